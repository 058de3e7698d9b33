//! Consumers on any node (docs/cluster.md, "Consumers on any node"): a lapin consumer on n3
//! of a classic queue that lives on n2, fed by confirmed publishes on n1, gets every
//! message within its prefetch (10: never more unacked at the client), its requeue comes
//! back redelivered, its acks settle on n2; a passive declare and a purge on another node
//! act on n2's queue, basic.get on n1 takes n2's messages; n3 killed with deliveries
//! unacked: they are back on n2. Then a quorum queue: a consumer on a node that does not
//! lead it gets every confirmed message, and keeps getting them (no basic.cancel) after
//! the leader is SIGKILLed and another elected. MQTT: a persistent session that
//! reconnects on another node gets what was queued for it while it was away, and what
//! comes after (its queue stays on its first node; the session consumes it from there).
//!
//! Needs root and `ip netns`, and the broker binary (`cargo build -p warren-cli`, or
//! WARREN_BIN). Without them the test says why and passes, unless WARREN_CLUSTER_REQUIRE=1
//! (CI sets it) turns the skip into a failure.

mod common;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use common::{Cluster, Node, agreed_leader, bounded, parse};
use futures_lite::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicGetOptions, BasicNackOptions, BasicPublishOptions,
    BasicQosOptions, ConfirmSelectOptions, QueueDeclareOptions, QueuePurgeOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};

/// Its own bridge and subnet: runs beside the other cluster tests.
const BRIDGE: &str = "wbr0";
const NET: &str = "10.84.0";

async fn channel(node: &Node) -> (Connection, Channel) {
    common::amqp_channel(node).await
}

/// Publishes `bodies` persistent to `q` with confirms; every one must be acked.
async fn publish_confirmed(ch: &Channel, q: &str, bodies: &[String]) {
    let mut confirms = Vec::new();
    for b in bodies {
        let c = bounded(
            "publish",
            ch.basic_publish(
                "".into(),
                q.into(),
                BasicPublishOptions::default(),
                b.as_bytes(),
                BasicProperties::default().with_delivery_mode(2),
            ),
        )
        .await
        .expect("publish");
        confirms.push(c);
    }
    for c in confirms {
        assert!(
            bounded("confirm", c).await.expect("confirm").is_ack(),
            "a publish was nacked"
        );
    }
}

/// (messages, consumers) of `q` as a passive declare on `node` reports them.
async fn counts(node: &Node, q: &str) -> (u32, u32) {
    let (_c, ch) = channel(node).await;
    let ok = bounded(
        "passive declare",
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
    .unwrap_or_else(|e| panic!("{}: passive declare {q}: {e}", node.name));
    (ok.message_count(), ok.consumer_count())
}

/// Takes `n` messages of `q` on `node` with basic.get (waiting up to `within` for them);
/// returns (body, redelivered) in order.
async fn get_n(node: &Node, q: &str, n: usize, within: Duration) -> Vec<(String, bool)> {
    let (_c, ch) = channel(node).await;
    let deadline = Instant::now() + within;
    let mut out = Vec::new();
    while out.len() < n {
        match bounded(
            "basic.get",
            ch.basic_get(q.into(), BasicGetOptions { no_ack: true }),
        )
        .await
        .expect("basic.get")
        {
            Some(m) => out.push((
                String::from_utf8_lossy(&m.delivery.data).into_owned(),
                m.delivery.redelivered,
            )),
            None => {
                assert!(
                    Instant::now() < deadline,
                    "{}: only {} of {n} messages in {within:?}: {out:?}",
                    node.name,
                    out.len()
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_on_another_node_gets_the_homes_messages_within_its_prefetch() {
    let Some(cluster) = Cluster::prepare("cluster remote consumers test", BRIDGE, NET) else {
        return;
    };
    let state = cluster.state.path().join("cluster");
    let nodes = parse(&cluster.run(&["up", "3"]));
    assert_eq!(nodes.len(), 3);
    let bin = cluster.bin.clone();
    agreed_leader(&state, &bin, &[1, 2, 3]);
    let (n1, n2, n3) = (&nodes[0], &nodes[1], &nodes[2]);
    let q = "far";

    // Declared on n2: it lives there.
    {
        let (_c, ch) = channel(n2).await;
        bounded(
            "declare",
            ch.queue_declare(
                q.into(),
                QueueDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                FieldTable::default(),
            ),
        )
        .await
        .expect("declare on n2");
    }
    let (_p, publisher) = channel(n1).await;
    common::answered(
        "confirm.select-ok",
        publisher.confirm_select(ConfirmSelectOptions::default()),
    )
    .await
    .expect("confirm.select");

    // A purge on n3 empties n2's queue (not n3's stub), and says how many it took.
    let junk: Vec<String> = (0..30).map(|i| format!("junk-{i}")).collect();
    publish_confirmed(&publisher, q, &junk).await;
    assert_eq!(counts(n1, q).await, (30, 0), "n1 reports n2's queue");
    {
        let (_c, ch) = channel(n3).await;
        let purged = bounded(
            "purge",
            ch.queue_purge(q.into(), QueuePurgeOptions::default()),
        )
        .await
        .expect("purge on n3");
        assert_eq!(purged, 30, "purge-ok counts n2's messages");
    }
    assert_eq!(counts(n2, q).await, (0, 0), "purged on the home");

    // basic.get on n1 takes n2's message.
    publish_confirmed(&publisher, q, &["got".to_string()]).await;
    assert_eq!(
        get_n(n1, q, 1, Duration::from_secs(5)).await,
        vec![("got".to_string(), false)]
    );

    // The consumer on n3, prefetch 10, manual acks.
    let (_cc, consumer_ch) = channel(n3).await;
    common::answered(
        "basic.qos-ok",
        consumer_ch.basic_qos(10, BasicQosOptions::default()),
    )
    .await
    .expect("qos");
    let mut consumer = bounded(
        "consume",
        consumer_ch.basic_consume(
            q.into(),
            "c3".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        ),
    )
    .await
    .expect("consume on n3");
    assert_eq!(
        counts(n1, q).await,
        (0, 1),
        "the consumer counts on the home"
    );

    let bodies: Vec<String> = (0..100).map(|i| format!("m{i}")).collect();
    let started = Instant::now();
    publish_confirmed(&publisher, q, &bodies).await;

    // Rounds of 10: the client never holds more than its prefetch; the first delivery
    // of the first round is requeued and must come back redelivered.
    let mut seen: BTreeSet<String> = BTreeSet::new();
    let mut requeued: Option<String> = None;
    let mut came_back = false;
    let mut max_unacked = 0usize;
    // 100 deliveries, and the requeued one again.
    let (total, mut delivered) = (bodies.len() + 1, 0);
    while delivered < total {
        let want = (total - delivered).min(10);
        let mut held = Vec::new();
        while held.len() < want {
            let d = bounded("delivery", consumer.next())
                .await
                .expect("consumer open")
                .expect("delivery");
            held.push(d);
        }
        delivered += held.len();
        // Nothing beyond the prefetch arrives while all 10 are unacked.
        if held.len() == 10 {
            let extra = tokio::time::timeout(Duration::from_millis(300), consumer.next()).await;
            assert!(extra.is_err(), "an 11th delivery with 10 unacked");
        }
        max_unacked = max_unacked.max(held.len());
        for d in held {
            let body = String::from_utf8_lossy(&d.data).into_owned();
            if requeued.is_none() {
                assert!(!d.redelivered, "{body}: redelivered the first time");
                requeued = Some(body);
                d.acker
                    .nack(BasicNackOptions {
                        requeue: true,
                        ..Default::default()
                    })
                    .await
                    .expect("nack");
                continue;
            }
            if requeued.as_deref() == Some(body.as_str()) {
                assert!(d.redelivered, "the requeued message comes back redelivered");
                came_back = true;
            }
            assert!(seen.insert(body.clone()), "{body} delivered twice");
            d.acker.ack(BasicAckOptions::default()).await.expect("ack");
        }
    }
    assert!(came_back, "the requeued message never came back");
    println!(
        "100 messages published on n1 to a queue on n2, consumed and acked on n3 in {:?} \
         (at most {max_unacked} unacked)",
        started.elapsed()
    );
    assert_eq!(seen.len(), bodies.len());
    // The acks settled on the home.
    let deadline = Instant::now() + Duration::from_secs(5);
    while counts(n2, q).await != (0, 1) {
        assert!(Instant::now() < deadline, "acks never reached n2");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // basic.cancel crosses too: cancel-ok, and the home counts no consumer.
    bounded(
        "cancel",
        consumer_ch.basic_cancel("c3".into(), Default::default()),
    )
    .await
    .expect("cancel on n3");
    assert_eq!(counts(n2, q).await, (0, 0), "cancelled on the home");

    // Throughput: 1000 messages consumed on n3 (from n2) and on n2 itself, prefetch 200.
    for node in [n3, n2] {
        let batch: Vec<String> = (0..1000).map(|i| format!("t{i}")).collect();
        publish_confirmed(&publisher, q, &batch).await;
        let (_c, ch) = channel(node).await;
        common::answered(
            "basic.qos-ok",
            ch.basic_qos(200, BasicQosOptions::default()),
        )
        .await
        .expect("qos");
        let mut fast = bounded(
            "consume",
            ch.basic_consume(
                q.into(),
                "fast".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            ),
        )
        .await
        .expect("consume");
        let started = Instant::now();
        for i in 1..=batch.len() {
            let d = bounded("delivery", fast.next())
                .await
                .expect("consumer open")
                .expect("delivery");
            if i % 50 == 0 {
                d.acker
                    .ack(BasicAckOptions { multiple: true })
                    .await
                    .expect("ack");
            }
        }
        let secs = started.elapsed().as_secs_f64();
        println!(
            "1000 messages of a queue on n2 consumed on {} (prefetch 200, acks every 50): \
             {:.0} msg/s",
            node.name,
            1000.0 / secs
        );
        bounded("cancel", ch.basic_cancel("fast".into(), Default::default()))
            .await
            .expect("cancel");
    }

    // n3 killed with 10 deliveries unacked: all 20 messages are back on n2.
    let (_cc, consumer_ch) = channel(n3).await;
    common::answered(
        "basic.qos-ok",
        consumer_ch.basic_qos(10, BasicQosOptions::default()),
    )
    .await
    .expect("qos");
    let mut consumer = bounded(
        "consume",
        consumer_ch.basic_consume(
            q.into(),
            "c3b".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        ),
    )
    .await
    .expect("consume on n3");
    let more: Vec<String> = (0..20).map(|i| format!("k{i}")).collect();
    publish_confirmed(&publisher, q, &more).await;
    for _ in 0..10 {
        bounded("delivery", consumer.next())
            .await
            .expect("consumer open")
            .expect("delivery");
    }
    cluster.run(&["kill", "n3"]);
    let killed = Instant::now();
    let back = get_n(n2, q, 20, Duration::from_secs(20)).await;
    println!(
        "n3 killed with 10 unacked: all 20 on n2 again after {:?}",
        killed.elapsed()
    );
    let names: BTreeSet<String> = back.iter().map(|(b, _)| b.clone()).collect();
    assert_eq!(names, more.iter().cloned().collect::<BTreeSet<_>>());
    assert_eq!(
        back.iter().filter(|(_, r)| *r).count(),
        10,
        "the 10 n3 held come back redelivered: {back:?}"
    );

    cluster.run(&["start", "n3"]);
    // Its link to n2 comes up within the transport's backoff: until then what it asks n2
    // fails (404, as for a home that is down).
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (_c, ch) = channel(n3).await;
        let probe = common::answered(
            "queue.declare answer",
            ch.queue_declare(
                q.into(),
                QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            ),
        )
        .await;
        if probe.is_ok() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "n3 never reached n2 after its restart"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    mqtt_session_moves_node(&nodes).await;
    quorum_consumer_on_a_follower(&cluster, &nodes).await;
}

/// The leader of quorum queue `q` as node `i` (index) reports it (`warren ctl list-queues`),
/// as an index.
fn reported_leader(cluster: &Cluster, i: usize, q: &str) -> Option<usize> {
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
    let found = qs.as_array()?.iter().find(|x| x["name"] == q)?;
    usize::try_from(found["leader"].as_u64()?)
        .ok()?
        .checked_sub(1)
}

/// Publishes `body` to `q` with a confirm, retrying (a new connection to `node` each time)
/// until it is confirmed: a quorum queue nacks while its group has no leader.
async fn publish_until_confirmed(node: &Node, q: &str, body: &str) {
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
                    q.into(),
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

/// A quorum queue with its consumer on a node that does not lead it.
async fn quorum_consumer_on_a_follower(cluster: &Cluster, nodes: &[Node]) {
    let q = "qq-far";
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".into()),
    );
    {
        let (_c, ch) = channel(&nodes[0]).await;
        bounded(
            "declare",
            ch.queue_declare(
                q.into(),
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
        if let Some(l) = (0..3).find_map(|i| reported_leader(cluster, i, q)) {
            break l;
        }
        assert!(Instant::now() < deadline, "no leader for {q}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let far = (leader + 1) % 3;
    println!(
        "quorum queue led by {}; consumer on {}",
        nodes[leader].name, nodes[far].name
    );
    let (_cc, consumer_ch) = channel(&nodes[far]).await;
    common::answered(
        "basic.qos-ok",
        consumer_ch.basic_qos(50, BasicQosOptions::default()),
    )
    .await
    .expect("qos");
    let mut consumer = bounded(
        "consume",
        consumer_ch.basic_consume(
            q.into(),
            "qc".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        ),
    )
    .await
    .expect("consume on a follower");

    let first: Vec<String> = (0..50).map(|i| format!("a{i}")).collect();
    for b in &first {
        publish_until_confirmed(&nodes[far], q, b).await;
    }
    let mut got: BTreeSet<String> = BTreeSet::new();
    while !first.iter().all(|b| got.contains(b)) {
        let d = bounded("delivery from the leader", consumer.next())
            .await
            .expect("consumer open")
            .expect("delivery");
        got.insert(String::from_utf8_lossy(&d.data).into_owned());
        d.acker.ack(BasicAckOptions::default()).await.expect("ack");
    }

    // The leader dies; the consumer stays and gets what is published after.
    cluster.run(&["kill", &nodes[leader].name]);
    let killed = Instant::now();
    let second: Vec<String> = (0..50).map(|i| format!("b{i}")).collect();
    for b in &second {
        publish_until_confirmed(&nodes[far], q, b).await;
    }
    println!(
        "leader {} killed: 50 more confirmed {:?} after",
        nodes[leader].name,
        killed.elapsed()
    );
    while !second.iter().all(|b| got.contains(b)) {
        let d = bounded("delivery after the leader's kill", consumer.next())
            .await
            .expect("the consumer was not cancelled")
            .expect("delivery");
        got.insert(String::from_utf8_lossy(&d.data).into_owned());
        d.acker.ack(BasicAckOptions::default()).await.expect("ack");
    }
    println!(
        "the consumer on {} got all 50 from the new leader {:?} after the kill",
        nodes[far].name,
        killed.elapsed()
    );
}

fn mqtt_options(node: &Node, id: &str, clean: bool) -> rumqttc::MqttOptions {
    let (host, port) = node.mqtt.rsplit_once(':').expect("HOST:PORT");
    let mut opts = rumqttc::MqttOptions::new(id, host, port.parse().expect("port"));
    opts.set_credentials("warren", "warren");
    opts.set_clean_session(clean);
    opts
}

/// Runs `events` until `n` publishes (other than probes) came in; their payloads.
async fn mqtt_receive(events: &mut rumqttc::EventLoop, n: usize) -> Vec<String> {
    let mut got = Vec::new();
    bounded("mqtt receive", async {
        while got.len() < n {
            match events.poll().await {
                Ok(rumqttc::Event::Incoming(rumqttc::Packet::Publish(p))) => {
                    got.push(String::from_utf8_lossy(&p.payload).into_owned());
                }
                Ok(_) => {}
                Err(e) => panic!("mqtt receive: {e}"),
            }
        }
    })
    .await;
    got
}

/// Publishes `payloads` at QoS 1 on `node`, each PUBACK in before the next.
async fn mqtt_publish(node: &Node, topic: &str, payloads: &[String]) {
    let (client, mut events) = rumqttc::AsyncClient::new(mqtt_options(node, "pub", true), 100);
    for p in payloads {
        common::answered(
            "room in the client queue for PUBLISH",
            client.publish(
                topic,
                rumqttc::QoS::AtLeastOnce,
                false,
                p.as_bytes().to_vec(),
            ),
        )
        .await
        .expect("publish");
        bounded("puback", async {
            loop {
                match events.poll().await {
                    Ok(rumqttc::Event::Incoming(rumqttc::Packet::PubAck(_))) => return,
                    Ok(_) => {}
                    Err(e) => panic!("{}: mqtt publish: {e}", node.name),
                }
            }
        })
        .await;
    }
    let _ = common::answered(
        "room in the client queue for DISCONNECT",
        client.disconnect(),
    )
    .await;
}

/// A persistent MQTT session subscribed on n2 reconnects on n3.
async fn mqtt_session_moves_node(nodes: &[Node]) {
    let (n1, n2, n3) = (&nodes[0], &nodes[1], &nodes[2]);
    let topic = "moving/t";
    {
        let (client, mut events) = rumqttc::AsyncClient::new(mqtt_options(n2, "mover", false), 100);
        common::answered(
            "room in the client queue for SUBSCRIBE",
            client.subscribe(topic, rumqttc::QoS::AtLeastOnce),
        )
        .await
        .expect("subscribe");
        bounded("suback", async {
            loop {
                match events.poll().await {
                    Ok(rumqttc::Event::Incoming(rumqttc::Packet::SubAck(_))) => return,
                    Ok(_) => {}
                    Err(e) => panic!("n2: mqtt: {e}"),
                }
            }
        })
        .await;
        common::answered(
            "room in the client queue for DISCONNECT",
            client.disconnect(),
        )
        .await
        .expect("disconnect");
        let _ = tokio::time::timeout(Duration::from_millis(500), events.poll()).await;
    }
    // Queued for the session on n2 while it is away (published there: n2 applied the
    // binding before its SUBACK).
    let away: Vec<String> = (0..10).map(|i| format!("away-{i}")).collect();
    mqtt_publish(n2, topic, &away).await;
    // The client subscribes again on n3 (as clients do; the session is present there
    // too since sessions are cluster-wide, cluster/tests/mqtt_sessions.rs); its queue,
    // with what it holds, is still the one on n2, consumed from n3.
    let (client, mut events) = rumqttc::AsyncClient::new(mqtt_options(n3, "mover", false), 100);
    common::answered(
        "room in the client queue for SUBSCRIBE",
        client.subscribe(topic, rumqttc::QoS::AtLeastOnce),
    )
    .await
    .expect("subscribe on n3");
    assert_eq!(
        mqtt_receive(&mut events, 10).await,
        away,
        "the session on n3 gets what its queue on n2 holds, in order"
    );
    // And what is published later, on any node.
    let after: Vec<String> = (0..5).map(|i| format!("after-{i}")).collect();
    mqtt_publish(n1, topic, &after).await;
    assert_eq!(mqtt_receive(&mut events, 5).await, after);
    let _ = common::answered(
        "room in the client queue for DISCONNECT",
        client.disconnect(),
    )
    .await;
    println!("a persistent MQTT session moved from n2 to n3 got its queued messages");
}
