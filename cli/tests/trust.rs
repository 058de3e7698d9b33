//! Storage trust over real sockets (issue 21): what was acked stays acked across a clean
//! stop and, beyond the removal sync bound, a `kill -9`; a drained broker gives its disk
//! back; durable server-named queues survive a restart; a second broker on a data dir in
//! use leaves it alone; everything in the data dir is its owner's only.

use futures_lite::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicGetOptions, BasicQosOptions, ConfirmSelectOptions,
    QueueDeclareOptions, QueuePurgeOptions,
};
use lapin::types::FieldTable;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

mod common;

use common::BIN;

fn data_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("warren-trust-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// A started broker, killed (SIGKILL) when dropped: a failing test leaves none running.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn serve(dir: &Path, args: &[&str]) -> (Running, u16) {
    let served = common::serve(dir, false, args);
    (Running(served.child), served.amqp)
}

/// SIGTERM, then the exit code (a clean stop is 0).
fn sigterm(mut running: Running) -> Option<i32> {
    let child = &mut running.0;
    // SAFETY: kill(2) on our own child's pid, which we have not reaped yet.
    unsafe {
        libc::kill(child.id() as libc::pid_t, libc::SIGTERM);
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match child.try_wait().expect("wait") {
            Some(status) => return status.code(),
            None if Instant::now() > deadline => {
                let _ = child.kill();
                let _ = child.wait();
                panic!("warren did not stop within 60 s of SIGTERM");
            }
            None => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

fn kill9(running: Running) {
    drop(running);
}

async fn channel(port: u16) -> (lapin::Connection, lapin::Channel) {
    let uri = format!("amqp://guest:guest@127.0.0.1:{port}/%2f");
    let c = tokio::time::timeout(
        Duration::from_secs(10),
        lapin::Connection::connect(&uri, lapin::ConnectionProperties::default()),
    )
    .await
    .expect("connect in time")
    .expect("connect");
    let ch = common::bounded_as("channel.open-ok", c.create_channel())
        .await
        .expect("channel");
    (c, ch)
}

async fn declare(ch: &lapin::Channel, queue: &str) -> lapin::Queue {
    let opts = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    common::bounded_as(
        "queue.declare answer",
        ch.queue_declare(queue.into(), opts, FieldTable::default()),
    )
    .await
    .expect("declare")
}

/// Messages in `queue`, by a passive declare.
async fn count(ch: &lapin::Channel, queue: &str) -> u32 {
    let opts = QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    common::bounded_as(
        "queue.declare answer",
        ch.queue_declare(queue.into(), opts, FieldTable::default()),
    )
    .await
    .expect("the queue exists")
    .message_count()
}

/// Publishes `n` messages of `size` bytes (persistent or not) and waits for every confirm,
/// bounded: a broker that stops taking publishes (a resource alarm blocks its publishers, as
/// RabbitMQ's does, when the disk is nearly full) fails the test with the reason instead of
/// hanging it.
async fn publish(ch: &lapin::Channel, queue: &str, n: usize, size: usize, persistent: bool) {
    const BOUND: Duration = Duration::from_secs(120);
    let all = publish_confirmed(ch, queue, n, size, persistent);
    if tokio::time::timeout(BOUND, all).await.is_err() {
        let free = free_disk(&std::env::temp_dir());
        panic!(
            "{n} publishes of {size} bytes not confirmed within {BOUND:?}; {free} bytes free \
             in the temp dir (below the broker's 50 MB disk_free_limit its alarm blocks \
             publishers)"
        );
    }
}

async fn publish_confirmed(
    ch: &lapin::Channel,
    queue: &str,
    n: usize,
    size: usize,
    persistent: bool,
) {
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirms");
    let props =
        lapin::BasicProperties::default().with_delivery_mode(if persistent { 2 } else { 1 });
    let mut pending = Vec::new();
    for i in 0..n {
        let mut body = format!("{i:08}").into_bytes();
        body.resize(size.max(8), b'.');
        let confirm = ch
            .basic_publish(
                "".into(),
                queue.into(),
                Default::default(),
                &body,
                props.clone(),
            )
            .await
            .expect("publish");
        pending.push(confirm);
        // Bounded in flight, so a debug build keeps up.
        if pending.len() >= 512 {
            for c in pending.drain(..) {
                confirmed(c).await;
            }
        }
    }
    for c in pending {
        confirmed(c).await;
    }
}

async fn confirmed(c: lapin::PublisherConfirm) {
    assert!(c.await.expect("confirm").is_ack(), "every publish is acked");
}

/// Free bytes on the file system holding `dir` (statvfs), for failure messages.
fn free_disk(dir: &Path) -> u64 {
    use std::os::unix::ffi::OsStrExt;
    let Ok(path) = std::ffi::CString::new(dir.as_os_str().as_bytes()) else {
        return 0;
    };
    // SAFETY: statvfs(3) writes into a zeroed struct we own; `path` is NUL-terminated.
    unsafe {
        let mut st: libc::statvfs = std::mem::zeroed();
        if libc::statvfs(path.as_ptr(), &mut st) != 0 {
            return 0;
        }
        st.f_bavail as u64 * st.f_frsize as u64
    }
}

/// Consumes `n` messages and acks each; returns their bodies' first 8 bytes.
async fn consume_and_ack(ch: &lapin::Channel, queue: &str, n: usize) -> Vec<String> {
    common::bounded_as(
        "basic.qos-ok",
        ch.basic_qos(500, BasicQosOptions::default()),
    )
    .await
    .expect("qos");
    let mut consumer = common::bounded_as(
        "basic.consume answer",
        ch.basic_consume(
            queue.into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        ),
    )
    .await
    .expect("consume");
    let mut got = Vec::with_capacity(n);
    while got.len() < n {
        let d = tokio::time::timeout(Duration::from_secs(20), consumer.next())
            .await
            .expect("a delivery in time")
            .expect("consumer open")
            .expect("delivery");
        got.push(String::from_utf8_lossy(&d.data[..8.min(d.data.len())]).into_owned());
        common::bounded_as("basic.ack sent", d.ack(BasicAckOptions::default()))
            .await
            .expect("ack");
    }
    got
}

const N: usize = 5_000;

/// How a run ends before the restart.
#[derive(Clone, Copy, Debug)]
enum Stop {
    Sigterm,
    /// `kill -9` one second after the last ack: past the removal sync bound (200 ms).
    Kill9AfterPause,
}

/// 5,000 persistent messages published, then consumed and acked (or purged); the broker
/// stopped as `stop` says and restarted: the queue must be empty.
async fn nothing_acked_comes_back(tag: &str, args: &[&str], purge: bool, stop: Stop) {
    let dir = data_dir(tag);
    let (child, port) = serve(&dir, args);
    {
        // Two connections: with shards they sit on different shards, so acks travel.
        let (_p, publisher) = channel(port).await;
        let (_c, consumer) = channel(port).await;
        declare(&publisher, "jobs").await;
        publish(&publisher, "jobs", N, 100, true).await;
        assert_eq!(count(&publisher, "jobs").await as usize, N);
        if purge {
            let purged = common::bounded_as(
                "queue.purge answer",
                consumer.queue_purge("jobs".into(), QueuePurgeOptions::default()),
            )
            .await
            .expect("purge");
            assert_eq!(purged as usize, N);
        } else {
            let got = consume_and_ack(&consumer, "jobs", N).await;
            assert_eq!(got.len(), N);
            // The acks have reached the broker once a round trip after them is answered.
            let _ = common::bounded_as(
                "basic.cancel-ok",
                consumer.basic_cancel("".into(), Default::default()),
            )
            .await;
        }
        assert_eq!(count(&publisher, "jobs").await, 0);
    }
    match stop {
        Stop::Sigterm => assert_eq!(sigterm(child), Some(0), "a clean stop"),
        Stop::Kill9AfterPause => {
            tokio::time::sleep(Duration::from_secs(1)).await;
            kill9(child);
        }
    }
    let (child, port) = serve(&dir, args);
    let (_c, ch) = channel(port).await;
    let back = count(&ch, "jobs").await;
    kill9(child);
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(
        back, 0,
        "{back} of {N} acked messages came back after {stop:?} ({tag})"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acked_messages_stay_acked_after_sigterm() {
    nothing_acked_comes_back("ack-term", &[], false, Stop::Sigterm).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acked_messages_stay_acked_after_sigterm_over_two_shards() {
    nothing_acked_comes_back("ack-term-2", &["--shards", "2"], false, Stop::Sigterm).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_purge_stays_purged_after_sigterm() {
    nothing_acked_comes_back("purge-term", &[], true, Stop::Sigterm).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acks_are_durable_within_the_sync_bound_of_a_kill_9() {
    nothing_acked_comes_back("ack-kill", &[], false, Stop::Kill9AfterPause).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acks_are_durable_within_the_sync_bound_of_a_kill_9_over_two_shards() {
    nothing_acked_comes_back(
        "ack-kill-2",
        &["--shards", "2"],
        false,
        Stop::Kill9AfterPause,
    )
    .await;
}

/// Bytes of every file under `dir`.
fn disk_use(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .filter_map(Result::ok)
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => disk_use(&e.path()),
            Ok(m) => m.len(),
            Err(_) => 0,
        })
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drained_broker_gives_its_disk_back_with_only_transient_traffic() {
    const BODY: usize = 64 * 1024;
    const COUNT: usize = 3_200; // 200 MiB
    const SMALL: u64 = 8 << 20;
    let dir = data_dir("drain");
    let (child, port) = serve(&dir, &[]);
    let (_c, ch) = channel(port).await;
    declare(&ch, "bulk").await;
    // No consumer yet: most bodies page out to the shared store.
    publish(&ch, "bulk", COUNT, BODY, false).await;
    let full = disk_use(&dir);
    assert!(full > 100 << 20, "the backlog went to disk: {full} bytes");
    let got = consume_and_ack(&ch, "bulk", COUNT).await;
    assert_eq!(got.len(), COUNT);
    let drained = Instant::now();
    let mut used = disk_use(&dir);
    while used > SMALL && drained.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(100)).await;
        used = disk_use(&dir);
    }
    let took = drained.elapsed();
    drop(ch);
    eprintln!("disk use: {full} bytes full, {used} bytes {took:?} after the drain");
    assert!(
        used <= SMALL,
        "{used} bytes on disk 5 s after the drain ({full} when full)"
    );
    assert_eq!(sigterm(child), Some(0));
    let (child, port) = serve(&dir, &[]);
    let (_c, ch) = channel(port).await;
    assert_eq!(count(&ch, "bulk").await, 0);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after_restart = disk_use(&dir);
    kill9(child);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        after_restart <= SMALL,
        "{after_restart} bytes after a restart"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_durable_server_named_queue_survives_a_restart() {
    let dir = data_dir("gen");
    let (child, port) = serve(&dir, &[]);
    let name = {
        let (_c, ch) = channel(port).await;
        let q = declare(&ch, "").await;
        let name = q.name().to_string();
        assert!(name.starts_with("amq.gen-"), "{name}");
        publish(&ch, &name, 1, 10, true).await;
        name
    };
    // Confirmed, so it must survive even a kill -9.
    kill9(child);
    let (child, port) = serve(&dir, &[]);
    let (_c, ch) = channel(port).await;
    let got = common::bounded_as(
        "basic.get answer",
        ch.basic_get(name.as_str().into(), BasicGetOptions { no_ack: true }),
    )
    .await;
    kill9(child);
    let _ = std::fs::remove_dir_all(&dir);
    let got = got.expect("the queue is back").expect("with its message");
    assert_eq!(&got.delivery.data[..8], b"00000000");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_broker_on_a_data_dir_in_use_exits_without_touching_it() {
    let dir = data_dir("lock");
    let (child, port) = serve(&dir, &[]);
    let (_c, ch) = channel(port).await;
    // A transient queue with more than it keeps in memory (for transient messages: 8192
    // or 32 MiB): the rest is paged out under `transient/`, which a second broker used to
    // wipe at start.
    common::bounded_as(
        "queue.declare answer",
        ch.queue_declare("backlog".into(), Default::default(), FieldTable::default()),
    )
    .await
    .expect("declare");
    const BACKLOG: usize = 3_000;
    const MORE: usize = 2_000;
    publish(&ch, "backlog", BACKLOG, 16 << 10, false).await;
    let before = files(&dir);
    assert!(
        before.iter().any(|f| f.starts_with(dir.join("transient"))),
        "paged out: {before:?}"
    );
    let mut second = common::dies_with_test(&mut Command::new(BIN))
        .args([
            "serve",
            "--amqp",
            "127.0.0.1:0",
            "--mqtt",
            "none",
            "--stream",
            "none",
        ])
        .arg("--data-dir")
        .arg(&dir)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run a second warren serve");
    // Bounded: a second broker that does not exit (it would wedge the first) fails here.
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = second.try_wait().expect("wait") {
            break status;
        }
        if Instant::now() > deadline {
            let _ = second.kill();
            let _ = second.wait();
            panic!("the second warren serve did not exit within 30 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut err = String::new();
    if let Some(mut pipe) = second.stderr.take() {
        use std::io::Read;
        let _ = pipe.read_to_string(&mut err);
    }
    let after = files(&dir);
    // A still confirms publishes (these cross into a new page file) and serves every
    // message.
    publish(&ch, "backlog", MORE, 16 << 10, false).await;
    let got = consume_and_ack(&ch, "backlog", BACKLOG + MORE).await;
    kill9(child);
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(status.code(), Some(2), "a configuration error: {err}");
    assert!(err.contains("in use"), "says why: {err}");
    assert_eq!(before, after, "the second broker touched nothing");
    let want: Vec<String> = (0..BACKLOG)
        .chain(0..MORE)
        .map(|i| format!("{i:08}"))
        .collect();
    assert_eq!(got, want, "every message, in order");
}

/// Every file under `dir`, sorted.
fn files(dir: &Path) -> Vec<PathBuf> {
    let mut all = Vec::new();
    modes(dir, &mut all);
    let mut files: Vec<PathBuf> = all
        .into_iter()
        .map(|(p, _)| p)
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    files
}

/// Every path under `dir` with its mode bits.
fn modes(dir: &Path, out: &mut Vec<(PathBuf, u32)>) {
    use std::os::unix::fs::PermissionsExt;
    for e in std::fs::read_dir(dir)
        .expect("read dir")
        .filter_map(Result::ok)
    {
        let Ok(m) = e.metadata() else { continue };
        out.push((e.path(), m.permissions().mode() & 0o777));
        if m.is_dir() {
            modes(&e.path(), out);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_data_dir_is_its_owners_only() {
    use std::os::unix::fs::PermissionsExt;
    let dir = data_dir("modes");
    // Made readable by others beforehand (as an older version did): restricted at start.
    std::fs::create_dir_all(&dir).expect("dir");
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let (child, port) = serve(&dir, &[]);
    {
        let (_c, ch) = channel(port).await;
        declare(&ch, "secret").await;
        // Inline bodies (segment files, journal) and shared ones (>= 4096 bytes).
        publish(&ch, "secret", 10, 100, true).await;
        publish(&ch, "secret", 10, 10_000, true).await;
    }
    let mut all = Vec::new();
    modes(&dir, &mut all);
    let root = std::fs::metadata(&dir).expect("dir").permissions().mode() & 0o777;
    kill9(child);
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(root, 0o700, "the data dir");
    let names: Vec<String> = all
        .iter()
        .filter_map(|(p, _)| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .collect();
    for expected in ["definitions.redb", "warren.lock", "warren.sock", "journal"] {
        assert!(
            names.iter().any(|n| n.starts_with(expected)),
            "{expected} in {names:?}"
        );
    }
    assert!(names.iter().any(|n| n.ends_with(".ws")), "a shared file");
    let open: Vec<_> = all.iter().filter(|(_, m)| m & 0o077 != 0).collect();
    assert!(
        open.is_empty(),
        "readable by others: {:?}",
        open.iter()
            .map(|(p, m)| format!("{} {m:o}", p.display()))
            .collect::<Vec<_>>()
    );
}
