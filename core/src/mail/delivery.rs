//! What the queue side and the channel side say to each other about deliveries: consumer
//! ids, the consumer record a channel hands its queue, a delivery picked by a queue, the
//! deliveries a channel holds unacked and how they are settled. Both sides import these;
//! neither side's state is here.

use crate::ids::{ChannelAddr, ChannelRef, QueueId};
use crate::mail::credit::SharedCredit;
use crate::message::{Message, QueuedMessage};
use std::sync::Arc;

/// A consumer, numbered broker-wide so channels and deliveries can refer to it cheaply.
/// Ids only grow, so a queue's consumers in arrival order are also in id order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct ConsumerId(pub(crate) u64);

/// A consumer as its queue holds it.
pub(crate) struct QueueConsumer {
    pub(crate) id: ConsumerId,
    pub(crate) tag: Arc<str>,
    pub(crate) ch: ChannelRef,
    /// The opening of `ch` that consumes (`ChannelAddr`): a consumer whose channel closed
    /// may stay here until its cancel arrives, and must not take a newer opening's credit.
    pub(crate) serial: u32,
    pub(crate) no_ack: bool,
    pub(crate) exclusive: bool,
    /// Its channel had a global prefetch (basic.qos global) when it consumed: a quorum
    /// queue refuses such a consumer, as RabbitMQ's do.
    pub(crate) global_qos: bool,
    /// Per-consumer prefetch (basic.qos global=false at consume time); 0 = unlimited.
    pub(crate) prefetch: u16,
    pub(crate) unacked: u32,
    /// A stream queue's consumer that reached its prefetch, held until a quarter of it is
    /// free again (`queue::stream::Room`); other queue types never set it.
    pub(crate) refilling: bool,
    /// `x-priority`: consumers with a higher priority get messages first. Stored in 32
    /// bits (a wider client value is clamped) so that the serial fits in the record.
    pub(crate) priority: i32,
    /// The channel's limits, when the channel is on another shard (`mail/credit.rs`).
    pub(crate) shared: Option<Arc<SharedCredit>>,
}

impl QueueConsumer {
    pub(crate) fn addr(&self) -> ChannelAddr {
        ChannelAddr {
            ch: self.ch,
            serial: self.serial,
        }
    }
}

/// What to do with settled deliveries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Settle {
    Ack,
    Requeue,
    /// Rejected without requeue: dropped, or dead-lettered if the queue says so.
    Discard,
}

impl Settle {
    pub(crate) fn reject(requeue: bool) -> Settle {
        if requeue {
            Settle::Requeue
        } else {
            Settle::Discard
        }
    }
}

/// The epoch (`QueuedMessage::epoch`) of a delivery that came from another node's queue is
/// this flag with that node's id (`nodes_consume.rs`): its settle goes to that node only while
/// the queue still lives there, and never matches a queue of this node, whose epochs stay
/// below it (`QueueState::reload`).
pub(crate) const FROM_NODE: u32 = 1 << 31;

/// A delivery awaiting its ack (held by the channel it went to).
pub(crate) struct Unacked {
    pub(crate) queue: QueueId,
    pub(crate) seq: u64,
    pub(crate) message: Arc<Message>,
    /// Set for consumer deliveries (they count against prefetch); `None` for basic.get.
    pub(crate) consumer: Option<ConsumerId>,
    /// The store holds it (remove it there when it is acked or dropped).
    pub(crate) stored: bool,
    /// Its expiry, kept across a requeue (as RabbitMQ does).
    pub(crate) expires_at: Option<u64>,
    /// Which serving of the queue delivered it (`QueuedMessage::epoch`).
    pub(crate) epoch: u32,
}

impl Unacked {
    /// Message `m` of queue `queue`, delivered to `consumer` (`None`: basic.get).
    pub(crate) fn of(queue: QueueId, m: &QueuedMessage, consumer: Option<ConsumerId>) -> Unacked {
        Unacked {
            queue,
            seq: m.seq,
            message: m.message.clone(),
            consumer,
            stored: m.stored,
            expires_at: m.expires_at,
            epoch: m.epoch,
        }
    }
}

/// A delivery picked by `next_delivery`: the message and who it goes to.
pub(crate) struct Picked {
    pub(crate) consumer: ConsumerId,
    pub(crate) to: ChannelAddr,
    pub(crate) tag: Arc<str>,
    pub(crate) no_ack: bool,
    pub(crate) message: QueuedMessage,
}
