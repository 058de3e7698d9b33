//! A lean MQTT 3.1.1 client for load generation: the few packets a bench needs (CONNECT,
//! SUBSCRIBE, PUBLISH, PUBACK, PUBREC/PUBREL/PUBCOMP, DISCONNECT) encoded by hand, packets
//! decoded from one bounded read buffer without copying. A general client library would
//! cost more CPU per message than the brokers under test.

use crate::transport::{self, ReadHalf, Transport, WriteHalf};
use anyhow::{Context, anyhow, bail, ensure};
use bytes::{BufMut, Bytes, BytesMut};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Packets larger than this are refused: bounds the read buffer (bench payloads are small).
pub const MAX_PACKET: usize = 1 << 20;
/// Read in chunks of this size: room for hundreds of small publishes per read.
const READ_CHUNK: usize = 256 * 1024;
/// CONNECT and SUBSCRIBE must be answered within this.
const RPC_TIMEOUT: Duration = Duration::from_secs(10);

pub const PUBLISH: u8 = 3;
pub const PUBACK: u8 = 4;
pub const PUBREC: u8 = 5;
pub const PUBREL: u8 = 6;
pub const PUBCOMP: u8 = 7;

/// Where to connect: `host:port` or `SCHEME://[user[:pass]@]host[:port][/path]` with the
/// scheme `mqtt` (port 1883), `mqtts` (TLS, 8883), `ws` (WebSocket, 8083) or `wss`
/// (WebSocket over TLS, 8084); the WebSocket path defaults to `/mqtt`.
#[derive(Clone, Debug)]
pub struct Target {
    pub addr: String,
    pub login: Option<(String, String)>,
    pub transport: Transport,
}

impl Target {
    pub fn parse(s: &str) -> anyhow::Result<Target> {
        let (scheme, rest) = s.split_once("://").unwrap_or(("mqtt", s));
        let (rest, path) = match rest.find('/') {
            Some(i) if i + 1 < rest.len() => (&rest[..i], rest[i..].to_string()),
            Some(i) => (&rest[..i], "/mqtt".to_string()),
            None => (rest, "/mqtt".to_string()),
        };
        let (transport, port) = match scheme {
            "mqtt" | "tcp" => (Transport::Tcp, 1883),
            "mqtts" | "ssl" => (Transport::Tls, 8883),
            "ws" => (Transport::Ws(path), 8083),
            "wss" => (Transport::Wss(path), 8084),
            other => bail!("--mqtt {s:?}: unknown scheme {other:?} (mqtt, mqtts, ws, wss)"),
        };
        let (login, hostport) = match rest.rsplit_once('@') {
            Some((auth, h)) => {
                let (u, p) = auth.split_once(':').unwrap_or((auth, ""));
                (Some((u.to_string(), p.to_string())), h)
            }
            None => (None, rest),
        };
        ensure!(!hostport.is_empty(), "--mqtt {s:?} has no host");
        let addr = if hostport
            .rsplit_once(':')
            .is_some_and(|(_, p)| p.parse::<u16>().is_ok())
        {
            hostport.to_string()
        } else {
            format!("{hostport}:{port}")
        };
        Ok(Target {
            addr,
            login,
            transport,
        })
    }
}

pub fn put_str(out: &mut impl BufMut, s: &str) {
    // Client ids, topics and logins here are short; MQTT caps strings at 65535 bytes.
    let len = u16::try_from(s.len()).unwrap_or(u16::MAX);
    out.put_u16(len);
    out.put_slice(&s.as_bytes()[..usize::from(len)]);
}

/// The fixed header's variable-length "remaining length".
pub fn put_len(out: &mut impl BufMut, mut len: usize) {
    loop {
        let byte = (len % 128) as u8;
        len /= 128;
        out.put_u8(if len > 0 { byte | 0x80 } else { byte });
        if len == 0 {
            break;
        }
    }
}

pub fn packet(out: &mut impl BufMut, header: u8, body: &[u8]) {
    out.put_u8(header);
    put_len(out, body.len());
    out.put_slice(body);
}

/// CONNECT (MQTT 3.1.1, clean session unless `persistent`) followed by an optional
/// SUBSCRIBE, in one write.
pub fn handshake_bytes(
    client_id: &str,
    keep_alive: u16,
    login: Option<&(String, String)>,
    subscribe: Option<(&str, u8)>,
    persistent: bool,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + client_id.len());
    let clean = if persistent { 0 } else { 0x02 };
    let flags = clean | login.map_or(0, |_| 0xC0);
    let mut body = vec![0, 4, b'M', b'Q', b'T', b'T', 4, flags];
    body.extend_from_slice(&keep_alive.to_be_bytes());
    put_str(&mut body, client_id);
    if let Some((user, pass)) = login {
        put_str(&mut body, user);
        put_str(&mut body, pass);
    }
    packet(&mut out, 0x10, &body);
    if let Some((filter, qos)) = subscribe {
        let mut body = vec![0, 1];
        put_str(&mut body, filter);
        body.push(qos);
        packet(&mut out, 0x82, &body);
    }
    out
}

/// The fixed header at the start of `buf`: (first byte, header length, body length), or
/// None while incomplete.
pub fn parse_header(buf: &[u8]) -> anyhow::Result<Option<(u8, usize, usize)>> {
    let Some(&first) = buf.first() else {
        return Ok(None);
    };
    let mut len = 0usize;
    for i in 1..=4 {
        let Some(&b) = buf.get(i) else {
            return Ok(None);
        };
        len |= usize::from(b & 0x7f) << (7 * (i - 1));
        if b & 0x80 == 0 {
            return Ok(Some((first, i + 1, len)));
        }
    }
    bail!("bad remaining length from the broker")
}

/// The send timestamp in the first 8 payload bytes of a PUBLISH body.
pub fn publish_stamp(header: u8, body: &[u8]) -> Option<u64> {
    let topic = usize::from(u16::from_be_bytes([*body.first()?, *body.get(1)?]));
    let pid = if (header >> 1) & 3 > 0 { 2 } else { 0 };
    let at = 2 + topic + pid;
    let stamp: [u8; 8] = body.get(at..at + 8)?.try_into().ok()?;
    Some(u64::from_be_bytes(stamp))
}

/// The packet id of a PUBLISH with QoS > 0, or of an ack.
pub fn packet_id(header: u8, body: &[u8]) -> Option<u16> {
    let at = if header >> 4 == PUBLISH {
        2 + usize::from(u16::from_be_bytes([*body.first()?, *body.get(1)?]))
    } else {
        0
    };
    Some(u16::from_be_bytes([*body.get(at)?, *body.get(at + 1)?]))
}

/// PUBACK, PUBREC, PUBREL (flags 0x2, as MQTT requires) or PUBCOMP.
pub fn put_ack(out: &mut BytesMut, kind: u8, pid: u16) {
    out.put_u8(kind << 4 | if kind == PUBREL { 0x02 } else { 0 });
    out.put_u8(2);
    out.put_u16(pid);
}

/// A prebuilt PUBLISH prefix for one topic and payload size: each message is the prefix,
/// the packet id (QoS > 0) and the payload (timestamp + zeros).
pub struct PublishTemplate {
    qos: u8,
    topic: Vec<u8>,
    size: usize,
}

impl PublishTemplate {
    pub fn new(topic: &str, qos: u8, size: usize) -> anyhow::Result<PublishTemplate> {
        ensure!(qos <= 2, "QoS {qos}: MQTT has 0, 1 and 2");
        ensure!(
            size >= 8,
            "payloads carry an 8-byte timestamp: size at least 8"
        );
        let mut t = Vec::with_capacity(8 + topic.len());
        put_str(&mut t, topic);
        let body = t.len() + if qos > 0 { 2 } else { 0 } + size;
        ensure!(body + 5 <= MAX_PACKET, "--size {size} is too large");
        let mut prefix = vec![0x30 | qos << 1];
        put_len(&mut prefix, body);
        prefix.extend_from_slice(&t);
        Ok(PublishTemplate {
            qos,
            topic: prefix,
            size,
        })
    }

    pub fn put(&self, out: &mut BytesMut, pid: u16, stamp: u64) {
        out.put_slice(&self.topic);
        if self.qos > 0 {
            out.put_u16(pid);
        }
        out.put_u64(stamp);
        out.put_bytes(0, self.size - 8);
    }

    #[cfg(test)]
    fn wire_len(&self) -> usize {
        self.topic.len() + if self.qos > 0 { 2 } else { 0 } + self.size
    }
}

/// The reading half: a read buffer holding at most one packet beyond what was read.
pub struct Reader {
    rd: ReadHalf,
    rbuf: BytesMut,
}

/// The keep-alive of load-generator connections: an hour, far beyond any run.
const BENCH_KEEP_ALIVE_S: u16 = 3600;

/// One connected client, split so reads and writes can be awaited together.
pub struct MqttConn {
    pub rx: Reader,
    pub wr: WriteHalf,
    pub wbuf: BytesMut,
}

impl MqttConn {
    /// Connects with a clean session and optionally subscribes. The keep-alive is long
    /// (runs are short and a busy load generator must not be dropped for a late ping) but
    /// not off: rumqttd refuses a CONNECT with keep-alive 0.
    pub async fn connect(
        target: &Target,
        client_id: &str,
        subscribe: Option<(&str, u8)>,
    ) -> anyhow::Result<MqttConn> {
        let (rd, mut wr) = transport::connect(&target.addr, &target.transport).await?;
        let hello = handshake_bytes(
            client_id,
            BENCH_KEEP_ALIVE_S,
            target.login.as_ref(),
            subscribe,
            false,
        );
        wr.write_all(&hello).await?;
        wr.flush().await?;
        let mut c = MqttConn {
            rx: Reader {
                rd,
                rbuf: BytesMut::with_capacity(READ_CHUNK),
            },
            wr,
            wbuf: BytesMut::with_capacity(64 * 1024),
        };
        let (h, body) = c.reply().await.context("waiting for CONNACK")?;
        ensure!(
            h == 0x20 && body.get(1) == Some(&0),
            "{client_id}: refused, CONNACK {h:#04x} {body:02x?}"
        );
        if let Some((filter, _)) = subscribe {
            let (h, body) = c.reply().await.context("waiting for SUBACK")?;
            ensure!(
                h == 0x90 && body.get(2).is_some_and(|&q| q <= 2),
                "{client_id}: SUBSCRIBE {filter} refused: {h:#04x} {body:02x?}"
            );
        }
        Ok(c)
    }

    async fn reply(&mut self) -> anyhow::Result<(u8, Bytes)> {
        tokio::time::timeout(RPC_TIMEOUT, async {
            loop {
                if let Some(p) = self.rx.try_packet()? {
                    return Ok(p);
                }
                self.rx.fill().await?;
            }
        })
        .await
        .map_err(|_| anyhow!("no reply from the broker within {RPC_TIMEOUT:?}"))?
    }

    pub async fn flush(&mut self) -> anyhow::Result<()> {
        if !self.wbuf.is_empty() {
            self.wr.write_all(&self.wbuf).await?;
            // TLS and WebSocket buffer what was written until flushed (TCP: a no-op).
            self.wr.flush().await?;
            self.wbuf.clear();
        }
        Ok(())
    }

    /// DISCONNECT, so the broker ends the session without a will or a warning.
    pub async fn disconnect(mut self) -> anyhow::Result<()> {
        self.wbuf.clear();
        self.wbuf.put_slice(&[0xE0, 0]);
        self.flush().await?;
        self.wr.shutdown().await.ok();
        Ok(())
    }
}

impl Reader {
    /// The next complete packet already read: (first header byte, body).
    pub fn try_packet(&mut self) -> anyhow::Result<Option<(u8, Bytes)>> {
        let Some((h, hl, len)) = parse_header(&self.rbuf)? else {
            return Ok(None);
        };
        ensure!(len <= MAX_PACKET, "a {len}-byte packet from the broker");
        if self.rbuf.len() < hl + len {
            return Ok(None);
        }
        let mut p = self.rbuf.split_to(hl + len);
        Ok(Some((h, p.split_off(hl).freeze())))
    }

    /// Reads more bytes (cancel safe: a cancelled read loses nothing).
    pub async fn fill(&mut self) -> anyhow::Result<()> {
        if self.rbuf.capacity() - self.rbuf.len() < READ_CHUNK / 4 {
            self.rbuf.reserve(READ_CHUNK);
        }
        if self.rd.read_buf(&mut self.rbuf).await? == 0 {
            bail!("the broker closed the connection");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets() {
        let t = Target::parse("127.0.0.1:1893").unwrap();
        assert_eq!(
            (t.addr.as_str(), t.login.is_none()),
            ("127.0.0.1:1893", true)
        );
        let t = Target::parse("mqtt://u:p@host").unwrap();
        assert_eq!(t.addr, "host:1883");
        assert_eq!(t.login, Some(("u".into(), "p".into())));
        assert!(Target::parse("mqtt://").is_err());
        let t = Target::parse("wss://u:p@localhost").unwrap();
        assert_eq!(
            (t.addr.as_str(), t.transport),
            ("localhost:8084", Transport::Wss("/mqtt".into()))
        );
        let t = Target::parse("ws://127.0.0.1:9/ws").unwrap();
        assert_eq!(
            (t.addr.as_str(), t.transport),
            ("127.0.0.1:9", Transport::Ws("/ws".into()))
        );
        let t = Target::parse("mqtts://h").unwrap();
        assert_eq!((t.addr.as_str(), t.transport), ("h:8883", Transport::Tls));
        assert!(Target::parse("http://h").is_err());
    }

    #[test]
    fn publish_round_trip() {
        let t = PublishTemplate::new("a/b", 1, 12).unwrap();
        let mut buf = BytesMut::new();
        t.put(&mut buf, 7, 42);
        assert_eq!(buf.len(), t.wire_len());
        let (h, hl, len) = parse_header(&buf).unwrap().unwrap();
        assert_eq!((h, hl + len), (0x32, buf.len()));
        let body = &buf[hl..];
        assert_eq!(packet_id(h, body), Some(7));
        assert_eq!(publish_stamp(h, body), Some(42));
        assert_eq!(parse_header(&buf[..1]).unwrap(), None);
        assert!(parse_header(&[0x30, 0xff, 0xff, 0xff, 0xff]).is_err());
    }
}
