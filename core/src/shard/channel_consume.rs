//! The channel side of consuming: basic.qos, basic.consume/cancel/get (requests to the
//! queue, by mail), deliveries arriving from queues, acks, nacks, rejects and recover (sent
//! back to their queues as `Mail::Settle`).

use super::mail::Mail;
use super::*;
use crate::access::{Perm, Resource};
use crate::channel::TxOp;
use crate::command::{Consume, OpKind};
use crate::effect::{Delivery, Effect, Reply};
use crate::error::{ErrorCode, ProtocolError};
use crate::ids::{ChannelRef, QueueId};
use crate::queue::classic::QueuedMessage;
use crate::queue::state::{ConsumerId, Picked, QueueConsumer, Settle, Unacked};
use std::collections::BTreeSet;
use std::sync::Arc;

impl Broker {
    /// The channel side of a delivery a queue picked: the channel tags it. One whose
    /// channel closed (or closed and opened again) while it travelled goes back: the credit
    /// it took, and the message to its queue (a no-ack one is lost with the channel, as
    /// RabbitMQ loses autoack deliveries in flight to a closed channel; `lost_in_flight`).
    /// A consumer cancelled on a live channel still gets what its queue sent before the
    /// cancel arrived (cancel-ok follows it).
    pub(super) fn deliver_picked(&mut self, queue: QueueId, p: Picked) {
        let m = p.message;
        let channel = match self.chans.channels.get_mut(&p.to.ch) {
            Some(channel) if channel.is_open_as(p.to.serial) => channel,
            _ => {
                let ack_required = !p.no_ack;
                if ack_required
                    && let Some(c) = self.chans.channels.get_mut(&p.to.ch)
                    && c.serial == p.to.serial
                {
                    c.consumer_unacked.sub(1);
                }
                // Its write-window credit comes back as a written delivery's does: the
                // window may have been full when it was picked, and the connection's other
                // queues, stopped by it, wait for this to reopen it (no `Op::Written` will
                // ever count this delivery).
                self.written(p.to.ch.conn, 1);
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
        let Some(channel) = self.chans.channels.get_mut(&ch) else {
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
        let Some(channel) = self.chans.channels.get(&ch) else {
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
        let global_qos = channel.global_prefetch > 0;
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
            global_qos,
            prefetch,
            unacked: 0,
            refilling: false,
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
            stream_offset: c.arguments.get("x-stream-offset").cloned().map(Box::new),
        });
        self.await_answer(ch);
        Ok(())
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
        match self.chans.channels.get_mut(&ch) {
            Some(channel) if live => {
                channel.consumers.insert(tag.clone(), cid, queue);
                if let Some(conn) = self.chans.conns.get_mut(&ch.conn) {
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
    pub(super) fn shared_tag(&mut self, tag: &str) -> Arc<str> {
        match &self.chans.last_tag {
            Some(last) if **last == *tag => last.clone(),
            _ => {
                let tag: Arc<str> = Arc::from(tag);
                self.chans.last_tag = Some(tag.clone());
                tag
            }
        }
    }

    pub(super) fn cancel(&mut self, ch: ChannelRef, tag: &str, nowait: bool) -> OpResult {
        self.cancel_reply_to(ch, tag);
        let consumer = self
            .chans
            .channels
            .get(&ch)
            .and_then(|c| c.consumers.get(tag));
        match consumer {
            Some((cid, queue)) => {
                self.forget_consumer(ch, tag);
                // cancel-ok comes from the queue, after the deliveries it sent before.
                let reply = super::mail::CancelReply {
                    to: self.chans.addr(ch),
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
        if let Some(channel) = self.chans.channels.get_mut(&ch)
            && channel.consumers.remove(tag).is_some()
            && let Some(conn) = self.chans.conns.get_mut(&ch.conn)
        {
            conn.consumers = conn.consumers.saturating_sub(1);
        }
    }

    pub(super) fn get(&mut self, ch: ChannelRef, queue: &str, no_ack: bool) -> OpResult {
        let (id, queue_name) = self.find_named_queue(ch, OpKind::Get, queue)?;
        self.check_access(ch, OpKind::Get, Perm::Read, Resource::Queue, &queue_name)?;
        self.mail.push_back(Mail::Get {
            queue: id,
            to: self.chans.addr(ch),
            no_ack,
        });
        self.await_answer(ch);
        Ok(())
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
        let Some(channel) = self.chans.channels.get_mut(&ch) else {
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
        let Some(channel) = self.chans.channels.get_mut(&ch) else {
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
    pub(super) fn settle(
        &mut self,
        ch: ChannelRef,
        kind: OpKind,
        delivery_tag: u64,
        multiple: bool,
        settle: Settle,
    ) -> OpResult {
        let Some(channel) = self.chans.channels.get_mut(&ch) else {
            return Ok(());
        };
        let settled = channel.take_settled(kind, delivery_tag, multiple)?;
        channel.count_settled(settle, settled.len());
        self.settle_entries(ch, settled, settle);
        Ok(())
    }

    pub(super) fn settle_entries(&mut self, ch: ChannelRef, settled: Vec<Unacked>, settle: Settle) {
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

    /// Resumes the queues this channel consumes from (credit was freed on the channel).
    pub(super) fn dispatch_channel_queues(&mut self, ch: ChannelRef) {
        let Some(channel) = self.chans.channels.get(&ch) else {
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
        let Some(channel) = self.chans.channels.get_mut(&ch) else {
            return Ok(());
        };
        let all = channel.take_all_unacked();
        // recover-ok goes before the redeliveries, as RabbitMQ orders them: clients (lapin)
        // discard deliveries they hold when recover-ok arrives.
        self.reply(ch, Reply::RecoverOk);
        self.settle_entries(ch, all, Settle::Requeue);
        Ok(())
    }
}
