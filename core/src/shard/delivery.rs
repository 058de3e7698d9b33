//! The message path: publish and route, dispatch to consumers under prefetch and write-window
//! credit, basic.get, ack/nack/reject/recover, publisher confirms and transactions.
//!
//! Nothing here waits on a round trip (seed 002): a publish is routed, enqueued, dispatched
//! and confirmed within one `handle` call; prefetch is a counter check per delivery.

use super::mail::{Mail, Publisher};
use super::{Broker, OpResult};
use crate::access::{Perm, Resource};
use crate::channel::TxOp;
use crate::command::{Consume, OpKind, Publish};
use crate::effect::{Delivery, Effect, Reply};
use crate::error::{ErrorCode, ProtocolError};
use crate::ids::{ChannelAddr, ChannelRef, ConnId, ExchangeId, QueueId};
use crate::message::Message;
use crate::queue::classic::QueuedMessage;
use crate::queue::state::{ConsumerId, Enqueued, Picked, QueueConsumer, Settle, Unacked};
use std::collections::BTreeSet;
use std::sync::Arc;

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
            && let Err(text) = crate::queue_args::parse_expiration(e)
        {
            return Err(ProtocolError::new(ErrorCode::PreconditionFailed, op, text));
        }
        // Through the routing table, which every shard has (topology is shard 0's).
        if let Some((vhost, true)) = self.topo.routes().exchange_facts(exchange) {
            return Err(ProtocolError::new(
                ErrorCode::AccessRefused,
                op,
                format!(
                    "cannot publish to internal exchange '{}' in vhost '{}'",
                    p.exchange,
                    self.vhost_name(vhost)
                ),
            ));
        }
        let Some(channel) = self.channels.get_mut(&ch) else {
            return Ok(());
        };
        if channel.tx.is_some() {
            // Routed at commit, against the table of that moment.
            p.routed = None;
        }
        if let Some(TxOp::Publish(p)) = channel.buffer(op, TxOp::Publish(p))? {
            self.route_and_enqueue(ch, exchange, p);
        }
        Ok(())
    }

    /// Routes a publish and sends it to the queues it reaches; returns them.
    fn route_and_enqueue(
        &mut self,
        ch: ChannelRef,
        exchange: ExchangeId,
        mut p: Box<Publish>,
    ) -> Vec<QueueId> {
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
        let answers = u32::try_from(queues.len()).unwrap_or(u32::MAX);
        let (seq, serial) = match self.channels.get_mut(&ch) {
            Some(c) => {
                c.stats.publish += 1;
                let seq = c.next_publish_seq();
                if let Some(seq) = seq {
                    c.expect_answers(seq, answers);
                }
                (seq, c.serial)
            }
            None => (None, 0),
        };
        let mandatory = p.mandatory;
        let p = *p;
        let message = Arc::new(Message {
            exchange: p.exchange,
            routing_key: p.routing_key,
            properties: p.properties,
            body: p.body,
        });
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
            let consumes = self.conns.get(&ch.conn).is_none_or(|c| c.consumers > 0);
            let to = ChannelAddr { ch, serial };
            for &queue in &queues {
                self.mail.push_back(Mail::Enqueue {
                    queue,
                    message: message.clone(),
                    publisher: Some(Publisher { to, seq, consumes }),
                });
            }
        }
        if seq.is_some() && queues.is_empty() {
            // Reached no queue (unrouted, or its queues were deleted since the host routed
            // it): confirmed at once, after any return. The queues' answers confirm the rest.
            self.send_confirms(ch);
        }
        queues
    }

    /// A queue's answer to publish `seq` of channel `ch` (see `ChannelState::answered`); a
    /// durable one waits for the sync of the current epoch.
    pub(super) fn answer(&mut self, ch: ChannelRef, seq: u64, taken: bool, durable: bool) {
        let epoch = durable.then_some(self.epoch);
        let Some(channel) = self.channels.get_mut(&ch) else {
            return;
        };
        channel.answered(seq, taken, epoch);
        if let Some(e) = epoch
            && self.confirm_waiters.back() != Some(&(e, ch))
        {
            self.confirm_waiters.push_back((e, ch));
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
    /// took the message with it (so a mandatory publish is not returned either; counted in
    /// `routed_to_deleted`).
    fn still_routable(&mut self, exchange: ExchangeId, mut queues: Vec<QueueId>) -> Vec<QueueId> {
        queues.sort_unstable();
        queues.dedup();
        if self.shard != 0 {
            // No queue directory here: the owner finds the queue gone and counts it.
            return queues;
        }
        let vhost = self.topo.exchange(exchange).map(|x| x.vhost);
        let routed = queues.len();
        queues.retain(|q| self.topo.queue(*q).map(|q| q.vhost) == vhost);
        self.routed_to_deleted += (routed - queues.len()) as u64;
        queues
    }

    /// Every queue a message published to `exchange` reaches, each once, in id order
    /// (through the routing table, as hosts that route outside the broker do).
    pub(super) fn route(&self, exchange: ExchangeId, p: &Publish) -> Vec<QueueId> {
        self.topo
            .routes()
            .route(exchange, &p.routing_key, p.properties.headers.as_ref())
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
        let may_expire = self.expiring.contains(&id);
        loop {
            let picked = self
                .with_queue_and_credit(id, |q, io, credit| q.next_delivery(io, credit, may_expire));
            let Some(picked) = picked.flatten() else {
                return;
            };
            self.mail.push_back(Mail::Deliver { queue: id, picked });
        }
    }

    /// The channel side of a delivery a queue picked: the channel tags it. One whose
    /// channel closed (or closed and opened again) while it travelled goes back: the credit
    /// it took, and the message to its queue (a no-ack one is lost with the channel, as
    /// RabbitMQ loses autoack deliveries in flight to a closed channel; `lost_in_flight`).
    /// A consumer cancelled on a live channel still gets what its queue sent before the
    /// cancel arrived (cancel-ok follows it).
    pub(super) fn deliver_picked(&mut self, queue: QueueId, p: Picked) {
        let m = p.message;
        let channel = match self.channels.get_mut(&p.to.ch) {
            Some(channel) if channel.is_open_as(p.to.serial) => channel,
            _ => {
                let ack_required = !p.no_ack;
                let mut credit = super::ChannelCredit {
                    conns: &mut self.conns,
                    channels: &mut self.channels,
                    write_window: self.config.write_window,
                };
                credit.give_back_to(p.to, ack_required);
                if ack_required {
                    let u = Unacked::of(queue, &m, Some(p.consumer));
                    self.send_settles(vec![u], Settle::Requeue);
                } else {
                    self.lost_in_flight += 1;
                }
                return;
            }
        };
        channel.stats.delivered(m.redelivered);
        let delivery_tag =
            channel.deliver((!p.no_ack).then(|| Unacked::of(queue, &m, Some(p.consumer))));
        self.effects.push(Effect::Deliver {
            ch: p.to.ch,
            consumer_tag: p.tag,
            delivery: Delivery {
                delivery_tag,
                redelivered: m.redelivered,
                message: m.message,
            },
        });
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
        channel.set_prefetch(prefetch_count, global);
        self.reply(ch, Reply::QosOk);
        if global {
            self.dispatch_channel_queues(ch);
        }
        Ok(())
    }

    pub(super) fn consume(&mut self, ch: ChannelRef, c: Consume) -> OpResult {
        if c.queue == crate::channel::reply_to::REPLY_TO {
            return self.consume_reply_to(ch, c);
        }
        let op = OpKind::Consume;
        let (queue, queue_name) = self.find_named_queue(ch, op, &c.queue)?;
        self.check_access(ch, op, Perm::Read, Resource::Queue, &queue_name)?;
        let tag: Arc<str> = if c.consumer_tag.is_empty() {
            Arc::from(self.names.name("amq.ctag-"))
        } else {
            self.shared_tag(&c.consumer_tag)
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
        let (prefetch, serial) = (channel.prefetch_count, channel.serial);
        let priority = c
            .arguments
            .get("x-priority")
            .and_then(|v| v.as_i64())
            .unwrap_or(0);
        let consumer = QueueConsumer {
            // The queue numbers it when it arrives (`consume_in_queue`).
            id: ConsumerId(0),
            tag,
            ch,
            serial,
            no_ack: c.no_ack,
            exclusive: c.exclusive,
            prefetch,
            unacked: 0,
            priority: i32::try_from(priority).unwrap_or(if priority < 0 {
                i32::MIN
            } else {
                i32::MAX
            }),
            // A queue on another shard takes the channel's credit through a shared record.
            shared: if self.queue_shard(queue) == self.shard {
                None
            } else {
                self.share_credit(ch)
            },
        };
        self.mail.push_back(Mail::Consume {
            queue,
            consumer: Box::new(consumer),
            nowait: c.nowait,
        });
        self.await_answer(ch);
        Ok(())
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
    ) {
        consumer.id = ConsumerId(self.id_on(self.shard));
        let (to, cid, tag) = (consumer.addr(), consumer.id, consumer.tag.clone());
        if let Err(error) = self.check_exclusive(to.ch, OpKind::Consume, queue) {
            self.mail.push_back(Mail::Refused { to, error });
            return;
        }
        let now = self.now;
        let refused = match self.queues.get_mut(&queue) {
            None => Some(ProtocolError::new(
                ErrorCode::NotFound,
                OpKind::Consume,
                "the queue was deleted",
            )),
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
        match refused {
            Some(error) => self.mail.push_back(Mail::Refused { to, error }),
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

    /// The channel side of a consumer the queue took: registered, and told to the client.
    /// A channel that closed meanwhile (not `live`) cancels it again.
    pub(super) fn consume_ok(
        &mut self,
        live: bool,
        ch: ChannelRef,
        queue: QueueId,
        cid: ConsumerId,
        tag: Arc<str>,
        nowait: bool,
    ) {
        match self.channels.get_mut(&ch) {
            Some(channel) if live => {
                channel.consumers.insert(tag.clone(), cid, queue);
                if let Some(conn) = self.conns.get_mut(&ch.conn) {
                    conn.consumers += 1;
                }
                if !nowait {
                    self.reply(ch, Reply::ConsumeOk { consumer_tag: tag });
                }
            }
            _ => self.mail.push_back(Mail::Cancel {
                queue,
                consumer: cid,
                reply: None,
            }),
        }
    }

    /// A client's consumer tag as an `Arc`, shared with the previous consumer's if it is
    /// the same string: many connections use one tag (every MQTT session does), and one
    /// allocation per consumer would cost each of a million idle subscribers a malloc chunk.
    fn shared_tag(&mut self, tag: &str) -> Arc<str> {
        match &self.last_tag {
            Some(last) if **last == *tag => last.clone(),
            _ => {
                let tag: Arc<str> = Arc::from(tag);
                self.last_tag = Some(tag.clone());
                tag
            }
        }
    }

    pub(super) fn cancel(&mut self, ch: ChannelRef, tag: &str, nowait: bool) -> OpResult {
        self.cancel_reply_to(ch, tag);
        let consumer = self.channels.get(&ch).and_then(|c| c.consumers.get(tag));
        match consumer {
            Some((cid, queue)) => {
                self.forget_consumer(ch, tag);
                // cancel-ok comes from the queue, after the deliveries it sent before.
                let reply = super::mail::CancelReply {
                    to: self.addr(ch),
                    consumer_tag: Arc::from(tag),
                    nowait,
                };
                self.mail.push_back(Mail::Cancel {
                    queue,
                    consumer: cid,
                    reply: Some(reply),
                });
                self.await_answer(ch);
            }
            // Cancelling an unknown tag is not an error (RabbitMQ answers cancel-ok).
            None if !nowait => {
                let consumer_tag = Arc::from(tag);
                self.reply(ch, Reply::CancelOk { consumer_tag });
            }
            None => {}
        }
        Ok(())
    }

    /// The channel side of a consumer going: its tag, and its count on the connection.
    pub(super) fn forget_consumer(&mut self, ch: ChannelRef, tag: &str) {
        if let Some(channel) = self.channels.get_mut(&ch)
            && channel.consumers.remove(tag).is_some()
            && let Some(conn) = self.conns.get_mut(&ch.conn)
        {
            conn.consumers = conn.consumers.saturating_sub(1);
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
        if let Some(q) = self.queues.get_mut(&queue)
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

    pub(super) fn get(&mut self, ch: ChannelRef, queue: &str, no_ack: bool) -> OpResult {
        let (id, queue_name) = self.find_named_queue(ch, OpKind::Get, queue)?;
        self.check_access(ch, OpKind::Get, Perm::Read, Resource::Queue, &queue_name)?;
        self.mail.push_back(Mail::Get {
            queue: id,
            to: self.addr(ch),
            no_ack,
        });
        self.await_answer(ch);
        Ok(())
    }

    /// The queue side of basic.get: refused if another connection holds the queue
    /// exclusively, else the next ready message, if any.
    pub(super) fn get_in_queue(&mut self, queue: QueueId, to: ChannelAddr, no_ack: bool) {
        if let Err(error) = self.check_exclusive(to.ch, OpKind::Get, queue) {
            self.mail.push_back(Mail::Refused { to, error });
            return;
        }
        let may_expire = self.expiring.contains(&queue);
        let got = self
            .with_queue(queue, |q, io| q.get(io, no_ack, may_expire))
            .flatten();
        self.mail.push_back(Mail::Got {
            queue,
            to,
            no_ack,
            got,
        });
    }

    /// The channel side of basic.get: get-ok with a delivery tag, or get-empty. A channel
    /// gone meanwhile (not `live`) gives the message back (a no-ack one is lost with it).
    pub(super) fn got(
        &mut self,
        live: bool,
        queue: QueueId,
        ch: ChannelRef,
        no_ack: bool,
        got: Option<(QueuedMessage, u32)>,
    ) {
        if !live {
            match got {
                Some(_) if no_ack => self.lost_in_flight += 1,
                Some((m, _)) => {
                    self.send_settles(vec![Unacked::of(queue, &m, None)], Settle::Requeue);
                }
                None => {}
            }
            return;
        }
        let Some((m, message_count)) = got else {
            self.reply(ch, Reply::GetEmpty);
            return;
        };
        let Some(channel) = self.channels.get_mut(&ch) else {
            return;
        };
        channel.stats.delivered(m.redelivered);
        let delivery_tag = channel.deliver((!no_ack).then(|| Unacked::of(queue, &m, None)));
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
    }

    pub(super) fn settle_op(
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
        let op = TxOp::Settle {
            kind,
            delivery_tag,
            multiple,
            settle,
        };
        if channel.buffer(kind, op)?.is_some() {
            self.settle(ch, kind, delivery_tag, multiple, settle)?;
        }
        Ok(())
    }

    /// Acks, requeues or drops the deliveries named by (`delivery_tag`, `multiple`).
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
        let settled = channel.take_settled(kind, delivery_tag, multiple)?;
        channel.count_settled(settle, settled.len());
        self.settle_entries(ch, settled, settle);
        Ok(())
    }

    fn settle_entries(&mut self, ch: ChannelRef, settled: Vec<Unacked>, settle: Settle) {
        self.send_settles(settled, settle);
        self.dispatch_channel_queues(ch);
    }

    /// Sends settled deliveries to their queues: one `Settle` per queue, in queue id order,
    /// each keeping the deliveries' order.
    pub(super) fn send_settles(&mut self, settled: Vec<Unacked>, how: Settle) {
        let Some(first) = settled.first().map(|u| u.queue) else {
            return;
        };
        // Most settles name one queue: their list is the mail, as it is.
        if settled.iter().all(|u| u.queue == first) {
            self.mail.push_back(Mail::Settle {
                queue: first,
                entries: settled,
                how,
            });
            return;
        }
        let mut groups: Vec<(QueueId, Vec<Unacked>)> = Vec::new();
        for u in settled {
            match groups.iter_mut().find(|(q, _)| *q == u.queue) {
                Some((_, entries)) => entries.push(u),
                None => groups.push((u.queue, vec![u])),
            }
        }
        groups.sort_unstable_by_key(|(q, _)| *q);
        for (queue, entries) in groups {
            self.mail.push_back(Mail::Settle {
                queue,
                entries,
                how,
            });
        }
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

    /// Resumes the queues this channel consumes from (credit was freed on the channel).
    fn dispatch_channel_queues(&mut self, ch: ChannelRef) {
        let Some(channel) = self.channels.get(&ch) else {
            return;
        };
        let queues: BTreeSet<QueueId> = channel.consumers.values().map(|(_, q)| q).collect();
        for queue in queues {
            self.mail.push_back(Mail::Dispatch { queue });
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
        let all = channel.take_all_unacked();
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
        channel.select_confirms()?;
        if !nowait {
            self.reply(ch, Reply::ConfirmSelectOk);
        }
        Ok(())
    }

    pub(super) fn tx_select(&mut self, ch: ChannelRef) -> OpResult {
        let Some(channel) = self.channels.get_mut(&ch) else {
            return Ok(());
        };
        channel.select_tx()?;
        self.reply(ch, Reply::TxSelectOk);
        Ok(())
    }

    /// tx.commit: the buffered publishes and settles go to their queues, in order; then
    /// each queue the transaction touched is asked to confirm it has them (`TxFlush`, after
    /// them on the same link), and commit-ok waits for every answer (`TxFlushed`) and, if
    /// the transaction published a persistent message, for the sync that makes it durable.
    pub(super) fn tx_commit(&mut self, ch: ChannelRef) -> OpResult {
        let ops = self.take_tx(ch, OpKind::TxCommit)?;
        let mut touched = BTreeSet::new();
        let mut persistent = false;
        for op in ops {
            match op {
                TxOp::Publish(p) => {
                    persistent |= p.properties.is_persistent();
                    // The exchange may have gone since the publish was buffered.
                    let exchange = self.exchange_id(ch, OpKind::Publish, &p.exchange)?;
                    touched.extend(self.route_and_enqueue(ch, exchange, p));
                }
                TxOp::Settle {
                    kind,
                    delivery_tag,
                    multiple,
                    settle,
                } => {
                    let Some(channel) = self.channels.get_mut(&ch) else {
                        return Ok(());
                    };
                    let settled = channel.take_settled(kind, delivery_tag, multiple)?;
                    channel.count_settled(settle, settled.len());
                    touched.extend(settled.iter().map(|u| u.queue));
                    self.settle_entries(ch, settled, settle);
                }
            }
        }
        if touched.is_empty() {
            self.reply(ch, Reply::TxCommitOk);
            return Ok(());
        }
        let to = self.addr(ch);
        let answers = u32::try_from(touched.len()).unwrap_or(u32::MAX);
        for queue in touched {
            self.mail.push_back(Mail::TxFlush { queue, to });
        }
        if let Some(tx) = self.channels.get_mut(&ch).and_then(|c| c.tx.as_mut()) {
            tx.commit = Some((answers, persistent));
        }
        self.await_answer(ch);
        Ok(())
    }

    /// A queue the commit of channel `to` touched has what the commit sent it. Once every
    /// such queue answered: commit-ok, or, if the commit published a persistent message and
    /// writes are waiting for a sync, a wait for that sync (`tx_synced`). The wait is
    /// conservative (the writes may be another client's): at most one sync more.
    pub(super) fn tx_flushed(&mut self, to: ChannelAddr) {
        if !self.is_live(to) {
            return;
        }
        let Some(tx) = self.channels.get_mut(&to.ch).and_then(|c| c.tx.as_mut()) else {
            return;
        };
        let Some((left, persistent)) = tx.commit.as_mut() else {
            return;
        };
        *left = left.saturating_sub(1);
        if *left > 0 {
            return;
        }
        let persistent = *persistent;
        tx.commit = None;
        if persistent && let Some(epoch) = self.unsynced_epoch() {
            self.tx_sync_waiters.push_back((epoch, to));
            return;
        }
        self.tx_synced(to, true);
    }

    /// The commit of channel `to` is durable (`durable`), or its sync failed: commit-ok,
    /// or the connection closes (541), since the client cannot know what survived.
    pub(super) fn tx_synced(&mut self, to: ChannelAddr, durable: bool) {
        if !self.take_answer(to) {
            return;
        }
        if durable {
            self.reply(to.ch, Reply::TxCommitOk);
            self.run_held(to.ch);
        } else {
            let error = ProtocolError::new(
                ErrorCode::InternalError,
                OpKind::TxCommit,
                "the store failed to sync the transaction; its messages may be lost, \
                 check the broker's log and disk",
            );
            self.fail(ChannelRef::new(to.ch.conn, 0), error);
        }
    }

    pub(super) fn tx_rollback(&mut self, ch: ChannelRef) -> OpResult {
        self.take_tx(ch, OpKind::TxRollback)?;
        self.reply(ch, Reply::TxRollbackOk);
        Ok(())
    }

    /// Takes the buffered operations of a transaction, leaving the channel transactional.
    fn take_tx(&mut self, ch: ChannelRef, kind: OpKind) -> Result<Vec<TxOp>, ProtocolError> {
        match self.channels.get_mut(&ch) {
            Some(channel) => channel.take_tx(kind),
            None => Err(ProtocolError::new(
                ErrorCode::PreconditionFailed,
                kind,
                "channel is not transactional",
            )),
        }
    }
}

impl Broker {
    /// Pauses publishing connection `conn` if queue `id` has consumers and more than
    /// `flow_ready_high` ready messages (the caller knows `conn` does not consume itself).
    pub(super) fn pace(&mut self, conn: ConnId, id: QueueId) {
        let high = self.config.flow_ready_high;
        let Some(q) = self.queues.get_mut(&id) else {
            return;
        };
        if q.consumers.is_empty() || q.messages.len() <= high || q.pausing.contains(&conn) {
            return;
        }
        q.pausing.push(conn);
        self.mail.push_back(Mail::Paused { conn, queue: id });
    }

    /// Lifts the pauses queue `id` holds (it drained, lost its consumers, or is going away).
    pub(super) fn resume_paused(&mut self, id: QueueId) {
        let Some(q) = self.queues.get_mut(&id) else {
            return;
        };
        for conn in q.pausing.take() {
            self.mail.push_back(Mail::Resumed { conn, queue: id });
        }
    }
}
