//! A lean AMQP 0.9.1 client for load generation. lapin's per-message futures and channel
//! machinery cost more CPU than the broker under test at 100k+ msg/s; here a publish is one
//! memcpy of a prebuilt frame prefix plus the body, batched into large writes, and a consumer
//! acks once per socket read (`multiple`). Framing and method decoding reuse warren-amqp's
//! codec (amq-protocol underneath); the few hot frames are encoded by hand.

use crate::transport::{self, ReadHalf, Transport, WriteHalf};
use amq_protocol::protocol::{AMQPClass, basic, channel, confirm, connection, queue};
use amq_protocol::types::{AMQPValue, FieldTable, LongString, ShortString};
use anyhow::{Context, anyhow, bail};
use bytes::{BufMut, BytesMut};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use warren_amqp::codec::{self, FRAME_BODY, FRAME_END, FRAME_HEADER, FRAME_METHOD, Frame};

/// The largest frame we accept or send; the broker may lower it in tune.
const FRAME_MAX: u32 = 131_072;
/// Read in chunks of this size: large enough to hold hundreds of small deliveries per read.
const READ_CHUNK: usize = 256 * 1024;
/// Every request/reply exchange (handshake, declare, close) must finish within this.
const RPC_TIMEOUT: Duration = Duration::from_secs(10);

/// Where to connect, parsed from `amqp://user:pass@host:port/vhost` (or `amqps://`: TLS).
#[derive(Clone, Debug)]
pub struct Uri {
    pub user: String,
    pub pass: String,
    pub addr: String,
    pub vhost: String,
    pub transport: Transport,
}

impl Uri {
    pub fn parse(uri: &str) -> anyhow::Result<Uri> {
        let (rest, transport, port) = if let Some(rest) = uri.strip_prefix("amqp://") {
            (rest, Transport::Tcp, 5672)
        } else if let Some(rest) = uri.strip_prefix("amqps://") {
            (rest, Transport::Tls, 5671)
        } else {
            bail!("--uri {uri:?} must start with amqp:// or amqps://")
        };
        let (auth, hostpart) = match rest.rsplit_once('@') {
            Some((a, h)) => (Some(a), h),
            None => (None, rest),
        };
        let (user, pass) = match auth {
            Some(a) => match a.split_once(':') {
                Some((u, p)) => (percent_decode(u)?, percent_decode(p)?),
                None => (percent_decode(a)?, String::new()),
            },
            None => ("guest".to_string(), "guest".to_string()),
        };
        let (hostport, vhost) = match hostpart.split_once('/') {
            // `amqp://host/` and `amqp://host` both mean the default vhost, as in RabbitMQ.
            Some((h, v)) if !v.is_empty() => (h, percent_decode(v)?),
            Some((h, _)) => (h, "/".to_string()),
            None => (hostpart, "/".to_string()),
        };
        if hostport.is_empty() {
            bail!("--uri {uri:?} has no host");
        }
        let addr = if hostport
            .rsplit_once(':')
            .is_some_and(|(_, p)| p.parse::<u16>().is_ok())
        {
            hostport.to_string()
        } else {
            format!("{hostport}:{port}")
        };
        Ok(Uri {
            user,
            pass,
            addr,
            vhost,
            transport,
        })
    }
}

fn percent_decode(s: &str) -> anyhow::Result<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| anyhow!("bad percent escape in {s:?}"))?;
            out.push(hex);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).context("URI part is not UTF-8")
}

/// The reading half: a bounded buffer (one frame at most `frame_max`, enforced by the codec).
pub struct Reader {
    rd: ReadHalf,
    buf: BytesMut,
    frame_max: u32,
}

/// The writing half: frames accumulate in `buf` and go out in one write on `flush`.
pub struct Writer {
    wr: WriteHalf,
    pub buf: BytesMut,
}

impl Reader {
    /// The next whole frame already buffered, without waiting.
    pub fn try_frame(&mut self) -> anyhow::Result<Option<Frame>> {
        codec::decode(&mut self.buf, self.frame_max).map_err(|e| anyhow!("from the broker: {e}"))
    }

    /// Reads more bytes from the socket (cancel safe: a cancelled read loses nothing).
    pub async fn fill(&mut self) -> anyhow::Result<()> {
        if self.buf.capacity() - self.buf.len() < READ_CHUNK / 4 {
            self.buf.reserve(READ_CHUNK);
        }
        let n = self.rd.read_buf(&mut self.buf).await?;
        if n == 0 {
            bail!("the broker closed the connection");
        }
        Ok(())
    }

    pub async fn frame(&mut self) -> anyhow::Result<Frame> {
        loop {
            if let Some(f) = self.try_frame()? {
                return Ok(f);
            }
            self.fill().await?;
        }
    }

    /// The next method on `ch`, skipping heartbeats; a close from the broker is an error.
    pub async fn method(&mut self, ch: u16) -> anyhow::Result<AMQPClass> {
        loop {
            match self.frame().await? {
                Frame::Method(c, m) => {
                    check_close(&m)?;
                    if c == ch {
                        return Ok(m);
                    }
                }
                Frame::Heartbeat(_) => {}
                other => bail!("unexpected frame while waiting for a reply: {other:?}"),
            }
        }
    }
}

/// Turns a broker's connection.close / channel.close into an error with its reply text.
pub fn check_close(m: &AMQPClass) -> anyhow::Result<()> {
    match m {
        AMQPClass::Connection(connection::AMQPMethod::Close(c)) => bail!(
            "the broker closed the connection: {} {}",
            c.reply_code,
            c.reply_text.as_str()
        ),
        AMQPClass::Channel(channel::AMQPMethod::Close(c)) => bail!(
            "the broker closed the channel: {} {}",
            c.reply_code,
            c.reply_text.as_str()
        ),
        _ => Ok(()),
    }
}

impl Writer {
    pub fn method(&mut self, ch: u16, m: AMQPClass) {
        codec::encode_method(&mut self.buf, ch, m);
    }

    pub async fn flush(&mut self) -> anyhow::Result<()> {
        if !self.buf.is_empty() {
            self.wr.write_all(&self.buf).await?;
            // TLS and WebSocket buffer what was written until flushed (TCP: a no-op).
            self.wr.flush().await?;
            self.buf.clear();
        }
        Ok(())
    }

    /// basic.ack (60, 80), by hand: it is on the hot path of every acking consumer.
    pub fn ack(&mut self, ch: u16, tag: u64, multiple: bool) {
        let b = &mut self.buf;
        b.put_u8(FRAME_METHOD);
        b.put_u16(ch);
        b.put_u32(13);
        b.put_u16(60);
        b.put_u16(80);
        b.put_u64(tag);
        b.put_u8(u8::from(multiple));
        b.put_u8(FRAME_END);
    }
}

/// One open connection with channel 1 open.
pub struct Conn {
    pub rd: Reader,
    pub wr: Writer,
    pub frame_max: u32,
}

pub const CH: u16 = 1;

impl Conn {
    pub async fn open(uri: &Uri, name: &str) -> anyhow::Result<Conn> {
        tokio::time::timeout(RPC_TIMEOUT, Self::open_inner(uri, name))
            .await
            .map_err(|_| anyhow!("connecting to {} timed out", uri.addr))?
    }

    async fn open_inner(uri: &Uri, name: &str) -> anyhow::Result<Conn> {
        let (rd, wr) = transport::connect(&uri.addr, &uri.transport).await?;
        let mut rd = Reader {
            rd,
            buf: BytesMut::with_capacity(READ_CHUNK),
            frame_max: FRAME_MAX,
        };
        let mut wr = Writer {
            wr,
            buf: BytesMut::with_capacity(64 * 1024),
        };
        wr.buf.put_slice(codec::PROTOCOL_HEADER);
        wr.flush().await?;
        match rd.method(0).await? {
            AMQPClass::Connection(connection::AMQPMethod::Start(_)) => {}
            other => bail!("expected connection.start, got {other:?}"),
        }
        let mut props = FieldTable::default();
        props.insert(
            ShortString::from("product"),
            AMQPValue::LongString(LongString::from("warren-bench")),
        );
        props.insert(
            ShortString::from("connection_name"),
            AMQPValue::LongString(LongString::from(name)),
        );
        let mut caps = FieldTable::default();
        caps.insert(
            ShortString::from("publisher_confirms"),
            AMQPValue::Boolean(true),
        );
        caps.insert(
            ShortString::from("connection.blocked"),
            AMQPValue::Boolean(true),
        );
        props.insert(
            ShortString::from("capabilities"),
            AMQPValue::FieldTable(caps),
        );
        let response = format!("\0{}\0{}", uri.user, uri.pass);
        wr.method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::StartOk(connection::StartOk {
                client_properties: props,
                mechanism: ShortString::from("PLAIN"),
                response: LongString::from(response),
                locale: ShortString::from("en_US"),
            })),
        );
        wr.flush().await?;
        let tune = match rd.method(0).await? {
            AMQPClass::Connection(connection::AMQPMethod::Tune(t)) => t,
            other => bail!("expected connection.tune (wrong credentials?), got {other:?}"),
        };
        // 0 from the broker means "no limit"; ours is FRAME_MAX.
        let frame_max = match tune.frame_max {
            0 => FRAME_MAX,
            f => f.min(FRAME_MAX),
        };
        rd.frame_max = frame_max;
        // Heartbeats off: runs are short and a busy load generator must not miss one.
        wr.method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::TuneOk(connection::TuneOk {
                channel_max: tune.channel_max,
                frame_max,
                heartbeat: 0,
            })),
        );
        wr.method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Open(connection::Open {
                virtual_host: ShortString::from(uri.vhost.as_str()),
            })),
        );
        wr.flush().await?;
        match rd.method(0).await? {
            AMQPClass::Connection(connection::AMQPMethod::OpenOk(_)) => {}
            other => bail!("expected connection.open-ok, got {other:?}"),
        }
        let mut conn = Conn { rd, wr, frame_max };
        conn.rpc(AMQPClass::Channel(channel::AMQPMethod::Open(
            channel::Open {},
        )))
        .await?;
        Ok(conn)
    }

    /// Sends one method on channel 1 and waits for its reply.
    pub async fn rpc(&mut self, m: AMQPClass) -> anyhow::Result<AMQPClass> {
        self.wr.method(CH, m);
        self.wr.flush().await?;
        tokio::time::timeout(RPC_TIMEOUT, self.rd.method(CH))
            .await
            .map_err(|_| anyhow!("no reply from the broker within {RPC_TIMEOUT:?}"))?
    }

    /// Declares `name`; returns the number of messages it holds.
    pub async fn declare_queue(&mut self, name: &str, durable: bool) -> anyhow::Result<u32> {
        match self
            .rpc(AMQPClass::Queue(queue::AMQPMethod::Declare(
                queue::Declare {
                    queue: ShortString::from(name),
                    passive: false,
                    durable,
                    exclusive: false,
                    auto_delete: false,
                    nowait: false,
                    arguments: FieldTable::default(),
                },
            )))
            .await?
        {
            AMQPClass::Queue(queue::AMQPMethod::DeclareOk(ok)) => Ok(ok.message_count),
            other => bail!("expected queue.declare-ok, got {other:?}"),
        }
    }

    pub async fn bind_queue(&mut self, name: &str, exchange: &str) -> anyhow::Result<()> {
        self.rpc(AMQPClass::Queue(queue::AMQPMethod::Bind(queue::Bind {
            queue: ShortString::from(name),
            exchange: ShortString::from(exchange),
            routing_key: ShortString::from(""),
            nowait: false,
            arguments: FieldTable::default(),
        })))
        .await
        .map(drop)
    }

    pub async fn delete_queue(&mut self, name: &str) -> anyhow::Result<()> {
        self.rpc(AMQPClass::Queue(queue::AMQPMethod::Delete(queue::Delete {
            queue: ShortString::from(name),
            if_unused: false,
            if_empty: false,
            nowait: false,
        })))
        .await
        .map(drop)
    }

    pub async fn confirm_select(&mut self) -> anyhow::Result<()> {
        self.rpc(AMQPClass::Confirm(confirm::AMQPMethod::Select(
            confirm::Select { nowait: false },
        )))
        .await
        .map(drop)
    }

    /// basic.qos then basic.consume; prefetch 0 means unlimited.
    pub async fn consume(
        &mut self,
        queue: &str,
        prefetch: u16,
        no_ack: bool,
    ) -> anyhow::Result<()> {
        self.consume_with(queue, prefetch, no_ack, FieldTable::default())
            .await
    }

    /// [`Conn::consume`] with basic.consume arguments (a stream's `x-stream-offset`).
    pub async fn consume_with(
        &mut self,
        queue: &str,
        prefetch: u16,
        no_ack: bool,
        arguments: FieldTable,
    ) -> anyhow::Result<()> {
        if prefetch > 0 {
            self.rpc(AMQPClass::Basic(basic::AMQPMethod::Qos(basic::Qos {
                prefetch_count: prefetch,
                global: false,
            })))
            .await?;
        }
        match self
            .rpc(AMQPClass::Basic(basic::AMQPMethod::Consume(
                basic::Consume {
                    queue: ShortString::from(queue),
                    consumer_tag: ShortString::from(""),
                    no_local: false,
                    no_ack,
                    exclusive: false,
                    nowait: false,
                    arguments,
                },
            )))
            .await?
        {
            AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(_)) => Ok(()),
            other => bail!("expected basic.consume-ok, got {other:?}"),
        }
    }

    /// Sends connection.close and waits (bounded) for close-ok; the broker then frees the
    /// connection at once instead of logging an abrupt disconnect.
    pub async fn close(mut self) -> anyhow::Result<()> {
        self.wr.buf.clear();
        close_with(&mut self.wr).await?;
        let wait = async {
            loop {
                if let Frame::Method(0, AMQPClass::Connection(connection::AMQPMethod::CloseOk(_))) =
                    self.rd.frame().await?
                {
                    return anyhow::Ok(());
                }
            }
        };
        tokio::time::timeout(Duration::from_secs(2), wait)
            .await
            .map_err(|_| anyhow!("no connection.close-ok within 2 s"))?
    }
}

/// Writes connection.close (200, normal shutdown).
pub async fn close_with(wr: &mut Writer) -> anyhow::Result<()> {
    wr.method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::Close(connection::Close {
            reply_code: 200,
            reply_text: ShortString::from("bench done"),
            class_id: 0,
            method_id: 0,
        })),
    );
    wr.flush().await
}

/// A prebuilt basic.publish + content header + body-frame header for fixed-size messages:
/// publishing is then a copy of `prefix`, the body, and the frame-end byte.
pub struct PublishTemplate {
    prefix: BytesMut,
    size: usize,
}

impl PublishTemplate {
    pub fn new(
        exchange: &str,
        routing_key: &str,
        size: usize,
        persistent: bool,
        frame_max: u32,
    ) -> anyhow::Result<PublishTemplate> {
        let max_body = frame_max.saturating_sub(codec::FRAME_OVERHEAD) as usize;
        if size > max_body {
            bail!("--size {size} exceeds one frame ({max_body} bytes with this broker)");
        }
        if exchange.len() > 255 || routing_key.len() > 255 {
            bail!("exchange and routing key must be at most 255 bytes");
        }
        let mut p = BytesMut::with_capacity(128);
        // Method frame: basic.publish (60, 40): reserved u16, exchange, routing key, bits.
        let args_len = 2 + 1 + exchange.len() + 1 + routing_key.len() + 1;
        p.put_u8(FRAME_METHOD);
        p.put_u16(CH);
        p.put_u32((4 + args_len) as u32);
        p.put_u16(60);
        p.put_u16(40);
        p.put_u16(0);
        p.put_u8(exchange.len() as u8);
        p.put_slice(exchange.as_bytes());
        p.put_u8(routing_key.len() as u8);
        p.put_slice(routing_key.as_bytes());
        p.put_u8(0);
        p.put_u8(FRAME_END);
        // Content header: class, weight, body size, property flags (+ delivery-mode).
        p.put_u8(FRAME_HEADER);
        p.put_u16(CH);
        p.put_u32(if persistent { 15 } else { 14 });
        p.put_u16(60);
        p.put_u16(0);
        p.put_u64(size as u64);
        if persistent {
            p.put_u16(0x1000); // delivery-mode present
            p.put_u8(2);
        } else {
            p.put_u16(0);
        }
        p.put_u8(FRAME_END);
        // Body frame header; the body and frame-end follow per message.
        p.put_u8(FRAME_BODY);
        p.put_u16(CH);
        p.put_u32(size as u32);
        Ok(PublishTemplate { prefix: p, size })
    }

    /// Appends one message whose body starts with `stamp` (nanoseconds, big-endian), as
    /// PerfTest embeds its send time; the rest of the body is zeros.
    pub fn put(&self, buf: &mut BytesMut, stamp: u64) {
        buf.put_slice(&self.prefix);
        let stamp = stamp.to_be_bytes();
        let n = self.size.min(8);
        buf.put_slice(&stamp[..n]);
        buf.put_bytes(0, self.size - n);
        buf.put_u8(FRAME_END);
    }

    pub fn wire_len(&self) -> usize {
        self.prefix.len() + self.size + 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uri_forms() {
        let u = Uri::parse("amqp://guest:guest@127.0.0.1:5682").unwrap();
        assert_eq!(
            (u.user.as_str(), u.addr.as_str(), u.vhost.as_str()),
            ("guest", "127.0.0.1:5682", "/")
        );
        let u = Uri::parse("amqp://a:b%40c@host/%2fv").unwrap();
        assert_eq!(
            (u.pass.as_str(), u.addr.as_str(), u.vhost.as_str()),
            ("b@c", "host:5672", "/v")
        );
        let u = Uri::parse("amqps://localhost").unwrap();
        assert_eq!(
            (u.addr.as_str(), &u.transport),
            ("localhost:5671", &Transport::Tls)
        );
        assert!(Uri::parse("http://x").is_err());
        assert!(Uri::parse("amqp://u:p@h/%zz").is_err());
    }

    #[test]
    fn publish_template_decodes() {
        // The hand-built frames must decode with the broker's own codec.
        let t = PublishTemplate::new("amq.fanout", "rk", 12, true, FRAME_MAX).unwrap();
        let mut buf = BytesMut::new();
        t.put(&mut buf, 42);
        assert_eq!(buf.len(), t.wire_len());
        let f = codec::decode(&mut buf, FRAME_MAX).unwrap().unwrap();
        assert!(
            matches!(f, Frame::Method(1, AMQPClass::Basic(basic::AMQPMethod::Publish(ref p)))
            if p.exchange.as_str() == "amq.fanout" && p.routing_key.as_str() == "rk")
        );
        let f = codec::decode(&mut buf, FRAME_MAX).unwrap().unwrap();
        assert!(matches!(f, Frame::Header(1, ref h)
            if h.body_size == 12 && h.properties.delivery_mode() == &Some(2)));
        let Some(Frame::Body(1, body)) = codec::decode(&mut buf, FRAME_MAX).unwrap() else {
            panic!("no body frame");
        };
        assert_eq!(&body[..8], &42u64.to_be_bytes());
        assert!(buf.is_empty());
    }
}
