//! A quorum queue's consumer whose node lost the queue's leader and reaches it again is
//! attached there again; where that is refused it must hear of it (docs/cluster.md,
//! "Consumers on any node"), as RabbitMQ cancels a quorum queue's consumer it cannot keep:
//! `basic.cancel` (consumer_cancel_notify), never a consumer left on its channel with
//! nothing behind it. Over `scripts/cluster.sh` with lapin: an exclusive consumer on a
//! node cut off by a partition is dropped by the leader's node; another exclusive consumer
//! takes the queue meanwhile; once the partition heals, the first one's attach is refused
//! (403, in exclusive use), and exactly one of the two goes on (the other is cancelled).
//!
//! Needs root and `ip netns`, and the broker binary (`cargo build -p warren-cli`, or
//! WARREN_BIN). Without them the test says why and passes, unless WARREN_CLUSTER_REQUIRE=1
//! (CI sets it) turns the skip into a failure.

mod common;

use std::time::{Duration, Instant};

use common::{Cluster, Node, bounded, parse};
use futures_lite::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions,
    QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Connection, ConnectionProperties};

/// Its own bridge and subnet (shared with `mqtt_gone_node.rs` and `conditional_delete.rs`,
/// run one after the other).
const BRIDGE: &str = "wbe1";
const NET: &str = "10.93.0";

const Q: &str = "qr";

/// The leader of `Q` as node index `i` reports it (`warren ctl list-queues`), as an index.
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
    let found = qs.as_array()?.iter().find(|x| x["name"] == Q)?;
    usize::try_from(found["leader"].as_u64()?)
        .ok()?
        .checked_sub(1)
}

/// Publishes `body` to `Q` on `node` until it is confirmed (nacked while no leader).
async fn publish_until_confirmed(node: &Node, body: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let attempt = async {
            let uri = format!("amqp://warren:warren@{}/%2f", node.amqp);
            let conn = Connection::connect(&uri, ConnectionProperties::default())
                .await
                .ok()?;
            let ch = conn.create_channel().await.ok()?;
            ch.confirm_select(ConfirmSelectOptions::default())
                .await
                .ok()?;
            let c = ch
                .basic_publish(
                    "".into(),
                    Q.into(),
                    BasicPublishOptions::default(),
                    body.as_bytes(),
                    BasicProperties::default().with_delivery_mode(2),
                )
                .await
                .ok()?;
            let ok = c.await.ok()?.is_ack();
            let _ = conn.close(200, "done".into()).await;
            Some(ok)
        };
        if let Ok(Some(true)) = tokio::time::timeout(Duration::from_secs(5), attempt).await {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{}: {body} never confirmed",
            node.name
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// What one consumer's stream gave: deliveries (acked) until it ended (`basic.cancel`).
#[derive(Debug)]
enum Seen {
    Delivery(String),
    Ended,
}

/// An exclusive consumer of `Q` on `node`, its events sent to `tx` (tagged `name`).
async fn exclusive_consumer(
    node: &Node,
    name: &'static str,
    tx: tokio::sync::mpsc::UnboundedSender<(&'static str, Seen)>,
) -> Result<Connection, String> {
    let uri = format!("amqp://warren:warren@{}/%2f", node.amqp);
    let conn = Connection::connect(&uri, ConnectionProperties::default())
        .await
        .map_err(|e| e.to_string())?;
    let ch = conn.create_channel().await.map_err(|e| e.to_string())?;
    let mut consumer = ch
        .basic_consume(
            Q.into(),
            name.into(),
            BasicConsumeOptions {
                exclusive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(async move {
        let _ch = ch;
        loop {
            match consumer.next().await {
                Some(Ok(d)) => {
                    let _ = d.acker.ack(BasicAckOptions::default()).await;
                    let body = String::from_utf8_lossy(&d.data).into_owned();
                    let _ = tx.send((name, Seen::Delivery(body)));
                }
                _ => {
                    let _ = tx.send((name, Seen::Ended));
                    return;
                }
            }
        }
    });
    Ok(conn)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quorum_consumer_refused_where_it_attaches_again_is_cancelled() {
    let Some(cluster) = Cluster::prepare("cluster quorum re-attach test", BRIDGE, NET) else {
        return;
    };
    let nodes = parse(&cluster.run(&["up", "3"]));
    assert_eq!(nodes.len(), 3);
    {
        let (_c, ch) = common::amqp_channel(&nodes[0]).await;
        let mut args = FieldTable::default();
        args.insert(
            "x-queue-type".into(),
            AMQPValue::LongString("quorum".into()),
        );
        bounded(
            "declare",
            ch.queue_declare(
                Q.into(),
                QueueDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                args,
            ),
        )
        .await
        .expect("declare the quorum queue");
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    let leader = loop {
        if let Some(l) = (0..3).find_map(|i| reported_leader(&cluster, i)) {
            break l;
        }
        assert!(Instant::now() < deadline, "no leader for {Q}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let far = (leader + 1) % 3;
    println!(
        "{Q} led by {}; first consumer on {}",
        nodes[leader].name, nodes[far].name
    );
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let _first = bounded(
        "first consumer",
        exclusive_consumer(&nodes[far], "first", tx.clone()),
    )
    .await
    .expect("exclusive consumer on a follower");
    publish_until_confirmed(&nodes[leader], "before").await;
    let (who, seen) = bounded("delivery", rx.recv()).await.expect("event");
    assert!(
        who == "first" && matches!(&seen, Seen::Delivery(b) if b == "before"),
        "{who}: {seen:?}"
    );

    // Cut off, the far node keeps its consumer (a quorum queue's); the leader's node drops
    // it, and a second exclusive consumer, on the leader's node, gets the queue.
    cluster.run(&["partition", &nodes[far].name]);
    let deadline = Instant::now() + Duration::from_secs(30);
    let _second = loop {
        match exclusive_consumer(&nodes[leader], "second", tx.clone()).await {
            Ok(c) => break c,
            Err(e) => assert!(
                Instant::now() < deadline,
                "the queue stayed in the cut-off consumer's exclusive use: {e}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    println!("second exclusive consumer on {}", nodes[leader].name);

    // Healed: the first consumer is attached again where the queue is served, and one of
    // the two is refused there. That one must end (basic.cancel); the other goes on.
    cluster.run(&["heal"]);
    let healed = Instant::now();
    let ended = loop {
        let left = common::WAIT.saturating_sub(healed.elapsed());
        match tokio::time::timeout(left, rx.recv()).await {
            Ok(Some((who, Seen::Ended))) => break who,
            Ok(Some((who, seen))) => println!("{who}: {seen:?}"),
            Ok(None) => unreachable!("the test holds a sender"),
            Err(_) => panic!(
                "neither exclusive consumer was cancelled {:?} after the heal: one of them \
                 is attached nowhere without knowing it",
                healed.elapsed()
            ),
        }
    };
    println!("{ended} cancelled {:?} after the heal", healed.elapsed());
    // The other still consumes.
    publish_until_confirmed(&nodes[(leader + 2) % 3], "after").await;
    loop {
        match bounded("delivery after the heal", rx.recv()).await {
            Some((who, Seen::Delivery(b))) if b == "after" => {
                assert_ne!(who, ended, "delivered to the cancelled consumer");
                break;
            }
            Some((who, Seen::Ended)) => panic!("{who} cancelled too"),
            other => println!("{other:?}"),
        }
    }
}
