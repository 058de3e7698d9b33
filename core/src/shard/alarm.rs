//! Resource alarms of the shard: the body bytes it holds (and, with shards, every shard's
//! sum), the host's measurements (RSS, free disk), a failed store write, and the blocking of
//! publishers they cause (with hysteresis and a minimum hold).

use super::*;
use crate::effect::Effect;
use crate::ids::ConnId;
use std::sync::Arc;

/// How long publishers stay blocked after the store failed a write, before the broker tries
/// again (the host logs the error; the core only knows that it happened).
pub(super) const STORE_RETRY_MS: u64 = 5_000;

/// How long publishers stay blocked at least once an alarm blocked them, even if the
/// resource recovers sooner: bounds alarm changes to about one per second whatever the
/// traffic (RabbitMQ checks its memory on a timer, with the same effect).
pub const ALARM_HOLD_MS: u64 = 1_000;

/// How often a shard whose memory alarm is raised by the shared count looks at it again.
pub(super) const ALARM_RECHECK_MS: u64 = 100;

/// What the host measured of the machine (`Broker::report_resources`); `None`: not measured.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Resources {
    /// Bytes the whole process holds (RSS).
    pub memory: Option<u64>,
    /// Free bytes on the disk of the data directory.
    pub disk_free: Option<u64>,
}

/// The resource alarms; publishers are blocked while any is raised.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Alarms {
    /// Memory is above the watermark (until it falls to 90% of it).
    pub memory: bool,
    /// Free disk space is below the limit (until it is 10% above it).
    pub disk: bool,
    /// A store write failed in the last `STORE_RETRY_MS`.
    pub store: bool,
}

impl Alarms {
    /// Whether any alarm is raised.
    pub fn any(self) -> bool {
        self.memory || self.disk || self.store
    }
}

impl Broker {
    /// Message memory is past half the alarm watermark (transient messages page out early).
    pub(super) fn memory_tight(&self) -> bool {
        self.memory_held() > self.config.memory_high_watermark / 2
    }

    /// Body bytes held, by this shard or, with a shared count, by every shard.
    pub(super) fn memory_held(&self) -> u64 {
        use std::sync::atomic::Ordering;
        self.shared_bytes
            .as_ref()
            .map_or(self.stored_bytes, |a| a.load(Ordering::Relaxed))
    }

    /// Makes the memory alarm count the body bytes of every shard: each shard given the
    /// same counter adds what it holds, and blocks its publishers when the sum passes the
    /// watermark. Call it before `restore`.
    pub fn share_memory_count(&mut self, count: Arc<std::sync::atomic::AtomicU64>) {
        use std::sync::atomic::Ordering;
        count.fetch_add(self.stored_bytes, Ordering::Relaxed);
        self.shared_bytes = Some(count);
    }

    /// Body bytes currently held (ready or unacked, once per queue).
    pub fn stored_bytes(&self) -> u64 {
        self.stored_bytes
    }

    /// A message body of `n` bytes entered a queue.
    pub(super) fn hold(&mut self, n: u64) {
        self.stored_bytes += n;
        if let Some(a) = &self.shared_bytes {
            a.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// A message body of `n` bytes left the broker's custody for one queue (acked, dropped,
    /// delivered without ack, purged, deleted).
    pub(super) fn release(&mut self, n: u64) {
        debug_assert!(self.stored_bytes >= n, "released more than held");
        let n = n.min(self.stored_bytes);
        self.stored_bytes -= n;
        if let Some(a) = &self.shared_bytes {
            // This shard added at least `n` of the sum.
            a.fetch_sub(n, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// Raises or clears the resource alarms after an op (or a report from the host), and
    /// tells every connection when publishers become blocked or unblocked.
    ///
    /// Each alarm has hysteresis: it is raised at its limit and cleared only clearly on the
    /// other side of it (memory: at 90% of the watermark; disk: 10% above the free-space
    /// limit). Without it a consumer draining a queue at the watermark flipped the alarm on
    /// every message (10,051 blocked/unblocked pairs in 10 s).
    pub(super) fn update_alarm(&mut self) {
        let store_failed = self
            .store_failed_at
            .is_some_and(|at| self.now < at.saturating_add(STORE_RETRY_MS));
        if !store_failed {
            self.store_failed_at = None;
        }
        let watermark = self.config.memory_high_watermark;
        let memory = self.memory_figure();
        self.alarms.memory = if self.alarms.memory {
            memory > watermark - watermark / 10
        } else {
            memory > watermark
        };
        let limit = self.config.disk_free_limit;
        self.alarms.disk = match self.resources.disk_free {
            Some(free) if limit > 0 => {
                if self.alarms.disk {
                    free < limit.saturating_add(limit / 10)
                } else {
                    free < limit
                }
            }
            _ => false,
        };
        self.alarms.store = store_failed;
        let over = self.alarms.any();
        if over == self.alarm {
            return;
        }
        if !over && self.now < self.alarm_changed_at.saturating_add(ALARM_HOLD_MS) {
            // Cleared too soon after blocking: publishers stay blocked until the hold
            // ends (`next_deadline` asks for a tick then).
            return;
        }
        self.alarm = over;
        self.alarm_changed_at = self.now;
        let mut conns: Vec<ConnId> = self.chans.conns.keys().copied().collect();
        conns.sort_unstable();
        for conn in conns {
            self.effects.push(if over {
                Effect::Blocked { conn }
            } else {
                Effect::Unblocked { conn }
            });
        }
    }

    /// The memory the alarm compares with the watermark: the body bytes the queues hold,
    /// or what the host measured the process to hold (its RSS), whichever is larger. With
    /// a store the queues hold little of their messages in memory, yet the process may
    /// hold much more (buffers, allocator slack): only the host can see that.
    pub(super) fn memory_figure(&self) -> u64 {
        self.memory_held().max(self.resources.memory.unwrap_or(0))
    }

    /// The host's latest measurements of the machine: the process's memory (RSS) and the
    /// free space on the data disk. The alarms are re-evaluated at once; the host then
    /// polls the effects (`Blocked` / `Unblocked`).
    pub fn report_resources(&mut self, now: u64, resources: Resources) {
        self.now = self.now.max(now);
        self.resources = resources;
        self.update_alarm();
    }

    /// The resource alarms raised now (hosts log their changes).
    pub fn alarms(&self) -> Alarms {
        self.alarms
    }

    /// Publishers are blocked: an alarm is raised, or one was within `ALARM_HOLD_MS`.
    pub fn publishers_blocked(&self) -> bool {
        self.alarm
    }
}
