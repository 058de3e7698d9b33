//! Operating quorum queues on three `warren serve` nodes in network namespaces
//! (`scripts/cluster.sh`, docs/cluster.md "Quorum queues"), with lapin on the host:
//!
//! - a declare-ok comes once the new queue's group has a leader serving it, so publishes with
//!   confirms right after it, on the declaring node (the group's leader or not), are all
//!   acked;
//! - `warren ctl cluster-status` shows every group (the metadata group and each quorum
//!   queue's: members, leader, each member's matched index and lag on the leader), and the
//!   HTTP API's queue objects carry `leader`, `members` and `online`.
//!
//! Needs root and `ip netns`, and the broker binary (`cargo build -p warren-cli`, or
//! WARREN_BIN); skipped otherwise unless WARREN_CLUSTER_REQUIRE=1.

mod common;

use std::time::{Duration, Instant};

use common::{Cluster, Node, bounded, cluster_status, parse};
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};

const BRIDGE: &str = "wbq0";
const NET: &str = "10.85.0";

async fn channel(node: &Node) -> (Connection, Channel) {
    let uri = format!("amqp://warren:warren@{}/%2f", node.amqp);
    let conn = bounded(
        "connect",
        Connection::connect(&uri, ConnectionProperties::default()),
    )
    .await
    .expect("connect");
    let ch = conn.create_channel().await.expect("channel");
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirm.select");
    (conn, ch)
}

fn quorum_args() -> FieldTable {
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".into()),
    );
    args
}

/// Publishes `n` persistent messages to `queue` and waits for every confirm: how many were
/// acked.
async fn publish_confirmed(ch: &Channel, queue: &str, n: usize) -> usize {
    let mut confirms = Vec::with_capacity(n);
    for i in 0..n {
        confirms.push(
            bounded(
                "publish",
                ch.basic_publish(
                    "".into(),
                    queue.into(),
                    BasicPublishOptions::default(),
                    format!("m{i}").as_bytes(),
                    BasicProperties::default().with_delivery_mode(2),
                ),
            )
            .await
            .expect("publish"),
        );
    }
    let mut acked = 0;
    for c in confirms {
        if bounded("confirm", c).await.expect("confirm").is_ack() {
            acked += 1;
        }
    }
    acked
}

/// `GET path` on a node's HTTP API as warren/warren: the JSON body.
fn http_get(node: &Node, path: &str) -> serde_json::Value {
    let out = std::process::Command::new("curl")
        .args(["-sf", "-m", "10", "-u", "warren:warren"])
        .arg(format!("http://{}{path}", node.http))
        .output()
        .expect("run curl");
    assert!(
        out.status.success(),
        "GET {path} on {}: {}",
        node.name,
        out.status
    );
    serde_json::from_slice(&out.stdout).expect("JSON")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn declare_ok_waits_for_a_leader_and_cluster_status_shows_every_group() {
    let Some(cluster) = Cluster::prepare("quorum queue operations test", BRIDGE, NET) else {
        return;
    };
    let nodes = parse(&cluster.run(&["up", "3"]));
    assert_eq!(nodes.len(), 3);
    let state = cluster.state.path().join("cluster");

    // Declares on every node in turn, each followed at once by confirmed publishes on the
    // same channel. Six queues: their groups' first leaders spread over the nodes, so the
    // declaring node leads some and not others (then it forwards to the leader).
    let names: Vec<String> = (0..6).map(|i| format!("qq-ops-{i}")).collect();
    let mut declare_ms = Vec::new();
    for (i, name) in names.iter().enumerate() {
        let node = &nodes[i % 3];
        let (_c, ch) = channel(node).await;
        let durable = QueueDeclareOptions {
            durable: true,
            ..Default::default()
        };
        let t = Instant::now();
        bounded(
            "declare",
            ch.queue_declare(name.as_str().into(), durable, quorum_args()),
        )
        .await
        .expect("declare a quorum queue");
        declare_ms.push(t.elapsed().as_millis());
        let acked = publish_confirmed(&ch, name, 20).await;
        assert_eq!(
            acked, 20,
            "publishes right after the declare-ok of {name} on {} are all acked",
            node.name
        );
    }
    eprintln!("quorum queue declare-ok took {declare_ms:?} ms");

    // cluster-status on every node names the metadata group and every queue's group, with
    // the same leader for each queue; on that leader, every member's matched index and lag.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let statuses: Vec<serde_json::Value> = (1..=3)
            .map(|i| cluster_status(&state, &cluster.bin, i).expect("cluster-status answers"))
            .collect();
        let mut problems = Vec::new();
        for name in &names {
            let groups: Vec<&serde_json::Value> = statuses
                .iter()
                .filter_map(|s| {
                    s["groups"]
                        .as_array()?
                        .iter()
                        .find(|g| g["type"] == "quorum" && g["queue"] == name.as_str())
                })
                .collect();
            if groups.len() != 3 {
                problems.push(format!("{name}: in {} nodes' status", groups.len()));
                continue;
            }
            let leaders: Vec<Option<u64>> = groups
                .iter()
                .map(|g| g["status"]["leader"].as_u64())
                .collect();
            let Some(Some(leader)) = leaders.first().copied() else {
                problems.push(format!("{name}: no leader"));
                continue;
            };
            if leaders.iter().any(|l| *l != Some(leader)) {
                problems.push(format!("{name}: leaders {leaders:?}"));
                continue;
            }
            let on_leader = groups[(leader - 1) as usize];
            assert_eq!(on_leader["status"]["state"], "leader");
            assert_eq!(on_leader["members"].as_array().map(Vec::len), Some(3));
            let members = on_leader["status"]["members"].as_array().expect("members");
            assert_eq!(members.len(), 3, "{on_leader}");
            for m in members {
                // 20 messages and the leader's marker are committed; every member has them.
                if m["matched"].as_u64().unwrap_or(0) < 2 || m["lag"].as_u64() != Some(0) {
                    problems.push(format!("{name}: member {m} behind"));
                }
                assert_eq!(m["online"], true, "{m}");
                assert_eq!(m["voter"], true, "{m}");
            }
        }
        for s in &statuses {
            let g = &s["groups"][0];
            assert_eq!(g["type"], "metadata", "the metadata group first: {s}");
            assert_eq!(g["status"]["leader"], s["leader"]);
            assert!(s["alarms"].as_array().is_some_and(Vec::is_empty), "{s}");
        }
        if problems.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "cluster-status does not show every group settled: {problems:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The text form lists the groups too.
    let text = std::process::Command::new(&cluster.bin)
        .args(["ctl", "--data-dir"])
        .arg(state.join("n1/data"))
        .arg("cluster-status")
        .output()
        .expect("ctl");
    let text = String::from_utf8_lossy(&text.stdout);
    for name in &names {
        assert!(text.contains(name.as_str()), "{name} in:\n{text}");
    }

    // The HTTP API's queues carry their group: leader, members, online (RabbitMQ's fields).
    for node in &nodes {
        let qs = http_get(node, "/api/queues");
        for name in &names {
            let q = qs
                .as_array()
                .and_then(|a| a.iter().find(|q| q["name"] == name.as_str()))
                .unwrap_or_else(|| panic!("{name} in /api/queues on {}", node.name));
            assert_eq!(q["type"], "quorum");
            assert_eq!(q["members"].as_array().map(Vec::len), Some(3), "{q}");
            assert_eq!(q["online"].as_array().map(Vec::len), Some(3), "{q}");
            assert!(q["leader"].as_u64().is_some(), "{q}");
        }
        let one = http_get(node, &format!("/api/queues/%2f/{}", names[0]));
        assert!(one["leader"].as_u64().is_some(), "{one}");
    }
    // A member down: the others no longer count it online.
    cluster.run(&["kill", "n3"]);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let q = http_get(&nodes[0], &format!("/api/queues/%2f/{}", names[0]));
        if q["online"].as_array().map(Vec::len) == Some(2) {
            assert!(
                !q["online"].as_array().into_iter().flatten().any(|m| m == 3),
                "{q}"
            );
            break;
        }
        assert!(Instant::now() < deadline, "n3 still online: {q}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
