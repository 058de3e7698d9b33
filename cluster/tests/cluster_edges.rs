//! Edges of queues that live on one node (docs/cluster.md, "Failure modes users must
//! know"): a `queue.delete` with `if-unused` or `if-empty` sent to a node that holds only a
//! stub of the queue is decided by the queue's home, as in RabbitMQ: `406
//! PRECONDITION_FAILED - queue '...' in vhost '/' in use` (or `is not empty`) while the home's
//! queue has a consumer (or ready messages), and the queue stays on every node; once it is
//! unused the same delete removes it everywhere. A declare of a classic queue while its home
//! node is down fails with RabbitMQ's 404 (`home node ... is down or inaccessible`).
//!
//! Needs root and `ip netns`, and the broker binary (`cargo build -p warren-cli`, or
//! WARREN_BIN). Without them the test says why and passes, unless WARREN_CLUSTER_REQUIRE=1
//! (CI sets it) turns the skip into a failure.

mod common;

use std::time::Duration;

use common::{Cluster, Node, bounded, parse};
use lapin::options::{
    BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection};

/// Its own bridge and subnet: runs beside the other cluster tests.
const BRIDGE: &str = "wbe0";
const NET: &str = "10.88.0";

async fn channel(node: &Node) -> (Connection, Channel) {
    common::amqp_channel(node).await
}

fn durable() -> QueueDeclareOptions {
    QueueDeclareOptions {
        durable: true,
        ..Default::default()
    }
}

/// A declare of `q` on `node` (passive or not): Ok, or the error's text.
async fn declare(node: &Node, q: &str, passive: bool) -> Result<(), String> {
    let (_c, ch) = channel(node).await;
    let options = QueueDeclareOptions {
        passive,
        ..durable()
    };
    bounded(
        "declare",
        ch.queue_declare(q.into(), options, FieldTable::default()),
    )
    .await
    .map(|_| ())
    .map_err(|e| e.to_string())
}

/// A `queue.delete` of `q` on `node` with these conditions: the message count, or the
/// error's text.
async fn delete(node: &Node, q: &str, if_unused: bool, if_empty: bool) -> Result<u32, String> {
    let (_c, ch) = channel(node).await;
    bounded(
        "delete",
        ch.queue_delete(
            q.into(),
            QueueDeleteOptions {
                if_unused,
                if_empty,
                nowait: false,
            },
        ),
    )
    .await
    .map_err(|e| e.to_string())
}

/// Polls until `q` exists on every node (`there`) or on none, within 10 s.
async fn exists_everywhere(nodes: &[Node], q: &str, there: bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let mut seen = Vec::new();
        for n in nodes {
            seen.push(declare(n, q, true).await.is_ok());
        }
        if seen.iter().all(|s| *s == there) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{q} exists on n1..n3: {seen:?}, expected {there} on all"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conditional_deletes_are_decided_by_the_home_and_declares_fail_while_it_is_down() {
    let Some(cluster) = Cluster::prepare("cluster edges test", BRIDGE, NET) else {
        return;
    };
    let nodes = parse(&cluster.run(&["up", "3"]));
    assert_eq!(nodes.len(), 3);

    // "used" and "full" live on n2 (declared there): "used" has a consumer on n2, "full"
    // a confirmed message.
    let (_c2, ch2) = channel(&nodes[1]).await;
    for q in ["used", "full"] {
        bounded(
            "declare on n2",
            ch2.queue_declare(q.into(), durable(), FieldTable::default()),
        )
        .await
        .expect("declare on n2");
    }
    let consumer = bounded(
        "consume",
        ch2.basic_consume(
            "used".into(),
            "c".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        ),
    )
    .await
    .expect("consume on n2");
    common::answered(
        "confirm.select-ok",
        ch2.confirm_select(ConfirmSelectOptions::default()),
    )
    .await
    .expect("confirm mode");
    let confirm = bounded(
        "publish",
        ch2.basic_publish(
            "".into(),
            "full".into(),
            BasicPublishOptions::default(),
            b"kept",
            BasicProperties::default().with_delivery_mode(2),
        ),
    )
    .await
    .expect("publish");
    assert!(bounded("confirm", confirm).await.expect("confirm").is_ack());
    exists_everywhere(&nodes, "used", true).await;
    exists_everywhere(&nodes, "full", true).await;

    // From n1 and n3, which hold stubs (no consumer, no message there): refused as the home
    // decides, and nothing is deleted anywhere.
    let e = delete(&nodes[0], "used", true, false)
        .await
        .expect_err("in use");
    assert!(
        e.contains("PRECONDITION") && e.contains("queue 'used' in vhost '/' in use"),
        "{e}"
    );
    let e = delete(&nodes[2], "full", false, true)
        .await
        .expect_err("not empty");
    assert!(
        e.contains("PRECONDITION") && e.contains("queue 'full' in vhost '/' is not empty"),
        "{e}"
    );
    exists_everywhere(&nodes, "used", true).await;
    exists_everywhere(&nodes, "full", true).await;

    // Unused now: the same delete from n1 removes it everywhere.
    bounded("cancel", ch2.basic_cancel("c".into(), Default::default()))
        .await
        .expect("cancel");
    drop(consumer);
    delete(&nodes[0], "used", true, false)
        .await
        .expect("delete once unused");
    exists_everywhere(&nodes, "used", false).await;

    // n2 down: a declare of its classic queue on n1 fails with RabbitMQ's 404.
    cluster.run(&["kill", "n2"]);
    let e = declare(&nodes[0], "full", false)
        .await
        .expect_err("home down");
    assert!(
        e.contains("NOT_FOUND") || e.contains("NOTFOUND") || e.contains("404"),
        "{e}"
    );
    assert!(e.contains("down or inaccessible"), "{e}");
}
