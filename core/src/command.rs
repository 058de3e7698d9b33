//! What hosts tell the core: one [`Op`] on one channel, with the current time.

use crate::message::{FieldTable, Properties};
use bytes::Bytes;
use std::sync::Arc;

pub use crate::exchange::ExchangeKind;

#[derive(Clone, Debug, PartialEq)]
pub struct ExchangeDeclare {
    pub exchange: String,
    /// The AMQP type name; validated by the core (unknown -> 503 COMMAND_INVALID).
    pub kind: String,
    pub passive: bool,
    pub durable: bool,
    pub auto_delete: bool,
    pub internal: bool,
    pub nowait: bool,
    pub arguments: FieldTable,
}

#[derive(Clone, Debug, PartialEq)]
pub struct QueueDeclare {
    /// Empty: the server names the queue `amq.gen-...`.
    pub queue: String,
    pub passive: bool,
    pub durable: bool,
    pub exclusive: bool,
    pub auto_delete: bool,
    pub nowait: bool,
    pub arguments: FieldTable,
}

/// A binding between an exchange (`source`) and a queue or exchange (`destination`).
#[derive(Clone, Debug, PartialEq)]
pub struct Bind {
    pub destination: String,
    pub source: String,
    pub routing_key: String,
    pub nowait: bool,
    pub arguments: FieldTable,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Consume {
    pub queue: String,
    /// Empty: the server generates `amq.ctag-...`.
    pub consumer_tag: String,
    pub no_local: bool,
    pub no_ack: bool,
    pub exclusive: bool,
    pub nowait: bool,
    pub arguments: FieldTable,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Publish {
    pub exchange: Arc<str>,
    pub routing_key: Arc<str>,
    pub mandatory: bool,
    pub immediate: bool,
    pub properties: Properties,
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
        vhost: String,
        user: String,
        cancel_notify: bool,
    },
    /// The connection is gone: its channels close, exclusive queues are deleted.
    ConnectionClose,
    ChannelOpen,
    /// Client-initiated close; the core answers `Reply::ChannelCloseOk`.
    ChannelClose,
    /// The host's acknowledgement of `channel.close-ok` after a channel error: the channel
    /// number may be reused from now on.
    ChannelCloseOk,
    ExchangeDeclare(ExchangeDeclare),
    ExchangeDelete {
        exchange: String,
        if_unused: bool,
        nowait: bool,
    },
    ExchangeBind(Bind),
    ExchangeUnbind(Bind),
    QueueDeclare(QueueDeclare),
    QueueBind(Bind),
    QueueUnbind(Bind),
    QueuePurge {
        queue: String,
        nowait: bool,
    },
    QueueDelete {
        queue: String,
        if_unused: bool,
        if_empty: bool,
        nowait: bool,
    },
    Qos {
        prefetch_size: u32,
        prefetch_count: u16,
        global: bool,
    },
    Consume(Consume),
    Cancel {
        consumer_tag: String,
        nowait: bool,
    },
    Get {
        queue: String,
        no_ack: bool,
    },
    /// Boxed: the properties make a publish ~370 bytes, and every other op (acks above all)
    /// would pay that size in the op batches.
    Publish(Box<Publish>),
    Ack {
        delivery_tag: u64,
        multiple: bool,
    },
    Nack {
        delivery_tag: u64,
        multiple: bool,
        requeue: bool,
    },
    Reject {
        delivery_tag: u64,
        requeue: bool,
    },
    Recover {
        requeue: bool,
    },
    ConfirmSelect {
        nowait: bool,
    },
    TxSelect,
    TxCommit,
    TxRollback,
    /// The host wrote `count` deliveries of this connection to its socket: they no longer
    /// occupy the connection's write window (see `BrokerConfig::write_window`).
    Written {
        count: u32,
    },
}

/// The kind of an [`Op`], carried by errors so a gateway can name the failing method
/// (AMQP's class-id and method-id in `channel.close`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OpKind {
    ConnectionOpen,
    ConnectionClose,
    ChannelOpen,
    ChannelClose,
    ChannelCloseOk,
    ExchangeDeclare,
    ExchangeDelete,
    ExchangeBind,
    ExchangeUnbind,
    QueueDeclare,
    QueueBind,
    QueueUnbind,
    QueuePurge,
    QueueDelete,
    Qos,
    Consume,
    Cancel,
    Get,
    Publish,
    Ack,
    Nack,
    Reject,
    Recover,
    ConfirmSelect,
    TxSelect,
    TxCommit,
    TxRollback,
    Written,
}

impl Op {
    pub fn kind(&self) -> OpKind {
        match self {
            Op::ConnectionOpen { .. } => OpKind::ConnectionOpen,
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
        }
    }
}
