//! Queues on other cluster nodes (docs/cluster.md, "Queues live on one node"): a classic
//! queue lives on the node that declared it (its home); every other node knows its
//! definition (replicated metadata) and keeps a stub of it that holds no messages. What
//! this node routes to a stub goes to the home node as [`NodeMail`], which the host carries
//! over the cluster transport, as it carries `ShardMail` between shards; the home node
//! enqueues it as any publish (`Mail::Enqueue`, its publisher a node's address) and the
//! queue's `Mail::Answered` (after the home's sync, for a persistent message on a durable
//! queue) goes back as [`NodeMail::Answered`], which becomes the publishing channel's own
//! `Mail::Answered` here. The core stays sans-IO: the host takes [`Broker::take_node_mail`]
//! and hands in [`Broker::receive_node_mail`].

use super::Broker;
use super::mail::{Mail, Publisher};
use crate::ids::{ChannelAddr, ChannelRef, ConnId, QueueId, VhostId};
use crate::message::Message;
use std::collections::HashMap;
use std::sync::Arc;

pub(crate) use crate::mail::mailbox::{NODE_CONN_BASE, NODES, is_node_conn};

/// Mail between cluster nodes, carried by the host.
#[derive(Clone, Debug)]
pub enum NodeMail {
    /// A message this node routed to `queue` of `vhost`, which lives on the node it goes
    /// to. `token`: answer it (the publisher wants a confirm).
    Enqueue {
        /// The queue's vhost.
        vhost: Arc<str>,
        /// The queue.
        queue: Arc<str>,
        /// The message, as routed.
        message: Arc<Message>,
        /// The sender's token for the answer, if the publisher wants a confirm.
        token: Option<u64>,
    },
    /// The home node's answer to a forwarded message with `token`: `taken` false is a nack
    /// (the queue refused it, its store failed, or it is not there).
    Answered {
        /// The forwarded message's token.
        token: u64,
        /// Taken (a confirm) or not (a nack).
        taken: bool,
    },
    /// Consuming node -> home: basic.consume from channel `from` of the sender on the
    /// home's queue (`Mail::Consume`). Answered by `ConsumeOk` or `Refused`.
    Consume {
        /// The queue's vhost.
        vhost: Arc<str>,
        /// The queue.
        queue: Arc<str>,
        /// The consuming channel, as its node names it.
        from: NodeChannel,
        /// The consumer's settings.
        consumer: NodeConsumer,
        /// No consume-ok for the client (the answer comes all the same).
        nowait: bool,
    },
    /// Home -> consuming node: the queue took the consumer, numbered `consumer`.
    ConsumeOk {
        /// The consuming channel.
        to: NodeChannel,
        /// The queue's vhost.
        vhost: Arc<str>,
        /// The queue.
        queue: Arc<str>,
        /// The consumer's id on the home node.
        consumer: u64,
        /// Its tag.
        tag: Arc<str>,
        /// No consume-ok for the client.
        nowait: bool,
    },
    /// Home -> requesting node: a request of channel `to` was refused (a channel or
    /// connection error of `code`, as the home's queue would answer it locally).
    Refused {
        /// The requesting channel.
        to: NodeChannel,
        /// The AMQP reply code.
        code: u16,
        /// The reply text.
        text: String,
    },
    /// Home -> consuming node: a delivery to consumer `consumer` (`Mail::Deliver`), with
    /// the credit it took from the channel's window on the home (`window`), which the
    /// consuming node gives back with `Credit` once its connection wrote it.
    Deliver {
        /// The consuming channel.
        to: NodeChannel,
        /// The queue's vhost.
        vhost: Arc<str>,
        /// The queue.
        queue: Arc<str>,
        /// The consumer's id on the home node.
        consumer: u64,
        /// Its tag.
        tag: Arc<str>,
        /// No ack expected.
        no_ack: bool,
        /// The home's number for this delivery (what a settle names; not the queue's
        /// sequence number, which a reloaded queue issues again); 0 with `no_ack`.
        seq: u64,
        /// Delivered before.
        redelivered: bool,
        /// The message.
        message: Arc<Message>,
        /// The home's record of the channel's window.
        window: u32,
    },
    /// Consuming node -> home: `count` deliveries of window `window` were written (or
    /// went back): the home may send as many more.
    Credit {
        /// The window (`Deliver::window`).
        window: u32,
        /// How many.
        count: u32,
    },
    /// Consuming node -> home: deliveries of the queue settled (`Mail::Settle`), by their
    /// `seq`, in delivery order.
    Settle {
        /// The queue's vhost.
        vhost: Arc<str>,
        /// The queue.
        queue: Arc<str>,
        /// The deliveries' numbers (`Deliver::seq`).
        seqs: Vec<u64>,
        /// Acked, requeued or discarded.
        how: NodeSettle,
    },
    /// Consuming node -> home: consumer `consumer` goes (`Mail::Cancel`); with `reply`, a
    /// basic.cancel of channel `reply.0` that waits for `Cancelled`.
    Cancel {
        /// The queue's vhost.
        vhost: Arc<str>,
        /// The queue.
        queue: Arc<str>,
        /// The consumer's id on the home node.
        consumer: u64,
        /// The cancelling channel, the tag and `nowait`.
        reply: Option<(NodeChannel, Arc<str>, bool)>,
    },
    /// Home -> consuming node: the consumer is gone (after every delivery sent to it).
    Cancelled {
        /// The cancelling channel.
        to: NodeChannel,
        /// The consumer's tag.
        tag: Arc<str>,
        /// No cancel-ok for the client.
        nowait: bool,
    },
    /// Home -> consuming node: the queue went from under consumer `consumer` (deleted, or
    /// the home dropped the consuming node): basic.cancel for a client that takes one.
    ConsumerGone {
        /// The consuming channel.
        to: NodeChannel,
        /// The consumer's id on the home node.
        consumer: u64,
        /// Its tag.
        tag: Arc<str>,
    },
    /// Requesting node -> home: basic.get, queue.purge or a passive queue.declare of
    /// channel `from` on the home's queue.
    Request {
        /// The queue's vhost.
        vhost: Arc<str>,
        /// The queue.
        queue: Arc<str>,
        /// The requesting channel.
        from: NodeChannel,
        /// What it asks.
        request: NodeRequest,
    },
    /// Home -> requesting node: what basic.get found (`None`: empty).
    Got {
        /// The requesting channel.
        to: NodeChannel,
        /// The queue's vhost.
        vhost: Arc<str>,
        /// The queue.
        queue: Arc<str>,
        /// No ack expected.
        no_ack: bool,
        /// The message, and how many stay ready.
        got: Option<NodeGot>,
    },
    /// Home -> requesting node: purge-ok with the purged count.
    Purged {
        /// The requesting channel.
        to: NodeChannel,
        /// Messages purged.
        count: u32,
        /// No purge-ok for the client.
        nowait: bool,
    },
    /// Home -> requesting node: declare-ok with the home queue's counts.
    Declared {
        /// The requesting channel.
        to: NodeChannel,
        /// The queue.
        queue: Arc<str>,
        /// Ready messages.
        messages: u32,
        /// Consumers (on every node).
        consumers: u32,
        /// No declare-ok for the client.
        nowait: bool,
    },
}

/// A channel of another node, as that node addresses it (`ChannelAddr`: connection,
/// channel number, opening).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct NodeChannel {
    /// The connection, numbered by that node's host.
    pub conn: u64,
    /// The channel number.
    pub channel: u16,
    /// Which opening of the channel number.
    pub serial: u32,
}

impl NodeChannel {
    pub(crate) fn of(a: ChannelAddr) -> NodeChannel {
        NodeChannel {
            conn: a.ch.conn.0,
            channel: a.ch.channel,
            serial: a.serial,
        }
    }

    pub(crate) fn addr(self) -> ChannelAddr {
        ChannelAddr {
            ch: ChannelRef {
                conn: ConnId(self.conn),
                channel: self.channel,
            },
            serial: self.serial,
        }
    }
}

/// A consumer's settings as the consuming node's channel gives them with basic.consume.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeConsumer {
    /// Its tag.
    pub tag: Arc<str>,
    /// No acks.
    pub no_ack: bool,
    /// basic.consume's `exclusive`.
    pub exclusive: bool,
    /// Its prefetch (basic.qos global=false), 0 for none.
    pub prefetch: u16,
    /// Its channel's prefetch (basic.qos global=true) when it consumed, 0 for none.
    pub global_prefetch: u16,
    /// `x-priority`.
    pub priority: i32,
}

/// How deliveries are settled (`Settle`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeSettle {
    /// Acked.
    Ack,
    /// Back to the queue.
    Requeue,
    /// Rejected without requeue (dropped or dead-lettered).
    Discard,
}

/// A request a node sends the home of a queue (`NodeMail::Request`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeRequest {
    /// basic.get.
    Get {
        /// No ack expected.
        no_ack: bool,
    },
    /// queue.purge.
    Purge {
        /// No purge-ok for the client.
        nowait: bool,
    },
    /// A queue.declare of the existing queue (checked on the requesting node): its counts.
    Declare {
        /// No declare-ok for the client.
        nowait: bool,
    },
}

/// What basic.get found on the home (`NodeMail::Got`).
#[derive(Clone, Debug)]
pub struct NodeGot {
    /// The home's number for this delivery (what a settle names, as `NodeMail::Deliver`'s).
    pub seq: u64,
    /// Delivered before.
    pub redelivered: bool,
    /// The message.
    pub message: Arc<Message>,
    /// Messages left ready.
    pub remaining: u32,
}

/// What a shard knows of other nodes: where queues live, and the forwarded publishes
/// waiting for an answer.
#[derive(Default)]
pub(crate) struct Nodes {
    /// Queues of another node, by vhost and name (set before their declare is applied, so
    /// no message lands in the stub meanwhile).
    homes: HashMap<(Arc<str>, Arc<str>), u32>,
    /// Forwarded publishes with a confirm to give: token -> (node, channel, seq, queue).
    pending: HashMap<u64, (u32, ChannelAddr, u64, QueueId)>,
    /// The next token's counter (a token is `counter * shards + shard`, so the host finds
    /// the shard an answer is for).
    next: u64,
    pub(super) outbox: Vec<(u32, NodeMail)>,
    /// Consumers and requests of other nodes' channels on this node's queues
    /// (`nodes_consume.rs`).
    pub(super) remote: super::nodes_consume::Remote,
    /// This node's channels' consumers and requests on other nodes' queues.
    pub(super) attached: super::nodes_consume::Attached,
    /// The nodes the host last said it cannot reach (`node_unreachable`), until it says it
    /// reaches them again (`node_reachable`): a quorum queue's consume for one of them
    /// waits here for a leader rather than being sent into the void. One entry per node.
    pub(super) unreachable: std::collections::BTreeSet<u32>,
}

impl Nodes {
    /// Whether mail may have to cross to another node: queues live elsewhere, or this
    /// node's channels consume there.
    pub(super) fn crosses(&self) -> bool {
        NODES && (!self.homes.is_empty() || self.attached.has_consumers())
    }
}

impl Broker {
    /// `AdminRequest::QueueHome`: queue `queue` of `vhost` lives on `node` (`None`: here).
    pub(super) fn set_queue_home(&mut self, vhost: &str, queue: &str, node: Option<u32>) {
        let key: (Arc<str>, Arc<str>) = (vhost.into(), queue.into());
        let old = match node {
            Some(n) => self.nodes.homes.insert(key, n),
            None => self.nodes.homes.remove(&key),
        };
        let routes = self.topo.routes();
        let id = routes.vhost(vhost).and_then(|v| routes.queue(v, queue));
        if let Some(id) = id {
            if let Some(from) = old.filter(|o| Some(*o) != node) {
                self.forwards_moved(id, from);
            }
            self.queue_moved(id, old, node);
        }
    }

    /// Queue `id` no longer lives on node `from` (a quorum queue's leader moved): the
    /// publishes forwarded there that wait for an answer are nacked now, as a node that
    /// became unreachable has them nacked, rather than after the forward timeout (a
    /// partition cost a publisher on the majority side 5.1 s); the old leader commits none
    /// of them in a session that still counts. A nack means "maybe": at least once.
    fn forwards_moved(&mut self, id: QueueId, from: u32) {
        let mut tokens: Vec<u64> = self
            .nodes
            .pending
            .iter()
            .filter(|(_, (n, _, _, q))| *n == from && *q == id)
            .map(|(t, _)| *t)
            .collect();
        tokens.sort_unstable();
        for t in tokens {
            self.node_answered(t, false);
        }
    }

    /// The node queue `id` lives on, if not this one.
    pub(super) fn queue_home(&self, id: QueueId) -> Option<u32> {
        if !NODES || self.nodes.homes.is_empty() {
            return None;
        }
        let q = self.qs.queues.get(&id)?;
        let vhost: Arc<str> = self.vhost_name(q.vhost).into();
        self.nodes.homes.get(&(vhost, q.name.clone())).copied()
    }

    /// Sends a message routed to queue `id` to its home node, if it lives on another one;
    /// false if it lives here. A message forwarded here is never forwarded again.
    pub(super) fn forward_to_home(
        &mut self,
        id: QueueId,
        message: &Arc<Message>,
        publisher: Option<Publisher>,
    ) -> bool {
        if publisher.is_some_and(|p| is_node_conn(p.to.ch.conn)) {
            return false;
        }
        let Some(node) = self.queue_home(id) else {
            return false;
        };
        let Some(q) = self.qs.queues.get(&id) else {
            return false;
        };
        let (vhost, queue) = (Arc::<str>::from(self.vhost_name(q.vhost)), q.name.clone());
        let token = match publisher {
            Some(Publisher {
                to, seq: Some(seq), ..
            }) => {
                let token = self.nodes.next * u64::from(self.shards) + u64::from(self.shard);
                self.nodes.next += 1;
                self.nodes.pending.insert(token, (node, to, seq, id));
                Some(token)
            }
            _ => None,
        };
        self.nodes.outbox.push((
            node,
            NodeMail::Enqueue {
                vhost,
                queue,
                message: message.clone(),
                token,
            },
        ));
        true
    }

    /// A queue's answer to a publish forwarded from another node: back to that node.
    pub(super) fn answer_node(&mut self, to: ChannelAddr, seq: u64, taken: bool) {
        let node = (to.ch.conn.0 - NODE_CONN_BASE) as u32;
        self.nodes
            .outbox
            .push((node, NodeMail::Answered { token: seq, taken }));
    }

    /// Mail for other nodes sent since the last call, in the order sent (the host keeps that
    /// order per node).
    pub fn take_node_mail(&mut self, out: &mut Vec<(u32, NodeMail)>) {
        out.append(&mut self.nodes.outbox);
    }

    /// The publishes (channel, seq) whose answer another node owes.
    #[cfg(any(test, feature = "testing"))]
    pub(super) fn node_pending(&self) -> impl Iterator<Item = (ChannelAddr, u64)> + '_ {
        self.nodes
            .pending
            .values()
            .map(|(_, to, seq, _)| (*to, *seq))
    }

    /// Whether forwarded publishes wait for an answer from other nodes.
    pub fn node_answers_pending(&self) -> usize {
        self.nodes.pending.len()
    }

    /// Mail node `from` sent here, in the order sent, at time `now`. An answer goes to the
    /// shard its token names (`token % shards`); a forwarded message to any shard (its
    /// queue is found by name on the routing table every shard has).
    pub fn receive_node_mail(
        &mut self,
        now: u64,
        from: u32,
        mails: impl IntoIterator<Item = NodeMail>,
    ) {
        self.now = self.now.max(now);
        // Deliveries handed on at once give their window's credit back with this batch.
        let mut credit_now: Vec<(u32, u32)> = Vec::new();
        for mail in mails {
            match mail {
                NodeMail::Enqueue {
                    vhost,
                    queue,
                    message,
                    token,
                } => {
                    let to = ChannelAddr {
                        ch: ChannelRef {
                            conn: ConnId(NODE_CONN_BASE + u64::from(from)),
                            channel: 0,
                        },
                        serial: 0,
                    };
                    let routes = self.topo.routes();
                    let id: Option<QueueId> = routes
                        .vhost(&vhost)
                        .and_then(|v: VhostId| routes.queue(v, &queue));
                    match id {
                        Some(queue) => self.mail.push_back(Mail::Enqueue {
                            queue,
                            message,
                            publisher: Some(Publisher {
                                to,
                                seq: token,
                                // Not paced by flow control: the forwarding node's
                                // transport is bounded and back-pressured instead.
                                consumes: true,
                            }),
                        }),
                        None => {
                            // Deleted here after the other node routed to it (or an MQTT
                            // session's queue that went with its connection): the deletion
                            // took it, as for a queue deleted on this node after routing
                            // (`routed_to_deleted`), so it is confirmed.
                            self.routed_to_deleted += 1;
                            if let Some(token) = token {
                                self.answer_node(to, token, true);
                            }
                        }
                    }
                }
                NodeMail::Answered { token, taken } => self.node_answered(token, taken),
                other => self.receive_consumer_mail(from, other, &mut credit_now),
            }
        }
        for (window, count) in credit_now {
            self.nodes
                .outbox
                .push((from, NodeMail::Credit { window, count }));
        }
        self.after_op();
    }

    fn node_answered(&mut self, token: u64, taken: bool) {
        if let Some((_, to, seq, _)) = self.nodes.pending.remove(&token) {
            // The home node synced it before answering: nothing left to wait for here.
            self.mail.push_back(Mail::Answered {
                to,
                seq,
                taken,
                durable: false,
            });
        }
    }

    /// The host could not hand mail to `node` (it is down or cut off): the publishes
    /// forwarded to it that wait for an answer are nacked (a classic queue on a node that
    /// is down is unavailable, as in RabbitMQ; a message that did reach it before may
    /// still be there: at least once, as a nack always means).
    pub fn node_unreachable(&mut self, now: u64, node: u32) {
        self.now = self.now.max(now);
        self.nodes.unreachable.insert(node);
        let mut tokens: Vec<u64> = self
            .nodes
            .pending
            .iter()
            .filter(|(_, (n, _, _, _))| *n == node)
            .map(|(t, _)| *t)
            .collect();
        tokens.sort_unstable();
        for t in tokens {
            self.node_answered(t, false);
        }
        self.drop_node_consumers(node);
        self.after_op();
    }
}
