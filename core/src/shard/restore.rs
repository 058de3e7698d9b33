//! Restore: replaying stored definitions into this shard (and, on shard 0 of a sharded
//! broker, into the others, carrying the mail between them until none is left).

use super::*;
use crate::effect::Effect;
use crate::ids::ChannelRef;
use std::sync::Arc;

/// Rounds of mail between shards a sharded restore carries after one op: each round is a
/// hop (declare -> create -> created -> declare-ok is three), so this only catches a loop.
const MAX_SETTLE_ROUNDS: usize = 1 << 16;

impl Broker {
    /// Replays stored definitions (vhosts, users, permissions, policies, then per vhost
    /// exchanges, queues, bindings); durable queues reopen their stored messages. A store
    /// without vhosts and users (a fresh data directory, or one written before they were
    /// stored) gets the defaults written into it. Returns what could not be restored, as
    /// RabbitMQ-style error texts, for the host to log.
    pub fn restore(&mut self, now: u64, definitions: &Definitions) -> Vec<String> {
        self.restore_shards(now, definitions, &mut [])
    }

    /// `restore` on shard 0 of a sharded broker, before any shard serves: `others` are
    /// shards 1.. (in order). Every shard gets the vhosts, users, permissions and policies;
    /// shard 0 replays exchanges, queues and bindings, and each restored queue is created
    /// by the shard that owns it, with the messages of that shard's store (the mail between
    /// them is carried here until none is left).
    pub fn restore_shards(
        &mut self,
        now: u64,
        definitions: &Definitions,
        others: &mut [Broker],
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
            self.replay(now, vhost, ops, &mut errors, others);
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
        self.restoring = false;
        errors
    }

    /// On shard 0: carries mail between this shard and `others` (shards 1.., in order) in
    /// one thread until none is left, the other shards adopting this one's routing table
    /// first. The sharded restore's stand-in for the runtime, which is not running yet,
    /// and a host for tests.
    pub fn carry_mail(&mut self, now: u64, others: &mut [Broker]) {
        let mut out = Vec::new();
        // Each round moves what every shard sent; a round bounds by the restore's work.
        for _ in 0..MAX_SETTLE_ROUNDS {
            let routes = Arc::clone(self.routes());
            for b in others.iter_mut() {
                b.adopt_routes(Arc::clone(&routes));
            }
            self.take_outbox(&mut out);
            for b in others.iter_mut() {
                b.take_outbox(&mut out);
            }
            if out.is_empty() {
                return;
            }
            for m in out.drain(..) {
                match m.shard() {
                    0 => self.receive_mail(now, m),
                    i => match others.get_mut(i as usize - 1) {
                        Some(b) => b.receive_mail(now, m),
                        None => debug_assert!(false, "mail for shard {i}, which is not given"),
                    },
                }
            }
        }
        debug_assert!(false, "mail between shards does not settle");
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
    ) {
        let ch = ChannelRef::new(RESTORE_CONN, 1);
        let mark = self.effects.len();
        if self.conns.contains_key(&RESTORE_CONN) {
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
            self.carry_mail(now, others);
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
