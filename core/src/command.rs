//! What hosts tell the core: one [`Op`] on one channel, with the current time.

use crate::message::{FieldTable, Properties};
use bytes::Bytes;
use std::sync::Arc;

pub use crate::exchange::ExchangeKind;

/// `exchange.declare`'s fields.
#[derive(Clone, Debug, PartialEq)]
pub struct ExchangeDeclare {
    /// The exchange, by name (`""`: the default exchange).
    pub exchange: String,
    /// The AMQP type name; validated by the core (unknown -> 503 COMMAND_INVALID).
    pub kind: String,
    /// Only check that it exists (404 otherwise).
    pub passive: bool,
    /// It survives a restart.
    pub durable: bool,
    /// It is deleted once its last consumer (queue) or binding (exchange) goes.
    pub auto_delete: bool,
    /// Clients may not publish to it directly.
    pub internal: bool,
    /// No reply is wanted (`no-wait`).
    pub nowait: bool,
    /// Its arguments (`x-...`).
    pub arguments: FieldTable,
}

/// `queue.declare`'s fields.
#[derive(Clone, Debug, PartialEq)]
pub struct QueueDeclare {
    /// Empty: the server names the queue `amq.gen-...`.
    pub queue: String,
    /// Only check that it exists (404 otherwise).
    pub passive: bool,
    /// It survives a restart.
    pub durable: bool,
    /// Only the declaring connection may use the queue.
    pub exclusive: bool,
    /// It is deleted once its last consumer (queue) or binding (exchange) goes.
    pub auto_delete: bool,
    /// No reply is wanted (`no-wait`).
    pub nowait: bool,
    /// Its arguments (`x-...`).
    pub arguments: FieldTable,
}

/// A binding between an exchange (`source`) and a queue or exchange (`destination`).
#[derive(Clone, Debug, PartialEq)]
pub struct Bind {
    /// The queue or exchange bound.
    pub destination: String,
    /// The exchange bound from.
    pub source: String,
    /// The routing key.
    pub routing_key: String,
    /// No reply is wanted (`no-wait`).
    pub nowait: bool,
    /// Its arguments (`x-...`).
    pub arguments: FieldTable,
}

/// `basic.consume`'s fields.
#[derive(Clone, Debug, PartialEq)]
pub struct Consume {
    /// The queue, by name (`""`: the channel's last declared queue).
    pub queue: String,
    /// Empty: the server generates `amq.ctag-...`.
    pub consumer_tag: String,
    /// Do not deliver this connection's own publishes (accepted, as RabbitMQ, and not enforced).
    pub no_local: bool,
    /// Deliveries need no ack.
    pub no_ack: bool,
    /// No other consumer may consume from the queue.
    pub exclusive: bool,
    /// No reply is wanted (`no-wait`).
    pub nowait: bool,
    /// Its arguments (`x-...`).
    pub arguments: FieldTable,
}

/// `basic.publish`'s fields, and a host's routing of it.
#[derive(Clone, Debug, PartialEq)]
pub struct Publish {
    /// The exchange, by name (`""`: the default exchange).
    pub exchange: Arc<str>,
    /// The routing key.
    pub routing_key: Arc<str>,
    /// Return the message if it reaches no queue.
    pub mandatory: bool,
    /// Deliver at once or return: RabbitMQ dropped it; refused with 540 NOT_IMPLEMENTED.
    pub immediate: bool,
    /// Its basic properties.
    pub properties: Properties,
    /// Its body.
    pub body: Bytes,
    /// Routed by the host against a snapshot of the routing table (`routing.rs`), so the
    /// broker need not route it. The broker uses it only if the snapshot saw every routing
    /// change of the publishing connection, and drops queues deleted since.
    pub routed: Option<crate::routing::Routed>,
}

/// One operation on one channel. Connection-level operations use channel 0.
/// Exhaustive on purpose: hosts' codecs (the wasm guest's) and gateways match every op,
/// and a new one must fail their build, not fall into a wildcard arm.
#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    /// A client connected and authenticated. `cancel_notify`: the client understands
    /// server-sent consumer cancellation (AMQP capability `consumer_cancel_notify`).
    ConnectionOpen {
        /// The vhost.
        vhost: String,
        /// The user.
        user: String,
        /// The client understands a server's `basic.cancel` (`consumer_cancel_notify`).
        cancel_notify: bool,
    },
    /// The connection's client identifier (MQTT's), sent after `ConnectionOpen`: it expands
    /// `{client_id}` in the user's topic permissions, as RabbitMQ's MQTT plugin does.
    ClientId(String),
    /// The connection is gone: its channels close, exclusive queues are deleted.
    ConnectionClose,
    /// `channel.open`.
    ChannelOpen,
    /// Client-initiated close; the core answers `Reply::ChannelCloseOk`.
    ChannelClose,
    /// The host's acknowledgement of `channel.close-ok` after a channel error: the channel
    /// number may be reused from now on.
    ChannelCloseOk,
    /// `exchange.declare`.
    ExchangeDeclare(ExchangeDeclare),
    /// `exchange.delete`.
    ExchangeDelete {
        /// The exchange, by name (`""`: the default exchange).
        exchange: String,
        /// Only if it has no consumers (queue) or bindings (exchange).
        if_unused: bool,
        /// No reply is wanted (`no-wait`).
        nowait: bool,
    },
    /// `exchange.bind`.
    ExchangeBind(Bind),
    /// `exchange.unbind`.
    ExchangeUnbind(Bind),
    /// `queue.declare`.
    QueueDeclare(QueueDeclare),
    /// `queue.bind`.
    QueueBind(Bind),
    /// `queue.unbind`.
    QueueUnbind(Bind),
    /// `queue.purge`.
    QueuePurge {
        /// The queue, by name (`""`: the channel's last declared queue).
        queue: String,
        /// No reply is wanted (`no-wait`).
        nowait: bool,
    },
    /// `queue.delete`.
    QueueDelete {
        /// The queue, by name (`""`: the channel's last declared queue).
        queue: String,
        /// Only if it has no consumers (queue) or bindings (exchange).
        if_unused: bool,
        /// Only if it has no ready messages.
        if_empty: bool,
        /// No reply is wanted (`no-wait`).
        nowait: bool,
    },
    /// `basic.qos`.
    Qos {
        /// Prefetch in bytes (0: none; others are refused as by RabbitMQ).
        prefetch_size: u32,
        /// Unacked deliveries at most (0: no limit).
        prefetch_count: u16,
        /// Shared by all the channel's consumers (RabbitMQ's meaning), or per consumer.
        global: bool,
    },
    /// `basic.consume`.
    Consume(Consume),
    /// `basic.cancel`.
    Cancel {
        /// The consumer tag.
        consumer_tag: String,
        /// No reply is wanted (`no-wait`).
        nowait: bool,
    },
    /// `basic.get`.
    Get {
        /// The queue, by name (`""`: the channel's last declared queue).
        queue: String,
        /// Deliveries need no ack.
        no_ack: bool,
    },
    /// Boxed: the properties make a publish ~370 bytes, and every other op (acks above all)
    /// would pay that size in the op batches.
    Publish(Box<Publish>),
    /// `basic.ack`.
    Ack {
        /// The delivery tag.
        delivery_tag: u64,
        /// Also every earlier delivery tag on the channel.
        multiple: bool,
    },
    /// `basic.nack`.
    Nack {
        /// The delivery tag.
        delivery_tag: u64,
        /// Also every earlier delivery tag on the channel.
        multiple: bool,
        /// Requeue rather than discard (or dead-letter).
        requeue: bool,
    },
    /// `basic.reject`.
    Reject {
        /// The delivery tag.
        delivery_tag: u64,
        /// Requeue rather than discard (or dead-letter).
        requeue: bool,
    },
    /// `basic.recover`.
    Recover {
        /// Requeue rather than discard (or dead-letter).
        requeue: bool,
    },
    /// `confirm.select`.
    ConfirmSelect {
        /// No reply is wanted (`no-wait`).
        nowait: bool,
    },
    /// `tx.select`.
    TxSelect,
    /// `tx.commit`.
    TxCommit,
    /// `tx.rollback`.
    TxRollback,
    /// The host wrote `count` deliveries of this connection to its socket: they no longer
    /// occupy the connection's write window (see `BrokerConfig::write_window`).
    Written {
        /// How many deliveries the host wrote to the socket.
        count: u32,
    },
    /// MQTT: `message` becomes the retained message of its topic in the connection's vhost
    /// (an empty payload clears the topic), for later `RetainedGet`s; the publish itself is
    /// a separate `Publish`. Needs write access to `amq.topic`; answered by
    /// `Reply::RetainOk`. Topology keeps retained messages, bounded per vhost
    /// (`BrokerConfig::max_retained_messages`, `max_retained_bytes`), and with `durable`
    /// stores them (the broker's own `$SYS` topics are not durable).
    Retain {
        /// The message (its `stored_at` is replaced by the op's time).
        message: Box<crate::mqtt::RetainedMessage>,
        /// Kept across restarts.
        durable: bool,
    },
    /// MQTT: the retained messages of the connection's vhost whose topics `filter` (a plain
    /// MQTT filter, no `$share/`) matches, unexpired, in topic order, at most `max`. Needs
    /// read access to `amq.topic`; answered by `Reply::Retained`.
    RetainedGet {
        /// The filter.
        filter: String,
        /// Messages at most.
        max: u32,
    },
    /// The host refuses the channel's next request with this channel error, in request
    /// order (after what the channel sent before it is answered): a clustered host whose
    /// metadata change could not be committed within its bound (docs/cluster.md).
    Refuse(crate::error::ProtocolError),
}

pub use crate::op_kind::OpKind;

impl Op {
    /// Its type name (`direct`, `fanout`, `topic`, `headers`, or a plugin's).
    pub fn kind(&self) -> OpKind {
        match self {
            Op::ConnectionOpen { .. } => OpKind::ConnectionOpen,
            Op::ClientId(_) => OpKind::ConnectionOpen,
            Op::ConnectionClose => OpKind::ConnectionClose,
            Op::ChannelOpen => OpKind::ChannelOpen,
            Op::ChannelClose => OpKind::ChannelClose,
            Op::ChannelCloseOk => OpKind::ChannelCloseOk,
            Op::ExchangeDeclare(_) => OpKind::ExchangeDeclare,
            Op::ExchangeDelete { .. } => OpKind::ExchangeDelete,
            Op::ExchangeBind(_) => OpKind::ExchangeBind,
            Op::ExchangeUnbind(_) => OpKind::ExchangeUnbind,
            Op::QueueDeclare(_) => OpKind::QueueDeclare,
            Op::QueueBind(_) => OpKind::QueueBind,
            Op::QueueUnbind(_) => OpKind::QueueUnbind,
            Op::QueuePurge { .. } => OpKind::QueuePurge,
            Op::QueueDelete { .. } => OpKind::QueueDelete,
            Op::Qos { .. } => OpKind::Qos,
            Op::Consume(_) => OpKind::Consume,
            Op::Cancel { .. } => OpKind::Cancel,
            Op::Get { .. } => OpKind::Get,
            Op::Publish(_) => OpKind::Publish,
            Op::Ack { .. } => OpKind::Ack,
            Op::Nack { .. } => OpKind::Nack,
            Op::Reject { .. } => OpKind::Reject,
            Op::Recover { .. } => OpKind::Recover,
            Op::ConfirmSelect { .. } => OpKind::ConfirmSelect,
            Op::TxSelect => OpKind::TxSelect,
            Op::TxCommit => OpKind::TxCommit,
            Op::TxRollback => OpKind::TxRollback,
            Op::Written { .. } => OpKind::Written,
            Op::Retain { .. } => OpKind::Retain,
            Op::RetainedGet { .. } => OpKind::RetainedGet,
            Op::Refuse(e) => e.op,
        }
    }
}
