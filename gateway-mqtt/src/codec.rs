//! Framing and the v3 <-> v5 packet bridge over `mqtt-proto`.
//!
//! The fixed header is parsed here, so a packet larger than the maximum packet size is refused
//! from its first bytes, before its body is buffered. Complete packets are decoded by
//! `mqtt-proto` (v3 or v5 codec per the protocol level of CONNECT). Inside the gateway every
//! packet is a v5 packet: v3 packets are lifted on decode and lowered on encode, so the session
//! state machine has one vocabulary; what v3 cannot express (properties, reason codes other
//! than the v3 return codes, server DISCONNECT) is dropped at the edge.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use mqtt_proto::v5::{self, DisconnectReasonCode};
use mqtt_proto::{Pid, QoS, QosPid, TopicFilter, v3};

/// MQTT protocol levels: 3 = MQTT 3.1, 4 = 3.1.1, 5 = 5.0.
pub type Level = u8;

/// Why a byte stream could not be decoded. Each maps to a v5 DISCONNECT reason.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CodecError {
    #[error("malformed packet: {0}")]
    Malformed(String),
    #[error("packet of {size} bytes over the maximum of {max}")]
    TooLarge { size: usize, max: usize },
    #[error("protocol error: {0}")]
    Protocol(String),
    #[error("unsupported protocol level {0}")]
    UnsupportedLevel(u8),
}

impl CodecError {
    pub fn reason(&self) -> DisconnectReasonCode {
        match self {
            CodecError::Malformed(_) => DisconnectReasonCode::MalformedPacket,
            CodecError::TooLarge { .. } => DisconnectReasonCode::PacketTooLarge,
            CodecError::Protocol(_) | CodecError::UnsupportedLevel(_) => {
                DisconnectReasonCode::ProtocolError
            }
        }
    }
}

/// A decoded client packet. SUBSCRIBE is special: `mqtt-proto` rejects a whole SUBSCRIBE when
/// one filter is invalid, but MQTT wants that filter refused in the SUBACK (0x80 / 0x8F) and the
/// others granted, so such packets are parsed here with the invalid filters kept as `None`.
// Unboxed: a decoded packet lives on the stack only until the session consumes it.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum Decoded {
    Packet(v5::Packet),
    Subscribe(Subscribe),
}

/// A SUBSCRIBE whose invalid filters are `None`.
#[derive(Debug, Clone, PartialEq)]
pub struct Subscribe {
    pub pid: Pid,
    pub subscription_id: Option<u32>,
    pub entries: Vec<(Option<TopicFilter>, v5::SubscriptionOptions)>,
}

impl From<v5::Subscribe> for Subscribe {
    fn from(s: v5::Subscribe) -> Subscribe {
        Subscribe {
            pid: s.pid,
            subscription_id: s.properties.subscription_id.map(|v| v.value()),
            entries: s.topics.into_iter().map(|(f, o)| (Some(f), o)).collect(),
        }
    }
}

/// The length of the fixed header and of the whole packet at the start of `buf`, or `None`
/// when the fixed header is still incomplete.
pub fn frame_len(buf: &[u8]) -> Result<Option<(usize, usize)>, CodecError> {
    let mut remaining: usize = 0;
    for i in 0..4 {
        let Some(&b) = buf.get(1 + i) else {
            return Ok(None);
        };
        remaining |= usize::from(b & 0x7f) << (7 * i);
        if b & 0x80 == 0 {
            let header = 2 + i;
            return Ok(Some((header, header + remaining)));
        }
    }
    Err(CodecError::Malformed(
        "remaining length over 4 bytes".into(),
    ))
}

/// The bit Mosquitto's bridges set in CONNECT's protocol level (`try_private true`, their
/// default: 0x83 for 3.1, 0x84 for 3.1.1), asking to be treated as a bridge: no copy of its
/// own publishes sent back, retain flags as published.
const BRIDGE_BIT: u8 = 0x80;

/// Whether the CONNECT at the front of `buf` carries the bridge bit; clears it if so, so
/// the frame decodes as the plain 3.1 / 3.1.1 CONNECT it is. Call it before [`decode`] on
/// the first packet, with whatever has arrived (false until the level byte is in).
pub fn take_bridge_bit(buf: &mut BytesMut) -> bool {
    let Ok(Some((header, _))) = frame_len(buf) else {
        return false;
    };
    if buf.first().map(|b| b >> 4) != Some(1) {
        return false;
    }
    let Some(name_len) = buf
        .get(header..header + 2)
        .map(|n| usize::from(u16::from_be_bytes([n[0], n[1]])))
    else {
        return false;
    };
    let at = header + 2 + name_len;
    let (Some(name), Some(&level)) = (buf.get(header + 2..at), buf.get(at)) else {
        return false;
    };
    let bridged = matches!((name, level), (b"MQIsdp", 0x83) | (b"MQTT", 0x84));
    if bridged {
        buf[at] = level & !BRIDGE_BIT;
    }
    bridged
}

/// Decodes the next complete packet from `buf` (consuming it), `None` when more bytes are
/// needed. `level` is `None` until CONNECT has been decoded: the first packet must be CONNECT.
pub fn decode(
    buf: &mut BytesMut,
    level: Option<Level>,
    max_packet: usize,
) -> Result<Option<Decoded>, CodecError> {
    let Some((header_len, total)) = frame_len(buf)? else {
        return Ok(None);
    };
    if total > max_packet {
        return Err(CodecError::TooLarge {
            size: total,
            max: max_packet,
        });
    }
    if buf.len() < total {
        // Reserve once for the whole packet rather than growing in steps.
        buf.reserve(total - buf.len());
        return Ok(None);
    }
    let frame = &buf[..total];
    let packet_type = frame[0] >> 4;
    let level = match level {
        Some(l) => l,
        None => {
            if packet_type != 1 {
                return Err(CodecError::Protocol(format!(
                    "first packet has type {packet_type}, not CONNECT"
                )));
            }
            connect_level(frame)?
        }
    };
    if level != 5 && packet_type == 15 {
        return Err(CodecError::Malformed("AUTH before MQTT 5".into()));
    }
    if level != 5 && packet_type == 3 {
        let p = decode_v3_publish(frame, header_len).map_err(|e| match e {
            mqtt_proto::Error::IoError(mqtt_proto::IoErrorKind::UnexpectedEof) => {
                CodecError::Malformed("truncated packet body".into())
            }
            e => CodecError::Malformed(e.to_string()),
        })?;
        buf.advance(total);
        return Ok(Some(Decoded::Packet(v5::Packet::Publish(p))));
    }
    let bad_filter = |e: &mqtt_proto::Error| matches!(e, mqtt_proto::Error::InvalidTopicFilter(_));
    let packet = if level == 5 {
        match v5::Packet::decode(frame) {
            Ok(Some(p)) => p,
            Ok(None) => return Err(CodecError::Malformed("truncated packet body".into())),
            Err(v5::ErrorV5::Common(e)) if packet_type == 8 && bad_filter(&e) => {
                let s = lenient_subscribe(frame, level)?;
                buf.advance(total);
                return Ok(Some(Decoded::Subscribe(s)));
            }
            Err(e) => return Err(CodecError::Malformed(e.to_string())),
        }
    } else {
        match v3::Packet::decode(frame) {
            Ok(Some(p)) => lift(p),
            Ok(None) => return Err(CodecError::Malformed("truncated packet body".into())),
            Err(e) if packet_type == 8 && bad_filter(&e) => {
                let s = lenient_subscribe(frame, level)?;
                buf.advance(total);
                return Ok(Some(Decoded::Subscribe(s)));
            }
            Err(e) => return Err(CodecError::Malformed(e.to_string())),
        }
    };
    buf.advance(total);
    Ok(Some(match packet {
        v5::Packet::Subscribe(s) => Decoded::Subscribe(s.into()),
        p => Decoded::Packet(p),
    }))
}

/// A v3 PUBLISH straight from its frame (`header_len` bytes of fixed header, then the body),
/// with `mqtt-proto`'s checks and errors: its own decoder reads through an async reader on a
/// thread-local executor per packet, copies the topic twice and zero-fills the payload
/// before copying it, and PUBLISH is nearly every packet a busy broker reads. The topic name
/// comes from [`convert::topic_name`]'s one-entry cache (a publisher repeats its topic).
fn decode_v3_publish(frame: &[u8], header_len: usize) -> Result<v5::Publish, mqtt_proto::Error> {
    let eof = || mqtt_proto::Error::IoError(mqtt_proto::IoErrorKind::UnexpectedEof);
    let first = frame.first().copied().ok_or_else(eof)?;
    let qos = QoS::from_u8((first & 0b110) >> 1)?;
    let body = frame.get(header_len..).ok_or_else(eof)?;
    let (len, rest) = body.split_first_chunk::<2>().ok_or_else(eof)?;
    let topic_len = usize::from(u16::from_be_bytes(*len));
    let topic = rest.get(..topic_len).ok_or_else(eof)?;
    let topic = std::str::from_utf8(topic).map_err(|_| mqtt_proto::Error::InvalidString)?;
    let mut payload = &rest[topic_len..];
    let qos_pid = match qos {
        QoS::Level0 => QosPid::Level0,
        qos => {
            let (pid, rest) = payload.split_first_chunk::<2>().ok_or_else(eof)?;
            payload = rest;
            let pid = Pid::try_from(u16::from_be_bytes(*pid))?;
            if qos == QoS::Level1 {
                QosPid::Level1(pid)
            } else {
                QosPid::Level2(pid)
            }
        }
    };
    Ok(v5::Publish {
        dup: first & 0b1000 != 0,
        retain: first & 1 == 1,
        qos_pid,
        topic_name: crate::convert::topic_name(topic)?,
        // A copy: sharing the read buffer would keep a whole read alive for a small
        // message that waits in a queue.
        payload: Bytes::copy_from_slice(payload),
        properties: Default::default(),
    })
}

fn take<'a>(b: &mut &'a [u8], n: usize) -> Result<&'a [u8], CodecError> {
    if b.len() < n {
        return Err(CodecError::Malformed("SUBSCRIBE truncated".into()));
    }
    let (head, rest) = b.split_at(n);
    *b = rest;
    Ok(head)
}

fn take_u16(b: &mut &[u8]) -> Result<u16, CodecError> {
    let x = take(b, 2)?;
    Ok(u16::from_be_bytes([x[0], x[1]]))
}

fn take_var_int(b: &mut &[u8]) -> Result<u32, CodecError> {
    let mut v: u32 = 0;
    for i in 0..4 {
        let byte = take(b, 1)?[0];
        v |= u32::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            return Ok(v);
        }
    }
    Err(CodecError::Malformed(
        "variable byte integer over 4 bytes".into(),
    ))
}

fn take_str<'a>(b: &mut &'a [u8]) -> Result<&'a str, CodecError> {
    let n = usize::from(take_u16(b)?);
    std::str::from_utf8(take(b, n)?).map_err(|_| CodecError::Malformed("invalid UTF-8".into()))
}

/// Parses a SUBSCRIBE that `mqtt-proto` refused because of an invalid filter. Everything
/// else is checked as strictly as `mqtt-proto` does (flags, UTF-8, option bits).
fn lenient_subscribe(frame: &[u8], level: Level) -> Result<Subscribe, CodecError> {
    if frame[0] != 0x82 {
        return Err(CodecError::Malformed("SUBSCRIBE flags".into()));
    }
    let (header, _) = frame_len(frame)?.ok_or_else(|| CodecError::Malformed("SUBSCRIBE".into()))?;
    let mut b = &frame[header..];
    let pid = Pid::try_from(take_u16(&mut b)?)
        .map_err(|_| CodecError::Malformed("packet id 0".into()))?;
    let mut subscription_id = None;
    if level == 5 {
        let len = take_var_int(&mut b)? as usize;
        let mut props = take(&mut b, len)?;
        while !props.is_empty() {
            match take(&mut props, 1)?[0] {
                0x0B => subscription_id = Some(take_var_int(&mut props)?),
                0x26 => {
                    take_str(&mut props)?;
                    take_str(&mut props)?;
                }
                id => return Err(CodecError::Malformed(format!("SUBSCRIBE property {id:#x}"))),
            }
        }
    }
    let mut entries = Vec::new();
    while !b.is_empty() {
        let filter = take_str(&mut b)?;
        let opts = take(&mut b, 1)?[0];
        let reserved = if level == 5 { 0xC0 } else { 0xFC };
        if opts & reserved != 0 || opts & 0x03 == 3 || (opts >> 4) & 0x03 == 3 {
            return Err(CodecError::Malformed(format!(
                "subscription options {opts:#x}"
            )));
        }
        let options = v5::SubscriptionOptions {
            max_qos: qos_from(opts & 0x03),
            no_local: level == 5 && opts & 0x04 != 0,
            retain_as_published: level == 5 && opts & 0x08 != 0,
            retain_handling: match (opts >> 4) & 0x03 {
                0 => v5::RetainHandling::SendAtSubscribe,
                1 => v5::RetainHandling::SendAtSubscribeIfNotExist,
                _ => v5::RetainHandling::DoNotSend,
            },
        };
        entries.push((TopicFilter::try_from(filter).ok(), options));
    }
    if entries.is_empty() {
        return Err(CodecError::Protocol("SUBSCRIBE without filters".into()));
    }
    Ok(Subscribe {
        pid,
        subscription_id,
        entries,
    })
}

/// The protocol level byte of a complete CONNECT frame.
fn connect_level(frame: &[u8]) -> Result<Level, CodecError> {
    let (header, _) = frame_len(frame)?.ok_or_else(|| CodecError::Malformed("CONNECT".into()))?;
    let body = &frame[header..];
    let name_len = match body {
        [hi, lo, ..] => usize::from(u16::from_be_bytes([*hi, *lo])),
        _ => {
            return Err(CodecError::Malformed(
                "CONNECT without protocol name".into(),
            ));
        }
    };
    let level = *body
        .get(2 + name_len)
        .ok_or_else(|| CodecError::Malformed("CONNECT without protocol level".into()))?;
    let name = &body[2..2 + name_len];
    match (name, level) {
        (b"MQIsdp", 3) | (b"MQTT", 4) | (b"MQTT", 5) => Ok(level),
        (b"MQIsdp", l) | (b"MQTT", l) => Err(CodecError::UnsupportedLevel(l)),
        _ => Err(CodecError::Protocol("unknown protocol name".into())),
    }
}

/// Lifts a v3 packet into the v5 vocabulary.
fn lift(p: v3::Packet) -> v5::Packet {
    use v5::Packet as P;
    match p {
        v3::Packet::Connect(c) => P::Connect(v5::Connect {
            protocol: c.protocol,
            clean_start: c.clean_session,
            keep_alive: c.keep_alive,
            properties: v5::ConnectProperties {
                // A 3.1.1 session without clean-session lives until the client cleans it.
                session_expiry_interval: Some(if c.clean_session { 0 } else { u32::MAX }),
                ..Default::default()
            },
            client_id: c.client_id,
            last_will: c.last_will.map(|w| v5::LastWill {
                qos: w.qos,
                retain: w.retain,
                topic_name: w.topic_name,
                payload: w.message,
                properties: Default::default(),
            }),
            username: c.username,
            password: c.password,
        }),
        v3::Packet::Connack(c) => P::Connack(v5::Connack::new(
            c.session_present,
            v5::ConnectReasonCode::Success,
        )),
        v3::Packet::Publish(p) => P::Publish(v5::Publish {
            dup: p.dup,
            retain: p.retain,
            qos_pid: p.qos_pid,
            topic_name: p.topic_name,
            payload: p.payload,
            properties: Default::default(),
        }),
        v3::Packet::Puback(pid) => P::Puback(v5::Puback::new_success(pid)),
        v3::Packet::Pubrec(pid) => P::Pubrec(v5::Pubrec::new_success(pid)),
        v3::Packet::Pubrel(pid) => P::Pubrel(v5::Pubrel::new_success(pid)),
        v3::Packet::Pubcomp(pid) => P::Pubcomp(v5::Pubcomp::new_success(pid)),
        v3::Packet::Subscribe(s) => P::Subscribe(v5::Subscribe::new(
            s.pid,
            s.topics
                .into_iter()
                .map(|(f, qos)| {
                    (
                        f,
                        v5::SubscriptionOptions {
                            max_qos: qos,
                            no_local: false,
                            // v3 subscribers always get live messages without the retain flag.
                            retain_as_published: false,
                            retain_handling: v5::RetainHandling::SendAtSubscribe,
                        },
                    )
                })
                .collect(),
        )),
        v3::Packet::Suback(s) => P::Suback(v5::Suback::new(s.pid, Vec::new())),
        v3::Packet::Unsubscribe(u) => P::Unsubscribe(v5::Unsubscribe::new(u.pid, u.topics)),
        v3::Packet::Unsuback(pid) => P::Unsuback(v5::Unsuback::new(pid, Vec::new())),
        v3::Packet::Pingreq => P::Pingreq,
        v3::Packet::Pingresp => P::Pingresp,
        v3::Packet::Disconnect => P::Disconnect(v5::Disconnect::new_normal()),
    }
}

/// Lowers a server packet to v3; `None` for packets v3 cannot carry (server DISCONNECT, AUTH).
fn lower(p: &v5::Packet) -> Option<v3::Packet> {
    use v5::Packet as P;
    Some(match p {
        P::Connack(c) => v3::Packet::Connack(v3::Connack {
            session_present: c.session_present,
            code: v3_return_code(c.reason_code),
        }),
        P::Publish(p) => v3::Packet::Publish(v3::Publish {
            dup: p.dup,
            retain: p.retain,
            qos_pid: p.qos_pid,
            topic_name: p.topic_name.clone(),
            payload: p.payload.clone(),
        }),
        P::Puback(a) => v3::Packet::Puback(a.pid),
        P::Pubrec(a) => v3::Packet::Pubrec(a.pid),
        P::Pubrel(a) => v3::Packet::Pubrel(a.pid),
        P::Pubcomp(a) => v3::Packet::Pubcomp(a.pid),
        P::Suback(s) => v3::Packet::Suback(v3::Suback {
            pid: s.pid,
            topics: s
                .topics
                .iter()
                .map(|c| match c {
                    v5::SubscribeReasonCode::GrantedQoS0 => v3::SubscribeReturnCode::MaxLevel0,
                    v5::SubscribeReasonCode::GrantedQoS1 => v3::SubscribeReturnCode::MaxLevel1,
                    v5::SubscribeReasonCode::GrantedQoS2 => v3::SubscribeReturnCode::MaxLevel2,
                    _ => v3::SubscribeReturnCode::Failure,
                })
                .collect(),
        }),
        P::Unsuback(u) => v3::Packet::Unsuback(u.pid),
        P::Pingresp => v3::Packet::Pingresp,
        P::Pingreq => v3::Packet::Pingreq,
        P::Connect(_) | P::Subscribe(_) | P::Unsubscribe(_) | P::Disconnect(_) | P::Auth(_) => {
            return None;
        }
    })
}

/// The v3 CONNACK return code closest to a v5 reason code.
pub fn v3_return_code(code: v5::ConnectReasonCode) -> v3::ConnectReturnCode {
    use v3::ConnectReturnCode as R;
    use v5::ConnectReasonCode as C;
    match code {
        C::Success => R::Accepted,
        C::UnsupportedProtocolVersion => R::UnacceptableProtocolVersion,
        C::ClientIdentifierNotValid => R::IdentifierRejected,
        C::BadUserNameOrPassword => R::BadUserNameOrPassword,
        C::NotAuthorized | C::BadAuthMethod | C::Banned => R::NotAuthorized,
        _ => R::ServerUnavailable,
    }
}

/// Appends the encoding of `p` for a client at `level`. Returns false when the packet has no
/// encoding at that level (it is skipped) or cannot be encoded.
pub fn encode(p: &v5::Packet, level: Level, out: &mut BytesMut) -> bool {
    if level != 5
        && let v5::Packet::Suback(s) = p
    {
        encode_v3_suback(s, out);
        return true;
    }
    if let v5::Packet::Publish(p) = p {
        return match encode_publish(p, level, out) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!("cannot encode PUBLISH: {e}");
                false
            }
        };
    }
    let bytes = if level == 5 {
        p.encode()
    } else {
        match lower(p) {
            Some(p3) => p3.encode(),
            None => return false,
        }
    };
    match bytes {
        Ok(b) => {
            out.extend_from_slice(b.as_ref());
            true
        }
        Err(e) => {
            tracing::warn!("cannot encode {:?}: {e}", p.get_type());
            false
        }
    }
}

/// The largest remaining length MQTT can express (four bytes of variable byte integer).
const MAX_REMAINING: usize = 268_435_455;

/// A PUBLISH appended to `out` as the client's level frames it, with no intermediate buffer
/// (`mqtt-proto`'s `Packet::encode` builds each packet in a `Vec` of its own, and at v3
/// first clones the packet into its v3 form): most packets a broker writes are these.
fn encode_publish(
    p: &v5::Publish,
    level: Level,
    out: &mut BytesMut,
) -> Result<(), mqtt_proto::Error> {
    use mqtt_proto::Encodable;
    let topic = p.topic_name.as_bytes();
    let topic_len = u16::try_from(topic.len()).map_err(|_| mqtt_proto::Error::InvalidString)?;
    let (qos, pid) = match p.qos_pid {
        QosPid::Level0 => (0u8, None),
        QosPid::Level1(pid) => (1, Some(pid)),
        QosPid::Level2(pid) => (2, Some(pid)),
    };
    let remaining = if level == 5 {
        p.encode_len()
    } else {
        2 + topic.len() + if pid.is_some() { 2 } else { 0 } + p.payload.len()
    };
    if remaining > MAX_REMAINING {
        return Err(mqtt_proto::Error::InvalidRemainingLength);
    }
    out.reserve(5 + remaining);
    out.put_u8(0x30 | (u8::from(p.dup) << 3) | (qos << 1) | u8::from(p.retain));
    let mut n = remaining;
    loop {
        let byte = (n % 128) as u8;
        n /= 128;
        out.put_u8(if n > 0 { byte | 0x80 } else { byte });
        if n == 0 {
            break;
        }
    }
    if level == 5 {
        return p.encode(&mut (&mut *out).writer());
    }
    out.put_u16(topic_len);
    out.put_slice(topic);
    if let Some(pid) = pid {
        out.put_u16(pid.value());
    }
    out.put_slice(&p.payload);
    Ok(())
}

/// Bytes `o` will likely take on the wire: what a write buffer reserves for it, so a flush of
/// many packets grows its buffer once instead of by repeated doubling (each a copy).
pub fn size_hint(o: &Out) -> usize {
    match &o.packet {
        v5::Packet::Publish(p) => 8 + p.topic_name.len() + p.payload.len(),
        _ => 8,
    }
}

/// mqtt-proto 0.4 encodes the v3 SUBACK failure code as its enum discriminant (3) instead of
/// 0x80 (MQTT-3.9.3), which clients read as an invalid QoS: v3 SUBACKs are encoded here.
fn encode_v3_suback(s: &v5::Suback, out: &mut BytesMut) {
    let codes = s.topics.iter().map(|c| match c {
        v5::SubscribeReasonCode::GrantedQoS0 => 0x00,
        v5::SubscribeReasonCode::GrantedQoS1 => 0x01,
        v5::SubscribeReasonCode::GrantedQoS2 => 0x02,
        _ => 0x80,
    });
    let mut remaining = 2 + s.topics.len();
    out.extend_from_slice(&[0x90]);
    // Variable byte integer (a SUBACK answers a SUBSCRIBE that fit the packet limit).
    loop {
        let mut byte = (remaining % 128) as u8;
        remaining /= 128;
        if remaining > 0 {
            byte |= 0x80;
        }
        out.extend_from_slice(&[byte]);
        if remaining == 0 {
            break;
        }
    }
    out.extend_from_slice(&s.pid.value().to_be_bytes());
    out.extend(codes);
}

/// A packet to send. A PUBLISH matching several of the client's subscriptions carries the
/// Subscription Identifier of each (MQTT-3.3.4-3): `mqtt-proto` 0.4 holds one, in
/// `subscription_id`; the others ride in `more_sub_ids` and are encoded by [`encode_out`].
#[derive(Debug, Clone, PartialEq)]
pub struct Out {
    pub packet: v5::Packet,
    pub more_sub_ids: Vec<u32>,
}

impl From<v5::Packet> for Out {
    fn from(packet: v5::Packet) -> Out {
        Out {
            packet,
            more_sub_ids: Vec::new(),
        }
    }
}

impl std::ops::Deref for Out {
    type Target = v5::Packet;
    fn deref(&self) -> &v5::Packet {
        &self.packet
    }
}

/// Appends the encoding of `o` for a client at `level` (see [`encode`]).
pub fn encode_out(o: &Out, level: Level, out: &mut BytesMut) -> bool {
    match &o.packet {
        v5::Packet::Publish(p) if level == 5 && !o.more_sub_ids.is_empty() => {
            match encode_publish_ids(p, &o.more_sub_ids) {
                Ok(b) => {
                    out.extend_from_slice(&b);
                    true
                }
                Err(e) => {
                    tracing::warn!("cannot encode PUBLISH: {e}");
                    false
                }
            }
        }
        p => encode(p, level, out),
    }
}

/// The encoded size of `o` at `level` (for the client's maximum packet size).
pub fn out_len(o: &Out, level: Level) -> usize {
    match &o.packet {
        v5::Packet::Publish(p) if level == 5 && !o.more_sub_ids.is_empty() => {
            encode_publish_ids(p, &o.more_sub_ids).map_or(usize::MAX, |b| b.len())
        }
        p => encoded_len(p, level),
    }
}

fn put_var_int(out: &mut Vec<u8>, mut n: usize) {
    loop {
        let mut byte = (n % 128) as u8;
        n /= 128;
        if n > 0 {
            byte |= 0x80;
        }
        out.push(byte);
        if n == 0 {
            break;
        }
    }
}

/// A v5 PUBLISH whose properties hold property 0x0B (Subscription Identifier) once per id:
/// `p`'s own `subscription_id` then `more`. The property may repeat in a PUBLISH (MQTT 5
/// §3.3.2.3.8), but `mqtt-proto` encodes at most one, so the packet is framed here around
/// `mqtt-proto`'s encoding of the other properties.
fn encode_publish_ids(p: &v5::Publish, more: &[u32]) -> Result<Vec<u8>, mqtt_proto::Error> {
    use mqtt_proto::Encodable;
    let mut props = p.properties.clone();
    let first = props.subscription_id.take().map(|v| v.value());
    let mut encoded = Vec::new();
    props.encode(&mut encoded)?;
    // `encoded` is the properties' length (a variable byte integer) then the properties.
    let mut at = 0;
    while encoded.get(at).is_some_and(|b| b & 0x80 != 0) {
        at += 1;
    }
    let mut body_props = encoded.get(at + 1..).unwrap_or_default().to_vec();
    for id in first.into_iter().chain(more.iter().copied()) {
        if !(1..=268_435_455).contains(&id) {
            return Err(mqtt_proto::Error::InvalidVarByteInt);
        }
        body_props.push(0x0B);
        put_var_int(&mut body_props, id as usize);
    }
    let topic = p.topic_name.as_bytes();
    let topic_len = u16::try_from(topic.len()).map_err(|_| mqtt_proto::Error::InvalidString)?;
    let mut var = Vec::with_capacity(2 + topic.len() + 2 + 4 + body_props.len());
    var.extend_from_slice(&topic_len.to_be_bytes());
    var.extend_from_slice(topic);
    let (qos, pid) = match p.qos_pid {
        QosPid::Level0 => (0u8, None),
        QosPid::Level1(pid) => (1, Some(pid)),
        QosPid::Level2(pid) => (2, Some(pid)),
    };
    if let Some(pid) = pid {
        var.extend_from_slice(&pid.value().to_be_bytes());
    }
    put_var_int(&mut var, body_props.len());
    var.extend_from_slice(&body_props);
    let remaining = var.len() + p.payload.len();
    if remaining > 268_435_455 {
        return Err(mqtt_proto::Error::InvalidRemainingLength);
    }
    let mut packet = Vec::with_capacity(5 + remaining);
    packet.push(0x30 | (u8::from(p.dup) << 3) | (qos << 1) | u8::from(p.retain));
    put_var_int(&mut packet, remaining);
    packet.extend_from_slice(&var);
    packet.extend_from_slice(&p.payload);
    Ok(packet)
}

/// The encoded size of `p` at `level` (for the client's maximum packet size).
pub fn encoded_len(p: &v5::Packet, level: Level) -> usize {
    if level == 5 {
        p.encode_len().unwrap_or(usize::MAX)
    } else {
        lower(p)
            .and_then(|p3| p3.encode_len().ok())
            .unwrap_or(usize::MAX)
    }
}

/// The QoS as a number.
pub fn qos_u8(q: QoS) -> u8 {
    q as u8
}

/// A QoS from a number, saturating at 2.
pub fn qos_from(n: u8) -> QoS {
    match n {
        0 => QoS::Level0,
        1 => QoS::Level1,
        _ => QoS::Level2,
    }
}
