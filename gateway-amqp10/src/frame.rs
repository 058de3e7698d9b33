//! Frames (part 2.3): a 4-byte size, `doff` (the header's size in 4-byte words, at least 2),
//! the frame type (0 AMQP, 1 SASL), a 2-byte channel, the extended header (skipped), then the
//! body: one performative, and for a `transfer` the message bytes after it. An empty body is
//! a heartbeat. Also the 8-byte protocol headers.

use crate::performatives::{FieldError, Performative, Sasl};
use crate::types::{DecodeError, Decoder, EncodeError, Value, encode_value};
use bytes::{Buf, BufMut, Bytes, BytesMut};

/// `AMQP 0 1 0 0`: the AMQP protocol header.
pub const AMQP_HEADER: [u8; 8] = *b"AMQP\x00\x01\x00\x00";
/// `AMQP 3 1 0 0`: the SASL layer's header.
pub const SASL_HEADER: [u8; 8] = *b"AMQP\x03\x01\x00\x00";
/// The smallest max-frame-size a peer may set (2.7.1).
pub const MIN_MAX_FRAME_SIZE: u32 = 512;

pub const TYPE_AMQP: u8 = 0;
pub const TYPE_SASL: u8 = 1;

/// Why bytes are not a frame, or a frame body not a performative.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("frame of {size} bytes exceeds max-frame-size {max}")]
    TooLarge { size: u32, max: u32 },
    #[error("frame size {0} is smaller than its header")]
    TooSmall(u32),
    #[error("doff {0} is below 2 or beyond the frame")]
    BadDoff(u8),
    #[error("unknown frame type {0}")]
    UnknownType(u8),
    #[error("frame body: {0}")]
    Decode(#[from] DecodeError),
    #[error("frame body: {0}")]
    Field(#[from] FieldError),
}

/// One frame as read: its type, channel and body bytes (without the extended header).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RawFrame {
    pub kind: u8,
    pub channel: u16,
    pub body: Bytes,
}

/// A frame body decoded: a heartbeat, a performative with its payload (the message bytes of
/// a transfer; empty for others), or a SASL frame.
#[derive(Clone, Debug, PartialEq)]
pub enum Body {
    Empty,
    Amqp(Performative, Bytes),
    Sasl(Sasl),
}

impl RawFrame {
    pub fn body(&self) -> Result<Body, FrameError> {
        if self.body.is_empty() {
            return Ok(Body::Empty);
        }
        let mut d = Decoder::new(&self.body);
        let v = d.value()?;
        match self.kind {
            TYPE_AMQP => {
                let p = Performative::from_value(v)?;
                Ok(Body::Amqp(p, self.body.slice(d.pos..)))
            }
            _ => Ok(Body::Sasl(Sasl::from_value(v)?)),
        }
    }
}

/// Takes one frame off the front of `buf`, if it is all there. `max` is the max-frame-size
/// this side announced: a bigger frame is refused before its bytes are waited for.
pub fn decode_frame(buf: &mut BytesMut, max: u32) -> Result<Option<RawFrame>, FrameError> {
    if buf.len() < 8 {
        return Ok(None);
    }
    let size = u32::from_be_bytes([buf[0], buf[1], buf[2], buf[3]]);
    if size < 8 {
        return Err(FrameError::TooSmall(size));
    }
    if size > max {
        return Err(FrameError::TooLarge { size, max });
    }
    let doff = buf[4];
    if doff < 2 || u32::from(doff) * 4 > size {
        return Err(FrameError::BadDoff(doff));
    }
    let kind = buf[5];
    if kind != TYPE_AMQP && kind != TYPE_SASL {
        return Err(FrameError::UnknownType(kind));
    }
    if buf.len() < size as usize {
        return Ok(None);
    }
    let channel = u16::from_be_bytes([buf[6], buf[7]]);
    let mut frame = buf.split_to(size as usize);
    frame.advance(usize::from(doff) * 4);
    Ok(Some(RawFrame {
        kind,
        channel,
        body: frame.freeze(),
    }))
}

fn header(out: &mut BytesMut, size: u32, kind: u8, channel: u16) {
    out.put_u32(size);
    out.put_u8(2);
    out.put_u8(kind);
    out.put_u16(channel);
}

/// Appends an AMQP frame: `perf` then `payload` (a transfer's message bytes, or empty).
pub fn encode_frame(
    out: &mut BytesMut,
    channel: u16,
    perf: &Performative,
    payload: &[u8],
) -> Result<(), EncodeError> {
    encode_raw(out, TYPE_AMQP, channel, &perf.to_value(), payload)
}

/// Appends a SASL frame (always on channel 0).
pub fn encode_sasl(out: &mut BytesMut, frame: &Sasl) -> Result<(), EncodeError> {
    encode_raw(out, TYPE_SASL, 0, &frame.to_value(), &[])
}

fn encode_raw(
    out: &mut BytesMut,
    kind: u8,
    channel: u16,
    v: &Value,
    payload: &[u8],
) -> Result<(), EncodeError> {
    let mut body = BytesMut::new();
    encode_value(&mut body, v)?;
    let size = u32::try_from(8 + body.len() + payload.len()).map_err(|_| EncodeError::TooLarge)?;
    header(out, size, kind, channel);
    out.put_slice(&body);
    out.put_slice(payload);
    Ok(())
}

/// Appends a heartbeat: an empty frame on channel 0.
pub fn encode_heartbeat(out: &mut BytesMut) {
    header(out, 8, TYPE_AMQP, 0);
}
