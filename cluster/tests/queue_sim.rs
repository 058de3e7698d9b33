//! A quorum queue's group (`warren_cluster::queue::QueueReplica`) on the in-process network:
//! 3 members with real redb logs and snapshot files, a snapshot every 8 entries (so a member
//! down for a while catches up by snapshot), seeded sequences of batches (appends, removes,
//! purges) through the leader while members, the leader included, are killed and restarted.
//! Checked at the end: every member holds exactly the messages the acknowledged batches
//! leave (a model applied in acknowledgement order), and the same next sequence number.
//!
//! A second scenario changes the group's members as `warren ctl quorum add-member` /
//! `delete-member` do (a fresh node added as a learner, then a voter; a voter removed and its
//! files deleted; the leader itself sometimes), between batches, over a pool of five nodes:
//! every member at the end, however it joined (log or snapshot), holds the model.

use std::collections::BTreeMap;
use std::time::Duration;

use openraft::error::{ClientWriteError, RaftError};
use openraft::{BasicNode, ServerState};
use warren_cluster::log_store::LogStore;
use warren_cluster::mem::Router;
use warren_cluster::queue::{DEAD_LETTER_BIT, QueueCommand, QueueOp, QueueReplica, STALE};
use warren_cluster::state_machine::StateMachineStore;
use warren_cluster::{NodeId, Raft};

const WAIT: Duration = Duration::from_secs(10);

struct Rng(u64);
impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) % n
    }
}

struct Sim {
    router: Router,
    dir: tempfile::TempDir,
    live: BTreeMap<NodeId, (Raft, StateMachineStore<QueueReplica>)>,
    seed: u64,
}

impl Sim {
    async fn start(&mut self, id: NodeId) {
        let dir = self.dir.path().join(format!("n{id}"));
        let deadline = tokio::time::Instant::now() + WAIT;
        let log = loop {
            match LogStore::open(&dir.join("q.redb")) {
                Ok(log) => break log,
                Err(redb::Error::DatabaseAlreadyOpen) if tokio::time::Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                Err(e) => panic!("seed {}: node {id}'s log: {e}", self.seed),
            }
        };
        let sm = StateMachineStore::open(Some(&dir.join("q.snapshot")), QueueReplica::new())
            .expect("snapshot");
        let config = warren_cluster::raft_config(10, 40, 8).expect("config");
        let raft = Raft::new(id, config, self.router.network(id), log, sm.clone())
            .await
            .expect("raft");
        self.router.add(id, raft.clone());
        self.live.insert(id, (raft, sm));
    }

    async fn kill(&mut self, id: NodeId) {
        self.router.remove(id);
        if let Some((raft, _)) = self.live.remove(&id) {
            let _ = raft.shutdown().await;
        }
    }

    async fn leader(&self) -> NodeId {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let best = self
                .live
                .iter()
                .map(|(id, (r, _))| (r.metrics().borrow().clone(), *id))
                .filter(|(m, _)| m.state == ServerState::Leader)
                .max_by_key(|(m, _)| m.current_term);
            if let Some((_, id)) = best {
                return id;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "seed {}: no leader",
                self.seed
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Commits `ops` through the leader, retrying until acknowledged: every op is
    /// idempotent (an append of the same sequence number and bytes, a remove), as the
    /// broker's writes are.
    async fn commit(&self, ops: Vec<QueueOp>) {
        let cmd = QueueCommand(ops).encode();
        for _ in 0..100 {
            let leader = self.leader().await;
            let raft = self.live[&leader].0.clone();
            match tokio::time::timeout(Duration::from_secs(2), raft.client_write(cmd.clone())).await
            {
                Ok(Ok(r)) => {
                    assert!(r.data.0.is_empty(), "seed {}: refused", self.seed);
                    return;
                }
                Ok(Err(RaftError::APIError(ClientWriteError::ForwardToLeader(_)))) | Err(_) => {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                Ok(Err(e)) => panic!("seed {}: write failed: {e}", self.seed),
            }
        }
        panic!("seed {}: a batch was never committed", self.seed);
    }
}

async fn scenario(seed: u64) {
    let mut sim = Sim {
        router: Router::new(),
        dir: tempfile::tempdir().expect("tempdir"),
        live: BTreeMap::new(),
        seed,
    };
    let ids: Vec<NodeId> = vec![1, 2, 3];
    for id in &ids {
        sim.start(*id).await;
    }
    let members: BTreeMap<NodeId, BasicNode> = ids
        .iter()
        .map(|id| (*id, BasicNode::new(format!("mem-{id}"))))
        .collect();
    for (raft, _) in sim.live.values() {
        match raft.initialize(members.clone()).await {
            Ok(()) | Err(RaftError::APIError(openraft::error::InitializeError::NotAllowed(_))) => {}
            Err(e) => panic!("initialize: {e}"),
        }
    }
    let mut rng = Rng(seed | 1);
    let mut model: BTreeMap<u64, Vec<u8>> = BTreeMap::new();
    let mut next_seq = 0u64;
    // The queue's dead-letter log rides in the same group (at-least-once dead-lettering):
    // its numbers carry DEAD_LETTER_BIT, and a purge of either leaves the other.
    let mut next_dead = 0u64;
    for _round in 0..40 {
        // A fault now and then: one member down at most (the group keeps its majority).
        match rng.below(6) {
            0 if sim.live.len() == 3 => {
                let victim = if rng.below(2) == 0 {
                    sim.leader().await
                } else {
                    ids[rng.below(3) as usize]
                };
                sim.kill(victim).await;
            }
            1 if sim.live.len() < 3 => {
                let down = ids
                    .iter()
                    .copied()
                    .find(|id| !sim.live.contains_key(id))
                    .expect("a member is down");
                sim.start(down).await;
            }
            _ => {}
        }
        let mut ops = Vec::new();
        for _ in 0..1 + rng.below(5) {
            match rng.below(14) {
                0..=5 => {
                    let message = format!("m{seed}-{next_seq}").into_bytes();
                    ops.push(QueueOp::Append {
                        seq: next_seq,
                        expires_at: None,
                        message: message.clone(),
                    });
                    model.insert(next_seq, message);
                    next_seq += 1;
                }
                6..=8 if !model.is_empty() => {
                    let keys: Vec<u64> = model.keys().copied().collect();
                    let seq = keys[rng.below(keys.len() as u64) as usize];
                    ops.push(QueueOp::Remove { seq });
                    model.remove(&seq);
                }
                9 if next_seq > 4 => {
                    let seq = next_seq - 1 - rng.below(4);
                    ops.push(QueueOp::RemoveFrom { seq });
                    let mut from = model.split_off(&seq);
                    model.append(&mut from.split_off(&DEAD_LETTER_BIT));
                }
                10 | 11 => {
                    let seq = DEAD_LETTER_BIT | next_dead;
                    let message = format!("d{seed}-{next_dead}").into_bytes();
                    ops.push(QueueOp::Append {
                        seq,
                        expires_at: None,
                        message: message.clone(),
                    });
                    model.insert(seq, message);
                    next_dead += 1;
                }
                12 if model.keys().any(|s| s & DEAD_LETTER_BIT != 0) => {
                    let dead: Vec<u64> = model.range(DEAD_LETTER_BIT..).map(|(s, _)| *s).collect();
                    let seq = dead[rng.below(dead.len() as u64) as usize];
                    ops.push(QueueOp::Remove { seq });
                    model.remove(&seq);
                }
                13 if next_dead > 2 => {
                    let seq = DEAD_LETTER_BIT | (next_dead - 1 - rng.below(3));
                    ops.push(QueueOp::RemoveFrom { seq });
                    model.split_off(&seq);
                }
                _ => {}
            }
        }
        sim.commit(ops).await;
    }
    assert!(
        next_dead > 0,
        "seed {seed}: the dead-letter log was written"
    );
    for id in &ids {
        if !sim.live.contains_key(id) {
            sim.start(*id).await;
        }
    }
    // One more entry in the current term: everything before it is committed with it.
    sim.commit(Vec::new()).await;
    let leader = sim.leader().await;
    let last = sim.live[&leader].0.metrics().borrow().last_log_index;
    for (id, (raft, sm)) in &sim.live {
        raft.wait(Some(WAIT))
            .applied_index_at_least(last, "catch up")
            .await
            .unwrap_or_else(|e| panic!("seed {seed}: node {id} did not catch up: {e}"));
        let (held, next) = sm.with(|r| {
            (
                r.messages
                    .iter()
                    .map(|(s, h)| (*s, h.message.clone()))
                    .collect::<BTreeMap<_, _>>(),
                r.next_seq,
            )
        });
        assert_eq!(held, model, "seed {seed}: node {id}'s messages");
        assert_eq!(
            next, next_seq,
            "seed {seed}: node {id}'s next sequence number"
        );
    }
    for id in ids {
        sim.kill(id).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_groups_converge_through_crashes_and_snapshots() {
    let seeds: Vec<u64> = match std::env::var("WARREN_SIM_SEED") {
        Ok(s) => vec![s.parse().expect("WARREN_SIM_SEED is a number")],
        Err(_) => vec![1, 2, 3],
    };
    for seed in seeds {
        tokio::time::timeout(Duration::from_secs(120), scenario(seed))
            .await
            .unwrap_or_else(|_| panic!("seed {seed}: scenario did not finish"));
    }
}

async fn membership_scenario(seed: u64) {
    let mut sim = Sim {
        router: Router::new(),
        dir: tempfile::tempdir().expect("tempdir"),
        live: BTreeMap::new(),
        seed,
    };
    let pool: Vec<NodeId> = vec![1, 2, 3, 4, 5];
    let mut voters: std::collections::BTreeSet<NodeId> = [1, 2, 3].into();
    for id in &voters {
        sim.start(*id).await;
    }
    let members: BTreeMap<NodeId, BasicNode> = voters
        .iter()
        .map(|id| (*id, BasicNode::new(format!("mem-{id}"))))
        .collect();
    for (raft, _) in sim.live.values() {
        match raft.initialize(members.clone()).await {
            Ok(()) | Err(RaftError::APIError(openraft::error::InitializeError::NotAllowed(_))) => {}
            Err(e) => panic!("initialize: {e}"),
        }
    }
    // The first membership committed (a change before it is refused as one in progress).
    sim.commit(Vec::new()).await;
    let mut rng = Rng(seed | 1);
    let mut model: BTreeMap<u64, Vec<u8>> = BTreeMap::new();
    let mut next_seq = 0u64;
    let (mut added, mut removed) = (0, 0);
    for _round in 0..40 {
        match rng.below(5) {
            // add-member: a node of the pool that is not a member, from a fresh data dir.
            0 if voters.len() < 4 => {
                let outside: Vec<NodeId> = pool
                    .iter()
                    .copied()
                    .filter(|id| !voters.contains(id))
                    .collect();
                let id = outside[rng.below(outside.len() as u64) as usize];
                sim.start(id).await;
                let leader = sim.leader().await;
                let raft = sim.live[&leader].0.clone();
                let learner = raft.add_learner(id, BasicNode::new(format!("mem-{id}")), true);
                match tokio::time::timeout(WAIT, learner).await {
                    Ok(Ok(_)) => {}
                    Ok(Err(e)) => panic!("seed {seed}: add learner {id}: {e}"),
                    Err(_) => panic!("seed {seed}: learner {id} never caught up"),
                }
                let mut next = voters.clone();
                next.insert(id);
                raft.change_membership(next.clone(), false)
                    .await
                    .unwrap_or_else(|e| panic!("seed {seed}: add voter {id}: {e}"));
                voters = next;
                added += 1;
            }
            // delete-member: any voter (the leader too), then its copy goes.
            1 if voters.len() > 2 => {
                let list: Vec<NodeId> = voters.iter().copied().collect();
                let id = list[rng.below(list.len() as u64) as usize];
                let leader = sim.leader().await;
                let raft = sim.live[&leader].0.clone();
                let mut next = voters.clone();
                next.remove(&id);
                raft.change_membership(next.clone(), false)
                    .await
                    .unwrap_or_else(|e| panic!("seed {seed}: remove voter {id}: {e}"));
                voters = next;
                sim.kill(id).await;
                let _ = std::fs::remove_dir_all(sim.dir.path().join(format!("n{id}")));
                removed += 1;
            }
            _ => {}
        }
        let mut ops = Vec::new();
        for _ in 0..1 + rng.below(5) {
            if rng.below(10) < 7 || model.is_empty() {
                let message = format!("m{seed}-{next_seq}").into_bytes();
                ops.push(QueueOp::Append {
                    seq: next_seq,
                    expires_at: None,
                    message: message.clone(),
                });
                model.insert(next_seq, message);
                next_seq += 1;
            } else {
                let keys: Vec<NodeId> = model.keys().copied().collect();
                let seq = keys[rng.below(keys.len() as u64) as usize];
                ops.push(QueueOp::Remove { seq });
                model.remove(&seq);
            }
        }
        sim.commit(ops).await;
    }
    sim.commit(Vec::new()).await;
    let leader = sim.leader().await;
    let last = sim.live[&leader].0.metrics().borrow().last_log_index;
    let live: Vec<NodeId> = sim.live.keys().copied().collect();
    assert_eq!(
        live,
        voters.iter().copied().collect::<Vec<_>>(),
        "seed {seed}: the live nodes are the members"
    );
    for (id, (raft, sm)) in &sim.live {
        raft.wait(Some(WAIT))
            .applied_index_at_least(last, "catch up")
            .await
            .unwrap_or_else(|e| panic!("seed {seed}: node {id} did not catch up: {e}"));
        let (held, next) = sm.with(|r| {
            (
                r.messages
                    .iter()
                    .map(|(s, h)| (*s, h.message.clone()))
                    .collect::<BTreeMap<_, _>>(),
                r.next_seq,
            )
        });
        assert_eq!(held, model, "seed {seed}: node {id}'s messages");
        assert_eq!(
            next, next_seq,
            "seed {seed}: node {id}'s next sequence number"
        );
    }
    eprintln!(
        "seed {seed}: {added} members added, {removed} removed, {} messages held",
        model.len()
    );
    assert!(
        added > 0 && removed > 0,
        "seed {seed}: the scenario changed no membership"
    );
    for id in voters {
        sim.kill(id).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_groups_converge_through_membership_changes() {
    let seeds: Vec<u64> = match std::env::var("WARREN_SIM_SEED") {
        Ok(s) => vec![s.parse().expect("WARREN_SIM_SEED is a number")],
        Err(_) => vec![1, 2, 3],
    };
    for seed in seeds {
        tokio::time::timeout(Duration::from_secs(120), membership_scenario(seed))
            .await
            .unwrap_or_else(|_| panic!("seed {seed}: scenario did not finish"));
    }
}

impl Sim {
    /// Writes `cmd` through the leader (retried while leadership moves): the state
    /// machine's reply.
    async fn write(&self, cmd: warren_cluster::Command) -> Vec<u8> {
        for _ in 0..100 {
            let leader = self.leader().await;
            let raft = self.live[&leader].0.clone();
            match tokio::time::timeout(Duration::from_secs(2), raft.client_write(cmd.clone())).await
            {
                Ok(Ok(r)) => return r.data.0,
                Ok(Err(RaftError::APIError(ClientWriteError::ForwardToLeader(_)))) | Err(_) => {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                Ok(Err(e)) => panic!("write failed: {e}"),
            }
        }
        panic!("a write was never committed");
    }

    /// What a leader does before its broker loads the queue: commits a session start, whose
    /// log index names the session.
    async fn start_session(&self) -> u64 {
        let cmd = QueueCommand::encode_session_start();
        for _ in 0..100 {
            let leader = self.leader().await;
            let raft = self.live[&leader].0.clone();
            if let Ok(Ok(r)) =
                tokio::time::timeout(Duration::from_secs(2), raft.client_write(cmd.clone())).await
            {
                assert!(r.data.0.is_empty(), "a session start is never refused");
                return r.log_id.index;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        panic!("no session start was committed");
    }
}

fn append(seq: u64, body: &str) -> QueueOp {
    QueueOp::Append {
        seq,
        expires_at: None,
        message: body.as_bytes().to_vec(),
    }
}

/// The loss `jepsen::three_nodes_quorum_queue_under_faults` found (docs/cluster.md, "Quorum
/// queues"): a leader's broker made writes from the queue as it had loaded it (a
/// publish under the next sequence number, an ack of another), and their proposal reached
/// the log only after a leader change (here: another leader; in the Jepsen runs the same
/// node, which lost the leadership and took it back within a millisecond) whose broker had
/// loaded the queue again and numbered new publishes from the group's copy. Applied, the
/// late write put another message under a sequence number a confirmed message had (and
/// removed one still owed): that confirmed message was gone from every member. A write
/// names the serving session it was made in, and every member refuses one of an earlier
/// session, the same way on every replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_of_an_earlier_serving_session_never_apply() {
    let mut sim = Sim {
        router: Router::new(),
        dir: tempfile::tempdir().expect("tempdir"),
        live: BTreeMap::new(),
        seed: 0,
    };
    let ids: Vec<NodeId> = vec![1, 2, 3];
    for id in &ids {
        sim.start(*id).await;
    }
    let members: BTreeMap<NodeId, BasicNode> = ids
        .iter()
        .map(|id| (*id, BasicNode::new(format!("mem-{id}"))))
        .collect();
    for (raft, _) in sim.live.values() {
        match raft.initialize(members.clone()).await {
            Ok(()) | Err(RaftError::APIError(openraft::error::InitializeError::NotAllowed(_))) => {}
            Err(e) => panic!("initialize: {e}"),
        }
    }
    let s1 = sim.start_session().await;
    for (seq, body) in [(0, "a"), (1, "b")] {
        let cmd = QueueCommand(vec![append(seq, body)]).encode_in(s1);
        assert!(
            sim.write(cmd).await.is_empty(),
            "a write of the session applies"
        );
    }
    // The leader dies; the next one starts its session and numbers its publishes from its
    // copy (next 2), and one is confirmed.
    let old = sim.leader().await;
    sim.kill(old).await;
    let s2 = sim.start_session().await;
    assert!(s2 > s1);
    let new = QueueCommand(vec![append(2, "confirmed")]).encode_in(s2);
    assert!(sim.write(new).await.is_empty());
    // The old session's last sync, proposed late: another message under 2, an ack of 1.
    let late = QueueCommand(vec![append(2, "late"), QueueOp::Remove { seq: 1 }]).encode_in(s1);
    assert_eq!(sim.write(late.clone()).await, STALE.to_vec());
    // The old leader comes back and replays the log: the same decision.
    sim.start(old).await;
    // The same node starting a new session (it lost the leadership and won it back): the
    // writes made before it are refused too.
    let s3 = sim.start_session().await;
    assert!(s3 > s2);
    let before = QueueCommand(vec![append(3, "before")]).encode_in(s2);
    assert_eq!(sim.write(before).await, STALE.to_vec());
    assert_eq!(sim.write(late).await, STALE.to_vec());
    let after = QueueCommand(vec![append(3, "after")]).encode_in(s3);
    assert!(sim.write(after).await.is_empty());
    // Unfenced writes (format 1, from a log written before sessions) still apply.
    assert!(
        sim.write(QueueCommand(Vec::new()).encode())
            .await
            .is_empty()
    );
    let leader = sim.leader().await;
    let last = sim.live[&leader].0.metrics().borrow().last_log_index;
    let want: BTreeMap<u64, Vec<u8>> = [(0, "a"), (1, "b"), (2, "confirmed"), (3, "after")]
        .into_iter()
        .map(|(s, b)| (s, b.as_bytes().to_vec()))
        .collect();
    for (id, (raft, sm)) in &sim.live {
        raft.wait(Some(WAIT))
            .applied_index_at_least(last, "catch up")
            .await
            .unwrap_or_else(|e| panic!("node {id} did not catch up: {e}"));
        let (held, session) = sm.with(|r| {
            (
                r.messages
                    .iter()
                    .map(|(s, h)| (*s, h.message.clone()))
                    .collect::<BTreeMap<_, _>>(),
                r.session,
            )
        });
        assert_eq!(held, want, "node {id}'s messages");
        assert_eq!(session, s3, "node {id}'s session");
    }
    for id in ids {
        sim.kill(id).await;
    }
}
