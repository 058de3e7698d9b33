//! Topology: vhosts, users and permissions, policies, exchanges and their bindings, and the
//! routing table (`routing.rs`) that publishes them to hosts.
//!
//! It is one of the three kinds of state machine the broker composes (with
//! `queue::state::QueueState` and `channel::ChannelState`): of a queue it knows only what
//! binding it and routing to it need (`QueueEntry`: its name, vhost, exclusive owner and
//! whether its bindings are stored, all fixed for the queue's life, and the exchanges that
//! bind it), and never touches its messages, consumers or channels. So a bind is decided
//! here alone: with shards, by shard 0 without asking the queue's owner. Definitions to
//! store come back to the caller as return values.
//!
//! Invariants:
//! - Every change to what routing reads goes through `routes_mut` (copy on write of a
//!   shared snapshot plus a version bump), so a host never sees a half-made change.
//! - `bound_from` of an exchange or of a queue entry counts exactly the bindings exchanges
//!   hold to it (deletion finds them without a scan).
//! - Every binding's destination exists: removing a queue (`remove_queue`) or an exchange
//!   removes the bindings to it in the same call.
//! - A queue in the directory is either routable (in the routing table) or being created
//!   (`creating`: reserved, its owner has not confirmed it), never both.
//! - Deleting an exchange removes every binding from and to it; auto-delete exchanges left
//!   without bindings go too, through a worklist (bounded by the number of exchanges).

use crate::access::{Users, VhostDef};
use crate::command::{ExchangeDeclare, ExchangeKind};
use crate::exchange::{Bindings, Counts};
use crate::idhash::IdMap;
use crate::ids::{ConnId, Destination, ExchangeId, QueueId, VhostId};
use crate::message::FieldTable;
use crate::policy::{Policy, PolicyDef};
use crate::routing::RouteTable;
use std::collections::BTreeMap;
use std::sync::Arc;

pub(crate) struct Exchange {
    pub(crate) vhost: VhostId,
    pub(crate) name: Arc<str>,
    pub(crate) kind: ExchangeKind,
    pub(crate) durable: bool,
    pub(crate) auto_delete: bool,
    pub(crate) internal: bool,
    pub(crate) arguments: FieldTable,
    /// The routing half lives in `Topology::routes` too (a snapshot of
    /// `bindings.router()`, refreshed by every change), with the effective alternate
    /// exchange.
    pub(crate) bindings: Bindings,
    /// Exchanges with bindings to this one, and how many.
    pub(crate) bound_from: Counts<ExchangeId>,
    /// An `x-delayed-message` exchange (`kind` is its `x-delayed-type`): its limits.
    pub(crate) delayed: Option<crate::routing::Delayed>,
}

impl Exchange {
    /// The exchange's own `alternate-exchange` argument (a policy's is not part of it).
    pub(crate) fn own_alternate(&self) -> Option<&str> {
        self.arguments
            .get("alternate-exchange")
            .and_then(|v| v.as_str())
    }
}

/// What topology knows of a queue (see the module docs).
pub(crate) struct QueueEntry {
    pub(crate) vhost: VhostId,
    pub(crate) name: Arc<str>,
    /// The connection that declared it exclusive: only it may bind it.
    pub(crate) exclusive_owner: Option<ConnId>,
    /// Its bindings are stored: it is durable and not exclusive (RabbitMQ stores a binding
    /// only between durable entities, and an exclusive queue dies with its connection).
    pub(crate) stored: bool,
    /// Exchanges with bindings to it, and how many.
    pub(crate) bound_from: Counts<ExchangeId>,
}

/// A vhost: its name and policies (the names of its exchanges and queues are in the
/// routing table).
pub(crate) struct Vhost {
    pub(crate) name: Arc<str>,
    pub(crate) description: String,
    /// Policies by name.
    pub(crate) policies: BTreeMap<String, Policy>,
    /// Runtime parameters by (component, name).
    pub(crate) parameters: BTreeMap<(String, String), crate::parameter::ParameterDef>,
    /// MQTT retained messages by topic (`Op::Retain`): the vhost's, so they go with it.
    pub(crate) retained: crate::mqtt::RetainedTopics,
}

/// What a binding change did to the binding set of its source.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BindChange {
    /// The binding was there already (add), or was not (remove).
    Unchanged,
    Added,
    /// Removed; `emptied`: the source is auto-delete and has no binding left, so it must go.
    Removed {
        emptied: bool,
    },
}

/// See the module docs.
pub(crate) struct Topology {
    vhosts: IdMap<VhostId, Vhost>,
    vhost_ids: BTreeMap<Arc<str>, VhostId>,
    /// The vhost of `BrokerConfig::default_vhost` as created at start (internal connections
    /// that name no vhost use it).
    pub(crate) default_vhost: VhostId,
    pub(crate) users: Users,
    exchanges: IdMap<ExchangeId, Exchange>,
    queues: IdMap<QueueId, QueueEntry>,
    /// Queues in the directory whose owner has not confirmed them yet: named (a declare of
    /// the name goes to them) but not routable. At most one per channel with a declare out,
    /// and one at a time without shards, so a scan (and no map type of its own: the wasm
    /// build is size-bounded).
    creating: Vec<QueueId>,
    /// What routing reads, shared with hosts as immutable snapshots.
    routes: Arc<RouteTable>,
    /// On a shard other than 0: shard 0's table, which its channels route on and resolve
    /// names through. This shard's own topology stays its own (`routes`): an admin change
    /// applied here too (a vhost deleted) never touches the adopted table.
    adopted: Option<Arc<RouteTable>>,
}

/// The exchanges every vhost has: (name, kind, internal).
const PREDEFINED: [(&str, ExchangeKind, bool); 7] = [
    ("", ExchangeKind::Direct, false),
    ("amq.direct", ExchangeKind::Direct, false),
    ("amq.fanout", ExchangeKind::Fanout, false),
    ("amq.topic", ExchangeKind::Topic, false),
    ("amq.headers", ExchangeKind::Headers, false),
    ("amq.match", ExchangeKind::Headers, false),
    ("amq.rabbitmq.trace", ExchangeKind::Topic, true),
];

impl Topology {
    pub(crate) fn new() -> Topology {
        Topology {
            vhosts: IdMap::default(),
            vhost_ids: BTreeMap::new(),
            default_vhost: VhostId(0),
            users: Users::new(),
            exchanges: IdMap::default(),
            queues: IdMap::default(),
            creating: Vec::new(),
            routes: Arc::default(),
            adopted: None,
        }
    }

    /// The routing table channels route on: shard 0's, on another shard.
    pub(crate) fn routes(&self) -> &Arc<RouteTable> {
        self.adopted.as_ref().unwrap_or(&self.routes)
    }

    /// Shard 0's table, on another shard (see `Broker::adopt_routes`); true if it is newer
    /// than the one adopted before (an older one is ignored).
    pub(crate) fn adopt_routes(&mut self, routes: Arc<RouteTable>) -> bool {
        if self
            .adopted
            .as_ref()
            .is_some_and(|a| a.version() >= routes.version())
        {
            return false;
        }
        self.adopted = Some(routes);
        true
    }

    /// The routing table for a change: copied first if a snapshot shares it (O(1): its maps
    /// are persistent), and its version bumped. Always this topology's own.
    pub(crate) fn routes_mut(&mut self) -> &mut RouteTable {
        let table = Arc::make_mut(&mut self.routes);
        table.bump();
        table
    }

    /// Refreshes the table's snapshot of exchange `id`'s bindings after they changed.
    fn refresh_router(&mut self, id: ExchangeId) {
        if let Some(router) = self.exchanges.get(&id).map(|x| x.bindings.router()) {
            self.routes_mut().set_router(id, router);
        }
    }

    // ----- vhosts -----

    /// The id of a vhost by name.
    pub(crate) fn vhost_id(&self, name: &str) -> Option<VhostId> {
        self.vhost_ids.get(name).copied()
    }

    /// The name of vhost `id` (empty if it is gone).
    pub(crate) fn vhost_name(&self, id: VhostId) -> &str {
        self.vhosts.get(&id).map_or("", |v| &v.name)
    }

    /// The name of vhost `id` as a shared string (empty if it is gone).
    pub(crate) fn vhost_name_arc(&self, id: VhostId) -> Arc<str> {
        self.vhosts
            .get(&id)
            .map_or_else(|| Arc::from(""), |v| v.name.clone())
    }

    /// Every vhost, by name.
    pub(crate) fn list_vhosts(&self) -> Vec<VhostDef> {
        self.vhost_ids
            .values()
            .filter_map(|id| self.vhosts.get(id))
            .map(|v| VhostDef {
                name: v.name.to_string(),
                description: v.description.clone(),
            })
            .collect()
    }

    /// Creates vhost `id` with its predeclared exchanges, whose ids `next_id` issues.
    pub(crate) fn insert_vhost(
        &mut self,
        id: VhostId,
        def: VhostDef,
        mut next_id: impl FnMut() -> u64,
    ) {
        let name: Arc<str> = Arc::from(def.name.as_str());
        debug_assert!(!self.vhost_ids.contains_key(&name), "vhost inserted twice");
        self.vhosts.insert(
            id,
            Vhost {
                name: name.clone(),
                description: def.description,
                policies: BTreeMap::new(),
                parameters: BTreeMap::new(),
                retained: crate::mqtt::RetainedTopics::new(),
            },
        );
        self.vhost_ids.insert(name.clone(), id);
        self.routes_mut().add_vhost(id, name);
        for (name, kind, internal) in PREDEFINED {
            let x = ExchangeId(next_id());
            self.exchanges.insert(
                x,
                Exchange {
                    vhost: id,
                    name: Arc::from(name),
                    kind,
                    durable: true,
                    auto_delete: false,
                    internal,
                    arguments: FieldTable::new(),
                    bindings: Bindings::new(kind),
                    bound_from: Default::default(),
                    delayed: None,
                },
            );
            // The default exchange routes by queue name, through the table's queue map.
            let router = (!name.is_empty()).then(|| Bindings::new(kind).router());
            self.routes_mut()
                .add_exchange(x, id, Arc::from(name), internal, None, router);
        }
    }

    /// Forgets vhost `id`, which must hold no exchanges any more; returns its policies'
    /// names and its parameters' (component, name) (for the store).
    pub(crate) fn remove_vhost(&mut self, id: VhostId) -> (Vec<String>, Vec<(String, String)>) {
        debug_assert!(
            self.exchanges.values().all(|x| x.vhost != id),
            "vhost removed with exchanges"
        );
        let Some(v) = self.vhosts.remove(&id) else {
            return (Vec::new(), Vec::new());
        };
        self.vhost_ids.remove(&v.name);
        self.users.forget_vhost(&v.name);
        self.routes_mut().remove_vhost(id, &v.name);
        (
            v.policies.into_keys().collect(),
            v.parameters.into_keys().collect(),
        )
    }

    /// The MQTT retained messages of vhost `id` (`None` if it is gone).
    pub(crate) fn retained_mut(&mut self, id: VhostId) -> Option<&mut crate::mqtt::RetainedTopics> {
        self.vhosts.get_mut(&id).map(|v| &mut v.retained)
    }

    /// Every vhost's retained messages: (vhost, messages, payload bytes), by vhost name.
    pub(crate) fn retained_stats(&self) -> Vec<(String, u64, u64)> {
        self.vhost_ids
            .iter()
            .filter_map(|(name, id)| Some((name, &self.vhosts.get(id)?.retained)))
            .map(|(name, r)| (name.to_string(), r.len() as u64, r.bytes()))
            .collect()
    }

    // ----- runtime parameters -----

    /// Vhost `vh`'s parameters (`None` if it is gone).
    pub(crate) fn parameters_mut(
        &mut self,
        vh: VhostId,
    ) -> Option<&mut BTreeMap<(String, String), crate::parameter::ParameterDef>> {
        self.vhosts.get_mut(&vh).map(|v| &mut v.parameters)
    }

    /// Every parameter, by vhost, component and name.
    pub(crate) fn list_parameters(&self) -> Vec<crate::parameter::ParameterDef> {
        self.vhost_ids
            .values()
            .filter_map(|id| self.vhosts.get(id))
            .flat_map(|v| v.parameters.values().cloned())
            .collect()
    }

    // ----- policies -----

    /// Adds or replaces a policy of vhost `vh`.
    pub(crate) fn set_policy(&mut self, vh: VhostId, policy: Policy) {
        if let Some(v) = self.vhosts.get_mut(&vh) {
            v.policies.insert(policy.def.name.clone(), policy);
        }
    }

    /// Removes a policy; whether it existed.
    pub(crate) fn clear_policy(&mut self, vh: VhostId, name: &str) -> bool {
        self.vhosts
            .get_mut(&vh)
            .and_then(|v| v.policies.remove(name))
            .is_some()
    }

    /// Every policy, by vhost and name.
    pub(crate) fn list_policies(&self) -> Vec<PolicyDef> {
        self.vhost_ids
            .values()
            .filter_map(|id| self.vhosts.get(id))
            .flat_map(|v| v.policies.values().map(|p| p.def.clone()))
            .collect()
    }

    /// The policy that applies to queue (`queue`) or exchange `name` in vhost `vh`.
    pub(crate) fn policy(&self, vh: VhostId, name: &str, queue: bool) -> Option<&Policy> {
        self.vhosts
            .get(&vh)
            .and_then(|v| crate::policy::applicable(v.policies.values(), name, queue))
    }

    /// Recomputes every exchange's effective alternate exchange (its own argument, else
    /// its policy's) after the policies changed.
    pub(crate) fn apply_exchange_policies(&mut self) {
        let mut changes = Vec::new();
        for (&id, x) in self.exchanges.iter() {
            let policy = self.policy(x.vhost, &x.name, false);
            let alternate = crate::policy::alternate_exchange(x.own_alternate(), policy);
            changes.push((id, alternate));
        }
        // Id order: the table's version history does not depend on hash order.
        changes.sort_unstable_by_key(|(id, _)| *id);
        for (id, alternate) in changes {
            self.routes_mut().set_alternate(id, alternate.as_deref());
        }
    }

    // ----- exchanges -----

    /// The exchange `name` in vhost `vh`, if it exists.
    pub(crate) fn find_exchange(&self, vh: VhostId, name: &str) -> Option<ExchangeId> {
        self.routes().exchange(vh, name)
    }

    /// The queue `name` in vhost `vh`, if it exists.
    pub(crate) fn find_queue(&self, vh: VhostId, name: &str) -> Option<QueueId> {
        self.routes().queue(vh, name)
    }

    pub(crate) fn exchange(&self, id: ExchangeId) -> Option<&Exchange> {
        self.exchanges.get(&id)
    }

    /// Every exchange, in no particular order.
    pub(crate) fn exchanges(&self) -> impl Iterator<Item = (ExchangeId, &Exchange)> {
        self.exchanges.iter().map(|(id, x)| (*id, x))
    }

    pub(crate) fn exchange_count(&self) -> usize {
        self.exchanges.len()
    }

    /// Declares a new exchange `id` in vhost `vh` (the caller checked that the name is
    /// free and allowed); its alternate exchange is its own argument, else its policy's.
    pub(crate) fn add_exchange(
        &mut self,
        id: ExchangeId,
        vh: VhostId,
        kind: ExchangeKind,
        d: ExchangeDeclare,
    ) {
        debug_assert!(self.find_exchange(vh, &d.exchange).is_none());
        let name: Arc<str> = Arc::from(d.exchange.as_str());
        let bindings = Bindings::new(kind);
        let router = bindings.router();
        let delayed = delayed_facts(&d);
        let x = Exchange {
            vhost: vh,
            name: name.clone(),
            kind,
            durable: d.durable,
            auto_delete: d.auto_delete,
            internal: d.internal,
            arguments: d.arguments,
            bindings,
            bound_from: Default::default(),
            delayed,
        };
        let policy = self.policy(vh, &name, false);
        let alternate = crate::policy::alternate_exchange(x.own_alternate(), policy);
        self.exchanges.insert(id, x);
        self.routes_mut().add_exchange(
            id,
            vh,
            name,
            d.internal,
            alternate.as_deref(),
            Some(router),
        );
        if let Some(delayed) = delayed {
            self.routes_mut().set_delayed(id, delayed);
        }
    }

    // ----- queues -----

    /// What topology knows of queue `id`, if it exists.
    pub(crate) fn queue(&self, id: QueueId) -> Option<&QueueEntry> {
        self.queues.get(&id)
    }

    #[cfg(any(test, feature = "testing"))]
    pub(crate) fn queue_count(&self) -> usize {
        self.queues.len()
    }

    /// The queue `name` in vhost `vh`, routable or being created.
    pub(crate) fn find_queue_or_creating(&self, vh: VhostId, name: &str) -> Option<QueueId> {
        self.find_queue(vh, name).or_else(|| {
            self.creating.iter().copied().find(|id| {
                self.queues
                    .get(id)
                    .is_some_and(|q| q.vhost == vh && *q.name == *name)
            })
        })
    }

    /// Adds queue `id` to the directory (the caller checked that its name is free in its
    /// vhost), not routable until `publish_queue`.
    pub(crate) fn reserve_queue(
        &mut self,
        id: QueueId,
        vhost: VhostId,
        name: Arc<str>,
        exclusive_owner: Option<ConnId>,
        stored: bool,
    ) {
        debug_assert!(self.find_queue_or_creating(vhost, &name).is_none());
        self.creating.push(id);
        self.queues.insert(
            id,
            QueueEntry {
                vhost,
                name,
                exclusive_owner,
                stored,
                bound_from: Counts::default(),
            },
        );
    }

    /// Makes reserved queue `id` routable by name through the default exchange; its name,
    /// or `None` if it is not reserved (it went meanwhile).
    pub(crate) fn publish_queue(&mut self, id: QueueId) -> Option<Arc<str>> {
        let (vhost, name) = self.queues.get(&id).map(|q| (q.vhost, q.name.clone()))?;
        if !self.stop_creating(id) {
            return None;
        }
        self.routes_mut().add_queue(vhost, name.clone(), id);
        Some(name)
    }

    /// Takes `id` out of `creating`; whether it was there.
    fn stop_creating(&mut self, id: QueueId) -> bool {
        let Some(i) = self.creating.iter().position(|c| *c == id) else {
            return false;
        };
        self.creating.swap_remove(i);
        true
    }

    /// Removes queue `id`, its name and every binding to it; returns the auto-delete
    /// exchanges left without bindings, which must go.
    pub(crate) fn remove_queue(&mut self, id: QueueId) -> Vec<ExchangeId> {
        let Some(q) = self.queues.remove(&id) else {
            return Vec::new();
        };
        if !self.stop_creating(id) {
            self.routes_mut().remove_queue(q.vhost, &q.name);
        }
        let mut emptied = Vec::new();
        self.unlink(Destination::Queue(id), &q.bound_from, &mut emptied);
        emptied
    }

    /// Removes every binding to `destination` from `sources` (its `bound_from`), adding the
    /// auto-delete sources left without bindings to `emptied`.
    fn unlink(
        &mut self,
        destination: Destination,
        sources: &Counts<ExchangeId>,
        emptied: &mut Vec<ExchangeId>,
    ) {
        for source in sources.keys() {
            if let Some(x) = self.exchanges.get_mut(&source) {
                x.bindings.remove_destination(destination);
                if x.auto_delete && x.bindings.is_empty() {
                    emptied.push(source);
                }
                self.refresh_router(source);
            }
        }
    }

    /// Adds (`add`) or removes one binding from `source` to `destination`, keeping the
    /// destination's `bound_from`.
    pub(crate) fn bind(
        &mut self,
        source: ExchangeId,
        destination: Destination,
        routing_key: &str,
        arguments: &FieldTable,
        add: bool,
    ) -> BindChange {
        let Some(x) = self.exchanges.get_mut(&source) else {
            return BindChange::Unchanged;
        };
        let change = if add {
            if !x.bindings.add(destination, routing_key, arguments) {
                return BindChange::Unchanged;
            }
            BindChange::Added
        } else {
            if !x.bindings.remove(destination, routing_key, arguments) {
                return BindChange::Unchanged;
            }
            BindChange::Removed {
                emptied: x.auto_delete && x.bindings.is_empty(),
            }
        };
        let bound_from = match destination {
            Destination::Exchange(d) => self.exchanges.get_mut(&d).map(|d| &mut d.bound_from),
            Destination::Queue(q) => self.queues.get_mut(&q).map(|q| &mut q.bound_from),
        };
        if let Some(bound_from) = bound_from {
            if add {
                bound_from.increment(source);
            } else {
                bound_from.decrement(source);
            }
        }
        self.refresh_router(source);
        change
    }

    /// Removes exchange `id` with every binding from and to it, and the auto-delete
    /// exchanges that lose their last binding that way. Returns the removed exchanges, in
    /// removal order: the caller stores the deletions.
    pub(crate) fn delete_exchange(&mut self, id: ExchangeId) -> Vec<(ExchangeId, Exchange)> {
        let mut removed = Vec::new();
        let mut work = vec![id];
        while let Some(id) = work.pop() {
            let Some(x) = self.exchanges.remove(&id) else {
                continue;
            };
            self.routes_mut().remove_exchange(id, &x.name);
            for b in x.bindings.list() {
                let bound_from = match b.destination {
                    Destination::Exchange(d) => {
                        self.exchanges.get_mut(&d).map(|d| &mut d.bound_from)
                    }
                    Destination::Queue(q) => self.queues.get_mut(&q).map(|q| &mut q.bound_from),
                };
                if let Some(bound_from) = bound_from {
                    bound_from.decrement(id);
                }
            }
            self.unlink(Destination::Exchange(id), &x.bound_from, &mut work);
            removed.push((id, x));
        }
        removed
    }

    /// Checks the invariants in the module docs.
    #[cfg(any(test, feature = "testing"))]
    pub(crate) fn check_invariants(&self) -> Result<(), String> {
        let mut to_exchanges: BTreeMap<ExchangeId, BTreeMap<ExchangeId, usize>> = BTreeMap::new();
        let mut to_queues: BTreeMap<QueueId, BTreeMap<ExchangeId, usize>> = BTreeMap::new();
        for (&id, x) in self.exchanges.iter() {
            if self.routes.exchange(x.vhost, &x.name) != Some(id) {
                return Err(format!(
                    "exchange {id:?} '{}' not in the routing table",
                    x.name
                ));
            }
            for b in x.bindings.list() {
                let counts = match b.destination {
                    Destination::Exchange(d) => to_exchanges.entry(d).or_default(),
                    Destination::Queue(q) => to_queues.entry(q).or_default(),
                };
                *counts.entry(id).or_default() += 1;
            }
        }
        for (&id, x) in self.exchanges.iter() {
            let expected = counted(&mut to_exchanges, id);
            if x.bound_from.entries() != expected.as_slice() {
                return Err(format!(
                    "exchange {id:?} bound_from {:?} but bindings say {expected:?}",
                    x.bound_from.entries()
                ));
            }
        }
        for id in &self.creating {
            if !self.queues.contains_key(id) {
                return Err(format!(
                    "queue {id:?} being created is not in the directory"
                ));
            }
        }
        for (&id, q) in self.queues.iter() {
            let creating = self.creating.contains(&id);
            if creating == (self.routes.queue(q.vhost, &q.name) == Some(id)) {
                return Err(format!(
                    "queue {id:?} '{}' must be either routable or being created",
                    q.name
                ));
            }
            let expected = counted(&mut to_queues, id);
            if q.bound_from.entries() != expected.as_slice() {
                return Err(format!(
                    "queue {id:?} bound_from {:?} but bindings say {expected:?}",
                    q.bound_from.entries()
                ));
            }
        }
        if let Some((d, _)) = to_exchanges.first_key_value() {
            return Err(format!("a binding to missing exchange {d:?}"));
        }
        if let Some((q, _)) = to_queues.first_key_value() {
            return Err(format!("a binding to missing queue {q:?}"));
        }
        Ok(())
    }
}

/// The (source, count) pairs counted for `id`, ascending, leaving them out of `counts`.
#[cfg(any(test, feature = "testing"))]
fn counted<K: Ord>(
    counts: &mut BTreeMap<K, BTreeMap<ExchangeId, usize>>,
    id: K,
) -> Vec<(ExchangeId, usize)> {
    counts
        .remove(&id)
        .map(|m| m.into_iter().collect())
        .unwrap_or_default()
}

/// The facts of a declare of type `x-delayed-message` (already validated), or `None`.
fn delayed_facts(d: &ExchangeDeclare) -> Option<crate::routing::Delayed> {
    (d.kind == crate::routing::DELAYED_TYPE).then(|| crate::routing::Delayed {
        durable: d.durable,
        max_scheduled: d
            .arguments
            .get("x-max-scheduled")
            .and_then(|v| v.as_i64())
            .and_then(|n| u64::try_from(n).ok()),
        reject_publish: d
            .arguments
            .get("x-overflow")
            .and_then(|v| v.as_str())
            .is_some_and(|s| s == "reject-publish"),
    })
}
