//! The stream protocol's tracking state kept in the log as tracking chunks: publishers' last
//! publishing ids (deduplication) and consumers' stored offsets, written, snapshotted and
//! replayed on open.

use super::*;

impl StreamLog {
    /// Records consumer offsets in a tracking chunk (durable at the next sync).
    pub fn store_offsets(
        &mut self,
        consumers: &[(&str, u64)],
        timestamp_ms: u64,
    ) -> Result<(), StreamError> {
        self.check_ok()?;
        for (name, _) in consumers {
            check_name(name)?;
        }
        let entries: Vec<_> = consumers
            .iter()
            .map(|(n, v)| (TrackingKind::Consumer, n.as_bytes().to_vec(), *v))
            .collect();
        self.write_tracking(ChunkType::TrackingDelta, &entries, timestamp_ms, true)?;
        for (name, offset) in consumers {
            self.tracking.set(
                TrackingKind::Consumer,
                name.as_bytes(),
                *offset,
                self.config.max_tracked,
            );
        }
        Ok(())
    }

    /// The highest publishing id stored for `publisher`, staged messages included (so a
    /// batch re-sent before the staged chunk is written is deduplicated too).
    pub fn publisher_sequence(&self, publisher: &str) -> Option<u64> {
        let staged = self
            .open
            .publishers
            .iter()
            .find(|(n, _)| n == publisher)
            .map(|(_, v)| *v);
        let stored = self
            .tracking
            .get(TrackingKind::Publisher, publisher.as_bytes());
        staged.max(stored)
    }

    pub fn consumer_offset(&self, consumer: &str) -> Option<u64> {
        self.tracking
            .get(TrackingKind::Consumer, consumer.as_bytes())
    }

    pub(super) fn write_tracking(
        &mut self,
        kind: ChunkType,
        entries: &[(TrackingKind, Vec<u8>, u64)],
        timestamp_ms: u64,
        may_roll: bool,
    ) -> Result<(), StreamError> {
        // Chunks stay in offset order: staged messages come first.
        self.seal()?;
        let data_len: usize = entries
            .iter()
            .map(|(_, n, _)| format::tracking_entry_len(n))
            .sum();
        let total = CHUNK_HEADER + data_len;
        self.reserve(total)?;
        let ts = timestamp_ms.max(self.last_ts);
        if may_roll {
            self.maybe_roll(total as u64, ts)?;
        }
        let buf = &mut self.active.buf;
        let start = buf.len();
        buf.extend_from_slice(&[0u8; CHUNK_HEADER]);
        for (k, n, v) in entries {
            format::put_tracking(buf, *k, n, *v);
        }
        let header = ChunkHeader {
            kind,
            entries: 0,
            first_offset: self.next_offset,
            count: 0,
            data_len: data_len as u32,
            trailer_len: 0,
            timestamp: ts,
            data_crc: crc32fast::hash(&buf[start + CHUNK_HEADER..]),
            trailer_crc: crc32fast::hash(&[]),
        };
        buf[start..start + CHUNK_HEADER].copy_from_slice(&header.encode());
        self.indexed(&header);
        Ok(())
    }

    /// The whole tracking state as the first chunk of a segment, so that replay at open
    /// starts in the newest segment and retention can delete older ones.
    pub(super) fn write_snapshot(&mut self, ts: u64) -> Result<(), StreamError> {
        let entries: Vec<_> = self
            .tracking
            .entries
            .iter()
            .map(|((k, n), (v, _))| (*k, n.clone(), *v))
            .collect();
        self.write_tracking(ChunkType::TrackingSnapshot, &entries, ts, false)
    }

    /// Replays the tracking state: from the newest segment that starts with a snapshot (or
    /// the oldest), every tracking chunk and every user chunk's trailer, in order. Whether the
    /// newest segment starts with a snapshot.
    pub(super) fn replay_tracking(&mut self) -> Result<bool, StreamError> {
        let dir = self.shared.dir.clone();
        let mut start = 0;
        let mut newest_has = false;
        for (i, seg) in self.segments.iter().enumerate().rev() {
            let path = index_path(&dir, seg.first_offset);
            let mut e = [0u8; INDEX_ENTRY];
            let first = File::open(&path)
                .and_then(|f| f.read_exact_at(&mut e, FILE_HEADER as u64))
                .ok()
                .and_then(|()| IndexEntry::decode(&e));
            if first.is_some_and(|e| e.kind == ChunkType::TrackingSnapshot) {
                start = i;
                newest_has = i + 1 == self.segments.len();
                break;
            }
        }
        let max = self.config.max_tracked;
        for seg in &self.segments[start..] {
            if seg.index_len <= FILE_HEADER as u64 {
                // No chunk (a new segment: its header may still be in the buffer).
                continue;
            }
            let ipath = index_path(&dir, seg.first_offset);
            let dpath = data_path(&dir, seg.first_offset);
            let index = File::open(&ipath).map_err(io_err(&ipath))?;
            let data = File::open(&dpath).map_err(io_err(&dpath))?;
            let mut r = BufReader::with_capacity(1 << 16, index);
            let mut skip = [0u8; FILE_HEADER];
            r.read_exact(&mut skip).map_err(io_err(&ipath))?;
            let mut e = [0u8; INDEX_ENTRY];
            for _ in 0..(seg.index_len - FILE_HEADER as u64) / INDEX_ENTRY as u64 {
                r.read_exact(&mut e).map_err(io_err(&ipath))?;
                let Some(entry) = IndexEntry::decode(&e) else {
                    continue;
                };
                if !entry.tracks() {
                    continue;
                }
                let (header, body) = read_chunk_at(&data, &dpath, entry.position)?;
                let (tracking, at) = match header.kind {
                    ChunkType::User => (&body[header.data_len as usize..], entry.position),
                    ChunkType::TrackingSnapshot => {
                        self.tracking.entries.clear();
                        (&body[..], entry.position)
                    }
                    ChunkType::TrackingDelta => (&body[..], entry.position),
                };
                self.tracking.apply(tracking, &dpath, at, max)?;
            }
        }
        Ok(newest_has)
    }
}
