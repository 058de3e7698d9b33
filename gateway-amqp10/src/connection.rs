//! One AMQP 1.0 connection: the tokio shell around [`Connection`], and the bridge from
//! links to the core's channels. Each attached link is one core channel (the core speaks
//! 0.9.1's model): a link the client sends on publishes in confirm mode, and the confirm
//! settles the transfer with `accepted` (for a durable queue, after the store's fsync); a
//! link the client receives on is a consumer whose prefetch is its first link credit.
//!
//! Addresses are RabbitMQ 4's v2 form: targets `/queues/:queue`, `/exchanges/:exchange`,
//! `/exchanges/:exchange/:routing-key`; sources `/queues/:queue` (percent-encoded names).

use crate::address;
use crate::pairs::{self, Pairs};
use crate::performatives::{DeliveryState, Error, Role, Source, Target, condition};
use crate::sasl::Login;
use crate::session::{Config, Connection, Ended, Event};
use bytes::{Bytes, BytesMut};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::watch;
use tokio::time::{Instant, sleep_until};
use warren_core::admin::{AdminRequest, AdminResponse, QueueInfo};
use warren_core::command::{Consume, Op, Publish};
use warren_core::effect::{Effect, Reply};
use warren_core::escape::Escaped;
use warren_runtime::BrokerHandle;

/// Who is on the other end.
#[derive(Clone, Debug)]
pub struct PeerInfo {
    pub addr: String,
    pub is_loopback: bool,
    /// A verified TLS client certificate's subject: EXTERNAL is offered.
    pub identity: Option<String>,
    pub tls: bool,
}

impl PeerInfo {
    pub fn new(addr: std::net::SocketAddr, identity: Option<String>, tls: bool) -> PeerInfo {
        PeerInfo {
            addr: addr.to_string(),
            is_loopback: warren_runtime::listener::is_loopback(&addr),
            identity,
            tls,
        }
    }
}

/// What one core channel is to the 1.0 side.
struct LinkRef {
    channel: u16,
    handle: u32,
    kind: LinkKind,
    /// A consumer's attach, answered once the core has checked its queue (as RabbitMQ
    /// refuses the attach itself for a missing queue): name and termini. Until then no
    /// other op goes to its core channel (one after a failed check would be a connection
    /// error), and the client's credit waits in `early_credit`.
    unanswered: Option<(String, Option<Source>, Option<Target>)>,
    early_credit: u32,
}

enum LinkKind {
    /// Client publishes: confirm sequence -> (delivery id, settled by the client).
    Publisher {
        target: address::Target,
        next_seq: u64,
        pending: HashMap<u64, u32>,
    },
    /// Client consumes. `pending`: the consume, held until the client's first credit (the
    /// core's prefetch is at least 1, so consuming at once would send a delivery the
    /// client gave no credit for).
    ///
    /// Link credit is counted here: the core's prefetch bounds the deliveries it has out
    /// unacknowledged, not those the client allowed, so a delivery beyond the credit waits
    /// in `held` until the client gives more. `held` is bounded by the prefetch (the core
    /// counts held deliveries as unacknowledged; for a pre-settled link the shell
    /// acknowledges each one as it sends it, so the core consumes with acks then too).
    Consumer {
        settled: bool,
        pending: Option<Consume>,
        /// Transfers the client's credit still allows, and our delivery-count.
        credit: u32,
        sent: u32,
        held: VecDeque<warren_core::effect::Delivery>,
    },
}

/// Link credit given to publishers, renewed when half is used.
const PUBLISH_CREDIT: u32 = 256;
const READ_CHUNK: usize = 64 * 1024;

/// Serves one connection whose first bytes (`prefix`, the protocol header already read by
/// the listener's dispatch) may be given.
pub async fn serve_connection<S>(
    stream: S,
    prefix: BytesMut,
    peer: PeerInfo,
    broker: BrokerHandle,
    config: Arc<Config>,
    mut shutdown: watch::Receiver<bool>,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (mut rd, mut wr) = tokio::io::split(stream);
    let epoch = Instant::now();
    let now = || epoch.elapsed().as_millis() as u64;
    let mut conn = Connection::new((*config).clone(), peer.identity.clone(), 0);
    let mut rbuf = prefix;
    conn.handle_input(0, &mut rbuf);
    let mut link: Option<warren_runtime::Connection> = None;
    let mut user = String::new();
    // The login, kept until the peer's open names its vhost (checked then, and dropped).
    let mut credentials: Option<Login> = None;
    let mut next_core_channel: u16 = 1;
    let mut cores: HashMap<u16, LinkRef> = HashMap::new();
    // (amqp channel, handle) -> core channel.
    let mut by_link: HashMap<(u16, u32), u16> = HashMap::new();
    // (amqp channel, our delivery id) -> (core channel, delivery tag).
    let mut outgoing: HashMap<(u16, u32), (u16, u64)> = HashMap::new();
    let mut ops: Vec<(u16, Op)> = Vec::new();
    let mut written: u32 = 0;
    let mut publish_used: HashMap<(u16, u32), u32> = HashMap::new();
    let mut pending_consume: Option<String> = None;
    // The management node's link pairs (`/management`).
    let mut mgmt = Pairs::new("/", &config.node);
    loop {
        let out = conn.take_output();
        if !out.is_empty() {
            if wr.write_all(&out).await.is_err() || wr.flush().await.is_err() {
                break;
            }
            if written > 0 {
                ops.push((0, Op::Written { count: written }));
                written = 0;
            }
        }
        for event in conn.take_events() {
            let t = now();
            match event {
                Event::Login(login) => {
                    credentials = Some(login.clone());
                    let answer = match &login {
                        Login::Plain { user: u, password } => {
                            user = u.clone();
                            broker
                                .authenticate(u, password, peer.is_loopback, None)
                                .await
                        }
                        Login::External(id) => {
                            user = id.clone();
                            broker
                                .authenticate_certified(id, peer.is_loopback, None)
                                .await
                        }
                        Login::Anonymous => {
                            // RabbitMQ's default anonymous_login_user.
                            user = "guest".into();
                            broker
                                .authenticate("guest", "guest", peer.is_loopback, None)
                                .await
                        }
                    };
                    let ok = matches!(answer, Ok(Ok(_)));
                    if !ok {
                        tracing::warn!(peer = %peer.addr, user = %Escaped(&user), "AMQP 1.0 login refused");
                    }
                    conn.on_login(ok);
                    conn.handle_input(now(), &mut rbuf);
                }
                Event::OpenRequested { hostname } => {
                    let vhost = hostname
                        .as_deref()
                        .and_then(|h| h.strip_prefix("vhost:"))
                        .unwrap_or("/");
                    let checked = match credentials.take() {
                        Some(Login::Plain { user: u, password }) => {
                            broker
                                .authenticate(&u, &password, peer.is_loopback, Some(vhost))
                                .await
                        }
                        Some(Login::External(id)) => {
                            broker
                                .authenticate_certified(&id, peer.is_loopback, Some(vhost))
                                .await
                        }
                        Some(Login::Anonymous) | None => {
                            broker
                                .authenticate("guest", "guest", peer.is_loopback, Some(vhost))
                                .await
                        }
                    };
                    // RabbitMQ's condition for both a missing vhost and no access to it
                    // (its `check_vhost_exists`); the handshake then ends silently.
                    let answer = match checked {
                        Ok(Ok(_)) => Ok(()),
                        Ok(Err(e)) => {
                            Err(Error::new(condition::UNAUTHORIZED_ACCESS, e.to_string()))
                        }
                        Err(_) => Err(Error::new(
                            condition::CONNECTION_FORCED,
                            "broker shutting down",
                        )),
                    };
                    if let Err(e) = &answer {
                        tracing::warn!(peer = %peer.addr, user = %Escaped(&user), vhost = %Escaped(vhost), error = %e.description.as_deref().unwrap_or(""), "AMQP 1.0 open refused");
                    }
                    conn.answer_open(t, answer);
                    conn.handle_input(now(), &mut rbuf);
                }
                Event::Opened { hostname } => {
                    let vhost = hostname
                        .as_deref()
                        .and_then(|h| h.strip_prefix("vhost:"))
                        .unwrap_or("/")
                        .to_string();
                    tracing::info!(peer = %peer.addr, user = %Escaped(&user), vhost = %Escaped(&vhost), "accepted AMQP 1.0 connection");
                    mgmt.set_vhost(&vhost);
                    let l = broker.connect();
                    l.tx.describe(warren_runtime::ConnMeta {
                        protocol: "AMQP 1-0",
                        peer: peer.addr.as_str().into(),
                        tls: peer.tls,
                        client_properties: None,
                        client_id: None,
                        heartbeat: (config.idle_timeout_ms / 1000) as u16,
                        frame_max: config.max_frame_size,
                        connected_at: warren_runtime::unix_ms(),
                    });
                    link = Some(l);
                    ops.push((
                        0,
                        Op::ConnectionOpen {
                            vhost,
                            user: user.clone(),
                            cancel_notify: true,
                        },
                    ));
                }
                Event::Attach {
                    channel,
                    handle,
                    role,
                    name,
                    source,
                    target,
                    snd_settle_mode,
                    properties,
                    ..
                } => {
                    if let Some(half) = pairs::half(role, source.as_ref(), target.as_ref()) {
                        let mut alloc = || next_core(&mut next_core_channel);
                        mgmt.attach(
                            &mut conn, t, channel, handle, name, half, source, target, properties,
                            &mut alloc, &mut ops,
                        );
                        continue;
                    }
                    let kind = match role {
                        Role::Sender => address::parse_target(
                            target.as_ref().and_then(|t| t.address.as_deref()),
                        )
                        .map(|target| LinkKind::Publisher {
                            target,
                            next_seq: 1,
                            pending: HashMap::new(),
                        }),
                        Role::Receiver => address::parse_source(
                            source.as_ref().and_then(|s| s.address.as_deref()),
                        )
                        .map(|address::Source::Queue(queue)| (queue, snd_settle_mode == 1))
                        .map(|(queue, settled)| {
                            pending_consume = Some(queue);
                            LinkKind::Consumer {
                                settled,
                                pending: None,
                                credit: 0,
                                sent: 0,
                                held: VecDeque::new(),
                            }
                        }),
                    };
                    let core = next_core(&mut next_core_channel);
                    let (kind, core) = match (kind, core) {
                        (Ok(kind), Some(core)) => (kind, core),
                        (Err(e), _) => {
                            tracing::info!(peer = %peer.addr, link = %Escaped(&name), error = %e, "AMQP 1.0 attach refused");
                            conn.refuse_link(
                                t,
                                channel,
                                handle,
                                name,
                                Error::new(e.condition(), e.to_string()),
                            );
                            continue;
                        }
                        (Ok(_), None) => {
                            conn.refuse_link(
                                t,
                                channel,
                                handle,
                                name,
                                Error::new(
                                    condition::RESOURCE_LIMIT_EXCEEDED,
                                    "too many links on this connection",
                                ),
                            );
                            continue;
                        }
                    };
                    ops.push((core, Op::ChannelOpen));
                    let mut kind = kind;
                    match (&mut kind, pending_consume.take()) {
                        (LinkKind::Consumer { pending, .. }, Some(queue)) => {
                            // The queue must exist and be readable now (a passive declare:
                            // its error detaches the link); the consume waits for credit.
                            ops.push((
                                core,
                                Op::QueueDeclare(warren_core::command::QueueDeclare {
                                    queue: queue.clone(),
                                    passive: true,
                                    durable: false,
                                    exclusive: false,
                                    auto_delete: false,
                                    nowait: false,
                                    arguments: Default::default(),
                                }),
                            ));
                            *pending = Some(Consume {
                                queue,
                                consumer_tag: format!("amqp10-{channel}-{handle}"),
                                no_local: false,
                                // Acknowledged by the shell as sent when pre-settled.
                                no_ack: false,
                                exclusive: false,
                                nowait: true,
                                arguments: Default::default(),
                            });
                        }
                        _ => ops.push((core, Op::ConfirmSelect { nowait: true })),
                    }
                    let credit = match kind {
                        LinkKind::Publisher { .. } => PUBLISH_CREDIT,
                        LinkKind::Consumer { .. } => 0,
                    };
                    let consumer = matches!(kind, LinkKind::Consumer { .. });
                    let mut unanswered = None;
                    if consumer {
                        unanswered = Some((name, source, target));
                    } else {
                        conn.accept_link(t, channel, handle, name, source, target, credit);
                    }
                    cores.insert(
                        core,
                        LinkRef {
                            channel,
                            handle,
                            kind,
                            unanswered,
                            early_credit: 0,
                        },
                    );
                    by_link.insert((channel, handle), core);
                }
                Event::Message {
                    channel,
                    handle,
                    delivery_id,
                    settled,
                    payload,
                } => {
                    if mgmt.owns_link(channel, handle) {
                        mgmt.on_request(
                            &mut conn,
                            t,
                            channel,
                            handle,
                            delivery_id,
                            settled,
                            &payload,
                            &mut ops,
                        );
                        continue;
                    }
                    let Some(&core) = by_link.get(&(channel, handle)) else {
                        continue;
                    };
                    let Some(LinkRef {
                        kind:
                            LinkKind::Publisher {
                                target: link_target,
                                next_seq,
                                pending,
                            },
                        ..
                    }) = cores.get_mut(&core)
                    else {
                        continue;
                    };
                    let message = match warren_core::amqp10::decode(&payload) {
                        Ok(m) => m,
                        Err(e) => {
                            tracing::info!(peer = %peer.addr, error = %e, "AMQP 1.0 transfer rejected");
                            conn.settle(
                                t,
                                channel,
                                delivery_id,
                                delivery_id,
                                DeliveryState::Rejected {
                                    error: Some(Error::new(condition::DECODE_ERROR, e.to_string())),
                                },
                            );
                            continue;
                        }
                    };
                    // A null target takes each message's `to`; `/exchanges/:x` takes its
                    // `subject` as the routing key (RabbitMQ 4's v2 addressing).
                    let (to, subject) =
                        warren_core::amqp10::addressing(&payload).unwrap_or((None, None));
                    let route = match link_target.route(to.as_deref(), subject.as_deref()) {
                        Ok(r) => r,
                        Err(e) => {
                            conn.settle(
                                t,
                                channel,
                                delivery_id,
                                delivery_id,
                                DeliveryState::Rejected {
                                    error: Some(Error::new(e.condition(), e.to_string())),
                                },
                            );
                            continue;
                        }
                    };
                    let seq = *next_seq;
                    *next_seq += 1;
                    if !settled {
                        pending.insert(seq, delivery_id);
                    }
                    ops.push((
                        core,
                        Op::Publish(Box::new(Publish {
                            exchange: route.exchange.into(),
                            routing_key: route.routing_key.into(),
                            routed: None,
                            mandatory: false,
                            immediate: false,
                            properties: message.properties,
                            body: message.body,
                        })),
                    ));
                    let used = publish_used.entry((channel, handle)).or_insert(0);
                    *used += 1;
                    if *used >= PUBLISH_CREDIT / 2 {
                        *used = 0;
                        conn.grant_credit(t, channel, handle, PUBLISH_CREDIT);
                    }
                }
                Event::Credit {
                    channel,
                    handle,
                    credit,
                    delivery_count,
                    ..
                } => {
                    if mgmt.owns_link(channel, handle) {
                        mgmt.on_credit(
                            &mut conn,
                            t,
                            channel,
                            handle,
                            credit,
                            delivery_count,
                            &mut ops,
                        );
                    } else if let Some(&core) = by_link.get(&(channel, handle))
                        // Not after a channel error closed its core channel: an op there
                        // would be a connection error.
                        && let Some(l) = cores.get_mut(&core)
                    {
                        if let LinkKind::Consumer {
                            credit: left, sent, ..
                        } = &mut l.kind
                        {
                            // 2.6.7: the receiver's count plus its credit, less ours; a flow
                            // from before our latest transfers leaves none.
                            let n = delivery_count
                                .unwrap_or(0)
                                .wrapping_add(credit)
                                .wrapping_sub(*sent);
                            *left = if n > credit { 0 } else { n };
                        }
                        if l.unanswered.is_some() {
                            l.early_credit = credit;
                        } else {
                            consumer_credit(l, core, credit, &mut ops);
                            send_held(&mut conn, t, l, core, &mut outgoing, &mut ops);
                        }
                    }
                }
                Event::Disposition {
                    channel,
                    first,
                    last,
                    state,
                    ..
                } => {
                    let mut id = first;
                    loop {
                        if let Some((core, tag)) = outgoing.remove(&(channel, id)) {
                            let op = match &state {
                                Some(DeliveryState::Accepted) | None => Op::Ack {
                                    delivery_tag: tag,
                                    multiple: false,
                                },
                                Some(DeliveryState::Rejected { .. }) => Op::Reject {
                                    delivery_tag: tag,
                                    requeue: false,
                                },
                                Some(DeliveryState::Modified {
                                    undeliverable_here: true,
                                    ..
                                }) => Op::Reject {
                                    delivery_tag: tag,
                                    requeue: false,
                                },
                                Some(_) => Op::Reject {
                                    delivery_tag: tag,
                                    requeue: true,
                                },
                            };
                            ops.push((core, op));
                        }
                        if id == last {
                            break;
                        }
                        id = id.wrapping_add(1);
                    }
                }
                Event::Detached { channel, handle } => {
                    mgmt.on_detached(channel, handle, &mut ops);
                    // A link whose core channel a channel error already closed (and
                    // removed from `cores`) has nothing left to close: a close there
                    // would be a connection error.
                    if let Some(core) = by_link.remove(&(channel, handle))
                        && cores.remove(&core).is_some()
                    {
                        ops.push((core, Op::ChannelClose));
                    }
                }
                Event::Ended { channel } => {
                    mgmt.on_ended(channel, &mut ops);
                    let gone: Vec<u32> = by_link
                        .keys()
                        .filter(|(c, _)| *c == channel)
                        .map(|(_, h)| *h)
                        .collect();
                    for h in gone {
                        if let Some(core) = by_link.remove(&(channel, h))
                            && cores.remove(&core).is_some()
                        {
                            ops.push((core, Op::ChannelClose));
                        }
                    }
                }
            }
        }
        // The management node's look-ups (a queue's type and flags, which no core reply
        // carries); answering one may start the next request, which may ask again.
        loop {
            let lookups = mgmt.take_lookups();
            if lookups.is_empty() {
                break;
            }
            for (key, queue) in lookups {
                let info = lookup_queue(&broker, mgmt.vhost(), &queue).await;
                mgmt.on_lookup(&mut conn, now(), &key, info.as_ref(), &mut ops);
            }
        }
        if let Some(l) = &link
            && !ops.is_empty()
            && l.tx.send(std::mem::take(&mut ops)).await.is_err()
        {
            break;
        }
        if !conn.has_output() && conn.ended().is_some() {
            break;
        }
        if conn.has_output() || conn.has_events() {
            continue;
        }
        if *shutdown.borrow_and_update() {
            conn.close(
                now(),
                Error::new(condition::CONNECTION_FORCED, "broker shutting down"),
            );
            continue;
        }
        if rbuf.capacity() - rbuf.len() < 4096 {
            rbuf.reserve(READ_CHUNK);
        }
        let deadline = conn.deadline().map(|ms| epoch + Duration::from_millis(ms));
        tokio::select! {
            _ = shutdown.changed() => {}
            batch = recv(link.as_mut().map(|l| &mut l.rx)), if link.is_some() => {
                let Some(batch) = batch else { break };
                let t = now();
                for effect in batch {
                    if effect_channel(&effect).is_some_and(|c| mgmt.owns_core(c)) {
                        mgmt.on_effect(&mut conn, t, effect, &mut ops);
                    } else {
                        on_effect(&mut conn, t, effect, &mut cores, &mut outgoing, &mut written, &mut ops);
                    }
                }
            }
            read = rd.read_buf(&mut rbuf) => match read {
                Ok(0) | Err(_) => break,
                Ok(_) => conn.handle_input(now(), &mut rbuf),
            },
            _ = sleep_until(deadline.unwrap_or_else(Instant::now)), if deadline.is_some() => {
                conn.on_timeout(now());
            }
        }
    }
    if let Some(l) = link {
        let _ = l.tx.send(vec![(0, Op::ConnectionClose)]).await;
    }
    match conn.ended() {
        Some(Ended::Closed(e)) => {
            tracing::info!(peer = %peer.addr, condition = %e.condition, "AMQP 1.0 connection closed")
        }
        Some(Ended::Refused(why)) => {
            tracing::info!(peer = %peer.addr, why = %why, "AMQP 1.0 connection refused")
        }
        _ => tracing::info!(peer = %peer.addr, "AMQP 1.0 connection ended"),
    }
}

/// Sends a consumer's held deliveries as far as its credit goes.
fn send_held(
    conn: &mut Connection,
    now: u64,
    l: &mut LinkRef,
    core: u16,
    outgoing: &mut HashMap<(u16, u32), (u16, u64)>,
    ops: &mut Vec<(u16, Op)>,
) {
    let (channel, handle) = (l.channel, l.handle);
    let LinkKind::Consumer {
        settled,
        credit,
        sent,
        held,
        ..
    } = &mut l.kind
    else {
        return;
    };
    while *credit > 0
        && let Some(delivery) = held.pop_front()
    {
        *credit -= 1;
        *sent = sent.wrapping_add(1);
        let payload = warren_core::amqp10::encode(&delivery.message);
        let tag = Bytes::copy_from_slice(&delivery.delivery_tag.to_be_bytes());
        let id = conn.send_message(now, channel, handle, tag, *settled, &payload);
        if *settled {
            ops.push((
                core,
                Op::Ack {
                    delivery_tag: delivery.delivery_tag,
                    multiple: false,
                },
            ));
        } else if let Some(id) = id {
            outgoing.insert((channel, id), (core, delivery.delivery_tag));
        }
    }
}

/// The client's first credit starts the consume, with that credit as its prefetch: 0.9.1's
/// per-consumer prefetch is fixed when the consumer starts (a later `basic.qos` applies to
/// later consumers), and the channel-wide one is refused by quorum queues (a connection
/// error). So later credit only moves the shell's count: the core has at most the first
/// credit's worth of deliveries out unsettled, and what comes beyond the link's credit
/// waits in `held`, bounded by that.
fn consumer_credit(l: &mut LinkRef, core: u16, credit: u32, ops: &mut Vec<(u16, Op)>) {
    if credit == 0 {
        return;
    }
    let LinkKind::Consumer { pending, .. } = &mut l.kind else {
        return;
    };
    let Some(consume) = pending.take() else {
        return;
    };
    ops.push((
        core,
        Op::Qos {
            prefetch_size: 0,
            prefetch_count: u16::try_from(credit).unwrap_or(u16::MAX),
            global: false,
        },
    ));
    ops.push((core, Op::Consume(consume)));
}

/// The core channel an effect is for (the management pairs' replies and errors).
fn effect_channel(e: &Effect) -> Option<u16> {
    match e {
        Effect::Reply { ch, .. } | Effect::ChannelError { ch, .. } => Some(ch.channel),
        _ => None,
    }
}

/// A queue of the vhost, from the admin listing (`None`: no such queue, or no answer).
async fn lookup_queue(broker: &BrokerHandle, vhost: &str, name: &str) -> Option<QueueInfo> {
    match broker.admin(AdminRequest::ListQueues).await {
        Ok(AdminResponse::Queues(queues)) => queues
            .into_iter()
            .find(|q| q.vhost == vhost && q.name == name),
        _ => None,
    }
}

fn next_core(next: &mut u16) -> Option<u16> {
    let c = *next;
    *next = next.checked_add(1)?;
    Some(c)
}

async fn recv(rx: Option<&mut warren_runtime::EffectReceiver>) -> Option<Vec<Effect>> {
    match rx {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}

fn on_effect(
    conn: &mut Connection,
    now: u64,
    effect: Effect,
    cores: &mut HashMap<u16, LinkRef>,
    outgoing: &mut HashMap<(u16, u32), (u16, u64)>,
    written: &mut u32,
    ops: &mut Vec<(u16, Op)>,
) {
    match effect {
        Effect::Deliver { ch, delivery, .. } => {
            *written += 1;
            let Some(l) = cores.get_mut(&ch.channel) else {
                return;
            };
            let LinkKind::Consumer { held, .. } = &mut l.kind else {
                return;
            };
            held.push_back(delivery);
            send_held(conn, now, l, ch.channel, outgoing, ops);
        }
        Effect::Confirm {
            ch,
            seq,
            multiple,
            ack,
        } => {
            let Some(l) = cores.get_mut(&ch.channel) else {
                return;
            };
            let (channel, _) = (l.channel, l.handle);
            let LinkKind::Publisher { pending, .. } = &mut l.kind else {
                return;
            };
            let seqs: Vec<u64> = if multiple {
                pending.keys().copied().filter(|s| *s <= seq).collect()
            } else {
                vec![seq]
            };
            for s in seqs {
                if let Some(id) = pending.remove(&s) {
                    let state = if ack {
                        DeliveryState::Accepted
                    } else {
                        DeliveryState::Rejected { error: None }
                    };
                    conn.settle(now, channel, id, id, state);
                }
            }
        }
        Effect::Reply {
            ch,
            reply: Reply::QueueDeclareOk { .. },
        } => {
            // A consumer's queue exists and may be read: its attach is answered (credit
            // comes from the client).
            if let Some(l) = cores.get_mut(&ch.channel)
                && let Some((name, source, target)) = l.unanswered.take()
            {
                conn.accept_link(now, l.channel, l.handle, name, source, target, 0);
                if l.early_credit > 0 {
                    let credit = l.early_credit;
                    consumer_credit(l, ch.channel, credit, ops);
                }
            }
        }
        Effect::ChannelError { ch, error } => {
            ops.push((ch.channel, Op::ChannelCloseOk));
            // The core requeued them; a settlement on the closed channel would be an op
            // where the core expects none.
            outgoing.retain(|_, (core, _)| *core != ch.channel);
            if let Some(mut l) = cores.remove(&ch.channel) {
                let cond = match error.code.code() {
                    404 => condition::NOT_FOUND,
                    403 => condition::UNAUTHORIZED_ACCESS,
                    405 => condition::RESOURCE_LOCKED,
                    406 => condition::PRECONDITION_FAILED,
                    _ => condition::INTERNAL_ERROR,
                };
                let e = Error::new(cond, error.text.to_string());
                match l.unanswered.take() {
                    // RabbitMQ's refusal: an attach with a null terminus, then the detach.
                    Some((name, ..)) => {
                        conn.refuse_link(now, l.channel, l.handle, name, e);
                    }
                    None => conn.detach_link(now, l.channel, l.handle, Some(e)),
                }
            }
        }
        Effect::ConnectionError { error, .. } => {
            conn.close(
                now,
                Error::new(condition::CONNECTION_FORCED, error.text.to_string()),
            );
        }
        Effect::Return { .. }
        | Effect::Reply { .. }
        | Effect::ConsumerCancelled { .. }
        | Effect::Blocked { .. }
        | Effect::Unblocked { .. }
        | Effect::FlowPaused { .. }
        | Effect::FlowResumed { .. } => {}
    }
}

/// The 8-byte header starts AMQP 1.0 (plain or SASL): the listener hands the connection to
/// this gateway rather than the 0.9.1 one.
pub fn is_amqp10_header(header: &[u8]) -> bool {
    header.len() >= 5
        && &header[..4] == b"AMQP"
        && matches!(header[4], 0 | 3)
        && header.get(5) == Some(&1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn amqp10_headers_dispatch() {
        assert!(is_amqp10_header(b"AMQP\x03\x01\x00\x00"));
        assert!(is_amqp10_header(b"AMQP\x00\x01\x00\x00"));
        assert!(!is_amqp10_header(b"AMQP\x00\x00\x09\x01"));
        assert!(!is_amqp10_header(b"AMQP"));
    }
}
