//! The stream queue type (`x-queue-type: stream`, RabbitMQ's `rabbit_stream_queue`): an
//! append-only log that every consumer reads from its own offset; nothing is removed by
//! consuming, only by retention (whole oldest segments, by `x-max-length-bytes` and
//! `x-max-age`).
//!
//! The log is the host's (`Store::stream_*`: segment files natively, shared with the stream
//! protocol's listener, so one stream is one log whichever protocol reads or writes it;
//! memory in `MemoryStore`); a broker without a store keeps it here, in a [`MemLog`]. What
//! this type keeps is the consumers' side: each consumer's next offset and a bounded
//! read-ahead of messages from the log; their credit (prefetch, unacked count) is the queue's
//! consumer record, as for any type, except that a consumer that used up its prefetch is
//! refilled a quarter at a time (`Room`). An ack only returns credit; deliveries carry their
//! offset in the `x-stream-offset` header; consumers see committed (synced) messages only, so
//! an offset a consumer saw is never given to another message after a crash.

use crate::amqp10;
use crate::message::{FieldTable, FieldValue, Message, QueuedMessage};
use crate::queue::state::{ConsumerId, Credit, Enqueued, Picked, QueueConsumer, QueueIo};
use crate::queue_args::ArgError;
use crate::store::{MemLog, SharedStreams, StreamBounds, StreamEntry, StreamSettings, StreamStart};
use std::collections::VecDeque;

/// Whether this build serves stream queues (the `streams` feature; the JS package's build
/// leaves them out to fit its size budget, issue 39). Without it a stream declare is refused
/// (406) and every stream path is dead code (`queue::variant::Variant`'s accessors).
pub(crate) const STREAMS: bool = cfg!(feature = "streams");
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering, fence};

/// How many consumers read a shard's stream queues (their cursors), shared with the host so
/// it tells the shard of appends it did not make (the stream protocol's) only when someone
/// reads (`Broker::streams_grew`): otherwise every commit costs every shard a lock, a set
/// insert and a task wake, with no AMQP reader anywhere (within noise on 2 shards in
/// 2026-11-25's measurement; the cost grows with the shard count).
///
/// The contract, a Dekker pair: a cursor counts itself, then a `SeqCst` fence, then reads the
/// log; the host makes its append visible, then [`StreamReaders::any`] (a fence, then the
/// load). Either the reader sees the append or the host sees the reader, so no append goes
/// unseen by a consumer that attached while it was committed.
#[derive(Clone, Debug, Default)]
pub struct StreamReaders(Arc<AtomicUsize>);

impl StreamReaders {
    /// Whether any consumer reads a stream queue of the shard now. Call after the append
    /// this is about is visible in the log.
    pub fn any(&self) -> bool {
        fence(Ordering::SeqCst);
        self.0.load(Ordering::SeqCst) > 0
    }

    fn added(&self) {
        self.0.fetch_add(1, Ordering::SeqCst);
        // Before this cursor reads the log (the type's contract).
        fence(Ordering::SeqCst);
    }

    fn removed(&self, n: usize) {
        let before = self.0.fetch_sub(n, Ordering::SeqCst);
        debug_assert!(before >= n, "{n} stream readers removed of {before}");
    }
}

/// Messages a consumer reads from the log at a time (whole chunks: a store may return a few
/// more), so a consumer holds at most about this many besides its unacked deliveries.
const READ_BATCH: usize = 128;

/// How long a stream consumer held back with some free prefetch waits at most for a quarter
/// of it (`Room::Held`), in the core's milliseconds: at least one whole millisecond passes.
pub(crate) const REFILL_HOLD_MS: u64 = 2;

/// Whether a consumer may be given a message now, as far as its own prefetch says.
///
/// A stream consumer with a backlog that refills its prefetch one ack at a time would get one
/// message per ack: with RabbitMQ's Java client (PerfTest: prefetch 200, an ack per message)
/// every small delivery wakes the client's reader thread, which cost the client more CPU than
/// the broker spent (2026-11-25: 32k socket reads a second for 130k msg/s, four messages a
/// read; RabbitMQ, slower, was read 37 at a time). So a consumer that reached its prefetch
/// is given more once a quarter of it is free again (`QueueConsumer::refilling`). A consumer
/// that stops acking before that (it waits for more messages to ack what it holds) gets what
/// is free after `REFILL_HOLD_MS` (`Broker::tick`): never stuck, at most that late. A
/// prefetch below 8 refills per ack, as before.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Room {
    /// It may take one more.
    Free,
    /// Some of its prefetch is free, but less than a quarter since it was full.
    Held,
    /// Its prefetch is used up.
    Full,
}

impl Room {
    pub(crate) fn of(c: &QueueConsumer) -> Room {
        if c.prefetch == 0 {
            return Room::Free;
        }
        let prefetch = u32::from(c.prefetch);
        let free = prefetch.saturating_sub(c.unacked);
        if free == 0 {
            Room::Full
        } else if c.refilling && prefetch >= 8 && free < prefetch / 4 {
            Room::Held
        } else {
            Room::Free
        }
    }
}

/// A stream's settings from its effective arguments.
pub(crate) fn settings(args: &FieldTable) -> Result<StreamSettings, ArgError> {
    let mut s = StreamSettings::default();
    let positive = |name: &'static str, v: &FieldValue, what: &str| {
        v.as_i64()
            .and_then(|n| u64::try_from(n).ok())
            .ok_or_else(|| (name, what.to_string()))
    };
    if let Some(v) = args.get("x-max-length-bytes") {
        s.max_length_bytes = Some(positive(
            "x-max-length-bytes",
            v,
            "{value_negative_or_not_an_integer}",
        )?);
    }
    if let Some(v) = args.get("x-stream-max-segment-size-bytes") {
        let n = positive(
            "x-stream-max-segment-size-bytes",
            v,
            "invalid_max_segment_size_bytes",
        )?;
        if n == 0 {
            return Err((
                "x-stream-max-segment-size-bytes",
                "invalid_max_segment_size_bytes".into(),
            ));
        }
        s.max_segment_size_bytes = Some(n);
    }
    if let Some(v) = args.get("x-max-age") {
        s.max_age_ms = Some(
            v.as_str()
                .and_then(parse_max_age)
                .ok_or(("x-max-age", "invalid_max_age".to_string()))?,
        );
    }
    Ok(s)
}

/// RabbitMQ's `x-max-age` (a number and a unit: `Y`, `M`, `D`, `h`, `m`, `s`) in ms.
pub(crate) fn parse_max_age(v: &str) -> Option<u64> {
    let unit = v.chars().last()?;
    let n: u64 = v.get(..v.len() - unit.len_utf8())?.parse().ok()?;
    let secs: u64 = match unit {
        'Y' => 365 * 24 * 3600,
        'M' => 30 * 24 * 3600,
        'D' => 24 * 3600,
        'h' => 3600,
        'm' => 60,
        's' => 1,
        _ => return None,
    };
    n.checked_mul(secs)?.checked_mul(1000)
}

/// Where a consumer starts, from its `x-stream-offset` argument at `now` (ms); `None` for a
/// value RabbitMQ does not take (the consume is refused).
pub(crate) fn parse_offset(v: Option<&FieldValue>, now: u64) -> Option<StreamStart> {
    let Some(v) = v else {
        return Some(StreamStart::Next);
    };
    if let FieldValue::Timestamp(secs) = v {
        return Some(StreamStart::Timestamp(secs.saturating_mul(1000)));
    }
    if let Some(n) = v.as_i64() {
        return Some(StreamStart::Offset(u64::try_from(n).unwrap_or(0)));
    }
    match v.as_str()? {
        "first" => Some(StreamStart::First),
        "last" => Some(StreamStart::Last),
        "next" => Some(StreamStart::Next),
        interval => {
            let ago = parse_max_age(interval)?;
            Some(StreamStart::Timestamp(now.saturating_sub(ago)))
        }
    }
}

/// One consumer's place in the log.
struct Cursor {
    id: ConsumerId,
    /// The offset its next delivery has.
    next: u64,
    /// Messages read from the log from `next` on, not delivered yet.
    buffer: VecDeque<StreamEntry>,
}

/// Where a stream queue's log is.
pub(crate) enum Log {
    /// The store's (`Store::stream_*`).
    Store,
    /// Its own, in memory (a broker without a store).
    Own(MemLog),
    /// The host's, shared with its stream protocol listener (a broker without a store).
    Shared {
        host: Arc<dyn SharedStreams>,
        vhost: Arc<str>,
        name: Arc<str>,
    },
}

/// A stream queue's state (see the module docs).
pub(crate) struct StreamQueue {
    /// Its settings (arguments over policy), as the log applies them.
    pub(crate) settings: StreamSettings,
    log: Log,
    /// By consumer id (ids only grow: pushed in order).
    cursors: Vec<Cursor>,
    /// Round-robin start among the consumers, so one with a backlog does not starve others.
    rr: usize,
    /// The shard's count, which `cursors` are part of (kept when they come and go, and when
    /// the queue goes: `Drop`).
    readers: StreamReaders,
}

impl Drop for StreamQueue {
    fn drop(&mut self) {
        self.readers.removed(self.cursors.len());
    }
}

impl StreamQueue {
    /// A stream over `log`: the store's (opened by the caller), a [`MemLog`] of its own
    /// (`Log::Own` made here with the settings) or the host's (opened by the caller).
    pub(crate) fn new(settings: StreamSettings, log: Log, readers: StreamReaders) -> StreamQueue {
        StreamQueue {
            log: match log {
                Log::Own(_) => Log::Own(MemLog::new(settings.clone())),
                other => other,
            },
            settings,
            cursors: Vec::new(),
            rr: 0,
            readers,
        }
    }

    /// The queue was deleted: a shared log goes with it (the store deletes its own, and an
    /// own log is dropped with the queue).
    pub(crate) fn delete_log(&self) {
        if let Log::Shared { host, vhost, name } = &self.log {
            host.delete(vhost, name);
        }
    }

    fn bounds(&mut self, io: &mut QueueIo<'_>, id: crate::ids::QueueId) -> Option<StreamBounds> {
        match &self.log {
            Log::Own(log) => return Some(log.bounds()),
            Log::Shared { host, vhost, name } => return host.bounds(vhost, name).ok(),
            Log::Store => {}
        }
        let store = io.store.as_deref_mut()?;
        match store.stream_bounds(id) {
            Ok(b) => Some(b),
            Err(_) => {
                io.out.store_failed = true;
                None
            }
        }
    }

    /// Messages in the stream (declare-ok's count, listings).
    pub(crate) fn message_count(&mut self, io: &mut QueueIo<'_>, id: crate::ids::QueueId) -> u64 {
        self.bounds(io, id)
            .map_or(0, |b| b.committed.saturating_sub(b.first))
    }

    /// Appends a routed message (AMQP 1.0 encoded, stamped with the clock). Always
    /// durable: its confirm waits for the sync that covers it.
    pub(crate) fn enqueue(
        &mut self,
        id: crate::ids::QueueId,
        io: &mut QueueIo<'_>,
        message: &Arc<Message>,
    ) -> Enqueued {
        let data = amqp10::encode(message);
        match &mut self.log {
            Log::Own(log) => {
                log.append([data], io.now);
                return Enqueued::Memory;
            }
            Log::Shared { host, vhost, name } => {
                return match host.append(vhost, name, data, io.now) {
                    Ok(()) => Enqueued::Memory,
                    // The host logged why: the publish is nacked.
                    Err(_) => Enqueued::Failed,
                };
            }
            Log::Store => {}
        }
        let Some(store) = io.store.as_deref_mut() else {
            return Enqueued::Failed;
        };
        if store.stream_append(id, data, io.now).is_err() {
            io.out.store_failed = true;
            return Enqueued::Failed;
        }
        io.out.durable_write = true;
        Enqueued::Durable
    }

    /// A policy changed its settings: the log applies them from now on.
    pub(crate) fn set_settings(
        &mut self,
        id: crate::ids::QueueId,
        io: &mut QueueIo<'_>,
        vhost: &str,
        name: &str,
        settings: StreamSettings,
    ) {
        match &mut self.log {
            Log::Own(log) => {
                log.set_settings(settings.clone());
                log.retain(io.now);
            }
            Log::Shared { host, vhost, name } => {
                // The host logged a failure; the old settings stay.
                let _ = host.open(vhost, name, &settings);
            }
            Log::Store => {
                let reopened = io
                    .store
                    .as_deref_mut()
                    .map(|s| s.stream_open(id, vhost, name, &settings));
                if !matches!(reopened, Some(Ok(_))) {
                    io.out.store_failed = true;
                }
            }
        }
        self.settings = settings;
    }

    /// A consumer starts at `start`.
    pub(crate) fn add_cursor(
        &mut self,
        id: crate::ids::QueueId,
        io: &mut QueueIo<'_>,
        consumer: ConsumerId,
        start: StreamStart,
    ) {
        // Counted before the log is read (`StreamReaders`); a consumer id is new here (a
        // repeated one replaces its cursor, counted once).
        let known = self
            .cursors
            .binary_search_by_key(&consumer, |c| c.id)
            .is_ok();
        if !known {
            self.readers.added();
        }
        let next = match &self.log {
            Log::Own(log) => log.start(start),
            Log::Shared { host, vhost, name } => host.start(vhost, name, start).unwrap_or(0),
            Log::Store => match io.store.as_deref_mut().map(|s| s.stream_start(id, start)) {
                Some(Ok(o)) => o,
                _ => {
                    io.out.store_failed = true;
                    0
                }
            },
        };
        let cursor = Cursor {
            id: consumer,
            next,
            buffer: VecDeque::new(),
        };
        match self.cursors.binary_search_by_key(&consumer, |c| c.id) {
            Ok(i) => self.cursors[i] = cursor,
            Err(i) => self.cursors.insert(i, cursor),
        }
    }

    /// A consumer went.
    pub(crate) fn remove_cursor(&mut self, consumer: ConsumerId) {
        if let Ok(i) = self.cursors.binary_search_by_key(&consumer, |c| c.id) {
            self.cursors.remove(i);
            self.readers.removed(1);
        }
    }

    /// Whether a consumer may be behind the log's committed end (dispatch may be due when
    /// the log grows without this queue's own appends: the stream protocol's publishers).
    pub(crate) fn has_cursors(&self) -> bool {
        !self.cursors.is_empty()
    }

    /// Fills cursor `i`'s buffer from the log, if it is empty and the log has more.
    fn refill(&mut self, id: crate::ids::QueueId, io: &mut QueueIo<'_>, i: usize) {
        if !self.cursors[i].buffer.is_empty() {
            return;
        }
        let Some(bounds) = self.bounds(io, id) else {
            return;
        };
        let c = &mut self.cursors[i];
        // Retention dropped what it had not read yet: it goes on from the first retained.
        c.next = c.next.max(bounds.first);
        if c.next >= bounds.committed {
            return;
        }
        let mut read = Vec::new();
        match &self.log {
            Log::Own(log) => log.read(c.next, READ_BATCH, &mut read),
            Log::Shared { host, vhost, name } => {
                if host
                    .read(vhost, name, c.next, READ_BATCH, &mut read)
                    .is_err()
                {
                    return;
                }
            }
            Log::Store => {
                let Some(store) = io.store.as_deref_mut() else {
                    return;
                };
                if store
                    .stream_read(id, c.next, READ_BATCH, &mut read)
                    .is_err()
                {
                    io.out.store_failed = true;
                    return;
                }
            }
        }
        let from = c.next;
        c.buffer.extend(
            read.into_iter()
                .filter(|e| e.offset >= from && e.offset < bounds.committed),
        );
    }

    /// The next delivery to a consumer with credit and a message to read, round-robin.
    pub(crate) fn next_delivery(
        &mut self,
        id: crate::ids::QueueId,
        io: &mut QueueIo<'_>,
        consumers: &mut [QueueConsumer],
        unacked: &mut u64,
        credit: &mut impl Credit,
    ) -> Option<Picked> {
        let n = consumers.len();
        for k in 0..n {
            let idx = (self.rr + k) % n;
            let c = &consumers[idx];
            match Room::of(c) {
                Room::Free => {}
                Room::Held => {
                    io.out.refill_held = true;
                    continue;
                }
                Room::Full => continue,
            }
            if !credit.may_deliver(c) {
                continue;
            }
            let Ok(i) = self.cursors.binary_search_by_key(&c.id, |cur| cur.id) else {
                continue;
            };
            self.refill(id, io, i);
            if self.cursors[i].buffer.is_empty() || !credit.take(c) {
                continue;
            }
            let Some(e) = self.cursors[i].buffer.pop_front() else {
                credit.give_back(c);
                continue;
            };
            self.cursors[i].next = e.offset + 1;
            let message = Arc::new(delivered(&e));
            io.out.held += message.body_len() as u64;
            let c = &mut consumers[idx];
            c.unacked += 1;
            c.refilling = c.prefetch != 0 && c.unacked >= u32::from(c.prefetch);
            *unacked += 1;
            self.rr = (idx + 1) % n;
            return Some(Picked {
                consumer: c.id,
                to: c.addr(),
                tag: c.tag.clone(),
                no_ack: false,
                message: QueuedMessage {
                    seq: e.offset,
                    message,
                    redelivered: false,
                    stored: false,
                    expires_at: None,
                    epoch: 0,
                },
            });
        }
        None
    }
}

/// A stream message as an AMQP 0.9.1 consumer gets it: decoded, with its offset in the
/// `x-stream-offset` header. Bytes that are not AMQP 1.0 (a stream client may publish
/// anything) are the body as they are.
fn delivered(e: &StreamEntry) -> Message {
    let mut m = amqp10::decode(&e.data).unwrap_or_else(|_| Message {
        exchange: Arc::from(""),
        routing_key: Arc::from(""),
        properties: Default::default(),
        body: e.data.clone(),
    });
    let offset = i64::try_from(e.offset).unwrap_or(i64::MAX);
    m.properties
        .headers
        .get_or_insert_with(FieldTable::new)
        .insert("x-stream-offset".into(), FieldValue::I64(offset));
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_age_and_offsets_parse_as_rabbitmq_takes_them() {
        assert_eq!(parse_max_age("7D"), Some(7 * 24 * 3600 * 1000));
        assert_eq!(parse_max_age("1h"), Some(3_600_000));
        assert_eq!(parse_max_age("30s"), Some(30_000));
        assert_eq!(parse_max_age("2M"), Some(60 * 24 * 3600 * 1000));
        for bad in ["", "h", "7", "7x", "-1h", "1.5h", "7DD"] {
            assert_eq!(parse_max_age(bad), None, "{bad}");
        }
        let now = 10_000_000;
        assert_eq!(parse_offset(None, now), Some(StreamStart::Next));
        let s = |t: &str| FieldValue::string(t);
        assert_eq!(
            parse_offset(Some(&s("first")), now),
            Some(StreamStart::First)
        );
        assert_eq!(parse_offset(Some(&s("last")), now), Some(StreamStart::Last));
        assert_eq!(parse_offset(Some(&s("next")), now), Some(StreamStart::Next));
        assert_eq!(
            parse_offset(Some(&FieldValue::I64(42)), now),
            Some(StreamStart::Offset(42))
        );
        assert_eq!(
            parse_offset(Some(&FieldValue::Timestamp(1_700)), now),
            Some(StreamStart::Timestamp(1_700_000))
        );
        assert_eq!(
            parse_offset(Some(&s("1h")), now),
            Some(StreamStart::Timestamp(now - 3_600_000))
        );
        assert_eq!(parse_offset(Some(&s("bogus")), now), None);
        assert_eq!(parse_offset(Some(&FieldValue::Bool(true)), now), None);
    }

    #[test]
    fn settings_are_read_with_rabbitmqs_words() {
        let mut t = FieldTable::new();
        t.insert("x-max-age".into(), FieldValue::string("7x"));
        assert_eq!(settings(&t), Err(("x-max-age", "invalid_max_age".into())));
        let mut t = FieldTable::new();
        t.insert("x-stream-max-segment-size-bytes".into(), FieldValue::I64(0));
        assert!(settings(&t).is_err());
        let mut t = FieldTable::new();
        t.insert("x-max-age".into(), FieldValue::string("1h"));
        t.insert("x-max-length-bytes".into(), FieldValue::I64(1000));
        t.insert(
            "x-stream-max-segment-size-bytes".into(),
            FieldValue::I32(100),
        );
        assert_eq!(
            settings(&t),
            Ok(StreamSettings {
                max_length_bytes: Some(1000),
                max_age_ms: Some(3_600_000),
                max_segment_size_bytes: Some(100),
            })
        );
    }
}
