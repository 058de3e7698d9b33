//! A node lost or back, a quorum queue moved: what crossed between nodes ends, or is attached
//! again where the queue is served now.

use super::*;

impl Broker {
    /// Node `node` is unreachable or restarted: what crossed between it and this node ends
    /// (see the module's docs).
    pub(in crate::shard) fn drop_node_consumers(&mut self, node: u32) {
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
    pub(in crate::shard) fn reattaching(&self, to: ChannelAddr, tag: &str, queue: QueueId) -> bool {
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
    pub(in crate::shard) fn queue_moved(
        &mut self,
        id: QueueId,
        old: Option<u32>,
        new: Option<u32>,
    ) {
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
    pub(super) fn attach_again(&mut self, id: QueueId, to: ChannelAddr, c: NodeConsumer) {
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
    pub(in crate::shard) fn reattached(
        &mut self,
        to: ChannelAddr,
        tag: &Arc<str>,
    ) -> Option<Moving> {
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
    pub(in crate::shard) fn reattach_failed(
        &mut self,
        to: ChannelAddr,
        tag: Arc<str>,
        queue: QueueId,
    ) {
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
    pub(super) fn reattach_refused(&mut self, to: ChannelAddr, node: u32) {
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
    pub(super) fn reattach_lost(&mut self, node: u32) {
        for m in self.nodes.attached.moving.values_mut() {
            if m.node == Some(node) {
                m.lost = true;
            }
        }
    }

    /// Attaches again the consumers whose consume was lost, those of `node` back or of
    /// queue `queue` moved.
    pub(super) fn reattach_again(&mut self, which: impl Fn(&Moving) -> bool) {
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
    pub(super) fn fail_request(&mut self, ch: ChannelRef, serial: u32, why: &str) {
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
    pub(super) fn vhost_of_conn(&self, conn: ConnId) -> Arc<str> {
        self.chans
            .conns
            .get(&conn)
            .map(|c| self.topo.vhost_name_arc(c.vhost))
            .unwrap_or_else(|| Arc::from(""))
    }

    /// When the oldest request waiting for another node times out, if any waits.
    pub(in crate::shard) fn node_request_deadline(&self) -> Option<u64> {
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
    pub(in crate::shard) fn expire_node_requests(&mut self) {
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
    pub(in crate::shard) fn cancel_attached(&mut self, id: QueueId) {
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
