//! The opening of an AMQP connection: protocol header, start/start-ok (authentication),
//! tune/tune-ok (limits), open/open-ok (vhost).

use crate::auth;
use crate::codec::{self, Frame, PROTOCOL_HEADER};
use crate::config::{AmqpConfig, FRAME_MIN_SIZE};
use crate::connection::PeerInfo;
use crate::convert::value_to_amqp;
use crate::methods::truncate;
use amq_protocol::protocol::{AMQPClass, connection};
use amq_protocol::types::{AMQPValue, FieldTable, LongString, ShortString};
use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
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

/// Why the handshake ended without a connection.
#[derive(Debug)]
pub enum Refused {
    /// The peer went away or the socket failed.
    Io(std::io::Error),
    /// We refused it (and told the peer): code and reason, for the log.
    Closed(ErrorCode, String),
}

impl From<std::io::Error> for Refused {
    fn from(e: std::io::Error) -> Refused {
        Refused::Io(e)
    }
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

async fn send<W: AsyncWrite + Unpin>(wr: &mut W, method: AMQPClass) -> std::io::Result<()> {
    let mut buf = BytesMut::new();
    codec::encode_method(&mut buf, 0, method);
    wr.write_all(&buf).await?;
    wr.flush().await
}

/// Sends connection.close and reports the refusal.
async fn refuse<W: AsyncWrite + Unpin>(
    wr: &mut W,
    code: ErrorCode,
    text: String,
    ids: (u16, u16),
) -> Refused {
    let _ = send(wr, connection_close(code.code(), &text, ids)).await;
    Refused::Closed(code, text)
}

/// Reads the next connection-level method, skipping heartbeats.
async fn next_method<R: AsyncRead + Unpin>(
    rd: &mut R,
    buf: &mut BytesMut,
    frame_max: u32,
) -> Result<Result<AMQPClass, crate::error::GatewayError>, std::io::Error> {
    loop {
        match codec::decode(buf, frame_max) {
            Ok(Some(Frame::Heartbeat(_))) => continue,
            Ok(Some(Frame::Method(0, m))) => return Ok(Ok(m)),
            Ok(Some(_)) => {
                return Ok(Err(crate::error::GatewayError::Unexpected(
                    "only connection methods are allowed during the handshake".into(),
                )));
            }
            Ok(None) => {}
            Err(e) => return Ok(Err(e)),
        }
        buf.reserve(1024);
        if rd.read_buf(buf).await? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
    }
}

/// Runs the handshake. On success the connection is open; `buf` keeps any bytes the client
/// pipelined after `connection.open`.
pub async fn run<R, W>(
    rd: &mut R,
    wr: &mut W,
    buf: &mut BytesMut,
    peer: &PeerInfo,
    config: &AmqpConfig,
    broker: &warren_runtime::BrokerHandle,
) -> Result<Negotiated, Refused>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    while buf.len() < PROTOCOL_HEADER.len() {
        buf.reserve(64);
        if rd.read_buf(buf).await? == 0 {
            return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into());
        }
    }
    if &buf[..8] != PROTOCOL_HEADER {
        // The spec's answer to an unsupported protocol: our header, then close.
        wr.write_all(PROTOCOL_HEADER).await?;
        wr.flush().await?;
        return Err(Refused::Closed(
            ErrorCode::FrameError,
            format!("unsupported protocol header {:?}", &buf[..8]),
        ));
    }
    let _ = buf.split_to(8);
    let start = match peer.identity {
        Some(_) => start_method_certified(),
        None => start_method(),
    };
    send(wr, start).await?;
    let limit = config.frame_max;

    let start_ok = match next_method(rd, buf, limit).await? {
        Ok(AMQPClass::Connection(connection::AMQPMethod::StartOk(s))) => s,
        Ok(_) => {
            return Err(refuse(
                wr,
                ErrorCode::CommandInvalid,
                "COMMAND_INVALID - expected 'connection.start_ok'".into(),
                (10, 11),
            )
            .await);
        }
        Err(e) => return Err(refuse(wr, e.code(), e.to_string(), (10, 11)).await),
    };
    let mechanism = start_ok.mechanism.as_str();
    // EXTERNAL: the user is the verified certificate's CN (the response, an authorization
    // identity, is ignored as RabbitMQ does); `password` None means no password to check.
    let external = match (mechanism, &peer.identity) {
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
        return Err(refuse(
            wr,
            ErrorCode::AccessRefused,
            format!(
                "ACCESS_REFUSED - Login was refused using authentication mechanism {}. \
                 For details see the broker logfile.",
                truncate(mechanism)
            ),
            (10, 11),
        )
        .await);
    };
    let login = check_login(broker, &credentials, certified, peer, None).await?;
    if let Err(e) = login {
        tracing::warn!(peer = %peer.addr, user = %Escaped(&credentials.user), "login refused: {}", Escaped(&e.to_string()));
        return Err(refuse(
            wr,
            ErrorCode::AccessRefused,
            format!(
                "ACCESS_REFUSED - Login was refused using authentication mechanism {mechanism}. \
                 For details see the broker logfile."
            ),
            (10, 11),
        )
        .await);
    }
    let capability = |name: &str| match start_ok.client_properties.inner().get("capabilities") {
        Some(AMQPValue::FieldTable(caps)) => {
            matches!(caps.inner().get(name), Some(AMQPValue::Boolean(true)))
        }
        _ => false,
    };
    let cancel_notify = capability("consumer_cancel_notify");
    let blocked_notify = capability("connection.blocked");

    send(wr, tune_method(config)).await?;
    let tune_ok = match next_method(rd, buf, limit).await? {
        Ok(AMQPClass::Connection(connection::AMQPMethod::TuneOk(t))) => t,
        Ok(_) => {
            return Err(refuse(
                wr,
                ErrorCode::CommandInvalid,
                "COMMAND_INVALID - expected 'connection.tune_ok'".into(),
                (10, 31),
            )
            .await);
        }
        Err(e) => return Err(refuse(wr, e.code(), e.to_string(), (10, 31)).await),
    };
    let frame_max = if tune_ok.frame_max == 0 {
        config.frame_max
    } else {
        tune_ok.frame_max
    };
    if frame_max > config.frame_max || frame_max < FRAME_MIN_SIZE {
        return Err(refuse(
            wr,
            ErrorCode::NotAllowed,
            format!(
                "NOT_ALLOWED - negotiated frame_max = {frame_max} is outside the allowed \
                 range [{FRAME_MIN_SIZE}, {}]",
                config.frame_max
            ),
            (10, 31),
        )
        .await);
    }
    let channel_max = if tune_ok.channel_max == 0 {
        config.channel_max
    } else {
        tune_ok.channel_max
    };
    if channel_max > config.channel_max {
        return Err(refuse(
            wr,
            ErrorCode::NotAllowed,
            format!(
                "NOT_ALLOWED - negotiated channel_max = {channel_max} is higher than the \
                 maximum allowed value ({})",
                config.channel_max
            ),
            (10, 31),
        )
        .await);
    }

    let open = match next_method(rd, buf, frame_max).await? {
        Ok(AMQPClass::Connection(connection::AMQPMethod::Open(o))) => o,
        Ok(_) => {
            return Err(refuse(
                wr,
                ErrorCode::CommandInvalid,
                "COMMAND_INVALID - expected 'connection.open'".into(),
                (10, 40),
            )
            .await);
        }
        Err(e) => return Err(refuse(wr, e.code(), e.to_string(), (10, 40)).await),
    };
    let vhost = open.virtual_host.to_string();
    let access = check_login(broker, &credentials, certified, peer, Some(&vhost)).await?;
    if let Err(e) = access {
        tracing::warn!(peer = %peer.addr, user = %Escaped(&credentials.user), "connection.open refused: {}", Escaped(&e.to_string()));
        return Err(refuse(
            wr,
            ErrorCode::NotAllowed,
            format!("NOT_ALLOWED - {}", truncate(&e.to_string())),
            (10, 40),
        )
        .await);
    }
    send(
        wr,
        AMQPClass::Connection(connection::AMQPMethod::OpenOk(connection::OpenOk {})),
    )
    .await?;
    Ok(Negotiated {
        frame_max,
        channel_max,
        heartbeat_secs: tune_ok.heartbeat,
        vhost,
        user: credentials.user,
        cancel_notify,
        blocked_notify,
        client_properties: crate::convert::table_from_amqp(&start_ok.client_properties),
    })
}

/// Checks the user (by password, or as certified by TLS) and, given a vhost, its access there.
async fn check_login(
    broker: &warren_runtime::BrokerHandle,
    credentials: &auth::Credentials,
    certified: bool,
    peer: &PeerInfo,
    vhost: Option<&str>,
) -> Result<Result<warren_runtime::Login, warren_runtime::LoginError>, std::io::Error> {
    let answer = if certified {
        broker
            .authenticate_certified(&credentials.user, peer.is_loopback, vhost)
            .await
    } else {
        broker
            .authenticate(
                &credentials.user,
                &credentials.password,
                peer.is_loopback,
                vhost,
            )
            .await
    };
    answer.map_err(|_| std::io::Error::other("broker stopped"))
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
