//! `warren serve --shards N`: queues spread over N shards, each with its own message log;
//! what was confirmed survives a `kill -9`, and the data directory keeps its shard count.

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::Duration;

mod common;

use common::BIN;

fn data_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("warren-serve-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// Starts `warren serve` (AMQP only) with `args`; returns it and its AMQP port.
fn serve(dir: &Path, args: &[&str]) -> (Child, u16) {
    let served = common::serve(dir, false, args);
    (served.child, served.amqp)
}

async fn channel(port: u16) -> (lapin::Connection, lapin::Channel) {
    let uri = format!("amqp://guest:guest@127.0.0.1:{port}/%2f");
    let c = tokio::time::timeout(
        Duration::from_secs(5),
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

async fn drain(ch: &lapin::Channel, queue: &str) -> Vec<String> {
    let mut got = Vec::new();
    while let Some(m) = common::bounded_as(
        "basic.get answer",
        ch.basic_get(
            queue.into(),
            lapin::options::BasicGetOptions { no_ack: true },
        ),
    )
    .await
    .expect("get")
    {
        got.push(String::from_utf8_lossy(&m.delivery.data).into_owned());
    }
    got
}

const QUEUES: [&str; 6] = ["a", "b", "c", "d", "e", "f"];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sharded_durable_queues_survive_kill_9_and_keep_their_shard_count() {
    let dir = data_dir("durable");
    let (mut child, port) = serve(&dir, &["--shards", "2"]);
    {
        // Publishers on two connections (two shards), six durable queues spread by name.
        let (_a, a) = channel(port).await;
        let (_z, z) = channel(port).await;
        for q in QUEUES {
            let args = lapin::options::QueueDeclareOptions {
                durable: true,
                ..Default::default()
            };
            common::bounded_as(
                "queue.declare answer",
                a.queue_declare(q.into(), args, Default::default()),
            )
            .await
            .expect("declare");
        }
        for ch in [&a, &z] {
            common::bounded_as("confirm.select-ok", ch.confirm_select(Default::default()))
                .await
                .expect("confirms");
        }
        for i in 0..60 {
            let ch = if i % 2 == 0 { &a } else { &z };
            let q = QUEUES[i % QUEUES.len()];
            common::bounded_as(
                "basic.publish sent (held while the connection is blocked)",
                ch.basic_publish(
                    "".into(),
                    q.into(),
                    Default::default(),
                    i.to_string().as_bytes(),
                    lapin::BasicProperties::default().with_delivery_mode(2),
                ),
            )
            .await
            .expect("publish");
        }
        for ch in [&a, &z] {
            assert!(
                common::bounded_as("publisher confirms", ch.wait_for_confirms())
                    .await
                    .expect("confirmed")
                    .is_empty()
            );
        }
    }
    // Every message is confirmed: none may be lost to a kill -9 now.
    let _ = child.kill();
    let _ = child.wait();
    let queue_dirs = |d: PathBuf| std::fs::read_dir(d.join("queues")).map_or(0, |r| r.count());
    assert!(
        queue_dirs(dir.join("shards").join("1")) > 0 && queue_dirs(dir.clone()) > 0,
        "the queues spread over both shards' message logs"
    );
    let refused = Command::new(BIN)
        .args([
            "serve",
            "--amqp",
            "127.0.0.1:0",
            "--mqtt",
            "none",
            "--shards",
            "3",
            "--management",
            "none",
            "--prometheus",
            "none",
            "--stream",
            "none",
        ])
        .arg("--data-dir")
        .arg(&dir)
        .output()
        .expect("run warren serve");
    assert_eq!(refused.status.code(), Some(2), "a configuration error");
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(err.contains("pass --shards 2"), "says what to do: {err}");
    let (mut child, port) = serve(&dir, &["--shards", "2"]);
    let (_c, ch) = channel(port).await;
    for (n, q) in QUEUES.iter().enumerate() {
        let want: Vec<String> = (0..60)
            .filter(|i| i % QUEUES.len() == n)
            .map(|i| i.to_string())
            .collect();
        assert_eq!(drain(&ch, q).await, want, "queue {q} after the restart");
    }
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_memory_shards_serve_amqp_clients() {
    let dir = data_dir("memory");
    let (mut child, port) = serve(&dir, &["--in-memory", "--shards", "2"]);
    // Two connections, so two shards: the queue is declared on one, used from the other.
    let (_a, a) = channel(port).await;
    let (_z, z) = channel(port).await;
    common::bounded_as(
        "queue.declare answer",
        a.queue_declare("q".into(), Default::default(), Default::default()),
    )
    .await
    .expect("declare");
    common::bounded_as("confirm.select-ok", z.confirm_select(Default::default()))
        .await
        .expect("confirms");
    for i in 0..10 {
        common::bounded_as(
            "basic.publish sent (held while the connection is blocked)",
            z.basic_publish(
                "".into(),
                "q".into(),
                Default::default(),
                i.to_string().as_bytes(),
                Default::default(),
            ),
        )
        .await
        .expect("publish");
    }
    assert!(
        common::bounded_as("publisher confirms", z.wait_for_confirms())
            .await
            .expect("confirmed")
            .is_empty()
    );
    let got = drain(&z, "q").await;
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&dir);
    let want: Vec<String> = (0..10).map(|i| i.to_string()).collect();
    assert_eq!(got, want);
}

/// The name a server-named exclusive queue and a generated consumer tag get from a fresh
/// connection to the broker on `port`.
async fn generated_names(port: u16) -> (String, String) {
    let (_c, ch) = channel(port).await;
    let q = common::bounded_as(
        "queue.declare answer",
        ch.queue_declare(
            "".into(),
            lapin::options::QueueDeclareOptions {
                exclusive: true,
                ..Default::default()
            },
            Default::default(),
        ),
    )
    .await
    .expect("declare");
    let consumer = common::bounded_as(
        "basic.consume answer",
        ch.basic_consume(
            q.name().clone(),
            "".into(),
            Default::default(),
            Default::default(),
        ),
    )
    .await
    .expect("consume");
    (q.name().to_string(), consumer.tag().to_string())
}

/// Each start seeds the name generator from the OS: two fresh brokers, and one broker
/// before and after a restart, hand out different queue names and consumer tags (with a
/// fixed seed they were the same sequence every time: predictable reply-to addresses, and
/// a restored `amq.gen-` queue's name drawn again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_start_draws_different_server_generated_names() {
    let (dir_a, dir_b) = (data_dir("names-a"), data_dir("names-b"));
    let (mut a, port_a) = serve(&dir_a, &[]);
    let (mut b, port_b) = serve(&dir_b, &[]);
    let from_a = generated_names(port_a).await;
    let from_b = generated_names(port_b).await;
    // A durable server-named queue with a confirmed persistent message, to restore.
    let stored = {
        let (_c, ch) = channel(port_a).await;
        let q = common::bounded_as(
            "queue.declare answer",
            ch.queue_declare(
                "".into(),
                lapin::options::QueueDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                Default::default(),
            ),
        )
        .await
        .expect("declare durable");
        common::bounded_as("confirm.select-ok", ch.confirm_select(Default::default()))
            .await
            .expect("confirms");
        common::bounded_as(
            "publisher confirm",
            common::bounded_as(
                "basic.publish sent (held while the connection is blocked)",
                ch.basic_publish(
                    "".into(),
                    q.name().clone(),
                    Default::default(),
                    b"kept",
                    lapin::BasicProperties::default().with_delivery_mode(2),
                ),
            )
            .await
            .expect("publish"),
        )
        .await
        .expect("confirmed");
        q.name().to_string()
    };
    let _ = b.kill();
    let _ = b.wait();
    a.kill().expect("stop a");
    let _ = a.wait();
    let (mut again, port) = serve(&dir_a, &[]);
    let after_restart = generated_names(port).await;
    let restored = {
        let (_c, ch) = channel(port).await;
        drain(&ch, &stored).await
    };
    let _ = again.kill();
    let _ = again.wait();
    for dir in [dir_a, dir_b] {
        let _ = std::fs::remove_dir_all(dir);
    }
    assert!(from_a.0.starts_with("amq.gen-") && from_a.1.starts_with("amq.ctag-"));
    assert_ne!(from_a.0, from_b.0, "two fresh brokers, one queue name");
    assert_ne!(from_a.1, from_b.1, "two fresh brokers, one consumer tag");
    assert_ne!(from_a.0, after_restart.0, "the same name after a restart");
    assert_ne!(
        stored, after_restart.0,
        "a restored queue's name drawn again"
    );
    assert_eq!(
        restored,
        ["kept"],
        "the restored server-named queue keeps its message"
    );
}
