//! `warren-bench stream publish`: a lean stream-protocol producer, so that the broker, not
//! the client, bounds the publish rate. It speaks the protocol with raw frames (warren-stream's
//! codec for the handshake; Publish frames patched in place: only the publishing ids change),
//! version 1 commands only, so it works against RabbitMQ 3.10.8 too (the Rust client 0.11
//! sends ExchangeCommandVersions, a 3.11 command, which 3.10 closes the connection on).
//! `--publishers` connections publish to one stream, each keeping at most `--in-flight`
//! messages unconfirmed and writing as many frames as its window allows per system call; the
//! rate is counted until the last confirm. With `--broker-pid` it also prints the broker's
//! CPU time per message.

use anyhow::{Context, bail};
use bytes::{BufMut, Bytes, BytesMut};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::net::tcp::OwnedReadHalf;
use warren_stream::codec::{self, Frame};
use warren_stream::frame::{key, split_frame};

/// Response code OK, and "stream already exists".
const OK: u16 = 1;
const ALREADY_EXISTS: u16 = 5;
/// Frames bigger than this are refused (the client asks for no more in Tune).
const FRAME_MAX: u32 = 1 << 20;
/// Bytes of Publish frames one write may carry.
const WRITE_BYTES: usize = 256 << 10;

/// One connection after the handshake: the socket and what was read past the last frame.
struct Conn {
    sock: TcpStream,
    buf: BytesMut,
    corr: u32,
}

impl Conn {
    async fn send(&mut self, f: &Frame) -> anyhow::Result<()> {
        let mut out = BytesMut::new();
        codec::encode(f, &mut out);
        self.sock.write_all(&out).await?;
        Ok(())
    }

    async fn recv(&mut self) -> anyhow::Result<Frame> {
        loop {
            if let Some(body) = split_frame(&mut self.buf, FRAME_MAX)? {
                match codec::decode(body)? {
                    Frame::Heartbeat => continue,
                    f => return Ok(f),
                }
            }
            if self.sock.read_buf(&mut self.buf).await? == 0 {
                bail!("the broker closed the connection");
            }
        }
    }

    fn next_corr(&mut self) -> u32 {
        self.corr += 1;
        self.corr
    }

    /// Sends a request and returns its response's code.
    async fn call(&mut self, f: Frame) -> anyhow::Result<u16> {
        self.send(&f).await?;
        Ok(match self.recv().await? {
            Frame::Response { code, .. }
            | Frame::PeerPropertiesResponse { code, .. }
            | Frame::SaslHandshakeResponse { code, .. }
            | Frame::SaslAuthenticateResponse { code, .. }
            | Frame::OpenResponse { code, .. } => code,
            other => bail!("unexpected answer {other:?} to {f:?}"),
        })
    }

    async fn open(host: &str, port: u16, user: &str, password: &str) -> anyhow::Result<Conn> {
        let sock = TcpStream::connect((host, port))
            .await
            .with_context(|| format!("connect to {host}:{port}"))?;
        sock.set_nodelay(true)?;
        let mut c = Conn {
            sock,
            buf: BytesMut::with_capacity(64 << 10),
            corr: 0,
        };
        let corr = c.next_corr();
        let props = vec![("product".to_string(), "warren-bench".to_string())];
        check(
            c.call(Frame::PeerProperties {
                corr,
                properties: props,
            })
            .await?,
            "peer properties",
        )?;
        let corr = c.next_corr();
        check(
            c.call(Frame::SaslHandshake { corr }).await?,
            "sasl handshake",
        )?;
        let corr = c.next_corr();
        let data = Bytes::from(format!("\0{user}\0{password}"));
        check(
            c.call(Frame::SaslAuthenticate {
                corr,
                mechanism: "PLAIN".into(),
                data,
            })
            .await?,
            "authenticate",
        )?;
        match c.recv().await? {
            Frame::Tune { frame_max, .. } => {
                let frame_max = if frame_max == 0 {
                    FRAME_MAX
                } else {
                    frame_max.min(FRAME_MAX)
                };
                // No heartbeats: runs are short, and the reader would have to answer them.
                c.send(&Frame::Tune {
                    frame_max,
                    heartbeat: 0,
                })
                .await?;
            }
            other => bail!("expected Tune, got {other:?}"),
        }
        let corr = c.next_corr();
        check(
            c.call(Frame::Open {
                corr,
                vhost: "/".into(),
            })
            .await?,
            "open",
        )?;
        Ok(c)
    }
}

fn check(code: u16, what: &str) -> anyhow::Result<()> {
    if code != OK {
        bail!("{what}: response code {code}");
    }
    Ok(())
}

/// The run's shape (from `StreamArgs`).
pub struct Publish<'a> {
    pub host: &'a str,
    pub port: u16,
    pub user: &'a str,
    pub password: &'a str,
    pub publishers: usize,
    pub in_flight: u64,
    pub broker_pid: Option<u32>,
    /// Leave the stream in place after the run (a fill for `raw-consume`).
    pub keep: bool,
}

/// (Re)creates `stream`, publishes `n` messages of `size` bytes in Publish frames of `batch`
/// messages from `p.publishers` connections; returns msg/s until the last confirm and the
/// broker's CPU ns per message (with `broker_pid`).
pub async fn run(
    p: &Publish<'_>,
    stream: &str,
    size: usize,
    batch: usize,
    n: u64,
) -> anyhow::Result<(f64, Option<f64>)> {
    let mut admin = Conn::open(p.host, p.port, p.user, p.password).await?;
    let corr = admin.next_corr();
    let _ = admin
        .call(Frame::Delete {
            corr,
            stream: stream.into(),
        })
        .await?;
    let corr = admin.next_corr();
    let code = admin
        .call(Frame::Create {
            corr,
            stream: stream.into(),
            arguments: vec![],
        })
        .await?;
    if code != OK && code != ALREADY_EXISTS {
        bail!("create {stream}: response code {code}");
    }
    let mut conns = Vec::with_capacity(p.publishers);
    for _ in 0..p.publishers {
        let mut c = Conn::open(p.host, p.port, p.user, p.password).await?;
        let corr = c.next_corr();
        check(
            c.call(Frame::DeclarePublisher {
                corr,
                publisher_id: 0,
                reference: String::new(),
                stream: stream.into(),
            })
            .await?,
            "declare publisher",
        )?;
        conns.push(c);
    }
    let cpu0 = p.broker_pid.and_then(crate::streams::BrokerCpu::read);
    let start = Instant::now();
    let per = n / p.publishers as u64;
    let mut tasks = Vec::new();
    for (i, c) in conns.into_iter().enumerate() {
        let count = if i == 0 {
            n - per * (p.publishers as u64 - 1)
        } else {
            per
        };
        tasks.push(tokio::spawn(publish(c, size, batch, count, p.in_flight)));
    }
    for t in tasks {
        t.await??;
    }
    let secs = start.elapsed().as_secs_f64();
    let cpu = match (cpu0, p.broker_pid.and_then(crate::streams::BrokerCpu::read)) {
        (Some(a), Some(b)) => Some(a.until(&b) as f64 / n as f64),
        _ => None,
    };
    if !p.keep {
        let corr = admin.next_corr();
        let _ = admin
            .call(Frame::Delete {
                corr,
                stream: stream.into(),
            })
            .await;
    }
    Ok((n as f64 / secs, cpu))
}

/// One publisher: `n` messages in frames of `batch`, at most `window` unconfirmed.
async fn publish(c: Conn, size: usize, batch: usize, n: u64, window: u64) -> anyhow::Result<()> {
    let Conn { sock, buf, .. } = c;
    let (rd, mut wr) = sock.into_split();
    let confirmed = Arc::new(AtomicU64::new(0));
    let wake = Arc::new(tokio::sync::Notify::new());
    let reader = tokio::spawn(confirms(rd, buf, confirmed.clone(), wake.clone(), n));
    // A frame of `batch` messages; only the publishing ids change between frames.
    let msg_len = 8 + 4 + size;
    let mut frame = BytesMut::with_capacity(4 + 2 + 2 + 1 + 4 + batch * msg_len);
    frame.put_u32(0);
    frame.put_u16(key::PUBLISH);
    frame.put_u16(1);
    frame.put_u8(0);
    frame.put_u32(batch as u32);
    let first_msg = frame.len();
    for _ in 0..batch {
        frame.put_u64(0);
        frame.put_u32(size as u32);
        frame.put_bytes(b'x', size);
    }
    let len = (frame.len() - 4) as u32;
    frame[..4].copy_from_slice(&len.to_be_bytes());
    let mut out = Vec::with_capacity(WRITE_BYTES + frame.len());
    let mut sent = 0u64;
    while sent < n {
        let acked = confirmed.load(Ordering::Acquire);
        if sent - acked + batch as u64 > window.max(batch as u64) {
            // Woken by each confirm frame; the timeout guards a lost wake-up.
            let _ = tokio::time::timeout(Duration::from_millis(5), wake.notified()).await;
            if reader.is_finished() {
                break;
            }
            continue;
        }
        out.clear();
        while sent < n
            && out.len() < WRITE_BYTES
            && sent - acked + batch as u64 <= window.max(batch as u64)
        {
            let k = (n - sent).min(batch as u64) as usize;
            if k < batch {
                // The last, short frame.
                let short = 4 + 2 + 2 + 1 + 4 + k * msg_len;
                let mut f = frame[..short].to_vec();
                f[..4].copy_from_slice(&((short - 4) as u32).to_be_bytes());
                f[9..13].copy_from_slice(&(k as u32).to_be_bytes());
                frame = BytesMut::from(&f[..]);
            }
            for i in 0..k {
                let at = first_msg + i * msg_len;
                frame[at..at + 8].copy_from_slice(&(sent + i as u64 + 1).to_be_bytes());
            }
            out.extend_from_slice(&frame);
            sent += k as u64;
        }
        wr.write_all(&out).await?;
    }
    reader.await??;
    Ok(())
}

/// Counts confirmed publishing ids until `n`; a publish error or a close ends the run.
async fn confirms(
    mut rd: OwnedReadHalf,
    mut buf: BytesMut,
    confirmed: Arc<AtomicU64>,
    wake: Arc<tokio::sync::Notify>,
    n: u64,
) -> anyhow::Result<()> {
    loop {
        while let Some(body) = split_frame(&mut buf, FRAME_MAX)? {
            // Confirms are read without decoding into a Vec: key, version, publisher id,
            // then the count of ids.
            if body.len() >= 9 && u16::from_be_bytes([body[0], body[1]]) == key::PUBLISH_CONFIRM {
                let k = u32::from_be_bytes([body[5], body[6], body[7], body[8]]);
                confirmed.fetch_add(u64::from(k), Ordering::AcqRel);
                wake.notify_one();
                continue;
            }
            match codec::decode(body)? {
                Frame::Heartbeat => {}
                Frame::PublishError { errors, .. } => {
                    bail!("publish errors: {:?}", &errors[..errors.len().min(5)])
                }
                Frame::Close { code, reason, .. } => bail!("closed by the broker: {code} {reason}"),
                _ => {}
            }
        }
        if confirmed.load(Ordering::Acquire) >= n {
            break;
        }
        if rd.read_buf(&mut buf).await? == 0 {
            bail!("the broker closed the connection");
        }
    }
    wake.notify_one();
    Ok(())
}

/// Chunks of credit a consumer starts with (Stream PerfTest's `--initial-credits`, 50 in
/// bench/java/StreamConsume.java).
const INITIAL_CREDIT: u16 = 50;
/// The largest Deliver frame a consumer takes: RabbitMQ 3.10 sends a chunk whole even when
/// it passes the negotiated frame-max (a 1,060,917-byte frame against 1 MiB at 1 KB x 3M).
const DELIVER_MAX: u32 = 64 << 20;

/// `raw-consume`: reads `n` messages of `stream` from `first` with raw frames (version 1
/// Deliver, so RabbitMQ 3.10 too), counting each chunk's records from its header without
/// parsing its messages and returning one credit per chunk, all the chunks of one read in
/// one Credit frame: a consumer leaner than any client, so that the broker's CPU per
/// message is what the run shows. Returns msg/s and the broker's CPU ns per message.
pub async fn consume(p: &Publish<'_>, stream: &str, n: u64) -> anyhow::Result<(f64, Option<f64>)> {
    let mut c = Conn::open(p.host, p.port, p.user, p.password).await?;
    let cpu0 = p.broker_pid.and_then(crate::streams::BrokerCpu::read);
    let start = Instant::now();
    let corr = c.next_corr();
    c.send(&Frame::Subscribe {
        corr,
        subscription_id: 0,
        stream: stream.into(),
        offset: codec::OffsetSpec::First,
        credit: INITIAL_CREDIT,
        properties: vec![],
    })
    .await?;
    let mut got = 0u64;
    let mut subscribed = false;
    let mut credit = BytesMut::new();
    while got < n {
        let mut chunks = 0u16;
        while let Some(body) = split_frame(&mut c.buf, DELIVER_MAX)? {
            if body.len() >= 5 && u16::from_be_bytes([body[0], body[1]]) == key::DELIVER {
                // key, version, subscription id, (v2: committed chunk id), then the chunk:
                // magic and version, type, entries (u16), records (u32).
                let at = if u16::from_be_bytes([body[2], body[3]]) >= 2 {
                    13
                } else {
                    5
                };
                let Some(h) = body.get(at..at + 8) else {
                    bail!("{stream}: a Deliver frame shorter than a chunk header");
                };
                if h[1] == 0 {
                    got += u64::from(u32::from_be_bytes([h[4], h[5], h[6], h[7]]));
                }
                chunks = chunks.saturating_add(1);
                continue;
            }
            match codec::decode(body)? {
                Frame::Response { code, .. } if !subscribed => {
                    check(code, "subscribe")?;
                    subscribed = true;
                }
                Frame::Close { code, reason, .. } => bail!("closed by the broker: {code} {reason}"),
                _ => {}
            }
        }
        if chunks > 0 && got < n {
            credit.clear();
            codec::encode(
                &Frame::Credit {
                    subscription_id: 0,
                    credit: chunks,
                },
                &mut credit,
            );
            c.sock.write_all(&credit).await?;
        }
        if got >= n {
            break;
        }
        if c.sock.read_buf(&mut c.buf).await? == 0 {
            bail!("{stream}: the broker closed the connection after {got} messages");
        }
    }
    let secs = start.elapsed().as_secs_f64();
    let cpu = match (cpu0, p.broker_pid.and_then(crate::streams::BrokerCpu::read)) {
        (Some(a), Some(b)) => Some(a.until(&b) as f64 / n as f64),
        _ => None,
    };
    Ok((n as f64 / secs, cpu))
}
