//! Starting a real `warren serve` for the CLI's tests, and the clients several of them share.
#![allow(dead_code)]

pub mod http;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub const BIN: &str = env!("CARGO_BIN_EXE_warren");

/// A started `warren serve` and the ports it logged.
pub struct Served {
    pub child: Child,
    pub amqp: u16,
    /// `None` when started without MQTT.
    pub mqtt: Option<u16>,
    /// The HTTP API's port, when `args` asked for it (`--management 127.0.0.1:0`).
    pub management: Option<u16>,
    /// The Prometheus port, when `args` asked for it.
    pub prometheus: Option<u16>,
    /// The stream protocol's port, when `args` asked for it (`--stream 127.0.0.1:0`).
    pub stream: Option<u16>,
    /// Every line the broker logged so far (tests look for their log lines here).
    pub log: Arc<Mutex<Vec<String>>>,
}

impl Served {
    /// Whether a logged line contains every one of `parts`, waiting up to 5 s for it.
    pub fn logged(&self, parts: &[&str]) -> bool {
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        loop {
            let found = self
                .log
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .iter()
                .any(|l| parts.iter().all(|p| l.contains(p)));
            if found || std::time::Instant::now() > deadline {
                return found;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// Makes the started process die with the thread that starts it (Linux's
/// `PR_SET_PDEATHSIG`): a test that fails (a bounded wait that panics, say) before it kills
/// its broker ends that broker with its own thread instead of leaving it running for the
/// rest of the run. Tests start their brokers on the test's own thread, which lives as long
/// as the test.
pub fn dies_with_test(cmd: &mut Command) -> &mut Command {
    use std::os::unix::process::CommandExt;
    // SAFETY: prctl(2) is async-signal-safe; the closure touches nothing else.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        })
    }
}

/// Starts `warren serve` on `dir` with AMQP (and, if `mqtt`, MQTT) on free loopback
/// ports, plus `args`; waits until it logs them. The HTTP API and Prometheus listeners
/// and stream listeners are off unless `args` name them (their default ports would collide between tests).
pub fn serve(dir: &Path, mqtt: bool, args: &[&str]) -> Served {
    serve_logging(dir, mqtt, args, "info")
}

/// `serve`, logging at `level` (`RUST_LOG`).
pub fn serve_logging(dir: &Path, mqtt: bool, args: &[&str], level: &str) -> Served {
    serve_amqp_at(dir, "127.0.0.1:0", mqtt, args, level)
}

/// `serve_logging` with AMQP on `amqp` (a restart on the port a client knows).
pub fn serve_amqp_at(dir: &Path, amqp: &str, mqtt: bool, args: &[&str], level: &str) -> Served {
    let mqtt_addr = if mqtt { "127.0.0.1:0" } else { "none" };
    let mut off = Vec::new();
    for flag in ["--management", "--prometheus", "--stream"] {
        if !args.contains(&flag) {
            off.extend([flag, "none"]);
        }
    }
    let mut child = dies_with_test(&mut Command::new(BIN))
        .args(["serve", "--amqp", amqp, "--mqtt", mqtt_addr, "--data-dir"])
        .arg(dir)
        .args(&off)
        .args(args)
        .env("RUST_LOG", level)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start warren serve");
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    let log = Arc::new(Mutex::new(Vec::new()));
    let kept = log.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Ok(mut kept) = kept.lock() {
                kept.push(line.clone());
            }
            if let Some(rest) = line.split("listening on 127.0.0.1:").nth(1) {
                let port: String = rest.chars().take_while(char::is_ascii_digit).collect();
                let kind = ["(AMQP", "(MQTT", "(HTTP", "(Prometheus", "(stream"]
                    .iter()
                    .position(|k| rest.contains(k));
                let _ = tx.send((kind, port.parse::<u16>().ok()));
            }
        }
    });
    let wants = |flag: &str| args.contains(&flag);
    let mut ports: [Option<u16>; 5] = [None; 5];
    while ports[0].is_none()
        || (mqtt && ports[1].is_none())
        || (wants("--management") && ports[2].is_none())
        || (wants("--prometheus") && ports[3].is_none())
        || (wants("--stream") && ports[4].is_none())
    {
        let (kind, p) = rx
            .recv_timeout(Duration::from_secs(20))
            .expect("warren serve logs its ports within 20 s");
        if let Some(k) = kind {
            ports[k] = p;
        }
    }
    Served {
        child,
        amqp: ports[0].expect("AMQP port"),
        mqtt: ports[1],
        management: ports[2],
        prometheus: ports[3],
        stream: ports[4],
        log,
    }
}

/// An empty data directory `$TMP/warren-{suite}-{tag}-{pid}` that outlives the brokers
/// started on it (restart tests start a second one there).
pub fn scratch_dir(suite: &str, tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("warren-{suite}-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create the data dir");
    dir
}

/// A started broker, SIGKILLed when dropped (also when a test fails midway); its data
/// directory stays for the next start.
pub struct Killed(pub Served);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.child.kill();
        let _ = self.0.child.wait();
    }
}

/// A `warren serve` (AMQP and MQTT on free ports, plus `args`) on a scratch data directory,
/// killed and removed when dropped.
pub struct Broker {
    pub served: Served,
    pub dir: PathBuf,
}

impl Broker {
    /// Starts one on `$TMP/warren-{suite}-{tag}-{pid}` (emptied first).
    pub fn start(suite: &str, tag: &str, args: &[&str]) -> Broker {
        let dir = std::env::temp_dir().join(format!("warren-{suite}-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let served = serve(&dir, true, args);
        Broker { served, dir }
    }

    /// The HTTP API's port (started with `--management 127.0.0.1:0`).
    pub fn api(&self) -> u16 {
        self.served.management.expect("HTTP API port")
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        let _ = self.served.child.kill();
        let _ = self.served.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// An MQTT 3.1.1 CONNECT with `client_id` (clean session, no credentials); waits for the
/// CONNACK and checks it accepts.
pub fn mqtt_connect(port: u16, client_id: &str) -> TcpStream {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect MQTT");
    let mut var = vec![0, 4, b'M', b'Q', b'T', b'T', 4, 0x02, 0, 60];
    var.extend_from_slice(&(client_id.len() as u16).to_be_bytes());
    var.extend_from_slice(client_id.as_bytes());
    let mut packet = vec![0x10, var.len() as u8];
    packet.extend(var);
    s.write_all(&packet).expect("CONNECT");
    let mut connack = [0u8; 4];
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("read timeout");
    s.read_exact(&mut connack).expect("CONNACK");
    assert_eq!(connack, [0x20, 2, 0, 0], "connection accepted");
    s
}

/// The exit status of `child`, waited for up to `within` after `what` (a signal, say): a
/// broker that does not stop is killed and the test fails naming the wait instead of
/// hanging in `Child::wait`.
pub fn exited(child: &mut Child, within: Duration, what: &str) -> std::process::ExitStatus {
    let deadline = Instant::now() + within;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return status,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "warren (pid {}) did not exit within {within:?} of {what}",
                    child.id()
                );
            }
            Err(e) => panic!("waiting for warren (pid {}): {e}", child.id()),
        }
    }
}

/// Polls `f` until it returns `Some`, for up to 5 s.
pub fn eventually<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The AMQP and MQTT tests' bound on each client step. It names a hang, it does not time
/// the broker: generous, because CI machines are small and loaded (a step that pages a
/// backlog to disk or waits on a restart can take seconds there).
pub const STEP: Duration = Duration::from_secs(30);

/// `f` within [`STEP`]. A plain fn (not `async`) so that `#[track_caller]` holds: the panic
/// names the test's line, that is what was waited for.
#[track_caller]
pub fn bounded<F: std::future::Future>(f: F) -> impl std::future::Future<Output = F::Output> {
    bounded_as("answer", f)
}

/// `f` within [`STEP`]; the panic names `what` and the caller's line.
#[track_caller]
pub fn bounded_as<F: std::future::Future>(
    what: impl std::fmt::Display,
    f: F,
) -> impl std::future::Future<Output = F::Output> {
    let at = std::panic::Location::caller();
    async move {
        match tokio::time::timeout(STEP, f).await {
            Ok(v) => v,
            Err(_) => panic!("no {what} within {STEP:?} (awaited at {at})"),
        }
    }
}

/// A lapin connection to the broker's AMQP `port` as guest, with one channel.
pub async fn channel(port: u16) -> (lapin::Connection, lapin::Channel) {
    let uri = format!("amqp://guest:guest@127.0.0.1:{port}/%2f");
    let c = bounded_as(
        "connection.open-ok",
        lapin::Connection::connect(&uri, lapin::ConnectionProperties::default()),
    )
    .await
    .expect("connect");
    let ch = bounded_as("channel.open-ok", c.create_channel())
        .await
        .expect("channel");
    (c, ch)
}
