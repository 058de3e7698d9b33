//! The opening of an AMQP connection, sans-IO: protocol header, start/start-ok
//! (authentication), tune/tune-ok (limits), open/open-ok (vhost). Bytes in, frames out, and
//! two login checks asked of whoever drives it (the broker's user database is behind an
//! async call the shell makes).

use crate::auth;
use crate::codec::{self, Frame, PROTOCOL_HEADER};
use crate::config::{AmqpConfig, FRAME_MIN_SIZE};
use crate::convert::value_to_amqp;
use crate::error::GatewayError;
use crate::methods::truncate;
use amq_protocol::protocol::{AMQPClass, connection};
use amq_protocol::types::{AMQPValue, FieldTable, LongString, ShortString};
use bytes::BytesMut;
use std::sync::Arc;
use warren_core::error::ErrorCode;
use warren_core::escape::Escaped;
use warren_core::message::FieldValue;

/// What the handshake settled.
#[derive(Debug)]
pub struct Negotiated {
    pub frame_max: u32,
    pub channel_max: u16,
    pub heartbeat_secs: u16,
    pub vhost: String,
    pub user: String,
    pub cancel_notify: bool,
    /// The client understands `connection.blocked` / `unblocked`.
    pub blocked_notify: bool,
    /// start-ok's client properties, for operators' listings.
    pub client_properties: warren_core::message::FieldTable,
}

/// A login check the driver must make and answer with [`Handshake::on_login`] (or
/// `Session::on_login`): the user by password, or as certified by TLS when `password` is
/// `None`; given a vhost, also the user's access there.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Login {
    pub user: String,
    pub password: Option<String>,
    pub vhost: Option<String>,
}

/// What the handshake needs or settled after some input or a login answer.
#[derive(Debug)]
pub enum Step {
    /// Waiting for more bytes.
    More,
    /// Waiting for this check's answer; input is not read meanwhile.
    Login(Login),
    /// `connection.open-ok` is written: the connection is open.
    Done(Box<Negotiated>),
    /// We refused the connection (and told the peer, if it speaks AMQP): code and reason,
    /// for the log.
    Refused(ErrorCode, String),
}

/// Where the handshake is.
enum State {
    Header,
    StartOk,
    /// start-ok's login is being checked.
    CheckingUser(Box<Client>),
    TuneOk(Box<Client>),
    Open(Box<Client>),
    /// connection.open's vhost access is being checked.
    CheckingVhost(Box<Client>, Box<Negotiated>),
    Finished,
}

/// What start-ok told us, kept to the end of the handshake.
struct Client {
    credentials: auth::Credentials,
    certified: bool,
    mechanism: String,
    cancel_notify: bool,
    blocked_notify: bool,
    client_properties: warren_core::message::FieldTable,
    frame_max: u32,
    channel_max: u16,
    heartbeat_secs: u16,
}

fn server_properties() -> FieldTable {
    let mut caps = FieldTable::default();
    for cap in [
        "publisher_confirms",
        "exchange_exchange_bindings",
        "basic.nack",
        "consumer_cancel_notify",
        "authentication_failure_close",
        "per_consumer_qos",
        "connection.blocked",
        "consumer_priorities",
        "direct_reply_to",
    ] {
        caps.insert(ShortString::from(cap), AMQPValue::Boolean(true));
    }
    let mut props = FieldTable::default();
    let text = |s: &str| value_to_amqp(&FieldValue::string(s));
    props.insert("capabilities".into(), AMQPValue::FieldTable(caps));
    props.insert("product".into(), text("Warren"));
    props.insert("version".into(), text(env!("CARGO_PKG_VERSION")));
    props.insert("platform".into(), text("Rust"));
    props.insert("copyright".into(), text("The Warren authors"));
    props.insert(
        "information".into(),
        text("A message broker speaking AMQP 0.9.1 and MQTT; see the README"),
    );
    props.insert("cluster_name".into(), text("warren"));
    props
}

/// `connection.start` as the server sends it.
pub fn start_method() -> AMQPClass {
    start_offering("PLAIN AMQPLAIN")
}

/// `connection.start` to a client whose TLS certificate was verified: EXTERNAL (log in as
/// the certificate's subject CN, rabbitmq_auth_mechanism_ssl) first, so that clients
/// configured for it find it.
pub fn start_method_certified() -> AMQPClass {
    start_offering("EXTERNAL PLAIN AMQPLAIN")
}

fn start_offering(mechanisms: &str) -> AMQPClass {
    AMQPClass::Connection(connection::AMQPMethod::Start(connection::Start {
        version_major: 0,
        version_minor: 9,
        server_properties: server_properties(),
        mechanisms: LongString::from(mechanisms),
        locales: LongString::from("en_US"),
    }))
}

pub fn tune_method(config: &AmqpConfig) -> AMQPClass {
    AMQPClass::Connection(connection::AMQPMethod::Tune(connection::Tune {
        channel_max: config.channel_max,
        frame_max: config.frame_max,
        heartbeat: config.heartbeat_secs,
    }))
}

pub fn connection_close(code: u16, text: &str, ids: (u16, u16)) -> AMQPClass {
    AMQPClass::Connection(connection::AMQPMethod::Close(connection::Close {
        reply_code: code,
        reply_text: ShortString::from(truncate(text)),
        class_id: ids.0,
        method_id: ids.1,
    }))
}

pub fn connection_close_ok() -> AMQPClass {
    AMQPClass::Connection(connection::AMQPMethod::CloseOk(connection::CloseOk {}))
}

/// The server side of the handshake.
pub struct Handshake {
    config: Arc<AmqpConfig>,
    /// The subject CN of a verified TLS client certificate: EXTERNAL is offered.
    identity: Option<String>,
    /// For log lines.
    peer: Arc<str>,
    state: State,
}

impl Handshake {
    pub fn new(config: Arc<AmqpConfig>, identity: Option<String>, peer: Arc<str>) -> Handshake {
        Handshake {
            config,
            identity,
            peer,
            state: State::Header,
        }
    }

    /// The largest frame accepted in the current state.
    fn frame_max(&self) -> u32 {
        match &self.state {
            State::Open(c) | State::CheckingVhost(c, _) => c.frame_max,
            _ => self.config.frame_max,
        }
    }

    /// Consumes what it can of `input`, writing frames to `out`. Returns at the first step
    /// that is not `More`; bytes behind connection.open stay in `input`.
    pub fn handle_input(&mut self, input: &mut BytesMut, out: &mut BytesMut) -> Step {
        loop {
            if matches!(self.state, State::Header) {
                let Some(header) = input.get(..PROTOCOL_HEADER.len()) else {
                    return Step::More;
                };
                if header != PROTOCOL_HEADER {
                    // The spec's answer to an unsupported protocol: our header, then close.
                    out.extend_from_slice(PROTOCOL_HEADER);
                    self.state = State::Finished;
                    return Step::Refused(
                        ErrorCode::FrameError,
                        format!("unsupported protocol header {header:?}"),
                    );
                }
                let _ = input.split_to(PROTOCOL_HEADER.len());
                let start = match self.identity {
                    Some(_) => start_method_certified(),
                    None => start_method(),
                };
                codec::encode_method(out, 0, start);
                self.state = State::StartOk;
                continue;
            }
            let ids = match self.state {
                State::StartOk => (10, 11),
                State::TuneOk(_) => (10, 31),
                State::Open(_) => (10, 40),
                // Waiting for a login answer, or done: input waits.
                _ => return Step::More,
            };
            let method = match codec::decode(input, self.frame_max()) {
                Ok(Some(Frame::Heartbeat(_))) => continue,
                Ok(Some(Frame::Method(0, m))) => m,
                Ok(Some(_)) => {
                    let e = GatewayError::Unexpected(
                        "only connection methods are allowed during the handshake".into(),
                    );
                    return self.refuse(out, e.code(), e.to_string(), ids);
                }
                Ok(None) => return Step::More,
                Err(e) => return self.refuse(out, e.code(), e.to_string(), ids),
            };
            let step = match std::mem::replace(&mut self.state, State::Finished) {
                State::StartOk => self.on_start_ok(method, out),
                State::TuneOk(client) => self.on_tune_ok(*client, method, out),
                State::Open(client) => self.on_open(*client, method, out),
                _ => Step::More,
            };
            if !matches!(step, Step::More) {
                return step;
            }
        }
    }

    fn on_start_ok(&mut self, method: AMQPClass, out: &mut BytesMut) -> Step {
        let AMQPClass::Connection(connection::AMQPMethod::StartOk(start_ok)) = method else {
            return self.refuse(
                out,
                ErrorCode::CommandInvalid,
                "COMMAND_INVALID - expected 'connection.start_ok'".into(),
                (10, 11),
            );
        };
        let mechanism = start_ok.mechanism.as_str();
        // EXTERNAL: the user is the verified certificate's CN (the response, an authorization
        // identity, is ignored as RabbitMQ does).
        let external = match (mechanism, &self.identity) {
            ("EXTERNAL", Some(identity)) => Some(auth::Credentials {
                user: identity.clone(),
                password: String::new(),
            }),
            _ => None,
        };
        let certified = external.is_some();
        let Some(credentials) =
            external.or_else(|| auth::parse_response(mechanism, start_ok.response.as_bytes()))
        else {
            return self.refuse(
                out,
                ErrorCode::AccessRefused,
                format!(
                    "ACCESS_REFUSED - Login was refused using authentication mechanism {}. \
                     For details see the broker logfile.",
                    truncate(mechanism)
                ),
                (10, 11),
            );
        };
        let capability = |name: &str| match start_ok.client_properties.inner().get("capabilities") {
            Some(AMQPValue::FieldTable(caps)) => {
                matches!(caps.inner().get(name), Some(AMQPValue::Boolean(true)))
            }
            _ => false,
        };
        let client = Client {
            certified,
            mechanism: mechanism.to_string(),
            cancel_notify: capability("consumer_cancel_notify"),
            blocked_notify: capability("connection.blocked"),
            client_properties: crate::convert::table_from_amqp(&start_ok.client_properties),
            frame_max: 0,
            channel_max: 0,
            heartbeat_secs: 0,
            credentials,
        };
        let login = client.login(None);
        self.state = State::CheckingUser(Box::new(client));
        Step::Login(login)
    }

    fn on_tune_ok(&mut self, mut client: Client, method: AMQPClass, out: &mut BytesMut) -> Step {
        let AMQPClass::Connection(connection::AMQPMethod::TuneOk(tune_ok)) = method else {
            return self.refuse(
                out,
                ErrorCode::CommandInvalid,
                "COMMAND_INVALID - expected 'connection.tune_ok'".into(),
                (10, 31),
            );
        };
        let config = &self.config;
        let frame_max = if tune_ok.frame_max == 0 {
            config.frame_max
        } else {
            tune_ok.frame_max
        };
        if frame_max > config.frame_max || frame_max < FRAME_MIN_SIZE {
            let text = format!(
                "NOT_ALLOWED - negotiated frame_max = {frame_max} is outside the allowed \
                 range [{FRAME_MIN_SIZE}, {}]",
                config.frame_max
            );
            return self.refuse(out, ErrorCode::NotAllowed, text, (10, 31));
        }
        let channel_max = if tune_ok.channel_max == 0 {
            config.channel_max
        } else {
            tune_ok.channel_max
        };
        if channel_max > config.channel_max {
            let text = format!(
                "NOT_ALLOWED - negotiated channel_max = {channel_max} is higher than the \
                 maximum allowed value ({})",
                config.channel_max
            );
            return self.refuse(out, ErrorCode::NotAllowed, text, (10, 31));
        }
        client.frame_max = frame_max;
        client.channel_max = channel_max;
        client.heartbeat_secs = tune_ok.heartbeat;
        self.state = State::Open(Box::new(client));
        Step::More
    }

    fn on_open(&mut self, mut client: Client, method: AMQPClass, out: &mut BytesMut) -> Step {
        let AMQPClass::Connection(connection::AMQPMethod::Open(open)) = method else {
            return self.refuse(
                out,
                ErrorCode::CommandInvalid,
                "COMMAND_INVALID - expected 'connection.open'".into(),
                (10, 40),
            );
        };
        let vhost = open.virtual_host.to_string();
        let login = client.login(Some(vhost.clone()));
        let negotiated = Negotiated {
            frame_max: client.frame_max,
            channel_max: client.channel_max,
            heartbeat_secs: client.heartbeat_secs,
            vhost,
            user: client.credentials.user.clone(),
            cancel_notify: client.cancel_notify,
            blocked_notify: client.blocked_notify,
            client_properties: std::mem::take(&mut client.client_properties),
        };
        self.state = State::CheckingVhost(Box::new(client), Box::new(negotiated));
        Step::Login(login)
    }

    /// The answer to the last [`Step::Login`]: `Err` carries why the broker refused it.
    pub fn on_login(&mut self, answer: Result<(), String>, out: &mut BytesMut) -> Step {
        match (std::mem::replace(&mut self.state, State::Finished), answer) {
            (State::CheckingUser(client), Ok(())) => {
                codec::encode_method(out, 0, tune_method(&self.config));
                self.state = State::TuneOk(client);
                Step::More
            }
            (State::CheckingUser(client), Err(e)) => {
                tracing::warn!(peer = %self.peer, user = %Escaped(&client.credentials.user), "login refused: {}", Escaped(&e));
                let text = format!(
                    "ACCESS_REFUSED - Login was refused using authentication mechanism {}. \
                     For details see the broker logfile.",
                    client.mechanism
                );
                self.refuse(out, ErrorCode::AccessRefused, text, (10, 11))
            }
            (State::CheckingVhost(_, negotiated), Ok(())) => {
                codec::encode_method(
                    out,
                    0,
                    AMQPClass::Connection(connection::AMQPMethod::OpenOk(connection::OpenOk {})),
                );
                Step::Done(negotiated)
            }
            (State::CheckingVhost(client, _), Err(e)) => {
                tracing::warn!(peer = %self.peer, user = %Escaped(&client.credentials.user), "connection.open refused: {}", Escaped(&e));
                let text = format!("NOT_ALLOWED - {}", truncate(&e));
                self.refuse(out, ErrorCode::NotAllowed, text, (10, 40))
            }
            (state, _) => {
                // No check was asked for: nothing to resume.
                self.state = state;
                Step::More
            }
        }
    }

    /// Writes connection.close and reports the refusal; the handshake is over.
    fn refuse(
        &mut self,
        out: &mut BytesMut,
        code: ErrorCode,
        text: String,
        ids: (u16, u16),
    ) -> Step {
        codec::encode_method(out, 0, connection_close(code.code(), &text, ids));
        self.state = State::Finished;
        Step::Refused(code, text)
    }
}

impl Client {
    fn login(&self, vhost: Option<String>) -> Login {
        Login {
            user: self.credentials.user.clone(),
            password: (!self.certified).then(|| self.credentials.password.clone()),
            vhost,
        }
    }
}

/// `connection.blocked`, sent while the broker's memory alarm is on.
pub fn connection_blocked() -> AMQPClass {
    AMQPClass::Connection(connection::AMQPMethod::Blocked(connection::Blocked {
        reason: ShortString::from("low on memory"),
    }))
}

pub fn connection_unblocked() -> AMQPClass {
    AMQPClass::Connection(connection::AMQPMethod::Unblocked(connection::Unblocked {}))
}
