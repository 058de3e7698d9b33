//! At-least-once dead-lettering of a quorum queue over three `warren serve` nodes in
//! network namespaces (`scripts/cluster.sh`, docs/cluster.md "At-least-once
//! dead-lettering"), with lapin on the host.
//!
//! First the dead letters wait: 30 messages rejected while nothing is bound to the
//! dead-letter exchange stay in the source queue's Raft group; its leader is SIGKILLed;
//! once a queue is bound, the new leader forwards all 30. Then the leader is SIGKILLed
//! while messages are expiring and being dead-lettered: every one reaches the target (a
//! quorum queue too, so the kill may take its leader as well) at least once.
//!
//! Needs root and `ip netns`, and the broker binary (`cargo build -p warren-cli`, or
//! WARREN_BIN); skipped otherwise unless WARREN_CLUSTER_REQUIRE=1. Run it under
//! `flock /tmp/warren-netns.lock` when other namespace tests may run.

mod common;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use common::{Cluster, Node, bounded, parse};
use lapin::options::{
    BasicGetOptions, BasicPublishOptions, BasicRejectOptions, ConfirmSelectOptions,
    ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};

const BRIDGE: &str = "wbd0";
const NET: &str = "10.90.0";
const SOURCE: &str = "src";
const TARGET: &str = "dlq";

fn kill9(cluster: &Cluster, name: &str) {
    let pid_file = cluster.state.path().join("cluster").join(name).join("pid");
    let pid = std::fs::read_to_string(&pid_file).expect("node's pid file");
    let ok = std::process::Command::new("kill")
        .args(["-9", pid.trim()])
        .status()
        .expect("kill")
        .success();
    assert!(ok, "kill -9 {name}");
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

fn args(pairs: &[(&str, &str)]) -> FieldTable {
    let mut t = FieldTable::default();
    for (k, v) in pairs {
        t.insert((*k).into(), AMQPValue::LongString((*v).into()));
    }
    t
}

fn durable() -> QueueDeclareOptions {
    QueueDeclareOptions {
        durable: true,
        ..Default::default()
    }
}

/// Publishes `body` to the source with a confirm (and `expiration`): whether it was acked.
async fn publish(ch: &Channel, body: &str, expiration: Option<&str>) -> bool {
    let mut props = BasicProperties::default().with_delivery_mode(2);
    if let Some(e) = expiration {
        props = props.with_expiration(e.into());
    }
    let Ok(Ok(confirm)) = tokio::time::timeout(
        Duration::from_secs(5),
        ch.basic_publish(
            "".into(),
            SOURCE.into(),
            BasicPublishOptions::default(),
            body.as_bytes(),
            props,
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

/// The source's group leader as node `i` reports it, as an index into the nodes.
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
    let q = qs.as_array()?.iter().find(|q| q["name"] == SOURCE)?;
    let l = q["leader"].as_u64()?;
    usize::try_from(l).ok()?.checked_sub(1)
}

/// The node among `among` that leads the source and confirms a probe publish there.
async fn find_leader(
    cluster: &Cluster,
    nodes: &[Node],
    among: &[usize],
) -> (usize, Connection, Channel) {
    let start = Instant::now();
    loop {
        for &i in among {
            let Some(l) = reported_leader(cluster, i).filter(|l| among.contains(l)) else {
                continue;
            };
            let Some((conn, ch)) = channel(&nodes[l]).await else {
                continue;
            };
            // A probe that expires at once: it dead-letters too (counted as "probe").
            if publish(&ch, "probe", Some("0")).await {
                return (l, conn, ch);
            }
            let _ = common::answered("close-ok", conn.close(200, "not the leader".into())).await;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "no node among {among:?} serves the source queue"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Takes what the target holds (no-ack gets through the nodes `among`: a get goes to the
/// target's leader), into `got`, until `want` are all in or `within` passes. A get that
/// fails (the target's leader was on the killed node: 404 until it moves, which closes the
/// channel) is tried again on a new channel, on the next node.
async fn collect(
    nodes: &[Node],
    among: &[usize],
    want: &BTreeSet<String>,
    got: &mut Vec<String>,
    within: Duration,
) {
    let start = Instant::now();
    let mut turn = 0usize;
    let mut open: Option<(Connection, Channel)> = None;
    let mut failures = 0u32;
    loop {
        if open.is_none() {
            turn += 1;
            open = channel(&nodes[among[turn % among.len()]]).await;
        }
        if let Some((_, ch)) = &open {
            match tokio::time::timeout(
                Duration::from_secs(5),
                ch.basic_get(TARGET.into(), BasicGetOptions { no_ack: true }),
            )
            .await
            {
                Ok(Ok(Some(m))) => {
                    got.push(String::from_utf8_lossy(&m.delivery.data).into_owned());
                    assert!(got.len() < 100_000, "far more than were dead-lettered");
                    continue;
                }
                Ok(Ok(None)) => {}
                Ok(Err(_)) | Err(_) => {
                    failures += 1;
                    open = None;
                }
            }
        }
        let seen: BTreeSet<&String> = got.iter().collect();
        if want.iter().all(|w| seen.contains(w)) || start.elapsed() > within {
            if failures > 0 {
                eprintln!("{failures} gets from the target failed and were tried again");
            }
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_reach_their_target_across_leader_kills() {
    let Some(cluster) = Cluster::prepare("at-least-once dead-lettering test", BRIDGE, NET) else {
        return;
    };
    let nodes = parse(&cluster.run(&["up", "3"]));
    assert_eq!(nodes.len(), 3);
    {
        let (_c, ch) = channel(&nodes[0]).await.expect("connect n1");
        bounded(
            "dlx",
            ch.exchange_declare(
                "dlx".into(),
                lapin::ExchangeKind::Direct,
                ExchangeDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                FieldTable::default(),
            ),
        )
        .await
        .expect("declare dlx");
        bounded(
            "source",
            ch.queue_declare(
                SOURCE.into(),
                durable(),
                args(&[
                    ("x-queue-type", "quorum"),
                    ("x-dead-letter-exchange", "dlx"),
                    ("x-dead-letter-strategy", "at-least-once"),
                    ("x-overflow", "reject-publish"),
                ]),
            ),
        )
        .await
        .expect("declare the source");
        // The target is a quorum queue too: a kill may take its leader, never its messages.
        bounded(
            "target",
            ch.queue_declare(
                TARGET.into(),
                durable(),
                args(&[("x-queue-type", "quorum")]),
            ),
        )
        .await
        .expect("declare the target");
    }

    // Phase 1: dead letters wait in the source's group through a kill of its leader.
    let (leader, _conn, ch) = find_leader(&cluster, &nodes, &[0, 1, 2]).await;
    let mut want = BTreeSet::new();
    for i in 0..30 {
        let body = format!("r{i}");
        assert!(publish(&ch, &body, None).await, "{body} confirmed");
        want.insert(body);
    }
    for _ in 0..30 {
        let m = bounded(
            "get",
            ch.basic_get(SOURCE.into(), BasicGetOptions { no_ack: false }),
        )
        .await
        .expect("get")
        .expect("a message");
        let body = String::from_utf8_lossy(&m.delivery.data).into_owned();
        assert!(body.starts_with('r'), "{body}");
        bounded(
            "reject",
            m.delivery.reject(BasicRejectOptions { requeue: false }),
        )
        .await
        .expect("reject");
    }
    // This confirmed publish's entry carries the dead letters written before it.
    assert!(publish(&ch, "probe", Some("0")).await);
    tokio::time::sleep(Duration::from_millis(500)).await;
    kill9(&cluster, &nodes[leader].name);
    eprintln!(
        "source leader {} killed with 30 dead letters held",
        nodes[leader].name
    );
    let survivors: Vec<usize> = (0..3).filter(|i| *i != leader).collect();
    let (leader2, _conn2, ch2) = find_leader(&cluster, &nodes, &survivors).await;
    cluster.run(&["kill", &nodes[leader].name]);
    bounded(
        "bind",
        ch2.queue_bind(
            TARGET.into(),
            "dlx".into(),
            SOURCE.into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        ),
    )
    .await
    .expect("bind the target");
    let mut got = Vec::new();
    collect(&nodes, &survivors, &want, &mut got, Duration::from_secs(20)).await;
    let seen: BTreeSet<String> = got.iter().cloned().collect();
    let missing: Vec<_> = want.difference(&seen).collect();
    assert!(missing.is_empty(), "dead letters lost: {missing:?}");
    let twice = got.iter().filter(|b| b.starts_with('r')).count() - want.len();
    eprintln!(
        "phase 1: {} dead letters held through the kill of {} reached the target on {}'s watch ({twice} twice)",
        want.len(),
        nodes[leader].name,
        nodes[leader2].name
    );

    // Phase 2: the leader dies while messages expire and are dead-lettered.
    let line = cluster.run(&["start", &nodes[leader].name]);
    assert!(line.contains("amqp="), "{line}");
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (leader3, _conn3, ch3) = find_leader(&cluster, &nodes, &[0, 1, 2]).await;
    let mut want = BTreeSet::new();
    for i in 0..300 {
        let body = format!("e{i}");
        // Expiring over ~1 s, so the kill comes while they are being dead-lettered.
        if publish(&ch3, &body, Some(&format!("{}", 200 + 3 * i))).await {
            want.insert(body);
        }
    }
    assert!(want.len() > 250, "most publishes confirmed: {}", want.len());
    tokio::time::sleep(Duration::from_millis(400)).await;
    kill9(&cluster, &nodes[leader3].name);
    let survivors: Vec<usize> = (0..3).filter(|i| *i != leader3).collect();
    let (leader4, _conn4, _ch4) = find_leader(&cluster, &nodes, &survivors).await;
    cluster.run(&["kill", &nodes[leader3].name]);
    let mut got = Vec::new();
    collect(&nodes, &survivors, &want, &mut got, Duration::from_secs(30)).await;
    let seen: BTreeSet<String> = got.iter().cloned().collect();
    let missing: Vec<_> = want.difference(&seen).collect();
    assert!(missing.is_empty(), "dead letters lost: {missing:?}");
    let twice = got.iter().filter(|b| b.starts_with('e')).count() - want.len();
    eprintln!(
        "phase 2: {} messages expiring while {} was killed reached the target on {}'s watch ({twice} twice)",
        want.len(),
        nodes[leader3].name,
        nodes[leader4].name
    );
}
