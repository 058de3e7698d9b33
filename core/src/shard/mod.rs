//! One shard of the broker: the deterministic state machine that composes the three sides
//! (the queue side, the channel side, topology) over vhosts, exchanges, queues, connections,
//! channels and consumers, with RabbitMQ's semantics.
//!
//! `handle` applies one operation; effects accumulate until `poll_effects`. The sides talk
//! by mail (`crate::mail`), delivered by `post.rs` at the end of each operation, or by the
//! host between shards (`crate::shards` composes several).
//!
//! Invariants (checked by `debug_assert!`s and the simulation tests):
//! - A message is in exactly one place per queue it was routed to: ready in the queue, or
//!   unacked on one channel, until acked or dropped.
//! - `QueueConsumer::unacked`, `ChannelState::consumer_unacked` and `QueueState::unacked`
//!   count exactly the unacked entries that reference them.
//! - Ids are never reused, so stale references (an unacked delivery of a deleted queue) are
//!   detected by a failed lookup, never aliased.
//!
//! Files are named for the side that owns what they handle:
//! - the composition: `mod.rs` (the state, `handle`, op dispatch), `post.rs` (mail to its
//!   side), `sync.rs` (epochs), `alarm.rs`, `restore.rs`, `admin.rs`, `dead_letter.rs`,
//!   `credit.rs` (the one bridge that reads channel records for a queue's dispatch),
//!   `check.rs` (invariants);
//! - the queue side: `queue_side.rs`;
//! - the channel side: `channel_session.rs`, `channel_publish.rs`, `channel_consume.rs`,
//!   `channel_declare.rs`, `channel_hold.rs`, `channel_reply_to.rs`;
//! - topology: `topology_declare.rs`, `topology_vhosts.rs`, `topology_access.rs`,
//!   `topology_policies.rs`, `topology_retained.rs`.

pub mod admin;
mod admin_late;
mod alarm;
mod channel_consume;
mod channel_declare;
mod channel_hold;
mod channel_publish;
mod channel_reply_to;
mod channel_session;
mod check;
mod credit;
mod dead_letter;
mod delayed;
pub use delayed::{MAX_DELAY_MS, MEMORY_SCHEDULE_LIMIT};
mod dlx;
pub use dlx::Notice;
mod nodes;
mod nodes_consume;
pub use nodes::{NodeChannel, NodeConsumer, NodeGot, NodeMail, NodeRequest, NodeSettle};
mod post;
#[cfg(test)]
mod post_tests;
mod queue_side;
mod restore;
mod sync;
mod topology_access;
mod topology_declare;
mod topology_parameters;
mod topology_policies;
mod topology_retained;
mod topology_vhosts;

use crate::mail;
pub use crate::mail::ShardMail;
pub use alarm::{ALARM_HOLD_MS, Alarms, Resources};
use alarm::{ALARM_RECHECK_MS, STORE_RETRY_MS};

use credit::ChannelCredit;

use crate::channel::Phase;
use crate::channel::side::ChannelSide;
use crate::command::{Op, OpKind};
use crate::config::BrokerConfig;
use crate::effect::Effect;
use crate::error::{ErrorCode, ProtocolError};
use crate::ids::{ChannelAddr, ChannelRef, ConnId, QueueId, VhostId};
use crate::mail::mailbox::RESTORE_CONN;
use crate::naming::NameGen;
use crate::queue::side::QueueSide;
use crate::queue::state::{QueueIo, QueueOut};
use crate::store::{Definitions, Store};
use crate::topology::Topology;
use std::collections::VecDeque;
use std::sync::Arc;

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
    /// The queue side's state: the queues this shard owns (`crate::queue::side`).
    qs: QueueSide,
    /// The channel side's state: connections, channels, holds, reply-to addresses
    /// (`crate::channel::side`).
    chans: ChannelSide,
    effects: Vec<Effect>,
    /// Operators' ops answered by another shard, and their answers (`admin_late`).
    admin_late: admin_late::LateAdmin,
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
    /// Without a store: the host's stream logs, shared with its stream protocol listener
    /// (`set_shared_streams`); `None`: each stream queue keeps its own log.
    shared_streams: Option<Arc<dyn crate::store::SharedStreams>>,
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
    /// Messages on their way to a dead-letter exchange.
    dead_letters: VecDeque<dead_letter::DeadLetter>,
    /// At-least-once dead letters being forwarded (`dlx.rs`).
    dlx: dlx::DlxWorker,
    /// Mail between the queue and channel sides, delivered at the end of each operation
    /// (`mail.rs`).
    mail: mail::Mailbox,
    /// The host delivers mail (`deliver_mail`) instead of each operation: the multi-shard
    /// simulation's model of mail that takes time (`set_mail_scheduled`).
    mail_scheduled: bool,
    /// Commits waiting for the sync of an epoch, in epoch order.
    tx_sync_waiters: VecDeque<(u64, ChannelAddr)>,
    /// No-ack deliveries whose channel closed while they travelled (lost, as in RabbitMQ).
    lost_in_flight: u64,
    /// Messages routed to a queue that was deleted before they reached it.
    routed_to_deleted: u64,
    /// Messages `mqtt-qos0` queues dropped: none of their consumers had credit.
    qos0_dropped: u64,
    /// The message counts of closed connections, per vhost (operators' totals never fall).
    closed_stats: std::collections::BTreeMap<VhostId, crate::stats::MessageStats>,
    /// Deliveries requeued (rejected, recovered, or left by a closed channel) after their
    /// queue was deleted: they went with it.
    requeued_to_deleted: u64,
    /// This broker's shard and the number of shards (`set_shard`).
    shard: u32,
    shards: u32,
    /// Queues on other cluster nodes and publishes forwarded to them (`nodes.rs`).
    nodes: nodes::Nodes,
    /// Delayed messages of this shard's publishers (`delayed.rs`).
    schedule: crate::schedule::Schedule,
    /// Scheduled messages routed when due, and those that reached no queue (or whose
    /// exchange was gone).
    scheduled_routed: u64,
    scheduled_dropped: u64,
}

type OpResult = Result<(), ProtocolError>;

impl Broker {
    /// The current routing table: clone the `Arc` to route publishes outside the broker
    /// (see `routing.rs` for what the broker guarantees about such publishes).
    pub fn routes(&self) -> &Arc<crate::routing::RouteTable> {
        self.topo.routes()
    }
}

impl Broker {}

impl Broker {
    /// A broker without storage (everything stays in memory), with the default vhost and user.
    pub fn new(config: BrokerConfig) -> Broker {
        let mut broker = Broker {
            names: NameGen::new(config.seed),
            topo: Topology::new(),
            qs: QueueSide::default(),
            chans: ChannelSide::default(),
            config,
            now: 0,
            next_id: 1,
            next_vhost: 0,
            effects: Vec::new(),
            admin_late: admin_late::LateAdmin::default(),
            stored_bytes: 0,
            shared_bytes: None,
            alarm: false,
            alarm_changed_at: 0,
            alarms: Alarms::default(),
            resources: Resources::default(),
            store: None,
            shared_streams: None,
            epoch: 1,
            sync_in_flight: false,
            sync_dirty: false,
            removed_since: None,
            confirm_waiters: VecDeque::new(),
            remote_answers: VecDeque::new(),
            synced_epoch: None,
            store_failed_at: None,
            restoring: false,
            dead_letters: VecDeque::new(),
            dlx: dlx::DlxWorker::default(),
            mail: mail::Mailbox::default(),
            mail_scheduled: false,
            tx_sync_waiters: VecDeque::new(),
            closed_stats: std::collections::BTreeMap::new(),
            lost_in_flight: 0,
            routed_to_deleted: 0,
            qos0_dropped: 0,
            requeued_to_deleted: 0,
            shard: 0,
            shards: 1,
            nodes: nodes::Nodes::default(),
            schedule: crate::schedule::Schedule::default(),
            scheduled_routed: 0,
            scheduled_dropped: 0,
        };
        broker.create_defaults();
        broker
    }

    /// A broker that keeps durable definitions and messages in `store`, and pages messages
    /// out of memory into it. Call [`Broker::restore`] next to bring back what it holds.
    pub fn with_store(config: BrokerConfig, store: Box<dyn Store>) -> Broker {
        let mut broker = Broker::new(config);
        broker.store = Some(store);
        broker.open_schedule();
        broker
    }

    /// Without a store, stream queues declared from now on keep their logs in `streams`,
    /// which the host shares with its stream protocol listener (one stream for both
    /// protocols); the host calls [`Broker::streams_grew`] when the listener appends.
    pub fn set_shared_streams(&mut self, streams: Arc<dyn crate::store::SharedStreams>) {
        self.shared_streams = Some(streams);
    }

    /// How many consumers read this shard's stream queues, for the host to ask after it
    /// appended to a stream before it calls [`Broker::streams_grew`] (a shard nobody reads
    /// streams on need not be woken; the type's docs hold the ordering contract).
    pub fn stream_readers(&self) -> crate::queue::StreamReaders {
        self.qs.stream_readers.clone()
    }

    /// Streams `(vhost, name)` grew by appends the broker did not make (the stream
    /// protocol's publishers): their queues' consumers that wait for messages get them now.
    pub fn streams_grew(&mut self, now: u64, streams: &[(String, String)]) {
        self.now = self.now.max(now);
        let grew: Vec<QueueId> = self
            .qs
            .streams
            .iter()
            .copied()
            .filter(|id| {
                self.qs.queues.get(id).is_some_and(|q| {
                    q.stream_ref().is_some_and(|s| s.has_cursors())
                        && streams
                            .iter()
                            .any(|(v, n)| *n == *q.name && v == self.vhost_name(q.vhost))
                })
            })
            .collect();
        for id in grew {
            self.mail.from(mail::Dest::Queue(id));
            self.dispatch(id);
        }
        self.after_op();
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
    pub(super) fn run_op(&mut self, ch: ChannelRef, op: Op) {
        let routes_before = self.topo.routes().version();
        self.apply_now(ch, op);
        self.saw_routes(ch.conn, routes_before);
    }

    #[inline]
    pub(super) fn apply_now(&mut self, ch: ChannelRef, op: Op) {
        if let Err(error) = self.apply(ch, op) {
            self.fail(ch, error);
        }
    }

    /// Connection `conn` saw its own routing changes since `before` (`routes_seen`).
    pub(super) fn saw_routes(&mut self, conn: ConnId, before: u64) {
        let after = self.topo.routes().version();
        if after != before {
            self.saw_version(conn, after);
        }
    }

    /// Connection `conn` was answered on routing table `version`: it routes on no older
    /// one from now on (a client sees its own topology changes).
    pub(super) fn saw_version(&mut self, conn: ConnId, version: u64) {
        if let Some(c) = self.chans.conns.get_mut(&conn) {
            c.routes_seen = c.routes_seen.max(version);
        }
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
        self.feed_starving();
        self.release_held_refills();
        let expiring: Vec<QueueId> = self.qs.expiring.iter().copied().collect();
        for id in expiring {
            self.mail.from(mail::Dest::Queue(id));
            let Some(q) = self.qs.queues.get(&id) else {
                self.qs.expiring.remove(&id);
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
        self.expire_node_requests();
        if delayed::DELAYED && self.schedule.next_due().is_some_and(|at| at <= self.now) {
            self.route_due();
        }
        self.after_op();
    }

    /// What every entry point does last: delivers the mail, routes the dead letters (whose
    /// enqueues send mail again), and updates the memory alarm.
    pub(super) fn after_op(&mut self) {
        if !self.mail_scheduled {
            self.pump();
        }
        self.mail.from(mail::Dest::Host);
        self.route_dead_letters();
        self.forward_due_dead_letters();
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
        if let Some(at) = self.dead_letters_due() {
            // Dead letters waiting to be forwarded again (`dlx.rs`).
            earliest(at.max(self.now));
        }
        if self.alarm && !self.alarms.any() {
            // Every alarm cleared during the hold: unblock when it ends.
            earliest(self.alarm_changed_at.saturating_add(ALARM_HOLD_MS));
        }
        if let Some(at) = self.removed_since {
            earliest(at.saturating_add(self.config.removal_sync_ms));
        }
        if let Some(at) = self.node_request_deadline() {
            earliest(at);
        }
        if delayed::DELAYED
            && let Some(at) = self.schedule_deadline()
        {
            // The earliest scheduled message (`delayed.rs`): one timer per shard.
            earliest(at.max(self.now));
        }
        if self.alarm && self.shared_bytes.is_some() {
            // Other shards' consumers may drain the sum below the watermark while this
            // shard's publishers, blocked, send nothing: look again soon.
            earliest(self.now.saturating_add(ALARM_RECHECK_MS));
        }
        if let Some(since) = self.qs.refill_held_since {
            // Stream consumers held for a fuller refill (`queue::stream::Room`).
            earliest(since.saturating_add(crate::queue::stream::REFILL_HOLD_MS));
        }
        if !self.qs.starving.is_empty() {
            // Paused publishers of an empty queue: the next wave (`feed_starving`).
            earliest(self.now.saturating_add(1));
        }
        for id in &self.qs.expiring {
            let Some(q) = self.qs.queues.get(id) else {
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
        if self.admin_late.waiting() {
            self.take_late_admin_effects();
        }
        out.append(&mut self.effects);
    }

    /// Ready messages in a queue of the default vhost, in memory and paged out (for hosts,
    /// tests and admin tools).
    pub fn queue_len(&self, name: &str) -> Option<usize> {
        let id = self.topo.routes().queue(self.topo.default_vhost, name)?;
        self.qs.queues.get(&id).map(|q| q.messages.len())
    }

    /// Number of queues and exchanges, for admin tools and tests.
    pub fn counts(&self) -> (usize, usize) {
        (self.qs.queues.len(), self.topo.exchange_count())
    }

    pub(super) fn next_id(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    /// A new id that says it belongs to `shard` (`id % shards == shard`), never reused:
    /// queues (on their owner's shard) and consumers (on their channel's), which shards
    /// allocate side by side.
    pub(super) fn id_on(&mut self, shard: u32) -> u64 {
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
            self.chans.conns.is_empty() && self.qs.queues.is_empty(),
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
    pub(super) fn conn_shard(&self, conn: ConnId) -> u32 {
        self.mail.shard_of(mail::Dest::Conn(conn))
    }

    /// The shard that owns queue `id`.
    pub(super) fn queue_shard(&self, id: QueueId) -> u32 {
        self.mail.shard_of(mail::Dest::Queue(id))
    }

    pub(super) fn apply(&mut self, ch: ChannelRef, op: Op) -> OpResult {
        if let Op::ConnectionOpen {
            vhost,
            user,
            cancel_notify,
        } = op
        {
            return self.connection_open(ch.conn, vhost, user, cancel_notify);
        }
        if !self.chans.conns.contains_key(&ch.conn) {
            // A connection that already failed or closed: its late ops are moot.
            return Ok(());
        }
        match op {
            Op::ConnectionOpen { .. } => Ok(()),
            Op::ClientId(id) => {
                if crate::access::TOPIC_PERMISSIONS
                    && let Some(conn) = self.chans.conns.get_mut(&ch.conn)
                {
                    let users = &self.topo.users;
                    conn.perms = conn.perms.as_ref().map(|p| users.for_client(p, &id));
                    conn.client_id = Some(std::sync::Arc::from(id));
                }
                Ok(())
            }
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
                if self.chans.channels.contains_key(&ch) {
                    self.release_channel(ch);
                    self.chans.remove_channel(ch);
                }
                Ok(())
            }
            op => {
                match self.chans.channels.get(&ch).map(|c| c.phase) {
                    Some(Phase::Open) => {}
                    // After a channel error everything but the close handshake is dropped.
                    Some(Phase::Closing) => {
                        if matches!(op, Op::ChannelClose) {
                            // The client's close crossed our channel.close (it was sent
                            // before the client saw the error): it is answered, as
                            // RabbitMQ does, and the channel stays until the client's
                            // close-ok to ours. Unanswered, the client waits forever.
                            self.reply(ch, crate::effect::Reply::ChannelCloseOk);
                        }
                        return Ok(());
                    }
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

    pub(super) fn channel_op(&mut self, ch: ChannelRef, op: Op) -> OpResult {
        match op {
            Op::ChannelClose => {
                self.release_channel(ch);
                self.chans.remove_channel(ch);
                self.reply(ch, crate::effect::Reply::ChannelCloseOk);
                Ok(())
            }
            Op::Refuse(e) => Err(e),
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
            Op::Retain {
                mut message,
                durable,
            } => {
                message.stored_at = self.now;
                self.retained_op(ch, mail::TopologyRequest::Retain { message, durable })
            }
            Op::RetainedGet { filter, max } => {
                self.retained_op(ch, mail::TopologyRequest::RetainedGet { filter, max })
            }
            Op::ConnectionOpen { .. }
            | Op::ClientId(_)
            | Op::ConnectionClose
            | Op::ChannelOpen
            | Op::ChannelCloseOk
            | Op::Written { .. } => Ok(()),
        }
    }

    /// Reports an error: a channel exception closes the channel, anything else the connection.
    pub(super) fn fail(&mut self, ch: ChannelRef, error: ProtocolError) {
        let channel_open = matches!(
            self.chans.channels.get(&ch).map(|c| c.phase),
            Some(Phase::Open)
        );
        if error.code.is_channel_level() && ch.channel != 0 && channel_open {
            self.drop_hold(ch);
            self.release_channel(ch);
            if let Some(channel) = self.chans.channels.get_mut(&ch) {
                channel.close();
            }
            self.effects.push(Effect::ChannelError { ch, error });
        } else if self.chans.conns.contains_key(&ch.conn) {
            self.release_connection(ch.conn);
            self.effects.push(Effect::ConnectionError {
                conn: ch.conn,
                error,
            });
        }
    }

    pub(super) fn reply(&mut self, ch: ChannelRef, reply: crate::effect::Reply) {
        self.effects.push(Effect::Reply { ch, reply });
    }

    /// The vhost of a connection (internal connections without one: the default vhost).
    pub(super) fn conn_vhost(&self, conn: ConnId) -> VhostId {
        self.chans
            .conns
            .get(&conn)
            .map_or(self.topo.default_vhost, |c| c.vhost)
    }

    pub(super) fn vhost_name(&self, vhost: VhostId) -> &str {
        self.topo.vhost_name(vhost)
    }
}

impl Broker {}
