//! The vocabulary of scheduled (delayed) messages between the core and its store
//! (docs/delayed.md): what a store keeps for each one, and what it reports at start.
//!
//! A store keeps every scheduled message it is given, ordered by [`ScheduleKey`] (due time,
//! then id), and reads them back in that order from any key on ([`super::Store::schedule_read`]):
//! the core holds only a window of the earliest-due ones in memory and pages the rest in as
//! the window drains, so memory does not grow with what is scheduled.

use crate::message::Message;
use std::sync::Arc;

/// Where a scheduled message stands: its due time (the core's clock, milliseconds since the
/// Unix epoch natively) and an id unique in its shard that only grows (so messages due in
/// the same millisecond go in the order they were scheduled). Ordered by due time, then id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ScheduleKey {
    /// When it is due.
    pub due: u64,
    /// Unique in its shard, growing.
    pub id: u64,
}

/// A scheduled message as stored: its key, the exchange it is routed through when due (by
/// name, so it means the same after a restart), the message, and whether it survives one.
#[derive(Clone, Debug)]
pub struct ScheduledMessage {
    /// Its key.
    pub key: ScheduleKey,
    /// The vhost of its exchange.
    pub vhost: Arc<str>,
    /// The exchange it is routed through when due.
    pub exchange: Arc<str>,
    /// The message (as routed when due: the `x-delay` header already negated).
    pub message: Arc<Message>,
    /// It survives a restart: persistent, scheduled on a durable exchange. A store may page
    /// the others to disk too but drops them when it opens.
    pub durable: bool,
}

/// What a store holds of the schedule when the core opens it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ScheduleRecovery {
    /// Above every stored id: the next id to issue.
    pub next_id: u64,
    /// Stored messages per (vhost, exchange), in name order.
    pub counts: Vec<(String, String, u64)>,
}
