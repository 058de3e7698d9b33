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

    /// Follows membership changes (`add_member`, `delete_member`, `grow`, `shrink`): each
    /// queue's members are a record of the metadata group, changed around the group's own
    /// membership change, so every node sees them in the same order. A node newly named
    /// starts the group uninitialized (its leader then brings it up to date, as a learner,
    /// and makes it a voter); a node no longer named stops it and deletes its files (the
    /// record changes only after the group committed the removal); every node keeps its
    /// `quorum-queues.json` in step.
    async fn reconcile(&self, node: &Arc<ClusterNode>) {
        use warren_cluster::definitions::{Kind, key};
        let groups: Vec<Arc<Group>> = lock(&self.0.groups).values().cloned().collect();
        for g in groups {
            if !g.decided.load(Ordering::Acquire) || g.deleted.load(Ordering::Acquire) {
                continue;
            }
            let k = key(Kind::Queue, &["quorum-members", &g.vhost, &g.name]);
            let Some(members) = node.definitions.with(|d| {
                d.get(&k)
                    .and_then(|b| serde_json::from_slice::<BTreeMap<NodeId, String>>(b).ok())
            }) else {
                continue;
            };
            {
                let mut records = lock(&self.0.records);
                if records.get(&g.id).map(|r| &r.members) != Some(&members) {
                    records.insert(
                        g.id,
                        Record {
                            vhost: g.vhost.clone(),
                            name: g.name.clone(),
                            group: g.id,
                            members: members.clone(),
                        },
                    );
                    self.save_records(&records);
                }
            }
            let member = members.contains_key(&node.id());
            if !member && g.raft().is_none() {
                // Not a member: this node's broker forwards to the leader the metadata group
                // names (each new leader records itself there).
                let leader = node.definitions.with(|d| {
                    d.get(&leader_key(&g.vhost, &g.name))
                        .and_then(|b| std::str::from_utf8(b).ok()?.parse::<NodeId>().ok())
                });
                if let Some(l) = leader
                    && g.told.load(Ordering::Acquire) != l
                    && let Some(broker) = self.0.broker.get()
                {
                    let home = AdminRequest::QueueHome {
                        vhost: g.vhost.clone(),
                        queue: g.name.clone(),
                        node: u32::try_from(l).ok(),
                    };
                    let _ = broker.admin_local(home).await;
                    g.told.store(l, Ordering::Release);
                }
            }
            if member && !g.running.swap(true, Ordering::AcqRel) {
                tracing::info!(vhost = %Escaped(&g.vhost), queue = %Escaped(&g.name), "quorum queue: this node was added to its group; catching up");
                let this = self.clone();
                let node = node.clone();
                self.0.runtime.spawn(async move {
                    this.run_group(&node, g, members, false, false).await;
                });
            } else if !member && let Some(raft) = g.raft() {
                tracing::info!(vhost = %Escaped(&g.vhost), queue = %Escaped(&g.name), "quorum queue: this node was removed from its group; its copy is deleted");
                *lock(&g.raft) = None;
                *lock(&g.replica) = None;
                node.remove_group(g.id, &raft, &g.file()).await;
                if g.leading.swap(false, Ordering::AcqRel)
                    && let Some(broker) = self.0.broker.get()
                {
                    let reload = AdminRequest::ReloadQueue {
                        vhost: g.vhost.clone(),
                        name: g.name.clone(),
                    };
                    let _ = broker.admin_local(reload).await;
                }
                g.running.store(false, Ordering::Release);
                // Forward to the recorded leader from now on (next pass).
                g.told.store(NO_LEADER, Ordering::Release);
                self.0.changed.store(true, Ordering::Release);
            } else if !member && g.running.load(Ordering::Acquire) {
                // Still starting (a restart on a record from before its removal): look
                // again next tick, once it runs.
                self.0.changed.store(true, Ordering::Release);
            }
        }
    }

    /// Queue `name`'s members as the metadata group records them: the raw record (for a
    /// compare-and-set) and the map.
    fn recorded_members(
        &self,
        node: &ClusterNode,
        vhost: &str,
        name: &str,
    ) -> Result<(Vec<u8>, BTreeMap<NodeId, String>), String> {
        use warren_cluster::definitions::{Kind, key};
        let k = key(Kind::Queue, &["quorum-members", vhost, name]);
        let raw = node
            .definitions
            .with(|d| d.get(&k).map(<[u8]>::to_vec))
            .ok_or_else(|| {
                format!("no quorum queue '{name}' in vhost '{vhost}' in this cluster")
            })?;
        let members = serde_json::from_slice(&raw)
            .map_err(|e| format!("quorum queue '{name}': unreadable members record: {e}"))?;
        Ok((raw, members))
    }

    /// Sets queue `name`'s members record from `expected` to `members` (compare-and-set).
    async fn record_members(
        node: &ClusterNode,
        vhost: &str,
        name: &str,
        expected: Vec<u8>,
        members: &BTreeMap<NodeId, String>,
    ) -> Result<(), String> {
        use warren_cluster::definitions::{DefCommand, DefReply, Kind, key};
        let cmd = DefCommand::PutIf {
            key: key(Kind::Queue, &["quorum-members", vhost, name]),
            expected: Some(expected),
            record: serde_json::to_vec(members).map_err(|e| e.to_string())?,
        };
        match node.write(&cmd).await {
            Ok(DefReply::Done { .. }) => Ok(()),
            Ok(DefReply::Conflict { .. }) => Err(format!(
                "quorum queue '{name}': its members changed meanwhile (another membership change); try again"
            )),
            Ok(other) => Err(format!("quorum queue '{name}': {other:?}")),
            Err(e) => Err(format!(
                "quorum queue '{name}': metadata store unavailable: {e}"
            )),
        }
    }

    /// `warren ctl quorum add-member QUEUE NODE` (rabbitmq-queues add_member): node `id`
    /// becomes a member of queue `name`'s group: recorded (so it starts the group), then
    /// added by the group's leader as a learner, brought up to date (log or snapshot), and
    /// made a voter. Answered once it votes; on failure the record is set back.
    pub async fn add_member(&self, vhost: &str, name: &str, id: NodeId) -> Result<(), String> {
        let node: &ClusterNode = self.0.node.get().ok_or("this node is not in a cluster")?;
        let g = self.group(vhost, name)?;
        let addr = node
            .members()
            .get(&id)
            .cloned()
            .ok_or_else(|| format!("node {id} is not a member of the cluster"))?;
        let (raw, old) = self.recorded_members(node, vhost, name)?;
        if old.contains_key(&id) {
            return Err(format!(
                "node {id} is a member of quorum queue '{name}' already"
            ));
        }
        let mut new = old.clone();
        new.insert(id, addr.clone());
        Self::record_members(node, vhost, name, raw, &new).await?;
        let raft = g.raft();
        match node.group_join(g.id, raft.as_ref(), &old, id, &addr).await {
            Ok(()) => {
                tracing::info!(vhost, queue = name, node = id, "quorum queue: member added");
                Ok(())
            }
            Err(e) => {
                if let Ok((raw, _)) = self.recorded_members(node, vhost, name) {
                    let _ = Self::record_members(node, vhost, name, raw, &old).await;
                }
                Err(format!("quorum queue '{name}': adding node {id}: {e}"))
            }
        }
    }

    /// `warren ctl quorum delete-member QUEUE NODE` (rabbitmq-queues delete_member): node
    /// `id` leaves queue `name`'s group (joint consensus, on its leader), then the record
    /// changes and that node deletes its copy. The last member cannot leave.
    pub async fn delete_member(&self, vhost: &str, name: &str, id: NodeId) -> Result<(), String> {
        let node: &ClusterNode = self.0.node.get().ok_or("this node is not in a cluster")?;
        let g = self.group(vhost, name)?;
        let (_, old) = self.recorded_members(node, vhost, name)?;
        if !old.contains_key(&id) {
            return Err(format!(
                "node {id} is not a member of quorum queue '{name}'"
            ));
        }
        if old.len() == 1 {
            return Err(format!(
                "node {id} is the last member of quorum queue '{name}'; delete the queue instead"
            ));
        }
        let raft = g.raft();
        node.group_forget(g.id, raft.as_ref(), &old, id)
            .await
            .map_err(|e| format!("quorum queue '{name}': removing node {id}: {e}"))?;
        let mut new = old.clone();
        new.remove(&id);
        let (raw, _) = self.recorded_members(node, vhost, name)?;
        Self::record_members(node, vhost, name, raw, &new).await?;
        tracing::info!(
            vhost,
            queue = name,
            node = id,
            "quorum queue: member removed"
        );
        Ok(())
    }

    /// `warren ctl quorum grow NODE` (rabbitmq-queues grow): node `id` joins every quorum
    /// queue's group it is not a member of, one queue at a time; `shrink` (`grow` false):
    /// leaves every group it is a member of (except a group it is the last member of). Each
    /// queue's outcome.
    pub async fn grow_or_shrink(&self, id: NodeId, grow: bool) -> Vec<serde_json::Value> {
        let Some(node) = self.0.node.get() else {
            return Vec::new();
        };
        let mut queues: Vec<(String, String)> = lock(&self.0.groups).keys().cloned().collect();
        queues.sort();
        let mut out = Vec::new();
        for (vhost, name) in queues {
            let Ok((_, members)) = self.recorded_members(node, &vhost, &name) else {
                continue;
            };
            let r = match (grow, members.contains_key(&id)) {
                (true, false) => self.add_member(&vhost, &name, id).await,
                (false, true) if members.len() > 1 => self.delete_member(&vhost, &name, id).await,
                _ => continue,
            };
            out.push(serde_json::json!({
                "vhost": vhost,
                "queue": name,
                "result": match &r { Ok(()) => "ok".to_string(), Err(e) => e.clone() },
            }));
        }
        out
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

    /// Starts group `g` on this node (its members: recorded, or chosen now from the
    /// cluster's members), and its leader watch.
    fn start(&self, g: Arc<Group>) {
        let Some(node) = self.0.node.get().cloned() else {
            return;
        };
        let recorded = lock(&self.0.records).get(&g.id).map(|r| r.members.clone());
        let size = lock(&self.0.sizes)
            .remove(&(g.vhost.clone(), g.name.clone()))
            .unwrap_or(DEFAULT_GROUP_SIZE);
        let this = self.clone();
        self.0.runtime.spawn(async move {
            let members = match recorded.clone() {
                Some(m) => m,
                None => {
                    let members = this.agree_members(&node, &g, size).await;
                    let mut records = lock(&this.0.records);
                    records.insert(
                        g.id,
                        Record {
                            vhost: g.vhost.clone(),
                            name: g.name.clone(),
                            group: g.id,
                            members: members.clone(),
                        },
                    );
                    this.save_records(&records);
                    members
                }
            };
            let member = members.contains_key(&node.id());
            // Claimed before `decided` is set, so `reconcile` never starts it uninitialized.
            let claimed = member && !g.running.swap(true, Ordering::AcqRel);
            g.decided.store(true, Ordering::Release);
            if !member {
                // Not a member: the queue is served by its members only (until an
                // add-member makes it one: `reconcile`).
                tracing::info!(vhost = %Escaped(&g.vhost), queue = %Escaped(&g.name), ?members, "quorum queue: this node is not a member of its group");
                return;
            }
            this.0.changed.store(true, Ordering::Release);
            if claimed {
                // Only a new group's members propose its first membership: a member
                // restarting on an empty log (it never got an entry, or it was added later)
                // waits for the leader instead of proposing one of its own.
                let new = recorded.is_none();
                this.run_group(&node, g, members, new, new).await;
            }
        });
    }

    /// Runs group `g` here until it stops (the caller claimed `Group::running`). `initialize`: as one of
    /// the members it was declared with (`members`, every one of them proposing the same
    /// first membership); otherwise as a member being added, which waits, uninitialized,
    /// for the leader to bring it up to date. `new`: the group was just declared.
    async fn run_group(
        &self,
        node: &ClusterNode,
        g: Arc<Group>,
        members: BTreeMap<NodeId, String>,
        initialize: bool,
        new: bool,
    ) {
        // The caller claimed `g.running`.
        let first = if initialize {
            members.clone()
        } else {
            BTreeMap::new()
        };
        match node
            .start_group(
                g.id,
                &g.file(),
                &first,
                QueueReplica::new(),
                warren_cluster::queue::MAX_ENTRIES,
            )
            .await
        {
            Ok((raft, sm)) => {
                *lock(&g.replica) = Some(sm);
                *lock(&g.raft) = Some(raft.clone());
                if g.deleted.load(Ordering::Acquire) {
                    node.remove_group(g.id, &raft, &g.file()).await;
                    return;
                }
                tracing::info!(vhost = %Escaped(&g.vhost), queue = %Escaped(&g.name), group = g.id, members = ?members.keys().collect::<Vec<_>>(), added = !initialize, "quorum queue group started");
                // A new group: one member, the one its id picks (so first leaders spread
                // over the cluster), calls the election at once instead of after an
                // election timeout; the declare-ok waits for it (`wait_ready`).
                if new && first_candidate(g.id, &members) == Some(node.id()) {
                    let _ = raft.trigger().elect().await;
                }
                self.watch(g, raft).await;
            }
            Err(e) => {
                g.running.store(false, Ordering::Release);
                tracing::error!(vhost = %Escaped(&g.vhost), queue = %Escaped(&g.name), error = %e, "quorum queue group could not start");
            }
        }
    }

    /// The members of new group `g`, agreed through the metadata group: this node proposes
    /// the set it computes (every node computes the same one from the same membership) with
    /// a compare-and-set on the queue's members key; if another node's proposal came first,
    /// that one. Without a metadata quorum within the bound, the computed set.
    async fn agree_members(
        &self,
        node: &ClusterNode,
        g: &Group,
        size: usize,
    ) -> BTreeMap<NodeId, String> {
        use warren_cluster::definitions::{DefCommand, DefReply, Kind, key};
        let mine = choose_members(g.id, &node.members(), size);
        let cmd = DefCommand::PutIf {
            key: key(Kind::Queue, &["quorum-members", &g.vhost, &g.name]),
            expected: None,
            record: serde_json::to_vec(&mine).unwrap_or_default(),
        };
        let deadline = std::time::Instant::now() + warren_cluster::node::FORWARD_TIMEOUT;
        loop {
            match node.write(&cmd).await {
                Ok(DefReply::Done { .. }) => return mine,
                Ok(DefReply::Conflict {
                    current: Some(bytes),
                }) => match serde_json::from_slice::<BTreeMap<NodeId, String>>(&bytes) {
                    Ok(theirs) => return theirs,
                    Err(e) => {
                        tracing::error!(queue = %Escaped(&g.name), error = %e, "unreadable quorum queue members record; using this node's choice");
                        return mine;
                    }
                },
                Ok(other) => {
                    tracing::warn!(queue = %Escaped(&g.name), reply = ?other, "quorum queue members not recorded; using this node's choice");
                    return mine;
                }
                Err(e) if std::time::Instant::now() < deadline => {
                    tracing::debug!(queue = %Escaped(&g.name), error = %e, "recording quorum queue members: retrying");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
                Err(e) => {
                    tracing::warn!(queue = %Escaped(&g.name), error = %e, "quorum queue members not recorded in the metadata group; using this node's choice");
                    return mine;
                }
            }
        }
    }

    /// Follows group `g`'s leadership: when this node becomes its leader, waits until its copy
    /// has applied everything committed, then has the broker serve the queue from it; when
    /// it stops leading, has the broker drop the queue's messages.
    async fn watch(&self, g: Arc<Group>, raft: Raft) {
        let mut metrics = raft.metrics();
        // openraft 0.9 keeps a leader cut off by a partition Leader (in its old term) until
        // it hears a higher one after the heal, while the other side elects another after
        // an election timeout: a leader that heard from no majority for that long stops
        // serving here (the lease is lost), so its publishes are nacked and its consumers
        // go, instead of waiting unanswered for the heal; it serves again, in a new
        // session, once a majority answers it and it still leads.
        let lease = self
            .0
            .node
            .get()
            .map_or(std::time::Duration::from_secs(1), |n| {
                n.election_timeout_max()
            });
        let lease_ms = u64::try_from(lease.as_millis()).unwrap_or(u64::MAX);
        // The term this node's broker serves the queue in (`None`: it does not serve it).
        // Compared by term, not as a flag: a node that lost the leadership and won it back
        // between two looks must still reload (another leader may have served meanwhile).
        let mut serving: Option<u64> = None;
        // The node this node's broker forwards the queue's publishes to (h-xnode's homes):
        // the group's leader when it is another node; none when it is this one or unknown
        // (then a publish here is refused: nacked).
        let mut home: Option<Option<u32>> = None;
        loop {
            let (leads, leader, me, term) = {
                let m = metrics.borrow_and_update();
                let leader = m.state == warren_cluster::openraft::ServerState::Leader
                    && m.current_leader == Some(m.id);
                let lease_held = m.millis_since_quorum_ack.is_none_or(|ms| ms <= lease_ms);
                if leader && !lease_held && serving.is_some() {
                    tracing::warn!(vhost = %g.vhost, queue = %g.name, term = m.current_term, since_ms = ?m.millis_since_quorum_ack, "quorum queue: no majority answers this leader; it stops serving until one does");
                }
                (
                    leader && lease_held,
                    // Whoever another node elects meanwhile is unknown here: no home.
                    m.current_leader.filter(|_| lease_held || !leader),
                    m.id,
                    m.current_term,
                )
            };
            let want_serving = leads.then_some(term);
            if g.deleted.load(Ordering::Acquire) {
                return;
            }
            let want = leader
                .filter(|l| *l != me)
                .and_then(|l| u32::try_from(l).ok());
            if home != Some(want) {
                home = Some(want);
                if let Some(broker) = self.0.broker.get() {
                    let at = AdminRequest::QueueHome {
                        vhost: g.vhost.clone(),
                        queue: g.name.clone(),
                        node: want,
                    };
                    let _ = broker.admin_local(at).await;
                }
            }
            g.told.store(leader.unwrap_or(NO_LEADER), Ordering::Release);
            if want_serving != serving {
                // A new serving session: committed (and so applied here, with everything
                // before it) before the broker loads the queue, so the copy it loads holds
                // every write of earlier sessions that will ever apply, and every one that
                // reaches the log after it is refused (a write the old session's broker made
                // whose proposal was still on its way: its sequence numbers could name
                // other messages by now).
                let session = if leads {
                    g.leading.store(false, Ordering::Release);
                    // Bounded: a leader cut off right after its election would wait for the
                    // heal here, blind to everything Raft does meanwhile. Given up, the
                    // session start may still commit: a later one supersedes it.
                    let start = raft.client_write(QueueCommand::encode_session_start());
                    match tokio::time::timeout(lease, start).await {
                        Ok(Ok(resp)) if resp.data.0.is_empty() => Some(resp.log_id.index),
                        Ok(_) => None,
                        Err(_) => {
                            tracing::info!(vhost = %g.vhost, queue = %g.name, term, "quorum queue: a new serving session was not committed in time; trying again");
                            None
                        }
                    }
                } else {
                    Some(0)
                };
                // No new session: the broker stops serving the old one meanwhile (its
                // writes would be refused anyway), and this loop tries again.
                let (session, leads, want_serving) = match session {
                    None if serving.is_some() => (Some(0), false, None),
                    s => (s, leads, want_serving),
                };
                if let Some(session) = session {
                    if serving.is_some() && leads {
                        tracing::info!(vhost = %Escaped(&g.vhost), queue = %Escaped(&g.name), term, session, "quorum queue: this node leads it in a new session; reloading");
                    }
                    g.session.store(session, Ordering::Release);
                    g.leading.store(leads, Ordering::Release);
                    let reload = AdminRequest::ReloadQueue {
                        vhost: g.vhost.clone(),
                        name: g.name.clone(),
                    };
                    if let Some(broker) = self.0.broker.get() {
                        let _ = broker.admin_local(reload).await;
                    }
                    serving = want_serving;
                    tracing::info!(vhost = %Escaped(&g.vhost), queue = %Escaped(&g.name), leader = leads, term, session, "quorum queue: {}", if leads { "this node leads and serves it" } else { "this node no longer leads it" });
                    if let Some(sm) = g.replica() {
                        let (held, next_seq, applied) =
                            sm.with(|r| (r.messages.len(), r.next_seq, r.applied));
                        tracing::debug!(target: "warren::qq::trace", queue = %Escaped(&g.name), leads, term, session, held, next_seq, applied, "quorum queue: reloaded");
                    }
                    if leads {
                        // An empty command: once a member applies it, it knows a leader
                        // served the group (`wait_ready` on the other members).
                        let marker = raft.clone();
                        // And the leader in the metadata group (as RabbitMQ's queue record
                        // names its leader): nodes that are not members forward there.
                        let node = self.0.node.get().cloned();
                        let k = leader_key(&g.vhost, &g.name);
                        self.0.runtime.spawn(async move {
                            let _ = marker.client_write(QueueCommand(Vec::new()).encode()).await;
                            if let Some(node) = node {
                                let put = warren_cluster::definitions::DefCommand::Put {
                                    key: k,
                                    record: me.to_string().into_bytes(),
                                };
                                if let Err(e) = node.write(&put).await {
                                    tracing::debug!(error = %e, "quorum queue leader not recorded");
                                }
                            }
                        });
                    }
                    continue;
                }
            }
            // Ends when the group shuts down (its metrics sender is dropped).
            if tokio::time::timeout(std::time::Duration::from_millis(500), metrics.changed())
                .await
                .is_ok_and(|r| r.is_err())
            {
                return;
            }
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

impl warren_runtime::StoreLayer for Replication {
    fn layer(
        &self,
        _shard: u32,
        synced: SyncCallback,
    ) -> (
        SyncCallback,
        Box<dyn FnOnce(Box<dyn Store>) -> Box<dyn Store> + Send>,
    ) {
        let (inner_tx, inner_rx) = mpsc::unbounded_channel();
        let (jobs_tx, jobs_rx) = mpsc::unbounded_channel();
        let (wait_tx, wait_rx) = mpsc::unbounded_channel();
        self.0.runtime.spawn(propose(jobs_rx, wait_tx));
        self.0.runtime.spawn(complete(wait_rx, inner_rx, synced));
        let on_inner: SyncCallback = Box::new(move |epoch, result| {
            let _ = inner_tx.send((epoch, result));
        });
        let this = self.clone();
        let wrap = Box::new(move |inner: Box<dyn Store>| -> Box<dyn Store> {
            Box::new(QuorumStore {
                inner,
                repl: this,
                names: HashMap::new(),
                quorum: HashMap::new(),
                pending: Vec::new(),
                jobs: jobs_tx,
            })
        });
        (on_inner, wrap)
    }
}

/// A batch of writes for one group, made while this node served it in a session.
type Batch = (Arc<Group>, u64, Vec<QueueOp>);

/// The broker's sync `epoch`: these writes committed, and the disk's own sync, complete it.
struct Job(u64, Vec<Batch>);

type WriteResult = Result<
    warren_cluster::openraft::raft::ClientWriteResponse<warren_cluster::TypeConfig>,
    warren_cluster::openraft::error::ClientWriteError<NodeId, warren_cluster::openraft::BasicNode>,
>;

type Responder = tokio::sync::oneshot::Receiver<WriteResult>;

/// Proposes each job's writes in order without waiting for their commit (openraft
/// pipelines them); [`complete`] waits for them in the same order.
async fn propose(
    mut jobs: mpsc::UnboundedReceiver<Job>,
    wait: mpsc::UnboundedSender<(u64, Vec<Proposed>)>,
) {
    while let Some(job) = jobs.recv().await {
        let Job(epoch, batches) = job;
        let mut waits = Vec::with_capacity(batches.len());
        for (g, session, ops) in batches {
            let w = match g.raft() {
                // Writes of the queue as served in an older session are refused here (the
                // broker reloads it for the new one), and by every member at apply if a
                // new session starts after this look.
                Some(raft)
                    if g.leading.load(Ordering::Acquire)
                        && g.session.load(Ordering::Acquire) == session =>
                {
                    if tracing::enabled!(target: "warren::qq::trace", tracing::Level::DEBUG) {
                        trace_ops(&g, session, epoch, &ops);
                    }
                    raft.client_write_ff(QueueCommand(ops).encode_in(session))
                        .await
                        .map_err(|e| e.to_string())
                }
                _ => {
                    // A write of an older session while this node serves a newer one: what
                    // the session check is for (before it, such a write was proposed).
                    tracing::debug!(
                        target: "warren::qq::trace",
                        queue = %Escaped(&g.name),
                        session,
                        current = g.session.load(Ordering::Acquire),
                        leading = g.leading.load(Ordering::Acquire),
                        epoch,
                        ops = ops.len(),
                        "quorum queue: write refused: not made in this node's serving session"
                    );
                    Err(format!(
                        "quorum queue '{}': this node does not lead its group (in the session its writes were made in)",
                        g.name
                    ))
                }
            };
            waits.push((g, session, w));
        }
        if wait.send((epoch, waits)).is_err() {
            return;
        }
    }
}

/// The `warren::qq::trace` debug target (`RUST_LOG=warren::qq::trace=debug`): each write a
/// leader proposes, by sequence number, with the serving session it was made in and the broker's sync
/// epoch (whose "committed" line gives its log index), to follow one message through
/// leader changes. Costs nothing unless enabled.
fn trace_ops(g: &Group, session: u64, epoch: u64, ops: &[QueueOp]) {
    let mut appended = Vec::new();
    let mut removed = Vec::new();
    for op in ops {
        match op {
            QueueOp::Append { seq, message, .. } => {
                // The body is the record's tail: enough of it to name a test's message.
                let tail = &message[message.len().saturating_sub(12)..];
                appended.push(format!("{seq}={}", String::from_utf8_lossy(tail)));
            }
            QueueOp::Remove { seq } => removed.push(seq.to_string()),
            QueueOp::RemoveFrom { seq } => removed.push(format!("{seq}..")),
        }
    }
    tracing::debug!(target: "warren::qq::trace", queue = %Escaped(&g.name), session, epoch, appended = ?appended, removed = ?removed, "quorum queue: proposing");
}

/// A group's write as proposed: the group, the serving session it was made in, and the
/// group's answer to come (or why it was not proposed).
type Proposed = (Arc<Group>, u64, Result<Responder, String>);

/// How often a write waiting for its commit checks that its serving session still runs.
const SESSION_CHECK: std::time::Duration = std::time::Duration::from_millis(50);

/// The group's answer to a write made in serving session `session`, or `None` once that
/// session ended here (this node's broker stopped serving the queue: its lease was lost, or
/// another session started): a leader cut off by a partition would otherwise hold the
/// shard's sync, and every confirm behind it, until the heal. The write is then nacked,
/// whatever the group does with it later: refused at apply once a newer session
/// committed, or, if it still commits, a message the publisher republished (at least once).
async fn answer(
    g: &Group,
    session: u64,
    rx: Responder,
) -> Option<Result<WriteResult, tokio::sync::oneshot::error::RecvError>> {
    tokio::pin!(rx);
    loop {
        tokio::select! {
            r = &mut rx => return Some(r),
            _ = tokio::time::sleep(SESSION_CHECK) => {
                if !g.leading.load(Ordering::Acquire) || g.session.load(Ordering::Acquire) != session {
                    return None;
                }
            }
        }
    }
}

/// Completes the broker's syncs in order: once its group writes are committed and the disk
/// reported the same epoch synced.
async fn complete(
    mut waits: mpsc::UnboundedReceiver<(u64, Vec<Proposed>)>,
    mut inner: mpsc::UnboundedReceiver<(u64, Result<(), SyncError>)>,
    synced: SyncCallback,
) {
    // Disk syncs reported before their group writes committed (at most the syncs in flight).
    let mut early: HashMap<u64, Result<(), SyncError>> = HashMap::new();
    while let Some((epoch, rxs)) = waits.recv().await {
        let mut result = Ok(());
        for (g, session, rx) in rxs {
            let r = match rx {
                Ok(rx) => match answer(&g, session, rx).await {
                    // A reply is an error the group's state machine gave (a stale or
                    // undecodable command: not applied).
                    Some(Ok(Ok(resp))) if !resp.data.0.is_empty() => {
                        Err(String::from_utf8_lossy(&resp.data.0).into_owned())
                    }
                    Some(Ok(Ok(resp))) => {
                        tracing::debug!(target: "warren::qq::trace", epoch, index = resp.log_id.index, term = resp.log_id.leader_id.term, "quorum queue: committed");
                        Ok(())
                    }
                    Some(Ok(Err(e))) => Err(e.to_string()),
                    Some(Err(_)) => Err("the group stopped".to_string()),
                    None => Err(format!(
                        "quorum queue '{}': this node stopped serving it before the write committed",
                        g.name
                    )),
                },
                Err(e) => Err(e),
            };
            if let Err(e) = r {
                tracing::debug!(error = %e, "quorum queue write not committed");
                result = result.and(Err(SyncError::NotReplicated(e)));
            }
        }
        let disk = loop {
            if let Some(r) = early.remove(&epoch) {
                break r;
            }
            match inner.recv().await {
                Some((e, r)) => {
                    early.insert(e, r);
                }
                None => return,
            }
        };
        // A disk failure first: it is the one that blocks publishers (the store alarm); a
        // write a quorum queue's group did not commit only nacks the epoch's confirms.
        synced(epoch, disk.and(result));
    }
}

/// A served queue's messages by sequence number: (message, expires_at, redelivered).
type Held = BTreeMap<u64, (Arc<Message>, Option<u64>, bool)>;

/// What the layer keeps of a quorum queue on this node.
struct Local {
    group: Arc<Group>,
    /// The broker serves the queue here (this node led its group at the last reload).
    serving: bool,
    /// The serving session the queue was loaded in (valid while `serving`).
    session: u64,
    /// Its messages, for the core to page in.
    messages: Held,
    /// This is the queue's dead-letter log (at-least-once dead-lettering,
    /// `warren_core::queue::dlx`), carried in the queue's own group under sequence numbers
    /// with `DEAD_LETTER_BIT` set.
    dead_letters: bool,
}

impl Local {
    /// The group's sequence number of this log's `seq`.
    fn key(&self, seq: u64) -> u64 {
        if self.dead_letters {
            seq | DEAD_LETTER_BIT
        } else {
            seq
        }
    }
}

/// One shard's store with the quorum-queue layer over it.
struct QuorumStore {
    inner: Box<dyn Store>,
    repl: Replication,
    names: HashMap<QueueId, (String, String)>,
    quorum: HashMap<QueueId, Local>,
    /// Writes since the last sync or flush, in order, with the serving session they were
    /// made in.
    pending: Vec<(Arc<Group>, u64, QueueOp)>,
    jobs: mpsc::UnboundedSender<Job>,
}

impl QuorumStore {
    /// The writes since the last sync as log entries: per group, in order, each entry at
    /// most `MAX_ENTRY_BYTES` of messages (or one larger message).
    fn take_batches(&mut self) -> Vec<Batch> {
        let mut batches: Vec<(Batch, usize)> = Vec::new();
        for (g, session, op) in self.pending.drain(..) {
            let size = match &op {
                QueueOp::Append { message, .. } => message.len() + 32,
                _ => 16,
            };
            // The last entry of this group, if it has room; else a new one.
            match batches
                .iter_mut()
                .rev()
                .find(|((b, _, _), _)| b.id == g.id)
                .filter(|((_, t, _), bytes)| {
                    *t == session && *bytes + size <= warren_cluster::queue::MAX_ENTRY_BYTES
                }) {
                Some(((_, _, ops), bytes)) => {
                    ops.push(op);
                    *bytes += size;
                }
                None => batches.push(((g, session, vec![op]), size)),
            }
        }
        batches.into_iter().map(|(b, _)| b).collect()
    }

    /// The queue's messages (or, for `dead_letters`, its dead-letter log) from its group's
    /// copy (this node leads it now).
    fn load_replica(g: &Group, dead_letters: bool) -> (Held, u64) {
        let Some(sm) = g.replica() else {
            return (BTreeMap::new(), 0);
        };
        sm.with(|r| {
            let mut out = BTreeMap::new();
            let range = if dead_letters {
                r.messages.range(DEAD_LETTER_BIT..)
            } else {
                r.messages.range(..DEAD_LETTER_BIT)
            };
            for (seq, held) in range {
                let seq = &(seq & !DEAD_LETTER_BIT);
                match warren_store::record::decode_message(&Bytes::from(held.message.clone()), None)
                {
                    Ok(m) => {
                        out.insert(*seq, (Arc::new(m), held.expires_at, true));
                    }
                    Err(e) => {
                        tracing::error!(queue = %Escaped(&g.name), seq, error = %e, "undecodable message in a quorum queue's log; skipped");
                    }
                }
            }
            let next = if dead_letters {
                out.keys().next_back().map_or(0, |s| s + 1)
            } else {
                r.next_seq
            };
            (out, next)
        })
    }
}

impl Store for QuorumStore {
    fn define(&mut self, change: DefinitionChange<'_>) -> Result<(), StoreError> {
        if let DefinitionChange::QueueDeclared { vhost, def } = change
            && let Some(size) = def
                .arguments
                .get("x-quorum-initial-group-size")
                .and_then(|v| v.as_i64())
        {
            let size = usize::try_from(size).unwrap_or(DEFAULT_GROUP_SIZE).max(1);
            lock(&self.repl.0.sizes).insert((vhost.to_string(), def.queue.clone()), size);
        }
        self.inner.define(change)
    }

    fn open_queue(
        &mut self,
        queue: QueueId,
        vhost: &str,
        name: &str,
        durable: bool,
    ) -> QueueRecovery {
        self.names
            .insert(queue, (vhost.to_string(), name.to_string()));
        let Some(local) = self.quorum.get_mut(&queue) else {
            return self.inner.open_queue(queue, vhost, name, durable);
        };
        // A reload: the queue changed hands here.
        local.serving = local.group.leading.load(Ordering::Acquire);
        local.session = local.group.session.load(Ordering::Acquire);
        let (messages, next_seq) = if local.serving {
            QuorumStore::load_replica(&local.group, local.dead_letters)
        } else {
            (BTreeMap::new(), 0)
        };
        local.messages = messages;
        let next_seq = next_seq.max(local.messages.keys().last().map_or(0, |s| s + 1));
        QueueRecovery {
            count: local.messages.len() as u64,
            bytes: local
                .messages
                .values()
                .map(|(m, _, _)| m.body_len() as u64)
                .sum(),
            first_seq: local.messages.keys().next().copied().unwrap_or(0),
            next_seq,
        }
    }

    fn keep_every_message(&mut self, queue: QueueId) {
        if self.quorum.contains_key(&queue) {
            return;
        }
        let Some((vhost, name)) = self.names.get(&queue).cloned() else {
            return self.inner.keep_every_message(queue);
        };
        // A quorum queue's dead-letter log goes in the queue's own group.
        let (name, dead_letters) = match name.strip_prefix(warren_core::queue::dlx::STORE_PREFIX) {
            Some(queue_name) => (queue_name.to_string(), true),
            None => (name, false),
        };
        let group = self.repl.ensure(&vhost, &name);
        // The log opens while the queue is served (its first dead letter, or a reload):
        // it is served as the queue is, with what the group's copy holds of it.
        let serving = dead_letters && group.leading.load(Ordering::Acquire);
        let session = group.session.load(Ordering::Acquire);
        let messages = if serving {
            QuorumStore::load_replica(&group, true).0
        } else {
            BTreeMap::new()
        };
        self.quorum.insert(
            queue,
            Local {
                group,
                serving,
                session,
                messages,
                dead_letters,
            },
        );
    }

    fn append(
        &mut self,
        queue: QueueId,
        seq: u64,
        message: &Arc<Message>,
        expires_at: Option<u64>,
    ) -> Result<(), StoreError> {
        let Some(local) = self.quorum.get_mut(&queue) else {
            return self.inner.append(queue, seq, message, expires_at);
        };
        if !local.serving {
            return Err(StoreError(format!(
                "quorum queue '{}': this node does not lead its group",
                local.group.name
            )));
        }
        let mut record = Vec::new();
        warren_store::record::encode_message(message, true, &mut record);
        if record.len() > warren_cluster::queue::MAX_MESSAGE {
            return Err(StoreError(format!(
                "quorum queue '{}': a message of {} bytes is over the replicated limit ({} bytes)",
                local.group.name,
                record.len(),
                warren_cluster::queue::MAX_MESSAGE
            )));
        }
        local
            .messages
            .insert(seq, (message.clone(), expires_at, false));
        self.pending.push((
            local.group.clone(),
            local.session,
            QueueOp::Append {
                seq: local.key(seq),
                expires_at,
                message: record,
            },
        ));
        Ok(())
    }

    fn serves(&self, queue: QueueId) -> bool {
        match self.quorum.get(&queue) {
            Some(local) => local.serving,
            None => self.inner.serves(queue),
        }
    }

    fn remove(&mut self, queue: QueueId, seq: u64) {
        let Some(local) = self.quorum.get_mut(&queue) else {
            return self.inner.remove(queue, seq);
        };
        if local.messages.remove(&seq).is_some() && local.serving {
            let seq = local.key(seq);
            self.pending
                .push((local.group.clone(), local.session, QueueOp::Remove { seq }));
        }
    }

    fn remove_from(&mut self, queue: QueueId, from_seq: u64) {
        let Some(local) = self.quorum.get_mut(&queue) else {
            return self.inner.remove_from(queue, from_seq);
        };
        local.messages.split_off(&from_seq);
        if local.serving {
            let seq = local.key(from_seq);
            self.pending.push((
                local.group.clone(),
                local.session,
                QueueOp::RemoveFrom { seq },
            ));
        }
    }

    fn read(
        &mut self,
        queue: QueueId,
        from_seq: u64,
        max: usize,
        out: &mut Vec<StoredMessage>,
    ) -> Result<(), StoreError> {
        let Some(local) = self.quorum.get(&queue) else {
            return self.inner.read(queue, from_seq, max, out);
        };
        out.extend(local.messages.range(from_seq..).take(max).map(
            |(seq, (message, expires_at, redelivered))| StoredMessage {
                seq: *seq,
                message: message.clone(),
                redelivered: *redelivered,
                expires_at: *expires_at,
            },
        ));
        Ok(())
    }

    fn delete_queue(&mut self, queue: QueueId) {
        if let Some(local) = self.quorum.remove(&queue)
            && !local.dead_letters
        {
            // (The dead-letter log goes with its queue's group.)
            self.pending.retain(|(g, _, _)| g.id != local.group.id);
            self.repl.delete(&local.group.vhost, &local.group.name);
        }
        self.names.remove(&queue);
        self.inner.delete_queue(queue);
    }

    fn sync(&mut self, epoch: u64) {
        let batches = self.take_batches();
        // Fails only when the runtime is shutting down: nothing to confirm then.
        let _ = self.jobs.send(Job(epoch, batches));
        self.inner.sync(epoch);
    }

    fn flush(&mut self) {
        // A quorum queue's removals wait for the next sync (the core starts one within
        // `removal_sync_ms` of a removal): one log entry for many acks, not one each.
        self.inner.flush();
    }

    fn stream_open(
        &mut self,
        queue: QueueId,
        vhost: &str,
        name: &str,
        settings: &StreamSettings,
    ) -> Result<StreamBounds, StoreError> {
        self.inner.stream_open(queue, vhost, name, settings)
    }

    fn stream_append(
        &mut self,
        queue: QueueId,
        data: Bytes,
        timestamp_ms: u64,
    ) -> Result<(), StoreError> {
        self.inner.stream_append(queue, data, timestamp_ms)
    }

    fn stream_bounds(&mut self, queue: QueueId) -> Result<StreamBounds, StoreError> {
        self.inner.stream_bounds(queue)
    }

    fn stream_start(&mut self, queue: QueueId, start: StreamStart) -> Result<u64, StoreError> {
        self.inner.stream_start(queue, start)
    }

    fn stream_read(
        &mut self,
        queue: QueueId,
        from: u64,
        max: usize,
        out: &mut Vec<StreamEntry>,
    ) -> Result<(), StoreError> {
        self.inner.stream_read(queue, from, max, out)
    }

    // The schedule of delayed messages is this node's own (docs/delayed.md): the disk
    // store's, not replicated.
    fn schedule_add(&mut self, m: &warren_core::store::ScheduledMessage) -> Result<(), StoreError> {
        self.inner.schedule_add(m)
    }

    fn schedule_remove(&mut self, key: warren_core::store::ScheduleKey) {
        self.inner.schedule_remove(key)
    }

    fn schedule_read(
        &mut self,
        after: Option<warren_core::store::ScheduleKey>,
        max: usize,
        out: &mut Vec<warren_core::store::ScheduledMessage>,
    ) -> Result<(), StoreError> {
        self.inner.schedule_read(after, max, out)
    }

    fn schedule_purge(&mut self, vhost: &str, exchange: &str) -> u64 {
        self.inner.schedule_purge(vhost, exchange)
    }

    fn schedule_recover(&mut self) -> warren_core::store::ScheduleRecovery {
        self.inner.schedule_recover()
    }
}

#[cfg(test)]
mod tests {
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
