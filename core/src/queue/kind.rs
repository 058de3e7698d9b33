//! The queue-type seam (RabbitMQ's `rabbit_queue_type`): what a queue of any type does for
//! the rest of the broker, and what the channel side and topology may expect of it.
//!
//! A queue type is three things here:
//! - a [`QueueType`] (the `x-queue-type` value, in `crate::queue_type` with its
//!   capabilities: vocabulary the mail and topology use too), parsed once where a declare is decided
//!   ([`QueueType::from_arguments`]): a type Warren does not have is refused there with 406
//!   PRECONDITION_FAILED, never served as a classic queue;
//! - its [`Capabilities`]: the facts the channel side and topology may rely on without
//!   knowing the type (whether `basic.get` is allowed, whether an ack removes the message,
//!   whether the queue must be durable), looked up by type, never by `match` outside this
//!   module;
//! - its behaviour, [`QueueBehaviour`]: the operations the queue side calls on a queue's
//!   state when queue mail arrives (enqueue, dispatch, get, settle, consume, cancel, purge,
//!   expiry), implemented once for every type by `queue::state::QueueState`.
//!
//! The state of a queue of any type is one `queue::state::QueueState`: what every queue has
//! (name, consumers, arguments, limits, stats) and one `queue::variant::Variant`, the state
//! only its type has (a quorum queue's log, a stream's cursors; nothing for classic and
//! `mqtt-qos0` queues). A queue is of exactly one type by construction; the behaviour
//! matches on the variant where types differ (static dispatch: no vtable on the message
//! path).
//!
//! Adding a type: a [`QueueType`] with its name and capabilities, a `Variant` with its state,
//! and the arms of `QueueBehaviour` where it differs. The channel side and topology do not
//! change: they talk to queues by mail only (`crate::mail`), and what differs between types
//! is answered by the queue or read from its capabilities.

use crate::mail::delivery::{ConsumerId, Picked, QueueConsumer, Settle, Unacked};
use crate::message::{Message, QueuedMessage};
use crate::queue::state::{Credit, Enqueued, QueueIo};
pub use crate::queue_type::{Capabilities, QueueType};
use std::sync::Arc;

/// What the queue side does with one queue's state when queue mail arrives: the contract
/// every queue type keeps, so the channel side and topology never need its type.
///
/// What comes in and goes out: `QueueIo` carries the store, the clock and the limits in,
/// and what the shard must do elsewhere out (`QueueOut`: bytes held and released, a store
/// failure, a durable write to sync, dead letters). A queue never reaches outside its
/// state otherwise; its answers go back by mail, sent by the queue side.
///
/// Consumers: the queue holds its consumers with their own credit (prefetch, unacked
/// count); the limits that span queues (a channel's global prefetch, its connection's
/// write window) are asked of `Credit`, taken only for a delivery that happens.
pub(crate) trait QueueBehaviour {
    /// Its type.
    fn kind(&self) -> QueueType;

    /// A routed message arrives. `Enqueued::Durable` promises that the message is in the
    /// store and covered by the next sync (its confirm waits for it); `Failed` and
    /// `Rejected` mean it is not in the queue (the publisher gets a nack).
    fn enqueue(&mut self, io: &mut QueueIo<'_>, message: &Arc<Message>) -> Enqueued;

    /// The next delivery to a consumer with credit, if any: the consumer's credit and, by
    /// `Credit::take`, the channel's are taken for it. A delivery without ack is settled
    /// for the queue by being picked. With `may_expire`, expired messages go first.
    fn next_delivery(
        &mut self,
        io: &mut QueueIo<'_>,
        credit: &mut impl Credit,
        may_expire: bool,
    ) -> Option<Picked>;

    /// `basic.get` (only if the type's capabilities allow it): the next ready message and
    /// how many stay ready; without `no_ack` the message awaits its settle as a delivery.
    fn get(
        &mut self,
        io: &mut QueueIo<'_>,
        no_ack: bool,
        may_expire: bool,
    ) -> Option<(QueuedMessage, u32)>;

    /// A delivery of this queue was settled on its channel (in delivery order per
    /// channel). `Ack` ends it (removing the message if the type's acks remove);
    /// `Requeue` makes it ready again where requeues go; `Discard` drops or dead-letters
    /// it. Returns whether a message became ready (dispatch may be due).
    fn settle(&mut self, io: &mut QueueIo<'_>, u: Unacked, settle: Settle) -> bool;

    /// Whether a new consumer (exclusive or not) is refused because the queue is in
    /// exclusive use (403 ACCESS_REFUSED for the channel).
    fn in_exclusive_use(&self, exclusive: bool) -> bool;

    /// A consumer starts (its id is greater than every earlier consumer's).
    fn add_consumer(&mut self, now: u64, c: QueueConsumer);

    /// A consumer goes; its unacked deliveries stay on their channel until settled.
    fn remove_consumer(&mut self, now: u64, id: ConsumerId) -> Option<QueueConsumer>;

    /// Empties the ready messages; returns how many there were (deliveries awaiting a
    /// settle stay).
    fn purge(&mut self, io: &mut QueueIo<'_>) -> u64;

    /// Dead-letters or drops the messages whose deadline passed (at the head: O(1) per
    /// message).
    fn expire_head(&mut self, io: &mut QueueIo<'_>);
}
