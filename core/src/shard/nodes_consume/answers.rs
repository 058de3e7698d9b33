//! A home's answers to another node's channel, and what a node receives of them (`NodeMail` for
//! consumers, in both directions).

use super::*;

impl Broker {
    /// The queue's answer to a window of node `node` goes back to that node's channel.
    pub(in crate::shard) fn mail_to_node(&mut self, node: u32, mail: Mail) {
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
    pub(in crate::shard) fn receive_consumer_mail(
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
    pub(super) fn refuse_remote(&mut self, node: u32, to: NodeChannel, vhost: &str, queue: &str) {
        self.nodes.outbox.push((
            node,
            NodeMail::Refused {
                to,
                code: ErrorCode::NotFound.code(),
                text: format!("NOT_FOUND - no queue '{queue}' in vhost '{vhost}'"),
            },
        ));
    }
}
