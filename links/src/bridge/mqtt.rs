//! One bridge session over rumqttc: the remote broker (MQTT 3.1.1 or 5) and the local one
//! (always MQTT 5, through this broker's own MQTT listener on loopback, as a shovel's local
//! end goes through the AMQP listener), both with manual acknowledgements; the link
//! ([`super::link::Link`]) decides, this moves bytes. A new session makes new clients: what
//! an old one left unacknowledged is sent again by its source (a persistent session).
//!
//! Each event loop is polled by a task of its own (a poll is never cancelled: one dropped
//! mid-write would lose a packet) and hands its events to the session's task over a bounded
//! channel; every request to a client is a `try_*` on a channel sized for the link's bound
//! ([`MAX_IN_FLIGHT`]), so a full channel is a broken bound, an error, never a wait that
//! could block the other side's acknowledgements.

use super::config::{Address, BridgeConfig, MQTT_MAX_PACKET, Protocol};
use super::link::{Link, LinkError, MAX_IN_FLIGHT, RECEIVE_MAXIMUM, Side, Verdict, subscriptions};
use super::status::Counters;
use bytes::Bytes;
use rumqttc::v5::mqttbytes::QoS as Q5;
use rumqttc::v5::mqttbytes::v5 as p5;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// Requests a client's channel holds at most (publishes and acknowledgements of both
/// directions, notifications).
const CHANNEL: usize = 4 * MAX_IN_FLIGHT + 64;

/// How often a bridge on a secondary address checks whether the primary is back
/// (`round_robin` false; Mosquitto's 5 s).
const PRIMARY_PROBE: Duration = Duration::from_secs(5);

/// How long a connect (TCP and CONNACK) may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// How a session ended without a failure.
#[derive(Debug, PartialEq, Eq)]
pub enum Ended {
    /// The bridge was stopped (shutdown).
    Stopped,
}

/// Why a session ended.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error(
        "no local MQTT listener to connect to (the bridge's local end is this broker's first plain MQTT listener; --mqtt none turns it off)"
    )]
    NoLocalListener,
    #[error("{side} broker {addr}: {error}")]
    Connection {
        side: &'static str,
        addr: String,
        error: String,
    },
    #[error("{side} broker refused the subscription to {filter:?}")]
    Subscribe { side: &'static str, filter: String },
    #[error("{side} broker refused a publish (PUBACK {reason})")]
    Refused { side: &'static str, reason: String },
    #[error("{0}")]
    Link(#[from] LinkError),
    #[error("the {0} client took no more requests: {1}")]
    Request(&'static str, String),
    #[error("the primary address {0} is reachable again")]
    PrimaryBack(String),
}

fn name(s: Side) -> &'static str {
    match s {
        Side::Local => "local",
        Side::Remote => "remote",
    }
}

/// What a client reported, whatever its version.
enum Ev {
    /// With the largest packet the broker takes, if it said (MQTT 5).
    ConnAck(Option<u32>),
    Publish {
        topic: String,
        qos: u8,
        retain: bool,
        pkid: u16,
        payload: Bytes,
        props: Option<p5::PublishProperties>,
    },
    /// The client wrote a publish with this packet id.
    Numbered(u16),
    PubAck {
        pkid: u16,
        failure: Option<Refusal>,
    },
    SubAck(Vec<bool>),
    Disconnect,
    Other,
}

/// A PUBACK's failure reason (MQTT 5).
enum Refusal {
    Permanent(String),
    Transient(String),
}

enum Client {
    V4(rumqttc::AsyncClient),
    V5(rumqttc::v5::AsyncClient),
}

enum Loop {
    V4(Box<rumqttc::EventLoop>),
    V5(Box<rumqttc::v5::EventLoop>),
}

fn q4(qos: u8) -> rumqttc::QoS {
    if qos == 0 {
        rumqttc::QoS::AtMostOnce
    } else {
        rumqttc::QoS::AtLeastOnce
    }
}

fn q5(qos: u8) -> Q5 {
    if qos == 0 {
        Q5::AtMostOnce
    } else {
        Q5::AtLeastOnce
    }
}

fn qos_of4(q: rumqttc::QoS) -> u8 {
    match q {
        rumqttc::QoS::AtMostOnce => 0,
        _ => 1,
    }
}

fn qos_of5(q: Q5) -> u8 {
    match q {
        Q5::AtMostOnce => 0,
        _ => 1,
    }
}

impl Loop {
    async fn next(&mut self) -> Result<Ev, String> {
        match self {
            Loop::V4(l) => {
                use rumqttc::{Event, Outgoing, Packet};
                Ok(match l.poll().await.map_err(|e| e.to_string())? {
                    Event::Incoming(Packet::ConnAck(_)) => Ev::ConnAck(None),
                    Event::Incoming(Packet::Publish(p)) => Ev::Publish {
                        topic: p.topic,
                        qos: qos_of4(p.qos),
                        retain: p.retain,
                        pkid: p.pkid,
                        payload: p.payload,
                        props: None,
                    },
                    Event::Incoming(Packet::PubAck(a)) => Ev::PubAck {
                        pkid: a.pkid,
                        failure: None,
                    },
                    Event::Incoming(Packet::SubAck(s)) => Ev::SubAck(
                        s.return_codes
                            .iter()
                            .map(|c| !matches!(c, rumqttc::SubscribeReasonCode::Failure))
                            .collect(),
                    ),
                    Event::Incoming(Packet::Disconnect) => Ev::Disconnect,
                    Event::Outgoing(Outgoing::Publish(pkid)) => Ev::Numbered(pkid),
                    _ => Ev::Other,
                })
            }
            Loop::V5(l) => {
                use rumqttc::Outgoing;
                use rumqttc::v5::{Event, mqttbytes::v5::Packet};
                Ok(match l.poll().await.map_err(|e| e.to_string())? {
                    Event::Incoming(Packet::ConnAck(c)) => {
                        Ev::ConnAck(c.properties.and_then(|p| p.max_packet_size))
                    }
                    Event::Incoming(Packet::Publish(p)) => Ev::Publish {
                        topic: String::from_utf8_lossy(&p.topic).into_owned(),
                        qos: qos_of5(p.qos),
                        retain: p.retain,
                        pkid: p.pkid,
                        payload: p.payload,
                        props: p.properties,
                    },
                    Event::Incoming(Packet::PubAck(a)) => Ev::PubAck {
                        pkid: a.pkid,
                        failure: match a.reason {
                            p5::PubAckReason::Success | p5::PubAckReason::NoMatchingSubscribers => {
                                None
                            }
                            // What the broker will refuse again: the copy is dropped.
                            r @ (p5::PubAckReason::NotAuthorized
                            | p5::PubAckReason::TopicNameInvalid
                            | p5::PubAckReason::PayloadFormatInvalid) => {
                                Some(Refusal::Permanent(format!("{r:?}")))
                            }
                            // Perhaps not next time (quota, an error): the session ends and
                            // the source sends it again.
                            other => Some(Refusal::Transient(format!("{other:?}"))),
                        },
                    },
                    Event::Incoming(Packet::SubAck(s)) => Ev::SubAck(
                        s.return_codes
                            .iter()
                            .map(|c| matches!(c, p5::SubscribeReasonCode::Success(_)))
                            .collect(),
                    ),
                    Event::Incoming(Packet::Disconnect(_)) => Ev::Disconnect,
                    Event::Outgoing(Outgoing::Publish(pkid)) => Ev::Numbered(pkid),
                    _ => Ev::Other,
                })
            }
        }
    }
}

impl Client {
    fn publish(
        &self,
        topic: String,
        qos: u8,
        retain: bool,
        payload: Bytes,
        props: Option<p5::PublishProperties>,
    ) -> Result<(), String> {
        match self {
            Client::V4(c) => c
                .try_publish(topic, q4(qos), retain, Vec::from(payload))
                .map_err(|e| e.to_string()),
            Client::V5(c) => match props {
                Some(p) => c.try_publish_with_properties(topic, q5(qos), retain, payload, p),
                None => c.try_publish(topic, q5(qos), retain, payload),
            }
            .map_err(|e| e.to_string()),
        }
    }

    fn ack(&self, pkid: u16) -> Result<(), String> {
        match self {
            Client::V4(c) => {
                let mut p = rumqttc::Publish::new("", rumqttc::QoS::AtLeastOnce, Vec::new());
                p.pkid = pkid;
                c.try_ack(&p).map_err(|e| e.to_string())
            }
            Client::V5(c) => {
                let mut p = p5::Publish::new("", Q5::AtLeastOnce, Vec::new(), None);
                p.pkid = pkid;
                c.try_ack(&p).map_err(|e| e.to_string())
            }
        }
    }

    fn subscribe(&self, filters: &[(String, u8)]) -> Result<(), String> {
        match self {
            Client::V4(c) => c
                .try_subscribe_many(
                    filters
                        .iter()
                        .map(|(f, q)| rumqttc::SubscribeFilter::new(f.clone(), q4(*q))),
                )
                .map_err(|e| e.to_string()),
            Client::V5(c) => c
                .try_subscribe_many(filters.iter().map(|(f, q)| p5::Filter {
                    path: f.clone(),
                    qos: q5(*q),
                    // Loop prevention: what the bridge publishes on a side does not come
                    // back to it there.
                    nolocal: true,
                    // Retain as published: a retained message stays retained across.
                    preserve_retain: true,
                    retain_forward_rule: p5::RetainForwardRule::OnEverySubscribe,
                }))
                .map_err(|e| e.to_string()),
        }
    }
}

/// One end's connection settings.
struct End<'a> {
    protocol: Protocol,
    client_id: String,
    host: String,
    port: u16,
    clean: bool,
    login: Option<(&'a str, &'a str)>,
    keepalive: Duration,
    will: Option<String>,
    tls: Option<Arc<rustls::ClientConfig>>,
}

fn open(end: End<'_>) -> (Client, Loop) {
    const MAX: usize = MQTT_MAX_PACKET as usize;
    match end.protocol {
        Protocol::V311 => {
            let mut o = rumqttc::MqttOptions::new(end.client_id, end.host, end.port);
            o.set_keep_alive(end.keepalive)
                .set_clean_session(end.clean)
                .set_manual_acks(true)
                .set_inflight(RECEIVE_MAXIMUM)
                .set_request_channel_capacity(CHANNEL)
                // Any size in; the link drops a copy too large for a side before it is
                // sent (`bridge_max_packet_size`, Mosquitto's rule).
                .set_max_packet_size(MAX, MAX);
            if let Some((u, p)) = end.login {
                o.set_credentials(u, p);
            }
            if let Some(t) = end.will {
                o.set_last_will(rumqttc::LastWill::new(
                    t,
                    "0",
                    rumqttc::QoS::AtLeastOnce,
                    true,
                ));
            }
            if let Some(c) = end.tls {
                o.set_transport(rumqttc::Transport::tls_with_config(
                    rumqttc::TlsConfiguration::Rustls(c),
                ));
            }
            let (c, l) = rumqttc::AsyncClient::new(o, CHANNEL);
            (Client::V4(c), Loop::V4(Box::new(l)))
        }
        Protocol::V5 => {
            let mut o = rumqttc::v5::MqttOptions::new(end.client_id, end.host, end.port);
            o.set_keep_alive(end.keepalive)
                .set_clean_start(end.clean)
                .set_manual_acks(true)
                .set_receive_maximum(Some(RECEIVE_MAXIMUM))
                .set_outgoing_inflight_upper_limit(RECEIVE_MAXIMUM)
                .set_request_channel_capacity(CHANNEL)
                .set_max_packet_size(Some(MQTT_MAX_PACKET));
            if !end.clean {
                // A persistent session: kept while the bridge is away.
                o.set_session_expiry_interval(Some(u32::MAX));
            }
            if let Some((u, p)) = end.login {
                o.set_credentials(u, p);
            }
            if let Some(t) = end.will {
                o.set_last_will(p5::LastWill::new(t, "0", Q5::AtLeastOnce, true, None));
            }
            if let Some(c) = end.tls {
                o.set_transport(rumqttc::Transport::tls_with_config(
                    rumqttc::TlsConfiguration::Rustls(c),
                ));
            }
            let (c, l) = rumqttc::v5::AsyncClient::new(o, CHANNEL);
            (Client::V5(c), Loop::V5(Box::new(l)))
        }
    }
}

/// Events an event loop's task hands the link ahead of it at most.
const EVENTS: usize = 256;

/// Aborts a task when dropped (a session's event loops end with it).
struct Aborting(tokio::task::JoinHandle<()>);

impl Drop for Aborting {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Polls `l` in a task of its own until it fails, handing each event over a bounded
/// channel (a full one stops the polling: the socket pushes back).
fn drive(mut l: Loop) -> (tokio::sync::mpsc::Receiver<Result<Ev, String>>, Aborting) {
    let (tx, rx) = tokio::sync::mpsc::channel(EVENTS);
    let task = tokio::spawn(async move {
        loop {
            let ev = l.next().await;
            let failed = ev.is_err();
            if tx.send(ev).await.is_err() || failed {
                break;
            }
        }
    });
    (rx, Aborting(task))
}

/// Polls `l` until its CONNACK, bounded in time; the largest packet the broker takes, if it
/// said.
async fn connect(l: &mut Loop, side: Side, addr: &str) -> Result<Option<u32>, SessionError> {
    let failed = |error: String| SessionError::Connection {
        side: name(side),
        addr: addr.to_string(),
        error,
    };
    let wait = async {
        loop {
            match l.next().await {
                Ok(Ev::ConnAck(max)) => return Ok(max),
                Ok(_) => {}
                Err(e) => return Err(e),
            }
        }
    };
    match tokio::time::timeout(CONNECT_TIMEOUT, wait).await {
        Ok(r) => r.map_err(failed),
        Err(_) => Err(failed("no CONNACK within 10 s".into())),
    }
}

/// What a session needs to know beyond its configuration.
pub struct Ctx<'a> {
    pub cfg: &'a BridgeConfig,
    pub hostname: &'a str,
    pub local: Option<SocketAddr>,
    pub counters: &'a Counters,
    /// Called once both ends are connected and subscribed.
    pub running: &'a (dyn Fn(&Address) + Send + Sync),
    pub now_ms: fn() -> u64,
}

/// Properties forwarded to an MQTT 5 side: the message's own (no alias, no subscription
/// identifiers: those belonged to the hop it came over).
fn forwardable(props: Option<p5::PublishProperties>) -> Option<p5::PublishProperties> {
    props.map(|mut p| {
        p.topic_alias = None;
        p.subscription_identifiers.clear();
        p
    })
}

/// The size of a PUBLISH packet as the client encodes it.
fn packet_size(
    v5: bool,
    topic: &str,
    qos: u8,
    payload: &Bytes,
    props: &Option<p5::PublishProperties>,
) -> usize {
    if v5 {
        return p5::Publish::new(topic, q5(qos), payload.clone(), props.clone()).size();
    }
    let len = 2 + topic.len() + payload.len() + if qos > 0 { 2 } else { 0 };
    let varint = match len {
        0..=127 => 1,
        128..=16_383 => 2,
        16_384..=2_097_151 => 3,
        _ => 4,
    };
    1 + varint + len
}

/// Publishes the retained `0` on the local state topic by a short connection of its own
/// (client id `<local_clientid>.state`, clean): the first attempt after a start failed
/// before the local end connected, so no will said it, and the topic may still hold the
/// `1` of the process before (Mosquitto's local notification says 0 too).
pub async fn notify_down(ctx: &Ctx<'_>) -> Result<(), String> {
    let local = ctx.local.ok_or("no local MQTT listener")?;
    let cfg = ctx.cfg;
    let (client, mut l) = open(End {
        protocol: Protocol::V5,
        client_id: format!("{}.state", cfg.local_clientid(ctx.hostname)),
        host: local.ip().to_string(),
        port: local.port(),
        clean: true,
        login: cfg
            .local_username
            .as_deref()
            .map(|u| (u, cfg.local_password.as_deref().unwrap_or(""))),
        keepalive: cfg.keepalive,
        will: None,
        tls: None,
    });
    let topic = cfg.notification_topic(ctx.hostname);
    let run = async {
        connect(&mut l, Side::Local, &local.to_string())
            .await
            .map_err(|e| e.to_string())?;
        client.publish(topic, 1, true, Bytes::from_static(b"0"), None)?;
        loop {
            match l.next().await? {
                Ev::PubAck { .. } => return Ok::<(), String>(()),
                _ => continue,
            }
        }
    };
    tokio::time::timeout(CONNECT_TIMEOUT, run)
        .await
        .map_err(|_| "no PUBACK within 10 s".to_string())?
}

/// Runs one session to `addr` (`index` in the list) until it fails or `stop` turns true.
pub async fn session(
    ctx: &Ctx<'_>,
    addr: &Address,
    index: usize,
    stop: &mut watch::Receiver<bool>,
) -> Result<Ended, SessionError> {
    let cfg = ctx.cfg;
    let local = ctx.local.ok_or(SessionError::NoLocalListener)?;
    let topic = cfg.notification_topic(ctx.hostname);
    let remote_login = cfg
        .remote_username
        .as_deref()
        .map(|u| (u, cfg.remote_password.as_deref().unwrap_or("")));
    let local_login = cfg
        .local_username
        .as_deref()
        .map(|u| (u, cfg.local_password.as_deref().unwrap_or("")));
    let (remote, mut remote_loop) = open(End {
        protocol: cfg.protocol,
        client_id: cfg.remote_clientid(ctx.hostname),
        host: addr.host.clone(),
        port: addr.port,
        clean: cfg.cleansession,
        login: remote_login,
        keepalive: cfg.keepalive,
        will: (cfg.notifications && !cfg.notifications_local_only).then(|| topic.clone()),
        tls: match &cfg.tls {
            None => None,
            Some(t) => Some(Arc::new(super::tls::client_config(t).map_err(|error| {
                SessionError::Connection {
                    side: "remote",
                    addr: addr.to_string(),
                    error,
                }
            })?)),
        },
    });
    let addr_text = addr.to_string();
    let remote_max = connect(&mut remote_loop, Side::Remote, &addr_text).await?;
    let (local_client, mut local_loop) = open(End {
        protocol: Protocol::V5,
        client_id: cfg.local_clientid(ctx.hostname),
        host: local.ip().to_string(),
        port: local.port(),
        clean: cfg.local_cleansession,
        login: local_login,
        keepalive: cfg.keepalive,
        will: cfg.notifications.then(|| topic.clone()),
        tls: None,
    });
    let local_text = local.to_string();
    let local_max = connect(&mut local_loop, Side::Local, &local_text).await?;
    // From here each event loop is polled by a task of its own and never cancelled (a poll
    // dropped while it writes would lose a packet); the link hears their events in order.
    let (mut local_events, _local_task) = drive(local_loop);
    let (mut remote_events, _remote_task) = drive(remote_loop);

    let mut link: Link<u16> = Link::new(cfg, cfg.protocol == Protocol::V311);
    for (side, max) in [(Side::Remote, remote_max), (Side::Local, local_max)] {
        if let Some(m) = max {
            link.limit(side, m);
        }
    }
    let clients = [local_client, remote];
    let client = |s: Side| match s {
        Side::Local => &clients[0],
        Side::Remote => &clients[1],
    };
    let full = |s: Side| move |e| SessionError::Request(name(s), e);
    let mut pending_subs: Vec<(Side, Vec<String>)> = Vec::new();
    for side in [Side::Local, Side::Remote] {
        let subs = subscriptions(&cfg.topics, side);
        if !subs.is_empty() {
            client(side).subscribe(&subs).map_err(full(side))?;
            pending_subs.push((side, subs.into_iter().map(|(f, _)| f).collect()));
        }
    }
    if cfg.notifications {
        let sides: &[Side] = if cfg.notifications_local_only {
            &[Side::Local]
        } else {
            &[Side::Local, Side::Remote]
        };
        for &side in sides {
            client(side)
                .publish(topic.clone(), 1, true, Bytes::from_static(b"1"), None)
                .map_err(full(side))?;
            link.sent(side, None, true);
        }
    }
    if pending_subs.is_empty() {
        (ctx.running)(addr);
    }
    // On a secondary (round_robin false): a task checks the primary every 5 s and says
    // when it accepts connections. (The session keeps a sender: without a probe, `recv`
    // waits forever.)
    let (back_tx, mut primary_back) = tokio::sync::mpsc::channel::<String>(1);
    let _probe = (!cfg.round_robin && index != 0).then(|| {
        let p = cfg.addresses[0].clone();
        let back_tx = back_tx.clone();
        Aborting(tokio::spawn(async move {
            loop {
                tokio::time::sleep(PRIMARY_PROBE).await;
                let reach = tokio::time::timeout(
                    CONNECT_TIMEOUT,
                    tokio::net::TcpStream::connect((p.host.as_str(), p.port)),
                )
                .await;
                if matches!(reach, Ok(Ok(_))) {
                    let _ = back_tx.send(p.to_string()).await;
                    break;
                }
            }
        }))
    });
    let mut refused_logged = false;
    let subscribed_by = tokio::time::Instant::now() + CONNECT_TIMEOUT;
    loop {
        let (side, ev) = tokio::select! {
            _ = stop.changed() => return Ok(Ended::Stopped),
            ev = local_events.recv() => (Side::Local, ev.unwrap_or_else(|| Err("event loop ended".into()))),
            ev = remote_events.recv() => (Side::Remote, ev.unwrap_or_else(|| Err("event loop ended".into()))),
            _ = tokio::time::sleep_until(subscribed_by), if !pending_subs.is_empty() => {
                let (side, filters) = &pending_subs[0];
                return Err(SessionError::Connection {
                    side: name(*side),
                    addr: match side {
                        Side::Local => local_text.clone(),
                        Side::Remote => addr_text.clone(),
                    },
                    error: format!("no SUBACK for {filters:?} within 10 s"),
                });
            }
            Some(p) = primary_back.recv() => return Err(SessionError::PrimaryBack(p)),
        };
        if *stop.borrow() {
            return Ok(Ended::Stopped);
        }
        let ev = ev.map_err(|error| SessionError::Connection {
            side: name(side),
            addr: match side {
                Side::Local => local_text.clone(),
                Side::Remote => addr_text.clone(),
            },
            error,
        })?;
        match ev {
            Ev::Publish {
                topic,
                qos,
                retain,
                pkid,
                payload,
                props,
            } => {
                let to = side.other();
                let v5 = to == Side::Local || cfg.protocol == Protocol::V5;
                let props = if v5 { forwardable(props) } else { None };
                let size = |t: &str, q: u8| packet_size(v5, t, q, &payload, &props);
                let now = (ctx.now_ms)();
                match link.arrived_sized(side, &topic, qos, &payload, now, size)? {
                    Verdict::Forward { topic, qos: fq } => {
                        client(to)
                            .publish(topic, fq, retain, payload, props)
                            .map_err(full(to))?;
                        link.sent(to, (qos > 0 && fq > 0).then_some(pkid), false);
                        if qos > 0 && fq == 0 {
                            client(side).ack(pkid).map_err(full(side))?;
                        }
                    }
                    Verdict::Drop(_) => {
                        ctx.counters.dropped(side);
                        if qos > 0 {
                            client(side).ack(pkid).map_err(full(side))?;
                        }
                    }
                }
            }
            Ev::Numbered(pkid) => {
                if link.numbered(side, pkid)? {
                    ctx.counters.moved(side.other());
                }
            }
            Ev::PubAck { pkid, failure } => {
                if let Some(Refusal::Transient(reason)) = failure {
                    return Err(SessionError::Refused {
                        side: name(side),
                        reason,
                    });
                }
                let ack = link.acked(side, pkid)?;
                if let Some(Refusal::Permanent(reason)) = failure {
                    // Dropped (acknowledged to its source): sending it again would be
                    // refused again and hold up everything behind it.
                    let what = if ack.is_some() {
                        "a copy"
                    } else {
                        "the bridge's state notification"
                    };
                    if !refused_logged {
                        refused_logged = true;
                        tracing::warn!(
                            bridge = %warren_core::escape::Escaped(&cfg.name),
                            "the {} broker refused {what} ({reason}); refused copies are \
                             dropped (warren_bridge_messages_dropped_total), logged once per \
                             session",
                            name(side)
                        );
                    }
                    if let Some(ack) = ack {
                        ctx.counters.dropped(side.other());
                        client(side.other()).ack(ack).map_err(full(side.other()))?;
                    }
                } else if let Some(ack) = ack {
                    client(side.other()).ack(ack).map_err(full(side.other()))?;
                    ctx.counters.moved(side.other());
                }
            }
            Ev::SubAck(oks) => {
                let Some(i) = pending_subs.iter().position(|(s, _)| *s == side) else {
                    continue;
                };
                let (_, filters) = pending_subs.remove(i);
                if let Some(bad) = oks.iter().position(|ok| !ok) {
                    return Err(SessionError::Subscribe {
                        side: name(side),
                        filter: filters.get(bad).cloned().unwrap_or_default(),
                    });
                }
                if pending_subs.is_empty() {
                    (ctx.running)(addr);
                }
            }
            Ev::Disconnect => {
                return Err(SessionError::Connection {
                    side: name(side),
                    addr: match side {
                        Side::Local => local_text.clone(),
                        Side::Remote => addr_text.clone(),
                    },
                    error: "the broker sent DISCONNECT".into(),
                });
            }
            Ev::ConnAck(_) | Ev::Other => {}
        }
    }
}
