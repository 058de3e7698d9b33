//! Mail between the queue side, the channel side and topology: the messages that will
//! cross shards in the sharded design (ARCHITECTURE.md, "warren-runtime"). Publish,
//! dispatch, acks, consume, cancel, get, purge, queue deletion, bindings, flow control and
//! dead letters already go only this way; what is still called directly is listed in
//! ARCHITECTURE.md.
//!
//! A handler touches one side only (`Enqueue` runs on the queue's state, `Answered` on the
//! channel's, `Bind` on topology). The synchronous composition delivers mail in FIFO order at the end of each
//! operation (`pump`), so effects come out in the order they did when the sides called each
//! other directly. With shards, mail may find its channel closed, or closed and opened
//! again: mail to a channel names the opening it is for (`ChannelAddr`), and the handlers
//! give back what it carried. `set_mail_scheduled` hands delivery to the host (the
//! simulation), FIFO per destination and in any order across destinations, as between
//! shards; a channel's requests are then answered later, and `hold.rs` keeps its replies in
//! order.

use super::Broker;
use crate::command::{Bind, ExchangeDeclare, OpKind, QueueDeclare};
use crate::effect::{Effect, Reply};
use crate::error::ProtocolError;
use crate::ids::{ChannelAddr, ChannelRef, ConnId, QueueId, VhostId};
use crate::message::Message;
use crate::queue::classic::QueuedMessage;
use crate::queue::state::{ConsumerId, Enqueued, Picked, QueueConsumer, Settle, Unacked};
use std::collections::VecDeque;
use std::sync::Arc;

/// Who published a message being enqueued, as the queue needs to know it.
#[derive(Clone, Copy)]
pub(crate) struct Publisher {
    pub(crate) to: ChannelAddr,
    /// The publish's confirm sequence number, in confirm mode: the queue answers it.
    pub(crate) seq: Option<u64>,
    /// The publishing connection consumes itself, so flow control must not pause it (it
    /// could never drain what it waits for).
    pub(crate) consumes: bool,
}

pub(crate) enum Mail {
    /// Channel -> queue: a routed publish.
    Enqueue {
        queue: QueueId,
        message: Arc<Message>,
        /// `None` for a dead letter: nobody to answer or to pace.
        publisher: Option<Publisher>,
    },
    /// Queue -> channel: the queue's answer to publish `seq` (see `ChannelState::answered`).
    Answered {
        to: ChannelAddr,
        seq: u64,
        /// The queue took the message (not refused by its store or by `x-overflow`).
        taken: bool,
        /// Persistent on a durable queue: it waits for the sync of the current epoch.
        durable: bool,
    },
    /// Channel -> queue: deliveries of this queue settled on a channel, in delivery order.
    Settle {
        queue: QueueId,
        entries: Vec<Unacked>,
        how: Settle,
    },
    /// Channel -> queue: the channel freed credit the queue may be waiting for (its shared
    /// prefetch): dispatch.
    Dispatch { queue: QueueId },
    /// Channel -> queue: basic.consume (the channel checked the tag and the permission).
    /// Always answered (`ConsumeOk` or `Refused`), `nowait` or not: the channel waits.
    Consume {
        queue: QueueId,
        consumer: Box<QueueConsumer>,
        nowait: bool,
    },
    /// Queue -> channel: the queue took the consumer.
    ConsumeOk {
        to: ChannelAddr,
        queue: QueueId,
        consumer: ConsumerId,
        tag: Arc<str>,
        nowait: bool,
    },
    /// Queue -> channel: the queue refused a request; a channel error.
    Refused {
        to: ChannelAddr,
        error: ProtocolError,
    },
    /// Channel -> queue: a consumer goes (basic.cancel, or its channel closed, then
    /// without `reply`).
    Cancel {
        queue: QueueId,
        consumer: ConsumerId,
        reply: Option<CancelReply>,
    },
    /// Queue -> channel: the consumer is gone (after every delivery the queue sent it).
    Cancelled { reply: CancelReply },
    /// Queue -> channel: the queue was deleted under this consumer (the client hears of it
    /// if it understands `basic.cancel` from the server).
    ConsumerGone {
        ch: ChannelRef,
        consumer: ConsumerId,
        consumer_tag: Arc<str>,
    },
    /// Channel -> queue: basic.get.
    Get {
        queue: QueueId,
        to: ChannelAddr,
        no_ack: bool,
    },
    /// Queue -> channel: what basic.get found (the message and how many stay ready).
    Got {
        queue: QueueId,
        to: ChannelAddr,
        no_ack: bool,
        got: Option<(QueuedMessage, u32)>,
    },
    /// Channel -> queue: queue.purge (always answered: the channel waits).
    Purge {
        queue: QueueId,
        to: ChannelAddr,
        nowait: bool,
    },
    /// Channel -> queue: queue.declare of a queue that exists (always answered: the
    /// channel waits).
    Redeclare {
        queue: QueueId,
        to: ChannelAddr,
        vhost: VhostId,
        declare: Box<QueueDeclare>,
    },
    /// Queue or topology -> channel: declare-ok (unless `nowait`) with the queue's counts;
    /// from topology, of a new queue, with the routing table version that holds it (as
    /// `TopologyDone`).
    Declared {
        to: ChannelAddr,
        queue: Arc<str>,
        message_count: u32,
        consumer_count: u32,
        nowait: bool,
        version: u64,
    },
    /// Topology -> the new queue's owner: create it (named, stored and in topology's
    /// directory already, not routable yet).
    CreateQueue {
        queue: QueueId,
        to: ChannelAddr,
        create: Box<CreateQueue>,
    },
    /// Owner -> topology: the queue exists; make it routable and answer its declarer.
    QueueCreated {
        queue: QueueId,
        to: ChannelAddr,
        message_count: u32,
        nowait: bool,
    },
    /// Owner -> topology: the queue is gone (or was never created): forget its name and
    /// bindings, then answer the queue.delete that removed it, if one did.
    QueueGone {
        queue: QueueId,
        answer: Option<DeleteAnswer>,
    },
    /// Channel -> queue: a transaction's commit sent this queue what it touched here
    /// (before this, on the same link): answer when it is done.
    TxFlush { queue: QueueId, to: ChannelAddr },
    /// Queue -> channel: the commit's operations on this queue are done (and, from a
    /// queue on another shard, durable: `durable` false if that shard's sync failed).
    TxFlushed { to: ChannelAddr, durable: bool },
    /// Channel -> queue: queue.delete (always answered: the channel waits).
    Delete {
        queue: QueueId,
        to: ChannelAddr,
        if_unused: bool,
        if_empty: bool,
        nowait: bool,
    },
    /// Topology -> channel: the queue is deleted and unroutable (delete-ok unless
    /// `nowait`), from routing table `version` on.
    Deleted {
        to: ChannelAddr,
        message_count: u32,
        nowait: bool,
        version: u64,
    },
    /// Queue -> channel: the purge is done (purge-ok unless `nowait`).
    Purged {
        to: ChannelAddr,
        message_count: u32,
        nowait: bool,
    },
    /// Queue -> channel: a delivery the queue's dispatch picked, its credit taken.
    Deliver { queue: QueueId, picked: Picked },
    /// Queue -> connection: the queue has paused the publishing connection (flow control).
    Paused { conn: ConnId, queue: QueueId },
    /// Connection -> queue: a connection the queue paused is gone: forget it.
    PublisherGone { queue: QueueId, conn: ConnId },
    /// Channel -> topology: a request in `vhost`, permissions checked by the channel
    /// (always answered: the channel waits).
    Topology {
        to: ChannelAddr,
        vhost: VhostId,
        request: Box<TopologyRequest>,
    },
    /// Topology -> channel: the request is done (its ok, unless `nowait`), on routing table
    /// `version` and later: the channel's connection routes on no older table from now on.
    TopologyDone {
        to: ChannelAddr,
        reply: Option<Reply>,
        version: u64,
    },
    /// Channel -> connection: a reply published to the direct reply-to address of a
    /// consumer on that connection (another shard's).
    Reply {
        conn: ConnId,
        address: Arc<str>,
        message: Arc<Message>,
    },
    /// Queue -> connection: the queue lifted its pause (it drained, lost its consumers, or
    /// went away). Sent after the `Paused` it lifts, so the connection never stays paused by
    /// a queue that no longer pauses it.
    Resumed { conn: ConnId, queue: QueueId },
}

/// The answer a queue.delete gets once topology has forgotten the queue.
#[derive(Clone, Copy)]
pub(crate) struct DeleteAnswer {
    pub(crate) to: ChannelAddr,
    /// The messages the queue held.
    pub(crate) message_count: u32,
    pub(crate) nowait: bool,
}

/// What the owner of a new queue needs to create it.
pub(crate) struct CreateQueue {
    pub(crate) vhost: VhostId,
    pub(crate) vhost_name: Arc<str>,
    /// The queue's name, shared with topology's directory.
    pub(crate) name: Arc<str>,
    /// The declare, its name resolved.
    pub(crate) declare: QueueDeclare,
    /// Its arguments with the policy applied, parsed.
    pub(crate) args: crate::queue::args::QueueArgs,
}

/// What a channel asks of topology.
pub(crate) enum TopologyRequest {
    /// exchange.bind/unbind or queue.bind/unbind (`op`), the queue name resolved.
    Bind { op: OpKind, bind: Bind },
    /// exchange.declare; `kind` is its parsed type, `None` for a passive one.
    DeclareExchange {
        declare: ExchangeDeclare,
        kind: Option<crate::command::ExchangeKind>,
    },
    DeleteExchange {
        name: String,
        if_unused: bool,
        nowait: bool,
    },
    /// queue.declare, its name resolved (`trusted_name`: the server's, exempt from the
    /// reserved-prefix check: generated, or replayed by restore or import); `name` is
    /// the same name, allocated once for the channel's last queue, topology and the queue.
    DeclareQueue {
        declare: QueueDeclare,
        name: Arc<str>,
        trusted_name: bool,
    },
}

/// Where a basic.cancel is answered (always, `nowait` or not: the channel waits for it).
pub(crate) struct CancelReply {
    pub(crate) to: ChannelAddr,
    pub(crate) consumer_tag: Arc<str>,
    /// No cancel-ok for the client.
    pub(crate) nowait: bool,
}

/// Where a piece of mail goes, or comes from: a queue, a connection (its channels),
/// topology (shard 0's part, with shards), or the host (admin ops, restore, dead-letter
/// routing).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Dest {
    Queue(QueueId),
    Conn(ConnId),
    Topology,
    Host,
}

/// Mail sent and not delivered yet. With scheduled mail it also keeps where each piece
/// came from, so `deliver_mail` keeps the order of each (source, destination) pair only,
/// as FIFO links between shards do (they keep more order than that: a link carries the
/// mail of many pairs).
pub(crate) struct Mailbox {
    queue: VecDeque<Mail>,
    /// Scheduled mail only: each piece's source, in step with `queue`.
    sources: Option<VecDeque<Dest>>,
    /// The source of what is sent now.
    from: Dest,
    /// This broker's shard, and how many there are: mail for a queue or connection of
    /// another shard, or for topology (shard 0's), waits in `outbox` for the host.
    shard: u32,
    shards: u32,
    outbox: Vec<ShardMail>,
}

impl Default for Mailbox {
    fn default() -> Mailbox {
        Mailbox {
            queue: VecDeque::new(),
            sources: None,
            from: Dest::Host,
            shard: 0,
            shards: 1,
            outbox: Vec::new(),
        }
    }
}

/// Mail from one shard to another (ARCHITECTURE.md, "warren-runtime"). The host takes it
/// from the sender's outbox (`Broker::take_outbox`) and hands it to shard [`Self::shard`]
/// (`Broker::receive_mail`), in the order sent between each pair of shards.
pub struct ShardMail {
    shard: u32,
    mail: Mail,
}

impl ShardMail {
    /// The shard it goes to.
    pub fn shard(&self) -> u32 {
        self.shard
    }
}

impl Mailbox {
    /// Makes this the mailbox of shard `shard` of `shards`.
    pub(super) fn set_shard(&mut self, shard: u32, shards: u32) {
        assert!(shards >= 1 && shard < shards, "shard {shard} of {shards}");
        self.shard = shard;
        self.shards = shards;
    }

    /// The shard that owns `dest`: a queue's or connection's id says it (`id % shards`);
    /// topology, and the internal connection that restores definitions and runs admin
    /// ops, are shard 0's; the host is everyone's own.
    pub(super) fn shard_of(&self, dest: Dest) -> u32 {
        let k = u64::from(self.shards);
        match dest {
            Dest::Queue(q) => (q.0 % k) as u32,
            Dest::Conn(c) if c != super::RESTORE_CONN => (c.0 % k) as u32,
            Dest::Topology | Dest::Conn(_) => 0,
            Dest::Host => self.shard,
        }
    }

    pub(super) fn outbox_len(&self) -> usize {
        self.outbox.len()
    }

    pub(super) fn take_outbox(&mut self, out: &mut Vec<ShardMail>) {
        out.append(&mut self.outbox);
    }

    #[inline]
    pub(super) fn push_back(&mut self, mail: Mail) {
        if self.shards > 1 {
            let shard = self.shard_of(mail.dest());
            if shard != self.shard {
                self.outbox.push(ShardMail { shard, mail });
                return;
            }
        }
        if let Some(sources) = &mut self.sources {
            sources.push_back(self.from);
        }
        self.queue.push_back(mail);
    }

    #[inline]
    pub(super) fn pop_front(&mut self) -> Option<Mail> {
        if let Some(sources) = &mut self.sources {
            sources.pop_front();
        }
        self.queue.pop_front()
    }

    /// Sends `mail` as `source` (with scheduled mail, it keeps order with what `source`
    /// sends, whoever runs now).
    pub(super) fn push_from(&mut self, source: Dest, mail: Mail) {
        let now = std::mem::replace(&mut self.from, source);
        self.push_back(mail);
        self.from = now;
    }

    #[cfg(test)]
    pub(super) fn front(&self) -> Option<&Mail> {
        self.queue.front()
    }

    #[inline]
    pub(super) fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    #[inline]
    pub(super) fn len(&self) -> usize {
        self.queue.len()
    }

    /// Who sends what is pushed from now on.
    #[inline]
    pub(super) fn from(&mut self, source: Dest) {
        self.from = source;
    }

    fn set_scheduled(&mut self, on: bool) {
        self.sources = on.then(|| self.queue.iter().map(|_| Dest::Host).collect());
    }

    /// The oldest piece with the source and destination of the `pick`-th one.
    fn take(&mut self, pick: usize) -> Option<Mail> {
        let n = self.queue.len();
        let sources = self.sources.as_mut()?;
        if n == 0 {
            return None;
        }
        let key = (sources[pick % n], self.queue[pick % n].dest());
        let first = (0..n).find(|&i| (sources[i], self.queue[i].dest()) == key)?;
        sources.remove(first);
        self.queue.remove(first)
    }
}

impl Mail {
    fn dest(&self) -> Dest {
        match self {
            Mail::Enqueue { queue, .. }
            | Mail::Settle { queue, .. }
            | Mail::Dispatch { queue }
            | Mail::Consume { queue, .. }
            | Mail::Cancel { queue, .. }
            | Mail::Get { queue, .. }
            | Mail::Purge { queue, .. }
            | Mail::Delete { queue, .. }
            | Mail::Redeclare { queue, .. }
            | Mail::TxFlush { queue, .. }
            | Mail::PublisherGone { queue, .. }
            | Mail::CreateQueue { queue, .. } => Dest::Queue(*queue),
            Mail::Topology { .. } | Mail::QueueCreated { .. } | Mail::QueueGone { .. } => {
                Dest::Topology
            }
            Mail::Answered { to, .. }
            | Mail::ConsumeOk { to, .. }
            | Mail::Refused { to, .. }
            | Mail::Got { to, .. }
            | Mail::Purged { to, .. }
            | Mail::Deleted { to, .. }
            | Mail::Declared { to, .. }
            | Mail::TopologyDone { to, .. }
            | Mail::TxFlushed { to, .. } => Dest::Conn(to.ch.conn),
            Mail::Cancelled { reply } => Dest::Conn(reply.to.ch.conn),
            Mail::ConsumerGone { ch, .. } => Dest::Conn(ch.conn),
            Mail::Deliver { picked, .. } => Dest::Conn(picked.to.ch.conn),
            Mail::Paused { conn, .. } | Mail::Resumed { conn, .. } | Mail::Reply { conn, .. } => {
                Dest::Conn(*conn)
            }
        }
    }
}

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
    fn deliver_one(&mut self, mail: Mail) {
        self.mail.from(mail.dest());
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
                if self.is_live(to) {
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
            } => self.consume_in_queue(queue, *consumer, nowait),
            Mail::ConsumeOk {
                to,
                queue,
                consumer,
                tag,
                nowait,
            } => {
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
                    .channels
                    .get(&ch)
                    .and_then(|c| c.consumers.get(&consumer_tag));
                if current.is_some_and(|(cid, _)| cid == consumer) {
                    self.forget_consumer(ch, &consumer_tag);
                    if self.conns.get(&ch.conn).is_some_and(|c| c.cancel_notify) {
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
            Mail::Paused { conn, queue } => match self.conns.get_mut(&conn) {
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
                if let Some(q) = self.queues.get_mut(&queue) {
                    q.pausing.remove(conn);
                }
            }
            Mail::Resumed { conn, queue } => {
                if let Some(c) = self.conns.get_mut(&conn)
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
    fn answered(&mut self, to: ChannelAddr, version: u64, reply: Option<Reply>) {
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
            debug_assert_eq!(mail.shard, self.mail.shard, "mail for another shard");
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

    /// Deliveries requeued (rejected with requeue, recovered, or left by a closed channel)
    /// after their queue was deleted: the deletion took them.
    pub fn requeued_to_deleted(&self) -> u64 {
        self.requeued_to_deleted
    }

    /// The queue side of a publish: enqueue, answer, dispatch, pace.
    fn enqueue_mail(
        &mut self,
        queue: QueueId,
        message: &Arc<Message>,
        publisher: Option<Publisher>,
    ) {
        if !self.queues.contains_key(&queue) {
            // Deleted since the publish was routed: the deletion took it (confirmed, as
            // the publish came before the deletion).
            self.routed_to_deleted += 1;
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
            if durable && self.conn_shard(to.ch.conn) != self.shard {
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
}

#[cfg(test)]
mod tests {
    //! The paths the synchronous composition never takes, since it delivers mail within
    //! the operation that sent it: with shards, a channel may close while mail for it
    //! travels. Each test stops the pump at the mail in question and closes the channel.
    use super::*;
    use crate::command::{Consume, Op, Publish, QueueDeclare};
    use crate::message::{FieldTable, Properties};
    use crate::{Broker, BrokerConfig};

    const CH: ChannelRef = ChannelRef::new(ConnId(1), 1);

    fn ops(b: &mut Broker, ch: ChannelRef, ops: Vec<Op>) -> Vec<Effect> {
        for op in ops {
            b.handle(1, ch, op);
        }
        let mut out = Vec::new();
        b.poll_effects(&mut out);
        out
    }

    /// A broker with queue `q` holding one message, and channel `CH` open.
    fn one_message() -> Broker {
        let mut b = Broker::new(BrokerConfig::default());
        let open = Op::ConnectionOpen {
            vhost: "/".into(),
            user: "guest".into(),
            cancel_notify: true,
        };
        ops(&mut b, ChannelRef::new(ConnId(1), 0), vec![open]);
        ops(
            &mut b,
            CH,
            vec![Op::ChannelOpen, declare_op(false), publish_op(b"hello")],
        );
        assert_eq!(b.queue_len("q"), Some(1));
        b
    }

    /// `one_message`, with mail that waits for `deliver_mail`.
    fn scheduled() -> Broker {
        let mut b = one_message();
        b.set_mail_scheduled(true);
        b
    }

    fn consume(b: &mut Broker) {
        let consume = Consume {
            queue: "q".into(),
            consumer_tag: "c".into(),
            no_local: false,
            no_ack: false,
            exclusive: false,
            nowait: true,
            arguments: FieldTable::new(),
        };
        assert!(b.consume(CH, consume).is_ok());
    }

    /// Delivers mail until the next one matches `stop`.
    fn pump_until(b: &mut Broker, stop: impl Fn(&Mail) -> bool) {
        while !b.mail.front().is_some_and(&stop) {
            let mail = b.mail.pop_front().expect("the awaited mail comes");
            b.deliver_one(mail);
        }
    }

    /// Closes `CH` (delivering the mail left) and checks that the message is back in its
    /// queue with everything it held, and that nothing reached the closed channel.
    fn close_and_check(b: &mut Broker) {
        let effects = ops(b, CH, vec![Op::ChannelClose]);
        let close_ok = Effect::Reply {
            ch: CH,
            reply: Reply::ChannelCloseOk,
        };
        assert_eq!(
            effects,
            vec![close_ok],
            "nothing but close-ok reaches the channel"
        );
        assert_eq!(
            b.queue_len("q"),
            Some(1),
            "the message is back in its queue"
        );
        assert_eq!(
            b.conns[&ConnId(1)].in_flight.get(),
            0,
            "its write credit is back"
        );
        assert_eq!(b.stored_bytes(), 5);
        assert_eq!(b.check_invariants(), Ok(()));
    }

    #[test]
    fn a_delivery_to_a_closed_channel_returns_to_its_queue() {
        let mut b = one_message();
        consume(&mut b);
        pump_until(&mut b, |m| matches!(m, Mail::Deliver { .. }));
        close_and_check(&mut b);
    }

    #[test]
    fn a_consumer_taken_for_a_closed_channel_is_cancelled() {
        let mut b = one_message();
        consume(&mut b);
        pump_until(&mut b, |m| matches!(m, Mail::ConsumeOk { .. }));
        close_and_check(&mut b);
        assert!(b.queues.values().all(|q| q.consumers.is_empty()));
    }

    #[test]
    fn a_get_whose_connection_closed_returns_to_its_queue() {
        let mut b = one_message();
        assert!(b.get(CH, "q", false).is_ok());
        pump_until(&mut b, |m| matches!(m, Mail::Got { .. }));
        let effects = ops(
            &mut b,
            ChannelRef::new(ConnId(1), 0),
            vec![Op::ConnectionClose],
        );
        assert_eq!(effects, vec![], "nothing reaches the closed connection");
        assert_eq!(
            b.queue_len("q"),
            Some(1),
            "the message is back in its queue"
        );
        assert_eq!(b.stored_bytes(), 5);
        assert_eq!(b.check_invariants(), Ok(()));
    }

    /// queue.declare of `q`, durable or not.
    fn declare_op(durable: bool) -> Op {
        declare_queue("q", durable, false)
    }

    fn declare_queue(name: &str, durable: bool, exclusive: bool) -> Op {
        Op::QueueDeclare(QueueDeclare {
            queue: name.into(),
            passive: false,
            durable,
            exclusive,
            auto_delete: false,
            nowait: false,
            arguments: FieldTable::new(),
        })
    }

    /// queue.delete of `q`.
    fn delete_op(if_unused: bool) -> Op {
        Op::QueueDelete {
            queue: "q".into(),
            if_unused,
            if_empty: false,
            nowait: false,
        }
    }

    /// Opens channel 2 of the connection of `CH`.
    fn open_ch2(b: &mut Broker) -> ChannelRef {
        let ch2 = ChannelRef::new(ConnId(1), 2);
        ops(b, ch2, vec![Op::ChannelOpen]);
        ch2
    }

    /// A publish to queue `q` through the default exchange.
    fn publish_op(body: &'static [u8]) -> Op {
        publish_to("q", false, body)
    }

    /// A publish to queue `queue` through the default exchange.
    fn publish_to(queue: &str, mandatory: bool, body: &'static [u8]) -> Op {
        Op::Publish(Box::new(Publish {
            exchange: "".into(),
            routing_key: queue.into(),
            mandatory,
            immediate: false,
            properties: Properties::default(),
            body: bytes::Bytes::from_static(body),
            routed: None,
        }))
    }

    /// basic.qos with a per-consumer prefetch: an op with a reply and no other effect.
    fn qos_op(prefetch_count: u16) -> Op {
        Op::Qos {
            prefetch_size: 0,
            prefetch_count,
            global: false,
        }
    }

    /// Whether `effects` is exactly one channel error with `code`.
    fn channel_error(effects: &[Effect], code: u16) -> bool {
        matches!(effects, [Effect::ChannelError { error, .. }] if error.code.code() == code)
    }

    fn deliver_all(b: &mut Broker) -> Vec<Effect> {
        while b.deliver_mail(1, 0) {}
        let mut out = Vec::new();
        b.poll_effects(&mut out);
        out
    }

    fn reply(reply: Reply) -> Effect {
        Effect::Reply { ch: CH, reply }
    }

    /// With mail that takes time, a channel's later ops wait for its request's answer, so
    /// replies keep request order.
    #[test]
    fn ops_after_a_request_wait_for_its_answer() {
        let mut b = scheduled();
        let get = Op::Get {
            queue: "q".into(),
            no_ack: true,
        };
        let qos = qos_op(5);
        assert_eq!(
            ops(&mut b, CH, vec![get, qos]),
            vec![],
            "qos-ok waits for get-ok"
        );
        let effects = deliver_all(&mut b);
        assert!(
            matches!(effects.as_slice(), [Effect::Reply { reply: Reply::GetOk { .. }, .. }, qos_ok] if *qos_ok == reply(Reply::QosOk)),
            "get-ok, then qos-ok: {effects:?}"
        );
        assert_eq!(b.held_channels(), 0);
        assert_eq!(b.check_invariants(), Ok(()));
    }

    /// queue.delete goes to the queue and back, and what the channel sends meanwhile waits;
    /// `if-unused` is the queue's to check.
    #[test]
    fn queue_delete_is_answered_by_the_queue() {
        let mut b = scheduled();
        let delete = delete_op;
        consume(&mut b);
        deliver_all(&mut b);
        let qos = qos_op(5);
        assert_eq!(ops(&mut b, CH, vec![delete(true), qos]), vec![]);
        let effects = deliver_all(&mut b);
        assert!(
            channel_error(&effects, 406),
            "the queue refuses: it has a consumer; the qos after it is dropped: {effects:?}"
        );
        let ch2 = open_ch2(&mut b);
        assert_eq!(
            ops(
                &mut b,
                ch2,
                vec![
                    delete(false),
                    Op::Qos {
                        prefetch_size: 0,
                        prefetch_count: 1,
                        global: false
                    }
                ]
            ),
            vec![]
        );
        let effects = deliver_all(&mut b);
        let delete_ok = Effect::Reply {
            ch: ch2,
            // The message went back when the failed channel's delivery was requeued.
            reply: Reply::QueueDeleteOk { message_count: 1 },
        };
        let qos_ok = Effect::Reply {
            ch: ch2,
            reply: Reply::QosOk,
        };
        assert_eq!(effects, vec![delete_ok, qos_ok], "delete-ok, then qos-ok");
        assert_eq!(b.queue_len("q"), None);
        assert_eq!(b.check_invariants(), Ok(()));
    }

    /// A declare of an existing queue is the queue's to answer (its counts, equivalence),
    /// after what the channel sent it before, and ahead of what the channel sends next.
    #[test]
    fn a_redeclare_is_answered_by_the_queue() {
        let mut b = scheduled();
        let publish = publish_op(b"again");
        let qos = qos_op(5);
        assert_eq!(
            ops(&mut b, CH, vec![publish, declare_op(false), qos]),
            vec![]
        );
        let declare_ok = reply(Reply::QueueDeclareOk {
            queue: "q".into(),
            message_count: 2,
            consumer_count: 0,
        });
        assert_eq!(
            deliver_all(&mut b),
            vec![declare_ok, reply(Reply::QosOk)],
            "the count includes the publish sent before; qos-ok waits"
        );
        ops(&mut b, CH, vec![declare_op(true)]);
        let effects = deliver_all(&mut b);
        assert!(
            channel_error(&effects, 406),
            "the queue finds the redeclare inequivalent: {effects:?}"
        );
        assert_eq!(b.check_invariants(), Ok(()));
    }

    /// A declare that reaches a queue deleted while it travelled creates the queue anew
    /// (topology hears of the deletion first), instead of answering 404 to a declare that
    /// would have created it a moment later.
    #[test]
    fn a_declare_racing_a_delete_creates_the_queue_anew() {
        let mut b = scheduled();
        let ch2 = open_ch2(&mut b);
        deliver_all(&mut b);
        ops(&mut b, ch2, vec![delete_op(false)]);
        ops(&mut b, CH, vec![declare_op(false)]);
        // The delete reaches the queue first; the declare reaches topology before the
        // queue's `QueueGone` does, so topology still sends it to the queue.
        let effects = deliver_all(&mut b);
        let delete_ok = Effect::Reply {
            ch: ch2,
            reply: Reply::QueueDeleteOk { message_count: 1 },
        };
        let declare_ok = reply(Reply::QueueDeclareOk {
            queue: "q".into(),
            message_count: 0,
            consumer_count: 0,
        });
        assert_eq!(effects, vec![delete_ok, declare_ok]);
        assert_eq!(b.queue_len("q"), Some(0), "a new, empty queue");
        assert_eq!(b.check_invariants(), Ok(()));
    }

    /// A new queue is routable only once its owner created it: a publish that races the
    /// declare is unroutable (returned), never routed to a queue that does not exist yet;
    /// one after declare-ok reaches it.
    #[test]
    fn a_new_queue_is_routable_once_it_exists() {
        let mut b = scheduled();
        let declare = declare_queue("n", false, false);
        let ch2 = open_ch2(&mut b);
        deliver_all(&mut b);
        ops(&mut b, CH, vec![declare]);
        // Topology names it and sends `CreateQueue`; the owner has not created it yet.
        assert!(b.deliver_mail(1, 0));
        assert!(matches!(b.mail.front(), Some(Mail::CreateQueue { .. })));
        let publish = |body| publish_to("n", true, body);
        let effects = ops(&mut b, ch2, vec![publish(b"early")]);
        assert!(
            matches!(effects.as_slice(), [Effect::Return { .. }]),
            "not routable before it exists: {effects:?}"
        );
        let effects = deliver_all(&mut b);
        assert_eq!(
            effects,
            vec![reply(Reply::QueueDeclareOk {
                queue: "n".into(),
                message_count: 0,
                consumer_count: 0,
            })]
        );
        ops(&mut b, ch2, vec![publish(b"later")]);
        deliver_all(&mut b);
        assert_eq!(b.queue_len("n"), Some(1));
        assert_eq!(b.check_invariants(), Ok(()));
    }

    /// An exclusive queue whose connection closed while its creation travelled is not
    /// created (it would outlive its owner), and its name is free again.
    #[test]
    fn an_exclusive_queue_of_a_closed_connection_is_not_created() {
        let mut b = scheduled();
        let declare = declare_queue("x", false, true);
        ops(&mut b, CH, vec![declare]);
        assert!(b.deliver_mail(1, 0));
        assert!(matches!(b.mail.front(), Some(Mail::CreateQueue { .. })));
        ops(
            &mut b,
            ChannelRef::new(ConnId(1), 0),
            vec![Op::ConnectionClose],
        );
        deliver_all(&mut b);
        assert_eq!(b.queue_len("x"), None);
        assert_eq!(b.topo.queue_count(), 1, "only q is left in the directory");
        assert_eq!(b.check_invariants(), Ok(()));
    }

    /// tx.commit-ok comes once every queue the transaction touched has what it sent.
    #[test]
    fn commit_ok_waits_for_the_queues() {
        let mut b = scheduled();
        let publish = publish_op(b"in tx");
        let effects = ops(&mut b, CH, vec![Op::TxSelect, publish, Op::TxCommit]);
        assert_eq!(effects, vec![reply(Reply::TxSelectOk)], "commit-ok waits");
        let mut committed = false;
        while b.deliver_mail(1, 0) {
            let mut effects = Vec::new();
            b.poll_effects(&mut effects);
            if effects.contains(&reply(Reply::TxCommitOk)) {
                assert_eq!(b.queue_len("q"), Some(2), "the queue has the message");
                committed = true;
            }
        }
        assert!(committed, "commit-ok came");
        assert_eq!(b.check_invariants(), Ok(()));
    }

    /// What a channel may pipeline behind an unanswered request is bounded: past
    /// `MAX_HELD_OPS` the connection is closed with 506, and nothing stays held.
    #[test]
    fn a_channel_holds_a_bounded_number_of_ops() {
        let mut b = scheduled();
        let get = Op::Get {
            queue: "q".into(),
            no_ack: false,
        };
        assert_eq!(ops(&mut b, CH, vec![get]), vec![]);
        let qos = qos_op(1);
        for _ in 0..super::super::hold::MAX_HELD_OPS {
            b.handle(1, CH, qos.clone());
        }
        let mut effects = Vec::new();
        b.poll_effects(&mut effects);
        assert_eq!(effects, vec![], "up to the bound, ops wait");
        let effects = ops(&mut b, CH, vec![qos]);
        assert!(
            matches!(effects.as_slice(), [Effect::ConnectionError { error, .. }] if error.code.code() == 506),
            "one more closes the connection: {effects:?}"
        );
        assert_eq!(b.held_channels(), 0);
        assert_eq!(
            deliver_all(&mut b),
            vec![],
            "the get's answer finds no channel"
        );
        assert_eq!(
            b.queue_len("q"),
            Some(1),
            "the message is back in its queue"
        );
        assert_eq!(b.check_invariants(), Ok(()));
    }

    /// A delivery that travelled while its channel closed and the client opened the same
    /// channel number again goes back to its queue, and takes nothing of the new opening.
    #[test]
    fn a_delivery_for_a_reopened_channel_returns_to_its_queue() {
        let mut b = scheduled();
        consume(&mut b);
        // Consume, then consume-ok and the delivery, in that order.
        assert!(b.deliver_mail(1, 0));
        assert!(b.deliver_mail(1, 0));
        assert!(matches!(b.mail.front(), Some(Mail::Deliver { .. })));
        let effects = ops(&mut b, CH, vec![Op::ChannelClose, Op::ChannelOpen]);
        assert_eq!(
            effects,
            vec![reply(Reply::ChannelCloseOk), reply(Reply::ChannelOpenOk)]
        );
        assert_eq!(deliver_all(&mut b), vec![], "the new opening gets nothing");
        assert_eq!(
            b.queue_len("q"),
            Some(1),
            "the message is back in its queue"
        );
        assert_eq!(b.channels[&CH].consumer_unacked.get(), 0);
        assert_eq!(b.conns[&ConnId(1)].in_flight.get(), 0);
        assert_eq!(b.check_invariants(), Ok(()));
    }

    /// A queue's answer to a publish of a closed opening of the channel does not confirm the
    /// publish with the same number on the new opening.
    #[test]
    fn an_answer_for_a_closed_opening_confirms_nothing() {
        let mut b = scheduled();
        let select = Op::ConfirmSelect { nowait: true };
        let publish = || publish_op(b"again");
        ops(&mut b, CH, vec![select.clone(), publish()]);
        // The queue takes the old publish; its answer travels.
        assert!(b.deliver_mail(1, 0));
        assert!(matches!(b.mail.front(), Some(Mail::Answered { .. })));
        ops(
            &mut b,
            CH,
            vec![Op::ChannelClose, Op::ChannelOpen, select, publish()],
        );
        // Deliver the old answer only (mail to the connection, ahead of the new enqueue).
        assert!(b.deliver_mail(1, 0));
        let mut effects = Vec::new();
        b.poll_effects(&mut effects);
        assert!(
            !effects.iter().any(|e| matches!(e, Effect::Confirm { .. })),
            "publish 1 of the new opening is not confirmed before its queue answered: {effects:?}"
        );
        let effects = deliver_all(&mut b);
        assert_eq!(
            effects
                .iter()
                .filter(|e| matches!(e, Effect::Confirm { .. }))
                .count(),
            1,
            "the new publish is confirmed once its queue answered: {effects:?}"
        );
        assert_eq!(b.check_invariants(), Ok(()));
    }
}
