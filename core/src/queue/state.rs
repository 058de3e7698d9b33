//! One queue's state and every operation that needs nothing but the queue: enqueue under
//! length limits and TTLs, paging to and from the store, picking the consumer the next
//! message goes to, settling deliveries, purge.
//!
//! This is the unit that gets an owner of its own (ARCHITECTURE.md, "warren-runtime"), so it
//! holds no reference to the rest of the broker:
//! - what it needs from outside comes in as arguments: `QueueIo` (the store, the clock, the
//!   limits) and `Credit` (whether a channel may take one more delivery: the shared
//!   prefetch of a channel and the write window of a connection span several queues);
//! - what the broker must do elsewhere goes out in `QueueOut` (bytes held and released for
//!   the memory alarm, a failed store write, a durable write to sync, dead letters).
//!
//! Consumers live in the queue they consume from: the queue keeps their per-consumer credit
//! (prefetch and unacked count), so dispatch reads nothing outside the queue but `Credit`.

use crate::config::BrokerConfig;
use crate::ids::QueueId;
pub(crate) use crate::mail::delivery::{ConsumerId, Picked, QueueConsumer, Settle, Unacked};
use crate::message::{FieldTable, Message};
use crate::queue::classic::{MessageQueue, QueuedMessage};
use crate::queue::kind::{QueueBehaviour, QueueType};
use crate::queue::quorum::{self, Applied, Command, Fifo};
use crate::queue::stream::STREAMS;
use crate::queue_args::{HeldArgs, Overflow};
use crate::store::Store;
use std::sync::Arc;

/// How many times the window a queue keeps transient messages in memory before paging
/// them out (see `enqueue`).
const TRANSIENT_WINDOW_FACTOR: usize = 4;

/// Whether a channel may take one more delivery now, by the limits that span queues: the
/// channel's shared (global) prefetch, counted only for deliveries that need an ack, and
/// its connection's write window.
pub(crate) trait Credit {
    /// Whether consumer `c`'s channel may take one more delivery now: a check, since
    /// dispatch may look at several consumers before it picks one. False if that opening
    /// of the channel is gone or closing (its consumers' cancels are on their way).
    fn may_deliver(&self, c: &QueueConsumer) -> bool;

    /// Takes the credit of one delivery to consumer `c`, the one dispatch picked. False if
    /// it is gone: owners running side by side can race for a channel's shared limit, and
    /// the loser stops dispatching until credit comes back.
    fn take(&mut self, c: &QueueConsumer) -> bool;

    /// Returns credit taken for a delivery that did not happen.
    fn give_back(&mut self, c: &QueueConsumer);
}

/// Why a message was dead-lettered (`x-death` `reason`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DeathReason {
    Rejected,
    Expired,
    MaxLen,
    /// Returned more often than the quorum queue's `x-delivery-limit`.
    DeliveryLimit,
}

impl DeathReason {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            DeathReason::Rejected => "rejected",
            DeathReason::Expired => "expired",
            DeathReason::MaxLen => "maxlen",
            DeathReason::DeliveryLimit => "delivery_limit",
        }
    }
}

/// Where `enqueue` put a message.
pub(crate) enum Enqueued {
    /// In memory only (or paged out as a transient message): no sync needed.
    Memory,
    /// In the store for a durable queue: its confirm waits for a sync.
    Durable,
    /// The store refused it: not enqueued.
    Failed,
    /// The queue is full and refuses publishes (`x-overflow` reject-publish[-dlx]).
    Rejected,
}

/// What a queue operation needs from outside the queue.
pub(crate) struct QueueIo<'a> {
    pub(crate) store: Option<&'a mut (dyn Store + 'static)>,
    pub(crate) config: &'a BrokerConfig,
    pub(crate) now: u64,
    /// Message memory is past half the alarm watermark: transient messages page out early.
    pub(crate) memory_tight: bool,
    pub(crate) out: QueueOut,
}

/// What a queue operation asks the rest of the broker to do.
#[derive(Default)]
pub(crate) struct QueueOut {
    /// Body bytes that entered the broker's custody (memory alarm accounting).
    pub(crate) held: u64,
    /// Body bytes that left it.
    pub(crate) released: u64,
    /// A store write or read failed (publishers are blocked for a while).
    pub(crate) store_failed: bool,
    /// A durable write happened: the next sync must cover it.
    pub(crate) durable_write: bool,
    /// A stored message was removed (acked, dropped, purged): a sync must cover it within
    /// `BrokerConfig::removal_sync_ms`.
    pub(crate) removed: bool,
    /// The queue now holds a message with a deadline: `tick` must look at it.
    pub(crate) expiring: bool,
    /// A stream consumer with some free prefetch was held back until more is free
    /// (`queue::stream::Room::Held`): `tick` lets it go if its acks stop short of that.
    pub(crate) refill_held: bool,
    /// Messages to dead-letter (or drop, without a dead-letter exchange), in order.
    pub(crate) dead: Vec<(Arc<Message>, DeathReason)>,
}

impl<'a> QueueIo<'a> {
    pub(crate) fn new(
        store: Option<&'a mut (dyn Store + 'static)>,
        config: &'a BrokerConfig,
        now: u64,
        memory_tight: bool,
    ) -> QueueIo<'a> {
        QueueIo {
            store,
            config,
            now,
            memory_tight,
            out: QueueOut::default(),
        }
    }
}

pub(crate) struct QueueState {
    pub(crate) id: QueueId,
    pub(crate) vhost: crate::ids::VhostId,
    pub(crate) name: Arc<str>,
    pub(crate) durable: bool,
    pub(crate) exclusive_owner: Option<crate::ids::ConnId>,
    pub(crate) auto_delete: bool,
    /// The arguments as declared (for equivalence checks and export); `None` when empty, as
    /// for most queues, and one allocation for the queues of a shard declared with equal
    /// ones (`set_arguments`): every MQTT QoS 0 session's queue is declared with
    /// `x-queue-type: mqtt-qos0`, and a table of one entry is a ~700-byte B-tree node.
    pub(crate) arguments: Option<Arc<FieldTable>>,
    pub(crate) messages: MessageQueue,
    /// In arrival order, which is round-robin order (and id order).
    pub(crate) consumers: Vec<QueueConsumer>,
    pub(crate) rr_next: usize,
    /// Auto-delete applies only to a queue that has had a consumer.
    pub(crate) had_consumer: bool,
    pub(crate) unacked: u64,
    /// Publishing connections this queue has paused (flow control).
    pub(crate) pausing: Pausing,
    /// The parsed `x-` arguments (TTL, limits, dead-lettering, single active consumer).
    pub(crate) args: HeldArgs,
    /// Its consumers have different `x-priority` values (dispatch then looks for the
    /// highest; otherwise it takes the first with credit).
    pub(crate) mixed_priorities: bool,
    /// When it was last used (declared, consumed from, read with basic.get): `x-expires`
    /// counts from here while it has no consumers.
    pub(crate) last_used: u64,
    /// Enqueued, delivered, redelivered and acked messages, for operators' rates.
    pub(crate) stats: crate::stats::MessageStats,
    /// A stream's state (`x-queue-type: stream`): its log is the store's, and `messages`
    /// stays empty; the behaviour below hands every operation to it.
    pub(crate) stream: Option<Box<crate::queue::stream::StreamQueue>>,
    /// A quorum queue's own state (`queue::quorum`); `None` for a classic queue.
    pub(crate) quorum: Option<Box<Fifo>>,
    /// An `mqtt-qos0` queue: it holds nothing (`direct_delivery`), `messages` stays empty.
    pub(crate) direct: bool,
    /// Which serving of the queue this is: it grows when the queue is reloaded (a quorum
    /// queue's leader moved, `reload`), below `FROM_NODE`. Each delivery carries it
    /// (`QueuedMessage::epoch`); a settle of a delivery of another epoch is stale and
    /// ignored (`settle`).
    pub(crate) epoch: u32,
}

/// Publishing connections a queue has paused (flow control), in pause order, and when the
/// next of them resume: boxed, since few queues ever pause anyone.
#[derive(Default)]
pub(crate) struct Pausing(Option<Box<Paused>>);

pub(crate) struct Paused {
    conns: Vec<crate::ids::ConnId>,
    /// The next wave resumes once the queue is down to this many ready messages.
    wave_at: usize,
    /// The queue's deliveries (`MessageStats::deliver_get`) at the last pause or wave.
    since: u64,
}

/// Paused publishers resumed together as their queue drains (`Pausing::take_wave`). Each
/// resumed publisher brings what it had read and routed before its next pause arrives (up
/// to four op batches of one socket read each, a few hundred small messages), so resuming
/// all of a hundred at once overshot the mark by tens of thousands of messages, which an
/// `mqtt-qos0` queue then dropped (docs/benchmarks.md, 2026-11-24). Four publishers of one
/// wave keep a consumer fed (one alone delivers 465k msg/s over MQTT) and overshoot by far
/// less than the flow mark.
pub(crate) const RESUME_WAVE: usize = 4;

impl Pausing {
    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_none()
    }

    pub(crate) fn contains(&self, conn: &crate::ids::ConnId) -> bool {
        self.0.as_ref().is_some_and(|p| p.conns.contains(conn))
    }

    /// Pauses `conn` (it goes last in line); the next wave waits until the queue is down to
    /// `low` ready messages again. `delivered`: the queue's deliveries so far.
    pub(crate) fn push(&mut self, conn: crate::ids::ConnId, low: usize, delivered: u64) {
        let p = self.0.get_or_insert_with(|| {
            Box::new(Paused {
                conns: Vec::new(),
                wave_at: low,
                since: delivered,
            })
        });
        p.conns.push(conn);
        p.wave_at = low;
        p.since = delivered;
    }

    pub(crate) fn remove(&mut self, conn: crate::ids::ConnId) {
        if let Some(p) = self.0.as_mut() {
            p.conns.retain(|&c| c != conn);
            if p.conns.is_empty() {
                self.0 = None;
            }
        }
    }

    /// Every paused connection, in pause order, leaving none.
    pub(crate) fn take(&mut self) -> Vec<crate::ids::ConnId> {
        self.0.take().map(|p| p.conns).unwrap_or_default()
    }

    /// The publishers to resume now that the queue holds `ready` messages and has made
    /// `delivered` deliveries, with flow mark `high`. A wave is the `RESUME_WAVE` paused
    /// longest (fair: a publisher paused again goes last). One goes once the queue is down
    /// to the wave mark (half the flow mark after a pause), and the mark halves, so a wave
    /// that does not refill the queue is followed by another before it runs dry; one also
    /// goes whenever twice the flow mark was delivered since the last pause or wave and the
    /// queue is not above the mark (publishers that keep it just fed, never paused again,
    /// would otherwise keep the paused ones waiting forever); and one each time it is asked
    /// while the queue is empty. Never everyone at once: under load resumed publishers take
    /// milliseconds to answer, and a queue that ran dry meanwhile then got every paused
    /// publisher's reads at once, far past its bound.
    pub(crate) fn take_wave(
        &mut self,
        ready: usize,
        delivered: u64,
        high: usize,
    ) -> Vec<crate::ids::ConnId> {
        let Some(p) = self.0.as_mut() else {
            return Vec::new();
        };
        let turn = ready <= high && delivered.saturating_sub(p.since) >= 2 * high as u64;
        if ready > p.wave_at && ready > 0 && !turn {
            return Vec::new();
        }
        if ready <= p.wave_at {
            p.wave_at = ready / 2;
        }
        p.since = delivered;
        if p.conns.len() <= RESUME_WAVE {
            return self.take();
        }
        p.conns.drain(..RESUME_WAVE).collect()
    }
}

/// The arguments of a queue that declares none.
static NO_ARGUMENTS: FieldTable = FieldTable::new();

/// When a message enqueued at `now` expires: the lower of the queue's and its own TTL.
fn expiry(now: u64, queue_ttl: Option<u64>, m: &Message) -> Option<u64> {
    let own = m
        .properties
        .expiration
        .as_deref()
        .and_then(|e| crate::queue_args::parse_expiration(e).ok());
    let ttl = match (queue_ttl, own) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }?;
    Some(now.saturating_add(ttl))
}

impl QueueState {
    /// A queue with no consumers, bindings or pauses yet: transient, not exclusive, not
    /// auto-delete and without arguments until the caller says otherwise.
    pub(crate) fn new(
        id: QueueId,
        vhost: crate::ids::VhostId,
        name: Arc<str>,
        messages: MessageQueue,
        now: u64,
    ) -> QueueState {
        QueueState {
            id,
            vhost,
            name,
            durable: false,
            exclusive_owner: None,
            auto_delete: false,
            arguments: None,
            messages,
            consumers: Vec::new(),
            rr_next: 0,
            had_consumer: false,
            unacked: 0,
            pausing: Pausing::default(),
            args: HeldArgs::default(),
            mixed_priorities: false,
            last_used: now,
            stats: crate::stats::MessageStats::default(),
            stream: None,
            quorum: None,
            direct: false,
            epoch: 0,
        }
    }

    /// A stream's state; always `None` when streams are left out of the build (`streams`
    /// feature), which lets the compiler drop their code.
    pub(crate) fn stream_mut(&mut self) -> Option<&mut crate::queue::stream::StreamQueue> {
        if !STREAMS {
            return None;
        }
        self.stream.as_deref_mut()
    }

    pub(crate) fn stream_ref(&self) -> Option<&crate::queue::stream::StreamQueue> {
        if !STREAMS {
            return None;
        }
        self.stream.as_deref()
    }

    /// Sets the parsed arguments (at creation, and when policies change). A quorum queue
    /// takes them as RabbitMQ 3.10 does: `reject-publish-dlx` acts as drop-head, and
    /// at-least-once dead-lettering without reject-publish falls back to at-most-once
    /// (RabbitMQ's `dlh/5`); its delivery limit goes to its state machine.
    /// `last`: the arguments last set on a queue of the shard, shared when equal.
    pub(crate) fn set_args(
        &mut self,
        mut args: crate::queue_args::QueueArgs,
        last: &mut Option<std::sync::Arc<crate::queue_args::QueueArgs>>,
    ) {
        if let Some(fifo) = self
            .quorum
            .as_deref_mut()
            .filter(|_| crate::queue::quorum::QUORUM)
        {
            if args.overflow == Overflow::RejectPublishDlx {
                args.overflow = Overflow::DropHead;
            }
            if args.overflow != Overflow::RejectPublish {
                args.dead_letter_strategy = crate::queue_args::DeadLetterStrategy::AtMostOnce;
            }
            fifo.apply(Command::Limit {
                limit: args.delivery_limit,
            });
        }
        self.args = HeldArgs::shared(args, last);
    }

    /// `last`: the arguments last set on a queue of the shard, shared when equal (as
    /// `set_args` shares the parsed ones).
    pub(crate) fn set_arguments(
        &mut self,
        arguments: FieldTable,
        last: &mut Option<Arc<FieldTable>>,
    ) {
        self.arguments = if arguments.is_empty() {
            None
        } else {
            match last {
                Some(held) if **held == arguments => Some(Arc::clone(held)),
                _ => {
                    let held = Arc::new(arguments);
                    *last = Some(Arc::clone(&held));
                    Some(held)
                }
            }
        };
    }

    /// The arguments as declared.
    pub(crate) fn arguments(&self) -> &FieldTable {
        self.arguments.as_deref().unwrap_or(&NO_ARGUMENTS)
    }

    /// Whether adding a message of `len` body bytes takes the queue over a length limit.
    /// A quorum queue's dead letters still owed to their targets count too, as RabbitMQ
    /// counts its "dlx" messages (so at-least-once dead-lettering cannot grow a queue past
    /// its limits).
    fn would_overflow(&self, len: u64) -> bool {
        let (dead, dead_bytes) = self.dead_held();
        self.args
            .max_length
            .is_some_and(|max| self.messages.len() as u64 + dead >= max)
            || self
                .args
                .max_length_bytes
                .is_some_and(|max| self.messages.total_bytes() + dead_bytes + len > max)
    }

    /// Over its length limit with `drop-head`: drops (dead-letters) from the head until the
    /// queue fits again.
    pub(crate) fn drop_overflow(&mut self, io: &mut QueueIo<'_>) {
        loop {
            let over_count = self
                .args
                .max_length
                .is_some_and(|max| self.messages.len() as u64 > max);
            let over_bytes = self
                .args
                .max_length_bytes
                .is_some_and(|max| self.messages.total_bytes() > max);
            if !(over_count || over_bytes) {
                return;
            }
            let Some(m) = self.pop_ready(io) else {
                return;
            };
            self.forget(io, m.seq, m.stored, m.message.body_len());
            io.out.dead.push((m.message, DeathReason::MaxLen));
        }
    }

    /// Makes sure the window holds the queue's next message when any is paged out.
    fn fill_window(&mut self, io: &mut QueueIo<'_>) -> bool {
        // A priority queue reads back everything (bounded by what it holds).
        while self.messages.needs_load() {
            if !self.load_batch(io) {
                return false;
            }
            if !self.messages.is_priority() {
                return true;
            }
        }
        true
    }

    /// Reads one batch of paged-out messages back into memory.
    fn load_batch(&mut self, io: &mut QueueIo<'_>) -> bool {
        let paged = self.messages.paged();
        // Read back a window's worth, by count and by bytes (big messages come fewer at a
        // time).
        let average = (paged.bytes / paged.count.max(1)).max(1);
        let by_bytes =
            usize::try_from(io.config.queue_window_bytes / average).unwrap_or(usize::MAX);
        let max = io.config.queue_window.min(by_bytes).max(1);
        let mut batch = Vec::new();
        let read = match io.store.as_deref_mut() {
            Some(store) => store.read(self.id, paged.from_seq, max, &mut batch),
            None => Ok(()),
        };
        if read.is_err() {
            io.out.store_failed = true;
            return false;
        }
        if batch.is_empty() {
            // The store has nothing where it reported messages: do not wait forever.
            self.messages.forget_paged();
            return false;
        }
        io.out.held += self.messages.load(batch);
        true
    }

    /// A replicated quorum queue changed hands on this node (docs/cluster.md, "Quorum
    /// queues"): the ready messages it held in memory are dropped without touching the store
    /// (the group's log, not this node, decides what the queue holds), and the queue takes
    /// what the store now recovers for it: the group's committed messages when this node
    /// leads the group, nothing when it does not. Its consumers stay; what they hold unacked
    /// is returned (as RabbitMQ returns a quorum queue's checked-out messages to the queue):
    /// the group still has every message not settled there, so the reloaded queue delivers
    /// them again, flagged redelivered, and each consumer's prefetch counts from 0. A settle
    /// of a delivery made before (its epoch is older) is stale and ignored (`settle`), as
    /// RabbitMQ ignores a settle of a message its consumer no longer has checked out.
    pub(crate) fn reload(&mut self, io: &mut QueueIo<'_>, vhost: &str) {
        while let Some(m) = self.messages.pop() {
            io.out.released += m.message.body_len() as u64;
        }
        self.epoch = self.epoch.wrapping_add(1) % crate::mail::delivery::FROM_NODE;
        for c in &mut self.consumers {
            c.unacked = 0;
        }
        self.unacked = 0;
        if let Some(fifo) = self
            .quorum
            .as_deref_mut()
            .filter(|_| crate::queue::quorum::QUORUM)
        {
            // The reloaded messages carry their delivery counts in their headers.
            fifo.returned_all();
        }
        self.forget_dead_letters(io);
        let Some(store) = io.store.as_deref_mut() else {
            return;
        };
        let recovery = store.open_queue(self.id, vhost, &self.name, self.durable);
        // Quorum queues have no priorities (`x-max-priority` is refused at declare).
        self.messages = MessageQueue::recovered(recovery, None);
        if crate::queue::quorum::QUORUM && self.quorum.is_some() {
            store.keep_every_message(self.id);
        }
        // The dead letters the group's log still owes: forwarded again from here.
        if self.at_least_once() {
            self.open_dead_letters(io, vhost);
        }
    }

    /// Takes the next ready message, reading paged-out messages back first when the window
    /// is empty.
    pub(crate) fn pop_ready(&mut self, io: &mut QueueIo<'_>) -> Option<QueuedMessage> {
        self.fill_window(io);
        let mut m = self.messages.pop()?;
        m.epoch = self.epoch;
        Some(m)
    }

    /// A message left the queue for good (acked, dropped, delivered without ack).
    fn forget(&mut self, io: &mut QueueIo<'_>, seq: u64, stored: bool, body_len: usize) {
        if let Some(fifo) = self
            .quorum
            .as_deref_mut()
            .filter(|_| crate::queue::quorum::QUORUM)
        {
            fifo.apply(Command::Settle { seq });
        }
        io.out.released += body_len as u64;
        if stored && let Some(store) = io.store.as_deref_mut() {
            store.remove(self.id, seq);
            io.out.removed = true;
        }
    }

    /// Whether consumer `c` may receive one more message now.
    fn can_deliver(c: &QueueConsumer, credit: &impl Credit) -> bool {
        (c.no_ack || c.prefetch == 0 || c.unacked < u32::from(c.prefetch)) && credit.may_deliver(c)
    }

    /// The index of the consumer the next message goes to: with `x-single-active-consumer`,
    /// only the first consumer (the next one takes over when it goes); otherwise
    /// round-robin among the consumers with credit and the highest `x-priority`.
    fn pick_consumer(&self, credit: &impl Credit) -> Option<usize> {
        if self.args.single_active_consumer {
            let first = self.consumers.first()?;
            return Self::can_deliver(first, credit).then_some(0);
        }
        let n = self.consumers.len();
        let start = self.rr_next % n.max(1);
        let mut order = (0..n).map(|i| (start + i) % n);
        if !self.mixed_priorities {
            return order.find(|&idx| Self::can_deliver(&self.consumers[idx], credit));
        }
        let mut best: Option<(i32, usize)> = None;
        for idx in order {
            let c = &self.consumers[idx];
            if Self::can_deliver(c, credit) && best.is_none_or(|(bp, _)| c.priority > bp) {
                best = Some((c.priority, idx));
            }
        }
        best.map(|(_, idx)| idx)
    }

    /// An `mqtt-qos0` queue's handling of a routed message while none waits in it, in
    /// place of enqueue and dispatch: the next consumer (round-robin) whose channel and
    /// connection have credit gets it now, without an ack (its consumers are no-ack,
    /// `Capabilities::no_ack_only`, so nothing stays behind); `None` if none has credit
    /// (the queue side then holds or drops it).
    pub(crate) fn direct_delivery(
        &mut self,
        credit: &mut impl Credit,
        message: &Arc<Message>,
    ) -> Option<Picked> {
        let picked = self.pick_consumer(credit).and_then(|idx| {
            let c = &self.consumers[idx];
            credit.take(c).then_some(idx)
        });
        let idx = picked?;
        self.stats.publish += 1;
        self.rr_next = (idx + 1) % self.consumers.len();
        self.stats.delivered(false);
        let c = &self.consumers[idx];
        Some(Picked {
            consumer: c.id,
            to: c.addr(),
            tag: c.tag.clone(),
            no_ack: true,
            message: QueuedMessage {
                seq: 0,
                message: message.clone(),
                redelivered: false,
                stored: false,
                expires_at: None,
                epoch: 0,
            },
        })
    }

    /// A quorum queue's checkout of message `m` (classic queues hand it on as it is): the
    /// delivery count goes in the `x-delivery-count` header, on every `basic.get` and on a
    /// consumer's delivery once it is above 0 (RabbitMQ 3.10's rule), and a counted
    /// message is a redelivery. A message recovered after a restart carries its count in
    /// its header.
    fn checkout(
        &mut self,
        mut m: QueuedMessage,
        consumer: Option<ConsumerId>,
        get: bool,
    ) -> QueuedMessage {
        let Some(fifo) = self
            .quorum
            .as_deref_mut()
            .filter(|_| crate::queue::quorum::QUORUM)
        else {
            return m;
        };
        if m.redelivered && fifo.count(m.seq) == 0 {
            let carried = quorum::header_count(&m.message);
            if carried > 0 {
                fifo.apply(Command::Enqueue {
                    seq: m.seq,
                    delivery_count: carried,
                });
            }
        }
        let checkout = Command::Checkout {
            seq: m.seq,
            consumer,
        };
        let count = match fifo.apply(checkout) {
            Applied::Count(n) => n,
            Applied::Done | Applied::OverLimit(_) => 0,
        };
        if count > 0 || get {
            m.message = quorum::with_count(&m.message, count);
        }
        m.redelivered |= count > 0;
        m
    }

    /// A quorum queue's return of delivery `u` (nack or reject with requeue, or its
    /// consumer or channel went): over `x-delivery-limit` it is dead-lettered (or dropped);
    /// otherwise it goes to the tail, as RabbitMQ 3.10 puts returns, re-appended to the
    /// store with its count in its header (so a restart keeps the count) and the old copy
    /// removed. Returns whether a message became ready.
    fn quorum_return(&mut self, io: &mut QueueIo<'_>, u: Unacked) -> bool {
        let to_seq = self.messages.next_seq();
        let returned = Command::Return { seq: u.seq, to_seq };
        let applied = match self
            .quorum
            .as_deref_mut()
            .filter(|_| crate::queue::quorum::QUORUM)
        {
            Some(fifo) => fifo.apply(returned),
            None => Applied::Done,
        };
        let count = match applied {
            Applied::Count(n) => n,
            Applied::OverLimit(_) | Applied::Done => {
                self.forget(io, u.seq, u.stored, u.message.body_len());
                io.out.dead.push((u.message, DeathReason::DeliveryLimit));
                return false;
            }
        };
        let message = quorum::with_count(&u.message, count);
        let len = message.body_len();
        let stored = match io.store.as_deref_mut() {
            Some(store) => {
                if store
                    .append(self.id, to_seq, &message, u.expires_at)
                    .is_err()
                {
                    // Back where it was, under its old number and with its count: the old
                    // copy stays stored, so a restart still has it. No alarm when the store
                    // only refused a queue this node does not serve now (a quorum queue
                    // whose leadership moved).
                    io.out.store_failed = store.serves(self.id);
                    if let Some(fifo) = self
                        .quorum
                        .as_deref_mut()
                        .filter(|_| crate::queue::quorum::QUORUM)
                    {
                        fifo.apply(Command::Enqueue {
                            seq: u.seq,
                            delivery_count: count,
                        });
                    }
                    self.messages
                        .requeue(u.seq, message, u.stored, u.expires_at);
                    return true;
                }
                if u.stored {
                    store.remove(self.id, u.seq);
                    io.out.removed = true;
                }
                io.out.durable_write = true;
                true
            }
            None => false,
        };
        if self.messages.paged().count > 0 {
            // Behind paged-out messages, it waits on disk too (order).
            self.messages.push_paged(to_seq, len as u64);
            io.out.released += len as u64;
        } else {
            self.messages.push(to_seq, message, stored, u.expires_at);
        }
        true
    }

    fn consumer_index(&self, id: ConsumerId) -> Option<usize> {
        self.consumers.binary_search_by_key(&id, |c| c.id).ok()
    }

    #[cfg(any(test, feature = "testing"))]
    pub(crate) fn consumer(&self, id: ConsumerId) -> Option<&QueueConsumer> {
        self.consumer_index(id).map(|i| &self.consumers[i])
    }

    fn refresh_priorities(&mut self) {
        let mut priorities = self.consumers.iter().map(|c| c.priority);
        self.mixed_priorities = match priorities.next() {
            Some(first) => priorities.any(|p| p != first),
            None => false,
        };
    }
}

/// The classic queue on the queue-type seam (`queue::kind`): what it does, beyond the
/// contract, is in the comments.
impl QueueBehaviour for QueueState {
    fn kind(&self) -> QueueType {
        if self.stream_ref().is_some() {
            return QueueType::Stream;
        }
        if self.direct {
            return QueueType::MqttQos0;
        }
        if crate::queue::quorum::QUORUM && self.quorum.is_some() {
            QueueType::Quorum
        } else {
            QueueType::Classic
        }
    }

    // Appends a routed message: into the window while it has room and nothing is paged
    // out, otherwise (with a store) into the store only. Persistent messages on durable
    // queues are stored either way. Applies the queue's length limit and TTL.
    fn enqueue(&mut self, io: &mut QueueIo<'_>, message: &Arc<Message>) -> Enqueued {
        if let Some(stream) = self.stream.as_deref_mut().filter(|_| STREAMS) {
            self.stats.publish += 1;
            return stream.enqueue(self.id, io, message);
        }
        let len = message.body_len() as u64;
        if self.args.overflow != Overflow::DropHead && self.would_overflow(len) {
            if self.args.overflow == Overflow::RejectPublishDlx {
                io.out.dead.push((message.clone(), DeathReason::MaxLen));
            }
            return Enqueued::Rejected;
        }
        self.stats.publish += 1;
        let expires_at = expiry(io.now, self.args.message_ttl, message);
        if expires_at.is_some() {
            io.out.expiring = true;
        }
        let Some(store) = io.store.as_deref_mut() else {
            let seq = self.messages.next_seq();
            self.messages.push(seq, message.clone(), false, expires_at);
            io.out.held += len;
            self.drop_overflow(io);
            return Enqueued::Memory;
        };
        let window = io.config.queue_window;
        // A quorum queue stores every message, whatever its delivery mode (RabbitMQ's
        // quorum queues have no transient messages).
        let persist = self.durable
            && (message.properties.is_persistent()
                || (crate::queue::quorum::QUORUM && self.quorum.is_some()));
        // A persistent message is written anyway, so keeping it out of memory costs only the
        // read back. A transient one would cost a write too: it pages out only at a larger
        // window (a burst above the flow-control mark stays in memory) or when message
        // memory passes half the alarm watermark.
        let (limit, limit_bytes) = if persist {
            (window, io.config.queue_window_bytes)
        } else {
            (
                window.saturating_mul(TRANSIENT_WINDOW_FACTOR),
                io.config
                    .queue_window_bytes
                    .saturating_mul(TRANSIENT_WINDOW_FACTOR as u64),
            )
        };
        let m = &self.messages;
        // Priority queues keep everything in memory (see `MessageQueue`).
        let page = !m.is_priority()
            && (m.paged().count > 0
                || m.in_memory() >= limit
                || m.bytes() >= limit_bytes
                || (io.memory_tight && m.in_memory() >= window));
        let seq = self.messages.next_seq();
        if !persist && !page {
            self.messages.push(seq, message.clone(), false, expires_at);
            io.out.held += len;
            self.drop_overflow(io);
            return Enqueued::Memory;
        }
        if store.append(self.id, seq, message, expires_at).is_err() {
            // The host logged why. The message is not taken (its publisher gets a nack), and
            // publishers are blocked for a while, unless the store only refused a queue
            // this node does not serve now (a quorum queue led elsewhere).
            io.out.store_failed = store.serves(self.id);
            return Enqueued::Failed;
        }
        if let Some(fifo) = self
            .quorum
            .as_deref_mut()
            .filter(|_| crate::queue::quorum::QUORUM)
        {
            fifo.apply(Command::Enqueue {
                seq,
                delivery_count: 0,
            });
        }
        if page {
            self.messages.push_paged(seq, len);
        } else {
            self.messages.push(seq, message.clone(), true, expires_at);
            io.out.held += len;
        }
        if persist {
            io.out.durable_write = true;
        }
        self.drop_overflow(io);
        if persist {
            Enqueued::Durable
        } else {
            Enqueued::Memory
        }
    }

    // Dead-letters (or drops) expired messages at the head: expiry is checked at the head
    // only, O(1) per message, as RabbitMQ does. A message expires once `now` passes its
    // deadline, so a TTL of 0 still reaches a consumer that is ready at publish time.
    fn expire_head(&mut self, io: &mut QueueIo<'_>) {
        // A stream's messages have no TTL: retention removes them.
        while self.stream_ref().is_none() && self.fill_window(io) {
            let expired = self
                .messages
                .head()
                .and_then(|m| m.expires_at)
                .is_some_and(|at| io.now > at);
            if !expired {
                return;
            }
            let Some(m) = self.messages.pop() else {
                return;
            };
            self.forget(io, m.seq, m.stored, m.message.body_len());
            io.out.dead.push((m.message, DeathReason::Expired));
        }
    }

    // Empties the ready messages (in memory and paged out); returns how many there were.
    fn purge(&mut self, io: &mut QueueIo<'_>) -> u64 {
        if let Some(fifo) = self
            .quorum
            .as_deref_mut()
            .filter(|_| crate::queue::quorum::QUORUM)
        {
            fifo.apply(Command::Purge);
        }
        let (window, paged) = self.messages.purge();
        let purged = window.len() as u64 + paged.count + self.purge_dead_letters(io);
        for m in window {
            self.forget(io, m.seq, m.stored, m.message.body_len());
        }
        if paged.count > 0
            && let Some(store) = io.store.as_deref_mut()
        {
            store.remove_from(self.id, paged.from_seq);
            io.out.removed = true;
        }
        purged
    }

    // Takes the next message for the next consumer with credit, if there are both, and
    // counts it against the consumer and, through `Credit::take`, against the limits that
    // span queues (a delivery without ack leaves the queue for good).
    // With `may_expire`, expired messages at the head are dead-lettered first.
    fn next_delivery(
        &mut self,
        io: &mut QueueIo<'_>,
        credit: &mut impl Credit,
        may_expire: bool,
    ) -> Option<Picked> {
        if let Some(stream) = self.stream.as_deref_mut().filter(|_| STREAMS) {
            let picked =
                stream.next_delivery(self.id, io, &mut self.consumers, &mut self.unacked, credit);
            if picked.is_some() {
                self.stats.delivered(false);
            }
            return picked;
        }
        if self.messages.is_empty() || self.consumers.is_empty() {
            return None;
        }
        let idx = self.pick_consumer(credit)?;
        if may_expire {
            self.expire_head(io);
            if self.messages.is_empty() {
                return None;
            }
        }
        let to = self.consumers[idx].addr();
        if !credit.take(&self.consumers[idx]) {
            return None;
        }
        let Some(m) = self.pop_ready(io) else {
            credit.give_back(&self.consumers[idx]);
            return None;
        };
        let n = self.consumers.len();
        self.rr_next = (idx + 1) % n;
        let m = self.checkout(m, Some(self.consumers[idx].id), false);
        self.stats.delivered(m.redelivered);
        let c = &mut self.consumers[idx];
        let picked = Picked {
            consumer: c.id,
            to,
            tag: c.tag.clone(),
            no_ack: c.no_ack,
            message: m,
        };
        if picked.no_ack {
            let m = &picked.message;
            self.forget(io, m.seq, m.stored, m.message.body_len());
        } else {
            c.unacked += 1;
            self.unacked += 1;
        }
        Some(picked)
    }

    // basic.get: the next ready message (with `may_expire`, expired ones are dead-lettered
    // first) and how many stay ready.
    fn get(
        &mut self,
        io: &mut QueueIo<'_>,
        no_ack: bool,
        may_expire: bool,
    ) -> Option<(QueuedMessage, u32)> {
        self.last_used = io.now;
        if may_expire {
            self.expire_head(io);
        }
        let m = self.pop_ready(io)?;
        let m = self.checkout(m, None, true);
        self.stats.delivered(m.redelivered);
        let ready = u32::try_from(self.messages.len()).unwrap_or(u32::MAX);
        if no_ack {
            self.forget(io, m.seq, m.stored, m.message.body_len());
        } else {
            self.unacked += 1;
        }
        Some((m, ready))
    }

    // Whether a new consumer (exclusive or not) is refused because the queue is in
    // exclusive use.
    fn in_exclusive_use(&self, exclusive: bool) -> bool {
        self.consumers.iter().any(|c| c.exclusive) || (exclusive && !self.consumers.is_empty())
    }

    fn add_consumer(&mut self, now: u64, c: QueueConsumer) {
        debug_assert!(
            self.consumers.last().is_none_or(|last| last.id < c.id),
            "consumer ids only grow"
        );
        if self.consumers.is_empty() {
            // Most queues have one consumer (an idle MQTT subscriber's): size it exactly.
            self.consumers.reserve_exact(1);
        }
        if let Some(fifo) = self
            .quorum
            .as_deref_mut()
            .filter(|_| crate::queue::quorum::QUORUM)
        {
            fifo.apply(Command::Consumer {
                id: c.id,
                attached: true,
            });
        }
        self.consumers.push(c);
        self.had_consumer = true;
        self.last_used = now;
        self.refresh_priorities();
    }

    // Removes a consumer (its unacked messages stay on their channel).
    fn remove_consumer(&mut self, now: u64, id: ConsumerId) -> Option<QueueConsumer> {
        let pos = self.consumer_index(id)?;
        let c = self.consumers.remove(pos);
        if let Some(stream) = self.stream_mut() {
            stream.remove_cursor(id);
        }
        if let Some(fifo) = self
            .quorum
            .as_deref_mut()
            .filter(|_| crate::queue::quorum::QUORUM)
        {
            fifo.apply(Command::Consumer {
                id,
                attached: false,
            });
        }
        if pos < self.rr_next {
            self.rr_next -= 1;
        }
        // x-expires counts from the moment the last consumer left.
        self.last_used = now;
        self.refresh_priorities();
        Some(c)
    }

    // A delivery of this queue was acked, requeued or rejected. Returns whether a message
    // went back to the ready list (dispatch may be due).
    fn settle(&mut self, io: &mut QueueIo<'_>, u: Unacked, settle: Settle) -> bool {
        if u.epoch != self.epoch {
            // Delivered before the queue was reloaded or moved: the message went back to the
            // queue then (or was never committed), and its consumer's prefetch was reset.
            // Only the body the channel held is let go.
            io.out.released += u.message.body_len() as u64;
            return false;
        }
        if let Some(i) = u.consumer.and_then(|id| self.consumer_index(id)) {
            let c = &mut self.consumers[i];
            c.unacked = c.unacked.saturating_sub(1);
        }
        self.unacked = self.unacked.saturating_sub(1);
        if self.stream_ref().is_some() {
            // A stream's settle only returns credit (nack and reject too, as RabbitMQ
            // 3.10 takes them): the message stays in the log for every consumer.
            self.stats.ack += u64::from(settle == Settle::Ack);
            io.out.released += u.message.body_len() as u64;
            return false;
        }
        if settle == Settle::Requeue && (crate::queue::quorum::QUORUM && self.quorum.is_some()) {
            return self.quorum_return(io, u);
        }
        if settle == Settle::Requeue {
            self.messages
                .requeue(u.seq, u.message, u.stored, u.expires_at);
            return true;
        }
        self.stats.ack += u64::from(settle == Settle::Ack);
        self.forget(io, u.seq, u.stored, u.message.body_len());
        if settle == Settle::Discard {
            io.out.dead.push((u.message, DeathReason::Rejected));
        }
        false
    }
}

#[cfg(test)]
#[path = "state_tests.rs"]
mod tests;
