//! One AMQP connection's protocol state, sans-IO: bytes in (with the current time in ms of a
//! monotonic clock the shell keeps), core effects in, login answers in; bytes out, core ops
//! out, login checks out, and one deadline. The tokio shell (`connection.rs`) moves bytes,
//! effects and time; everything the protocol decides is here, so it is tested without
//! sockets (tests/session_sans_io.rs), as `warren-mqtt`'s session is.
//!
//! Phases: the handshake (`handshake.rs`), open (frames to ops through the channel table,
//! `channels.rs`; effects to frames in `session/effects.rs`), closing (we sent connection.close and wait for
//! close-ok, bounded), ended.

use crate::channels::{Channels, Done, Out};
use crate::codec::{self, Frame};
use crate::config::AmqpConfig;
use crate::confirms::PendingAcks;
use crate::error::GatewayError;
use crate::handshake::{self, Handshake, Login, Negotiated, Step};
use crate::heartbeat::{Beat, Heartbeat};
use crate::methods::method_name;
use amq_protocol::protocol::{AMQPClass, connection};
use bytes::BytesMut;
use std::sync::Arc;
use warren_core::command::Op;
use warren_core::effect::Effect;
use warren_core::error::ErrorCode;
use warren_core::escape::Escaped;

mod effects;

/// How long we wait for `connection.close-ok` after sending `connection.close`.
const CLOSE_TIMEOUT_MS: u64 = 3_000;
/// Effect batches or encoded bytes gathered into one write.
const MAX_BATCHES_PER_WRITE: usize = 64;
/// Output beyond which effects wait for the next write.
const MAX_WRITE_BYTES: usize = 1024 * 1024;
/// An output buffer grown larger than this is released once written.
const RELEASE_OUTPUT_ABOVE: usize = 256 * 1024;

/// How a session ended.
#[derive(Clone, Debug, PartialEq)]
pub enum Ended {
    /// The client sent connection.close and got close-ok.
    ClientClosed,
    /// The peer closed the socket without connection.close.
    Eof,
    /// We sent connection.close with this code and text (and got close-ok, or gave up).
    Closed(u16, String),
    /// Nothing received for two heartbeat intervals (seconds): the socket is just closed.
    MissedHeartbeats(u64),
    /// The handshake did not complete within the configured time.
    HandshakeTimeout,
    /// The handshake refused the connection: code and reason.
    Refused(ErrorCode, String),
}

/// What the shell needs to attach an opened connection to the broker.
pub struct Opened {
    pub heartbeat_secs: u16,
    pub frame_max: u32,
    pub user: String,
    pub client_properties: warren_core::message::FieldTable,
}

enum Phase {
    Handshake {
        handshake: Box<Handshake>,
        deadline: u64,
    },
    Open,
    /// We sent connection.close: frames are discarded until close-ok, until `deadline`.
    Closing {
        code: u16,
        text: String,
        deadline: u64,
    },
    Ended(Ended),
}

/// A login check asked of the shell, and what its answer resumes.
enum Awaiting {
    Handshake,
    /// `connection.update-secret`, with its reason (for the log).
    Secret(String),
}

/// What the handshake settled that the open connection keeps.
struct Connection {
    vhost: String,
    user: String,
    blocked_notify: bool,
    frame_max: u32,
}

pub struct Session {
    config: Arc<AmqpConfig>,
    /// For log lines.
    peer: Arc<str>,
    phase: Phase,
    out: BytesMut,
    ops: Vec<(u16, Op)>,
    login: Option<Login>,
    awaiting: Option<Awaiting>,
    opened: Option<Opened>,
    conn: Connection,
    channels: Channels,
    heartbeat: Option<Heartbeat>,
    /// Acks gathered during one batch of effects.
    pending_acks: PendingAcks,
    /// The broker's memory alarm is on.
    blocked: bool,
    /// This connection has published: while blocked, it is not read from (RabbitMQ blocks
    /// publishing connections; consumers keep acking, which is what frees memory).
    published: bool,
    /// The core's flow control paused this (publishing) connection.
    flow_paused: bool,
    /// We told the client connection.blocked (and owe it connection.unblocked).
    blocked_sent: bool,
}

impl Session {
    /// A session waiting for the protocol header. `identity`: the subject CN of a verified
    /// TLS client certificate (EXTERNAL is offered); `peer`: for log lines.
    pub fn new(
        config: Arc<AmqpConfig>,
        identity: Option<String>,
        peer: Arc<str>,
        now: u64,
    ) -> Session {
        let deadline = now.saturating_add(config.handshake_timeout.as_millis() as u64);
        Session {
            phase: Phase::Handshake {
                handshake: Box::new(Handshake::new(config.clone(), identity, peer.clone())),
                deadline,
            },
            channels: Channels::new(config.channel_max, config.max_message_size),
            config,
            peer,
            out: BytesMut::new(),
            ops: Vec::new(),
            login: None,
            awaiting: None,
            opened: None,
            conn: Connection {
                vhost: String::new(),
                user: String::new(),
                blocked_notify: false,
                frame_max: 0,
            },
            heartbeat: None,
            pending_acks: PendingAcks::default(),
            blocked: false,
            published: false,
            flow_paused: false,
            blocked_sent: false,
        }
    }

    // ---- what the shell reads ----

    /// Bytes to write to the peer; call [`Session::output_written`] once they are.
    pub fn output(&self) -> &[u8] {
        &self.out
    }

    /// The output was written at `now`.
    pub fn output_written(&mut self, now: u64) {
        if let Some(h) = &mut self.heartbeat {
            h.written(now);
        }
        if self.out.capacity() > RELEASE_OUTPUT_ABOVE {
            self.out = BytesMut::new();
        } else {
            self.out.clear();
        }
    }

    /// Ops for the core, in order. Send them after writing the output: the write-window
    /// credit (`Op::Written`) must not return before the deliveries it counts are written.
    pub fn take_ops(&mut self) -> Vec<(u16, Op)> {
        std::mem::take(&mut self.ops)
    }

    /// A login check to make and answer with [`Session::on_login`]; no input is processed
    /// meanwhile.
    pub fn take_login(&mut self) -> Option<Login> {
        self.login.take()
    }

    /// Once, when the handshake has completed: attach the connection to the broker.
    pub fn take_opened(&mut self) -> Option<Opened> {
        self.opened.take()
    }

    /// How the session ended; the shell closes the socket after writing the output.
    pub fn ended(&self) -> Option<&Ended> {
        match &self.phase {
            Phase::Ended(e) => Some(e),
            _ => None,
        }
    }

    pub fn is_open(&self) -> bool {
        matches!(self.phase, Phase::Open)
    }

    /// When [`Session::on_timeout`] must run next.
    pub fn deadline(&self) -> Option<u64> {
        match &self.phase {
            Phase::Handshake { deadline, .. } | Phase::Closing { deadline, .. } => Some(*deadline),
            Phase::Open => self.heartbeat.as_ref().map(Heartbeat::deadline),
            Phase::Ended(_) => None,
        }
    }

    /// Whether the shell must stop reading: by the memory alarm (publishers only) or by flow
    /// control.
    pub fn read_paused(&self) -> bool {
        matches!(self.phase, Phase::Open) && ((self.blocked && self.published) || self.flow_paused)
    }

    // ---- what the shell feeds ----

    /// Handles every complete frame at the front of `input` (bytes read at `now`); a partial
    /// frame stays there for the next read.
    pub fn handle_input(&mut self, now: u64, input: &mut BytesMut) {
        if let Some(h) = &mut self.heartbeat {
            h.read(now);
        }
        loop {
            if self.login.is_some() || self.awaiting.is_some() {
                // A login check comes first, whatever the client sent behind it.
                return;
            }
            match &mut self.phase {
                Phase::Handshake { handshake, .. } => {
                    let step = handshake.handle_input(input, &mut self.out);
                    if !self.on_step(now, step) {
                        return;
                    }
                }
                Phase::Open => {
                    if let Err(e) = self.on_frames(input) {
                        self.fail(now, e);
                    }
                    // It may have published just now, during an alarm.
                    self.notify_blocked();
                    if matches!(self.phase, Phase::Open) {
                        return;
                    }
                }
                Phase::Closing { .. } => {
                    self.await_close_ok(input);
                    return;
                }
                Phase::Ended(_) => return,
            }
        }
    }

    /// The answer to the last [`Session::take_login`]: `Err` says why the broker refused.
    /// Call [`Session::handle_input`] after it: input that waited for the answer is read.
    pub fn on_login(&mut self, now: u64, answer: Result<(), String>) {
        match self.awaiting.take() {
            Some(Awaiting::Handshake) => {
                if let Phase::Handshake { handshake, .. } = &mut self.phase {
                    let step = handshake.on_login(answer, &mut self.out);
                    self.on_step(now, step);
                }
            }
            Some(Awaiting::Secret(reason)) => self.on_secret_checked(now, answer, &reason),
            None => {}
        }
    }

    /// A batch of the core's effects, and (bounded) the batches `next` yields while the
    /// output stays small: encoded together, so runs of acks collapse. `next` is called only
    /// for a batch that will be encoded: what it yields leaves the mailbox.
    pub fn handle_effects(
        &mut self,
        now: u64,
        first: Vec<Effect>,
        mut next: impl FnMut() -> Option<Vec<Effect>>,
    ) {
        if !matches!(self.phase, Phase::Open) {
            // Closing or closed: the client gets nothing but the close handshake.
            return;
        }
        let mut delivered: u32 = 0;
        let mut batch = first;
        let mut encoded = 0;
        loop {
            for effect in batch.drain(..) {
                self.encode_effect(now, effect, &mut delivered);
            }
            encoded += 1;
            // Checked before taking the next batch, never after: a batch taken from the
            // mailbox is encoded. One taken and dropped here lost its messages and, never
            // counted in `Op::Written`, held their write-window credit for good.
            if encoded >= MAX_BATCHES_PER_WRITE || self.out.len() >= MAX_WRITE_BYTES {
                break;
            }
            match next() {
                Some(b) => batch = b,
                None => break,
            }
        }
        let runs: Vec<_> = self.pending_acks.drain().collect();
        for (ch, first, last) in runs {
            self.emit_acks(ch, first, last);
        }
        if delivered > 0 {
            self.ops.push((0, Op::Written { count: delivered }));
        }
    }

    /// The deadline passed: heartbeats, the handshake and close timeouts.
    pub fn on_timeout(&mut self, now: u64) {
        match &self.phase {
            Phase::Handshake { deadline, .. } if now >= *deadline => {
                self.phase = Phase::Ended(Ended::HandshakeTimeout);
            }
            Phase::Closing {
                code,
                text,
                deadline,
            } if now >= *deadline => {
                self.phase = Phase::Ended(Ended::Closed(*code, text.clone()));
            }
            Phase::Open => {
                let paused = self.read_paused();
                let Some(h) = &mut self.heartbeat else {
                    return;
                };
                match h.on_timeout(now, paused) {
                    Beat::Idle => {}
                    Beat::Send => codec::encode_heartbeat(&mut self.out),
                    Beat::PeerDead => {
                        self.phase = Phase::Ended(Ended::MissedHeartbeats(h.interval_secs()))
                    }
                }
            }
            _ => {}
        }
    }

    /// The peer closed its side (or the socket failed): how the session ended.
    pub fn peer_gone(&mut self) {
        let end = match std::mem::replace(&mut self.phase, Phase::Ended(Ended::Eof)) {
            // We were waiting for close-ok; the close is what happened.
            Phase::Closing { code, text, .. } => Ended::Closed(code, text),
            Phase::Ended(e) => e,
            _ => Ended::Eof,
        };
        self.phase = Phase::Ended(end);
    }

    /// The broker shuts down: close with 320 CONNECTION_FORCED. A connection still in its
    /// handshake is left to its handshake timeout.
    pub fn shutdown(&mut self, now: u64) {
        if matches!(self.phase, Phase::Open) {
            self.close_connection(
                now,
                ErrorCode::ConnectionForced,
                "CONNECTION_FORCED - broker shutdown".into(),
                (0, 0),
            );
        }
    }

    // ---- the handshake ----

    /// Applies a handshake step; whether input processing goes on.
    fn on_step(&mut self, now: u64, step: Step) -> bool {
        match step {
            Step::More => false,
            Step::Login(login) => {
                self.login = Some(login);
                self.awaiting = Some(Awaiting::Handshake);
                false
            }
            Step::Refused(code, text) => {
                self.phase = Phase::Ended(Ended::Refused(code, text));
                false
            }
            Step::Done(n) => {
                self.open(now, *n);
                true
            }
        }
    }

    fn open(&mut self, now: u64, n: Negotiated) {
        self.channels = Channels::new(n.channel_max, self.config.max_message_size);
        self.heartbeat = Heartbeat::new(n.heartbeat_secs, now);
        self.opened = Some(Opened {
            heartbeat_secs: n.heartbeat_secs,
            frame_max: n.frame_max,
            user: n.user.clone(),
            client_properties: n.client_properties,
        });
        self.ops.push((
            0,
            Op::ConnectionOpen {
                // Kept: connection.update-secret checks the user in its vhost again.
                vhost: n.vhost.clone(),
                user: n.user.clone(),
                cancel_notify: n.cancel_notify,
            },
        ));
        self.conn = Connection {
            vhost: n.vhost,
            user: n.user,
            blocked_notify: n.blocked_notify,
            frame_max: n.frame_max,
        };
        self.phase = Phase::Open;
    }

    // ---- the open connection: input ----

    /// Decodes and handles every complete frame in `input`, while open.
    fn on_frames(&mut self, input: &mut BytesMut) -> Result<(), GatewayError> {
        // An update-secret is answered before anything after it is read.
        while matches!(self.phase, Phase::Open) && self.awaiting.is_none() {
            let frame = match codec::decode(input, self.conn.frame_max) {
                Ok(Some(frame)) => frame,
                Ok(None) => return Ok(()),
                Err(GatewayError::NotUtf8 { channel, ids, text }) => {
                    let out = Out {
                        bytes: &mut self.out,
                        ops: &mut self.ops,
                        peer: &self.peer,
                    };
                    self.channels.on_not_utf8(channel, ids, text, out)?;
                    continue;
                }
                Err(e) => return Err(e),
            };
            self.on_frame(frame)?;
        }
        Ok(())
    }

    fn on_frame(&mut self, frame: Frame) -> Result<(), GatewayError> {
        let out = Out {
            bytes: &mut self.out,
            ops: &mut self.ops,
            peer: &self.peer,
        };
        let done = match frame {
            Frame::Heartbeat(0) => return Ok(()),
            Frame::Heartbeat(ch) => {
                return Err(GatewayError::Frame(format!(
                    "heartbeat frame on channel {ch}"
                )));
            }
            Frame::Method(0, method) => return self.on_connection_method(method),
            Frame::Method(ch, method) => self.channels.on_method(ch, method, out)?,
            Frame::Header(ch, header) => self.channels.on_header(ch, header, out)?,
            Frame::Body(ch, body) => self.channels.on_body(ch, body, out)?,
        };
        if done == Done::Published {
            self.published = true;
        }
        Ok(())
    }

    fn on_connection_method(&mut self, method: AMQPClass) -> Result<(), GatewayError> {
        match method {
            AMQPClass::Connection(connection::AMQPMethod::Close(_)) => {
                self.ops.push((0, Op::ConnectionClose));
                codec::encode_method(&mut self.out, 0, handshake::connection_close_ok());
                self.phase = Phase::Ended(Ended::ClientClosed);
                Ok(())
            }
            AMQPClass::Connection(connection::AMQPMethod::CloseOk(_)) => Ok(()),
            AMQPClass::Connection(connection::AMQPMethod::UpdateSecret(u)) => {
                // `connection.update-secret` (RabbitMQ 3.8+, an OAuth 2 token refresh). A
                // password user's credentials do not expire, so RabbitMQ 3.10 takes any new
                // secret from one without looking at it (its internal backend's
                // state_can_expire() is false; pika's TestUpdateSecret sends `new_secret`
                // for guest). Checking it as the password closed those connections with
                // 530. What is checked again: that the user still exists and may use this
                // connection's vhost, as a login with no password (TLS's) is checked.
                self.login = Some(Login {
                    user: self.conn.user.clone(),
                    password: None,
                    vhost: Some(self.conn.vhost.clone()),
                });
                self.awaiting = Some(Awaiting::Secret(u.reason.to_string()));
                Ok(())
            }
            other => Err(GatewayError::CommandInvalid(format!(
                "unexpected method on channel 0: {}",
                method_name(&other)
            ))),
        }
    }

    /// update-secret-ok if the new secret holds, else the connection closes with 530 as
    /// RabbitMQ's does when a backend refuses the secret.
    fn on_secret_checked(&mut self, now: u64, answer: Result<(), String>, reason: &str) {
        let user = Escaped(&self.conn.user);
        match answer {
            Ok(()) => {
                tracing::info!(peer = %self.peer, %user, reason = %Escaped(reason), "updated secret");
                codec::encode_method(
                    &mut self.out,
                    0,
                    AMQPClass::Connection(connection::AMQPMethod::UpdateSecretOk(
                        connection::UpdateSecretOk {},
                    )),
                );
            }
            Err(why) => {
                tracing::warn!(peer = %self.peer, %user, "secret update refused: {}", Escaped(&why));
                self.close_connection(
                    now,
                    ErrorCode::NotAllowed,
                    "NOT_ALLOWED - New secret was refused by one of the backends".into(),
                    (10, 70),
                );
            }
        }
    }

    /// After sending connection.close: ignore everything until close-ok. A simultaneous
    /// close from the client gets its close-ok. Input that no longer frames (the error was a
    /// framing error) is discarded: the shell keeps reading rather than leave it unread, as
    /// closing a socket with unread input resets it, and the reset can destroy our
    /// connection.close before the client reads it.
    fn await_close_ok(&mut self, input: &mut BytesMut) {
        let Phase::Closing { code, text, .. } = &self.phase else {
            return;
        };
        loop {
            match codec::decode(input, self.conn.frame_max) {
                Ok(Some(Frame::Method(
                    0,
                    AMQPClass::Connection(connection::AMQPMethod::CloseOk(_)),
                ))) => break,
                Ok(Some(Frame::Method(
                    0,
                    AMQPClass::Connection(connection::AMQPMethod::Close(_)),
                ))) => {
                    codec::encode_method(&mut self.out, 0, handshake::connection_close_ok());
                    break;
                }
                Ok(Some(_)) => continue,
                Ok(None) => return,
                Err(_) => {
                    input.clear();
                    return;
                }
            }
        }
        self.phase = Phase::Ended(Ended::Closed(*code, text.clone()));
    }

    /// A connection-level error: send connection.close and stop processing input.
    fn fail(&mut self, now: u64, e: GatewayError) {
        let text = e.to_string();
        self.close_connection(now, e.code(), text, (0, 0));
    }

    fn close_connection(&mut self, now: u64, code: ErrorCode, text: String, ids: (u16, u16)) {
        if !matches!(self.phase, Phase::Open) {
            return;
        }
        codec::encode_method(
            &mut self.out,
            0,
            handshake::connection_close(code.code(), &text, ids),
        );
        self.phase = Phase::Closing {
            code: code.code(),
            text,
            deadline: now.saturating_add(CLOSE_TIMEOUT_MS),
        };
    }

    // ---- the open connection: effects ----

    /// Tells the client connection.blocked once it is blocked: during an alarm and once it
    /// has published, as RabbitMQ does. A connection that only consumes is never told:
    /// clients stop sending everything while blocked (lapin does), and a consumer that
    /// stops acking holds the very memory the alarm waits for.
    fn notify_blocked(&mut self) {
        if self.blocked && self.published && self.conn.blocked_notify && !self.blocked_sent {
            codec::encode_method(&mut self.out, 0, handshake::connection_blocked());
            self.blocked_sent = true;
        }
    }
}
