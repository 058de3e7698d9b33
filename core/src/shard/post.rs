//! The composition's post: delivers mail to the side that owns its destination (queue
//! mail to the queue side, channel mail to the channel side, topology mail to topology),
//! and the entry points through which hosts move mail (scheduled, and between shards).

use super::Broker;
use crate::effect::{Effect, Reply};
use crate::ids::ChannelAddr;
use crate::mail::{Mail, ShardMail};

/// The mail of one operation is bounded by what it touches (the queues a publish reaches, the
/// unacked deliveries of a closing connection, the consumers of a deleted queue), each piece
/// answered at most once; this many means a handler loops.
const MAX_MAIL_PER_PUMP: usize = 1 << 24;

impl Broker {
    /// Delivers queued mail until none is left.
    pub(super) fn pump(&mut self) {
        let mut handled = 0usize;
        while let Some(mail) = self.mail.pop_front() {
            handled += 1;
            assert!(handled < MAX_MAIL_PER_PUMP, "mail loop");
            self.deliver_one(mail);
        }
    }

    /// Hands one piece of mail to its handler. An answer to a channel's request lets
    /// what the channel held run (`hold.rs`).
    pub(super) fn deliver_one(&mut self, mail: Mail) {
        self.mail.from(mail.dest());
        // A queue of another node, or a channel of another node (`nodes_consume.rs`).
        let mail = if self.nodes.crosses() {
            match self.mail_to_home(mail) {
                Some(mail) => mail,
                None => return,
            }
        } else {
            mail
        };
        if let super::mail::Dest::Conn(c) = mail.dest()
            && super::nodes::is_node_conn(c)
            && !matches!(mail, Mail::Answered { .. })
        {
            self.mail_to_node((c.0 - super::nodes::NODE_CONN_BASE) as u32, mail);
            return;
        }
        match mail {
            Mail::Enqueue {
                queue,
                message,
                publisher,
            } => self.enqueue_mail(queue, &message, publisher),
            Mail::Answered {
                to,
                seq,
                taken,
                durable,
            } => {
                if super::dlx::is_dlx_conn(to.ch.conn) {
                    self.dead_letter_answered(seq, taken, durable);
                } else if super::nodes::is_node_conn(to.ch.conn) {
                    self.answer_node(to, seq, taken);
                } else if self.chans.is_live(to) {
                    self.answer(to.ch, seq, taken, durable);
                    self.send_confirms(to.ch);
                }
            }
            Mail::Settle {
                queue,
                entries,
                how,
            } => self.settle_in_queue(queue, entries, how),
            Mail::Dispatch { queue } => self.dispatch(queue),
            Mail::Deliver { queue, picked } => self.deliver_picked(queue, picked),
            Mail::Consume {
                queue,
                consumer,
                nowait,
                stream_offset,
            } => self.consume_in_queue(queue, *consumer, nowait, stream_offset),
            Mail::ConsumeOk {
                to,
                queue,
                consumer,
                tag,
                nowait,
            } => {
                if self.reattaching(to, &tag, queue) {
                    // Its queue moved (a quorum queue's leader): the same consumer, attached
                    // where the queue is now; the client asked nothing.
                    self.reattached(to, &tag);
                    if let Some(c) = self.chans.channels.get_mut(&to.ch) {
                        c.consumers.remove(&tag);
                        c.consumers.insert(tag, consumer, queue);
                    }
                    return;
                }
                let live = self.take_answer(to);
                self.consume_ok(live, to.ch, queue, consumer, tag, nowait);
                self.run_held(to.ch);
            }
            Mail::Refused { to, error } => {
                if self.take_answer(to) {
                    self.fail(to.ch, error);
                }
                self.run_held(to.ch);
            }
            Mail::Cancel {
                queue,
                consumer,
                reply,
            } => self.cancel_in_queue(queue, consumer, reply),
            Mail::Cancelled { reply } => {
                if self.take_answer(reply.to) && !reply.nowait {
                    let consumer_tag = reply.consumer_tag;
                    self.reply(reply.to.ch, Reply::CancelOk { consumer_tag });
                }
                self.run_held(reply.to.ch);
            }
            Mail::ConsumerGone {
                ch,
                consumer,
                consumer_tag,
            } => {
                // The tag may name a newer consumer by now (of a newer opening, even).
                let current = self
                    .chans
                    .channels
                    .get(&ch)
                    .and_then(|c| c.consumers.get(&consumer_tag));
                if current.is_some_and(|(cid, _)| cid == consumer) {
                    self.forget_consumer(ch, &consumer_tag);
                    if self
                        .chans
                        .conns
                        .get(&ch.conn)
                        .is_some_and(|c| c.cancel_notify)
                    {
                        self.effects
                            .push(Effect::ConsumerCancelled { ch, consumer_tag });
                    }
                }
            }
            Mail::Get { queue, to, no_ack } => self.get_in_queue(queue, to, no_ack),
            Mail::Got {
                queue,
                to,
                no_ack,
                got,
            } => {
                let live = self.take_answer(to);
                self.got(live, queue, to.ch, no_ack, got);
                self.run_held(to.ch);
            }
            Mail::Purge { queue, to, nowait } => self.purge_in_queue(queue, to, nowait),
            Mail::Purged {
                to,
                message_count,
                nowait,
            } => {
                let reply = (!nowait).then_some(Reply::QueuePurgeOk { message_count });
                self.answered(to, 0, reply);
            }
            Mail::TxFlush { to, .. } => {
                let flushed = Mail::TxFlushed { to, durable: true };
                match self.unsynced_epoch() {
                    // The commit's persistent messages here are durable once this shard's
                    // sync covers them, which the channel's shard cannot see: the answer
                    // waits for it (conservatively: the writes may be another client's).
                    Some(epoch) if self.conn_shard(to.ch.conn) != self.shard => {
                        self.remote_answers.push_back((epoch, flushed));
                    }
                    _ => self.mail.push_back(flushed),
                }
            }
            Mail::TxFlushed { to, durable: true } => self.tx_flushed(to),
            Mail::TxFlushed { to, durable: false } => self.tx_synced(to, false),
            Mail::Redeclare {
                queue,
                to,
                vhost,
                declare,
            } => self.redeclare_in_queue(queue, to, vhost, *declare),
            Mail::Declared {
                to,
                queue,
                message_count,
                consumer_count,
                nowait,
                version,
            } => {
                let reply = (!nowait).then_some(Reply::QueueDeclareOk {
                    queue,
                    message_count,
                    consumer_count,
                });
                self.answered(to, version, reply);
            }
            Mail::CreateQueue { queue, to, create } => self.create_queue(queue, to, *create),
            Mail::QueueCreated {
                queue,
                to,
                message_count,
                nowait,
            } => self.queue_created(queue, to, message_count, nowait),
            Mail::QueueGone { queue, answer } => self.queue_gone(queue, answer),
            Mail::Delete {
                queue,
                to,
                if_unused,
                if_empty,
                nowait,
            } => self.delete_in_queue(queue, to, if_unused, if_empty, nowait),
            Mail::Deleted {
                to,
                message_count,
                nowait,
                version,
            } => {
                let reply = (!nowait).then_some(Reply::QueueDeleteOk { message_count });
                self.answered(to, version, reply);
            }
            Mail::Topology { to, vhost, request } => self.topology_request(to, vhost, &request),
            Mail::TopologyDone { to, reply, version } => self.answered(to, version, reply),
            Mail::Paused { conn, queue } => match self.chans.conns.get_mut(&conn) {
                Some(c) => {
                    if c.paused_in.insert(queue) && c.paused_in.len() == 1 {
                        self.effects.push(Effect::FlowPaused { conn });
                    }
                }
                // The connection went while the pause travelled: the queue forgets it.
                None => self.mail.push_back(Mail::PublisherGone { queue, conn }),
            },
            Mail::Reply {
                address, message, ..
            } => {
                self.deliver_reply_here(&address, &message);
            }
            Mail::PublisherGone { queue, conn } => {
                if let Some(q) = self.qs.queues.get_mut(&queue) {
                    q.pausing.remove(conn);
                }
            }
            Mail::Resumed { conn, queue } => {
                if let Some(c) = self.chans.conns.get_mut(&conn)
                    && c.paused_in.remove(&queue)
                    && c.paused_in.is_empty()
                {
                    self.effects.push(Effect::FlowResumed { conn });
                }
            }
        }
    }

    /// A request of `to` is answered, on routing table `version` (0 when the answer changed
    /// no routing): `reply` goes out if `to` is still live, then what the channel held runs.
    pub(super) fn answered(&mut self, to: ChannelAddr, version: u64, reply: Option<Reply>) {
        if self.take_answer(to) {
            self.saw_version(to.ch.conn, version);
            if let Some(reply) = reply {
                self.reply(to.ch, reply);
            }
        }
        self.run_held(to.ch);
    }

    /// Makes mail wait for `deliver_mail` instead of arriving within the operation that
    /// sent it: the multi-shard simulation's model of mail that takes time (a channel's
    /// requests are then answered later, and what it sends meanwhile waits, as it will
    /// with shards). Hosts leave it off. Turning it off delivers what is pending.
    pub fn set_mail_scheduled(&mut self, on: bool) {
        self.mail_scheduled = on;
        self.mail.set_scheduled(on);
        if !on {
            self.after_op();
        }
    }

    /// Mail sent and not delivered yet (always 0 unless `set_mail_scheduled`).
    pub fn mail_pending(&self) -> usize {
        self.mail.len()
    }

    /// Delivers one piece of scheduled mail at time `now`: the oldest one with the source
    /// and destination of the `pick`-th pending piece (modulo their number). So what one
    /// queue or connection sends another arrives in the order it was sent, and the rest
    /// in any order the caller picks. False if no mail is pending (or it is not scheduled).
    pub fn deliver_mail(&mut self, now: u64, pick: usize) -> bool {
        let Some(mail) = self.mail.take(pick) else {
            return false;
        };
        self.now = self.now.max(now);
        self.deliver_one(mail);
        self.after_op();
        true
    }

    /// Mail for other shards sent since the last call, in the order sent: the host hands
    /// each piece to its shard's `receive_mail`, keeping that order between each pair of
    /// shards. Always empty with one shard.
    pub fn take_outbox(&mut self, out: &mut Vec<ShardMail>) {
        self.mail.take_outbox(out);
    }

    /// Delivers mail another shard sent here, at time `now` (ARCHITECTURE.md,
    /// "warren-runtime"): it arrives now, whether this shard's own mail is scheduled or not.
    pub fn receive_mail(&mut self, now: u64, mail: ShardMail) {
        self.receive_mails(now, [mail]);
    }

    /// `receive_mail` of a batch, in order (what each piece causes runs after all of them).
    pub fn receive_mails(&mut self, now: u64, mails: impl IntoIterator<Item = ShardMail>) {
        self.now = self.now.max(now);
        for mail in mails {
            debug_assert_eq!(mail.shard, self.shard, "mail for another shard");
            self.deliver_one(mail.mail);
            if !self.mail_scheduled {
                // Each piece's own mail first, as if it had come alone.
                self.pump();
            }
        }
        self.after_op();
    }

    /// No-ack deliveries and basic.get messages lost because their channel closed while
    /// they travelled to it (as RabbitMQ loses them); 0 unless mail is scheduled.
    pub fn lost_in_flight(&self) -> u64 {
        self.lost_in_flight
    }

    /// Messages routed to a queue that was deleted before they reached it (the deletion
    /// took them, as if they had arrived just before it). With mail delivered within the
    /// operation, only a queue deleted by the operation that routed to it does this.
    pub fn routed_to_deleted(&self) -> u64 {
        self.routed_to_deleted
    }

    /// Messages dropped by `mqtt-qos0` queues since the start: at their arrival no consumer
    /// of the queue had write-window credit (a subscriber slower than its publishers).
    pub fn qos0_dropped(&self) -> u64 {
        self.qos0_dropped
    }

    /// Deliveries requeued (rejected with requeue, recovered, or left by a closed channel)
    /// after their queue was deleted: the deletion took them.
    pub fn requeued_to_deleted(&self) -> u64 {
        self.requeued_to_deleted
    }
}
