//! One shard's schedule of delayed messages (docs/delayed.md): which are due when, in
//! memory only as a window of the earliest-due ones, the rest in the store.
//!
//! Deterministic and clock-free: the caller says what time it is. Messages leave in
//! [`ScheduleKey`] order (due time, then the order they were scheduled in), whatever
//! order they arrived in and however the window was paged.
//!
//! The window's invariant: with `paged_after = Some(k)` every scheduled message with a key
//! up to `k` is in the window and the store holds the others; with `None` the window holds
//! them all. A message scheduled above `k` goes to the store only; one below it goes to the
//! window, which, over its cap, drops its latest entry back to the store's custody (every
//! entry is written to the store first) and lowers `k`. When the window drains below half
//! its cap the caller reads the next keys above `k` from the store (`refill`).

use crate::store::{ScheduleKey, ScheduleRecovery, ScheduledMessage};
use std::collections::BTreeMap;
use std::sync::Arc;

/// The lowest key: a window "paged after" it holds nothing yet (after a restore).
const KEY_MIN: ScheduleKey = ScheduleKey { due: 0, id: 0 };

/// (vhost, exchange) by name: what a scheduled message is routed through when due.
pub(crate) type ExchangeName = (Arc<str>, Arc<str>);

/// What the window holds at most (by count, and by body bytes) when a store pages the rest.
/// 64 Ki entries of 100 B are ~15 MB with their keys and names; the byte cap bounds bigger
/// messages.
pub(crate) const WINDOW_ENTRIES: usize = 65_536;
pub(crate) const WINDOW_BYTES: u64 = 32 << 20;

/// See the module docs.
#[derive(Debug)]
pub(crate) struct Schedule {
    window: BTreeMap<ScheduleKey, ScheduledMessage>,
    window_bytes: u64,
    /// Entries and body bytes the window holds at most; `usize::MAX`/`u64::MAX` without a
    /// store (nothing to page to: the broker bounds the total instead).
    cap: usize,
    cap_bytes: u64,
    paged_after: Option<ScheduleKey>,
    /// Scheduled messages per exchange (window and store).
    counts: BTreeMap<ExchangeName, u64>,
    total: u64,
    next_id: u64,
}

impl Default for Schedule {
    fn default() -> Schedule {
        Schedule::new(usize::MAX, u64::MAX)
    }
}

impl Schedule {
    /// An empty schedule whose window holds at most `cap` entries and `cap_bytes` body bytes.
    pub(crate) fn new(cap: usize, cap_bytes: u64) -> Schedule {
        Schedule {
            window: BTreeMap::new(),
            window_bytes: 0,
            cap: cap.max(1),
            cap_bytes,
            paged_after: None,
            counts: BTreeMap::new(),
            total: 0,
            next_id: 1,
        }
    }

    /// A schedule over what a store already holds: nothing in memory, everything paged.
    pub(crate) fn recovered(cap: usize, cap_bytes: u64, rec: ScheduleRecovery) -> Schedule {
        let mut s = Schedule::new(cap, cap_bytes);
        s.next_id = rec.next_id.max(1);
        for (vhost, exchange, n) in rec.counts {
            if n > 0 {
                s.total += n;
                *s.counts
                    .entry((Arc::from(vhost), Arc::from(exchange)))
                    .or_default() += n;
            }
        }
        if s.total > 0 {
            s.paged_after = Some(KEY_MIN);
        }
        s
    }

    /// The key for a message due at `due`: ids only grow.
    pub(crate) fn key(&mut self, due: u64) -> ScheduleKey {
        let id = self.next_id;
        self.next_id += 1;
        ScheduleKey { due, id }
    }

    /// Scheduled messages, in memory and in the store.
    pub(crate) fn len(&self) -> u64 {
        self.total
    }

    /// How many exchange `x` has scheduled.
    pub(crate) fn count(&self, x: &ExchangeName) -> u64 {
        self.counts.get(x).copied().unwrap_or(0)
    }

    /// Entries in memory.
    pub(crate) fn in_window(&self) -> usize {
        self.window.len()
    }

    /// Adds `m` (already in the store, when there is one). False when it went to the
    /// store's custody only (it is due after the window).
    pub(crate) fn insert(&mut self, m: ScheduledMessage) -> bool {
        self.total += 1;
        *self
            .counts
            .entry((m.vhost.clone(), m.exchange.clone()))
            .or_default() += 1;
        if self.paged_after.is_some_and(|k| m.key > k) {
            return false;
        }
        self.window_bytes += m.message.body_len() as u64;
        self.window.insert(m.key, m);
        while self.window.len() > 1
            && (self.window.len() > self.cap || self.window_bytes > self.cap_bytes)
        {
            if let Some((_, out)) = self.window.pop_last() {
                self.window_bytes -= out.message.body_len() as u64;
            }
            self.paged_after = self.window.last_key_value().map(|(k, _)| *k);
        }
        true
    }

    /// When the caller should look again: the earliest due time in the window, or at once
    /// when the window is empty and the store holds more.
    pub(crate) fn next_due(&self) -> Option<u64> {
        match self.window.first_key_value() {
            Some((k, _)) => Some(k.due),
            None => self.paged_after.map(|_| 0),
        }
    }

    /// What to read from the store now, if anything: keys above the first, at most the
    /// second many (the window drained below half its cap).
    pub(crate) fn refill_request(&self) -> Option<(ScheduleKey, usize)> {
        let after = self.paged_after?;
        let room = self.cap.saturating_sub(self.window.len());
        (self.window.len() <= self.cap / 2 && room > 0).then_some((after, room))
    }

    /// The store's answer to `refill_request`: `read` (keys above the request's, in order)
    /// of `asked`; fewer than asked means the store holds no more.
    pub(crate) fn refilled(&mut self, read: Vec<ScheduledMessage>, asked: usize) {
        let complete = read.len() < asked;
        let mut last = self.paged_after;
        for m in read {
            if last.is_some_and(|k| m.key <= k) {
                // Not above the request: a store bug, never delivered twice.
                continue;
            }
            last = Some(m.key);
            self.window_bytes += m.message.body_len() as u64;
            self.window.insert(m.key, m);
        }
        self.paged_after = if complete { None } else { last };
        // A byte cap can still be exceeded by one big read: trim as `insert` does.
        while self.window.len() > 1 && self.window_bytes > self.cap_bytes {
            if let Some((_, out)) = self.window.pop_last() {
                self.window_bytes -= out.message.body_len() as u64;
            }
            self.paged_after = self.window.last_key_value().map(|(k, _)| *k);
        }
    }

    /// Takes up to `max` messages due at `now`, in key order, into `out`. Stops early when
    /// the window must be refilled first (the store may hold earlier ones than what is left).
    pub(crate) fn take_due(&mut self, now: u64, max: usize, out: &mut Vec<ScheduledMessage>) {
        let start = out.len();
        while out.len() - start < max {
            match self.window.first_key_value() {
                Some((k, _)) if k.due <= now => {}
                _ => break,
            }
            let Some((_, m)) = self.window.pop_first() else {
                break;
            };
            self.window_bytes -= m.message.body_len() as u64;
            self.forget(&(m.vhost.clone(), m.exchange.clone()), 1);
            out.push(m);
        }
    }

    /// Drops exchange `x`'s messages from the window and the counts (the store drops its
    /// own); returns how many were counted.
    pub(crate) fn purge(&mut self, x: &ExchangeName) -> u64 {
        let mut bytes = 0;
        self.window.retain(|_, m| {
            let keep = m.vhost != x.0 || m.exchange != x.1;
            if !keep {
                bytes += m.message.body_len() as u64;
            }
            keep
        });
        self.window_bytes -= bytes;
        let n = self.count(x);
        self.forget(x, n);
        n
    }

    fn forget(&mut self, x: &ExchangeName, n: u64) {
        self.total = self.total.saturating_sub(n);
        if let Some(c) = self.counts.get_mut(x) {
            *c = c.saturating_sub(n);
            if *c == 0 {
                self.counts.remove(x);
            }
        }
    }

    /// Per exchange: how many are scheduled, and the earliest due time the window knows of
    /// (`None` when all of them are paged out: the operator sees the count only).
    pub(crate) fn summary(&self) -> Vec<(ExchangeName, u64, Option<u64>)> {
        let mut next: BTreeMap<&ExchangeName, u64> = BTreeMap::new();
        for m in self.window.values() {
            // Two `Arc<str>` compare by content: look up by a borrowed pair.
            if let Some((x, _)) = self
                .counts
                .get_key_value(&(m.vhost.clone(), m.exchange.clone()))
            {
                next.entry(x).or_insert(m.key.due);
            }
        }
        self.counts
            .iter()
            .map(|(x, n)| (x.clone(), *n, next.get(x).copied()))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::Message;
    use proptest::prelude::*;

    fn msg(s: &mut Schedule, due: u64, x: &str) -> ScheduledMessage {
        ScheduledMessage {
            key: s.key(due),
            vhost: Arc::from("/"),
            exchange: Arc::from(x),
            message: Arc::new(Message {
                exchange: Arc::from(x),
                routing_key: Arc::from("k"),
                properties: Default::default(),
                body: bytes::Bytes::from_static(b"0123456789"),
            }),
            durable: true,
        }
    }

    /// A store's schedule: every message, by key.
    #[derive(Default)]
    struct Disk(BTreeMap<ScheduleKey, ScheduledMessage>);

    impl Disk {
        fn read(&self, after: ScheduleKey, max: usize) -> Vec<ScheduledMessage> {
            use std::ops::Bound::{Excluded, Unbounded};
            self.0
                .range((Excluded(after), Unbounded))
                .take(max)
                .map(|(_, m)| m.clone())
                .collect()
        }
    }

    /// Delivers everything due at `now` as the broker does (refill, take, repeat).
    fn run(s: &mut Schedule, disk: &mut Disk, now: u64, out: &mut Vec<ScheduledMessage>) {
        loop {
            if let Some((after, max)) = s.refill_request() {
                let read = disk.read(after, max);
                s.refilled(read, max);
            }
            let before = out.len();
            s.take_due(now, 3, out);
            for m in &out[before..] {
                disk.0.remove(&m.key);
            }
            if out.len() == before && s.refill_request().is_none() {
                break;
            }
        }
    }

    #[test]
    fn due_order_across_the_window() {
        let mut s = Schedule::new(4, u64::MAX);
        let mut disk = Disk::default();
        for due in [50, 10, 40, 30, 20, 60, 5, 45, 15] {
            let m = msg(&mut s, due, "x");
            disk.0.insert(m.key, m.clone());
            s.insert(m);
        }
        assert_eq!(s.in_window(), 4, "the window is bounded");
        assert_eq!(s.len(), 9);
        let mut out = Vec::new();
        run(&mut s, &mut disk, 30, &mut out);
        let dues: Vec<u64> = out.iter().map(|m| m.key.due).collect();
        assert_eq!(dues, [5, 10, 15, 20, 30]);
        run(&mut s, &mut disk, 100, &mut out);
        let dues: Vec<u64> = out.iter().map(|m| m.key.due).collect();
        assert_eq!(dues, [5, 10, 15, 20, 30, 40, 45, 50, 60]);
        assert_eq!(s.len(), 0);
        assert_eq!(s.next_due(), None);
    }

    #[test]
    fn recovered_pages_everything_in() {
        let rec = ScheduleRecovery {
            next_id: 10,
            counts: vec![("/".into(), "x".into(), 2)],
        };
        let mut s = Schedule::recovered(4, u64::MAX, rec);
        assert_eq!(s.next_due(), Some(0), "look at the store at once");
        assert_eq!(s.key(7).id, 10, "ids continue above the stored ones");
        assert_eq!(s.count(&(Arc::from("/"), Arc::from("x"))), 2);
    }

    #[test]
    fn purge_forgets_one_exchange() {
        let mut s = Schedule::default();
        for (due, x) in [(1, "a"), (2, "b"), (3, "a")] {
            let m = msg(&mut s, due, x);
            s.insert(m);
        }
        assert_eq!(s.purge(&(Arc::from("/"), Arc::from("a"))), 2);
        let mut out = Vec::new();
        s.take_due(10, 10, &mut out);
        assert_eq!(out.len(), 1);
        assert_eq!(&*out[0].exchange, "b");
        assert_eq!(s.len(), 0);
    }

    proptest! {
        /// Whatever the arrival order, window size and delivery times: every message leaves
        /// exactly once, never before its due time, in key order, and the window stays
        /// within its cap.
        #[test]
        fn leaves_in_key_order(
            ops in proptest::collection::vec((0u64..1000, any::<bool>()), 1..200),
            cap in 1usize..16,
        ) {
            let mut s = Schedule::new(cap, u64::MAX);
            let mut disk = Disk::default();
            let mut now = 0;
            let mut out = Vec::new();
            let mut scheduled = 0;
            for (delay, advance) in ops {
                if advance {
                    now += delay / 10;
                    let before = out.len();
                    run(&mut s, &mut disk, now, &mut out);
                    for m in &out[before..] {
                        prop_assert!(m.key.due <= now);
                    }
                } else {
                    let m = msg(&mut s, now + delay + 1, "x");
                    disk.0.insert(m.key, m.clone());
                    s.insert(m);
                    scheduled += 1;
                }
                prop_assert!(s.in_window() <= cap);
            }
            run(&mut s, &mut disk, u64::MAX, &mut out);
            prop_assert_eq!(out.len(), scheduled);
            prop_assert!(out.windows(2).all(|w| w[0].key < w[1].key));
            prop_assert_eq!(s.len(), 0);
        }
    }
}
