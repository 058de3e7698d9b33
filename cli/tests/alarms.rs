//! `warren serve`'s resource alarms as a client sees them (connection.blocked /
//! unblocked over a socket, with lapin): the memory alarm counts what the process holds
//! with a data dir, and the free-disk limit blocks publishers.

use futures_lite::StreamExt;
use std::path::PathBuf;
use std::time::Duration;

mod common;

fn data_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("warren-alarms-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

async fn connect(port: u16) -> lapin::Connection {
    let uri = format!("amqp://guest:guest@127.0.0.1:{port}/%2f");
    tokio::time::timeout(
        Duration::from_secs(5),
        lapin::Connection::connect(&uri, lapin::ConnectionProperties::default()),
    )
    .await
    .expect("connect in time")
    .expect("connect")
}

/// Whether the broker sends `connection.blocked` within `within` once `conn` publishes
/// (as RabbitMQ, only a connection that publishes is blocked and told).
async fn blocked_within(conn: &lapin::Connection, within: Duration) -> bool {
    let mut events = conn.events_listener();
    let ch = common::bounded_as("channel.open-ok", conn.create_channel())
        .await
        .expect("channel");
    common::bounded_as(
        "basic.publish sent (held while the connection is blocked)",
        ch.basic_publish(
            "".into(),
            "nowhere".into(),
            Default::default(),
            b"one",
            Default::default(),
        ),
    )
    .await
    .expect("publish");
    if conn.status().blocked() {
        return true;
    }
    tokio::time::timeout(within, async {
        while let Some(event) = events.next().await {
            if matches!(event, lapin::Event::ConnectionBlocked(_)) {
                return;
            }
        }
        std::future::pending::<()>().await
    })
    .await
    .is_ok()
}

/// With a data dir the queues keep few of their messages in memory, yet the process holds
/// far more (RSS was 5-6x the watermark with publishers never blocked): the alarm compares
/// the watermark with the process's resident memory too. A watermark below what an idle
/// broker already holds blocks a client at once, with no message queued.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_data_dir_the_memory_alarm_counts_the_process_resident_memory() {
    let dir = data_dir("rss");
    let mut served = common::serve(
        &dir,
        false,
        &["--memory-high-watermark", "1MiB", "--disk-free-limit", "0"],
    );
    let conn = connect(served.amqp).await;
    let blocked = blocked_within(&conn, Duration::from_secs(5)).await;
    let _ = served.child.kill();
    let _ = served.child.wait();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(blocked, "an RSS above the watermark blocks publishers");
}

/// A generous watermark leaves the same broker unblocked (the test above is not a broker
/// that blocks everyone).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn below_the_watermark_and_with_free_disk_nobody_is_blocked() {
    let dir = data_dir("fine");
    let mut served = common::serve(&dir, false, &["--memory-high-watermark", "4GiB"]);
    let conn = connect(served.amqp).await;
    let blocked = blocked_within(&conn, Duration::from_secs(3)).await;
    let _ = served.child.kill();
    let _ = served.child.wait();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(!blocked, "nothing is short: nobody is blocked");
}

/// RabbitMQ's disk_free_limit: a limit above the free space of the data dir's disk blocks
/// publishers (no need to fill a disk: ask for more than any has).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_free_disk_limit_above_the_free_space_blocks_publishers() {
    let dir = data_dir("disk");
    let mut served = common::serve(
        &dir,
        false,
        &[
            "--memory-high-watermark",
            "4GiB",
            "--disk-free-limit",
            "1000000GB",
        ],
    );
    let conn = connect(served.amqp).await;
    let blocked = blocked_within(&conn, Duration::from_secs(5)).await;
    let _ = served.child.kill();
    let _ = served.child.wait();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(blocked, "free disk below the limit blocks publishers");
}
