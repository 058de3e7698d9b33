//! The metadata group on the in-process network (3 and 5 nodes in one test process, each
//! with its real redb log and snapshot file in a temporary directory): seeded sequences of
//! writes, crashes, restarts and partitions. Checked after every scenario:
//! - every acknowledged write is applied on every node;
//! - nodes that applied up to the same index applied the same commands in the same order
//!   (the definitions' hash chain is equal);
//! - a restarted node catches up, from the log or from a snapshot.
//!
//! Waits are openraft's own (`Raft::wait` on metrics) with small election timeouts; the
//! scenario is a function of the seed (printed on failure).

use std::collections::BTreeMap;
use std::time::Duration;

use openraft::error::{ClientWriteError, RaftError};
use openraft::{BasicNode, ServerState};
use warren_cluster::definitions::{DefCommand, DefReply, Definitions};
use warren_cluster::log_store::LogStore;
use warren_cluster::mem::Router;
use warren_cluster::state_machine::StateMachineStore;
use warren_cluster::{NodeId, Raft};

/// A bound on every wait: far above an election (20-40 ms here).
const WAIT: Duration = Duration::from_secs(10);
/// A write that is not answered in this long counts as unknown (not acknowledged).
const WRITE_TIMEOUT: Duration = Duration::from_secs(2);

/// xorshift64*: the scenario's only source of choices.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

struct Node {
    raft: Raft,
    sm: StateMachineStore<Definitions>,
}

struct Sim {
    router: Router,
    dir: tempfile::TempDir,
    ids: Vec<NodeId>,
    live: BTreeMap<NodeId, Node>,
    /// Nodes cut from the rest (the minority side), if a partition is on.
    cut: Vec<NodeId>,
    snapshot_every: u64,
    /// key -> value of every acknowledged write.
    acked: BTreeMap<String, Vec<u8>>,
    next_key: u64,
    seed: u64,
}

impl Sim {
    async fn new(n: u64, seed: u64, snapshot_every: u64) -> Self {
        let mut sim = Sim {
            router: Router::new(),
            dir: tempfile::tempdir().expect("tempdir"),
            ids: (1..=n).collect(),
            live: BTreeMap::new(),
            cut: Vec::new(),
            snapshot_every,
            acked: BTreeMap::new(),
            next_key: 0,
            seed,
        };
        for id in sim.ids.clone() {
            sim.start(id).await;
        }
        let members: BTreeMap<NodeId, BasicNode> = sim
            .ids
            .iter()
            .map(|id| (*id, BasicNode::new(format!("mem-{id}"))))
            .collect();
        // Every node starts from the same membership, as ClusterNode does: a partition right
        // after start must not leave the majority without knowing it is the cluster.
        for n in sim.live.values() {
            match n.raft.initialize(members.clone()).await {
                Ok(()) => {}
                Err(RaftError::APIError(openraft::error::InitializeError::NotAllowed(_))) => {}
                Err(e) => panic!("initialize: {e}"),
            }
        }
        // A node that voted before its own initialize learns the membership from the leader:
        // wait for that before any fault (a voter that does not know it is one cannot vote).
        for node in sim.live.values() {
            node.raft
                .wait(Some(WAIT))
                .metrics(
                    |m| m.membership_config.membership().voter_ids().count() == n as usize,
                    "membership known",
                )
                .await
                .expect("membership replicated");
        }
        sim
    }

    /// Starts node `id` on its files (new or left by an earlier run of it).
    async fn start(&mut self, id: NodeId) {
        let dir = self.dir.path().join(format!("n{id}"));
        // A node killed a moment ago may still have a task of its old Raft holding the file
        // (openraft's replication tasks end asynchronously after shutdown): wait for them.
        let deadline = tokio::time::Instant::now() + WAIT;
        let log = loop {
            match LogStore::open(&dir.join("meta.redb")) {
                Ok(log) => break log,
                Err(redb::Error::DatabaseAlreadyOpen) if tokio::time::Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                Err(e) => panic!("seed {}: node {id}'s log: {e}", self.seed),
            }
        };
        let sm = StateMachineStore::open(Some(&dir.join("meta.snapshot")), Definitions::new())
            .expect("snapshot");
        // Small timeouts: an election takes tens of milliseconds.
        let config = warren_cluster::raft_config(10, 40, self.snapshot_every).expect("config");
        let raft = Raft::new(id, config, self.router.network(id), log, sm.clone())
            .await
            .expect("raft");
        self.router.add(id, raft.clone());
        self.live.insert(id, Node { raft, sm });
    }

    /// A crash: the node stops answering and its process state is gone; files stay.
    async fn kill(&mut self, id: NodeId) {
        self.router.remove(id);
        if let Some(n) = self.live.remove(&id) {
            let _ = n.raft.shutdown().await;
        }
    }

    fn majority_side(&self) -> Vec<NodeId> {
        self.live
            .keys()
            .copied()
            .filter(|id| !self.cut.contains(id))
            .collect()
    }

    /// Waits until a live node on the majority side is leader and returns it.
    async fn leader(&self) -> NodeId {
        let side = self.majority_side();
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            // The highest term wins: a node restarted a moment ago may still believe in the
            // leadership of its old term.
            let best = side
                .iter()
                .map(|id| (self.live[id].raft.metrics().borrow().clone(), *id))
                .filter(|(m, _)| m.state == ServerState::Leader)
                .max_by_key(|(m, _)| m.current_term);
            if let Some((_, id)) = best {
                return id;
            }
            if tokio::time::Instant::now() >= deadline {
                for (id, n) in &self.live {
                    let m = n.raft.metrics().borrow().clone();
                    eprintln!(
                        "node {id}: {:?} term {} vote {} leader {:?} last {:?} applied {:?}",
                        m.state,
                        m.current_term,
                        m.vote,
                        m.current_leader,
                        m.last_log_index,
                        m.last_applied
                    );
                }
                panic!("seed {}: no leader among {side:?} in {WAIT:?}", self.seed);
            }
            // Wait for the next change of any metrics on the majority side (openraft's own
            // notification, not a sleep), bounded by one election timeout period.
            let waits = side.iter().map(|id| {
                let mut rx = self.live[id].raft.metrics();
                let f: std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> =
                    Box::pin(async move {
                        let _ = rx.changed().await;
                    });
                f
            });
            let _ = tokio::time::timeout(
                Duration::from_millis(100),
                futures_select_any(waits.collect()),
            )
            .await;
        }
    }

    /// Proposes `count` new keys through the current leader; remembers the acknowledged ones.
    async fn write(&mut self, count: usize) {
        for _ in 0..count {
            self.next_key += 1;
            let key = format!("queue/{}", self.next_key);
            let value = format!("v{}-{}", self.seed, self.next_key).into_bytes();
            let cmd = DefCommand::Put {
                key: key.clone(),
                record: value.clone(),
            };
            // A node that answers "not the leader" did not propose it: try the leader again
            // (a few times: leadership may move while we ask).
            for _attempt in 0..20 {
                let leader = self.leader().await;
                let raft = self.live[&leader].raft.clone();
                match tokio::time::timeout(WRITE_TIMEOUT, raft.client_write(cmd.encode())).await {
                    Ok(Ok(r)) => {
                        assert_eq!(
                            DefReply::decode(&r.data).expect("reply"),
                            DefReply::Done { previous: None }
                        );
                        self.acked.insert(key, value);
                        break;
                    }
                    Ok(Err(RaftError::APIError(ClientWriteError::ForwardToLeader(_)))) => {
                        let mut rx = raft.metrics();
                        let _ = tokio::time::timeout(Duration::from_millis(50), rx.changed()).await;
                    }
                    Ok(Err(e)) => panic!("seed {}: write failed: {e}", self.seed),
                    // Proposed but not committed in time (lost leadership meanwhile): the
                    // outcome is unknown, as a client would see it. Not acknowledged, not
                    // checked, and not retried (it may yet commit).
                    Err(_) => break,
                }
            }
        }
    }

    /// Heals, restarts every stopped node, waits for all to apply the same log, and checks
    /// the invariants.
    async fn converge_and_check(&mut self) {
        self.router.heal();
        self.cut.clear();
        for id in self.ids.clone() {
            if !self.live.contains_key(&id) {
                self.start(id).await;
            }
        }
        // One more write: committed in the current term, so everything before it is too.
        self.write(1).await;
        let leader = self.leader().await;
        let last = self.live[&leader]
            .raft
            .metrics()
            .borrow()
            .last_log_index
            .expect("leader has a log");
        for (id, n) in &self.live {
            n.raft
                .wait(Some(WAIT))
                .applied_index_at_least(Some(last), "catch up")
                .await
                .unwrap_or_else(|e| panic!("seed {}: node {id} did not catch up: {e}", self.seed));
        }
        let (digest, applied) = self.live[&leader].sm.with(|d| (d.digest(), d.applied()));
        for (id, n) in &self.live {
            let last_applied = n.sm.last_applied().map(|l| l.index);
            // Entries after `last` may be applied on some nodes only (none are proposed, but
            // blank leader entries could be): compare at the same applied index.
            if last_applied == self.live[&leader].sm.last_applied().map(|l| l.index) {
                n.sm.with(|d| {
                    assert_eq!(
                        (d.digest(), d.applied()),
                        (digest, applied),
                        "seed {}: node {id} applied other commands or another order",
                        self.seed
                    );
                });
            }
            n.sm.with(|d| {
                for (k, v) in &self.acked {
                    assert_eq!(
                        d.get(k),
                        Some(v.as_slice()),
                        "seed {}: node {id} lost acknowledged write {k}",
                        self.seed
                    );
                }
            });
        }
    }

    async fn shutdown(mut self) {
        for id in self.ids.clone() {
            self.kill(id).await;
        }
    }
}

/// Resolves when the first of `futs` does (a tiny select without another dependency).
async fn futures_select_any(
    mut futs: Vec<std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + '_>>>,
) {
    std::future::poll_fn(|cx| {
        for f in futs.iter_mut() {
            if f.as_mut().poll(cx).is_ready() {
                return std::task::Poll::Ready(());
            }
        }
        std::task::Poll::Pending
    })
    .await
}

/// A seeded run: `rounds` steps, each a burst of writes with a fault before it. At most a
/// minority is down or cut off at a time, so the group stays available throughout.
async fn run(n: u64, seed: u64, rounds: usize) {
    let mut sim = Sim::new(n, seed, 50).await;
    let mut rng = Rng(seed | 1);
    let minority = ((n - 1) / 2) as usize;
    let mut faults = 0;
    for _ in 0..rounds {
        let down = sim.ids.len() - sim.live.len() + sim.cut.len();
        match rng.below(6) {
            // Crash a node (the leader half of the time).
            0 | 1 if down < minority => {
                let victim = if rng.below(2) == 0 {
                    sim.leader().await
                } else {
                    let live: Vec<_> = sim.majority_side();
                    live[rng.below(live.len() as u64) as usize]
                };
                eprintln!("seed {seed}: kill {victim}");
                faults += 1;
                sim.kill(victim).await;
            }
            // Restart a crashed node.
            2 if sim.live.len() < sim.ids.len() => {
                let dead: Vec<_> = sim
                    .ids
                    .iter()
                    .copied()
                    .filter(|id| !sim.live.contains_key(id))
                    .collect();
                let id = dead[rng.below(dead.len() as u64) as usize];
                eprintln!("seed {seed}: start {id}");
                sim.start(id).await;
            }
            // Cut the leader (and maybe one more) from the rest.
            3 if down == 0 && sim.cut.is_empty() => {
                let mut side = vec![sim.leader().await];
                if minority >= 2 {
                    let others: Vec<_> =
                        sim.ids.iter().copied().filter(|i| *i != side[0]).collect();
                    side.push(others[rng.below(others.len() as u64) as usize]);
                }
                eprintln!("seed {seed}: partition {side:?}");
                faults += 1;
                sim.router.partition(&side, &sim.ids);
                sim.cut = side;
            }
            4 => {
                eprintln!("seed {seed}: heal");
                sim.router.heal();
                sim.cut.clear();
            }
            _ => {}
        }
        let burst = 1 + rng.below(8) as usize;
        sim.write(burst).await;
    }
    sim.converge_and_check().await;
    eprintln!(
        "{n} nodes, seed {seed}: {faults} faults (crashes and partitions), {} writes acknowledged and checked on every node",
        sim.acked.len()
    );
    assert!(
        sim.acked.len() >= rounds / 2,
        "seed {seed}: only {} writes acknowledged in {rounds} rounds",
        sim.acked.len()
    );
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nodes_crashes_and_partitions_seeded() {
    for seed in [1, 2, 3, 4, 5] {
        run(3, seed, 60).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_nodes_crashes_and_partitions_seeded() {
    for seed in [11, 12, 13] {
        run(5, seed, 60).await;
    }
}

/// A member that joins after the others snapshotted and purged their logs is brought up by
/// InstallSnapshot (the log it would need is gone), and its state is the others'. A member
/// that restarts loads its own snapshot file and re-applies only the log after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_member_catches_up_from_a_snapshot_and_restart_loads_its_own() {
    let mut sim = Sim::new(3, 7, 20).await;
    sim.write(120).await;
    let leader = sim.leader().await;
    let m = sim.live[&leader].raft.metrics().borrow().clone();
    assert!(m.snapshot.is_some(), "leader built no snapshot");
    // Purging waits until no replication uses the range; all three nodes are up.
    sim.live[&leader]
        .raft
        .wait(Some(WAIT))
        .metrics(|m| m.purged.map(|p| p.index).unwrap_or(0) > 10, "purged")
        .await
        .expect("leader purged its log after the snapshot");

    // Node 4 joins as a learner with an empty log.
    sim.ids.push(4);
    sim.start(4).await;
    sim.live[&leader]
        .raft
        .add_learner(4, BasicNode::new("mem-4"), true)
        .await
        .expect("add learner");
    sim.converge_and_check().await;
    let m = sim.live[&4].raft.metrics().borrow().clone();
    assert!(
        m.snapshot.map(|s| s.index).unwrap_or(0) > 10,
        "node 4 caught up without a snapshot: {:?}",
        m.snapshot
    );

    // A follower restarts: its snapshot file gives it the state up to the snapshot at once.
    let follower = sim
        .ids
        .iter()
        .copied()
        .find(|id| *id != leader && *id != 4)
        .expect("a follower");
    sim.kill(follower).await;
    sim.start(follower).await;
    let restored = sim.live[&follower].sm.last_applied().map(|l| l.index);
    assert!(
        restored.unwrap_or(0) > 10,
        "node {follower} did not load its snapshot on restart: {restored:?}"
    );
    sim.converge_and_check().await;
    sim.shutdown().await;
}

/// Every node stops at once (as a power cut) and restarts from its files: nothing
/// acknowledged is lost, and the group elects a leader and takes writes again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn whole_cluster_restart_keeps_acknowledged_writes() {
    let mut sim = Sim::new(3, 9, 1000).await;
    sim.write(40).await;
    assert_eq!(
        sim.acked.len(),
        40,
        "no fault yet: every write is acknowledged"
    );
    for id in sim.ids.clone() {
        sim.kill(id).await;
    }
    for id in sim.ids.clone() {
        sim.start(id).await;
    }
    sim.write(5).await;
    sim.converge_and_check().await;
    assert!(sim.acked.len() >= 41);
    sim.shutdown().await;
}

/// The check itself: a node whose applied commands differ would be caught (the set of
/// acknowledged keys is compared on every node).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checker_catches_a_missing_write() {
    let mut sim = Sim::new(3, 5, 1000).await;
    sim.write(3).await;
    sim.acked
        .insert("queue/never-written".into(), b"x".to_vec());
    let r = tokio::spawn(async move {
        sim.converge_and_check().await;
    })
    .await;
    assert!(r.is_err(), "the checker accepted a write no node has");
}
