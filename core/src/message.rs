//! The protocol-agnostic message model.
//!
//! Properties mirror AMQP 0.9.1's basic properties because they are the richest of the protocols
//! Warren speaks; MQTT 5 properties map onto them (see ARCHITECTURE.md, "MQTT <-> AMQP mapping").

use bytes::Bytes;
use std::collections::BTreeMap;
use std::sync::Arc;

/// A field table: AMQP's typed map. `BTreeMap` keeps iteration deterministic, which the core's
/// effect stream (and the native-vs-wasm differential test) depends on.
pub type FieldTable = BTreeMap<String, FieldValue>;

/// One value of a field table, covering every AMQP 0.9.1 / RabbitMQ field type.
#[derive(Clone, Debug, PartialEq)]
pub enum FieldValue {
    /// Boolean (`t`).
    Bool(bool),
    /// Signed 8-bit (`b`).
    I8(i8),
    /// Unsigned 8-bit (`B`).
    U8(u8),
    /// Signed 16-bit (`s`).
    I16(i16),
    /// Unsigned 16-bit (`u`).
    U16(u16),
    /// Signed 32-bit (`I`).
    I32(i32),
    /// Unsigned 32-bit (`i`).
    U32(u32),
    /// Signed 64-bit (`l`).
    I64(i64),
    /// 32-bit float (`f`).
    F32(f32),
    /// 64-bit float (`d`).
    F64(f64),
    /// Decimal (`D`): `value` / 10^`scale`.
    Decimal {
        /// Decimal places.
        scale: u8,
        /// The unscaled value.
        value: u32,
    },
    /// A short string (deprecated on the wire, kept for fidelity).
    ShortString(String),
    /// A long string: arbitrary bytes, usually UTF-8.
    LongString(Bytes),
    /// Array (`A`).
    Array(Vec<FieldValue>),
    /// Timestamp, seconds (`T`).
    Timestamp(u64),
    /// Nested table (`F`).
    Table(FieldTable),
    /// Byte array (`x`).
    ByteArray(Bytes),
    /// No value (`V`).
    Void,
}

impl FieldValue {
    /// The value as text when it is a (short or long) string of valid UTF-8.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            FieldValue::ShortString(s) => Some(s),
            FieldValue::LongString(b) => std::str::from_utf8(b).ok(),
            _ => None,
        }
    }

    /// The value as an integer when it is one of the integer types.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            FieldValue::I8(v) => Some(v.into()),
            FieldValue::U8(v) => Some(v.into()),
            FieldValue::I16(v) => Some(v.into()),
            FieldValue::U16(v) => Some(v.into()),
            FieldValue::I32(v) => Some(v.into()),
            FieldValue::U32(v) => Some(v.into()),
            FieldValue::I64(v) => Some(v),
            FieldValue::Timestamp(v) => i64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a boolean when it is one.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            FieldValue::Bool(b) => Some(b),
            _ => None,
        }
    }

    /// A long string from text.
    pub fn string(s: &str) -> FieldValue {
        FieldValue::LongString(Bytes::copy_from_slice(s.as_bytes()))
    }
}

/// Message properties (AMQP 0.9.1 basic properties, all optional).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Properties {
    /// MIME content type.
    pub content_type: Option<String>,
    /// MIME content encoding.
    pub content_encoding: Option<String>,
    /// Application headers.
    pub headers: Option<FieldTable>,
    /// 1 = transient, 2 = persistent.
    pub delivery_mode: Option<u8>,
    /// Message priority (0-9 as RabbitMQ).
    pub priority: Option<u8>,
    /// Correlates a reply with its request.
    pub correlation_id: Option<String>,
    /// Where replies go.
    pub reply_to: Option<String>,
    /// Per-message TTL in milliseconds, as a decimal string (AMQP's odd choice).
    pub expiration: Option<String>,
    /// Application message id.
    pub message_id: Option<String>,
    /// Application timestamp.
    pub timestamp: Option<u64>,
    /// AMQP's `type` property.
    pub kind: Option<String>,
    /// The publishing user, as the client set it.
    pub user_id: Option<String>,
    /// Publishing application.
    pub app_id: Option<String>,
    /// Deprecated by AMQP 0-9-1.
    pub cluster_id: Option<String>,
}

impl Properties {
    /// True when `delivery_mode` asks for persistence.
    pub fn is_persistent(&self) -> bool {
        self.delivery_mode == Some(2)
    }
}

/// A published message as routed: where it was published, its properties and body.
///
/// Shared between queues by `Arc` (a fanout to N queues holds one copy); `Bytes` bodies are
/// reference-counted, never copied on the way through the core.
#[derive(Clone, Debug, PartialEq)]
pub struct Message {
    /// The exchange it was published to.
    pub exchange: Arc<str>,
    /// The routing key it was published with.
    pub routing_key: Arc<str>,
    /// Its basic properties.
    pub properties: Properties,
    /// Its body.
    pub body: Bytes,
}

impl Message {
    /// Bytes this message accounts for in queue-length-in-bytes limits (body only, as RabbitMQ).
    pub fn body_len(&self) -> usize {
        self.body.len()
    }
}

/// One ready message in memory.
#[derive(Clone, Debug)]
pub struct QueuedMessage {
    /// Its position in its queue, given on enqueue.
    pub seq: u64,
    /// The message.
    pub message: Arc<Message>,
    /// It was delivered before and came back (requeue, channel close, restart).
    pub redelivered: bool,
    /// The store holds it: it must be removed from the store when it leaves the queue.
    pub stored: bool,
    /// When it expires (queue or message TTL), in the host's clock.
    pub expires_at: Option<u64>,
    /// Which serving of its queue handed it out (`QueueState::epoch` when it was delivered,
    /// 0 while it waits; for a delivery from another node's queue, `FROM_NODE` with that
    /// node's id): a settle of a delivery made before its queue was reloaded (a quorum
    /// queue's leader moved) or before the queue moved to another node is stale.
    pub epoch: u32,
}
