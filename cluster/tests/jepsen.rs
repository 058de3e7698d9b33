//! Tests that earn trust, in Jepsen's style (docs/cluster.md, "How we test"): confirmed
//! publishers and acking consumers (lapin, real sockets) run while a fault schedule kills
//! (SIGKILL), pauses (SIGSTOP), partitions and restarts brokers; clients reconnect to any
//! live node and go on. Every operation goes into a history (`common/history.rs`) and a
//! checker judges it: every confirmed message delivered at least once, none invented, per
//! publisher order among first deliveries. Then metadata: declares and deletes on different
//! nodes during a partition converge after it heals, with no queue lost or doubled.
//!
//! - `single_node_*`: one `warren serve` on loopback, killed with SIGKILL and restarted on
//!   its data dir, paused and resumed; a durable classic queue and a quorum queue. No root.
//! - `three_nodes_quorum_queue_under_faults`: `scripts/cluster.sh up 3` (bridge `wbj0`,
//!   10.85.0.0/24): kill the leader, kill a follower, partition the leader, pause a node,
//!   restart all. What the run may expect depends on a feature check made first (one queue
//!   seen from every node: a confirmed publish on n1 is counted by a passive declare on
//!   n2): with it, the final drain reads the queue from the survivors with the queue's
//!   leader killed (failover: nothing confirmed may be lost); without it (each node's own
//!   group of one, as today), every node is restarted and drained, since each holds its
//!   own messages. The report says which expectation ran.
//! - `three_nodes_durable_classic_queue_under_faults`: the same faults; a classic queue is
//!   not replicated (it lives on one node), so every node is restarted and drained.
//! - `metadata_*`: bridge `wbj1`, 10.86.0.0/24.
//!
//! The cluster tests need root and `ip netns`, and the broker binary (`cargo build -p
//! warren-cli`, or WARREN_BIN); without them they say why and pass, unless
//! WARREN_CLUSTER_REQUIRE=1 (CI) makes that a failure. `WARREN_JEPSEN_SECS` (default 15)
//! is how long faults are injected per run, and each kind a run names is injected at least
//! once: CI runs the default, `WARREN_JEPSEN_SECS=300` is the minutes-of-faults run.
//! `WARREN_JEPSEN_SEED` replays a schedule.

mod common;

use std::collections::{BTreeSet, VecDeque};
use std::fs::OpenOptions;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use common::history::{History, Outcome, Report};
use common::{Cluster, cluster_status, parse};
use futures_lite::StreamExt;
use futures_lite::future::poll_once;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicGetOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties};
use tokio::sync::watch;
use tokio::time::{sleep, timeout};

const BRIDGE: &str = "wbj0";
const NET: &str = "10.85.0";
const META_BRIDGE: &str = "wbj1";
const META_NET: &str = "10.86.0";

/// Any one client round trip; a node that does not answer within it counts as gone.
const OP_TIMEOUT: Duration = Duration::from_secs(3);
/// Publishes awaiting their confirm, per publisher.
const CONFIRM_WINDOW: usize = 64;
const PREFETCH: u16 = 50;
/// A client that had to move off its home node goes back after this, so clients spread
/// over the nodes again after a fault.
const AWAY: Duration = Duration::from_secs(5);
/// The history's bound: publishers stop publishing once this many publishes are recorded.
const MAX_OPS: u64 = 2_000_000;

/// The tests of this file run one at a time: they share the machine's two cores, and a
/// starved broker misses its election timeouts.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .map(|v| {
            v.parse()
                .unwrap_or_else(|_| panic!("{name}={v:?} is not a number"))
        })
        .unwrap_or(default)
}

/// xorshift64*: fault choices and timings only need to vary and replay.
struct Rng(u64);

impl Rng {
    fn seeded() -> Rng {
        let seed = env_u64(
            "WARREN_JEPSEN_SEED",
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64),
        );
        eprintln!("jepsen: seed {seed} (WARREN_JEPSEN_SEED to replay)");
        Rng(seed | 1)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn millis(&mut self, lo: u64, hi: u64) -> Duration {
        Duration::from_millis(lo + self.next() % (hi - lo + 1))
    }
}

// ---------------------------------------------------------------------------------------
// Targets: one local broker, or a cluster through scripts/cluster.sh.

/// One `warren serve` on loopback that this test starts, kills and restarts.
struct Local {
    bin: PathBuf,
    dir: tempfile::TempDir,
    /// 0 until the first start picked a free port; later starts reuse it, so clients
    /// reconnect to the same address.
    port: u16,
    child: Option<Child>,
}

impl Local {
    fn new() -> Option<Local> {
        let bin = common::bin();
        if !bin.exists() {
            assert!(
                std::env::var_os("WARREN_CLUSTER_REQUIRE").is_none(),
                "broker binary {} not found",
                bin.display()
            );
            eprintln!("SKIPPED: broker binary {} not found", bin.display());
            return None;
        }
        Some(Local {
            bin,
            dir: tempfile::tempdir().expect("tempdir"),
            port: 0,
            child: None,
        })
    }

    fn log(&self) -> PathBuf {
        self.dir.path().join("log")
    }

    fn start(&mut self) {
        let log = self.log();
        let out = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .expect("broker log");
        let from = out.metadata().map(|m| m.len()).unwrap_or(0) as usize;
        let err = out.try_clone().expect("log handle");
        let mut child = Command::new(&self.bin)
            .args(["serve", "--amqp", &format!("127.0.0.1:{}", self.port)])
            .args(["--mqtt", "none", "--management", "none"])
            .args(["--prometheus", "none", "--stream", "none"])
            .arg("--data-dir")
            .arg(self.dir.path().join("data"))
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .expect("run warren serve");
        let deadline = Instant::now() + common::WAIT;
        loop {
            let text = std::fs::read(&log).unwrap_or_default();
            let text = String::from_utf8_lossy(&text[from.min(text.len())..]).into_owned();
            if let Some(at) = text.find(" (AMQP") {
                let addr = text[..at].rsplit(' ').next().unwrap_or("");
                self.port = addr
                    .rsplit_once(':')
                    .and_then(|(_, p)| p.parse().ok())
                    .unwrap_or_else(|| panic!("no port in the listening line: {addr:?}"));
                self.child = Some(child);
                return;
            }
            if let Ok(Some(status)) = child.try_wait() {
                panic!("warren exited ({status}) before listening:\n{text}");
            }
            assert!(
                Instant::now() < deadline,
                "warren not listening after {:?}:\n{text}",
                common::WAIT
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn signal(&self, sig: &str) {
        if let Some(c) = &self.child {
            let _ = Command::new("kill")
                .args([sig, &c.id().to_string()])
                .status();
        }
    }
}

impl Drop for Local {
    fn drop(&mut self) {
        self.signal("-CONT");
        self.kill();
    }
}

enum Target {
    Local(Local),
    Cluster { c: Cluster, size: usize },
}

impl Target {
    fn size(&self) -> usize {
        match self {
            Target::Local(_) => 1,
            Target::Cluster { size, .. } => *size,
        }
    }

    /// AMQP URIs, node i at index i - 1.
    fn uris(&self) -> Vec<String> {
        match self {
            Target::Local(l) => vec![format!("amqp://guest:guest@127.0.0.1:{}/%2f", l.port)],
            Target::Cluster { c, .. } => parse(&c.run(&["status"]))
                .iter()
                .map(|n| format!("amqp://warren:warren@{}/%2f", n.amqp))
                .collect(),
        }
    }

    fn kill(&mut self, i: usize) {
        match self {
            Target::Local(l) => l.kill(),
            Target::Cluster { c, .. } => {
                c.run(&["kill", &format!("n{i}")]);
            }
        }
    }

    fn start(&mut self, i: usize) {
        match self {
            Target::Local(l) => l.start(),
            Target::Cluster { c, .. } => {
                c.run(&["start", &format!("n{i}")]);
            }
        }
    }

    fn pause(&mut self, i: usize, on: bool) {
        match self {
            Target::Local(l) => l.signal(if on { "-STOP" } else { "-CONT" }),
            Target::Cluster { c, .. } => {
                c.run(&[if on { "pause" } else { "resume" }, &format!("n{i}")]);
            }
        }
    }

    fn ctl(&self, i: usize, args: &[&str]) -> Option<serde_json::Value> {
        let data = match self {
            Target::Local(l) => l.dir.path().join("data"),
            Target::Cluster { c, .. } => c.state.path().join(format!("cluster/n{i}/data")),
        };
        let bin = match self {
            Target::Local(l) => &l.bin,
            Target::Cluster { c, .. } => &c.bin,
        };
        let out = Command::new(bin)
            .args(["ctl", "--format", "json", "--data-dir"])
            .arg(data)
            .args(args)
            .output()
            .ok()?;
        if !out.status.success() {
            return None;
        }
        serde_json::from_slice(&out.stdout).ok()
    }

    /// The metadata group's leader all live nodes agree on (bounded wait).
    fn leader(&self, live: &[usize]) -> Option<usize> {
        let Target::Cluster { c, .. } = self else {
            return Some(1);
        };
        let state = c.state.path().join("cluster");
        let deadline = Instant::now() + common::WAIT;
        while Instant::now() < deadline {
            let leaders: Vec<Option<u64>> = live
                .iter()
                .map(|i| cluster_status(&state, &c.bin, *i).and_then(|s| s["leader"].as_u64()))
                .collect();
            if let Some(Some(l)) = leaders.first()
                && leaders.iter().all(|x| *x == Some(*l))
                && live.contains(&(*l as usize))
            {
                return Some(*l as usize);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        None
    }

    /// The node leading `queue`'s group if the broker lists one (a `leader` field in
    /// `list-queues`: a node id or `nN`), else the metadata leader: today each node's
    /// quorum queue is a group of one, and the metadata leader is the node whose loss
    /// costs an election.
    fn queue_leader(&self, queue: &str, live: &[usize]) -> Option<usize> {
        for &i in live {
            let Some(serde_json::Value::Array(qs)) = self.ctl(i, &["list-queues"]) else {
                continue;
            };
            let leader = qs
                .iter()
                .find(|q| q["name"] == queue)
                .and_then(|q| match &q["leader"] {
                    serde_json::Value::Number(n) => n.as_u64(),
                    serde_json::Value::String(s) => s.trim_start_matches('n').parse().ok(),
                    _ => None,
                });
            if let Some(l) = leader
                && live.contains(&(l as usize))
            {
                return Some(l as usize);
            }
            break;
        }
        self.queue_leader_from_logs(queue, live)
            .or_else(|| self.leader(live))
    }

    /// The first line of each panic in the brokers' logs: a broker that panicked failed,
    /// whatever its clients saw.
    fn panics(&self) -> Vec<String> {
        let mut found = Vec::new();
        for i in 1..=self.size() {
            let log = match self {
                Target::Local(l) => l.log(),
                Target::Cluster { c, .. } => c.state.path().join(format!("cluster/n{i}/log")),
            };
            let text = std::fs::read_to_string(log).unwrap_or_default();
            let mut lines = text.lines();
            while let Some(l) = lines.next() {
                if l.contains("panicked at") {
                    let why = lines.next().unwrap_or("");
                    found.push(format!("n{i}: {l} {why}"));
                }
            }
        }
        found
    }

    /// Copies the brokers' logs to `$TMPDIR/warren-jepsen-logs` for a post-mortem (the
    /// cluster's state dir goes with `down`).
    fn keep_logs(&self) {
        let keep = std::env::temp_dir().join("warren-jepsen-logs");
        let _ = std::fs::create_dir_all(&keep);
        for i in 1..=self.size() {
            let log = match self {
                Target::Local(l) => l.log(),
                Target::Cluster { c, .. } => c.state.path().join(format!("cluster/n{i}/log")),
            };
            let _ = std::fs::copy(&log, keep.join(format!("n{i}.log")));
        }
        eprintln!("jepsen: broker logs kept in {}", keep.display());
    }

    /// The live node whose log last said it leads `queue`'s group (`quorum queue: this
    /// node leads and serves it ... queue=NAME leader=true`), if exactly one did.
    fn queue_leader_from_logs(&self, queue: &str, live: &[usize]) -> Option<usize> {
        let Target::Cluster { c, .. } = self else {
            return None;
        };
        let key = format!(" queue={queue} ");
        let leaders: Vec<usize> = live
            .iter()
            .copied()
            .filter(|i| {
                let log = c.state.path().join(format!("cluster/n{i}/log"));
                let text = std::fs::read_to_string(log).unwrap_or_default();
                text.lines()
                    .rev()
                    .find(|l| l.contains("quorum queue: this node") && l.contains(&key))
                    .is_some_and(|l| l.contains("leader=true"))
            })
            .collect();
        (leaders.len() == 1).then(|| leaders[0])
    }
}

// ---------------------------------------------------------------------------------------
// Clients.

type Shared = Arc<Mutex<History>>;

#[derive(Clone)]
struct Clients {
    uris: Arc<Vec<String>>,
    queue: String,
    args: FieldTable,
    hist: Shared,
    stop: watch::Receiver<bool>,
    /// Messages per second per publisher.
    rate: u64,
    /// Deliveries per second per consumer: slower than the publishers, so the queue holds a
    /// backlog at every fault, which only storage (or another node) can bring back.
    consume_rate: u64,
}

async fn within<T>(what: &str, f: impl Future<Output = lapin::Result<T>>) -> Result<T, String> {
    match timeout(OP_TIMEOUT, f).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(format!("{what}: {e}")),
        Err(_) => Err(format!("{what}: no answer within {OP_TIMEOUT:?}")),
    }
}

async fn open(uri: &str) -> Result<(Connection, Channel), String> {
    let conn = within(
        "connect",
        Connection::connect(uri, ConnectionProperties::default()),
    )
    .await?;
    let ch = within("channel.open", conn.create_channel()).await?;
    Ok((conn, ch))
}

async fn close(conn: Connection) {
    let _ = timeout(Duration::from_secs(1), conn.close(200, "bye".into())).await;
}

async fn declare(
    ch: &Channel,
    queue: &str,
    args: &FieldTable,
    passive: bool,
) -> Result<u32, String> {
    let q = within(
        "queue.declare",
        ch.queue_declare(
            queue.into(),
            QueueDeclareOptions {
                durable: true,
                passive,
                ..QueueDeclareOptions::default()
            },
            args.clone(),
        ),
    )
    .await?;
    Ok(q.message_count())
}

fn quorum_args() -> FieldTable {
    let mut t = FieldTable::default();
    t.insert(
        ShortString::from("x-queue-type"),
        AMQPValue::LongString("quorum".into()),
    );
    t
}

fn outcome(o: &lapin::Result<Confirmation>) -> Outcome {
    match o {
        Ok(Confirmation::Ack(None)) => Outcome::Confirmed,
        Ok(Confirmation::Ack(Some(_))) => Outcome::Returned,
        Ok(Confirmation::Nack(_)) => Outcome::Nacked,
        // The connection died first: stored or not, both are allowed.
        Ok(Confirmation::NotRequested) | Err(_) => Outcome::Unknown,
    }
}

type Inflight = VecDeque<(u64, lapin::PublisherConfirm)>;

impl Clients {
    fn stopped(&self) -> bool {
        *self.stop.borrow()
    }

    fn fail(&self, who: String, e: String) {
        if !self.stopped() {
            self.hist.lock().unwrap().error(format!("{who}: {e}"));
        }
    }

    async fn publisher(self, p: usize) {
        let n = self.uris.len();
        let (home, mut at) = (p % n, p % n);
        while !self.stopped() {
            match self.publish_session(p, at, at != home).await {
                Ok(()) => at = home,
                Err(e) => {
                    self.fail(format!("publisher {p} on node {}", at + 1), e);
                    at = (at + 1) % n;
                    sleep(Duration::from_millis(100)).await;
                }
            }
        }
    }

    async fn settle_ready(&self, p: usize, inflight: &mut Inflight) {
        let mut pending = Inflight::with_capacity(inflight.len());
        while let Some((seq, mut c)) = inflight.pop_front() {
            match poll_once(&mut c).await {
                Some(o) => self.hist.lock().unwrap().settle(p, seq, outcome(&o)),
                None => pending.push_back((seq, c)),
            }
        }
        *inflight = pending;
    }

    async fn publish_session(&self, p: usize, at: usize, away: bool) -> Result<(), String> {
        let (conn, ch) = open(&self.uris[at]).await?;
        let mut inflight = Inflight::new();
        let result = self.publish_on(p, &ch, away, &mut inflight).await;
        // Confirms that already came count; the rest stay unknown (allowed either way).
        let deadline = Instant::now() + OP_TIMEOUT;
        while let Some((seq, c)) = inflight.pop_front() {
            if result.is_err() {
                break;
            }
            match timeout(deadline.saturating_duration_since(Instant::now()), c).await {
                Ok(o) => self.hist.lock().unwrap().settle(p, seq, outcome(&o)),
                Err(_) => break,
            }
        }
        close(conn).await;
        result
    }

    async fn publish_on(
        &self,
        p: usize,
        ch: &Channel,
        away: bool,
        inflight: &mut Inflight,
    ) -> Result<(), String> {
        within(
            "confirm.select",
            ch.confirm_select(ConfirmSelectOptions::default()),
        )
        .await?;
        // Applications declare on every connect; for an existing queue it costs no consensus.
        declare(ch, &self.queue, &self.args, false).await?;
        let props = BasicProperties::default().with_delivery_mode(2);
        let mut tick = tokio::time::interval(Duration::from_micros(1_000_000 / self.rate.max(1)));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let since = Instant::now();
        while !self.stopped() && (!away || since.elapsed() <= AWAY) {
            tick.tick().await;
            let Some(seq) = self.hist.lock().unwrap().send(p) else {
                sleep(Duration::from_millis(100)).await; // the history is full: idle
                continue;
            };
            let confirm = within(
                "basic.publish",
                ch.basic_publish(
                    "".into(),
                    self.queue.as_str().into(),
                    BasicPublishOptions {
                        mandatory: true,
                        ..BasicPublishOptions::default()
                    },
                    format!("{p}:{seq}").as_bytes(),
                    props.clone(),
                ),
            )
            .await?;
            inflight.push_back((seq, confirm));
            self.settle_ready(p, inflight).await;
            while inflight.len() >= CONFIRM_WINDOW {
                let (seq, c) = inflight.pop_front().expect("window is not empty");
                let o = timeout(OP_TIMEOUT, c)
                    .await
                    .map_err(|_| format!("no confirm within {OP_TIMEOUT:?}"))?;
                let failed = o.as_ref().err().map(|e| format!("confirm: {e}"));
                self.hist.lock().unwrap().settle(p, seq, outcome(&o));
                if let Some(e) = failed {
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    async fn consumer(self, c: usize) {
        let n = self.uris.len();
        let (home, mut at) = (c % n, c % n);
        while !self.stopped() {
            match self.consume_session(at, at != home).await {
                Ok(()) => at = home,
                Err(e) => {
                    self.fail(format!("consumer {c} on node {}", at + 1), e);
                    at = (at + 1) % n;
                    sleep(Duration::from_millis(100)).await;
                }
            }
        }
    }

    async fn consume_session(&self, at: usize, away: bool) -> Result<(), String> {
        let (conn, ch) = open(&self.uris[at]).await?;
        let result = async {
            within(
                "basic.qos",
                ch.basic_qos(PREFETCH, BasicQosOptions::default()),
            )
            .await?;
            declare(&ch, &self.queue, &self.args, false).await?;
            let mut deliveries = within(
                "basic.consume",
                ch.basic_consume(
                    self.queue.as_str().into(),
                    "".into(),
                    BasicConsumeOptions::default(),
                    FieldTable::default(),
                ),
            )
            .await?;
            let session = self.hist.lock().unwrap().session();
            let since = Instant::now();
            let mut tick =
                tokio::time::interval(Duration::from_micros(1_000_000 / self.consume_rate.max(1)));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            while !self.stopped() && (!away || since.elapsed() <= AWAY) {
                let d = match timeout(Duration::from_millis(500), deliveries.next()).await {
                    Err(_) => continue, // idle: look at stop again
                    Ok(None) => return Err("consumer cancelled".to_string()),
                    Ok(Some(Err(e))) => return Err(format!("delivery: {e}")),
                    Ok(Some(Ok(d))) => d,
                };
                self.hist
                    .lock()
                    .unwrap()
                    .deliver(session, &d.data, d.redelivered);
                within("basic.ack", d.acker.ack(BasicAckOptions::default())).await?;
                tick.tick().await;
            }
            Ok(())
        }
        .await;
        close(conn).await;
        result
    }
}

/// Takes every message the queue holds at `uri`, recording each (its own consumer session).
/// Retries while the node cannot serve yet (an election after a kill), bounded.
async fn drain(uri: &str, queue: &str, args: &FieldTable, hist: &Shared) -> Result<u64, String> {
    let deadline = Instant::now() + common::WAIT;
    let session = hist.lock().unwrap().session();
    let mut taken = 0u64;
    let mut empty_gets = 0;
    loop {
        let attempt = async {
            let (conn, ch) = open(uri).await?;
            declare(&ch, queue, args, true).await?;
            // An empty get three times, 200 ms apart: requeues of the clients' unacked
            // messages (their connections just closed) have landed.
            while empty_gets < 3 {
                let got = within(
                    "basic.get",
                    ch.basic_get(queue.into(), BasicGetOptions { no_ack: true }),
                )
                .await?;
                match got {
                    Some(m) => {
                        empty_gets = 0;
                        taken += 1;
                        hist.lock().unwrap().deliver(
                            session,
                            &m.delivery.data,
                            m.delivery.redelivered,
                        );
                    }
                    None => {
                        empty_gets += 1;
                        sleep(Duration::from_millis(200)).await;
                    }
                }
                if taken > MAX_OPS * 2 {
                    return Err("the drain never ends".to_string());
                }
            }
            close(conn).await;
            Ok::<(), String>(())
        }
        .await;
        match attempt {
            Ok(()) => return Ok(taken),
            Err(e) if Instant::now() > deadline => return Err(format!("drain {uri}: {e}")),
            Err(_) => sleep(Duration::from_millis(200)).await,
        }
    }
}

/// Declares `queue` on `uri`, retried until a node can commit it (bounded).
async fn declare_once(uri: &str, queue: &str, args: &FieldTable) {
    let deadline = Instant::now() + common::WAIT;
    loop {
        let r = async {
            let (conn, ch) = open(uri).await?;
            let _ = within(
                "queue.delete",
                ch.queue_delete(queue.into(), QueueDeleteOptions::default()),
            )
            .await;
            let ch = within("channel.open", conn.create_channel()).await?;
            declare(&ch, queue, args, false).await?;
            close(conn).await;
            Ok::<(), String>(())
        }
        .await;
        match r {
            Ok(()) => return,
            Err(e) if Instant::now() > deadline => panic!("declare {queue} on {uri}: {e}"),
            Err(_) => sleep(Duration::from_millis(200)).await,
        }
    }
}

/// The feature check: is a quorum queue one queue across the nodes? A publish confirmed on
/// one node must be counted by a passive declare on another. False today (each node has its
/// own group of one); true once quorum queues are replicated (or reached across nodes). A
/// node that does not lead the queue's group may refuse the publish (nack): the probe tries
/// each node in turn. `leader_known`: the nodes name a leader of the probe queue's group
/// (`warren ctl list-queues`' `leader`), which also says it is one queue (a replicated
/// quorum queue counts its messages on its leader's node only).
async fn one_queue_across_nodes(uris: &[String], leader_known: &dyn Fn() -> bool) -> bool {
    let probe = "jepsen.probe";
    let args = quorum_args();
    declare_once(&uris[0], probe, &args).await;
    let mut confirmed_on = None;
    let mut refused = 0;
    let deadline = Instant::now() + Duration::from_secs(10);
    // A new queue's group elects its leader first: retry the round within the bound.
    'rounds: while Instant::now() < deadline {
        for (i, uri) in uris.iter().enumerate() {
            match publish_probe(uri, probe).await {
                Ok(true) => {
                    confirmed_on = Some(i);
                    break 'rounds;
                }
                Ok(false) => refused += 1,
                Err(_) => {}
            }
        }
        sleep(Duration::from_millis(300)).await;
    }
    let Some(on) = confirmed_on else {
        panic!("probe: no node confirmed a publish to a fresh quorum queue");
    };
    let other = &uris[(on + 1) % uris.len()];
    let mut seen = leader_known();
    let deadline = Instant::now() + Duration::from_secs(3);
    while !seen && Instant::now() < deadline {
        if let Ok((c2, ch2)) = open(other).await {
            seen = declare(&ch2, probe, &args, true).await.unwrap_or(0) >= 1;
            close(c2).await;
        }
        if !seen {
            sleep(Duration::from_millis(200)).await;
        }
    }
    // A queue per node: the first node asked confirms, the next does not see it, and
    // confirms a publish of its own. Anything else (a node that refuses publishes for a
    // queue it does not lead, or sees another's) is one queue.
    let per_node =
        on == 0 && refused == 0 && !seen && publish_probe(other, probe).await == Ok(true);
    eprintln!(
        "jepsen: feature check: a publish confirmed on n{} is {} by a passive declare on n{} \
         ({refused} publishes refused before): {}",
        on + 1,
        if seen { "counted" } else { "not counted" },
        (on + 1) % uris.len() + 1,
        if per_node {
            "a queue per node"
        } else {
            "one queue across the nodes"
        }
    );
    if let Ok((conn, ch)) = open(&uris[0]).await {
        let _ = within(
            "queue.delete",
            ch.queue_delete(probe.into(), QueueDeleteOptions::default()),
        )
        .await;
        close(conn).await;
    }
    !per_node
}

/// Publishes one persistent message to `queue` at `uri`: whether it was confirmed.
async fn publish_probe(uri: &str, queue: &str) -> Result<bool, String> {
    let (conn, ch) = open(uri).await?;
    let confirmed = async {
        within(
            "confirm.select",
            ch.confirm_select(ConfirmSelectOptions::default()),
        )
        .await?;
        let confirm = within(
            "basic.publish",
            ch.basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions::default(),
                b"probe",
                BasicProperties::default().with_delivery_mode(2),
            ),
        )
        .await?;
        Ok::<_, String>(matches!(
            timeout(OP_TIMEOUT, confirm).await,
            Ok(Ok(Confirmation::Ack(None)))
        ))
    }
    .await;
    close(conn).await;
    confirmed
}

// ---------------------------------------------------------------------------------------
// The run: clients, a fault schedule, recovery, the drain, the check.

#[derive(Clone, Copy, Debug)]
enum Fault {
    KillLeader,
    KillFollower,
    PartitionLeader,
    Pause,
    RestartAll,
}

impl Fault {
    fn name(self, nodes: usize) -> &'static str {
        match self {
            Fault::KillLeader if nodes == 1 => "kill -9 + restart",
            Fault::KillLeader => "kill -9 leader",
            Fault::KillFollower => "kill -9 follower",
            Fault::PartitionLeader => "partition leader",
            Fault::Pause => "SIGSTOP/SIGCONT",
            Fault::RestartAll => "kill -9 all + restart",
        }
    }
}

struct Spec {
    name: &'static str,
    queue: &'static str,
    args: FieldTable,
    publishers: usize,
    consumers: usize,
    rate: u64,
    consume_rate: u64,
    schedule: Vec<Fault>,
    /// A quorum queue: with one queue across the nodes, it must survive its leader's loss.
    /// A classic queue lives on one node (RabbitMQ 4's rule): only a restart brings its
    /// messages back, so every node is restarted and drained whatever the layout.
    replicated: bool,
}

/// Applies one fault, holds it, undoes it, and waits until the cluster has a leader again.
fn inject(target: &mut Target, fault: Fault, queue: &str, rng: &mut Rng, hist: &Shared) {
    let n = target.size();
    let all: Vec<usize> = (1..=n).collect();
    let hold = rng.millis(1000, 3000);
    let leader = target.queue_leader(queue, &all).unwrap_or(1);
    let t = Instant::now();
    match fault {
        Fault::KillLeader => {
            target.kill(leader);
            std::thread::sleep(hold);
            target.start(leader);
        }
        Fault::KillFollower => {
            let f = (leader + (rng.next() as usize % (n - 1).max(1))) % n + 1;
            target.kill(f);
            std::thread::sleep(hold);
            target.start(f);
        }
        Fault::PartitionLeader => {
            let Target::Cluster { c, .. } = target else {
                unreachable!("no partition on one node")
            };
            c.run(&["partition", &format!("n{leader}")]);
            // Long enough for the majority to elect a leader of its own.
            std::thread::sleep(hold + Duration::from_secs(2));
            c.run(&["heal"]);
        }
        Fault::Pause => {
            let i = rng.next() as usize % n + 1;
            target.pause(i, true);
            std::thread::sleep(hold);
            target.pause(i, false);
        }
        Fault::RestartAll => {
            for i in 1..=n {
                target.kill(i);
            }
            for i in 1..=n {
                target.start(i);
            }
        }
    }
    hist.lock().unwrap().fault(fault.name(n));
    let agreed = target.leader(&all);
    eprintln!(
        "jepsen: {} (node {leader} led) held {hold:?}; back with leader {agreed:?} after {:?}",
        fault.name(n),
        t.elapsed()
    );
}

/// Runs the workload against `target` with its fault schedule for `WARREN_JEPSEN_SECS`,
/// drains, checks. Returns the report and whether one queue spans the nodes.
fn run(target: &mut Target, spec: Spec) -> (Report, bool) {
    let secs = env_u64("WARREN_JEPSEN_SECS", 15);
    let mut rng = Rng::seeded();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let uris = Arc::new(target.uris());
    let leader_known = || {
        (1..=target.size()).any(|i| {
            target
                .ctl(i, &["list-queues"])
                .and_then(|qs| {
                    qs.as_array()?
                        .iter()
                        .find(|q| q["name"] == "jepsen.probe")
                        .map(|q| q["leader"].is_u64())
                })
                .unwrap_or(false)
        })
    };
    let one_queue = spec.replicated
        && uris.len() > 1
        && rt.block_on(one_queue_across_nodes(&uris, &leader_known));
    rt.block_on(declare_once(&uris[0], spec.queue, &spec.args));
    let hist: Shared = Arc::new(Mutex::new(History::new(spec.publishers, MAX_OPS)));
    let (stop_tx, stop) = watch::channel(false);
    let clients = Clients {
        uris: uris.clone(),
        queue: spec.queue.to_string(),
        args: spec.args.clone(),
        hist: hist.clone(),
        stop,
        rate: spec.rate,
        consume_rate: spec.consume_rate,
    };
    let mut tasks = Vec::new();
    for p in 0..spec.publishers {
        tasks.push(rt.spawn(clients.clone().publisher(p)));
    }
    for c in 0..spec.consumers {
        tasks.push(rt.spawn(clients.clone().consumer(c)));
    }
    let started = Instant::now();
    let mut next = 0;
    // For the time asked, and at least once through the schedule: every kind of fault the
    // test names is injected in every run.
    while started.elapsed() < Duration::from_secs(secs) || next < spec.schedule.len() {
        std::thread::sleep(rng.millis(1000, 2500));
        let fault = spec.schedule[next % spec.schedule.len()];
        next += 1;
        inject(target, fault, spec.queue, &mut rng, &hist);
    }
    // Let the clients catch up on a whole cluster, then stop them.
    std::thread::sleep(Duration::from_secs(2));
    stop_tx.send_replace(true);
    rt.block_on(async {
        for t in tasks {
            timeout(Duration::from_secs(15), t)
                .await
                .expect("a client did not stop within 15 s")
                .expect("a client task panicked");
        }
    });
    let mut drained = Vec::new();
    if one_queue {
        // Failover: the leader of the queue's group is killed and the survivors must hold
        // every confirmed message.
        let all: Vec<usize> = (1..=target.size()).collect();
        let leader = target.queue_leader(spec.queue, &all).unwrap_or(1);
        target.kill(leader);
        hist.lock()
            .unwrap()
            .fault("kill -9 leader before the drain");
        // The survivors elect a leader for the queue's group; every survivor is drained
        // (one that does not lead may have nothing to give), twice, so a node that took
        // over after its first turn gives its messages in the second.
        std::thread::sleep(Duration::from_secs(3));
        let mut errors = Vec::new();
        for _round in 0..2 {
            for i in (1..=target.size()).filter(|i| *i != leader) {
                match rt.block_on(drain(&uris[i - 1], spec.queue, &spec.args, &hist)) {
                    Ok(got) => drained.push((i, got)),
                    Err(e) => errors.push(e),
                }
            }
        }
        assert!(
            !drained.is_empty(),
            "no survivor of n{leader} could be drained: {errors:?}"
        );
        if !errors.is_empty() {
            eprintln!("jepsen: drain errors on survivors of n{leader}: {errors:?}");
        }
        target.start(leader);
    } else {
        // Each node's own instance: every one must give back its confirmed messages.
        for (i, uri) in uris.iter().enumerate() {
            let got = rt
                .block_on(drain(uri, spec.queue, &spec.args, &hist))
                .unwrap_or_else(|e| panic!("{e}"));
            drained.push((i + 1, got));
        }
    }
    drop(rt);
    target.keep_logs();
    let h = hist.lock().unwrap();
    let mut report = h.check();
    report.broker_panics = target.panics();
    eprintln!(
        "jepsen: {} ({} nodes, {} publishers, {} consumers, {secs} s of faults; expectation: {}): \
         {report}; drained (node, messages) {drained:?}",
        spec.name,
        target.size(),
        spec.publishers,
        spec.consumers,
        if one_queue {
            "one queue across nodes, drained from a survivor of its leader's kill"
        } else if uris.len() > 1 && spec.replicated {
            "a queue per node (replication not detected), every node restarted and drained"
        } else if uris.len() > 1 {
            "a classic queue (not replicated), every node restarted and drained"
        } else {
            "one node, restarted and drained"
        }
    );
    if !h.first_errors.is_empty() {
        eprintln!("jepsen: first client errors: {:?}", h.first_errors);
    }
    (report, one_queue)
}

fn single_node(name: &'static str, queue: &'static str, args: FieldTable) {
    let _serial = serial();
    let Some(mut local) = Local::new() else {
        return;
    };
    local.start();
    let mut target = Target::Local(local);
    let (report, _) = run(
        &mut target,
        Spec {
            name,
            queue,
            args,
            publishers: 3,
            consumers: 2,
            rate: 200,
            consume_rate: 220,
            schedule: vec![Fault::KillLeader, Fault::Pause, Fault::KillLeader],
            replicated: false,
        },
    );
    let problems = report.problems();
    assert!(problems.is_empty(), "{name}: {problems:#?}\n{report}");
    assert!(
        report.faults.get("kill -9 + restart").copied().unwrap_or(0) >= 1,
        "{name}: no kill was injected: {report}"
    );
}

#[test]
fn single_node_durable_classic_queue_survives_kill_and_pause() {
    single_node(
        "single node, durable classic queue",
        "jepsen.classic",
        FieldTable::default(),
    );
}

#[test]
fn single_node_quorum_queue_survives_kill_and_pause() {
    single_node("single node, quorum queue", "jepsen.quorum", quorum_args());
}

#[test]
fn three_nodes_quorum_queue_under_faults() {
    three_nodes("3 nodes, quorum queue", "jepsen.qq", quorum_args(), true);
}

#[test]
fn three_nodes_durable_classic_queue_under_faults() {
    three_nodes(
        "3 nodes, durable classic queue",
        "jepsen.classic",
        FieldTable::default(),
        false,
    );
}

fn three_nodes(name: &'static str, queue: &'static str, args: FieldTable, replicated: bool) {
    let _serial = serial();
    let Some(cluster) = Cluster::prepare(name, BRIDGE, NET) else {
        return;
    };
    let nodes = parse(&cluster.run(&["up", "3"]));
    assert_eq!(nodes.len(), 3);
    let mut target = Target::Cluster {
        c: cluster,
        size: 3,
    };
    assert!(target.leader(&[1, 2, 3]).is_some(), "no leader agreed");
    let (report, one_queue) = run(
        &mut target,
        Spec {
            name,
            queue,
            args,
            publishers: 3,
            consumers: 3,
            rate: 100,
            consume_rate: 70,
            schedule: vec![
                Fault::KillLeader,
                Fault::Pause,
                Fault::PartitionLeader,
                Fault::KillFollower,
                Fault::RestartAll,
            ],
            replicated,
        },
    );
    let problems = report.problems();
    assert!(
        problems.is_empty(),
        "{name} (one queue across nodes: {one_queue}): {problems:#?}\n{report}"
    );
    assert!(
        report.faults.len() >= 5,
        "not every kind of fault was injected: {report}"
    );
}

// ---------------------------------------------------------------------------------------
// Metadata: declares and deletes on both sides of a partition converge after it heals.

/// The queue names `warren ctl list-queues` shows on node `i`, in listing order (a name
/// listed twice stays twice).
fn queue_names(c: &Cluster, i: usize) -> Option<Vec<String>> {
    let out = Command::new(&c.bin)
        .args(["ctl", "--format", "json", "--data-dir"])
        .arg(c.state.path().join(format!("cluster/n{i}/data")))
        .arg("list-queues")
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
    Some(
        v.as_array()?
            .iter()
            .filter_map(|q| q["name"].as_str().map(str::to_string))
            .filter(|n| n.starts_with("md."))
            .collect(),
    )
}

/// One metadata operation, its node and whether it was answered -ok.
struct MetaOp {
    node: usize,
    queue: String,
    declare: bool,
    ok: bool,
}

async fn meta_op(uri: &str, queue: &str, declare_it: bool) -> bool {
    // A minority-side change fails after the proposer's 5 s bound: wait longer than that.
    let r = timeout(Duration::from_secs(8), async {
        let (conn, ch) = open(uri).await?;
        let r = if declare_it {
            ch.queue_declare(
                queue.into(),
                QueueDeclareOptions {
                    durable: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .map(|_| ())
        } else {
            ch.queue_delete(queue.into(), QueueDeleteOptions::default())
                .await
                .map(|_| ())
        };
        close(conn).await;
        r.map_err(|e| e.to_string())
    })
    .await;
    match r {
        Ok(Ok(())) => true,
        Ok(Err(e)) => {
            eprintln!("jepsen metadata: {queue} on {uri}: {e}");
            false
        }
        Err(_) => {
            eprintln!("jepsen metadata: {queue} on {uri}: no answer");
            false
        }
    }
}

// The guard only serializes this file's tests; nothing else waits for it.
#[allow(clippy::await_holding_lock)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metadata_declares_and_deletes_during_a_partition_converge_after_heal() {
    let _serial = serial();
    let Some(c) = Cluster::prepare("jepsen metadata convergence", META_BRIDGE, META_NET) else {
        return;
    };
    let nodes = parse(&c.run(&["up", "3"]));
    let uri = |i: usize| format!("amqp://warren:warren@{}/%2f", nodes[i - 1].amqp);
    let target = Target::Cluster { c, size: 3 };
    let leader = target.leader(&[1, 2, 3]).expect("a leader");
    let Target::Cluster { c, .. } = &target else {
        unreachable!()
    };
    let (maj_a, maj_b) = match leader {
        1 => (2, 3),
        2 => (1, 3),
        _ => (1, 2),
    };
    // Before: ten queues everyone has.
    let mut ops = Vec::new();
    for k in 0..10 {
        let q = format!("md.pre.{k}");
        assert!(
            meta_op(&uri(maj_a), &q, true).await,
            "declare {q} before the partition"
        );
        ops.push(MetaOp {
            node: maj_a,
            queue: q,
            declare: true,
            ok: true,
        });
    }
    // The leader is cut off; both sides change metadata at the same time.
    c.run(&["partition", &format!("n{leader}")]);
    let mut side_ops = Vec::new();
    for k in 0..5 {
        side_ops.push((maj_a, format!("md.a.{k}"), true));
        side_ops.push((maj_b, format!("md.b.{k}"), true));
        side_ops.push((maj_b, format!("md.pre.{k}"), false));
        side_ops.push((leader, format!("md.min.{k}"), true));
    }
    side_ops.push((leader, "md.pre.5".to_string(), false));
    // The same name declared on both majority nodes at once: one queue, not two.
    side_ops.push((maj_a, "md.both".to_string(), true));
    side_ops.push((maj_b, "md.both".to_string(), true));
    let handles: Vec<_> = side_ops
        .iter()
        .map(|(node, q, d)| {
            let (u, q, d) = (uri(*node), q.clone(), *d);
            tokio::spawn(async move { meta_op(&u, &q, d).await })
        })
        .collect();
    for ((node, queue, declare), h) in side_ops.into_iter().zip(handles) {
        let ok = h.await.expect("meta op task");
        ops.push(MetaOp {
            node,
            queue,
            declare,
            ok,
        });
    }
    c.run(&["heal"]);
    // Converged: every node lists the same queues, each once, within the bound.
    let deadline = Instant::now() + common::WAIT;
    let lists = loop {
        let lists: Vec<Option<Vec<String>>> = (1..=3).map(|i| queue_names(c, i)).collect();
        let same = lists.iter().all(|l| {
            l.as_ref().map(|l| l.iter().collect::<BTreeSet<_>>())
                == lists[0].as_ref().map(|l| l.iter().collect::<BTreeSet<_>>())
        }) && lists[0].is_some();
        if same || Instant::now() > deadline {
            break lists;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let mut problems = Vec::new();
    let sets: Vec<BTreeSet<String>> = lists
        .iter()
        .map(|l| l.clone().unwrap_or_default().into_iter().collect())
        .collect();
    for (i, l) in lists.iter().enumerate() {
        match l {
            None => problems.push(format!("n{}: list-queues failed", i + 1)),
            Some(l) if l.len() != sets[i].len() => {
                problems.push(format!("n{}: a queue listed twice: {l:?}", i + 1))
            }
            Some(_) if sets[i] != sets[0] => problems.push(format!(
                "n{} differs from n1 after heal: {:?} vs {:?}",
                i + 1,
                sets[i],
                sets[0]
            )),
            _ => {}
        }
    }
    // What each name must be after heal: its last change decides if it was acknowledged;
    // a change that failed may or may not have committed (it may have reached the leader
    // before the partition: docs/cluster.md), so after one the name may be either.
    let mut expect: std::collections::BTreeMap<&str, Option<bool>> = Default::default();
    for op in &ops {
        expect.insert(&op.queue, op.ok.then_some(op.declare));
    }
    for (q, present) in &expect {
        if let Some(present) = present
            && sets[0].contains(*q) != *present
        {
            problems.push(format!(
                "{q}: {} after heal, but its last change, acknowledged, was a {}",
                if *present { "missing" } else { "present" },
                if *present { "declare" } else { "delete" }
            ));
        }
    }
    let minority_ok = ops.iter().filter(|o| o.node == leader && o.ok).count();
    // The first ten were made before the partition.
    let majority_ok = ops[10..]
        .iter()
        .filter(|o| o.node != leader && o.ok)
        .count();
    eprintln!(
        "jepsen metadata: leader n{leader} partitioned; {} changes acknowledged on the majority, \
         {minority_ok} on the minority side (expected 0); after heal every node lists {} md.* \
         queues",
        majority_ok,
        sets[0].len()
    );
    // The majority has a quorum: once it elected a leader (about a second), its changes
    // commit; each had the proposer's whole bound (5 s).
    let majority_ops = ops[10..].iter().filter(|o| o.node != leader).count();
    if majority_ok < majority_ops {
        problems.push(format!(
            "only {majority_ok} of {majority_ops} changes on the majority side (n{maj_a}, \
             n{maj_b}) were acknowledged while n{leader}, the old leader, was cut off"
        ));
    }
    if minority_ok > 0 {
        problems.push(format!(
            "{minority_ok} metadata changes acknowledged on the minority side of a partition"
        ));
    }
    assert!(problems.is_empty(), "{problems:#?}");
}

// ---------------------------------------------------------------------------------------
// The checker itself: each check fails on the history it exists for.

mod checker {
    use super::common::history::{History, Outcome};

    fn history(publishes: &[&[Outcome]], deliveries: &[(u32, &str, bool)]) -> History {
        let mut h = History::new(publishes.len(), 1000);
        for (p, outcomes) in publishes.iter().enumerate() {
            for (seq, o) in outcomes.iter().enumerate() {
                assert_eq!(h.send(p), Some(seq as u64));
                h.settle(p, seq as u64, *o);
            }
        }
        for (session, body, redelivered) in deliveries {
            h.deliver(*session, body.as_bytes(), *redelivered);
        }
        h
    }

    use Outcome::{Confirmed as C, Nacked as N, Unknown as U};

    #[test]
    fn a_clean_history_with_duplicates_requeues_and_unknowns_passes() {
        let h = history(
            &[&[C, C, C, U, N], &[C, C]],
            &[
                (1, "0:0", false),
                (1, "1:0", false),
                (2, "0:1", false),
                (1, "0:2", false),
                (2, "0:1", true),  // a requeue
                (2, "0:2", false), // seen before, flag lost in a crash
                (1, "0:3", false), // unknown outcome, delivered: allowed
                (2, "1:1", false),
            ],
        );
        let r = h.check();
        assert!(r.problems().is_empty(), "{:?}", r.problems());
        assert_eq!(
            (r.published, r.confirmed, r.unknown, r.nacked),
            (7, 5, 1, 1)
        );
        assert_eq!((r.delivered, r.distinct, r.duplicates), (8, 6, 2));
    }

    #[test]
    fn a_confirmed_message_never_delivered_is_lost() {
        let r = history(&[&[C, C, U]], &[(1, "0:0", false)]).check();
        assert_eq!(r.lost, 1);
        assert!(r.problems()[0].contains("(lost), e.g. (publisher, seq) [(0, 1)]"));
    }

    #[test]
    fn a_delivery_nobody_published_is_invented() {
        let r = history(
            &[&[C]],
            &[(1, "0:0", false), (1, "0:1", false), (1, "3:0", false)],
        )
        .check();
        assert_eq!(r.invented, 2);
        let mut h = history(&[&[C]], &[(1, "0:0", false)]);
        h.deliver(1, b"junk", false);
        assert_eq!(h.check().invented, 1);
    }

    #[test]
    fn first_deliveries_out_of_order_in_one_session_fail() {
        let r = history(
            &[&[C, C, C]],
            &[(1, "0:0", false), (1, "0:2", false), (1, "0:1", false)],
        )
        .check();
        assert_eq!(r.out_of_order, 1, "{r}");
        // Flagged redelivered, in another session, or unconfirmed: not an order violation.
        for d in [
            [(1, "0:0", false), (1, "0:2", false), (1, "0:1", true)],
            [(1, "0:0", false), (1, "0:2", false), (2, "0:1", false)],
        ] {
            assert_eq!(history(&[&[C, C, C]], &d).check().out_of_order, 0);
        }
        let r = history(
            &[&[C, U, C]],
            &[(1, "0:2", false), (1, "0:1", false), (1, "0:0", false)],
        )
        .check();
        assert_eq!(r.out_of_order, 1, "only 0 after 2 counts: {r}");
    }

    #[test]
    fn an_idle_run_fails_and_the_history_is_bounded() {
        assert!(!history(&[&[U]], &[]).check().problems().is_empty());
        let mut h = History::new(1, 2);
        assert_eq!((h.send(0), h.send(0), h.send(0)), (Some(0), Some(1), None));
    }
}
