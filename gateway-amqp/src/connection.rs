//! One AMQP connection: a task that turns frames into core operations and effects into
//! frames, with heartbeats, content assembly and error handling.
//!
//! Generic over the byte stream, so the same code serves TCP sockets and in-process
//! (socketless) connections for benchmarks.

use crate::codec::{self, Frame};
use crate::config::AmqpConfig;
use crate::error::GatewayError;
use crate::handshake::{self, Negotiated, Refused};
use crate::methods::{self, Incoming};
use amq_protocol::protocol::{AMQPClass, basic, connection};
use bytes::{Bytes, BytesMut};
use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::watch;
use tokio::time::{Instant, sleep_until, timeout};
use warren_core::command::{Op, Publish};
use warren_core::effect::{Effect, Reply};
use warren_core::error::ErrorCode;
use warren_core::escape::Escaped;
use warren_runtime::{BrokerHandle, CommandSender};

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

/// A read buffer larger than this is released when it empties: idle connections hold no
/// big buffers.
const IDLE_BUFFER: usize = 64 * 1024;
/// After a client's connection.close, how long we keep reading (and discarding) until the
/// client closes the socket, and how much we read at most meanwhile.
const CLOSE_LINGER: std::time::Duration = std::time::Duration::from_secs(1);
const CLOSE_LINGER_BYTES: usize = 1024 * 1024;
/// Read chunk for an active connection.
const READ_CHUNK: usize = 64 * 1024;
/// Read chunk for a connection that sends little.
const SMALL_READ: usize = 4 * 1024;
/// Effect batches or encoded bytes gathered into one write.
const MAX_BATCHES_PER_WRITE: usize = 64;
const MAX_WRITE_BYTES: usize = 1024 * 1024;
/// Bodies are assembled in a buffer this large at first, growing geometrically after, so a
/// client announcing 128 MiB cannot make us allocate it before sending it.
const INITIAL_BODY: u64 = 1024 * 1024;
/// Single-frame bodies shorter than this are copied out of the read buffer. Kept as a slice,
/// a small body would pin the whole read allocation (up to `READ_CHUNK`) for as long as the
/// message sits in a queue: a slow publisher's 100-byte messages would hold 4-64 KiB each,
/// invisible to the core's memory accounting, which counts body bytes.
const COPY_BODY_BELOW: usize = 32 * 1024;
/// How long we wait for `connection.close-ok` after sending `connection.close`.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(3);

/// Serves one connection until it closes.
pub async fn serve_connection<S>(
    stream: S,
    peer: PeerInfo,
    broker: BrokerHandle,
    config: Arc<AmqpConfig>,
    shutdown: watch::Receiver<bool>,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (mut rd, mut wr) = tokio::io::split(stream);
    let mut rbuf = BytesMut::with_capacity(SMALL_READ);
    let mut negotiated = match timeout(
        config.handshake_timeout,
        handshake::run(&mut rd, &mut wr, &mut rbuf, &peer, &config, &broker),
    )
    .await
    {
        Ok(Ok(n)) => n,
        Ok(Err(Refused::Io(e))) => {
            tracing::debug!(peer = %peer.addr, "connection closed during handshake: {e}");
            return;
        }
        Ok(Err(Refused::Closed(code, text))) => {
            tracing::warn!(peer = %peer.addr, code = code.code(), "handshake refused: {}", Escaped(&text));
            return;
        }
        Err(_) => {
            tracing::warn!(
                peer = %peer.addr,
                "handshake not completed within {:?}; closing",
                config.handshake_timeout
            );
            return;
        }
    };
    tracing::info!(peer = %peer.addr, user = %Escaped(&negotiated.user), "accepted AMQP connection");
    let link = broker.connect();
    link.tx.describe(warren_runtime::ConnMeta {
        protocol: "AMQP 0-9-1",
        peer: peer.addr.as_str().into(),
        tls: peer.tls,
        client_properties: Some(Box::new(std::mem::take(&mut negotiated.client_properties))),
        client_id: None,
        heartbeat: negotiated.heartbeat_secs,
        frame_max: negotiated.frame_max,
        connected_at: warren_runtime::unix_ms(),
    });
    let mut session = Session::new(negotiated, link.tx, peer, config, broker.clone());
    let end = session.run(&mut rd, &mut wr, rbuf, link.rx, shutdown).await;
    let _ = session.tx.send(vec![(0, Op::ConnectionClose)]).await;
    if matches!(end, End::ClientClosed) {
        // The client closes the socket once it has our close-ok. Frames it wrote meanwhile
        // (an ack racing its own close, as PerfTest's consumers do) must not meet a closed
        // socket: the client would log a broken pipe. Read them away first, bounded.
        let _ = timeout(CLOSE_LINGER, async {
            let mut discard = [0u8; 4096];
            let mut read = 0;
            while read < CLOSE_LINGER_BYTES {
                match rd.read(&mut discard).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => read += n,
                }
            }
        })
        .await;
    }
    match end {
        End::ClientClosed => {
            tracing::info!(peer = %session.peer.addr, "connection closed by client")
        }
        End::Eof => tracing::info!(peer = %session.peer.addr, "client went away without closing"),
        End::Io(e) => tracing::warn!(peer = %session.peer.addr, "connection I/O error: {e}"),
        End::Closed(code, text) => tracing::warn!(
            peer = %session.peer.addr,
            code,
            "connection closed by the server: {}",
            Escaped(&text)
        ),
        End::BrokerGone => tracing::debug!(peer = %session.peer.addr, "broker stopped"),
        End::MissedHeartbeats(secs) => tracing::warn!(
            peer = %session.peer.addr,
            "missed heartbeats from client, timeout: {secs}s"
        ),
    }
}

/// How a session ended.
enum End {
    ClientClosed,
    Eof,
    Io(std::io::Error),
    /// We sent connection.close with this code and text.
    Closed(u16, String),
    BrokerGone,
    /// Nothing received for two heartbeat intervals (seconds): the socket is just closed.
    MissedHeartbeats(u64),
}

impl From<std::io::Error> for End {
    fn from(e: std::io::Error) -> End {
        End::Io(e)
    }
}

/// A message being assembled from publish + header + body frames.
struct Content {
    publish: basic::Publish,
    header: Option<(u64, warren_core::message::Properties)>,
    body: Body,
}

enum Body {
    Empty,
    /// The whole body arrived in one frame (see `own`).
    One(Bytes),
    /// Assembled from several frames. Capacity grows geometrically from at most
    /// `INITIAL_BODY` but never beyond the announced size, so a complete body holds exactly
    /// its length and a client announcing 128 MiB must send it before we allocate it.
    Many(Vec<u8>),
}

impl Body {
    fn len(&self) -> u64 {
        match self {
            Body::Empty => 0,
            Body::One(b) => b.len() as u64,
            Body::Many(b) => b.len() as u64,
        }
    }

    /// Appends a chunk; the caller has checked that the body stays within `total`.
    fn push(&mut self, chunk: Bytes, total: u64) {
        *self = match std::mem::replace(self, Body::Empty) {
            Body::Empty if chunk.len() as u64 == total => Body::One(own(chunk)),
            Body::Empty => {
                let mut b = Vec::with_capacity(total.min(INITIAL_BODY) as usize);
                b.extend_from_slice(&chunk);
                Body::Many(b)
            }
            Body::One(first) => {
                let mut b = Vec::with_capacity(total.min(INITIAL_BODY) as usize);
                extend_within(&mut b, &first, total);
                extend_within(&mut b, &chunk, total);
                Body::Many(b)
            }
            Body::Many(mut b) => {
                extend_within(&mut b, &chunk, total);
                Body::Many(b)
            }
        };
    }

    fn freeze(self) -> Bytes {
        match self {
            Body::Empty => Bytes::new(),
            Body::One(b) => b,
            Body::Many(b) => Bytes::from(b),
        }
    }
}

/// Appends `chunk`, doubling the capacity when it is short but capping it at `total`.
fn extend_within(b: &mut Vec<u8>, chunk: &[u8], total: u64) {
    let needed = b.len() + chunk.len();
    if needed > b.capacity() {
        let cap = usize::try_from(total).unwrap_or(usize::MAX);
        let target = b
            .capacity()
            .saturating_mul(2)
            .max(needed)
            .min(cap.max(needed));
        b.reserve_exact(target - b.len());
    }
    b.extend_from_slice(chunk);
}

/// A body chunk fit to keep: small ones get their own allocation (see `COPY_BODY_BELOW`).
fn own(chunk: Bytes) -> Bytes {
    if chunk.len() < COPY_BODY_BELOW {
        Bytes::copy_from_slice(&chunk)
    } else {
        chunk
    }
}

#[derive(Default)]
struct ChannelState {
    /// We sent channel.close (a channel error) and wait for close-ok; frames are dropped.
    closing: bool,
    content: Option<Content>,
    /// Publisher confirms sent, for collapsing acks.
    confirmed: Confirmed,
    /// The exchange and routing key of the last publish: publishers mostly repeat them, and
    /// sharing the `Arc` saves two allocations and copies per message.
    last_address: Option<(Arc<str>, Arc<str>)>,
}

/// The publisher confirms sent on one channel: every sequence number up to `through` has been
/// confirmed (acked or nacked), `above` holds those confirmed out of order beyond it. A run of
/// acks may collapse into one `multiple` ack only when it starts right after `through`: a
/// `multiple` ack would otherwise also confirm a message still in flight.
#[derive(Default)]
struct Confirmed {
    through: u64,
    /// Empty while the core confirms in order (today it always does).
    above: BTreeSet<u64>,
}

impl Confirmed {
    /// Whether every sequence number before `seq` has been confirmed.
    fn follows(&self, seq: u64) -> bool {
        seq == self.through.saturating_add(1)
    }

    /// Records `first..=last` as confirmed (`first` = 1 for a core-sent `multiple` confirm).
    fn mark(&mut self, first: u64, last: u64) {
        if first <= self.through.saturating_add(1) {
            self.through = self.through.max(last);
            self.above = self.above.split_off(&self.through.saturating_add(1));
        } else {
            self.above.extend(first..=last);
        }
        while self.above.first() == Some(&self.through.saturating_add(1)) {
            self.above.pop_first();
            self.through += 1;
        }
    }
}

struct Session {
    frame_max: u32,
    channel_max: u16,
    heartbeat: Option<Duration>,
    max_message_size: u64,
    tx: CommandSender,
    peer: PeerInfo,
    channels: HashMap<u16, ChannelState>,
    ops: Vec<(u16, Op)>,
    wbuf: BytesMut,
    /// Frames the server wants to send ahead of effects (flow-ok, close-ok for closing
    /// channels).
    last_read: Instant,
    last_write: Instant,
    /// Set when we sent connection.close: code and text.
    closing: Option<(u16, String)>,
    /// Client sent connection.close and got close-ok.
    client_closed: bool,
    vhost: String,
    user: String,
    cancel_notify: bool,
    blocked_notify: bool,
    /// The broker's memory alarm is on.
    blocked: bool,
    /// This connection has published: while blocked, it is not read from (RabbitMQ blocks
    /// publishing connections; consumers keep acking, which is what frees memory).
    published: bool,
    /// The core's flow control paused this (publishing) connection.
    flow_paused: bool,
    /// We told the client connection.blocked (and owe it connection.unblocked).
    blocked_sent: bool,
    /// For `connection.update-secret`: the broker checks the new secret.
    broker: BrokerHandle,
    /// A `connection.update-secret` to answer before reading on (its new secret, its reason).
    new_secret: Option<(Vec<u8>, String)>,
}

impl Session {
    fn new(
        n: Negotiated,
        tx: CommandSender,
        peer: PeerInfo,
        config: Arc<AmqpConfig>,
        broker: BrokerHandle,
    ) -> Session {
        let now = Instant::now();
        Session {
            frame_max: n.frame_max,
            channel_max: n.channel_max,
            heartbeat: (n.heartbeat_secs > 0).then(|| Duration::from_secs(n.heartbeat_secs.into())),
            max_message_size: config.max_message_size,
            tx,
            peer,
            channels: HashMap::new(),
            ops: Vec::new(),
            wbuf: BytesMut::new(),
            last_read: now,
            last_write: now,
            closing: None,
            client_closed: false,
            vhost: n.vhost,
            user: n.user,
            cancel_notify: n.cancel_notify,
            blocked_notify: n.blocked_notify,
            blocked: false,
            published: false,
            flow_paused: false,
            blocked_sent: false,
            broker,
            new_secret: None,
        }
    }

    /// Tells the client connection.blocked once it is blocked: during an alarm and once it
    /// has published, as RabbitMQ does. A connection that only consumes is never told:
    /// clients stop sending everything while blocked (lapin does), and a consumer that
    /// stops acking holds the very memory the alarm waits for.
    fn notify_blocked(&mut self) {
        if self.blocked && self.published && self.blocked_notify && !self.blocked_sent {
            codec::encode_method(&mut self.wbuf, 0, handshake::connection_blocked());
            self.blocked_sent = true;
        }
    }

    /// Whether reading is paused: by the memory alarm (publishers only) or by flow control.
    fn paused(&self) -> bool {
        (self.blocked && self.published) || self.flow_paused
    }

    async fn run<R, W>(
        &mut self,
        rd: &mut R,
        wr: &mut W,
        mut rbuf: BytesMut,
        mut rx: warren_runtime::EffectReceiver,
        mut shutdown: watch::Receiver<bool>,
    ) -> End
    where
        R: AsyncRead + Unpin,
        W: AsyncWrite + Unpin,
    {
        self.ops.push((
            0,
            Op::ConnectionOpen {
                // Kept: connection.update-secret checks the user in its vhost again.
                vhost: self.vhost.clone(),
                user: self.user.clone(),
                cancel_notify: self.cancel_notify,
            },
        ));
        // Bytes the client pipelined behind connection.open.
        if let Err(e) = self.on_frames(&mut rbuf) {
            self.fail(e);
        }
        let mut read_chunk = SMALL_READ;
        let mut watching_shutdown = true;
        loop {
            // Write before returning write-window credit (`Op::Written` in `ops`), so the
            // core never has more than one window of deliveries in flight to this socket.
            if !self.wbuf.is_empty()
                && let Err(e) = self.write(wr).await
            {
                return e.into();
            }
            if let Some(end) = self.flush_ops().await {
                return end;
            }
            if let Some((code, text)) = self.closing.clone() {
                return self.await_close_ok(rd, wr, &mut rbuf, code, text).await;
            }
            if self.client_closed {
                return End::ClientClosed;
            }
            if let Some((secret, reason)) = self.new_secret.take() {
                if let Err(e) = self.update_secret(secret, &reason).await {
                    return e;
                }
                // Then what the client sent behind it.
                if let Err(e) = self.on_frames(&mut rbuf) {
                    self.fail(e);
                }
                continue;
            }
            if rbuf.is_empty() && rbuf.capacity() > IDLE_BUFFER {
                rbuf = BytesMut::new();
            }
            if rbuf.capacity() - rbuf.len() < SMALL_READ {
                rbuf.reserve(read_chunk);
            }
            if *shutdown.borrow_and_update() {
                self.close_connection(
                    ErrorCode::ConnectionForced,
                    "CONNECTION_FORCED - broker shutdown".into(),
                    (0, 0),
                );
                continue;
            }
            let heartbeat_at = self.heartbeat.map(|h| self.next_heartbeat_check(h));
            // Not biased: under a steady stream of deliveries a biased select would never read
            // the socket, so the client's acks and heartbeats would go unread.
            tokio::select! {
                changed = shutdown.changed(), if watching_shutdown => {
                    // A dropped sender means nobody can ask us to stop: stop watching (the
                    // branch would otherwise be ready forever). A change is handled above.
                    watching_shutdown = changed.is_ok();
                }
                batch = rx.recv() => {
                    let Some(batch) = batch else { return End::BrokerGone };
                    self.on_effects(batch, &mut rx);
                }
                read = rd.read_buf(&mut rbuf), if !self.paused() => {
                    match read {
                        Ok(0) => return End::Eof,
                        Ok(n) => {
                            self.last_read = Instant::now();
                            read_chunk = if n >= read_chunk { READ_CHUNK } else { SMALL_READ };
                            if let Err(e) = self.on_frames(&mut rbuf) {
                                self.fail(e);
                            }
                            // It may have published just now, during an alarm.
                            self.notify_blocked();
                        }
                        Err(e) => return e.into(),
                    }
                }
                _ = sleep_until(heartbeat_at.unwrap_or_else(Instant::now)), if heartbeat_at.is_some() => {
                    if let Some(end) = self.on_heartbeat_timer() {
                        return end;
                    }
                }
            }
        }
    }

    fn next_heartbeat_check(&self, h: Duration) -> Instant {
        (self.last_write + h / 2).min(self.last_read + h * 2)
    }

    /// Sends a heartbeat when we have been quiet for half the interval; gives up on a peer
    /// silent for two intervals.
    fn on_heartbeat_timer(&mut self) -> Option<End> {
        let h = self.heartbeat?;
        let now = Instant::now();
        if self.paused() {
            // We are not reading, so the client's heartbeats sit unread in the socket; its
            // silence proves nothing until we read again.
            self.last_read = now;
        }
        if now >= self.last_read + h * 2 {
            return Some(End::MissedHeartbeats(h.as_secs()));
        }
        if now >= self.last_write + h / 2 {
            codec::encode_heartbeat(&mut self.wbuf);
        }
        None
    }

    async fn flush_ops(&mut self) -> Option<End> {
        if self.ops.is_empty() {
            return None;
        }
        let ops = std::mem::take(&mut self.ops);
        match self.tx.send(ops).await {
            Ok(()) => None,
            Err(_) => Some(End::BrokerGone),
        }
    }

    async fn write<W: AsyncWrite + Unpin>(&mut self, wr: &mut W) -> std::io::Result<()> {
        wr.write_all(&self.wbuf).await?;
        wr.flush().await?;
        self.last_write = Instant::now();
        if self.wbuf.capacity() > 4 * IDLE_BUFFER {
            self.wbuf = BytesMut::new();
        } else {
            self.wbuf.clear();
        }
        Ok(())
    }

    /// After sending connection.close: ignore everything until close-ok, for a bounded time.
    /// A simultaneous close from the client gets its close-ok. Input that no longer frames
    /// (the error was a framing error) is read and discarded rather than left unread: closing
    /// a socket with unread input resets it, and the reset can destroy our connection.close
    /// before the client reads it.
    async fn await_close_ok<R, W>(
        &mut self,
        rd: &mut R,
        wr: &mut W,
        rbuf: &mut BytesMut,
        code: u16,
        text: String,
    ) -> End
    where
        R: AsyncRead + Unpin,
        W: AsyncWrite + Unpin,
    {
        let deadline = Instant::now() + CLOSE_TIMEOUT;
        loop {
            loop {
                match codec::decode(rbuf, self.frame_max) {
                    Ok(Some(Frame::Method(
                        0,
                        AMQPClass::Connection(connection::AMQPMethod::CloseOk(_)),
                    ))) => return End::Closed(code, text),
                    Ok(Some(Frame::Method(
                        0,
                        AMQPClass::Connection(connection::AMQPMethod::Close(_)),
                    ))) => {
                        let mut buf = BytesMut::new();
                        codec::encode_method(&mut buf, 0, handshake::connection_close_ok());
                        let _ =
                            timeout(deadline.saturating_duration_since(Instant::now()), async {
                                wr.write_all(&buf).await?;
                                wr.flush().await
                            })
                            .await;
                        return End::Closed(code, text);
                    }
                    Ok(Some(_)) => continue,
                    Ok(None) => break,
                    Err(_) => {
                        rbuf.clear();
                        break;
                    }
                }
            }
            if rbuf.capacity() > IDLE_BUFFER {
                *rbuf = BytesMut::new();
            }
            rbuf.reserve(SMALL_READ);
            match timeout(
                deadline.saturating_duration_since(Instant::now()),
                rd.read_buf(rbuf),
            )
            .await
            {
                Ok(Ok(n)) if n > 0 => {}
                _ => return End::Closed(code, text),
            }
        }
    }

    /// `connection.update-secret` (RabbitMQ 3.8+, an OAuth 2 token refresh): the new secret
    /// is the user's password from now on, so the broker checks it (and the user's access
    /// to this connection's vhost) again; update-secret-ok if it holds, else the connection
    /// closes with 530 as RabbitMQ's does when a backend refuses the secret.
    async fn update_secret(&mut self, secret: Vec<u8>, reason: &str) -> Result<(), End> {
        let refused = match String::from_utf8(secret) {
            Ok(password) => self
                .broker
                .authenticate(
                    &self.user,
                    &password,
                    self.peer.is_loopback,
                    Some(&self.vhost),
                )
                .await
                .map_err(|_| End::BrokerGone)?
                .err()
                .map(|e| e.to_string()),
            Err(_) => Some("the new secret is not UTF-8".into()),
        };
        let user = Escaped(&self.user);
        match refused {
            None => {
                tracing::info!(peer = %self.peer.addr, %user, reason = %Escaped(reason), "updated secret");
                codec::encode_method(
                    &mut self.wbuf,
                    0,
                    AMQPClass::Connection(connection::AMQPMethod::UpdateSecretOk(
                        connection::UpdateSecretOk {},
                    )),
                );
            }
            Some(why) => {
                tracing::warn!(
                    peer = %self.peer.addr,
                    %user,
                    "secret update refused: {}",
                    Escaped(&why)
                );
                self.close_connection(
                    ErrorCode::NotAllowed,
                    "NOT_ALLOWED - New secret was refused by one of the backends".into(),
                    (10, 70),
                );
            }
        }
        Ok(())
    }

    /// A connection-level error: send connection.close and stop processing input.
    fn fail(&mut self, e: GatewayError) {
        let text = e.to_string();
        self.close_connection(e.code(), text, (0, 0));
    }

    fn close_connection(&mut self, code: ErrorCode, text: String, ids: (u16, u16)) {
        if self.closing.is_some() {
            return;
        }
        codec::encode_method(
            &mut self.wbuf,
            0,
            handshake::connection_close(code.code(), &text, ids),
        );
        self.closing = Some((code.code(), text));
    }

    /// Decodes and handles every complete frame in `rbuf`.
    fn on_frames(&mut self, rbuf: &mut BytesMut) -> Result<(), GatewayError> {
        // An update-secret is answered before anything after it is read.
        while self.closing.is_none() && !self.client_closed && self.new_secret.is_none() {
            let frame = match codec::decode(rbuf, self.frame_max) {
                Ok(Some(frame)) => frame,
                Ok(None) => return Ok(()),
                Err(GatewayError::NotUtf8 { channel, ids, text }) => {
                    self.on_not_utf8(channel, ids, text)?;
                    continue;
                }
                Err(e) => return Err(e),
            };
            self.on_frame(frame)?;
        }
        Ok(())
    }

    /// A method with a short string that is not UTF-8 (a queue or exchange name, a
    /// routing key): a bad argument, so its channel's error (406) as any other bad
    /// argument is, and the connection and its other channels carry on. On channel 0, on
    /// a channel that is not open or inside a message's content, it stays a connection
    /// error.
    fn on_not_utf8(&mut self, ch: u16, ids: (u16, u16), text: String) -> Result<(), GatewayError> {
        let Some(state) = self
            .channels
            .get_mut(&ch)
            .filter(|s| ch != 0 && s.content.is_none())
        else {
            return Err(GatewayError::NotUtf8 {
                channel: ch,
                ids,
                text,
            });
        };
        if state.closing {
            // Only the close handshake matters on a channel we are closing.
            return Ok(());
        }
        state.closing = true;
        let text = format!("PRECONDITION_FAILED - {text}");
        tracing::warn!(peer = %self.peer.addr, channel = ch, "{text}");
        codec::encode_method(
            &mut self.wbuf,
            ch,
            methods::channel_close(ErrorCode::PreconditionFailed.code(), &text, ids),
        );
        Ok(())
    }

    fn on_frame(&mut self, frame: Frame) -> Result<(), GatewayError> {
        match frame {
            Frame::Heartbeat(0) => Ok(()),
            Frame::Heartbeat(ch) => Err(GatewayError::Frame(format!(
                "heartbeat frame on channel {ch}"
            ))),
            Frame::Method(0, method) => self.on_connection_method(method),
            Frame::Method(ch, method) => self.on_channel_method(ch, method),
            Frame::Header(ch, header) => self.on_header(ch, header),
            Frame::Body(ch, body) => self.on_body(ch, body),
        }
    }

    fn on_connection_method(&mut self, method: AMQPClass) -> Result<(), GatewayError> {
        match method {
            AMQPClass::Connection(connection::AMQPMethod::Close(_)) => {
                self.ops.push((0, Op::ConnectionClose));
                codec::encode_method(&mut self.wbuf, 0, handshake::connection_close_ok());
                self.client_closed = true;
                Ok(())
            }
            AMQPClass::Connection(connection::AMQPMethod::CloseOk(_)) => Ok(()),
            AMQPClass::Connection(connection::AMQPMethod::UpdateSecret(u)) => {
                self.new_secret = Some((u.new_secret.as_bytes().to_vec(), u.reason.to_string()));
                Ok(())
            }
            other => Err(GatewayError::CommandInvalid(format!(
                "unexpected method on channel 0: {}",
                method_name(&other)
            ))),
        }
    }

    fn on_channel_method(&mut self, ch: u16, method: AMQPClass) -> Result<(), GatewayError> {
        if ch > self.channel_max {
            return Err(GatewayError::Channel(format!(
                "channel {ch} exceeds the negotiated channel_max {}",
                self.channel_max
            )));
        }
        // Only error paths need the method's name: formatting it for every publish and ack
        // cost ~10% of the broker's CPU.
        let is_open = matches!(
            method,
            AMQPClass::Channel(amq_protocol::protocol::channel::AMQPMethod::Open(_))
        );
        let in_content = self.channels.get(&ch).is_some_and(|s| s.content.is_some());
        if in_content || (!is_open && !self.channels.contains_key(&ch)) {
            let name = method_name(&method);
            return Err(if in_content {
                GatewayError::Unexpected(format!(
                    "expected content header or body on channel {ch}, got {name}"
                ))
            } else {
                GatewayError::Channel(format!(
                    "expected 'channel.open' on channel {ch}, got {name}"
                ))
            });
        }
        let incoming = methods::incoming(method)?;
        let Some(state) = self.channels.get_mut(&ch) else {
            // Checked above: only channel.open reaches here for an unknown channel.
            self.channels.insert(ch, ChannelState::default());
            self.ops.push((ch, Op::ChannelOpen));
            return Ok(());
        };
        if state.closing {
            // Only the close handshake matters on a channel we are closing.
            match incoming {
                Incoming::CloseOk => {
                    self.channels.remove(&ch);
                    self.ops.push((ch, Op::ChannelCloseOk));
                }
                Incoming::Op(Op::ChannelClose) => {
                    codec::encode_method(&mut self.wbuf, ch, methods::channel_close_ok());
                    self.channels.remove(&ch);
                    self.ops.push((ch, Op::ChannelCloseOk));
                }
                _ => {}
            }
            return Ok(());
        }
        match incoming {
            Incoming::Op(Op::ChannelOpen) => Err(GatewayError::Channel(format!(
                "second 'channel.open' seen on channel {ch}"
            ))),
            Incoming::Op(op) => {
                self.ops.push((ch, op));
                Ok(())
            }
            Incoming::Publish(publish) => {
                state.content = Some(Content {
                    publish,
                    header: None,
                    body: Body::Empty,
                });
                Ok(())
            }
            Incoming::Flow(active) => {
                codec::encode_method(&mut self.wbuf, ch, methods::flow_ok(active));
                Ok(())
            }
            Incoming::CloseOk => Ok(()),
        }
    }

    fn on_header(
        &mut self,
        ch: u16,
        header: amq_protocol::frame::AMQPContentHeader,
    ) -> Result<(), GatewayError> {
        let max = self.max_message_size;
        let Some(state) = self.channels.get_mut(&ch) else {
            return Err(GatewayError::Unexpected(format!(
                "content header on channel {ch}, which is not open"
            )));
        };
        if state.closing {
            return Ok(());
        }
        let Some(content) = state.content.as_mut().filter(|c| c.header.is_none()) else {
            return Err(GatewayError::Unexpected(format!(
                "content header on channel {ch} without a preceding basic.publish"
            )));
        };
        if header.class_id != 60 {
            return Err(GatewayError::Unexpected(format!(
                "content header of class {} on channel {ch}; expected 60 (basic)",
                header.class_id
            )));
        }
        if header.body_size > max {
            state.content = None;
            state.closing = true;
            let text = format!(
                "PRECONDITION_FAILED - message size {} is larger than configured max size {max}",
                header.body_size
            );
            tracing::warn!(peer = %self.peer.addr, channel = ch, "{text}");
            codec::encode_method(
                &mut self.wbuf,
                ch,
                methods::channel_close(ErrorCode::PreconditionFailed.code(), &text, (60, 40)),
            );
            return Ok(());
        }
        content.header = Some((
            header.body_size,
            crate::convert::properties_from_amqp(&header.properties),
        ));
        if header.body_size == 0 {
            self.complete_publish(ch);
        }
        Ok(())
    }

    fn on_body(&mut self, ch: u16, chunk: Bytes) -> Result<(), GatewayError> {
        let Some(state) = self.channels.get_mut(&ch) else {
            return Err(GatewayError::Unexpected(format!(
                "content body on channel {ch}, which is not open"
            )));
        };
        if state.closing {
            return Ok(());
        }
        let Some(content) = state.content.as_mut() else {
            return Err(GatewayError::Unexpected(format!(
                "content body on channel {ch} without a preceding basic.publish"
            )));
        };
        let Some((size, _)) = content.header else {
            return Err(GatewayError::Unexpected(format!(
                "content body on channel {ch} before its content header"
            )));
        };
        if content.body.len() + chunk.len() as u64 > size {
            return Err(GatewayError::Unexpected(format!(
                "content body on channel {ch} longer than the {size} bytes its header announced"
            )));
        }
        content.body.push(chunk, size);
        if content.body.len() == size {
            self.complete_publish(ch);
        }
        Ok(())
    }

    fn complete_publish(&mut self, ch: u16) {
        let Some(state) = self.channels.get_mut(&ch) else {
            return;
        };
        let Some(content) = state.content.take() else {
            return;
        };
        let (e, k) = (
            content.publish.exchange.as_str(),
            content.publish.routing_key.as_str(),
        );
        let (exchange, routing_key) = match &state.last_address {
            Some((le, lk)) if **le == *e && **lk == *k => (le.clone(), lk.clone()),
            _ => {
                let address = (Arc::<str>::from(e), Arc::<str>::from(k));
                state.last_address = Some(address.clone());
                address
            }
        };
        let properties = content.header.map(|(_, p)| p).unwrap_or_default();
        self.published = true;
        self.ops.push((
            ch,
            Op::Publish(Box::new(Publish {
                exchange,
                routing_key,
                mandatory: content.publish.mandatory,
                immediate: content.publish.immediate,
                properties,
                body: content.body.freeze(),
                routed: None,
            })),
        ));
    }

    /// Encodes this batch and whatever else is ready (bounded) into the write buffer.
    fn on_effects(&mut self, first: Vec<Effect>, rx: &mut warren_runtime::EffectReceiver) {
        let mut pending_acks: Vec<(u16, u64, u64)> = Vec::new();
        let mut delivered: u32 = 0;
        let mut batch = first;
        for _ in 0..MAX_BATCHES_PER_WRITE {
            for effect in batch.drain(..) {
                self.encode_effect(effect, &mut pending_acks, &mut delivered);
            }
            if self.wbuf.len() >= MAX_WRITE_BYTES {
                break;
            }
            match rx.try_recv() {
                Some(next) => batch = next,
                None => break,
            }
        }
        for (ch, first, last) in std::mem::take(&mut pending_acks) {
            self.emit_acks(ch, first, last);
        }
        if delivered > 0 {
            self.ops.push((0, Op::Written { count: delivered }));
        }
    }

    fn flush_acks_of(&mut self, ch: u16, pending: &mut Vec<(u16, u64, u64)>) {
        if let Some(i) = pending.iter().position(|p| p.0 == ch) {
            let (ch, first, last) = pending.swap_remove(i);
            self.emit_acks(ch, first, last);
        }
    }

    /// Sends acks for seqs `first..=last`: one `multiple` ack when the run directly follows
    /// the last one sent, individual acks otherwise.
    fn emit_acks(&mut self, ch: u16, first: u64, last: u64) {
        let Some(state) = self.channels.get_mut(&ch) else {
            return;
        };
        if state.confirmed.follows(first) {
            codec::encode_confirm(&mut self.wbuf, ch, last, last > first, true);
        } else {
            for seq in first..=last {
                codec::encode_confirm(&mut self.wbuf, ch, seq, false, true);
            }
        }
        state.confirmed.mark(first, last);
    }

    fn encode_effect(
        &mut self,
        effect: Effect,
        pending: &mut Vec<(u16, u64, u64)>,
        delivered: &mut u32,
    ) {
        if let Effect::Confirm {
            ch,
            seq,
            multiple: false,
            ack: true,
        } = effect
        {
            let c = ch.channel;
            if let Some(p) = pending.iter_mut().find(|p| p.0 == c) {
                if seq == p.2 + 1 {
                    p.2 = seq;
                    return;
                }
                self.flush_acks_of(c, pending);
            }
            pending.push((c, seq, seq));
            return;
        }
        if let Effect::Deliver { .. } = effect {
            // Counted even if dropped below: the core's write window must get it back.
            *delivered += 1;
        }
        let ch = match &effect {
            Effect::ConnectionError { .. }
            | Effect::Blocked { .. }
            | Effect::Unblocked { .. }
            | Effect::FlowPaused { .. }
            | Effect::FlowResumed { .. } => 0,
            Effect::Reply { ch, .. }
            | Effect::Deliver { ch, .. }
            | Effect::Return { ch, .. }
            | Effect::Confirm { ch, .. }
            | Effect::ConsumerCancelled { ch, .. }
            | Effect::ChannelError { ch, .. } => ch.channel,
        };
        self.flush_acks_of(ch, pending);
        let closing = self.channels.get(&ch).is_none_or(|s| s.closing);
        let frame_max = self.frame_max;
        match effect {
            Effect::ConnectionError { error, .. } => {
                let ids = methods::method_ids(error.op);
                self.close_connection(error.code, error.text, ids);
            }
            Effect::Blocked { .. } => {
                self.blocked = true;
                // The broker logs the alarm once; per connection it is only a debug line.
                tracing::debug!(peer = %self.peer.addr, "resource alarm: publishing blocked");
                self.notify_blocked();
            }
            Effect::FlowPaused { .. } => self.flow_paused = true,
            Effect::FlowResumed { .. } => self.flow_paused = false,
            Effect::Unblocked { .. } => {
                self.blocked = false;
                if self.blocked_sent {
                    codec::encode_method(&mut self.wbuf, 0, handshake::connection_unblocked());
                    self.blocked_sent = false;
                }
            }
            // A channel we are closing gets nothing but the close handshake.
            _ if closing && ch != 0 => {}
            Effect::Reply { reply, .. } => match reply {
                Reply::GetOk {
                    delivery,
                    message_count,
                } => {
                    let m = &delivery.message;
                    codec::encode_method(
                        &mut self.wbuf,
                        ch,
                        methods::get_ok(
                            delivery.delivery_tag,
                            delivery.redelivered,
                            &m.exchange,
                            &m.routing_key,
                            message_count,
                        ),
                    );
                    codec::encode_content(&mut self.wbuf, ch, &m.properties, &m.body, frame_max);
                }
                Reply::ChannelCloseOk => {
                    self.channels.remove(&ch);
                    codec::encode_method(&mut self.wbuf, ch, methods::channel_close_ok());
                }
                other => {
                    if let Some(method) = methods::reply_method(&other) {
                        codec::encode_method(&mut self.wbuf, ch, method);
                    }
                }
            },
            Effect::Deliver {
                consumer_tag,
                delivery,
                ..
            } => {
                let m = &delivery.message;
                codec::encode_deliver(
                    &mut self.wbuf,
                    ch,
                    &consumer_tag,
                    delivery.delivery_tag,
                    delivery.redelivered,
                    &m.exchange,
                    &m.routing_key,
                );
                codec::encode_content(&mut self.wbuf, ch, &m.properties, &m.body, frame_max);
            }
            Effect::Return {
                reply_code,
                reply_text,
                message,
                ..
            } => {
                codec::encode_method(
                    &mut self.wbuf,
                    ch,
                    methods::basic_return(
                        reply_code,
                        reply_text,
                        &message.exchange,
                        &message.routing_key,
                    ),
                );
                codec::encode_content(
                    &mut self.wbuf,
                    ch,
                    &message.properties,
                    &message.body,
                    frame_max,
                );
            }
            Effect::Confirm {
                seq, multiple, ack, ..
            } => {
                codec::encode_confirm(&mut self.wbuf, ch, seq, multiple, ack);
                if let Some(s) = self.channels.get_mut(&ch) {
                    s.confirmed.mark(if multiple { 1 } else { seq }, seq);
                }
            }
            Effect::ConsumerCancelled { consumer_tag, .. } => {
                codec::encode_method(&mut self.wbuf, ch, methods::server_cancel(&consumer_tag));
            }
            Effect::ChannelError { error, .. } => {
                tracing::debug!(peer = %self.peer.addr, channel = ch, "channel error: {}", Escaped(&error.text));
                codec::encode_method(
                    &mut self.wbuf,
                    ch,
                    methods::channel_close(
                        error.code.code(),
                        &error.text,
                        methods::method_ids(error.op),
                    ),
                );
                if let Some(s) = self.channels.get_mut(&ch) {
                    s.closing = true;
                    s.content = None;
                }
            }
        }
    }
}

/// A short name for a method, for error texts and logs (`basic.publish`).
fn method_name(m: &AMQPClass) -> String {
    let s = format!("{m:?}");
    // Debug prints `Basic(Publish(Publish { .. }))`: keep the first two names.
    let mut parts = s.split(['(', ' ', '{']).filter(|p| !p.is_empty());
    match (parts.next(), parts.next()) {
        (Some(class), Some(method)) => format!("{}.{}", class.to_lowercase(), to_snake(method)),
        _ => "unknown method".into(),
    }
}

fn to_snake(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 4);
    for (i, c) in s.chars().enumerate() {
        if c.is_ascii_uppercase() {
            if i > 0 {
                out.push('-');
            }
            out.push(c.to_ascii_lowercase());
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use amq_protocol::protocol::channel;

    #[test]
    fn acks_collapse_only_when_nothing_before_them_is_outstanding() {
        let mut c = Confirmed::default();
        assert!(c.follows(1));
        c.mark(1, 3);
        assert!(c.follows(4));
        // 5 confirmed before 4: a multiple ack at 6 or later would confirm 4 too.
        c.mark(5, 5);
        assert!(!c.follows(6));
        assert_eq!(c.through, 3);
        c.mark(4, 4);
        assert_eq!(c.through, 5);
        assert!(c.follows(6));
        assert!(c.above.is_empty());
        // A core-sent multiple confirm covers everything up to its seq.
        c.mark(9, 9);
        c.mark(1, 7);
        assert_eq!(c.through, 7);
        c.mark(8, 8);
        assert_eq!(c.through, 9);
        assert!(c.above.is_empty());
    }

    #[test]
    fn bodies_assemble_to_exactly_their_size() {
        let total = 3 * 1024 * 1024 + 17;
        let mut body = Body::Empty;
        let chunk = Bytes::from(vec![7u8; 131_064]);
        while body.len() + (chunk.len() as u64) <= total {
            body.push(chunk.clone(), total);
        }
        let rest = (total - body.len()) as usize;
        body.push(chunk.slice(..rest), total);
        let Body::Many(ref v) = body else {
            panic!("a multi-frame body")
        };
        assert_eq!(v.capacity() as u64, total, "no slack kept past completion");
        assert_eq!(body.freeze().len() as u64, total);

        // A small single-frame body does not pin the buffer it was read into.
        let read = Bytes::from(vec![1u8; 65_536]);
        let mut small = Body::Empty;
        small.push(read.slice(10..110), 100);
        let frozen = small.freeze();
        assert_eq!(frozen.len(), 100);
        assert!(!read.as_ptr_range().contains(&frozen.as_ptr()));
    }

    #[test]
    fn method_names_read_like_the_spec() {
        let m = AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {}));
        assert_eq!(method_name(&m), "channel.close-ok");
    }
}
