//! Exchanges, queues and bindings: declare, bind, unbind, purge, delete, with RabbitMQ's
//! checks (reserved `amq.` names, equivalence on redeclare, exclusive ownership) and
//! auto-delete cascades.

use super::mail::TopologyRequest;
use super::{Broker, OpResult};
use crate::access::{Perm, Resource};
use crate::command::{Bind, ExchangeDeclare, ExchangeKind, OpKind, QueueDeclare};
use crate::effect::Reply;
use crate::error::{ErrorCode, ProtocolError};
use crate::ids::{ChannelAddr, ChannelRef, ConnId, Destination, ExchangeId, QueueId, VhostId};
use crate::message::{FieldTable, FieldValue};
use crate::queue::classic::MessageQueue;
use crate::queue::state::QueueState;
use crate::topology::BindChange;
use std::sync::Arc;

/// Draws of a server-generated queue name before taking one unchecked (`fresh_queue_name`).
const MAX_NAME_DRAWS: usize = 8;

/// Queue arguments whose values must match on redeclare (as RabbitMQ checks them).
const EQUIVALENT_QUEUE_ARGS: &[&str] = &[
    "x-expires",
    "x-message-ttl",
    "x-max-length",
    "x-max-length-bytes",
    "x-overflow",
    "x-dead-letter-exchange",
    "x-dead-letter-routing-key",
    "x-max-priority",
    "x-queue-type",
    "x-single-active-consumer",
];

fn describe(v: Option<&FieldValue>) -> String {
    match v {
        None => "none".to_string(),
        Some(v) => match (v.as_str(), v.as_i64(), v.as_bool()) {
            (Some(s), _, _) => format!("'{s}'"),
            (_, Some(i), _) => format!("'{i}'"),
            (_, _, Some(b)) => format!("'{b}'"),
            _ => format!("{v:?}"),
        },
    }
}

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
    fn not_found(&self, vh: VhostId, op: OpKind, what: &str, name: &str) -> ProtocolError {
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

    fn default_exchange_refused(op: OpKind) -> ProtocolError {
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

    fn resolve_queue_name(
        &self,
        ch: ChannelRef,
        op: OpKind,
        name: &str,
    ) -> Result<Arc<str>, ProtocolError> {
        if !name.is_empty() {
            return Ok(Arc::from(name));
        }
        self.channels
            .get(&ch)
            .and_then(|c| c.last_queue.clone())
            .ok_or_else(|| {
                ProtocolError::new(ErrorCode::NotFound, op, "no previously declared queue")
            })
    }

    /// A server-generated name (`amq.gen-…`) no queue of vhost `vh` has: a queue restored
    /// from a run with the same seed (a simulation's) or named by another shard may hold
    /// the one drawn first, and a server-named declare must never land on an existing queue.
    fn fresh_queue_name(&mut self, vh: VhostId) -> Arc<str> {
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
        match self.queues.get(&id) {
            Some(q) => self.exclusive_use(ch.conn, op, q.exclusive_owner, &q.name, q.vhost),
            None => Ok(()),
        }
    }

    /// Refused (405) unless connection `conn` may use a queue held by `owner`.
    fn exclusive_use(
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
            let Some(kind) = ExchangeKind::parse(&d.kind) else {
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

    /// The topology side of exchange.declare in vhost `vh`: a passive one (`kind` `None`)
    /// only looks; else an existing exchange must be equivalent, and a new one is created
    /// (and stored).
    fn declare_exchange_in_topology(
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
            let mismatch = if x.kind != kind {
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

    /// The topology side of exchange.delete in vhost `vh`.
    fn delete_exchange_in_topology(
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
    fn bind(
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
    fn persist_binding(
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

    fn check_binding_arguments(
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
        b.destination = queue_name.to_string();
        self.send_to_topology(ch, TopologyRequest::Bind { op, bind: b });
        Ok(())
    }

    /// Sends a channel's topology request (always answered: the channel waits).
    fn send_to_topology(&mut self, ch: ChannelRef, request: TopologyRequest) {
        let to = self.addr(ch);
        let vhost = self.conn_vhost(ch.conn);
        self.mail.push_back(super::mail::Mail::Topology {
            to,
            vhost,
            request: Box::new(request),
        });
        self.await_answer(ch);
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

    fn apply_bind(&mut self, conn: ConnId, vh: VhostId, op: OpKind, b: &Bind) -> OpResult {
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
        if let Some(channel) = self.channels.get_mut(&ch) {
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

    /// The topology side of queue.declare of channel `to` in vhost `vh`: an existing queue
    /// (or one being created) decides itself (`Redeclare`); a new one is named here, stored,
    /// and created by its owner (`CreateQueue`), which tells topology (`QueueCreated`);
    /// only then is it routable and declare-ok sent, so a publish after declare-ok reaches
    /// it.
    fn declare_queue_in_topology(
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
        // A restore keeps a queue an older Warren stored with another type: it always was
        // a classic queue, and its messages are on disk.
        let checked_type = if self.restoring {
            Ok(())
        } else {
            crate::queue_args::check_queue_type(&d.arguments)
        };
        let args = checked_type
            .and_then(|()| crate::queue_args::QueueArgs::parse(&effective))
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
                args,
            }),
        });
        Ok(())
    }

    /// The owner's side of a new queue: creates it with its store log. An exclusive queue
    /// whose connection closed meanwhile is not created (it would outlive its owner).
    pub(super) fn create_queue(
        &mut self,
        id: QueueId,
        to: ChannelAddr,
        c: super::mail::CreateQueue,
    ) {
        let d = c.declare;
        let owner = d.exclusive.then_some(to.ch.conn);
        if owner.is_some_and(|o| !self.conns.contains_key(&o)) {
            let gone = super::mail::Mail::QueueGone {
                queue: id,
                answer: None,
            };
            self.mail.push_back(gone);
            return;
        }
        let stored = d.durable && !d.exclusive;
        // One allocation of the name for the queue, topology and the routing table.
        let name = c.name;
        let messages = match self.store.as_mut() {
            Some(store) => MessageQueue::recovered(
                store.open_queue(id, &c.vhost_name, &name, stored),
                c.args.max_priority,
            ),
            None => MessageQueue::recovered(Default::default(), c.args.max_priority),
        };
        let mut queue = QueueState::new(id, c.vhost, name, messages, self.now);
        queue.durable = d.durable;
        queue.exclusive_owner = owner;
        queue.auto_delete = d.auto_delete;
        queue.args = c.args.into();
        queue.set_arguments(d.arguments);
        let expiring = queue.args.message_ttl.is_some() || queue.args.expires.is_some();
        // Messages a durable queue's log already holds (a restore) count in declare-ok.
        let message_count = u32::try_from(queue.messages.len()).unwrap_or(u32::MAX);
        self.queues.insert(id, Box::new(queue));
        if expiring {
            self.expiring.insert(id);
        }
        if let Some(conn) = owner.and_then(|o| self.conns.get_mut(&o)) {
            conn.exclusive_queues.insert(id);
        }
        self.mail.push_back(super::mail::Mail::QueueCreated {
            queue: id,
            to,
            message_count,
            nowait: d.nowait,
        });
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

    /// The queue side of a declare of an existing queue: refused if another connection
    /// holds it exclusively or (unless passive) if the declare is not equivalent; else a
    /// redeclare renews its `x-expires` lease (a passive one only looks), and declare-ok
    /// carries its counts. A queue deleted while the declare travelled is not found.
    pub(super) fn redeclare_in_queue(
        &mut self,
        queue: QueueId,
        to: ChannelAddr,
        vhost: VhostId,
        d: QueueDeclare,
    ) {
        let op = OpKind::QueueDeclare;
        if !self.queues.contains_key(&queue) {
            // Deleted while the declare travelled: topology hears of that (`QueueGone`,
            // sent before this on the same link) before it sees the declare again, and
            // then creates the queue anew (or answers 404 to a passive declare).
            let request = TopologyRequest::DeclareQueue {
                name: Arc::from(d.queue.as_str()),
                declare: d,
                trusted_name: false,
            };
            self.mail.push_back(super::mail::Mail::Topology {
                to,
                vhost,
                request: Box::new(request),
            });
            return;
        }
        let checked = self.check_exclusive(to.ch, op, queue).and_then(|()| {
            if d.passive {
                return Ok(());
            }
            self.check_queue_equivalence(queue, &d)
        });
        if let Err(error) = checked {
            self.mail
                .push_back(super::mail::Mail::Refused { to, error });
            return;
        }
        let now = self.now;
        let Some(q) = self.queues.get_mut(&queue) else {
            return;
        };
        if !d.passive {
            q.last_used = now;
        }
        self.mail.push_back(super::mail::Mail::Declared {
            to,
            queue: q.name.clone(),
            message_count: u32::try_from(q.messages.len()).unwrap_or(u32::MAX),
            consumer_count: u32::try_from(q.consumers.len()).unwrap_or(u32::MAX),
            nowait: d.nowait,
            version: 0,
        });
    }

    fn check_queue_equivalence(&self, id: QueueId, d: &QueueDeclare) -> OpResult {
        let q = &self.queues[&id];
        let mismatch = if q.durable != d.durable {
            Some(("durable", q.durable.to_string(), d.durable.to_string()))
        } else if q.auto_delete != d.auto_delete {
            Some((
                "auto_delete",
                q.auto_delete.to_string(),
                d.auto_delete.to_string(),
            ))
        } else {
            EQUIVALENT_QUEUE_ARGS.iter().find_map(|&arg| {
                let (have, want) = (q.arguments().get(arg), d.arguments.get(arg));
                let same = match (have, want) {
                    (Some(a), Some(b)) => {
                        a == b
                            || (a.as_i64().is_some() && a.as_i64() == b.as_i64())
                            || (a.as_str().is_some() && a.as_str() == b.as_str())
                    }
                    (None, None) => true,
                    _ => false,
                };
                (!same).then(|| (arg, describe(have), describe(want)))
            })
        };
        match mismatch {
            None => Ok(()),
            Some((arg, current, received)) => Err(ProtocolError::new(
                ErrorCode::PreconditionFailed,
                OpKind::QueueDeclare,
                format!(
                    "inequivalent arg '{arg}' for queue '{}' in vhost '{}': received \
                     {received} but current is {current}",
                    q.name,
                    self.vhost_name(q.vhost)
                ),
            )),
        }
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
            to: self.addr(ch),
            nowait,
        });
        self.await_answer(ch);
        Ok(())
    }

    /// The queue side of queue.purge: refused if another connection holds the queue
    /// exclusively; else its ready messages go (unacked ones stay out), and the publishers
    /// it paused resume.
    pub(super) fn purge_in_queue(
        &mut self,
        queue: QueueId,
        to: crate::ids::ChannelAddr,
        nowait: bool,
    ) {
        if let Err(error) = self.check_exclusive(to.ch, OpKind::QueuePurge, queue) {
            self.mail
                .push_back(super::mail::Mail::Refused { to, error });
            return;
        }
        let purged = self.with_queue(queue, |q, io| q.purge(io)).unwrap_or(0);
        self.resume_paused(queue);
        self.mail.push_back(super::mail::Mail::Purged {
            to,
            message_count: u32::try_from(purged).unwrap_or(u32::MAX),
            nowait,
        });
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
                let to = self.addr(ch);
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

    /// The queue side of queue.delete: refused if another connection holds the queue
    /// exclusively, or by `if-unused` / `if-empty`; else delete-ok goes to the channel
    /// (before the consumers' cancels, as RabbitMQ orders them) and the queue goes. A queue
    /// gone meanwhile counts 0, as a missing one does.
    pub(super) fn delete_in_queue(
        &mut self,
        queue: QueueId,
        to: crate::ids::ChannelAddr,
        if_unused: bool,
        if_empty: bool,
        nowait: bool,
    ) {
        let op = OpKind::QueueDelete;
        if let Err(error) = self.check_exclusive(to.ch, op, queue) {
            self.mail
                .push_back(super::mail::Mail::Refused { to, error });
            return;
        }
        let refused = self.queues.get(&queue).and_then(|q| {
            let why = if if_unused && !q.consumers.is_empty() {
                "in use"
            } else if if_empty && !q.messages.is_empty() {
                "is not empty"
            } else {
                return None;
            };
            let vhost = self.vhost_name(q.vhost);
            Some(format!("queue '{}' in vhost '{vhost}' {why}", q.name))
        });
        if let Some(text) = refused {
            let error = ProtocolError::new(ErrorCode::PreconditionFailed, op, text);
            self.mail
                .push_back(super::mail::Mail::Refused { to, error });
            return;
        }
        let count = self.queues.get(&queue).map_or(0, |q| q.messages.len());
        let answer = super::mail::DeleteAnswer {
            to,
            message_count: u32::try_from(count).unwrap_or(u32::MAX),
            nowait,
        };
        self.delete_queue_answering(queue, Some(answer));
    }

    /// Removes a queue: its name and bindings (topology's, told by `QueueGone`; auto-delete
    /// exchanges left without bindings go too), its ready
    /// messages, and its consumers, who are told (`basic.cancel`) when their client
    /// understands it. Unacked deliveries stay on their channels; acking them is a no-op.
    pub(super) fn delete_queue(&mut self, id: QueueId) {
        self.delete_queue_answering(id, None);
    }

    /// `delete_queue`, for a queue.delete whose answer topology sends once the queue's name
    /// and bindings are gone (so a publish after delete-ok is not routed to it).
    fn delete_queue_answering(&mut self, id: QueueId, answer: Option<super::mail::DeleteAnswer>) {
        self.resume_paused(id);
        let Some(q) = self.queues.remove(&id) else {
            // Deleted by an earlier op while this delete travelled: topology heard of that
            // on this link already, and answers after it.
            if answer.is_some() {
                let gone = super::mail::Mail::QueueGone { queue: id, answer };
                self.mail.push_from(super::mail::Dest::Queue(id), gone);
            }
            return;
        };
        self.release(q.messages.bytes());
        // Topology removes its name and bindings (from this queue's link, so a declare the
        // queue sends back to topology arrives after it).
        let gone = super::mail::Mail::QueueGone { queue: id, answer };
        self.mail.push_from(super::mail::Dest::Queue(id), gone);
        let vhost = self.topo.vhost_name_arc(q.vhost);
        if let Some(store) = self.store.as_mut() {
            if q.durable && q.exclusive_owner.is_none() {
                if store
                    .define(crate::store::DefinitionChange::QueueDeleted {
                        vhost: &vhost,
                        name: &q.name,
                    })
                    .is_err()
                {
                    self.store_failed_at = Some(self.now);
                }
                self.sync_dirty = true;
            }
            store.delete_queue(id);
            // What it held is dead space for the store to reclaim at the next sync.
            self.note_removal();
        }
        if let Some(owner) = q.exclusive_owner.and_then(|o| self.conns.get_mut(&o)) {
            owner.exclusive_queues.remove(&id);
        }
        for consumer in q.consumers {
            self.mail.push_back(super::mail::Mail::ConsumerGone {
                ch: consumer.ch,
                consumer: consumer.id,
                consumer_tag: consumer.tag,
            });
        }
    }
}
