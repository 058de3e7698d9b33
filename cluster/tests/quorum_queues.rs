//! Quorum queues replicated over three `warren serve` nodes in network namespaces
//! (`scripts/cluster.sh`, docs/cluster.md "Quorum queues"), with lapin on the host.
//!
//! A queue declared `x-queue-type: quorum` is a Raft group over the three nodes; its
//! leader's node serves it and confirms a publish once a majority has it on disk. The test
//! publishes with confirms, acks some, SIGKILLs the leader, and consumes on the new leader:
//! every confirmed, unacked message is there (flagged redelivered), none of the acked ones.
//! Then, with the old leader still down, it publishes more, restarts the old leader, kills
//! the second leader: the last majority is the restarted node and the third, so the
//! restarted node must have caught up for those messages to be served. Prints throughput
//! (1 publisher, 1 consumer, 1 KB, confirms) and the failover times.
//!
//! Needs root and `ip netns`, and the broker binary (`cargo build -p warren-cli`, or
//! WARREN_BIN); skipped otherwise unless WARREN_CLUSTER_REQUIRE=1.

mod common;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use common::{Cluster, Node, bounded, parse};
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicGetOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};

const BRIDGE: &str = "wbq0";
const NET: &str = "10.81.0";
const QUEUE: &str = "qq";

/// SIGKILLs node `name` (`n1`..) itself, timed from here (`cluster.sh kill` takes over a
/// second on a loaded machine, which would count in the failover time); `cluster.sh kill`
/// cleans up afterwards.
fn kill9(cluster: &Cluster, name: &str) -> Instant {
    let pid_file = cluster.state.path().join("cluster").join(name).join("pid");
    let pid = std::fs::read_to_string(&pid_file).expect("node's pid file");
    let at = Instant::now();
    let ok = std::process::Command::new("kill")
        .args(["-9", pid.trim()])
        .status()
        .expect("kill")
        .success();
    assert!(ok, "kill -9 {name}");
    let _ = cluster;
    at
}

async fn channel(node: &Node) -> Option<(Connection, Channel)> {
    let uri = format!("amqp://warren:warren@{}/%2f", node.amqp);
    let conn = tokio::time::timeout(
        Duration::from_secs(5),
        Connection::connect(&uri, ConnectionProperties::default()),
    )
    .await
    .ok()?
    .ok()?;
    let ch = common::answered("channel.open-ok", conn.create_channel())
        .await
        .ok()?;
    common::answered(
        "confirm.select-ok",
        ch.confirm_select(ConfirmSelectOptions::default()),
    )
    .await
    .ok()?;
    Some((conn, ch))
}

fn quorum_args() -> FieldTable {
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".into()),
    );
    args
}

/// Publishes `body` with a confirm: whether it was acked (a node that does not lead the
/// queue's group nacks).
async fn publish(ch: &Channel, body: &[u8]) -> bool {
    let Ok(Ok(confirm)) = tokio::time::timeout(
        Duration::from_secs(5),
        ch.basic_publish(
            "".into(),
            QUEUE.into(),
            BasicPublishOptions::default(),
            body,
            BasicProperties::default().with_delivery_mode(2),
        ),
    )
    .await
    else {
        return false;
    };
    matches!(
        tokio::time::timeout(Duration::from_secs(5), confirm).await,
        Ok(Ok(c)) if c.is_ack()
    )
}

/// The queue's group leader as node `i` (index into `nodes`) reports it (`warren ctl
/// list-queues`), as an index into `nodes`.
fn reported_leader(cluster: &Cluster, i: usize) -> Option<usize> {
    let out = std::process::Command::new(&cluster.bin)
        .args(["ctl", "--format", "json", "--data-dir"])
        .arg(
            cluster
                .state
                .path()
                .join(format!("cluster/n{}/data", i + 1)),
        )
        .arg("list-queues")
        .output()
        .ok()?;
    let qs: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
    let q = qs.as_array()?.iter().find(|q| q["name"] == QUEUE)?;
    let l = q["leader"].as_u64()?;
    usize::try_from(l).ok()?.checked_sub(1)
}

/// Polls nodes `among` until they name a leader of the queue's group among them and it
/// confirms a probe publish: its index, its channel, and how long that took. The probes
/// that were confirmed are added to `confirmed`.
async fn find_leader(
    cluster: &Cluster,
    nodes: &[Node],
    among: &[usize],
    confirmed: &mut BTreeSet<String>,
    probe: &mut u32,
) -> (usize, Connection, Channel, Duration) {
    let start = Instant::now();
    loop {
        for &i in among {
            let Some(l) = reported_leader(cluster, i).filter(|l| among.contains(l)) else {
                continue;
            };
            let Some((conn, ch)) = channel(&nodes[l]).await else {
                continue;
            };
            *probe += 1;
            let body = format!("probe-{probe}");
            if publish(&ch, body.as_bytes()).await {
                confirmed.insert(body);
                return (l, conn, ch, start.elapsed());
            }
            let _ = common::answered("close-ok", conn.close(200, "not the leader".into())).await;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "no node among {among:?} serves the quorum queue"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The last log index of the queue's group on node `i` (index into `nodes`), from its
/// `warren ctl cluster-status`.
fn group_last_index(cluster: &Cluster, i: usize) -> Option<u64> {
    let status =
        common::cluster_status(&cluster.state.path().join("cluster"), &cluster.bin, i + 1)?;
    status["groups"]
        .as_array()?
        .iter()
        .find(|g| g["queue"] == QUEUE)?["status"]["last_log_index"]
        .as_u64()
}

/// Takes every message of the queue on `ch` (acking each), as (body, redelivered).
async fn drain(ch: &Channel) -> Vec<(String, bool)> {
    let mut got = Vec::new();
    while let Some(m) = bounded(
        "basic.get",
        ch.basic_get(QUEUE.into(), BasicGetOptions { no_ack: false }),
    )
    .await
    .expect("basic.get")
    {
        got.push((
            String::from_utf8_lossy(&m.delivery.data).into_owned(),
            m.delivery.redelivered,
        ));
        bounded("ack", m.delivery.ack(BasicAckOptions::default()))
            .await
            .expect("ack");
        assert!(got.len() < 100_000, "more messages than were published");
    }
    got
}

/// 1 publisher and 1 consumer on `node`, 1 KB messages, confirms (windows of 100) for
/// `secs`: messages per second confirmed, and consumed, and the number confirmed.
async fn throughput(node: &Node, secs: u64) -> (f64, f64, u64) {
    let (_pc, pub_ch) = channel(node).await.expect("publisher");
    let (_cc, con_ch) = channel(node).await.expect("consumer");
    common::answered(
        "basic.qos-ok",
        con_ch.basic_qos(200, BasicQosOptions::default()),
    )
    .await
    .expect("qos");
    let mut consumer = common::answered(
        "basic.consume answer",
        con_ch.basic_consume(
            QUEUE.into(),
            "bench".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        ),
    )
    .await
    .expect("consume");
    let consumed = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let counter = consumed.clone();
    let task = tokio::spawn(async move {
        use futures_lite::StreamExt;
        while let Some(Ok(d)) = consumer.next().await {
            counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if d.ack(BasicAckOptions::default()).await.is_err() {
                return;
            }
        }
    });
    let body = vec![b'x'; 1024];
    let start = Instant::now();
    let mut confirmed = 0u64;
    while start.elapsed() < Duration::from_secs(secs) {
        let mut window = Vec::with_capacity(100);
        for _ in 0..100 {
            window.push(
                pub_ch
                    .basic_publish(
                        "".into(),
                        QUEUE.into(),
                        BasicPublishOptions::default(),
                        &body,
                        BasicProperties::default().with_delivery_mode(2),
                    )
                    .await
                    .expect("publish"),
            );
        }
        for c in window {
            if bounded("confirm", c).await.expect("confirm").is_ack() {
                confirmed += 1;
            }
        }
    }
    let elapsed = start.elapsed().as_secs_f64();
    // Let the consumer finish what was confirmed (bounded).
    let deadline = Instant::now() + Duration::from_secs(10);
    while consumed.load(std::sync::atomic::Ordering::Relaxed) < confirmed
        && Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let all = start.elapsed().as_secs_f64();
    let got = consumed.load(std::sync::atomic::Ordering::Relaxed);
    task.abort();
    assert_eq!(got, confirmed, "every confirmed message consumed");
    (confirmed as f64 / elapsed, got as f64 / all, confirmed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn confirmed_messages_survive_leader_kill_and_a_member_catches_up() {
    let Some(cluster) = Cluster::prepare("quorum queue replication test", BRIDGE, NET) else {
        return;
    };
    let nodes = parse(&cluster.run(&["up", "3"]));
    assert_eq!(nodes.len(), 3);
    {
        let (_c, ch) = channel(&nodes[0]).await.expect("connect n1");
        let durable = QueueDeclareOptions {
            durable: true,
            ..Default::default()
        };
        bounded(
            "declare",
            ch.queue_declare(QUEUE.into(), durable, quorum_args()),
        )
        .await
        .expect("declare a quorum queue");
    }
    let mut confirmed = BTreeSet::new();
    let mut probe = 0;
    let (leader, _conn, ch, took) =
        find_leader(&cluster, &nodes, &[0, 1, 2], &mut confirmed, &mut probe).await;
    eprintln!(
        "quorum queue served by {} {took:?} after its declare",
        nodes[leader].name
    );
    // A follower takes publishes too: it forwards them to the leader, and confirms once the
    // leader committed them.
    let follower = (leader + 1) % 3;
    {
        let (_fc, fch) = channel(&nodes[follower])
            .await
            .expect("connect to a follower");
        for i in 0..20 {
            let body = format!("f{i}");
            assert!(
                publish(&fch, body.as_bytes()).await,
                "{body} published on follower {} confirmed",
                nodes[follower].name
            );
            confirmed.insert(body);
        }
    }
    // Confirmed publishes, then 50 of them acked (those must not come back).
    for i in 0..300 {
        let body = format!("m{i}");
        assert!(publish(&ch, body.as_bytes()).await, "{body} confirmed");
        confirmed.insert(body);
    }
    let mut acked = BTreeSet::new();
    for _ in 0..50 {
        let m = bounded(
            "get",
            ch.basic_get(QUEUE.into(), BasicGetOptions { no_ack: false }),
        )
        .await
        .expect("get")
        .expect("a message");
        acked.insert(String::from_utf8_lossy(&m.delivery.data).into_owned());
        bounded("ack", m.delivery.ack(BasicAckOptions::default()))
            .await
            .expect("ack");
    }
    // Ten more delivered, not acked when the leader dies: they come back.
    for _ in 0..10 {
        bounded(
            "get",
            ch.basic_get(QUEUE.into(), BasicGetOptions { no_ack: false }),
        )
        .await
        .expect("get")
        .expect("a message");
    }
    // An ack is replicated with the next sync: this confirmed publish carries them.
    probe += 1;
    let body = format!("probe-{probe}");
    assert!(publish(&ch, body.as_bytes()).await);
    confirmed.insert(body);

    // kill -9 the leader; a survivor serves the queue.
    let killed = leader;
    let at = kill9(&cluster, &nodes[killed].name);
    let survivors: Vec<usize> = (0..3).filter(|i| *i != killed).collect();
    let (leader2, _conn2, ch2, _) =
        find_leader(&cluster, &nodes, &survivors, &mut confirmed, &mut probe).await;
    eprintln!(
        "leader {} killed: {} confirms publishes {:?} after the kill",
        nodes[killed].name,
        nodes[leader2].name,
        at.elapsed()
    );
    cluster.run(&["kill", &nodes[killed].name]);
    let got = drain(&ch2).await;
    let bodies: BTreeSet<String> = got.iter().map(|(b, _)| b.clone()).collect();
    let want: BTreeSet<String> = confirmed.difference(&acked).cloned().collect();
    let missing: Vec<_> = want.difference(&bodies).collect();
    assert!(
        missing.is_empty(),
        "confirmed, unacked messages lost: {missing:?}"
    );
    let resurrected: Vec<_> = bodies.intersection(&acked).collect();
    assert!(
        resurrected.is_empty(),
        "acked messages came back: {resurrected:?}"
    );
    assert!(
        got.iter()
            .filter(|(b, _)| b.starts_with('m') || b.starts_with('f'))
            .all(|(_, redelivered)| *redelivered),
        "messages taken over from the old leader are flagged redelivered"
    );
    assert_eq!(got.len(), bodies.len(), "no message twice");

    // More while the old leader is down; then it comes back and must catch up: the second
    // leader dies, leaving the restarted node and the third as the only majority.
    let mut later = BTreeSet::new();
    for i in 0..100 {
        let body = format!("n{i}");
        assert!(publish(&ch2, body.as_bytes()).await, "{body} confirmed");
        later.insert(body);
    }
    let line = cluster.run(&["start", &nodes[killed].name]);
    assert!(line.contains("amqp="), "{line}");
    // Let the leader reach it (the transport's reconnect backs off up to 2 s).
    tokio::time::sleep(Duration::from_secs(3)).await;
    // Its return may have moved the leadership (an election); whoever leads now dies. If
    // the returned node leads, it was elected, so it had every committed entry; else it is
    // half of the last majority and must have caught up for a commit to happen.
    let mut probes = BTreeSet::new();
    let (leader2, _c, _ch, _) =
        find_leader(&cluster, &nodes, &[0, 1, 2], &mut probes, &mut probe).await;
    let at = kill9(&cluster, &nodes[leader2].name);
    let last: Vec<usize> = (0..3).filter(|i| *i != leader2).collect();
    let (leader3, _conn3, ch3, _) =
        find_leader(&cluster, &nodes, &last, &mut probes, &mut probe).await;
    eprintln!(
        "leader {} killed: {} confirms publishes {:?} after the kill ({} had been down)",
        nodes[leader2].name,
        nodes[leader3].name,
        at.elapsed(),
        nodes[killed].name
    );
    cluster.run(&["kill", &nodes[leader2].name]);
    let got = drain(&ch3).await;
    let bodies: BTreeSet<String> = got.iter().map(|(b, _)| b.clone()).collect();
    let missing: Vec<_> = later
        .union(&probes)
        .filter(|b| !bodies.contains(*b))
        .collect();
    assert!(
        missing.is_empty(),
        "messages confirmed while {} was down are missing after it caught up: {missing:?}",
        nodes[killed].name
    );
    assert!(
        bodies.iter().all(|b| !want.contains(b)),
        "messages drained before came back"
    );

    // Throughput on the last majority (2 of 3 members up: every commit needs both).
    let (published, consumed, _) = throughput(&nodes[leader3], 3).await;
    eprintln!(
        "quorum queue, 1 publisher 1 consumer 1 KB confirms (2 of 3 members up): {published:.0} msg/s confirmed, {consumed:.0} msg/s consumed"
    );
    cluster.run(&["start", &nodes[leader2].name]);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let before = group_last_index(&cluster, leader3).expect("the leader's group status");
    let (published, consumed, n) = throughput(&nodes[leader3], 3).await;
    let entries = group_last_index(&cluster, leader3).expect("the leader's group status") - before;
    eprintln!(
        "quorum queue, 1 publisher 1 consumer 1 KB confirms (3 members): {published:.0} msg/s confirmed, {consumed:.0} msg/s consumed; {n} messages (and their acks) in {entries} log entries"
    );
    // Group commit: the publishes (windows of 100 awaiting confirms) and the acks that
    // arrive together share log entries (a broker sync each, and what is proposed ahead of
    // the next one), not an entry (a leader fsync and a follower fsync) per write.
    assert!(
        entries * 4 <= n,
        "{n} messages and their acks took {entries} log entries"
    );
}
