//! Consumers on any node (docs/cluster.md, "Consumers on any node"): a channel of this node
//! consumes from, gets from, purges or declares a queue whose home is another node. The
//! channel side is unchanged: it sends its `Mail::Consume`, `Settle`, `Cancel`, `Get`,
//! `Purge` and `Redeclare` to the queue as always; a queue that lives on another node (a
//! stub here) is reached over the network, as a queue on another shard is reached over the
//! host's links, so that mail goes to the home as [`NodeMail`] ([`Broker::mail_to_home`]).
//! On the home the same mail is made again, from an address that stands for the consuming
//! node's channel (a *window*: the node's connection address, the window's number as the
//! opening), and the queue's answers to that address (`ConsumeOk`, `Deliver`, `Got`, ...)
//! go back as `NodeMail` ([`Broker::mail_to_node`]), which the consuming node turns into
//! the mail its channel always gets.
//!
//! Credit: a window holds the consuming channel's limits as `SharedCredit` holds a channel's
//! for a queue on another shard: the consumer's prefetch (the queue counts its unacked), the
//! channel's global prefetch when it consumed, and a write window of deliveries in flight,
//! which the consuming node gives back (`NodeMail::Credit`) once its connection wrote them.
//! So the home sends a slow consumer at most its window, and holds the rest in its queue.
//!
//! A node that becomes unreachable (or restarts) ends what crossed to it: the home cancels
//! its consumers and requeues what they held unacked; the consuming node cancels its
//! consumers on that node's queues (basic.cancel for clients that take it) and fails the
//! requests waiting there (404, as RabbitMQ answers for a queue whose home is down). A
//! client's basic.consume of a quorum queue is the exception: a majority of its group may
//! well be alive and elect another leader within an election timeout, so the consume waits
//! for the queue to move (`queue_moved`) or the node to be back (`node_reachable`), at most
//! [`LEADER_WAIT_MS`], and is sent where the queue is served then; only when no leader
//! comes does it fail, with RabbitMQ's 541 "timed out consuming from quorum queue".

use super::Broker;
use super::mail::{CancelReply, Mail};
use super::nodes::{
    NODE_CONN_BASE, NODES, NodeChannel, NodeConsumer, NodeGot, NodeMail, NodeRequest, NodeSettle,
    is_node_conn,
};
use crate::command::{OpKind, QueueDeclare};
use crate::error::{ErrorCode, ProtocolError};
use crate::ids::{ChannelAddr, ChannelRef, ConnId, QueueId, VhostId};
use crate::mail::credit::SharedCredit;
use crate::mail::delivery::{ConsumerId, FROM_NODE, Picked, QueueConsumer, Settle, Unacked};
use crate::mail::mailbox::RESTORE_CONN;
use crate::message::{Message, QueuedMessage};
use crate::queue::kind::QueueBehaviour;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

mod answers;
mod faults;

/// The home's record of a channel of another node that consumes or asks here.
struct Window {
    node: u32,
    remote: NodeChannel,
    credit: Arc<SharedCredit>,
    /// Its consumers here, with their queues.
    consumers: Vec<(ConsumerId, QueueId)>,
    /// Its requests sent to a queue and not answered yet.
    requests: u32,
    /// Deliveries it holds unacked.
    unacked: u32,
}

/// The home's side: other nodes' channels on this node's queues.
#[derive(Default)]
pub(crate) struct Remote {
    windows: HashMap<u32, Window>,
    by_channel: HashMap<(u32, NodeChannel), u32>,
    by_consumer: HashMap<ConsumerId, u32>,
    next: u32,
    /// Deliveries other nodes' channels hold unacked: (node, queue, delivery) -> (window,
    /// entry), so a settle names them by delivery number and a node that goes away gives
    /// them back.
    unacked: HashMap<(u32, QueueId, u64), (u32, Unacked)>,
    /// The number of the next delivery to another node (what it names in its settle). Not
    /// the queue's sequence number: a queue reloaded (a quorum queue's leader moved away and
    /// back) delivers the same sequence numbers again, and a settle of an earlier delivery
    /// must not settle the new one.
    next_delivery: u64,
}

impl Remote {
    fn delivery(&mut self) -> u64 {
        self.next_delivery += 1;
        self.next_delivery
    }
}

/// A consumer of this node's channel on another node's queue.
struct AttachedConsumer {
    node: u32,
    ch: ChannelRef,
    serial: u32,
    tag: Arc<str>,
    /// Its settings, to attach it again where the queue moves (a quorum queue's leader).
    settings: Option<NodeConsumer>,
    /// Its node became unreachable (or restarted) and dropped it: it attaches again when
    /// the node is reachable (`node_reachable`) or the queue moves.
    orphan: bool,
}

/// How long a request of this node's channel waits for another node's answer before it
/// fails: an answer lost on the way (the answering node's batch failed while this node's
/// reached it) would leave the channel waiting for ever.
const REQUEST_TIMEOUT_MS: u64 = 10_000;

/// How long a client's basic.consume of a quorum queue waits for a leader once the node it
/// went to (its last known leader) is unreachable: a few election timeouts (0.5-1 s each
/// with the default timings), so a survivor of a leader's loss attaches to the new leader.
/// RabbitMQ's consume waits for its group's command timeout likewise, then fails.
pub(crate) const LEADER_WAIT_MS: u64 = 5_000;

/// The most one consume waits in all, however often its leader changes or its node is
/// lost again meanwhile (RabbitMQ's quorum-queue command timeout, 30 s).
const CONSUME_WAIT_MAX_MS: u64 = 30_000;

/// A client's basic.consume of a quorum queue, kept so it can be sent again where the queue
/// is served once the node it went to is lost (`Request::retry`).
struct Retry {
    /// The stub here.
    queue: QueueId,
    /// The consumer's settings.
    settings: NodeConsumer,
    /// basic.consume's `nowait`.
    nowait: bool,
    /// When the client asked (the broker's clock): the wait is bounded from here.
    since: u64,
    /// Waiting for a leader (the node it went to is unreachable) until then; `None`: sent
    /// to `Request::node`, waiting for its answer.
    parked: Option<u64>,
}

/// A request of this node's channel waiting for another node's answer.
struct Request {
    node: u32,
    /// When it was sent (the broker's clock).
    sent_at: u64,
    op: OpKind,
    queue: Arc<str>,
    /// A basic.cancel: its tag and `nowait`.
    cancel: Option<(Arc<str>, bool)>,
    /// A declare (not passive) of a quorum queue: if the leader cannot answer, this node
    /// does, from its copy of the queue's record (RabbitMQ answers a quorum queue's declare
    /// with 0 messages and 0 consumers when its leader does not answer): `nowait`. A
    /// classic queue's declare, like any passive one, fails instead, with RabbitMQ's 404
    /// for a queue whose home node is down.
    declare: Option<bool>,
    /// A client's consume of a quorum queue: it waits for a leader when `node` is lost.
    retry: Option<Retry>,
}

impl Request {
    /// When it fails if no answer comes: a consume waiting for a leader at its bound, any
    /// other request [`REQUEST_TIMEOUT_MS`] after it was sent.
    fn deadline(&self) -> u64 {
        match self.retry.as_ref().and_then(|x| x.parked) {
            Some(until) => until,
            None => self.sent_at.saturating_add(REQUEST_TIMEOUT_MS),
        }
    }
}

/// The consuming side: this node's channels on other nodes' queues.
#[derive(Default)]
pub(crate) struct Attached {
    /// By the stub's id and the home's consumer id.
    consumers: HashMap<(QueueId, ConsumerId), AttachedConsumer>,
    requests: HashMap<(ChannelRef, u32), Request>,
    /// The settings of consumes in flight to another node, by channel opening and tag.
    settings: HashMap<(ChannelRef, u32, Arc<str>), NodeConsumer>,
    /// Credit to give back once the connection has written: conn -> (node, window, count).
    owed: HashMap<ConnId, Vec<(u32, u32, u32)>>,
    /// Consumers attached again (their queue moved) whose consume has not been answered
    /// yet, by channel opening and tag: until it is, the consumer is nowhere in
    /// `consumers`, so a refusal, the queue's deletion, the target node going away or the
    /// queue moving again must find it here, or the client would wait for ever on a
    /// consumer no queue serves (it gets basic.cancel instead, or is attached again).
    /// One entry per consumer of this node's channels at most.
    moving: HashMap<MovingKey, Moving>,
}

/// A consumer by its channel's opening and its tag.
type MovingKey = (ChannelRef, u32, Arc<str>);

/// A consumer attached again, its consume in flight (`Attached::moving`).
pub(super) struct Moving {
    queue: QueueId,
    /// Where the consume went (`None`: this node's own queue).
    node: Option<u32>,
    settings: NodeConsumer,
    /// The node it went to became unreachable before it answered: it is attached again
    /// when that node is back (`node_reachable`) or the queue moves.
    lost: bool,
}

impl Attached {
    pub(super) fn has_consumers(&self) -> bool {
        !self.consumers.is_empty() || !self.moving.is_empty()
    }

    /// Whether channel `to` waits for another node's answer.
    pub(super) fn awaits(&self, to: ChannelAddr) -> bool {
        self.requests.contains_key(&(to.ch, to.serial))
    }
}

impl NodeSettle {
    fn of(how: Settle) -> NodeSettle {
        match how {
            Settle::Ack => NodeSettle::Ack,
            Settle::Requeue => NodeSettle::Requeue,
            Settle::Discard => NodeSettle::Discard,
        }
    }

    fn settle(self) -> Settle {
        match self {
            NodeSettle::Ack => Settle::Ack,
            NodeSettle::Requeue => Settle::Requeue,
            NodeSettle::Discard => Settle::Discard,
        }
    }
}

/// A channel of a client of this node (not a node's window, not the internal connection).
fn client(a: ChannelAddr) -> bool {
    !is_node_conn(a.ch.conn) && a.ch.conn != RESTORE_CONN
}

fn node_addr(node: u32, window: u32) -> ChannelAddr {
    ChannelAddr {
        ch: ChannelRef {
            conn: ConnId(NODE_CONN_BASE + u64::from(node)),
            channel: 0,
        },
        serial: window,
    }
}

impl Broker {
    /// Whether any consumer or request crosses between this node and another.
    #[cfg(any(test, feature = "testing"))]
    pub(super) fn crosses_nodes(&self) -> bool {
        // A channel may keep deliveries of another node's queue after its consumer went.
        self.nodes.crosses()
            || !self.nodes.remote.windows.is_empty()
            || !self.nodes.attached.consumers.is_empty()
            || !self.nodes.attached.requests.is_empty()
    }

    /// Queue `id`'s vhost and name.
    fn queue_names(&self, id: QueueId) -> (Arc<str>, Arc<str>) {
        match self.qs.queues.get(&id) {
            Some(q) => (self.topo.vhost_name_arc(q.vhost), q.name.clone()),
            None => (Arc::from(""), Arc::from("")),
        }
    }

    /// The queue named `queue` in `vhost` here (the home's queue, or this node's stub).
    fn named_queue(&self, vhost: &str, queue: &str) -> Option<(VhostId, QueueId)> {
        let routes = self.topo.routes();
        let v = routes.vhost(vhost)?;
        Some((v, routes.queue(v, queue)?))
    }

    // ---- the consuming node ----

    /// Mail from this node's channel side to a queue that lives on another node goes there;
    /// anything else comes back, for this node.
    pub(super) fn mail_to_home(&mut self, mail: Mail) -> Option<Mail> {
        let queue = match &mail {
            Mail::Consume { queue, .. }
            | Mail::Settle { queue, .. }
            | Mail::Cancel { queue, .. }
            | Mail::Get { queue, .. }
            | Mail::Purge { queue, .. }
            | Mail::Redeclare { queue, .. } => *queue,
            _ => return Some(mail),
        };
        // A consumer that attached to another node stays with it (a quorum queue's leader
        // may have moved since): its cancel goes there.
        let attached = match &mail {
            Mail::Cancel { consumer, .. } => self
                .nodes
                .attached
                .consumers
                .remove(&(queue, *consumer))
                .map(|c| c.node),
            _ => None,
        };
        let Some(node) = attached.or_else(|| self.queue_home(queue)) else {
            return Some(mail);
        };
        let (vhost, name) = self.queue_names(queue);
        if let Some((to, error)) = self.unsupported_across_shards(&mail, node, &name) {
            match &mail {
                Mail::Consume { consumer, .. } if self.reattaching(to, &consumer.tag, queue) => {
                    self.reattach_failed(to, consumer.tag.clone(), queue);
                }
                _ => self.mail.push_back(Mail::Refused { to, error }),
            }
            return None;
        }
        let request = |b: &mut Broker, to: ChannelAddr, op: OpKind, r: NodeRequest| {
            b.nodes.attached.requests.insert(
                (to.ch, to.serial),
                Request {
                    node,
                    sent_at: b.now,
                    op,
                    queue: name.clone(),
                    cancel: None,
                    declare: None,
                    retry: None,
                },
            );
            b.nodes.outbox.push((
                node,
                NodeMail::Request {
                    vhost: vhost.clone(),
                    queue: name.clone(),
                    from: NodeChannel::of(to),
                    request: r,
                },
            ));
            None
        };
        match mail {
            Mail::Consume {
                consumer, nowait, ..
            } if client(consumer.addr()) => {
                let from = consumer.addr();
                let global_prefetch = self
                    .chans
                    .channels
                    .get(&from.ch)
                    .map_or(0, |c| c.global_prefetch);
                let settings = NodeConsumer {
                    tag: consumer.tag.clone(),
                    no_ack: consumer.no_ack,
                    exclusive: consumer.exclusive,
                    prefetch: consumer.prefetch,
                    global_prefetch,
                    priority: consumer.priority,
                };
                // A consumer attached again (its queue moved) is no request of the
                // channel's: the client asked nothing.
                if !self.reattaching(from, &consumer.tag, queue) {
                    let retry = self.is_quorum(queue).then(|| Retry {
                        queue,
                        settings: settings.clone(),
                        nowait,
                        since: self.now,
                        parked: None,
                    });
                    self.nodes.attached.requests.insert(
                        (from.ch, from.serial),
                        Request {
                            node,
                            sent_at: self.now,
                            op: OpKind::Consume,
                            queue: name.clone(),
                            cancel: None,
                            declare: None,
                            retry,
                        },
                    );
                    if self.nodes.unreachable.contains(&node) && self.is_quorum(queue) {
                        // Its leader is known lost: it waits here for the next one.
                        self.park((from.ch, from.serial));
                        return None;
                    }
                }
                self.send_consume(node, from, (vhost, name), settings, nowait);
                None
            }
            Mail::Settle {
                mut entries, how, ..
            } => {
                let held: u64 = entries.iter().map(|u| u.message.body_len() as u64).sum();
                self.release(held);
                // Only deliveries of the node the queue lives on now: one made by another
                // node (before the queue moved: a quorum queue's leader changed), or by this
                // node's own queue before it moved away, is stale. Its message went back to
                // the queue, which delivers it again (`QueueState::reload`).
                entries.retain(|u| u.epoch == FROM_NODE | node);
                if entries.is_empty() {
                    return None;
                }
                self.nodes.outbox.push((
                    node,
                    NodeMail::Settle {
                        vhost,
                        queue: name,
                        seqs: entries.iter().map(|u| u.seq).collect(),
                        how: NodeSettle::of(how),
                    },
                ));
                None
            }
            Mail::Cancel {
                consumer, reply, ..
            } => {
                let reply = reply.map(|r| {
                    self.nodes.attached.requests.insert(
                        (r.to.ch, r.to.serial),
                        Request {
                            node,
                            sent_at: self.now,
                            op: OpKind::Cancel,
                            queue: name.clone(),
                            cancel: Some((r.consumer_tag.clone(), r.nowait)),
                            declare: None,
                            retry: None,
                        },
                    );
                    (NodeChannel::of(r.to), r.consumer_tag, r.nowait)
                });
                self.nodes.outbox.push((
                    node,
                    NodeMail::Cancel {
                        vhost,
                        queue: name,
                        consumer: consumer.0,
                        reply,
                    },
                ));
                None
            }
            Mail::Get { to, no_ack, .. } if client(to) => {
                request(self, to, OpKind::Get, NodeRequest::Get { no_ack })
            }
            Mail::Purge { to, nowait, .. } if client(to) => {
                request(self, to, OpKind::QueuePurge, NodeRequest::Purge { nowait })
            }
            Mail::Redeclare { to, declare, .. } if client(to) => {
                // The definition is the same on every node: the stub checks it, the home
                // counts.
                if !declare.passive
                    && let Err(error) = self.check_queue_equivalence(queue, &declare)
                {
                    self.mail.push_back(Mail::Refused { to, error });
                    return None;
                }
                let (nowait, passive) = (declare.nowait, declare.passive);
                request(
                    self,
                    to,
                    OpKind::QueueDeclare,
                    NodeRequest::Declare { nowait },
                );
                let quorum = self
                    .qs
                    .queues
                    .get(&queue)
                    .is_some_and(|q| q.kind() == crate::queue_type::QueueType::Quorum);
                if !passive
                    && quorum
                    && let Some(r) = self.nodes.attached.requests.get_mut(&(to.ch, to.serial))
                {
                    r.declare = Some(nowait);
                }
                None
            }
            other => Some(other),
        }
    }

    /// With `--shards` > 1, a client's request to another node's queue is served only where
    /// the answers find what they need (docs/cluster.md, "Not yet"): the host hands every
    /// piece of consumer mail from other nodes to shard 0, so the request must be recorded
    /// there (the stub is shard 0's, as `mail_to_home` runs on the stub's shard), and a
    /// consumer's deliveries and a get's message are taken in by shard 0, so its channel
    /// must be shard 0's too. Anything else would wait 10 s for an answer that never
    /// comes, then fail as if the home were down, or (a consumer on another shard's
    /// channel) get no delivery while the home sends its messages back and forth: it is
    /// refused now instead, 540 NOT_IMPLEMENTED (a connection error in AMQP 0-9-1, which
    /// the gateway logs). The home refuses the same way for a queue of its own that is not
    /// on its shard 0 (`refuse_on_shard`).
    fn unsupported_across_shards(
        &self,
        mail: &Mail,
        node: u32,
        queue: &str,
    ) -> Option<(ChannelAddr, ProtocolError)> {
        if self.shards <= 1 {
            return None;
        }
        let (to, op, channel_too, what) = match mail {
            Mail::Consume { consumer, .. } => (consumer.addr(), OpKind::Consume, true, "consuming"),
            Mail::Get { to, .. } => (*to, OpKind::Get, true, "getting from"),
            Mail::Purge { to, .. } => (*to, OpKind::QueuePurge, false, "purging"),
            Mail::Redeclare { to, .. } => (*to, OpKind::QueueDeclare, false, "declaring"),
            _ => return None,
        };
        if !client(to) || (self.shard == 0 && (!channel_too || self.conn_shard(to.ch.conn) == 0)) {
            return None;
        }
        Some((
            to,
            ProtocolError::new(
                ErrorCode::NotImplemented,
                op,
                format!(
                    "{what} queue '{queue}' of node {node} from another node needs --shards 1 \
                     (or the queue, its copy here and this connection on shard 0; here the \
                     copy is on shard {}, the connection on shard {} of {})",
                    self.shard,
                    self.conn_shard(to.ch.conn),
                    self.shards
                ),
            ),
        ))
    }

    /// At the home, with `--shards` > 1: another node's request for queue `id` is served
    /// only if the queue is shard 0's, where the host hands that node's mail and where the
    /// windows its answers go back through are (`unsupported_across_shards`); otherwise it
    /// is refused (540) rather than answered nowhere. True if refused.
    fn refuse_on_shard(&mut self, node: u32, to: NodeChannel, queue: &str, id: QueueId) -> bool {
        let shard = self.queue_shard(id);
        if shard == 0 {
            return false;
        }
        self.nodes.outbox.push((
            node,
            NodeMail::Refused {
                to,
                code: ErrorCode::NotImplemented.code(),
                text: format!(
                    "NOT_IMPLEMENTED - queue '{queue}' is on shard {shard} of {} of its home \
                     node: consuming it from another node needs --shards 1 there (or the \
                     queue on shard 0)",
                    self.shards
                ),
            },
        ));
        true
    }

    /// The answer to a request of channel `to` arrived from node `from`: the request, if it
    /// still waits for that node (a consume of a quorum queue sent again elsewhere, or
    /// waiting for a leader, does not take a late answer of the node it left).
    fn node_answered_request(&mut self, to: ChannelAddr, from: u32) -> Option<Request> {
        let key = (to.ch, to.serial);
        let current =
            self.nodes.attached.requests.get(&key).is_some_and(|r| {
                r.node == from && r.retry.as_ref().is_none_or(|x| x.parked.is_none())
            });
        if current {
            self.nodes.attached.requests.remove(&key)
        } else {
            None
        }
    }

    /// Whether queue `id` here is a quorum queue (its stub, on a node it does not lead).
    fn is_quorum(&self, id: QueueId) -> bool {
        self.qs
            .queues
            .get(&id)
            .is_some_and(|q| q.kind() == crate::queue_type::QueueType::Quorum)
    }

    /// Sends the consume of channel `from` with `settings` to the queue's home `node`.
    fn send_consume(
        &mut self,
        node: u32,
        from: ChannelAddr,
        (vhost, queue): (Arc<str>, Arc<str>),
        settings: NodeConsumer,
        nowait: bool,
    ) {
        self.nodes.attached.settings.insert(
            (from.ch, from.serial, settings.tag.clone()),
            settings.clone(),
        );
        self.nodes.outbox.push((
            node,
            NodeMail::Consume {
                vhost,
                queue,
                from: NodeChannel::of(from),
                consumer: settings,
                nowait,
            },
        ));
    }

    /// The node request `key` (a quorum queue's consume) went to is lost: it waits for a
    /// leader (bounded), or goes at once where the queue moved meanwhile. A request with no
    /// retry fails with RabbitMQ's 404.
    fn park(&mut self, key: (ChannelRef, u32)) {
        let now = self.now;
        let Some(r) = self.nodes.attached.requests.get_mut(&key) else {
            return;
        };
        let Some(retry) = r.retry.as_mut() else {
            self.fail_request(key.0, key.1, "is down or inaccessible");
            return;
        };
        if retry.parked.is_some() {
            // Already waiting (the host says the node is lost on every failed batch): the
            // bound stays the first one.
            return;
        }
        let until = now
            .saturating_add(LEADER_WAIT_MS)
            .min(retry.since.saturating_add(CONSUME_WAIT_MAX_MS));
        retry.parked = Some(until);
        if now >= until {
            // It waited its whole bound already, going from leader to leader.
            self.fail_request(key.0, key.1, "is down or inaccessible");
            return;
        }
        let (node, queue) = (r.node, retry.queue);
        if self.queue_home(queue) != Some(node) {
            // Its new leader was known before the old one was found lost.
            self.consume_again(key);
        }
    }

    /// Sends consume request `key` (a quorum queue's) where its queue is served now: another
    /// node (it waits there, or here again if that node is unreachable too), or this node
    /// (its copy takes the consumer, which moves with the queue as every consumer does).
    fn consume_again(&mut self, key: (ChannelRef, u32)) {
        let Some(mut r) = self.nodes.attached.requests.remove(&key) else {
            return;
        };
        let Some(mut retry) = r.retry.take() else {
            self.nodes.attached.requests.insert(key, r);
            return;
        };
        let to = ChannelAddr {
            ch: key.0,
            serial: key.1,
        };
        let tag = retry.settings.tag.clone();
        let open = self
            .chans
            .channels
            .get(&key.0)
            .is_some_and(|c| c.is_open_as(key.1));
        if !open || !self.qs.queues.contains_key(&retry.queue) {
            // The channel went (or its queue): nobody waits for the answer.
            self.nodes
                .attached
                .settings
                .remove(&(key.0, key.1, tag.clone()));
            if open {
                let error = ProtocolError::new(
                    ErrorCode::NotFound,
                    OpKind::Consume,
                    format!("no queue '{}'", r.queue),
                );
                self.mail.push_back(Mail::Refused { to, error });
            }
            return;
        }
        match self.queue_home(retry.queue) {
            Some(node) => {
                r.node = node;
                r.sent_at = self.now;
                let lost = self.nodes.unreachable.contains(&node);
                if !lost {
                    retry.parked = None;
                }
                let (settings, nowait) = (retry.settings.clone(), retry.nowait);
                let queue = retry.queue;
                r.retry = Some(retry);
                self.nodes.attached.requests.insert(key, r);
                if lost {
                    self.park(key);
                } else {
                    let names = self.queue_names(queue);
                    self.send_consume(node, to, names, settings, nowait);
                }
            }
            None => {
                self.nodes
                    .attached
                    .settings
                    .remove(&(key.0, key.1, tag.clone()));
                let c = retry.settings;
                self.mail.push_back(Mail::Consume {
                    queue: retry.queue,
                    consumer: Box::new(QueueConsumer {
                        id: ConsumerId(0),
                        tag: c.tag,
                        ch: to.ch,
                        serial: to.serial,
                        no_ack: c.no_ack,
                        exclusive: c.exclusive,
                        global_qos: c.global_prefetch > 0,
                        prefetch: c.prefetch,
                        unacked: 0,
                        refilling: false,
                        priority: c.priority,
                        shared: None,
                    }),
                    nowait: retry.nowait,
                    stream_offset: None,
                });
            }
        }
    }

    /// The quorum queues' consume requests that wait for `which` to hold, in a fixed order.
    fn consumes_waiting(&self, which: impl Fn(&Request, &Retry) -> bool) -> Vec<(ChannelRef, u32)> {
        let mut keys: Vec<(ChannelRef, u32)> = self
            .nodes
            .attached
            .requests
            .iter()
            .filter(|(_, r)| r.retry.as_ref().is_some_and(|x| which(r, x)))
            .map(|(k, _)| *k)
            .collect();
        keys.sort_unstable_by_key(|(ch, s)| (ch.conn, ch.channel, *s));
        keys
    }

    /// A delivery from the home of `queue` to consumer `consumer` of channel `to`.
    #[allow(clippy::too_many_arguments)]
    fn node_deliver(
        &mut self,
        from: u32,
        to: NodeChannel,
        (vhost, queue): (Arc<str>, Arc<str>),
        (consumer, tag, no_ack): (u64, Arc<str>, bool),
        (seq, redelivered, message): (u64, bool, Arc<Message>),
        window: u32,
        credit_now: &mut Vec<(u32, u32)>,
    ) {
        let addr = to.addr();
        let cid = ConsumerId(consumer);
        let stub = self.named_queue(&vhost, &queue).map(|(_, q)| q);
        let give_now = |credit_now: &mut Vec<(u32, u32)>| match credit_now.last_mut() {
            Some((w, n)) if *w == window => *n += 1,
            _ => credit_now.push((window, 1)),
        };
        // Only to a consumer still registered on that opening (one cancelled meanwhile,
        // or a channel closed, gives it back at once).
        // ... and only from the queue's home (a delivery the old home sent before the
        // queue moved would be settled nowhere: it goes back at once).
        let live = stub.filter(|&stub| {
            self.queue_home(stub) == Some(from)
                && self.chans.channels.get(&addr.ch).is_some_and(|c| {
                    c.is_open_as(addr.serial) && c.consumers.get(&tag) == Some((cid, stub))
                })
        });
        let Some(stub) = live else {
            if no_ack {
                self.lost_in_flight += 1;
            } else {
                self.nodes.outbox.push((
                    from,
                    NodeMail::Settle {
                        vhost,
                        queue,
                        seqs: vec![seq],
                        how: NodeSettle::Requeue,
                    },
                ));
            }
            give_now(credit_now);
            return;
        };
        if !no_ack {
            if let Some(c) = self.chans.channels.get_mut(&addr.ch) {
                c.consumer_unacked.add(1);
            }
            // The channel keeps it until it is settled: this node holds its body meanwhile
            // (released when the settle goes to the home, `mail_to_home`).
            self.hold(message.body_len() as u64);
        }
        let window_full = match self.chans.conns.get_mut(&addr.ch.conn) {
            Some(c) => {
                // The host counts it written as any delivery.
                c.in_flight.add(1);
                c.in_flight.get() > self.config.write_window
            }
            None => false,
        };
        self.deliver_picked(
            stub,
            Picked {
                consumer: cid,
                to: addr,
                tag,
                no_ack,
                message: QueuedMessage {
                    seq,
                    message,
                    redelivered,
                    stored: false,
                    expires_at: None,
                    epoch: FROM_NODE | from,
                },
            },
        );
        if window_full {
            // Given back once the connection wrote enough (`give_owed_credit`).
            let owed = self.nodes.attached.owed.entry(addr.ch.conn).or_default();
            match owed.last_mut() {
                Some((n, w, k)) if *n == from && *w == window => *k += 1,
                _ => owed.push((from, window, 1)),
            }
        } else {
            give_now(credit_now);
        }
    }

    /// Connection `conn` wrote (or went): the credit it owes homes goes back once its own
    /// window has room again (`all`: at once).
    pub(super) fn give_owed_credit(&mut self, conn: ConnId, all: bool) {
        if !NODES || self.nodes.attached.owed.is_empty() {
            return;
        }
        let room = self
            .chans
            .conns
            .get(&conn)
            .is_none_or(|c| c.in_flight.get() <= self.config.write_window);
        if !(all || room) {
            return;
        }
        for (node, window, count) in self.nodes.attached.owed.remove(&conn).unwrap_or_default() {
            self.nodes
                .outbox
                .push((node, NodeMail::Credit { window, count }));
        }
    }

    fn stub_or_refuse(
        &mut self,
        to: ChannelAddr,
        op: OpKind,
        vhost: &str,
        queue: &str,
    ) -> Option<QueueId> {
        let stub = self.named_queue(vhost, queue).map(|(_, q)| q);
        if stub.is_none() {
            let error = ProtocolError::new(
                ErrorCode::NotFound,
                op,
                format!("no queue '{queue}' in vhost '{vhost}'"),
            );
            self.mail.push_back(Mail::Refused { to, error });
        }
        stub
    }

    // ---- the home ----

    /// The window of channel `remote` of node `node` (made now if new).
    fn window(&mut self, node: u32, remote: NodeChannel, global_prefetch: u16) -> u32 {
        if let Some(&w) = self.nodes.remote.by_channel.get(&(node, remote)) {
            return w;
        }
        let w = self.nodes.remote.next;
        self.nodes.remote.next = w.wrapping_add(1);
        let credit = Arc::new(SharedCredit {
            open: AtomicBool::new(true),
            global_prefetch: AtomicU32::new(u32::from(global_prefetch)),
            consumer_unacked: Arc::default(),
            in_flight: Arc::default(),
            write_window: self.config.write_window,
        });
        self.nodes.remote.by_channel.insert((node, remote), w);
        self.nodes.remote.windows.insert(
            w,
            Window {
                node,
                remote,
                credit,
                consumers: Vec::new(),
                requests: 0,
                unacked: 0,
            },
        );
        w
    }

    /// Forgets window `w` once nothing refers to it.
    fn window_done(&mut self, w: u32) {
        let done = self
            .nodes
            .remote
            .windows
            .get(&w)
            .is_some_and(|x| x.consumers.is_empty() && x.requests == 0 && x.unacked == 0);
        if done && let Some(x) = self.nodes.remote.windows.remove(&w) {
            x.credit.open.store(false, Ordering::Release);
            self.nodes.remote.by_channel.remove(&(x.node, x.remote));
        }
    }

    /// Queue `id` was reloaded (`QueueState::reload`): the deliveries other nodes' channels
    /// hold of it are returned, so a settle naming one finds nothing (their windows' credit
    /// comes back now). Their bodies are let go by the queue (stale settles).
    pub(super) fn returned_remote_deliveries(&mut self, id: QueueId) {
        if !NODES || self.nodes.remote.unacked.is_empty() {
            return;
        }
        let mut keys: Vec<(u32, QueueId, u64)> = self
            .nodes
            .remote
            .unacked
            .keys()
            .filter(|k| k.1 == id)
            .copied()
            .collect();
        if keys.is_empty() {
            return;
        }
        keys.sort_unstable();
        let mut entries = Vec::with_capacity(keys.len());
        let mut windows: Vec<u32> = Vec::new();
        for key in keys {
            let Some((w, u)) = self.nodes.remote.unacked.remove(&key) else {
                continue;
            };
            if let Some(x) = self.nodes.remote.windows.get_mut(&w) {
                x.unacked = x.unacked.saturating_sub(1);
                if u.consumer.is_some() {
                    let before = x.credit.consumer_unacked.load(Ordering::Acquire);
                    x.credit
                        .consumer_unacked
                        .store(before.saturating_sub(1), Ordering::Release);
                }
            }
            windows.push(w);
            entries.push(u);
        }
        self.mail.push_back(Mail::Settle {
            queue: id,
            entries,
            how: Settle::Requeue,
        });
        windows.sort_unstable();
        windows.dedup();
        for w in windows {
            self.window_done(w);
        }
    }

    /// Dispatches the queues window `w`'s consumers consume from (it has credit again).
    fn dispatch_window(&mut self, w: u32) {
        let mut queues: Vec<QueueId> = self
            .nodes
            .remote
            .windows
            .get(&w)
            .map(|x| x.consumers.iter().map(|(_, q)| *q).collect())
            .unwrap_or_default();
        queues.sort_unstable();
        queues.dedup();
        for queue in queues {
            self.mail.push_back(Mail::Dispatch { queue });
        }
    }
}
