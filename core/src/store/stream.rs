//! The store's side of streams: what the core asks of a stream's log (`Store::stream_*`),
//! and [`MemLog`], the log in memory that `MemoryStore` (simulations, wasm hosts) and a
//! broker without a store keep. The native store keeps streams on disk
//! (`warren_store::stream`), shared with the stream protocol's listener.
//!
//! A log holds messages as bytes (AMQP 1.0, `crate::amqp10`) at dense offsets from 0, in
//! chunks (the messages appended together) stamped with the host's clock, grouped in
//! segments; retention drops whole oldest segments only, as RabbitMQ's does.

use bytes::Bytes;
use std::collections::VecDeque;

/// A stream's settings, from its arguments or policy.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StreamSettings {
    /// `x-max-length-bytes`: whole oldest segments go while the stream is larger.
    pub max_length_bytes: Option<u64>,
    /// `x-max-age`, in ms: a segment whose newest message is older goes.
    pub max_age_ms: Option<u64>,
    /// `x-stream-max-segment-size-bytes` (default: the store's, 500 MB natively).
    pub max_segment_size_bytes: Option<u64>,
}

/// The offsets a stream holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StreamBounds {
    /// The first retained offset.
    pub first: u64,
    /// The offset the next message gets.
    pub next: u64,
    /// Offsets below this are durable and may be delivered (RabbitMQ delivers committed
    /// messages only: an offset a consumer saw is never reused after a crash).
    pub committed: u64,
}

/// Where a consumer starts (`x-stream-offset` resolved by the queue, with its clock).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamStart {
    /// The first retained message.
    First,
    /// The first message of the last chunk.
    Last,
    /// The next message appended.
    Next,
    /// This offset, clamped to what the stream holds.
    Offset(u64),
    /// The first chunk stamped at or after this time (ms).
    Timestamp(u64),
}

/// A message read from a stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StreamEntry {
    /// Its offset.
    pub offset: u64,
    /// Its chunk's timestamp (ms).
    pub timestamp: u64,
    /// The message, AMQP 1.0 encoded.
    pub data: Bytes,
}

/// Stream logs a host shares between a broker without a store and its other users of them
/// (`warren serve --in-memory`: the stream protocol's listener), so that one stream is one log
/// whichever protocol writes or reads it, as with a store's logs. Appends are committed
/// (readable) at once: nothing is durable. A host whose other users append tells the broker
/// (`Broker::streams_grew`). Errors are text for the host's log.
pub trait SharedStreams: Send + Sync {
    /// Opens stream `name` of `vhost`, creating it with `settings` if it does not exist; an
    /// existing one takes the settings that are set (a policy changed).
    fn open(&self, vhost: &str, name: &str, settings: &StreamSettings) -> Result<(), String>;
    /// Appends one message (AMQP 1.0 bytes) stamped `timestamp_ms`.
    fn append(&self, vhost: &str, name: &str, data: Bytes, timestamp_ms: u64)
    -> Result<(), String>;
    /// The offsets it holds.
    fn bounds(&self, vhost: &str, name: &str) -> Result<StreamBounds, String>;
    /// Resolves where a consumer starts.
    fn start(&self, vhost: &str, name: &str, start: StreamStart) -> Result<u64, String>;
    /// Up to about `max` messages from offset `from` (from the first retained one if `from`
    /// was dropped), whole chunks, in order, into `out`.
    fn read(
        &self,
        vhost: &str,
        name: &str,
        from: u64,
        max: usize,
        out: &mut Vec<StreamEntry>,
    ) -> Result<(), String>;
    /// The stream's queue was deleted: the log goes too.
    fn delete(&self, vhost: &str, name: &str);
}

/// The default segment size of an in-memory log.
const MEM_SEGMENT_BYTES: u64 = 64 << 20;

#[derive(Clone, Debug, Default)]
struct MemSegment {
    entries: VecDeque<StreamEntry>,
    bytes: u64,
    /// First offset of the last chunk appended to it.
    last_chunk: u64,
}

/// A stream's log in memory (see the module docs). Clones are cheap per message (the bodies
/// are shared `Bytes`), which `MemoryStore`'s snapshots rely on.
#[derive(Clone, Debug, Default)]
pub struct MemLog {
    settings: StreamSettings,
    segments: VecDeque<MemSegment>,
    first: u64,
    next: u64,
    bytes: u64,
}

impl MemLog {
    /// An empty log.
    pub fn new(settings: StreamSettings) -> MemLog {
        MemLog {
            settings,
            ..MemLog::default()
        }
    }

    /// Applies new settings (a policy changed): retention uses them from the next append.
    pub fn set_settings(&mut self, settings: StreamSettings) {
        self.settings = settings;
    }

    /// Offsets held; everything is committed (durability is the store's business).
    pub fn bounds(&self) -> StreamBounds {
        StreamBounds {
            first: self.first,
            next: self.next,
            committed: self.next,
        }
    }

    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Segments held.
    pub fn segment_count(&self) -> usize {
        self.segments.len()
    }

    /// Appends `messages` as one chunk stamped `timestamp_ms` (never below the previous
    /// chunk's, so seeks by time can bisect), then applies retention at that time.
    pub fn append(&mut self, messages: impl IntoIterator<Item = Bytes>, timestamp_ms: u64) {
        let ts = self
            .segments
            .back()
            .and_then(|s| s.entries.back())
            .map_or(timestamp_ms, |e| e.timestamp.max(timestamp_ms));
        let max = self
            .settings
            .max_segment_size_bytes
            .unwrap_or(MEM_SEGMENT_BYTES)
            .max(1);
        let chunk = self.next;
        let mut started = false;
        for data in messages {
            let len = data.len() as u64;
            let roll = match self.segments.back() {
                None => true,
                Some(s) => !started && s.bytes > 0 && s.bytes + len > max,
            };
            if roll {
                self.segments.push_back(MemSegment::default());
            }
            started = true;
            let Some(seg) = self.segments.back_mut() else {
                return;
            };
            seg.entries.push_back(StreamEntry {
                offset: self.next,
                timestamp: ts,
                data,
            });
            seg.bytes += len;
            seg.last_chunk = chunk;
            self.bytes += len;
            self.next += 1;
        }
        self.retain(timestamp_ms);
    }

    /// Drops whole oldest segments (never the newest) while the log is over its length or
    /// their newest message is over its age at `now_ms`.
    pub fn retain(&mut self, now_ms: u64) {
        while self.segments.len() > 1 {
            let Some(oldest) = self.segments.front() else {
                return;
            };
            let too_big = self
                .settings
                .max_length_bytes
                .is_some_and(|m| self.bytes > m);
            let newest = oldest.entries.back().map_or(0, |e| e.timestamp);
            let too_old = self
                .settings
                .max_age_ms
                .is_some_and(|a| newest.saturating_add(a) < now_ms);
            if !too_big && !too_old {
                return;
            }
            if let Some(seg) = self.segments.pop_front() {
                self.bytes -= seg.bytes;
                self.first = self
                    .segments
                    .front()
                    .and_then(|s| s.entries.front())
                    .map_or(self.next, |e| e.offset);
            }
        }
    }

    /// Resolves a start position to an offset.
    pub fn start(&self, start: StreamStart) -> u64 {
        match start {
            StreamStart::First => self.first,
            StreamStart::Next => self.next,
            StreamStart::Last => self.segments.back().map_or(self.next, |s| {
                if s.entries.is_empty() {
                    self.next
                } else {
                    s.last_chunk
                }
            }),
            StreamStart::Offset(o) => o.clamp(self.first, self.next),
            StreamStart::Timestamp(t) => self
                .segments
                .iter()
                .flat_map(|s| s.entries.iter())
                .find(|e| e.timestamp >= t)
                .map_or(self.next, |e| e.offset),
        }
    }

    /// Up to `max` messages from offset `from` (from the first one if `from` was dropped).
    pub fn read(&self, from: u64, max: usize, out: &mut Vec<StreamEntry>) {
        let from = from.max(self.first);
        let Some(i) = self
            .segments
            .iter()
            .rposition(|s| s.entries.front().is_some_and(|e| e.offset <= from))
        else {
            return;
        };
        let mut n = 0;
        for seg in self.segments.iter().skip(i) {
            let Some(head) = seg.entries.front() else {
                continue;
            };
            let skip = usize::try_from(from.saturating_sub(head.offset)).unwrap_or(usize::MAX);
            for e in seg.entries.iter().skip(skip) {
                if n == max {
                    return;
                }
                out.push(e.clone());
                n += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(n: usize) -> Bytes {
        Bytes::from(vec![b'x'; n])
    }

    #[test]
    fn offsets_are_dense_and_reads_resume_anywhere() {
        let mut log = MemLog::new(StreamSettings::default());
        log.append((0..3).map(|_| msg(1)), 10);
        log.append([msg(1)], 20);
        assert_eq!(
            log.bounds(),
            StreamBounds {
                first: 0,
                next: 4,
                committed: 4
            }
        );
        let mut out = Vec::new();
        log.read(2, 10, &mut out);
        assert_eq!(out.iter().map(|e| e.offset).collect::<Vec<_>>(), [2, 3]);
        assert_eq!(log.start(StreamStart::Last), 3);
        assert_eq!(log.start(StreamStart::Timestamp(15)), 3);
        assert_eq!(log.start(StreamStart::Timestamp(5)), 0);
        assert_eq!(log.start(StreamStart::Timestamp(25)), 4);
        assert_eq!(log.start(StreamStart::Offset(99)), 4);
    }

    #[test]
    fn retention_drops_whole_oldest_segments_only() {
        let mut log = MemLog::new(StreamSettings {
            max_length_bytes: Some(250),
            max_age_ms: None,
            max_segment_size_bytes: Some(100),
        });
        for i in 0..10 {
            log.append([msg(50)], i);
        }
        // Segments of two 50-byte messages; 500 bytes held at most 250 after retention.
        assert!(log.bytes() <= 250, "{}", log.bytes());
        let b = log.bounds();
        assert_eq!(b.first % 2, 0, "a segment boundary");
        assert_eq!(b.next, 10);
        let mut out = Vec::new();
        log.read(0, 100, &mut out);
        assert_eq!(out.first().map(|e| e.offset), Some(b.first));
        // Age: everything but the newest segment is older than 5 ms at t=100.
        let mut aged = MemLog::new(StreamSettings {
            max_age_ms: Some(5),
            max_segment_size_bytes: Some(100),
            ..StreamSettings::default()
        });
        for i in 0..6 {
            aged.append([msg(50)], i);
        }
        aged.retain(100);
        assert_eq!(aged.segment_count(), 1);
        assert_eq!(aged.bounds().first, 4);
    }
}
