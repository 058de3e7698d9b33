//! The byte encoding of ops and effects that crosses the guest boundary. Documented byte by
//! byte in `docs/wasm-abi.md`; any change here is an ABI change (bump [`crate::ABI_VERSION`]).
//!
//! Deterministic by construction: integers are little-endian with fixed widths, field tables
//! are `BTreeMap`s (sorted keys), floats are written as their bit patterns, and nothing
//! depends on pointer width, so the native and wasm32 builds produce identical bytes.

use bytes::Bytes;
use std::sync::Arc;
use warren_core::command::{Bind, Consume, ExchangeDeclare, Op, OpKind, Publish, QueueDeclare};
use warren_core::effect::{Delivery, Effect, Reply};
use warren_core::error::{ErrorCode, ProtocolError};
use warren_core::ids::{ChannelRef, ConnId};
use warren_core::message::{FieldTable, FieldValue, Message, Properties};
use warren_core::mqtt::RetainedMessage;
use warren_core::policy::{ApplyTo, PolicyDef};

/// Field tables nest (tables in arrays in tables); decoding recursion is bounded so hostile
/// input cannot overflow the guest's small stack.
pub const MAX_NESTING: usize = 32;

/// Why a byte sequence is not a valid op or effect stream. `at` is the byte offset.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("truncated input at byte {at}")]
    Truncated { at: usize },
    #[error("unknown {what} tag {tag:#04x} at byte {at}")]
    BadTag {
        what: &'static str,
        tag: u8,
        at: usize,
    },
    #[error("invalid UTF-8 string at byte {at}")]
    BadUtf8 { at: usize },
    #[error("{extra} trailing bytes after the value")]
    Trailing { extra: usize },
    #[error("field tables nested deeper than {MAX_NESTING}")]
    TooDeep,
    #[error("unknown reply text {0:?}")]
    UnknownText(String),
}

type Result<T> = std::result::Result<T, DecodeError>;

// ---------------------------------------------------------------------------------------------
// Primitives

struct Writer<'a>(&'a mut Vec<u8>);

impl Writer<'_> {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u16(&mut self, v: u16) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn bool(&mut self, v: bool) {
        self.u8(u8::from(v));
    }
    /// Up to 8 booleans as one byte, the first in bit 0.
    fn flags(&mut self, bits: &[bool]) {
        debug_assert!(bits.len() <= 8);
        let mut b = 0u8;
        for (i, &set) in bits.iter().enumerate() {
            b |= u8::from(set) << i;
        }
        self.u8(b);
    }
    fn bytes(&mut self, v: &[u8]) {
        // Lengths above u32::MAX cannot exist in wasm32 memory; natively they would be a host
        // bug, and truncating silently would desynchronise the stream, so saturate loudly.
        let len = u32::try_from(v.len()).expect("value longer than 4 GiB");
        self.u32(len);
        self.0.extend_from_slice(v);
    }
    fn str(&mut self, v: &str) {
        self.bytes(v.as_bytes());
    }
    fn ch(&mut self, ch: ChannelRef) {
        self.u64(ch.conn.0);
        self.u16(ch.channel);
    }
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn new(buf: &'a [u8]) -> Reader<'a> {
        Reader { buf, pos: 0 }
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&end| end <= self.buf.len())
            .ok_or(DecodeError::Truncated { at: self.pos })?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8> {
        Ok(self.array::<1>()?[0])
    }
    fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_le_bytes(self.array()?))
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    fn bad(&self, what: &'static str, tag: u8) -> DecodeError {
        DecodeError::BadTag {
            what,
            tag,
            at: self.pos.saturating_sub(1),
        }
    }
    fn bool(&mut self) -> Result<bool> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            t => Err(self.bad("bool", t)),
        }
    }
    /// `N` booleans from one byte; bits above `N` must be clear so every value has exactly one
    /// encoding.
    fn flags<const N: usize>(&mut self) -> Result<[bool; N]> {
        let b = self.u8()?;
        if N < 8 && b >> N != 0 {
            return Err(self.bad("flags", b));
        }
        let mut out = [false; N];
        for (i, v) in out.iter_mut().enumerate() {
            *v = b & (1 << i) != 0;
        }
        Ok(out)
    }
    fn len(&mut self) -> Result<usize> {
        let n = self.u32()?;
        usize::try_from(n).map_err(|_| DecodeError::Truncated { at: self.pos })
    }
    fn bytes(&mut self) -> Result<&'a [u8]> {
        let n = self.len()?;
        self.take(n)
    }
    fn string(&mut self) -> Result<String> {
        let at = self.pos;
        let b = self.bytes()?;
        std::str::from_utf8(b)
            .map(str::to_owned)
            .map_err(|_| DecodeError::BadUtf8 { at })
    }
    fn ch(&mut self) -> Result<ChannelRef> {
        let conn = self.u64()?;
        let channel = self.u16()?;
        Ok(ChannelRef::new(ConnId(conn), channel))
    }
    fn finish(&self) -> Result<()> {
        match self.buf.len() - self.pos {
            0 => Ok(()),
            extra => Err(DecodeError::Trailing { extra }),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Field tables and properties

fn put_table(w: &mut Writer, t: &FieldTable) {
    w.u32(u32::try_from(t.len()).expect("field table with 4G entries"));
    for (k, v) in t {
        w.str(k);
        put_value(w, v);
    }
}

fn put_value(w: &mut Writer, v: &FieldValue) {
    match v {
        FieldValue::Void => w.u8(0),
        FieldValue::Bool(b) => {
            w.u8(1);
            w.bool(*b);
        }
        FieldValue::I8(x) => {
            w.u8(2);
            w.u8(x.to_le_bytes()[0]);
        }
        FieldValue::U8(x) => {
            w.u8(3);
            w.u8(*x);
        }
        FieldValue::I16(x) => {
            w.u8(4);
            w.u16(u16::from_le_bytes(x.to_le_bytes()));
        }
        FieldValue::U16(x) => {
            w.u8(5);
            w.u16(*x);
        }
        FieldValue::I32(x) => {
            w.u8(6);
            w.u32(u32::from_le_bytes(x.to_le_bytes()));
        }
        FieldValue::U32(x) => {
            w.u8(7);
            w.u32(*x);
        }
        FieldValue::I64(x) => {
            w.u8(8);
            w.u64(u64::from_le_bytes(x.to_le_bytes()));
        }
        FieldValue::F32(x) => {
            w.u8(9);
            w.u32(x.to_bits());
        }
        FieldValue::F64(x) => {
            w.u8(10);
            w.u64(x.to_bits());
        }
        FieldValue::Decimal { scale, value } => {
            w.u8(11);
            w.u8(*scale);
            w.u32(*value);
        }
        FieldValue::ShortString(s) => {
            w.u8(12);
            w.str(s);
        }
        FieldValue::LongString(b) => {
            w.u8(13);
            w.bytes(b);
        }
        FieldValue::Array(items) => {
            w.u8(14);
            w.u32(u32::try_from(items.len()).expect("array with 4G entries"));
            for item in items {
                put_value(w, item);
            }
        }
        FieldValue::Timestamp(t) => {
            w.u8(15);
            w.u64(*t);
        }
        FieldValue::Table(t) => {
            w.u8(16);
            put_table(w, t);
        }
        FieldValue::ByteArray(b) => {
            w.u8(17);
            w.bytes(b);
        }
    }
}

fn get_table(r: &mut Reader, depth: usize) -> Result<FieldTable> {
    if depth > MAX_NESTING {
        return Err(DecodeError::TooDeep);
    }
    let n = r.len()?;
    let mut t = FieldTable::new();
    for _ in 0..n {
        let k = r.string()?;
        let v = get_value(r, depth)?;
        t.insert(k, v);
    }
    Ok(t)
}

fn get_value(r: &mut Reader, depth: usize) -> Result<FieldValue> {
    Ok(match r.u8()? {
        0 => FieldValue::Void,
        1 => FieldValue::Bool(r.bool()?),
        2 => FieldValue::I8(i8::from_le_bytes([r.u8()?])),
        3 => FieldValue::U8(r.u8()?),
        4 => FieldValue::I16(r.u16()? as i16),
        5 => FieldValue::U16(r.u16()?),
        6 => FieldValue::I32(r.u32()? as i32),
        7 => FieldValue::U32(r.u32()?),
        8 => FieldValue::I64(r.u64()? as i64),
        9 => FieldValue::F32(f32::from_bits(r.u32()?)),
        10 => FieldValue::F64(f64::from_bits(r.u64()?)),
        11 => FieldValue::Decimal {
            scale: r.u8()?,
            value: r.u32()?,
        },
        12 => FieldValue::ShortString(r.string()?),
        13 => FieldValue::LongString(Bytes::copy_from_slice(r.bytes()?)),
        14 => {
            if depth >= MAX_NESTING {
                return Err(DecodeError::TooDeep);
            }
            let n = r.len()?;
            // No `with_capacity(n)`: `n` is untrusted and each element takes >= 1 byte anyway.
            let mut items = Vec::new();
            for _ in 0..n {
                items.push(get_value(r, depth + 1)?);
            }
            FieldValue::Array(items)
        }
        15 => FieldValue::Timestamp(r.u64()?),
        16 => FieldValue::Table(get_table(r, depth + 1)?),
        17 => FieldValue::ByteArray(Bytes::copy_from_slice(r.bytes()?)),
        t => return Err(r.bad("field value", t)),
    })
}

fn put_opt_str(w: &mut Writer, v: &Option<String>) {
    if let Some(s) = v {
        w.str(s);
    }
}

fn put_properties(w: &mut Writer, p: &Properties) {
    let present = [
        p.content_type.is_some(),
        p.content_encoding.is_some(),
        p.headers.is_some(),
        p.delivery_mode.is_some(),
        p.priority.is_some(),
        p.correlation_id.is_some(),
        p.reply_to.is_some(),
        p.expiration.is_some(),
        p.message_id.is_some(),
        p.timestamp.is_some(),
        p.kind.is_some(),
        p.user_id.is_some(),
        p.app_id.is_some(),
        p.cluster_id.is_some(),
    ];
    let mut mask = 0u16;
    for (i, &set) in present.iter().enumerate() {
        mask |= u16::from(set) << i;
    }
    w.u16(mask);
    put_opt_str(w, &p.content_type);
    put_opt_str(w, &p.content_encoding);
    if let Some(h) = &p.headers {
        put_table(w, h);
    }
    if let Some(v) = p.delivery_mode {
        w.u8(v);
    }
    if let Some(v) = p.priority {
        w.u8(v);
    }
    put_opt_str(w, &p.correlation_id);
    put_opt_str(w, &p.reply_to);
    put_opt_str(w, &p.expiration);
    put_opt_str(w, &p.message_id);
    if let Some(v) = p.timestamp {
        w.u64(v);
    }
    put_opt_str(w, &p.kind);
    put_opt_str(w, &p.user_id);
    put_opt_str(w, &p.app_id);
    put_opt_str(w, &p.cluster_id);
}

fn get_properties(r: &mut Reader) -> Result<Properties> {
    let mask = r.u16()?;
    if mask >> 14 != 0 {
        return Err(DecodeError::BadTag {
            what: "property mask",
            tag: (mask >> 8) as u8,
            at: r.pos - 2,
        });
    }
    let has = |i: u16| mask & (1 << i) != 0;
    let opt_str = |r: &mut Reader, i| -> Result<Option<String>> {
        if has(i) {
            r.string().map(Some)
        } else {
            Ok(None)
        }
    };
    Ok(Properties {
        content_type: opt_str(r, 0)?,
        content_encoding: opt_str(r, 1)?,
        headers: if has(2) { Some(get_table(r, 0)?) } else { None },
        delivery_mode: if has(3) { Some(r.u8()?) } else { None },
        priority: if has(4) { Some(r.u8()?) } else { None },
        correlation_id: opt_str(r, 5)?,
        reply_to: opt_str(r, 6)?,
        expiration: opt_str(r, 7)?,
        message_id: opt_str(r, 8)?,
        timestamp: if has(9) { Some(r.u64()?) } else { None },
        kind: opt_str(r, 10)?,
        user_id: opt_str(r, 11)?,
        app_id: opt_str(r, 12)?,
        cluster_id: opt_str(r, 13)?,
    })
}

fn put_message(w: &mut Writer, m: &Message) {
    w.str(&m.exchange);
    w.str(&m.routing_key);
    put_properties(w, &m.properties);
    w.bytes(&m.body);
}

fn get_message(r: &mut Reader) -> Result<Message> {
    Ok(Message {
        exchange: Arc::from(r.string()?),
        routing_key: Arc::from(r.string()?),
        properties: get_properties(r)?,
        body: Bytes::copy_from_slice(r.bytes()?),
    })
}

fn put_bind(w: &mut Writer, b: &Bind) {
    w.str(&b.destination);
    w.str(&b.source);
    w.str(&b.routing_key);
    w.bool(b.nowait);
    put_table(w, &b.arguments);
}

fn get_bind(r: &mut Reader) -> Result<Bind> {
    Ok(Bind {
        destination: r.string()?,
        source: r.string()?,
        routing_key: r.string()?,
        nowait: r.bool()?,
        arguments: get_table(r, 0)?,
    })
}

// ---------------------------------------------------------------------------------------------
// Policies

/// An operator's policy change (`warren_policy`): policies are not client ops, yet they
/// change what queues do (limits, TTLs, dead-lettering, alternate exchanges), so a host
/// that wants the whole broker drives them too.
#[derive(Clone, Debug, PartialEq)]
pub enum PolicyChange {
    Set(PolicyDef),
    Clear { vhost: String, name: String },
}

const APPLY_TO: [ApplyTo; 3] = [ApplyTo::All, ApplyTo::Queues, ApplyTo::Exchanges];

/// Appends the encoding of `change` to `out`.
pub fn encode_policy(change: &PolicyChange, out: &mut Vec<u8>) {
    let w = &mut Writer(out);
    match change {
        PolicyChange::Set(p) => {
            w.u8(0x01);
            w.str(&p.vhost);
            w.str(&p.name);
            w.str(&p.pattern);
            let apply_to = APPLY_TO.iter().position(|a| *a == p.apply_to).unwrap_or(0);
            w.u8(apply_to as u8);
            w.u64(p.priority as u64);
            put_table(w, &p.definition);
        }
        PolicyChange::Clear { vhost, name } => {
            w.u8(0x02);
            w.str(vhost);
            w.str(name);
        }
    }
}

/// Decodes exactly one policy change; trailing bytes are an error.
pub fn decode_policy(buf: &[u8]) -> Result<PolicyChange> {
    let r = &mut Reader::new(buf);
    let change = match r.u8()? {
        0x01 => PolicyChange::Set(PolicyDef {
            vhost: r.string()?,
            name: r.string()?,
            pattern: r.string()?,
            apply_to: {
                let tag = r.u8()?;
                *APPLY_TO
                    .get(usize::from(tag))
                    .ok_or_else(|| r.bad("apply-to", tag))?
            },
            priority: r.u64()? as i64,
            definition: get_table(r, 0)?,
        }),
        0x02 => PolicyChange::Clear {
            vhost: r.string()?,
            name: r.string()?,
        },
        t => return Err(r.bad("policy change", t)),
    };
    r.finish()?;
    Ok(change)
}

// ---------------------------------------------------------------------------------------------
// Ops

/// Appends the encoding of `op` to `out`.
pub fn encode_op(op: &Op, out: &mut Vec<u8>) {
    let w = &mut Writer(out);
    match op {
        Op::ConnectionOpen {
            vhost,
            user,
            cancel_notify,
        } => {
            w.u8(0x01);
            w.str(vhost);
            w.str(user);
            w.bool(*cancel_notify);
        }
        Op::ConnectionClose => w.u8(0x02),
        Op::ChannelOpen => w.u8(0x03),
        Op::ChannelClose => w.u8(0x04),
        Op::ChannelCloseOk => w.u8(0x05),
        Op::ExchangeDeclare(d) => {
            w.u8(0x06);
            w.str(&d.exchange);
            w.str(&d.kind);
            w.flags(&[d.passive, d.durable, d.auto_delete, d.internal, d.nowait]);
            put_table(w, &d.arguments);
        }
        Op::ExchangeDelete {
            exchange,
            if_unused,
            nowait,
        } => {
            w.u8(0x07);
            w.str(exchange);
            w.flags(&[*if_unused, *nowait]);
        }
        Op::ExchangeBind(b) => {
            w.u8(0x08);
            put_bind(w, b);
        }
        Op::ExchangeUnbind(b) => {
            w.u8(0x09);
            put_bind(w, b);
        }
        Op::QueueDeclare(d) => {
            w.u8(0x0a);
            w.str(&d.queue);
            w.flags(&[d.passive, d.durable, d.exclusive, d.auto_delete, d.nowait]);
            put_table(w, &d.arguments);
        }
        Op::QueueBind(b) => {
            w.u8(0x0b);
            put_bind(w, b);
        }
        Op::QueueUnbind(b) => {
            w.u8(0x0c);
            put_bind(w, b);
        }
        Op::QueuePurge { queue, nowait } => {
            w.u8(0x0d);
            w.str(queue);
            w.bool(*nowait);
        }
        Op::QueueDelete {
            queue,
            if_unused,
            if_empty,
            nowait,
        } => {
            w.u8(0x0e);
            w.str(queue);
            w.flags(&[*if_unused, *if_empty, *nowait]);
        }
        Op::Qos {
            prefetch_size,
            prefetch_count,
            global,
        } => {
            w.u8(0x0f);
            w.u32(*prefetch_size);
            w.u16(*prefetch_count);
            w.bool(*global);
        }
        Op::Consume(c) => {
            w.u8(0x10);
            w.str(&c.queue);
            w.str(&c.consumer_tag);
            w.flags(&[c.no_local, c.no_ack, c.exclusive, c.nowait]);
            put_table(w, &c.arguments);
        }
        Op::Cancel {
            consumer_tag,
            nowait,
        } => {
            w.u8(0x11);
            w.str(consumer_tag);
            w.bool(*nowait);
        }
        Op::Get { queue, no_ack } => {
            w.u8(0x12);
            w.str(queue);
            w.bool(*no_ack);
        }
        Op::Publish(p) => {
            w.u8(0x13);
            w.str(&p.exchange);
            w.str(&p.routing_key);
            w.flags(&[p.mandatory, p.immediate]);
            put_properties(w, &p.properties);
            w.bytes(&p.body);
        }
        Op::Ack {
            delivery_tag,
            multiple,
        } => {
            w.u8(0x14);
            w.u64(*delivery_tag);
            w.bool(*multiple);
        }
        Op::Nack {
            delivery_tag,
            multiple,
            requeue,
        } => {
            w.u8(0x15);
            w.u64(*delivery_tag);
            w.flags(&[*multiple, *requeue]);
        }
        Op::Reject {
            delivery_tag,
            requeue,
        } => {
            w.u8(0x16);
            w.u64(*delivery_tag);
            w.bool(*requeue);
        }
        Op::Recover { requeue } => {
            w.u8(0x17);
            w.bool(*requeue);
        }
        Op::ConfirmSelect { nowait } => {
            w.u8(0x18);
            w.bool(*nowait);
        }
        Op::TxSelect => w.u8(0x19),
        Op::TxCommit => w.u8(0x1a),
        Op::TxRollback => w.u8(0x1b),
        Op::Written { count } => {
            w.u8(0x1c);
            w.u32(*count);
        }
        Op::Refuse(e) => {
            w.u8(0x1d);
            put_error(w, e);
        }
        Op::Retain { message, durable } => {
            w.u8(0x1e);
            put_retained(w, message);
            w.bool(*durable);
        }
        Op::RetainedGet { filter, max } => {
            w.u8(0x1f);
            w.str(filter);
            w.u32(*max);
        }
        Op::ClientId(id) => {
            w.u8(0x20);
            w.str(id);
        }
    }
}

/// An MQTT retained message: `str` topic, `u8` QoS (0-2), `props`, `bytes` payload, `u64`
/// stored_at, `u64` expiry in ms (`u64::MAX`: none).
fn put_retained(w: &mut Writer, m: &RetainedMessage) {
    w.str(&m.topic);
    w.u8(m.qos);
    put_properties(w, &m.properties);
    w.bytes(&m.payload);
    w.u64(m.stored_at);
    w.u64(m.expiry_ms.unwrap_or(u64::MAX));
}

fn get_retained(r: &mut Reader) -> Result<RetainedMessage> {
    let topic = Arc::from(r.string()?);
    let qos = r.u8()?;
    if qos > 2 {
        return Err(r.bad("qos", qos));
    }
    Ok(RetainedMessage {
        topic,
        qos,
        properties: get_properties(r)?,
        payload: Bytes::copy_from_slice(r.bytes()?),
        stored_at: r.u64()?,
        expiry_ms: Some(r.u64()?).filter(|&e| e != u64::MAX),
    })
}

/// Decodes exactly one op; trailing bytes are an error.
pub fn decode_op(buf: &[u8]) -> Result<Op> {
    let r = &mut Reader::new(buf);
    let op = match r.u8()? {
        0x01 => Op::ConnectionOpen {
            vhost: r.string()?,
            user: r.string()?,
            cancel_notify: r.bool()?,
        },
        0x02 => Op::ConnectionClose,
        0x03 => Op::ChannelOpen,
        0x04 => Op::ChannelClose,
        0x05 => Op::ChannelCloseOk,
        0x06 => {
            let exchange = r.string()?;
            let kind = r.string()?;
            let [passive, durable, auto_delete, internal, nowait] = r.flags()?;
            Op::ExchangeDeclare(ExchangeDeclare {
                exchange,
                kind,
                passive,
                durable,
                auto_delete,
                internal,
                nowait,
                arguments: get_table(r, 0)?,
            })
        }
        0x07 => {
            let exchange = r.string()?;
            let [if_unused, nowait] = r.flags()?;
            Op::ExchangeDelete {
                exchange,
                if_unused,
                nowait,
            }
        }
        0x08 => Op::ExchangeBind(get_bind(r)?),
        0x09 => Op::ExchangeUnbind(get_bind(r)?),
        0x0a => {
            let queue = r.string()?;
            let [passive, durable, exclusive, auto_delete, nowait] = r.flags()?;
            Op::QueueDeclare(QueueDeclare {
                queue,
                passive,
                durable,
                exclusive,
                auto_delete,
                nowait,
                arguments: get_table(r, 0)?,
            })
        }
        0x0b => Op::QueueBind(get_bind(r)?),
        0x0c => Op::QueueUnbind(get_bind(r)?),
        0x0d => Op::QueuePurge {
            queue: r.string()?,
            nowait: r.bool()?,
        },
        0x0e => {
            let queue = r.string()?;
            let [if_unused, if_empty, nowait] = r.flags()?;
            Op::QueueDelete {
                queue,
                if_unused,
                if_empty,
                nowait,
            }
        }
        0x0f => Op::Qos {
            prefetch_size: r.u32()?,
            prefetch_count: r.u16()?,
            global: r.bool()?,
        },
        0x10 => {
            let queue = r.string()?;
            let consumer_tag = r.string()?;
            let [no_local, no_ack, exclusive, nowait] = r.flags()?;
            Op::Consume(Consume {
                queue,
                consumer_tag,
                no_local,
                no_ack,
                exclusive,
                nowait,
                arguments: get_table(r, 0)?,
            })
        }
        0x11 => Op::Cancel {
            consumer_tag: r.string()?,
            nowait: r.bool()?,
        },
        0x12 => Op::Get {
            queue: r.string()?,
            no_ack: r.bool()?,
        },
        0x13 => {
            let exchange = Arc::from(r.string()?);
            let routing_key = Arc::from(r.string()?);
            let [mandatory, immediate] = r.flags()?;
            Op::Publish(Box::new(Publish {
                exchange,
                routing_key,
                mandatory,
                immediate,
                properties: get_properties(r)?,
                body: Bytes::copy_from_slice(r.bytes()?),
                routed: None,
            }))
        }
        0x14 => Op::Ack {
            delivery_tag: r.u64()?,
            multiple: r.bool()?,
        },
        0x15 => {
            let delivery_tag = r.u64()?;
            let [multiple, requeue] = r.flags()?;
            Op::Nack {
                delivery_tag,
                multiple,
                requeue,
            }
        }
        0x16 => Op::Reject {
            delivery_tag: r.u64()?,
            requeue: r.bool()?,
        },
        0x17 => Op::Recover { requeue: r.bool()? },
        0x18 => Op::ConfirmSelect { nowait: r.bool()? },
        0x19 => Op::TxSelect,
        0x1a => Op::TxCommit,
        0x1b => Op::TxRollback,
        0x1c => Op::Written { count: r.u32()? },
        0x1d => Op::Refuse(get_error(r)?),
        0x1e => Op::Retain {
            message: Box::new(get_retained(r)?),
            durable: r.bool()?,
        },
        0x1f => Op::RetainedGet {
            filter: r.string()?,
            max: r.u32()?,
        },
        0x20 => Op::ClientId(r.string()?),
        t => return Err(r.bad("op", t)),
    };
    r.finish()?;
    Ok(op)
}

// ---------------------------------------------------------------------------------------------
// Effects

/// `OpKind` in declaration order, so its wire number is its index + 1.
const OP_KINDS: [OpKind; 30] = [
    OpKind::ConnectionOpen,
    OpKind::ConnectionClose,
    OpKind::ChannelOpen,
    OpKind::ChannelClose,
    OpKind::ChannelCloseOk,
    OpKind::ExchangeDeclare,
    OpKind::ExchangeDelete,
    OpKind::ExchangeBind,
    OpKind::ExchangeUnbind,
    OpKind::QueueDeclare,
    OpKind::QueueBind,
    OpKind::QueueUnbind,
    OpKind::QueuePurge,
    OpKind::QueueDelete,
    OpKind::Qos,
    OpKind::Consume,
    OpKind::Cancel,
    OpKind::Get,
    OpKind::Publish,
    OpKind::Ack,
    OpKind::Nack,
    OpKind::Reject,
    OpKind::Recover,
    OpKind::ConfirmSelect,
    OpKind::TxSelect,
    OpKind::TxCommit,
    OpKind::TxRollback,
    OpKind::Written,
    OpKind::Retain,
    OpKind::RetainedGet,
];

const ERROR_CODES: [ErrorCode; 18] = [
    ErrorCode::ContentTooLarge,
    ErrorCode::NoRoute,
    ErrorCode::NoConsumers,
    ErrorCode::ConnectionForced,
    ErrorCode::InvalidPath,
    ErrorCode::AccessRefused,
    ErrorCode::NotFound,
    ErrorCode::ResourceLocked,
    ErrorCode::PreconditionFailed,
    ErrorCode::FrameError,
    ErrorCode::SyntaxError,
    ErrorCode::CommandInvalid,
    ErrorCode::ChannelError,
    ErrorCode::UnexpectedFrame,
    ErrorCode::ResourceError,
    ErrorCode::NotAllowed,
    ErrorCode::NotImplemented,
    ErrorCode::InternalError,
];

fn op_kind_number(kind: OpKind) -> u8 {
    OP_KINDS
        .iter()
        .position(|&k| k == kind)
        .map_or(0, |i| i as u8 + 1)
}

fn put_error(w: &mut Writer, e: &ProtocolError) {
    w.u16(e.code.code());
    w.u8(op_kind_number(e.op));
    w.str(&e.text);
}

fn get_error(r: &mut Reader) -> Result<ProtocolError> {
    let code = r.u16()?;
    let code = ERROR_CODES
        .iter()
        .copied()
        .find(|c| c.code() == code)
        .ok_or(DecodeError::BadTag {
            what: "error code",
            tag: (code & 0xff) as u8,
            at: r.pos - 2,
        })?;
    let kind = r.u8()?;
    let op = usize::from(kind)
        .checked_sub(1)
        .and_then(|i| OP_KINDS.get(i))
        .copied()
        .ok_or_else(|| r.bad("op kind", kind))?;
    Ok(ProtocolError {
        code,
        op,
        text: r.string()?,
    })
}

fn put_delivery(w: &mut Writer, d: &Delivery) {
    w.u64(d.delivery_tag);
    w.bool(d.redelivered);
    put_message(w, &d.message);
}

fn get_delivery(r: &mut Reader) -> Result<Delivery> {
    Ok(Delivery {
        delivery_tag: r.u64()?,
        redelivered: r.bool()?,
        message: Arc::new(get_message(r)?),
    })
}

fn put_reply(w: &mut Writer, reply: &Reply) {
    match reply {
        Reply::ChannelOpenOk => w.u8(1),
        Reply::ChannelCloseOk => w.u8(2),
        Reply::ExchangeDeclareOk => w.u8(3),
        Reply::ExchangeDeleteOk => w.u8(4),
        Reply::ExchangeBindOk => w.u8(5),
        Reply::ExchangeUnbindOk => w.u8(6),
        Reply::QueueDeclareOk {
            queue,
            message_count,
            consumer_count,
        } => {
            w.u8(7);
            w.str(queue);
            w.u32(*message_count);
            w.u32(*consumer_count);
        }
        Reply::QueueBindOk => w.u8(8),
        Reply::QueueUnbindOk => w.u8(9),
        Reply::QueuePurgeOk { message_count } => {
            w.u8(10);
            w.u32(*message_count);
        }
        Reply::QueueDeleteOk { message_count } => {
            w.u8(11);
            w.u32(*message_count);
        }
        Reply::QosOk => w.u8(12),
        Reply::ConsumeOk { consumer_tag } => {
            w.u8(13);
            w.str(consumer_tag);
        }
        Reply::CancelOk { consumer_tag } => {
            w.u8(14);
            w.str(consumer_tag);
        }
        Reply::GetOk {
            delivery,
            message_count,
        } => {
            w.u8(15);
            put_delivery(w, delivery);
            w.u32(*message_count);
        }
        Reply::GetEmpty => w.u8(16),
        Reply::RecoverOk => w.u8(17),
        Reply::ConfirmSelectOk => w.u8(18),
        Reply::TxSelectOk => w.u8(19),
        Reply::TxCommitOk => w.u8(20),
        Reply::TxRollbackOk => w.u8(21),
        Reply::RetainOk { stored } => {
            w.u8(22);
            w.bool(*stored);
        }
        Reply::Retained { messages } => {
            w.u8(23);
            w.u32(u32::try_from(messages.len()).unwrap_or(u32::MAX));
            for m in messages {
                put_retained(w, m);
            }
        }
    }
}

fn get_reply(r: &mut Reader) -> Result<Reply> {
    Ok(match r.u8()? {
        1 => Reply::ChannelOpenOk,
        2 => Reply::ChannelCloseOk,
        3 => Reply::ExchangeDeclareOk,
        4 => Reply::ExchangeDeleteOk,
        5 => Reply::ExchangeBindOk,
        6 => Reply::ExchangeUnbindOk,
        7 => Reply::QueueDeclareOk {
            queue: Arc::from(r.string()?),
            message_count: r.u32()?,
            consumer_count: r.u32()?,
        },
        8 => Reply::QueueBindOk,
        9 => Reply::QueueUnbindOk,
        10 => Reply::QueuePurgeOk {
            message_count: r.u32()?,
        },
        11 => Reply::QueueDeleteOk {
            message_count: r.u32()?,
        },
        12 => Reply::QosOk,
        13 => Reply::ConsumeOk {
            consumer_tag: Arc::from(r.string()?),
        },
        14 => Reply::CancelOk {
            consumer_tag: Arc::from(r.string()?),
        },
        15 => Reply::GetOk {
            delivery: get_delivery(r)?,
            message_count: r.u32()?,
        },
        16 => Reply::GetEmpty,
        17 => Reply::RecoverOk,
        18 => Reply::ConfirmSelectOk,
        19 => Reply::TxSelectOk,
        20 => Reply::TxCommitOk,
        21 => Reply::TxRollbackOk,
        22 => Reply::RetainOk { stored: r.bool()? },
        23 => {
            let n = r.u32()?;
            // No capacity from the count: it is input; each message takes bytes to decode.
            let mut messages = Vec::new();
            for _ in 0..n {
                messages.push(get_retained(r)?);
            }
            Reply::Retained { messages }
        }
        t => return Err(r.bad("reply", t)),
    })
}

/// Tag of effects this encoder does not know (variants added to the core after it): their
/// `Debug` text, so a stream stays decodable and still differs when they differ.
pub const UNKNOWN_EFFECT: u8 = 0xff;

/// Appends the encoding of one effect to `out`.
pub fn encode_effect(e: &Effect, out: &mut Vec<u8>) {
    let w = &mut Writer(out);
    #[allow(unreachable_patterns)] // The catch-all keeps this compiling when the core grows.
    match e {
        Effect::Reply { ch, reply } => {
            w.u8(0x01);
            w.ch(*ch);
            put_reply(w, reply);
        }
        Effect::Deliver {
            ch,
            consumer_tag,
            delivery,
        } => {
            w.u8(0x02);
            w.ch(*ch);
            w.str(consumer_tag);
            put_delivery(w, delivery);
        }
        Effect::Return {
            ch,
            reply_code,
            reply_text,
            message,
        } => {
            w.u8(0x03);
            w.ch(*ch);
            w.u16(*reply_code);
            w.str(reply_text);
            put_message(w, message);
        }
        Effect::Confirm {
            ch,
            seq,
            multiple,
            ack,
        } => {
            w.u8(0x04);
            w.ch(*ch);
            w.u64(*seq);
            w.flags(&[*multiple, *ack]);
        }
        Effect::ConsumerCancelled { ch, consumer_tag } => {
            w.u8(0x05);
            w.ch(*ch);
            w.str(consumer_tag);
        }
        Effect::ChannelError { ch, error } => {
            w.u8(0x06);
            w.ch(*ch);
            put_error(w, error);
        }
        Effect::Blocked { conn } => {
            w.u8(0x07);
            w.u64(conn.0);
        }
        Effect::Unblocked { conn } => {
            w.u8(0x08);
            w.u64(conn.0);
        }
        Effect::FlowPaused { conn } => {
            w.u8(0x09);
            w.u64(conn.0);
        }
        Effect::FlowResumed { conn } => {
            w.u8(0x0a);
            w.u64(conn.0);
        }
        Effect::ConnectionError { conn, error } => {
            w.u8(0x0b);
            w.u64(conn.0);
            put_error(w, error);
        }
        other => {
            w.u8(UNKNOWN_EFFECT);
            w.str(&format!("{other:?}"));
        }
    }
}

/// Appends an effect batch: a u32 count, then the effects.
pub fn encode_effects(effects: &[Effect], out: &mut Vec<u8>) {
    Writer(out).u32(u32::try_from(effects.len()).expect("4G effects in one batch"));
    for e in effects {
        encode_effect(e, out);
    }
}

/// The `basic.return` texts the core emits (`Effect::Return::reply_text` is `&'static str`).
const RETURN_TEXTS: [&str; 2] = ["NO_ROUTE", "NO_CONSUMERS"];

/// A decoded effect: a core effect, or one the encoder only knew by its `Debug` text.
#[derive(Clone, Debug, PartialEq)]
pub enum Decoded {
    Effect(Effect),
    Unknown(String),
}

/// Decodes an effect batch written by [`encode_effects`].
pub fn decode_effects(buf: &[u8]) -> Result<Vec<Decoded>> {
    let r = &mut Reader::new(buf);
    let n = r.len()?;
    let mut out = Vec::new();
    for _ in 0..n {
        out.push(get_effect(r)?);
    }
    r.finish()?;
    Ok(out)
}

fn get_effect(r: &mut Reader) -> Result<Decoded> {
    let e = match r.u8()? {
        0x01 => Effect::Reply {
            ch: r.ch()?,
            reply: get_reply(r)?,
        },
        0x02 => Effect::Deliver {
            ch: r.ch()?,
            consumer_tag: Arc::from(r.string()?),
            delivery: get_delivery(r)?,
        },
        0x03 => {
            let ch = r.ch()?;
            let reply_code = r.u16()?;
            let text = r.string()?;
            let reply_text = RETURN_TEXTS
                .iter()
                .find(|t| **t == text)
                .ok_or(DecodeError::UnknownText(text))?;
            Effect::Return {
                ch,
                reply_code,
                reply_text,
                message: Arc::new(get_message(r)?),
            }
        }
        0x04 => {
            let ch = r.ch()?;
            let seq = r.u64()?;
            let [multiple, ack] = r.flags()?;
            Effect::Confirm {
                ch,
                seq,
                multiple,
                ack,
            }
        }
        0x05 => Effect::ConsumerCancelled {
            ch: r.ch()?,
            consumer_tag: Arc::from(r.string()?),
        },
        0x06 => Effect::ChannelError {
            ch: r.ch()?,
            error: get_error(r)?,
        },
        0x07 => Effect::Blocked {
            conn: ConnId(r.u64()?),
        },
        0x08 => Effect::Unblocked {
            conn: ConnId(r.u64()?),
        },
        0x09 => Effect::FlowPaused {
            conn: ConnId(r.u64()?),
        },
        0x0a => Effect::FlowResumed {
            conn: ConnId(r.u64()?),
        },
        0x0b => Effect::ConnectionError {
            conn: ConnId(r.u64()?),
            error: get_error(r)?,
        },
        UNKNOWN_EFFECT => return Ok(Decoded::Unknown(r.string()?)),
        t => return Err(r.bad("effect", t)),
    };
    Ok(Decoded::Effect(e))
}
