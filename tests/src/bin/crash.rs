//! Crash-safety test: publishers with confirms and consumers with manual acks run while the
//! broker is killed with SIGKILL at random moments and restarted on the same data dir, in a
//! loop. Afterwards every confirmed message must have been delivered at least once, nothing
//! delivered may be a message that was never published, and per queue the messages delivered
//! for the first time without the redelivered flag must arrive in publish order. Last, after
//! a drain that takes every message, a clean stop (SIGTERM) and a restart: no message may
//! come back (an ack lost at a clean stop resurrects its message).
//!
//! Written against the AMQP 0.9.1 contract only, so it must pass against RabbitMQ too.
//!
//! ```text
//! cargo build -p warren-cli && cargo run -p warren-tests --bin crash-test
//! ```
//!
//! Environment (all optional):
//! - `WARREN_BIN`: the broker binary (default `target/debug/warren` of this workspace).
//! - `CRASH_CYCLES` (20), `CRASH_QUEUES` (3), `CRASH_RATE` (messages/s per publisher, 500),
//!   `CRASH_CONSUME_RATE` (per consumer, 400, 0 = unlimited: slower than publishers, so the
//!   queues hold a growing backlog at every kill), `CRASH_REQUEUE_PERCENT` (1),
//!   `CRASH_MIN_UP_MS` / `CRASH_MAX_UP_MS` (300 / 1500: how long the broker runs between
//!   kills), `CRASH_SEED` (to replay a run's kill timings), `CRASH_DEADLINE_SECS` (120: the
//!   whole run), `CRASH_START_TIMEOUT_SECS` (30: each start until it accepts connections).
//! - `CRASH_DATA_DIR`: where the broker keeps its data (default `target/crash-data`, wiped).
//! - `CRASH_SERVE_ARGS`: more `warren serve` arguments, split at whitespace (e.g.
//!   `--shards 2`).
//! - `CRASH_AMQP=HOST:PORT`: test a broker this program does not start (e.g. RabbitMQ). With
//!   `CRASH_START_CMD` (run with `sh -c`, kept as a child) it is started and, unless
//!   `CRASH_KILL_CMD` is given, killed with SIGKILL like Warren; with neither, no crash is
//!   injected and the run only checks the client side. The start command's output is
//!   discarded (redirect it in the command to keep it); a broker started here is killed at
//!   the end. RabbitMQ example in docs/benchmarks.md ("Crash test").

use futures_lite::StreamExt;
use futures_lite::future::poll_once;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicGetOptions, BasicNackOptions, BasicPublishOptions,
    BasicQosOptions, ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties};
use std::collections::{BTreeSet, HashSet, VecDeque};
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::watch;
use tokio::time::{sleep, timeout};

/// Any single broker round trip; a broker that does not answer within it counts as gone.
const OP_TIMEOUT: Duration = Duration::from_secs(5);
/// Publishes awaiting their confirm per publisher: enough to keep a group commit busy.
const CONFIRM_WINDOW: usize = 256;
const PREFETCH: u16 = 100;

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    match std::env::var(name) {
        Ok(v) => v
            .parse()
            .unwrap_or_else(|_| fail(&format!("{name}={v:?} is not a valid value"))),
        Err(_) => default,
    }
}

fn fail(msg: &str) -> ! {
    eprintln!("crash-test: {msg}");
    std::process::exit(2)
}

struct Config {
    cycles: u32,
    queues: usize,
    rate: u64,
    min_up: u64,
    max_up: u64,
    seed: u64,
    deadline: Duration,
    start_timeout: Duration,
    requeue_percent: u64,
    consume_rate: u64,
}

/// xorshift64*: the kill timings only need to be varied and replayable, not good.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn between(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }
}

/// What the clients saw, per queue.
#[derive(Default)]
struct QueueLedger {
    /// Ids below this were handed to `basic.publish`: anything else delivered was invented.
    published: u64,
    /// Ids the broker acked (routed, not returned).
    confirmed: BTreeSet<u64>,
    nacked: u64,
    returned: u64,
    /// Every delivery in arrival order: (id, redelivered).
    deliveries: Vec<(u64, bool)>,
}

#[derive(Default)]
struct Ledger {
    queues: Vec<QueueLedger>,
    /// Bodies that do not parse as an id of the queue they came from.
    malformed: Vec<String>,
    /// Durable queues a passive declare did not find right after a restart.
    queues_lost: Vec<String>,
    /// Messages back in the queues after the final drain took every one, a clean stop and
    /// a restart: taken (acked) messages that came back. `None`: no clean stop was made.
    resurrected: Option<u64>,
}

type Shared = Arc<Mutex<Ledger>>;

fn record_delivery(ledger: &Shared, q: usize, data: &[u8], redelivered: bool) {
    let text = String::from_utf8_lossy(data);
    let parsed = text
        .split_once(':')
        .and_then(|(qi, id)| Some((qi.parse::<usize>().ok()?, id.parse::<u64>().ok()?)));
    let mut l = ledger.lock().unwrap();
    match parsed {
        Some((qi, id)) if qi == q => l.queues[q].deliveries.push((id, redelivered)),
        _ => l.malformed.push(format!("{}: {text:?}", queue_name(q))),
    }
}

fn queue_name(q: usize) -> String {
    format!("crash-q{q}")
}

/// What the clients are allowed to do: connect to broker generation `generation` while `up`.
#[derive(Clone, Copy, Default)]
struct Phase {
    generation: u64,
    up: bool,
    stop: bool,
}

/// Waits until the broker is up; `None` once the run is stopping.
async fn wait_up(phase: &mut watch::Receiver<Phase>) -> Option<u64> {
    loop {
        let p = *phase.borrow_and_update();
        if p.stop {
            return None;
        }
        if p.up {
            return Some(p.generation);
        }
        phase.changed().await.ok()?;
    }
}

/// After a session ended: retry at once if the broker was restarted meanwhile, else after a
/// pause (the kill may not be announced yet, or the connection failed for another reason).
async fn after_session(phase: &mut watch::Receiver<Phase>, generation: u64) {
    let _ = timeout(Duration::from_millis(200), async {
        while phase.borrow().generation == generation && !phase.borrow().stop {
            if phase.changed().await.is_err() {
                return;
            }
        }
    })
    .await;
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

async fn declare(ch: &Channel, q: usize, passive: bool) -> Result<lapin::Queue, String> {
    within(
        "queue.declare",
        ch.queue_declare(
            queue_name(q).into(),
            QueueDeclareOptions {
                durable: true,
                passive,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        ),
    )
    .await
}

async fn close(conn: Connection) {
    let _ = timeout(Duration::from_secs(1), conn.close(200, "bye".into())).await;
}

fn settle(ledger: &Shared, q: usize, id: u64, outcome: &lapin::Result<Confirmation>) {
    let mut l = ledger.lock().unwrap();
    let ql = &mut l.queues[q];
    match outcome {
        Ok(Confirmation::Ack(None)) => {
            ql.confirmed.insert(id);
        }
        Ok(Confirmation::Ack(Some(_))) => ql.returned += 1,
        Ok(Confirmation::Nack(_)) => ql.nacked += 1,
        // The connection died first: the message may or may not be stored, both are fine.
        Ok(Confirmation::NotRequested) | Err(_) => {}
    }
}

type Inflight = VecDeque<(u64, lapin::PublisherConfirm)>;

/// Records every confirm that has already arrived, without waiting.
async fn settle_ready(ledger: &Shared, q: usize, inflight: &mut Inflight) {
    let mut pending = VecDeque::with_capacity(inflight.len());
    while let Some((id, mut confirm)) = inflight.pop_front() {
        match poll_once(&mut confirm).await {
            Some(outcome) => settle(ledger, q, id, &outcome),
            None => pending.push_back((id, confirm)),
        }
    }
    *inflight = pending;
}

async fn publisher(
    q: usize,
    uri: String,
    rate: u64,
    ledger: Shared,
    mut phase: watch::Receiver<Phase>,
) {
    let started = Instant::now();
    let mut next_id = 0u64;
    while let Some(generation) = wait_up(&mut phase).await {
        let mut inflight = Inflight::new();
        let result = publish_session(
            q,
            &uri,
            rate,
            started,
            &mut next_id,
            &ledger,
            &phase,
            &mut inflight,
        )
        .await;
        settle_ready(&ledger, q, &mut inflight).await;
        if let Err(e) = result
            && phase.borrow().up
            && phase.borrow().generation == generation
        {
            eprintln!("publisher {q}: {e}");
        }
        after_session(&mut phase, generation).await;
    }
}

#[allow(clippy::too_many_arguments)]
async fn publish_session(
    q: usize,
    uri: &str,
    rate: u64,
    started: Instant,
    next_id: &mut u64,
    ledger: &Shared,
    phase: &watch::Receiver<Phase>,
    inflight: &mut Inflight,
) -> Result<(), String> {
    let (conn, ch) = open(uri).await?;
    within(
        "confirm.select",
        ch.confirm_select(ConfirmSelectOptions::default()),
    )
    .await?;
    // Declaring on every connect is what applications do; it must not disturb what survived.
    declare(&ch, q, false).await?;
    let props = BasicProperties::default().with_delivery_mode(2);
    while !phase.borrow().stop {
        // Pace to `rate` since the start, so the backlog after a run stays small to drain.
        let due = started + Duration::from_micros(*next_id * 1_000_000 / rate.max(1));
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            sleep(wait).await;
        }
        let id = *next_id;
        *next_id += 1;
        ledger.lock().unwrap().queues[q].published = *next_id;
        let body = format!("{q}:{id}");
        let confirm = within(
            "basic.publish",
            ch.basic_publish(
                "".into(),
                queue_name(q).into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                body.as_bytes(),
                props.clone(),
            ),
        )
        .await?;
        inflight.push_back((id, confirm));
        settle_ready(ledger, q, inflight).await;
        while inflight.len() >= CONFIRM_WINDOW {
            let (id, confirm) = inflight.pop_front().expect("window is not empty");
            let outcome = timeout(OP_TIMEOUT, confirm)
                .await
                .map_err(|_| format!("no confirm within {OP_TIMEOUT:?}"))?;
            let failed = outcome.as_ref().err().map(|e| format!("confirm: {e}"));
            settle(ledger, q, id, &outcome);
            if let Some(e) = failed {
                return Err(e);
            }
        }
    }
    // Stopping: give the last confirms a bounded chance to arrive, so they count.
    let deadline = Instant::now() + OP_TIMEOUT;
    while let Some((id, confirm)) = inflight.pop_front() {
        let left = deadline.saturating_duration_since(Instant::now());
        match timeout(left, confirm).await {
            Ok(outcome) => settle(ledger, q, id, &outcome),
            Err(_) => break,
        }
    }
    close(conn).await;
    Ok(())
}

/// How a consumer behaves: it requeues `requeue_percent` of its deliveries and takes at most
/// `rate` per second (0: no limit).
#[derive(Clone, Copy)]
struct Pace {
    requeue_percent: u64,
    rate: u64,
}

async fn consumer(
    q: usize,
    uri: String,
    pace: Pace,
    seed: u64,
    ledger: Shared,
    mut phase: watch::Receiver<Phase>,
) {
    let mut rng = Rng(seed | 1);
    let (started, mut taken) = (Instant::now(), 0u64);
    while let Some(generation) = wait_up(&mut phase).await {
        let result = consume_session(
            q,
            &uri,
            pace,
            (started, &mut taken),
            &mut rng,
            &ledger,
            &phase,
        )
        .await;
        if let Err(e) = result
            && phase.borrow().up
            && phase.borrow().generation == generation
        {
            eprintln!("consumer {q}: {e}");
        }
        after_session(&mut phase, generation).await;
    }
}

async fn consume_session(
    q: usize,
    uri: &str,
    pace: Pace,
    (started, taken): (Instant, &mut u64),
    rng: &mut Rng,
    ledger: &Shared,
    phase: &watch::Receiver<Phase>,
) -> Result<(), String> {
    let (conn, ch) = open(uri).await?;
    declare(&ch, q, false).await?;
    within(
        "basic.qos",
        ch.basic_qos(PREFETCH, BasicQosOptions::default()),
    )
    .await?;
    let mut deliveries = within(
        "basic.consume",
        ch.basic_consume(
            queue_name(q).into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        ),
    )
    .await?;
    while !phase.borrow().stop {
        let d = match timeout(Duration::from_millis(500), deliveries.next()).await {
            Err(_) => continue, // idle: look at `stop` again
            Ok(None) => return Err("consumer cancelled".into()),
            Ok(Some(Err(e))) => return Err(format!("delivery: {e}")),
            Ok(Some(Ok(d))) => d,
        };
        record_delivery(ledger, q, &d.data, d.redelivered);
        *taken += 1;
        // An occasional requeue puts redelivered messages among first deliveries, which the
        // order check must tolerate.
        if rng.between(1, 100) <= pace.requeue_percent {
            within(
                "basic.nack",
                d.acker.nack(BasicNackOptions {
                    requeue: true,
                    ..BasicNackOptions::default()
                }),
            )
            .await?;
        } else {
            within("basic.ack", d.acker.ack(BasicAckOptions::default())).await?;
        }
        // Consuming slower than publishing keeps a backlog in the queues, so that every kill
        // finds confirmed messages that only storage can bring back.
        if let Some(micros) = (*taken * 1_000_000).checked_div(pace.rate)
            && let Some(wait) =
                (started + Duration::from_micros(micros)).checked_duration_since(Instant::now())
        {
            sleep(wait).await;
        }
    }
    close(conn).await;
    Ok(())
}

/// The broker under test and how to crash it.
enum Broker {
    /// Warren started by this program.
    Warren {
        bin: PathBuf,
        data_dir: PathBuf,
        log: PathBuf,
        port: u16,
        child: Option<Child>,
    },
    /// A broker started (and maybe killed) by shell commands, reached at `addr`.
    Command {
        addr: String,
        start: Option<String>,
        kill: Option<String>,
        child: Option<Child>,
    },
}

impl Broker {
    fn uri(&self) -> String {
        match self {
            Broker::Warren { port, .. } => format!("amqp://guest:guest@127.0.0.1:{port}/%2f"),
            Broker::Command { addr, .. } => format!("amqp://guest:guest@{addr}/%2f"),
        }
    }

    fn can_crash(&self) -> bool {
        match self {
            Broker::Warren { .. } => true,
            Broker::Command { start, kill, .. } => start.is_some() || kill.is_some(),
        }
    }

    /// Starts the broker and waits (bounded) until it accepts AMQP connections.
    async fn start(&mut self, within_time: Duration) -> Result<(), String> {
        match self {
            Broker::Warren {
                bin,
                data_dir,
                log,
                port,
                child,
            } => {
                let out = OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&*log)
                    .map_err(|e| format!("open {}: {e}", log.display()))?;
                let from = out.metadata().map(|m| m.len()).unwrap_or(0);
                let err = out.try_clone().map_err(|e| e.to_string())?;
                let mut c = Command::new(&*bin)
                    .args(["serve", "--amqp", &format!("127.0.0.1:{port}")])
                    .args([
                        "--mqtt",
                        "none",
                        "--management",
                        "none",
                        "--prometheus",
                        "none",
                        "--stream",
                        "none",
                    ])
                    .arg("--data-dir")
                    .arg(&*data_dir)
                    .args(
                        std::env::var("CRASH_SERVE_ARGS")
                            .unwrap_or_default()
                            .split_whitespace(),
                    )
                    .env("NO_COLOR", "1")
                    .stdin(Stdio::null())
                    .stdout(out)
                    .stderr(err)
                    .spawn()
                    .map_err(|e| format!("cannot run {}: {e}", bin.display()))?;
                let deadline = Instant::now() + within_time;
                loop {
                    if let Some(p) = listening_port(log, from) {
                        *port = p;
                        *child = Some(c);
                        return Ok(());
                    }
                    if let Ok(Some(status)) = c.try_wait() {
                        return Err(format!(
                            "warren exited ({status}) before listening; log:\n{}",
                            log_tail(log, from)
                        ));
                    }
                    if Instant::now() > deadline {
                        let _ = c.kill();
                        let _ = c.wait();
                        return Err(format!(
                            "warren did not log `listening on` within {within_time:?}; log:\n{}",
                            log_tail(log, from)
                        ));
                    }
                    sleep(Duration::from_millis(10)).await;
                }
            }
            Broker::Command {
                addr, start, child, ..
            } => {
                if let Some(cmd) = start {
                    // Not our stdout: a broker holding it would keep a `| tee` open forever.
                    let c = Command::new("sh")
                        .args(["-c", cmd])
                        .stdin(Stdio::null())
                        .stdout(Stdio::null())
                        .stderr(Stdio::null())
                        .spawn()
                        .map_err(|e| format!("cannot run {cmd:?}: {e}"))?;
                    *child = Some(c);
                }
                let uri = format!("amqp://guest:guest@{addr}/%2f");
                let deadline = Instant::now() + within_time;
                loop {
                    match open(&uri).await {
                        Ok((conn, _)) => {
                            close(conn).await;
                            return Ok(());
                        }
                        Err(e) if Instant::now() > deadline => {
                            return Err(format!("broker at {addr} not up in time: {e}"));
                        }
                        Err(_) => sleep(Duration::from_millis(100)).await,
                    }
                }
            }
        }
    }

    /// SIGTERM and wait for a clean exit (code 0). `Ok(false)`: this broker cannot be
    /// stopped cleanly from here (one started by a command).
    async fn stop_cleanly(&mut self, within_time: Duration) -> Result<bool, String> {
        let Broker::Warren { child, .. } = self else {
            return Ok(false);
        };
        let Some(mut c) = child.take() else {
            return Ok(false);
        };
        let sent = Command::new("kill")
            .args(["-TERM", &c.id().to_string()])
            .status()
            .map_err(|e| format!("cannot run kill: {e}"))?;
        if !sent.success() {
            return Err(format!("kill -TERM failed: {sent}"));
        }
        let deadline = Instant::now() + within_time;
        loop {
            match c.try_wait().map_err(|e| format!("wait for warren: {e}"))? {
                Some(status) if status.success() => return Ok(true),
                Some(status) => return Err(format!("warren stopped with {status} on SIGTERM")),
                None if Instant::now() > deadline => {
                    let _ = c.kill();
                    let _ = c.wait();
                    return Err(format!(
                        "warren did not stop within {within_time:?} of SIGTERM"
                    ));
                }
                None => sleep(Duration::from_millis(20)).await,
            }
        }
    }

    /// SIGKILL, and reap the process so the next start finds the port and files free.
    fn kill(&mut self) -> Result<(), String> {
        match self {
            Broker::Warren { child, .. } => {
                if let Some(mut c) = child.take() {
                    c.kill().map_err(|e| format!("SIGKILL warren: {e}"))?;
                    c.wait().map_err(|e| format!("reap warren: {e}"))?;
                }
                Ok(())
            }
            Broker::Command {
                start, kill, child, ..
            } => {
                if start.is_some() && child.is_none() {
                    return Ok(()); // already down: a kill command could hit a reused pid
                }
                if let Some(cmd) = kill {
                    let status = Command::new("sh")
                        .args(["-c", cmd])
                        .status()
                        .map_err(|e| format!("cannot run {cmd:?}: {e}"))?;
                    if !status.success() {
                        return Err(format!("{cmd:?} failed: {status}"));
                    }
                }
                if let Some(mut c) = child.take() {
                    if kill.is_none() {
                        c.kill().map_err(|e| format!("SIGKILL broker: {e}"))?;
                    }
                    c.wait().map_err(|e| format!("reap broker: {e}"))?;
                }
                Ok(())
            }
        }
    }

    fn describe(&self) -> String {
        match self {
            Broker::Warren {
                bin, data_dir, log, ..
            } => format!(
                "{} (data dir {}, log {})",
                bin.display(),
                data_dir.display(),
                log.display()
            ),
            Broker::Command { addr, .. } => format!("external broker at {addr}"),
        }
    }
}

impl Drop for Broker {
    /// Leaves nothing running that this program started.
    fn drop(&mut self) {
        let started_here = match self {
            Broker::Warren { .. } => true,
            Broker::Command { start, .. } => start.is_some(),
        };
        if started_here {
            let _ = self.kill();
        }
    }
}

/// The port from the first `listening on HOST:PORT` line written at or after `from`.
fn listening_port(log: &PathBuf, from: u64) -> Option<u16> {
    let mut f = File::open(log).ok()?;
    f.seek(SeekFrom::Start(from)).ok()?;
    let mut text = String::new();
    f.read_to_string(&mut text).ok()?;
    let rest = &text[text.find("listening on ")? + "listening on ".len()..];
    let addr = rest.split_whitespace().next()?;
    addr.rsplit_once(':')?.1.parse().ok()
}

fn log_tail(log: &PathBuf, from: u64) -> String {
    let text = std::fs::read(log).unwrap_or_default();
    let start = (from as usize).min(text.len());
    let tail = &text[start..];
    String::from_utf8_lossy(&tail[tail.len().saturating_sub(4000)..]).into_owned()
}

/// Right after a restart, before any client may redeclare: every durable queue must exist.
async fn check_queues(uri: &str, queues: usize, ledger: &Shared, cycle: u32) -> Result<(), String> {
    let (conn, _) = open(uri).await?;
    for q in 0..queues {
        // A 404 closes the channel, so each check gets its own.
        let ch = within("channel.open", conn.create_channel()).await?;
        if declare(&ch, q, true).await.is_err() {
            ledger
                .lock()
                .unwrap()
                .queues_lost
                .push(format!("{} after restart {cycle}", queue_name(q)));
        }
    }
    close(conn).await;
    Ok(())
}

/// Takes every message left, with nothing else connected, recording each as a delivery.
async fn drain(uri: &str, queues: usize, ledger: &Shared) -> Result<(), String> {
    let (conn, _) = open(uri).await?;
    for q in 0..queues {
        let ch = within("channel.open", conn.create_channel()).await?;
        let Ok(queue) = declare(&ch, q, true).await else {
            continue; // already counted as lost by check_queues
        };
        let mut left = queue.message_count();
        within("basic.qos", ch.basic_qos(1000, BasicQosOptions::default())).await?;
        let mut deliveries = within(
            "basic.consume",
            ch.basic_consume(
                queue_name(q).into(),
                "".into(),
                BasicConsumeOptions {
                    no_ack: true,
                    ..BasicConsumeOptions::default()
                },
                FieldTable::default(),
            ),
        )
        .await?;
        while left > 0 {
            match timeout(OP_TIMEOUT, deliveries.next()).await {
                Ok(Some(Ok(d))) => {
                    record_delivery(ledger, q, &d.data, d.redelivered);
                    left -= 1;
                }
                Ok(Some(Err(e))) => return Err(format!("drain {}: {e}", queue_name(q))),
                Ok(None) => break,
                Err(_) => {
                    eprintln!(
                        "drain {}: {left} of {} reported messages never came",
                        queue_name(q),
                        queue.message_count()
                    );
                    break;
                }
            }
        }
        // The count came from the broker under test; a get proves the queue is really empty.
        let ch = within("channel.open", conn.create_channel()).await?;
        while let Some(m) = within(
            "basic.get",
            ch.basic_get(queue_name(q).into(), BasicGetOptions { no_ack: true }),
        )
        .await?
        {
            record_delivery(ledger, q, &m.delivery.data, m.delivery.redelivered);
        }
    }
    close(conn).await;
    Ok(())
}

async fn setup(uri: &str, queues: usize) -> Result<(), String> {
    let (conn, _) = open(uri).await?;
    for q in 0..queues {
        // An external broker keeps queues from earlier runs; start from empty ones.
        let ch = within("channel.open", conn.create_channel()).await?;
        within(
            "queue.delete",
            ch.queue_delete(queue_name(q).into(), QueueDeleteOptions::default()),
        )
        .await?;
        declare(&ch, q, false).await?;
    }
    close(conn).await;
    Ok(())
}

fn totals(ledger: &Shared) -> (u64, usize, usize) {
    let l = ledger.lock().unwrap();
    let published = l.queues.iter().map(|q| q.published).sum();
    let confirmed = l.queues.iter().map(|q| q.confirmed.len()).sum();
    let delivered = l.queues.iter().map(|q| q.deliveries.len()).sum();
    (published, confirmed, delivered)
}

async fn run(cfg: &Config, broker: &mut Broker, ledger: &Shared) -> Result<u32, String> {
    let mut rng = Rng(cfg.seed | 1);
    broker.start(cfg.start_timeout).await?;
    let uri = broker.uri();
    println!("crash-test: broker {} at {uri}", broker.describe());
    setup(&uri, cfg.queues).await?;
    let (phase_tx, phase_rx) = watch::channel(Phase {
        generation: 1,
        up: true,
        stop: false,
    });
    let mut clients = Vec::new();
    for q in 0..cfg.queues {
        clients.push(tokio::spawn(publisher(
            q,
            uri.clone(),
            cfg.rate,
            ledger.clone(),
            phase_rx.clone(),
        )));
        clients.push(tokio::spawn(consumer(
            q,
            uri.clone(),
            Pace {
                requeue_percent: cfg.requeue_percent,
                rate: cfg.consume_rate,
            },
            rng.next(),
            ledger.clone(),
            phase_rx.clone(),
        )));
    }
    if !broker.can_crash() {
        println!("crash-test: no way to kill this broker: cycles only let time pass");
    }
    let mut cycles = 0;
    for cycle in 1..=cfg.cycles {
        let up = rng.between(cfg.min_up, cfg.max_up);
        sleep(Duration::from_millis(up)).await;
        if !broker.can_crash() {
            cycles = cycle;
            continue;
        }
        phase_tx.send_modify(|p| p.up = false);
        broker.kill()?;
        let restart = Instant::now();
        broker.start(cfg.start_timeout).await?;
        let restarted_in = restart.elapsed();
        check_queues(&uri, cfg.queues, ledger, cycle).await?;
        phase_tx.send_modify(|p| {
            p.up = true;
            p.generation += 1;
        });
        cycles = cycle;
        let (published, confirmed, delivered) = totals(ledger);
        println!(
            "cycle {cycle:>3}: killed after {up:>4} ms, listening again after {:>5} ms; \
             published {published}, confirmed {confirmed}, delivered {delivered}",
            restarted_in.as_millis()
        );
    }
    phase_tx.send_modify(|p| p.stop = true);
    for c in clients {
        timeout(Duration::from_secs(15), c)
            .await
            .map_err(|_| "a client did not stop within 15 s".to_string())?
            .map_err(|e| format!("a client task failed: {e}"))?;
    }
    // One last crash, so that what the clients left unacked must also survive a kill.
    if broker.can_crash() {
        broker.kill()?;
        broker.start(cfg.start_timeout).await?;
        check_queues(&uri, cfg.queues, ledger, cfg.cycles + 1).await?;
    }
    drain(&uri, cfg.queues, ledger).await?;
    // Last, acks with nothing after them: a round of persistent messages, each consumed and
    // acked; after a clean stop and a restart none may come back.
    if matches!(broker, Broker::Warren { .. }) {
        ack_round(&uri, cfg.queues).await?;
    }
    if broker.stop_cleanly(cfg.start_timeout).await? {
        broker.start(cfg.start_timeout).await?;
        check_queues(&uri, cfg.queues, ledger, cfg.cycles + 2).await?;
        let back = messages_left(&uri, cfg.queues).await?;
        ledger.lock().unwrap().resurrected = Some(back);
    }
    Ok(cycles)
}

/// Messages per queue in the final ack round.
const ACK_ROUND: usize = 1000;

/// Publishes `ACK_ROUND` persistent messages to each queue (confirmed), then consumes and
/// acks every one. Their bodies are not ids (`final:N`), so they stay out of the ledger.
async fn ack_round(uri: &str, queues: usize) -> Result<(), String> {
    let (conn, ch) = open(uri).await?;
    within(
        "confirm.select",
        ch.confirm_select(ConfirmSelectOptions::default()),
    )
    .await?;
    for q in 0..queues {
        for i in 0..ACK_ROUND {
            let confirm = within(
                "basic.publish",
                ch.basic_publish(
                    "".into(),
                    queue_name(q).into(),
                    BasicPublishOptions::default(),
                    format!("final:{i}").as_bytes(),
                    BasicProperties::default().with_delivery_mode(2),
                ),
            )
            .await?;
            drop(confirm);
        }
    }
    if !within("confirms", ch.wait_for_confirms()).await?.is_empty() {
        return Err("a publish of the final ack round was nacked".into());
    }
    within(
        "basic.qos",
        ch.basic_qos(PREFETCH, BasicQosOptions::default()),
    )
    .await?;
    for q in 0..queues {
        let mut deliveries = within(
            "basic.consume",
            ch.basic_consume(
                queue_name(q).into(),
                format!("final-{q}").as_str().into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            ),
        )
        .await?;
        for _ in 0..ACK_ROUND {
            match timeout(OP_TIMEOUT, deliveries.next()).await {
                Ok(Some(Ok(d))) => {
                    within("basic.ack", d.ack(BasicAckOptions::default())).await?;
                }
                Ok(Some(Err(e))) => return Err(format!("final round {}: {e}", queue_name(q))),
                _ => {
                    return Err(format!(
                        "final round {}: a message never came",
                        queue_name(q)
                    ));
                }
            }
        }
        within(
            "basic.cancel",
            ch.basic_cancel(format!("final-{q}").as_str().into(), Default::default()),
        )
        .await?;
    }
    close(conn).await;
    Ok(())
}

/// Messages the queues hold, by passive declares.
async fn messages_left(uri: &str, queues: usize) -> Result<u64, String> {
    let (conn, _) = open(uri).await?;
    let mut left = 0;
    for q in 0..queues {
        let ch = within("channel.open", conn.create_channel()).await?;
        if let Ok(queue) = declare(&ch, q, true).await {
            left += u64::from(queue.message_count());
        }
    }
    close(conn).await;
    Ok(left)
}

/// Checks the ledger; returns the violations found.
fn verify(ledger: &Ledger, cycles: u32) -> Vec<String> {
    let mut problems = Vec::new();
    let mut confirmed_total = 0;
    for (q, ql) in ledger.queues.iter().enumerate() {
        let name = queue_name(q);
        confirmed_total += ql.confirmed.len();
        let delivered: HashSet<u64> = ql.deliveries.iter().map(|&(id, _)| id).collect();
        let lost: Vec<u64> = ql
            .confirmed
            .iter()
            .copied()
            .filter(|id| !delivered.contains(id))
            .collect();
        if !lost.is_empty() {
            problems.push(format!(
                "{name}: {} confirmed messages never delivered (lost), e.g. ids {:?}",
                lost.len(),
                &lost[..lost.len().min(10)]
            ));
        }
        let invented: BTreeSet<u64> = delivered
            .iter()
            .copied()
            .filter(|&id| id >= ql.published)
            .collect();
        if !invented.is_empty() {
            problems.push(format!(
                "{name}: {} delivered ids were never published (invented), e.g. {:?}",
                invented.len(),
                invented.iter().take(10).collect::<Vec<_>>()
            ));
        }
        // First deliveries without the redelivered flag are messages never requeued: the
        // queue must hand them out in publish order. A repeat is a requeue even if the
        // broker lost the flag, so only the first sight of an id counts.
        let mut seen = HashSet::new();
        let mut last: Option<u64> = None;
        let mut out_of_order = Vec::new();
        for &(id, redelivered) in &ql.deliveries {
            if seen.insert(id) && !redelivered {
                if let Some(prev) = last
                    && id < prev
                {
                    out_of_order.push((prev, id));
                }
                last = Some(last.map_or(id, |p| p.max(id)));
            }
        }
        if !out_of_order.is_empty() {
            problems.push(format!(
                "{name}: {} never-requeued messages arrived out of order, e.g. (after, got) {:?}",
                out_of_order.len(),
                &out_of_order[..out_of_order.len().min(10)]
            ));
        }
    }
    if !ledger.malformed.is_empty() {
        problems.push(format!(
            "{} deliveries with bodies no publisher wrote (invented), e.g. {:?}",
            ledger.malformed.len(),
            &ledger.malformed[..ledger.malformed.len().min(5)]
        ));
    }
    if !ledger.queues_lost.is_empty() {
        problems.push(format!(
            "{} durable queue(s) missing after a restart, e.g. {:?}",
            ledger.queues_lost.len(),
            &ledger.queues_lost[..ledger.queues_lost.len().min(5)]
        ));
    }
    if let Some(back) = ledger.resurrected
        && back > 0
    {
        problems.push(format!(
            "{back} messages came back after every message was taken (the last {ACK_ROUND} \
             per queue acked), a clean stop and a restart: acked messages resurrected"
        ));
    }
    // Guard against a run that proves nothing (no broker traffic got through at all).
    if confirmed_total == 0 {
        problems.push("no message was confirmed: the run exercised nothing".into());
    }
    if (confirmed_total as u64) < u64::from(cycles) {
        problems.push(format!(
            "only {confirmed_total} confirms over {cycles} cycles: too little traffic to judge"
        ));
    }
    problems
}

fn summary(ledger: &Ledger, cycles: u32) -> String {
    let mut published = 0;
    let (mut confirmed, mut delivered, mut unique, mut redelivered) = (0, 0, 0, 0);
    let (mut nacked, mut returned) = (0, 0);
    for ql in &ledger.queues {
        published += ql.published;
        confirmed += ql.confirmed.len();
        nacked += ql.nacked;
        returned += ql.returned;
        delivered += ql.deliveries.len();
        unique += ql
            .deliveries
            .iter()
            .map(|&(id, _)| id)
            .collect::<HashSet<_>>()
            .len();
        redelivered += ql.deliveries.iter().filter(|d| d.1).count();
    }
    let back = ledger
        .resurrected
        .map_or("not checked (no clean stop)".to_string(), |n| n.to_string());
    format!(
        "cycles {cycles}, queues {}, published {published}, confirmed {confirmed} \
         (nacked {nacked}, returned {returned}), delivered {delivered} ({unique} distinct, \
         {} duplicates), redelivered flag {redelivered}, back after the final clean stop \
         {back}",
        ledger.queues.len(),
        delivered - unique
    )
}

fn main() {
    let seed = std::env::var("CRASH_SEED")
        .ok()
        .map(|s| {
            s.parse()
                .unwrap_or_else(|_| fail("CRASH_SEED must be a u64"))
        })
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        });
    let cfg = Config {
        cycles: env_or("CRASH_CYCLES", 20),
        queues: env_or("CRASH_QUEUES", 3),
        rate: env_or("CRASH_RATE", 500),
        min_up: env_or("CRASH_MIN_UP_MS", 300),
        max_up: env_or("CRASH_MAX_UP_MS", 1500),
        seed,
        deadline: Duration::from_secs(env_or("CRASH_DEADLINE_SECS", 120)),
        start_timeout: Duration::from_secs(env_or("CRASH_START_TIMEOUT_SECS", 30)),
        requeue_percent: env_or("CRASH_REQUEUE_PERCENT", 1),
        consume_rate: env_or("CRASH_CONSUME_RATE", 400),
    };
    if cfg.min_up > cfg.max_up || cfg.queues == 0 {
        fail("need CRASH_MIN_UP_MS <= CRASH_MAX_UP_MS and CRASH_QUEUES >= 1");
    }
    let workspace = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ sits in the workspace")
        .to_path_buf();
    let mut broker = match std::env::var("CRASH_AMQP") {
        Ok(addr) => Broker::Command {
            addr,
            start: std::env::var("CRASH_START_CMD").ok(),
            kill: std::env::var("CRASH_KILL_CMD").ok(),
            child: None,
        },
        Err(_) => {
            let bin = std::env::var_os("WARREN_BIN")
                .map(PathBuf::from)
                .unwrap_or_else(|| workspace.join("target/debug/warren"));
            if !bin.is_file() {
                fail(&format!(
                    "broker binary {} not found: run `cargo build -p warren-cli` or set WARREN_BIN",
                    bin.display()
                ));
            }
            let data_dir = std::env::var_os("CRASH_DATA_DIR")
                .map(PathBuf::from)
                .unwrap_or_else(|| workspace.join("target/crash-data"));
            let _ = std::fs::remove_dir_all(&data_dir);
            let log = data_dir.with_extension("log");
            let _ = std::fs::remove_file(&log);
            Broker::Warren {
                bin,
                data_dir,
                log,
                port: 0,
                child: None,
            }
        }
    };
    println!(
        "crash-test: seed {seed} (CRASH_SEED to replay), {} cycles, {} queues, {} msg/s per publisher",
        cfg.cycles, cfg.queues, cfg.rate
    );
    let ledger: Shared = Arc::new(Mutex::new(Ledger {
        queues: (0..cfg.queues).map(|_| QueueLedger::default()).collect(),
        ..Ledger::default()
    }));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let started = Instant::now();
    let outcome = runtime.block_on(async {
        match timeout(cfg.deadline, run(&cfg, &mut broker, &ledger)).await {
            Ok(r) => r,
            Err(_) => Err(format!("the run did not finish within {:?}", cfg.deadline)),
        }
    });
    let description = broker.describe();
    drop(broker);
    // Client tasks may still hold the ledger if the run was cut short; read it under the lock.
    let ledger = ledger.lock().unwrap();
    let cycles = *outcome.as_ref().unwrap_or(&0);
    println!(
        "crash-test: {} in {:.1} s",
        summary(&ledger, cycles),
        started.elapsed().as_secs_f64()
    );
    let problems = match outcome {
        Ok(cycles) => verify(&ledger, cycles),
        Err(e) => vec![format!("the run failed: {e}")],
    };
    if problems.is_empty() {
        println!("crash-test: PASSED");
        return;
    }
    for p in &problems {
        eprintln!("crash-test: FAILED: {p}");
    }
    eprintln!("crash-test: broker was {description}; replay with CRASH_SEED={seed}");
    std::process::exit(1);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One queue: `published` ids handed out, `confirmed` acked, `deliveries` in arrival order.
    fn ledger(published: u64, confirmed: &[u64], deliveries: &[(u64, bool)]) -> Ledger {
        Ledger {
            queues: vec![QueueLedger {
                published,
                confirmed: confirmed.iter().copied().collect(),
                deliveries: deliveries.to_vec(),
                ..QueueLedger::default()
            }],
            ..Ledger::default()
        }
    }

    fn problems(l: &Ledger) -> String {
        verify(l, 1).join("\n")
    }

    #[test]
    fn a_clean_run_passes_with_duplicates_requeues_and_unconfirmed_messages() {
        // 2 was requeued (flagged), 3 was redelivered after a crash that lost the flag,
        // 5 was never confirmed and never delivered, 6 unconfirmed but delivered.
        let l = ledger(
            7,
            &[0, 1, 2, 3, 4],
            &[
                (0, false),
                (1, false),
                (2, false),
                (3, false),
                (2, true),
                (3, false),
                (4, false),
                (6, false),
            ],
        );
        assert_eq!(problems(&l), "");
    }

    #[test]
    fn a_confirmed_message_never_delivered_is_lost() {
        let l = ledger(3, &[0, 1, 2], &[(0, false), (2, false)]);
        assert!(problems(&l).contains("1 confirmed messages never delivered (lost), e.g. ids [1]"));
    }

    #[test]
    fn a_delivery_never_published_is_invented() {
        let l = ledger(2, &[0, 1], &[(0, false), (1, false), (7, false)]);
        assert!(problems(&l).contains("never published (invented), e.g. [7]"));
        let mut l = ledger(1, &[0], &[(0, false)]);
        l.malformed.push("crash-q0: \"junk\"".into());
        assert!(problems(&l).contains("bodies no publisher wrote"));
    }

    #[test]
    fn first_deliveries_out_of_order_fail_unless_flagged_redelivered() {
        let l = ledger(3, &[0, 1, 2], &[(0, false), (2, false), (1, false)]);
        assert!(problems(&l).contains("out of order, e.g. (after, got) [(2, 1)]"));
        let l = ledger(3, &[0, 1, 2], &[(0, false), (2, false), (1, true)]);
        assert_eq!(problems(&l), "");
    }

    #[test]
    fn a_missing_queue_or_an_idle_run_fails() {
        let mut l = ledger(1, &[0], &[(0, false)]);
        l.queues_lost.push("crash-q0 after restart 1".into());
        assert!(problems(&l).contains("missing after a restart"));
        assert!(problems(&ledger(0, &[], &[])).contains("no message was confirmed"));
    }
}
