//! The per-connection MQTT state machine, sans-IO: packets and core effects in (with the current
//! unix time in ms), packets and core ops out, plus a keep-alive deadline. The tokio shell
//! (`connection.rs`) moves bytes and time; everything the protocol decides is here, so it is
//! tested without sockets.
//!
//! A session is backed by the core like RabbitMQ's MQTT plugin backs it: one queue per client
//! id (`mqtt-subscription-{id}qos1`) bound to `amq.topic` with the translated filters, consumed
//! on channel 1 with manual acks and a prefetch equal to the in-flight limit, and published
//! into `amq.topic` in confirm mode (a PUBACK/PUBREC leaves only once the core has routed the
//! message). Clean sessions use an exclusive queue that the core deletes with the connection;
//! persistent ones a durable queue that outlives it, so messages published while the client is
//! away wait there and unacknowledged ones come back (redelivered, hence DUP) in order.

use crate::codec::{self, Level, qos_from};
use crate::config::MqttConfig;
use crate::convert::{self, EXCHANGE};
use crate::error::CloseError;
use crate::record::stored_subs;
pub use crate::record::{SessionRecord, SubMap, SubOpts, decode_will, encode_will};
use mqtt_proto::v5::{
    self, ConnectReasonCode, DisconnectReasonCode, PubackReasonCode, PubcompReasonCode,
    PubrecReasonCode, RetainHandling, SubscribeReasonCode, UnsubscribeReasonCode,
};
use mqtt_proto::{Pid, QoS, QosPid, TopicName};
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::Arc;
use warren_core::access::{Perm, Permissions};
use warren_core::command::{Bind, Consume, Op, QueueDeclare};
use warren_core::effect::{Delivery, Effect, Reply};
use warren_core::message::{FieldTable, FieldValue, Message};
use warren_core::mqtt::{
    RetainedMessage, StoredSession, StoredWill, filter_to_amqp_pattern, matches, validate_filter,
    validate_topic,
};

/// Queues a packet without Subscription Identifiers beyond what `mqtt-proto` holds.
trait PushPacket {
    fn push_packet(&mut self, p: v5::Packet);
}

impl PushPacket for Vec<codec::Out> {
    fn push_packet(&mut self, p: v5::Packet) {
        self.push(p.into());
    }
}

/// The core channel every MQTT session uses.
pub const CHANNEL: u16 = 1;
/// The core channel of QoS 0 publishes, opened at the first one: not in confirm mode, so a
/// QoS 0 publish costs no confirm (no answer from its queues, no `Effect::Confirm` back to
/// the publisher's task per op batch), which MQTT never acknowledges anyway. Channel 1
/// stays in confirm mode for the PUBACKs and PUBRECs of QoS 1/2.
pub const QOS0_CHANNEL: u16 = 3;
const CONSUMER_TAG: &str = "mqtt";
/// The consumer tag of a clean session's `mqtt-qos0` queue (see `Session::direct`): its
/// deliveries come without acks, so they are never acked back.
const QOS0_TAG: &str = "mqtt-qos0";

/// An accepted CONNECT, as the session needs it.
#[derive(Clone, Debug)]
pub struct ConnectInfo {
    pub level: Level,
    pub client_id: Arc<str>,
    pub assigned_id: bool,
    pub clean_start: bool,
    pub session_expiry_s: u32,
    pub keep_alive_s: u16,
    pub server_keep_alive: Option<u16>,
    pub will: Option<v5::LastWill>,
    pub user: String,
    pub client_receive_max: u16,
    pub client_max_packet: Option<u32>,
    pub client_topic_alias_max: u16,
    /// The user's permissions in the vhost as of the login (set after it): a SUBSCRIBE the
    /// user may not make is refused in the SUBACK.
    pub permissions: Option<Arc<Permissions>>,
    /// A Mosquitto bridge (the CONNECT's bridge bit, `codec::take_bridge_bit`): every
    /// subscription it makes is no-local and retain-as-published, as Mosquitto treats one.
    pub bridge: bool,
}

/// Checks a CONNECT: protocol level, client id rules, the user name (no credentials means
/// guest, as RabbitMQ's `mqtt.default_user`; the password is the broker's to check, see
/// [`credentials`]). `assign` names clients that sent an empty id.
pub fn check_connect(
    c: &v5::Connect,
    peer_is_loopback: bool,
    config: &MqttConfig,
    assign: impl FnOnce() -> String,
) -> Result<ConnectInfo, ConnectReasonCode> {
    let (_, level) = c.protocol.to_pair();
    if c.properties.auth_method.is_some() {
        return Err(ConnectReasonCode::BadAuthMethod);
    }
    let (user, _) = credentials(c)?;
    if user == "guest" && !peer_is_loopback {
        return Err(ConnectReasonCode::NotAuthorized);
    }
    let (client_id, assigned_id): (Arc<str>, bool) = if c.client_id.is_empty() {
        // 3.1 has no empty ids; 3.1.1 only with a clean session (MQTT-3.1.3-8); v5 assigns.
        if level == 3 || (level == 4 && !c.clean_start) {
            return Err(ConnectReasonCode::ClientIdentifierNotValid);
        }
        (Arc::from(assign()), level == 5)
    } else {
        (c.client_id.clone(), false)
    };
    if let Some(w) = &c.last_will
        && validate_topic(&w.topic_name).is_err()
    {
        return Err(ConnectReasonCode::TopicNameInvalid);
    }
    let keep_alive_s = match config.server_keep_alive {
        Some(k) if c.keep_alive == 0 || c.keep_alive > k => k,
        _ => c.keep_alive,
    };
    Ok(ConnectInfo {
        level,
        client_id,
        assigned_id,
        clean_start: c.clean_start,
        session_expiry_s: c.properties.session_expiry_interval.unwrap_or(0),
        keep_alive_s,
        server_keep_alive: (keep_alive_s != c.keep_alive).then_some(keep_alive_s),
        will: c.last_will.clone(),
        user: user.to_string(),
        client_receive_max: c.properties.receive_max.unwrap_or(u16::MAX).max(1),
        client_max_packet: c.properties.max_packet_size,
        client_topic_alias_max: c.properties.topic_alias_max.unwrap_or(0),
        permissions: None,
        bridge: false,
    })
}

/// The user name and password of a CONNECT: anonymous clients are `guest`/`guest` (as
/// RabbitMQ's MQTT plugin with `allow_anonymous`); a password that is not UTF-8 cannot match
/// any stored one.
pub fn credentials(c: &v5::Connect) -> Result<(&str, &str), ConnectReasonCode> {
    match (c.username.as_deref(), c.password.as_deref()) {
        (None, None) => Ok(("guest", "guest")),
        (Some(user), password) => {
            let password = std::str::from_utf8(password.unwrap_or(b""))
                .map_err(|_| ConnectReasonCode::BadUserNameOrPassword)?;
            Ok((user, password))
        }
        (None, Some(_)) => Err(ConnectReasonCode::BadUserNameOrPassword),
    }
}

/// The core queue of the session of `client_id`.
pub fn session_queue(client_id: &str) -> String {
    format!("{}{client_id}qos1", crate::config::SESSION_QUEUE_PREFIX)
}

/// The `mqtt-qos0` queue of the clean session of `client_id` while all its subscriptions
/// are QoS 0 (RabbitMQ's MQTT plugin names its QoS 0 queue the same way).
pub fn session_qos0_queue(client_id: &str) -> String {
    format!("{}{client_id}qos0", crate::config::SESSION_QUEUE_PREFIX)
}

/// The queue of share group `group` for `filter` (one per group and filter, per vhost).
fn shared_queue(group: &str, filter: &str) -> String {
    format!("mqtt-shared-{group}-{filter}")
}

fn granted_code(qos: QoS) -> SubscribeReasonCode {
    match qos {
        QoS::Level0 => SubscribeReasonCode::GrantedQoS0,
        QoS::Level1 => SubscribeReasonCode::GrantedQoS1,
        QoS::Level2 => SubscribeReasonCode::GrantedQoS2,
    }
}

/// A v3 or v5 CONNACK refusing a connection.
pub fn refusal(code: ConnectReasonCode) -> v5::Packet {
    v5::Packet::Connack(v5::Connack::new(false, code))
}

enum PendingAck {
    None,
    Puback(Pid),
    Pubrec(Pid),
}

struct Inflight {
    /// The core delivery to ack; `None` for retained messages (not from the queue) and once
    /// acked at PUBREC.
    tag: Option<u64>,
    qos: QoS,
    /// PUBREC received and PUBREL sent (QoS 2).
    released: bool,
}

/// An outbound QoS 1/2 message waiting for a free packet id (the client's Receive Maximum).
struct Waiting {
    publish: v5::Publish,
    /// Subscription Identifiers past the one in `publish` (see [`codec::Out`]).
    more_sub_ids: Vec<u32>,
    tag: Option<u64>,
}

/// A will with the user its publish runs as (the login is gone by the time a delayed will is
/// published). The user is kept only here: a client without a will never needs it.
struct Will {
    will: v5::LastWill,
    user: Box<str>,
}

/// What SUBSCRIBEs leave waiting on the core, oldest first. Allocated while anything waits
/// and dropped once nothing does: kept in `Rare`, the retained-message request every
/// subscription makes allocated `Rare` (~300 bytes) in every idle subscriber, for good.
#[derive(Default)]
struct Pending {
    /// Positions in `Session::out` of the SUBACKs waiting for a bind-ok.
    subacks: VecDeque<usize>,
    /// `Op::RetainedGet`s sent and not answered (the core answers a channel's requests in
    /// order): the subscription identifier and granted QoS of each.
    retained_gets: VecDeque<(Option<u32>, QoS)>,
}

/// The protocol state an idle subscriber never touches: confirms of its publishes, QoS 2
/// packet ids, outbound messages in flight or waiting for a packet id, topic aliases, a
/// delayed will. Inline it was more than half of `Session` (~230 bytes in every idle
/// connection); boxed, it is allocated on first use and then kept, so a busy session pays
/// one pointer hop and no allocation per message.
struct Rare {
    confirm_next: u64,
    confirms: VecDeque<(u64, PendingAck)>,
    /// Entries of `confirms` that are PUBACKs: the QoS 1 share of the inbound window, kept
    /// as a count so a publish does not scan up to 1024 pending confirms.
    pending_pubacks: u32,
    next_pid: u16,
    inbound_qos2: BTreeSet<u16>,
    outbound: BTreeMap<u16, Inflight>,
    waiting: VecDeque<Waiting>,
    /// The core delivery tags of the QoS 1/2 messages in `outbound` or `waiting` not yet
    /// acked to the core, ascending (the core numbers a channel's deliveries in order, so
    /// this is nearly always a push at the back and a pop at the front). An ack of a tag
    /// below all of them covers every tag up to it, so it is merged into one multiple ack
    /// (`Session::ack_core`) instead of one op per PUBACK.
    held_tags: VecDeque<u64>,
    aliases: HashMap<u16, TopicName>,
    /// Topic aliases towards the client (MQTT 5 3.3.2.3.4), first come first served up to
    /// `out_alias_max`.
    out_aliases: HashMap<TopicName, u16>,
    delayed_will: Option<(u32, Box<Will>)>,
    /// Packet ids of the previous connection's unacknowledged outbound messages, oldest
    /// first: the core redelivers those messages first, and they get these ids again.
    resume_pids: VecDeque<u16>,
    /// Tab-link ids of QoS 1 publishes waiting for their confirm (`link_dedup`).
    link_ids: crate::link_dedup::Unconfirmed,
}

impl Rare {
    /// A delivery now held by the session until the client acknowledges it.
    fn hold(&mut self, tag: u64) {
        match self.held_tags.back() {
            Some(&last) if last >= tag => {
                if let Err(i) = self.held_tags.binary_search(&tag) {
                    self.held_tags.insert(i, tag);
                }
            }
            _ => self.held_tags.push_back(tag),
        }
    }

    /// A delivery no longer held (acked to the core now).
    fn release(&mut self, tag: u64) {
        if self.held_tags.front() == Some(&tag) {
            self.held_tags.pop_front();
        } else if let Ok(i) = self.held_tags.binary_search(&tag) {
            self.held_tags.remove(i);
        }
        // A burst's capacity is not kept by a session that goes idle (at most one
        // allocation per burst otherwise: the list empties only when nothing is in flight).
        if self.held_tags.is_empty() && self.held_tags.capacity() > 16 {
            self.held_tags = VecDeque::new();
        }
    }

    fn push_confirm(&mut self, ack: PendingAck) {
        self.pending_pubacks += u32::from(matches!(ack, PendingAck::Puback(_)));
        self.confirms.push_back((self.confirm_next, ack));
        self.confirm_next += 1;
    }
}

impl Default for Rare {
    fn default() -> Rare {
        Rare {
            // The core numbers a channel's confirms from 1, as does MQTT its packet ids.
            confirm_next: 1,
            confirms: VecDeque::new(),
            pending_pubacks: 0,
            next_pid: 1,
            inbound_qos2: BTreeSet::new(),
            outbound: BTreeMap::new(),
            waiting: VecDeque::new(),
            held_tags: VecDeque::new(),
            aliases: HashMap::new(),
            out_aliases: HashMap::new(),
            delayed_will: None,
            resume_pids: VecDeque::new(),
            link_ids: Default::default(),
        }
    }
}

pub struct Session {
    config: Arc<MqttConfig>,
    level: Level,
    client_id: Arc<str>,
    persistent: bool,
    /// A Mosquitto bridge (`ConnectInfo::bridge`).
    bridge: bool,
    /// Whether the session queue is (or will be declared) durable: a persistent session's,
    /// and a resumed one's whatever the new expiry (MQTT keeps the session; it ends, and the
    /// queue is deleted, when the connection closes with expiry 0).
    queue_durable: bool,
    /// Delete any queue of this client id before declaring the session's: a new session
    /// must not inherit one left by a crash between a session's end and its queue's
    /// deletion (or by a broker without stored sessions).
    purge_queue: bool,
    /// The registry holds a stored record for this client id (so a session that ends must
    /// remove it).
    stored: bool,
    /// The subscriptions or mode changed since the session was last stored.
    dirty: bool,
    session_expiry_s: u32,
    subs: SubMap,
    queue_ready: bool,
    /// The session's queue is its `mqtt-qos0` queue (`session_qos0_queue`): a clean
    /// session whose subscriptions are all QoS 0 is served without a queue that holds
    /// messages, acks or confirms; a slow subscriber loses messages beyond its write
    /// window, as MQTT allows for QoS 0. Its first subscription of QoS 1 or 2 moves it to
    /// the classic queue for good (`leave_direct`).
    direct: bool,
    keep_alive_ms: u64,
    last_rx: u64,
    client_receive_max: u16,
    client_max_packet: Option<u32>,
    rare: Option<Box<Rare>>,
    out_alias_max: u16,
    // Boxed, as `Rare`: most clients set none, and inline a will costs ~2x its size in every
    // idle session.
    will: Option<Box<Will>>,
    /// The user's permissions as of the login (`None`: not known; the core still checks).
    permissions: Option<Arc<Permissions>>,
    /// Set once a subscription asks for no-local: this session's publishes then carry its
    /// client id, so its own deliveries can be recognised.
    stamp_publisher: bool,
    /// Deliveries received from the core since the last flush (write-window credit).
    delivered: u32,
    /// The highest delivery tag acknowledged but not yet told to the core (0: none): acks
    /// in delivery order while no earlier delivery is held go to the core as one multiple
    /// ack per batch of ops (`ack_core`), not one op per QoS 0 message.
    ack_upto: u64,
    disconnected: bool,
    paused: bool,
    blocked: bool,
    published: bool,
    /// `QOS0_CHANNEL` is open.
    qos0_open: bool,
    out: Vec<codec::Out>,
    /// SUBACKs waiting for their bindings to be applied and retained-message requests not
    /// yet answered (see [`Session::on_subscribe`]); `None` when none waits, so an idle
    /// subscriber holds no allocation for them.
    pending: Option<Box<Pending>>,
    ops: Vec<(u16, Op)>,
    /// How many packets and ops the last flush took (at most `HINT_MAX_BYTES` of them): the next batch
    /// reserves that much at its first packet or op, instead of growing by doubling (a
    /// reallocation and copy at 4, 8, 16... entries of every busy read or effect batch).
    /// Lazily, so an idle session holds no buffer.
    out_hint: u16,
    ops_hint: u16,
}

/// The largest reservation a hint makes, in bytes: under glibc's 64 KiB at which freeing a
/// chunk consolidates every fast bin (`malloc_consolidate` and `unlink_chunk` were 5-7 % of
/// the broker's samples in fan-in with 1,024-entry reservations: 368 KiB of packets).
const HINT_MAX_BYTES: usize = 60 * 1024;

/// The next reservation (entries of `T`) after a batch of `len`: a small batch (the
/// write-window credit after a large one) halves it rather than resetting it.
fn hint<T>(len: usize, last: u16) -> u16 {
    let max = HINT_MAX_BYTES / std::mem::size_of::<T>().max(1);
    len.max(usize::from(last) / 2).min(max) as u16
}

impl Session {
    /// Starts a session after a successful CONNECT (and any takeover). Queues the CONNACK and the
    /// core ops that open the session.
    pub fn new(
        info: ConnectInfo,
        record: Option<SessionRecord>,
        now: u64,
        config: Arc<MqttConfig>,
    ) -> Session {
        let persistent = info.session_expiry_s > 0;
        let prefetch = info.client_receive_max.min(config.max_inflight);
        let mut s = Session {
            level: info.level,
            client_id: info.client_id.clone(),
            persistent,
            bridge: info.bridge,
            queue_durable: persistent,
            purge_queue: false,
            stored: record.is_some(),
            dirty: persistent || record.is_some(),
            session_expiry_s: info.session_expiry_s,
            subs: SubMap::default(),
            queue_ready: false,
            direct: false,
            keep_alive_ms: u64::from(info.keep_alive_s) * 1000,
            last_rx: now,
            client_receive_max: info.client_receive_max,
            client_max_packet: info.client_max_packet,
            rare: None,
            out_alias_max: if info.level == 5 {
                info.client_topic_alias_max.min(config.topic_alias_max)
            } else {
                0
            },
            will: info.will.clone().map(|will| {
                Box::new(Will {
                    will,
                    user: info.user.as_str().into(),
                })
            }),
            stamp_publisher: false,
            // `{client_id}` in topic permissions compiled once, for this connection.
            permissions: info
                .permissions
                .as_ref()
                .map(|p| p.for_client(&info.client_id)),
            delivered: 0,
            ack_upto: 0,
            disconnected: false,
            paused: false,
            blocked: false,
            published: false,
            qos0_open: false,
            out: Vec::new(),
            out_hint: 0,
            ops_hint: 0,
            pending: None,
            ops: Vec::new(),
            config: config.clone(),
        };
        s.ops.push((
            0,
            Op::ConnectionOpen {
                vhost: config.vhost.clone(),
                user: info.user.clone(),
                cancel_notify: true,
            },
        ));
        if s.permissions
            .as_ref()
            .is_some_and(|p| p.has_topic_permissions())
        {
            // The core checks topic permissions too, and expands `{client_id}` with this
            // (only sent when some apply: a connection without them keeps no copy).
            s.ops.push((0, Op::ClientId(info.client_id.to_string())));
        }
        s.ops.push((CHANNEL, Op::ChannelOpen));
        s.ops.push((CHANNEL, Op::ConfirmSelect { nowait: true }));
        s.ops.push((
            CHANNEL,
            Op::Qos {
                prefetch_size: 0,
                prefetch_count: prefetch,
                global: false,
            },
        ));
        let mut session_present = false;
        match record {
            Some(r) if (info.clean_start || r.expired(now)) && r.has_queue => {
                s.ops.push((
                    CHANNEL,
                    Op::QueueDelete {
                        queue: s.queue(),
                        if_unused: false,
                        if_empty: false,
                        nowait: true,
                    },
                ));
            }
            Some(r) if info.clean_start || r.expired(now) => {}
            Some(r) => {
                session_present = true;
                s.subs = r.subs;
                s.stamp_publisher = s.subs.values().any(|o| o.no_local);
                if !r.inbound_qos2.is_empty() {
                    s.rare().inbound_qos2 = r.inbound_qos2;
                }
                if !r.outbound.is_empty() {
                    s.rare().resume_pids = r.outbound.into_iter().collect();
                }
                if r.has_queue {
                    // A stored session's queue is durable, whatever this connection's expiry.
                    s.queue_durable = true;
                    s.ensure_queue(false);
                }
                let shared: Vec<(Arc<str>, String)> = s
                    .subs
                    .keys()
                    .filter_map(|f| match validate_filter(f) {
                        Ok((Some(group), plain)) => Some((f.clone(), shared_queue(group, plain))),
                        _ => None,
                    })
                    .collect();
                for (filter, queue) in shared {
                    s.join_share(&filter, queue);
                }
                for pid in r.awaiting_comp {
                    if let Ok(p) = Pid::try_from(pid) {
                        s.rare().outbound.insert(
                            pid,
                            Inflight {
                                tag: None,
                                qos: QoS::Level2,
                                released: true,
                            },
                        );
                        s.out
                            .push_packet(v5::Packet::Pubrel(v5::Pubrel::new_success(p)));
                    }
                }
            }
            None => {
                // A durable queue without a session is adopted by a persistent session that
                // asked to resume (what a broker without stored sessions left), else deleted.
                s.purge_queue = !persistent || info.clean_start;
            }
        }
        let mut ack = v5::Connack::new(session_present, ConnectReasonCode::Success);
        if s.level == 5 {
            let p = &mut ack.properties;
            p.receive_max = Some(config.max_inflight);
            p.max_packet_size = Some(config.max_packet_size);
            p.topic_alias_max = Some(config.topic_alias_max);
            p.retain_available = Some(true);
            p.wildcard_subscription_available = Some(true);
            p.subscription_id_available = Some(true);
            p.shared_subscription_available = Some(true);
            p.server_keep_alive = info.server_keep_alive;
            if info.assigned_id {
                p.assigned_client_id = Some(info.client_id.clone());
            }
        }
        // The CONNACK goes first: PUBRELs resent above must follow it.
        s.out.insert(0, v5::Packet::Connack(ack).into());
        s
    }

    /// The session's core queue. Built when an op needs it (CONNECT, SUBSCRIBE, UNSUBSCRIBE)
    /// rather than held: kept, it cost every idle connection a ~50-byte allocation.
    fn queue(&self) -> String {
        if self.direct {
            session_qos0_queue(&self.client_id)
        } else {
            session_queue(&self.client_id)
        }
    }

    /// The rarely used state, allocated on first use.
    fn rare(&mut self) -> &mut Rare {
        self.rare.get_or_insert_with(Box::default)
    }

    pub fn level(&self) -> Level {
        self.level
    }

    pub fn config(&self) -> &Arc<MqttConfig> {
        &self.config
    }

    pub fn client_id(&self) -> &Arc<str> {
        &self.client_id
    }

    /// Packets to send, in order: those queued before the first SUBACK still waiting for its
    /// bindings (everything after it waits too, so the client sees packets in the order
    /// they were queued, topic alias assignments included).
    pub fn take_packets(&mut self) -> Vec<codec::Out> {
        self.out_hint = hint::<codec::Out>(self.out.len(), self.out_hint);
        let Some(held) = self.pending.as_deref_mut().map(|p| &mut p.subacks) else {
            return std::mem::take(&mut self.out);
        };
        let n = held
            .front()
            .map_or(self.out.len(), |&at| at.min(self.out.len()));
        for at in held.iter_mut() {
            *at -= n;
        }
        self.out.drain(..n).collect()
    }

    /// Every queued packet, held SUBACKs included: for the close sequence, which writes them
    /// only after its barrier, i.e. once the bindings were applied.
    pub fn take_all_packets(&mut self) -> Vec<codec::Out> {
        if let Some(p) = self.pending.as_deref_mut() {
            p.subacks.clear();
        }
        self.drop_pending_if_done();
        std::mem::take(&mut self.out)
    }

    /// A bind-ok: the oldest held SUBACK's bindings are applied, and the routing table holding
    /// them was published before this reply left the broker.
    fn release_suback(&mut self) {
        if let Some(p) = self.pending.as_deref_mut() {
            p.subacks.pop_front();
        }
        self.drop_pending_if_done();
    }

    /// Frees `pending` once nothing waits in it.
    fn drop_pending_if_done(&mut self) {
        if self
            .pending
            .as_deref()
            .is_some_and(|p| p.subacks.is_empty() && p.retained_gets.is_empty())
        {
            self.pending = None;
        }
    }

    /// Whether the ops to send hold a publish (`connection.rs` lets other connections'
    /// reads go first: see `yield_to_earlier_reads`).
    pub fn publishes_pending(&self) -> bool {
        self.ops.iter().any(|(_, op)| matches!(op, Op::Publish(_)))
    }

    /// Whether the ops to send hold a binding (a SUBSCRIBE's).
    pub fn binds_pending(&self) -> bool {
        self.ops
            .iter()
            .any(|(_, op)| matches!(op, Op::QueueBind(_)))
    }

    /// Core ops to send, in order, before the packets (a SUBACK waits for its bindings).
    pub fn take_ops(&mut self) -> Vec<(u16, Op)> {
        self.flush_acks();
        if !self.ops.is_empty() {
            self.ops_hint = hint::<(u16, Op)>(self.ops.len(), self.ops_hint);
        }
        std::mem::take(&mut self.ops)
    }

    /// Reserves the last batch's sizes in the empty packet and op lists (see `out_hint`).
    fn reserve_hinted(&mut self) {
        if self.out.capacity() == 0 && self.out_hint > 0 {
            self.out.reserve(usize::from(self.out_hint));
        }
        if self.ops.capacity() == 0 && self.ops_hint > 0 {
            self.ops.reserve(usize::from(self.ops_hint));
        }
    }

    /// Deliveries now written to the socket: returns their write-window credit to the core.
    pub fn flushed(&mut self) {
        if self.delivered > 0 {
            self.ops.push((
                CHANNEL,
                Op::Written {
                    count: self.delivered,
                },
            ));
            self.delivered = 0;
        }
    }

    /// The client sent DISCONNECT.
    pub fn disconnected(&self) -> bool {
        self.disconnected
    }

    /// Whether the shell should stop reading from the socket (core flow control, or the memory
    /// alarm once this session has published).
    pub fn read_paused(&self) -> bool {
        self.paused || (self.blocked && self.published)
    }

    /// When the client has been silent for 1.5 times its keep-alive (MQTT-3.1.2-24).
    pub fn deadline(&self) -> Option<u64> {
        (self.keep_alive_ms > 0).then(|| self.last_rx + self.keep_alive_ms * 3 / 2)
    }

    pub fn on_timeout(&mut self, now: u64) -> Result<(), CloseError> {
        match self.deadline() {
            Some(d) if now >= d => Err(CloseError::new(
                DisconnectReasonCode::KeepAliveTimeout,
                "keep-alive timeout",
            )),
            _ => Ok(()),
        }
    }

    /// Handles one decoded packet from the client.
    pub fn handle(&mut self, now: u64, decoded: codec::Decoded) -> Result<(), CloseError> {
        self.reserve_hinted();
        match decoded {
            codec::Decoded::Packet(p) => self.handle_packet(now, p),
            codec::Decoded::Subscribe(s) => {
                self.last_rx = now;
                if self.disconnected {
                    return Err(CloseError::protocol("packet after DISCONNECT"));
                }
                self.on_subscribe(s);
                Ok(())
            }
        }
    }

    /// Handles one packet from the client.
    pub fn handle_packet(&mut self, now: u64, packet: v5::Packet) -> Result<(), CloseError> {
        self.last_rx = now;
        if self.disconnected {
            return Err(CloseError::protocol("packet after DISCONNECT"));
        }
        match packet {
            v5::Packet::Connect(_) => return Err(CloseError::protocol("second CONNECT")),
            v5::Packet::Publish(p) => self.on_publish(now, p)?,
            v5::Packet::Puback(a) => {
                let outbound = self.rare.as_deref_mut().map(|r| &mut r.outbound);
                if let Some(outbound) = outbound
                    && outbound
                        .get(&a.pid.value())
                        .is_some_and(|f| f.qos == QoS::Level1)
                {
                    let f = outbound.remove(&a.pid.value());
                    self.ack_core(f.and_then(|f| f.tag));
                    self.send_waiting();
                }
            }
            v5::Packet::Pubrec(a) => {
                let pid = a.pid.value();
                let outbound = self.rare.as_deref_mut().map(|r| &mut r.outbound);
                match outbound.and_then(|o| o.get_mut(&pid)) {
                    Some(f) if f.qos == QoS::Level2 => {
                        // The client owns the message now: ack the core so a reconnect does
                        // not send it again, and remember the id to resend PUBREL.
                        let tag = f.tag.take();
                        if (a.reason_code as u8) >= 0x80 {
                            self.rare().outbound.remove(&pid);
                            self.ack_core(tag);
                            self.send_waiting();
                        } else {
                            f.released = true;
                            self.ack_core(tag);
                            self.out
                                .push_packet(v5::Packet::Pubrel(v5::Pubrel::new_success(a.pid)));
                        }
                    }
                    _ => self.out.push_packet(v5::Packet::Pubrel(v5::Pubrel::new(
                        a.pid,
                        v5::PubrelReasonCode::PacketIdentifierNotFound,
                    ))),
                }
            }
            v5::Packet::Pubrel(r) => {
                let released = self
                    .rare
                    .as_deref_mut()
                    .is_some_and(|rare| rare.inbound_qos2.remove(&r.pid.value()));
                let code = if released {
                    PubcompReasonCode::Success
                } else {
                    PubcompReasonCode::PacketIdentifierNotFound
                };
                self.out
                    .push_packet(v5::Packet::Pubcomp(v5::Pubcomp::new(r.pid, code)));
            }
            v5::Packet::Pubcomp(c) => {
                let outbound = self.rare.as_deref_mut().map(|r| &mut r.outbound);
                if let Some(outbound) = outbound
                    && outbound.get(&c.pid.value()).is_some_and(|f| f.released)
                {
                    outbound.remove(&c.pid.value());
                    self.send_waiting();
                }
            }
            v5::Packet::Subscribe(s) => self.on_subscribe(s.into()),
            v5::Packet::Unsubscribe(u) => self.on_unsubscribe(u),
            v5::Packet::Pingreq => self.out.push_packet(v5::Packet::Pingresp),
            v5::Packet::Disconnect(d) => {
                if let Some(e) = d.properties.session_expiry_interval {
                    if self.session_expiry_s == 0 && e != 0 {
                        // MQTT-3.14.2-2.
                        return Err(CloseError::protocol(
                            "session expiry set on DISCONNECT after 0 at CONNECT",
                        ));
                    }
                    self.session_expiry_s = e;
                }
                if d.reason_code != DisconnectReasonCode::DisconnectWithWillMessage {
                    self.will = None;
                }
                self.disconnected = true;
            }
            v5::Packet::Auth(_) => {
                return Err(CloseError::protocol(
                    "AUTH is not supported (no authentication method was accepted)",
                ));
            }
            v5::Packet::Connack(_)
            | v5::Packet::Suback(_)
            | v5::Packet::Unsuback(_)
            | v5::Packet::Pingresp => {
                return Err(CloseError::protocol(
                    "server-to-client packet from a client",
                ));
            }
        }
        Ok(())
    }

    /// A `$delayed` publish of a bad form: dropped with one `warn` line; an MQTT 5 client
    /// is told (0x90 Topic Name invalid), a 3.1.1 one gets the normal acknowledgement (the
    /// only answer besides closing), as for a refused publish.
    fn refuse_delayed(&mut self, p: &v5::Publish, why: String) -> Result<(), CloseError> {
        tracing::warn!(
            client_id = %warren_core::escape::Escaped(&self.client_id),
            topic = %warren_core::escape::Escaped(&p.topic_name),
            reason = %warren_core::escape::Escaped(&why),
            "MQTT $delayed publish refused"
        );
        match (p.qos_pid, self.level == 5) {
            (QosPid::Level0, _) => {}
            (QosPid::Level1(pid), true) => self.out.push_packet(v5::Packet::Puback(
                v5::Puback::new(pid, PubackReasonCode::TopicNameInvalid),
            )),
            (QosPid::Level1(pid), false) => self
                .out
                .push_packet(v5::Packet::Puback(v5::Puback::new_success(pid))),
            (QosPid::Level2(pid), true) => self.out.push_packet(v5::Packet::Pubrec(
                v5::Pubrec::new(pid, PubrecReasonCode::TopicNameInvalid),
            )),
            (QosPid::Level2(pid), false) => {
                self.rare().inbound_qos2.insert(pid.value());
                self.out
                    .push_packet(v5::Packet::Pubrec(v5::Pubrec::new_success(pid)));
            }
        }
        Ok(())
    }

    fn on_publish(&mut self, now: u64, mut p: v5::Publish) -> Result<(), CloseError> {
        if let Some(alias) = p.properties.topic_alias.take() {
            if alias == 0 || alias > self.config.topic_alias_max {
                return Err(CloseError::new(
                    DisconnectReasonCode::TopicAliasInvalid,
                    format!("topic alias {alias} out of range"),
                ));
            }
            let aliases = &mut self.rare().aliases;
            if p.topic_name.is_empty() {
                p.topic_name = aliases
                    .get(&alias)
                    .cloned()
                    .ok_or_else(|| CloseError::protocol(format!("unknown topic alias {alias}")))?;
            } else {
                aliases.insert(alias, p.topic_name.clone());
            }
        }
        if let Err(e) = validate_topic(&p.topic_name) {
            return Err(CloseError::new(
                DisconnectReasonCode::TopicNameInvalid,
                format!("PUBLISH topic: {e}"),
            ));
        }
        // `$delayed/{seconds}/{topic}` (EMQX): published to the topic when due.
        let mut delay_ms = None;
        if let Some(parsed) = convert::delayed(&p.topic_name) {
            match parsed.map(|(s, t)| (s, convert::topic_name(t))) {
                Ok((secs, Ok(topic))) => {
                    p.topic_name = topic;
                    delay_ms = (secs > 0).then_some(secs * 1000);
                }
                Ok((_, Err(e))) => return self.refuse_delayed(&p, format!("{e}")),
                Err(e) => return self.refuse_delayed(&p, e),
            }
            if p.retain {
                // Retained when due would be EMQX's; Warren keeps retained messages at
                // publish time, so a delayed one is not retained (docs/delayed.md).
                p.retain = false;
            }
        }
        let qos = p.qos_pid.qos();
        if p.properties.payload_is_utf8 == Some(true) && std::str::from_utf8(&p.payload).is_err() {
            // MQTT 5 3.3.2.3.2: refuse it with 0x99 where there is an ack to carry it.
            match p.qos_pid {
                QosPid::Level0 => {
                    return Err(CloseError::new(
                        DisconnectReasonCode::PayloadFormatInvalid,
                        "payload announced as UTF-8 is not",
                    ));
                }
                QosPid::Level1(pid) => self.out.push_packet(v5::Packet::Puback(v5::Puback::new(
                    pid,
                    PubackReasonCode::PayloadFormatInvalid,
                ))),
                QosPid::Level2(pid) => self.out.push_packet(v5::Packet::Pubrec(v5::Pubrec::new(
                    pid,
                    PubrecReasonCode::PayloadFormatInvalid,
                ))),
            }
            return Ok(());
        }
        if !self.may_publish(&p.topic_name) {
            // As RabbitMQ's MQTT plugin with `mqtt.disconnect_on_unauthorized = false`: the
            // connection stays, the message is dropped, and only an MQTT 5 client is told
            // (0x87); a 3.1.1 client gets the normal acknowledgement, the one answer 3.1.1
            // allows besides closing (MQTT-3.3.5-2).
            tracing::warn!(
                client_id = %warren_core::escape::Escaped(&self.client_id),
                topic = %warren_core::escape::Escaped(&p.topic_name),
                "MQTT publish refused: not authorized"
            );
            match (p.qos_pid, self.level == 5) {
                (QosPid::Level0, _) => {}
                (QosPid::Level1(pid), true) => self.out.push_packet(v5::Packet::Puback(
                    v5::Puback::new(pid, PubackReasonCode::NotAuthorized),
                )),
                (QosPid::Level1(pid), false) => self
                    .out
                    .push_packet(v5::Packet::Puback(v5::Puback::new_success(pid))),
                (QosPid::Level2(pid), true) => self.out.push_packet(v5::Packet::Pubrec(
                    v5::Pubrec::new(pid, PubrecReasonCode::NotAuthorized),
                )),
                (QosPid::Level2(pid), false) => {
                    // Its PUBREL then finds it and gets PUBCOMP, as for a delivered one.
                    self.rare().inbound_qos2.insert(pid.value());
                    self.out
                        .push_packet(v5::Packet::Pubrec(v5::Pubrec::new_success(pid)));
                }
            }
            return Ok(());
        }
        // A tab link's resend of a message already accepted: acknowledged, not routed again.
        let link_key = match p.qos_pid {
            QosPid::Level1(pid) if self.level == 5 => {
                let key = self.config.link_dedup.key(&p.properties);
                if let Some(k) = key
                    && self.config.link_dedup.seen(&self.client_id, k)
                {
                    self.out
                        .push_packet(v5::Packet::Puback(v5::Puback::new_success(pid)));
                    return Ok(());
                }
                key
            }
            _ => None,
        };
        // A QoS 2 publish awaiting its confirm is already in `inbound_qos2` (from PUBLISH
        // to PUBREL): counting its pending PUBREC too halved the window (a publisher with
        // 1000 in flight, under the 1024 announced, was disconnected).
        let max_inflight = usize::from(self.config.max_inflight);
        // Read without allocating `Rare`: a QoS 0 publisher never needs it.
        let in_flight = self
            .rare
            .as_deref()
            .map_or(0, |r| r.inbound_qos2.len() + r.pending_pubacks as usize);
        if qos != QoS::Level0 && in_flight >= max_inflight {
            return Err(CloseError::new(
                DisconnectReasonCode::ReceiveMaximumExceeded,
                "more unacknowledged QoS 1/2 publishes than Receive Maximum",
            ));
        }
        let ack = match p.qos_pid {
            QosPid::Level0 => PendingAck::None,
            QosPid::Level1(pid) => PendingAck::Puback(pid),
            QosPid::Level2(pid) => {
                if !self.rare().inbound_qos2.insert(pid.value()) {
                    // A resend of a message already routed: exactly once means not again.
                    self.out
                        .push_packet(v5::Packet::Pubrec(v5::Pubrec::new_success(pid)));
                    return Ok(());
                }
                PendingAck::Pubrec(pid)
            }
        };
        let publisher = self.stamp_publisher.then_some(&self.client_id);
        let mut publish = convert::to_core(
            &p.topic_name,
            qos,
            p.retain,
            p.payload,
            &p.properties,
            now,
            publisher,
        );
        if let Some(ms) = delay_ms {
            convert::delay(&mut publish, now, ms);
        }
        let channel = if qos == QoS::Level0 {
            if !self.qos0_open {
                self.qos0_open = true;
                self.ops.push((QOS0_CHANNEL, Op::ChannelOpen));
            }
            QOS0_CHANNEL
        } else {
            CHANNEL
        };
        if p.retain {
            // Before the publish: the core answers it first, so the PUBACK (after the
            // publish's confirm) means new subscribers get the message.
            let retain = retain_op(
                &p.topic_name,
                qos,
                &publish,
                p.properties.message_expiry_interval,
            );
            self.ops.push((channel, retain));
        }
        self.ops.push((channel, Op::Publish(Box::new(publish))));
        self.published = true;
        if channel == CHANNEL {
            if let Some(key) = link_key {
                self.config.link_dedup.accept(&self.client_id, key);
            }
            let rare = self.rare();
            if let Some(key) = link_key {
                rare.link_ids.push(rare.confirm_next, key);
            }
            rare.push_confirm(ack);
        }
        Ok(())
    }

    /// Declares and consumes the session's queue if it has none yet: the `mqtt-qos0` one
    /// when `qos0_only` (the subscription that asks for it is QoS 0) and the session is
    /// clean, else the classic one.
    fn ensure_queue(&mut self, qos0_only: bool) {
        if self.queue_ready {
            return;
        }
        self.queue_ready = true;
        self.dirty = true;
        if std::mem::take(&mut self.purge_queue) {
            // What a crash or an earlier persistent session left under the classic name.
            self.ops.push((
                CHANNEL,
                Op::QueueDelete {
                    queue: session_queue(&self.client_id),
                    if_unused: false,
                    if_empty: false,
                    nowait: true,
                },
            ));
        }
        self.direct = qos0_only && !self.queue_durable && !self.persistent;
        let (arguments, tag) = if self.direct {
            let mut t = FieldTable::new();
            t.insert("x-queue-type".into(), FieldValue::string("mqtt-qos0"));
            (t, QOS0_TAG)
        } else {
            (FieldTable::new(), CONSUMER_TAG)
        };
        self.ops.push((
            CHANNEL,
            Op::QueueDeclare(QueueDeclare {
                queue: self.queue(),
                passive: false,
                durable: self.queue_durable,
                exclusive: !self.queue_durable,
                auto_delete: false,
                nowait: true,
                arguments,
            }),
        ));
        self.ops.push((
            CHANNEL,
            Op::Consume(Consume {
                queue: self.queue(),
                consumer_tag: tag.to_string(),
                no_local: false,
                no_ack: self.direct,
                exclusive: false,
                nowait: true,
                arguments: FieldTable::new(),
            }),
        ));
    }

    /// A QoS 1 or 2 subscription on a session served by its `mqtt-qos0` queue: the
    /// session moves to the classic queue, with every filter bound again there. The
    /// `mqtt-qos0` queue goes (its consumer cancelled first, so its deletion does not
    /// read as an operator's); its deliveries still on the way are sent as they come.
    /// Applied in one turn of the broker, so a publish reaches one of the two queues.
    fn leave_direct(&mut self) {
        if !self.direct {
            return;
        }
        self.ops.push((
            CHANNEL,
            Op::Cancel {
                consumer_tag: QOS0_TAG.to_string(),
                nowait: true,
            },
        ));
        self.ops.push((
            CHANNEL,
            Op::QueueDelete {
                queue: self.queue(),
                if_unused: false,
                if_empty: false,
                nowait: true,
            },
        ));
        self.direct = false;
        self.queue_ready = false;
        self.ensure_queue(false);
        let plain: Vec<Arc<str>> = self
            .subs
            .keys()
            .filter(|f| !f.starts_with("$share/"))
            .cloned()
            .collect();
        for filter in plain {
            let bind = self.bind_op(&filter);
            self.ops.push((CHANNEL, Op::QueueBind(bind)));
        }
    }

    fn bind_op(&self, filter: &str) -> Bind {
        Bind {
            destination: self.queue(),
            source: EXCHANGE.to_string(),
            routing_key: filter_to_amqp_pattern(filter),
            nowait: true,
            arguments: FieldTable::new(),
        }
    }

    /// Whether the user may subscribe through `queue`: declare it (configure), bind it (write)
    /// to `amq.topic` (read), as the core checks them. Answered in the SUBACK (0x80 in 3.1.1,
    /// 0x87 in MQTT 5) rather than by the core's 403, which would close the connection after
    /// a granted SUBACK. Permissions are those of the login (RabbitMQ's MQTT plugin caches
    /// them per connection too); the core still checks every operation.
    ///
    /// The filter's topic permission (read, on its AMQP binding key: `a/+/#` is checked as
    /// `a.*.#`, as RabbitMQ's MQTT plugin checks it) is answered the same way, filter by
    /// filter, as RabbitMQ with `mqtt.disconnect_on_unauthorized = false`.
    fn may_subscribe(&self, queue: &str, filter: &str) -> bool {
        self.permissions.as_ref().is_none_or(|p| {
            p.allows(Perm::Read, EXCHANGE)
                && p.allows(Perm::Configure, queue)
                && p.allows(Perm::Write, queue)
                && (!p.has_topic_permissions()
                    || p.topic_allows(Perm::Read, EXCHANGE, &filter_to_amqp_pattern(filter)))
        })
    }

    /// Whether the user's topic permission lets it unbind `filter` (read, as a bind).
    fn may_unbind(&self, filter: &str) -> bool {
        self.permissions.as_ref().is_none_or(|p| {
            !p.has_topic_permissions()
                || p.topic_allows(Perm::Read, EXCHANGE, &filter_to_amqp_pattern(filter))
        })
    }

    /// Whether the user may publish to `topic`: write on the exchange and the topic's
    /// permission (write, on its AMQP routing key), as RabbitMQ's `check_publish_permitted`.
    fn may_publish(&self, topic: &str) -> bool {
        self.permissions.as_ref().is_none_or(|p| {
            p.allows(Perm::Write, EXCHANGE)
                && (!p.has_topic_permissions()
                    || p.topic_allows(
                        Perm::Write,
                        EXCHANGE,
                        &warren_core::mqtt::topic_to_amqp_key(topic),
                    ))
        })
    }

    /// Handles a SUBSCRIBE (filters `mqtt-proto` found invalid arrive as `None`).
    pub fn on_subscribe(&mut self, s: codec::Subscribe) {
        let sub_id = s.subscription_id;
        let ops_start = self.ops.len();
        let mut codes = Vec::with_capacity(s.entries.len());
        for (filter, mut opts) in s.entries {
            if self.bridge {
                // Mosquitto's rule for a bridge: its own publishes are not sent back to it
                // (the loop a bridge would make), and retain flags pass as published.
                opts.no_local = true;
                opts.retain_as_published = true;
            }
            let Some(filter) = filter else {
                codes.push(SubscribeReasonCode::TopicFilterInvalid);
                continue;
            };
            let plain = match validate_filter(&filter) {
                Ok((None, plain)) => plain,
                Ok((Some(group), plain)) => {
                    let queue = shared_queue(group, plain);
                    if queue.len() > 255 {
                        codes.push(SubscribeReasonCode::QuotaExceeded);
                        continue;
                    }
                    if !self.may_subscribe(&queue, plain) {
                        codes.push(SubscribeReasonCode::NotAuthorized);
                        continue;
                    }
                    let key: Arc<str> = Arc::from(&*filter);
                    let opts = SubOpts {
                        qos: opts.max_qos,
                        no_local: false,
                        retain_as_published: opts.retain_as_published,
                        retain_handling: opts.retain_handling as u8,
                        id: sub_id,
                    };
                    let qos = opts.qos;
                    if self.subs.insert(key.clone(), opts).is_none() {
                        self.join_share(&key, queue);
                    }
                    // No retained messages for shared subscriptions (MQTT 5, 4.8.2).
                    codes.push(granted_code(qos));
                    continue;
                }
                Err(_) => {
                    codes.push(SubscribeReasonCode::TopicFilterInvalid);
                    continue;
                }
            };
            // The queue this subscription will be served by.
            let direct = opts.max_qos == QoS::Level0
                && if self.queue_ready {
                    self.direct
                } else {
                    !self.queue_durable && !self.persistent
                };
            let queue = if direct {
                session_qos0_queue(&self.client_id)
            } else {
                session_queue(&self.client_id)
            };
            if !self.may_subscribe(&queue, plain) {
                codes.push(SubscribeReasonCode::NotAuthorized);
                continue;
            }
            if opts.max_qos == QoS::Level0 {
                self.ensure_queue(true);
            } else {
                self.ensure_queue(false);
                self.leave_direct();
            }
            let key: Arc<str> = Arc::from(plain);
            let existed = self
                .subs
                .insert(
                    key,
                    SubOpts {
                        qos: opts.max_qos,
                        no_local: opts.no_local,
                        retain_as_published: opts.retain_as_published,
                        retain_handling: opts.retain_handling as u8,
                        id: sub_id,
                    },
                )
                .is_some();
            if !existed {
                let bind = self.bind_op(plain);
                self.ops.push((CHANNEL, Op::QueueBind(bind)));
            }
            self.stamp_publisher |= opts.no_local;
            codes.push(granted_code(opts.max_qos));
            let send = match opts.retain_handling {
                RetainHandling::SendAtSubscribe => true,
                RetainHandling::SendAtSubscribeIfNotExist => !existed,
                RetainHandling::DoNotSend => false,
            };
            if send {
                // After the bind: a message published in between comes twice (retained and
                // routed) rather than not at all. Answered in order, after the SUBACK is
                // queued (`on_retained`).
                let max = u32::try_from(self.config.max_retained_per_subscribe).unwrap_or(u32::MAX);
                self.ops.push((
                    CHANNEL,
                    Op::RetainedGet {
                        filter: plain.to_string(),
                        max,
                    },
                ));
                self.pending
                    .get_or_insert_with(Box::default)
                    .retained_gets
                    .push_back((sub_id, opts.max_qos));
            }
        }
        // The SUBACK promises that what others publish from now on reaches the subscription.
        // Other connections route their publishes on the broker's published routing table,
        // which holds a bind only once the broker applied it, and the binds above are only
        // sent, not applied, when the connection writes its packets: so the last bind asks for
        // a bind-ok, and the SUBACK (with everything queued after it) waits for that reply.
        let last_bind = self.ops[ops_start..]
            .iter_mut()
            .rev()
            .find_map(|(_, op)| match op {
                Op::QueueBind(b) => Some(b),
                _ => None,
            });
        if let Some(bind) = last_bind {
            bind.nowait = false;
            let at = self.out.len();
            self.pending
                .get_or_insert_with(Box::default)
                .subacks
                .push_back(at);
        }
        self.dirty = true;
        self.out
            .push_packet(v5::Packet::Suback(v5::Suback::new(s.pid, codes)));
    }

    /// The core's answer to the oldest `Op::RetainedGet`: its messages go out after the
    /// SUBACK (queued before the request was answered), with the retain flag, at the lower
    /// of their QoS and the subscription's.
    fn on_retained(&mut self, now: u64, messages: Vec<RetainedMessage>) {
        let Some((sub_id, granted)) = self
            .pending
            .as_deref_mut()
            .and_then(|p| p.retained_gets.pop_front())
        else {
            return;
        };
        self.drop_pending_if_done();
        for m in messages {
            let message = Message {
                exchange: Arc::from(EXCHANGE),
                routing_key: Arc::from(warren_core::mqtt::topic_to_amqp_key(&m.topic)),
                properties: m.properties,
                body: m.payload,
            };
            let Some(o) = convert::from_core(&message, now) else {
                continue;
            };
            if o.expired {
                continue;
            }
            let mut props = o.properties;
            props.subscription_id = sub_id.and_then(|id| v5::VarByteInt::try_from(id).ok());
            let publish = v5::Publish {
                dup: false,
                // Messages sent because of a new subscription carry the retain flag.
                retain: true,
                qos_pid: QosPid::Level0,
                topic_name: o.topic,
                payload: message.body,
                properties: props,
            };
            self.send_publish(
                publish,
                Vec::new(),
                qos_from((m.qos).min(granted as u8)),
                None,
            );
        }
    }

    fn on_unsubscribe(&mut self, u: v5::Unsubscribe) {
        let mut codes = Vec::with_capacity(u.topics.len());
        for filter in u.topics {
            if !filter.is_shared() && self.subs.get(&filter).is_some() && !self.may_unbind(&filter)
            {
                // A subscription of an earlier connection that its topic permission now
                // refuses: the core would refuse the unbind (403, closing the connection).
                // RabbitMQ answers 0x87 and keeps it (3.1.1 has no code to carry).
                codes.push(UnsubscribeReasonCode::NotAuthorized);
                continue;
            }
            if self.subs.remove(&filter).is_some() {
                if filter.is_shared() {
                    // The group's queue is auto-delete: it goes with its last member.
                    self.ops.push((
                        CHANNEL,
                        Op::Cancel {
                            consumer_tag: filter.to_string(),
                            nowait: true,
                        },
                    ));
                } else {
                    let bind = self.bind_op(&filter);
                    self.ops.push((CHANNEL, Op::QueueUnbind(bind)));
                }
                codes.push(UnsubscribeReasonCode::Success);
            } else {
                codes.push(UnsubscribeReasonCode::NoSubscriptionExisted);
            }
        }
        self.dirty = true;
        self.out
            .push_packet(v5::Packet::Unsuback(v5::Unsuback::new(u.pid, codes)));
    }

    /// Handles one effect the core addressed to this connection.
    pub fn handle_effect(&mut self, now: u64, effect: Effect) -> Result<(), CloseError> {
        self.reserve_hinted();
        match effect {
            Effect::Deliver {
                delivery,
                consumer_tag,
                ..
            } => {
                self.delivered += 1;
                if &*consumer_tag == CONSUMER_TAG {
                    let tag = delivery.delivery_tag;
                    self.on_deliver(now, delivery, Some(tag));
                } else if &*consumer_tag == QOS0_TAG {
                    self.on_deliver(now, delivery, None);
                } else {
                    self.on_shared_deliver(now, &consumer_tag, delivery);
                }
            }
            Effect::Confirm {
                seq, multiple, ack, ..
            } => self.on_confirm(seq, multiple, ack)?,
            Effect::ChannelError { error, .. } | Effect::ConnectionError { error, .. } => {
                // A permission refusal (403) closes the connection as "not authorized", as
                // RabbitMQ's MQTT plugin does on a denied publish or subscribe.
                let reason = if error.code == warren_core::error::ErrorCode::AccessRefused {
                    DisconnectReasonCode::NotAuthorized
                } else {
                    DisconnectReasonCode::ImplementationSpecificError
                };
                return Err(CloseError::new(
                    reason,
                    format!("broker error {}: {}", error.code.code(), error.text),
                ));
            }
            Effect::ConsumerCancelled { .. } => {
                return Err(CloseError::new(
                    DisconnectReasonCode::AdministrativeAction,
                    "the session queue was deleted",
                ));
            }
            Effect::FlowPaused { .. } => self.paused = true,
            Effect::FlowResumed { .. } => self.paused = false,
            Effect::Blocked { .. } => self.blocked = true,
            Effect::Unblocked { .. } => self.blocked = false,
            Effect::Reply {
                ch,
                reply: Reply::QueueBindOk,
            } if ch.channel == CHANNEL => self.release_suback(),
            Effect::Reply {
                ch,
                reply: Reply::Retained { messages },
            } if ch.channel == CHANNEL => self.on_retained(now, messages),
            Effect::Reply {
                reply: Reply::RetainOk { stored: false },
                ..
            } => tracing::warn!(
                client_id = %warren_core::escape::Escaped(&self.client_id),
                "the vhost holds as many retained messages as it may (max_retained_messages/bytes): \
                 this retained publish was routed but not retained"
            ),
            Effect::Reply { .. } | Effect::Return { .. } => {}
        }
        Ok(())
    }

    /// The core's answer to QoS 1/2 publishes up to (or at) `seq`: their PUBACKs and
    /// PUBRECs, with a reason code in MQTT 5. MQTT 3.1.1 has no negative acknowledgement,
    /// and a positive one for a message the broker did not take would lose it (the client
    /// drops its copy): the connection is closed instead, without the ack, as RabbitMQ 3.10's
    /// MQTT plugin does on a nack (checked: a QoS 1 publish to a full `reject-publish`
    /// queue gets no PUBACK and the connection ends). The client resends the publish
    /// after it reconnects (MQTT-4.4.0-1, when its session is kept) and in any case learns
    /// that it was not acknowledged. Withholding the ack while staying connected would
    /// hold the client's in-flight slot until a reconnect that nothing prompts.
    fn on_confirm(&mut self, seq: u64, multiple: bool, ack: bool) -> Result<(), CloseError> {
        let v5 = self.level == 5;
        let Some(rare) = self.rare.as_deref_mut() else {
            return Ok(());
        };
        rare.link_ids
            .settle(seq, multiple, ack, &self.config.link_dedup, &self.client_id);
        let confirms = &mut rare.confirms;
        // Settled one at a time, in order: no list per confirm (one allocation per QoS 1
        // publish when this collected them first).
        loop {
            let a = if multiple {
                match confirms.front() {
                    Some((s, _)) if *s <= seq => confirms.pop_front(),
                    _ => None,
                }
            } else if confirms.front().is_some_and(|(s, _)| *s == seq) {
                // The core confirms in publish order: the front, nearly always.
                confirms.pop_front()
            } else {
                confirms
                    .iter()
                    .position(|(s, _)| *s == seq)
                    .and_then(|i| confirms.remove(i))
            };
            let Some((_, a)) = a else { break };
            if !ack && !v5 && !matches!(a, PendingAck::None) {
                return Err(CloseError::new(
                    DisconnectReasonCode::ImplementationSpecificError,
                    "a QoS 1/2 publish was not taken by its queues (refused or unavailable); \
                     MQTT 3.1.1 has no negative acknowledgement, so the connection is closed \
                     without acknowledging it",
                ));
            }
            match a {
                PendingAck::None => {}
                PendingAck::Puback(pid) => {
                    rare.pending_pubacks = rare.pending_pubacks.saturating_sub(1);
                    let code = if ack {
                        PubackReasonCode::Success
                    } else {
                        PubackReasonCode::UnspecifiedError
                    };
                    self.out
                        .push_packet(v5::Packet::Puback(v5::Puback::new(pid, code)));
                }
                PendingAck::Pubrec(pid) => {
                    let code = if ack {
                        PubrecReasonCode::Success
                    } else {
                        rare.inbound_qos2.remove(&pid.value());
                        PubrecReasonCode::UnspecifiedError
                    };
                    self.out
                        .push_packet(v5::Packet::Pubrec(v5::Pubrec::new(pid, code)));
                }
            }
            if !multiple {
                break;
            }
        }
        Ok(())
    }

    /// Acknowledges a delivery to the core. While no earlier delivery of the channel is held
    /// (a QoS 1/2 message in flight or waiting for a packet id: `Rare::held_tags`), every
    /// delivery up to this one has been acknowledged, so the ack is deferred and merged with
    /// the following ones into one multiple ack (sent by `take_ops`): a subscriber's PUBACKs
    /// in order cost the core one settle per read, not one per message. Otherwise it goes
    /// alone, after the merged one, so that a multiple ack never covers a held delivery.
    fn ack_core(&mut self, tag: Option<u64>) {
        let Some(delivery_tag) = tag else {
            return;
        };
        if delivery_tag <= self.ack_upto {
            // Covered by the pending multiple ack.
            return;
        }
        let held = match self.rare.as_deref_mut() {
            Some(r) => {
                r.release(delivery_tag);
                r.held_tags
                    .front()
                    .is_some_and(|&oldest| oldest < delivery_tag)
            }
            None => false,
        };
        if !held {
            self.ack_upto = delivery_tag;
            return;
        }
        self.flush_acks();
        self.ops.push((
            CHANNEL,
            Op::Ack {
                delivery_tag,
                multiple: false,
            },
        ));
    }

    /// Sends the deferred multiple ack, if any.
    fn flush_acks(&mut self) {
        if self.ack_upto > 0 {
            self.ops.push((
                CHANNEL,
                Op::Ack {
                    delivery_tag: std::mem::take(&mut self.ack_upto),
                    multiple: true,
                },
            ));
        }
    }

    /// A delivery from the session's queue; `tag`: the delivery tag to ack (`None` for
    /// the `mqtt-qos0` queue's, which come without acks).
    fn on_deliver(&mut self, now: u64, d: Delivery, tag: Option<u64>) {
        let Some(o) = convert::from_core(&d.message, now) else {
            self.ack_core(tag);
            return;
        };
        let own = self.stamp_publisher && convert::publisher(&d.message) == Some(&*self.client_id);
        let mut granted: Option<QoS> = None;
        let mut rap = false;
        // One copy for all the matching subscriptions, carrying each one's identifier
        // (MQTT-3.3.4-3/-5); with one match (the usual case) nothing is allocated.
        let mut sub_id = None;
        let mut more_sub_ids = Vec::new();
        for (filter, opts) in &self.subs {
            if filter.starts_with("$share/") || !matches(filter, &o.topic) || (own && opts.no_local)
            {
                continue;
            }
            granted = Some(granted.map_or(opts.qos, |g| g.max(opts.qos)));
            rap |= opts.retain_as_published;
            if let Some(id) = opts.id {
                if sub_id.is_none() {
                    sub_id = Some(id);
                } else if sub_id != Some(id) && !more_sub_ids.contains(&id) {
                    more_sub_ids.push(id);
                }
            }
        }
        let Some(granted) = granted else {
            // Unsubscribed meanwhile, or only no-local subscriptions match its own message.
            self.ack_core(tag);
            return;
        };
        if o.expired {
            self.ack_core(tag);
            return;
        }
        let mut props = o.properties;
        props.subscription_id = sub_id.and_then(|id| v5::VarByteInt::try_from(id).ok());
        let publish = v5::Publish {
            dup: d.redelivered,
            retain: rap && o.retain,
            qos_pid: QosPid::Level0,
            topic_name: o.topic,
            payload: d.message.body.clone(),
            properties: props,
        };
        self.send_publish(publish, more_sub_ids, o.qos.min(granted), tag);
    }

    /// Joins a share group: its queue (auto-delete, shared by the group's members, who get its
    /// messages round-robin) bound like a plain subscription, consumed under the full filter
    /// as consumer tag.
    fn join_share(&mut self, filter: &Arc<str>, queue: String) {
        let plain = match validate_filter(filter) {
            Ok((Some(_), plain)) => plain.to_string(),
            _ => return,
        };
        self.ops.push((
            CHANNEL,
            Op::QueueDeclare(QueueDeclare {
                queue: queue.clone(),
                passive: false,
                durable: false,
                exclusive: false,
                auto_delete: true,
                nowait: true,
                arguments: FieldTable::new(),
            }),
        ));
        self.ops.push((
            CHANNEL,
            Op::QueueBind(Bind {
                destination: queue.clone(),
                source: EXCHANGE.to_string(),
                routing_key: filter_to_amqp_pattern(&plain),
                nowait: true,
                arguments: FieldTable::new(),
            }),
        ));
        self.ops.push((
            CHANNEL,
            Op::Consume(Consume {
                queue,
                consumer_tag: filter.to_string(),
                no_local: false,
                no_ack: false,
                exclusive: false,
                nowait: true,
                arguments: FieldTable::new(),
            }),
        ));
    }

    fn on_shared_deliver(&mut self, now: u64, filter: &str, d: Delivery) {
        let tag = d.delivery_tag;
        let (Some(opts), Some(o)) = (
            self.subs.get(filter).cloned(),
            convert::from_core(&d.message, now),
        ) else {
            self.ack_core(Some(tag));
            return;
        };
        let plain_matches =
            matches!(validate_filter(filter), Ok((_, plain)) if matches(plain, &o.topic));
        if !plain_matches || o.expired {
            self.ack_core(Some(tag));
            return;
        }
        let mut props = o.properties;
        props.subscription_id = opts.id.and_then(|id| v5::VarByteInt::try_from(id).ok());
        let publish = v5::Publish {
            dup: d.redelivered,
            retain: opts.retain_as_published && o.retain,
            qos_pid: QosPid::Level0,
            topic_name: o.topic,
            payload: d.message.body.clone(),
            properties: props,
        };
        self.send_publish(publish, Vec::new(), o.qos.min(opts.qos), Some(tag));
    }

    /// Sends a PUBLISH at `qos` (0: at once, acking the core; 1/2: under a packet id, or queued
    /// until one is free).
    fn send_publish(
        &mut self,
        mut publish: v5::Publish,
        more_sub_ids: Vec<u32>,
        qos: QoS,
        tag: Option<u64>,
    ) {
        if let Some(max) = self.client_max_packet {
            let out = codec::Out {
                packet: v5::Packet::Publish(publish.clone()),
                more_sub_ids: more_sub_ids.clone(),
            };
            let size = codec::out_len(&out, self.level);
            if size > max as usize {
                // MQTT-3.1.2-25: discard what the client said it cannot take.
                self.ack_core(tag);
                return;
            }
        }
        if qos == QoS::Level0 {
            publish.dup = false;
            self.push_publish(publish, more_sub_ids);
            self.ack_core(tag);
            return;
        }
        publish.qos_pid = match qos {
            QoS::Level1 => QosPid::Level1(Pid::default()),
            _ => QosPid::Level2(Pid::default()),
        };
        if let Some(tag) = tag {
            self.rare().hold(tag);
        }
        if self.rare().waiting.is_empty()
            && let Some(pid) = self.alloc_pid()
        {
            self.send_inflight(publish, more_sub_ids, pid, tag);
            return;
        }
        self.rare().waiting.push_back(Waiting {
            publish,
            more_sub_ids,
            tag,
        });
    }

    fn send_inflight(
        &mut self,
        mut publish: v5::Publish,
        more_sub_ids: Vec<u32>,
        pid: Pid,
        tag: Option<u64>,
    ) {
        let qos = publish.qos_pid.qos();
        publish.qos_pid = match qos {
            QoS::Level1 => QosPid::Level1(pid),
            _ => QosPid::Level2(pid),
        };
        self.rare().outbound.insert(
            pid.value(),
            Inflight {
                tag,
                qos,
                released: false,
            },
        );
        self.push_publish(publish, more_sub_ids);
    }

    /// Queues a PUBLISH, replacing its topic by an alias when the client takes aliases.
    fn push_publish(&mut self, mut p: v5::Publish, more_sub_ids: Vec<u32>) {
        let max = usize::from(self.out_alias_max);
        if max > 0 {
            let out_aliases = &mut self.rare().out_aliases;
            if let Some(&alias) = out_aliases.get(&p.topic_name) {
                p.properties.topic_alias = Some(alias);
                if let Ok(empty) = TopicName::try_from("") {
                    p.topic_name = empty;
                }
            } else if out_aliases.len() < max {
                let alias = out_aliases.len() as u16 + 1;
                out_aliases.insert(p.topic_name.clone(), alias);
                p.properties.topic_alias = Some(alias);
            }
        }
        self.out.push(codec::Out {
            packet: v5::Packet::Publish(p),
            more_sub_ids,
        });
    }

    fn send_waiting(&mut self) {
        while self.waiting_len() > 0 {
            let Some(pid) = self.alloc_pid() else { return };
            let Some(w) = self.rare().waiting.pop_front() else {
                return;
            };
            self.send_inflight(w.publish, w.more_sub_ids, pid, w.tag);
        }
    }

    /// A free packet id, if the client's Receive Maximum allows another message in flight.
    fn alloc_pid(&mut self) -> Option<Pid> {
        let max = usize::from(self.client_receive_max);
        let rare = self.rare();
        if rare.outbound.len() >= max {
            return None;
        }
        while let Some(id) = rare.resume_pids.pop_front() {
            if !rare.outbound.contains_key(&id) {
                return Pid::try_from(id).ok();
            }
        }
        // At most 65535 ids, fewer in use than that: the scan ends.
        for _ in 0..u16::MAX {
            let id = rare.next_pid;
            rare.next_pid = if id == u16::MAX { 1 } else { id + 1 };
            if !rare.outbound.contains_key(&id) {
                return Pid::try_from(id).ok();
            }
        }
        None
    }

    /// The DISCONNECT a v5 client gets when the server closes for `reason`.
    pub fn disconnect_packet(&self, reason: DisconnectReasonCode) -> Option<v5::Packet> {
        (self.level == 5).then(|| v5::Packet::Disconnect(v5::Disconnect::new(reason)))
    }

    /// Ends the session: publishes the will unless the client disconnected normally and
    /// returns what a persistent session keeps. The host then sends `Op::ConnectionClose`
    /// (once these ops are applied): the core puts unacked deliveries back in the queue.
    pub fn close(&mut self, now: u64) -> Option<SessionRecord> {
        if let Some(w) = self.will.take() {
            // MQTT 5 3.1.3.2.2: the will waits for its delay, or until the session ends if
            // that comes first; a clean session ends now.
            let delay = w.will.properties.delay_interval.unwrap_or(0);
            let ends = if self.persistent {
                self.session_expiry_s
            } else {
                0
            };
            let delay = delay.min(ends);
            if delay > 0 {
                self.rare().delayed_will = Some((delay, w));
            } else if !self.may_publish(&w.will.topic_name) {
                // Checked as any publish (RabbitMQ too): the core would refuse it.
                tracing::warn!(client_id = %warren_core::escape::Escaped(&self.client_id), "MQTT will refused: not authorized");
            } else {
                for op in will_ops(&w.will, now) {
                    self.ops.push((CHANNEL, op));
                }
                self.rare().push_confirm(PendingAck::None);
            }
        }
        if self.session_expiry_s == 0 {
            // The session ends with the connection (MQTT 5 3.1.2.11.2): an exclusive queue
            // goes with it in the core, a durable one (a resumed session) is deleted here.
            if self.queue_ready && self.queue_durable {
                self.ops.push((
                    CHANNEL,
                    Op::QueueDelete {
                        queue: self.queue(),
                        if_unused: false,
                        if_empty: false,
                        nowait: true,
                    },
                ));
            }
            return None;
        }
        let level = self.level;
        let will = self
            .rare
            .as_deref()
            .and_then(|r| r.delayed_will.as_ref())
            .map(|(delay, w)| StoredWill {
                due_at: now.saturating_add(u64::from(*delay) * 1000),
                user: w.user.to_string(),
                publish: encode_will(&w.will),
            });
        let rare = self.rare.as_deref_mut();
        let (awaiting_comp, outbound) = rare.as_ref().map_or_else(Default::default, |r| {
            let mut unacked: Vec<(u64, u16)> = r
                .outbound
                .iter()
                .filter_map(|(pid, f)| Some((f.tag?, *pid)))
                .collect();
            unacked.sort_unstable();
            (
                r.outbound
                    .iter()
                    .filter(|(_, f)| f.released)
                    .map(|(pid, _)| *pid)
                    .collect(),
                unacked.into_iter().map(|(_, pid)| pid).collect(),
            )
        });
        Some(SessionRecord {
            level,
            subs: std::mem::take(&mut self.subs),
            awaiting_comp,
            inbound_qos2: rare.map_or_else(BTreeSet::new, |r| std::mem::take(&mut r.inbound_qos2)),
            outbound,
            has_queue: self.queue_ready,
            expiry_s: self.session_expiry_s,
            stored_at: now,
            will,
        })
    }

    /// The session as stored while its client is connected, when it changed since last
    /// stored: `Some(Some(s))` store it, `Some(None)` remove the stored one (the session is
    /// not persistent), `None` nothing to do.
    pub fn take_stored(&mut self) -> Option<Option<StoredSession>> {
        if !std::mem::take(&mut self.dirty) {
            return None;
        }
        if self.session_expiry_s == 0 {
            return std::mem::take(&mut self.stored).then_some(None);
        }
        self.stored = true;
        Some(Some(StoredSession {
            level: self.level,
            expiry_s: self.session_expiry_s,
            disconnected_at: None,
            has_queue: self.queue_ready,
            subs: stored_subs(&self.subs),
            awaiting_comp: Vec::new(),
            inbound_qos2: Vec::new(),
            outbound: Vec::new(),
            will: None,
        }))
    }

    /// Whether a stored record exists for this session's client id.
    pub fn is_stored(&self) -> bool {
        self.stored
    }

    /// Outbound QoS 1/2 messages waiting for a packet id (the client's Receive Maximum).
    pub fn waiting_len(&self) -> usize {
        self.rare.as_ref().map_or(0, |r| r.waiting.len())
    }

    /// A will that [`Session::close`] left for later: (delay in seconds, will, the user to
    /// publish it as). The host publishes it after the delay unless the client id connects
    /// again meanwhile.
    pub fn take_delayed_will(&mut self) -> Option<(u32, v5::LastWill, String)> {
        let (delay, w) = self.rare.as_mut()?.delayed_will.take()?;
        let Will { will, user } = *w;
        Some((delay, will, user.into()))
    }
}

/// The `Op::Retain` of a retained publish (the core sets its time).
fn retain_op(
    topic: &str,
    qos: QoS,
    publish: &warren_core::command::Publish,
    expiry_s: Option<u32>,
) -> Op {
    Op::Retain {
        message: Box::new(RetainedMessage {
            topic: Arc::from(topic),
            qos: qos as u8,
            payload: publish.body.clone(),
            properties: publish.properties.clone(),
            stored_at: 0,
            expiry_ms: expiry_s.map(|s| u64::from(s) * 1000),
        }),
        durable: true,
    }
}

/// The core ops of a will: its retained copy first when it has the retain flag, then its
/// publish.
pub fn will_ops(w: &v5::LastWill, now: u64) -> Vec<Op> {
    let props = v5::PublishProperties {
        payload_is_utf8: w.properties.payload_is_utf8,
        message_expiry_interval: w.properties.message_expiry_interval,
        content_type: w.properties.content_type.clone(),
        response_topic: w.properties.response_topic.clone(),
        correlation_data: w.properties.correlation_data.clone(),
        user_properties: w.properties.user_properties.clone(),
        ..Default::default()
    };
    let publish = convert::to_core(
        &w.topic_name,
        w.qos,
        w.retain,
        w.payload.clone(),
        &props,
        now,
        None,
    );
    let mut ops = Vec::with_capacity(2);
    if w.retain {
        ops.push(retain_op(
            &w.topic_name,
            w.qos,
            &publish,
            props.message_expiry_interval,
        ));
    }
    ops.push(Op::Publish(Box::new(publish)));
    ops
}

#[cfg(test)]
mod tests {
    //! What a session keeps allocated once idle: the rarely used state and the per-SUBSCRIBE
    //! waits must not outlive their use (every idle connection would pay for them).
    use super::*;
    use bytes::Bytes;
    use mqtt_proto::{Protocol, TopicFilter};
    use warren_core::Broker;
    use warren_core::ids::{ChannelRef, ConnId};

    /// Feeds the session's ops to the core and the core's effects back until quiet.
    fn pump(broker: &mut Broker, s: &mut Session) {
        loop {
            let ops = s.take_ops();
            s.take_packets();
            if ops.is_empty() {
                return;
            }
            for (ch, op) in ops {
                broker.handle(1_000, ChannelRef::new(ConnId(1), ch), op);
            }
            let mut effects = Vec::new();
            broker.poll_effects(&mut effects);
            for e in effects {
                s.handle_effect(1_000, e).expect("no error");
            }
            s.flushed();
        }
    }

    fn session(config: &Arc<MqttConfig>) -> Session {
        let mut c = v5::Connect::new(Arc::from("idle"), 30);
        c.protocol = Protocol::V311;
        let info = check_connect(&c, true, config, || "gen".into()).expect("accepted");
        Session::new(info, None, 1_000, config.clone())
    }

    #[test]
    fn an_idle_subscriber_and_a_qos0_publisher_keep_no_rare_or_pending_state() {
        let config: Arc<MqttConfig> = Arc::new(Default::default());
        let mut broker = Broker::new(Default::default());
        let mut s = session(&config);
        pump(&mut broker, &mut s);
        let subscribe = v5::Packet::Subscribe(v5::Subscribe::new(
            Pid::try_from(1).expect("pid"),
            vec![(
                TopicFilter::try_from("idle/cmd").expect("filter"),
                v5::SubscriptionOptions {
                    max_qos: QoS::Level1,
                    no_local: false,
                    retain_as_published: false,
                    // Asks the core for retained messages: answered after the SUBACK.
                    retain_handling: v5::RetainHandling::SendAtSubscribe,
                },
            )],
        ));
        s.handle(1_000, codec::Decoded::Packet(subscribe))
            .expect("subscribe");
        assert!(s.pending.is_some(), "the SUBACK waits for its bind-ok");
        pump(&mut broker, &mut s);
        assert!(
            s.pending.is_none(),
            "bind-ok and retained answer freed the wait"
        );
        let publish = v5::Packet::Publish(v5::Publish::new(
            QosPid::Level0,
            TopicName::try_from("elsewhere").expect("topic"),
            Bytes::from_static(b"x"),
        ));
        s.handle(1_000, codec::Decoded::Packet(publish))
            .expect("publish");
        pump(&mut broker, &mut s);
        assert!(s.rare.is_none(), "no rarely used state allocated");
    }

    /// Feeds the ops to the core and its effects back, once; returns the packets.
    fn step(broker: &mut Broker, s: &mut Session, ops: Vec<(u16, Op)>) -> Vec<codec::Out> {
        for (ch, op) in ops {
            broker.handle(1_000, ChannelRef::new(ConnId(1), ch), op);
        }
        let mut effects = Vec::new();
        broker.poll_effects(&mut effects);
        for e in effects {
            s.handle_effect(1_000, e).expect("no error");
        }
        s.flushed();
        s.take_packets()
    }

    fn acks(ops: &[(u16, Op)]) -> Vec<(u64, bool)> {
        ops.iter()
            .filter_map(|(_, op)| match op {
                Op::Ack {
                    delivery_tag,
                    multiple,
                } => Some((*delivery_tag, *multiple)),
                _ => None,
            })
            .collect()
    }

    /// The packet and op lists' reservations stay under glibc's 64 KiB consolidation
    /// threshold however large the last batch was (a 1,024-entry packet list was 368 KiB),
    /// and still follow small batches.
    #[test]
    fn hinted_reservations_stay_under_64_kib() {
        for len in [0, 10, 100, 1_000, 100_000] {
            let out = usize::from(hint::<codec::Out>(len, 0));
            let ops = usize::from(hint::<(u16, Op)>(len, 0));
            assert!(
                out * std::mem::size_of::<codec::Out>() < 64 * 1024,
                "{len}: {out}"
            );
            assert!(
                ops * std::mem::size_of::<(u16, Op)>() < 64 * 1024,
                "{len}: {ops}"
            );
            assert_eq!(out, len.min(out), "{len}");
        }
        assert_eq!(hint::<codec::Out>(10, 0), 10);
        assert_eq!(
            hint::<codec::Out>(10, 100),
            50,
            "a small batch halves the hint"
        );
    }

    /// A subscriber's PUBACKs in delivery order reach the core as one multiple ack per read,
    /// though later deliveries are still in flight; one out of order goes alone, and the
    /// multiple ack that follows never covers a delivery still held.
    #[test]
    fn in_order_pubacks_settle_in_the_core_as_one_multiple_ack() {
        let config: Arc<MqttConfig> = Arc::new(Default::default());
        let mut broker = Broker::new(Default::default());
        let mut s = session(&config);
        pump(&mut broker, &mut s);
        let subscribe = v5::Packet::Subscribe(v5::Subscribe::new(
            Pid::try_from(1).expect("pid"),
            vec![(
                TopicFilter::try_from("t").expect("filter"),
                v5::SubscriptionOptions {
                    max_qos: QoS::Level1,
                    no_local: false,
                    retain_as_published: false,
                    retain_handling: v5::RetainHandling::DoNotSend,
                },
            )],
        ));
        s.handle(1_000, codec::Decoded::Packet(subscribe))
            .expect("subscribe");
        pump(&mut broker, &mut s);
        let mut delivered = Vec::new();
        for round in 0..2 {
            for i in 1..=10u16 {
                let publish = v5::Packet::Publish(v5::Publish::new(
                    QosPid::Level1(Pid::try_from(round * 10 + i).expect("pid")),
                    TopicName::try_from("t").expect("topic"),
                    Bytes::from_static(b"x"),
                ));
                s.handle(1_000, codec::Decoded::Packet(publish))
                    .expect("publish");
            }
            let mut ops = s.take_ops();
            // Until the deliveries and every confirm are back.
            for _ in 0..8 {
                for o in step(&mut broker, &mut s, ops) {
                    if let v5::Packet::Publish(p) = &o.packet
                        && let QosPid::Level1(pid) = p.qos_pid
                    {
                        delivered.push(pid);
                    }
                }
                ops = s.take_ops();
            }
            assert!(acks(&ops).is_empty());
            step(&mut broker, &mut s, ops);
        }
        assert_eq!(delivered.len(), 20, "every publish delivered back at QoS 1");
        // The first ten acked in order, the other ten in flight: one multiple ack.
        for pid in &delivered[..10] {
            s.handle(
                1_000,
                codec::Decoded::Packet(v5::Packet::Puback(v5::Puback::new_success(*pid))),
            )
            .expect("puback");
        }
        let ops = s.take_ops();
        let first = acks(&ops);
        assert_eq!(first.len(), 1, "one ack for ten PUBACKs: {first:?}");
        assert!(first[0].1, "a multiple ack");
        step(&mut broker, &mut s, ops);
        // The 12th before the 11th: it goes alone; then the rest merge again.
        let rest: Vec<Pid> = std::iter::once(delivered[11])
            .chain(std::iter::once(delivered[10]))
            .chain(delivered[12..].iter().copied())
            .collect();
        for pid in rest {
            s.handle(
                1_000,
                codec::Decoded::Packet(v5::Packet::Puback(v5::Puback::new_success(pid))),
            )
            .expect("puback");
        }
        let ops = s.take_ops();
        let second = acks(&ops);
        assert_eq!(second.len(), 2, "{second:?}");
        assert!(!second[0].1, "the out-of-order ack alone");
        assert!(second[1].1 && second[1].0 > second[0].0, "{second:?}");
        // The core took every ack (an unknown tag would be a channel error).
        step(&mut broker, &mut s, ops);
        assert!(s.rare.as_deref().is_some_and(|r| r.held_tags.is_empty()));
    }
}
