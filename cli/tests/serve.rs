//! `warren serve --shards`: more than one shard runs only in memory for now, and says so.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

const BIN: &str = env!("CARGO_BIN_EXE_warren");

fn data_dir(tag: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("warren-serve-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

#[test]
fn shards_without_in_memory_are_refused_with_what_to_do() {
    let dir = data_dir("refused");
    let out = Command::new(BIN)
        .args([
            "serve",
            "--amqp",
            "127.0.0.1:0",
            "--mqtt",
            "none",
            "--shards",
            "2",
        ])
        .arg("--data-dir")
        .arg(&dir)
        .output()
        .expect("run warren serve");
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(out.status.code(), Some(2), "a configuration error");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--shards 2 needs --in-memory"),
        "says what to do: {err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_memory_shards_serve_amqp_clients() {
    let dir = data_dir("shards");
    let mut child = Command::new(BIN)
        .args(["serve", "--amqp", "127.0.0.1:0", "--mqtt", "none"])
        .args(["--in-memory", "--shards", "2", "--data-dir"])
        .arg(&dir)
        .env("RUST_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start warren serve");
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(rest) = line.split("listening on 127.0.0.1:").nth(1) {
                let port: String = rest.chars().take_while(char::is_ascii_digit).collect();
                let _ = tx.send(port.parse::<u16>().ok());
            }
        }
    });
    let port = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("warren serve logs its port within 20 s")
        .expect("a port");
    let uri = format!("amqp://guest:guest@127.0.0.1:{port}/%2f");
    let connect = || async {
        let c = tokio::time::timeout(
            Duration::from_secs(5),
            lapin::Connection::connect(&uri, lapin::ConnectionProperties::default()),
        )
        .await
        .expect("connect in time")
        .expect("connect");
        let ch = c.create_channel().await.expect("channel");
        (c, ch)
    };
    // Two connections, so two shards: the queue is declared on one, used from the other.
    let (_a, a) = connect().await;
    let (_z, z) = connect().await;
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
    let mut got = Vec::new();
    while let Some(m) = z
        .basic_get("q".into(), lapin::options::BasicGetOptions { no_ack: true })
        .await
        .expect("get")
    {
        got.push(String::from_utf8_lossy(&m.delivery.data).into_owned());
    }
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&dir);
    let want: Vec<String> = (0..10).map(|i| i.to_string()).collect();
    assert_eq!(got, want);
}
