//! The channel side of declares, binds, purges and deletes: permission checks and name
//! resolution on the channel, then a request by mail to topology or to the queue.

use super::mail::TopologyRequest;
use super::*;
use crate::access::{Perm, Resource};
use crate::command::{Bind, ExchangeDeclare, ExchangeKind, OpKind, QueueDeclare};
use crate::effect::Reply;
use crate::error::{ErrorCode, ProtocolError};
use crate::ids::ChannelRef;
use std::sync::Arc;

impl Broker {
    /// The channel side of exchange.declare: the checks that need no topology (the default
    /// exchange, the type, permissions); topology decides the rest and answers.
    pub(super) fn exchange_declare(&mut self, ch: ChannelRef, d: ExchangeDeclare) -> OpResult {
        let op = OpKind::ExchangeDeclare;
        if d.exchange.is_empty() {
            return Err(Self::default_exchange_refused(op));
        }
        // A passive declare only looks: its type is not checked.
        let kind = if d.passive {
            None
        } else {
            let kind = if super::delayed::DELAYED && d.kind == crate::routing::DELAYED_TYPE {
                Self::delayed_kind(&d)?
            } else {
                ExchangeKind::parse(&d.kind)
            };
            let Some(kind) = kind else {
                return Err(ProtocolError::new(
                    ErrorCode::CommandInvalid,
                    op,
                    format!("invalid exchange type '{}'", d.kind),
                ));
            };
            self.check_access(ch, op, Perm::Configure, Resource::Exchange, &d.exchange)?;
            Some(kind)
        };
        let request = TopologyRequest::DeclareExchange { declare: d, kind };
        self.send_to_topology(ch, request);
        Ok(())
    }

    /// The channel side of exchange.delete: the checks that need no topology (the default
    /// and system exchanges, permissions); topology deletes and answers.
    pub(super) fn exchange_delete(
        &mut self,
        ch: ChannelRef,
        name: String,
        if_unused: bool,
        nowait: bool,
    ) -> OpResult {
        let op = OpKind::ExchangeDelete;
        if name.is_empty() {
            return Err(Self::default_exchange_refused(op));
        }
        let vh = self.conn_vhost(ch.conn);
        if name.starts_with("amq.") {
            return Err(ProtocolError::new(
                ErrorCode::AccessRefused,
                op,
                format!(
                    "deletion of system exchange '{name}' in vhost '{}' not allowed",
                    self.vhost_name(vh)
                ),
            ));
        }
        self.check_access(ch, op, Perm::Configure, Resource::Exchange, &name)?;
        let request = TopologyRequest::DeleteExchange {
            name,
            if_unused,
            nowait,
        };
        self.send_to_topology(ch, request);
        Ok(())
    }

    /// The channel side of exchange.bind/unbind: the permission checks (RabbitMQ checks
    /// them before it looks anything up), then the bind goes to topology, which answers.
    pub(super) fn exchange_bind(&mut self, ch: ChannelRef, b: Bind, add: bool) -> OpResult {
        let op = if add {
            OpKind::ExchangeBind
        } else {
            OpKind::ExchangeUnbind
        };
        self.check_access(ch, op, Perm::Write, Resource::Exchange, &b.destination)?;
        if b.source.is_empty() || b.destination.is_empty() {
            return Err(Self::default_exchange_refused(op));
        }
        self.check_access(ch, op, Perm::Read, Resource::Exchange, &b.source)?;
        self.check_topic_access(ch, op, Perm::Read, &b.source, &b.routing_key)?;
        self.send_to_topology(ch, TopologyRequest::Bind { op, bind: b });
        Ok(())
    }

    /// The channel side of queue.bind/unbind: resolves the queue name (`""` = the channel's
    /// last declared queue, whose name is then also the key if none is given) and checks
    /// permissions; topology decides the rest and answers.
    pub(super) fn queue_bind(&mut self, ch: ChannelRef, mut b: Bind, add: bool) -> OpResult {
        let op = if add {
            OpKind::QueueBind
        } else {
            OpKind::QueueUnbind
        };
        let queue_name = self.resolve_queue_name(ch, op, &b.destination)?;
        self.check_access(ch, op, Perm::Write, Resource::Queue, &queue_name)?;
        if b.source.is_empty() {
            return Err(Self::default_exchange_refused(op));
        }
        self.check_access(ch, op, Perm::Read, Resource::Exchange, &b.source)?;
        if b.destination.is_empty() && b.routing_key.is_empty() {
            b.routing_key = queue_name.to_string();
        }
        self.check_topic_access(ch, op, Perm::Read, &b.source, &b.routing_key)?;
        b.destination = queue_name.to_string();
        self.send_to_topology(ch, TopologyRequest::Bind { op, bind: b });
        Ok(())
    }

    /// The channel side of `Op::Retain` and `Op::RetainedGet`: MQTT publishes retained
    /// messages through `amq.topic` and subscribes from it, so the same permissions apply
    /// (write to set one, read to get them); topology keeps them and answers.
    pub(super) fn retained_op(&mut self, ch: ChannelRef, request: TopologyRequest) -> OpResult {
        let (op, perm) = match request {
            TopologyRequest::RetainedGet { .. } => (OpKind::RetainedGet, Perm::Read),
            _ => (OpKind::Retain, Perm::Write),
        };
        self.check_access(ch, op, perm, Resource::Exchange, crate::mqtt::EXCHANGE)?;
        self.send_to_topology(ch, request);
        Ok(())
    }

    /// Sends a channel's topology request (always answered: the channel waits).
    pub(super) fn send_to_topology(&mut self, ch: ChannelRef, request: TopologyRequest) {
        let to = self.chans.addr(ch);
        let vhost = self.conn_vhost(ch.conn);
        self.mail.push_back(super::mail::Mail::Topology {
            to,
            vhost,
            request: Box::new(request),
        });
        self.await_answer(ch);
    }

    pub(super) fn queue_declare(&mut self, ch: ChannelRef, d: QueueDeclare) -> OpResult {
        let op = OpKind::QueueDeclare;
        if d.passive && d.queue == crate::channel::reply_to::REPLY_TO {
            // The direct reply-to pseudo-queue exists for every channel (RabbitMQ answers a
            // passive declare of it).
            if !d.nowait {
                self.reply(
                    ch,
                    Reply::QueueDeclareOk {
                        queue: Arc::from(d.queue.as_str()),
                        message_count: 0,
                        consumer_count: 0,
                    },
                );
            }
            return Ok(());
        }
        let name: Arc<str> = if d.queue.is_empty() && !d.passive {
            self.fresh_queue_name(self.conn_vhost(ch.conn))
        } else {
            self.resolve_queue_name(ch, op, &d.queue)?
        };
        if !d.passive {
            self.check_access(ch, op, Perm::Configure, Resource::Queue, &name)?;
            // Dead-lettering publishes as this user: RabbitMQ checks it at declare.
            if let Some(dlx) = d
                .arguments
                .get("x-dead-letter-exchange")
                .and_then(|v| v.as_str())
            {
                self.check_access(ch, op, Perm::Read, Resource::Queue, &name)?;
                self.check_access(ch, op, Perm::Write, Resource::Exchange, dlx)?;
            }
        }
        if let Some(channel) = self.chans.channels.get_mut(&ch) {
            channel.last_queue = Some(name.clone());
        }
        // Only clients are kept from `amq.` names: a name the server generates now, or one
        // the broker's own connection replays (a restored server-named queue, an operator's
        // import), is the server's.
        let trusted_name = d.queue.is_empty() || ch.conn == crate::mail::mailbox::RESTORE_CONN;
        let mut declare = d;
        declare.queue = name.to_string();
        self.send_to_topology(
            ch,
            TopologyRequest::DeclareQueue {
                declare,
                name,
                trusted_name,
            },
        );
        Ok(())
    }

    pub(super) fn queue_purge(&mut self, ch: ChannelRef, name: &str, nowait: bool) -> OpResult {
        let (id, queue_name) = self.find_named_queue(ch, OpKind::QueuePurge, name)?;
        self.check_access(
            ch,
            OpKind::QueuePurge,
            Perm::Read,
            Resource::Queue,
            &queue_name,
        )?;
        self.mail.push_back(super::mail::Mail::Purge {
            queue: id,
            to: self.chans.addr(ch),
            nowait,
        });
        self.await_answer(ch);
        Ok(())
    }

    pub(super) fn queue_delete_op(
        &mut self,
        ch: ChannelRef,
        name: &str,
        if_unused: bool,
        if_empty: bool,
        nowait: bool,
    ) -> OpResult {
        let op = OpKind::QueueDelete;
        let resolved = self.resolve_queue_name(ch, op, name)?;
        let vh = self.conn_vhost(ch.conn);
        self.check_access(ch, op, Perm::Configure, Resource::Queue, &resolved)?;
        match self.find_queue(vh, &resolved) {
            Some(queue) => {
                let to = self.chans.addr(ch);
                self.mail.push_back(super::mail::Mail::Delete {
                    queue,
                    to,
                    if_unused,
                    if_empty,
                    nowait,
                });
                self.await_answer(ch);
            }
            // Deleting a missing queue succeeds with a count of 0, as in RabbitMQ 3.x.
            None if !nowait => self.reply(ch, Reply::QueueDeleteOk { message_count: 0 }),
            None => {}
        }
        Ok(())
    }
}
