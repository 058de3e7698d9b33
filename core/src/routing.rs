//! The routing table: an immutable snapshot of what routing reads (each vhost's exchange and
//! queue names, every exchange's bindings, alternate exchange and `internal` flag).
//!
//! The broker owns one `Arc<RouteTable>` and is the only writer: every change to routing goes
//! through [`crate::Broker::routes`]'s mutators, which bump [`RouteTable::version`]. A host
//! may clone the `Arc` (O(1)) and route publishes on other threads, before they reach the
//! broker (`Publish::routed`). Every map inside is persistent ([`PMap`], [`Router`]), so the
//! broker's next change copies only its own path, never the table, whatever snapshots live.
//!
//! Consistency (the broker enforces it, hosts need not): a pre-routed publish is used only if
//! its table is at least as new as the last routing change made by its own connection, so a
//! client always sees its own binds and declares; other clients' changes are concurrent with
//! it unless it learned of them through a reply, and hosts publish a new table before they
//! send the replies of the turn that changed it.

use crate::exchange::Router;
use crate::ids::{Destination, ExchangeId, QueueId, VhostId};
use crate::message::FieldTable;
use crate::pmap::PMap;
use std::sync::Arc;

/// Exchange-to-exchange hops one publish may take: bounds routing work on deep graphs
/// (cycles are cut by the visited set anyway).
const MAX_ROUTE_EXCHANGES: usize = 1024;

/// See the module docs.
#[derive(Clone, Default, Debug)]
pub struct RouteTable {
    version: u64,
    /// Names map to the raw id (`u64`) in every `PMap` of names, whatever the id's type:
    /// one instantiation of the map's code instead of three (the JS `.wasm` has a size
    /// budget).
    vhost_ids: PMap<Arc<str>, u64>,
    vhosts: PMap<VhostId, VhostRoutes>,
    exchanges: PMap<ExchangeId, ExchangeRoute>,
}

/// One vhost's names.
#[derive(Clone, Default, Debug)]
struct VhostRoutes {
    exchanges: PMap<Arc<str>, u64>,
    /// Queue names: the default exchange's implicit bindings.
    queues: PMap<Arc<str>, u64>,
}

#[derive(Clone, Debug)]
struct ExchangeRoute {
    vhost: VhostId,
    internal: bool,
    /// The effective alternate exchange (own argument or policy), by name: it may be
    /// declared after this exchange.
    alternate: Option<Arc<str>>,
    /// `None`: the default exchange, which routes to the queue named by the routing key.
    router: Option<Router>,
    /// An `x-delayed-message` exchange's facts (docs/delayed.md).
    delayed: Option<Delayed>,
}

/// The exchange type of delayed exchanges (the community plugin's name).
pub const DELAYED_TYPE: &str = "x-delayed-message";

/// What a delayed exchange (type `x-delayed-message`) adds to routing: a publish with an
/// `x-delay` is scheduled on it, and these are its limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Delayed {
    /// It survives a restart: so do its persistent scheduled messages.
    pub durable: bool,
    /// `x-max-scheduled`: at most this many messages scheduled on it (per shard).
    pub max_scheduled: Option<u64>,
    /// `x-overflow: reject-publish`: a publish over the limit is nacked (dropped without
    /// confirms) instead of closing the channel with 406.
    pub reject_publish: bool,
}

/// What a host may route before the broker sees a publish: the exchange it was routed
/// through, the table version, and every queue reached.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Routed {
    /// The table's version it was routed on.
    pub version: u64,
    /// The exchange it was published to.
    pub exchange: ExchangeId,
    /// The queues it reaches.
    pub queues: Vec<QueueId>,
}

impl RouteTable {
    /// Bumped by every change; a snapshot with a higher version saw every change a lower one
    /// saw.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// The vhost named `name`.
    pub fn vhost(&self, name: &str) -> Option<VhostId> {
        self.vhost_ids.get(name).copied().map(VhostId)
    }

    /// The exchange `name` in `vhost`.
    pub fn exchange(&self, vhost: VhostId, name: &str) -> Option<ExchangeId> {
        self.vhosts
            .get(&vhost)?
            .exchanges
            .get(name)
            .copied()
            .map(ExchangeId)
    }

    /// The queue `name` in `vhost`.
    pub fn queue(&self, vhost: VhostId, name: &str) -> Option<QueueId> {
        self.vhosts
            .get(&vhost)?
            .queues
            .get(name)
            .copied()
            .map(QueueId)
    }

    /// Exchange `id`'s vhost, and whether it is internal (clients may not publish to it).
    pub(crate) fn exchange_facts(&self, id: ExchangeId) -> Option<(VhostId, bool)> {
        self.exchanges.get(&id).map(|x| (x.vhost, x.internal))
    }

    /// Whether exchange `id` is a topic exchange (topic permissions apply to those only).
    pub fn is_topic(&self, id: ExchangeId) -> bool {
        self.exchanges
            .get(&id)
            .and_then(|x| x.router.as_ref())
            .is_some_and(crate::exchange::Router::is_topic)
    }

    /// Routes a publish to exchange `name` of `vhost` as the broker would, for a host that
    /// routes outside it. `None` when the broker must see the publish unrouted (no such
    /// exchange, or an internal one: the broker reports the error).
    pub fn route_publish(
        &self,
        vhost: VhostId,
        name: &str,
        routing_key: &str,
        headers: Option<&FieldTable>,
    ) -> Option<Routed> {
        self.route_publish_keyed(vhost, name, routing_key, headers)
            .map(|(routed, _)| routed)
    }

    /// As [`RouteTable::route_publish`], and whether the result depended on `headers` (a
    /// headers exchange on the way). One that did not holds for every publish to the same
    /// exchange name and routing key on this table (same version): a host may reuse it.
    pub fn route_publish_keyed(
        &self,
        vhost: VhostId,
        name: &str,
        routing_key: &str,
        headers: Option<&FieldTable>,
    ) -> Option<(Routed, bool)> {
        let exchange = self.exchange(vhost, name)?;
        if self.exchanges.get(&exchange)?.internal {
            return None;
        }
        let mut read_headers = false;
        let queues = self.route_reading(exchange, routing_key, headers, &mut read_headers);
        Some((
            Routed {
                version: self.version,
                exchange,
                queues,
            },
            read_headers,
        ))
    }

    /// Every queue a message published to `exchange` reaches, each once, in id order:
    /// follows exchange-to-exchange bindings (cycles cut) and alternate exchanges.
    pub fn route(
        &self,
        exchange: ExchangeId,
        routing_key: &str,
        headers: Option<&FieldTable>,
    ) -> Vec<QueueId> {
        self.route_reading(exchange, routing_key, headers, &mut false)
    }

    /// [`RouteTable::route`], setting `read_headers` when a headers exchange was on the way.
    fn route_reading(
        &self,
        exchange: ExchangeId,
        routing_key: &str,
        headers: Option<&FieldTable>,
        read_headers: &mut bool,
    ) -> Vec<QueueId> {
        let mut queues = Vec::new();
        // The exchanges reached through bindings or as alternates, and those left to route
        // through: empty (no allocation) in the usual case of one exchange, on every
        // publish's path.
        let mut visited: Vec<ExchangeId> = Vec::new();
        let mut work = Vec::new();
        let mut matched = Vec::new();
        let mut first = Some(exchange);
        while let Some(id) = first.take().or_else(|| work.pop()) {
            let Some(x) = self.exchanges.get(&id) else {
                continue;
            };
            matched.clear();
            match &x.router {
                Some(router) => {
                    *read_headers |= router.reads_headers();
                    router.route(routing_key, headers, &mut matched);
                }
                None => {
                    if let Some(q) = self.queue(x.vhost, routing_key) {
                        matched.push(Destination::Queue(q));
                    }
                }
            }
            if matched.is_empty()
                && let Some(ae) = x
                    .alternate
                    .as_deref()
                    .and_then(|name| self.exchange(x.vhost, name))
            {
                matched.push(Destination::Exchange(ae));
            }
            for d in &matched {
                match *d {
                    Destination::Queue(q) => queues.push(q),
                    Destination::Exchange(next) => {
                        if next != exchange
                            && !visited.contains(&next)
                            && visited.len() + 1 < MAX_ROUTE_EXCHANGES
                        {
                            visited.push(next);
                            work.push(next);
                        }
                    }
                }
            }
        }
        queues.sort_unstable();
        queues.dedup();
        queues
    }

    // The broker's mutators. Each is called through `Broker::routes_mut`, which bumps the
    // version once per change.

    pub(crate) fn bump(&mut self) {
        self.version += 1;
    }

    pub(crate) fn add_vhost(&mut self, id: VhostId, name: Arc<str>) {
        self.vhost_ids.insert(name, id.0);
        self.vhosts.insert(id, VhostRoutes::default());
    }

    /// Forgets a vhost and its names (its exchanges are removed one by one before).
    pub(crate) fn remove_vhost(&mut self, id: VhostId, name: &str) {
        self.vhost_ids.remove(name);
        self.vhosts.remove(&id);
    }

    pub(crate) fn add_exchange(
        &mut self,
        id: ExchangeId,
        vhost: VhostId,
        name: Arc<str>,
        internal: bool,
        alternate: Option<&str>,
        router: Option<Router>,
    ) {
        if let Some(v) = self.vhosts.get_mut(&vhost) {
            v.exchanges.insert(name, id.0);
        }
        self.exchanges.insert(
            id,
            ExchangeRoute {
                vhost,
                internal,
                alternate: alternate.map(Arc::from),
                router,
                delayed: None,
            },
        );
    }

    /// Makes exchange `id` a delayed one.
    pub(crate) fn set_delayed(&mut self, id: ExchangeId, delayed: Delayed) {
        if let Some(x) = self.exchanges.get_mut(&id) {
            x.delayed = Some(delayed);
        }
    }

    /// Exchange `id`'s facts if it is a delayed exchange (`x-delayed-message`).
    pub fn delayed(&self, id: ExchangeId) -> Option<Delayed> {
        self.exchanges.get(&id).and_then(|x| x.delayed)
    }

    pub(crate) fn remove_exchange(&mut self, id: ExchangeId, name: &str) {
        if let Some(x) = self.exchanges.remove(&id)
            && let Some(v) = self.vhosts.get_mut(&x.vhost)
        {
            v.exchanges.remove(name);
        }
    }

    /// After a binding change: the exchange's new router snapshot.
    pub(crate) fn set_router(&mut self, id: ExchangeId, router: Router) {
        if let Some(x) = self.exchanges.get_mut(&id)
            && x.router.is_some()
        {
            x.router = Some(router);
        }
    }

    pub(crate) fn set_alternate(&mut self, id: ExchangeId, alternate: Option<&str>) {
        if let Some(x) = self.exchanges.get_mut(&id) {
            x.alternate = alternate.map(Arc::from);
        }
    }

    pub(crate) fn add_queue(&mut self, vhost: VhostId, name: Arc<str>, id: QueueId) {
        if let Some(v) = self.vhosts.get_mut(&vhost) {
            v.queues.insert(name, id.0);
        }
    }

    pub(crate) fn remove_queue(&mut self, vhost: VhostId, name: &str) {
        if let Some(v) = self.vhosts.get_mut(&vhost) {
            v.queues.remove(name);
        }
    }
}
