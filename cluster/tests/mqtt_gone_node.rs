//! MQTT sessions of a node that is gone for good (docs/cluster.md, "MQTT sessions across
//! nodes"), over `scripts/cluster.sh` with rumqttc (MQTT 5): after a kill -9 of the node
//! that had them, never restarted,
//! - a client that was connected there claims its session on another node without waiting
//!   the 3 s handover bound (the dead node cannot hand over; the claimer's probe of the
//!   cluster port says so at once);
//! - the sessions it owned still expire on time: the metadata leader ends them once the
//!   node was unreachable for the takeover wait (10 s) and their expiry passed (a session
//!   whose connection died with the node counts as disconnected from then), and their
//!   queues go.
//!
//! Needs root and `ip netns`, and the broker binary (`cargo build -p warren-cli`, or
//! WARREN_BIN). Without them the test says why and passes, unless WARREN_CLUSTER_REQUIRE=1
//! (CI sets it) turns the skip into a failure.

mod common;

use std::time::{Duration, Instant};

use common::{Cluster, Node, bounded, parse};
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::mqttbytes::v5::Packet;
use rumqttc::v5::{AsyncClient, Event, EventLoop, MqttOptions};

/// Its own bridge and subnet: runs beside the other cluster tests.
const BRIDGE: &str = "wbe1";
const NET: &str = "10.93.0";

/// The sessions' expiry (s).
const EXPIRY: u32 = 4;

async fn connect(node: &Node, id: &str, expiry: u32) -> (AsyncClient, EventLoop, bool) {
    let (host, port) = node.mqtt.rsplit_once(':').expect("HOST:PORT");
    let mut o = MqttOptions::new(id, host, port.parse().expect("port"));
    o.set_credentials("warren", "warren");
    o.set_clean_start(false);
    o.set_session_expiry_interval(Some(expiry));
    o.set_keep_alive(Duration::from_secs(30));
    let (client, mut events) = AsyncClient::new(o, 100);
    let present = bounded("connack", async {
        loop {
            match events.poll().await {
                Ok(Event::Incoming(Packet::ConnAck(ack))) => return ack.session_present,
                Ok(_) => {}
                Err(e) => panic!("{}: connect {id}: {e:?}", node.name),
            }
        }
    })
    .await;
    (client, events, present)
}

async fn subscribe(client: &AsyncClient, events: &mut EventLoop, filter: &str) {
    common::answered(
        "room in the client queue for SUBSCRIBE",
        client.subscribe(filter, QoS::AtLeastOnce),
    )
    .await
    .expect("subscribe");
    bounded("suback", async {
        loop {
            match events.poll().await {
                Ok(Event::Incoming(Packet::SubAck(_))) => return,
                Ok(_) => {}
                Err(e) => panic!("subscribe {filter}: {e:?}"),
            }
        }
    })
    .await;
}

async fn disconnect(client: AsyncClient, mut events: EventLoop) {
    common::answered(
        "room in the client queue for DISCONNECT",
        client.disconnect(),
    )
    .await
    .expect("disconnect");
    let _ = tokio::time::timeout(Duration::from_secs(2), async {
        while events.poll().await.is_ok() {}
    })
    .await;
}

/// What a passive declare of `queue` on `node` says: `Ok(())` if it exists and its home
/// answers, else the server's reply text.
async fn passive(node: &Node, queue: &str) -> Result<(), String> {
    let (_c, ch) = common::amqp_channel(node).await;
    common::answered(
        "queue.declare answer",
        ch.queue_declare(
            queue.into(),
            lapin::options::QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            lapin::types::FieldTable::default(),
        ),
    )
    .await
    .map(|_| ())
    .map_err(|e| e.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_nodes_sessions_are_claimed_without_waiting_and_still_expire() {
    let Some(cluster) = Cluster::prepare("cluster MQTT gone node test", BRIDGE, NET) else {
        return;
    };
    let nodes = parse(&cluster.run(&["up", "3"]));
    assert_eq!(nodes.len(), 3);

    // On n3: "held" stays connected (its connection dies with n3), "left" disconnects
    // before (n3's own timer would have ended it), "moving" stays connected and comes
    // back on n1 after the kill. Each has a queue on n3 (a QoS 1 subscription).
    let (held, mut held_events, _) = connect(&nodes[2], "held", EXPIRY).await;
    subscribe(&held, &mut held_events, "g/held").await;
    let (left, mut left_events, _) = connect(&nodes[2], "left", EXPIRY).await;
    subscribe(&left, &mut left_events, "g/left").await;
    disconnect(left, left_events).await;
    let (moving, mut moving_events, _) = connect(&nodes[2], "moving", 600).await;
    subscribe(&moving, &mut moving_events, "g/moving").await;
    for q in ["held", "left", "moving"] {
        let queue = format!("mqtt-subscription-{q}qos1");
        assert_eq!(passive(&nodes[0], &queue).await, Ok(()), "{queue} on n1");
    }

    let killed = Instant::now();
    cluster.run(&["kill", "n3"]);
    // Keep the clients from reconnecting to the dead node.
    drop((held, held_events, moving, moving_events));

    // The session n3's connection had resumes on n1 without the 3 s handover wait (the
    // connection is then closed, 0x83: its queue's home, n3, is down, as a classic queue's
    // consumers are refused while their home is).
    let started = Instant::now();
    let (client, events, present) = connect(&nodes[0], "moving", 600).await;
    let took = started.elapsed();
    println!("resume on n1 after n3's kill -9 with the client connected: CONNACK after {took:?}");
    assert!(present, "the session n3 had");
    assert!(
        took < Duration::from_millis(2000),
        "no handover wait for a dead node ({took:?}; the bound is 3 s)"
    );
    disconnect(client, events).await;

    // "held" and "left" expire although n3, which ran their timers, never comes back:
    // their queues go (a queue whose home is down is answered `... is down or
    // inaccessible`; one deleted, `no queue`).
    let bound = Duration::from_secs(u64::from(EXPIRY) + 10 + 20);
    for q in ["held", "left"] {
        let queue = format!("mqtt-subscription-{q}qos1");
        loop {
            match passive(&nodes[1], &queue).await {
                Err(e) if e.contains("no queue") => break,
                other => assert!(
                    killed.elapsed() < bound,
                    "{queue} still there {:?} after n3's kill -9: {other:?}",
                    killed.elapsed()
                ),
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        println!("{queue} gone {:?} after n3's kill -9", killed.elapsed());
    }
    // "moving" lives on (its session is n1's now, with its 600 s expiry; its queue stays
    // on the dead n3 as RabbitMQ's classic queues do).
    let (client, events, present) = connect(&nodes[1], "moving", 600).await;
    assert!(present, "moving's session is still there");
    disconnect(client, events).await;
    let (client, events, present) = connect(&nodes[0], "held", EXPIRY).await;
    assert!(!present, "held's session ended");
    disconnect(client, events).await;
}
