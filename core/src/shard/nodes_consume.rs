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

    /// The queue's answer to a window of node `node` goes back to that node's channel.
    pub(super) fn mail_to_node(&mut self, node: u32, mail: Mail) {
        let remote = |b: &Broker, w: u32| b.nodes.remote.windows.get(&w).map(|x| x.remote);
        let answered = |b: &mut Broker, w: u32| {
            if let Some(x) = b.nodes.remote.windows.get_mut(&w) {
                x.requests = x.requests.saturating_sub(1);
            }
        };
        match mail {
            Mail::ConsumeOk {
                to,
                queue,
                consumer,
                tag,
                nowait,
            } => {
                answered(self, to.serial);
                let Some(x) = self.nodes.remote.windows.get_mut(&to.serial) else {
                    // The node went meanwhile.
                    self.mail.push_back(Mail::Cancel {
                        queue,
                        consumer,
                        reply: None,
                    });
                    return;
                };
                x.consumers.push((consumer, queue));
                let remote = x.remote;
                self.nodes.remote.by_consumer.insert(consumer, to.serial);
                let (vhost, name) = self.queue_names(queue);
                self.nodes.outbox.push((
                    node,
                    NodeMail::ConsumeOk {
                        to: remote,
                        vhost,
                        queue: name,
                        consumer: consumer.0,
                        tag,
                        nowait,
                    },
                ));
            }
            Mail::Refused { to, error } => {
                answered(self, to.serial);
                if let Some(remote) = remote(self, to.serial) {
                    self.nodes.outbox.push((
                        node,
                        NodeMail::Refused {
                            to: remote,
                            code: error.code.code(),
                            text: error.text,
                        },
                    ));
                }
                self.window_done(to.serial);
            }
            Mail::Deliver { queue, picked } => {
                let w = picked.to.serial;
                let m = picked.message;
                let Some(x) = self.nodes.remote.windows.get_mut(&w) else {
                    if !picked.no_ack {
                        let u = Unacked::of(queue, &m, Some(picked.consumer));
                        self.send_settles(vec![u], Settle::Requeue);
                    }
                    return;
                };
                let remote = x.remote;
                let mut delivery = 0;
                if !picked.no_ack {
                    x.unacked += 1;
                    let u = Unacked::of(queue, &m, Some(picked.consumer));
                    delivery = self.nodes.remote.delivery();
                    self.nodes
                        .remote
                        .unacked
                        .insert((node, queue, delivery), (w, u));
                }
                let (vhost, name) = self.queue_names(queue);
                self.nodes.outbox.push((
                    node,
                    NodeMail::Deliver {
                        to: remote,
                        vhost,
                        queue: name,
                        consumer: picked.consumer.0,
                        tag: picked.tag,
                        no_ack: picked.no_ack,
                        seq: delivery,
                        redelivered: m.redelivered,
                        message: m.message,
                        window: w,
                    },
                ));
            }
            Mail::Cancelled { reply } => {
                let w = reply.to.serial;
                answered(self, w);
                if let Some(remote) = remote(self, w) {
                    self.nodes.outbox.push((
                        node,
                        NodeMail::Cancelled {
                            to: remote,
                            tag: reply.consumer_tag,
                            nowait: reply.nowait,
                        },
                    ));
                }
                self.window_done(w);
            }
            Mail::ConsumerGone {
                consumer,
                consumer_tag,
                ..
            } => {
                let Some(w) = self.nodes.remote.by_consumer.remove(&consumer) else {
                    return;
                };
                if let Some(x) = self.nodes.remote.windows.get_mut(&w) {
                    x.consumers.retain(|(c, _)| *c != consumer);
                    let remote = x.remote;
                    self.nodes.outbox.push((
                        node,
                        NodeMail::ConsumerGone {
                            to: remote,
                            consumer: consumer.0,
                            tag: consumer_tag,
                        },
                    ));
                }
                self.window_done(w);
            }
            Mail::Got {
                queue,
                to,
                no_ack,
                got,
            } => {
                let w = to.serial;
                answered(self, w);
                let Some(x) = self.nodes.remote.windows.get_mut(&w) else {
                    if let Some((m, _)) = got.filter(|_| !no_ack) {
                        self.send_settles(vec![Unacked::of(queue, &m, None)], Settle::Requeue);
                    }
                    return;
                };
                let remote = x.remote;
                let mut delivery = 0;
                if let Some((m, _)) = got.as_ref().filter(|_| !no_ack) {
                    x.unacked += 1;
                    let u = Unacked::of(queue, m, None);
                    delivery = self.nodes.remote.delivery();
                    self.nodes
                        .remote
                        .unacked
                        .insert((node, queue, delivery), (w, u));
                }
                let (vhost, name) = self.queue_names(queue);
                self.nodes.outbox.push((
                    node,
                    NodeMail::Got {
                        to: remote,
                        vhost,
                        queue: name,
                        no_ack,
                        got: got.map(|(m, remaining)| NodeGot {
                            seq: delivery,
                            redelivered: m.redelivered,
                            message: m.message,
                            remaining,
                        }),
                    },
                ));
                self.window_done(w);
            }
            Mail::Purged {
                to,
                message_count,
                nowait,
            } => {
                answered(self, to.serial);
                if let Some(remote) = remote(self, to.serial) {
                    self.nodes.outbox.push((
                        node,
                        NodeMail::Purged {
                            to: remote,
                            count: message_count,
                            nowait,
                        },
                    ));
                }
                self.window_done(to.serial);
            }
            Mail::Declared {
                to,
                queue,
                message_count,
                consumer_count,
                nowait,
                ..
            } => {
                answered(self, to.serial);
                if let Some(remote) = remote(self, to.serial) {
                    self.nodes.outbox.push((
                        node,
                        NodeMail::Declared {
                            to: remote,
                            queue,
                            messages: message_count,
                            consumers: consumer_count,
                            nowait,
                        },
                    ));
                }
                self.window_done(to.serial);
            }
            // A declare of a queue deleted while it travelled (topology answers it).
            Mail::TopologyDone { to, .. } => {
                answered(self, to.serial);
                if let Some(remote) = remote(self, to.serial) {
                    self.nodes.outbox.push((
                        node,
                        NodeMail::Refused {
                            to: remote,
                            code: ErrorCode::NotFound.code(),
                            text: "NOT_FOUND - the queue was deleted".into(),
                        },
                    ));
                }
                self.window_done(to.serial);
            }
            // Nothing else is addressed to a node's window.
            _ => {}
        }
    }

    /// Mail from node `from` about consumers and requests (either side), in the order sent.
    pub(super) fn receive_consumer_mail(
        &mut self,
        from: u32,
        mail: NodeMail,
        credit_now: &mut Vec<(u32, u32)>,
    ) {
        match mail {
            NodeMail::Enqueue { .. } | NodeMail::Answered { .. } => {}
            // ---- at the home ----
            NodeMail::Consume {
                vhost,
                queue,
                from: remote,
                consumer,
                nowait,
            } => {
                let w = self.window(from, remote, consumer.global_prefetch);
                let to = node_addr(from, w);
                let Some((_, id)) = self.named_queue(&vhost, &queue) else {
                    self.refuse_remote(from, remote, &vhost, &queue);
                    self.window_done(w);
                    return;
                };
                if self.refuse_on_shard(from, remote, &queue, id) {
                    self.window_done(w);
                    return;
                }
                let Some(x) = self.nodes.remote.windows.get_mut(&w) else {
                    return;
                };
                x.requests += 1;
                // The channel's global prefetch as it is now (the window may be older).
                x.credit
                    .global_prefetch
                    .store(u32::from(consumer.global_prefetch), Ordering::Release);
                let qc = QueueConsumer {
                    id: ConsumerId(0),
                    tag: consumer.tag,
                    ch: to.ch,
                    serial: to.serial,
                    no_ack: consumer.no_ack,
                    exclusive: consumer.exclusive,
                    global_qos: consumer.global_prefetch > 0,
                    prefetch: consumer.prefetch,
                    unacked: 0,
                    refilling: false,
                    priority: consumer.priority,
                    shared: Some(x.credit.clone()),
                };
                self.mail.push_back(Mail::Consume {
                    queue: id,
                    consumer: Box::new(qc),
                    nowait,
                    stream_offset: None,
                });
            }
            NodeMail::Settle {
                vhost,
                queue,
                seqs,
                how,
            } => {
                let Some((_, id)) = self.named_queue(&vhost, &queue) else {
                    return;
                };
                let mut entries = Vec::with_capacity(seqs.len());
                let mut windows: Vec<u32> = Vec::new();
                for seq in seqs {
                    let Some((w, u)) = self.nodes.remote.unacked.remove(&(from, id, seq)) else {
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
                    if windows.last() != Some(&w) {
                        windows.push(w);
                    }
                    entries.push(u);
                }
                if !entries.is_empty() {
                    self.mail.push_back(Mail::Settle {
                        queue: id,
                        entries,
                        how: how.settle(),
                    });
                }
                windows.sort_unstable();
                windows.dedup();
                for w in windows {
                    self.dispatch_window(w);
                    self.window_done(w);
                }
            }
            NodeMail::Credit { window, count } => {
                if let Some(x) = self.nodes.remote.windows.get(&window) {
                    let f = &x.credit.in_flight;
                    let before = f.load(Ordering::Acquire);
                    f.store(before.saturating_sub(count), Ordering::Release);
                    self.dispatch_window(window);
                }
            }
            NodeMail::Cancel {
                vhost,
                queue,
                consumer,
                reply,
            } => {
                let cid = ConsumerId(consumer);
                let mut owned = false;
                if let Some(w) = self.nodes.remote.by_consumer.remove(&cid)
                    && let Some(x) = self.nodes.remote.windows.get_mut(&w)
                {
                    owned = x.node == from;
                    x.consumers.retain(|(c, _)| *c != cid);
                }
                // Only a consumer of that node's here: one this node dropped already (its
                // queue moved away, `queue_moved`) is gone, and the number may be another
                // consumer's by now (a cancel made here for it would even be forwarded to
                // the queue's new home, which numbers its own consumers).
                let id = self
                    .named_queue(&vhost, &queue)
                    .map(|(_, q)| q)
                    .filter(|_| owned);
                let reply = reply.map(|(remote, tag, nowait)| {
                    let w = self.window(from, remote, 0);
                    if let Some(x) = self.nodes.remote.windows.get_mut(&w) {
                        x.requests += 1;
                    }
                    CancelReply {
                        to: node_addr(from, w),
                        consumer_tag: tag,
                        nowait,
                    }
                });
                match id {
                    Some(queue) => self.mail.push_back(Mail::Cancel {
                        queue,
                        consumer: cid,
                        reply,
                    }),
                    // The queue (or the consumer) went: its consumers went with it.
                    None => {
                        if let Some(reply) = reply {
                            self.mail.push_back(Mail::Cancelled { reply });
                        }
                    }
                }
            }
            NodeMail::Request {
                vhost,
                queue,
                from: remote,
                request,
            } => {
                let Some((vid, id)) = self.named_queue(&vhost, &queue) else {
                    self.refuse_remote(from, remote, &vhost, &queue);
                    return;
                };
                if self.refuse_on_shard(from, remote, &queue, id) {
                    return;
                }
                let w = self.window(from, remote, 0);
                if let Some(x) = self.nodes.remote.windows.get_mut(&w) {
                    x.requests += 1;
                }
                let to = node_addr(from, w);
                self.mail.push_back(match request {
                    NodeRequest::Get { no_ack } => Mail::Get {
                        queue: id,
                        to,
                        no_ack,
                    },
                    NodeRequest::Purge { nowait } => Mail::Purge {
                        queue: id,
                        to,
                        nowait,
                    },
                    NodeRequest::Declare { nowait } => Mail::Redeclare {
                        queue: id,
                        to,
                        vhost: vid,
                        declare: Box::new(QueueDeclare {
                            queue: queue.to_string(),
                            passive: true,
                            durable: false,
                            exclusive: false,
                            auto_delete: false,
                            nowait,
                            arguments: Default::default(),
                        }),
                    },
                });
            }
            // ---- at the consuming node ----
            NodeMail::ConsumeOk {
                to,
                vhost,
                queue,
                consumer,
                tag,
                nowait,
            } => {
                let addr = to.addr();
                let cid = ConsumerId(consumer);
                let stub = self.named_queue(&vhost, &queue).map(|(_, q)| q);
                let moving = self.reattached(addr, &tag);
                let reattach = stub.is_some_and(|stub| self.reattaching(addr, &tag, stub));
                if let (Some(m), Some(stub), true) = (moving, stub, reattach)
                    && self.queue_home(stub) != Some(from)
                {
                    // The queue moved again while this consume travelled: it goes there
                    // (the moves it saw meanwhile found it in flight, nowhere attached).
                    self.nodes.outbox.push((
                        from,
                        NodeMail::Cancel {
                            vhost,
                            queue,
                            consumer,
                            reply: None,
                        },
                    ));
                    self.attach_again(stub, addr, m.settings);
                    return;
                }
                if !reattach && self.node_answered_request(addr, from).is_none() {
                    // Too late (the request timed out): the home lets it go.
                    self.nodes.outbox.push((
                        from,
                        NodeMail::Cancel {
                            vhost,
                            queue,
                            consumer,
                            reply: None,
                        },
                    ));
                    return;
                }
                let settings =
                    self.nodes
                        .attached
                        .settings
                        .remove(&(addr.ch, addr.serial, tag.clone()));
                match self.stub_or_refuse(addr, OpKind::Consume, &vhost, &queue) {
                    Some(stub) => {
                        self.nodes.attached.consumers.insert(
                            (stub, cid),
                            AttachedConsumer {
                                node: from,
                                ch: addr.ch,
                                serial: addr.serial,
                                tag: tag.clone(),
                                settings,
                                orphan: false,
                            },
                        );
                        self.mail.push_back(Mail::ConsumeOk {
                            to: addr,
                            queue: stub,
                            consumer: cid,
                            tag,
                            nowait,
                        });
                        // Registered before the deliveries that follow in this batch.
                        if !self.mail_scheduled {
                            self.pump();
                        }
                    }
                    None => self.nodes.outbox.push((
                        from,
                        NodeMail::Cancel {
                            vhost,
                            queue,
                            consumer,
                            reply: None,
                        },
                    )),
                }
            }
            NodeMail::Refused { to, code, text } => {
                let addr = to.addr();
                // Not those of a consume that waits elsewhere now (sent again).
                let elsewhere = self
                    .nodes
                    .attached
                    .requests
                    .get(&(addr.ch, addr.serial))
                    .is_some_and(|r| r.retry.is_some() && r.node != from);
                if !elsewhere {
                    self.nodes
                        .attached
                        .settings
                        .retain(|k, _| (k.0, k.1) != (addr.ch, addr.serial));
                }
                // No request waits: a consumer attached again was refused where its queue
                // moved (gone there, or in exclusive use): it ends, and the client hears.
                let Some(op) = self.node_answered_request(addr, from).map(|r| r.op) else {
                    self.reattach_refused(addr, from);
                    return;
                };
                let code = ErrorCode::from_code(code).unwrap_or(ErrorCode::InternalError);
                self.mail.push_back(Mail::Refused {
                    to: addr,
                    error: ProtocolError { code, text, op },
                });
            }
            NodeMail::Deliver {
                to,
                vhost,
                queue,
                consumer,
                tag,
                no_ack,
                seq,
                redelivered,
                message,
                window,
            } => self.node_deliver(
                from,
                to,
                (vhost, queue),
                (consumer, tag, no_ack),
                (seq, redelivered, message),
                window,
                credit_now,
            ),
            NodeMail::Cancelled { to, tag, nowait } => {
                let addr = to.addr();
                if self.node_answered_request(addr, from).is_none() {
                    return;
                }
                self.mail.push_back(Mail::Cancelled {
                    reply: CancelReply {
                        to: addr,
                        consumer_tag: tag,
                        nowait,
                    },
                });
            }
            NodeMail::ConsumerGone { to, consumer, tag } => {
                let ch = to.addr().ch;
                let cid = ConsumerId(consumer);
                let current = self
                    .chans
                    .channels
                    .get(&ch)
                    .and_then(|c| c.consumers.get(&tag));
                // Consumer ids are each node's own: the channel's consumer by that tag may
                // now be another one with the same number (attached here or elsewhere since
                // its queue moved), which this does not end.
                if let Some((c, stub)) = current
                    && c == cid
                    && self
                        .nodes
                        .attached
                        .consumers
                        .get(&(stub, cid))
                        .is_some_and(|a| a.node == from)
                {
                    self.nodes.attached.consumers.remove(&(stub, cid));
                    self.mail.push_back(Mail::ConsumerGone {
                        ch,
                        consumer: cid,
                        consumer_tag: tag,
                    });
                }
            }
            NodeMail::Got {
                to,
                vhost,
                queue,
                no_ack,
                got,
            } => {
                let addr = to.addr();
                if self.node_answered_request(addr, from).is_none() {
                    // Too late: what it took goes back.
                    if let Some(g) = got.filter(|_| !no_ack) {
                        self.nodes.outbox.push((
                            from,
                            NodeMail::Settle {
                                vhost,
                                queue,
                                seqs: vec![g.seq],
                                how: NodeSettle::Requeue,
                            },
                        ));
                    }
                    return;
                }
                match self.stub_or_refuse(addr, OpKind::Get, &vhost, &queue) {
                    Some(stub) => {
                        if let Some(g) = got.as_ref().filter(|_| !no_ack) {
                            // Held until settled, as a consumer's delivery (`node_deliver`).
                            self.hold(g.message.body_len() as u64);
                        }
                        self.mail.push_back(Mail::Got {
                            queue: stub,
                            to: addr,
                            no_ack,
                            got: got.map(|g| {
                                (
                                    QueuedMessage {
                                        seq: g.seq,
                                        message: g.message,
                                        redelivered: g.redelivered,
                                        stored: false,
                                        expires_at: None,
                                        epoch: FROM_NODE | from,
                                    },
                                    g.remaining,
                                )
                            }),
                        });
                    }
                    None => {
                        if let Some(g) = got.filter(|_| !no_ack) {
                            self.nodes.outbox.push((
                                from,
                                NodeMail::Settle {
                                    vhost,
                                    queue,
                                    seqs: vec![g.seq],
                                    how: NodeSettle::Requeue,
                                },
                            ));
                        }
                    }
                }
            }
            NodeMail::Purged { to, count, nowait } => {
                let addr = to.addr();
                if self.node_answered_request(addr, from).is_none() {
                    return;
                }
                self.mail.push_back(Mail::Purged {
                    to: addr,
                    message_count: count,
                    nowait,
                });
            }
            NodeMail::Declared {
                to,
                queue,
                messages,
                consumers,
                nowait,
            } => {
                let addr = to.addr();
                if self.node_answered_request(addr, from).is_none() {
                    return;
                }
                self.mail.push_back(Mail::Declared {
                    to: addr,
                    queue,
                    message_count: messages,
                    consumer_count: consumers,
                    nowait,
                    version: 0,
                });
            }
        }
    }

    /// A request of another node's channel for a queue this node does not have: 404.
    fn refuse_remote(&mut self, node: u32, to: NodeChannel, vhost: &str, queue: &str) {
        self.nodes.outbox.push((
            node,
            NodeMail::Refused {
                to,
                code: ErrorCode::NotFound.code(),
                text: format!("NOT_FOUND - no queue '{queue}' in vhost '{vhost}'"),
            },
        ));
    }

    /// Node `node` is unreachable or restarted: what crossed between it and this node ends
    /// (see the module's docs).
    pub(super) fn drop_node_consumers(&mut self, node: u32) {
        // The home's side: its windows' consumers go, what they held comes back.
        let mut windows: Vec<u32> = self
            .nodes
            .remote
            .windows
            .iter()
            .filter(|(_, x)| x.node == node)
            .map(|(w, _)| *w)
            .collect();
        windows.sort_unstable();
        for w in &windows {
            let Some(x) = self.nodes.remote.windows.remove(w) else {
                continue;
            };
            x.credit.open.store(false, Ordering::Release);
            self.nodes.remote.by_channel.remove(&(x.node, x.remote));
            for (cid, queue) in x.consumers {
                self.nodes.remote.by_consumer.remove(&cid);
                self.mail.push_back(Mail::Cancel {
                    queue,
                    consumer: cid,
                    reply: None,
                });
                // If it only looked gone (a stall), it hears of it when it answers again.
                let tag = self
                    .qs
                    .queues
                    .get(&queue)
                    .and_then(|q| q.consumers.iter().find(|c| c.id == cid))
                    .map_or_else(|| Arc::from(""), |c| c.tag.clone());
                self.nodes.outbox.push((
                    node,
                    NodeMail::ConsumerGone {
                        to: x.remote,
                        consumer: cid.0,
                        tag,
                    },
                ));
            }
        }
        let mut held: Vec<(QueueId, u64)> = self
            .nodes
            .remote
            .unacked
            .keys()
            .filter(|(n, _, _)| *n == node)
            .map(|(_, q, s)| (*q, *s))
            .collect();
        held.sort_unstable();
        for (queue, seq) in held {
            if let Some((_, u)) = self.nodes.remote.unacked.remove(&(node, queue, seq)) {
                self.mail.push_back(Mail::Settle {
                    queue,
                    entries: vec![u],
                    how: Settle::Requeue,
                });
            }
        }
        // The consuming side: consumers on its queues are cancelled, requests fail. A
        // quorum queue's consumers stay (RabbitMQ keeps them), orphaned: its group elects
        // another leader, and they attach there when the queue's home moves
        // (`queue_moved`), or there again when the node is back (`node_reachable`).
        let quorum = |b: &Broker, q: QueueId| {
            b.qs.queues
                .get(&q)
                .is_some_and(|q| q.kind() == crate::queue_type::QueueType::Quorum)
        };
        let mut gone: Vec<(QueueId, ConsumerId)> = Vec::new();
        let mut orphans: Vec<(QueueId, ConsumerId)> = Vec::new();
        for (k, c) in &self.nodes.attached.consumers {
            if c.node == node {
                if quorum(self, k.0) {
                    orphans.push(*k);
                } else {
                    gone.push(*k);
                }
            }
        }
        for k in orphans {
            if let Some(c) = self.nodes.attached.consumers.get_mut(&k) {
                c.orphan = true;
            }
        }
        self.reattach_lost(node);
        gone.sort_unstable();
        for key in gone {
            if let Some(c) = self.nodes.attached.consumers.remove(&key) {
                // If it only looked gone, the home drops the consumer when this arrives.
                let (vhost, queue) = self.queue_names(key.0);
                self.nodes.outbox.push((
                    node,
                    NodeMail::Cancel {
                        vhost,
                        queue,
                        consumer: key.1.0,
                        reply: None,
                    },
                ));
                self.mail.push_back(Mail::ConsumerGone {
                    ch: c.ch,
                    consumer: key.1,
                    consumer_tag: c.tag,
                });
            }
        }
        let mut waiting: Vec<(ChannelRef, u32)> = self
            .nodes
            .attached
            .requests
            .iter()
            .filter(|(_, r)| r.node == node)
            .map(|(k, _)| *k)
            .collect();
        waiting.sort_unstable_by_key(|(ch, s)| (ch.conn, ch.channel, *s));
        for key in waiting {
            // A quorum queue's consume waits for a leader; anything else fails (404).
            self.park(key);
        }
        for owed in self.nodes.attached.owed.values_mut() {
            owed.retain(|(n, _, _)| *n != node);
        }
        self.nodes.attached.owed.retain(|_, v| !v.is_empty());
    }

    /// Whether a consume of channel `to` under `tag` on `queue` attaches a consumer the
    /// channel already has there again (its queue moved), rather than a client's request.
    pub(super) fn reattaching(&self, to: ChannelAddr, tag: &str, queue: QueueId) -> bool {
        if !NODES {
            return false;
        }
        self.chans
            .channels
            .get(&to.ch)
            .filter(|c| c.serial == to.serial)
            .and_then(|c| c.consumers.get(tag))
            .is_some_and(|(_, q)| q == queue)
    }

    /// Queue `id` moved from `old` to `new` (`None`: this node), as a quorum queue's home
    /// follows its group's leader: this node's clients' consumers of it attach where it is
    /// now (RabbitMQ keeps a quorum queue's consumers across a leader change), and other
    /// nodes' consumers of it here go (their nodes attach them again).
    pub(super) fn queue_moved(&mut self, id: QueueId, old: Option<u32>, new: Option<u32>) {
        if old == new {
            return;
        }
        let (vhost, name) = self.queue_names(id);
        let mut moving: Vec<(ChannelAddr, NodeConsumer)> = Vec::new();
        // Attached to another node.
        let mut keys: Vec<(QueueId, ConsumerId)> = self
            .nodes
            .attached
            .consumers
            .keys()
            .filter(|k| k.0 == id)
            .copied()
            .collect();
        keys.sort_unstable();
        for key in keys {
            let Some(c) = self.nodes.attached.consumers.remove(&key) else {
                continue;
            };
            self.nodes.outbox.push((
                c.node,
                NodeMail::Cancel {
                    vhost: vhost.clone(),
                    queue: name.clone(),
                    consumer: key.1.0,
                    reply: None,
                },
            ));
            let to = ChannelAddr {
                ch: c.ch,
                serial: c.serial,
            };
            match c.settings {
                Some(settings) => moving.push((to, settings)),
                None => self.mail.push_back(Mail::ConsumerGone {
                    ch: c.ch,
                    consumer: key.1,
                    consumer_tag: c.tag,
                }),
            }
        }
        // Served here until now.
        if old.is_none() {
            let now = self.now;
            let consumers: Vec<(ConsumerId, ChannelAddr, NodeConsumer)> = self
                .qs
                .queues
                .get(&id)
                .map(|q| {
                    q.consumers
                        .iter()
                        .map(|c| {
                            let settings = NodeConsumer {
                                tag: c.tag.clone(),
                                no_ack: c.no_ack,
                                exclusive: c.exclusive,
                                prefetch: c.prefetch,
                                global_prefetch: 0,
                                priority: c.priority,
                            };
                            (c.id, c.addr(), settings)
                        })
                        .collect()
                })
                .unwrap_or_default();
            for (cid, to, mut settings) in consumers {
                if let Some(q) = self.qs.queues.get_mut(&id) {
                    q.remove_consumer(now, cid);
                }
                if is_node_conn(to.ch.conn) {
                    // Another node's: it goes quietly (that node attaches it again).
                    if let Some(w) = self.nodes.remote.by_consumer.remove(&cid)
                        && let Some(x) = self.nodes.remote.windows.get_mut(&w)
                    {
                        x.consumers.retain(|(c, _)| *c != cid);
                    }
                } else {
                    settings.global_prefetch = self
                        .chans
                        .channels
                        .get(&to.ch)
                        .map_or(0, |c| c.global_prefetch);
                    moving.push((to, settings));
                }
            }
            // What other nodes hold of it is settled there no more (the queue here is
            // reloaded from the new leader's copy when this node leads again).
            let mut held: Vec<(u32, QueueId, u64)> = self
                .nodes
                .remote
                .unacked
                .keys()
                .filter(|k| k.1 == id)
                .copied()
                .collect();
            held.sort_unstable();
            let mut windows = Vec::new();
            for k in held {
                if let Some((w, _)) = self.nodes.remote.unacked.remove(&k) {
                    if let Some(x) = self.nodes.remote.windows.get_mut(&w) {
                        x.unacked = x.unacked.saturating_sub(1);
                    }
                    windows.push(w);
                }
            }
            let mut all: Vec<u32> = self.nodes.remote.windows.keys().copied().collect();
            all.extend(windows);
            all.sort_unstable();
            all.dedup();
            for w in all {
                self.window_done(w);
            }
        }
        for (to, c) in moving {
            self.attach_again(id, to, c);
        }
        // Those whose consume was lost with an unreachable node go where it is now.
        self.reattach_again(|m| m.queue == id);
        // Clients' consumes of it waiting for a leader, or sent to where it was: where it
        // is now (a late answer of the old home is cancelled on arrival).
        for key in self.consumes_waiting(|r, x| x.queue == id && Some(r.node) != new) {
            self.consume_again(key);
        }
    }

    /// The host reaches node `node` again (`BrokerHandle::node_reachable`): the consumers
    /// it dropped while it was unreachable (quorum queues' consumers, kept) attach again
    /// where their queue is served now (there, if it still leads).
    pub fn node_reachable(&mut self, now: u64, node: u32) {
        self.now = self.now.max(now);
        self.nodes.unreachable.remove(&node);
        let mut keys: Vec<(QueueId, ConsumerId)> = self
            .nodes
            .attached
            .consumers
            .iter()
            .filter(|(_, c)| c.node == node && c.orphan)
            .map(|(k, _)| *k)
            .collect();
        keys.sort_unstable();
        for key in keys {
            let Some(c) = self.nodes.attached.consumers.remove(&key) else {
                continue;
            };
            let (vhost, name) = self.queue_names(key.0);
            // In case it only looked gone and still has it.
            self.nodes.outbox.push((
                node,
                NodeMail::Cancel {
                    vhost,
                    queue: name,
                    consumer: key.1.0,
                    reply: None,
                },
            ));
            if let Some(settings) = c.settings {
                let to = ChannelAddr {
                    ch: c.ch,
                    serial: c.serial,
                };
                self.attach_again(key.0, to, settings);
            }
        }
        self.reattach_again(|m| m.node == Some(node));
        // Clients' consumes of quorum queues that waited for it (it may lead still).
        for key in self.consumes_waiting(|r, x| r.node == node && x.parked.is_some()) {
            self.consume_again(key);
        }
        self.after_op();
    }

    /// Attaches consumer `c` of channel `to` (registered there on queue `id`) to the queue
    /// where it is served now: the same consumer for the client, no consume-ok.
    fn attach_again(&mut self, id: QueueId, to: ChannelAddr, c: NodeConsumer) {
        if !self.reattaching(to, &c.tag, id)
            || !self
                .chans
                .channels
                .get(&to.ch)
                .is_some_and(|ch| ch.is_open_as(to.serial))
        {
            return;
        }
        let node = self.queue_home(id);
        self.nodes.attached.moving.insert(
            (to.ch, to.serial, c.tag.clone()),
            Moving {
                queue: id,
                node,
                settings: c.clone(),
                lost: false,
            },
        );
        self.mail.push_back(Mail::Consume {
            queue: id,
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
            nowait: true,
            stream_offset: None,
        });
    }

    /// The consume of consumer `tag` of channel `to`, attached again, was answered with a
    /// consume-ok: it is attached (`None` if it was not moving).
    pub(super) fn reattached(&mut self, to: ChannelAddr, tag: &Arc<str>) -> Option<Moving> {
        if !NODES || self.nodes.attached.moving.is_empty() {
            return None;
        }
        self.nodes
            .attached
            .moving
            .remove(&(to.ch, to.serial, tag.clone()))
    }

    /// Consumer `tag` of channel `to` on queue `queue` cannot be attached again (its
    /// queue refused it where it is now, or is gone): the client learns it as from a
    /// deleted queue, basic.cancel if it takes one (RabbitMQ's consumer_cancel_notify),
    /// never a consumer left waiting on nothing.
    pub(super) fn reattach_failed(&mut self, to: ChannelAddr, tag: Arc<str>, queue: QueueId) {
        self.nodes
            .attached
            .moving
            .remove(&(to.ch, to.serial, tag.clone()));
        let current = self
            .chans
            .channels
            .get(&to.ch)
            .filter(|c| c.serial == to.serial)
            .and_then(|c| c.consumers.get(&tag));
        if let Some((cid, q)) = current
            && q == queue
        {
            self.mail.push_back(Mail::ConsumerGone {
                ch: to.ch,
                consumer: cid,
                consumer_tag: tag,
            });
        }
    }

    /// Node `node` refused a request of channel `to` that no client request waits for:
    /// the consumes of that channel attached again there (at most one in flight per
    /// consumer; the refusal names no tag, so every one of them in flight there goes,
    /// and a consume-ok that still comes for one is cancelled on arrival).
    fn reattach_refused(&mut self, to: ChannelAddr, node: u32) {
        let mut refused: Vec<(Arc<str>, QueueId)> = self
            .nodes
            .attached
            .moving
            .iter()
            .filter(|(k, m)| (k.0, k.1) == (to.ch, to.serial) && m.node == Some(node))
            .map(|(k, m)| (k.2.clone(), m.queue))
            .collect();
        refused.sort_unstable();
        for (tag, queue) in refused {
            self.reattach_failed(to, tag, queue);
        }
    }

    /// Consumers attached again whose consume went to `node` now unreachable: kept, to
    /// attach again when it is back or the queue moves (as `orphan` attached consumers).
    fn reattach_lost(&mut self, node: u32) {
        for m in self.nodes.attached.moving.values_mut() {
            if m.node == Some(node) {
                m.lost = true;
            }
        }
    }

    /// Attaches again the consumers whose consume was lost, those of `node` back or of
    /// queue `queue` moved.
    fn reattach_again(&mut self, which: impl Fn(&Moving) -> bool) {
        let mut again: Vec<(MovingKey, QueueId)> = self
            .nodes
            .attached
            .moving
            .iter()
            .filter(|(_, m)| m.lost && which(m))
            .map(|(k, m)| (k.clone(), m.queue))
            .collect();
        again.sort_unstable_by(|a, b| {
            (a.0.0.conn, a.0.0.channel, a.0.1, &a.0.2).cmp(&(
                b.0.0.conn,
                b.0.0.channel,
                b.0.1,
                &b.0.2,
            ))
        });
        for (key, queue) in again {
            if let Some(m) = self.nodes.attached.moving.remove(&key) {
                let to = ChannelAddr {
                    ch: key.0,
                    serial: key.1,
                };
                self.attach_again(queue, to, m.settings);
            }
        }
    }

    /// Fails request `(ch, serial)` waiting for another node: a cancel is answered
    /// (cancel-ok: the consumer is gone from this node's view), anything else is refused
    /// with RabbitMQ's 404 for a queue whose home node is unavailable.
    fn fail_request(&mut self, ch: ChannelRef, serial: u32, why: &str) {
        let Some(r) = self.nodes.attached.requests.remove(&(ch, serial)) else {
            return;
        };
        let to = ChannelAddr { ch, serial };
        if let Some(retry) = &r.retry {
            self.nodes
                .attached
                .settings
                .remove(&(ch, serial, retry.settings.tag.clone()));
            if retry.parked.is_some() {
                // RabbitMQ's answer when a quorum queue's group gives no leader in time:
                // 541, a connection error in AMQP 0-9-1.
                let vhost = self.vhost_of_conn(ch.conn);
                let error = ProtocolError::new(
                    ErrorCode::InternalError,
                    OpKind::Consume,
                    format!(
                        "timed out consuming from quorum queue '{}' in vhost '{vhost}': no \
                         leader serves it (node {}, its last, is down or inaccessible)",
                        r.queue, r.node
                    ),
                );
                self.mail.push_back(Mail::Refused { to, error });
                return;
            }
        }
        if let Some(nowait) = r.declare {
            self.mail.push_back(Mail::Declared {
                to,
                queue: r.queue,
                message_count: 0,
                consumer_count: 0,
                nowait,
                version: 0,
            });
            return;
        }
        match r.cancel {
            Some((consumer_tag, nowait)) => self.mail.push_back(Mail::Cancelled {
                reply: CancelReply {
                    to,
                    consumer_tag,
                    nowait,
                },
            }),
            None => {
                let vhost = self.vhost_of_conn(ch.conn);
                let error = ProtocolError::new(
                    ErrorCode::NotFound,
                    r.op,
                    format!(
                        "home node {} of queue '{}' in vhost '{vhost}' {why}",
                        r.node, r.queue
                    ),
                );
                self.mail.push_back(Mail::Refused { to, error });
            }
        }
    }

    /// The vhost of connection `conn` (empty if it went).
    fn vhost_of_conn(&self, conn: ConnId) -> Arc<str> {
        self.chans
            .conns
            .get(&conn)
            .map(|c| self.topo.vhost_name_arc(c.vhost))
            .unwrap_or_else(|| Arc::from(""))
    }

    /// When the oldest request waiting for another node times out, if any waits.
    pub(super) fn node_request_deadline(&self) -> Option<u64> {
        if !NODES {
            return None;
        }
        self.nodes
            .attached
            .requests
            .values()
            .map(Request::deadline)
            .min()
    }

    /// Fails the requests that waited for another node's answer too long (`tick`).
    pub(super) fn expire_node_requests(&mut self) {
        if !NODES || self.nodes.attached.requests.is_empty() {
            return;
        }
        let now = self.now;
        let mut late: Vec<(ChannelRef, u32)> = self
            .nodes
            .attached
            .requests
            .iter()
            .filter(|(_, r)| now >= r.deadline())
            .map(|(k, _)| *k)
            .collect();
        late.sort_unstable_by_key(|(ch, s)| (ch.conn, ch.channel, *s));
        for (ch, serial) in late {
            self.fail_request(ch, serial, "did not answer in time");
        }
    }

    /// Queue `id` (a stub) is deleted here: this node's consumers attached to it on its
    /// home are cancelled (basic.cancel for clients that take it).
    pub(super) fn cancel_attached(&mut self, id: QueueId) {
        if !NODES || !self.nodes.attached.has_consumers() {
            return;
        }
        let mut keys: Vec<(QueueId, ConsumerId)> = self
            .nodes
            .attached
            .consumers
            .keys()
            .filter(|k| k.0 == id)
            .copied()
            .collect();
        keys.sort_unstable();
        for key in keys {
            if let Some(c) = self.nodes.attached.consumers.remove(&key) {
                self.mail.push_back(Mail::ConsumerGone {
                    ch: c.ch,
                    consumer: key.1,
                    consumer_tag: c.tag,
                });
            }
        }
        // Those attaching again, their consume in flight (or lost with a node).
        let mut moving: Vec<MovingKey> = self
            .nodes
            .attached
            .moving
            .iter()
            .filter(|(_, m)| m.queue == id)
            .map(|(k, _)| k.clone())
            .collect();
        moving.sort_unstable_by(|a, b| {
            (a.0.conn, a.0.channel, a.1, &a.2).cmp(&(b.0.conn, b.0.channel, b.1, &b.2))
        });
        for (ch, serial, tag) in moving {
            self.reattach_failed(ChannelAddr { ch, serial }, tag, id);
        }
    }
}
