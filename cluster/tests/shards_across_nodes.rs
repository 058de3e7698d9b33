//! Consumers across nodes with `--shards 2` (docs/cluster.md, "Not yet"): only a queue on
//! its home's shard 0, consumed through its copy on shard 0 by a connection on shard 0, is
//! served; the rest is refused at once with 540 NOT_IMPLEMENTED, never left unanswered (before,
//! a consumer got nothing, or a 404 "did not answer in time" after 10 s). Two nodes, each
//! `--shards 2`: a durable queue lives on the shard its name hashes to, on both nodes.
//!
//! Needs root and `ip netns`, and the broker binary (`cargo build -p warren-cli`, or
//! WARREN_BIN). Without them the test says why and passes, unless WARREN_CLUSTER_REQUIRE=1
//! (CI sets it) turns the skip into a failure.

mod common;

use std::time::Duration;

use common::{Cluster, Node, bounded, parse};
use lapin::BasicProperties;
use lapin::options::{
    BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::FieldTable;

/// Its own bridge and subnet: runs beside the other cluster tests.
const BRIDGE: &str = "wbs0";
const NET: &str = "10.92.0";

/// The shard a durable queue of vhost "/" lives on with 2 shards (FNV-1a of vhost, 0, name:
/// `stored_queue_shard` in core/src/shard/topology_declare.rs).
fn shard_of(name: &str) -> u32 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in "/".bytes().chain([0]).chain(name.bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    (h % 2) as u32
}

/// A queue name of shard `shard`.
fn name_on(shard: u32) -> String {
    (0..)
        .map(|i| format!("q{i}"))
        .find(|n| shard_of(n) == shard)
        .expect("a name")
}

/// basic.get (no ack) of `q` on `node` from a new connection: the body, None if empty, or
/// the error's text.
async fn get(node: &Node, q: &str) -> Result<Option<String>, String> {
    let (_c, ch) = common::amqp_channel(node).await;
    bounded(
        "basic.get",
        ch.basic_get(q.into(), BasicGetOptions { no_ack: true }),
    )
    .await
    .map(|m| m.map(|m| String::from_utf8_lossy(&m.delivery.data).into_owned()))
    .map_err(|e| format!("{e:?} {e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_two_shards_consumers_across_nodes_are_served_or_refused_never_left_waiting() {
    let Some(mut cluster) = Cluster::prepare("shards across nodes test", BRIDGE, NET) else {
        return;
    };
    cluster
        .env
        .push(("WARREN_CLUSTER_SHARDS", std::path::PathBuf::from("2")));
    let nodes = parse(&cluster.run(&["up", "2"]));
    assert_eq!(nodes.len(), 2);
    let (q0, q1) = (name_on(0), name_on(1));

    // Both live on n1, one message each.
    let (_c1, ch1) = common::amqp_channel(&nodes[0]).await;
    common::answered(
        "confirm.select-ok",
        ch1.confirm_select(ConfirmSelectOptions::default()),
    )
    .await
    .expect("confirm mode");
    for q in [&q0, &q1, &q0, &q0, &q0] {
        bounded(
            "declare on n1",
            ch1.queue_declare(
                q.as_str().into(),
                QueueDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                FieldTable::default(),
            ),
        )
        .await
        .expect("declare on n1");
        let confirm = bounded(
            "publish",
            ch1.basic_publish(
                "".into(),
                q.as_str().into(),
                BasicPublishOptions::default(),
                format!("m-{q}").as_bytes(),
                BasicProperties::default().with_delivery_mode(2),
            ),
        )
        .await
        .expect("publish");
        assert!(bounded("confirm", confirm).await.expect("confirm").is_ack());
    }

    // q1 is on shard 1 of its home: a get on n2 is refused at once, by the home, whatever
    // n2's connection (a 404 only until n2 knows the queue).
    let deadline = tokio::time::Instant::now() + common::WAIT;
    let refusal = loop {
        let started = tokio::time::Instant::now();
        match get(&nodes[1], &q1).await {
            Err(e) if e.contains("NOT_FOUND") && !e.contains("answer in time") => {}
            other => {
                assert!(
                    started.elapsed() < Duration::from_secs(5),
                    "answered only after {:?}: {other:?}",
                    started.elapsed()
                );
                break other;
            }
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{q1} never known on n2"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let e = refusal.expect_err("a get of a queue on its home's shard 1 is refused");
    eprintln!("{q1} from n2: {e}");
    assert!(
        e.contains("NOT_IMPLEMENTED") && e.contains("--shards 1") && e.contains(&q1),
        "{e}"
    );
    // The message stays on n1.
    assert_eq!(get(&nodes[0], &q1).await, Ok(Some(format!("m-{q1}"))));

    // q0 is on shard 0 of both nodes: served to a connection of n2's shard 0, refused (540,
    // at once) to one of its shard 1. Connections take turns between the shards (their ids
    // count up, shard = id % 2), so a few tries see both.
    let (mut served, mut refused) = (Vec::new(), 0);
    for _ in 0..8 {
        let started = tokio::time::Instant::now();
        match get(&nodes[1], &q0).await {
            Ok(got) => served.push(got),
            Err(e) if e.contains("NOT_FOUND") && !e.contains("answer in time") => {}
            Err(e) => {
                assert!(
                    e.contains("NOT_IMPLEMENTED") && e.contains("this connection on shard 0"),
                    "{e}"
                );
                refused += 1;
            }
        }
        assert!(started.elapsed() < Duration::from_secs(5), "answered late");
        if !served.is_empty() && refused > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!("{q0} from n2: refused {refused} times, served {served:?}");
    assert!(refused > 0, "a connection of shard 1 is refused");
    assert_eq!(served.first(), Some(&Some(format!("m-{q0}"))), "served");
}
