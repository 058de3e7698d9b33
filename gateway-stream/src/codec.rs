//! Every command of the stream protocol as a value, with its exact wire encoding
//! (`PROTOCOL.adoc`, checked against RabbitMQ's `rabbit_stream_core.erl` where the spec is
//! loose). One decoder serves both directions: the key (with its response bit) and version
//! say which command a body is. `decode(encode(x)) == x` for every command.

use crate::frame::{
    DecodeError, Reader, code, key, put_bytes, put_map, put_string, read_map, read_strings,
};
use bytes::{BufMut, Bytes, BytesMut};

/// Where a subscription starts (`OffsetSpecification`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OffsetSpec {
    First,
    Last,
    Next,
    Offset(u64),
    /// Milliseconds since the epoch.
    Timestamp(i64),
}

impl OffsetSpec {
    fn put(&self, out: &mut BytesMut) {
        match *self {
            OffsetSpec::First => out.put_u16(1),
            OffsetSpec::Last => out.put_u16(2),
            OffsetSpec::Next => out.put_u16(3),
            OffsetSpec::Offset(o) => {
                out.put_u16(4);
                out.put_u64(o);
            }
            OffsetSpec::Timestamp(t) => {
                out.put_u16(5);
                out.put_i64(t);
            }
        }
    }

    fn read(r: &mut Reader) -> Result<OffsetSpec, DecodeError> {
        let t = r.u16("offset type")?;
        Self::read_type(r, t)
    }

    fn read_type(r: &mut Reader, t: u16) -> Result<OffsetSpec, DecodeError> {
        Ok(match t {
            1 => OffsetSpec::First,
            2 => OffsetSpec::Last,
            3 => OffsetSpec::Next,
            4 => OffsetSpec::Offset(r.u64("offset")?),
            5 => OffsetSpec::Timestamp(r.i64("timestamp")?),
            _ => return Err(DecodeError::BadValue("offset type")),
        })
    }
}

/// One message of a Publish frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PublishedMessage {
    pub publishing_id: u64,
    /// Version 2 only: the filter value (`None`: null string).
    pub filter_value: Option<String>,
    pub entry: Entry,
}

pub use crate::chunk::Entry;

/// A Publish frame's messages, or decoded ones: what a backend appends. The session reads
/// Publish frames straight from its read buffer into [`PublishedBatch::Wire`] (checked once
/// by [`parse_publish`], then iterated over the frame's own bytes), so a 1-message frame
/// costs no allocation and no reference count on its way to the log.
#[derive(Clone, Copy, Debug)]
pub enum PublishedBatch<'a> {
    /// The message section of a Publish frame (after the count), checked by
    /// [`parse_publish`]: `count` messages, each a publishing id, a filter value (`v2`) and
    /// an entry, filling `bytes` exactly.
    Wire {
        bytes: &'a [u8],
        count: usize,
        v2: bool,
        summary: BatchSummary,
    },
    Messages(&'a [PublishedMessage]),
}

/// What a backend checks before it appends, known from the parse (no pass of its own).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BatchSummary {
    pub min_id: u64,
    pub max_id: u64,
    /// Bytes of the simple entries as a chunk's data section holds them (4-byte size each).
    pub simple_bytes: u64,
    pub sub_batches: bool,
}

impl BatchSummary {
    fn add(&mut self, first: bool, m: &PublishedRef<'_>) {
        if first {
            self.min_id = m.publishing_id;
            self.max_id = m.publishing_id;
        }
        self.min_id = self.min_id.min(m.publishing_id);
        self.max_id = self.max_id.max(m.publishing_id);
        match m.entry {
            EntryRef::Simple(b) => self.simple_bytes += 4 + b.len() as u64,
            EntryRef::SubBatch { .. } => self.sub_batches = true,
        }
    }
}

/// One message of a [`PublishedBatch`], borrowed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PublishedRef<'a> {
    pub publishing_id: u64,
    pub filter_value: Option<&'a str>,
    pub entry: EntryRef<'a>,
}

/// An [`Entry`], borrowed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EntryRef<'a> {
    Simple(&'a [u8]),
    SubBatch {
        compression: u8,
        count: u16,
        uncompressed_size: u32,
        data: &'a [u8],
    },
}

impl<'a> PublishedBatch<'a> {
    pub fn len(&self) -> usize {
        match self {
            PublishedBatch::Wire { count, .. } => *count,
            PublishedBatch::Messages(m) => m.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn iter(&self) -> PublishedIter<'a> {
        match *self {
            PublishedBatch::Wire {
                bytes, count, v2, ..
            } => PublishedIter::Wire {
                bytes,
                left: count,
                v2,
            },
            PublishedBatch::Messages(m) => PublishedIter::Messages(m.iter()),
        }
    }

    /// Ids, sizes and sub-batches (from the parse for a frame).
    pub fn summary(&self) -> BatchSummary {
        match self {
            PublishedBatch::Wire { summary, .. } => *summary,
            PublishedBatch::Messages(_) => {
                let mut s = BatchSummary::default();
                for (i, m) in self.iter().enumerate() {
                    s.add(i == 0, &m);
                }
                s
            }
        }
    }

    /// The messages as owned values, for backends that keep them: a frame's section is
    /// copied once and its messages share that copy.
    pub fn to_messages(&self) -> Vec<PublishedMessage> {
        let PublishedBatch::Wire { bytes, .. } = *self else {
            return match self {
                PublishedBatch::Messages(m) => m.to_vec(),
                PublishedBatch::Wire { .. } => Vec::new(),
            };
        };
        let owned = Bytes::copy_from_slice(bytes);
        // Each entry is a subslice of `bytes`: the same range of the copy.
        let share = |d: &[u8]| {
            let at = (d.as_ptr() as usize).saturating_sub(bytes.as_ptr() as usize);
            owned.slice(at.min(owned.len())..(at + d.len()).min(owned.len()))
        };
        self.iter()
            .map(|m| PublishedMessage {
                publishing_id: m.publishing_id,
                filter_value: m.filter_value.map(str::to_string),
                entry: match m.entry {
                    EntryRef::Simple(d) => Entry::Simple(share(d)),
                    EntryRef::SubBatch {
                        compression,
                        count,
                        uncompressed_size,
                        data,
                    } => Entry::SubBatch {
                        compression,
                        count,
                        uncompressed_size,
                        data: share(data),
                    },
                },
            })
            .collect()
    }
}

/// Iterates a [`PublishedBatch`].
#[derive(Clone, Debug)]
pub enum PublishedIter<'a> {
    Wire {
        /// What is left of the section.
        bytes: &'a [u8],
        left: usize,
        v2: bool,
    },
    Messages(std::slice::Iter<'a, PublishedMessage>),
}

impl<'a> Iterator for PublishedIter<'a> {
    type Item = PublishedRef<'a>;

    fn next(&mut self) -> Option<PublishedRef<'a>> {
        match self {
            PublishedIter::Messages(it) => it.next().map(|m| PublishedRef {
                publishing_id: m.publishing_id,
                filter_value: m.filter_value.as_deref(),
                entry: match &m.entry {
                    Entry::Simple(b) => EntryRef::Simple(b),
                    Entry::SubBatch {
                        compression,
                        count,
                        uncompressed_size,
                        data,
                    } => EntryRef::SubBatch {
                        compression: *compression,
                        count: *count,
                        uncompressed_size: *uncompressed_size,
                        data,
                    },
                },
            }),
            PublishedIter::Wire { bytes, left, v2 } => {
                if *left == 0 {
                    return None;
                }
                // Checked by `parse_publish`; a short read ends the iteration, never panics.
                let (m, used) = read_published(bytes, *v2).ok()?;
                *bytes = bytes.get(used..)?;
                *left -= 1;
                Some(m)
            }
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        match self {
            PublishedIter::Wire { left, .. } => (*left, Some(*left)),
            PublishedIter::Messages(it) => it.size_hint(),
        }
    }
}

/// One message of a Publish frame at the front of `b`: it and the bytes it took.
fn read_published(b: &[u8], v2: bool) -> Result<(PublishedRef<'_>, usize), DecodeError> {
    let take = |at: usize, n: usize, what: &'static str| -> Result<&[u8], DecodeError> {
        b.get(at..at.checked_add(n).ok_or(DecodeError::Truncated(what))?)
            .ok_or(DecodeError::Truncated(what))
    };
    let publishing_id = u64::from_be_bytes(
        take(0, 8, "publishing id")?
            .try_into()
            .map_err(|_| DecodeError::Truncated("publishing id"))?,
    );
    let mut at = 8;
    let mut filter_value = None;
    if v2 {
        let len = i16::from_be_bytes([
            *b.get(at).ok_or(DecodeError::Truncated("filter value"))?,
            *b.get(at + 1)
                .ok_or(DecodeError::Truncated("filter value"))?,
        ]);
        at += 2;
        if len >= 0 {
            let s = take(at, len as usize, "filter value")?;
            filter_value = Some(std::str::from_utf8(s).map_err(|_| DecodeError::Utf8)?);
            at += len as usize;
        }
    }
    let first = *b.get(at).ok_or(DecodeError::Truncated("entry header"))?;
    let entry = if first & 0x80 == 0 {
        let h = take(at, 4, "entry size")?;
        let len = u32::from_be_bytes([h[0], h[1], h[2], h[3]]) as usize;
        at += 4;
        let data = take(at, len, "entry")?;
        at += len;
        EntryRef::Simple(data)
    } else {
        let h = take(at, 11, "sub-batch header")?;
        let compression = (first >> 4) & 0x07;
        let count = u16::from_be_bytes([h[1], h[2]]);
        let uncompressed_size = u32::from_be_bytes([h[3], h[4], h[5], h[6]]);
        let len = u32::from_be_bytes([h[7], h[8], h[9], h[10]]) as usize;
        at += 11;
        let data = take(at, len, "sub-batch")?;
        at += len;
        EntryRef::SubBatch {
            compression,
            count,
            uncompressed_size,
            data,
        }
    };
    Ok((
        PublishedRef {
            publishing_id,
            filter_value,
            entry,
        },
        at,
    ))
}

/// A Publish frame's body (key and version included) read in place, without a [`Frame`]:
/// the publisher id and its messages as a [`PublishedBatch::Wire`], the section checked whole
/// (the same checks and errors as [`decode`]); `None` when the body is not a Publish command.
pub fn parse_publish(b: &[u8]) -> Option<Result<(u8, PublishedBatch<'_>), DecodeError>> {
    if b.len() < 4 || u16::from_be_bytes([b[0], b[1]]) != key::PUBLISH {
        return None;
    }
    let version = u16::from_be_bytes([b[2], b[3]]);
    if version != 1 && version != 2 {
        return None;
    }
    let v2 = version == 2;
    Some((|| {
        let publisher_id = *b.get(4).ok_or(DecodeError::Truncated("publisher id"))?;
        let n = b
            .get(5..9)
            .ok_or(DecodeError::Truncated("published messages"))?;
        let n = i32::from_be_bytes([n[0], n[1], n[2], n[3]]);
        if n < 0 {
            return Err(DecodeError::BadValue("published messages"));
        }
        let n = n as usize;
        let section = &b[9..];
        // id + smallest entry (4-byte size) [+ null filter string], as `decode`.
        if n.saturating_mul(if v2 { 14 } else { 12 }) > section.len() {
            return Err(DecodeError::Truncated("published messages"));
        }
        let mut summary = BatchSummary::default();
        let mut at = 0;
        for i in 0..n {
            let (m, used) = read_published(&section[at..], v2)?;
            summary.add(i == 0, &m);
            at += used;
        }
        if at != section.len() {
            return Err(DecodeError::Trailing(section.len() - at));
        }
        Ok((
            publisher_id,
            PublishedBatch::Wire {
                bytes: section,
                count: n,
                v2,
                summary,
            },
        ))
    })())
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Broker {
    pub reference: u16,
    pub host: String,
    pub port: u32,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StreamMetadata {
    pub stream: String,
    pub code: u16,
    /// Index into the brokers; 0xffff when the stream has none (RabbitMQ writes -1).
    pub leader: u16,
    pub replicas: Vec<u16>,
}

/// `(key, min version, max version)`.
pub type CommandVersion = (u16, u16, u16);

/// A stream-protocol frame: one command, either direction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Frame {
    DeclarePublisher {
        corr: u32,
        publisher_id: u8,
        reference: String,
        stream: String,
    },
    /// Version 1 when `v2` is false (no filter values), else version 2.
    Publish {
        v2: bool,
        publisher_id: u8,
        messages: Vec<PublishedMessage>,
    },
    PublishConfirm {
        publisher_id: u8,
        publishing_ids: Vec<u64>,
    },
    PublishError {
        publisher_id: u8,
        /// `(publishing id, code)`.
        errors: Vec<(u64, u16)>,
    },
    QueryPublisherSequence {
        corr: u32,
        reference: String,
        stream: String,
    },
    QueryPublisherSequenceResponse {
        corr: u32,
        code: u16,
        sequence: u64,
    },
    DeletePublisher {
        corr: u32,
        publisher_id: u8,
    },
    Subscribe {
        corr: u32,
        subscription_id: u8,
        stream: String,
        offset: OffsetSpec,
        credit: u16,
        properties: Vec<(String, String)>,
    },
    /// Version 2 carries the committed chunk id.
    Deliver {
        subscription_id: u8,
        committed_chunk_id: Option<u64>,
        chunk: Bytes,
    },
    Credit {
        subscription_id: u8,
        credit: u16,
    },
    /// Sent only on a problem; no correlation id.
    CreditResponse {
        code: u16,
        subscription_id: u8,
    },
    StoreOffset {
        reference: String,
        stream: String,
        offset: u64,
    },
    QueryOffset {
        corr: u32,
        reference: String,
        stream: String,
    },
    QueryOffsetResponse {
        corr: u32,
        code: u16,
        offset: u64,
    },
    Unsubscribe {
        corr: u32,
        subscription_id: u8,
    },
    Create {
        corr: u32,
        stream: String,
        arguments: Vec<(String, String)>,
    },
    Delete {
        corr: u32,
        stream: String,
    },
    Metadata {
        corr: u32,
        streams: Vec<String>,
    },
    MetadataResponse {
        corr: u32,
        brokers: Vec<Broker>,
        streams: Vec<StreamMetadata>,
    },
    MetadataUpdate {
        code: u16,
        stream: String,
    },
    PeerProperties {
        corr: u32,
        properties: Vec<(String, String)>,
    },
    PeerPropertiesResponse {
        corr: u32,
        code: u16,
        properties: Vec<(String, String)>,
    },
    SaslHandshake {
        corr: u32,
    },
    SaslHandshakeResponse {
        corr: u32,
        code: u16,
        mechanisms: Vec<String>,
    },
    SaslAuthenticate {
        corr: u32,
        mechanism: String,
        /// -1 (null) reads as empty.
        data: Bytes,
    },
    /// The challenge is written only when non-empty (as a `string`, as RabbitMQ does).
    SaslAuthenticateResponse {
        corr: u32,
        code: u16,
        challenge: Bytes,
    },
    /// Server's proposal, and a client's answer sent with the request key.
    Tune {
        frame_max: u32,
        heartbeat: u32,
    },
    /// A client's answer sent with the response key (both are accepted).
    TuneResponse {
        frame_max: u32,
        heartbeat: u32,
    },
    Open {
        corr: u32,
        vhost: String,
    },
    /// Properties are written when the code is OK or when there are some.
    OpenResponse {
        corr: u32,
        code: u16,
        properties: Vec<(String, String)>,
    },
    Close {
        corr: u32,
        code: u16,
        reason: String,
    },
    Heartbeat,
    Route {
        corr: u32,
        routing_key: String,
        super_stream: String,
    },
    RouteResponse {
        corr: u32,
        code: u16,
        streams: Vec<String>,
    },
    Partitions {
        corr: u32,
        super_stream: String,
    },
    PartitionsResponse {
        corr: u32,
        code: u16,
        streams: Vec<String>,
    },
    ConsumerUpdate {
        corr: u32,
        subscription_id: u8,
        active: bool,
    },
    /// `offset: None` is type 0 ("none": keep the subscription's own).
    ConsumerUpdateResponse {
        corr: u32,
        code: u16,
        offset: Option<OffsetSpec>,
    },
    ExchangeCommandVersions {
        corr: u32,
        versions: Vec<CommandVersion>,
    },
    ExchangeCommandVersionsResponse {
        corr: u32,
        code: u16,
        versions: Vec<CommandVersion>,
    },
    StreamStats {
        corr: u32,
        stream: String,
    },
    StreamStatsResponse {
        corr: u32,
        code: u16,
        stats: Vec<(String, i64)>,
    },
    CreateSuperStream {
        corr: u32,
        name: String,
        partitions: Vec<String>,
        binding_keys: Vec<String>,
        arguments: Vec<(String, String)>,
    },
    DeleteSuperStream {
        corr: u32,
        name: String,
    },
    ResolveOffsetSpec {
        corr: u32,
        stream: String,
        offset: OffsetSpec,
        properties: Vec<(String, String)>,
    },
    ResolveOffsetSpecResponse {
        corr: u32,
        code: u16,
        offset_type: u16,
        offset: u64,
    },
    /// A response that carries only a code: declare/delete publisher, subscribe,
    /// unsubscribe, create/delete (super) stream, close. `key` is the request's key.
    Response {
        key: u16,
        corr: u32,
        code: u16,
    },
}

/// Keys whose response is a bare code.
const PLAIN_RESPONSES: [u16; 9] = [
    key::DECLARE_PUBLISHER,
    key::DELETE_PUBLISHER,
    key::SUBSCRIBE,
    key::UNSUBSCRIBE,
    key::CREATE,
    key::DELETE,
    key::CLOSE,
    key::CREATE_SUPER_STREAM,
    key::DELETE_SUPER_STREAM,
];

pub fn is_plain_response(k: u16) -> bool {
    PLAIN_RESPONSES.contains(&k)
}

impl Frame {
    /// The key on the wire (with the response bit).
    pub fn key(&self) -> u16 {
        use Frame::*;
        let r = key::RESPONSE;
        match self {
            DeclarePublisher { .. } => key::DECLARE_PUBLISHER,
            Publish { .. } => key::PUBLISH,
            PublishConfirm { .. } => key::PUBLISH_CONFIRM,
            PublishError { .. } => key::PUBLISH_ERROR,
            QueryPublisherSequence { .. } => key::QUERY_PUBLISHER_SEQUENCE,
            QueryPublisherSequenceResponse { .. } => r | key::QUERY_PUBLISHER_SEQUENCE,
            DeletePublisher { .. } => key::DELETE_PUBLISHER,
            Subscribe { .. } => key::SUBSCRIBE,
            Deliver { .. } => key::DELIVER,
            Credit { .. } => key::CREDIT,
            CreditResponse { .. } => r | key::CREDIT,
            StoreOffset { .. } => key::STORE_OFFSET,
            QueryOffset { .. } => key::QUERY_OFFSET,
            QueryOffsetResponse { .. } => r | key::QUERY_OFFSET,
            Unsubscribe { .. } => key::UNSUBSCRIBE,
            Create { .. } => key::CREATE,
            Delete { .. } => key::DELETE,
            Metadata { .. } => key::METADATA,
            MetadataResponse { .. } => r | key::METADATA,
            MetadataUpdate { .. } => key::METADATA_UPDATE,
            PeerProperties { .. } => key::PEER_PROPERTIES,
            PeerPropertiesResponse { .. } => r | key::PEER_PROPERTIES,
            SaslHandshake { .. } => key::SASL_HANDSHAKE,
            SaslHandshakeResponse { .. } => r | key::SASL_HANDSHAKE,
            SaslAuthenticate { .. } => key::SASL_AUTHENTICATE,
            SaslAuthenticateResponse { .. } => r | key::SASL_AUTHENTICATE,
            Tune { .. } => key::TUNE,
            TuneResponse { .. } => r | key::TUNE,
            Open { .. } => key::OPEN,
            OpenResponse { .. } => r | key::OPEN,
            Close { .. } => key::CLOSE,
            Heartbeat => key::HEARTBEAT,
            Route { .. } => key::ROUTE,
            RouteResponse { .. } => r | key::ROUTE,
            Partitions { .. } => key::PARTITIONS,
            PartitionsResponse { .. } => r | key::PARTITIONS,
            ConsumerUpdate { .. } => key::CONSUMER_UPDATE,
            ConsumerUpdateResponse { .. } => r | key::CONSUMER_UPDATE,
            ExchangeCommandVersions { .. } => key::EXCHANGE_COMMAND_VERSIONS,
            ExchangeCommandVersionsResponse { .. } => r | key::EXCHANGE_COMMAND_VERSIONS,
            StreamStats { .. } => key::STREAM_STATS,
            StreamStatsResponse { .. } => r | key::STREAM_STATS,
            CreateSuperStream { .. } => key::CREATE_SUPER_STREAM,
            DeleteSuperStream { .. } => key::DELETE_SUPER_STREAM,
            ResolveOffsetSpec { .. } => key::RESOLVE_OFFSET_SPEC,
            ResolveOffsetSpecResponse { .. } => r | key::RESOLVE_OFFSET_SPEC,
            Response { key: k, .. } => r | k,
        }
    }

    fn version(&self) -> u16 {
        match self {
            Frame::Publish { v2: true, .. } => 2,
            Frame::Deliver {
                committed_chunk_id: Some(_),
                ..
            } => 2,
            _ => 1,
        }
    }
}

/// Appends `frame` to `out`: size, key, version, body.
pub fn encode(frame: &Frame, out: &mut BytesMut) {
    let start = out.len();
    out.put_u32(0);
    out.put_u16(frame.key());
    out.put_u16(frame.version());
    encode_body(frame, out);
    let size = (out.len() - start - 4) as u32;
    out[start..start + 4].copy_from_slice(&size.to_be_bytes());
}

/// Appends a Deliver frame for `chunk` (v2 when `committed_chunk_id` is given), writing the
/// chunk header and data straight into `out` (the same bytes as [`Frame::Deliver`] with
/// `chunk.to_bytes()`).
/// A Deliver frame for `chunk`; when its data is a file range, the frame's bytes up to the
/// data, and the range that completes the frame (see [`crate::chunk::Chunk::put`]).
pub fn encode_deliver<'c>(
    subscription_id: u8,
    committed_chunk_id: Option<u64>,
    chunk: &'c crate::chunk::Chunk,
    out: &mut BytesMut,
) -> Option<&'c crate::chunk::FileRange> {
    let size = 4 + 1 + committed_chunk_id.map_or(0, |_| 8) + chunk.wire_len();
    out.reserve(4 + size);
    out.put_u32(size as u32);
    out.put_u16(key::DELIVER);
    out.put_u16(if committed_chunk_id.is_some() { 2 } else { 1 });
    out.put_u8(subscription_id);
    if let Some(c) = committed_chunk_id {
        out.put_u64(c);
    }
    chunk.put(out)
}

/// The encoding of one frame, as a buffer of its own.
pub fn to_bytes(frame: &Frame) -> Bytes {
    let mut out = BytesMut::new();
    encode(frame, &mut out);
    out.freeze()
}

fn encode_body(frame: &Frame, out: &mut BytesMut) {
    use Frame::*;
    match frame {
        DeclarePublisher {
            corr,
            publisher_id,
            reference,
            stream,
        } => {
            out.put_u32(*corr);
            out.put_u8(*publisher_id);
            put_string(out, reference);
            put_string(out, stream);
        }
        Publish {
            v2,
            publisher_id,
            messages,
        } => {
            out.put_u8(*publisher_id);
            out.put_i32(messages.len() as i32);
            for m in messages {
                out.put_u64(m.publishing_id);
                if *v2 {
                    match &m.filter_value {
                        Some(f) => put_string(out, f),
                        None => out.put_i16(-1),
                    }
                }
                m.entry.put(out);
            }
        }
        PublishConfirm {
            publisher_id,
            publishing_ids,
        } => {
            out.put_u8(*publisher_id);
            out.put_i32(publishing_ids.len() as i32);
            for id in publishing_ids {
                out.put_u64(*id);
            }
        }
        PublishError {
            publisher_id,
            errors,
        } => {
            out.put_u8(*publisher_id);
            out.put_i32(errors.len() as i32);
            for (id, c) in errors {
                out.put_u64(*id);
                out.put_u16(*c);
            }
        }
        QueryPublisherSequence {
            corr,
            reference,
            stream,
        }
        | QueryOffset {
            corr,
            reference,
            stream,
        } => {
            out.put_u32(*corr);
            put_string(out, reference);
            put_string(out, stream);
        }
        QueryPublisherSequenceResponse {
            corr,
            code,
            sequence: value,
        }
        | QueryOffsetResponse {
            corr,
            code,
            offset: value,
        } => {
            out.put_u32(*corr);
            out.put_u16(*code);
            out.put_u64(*value);
        }
        DeletePublisher {
            corr,
            publisher_id: id,
        }
        | Unsubscribe {
            corr,
            subscription_id: id,
        } => {
            out.put_u32(*corr);
            out.put_u8(*id);
        }
        Subscribe {
            corr,
            subscription_id,
            stream,
            offset,
            credit,
            properties,
        } => {
            out.put_u32(*corr);
            out.put_u8(*subscription_id);
            put_string(out, stream);
            offset.put(out);
            out.put_u16(*credit);
            // RabbitMQ leaves out an empty property map; the Rust client writes a count of
            // 0. Both decode; we write the shorter form.
            if !properties.is_empty() {
                put_map(out, properties);
            }
        }
        Deliver {
            subscription_id,
            committed_chunk_id,
            chunk,
        } => {
            out.put_u8(*subscription_id);
            if let Some(c) = committed_chunk_id {
                out.put_u64(*c);
            }
            out.put_slice(chunk);
        }
        Credit {
            subscription_id,
            credit,
        } => {
            out.put_u8(*subscription_id);
            out.put_u16(*credit);
        }
        CreditResponse {
            code,
            subscription_id,
        } => {
            out.put_u16(*code);
            out.put_u8(*subscription_id);
        }
        StoreOffset {
            reference,
            stream,
            offset,
        } => {
            put_string(out, reference);
            put_string(out, stream);
            out.put_u64(*offset);
        }
        Create {
            corr,
            stream,
            arguments,
        } => {
            out.put_u32(*corr);
            put_string(out, stream);
            put_map(out, arguments);
        }
        Delete { corr, stream }
        | StreamStats { corr, stream }
        | Partitions {
            corr,
            super_stream: stream,
        }
        | DeleteSuperStream { corr, name: stream }
        | Open {
            corr,
            vhost: stream,
        } => {
            out.put_u32(*corr);
            put_string(out, stream);
        }
        Metadata { corr, streams } => {
            out.put_u32(*corr);
            put_strings(out, streams);
        }
        MetadataResponse {
            corr,
            brokers,
            streams,
        } => {
            out.put_u32(*corr);
            out.put_i32(brokers.len() as i32);
            for b in brokers {
                out.put_u16(b.reference);
                put_string(out, &b.host);
                out.put_u32(b.port);
            }
            out.put_i32(streams.len() as i32);
            for s in streams {
                put_string(out, &s.stream);
                out.put_u16(s.code);
                out.put_u16(s.leader);
                out.put_i32(s.replicas.len() as i32);
                for r in &s.replicas {
                    out.put_u16(*r);
                }
            }
        }
        MetadataUpdate { code, stream } => {
            out.put_u16(*code);
            put_string(out, stream);
        }
        PeerProperties { corr, properties } => {
            out.put_u32(*corr);
            put_map(out, properties);
        }
        PeerPropertiesResponse {
            corr,
            code,
            properties,
        } => {
            out.put_u32(*corr);
            out.put_u16(*code);
            put_map(out, properties);
        }
        SaslHandshake { corr } => out.put_u32(*corr),
        SaslHandshakeResponse {
            corr,
            code,
            mechanisms,
        } => {
            out.put_u32(*corr);
            out.put_u16(*code);
            put_strings(out, mechanisms);
        }
        SaslAuthenticate {
            corr,
            mechanism,
            data,
        } => {
            out.put_u32(*corr);
            put_string(out, mechanism);
            put_bytes(out, data);
        }
        SaslAuthenticateResponse {
            corr,
            code,
            challenge,
        } => {
            out.put_u32(*corr);
            out.put_u16(*code);
            if !challenge.is_empty() {
                let n = challenge.len().min(i16::MAX as usize);
                out.put_i16(n as i16);
                out.put_slice(&challenge[..n]);
            }
        }
        Tune {
            frame_max,
            heartbeat,
        }
        | TuneResponse {
            frame_max,
            heartbeat,
        } => {
            out.put_u32(*frame_max);
            out.put_u32(*heartbeat);
        }
        OpenResponse {
            corr,
            code: c,
            properties,
        } => {
            out.put_u32(*corr);
            out.put_u16(*c);
            // Clients read the map after an OK (the Rust client unconditionally).
            if *c == code::OK || !properties.is_empty() {
                put_map(out, properties);
            }
        }
        Close { corr, code, reason } => {
            out.put_u32(*corr);
            out.put_u16(*code);
            put_string(out, reason);
        }
        Heartbeat => {}
        Route {
            corr,
            routing_key,
            super_stream,
        } => {
            out.put_u32(*corr);
            put_string(out, routing_key);
            put_string(out, super_stream);
        }
        RouteResponse {
            corr,
            code,
            streams,
        }
        | PartitionsResponse {
            corr,
            code,
            streams,
        } => {
            out.put_u32(*corr);
            out.put_u16(*code);
            put_strings(out, streams);
        }
        ConsumerUpdate {
            corr,
            subscription_id,
            active,
        } => {
            out.put_u32(*corr);
            out.put_u8(*subscription_id);
            out.put_u8(u8::from(*active));
        }
        ConsumerUpdateResponse { corr, code, offset } => {
            out.put_u32(*corr);
            out.put_u16(*code);
            match offset {
                None => out.put_u16(0),
                Some(o) => o.put(out),
            }
        }
        ExchangeCommandVersions { corr, versions } => {
            out.put_u32(*corr);
            put_versions(out, versions);
        }
        ExchangeCommandVersionsResponse {
            corr,
            code,
            versions,
        } => {
            out.put_u32(*corr);
            out.put_u16(*code);
            put_versions(out, versions);
        }
        StreamStatsResponse { corr, code, stats } => {
            out.put_u32(*corr);
            out.put_u16(*code);
            out.put_i32(stats.len() as i32);
            for (k, v) in stats {
                put_string(out, k);
                out.put_i64(*v);
            }
        }
        CreateSuperStream {
            corr,
            name,
            partitions,
            binding_keys,
            arguments,
        } => {
            out.put_u32(*corr);
            put_string(out, name);
            put_strings(out, partitions);
            put_strings(out, binding_keys);
            put_map(out, arguments);
        }
        ResolveOffsetSpec {
            corr,
            stream,
            offset,
            properties,
        } => {
            out.put_u32(*corr);
            put_string(out, stream);
            offset.put(out);
            if !properties.is_empty() {
                put_map(out, properties);
            }
        }
        ResolveOffsetSpecResponse {
            corr,
            code,
            offset_type,
            offset,
        } => {
            out.put_u32(*corr);
            out.put_u16(*code);
            out.put_u16(*offset_type);
            out.put_u64(*offset);
        }
        Response { corr, code, .. } => {
            out.put_u32(*corr);
            out.put_u16(*code);
        }
    }
}

fn put_strings(out: &mut BytesMut, list: &[String]) {
    out.put_i32(list.len() as i32);
    for s in list {
        put_string(out, s);
    }
}

fn put_versions(out: &mut BytesMut, versions: &[CommandVersion]) {
    out.put_i32(versions.len() as i32);
    for (k, min, max) in versions {
        out.put_u16(*k);
        out.put_u16(*min);
        out.put_u16(*max);
    }
}

fn read_versions(r: &mut Reader) -> Result<Vec<CommandVersion>, DecodeError> {
    let n = r.count(6, "command versions")?;
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        v.push((r.u16("key")?, r.u16("min")?, r.u16("max")?));
    }
    Ok(v)
}

/// Optional trailing property map (Subscribe, ResolveOffsetSpec): absent means empty.
fn read_opt_map(r: &mut Reader) -> Result<Vec<(String, String)>, DecodeError> {
    if r.is_empty() {
        Ok(Vec::new())
    } else {
        read_map(r, "properties")
    }
}

/// Decodes one frame body (what follows the 4-byte size). Any mismatch, including bytes left
/// over, is an error: the frame is malformed.
pub fn decode(body: Bytes) -> Result<Frame, DecodeError> {
    let mut r = Reader::new(body);
    let k = r.u16("key")?;
    let version = r.u16("version")?;
    let frame = decode_command(&mut r, k, version)?;
    r.end()?;
    Ok(frame)
}

fn decode_command(r: &mut Reader, k: u16, version: u16) -> Result<Frame, DecodeError> {
    use Frame::*;
    let unknown = DecodeError::UnknownCommand { key: k, version };
    let versioned = matches!(k, key::PUBLISH | key::DELIVER);
    if version != 1 && !(versioned && version == 2) {
        return Err(unknown);
    }
    let response = k & key::RESPONSE != 0;
    let base = k & !key::RESPONSE;
    if response {
        if is_plain_response(base) {
            return Ok(Response {
                key: base,
                corr: r.u32("correlation id")?,
                code: r.u16("code")?,
            });
        }
        return Ok(match base {
            key::QUERY_PUBLISHER_SEQUENCE => QueryPublisherSequenceResponse {
                corr: r.u32("correlation id")?,
                code: r.u16("code")?,
                sequence: r.u64("sequence")?,
            },
            key::CREDIT => CreditResponse {
                code: r.u16("code")?,
                subscription_id: r.u8("subscription id")?,
            },
            key::QUERY_OFFSET => QueryOffsetResponse {
                corr: r.u32("correlation id")?,
                code: r.u16("code")?,
                offset: r.u64("offset")?,
            },
            key::METADATA => {
                let corr = r.u32("correlation id")?;
                let n = r.count(8, "brokers")?;
                let mut brokers = Vec::with_capacity(n);
                for _ in 0..n {
                    brokers.push(Broker {
                        reference: r.u16("broker reference")?,
                        host: r.string("host")?,
                        port: r.u32("port")?,
                    });
                }
                let n = r.count(10, "stream metadata")?;
                let mut streams = Vec::with_capacity(n);
                for _ in 0..n {
                    let stream = r.string("stream")?;
                    let code = r.u16("code")?;
                    let leader = r.u16("leader")?;
                    let m = r.count(2, "replicas")?;
                    let mut replicas = Vec::with_capacity(m);
                    for _ in 0..m {
                        replicas.push(r.u16("replica")?);
                    }
                    streams.push(StreamMetadata {
                        stream,
                        code,
                        leader,
                        replicas,
                    });
                }
                MetadataResponse {
                    corr,
                    brokers,
                    streams,
                }
            }
            key::PEER_PROPERTIES => PeerPropertiesResponse {
                corr: r.u32("correlation id")?,
                code: r.u16("code")?,
                properties: read_map(r, "peer properties")?,
            },
            key::SASL_HANDSHAKE => SaslHandshakeResponse {
                corr: r.u32("correlation id")?,
                code: r.u16("code")?,
                mechanisms: read_strings(r, "mechanisms")?,
            },
            key::SASL_AUTHENTICATE => {
                let corr = r.u32("correlation id")?;
                let code = r.u16("code")?;
                let challenge = if r.is_empty() {
                    Bytes::new()
                } else {
                    let n = r.i16("challenge")?;
                    if n <= 0 {
                        return Err(DecodeError::BadValue("challenge"));
                    }
                    r.take(n as usize, "challenge")?
                };
                SaslAuthenticateResponse {
                    corr,
                    code,
                    challenge,
                }
            }
            key::TUNE => TuneResponse {
                frame_max: r.u32("frame max")?,
                heartbeat: r.u32("heartbeat")?,
            },
            key::OPEN => {
                let corr = r.u32("correlation id")?;
                let code = r.u16("code")?;
                let properties = read_opt_map(r)?;
                OpenResponse {
                    corr,
                    code,
                    properties,
                }
            }
            key::ROUTE => RouteResponse {
                corr: r.u32("correlation id")?,
                code: r.u16("code")?,
                streams: read_strings(r, "streams")?,
            },
            key::PARTITIONS => PartitionsResponse {
                corr: r.u32("correlation id")?,
                code: r.u16("code")?,
                streams: read_strings(r, "streams")?,
            },
            key::CONSUMER_UPDATE => {
                let corr = r.u32("correlation id")?;
                let code = r.u16("code")?;
                let t = r.u16("offset type")?;
                let offset = if t == 0 {
                    None
                } else {
                    Some(OffsetSpec::read_type(r, t)?)
                };
                ConsumerUpdateResponse { corr, code, offset }
            }
            key::EXCHANGE_COMMAND_VERSIONS => ExchangeCommandVersionsResponse {
                corr: r.u32("correlation id")?,
                code: r.u16("code")?,
                versions: read_versions(r)?,
            },
            key::STREAM_STATS => {
                let corr = r.u32("correlation id")?;
                let code = r.u16("code")?;
                let n = r.count(10, "stats")?;
                let mut stats = Vec::with_capacity(n);
                for _ in 0..n {
                    stats.push((r.string("stat")?, r.i64("stat value")?));
                }
                StreamStatsResponse { corr, code, stats }
            }
            key::RESOLVE_OFFSET_SPEC => ResolveOffsetSpecResponse {
                corr: r.u32("correlation id")?,
                code: r.u16("code")?,
                offset_type: r.u16("offset type")?,
                offset: r.u64("offset")?,
            },
            _ => return Err(unknown),
        });
    }
    Ok(match base {
        key::DECLARE_PUBLISHER => DeclarePublisher {
            corr: r.u32("correlation id")?,
            publisher_id: r.u8("publisher id")?,
            reference: r.string("publisher reference")?,
            stream: r.string("stream")?,
        },
        key::PUBLISH => {
            let v2 = version == 2;
            let publisher_id = r.u8("publisher id")?;
            // id + smallest entry (4-byte size) [+ null filter string]
            let n = r.count(if v2 { 14 } else { 12 }, "published messages")?;
            let mut messages = Vec::with_capacity(n);
            for _ in 0..n {
                let publishing_id = r.u64("publishing id")?;
                let filter_value = if v2 {
                    r.opt_string("filter value")?
                } else {
                    None
                };
                let entry = Entry::read(r)?;
                messages.push(PublishedMessage {
                    publishing_id,
                    filter_value,
                    entry,
                });
            }
            Publish {
                v2,
                publisher_id,
                messages,
            }
        }
        key::PUBLISH_CONFIRM => {
            let publisher_id = r.u8("publisher id")?;
            let n = r.count(8, "publishing ids")?;
            let mut publishing_ids = Vec::with_capacity(n);
            for _ in 0..n {
                publishing_ids.push(r.u64("publishing id")?);
            }
            PublishConfirm {
                publisher_id,
                publishing_ids,
            }
        }
        key::PUBLISH_ERROR => {
            let publisher_id = r.u8("publisher id")?;
            let n = r.count(10, "publishing errors")?;
            let mut errors = Vec::with_capacity(n);
            for _ in 0..n {
                errors.push((r.u64("publishing id")?, r.u16("code")?));
            }
            PublishError {
                publisher_id,
                errors,
            }
        }
        key::QUERY_PUBLISHER_SEQUENCE => QueryPublisherSequence {
            corr: r.u32("correlation id")?,
            reference: r.string("publisher reference")?,
            stream: r.string("stream")?,
        },
        key::DELETE_PUBLISHER => DeletePublisher {
            corr: r.u32("correlation id")?,
            publisher_id: r.u8("publisher id")?,
        },
        key::SUBSCRIBE => Subscribe {
            corr: r.u32("correlation id")?,
            subscription_id: r.u8("subscription id")?,
            stream: r.string("stream")?,
            offset: OffsetSpec::read(r)?,
            credit: r.u16("credit")?,
            properties: read_opt_map(r)?,
        },
        key::DELIVER => {
            let subscription_id = r.u8("subscription id")?;
            let committed_chunk_id = if version == 2 {
                Some(r.u64("committed chunk id")?)
            } else {
                None
            };
            let chunk = r.take(r.remaining(), "chunk")?;
            Deliver {
                subscription_id,
                committed_chunk_id,
                chunk,
            }
        }
        key::CREDIT => Credit {
            subscription_id: r.u8("subscription id")?,
            credit: r.u16("credit")?,
        },
        key::STORE_OFFSET => StoreOffset {
            reference: r.string("reference")?,
            stream: r.string("stream")?,
            offset: r.u64("offset")?,
        },
        key::QUERY_OFFSET => QueryOffset {
            corr: r.u32("correlation id")?,
            reference: r.string("reference")?,
            stream: r.string("stream")?,
        },
        key::UNSUBSCRIBE => Unsubscribe {
            corr: r.u32("correlation id")?,
            subscription_id: r.u8("subscription id")?,
        },
        key::CREATE => Create {
            corr: r.u32("correlation id")?,
            stream: r.string("stream")?,
            arguments: read_map(r, "arguments")?,
        },
        key::DELETE => Delete {
            corr: r.u32("correlation id")?,
            stream: r.string("stream")?,
        },
        key::METADATA => Metadata {
            corr: r.u32("correlation id")?,
            streams: read_strings(r, "streams")?,
        },
        key::METADATA_UPDATE => MetadataUpdate {
            code: r.u16("code")?,
            stream: r.string("stream")?,
        },
        key::PEER_PROPERTIES => PeerProperties {
            corr: r.u32("correlation id")?,
            properties: read_map(r, "peer properties")?,
        },
        key::SASL_HANDSHAKE => SaslHandshake {
            corr: r.u32("correlation id")?,
        },
        key::SASL_AUTHENTICATE => SaslAuthenticate {
            corr: r.u32("correlation id")?,
            mechanism: r.string("mechanism")?,
            data: r.bytes("sasl data")?,
        },
        key::TUNE => Tune {
            frame_max: r.u32("frame max")?,
            heartbeat: r.u32("heartbeat")?,
        },
        key::OPEN => Open {
            corr: r.u32("correlation id")?,
            vhost: r.string("virtual host")?,
        },
        key::CLOSE => Close {
            corr: r.u32("correlation id")?,
            code: r.u16("code")?,
            reason: r.string("reason")?,
        },
        key::HEARTBEAT => Heartbeat,
        key::ROUTE => Route {
            corr: r.u32("correlation id")?,
            routing_key: r.string("routing key")?,
            super_stream: r.string("super stream")?,
        },
        key::PARTITIONS => Partitions {
            corr: r.u32("correlation id")?,
            super_stream: r.string("super stream")?,
        },
        key::CONSUMER_UPDATE => ConsumerUpdate {
            corr: r.u32("correlation id")?,
            subscription_id: r.u8("subscription id")?,
            active: match r.u8("active")? {
                0 => false,
                1 => true,
                _ => return Err(DecodeError::BadValue("active")),
            },
        },
        key::EXCHANGE_COMMAND_VERSIONS => ExchangeCommandVersions {
            corr: r.u32("correlation id")?,
            versions: read_versions(r)?,
        },
        key::STREAM_STATS => StreamStats {
            corr: r.u32("correlation id")?,
            stream: r.string("stream")?,
        },
        key::CREATE_SUPER_STREAM => CreateSuperStream {
            corr: r.u32("correlation id")?,
            name: r.string("super stream")?,
            partitions: read_strings(r, "partitions")?,
            binding_keys: read_strings(r, "binding keys")?,
            arguments: read_map(r, "arguments")?,
        },
        key::DELETE_SUPER_STREAM => DeleteSuperStream {
            corr: r.u32("correlation id")?,
            name: r.string("super stream")?,
        },
        key::RESOLVE_OFFSET_SPEC => ResolveOffsetSpec {
            corr: r.u32("correlation id")?,
            stream: r.string("stream")?,
            offset: OffsetSpec::read(r)?,
            properties: read_opt_map(r)?,
        },
        _ => return Err(unknown),
    })
}
