//! Quorum-queue replication on a cluster node (docs/cluster.md, "Quorum queues").
//!
//! Each quorum queue is a Raft group of its own (`warren_cluster::queue::QueueReplica`, the
//! metadata group's log store, transport and timings; its group id in every RPC). The core
//! already treats a quorum queue's store writes as its commands (every message stored, its
//! confirm after the sync): this layer over each shard's disk store ([`Replication`], a
//! `warren_runtime::StoreLayer`) sends a quorum queue's writes (a message appended, one
//! removed, a purge) to its group instead of the disk, one log entry per broker sync, and
//! reports the sync done once the entry is committed (on a majority's disks). So a publish
//! is confirmed after a majority has it, and an ack, a return or a purge reaches every
//! member. The broker serves the queue on the node that leads its group; there the layer
//! keeps the queue's messages for the core to page in. When a node becomes the leader it
//! waits until its copy has applied everything committed, then has its broker reload the
//! queue from that copy (`AdminRequest::ReloadQueue`): every confirmed, unsettled message,
//! flagged redelivered. A node that stops leading reloads to nothing, and refuses writes
//! (a publish there is nacked) until it leads again.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use warren_core::escape::Escaped;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;
use warren_cluster::node::ClusterNode;
use warren_cluster::queue::{DEAD_LETTER_BIT, QueueCommand, QueueOp, QueueReplica};
use warren_cluster::state_machine::{StateMachineStore, write_atomic};
use warren_cluster::{NodeId, Raft};
use warren_core::admin::AdminRequest;
use warren_core::ids::QueueId;
use warren_core::message::Message;
use warren_core::store::{
    DefinitionChange, QueueRecovery, Store, StoreError, StoredMessage, StreamBounds, StreamEntry,
    StreamSettings, StreamStart,
};
use warren_store::{SyncCallback, SyncError};

mod commit;
mod groups;
mod members;
mod store;

/// Members of a quorum queue's group when the declare names none (RabbitMQ's default),
/// capped at the cluster's size.
const DEFAULT_GROUP_SIZE: usize = 3;

/// `Group::told` when no leader is known.
const NO_LEADER: u64 = u64::MAX;

/// How long a declare-ok waits for a new quorum queue's group to have a leader serving it
/// (RabbitMQ's declare waits for its Ra cluster to start): its members' agreement, the
/// group's start and one election take well under a second on a healthy cluster.
pub const READY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// A quorum queue's group as recorded on this node (`<data-dir>/cluster/quorum-queues.json`):
/// the members chosen at its declare, so a restart (or a later change of the cluster's
/// membership) keeps them.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Record {
    vhost: String,
    name: String,
    group: u64,
    members: BTreeMap<NodeId, String>,
}

/// One quorum queue's group on this node.
struct Group {
    vhost: String,
    name: String,
    id: u64,
    /// This node's copy of the group while it runs here (a member, or a node being added).
    raft: Mutex<Option<Raft>>,
    replica: Mutex<Option<StateMachineStore<QueueReplica>>>,
    /// The group is starting or runs here (set by whoever starts it, so it starts once).
    running: AtomicBool,
    /// This node leads the group and its copy has applied everything committed: the broker
    /// serves the queue from it (set before the reload that makes the broker do so).
    leading: AtomicBool,
    /// The serving session this node's broker serves the queue in (valid while `leading`):
    /// the log index of the session start it committed before the broker loaded the queue
    /// (`QueueCommand::encode_session_start`). The broker's writes carry it, and every
    /// member applies them only while it is the group's latest session.
    session: AtomicU64,
    /// Deleted: a group still starting stops once started.
    deleted: AtomicBool,
    /// Its members were decided at start (recorded, or agreed for a new group): from then
    /// on `reconcile` follows membership changes.
    decided: AtomicBool,
    /// The leader this node's broker was last told of (`QueueHome`), `NO_LEADER` for none: a publish
    /// here goes to that node from then on.
    told: AtomicU64,
}

impl Group {
    /// The group's leader as this node knows it: from its copy of the group, or, on a node
    /// that is not a member, the one the metadata group names (its broker forwards there).
    fn leader(&self) -> Option<NodeId> {
        match self.raft() {
            Some(raft) => raft.metrics().borrow().current_leader,
            None => Some(self.told.load(Ordering::Acquire)).filter(|l| *l != NO_LEADER),
        }
    }

    fn raft(&self) -> Option<Raft> {
        lock(&self.raft).clone()
    }

    fn replica(&self) -> Option<StateMachineStore<QueueReplica>> {
        lock(&self.replica).clone()
    }

    fn file(&self) -> String {
        format!("q-{:016x}", self.id)
    }
}

struct Shared {
    registry_path: PathBuf,
    node: OnceLock<Arc<ClusterNode>>,
    broker: OnceLock<warren_runtime::BrokerHandle>,
    runtime: tokio::runtime::Handle,
    groups: Mutex<HashMap<(String, String), Arc<Group>>>,
    records: Mutex<BTreeMap<u64, Record>>,
    /// `x-quorum-initial-group-size` of queues declared here, until their group is made.
    sizes: Mutex<HashMap<(String, String), usize>>,
    /// A group's members were decided since `reconcile` last looked (it compares them with
    /// the metadata group's record then, as after any metadata change).
    changed: AtomicBool,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The quorum-queue replication of a cluster node: the store layer, and (once the cluster
/// node runs: [`Replication::attach`]) the groups.
#[derive(Clone)]
pub struct Replication(Arc<Shared>);

/// The group id of queue `name` in `vhost`: FNV-1a of both, top bit set (never the metadata
/// group's 0).
fn group_id(vhost: &str, name: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in vhost.bytes().chain([0]).chain(name.bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h | (1 << 63)
}

/// `size` members out of `nodes`, starting at a place the group id picks, so queues spread
/// their members (and first leaders) over the cluster.
fn choose_members(
    group: u64,
    nodes: &BTreeMap<NodeId, String>,
    size: usize,
) -> BTreeMap<NodeId, String> {
    let all: Vec<_> = nodes.iter().collect();
    if all.is_empty() {
        return BTreeMap::new();
    }
    let size = size.clamp(1, all.len());
    let start = (group % all.len() as u64) as usize;
    (0..size)
        .map(|i| all[(start + i) % all.len()])
        .map(|(id, a)| (*id, a.clone()))
        .collect()
}

/// The metadata group's key naming queue `name`'s leader (its node id in decimal), written
/// by each new leader once it serves: nodes that are not members forward publishes there.
fn leader_key(vhost: &str, name: &str) -> String {
    use warren_cluster::definitions::{Kind, key};
    key(Kind::Queue, &["quorum-leader", vhost, name])
}

/// The member of a new group that calls its first election: the one at the place the group
/// id picks among them.
fn first_candidate(group: u64, members: &BTreeMap<NodeId, String>) -> Option<NodeId> {
    let ids: Vec<NodeId> = members.keys().copied().collect();
    if ids.is_empty() {
        return None;
    }
    ids.get((group % ids.len() as u64) as usize).copied()
}

impl Replication {
    /// Replication for the node whose data dir is `data_dir`. Call inside the runtime.
    pub fn new(data_dir: &Path) -> Replication {
        let registry_path = data_dir.join("cluster").join("quorum-queues.json");
        let records: BTreeMap<u64, Record> = match std::fs::read(&registry_path) {
            Ok(bytes) => match serde_json::from_slice::<Vec<Record>>(&bytes) {
                Ok(v) => v.into_iter().map(|r| (r.group, r)).collect(),
                Err(e) => {
                    tracing::error!(path = %registry_path.display(), error = %e, "unreadable quorum queue records; their groups start when redeclared");
                    BTreeMap::new()
                }
            },
            Err(_) => BTreeMap::new(),
        };
        Replication(Arc::new(Shared {
            registry_path,
            node: OnceLock::new(),
            broker: OnceLock::new(),
            runtime: tokio::runtime::Handle::current(),
            groups: Mutex::new(HashMap::new()),
            records: Mutex::new(records),
            sizes: Mutex::new(HashMap::new()),
            changed: AtomicBool::new(true),
        }))
    }

    /// The cluster node runs: start the groups of the queues the broker restored.
    pub fn attach(&self, node: Arc<ClusterNode>, broker: warren_runtime::BrokerHandle) {
        let _ = self.0.broker.set(broker);
        if self.0.node.set(node.clone()).is_err() {
            return;
        }
        let groups: Vec<_> = lock(&self.0.groups).values().cloned().collect();
        for g in groups {
            self.start(g);
        }
        let this = self.clone();
        self.0.runtime.spawn(async move {
            let mut tick = tokio::time::interval(std::time::Duration::from_millis(250));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            // Each pass reads every group's record: only after a metadata change or a group
            // decided, not every tick.
            let mut seen = None;
            loop {
                tick.tick().await;
                let applied = node.definitions.with(|d| d.applied());
                if this.0.changed.swap(false, Ordering::AcqRel) || seen != Some(applied) {
                    seen = Some(applied);
                    this.reconcile(&node).await;
                }
            }
        });
    }

    fn group(&self, vhost: &str, name: &str) -> Result<Arc<Group>, String> {
        lock(&self.0.groups)
            .get(&(vhost.to_string(), name.to_string()))
            .cloned()
            .ok_or_else(|| format!("no quorum queue '{name}' in vhost '{vhost}' on this node"))
    }

    /// The leader of queue `name`'s group, as this node knows it.
    pub fn leader(&self, vhost: &str, name: &str) -> Option<NodeId> {
        let g = lock(&self.0.groups)
            .get(&(vhost.to_string(), name.to_string()))
            .cloned()?;
        g.leader()
    }

    /// Stops every quorum queue's group on this node (their files stay), as the process's
    /// exit does: [`crate::Cluster::halt`].
    pub(crate) async fn shutdown_groups(&self) {
        let groups: Vec<Arc<Group>> = lock(&self.0.groups).values().cloned().collect();
        for g in groups {
            if let Some(raft) = g.raft() {
                let _ = raft.shutdown().await;
            }
        }
    }

    /// Whether a publish on this node to queue `name` would be taken now: this node leads
    /// its group and serves it, or its broker forwards to the leader and this node's copy
    /// has applied a command of a serving leader (the empty one each new leader writes once
    /// it serves). False while the group starts or elects. A node that is not a member: once
    /// its broker forwards to the leader the metadata group names.
    fn ready(&self, vhost: &str, name: &str) -> bool {
        let Some(g) = lock(&self.0.groups)
            .get(&(vhost.to_string(), name.to_string()))
            .cloned()
        else {
            return false;
        };
        let Some(node) = self.0.node.get() else {
            return false;
        };
        if lock(&self.0.records)
            .get(&g.id)
            .is_some_and(|r| !r.members.contains_key(&node.id()))
        {
            // Not a member: its broker forwards to the leader the metadata group names.
            return g.told.load(Ordering::Acquire) != NO_LEADER;
        }
        let (Some(raft), Some(replica)) = (g.raft(), g.replica()) else {
            return false;
        };
        let leader = raft.metrics().borrow().current_leader;
        let told = g.told.load(Ordering::Acquire);
        match leader {
            Some(l) if l == node.id() => g.leading.load(Ordering::Acquire) && told == l,
            Some(l) => told == l && replica.with(|r| r.applied > 0),
            None => false,
        }
    }

    /// Waits (at most `bound`) until a publish on this node to quorum queue `name` would be
    /// taken ([`Replication::ready`]): a declare-ok comes after it, so a client publishing
    /// right after its declare-ok is not nacked for want of a leader. Whether it got there.
    pub async fn wait_ready(&self, vhost: &str, name: &str, bound: std::time::Duration) -> bool {
        let deadline = tokio::time::Instant::now() + bound;
        loop {
            if self.ready(vhost, name) {
                return true;
            }
            if tokio::time::Instant::now() >= deadline {
                tracing::warn!(
                    vhost = %Escaped(vhost),
                    queue = %Escaped(name),
                    "quorum queue has no leader serving it {} ms after its declare; answering anyway",
                    bound.as_millis()
                );
                return false;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    }

    /// Queue `name`'s group for the management API (RabbitMQ's fields): `leader` (its node
    /// id, as this node knows it; null during an election), `members` (node ids) and
    /// `online` (the members this node reaches now). `None` for a queue without a group here.
    pub fn placement(
        &self,
        vhost: &str,
        name: &str,
    ) -> Option<serde_json::Map<String, serde_json::Value>> {
        let g = lock(&self.0.groups)
            .get(&(vhost.to_string(), name.to_string()))
            .cloned()?;
        let members: Vec<NodeId> = lock(&self.0.records)
            .get(&g.id)
            .map(|r| r.members.keys().copied().collect())
            .unwrap_or_default();
        let node = self.0.node.get()?;
        let leader = g.leader();
        let online: Vec<NodeId> = members
            .iter()
            .copied()
            .filter(|m| node.reachable(*m))
            .collect();
        let mut out = serde_json::Map::new();
        out.insert("leader".into(), serde_json::json!(leader));
        out.insert("members".into(), serde_json::json!(members));
        out.insert("online".into(), serde_json::json!(online));
        Some(out)
    }

    /// The quorum queues that would lose their majority if this node stopped (RabbitMQ's
    /// `node-is-quorum-critical`): those with this node a member where the members online
    /// besides it are fewer than a majority of all.
    pub fn quorum_critical(&self) -> Vec<(String, String)> {
        let Some(node) = self.0.node.get() else {
            return Vec::new();
        };
        let me = node.id();
        let groups: Vec<Arc<Group>> = lock(&self.0.groups).values().cloned().collect();
        let records = lock(&self.0.records);
        let mut out: Vec<(String, String)> = groups
            .iter()
            .filter(|g| {
                records.get(&g.id).is_some_and(|r| {
                    let others = r.members.keys().filter(|m| **m != me);
                    r.members.contains_key(&me)
                        && others.filter(|m| node.reachable(**m)).count() < r.members.len() / 2 + 1
                })
            })
            .map(|g| (g.vhost.clone(), g.name.clone()))
            .collect();
        out.sort();
        out
    }

    /// Every quorum queue group this node knows: its queue, group id, recorded members and,
    /// where this node is a member, its group's status as this node sees it (role, term,
    /// leader, log indexes, each member's matched index and lag on the leader).
    pub fn groups_status(&self) -> Vec<serde_json::Value> {
        let groups: Vec<Arc<Group>> = lock(&self.0.groups).values().cloned().collect();
        let records = lock(&self.0.records).clone();
        let mut out: Vec<serde_json::Value> = groups
            .iter()
            .map(|g| {
                let members: Vec<NodeId> = records
                    .get(&g.id)
                    .map(|r| r.members.keys().copied().collect())
                    .unwrap_or_default();
                let mut v = serde_json::json!({
                    "type": "quorum",
                    "vhost": g.vhost,
                    "queue": g.name,
                    "group": format!("{:016x}", g.id),
                    "members": members,
                    "serving": g.leading.load(Ordering::Acquire),
                });
                if let (Some(raft), Some(node)) = (g.raft(), self.0.node.get()) {
                    let st = node.group_status(&raft);
                    v["status"] = serde_json::to_value(st).unwrap_or_default();
                }
                v
            })
            .collect();
        out.sort_by(|a, b| {
            (a["vhost"].as_str(), a["queue"].as_str())
                .cmp(&(b["vhost"].as_str(), b["queue"].as_str()))
        });
        out
    }

    /// The group of queue `name` in `vhost`, made (and started, once the node runs) if new.
    fn ensure(&self, vhost: &str, name: &str) -> Arc<Group> {
        let key = (vhost.to_string(), name.to_string());
        let mut groups = lock(&self.0.groups);
        if let Some(g) = groups.get(&key) {
            return g.clone();
        }
        let g = Arc::new(Group {
            vhost: key.0.clone(),
            name: key.1.clone(),
            id: group_id(vhost, name),
            raft: Mutex::new(None),
            replica: Mutex::new(None),
            running: AtomicBool::new(false),
            decided: AtomicBool::new(false),
            leading: AtomicBool::new(false),
            session: AtomicU64::new(0),
            deleted: AtomicBool::new(false),
            told: AtomicU64::new(NO_LEADER),
        });
        groups.insert(key, g.clone());
        drop(groups);
        if self.0.node.get().is_some() {
            self.start(g.clone());
        }
        g
    }

    fn save_records(&self, records: &BTreeMap<u64, Record>) {
        let list: Vec<_> = records.values().collect();
        let write = serde_json::to_vec(&list)
            .map_err(std::io::Error::other)
            .and_then(|bytes| write_atomic(&self.0.registry_path, &bytes));
        if let Err(e) = write {
            tracing::error!(path = %self.0.registry_path.display(), error = %e, "could not record quorum queue groups");
        }
    }

    /// Queue `name` in `vhost` was deleted: its group stops and its files go.
    fn delete(&self, vhost: &str, name: &str) {
        let Some(g) = lock(&self.0.groups).remove(&(vhost.to_string(), name.to_string())) else {
            return;
        };
        g.deleted.store(true, Ordering::Release);
        {
            let mut records = lock(&self.0.records);
            if records.remove(&g.id).is_some() {
                self.save_records(&records);
            }
        }
        let Some(node) = self.0.node.get().cloned() else {
            return;
        };
        let raft = g.raft();
        self.0.runtime.spawn(async move {
            if let Some(raft) = raft {
                node.remove_group(g.id, &raft, &g.file()).await;
            }
            // Every member drops the record; the deletes are idempotent. A failure leaves
            // a stale record a redeclare of the name then reuses.
            use warren_cluster::definitions::{DefCommand, Kind, key};
            for k in [
                key(Kind::Queue, &["quorum-members", &g.vhost, &g.name]),
                leader_key(&g.vhost, &g.name),
            ] {
                if let Err(e) = node.write(&DefCommand::Delete { key: k }).await {
                    tracing::debug!(queue = %Escaped(&g.name), error = %e, "quorum queue record not deleted");
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::store::QuorumStore;
    use super::*;

    /// Writes of two serving sessions (an old session's, left in `pending` by a sync that
    /// waited for a commit across a leader change, then the new session's) never share a
    /// log entry: each entry names one session, so the old ones are refused as a whole.
    #[tokio::test]
    async fn a_sync_keeps_the_writes_of_each_serving_session_apart() {
        // Nothing is read or written there: no cluster node is attached.
        let repl = Replication::new(Path::new("/nonexistent/warren-qq-test"));
        let g = repl.ensure("/", "q");
        let (jobs, _rx) = mpsc::unbounded_channel();
        let mut store = QuorumStore {
            inner: Box::new(warren_core::store::MemoryStore::new()),
            repl,
            names: HashMap::new(),
            quorum: HashMap::new(),
            pending: Vec::new(),
            jobs,
        };
        let append = |seq: u64| QueueOp::Append {
            seq,
            expires_at: None,
            message: vec![seq as u8],
        };
        store.pending = vec![
            (g.clone(), 5, append(7)),
            (g.clone(), 5, QueueOp::Remove { seq: 3 }),
            (g.clone(), 9, append(7)),
            (g.clone(), 9, append(8)),
        ];
        let batches: Vec<(u64, Vec<QueueOp>)> = store
            .take_batches()
            .into_iter()
            .map(|(_, session, ops)| (session, ops))
            .collect();
        assert_eq!(
            batches,
            vec![
                (5, vec![append(7), QueueOp::Remove { seq: 3 }]),
                (9, vec![append(7), append(8)]),
            ]
        );
        assert!(store.pending.is_empty());
    }

    #[test]
    fn members_spread_and_are_capped_at_the_cluster() {
        let nodes: BTreeMap<NodeId, String> =
            (1..=5).map(|i| (i, format!("10.0.0.{i}:25672"))).collect();
        let m = choose_members(7, &nodes, 3);
        // 7 % 5 = 2: the members start at the third node, in id order.
        assert_eq!(m.keys().copied().collect::<Vec<_>>(), vec![3, 4, 5]);
        assert_eq!(choose_members(7, &nodes, 9).len(), 5);
        assert_eq!(choose_members(7, &nodes, 0).len(), 1);
        assert_ne!(group_id("/", "a"), group_id("/", "b"));
        assert_ne!(group_id("/a", ""), group_id("/", "a"));
        assert!(group_id("/", "a") >> 63 == 1);
    }
}
