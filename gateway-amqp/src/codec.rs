//! AMQP 0.9.1 framing: incremental decoding with limits checked before buffering, and
//! encoding into one write buffer per batch.
//!
//! Frame layout: type (u8), channel (u16), payload size (u32), payload, frame-end 0xCE.
//! Methods and content headers are decoded by amq-protocol (spec-generated). The hot frames
//! (basic.deliver, server basic.ack/nack, empty content headers, bodies) are encoded by hand
//! here; tests check them byte for byte against amq-protocol's encoder.

use crate::convert::properties_to_amqp;
use crate::error::GatewayError;
use crate::spec::BadMethod;
use amq_protocol::frame::{AMQPContentHeader, AMQPFrame, gen_frame, parsing::parse_content_header};
use amq_protocol::protocol::{AMQPClass, parse_class};
use bytes::{BufMut, Bytes, BytesMut};
use warren_core::escape::Escaped;
use warren_core::message::Properties;

/// What a client must send first.
pub const PROTOCOL_HEADER: &[u8; 8] = b"AMQP\x00\x00\x09\x01";
pub const FRAME_METHOD: u8 = 1;
pub const FRAME_HEADER: u8 = 2;
pub const FRAME_BODY: u8 = 3;
pub const FRAME_HEARTBEAT: u8 = 8;
pub const FRAME_END: u8 = 0xCE;
/// Header (7 bytes) plus frame-end (1 byte).
pub const FRAME_OVERHEAD: u32 = 8;
const BASIC_CLASS: u16 = 60;

/// One decoded frame.
#[derive(Debug, PartialEq)]
pub enum Frame {
    Method(u16, AMQPClass),
    Header(u16, AMQPContentHeader),
    /// A body chunk, split off the read buffer without copying.
    Body(u16, Bytes),
    Heartbeat(u16),
}

/// Decodes the frame at the front of `buf`. `Ok(None)`: more bytes are needed (and room for
/// them has been reserved). A frame larger than `frame_max` is refused from its header alone.
pub fn decode(buf: &mut BytesMut, frame_max: u32) -> Result<Option<Frame>, GatewayError> {
    let Some(header) = buf.get(..7) else {
        return Ok(None);
    };
    let kind = header[0];
    let channel = u16::from_be_bytes([header[1], header[2]]);
    let size = u32::from_be_bytes([header[3], header[4], header[5], header[6]]);
    if kind == b'A' {
        return Err(GatewayError::Frame(
            "protocol header received after the handshake".into(),
        ));
    }
    if size > frame_max.saturating_sub(FRAME_OVERHEAD) {
        return Err(GatewayError::Frame(format!(
            "frame of {} bytes exceeds the negotiated frame_max {frame_max}",
            u64::from(size) + u64::from(FRAME_OVERHEAD)
        )));
    }
    let total = 7 + size as usize + 1;
    if buf.len() < total {
        buf.reserve(total - buf.len());
        return Ok(None);
    }
    if buf[total - 1] != FRAME_END {
        return Err(GatewayError::Frame(format!(
            "frame end byte 0x{:02X} instead of 0xCE",
            buf[total - 1]
        )));
    }
    let mut frame = buf.split_to(total);
    frame.truncate(total - 1);
    let payload = frame.split_off(7);
    match kind {
        FRAME_METHOD => match parse_class(&payload[..]) {
            Ok(([], method)) => Ok(Some(Frame::Method(channel, method))),
            Ok(_) => Err(GatewayError::Syntax(
                "trailing bytes after method arguments".into(),
            )),
            // The decoder's error is its parser's internals: say what is wrong in the
            // protocol's terms instead.
            Err(_) => Err(bad_method(channel, &payload)),
        },
        FRAME_HEADER => match parse_content_header(&payload[..]) {
            Ok(([], h)) => Ok(Some(Frame::Header(channel, h))),
            Ok(_) => Err(GatewayError::Syntax(
                "trailing bytes after content header".into(),
            )),
            Err(_) => Err(GatewayError::Syntax(format!(
                "cannot decode the content header on channel {channel}"
            ))),
        },
        FRAME_BODY => Ok(Some(Frame::Body(channel, payload.freeze()))),
        FRAME_HEARTBEAT => Ok(Some(Frame::Heartbeat(channel))),
        other => Err(GatewayError::Frame(format!("unknown frame type {other}"))),
    }
}

/// The error for a method frame on `channel` whose `payload` did not decode.
fn bad_method(channel: u16, payload: &[u8]) -> GatewayError {
    match crate::spec::diagnose(payload) {
        BadMethod::NoIds => GatewayError::Frame(format!(
            "method frame of {} bytes on channel {channel} has no class and method ids",
            payload.len()
        )),
        BadMethod::Unknown { class, method } => GatewayError::CommandInvalid(format!(
            "unknown method (class {class}, method {method}) on channel {channel}"
        )),
        BadMethod::NotUtf8 {
            class,
            method,
            name,
            field,
        } => GatewayError::NotUtf8 {
            channel,
            ids: (class, method),
            text: format!("invalid UTF-8 in argument '{field}' of {name}"),
        },
        BadMethod::Malformed { name, .. } => GatewayError::Syntax(format!(
            "cannot decode the arguments of {name} on channel {channel}"
        )),
    }
}

/// Encodes any frame with amq-protocol's generator.
pub fn encode_frame(buf: &mut BytesMut, frame: &AMQPFrame) {
    match cookie_factory::r#gen(gen_frame(frame), Vec::with_capacity(64)) {
        Ok((bytes, _)) => buf.extend_from_slice(&bytes),
        // Generation into a growable Vec only fails on values the core never produces
        // (e.g. a short string over 255 bytes); losing one frame beats a broker panic.
        Err(e) => tracing::error!(
            "cannot encode {}: {}",
            Escaped(&frame.to_string()),
            Escaped(&format!("{e:?}"))
        ),
    }
}

pub fn encode_method(buf: &mut BytesMut, channel: u16, method: AMQPClass) {
    encode_frame(buf, &AMQPFrame::Method(channel, method));
}

pub fn encode_heartbeat(buf: &mut BytesMut) {
    buf.put_slice(&[FRAME_HEARTBEAT, 0, 0, 0, 0, 0, 0, FRAME_END]);
}

fn put_short_str(buf: &mut BytesMut, s: &str) {
    // Every name reaching here arrived as a short string or was generated short.
    let bytes = &s.as_bytes()[..s.len().min(255)];
    buf.put_u8(bytes.len() as u8);
    buf.put_slice(bytes);
}

/// Writes a method frame whose arguments `args` appends; patches in the size afterwards.
fn put_method(
    buf: &mut BytesMut,
    channel: u16,
    class: u16,
    method: u16,
    args: impl FnOnce(&mut BytesMut),
) {
    buf.put_u8(FRAME_METHOD);
    buf.put_u16(channel);
    let size_at = buf.len();
    buf.put_u32(0);
    buf.put_u16(class);
    buf.put_u16(method);
    args(buf);
    let size = (buf.len() - size_at - 4) as u32;
    buf[size_at..size_at + 4].copy_from_slice(&size.to_be_bytes());
    buf.put_u8(FRAME_END);
}

/// basic.deliver (60, 60).
pub fn encode_deliver(
    buf: &mut BytesMut,
    channel: u16,
    consumer_tag: &str,
    delivery_tag: u64,
    redelivered: bool,
    exchange: &str,
    routing_key: &str,
) {
    put_method(buf, channel, BASIC_CLASS, 60, |b| {
        put_short_str(b, consumer_tag);
        b.put_u64(delivery_tag);
        b.put_u8(u8::from(redelivered));
        put_short_str(b, exchange);
        put_short_str(b, routing_key);
    });
}

/// Server-sent basic.ack (60, 80) or basic.nack (60, 120) for publisher confirms.
pub fn encode_confirm(buf: &mut BytesMut, channel: u16, seq: u64, multiple: bool, ack: bool) {
    let method = if ack { 80 } else { 120 };
    put_method(buf, channel, BASIC_CLASS, method, |b| {
        b.put_u64(seq);
        b.put_u8(u8::from(multiple));
    });
}

/// A content header and the body frames, split to fit `frame_max`.
pub fn encode_content(
    buf: &mut BytesMut,
    channel: u16,
    properties: &Properties,
    body: &Bytes,
    frame_max: u32,
) {
    if *properties == Properties::default() {
        // The common case costs no conversion: class, weight, size, empty property flags.
        buf.put_u8(FRAME_HEADER);
        buf.put_u16(channel);
        buf.put_u32(14);
        buf.put_u16(BASIC_CLASS);
        buf.put_u16(0);
        buf.put_u64(body.len() as u64);
        buf.put_u16(0);
        buf.put_u8(FRAME_END);
    } else {
        encode_frame(
            buf,
            &AMQPFrame::Header(
                channel,
                AMQPContentHeader {
                    class_id: BASIC_CLASS,
                    body_size: body.len() as u64,
                    properties: properties_to_amqp(properties),
                },
            ),
        );
    }
    let chunk = frame_max.saturating_sub(FRAME_OVERHEAD).max(1) as usize;
    for part in body.chunks(chunk) {
        buf.put_u8(FRAME_BODY);
        buf.put_u16(channel);
        buf.put_u32(part.len() as u32);
        buf.put_slice(part);
        buf.put_u8(FRAME_END);
    }
}
