//! Setting and clearing policies at runtime: every existing queue and exchange gets its
//! effective settings recomputed at once (no redeclare), and stores keep the policies.

use super::Broker;
use crate::ids::QueueId;
use crate::policy::{self, Policy, PolicyDef};
use crate::store::DefinitionChange;

impl Broker {
    /// Adds or replaces a policy; the error says why it is refused.
    pub fn set_policy(&mut self, now: u64, def: PolicyDef) -> Result<(), String> {
        self.now = self.now.max(now);
        let compiled = Policy::new(def)?;
        if !self.restoring
            && let Some(store) = self.store.as_mut()
        {
            if store
                .define(DefinitionChange::PolicySet(&compiled.def))
                .is_err()
            {
                self.store_failed_at = Some(self.now);
            }
            self.sync_dirty = true;
        }
        self.policies.insert(compiled.def.name.clone(), compiled);
        self.apply_policies();
        Ok(())
    }

    /// Removes a policy; the error names a missing one.
    pub fn clear_policy(&mut self, now: u64, name: &str) -> Result<(), String> {
        self.now = self.now.max(now);
        if self.policies.remove(name).is_none() {
            return Err(format!(
                "policy '{name}' not found in vhost '{}'",
                self.vhost_name()
            ));
        }
        if let Some(store) = self.store.as_mut() {
            if store.define(DefinitionChange::PolicyCleared(name)).is_err() {
                self.store_failed_at = Some(self.now);
            }
            self.sync_dirty = true;
        }
        self.apply_policies();
        Ok(())
    }

    /// Every policy, by name.
    pub fn list_policies(&self) -> Vec<PolicyDef> {
        self.policies.values().map(|p| p.def.clone()).collect()
    }

    /// The name of the policy applying to a queue of the default vhost, if any (admin tools).
    pub fn queue_policy(&self, queue: &str) -> Option<String> {
        policy::applicable(self.policies.values(), queue, true).map(|p| p.def.name.clone())
    }

    /// Recomputes every queue's and exchange's effective settings from its own arguments
    /// and the policy that applies now; new limits act at once.
    fn apply_policies(&mut self) {
        let ids: Vec<QueueId> = self.queues.keys().copied().collect();
        let mut touched = Vec::new();
        for id in ids {
            let Some(q) = self.queues.get(&id) else {
                continue;
            };
            let merged = policy::queue_arguments(
                &q.arguments,
                policy::applicable(self.policies.values(), &q.name, true),
            );
            // Policies were validated when set; the queue's own arguments when declared.
            let Ok(mut args) = crate::queue::args::QueueArgs::parse(&merged) else {
                continue;
            };
            // The priority levels are the queue's shape: only its own argument sets them.
            args.max_priority = q.args.max_priority;
            if args == q.args {
                continue;
            }
            if args.message_ttl.is_some() || args.expires.is_some() {
                self.expiring.insert(id);
            }
            if let Some(q) = self.queues.get_mut(&id) {
                q.args = args;
            }
            touched.push(id);
        }
        for id in touched {
            self.drop_overflow(id);
            self.expire_head(id);
            self.dispatch(id);
        }
        let exchanges: Vec<_> = self.exchanges.keys().copied().collect();
        for id in exchanges {
            let Some(x) = self.exchanges.get(&id) else {
                continue;
            };
            let own = x
                .arguments
                .get("alternate-exchange")
                .and_then(|v| v.as_str())
                .map(str::to_string);
            let alternate = policy::alternate_exchange(
                own.as_deref(),
                policy::applicable(self.policies.values(), &x.name, false),
            );
            if let Some(x) = self.exchanges.get_mut(&id) {
                x.alternate = alternate;
            }
        }
        self.route_dead_letters();
        self.update_alarm();
    }
}
