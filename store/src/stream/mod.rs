//! A stream's storage: an append-only log of chunks (one chunk = the messages of one batch),
//! in segment files with an index per segment for seeks by offset and by timestamp, plus the
//! tracking state the stream protocol needs (publisher reference -> last publishing id for
//! deduplication, consumer reference -> stored offset), kept in the log itself as tracking
//! chunks. Byte layouts and guarantees: docs/storage.md, "Streams".
//!
//! - [`StreamLog`] is the writer (one per stream, owned by the stream's task): `append`
//!   buffers a batch as one chunk, `sync` writes and fsyncs and returns the highest durable
//!   offset (group commit: publishes are confirmed after it), segments roll at
//!   `max_segment_size_bytes`, retention deletes whole oldest segments.
//! - [`StreamReader`]s read committed chunks from an [`OffsetSpec`], with read-ahead: small
//!   chunks come several per `pread`, large ones as file ranges for `sendfile`.
//! - [`StreamStore`] / [`StreamRead`]: the operations above as a trait, the shape in which they
//!   are to be lifted into the core's `Store` (whose in-memory and wasm hosts hold the log
//!   themselves).

pub mod bloom;
pub mod format;
mod reader;
pub mod sub_batch;

pub use reader::{ChunkData, ReadChunk, ReaderOptions, StreamReader};

use format::{
    CHUNK_HEADER, ChunkHeader, ChunkType, FILE_HEADER, INDEX_ENTRY, INDEX_MAGIC, IndexEntry,
    MAX_CHUNK_BODY, MAX_CHUNK_MESSAGES, MAX_MESSAGE, MAX_NAME, SEGMENT_MAGIC, TrackingKind,
};
use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

mod append;
mod durability;
mod segments;
mod tracking;
use segments::*;

/// A stream's settings (RabbitMQ's queue arguments and defaults where it has them).
#[derive(Clone, Debug)]
pub struct StreamConfig {
    /// `x-stream-max-segment-size-bytes`: a segment that would grow past this starts a new
    /// one (500 MB, as RabbitMQ). A chunk larger than this gets a segment of its own.
    pub max_segment_size_bytes: u64,
    /// `x-max-length-bytes`: whole oldest segments are deleted while the stream is larger.
    pub max_length_bytes: Option<u64>,
    /// `x-max-age` in ms: a segment whose newest chunk is older than this is deleted.
    pub max_age_ms: Option<u64>,
    /// Bytes `append` may buffer before it refuses with [`StreamError::Backpressure`] (the
    /// caller flushes or syncs, then retries): the writer's memory bound.
    pub buffer_limit_bytes: usize,
    /// fsync in `sync` (off: data reaches the OS only; for benchmarks and tests).
    pub fsync: bool,
    /// Tracked names per kind (publishers, consumers); a new name beyond this replaces the
    /// one updated longest ago, so the state (rewritten into every segment) stays bounded.
    pub max_tracked: usize,
    /// Messages `append_merged` gathers into one chunk at most (a batch bigger than this is
    /// never split: it is a chunk of its own). The stream protocol's listener bounds it so
    /// consumer credit, which counts chunks, stays fine-grained (docs/storage.md, "Chunk
    /// size"); the format's own bound is `MAX_CHUNK_MESSAGES`.
    pub merge_entries: usize,
}

impl Default for StreamConfig {
    fn default() -> StreamConfig {
        StreamConfig {
            max_segment_size_bytes: 500_000_000,
            max_length_bytes: None,
            max_age_ms: None,
            buffer_limit_bytes: 1 << 20,
            fsync: true,
            max_tracked: 4096,
            merge_entries: MAX_CHUNK_MESSAGES,
        }
    }
}

/// Where a reader starts (the stream protocol's offset specification).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OffsetSpec {
    /// The first retained message.
    First,
    /// The last chunk (from its first offset).
    Last,
    /// Only messages appended from now on.
    Next,
    /// The chunk holding this offset; below the first retained offset reads from the first,
    /// past the end from `Next` (as RabbitMQ clamps).
    Offset(u64),
    /// The first chunk whose timestamp (ms) is at or after this one.
    Timestamp(u64),
}

#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    #[error("stream file {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error("stream file {path}: corrupt at byte {pos}: {reason}")]
    Corrupt {
        path: PathBuf,
        pos: u64,
        reason: String,
    },
    #[error(
        "the stream's write buffer holds {buffered} bytes (limit {limit}): flush or sync before appending more"
    )]
    Backpressure { buffered: usize, limit: usize },
    #[error("invalid append: {0}")]
    Invalid(String),
    #[error(
        "an earlier write to this stream failed ({0}); reopen it (recovery cuts the torn tail)"
    )]
    Failed(String),
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> StreamError + '_ {
    move |source| StreamError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// What retention removed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Retained {
    pub segments: usize,
    pub bytes: u64,
}

/// The offsets a stream holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bounds {
    /// The first retained offset.
    pub first: u64,
    /// The offset the next message gets.
    pub next: u64,
    /// Offsets below this are durable (and visible to readers).
    pub committed: u64,
}

/// The stream log operations, shaped so they can be lifted into the core's `Store` trait
/// once the queue-type seam exists: the core (sans-IO, also in-memory and in wasm, where the
/// host's `Store` holds the log) calls these, never the files. Offsets are dense from 0;
/// `append` confirms nothing: a publish is confirmed once `sync` returns an offset at or past
/// it. Timestamps come from the caller (the core has no clock).
pub trait StreamStore {
    type Reader: StreamRead;
    /// Appends one batch as one chunk; returns its offsets. `publishers` are the publisher
    /// references and highest publishing ids in the batch, stored with it (deduplication).
    fn append(
        &mut self,
        messages: &[&[u8]],
        timestamp_ms: u64,
        publishers: &[(&str, u64)],
    ) -> Result<Range<u64>, StreamError>;
    /// Stores consumer offsets (server-side offset tracking); durable at the next `sync`.
    fn store_offsets(
        &mut self,
        consumers: &[(&str, u64)],
        timestamp_ms: u64,
    ) -> Result<(), StreamError>;
    /// Makes everything appended durable; the highest durable offset (`None`: empty).
    fn sync(&mut self) -> Result<Option<u64>, StreamError>;
    /// Applies `x-max-length-bytes` and `x-max-age` at `now_ms`.
    fn retain(&mut self, now_ms: u64) -> Result<Retained, StreamError>;
    fn reader(
        &mut self,
        spec: OffsetSpec,
        options: ReaderOptions,
    ) -> Result<Self::Reader, StreamError>;
    fn publisher_sequence(&self, publisher: &str) -> Option<u64>;
    fn consumer_offset(&self, consumer: &str) -> Option<u64>;
    fn bounds(&self) -> Bounds;
}

/// A reader of committed chunks.
pub trait StreamRead {
    /// The next committed user chunk, or `None` when the reader has caught up.
    fn next_chunk(&mut self) -> Result<Option<ReadChunk>, StreamError>;
}

/// What the writer shares with readers.
pub(crate) struct Shared {
    pub(crate) dir: PathBuf,
    /// Offsets below this are durable: readers stop there.
    pub(crate) committed: AtomicU64,
    /// First offsets of the segments, oldest first.
    pub(crate) segments: Mutex<Vec<u64>>,
}

impl Shared {
    pub(crate) fn segments(&self) -> Vec<u64> {
        match self.segments.lock() {
            Ok(s) => s.clone(),
            Err(p) => p.into_inner().clone(),
        }
    }

    fn set_segments(&self, firsts: Vec<u64>) {
        match self.segments.lock() {
            Ok(mut s) => *s = firsts,
            Err(p) => *p.into_inner() = firsts,
        }
    }
}

pub(crate) fn data_path(dir: &Path, first: u64) -> PathBuf {
    dir.join(format!("{first:016x}.sd"))
}

fn index_path(dir: &Path, first: u64) -> PathBuf {
    dir.join(format!("{first:016x}.si"))
}

/// One segment's summary, in memory.
#[derive(Clone, Debug)]
struct Segment {
    first_offset: u64,
    next_offset: u64,
    /// Timestamp of its newest chunk (0 while it has none).
    last_ts: u64,
    /// Data file length, buffered bytes included.
    size: u64,
    /// Index file length, buffered bytes included.
    index_len: u64,
}

/// The segment appends go to.
struct Active {
    data: Arc<File>,
    index: File,
    data_written: u64,
    /// Bytes of the data file a completed fsync covered: a group commit with nothing
    /// written past them needs no fsync of its own.
    data_durable: u64,
    index_written: u64,
    buf: Vec<u8>,
    ibuf: Vec<u8>,
}

#[derive(Default)]
struct Tracking {
    /// (kind, name) -> (value, update stamp).
    entries: BTreeMap<(TrackingKind, Vec<u8>), (u64, u64)>,
    stamp: u64,
}

impl Tracking {
    fn get(&self, kind: TrackingKind, name: &[u8]) -> Option<u64> {
        self.entries.get(&(kind, name.to_vec())).map(|e| e.0)
    }

    fn set(&mut self, kind: TrackingKind, name: &[u8], value: u64, max: usize) {
        self.stamp += 1;
        let key = (kind, name.to_vec());
        if !self.entries.contains_key(&key) {
            let of_kind = self.entries.keys().filter(|k| k.0 == kind).count();
            if of_kind >= max.max(1) {
                let oldest = self
                    .entries
                    .iter()
                    .filter(|(k, _)| k.0 == kind)
                    .min_by_key(|(_, v)| v.1)
                    .map(|(k, _)| k.clone());
                if let Some(k) = oldest {
                    self.entries.remove(&k);
                }
            }
        }
        self.entries.insert(key, (value, self.stamp));
    }

    fn apply(&mut self, body: &[u8], path: &Path, pos: u64, max: usize) -> Result<(), StreamError> {
        for e in format::tracking_entries(body) {
            let (kind, name, value) = e.map_err(|e| StreamError::Corrupt {
                path: path.to_path_buf(),
                pos,
                reason: e.to_string(),
            })?;
            if kind == TrackingKind::Filter {
                // A chunk's filter, not state.
                continue;
            }
            self.set(kind, name, value, max);
        }
        Ok(())
    }
}

/// A sync begun by [`StreamLog::begin_sync`]: the fsyncs to run outside the writer's lock.
pub struct PendingSync {
    data: Option<Arc<File>>,
    path: PathBuf,
    dir: Option<PathBuf>,
    next: u64,
    /// The segment (its first offset) and its bytes written when the sync began.
    segment: u64,
    written: u64,
}

impl PendingSync {
    /// Offsets below this are durable once [`PendingSync::wait`] returns.
    pub fn next_offset(&self) -> u64 {
        self.next
    }

    /// Whether [`PendingSync::wait`] fsyncs the data file (not when a completed sync
    /// already covered every byte written).
    pub fn fsyncs_data(&self) -> bool {
        self.data.is_some()
    }

    /// Whether [`PendingSync::wait`] has anything to do (an fsync of the data file or of
    /// the directory); without, it returns at once and needs no thread of its own.
    pub fn blocks(&self) -> bool {
        self.data.is_some() || self.dir.is_some()
    }

    /// Runs the fsyncs (blocking: call it off the async executor).
    pub fn wait(&self) -> Result<(), StreamError> {
        if let Some(data) = &self.data {
            data.sync_data().map_err(io_err(&self.path))?;
        }
        if let Some(dir) = &self.dir {
            File::open(dir)
                .and_then(|d| d.sync_all())
                .map_err(io_err(dir))?;
        }
        Ok(())
    }
}

/// See the module docs.
pub struct StreamLog {
    config: StreamConfig,
    shared: Arc<Shared>,
    segments: Vec<Segment>,
    active: Active,
    next_offset: u64,
    last_ts: u64,
    tracking: Tracking,
    /// Segment files were created or deleted since the last directory fsync.
    dir_dirty: bool,
    failed: Option<String>,
    /// Messages [`StreamLog::append_merged`] staged, not yet a chunk (empty: none).
    open: OpenChunk,
    /// First offset of the newest user chunk written (Deliver v2's committed chunk id).
    last_chunk: Option<u64>,
}

/// The chunk [`StreamLog::append_merged`] is filling: the stream protocol's Publish frames
/// queued for one stream between two writes become one chunk, as osiris's writer merges
/// what its mailbox holds. It becomes a chunk ("sealed") before anything else is written
/// (a flush, a sync, a tracking chunk, an unmerged append) and when the next batch would not
/// fit. Its offsets are taken (`bounds().next` counts them) but it has no place in a segment
/// yet, so a roll before the seal starts the new segment at its first offset.
#[derive(Default)]
struct OpenChunk {
    /// Room for the chunk's header, then the messages as its data section holds them
    /// (`format::put_message`); empty while nothing is staged.
    data: Vec<u8>,
    /// Records (offsets) staged.
    count: usize,
    /// Entries staged: one per message, one per sub-batch (`append_merged_sub_batch`).
    entries: usize,
    filter: bloom::Builder,
    /// Publisher reference -> highest publishing id in the chunk (stored in its trailer;
    /// the tracking state takes them when the chunk is written).
    publishers: Vec<(String, u64)>,
    /// The newest timestamp of the merged batches.
    ts: u64,
}

impl OpenChunk {
    /// A batch was staged at `timestamp_ms` with these publishers' highest ids.
    fn staged(&mut self, timestamp_ms: u64, publishers: &[(&str, u64)]) {
        self.ts = self.ts.max(timestamp_ms);
        for (name, seq) in publishers {
            match self.publishers.iter_mut().find(|(n, _)| n == name) {
                Some((_, v)) => *v = (*v).max(*seq),
                None => self.publishers.push((name.to_string(), *seq)),
            }
        }
    }
}

impl StreamLog {
    /// Opens the stream in `dir` (created if missing), recovering it: the newest segment is
    /// verified chunk by chunk and a torn tail cut off, indexes missing or behind are rebuilt,
    /// the tracking state replayed. One writer per directory: the caller holds the data
    /// directory's lock (`lock::DirLock`), as for every other file of the store.
    pub fn open(dir: &Path, config: StreamConfig) -> Result<StreamLog, StreamError> {
        fs::create_dir_all(dir).map_err(io_err(dir))?;
        let mut firsts = Vec::new();
        let mut indexes = Vec::new();
        for entry in fs::read_dir(dir).map_err(io_err(dir))? {
            let entry = entry.map_err(io_err(dir))?;
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            let parse = |stem: &str| {
                (stem.len() == 16)
                    .then(|| u64::from_str_radix(stem, 16).ok())
                    .flatten()
            };
            if let Some(first) = name.strip_suffix(".sd").and_then(parse) {
                firsts.push(first);
            } else if let Some(first) = name.strip_suffix(".si").and_then(parse) {
                indexes.push(first);
            }
        }
        firsts.sort_unstable();
        for orphan in indexes.iter().filter(|i| firsts.binary_search(i).is_err()) {
            // Its data file was deleted by retention before the index (a crash between).
            let path = index_path(dir, *orphan);
            fs::remove_file(&path).map_err(io_err(&path))?;
        }
        let shared = Arc::new(Shared {
            dir: dir.to_path_buf(),
            committed: AtomicU64::new(0),
            segments: Mutex::new(Vec::new()),
        });
        let mut segments: Vec<Segment> = Vec::with_capacity(firsts.len());
        let last = firsts.len().saturating_sub(1);
        for (i, &first) in firsts.iter().enumerate() {
            let seg = if i == last {
                recover_segment(dir, first)?
            } else {
                match check_segment(dir, first)? {
                    Some(seg) => seg,
                    None => {
                        tracing::warn!(segment = %data_path(dir, first).display(), "stream: index missing or behind its segment; rebuilt");
                        recover_segment(dir, first)?
                    }
                }
            };
            if let Some(prev) = segments.last()
                && seg.first_offset != prev.next_offset
            {
                tracing::warn!(segment = %data_path(dir, first).display(), expected = prev.next_offset, "stream: offsets missing before this segment (a segment was damaged)");
            }
            segments.push(seg);
        }
        let active = match segments.last() {
            Some(seg) => open_active(dir, seg)?,
            None => {
                let (active, seg) = create_segment(dir, 0)?;
                segments.push(seg);
                active
            }
        };
        let (next_offset, last_ts) = segments
            .last()
            .map(|s| (s.next_offset, s.last_ts))
            .unwrap_or((0, 0));
        let mut log = StreamLog {
            config,
            shared,
            segments,
            active,
            next_offset,
            last_ts,
            tracking: Tracking::default(),
            dir_dirty: true,
            failed: None,
            open: OpenChunk::default(),
            last_chunk: None,
        };
        if !log.replay_tracking()? {
            // A new stream, or a roll whose snapshot was torn: the newest segment must hold
            // the state, or retention could delete the only copy.
            let ts = log.last_ts;
            log.write_snapshot(ts)?;
        }
        log.shared
            .set_segments(log.segments.iter().map(|s| s.first_offset).collect());
        // What recovery kept may have reached only the page cache before a crash of the
        // process: make it durable before readers see it as committed.
        log.sync()?;
        // After the sync: the index entries it wrote (a new snapshot's) are in the file.
        log.last_chunk = log.last_user_chunk()?;
        Ok(log)
    }

    /// The first offset of the newest user chunk on disk (`None`: none), from the index,
    /// newest entry first: tracking chunks between are passed over.
    fn last_user_chunk(&self) -> Result<Option<u64>, StreamError> {
        for (i, seg) in self.segments.iter().enumerate().rev() {
            let path = index_path(&self.shared.dir, seg.first_offset);
            let opened;
            let file = if i + 1 == self.segments.len() {
                &self.active.index
            } else {
                opened = File::open(&path).map_err(io_err(&path))?;
                &opened
            };
            let n = seg.index_len.saturating_sub(FILE_HEADER as u64) / INDEX_ENTRY as u64;
            for k in (0..n).rev() {
                let mut e = [0u8; INDEX_ENTRY];
                let at = FILE_HEADER as u64 + k * INDEX_ENTRY as u64;
                file.read_exact_at(&mut e, at).map_err(io_err(&path))?;
                match IndexEntry::decode(&e) {
                    Some(e) if e.kind == ChunkType::User => return Ok(Some(e.first_offset)),
                    Some(_) => {}
                    None => {
                        return Err(StreamError::Corrupt {
                            path,
                            pos: at,
                            reason: "bad index entry".into(),
                        });
                    }
                }
            }
        }
        Ok(None)
    }

    pub fn dir(&self) -> &Path {
        &self.shared.dir
    }

    /// Changes the retention and segment size (a policy changed); retention applies at the
    /// next roll or `retain`.
    pub fn set_limits(
        &mut self,
        max_length_bytes: Option<u64>,
        max_age_ms: Option<u64>,
        max_segment_size_bytes: Option<u64>,
    ) {
        self.config.max_length_bytes = max_length_bytes;
        self.config.max_age_ms = max_age_ms;
        if let Some(n) = max_segment_size_bytes {
            self.config.max_segment_size_bytes = n.max(1);
        }
    }

    pub fn bounds(&self) -> Bounds {
        Bounds {
            first: self.segments.first().map_or(0, |s| s.first_offset),
            next: self.next_offset + self.open.count as u64,
            committed: self.shared.committed.load(Ordering::Acquire),
        }
    }

    /// Bytes on disk (and buffered) in all segments.
    pub fn size_bytes(&self) -> u64 {
        self.segments.iter().map(|s| s.size).sum()
    }

    pub fn segment_count(&self) -> usize {
        self.segments.len()
    }

    /// Bytes `append` has buffered (staged messages included).
    pub fn buffered_bytes(&self) -> usize {
        self.active.buf.len() + self.active.ibuf.len() + self.open.data.len()
    }

    /// First offset of the newest user chunk written (found in the index at open).
    pub fn last_chunk(&self) -> Option<u64> {
        self.last_chunk
    }

    /// A reader positioned by `spec` (see [`OffsetSpec`]).
    pub fn reader(
        &mut self,
        spec: OffsetSpec,
        options: ReaderOptions,
    ) -> Result<StreamReader, StreamError> {
        // Seeks read the index files; buffered entries must be in them.
        self.flush()?;
        let first = self.segments.first().map_or(0, |s| s.first_offset);
        let last = spec == OffsetSpec::Last;
        let spec = match spec {
            OffsetSpec::Last if self.next_offset > first => {
                OffsetSpec::Offset(self.next_offset - 1)
            }
            OffsetSpec::Last => OffsetSpec::Next,
            OffsetSpec::Offset(o) if o <= first => OffsetSpec::First,
            OffsetSpec::Offset(o) if o >= self.next_offset => OffsetSpec::Next,
            other => other,
        };
        let (seg_first, position, offset, start) = match spec {
            OffsetSpec::First => (first, FILE_HEADER as u64, first, first),
            OffsetSpec::Next | OffsetSpec::Last => {
                let seg = self.last_segment()?;
                (
                    seg.first_offset,
                    seg.size,
                    self.next_offset,
                    self.next_offset,
                )
            }
            OffsetSpec::Offset(o) => {
                let i = self
                    .segments
                    .partition_point(|s| s.first_offset <= o)
                    .saturating_sub(1);
                let seg = &self.segments[i];
                let (entry, _) = self.search_index(i, |e| e.first_offset <= o)?;
                match entry {
                    Some(e) => {
                        let start = if last { e.first_offset } else { o };
                        (seg.first_offset, e.position, e.first_offset, start)
                    }
                    None => (seg.first_offset, FILE_HEADER as u64, seg.first_offset, o),
                }
            }
            OffsetSpec::Timestamp(t) => {
                match self
                    .segments
                    .iter()
                    .position(|s| s.last_ts >= t && s.next_offset > s.first_offset)
                {
                    None => {
                        let seg = self.last_segment()?;
                        (
                            seg.first_offset,
                            seg.size,
                            self.next_offset,
                            self.next_offset,
                        )
                    }
                    Some(i) => {
                        let seg = &self.segments[i];
                        match self.search_index(i, |e| e.timestamp < t)? {
                            (_, Some(e)) => {
                                (seg.first_offset, e.position, e.first_offset, e.first_offset)
                            }
                            // Not reached: the segment's newest chunk is at or after `t`.
                            (_, None) => {
                                (seg.first_offset, seg.size, seg.next_offset, seg.next_offset)
                            }
                        }
                    }
                }
            }
        };
        Ok(StreamReader::new(
            self.shared.clone(),
            options,
            seg_first,
            position,
            offset,
            start,
        ))
    }

    fn last_segment(&self) -> Result<&Segment, StreamError> {
        self.segments.last().ok_or_else(|| StreamError::Corrupt {
            path: self.shared.dir.clone(),
            pos: 0,
            reason: "no segment".into(),
        })
    }

    /// Bisects segment `i`'s index (`pred` must hold for a prefix: entries are ordered by
    /// offset and by timestamp): the last entry for which `pred` holds and the first for
    /// which it does not.
    fn search_index(
        &self,
        i: usize,
        pred: impl Fn(&IndexEntry) -> bool,
    ) -> Result<(Option<IndexEntry>, Option<IndexEntry>), StreamError> {
        let seg = &self.segments[i];
        let path = index_path(&self.shared.dir, seg.first_offset);
        let opened;
        let file = if i + 1 == self.segments.len() {
            &self.active.index
        } else {
            opened = File::open(&path).map_err(io_err(&path))?;
            &opened
        };
        let entry = |k: u64| -> Result<IndexEntry, StreamError> {
            let mut e = [0u8; INDEX_ENTRY];
            let at = FILE_HEADER as u64 + k * INDEX_ENTRY as u64;
            file.read_exact_at(&mut e, at).map_err(io_err(&path))?;
            IndexEntry::decode(&e).ok_or_else(|| StreamError::Corrupt {
                path: path.clone(),
                pos: at,
                reason: "bad index entry".into(),
            })
        };
        let n = seg.index_len.saturating_sub(FILE_HEADER as u64) / INDEX_ENTRY as u64;
        let (mut lo, mut hi) = (0u64, n);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if pred(&entry(mid)?) {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        let before = lo.checked_sub(1).map(&entry).transpose()?;
        let after = if lo < n { Some(entry(lo)?) } else { None };
        Ok((before, after))
    }

    /// Removes the stream's directory (the stream was deleted).
    pub fn destroy(self) -> Result<(), StreamError> {
        let dir = self.shared.dir.clone();
        drop(self);
        fs::remove_dir_all(&dir).map_err(io_err(&dir))
    }
}

impl Drop for StreamLog {
    /// Written out, not fsynced: what was never synced was never confirmed.
    fn drop(&mut self) {
        if self.failed.is_none()
            && let Err(e) = self.flush()
        {
            tracing::warn!(error = %e, "stream: writing buffers out at close failed");
        }
    }
}

impl StreamStore for StreamLog {
    type Reader = StreamReader;

    fn append(
        &mut self,
        messages: &[&[u8]],
        timestamp_ms: u64,
        publishers: &[(&str, u64)],
    ) -> Result<Range<u64>, StreamError> {
        StreamLog::append(self, messages, timestamp_ms, publishers)
    }

    fn store_offsets(
        &mut self,
        consumers: &[(&str, u64)],
        timestamp_ms: u64,
    ) -> Result<(), StreamError> {
        StreamLog::store_offsets(self, consumers, timestamp_ms)
    }

    fn sync(&mut self) -> Result<Option<u64>, StreamError> {
        StreamLog::sync(self)
    }

    fn retain(&mut self, now_ms: u64) -> Result<Retained, StreamError> {
        StreamLog::retain(self, now_ms)
    }

    fn reader(
        &mut self,
        spec: OffsetSpec,
        options: ReaderOptions,
    ) -> Result<StreamReader, StreamError> {
        StreamLog::reader(self, spec, options)
    }

    fn publisher_sequence(&self, publisher: &str) -> Option<u64> {
        StreamLog::publisher_sequence(self, publisher)
    }

    fn consumer_offset(&self, consumer: &str) -> Option<u64> {
        StreamLog::consumer_offset(self, consumer)
    }

    fn bounds(&self) -> Bounds {
        StreamLog::bounds(self)
    }
}
