//! One MQTT connection: the tokio shell around [`Session`]. Reads packets, feeds the session,
//! sends its ops to the broker and writes its packets; keep-alive from the session's deadline;
//! takeover and shutdown requests end it with the v5 reason.
//!
//! Generic over the byte stream (TCP in `warren serve`, in-process duplex streams for
//! socketless load). Memory while idle: the read buffer is released whenever it is empty, and
//! reads into an empty buffer go through a stack chunk, so an idle connection holds no heap
//! buffer at all; writes build one buffer per flush and drop it.

use crate::codec::{self, CodecError, Level};
use crate::config::MqttConfig;
use crate::error::CloseError;
use crate::record::SessionRecord;
use crate::registry::{Registry, SubscribeGate};
use crate::session::{Session, check_connect, credentials, refusal};
use bytes::{BufMut, BytesMut};
use mqtt_proto::v5::ConnectReasonCode;
use mqtt_proto::v5::{self, DisconnectReasonCode};
use std::future::poll_fn;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::sync::{oneshot, watch};
use tokio::time::{Instant, sleep_until, timeout};
use warren_core::command::Op;
use warren_core::effect::Effect;
use warren_core::escape::Escaped;
use warren_runtime::{BrokerHandle, CommandSender, EffectReceiver, LoginError};

/// Who is on the other end, for authentication and logs.
#[derive(Clone, Debug)]
pub struct PeerInfo {
    pub addr: String,
    pub is_loopback: bool,
    /// The subject CN of the client's TLS certificate, when it presented one the listener
    /// verified: the user name of certificate logins.
    pub identity: Option<String>,
    /// Whether the connection came through a TLS listener (the HTTP API's `ssl`).
    pub tls: bool,
}

/// Bytes read per call when no packet is in progress (from a stack chunk).
const STACK_READ: usize = 4096;
/// Bytes read per call at most (the read buffer's capacity grows past it when the payloads
/// it shares keep it from being reused). A read is one op batch, and a publisher has up to
/// four in flight when its flow-control pause reaches it: unbounded, 64 KiB reads made that
/// ~2,500 small publishes per publisher, so a hundred publishers overshot their queue's
/// mark tenfold (docs/benchmarks.md, 2026-11-24 fan-in).
const MAX_READ: usize = 16 * 1024;
/// Effect batches handled before writing.
const MAX_BATCHES: usize = 64;
/// How long a new connection waits for the previous owner of its client id to close.
const TAKEOVER_TIMEOUT: Duration = Duration::from_secs(5);
/// A channel opened only to learn that earlier ops were applied (see the end of
/// [`serve_connection`]).
const BARRIER_CHANNEL: u16 = 2;
/// How long closing writes may take.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(2);

/// Unix time in ms: the session's clock (also used for message expiry across connections).
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

enum End {
    /// The client sent DISCONNECT.
    Disconnected,
    Eof,
    Io(std::io::Error),
    BrokerGone,
    /// We close, telling a v5 client why.
    Close(CloseError),
}

impl From<CloseError> for End {
    fn from(e: CloseError) -> End {
        End::Close(e)
    }
}

impl From<CodecError> for End {
    fn from(e: CodecError) -> End {
        End::Close(CloseError::new(e.reason(), e.to_string()))
    }
}

/// Reads what is available into `buf`. An empty buffer is filled through a stack chunk, so no
/// heap buffer is held while waiting for an idle client.
async fn read_some<S: AsyncRead + Unpin>(s: &mut S, buf: &mut BytesMut) -> std::io::Result<usize> {
    if buf.capacity() - buf.len() >= STACK_READ {
        return s.read_buf(&mut (&mut *buf).limit(MAX_READ)).await;
    }
    poll_fn(|cx| {
        let mut chunk = [0u8; STACK_READ];
        let mut rb = ReadBuf::new(&mut chunk);
        match Pin::new(&mut *s).poll_read(cx, &mut rb) {
            Poll::Ready(Ok(())) => {
                buf.put_slice(rb.filled());
                Poll::Ready(Ok(rb.filled().len()))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => Poll::Pending,
        }
    })
    .await
}

async fn write_packets<S: AsyncWrite + Unpin>(
    s: &mut S,
    packets: &[codec::Out],
    level: Level,
) -> std::io::Result<()> {
    if packets.is_empty() {
        return Ok(());
    }
    let mut w = BytesMut::with_capacity(packets.iter().map(codec::size_hint).sum());
    for p in packets {
        codec::encode_out(p, level, &mut w);
    }
    s.write_all(&w).await?;
    // A no-op on TCP; TLS and WebSocket streams send what they buffered only on flush.
    s.flush().await
}

/// Reads until CONNECT; with whether it came from a Mosquitto bridge (`try_private`).
async fn read_connect<S: AsyncRead + Unpin>(
    s: &mut S,
    buf: &mut BytesMut,
    max: usize,
) -> Result<(v5::Connect, bool), End> {
    let mut bridge = false;
    loop {
        bridge |= codec::take_bridge_bit(buf);
        if let Some(p) = codec::decode(buf, None, max)? {
            return match p {
                codec::Decoded::Packet(v5::Packet::Connect(c)) => Ok((c, bridge)),
                _ => Err(CloseError::protocol("first packet is not CONNECT").into()),
            };
        }
        match read_some(s, buf).await {
            Ok(0) => return Err(End::Eof),
            Ok(_) => {}
            Err(e) => return Err(End::Io(e)),
        }
    }
}

/// A connection past CONNECT: what the running loop and the close sequence share. Owned
/// here rather than borrowed from `serve_connection`'s arguments, so the connection's future
/// holds each once.
struct Live<S> {
    stream: S,
    rbuf: BytesMut,
    session: Session,
    tx: CommandSender,
    rx: EffectReceiver,
    kick_rx: oneshot::Receiver<oneshot::Sender<()>>,
    /// The client's address, for the close's logs (shared with the listing's `ConnMeta`;
    /// the rest of `PeerInfo` served the login).
    peer: Arc<str>,
    broker: BrokerHandle,
    registry: Arc<Registry>,
}

/// Serves one connection until it closes.
///
/// The connection's future is held for its whole life, so its size is per-connection memory
/// (1M-connection target); hence its shape:
/// - The CONNECT phase and the close sequence run as boxed futures: their timeouts, login and
///   buffers would otherwise size the future by their largest state; boxed, they cost heap
///   only while they run. The CONNECT phase is boxed before the async block, so the stream
///   and the peer are moved into it instead of also staying in the block's captures.
/// - The loop and its flush are written inline, not as nested `async fn`s: an async fn keeps
///   both its arguments and their bindings across every await, and its future sits next to
///   the caller's locals (672 bytes in all here, 1,200 as `run`/`flush` with the old session).
pub fn serve_connection<S>(
    stream: S,
    peer: PeerInfo,
    broker: BrokerHandle,
    registry: Arc<Registry>,
    config: Arc<MqttConfig>,
    mut shutdown: watch::Receiver<bool>,
) -> impl Future<Output = ()> + Send + 'static
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let accepting = Box::pin(accept(stream, peer, broker, registry, config));
    async move {
        let Some(Live {
            mut stream,
            mut rbuf,
            mut session,
            tx,
            mut rx,
            mut kick_rx,
            peer,
            broker,
            registry,
        }) = accepting.await
        else {
            return;
        };
        let level = session.level();
        let max = session.config().max_packet_size as usize;
        let mut kick_open = true;
        let (end, takeover) = 'run: {
            // Clients may send packets right behind CONNECT without waiting for the CONNACK.
            if let Err(e) = process_input(&mut rbuf, level, max, &mut session) {
                break 'run (e, None);
            }
            let mut gate: Option<SubscribeGate> = None;
            // The last read carried publishes (and no SUBSCRIBE).
            let mut publishes_read = false;
            loop {
                if let Some(stored) = session.take_stored() {
                    registry.persist_live(session.client_id(), stored);
                }
                // Ops first (a SUBACK waits for its bindings' bind-ok), then packets, then the
                // write-window credit of what was written.
                if std::mem::take(&mut publishes_read) {
                    yield_to_subscribes(&registry).await;
                }
                if tx.send(session.take_ops()).await.is_err() {
                    break 'run (End::BrokerGone, None);
                }
                // The bindings are in the broker's queue: publishes read later follow them.
                drop(gate.take());
                {
                    let packets = session.take_packets();
                    if let Err(e) = write_packets(&mut stream, &packets, level).await {
                        break 'run (End::Io(e), None);
                    }
                }
                session.flushed();
                if tx.send(session.take_ops()).await.is_err() {
                    break 'run (End::BrokerGone, None);
                }
                if rbuf.is_empty() {
                    rbuf = BytesMut::new();
                }
                if session.disconnected() {
                    break 'run (End::Disconnected, None);
                }
                let deadline = session
                    .deadline()
                    .map(|d| Instant::now() + Duration::from_millis(d.saturating_sub(now_ms())));
                let reading = !session.read_paused();
                tokio::select! {
                    biased;
                    changed = shutdown.changed() => {
                        if changed.is_err() || *shutdown.borrow() {
                            break 'run (End::Close(CloseError::new(
                                DisconnectReasonCode::ServerShuttingDown,
                                "server shutting down",
                            )), None);
                        }
                    }
                    kick = &mut kick_rx, if kick_open => match kick {
                        Ok(done) => {
                            break 'run (End::Close(CloseError::new(
                                DisconnectReasonCode::SessionTakenOver,
                                "session taken over by a new connection with the same client id",
                            )), Some(done));
                        }
                        Err(_) => kick_open = false,
                    },
                    batch = rx.recv() => {
                        let Some(batch) = batch else { break 'run (End::BrokerGone, None) };
                        let now = now_ms();
                        let mut next = Some(batch);
                        let mut n = 0;
                        while let Some(batch) = next.take() {
                            for effect in batch {
                                if let Err(e) = session.handle_effect(now, effect) {
                                    break 'run (e.into(), None);
                                }
                            }
                            n += 1;
                            if n < MAX_BATCHES {
                                next = rx.try_recv();
                            }
                        }
                    }
                    read = read_some(&mut stream, &mut rbuf), if reading => match read {
                        Ok(0) => break 'run (End::Eof, None),
                        Ok(_) => {
                            // A SUBSCRIBE at the head of what was read: publishers read from
                            // now on wait for it before decoding it (which takes a while).
                            if gate.is_none() && rbuf.first().is_some_and(|b| b >> 4 == 8) {
                                gate = Some(SubscribeGate::new(&registry));
                            }
                            if let Err(e) = process_input(&mut rbuf, level, max, &mut session) {
                                break 'run (e, None);
                            }
                            if gate.is_some() {
                                // Held until the bindings are sent (loop top).
                            } else if session.binds_pending() {
                                gate = Some(SubscribeGate::new(&registry));
                            } else if session.publishes_pending() {
                                publishes_read = true;
                            }
                        }
                        Err(e) => break 'run (End::Io(e), None),
                    },
                    _ = sleep_until(deadline.unwrap_or_else(Instant::now)), if deadline.is_some() => {
                        if let Err(e) = session.on_timeout(now_ms()) {
                            break 'run (e.into(), None);
                        }
                    }
                }
            }
        };
        let live = Live {
            stream,
            rbuf,
            session,
            tx,
            rx,
            kick_rx,
            peer,
            broker,
            registry,
        };
        Box::pin(close(live, end, takeover)).await;
    }
}

/// Reads CONNECT, checks it and logs in; `None` when the connection was refused or closed.
async fn accept<S>(
    mut stream: S,
    peer: PeerInfo,
    broker: BrokerHandle,
    registry: Arc<Registry>,
    config: Arc<MqttConfig>,
) -> Option<Live<S>>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let max = config.max_packet_size as usize;
    let mut rbuf = BytesMut::new();
    let (mut connect, bridge) = match timeout(
        config.connect_timeout,
        read_connect(&mut stream, &mut rbuf, max),
    )
    .await
    {
        Ok(Ok(c)) => c,
        Ok(Err(End::Close(e))) => {
            if let Some(level) = e.text.strip_prefix("unsupported protocol level ") {
                // MQTT-3.1.2-2: CONNACK 0x01 (v3 framing: the client is no v5 client).
                tracing::warn!(peer = %peer.addr, "MQTT CONNECT refused: protocol level {}", Escaped(level));
                let _ = timeout(CLOSE_TIMEOUT, async {
                    stream.write_all(&[0x20, 2, 0, 1]).await?;
                    stream.flush().await
                })
                .await;
            } else {
                tracing::warn!(peer = %peer.addr, "MQTT connection closed before CONNECT: {}", Escaped(&e.to_string()));
            }
            return None;
        }
        Ok(Err(_)) => {
            tracing::debug!(peer = %peer.addr, "MQTT socket closed before CONNECT");
            return None;
        }
        Err(_) => {
            tracing::warn!(peer = %peer.addr, "no MQTT CONNECT within {:?}; closing", config.connect_timeout);
            return None;
        }
    };
    let (_, level) = connect.protocol.to_pair();
    // A verified TLS client certificate names the user (Mosquitto's use_identity_as_username):
    // the CONNECT's user name and password are replaced, so the session acts as that user.
    let certified = match &peer.identity {
        Some(identity) if config.use_identity_as_username => {
            connect.username = Some(identity.as_str().into());
            connect.password = None;
            true
        }
        // No verified certificate (a plain listener, or TLS without client certificates):
        // the CONNECT's own credentials.
        _ => false,
    };
    let info = match check_connect(&connect, peer.is_loopback, &config, || registry.assign_id()) {
        Ok(i) => i,
        Err(code) => {
            tracing::warn!(peer = %peer.addr, client_id = %Escaped(&connect.client_id), "MQTT CONNECT refused: {code:?}");
            let _ = timeout(
                CLOSE_TIMEOUT,
                write_packets(&mut stream, &[refusal(code).into()], level),
            )
            .await;
            return None;
        }
    };
    let login = match (certified, credentials(&connect)) {
        (true, Ok((user, _))) => broker
            .authenticate_certified(user, peer.is_loopback, Some(&config.vhost))
            .await
            .map_err(|_| None)
            .and_then(|r| r.map_err(Some)),
        (false, Ok((user, password))) => broker
            .authenticate(user, password, peer.is_loopback, Some(&config.vhost))
            .await
            .map_err(|_| None)
            .and_then(|r| r.map_err(Some)),
        (_, Err(_)) => Err(None),
    };
    let mut info = info;
    info.bridge = bridge;
    if bridge {
        tracing::info!(peer = %peer.addr, client_id = %Escaped(&connect.client_id), "MQTT bridge connected (Mosquitto's try_private): its subscriptions are no-local");
    }
    let e = match login {
        Ok(login) => {
            info.permissions = login.permissions;
            None
        }
        Err(e) => Some(e),
    };
    if let Some(e) = e {
        let code = match e {
            Some(
                LoginError::LoopbackOnly(_)
                | LoginError::VhostRefused { .. }
                | LoginError::NoSuchVhost(_),
            ) => ConnectReasonCode::NotAuthorized,
            _ => ConnectReasonCode::BadUserNameOrPassword,
        };
        let why = e.map_or_else(|| "malformed credentials".to_string(), |e| e.to_string());
        tracing::warn!(peer = %peer.addr, client_id = %Escaped(&connect.client_id), "MQTT login refused: {}", Escaped(&why));
        let _ = timeout(
            CLOSE_TIMEOUT,
            write_packets(&mut stream, &[refusal(code).into()], level),
        )
        .await;
        return None;
    }
    drop(connect);
    let addr: Arc<str> = peer.addr.as_str().into();
    let link = broker.connect();
    link.tx.describe(warren_runtime::ConnMeta {
        // CONNECT's protocol level: 3 = 3.1, 4 = 3.1.1, 5 = 5.0.
        protocol: match level {
            5 => "MQTT 5-0",
            4 => "MQTT 3.1.1",
            _ => "MQTT 3.1",
        },
        peer: addr.clone(),
        tls: peer.tls,
        client_properties: None,
        client_id: Some(info.client_id.clone()),
        heartbeat: info.keep_alive_s,
        frame_max: 0,
        connected_at: warren_runtime::unix_ms(),
    });
    let client_id = info.client_id.clone();
    let (kick_tx, kick_rx) = oneshot::channel();
    if let Some(prev) = registry.claim(&client_id, link.id, kick_tx) {
        let (done_tx, done_rx) = oneshot::channel();
        if prev.send(done_tx).is_ok() {
            let _ = timeout(TAKEOVER_TIMEOUT, done_rx).await;
        }
    }
    let mut record = registry.take_session(&client_id);
    if let Some(cluster) = registry.cluster() {
        // One session per client id across the cluster: the cluster's state of it wins
        // over this node's copy, which may be older (it was resumed elsewhere since).
        registry.begin_claim(&client_id);
        match cluster.claim(&client_id).await {
            Ok(stored) => {
                record = stored.map(|s| SessionRecord::from_stored(s, now_ms()));
                registry.end_claim(&client_id, cluster.owns(&client_id));
            }
            Err(why) => {
                registry.end_claim(&client_id, true);
                tracing::warn!(client_id = %Escaped(&client_id), "MQTT session not claimed in the cluster, going on with this node's state: {}", Escaped(&why))
            }
        }
    }
    let session = Session::new(info, record, now_ms(), config);
    tracing::info!(peer = %peer.addr, client_id = %Escaped(&client_id), level, "accepted MQTT connection");
    Some(Live {
        stream,
        rbuf,
        session,
        tx: link.tx,
        rx: link.rx,
        kick_rx,
        peer: addr,
        broker,
        registry,
    })
}

/// The close sequence: will, last ops, barrier, release, goodbye packets.
async fn close<S>(live: Live<S>, end: End, takeover: Option<oneshot::Sender<()>>)
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let Live {
        mut stream,
        mut session,
        tx,
        mut rx,
        peer,
        broker,
        registry,
        ..
    } = live;
    let (registry, peer) = (&registry, &peer);
    let config = session.config().clone();
    let client_id = session.client_id().clone();
    let level = session.level();
    match &end {
        End::Disconnected => {
            tracing::info!(peer = %peer, client_id = %Escaped(&client_id), "MQTT client disconnected")
        }
        End::Eof => {
            tracing::info!(peer = %peer, client_id = %Escaped(&client_id), "MQTT client went away without DISCONNECT")
        }
        End::Io(e) => {
            tracing::warn!(peer = %peer, client_id = %Escaped(&client_id), "MQTT connection I/O error: {}", Escaped(&e.to_string()))
        }
        End::BrokerGone => tracing::debug!(peer = %peer, "broker stopped"),
        End::Close(e) => match e.reason {
            DisconnectReasonCode::SessionTakenOver | DisconnectReasonCode::ServerShuttingDown => {
                tracing::info!(peer = %peer, client_id = %Escaped(&client_id), "MQTT connection closed: {}", Escaped(&e.to_string()))
            }
            _ => {
                tracing::warn!(peer = %peer, client_id = %Escaped(&client_id), "MQTT connection closed: {}", Escaped(&e.to_string()))
            }
        },
    }
    let now = now_ms();
    // Held SUBACKs too: these packets are written after the barrier below, by which their
    // bindings were applied.
    let mut last = session.take_all_packets();
    if let End::Close(e) = &end {
        last.extend(session.disconnect_packet(e.reason).map(codec::Out::from));
    }
    let record = session.close(now);
    if record.is_none() {
        if session.is_stored() {
            // The session ended with its connection (expiry 0, maybe set by DISCONNECT).
            registry.persist_session(&client_id, None);
        } else {
            registry.closed_without_session(&client_id);
        }
    }
    // The runtime applies a dropped connection's disconnect ahead of requests still queued
    // (it drains control messages first), which would lose the will and even earlier
    // bindings. A channel.open on a spare channel is a barrier: once its reply is back, every
    // op sent before it has been applied.
    let mut ops = session.take_ops();
    ops.push((BARRIER_CHANNEL, Op::ChannelOpen));
    if tx.send(ops).await.is_ok() {
        let _ = timeout(CLOSE_TIMEOUT, async {
            while let Some(batch) = rx.recv().await {
                if batch.iter().any(|e| {
                    matches!(e, Effect::Reply { ch, .. } if ch.channel == BARRIER_CHANNEL)
                        || matches!(e, Effect::ConnectionError { .. })
                }) {
                    return;
                }
            }
        })
        .await;
    }
    // The core releases the session (requeueing unacked deliveries) before a new owner of the
    // client id, waiting on `takeover`, declares the same queue.
    let _ = tx.send(vec![(0, Op::ConnectionClose)]).await;
    // Taken over: the session goes on in the new connection, which cancels a delayed will
    // (MQTT 5 3.1.3.2.2); it claimed the client id before this close, so the will must not
    // even be scheduled.
    let taken_over = takeover.is_some();
    if let Some(mut r) = record {
        if taken_over {
            r.will = None;
        }
        registry.store_session(client_id.clone(), r);
    }
    if let Some((delay, will, user)) = session.take_delayed_will()
        && !taken_over
    {
        registry.delay_will(client_id.clone(), tx.conn());
        tokio::spawn(publish_delayed_will(
            DelayedWill {
                delay_ms: u64::from(delay) * 1000,
                will,
                user,
            },
            client_id.clone(),
            tx.conn(),
            broker.clone(),
            registry.clone(),
            config.clone(),
        ));
    }
    registry.release(&client_id, tx.conn());
    if let Some(done) = takeover {
        let _ = done.send(());
    }
    if !matches!(end, End::Eof | End::Io(_)) {
        let _ = timeout(CLOSE_TIMEOUT, async {
            write_packets(&mut stream, &last, level).await?;
            stream.shutdown().await?;
            linger(&mut stream).await
        })
        .await;
    }
}

/// Bytes a closing connection reads and discards after its DISCONNECT at most.
const LINGER_MAX_BYTES: usize = 256 * 1024;

/// Reads and discards what the client still sends after the server's DISCONNECT (its write
/// side already shut), until the client closes, [`LINGER_MAX_BYTES`] or the caller's timeout.
/// Closing a socket with bytes arriving makes the kernel answer with a reset, and a reset
/// makes the client's kernel drop what it had received but not read yet: the DISCONNECT with
/// its reason code. A client that pipelines (a PUBREL for every PUBREC, as paho's test client
/// does when it exceeds Receive Maximum) would see a reset instead of reason 0x93.
async fn linger<S: AsyncRead + Unpin>(stream: &mut S) -> std::io::Result<()> {
    let mut buf = [0u8; 4096];
    let mut read = 0;
    while read < LINGER_MAX_BYTES {
        match stream.read(&mut buf).await? {
            0 => break,
            n => read += n,
        }
    }
    Ok(())
}

/// A will left for later by a closed session.
pub(crate) struct DelayedWill {
    pub(crate) delay_ms: u64,
    pub(crate) will: v5::LastWill,
    /// Published as the user the client logged in as.
    pub(crate) user: String,
}

/// Publishes a will after its delay, through a connection of its own (the client's is gone),
/// unless the client id connected again meanwhile.
pub(crate) async fn publish_delayed_will(
    DelayedWill {
        delay_ms,
        will,
        user,
    }: DelayedWill,
    client_id: Arc<str>,
    left_by: warren_core::ids::ConnId,
    broker: BrokerHandle,
    registry: Arc<Registry>,
    config: Arc<MqttConfig>,
) {
    tokio::time::sleep(Duration::from_millis(delay_ms)).await;
    if !registry.take_will(&client_id, left_by) {
        return;
    }
    publish_will(&will, user, &client_id, &broker, &config).await;
    registry.will_published(&client_id);
}

/// Publishes a will now, as `user`, through a connection of its own; returns once the
/// publish was applied (or after a bounded wait).
pub(crate) async fn publish_will(
    will: &v5::LastWill,
    user: String,
    client_id: &str,
    broker: &BrokerHandle,
    config: &MqttConfig,
) {
    let link = broker.connect();
    // An MQTT connection to the runtime: in a cluster a retained will is replicated as a
    // client's retained publish is.
    link.tx.describe(warren_runtime::ConnMeta {
        protocol: "MQTT 5-0",
        peer: "will".into(),
        tls: false,
        client_properties: None,
        client_id: Some(client_id.into()),
        heartbeat: 0,
        frame_max: 0,
        connected_at: warren_runtime::unix_ms(),
    });
    let mut rx = link.rx;
    let mut ops = vec![
        (
            0,
            Op::ConnectionOpen {
                vhost: config.vhost.clone(),
                user,
                cancel_notify: false,
            },
        ),
        (crate::session::CHANNEL, Op::ChannelOpen),
    ];
    for op in crate::session::will_ops(will, now_ms()) {
        ops.push((crate::session::CHANNEL, op));
    }
    ops.push((BARRIER_CHANNEL, Op::ChannelOpen));
    if link.tx.send(ops).await.is_err() {
        return;
    }
    // As at the end of a connection: wait until the publish was applied.
    let _ = timeout(CLOSE_TIMEOUT, async {
        while let Some(batch) = rx.recv().await {
            if batch
                .iter()
                .any(|e| matches!(e, Effect::Reply { ch, .. } if ch.channel == BARRIER_CHANNEL))
            {
                return;
            }
        }
    })
    .await;
    let _ = link.tx.send(vec![(0, Op::ConnectionClose)]).await;
    tracing::debug!(client_id = %Escaped(client_id), "delayed will published");
}

/// Decodes and handles every complete packet in `rbuf`.
fn process_input(
    rbuf: &mut BytesMut,
    level: Level,
    max: usize,
    session: &mut Session,
) -> Result<(), End> {
    let now = now_ms();
    while let Some(p) = codec::decode(rbuf, Some(level), max)? {
        session.handle(now, p)?;
        if session.disconnected() {
            break;
        }
    }
    Ok(())
}

/// Lets other connections' SUBSCRIBEs read at about the same time go to the broker before
/// this read's publishes. Sockets that became readable together wake their tasks together,
/// and tokio runs the last one woken first (its LIFO slot), or another worker runs it
/// alongside: a publish whose bytes arrived just after another client's SUBSCRIBE was
/// routed before that SUBSCRIBE's bindings reached the broker, and missed the new
/// subscription in half the rounds (issue 43, item 15; Mosquitto, one thread reading in
/// arrival order, has no such window). One trip through the scheduler per read that
/// carried publishes (not per publish), a few more only while a SUBSCRIBE is in flight.
async fn yield_to_subscribes(registry: &Registry) {
    tokio::task::yield_now().await;
    for _ in 0..MAX_SUBSCRIBE_YIELDS {
        if !registry.subscribing() {
            return;
        }
        tokio::task::yield_now().await;
    }
}

/// The bound on a publisher's wait for SUBSCRIBEs in flight, in scheduler turns (each a few
/// microseconds; a SUBSCRIBE takes one turn of its task from read to send, tens of
/// microseconds in a debug build): many clients subscribing all the time never stall
/// publishers for long.
const MAX_SUBSCRIBE_YIELDS: usize = 256;

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    /// One read takes at most `MAX_READ` bytes however much is waiting and however much room
    /// the buffer has (a buffer grown by one large packet keeps its capacity while packets
    /// behind it remain): a read is one op batch, and the batches in flight when a
    /// flow-control pause reaches the publisher are what it routes past the pause.
    #[tokio::test]
    async fn a_read_takes_at_most_max_read_whatever_the_buffer_capacity() {
        let (mut client, mut server) = tokio::io::duplex(1 << 20);
        client.write_all(&vec![0x30; 256 * 1024]).await.unwrap();
        let mut buf = BytesMut::with_capacity(1 << 20);
        buf.put_u8(0x30);
        let mut total = 0;
        for _ in 0..4 {
            let n = read_some(&mut server, &mut buf).await.unwrap();
            assert!(n <= MAX_READ, "one read took {n} bytes");
            total += n;
        }
        assert_eq!(buf.len(), 1 + total);
        // An empty buffer reads through the stack chunk, holding no heap.
        let mut empty = BytesMut::new();
        let n = read_some(&mut server, &mut empty).await.unwrap();
        assert!(n > 0 && n <= STACK_READ);
    }
}
