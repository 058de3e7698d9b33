//! MQTT sessions across a cluster (docs/cluster.md, "MQTT sessions across nodes"): one
//! session per client id over all nodes, kept as one record per (vhost, client id) in the
//! metadata group's replicated map (`warren_cluster::definitions::Kind::Mqtt`), changed only
//! by compare-and-set, so two nodes never both own a client id.
//!
//! - A connection claims its client id (`claim`): the record names this node, connected. If
//!   a connection on another node had it, that node is told through the metadata group's
//!   change log (`meta::takeover_change`): it closes that connection (v5 reason 0x8E) and
//!   writes the session's last state into the record (the handover), which the claimer
//!   waits for, bounded by [`HANDOVER_WAIT`].
//! - Every change of a session the owner makes (subscriptions, the offline state at
//!   disconnect, its end) is written to the record in order per client id (one lane task per
//!   hash of the client id; a lane's queue is bounded), without holding the client.
//! - Expiry: the node that owns an offline session runs its timer; at the deadline it ends
//!   the session only if the record is still its own and unchanged (`DeleteIf`), so a
//!   client that resumed on another node meanwhile keeps it.
//! - A member gone (unreachable from the metadata leader for [`TAKEOVER_WAIT`], or no
//!   longer a member): its sessions' timers went with it, so the leader adopts each of its
//!   sessions once its deadline passed (`adopt_gone`: compare-and-set to itself, then its
//!   own expiry ends it, will and queue included). A session its connection had when the
//!   member went counts as disconnected from when the leader saw the member go.
//! - A claim waits for no handover from a node that does not answer the cluster port
//!   (a probe, [`PROBE_TIMEOUT`]): a node killed cannot hand over.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use warren_cluster::definitions::{DefCommand, DefReply, Kind, key};
use warren_cluster::node::{ClusterNode, NodeError};
use warren_core::escape::Escaped;
use warren_core::mqtt::StoredSession;
use warren_mqtt::registry::{ClusterFuture, ClusterSessions};

/// How long a claim waits for the node whose connection had the session to hand it over
/// (that node is down or cut off beyond it: the claim goes on with the last state the
/// record holds). A handover takes tens of ms; the bound stays under the 5 s CONNACK
/// timeout of common clients (rumqttc's default), so the client's first try succeeds.
pub const HANDOVER_WAIT: Duration = Duration::from_secs(3);
/// How long a claim's probe of the node it waits a handover from may take: a node killed
/// answers at once with a refused connection, one cut off not at all (its handover could
/// not reach the claimer's side in time either).
const PROBE_TIMEOUT: Duration = Duration::from_millis(500);
/// How long a member must be unreachable from the metadata leader before the leader ends
/// its sessions whose expiry passed (a node restarting within it runs its own timers).
pub const TAKEOVER_WAIT: Duration = Duration::from_secs(10);
/// How often the metadata leader looks for gone members' sessions to end.
const ADOPT_EVERY: Duration = Duration::from_secs(1);
/// Sessions adopted per look (the rest on the next one).
const ADOPT_BATCH: usize = 256;
/// Every how many looks the leader scans for sessions of nodes no longer members.
const FORGOTTEN_EVERY: u64 = 30;
/// How long one write to the metadata group may take (an election fits).
const WRITE_BOUND: Duration = Duration::from_secs(5);
/// Compare-and-set attempts per change (each conflict means another node changed the
/// record in between: a race of two connections of one client id).
const ATTEMPTS: usize = 8;
/// Lanes (tasks) that write session changes; a client id always goes to the same one.
const LANES: usize = 8;
/// Changes waiting per lane; beyond it a change is dropped with a warning (the session's
/// next change repairs it; this node's own store has it regardless).
const LANE_QUEUE: usize = 4096;

/// A session record (docs/storage.md, "MQTT sessions in a cluster").
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Record {
    /// The node that has (or last had) the session.
    pub owner: u64,
    /// A connection on `owner` has it (or claimed it).
    pub connected: bool,
    /// The node whose connection had the session when `owner` claimed it, until that node
    /// handed it over.
    pub handover: Option<u64>,
    /// The session's state (`None`: the client has no persistent session).
    pub session: Option<StoredSession>,
}

const VERSION: u8 = 1;
const CONNECTED: u8 = 1;
const HANDOVER: u8 = 2;
const SESSION: u8 = 4;

impl Record {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(32);
        out.push(VERSION);
        out.extend_from_slice(&self.owner.to_be_bytes());
        let flag = |on: bool, bit: u8| if on { bit } else { 0 };
        let flags = flag(self.connected, CONNECTED)
            | flag(self.handover.is_some(), HANDOVER)
            | flag(self.session.is_some(), SESSION);
        out.push(flags);
        if let Some(h) = self.handover {
            out.extend_from_slice(&h.to_be_bytes());
        }
        if let Some(s) = &self.session {
            out.extend_from_slice(&warren_store::sessions::encode(s));
        }
        out
    }

    pub fn decode(b: &[u8]) -> Result<Record, String> {
        let u64_at = |at: usize| -> Result<u64, String> {
            b.get(at..at + 8)
                .and_then(|s| <[u8; 8]>::try_from(s).ok())
                .map(u64::from_be_bytes)
                .ok_or_else(|| "truncated".to_string())
        };
        match b.first() {
            Some(&VERSION) => {}
            other => return Err(format!("unknown version {other:?}")),
        }
        let owner = u64_at(1)?;
        let flags = *b.get(9).ok_or("truncated")?;
        let mut at = 10;
        let handover = if flags & HANDOVER != 0 {
            at += 8;
            Some(u64_at(10)?)
        } else {
            None
        };
        let session = if flags & SESSION != 0 {
            Some(warren_store::sessions::decode(&b[at..]).map_err(|e| e.to_string())?)
        } else {
            None
        };
        Ok(Record {
            owner,
            connected: flags & CONNECTED != 0,
            handover,
            session,
        })
    }
}

/// What a lane writes.
enum Job {
    /// The state of a session whose client is connected here (`None`: not persistent).
    Live(Option<StoredSession>),
    /// Its connection's last state (offline, or `None`: ended).
    Last(Option<StoredSession>),
    /// Another node claimed it and no connection here has it: hand over what the record
    /// holds.
    Release,
}

struct Inner {
    node: Arc<ClusterNode>,
    /// Proposes the takeover changes (through the metadata group's change log).
    replicator: crate::meta::MetaReplicator,
    me: u64,
    vhost: String,
    lanes: Vec<mpsc::Sender<(Arc<str>, Job)>>,
    /// Changes enqueued and not yet written (or given up).
    waiting: std::sync::atomic::AtomicUsize,
}

/// The cluster's MQTT session registry for one vhost, on this node.
#[derive(Clone)]
pub struct MqttCluster(Arc<Inner>);

impl MqttCluster {
    /// Starts the lanes (tokio tasks, ending when the registry is dropped).
    pub fn new(
        node: Arc<ClusterNode>,
        replicator: crate::meta::MetaReplicator,
        me: u64,
        vhost: &str,
    ) -> MqttCluster {
        let mut lanes = Vec::with_capacity(LANES);
        let mut receivers = Vec::with_capacity(LANES);
        for _ in 0..LANES {
            let (tx, rx) = mpsc::channel(LANE_QUEUE);
            lanes.push(tx);
            receivers.push(rx);
        }
        let this = MqttCluster(Arc::new(Inner {
            node,
            replicator,
            me,
            vhost: vhost.to_string(),
            lanes,
            waiting: std::sync::atomic::AtomicUsize::new(0),
        }));
        for mut rx in receivers {
            // Weak: the lanes end with the registry, not keep it alive.
            let inner = Arc::downgrade(&this.0);
            tokio::spawn(async move {
                while let Some((client_id, job)) = rx.recv().await {
                    let Some(inner) = inner.upgrade() else { return };
                    if let Err(e) = inner.write_job(&client_id, job).await {
                        tracing::warn!(client_id = %Escaped(&client_id), "MQTT session not recorded in the cluster: {}", Escaped(&e));
                    }
                    inner
                        .waiting
                        .fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
                }
            });
        }
        this
    }
}

impl MqttCluster {
    /// Waits (at most `bound`) until every session change enqueued so far was written: at
    /// shutdown, before the cluster node stops.
    pub async fn flush(&self, bound: Duration) {
        let deadline = tokio::time::Instant::now() + bound;
        while self.0.waiting.load(std::sync::atomic::Ordering::Acquire) > 0 {
            if tokio::time::Instant::now() >= deadline {
                tracing::warn!("MQTT session changes not all recorded in the cluster at shutdown");
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Whether the cluster's record says this node has `client_id` now: a takeover change
    /// applied again after a restart (or older than this node's own later claim) is then
    /// stale and lets nothing go.
    pub fn owned_here(&self, client_id: &str) -> bool {
        let key = self.0.key(client_id);
        self.0
            .read(&key)
            .and_then(|b| Record::decode(&b).ok())
            .is_some_and(|r| r.owner == self.0.me)
    }
}

impl MqttCluster {
    /// Ends the sessions of gone members whose expiry passed, on this node while it leads
    /// the metadata group (see the module's docs). Runs until `registry` is dropped.
    pub fn adopt_gone(&self, registry: std::sync::Weak<warren_mqtt::Registry>) {
        let inner = Arc::downgrade(&self.0);
        tokio::spawn(async move {
            let mut down_since: HashMap<u64, u64> = HashMap::new();
            let mut looks = 0u64;
            loop {
                tokio::time::sleep(ADOPT_EVERY).await;
                let (Some(inner), Some(registry)) = (inner.upgrade(), registry.upgrade()) else {
                    return;
                };
                inner
                    .adopt_gone(&registry, &mut down_since, &mut looks)
                    .await;
            }
        });
    }
}

impl Inner {
    /// One look for gone members' expired sessions (`MqttCluster::adopt_gone`);
    /// `down_since` keeps when this node first saw each member unreachable (ms).
    async fn adopt_gone(
        &self,
        registry: &warren_mqtt::Registry,
        down_since: &mut HashMap<u64, u64>,
        looks: &mut u64,
    ) {
        let status = self.node.status();
        if status.state != "leader" || status.leader != Some(self.me) {
            // Only the leader's view counts: its heartbeats reach every member.
            down_since.clear();
            return;
        }
        let now = warren_mqtt::connection::now_ms();
        let members = self.node.members();
        down_since.retain(|id, _| !members.contains_key(id) || !self.node.reachable(*id));
        for id in members.keys() {
            if *id != self.me && !self.node.reachable(*id) {
                down_since.entry(*id).or_insert(now);
            }
        }
        let wait = TAKEOVER_WAIT.as_millis() as u64;
        let gone = |owner: u64, down: &mut HashMap<u64, u64>| -> Option<u64> {
            if owner == self.me {
                return None;
            }
            if !members.contains_key(&owner) {
                // Forgotten (`warren ctl forget-node`): gone from the first look.
                return Some(*down.entry(owner).or_insert(now));
            }
            down.get(&owner)
                .copied()
                .filter(|t| now.saturating_sub(*t) >= wait)
        };
        // The scan reads every session record: only when a member is gone, or now and
        // then for sessions of nodes no longer members.
        *looks = looks.wrapping_add(1);
        let member_gone = members.keys().any(|id| gone(*id, down_since).is_some());
        if !member_gone && !(*looks).is_multiple_of(FORGOTTEN_EVERY) {
            return;
        }
        let prefix = format!("{}/", key(Kind::Mqtt, &[&self.vhost]));
        let records: Vec<(String, Vec<u8>)> = self.node.definitions.with(|d| {
            d.scan(&prefix)
                .map(|(k, b)| (k.to_string(), b.to_vec()))
                .collect()
        });
        let mut adopted = 0;
        for (k, bytes) in records {
            if adopted >= ADOPT_BATCH {
                break;
            }
            let Ok(r) = Record::decode(&bytes) else {
                continue;
            };
            let Some(since) = gone(r.owner, down_since) else {
                continue;
            };
            let Some(mut session) = r.session.clone() else {
                continue;
            };
            // A connection there had it when the member went: disconnected since then.
            let disconnected = match (r.connected, session.disconnected_at) {
                (false, Some(at)) => at,
                _ => since,
            };
            if session.expiry_s == u32::MAX
                || now < disconnected.saturating_add(u64::from(session.expiry_s) * 1000)
            {
                continue;
            }
            let Some(client_id) = k
                .strip_prefix(&prefix)
                .and_then(|rest| rest.split_once(':'))
                .map(|(_, id)| id.to_string())
            else {
                continue;
            };
            session.disconnected_at = Some(disconnected);
            let mine = Record {
                owner: self.me,
                connected: false,
                handover: None,
                session: Some(session.clone()),
            };
            let cmd = DefCommand::PutIf {
                key: k.clone(),
                expected: Some(bytes),
                record: mine.encode(),
            };
            match self.write(&cmd).await {
                Ok(DefReply::Done { .. }) => {}
                // Changed meanwhile (its client came back somewhere): not gone.
                Ok(_) => continue,
                Err(e) => {
                    tracing::warn!(client_id = %Escaped(&client_id), "MQTT session of a gone node not taken over: {}", Escaped(&e));
                    return;
                }
            }
            tracing::info!(client_id = %Escaped(&client_id), node = r.owner, "MQTT session of gone node {} expired; ending it here", r.owner);
            // Its expiry passed: the expiry task ends it at once (will, queue, record).
            registry.store_session(
                Arc::from(client_id.as_str()),
                warren_mqtt::record::SessionRecord::from_stored(session, now),
            );
            adopted += 1;
        }
    }

    fn key(&self, client_id: &str) -> String {
        key(Kind::Mqtt, &[&self.vhost, client_id])
    }

    fn read(&self, key: &str) -> Option<Vec<u8>> {
        self.node
            .definitions
            .with(|d| d.get(key).map(<[u8]>::to_vec))
    }

    fn enqueue(&self, client_id: &str, job: Job) {
        let lane = fnv(client_id.as_bytes()) as usize % self.lanes.len();
        self.waiting
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        if self.lanes[lane]
            .try_send((Arc::from(client_id), job))
            .is_err()
        {
            self.waiting
                .fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
            tracing::warn!(client_id = %Escaped(client_id), "MQTT session change not recorded in the cluster: too many waiting");
        }
    }

    /// Writes `cmd`, retrying while no leader is known, within [`WRITE_BOUND`].
    async fn write(&self, cmd: &DefCommand) -> Result<DefReply, String> {
        tokio::time::timeout(WRITE_BOUND, async {
            let mut backoff = Duration::from_millis(20);
            loop {
                match self.node.write(cmd).await {
                    Ok(r) => return Ok(r),
                    Err(NodeError::NotLeader(_) | NodeError::Forward(..)) => {
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(Duration::from_millis(250));
                    }
                    Err(e) => return Err(e.to_string()),
                }
            }
        })
        .await
        .unwrap_or_else(|_| Err("no quorum in time".into()))
    }

    /// Compare-and-set: `decide` turns the current record into the command to write
    /// (`None`: nothing to do); retried on a conflict with the record the conflict names.
    async fn update(
        &self,
        key: &str,
        mut decide: impl FnMut(Option<&[u8]>, Option<Record>) -> Option<DefCommand>,
    ) -> Result<bool, String> {
        let mut current = self.read(key);
        for _ in 0..ATTEMPTS {
            let record = match current.as_deref().map(Record::decode) {
                Some(Ok(r)) => Some(r),
                Some(Err(e)) => {
                    tracing::warn!(key = %Escaped(key), "unreadable MQTT session record, replaced: {e}");
                    None
                }
                None => None,
            };
            let Some(cmd) = decide(current.as_deref(), record) else {
                return Ok(false);
            };
            match self.write(&cmd).await? {
                DefReply::Done { .. } => return Ok(true),
                DefReply::Conflict { current: c } => current = c,
                other => return Err(format!("refused by the metadata group: {other:?}")),
            }
        }
        Err("the record kept changing".into())
    }

    async fn write_job(&self, client_id: &str, job: Job) -> Result<bool, String> {
        let key = self.key(client_id);
        let me = self.me;
        self.update(&key, |bytes, record| {
            let put = |r: Record| DefCommand::PutIf {
                key: key.clone(),
                expected: bytes.map(<[u8]>::to_vec),
                record: r.encode(),
            };
            match (&job, record) {
                // The claimer waits for this node's handover: the connection's last state
                // (or, with no connection here, what the record holds).
                (Job::Last(s), Some(r)) if r.handover == Some(me) => Some(put(Record {
                    handover: None,
                    session: s.clone(),
                    ..r
                })),
                (Job::Release, Some(r)) if r.handover == Some(me) => Some(put(Record {
                    handover: None,
                    ..r
                })),
                (Job::Release, _) => None,
                // Another node took it: this node's changes no longer count.
                (_, Some(r)) if r.owner != me => None,
                (Job::Live(s), _) => Some(put(Record {
                    owner: me,
                    connected: true,
                    handover: None,
                    session: s.clone(),
                })),
                (Job::Last(Some(s)), _) => Some(put(Record {
                    owner: me,
                    connected: false,
                    handover: None,
                    session: Some(s.clone()),
                })),
                (Job::Last(None), Some(_)) => Some(DefCommand::DeleteIf {
                    key: key.clone(),
                    expected: bytes.map(<[u8]>::to_vec).unwrap_or_default(),
                }),
                (Job::Last(None), None) => None,
            }
        })
        .await
    }

    async fn claim(&self, client_id: &str) -> Result<Option<StoredSession>, String> {
        let key = self.key(client_id);
        let me = self.me;
        let mut before: Option<Record> = None;
        let mut before_bytes: Option<Vec<u8>> = None;
        let mut mine = Record::default();
        self.update(&key, |bytes, record| {
            before = record.clone();
            before_bytes = bytes.map(<[u8]>::to_vec);
            let r = record.unwrap_or_default();
            mine = Record {
                owner: me,
                connected: true,
                // A connection on another node has it: that node hands it over.
                handover: (bytes.is_some() && r.connected && r.owner != me).then_some(r.owner),
                session: r.session,
            };
            Some(DefCommand::PutIf {
                key: key.clone(),
                expected: bytes.map(<[u8]>::to_vec),
                record: mine.encode(),
            })
        })
        .await?;
        // The write is committed; this node's copy of the map may apply it a moment later
        // (a follower): what this node reads from here on includes it.
        if before_bytes.as_deref() != Some(mine.encode().as_slice()) {
            let deadline = tokio::time::Instant::now() + HANDOVER_WAIT;
            while self.read(&key) == before_bytes && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
        if let Some(b) = &before
            && b.owner != me
        {
            // The node that had it (connected or holding it offline, with its expiry)
            // learns through the change log, in order with the metadata it applies.
            let change = crate::meta::takeover_change(&self.vhost, client_id);
            if let Err(e) = self.replicator.propose_change(change).await {
                tracing::warn!(client_id = %Escaped(client_id), "cluster not told of the MQTT session's takeover: {}", Escaped(&e));
            }
        }
        let Some(from) = mine.handover else {
            return Ok(mine.session);
        };
        let deadline = tokio::time::Instant::now() + HANDOVER_WAIT;
        // Meanwhile, whether that node is there at all: a node killed (kill -9 with the
        // client connected) never hands over, and the claim need not wait for it.
        let node = self.node.clone();
        let mut probe = Some(tokio::spawn(async move {
            let empty = crate::nodes::encode(&[]);
            node.send_mail(from, empty, PROBE_TIMEOUT).await.is_ok()
        }));
        loop {
            if finished(&mut probe).await == Some(false) {
                tracing::info!(client_id = %Escaped(client_id), node = from, "MQTT session's last node does not answer; resuming its last recorded state without a handover");
                return Ok(self
                    .read(&key)
                    .and_then(|b| Record::decode(&b).ok())
                    .and_then(|r| r.session)
                    .or(mine.session));
            }
            let now = self
                .read(&key)
                .and_then(|b| Record::decode(&b).ok())
                .unwrap_or_default();
            if now.owner != me || now.handover != Some(from) {
                // Handed over (or claimed again elsewhere, which closes this connection).
                return Ok(now.session);
            }
            if tokio::time::Instant::now() >= deadline {
                tracing::warn!(client_id = %Escaped(client_id), node = from, "MQTT session not handed over in time by the node that had it; resuming its last recorded state");
                return Ok(mine.session);
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    async fn expire(&self, client_id: &str) -> bool {
        let key = self.key(client_id);
        let me = self.me;
        let r = self
            .update(&key, |bytes, record| match (bytes, record) {
                // A connected record of this node with no connection here (the expiry
                // task runs only for client ids no connection holds) is one a crash left.
                (Some(b), Some(r)) if r.owner == me && r.handover.is_none() => {
                    Some(DefCommand::DeleteIf {
                        key: key.clone(),
                        expected: b.to_vec(),
                    })
                }
                _ => None,
            })
            .await;
        match r {
            Ok(done) => done,
            Err(e) => {
                tracing::warn!(client_id = %Escaped(client_id), "MQTT session expiry not recorded in the cluster: {}", Escaped(&e));
                false
            }
        }
    }
}

impl ClusterSessions for MqttCluster {
    fn claim(&self, client_id: &str) -> ClusterFuture<Result<Option<StoredSession>, String>> {
        let this = self.0.clone();
        let client_id = client_id.to_string();
        Box::pin(async move { this.claim(&client_id).await })
    }

    fn store(&self, client_id: &str, session: Option<StoredSession>, live: bool) {
        let job = if live {
            Job::Live(session)
        } else {
            Job::Last(session)
        };
        self.0.enqueue(client_id, job);
    }

    fn release(&self, client_id: &str) {
        self.0.enqueue(client_id, Job::Release);
    }

    fn owns(&self, client_id: &str) -> bool {
        self.owned_here(client_id)
    }

    fn expire(&self, client_id: &str) -> ClusterFuture<bool> {
        let this = self.0.clone();
        let client_id = client_id.to_string();
        Box::pin(async move { this.expire(&client_id).await })
    }
}

fn fnv(b: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &x in b {
        h ^= u64::from(x);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// The answer of `probe` once it finished, taken once: a finished `JoinHandle` polled a
/// second time panics (it did, in the loop of `claim`, when the probe answered before the
/// handover came: the connection's task died and the client saw its socket reset). `None`
/// while it runs, after it was taken, and if it panicked (the claim then waits for the
/// handover, as without a probe).
async fn finished(probe: &mut Option<tokio::task::JoinHandle<bool>>) -> Option<bool> {
    let handle = probe.take_if(|p| p.is_finished())?;
    handle.await.ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use warren_core::mqtt::StoredSub;

    #[tokio::test]
    async fn a_finished_probe_is_read_once_and_never_polled_again() {
        let mut probe = Some(tokio::spawn(async { true }));
        let mut answers = Vec::new();
        // The claim's loop asks every 10 ms, before and after the probe finished.
        for _ in 0..50 {
            if let Some(a) = finished(&mut probe).await {
                answers.push(a);
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        assert_eq!(answers, [true]);
        assert!(probe.is_none());
        let mut failed = Some(tokio::spawn(async { panic!("probe failed") }));
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(
            finished(&mut failed).await,
            None,
            "a failed probe is no answer"
        );
        assert_eq!(finished(&mut failed).await, None);
    }

    #[test]
    fn records_round_trip_and_bad_bytes_are_errors() {
        let session = StoredSession {
            level: 5,
            expiry_s: 300,
            disconnected_at: Some(1_700_000_000_000),
            has_queue: true,
            subs: vec![StoredSub {
                filter: "a/+".into(),
                qos: 1,
                no_local: true,
                retain_as_published: false,
                retain_handling: 2,
                id: Some(7),
            }],
            ..StoredSession::default()
        };
        for r in [
            Record::default(),
            Record {
                owner: 3,
                connected: true,
                handover: Some(2),
                session: Some(session.clone()),
            },
            Record {
                owner: u64::MAX,
                connected: false,
                handover: None,
                session: Some(session),
            },
        ] {
            assert_eq!(Record::decode(&r.encode()).as_ref(), Ok(&r));
        }
        let r = Record {
            owner: 1,
            connected: true,
            handover: Some(2),
            session: None,
        };
        let b = r.encode();
        assert_eq!(b.len(), 18);
        assert!(Record::decode(&b[..12]).is_err());
        assert!(Record::decode(&[2]).is_err());
        assert!(Record::decode(&[]).is_err());
    }
}
