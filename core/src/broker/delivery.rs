//! The message path: publish and route, dispatch to consumers under prefetch and write-window
//! credit, basic.get, ack/nack/reject/recover, publisher confirms and transactions.
//!
//! Nothing here waits on a round trip (seed 002): a publish is routed, enqueued, dispatched
//! and confirmed within one `handle` call; prefetch is a counter check per delivery.

use super::dead_letter::DeathReason;
use super::session::{TxOp, Unacked};
use super::{Broker, Consumer, ConsumerId, OpResult, PendingConfirm};
use crate::access::{Perm, Resource};
use crate::command::{Consume, OpKind, Publish};
use crate::effect::{Delivery, Effect, Reply};
use crate::error::{ErrorCode, ProtocolError};
use crate::idhash::IdMap;
use crate::ids::{ChannelRef, ConnId, ExchangeId, QueueId};
use crate::message::Message;
use crate::queue::args::Overflow;
use crate::queue::classic::QueuedMessage;
use std::collections::BTreeSet;
use std::sync::Arc;

/// Operations one transaction may buffer: bounds a channel's memory however long the
/// client keeps a transaction open.
const MAX_TX_OPS: usize = 65_536;

/// How many times the window a queue keeps transient messages in memory before paging
/// them out (see `enqueue`).
const TRANSIENT_WINDOW_FACTOR: usize = 4;

/// What to do with settled deliveries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Settle {
    Ack,
    Requeue,
    /// Rejected without requeue: dropped (dead-lettering comes with queue policies).
    Discard,
}

impl Settle {
    pub(crate) fn reject(requeue: bool) -> Settle {
        if requeue {
            Settle::Requeue
        } else {
            Settle::Discard
        }
    }
}

/// Where `enqueue` put a message.
pub(super) enum Enqueued {
    /// In memory only (or paged out as a transient message): no sync needed.
    Memory,
    /// In the store for a durable queue: its confirm waits for a sync.
    Durable,
    /// The store refused it: not enqueued.
    Failed,
    /// The queue is full and refuses publishes (`x-overflow` reject-publish[-dlx]).
    Rejected,
}

/// Whether a queue's consumers have different `x-priority` values (dispatch then looks for
/// the highest; otherwise it takes the first with credit).
fn mixed_priorities(
    queue_consumers: &[ConsumerId],
    consumers: &IdMap<ConsumerId, Consumer>,
) -> bool {
    let mut priorities = queue_consumers
        .iter()
        .filter_map(|cid| consumers.get(cid).map(|c| c.priority));
    let Some(first) = priorities.next() else {
        return false;
    };
    priorities.any(|p| p != first)
}

/// Whether adding a message of `len` body bytes takes the queue over a length limit.
fn would_overflow(q: &super::Queue, len: u64) -> bool {
    q.args
        .max_length
        .is_some_and(|max| q.messages.len() as u64 >= max)
        || q.args
            .max_length_bytes
            .is_some_and(|max| q.messages.total_bytes() + len > max)
}

/// When a message enqueued at `now` expires: the lower of the queue's and its own TTL.
fn expiry(now: u64, queue_ttl: Option<u64>, m: &Message) -> Option<u64> {
    let own = m
        .properties
        .expiration
        .as_deref()
        .and_then(|e| crate::queue::args::parse_expiration(e).ok());
    let ttl = match (queue_ttl, own) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }?;
    Some(now.saturating_add(ttl))
}

impl Broker {
    pub(super) fn publish(&mut self, ch: ChannelRef, mut p: Box<Publish>) -> OpResult {
        if let Some(rt) = p.properties.reply_to.as_deref()
            && let Some(address) = self.rewrite_reply_to(ch, rt)?
        {
            p.properties.reply_to = Some(address);
        }
        let op = OpKind::Publish;
        if p.immediate {
            return Err(ProtocolError::new(
                ErrorCode::NotImplemented,
                op,
                "immediate=true",
            ));
        }
        let exchange = self.exchange_id(ch, op, &p.exchange)?;
        self.check_access(ch, op, Perm::Write, Resource::Exchange, &p.exchange)?;
        if let Some(e) = p.properties.expiration.as_deref()
            && let Err(text) = crate::queue::args::parse_expiration(e)
        {
            return Err(ProtocolError::new(ErrorCode::PreconditionFailed, op, text));
        }
        if self.exchanges[&exchange].internal {
            return Err(ProtocolError::new(
                ErrorCode::AccessRefused,
                op,
                format!(
                    "cannot publish to internal exchange '{}' in vhost '{}'",
                    p.exchange,
                    self.vhost_name(self.exchanges[&exchange].vhost)
                ),
            ));
        }
        if let Some(tx) = self.channels.get_mut(&ch).and_then(|c| c.tx.as_mut()) {
            if tx.len() >= MAX_TX_OPS {
                return Err(too_large_tx(op));
            }
            // Routed at commit, against the table of that moment.
            p.routed = None;
            tx.push(TxOp::Publish(p));
            return Ok(());
        }
        self.route_and_enqueue(ch, exchange, p);
        Ok(())
    }

    fn route_and_enqueue(&mut self, ch: ChannelRef, exchange: ExchangeId, mut p: Box<Publish>) {
        let (queues, routed_any) = match p.routed.take() {
            Some(routed) if self.usable(ch, exchange, &routed) => {
                let routed_any = !routed.queues.is_empty();
                (self.still_routable(exchange, routed.queues), routed_any)
            }
            _ => {
                let queues = self.route(exchange, &p);
                let routed_any = !queues.is_empty();
                (queues, routed_any)
            }
        };
        let seq = self.channels.get_mut(&ch).and_then(|c| {
            let seq = c.confirm_next?;
            c.confirm_next = Some(seq + 1);
            Some(seq)
        });
        let mandatory = p.mandatory;
        let p = *p;
        let message = Arc::new(Message {
            exchange: p.exchange,
            routing_key: p.routing_key,
            properties: p.properties,
            body: p.body,
        });
        let (mut wait_sync, mut failed) = (false, false);
        if !routed_any {
            let is_reply = message.exchange.is_empty()
                && self.deliver_reply(&message.routing_key.clone(), &message);
            if mandatory && !is_reply {
                self.effects.push(Effect::Return {
                    ch,
                    reply_code: ErrorCode::NoRoute.code(),
                    reply_text: "NO_ROUTE",
                    message: message.clone(),
                });
            }
        } else {
            for &q in &queues {
                match self.enqueue(q, &message) {
                    Enqueued::Memory => {}
                    Enqueued::Durable => wait_sync = true,
                    Enqueued::Failed | Enqueued::Rejected => failed = true,
                }
            }
            for &q in &queues {
                self.dispatch(q);
            }
            self.pace(ch.conn, &queues);
        }
        if let Some(seq) = seq {
            // A message the store failed to take is nacked: nothing is confirmed that was not
            // stored. A persistent message on a durable queue is confirmed once it is durable.
            self.confirm(ch, seq, !failed, wait_sync);
        }
    }

    /// Emits a publisher confirm now, or queues it behind the next sync (`wait_sync`) or
    /// behind confirms of the same channel already waiting (a channel's confirms leave in
    /// order).
    fn confirm(&mut self, ch: ChannelRef, seq: u64, ack: bool, wait_sync: bool) {
        let Some(channel) = self.channels.get_mut(&ch) else {
            return;
        };
        if wait_sync || channel.pending_confirms > 0 {
            channel.pending_confirms += 1;
            // A confirm that only waits for its channel's earlier ones needs no sync of its
            // own: it rides on the newest epoch already waited for.
            let epoch = if wait_sync {
                self.epoch
            } else {
                self.pending_confirms.back().map_or(self.epoch, |p| p.epoch)
            };
            self.pending_confirms.push_back(PendingConfirm {
                epoch,
                ch,
                seq,
                ack,
            });
        } else {
            self.effects.push(Effect::Confirm {
                ch,
                seq,
                multiple: false,
                ack,
            });
        }
    }

    /// Appends a routed message to a queue: into the window while it has room and nothing is
    /// paged out, otherwise (with a store) into the store only. Persistent messages on
    /// durable queues are stored either way. Applies the queue's length limit and TTL.
    pub(super) fn enqueue(&mut self, id: QueueId, message: &Arc<Message>) -> Enqueued {
        let window = self.config.queue_window;
        let now = self.now;
        let Some(q) = self.queues.get_mut(&id) else {
            return Enqueued::Memory;
        };
        let len = message.body_len() as u64;
        if q.args.overflow != Overflow::DropHead && would_overflow(q, len) {
            if q.args.overflow == Overflow::RejectPublishDlx {
                self.dead_letter(id, message.clone(), DeathReason::MaxLen);
            }
            return Enqueued::Rejected;
        }
        let expires_at = expiry(now, q.args.message_ttl, message);
        if expires_at.is_some() {
            self.expiring.insert(id);
        }
        let Some(q) = self.queues.get_mut(&id) else {
            return Enqueued::Memory;
        };
        let Some(store) = self.store.as_mut() else {
            let seq = q.messages.next_seq();
            q.messages.push(seq, message.clone(), false, expires_at);
            self.hold(len);
            self.drop_overflow(id);
            return Enqueued::Memory;
        };
        let persist = q.durable && message.properties.is_persistent();
        // A persistent message is written anyway, so keeping it out of memory costs only the
        // read back. A transient one would cost a write too: it pages out only at a larger
        // window (a burst above the flow-control mark stays in memory) or when message
        // memory passes half the alarm watermark.
        let (limit, limit_bytes) = if persist {
            (window, self.config.queue_window_bytes)
        } else {
            (
                window.saturating_mul(TRANSIENT_WINDOW_FACTOR),
                self.config
                    .queue_window_bytes
                    .saturating_mul(TRANSIENT_WINDOW_FACTOR as u64),
            )
        };
        let memory_tight = self.stored_bytes > self.config.memory_high_watermark / 2;
        // Priority queues keep everything in memory (see `MessageQueue`).
        let page = !q.messages.is_priority()
            && (q.messages.paged().count > 0
                || q.messages.in_memory() >= limit
                || q.messages.bytes() >= limit_bytes
                || (memory_tight && q.messages.in_memory() >= window));
        let seq = q.messages.next_seq();
        if !persist && !page {
            q.messages.push(seq, message.clone(), false, expires_at);
            self.hold(len);
            self.drop_overflow(id);
            return Enqueued::Memory;
        }
        if store.append(id, seq, message, expires_at).is_err() {
            // The host logged why. The message is not taken (its publisher gets a nack), and
            // publishers are blocked for a while.
            self.store_failed_at = Some(self.now);
            return Enqueued::Failed;
        }
        if page {
            q.messages.push_paged(seq, len);
        } else {
            q.messages.push(seq, message.clone(), true, expires_at);
            self.hold(len);
        }
        if persist {
            self.sync_dirty = true;
        }
        self.drop_overflow(id);
        if persist {
            Enqueued::Durable
        } else {
            Enqueued::Memory
        }
    }

    /// Over its length limit with `drop-head`: drops (dead-letters) from the head until the
    /// queue fits again.
    pub(super) fn drop_overflow(&mut self, id: QueueId) {
        loop {
            let Some(q) = self.queues.get(&id) else {
                return;
            };
            let over_count = q
                .args
                .max_length
                .is_some_and(|max| q.messages.len() as u64 > max);
            let over_bytes = q
                .args
                .max_length_bytes
                .is_some_and(|max| q.messages.total_bytes() > max);
            if !(over_count || over_bytes) {
                return;
            }
            let Some(m) = self.pop_ready(id) else {
                return;
            };
            self.forget(id, m.seq, m.stored, m.message.body_len());
            self.dead_letter(id, m.message, DeathReason::MaxLen);
        }
    }

    /// Makes sure the window holds the queue's next message when any is paged out.
    fn fill_window(&mut self, id: QueueId) -> bool {
        // A priority queue reads back everything (bounded by what it holds).
        loop {
            match self
                .queues
                .get(&id)
                .map(|q| (q.messages.needs_load(), q.messages.is_priority()))
            {
                None => return false,
                Some((false, _)) => return true,
                Some((true, priority)) => {
                    if !self.load_batch(id) {
                        return false;
                    }
                    if !priority {
                        return true;
                    }
                }
            }
        }
    }

    /// Reads one batch of paged-out messages back into memory.
    fn load_batch(&mut self, id: QueueId) -> bool {
        let Some(q) = self.queues.get_mut(&id) else {
            return false;
        };
        let paged = q.messages.paged();
        // Read back a window's worth, by count and by bytes (big messages come fewer at a
        // time).
        let average = (paged.bytes / paged.count.max(1)).max(1);
        let by_bytes =
            usize::try_from(self.config.queue_window_bytes / average).unwrap_or(usize::MAX);
        let max = self.config.queue_window.min(by_bytes).max(1);
        let mut batch = Vec::new();
        let read = match self.store.as_mut() {
            Some(store) => store.read(id, paged.from_seq, max, &mut batch),
            None => Ok(()),
        };
        if read.is_err() {
            self.store_failed_at = Some(self.now);
            return false;
        }
        if batch.is_empty() {
            // The store has nothing where it reported messages: do not wait forever.
            q.messages.forget_paged();
            return false;
        }
        let bytes = q.messages.load(batch);
        self.hold(bytes);
        true
    }

    /// Takes the next ready message of a queue, reading paged-out messages back first when
    /// the window is empty.
    pub(super) fn pop_ready(&mut self, id: QueueId) -> Option<QueuedMessage> {
        self.fill_window(id);
        self.queues.get_mut(&id)?.messages.pop()
    }

    /// Dead-letters (or drops) expired messages at the head of a queue: expiry is checked at
    /// the head only, O(1) per message, as RabbitMQ does. A message expires once `now` passes
    /// its deadline, so a TTL of 0 still reaches a consumer that is ready at publish time.
    pub(super) fn expire_head(&mut self, id: QueueId) {
        let now = self.now;
        while self.fill_window(id) {
            let expired = self
                .queues
                .get(&id)
                .and_then(|q| q.messages.head())
                .and_then(|m| m.expires_at)
                .is_some_and(|at| now > at);
            if !expired {
                return;
            }
            let Some(m) = self.queues.get_mut(&id).and_then(|q| q.messages.pop()) else {
                return;
            };
            self.forget(id, m.seq, m.stored, m.message.body_len());
            self.dead_letter(id, m.message, DeathReason::Expired);
        }
    }

    /// A message left queue `id` for good (acked, dropped, delivered without ack).
    pub(super) fn forget(&mut self, id: QueueId, seq: u64, stored: bool, body_len: usize) {
        self.release(body_len as u64);
        if stored && let Some(store) = self.store.as_mut() {
            store.remove(id, seq);
        }
    }

    /// Whether a publish routed by the host (`Publish::routed`) may be used as routed: through
    /// the same exchange (not one deleted and declared again), on a table that saw every
    /// routing change of the publishing connection (a client sees its own binds).
    fn usable(
        &self,
        ch: ChannelRef,
        exchange: ExchangeId,
        routed: &crate::routing::Routed,
    ) -> bool {
        routed.exchange == exchange
            && self
                .conns
                .get(&ch.conn)
                .is_some_and(|c| routed.version >= c.routes_seen)
    }

    /// The queues of a host-routed publish that still exist, each once, in id order. A queue
    /// deleted since the snapshot is dropped: the publish happened before the deletion, which
    /// took the message with it (so a mandatory publish is not returned either).
    fn still_routable(&self, exchange: ExchangeId, mut queues: Vec<QueueId>) -> Vec<QueueId> {
        let vhost = self.exchanges.get(&exchange).map(|x| x.vhost);
        queues.sort_unstable();
        queues.dedup();
        queues.retain(|q| self.queues.get(q).map(|q| q.vhost) == vhost);
        queues
    }

    /// Every queue a message published to `exchange` reaches, each once, in id order
    /// (through the routing table, as hosts that route outside the broker do).
    pub(super) fn route(&self, exchange: ExchangeId, p: &Publish) -> Vec<QueueId> {
        self.routes
            .route(exchange, &p.routing_key, p.properties.headers.as_ref())
    }

    /// Whether consumer `cid` may receive one more message now.
    fn can_deliver(&self, cid: ConsumerId) -> bool {
        let Some(c) = self.consumers.get(&cid) else {
            return false;
        };
        let Some(conn) = self.conns.get(&c.ch.conn) else {
            return false;
        };
        if conn.in_flight >= self.config.write_window {
            return false;
        }
        if c.no_ack {
            return true;
        }
        let Some(channel) = self.channels.get(&c.ch) else {
            return false;
        };
        (c.prefetch == 0 || c.unacked < u32::from(c.prefetch))
            && (channel.global_prefetch == 0
                || channel.consumer_unacked < u32::from(channel.global_prefetch))
    }

    /// The consumer the next message goes to: with `x-single-active-consumer`, only the
    /// first consumer (the next one takes over when it goes); otherwise round-robin among
    /// the consumers with credit and the highest `x-priority`.
    fn pick_consumer(&self, q: &super::Queue) -> Option<(usize, ConsumerId)> {
        if q.args.single_active_consumer {
            let first = *q.consumers.first()?;
            return self.can_deliver(first).then_some((0, first));
        }
        let n = q.consumers.len();
        let start = q.rr_next % n;
        let order = (0..n)
            .map(|i| (start + i) % n)
            .map(|idx| (idx, q.consumers[idx]));
        if !q.mixed_priorities {
            return order.clone().find(|&(_, cid)| self.can_deliver(cid));
        }
        let priority = |cid: ConsumerId| self.consumers.get(&cid).map_or(0, |c| c.priority);
        let mut best: Option<(i64, usize, ConsumerId)> = None;
        for (idx, cid) in order {
            if !self.can_deliver(cid) {
                continue;
            }
            let p = priority(cid);
            if best.is_none_or(|(bp, _, _)| p > bp) {
                best = Some((p, idx, cid));
            }
        }
        best.map(|(_, idx, cid)| (idx, cid))
    }

    /// Hands ready messages of queue `id` to its consumers, round-robin, while any has credit;
    /// then resumes the publishers it paused once it has drained to half the flow mark.
    pub(super) fn dispatch(&mut self, id: QueueId) {
        self.dispatch_ready(id);
        let low = self.config.flow_ready_high / 2;
        if self
            .queues
            .get(&id)
            .is_some_and(|q| !q.pausing.is_empty() && q.messages.len() <= low)
        {
            self.resume_paused(id);
        }
    }

    fn dispatch_ready(&mut self, id: QueueId) {
        loop {
            let Some(q) = self.queues.get(&id) else {
                return;
            };
            if q.messages.is_empty() || q.consumers.is_empty() {
                return;
            }
            let Some((idx, cid)) = self.pick_consumer(q) else {
                return;
            };
            let n = q.consumers.len();
            if !self.expiring.is_empty() && self.expiring.contains(&id) {
                self.expire_head(id);
            }
            let Some(m) = self.pop_ready(id) else {
                return;
            };
            let Some(q) = self.queues.get_mut(&id) else {
                return;
            };
            q.rr_next = (idx + 1) % n;
            let Some(c) = self.consumers.get_mut(&cid) else {
                return;
            };
            let (ch, no_ack, tag) = (c.ch, c.no_ack, c.tag.clone());
            if !no_ack {
                c.unacked += 1;
                q.unacked += 1;
            }
            let Some(channel) = self.channels.get_mut(&ch) else {
                return;
            };
            let delivery_tag = channel.next_delivery_tag;
            channel.next_delivery_tag += 1;
            if !no_ack {
                channel.consumer_unacked += 1;
                channel.unacked.insert(
                    delivery_tag,
                    Unacked {
                        queue: id,
                        seq: m.seq,
                        message: m.message.clone(),
                        consumer: Some(cid),
                        stored: m.stored,
                        expires_at: m.expires_at,
                    },
                );
            }
            if let Some(conn) = self.conns.get_mut(&ch.conn) {
                conn.in_flight += 1;
            }
            if no_ack {
                self.forget(id, m.seq, m.stored, m.message.body_len());
            }
            self.effects.push(Effect::Deliver {
                ch,
                consumer_tag: tag,
                delivery: Delivery {
                    delivery_tag,
                    redelivered: m.redelivered,
                    message: m.message,
                },
            });
        }
    }

    pub(super) fn qos(
        &mut self,
        ch: ChannelRef,
        prefetch_size: u32,
        prefetch_count: u16,
        global: bool,
    ) -> OpResult {
        if prefetch_size != 0 {
            return Err(ProtocolError::new(
                ErrorCode::NotImplemented,
                OpKind::Qos,
                format!("prefetch_size!=0 ({prefetch_size})"),
            ));
        }
        let Some(channel) = self.channels.get_mut(&ch) else {
            return Ok(());
        };
        if global {
            channel.global_prefetch = prefetch_count;
        } else {
            channel.prefetch_count = prefetch_count;
        }
        self.reply(ch, Reply::QosOk);
        if global {
            self.dispatch_channel_queues(ch);
        }
        Ok(())
    }

    pub(super) fn consume(&mut self, ch: ChannelRef, c: Consume) -> OpResult {
        if c.queue == super::reply_to::REPLY_TO {
            return self.consume_reply_to(ch, c);
        }
        let op = OpKind::Consume;
        let queue = self.queue_id(ch, op, &c.queue)?;
        let queue_name = self.queues[&queue].name.clone();
        self.check_access(ch, op, Perm::Read, Resource::Queue, &queue_name)?;
        let tag: Arc<str> = if c.consumer_tag.is_empty() {
            Arc::from(self.names.name("amq.ctag-"))
        } else {
            Arc::from(c.consumer_tag.as_str())
        };
        let Some(channel) = self.channels.get(&ch) else {
            return Ok(());
        };
        if channel.consumers.contains_key(&tag) {
            return Err(ProtocolError::new(
                ErrorCode::NotAllowed,
                op,
                format!("attempt to reuse consumer tag '{tag}'"),
            ));
        }
        let prefetch = channel.prefetch_count;
        let q = &self.queues[&queue];
        let exclusive_held = q
            .consumers
            .iter()
            .any(|cid| self.consumers.get(cid).is_some_and(|c| c.exclusive));
        if exclusive_held || (c.exclusive && !q.consumers.is_empty()) {
            return Err(ProtocolError::new(
                ErrorCode::AccessRefused,
                op,
                format!(
                    "queue '{}' in vhost '{}' in exclusive use",
                    q.name,
                    self.vhost_name(q.vhost)
                ),
            ));
        }
        let cid = ConsumerId(self.next_id());
        self.consumers.insert(
            cid,
            Consumer {
                tag: tag.clone(),
                ch,
                queue,
                no_ack: c.no_ack,
                exclusive: c.exclusive,
                prefetch,
                unacked: 0,
                priority: c
                    .arguments
                    .get("x-priority")
                    .and_then(|v| v.as_i64())
                    .unwrap_or(0),
            },
        );
        if let Some(channel) = self.channels.get_mut(&ch) {
            channel.consumers.insert(tag.clone(), cid);
        }
        let now = self.now;
        let consumers = &self.consumers;
        if let Some(q) = self.queues.get_mut(&queue) {
            q.consumers.push(cid);
            q.had_consumer = true;
            q.last_used = now;
            q.mixed_priorities = mixed_priorities(&q.consumers, consumers);
        }
        if let Some(conn) = self.conns.get_mut(&ch.conn) {
            conn.consumers += 1;
        }
        if !c.nowait {
            self.reply(ch, Reply::ConsumeOk { consumer_tag: tag });
        }
        self.dispatch(queue);
        Ok(())
    }

    pub(super) fn cancel(&mut self, ch: ChannelRef, tag: &str, nowait: bool) -> OpResult {
        self.cancel_reply_to(ch, tag);
        let cid = self
            .channels
            .get(&ch)
            .and_then(|c| c.consumers.get(tag).copied());
        // Cancelling an unknown tag is not an error (RabbitMQ answers cancel-ok).
        if let Some(cid) = cid {
            self.remove_consumer(cid, true);
        }
        if !nowait {
            self.reply(
                ch,
                Reply::CancelOk {
                    consumer_tag: Arc::from(tag),
                },
            );
        }
        Ok(())
    }

    /// Removes a consumer from its queue and channel. Its unacked messages stay on the
    /// channel. With `auto_delete`, an auto-delete queue left without consumers is deleted.
    pub(super) fn remove_consumer(&mut self, cid: ConsumerId, auto_delete: bool) {
        let Some(c) = self.consumers.remove(&cid) else {
            return;
        };
        if let Some(conn) = self.conns.get_mut(&c.ch.conn) {
            conn.consumers = conn.consumers.saturating_sub(1);
        }
        if let Some(channel) = self.channels.get_mut(&c.ch) {
            channel.consumers.remove(&c.tag);
        }
        let Some(q) = self.queues.get_mut(&c.queue) else {
            return;
        };
        if let Some(pos) = q.consumers.iter().position(|&x| x == cid) {
            q.consumers.remove(pos);
            if pos < q.rr_next {
                q.rr_next -= 1;
            }
        }
        // x-expires counts from the moment the last consumer left.
        q.last_used = self.now;
        q.mixed_priorities = mixed_priorities(&q.consumers, &self.consumers);
        // Channel and connection close pass `false` but still delete: RabbitMQ deletes an
        // auto-delete queue when its last consumer goes, however it goes.
        let _ = auto_delete;
        if q.consumers.is_empty() {
            // Without consumers a queue buffers, as in RabbitMQ: nothing to pace against.
            self.resume_paused(c.queue);
        }
        let Some(q) = self.queues.get(&c.queue) else {
            return;
        };
        if q.auto_delete && q.had_consumer && q.consumers.is_empty() {
            self.delete_queue(c.queue);
        }
    }

    pub(super) fn get(&mut self, ch: ChannelRef, queue: &str, no_ack: bool) -> OpResult {
        let id = self.queue_id(ch, OpKind::Get, queue)?;
        let queue_name = self.queues[&id].name.clone();
        self.check_access(ch, OpKind::Get, Perm::Read, Resource::Queue, &queue_name)?;
        let now = self.now;
        if let Some(q) = self.queues.get_mut(&id) {
            q.last_used = now;
        }
        if self.expiring.contains(&id) {
            self.expire_head(id);
        }
        let Some(m) = self.pop_ready(id) else {
            self.reply(ch, Reply::GetEmpty);
            return Ok(());
        };
        let Some(q) = self.queues.get_mut(&id) else {
            return Ok(());
        };
        let message_count = u32::try_from(q.messages.len()).unwrap_or(u32::MAX);
        if no_ack {
            self.forget(id, m.seq, m.stored, m.message.body_len());
        } else {
            q.unacked += 1;
        }
        let Some(channel) = self.channels.get_mut(&ch) else {
            return Ok(());
        };
        let delivery_tag = channel.next_delivery_tag;
        channel.next_delivery_tag += 1;
        if !no_ack {
            channel.unacked.insert(
                delivery_tag,
                Unacked {
                    queue: id,
                    seq: m.seq,
                    message: m.message.clone(),
                    consumer: None,
                    stored: m.stored,
                    expires_at: m.expires_at,
                },
            );
        }
        self.reply(
            ch,
            Reply::GetOk {
                delivery: Delivery {
                    delivery_tag,
                    redelivered: m.redelivered,
                    message: m.message,
                },
                message_count,
            },
        );
        Ok(())
    }

    pub(super) fn settle_op(
        &mut self,
        ch: ChannelRef,
        kind: OpKind,
        delivery_tag: u64,
        multiple: bool,
        settle: Settle,
    ) -> OpResult {
        if let Some(tx) = self.channels.get_mut(&ch).and_then(|c| c.tx.as_mut()) {
            if tx.len() >= MAX_TX_OPS {
                return Err(too_large_tx(kind));
            }
            tx.push(TxOp::Settle {
                kind,
                delivery_tag,
                multiple,
                settle,
            });
            return Ok(());
        }
        self.settle(ch, kind, delivery_tag, multiple, settle)
    }

    /// Acks, requeues or drops the deliveries named by (`delivery_tag`, `multiple`), with
    /// RabbitMQ's rules: tag 0 with `multiple` means all; otherwise the tag must be unacked.
    fn settle(
        &mut self,
        ch: ChannelRef,
        kind: OpKind,
        delivery_tag: u64,
        multiple: bool,
        settle: Settle,
    ) -> OpResult {
        let Some(channel) = self.channels.get_mut(&ch) else {
            return Ok(());
        };
        let settled: Vec<Unacked> = if multiple && delivery_tag == 0 {
            std::mem::take(&mut channel.unacked).into_values().collect()
        } else if !channel.unacked.contains_key(&delivery_tag) {
            return Err(ProtocolError::new(
                ErrorCode::PreconditionFailed,
                kind,
                format!("unknown delivery tag {delivery_tag}"),
            ));
        } else if multiple {
            let rest = channel.unacked.split_off(&(delivery_tag + 1));
            std::mem::replace(&mut channel.unacked, rest)
                .into_values()
                .collect()
        } else {
            channel.unacked.remove(&delivery_tag).into_iter().collect()
        };
        self.settle_entries(ch, settled, settle);
        Ok(())
    }

    fn settle_entries(&mut self, ch: ChannelRef, settled: Vec<Unacked>, settle: Settle) {
        let mut touched = BTreeSet::new();
        for u in settled {
            if let Some(cid) = u.consumer {
                if let Some(channel) = self.channels.get_mut(&ch) {
                    channel.consumer_unacked = channel.consumer_unacked.saturating_sub(1);
                }
                if let Some(c) = self.consumers.get_mut(&cid) {
                    c.unacked = c.unacked.saturating_sub(1);
                }
            }
            match self.queues.get_mut(&u.queue) {
                Some(q) => {
                    q.unacked = q.unacked.saturating_sub(1);
                    if settle == Settle::Requeue {
                        q.messages.requeue(u.seq, u.message, u.stored, u.expires_at);
                        touched.insert(u.queue);
                    } else {
                        self.forget(u.queue, u.seq, u.stored, u.message.body_len());
                        if settle == Settle::Discard {
                            self.dead_letter(u.queue, u.message, DeathReason::Rejected);
                        }
                    }
                }
                // Its queue was deleted while it was out: acked, dropped or requeued, it goes.
                None => self.release(u.message.body_len() as u64),
            }
        }
        for q in touched {
            self.dispatch(q);
        }
        self.dispatch_channel_queues(ch);
    }

    /// Resumes the queues this channel consumes from (credit was freed on the channel).
    fn dispatch_channel_queues(&mut self, ch: ChannelRef) {
        let Some(channel) = self.channels.get(&ch) else {
            return;
        };
        let queues: BTreeSet<QueueId> = channel
            .consumers
            .values()
            .filter_map(|cid| self.consumers.get(cid).map(|c| c.queue))
            .collect();
        for q in queues {
            self.dispatch(q);
        }
    }

    pub(super) fn recover(&mut self, ch: ChannelRef, requeue: bool) -> OpResult {
        if !requeue {
            return Err(ProtocolError::new(
                ErrorCode::NotImplemented,
                OpKind::Recover,
                "requeue=false",
            ));
        }
        let Some(channel) = self.channels.get_mut(&ch) else {
            return Ok(());
        };
        let all: Vec<Unacked> = std::mem::take(&mut channel.unacked).into_values().collect();
        // recover-ok goes before the redeliveries, as RabbitMQ orders them: clients (lapin)
        // discard deliveries they hold when recover-ok arrives.
        self.reply(ch, Reply::RecoverOk);
        self.settle_entries(ch, all, Settle::Requeue);
        Ok(())
    }

    pub(super) fn confirm_select(&mut self, ch: ChannelRef, nowait: bool) -> OpResult {
        let Some(channel) = self.channels.get_mut(&ch) else {
            return Ok(());
        };
        if channel.tx.is_some() {
            return Err(ProtocolError::new(
                ErrorCode::PreconditionFailed,
                OpKind::ConfirmSelect,
                "cannot switch from tx to confirm mode",
            ));
        }
        if channel.confirm_next.is_none() {
            channel.confirm_next = Some(1);
        }
        if !nowait {
            self.reply(ch, Reply::ConfirmSelectOk);
        }
        Ok(())
    }

    pub(super) fn tx_select(&mut self, ch: ChannelRef) -> OpResult {
        let Some(channel) = self.channels.get_mut(&ch) else {
            return Ok(());
        };
        if channel.confirm_next.is_some() {
            return Err(ProtocolError::new(
                ErrorCode::PreconditionFailed,
                OpKind::TxSelect,
                "cannot switch from confirm to tx mode",
            ));
        }
        if channel.tx.is_none() {
            channel.tx = Some(Vec::new());
        }
        self.reply(ch, Reply::TxSelectOk);
        Ok(())
    }

    pub(super) fn tx_commit(&mut self, ch: ChannelRef) -> OpResult {
        let ops = self.take_tx(ch, OpKind::TxCommit)?;
        for op in ops {
            match op {
                TxOp::Publish(p) => {
                    // The exchange may have gone since the publish was buffered.
                    let exchange = self.exchange_id(ch, OpKind::Publish, &p.exchange)?;
                    self.route_and_enqueue(ch, exchange, p);
                }
                TxOp::Settle {
                    kind,
                    delivery_tag,
                    multiple,
                    settle,
                } => self.settle(ch, kind, delivery_tag, multiple, settle)?,
            }
        }
        self.reply(ch, Reply::TxCommitOk);
        Ok(())
    }

    pub(super) fn tx_rollback(&mut self, ch: ChannelRef) -> OpResult {
        self.take_tx(ch, OpKind::TxRollback)?;
        self.reply(ch, Reply::TxRollbackOk);
        Ok(())
    }

    /// Takes the buffered operations of a transaction, leaving the channel transactional.
    fn take_tx(&mut self, ch: ChannelRef, kind: OpKind) -> Result<Vec<TxOp>, ProtocolError> {
        match self.channels.get_mut(&ch).and_then(|c| c.tx.as_mut()) {
            Some(tx) => Ok(std::mem::take(tx)),
            None => Err(ProtocolError::new(
                ErrorCode::PreconditionFailed,
                kind,
                "channel is not transactional",
            )),
        }
    }
}

fn too_large_tx(op: OpKind) -> ProtocolError {
    ProtocolError::new(
        ErrorCode::PreconditionFailed,
        op,
        format!("transaction exceeds {MAX_TX_OPS} operations; commit more often"),
    )
}

impl Broker {
    /// Pauses publishing connection `conn` for every queue among `queues` that has consumers
    /// and more than `flow_ready_high` ready messages, unless `conn` consumes itself.
    fn pace(&mut self, conn: ConnId, queues: &[QueueId]) {
        if self.conns.get(&conn).is_none_or(|c| c.consumers > 0) {
            return;
        }
        let high = self.config.flow_ready_high;
        for &id in queues {
            let Some(q) = self.queues.get_mut(&id) else {
                continue;
            };
            if q.consumers.is_empty() || q.messages.len() <= high || q.pausing.contains(&conn) {
                continue;
            }
            q.pausing.push(conn);
            if let Some(c) = self.conns.get_mut(&conn) {
                c.paused_in.insert(id);
                if c.paused_in.len() == 1 {
                    self.effects.push(Effect::FlowPaused { conn });
                }
            }
        }
    }

    /// Lifts the pauses queue `id` holds (it drained, lost its consumers, or is going away).
    pub(super) fn resume_paused(&mut self, id: QueueId) {
        let Some(q) = self.queues.get_mut(&id) else {
            return;
        };
        for conn in std::mem::take(&mut q.pausing) {
            if let Some(c) = self.conns.get_mut(&conn)
                && c.paused_in.remove(&id)
                && c.paused_in.is_empty()
            {
                self.effects.push(Effect::FlowResumed { conn });
            }
        }
    }
}
