//! Topic permissions in a cluster: set on one node with `warren ctl`, they reach every node
//! through the metadata group, and a client's queue.bind from a topic exchange with a
//! refused binding key is refused (403) on the node it was made on before anything is
//! proposed (the nodes apply a committed bind on their admin path, which checks nothing), so
//! no node gets the binding; an allowed one is replicated as any bind.
//!
//! Needs root and `ip netns`, and the broker binary (`cargo build -p warren-cli`, or
//! WARREN_BIN). Without them the test says why and passes, unless WARREN_CLUSTER_REQUIRE=1
//! (CI sets it) turns the skip into a failure.

mod common;

use common::{Cluster, agreed_leader, amqp_channel, bounded, parse};
use lapin::options::{QueueBindOptions, QueueDeclareOptions};
use lapin::types::FieldTable;

/// Its own bridge and subnet: runs beside the other cluster tests.
const BRIDGE: &str = "wbtp0";
const NET: &str = "10.94.0";

fn ctl(cluster: &Cluster, i: usize, args: &[&str]) -> Result<String, String> {
    let out = std::process::Command::new(&cluster.bin)
        .args(["ctl", "--format", "json", "--data-dir"])
        .arg(cluster.state.path().join(format!("cluster/n{i}/data")))
        .args(args)
        .output()
        .map_err(|e| e.to_string())?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

async fn bind(ch: &lapin::Channel, key: &str) -> Result<(), u16> {
    common::answered(
        "queue.bind answer",
        ch.queue_bind(
            "tp.q".into(),
            "amq.topic".into(),
            key.into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        ),
    )
    .await
    .map_err(|e| match e.kind() {
        lapin::ErrorKind::ProtocolError(p) => p.get_id(),
        other => panic!("unexpected error {other:?}"),
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn topic_permissions_reach_every_node_and_refused_binds_are_not_replicated() {
    let Some(cluster) = Cluster::prepare("cluster topic permissions test", BRIDGE, NET) else {
        return;
    };
    let state = cluster.state.path().join("cluster");
    let nodes = parse(&cluster.run(&["up", "3"]));
    assert_eq!(nodes.len(), 3);
    agreed_leader(&state, &cluster.bin, &[1, 2, 3]);

    ctl(
        &cluster,
        1,
        &[
            "set-topic-permissions",
            "warren",
            "amq.topic",
            "^ok\\.",
            "^ok\\.",
        ],
    )
    .expect("set-topic-permissions on n1");
    for i in 1..=3 {
        let rows = ctl(&cluster, i, &["list-topic-permissions"]).expect("list");
        assert!(rows.contains("\"^ok\\\\.\""), "n{i}: {rows}");
    }

    let (_c2, ch2) = amqp_channel(&nodes[1]).await;
    bounded(
        "queue.declare",
        ch2.queue_declare(
            "tp.q".into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        ),
    )
    .await
    .expect("queue.declare");
    assert_eq!(bounded("bind ok.#", bind(&ch2, "ok.#")).await, Ok(()));
    assert_eq!(bounded("bind no.#", bind(&ch2, "no.#")).await, Err(403));
    // Every node has the allowed binding and none the refused one.
    for i in 1..=3 {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        loop {
            let rows = ctl(&cluster, i, &["list-bindings"]).expect("list-bindings");
            assert!(
                !rows.contains("no.#"),
                "n{i} has the refused binding: {rows}"
            );
            if rows.contains("ok.#") {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "n{i} lacks the allowed binding: {rows}"
            );
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    }
    // Cleared on n3: n2 may bind it now.
    ctl(&cluster, 3, &["clear-topic-permissions", "warren"]).expect("clear on n3");
    let (_c2b, ch2b) = amqp_channel(&nodes[1]).await;
    assert_eq!(bounded("bind no.#", bind(&ch2b, "no.#")).await, Ok(()));
}
