//! The stream protocol's backend over the native stream log (`warren_store::stream`): the
//! gateway (`warren-stream`) must not depend on the store, so this crate joins them, as
//! RabbitMQ's stream plugin talks to osiris directly.
//!
//! - A catalog of streams under `<data-dir>/streams/<vhost>/<stream>/` (names escaped, see
//!   [`escape`]), reopened at start (recovery is the log's torn-tail cut).
//! - Group commit: appends go to the log's buffer under the stream's lock; one sync task per
//!   stream writes out, fsyncs outside the lock, then publishes the new durable offset on a
//!   `watch` that both `wait_durable` (confirms) and `wait_data` (subscribers) wait on.
//! - Retention (`max-length-bytes`, `max-age`) at every segment roll (the log does it) and on
//!   a timer.
//! - Logins and vhost access through the broker's users.
//! - The same logs are the core's stream queues (`x-queue-type: stream` over AMQP): the
//!   catalog is the native store's [`warren_store::StreamHost`], opened before the broker so
//!   the restore finds the streams; the store's sync thread syncs what the core appended and
//!   moves the tail the stream protocol's subscribers wait on.

use bytes::Bytes;
use std::collections::HashMap;
use std::fs;
use std::future::Future;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::sync::Notify;
use warren_core::escape::Escaped;
use warren_store::stream::{
    self as log, OffsetSpec as LogSpec, ReaderOptions, StreamConfig, StreamLog, StreamReader,
};
use warren_stream::backend::{
    Appended, AuthError, ChunkReader, Login, OpenedConnection, OperatorClose, PeerInfo, ReadBatch,
    ReaderFilter, StreamBackend, StreamError, StreamStats,
};
use warren_stream::chunk::{CHUNK_ENTRIES, Chunk, ChunkData, FileRange};
use warren_stream::codec::{EntryRef, OffsetSpec, PublishedBatch, PublishedRef};
use warren_stream::sac::ConsumerGroups;
use warren_stream::tail::{self, Tail, TailWatch};

/// Streams one node holds (each has a task and open files).
pub const MAX_STREAMS: usize = 1000;
/// How often retention by age runs besides at segment rolls.
const RETENTION_INTERVAL: Duration = Duration::from_secs(30);
/// Bytes a stream's writer buffers before an append writes them out itself.
const WRITE_BUFFER: usize = 1 << 20;
/// The file in a stream's directory holding its arguments (`key=value` lines, validated).
const ARGUMENTS: &str = "arguments";
/// Chunks whose data is at least this big (and past the read-ahead bytes) are handed to the
/// session as file ranges, which its shell sends with sendfile(2). Below it the extra system
/// call per chunk (a write of the frame header, then the sendfile) costs more than the copy
/// it saves, and the read-ahead path reads them with the chunks after them.
pub const SENDFILE_MIN: u32 = 16 * 1024;
/// Escaped names longer than this are refused (file names are at most 255 bytes).
const MAX_ESCAPED: usize = 240;

/// A directory name for a client-chosen name: bytes outside `[A-Za-z0-9_-]` become `%XX`
/// (so `.`, `..`, `/` and NUL cannot reach the file system as themselves), and the empty
/// name is `%`. Injective, and never starts with `.` (temporary names do).
pub fn escape(name: &str) -> String {
    if name.is_empty() {
        return "%".into();
    }
    let mut out = String::with_capacity(name.len());
    for b in name.bytes() {
        if b.is_ascii_alphanumeric() || b == b'_' || b == b'-' {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The inverse of [`escape`]; `None` for a name it cannot have made.
pub fn unescape(s: &str) -> Option<String> {
    if s == "%" {
        return Some(String::new());
    }
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = s.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    let name = String::from_utf8(out).ok()?;
    (escape(&name) == s).then_some(name)
}

/// A subscription's reader: the log's reader (its read-ahead buffer kept between reads) and
/// the chunk it read but could not hand out within the byte limit.
pub struct DiskReader {
    stream: Arc<Stream>,
    reader: StreamReader,
    pending: Option<Chunk>,
}

impl ChunkReader for DiskReader {
    fn read(&mut self, max_chunks: usize, max_bytes: usize) -> Result<ReadBatch, StreamError> {
        let tail = self.stream.tail.get();
        if tail.deleted {
            return Err(StreamError::DoesNotExist);
        }
        let mut batch = ReadBatch {
            chunks: Vec::new(),
            committed_chunk_id: tail.last_chunk.unwrap_or(0),
        };
        let mut size = 0;
        while batch.chunks.len() < max_chunks {
            let chunk = match self.pending.take() {
                Some(c) => c,
                None => match self.reader.next_chunk().map_err(internal)? {
                    Some(c) => to_chunk(&c),
                    None => break,
                },
            };
            if !batch.chunks.is_empty() && size + chunk.wire_len() > max_bytes {
                self.pending = Some(chunk);
                break;
            }
            size += chunk.wire_len();
            batch.chunks.push(chunk);
        }
        Ok(batch)
    }

    fn position(&self) -> u64 {
        match &self.pending {
            Some(c) => c.first_offset,
            None => self.reader.next_offset(),
        }
    }
}

struct Writer {
    log: StreamLog,
}

/// One stream of the catalog (a publisher's [`StreamBackend::Target`]).
pub struct Stream {
    writer: Mutex<Option<Writer>>,
    /// The durable tail (what `wait_durable` and `wait_data` wait on).
    tail: TailWatch,
    dirty: Notify,
    /// How its subscriptions read (read-ahead; file ranges for sendfile).
    reader_options: ReaderOptions,
    /// Its creation's arguments, as a declaration again compares them.
    declared: Vec<(String, String)>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Data under these locks stays consistent at every step, so a poisoned lock is used.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn internal(e: impl std::fmt::Display) -> StreamError {
    StreamError::Internal(e.to_string())
}

impl Stream {
    fn with_writer<T>(
        &self,
        f: impl FnOnce(&mut Writer) -> Result<T, StreamError>,
    ) -> Result<T, StreamError> {
        match lock(&self.writer).as_mut() {
            Some(w) => f(w),
            None => Err(StreamError::DoesNotExist),
        }
    }

    /// Group commit: waits for appends, writes them out, fsyncs off the executor without
    /// the lock, publishes the durable offset (which wakes the stream protocol's waiting
    /// subscribers) and tells the broker (its stream queue's waiting consumers). Also runs
    /// retention by age on a timer.
    async fn sync_task(
        self: Arc<Stream>,
        vhost: String,
        stream: String,
        broker: Arc<crate::broker::BrokerLink>,
    ) {
        let name = format!("{vhost}/{stream}");
        let mut retention = tokio::time::interval(RETENTION_INTERVAL);
        loop {
            tokio::select! {
                _ = self.dirty.notified() => {}
                _ = retention.tick() => {
                    let now = warren_runtime::unix_ms();
                    if let Err(e) = self.with_writer(|w| w.log.retain(now).map_err(internal)) {
                        if e == StreamError::DoesNotExist {
                            return;
                        }
                        tracing::warn!(stream = %Escaped(&name), "stream retention: {e}");
                    }
                    continue;
                }
            }
            let begun = self.with_writer(|w| {
                let p = w.log.begin_sync().map_err(internal)?;
                Ok((p, w.log.last_chunk()))
            });
            let (pending, last_chunk) = match begun {
                Ok(p) => p,
                Err(StreamError::DoesNotExist) => return,
                Err(e) => {
                    tracing::error!(stream = %Escaped(&name), "stream write failed: {e}");
                    continue;
                }
            };
            // Nothing to fsync (`--fsync off`, or a sync that found everything durable): no
            // hop to a blocking thread and back, two thread wake-ups per group commit that
            // cost more than the write itself when a publisher sends little at a time.
            let (pending, waited) = if !pending.blocks() {
                (pending, Ok(()))
            } else {
                match tokio::task::spawn_blocking(move || {
                    let r = pending.wait();
                    (pending, r)
                })
                .await
                {
                    Ok(r) => r,
                    Err(e) => {
                        tracing::error!(stream = %Escaped(&name), "stream fsync task failed: {e}");
                        continue;
                    }
                }
            };
            let ended = self.with_writer(|w| w.log.end_sync(&pending, waited).map_err(internal));
            match ended {
                Ok(_) => {
                    let before = self.tail.get().committed;
                    self.tail.advance(pending.next_offset(), last_chunk);
                    if self.tail.get().committed > before {
                        broker.streams_grew(&vhost, &stream);
                    }
                }
                Err(StreamError::DoesNotExist) => return,
                // Confirms stop: the publishers' unconfirmed ids time out on the client side,
                // which is what a failed disk must look like.
                Err(e) => tracing::error!(stream = %Escaped(&name), "stream fsync failed: {e}"),
            }
        }
    }
}

/// The catalog: see the module docs.
pub struct DiskStreams {
    root: PathBuf,
    /// Set once the broker runs (the catalog opens before it: the restore reopens streams).
    broker: Arc<crate::broker::BrokerLink>,
    read_ahead: usize,
    sendfile: bool,
    fsync: bool,
    /// vhost -> stream name -> stream: looked up by `&str` on every Publish frame, so
    /// without building a key (two `String`s per frame were ~10% of a 1-message publish).
    streams: Mutex<Catalog>,
    groups: ConsumerGroups,
}

type Catalog = HashMap<String, HashMap<String, Arc<Stream>>>;

/// A stream's settings from its protocol arguments (unknown ones ignored, as RabbitMQ).
pub(crate) fn parse_arguments(
    args: &[(String, String)],
) -> Result<Vec<(String, String)>, StreamError> {
    let bad = |k: &str, v: &str| StreamError::Precondition(format!("invalid {k}: {v}"));
    let mut kept = Vec::new();
    for (k, v) in args {
        match k.as_str() {
            "max-length-bytes" | "stream-max-segment-size-bytes" => {
                v.parse::<u64>().map_err(|_| bad(k, v))?;
                kept.push((k.clone(), v.clone()));
            }
            "max-age" => {
                warren_stream::memory::parse_max_age(v).ok_or_else(|| bad(k, v))?;
                kept.push((k.clone(), v.clone()));
            }
            "initial-cluster-size" => {
                v.parse::<u64>().map_err(|_| bad(k, v))?;
            }
            // Validated as RabbitMQ does (and so never a line break in the arguments file).
            "stream-filter-size-bytes" if !matches!(v.parse::<u8>(), Ok(16..=255)) => {
                return Err(bad(k, v));
            }
            "queue-leader-locator"
                if !matches!(
                    v.as_str(),
                    "client-local" | "balanced" | "least-leaders" | "random"
                ) =>
            {
                return Err(bad(k, v));
            }
            _ => {}
        }
    }
    Ok(kept)
}

fn stream_config(args: &[(String, String)], fsync: bool) -> StreamConfig {
    let mut c = StreamConfig {
        buffer_limit_bytes: WRITE_BUFFER,
        fsync,
        merge_entries: CHUNK_ENTRIES,
        ..StreamConfig::default()
    };
    for (k, v) in args {
        match k.as_str() {
            "max-length-bytes" => c.max_length_bytes = v.parse().ok(),
            "stream-max-segment-size-bytes" => {
                if let Ok(n) = v.parse::<u64>() {
                    c.max_segment_size_bytes = n.max(1);
                }
            }
            "max-age" => c.max_age_ms = warren_stream::memory::parse_max_age(v),
            _ => {}
        }
    }
    c
}

/// Why the streams of a data directory did not open.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// The catalog's directories or a stream's arguments file.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// A stream's log.
    #[error(transparent)]
    Log(#[from] log::StreamError),
}

impl DiskStreams {
    /// Opens every stream under `<data_dir>/streams` (recovering each), and starts their
    /// sync tasks.
    pub fn open(
        data_dir: &Path,
        read_ahead: usize,
        sendfile: bool,
        fsync: bool,
    ) -> Result<Arc<DiskStreams>, OpenError> {
        let root = data_dir.join("streams");
        fs::create_dir_all(&root)?;
        let me = Arc::new(DiskStreams {
            root: root.clone(),
            broker: Default::default(),
            read_ahead,
            sendfile,
            fsync,
            streams: Mutex::new(HashMap::new()),
            groups: ConsumerGroups::new(),
        });
        for vdir in fs::read_dir(&root)? {
            let vdir = vdir?;
            let vname = vdir.file_name();
            let vname = vname.to_string_lossy();
            if vname.starts_with('.') {
                // A deletion the process did not finish.
                fs::remove_dir_all(vdir.path())?;
                continue;
            }
            let Some(vhost) = unescape(&vname) else {
                tracing::warn!(dir = %vdir.path().display(), "streams: not a vhost directory; ignored");
                continue;
            };
            for sdir in fs::read_dir(vdir.path())? {
                let sdir = sdir?;
                let sname = sdir.file_name();
                let sname = sname.to_string_lossy();
                let Some(stream) = unescape(&sname) else {
                    tracing::warn!(dir = %sdir.path().display(), "streams: not a stream directory; ignored");
                    continue;
                };
                let args = match fs::read_to_string(sdir.path().join(ARGUMENTS)) {
                    Ok(text) => text
                        .lines()
                        .filter_map(|l| l.split_once('='))
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                        .collect::<Vec<_>>(),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                        // Created up to its directory only: never acknowledged.
                        fs::remove_dir_all(sdir.path())?;
                        continue;
                    }
                    Err(e) => return Err(e.into()),
                };
                let log = StreamLog::open(&sdir.path(), stream_config(&args, fsync))?;
                tracing::info!(vhost = %Escaped(&vhost), stream = %Escaped(&stream), next = log.bounds().next, "stream recovered");
                let declared = warren_stream::memory::declared_arguments(&args);
                me.insert(&mut lock(&me.streams), vhost.clone(), stream, log, declared);
            }
        }
        Ok(me)
    }

    fn insert(
        &self,
        streams: &mut Catalog,
        vhost: String,
        name: String,
        log: StreamLog,
        declared: Vec<(String, String)>,
    ) {
        let b = log.bounds();
        let tail = TailWatch::new(Tail {
            committed: b.committed,
            // Found in the index at open (everything recovered is committed).
            last_chunk: log.last_chunk().filter(|&c| c < b.committed),
            deleted: false,
        });
        let stream = Arc::new(Stream {
            writer: Mutex::new(Some(Writer { log })),
            tail,
            dirty: Notify::new(),
            reader_options: ReaderOptions {
                read_ahead: self.read_ahead,
                ranges_from: self.sendfile.then_some(SENDFILE_MIN),
            },
            declared,
        });
        tokio::spawn(
            stream
                .clone()
                .sync_task(vhost.clone(), name.clone(), self.broker.clone()),
        );
        streams.entry(vhost).or_default().insert(name, stream);
    }

    fn get(&self, vhost: &str, stream: &str) -> Result<Arc<Stream>, StreamError> {
        lock(&self.streams)
            .get(vhost)
            .and_then(|v| v.get(stream))
            .cloned()
            .ok_or(StreamError::DoesNotExist)
    }

    fn dir(&self, vhost: &str, stream: &str) -> Result<PathBuf, StreamError> {
        let (v, s) = (escape(vhost), escape(stream));
        if v.len() > MAX_ESCAPED || s.len() > MAX_ESCAPED {
            return Err(StreamError::Precondition(
                "name too long for this node's stream directory".into(),
            ));
        }
        Ok(self.root.join(v).join(s))
    }

    /// Runs a broker call from the session's synchronous backend methods. The stream
    /// session is sans-IO and asks its backend inline; the broker's user table lives in its
    /// task, so the worker thread blocks for one round trip (the runtime is multi-threaded).
    /// Creates a stream's log (not its AMQP queue).
    fn create_log(
        &self,
        vhost: &str,
        stream: &str,
        arguments: &[(String, String)],
    ) -> Result<(), StreamError> {
        parse_arguments(arguments)?;
        // Stored as declared: what the log applies, and what a declaration again compares.
        let args = warren_stream::memory::declared_arguments(arguments);
        let dir = self.dir(vhost, stream)?;
        // Held across the creation so two creates of one name cannot both succeed.
        let mut streams = lock(&self.streams);
        if let Some(s) = streams.get(vhost).and_then(|v| v.get(stream)) {
            return Err(warren_stream::memory::redeclared(&s.declared, arguments));
        }
        if streams.values().map(HashMap::len).sum::<usize>() >= MAX_STREAMS {
            return Err(StreamError::Precondition(format!(
                "this node holds {MAX_STREAMS} streams, its limit"
            )));
        }
        // Arguments first, durably: a directory without them is a create that never
        // finished (removed at start).
        let created = (|| -> std::io::Result<()> {
            fs::create_dir_all(&dir)?;
            let mut f = fs::File::create(dir.join(ARGUMENTS))?;
            for (k, v) in &args {
                writeln!(f, "{k}={v}")?;
            }
            f.sync_all()?;
            if let Some(parent) = dir.parent() {
                fs::File::open(parent)?.sync_all()?;
            }
            Ok(())
        })();
        created.map_err(internal)?;
        let log = StreamLog::open(&dir, stream_config(&args, self.fsync)).map_err(internal)?;
        self.insert(
            &mut streams,
            vhost.to_string(),
            stream.to_string(),
            log,
            args,
        );
        Ok(())
    }

    /// Removes a stream's log and files (not its AMQP queue).
    fn remove_log(&self, vhost: &str, stream: &str) -> Result<(), StreamError> {
        let s = {
            let mut streams = lock(&self.streams);
            let v = streams.get_mut(vhost).ok_or(StreamError::DoesNotExist)?;
            let s = v.remove(stream).ok_or(StreamError::DoesNotExist)?;
            if v.is_empty() {
                streams.remove(vhost);
            }
            s
        };
        let writer = lock(&s.writer).take();
        s.tail.delete();
        s.dirty.notify_one();
        if let Some(w) = writer {
            // Renamed first (atomic), then removed: a crash in between leaves a `.deleted`
            // directory that the next start removes, never half a stream.
            let dir = w.log.dir().to_path_buf();
            drop(w);
            let tomb = self.root.join(format!(
                ".deleted-{}-{}",
                std::process::id(),
                warren_runtime::unix_ms()
            ));
            fs::rename(&dir, &tomb).map_err(internal)?;
            fs::remove_dir_all(&tomb).map_err(internal)?;
        }
        Ok(())
    }

    /// The broker, for logins and the streams' AMQP queues (the catalog opened before it).
    pub fn set_broker(&self, broker: warren_runtime::BrokerHandle) {
        self.broker.set(broker);
    }
}

fn spec(spec: OffsetSpec) -> LogSpec {
    match spec {
        OffsetSpec::First => LogSpec::First,
        OffsetSpec::Last => LogSpec::Last,
        OffsetSpec::Next => LogSpec::Next,
        OffsetSpec::Offset(o) => LogSpec::Offset(o),
        OffsetSpec::Timestamp(t) if t <= 0 => LogSpec::First,
        OffsetSpec::Timestamp(t) => LogSpec::Timestamp(t as u64),
    }
}

/// Stages one batch in the log (`append_merged_iter`), writing the buffer out first when it
/// is full.
fn stage<'m>(
    w: &mut Writer,
    part: impl Iterator<Item = (&'m [u8], Option<&'m str>)> + Clone,
    sized: Option<(usize, u64)>,
    publishers: &[(&str, u64)],
    now_ms: u64,
) -> Result<(), StreamError> {
    match w
        .log
        .append_merged_iter(part.clone(), sized, now_ms, publishers)
    {
        Err(log::StreamError::Backpressure { .. }) => {
            // The buffer is full: write it out (to the OS, not fsynced) and append again;
            // the sync task fsyncs both.
            w.log.flush().map_err(internal)?;
            w.log.append_merged_iter(part, sized, now_ms, publishers)
        }
        other => other,
    }
    .map(|_| ())
    .map_err(|e| match e {
        log::StreamError::Invalid(m) => StreamError::Precondition(m),
        other => internal(other),
    })
}

/// A frame with sub-batch entries (the clients' sub-entry batching): its new entries in
/// order, runs of simple entries as batches of at most [`CHUNK_ENTRIES`] (and the write
/// buffer), each sub-batch as one entry of its records (`append_merged_sub_batch`: stored as
/// published, for clients to decompress). A codec the log does not serve refuses the frame
/// before anything is staged.
fn append_entries(
    w: &mut Writer,
    writer: Option<&str>,
    messages: PublishedBatch<'_>,
    now_ms: u64,
) -> Result<Appended, StreamError> {
    let last = writer.and_then(|r| w.log.publisher_sequence(r));
    let named = writer.filter(|r| !r.is_empty());
    let fresh: Vec<PublishedRef<'_>> = messages
        .iter()
        .filter(|m| last.is_none_or(|l| m.publishing_id > l))
        .collect();
    for m in &fresh {
        if let EntryRef::SubBatch { compression, .. } = m.entry
            && !log::sub_batch::served(compression)
        {
            return Err(StreamError::Precondition(format!(
                "sub-batch compression {compression} is not served (none and gzip are)"
            )));
        }
    }
    let mut i = 0;
    while i < fresh.len() {
        let (n, max_id) = match fresh[i].entry {
            EntryRef::SubBatch { .. } => (1, fresh[i].publishing_id),
            EntryRef::Simple(_) => {
                let (mut n, mut bytes, mut max_id) = (0, 0, 0);
                for m in &fresh[i..] {
                    let EntryRef::Simple(b) = m.entry else {
                        break;
                    };
                    if n == CHUNK_ENTRIES || (n > 0 && bytes + b.len() > WRITE_BUFFER) {
                        break;
                    }
                    bytes += b.len() + 4;
                    max_id = max_id.max(m.publishing_id);
                    n += 1;
                }
                (n, max_id)
            }
        };
        // As in `append`: each batch records the highest id it holds.
        let publishers = named.map(|r| [(r, max_id.max(last.unwrap_or(0)))]);
        let publishers = publishers.as_ref().map_or(&[][..], |p| &p[..]);
        match fresh[i].entry {
            EntryRef::SubBatch {
                compression,
                count,
                uncompressed_size,
                data,
            } => {
                let header = log::sub_batch::SubBatch {
                    compression,
                    count,
                    uncompressed_size,
                    size: u32::try_from(data.len()).map_err(internal)?,
                };
                let mut entry = Vec::with_capacity(log::sub_batch::HEADER + data.len());
                entry.extend_from_slice(&header.encode());
                entry.extend_from_slice(data);
                let filter = fresh[i].filter_value;
                let staged = match w
                    .log
                    .append_merged_sub_batch(&entry, filter, now_ms, publishers)
                {
                    Err(log::StreamError::Backpressure { .. }) => {
                        w.log.flush().map_err(internal)?;
                        w.log
                            .append_merged_sub_batch(&entry, filter, now_ms, publishers)
                    }
                    other => other,
                };
                staged.map_err(|e| match e {
                    log::StreamError::Invalid(m) => StreamError::Precondition(m),
                    other => internal(other),
                })?;
            }
            EntryRef::Simple(_) => stage(
                w,
                fresh[i..i + n].iter().map(|m| (simple(m), m.filter_value)),
                None,
                publishers,
                now_ms,
            )?,
        }
        i += n;
    }
    Ok(Appended {
        stored: fresh.len(),
        duplicates: messages.len() - fresh.len(),
        confirm_at: w.log.bounds().next.checked_sub(1),
    })
}

/// A simple entry's bytes (frames with sub-batches go through [`append_entries`], which
/// calls this for its simple entries only).
fn simple<'a>(m: &PublishedRef<'a>) -> &'a [u8] {
    match m.entry {
        EntryRef::Simple(b) => b,
        EntryRef::SubBatch { data, .. } => data,
    }
}

/// A stored chunk as the session sends it: the log's data section is the stream protocol's
/// simple-entry layout, so data and CRC go out as stored.
fn to_chunk(c: &log::ReadChunk) -> Chunk {
    Chunk {
        first_offset: c.first_offset,
        // A sub-batch is one entry of several records.
        num_entries: c.entries,
        num_records: c.count,
        timestamp: c.timestamp as i64,
        crc: c.data_crc,
        data: match &c.data {
            log::ChunkData::Bytes(b) => ChunkData::Bytes(b.clone()),
            // Sent as it is on disk: clients check it against the CRC above.
            log::ChunkData::File { file, offset, len } => ChunkData::File(FileRange {
                file: file.clone(),
                offset: *offset,
                len: *len,
            }),
        },
    }
}

impl StreamBackend for DiskStreams {
    type Reader = DiskReader;
    type Target = Arc<Stream>;

    fn authenticate(&self, login: &Login, peer: &PeerInfo) -> Result<String, AuthError> {
        self.broker.authenticate(login, peer)
    }

    fn vhost_access(&self, user: &str, vhost: &str) -> bool {
        self.broker.vhost_access(user, vhost)
    }

    fn register_connection(&self, connection: OpenedConnection<'_>) -> Option<OperatorClose> {
        self.broker.register_connection(connection)
    }

    fn create_stream(
        &self,
        vhost: &str,
        stream: &str,
        arguments: &[(String, String)],
    ) -> Result<(), StreamError> {
        self.create_log(vhost, stream, arguments)?;
        // A stream is a queue of its vhost for AMQP clients too, as in RabbitMQ: declared
        // through the broker's admin channel (its queue opens this log, which exists now).
        self.broker.declare_queue(
            vhost,
            stream,
            &parse_arguments(arguments).unwrap_or_default(),
        );
        Ok(())
    }

    fn delete_stream(&self, vhost: &str, stream: &str) -> Result<(), StreamError> {
        if !self.stream_exists(vhost, stream) {
            return Err(StreamError::DoesNotExist);
        }
        // Through the broker first: its queue goes, and the store deletes the log.
        self.broker.delete_queue(vhost, stream);
        match self.remove_log(vhost, stream) {
            Ok(()) | Err(StreamError::DoesNotExist) => Ok(()),
            Err(e) => Err(e),
        }
    }

    fn stream_exists(&self, vhost: &str, stream: &str) -> bool {
        self.get(vhost, stream).is_ok()
    }

    fn stream_stats(&self, vhost: &str, stream: &str) -> Result<StreamStats, StreamError> {
        let s = self.get(vhost, stream)?;
        let (first, last) = s.with_writer(|w| Ok((w.log.bounds(), w.log.last_chunk())))?;
        let tail = s.tail.get();
        Ok(StreamStats {
            first_chunk_id: if tail.committed > first.first {
                first.first as i64
            } else {
                -1
            },
            committed_chunk_id: tail.last_chunk.map_or(-1, |c| c as i64),
            // Written, committed or not (a chunk still staged has no id yet).
            last_chunk_id: last.map_or(-1, |c| c as i64),
        })
    }

    fn target(&self, vhost: &str, stream: &str) -> Option<Arc<Stream>> {
        self.get(vhost, stream).ok()
    }

    fn append(
        &self,
        target: Option<&Arc<Stream>>,
        vhost: &str,
        stream: &str,
        writer: Option<&str>,
        messages: PublishedBatch<'_>,
        now_ms: u64,
    ) -> Result<Appended, StreamError> {
        // A publisher's stream as it was declared: a deleted one has no writer any more
        // (`DoesNotExist`), even when one of the same name was created since.
        let looked_up;
        let s = match target {
            Some(s) => s,
            None => {
                looked_up = self.get(vhost, stream)?;
                &looked_up
            }
        };
        let summary = messages.summary();
        if summary.sub_batches {
            let appended = s.with_writer(|w| append_entries(w, writer, messages, now_ms))?;
            if appended.stored > 0 {
                s.dirty.notify_one();
            }
            return Ok(appended);
        }
        let appended = s.with_writer(|w| {
            let last = writer.and_then(|r| w.log.publisher_sequence(r));
            let named = writer.filter(|r| !r.is_empty());
            let count = messages.len();
            if count > 0
                && last.is_none_or(|l| summary.min_id > l)
                && count <= CHUNK_ENTRIES
                && (count == 1 || summary.simple_bytes <= WRITE_BUFFER as u64)
            {
                // The usual frame: every id new, one batch: its messages go from the frame's
                // bytes to the log's staging buffer in one walk, sized by the parse.
                let publishers = named.map(|r| [(r, summary.max_id.max(last.unwrap_or(0)))]);
                stage(
                    w,
                    messages.iter().map(|m| (simple(&m), m.filter_value)),
                    Some((count, summary.simple_bytes)),
                    publishers.as_ref().map_or(&[][..], |p| &p[..]),
                    now_ms,
                )?;
                return Ok(Appended {
                    stored: count,
                    duplicates: 0,
                    confirm_at: w.log.bounds().next.checked_sub(1),
                });
            }
            let fresh = move |m: &PublishedRef<'_>| last.is_none_or(|l| m.publishing_id > l);
            let stored = messages.iter().filter(fresh).count();
            // Re-sent ids among them, or a frame past the log's message count or about the
            // write buffer: batches of the new messages within those bounds. The log merges
            // each with those queued before the sync task's next write (one chunk per group
            // commit, as osiris), so many frames in flight share chunks.
            let mut rest = messages.iter().filter(fresh);
            let mut left = stored;
            while left > 0 {
                let (mut n, mut bytes, mut max_id) = (0, 0, 0);
                for m in rest.clone() {
                    let len = simple(&m).len();
                    if n == left || n == CHUNK_ENTRIES || (n > 0 && bytes + len > WRITE_BUFFER) {
                        break;
                    }
                    bytes += len + 4;
                    max_id = max_id.max(m.publishing_id);
                    n += 1;
                }
                // Each batch records the highest id it holds: a crash between two batches
                // of one frame must not deduplicate the second's ids when they are re-sent.
                let publishers = named.map(|r| [(r, max_id.max(last.unwrap_or(0)))]);
                stage(
                    w,
                    rest.clone().take(n).map(|m| (simple(&m), m.filter_value)),
                    None,
                    publishers.as_ref().map_or(&[][..], |p| &p[..]),
                    now_ms,
                )?;
                for _ in 0..n {
                    rest.next();
                }
                left -= n;
            }
            Ok(Appended {
                stored,
                duplicates: messages.len() - stored,
                confirm_at: w.log.bounds().next.checked_sub(1),
            })
        })?;
        if appended.stored > 0 {
            s.dirty.notify_one();
        }
        Ok(appended)
    }

    fn wait_durable(
        &self,
        vhost: &str,
        stream: &str,
        offset: u64,
    ) -> impl Future<Output = Result<(), StreamError>> + Send + 'static {
        tail::wait_past(self.get(vhost, stream).map(|s| s.tail.waiter()), offset)
    }

    fn resolve_offset(
        &self,
        vhost: &str,
        stream: &str,
        offset: OffsetSpec,
    ) -> Result<u64, StreamError> {
        let s = self.get(vhost, stream)?;
        s.with_writer(|w| {
            let b = w.log.bounds();
            Ok(match offset {
                OffsetSpec::First => b.first,
                OffsetSpec::Next => b.next,
                // Below the first: the first; past the end: next (osiris's clamping).
                OffsetSpec::Offset(o) => o.clamp(b.first, b.next),
                other => {
                    let r = w
                        .log
                        .reader(spec(other), ReaderOptions::default())
                        .map_err(internal)?;
                    r.next_offset()
                }
            })
        })
    }

    fn open_reader(
        &self,
        vhost: &str,
        stream: &str,
        offset: OffsetSpec,
        filter: Option<ReaderFilter>,
    ) -> Result<DiskReader, StreamError> {
        let s = self.get(vhost, stream)?;
        let options = s.reader_options;
        let mut reader =
            s.with_writer(|w| w.log.reader(spec(offset), options).map_err(internal))?;
        // Chunks whose Bloom filter rules the values out are skipped; the rest (false
        // positives included) go out and clients filter their messages, as with RabbitMQ.
        reader.set_filter(filter.map(|f| log::bloom::ChunkFilter {
            values: f.values,
            match_unfiltered: f.match_unfiltered,
        }));
        Ok(DiskReader {
            stream: s,
            reader,
            pending: None,
        })
    }

    fn wait_data(
        &self,
        vhost: &str,
        stream: &str,
        from: u64,
    ) -> impl Future<Output = Result<(), StreamError>> + Send + 'static {
        self.wait_durable(vhost, stream, from)
    }

    fn create_super_stream(
        &self,
        vhost: &str,
        name: &str,
        partitions: &[String],
        binding_keys: &[String],
        arguments: &[(String, String)],
    ) -> Result<(), StreamError> {
        crate::super_streams::create(
            &self.broker,
            self,
            vhost,
            name,
            partitions,
            binding_keys,
            arguments,
        )
    }

    fn delete_super_stream(&self, vhost: &str, name: &str) -> Result<Vec<String>, StreamError> {
        crate::super_streams::delete_super(&self.broker, self, vhost, name)
    }

    fn partitions(&self, vhost: &str, name: &str) -> Result<Vec<String>, StreamError> {
        crate::super_streams::partitions(&self.broker, vhost, name)
    }

    fn route(
        &self,
        vhost: &str,
        name: &str,
        routing_key: &str,
    ) -> Result<Vec<String>, StreamError> {
        crate::super_streams::route(&self.broker, vhost, name, routing_key)
    }

    fn consumer_groups(&self) -> &ConsumerGroups {
        &self.groups
    }

    fn store_offset(
        &self,
        vhost: &str,
        stream: &str,
        reference: &str,
        offset: u64,
    ) -> Result<(), StreamError> {
        let s = self.get(vhost, stream)?;
        s.with_writer(|w| {
            w.log
                .store_offsets(&[(reference, offset)], warren_runtime::unix_ms())
                .map_err(|e| match e {
                    log::StreamError::Invalid(m) => StreamError::Precondition(m),
                    other => internal(other),
                })
        })?;
        // Durable with the next group commit.
        s.dirty.notify_one();
        Ok(())
    }

    fn query_offset(
        &self,
        vhost: &str,
        stream: &str,
        reference: &str,
    ) -> Result<Option<u64>, StreamError> {
        self.get(vhost, stream)?
            .with_writer(|w| Ok(w.log.consumer_offset(reference)))
    }

    fn publisher_sequence(
        &self,
        vhost: &str,
        stream: &str,
        reference: &str,
    ) -> Result<u64, StreamError> {
        self.get(vhost, stream)?
            .with_writer(|w| Ok(w.log.publisher_sequence(reference).unwrap_or(0)))
    }
}

impl std::fmt::Debug for DiskStreams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DiskStreams")
            .field("root", &self.root)
            .finish_non_exhaustive()
    }
}

/// The core's stream queues over the same logs (see the module docs).
impl warren_store::StreamHost for DiskStreams {
    fn open(
        &self,
        vhost: &str,
        name: &str,
        settings: &warren_core::store::StreamSettings,
    ) -> Result<(), String> {
        if let Ok(s) = self.get(vhost, name) {
            // Opened again with the queue's settings (at start, or a policy changed): the
            // queue's effective arguments win over what the stream was created with.
            let has_any = settings.max_length_bytes.is_some()
                || settings.max_age_ms.is_some()
                || settings.max_segment_size_bytes.is_some();
            if has_any {
                s.with_writer(|w| {
                    w.log.set_limits(
                        settings.max_length_bytes,
                        settings.max_age_ms,
                        settings.max_segment_size_bytes,
                    );
                    Ok(())
                })
                .map_err(|e| e.to_string())?;
            }
            return Ok(());
        }
        let mut args = Vec::new();
        if let Some(n) = settings.max_length_bytes {
            args.push(("max-length-bytes".to_string(), n.to_string()));
        }
        if let Some(ms) = settings.max_age_ms {
            args.push(("max-age".to_string(), format!("{}s", ms.div_ceil(1000))));
        }
        if let Some(n) = settings.max_segment_size_bytes {
            args.push(("stream-max-segment-size-bytes".to_string(), n.to_string()));
        }
        match self.create_log(vhost, name, &args) {
            // Created meanwhile by the stream protocol: the same stream.
            Ok(()) => Ok(()),
            Err(StreamError::AlreadyExists | StreamError::Precondition(_))
                if self.stream_exists(vhost, name) =>
            {
                Ok(())
            }
            Err(e) => Err(e.to_string()),
        }
    }

    fn append(
        &self,
        vhost: &str,
        name: &str,
        messages: &[Bytes],
        timestamp_ms: u64,
    ) -> Result<(), String> {
        let s = self.get(vhost, name).map_err(|e| e.to_string())?;
        // Merged with what is staged since the log's last write, as the stream protocol's
        // appends are: the broker task's batches that arrive while a sync runs become one
        // chunk at the next write, not a chunk each.
        s.with_writer(|w| {
            match w.log.append_merged(messages, &[], timestamp_ms, &[]) {
                Err(log::StreamError::Backpressure { .. }) => {
                    // Written out (not fsynced) to make room: the next sync covers both.
                    w.log.flush().map_err(internal)?;
                    w.log.append_merged(messages, &[], timestamp_ms, &[])
                }
                other => other,
            }
            .map_err(internal)?;
            Ok(())
        })
        .map_err(|e| e.to_string())
    }

    fn bounds(&self, vhost: &str, name: &str) -> Result<log::Bounds, String> {
        let s = self.get(vhost, name).map_err(|e| e.to_string())?;
        s.with_writer(|w| Ok(w.log.bounds()))
            .map_err(|e| e.to_string())
    }

    fn reader(&self, vhost: &str, name: &str, spec: LogSpec) -> Result<StreamReader, String> {
        let s = self.get(vhost, name).map_err(|e| e.to_string())?;
        // The AMQP side copies messages out of the chunk: no file ranges.
        let options = ReaderOptions {
            read_ahead: s.reader_options.read_ahead,
            ranges_from: None,
        };
        s.with_writer(|w| w.log.reader(spec, options).map_err(internal))
            .map_err(|e| e.to_string())
    }

    fn sync(&self, vhost: &str, name: &str) -> Result<(), String> {
        let s = match self.get(vhost, name) {
            Ok(s) => s,
            // Deleted since: nothing of it to make durable.
            Err(StreamError::DoesNotExist) => return Ok(()),
            Err(e) => return Err(e.to_string()),
        };
        let begun = s.with_writer(|w| {
            let p = w.log.begin_sync().map_err(internal)?;
            Ok((p, w.log.last_chunk()))
        });
        let (pending, last_chunk) = match begun {
            Ok(p) => p,
            Err(StreamError::DoesNotExist) => return Ok(()),
            Err(e) => return Err(e.to_string()),
        };
        // The fsync runs without the writer's lock: the stream protocol appends meanwhile.
        let waited = pending.wait();
        match s.with_writer(|w| w.log.end_sync(&pending, waited).map_err(internal)) {
            Ok(_) => {}
            Err(StreamError::DoesNotExist) => return Ok(()),
            Err(e) => return Err(e.to_string()),
        }
        s.tail.advance(pending.next_offset(), last_chunk);
        Ok(())
    }

    fn delete(&self, vhost: &str, name: &str) {
        match self.remove_log(vhost, name) {
            Ok(()) | Err(StreamError::DoesNotExist) => {}
            Err(e) => tracing::warn!(
                vhost = %Escaped(vhost),
                stream = %Escaped(name),
                "deleting a stream's files failed: {e}"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Data chunks as a session gets them from a fresh stream holding one large chunk (a
    /// 100 kB message) between two small ones.
    async fn chunks(sendfile: bool) -> Vec<Chunk> {
        let dir = std::env::temp_dir().join(format!(
            "warren-sendfile-unit-{}-{sendfile}",
            std::process::id()
        ));
        let _ = fs::remove_dir_all(&dir);
        let streams = DiskStreams::open(&dir, 4096, sendfile, false).unwrap();
        streams.create_stream("/", "s", &[]).unwrap();
        use warren_stream::codec::{Entry, PublishedMessage};
        let msg = |id: u64, len: usize| PublishedMessage {
            publishing_id: id,
            filter_value: None,
            entry: Entry::Simple(Bytes::from(vec![id as u8; len])),
        };
        for (id, len) in [(1, 10), (2, 100_000), (3, 10)] {
            let a = streams
                .append(
                    None,
                    "/",
                    "s",
                    None,
                    PublishedBatch::Messages(&[msg(id, len)]),
                    1,
                )
                .unwrap();
            let at = a.confirm_at.unwrap();
            streams.wait_durable("/", "s", at).await.unwrap();
        }
        let mut r = streams
            .open_reader("/", "s", OffsetSpec::First, None)
            .unwrap();
        let got = r.read(10, 10 << 20).unwrap().chunks;
        let _ = fs::remove_dir_all(&dir);
        got
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn large_chunks_come_as_file_ranges_for_sendfile_only_when_it_is_on() {
        let on = chunks(true).await;
        assert_eq!(on.len(), 3);
        assert!(
            matches!(on[0].data, ChunkData::Bytes(_)),
            "small: in memory"
        );
        let ChunkData::File(r) = &on[1].data else {
            panic!("a 100 kB chunk as a file range, got {:?}", on[1].data);
        };
        // The range is the chunk's data section on disk: the message with its size.
        let mut on_disk = vec![0u8; r.len as usize];
        std::os::unix::fs::FileExt::read_exact_at(&*r.file, &mut on_disk, r.offset).unwrap();
        let mut want = 100_000u32.to_be_bytes().to_vec();
        want.extend(vec![2u8; 100_000]);
        assert!(on_disk == want, "the data section as stored");
        assert!(matches!(on[2].data, ChunkData::Bytes(_)));
        let off = chunks(false).await;
        assert!(off.iter().all(|c| matches!(c.data, ChunkData::Bytes(_))));
        assert_eq!(off[1].crc, on[1].crc);
    }

    /// The core's stream queues hand the log one batch per broker-task sync: the batches
    /// that arrive before the log's next write become one chunk, in order, as the stream
    /// protocol's frames do (a chunk per batch before).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn stream_queue_batches_between_two_writes_become_one_chunk() {
        use warren_store::StreamHost;
        let dir = std::env::temp_dir().join(format!("warren-merge-unit-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let streams = DiskStreams::open(&dir, 4096, false, true).unwrap();
        let host: &dyn StreamHost = &*streams;
        host.open("/", "q", &Default::default()).unwrap();
        let body = |i: usize| Bytes::from(format!("m{i}"));
        for batch in 0..5 {
            host.append("/", "q", &[body(2 * batch), body(2 * batch + 1)], 1)
                .unwrap();
        }
        host.sync("/", "q").unwrap();
        host.append("/", "q", &[body(10)], 2).unwrap();
        host.sync("/", "q").unwrap();
        assert_eq!(host.bounds("/", "q").unwrap().committed, 11);
        let mut r = host.reader("/", "q", LogSpec::First).unwrap();
        let mut chunks = Vec::new();
        let mut got = Vec::new();
        while let Some(c) = r.next_chunk().unwrap() {
            chunks.push((c.first_offset, c.count));
            let log::ChunkData::Bytes(data) = &c.data else {
                panic!("small chunks are read into memory");
            };
            got.extend(log::ReadChunk::messages(data).map(|m| m.unwrap()));
        }
        assert_eq!(chunks, vec![(0, 10), (10, 1)], "one chunk per write");
        assert_eq!(got, (0..11).map(body).collect::<Vec<_>>());
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn escaped_names_are_plain_file_names_and_round_trip() {
        for name in [
            "",
            ".",
            "..",
            "a/b",
            "../../etc",
            "x\0y",
            "héllo",
            "%",
            "%41",
            "ok-name_1",
        ] {
            let e = escape(name);
            assert!(
                !e.contains('/') && !e.contains('\0') && !e.starts_with('.'),
                "{e}"
            );
            assert!(e != "." && e != "..");
            assert_eq!(unescape(&e).as_deref(), Some(name), "{name:?} -> {e}");
        }
        // Distinct names never share a directory.
        assert_ne!(escape("%41"), escape("A"));
        // Names escape() cannot have produced are not taken for streams.
        for odd in ["a.b", "%4", "%zz", "%41x%", ".deleted-1"] {
            assert_eq!(unescape(odd), None, "{odd}");
        }
    }
}
