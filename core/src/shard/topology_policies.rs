//! Setting and clearing policies at runtime: every existing queue and exchange gets its
//! effective settings recomputed at once (no redeclare), and stores keep the policies.

use super::Broker;
use crate::admin::AdminError;
use crate::ids::QueueId;
use crate::policy::{self, Policy, PolicyDef};
use crate::store::DefinitionChange;

impl Broker {
    /// Adds or replaces a policy in its vhost; the error says why it is refused.
    pub fn set_policy(&mut self, now: u64, def: PolicyDef) -> Result<(), AdminError> {
        self.now = self.now.max(now);
        let vh = self
            .vhost_id(&def.vhost)
            .ok_or_else(|| AdminError::NotFound(format!("vhost '{}' does not exist", def.vhost)))?;
        let compiled = Policy::new(def)?;
        self.define(DefinitionChange::PolicySet(&compiled.def));
        self.topo.set_policy(vh, compiled);
        self.apply_policies();
        Ok(())
    }

    /// Removes a policy of a vhost; the error names a missing one.
    pub fn clear_policy(&mut self, now: u64, vhost: &str, name: &str) -> Result<(), AdminError> {
        self.now = self.now.max(now);
        let removed = self
            .vhost_id(vhost)
            .is_some_and(|vh| self.topo.clear_policy(vh, name));
        if !removed {
            return Err(AdminError::NotFound(format!(
                "policy '{name}' not found in vhost '{vhost}'"
            )));
        }
        self.define(DefinitionChange::PolicyCleared { vhost, name });
        self.apply_policies();
        Ok(())
    }

    /// Every policy, by vhost and name.
    pub fn list_policies(&self) -> Vec<PolicyDef> {
        self.topo.list_policies()
    }

    /// The name of the policy applying to a queue, if any (admin tools).
    pub fn queue_policy(&self, vhost: &str, queue: &str) -> Option<String> {
        let vh = self.vhost_id(vhost)?;
        self.topo
            .policy(vh, queue, true)
            .map(|p| p.def.name.clone())
    }

    /// Recomputes every queue's and exchange's effective settings from its own arguments
    /// and the policy that applies now; new limits act at once.
    pub(super) fn apply_policies(&mut self) {
        let mut ids: Vec<QueueId> = self.qs.queues.keys().copied().collect();
        // Id order, not hash order: the effects of a policy change (overflow drops, dead
        // letters, expiries, deliveries) come out in the same order on every build (native
        // and wasm hash differently).
        ids.sort_unstable();
        let mut touched = Vec::new();
        let mut switched = Vec::new();
        for id in ids {
            let Some(q) = self.qs.queues.get(&id) else {
                continue;
            };
            let applicable = self.topo.policy(q.vhost, &q.name, true);
            let merged = policy::queue_arguments(q.arguments(), applicable);
            // A stream takes its own keys only (retention, segment size), into its log.
            if let Some(stream) = q.stream_ref() {
                let Ok(settings) = crate::queue::stream::settings(&merged) else {
                    continue;
                };
                if settings != stream.settings {
                    let (vhost, name) = (self.vhost_name(q.vhost).to_string(), q.name.clone());
                    self.with_queue(id, |q, io| {
                        if let Some(s) = q.stream_mut() {
                            s.set_settings(id, io, &vhost, &name, settings);
                        }
                    });
                }
                continue;
            }
            // Policies were validated when set; the queue's own arguments when declared.
            let Ok(mut args) = crate::queue_args::QueueArgs::parse(&merged) else {
                continue;
            };
            // The priority levels are the queue's shape: only its own argument sets them.
            args.max_priority = q.args.max_priority;
            if args == *q.args {
                continue;
            }
            if args.message_ttl.is_some() || args.expires.is_some() {
                self.qs.expiring.insert(id);
            }
            // A policy asks for at-least-once dead-lettering the queue cannot do: RabbitMQ's
            // warning, as a declare with those arguments gets it (the gateway logs that one).
            if super::dlx::NOTICES
                && let Some(text) = crate::queue_args::dead_letter_warning(&merged)
                && crate::queue_args::dead_letter_warning(q.arguments()) != Some(text)
            {
                let n = super::Notice::DeadLetterFallback {
                    vhost: self.topo.vhost_name_arc(q.vhost),
                    queue: q.name.clone(),
                    text,
                };
                self.notice(n);
            }
            if let Some(q) = self.qs.queues.get_mut(&id) {
                let was = q.at_least_once();
                q.set_args(args, &mut self.qs.last_args);
                if was != q.at_least_once() {
                    switched.push(id);
                }
            }
            touched.push(id);
        }
        for id in switched {
            self.switch_dead_letter_strategy(id);
        }
        for id in touched {
            self.with_queue(id, |q, io| q.drop_overflow(io));
            self.expire_head(id);
            self.dispatch(id);
        }
        self.topo.apply_exchange_policies();
        self.after_op();
    }
}
