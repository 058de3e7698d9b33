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
    Bool(bool),
    I8(i8),
    U8(u8),
    I16(i16),
    U16(u16),
    I32(i32),
    U32(u32),
    I64(i64),
    F32(f32),
    F64(f64),
    Decimal {
        scale: u8,
        value: u32,
    },
    /// A short string (deprecated on the wire, kept for fidelity).
    ShortString(String),
    /// A long string: arbitrary bytes, usually UTF-8.
    LongString(Bytes),
    Array(Vec<FieldValue>),
    Timestamp(u64),
    Table(FieldTable),
    ByteArray(Bytes),
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
    pub content_type: Option<String>,
    pub content_encoding: Option<String>,
    pub headers: Option<FieldTable>,
    /// 1 = transient, 2 = persistent.
    pub delivery_mode: Option<u8>,
    pub priority: Option<u8>,
    pub correlation_id: Option<String>,
    pub reply_to: Option<String>,
    /// Per-message TTL in milliseconds, as a decimal string (AMQP's odd choice).
    pub expiration: Option<String>,
    pub message_id: Option<String>,
    pub timestamp: Option<u64>,
    /// AMQP's `type` property.
    pub kind: Option<String>,
    pub user_id: Option<String>,
    pub app_id: Option<String>,
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
    pub exchange: Arc<str>,
    pub routing_key: Arc<str>,
    pub properties: Properties,
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
    pub message: Arc<Message>,
    /// It was delivered before and came back (requeue, channel close, restart).
    pub redelivered: bool,
    /// The store holds it: it must be removed from the store when it leaves the queue.
    pub stored: bool,
    /// When it expires (queue or message TTL), in the host's clock.
    pub expires_at: Option<u64>,
}
