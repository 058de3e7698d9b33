//! The per-connection stream-protocol state machine, sans-IO: bytes in (with the current unix
//! time in ms), bytes out, [`Wait`]s for the shell to await on the backend, and a timer
//! deadline (heartbeats, handshake and close timeouts). No socket, clock or runtime in here;
//! `connection.rs` moves bytes and time.
//!
//! Lifecycle (`PROTOCOL.adoc`, "Authentication"): PeerProperties, SaslHandshake,
//! SaslAuthenticate, then the server's Tune, the client's Tune, Open. Until Open succeeds
//! frames are limited to [`INITIAL_FRAME_MAX`] bytes (RabbitMQ's pre-auth ceiling).

use crate::backend::{
    AuthError, ChunkReader, Login, OpenedConnection, OperatorClose, PeerInfo, ReaderFilter,
    StreamBackend, StreamError,
};
use crate::chunk::FileRange;
use crate::codec::{self, Broker, Frame, OffsetSpec, PublishedBatch, StreamMetadata};
use crate::frame::{DecodeError, code, key, split_frame};
use crate::sac::Mailbox;
use bytes::{Buf, Bytes, BytesMut};
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::Arc;
use warren_core::escape::Escaped;

/// The length (size field included) of the whole Publish frame at the front of `buf`, if
/// there is one within `max` (0: no limit); anything else is for [`split_frame`].
fn whole_publish(buf: &BytesMut, max: u32) -> Option<usize> {
    let h = buf.get(..8)?;
    let size = u32::from_be_bytes([h[0], h[1], h[2], h[3]]);
    let total = 4 + size as usize;
    // Versions 1 and 2 (others are the decoder's unknown command).
    let publish = u16::from_be_bytes([h[4], h[5]]) == key::PUBLISH
        && matches!(u16::from_be_bytes([h[6], h[7]]), 1 | 2);
    (publish && (max == 0 || size <= max) && buf.len() >= total && size >= 4).then_some(total)
}

/// Frame-max until Open succeeds.
pub const INITIAL_FRAME_MAX: u32 = 8192;
/// Longest publisher / offset reference (RabbitMQ refuses longer ones).
pub const MAX_REFERENCE_LEN: usize = 255;
/// Credit a subscription may hold; a grant past it is refused with a CreditResponse.
pub const MAX_CREDIT: u32 = u16::MAX as u32;
/// Publishing ids per PublishConfirm frame (fits the smallest frame-max).
const CONFIRMS_PER_FRAME: usize = 1000;

/// The RabbitMQ release whose stream protocol this gateway speaks (super stream
/// management and filtering are 3.13's), as peer properties' `version`.
pub const RABBITMQ_VERSION: &str = "3.13.7";

/// What a listener offers; shared by its connections.
#[derive(Clone, Debug)]
pub struct StreamConfig {
    /// Frame-max the server proposes (0: no limit). RabbitMQ: 1 MiB.
    pub frame_max: u32,
    /// Heartbeat the server proposes, in seconds (0: none). RabbitMQ: 60.
    pub heartbeat: u32,
    /// Host and port clients are told to connect to (Open's properties, Metadata).
    pub advertised_host: String,
    pub advertised_port: u16,
    pub max_publishers: usize,
    pub max_subscriptions: usize,
    /// Unconfirmed publishing ids a connection may have before it stops reading.
    pub max_unconfirmed: usize,
    /// Outgoing bytes buffered before the session stops reading and delivering.
    pub out_high_water: usize,
    /// Time to reach Open.
    pub handshake_timeout_ms: u64,
    /// Time to wait for the client's answer to our Close.
    pub close_timeout_ms: u64,
    /// Chunk data that a backend hands out as a file range goes to the socket with
    /// `sendfile` (no copy through user space) where the transport is a plain TCP socket;
    /// false: always read and written (for comparison, or a kernel without it).
    pub zero_copy: bool,
}

impl Default for StreamConfig {
    fn default() -> Self {
        StreamConfig {
            frame_max: 1 << 20,
            heartbeat: 60,
            advertised_host: "localhost".into(),
            advertised_port: 5552,
            max_publishers: 256,
            max_subscriptions: 256,
            max_unconfirmed: 50_000,
            out_high_water: 1 << 20,
            handshake_timeout_ms: 10_000,
            close_timeout_ms: 5_000,
            zero_copy: true,
        }
    }
}

/// Output for the socket, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OutPart {
    Bytes(Bytes),
    /// A file range to send as it is (the data of a Deliver frame whose bytes before it are
    /// the previous part): with `sendfile` where the shell can, else read and written.
    File(FileRange),
}

impl OutPart {
    pub fn len(&self) -> usize {
        match self {
            OutPart::Bytes(b) => b.len(),
            OutPart::File(r) => r.len as usize,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Something the shell awaits on the backend, then reports back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Wait {
    /// `backend.wait_durable(vhost, stream, offset)`, then [`Session::durable`].
    Durable {
        vhost: String,
        stream: String,
        offset: u64,
    },
    /// `backend.wait_data(vhost, stream, from)`, then [`Session::data_ready`].
    Data {
        vhost: String,
        stream: String,
        from: u64,
        subscription_id: u8,
        generation: u64,
    },
    /// `backend.wait_deleted(vhost, stream)`, then [`Session::stream_gone`]: one per stream
    /// the connection has a publisher or subscription on, so an idle one learns of a
    /// deletion too (RabbitMQ's MetadataUpdate to every connection using the stream).
    Deleted { vhost: String, stream: String },
    /// The connection uses `stream` no more: its `Deleted` wait is dropped.
    Unwatch { stream: String },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    PeerProperties,
    Sasl,
    Authenticating,
    Tune,
    Open,
    Opened,
    /// We sent Close; waiting for its response (or the deadline).
    CloseSent {
        deadline: u64,
    },
    /// Flush what is buffered, then end the connection.
    Closing,
}

struct Publisher<T> {
    stream: String,
    reference: Option<String>,
    /// The backend's handle on the stream, taken at declaration.
    target: Option<T>,
}

struct Subscription<R> {
    stream: String,
    reader: R,
    credit: u32,
    /// A `Wait::Data` is outstanding.
    waiting: bool,
    generation: u64,
    /// Single active consumer: its membership; `None` for a plain subscription.
    sac: Option<SacMember>,
}

struct SacMember {
    /// Its id in the broker's groups (unique within this connection).
    token: u64,
    /// Chunks go out only while active: from the client's answer to the ConsumerUpdate
    /// that activated it until the group tells it otherwise.
    active: bool,
    /// To reopen the reader at the offset the client answers with.
    filter: Option<ReaderFilter>,
}

struct Pending {
    offset: u64,
    publisher_id: u8,
    /// How many of the stream's `ids` (from the front) are this frame's.
    count: usize,
}

#[derive(Default)]
struct StreamPending {
    queue: VecDeque<Pending>,
    /// The publishing ids of the frames in `queue`, in order: one deque per stream instead of a
    /// `Vec` per Publish frame (an allocation per 1-message frame). Bounded with `queue` by
    /// `max_unconfirmed` (no reads past it).
    ids: VecDeque<u64>,
    /// The offset an outstanding `Wait::Durable` was asked for.
    waiting_for: Option<u64>,
}

/// One connection's protocol state.
pub struct Session<B: StreamBackend> {
    backend: Arc<B>,
    config: Arc<StreamConfig>,
    peer: PeerInfo,
    phase: Phase,
    user: Option<String>,
    vhost: String,
    started_ms: u64,
    last_recv_ms: u64,
    last_sent_ms: u64,
    /// Frame-max enforced on incoming frames.
    frame_max_in: u32,
    /// Frame-max agreed at Tune (in force after Open).
    frame_max: u32,
    heartbeat_ms: u64,
    deliver_v2: bool,
    next_corr: u32,
    /// Frames being encoded; `parts` holds what came before it (file ranges cut it).
    out: BytesMut,
    parts: Vec<OutPart>,
    /// Bytes in `parts`.
    parts_len: usize,
    waits: Vec<Wait>,
    publishers: BTreeMap<u8, Publisher<B::Target>>,
    subscriptions: BTreeMap<u8, Subscription<B::Reader>>,
    /// Unconfirmed Publish frames per stream (of this connection's vhost).
    pending: HashMap<String, StreamPending>,
    unconfirmed: usize,
    generation: u64,
    /// This connection in the broker's single-active-consumer groups.
    conn_id: u64,
    mailbox: Arc<Mailbox>,
    next_token: u64,
    /// ConsumerUpdates sent and not answered: correlation id -> (subscription, token,
    /// active). At most two per subscription (a deactivation's answer precedes the next
    /// activation), removed with it.
    updates_sent: HashMap<u32, (u8, u64, bool)>,
    /// Streams with a `Wait::Deleted` out (those of its publishers and subscriptions).
    watched: HashSet<String>,
    /// The client's PeerProperties, for operators' listings (bounded by the pre-Open
    /// frame-max).
    client_properties: Vec<(String, String)>,
    /// From the backend at Open, for the shell to await (see [`Session::take_operator_close`]).
    operator_close: Option<OperatorClose>,
}

impl<B: StreamBackend> Drop for Session<B> {
    /// However the connection ends, its consumers leave their groups (the next ones of each
    /// group take over).
    fn drop(&mut self) {
        self.backend.consumer_groups().disconnect(self.conn_id);
    }
}

fn response(k: u16, corr: u32, c: u16) -> Frame {
    Frame::Response {
        key: k,
        corr,
        code: c,
    }
}

impl<B: StreamBackend> Session<B> {
    pub fn new(backend: Arc<B>, config: Arc<StreamConfig>, peer: PeerInfo, now_ms: u64) -> Self {
        let (conn_id, mailbox) = backend.consumer_groups().connect();
        Session {
            backend,
            config,
            peer,
            phase: Phase::PeerProperties,
            user: None,
            vhost: String::new(),
            started_ms: now_ms,
            last_recv_ms: now_ms,
            last_sent_ms: now_ms,
            frame_max_in: INITIAL_FRAME_MAX,
            frame_max: 0,
            heartbeat_ms: 0,
            deliver_v2: false,
            next_corr: 1,
            out: BytesMut::new(),
            parts: Vec::new(),
            parts_len: 0,
            waits: Vec::new(),
            publishers: BTreeMap::new(),
            subscriptions: BTreeMap::new(),
            pending: HashMap::new(),
            unconfirmed: 0,
            generation: 0,
            conn_id,
            mailbox,
            next_token: 0,
            updates_sent: HashMap::new(),
            watched: HashSet::new(),
            client_properties: Vec::new(),
            operator_close: None,
        }
    }

    /// What resolves when an operator closes this connection (taken once, after Open, by
    /// the shell, which then calls [`Session::closed_by_operator`]).
    pub fn take_operator_close(&mut self) -> Option<OperatorClose> {
        self.operator_close.take()
    }

    /// An operator closed the connection (`DELETE /api/connections/NAME`, `warren ctl
    /// close_connection`): it ends at once, without a Close frame, as RabbitMQ 3.10's does.
    pub fn closed_by_operator(&mut self, reason: &str) {
        tracing::info!(peer = %self.peer.addr, reason = %reason.escape_debug(), "stream connection closed by an operator");
        self.phase = Phase::Closing;
    }

    /// A `Wait::Deleted` for `stream` unless one is out.
    fn watch(&mut self, stream: &str) {
        if self.watched.insert(stream.to_string()) {
            self.waits.push(Wait::Deleted {
                vhost: self.vhost.clone(),
                stream: stream.to_string(),
            });
        }
    }

    /// Drops the `Wait::Deleted` of streams without a publisher or subscription left.
    fn unwatch_unused(&mut self) {
        let unused: Vec<String> = self
            .watched
            .iter()
            .filter(|w| {
                !self.publishers.values().any(|p| &p.stream == *w)
                    && !self.subscriptions.values().any(|s| &s.stream == *w)
            })
            .cloned()
            .collect();
        for stream in unused {
            self.watched.remove(&stream);
            self.waits.push(Wait::Unwatch { stream });
        }
    }

    /// Where the broker's single-active-consumer groups leave this connection's updates:
    /// the shell awaits [`Mailbox::notified`] and then calls [`Session::consumer_updates`].
    pub fn mailbox(&self) -> Arc<Mailbox> {
        self.mailbox.clone()
    }

    /// Acts on the group updates waiting in the mailbox: each becomes a ConsumerUpdate to
    /// the client (a deactivated subscription stops getting chunks at once; an activated
    /// one starts with the client's answer).
    pub fn consumer_updates(&mut self) {
        let updates = self.mailbox.take();
        if self.phase != Phase::Opened {
            return;
        }
        for u in updates {
            let Some((&id, s)) = self
                .subscriptions
                .iter_mut()
                .find(|(_, s)| s.sac.as_ref().is_some_and(|m| m.token == u.token))
            else {
                // Unsubscribed meanwhile: it left its group already.
                continue;
            };
            if let Some(m) = s.sac.as_mut()
                && !u.active
            {
                m.active = false;
            }
            let corr = self.corr();
            self.updates_sent.insert(corr, (id, u.token, u.active));
            self.send(&Frame::ConsumerUpdate {
                corr,
                subscription_id: id,
                active: u.active,
            });
        }
    }

    /// The client answered a ConsumerUpdate: an activated subscription starts delivering
    /// from the offset it gives (none: where the subscription was); a deactivated one lets
    /// its group activate the next.
    fn consumer_update_answered(&mut self, corr: u32, c: u16, offset: Option<OffsetSpec>) {
        let Some((id, token, active)) = self.updates_sent.remove(&corr) else {
            tracing::warn!(peer = %self.peer.addr, corr, "stream connection: answer to no consumer update");
            return;
        };
        if !active {
            self.backend
                .consumer_groups()
                .stepped_down(self.conn_id, token);
            self.consumer_updates();
            return;
        }
        let Some(s) = self.subscriptions.get_mut(&id) else {
            return;
        };
        let Some(m) = s.sac.as_mut().filter(|m| m.token == token) else {
            return;
        };
        if c != code::OK {
            tracing::warn!(peer = %self.peer.addr, subscription_id = id, code = c, "stream connection: consumer update answered with an error; delivering from the subscription's offset");
        }
        if let (code::OK, Some(spec)) = (c, offset) {
            match self
                .backend
                .open_reader(&self.vhost, &s.stream, spec, m.filter.clone())
            {
                Ok(reader) => {
                    // A new generation: a wait on the old reader's position is stale.
                    self.generation += 1;
                    s.reader = reader;
                    s.generation = self.generation;
                    s.waiting = false;
                }
                Err(e) => {
                    tracing::warn!(peer = %self.peer.addr, stream = %Escaped(&s.stream), "stream connection: consumer update offset: {}", Escaped(&e.to_string()));
                    let stream = s.stream.clone();
                    self.stream_gone(&stream);
                    return;
                }
            }
        }
        m.active = true;
        self.pump();
    }

    /// Subscriptions leave their groups.
    fn leave_groups(&mut self, tokens: Vec<u64>) {
        if tokens.is_empty() {
            return;
        }
        for t in &tokens {
            self.backend.consumer_groups().leave(self.conn_id, *t);
        }
        self.updates_sent.retain(|_, (_, t, _)| !tokens.contains(t));
        self.consumer_updates();
    }

    /// True once the connection is to end (after its buffered output is written).
    pub fn is_closing(&self) -> bool {
        self.phase == Phase::Closing
    }

    pub fn is_open(&self) -> bool {
        self.phase == Phase::Opened
    }

    /// Whether the shell should read more: back-pressure on a full outgoing buffer or too
    /// many unconfirmed messages.
    pub fn wants_read(&self) -> bool {
        self.phase != Phase::Closing
            && self.out_len() < self.config.out_high_water
            && self.unconfirmed < self.config.max_unconfirmed
    }

    /// What to write, in order. The shell writes it all and then calls
    /// [`Session::flushed`].
    pub fn take_output(&mut self) -> Vec<OutPart> {
        self.cut();
        self.parts_len = 0;
        std::mem::take(&mut self.parts)
    }

    pub fn has_output(&self) -> bool {
        !self.out.is_empty() || !self.parts.is_empty()
    }

    /// Bytes waiting to be written.
    fn out_len(&self) -> usize {
        self.parts_len + self.out.len()
    }

    /// Ends the bytes part being encoded.
    fn cut(&mut self) {
        if !self.out.is_empty() {
            let b = self.out.split().freeze();
            self.parts_len += b.len();
            self.parts.push(OutPart::Bytes(b));
        }
    }

    pub fn take_waits(&mut self) -> Vec<Wait> {
        std::mem::take(&mut self.waits)
    }

    /// Output was written at `now_ms`: room for more deliveries.
    pub fn flushed(&mut self, now_ms: u64) {
        self.last_sent_ms = now_ms;
        if self.phase == Phase::Opened {
            self.pump();
        }
    }

    fn send(&mut self, frame: &Frame) {
        codec::encode(frame, &mut self.out);
    }

    /// The next time [`Session::on_timer`] must run.
    pub fn next_deadline(&self) -> Option<u64> {
        match self.phase {
            Phase::CloseSent { deadline } => Some(deadline),
            Phase::Closing => None,
            Phase::Opened if self.heartbeat_ms > 0 => Some(
                (self.last_sent_ms + self.heartbeat_ms)
                    .min(self.last_recv_ms + 2 * self.heartbeat_ms),
            ),
            Phase::Opened => None,
            _ => Some(self.started_ms + self.config.handshake_timeout_ms),
        }
    }

    pub fn on_timer(&mut self, now_ms: u64) {
        match self.phase {
            Phase::CloseSent { deadline } if now_ms >= deadline => {
                tracing::info!(peer = %self.peer.addr, "stream connection: no answer to close");
                self.phase = Phase::Closing;
            }
            Phase::Opened if self.heartbeat_ms > 0 => {
                // RabbitMQ's heartbeat monitor: two silent intervals end the connection.
                if now_ms >= self.last_recv_ms + 2 * self.heartbeat_ms {
                    tracing::info!(peer = %self.peer.addr, "stream connection: heartbeat timeout");
                    self.phase = Phase::Closing;
                } else if now_ms >= self.last_sent_ms + self.heartbeat_ms && !self.has_output() {
                    self.send(&Frame::Heartbeat);
                }
            }
            Phase::PeerProperties
            | Phase::Sasl
            | Phase::Authenticating
            | Phase::Tune
            | Phase::Open
                if now_ms >= self.started_ms + self.config.handshake_timeout_ms =>
            {
                tracing::info!(peer = %self.peer.addr, "stream connection: handshake timeout");
                self.phase = Phase::Closing;
            }
            _ => {}
        }
    }

    /// The server is shutting down: tell the client and close.
    pub fn shutdown(&mut self, now_ms: u64) {
        if matches!(self.phase, Phase::Closing | Phase::CloseSent { .. }) {
            return;
        }
        if self.phase == Phase::Opened {
            // Tell the client, but do not wait for its answer: the server is going away
            // (and some clients, the Rust one among them, never answer a server's Close).
            self.close_with(code::OK, "server shutdown", now_ms);
        }
        self.phase = Phase::Closing;
    }

    fn close_with(&mut self, c: u16, reason: &str, now_ms: u64) {
        let corr = self.corr();
        self.send(&Frame::Close {
            corr,
            code: c,
            reason: reason.into(),
        });
        self.phase = Phase::CloseSent {
            deadline: now_ms + self.config.close_timeout_ms,
        };
    }

    fn corr(&mut self) -> u32 {
        let c = self.next_corr;
        self.next_corr = self.next_corr.wrapping_add(1);
        c
    }

    /// Consumes whole frames from `buf` (leaving a partial one, and everything while the
    /// outgoing buffer is full).
    pub fn handle_input(&mut self, buf: &mut BytesMut, now_ms: u64) {
        if !buf.is_empty() {
            self.last_recv_ms = now_ms;
        }
        loop {
            if matches!(self.phase, Phase::Closing) {
                buf.clear();
                return;
            }
            if !self.wants_read() {
                return;
            }
            // Publish frames, once open, are read where they lie in the buffer and go to the
            // backend from there: no `Frame`, no `Vec` of messages, no reference-counted
            // slice (a 1-message frame's path is all per-frame cost).
            if matches!(self.phase, Phase::Opened)
                && let Some(total) = whole_publish(buf, self.frame_max_in)
            {
                match codec::parse_publish(&buf[4..total]) {
                    Some(Ok((publisher_id, batch))) => self.publish(publisher_id, batch, now_ms),
                    Some(Err(e)) => self.bad_frame(e, now_ms),
                    // Not reached: `whole_publish` checked the key and version.
                    None => self.bad_frame(DecodeError::BadValue("publish"), now_ms),
                }
                buf.advance(total);
                continue;
            }
            let body = match split_frame(buf, self.frame_max_in) {
                Ok(Some(b)) => b,
                Ok(None) => return,
                Err(e) => {
                    tracing::warn!(peer = %self.peer.addr, "stream connection: {}", Escaped(&e.to_string()));
                    // The framing is lost: nothing after this can be read.
                    buf.clear();
                    if matches!(self.phase, Phase::CloseSent { .. }) {
                        self.phase = Phase::Closing;
                    } else {
                        self.close_with(code::FRAME_TOO_LARGE, "frame too large", now_ms);
                        self.phase = Phase::Closing;
                    }
                    return;
                }
            };
            match codec::decode(body) {
                Ok(frame) => self.handle_frame(frame, now_ms),
                Err(e) => self.bad_frame(e, now_ms),
            }
        }
    }

    fn bad_frame(&mut self, e: DecodeError, now_ms: u64) {
        match self.phase {
            Phase::CloseSent { .. } | Phase::Closing => {}
            _ => {
                tracing::warn!(peer = %self.peer.addr, "stream connection: unknown frame: {}", Escaped(&e.to_string()));
                self.close_with(code::UNKNOWN_FRAME, "unknown frame", now_ms);
            }
        }
    }

    fn handle_frame(&mut self, frame: Frame, now_ms: u64) {
        match (self.phase, frame) {
            (
                Phase::CloseSent { .. },
                Frame::Response {
                    key: key::CLOSE, ..
                },
            ) => {
                self.phase = Phase::Closing;
            }
            (Phase::CloseSent { .. }, _) => {}
            (_, Frame::Heartbeat) => {}
            (
                _,
                Frame::Close {
                    corr,
                    code: c,
                    reason,
                },
            ) => {
                tracing::debug!(peer = %self.peer.addr, code = c, reason = %Escaped(&reason), "client closes");
                self.send(&response(key::CLOSE, corr, code::OK));
                self.phase = Phase::Closing;
            }
            (Phase::PeerProperties, Frame::PeerProperties { corr, properties }) => {
                self.client_properties = properties;
                let properties = vec![
                    ("product".into(), "Warren".into()),
                    // Clients gate features on RabbitMQ's version: the Java client exchanges
                    // command versions (Deliver v2, filtering, super stream management) only
                    // with 3.11 and later, so the version is the RabbitMQ release whose
                    // stream protocol this gateway speaks; Warren's own is beside it.
                    ("version".into(), RABBITMQ_VERSION.into()),
                    ("warren_version".into(), env!("CARGO_PKG_VERSION").into()),
                    ("platform".into(), "Rust".into()),
                    ("cluster_name".into(), "warren".into()),
                    ("copyright".into(), "Warren contributors".into()),
                    ("information".into(), "Licensed under Apache-2.0".into()),
                ];
                self.send(&Frame::PeerPropertiesResponse {
                    corr,
                    code: code::OK,
                    properties,
                });
                self.phase = Phase::Sasl;
            }
            (Phase::Sasl | Phase::Authenticating, Frame::SaslHandshake { corr }) => {
                self.send(&Frame::SaslHandshakeResponse {
                    corr,
                    code: code::OK,
                    mechanisms: vec!["PLAIN".into(), "ANONYMOUS".into()],
                });
                self.phase = Phase::Authenticating;
            }
            (
                Phase::Authenticating,
                Frame::SaslAuthenticate {
                    corr,
                    mechanism,
                    data,
                },
            ) => self.authenticate(corr, &mechanism, &data),
            (
                Phase::Tune,
                Frame::Tune {
                    frame_max,
                    heartbeat,
                },
            )
            | (
                Phase::Tune,
                Frame::TuneResponse {
                    frame_max,
                    heartbeat,
                },
            ) => {
                // 0 on either side means no limit (RabbitMQ's negotiate_frame_max).
                self.frame_max = match (frame_max, self.config.frame_max) {
                    (0, s) => s,
                    (c, 0) => c,
                    (c, s) => c.min(s),
                };
                // The client's answer is what both sides use.
                self.heartbeat_ms = heartbeat as u64 * 1000;
                self.phase = Phase::Open;
            }
            (Phase::Open, Frame::Open { corr, vhost }) => {
                let user = self.user.clone().unwrap_or_default();
                if self.backend.vhost_access(&user, &vhost) {
                    self.send(&Frame::OpenResponse {
                        corr,
                        code: code::OK,
                        properties: vec![
                            (
                                "advertised_host".into(),
                                self.config.advertised_host.clone(),
                            ),
                            (
                                "advertised_port".into(),
                                self.config.advertised_port.to_string(),
                            ),
                        ],
                    });
                    self.vhost = vhost;
                    self.frame_max_in = self.frame_max;
                    self.phase = Phase::Opened;
                    self.operator_close = self.backend.register_connection(OpenedConnection {
                        peer: &self.peer,
                        user: &user,
                        vhost: &self.vhost,
                        client_properties: &self.client_properties,
                        heartbeat_s: (self.heartbeat_ms / 1000) as u32,
                        frame_max: self.frame_max,
                    });
                } else {
                    tracing::warn!(peer = %self.peer.addr, user = %Escaped(&user), vhost = %Escaped(&vhost), "stream connection: vhost access refused");
                    self.send(&Frame::OpenResponse {
                        corr,
                        code: code::VIRTUAL_HOST_ACCESS_FAILURE,
                        properties: vec![],
                    });
                    self.phase = Phase::Closing;
                }
            }
            (Phase::Opened, frame) => self.handle_opened(frame, now_ms),
            (phase, frame) => {
                tracing::warn!(peer = %self.peer.addr, ?phase, key = frame.key(), "stream connection: unexpected command");
                if phase == Phase::Opened {
                    self.close_with(code::UNKNOWN_FRAME, "unknown frame", now_ms);
                } else {
                    // Before Open RabbitMQ ends the connection without a word; a Close
                    // tells the client why.
                    let corr = self.corr();
                    self.send(&Frame::Close {
                        corr,
                        code: code::UNKNOWN_FRAME,
                        reason: "unexpected command".into(),
                    });
                    self.phase = Phase::Closing;
                }
            }
        }
    }

    fn authenticate(&mut self, corr: u32, mechanism: &str, data: &[u8]) {
        let login = match mechanism {
            "PLAIN" => {
                // authzid NUL authcid NUL passwd
                let mut parts = data.split(|b| *b == 0);
                let (Some(_), Some(user), Some(pass), None) =
                    (parts.next(), parts.next(), parts.next(), parts.next())
                else {
                    tracing::warn!(peer = %self.peer.addr, "stream connection: malformed PLAIN response");
                    self.refuse_login(corr, code::SASL_ERROR);
                    return;
                };
                let (Ok(username), Ok(password)) = (
                    String::from_utf8(user.to_vec()),
                    String::from_utf8(pass.to_vec()),
                ) else {
                    self.refuse_login(corr, code::SASL_ERROR);
                    return;
                };
                Login::Plain { username, password }
            }
            "ANONYMOUS" => Login::Anonymous,
            other => {
                tracing::warn!(peer = %self.peer.addr, mechanism = %Escaped(other), "stream connection: SASL mechanism not supported");
                self.refuse_login(corr, code::SASL_MECHANISM_NOT_SUPPORTED);
                return;
            }
        };
        match self.backend.authenticate(&login, &self.peer) {
            Ok(user) => {
                self.send(&Frame::SaslAuthenticateResponse {
                    corr,
                    code: code::OK,
                    challenge: Bytes::new(),
                });
                self.user = Some(user);
                self.send(&Frame::Tune {
                    frame_max: self.config.frame_max,
                    heartbeat: self.config.heartbeat,
                });
                self.phase = Phase::Tune;
            }
            Err(e) => {
                tracing::warn!(peer = %self.peer.addr, "stream connection: {}", Escaped(&e.to_string()));
                let c = match e {
                    AuthError::Refused => code::AUTHENTICATION_FAILURE,
                    AuthError::Loopback => code::SASL_AUTHENTICATION_FAILURE_LOOPBACK,
                };
                self.refuse_login(corr, c);
            }
        }
    }

    fn refuse_login(&mut self, corr: u32, c: u16) {
        self.send(&Frame::SaslAuthenticateResponse {
            corr,
            code: c,
            challenge: Bytes::new(),
        });
        self.phase = Phase::Closing;
    }

    fn handle_opened(&mut self, frame: Frame, now_ms: u64) {
        let vhost = self.vhost.clone();
        match frame {
            Frame::DeclarePublisher {
                corr,
                publisher_id,
                reference,
                stream,
            } => {
                let taken = self.publishers.contains_key(&publisher_id)
                    || (!reference.is_empty()
                        && self.publishers.values().any(|p| {
                            p.stream == stream && p.reference.as_deref() == Some(&reference)
                        }));
                let c = if self.publishers.len() >= self.config.max_publishers
                    || reference.len() > MAX_REFERENCE_LEN
                {
                    code::PRECONDITION_FAILED
                } else if !self.backend.stream_exists(&vhost, &stream) {
                    code::STREAM_DOES_NOT_EXIST
                } else if taken {
                    code::PRECONDITION_FAILED
                } else {
                    self.watch(&stream);
                    self.publishers.insert(
                        publisher_id,
                        Publisher {
                            target: self.backend.target(&vhost, &stream),
                            stream,
                            reference: (!reference.is_empty()).then_some(reference),
                        },
                    );
                    code::OK
                };
                self.send(&response(key::DECLARE_PUBLISHER, corr, c));
            }
            Frame::Publish {
                publisher_id,
                messages,
                ..
            } => self.publish(publisher_id, PublishedBatch::Messages(&messages), now_ms),
            Frame::QueryPublisherSequence {
                corr,
                reference,
                stream,
            } => {
                let (c, sequence) =
                    match self.backend.publisher_sequence(&vhost, &stream, &reference) {
                        Ok(s) => (code::OK, s),
                        Err(e) => (e.code(), 0),
                    };
                self.send(&Frame::QueryPublisherSequenceResponse {
                    corr,
                    code: c,
                    sequence,
                });
            }
            Frame::DeletePublisher { corr, publisher_id } => {
                let c = match self.publishers.remove(&publisher_id) {
                    Some(_) => code::OK,
                    None => code::PUBLISHER_DOES_NOT_EXIST,
                };
                self.send(&response(key::DELETE_PUBLISHER, corr, c));
                self.unwatch_unused();
            }
            Frame::Subscribe {
                corr,
                subscription_id,
                stream,
                offset,
                credit,
                properties,
            } => self.subscribe(corr, subscription_id, stream, offset, credit, &properties),
            Frame::Credit {
                subscription_id,
                credit,
            } => {
                let c = match self.subscriptions.get_mut(&subscription_id) {
                    None => Some(code::SUBSCRIPTION_ID_DOES_NOT_EXIST),
                    Some(s) if s.credit + credit as u32 > MAX_CREDIT => {
                        Some(code::PRECONDITION_FAILED)
                    }
                    Some(s) => {
                        s.credit += credit as u32;
                        None
                    }
                };
                match c {
                    Some(c) => {
                        tracing::warn!(peer = %self.peer.addr, subscription_id, credit, code = c, "stream connection: credit refused");
                        self.send(&Frame::CreditResponse {
                            code: c,
                            subscription_id,
                        });
                    }
                    None => self.pump(),
                }
            }
            Frame::StoreOffset {
                reference,
                stream,
                offset,
            } => {
                // No response (the command has none): a failure is only logged.
                let r = if reference.is_empty() || reference.len() > MAX_REFERENCE_LEN {
                    Err(StreamError::Precondition("bad reference".into()))
                } else {
                    self.backend
                        .store_offset(&vhost, &stream, &reference, offset)
                };
                if let Err(e) = r {
                    tracing::warn!(peer = %self.peer.addr, stream = %Escaped(&stream), "stream connection: store offset: {}", Escaped(&e.to_string()));
                }
            }
            Frame::QueryOffset {
                corr,
                reference,
                stream,
            } => {
                let (c, offset) = match self.backend.query_offset(&vhost, &stream, &reference) {
                    Ok(Some(o)) => (code::OK, o),
                    Ok(None) => (code::NO_OFFSET, 0),
                    Err(e) => (e.code(), 0),
                };
                self.send(&Frame::QueryOffsetResponse {
                    corr,
                    code: c,
                    offset,
                });
            }
            Frame::Unsubscribe {
                corr,
                subscription_id,
            } => match self.subscriptions.remove(&subscription_id) {
                Some(s) => {
                    self.send(&response(key::UNSUBSCRIBE, corr, code::OK));
                    self.leave_groups(s.sac.map(|m| m.token).into_iter().collect());
                    self.unwatch_unused();
                }
                None => self.send(&response(
                    key::UNSUBSCRIBE,
                    corr,
                    code::SUBSCRIPTION_ID_DOES_NOT_EXIST,
                )),
            },
            Frame::Create {
                corr,
                stream,
                arguments,
            } => {
                let c = if stream.is_empty()
                    || stream.len() > MAX_REFERENCE_LEN
                    || stream.starts_with("amq.")
                {
                    code::PRECONDITION_FAILED
                } else {
                    match self.backend.create_stream(&vhost, &stream, &arguments) {
                        Ok(()) => code::OK,
                        Err(e) => {
                            tracing::warn!(peer = %self.peer.addr, stream = %Escaped(&stream), "stream connection: create: {}", Escaped(&e.to_string()));
                            e.code()
                        }
                    }
                };
                self.send(&response(key::CREATE, corr, c));
            }
            Frame::Delete { corr, stream } => match self.backend.delete_stream(&vhost, &stream) {
                Ok(()) => {
                    self.send(&response(key::DELETE, corr, code::OK));
                    self.stream_gone(&stream);
                }
                Err(e) => self.send(&response(key::DELETE, corr, e.code())),
            },
            Frame::Metadata { corr, streams } => {
                let mut any = false;
                let streams: Vec<StreamMetadata> = streams
                    .into_iter()
                    .map(|s| {
                        let exists = self.backend.stream_exists(&vhost, &s);
                        any |= exists;
                        StreamMetadata {
                            stream: s,
                            code: if exists {
                                code::OK
                            } else {
                                code::STREAM_DOES_NOT_EXIST
                            },
                            leader: if exists { 0 } else { u16::MAX },
                            replicas: vec![],
                        }
                    })
                    .collect();
                // As RabbitMQ: only the nodes of the streams found are listed.
                let brokers = if any {
                    vec![Broker {
                        reference: 0,
                        host: self.config.advertised_host.clone(),
                        port: self.config.advertised_port as u32,
                    }]
                } else {
                    vec![]
                };
                self.send(&Frame::MetadataResponse {
                    corr,
                    brokers,
                    streams,
                });
            }
            Frame::ExchangeCommandVersions { corr, versions } => {
                if versions
                    .iter()
                    .any(|&(k, _, max)| k == key::DELIVER && max >= 2)
                {
                    self.deliver_v2 = true;
                }
                self.send(&Frame::ExchangeCommandVersionsResponse {
                    corr,
                    code: code::OK,
                    versions: server_versions(),
                });
            }
            Frame::StreamStats { corr, stream } => {
                let (c, stats) = match self.backend.stream_stats(&vhost, &stream) {
                    Ok(s) => (
                        code::OK,
                        vec![
                            ("first_chunk_id".into(), s.first_chunk_id),
                            ("committed_chunk_id".into(), s.committed_chunk_id),
                            ("last_chunk_id".into(), s.last_chunk_id),
                        ],
                    ),
                    Err(e) => (e.code(), vec![]),
                };
                self.send(&Frame::StreamStatsResponse {
                    corr,
                    code: c,
                    stats,
                });
            }
            Frame::ResolveOffsetSpec {
                corr,
                stream,
                offset,
                ..
            } => {
                let (c, offset) = match self.backend.resolve_offset(&vhost, &stream, offset) {
                    Ok(o) => (code::OK, o),
                    Err(e) => (e.code(), 0),
                };
                self.send(&Frame::ResolveOffsetSpecResponse {
                    corr,
                    code: c,
                    offset_type: 4,
                    offset,
                });
            }
            Frame::Route {
                corr,
                routing_key,
                super_stream,
            } => {
                let (c, streams) = match self.backend.route(&vhost, &super_stream, &routing_key) {
                    Ok(s) => (code::OK, s),
                    Err(e) => (e.code(), vec![]),
                };
                self.send(&Frame::RouteResponse {
                    corr,
                    code: c,
                    streams,
                });
            }
            Frame::Partitions { corr, super_stream } => {
                let (c, streams) = match self.backend.partitions(&vhost, &super_stream) {
                    Ok(s) => (code::OK, s),
                    Err(e) => (e.code(), vec![]),
                };
                self.send(&Frame::PartitionsResponse {
                    corr,
                    code: c,
                    streams,
                });
            }
            Frame::CreateSuperStream {
                corr,
                name,
                partitions,
                binding_keys,
                arguments,
            } => {
                let bad_name =
                    |n: &str| n.is_empty() || n.len() > MAX_REFERENCE_LEN || n.starts_with("amq.");
                let c = if bad_name(&name) || partitions.iter().any(|p| bad_name(p)) {
                    code::PRECONDITION_FAILED
                } else {
                    match self.backend.create_super_stream(
                        &vhost,
                        &name,
                        &partitions,
                        &binding_keys,
                        &arguments,
                    ) {
                        Ok(()) => code::OK,
                        Err(e) => {
                            tracing::warn!(peer = %self.peer.addr, name = %Escaped(&name), "stream connection: create super stream: {}", Escaped(&e.to_string()));
                            e.code()
                        }
                    }
                };
                self.send(&response(key::CREATE_SUPER_STREAM, corr, c));
            }
            Frame::DeleteSuperStream { corr, name } => {
                match self.backend.delete_super_stream(&vhost, &name) {
                    Ok(partitions) => {
                        self.send(&response(key::DELETE_SUPER_STREAM, corr, code::OK));
                        for p in partitions {
                            self.stream_gone(&p);
                        }
                    }
                    Err(e) => self.send(&response(key::DELETE_SUPER_STREAM, corr, e.code())),
                }
            }
            Frame::ConsumerUpdateResponse {
                corr,
                code: c,
                offset,
            } => self.consumer_update_answered(corr, c, offset),
            other => {
                tracing::warn!(peer = %self.peer.addr, key = other.key(), "stream connection: command not expected from a client");
                self.close_with(code::UNKNOWN_FRAME, "unknown frame", now_ms);
            }
        }
    }

    fn publish(&mut self, publisher_id: u8, messages: PublishedBatch<'_>, now_ms: u64) {
        let Some(p) = self.publishers.get(&publisher_id) else {
            tracing::warn!(peer = %self.peer.addr, publisher_id, "stream connection: publish to an undeclared publisher");
            self.publish_error(publisher_id, messages, code::PUBLISHER_DOES_NOT_EXIST);
            return;
        };
        if messages.is_empty() {
            return;
        }
        // No per-frame clone of the stream's name (or a (vhost, stream) key): with 1-message
        // frames these allocations were a measurable part of the broker's time (perf).
        let result = self.backend.append(
            p.target.as_ref(),
            &self.vhost,
            &p.stream,
            p.reference.as_deref(),
            messages,
            now_ms,
        );
        match result {
            Ok(a) => {
                let Some(offset) = a.confirm_at else {
                    let ids = messages.iter().map(|m| m.publishing_id).collect();
                    self.confirm(publisher_id, ids);
                    return;
                };
                self.unconfirmed += messages.len();
                // One lookup per frame (the entry is made once per run of unconfirmed ones).
                let sp = match self.pending.get_mut(p.stream.as_str()) {
                    Some(sp) => sp,
                    None => self.pending.entry(p.stream.clone()).or_default(),
                };
                sp.ids.extend(messages.iter().map(|m| m.publishing_id));
                sp.queue.push_back(Pending {
                    offset,
                    publisher_id,
                    count: messages.len(),
                });
                if sp.waiting_for.is_none() {
                    sp.waiting_for = Some(offset);
                    self.waits.push(Wait::Durable {
                        vhost: self.vhost.clone(),
                        stream: p.stream.clone(),
                        offset,
                    });
                }
            }
            Err(e) => {
                let stream = p.stream.clone();
                tracing::warn!(peer = %self.peer.addr, stream = %Escaped(&stream), "stream connection: publish: {}", Escaped(&e.to_string()));
                self.publish_error(publisher_id, messages, e.code());
                if e == StreamError::DoesNotExist {
                    self.stream_gone(&stream);
                }
            }
        }
    }

    /// A PublishError for every message of a frame, each with code `c` (as RabbitMQ).
    fn publish_error(&mut self, publisher_id: u8, messages: PublishedBatch<'_>, c: u16) {
        let mut it = messages.iter().peekable();
        while it.peek().is_some() {
            let errors = it
                .by_ref()
                .take(CONFIRMS_PER_FRAME)
                .map(|m| (m.publishing_id, c))
                .collect();
            self.send(&Frame::PublishError {
                publisher_id,
                errors,
            });
        }
    }

    fn confirm(&mut self, publisher_id: u8, ids: Vec<u64>) {
        for part in ids.chunks(CONFIRMS_PER_FRAME) {
            self.send(&Frame::PublishConfirm {
                publisher_id,
                publishing_ids: part.to_vec(),
            });
        }
    }

    /// The backend reports `offset` of `stream` durable (or the wait failed).
    pub fn durable(
        &mut self,
        vhost: &str,
        stream: &str,
        offset: u64,
        result: Result<(), StreamError>,
    ) {
        // A connection's vhost is fixed at Open, before any publisher: pending confirms are
        // keyed by the stream's name alone.
        if vhost != self.vhost {
            return;
        }
        let Some(sp) = self.pending.get_mut(stream) else {
            return;
        };
        sp.waiting_for = None;
        // The frames now durable (or failed), as runs of one publisher's consecutive frames:
        // their confirms go out in one frame per run (as RabbitMQ's): with one-message frames
        // in flight, a frame per Publish would cost the broker and the client as much as the
        // publish itself.
        let mut runs: Vec<(u8, Vec<u64>)> = Vec::new();
        let failed = result.is_err();
        while let Some(p) = sp.queue.front() {
            if !failed && p.offset > offset {
                break;
            }
            let Some(p) = sp.queue.pop_front() else {
                break;
            };
            let ids = sp.ids.drain(..p.count.min(sp.ids.len()));
            match runs.last_mut() {
                Some((id, run)) if *id == p.publisher_id => run.extend(ids),
                _ => runs.push((p.publisher_id, ids.collect())),
            }
        }
        let next_wait = sp.queue.back().map(|p| p.offset);
        if let Some(o) = next_wait {
            sp.waiting_for = Some(o);
            self.waits.push(Wait::Durable {
                vhost: vhost.to_string(),
                stream: stream.to_string(),
                offset: o,
            });
        } else {
            self.pending.remove(stream);
        }
        for (publisher_id, ids) in runs {
            self.unconfirmed = self.unconfirmed.saturating_sub(ids.len());
            match &result {
                Ok(()) => self.confirm(publisher_id, ids),
                Err(e) => {
                    for part in ids.chunks(CONFIRMS_PER_FRAME) {
                        self.send(&Frame::PublishError {
                            publisher_id,
                            errors: part.iter().map(|id| (*id, e.code())).collect(),
                        });
                    }
                }
            }
        }
    }

    fn subscribe(
        &mut self,
        corr: u32,
        subscription_id: u8,
        stream: String,
        offset: OffsetSpec,
        credit: u16,
        properties: &[(String, String)],
    ) {
        let vhost = self.vhost.clone();
        let sac = properties
            .iter()
            .any(|(k, v)| k == "single-active-consumer" && v == "true");
        let property = |name: &str| {
            properties
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.as_str())
        };
        // A single active consumer needs its group's name (RabbitMQ refuses one without).
        let sac_name = property("name").filter(|n| !n.is_empty() && sac);
        let c = if self.subscriptions.len() >= self.config.max_subscriptions {
            code::PRECONDITION_FAILED
        } else if !self.backend.stream_exists(&vhost, &stream) {
            code::STREAM_DOES_NOT_EXIST
        } else if self.subscriptions.contains_key(&subscription_id) {
            code::SUBSCRIPTION_ID_ALREADY_EXISTS
        } else if sac && sac_name.is_none() {
            tracing::warn!(peer = %self.peer.addr, stream = %Escaped(&stream), "stream connection: single active consumer without a name");
            code::PRECONDITION_FAILED
        } else {
            let filter = ReaderFilter::from_properties(properties);
            match self
                .backend
                .open_reader(&vhost, &stream, offset, filter.clone())
            {
                Ok(reader) => {
                    self.generation += 1;
                    let member = sac_name.map(|name| {
                        self.next_token += 1;
                        // A super stream's consumers pass it: the group of a partition
                        // spreads over them by the partition's index.
                        let partition = property("super-stream").and_then(|ss| {
                            self.backend
                                .partitions(&vhost, ss)
                                .ok()?
                                .iter()
                                .position(|p| *p == stream)
                        });
                        (self.next_token, name, partition)
                    });
                    let joined = match member {
                        Some((token, name, partition)) => self
                            .backend
                            .consumer_groups()
                            .join(self.conn_id, token, &vhost, &stream, name, partition)
                            .map(|()| {
                                Some(SacMember {
                                    token,
                                    active: false,
                                    filter,
                                })
                            }),
                        None => Ok(None),
                    };
                    match joined {
                        Ok(sac) => {
                            self.watch(&stream);
                            self.subscriptions.insert(
                                subscription_id,
                                Subscription {
                                    stream: stream.clone(),
                                    reader,
                                    credit: credit as u32,
                                    waiting: false,
                                    generation: self.generation,
                                    sac,
                                },
                            );
                            code::OK
                        }
                        Err(e) => {
                            tracing::warn!(peer = %self.peer.addr, stream = %Escaped(&stream), "stream connection: {}", Escaped(&e.to_string()));
                            code::PRECONDITION_FAILED
                        }
                    }
                }
                Err(e) => e.code(),
            }
        };
        if c != code::OK {
            tracing::warn!(peer = %self.peer.addr, stream = %Escaped(&stream), subscription_id, code = c, "stream connection: subscribe refused");
        }
        self.send(&response(key::SUBSCRIBE, corr, c));
        if c == code::OK {
            // A single active consumer's activation, if it is the first of its group.
            self.consumer_updates();
            self.pump();
        }
    }

    /// Data may be there for a subscription that waited.
    pub fn data_ready(
        &mut self,
        subscription_id: u8,
        generation: u64,
        result: Result<(), StreamError>,
    ) {
        let Some(s) = self.subscriptions.get_mut(&subscription_id) else {
            return;
        };
        if s.generation != generation {
            return;
        }
        s.waiting = false;
        match result {
            Ok(()) => self.pump(),
            Err(_) => {
                let stream = s.stream.clone();
                self.stream_gone(&stream);
            }
        }
    }

    /// The stream was deleted: drop this connection's publishers and subscriptions on it and
    /// tell the client (MetadataUpdate, "stream not available", as RabbitMQ).
    pub fn stream_gone(&mut self, stream: &str) {
        let before = self.publishers.len() + self.subscriptions.len();
        self.publishers.retain(|_, p| p.stream != stream);
        let mut left = Vec::new();
        self.subscriptions.retain(|_, s| {
            let keep = s.stream != stream;
            if !keep && let Some(m) = &s.sac {
                left.push(m.token);
            }
            keep
        });
        if self.publishers.len() + self.subscriptions.len() != before {
            self.send(&Frame::MetadataUpdate {
                code: code::STREAM_NOT_AVAILABLE,
                stream: stream.to_string(),
            });
        }
        self.leave_groups(left);
        self.unwatch_unused();
    }

    /// Sends chunks to subscriptions with credit, while the outgoing buffer has room; a
    /// subscription at the end of its stream asks for a `Wait::Data`.
    fn pump(&mut self) {
        let ids: Vec<u8> = self.subscriptions.keys().copied().collect();
        let mut gone = Vec::new();
        for id in ids {
            loop {
                let room = self.config.out_high_water.saturating_sub(self.out_len());
                let Some(s) = self.subscriptions.get_mut(&id) else {
                    break;
                };
                let inactive = s.sac.as_ref().is_some_and(|m| !m.active);
                if s.credit == 0 || s.waiting || room == 0 || inactive {
                    break;
                }
                match s.reader.read(s.credit as usize, room) {
                    Ok(batch) if batch.chunks.is_empty() => {
                        s.waiting = true;
                        self.waits.push(Wait::Data {
                            vhost: self.vhost.clone(),
                            stream: s.stream.clone(),
                            from: s.reader.position(),
                            subscription_id: id,
                            generation: s.generation,
                        });
                        break;
                    }
                    Ok(batch) => {
                        s.credit -= batch.chunks.len().min(s.credit as usize) as u32;
                        let committed = self.deliver_v2.then_some(batch.committed_chunk_id);
                        for chunk in &batch.chunks {
                            if let Some(r) =
                                codec::encode_deliver(id, committed, chunk, &mut self.out)
                            {
                                self.cut();
                                self.parts_len += r.len as usize;
                                self.parts.push(OutPart::File(r.clone()));
                            }
                        }
                    }
                    Err(e) => {
                        tracing::warn!(peer = %self.peer.addr, stream = %Escaped(&s.stream), "stream connection: read: {}", Escaped(&e.to_string()));
                        gone.push(s.stream.clone());
                        break;
                    }
                }
            }
        }
        for stream in gone {
            self.stream_gone(&stream);
        }
    }
}

/// The versions this server speaks (RabbitMQ's list; Deliver v2 is taken when a client
/// offers it).
pub fn server_versions() -> Vec<codec::CommandVersion> {
    let mut v: Vec<codec::CommandVersion> = [
        key::DECLARE_PUBLISHER,
        key::PUBLISH,
        key::QUERY_PUBLISHER_SEQUENCE,
        key::DELETE_PUBLISHER,
        key::SUBSCRIBE,
        key::CREDIT,
        key::STORE_OFFSET,
        key::QUERY_OFFSET,
        key::UNSUBSCRIBE,
        key::CREATE,
        key::DELETE,
        key::METADATA,
        key::CLOSE,
        key::HEARTBEAT,
        key::ROUTE,
        key::PARTITIONS,
        key::STREAM_STATS,
        key::CREATE_SUPER_STREAM,
        key::DELETE_SUPER_STREAM,
        key::RESOLVE_OFFSET_SPEC,
    ]
    .iter()
    .map(|&k| (k, 1, 1))
    .collect();
    v[1].2 = 2; // publish: v1..v2 (filter values)
    v
}
