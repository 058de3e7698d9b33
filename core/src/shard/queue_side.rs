//! The queue side: what the shard does with queue mail (enqueue, dispatch, consume, cancel,
//! get, settle, purge, delete, create and redeclare) on the queue's own state
//! (`queue::state::QueueState`), and what a queue operation asks of the rest of the shard
//! (`absorb`). Answers go back to channels and topology by mail only.

use super::mail::{Mail, Publisher, TopologyRequest};
use super::*;
use crate::command::{OpKind, QueueDeclare};
use crate::error::{ErrorCode, ProtocolError};
use crate::ids::{ChannelAddr, ConnId, QueueId, VhostId};
use crate::message::{FieldValue, Message};
use crate::queue::classic::MessageQueue;
use crate::queue::kind::{QueueBehaviour, QueueType};
use crate::queue::state::{ConsumerId, Enqueued, QueueConsumer, QueueState, Settle, Unacked};
use crate::queue::variant::Variant;
use std::sync::Arc;

/// Queue arguments whose values must match on redeclare (as RabbitMQ checks them).
const EQUIVALENT_QUEUE_ARGS: &[&str] = &[
    "x-expires",
    "x-message-ttl",
    "x-max-length",
    "x-max-length-bytes",
    "x-overflow",
    "x-dead-letter-exchange",
    "x-dead-letter-routing-key",
    "x-max-priority",
    "x-queue-type",
    "x-single-active-consumer",
    "x-max-age",
    "x-stream-max-segment-size-bytes",
    "x-delivery-limit",
    "x-dead-letter-strategy",
    "x-quorum-initial-group-size",
];

fn describe(v: Option<&FieldValue>) -> String {
    match v {
        None => "none".to_string(),
        Some(v) => match (v.as_str(), v.as_i64(), v.as_bool()) {
            (Some(s), _, _) => format!("'{s}'"),
            (_, Some(i), _) => format!("'{i}'"),
            (_, _, Some(b)) => format!("'{b}'"),
            _ => format!("{v:?}"),
        },
    }
}

impl Broker {
    /// Runs a queue operation on queue `id` with what it needs from the broker, then does
    /// what it asks of the broker (`absorb`). `None` if there is no such queue.
    pub(super) fn with_queue<R>(
        &mut self,
        id: QueueId,
        f: impl FnOnce(&mut QueueState, &mut QueueIo<'_>) -> R,
    ) -> Option<R> {
        self.with_queue_and_credit(id, |q, io, _| f(q, io))
    }

    /// `with_queue` for operations that also take cross-queue credit (dispatch).
    pub(super) fn with_queue_and_credit<R>(
        &mut self,
        id: QueueId,
        f: impl FnOnce(&mut QueueState, &mut QueueIo<'_>, &mut ChannelCredit<'_>) -> R,
    ) -> Option<R> {
        let memory_tight = self.memory_tight();
        let q = self.qs.queues.get_mut(&id)?;
        let mut io = QueueIo::new(
            self.store.as_deref_mut(),
            &self.config,
            self.now,
            memory_tight,
        );
        let mut credit = ChannelCredit {
            conns: &mut self.chans.conns,
            channels: &mut self.chans.channels,
            write_window: self.config.write_window,
        };
        let result = f(q, &mut io, &mut credit);
        let out = io.out;
        self.absorb(id, out);
        Some(result)
    }

    /// Applies what an operation on queue `id` asks of the rest of the broker.
    pub(super) fn absorb(&mut self, id: QueueId, out: QueueOut) {
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
            self.qs.expiring.insert(id);
        }
        if out.refill_held {
            self.qs.refill_held.insert(id);
            self.qs.refill_held_since.get_or_insert(self.now);
        }
        for (message, reason) in out.dead {
            self.dead_letter(id, message, reason);
        }
    }

    /// The queue side of a publish: enqueue, answer, dispatch, pace.
    pub(super) fn enqueue_mail(
        &mut self,
        queue: QueueId,
        message: &Arc<Message>,
        publisher: Option<Publisher>,
    ) {
        if self.forward_to_home(queue, message, publisher) {
            return;
        }
        if !self.qs.queues.contains_key(&queue) {
            // Deleted since the publish was routed: the deletion took it (confirmed, as
            // the publish came before the deletion).
            self.routed_to_deleted += 1;
        }
        if self
            .qs
            .queues
            .get(&queue)
            .is_some_and(|q| q.variant.is_direct())
        {
            self.direct_mail(queue, message, publisher);
            return;
        }
        // A message the store failed to take is nacked: nothing is confirmed that was not
        // stored. A persistent message on a durable queue is confirmed once it is durable.
        let (taken, durable) = match self.enqueue(queue, message) {
            Enqueued::Memory => (true, false),
            Enqueued::Durable => (true, true),
            Enqueued::Failed | Enqueued::Rejected => (false, false),
        };
        if let Some(Publisher {
            to, seq: Some(seq), ..
        }) = publisher
        {
            let answer = Mail::Answered {
                to,
                seq,
                taken,
                durable,
            };
            if durable
                && (self.conn_shard(to.ch.conn) != self.shard
                    || super::nodes::is_node_conn(to.ch.conn))
            {
                // Durable once this shard's sync covers it, which the publisher's shard
                // cannot see: the answer waits here for that sync (`release_confirms`),
                // then goes as a plain one.
                self.remote_answers.push_back((self.epoch, answer));
            } else {
                self.mail.push_back(answer);
            }
        }
        self.dispatch(queue);
        if let Some(p) = publisher
            && !p.consumes
        {
            self.pace(p.to.ch.conn, queue);
        }
    }

    /// A routed message for an `mqtt-qos0` queue. While nothing waits in it, it goes
    /// straight to a consumer with write-window credit (`QueueState::direct_delivery`: no
    /// enqueue, no ack, no settle). Otherwise it waits as in a classic queue, whose flow
    /// control pauses its publishers past `flow_ready_high`, up to twice that: beyond, it
    /// is dropped and counted (QoS 0 is at most once) and its publisher paused as well, so
    /// the queue stays bounded whatever its publishers do (those that also consume are
    /// never paused). Dropping at once,
    /// without the backlog, wasted the broker: a subscriber's task, one among a hundred
    /// publishers', had its window full most of the time, and nine in ten messages routed
    /// were dropped (docs/benchmarks.md). Taken either way (a confirm says the broker has
    /// it, as MQTT's PUBACK).
    fn direct_mail(
        &mut self,
        queue: QueueId,
        message: &Arc<Message>,
        publisher: Option<Publisher>,
    ) {
        let answer = |b: &mut Self| {
            if let Some(Publisher {
                to, seq: Some(seq), ..
            }) = publisher
            {
                b.mail.push_back(Mail::Answered {
                    to,
                    seq,
                    taken: true,
                    durable: false,
                });
            }
        };
        let backlog = self.qs.queues.get(&queue).map_or(0, |q| q.messages.len());
        if backlog == 0
            && let Some(Some(picked)) =
                self.with_queue_and_credit(queue, |q, _, credit| q.direct_delivery(credit, message))
        {
            self.mail.push_back(Mail::Deliver { queue, picked });
            answer(self);
            return;
        }
        if backlog >= self.config.flow_ready_high.saturating_mul(2) {
            self.qos0_dropped += 1;
            answer(self);
            // Paced as for what is kept: a publisher that only ever landed here past the
            // bound was never paused, and went on sending what was then dropped.
            if let Some(p) = publisher
                && !p.consumes
            {
                self.pace(p.to.ch.conn, queue);
            }
            return;
        }
        self.enqueue(queue, message);
        answer(self);
        self.dispatch(queue);
        if let Some(p) = publisher
            && !p.consumes
        {
            self.pace(p.to.ch.conn, queue);
        }
    }

    /// Appends a routed message to queue `id` (see `QueueState::enqueue`).
    pub(super) fn enqueue(&mut self, id: QueueId, message: &Arc<Message>) -> Enqueued {
        self.with_queue(id, |q, io| q.enqueue(io, message))
            .unwrap_or(Enqueued::Memory)
    }

    /// Dead-letters (or drops) expired messages at the head of queue `id`.
    pub(super) fn expire_head(&mut self, id: QueueId) {
        self.with_queue(id, |q, io| q.expire_head(io));
    }

    /// A replicated quorum queue `name` in `vhost` changed hands on this node
    /// ([`crate::admin::AdminRequest::ReloadQueue`]): it takes what the store recovers for it
    /// now and serves its consumers from that. `false` when this shard has no such queue.
    pub(crate) fn reload_queue(&mut self, vhost: &str, name: &str) -> bool {
        let Some(id) = self
            .vhost_id(vhost)
            .and_then(|vh| self.find_queue(vh, name))
        else {
            return false;
        };
        let vhost = vhost.to_string();
        if self.with_queue(id, |q, io| q.reload(io, &vhost)).is_none() {
            return false;
        }
        // What other nodes' channels held of it went back with the reload.
        self.returned_remote_deliveries(id);
        self.dead_letters_reloaded(id);
        // Its consumers get the reloaded messages now; their deliveries are mail, delivered
        // before this entry point returns (as every entry point's).
        self.dispatch(id);
        self.after_op();
        true
    }

    /// Hands ready messages of queue `id` to its consumers, round-robin, while any has credit;
    /// then resumes the publishers it paused once it has drained to half the flow mark.
    pub(super) fn dispatch(&mut self, id: QueueId) {
        self.dispatch_ready(id);
        self.resume_if_drained(id);
    }

    /// Resumes publishers queue `id` paused, a wave at a time, once it has drained to half
    /// the flow mark (`Pausing::take_wave`). Checked after a dispatch and after a basic.get
    /// (expiry is followed by a dispatch): a queue drained by basic.get while its consumers
    /// wait for credit never dispatches.
    fn resume_if_drained(&mut self, id: QueueId) {
        let Some(q) = self.qs.queues.get_mut(&id) else {
            return;
        };
        if q.pausing.is_empty() {
            return;
        }
        let (ready, delivered) = (q.messages.len(), q.stats.deliver_get);
        for conn in q
            .pausing
            .take_wave(ready, delivered, self.config.flow_ready_high)
        {
            self.mail.push_back(Mail::Resumed { conn, queue: id });
        }
        if ready == 0 && !q.pausing.is_empty() {
            self.qs.starving.insert(id);
        }
    }

    /// The `tick` of queues that ran empty with publishers still paused: another wave each.
    pub(super) fn feed_starving(&mut self) {
        for id in std::mem::take(&mut self.qs.starving) {
            self.resume_if_drained(id);
        }
    }

    pub(super) fn dispatch_ready(&mut self, id: QueueId) {
        let may_expire = self.qs.expiring.contains(&id);
        loop {
            let picked = self
                .with_queue_and_credit(id, |q, io, credit| q.next_delivery(io, credit, may_expire));
            let Some(picked) = picked.flatten() else {
                return;
            };
            self.mail.push_back(Mail::Deliver { queue: id, picked });
        }
    }

    /// The queue side of basic.consume: refused if another connection holds the queue
    /// exclusively, if a consumer holds it exclusively, or if it is gone; else the consumer
    /// is numbered, added and served at once (the channel registers it on `ConsumeOk`).
    /// Numbered here, on arrival, not by the channel: consumers from different channels
    /// may arrive in any order, and a queue keeps its consumers in arrival order (the
    /// single active consumer is the first to arrive) and looks them up by id.
    pub(super) fn consume_in_queue(
        &mut self,
        queue: QueueId,
        mut consumer: QueueConsumer,
        nowait: bool,
        stream_offset: Option<Box<FieldValue>>,
    ) {
        consumer.id = ConsumerId(self.id_on(self.shard));
        let (to, cid, tag) = (consumer.addr(), consumer.id, consumer.tag.clone());
        // A consumer of this node's channel attached here again (its quorum queue's leader
        // moved here): no client request waits for a refusal, which ends it instead.
        let reattach = self.reattaching(to, &tag, queue);
        if let Err(error) = self.check_exclusive(to.ch, OpKind::Consume, queue) {
            self.refuse_consume(to, tag, queue, reattach, error);
            return;
        }
        let now = self.now;
        // A stream's consumers need a prefetch and manual acks, and start at an offset.
        let mut stream_start = None;
        if self.qs.streams.contains(&queue) {
            let start = crate::queue::stream::parse_offset(stream_offset.as_deref(), now);
            let refused = if consumer.prefetch == 0 {
                Some((
                    ErrorCode::PreconditionFailed,
                    "consumer prefetch count is not set for '{rs}'".to_string(),
                ))
            } else if consumer.no_ack {
                Some((
                    ErrorCode::NotImplemented,
                    "automatic acknowledgement not supported by stream queues {rs}".to_string(),
                ))
            } else if start.is_none() {
                Some((
                    ErrorCode::PreconditionFailed,
                    format!(
                        "invalid x-stream-offset {} for {{rs}}: 'first', 'last', 'next', an \
                         offset, a timestamp or an interval such as '1h'",
                        describe(stream_offset.as_deref())
                    ),
                ))
            } else {
                None
            };
            if let Some((code, text)) = refused {
                let error = self.stream_refusal(queue, code, OpKind::Consume, &text);
                self.refuse_consume(to, tag, queue, reattach, error);
                return;
            }
            stream_start = start;
        }
        let refused = match self.qs.queues.get_mut(&queue) {
            None => Some(ProtocolError::new(
                ErrorCode::NotFound,
                OpKind::Consume,
                "the queue was deleted",
            )),
            // RabbitMQ 3.10 closes the connection (540) rather than share a channel's
            // global prefetch with a quorum queue.
            Some(q) if consumer.global_qos && !q.kind().capabilities().global_qos => {
                let (name, vhost) = (q.name.clone(), q.vhost);
                Some(ProtocolError::new(
                    ErrorCode::NotImplemented,
                    OpKind::Consume,
                    format!(
                        "queue '{name}' in vhost '{}' does not support global qos",
                        self.vhost_name(vhost)
                    ),
                ))
            }
            Some(q) if !consumer.no_ack && q.kind().capabilities().no_ack_only => {
                let (name, vhost, kind) = (q.name.clone(), q.vhost, q.kind());
                Some(ProtocolError::new(
                    ErrorCode::PreconditionFailed,
                    OpKind::Consume,
                    format!(
                        "queue '{name}' in vhost '{}' of type {} takes consumers without \
                         acknowledgements only (no_ack)",
                        self.vhost_name(vhost),
                        kind.name()
                    ),
                ))
            }
            Some(q) if q.in_exclusive_use(consumer.exclusive) => {
                let (name, vhost) = (q.name.clone(), q.vhost);
                Some(ProtocolError::new(
                    ErrorCode::AccessRefused,
                    OpKind::Consume,
                    format!(
                        "queue '{name}' in vhost '{}' in exclusive use",
                        self.vhost_name(vhost)
                    ),
                ))
            }
            Some(q) => {
                q.add_consumer(now, consumer);
                None
            }
        };
        if refused.is_none()
            && let Some(start) = stream_start
        {
            self.with_queue(queue, |q, io| {
                let id = q.id;
                if let Some(s) = q.variant.stream_mut() {
                    s.add_cursor(id, io, cid, start);
                }
            });
        }
        match refused {
            Some(error) => self.refuse_consume(to, tag, queue, reattach, error),
            None => {
                self.mail.push_back(Mail::ConsumeOk {
                    to,
                    queue,
                    consumer: cid,
                    tag,
                    nowait,
                });
                self.dispatch(queue);
            }
        }
    }

    /// A consume refused: the client's request fails, or a consumer attached again ends
    /// with basic.cancel (`reattach_failed`).
    fn refuse_consume(
        &mut self,
        to: ChannelAddr,
        tag: Arc<str>,
        queue: QueueId,
        reattach: bool,
        error: ProtocolError,
    ) {
        if reattach {
            self.reattach_failed(to, tag, queue);
        } else {
            self.mail.push_back(Mail::Refused { to, error });
        }
    }

    /// The queue side of a consumer going. Its unacked messages stay on the channel. An
    /// auto-delete queue left without consumers is deleted: RabbitMQ deletes it when its
    /// last consumer goes, however it goes (cancel, channel or connection close).
    pub(super) fn cancel_in_queue(
        &mut self,
        queue: QueueId,
        cid: ConsumerId,
        reply: Option<super::mail::CancelReply>,
    ) {
        let now = self.now;
        if let Some(q) = self.qs.queues.get_mut(&queue)
            && q.remove_consumer(now, cid).is_some()
            && q.consumers.is_empty()
        {
            let auto_delete = q.auto_delete && q.had_consumer;
            // Without consumers a queue buffers, as in RabbitMQ: nothing to pace against.
            self.resume_paused(queue);
            if auto_delete {
                self.delete_queue(queue);
            }
        }
        if let Some(reply) = reply {
            self.mail.push_back(Mail::Cancelled { reply });
        }
    }

    /// The queue side of basic.get: refused if another connection holds the queue
    /// exclusively, else the next ready message, if any.
    pub(super) fn get_in_queue(&mut self, queue: QueueId, to: ChannelAddr, no_ack: bool) {
        if let Err(error) = self.check_exclusive(to.ch, OpKind::Get, queue) {
            self.mail.push_back(Mail::Refused { to, error });
            return;
        }
        if self.qs.streams.contains(&queue) {
            let error = self.stream_refusal(
                queue,
                ErrorCode::NotImplemented,
                OpKind::Get,
                "basic.get not supported by stream queues {rs}",
            );
            self.mail.push_back(Mail::Refused { to, error });
            return;
        }
        let may_expire = self.qs.expiring.contains(&queue);
        let got = self
            .with_queue(queue, |q, io| q.get(io, no_ack, may_expire))
            .flatten();
        self.resume_if_drained(queue);
        self.mail.push_back(Mail::Got {
            queue,
            to,
            no_ack,
            got,
        });
    }

    /// The queue side of settled deliveries: acked, dropped or requeued (then dispatched).
    pub(super) fn settle_in_queue(&mut self, queue: QueueId, entries: Vec<Unacked>, how: Settle) {
        let mut requeued = false;
        for u in entries {
            let len = u.message.body_len() as u64;
            match self.with_queue(queue, |q, io| q.settle(io, u, how)) {
                Some(true) => requeued = true,
                Some(false) => {}
                // Its queue was deleted while it was out: acked, dropped or requeued, it goes.
                None => {
                    if how == Settle::Requeue {
                        self.requeued_to_deleted += 1;
                    }
                    self.release(len);
                }
            }
        }
        if requeued {
            self.dispatch(queue);
        }
    }

    /// Pauses publishing connection `conn` if queue `id` has consumers and more than
    /// `flow_ready_high` ready messages (the caller knows `conn` does not consume itself).
    pub(super) fn pace(&mut self, conn: ConnId, id: QueueId) {
        let high = self.config.flow_ready_high;
        let Some(q) = self.qs.queues.get_mut(&id) else {
            return;
        };
        if q.consumers.is_empty() || q.messages.len() <= high || q.pausing.contains(&conn) {
            return;
        }
        q.pausing.push(conn, high / 2, q.stats.deliver_get);
        self.mail.push_back(Mail::Paused { conn, queue: id });
    }

    /// Lifts the pauses queue `id` holds (it drained, lost its consumers, or is going away).
    pub(super) fn resume_paused(&mut self, id: QueueId) {
        let Some(q) = self.qs.queues.get_mut(&id) else {
            return;
        };
        for conn in q.pausing.take() {
            self.mail.push_back(Mail::Resumed { conn, queue: id });
        }
    }

    /// The owner's side of a new queue: creates it with its store log. An exclusive queue
    /// whose connection closed meanwhile is not created (it would outlive its owner).
    pub(super) fn create_queue(
        &mut self,
        id: QueueId,
        to: ChannelAddr,
        c: super::mail::CreateQueue,
    ) {
        let d = c.declare;
        let owner = d.exclusive.then_some(to.ch.conn);
        if owner.is_some_and(|o| !self.chans.conns.contains_key(&o)) {
            let gone = super::mail::Mail::QueueGone {
                queue: id,
                answer: None,
            };
            self.mail.push_back(gone);
            return;
        }
        let stored = d.durable && !d.exclusive;
        // One allocation of the name for the queue, topology and the routing table.
        let name = c.name;
        let messages = match self.store.as_mut() {
            // A stream's messages are in its log, opened below.
            _ if c.kind == QueueType::Stream => {
                MessageQueue::recovered(Default::default(), c.args.max_priority)
            }
            Some(store) => MessageQueue::recovered(
                store.open_queue(id, &c.vhost_name, &name, stored),
                c.args.max_priority,
            ),
            None => MessageQueue::recovered(Default::default(), c.args.max_priority),
        };
        // The queue-type seam's one match: the state of the queue's type.
        let mut queue = match c.kind {
            QueueType::Classic => QueueState::new(id, c.vhost, name, messages, self.now),
            QueueType::Stream if crate::queue::stream::STREAMS => {
                let settings = c.stream.clone().unwrap_or_default();
                use crate::queue::stream::Log;
                let log = match (self.store.as_mut(), &self.shared_streams) {
                    (Some(store), _) => {
                        if store
                            .stream_open(id, &c.vhost_name, &name, &settings)
                            .is_err()
                        {
                            // The host logged why; its publishes are nacked until it works.
                            self.store_failed_at = Some(self.now);
                        }
                        Log::Store
                    }
                    (None, Some(host)) => {
                        // The host logged a failure; publishes to it are nacked.
                        let _ = host.open(&c.vhost_name, &name, &settings);
                        Log::Shared {
                            host: Arc::clone(host),
                            vhost: Arc::clone(&c.vhost_name),
                            name: Arc::clone(&name),
                        }
                    }
                    (None, None) => Log::Own(Default::default()),
                };
                let mut q = QueueState::new(id, c.vhost, Arc::clone(&name), messages, self.now);
                q.variant = Variant::Stream(Box::new(crate::queue::stream::StreamQueue::new(
                    settings,
                    log,
                    self.qs.stream_readers.clone(),
                )));
                self.qs.streams.insert(id);
                q
            }
            // Refused at declare when streams are left out (`streams` feature).
            QueueType::Stream => QueueState::new(id, c.vhost, name, messages, self.now),
            QueueType::MqttQos0 => {
                let mut q = QueueState::new(id, c.vhost, name, messages, self.now);
                q.variant = Variant::Direct;
                q
            }
            QueueType::Quorum => {
                if let Some(store) = self.store.as_mut() {
                    store.keep_every_message(id);
                }
                let mut q = QueueState::new(id, c.vhost, name, messages, self.now);
                q.variant = Variant::Quorum(Box::default());
                q
            }
        };
        let is_stream = c.kind == QueueType::Stream;
        queue.durable = d.durable;
        queue.exclusive_owner = owner;
        queue.auto_delete = d.auto_delete;
        // A stream's settings are its own; a policy's classic keys (TTL, expiry) do not
        // apply to it.
        if !is_stream {
            queue.set_args(c.args, &mut self.qs.last_args);
        }
        queue.set_arguments(d.arguments, &mut self.qs.last_arguments);
        let expiring = queue.args.message_ttl.is_some() || queue.args.expires.is_some();
        // Messages a durable queue's log already holds (a restore) count in declare-ok.
        let message_count = u32::try_from(queue.messages.len()).unwrap_or(u32::MAX);
        let at_least_once = queue.at_least_once();
        self.qs.queues.insert(id, Box::new(queue));
        if at_least_once {
            // Dead letters a restart recovers are forwarded again (`dlx.rs`).
            let vhost = Arc::clone(&c.vhost_name);
            self.with_queue(id, |q, io| q.open_dead_letters(io, &vhost));
            self.dead_letters_reloaded(id);
        }
        if expiring {
            self.qs.expiring.insert(id);
        }
        if let Some(conn) = owner.and_then(|o| self.chans.conns.get_mut(&o)) {
            conn.exclusive_queues.insert(id);
        }
        self.mail.push_back(super::mail::Mail::QueueCreated {
            queue: id,
            to,
            message_count,
            nowait: d.nowait,
        });
    }

    /// The queue side of a declare of an existing queue: refused if another connection
    /// holds it exclusively or (unless passive) if the declare is not equivalent; else a
    /// redeclare renews its `x-expires` lease (a passive one only looks), and declare-ok
    /// carries its counts. A queue deleted while the declare travelled is not found.
    pub(super) fn redeclare_in_queue(
        &mut self,
        queue: QueueId,
        to: ChannelAddr,
        vhost: VhostId,
        d: QueueDeclare,
    ) {
        let op = OpKind::QueueDeclare;
        if !self.qs.queues.contains_key(&queue) {
            // Deleted while the declare travelled: topology hears of that (`QueueGone`,
            // sent before this on the same link) before it sees the declare again, and
            // then creates the queue anew (or answers 404 to a passive declare).
            let request = TopologyRequest::DeclareQueue {
                name: Arc::from(d.queue.as_str()),
                declare: d,
                trusted_name: false,
            };
            self.mail.push_back(super::mail::Mail::Topology {
                to,
                vhost,
                request: Box::new(request),
            });
            return;
        }
        let checked = self.check_exclusive(to.ch, op, queue).and_then(|()| {
            if d.passive {
                return Ok(());
            }
            self.check_queue_equivalence(queue, &d)
        });
        if let Err(error) = checked {
            self.mail
                .push_back(super::mail::Mail::Refused { to, error });
            return;
        }
        let now = self.now;
        let Some(q) = self.qs.queues.get_mut(&queue) else {
            return;
        };
        if !d.passive {
            q.last_used = now;
        }
        let (name, consumers) = (q.name.clone(), q.consumers.len());
        let message_count = self.message_count(queue);
        self.mail.push_back(super::mail::Mail::Declared {
            to,
            queue: name,
            message_count: u32::try_from(message_count).unwrap_or(u32::MAX),
            consumer_count: u32::try_from(consumers).unwrap_or(u32::MAX),
            nowait: d.nowait,
            version: 0,
        });
    }

    /// Messages in queue `id`: ready ones, or those a stream holds.
    pub(super) fn message_count(&mut self, id: QueueId) -> u64 {
        if self.qs.streams.contains(&id) {
            return self
                .with_queue(id, |q, io| {
                    let id = q.id;
                    q.variant
                        .stream_mut()
                        .map_or(0, |s| s.message_count(io, id))
                })
                .unwrap_or(0);
        }
        self.qs
            .queues
            .get(&id)
            .map_or(0, |q| q.messages.len() as u64)
    }

    /// Dispatches every stream queue with consumers: its log may have grown (a sync made
    /// appends visible, or the stream protocol appended).
    pub(super) fn dispatch_streams(&mut self) {
        let streams: Vec<QueueId> = self
            .qs
            .streams
            .iter()
            .copied()
            .filter(|id| {
                self.qs
                    .queues
                    .get(id)
                    .is_some_and(|q| q.variant.stream().is_some_and(|s| s.has_cursors()))
            })
            .collect();
        for id in streams {
            self.mail.from(super::mail::Dest::Queue(id));
            self.dispatch(id);
        }
    }

    /// Lets the stream consumers held back for a fuller refill take what is free of their
    /// prefetch, once they waited `REFILL_HOLD_MS` (`queue::stream::Room`).
    pub(super) fn release_held_refills(&mut self) {
        let due = self.qs.refill_held_since.is_some_and(|since| {
            self.now >= since.saturating_add(crate::queue::stream::REFILL_HOLD_MS)
        });
        if !due {
            return;
        }
        self.qs.refill_held_since = None;
        let held = std::mem::take(&mut self.qs.refill_held);
        for id in held {
            let Some(q) = self.qs.queues.get_mut(&id) else {
                continue;
            };
            // Held consumers (`Room::Held`) take what is free of their prefetch now.
            for c in &mut q.consumers {
                c.refilling = false;
            }
            self.mail.from(super::mail::Dest::Queue(id));
            self.dispatch(id);
        }
    }

    /// A stream operation refused, in RabbitMQ's words (`{rs}` in `text` is the queue's
    /// `queue 'name' in vhost 'v'`).
    fn stream_refusal(
        &self,
        queue: QueueId,
        code: ErrorCode,
        op: OpKind,
        text: &str,
    ) -> ProtocolError {
        let rs = match self.qs.queues.get(&queue) {
            Some(q) => format!("queue '{}' in vhost '{}'", q.name, self.vhost_name(q.vhost)),
            None => "the queue".to_string(),
        };
        ProtocolError::new(code, op, text.replace("{rs}", &rs))
    }

    pub(super) fn check_queue_equivalence(&self, id: QueueId, d: &QueueDeclare) -> OpResult {
        let q = &self.qs.queues[&id];
        let mismatch = if q.durable != d.durable {
            Some(("durable", q.durable.to_string(), d.durable.to_string()))
        } else if q.auto_delete != d.auto_delete {
            Some((
                "auto_delete",
                q.auto_delete.to_string(),
                d.auto_delete.to_string(),
            ))
        } else {
            EQUIVALENT_QUEUE_ARGS.iter().find_map(|&arg| {
                let (have, want) = (q.arguments().get(arg), d.arguments.get(arg));
                let same = match (have, want) {
                    (Some(a), Some(b)) => {
                        a == b
                            || (a.as_i64().is_some() && a.as_i64() == b.as_i64())
                            || (a.as_str().is_some() && a.as_str() == b.as_str())
                    }
                    (None, None) => true,
                    _ => false,
                };
                (!same).then(|| (arg, describe(have), describe(want)))
            })
        };
        match mismatch {
            None => Ok(()),
            Some((arg, current, received)) => Err(ProtocolError::new(
                ErrorCode::PreconditionFailed,
                OpKind::QueueDeclare,
                format!(
                    "inequivalent arg '{arg}' for queue '{}' in vhost '{}': received \
                     {received} but current is {current}",
                    q.name,
                    self.vhost_name(q.vhost)
                ),
            )),
        }
    }

    /// The queue side of queue.purge: refused if another connection holds the queue
    /// exclusively; else its ready messages go (unacked ones stay out), and the publishers
    /// it paused resume.
    pub(super) fn purge_in_queue(
        &mut self,
        queue: QueueId,
        to: crate::ids::ChannelAddr,
        nowait: bool,
    ) {
        if let Err(error) = self.check_exclusive(to.ch, OpKind::QueuePurge, queue) {
            self.mail
                .push_back(super::mail::Mail::Refused { to, error });
            return;
        }
        if self.qs.streams.contains(&queue) {
            let error = self.stream_refusal(
                queue,
                ErrorCode::NotImplemented,
                OpKind::QueuePurge,
                "queue.purge not supported by stream queues {rs}",
            );
            self.mail
                .push_back(super::mail::Mail::Refused { to, error });
            return;
        }
        let purged = self.with_queue(queue, |q, io| q.purge(io)).unwrap_or(0);
        self.resume_paused(queue);
        self.mail.push_back(super::mail::Mail::Purged {
            to,
            message_count: u32::try_from(purged).unwrap_or(u32::MAX),
            nowait,
        });
    }

    /// The queue side of queue.delete: refused if another connection holds the queue
    /// exclusively, or by `if-unused` / `if-empty`; else delete-ok goes to the channel
    /// (before the consumers' cancels, as RabbitMQ orders them) and the queue goes. A queue
    /// gone meanwhile counts 0, as a missing one does.
    pub(super) fn delete_in_queue(
        &mut self,
        queue: QueueId,
        to: crate::ids::ChannelAddr,
        if_unused: bool,
        if_empty: bool,
        nowait: bool,
    ) {
        let op = OpKind::QueueDelete;
        if let Err(error) = self.check_exclusive(to.ch, op, queue) {
            self.mail
                .push_back(super::mail::Mail::Refused { to, error });
            return;
        }
        let refused = self.qs.queues.get(&queue).and_then(|q| {
            let why = if if_unused && !q.consumers.is_empty() {
                "in use"
            } else if if_empty && !q.messages.is_empty() {
                "is not empty"
            } else {
                return None;
            };
            let vhost = self.vhost_name(q.vhost);
            Some(format!("queue '{}' in vhost '{vhost}' {why}", q.name))
        });
        if let Some(text) = refused {
            let error = ProtocolError::new(ErrorCode::PreconditionFailed, op, text);
            self.mail
                .push_back(super::mail::Mail::Refused { to, error });
            return;
        }
        let count = self.message_count(queue);
        let answer = super::mail::DeleteAnswer {
            to,
            message_count: u32::try_from(count).unwrap_or(u32::MAX),
            nowait,
        };
        self.delete_queue_answering(queue, Some(answer));
    }

    /// Removes a queue: its name and bindings (topology's, told by `QueueGone`; auto-delete
    /// exchanges left without bindings go too), its ready
    /// messages, and its consumers, who are told (`basic.cancel`) when their client
    /// understands it. Unacked deliveries stay on their channels; acking them is a no-op.
    pub(super) fn delete_queue(&mut self, id: QueueId) {
        self.delete_queue_answering(id, None);
    }

    /// `delete_queue`, for a queue.delete whose answer topology sends once the queue's name
    /// and bindings are gone (so a publish after delete-ok is not routed to it).
    pub(super) fn delete_queue_answering(
        &mut self,
        id: QueueId,
        answer: Option<super::mail::DeleteAnswer>,
    ) {
        self.resume_paused(id);
        self.qs.streams.remove(&id);
        let Some(q) = self.qs.queues.remove(&id) else {
            // Deleted by an earlier op while this delete travelled: topology heard of that
            // on this link already, and answers after it.
            if answer.is_some() {
                let gone = super::mail::Mail::QueueGone { queue: id, answer };
                self.mail.push_from(super::mail::Dest::Queue(id), gone);
            }
            return;
        };
        self.release(q.messages.bytes() + q.dead_held().1);
        self.dead_letters_reloaded(id);
        if let Some(s) = q.variant.stream() {
            s.delete_log();
        }
        // Topology removes its name and bindings (from this queue's link, so a declare the
        // queue sends back to topology arrives after it).
        let gone = super::mail::Mail::QueueGone { queue: id, answer };
        self.mail.push_from(super::mail::Dest::Queue(id), gone);
        let vhost = self.topo.vhost_name_arc(q.vhost);
        if let Some(store) = self.store.as_mut() {
            if q.durable && q.exclusive_owner.is_none() {
                if store
                    .define(crate::store::DefinitionChange::QueueDeleted {
                        vhost: &vhost,
                        name: &q.name,
                    })
                    .is_err()
                {
                    self.store_failed_at = Some(self.now);
                }
                self.sync_dirty = true;
            }
            store.delete_queue(id);
            if q.variant.quorum().is_some_and(|f| f.dead.open) {
                store.delete_queue(crate::queue::dlx::store_id(id));
            }
            // What it held is dead space for the store to reclaim at the next sync.
            self.note_removal();
        }
        if let Some(owner) = q.exclusive_owner.and_then(|o| self.chans.conns.get_mut(&o)) {
            owner.exclusive_queues.remove(&id);
        }
        for consumer in q.consumers {
            self.mail.push_back(super::mail::Mail::ConsumerGone {
                ch: consumer.ch,
                consumer: consumer.id,
                consumer_tag: consumer.tag,
            });
        }
        // This node's consumers of it on another node (a stub's) go too, whether or not
        // the home's word of it arrives.
        self.cancel_attached(id);
    }
}
