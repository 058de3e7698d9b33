//! The broker: one deterministic state machine over vhosts, exchanges, queues, connections,
//! channels and consumers, with RabbitMQ's semantics.
//!
//! `handle` applies one operation; effects accumulate until `poll_effects`. Topology (declares,
//! bindings, deletes) lives in `topology.rs`; the message path (publish, dispatch, acks, qos,
//! confirms, transactions) in `delivery.rs`; per-connection and per-channel state in
//! `session.rs`.
//!
//! Invariants (checked by `debug_assert!`s and the simulation tests):
//! - A message is in exactly one place per queue it was routed to: ready in the queue, or
//!   unacked on one channel, until acked or dropped.
//! - `QueueConsumer::unacked`, `ChannelState::consumer_unacked` and `QueueState::unacked`
//!   count exactly the unacked entries that reference them.
//! - Ids are never reused, so stale references (an unacked delivery of a deleted queue) are
//!   detected by a failed lookup, never aliased.

mod access;
pub mod admin;
mod credit;
mod dead_letter;
mod delivery;
mod hold;
mod post;
#[cfg(test)]
mod post_tests;
use crate::mail;
pub use crate::mail::ShardMail;
use credit::ChannelCredit;
mod policies;
mod reply_to;
mod session;

mod declare;
mod vhosts;

use crate::channel::conn::Conn;
use crate::channel::{ChannelState, Phase};
use crate::command::{Op, OpKind};
use crate::config::BrokerConfig;
use crate::effect::Effect;
use crate::error::{ErrorCode, ProtocolError};
use crate::idhash::IdMap;
use crate::ids::{ChannelAddr, ChannelRef, ConnId, QueueId, VhostId};
use crate::mail::mailbox::RESTORE_CONN;
use crate::naming::NameGen;
use crate::queue::state::{ConsumerId, QueueIo, QueueOut, QueueState};
use crate::store::{Definitions, Store};
use crate::topology::Topology;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

/// How long publishers stay blocked after the store failed a write, before the broker tries
/// again (the host logs the error; the core only knows that it happened).
const STORE_RETRY_MS: u64 = 5_000;

/// How long publishers stay blocked at least once an alarm blocked them, even if the
/// resource recovers sooner: bounds alarm changes to about one per second whatever the
/// traffic (RabbitMQ checks its memory on a timer, with the same effect).
pub const ALARM_HOLD_MS: u64 = 1_000;

/// How often a shard whose memory alarm is raised by the shared count looks at it again.
const ALARM_RECHECK_MS: u64 = 100;

/// Rounds of mail between shards a sharded restore carries after one op: each round is a
/// hop (declare -> create -> created -> declare-ok is three), so this only catches a loop.
const MAX_SETTLE_ROUNDS: usize = 1 << 16;

/// The broker state machine. See the module docs.
pub struct Broker {
    config: BrokerConfig,
    now: u64,
    names: NameGen,
    next_id: u64,
    /// The last vhost id issued (`insert_vhost`).
    next_vhost: u64,
    /// Vhosts, users, exchanges, bindings and the routing table (`topology.rs`).
    topo: Topology,
    // Records boxed: a hash table keeps up to half its slots empty after growing, and an
    // empty slot of a boxed map costs a pointer instead of a whole record (a queue is ~400
    // bytes); with one queue, channel and connection per idle MQTT client this matters.
    queues: IdMap<QueueId, Box<QueueState>>,
    conns: IdMap<ConnId, Box<Conn>>,
    channels: IdMap<ChannelRef, Box<ChannelState>>,
    effects: Vec<Effect>,
    /// Body bytes in the broker's custody, counted once per queue holding the message
    /// (ready or unacked). Drives the memory alarm.
    stored_bytes: u64,
    /// With shards: the body bytes of every shard, which the memory alarm compares with
    /// the watermark (`share_memory_count`).
    shared_bytes: Option<Arc<std::sync::atomic::AtomicU64>>,
    /// Publishers are blocked: one of `alarms` holds.
    alarm: bool,
    /// When `alarm` last changed (`ALARM_HOLD_MS`).
    alarm_changed_at: u64,
    /// Which resource alarms are raised (each with its own hysteresis).
    alarms: Alarms,
    /// What the host last measured (`report_resources`).
    resources: Resources,
    /// Where durable definitions and messages go; `None`: everything stays in memory.
    store: Option<Box<dyn Store>>,
    /// The epoch the next sync will carry; writes made now are covered by it.
    epoch: u64,
    /// A sync has started and not yet completed.
    sync_in_flight: bool,
    /// Durable writes (persistent messages on durable queues, definitions) since the last
    /// sync started.
    sync_dirty: bool,
    /// When the first store removal (ack, purge, drop, queue deletion) that no started
    /// sync covers was made: `tick` asks for a sync `removal_sync_ms` after it, so removals
    /// become durable (and dead store space is reclaimed) even when no publish starts a
    /// sync.
    removed_since: Option<u64>,
    /// Channels with a confirm waiting for the sync of an epoch, in epoch order (a channel
    /// may be listed more than once; the confirms themselves are in `ChannelState`).
    confirm_waiters: VecDeque<(u64, ChannelRef)>,
    /// Answers to publishes from other shards that a sync of this shard must cover first
    /// (persistent messages on durable queues), in epoch order.
    remote_answers: VecDeque<(u64, mail::Mail)>,
    /// The newest epoch whose sync completed.
    synced_epoch: Option<u64>,
    /// When a store write last failed: publishers are blocked for `STORE_RETRY_MS`.
    store_failed_at: Option<u64>,
    /// Replaying stored definitions: do not write them back.
    restoring: bool,
    /// Direct reply-to addresses -> the channel consuming replies (lookup only).
    reply_addresses: HashMap<Arc<str>, ChannelRef>,
    /// The last client-chosen consumer tag (`shared_tag`).
    last_tag: Option<Arc<str>>,
    /// Messages on their way to a dead-letter exchange.
    dead_letters: VecDeque<dead_letter::DeadLetter>,
    /// Mail between the queue and channel sides, delivered at the end of each operation
    /// (`mail.rs`).
    mail: mail::Mailbox,
    /// The host delivers mail (`deliver_mail`) instead of each operation: the multi-shard
    /// simulation's model of mail that takes time (`set_mail_scheduled`).
    mail_scheduled: bool,
    /// What channels whose request is not answered yet received meanwhile (`hold.rs`).
    holds: IdMap<ChannelRef, crate::channel::hold::Hold>,
    /// Commits waiting for the sync of an epoch, in epoch order.
    tx_sync_waiters: VecDeque<(u64, ChannelAddr)>,
    /// Channels with `ChannelState::awaiting` set: while none are, no op can wait, and
    /// `hold_op` costs two compares.
    awaiting: usize,
    /// The serial of the next channel opened (`ChannelAddr`).
    next_channel_serial: u32,
    /// No-ack deliveries whose channel closed while they travelled (lost, as in RabbitMQ).
    lost_in_flight: u64,
    /// Messages routed to a queue that was deleted before they reached it.
    routed_to_deleted: u64,
    /// The message counts of closed connections, per vhost (operators' totals never fall).
    closed_stats: std::collections::BTreeMap<VhostId, crate::stats::MessageStats>,
    /// Deliveries requeued (rejected, recovered, or left by a closed channel) after their
    /// queue was deleted: they went with it.
    requeued_to_deleted: u64,
    /// This broker's shard and the number of shards (`set_shard`).
    shard: u32,
    shards: u32,
    /// Queues that may hold messages with a TTL or have `x-expires`: `tick` looks at their
    /// heads and deadlines (not at every queue).
    expiring: std::collections::BTreeSet<QueueId>,
}

type OpResult = Result<(), ProtocolError>;

/// What the host measured of the machine (`Broker::report_resources`); `None`: not measured.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Resources {
    /// Bytes the whole process holds (RSS).
    pub memory: Option<u64>,
    /// Free bytes on the disk of the data directory.
    pub disk_free: Option<u64>,
}

/// The resource alarms; publishers are blocked while any is raised.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Alarms {
    /// Memory is above the watermark (until it falls to 90% of it).
    pub memory: bool,
    /// Free disk space is below the limit (until it is 10% above it).
    pub disk: bool,
    /// A store write failed in the last `STORE_RETRY_MS`.
    pub store: bool,
}

impl Alarms {
    pub fn any(self) -> bool {
        self.memory || self.disk || self.store
    }
}

impl Broker {
    /// The current routing table: clone the `Arc` to route publishes outside the broker
    /// (see `routing.rs` for what the broker guarantees about such publishes).
    pub fn routes(&self) -> &Arc<crate::routing::RouteTable> {
        self.topo.routes()
    }
}

impl Broker {
    /// Message memory is past half the alarm watermark (transient messages page out early).
    fn memory_tight(&self) -> bool {
        self.memory_held() > self.config.memory_high_watermark / 2
    }

    /// Body bytes held, by this shard or, with a shared count, by every shard.
    fn memory_held(&self) -> u64 {
        use std::sync::atomic::Ordering;
        self.shared_bytes
            .as_ref()
            .map_or(self.stored_bytes, |a| a.load(Ordering::Relaxed))
    }

    /// Makes the memory alarm count the body bytes of every shard: each shard given the
    /// same counter adds what it holds, and blocks its publishers when the sum passes the
    /// watermark. Call it before `restore`.
    pub fn share_memory_count(&mut self, count: Arc<std::sync::atomic::AtomicU64>) {
        use std::sync::atomic::Ordering;
        count.fetch_add(self.stored_bytes, Ordering::Relaxed);
        self.shared_bytes = Some(count);
    }

    /// Runs a queue operation on queue `id` with what it needs from the broker, then does
    /// what it asks of the broker (`absorb`). `None` if there is no such queue.
    fn with_queue<R>(
        &mut self,
        id: QueueId,
        f: impl FnOnce(&mut QueueState, &mut QueueIo<'_>) -> R,
    ) -> Option<R> {
        self.with_queue_and_credit(id, |q, io, _| f(q, io))
    }

    /// `with_queue` for operations that also take cross-queue credit (dispatch).
    fn with_queue_and_credit<R>(
        &mut self,
        id: QueueId,
        f: impl FnOnce(&mut QueueState, &mut QueueIo<'_>, &mut ChannelCredit<'_>) -> R,
    ) -> Option<R> {
        let memory_tight = self.memory_tight();
        let q = self.queues.get_mut(&id)?;
        let mut io = QueueIo::new(
            self.store.as_deref_mut(),
            &self.config,
            self.now,
            memory_tight,
        );
        let mut credit = ChannelCredit {
            conns: &mut self.conns,
            channels: &mut self.channels,
            write_window: self.config.write_window,
        };
        let result = f(q, &mut io, &mut credit);
        let out = io.out;
        self.absorb(id, out);
        Some(result)
    }

    /// Applies what an operation on queue `id` asks of the rest of the broker.
    fn absorb(&mut self, id: QueueId, out: QueueOut) {
        self.hold(out.held);
        self.release(out.released);
        if out.store_failed {
            self.store_failed_at = Some(self.now);
        }
        if out.durable_write {
            self.sync_dirty = true;
        }
        if out.removed {
            self.note_removal();
        }
        if out.expiring {
            self.expiring.insert(id);
        }
        for (message, reason) in out.dead {
            self.dead_letter(id, message, reason);
        }
    }
}

impl Broker {
    pub fn new(config: BrokerConfig) -> Broker {
        let mut broker = Broker {
            names: NameGen::new(config.seed),
            topo: Topology::new(),
            config,
            now: 0,
            next_id: 1,
            next_vhost: 0,
            queues: IdMap::default(),
            conns: IdMap::default(),
            channels: IdMap::default(),
            effects: Vec::new(),
            stored_bytes: 0,
            shared_bytes: None,
            alarm: false,
            alarm_changed_at: 0,
            alarms: Alarms::default(),
            resources: Resources::default(),
            store: None,
            epoch: 1,
            sync_in_flight: false,
            sync_dirty: false,
            removed_since: None,
            confirm_waiters: VecDeque::new(),
            remote_answers: VecDeque::new(),
            synced_epoch: None,
            store_failed_at: None,
            restoring: false,
            last_tag: None,
            dead_letters: VecDeque::new(),
            mail: mail::Mailbox::default(),
            mail_scheduled: false,
            holds: IdMap::default(),
            tx_sync_waiters: VecDeque::new(),
            closed_stats: std::collections::BTreeMap::new(),
            awaiting: 0,
            next_channel_serial: 0,
            lost_in_flight: 0,
            routed_to_deleted: 0,
            requeued_to_deleted: 0,
            reply_addresses: HashMap::new(),
            expiring: std::collections::BTreeSet::new(),
            shard: 0,
            shards: 1,
        };
        broker.create_defaults();
        broker
    }

    /// A broker that keeps durable definitions and messages in `store`, and pages messages
    /// out of memory into it. Call [`Broker::restore`] next to bring back what it holds.
    pub fn with_store(config: BrokerConfig, store: Box<dyn Store>) -> Broker {
        let mut broker = Broker::new(config);
        broker.store = Some(store);
        broker
    }

    /// Replays stored definitions (vhosts, users, permissions, policies, then per vhost
    /// exchanges, queues, bindings); durable queues reopen their stored messages. A store
    /// without vhosts and users (a fresh data directory, or one written before they were
    /// stored) gets the defaults written into it. Returns what could not be restored, as
    /// RabbitMQ-style error texts, for the host to log.
    pub fn restore(&mut self, now: u64, definitions: &Definitions) -> Vec<String> {
        self.restore_shards(now, definitions, &mut [])
    }

    /// `restore` on shard 0 of a sharded broker, before any shard serves: `others` are
    /// shards 1.. (in order). Every shard gets the vhosts, users, permissions and policies;
    /// shard 0 replays exchanges, queues and bindings, and each restored queue is created
    /// by the shard that owns it, with the messages of that shard's store (the mail between
    /// them is carried here until none is left).
    pub fn restore_shards(
        &mut self,
        now: u64,
        definitions: &Definitions,
        others: &mut [Broker],
    ) -> Vec<String> {
        for b in others.iter_mut() {
            b.now = b.now.max(now);
            // The same replay from the same start gives the same vhost ids everywhere;
            // its errors are shard 0's too.
            b.restoring = true;
            b.restore_access(now, definitions, &mut Vec::new());
            b.restoring = false;
        }
        self.now = self.now.max(now);
        let mut errors = Vec::new();
        self.restore_access(now, definitions, &mut errors);
        let vhosts: Vec<String> = self
            .topo
            .list_vhosts()
            .into_iter()
            .map(|v| v.name)
            .collect();
        for vhost in &vhosts {
            let in_vhost = |v: &String| v == vhost;
            let ops = definitions
                .exchanges
                .iter()
                .filter(|(v, _)| in_vhost(v))
                .map(|(_, x)| Op::ExchangeDeclare(x.clone()))
                .chain(
                    definitions
                        .queues
                        .iter()
                        .filter(|(v, _)| in_vhost(v))
                        .map(|(_, q)| Op::QueueDeclare(q.clone())),
                )
                .chain(
                    definitions
                        .bindings
                        .iter()
                        .filter(|(v, _, _)| in_vhost(v))
                        .map(|(_, b, to_exchange)| {
                            if *to_exchange {
                                Op::ExchangeBind(b.clone())
                            } else {
                                Op::QueueBind(b.clone())
                            }
                        }),
                );
            self.replay(now, vhost, ops, &mut errors, others);
        }
        for (v, x) in &definitions.exchanges {
            if !vhosts.contains(v) {
                errors.push(format!(
                    "exchange '{}': vhost '{v}' does not exist",
                    x.exchange
                ));
            }
        }
        for (v, q) in &definitions.queues {
            if !vhosts.contains(v) {
                errors.push(format!("queue '{}': vhost '{v}' does not exist", q.queue));
            }
        }
        self.restoring = false;
        errors
    }

    /// On shard 0: carries mail between this shard and `others` (shards 1.., in order) in
    /// one thread until none is left, the other shards adopting this one's routing table
    /// first. The sharded restore's stand-in for the runtime, which is not running yet,
    /// and a host for tests.
    pub fn carry_mail(&mut self, now: u64, others: &mut [Broker]) {
        let mut out = Vec::new();
        // Each round moves what every shard sent; a round bounds by the restore's work.
        for _ in 0..MAX_SETTLE_ROUNDS {
            let routes = Arc::clone(self.routes());
            for b in others.iter_mut() {
                b.adopt_routes(Arc::clone(&routes));
            }
            self.take_outbox(&mut out);
            for b in others.iter_mut() {
                b.take_outbox(&mut out);
            }
            if out.is_empty() {
                return;
            }
            for m in out.drain(..) {
                match m.shard() {
                    0 => self.receive_mail(now, m),
                    i => match others.get_mut(i as usize - 1) {
                        Some(b) => b.receive_mail(now, m),
                        None => debug_assert!(false, "mail for shard {i}, which is not given"),
                    },
                }
            }
        }
        debug_assert!(false, "mail between shards does not settle");
    }

    /// Vhosts, users, permissions and policies of `definitions` (the first part of a
    /// restore, which every shard does).
    fn restore_access(&mut self, now: u64, definitions: &Definitions, errors: &mut Vec<String>) {
        if definitions.vhosts.is_empty() && definitions.users.is_empty() {
            self.store_defaults();
        }
        self.restoring = true;
        if !definitions.vhosts.is_empty() || !definitions.users.is_empty() {
            // The stored ones replace the defaults (an operator may have deleted guest).
            self.topo.users.clear();
            let stored: std::collections::BTreeSet<&str> =
                definitions.vhosts.iter().map(|v| v.name.as_str()).collect();
            let defaults: Vec<String> = self
                .topo
                .list_vhosts()
                .into_iter()
                .map(|v| v.name)
                .collect();
            for v in defaults {
                if !stored.contains(v.as_str()) {
                    let _ = self.delete_vhost(now, &v);
                }
            }
            for v in &definitions.vhosts {
                if let Err(e) = self.add_vhost(now, v.clone()) {
                    errors.push(format!("vhost '{}': {e}", v.name));
                }
            }
            for u in &definitions.users {
                self.topo.users.put(u.clone());
            }
            for p in &definitions.permissions {
                if let Err(e) = self.set_permissions(now, p.clone()) {
                    errors.push(format!("permissions of '{}' in '{}': {e}", p.user, p.vhost));
                }
            }
        }
        for p in &definitions.policies {
            if let Err(e) = self.set_policy(now, p.clone()) {
                errors.push(format!("policy '{}': {e}", p.name));
            }
        }
    }

    /// Applies `ops` in `vhost` on the restore connection, collecting their errors (a failed
    /// op reopens the channel, so the rest still apply).
    fn replay(
        &mut self,
        now: u64,
        vhost: &str,
        ops: impl Iterator<Item = Op>,
        errors: &mut Vec<String>,
        others: &mut [Broker],
    ) {
        let ch = ChannelRef::new(RESTORE_CONN, 1);
        let mark = self.effects.len();
        if self.conns.contains_key(&RESTORE_CONN) {
            self.release_connection(RESTORE_CONN);
        }
        self.handle(
            now,
            ChannelRef::new(RESTORE_CONN, 0),
            Op::ConnectionOpen {
                vhost: vhost.to_string(),
                user: "warren-restore".into(),
                cancel_notify: false,
            },
        );
        self.handle(now, ch, Op::ChannelOpen);
        for op in ops {
            self.handle(now, ch, op);
            self.carry_mail(now, others);
            let failed: Vec<String> =
                self.effects
                    .drain(mark..)
                    .filter_map(|effect| match effect {
                        Effect::ChannelError { error, .. }
                        | Effect::ConnectionError { error, .. } => Some(error.to_string()),
                        _ => None,
                    })
                    .collect();
            if !failed.is_empty() {
                errors.extend(failed);
                self.handle(now, ch, Op::ChannelCloseOk);
                self.handle(now, ch, Op::ChannelOpen);
                self.effects.truncate(mark);
            }
        }
        self.handle(now, ch, Op::ConnectionClose);
        self.effects.truncate(mark);
    }

    /// Starts a sync of the durable writes made so far, if there are any and no sync is
    /// running. Hosts call it after applying a batch of ops (group commit: everything
    /// written meanwhile rides on the next sync). Returns the epoch handed to the store.
    pub fn start_sync(&mut self) -> Option<u64> {
        let store = self.store.as_mut()?;
        if self.sync_in_flight || !self.sync_dirty {
            store.flush();
            return None;
        }
        let epoch = self.epoch;
        self.epoch += 1;
        self.sync_in_flight = true;
        self.sync_dirty = false;
        // Every removal made so far rides on this sync.
        self.removed_since = None;
        store.sync(epoch);
        Some(epoch)
    }

    /// Asks for a sync of everything written so far, removals included, at the next
    /// `start_sync` (or right after the one in flight). Hosts call it at a clean stop,
    /// then wait until `all_synced`, so nothing acked comes back after a
    /// restart; and once after a restore, which ends the store's recovery.
    pub fn request_sync(&mut self) {
        if self.store.is_some() {
            self.sync_dirty = true;
        }
    }

    /// A stored message left a queue (acked, dropped, purged, its queue deleted): a sync
    /// must cover it within `removal_sync_ms` (`tick`, `next_deadline`).
    pub(super) fn note_removal(&mut self) {
        if self.store.is_some() && self.removed_since.is_none() {
            self.removed_since = Some(self.now);
        }
    }

    /// The store reports that the sync of `epoch` completed: everything written before it
    /// started is durable, and the confirms waiting for it go out.
    pub fn synced(&mut self, now: u64, epoch: u64) {
        self.now = self.now.max(now);
        debug_assert!(epoch < self.epoch, "synced an epoch never started");
        self.sync_in_flight = false;
        self.release_confirms(epoch, true);
        self.after_op();
    }

    /// The store reports that the sync of `epoch` failed: nothing it covered can be called
    /// durable, so the confirms waiting for it become nacks, and publishers are blocked for a
    /// while (as after a failed write).
    pub fn sync_failed(&mut self, now: u64, epoch: u64) {
        self.now = self.now.max(now);
        self.sync_in_flight = false;
        self.store_failed_at = Some(self.now);
        self.release_confirms(epoch, false);
        self.after_op();
    }

    /// The sync of `epoch` completed (`durable`) or failed: the confirms waiting for it go
    /// out, as decided at publish if it completed, as nacks if it failed.
    fn release_confirms(&mut self, epoch: u64, durable: bool) {
        if durable {
            self.synced_epoch = Some(self.synced_epoch.map_or(epoch, |s| s.max(epoch)));
        }
        let mut channels = std::collections::BTreeSet::new();
        while self.confirm_waiters.front().is_some_and(|w| w.0 <= epoch) {
            if let Some((_, ch)) = self.confirm_waiters.pop_front() {
                channels.insert(ch);
            }
        }
        for ch in channels {
            if !durable && let Some(channel) = self.channels.get_mut(&ch) {
                channel.sync_failed(epoch);
            }
            self.send_confirms(ch);
        }
        while self.remote_answers.front().is_some_and(|w| w.0 <= epoch) {
            let answer = match self.remote_answers.pop_front() {
                Some((_, mail::Mail::Answered { to, seq, taken, .. })) => mail::Mail::Answered {
                    to,
                    seq,
                    // A failed sync makes the message not durable: nacked.
                    taken: taken && durable,
                    durable: false,
                },
                Some((_, mail::Mail::TxFlushed { to, .. })) => {
                    mail::Mail::TxFlushed { to, durable }
                }
                _ => continue,
            };
            self.mail.push_back(answer);
        }
        while self.tx_sync_waiters.front().is_some_and(|w| w.0 <= epoch) {
            if let Some((_, to)) = self.tx_sync_waiters.pop_front() {
                self.tx_synced(to, durable);
            }
        }
    }

    /// Sends the confirms of channel `ch` that may go out now, in publish order.
    fn send_confirms(&mut self, ch: ChannelRef) {
        let Some(channel) = self.channels.get_mut(&ch) else {
            return;
        };
        let mut ready = Vec::new();
        channel.take_confirms(self.synced_epoch, &mut ready);
        for (seq, ack) in ready {
            self.effects.push(Effect::Confirm {
                ch,
                seq,
                multiple: false,
                ack,
            });
        }
    }

    /// The epoch whose completed sync makes every write so far durable, if some write is not
    /// durable yet (`None` without a store). Hosts hold answers to operators (a user added, a
    /// policy set) until then, so "done" means it survives a crash.
    pub fn unsynced_epoch(&self) -> Option<u64> {
        self.store.as_ref()?;
        if self.sync_dirty {
            Some(self.epoch)
        } else if self.sync_in_flight {
            Some(self.epoch - 1)
        } else {
            None
        }
    }

    /// Whether everything written so far, removals included, is covered by a completed
    /// sync (always without a store): a clean stop waits for it after `request_sync`.
    pub fn all_synced(&self) -> bool {
        self.store.is_none()
            || (!self.sync_dirty && !self.sync_in_flight && self.removed_since.is_none())
    }

    /// Confirms waiting for a sync (hosts and tests).
    pub fn pending_confirms(&self) -> usize {
        self.channels
            .values()
            .map(|c| c.unconfirmed().count())
            .sum()
    }

    /// Applies one operation of channel `ch` at time `now` (milliseconds, host-defined epoch).
    pub fn handle(&mut self, now: u64, ch: ChannelRef, op: Op) {
        debug_assert_eq!(
            self.conn_shard(ch.conn),
            self.shard,
            "{ch:?} is another shard's"
        );
        self.now = self.now.max(now);
        self.mail.from(mail::Dest::Conn(ch.conn));
        let routes_before = self.topo.routes().version();
        if self.must_hold(ch) {
            self.hold_op(ch, op);
        } else {
            self.apply_now(ch, op);
        }
        // What the op's mail changed (an auto-delete its cancel caused) counts as its own.
        self.after_op();
        self.saw_routes(ch.conn, routes_before);
    }

    /// Applies an op that waited on its channel (`hold.rs`), once its turn came.
    fn run_op(&mut self, ch: ChannelRef, op: Op) {
        let routes_before = self.topo.routes().version();
        self.apply_now(ch, op);
        self.saw_routes(ch.conn, routes_before);
    }

    #[inline]
    fn apply_now(&mut self, ch: ChannelRef, op: Op) {
        if let Err(error) = self.apply(ch, op) {
            self.fail(ch, error);
        }
    }

    /// Connection `conn` saw its own routing changes since `before` (`routes_seen`).
    fn saw_routes(&mut self, conn: ConnId, before: u64) {
        let after = self.topo.routes().version();
        if after != before {
            self.saw_version(conn, after);
        }
    }

    /// Connection `conn` was answered on routing table `version`: it routes on no older
    /// one from now on (a client sees its own topology changes).
    fn saw_version(&mut self, conn: ConnId, version: u64) {
        if let Some(c) = self.conns.get_mut(&conn) {
            c.routes_seen = c.routes_seen.max(version);
        }
    }

    /// Body bytes currently held (ready or unacked, once per queue).
    pub fn stored_bytes(&self) -> u64 {
        self.stored_bytes
    }

    /// A message body of `n` bytes entered a queue.
    fn hold(&mut self, n: u64) {
        self.stored_bytes += n;
        if let Some(a) = &self.shared_bytes {
            a.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// A message body of `n` bytes left the broker's custody for one queue (acked, dropped,
    /// delivered without ack, purged, deleted).
    fn release(&mut self, n: u64) {
        debug_assert!(self.stored_bytes >= n, "released more than held");
        let n = n.min(self.stored_bytes);
        self.stored_bytes -= n;
        if let Some(a) = &self.shared_bytes {
            // This shard added at least `n` of the sum.
            a.fetch_sub(n, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// Raises or clears the resource alarms after an op (or a report from the host), and
    /// tells every connection when publishers become blocked or unblocked.
    ///
    /// Each alarm has hysteresis: it is raised at its limit and cleared only clearly on the
    /// other side of it (memory: at 90% of the watermark; disk: 10% above the free-space
    /// limit). Without it a consumer draining a queue at the watermark flipped the alarm on
    /// every message (10,051 blocked/unblocked pairs in 10 s).
    fn update_alarm(&mut self) {
        let store_failed = self
            .store_failed_at
            .is_some_and(|at| self.now < at.saturating_add(STORE_RETRY_MS));
        if !store_failed {
            self.store_failed_at = None;
        }
        let watermark = self.config.memory_high_watermark;
        let memory = self.memory_figure();
        self.alarms.memory = if self.alarms.memory {
            memory > watermark - watermark / 10
        } else {
            memory > watermark
        };
        let limit = self.config.disk_free_limit;
        self.alarms.disk = match self.resources.disk_free {
            Some(free) if limit > 0 => {
                if self.alarms.disk {
                    free < limit.saturating_add(limit / 10)
                } else {
                    free < limit
                }
            }
            _ => false,
        };
        self.alarms.store = store_failed;
        let over = self.alarms.any();
        if over == self.alarm {
            return;
        }
        if !over && self.now < self.alarm_changed_at.saturating_add(ALARM_HOLD_MS) {
            // Cleared too soon after blocking: publishers stay blocked until the hold
            // ends (`next_deadline` asks for a tick then).
            return;
        }
        self.alarm = over;
        self.alarm_changed_at = self.now;
        let mut conns: Vec<ConnId> = self.conns.keys().copied().collect();
        conns.sort_unstable();
        for conn in conns {
            self.effects.push(if over {
                Effect::Blocked { conn }
            } else {
                Effect::Unblocked { conn }
            });
        }
    }

    /// The memory the alarm compares with the watermark: the body bytes the queues hold,
    /// or what the host measured the process to hold (its RSS), whichever is larger. With
    /// a store the queues hold little of their messages in memory, yet the process may
    /// hold much more (buffers, allocator slack): only the host can see that.
    fn memory_figure(&self) -> u64 {
        self.memory_held().max(self.resources.memory.unwrap_or(0))
    }

    /// The host's latest measurements of the machine: the process's memory (RSS) and the
    /// free space on the data disk. The alarms are re-evaluated at once; the host then
    /// polls the effects (`Blocked` / `Unblocked`).
    pub fn report_resources(&mut self, now: u64, resources: Resources) {
        self.now = self.now.max(now);
        self.resources = resources;
        self.update_alarm();
    }

    /// The resource alarms raised now (hosts log their changes).
    pub fn alarms(&self) -> Alarms {
        self.alarms
    }

    /// Publishers are blocked: an alarm is raised, or one was within `ALARM_HOLD_MS`.
    pub fn publishers_blocked(&self) -> bool {
        self.alarm
    }

    /// Advances time (message TTLs and queue expiry will hang off this).
    pub fn tick(&mut self, now: u64) {
        self.now = self.now.max(now);
        if self
            .removed_since
            .is_some_and(|at| self.now >= at.saturating_add(self.config.removal_sync_ms))
        {
            // The host starts it after this tick (or once the sync in flight completes).
            self.removed_since = None;
            self.sync_dirty = true;
        }
        let expiring: Vec<QueueId> = self.expiring.iter().copied().collect();
        for id in expiring {
            self.mail.from(mail::Dest::Queue(id));
            let Some(q) = self.queues.get(&id) else {
                self.expiring.remove(&id);
                continue;
            };
            let unused_since = q
                .args
                .expires
                .filter(|_| q.consumers.is_empty())
                .map(|e| q.last_used.saturating_add(e));
            if unused_since.is_some_and(|at| self.now > at) {
                self.delete_queue(id);
                continue;
            }
            self.expire_head(id);
            self.dispatch(id);
        }
        self.after_op();
    }

    /// What every entry point does last: delivers the mail, routes the dead letters (whose
    /// enqueues send mail again), and updates the memory alarm.
    fn after_op(&mut self) {
        if !self.mail_scheduled {
            self.pump();
        }
        self.mail.from(mail::Dest::Host);
        self.route_dead_letters();
        if !self.mail_scheduled {
            self.pump();
        }
        self.update_alarm();
    }

    /// When the host should call `tick` next, if ever.
    pub fn next_deadline(&self) -> Option<u64> {
        let mut next = self
            .store_failed_at
            .map(|at| at.saturating_add(STORE_RETRY_MS));
        let mut earliest = |at: u64| next = Some(next.map_or(at, |n: u64| n.min(at)));
        if !self.dead_letters.is_empty() {
            earliest(self.now);
        }
        if self.alarm && !self.alarms.any() {
            // Every alarm cleared during the hold: unblock when it ends.
            earliest(self.alarm_changed_at.saturating_add(ALARM_HOLD_MS));
        }
        if let Some(at) = self.removed_since {
            earliest(at.saturating_add(self.config.removal_sync_ms));
        }
        if self.alarm && self.shared_bytes.is_some() {
            // Other shards' consumers may drain the sum below the watermark while this
            // shard's publishers, blocked, send nothing: look again soon.
            earliest(self.now.saturating_add(ALARM_RECHECK_MS));
        }
        for id in &self.expiring {
            let Some(q) = self.queues.get(id) else {
                continue;
            };
            if let Some(e) = q.args.expires.filter(|_| q.consumers.is_empty()) {
                earliest(q.last_used.saturating_add(e).saturating_add(1));
            }
            match q.messages.head() {
                Some(m) => {
                    if let Some(at) = m.expires_at {
                        earliest(at.saturating_add(1));
                    }
                }
                // The head is on disk: read it in at the next tick to learn its deadline.
                None if q.messages.paged().count > 0 => earliest(self.now.saturating_add(1)),
                None => {}
            }
        }
        next
    }

    /// Moves the effects produced so far into `out`, in order.
    pub fn poll_effects(&mut self, out: &mut Vec<Effect>) {
        debug_assert!(
            self.mail_scheduled || self.mail.is_empty(),
            "an entry point left mail undelivered"
        );
        debug_assert!(
            self.mail_scheduled || self.shards > 1 || self.stuck_channel().is_none(),
            "{:?}",
            self.stuck_channel()
        );
        out.append(&mut self.effects);
    }

    /// Ready messages in a queue of the default vhost, in memory and paged out (for hosts,
    /// tests and admin tools).
    pub fn queue_len(&self, name: &str) -> Option<usize> {
        let id = self.topo.routes().queue(self.topo.default_vhost, name)?;
        self.queues.get(&id).map(|q| q.messages.len())
    }

    /// Number of queues and exchanges, for admin tools and tests.
    pub fn counts(&self) -> (usize, usize) {
        (self.queues.len(), self.topo.exchange_count())
    }

    fn next_id(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    /// A new id that says it belongs to `shard` (`id % shards == shard`), never reused:
    /// queues (on their owner's shard) and consumers (on their channel's), which shards
    /// allocate side by side.
    fn id_on(&mut self, shard: u32) -> u64 {
        let n = self.next_id();
        n * u64::from(self.shards) + u64::from(shard)
    }

    /// Makes this broker shard `shard` of `shards` (ARCHITECTURE.md, "warren-runtime"):
    /// it owns the connections and queues whose ids are `shard` modulo `shards`, sends
    /// mail for the others to its outbox (`take_outbox`), and only shard 0 keeps topology;
    /// the others route on the table shard 0 publishes (`adopt_routes`). Call it on a new
    /// broker, before any connection.
    pub fn set_shard(&mut self, shard: u32, shards: u32) {
        assert!(
            self.conns.is_empty() && self.queues.is_empty(),
            "set_shard on a used broker"
        );
        self.mail.set_shard(shard, shards);
        self.names = NameGen::for_shard(self.config.seed, shard);
        self.shard = shard;
        self.shards = shards;
    }

    /// This broker's shard (0 unless `set_shard`).
    pub fn shard(&self) -> u32 {
        self.shard
    }

    /// Shard 0's routing table, on another shard: its channels route on it and resolve
    /// names through it. The host adopts every table shard 0 publishes, before it hands
    /// this shard mail that shard 0 sent after publishing it (a client sees its own binds).
    pub fn adopt_routes(&mut self, routes: Arc<crate::routing::RouteTable>) {
        assert_ne!(self.shard, 0, "shard 0 owns the routing table");
        self.topo.adopt_routes(routes);
    }

    /// The shard of connection `conn` (the restore connection is every shard's own).
    fn conn_shard(&self, conn: ConnId) -> u32 {
        self.mail.shard_of(mail::Dest::Conn(conn))
    }

    /// The shard that owns queue `id`.
    fn queue_shard(&self, id: QueueId) -> u32 {
        self.mail.shard_of(mail::Dest::Queue(id))
    }

    fn apply(&mut self, ch: ChannelRef, op: Op) -> OpResult {
        if let Op::ConnectionOpen {
            vhost,
            user,
            cancel_notify,
        } = op
        {
            return self.connection_open(ch.conn, vhost, user, cancel_notify);
        }
        if !self.conns.contains_key(&ch.conn) {
            // A connection that already failed or closed: its late ops are moot.
            return Ok(());
        }
        match op {
            Op::ConnectionOpen { .. } => Ok(()),
            Op::ConnectionClose => {
                self.flush_holds(ch.conn);
                self.release_connection(ch.conn);
                Ok(())
            }
            Op::Written { count } => {
                self.written(ch.conn, count);
                Ok(())
            }
            Op::ChannelOpen => self.channel_open(ch),
            Op::ChannelCloseOk => {
                // Either the host confirms a channel error we raised, or it closed the channel
                // itself after an error of its own: release what is left either way.
                if self.channels.contains_key(&ch) {
                    self.release_channel(ch);
                    self.remove_channel(ch);
                }
                Ok(())
            }
            op => {
                match self.channels.get(&ch).map(|c| c.phase) {
                    Some(Phase::Open) => {}
                    // After a channel error everything but the close handshake is dropped.
                    Some(Phase::Closing) => return Ok(()),
                    None => {
                        return Err(ProtocolError::new(
                            ErrorCode::ChannelError,
                            op.kind(),
                            format!("expected 'channel.open' on channel {}", ch.channel),
                        ));
                    }
                }
                self.channel_op(ch, op)
            }
        }
    }

    fn channel_op(&mut self, ch: ChannelRef, op: Op) -> OpResult {
        match op {
            Op::ChannelClose => {
                self.release_channel(ch);
                self.remove_channel(ch);
                self.reply(ch, crate::effect::Reply::ChannelCloseOk);
                Ok(())
            }
            Op::ExchangeDeclare(d) => self.exchange_declare(ch, d),
            Op::ExchangeDelete {
                exchange,
                if_unused,
                nowait,
            } => self.exchange_delete(ch, exchange, if_unused, nowait),
            Op::ExchangeBind(b) => self.exchange_bind(ch, b, true),
            Op::ExchangeUnbind(b) => self.exchange_bind(ch, b, false),
            Op::QueueDeclare(d) => self.queue_declare(ch, d),
            Op::QueueBind(b) => self.queue_bind(ch, b, true),
            Op::QueueUnbind(b) => self.queue_bind(ch, b, false),
            Op::QueuePurge { queue, nowait } => self.queue_purge(ch, &queue, nowait),
            Op::QueueDelete {
                queue,
                if_unused,
                if_empty,
                nowait,
            } => self.queue_delete_op(ch, &queue, if_unused, if_empty, nowait),
            Op::Qos {
                prefetch_size,
                prefetch_count,
                global,
            } => self.qos(ch, prefetch_size, prefetch_count, global),
            Op::Consume(c) => self.consume(ch, c),
            Op::Cancel {
                consumer_tag,
                nowait,
            } => self.cancel(ch, &consumer_tag, nowait),
            Op::Get { queue, no_ack } => self.get(ch, &queue, no_ack),
            Op::Publish(p) => self.publish(ch, p),
            Op::Ack {
                delivery_tag,
                multiple,
            } => self.settle_op(
                ch,
                OpKind::Ack,
                delivery_tag,
                multiple,
                crate::queue::state::Settle::Ack,
            ),
            Op::Nack {
                delivery_tag,
                multiple,
                requeue,
            } => self.settle_op(
                ch,
                OpKind::Nack,
                delivery_tag,
                multiple,
                crate::queue::state::Settle::reject(requeue),
            ),
            Op::Reject {
                delivery_tag,
                requeue,
            } => self.settle_op(
                ch,
                OpKind::Reject,
                delivery_tag,
                false,
                crate::queue::state::Settle::reject(requeue),
            ),
            Op::Recover { requeue } => self.recover(ch, requeue),
            Op::ConfirmSelect { nowait } => self.confirm_select(ch, nowait),
            Op::TxSelect => self.tx_select(ch),
            Op::TxCommit => self.tx_commit(ch),
            Op::TxRollback => self.tx_rollback(ch),
            Op::ConnectionOpen { .. }
            | Op::ConnectionClose
            | Op::ChannelOpen
            | Op::ChannelCloseOk
            | Op::Written { .. } => Ok(()),
        }
    }

    /// Reports an error: a channel exception closes the channel, anything else the connection.
    fn fail(&mut self, ch: ChannelRef, error: ProtocolError) {
        let channel_open = matches!(self.channels.get(&ch).map(|c| c.phase), Some(Phase::Open));
        if error.code.is_channel_level() && ch.channel != 0 && channel_open {
            self.drop_hold(ch);
            self.release_channel(ch);
            if let Some(channel) = self.channels.get_mut(&ch) {
                channel.close();
            }
            self.effects.push(Effect::ChannelError { ch, error });
        } else if self.conns.contains_key(&ch.conn) {
            self.release_connection(ch.conn);
            self.effects.push(Effect::ConnectionError {
                conn: ch.conn,
                error,
            });
        }
    }

    fn reply(&mut self, ch: ChannelRef, reply: crate::effect::Reply) {
        self.effects.push(Effect::Reply { ch, reply });
    }

    /// The vhost of a connection (internal connections without one: the default vhost).
    fn conn_vhost(&self, conn: ConnId) -> VhostId {
        self.conns
            .get(&conn)
            .map_or(self.topo.default_vhost, |c| c.vhost)
    }

    fn vhost_name(&self, vhost: VhostId) -> &str {
        self.topo.vhost_name(vhost)
    }
}

impl Broker {
    /// With no mail left, a channel waits only for a sync (its commit), and holds ops only
    /// while it waits: the first channel that breaks this, described.
    fn stuck_channel(&self) -> Option<String> {
        self.stuck_channel_but(&|_| false)
    }

    /// `stuck_channel`, where `synced_elsewhere` says which channels wait for another
    /// shard's sync (an answer held in its `remote_answers`).
    fn stuck_channel_but(&self, synced_elsewhere: &dyn Fn(&ChannelRef) -> bool) -> Option<String> {
        if !self.mail.is_empty() || (self.awaiting == 0 && self.holds.is_empty()) {
            return None;
        }
        // O(channels x waiters): for checks only.
        let syncing = |ch: &ChannelRef| {
            let serial = self.channels.get(ch).map(|c| c.serial);
            synced_elsewhere(ch)
                || self
                    .tx_sync_waiters
                    .iter()
                    .any(|(_, to)| to.ch == *ch && Some(to.serial) == serial)
        };
        if let Some((ch, _)) = self
            .channels
            .iter()
            .find(|(ch, c)| c.awaiting && !syncing(ch))
        {
            return Some(format!("{ch:?} waits for an answer with no mail left"));
        }
        self.holds
            .keys()
            .find(|ch| !syncing(ch))
            .map(|ch| format!("{ch:?} holds ops with nothing to wait for"))
    }

    /// Verifies the cross-references the module docs promise (counters match the unacked
    /// entries, consumers are where queues and channels say they are). For simulation tests
    /// and debug builds; O(state).
    pub fn check_invariants(&self) -> Result<(), String> {
        Broker::check_shards(&[self])
    }

    /// `check_invariants` over every shard of a sharded broker, in shard order: the queue
    /// side, the channel side and topology agree across shards once no mail travels.
    pub fn check_shards(shards: &[&Broker]) -> Result<(), String> {
        let Some(first) = shards.first() else {
            return Ok(());
        };
        for (i, b) in shards.iter().enumerate() {
            if b.shard as usize != i || b.shards as usize != shards.len() {
                return Err(format!("shard {} of {} given as {i}", b.shard, b.shards));
            }
        }
        let topo = &first.topo;
        topo.check_invariants()?;
        // What follows compares the queue side with the channel side and with topology,
        // which agree only once the mail between them has arrived (with scheduled mail, not
        // after every op).
        if shards
            .iter()
            .any(|b| !b.mail.is_empty() || b.mail.outbox_len() > 0)
        {
            return Ok(());
        }
        let owner = |id: QueueId| &shards[(id.0 % shards.len() as u64) as usize];
        let queue = |id: QueueId| owner(id).queues.get(&id).map(|q| &**q);
        let channel = |ch: &ChannelRef| {
            let b = &shards[first.conn_shard(ch.conn) as usize];
            b.channels.get(ch).map(|c| &**c)
        };
        let queues = || shards.iter().flat_map(|b| b.queues.iter());
        let channels = || shards.iter().flat_map(|b| b.channels.iter());
        // Topology's copy of each queue's fixed facts matches the queue (a queue being
        // created or removed differs only while the mail about it travels).
        for (&id, q) in queues() {
            let entry = topo
                .queue(id)
                .ok_or_else(|| format!("queue {id:?} '{}' unknown to topology", q.name))?;
            let stored = q.durable && q.exclusive_owner.is_none();
            if (
                entry.vhost,
                &entry.name,
                entry.exclusive_owner,
                entry.stored,
            ) != (q.vhost, &q.name, q.exclusive_owner, stored)
            {
                return Err(format!("topology's entry of queue {id:?} differs from it"));
            }
        }
        let total: usize = shards.iter().map(|b| b.queues.len()).sum();
        if topo.queue_count() != total {
            return Err(format!(
                "topology knows {} queues, the shards have {total}",
                topo.queue_count()
            ));
        }
        // Answers held until their queue's shard syncs (`remote_answers`), by channel.
        let mut held_answers: HashMap<(ChannelRef, u64), u32> = HashMap::new();
        let mut held_flushes: std::collections::BTreeSet<ChannelRef> = Default::default();
        for b in shards {
            for (_, m) in &b.remote_answers {
                match m {
                    mail::Mail::Answered { to, seq, .. } => {
                        *held_answers.entry((to.ch, *seq)).or_default() += 1;
                    }
                    mail::Mail::TxFlushed { to, .. } => {
                        held_flushes.insert(to.ch);
                    }
                    _ => return Err("a held answer that is not one".into()),
                }
            }
        }
        for b in shards {
            let awaiting = b.channels.values().filter(|c| c.awaiting).count();
            if awaiting != b.awaiting {
                return Err(format!(
                    "{awaiting} channels await an answer but the count says {}",
                    b.awaiting
                ));
            }
            if let Some(stuck) = b.stuck_channel_but(&|ch| held_flushes.contains(ch)) {
                return Err(stuck);
            }
            if let Some(q) = b.queues.values().find(|q| b.queue_shard(q.id) != b.shard) {
                return Err(format!(
                    "queue {} on shard {}, not its own",
                    q.name, b.shard
                ));
            }
        }
        let held: u64 = queues()
            .map(|(_, q)| q.messages.bytes())
            .chain(
                channels()
                    .flat_map(|(_, c)| c.unacked.values())
                    .map(|u| u.message.body_len() as u64),
            )
            .sum();
        let stored_bytes: u64 = shards.iter().map(|b| b.stored_bytes).sum();
        if held != stored_bytes {
            return Err(format!(
                "stored_bytes {stored_bytes} but queues and unacked hold {held}"
            ));
        }
        let mut queue_unacked: HashMap<QueueId, u64> = HashMap::new();
        let mut consumer_unacked: HashMap<ConsumerId, u32> = HashMap::new();
        for (ch, channel) in channels() {
            let mut from_consumers = 0u32;
            for u in channel.unacked.values() {
                *queue_unacked.entry(u.queue).or_default() += 1;
                if let Some(cid) = u.consumer {
                    from_consumers += 1;
                    *consumer_unacked.entry(cid).or_default() += 1;
                }
            }
            if channel.phase == Phase::Open && from_consumers != channel.consumer_unacked.get() {
                return Err(format!(
                    "{ch:?}: consumer_unacked {} but {} entries",
                    channel.consumer_unacked.get(),
                    from_consumers
                ));
            }
            for (tag, cid, q) in channel.consumers.iter() {
                let c = queue(q)
                    .and_then(|q| q.consumer(cid))
                    .ok_or_else(|| format!("{ch:?}: consumer {tag} missing from its queue"))?;
                if c.ch != *ch || c.tag != *tag {
                    return Err(format!("{ch:?}: consumer {tag} points elsewhere"));
                }
            }
        }
        for b in shards {
            for (ch, channel) in &b.channels {
                let mut last = 0;
                for (seq, waiting, epoch) in channel.unconfirmed() {
                    if seq <= last {
                        return Err(format!("{ch:?}: confirms out of publish order"));
                    }
                    last = seq;
                    // Every queue answers (by mail) once the mail has arrived, or holds
                    // its answer until its shard's sync.
                    if waiting > held_answers.get(&(*ch, seq)).copied().unwrap_or(0) {
                        return Err(format!("{ch:?}: publish {seq} waits for {waiting} queues"));
                    }
                    // (A publish whose sync is done may still wait, in order, behind
                    // an earlier one that a queue on another shard has not answered.)
                    if let Some(e) = epoch
                        && b.synced_epoch.is_none_or(|s| e > s)
                        && !b.confirm_waiters.contains(&(e, *ch))
                    {
                        return Err(format!(
                            "{ch:?}: publish {seq} waits for epoch {e} unlisted"
                        ));
                    }
                }
            }
            if b.confirm_waiters
                .iter()
                .zip(b.confirm_waiters.iter().skip(1))
                .any(|(a, b)| a.0 > b.0)
            {
                return Err("confirm waiters out of epoch order".into());
            }
            for q in b.queues.values() {
                let paged = q.messages.paged();
                if b.store.is_none() && paged.count > 0 {
                    return Err(format!("queue {}: paged out without a store", q.name));
                }
                for deque in q.messages.deques() {
                    let mut last = None;
                    for m in deque {
                        if last.is_some_and(|l| l >= m.seq) {
                            return Err(format!("queue {}: window out of order", q.name));
                        }
                        // A priority queue reads everything back before popping: its levels
                        // may hold messages above a partly read suffix meanwhile.
                        if paged.count > 0 && m.seq >= paged.from_seq && !q.messages.is_priority() {
                            return Err(format!(
                                "queue {}: window overlaps the paged suffix",
                                q.name
                            ));
                        }
                        last = Some(m.seq);
                    }
                }
            }
        }
        for (id, q) in queues() {
            let expected = queue_unacked.get(id).copied().unwrap_or(0);
            if q.unacked != expected {
                return Err(format!(
                    "queue {}: unacked {} but {} entries",
                    q.name, q.unacked, expected
                ));
            }
            if q.consumers
                .iter()
                .zip(q.consumers.iter().skip(1))
                .any(|(a, b)| a.id >= b.id)
            {
                return Err(format!("queue {}: consumers out of id order", q.name));
            }
            for c in &q.consumers {
                let expected = consumer_unacked.get(&c.id).copied().unwrap_or(0);
                if c.unacked != expected {
                    return Err(format!(
                        "consumer {}: unacked {} but {} entries",
                        c.tag, c.unacked, expected
                    ));
                }
                let listed = channel(&c.ch).and_then(|channel| channel.consumers.get(&c.tag));
                if listed != Some((c.id, *id)) {
                    return Err(format!("consumer {} not on its channel", c.tag));
                }
            }
        }
        for (id, conn) in shards.iter().flat_map(|b| b.conns.iter()) {
            let consumers = queues()
                .flat_map(|(_, q)| &q.consumers)
                .filter(|c| c.ch.conn == *id)
                .count();
            if conn.consumers as usize != consumers {
                return Err(format!(
                    "{id:?}: consumers {} but {consumers} exist",
                    conn.consumers
                ));
            }
            let pausing: crate::sorted_vec::SortedSet<QueueId> = queues()
                .filter(|(_, q)| q.pausing.contains(id))
                .map(|(qid, _)| *qid)
                .collect();
            if conn.paused_in != pausing {
                return Err(format!(
                    "{id:?}: paused in {:?} but {pausing:?} pause it",
                    conn.paused_in
                ));
            }
        }
        Ok(())
    }
}
