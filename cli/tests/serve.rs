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
    let ch = c.create_channel().await.expect("channel");
    (c, ch)
}

async fn drain(ch: &lapin::Channel, queue: &str) -> Vec<String> {
    let mut got = Vec::new();
    while let Some(m) = ch
        .basic_get(
            queue.into(),
            lapin::options::BasicGetOptions { no_ack: true },
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
            a.queue_declare(q.into(), args, Default::default())
                .await
                .expect("declare");
        }
        for ch in [&a, &z] {
            ch.confirm_select(Default::default())
                .await
                .expect("confirms");
        }
        for i in 0..60 {
            let ch = if i % 2 == 0 { &a } else { &z };
            let q = QUEUES[i % QUEUES.len()];
            ch.basic_publish(
                "".into(),
                q.into(),
                Default::default(),
                i.to_string().as_bytes(),
                lapin::BasicProperties::default().with_delivery_mode(2),
            )
            .await
            .expect("publish");
        }
        for ch in [&a, &z] {
            assert!(ch.wait_for_confirms().await.expect("confirmed").is_empty());
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
    a.queue_declare("q".into(), Default::default(), Default::default())
        .await
        .expect("declare");
    z.confirm_select(Default::default())
        .await
        .expect("confirms");
    for i in 0..10 {
        z.basic_publish(
            "".into(),
            "q".into(),
            Default::default(),
            i.to_string().as_bytes(),
            Default::default(),
        )
        .await
        .expect("publish");
    }
    assert!(z.wait_for_confirms().await.expect("confirmed").is_empty());
    let got = drain(&z, "q").await;
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&dir);
    let want: Vec<String> = (0..10).map(|i| i.to_string()).collect();
    assert_eq!(got, want);
}
