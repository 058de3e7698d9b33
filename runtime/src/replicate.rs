//! The seam a clustered host plugs into so that durable metadata changes (declares, deletes,
//! bindings, vhosts, users, permissions, policies, imports) are committed by its consensus
//! group before this broker applies them, and are applied by every node in the group's log
//! order (docs/cluster.md, "What is replicated"). The runtime knows no cluster crate: the
//! host implements [`Replicator`] and applies committed changes with
//! [`crate::BrokerHandle::admin_local`], the admin path, which re-runs no client checks.
//!
//! Which changes go through it is decided here, once, for client ops
//! ([`replicated_op`]) and operators' requests ([`replicated_admin`]); what stays local:
//! passive declares, exclusive, transient and server-named queues, transient exchanges,
//! `amq.*` names (refused to clients anyway). MQTT connections' session queues and their
//! bindings are replicated ([`replicated_session_op`]): a subscriber on one node gets what
//! is published on any other.

use std::future::Future;
use std::pin::Pin;

use warren_core::access::{Perm, Permissions};
use warren_core::admin::{AdminRequest, AdminResponse};
use warren_core::command::Op;
use warren_core::error::{ErrorCode, ProtocolError};

/// What [`Replicator::replicate`] returns.
pub type ReplicateFuture = Pin<Box<dyn Future<Output = Result<AdminResponse, String>> + Send>>;

/// A host's consensus group for metadata.
pub trait Replicator: Send + Sync + 'static {
    /// Commits `change` and answers once this node applied it (with this node's answer to
    /// it), or `Err(why)` when it could not be committed within the host's bound (no
    /// quorum). A change that timed out may still commit later, and then every node applies
    /// it.
    fn replicate(&self, change: AdminRequest) -> ReplicateFuture;

    /// Answers once this node applied every change committed before the call (a read
    /// barrier: a passive declare on one node right after a declare-ok from another finds
    /// what was declared), or `Err(why)` when the cluster cannot tell within its bound.
    fn barrier(&self) -> Pin<Box<dyn Future<Output = Result<(), String>> + Send>>;

    /// Checks client op `op` in `vhost` against what the other nodes hold before it is
    /// proposed: a `queue.delete` with `if-unused` or `if-empty` is decided by the node that
    /// serves the queue, not by this node's stub of it (docs/cluster.md, "Failure modes").
    /// `Some(error)` refuses it (the client's channel error); `None` lets it be proposed.
    fn precheck(
        &self,
        vhost: &str,
        op: &Op,
    ) -> Pin<Box<dyn Future<Output = Option<ProtocolError>> + Send>> {
        let _ = (vhost, op);
        Box::pin(async { None })
    }
}

/// `op` as it is proposed once [`Replicator::precheck`] let it through: a `queue.delete`
/// with `if-unused` or `if-empty` was decided by that check, where the queue is served, so
/// it is committed without its conditions. Otherwise each node would decide again on its
/// own instance when it applies it: a consumer attaching (or a message arriving) on the
/// home between the check and the commit made the home keep its queue while every other
/// node dropped its copy (docs/cluster.md, "Failure modes"). Now every node deletes it,
/// that consumer is cancelled and that message goes with the queue, as for an
/// unconditional delete committed at that moment.
pub fn decided(op: Op) -> Op {
    match op {
        Op::QueueDelete {
            queue,
            nowait,
            if_unused: true,
            ..
        }
        | Op::QueueDelete {
            queue,
            nowait,
            if_empty: true,
            ..
        } => Op::QueueDelete {
            queue,
            if_unused: false,
            if_empty: false,
            nowait,
        },
        other => other,
    }
}

/// Whether a client op reads cluster metadata and so waits for [`Replicator::barrier`]
/// first: passive declares, a client's way to ask whether something exists.
pub fn needs_barrier(op: &Op) -> bool {
    match op {
        Op::ExchangeDeclare(d) => d.passive,
        Op::QueueDeclare(d) => d.passive,
        _ => false,
    }
}

/// The channel error a client gets when its change could not be committed within the
/// bound (no quorum: this node is on the minority side of a partition, or most nodes are
/// down). RabbitMQ 4 (Khepri) answers a metadata timeout with 541 INTERNAL_ERROR, which
/// closes the whole connection; a channel error keeps the client's other channels.
pub fn unavailable(op: &Op, why: &str) -> ProtocolError {
    ProtocolError::new(
        ErrorCode::PreconditionFailed,
        op.kind(),
        format!("cluster metadata store unavailable, the change was not committed: {why}"),
    )
}

/// Whether a client op changes cluster metadata (see the module docs).
pub fn replicated_op(op: &Op) -> bool {
    let shared_name = |n: &str| !n.is_empty() && !n.starts_with("amq.");
    match op {
        Op::ExchangeDeclare(d) => !d.passive && d.durable && shared_name(&d.exchange),
        Op::ExchangeDelete { exchange, .. } => shared_name(exchange),
        Op::QueueDeclare(d) => !d.passive && d.durable && !d.exclusive && shared_name(&d.queue),
        Op::QueueDelete { queue, .. } => !queue.is_empty(),
        // An empty destination is the channel's last declared queue: known to the channel
        // only, so that binding stays local.
        Op::QueueBind(b) | Op::QueueUnbind(b) | Op::ExchangeBind(b) | Op::ExchangeUnbind(b) => {
            !b.source.is_empty() && !b.destination.is_empty()
        }
        _ => false,
    }
}

/// Whether an MQTT session's op is cluster metadata: its queue and the queue's bindings,
/// so a publish on any node reaches a subscriber on any other, and retained messages (docs/cluster.md, "MQTT
/// across nodes"). A clean session's queue is exclusive: the other nodes keep a stub of
/// it, placed on the session's node by each declare (the newest session of a client id
/// owns it).
pub fn replicated_session_op(op: &Op) -> bool {
    match op {
        // A retained message is kept by every node, so a subscriber on any node gets it
        // (the broker's own `$SYS` topics, not durable, stay per node).
        Op::Retain { durable, .. } => *durable,
        Op::QueueDeclare(d) => !d.passive && !d.queue.is_empty(),
        Op::QueueDelete { queue, .. } => !queue.is_empty(),
        Op::QueueBind(b) | Op::QueueUnbind(b) => !b.source.is_empty() && !b.destination.is_empty(),
        _ => false,
    }
}

/// Whether an operator's request changes cluster metadata.
pub fn replicated_admin(request: &AdminRequest) -> bool {
    match request {
        AdminRequest::Op { op, .. } => replicated_op(op),
        AdminRequest::Import(_)
        | AdminRequest::SetPolicy(_)
        | AdminRequest::ClearPolicy { .. }
        | AdminRequest::SetParameter(_)
        | AdminRequest::ClearParameter { .. }
        | AdminRequest::AddVhost(_)
        | AdminRequest::DeleteVhost(_)
        | AdminRequest::AddUser(_)
        | AdminRequest::ChangePassword { .. }
        | AdminRequest::SetUserTags { .. }
        | AdminRequest::DeleteUser(_)
        | AdminRequest::SetPermissions(_)
        | AdminRequest::ClearPermissions { .. }
        | AdminRequest::SetTopicPermissions(_)
        | AdminRequest::ClearTopicPermissions { .. } => true,
        _ => false,
    }
}

/// The permissions a client op needs, as the core checks them (`shard/channel_declare.rs`):
/// checked before the op is proposed, since the nodes apply it on their admin path.
pub(crate) fn needed(op: &Op) -> Vec<(Perm, &str)> {
    match op {
        Op::ExchangeDeclare(d) => vec![(Perm::Configure, d.exchange.as_str())],
        Op::ExchangeDelete { exchange, .. } => vec![(Perm::Configure, exchange.as_str())],
        Op::QueueDeclare(d) => {
            let mut v = vec![(Perm::Configure, d.queue.as_str())];
            if let Some(dlx) = d
                .arguments
                .get("x-dead-letter-exchange")
                .and_then(|v| v.as_str())
            {
                v.push((Perm::Read, d.queue.as_str()));
                v.push((Perm::Write, dlx));
            }
            v
        }
        Op::QueueDelete { queue, .. } => vec![(Perm::Configure, queue.as_str())],
        Op::QueueBind(b) | Op::QueueUnbind(b) | Op::ExchangeBind(b) | Op::ExchangeUnbind(b) => {
            vec![
                (Perm::Write, b.destination.as_str()),
                (Perm::Read, b.source.as_str()),
            ]
        }
        // As the core checks a retain (`shard/channel_declare.rs`).
        Op::Retain { .. } => vec![(Perm::Write, "amq.topic")],
        _ => Vec::new(),
    }
}

/// Whether `perms` (the user's in the connection's vhost) allow `op`.
pub(crate) fn permitted(perms: Option<&Permissions>, op: &Op) -> bool {
    perms.is_some_and(|p| needed(op).iter().all(|(perm, name)| p.allows(*perm, name)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use warren_core::access::PermissionDef;
    use warren_core::command::{Bind, QueueDeclare};

    fn declare(name: &str, durable: bool, exclusive: bool) -> Op {
        Op::QueueDeclare(QueueDeclare {
            queue: name.into(),
            passive: false,
            durable,
            exclusive,
            auto_delete: false,
            nowait: false,
            arguments: Default::default(),
        })
    }

    #[test]
    fn what_is_cluster_metadata() {
        assert!(replicated_op(&declare("q", true, false)));
        assert!(!replicated_op(&declare("q", false, false)));
        assert!(!replicated_op(&declare("q", true, true)));
        assert!(!replicated_op(&declare("", true, false)));
        assert!(!replicated_op(&declare("amq.q", true, false)));
        let bind = |dest: &str| {
            Op::QueueBind(Bind {
                destination: dest.into(),
                source: "x".into(),
                routing_key: "k".into(),
                nowait: false,
                arguments: Default::default(),
            })
        };
        assert!(replicated_op(&bind("q")));
        assert!(!replicated_op(&bind("")));
        assert!(!replicated_op(&Op::ChannelOpen));
    }

    #[test]
    fn permissions_are_checked_as_the_core_does() {
        let perms = Permissions::compile(PermissionDef {
            user: "u".into(),
            vhost: "/".into(),
            configure: "^mine".into(),
            write: ".*".into(),
            read: ".*".into(),
        })
        .expect("valid");
        assert!(permitted(Some(&perms), &declare("mine.q", true, false)));
        assert!(!permitted(Some(&perms), &declare("other", true, false)));
        assert!(!permitted(None, &declare("mine.q", true, false)));
    }
}
