//! The sans-IO state machine of one AMQP 1.0 connection: bytes and time in, bytes, events
//! and a deadline out. It runs the protocol headers (`AMQP 3 1 0 0` then SASL, then
//! `AMQP 0 1 0 0`), open/close with max-frame-size, channel-max and idle-time-out, sessions
//! (begin/end, the incoming window), links (attach/detach, handle-max, link credit) and
//! transfers (multi-frame assembly, max-message-size). What a link carries is the shell's
//! business: it gets [`Event`]s (a link to accept or refuse, a complete message, credit, a
//! disposition) and answers through the methods below.
//!
//! Errors go to the spec's scope: a link error detaches the link, a session error ends the
//! session, a connection error closes the connection; other sessions and links go on.

use crate::frame::{self, AMQP_HEADER, Body, MIN_MAX_FRAME_SIZE, SASL_HEADER};
use crate::performatives::{
    Attach, Begin, DeliveryState, Detach, Disposition, Error, Flow, Open, Performative, Role, Sasl,
    Source, Target, Transfer, condition,
};
use crate::sasl::{self, Login};
use crate::types::Value;
use bytes::{Bytes, BytesMut};
use std::collections::HashMap;

/// What the gateway announces and enforces.
#[derive(Clone, Debug)]
pub struct Config {
    pub container_id: String,
    pub max_frame_size: u32,
    pub channel_max: u16,
    /// Milliseconds; the peer must send something at least this often (we close at twice).
    pub idle_timeout_ms: u32,
    pub handle_max: u32,
    /// Our incoming window per session, in transfer frames.
    pub incoming_window: u32,
    pub max_message_size: u64,
    pub allow_anonymous: bool,
    /// The `product` and `version` connection properties (see docs/amqp10.md).
    pub product: String,
    pub version: String,
    /// This broker's name in the management node's queue answers (`leader`, `replicas`).
    pub node: String,
    /// The peer's `open` waits for the shell's [`Connection::answer_open`] (the vhost
    /// check) before ours is sent: a refused vhost ends the handshake before any `open`,
    /// which a client sees as a failed connect (RabbitMQ checks first too).
    pub check_open: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            container_id: "warren".into(),
            max_frame_size: 131_072,
            channel_max: 255,
            idle_timeout_ms: 60_000,
            handle_max: 255,
            incoming_window: 400,
            max_message_size: 16 * 1024 * 1024,
            allow_anonymous: false,
            // RabbitMQ 4's own clients refuse any other product or a version below 4.0.0
            // (rabbitmq-amqp-python-client's `_validate_server_properties`).
            product: "RabbitMQ".into(),
            version: "4.0.0".into(),
            node: "warren".into(),
            check_open: false,
        }
    }
}

/// What the shell must act on.
// An attach carries both termini; events are taken as soon as they are made, so the size
// of the enum costs nothing worth a box per event.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, PartialEq)]
pub enum Event {
    /// Check these credentials; answer with [`Connection::on_login`].
    Login(Login),
    /// The connection is open (after the peer's `open`), with the peer's `hostname`.
    Opened { hostname: Option<String> },
    /// With [`Config::check_open`]: the peer's `open` named this `hostname`; answer with
    /// [`Connection::answer_open`].
    OpenRequested { hostname: Option<String> },
    /// A link the peer attached; answer with [`Connection::accept_link`] or
    /// [`Connection::refuse_link`]. `role` is the peer's.
    Attach {
        channel: u16,
        handle: u32,
        role: Role,
        name: String,
        source: Option<Source>,
        target: Option<Target>,
        rcv_settle_mode: u8,
        snd_settle_mode: u8,
        /// The attach's link properties (RabbitMQ's management link pair needs `paired`).
        properties: Option<Value>,
    },
    /// A complete message (all its transfer frames) on a link the peer sends on.
    Message {
        channel: u16,
        handle: u32,
        delivery_id: u32,
        settled: bool,
        payload: Bytes,
    },
    /// The peer gave credit on a link it receives on.
    Credit {
        channel: u16,
        handle: u32,
        credit: u32,
        /// The peer's view of our delivery-count (`None`: ours is still the initial 0):
        /// what we may send is `delivery_count + credit - our count` (2.6.7).
        delivery_count: Option<u32>,
        drain: bool,
    },
    /// The peer settled or gave an outcome for our deliveries `first..=last`.
    Disposition {
        channel: u16,
        first: u32,
        last: u32,
        settled: bool,
        state: Option<DeliveryState>,
    },
    /// The peer detached a link (or we did, on an error).
    Detached { channel: u16, handle: u32 },
    /// The session on this channel ended (its links are gone).
    Ended { channel: u16 },
}

/// Why and how the connection ended.
#[derive(Clone, Debug, PartialEq)]
pub enum Ended {
    /// The peer closed (with its error, if any).
    PeerClosed(Option<Error>),
    /// We closed with this error.
    Closed(Error),
    /// A header we do not speak, or SASL failed: the socket is just closed.
    Refused(String),
}

enum Phase {
    /// Waiting for the first protocol header.
    Header,
    /// SASL mechanisms sent, waiting for sasl-init.
    SaslInit,
    /// The login is with the shell.
    SaslChecking,
    /// SASL succeeded; waiting for the AMQP header.
    AmqpHeader,
    /// AMQP header exchanged, waiting for open.
    Open,
    /// The peer's open is with the shell (`check_open`); its hostname.
    OpenChecking(Option<String>),
    Opened,
    /// We sent close; waiting for the peer's.
    Closing,
    Ended(Ended),
}

struct Link {
    role: Role,
    attached: bool,
    /// For links the peer sends on: credit we gave and not yet used.
    credit: u32,
    /// For links the peer sends on: its delivery-count as we count it (its initial one plus
    /// the deliveries begun since). Our flows carry it so the peer computes its credit from
    /// ours (2.6.7); without it the peer takes 0 and a granted credit shrinks by every
    /// message sent so far.
    delivery_count: u32,
    /// A message whose transfers have `more` set: id, settled, bytes so far.
    partial: Option<(u32, bool, BytesMut)>,
    /// We sent our detach (an error, or a refused attach) and wait for the peer's: its
    /// handle stays taken until then (2.6.4), and what still comes on it is dropped.
    detached: bool,
}

struct SessionState {
    remote_channel: u16,
    /// The next transfer id we expect, and how many more we take.
    next_incoming_id: u32,
    incoming_window: u32,
    /// Our own outgoing ids (deliveries we send).
    next_outgoing_id: u32,
    /// The peer's incoming window for our transfers.
    remote_incoming_window: u32,
    links: HashMap<u32, Link>,
    /// After we ended the session on an error: frames are ignored until the peer's end.
    ending: bool,
}

pub struct Connection {
    config: Config,
    identity: Option<String>,
    phase: Phase,
    out: BytesMut,
    events: Vec<Event>,
    /// The peer's max-frame-size (what we may send).
    remote_max_frame: u32,
    /// Half the peer's idle timeout: how often we must send something (ms).
    heartbeat_every: Option<u64>,
    last_received: u64,
    last_sent: u64,
    sessions: HashMap<u16, SessionState>,
    /// What we closed with, kept until the peer's close arrives.
    closed_with: Option<Error>,
}

const PRE_OPEN_MAX_FRAME: u32 = MIN_MAX_FRAME_SIZE;

impl Connection {
    /// `identity`: the verified client certificate's subject (EXTERNAL is offered).
    pub fn new(config: Config, identity: Option<String>, now: u64) -> Self {
        Connection {
            config,
            identity,
            phase: Phase::Header,
            out: BytesMut::new(),
            events: Vec::new(),
            remote_max_frame: PRE_OPEN_MAX_FRAME,
            heartbeat_every: None,
            last_received: now,
            last_sent: now,
            sessions: HashMap::new(),
            closed_with: None,
        }
    }

    /// Bytes to send (take them all).
    pub fn take_output(&mut self) -> BytesMut {
        std::mem::take(&mut self.out)
    }

    pub fn has_output(&self) -> bool {
        !self.out.is_empty()
    }

    pub fn has_events(&self) -> bool {
        !self.events.is_empty()
    }

    pub fn take_events(&mut self) -> Vec<Event> {
        std::mem::take(&mut self.events)
    }

    pub fn ended(&self) -> Option<&Ended> {
        match &self.phase {
            Phase::Ended(e) => Some(e),
            _ => None,
        }
    }

    /// When [`Connection::on_timeout`] is due (ms), if ever.
    pub fn deadline(&self) -> Option<u64> {
        if !matches!(self.phase, Phase::Opened) {
            return None;
        }
        let idle = u64::from(self.config.idle_timeout_ms) * 2;
        let mut d = (idle > 0).then(|| self.last_received + idle);
        if let Some(every) = self.heartbeat_every {
            let hb = self.last_sent + every;
            d = Some(d.map_or(hb, |x| x.min(hb)));
        }
        d
    }

    pub fn on_timeout(&mut self, now: u64) {
        if !matches!(self.phase, Phase::Opened) {
            return;
        }
        let idle = u64::from(self.config.idle_timeout_ms) * 2;
        if idle > 0 && now >= self.last_received + idle {
            self.close(
                now,
                Error::new(
                    condition::RESOURCE_LIMIT_EXCEEDED,
                    "local-idle-timeout expired",
                ),
            );
            return;
        }
        if let Some(every) = self.heartbeat_every
            && now >= self.last_sent + every
        {
            frame::encode_heartbeat(&mut self.out);
            self.last_sent = now;
        }
    }

    /// Reads what it can from `input` (consumed bytes are removed).
    pub fn handle_input(&mut self, now: u64, input: &mut BytesMut) {
        if !input.is_empty() {
            self.last_received = now;
        }
        loop {
            match self.phase {
                Phase::Ended(_) => {
                    input.clear();
                    return;
                }
                Phase::SaslChecking | Phase::OpenChecking(_) => return,
                Phase::Header | Phase::AmqpHeader => {
                    if input.len() < 8 {
                        return;
                    }
                    let header = input.split_to(8);
                    self.on_header(&header);
                }
                _ => {
                    // Our own limit, announced in our open, holds from the start: some
                    // clients' SASL inits and opens exceed the spec's 512-byte pre-open size.
                    let max = self.config.max_frame_size;
                    match frame::decode_frame(input, max) {
                        Ok(None) => return,
                        Ok(Some(raw)) => {
                            let body = raw.body();
                            match body {
                                Ok(body) => self.on_frame(now, raw.kind, raw.channel, body),
                                Err(e) => {
                                    self.close(
                                        now,
                                        Error::new(condition::DECODE_ERROR, e.to_string()),
                                    );
                                }
                            }
                        }
                        Err(e) => {
                            let cond = match e {
                                frame::FrameError::Decode(_) | frame::FrameError::Field(_) => {
                                    condition::DECODE_ERROR
                                }
                                _ => condition::FRAMING_ERROR,
                            };
                            self.close(now, Error::new(cond, e.to_string()));
                            input.clear();
                            return;
                        }
                    }
                }
            }
        }
    }

    fn on_header(&mut self, header: &[u8]) {
        let sasl_phase = matches!(self.phase, Phase::Header);
        if header == SASL_HEADER && sasl_phase {
            self.out.extend_from_slice(&SASL_HEADER);
            let mechs = sasl::mechanisms(self.identity.as_deref(), self.config.allow_anonymous);
            let _ = frame::encode_sasl(&mut self.out, &Sasl::Mechanisms(mechs));
            self.phase = Phase::SaslInit;
        } else if header == AMQP_HEADER && !sasl_phase {
            self.out.extend_from_slice(&AMQP_HEADER);
            self.phase = Phase::Open;
        } else if header == AMQP_HEADER && self.config.allow_anonymous {
            // No SASL layer at all: RabbitMQ takes that as ANONYMOUS when it is allowed.
            self.out.extend_from_slice(&AMQP_HEADER);
            self.events.push(Event::Login(Login::Anonymous));
            self.phase = Phase::Open;
        } else {
            // The spec's answer to a header we do not take: ours, then close (2.2).
            self.out.extend_from_slice(if sasl_phase {
                &SASL_HEADER
            } else {
                &AMQP_HEADER
            });
            self.phase = Phase::Ended(Ended::Refused(format!(
                "protocol header {header:02x?} refused"
            )));
        }
    }

    /// The shell's answer to [`Event::OpenRequested`]: our `open` and [`Event::Opened`],
    /// or with `Err` the socket is closed with nothing sent, as RabbitMQ ends a handshake
    /// whose vhost check failed (`rabbit_amqp_reader`'s silent close): its clients then fail
    /// their connect, where an `open` would let it succeed and the `close` behind it start
    /// their reconnection.
    pub fn answer_open(&mut self, now: u64, answer: Result<(), Error>) {
        let Phase::OpenChecking(hostname) = &mut self.phase else {
            return;
        };
        let hostname = hostname.take();
        match answer {
            Ok(()) => {
                self.send_open(now);
                self.phase = Phase::Opened;
                self.events.push(Event::Opened { hostname });
            }
            Err(e) => {
                let why = e.description.unwrap_or(e.condition);
                self.phase = Phase::Ended(Ended::Refused(why));
            }
        }
    }

    /// The shell's answer to [`Event::Login`] (during SASL).
    pub fn on_login(&mut self, ok: bool) {
        if !matches!(self.phase, Phase::SaslChecking) {
            return;
        }
        let code = if ok { 0 } else { 1 };
        let _ = frame::encode_sasl(
            &mut self.out,
            &Sasl::Outcome {
                code,
                additional_data: None,
            },
        );
        self.phase = if ok {
            Phase::AmqpHeader
        } else {
            Phase::Ended(Ended::Refused("authentication failed".into()))
        };
    }

    fn send(&mut self, now: u64, channel: u16, p: &Performative, payload: &[u8]) {
        let _ = frame::encode_frame(&mut self.out, channel, p, payload);
        self.last_sent = now;
    }

    /// Closes the connection with `error` (a connection-scope error).
    pub fn close(&mut self, now: u64, error: Error) {
        if matches!(self.phase, Phase::Closing | Phase::Ended(_)) {
            return;
        }
        if matches!(self.phase, Phase::Open | Phase::OpenChecking(_)) {
            // The spec: an open must precede a close.
            self.send_open(now);
            self.phase = Phase::Open;
        }
        if matches!(self.phase, Phase::Open | Phase::Opened) {
            self.send(now, 0, &Performative::Close(Some(error.clone())), &[]);
            self.phase = Phase::Closing;
        }
        if !matches!(self.phase, Phase::Closing) {
            self.phase = Phase::Ended(Ended::Closed(error));
        } else {
            // Keep what we closed with for when the peer's close comes.
            self.closed_with = Some(error);
        }
    }

    fn send_open(&mut self, now: u64) {
        let props = Value::Map(vec![
            (
                Value::symbol("product"),
                Value::String(self.config.product.clone()),
            ),
            (
                Value::symbol("version"),
                Value::String(self.config.version.clone()),
            ),
            (
                Value::symbol("warren-product"),
                Value::String("Warren".into()),
            ),
            (
                Value::symbol("warren-version"),
                Value::String(env!("CARGO_PKG_VERSION").into()),
            ),
        ]);
        let open = Open {
            container_id: self.config.container_id.clone(),
            hostname: None,
            max_frame_size: self.config.max_frame_size,
            channel_max: self.config.channel_max,
            idle_time_out: (self.config.idle_timeout_ms > 0).then_some(self.config.idle_timeout_ms),
            outgoing_locales: Vec::new(),
            incoming_locales: Vec::new(),
            offered_capabilities: Vec::new(),
            desired_capabilities: Vec::new(),
            properties: Some(props),
        };
        self.send(now, 0, &Performative::Open(Box::new(open)), &[]);
    }

    fn on_frame(&mut self, now: u64, kind: u8, channel: u16, body: Body) {
        match (&self.phase, body) {
            (
                Phase::SaslInit,
                Body::Sasl(Sasl::Init {
                    mechanism,
                    initial_response,
                    ..
                }),
            ) => {
                match sasl::parse_init(
                    &mechanism,
                    initial_response.as_deref(),
                    self.identity.as_deref(),
                    self.config.allow_anonymous,
                ) {
                    Ok(login) => {
                        self.events.push(Event::Login(login));
                        self.phase = Phase::SaslChecking;
                    }
                    Err(_) => {
                        self.phase = Phase::SaslChecking;
                        self.on_login(false);
                    }
                }
            }
            (_, Body::Empty) => {}
            (Phase::SaslInit, _) => {
                self.phase = Phase::Ended(Ended::Refused(format!(
                    "frame type {kind} where sasl-init was due"
                )));
            }
            (Phase::Open, Body::Amqp(Performative::Open(open), _)) => {
                if open.max_frame_size < MIN_MAX_FRAME_SIZE {
                    self.send_open(now);
                    self.phase = Phase::Opened;
                    self.close(
                        now,
                        Error::new(condition::FRAME_SIZE_TOO_SMALL, "max-frame-size below 512"),
                    );
                    return;
                }
                self.remote_max_frame = open.max_frame_size.min(self.config.max_frame_size);
                // Send at half the peer's idle timeout, as the spec advises.
                self.heartbeat_every = open
                    .idle_time_out
                    .filter(|&t| t > 0)
                    .map(|t| u64::from(t) / 2);
                if self.config.check_open {
                    self.events.push(Event::OpenRequested {
                        hostname: open.hostname.clone(),
                    });
                    self.phase = Phase::OpenChecking(open.hostname);
                    return;
                }
                self.send_open(now);
                self.phase = Phase::Opened;
                self.events.push(Event::Opened {
                    hostname: open.hostname,
                });
            }
            (Phase::Open, _) => {
                self.close(now, Error::new(condition::ILLEGAL_STATE, "open expected"));
            }
            (Phase::Closing, Body::Amqp(Performative::Close(_), _)) => {
                let e = self
                    .closed_with
                    .take()
                    .unwrap_or_else(|| Error::new(condition::INTERNAL_ERROR, "closed"));
                self.phase = Phase::Ended(Ended::Closed(e));
            }
            (Phase::Closing, _) => {}
            (Phase::Opened, Body::Amqp(p, payload)) => {
                self.on_performative(now, channel, p, payload)
            }
            (Phase::Opened, Body::Sasl(_)) => self.close(
                now,
                Error::new(condition::FRAMING_ERROR, "SASL frame after open"),
            ),
            _ => {}
        }
    }

    fn on_performative(&mut self, now: u64, channel: u16, p: Performative, payload: Bytes) {
        match p {
            Performative::Close(e) => {
                self.send(now, 0, &Performative::Close(None), &[]);
                self.phase = Phase::Ended(Ended::PeerClosed(e));
            }
            Performative::Open(_) => {
                self.close(now, Error::new(condition::ILLEGAL_STATE, "second open"));
            }
            Performative::Begin(b) => self.on_begin(now, channel, b),
            other => {
                let Some(session) = self.sessions.get_mut(&channel) else {
                    self.close(
                        now,
                        Error::new(
                            condition::ILLEGAL_STATE,
                            format!("{} on channel {channel} without a session", other.name()),
                        ),
                    );
                    return;
                };
                if let Performative::End(_) = other {
                    let remote = session.remote_channel;
                    let ending = session.ending;
                    self.sessions.remove(&channel);
                    if !ending {
                        self.send(now, remote, &Performative::End(None), &[]);
                    }
                    self.events.push(Event::Ended { channel });
                    return;
                }
                if session.ending {
                    return;
                }
                self.on_session_frame(now, channel, other, payload);
            }
        }
    }

    fn on_begin(&mut self, now: u64, channel: u16, b: Begin) {
        if b.remote_channel.is_some() || self.sessions.contains_key(&channel) {
            self.close(
                now,
                Error::new(condition::ILLEGAL_STATE, "begin on a channel in use"),
            );
            return;
        }
        if channel > self.config.channel_max {
            self.close(
                now,
                Error::new(
                    condition::FRAMING_ERROR,
                    format!("channel {channel} beyond channel-max"),
                ),
            );
            return;
        }
        // Our outgoing channel is the same number as the peer's.
        self.sessions.insert(
            channel,
            SessionState {
                remote_channel: channel,
                next_incoming_id: b.next_outgoing_id,
                incoming_window: self.config.incoming_window,
                next_outgoing_id: 0,
                remote_incoming_window: b.incoming_window,
                links: HashMap::new(),
                ending: false,
            },
        );
        let reply = Begin {
            remote_channel: Some(channel),
            next_outgoing_id: 0,
            incoming_window: self.config.incoming_window,
            outgoing_window: u32::MAX,
            handle_max: self.config.handle_max,
            offered_capabilities: Vec::new(),
            desired_capabilities: Vec::new(),
            properties: None,
        };
        self.send(now, channel, &Performative::Begin(reply), &[]);
    }

    /// Ends the session on `channel` with a session-scope error.
    pub fn end_session(&mut self, now: u64, channel: u16, error: Error) {
        if let Some(s) = self.sessions.get_mut(&channel) {
            s.ending = true;
            let handles: Vec<u32> = s.links.keys().copied().collect();
            for handle in handles {
                self.events.push(Event::Detached { channel, handle });
            }
            if let Some(s) = self.sessions.get_mut(&channel) {
                s.links.clear();
            }
            self.send(now, channel, &Performative::End(Some(error)), &[]);
        }
    }

    /// Detaches a link with a link-scope error.
    pub fn detach_link(&mut self, now: u64, channel: u16, handle: u32, error: Option<Error>) {
        let Some(s) = self.sessions.get_mut(&channel) else {
            return;
        };
        if let Some(link) = s.links.get_mut(&handle)
            && !link.detached
        {
            link.detached = true;
            link.partial = None;
            self.events.push(Event::Detached { channel, handle });
            let d = Detach {
                handle,
                closed: true,
                error,
            };
            self.send(now, channel, &Performative::Detach(d), &[]);
        }
    }

    fn on_session_frame(&mut self, now: u64, channel: u16, p: Performative, payload: Bytes) {
        match p {
            Performative::Attach(a) => self.on_attach(now, channel, *a),
            Performative::Detach(d) => {
                let Some(s) = self.sessions.get_mut(&channel) else {
                    return;
                };
                let Some(link) = s.links.remove(&d.handle) else {
                    self.end_session(
                        now,
                        channel,
                        Error::new(
                            condition::UNATTACHED_HANDLE,
                            "detach of an unattached handle",
                        ),
                    );
                    return;
                };
                if link.detached {
                    // The answer to our detach: the handle is free again.
                    return;
                }
                self.events.push(Event::Detached {
                    channel,
                    handle: d.handle,
                });
                let reply = Detach {
                    handle: d.handle,
                    closed: d.closed,
                    error: None,
                };
                self.send(now, channel, &Performative::Detach(reply), &[]);
            }
            Performative::Flow(f) => self.on_flow(now, channel, f),
            Performative::Transfer(t) => self.on_transfer(now, channel, t, payload),
            // The peer's dispositions are about our deliveries when it is a receiver.
            Performative::Disposition(d) if d.role == Role::Receiver => {
                self.events.push(Event::Disposition {
                    channel,
                    first: d.first,
                    last: d.last.unwrap_or(d.first),
                    settled: d.settled,
                    state: d.state,
                });
            }
            _ => {}
        }
    }

    fn on_attach(&mut self, now: u64, channel: u16, a: Attach) {
        let handle_max = self.config.handle_max;
        let Some(s) = self.sessions.get_mut(&channel) else {
            return;
        };
        if a.handle > handle_max {
            self.end_session(
                now,
                channel,
                Error::new(
                    condition::RESOURCE_LIMIT_EXCEEDED,
                    "handle beyond handle-max",
                ),
            );
            return;
        }
        if s.links.contains_key(&a.handle) {
            self.end_session(
                now,
                channel,
                Error::new(condition::HANDLE_IN_USE, "handle already attached"),
            );
            return;
        }
        s.links.insert(
            a.handle,
            Link {
                role: a.role,
                attached: false,
                credit: 0,
                delivery_count: a.initial_delivery_count.unwrap_or(0),
                partial: None,
                detached: false,
            },
        );
        self.events.push(Event::Attach {
            channel,
            handle: a.handle,
            role: a.role,
            name: a.name,
            source: a.source,
            target: a.target,
            rcv_settle_mode: a.rcv_settle_mode,
            snd_settle_mode: a.snd_settle_mode,
            properties: a.properties,
        });
    }

    /// Accepts a link the peer attached: our attach answers it (the mirror role, the same
    /// terminus), and for a link the peer sends on, `credit` is granted at once.
    #[allow(clippy::too_many_arguments)]
    pub fn accept_link(
        &mut self,
        now: u64,
        channel: u16,
        handle: u32,
        name: String,
        source: Option<Source>,
        target: Option<Target>,
        credit: u32,
    ) {
        let termini = (source, target);
        self.accept(now, channel, handle, name, termini, credit, None);
    }

    /// Accepts one half of a link pair (RabbitMQ's management node): as
    /// [`Connection::accept_link`], but settled (RabbitMQ's `snd-settle-mode` for the pair)
    /// and with the link properties echoed (`paired: true`), as RabbitMQ answers.
    #[allow(clippy::too_many_arguments)]
    pub fn accept_paired_link(
        &mut self,
        now: u64,
        channel: u16,
        handle: u32,
        name: String,
        source: Option<Source>,
        target: Option<Target>,
        credit: u32,
        properties: Option<Value>,
    ) {
        let termini = (source, target);
        self.accept(
            now,
            channel,
            handle,
            name,
            termini,
            credit,
            Some(properties),
        );
    }

    /// `paired`: `Some(properties)` for a half of a link pair.
    #[allow(clippy::too_many_arguments)]
    fn accept(
        &mut self,
        now: u64,
        channel: u16,
        handle: u32,
        name: String,
        (source, target): (Option<Source>, Option<Target>),
        credit: u32,
        paired: Option<Option<Value>>,
    ) {
        let max_message_size = self.config.max_message_size;
        let Some(s) = self.sessions.get_mut(&channel) else {
            return;
        };
        let next_incoming_id = s.next_incoming_id;
        let incoming_window = s.incoming_window;
        let next_outgoing_id = s.next_outgoing_id;
        let Some(link) = s.links.get_mut(&handle) else {
            return;
        };
        link.attached = true;
        let peer_role = link.role;
        let our_role = match peer_role {
            Role::Sender => Role::Receiver,
            Role::Receiver => Role::Sender,
        };
        if peer_role == Role::Sender {
            link.credit = credit;
        }
        let delivery_count = link.delivery_count;
        let reply = Attach {
            name,
            handle,
            role: our_role,
            snd_settle_mode: if paired.is_some() { 1 } else { 2 },
            rcv_settle_mode: 0,
            source,
            target,
            unsettled: None,
            incomplete_unsettled: false,
            initial_delivery_count: (our_role == Role::Sender).then_some(0),
            max_message_size: Some(max_message_size),
            offered_capabilities: Vec::new(),
            desired_capabilities: Vec::new(),
            properties: paired.flatten(),
        };
        self.send(now, channel, &Performative::Attach(Box::new(reply)), &[]);
        if peer_role == Role::Sender {
            let flow = Flow {
                next_incoming_id: Some(next_incoming_id),
                incoming_window,
                next_outgoing_id,
                outgoing_window: u32::MAX,
                handle: Some(handle),
                delivery_count: Some(delivery_count),
                link_credit: Some(credit),
                ..Flow::default()
            };
            self.send(now, channel, &Performative::Flow(flow), &[]);
        }
    }

    /// Refuses a link: the spec's way is an attach with a null terminus, then a detach with
    /// the error (2.6.3).
    pub fn refuse_link(&mut self, now: u64, channel: u16, handle: u32, name: String, error: Error) {
        let Some(s) = self.sessions.get_mut(&channel) else {
            return;
        };
        let Some(link) = s.links.get_mut(&handle) else {
            return;
        };
        if link.detached {
            return;
        }
        link.detached = true;
        // For a shell that had already taken the link in (a consumer whose queue was
        // being checked): it is gone.
        self.events.push(Event::Detached { channel, handle });
        let our_role = match link.role {
            Role::Sender => Role::Receiver,
            Role::Receiver => Role::Sender,
        };
        let reply = Attach {
            name,
            handle,
            role: our_role,
            snd_settle_mode: 2,
            rcv_settle_mode: 0,
            source: None,
            target: None,
            unsettled: None,
            incomplete_unsettled: false,
            initial_delivery_count: (our_role == Role::Sender).then_some(0),
            max_message_size: None,
            offered_capabilities: Vec::new(),
            desired_capabilities: Vec::new(),
            properties: None,
        };
        self.send(now, channel, &Performative::Attach(Box::new(reply)), &[]);
        let d = Detach {
            handle,
            closed: true,
            error: Some(error),
        };
        self.send(now, channel, &Performative::Detach(d), &[]);
    }

    /// Grants `credit` more on a link the peer sends on (flow control is credit).
    pub fn grant_credit(&mut self, now: u64, channel: u16, handle: u32, credit: u32) {
        let Some(s) = self.sessions.get_mut(&channel) else {
            return;
        };
        let (nii, iw, noi) = (s.next_incoming_id, s.incoming_window, s.next_outgoing_id);
        let Some(link) = s.links.get_mut(&handle) else {
            return;
        };
        link.credit = credit;
        let flow = Flow {
            next_incoming_id: Some(nii),
            incoming_window: iw,
            next_outgoing_id: noi,
            outgoing_window: u32::MAX,
            handle: Some(handle),
            delivery_count: Some(link.delivery_count),
            link_credit: Some(credit),
            ..Flow::default()
        };
        self.send(now, channel, &Performative::Flow(flow), &[]);
    }

    /// Settles the peer's deliveries `first..=last` with `state` (accepted once the core
    /// confirmed, rejected, released...).
    pub fn settle(&mut self, now: u64, channel: u16, first: u32, last: u32, state: DeliveryState) {
        if !self.sessions.contains_key(&channel) {
            return;
        }
        let d = Disposition {
            role: Role::Receiver,
            first,
            last: (last != first).then_some(last),
            settled: true,
            state: Some(state),
            batchable: false,
        };
        self.send(now, channel, &Performative::Disposition(d), &[]);
    }

    /// Sends a message on a link the peer receives on; the shell keeps to the credit it was
    /// given. Splits it over frames when it exceeds the peer's max-frame-size.
    pub fn send_message(
        &mut self,
        now: u64,
        channel: u16,
        handle: u32,
        tag: Bytes,
        settled: bool,
        payload: &[u8],
    ) -> Option<u32> {
        let max = self.remote_max_frame as usize;
        let s = self.sessions.get_mut(&channel)?;
        let id = s.next_outgoing_id;
        s.next_outgoing_id = s.next_outgoing_id.wrapping_add(1);
        s.remote_incoming_window = s.remote_incoming_window.saturating_sub(1);
        // Room for the transfer performative and frame header in each frame.
        let room = max.saturating_sub(64).max(256);
        let mut chunks = payload.chunks(room).peekable();
        let mut first = true;
        if payload.is_empty() {
            chunks = [].chunks(1).peekable();
        }
        loop {
            let chunk = chunks.next().unwrap_or(&[]);
            let more = chunks.peek().is_some();
            let t = Transfer {
                handle,
                delivery_id: first.then_some(id),
                delivery_tag: first.then(|| tag.clone()),
                message_format: first.then_some(0),
                settled: first.then_some(settled),
                more,
                ..Transfer::default()
            };
            self.send(now, channel, &Performative::Transfer(t), chunk);
            first = false;
            if !more {
                break;
            }
        }
        Some(id)
    }

    fn on_flow(&mut self, _now: u64, channel: u16, f: Flow) {
        let Some(s) = self.sessions.get_mut(&channel) else {
            return;
        };
        // The peer's incoming window, counted from the id it has seen.
        let seen = f.next_incoming_id.unwrap_or(0);
        s.remote_incoming_window = seen
            .wrapping_add(f.incoming_window)
            .wrapping_sub(s.next_outgoing_id);
        if let Some(handle) = f.handle
            && let Some(link) = s.links.get(&handle)
            && link.role == Role::Receiver
            && !link.detached
        {
            self.events.push(Event::Credit {
                channel,
                handle,
                credit: f.link_credit.unwrap_or(0),
                delivery_count: f.delivery_count,
                drain: f.drain,
            });
        }
    }

    fn on_transfer(&mut self, now: u64, channel: u16, t: Transfer, payload: Bytes) {
        let max_message_size = self.config.max_message_size;
        let Some(s) = self.sessions.get_mut(&channel) else {
            return;
        };
        if s.incoming_window == 0 {
            self.end_session(
                now,
                channel,
                Error::new(
                    condition::WINDOW_VIOLATION,
                    "transfer beyond incoming-window",
                ),
            );
            return;
        }
        s.next_incoming_id = s.next_incoming_id.wrapping_add(1);
        s.incoming_window -= 1;
        // Reopen the window early so a steady sender never stalls on it.
        let reopen = s.incoming_window < self.config.incoming_window / 2;
        let Some(link) = s.links.get_mut(&t.handle) else {
            self.end_session(
                now,
                channel,
                Error::new(
                    condition::UNATTACHED_HANDLE,
                    "transfer on an unattached handle",
                ),
            );
            return;
        };
        if link.detached {
            // Sent before the peer saw our detach.
            return;
        }
        if link.role != Role::Sender || !link.attached {
            self.end_session(
                now,
                channel,
                Error::new(
                    condition::UNATTACHED_HANDLE,
                    "transfer on a link we send on",
                ),
            );
            return;
        }
        let (id, settled, mut buf) = match link.partial.take() {
            Some(p) => p,
            None => {
                if link.credit == 0 {
                    self.detach_link(
                        now,
                        channel,
                        t.handle,
                        Some(Error::new(
                            condition::TRANSFER_LIMIT_EXCEEDED,
                            "transfer without link credit",
                        )),
                    );
                    return;
                }
                link.credit -= 1;
                link.delivery_count = link.delivery_count.wrapping_add(1);
                let Some(id) = t.delivery_id else {
                    self.end_session(
                        now,
                        channel,
                        Error::new(
                            condition::INVALID_FIELD,
                            "first transfer without delivery-id",
                        ),
                    );
                    return;
                };
                (id, t.settled.unwrap_or(false), BytesMut::new())
            }
        };
        if t.aborted {
            return;
        }
        if (buf.len() + payload.len()) as u64 > max_message_size {
            self.detach_link(
                now,
                channel,
                t.handle,
                Some(Error::new(
                    condition::MESSAGE_SIZE_EXCEEDED,
                    "message beyond max-message-size",
                )),
            );
            return;
        }
        buf.extend_from_slice(&payload);
        let settled = settled || t.settled.unwrap_or(false);
        if t.more {
            link.partial = Some((id, settled, buf));
        } else {
            self.events.push(Event::Message {
                channel,
                handle: t.handle,
                delivery_id: id,
                settled,
                payload: buf.freeze(),
            });
        }
        if reopen && let Some(s) = self.sessions.get_mut(&channel) {
            s.incoming_window = self.config.incoming_window;
            let flow = Flow {
                next_incoming_id: Some(s.next_incoming_id),
                incoming_window: s.incoming_window,
                next_outgoing_id: s.next_outgoing_id,
                outgoing_window: u32::MAX,
                ..Flow::default()
            };
            self.send(now, channel, &Performative::Flow(flow), &[]);
        }
    }
}
