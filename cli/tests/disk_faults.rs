//! Disk faults in a stopped broker's data directory (issue 43, "Storage under disk faults"):
//! confirmed messages written over AMQP (lapin) to a real `warren serve`, the broker
//! stopped, then bytes flipped at seeded random offsets in every kind of data file (and each
//! kind cut short), and the broker started on the result. Asserted every time: no panic; a
//! refusal to start only for a damaged definitions database, with exit code 3 and one line
//! naming the file and the way out; no garbage served (every body checked whole); no
//! message twice; every message the damage did not hit served; and what was lost reported
//! in the log, message for message.

use lapin::options::{BasicGetOptions, ConfirmSelectOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

mod common;

use common::{BIN, bounded};

/// Queues, message counts and body sizes: inline bodies (in the segment files) and shared
/// ones (at or above 4096 bytes, in `shared/*.ws`).
const QUEUES: [(&str, u64, usize); 2] = [("small", 300, 200), ("large", 100, 20_000)];

fn body(queue: &str, i: u64, len: usize) -> Vec<u8> {
    let mut b = format!("{queue}:{i:06}:").into_bytes();
    let start = b.len();
    b.extend((start..len).map(|j| (i as usize * 7 + j * 13) as u8));
    b
}

/// Which message a served body is, if it is exactly one that was published.
fn check(queue: &str, len: usize, data: &[u8]) -> Option<u64> {
    let text = std::str::from_utf8(data.get(..queue.len() + 8)?).ok()?;
    let i: u64 = text.strip_prefix(queue)?.get(1..7)?.parse().ok()?;
    (data == body(queue, i, len).as_slice()).then_some(i)
}

/// A started (or refused) `warren serve`: its AMQP port, or its exit code, and every line
/// it printed.
struct Start {
    child: std::process::Child,
    port: Option<u16>,
    lines: Arc<Mutex<Vec<String>>>,
}

impl Start {
    fn log(&self) -> String {
        self.lines.lock().map(|l| l.join("\n")).unwrap_or_default()
    }
}

impl Drop for Start {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(dir: &Path) -> Start {
    let mut child = common::dies_with_test(&mut Command::new(BIN))
        .args(["serve", "--amqp", "127.0.0.1:0", "--mqtt", "none"])
        .args([
            "--management",
            "none",
            "--prometheus",
            "none",
            "--stream",
            "none",
        ])
        .arg("--data-dir")
        .arg(dir)
        .env("RUST_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start warren serve");
    let lines = Arc::new(Mutex::new(Vec::new()));
    let (tx, rx) = std::sync::mpsc::channel();
    for pipe in [
        Box::new(child.stdout.take().expect("stdout")) as Box<dyn std::io::Read + Send>,
        Box::new(child.stderr.take().expect("stderr")),
    ] {
        let (lines, tx) = (lines.clone(), tx.clone());
        std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                if let Some(rest) = line.split("listening on 127.0.0.1:").nth(1)
                    && rest.contains("(AMQP")
                {
                    let port: String = rest.chars().take_while(char::is_ascii_digit).collect();
                    let _ = tx.send(port.parse::<u16>().ok());
                }
                if let Ok(mut l) = lines.lock() {
                    l.push(line);
                }
            }
        });
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut s = Start {
        child,
        port: None,
        lines,
    };
    while Instant::now() < deadline {
        if let Ok(port) = rx.recv_timeout(Duration::from_millis(50)) {
            s.port = port;
            return s;
        }
        if s.child.try_wait().expect("wait").is_some() {
            // Let the readers take the last lines.
            std::thread::sleep(Duration::from_millis(100));
            return s;
        }
    }
    panic!("warren neither served nor exited within 20 s:\n{}", s.log());
}

fn stop(mut s: Start) -> String {
    // SAFETY: kill(2) on our own child's pid, not reaped yet.
    unsafe {
        libc::kill(s.child.id() as libc::pid_t, libc::SIGTERM);
    }
    let status = common::exited(&mut s.child, Duration::from_secs(30), "SIGTERM");
    assert_eq!(status.code(), Some(0), "a clean stop:\n{}", s.log());
    std::thread::sleep(Duration::from_millis(50));
    s.log()
}

async fn channel(port: u16) -> (lapin::Connection, lapin::Channel) {
    common::channel(port).await
}

async fn publish_all(port: u16) {
    let (_c, ch) = channel(port).await;
    bounded(ch.confirm_select(ConfirmSelectOptions::default()))
        .await
        .expect("confirms");
    let props = lapin::BasicProperties::default().with_delivery_mode(2);
    for (queue, n, len) in QUEUES {
        let opts = QueueDeclareOptions {
            durable: true,
            ..Default::default()
        };
        bounded(ch.queue_declare(queue.into(), opts, FieldTable::default()))
            .await
            .expect("declare");
        let mut pending = Vec::new();
        for i in 0..n {
            let confirm = bounded(ch.basic_publish(
                "".into(),
                queue.into(),
                Default::default(),
                &body(queue, i, len),
                props.clone(),
            ))
            .await
            .expect("publish");
            pending.push(confirm);
        }
        for c in pending {
            assert!(bounded(c).await.expect("confirm").is_ack(), "confirmed");
        }
    }
}

/// Every message served, per queue, each checked whole; `None` for a queue that is gone.
async fn drain(port: u16) -> Vec<Option<BTreeSet<u64>>> {
    let mut out = Vec::new();
    for (queue, n, len) in QUEUES {
        // A channel per queue: a passive declare of a missing queue closes it.
        let (_c, ch) = channel(port).await;
        let opts = QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        if bounded(ch.queue_declare(queue.into(), opts, FieldTable::default()))
            .await
            .is_err()
        {
            out.push(None);
            continue;
        }
        let mut got = BTreeSet::new();
        while let Some(m) = bounded(ch.basic_get(queue.into(), BasicGetOptions { no_ack: true }))
            .await
            .expect("get")
        {
            let i = check(queue, len, &m.delivery.data).unwrap_or_else(|| {
                panic!(
                    "garbage served from {queue}: {:?}",
                    String::from_utf8_lossy(&m.delivery.data[..m.delivery.data.len().min(40)])
                )
            });
            assert!(got.insert(i), "{queue} {i} served twice");
            assert!(got.len() as u64 <= n);
        }
        out.push(Some(got));
    }
    out
}

/// What the log says was lost: the `lost=N` and `torn=N` of the recovery lines, and one per
/// message a read found unreadable.
fn reported_lost(log: &str) -> u64 {
    let mut sum = 0;
    for line in log.lines() {
        for key in ["lost=", "torn="] {
            for part in line.split(key).skip(1) {
                let n: String = part.chars().take_while(char::is_ascii_digit).collect();
                sum += n.parse::<u64>().unwrap_or(0);
            }
        }
        if line.contains("the message is lost") {
            sum += 1;
        }
    }
    sum
}

fn copy_tree(from: &Path, to: &Path) {
    let _ = std::fs::remove_dir_all(to);
    std::fs::create_dir_all(to).expect("mkdir");
    for e in std::fs::read_dir(from).expect("dir").flatten() {
        let (src, dst) = (e.path(), to.join(e.file_name()));
        let kind = e.file_type().expect("type");
        if kind.is_dir() {
            copy_tree(&src, &dst);
        } else if kind.is_file() {
            std::fs::copy(&src, &dst).expect("copy");
        }
    }
}

/// The data files by kind, sorted.
fn data_files(dir: &Path) -> Vec<(&'static str, PathBuf)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).expect("dir").flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
                continue;
            }
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
            let kind = match p.extension().and_then(|x| x.to_str()) {
                Some("ws") => "shared",
                Some("qd") => "segment data",
                Some("qi") => "segment index",
                Some("wj") => "journal",
                Some("redb") => "definitions",
                _ if name == "name" => "queue name",
                _ => continue,
            };
            out.push((kind, p));
        }
    }
    out.sort();
    out
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// One damaged copy of `pristine`, started: the assertions of the module docs.
/// `damage` says whether it hit the definitions, and at most how many messages it may cost.
async fn trial(pristine: &Path, what: &str, damage: impl FnOnce(&Path) -> (bool, Option<u64>)) {
    let dir = pristine.with_extension(what.replace(' ', "-"));
    copy_tree(pristine, &dir);
    let (definitions_hit, bound) = damage(&dir);
    let s = start(&dir);
    let Some(port) = s.port else {
        let mut s = s;
        let code = s.child.wait().expect("exit").code();
        let log = s.log();
        assert!(!log.contains("panicked"), "{what}: no panic:\n{log}");
        assert!(
            definitions_hit,
            "{what}: refused only for its definitions:\n{log}"
        );
        assert_eq!(code, Some(3), "{what}: the damaged-data exit code:\n{log}");
        let line = log
            .lines()
            .find(|l| l.contains("definitions.redb") && l.contains("To recover"))
            .unwrap_or_else(|| panic!("{what}: one line naming the file and the way out:\n{log}"));
        assert!(
            !line.contains("another warren"),
            "{what}: no lock hint: {line}"
        );
        eprintln!("{what}: refused to start (exit 3): {line}");
        let _ = std::fs::remove_dir_all(&dir);
        return;
    };
    let served = drain(port).await;
    let log = stop(s);
    assert!(!log.contains("panicked"), "{what}: no panic:\n{log}");
    let mut lost = 0;
    for ((queue, n, _), got) in QUEUES.iter().zip(&served) {
        let got = got
            .as_ref()
            .unwrap_or_else(|| panic!("{what}: queue {queue} is gone:\n{log}"));
        lost += n - got.len() as u64;
    }
    assert_eq!(
        reported_lost(&log),
        lost,
        "{what}: every lost message reported, no more:\n{log}"
    );
    eprintln!("{what}: started, {lost} messages lost, all reported");
    if let Some(bound) = bound {
        assert!(
            lost <= bound,
            "{what}: {lost} lost, more than the damage hit:\n{log}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flipped_and_cut_data_files_lose_only_what_the_damage_hit() {
    let started = Instant::now();
    let fresh = common::scratch_dir("faults", "fresh");
    let s = start(&fresh);
    publish_all(s.port.expect("serves")).await;
    let log = stop(s);
    assert!(!log.contains("truncating a torn"), "{log}");
    // Started and stopped once more: the journal no longer covers the segment files.
    let settled = common::scratch_dir("faults", "settled");
    copy_tree(&fresh, &settled);
    let log = stop(start(&settled));
    assert!(
        !log.contains("WARN"),
        "a clean restart warns of nothing:\n{log}"
    );

    for (pristine, tag) in [(&fresh, "journalled"), (&settled, "settled")] {
        // Three flipped bytes in every data file at once.
        let mut rng = Rng(0x5EED_0043 ^ tag.len() as u64);
        trial(pristine, &format!("flip {tag}"), |dir| {
            let mut definitions = false;
            // A flipped byte costs one message at most, and only in a file that holds some.
            let mut bound = 0;
            for (kind, path) in data_files(dir) {
                let bytes = std::fs::read(&path).expect("read");
                if bytes.is_empty() {
                    continue;
                }
                let mut bytes = bytes;
                for _ in 0..3 {
                    let at = (rng.next() % bytes.len() as u64) as usize;
                    bytes[at] ^= 1 << (rng.next() % 8);
                }
                std::fs::write(&path, bytes).expect("write");
                definitions |= kind == "definitions";
                if matches!(kind, "shared" | "segment data" | "segment index") {
                    bound += 3;
                }
            }
            (definitions, Some(bound))
        })
        .await;
    }
    // Each kind of file cut short at a seeded offset.
    let mut rng = Rng(0xC0FF_EE43);
    let kinds: BTreeSet<&str> = data_files(&settled).iter().map(|(k, _)| *k).collect();
    for kind in kinds {
        trial(&settled, &format!("cut {kind}"), |dir| {
            for (k, path) in data_files(dir) {
                if k == kind {
                    let len = std::fs::metadata(&path).expect("meta").len();
                    let at = rng.next() % len.max(1);
                    std::fs::OpenOptions::new()
                        .write(true)
                        .open(&path)
                        .expect("open")
                        .set_len(at)
                        .expect("cut");
                }
            }
            (kind == "definitions", None)
        })
        .await;
    }
    let _ = std::fs::remove_dir_all(&fresh);
    let _ = std::fs::remove_dir_all(&settled);
    assert!(
        started.elapsed() < Duration::from_secs(50),
        "bounded: {:?}",
        started.elapsed()
    );
}

/// Issue 43 item 14: a queue drained and acked to empty, a clean stop, a start: nothing in
/// the log says torn (its write head's acked records are valid records, not a tail).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_drained_to_empty_restarts_with_nothing_torn() {
    let dir = common::scratch_dir("faults", "drained");
    let s = start(&dir);
    let port = s.port.expect("serves");
    publish_all(port).await;
    let served = drain(port).await;
    for ((queue, n, _), got) in QUEUES.iter().zip(&served) {
        assert_eq!(
            got.as_ref().map(BTreeSet::len),
            Some(*n as usize),
            "{queue}"
        );
    }
    stop(s);
    let log = stop(start(&dir));
    assert!(
        !log.contains("truncating a torn"),
        "a clean stop leaves nothing torn:\n{log}"
    );
    assert!(!log.contains("WARN"), "{log}");
    let _ = std::fs::remove_dir_all(&dir);
}
