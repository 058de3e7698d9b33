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

use crate::command::{Bind, ExchangeDeclare, OpKind, QueueDeclare};
use crate::effect::Reply;
use crate::error::ProtocolError;
use crate::ids::{ChannelAddr, ChannelRef, ConnId, QueueId, VhostId};
use crate::message::Message;
use crate::message::QueuedMessage;
use delivery::{ConsumerId, Picked, QueueConsumer, Settle, Unacked};

pub(crate) mod credit;
pub(crate) mod delivery;
pub(crate) mod mailbox;
pub(crate) use mailbox::Mailbox;
pub use mailbox::ShardMail;
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
        /// Its `x-stream-offset` argument (read by stream queues only).
        stream_offset: Option<Box<crate::message::FieldValue>>,
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
    /// Its type (`x-queue-type`), which decides the state the owner creates.
    pub(crate) kind: crate::queue_type::QueueType,
    /// Its arguments with the policy applied, parsed.
    pub(crate) args: crate::queue_args::QueueArgs,
    /// A stream's settings (its arguments with the policy applied).
    pub(crate) stream: Option<crate::store::StreamSettings>,
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
pub(crate) enum Dest {
    Queue(QueueId),
    Conn(ConnId),
    Topology,
    Host,
}

impl Mail {
    /// Where it goes.
    pub(crate) fn dest(&self) -> Dest {
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
