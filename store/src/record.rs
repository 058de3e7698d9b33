//! The byte encoding of a message (and of field tables, reused by the definitions) inside
//! store records. Layout in docs/storage.md ("Message encoding"). All integers little-endian;
//! every length is checked against the input on decode, so a corrupt record is an error,
//! never a panic or a huge allocation.

use bytes::Bytes;
use std::sync::Arc;
use warren_core::message::{FieldTable, FieldValue, Message, Properties};

/// A field table alone, in the encoding messages and definitions use (docs/storage.md,
/// "Message encoding"): lossless, unlike JSON (an `I8` stays an `I8`), so a definition
/// carried elsewhere (the cluster's metadata log) compares equal where it is applied.
pub fn encode_table(t: &FieldTable) -> Vec<u8> {
    let mut out = Vec::new();
    Writer(&mut out).table(t);
    out
}

/// Decodes [`encode_table`]'s bytes; trailing bytes are an error.
pub fn decode_table(v: &[u8]) -> Result<FieldTable, DecodeError> {
    let b = Bytes::copy_from_slice(v);
    let mut r = Reader::new(&b);
    let t = r.table(0)?;
    if r.pos != b.len() {
        return Err(DecodeError::Truncated);
    }
    Ok(t)
}

/// Version byte at the start of every encoded message.
pub const MESSAGE_VERSION: u8 = 1;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DecodeError {
    #[error("record truncated")]
    Truncated,
    #[error("unknown message encoding version {0}")]
    Version(u8),
    #[error("unknown field value tag {0}")]
    Tag(u8),
    #[error("text is not UTF-8")]
    Utf8,
    #[error("field tables nested deeper than {MAX_DEPTH}")]
    TooDeep,
}

/// Field tables may nest; bound the recursion on decode.
const MAX_DEPTH: usize = 32;

pub(crate) struct Writer<'a>(pub(crate) &'a mut Vec<u8>);

impl Writer<'_> {
    pub(crate) fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    pub(crate) fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    pub(crate) fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    pub(crate) fn bytes(&mut self, b: &[u8]) {
        self.u32(u32::try_from(b.len()).unwrap_or(u32::MAX));
        self.0.extend_from_slice(b);
    }
    fn opt_str(&mut self, s: &Option<String>) {
        match s {
            Some(s) => {
                self.u8(1);
                self.bytes(s.as_bytes());
            }
            None => self.u8(0),
        }
    }
    pub(crate) fn table(&mut self, t: &FieldTable) {
        self.u32(u32::try_from(t.len()).unwrap_or(u32::MAX));
        for (k, v) in t {
            self.bytes(k.as_bytes());
            self.value(v);
        }
    }
    fn value(&mut self, v: &FieldValue) {
        match v {
            FieldValue::Bool(b) => {
                self.u8(b't');
                self.u8(u8::from(*b));
            }
            FieldValue::I8(n) => {
                self.u8(b'b');
                self.0.extend_from_slice(&n.to_le_bytes());
            }
            FieldValue::U8(n) => {
                self.u8(b'B');
                self.u8(*n);
            }
            FieldValue::I16(n) => {
                self.u8(b's');
                self.0.extend_from_slice(&n.to_le_bytes());
            }
            FieldValue::U16(n) => {
                self.u8(b'u');
                self.0.extend_from_slice(&n.to_le_bytes());
            }
            FieldValue::I32(n) => {
                self.u8(b'I');
                self.0.extend_from_slice(&n.to_le_bytes());
            }
            FieldValue::U32(n) => {
                self.u8(b'i');
                self.u32(*n);
            }
            FieldValue::I64(n) => {
                self.u8(b'l');
                self.0.extend_from_slice(&n.to_le_bytes());
            }
            FieldValue::F32(n) => {
                self.u8(b'f');
                self.0.extend_from_slice(&n.to_le_bytes());
            }
            FieldValue::F64(n) => {
                self.u8(b'd');
                self.0.extend_from_slice(&n.to_le_bytes());
            }
            FieldValue::Decimal { scale, value } => {
                self.u8(b'D');
                self.u8(*scale);
                self.u32(*value);
            }
            FieldValue::ShortString(s) => {
                self.u8(SHORT_STRING);
                self.bytes(s.as_bytes());
            }
            FieldValue::LongString(b) => {
                self.u8(b'S');
                self.bytes(b);
            }
            FieldValue::Array(items) => {
                self.u8(b'A');
                self.u32(u32::try_from(items.len()).unwrap_or(u32::MAX));
                for item in items {
                    self.value(item);
                }
            }
            FieldValue::Timestamp(t) => {
                self.u8(b'T');
                self.u64(*t);
            }
            FieldValue::Table(t) => {
                self.u8(b'F');
                self.table(t);
            }
            FieldValue::ByteArray(b) => {
                self.u8(b'x');
                self.bytes(b);
            }
            FieldValue::Void => self.u8(b'V'),
        }
    }
}

pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    /// The whole record, so byte strings can be sliced out without a copy.
    whole: &'a Bytes,
    pos: usize,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(whole: &'a Bytes) -> Reader<'a> {
        Reader {
            buf: whole,
            whole,
            pos: 0,
        }
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let end = self.pos.checked_add(n).ok_or(DecodeError::Truncated)?;
        let s = self.buf.get(self.pos..end).ok_or(DecodeError::Truncated)?;
        self.pos = end;
        Ok(s)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }
    pub(crate) fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }
    pub(crate) fn u32(&mut self) -> Result<u32, DecodeError> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    pub(crate) fn u64(&mut self) -> Result<u64, DecodeError> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    fn len(&mut self) -> Result<usize, DecodeError> {
        usize::try_from(self.u32()?).map_err(|_| DecodeError::Truncated)
    }
    pub(crate) fn bytes(&mut self) -> Result<Bytes, DecodeError> {
        let n = self.len()?;
        let start = self.pos;
        self.take(n)?;
        Ok(self.whole.slice(start..start + n))
    }
    pub(crate) fn string(&mut self) -> Result<String, DecodeError> {
        let n = self.len()?;
        let s = self.take(n)?;
        String::from_utf8(s.to_vec()).map_err(|_| DecodeError::Utf8)
    }
    fn opt_str(&mut self) -> Result<Option<String>, DecodeError> {
        match self.u8()? {
            0 => Ok(None),
            _ => self.string().map(Some),
        }
    }
    pub(crate) fn table(&mut self, depth: usize) -> Result<FieldTable, DecodeError> {
        if depth > MAX_DEPTH {
            return Err(DecodeError::TooDeep);
        }
        let n = self.u32()?;
        let mut t = FieldTable::new();
        for _ in 0..n {
            let k = self.string()?;
            let v = self.value(depth)?;
            t.insert(k, v);
        }
        Ok(t)
    }
    fn value(&mut self, depth: usize) -> Result<FieldValue, DecodeError> {
        Ok(match self.u8()? {
            b't' => FieldValue::Bool(self.u8()? != 0),
            b'b' => FieldValue::I8(i8::from_le_bytes(self.array()?)),
            b'B' => FieldValue::U8(self.u8()?),
            b's' => FieldValue::I16(i16::from_le_bytes(self.array()?)),
            b'u' => FieldValue::U16(u16::from_le_bytes(self.array()?)),
            b'I' => FieldValue::I32(i32::from_le_bytes(self.array()?)),
            b'i' => FieldValue::U32(self.u32()?),
            b'l' => FieldValue::I64(i64::from_le_bytes(self.array()?)),
            b'f' => FieldValue::F32(f32::from_le_bytes(self.array()?)),
            b'd' => FieldValue::F64(f64::from_le_bytes(self.array()?)),
            b'D' => FieldValue::Decimal {
                scale: self.u8()?,
                value: self.u32()?,
            },
            SHORT_STRING => FieldValue::ShortString(self.string()?),
            b'S' => FieldValue::LongString(self.bytes()?),
            b'A' => {
                if depth > MAX_DEPTH {
                    return Err(DecodeError::TooDeep);
                }
                let n = self.u32()?;
                // Each value takes at least one byte: a count beyond the input is corrupt.
                if n as usize > self.buf.len() - self.pos {
                    return Err(DecodeError::Truncated);
                }
                let mut items = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    items.push(self.value(depth + 1)?);
                }
                FieldValue::Array(items)
            }
            b'T' => FieldValue::Timestamp(self.u64()?),
            b'F' => FieldValue::Table(self.table(depth + 1)?),
            b'x' => FieldValue::ByteArray(self.bytes()?),
            b'V' => FieldValue::Void,
            tag => return Err(DecodeError::Tag(tag)),
        })
    }
}

/// Tag of a short string: AMQP has none of its own in RabbitMQ's table grammar, so the store
/// uses 'z' (not an AMQP tag) to keep the distinction lossless.
const SHORT_STRING: u8 = b'z';

/// Encodes `m` into `out`; `with_body: false` leaves the body out (it lives in the shared
/// store).
pub fn encode_message(m: &Message, with_body: bool, out: &mut Vec<u8>) {
    let mut w = Writer(out);
    w.u8(MESSAGE_VERSION);
    w.bytes(m.exchange.as_bytes());
    w.bytes(m.routing_key.as_bytes());
    let p = &m.properties;
    w.opt_str(&p.content_type);
    w.opt_str(&p.content_encoding);
    match &p.headers {
        Some(h) => {
            w.u8(1);
            w.table(h);
        }
        None => w.u8(0),
    }
    w.u8(p.delivery_mode.unwrap_or(0));
    w.u8(p.priority.map_or(0, |v| v.saturating_add(1)));
    w.opt_str(&p.correlation_id);
    w.opt_str(&p.reply_to);
    w.opt_str(&p.expiration);
    w.opt_str(&p.message_id);
    match p.timestamp {
        Some(t) => {
            w.u8(1);
            w.u64(t);
        }
        None => w.u8(0),
    }
    w.opt_str(&p.kind);
    w.opt_str(&p.user_id);
    w.opt_str(&p.app_id);
    w.opt_str(&p.cluster_id);
    if with_body {
        w.u8(1);
        w.bytes(&m.body);
    } else {
        w.u8(0);
    }
}

/// Decodes a message; `body` supplies the body when the record has none (shared store).
pub fn decode_message(record: &Bytes, body: Option<Bytes>) -> Result<Message, DecodeError> {
    let mut r = Reader::new(record);
    let version = r.u8()?;
    if version != MESSAGE_VERSION {
        return Err(DecodeError::Version(version));
    }
    let exchange: Arc<str> = Arc::from(r.string()?);
    let routing_key: Arc<str> = Arc::from(r.string()?);
    let content_type = r.opt_str()?;
    let content_encoding = r.opt_str()?;
    let headers = match r.u8()? {
        0 => None,
        _ => Some(r.table(0)?),
    };
    let delivery_mode = match r.u8()? {
        0 => None,
        v => Some(v),
    };
    let priority = match r.u8()? {
        0 => None,
        v => Some(v - 1),
    };
    let correlation_id = r.opt_str()?;
    let reply_to = r.opt_str()?;
    let expiration = r.opt_str()?;
    let message_id = r.opt_str()?;
    let timestamp = match r.u8()? {
        0 => None,
        _ => Some(r.u64()?),
    };
    let kind = r.opt_str()?;
    let user_id = r.opt_str()?;
    let app_id = r.opt_str()?;
    let cluster_id = r.opt_str()?;
    let body = match r.u8()? {
        0 => body.ok_or(DecodeError::Truncated)?,
        _ => r.bytes()?,
    };
    Ok(Message {
        exchange,
        routing_key,
        properties: Properties {
            content_type,
            content_encoding,
            headers,
            delivery_mode,
            priority,
            correlation_id,
            reply_to,
            expiration,
            message_id,
            timestamp,
            kind,
            user_id,
            app_id,
            cluster_id,
        },
        body,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Message {
        let mut headers = FieldTable::new();
        headers.insert("a".into(), FieldValue::I32(-5));
        headers.insert("s".into(), FieldValue::ShortString("short".into()));
        headers.insert(
            "arr".into(),
            FieldValue::Array(vec![FieldValue::Void, FieldValue::string("x")]),
        );
        let mut inner = FieldTable::new();
        inner.insert("f".into(), FieldValue::F64(1.5));
        headers.insert("t".into(), FieldValue::Table(inner));
        Message {
            exchange: "amq.topic".into(),
            routing_key: "a.b".into(),
            properties: Properties {
                content_type: Some("text/plain".into()),
                headers: Some(headers),
                delivery_mode: Some(2),
                priority: Some(0),
                timestamp: Some(42),
                message_id: Some("m1".into()),
                ..Default::default()
            },
            body: Bytes::from_static(b"hello"),
        }
    }

    #[test]
    fn round_trips_with_and_without_body() {
        let m = sample();
        let mut buf = Vec::new();
        encode_message(&m, true, &mut buf);
        assert_eq!(decode_message(&Bytes::from(buf), None), Ok(m.clone()));
        let mut buf = Vec::new();
        encode_message(&m, false, &mut buf);
        assert_eq!(
            decode_message(&Bytes::from(buf), Some(m.body.clone())),
            Ok(m)
        );
    }

    #[test]
    fn every_truncation_is_an_error() {
        let mut buf = Vec::new();
        encode_message(&sample(), true, &mut buf);
        for n in 0..buf.len() {
            assert!(decode_message(&Bytes::copy_from_slice(&buf[..n]), None).is_err());
        }
    }
}
