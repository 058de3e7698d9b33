//! `warren serve --in-memory`'s streams: one in-memory log per stream
//! ([`warren_stream::MemoryBackend`]) that both the stream protocol and the core's stream
//! queues use (the core through [`SharedStreams`]), so a stream declared over AMQP is
//! readable on the stream port and the other way round, as with a data directory. Logins
//! and the streams' AMQP queues go through the broker (`broker`). Nothing is durable.

use crate::broker::BrokerLink;
use bytes::Bytes;
use std::future::Future;
use std::sync::Arc;
use warren_core::store::{SharedStreams, StreamBounds, StreamEntry, StreamSettings, StreamStart};
use warren_stream::backend::{
    Appended, AuthError, ChunkReader, Login, OpenedConnection, OperatorClose, PeerInfo,
    ReaderFilter, StreamBackend, StreamError, StreamStats,
};
use warren_stream::codec::{Entry, EntryRef, OffsetSpec, PublishedBatch, PublishedMessage};
use warren_stream::memory::{MemoryBackend, MemoryReader};
use warren_stream::sac::ConsumerGroups;

/// Chunks one read of the core's takes from the log at a time.
const READ_CHUNKS: usize = 16;
/// Bytes one read of the core's takes from the log at a time (past the first chunk).
const READ_BYTES: usize = 1 << 20;

/// See the module docs.
pub struct MemStreams {
    logs: MemoryBackend,
    broker: BrokerLink,
}

impl MemStreams {
    pub fn new() -> Arc<MemStreams> {
        Arc::new(MemStreams {
            logs: MemoryBackend::new(),
            broker: BrokerLink::default(),
        })
    }

    /// The broker, for logins and the streams' AMQP queues (made after this).
    pub fn set_broker(&self, broker: warren_runtime::BrokerHandle) {
        self.broker.set(broker);
    }
}

/// A stream's settings as the stream protocol's arguments.
fn arguments(settings: &StreamSettings) -> Vec<(String, String)> {
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
    args
}

fn spec(start: StreamStart) -> OffsetSpec {
    match start {
        StreamStart::First => OffsetSpec::First,
        StreamStart::Last => OffsetSpec::Last,
        StreamStart::Next => OffsetSpec::Next,
        StreamStart::Offset(o) => OffsetSpec::Offset(o),
        StreamStart::Timestamp(t) => OffsetSpec::Timestamp(i64::try_from(t).unwrap_or(i64::MAX)),
    }
}

/// The core's side of the logs.
impl SharedStreams for MemStreams {
    fn open(&self, vhost: &str, name: &str, settings: &StreamSettings) -> Result<(), String> {
        let args = arguments(settings);
        match self.logs.create_stream(vhost, name, &args) {
            Ok(()) => Ok(()),
            // Created by the stream protocol first (it then declares the queue), or opened
            // again with a policy's settings (which a declaration would call different
            // arguments): those that are set apply.
            Err(_) if args.is_empty() && self.logs.stream_exists(vhost, name) => Ok(()),
            Err(StreamError::AlreadyExists | StreamError::Precondition(_))
                if self.logs.stream_exists(vhost, name) =>
            {
                self.logs
                    .set_retention(vhost, name, &args, warren_runtime::unix_ms())
                    .map_err(|e| e.to_string())
            }
            Err(e) => Err(e.to_string()),
        }
    }

    fn append(
        &self,
        vhost: &str,
        name: &str,
        data: Bytes,
        timestamp_ms: u64,
    ) -> Result<(), String> {
        let message = PublishedMessage {
            publishing_id: 0,
            filter_value: None,
            entry: Entry::Simple(data),
        };
        self.logs
            .append(
                None,
                vhost,
                name,
                None,
                PublishedBatch::Messages(&[message]),
                timestamp_ms,
            )
            .map(|_| ())
            .map_err(|e| e.to_string())
    }

    fn bounds(&self, vhost: &str, name: &str) -> Result<StreamBounds, String> {
        let first = self.logs.resolve_offset(vhost, name, OffsetSpec::First);
        let next = self.logs.resolve_offset(vhost, name, OffsetSpec::Next);
        match (first, next) {
            (Ok(first), Ok(next)) => Ok(StreamBounds {
                first,
                next,
                committed: next,
            }),
            (Err(e), _) | (_, Err(e)) => Err(e.to_string()),
        }
    }

    fn start(&self, vhost: &str, name: &str, start: StreamStart) -> Result<u64, String> {
        self.logs
            .resolve_offset(vhost, name, spec(start))
            .map_err(|e| e.to_string())
    }

    fn read(
        &self,
        vhost: &str,
        name: &str,
        from: u64,
        max: usize,
        out: &mut Vec<StreamEntry>,
    ) -> Result<(), String> {
        let mut reader = self
            .logs
            .open_reader(vhost, name, OffsetSpec::Offset(from), None)
            .map_err(|e| e.to_string())?;
        let mut n = 0;
        while n < max {
            let batch = reader
                .read(READ_CHUNKS, READ_BYTES)
                .map_err(|e| e.to_string())?;
            if batch.chunks.is_empty() {
                break;
            }
            for chunk in batch.chunks {
                let warren_stream::chunk::ChunkData::Bytes(data) = chunk.data else {
                    return Err("an in-memory chunk in a file".into());
                };
                // The chunk is in the protocol's layout, which the native log's data section
                // shares: its records, sub-batches expanded, one offset each.
                let records = warren_store::stream::sub_batch::Records::new(&data);
                for (offset, record) in (chunk.first_offset..).zip(records) {
                    let record = record.map_err(|e| e.to_string())?;
                    if offset >= from {
                        out.push(StreamEntry {
                            offset,
                            timestamp: u64::try_from(chunk.timestamp).unwrap_or(0),
                            data: record,
                        });
                        n += 1;
                    }
                }
            }
        }
        Ok(())
    }

    fn delete(&self, vhost: &str, name: &str) {
        // Gone already when the stream protocol deleted it first.
        let _ = self.logs.delete_stream(vhost, name);
    }
}

/// The stream protocol's side: the logs, with logins, queues and pushes through the broker.
impl StreamBackend for MemStreams {
    type Reader = MemoryReader;
    type Target = ();

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
        let kept = crate::disk::parse_arguments(arguments)?;
        self.logs.create_stream(vhost, stream, arguments)?;
        self.broker.declare_queue(vhost, stream, &kept);
        Ok(())
    }

    fn delete_stream(&self, vhost: &str, stream: &str) -> Result<(), StreamError> {
        if !self.logs.stream_exists(vhost, stream) {
            return Err(StreamError::DoesNotExist);
        }
        // Through the broker first: its queue goes, and with it the log.
        self.broker.delete_queue(vhost, stream);
        match self.logs.delete_stream(vhost, stream) {
            Ok(()) | Err(StreamError::DoesNotExist) => Ok(()),
            Err(e) => Err(e),
        }
    }

    fn stream_exists(&self, vhost: &str, stream: &str) -> bool {
        self.logs.stream_exists(vhost, stream)
    }

    fn stream_stats(&self, vhost: &str, stream: &str) -> Result<StreamStats, StreamError> {
        self.logs.stream_stats(vhost, stream)
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
        // As the data directory's streams: sub-batches of the codecs AMQP consumers can
        // read (their records expanded for them), stored as published.
        for m in messages.iter() {
            if let EntryRef::SubBatch { compression, .. } = m.entry
                && !warren_store::stream::sub_batch::served(compression)
            {
                return Err(StreamError::Precondition(format!(
                    "sub-batch compression {compression} is not served (none and gzip are)"
                )));
            }
        }
        let appended = self
            .logs
            .append(None, vhost, stream, writer, messages, now_ms)?;
        if appended.stored > 0 {
            self.broker.streams_grew(vhost, stream);
        }
        Ok(appended)
    }

    fn wait_durable(
        &self,
        vhost: &str,
        stream: &str,
        offset: u64,
    ) -> impl Future<Output = Result<(), StreamError>> + Send + 'static {
        self.logs.wait_durable(vhost, stream, offset)
    }

    fn resolve_offset(
        &self,
        vhost: &str,
        stream: &str,
        spec: OffsetSpec,
    ) -> Result<u64, StreamError> {
        self.logs.resolve_offset(vhost, stream, spec)
    }

    fn open_reader(
        &self,
        vhost: &str,
        stream: &str,
        spec: OffsetSpec,
        filter: Option<ReaderFilter>,
    ) -> Result<MemoryReader, StreamError> {
        self.logs.open_reader(vhost, stream, spec, filter)
    }

    fn wait_data(
        &self,
        vhost: &str,
        stream: &str,
        from: u64,
    ) -> impl Future<Output = Result<(), StreamError>> + Send + 'static {
        self.logs.wait_data(vhost, stream, from)
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
        self.logs.consumer_groups()
    }

    fn store_offset(
        &self,
        vhost: &str,
        stream: &str,
        reference: &str,
        offset: u64,
    ) -> Result<(), StreamError> {
        self.logs.store_offset(vhost, stream, reference, offset)
    }

    fn query_offset(
        &self,
        vhost: &str,
        stream: &str,
        reference: &str,
    ) -> Result<Option<u64>, StreamError> {
        self.logs.query_offset(vhost, stream, reference)
    }

    fn publisher_sequence(
        &self,
        vhost: &str,
        stream: &str,
        reference: &str,
    ) -> Result<u64, StreamError> {
        self.logs.publisher_sequence(vhost, stream, reference)
    }
}
