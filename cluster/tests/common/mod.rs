//! What the network-namespace tests share: `scripts/cluster.sh` driven from a test, the
//! lines it prints, and `warren ctl cluster-status`.

#![allow(dead_code)] // each test binary uses its own part

pub mod history;
pub mod quorum;

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

/// How long a node may take to start, a client to connect, a leader to be agreed on.
pub const WAIT: Duration = Duration::from_secs(20);

pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The broker binary (WARREN_BIN, or this workspace's debug build).
pub fn bin() -> PathBuf {
    std::env::var_os("WARREN_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo().join("target/debug/warren"))
}

pub struct Cluster {
    pub state: tempfile::TempDir,
    pub bin: PathBuf,
    /// The bridge and subnet (first three octets) of this test's own.
    pub bridge: &'static str,
    pub net: &'static str,
    /// More environment for `scripts/cluster.sh` (e.g. `WARREN_CLUSTER_TLS_DIR`).
    pub env: Vec<(&'static str, std::path::PathBuf)>,
}

impl Cluster {
    /// A cluster handle on this test's own bridge and subnet, or `None` (with a SKIPPED
    /// line naming `what`) when this machine cannot run it; with `WARREN_CLUSTER_REQUIRE`
    /// set (CI), a machine that cannot is a failure instead.
    pub fn prepare(what: &str, bridge: &'static str, net: &'static str) -> Option<Cluster> {
        // `cargo test --workspace` in scripts/test.sh sets this: each netns test file has a
        // step of its own there (with WARREN_CLUSTER_REQUIRE), so running it here too would
        // only run it twice (checked: test.sh's `cluster_steps_cover_every_netns_test`).
        if std::env::var_os("WARREN_CLUSTER_OWN_STEPS").is_some() {
            eprintln!("SKIPPED {what}: scripts/test.sh runs it in a step of its own");
            return None;
        }
        let bin = bin();
        if let Some(why) = unavailable(&bin) {
            assert!(
                std::env::var_os("WARREN_CLUSTER_REQUIRE").is_none(),
                "WARREN_CLUSTER_REQUIRE is set but {why}"
            );
            eprintln!("SKIPPED {what}: {why}");
            return None;
        }
        Some(Cluster {
            state: tempfile::tempdir().expect("tempdir"),
            bin,
            bridge,
            net,
            env: Vec::new(),
        })
    }

    /// Runs `scripts/cluster.sh ARGS`; returns stdout, panics with stderr on failure.
    pub fn run(&self, args: &[&str]) -> String {
        let out = self.command(args).output().expect("run scripts/cluster.sh");
        assert!(
            out.status.success(),
            "cluster.sh {args:?} failed: {}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    pub fn command(&self, args: &[&str]) -> Command {
        let mut c = Command::new(repo().join("scripts/cluster.sh"));
        c.args(args)
            .env("WARREN_BIN", &self.bin)
            .env("WARREN_CLUSTER_DIR", self.state.path().join("cluster"))
            .env("WARREN_CLUSTER_NET", self.net)
            .env("WARREN_CLUSTER_BRIDGE", self.bridge)
            .env("WARREN_CLUSTER_WAIT", "20")
            .envs(self.env.iter().map(|(k, v)| (*k, v)));
        c
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // A failed assertion must not leave namespaces or brokers behind; the nodes' logs
        // are kept for the post-mortem (the state dir goes with `down`).
        if std::thread::panicking() {
            let keep = std::env::temp_dir().join("warren-cluster-test-logs");
            let _ = std::fs::create_dir_all(&keep);
            for i in 1..=3 {
                let log = self.state.path().join(format!("cluster/n{i}/log"));
                let _ = std::fs::copy(&log, keep.join(format!("n{i}.log")));
            }
            eprintln!("node logs kept in {}", keep.display());
        }
        let _ = self.command(&["down"]).output();
    }
}

/// Why this machine cannot run the test, if it cannot.
pub fn unavailable(bin: &std::path::Path) -> Option<String> {
    let ok = Command::new("ip")
        .args(["netns", "list"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !ok {
        return Some("`ip netns` is unavailable (needs iproute2 and root)".into());
    }
    if !bin.exists() {
        return Some(format!(
            "broker binary {} not found: cargo build -p warren-cli, or set WARREN_BIN",
            bin.display()
        ));
    }
    None
}

#[derive(Clone)]
pub struct Node {
    pub name: String,
    pub amqp: String,
    pub mqtt: String,
    pub http: String,
}

/// Parses the `NODE amqp=HOST:PORT mqtt=HOST:PORT http=HOST:PORT` lines.
pub fn parse(out: &str) -> Vec<Node> {
    out.lines()
        .map(|line| {
            let mut words = line.split_whitespace();
            let name = words.next().expect("node name").to_string();
            let mut field = |key: &str| {
                let w = words
                    .next()
                    .unwrap_or_else(|| panic!("no {key} in {line:?}"));
                let v = w
                    .strip_prefix(key)
                    .and_then(|w| w.strip_prefix('='))
                    .unwrap_or_else(|| panic!("expected {key}= in {line:?}"));
                v.parse::<std::net::SocketAddr>()
                    .unwrap_or_else(|_| panic!("{key} is not HOST:PORT in {line:?}"));
                v.to_string()
            };
            let (amqp, mqtt, http) = (field("amqp"), field("mqtt"), field("http"));
            Node {
                name,
                amqp,
                mqtt,
                http,
            }
        })
        .collect()
}

/// An AMQP connection to `node` as the test user, and a channel on it.
pub async fn amqp_channel(node: &Node) -> (lapin::Connection, lapin::Channel) {
    let uri = format!("amqp://warren:warren@{}/%2f", node.amqp);
    let conn = bounded(
        "amqp connect",
        lapin::Connection::connect(&uri, lapin::ConnectionProperties::default()),
    )
    .await
    .unwrap_or_else(|e| panic!("{}: connect: {e}", node.name));
    let ch = answered("channel.open-ok", conn.create_channel())
        .await
        .expect("channel");
    (conn, ch)
}

/// How long a client step on a node may take: well above the nodes' own wait for the
/// cluster (`WARREN_CLUSTER_WAIT`, [`WAIT`]), so that a slow election or a partition shows as
/// the broker's own error, and only a step left unanswered as our timeout.
pub const STEP: Duration = Duration::from_secs(60);

/// `f` within [`STEP`]; the panic names `what` and the caller's line (a plain fn, not
/// `async`, so that `#[track_caller]` holds).
#[track_caller]
pub fn answered<T>(
    what: &str,
    f: impl std::future::Future<Output = T>,
) -> impl std::future::Future<Output = T> {
    let at = std::panic::Location::caller();
    async move {
        tokio::time::timeout(STEP, f)
            .await
            .unwrap_or_else(|_| panic!("no {what} in {STEP:?} (awaited at {at})"))
    }
}

/// `f` within [`WAIT`]; the panic names `what` and the caller's line (a plain fn, not
/// `async`, so that `#[track_caller]` holds).
#[track_caller]
pub fn bounded<T>(
    what: &str,
    f: impl std::future::Future<Output = T>,
) -> impl std::future::Future<Output = T> {
    let at = std::panic::Location::caller();
    async move {
        tokio::time::timeout(WAIT, f)
            .await
            .unwrap_or_else(|_| panic!("{what}: no answer in {WAIT:?} (awaited at {at})"))
    }
}

/// Node `i`'s `warren ctl cluster-status`, if it answers.
pub fn cluster_status(
    state: &std::path::Path,
    bin: &std::path::Path,
    i: usize,
) -> Option<serde_json::Value> {
    let out = Command::new(bin)
        .args(["ctl", "--format", "json", "--data-dir"])
        .arg(state.join(format!("n{i}/data")))
        .arg("cluster-status")
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    serde_json::from_slice(&out.stdout).ok()
}

/// Polls until nodes `ids` all name the same leader, one of `ids`; returns it and how long
/// that took.
pub fn agreed_leader(
    state: &std::path::Path,
    bin: &std::path::Path,
    ids: &[usize],
) -> (u64, Duration) {
    let start = std::time::Instant::now();
    loop {
        let leaders: Vec<Option<u64>> = ids
            .iter()
            .map(|i| cluster_status(state, bin, *i).and_then(|s| s["leader"].as_u64()))
            .collect();
        if let Some(Some(l)) = leaders.first()
            && leaders.iter().all(|x| *x == Some(*l))
            && ids.contains(&(*l as usize))
        {
            return (*l, start.elapsed());
        }
        assert!(
            start.elapsed() < WAIT,
            "nodes {ids:?} agree on no leader among them: {leaders:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}
