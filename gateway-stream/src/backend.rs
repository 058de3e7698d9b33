//! What a stream-protocol session needs from the broker. The session calls the synchronous
//! methods inline (they do no I/O wait: an append hands a batch to the log, a read returns
//! what is committed) and asks its shell to await the two waits, `wait_durable` and
//! `wait_data`, whose results it is then given. A stream log (append batch, sync -> durable
//! offset, read chunks from an offset, stored offsets and writer sequences) implements it
//! directly; a core that owns stream queues can implement it by forwarding.

use crate::chunk::Chunk;
use crate::codec::{OffsetSpec, PublishedBatch};
use std::future::Future;

/// How the client authenticates (SASL).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Login {
    Plain { username: String, password: String },
    Anonymous,
}

/// Who is connected.
#[derive(Clone, Debug, Default)]
pub struct PeerInfo {
    pub addr: String,
    pub is_loopback: bool,
    /// It came through a TLS listener (`--stream-tls`).
    pub tls: bool,
}

/// An open connection as operators see it (`GET /api/connections`, `warren ctl
/// list-connections`), handed to [`StreamBackend::register_connection`] once Open succeeds.
#[derive(Clone, Copy, Debug)]
pub struct OpenedConnection<'a> {
    pub peer: &'a PeerInfo,
    pub user: &'a str,
    pub vhost: &'a str,
    /// The client's PeerProperties (`connection_name`, `product`, ...).
    pub client_properties: &'a [(String, String)],
    pub heartbeat_s: u32,
    pub frame_max: u32,
}

/// A registered connection's end on the operators' side: resolves with the reason when an
/// operator closes the connection (or its vhost goes); dropped when the connection ends, which
/// takes it out of the listings.
pub type OperatorClose = std::pin::Pin<Box<dyn Future<Output = String> + Send>>;

#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum AuthError {
    #[error("authentication refused")]
    Refused,
    /// The user may only connect from loopback (RabbitMQ's `loopback_users`).
    #[error("user may only connect via localhost")]
    Loopback,
}

#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum StreamError {
    #[error("stream does not exist")]
    DoesNotExist,
    #[error("stream already exists")]
    AlreadyExists,
    #[error("precondition failed: {0}")]
    Precondition(String),
    #[error("access refused")]
    AccessRefused,
    #[error("internal error: {0}")]
    Internal(String),
}

impl StreamError {
    /// The protocol's response code for this error.
    pub fn code(&self) -> u16 {
        use crate::frame::code;
        match self {
            StreamError::DoesNotExist => code::STREAM_DOES_NOT_EXIST,
            StreamError::AlreadyExists => code::STREAM_ALREADY_EXISTS,
            StreamError::Precondition(_) => code::PRECONDITION_FAILED,
            StreamError::AccessRefused => code::ACCESS_REFUSED,
            StreamError::Internal(_) => code::INTERNAL_ERROR,
        }
    }
}

/// The outcome of an append.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Appended {
    /// Messages written (re-sent publishing ids of a named writer are not).
    pub stored: usize,
    /// Messages skipped as duplicates.
    pub duplicates: usize,
    /// Once this offset is durable, every message of the batch may be confirmed (for
    /// duplicates too: the copy written earlier may still be on its way to disk). `None`
    /// when the stream holds nothing at all.
    pub confirm_at: Option<u64>,
}

/// Committed chunks read from a stream.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReadBatch {
    pub chunks: Vec<Chunk>,
    /// The id of the last committed chunk (Deliver v2).
    pub committed_chunk_id: u64,
}

/// A subscription's reader: a position in one stream that moves forward as it reads. Held by
/// the session (one per subscription) and used from its thread only.
pub trait ChunkReader: Send + 'static {
    /// Committed chunks from the position on, at most `max_chunks` and, past the first, at
    /// most `max_bytes` in all; empty when the reader has caught up. The chunk holding the
    /// position comes first (whole: clients drop the records before the offset they asked
    /// for). An error when the stream is gone.
    fn read(&mut self, max_chunks: usize, max_bytes: usize) -> Result<ReadBatch, StreamError>;
    /// The offset the next read starts from (what [`StreamBackend::wait_data`] waits past).
    fn position(&self) -> u64;
}

/// Stream filtering (RabbitMQ 3.13): a subscription's `filter.N` values and
/// `match-unfiltered`. A chunk is delivered when it holds a message with one of the values,
/// or, with `match_unfiltered`, a message without a filter value. Best effort, as osiris's
/// bloom filter: a backend may deliver more (clients filter messages themselves), never less.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReaderFilter {
    pub values: Vec<String>,
    pub match_unfiltered: bool,
}

impl ReaderFilter {
    /// From Subscribe properties; `None` when there is no `filter.` value.
    pub fn from_properties(properties: &[(String, String)]) -> Option<ReaderFilter> {
        let values: Vec<String> = properties
            .iter()
            .filter(|(k, _)| k.starts_with("filter."))
            .map(|(_, v)| v.clone())
            .collect();
        if values.is_empty() {
            return None;
        }
        let match_unfiltered = properties
            .iter()
            .any(|(k, v)| k == "match-unfiltered" && v == "true");
        Some(ReaderFilter {
            values,
            match_unfiltered,
        })
    }
}

/// `StreamStats`' figures (RabbitMQ sends osiris's counters; -1 when there is none).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamStats {
    pub first_chunk_id: i64,
    pub committed_chunk_id: i64,
    /// The id of the last chunk written, committed or not (osiris's `last_chunk_id`).
    pub last_chunk_id: i64,
}

/// The broker side of the stream protocol. Names are `(vhost, stream)`.
pub trait StreamBackend: Send + Sync + 'static {
    type Reader: ChunkReader;
    /// A stream as a publisher holds it from its declaration (RabbitMQ's publishers hold
    /// their stream's writer): appends through it skip the lookup by name. It must fail
    /// with `DoesNotExist` once its stream is deleted, even if one of that name is created
    /// again (the publisher went with the first).
    type Target: Send + Sync + 'static;

    /// SASL: checks a login; returns the user name.
    fn authenticate(&self, login: &Login, peer: &PeerInfo) -> Result<String, AuthError>;
    /// Whether `user` may open `vhost`.
    fn vhost_access(&self, user: &str, vhost: &str) -> bool;

    /// Creates a stream with its arguments (`max-length-bytes`, `max-age`,
    /// `stream-max-segment-size-bytes`, ...); unknown or invalid ones are a precondition
    /// failure.
    fn create_stream(
        &self,
        vhost: &str,
        stream: &str,
        arguments: &[(String, String)],
    ) -> Result<(), StreamError>;
    fn delete_stream(&self, vhost: &str, stream: &str) -> Result<(), StreamError>;
    fn stream_exists(&self, vhost: &str, stream: &str) -> bool;
    fn stream_stats(&self, vhost: &str, stream: &str) -> Result<StreamStats, StreamError>;

    /// The stream `(vhost, stream)` as a publisher holds it (`None`: appends go by name).
    fn target(&self, vhost: &str, stream: &str) -> Option<Self::Target>;

    /// Appends one batch (one or more chunks) stamped `now_ms`, to `target` when given (the
    /// stream of that name when it was taken), else by name. With a `writer` reference,
    /// messages whose publishing id is at most the last one stored for that reference are
    /// skipped (deduplication) and the reference's sequence advances.
    #[allow(clippy::too_many_arguments)]
    fn append(
        &self,
        target: Option<&Self::Target>,
        vhost: &str,
        stream: &str,
        writer: Option<&str>,
        messages: PublishedBatch<'_>,
        now_ms: u64,
    ) -> Result<Appended, StreamError>;
    /// Resolves once `offset` is durable (fsync'd, group commit), or with an error if the
    /// stream goes away.
    fn wait_durable(
        &self,
        vhost: &str,
        stream: &str,
        offset: u64,
    ) -> impl Future<Output = Result<(), StreamError>> + Send + 'static;

    /// Where an offset specification starts reading: a chunk id, or the next offset when it
    /// points past the end (a reader there waits for data, as osiris attaches at `next`).
    fn resolve_offset(
        &self,
        vhost: &str,
        stream: &str,
        spec: OffsetSpec,
    ) -> Result<u64, StreamError>;
    /// A reader positioned as `spec` resolves: `first`, `last` (the last chunk), `next`, an
    /// offset (clamped into the retained range; past the end: `next`), a timestamp (the first
    /// chunk stamped at or after it; none: `next`). With a filter, chunks that hold none of
    /// its values may be skipped (see [`ReaderFilter`]).
    fn open_reader(
        &self,
        vhost: &str,
        stream: &str,
        spec: OffsetSpec,
        filter: Option<ReaderFilter>,
    ) -> Result<Self::Reader, StreamError>;
    /// Resolves once a committed chunk holds an offset >= `from`, or with an error if the
    /// stream goes away.
    fn wait_data(
        &self,
        vhost: &str,
        stream: &str,
        from: u64,
    ) -> impl Future<Output = Result<(), StreamError>> + Send + 'static;
    /// Resolves once the stream is deleted (at once if it does not exist), however that
    /// happens (this protocol, AMQP, the HTTP API): connections with a publisher or
    /// consumer on it are told (MetadataUpdate). The default waits for data past the last
    /// possible offset, which only a deletion ends.
    fn wait_deleted(&self, vhost: &str, stream: &str) -> impl Future<Output = ()> + Send + 'static {
        let gone = self.wait_data(vhost, stream, u64::MAX);
        async move {
            let _ = gone.await;
        }
    }

    /// Makes an open connection visible to operators (listings, closing); `None` (the
    /// default) for a backend without them.
    fn register_connection(&self, connection: OpenedConnection<'_>) -> Option<OperatorClose> {
        let _ = connection;
        None
    }

    /// Super streams: a name over partition streams, each bound with a binding key (RabbitMQ
    /// makes it a direct exchange). Creates the partitions with `arguments`. A name or a
    /// partition that exists already: `AlreadyExists`; no partitions, or a key count that
    /// differs from the partition count: `Precondition`. The default: not supported.
    fn create_super_stream(
        &self,
        vhost: &str,
        name: &str,
        partitions: &[String],
        binding_keys: &[String],
        arguments: &[(String, String)],
    ) -> Result<(), StreamError> {
        let _ = (vhost, partitions, binding_keys, arguments);
        Err(StreamError::Precondition(format!(
            "super stream {name}: super streams are not supported"
        )))
    }
    /// Deletes a super stream and its partitions; returns the partitions.
    fn delete_super_stream(&self, vhost: &str, name: &str) -> Result<Vec<String>, StreamError> {
        let _ = (vhost, name);
        Err(StreamError::DoesNotExist)
    }
    /// The partitions, in binding order.
    fn partitions(&self, vhost: &str, name: &str) -> Result<Vec<String>, StreamError> {
        let _ = (vhost, name);
        Err(StreamError::DoesNotExist)
    }
    /// The partitions bound with exactly `routing_key` (empty: no route).
    fn route(
        &self,
        vhost: &str,
        name: &str,
        routing_key: &str,
    ) -> Result<Vec<String>, StreamError> {
        let _ = (vhost, name, routing_key);
        Err(StreamError::DoesNotExist)
    }

    /// The single-active-consumer groups of this broker (shared by all its connections).
    fn consumer_groups(&self) -> &crate::sac::ConsumerGroups;

    /// Server-side offset tracking.
    fn store_offset(
        &self,
        vhost: &str,
        stream: &str,
        reference: &str,
        offset: u64,
    ) -> Result<(), StreamError>;
    fn query_offset(
        &self,
        vhost: &str,
        stream: &str,
        reference: &str,
    ) -> Result<Option<u64>, StreamError>;
    /// The last publishing id stored for a writer reference (0 when none).
    fn publisher_sequence(
        &self,
        vhost: &str,
        stream: &str,
        reference: &str,
    ) -> Result<u64, StreamError>;
}
