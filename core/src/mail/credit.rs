//! The limits that span queues (a channel's global prefetch, its connection's write
//! window) as a queue's dispatch takes them (`queue::state::Credit`).
//!
//! A queue on the channel's own shard reads the channel and connection records directly
//! (`ChannelCredit`). A queue on another shard cannot: the channel gives it a
//! `SharedCredit` with its consume, one small record of atomics per channel opening that
//! consumes from another shard (so MQTT sessions and other same-shard consumers pay
//! nothing). While a channel has one, its counters live there, for its own shard's queues
//! too: a take is a compare-and-swap against the limit, a give-back a decrement, and
//! closing the channel clears `open`, so a racing owner's take fails and its delivery
//! stays in the queue.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

/// A counter that is plain until another shard must share it, then an atomic.
pub(crate) enum Counter {
    Local(u32),
    Shared(Arc<AtomicU32>),
}

impl Default for Counter {
    fn default() -> Counter {
        Counter::Local(0)
    }
}

impl Counter {
    pub(crate) fn get(&self) -> u32 {
        match self {
            Counter::Local(n) => *n,
            Counter::Shared(a) => a.load(Ordering::Acquire),
        }
    }

    /// Adds one if that keeps it within `limit` (0: no limit).
    pub(crate) fn take(&mut self, limit: u32) -> bool {
        match self {
            Counter::Shared(a) => take_atomic(a, limit),
            Counter::Local(n) => {
                if limit != 0 && *n >= limit {
                    return false;
                }
                *n = n.saturating_add(1);
                true
            }
        }
    }

    pub(crate) fn add(&mut self, by: u32) {
        match self {
            Counter::Shared(a) => {
                a.fetch_add(by, Ordering::AcqRel);
            }
            Counter::Local(n) => *n = n.saturating_add(by),
        }
    }

    /// Subtracts `by` (not below 0); returns the value before.
    pub(crate) fn sub(&mut self, by: u32) -> u32 {
        match self {
            Counter::Shared(a) => sub_atomic(a, by),
            Counter::Local(n) => {
                let before = *n;
                *n = n.saturating_sub(by);
                before
            }
        }
    }

    /// The shared form of this counter (made now, with its current value, if it was
    /// plain).
    pub(crate) fn share(&mut self) -> Arc<AtomicU32> {
        if let Counter::Shared(a) = self {
            return a.clone();
        }
        let a = Arc::new(AtomicU32::new(self.get()));
        *self = Counter::Shared(a.clone());
        a
    }
}

fn take_atomic(a: &AtomicU32, limit: u32) -> bool {
    a.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
        (limit == 0 || n < limit).then(|| n.saturating_add(1))
    })
    .is_ok()
}

fn sub_atomic(a: &AtomicU32, by: u32) -> u32 {
    match a.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
        Some(n.saturating_sub(by))
    }) {
        Ok(before) | Err(before) => before,
    }
}

/// One channel opening's limits, shared with the queues on other shards it consumes from.
pub(crate) struct SharedCredit {
    /// The opening is open: cleared when it closes (or fails), so no owner takes credit
    /// for it any more.
    pub(crate) open: AtomicBool,
    /// basic.qos global: 0 = none.
    pub(crate) global_prefetch: AtomicU32,
    /// `ChannelState`'s consumer deliveries awaiting an ack.
    pub(crate) consumer_unacked: Arc<AtomicU32>,
    /// The connection's deliveries handed to the host and not written (`Conn`).
    pub(crate) in_flight: Arc<AtomicU32>,
    pub(crate) write_window: u32,
}

impl SharedCredit {
    pub(crate) fn may_deliver(&self, ack_required: bool) -> bool {
        if !self.open.load(Ordering::Acquire)
            || self.in_flight.load(Ordering::Acquire) >= self.write_window
        {
            return false;
        }
        let prefetch = self.global_prefetch.load(Ordering::Acquire);
        !ack_required || prefetch == 0 || self.consumer_unacked.load(Ordering::Acquire) < prefetch
    }

    pub(crate) fn take(&self, ack_required: bool) -> bool {
        if !self.open.load(Ordering::Acquire) || !take_atomic(&self.in_flight, self.write_window) {
            return false;
        }
        let prefetch = self.global_prefetch.load(Ordering::Acquire);
        if ack_required && !take_atomic(&self.consumer_unacked, prefetch) {
            sub_atomic(&self.in_flight, 1);
            return false;
        }
        true
    }

    pub(crate) fn give_back(&self, ack_required: bool) {
        if ack_required {
            sub_atomic(&self.consumer_unacked, 1);
        }
        sub_atomic(&self.in_flight, 1);
    }
}
