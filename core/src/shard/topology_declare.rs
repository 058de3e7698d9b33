//! Exchanges, queues and bindings: declare, bind, unbind, purge, delete, with RabbitMQ's
//! checks (reserved `amq.` names, equivalence on redeclare, exclusive ownership) and
//! auto-delete cascades.

use super::mail::TopologyRequest;
use super::{Broker, OpResult};
use crate::command::{Bind, ExchangeDeclare, ExchangeKind, OpKind, QueueDeclare};
use crate::effect::Reply;
use crate::error::{ErrorCode, ProtocolError};
use crate::ids::{ChannelAddr, ChannelRef, ConnId, Destination, ExchangeId, QueueId, VhostId};
use crate::message::FieldTable;
use crate::queue::kind::QueueType;
use crate::topology::BindChange;
use std::sync::Arc;

/// Draws of a server-generated queue name before taking one unchecked (`fresh_queue_name`).
const MAX_NAME_DRAWS: usize = 8;

/// The shard of a stored queue: FNV-1a of its vhost and name, modulo the shards (stable
/// across restarts with the same number of shards; the host refuses another number).
fn stored_queue_shard(vhost: &str, name: &str, shards: u32) -> u32 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in vhost.bytes().chain([0]).chain(name.bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    (h % u64::from(shards.max(1))) as u32
}

impl Broker {
    pub(super) fn not_found(
        &self,
        vh: VhostId,
        op: OpKind,
        what: &str,
        name: &str,
    ) -> ProtocolError {
        ProtocolError::new(
            ErrorCode::NotFound,
            op,
            format!("no {what} '{name}' in vhost '{}'", self.vhost_name(vh)),
        )
    }

    /// The exchange `name` in vhost `vh`, if it exists.
    pub(super) fn find_exchange(&self, vh: VhostId, name: &str) -> Option<ExchangeId> {
        self.topo.find_exchange(vh, name)
    }

    /// The queue `name` in vhost `vh`, if it exists.
    pub(super) fn find_queue(&self, vh: VhostId, name: &str) -> Option<QueueId> {
        self.topo.find_queue(vh, name)
    }

    pub(super) fn default_exchange_refused(op: OpKind) -> ProtocolError {
        ProtocolError::new(
            ErrorCode::AccessRefused,
            op,
            "operation not permitted on the default exchange",
        )
    }

    /// The exchange `name` in the vhost of the connection of `ch`, or 404.
    pub(super) fn exchange_id(
        &self,
        ch: ChannelRef,
        op: OpKind,
        name: &str,
    ) -> Result<ExchangeId, ProtocolError> {
        let vh = self.conn_vhost(ch.conn);
        self.find_exchange(vh, name)
            .ok_or_else(|| self.not_found(vh, op, "exchange", name))
    }

    /// Resolves a queue name (`""` = the channel's last declared queue) to its id, or 404;
    /// the ops that go to the queue leave its exclusive-use check to the queue.
    pub(super) fn find_named_queue(
        &self,
        ch: ChannelRef,
        op: OpKind,
        name: &str,
    ) -> Result<(QueueId, Arc<str>), ProtocolError> {
        let name = self.resolve_queue_name(ch, op, name)?;
        let vh = self.conn_vhost(ch.conn);
        let id = self
            .find_queue(vh, &name)
            .ok_or_else(|| self.not_found(vh, op, "queue", &name))?;
        Ok((id, name))
    }

    pub(super) fn resolve_queue_name(
        &self,
        ch: ChannelRef,
        op: OpKind,
        name: &str,
    ) -> Result<Arc<str>, ProtocolError> {
        if !name.is_empty() {
            return Ok(Arc::from(name));
        }
        self.chans
            .channels
            .get(&ch)
            .and_then(|c| c.last_queue.clone())
            .ok_or_else(|| {
                ProtocolError::new(ErrorCode::NotFound, op, "no previously declared queue")
            })
    }

    /// A server-generated name (`amq.gen-…`) no queue of vhost `vh` has: a queue restored
    /// from a run with the same seed (a simulation's) or named by another shard may hold
    /// the one drawn first, and a server-named declare must never land on an existing queue.
    pub(super) fn fresh_queue_name(&mut self, vh: VhostId) -> Arc<str> {
        // 128 bits per draw: a second clash in a row means a broken seed, not bad luck;
        // the bound keeps the loop finite whatever the seed.
        for _ in 0..MAX_NAME_DRAWS {
            let name = self.names.name("amq.gen-");
            if self.topo.find_queue_or_creating(vh, &name).is_none() {
                return Arc::from(name);
            }
        }
        Arc::from(self.names.name("amq.gen-"))
    }

    /// The queue side's exclusive-use check: refused if another connection declared queue
    /// `id` exclusive.
    pub(super) fn check_exclusive(&self, ch: ChannelRef, op: OpKind, id: QueueId) -> OpResult {
        match self.qs.queues.get(&id) {
            Some(q) => self.exclusive_use(ch.conn, op, q.exclusive_owner, &q.name, q.vhost),
            None => Ok(()),
        }
    }

    /// Refused (405) unless connection `conn` may use a queue held by `owner`.
    pub(super) fn exclusive_use(
        &self,
        conn: ConnId,
        op: OpKind,
        owner: Option<ConnId>,
        name: &str,
        vhost: VhostId,
    ) -> OpResult {
        if owner.is_none_or(|o| o == conn) {
            return Ok(());
        }
        Err(ProtocolError::new(
            ErrorCode::ResourceLocked,
            op,
            format!(
                "cannot obtain exclusive access to locked queue '{name}' in vhost '{}'. \
                 It could be originally declared on another connection or the \
                 exclusive property value does not match that of the original \
                 declaration.",
                self.vhost_name(vhost)
            ),
        ))
    }

    /// The topology side of exchange.declare in vhost `vh`: a passive one (`kind` `None`)
    /// only looks; else an existing exchange must be equivalent, and a new one is created
    /// (and stored).
    pub(super) fn declare_exchange_in_topology(
        &mut self,
        vh: VhostId,
        d: &ExchangeDeclare,
        kind: Option<ExchangeKind>,
    ) -> OpResult {
        let op = OpKind::ExchangeDeclare;
        let Some(kind) = kind else {
            return match self.find_exchange(vh, &d.exchange) {
                Some(_) => Ok(()),
                None => Err(self.not_found(vh, op, "exchange", &d.exchange)),
            };
        };
        let alternate = d
            .arguments
            .get("alternate-exchange")
            .and_then(|v| v.as_str())
            .map(str::to_string);
        if let Some(x) = self
            .find_exchange(vh, &d.exchange)
            .and_then(|id| self.topo.exchange(id))
        {
            let delayed = d.kind == crate::routing::DELAYED_TYPE;
            let mismatch = if x.delayed.is_some() != delayed {
                let name = |delayed: bool, k: ExchangeKind| match delayed {
                    true => crate::routing::DELAYED_TYPE.to_string(),
                    false => k.as_str().to_string(),
                };
                Some((
                    "type",
                    name(x.delayed.is_some(), x.kind),
                    name(delayed, kind),
                ))
            } else if x.kind != kind {
                Some((
                    "type",
                    x.kind.as_str().to_string(),
                    kind.as_str().to_string(),
                ))
            } else if x.durable != d.durable {
                Some(("durable", x.durable.to_string(), d.durable.to_string()))
            } else if x.auto_delete != d.auto_delete {
                Some((
                    "auto_delete",
                    x.auto_delete.to_string(),
                    d.auto_delete.to_string(),
                ))
            } else if x.internal != d.internal {
                Some(("internal", x.internal.to_string(), d.internal.to_string()))
            } else if x.own_alternate() != alternate.as_deref() {
                // Compared with its own argument: a policy's alternate exchange is not part
                // of what clients declare.
                Some((
                    "alternate-exchange",
                    format!("{:?}", x.own_alternate()),
                    format!("{alternate:?}"),
                ))
            } else {
                None
            };
            if let Some((arg, current, received)) = mismatch {
                return Err(ProtocolError::new(
                    ErrorCode::PreconditionFailed,
                    op,
                    format!(
                        "inequivalent arg '{arg}' for exchange '{}' in vhost '{}': received \
                         '{received}' but current is '{current}'",
                        d.exchange,
                        self.vhost_name(vh)
                    ),
                ));
            }
        } else {
            if d.exchange.starts_with("amq.") {
                return Err(ProtocolError::new(
                    ErrorCode::AccessRefused,
                    op,
                    format!(
                        "exchange name '{}' contains reserved prefix 'amq.*'",
                        d.exchange
                    ),
                ));
            }
            if d.durable && !self.restoring {
                let mut def = d.clone();
                def.passive = false;
                def.nowait = false;
                let vhost = self.vhost_name(vh).to_string();
                self.define(crate::store::DefinitionChange::ExchangeDeclared {
                    vhost: &vhost,
                    def: &def,
                });
            }
            let id = ExchangeId(self.next_id());
            self.topo.add_exchange(id, vh, kind, d.clone());
        }
        Ok(())
    }

    /// The topology side of exchange.delete in vhost `vh`.
    pub(super) fn delete_exchange_in_topology(
        &mut self,
        vh: VhostId,
        name: &str,
        if_unused: bool,
    ) -> OpResult {
        let op = OpKind::ExchangeDelete;
        // Deleting a missing exchange succeeds, as in RabbitMQ 3.x.
        if let Some(id) = self.find_exchange(vh, name) {
            if if_unused
                && self
                    .topo
                    .exchange(id)
                    .is_some_and(|x| !x.bindings.is_empty())
            {
                return Err(ProtocolError::new(
                    ErrorCode::PreconditionFailed,
                    op,
                    format!(
                        "exchange '{name}' in vhost '{}' in use",
                        self.vhost_name(vh)
                    ),
                ));
            }
            self.delete_exchange(id);
        }
        Ok(())
    }

    /// Removes an exchange with all bindings from and to it; auto-delete exchanges that lose
    /// their last binding this way go too (`Topology::delete_exchange`).
    pub(super) fn delete_exchange(&mut self, id: ExchangeId) {
        for (_, x) in self.topo.delete_exchange(id) {
            if x.durable {
                let vhost = self.topo.vhost_name_arc(x.vhost);
                self.define(crate::store::DefinitionChange::ExchangeDeleted {
                    vhost: &vhost,
                    name: &x.name,
                });
            }
        }
    }

    /// Adds or removes one binding from `source` to `destination`.
    pub(super) fn bind(
        &mut self,
        source: ExchangeId,
        destination: Destination,
        routing_key: &str,
        arguments: &FieldTable,
        add: bool,
    ) {
        let change = self
            .topo
            .bind(source, destination, routing_key, arguments, add);
        if change == (BindChange::Removed { emptied: true }) {
            self.delete_exchange(source);
        }
    }

    /// Records a durable definition change (no-op without a store or while restoring).
    pub(super) fn define(&mut self, change: crate::store::DefinitionChange<'_>) {
        // Definitions are shard 0's to keep; the others apply an operator's change too
        // (users, vhosts, policies) but store nothing of it.
        if self.restoring || self.shard != 0 {
            return;
        }
        let Some(store) = self.store.as_mut() else {
            return;
        };
        if store.define(change).is_err() {
            self.store_failed_at = Some(self.now);
        }
        self.sync_dirty = true;
    }

    /// Stores a binding change when both ends are durable (as RabbitMQ: a binding is durable
    /// only between durable entities).
    pub(super) fn persist_binding(
        &mut self,
        source: ExchangeId,
        destination: Destination,
        b: &Bind,
        add: bool,
    ) {
        if self.store.is_none() || self.restoring {
            return;
        }
        let Some(source) = self.topo.exchange(source) else {
            return;
        };
        let (source_durable, vhost) = (source.durable, self.topo.vhost_name_arc(source.vhost));
        let (destination_durable, to_exchange) = match destination {
            Destination::Queue(q) => (self.topo.queue(q).is_some_and(|q| q.stored), false),
            Destination::Exchange(x) => (self.topo.exchange(x).is_some_and(|x| x.durable), true),
        };
        if !(source_durable && destination_durable) {
            return;
        }
        let mut bind = b.clone();
        bind.nowait = false;
        self.define(if add {
            crate::store::DefinitionChange::Bound {
                vhost: &vhost,
                bind: &bind,
                to_exchange,
            }
        } else {
            crate::store::DefinitionChange::Unbound {
                vhost: &vhost,
                bind: &bind,
                to_exchange,
            }
        });
    }

    pub(super) fn check_binding_arguments(
        &self,
        op: OpKind,
        source: ExchangeId,
        arguments: &FieldTable,
    ) -> OpResult {
        if self
            .topo
            .exchange(source)
            .is_some_and(|x| x.kind == ExchangeKind::Headers)
            && let Err(text) = crate::exchange::validate_x_match(arguments)
        {
            return Err(ProtocolError::new(ErrorCode::PreconditionFailed, op, text));
        }
        Ok(())
    }

    /// The topology side of a channel's request in `vhost`: answers `TopologyDone` with
    /// the routing table version that holds the change, or `Refused`.
    pub(super) fn topology_request(
        &mut self,
        to: ChannelAddr,
        vhost: VhostId,
        request: &TopologyRequest,
    ) {
        let (result, reply, nowait) = match *request {
            TopologyRequest::Bind { op, ref bind } => {
                let reply = match op {
                    OpKind::ExchangeBind => Reply::ExchangeBindOk,
                    OpKind::ExchangeUnbind => Reply::ExchangeUnbindOk,
                    OpKind::QueueBind => Reply::QueueBindOk,
                    _ => Reply::QueueUnbindOk,
                };
                let result = self.apply_bind(to.ch.conn, vhost, op, bind);
                (result, reply, bind.nowait)
            }
            TopologyRequest::DeclareExchange { ref declare, kind } => (
                self.declare_exchange_in_topology(vhost, declare, kind),
                Reply::ExchangeDeclareOk,
                declare.nowait,
            ),
            TopologyRequest::DeleteExchange {
                ref name,
                if_unused,
                nowait,
            } => (
                self.delete_exchange_in_topology(vhost, name, if_unused),
                Reply::ExchangeDeleteOk,
                nowait,
            ),
            TopologyRequest::DeclareQueue {
                ref declare,
                ref name,
                trusted_name,
            } => {
                // Answered later, by the queue (redeclare) or once its owner created it.
                let name = name.clone();
                if let Err(error) =
                    self.declare_queue_in_topology(to, vhost, declare, name, trusted_name)
                {
                    self.mail
                        .push_back(super::mail::Mail::Refused { to, error });
                }
                return;
            }
            TopologyRequest::Retain {
                ref message,
                durable,
            } => {
                let stored =
                    self.retain(vhost, crate::mqtt::RetainedMessage::clone(message), durable);
                (Ok(()), Reply::RetainOk { stored }, false)
            }
            TopologyRequest::RetainedGet { ref filter, max } => {
                let messages = self.retained_get(vhost, filter, max);
                (Ok(()), Reply::Retained { messages }, false)
            }
        };
        let mail = match result {
            Ok(()) => super::mail::Mail::TopologyDone {
                to,
                reply: (!nowait).then_some(reply),
                version: self.topo.routes().version(),
            },
            Err(error) => super::mail::Mail::Refused { to, error },
        };
        self.mail.push_back(mail);
    }

    pub(super) fn apply_bind(
        &mut self,
        conn: ConnId,
        vh: VhostId,
        op: OpKind,
        b: &Bind,
    ) -> OpResult {
        let add = matches!(op, OpKind::ExchangeBind | OpKind::QueueBind);
        let destination = if matches!(op, OpKind::ExchangeBind | OpKind::ExchangeUnbind) {
            let id = self
                .find_exchange(vh, &b.destination)
                .ok_or_else(|| self.not_found(vh, op, "exchange", &b.destination))?;
            Destination::Exchange(id)
        } else {
            let id = self
                .find_queue(vh, &b.destination)
                .ok_or_else(|| self.not_found(vh, op, "queue", &b.destination))?;
            if let Some(q) = self.topo.queue(id) {
                self.exclusive_use(conn, op, q.exclusive_owner, &q.name, q.vhost)?;
            }
            Destination::Queue(id)
        };
        let source = self
            .find_exchange(vh, &b.source)
            .ok_or_else(|| self.not_found(vh, op, "exchange", &b.source))?;
        if add {
            self.check_binding_arguments(op, source, &b.arguments)?;
        }
        self.bind(source, destination, &b.routing_key, &b.arguments, add);
        self.persist_binding(source, destination, b, add);
        Ok(())
    }

    /// The topology side of queue.declare of channel `to` in vhost `vh`: an existing queue
    /// (or one being created) decides itself (`Redeclare`); a new one is named here, stored,
    /// and created by its owner (`CreateQueue`), which tells topology (`QueueCreated`);
    /// only then is it routable and declare-ok sent, so a publish after declare-ok reaches
    /// it.
    pub(super) fn declare_queue_in_topology(
        &mut self,
        to: ChannelAddr,
        vh: VhostId,
        d: &QueueDeclare,
        shared_name: Arc<str>,
        trusted_name: bool,
    ) -> OpResult {
        let op = OpKind::QueueDeclare;
        let name = d.queue.as_str();
        if let Some(queue) = self.topo.find_queue_or_creating(vh, name) {
            // The queue decides (exclusive use, equivalence, its counts) and answers.
            self.mail.push_back(super::mail::Mail::Redeclare {
                queue,
                to,
                vhost: vh,
                declare: Box::new(d.clone()),
            });
            return Ok(());
        }
        if d.passive {
            return Err(self.not_found(vh, op, "queue", name));
        }
        if name.starts_with("amq.") && !trusted_name {
            return Err(ProtocolError::new(
                ErrorCode::AccessRefused,
                op,
                format!("queue name '{name}' contains reserved prefix 'amq.*'"),
            ));
        }
        let policy = self.topo.policy(vh, name, true);
        let effective = crate::policy::queue_arguments(&d.arguments, policy);
        // A restore keeps the type a queue was stored with; one an older Warren stored with
        // a type it did not serve always was a classic queue, and its messages are on disk.
        let kind = if self.restoring {
            Ok(QueueType::from_arguments(&d.arguments).unwrap_or(QueueType::Classic))
        } else {
            QueueType::from_arguments(&d.arguments)
        };
        let (kind, args) = kind
            .and_then(|kind| Ok((kind, crate::queue_args::QueueArgs::parse(&effective)?)))
            .map_err(|(arg, reason)| {
                ProtocolError::new(
                    ErrorCode::PreconditionFailed,
                    op,
                    format!(
                        "invalid arg '{arg}' for queue '{name}' in vhost '{}': {reason}",
                        self.vhost_name(vh)
                    ),
                )
            })?;
        if !self.restoring {
            // The channel side named a server-named queue already (`amq.gen-`).
            let server_named = trusted_name && name.starts_with("amq.gen-");
            self.check_queue_type(vh, d, kind, server_named)?;
        }
        let left_out = match kind {
            QueueType::Stream => !crate::queue::stream::STREAMS,
            QueueType::Quorum => !crate::queue::quorum::QUORUM,
            _ => false,
        };
        if left_out {
            // As for any type this build does not serve (406, never a classic queue).
            return Err(ProtocolError::new(
                ErrorCode::PreconditionFailed,
                op,
                format!(
                    "invalid arg 'x-queue-type' for queue '{name}': type '{}' is left out of this build",
                    kind.name()
                ),
            ));
        }
        let stream = match kind {
            QueueType::Stream => Some(crate::queue::stream::settings(&effective).map_err(
                |(arg, reason)| {
                    ProtocolError::new(
                        ErrorCode::PreconditionFailed,
                        op,
                        format!(
                            "invalid arg '{arg}' for queue '{name}' in vhost '{}': {reason}",
                            self.vhost_name(vh)
                        ),
                    )
                },
            )?),
            _ => None,
        };
        let owner = d.exclusive.then_some(to.ch.conn);
        // Exclusive queues die with their connection: nothing of them outlives a restart,
        // so they are not stored as durable.
        let stored = d.durable && !d.exclusive;
        let vhost = self.topo.vhost_name_arc(vh);
        // A queue lives on the shard of the connection that declares it (an MQTT session's
        // queue, an RPC client's reply queue stay with their connection). A stored one
        // lives where its name says, so that after a restart it is restored on the shard
        // whose message log holds it.
        let shard = if stored {
            stored_queue_shard(&vhost, name, self.shards)
        } else {
            self.conn_shard(to.ch.conn)
        };
        let id = QueueId(self.id_on(shard));
        if stored && !self.restoring {
            let mut def = d.clone();
            def.passive = false;
            def.nowait = false;
            self.define(crate::store::DefinitionChange::QueueDeclared {
                vhost: &vhost,
                def: &def,
            });
        }
        self.topo
            .reserve_queue(id, vh, shared_name.clone(), owner, stored);
        self.mail.push_back(super::mail::Mail::CreateQueue {
            queue: id,
            to,
            create: Box::new(super::mail::CreateQueue {
                vhost: vh,
                vhost_name: vhost,
                name: shared_name,
                declare: d.clone(),
                kind,
                args,
                stream,
            }),
        });
        Ok(())
    }

    /// What a queue's type refuses in a declare, in RabbitMQ 3.10's order and words: a
    /// server-generated name, an argument RabbitMQ knows that the type does not take, then
    /// the properties (auto-delete, exclusive, non-durable) the type cannot have.
    fn check_queue_type(
        &self,
        vh: VhostId,
        d: &QueueDeclare,
        kind: QueueType,
        server_named: bool,
    ) -> OpResult {
        let caps = kind.capabilities();
        let fail = |text: String| {
            Err(ProtocolError::new(
                ErrorCode::PreconditionFailed,
                OpKind::QueueDeclare,
                text,
            ))
        };
        if server_named && !caps.server_named {
            return fail(format!(
                "Cannot declare a server-named queue for type {}",
                kind.module()
            ));
        }
        let rs = format!("queue '{}' in vhost '{}'", d.queue, self.vhost_name(vh));
        if let Some(arg) = caps
            .refused_arguments
            .iter()
            .find(|a| d.arguments.contains_key(**a))
        {
            return fail(format!(
                "invalid arg '{arg}' for {rs} of queue type {}",
                kind.module()
            ));
        }
        let property = if d.auto_delete && !caps.auto_delete {
            "auto-delete"
        } else if d.exclusive && !caps.exclusive {
            "exclusive-owner"
        } else if !d.durable && caps.durable_only {
            "non-durable"
        } else if d.durable && caps.transient_only {
            "durable"
        } else {
            return Ok(());
        };
        fail(format!("invalid property '{property}' for {rs}"))
    }

    /// Topology learns that queue `id` exists: it becomes routable, and its declarer gets
    /// declare-ok with the routing table version that holds it.
    pub(super) fn queue_created(
        &mut self,
        id: QueueId,
        to: ChannelAddr,
        message_count: u32,
        nowait: bool,
    ) {
        // Only its own `QueueGone` takes a reserved queue out, and that comes after this on
        // the owner's link.
        let Some(name) = self.topo.publish_queue(id) else {
            debug_assert!(false, "queue {id:?} created but not reserved");
            return;
        };
        let version = self.topo.routes().version();
        self.mail.push_back(super::mail::Mail::Declared {
            to,
            queue: name,
            message_count,
            consumer_count: 0,
            nowait,
            version,
        });
    }

    /// Topology learns that queue `id` is gone: its name, directory entry and bindings go,
    /// and the auto-delete exchanges that lose their last binding that way; then the
    /// queue.delete that removed it (if one did) is answered, with the routing table version
    /// that no longer has it.
    pub(super) fn queue_gone(&mut self, id: QueueId, answer: Option<super::mail::DeleteAnswer>) {
        for x in self.topo.remove_queue(id) {
            self.delete_exchange(x);
        }
        if let Some(a) = answer {
            self.mail.push_back(super::mail::Mail::Deleted {
                to: a.to,
                message_count: a.message_count,
                nowait: a.nowait,
                version: self.topo.routes().version(),
            });
        }
    }
}
