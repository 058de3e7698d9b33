//! The AMQP side of `warren-bench conns`: one idle AMQP 0.9.1 connection over any byte
//! stream (a TCP socket, or an in-memory stream into the real gateway): connection.open,
//! channel 1, an exclusive server-named queue bound to `amq.topic`, and a consumer on it,
//! the AMQP counterpart of an MQTT client with one subscription.
//!
//! The bench client's `client::Conn` is tied to TCP halves and 256 KiB buffers; a million
//! idle connections need a few hundred bytes of client state each, so this side keeps none
//! between calls.

use super::client::check_close;
use amq_protocol::protocol::{AMQPClass, basic, channel, connection, queue};
use amq_protocol::types::{FieldTable, LongString, ShortString};
use anyhow::{Context, bail};
use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use warren_amqp::codec::{self, Frame};

/// Frames larger than this are refused (the broker's replies here are a few hundred bytes).
const FRAME_MAX: u32 = 131_072;
/// A heartbeat frame: type 8, channel 0, empty payload, frame end.
pub const HEARTBEAT: [u8; 8] = [8, 0, 0, 0, 0, 0, 0, 0xCE];
/// The channel the queue and consumer live on.
const CH: u16 = 1;

/// Bytes (client wrote, broker wrote) per round trip of one handshake, in order: replayed
/// over bare in-memory streams to learn what the transport itself holds afterwards.
pub type Exchange = Vec<(usize, usize)>;

/// Opens the connection and, with `bind_key`, declares, binds and consumes. The steps after
/// connection.tune go out in one write (AMQP lets a client pipeline them; an empty queue
/// name means the channel's last declared queue), so a connection costs three round trips.
pub async fn handshake<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    heartbeat: u16,
    bind_key: Option<&str>,
) -> anyhow::Result<Exchange> {
    let mut rbuf = BytesMut::new();
    let mut w = BytesMut::new();
    let mut steps = Exchange::with_capacity(3);

    s.write_all(codec::PROTOCOL_HEADER).await?;
    let got = until(s, &mut rbuf, |m| {
        matches!(m, AMQPClass::Connection(connection::AMQPMethod::Start(_)))
    })
    .await
    .context("connection.start")?;
    steps.push((codec::PROTOCOL_HEADER.len(), got.0));

    codec::encode_method(
        &mut w,
        0,
        AMQPClass::Connection(connection::AMQPMethod::StartOk(connection::StartOk {
            client_properties: FieldTable::default(),
            mechanism: ShortString::from("PLAIN"),
            response: LongString::from("\0guest\0guest"),
            locale: ShortString::from("en_US"),
        })),
    );
    let sent = send(s, &mut w).await?;
    let (read, tune) = until(s, &mut rbuf, |m| {
        matches!(m, AMQPClass::Connection(connection::AMQPMethod::Tune(_)))
    })
    .await
    .context("connection.tune (credentials guest/guest refused?)")?;
    steps.push((sent, read));
    let AMQPClass::Connection(connection::AMQPMethod::Tune(tune)) = tune else {
        bail!("expected connection.tune");
    };

    let frame_max = match tune.frame_max {
        0 => FRAME_MAX,
        f => f.min(FRAME_MAX),
    };
    for m in [
        AMQPClass::Connection(connection::AMQPMethod::TuneOk(connection::TuneOk {
            channel_max: tune.channel_max,
            frame_max,
            heartbeat,
        })),
        AMQPClass::Connection(connection::AMQPMethod::Open(connection::Open {
            virtual_host: ShortString::from("/"),
        })),
    ] {
        codec::encode_method(&mut w, 0, m);
    }
    codec::encode_method(
        &mut w,
        CH,
        AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
    );
    if let Some(key) = bind_key {
        for m in subscribe(key) {
            codec::encode_method(&mut w, CH, m);
        }
    }
    let sent = send(s, &mut w).await?;
    let consuming = bind_key.is_some();
    let (read, _) = until(s, &mut rbuf, |m| match m {
        AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(_)) => true,
        AMQPClass::Channel(channel::AMQPMethod::OpenOk(_)) => !consuming,
        _ => false,
    })
    .await
    .context("connection.open .. basic.consume")?;
    steps.push((sent, read));
    Ok(steps)
}

/// queue.declare (server-named, exclusive), queue.bind to amq.topic, basic.consume.
fn subscribe(key: &str) -> [AMQPClass; 3] {
    [
        AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
            queue: ShortString::from(""),
            passive: false,
            durable: false,
            exclusive: true,
            auto_delete: false,
            nowait: false,
            arguments: FieldTable::default(),
        })),
        AMQPClass::Queue(queue::AMQPMethod::Bind(queue::Bind {
            queue: ShortString::from(""),
            exchange: ShortString::from("amq.topic"),
            routing_key: ShortString::from(key),
            nowait: false,
            arguments: FieldTable::default(),
        })),
        AMQPClass::Basic(basic::AMQPMethod::Consume(basic::Consume {
            queue: ShortString::from(""),
            consumer_tag: ShortString::from(""),
            no_local: false,
            no_ack: false,
            exclusive: false,
            nowait: false,
            arguments: FieldTable::default(),
        })),
    ]
}

/// One request/reply on channel 1 (basic.qos, which changes nothing here): proves the
/// connection, its channel and the broker behind them still answer.
pub async fn ping<S: AsyncRead + AsyncWrite + Unpin>(s: &mut S) -> anyhow::Result<()> {
    let mut w = BytesMut::new();
    codec::encode_method(
        &mut w,
        CH,
        AMQPClass::Basic(basic::AMQPMethod::Qos(basic::Qos {
            prefetch_count: 0,
            global: false,
        })),
    );
    send(s, &mut w).await?;
    let mut rbuf = BytesMut::new();
    until(s, &mut rbuf, |m| {
        matches!(m, AMQPClass::Basic(basic::AMQPMethod::QosOk(_)))
    })
    .await
    .context("basic.qos-ok")?;
    Ok(())
}

/// Whether `bytes` (one read from an idle connection) are whole heartbeat frames only, all an
/// idle AMQP connection may receive.
pub fn only_heartbeats(bytes: &[u8]) -> bool {
    bytes.len().is_multiple_of(HEARTBEAT.len())
        && bytes.chunks(HEARTBEAT.len()).all(|c| c == HEARTBEAT)
}

async fn send<S: AsyncWrite + Unpin>(s: &mut S, w: &mut BytesMut) -> anyhow::Result<usize> {
    s.write_all(w).await?;
    let n = w.len();
    w.clear();
    Ok(n)
}

/// Reads frames until a method `want` accepts; returns the bytes read and that method.
/// Heartbeats are skipped; a close from the broker is an error.
async fn until<S: AsyncRead + Unpin>(
    s: &mut S,
    rbuf: &mut BytesMut,
    want: impl Fn(&AMQPClass) -> bool,
) -> anyhow::Result<(usize, AMQPClass)> {
    let mut read = 0;
    loop {
        while let Some(frame) =
            codec::decode(rbuf, FRAME_MAX).map_err(|e| anyhow::anyhow!("from the broker: {e}"))?
        {
            match frame {
                Frame::Method(_, m) => {
                    check_close(&m)?;
                    if want(&m) {
                        return Ok((read, m));
                    }
                }
                Frame::Heartbeat(_) => {}
                other => bail!("unexpected frame from an idle connection: {other:?}"),
            }
        }
        // Bounded: the codec refuses frames above FRAME_MAX, so the buffer holds at most one.
        rbuf.reserve(4096);
        let n = s.read_buf(rbuf).await?;
        if n == 0 {
            bail!("the broker closed the connection");
        }
        read += n;
    }
}
