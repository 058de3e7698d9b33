//! A dynamic shovel runs on one node of a cluster: the metadata group's leader (issue 38,
//! docs/bridges.md "Clusters"). Its parameter is replicated to every node; before, every node
//! ran it, so each message was moved once per node.
//!
//! Over `scripts/cluster.sh` with lapin: 3 nodes, two quorum queues, a dynamic shovel between
//! them set once; confirmed messages each arrive once, and only the leader lists the shovel.
//! Then the leader is killed (-9): the shovel resumes on the new leader, and every confirmed
//! message arrives at least once, none invented.
//!
//! Needs root and `ip netns`, and the broker binary (`cargo build -p warren-cli`, or
//! WARREN_BIN). Without them the test says why and passes, unless WARREN_CLUSTER_REQUIRE=1
//! (CI sets it) turns the skip into a failure.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use common::quorum::{confirm_channel, declare};
use common::{Cluster, Node, agreed_leader, amqp_channel, bounded, parse};
use futures_lite::StreamExt;
use lapin::BasicProperties;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ExchangeDeclareOptions, QueueBindOptions,
};
use lapin::types::FieldTable;

/// Its own bridge and subnet.
const BRIDGE: &str = "wbp0";
const NET: &str = "10.97.0";

const SRC: &str = "sp-src";
const DEST: &str = "sp-dest";
const SHOVEL: &str = "sp";
/// A second shovel, from an exchange of one named node (as from a remote broker): each node
/// running it binds a queue of its own there, so each moves every message (the
/// queue-sourced one's copies compete for the messages: once each, on any number of nodes).
const XSHOVEL: &str = "sx";
const XDEST: &str = "sx-dest";
const X: &str = "sp-x";
/// A third, from the local broker's exchange: its queue (server-named, exclusive) and its
/// binding stay on the node that declared it (docs/cluster.md, "What stays local"), so it
/// runs on every node, each moving what was published there.
const LSHOVEL: &str = "sl";
const LDEST: &str = "sl-dest";
/// Messages per round.
const N: usize = 200;

/// `curl` on a node's HTTP API as warren/warren: the body, or `None` on failure.
fn http(node: &Node, method: &str, path: &str, body: Option<&str>) -> Option<String> {
    let mut c = std::process::Command::new("curl");
    c.args(["-sf", "-m", "10", "-u", "warren:warren", "-X", method]);
    if let Some(b) = body {
        c.args(["-H", "content-type: application/json", "-d", b]);
    }
    let out = c
        .arg(format!("http://{}{path}", node.http))
        .output()
        .expect("run curl");
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The shovels `GET /api/shovels` on `node` lists: (name, state).
fn listed(node: &Node) -> Vec<(String, String)> {
    let body = http(node, "GET", "/api/shovels", None).unwrap_or_default();
    let rows: Vec<serde_json::Value> = serde_json::from_str(&body).unwrap_or_default();
    rows.iter()
        .map(|r| {
            let s = |k: &str| r[k].as_str().unwrap_or_default().to_string();
            (s("name"), s("state"))
        })
        .collect()
}

/// Publishes `bodies` to exchange `x` (routing key SRC) through `node`, each until confirmed (a new connection after
/// a failure), within `bound`.
async fn publish_all(node: &Node, x: &str, bodies: &[String], bound: Duration) {
    let start = Instant::now();
    let mut conn = None;
    for b in bodies {
        loop {
            assert!(start.elapsed() < bound, "{b} not confirmed in {bound:?}");
            if conn.is_none() {
                conn = confirm_channel(node).await.ok();
            }
            let Some((_, ch)) = &conn else {
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            };
            let sent = ch.basic_publish(
                x.into(),
                SRC.into(),
                BasicPublishOptions::default(),
                b.as_bytes(),
                BasicProperties::default().with_delivery_mode(2),
            );
            let confirmed = async {
                let c = sent.await.map_err(|e| e.to_string())?;
                Ok::<_, String>(c.await.map_err(|e| e.to_string())?.is_ack())
            };
            match tokio::time::timeout(Duration::from_secs(10), confirmed).await {
                Ok(Ok(true)) => break,
                _ => {
                    conn = None;
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
    }
}

/// Consumes DEST through `node` (acking), counting each body, until every one of `want` was
/// seen and then `quiet` passed with nothing new; fails past `bound`.
async fn drain(
    node: &Node,
    queue: &str,
    want: &BTreeSet<String>,
    seen: &mut BTreeMap<String, usize>,
    quiet: Duration,
    bound: Duration,
) {
    let (_conn, ch) = amqp_channel(node).await;
    bounded("qos", ch.basic_qos(50, BasicQosOptions::default()))
        .await
        .expect("qos");
    let mut consumer = bounded(
        "consume",
        ch.basic_consume(
            queue.into(),
            "sp-check".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        ),
    )
    .await
    .expect("consume");
    let start = Instant::now();
    let mut done_at: Option<Instant> = None;
    loop {
        if want.iter().all(|w| seen.contains_key(w)) {
            let at = *done_at.get_or_insert_with(Instant::now);
            if at.elapsed() >= quiet {
                return;
            }
        }
        let missing = want.iter().filter(|w| !seen.contains_key(*w)).count();
        assert!(
            start.elapsed() < bound,
            "{missing} confirmed messages never arrived at {queue} in {bound:?}"
        );
        match tokio::time::timeout(Duration::from_millis(300), consumer.next()).await {
            Ok(Some(Ok(d))) => {
                let body = String::from_utf8_lossy(&d.data).into_owned();
                *seen.entry(body).or_default() += 1;
                d.ack(BasicAckOptions::default()).await.expect("ack");
            }
            Ok(Some(Err(e))) => panic!("consumer on {}: {e}", node.name),
            Ok(None) => panic!("consumer on {} cancelled", node.name),
            Err(_) => {}
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dynamic_shovel_runs_on_the_metadata_leader_only() {
    let Some(cluster) = Cluster::prepare("cluster shovel placement test", BRIDGE, NET) else {
        return;
    };
    let t0 = Instant::now();
    let state = cluster.state.path().join("cluster");
    let nodes = parse(&cluster.run(&["up", "3"]));
    assert_eq!(nodes.len(), 3);
    let (leader, _) = agreed_leader(&state, &cluster.bin, &[1, 2, 3]);
    let leader = leader as usize - 1;
    let other = (leader + 1) % 3;
    declare(&nodes[other], SRC, true).await;
    declare(&nodes[other], DEST, true).await;
    let value = serde_json::json!({"value": {
        // The local broker (no host) as the test user: `guest` logs in from loopback only,
        // and a node's listener is on its own address.
        "src-uri": "amqp://warren:warren@", "src-queue": SRC,
        "dest-uri": "amqp://warren:warren@", "dest-queue": DEST,
        "src-queue-args": {"x-queue-type": "quorum"},
        "dest-queue-args": {"x-queue-type": "quorum"},
        "ack-mode": "on-confirm",
    }});
    // The exchange the second shovel takes from, bound to SRC too.
    declare(&nodes[other], XDEST, true).await;
    declare(&nodes[other], LDEST, true).await;
    {
        let (_c, ch) = amqp_channel(&nodes[other]).await;
        let durable = ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        };
        let kind = lapin::ExchangeKind::Direct;
        let declared = ch.exchange_declare(X.into(), kind, durable, FieldTable::default());
        bounded("exchange.declare", declared)
            .await
            .expect("exchange.declare");
        let opts = QueueBindOptions::default();
        let bind = ch.queue_bind(
            SRC.into(),
            X.into(),
            SRC.into(),
            opts,
            FieldTable::default(),
        );
        bounded("queue.bind", bind).await.expect("queue.bind");
    }
    let src_uri = format!("amqp://warren:warren@{}", nodes[other].amqp);
    let xvalue = serde_json::json!({"value": {
        // One node named, as a remote broker would be: every node running the shovel would
        // bind a queue of its own there.
        "src-uri": src_uri, "src-exchange": X, "src-exchange-key": SRC,
        "dest-uri": "amqp://warren:warren@", "dest-queue": XDEST,
        "dest-queue-args": {"x-queue-type": "quorum"},
    }});
    let lvalue = serde_json::json!({"value": {
        "src-uri": "amqp://warren:warren@", "src-exchange": X, "src-exchange-key": SRC,
        "dest-uri": "amqp://warren:warren@", "dest-queue": LDEST,
        "dest-queue-args": {"x-queue-type": "quorum"},
    }});
    for (name, v) in [(SHOVEL, &value), (XSHOVEL, &xvalue), (LSHOVEL, &lvalue)] {
        let path = format!("/api/parameters/shovel/%2f/{name}");
        http(&nodes[other], "PUT", &path, Some(&v.to_string()))
            .unwrap_or_else(|| panic!("PUT {path} on {}", nodes[other].name));
    }
    // Both running (the exchange's shovel has bound its queue) before the publishes.
    let start = Instant::now();
    // (Which node lists which is checked after round 1.)
    let running = |n: &Node, names: &[&str]| {
        let rows = listed(n);
        names
            .iter()
            .all(|x| rows.iter().any(|r| r.0 == *x && r.1 == "running"))
    };
    while !(running(&nodes[leader], &[SHOVEL, XSHOVEL, LSHOVEL])
        && running(&nodes[other], &[LSHOVEL]))
    {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "the shovels never ran"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;

    // Round 1: each confirmed message arrives once, through either shovel.
    let first: Vec<String> = (0..N).map(|k| format!("a-{k}")).collect();
    publish_all(&nodes[other], X, &first, Duration::from_secs(20)).await;
    let want: BTreeSet<String> = first.iter().cloned().collect();
    let (quiet, bound) = (Duration::from_secs(3), Duration::from_secs(20));
    for queue in [DEST, XDEST, LDEST] {
        let mut seen = BTreeMap::new();
        drain(&nodes[other], queue, &want, &mut seen, quiet, bound).await;
        let twice: Vec<_> = seen.iter().filter(|(_, n)| **n > 1).collect();
        assert!(
            twice.is_empty(),
            "{} of {N} messages arrived at {queue} more than once (e.g. {:?})",
            twice.len(),
            twice.first()
        );
        let invented: Vec<_> = seen.keys().filter(|b| !want.contains(*b)).collect();
        assert!(invented.is_empty(), "invented at {queue}: {invented:?}");
    }
    println!(
        "round 1: {N} messages, each once through each shovel, {:?}",
        t0.elapsed()
    );

    // Only the leader lists the first two; every node the local exchange's.
    for (i, n) in nodes.iter().enumerate() {
        let rows = listed(n);
        if i == leader {
            assert_eq!(rows.len(), 3, "{} lists {rows:?}", n.name);
        } else {
            let names: Vec<&str> = rows.iter().map(|r| r.0.as_str()).collect();
            assert_eq!(
                names,
                [LSHOVEL],
                "{} (not the leader) lists {rows:?}",
                n.name
            );
        }
    }
    // Round 2 is the queue-sourced shovel's: an exchange's shovel queue lives on its node
    // (as RabbitMQ's), so what is published while none runs is not routed to it.
    for name in [XSHOVEL, LSHOVEL] {
        let path = format!("/api/parameters/shovel/%2f/{name}");
        http(&nodes[other], "DELETE", &path, None)
            .unwrap_or_else(|| panic!("DELETE {path} on {}", nodes[other].name));
    }

    // Round 2: the leader killed; the shovel resumes on the new one.
    cluster.run(&["kill", &nodes[leader].name]);
    let killed = Instant::now();
    let survivors: Vec<usize> = (0..3).filter(|&i| i != leader).collect();
    let ids: Vec<usize> = survivors.iter().map(|i| i + 1).collect();
    let second: Vec<String> = (0..N).map(|k| format!("b-{k}")).collect();
    publish_all(&nodes[survivors[0]], "", &second, Duration::from_secs(30)).await;
    let (new_leader, _) = agreed_leader(&state, &cluster.bin, &ids);
    let new_leader = new_leader as usize - 1;
    let all: BTreeSet<String> = first.iter().chain(&second).cloned().collect();
    let want: BTreeSet<String> = second.iter().cloned().collect();
    let mut seen2 = BTreeMap::new();
    let quiet = Duration::from_secs(2);
    drain(&nodes[survivors[0]], DEST, &want, &mut seen2, quiet, bound).await;
    let invented: Vec<_> = seen2.keys().filter(|b| !all.contains(*b)).collect();
    assert!(invented.is_empty(), "invented: {invented:?}");
    let dups = seen2.values().filter(|n| **n > 1).count();
    println!(
        "round 2: {N} messages after the kill of {}, all arrived {:?} after it ({dups} more than once, {} of round 1 again); new leader {}",
        nodes[leader].name,
        killed.elapsed(),
        seen2.keys().filter(|b| b.starts_with("a-")).count(),
        nodes[new_leader].name
    );
    for &i in &survivors {
        let rows = listed(&nodes[i]);
        if i == new_leader {
            assert_eq!(rows.len(), 1, "{} lists {rows:?}", nodes[i].name);
        } else {
            assert!(rows.is_empty(), "{} lists {rows:?}", nodes[i].name);
        }
    }
    println!("done in {:?}", t0.elapsed());
}
