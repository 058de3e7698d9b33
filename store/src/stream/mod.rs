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

    fn check_ok(&self) -> Result<(), StreamError> {
        match &self.failed {
            Some(e) => Err(StreamError::Failed(e.clone())),
            None => Ok(()),
        }
    }

    /// Refuses a chunk of `len` bytes if the buffer would pass its limit (an empty buffer
    /// takes any chunk: it is written out at the next flush).
    fn reserve(&self, len: usize) -> Result<(), StreamError> {
        let buffered = self.buffered_bytes();
        if buffered > 0 && buffered + len + INDEX_ENTRY > self.config.buffer_limit_bytes {
            return Err(StreamError::Backpressure {
                buffered,
                limit: self.config.buffer_limit_bytes,
            });
        }
        Ok(())
    }

    /// Appends `messages` as one chunk stamped `timestamp_ms` (raised to the previous
    /// chunk's, so timestamps never decrease and seeks by time can bisect). Nothing is
    /// durable or visible to readers before [`StreamLog::sync`].
    pub fn append<M: AsRef<[u8]>>(
        &mut self,
        messages: &[M],
        timestamp_ms: u64,
        publishers: &[(&str, u64)],
    ) -> Result<Range<u64>, StreamError> {
        self.append_filtered(messages, &[], timestamp_ms, publishers)
    }

    /// [`StreamLog::append`], with the messages' filter values (stream filtering; empty or
    /// all `None`: none): when one is set, the chunk's trailer carries their Bloom filter
    /// (`bloom.rs`), which filtered readers check before reading the chunk.
    pub fn append_filtered<M: AsRef<[u8]>>(
        &mut self,
        messages: &[M],
        filter_values: &[Option<&str>],
        timestamp_ms: u64,
        publishers: &[(&str, u64)],
    ) -> Result<Range<u64>, StreamError> {
        let data_len = check_batch(messages)?;
        for (name, _) in publishers {
            check_name(name)?;
        }
        self.seal()?;
        let publishers: Vec<(&[u8], u64)> =
            publishers.iter().map(|(n, v)| (n.as_bytes(), *v)).collect();
        self.put_user_chunk(
            (messages.len(), messages.len()),
            data_len,
            |buf| {
                buf.extend_from_slice(&[0u8; CHUNK_HEADER]);
                for m in messages {
                    format::put_message(buf, m.as_ref());
                }
            },
            bloom::build(filter_values),
            &publishers,
            timestamp_ms,
            true,
        )
    }

    /// [`StreamLog::append_filtered`], except that the batch joins the messages staged since
    /// the last write into one chunk (see `OpenChunk`) instead of making its own: the
    /// stream protocol's path, where a chunk per Publish frame would cost a header, an index
    /// entry and CRCs per frame. A batch is never split; it starts a new chunk when the
    /// staged one would pass `MAX_CHUNK_MESSAGES` or the write buffer's limit. The offsets
    /// are the batch's; nothing is durable or visible before the next sync, as for
    /// [`StreamLog::append`].
    pub fn append_merged<M: AsRef<[u8]>>(
        &mut self,
        messages: &[M],
        filter_values: &[Option<&str>],
        timestamp_ms: u64,
        publishers: &[(&str, u64)],
    ) -> Result<Range<u64>, StreamError> {
        self.append_merged_iter(
            messages
                .iter()
                .enumerate()
                .map(|(i, m)| (m.as_ref(), filter_values.get(i).copied().flatten())),
            None,
            timestamp_ms,
            publishers,
        )
    }

    /// [`StreamLog::append_merged`] over an iterator of (message, filter value): callers hand
    /// borrowed slices of what they received (a Publish frame) without collecting them
    /// first. `sized`: the message count and data-section bytes when the caller knows them
    /// (its parse counted them), so the messages are walked once, as they are staged (a
    /// batch that turns out to differ is unstaged and refused); `None`: walked twice.
    pub fn append_merged_iter<'m, I>(
        &mut self,
        messages: I,
        sized: Option<(usize, u64)>,
        timestamp_ms: u64,
        publishers: &[(&str, u64)],
    ) -> Result<Range<u64>, StreamError>
    where
        I: Iterator<Item = (&'m [u8], Option<&'m str>)> + Clone,
    {
        self.check_ok()?;
        let (count, data_len) = match sized {
            Some((count, data_len)) => check_sizes(count, data_len)?,
            None => check_batch_iter(messages.clone().map(|(m, _)| m))?,
        };
        for (name, _) in publishers {
            check_name(name)?;
        }
        self.seal_unless_room(count, count, data_len)?;
        // Room for the batch and its share of a chunk's header and trailer.
        let trailer: usize = publishers
            .iter()
            .map(|(n, _)| format::tracking_entry_len(n.as_bytes()))
            .sum::<usize>()
            + format::tracking_entry_len(&[0u8; bloom::FILTER_BYTES]);
        self.reserve(CHUNK_HEADER + data_len as usize + trailer)?;
        let o = &mut self.open;
        let first = self.next_offset + o.count as u64;
        if o.data.is_empty() {
            // Room for the chunk's header: sealed into an empty write buffer, the staged
            // bytes become that buffer as they are (no copy).
            o.data.extend_from_slice(&[0u8; CHUNK_HEADER]);
        }
        o.data.reserve(data_len as usize);
        let mark = o.data.len();
        let (mut n, mut len, mut too_big) = (0usize, 0u64, false);
        for (m, filter) in messages {
            too_big |= m.len() > MAX_MESSAGE;
            format::put_message(&mut o.data, m);
            o.filter.add(filter);
            n += 1;
            len += 4 + m.len() as u64;
        }
        if (n, len) != (count, data_len) || too_big {
            // Only a caller's wrong `sized` gets here. (Filter bits it added stay: at worst a
            // false positive for a filtered reader.)
            o.data.truncate(if o.count == 0 { 0 } else { mark });
            return Err(StreamError::Invalid(format!(
                "a batch said to hold {count} messages of {data_len} bytes holds {n} of {len}"
            )));
        }
        o.count += count;
        o.entries += count;
        o.staged(timestamp_ms, publishers);
        Ok(first..first + count as u64)
    }

    /// Seals the staged chunk if `entries` more entries of `records` records and `data_len`
    /// bytes would take it past `merge_entries`, the format's record count or the write
    /// buffer's limit.
    fn seal_unless_room(
        &mut self,
        entries: usize,
        records: usize,
        data_len: u64,
    ) -> Result<(), StreamError> {
        let o = &self.open;
        if o.count > 0
            && (o.entries + entries > MAX_CHUNK_MESSAGES.min(self.config.merge_entries)
                || o.count + records > MAX_CHUNK_MESSAGES
                || o.data.len() as u64 + data_len
                    > (self.config.buffer_limit_bytes as u64).min(MAX_CHUNK_BODY / 2))
        {
            self.seal()?;
        }
        Ok(())
    }

    /// Stages one sub-batch entry of the stream protocol (`entry`: its wire layout, header
    /// included; see `sub_batch`) as one entry of its `count` records in the staged chunk, as
    /// osiris stores it: delivered to stream clients as written, its records counted in
    /// offsets, expanded for the AMQP side. Merged as [`StreamLog::append_merged`] merges;
    /// `filter` is the publisher's filter value for all of its records. A codec the log does
    /// not serve, or bytes that are not one sub-batch, are refused (`Invalid`).
    pub fn append_merged_sub_batch(
        &mut self,
        entry: &[u8],
        filter: Option<&str>,
        timestamp_ms: u64,
        publishers: &[(&str, u64)],
    ) -> Result<Range<u64>, StreamError> {
        self.check_ok()?;
        let h = sub_batch::SubBatch::parse(entry)
            .filter(|h| h.count > 0 && sub_batch::HEADER + h.size as usize == entry.len())
            .ok_or_else(|| StreamError::Invalid("not a sub-batch entry".into()))?;
        if !sub_batch::served(h.compression) {
            return Err(StreamError::Invalid(format!(
                "sub-batch compression {} is not served (none and gzip are)",
                h.compression
            )));
        }
        for (name, _) in publishers {
            check_name(name)?;
        }
        let count = usize::from(h.count);
        let data_len = entry.len() as u64;
        check_sizes(count, data_len)?;
        self.seal_unless_room(1, count, data_len)?;
        let trailer: usize = publishers
            .iter()
            .map(|(n, _)| format::tracking_entry_len(n.as_bytes()))
            .sum::<usize>()
            + format::tracking_entry_len(&[0u8; bloom::FILTER_BYTES]);
        self.reserve(CHUNK_HEADER + entry.len() + trailer)?;
        let o = &mut self.open;
        let first = self.next_offset + o.count as u64;
        if o.data.is_empty() {
            o.data.extend_from_slice(&[0u8; CHUNK_HEADER]);
        }
        o.data.extend_from_slice(entry);
        o.filter.add(filter);
        o.count += count;
        o.entries += 1;
        o.staged(timestamp_ms, publishers);
        Ok(first..first + count as u64)
    }

    /// Writes the staged messages (`append_merged`) into the buffer as one chunk.
    fn seal(&mut self) -> Result<(), StreamError> {
        if self.open.count == 0 {
            return Ok(());
        }
        let mut o = std::mem::take(&mut self.open);
        let publishers: Vec<(&[u8], u64)> = o
            .publishers
            .iter()
            .map(|(n, v)| (n.as_bytes(), *v))
            .collect();
        // Its bytes were admitted at staging (`reserve`): no backpressure now, which would
        // lose them.
        let data = &mut o.data;
        let sealed = self.put_user_chunk(
            (o.entries, o.count),
            (data.len() - CHUNK_HEADER) as u64,
            |buf| {
                if buf.is_empty() {
                    // The usual case (the buffer was written out at the last flush): the
                    // staged chunk, its header's room included, becomes the buffer; the
                    // emptied buffer, with its capacity, stages the next one.
                    std::mem::swap(buf, data);
                } else {
                    buf.extend_from_slice(data);
                }
            },
            o.filter.finish(),
            &publishers,
            o.ts,
            false,
        );
        if let Err(e) = &sealed {
            // Offsets were handed out for these messages: the log cannot go on without them.
            self.failed = Some(e.to_string());
        }
        // The staging buffer keeps its capacity (at most about the write buffer's limit): a
        // fresh one per chunk would grow by doubling and fault its pages in at every write.
        drop(publishers);
        o.data.clear();
        self.open.data = o.data;
        sealed.map(|_| ())
    }

    /// Puts one user chunk in the buffer: room for its header and `data_len` bytes of
    /// messages (`count` of them) written by `write_data`, then the trailer (publishers,
    /// Bloom filter).
    #[allow(clippy::too_many_arguments)]
    fn put_user_chunk(
        &mut self,
        (entries, count): (usize, usize),
        data_len: u64,
        write_data: impl FnOnce(&mut Vec<u8>),
        filter: Option<(Vec<u8>, u64)>,
        publishers: &[(&[u8], u64)],
        timestamp_ms: u64,
        check_room: bool,
    ) -> Result<Range<u64>, StreamError> {
        self.check_ok()?;
        let mut trailer_len = 0u64;
        for (name, _) in publishers {
            trailer_len += format::tracking_entry_len(name) as u64;
        }
        if let Some((bits, _)) = &filter {
            trailer_len += format::tracking_entry_len(bits) as u64;
        }
        if data_len + trailer_len > MAX_CHUNK_BODY {
            return Err(StreamError::Invalid(format!(
                "a chunk of {} bytes (limit {MAX_CHUNK_BODY})",
                data_len + trailer_len
            )));
        }
        let total = CHUNK_HEADER as u64 + data_len + trailer_len;
        if check_room {
            self.reserve(total as usize)?;
        }
        let ts = timestamp_ms.max(self.last_ts);
        self.maybe_roll(total, ts)?;
        let first = self.next_offset;
        let buf = &mut self.active.buf;
        let start = buf.len();
        write_data(buf);
        let data_end = buf.len();
        debug_assert_eq!((data_end - start - CHUNK_HEADER) as u64, data_len);
        for (name, seq) in publishers {
            format::put_tracking(buf, TrackingKind::Publisher, name, *seq);
        }
        if let Some((bits, flags)) = &filter {
            format::put_tracking(buf, TrackingKind::Filter, bits, *flags);
        }
        let header = ChunkHeader {
            kind: ChunkType::User,
            entries: entries as u16,
            first_offset: first,
            count: count as u32,
            data_len: data_len as u32,
            trailer_len: trailer_len as u32,
            timestamp: ts,
            data_crc: crc32fast::hash(&buf[start + CHUNK_HEADER..data_end]),
            trailer_crc: crc32fast::hash(&buf[data_end..]),
        };
        buf[start..start + CHUNK_HEADER].copy_from_slice(&header.encode());
        self.indexed(&header);
        self.last_chunk = Some(first);
        for (name, seq) in publishers {
            self.tracking
                .set(TrackingKind::Publisher, name, *seq, self.config.max_tracked);
        }
        Ok(first..self.next_offset)
    }

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

    fn write_tracking(
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
    fn write_snapshot(&mut self, ts: u64) -> Result<(), StreamError> {
        let entries: Vec<_> = self
            .tracking
            .entries
            .iter()
            .map(|((k, n), (v, _))| (*k, n.clone(), *v))
            .collect();
        self.write_tracking(ChunkType::TrackingSnapshot, &entries, ts, false)
    }

    /// Books a chunk just put in the buffer: its index entry and the segment's summary.
    fn indexed(&mut self, header: &ChunkHeader) {
        let Some(seg) = self.segments.last_mut() else {
            return;
        };
        let entry = IndexEntry::of(header, seg.size);
        self.active.ibuf.extend_from_slice(&entry.encode());
        seg.size += header.total_len();
        seg.index_len += INDEX_ENTRY as u64;
        seg.next_offset = header.next_offset();
        seg.last_ts = header.timestamp;
        self.next_offset = header.next_offset();
        self.last_ts = header.timestamp;
    }

    fn maybe_roll(&mut self, chunk: u64, ts: u64) -> Result<(), StreamError> {
        let Some(seg) = self.segments.last() else {
            return Ok(());
        };
        // A segment holding no message yet takes any chunk (no empty segments).
        if seg.next_offset > seg.first_offset
            && seg.size + chunk > self.config.max_segment_size_bytes
        {
            self.roll(ts)?;
        }
        Ok(())
    }

    /// Closes the active segment (written and fsynced: segments before the newest are
    /// complete, so recovery needs to verify only the newest) and starts one at
    /// `next_offset`, beginning with a tracking snapshot; then applies retention.
    fn roll(&mut self, ts: u64) -> Result<(), StreamError> {
        self.flush()?;
        if self.config.fsync {
            let first = self.segments.last().map_or(0, |s| s.first_offset);
            let path = data_path(&self.shared.dir, first);
            self.active.data.sync_data().map_err(io_err(&path))?;
            let path = index_path(&self.shared.dir, first);
            self.active.index.sync_data().map_err(io_err(&path))?;
        }
        let (active, seg) = create_segment(&self.shared.dir, self.next_offset)?;
        self.active = active;
        self.segments.push(seg);
        self.dir_dirty = true;
        self.write_snapshot(ts)?;
        self.shared
            .set_segments(self.segments.iter().map(|s| s.first_offset).collect());
        self.retain(ts)?;
        Ok(())
    }

    /// Writes the buffers out (data, then index) to the OS; no fsync.
    pub fn flush(&mut self) -> Result<(), StreamError> {
        self.check_ok()?;
        self.seal()?;
        let first = self.segments.last().map_or(0, |s| s.first_offset);
        let a = &mut self.active;
        if !a.buf.is_empty() {
            if let Err(e) = a.data.write_all_at(&a.buf, a.data_written) {
                let path = data_path(&self.shared.dir, first);
                self.failed = Some(e.to_string());
                return Err(io_err(&path)(e));
            }
            a.data_written += a.buf.len() as u64;
            a.buf.clear();
            // A chunk bigger than the limit passed through: give its memory back.
            a.buf.shrink_to(self.config.buffer_limit_bytes);
        }
        if !a.ibuf.is_empty() {
            if let Err(e) = a.index.write_all_at(&a.ibuf, a.index_written) {
                let path = index_path(&self.shared.dir, first);
                self.failed = Some(e.to_string());
                return Err(io_err(&path)(e));
            }
            a.index_written += a.ibuf.len() as u64;
            a.ibuf.clear();
        }
        Ok(())
    }

    /// Writes out and fsyncs what was appended, then lets readers see it; returns the highest
    /// durable offset. Only the data file is fsynced here: recovery verifies the newest
    /// segment chunk by chunk and rebuilds its index, so its index need not be durable
    /// (saving one fsync per group commit); older segments' indexes were fsynced at roll.
    pub fn sync(&mut self) -> Result<Option<u64>, StreamError> {
        self.flush()?;
        if self.config.fsync {
            let first = self.segments.last().map_or(0, |s| s.first_offset);
            if let Err(e) = self.active.data.sync_data() {
                self.failed = Some(e.to_string());
                return Err(io_err(&data_path(&self.shared.dir, first))(e));
            }
            self.active.data_durable = self.active.data_written;
            if self.dir_dirty {
                let dir = &self.shared.dir;
                File::open(dir)
                    .and_then(|d| d.sync_all())
                    .map_err(io_err(dir))?;
                self.dir_dirty = false;
            }
        }
        self.shared
            .committed
            .store(self.next_offset, Ordering::Release);
        Ok(self.next_offset.checked_sub(1))
    }

    /// Group commit in two steps, so the fsync runs without the writer's lock: writes the
    /// buffers out and returns what [`PendingSync::wait`] must fsync; appends may go on
    /// meanwhile (a roll fsyncs the segment it closes itself); [`StreamLog::end_sync`] then
    /// lets readers see the offsets the pending sync covered. [`StreamLog::sync`] in one call.
    pub fn begin_sync(&mut self) -> Result<PendingSync, StreamError> {
        self.flush()?;
        let first = self.segments.last().map_or(0, |s| s.first_offset);
        let dir = (self.config.fsync && std::mem::take(&mut self.dir_dirty))
            .then(|| self.shared.dir.clone());
        // Nothing written since a completed fsync (another sync made it durable, or only
        // tracking state that is already out): no fsync. A sync still in flight does not
        // count: its bytes are not durable until it completes.
        let needed = self.active.data_written > self.active.data_durable;
        Ok(PendingSync {
            data: (self.config.fsync && needed).then(|| self.active.data.clone()),
            path: data_path(&self.shared.dir, first),
            dir,
            next: self.next_offset,
            segment: first,
            written: self.active.data_written,
        })
    }

    /// Completes a [`StreamLog::begin_sync`] with its [`PendingSync::wait`] result: the
    /// highest durable offset, or the error (the log then refuses further writes).
    pub fn end_sync(
        &mut self,
        pending: &PendingSync,
        waited: Result<(), StreamError>,
    ) -> Result<Option<u64>, StreamError> {
        if let Err(e) = waited {
            self.failed = Some(e.to_string());
            return Err(e);
        }
        self.check_ok()?;
        if self.segments.last().map_or(0, |s| s.first_offset) == pending.segment {
            self.active.data_durable = self.active.data_durable.max(pending.written);
        }
        self.shared
            .committed
            .fetch_max(pending.next, Ordering::AcqRel);
        Ok(self.shared.committed.load(Ordering::Acquire).checked_sub(1))
    }

    /// Deletes whole oldest segments, never the active one, while the stream is larger than
    /// `max_length_bytes` or their newest chunk is older than `max_age_ms` at `now_ms`.
    pub fn retain(&mut self, now_ms: u64) -> Result<Retained, StreamError> {
        let mut done = Retained::default();
        while self.segments.len() > 1 {
            let total = self.size_bytes();
            let oldest = &self.segments[0];
            let too_big = self.config.max_length_bytes.is_some_and(|m| total > m);
            let too_old = self
                .config
                .max_age_ms
                .is_some_and(|a| oldest.last_ts.saturating_add(a) < now_ms);
            if !too_big && !too_old {
                break;
            }
            let seg = self.segments.remove(0);
            // Data first: an index left without its data is removed at open.
            for path in [
                data_path(&self.shared.dir, seg.first_offset),
                index_path(&self.shared.dir, seg.first_offset),
            ] {
                match fs::remove_file(&path) {
                    Ok(()) => {}
                    Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                    Err(e) => return Err(io_err(&path)(e)),
                }
            }
            done.segments += 1;
            done.bytes += seg.size;
            self.dir_dirty = true;
        }
        if done.segments > 0 {
            self.shared
                .set_segments(self.segments.iter().map(|s| s.first_offset).collect());
        }
        Ok(done)
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

    /// Replays the tracking state: from the newest segment that starts with a snapshot (or
    /// the oldest), every tracking chunk and every user chunk's trailer, in order. Whether the
    /// newest segment starts with a snapshot.
    fn replay_tracking(&mut self) -> Result<bool, StreamError> {
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

/// A batch's data section length, if it can be one chunk's messages.
fn check_batch<M: AsRef<[u8]>>(messages: &[M]) -> Result<u64, StreamError> {
    check_batch_iter(messages.iter().map(|m| m.as_ref())).map(|(_, len)| len)
}

/// `check_batch_iter`'s bounds on a batch's known count and data-section bytes.
fn check_sizes(count: usize, data_len: u64) -> Result<(usize, u64), StreamError> {
    if count == 0 || count > MAX_CHUNK_MESSAGES {
        return Err(StreamError::Invalid(format!(
            "a chunk holds 1 to {MAX_CHUNK_MESSAGES} messages, not {count}"
        )));
    }
    if data_len > MAX_CHUNK_BODY {
        return Err(StreamError::Invalid(format!(
            "a chunk of {data_len} bytes (limit {MAX_CHUNK_BODY})"
        )));
    }
    Ok((count, data_len))
}

/// The message count and data-section bytes of a batch, or why it cannot be one chunk.
fn check_batch_iter<'m>(
    messages: impl Iterator<Item = &'m [u8]>,
) -> Result<(usize, u64), StreamError> {
    let mut count = 0usize;
    let mut data_len = 0u64;
    for m in messages {
        if m.len() > MAX_MESSAGE {
            return Err(StreamError::Invalid(format!(
                "a message of {} bytes",
                m.len()
            )));
        }
        count += 1;
        data_len += 4 + m.len() as u64;
    }
    if count == 0 || count > MAX_CHUNK_MESSAGES {
        return Err(StreamError::Invalid(format!(
            "a chunk holds 1 to {MAX_CHUNK_MESSAGES} messages, not {count}"
        )));
    }
    if data_len > MAX_CHUNK_BODY {
        return Err(StreamError::Invalid(format!(
            "a chunk of {data_len} bytes (limit {MAX_CHUNK_BODY})"
        )));
    }
    Ok((count, data_len))
}

fn check_name(name: &str) -> Result<(), StreamError> {
    if name.is_empty() || name.len() > MAX_NAME {
        return Err(StreamError::Invalid(format!(
            "a tracking name of {} bytes (1 to {MAX_NAME})",
            name.len()
        )));
    }
    Ok(())
}

fn open_rw(path: &Path) -> Result<File, StreamError> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map_err(io_err(path))
}

/// A new segment's files with their headers written (durable with the next sync's directory
/// and data fsync; the index header with the roll's).
fn create_segment(dir: &Path, first: u64) -> Result<(Active, Segment), StreamError> {
    let dpath = data_path(dir, first);
    let ipath = index_path(dir, first);
    let data = open_rw(&dpath)?;
    let index = open_rw(&ipath)?;
    data.set_len(0).map_err(io_err(&dpath))?;
    index.set_len(0).map_err(io_err(&ipath))?;
    let header = FILE_HEADER as u64;
    let active = Active {
        data: Arc::new(data),
        index,
        data_written: 0,
        data_durable: 0,
        index_written: 0,
        buf: format::file_header(SEGMENT_MAGIC, first).to_vec(),
        ibuf: format::file_header(INDEX_MAGIC, first).to_vec(),
    };
    let seg = Segment {
        first_offset: first,
        next_offset: first,
        last_ts: 0,
        size: header,
        index_len: header,
    };
    Ok((active, seg))
}

fn open_active(dir: &Path, seg: &Segment) -> Result<Active, StreamError> {
    Ok(Active {
        data: Arc::new(open_rw(&data_path(dir, seg.first_offset))?),
        index: open_rw(&index_path(dir, seg.first_offset))?,
        data_written: seg.size,
        // Made durable by `open`'s sync before anything is read as committed.
        data_durable: 0,
        index_written: seg.index_len,
        buf: Vec::new(),
        ibuf: Vec::new(),
    })
}

/// Reads and verifies the chunk at `pos`: header, then data and trailer.
fn read_chunk_at(
    file: &File,
    path: &Path,
    pos: u64,
) -> Result<(ChunkHeader, Vec<u8>), StreamError> {
    let corrupt = |reason: String| StreamError::Corrupt {
        path: path.to_path_buf(),
        pos,
        reason,
    };
    let mut h = [0u8; CHUNK_HEADER];
    file.read_exact_at(&mut h, pos).map_err(io_err(path))?;
    let header = ChunkHeader::decode(&h).map_err(|e| corrupt(e.to_string()))?;
    let mut body = vec![0u8; (header.total_len() - CHUNK_HEADER as u64) as usize];
    file.read_exact_at(&mut body, pos + CHUNK_HEADER as u64)
        .map_err(io_err(path))?;
    header
        .verify_body(&body)
        .map_err(|e| corrupt(e.to_string()))?;
    Ok((header, body))
}

/// A segment before the newest: complete when it was rolled, so only its index is checked
/// (whole entries, the last one naming the last chunk, which ends the file). `None`: the
/// index must be rebuilt.
fn check_segment(dir: &Path, first: u64) -> Result<Option<Segment>, StreamError> {
    let dpath = data_path(dir, first);
    let ipath = index_path(dir, first);
    let data = File::open(&dpath).map_err(io_err(&dpath))?;
    let size = data.metadata().map_err(io_err(&dpath))?.len();
    let Ok(index) = File::open(&ipath) else {
        return Ok(None);
    };
    let index_len = index.metadata().map_err(io_err(&ipath))?.len();
    let mut h = [0u8; FILE_HEADER];
    if index.read_exact_at(&mut h, 0).is_err()
        || format::decode_file_header(INDEX_MAGIC, &h) != Some(first)
        || index_len < (FILE_HEADER + INDEX_ENTRY) as u64
        || !(index_len - FILE_HEADER as u64).is_multiple_of(INDEX_ENTRY as u64)
    {
        return Ok(None);
    }
    let mut e = [0u8; INDEX_ENTRY];
    if index
        .read_exact_at(&mut e, index_len - INDEX_ENTRY as u64)
        .is_err()
    {
        return Ok(None);
    }
    let Some(last) = IndexEntry::decode(&e) else {
        return Ok(None);
    };
    let mut ch = [0u8; CHUNK_HEADER];
    if data.read_exact_at(&mut ch, last.position).is_err() {
        return Ok(None);
    }
    match ChunkHeader::decode(&ch) {
        Ok(header)
            if header.first_offset == last.first_offset
                && last.position + header.total_len() == size =>
        {
            Ok(Some(Segment {
                first_offset: first,
                next_offset: header.next_offset(),
                last_ts: header.timestamp,
                size,
                index_len,
            }))
        }
        _ => Ok(None),
    }
}

/// Verifies a segment chunk by chunk (header, offsets, CRCs of data and trailer), cuts the
/// data file after the last whole chunk (a torn tail: short header, short data, checksum
/// mismatch), and makes the index match: entries that agree are kept, the rest rewritten.
/// Memory stays bounded whatever the segment's size (streamed through buffers).
fn recover_segment(dir: &Path, first: u64) -> Result<Segment, StreamError> {
    let dpath = data_path(dir, first);
    let ipath = index_path(dir, first);
    let data = open_rw(&dpath)?;
    let index = open_rw(&ipath)?;
    let file_len = data.metadata().map_err(io_err(&dpath))?.len();
    let mut h = [0u8; FILE_HEADER];
    let header_ok = data.read_exact_at(&mut h, 0).is_ok();
    match format::decode_file_header(SEGMENT_MAGIC, &h) {
        Some(f) if header_ok && f == first => {}
        _ if file_len < FILE_HEADER as u64 || h.iter().all(|b| *b == 0) => {
            // Created by a roll whose header never reached the disk.
            tracing::warn!(segment = %dpath.display(), "stream: segment header torn; rewritten");
            data.set_len(0).map_err(io_err(&dpath))?;
            data.write_all_at(&format::file_header(SEGMENT_MAGIC, first), 0)
                .map_err(io_err(&dpath))?;
        }
        _ => {
            return Err(StreamError::Corrupt {
                path: dpath,
                pos: 0,
                reason: "not a stream segment of this offset".into(),
            });
        }
    }
    let file_len = file_len.max(FILE_HEADER as u64);

    // The index: its header, then entries compared one by one with the scan.
    let index_len = index.metadata().map_err(io_err(&ipath))?.len();
    let mut ih = [0u8; FILE_HEADER];
    let index_header_ok = index.read_exact_at(&mut ih, 0).is_ok()
        && format::decode_file_header(INDEX_MAGIC, &ih) == Some(first);
    let old_entries = if index_header_ok {
        (index_len - FILE_HEADER as u64) / INDEX_ENTRY as u64
    } else {
        index.set_len(0).map_err(io_err(&ipath))?;
        index
            .write_all_at(&format::file_header(INDEX_MAGIC, first), 0)
            .map_err(io_err(&ipath))?;
        0
    };
    let mut old = BufReader::with_capacity(1 << 16, index.try_clone().map_err(io_err(&ipath))?);
    let mut skip = [0u8; FILE_HEADER];
    if index_header_ok {
        old.read_exact(&mut skip).map_err(io_err(&ipath))?;
    }
    // Set once the index diverges: the writer of the rest (from entry `k`).
    let mut rewrite: Option<BufWriter<File>> = None;

    let mut r = BufReader::with_capacity(1 << 20, File::open(&dpath).map_err(io_err(&dpath))?);
    let mut skip = [0u8; FILE_HEADER];
    r.read_exact(&mut skip).map_err(io_err(&dpath))?;
    let mut pos = FILE_HEADER as u64;
    let mut expected = first;
    let mut last_ts = 0;
    let mut k = 0u64;
    let mut body = Vec::new();
    let mut torn: Option<String> = None;
    while pos < file_len {
        let mut hb = [0u8; CHUNK_HEADER];
        if pos + CHUNK_HEADER as u64 > file_len {
            torn = Some(format!("short header ({} bytes)", file_len - pos));
            break;
        }
        r.read_exact(&mut hb).map_err(io_err(&dpath))?;
        let header = match ChunkHeader::decode(&hb) {
            Ok(h) => h,
            Err(e) => {
                torn = Some(e.to_string());
                break;
            }
        };
        if header.first_offset != expected {
            torn = Some(format!(
                "chunk offset {} where {expected} was due",
                header.first_offset
            ));
            break;
        }
        if pos + header.total_len() > file_len {
            torn = Some(format!(
                "short data ({} of {} bytes)",
                file_len - pos,
                header.total_len()
            ));
            break;
        }
        body.resize((header.total_len() - CHUNK_HEADER as u64) as usize, 0);
        r.read_exact(&mut body).map_err(io_err(&dpath))?;
        if let Err(e) = header.verify_body(&body) {
            torn = Some(e.to_string());
            break;
        }
        let entry = IndexEntry::of(&header, pos).encode();
        match &mut rewrite {
            Some(w) => w.write_all(&entry).map_err(io_err(&ipath))?,
            None => {
                let mut e = [0u8; INDEX_ENTRY];
                let same = k < old_entries && old.read_exact(&mut e).is_ok() && e == entry;
                if !same {
                    if k < old_entries {
                        tracing::warn!(segment = %dpath.display(), entry = k, "stream: index disagrees with its segment; rewritten from there");
                    }
                    let at = FILE_HEADER as u64 + k * INDEX_ENTRY as u64;
                    index.set_len(at).map_err(io_err(&ipath))?;
                    let mut f = index.try_clone().map_err(io_err(&ipath))?;
                    std::io::Seek::seek(&mut f, io::SeekFrom::Start(at)).map_err(io_err(&ipath))?;
                    let mut w = BufWriter::with_capacity(1 << 16, f);
                    w.write_all(&entry).map_err(io_err(&ipath))?;
                    rewrite = Some(w);
                }
            }
        }
        k += 1;
        pos += header.total_len();
        expected = header.next_offset();
        last_ts = header.timestamp;
    }
    if let Some(reason) = &torn {
        tracing::warn!(segment = %dpath.display(), at = pos, cut = file_len - pos, reason = %reason, "stream: torn chunk at the tail cut off");
        data.set_len(pos).map_err(io_err(&dpath))?;
    }
    let index_len = FILE_HEADER as u64 + k * INDEX_ENTRY as u64;
    if let Some(mut w) = rewrite.take() {
        w.flush().map_err(io_err(&ipath))?;
    }
    let on_disk = index.metadata().map_err(io_err(&ipath))?.len();
    if on_disk != index_len {
        // Entries for chunks that are not there (the index reached the disk before the
        // data did), or a torn entry.
        index.set_len(index_len).map_err(io_err(&ipath))?;
    }
    if torn.is_some() || old_entries != k || on_disk != index_len {
        data.sync_data().map_err(io_err(&dpath))?;
        index.sync_data().map_err(io_err(&ipath))?;
    }
    Ok(Segment {
        first_offset: first,
        next_offset: expected,
        last_ts,
        size: pos,
        index_len,
    })
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
