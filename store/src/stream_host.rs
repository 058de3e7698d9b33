//! Streams for the core (`Store::stream_*`) over the native stream logs: the logs belong to a
//! [`StreamHost`] (the binary's catalog, which also serves them to the stream protocol), so
//! one stream is one log whichever protocol writes or reads it. [`DiskStore`] keeps, per
//! stream the core opened, the messages appended since the last flush (handed to the log
//! per batch of the broker task, where the batches staged since its last write become one
//! chunk) and a few readers positioned where the stream's
//! consumers read next (each keeps its read-ahead buffer between reads).
//!
//! [`DiskStore`]: crate::DiskStore

use crate::stream::{Bounds, OffsetSpec, ReadChunk, StreamReader, format::MAX_CHUNK_MESSAGES};
use bytes::Bytes;
use std::sync::Arc;
use warren_core::store::{StoreError, StreamBounds, StreamEntry, StreamSettings, StreamStart};

/// Readers kept per stream: one per consumer position is typical; beyond this the oldest
/// goes (a consumer whose reader went gets a new one at its next read: an index seek).
const READERS: usize = 16;
/// Bytes of appended messages buffered before they are written out as a chunk.
const PENDING_BYTES: usize = 1 << 20;

/// The stream logs, as the core's store reaches them. Errors are text for the log.
pub trait StreamHost: Send + Sync + std::fmt::Debug {
    /// Opens stream `name` of `vhost`, creating it with `settings` if it does not exist
    /// (an existing stream keeps its own).
    fn open(&self, vhost: &str, name: &str, settings: &StreamSettings) -> Result<(), String>;
    /// Appends `messages`, merged into one chunk with what was appended since the log's
    /// last write (osiris's shape: one chunk per write, not per batch); durable after
    /// [`StreamHost::sync`].
    fn append(
        &self,
        vhost: &str,
        name: &str,
        messages: &[Bytes],
        timestamp_ms: u64,
    ) -> Result<(), String>;
    /// The offsets it holds.
    fn bounds(&self, vhost: &str, name: &str) -> Result<Bounds, String>;
    /// A reader of committed chunks from `spec`.
    fn reader(&self, vhost: &str, name: &str, spec: OffsetSpec) -> Result<StreamReader, String>;
    /// Makes every append so far durable and visible to readers (blocking: the store's sync
    /// thread calls it), and tells the stream's subscribers.
    fn sync(&self, vhost: &str, name: &str) -> Result<(), String>;
    /// Deletes the stream with its files.
    fn delete(&self, vhost: &str, name: &str);
}

/// A stream the core opened.
pub(crate) struct OpenStream {
    vhost: String,
    name: String,
    pending: Vec<Bytes>,
    pending_bytes: usize,
    pending_ts: u64,
    /// Appended since the last sync started.
    pub(crate) dirty: bool,
    readers: Vec<StreamReader>,
}

fn err(e: impl std::fmt::Display) -> StoreError {
    StoreError(e.to_string())
}

impl OpenStream {
    pub(crate) fn open(
        host: &dyn StreamHost,
        vhost: &str,
        name: &str,
        settings: &StreamSettings,
    ) -> Result<OpenStream, StoreError> {
        host.open(vhost, name, settings).map_err(err)?;
        Ok(OpenStream {
            vhost: vhost.to_string(),
            name: name.to_string(),
            pending: Vec::new(),
            pending_bytes: 0,
            pending_ts: 0,
            dirty: false,
            readers: Vec::new(),
        })
    }

    /// Applies new settings to the open stream.
    pub(crate) fn reopen(
        &self,
        host: &dyn StreamHost,
        settings: &StreamSettings,
    ) -> Result<(), StoreError> {
        host.open(&self.vhost, &self.name, settings).map_err(err)
    }

    pub(crate) fn append(
        &mut self,
        host: &dyn StreamHost,
        data: Bytes,
        timestamp_ms: u64,
    ) -> Result<(), StoreError> {
        if self.pending.is_empty() {
            self.pending_ts = timestamp_ms;
        }
        self.pending_bytes += data.len();
        self.pending.push(data);
        self.dirty = true;
        if self.pending_bytes >= PENDING_BYTES || self.pending.len() >= MAX_CHUNK_MESSAGES {
            self.write_out(host)?;
        }
        Ok(())
    }

    /// Hands the pending messages to the log (one batch, merged there with what is staged).
    pub(crate) fn write_out(&mut self, host: &dyn StreamHost) -> Result<(), StoreError> {
        if self.pending.is_empty() {
            return Ok(());
        }
        host.append(&self.vhost, &self.name, &self.pending, self.pending_ts)
            .map_err(err)?;
        self.pending.clear();
        self.pending_bytes = 0;
        Ok(())
    }

    /// What the sync thread must do for this stream.
    pub(crate) fn sync_job(&self, host: &Arc<dyn StreamHost>) -> StreamSync {
        StreamSync {
            host: host.clone(),
            vhost: self.vhost.clone(),
            name: self.name.clone(),
        }
    }

    pub(crate) fn delete(&self, host: &dyn StreamHost) {
        host.delete(&self.vhost, &self.name);
    }

    pub(crate) fn bounds(&self, host: &dyn StreamHost) -> Result<StreamBounds, StoreError> {
        let b = host.bounds(&self.vhost, &self.name).map_err(err)?;
        Ok(StreamBounds {
            first: b.first,
            next: b.next + self.pending.len() as u64,
            committed: b.committed.max(b.first),
        })
    }

    pub(crate) fn start(
        &mut self,
        host: &dyn StreamHost,
        start: StreamStart,
    ) -> Result<u64, StoreError> {
        let b = self.bounds(host)?;
        Ok(match start {
            StreamStart::First => b.first,
            StreamStart::Next => b.next,
            StreamStart::Offset(o) => o.clamp(b.first, b.next),
            StreamStart::Last | StreamStart::Timestamp(_) => {
                // Seeks read the index: write the pending chunk out first.
                self.write_out(host)?;
                let spec = match start {
                    StreamStart::Timestamp(t) => OffsetSpec::Timestamp(t),
                    _ => OffsetSpec::Last,
                };
                let r = host.reader(&self.vhost, &self.name, spec).map_err(err)?;
                r.start_offset()
            }
        })
    }

    pub(crate) fn read(
        &mut self,
        host: &dyn StreamHost,
        from: u64,
        max: usize,
        out: &mut Vec<StreamEntry>,
    ) -> Result<(), StoreError> {
        let mut reader = match self.readers.iter().position(|r| r.next_offset() == from) {
            Some(i) => self.readers.swap_remove(i),
            None => host
                .reader(&self.vhost, &self.name, OffsetSpec::Offset(from))
                .map_err(err)?,
        };
        let mut n = 0;
        let read = (|| -> Result<(), StoreError> {
            while n < max {
                let Some(chunk) = reader.next_chunk().map_err(err)? else {
                    break;
                };
                let data = chunk.bytes().map_err(err)?;
                for (i, m) in ReadChunk::records(&data).enumerate() {
                    let offset = chunk.first_offset + i as u64;
                    let m = m.map_err(err)?;
                    if offset < from {
                        continue;
                    }
                    out.push(StreamEntry {
                        offset,
                        timestamp: chunk.timestamp,
                        data: m,
                    });
                    n += 1;
                }
            }
            Ok(())
        })();
        if read.is_ok() {
            if self.readers.len() >= READERS {
                self.readers.remove(0);
            }
            self.readers.push(reader);
        }
        read
    }
}

/// A stream's part of a sync, run by the sync thread.
pub(crate) struct StreamSync {
    host: Arc<dyn StreamHost>,
    vhost: String,
    name: String,
}

impl StreamSync {
    pub(crate) fn run(&self) -> Result<(), String> {
        self.host
            .sync(&self.vhost, &self.name)
            .map_err(|e| format!("stream '{}' in vhost '{}': {e}", self.name, self.vhost))
    }
}
