//! Messages in AMQP 1.0's format, as streams store them: the stream protocol carries AMQP 1.0
//! messages, and a stream is one log whichever protocol writes or reads it (RabbitMQ's
//! `rabbit_msg_record`). An AMQP 0.9.1 publish is encoded here on its way into a stream, and
//! whatever a stream holds is decoded back for an AMQP 0.9.1 consumer.
//!
//! The mapping, both ways:
//! - `header`: `durable` (delivery mode 2 / 1), `priority`;
//! - `message-annotations`: `x-exchange`, `x-routing-key`, and the 0.9.1 properties AMQP 1.0
//!   has no field for (`x-basic-type`, `x-basic-app-id`, `x-basic-expiration`,
//!   `x-basic-cluster-id`); other `x-` annotations a stream client set become headers;
//! - `properties`: `message-id`, `user-id`, `reply-to`, `correlation-id`, `content-type`,
//!   `content-encoding`, `creation-time` (the 0.9.1 timestamp, seconds, as milliseconds);
//! - `application-properties`: the headers;
//! - the body: one `data` section (decoding also takes several, `amqp-value` and
//!   `amqp-sequence`: a string or binary value is the body, another value its encoding).
//!
//! Pure functions: the core's stream queues call them, the stores only see bytes.
//!
//! `types` is AMQP 1.0's whole type system and `descriptor` the spec's descriptor codes:
//! the AMQP 1.0 gateway (`warren-amqp10`) builds its frames on them, so the broker has one
//! AMQP 1.0 decoder, here where the stream code needs it too.

pub mod descriptor;
pub mod types;

pub use types::DecodeError;
use types::{Descriptor, Reader, Value};

use crate::message::{FieldTable, FieldValue, Message, Properties};
use bytes::{BufMut, Bytes, BytesMut};
use std::sync::Arc;

use descriptor::{
    AMQP_SEQUENCE, AMQP_VALUE, APPLICATION_PROPERTIES, DATA, DELIVERY_ANNOTATIONS, FOOTER, HEADER,
    MESSAGE_ANNOTATIONS, PROPERTIES,
};

/// What the 0.9.1 mapping makes of AMQP 1.0 values.
trait ToField {
    fn field(self) -> FieldValue;
}

impl ToField for Value {
    fn field(self) -> FieldValue {
        match self {
            Value::Null | Value::Decimal32(_) | Value::Decimal64(_) | Value::Decimal128(_) => {
                FieldValue::Void
            }
            Value::Char(c) => FieldValue::LongString(Bytes::from(c.to_string())),
            Value::Bool(b) => FieldValue::Bool(b),
            Value::UByte(v) => FieldValue::U8(v),
            Value::UShort(v) => FieldValue::U16(v),
            Value::UInt(v) => FieldValue::U32(v),
            Value::ULong(v) => i64::try_from(v).map_or(FieldValue::Void, FieldValue::I64),
            Value::Byte(v) => FieldValue::I8(v),
            Value::Short(v) => FieldValue::I16(v),
            Value::Int(v) => FieldValue::I32(v),
            Value::Long(v) => FieldValue::I64(v),
            Value::Float(v) => FieldValue::F32(v),
            Value::Double(v) => FieldValue::F64(v),
            Value::Timestamp(ms) => FieldValue::Timestamp(u64::try_from(ms / 1000).unwrap_or(0)),
            Value::Uuid(u) => FieldValue::ByteArray(Bytes::copy_from_slice(&u)),
            Value::Binary(b) => FieldValue::LongString(b),
            Value::String(s) | Value::Symbol(s) => FieldValue::LongString(Bytes::from(s)),
            Value::List(items) | Value::Array(items) => {
                FieldValue::Array(items.into_iter().map(ToField::field).collect())
            }
            Value::Map(entries) => FieldValue::Table(table(entries)),
            Value::Described(_, v) => v.field(),
        }
    }
}

fn table(entries: Vec<(Value, Value)>) -> FieldTable {
    entries
        .into_iter()
        .filter_map(|(k, v)| Some((k.text()?.to_string(), v.field())))
        .collect()
}

// ---- encoding ----

fn descriptor(out: &mut BytesMut, code: u64) {
    out.put_u8(0x00);
    out.put_u8(0x53);
    out.put_u8(code as u8);
}

fn variable(out: &mut BytesMut, short: u8, long: u8, b: &[u8]) {
    match u8::try_from(b.len()) {
        Ok(n) => {
            out.put_u8(short);
            out.put_u8(n);
        }
        Err(_) => {
            out.put_u8(long);
            out.put_u32(b.len() as u32);
        }
    }
    out.put_slice(b);
}

fn string(out: &mut BytesMut, s: &str) {
    variable(out, 0xa1, 0xb1, s.as_bytes());
}

fn symbol(out: &mut BytesMut, s: &str) {
    variable(out, 0xa3, 0xb3, s.as_bytes());
}

fn binary(out: &mut BytesMut, b: &[u8]) {
    variable(out, 0xa0, 0xb0, b);
}

/// A compound (list 0xd0, map 0xd1) of `count` items already encoded in `items`.
fn compound(out: &mut BytesMut, code: u8, count: usize, items: &[u8]) {
    out.put_u8(code);
    out.put_u32(items.len() as u32 + 4);
    out.put_u32(count as u32);
    out.put_slice(items);
}

fn field(out: &mut BytesMut, v: &FieldValue) {
    match v {
        FieldValue::Bool(true) => out.put_u8(0x41),
        FieldValue::Bool(false) => out.put_u8(0x42),
        FieldValue::I8(v) => {
            out.put_u8(0x51);
            out.put_i8(*v);
        }
        FieldValue::U8(v) => {
            out.put_u8(0x50);
            out.put_u8(*v);
        }
        FieldValue::I16(v) => {
            out.put_u8(0x61);
            out.put_i16(*v);
        }
        FieldValue::U16(v) => {
            out.put_u8(0x60);
            out.put_u16(*v);
        }
        FieldValue::I32(v) => {
            out.put_u8(0x71);
            out.put_i32(*v);
        }
        FieldValue::U32(v) => {
            out.put_u8(0x70);
            out.put_u32(*v);
        }
        FieldValue::I64(v) => {
            out.put_u8(0x81);
            out.put_i64(*v);
        }
        FieldValue::F32(v) => {
            out.put_u8(0x72);
            out.put_f32(*v);
        }
        FieldValue::F64(v) => {
            out.put_u8(0x82);
            out.put_f64(*v);
        }
        // AMQP 1.0's decimals are IEEE 754 decimals, not scaled integers: the text keeps
        // the value.
        FieldValue::Decimal { scale, value } => {
            let text = if *scale == 0 {
                value.to_string()
            } else {
                let digits = format!("{value:0>width$}", width = usize::from(*scale) + 1);
                let (int, frac) = digits.split_at(digits.len() - usize::from(*scale));
                format!("{int}.{frac}")
            };
            string(out, &text);
        }
        FieldValue::ShortString(s) => string(out, s),
        FieldValue::LongString(b) => match std::str::from_utf8(b) {
            Ok(s) => string(out, s),
            Err(_) => binary(out, b),
        },
        FieldValue::Array(items) => {
            let mut inner = BytesMut::new();
            for item in items {
                field(&mut inner, item);
            }
            compound(out, 0xd0, items.len(), &inner);
        }
        FieldValue::Timestamp(secs) => {
            out.put_u8(0x83);
            out.put_i64(i64::try_from(secs.saturating_mul(1000)).unwrap_or(i64::MAX));
        }
        FieldValue::Table(t) => map(out, t, string),
        FieldValue::ByteArray(b) => binary(out, b),
        FieldValue::Void => out.put_u8(0x40),
    }
}

fn map(out: &mut BytesMut, t: &FieldTable, key: fn(&mut BytesMut, &str)) {
    let mut inner = BytesMut::new();
    for (k, v) in t {
        key(&mut inner, k);
        field(&mut inner, v);
    }
    compound(out, 0xd1, t.len() * 2, &inner);
}

/// A `properties` field to encode.
enum Prop<'a> {
    Str(&'a str),
    Bin(&'a str),
    Sym(&'a str),
    /// Seconds (0.9.1), written as milliseconds.
    Ts(u64),
}

/// `m` as an AMQP 1.0 message (see the module docs for the mapping).
pub fn encode(m: &Message) -> Bytes {
    let p = &m.properties;
    let mut out = BytesMut::with_capacity(m.body.len() + 96);
    if p.delivery_mode.is_some() || p.priority.is_some() {
        descriptor(&mut out, HEADER);
        let mut items = BytesMut::new();
        match p.delivery_mode {
            Some(2) => items.put_u8(0x41),
            Some(_) => items.put_u8(0x42),
            None => items.put_u8(0x40),
        }
        let mut count = 1;
        if let Some(prio) = p.priority {
            items.put_u8(0x50);
            items.put_u8(prio);
            count = 2;
        }
        compound(&mut out, 0xd0, count, &items);
    }
    let mut annotations = FieldTable::new();
    annotations.insert("x-exchange".into(), FieldValue::string(&m.exchange));
    annotations.insert("x-routing-key".into(), FieldValue::string(&m.routing_key));
    for (name, v) in [
        ("x-basic-type", &p.kind),
        ("x-basic-app-id", &p.app_id),
        ("x-basic-expiration", &p.expiration),
        ("x-basic-cluster-id", &p.cluster_id),
    ] {
        if let Some(v) = v {
            annotations.insert(name.into(), FieldValue::string(v));
        }
    }
    descriptor(&mut out, MESSAGE_ANNOTATIONS);
    map(&mut out, &annotations, symbol);
    let fields: [Option<Prop<'_>>; 10] = [
        p.message_id.as_deref().map(Prop::Str),
        p.user_id.as_deref().map(Prop::Bin),
        None,
        None,
        p.reply_to.as_deref().map(Prop::Str),
        p.correlation_id.as_deref().map(Prop::Str),
        p.content_type.as_deref().map(Prop::Sym),
        p.content_encoding.as_deref().map(Prop::Sym),
        None,
        p.timestamp.map(Prop::Ts),
    ];
    if let Some(last) = fields.iter().rposition(Option::is_some) {
        let mut items = BytesMut::new();
        for f in &fields[..=last] {
            match f {
                Some(Prop::Str(s)) => string(&mut items, s),
                Some(Prop::Bin(s)) => binary(&mut items, s.as_bytes()),
                Some(Prop::Sym(s)) => symbol(&mut items, s),
                Some(Prop::Ts(secs)) => {
                    items.put_u8(0x83);
                    items.put_i64(i64::try_from(secs.saturating_mul(1000)).unwrap_or(i64::MAX));
                }
                None => items.put_u8(0x40),
            }
        }
        descriptor(&mut out, PROPERTIES);
        compound(&mut out, 0xd0, last + 1, &items);
    }
    if let Some(headers) = p.headers.as_ref().filter(|h| !h.is_empty()) {
        descriptor(&mut out, APPLICATION_PROPERTIES);
        map(&mut out, headers, string);
    }
    descriptor(&mut out, DATA);
    binary(&mut out, &m.body);
    out.freeze()
}

// ---- decoding ----

/// The next section: its descriptor code, its value, and where that value starts.
fn section(r: &mut Reader<'_>) -> Result<(u64, Value, usize), DecodeError> {
    let code = match r.descriptor()? {
        Some(Descriptor::Code(c)) => c,
        // Symbolic descriptors (`amqp:data:binary`): rare; named by their code.
        Some(Descriptor::Symbol(s)) => {
            descriptor::code_of(&s).ok_or(DecodeError::Message("unknown section"))?
        }
        None => return Err(DecodeError::Message("a section without a descriptor")),
    };
    let value_at = r.pos;
    let value = r.value()?;
    Ok((code, value, value_at))
}

fn text(v: Value) -> Option<String> {
    match v {
        Value::String(s) | Value::Symbol(s) => Some(s),
        Value::Binary(b) => String::from_utf8(b.to_vec()).ok(),
        Value::ULong(n) => Some(n.to_string()),
        Value::Uuid(u) => Some(u.iter().map(|b| format!("{b:02x}")).collect()),
        _ => None,
    }
}

/// A message's `to` and `subject` properties (fields 2 and 3 of `properties`): where an
/// AMQP 1.0 publisher on a null-addressed link sends it, and the routing key for an
/// `/exchanges/:exchange` link (RabbitMQ 4's addressing). `None` for each one absent.
pub fn addressing(data: &Bytes) -> Result<(Option<String>, Option<String>), DecodeError> {
    let mut r = Reader::new(data);
    while !r.at_end() {
        let (code, value, _) = section(&mut r)?;
        if let (PROPERTIES, Value::List(items)) = (code, value) {
            let mut items = items.into_iter().skip(2);
            let to = items.next().and_then(text);
            let subject = items.next().and_then(text);
            return Ok((to, subject));
        }
        // The bare message's properties come before application-properties and the body.
        if code > PROPERTIES {
            break;
        }
    }
    Ok((None, None))
}

/// An AMQP 1.0 message as AMQP 0.9.1 sees it (see the module docs for the mapping).
pub fn decode(data: &Bytes) -> Result<Message, DecodeError> {
    let mut r = Reader::new(data);
    let mut p = Properties::default();
    let mut headers = FieldTable::new();
    let (mut exchange, mut routing_key) = (String::new(), String::new());
    let mut body: Option<Bytes> = None;
    let mut extra = BytesMut::new();
    while r.pos < data.len() {
        let (code, value, value_at) = section(&mut r)?;
        match (code, value) {
            (HEADER, Value::List(items)) => {
                let mut items = items.into_iter();
                if let Some(Value::Bool(durable)) = items.next() {
                    p.delivery_mode = Some(if durable { 2 } else { 1 });
                }
                if let Some(Value::UByte(prio)) = items.next() {
                    p.priority = Some(prio);
                }
                // ttl (ms): 0.9.1's per-message expiration; an `x-basic-expiration`
                // annotation (a 0.9.1 publisher's own text) comes later and wins.
                if let Some(Value::UInt(ttl)) = items.next() {
                    p.expiration = Some(ttl.to_string());
                }
            }
            (MESSAGE_ANNOTATIONS, Value::Map(entries)) => {
                for (k, v) in entries {
                    let Some(k) = k.text().map(str::to_string) else {
                        continue;
                    };
                    match k.as_str() {
                        "x-exchange" => {
                            exchange = text(v).unwrap_or_default();
                            continue;
                        }
                        "x-routing-key" => {
                            routing_key = text(v).unwrap_or_default();
                            continue;
                        }
                        _ => {}
                    }
                    let prop = match k.as_str() {
                        "x-basic-type" => Some(&mut p.kind),
                        "x-basic-app-id" => Some(&mut p.app_id),
                        "x-basic-expiration" => Some(&mut p.expiration),
                        "x-basic-cluster-id" => Some(&mut p.cluster_id),
                        _ => None,
                    };
                    match prop {
                        Some(prop) => *prop = text(v),
                        None => {
                            headers.insert(k, v.field());
                        }
                    }
                }
            }
            (PROPERTIES, Value::List(items)) => {
                for (i, v) in items.into_iter().enumerate() {
                    match (i, v) {
                        (_, Value::Null) => {}
                        (0, v) => p.message_id = text(v),
                        (1, v) => p.user_id = text(v),
                        (4, v) => p.reply_to = text(v),
                        (5, v) => p.correlation_id = text(v),
                        (6, v) => p.content_type = text(v),
                        (7, v) => p.content_encoding = text(v),
                        (9, Value::Timestamp(ms)) => p.timestamp = u64::try_from(ms / 1000).ok(),
                        _ => {}
                    }
                }
            }
            (APPLICATION_PROPERTIES, Value::Map(entries)) => {
                for (k, v) in entries {
                    if let Some(k) = k.text() {
                        headers.insert(k.to_string(), v.field());
                    }
                }
            }
            (DATA, Value::Binary(b)) => match body.take() {
                None => body = Some(b),
                Some(first) => {
                    if extra.is_empty() {
                        extra.put_slice(&first);
                    }
                    extra.put_slice(&b);
                    body = Some(Bytes::new());
                }
            },
            (AMQP_VALUE, Value::Binary(b)) => body = Some(b),
            (AMQP_VALUE, Value::String(s)) => body = Some(Bytes::from(s)),
            (AMQP_VALUE | AMQP_SEQUENCE, _) => body = Some(data.slice(value_at..r.pos)),
            (DELIVERY_ANNOTATIONS | FOOTER, _) => {}
            _ => return Err(DecodeError::Message("a section of the wrong type")),
        }
    }
    let body = if extra.is_empty() {
        body.unwrap_or_default()
    } else {
        extra.freeze()
    };
    if !headers.is_empty() {
        p.headers = Some(headers);
    }
    Ok(Message {
        exchange: Arc::from(exchange),
        routing_key: Arc::from(routing_key),
        properties: p,
        body,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn full() -> Message {
        let mut headers = FieldTable::new();
        headers.insert("i".into(), FieldValue::I32(-7));
        headers.insert("l".into(), FieldValue::I64(1 << 40));
        headers.insert("s".into(), FieldValue::string("text"));
        headers.insert("b".into(), FieldValue::Bool(true));
        headers.insert("f".into(), FieldValue::F64(1.5));
        headers.insert("t".into(), FieldValue::Timestamp(1_700_000_000));
        headers.insert(
            "a".into(),
            FieldValue::Array(vec![FieldValue::I64(1), FieldValue::string("x")]),
        );
        let mut nested = FieldTable::new();
        nested.insert("k".into(), FieldValue::U8(3));
        headers.insert("n".into(), FieldValue::Table(nested));
        headers.insert("v".into(), FieldValue::Void);
        Message {
            exchange: Arc::from("ex"),
            routing_key: Arc::from("rk"),
            properties: Properties {
                content_type: Some("text/plain".into()),
                content_encoding: Some("gzip".into()),
                headers: Some(headers),
                delivery_mode: Some(2),
                priority: Some(3),
                correlation_id: Some("c".into()),
                reply_to: Some("r".into()),
                expiration: Some("60000".into()),
                message_id: Some("id0".into()),
                timestamp: Some(1_700_000_000),
                kind: Some("t".into()),
                user_id: Some("guest".into()),
                app_id: Some("a".into()),
                cluster_id: None,
            },
            body: Bytes::from_static(b"hello"),
        }
    }

    #[test]
    fn an_amqp_091_message_comes_back_as_it_went_in() {
        let m = full();
        assert_eq!(decode(&encode(&m)).expect("decodes"), m);
        let bare = Message {
            exchange: Arc::from(""),
            routing_key: Arc::from("q"),
            properties: Properties::default(),
            body: Bytes::from(vec![7u8; 300]),
        };
        assert_eq!(decode(&encode(&bare)).expect("decodes"), bare);
    }

    #[test]
    fn a_stream_clients_message_decodes() {
        // properties (message-id "m1"), application-properties {"k": "v"}, two data
        // sections, as a stream client may write them.
        let mut out = BytesMut::new();
        descriptor(&mut out, PROPERTIES);
        let mut items = BytesMut::new();
        string(&mut items, "m1");
        compound(&mut out, 0xd0, 1, &items);
        descriptor(&mut out, APPLICATION_PROPERTIES);
        let mut kv = BytesMut::new();
        string(&mut kv, "k");
        string(&mut kv, "v");
        compound(&mut out, 0xd1, 2, &kv);
        descriptor(&mut out, DATA);
        binary(&mut out, b"ab");
        descriptor(&mut out, DATA);
        binary(&mut out, b"cd");
        let m = decode(&out.freeze()).expect("decodes");
        assert_eq!(&m.body[..], b"abcd");
        assert_eq!(m.properties.message_id.as_deref(), Some("m1"));
        assert_eq!(
            m.properties.headers.and_then(|h| h.get("k").cloned()),
            Some(FieldValue::string("v"))
        );
        // amqp-value string body.
        let mut out = BytesMut::new();
        descriptor(&mut out, AMQP_VALUE);
        string(&mut out, "plain");
        assert_eq!(&decode(&out.freeze()).expect("decodes").body[..], b"plain");
    }

    #[test]
    fn to_subject_and_ttl() {
        // header [durable, priority 4, ttl 5000], properties [null, null, to, subject].
        let mut out = BytesMut::new();
        descriptor(&mut out, HEADER);
        let mut items = BytesMut::new();
        items.put_slice(&[0x41, 0x50, 4, 0x70, 0, 0, 0x13, 0x88]);
        compound(&mut out, 0xd0, 3, &items);
        descriptor(&mut out, PROPERTIES);
        let mut items = BytesMut::new();
        items.put_slice(&[0x40, 0x40]);
        string(&mut items, "/queues/q1");
        string(&mut items, "rk");
        compound(&mut out, 0xd0, 4, &items);
        descriptor(&mut out, DATA);
        binary(&mut out, b"x");
        let data = out.freeze();
        assert_eq!(
            addressing(&data),
            Ok((Some("/queues/q1".into()), Some("rk".into())))
        );
        let m = decode(&data).expect("decodes");
        assert_eq!(m.properties.expiration.as_deref(), Some("5000"));
        assert_eq!(m.properties.delivery_mode, Some(2));
        assert_eq!(m.properties.priority, Some(4));
        // Properties without to or subject: neither.
        assert_eq!(addressing(&encode(&full())), Ok((None, None)));
        assert!(addressing(&Bytes::from_static(b"\x00\x53")).is_err());
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        for bad in [
            &b"\x00"[..],
            b"\x00\x53\x75\xb0\xff\xff\xff\xff",
            b"\x00\x53\x74\xd1\x00\x00\x00\x10\x00\x00\x00\x09",
            b"hello",
            b"\x00\x53\x73\xc0\x05\xff",
        ] {
            assert!(decode(&Bytes::copy_from_slice(bad)).is_err(), "{bad:?}");
        }
        // Deep nesting is refused, not recursed into.
        let mut deep = vec![0x00, 0x53, 0x77];
        for _ in 0..100 {
            deep.extend_from_slice(&[0xc0, 0xff, 0x01]);
        }
        assert!(decode(&Bytes::from(deep)).is_err());
    }
}
