//! What the core tells hosts. Effects for one channel come out in the order the protocol needs
//! (a `basic.return` before the confirm of the same message, a reply after the deliveries that
//! preceded it).

use crate::error::ProtocolError;
use crate::ids::{ChannelRef, ConnId};
use crate::message::Message;
use std::sync::Arc;

/// A message handed to a consumer or to `basic.get`.
#[derive(Clone, Debug, PartialEq)]
pub struct Delivery {
    /// The delivery tag.
    pub delivery_tag: u64,
    /// It was delivered before.
    pub redelivered: bool,
    /// The message.
    pub message: Arc<Message>,
}

/// Synchronous replies, one per request that has one (none when the request said `nowait`).
/// Exhaustive on purpose: the gateways and the wasm codec encode every reply.
#[derive(Clone, Debug, PartialEq)]
pub enum Reply {
    /// `channel.open-ok`.
    ChannelOpenOk,
    /// `channel.close-ok`.
    ChannelCloseOk,
    /// `exchange.declare-ok`.
    ExchangeDeclareOk,
    /// `exchange.delete-ok`.
    ExchangeDeleteOk,
    /// `exchange.bind-ok`.
    ExchangeBindOk,
    /// `exchange.unbind-ok`.
    ExchangeUnbindOk,
    /// `queue.declare-ok`.
    QueueDeclareOk {
        /// The queue's name.
        queue: Arc<str>,
        /// Messages in the queue.
        message_count: u32,
        /// Consumers of the queue.
        consumer_count: u32,
    },
    /// `queue.bind-ok`.
    QueueBindOk,
    /// `queue.unbind-ok`.
    QueueUnbindOk,
    /// `queue.purge-ok`.
    QueuePurgeOk {
        /// Messages purged.
        message_count: u32,
    },
    /// `queue.delete-ok`.
    QueueDeleteOk {
        /// Messages the queue held.
        message_count: u32,
    },
    /// `basic.qos-ok`.
    QosOk,
    /// `basic.consume-ok`.
    ConsumeOk {
        /// The consumer tag.
        consumer_tag: Arc<str>,
    },
    /// `basic.cancel-ok`.
    CancelOk {
        /// The consumer tag.
        consumer_tag: Arc<str>,
    },
    /// `basic.get-ok`.
    GetOk {
        /// The delivery.
        delivery: Delivery,
        /// Messages left in the queue after this one.
        message_count: u32,
    },
    /// `basic.get-empty`.
    GetEmpty,
    /// `basic.recover-ok`.
    RecoverOk,
    /// `confirm.select-ok`.
    ConfirmSelectOk,
    /// `tx.select-ok`.
    TxSelectOk,
    /// `tx.commit-ok`.
    TxCommitOk,
    /// `tx.rollback-ok`.
    TxRollbackOk,
    /// `Op::Retain` is done: `stored` false when the vhost's bound refused it (the host
    /// says so in its log; the publish is routed all the same).
    RetainOk {
        /// The message is now its topic's (or the topic was cleared).
        stored: bool,
    },
    /// `Op::RetainedGet`'s messages.
    Retained {
        /// In topic order.
        messages: Vec<crate::mqtt::RetainedMessage>,
    },
}

/// Exhaustive on purpose: every host must handle every effect (a new one must fail its
/// build, not be dropped by a wildcard arm).
#[derive(Clone, Debug, PartialEq)]
pub enum Effect {
    /// A reply to the channel.
    Reply {
        /// The channel.
        ch: ChannelRef,
        /// The reply.
        reply: Reply,
    },
    /// A push delivery to a consumer (`basic.deliver`).
    Deliver {
        /// The channel.
        ch: ChannelRef,
        /// The consumer tag.
        consumer_tag: Arc<str>,
        /// The delivery.
        delivery: Delivery,
    },
    /// A mandatory message that reached no queue (`basic.return`).
    Return {
        /// The channel.
        ch: ChannelRef,
        /// The AMQP reply code.
        reply_code: u16,
        /// Why.
        reply_text: &'static str,
        /// The message.
        message: Arc<Message>,
    },
    /// A publisher confirm (`basic.ack` / `basic.nack` from the server).
    Confirm {
        /// The channel.
        ch: ChannelRef,
        /// The publish sequence number (confirm mode).
        seq: u64,
        /// Also every earlier delivery tag on the channel.
        multiple: bool,
        /// Confirmed (ack), or nacked.
        ack: bool,
    },
    /// The server cancelled a consumer (its queue was deleted).
    ConsumerCancelled {
        /// The channel.
        ch: ChannelRef,
        /// The consumer tag.
        consumer_tag: Arc<str>,
    },
    /// A channel exception: the core has already released the channel's state (consumers
    /// cancelled, unacked requeued). The host sends `channel.close` and later `Op::ChannelCloseOk`.
    ChannelError {
        /// The channel.
        ch: ChannelRef,
        /// The error.
        error: ProtocolError,
    },
    /// The memory alarm is raised: the host stops reading from this connection once it has
    /// published (AMQP: `connection.blocked`), until `Unblocked`.
    Blocked {
        /// The connection.
        conn: ConnId,
    },
    /// The memory alarm cleared.
    Unblocked {
        /// The connection.
        conn: ConnId,
    },
    /// Flow control: stop reading from this connection (it publishes faster than a queue
    /// it feeds is consumed). Invisible to the client, like RabbitMQ's credit flow.
    FlowPaused {
        /// The connection.
        conn: ConnId,
    },
    /// Flow control: read from this connection again.
    FlowResumed {
        /// The connection.
        conn: ConnId,
    },
    /// A connection exception: the core has released the whole connection. The host sends
    /// `connection.close` and closes the socket.
    ConnectionError {
        /// The connection.
        conn: ConnId,
        /// The error.
        error: ProtocolError,
    },
}

impl Effect {
    /// The connection this effect is addressed to.
    pub fn conn(&self) -> ConnId {
        match self {
            Effect::Reply { ch, .. }
            | Effect::Deliver { ch, .. }
            | Effect::Return { ch, .. }
            | Effect::Confirm { ch, .. }
            | Effect::ConsumerCancelled { ch, .. }
            | Effect::ChannelError { ch, .. } => ch.conn,
            Effect::ConnectionError { conn, .. }
            | Effect::Blocked { conn }
            | Effect::Unblocked { conn }
            | Effect::FlowPaused { conn }
            | Effect::FlowResumed { conn } => *conn,
        }
    }
}
