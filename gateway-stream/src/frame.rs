//! Wire primitives of the stream protocol: command keys, response codes, the frame splitter
//! and a bounds-checked reader. Every length read from the wire is checked against what is
//! left of the frame before anything is sliced or allocated, so a declared length past the
//! frame end is a [`DecodeError`], never a panic or an allocation of the declared size.

use bytes::{Buf, Bytes, BytesMut};

/// Command keys (`PROTOCOL.adoc`, "Commands"). A response has the top bit set.
pub mod key {
    pub const DECLARE_PUBLISHER: u16 = 0x0001;
    pub const PUBLISH: u16 = 0x0002;
    pub const PUBLISH_CONFIRM: u16 = 0x0003;
    pub const PUBLISH_ERROR: u16 = 0x0004;
    pub const QUERY_PUBLISHER_SEQUENCE: u16 = 0x0005;
    pub const DELETE_PUBLISHER: u16 = 0x0006;
    pub const SUBSCRIBE: u16 = 0x0007;
    pub const DELIVER: u16 = 0x0008;
    pub const CREDIT: u16 = 0x0009;
    pub const STORE_OFFSET: u16 = 0x000a;
    pub const QUERY_OFFSET: u16 = 0x000b;
    pub const UNSUBSCRIBE: u16 = 0x000c;
    pub const CREATE: u16 = 0x000d;
    pub const DELETE: u16 = 0x000e;
    pub const METADATA: u16 = 0x000f;
    pub const METADATA_UPDATE: u16 = 0x0010;
    pub const PEER_PROPERTIES: u16 = 0x0011;
    pub const SASL_HANDSHAKE: u16 = 0x0012;
    pub const SASL_AUTHENTICATE: u16 = 0x0013;
    pub const TUNE: u16 = 0x0014;
    pub const OPEN: u16 = 0x0015;
    pub const CLOSE: u16 = 0x0016;
    pub const HEARTBEAT: u16 = 0x0017;
    pub const ROUTE: u16 = 0x0018;
    pub const PARTITIONS: u16 = 0x0019;
    pub const CONSUMER_UPDATE: u16 = 0x001a;
    pub const EXCHANGE_COMMAND_VERSIONS: u16 = 0x001b;
    pub const STREAM_STATS: u16 = 0x001c;
    pub const CREATE_SUPER_STREAM: u16 = 0x001d;
    pub const DELETE_SUPER_STREAM: u16 = 0x001e;
    pub const RESOLVE_OFFSET_SPEC: u16 = 0x001f;
    /// The bit that marks a response.
    pub const RESPONSE: u16 = 0x8000;
}

/// Response codes (`PROTOCOL.adoc`, "Response Codes"; 0x14/0x15 from RabbitMQ's header).
pub mod code {
    pub const OK: u16 = 0x01;
    pub const STREAM_DOES_NOT_EXIST: u16 = 0x02;
    pub const SUBSCRIPTION_ID_ALREADY_EXISTS: u16 = 0x03;
    pub const SUBSCRIPTION_ID_DOES_NOT_EXIST: u16 = 0x04;
    pub const STREAM_ALREADY_EXISTS: u16 = 0x05;
    pub const STREAM_NOT_AVAILABLE: u16 = 0x06;
    pub const SASL_MECHANISM_NOT_SUPPORTED: u16 = 0x07;
    pub const AUTHENTICATION_FAILURE: u16 = 0x08;
    pub const SASL_ERROR: u16 = 0x09;
    pub const SASL_CHALLENGE: u16 = 0x0a;
    pub const SASL_AUTHENTICATION_FAILURE_LOOPBACK: u16 = 0x0b;
    pub const VIRTUAL_HOST_ACCESS_FAILURE: u16 = 0x0c;
    pub const UNKNOWN_FRAME: u16 = 0x0d;
    pub const FRAME_TOO_LARGE: u16 = 0x0e;
    pub const INTERNAL_ERROR: u16 = 0x0f;
    pub const ACCESS_REFUSED: u16 = 0x10;
    pub const PRECONDITION_FAILED: u16 = 0x11;
    pub const PUBLISHER_DOES_NOT_EXIST: u16 = 0x12;
    pub const NO_OFFSET: u16 = 0x13;
}

/// Why a frame body could not be decoded. All are answered with `UNKNOWN_FRAME` (0x0d) and a
/// close, as RabbitMQ answers any frame its parser does not match.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum DecodeError {
    #[error("frame truncated: {0} needs more bytes than the frame holds")]
    Truncated(&'static str),
    #[error("unknown command key {key:#06x} version {version}")]
    UnknownCommand { key: u16, version: u16 },
    #[error("{0} trailing bytes after the command")]
    Trailing(usize),
    #[error("string is not UTF-8")]
    Utf8,
    #[error("bad value for {0}")]
    BadValue(&'static str),
}

/// A frame whose declared size is over the negotiated maximum (answered with
/// `FRAME_TOO_LARGE`, 0x0e, and a close).
#[derive(Debug, thiserror::Error, Clone, Copy, PartialEq, Eq)]
#[error("frame of {size} bytes exceeds the maximum of {max}")]
pub struct FrameTooLarge {
    pub size: u32,
    pub max: u32,
}

/// Takes one whole frame body (without its 4-byte size) off the front of `buf`, or `None`
/// while it is incomplete. `max` is the frame-max in force (0: no limit); a declared size over
/// it is refused before any of the body is buffered.
pub fn split_frame(buf: &mut BytesMut, max: u32) -> Result<Option<Bytes>, FrameTooLarge> {
    if buf.len() < 4 {
        return Ok(None);
    }
    let size = u32::from_be_bytes([buf[0], buf[1], buf[2], buf[3]]);
    if max != 0 && size > max {
        return Err(FrameTooLarge { size, max });
    }
    let total = 4 + size as usize;
    if buf.len() < total {
        // Make room for the rest once (bounded by `max`), instead of growing step by step.
        buf.reserve(total - buf.len());
        return Ok(None);
    }
    buf.advance(4);
    Ok(Some(buf.split_to(size as usize).freeze()))
}

/// A bounds-checked cursor over one frame body. Slices share the frame's buffer.
pub struct Reader {
    buf: Bytes,
}

impl Reader {
    pub fn new(buf: Bytes) -> Reader {
        Reader { buf }
    }

    pub fn remaining(&self) -> usize {
        self.buf.len()
    }

    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    fn need(&self, n: usize, what: &'static str) -> Result<(), DecodeError> {
        if self.buf.len() < n {
            Err(DecodeError::Truncated(what))
        } else {
            Ok(())
        }
    }

    pub fn u8(&mut self, what: &'static str) -> Result<u8, DecodeError> {
        self.need(1, what)?;
        Ok(self.buf.get_u8())
    }

    pub fn u16(&mut self, what: &'static str) -> Result<u16, DecodeError> {
        self.need(2, what)?;
        Ok(self.buf.get_u16())
    }

    pub fn i16(&mut self, what: &'static str) -> Result<i16, DecodeError> {
        self.need(2, what)?;
        Ok(self.buf.get_i16())
    }

    pub fn u32(&mut self, what: &'static str) -> Result<u32, DecodeError> {
        self.need(4, what)?;
        Ok(self.buf.get_u32())
    }

    pub fn i32(&mut self, what: &'static str) -> Result<i32, DecodeError> {
        self.need(4, what)?;
        Ok(self.buf.get_i32())
    }

    pub fn u64(&mut self, what: &'static str) -> Result<u64, DecodeError> {
        self.need(8, what)?;
        Ok(self.buf.get_u64())
    }

    pub fn i64(&mut self, what: &'static str) -> Result<i64, DecodeError> {
        self.need(8, what)?;
        Ok(self.buf.get_i64())
    }

    pub fn take(&mut self, n: usize, what: &'static str) -> Result<Bytes, DecodeError> {
        self.need(n, what)?;
        Ok(self.buf.split_to(n))
    }

    /// `string`: int16 length (-1: null, read as empty), then UTF-8 bytes.
    pub fn string(&mut self, what: &'static str) -> Result<String, DecodeError> {
        let len = self.i16(what)?;
        if len < 0 {
            return Ok(String::new());
        }
        let bytes = self.take(len as usize, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| DecodeError::Utf8)
    }

    /// `string` that may be null (-1).
    pub fn opt_string(&mut self, what: &'static str) -> Result<Option<String>, DecodeError> {
        let len = self.i16(what)?;
        if len < 0 {
            return Ok(None);
        }
        let bytes = self.take(len as usize, what)?;
        String::from_utf8(bytes.to_vec())
            .map(Some)
            .map_err(|_| DecodeError::Utf8)
    }

    /// `bytes`: int32 length (-1: null, read as empty), then the bytes.
    pub fn bytes(&mut self, what: &'static str) -> Result<Bytes, DecodeError> {
        let len = self.i32(what)?;
        if len < 0 {
            return Ok(Bytes::new());
        }
        self.take(len as usize, what)
    }

    /// An array count, checked against the bytes left: each element takes at least
    /// `min_size` bytes, so a count the frame cannot hold is refused here, and what the
    /// caller reserves from it is bounded by the frame.
    pub fn count(&mut self, min_size: usize, what: &'static str) -> Result<usize, DecodeError> {
        let n = self.i32(what)?;
        if n < 0 {
            return Err(DecodeError::BadValue(what));
        }
        let n = n as usize;
        if n.saturating_mul(min_size.max(1)) > self.buf.len() {
            return Err(DecodeError::Truncated(what));
        }
        Ok(n)
    }

    /// Ends the command: anything left is a malformed frame.
    pub fn end(self) -> Result<(), DecodeError> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(DecodeError::Trailing(self.buf.len()))
        }
    }
}

/// Writes a `string` (int16 length). Longer strings cannot be sent: they are cut at the
/// last char boundary within `i16::MAX` bytes (only server-made strings get here).
pub fn put_string(out: &mut BytesMut, s: &str) {
    use bytes::BufMut;
    let mut end = s.len().min(i16::MAX as usize);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    out.put_i16(end as i16);
    out.put_slice(&s.as_bytes()[..end]);
}

/// Writes `bytes` (int32 length).
pub fn put_bytes(out: &mut BytesMut, b: &[u8]) {
    use bytes::BufMut;
    out.put_i32(b.len() as i32);
    out.put_slice(b);
}

/// Writes a `[Key Value]` string map.
pub fn put_map(out: &mut BytesMut, map: &[(String, String)]) {
    use bytes::BufMut;
    out.put_i32(map.len() as i32);
    for (k, v) in map {
        put_string(out, k);
        put_string(out, v);
    }
}

/// Reads a `[Key Value]` string map.
pub fn read_map(r: &mut Reader, what: &'static str) -> Result<Vec<(String, String)>, DecodeError> {
    let n = r.count(4, what)?;
    let mut map = Vec::with_capacity(n);
    for _ in 0..n {
        let k = r.string(what)?;
        let v = r.string(what)?;
        map.push((k, v));
    }
    Ok(map)
}

/// Reads a `[string]` list.
pub fn read_strings(r: &mut Reader, what: &'static str) -> Result<Vec<String>, DecodeError> {
    let n = r.count(2, what)?;
    let mut list = Vec::with_capacity(n);
    for _ in 0..n {
        list.push(r.string(what)?);
    }
    Ok(list)
}
