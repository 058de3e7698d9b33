//! A [`Store`] in memory: for WebAssembly hosts without a file system, and for simulation
//! tests, which use its crash model: [`MemoryStore::crash`] forgets everything not covered by
//! a completed sync, as a power cut would.
//!
//! Clones share one state, so a test keeps a handle while the broker owns another.

use super::{DefinitionChange, Definitions, QueueRecovery, Store, StoreError, StoredMessage};
use crate::idhash::IdMap;
use crate::ids::QueueId;
use crate::message::Message;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

/// A stored message: (message, survived a restart, expiry).
type Entry = (Arc<Message>, bool, Option<u64>);
/// A queue: (vhost, name).
type QueueKey = (String, String);

#[derive(Clone, Debug, Default)]
struct State {
    definitions: Definitions,
    /// Messages by (vhost, queue name), then sequence number.
    queues: BTreeMap<QueueKey, BTreeMap<u64, Entry>>,
    /// Queues opened as durable here: with shards, a shard's store keeps the messages of
    /// its durable queues while their definitions are shard 0's (in another store).
    durable_queues: std::collections::BTreeSet<QueueKey>,
    /// Streams by (vhost, name): durable, synced like everything else.
    streams: BTreeMap<QueueKey, super::MemLog>,
    /// Queues whose transient messages survive a crash too (`Store::keep_every_message`).
    keep_all: std::collections::BTreeSet<QueueKey>,
    /// Scheduled messages by key (`Store::schedule_add`).
    schedule: BTreeMap<super::ScheduleKey, super::ScheduledMessage>,
}

#[derive(Debug, Default)]
struct Inner {
    live: State,
    /// The state as of the sync in progress (taken when it started).
    syncing: Option<(u64, State)>,
    /// The state as of the last completed sync: what survives a crash.
    durable: State,
    open: IdMap<QueueId, (QueueKey, bool)>,
    /// Streams opened, by the core's id.
    open_streams: IdMap<QueueId, QueueKey>,
    /// When set, appends fail (disk-full simulation).
    fail_appends: bool,
}

/// See the module docs.
#[derive(Clone, Debug, Default)]
pub struct MemoryStore {
    inner: Arc<Mutex<Inner>>,
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> MemoryStore {
        MemoryStore::default()
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock can only come from a bug in this file; the state is
        // plain data, so carrying on with it is safe.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The epoch of the sync in progress, if any: the host completes it with
    /// [`MemoryStore::complete_sync`] and then tells the broker.
    pub fn sync_in_progress(&self) -> Option<u64> {
        self.lock().syncing.as_ref().map(|(e, _)| *e)
    }

    /// Completes the sync in progress: its writes survive a crash from now on.
    pub fn complete_sync(&self) -> Option<u64> {
        let mut inner = self.lock();
        let (epoch, state) = inner.syncing.take()?;
        inner.durable = state;
        Some(epoch)
    }

    /// A crash: everything not covered by a completed sync is lost; recovered messages are
    /// flagged as possibly delivered.
    pub fn crash(&self) {
        let mut inner = self.lock();
        let mut state = inner.durable.clone();
        let durable: std::collections::BTreeSet<QueueKey> = state
            .definitions
            .queues
            .iter()
            .map(|(v, q)| (v.clone(), q.queue.clone()))
            .chain(state.durable_queues.iter().cloned())
            .collect();
        // Transient queues and what they paged out do not survive.
        state.queues.retain(|name, _| durable.contains(name));
        for (name, q) in state.queues.iter_mut() {
            for (_, recovered, _) in q.values_mut() {
                *recovered = true;
            }
            // Transient messages paged out by a durable queue do not survive (a quorum
            // queue's do).
            let keep_all = state.keep_all.contains(name);
            q.retain(|_, (m, _, _)| keep_all || m.properties.is_persistent());
        }
        // Scheduled messages that do not survive a restart are gone with it.
        state.schedule.retain(|_, m| m.durable);
        inner.live = state.clone();
        inner.durable = state;
        inner.syncing = None;
        inner.open = IdMap::default();
        inner.open_streams = IdMap::default();
    }

    /// The durable definitions, as a host loads them at start-up.
    pub fn definitions(&self) -> Definitions {
        self.lock().live.definitions.clone()
    }

    /// Makes appends fail (or succeed again), as a full disk would.
    pub fn set_fail_appends(&self, fail: bool) {
        self.lock().fail_appends = fail;
    }

    /// Scheduled messages stored (tests).
    pub fn scheduled(&self) -> usize {
        self.lock().live.schedule.len()
    }

    /// Messages stored for a queue of vhost `/` (tests).
    pub fn stored(&self, name: &str) -> usize {
        self.lock()
            .live
            .queues
            .get(&("/".to_string(), name.to_string()))
            .map_or(0, |q| q.len())
    }
}

fn same_bind(a: &crate::command::Bind, b: &crate::command::Bind) -> bool {
    a.source == b.source
        && a.destination == b.destination
        && a.routing_key == b.routing_key
        && a.arguments == b.arguments
}

impl Store for MemoryStore {
    fn schedule_add(&mut self, m: &super::ScheduledMessage) -> Result<(), StoreError> {
        let mut inner = self.lock();
        if inner.fail_appends {
            return Err(StoreError("appends fail (simulated)".into()));
        }
        inner.live.schedule.insert(m.key, m.clone());
        Ok(())
    }

    fn schedule_remove(&mut self, key: super::ScheduleKey) {
        self.lock().live.schedule.remove(&key);
    }

    fn schedule_read(
        &mut self,
        after: Option<super::ScheduleKey>,
        max: usize,
        out: &mut Vec<super::ScheduledMessage>,
    ) -> Result<(), StoreError> {
        use std::ops::Bound::{Excluded, Unbounded};
        let inner = self.lock();
        let from = after.map_or(Unbounded, Excluded);
        out.extend(
            inner
                .live
                .schedule
                .range((from, Unbounded))
                .take(max)
                .map(|(_, m)| m.clone()),
        );
        Ok(())
    }

    fn schedule_purge(&mut self, vhost: &str, exchange: &str) -> u64 {
        let mut inner = self.lock();
        let before = inner.live.schedule.len();
        inner
            .live
            .schedule
            .retain(|_, m| &*m.vhost != vhost || &*m.exchange != exchange);
        (before - inner.live.schedule.len()) as u64
    }

    fn schedule_recover(&mut self) -> super::ScheduleRecovery {
        let inner = self.lock();
        let mut counts: BTreeMap<(String, String), u64> = BTreeMap::new();
        for m in inner.live.schedule.values() {
            *counts
                .entry((m.vhost.to_string(), m.exchange.to_string()))
                .or_default() += 1;
        }
        super::ScheduleRecovery {
            next_id: inner
                .live
                .schedule
                .keys()
                .map(|k| k.id + 1)
                .max()
                .unwrap_or(1),
            counts: counts.into_iter().map(|((v, x), n)| (v, x, n)).collect(),
        }
    }

    fn define(&mut self, change: DefinitionChange<'_>) -> Result<(), StoreError> {
        let mut inner = self.lock();
        let defs = &mut inner.live.definitions;
        match change {
            DefinitionChange::VhostAdded(v) => {
                defs.vhosts.retain(|x| x.name != v.name);
                defs.vhosts.push(v.clone());
            }
            DefinitionChange::VhostDeleted(name) => {
                defs.vhosts.retain(|x| x.name != name);
                defs.topic_permissions.retain(|x| x.vhost != name);
            }
            DefinitionChange::UserPut(u) => {
                defs.users.retain(|x| x.name != u.name);
                defs.users.push(u.clone());
            }
            DefinitionChange::UserDeleted(name) => {
                defs.users.retain(|x| x.name != name);
                defs.permissions.retain(|p| p.user != name);
                defs.topic_permissions.retain(|p| p.user != name);
            }
            DefinitionChange::PermissionSet(p) => {
                defs.permissions
                    .retain(|x| !(x.vhost == p.vhost && x.user == p.user));
                defs.permissions.push(p.clone());
            }
            DefinitionChange::PermissionCleared { vhost, user } => {
                defs.permissions
                    .retain(|x| !(x.vhost == vhost && x.user == user));
            }
            DefinitionChange::TopicPermissionSet(p) => {
                defs.topic_permissions.retain(|x| {
                    !(x.vhost == p.vhost && x.user == p.user && x.exchange == p.exchange)
                });
                defs.topic_permissions.push(p.clone());
            }
            DefinitionChange::TopicPermissionCleared {
                vhost,
                user,
                exchange,
            } => {
                defs.topic_permissions.retain(|x| {
                    !(x.vhost == vhost
                        && x.user == user
                        && exchange.is_none_or(|e| e == x.exchange))
                });
            }
            DefinitionChange::ExchangeDeclared { vhost, def } => {
                defs.exchanges
                    .retain(|(v, x)| !(v == vhost && x.exchange == def.exchange));
                defs.exchanges.push((vhost.to_string(), def.clone()));
            }
            DefinitionChange::ExchangeDeleted { vhost, name } => {
                defs.exchanges
                    .retain(|(v, x)| !(v == vhost && x.exchange == name));
                defs.bindings.retain(|(v, b, to_x)| {
                    v != vhost || (b.source != name && !(*to_x && b.destination == name))
                });
            }
            DefinitionChange::QueueDeclared { vhost, def } => {
                defs.queues
                    .retain(|(v, q)| !(v == vhost && q.queue == def.queue));
                defs.queues.push((vhost.to_string(), def.clone()));
            }
            DefinitionChange::QueueDeleted { vhost, name } => {
                defs.queues
                    .retain(|(v, q)| !(v == vhost && q.queue == name));
                defs.bindings
                    .retain(|(v, b, to_x)| v != vhost || *to_x || b.destination != name);
                let key = (vhost.to_string(), name.to_string());
                inner.live.queues.remove(&key);
                inner.live.streams.remove(&key);
            }
            DefinitionChange::Bound {
                vhost,
                bind,
                to_exchange,
            } => {
                if !defs
                    .bindings
                    .iter()
                    .any(|(v, b, x)| v == vhost && *x == to_exchange && same_bind(b, bind))
                {
                    defs.bindings
                        .push((vhost.to_string(), bind.clone(), to_exchange));
                }
            }
            DefinitionChange::PolicySet(p) => {
                defs.policies
                    .retain(|x| !(x.vhost == p.vhost && x.name == p.name));
                defs.policies.push(p.clone());
            }
            DefinitionChange::PolicyCleared { vhost, name } => {
                defs.policies
                    .retain(|x| !(x.vhost == vhost && x.name == name));
            }
            DefinitionChange::ParameterSet(p) => {
                defs.parameters.retain(|x| {
                    !(x.vhost == p.vhost && x.component == p.component && x.name == p.name)
                });
                defs.parameters.push(p.clone());
            }
            DefinitionChange::ParameterCleared {
                vhost,
                component,
                name,
            } => {
                defs.parameters
                    .retain(|x| !(x.vhost == vhost && x.component == component && x.name == name));
            }
            DefinitionChange::Unbound {
                vhost,
                bind,
                to_exchange,
            } => {
                defs.bindings
                    .retain(|(v, b, x)| !(v == vhost && *x == to_exchange && same_bind(b, bind)));
            }
            // A scan per change: this store serves simulations and small wasm hosts.
            DefinitionChange::RetainedSet { vhost, message } => {
                defs.retained
                    .retain(|(v, m)| !(v == vhost && m.topic == message.topic));
                defs.retained.push((vhost.to_string(), message.clone()));
            }
            DefinitionChange::RetainedCleared { vhost, topic } => {
                defs.retained
                    .retain(|(v, m)| !(v == vhost && &*m.topic == topic));
            }
        }
        Ok(())
    }

    fn open_queue(
        &mut self,
        queue: QueueId,
        vhost: &str,
        name: &str,
        durable: bool,
    ) -> QueueRecovery {
        let mut inner = self.lock();
        let key = (vhost.to_string(), name.to_string());
        inner.open.insert(queue, (key.clone(), durable));
        if !durable {
            inner.live.queues.remove(&key);
            return QueueRecovery::default();
        }
        inner.live.durable_queues.insert(key.clone());
        let Some(q) = inner.live.queues.get(&key) else {
            return QueueRecovery::default();
        };
        QueueRecovery {
            count: q.len() as u64,
            bytes: q.values().map(|(m, _, _)| m.body_len() as u64).sum(),
            first_seq: q.keys().next().copied().unwrap_or(0),
            next_seq: q.keys().next_back().map_or(0, |s| s + 1),
        }
    }

    fn append(
        &mut self,
        queue: QueueId,
        seq: u64,
        message: &Arc<Message>,
        expires_at: Option<u64>,
    ) -> Result<(), StoreError> {
        let mut inner = self.lock();
        if inner.fail_appends {
            return Err(StoreError("simulated full disk".into()));
        }
        let Some((name, _)) = inner.open.get(&queue).cloned() else {
            return Err(StoreError(format!("queue {} is not open", queue.0)));
        };
        inner
            .live
            .queues
            .entry(name)
            .or_default()
            .insert(seq, (message.clone(), false, expires_at));
        Ok(())
    }

    fn keep_every_message(&mut self, queue: QueueId) {
        let mut inner = self.lock();
        if let Some((key, _)) = inner.open.get(&queue).cloned() {
            inner.live.keep_all.insert(key);
        }
    }

    fn remove(&mut self, queue: QueueId, seq: u64) {
        let mut inner = self.lock();
        if let Some((name, _)) = inner.open.get(&queue).cloned()
            && let Some(q) = inner.live.queues.get_mut(&name)
        {
            q.remove(&seq);
        }
    }

    fn remove_from(&mut self, queue: QueueId, from_seq: u64) {
        let mut inner = self.lock();
        if let Some((name, _)) = inner.open.get(&queue).cloned()
            && let Some(q) = inner.live.queues.get_mut(&name)
        {
            q.split_off(&from_seq);
        }
    }

    fn read(
        &mut self,
        queue: QueueId,
        from_seq: u64,
        max: usize,
        out: &mut Vec<StoredMessage>,
    ) -> Result<(), StoreError> {
        let inner = self.lock();
        let Some((name, _)) = inner.open.get(&queue) else {
            return Err(StoreError(format!("queue {} is not open", queue.0)));
        };
        if let Some(q) = inner.live.queues.get(name) {
            out.extend(
                q.range(from_seq..)
                    .take(max)
                    .map(|(&seq, (m, recovered, expires_at))| StoredMessage {
                        seq,
                        message: m.clone(),
                        redelivered: *recovered,
                        expires_at: *expires_at,
                    }),
            );
        }
        Ok(())
    }

    fn delete_queue(&mut self, queue: QueueId) {
        let mut inner = self.lock();
        if let Some(key) = inner.open_streams.remove(&queue) {
            inner.live.streams.remove(&key);
        }
        if let Some((name, _)) = inner.open.remove(&queue) {
            inner.live.queues.remove(&name);
            inner.live.durable_queues.remove(&name);
            inner.live.keep_all.remove(&name);
        }
    }

    fn sync(&mut self, epoch: u64) {
        let mut inner = self.lock();
        let snapshot = inner.live.clone();
        inner.syncing = Some((epoch, snapshot));
    }

    fn stream_open(
        &mut self,
        queue: QueueId,
        vhost: &str,
        name: &str,
        settings: &super::StreamSettings,
    ) -> Result<super::StreamBounds, StoreError> {
        let mut inner = self.lock();
        let key = (vhost.to_string(), name.to_string());
        inner.open_streams.insert(queue, key.clone());
        let log = inner
            .live
            .streams
            .entry(key.clone())
            .or_insert_with(|| super::MemLog::new(settings.clone()));
        log.set_settings(settings.clone());
        let bounds = log.bounds();
        Ok(super::StreamBounds {
            committed: Self::committed(&inner, &key),
            ..bounds
        })
    }

    fn stream_append(
        &mut self,
        queue: QueueId,
        data: bytes::Bytes,
        timestamp_ms: u64,
    ) -> Result<(), StoreError> {
        let mut inner = self.lock();
        if inner.fail_appends {
            return Err(StoreError("simulated full disk".into()));
        }
        let key = Self::stream_key(&inner, queue)?;
        match inner.live.streams.get_mut(&key) {
            Some(log) => {
                log.append([data], timestamp_ms);
                Ok(())
            }
            None => Err(StoreError(format!("stream {} is gone", queue.0))),
        }
    }

    fn stream_bounds(&mut self, queue: QueueId) -> Result<super::StreamBounds, StoreError> {
        let inner = self.lock();
        let key = Self::stream_key(&inner, queue)?;
        let bounds = inner
            .live
            .streams
            .get(&key)
            .map(super::MemLog::bounds)
            .unwrap_or_default();
        Ok(super::StreamBounds {
            committed: Self::committed(&inner, &key).max(bounds.first),
            ..bounds
        })
    }

    fn stream_start(
        &mut self,
        queue: QueueId,
        start: super::StreamStart,
    ) -> Result<u64, StoreError> {
        let inner = self.lock();
        let key = Self::stream_key(&inner, queue)?;
        Ok(inner
            .live
            .streams
            .get(&key)
            .map_or(0, |log| log.start(start)))
    }

    fn stream_read(
        &mut self,
        queue: QueueId,
        from: u64,
        max: usize,
        out: &mut Vec<super::StreamEntry>,
    ) -> Result<(), StoreError> {
        let inner = self.lock();
        let key = Self::stream_key(&inner, queue)?;
        let committed = Self::committed(&inner, &key);
        if let Some(log) = inner.live.streams.get(&key) {
            let start = out.len();
            log.read(from, max, out);
            // Only what a completed sync covers: an offset a consumer saw survives a crash.
            let keep = out[start..]
                .iter()
                .position(|e| e.offset >= committed)
                .map_or(out.len(), |i| start + i);
            out.truncate(keep);
        }
        Ok(())
    }
}

impl MemoryStore {
    fn stream_key(inner: &Inner, queue: QueueId) -> Result<QueueKey, StoreError> {
        inner
            .open_streams
            .get(&queue)
            .cloned()
            .ok_or_else(|| StoreError(format!("stream {} is not open", queue.0)))
    }

    /// Offsets below this are covered by a completed sync.
    fn committed(inner: &Inner, key: &QueueKey) -> u64 {
        inner
            .durable
            .streams
            .get(key)
            .map_or(0, |l| l.bounds().next)
    }

    /// The offsets stream `name` of vhost `/` holds (tests).
    pub fn stream_bounds_of(&self, name: &str) -> Option<super::StreamBounds> {
        let inner = self.lock();
        let key = ("/".to_string(), name.to_string());
        inner.live.streams.get(&key).map(|l| super::StreamBounds {
            committed: Self::committed(&inner, &key),
            ..l.bounds()
        })
    }
}
