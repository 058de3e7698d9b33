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
    pub delivery_tag: u64,
    pub redelivered: bool,
    pub message: Arc<Message>,
}

/// Synchronous replies, one per request that has one (none when the request said `nowait`).
/// Exhaustive on purpose: the gateways and the wasm codec encode every reply.
#[derive(Clone, Debug, PartialEq)]
pub enum Reply {
    ChannelOpenOk,
    ChannelCloseOk,
    ExchangeDeclareOk,
    ExchangeDeleteOk,
    ExchangeBindOk,
    ExchangeUnbindOk,
    QueueDeclareOk {
        queue: Arc<str>,
        message_count: u32,
        consumer_count: u32,
    },
    QueueBindOk,
    QueueUnbindOk,
    QueuePurgeOk {
        message_count: u32,
    },
    QueueDeleteOk {
        message_count: u32,
    },
    QosOk,
    ConsumeOk {
        consumer_tag: Arc<str>,
    },
    CancelOk {
        consumer_tag: Arc<str>,
    },
    GetOk {
        delivery: Delivery,
        /// Messages left in the queue after this one.
        message_count: u32,
    },
    GetEmpty,
    RecoverOk,
    ConfirmSelectOk,
    TxSelectOk,
    TxCommitOk,
    TxRollbackOk,
}

/// Exhaustive on purpose: every host must handle every effect (a new one must fail its
/// build, not be dropped by a wildcard arm).
#[derive(Clone, Debug, PartialEq)]
pub enum Effect {
    Reply {
        ch: ChannelRef,
        reply: Reply,
    },
    /// A push delivery to a consumer (`basic.deliver`).
    Deliver {
        ch: ChannelRef,
        consumer_tag: Arc<str>,
        delivery: Delivery,
    },
    /// A mandatory message that reached no queue (`basic.return`).
    Return {
        ch: ChannelRef,
        reply_code: u16,
        reply_text: &'static str,
        message: Arc<Message>,
    },
    /// A publisher confirm (`basic.ack` / `basic.nack` from the server).
    Confirm {
        ch: ChannelRef,
        seq: u64,
        multiple: bool,
        ack: bool,
    },
    /// The server cancelled a consumer (its queue was deleted).
    ConsumerCancelled {
        ch: ChannelRef,
        consumer_tag: Arc<str>,
    },
    /// A channel exception: the core has already released the channel's state (consumers
    /// cancelled, unacked requeued). The host sends `channel.close` and later `Op::ChannelCloseOk`.
    ChannelError {
        ch: ChannelRef,
        error: ProtocolError,
    },
    /// The memory alarm is raised: the host stops reading from this connection once it has
    /// published (AMQP: `connection.blocked`), until `Unblocked`.
    Blocked {
        conn: ConnId,
    },
    /// The memory alarm cleared.
    Unblocked {
        conn: ConnId,
    },
    /// Flow control: stop reading from this connection (it publishes faster than a queue
    /// it feeds is consumed). Invisible to the client, like RabbitMQ's credit flow.
    FlowPaused {
        conn: ConnId,
    },
    /// Flow control: read from this connection again.
    FlowResumed {
        conn: ConnId,
    },
    /// A connection exception: the core has released the whole connection. The host sends
    /// `connection.close` and closes the socket.
    ConnectionError {
        conn: ConnId,
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
