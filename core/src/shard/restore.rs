//! Restore: replaying stored definitions into this shard (and, on shard 0 of a sharded
//! broker, into the others, carrying the mail between them until none is left).

use super::*;
use crate::effect::Effect;
use crate::ids::ChannelRef;

/// How a sharded restore carries the mail between shard 0 (the first) and the others
/// (`crate::shards::carry`); a no-op with one shard.
pub(crate) type Carry = fn(u64, &mut Broker, &mut [Broker]);

impl Broker {
    /// Replays stored definitions (vhosts, users, permissions, policies, then per vhost
    /// exchanges, queues, bindings); durable queues reopen their stored messages. A store
    /// without vhosts and users (a fresh data directory, or one written before they were
    /// stored) gets the defaults written into it. Returns what could not be restored, as
    /// RabbitMQ-style error texts, for the host to log.
    pub fn restore(&mut self, now: u64, definitions: &Definitions) -> Vec<String> {
        self.restore_shards(now, definitions, &mut [], |_, _, _| {})
    }

    /// `restore` on shard 0 of a sharded broker, before any shard serves: `others` are
    /// shards 1.. (in order). Every shard gets the vhosts, users, permissions and policies;
    /// shard 0 replays exchanges, queues and bindings, and each restored queue is created
    /// by the shard that owns it, with the messages of that shard's store (`carry` moves
    /// the mail between them until none is left: `crate::shards::restore`).
    pub(crate) fn restore_shards(
        &mut self,
        now: u64,
        definitions: &Definitions,
        others: &mut [Broker],
        carry: Carry,
    ) -> Vec<String> {
        for b in others.iter_mut() {
            b.now = b.now.max(now);
            // The same replay from the same start gives the same vhost ids everywhere;
            // its errors are shard 0's too.
            b.restoring = true;
            b.restore_access(now, definitions, &mut Vec::new());
            b.restoring = false;
        }
        self.now = self.now.max(now);
        let mut errors = Vec::new();
        self.restore_access(now, definitions, &mut errors);
        // Parameters are topology's, shard 0's alone (the others never get them).
        for p in &definitions.parameters {
            if let Err(e) = self.set_parameter(now, p.clone()) {
                errors.push(format!("parameter '{}' of '{}': {e}", p.name, p.component));
            }
        }
        let vhosts: Vec<String> = self
            .topo
            .list_vhosts()
            .into_iter()
            .map(|v| v.name)
            .collect();
        for vhost in &vhosts {
            let in_vhost = |v: &String| v == vhost;
            let ops = definitions
                .exchanges
                .iter()
                .filter(|(v, _)| in_vhost(v))
                .map(|(_, x)| Op::ExchangeDeclare(x.clone()))
                .chain(
                    definitions
                        .queues
                        .iter()
                        .filter(|(v, _)| in_vhost(v))
                        .map(|(_, q)| Op::QueueDeclare(q.clone())),
                )
                .chain(
                    definitions
                        .bindings
                        .iter()
                        .filter(|(v, _, _)| in_vhost(v))
                        .map(|(_, b, to_exchange)| {
                            if *to_exchange {
                                Op::ExchangeBind(b.clone())
                            } else {
                                Op::QueueBind(b.clone())
                            }
                        }),
                );
            self.replay(now, vhost, ops, &mut errors, others, carry);
        }
        for (v, x) in &definitions.exchanges {
            if !vhosts.contains(v) {
                errors.push(format!(
                    "exchange '{}': vhost '{v}' does not exist",
                    x.exchange
                ));
            }
        }
        for (v, q) in &definitions.queues {
            if !vhosts.contains(v) {
                errors.push(format!("queue '{}': vhost '{v}' does not exist", q.queue));
            }
        }
        self.restore_retained(&definitions.retained, &mut errors);
        self.restoring = false;
        errors
    }

    /// Vhosts, users, permissions and policies of `definitions` (the first part of a
    /// restore, which every shard does).
    pub(super) fn restore_access(
        &mut self,
        now: u64,
        definitions: &Definitions,
        errors: &mut Vec<String>,
    ) {
        if definitions.vhosts.is_empty() && definitions.users.is_empty() {
            self.store_defaults();
        }
        self.restoring = true;
        if !definitions.vhosts.is_empty() || !definitions.users.is_empty() {
            // The stored ones replace the defaults (an operator may have deleted guest).
            self.topo.users.clear();
            let stored: std::collections::BTreeSet<&str> =
                definitions.vhosts.iter().map(|v| v.name.as_str()).collect();
            let defaults: Vec<String> = self
                .topo
                .list_vhosts()
                .into_iter()
                .map(|v| v.name)
                .collect();
            for v in defaults {
                if !stored.contains(v.as_str()) {
                    let _ = self.delete_vhost(now, &v);
                }
            }
            for v in &definitions.vhosts {
                if let Err(e) = self.add_vhost(now, v.clone()) {
                    errors.push(format!("vhost '{}': {e}", v.name));
                }
            }
            for u in &definitions.users {
                self.topo.users.put(u.clone());
            }
            for p in &definitions.permissions {
                if let Err(e) = self.set_permissions(now, p.clone()) {
                    errors.push(format!("permissions of '{}' in '{}': {e}", p.user, p.vhost));
                }
            }
            for p in &definitions.topic_permissions {
                if let Err(e) = self.set_topic_permissions(now, p.clone()) {
                    errors.push(format!(
                        "topic permissions of '{}' in '{}' on '{}': {e}",
                        p.user, p.vhost, p.exchange
                    ));
                }
            }
        }
        for p in &definitions.policies {
            if let Err(e) = self.set_policy(now, p.clone()) {
                errors.push(format!("policy '{}': {e}", p.name));
            }
        }
    }

    /// Applies `ops` in `vhost` on the restore connection, collecting their errors (a failed
    /// op reopens the channel, so the rest still apply).
    pub(super) fn replay(
        &mut self,
        now: u64,
        vhost: &str,
        ops: impl Iterator<Item = Op>,
        errors: &mut Vec<String>,
        others: &mut [Broker],
        carry: Carry,
    ) {
        let ch = ChannelRef::new(RESTORE_CONN, 1);
        let mark = self.effects.len();
        if self.chans.conns.contains_key(&RESTORE_CONN) {
            self.release_connection(RESTORE_CONN);
        }
        self.handle(
            now,
            ChannelRef::new(RESTORE_CONN, 0),
            Op::ConnectionOpen {
                vhost: vhost.to_string(),
                user: "warren-restore".into(),
                cancel_notify: false,
            },
        );
        self.handle(now, ch, Op::ChannelOpen);
        for op in ops {
            self.handle(now, ch, op);
            carry(now, self, others);
            let failed: Vec<String> =
                self.effects
                    .drain(mark..)
                    .filter_map(|effect| match effect {
                        Effect::ChannelError { error, .. }
                        | Effect::ConnectionError { error, .. } => Some(error.to_string()),
                        _ => None,
                    })
                    .collect();
            if !failed.is_empty() {
                errors.extend(failed);
                self.handle(now, ch, Op::ChannelCloseOk);
                self.handle(now, ch, Op::ChannelOpen);
                self.effects.truncate(mark);
            }
        }
        self.handle(now, ch, Op::ConnectionClose);
        self.effects.truncate(mark);
    }
}
