//! `MemoryBackend`: a real, in-memory stream log behind [`StreamBackend`]: chunks in
//! osiris's layout, writer sequences for deduplication, stored consumer offsets, retention by
//! `max-length-bytes` and `max-age` (whole chunks, oldest first). Nothing survives the
//! process: "durable" means appended. Used by the crate's tests and by embedders without a
//! disk; the file-backed log implements the same trait.

use crate::backend::{
    Appended, AuthError, ChunkReader, Login, PeerInfo, ReadBatch, ReaderFilter, StreamBackend,
    StreamError, StreamStats,
};
use crate::chunk::{self, Chunk};
use crate::codec::{Entry, OffsetSpec, PublishedBatch, PublishedMessage};
use crate::sac::ConsumerGroups;
use crate::tail::{self, Tail, TailWatch};
use std::collections::{BTreeSet, HashMap, VecDeque};
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};
use tokio::sync::watch;

/// Stored writer references and consumer offsets per stream (each key at most 255 bytes, as
/// the protocol's references).
const MAX_REFERENCES: usize = 100_000;

/// Chunks a filtered read may pass over in one call (the reader's position still moves, and
/// the session reads again).
const MAX_SKIPPED: usize = 10_000;

/// A stored chunk and the filter values of its messages ("" for a message without one), as
/// osiris's bloom filter records them (here exactly: no false positives).
struct MemChunk {
    chunk: Chunk,
    filters: BTreeSet<String>,
}

impl MemChunk {
    fn matches(&self, f: &ReaderFilter) -> bool {
        f.values
            .iter()
            .any(|v| !v.is_empty() && self.filters.contains(v))
            || (f.match_unfiltered && self.filters.contains(""))
    }
}

struct MemStream {
    chunks: VecDeque<MemChunk>,
    bytes: usize,
    next: u64,
    max_bytes: Option<usize>,
    max_age_ms: Option<u64>,
    writers: HashMap<String, u64>,
    offsets: HashMap<String, u64>,
    tail: TailWatch,
    /// Its creation's arguments, as a declaration again compares them.
    declared: Vec<(String, String)>,
}

impl MemStream {
    fn first_offset(&self) -> u64 {
        self.chunks
            .front()
            .map_or(self.next, |c| c.chunk.first_offset)
    }

    /// Index of the chunk holding `offset`, or of the first chunk after it.
    fn chunk_at(&self, offset: u64) -> usize {
        self.chunks
            .partition_point(|c| c.chunk.first_offset + c.chunk.num_records as u64 <= offset)
    }

    fn retain(&mut self, now_ms: u64) {
        // Keep at least the last chunk: retention never empties a stream that has data.
        while self.chunks.len() > 1 {
            let front = &self.chunks[0].chunk;
            let too_big = self.max_bytes.is_some_and(|m| self.bytes > m);
            let too_old = self
                .max_age_ms
                .is_some_and(|age| (front.timestamp.max(0) as u64).saturating_add(age) < now_ms);
            if !(too_big || too_old) {
                break;
            }
            self.bytes -= front.wire_len();
            self.chunks.pop_front();
        }
    }
}

#[derive(Default)]
struct Inner {
    streams: HashMap<(String, String), MemStream>,
    /// Super stream -> (partition, binding key), in binding order.
    super_streams: HashMap<(String, String), Vec<(String, String)>>,
}

/// An in-memory stream log with a user table.
#[derive(Clone)]
pub struct MemoryBackend {
    inner: Arc<Mutex<Inner>>,
    users: Arc<HashMap<String, String>>,
    vhosts: Arc<Vec<String>>,
    /// Users that may log in from loopback only (RabbitMQ's `guest`).
    loopback_only: Arc<Vec<String>>,
    anonymous_as: Option<String>,
    groups: Arc<ConsumerGroups>,
}

impl Default for MemoryBackend {
    fn default() -> Self {
        MemoryBackend::new()
    }
}

impl MemoryBackend {
    /// User `guest`/`guest` (loopback only), vhost `/`, as a fresh RabbitMQ.
    pub fn new() -> MemoryBackend {
        MemoryBackend {
            inner: Arc::default(),
            users: Arc::new(HashMap::from([("guest".into(), "guest".into())])),
            vhosts: Arc::new(vec!["/".into()]),
            loopback_only: Arc::new(vec!["guest".into()]),
            anonymous_as: None,
            groups: Arc::default(),
        }
    }

    /// Adds a user (any address may log in as it).
    pub fn with_user(mut self, user: &str, password: &str) -> MemoryBackend {
        Arc::make_mut(&mut self.users).insert(user.into(), password.into());
        self
    }

    pub fn with_vhost(mut self, vhost: &str) -> MemoryBackend {
        Arc::make_mut(&mut self.vhosts).push(vhost.into());
        self
    }

    /// Lets SASL ANONYMOUS log in as `user`.
    pub fn with_anonymous(mut self, user: &str) -> MemoryBackend {
        self.anonymous_as = Some(user.into());
        self
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves consistent data (no multi-step invariants
        // are broken midway), so a poisoned lock is used as is.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn with_stream<T>(
        &self,
        vhost: &str,
        stream: &str,
        f: impl FnOnce(&mut MemStream) -> Result<T, StreamError>,
    ) -> Result<T, StreamError> {
        let mut inner = self.lock();
        match inner
            .streams
            .get_mut(&(vhost.to_string(), stream.to_string()))
        {
            Some(s) => f(s),
            None => Err(StreamError::DoesNotExist),
        }
    }

    /// Sets a stream's retention from protocol arguments (`max-length-bytes`, `max-age`;
    /// the others are checked and ignored), as creating it with them would have, and
    /// applies it now.
    pub fn set_retention(
        &self,
        vhost: &str,
        stream: &str,
        arguments: &[(String, String)],
        now_ms: u64,
    ) -> Result<(), StreamError> {
        let (max_bytes, max_age_ms) = parse_arguments(arguments)?;
        self.with_stream(vhost, stream, |s| {
            s.max_bytes = max_bytes;
            s.max_age_ms = max_age_ms;
            s.retain(now_ms);
            Ok(())
        })
    }

    fn tail(&self, vhost: &str, stream: &str) -> Result<watch::Receiver<Tail>, StreamError> {
        self.with_stream(vhost, stream, |s| Ok(s.tail.waiter()))
    }
}

/// `max-age` as RabbitMQ writes it: a number and a unit of Y, M, D, h, m or s.
pub fn parse_max_age(v: &str) -> Option<u64> {
    let unit = v.chars().last()?;
    let n: u64 = v[..v.len() - unit.len_utf8()].parse().ok()?;
    let s = match unit {
        'Y' => 365 * 86_400,
        'M' => 30 * 86_400,
        'D' => 86_400,
        'h' => 3_600,
        'm' => 60,
        's' => 1,
        _ => return None,
    };
    n.checked_mul(s)?.checked_mul(1000)
}

/// The arguments RabbitMQ compares when an existing stream is declared again (its stream
/// queue type's equivalence check; RabbitMQ 3.10 answers PRECONDITION_FAILED when one of
/// them differs or is given on one declaration only, and ignores the others). Numbers compare
/// as numbers, `max-age` as written (RabbitMQ: `1h` and `60m` differ); a later duplicate
/// wins, as when the arguments are applied.
pub fn declared_arguments(args: &[(String, String)]) -> Vec<(String, String)> {
    const COMPARED: [&str; 6] = [
        "max-length-bytes",
        "max-age",
        "stream-max-segment-size-bytes",
        "stream-filter-size-bytes",
        "initial-cluster-size",
        "queue-leader-locator",
    ];
    let mut kept = std::collections::BTreeMap::new();
    for (k, v) in args {
        if !COMPARED.contains(&k.as_str()) {
            continue;
        }
        let v = match v.parse::<u64>() {
            Ok(n) if k != "max-age" && k != "queue-leader-locator" => n.to_string(),
            _ => v.clone(),
        };
        kept.insert(k.clone(), v);
    }
    kept.into_iter().collect()
}

/// An existing stream declared again: `AlreadyExists` when the compared arguments are the
/// same (clients take it for success), else `Precondition` (see [`declared_arguments`]).
pub fn redeclared(existing: &[(String, String)], args: &[(String, String)]) -> StreamError {
    let asked = declared_arguments(args);
    if asked == existing {
        StreamError::AlreadyExists
    } else {
        StreamError::Precondition(format!(
            "stream exists with other arguments: {existing:?}, asked for {asked:?}"
        ))
    }
}

fn parse_arguments(args: &[(String, String)]) -> Result<(Option<usize>, Option<u64>), StreamError> {
    let bad = |k: &str, v: &str| StreamError::Precondition(format!("invalid {k}: {v}"));
    let mut max_bytes = None;
    let mut max_age = None;
    for (k, v) in args {
        match k.as_str() {
            "max-length-bytes" => {
                max_bytes = Some(v.parse::<usize>().map_err(|_| bad(k, v))?);
            }
            "max-age" => max_age = Some(parse_max_age(v).ok_or_else(|| bad(k, v))?),
            "stream-max-segment-size-bytes" | "initial-cluster-size" => {
                v.parse::<u64>().map_err(|_| bad(k, v))?;
            }
            "stream-filter-size-bytes" => match v.parse::<u8>() {
                Ok(16..=255) => {}
                _ => return Err(bad(k, v)),
            },
            "queue-leader-locator"
                if !matches!(
                    v.as_str(),
                    "client-local" | "balanced" | "least-leaders" | "random"
                ) =>
            {
                return Err(bad(k, v));
            }
            // RabbitMQ ignores arguments it does not know.
            _ => {}
        }
    }
    Ok((max_bytes, max_age))
}

/// A [`MemoryBackend`] stream's reader.
pub struct MemoryReader {
    backend: MemoryBackend,
    vhost: String,
    stream: String,
    next: u64,
    filter: Option<ReaderFilter>,
}

impl ChunkReader for MemoryReader {
    fn read(&mut self, max_chunks: usize, max_bytes: usize) -> Result<ReadBatch, StreamError> {
        let from = self.next;
        let filter = self.filter.as_ref();
        let (batch, next) = self.backend.with_stream(&self.vhost, &self.stream, |s| {
            let mut batch = ReadBatch {
                chunks: Vec::new(),
                committed_chunk_id: s.chunks.back().map_or(0, |c| c.chunk.first_offset),
            };
            let mut next = from;
            let mut size = 0;
            let mut skipped = 0;
            for c in s.chunks.range(s.chunk_at(from)..) {
                if batch.chunks.len() >= max_chunks
                    || (!batch.chunks.is_empty() && size + c.chunk.wire_len() > max_bytes)
                    || skipped >= MAX_SKIPPED
                {
                    break;
                }
                next = c.chunk.first_offset + c.chunk.num_records as u64;
                if filter.is_some_and(|f| !c.matches(f)) {
                    skipped += 1;
                    continue;
                }
                size += c.chunk.wire_len();
                batch.chunks.push(c.chunk.clone());
            }
            Ok((batch, next))
        })?;
        self.next = self.next.max(next);
        Ok(batch)
    }

    fn position(&self) -> u64 {
        self.next
    }
}

impl StreamBackend for MemoryBackend {
    type Reader = MemoryReader;
    /// Looked up by name at each append (the in-memory map is cheap to search).
    type Target = ();

    fn authenticate(&self, login: &Login, peer: &PeerInfo) -> Result<String, AuthError> {
        let user = match login {
            Login::Plain { username, password } => {
                match self.users.get(username) {
                    Some(p) if p == password => {}
                    _ => return Err(AuthError::Refused),
                }
                username.clone()
            }
            Login::Anonymous => self.anonymous_as.clone().ok_or(AuthError::Refused)?,
        };
        if !peer.is_loopback && self.loopback_only.contains(&user) {
            return Err(AuthError::Loopback);
        }
        Ok(user)
    }

    fn vhost_access(&self, _user: &str, vhost: &str) -> bool {
        self.vhosts.iter().any(|v| v == vhost)
    }

    fn create_stream(
        &self,
        vhost: &str,
        stream: &str,
        arguments: &[(String, String)],
    ) -> Result<(), StreamError> {
        let (max_bytes, max_age_ms) = parse_arguments(arguments)?;
        let mut inner = self.lock();
        let key = (vhost.to_string(), stream.to_string());
        if let Some(s) = inner.streams.get(&key) {
            return Err(redeclared(&s.declared, arguments));
        }
        let tail = TailWatch::new(Tail::default());
        inner.streams.insert(
            key,
            MemStream {
                chunks: VecDeque::new(),
                bytes: 0,
                next: 0,
                max_bytes,
                max_age_ms,
                writers: HashMap::new(),
                offsets: HashMap::new(),
                tail,
                declared: declared_arguments(arguments),
            },
        );
        Ok(())
    }

    fn delete_stream(&self, vhost: &str, stream: &str) -> Result<(), StreamError> {
        let mut inner = self.lock();
        match inner
            .streams
            .remove(&(vhost.to_string(), stream.to_string()))
        {
            Some(s) => {
                s.tail.delete();
                Ok(())
            }
            None => Err(StreamError::DoesNotExist),
        }
    }

    fn stream_exists(&self, vhost: &str, stream: &str) -> bool {
        self.lock()
            .streams
            .contains_key(&(vhost.to_string(), stream.to_string()))
    }

    fn stream_stats(&self, vhost: &str, stream: &str) -> Result<StreamStats, StreamError> {
        self.with_stream(vhost, stream, |s| {
            Ok(StreamStats {
                first_chunk_id: s.chunks.front().map_or(-1, |c| c.chunk.first_offset as i64),
                committed_chunk_id: s.chunks.back().map_or(-1, |c| c.chunk.first_offset as i64),
                // Appended is committed in memory.
                last_chunk_id: s.chunks.back().map_or(-1, |c| c.chunk.first_offset as i64),
            })
        })
    }

    fn target(&self, _vhost: &str, _stream: &str) -> Option<()> {
        None
    }

    fn append(
        &self,
        _target: Option<&()>,
        vhost: &str,
        stream: &str,
        writer: Option<&str>,
        messages: PublishedBatch<'_>,
        now_ms: u64,
    ) -> Result<Appended, StreamError> {
        // Kept as entries sharing the frame's buffer.
        let messages = &messages.to_messages();
        self.with_stream(vhost, stream, |s| {
            let last = writer.and_then(|w| s.writers.get(w).copied());
            let mut keep: Vec<&PublishedMessage> = Vec::with_capacity(messages.len());
            let mut max_id = last;
            for m in messages {
                if last.is_some_and(|l| m.publishing_id <= l) {
                    continue;
                }
                max_id = Some(max_id.map_or(m.publishing_id, |x| x.max(m.publishing_id)));
                keep.push(m);
            }
            let stored = keep.len();
            for part in keep.chunks(chunk::CHUNK_ENTRIES) {
                let entries: Vec<&Entry> = part.iter().map(|m| &m.entry).collect();
                let c = chunk::build(s.next, now_ms as i64, &entries);
                let filters = part
                    .iter()
                    .map(|m| m.filter_value.clone().unwrap_or_default())
                    .collect();
                s.bytes += c.wire_len();
                s.next += c.num_records as u64;
                s.chunks.push_back(MemChunk { chunk: c, filters });
            }
            if let (Some(w), Some(id)) = (writer, max_id)
                && (s.writers.contains_key(w) || s.writers.len() < MAX_REFERENCES)
            {
                s.writers.insert(w.to_string(), id);
            }
            s.retain(now_ms);
            let next = s.next;
            if stored > 0 {
                s.tail
                    .advance(next, s.chunks.back().map(|c| c.chunk.first_offset));
            }
            Ok(Appended {
                stored,
                duplicates: messages.len() - stored,
                confirm_at: next.checked_sub(1),
            })
        })
    }

    fn wait_durable(
        &self,
        vhost: &str,
        stream: &str,
        _offset: u64,
    ) -> impl Future<Output = Result<(), StreamError>> + Send + 'static {
        // In memory, appended is as durable as it gets.
        let exists = self.stream_exists(vhost, stream);
        async move {
            if exists {
                Ok(())
            } else {
                Err(StreamError::DoesNotExist)
            }
        }
    }

    fn resolve_offset(
        &self,
        vhost: &str,
        stream: &str,
        spec: OffsetSpec,
    ) -> Result<u64, StreamError> {
        self.with_stream(vhost, stream, |s| {
            Ok(match spec {
                OffsetSpec::First => s.first_offset(),
                OffsetSpec::Last => s.chunks.back().map_or(s.next, |c| c.chunk.first_offset),
                OffsetSpec::Next => s.next,
                // Below the first: the first; past the end: next (osiris's clamping).
                OffsetSpec::Offset(o) => o.clamp(s.first_offset(), s.next),
                // The first chunk stamped at or after the time; none: next.
                OffsetSpec::Timestamp(ts) => s
                    .chunks
                    .iter()
                    .find(|c| c.chunk.timestamp >= ts)
                    .map_or(s.next, |c| c.chunk.first_offset),
            })
        })
    }

    fn open_reader(
        &self,
        vhost: &str,
        stream: &str,
        spec: OffsetSpec,
        filter: Option<ReaderFilter>,
    ) -> Result<MemoryReader, StreamError> {
        let next = self.resolve_offset(vhost, stream, spec)?;
        Ok(MemoryReader {
            backend: self.clone(),
            vhost: vhost.to_string(),
            stream: stream.to_string(),
            next,
            filter,
        })
    }

    fn wait_data(
        &self,
        vhost: &str,
        stream: &str,
        from: u64,
    ) -> impl Future<Output = Result<(), StreamError>> + Send + 'static {
        tail::wait_past(self.tail(vhost, stream), from)
    }

    fn create_super_stream(
        &self,
        vhost: &str,
        name: &str,
        partitions: &[String],
        binding_keys: &[String],
        arguments: &[(String, String)],
    ) -> Result<(), StreamError> {
        if partitions.is_empty() || partitions.len() != binding_keys.len() {
            return Err(StreamError::Precondition(format!(
                "super stream {name}: {} partitions, {} binding keys",
                partitions.len(),
                binding_keys.len()
            )));
        }
        parse_arguments(arguments)?;
        {
            let inner = self.lock();
            let key = (vhost.to_string(), name.to_string());
            if inner.super_streams.contains_key(&key)
                || partitions
                    .iter()
                    .any(|p| inner.streams.contains_key(&(vhost.to_string(), p.clone())))
            {
                return Err(StreamError::AlreadyExists);
            }
        }
        for (i, p) in partitions.iter().enumerate() {
            if let Err(e) = self.create_stream(vhost, p, arguments) {
                // Undo the partitions made so far: all or nothing.
                for made in &partitions[..i] {
                    let _ = self.delete_stream(vhost, made);
                }
                return Err(e);
            }
        }
        let bindings = partitions
            .iter()
            .cloned()
            .zip(binding_keys.iter().cloned())
            .collect();
        self.lock()
            .super_streams
            .insert((vhost.to_string(), name.to_string()), bindings);
        Ok(())
    }

    fn delete_super_stream(&self, vhost: &str, name: &str) -> Result<Vec<String>, StreamError> {
        let bindings = self
            .lock()
            .super_streams
            .remove(&(vhost.to_string(), name.to_string()))
            .ok_or(StreamError::DoesNotExist)?;
        let partitions: Vec<String> = bindings.into_iter().map(|(p, _)| p).collect();
        for p in &partitions {
            let _ = self.delete_stream(vhost, p);
        }
        Ok(partitions)
    }

    fn partitions(&self, vhost: &str, name: &str) -> Result<Vec<String>, StreamError> {
        self.lock()
            .super_streams
            .get(&(vhost.to_string(), name.to_string()))
            .map(|b| b.iter().map(|(p, _)| p.clone()).collect())
            .ok_or(StreamError::DoesNotExist)
    }

    fn route(
        &self,
        vhost: &str,
        name: &str,
        routing_key: &str,
    ) -> Result<Vec<String>, StreamError> {
        self.lock()
            .super_streams
            .get(&(vhost.to_string(), name.to_string()))
            .map(|b| {
                b.iter()
                    .filter(|(_, k)| k == routing_key)
                    .map(|(p, _)| p.clone())
                    .collect()
            })
            .ok_or(StreamError::DoesNotExist)
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
        self.with_stream(vhost, stream, |s| {
            if !s.offsets.contains_key(reference) && s.offsets.len() >= MAX_REFERENCES {
                return Err(StreamError::Precondition(
                    "too many offset references".into(),
                ));
            }
            s.offsets.insert(reference.to_string(), offset);
            Ok(())
        })
    }

    fn query_offset(
        &self,
        vhost: &str,
        stream: &str,
        reference: &str,
    ) -> Result<Option<u64>, StreamError> {
        self.with_stream(vhost, stream, |s| Ok(s.offsets.get(reference).copied()))
    }

    fn publisher_sequence(
        &self,
        vhost: &str,
        stream: &str,
        reference: &str,
    ) -> Result<u64, StreamError> {
        self.with_stream(vhost, stream, |s| {
            Ok(s.writers.get(reference).copied().unwrap_or(0))
        })
    }
}
