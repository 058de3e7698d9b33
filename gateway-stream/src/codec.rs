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

pub use crate::chunk::Entry;

mod decode;
mod encode;
mod publish;
pub use decode::*;
pub use encode::*;
pub use publish::*;

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
