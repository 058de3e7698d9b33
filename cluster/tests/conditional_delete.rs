//! The window of a conditional `queue.delete` in a cluster (docs/cluster.md, "Failure modes
//! users must know"): the node that gets a delete with `if-unused` asks every node whether
//! the queue is in use, then commits the delete. A consumer that attaches on the queue's
//! home in between (the brokers widen that window here, through
//! `WARREN_TEST_CONDITIONAL_DELETE_DELAY_MS`) must not split the cluster: the committed
//! delete is the decided one, so the queue goes on every node and that consumer is
//! cancelled (basic.cancel); before, the home kept its queue while the others dropped it.
//!
//! Needs root and `ip netns`, and the broker binary (`cargo build -p warren-cli`, or
//! WARREN_BIN). Without them the test says why and passes, unless WARREN_CLUSTER_REQUIRE=1
//! (CI sets it) turns the skip into a failure.

mod common;

use std::time::{Duration, Instant};

use common::{Cluster, Node, bounded, parse};
use futures_lite::StreamExt;
use lapin::options::{BasicConsumeOptions, QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::FieldTable;

/// Its own bridge and subnet (shared with `mqtt_gone_node.rs`, run one after the other).
const BRIDGE: &str = "wbe1";
const NET: &str = "10.93.0";

/// A passive declare of `q` on `node`: Ok, or the error's text.
async fn passive(node: &Node, q: &str) -> Result<(), String> {
    let (_c, ch) = common::amqp_channel(node).await;
    bounded(
        "declare",
        ch.queue_declare(
            q.into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        ),
    )
    .await
    .map(|_| ())
    .map_err(|e| e.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_attaching_while_a_conditional_delete_commits_does_not_split_the_cluster() {
    let Some(mut cluster) = Cluster::prepare("cluster conditional delete test", BRIDGE, NET) else {
        return;
    };
    cluster
        .env
        .push(("WARREN_TEST_CONDITIONAL_DELETE_DELAY_MS", "1500".into()));
    let nodes = parse(&cluster.run(&["up", "3"]));
    assert_eq!(nodes.len(), 3);

    // "cd" lives on n1 (declared there), unused.
    let (_c1, ch1) = common::amqp_channel(&nodes[0]).await;
    bounded(
        "declare",
        ch1.queue_declare(
            "cd".into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        ),
    )
    .await
    .expect("declared on n1");
    let deadline = Instant::now() + common::WAIT;
    while passive(&nodes[1], "cd").await.is_err() {
        assert!(Instant::now() < deadline, "n2 never saw cd");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // n2 checks (every node: unused) and waits 1.5 s before proposing; meanwhile a
    // consumer attaches on n1, the home.
    let n2 = nodes[1].clone();
    let deleting = tokio::spawn(async move {
        let (_c, ch) = common::amqp_channel(&n2).await;
        ch.queue_delete(
            "cd".into(),
            QueueDeleteOptions {
                if_unused: true,
                ..Default::default()
            },
        )
        .await
        .map_err(|e| e.to_string())
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut consumer = bounded(
        "consume",
        ch1.basic_consume(
            "cd".into(),
            "late".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        ),
    )
    .await
    .expect("consume-ok on n1 while the delete waits");
    let deleted = bounded("delete", deleting).await.expect("task");
    assert!(deleted.is_ok(), "the checked delete commits: {deleted:?}");

    // The same everywhere: gone on every node, the late consumer cancelled.
    for node in &nodes {
        let deadline = Instant::now() + common::WAIT;
        loop {
            match passive(node, "cd").await {
                Err(e) if e.contains("NOT_FOUND") => break,
                other => assert!(
                    Instant::now() < deadline,
                    "{}: cd still there: {other:?}",
                    node.name
                ),
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let end = bounded("the consumer's end", consumer.next()).await;
    assert!(end.is_none(), "basic.cancel ends the consumer: {end:?}");
}
