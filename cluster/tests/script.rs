//! `scripts/cluster.sh` end to end: `up 3` gives three brokers, each in its own network
//! namespace, that real clients on the host reach over AMQP (lapin) and MQTT (rumqttc);
//! `kill` is a SIGKILL, `start` brings the node back on its data dir, `partition` cuts nodes
//! from each other while the host still reaches both sides, `heal` undoes it, and `down`
//! leaves no namespace, link, process or state behind.
//!
//! Needs root and `ip netns`, and the broker binary (`cargo build -p warren-cli`, or
//! WARREN_BIN). Without them the test says why and passes, unless WARREN_CLUSTER_REQUIRE=1
//! (CI sets it) turns the skip into a failure.

mod common;

use common::{Cluster, Node, WAIT, agreed_leader, bounded, cluster_status, parse};
use std::process::Command;
use std::time::Duration;

use lapin::options::{BasicGetOptions, BasicPublishOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection, ConnectionProperties};

/// A bridge, subnet and state dir of the test's own, so a cluster a developer runs by hand
/// with the defaults is not touched.
const BRIDGE: &str = "wtest0";
const NET: &str = "10.78.0";

/// Declares a queue on the node, publishes to it and gets the message back. The queue is
/// transient: the node's own, so this works on the minority side of a partition too (a
/// durable declare is cluster metadata, which a minority cannot change: tests/metadata.rs).
async fn amqp_roundtrip(node: &Node, queue: &str) {
    let uri = format!("amqp://warren:warren@{}/%2f", node.amqp);
    let conn = bounded(
        "amqp connect",
        Connection::connect(&uri, ConnectionProperties::default()),
    )
    .await
    .unwrap_or_else(|e| panic!("{}: connect {uri}: {e}", node.name));
    let ch = common::answered("channel.open-ok", conn.create_channel())
        .await
        .expect("channel");
    common::answered(
        "queue.declare answer",
        ch.queue_declare(
            queue.into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        ),
    )
    .await
    .expect("queue.declare");
    let body = format!("hello {}", node.name);
    common::answered(
        "basic.publish sent (held while the connection is blocked)",
        ch.basic_publish(
            "".into(),
            queue.into(),
            BasicPublishOptions::default(),
            body.as_bytes(),
            BasicProperties::default(),
        ),
    )
    .await
    .expect("publish");
    let mut got = None;
    for _ in 0..100 {
        got = common::answered(
            "basic.get answer",
            ch.basic_get(queue.into(), BasicGetOptions { no_ack: true }),
        )
        .await
        .expect("basic.get");
        if got.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let got = got.unwrap_or_else(|| panic!("{}: nothing in {queue}", node.name));
    assert_eq!(got.delivery.data, body.as_bytes());
    let _ = common::answered("close-ok", conn.close(200, "bye".into())).await;
}

/// Whether an AMQP client can log in at the node now.
async fn amqp_up(node: &Node) -> bool {
    let uri = format!("amqp://warren:warren@{}/%2f", node.amqp);
    let conn = Connection::connect(&uri, ConnectionProperties::default());
    matches!(
        tokio::time::timeout(Duration::from_secs(3), conn).await,
        Ok(Ok(_))
    )
}

/// Subscribes and publishes at QoS 1 on the node; the message comes back.
async fn mqtt_roundtrip(node: &Node) {
    let (host, port) = node.mqtt.rsplit_once(':').expect("HOST:PORT");
    let mut opts = rumqttc::MqttOptions::new(
        format!("script-{}", node.name),
        host,
        port.parse().expect("port"),
    );
    opts.set_credentials("warren", "warren");
    let (client, mut events) = rumqttc::AsyncClient::new(opts, 10);
    let topic = format!("cluster/{}", node.name);
    client
        .subscribe(&topic, rumqttc::QoS::AtLeastOnce)
        .await
        .expect("subscribe");
    let mut published = false;
    let got = bounded("mqtt", async {
        loop {
            match events.poll().await {
                Ok(rumqttc::Event::Incoming(rumqttc::Packet::SubAck(_))) if !published => {
                    published = true;
                    client
                        .publish(&topic, rumqttc::QoS::AtLeastOnce, false, "ping")
                        .await
                        .expect("publish");
                }
                Ok(rumqttc::Event::Incoming(rumqttc::Packet::Publish(p))) => return p,
                Ok(_) => {}
                Err(e) => panic!("{}: mqtt: {e}", node.name),
            }
        }
    })
    .await;
    assert_eq!(got.topic, topic);
    assert_eq!(&got.payload[..], b"ping");
    let _ = common::answered(
        "room in the client queue for DISCONNECT",
        client.disconnect(),
    )
    .await;
}

/// Whether a TCP connection from inside node `from`'s namespace reaches `to`.
fn reaches(from: usize, to: &str) -> bool {
    let (host, port) = to.rsplit_once(':').expect("HOST:PORT");
    Command::new("ip")
        .args(["netns", "exec", &format!("{BRIDGE}-n{from}")])
        .args(["timeout", "2", "bash", "-c"])
        .arg(format!("exec 3<>/dev/tcp/{host}/{port}"))
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

fn leftovers() -> Vec<String> {
    let mut left = Vec::new();
    let ns = Command::new("ip")
        .args(["netns", "list"])
        .output()
        .expect("ip");
    for line in String::from_utf8_lossy(&ns.stdout).lines() {
        if line.starts_with(&format!("{BRIDGE}-n")) {
            left.push(format!("namespace {line}"));
        }
    }
    let links = Command::new("ip")
        .args(["-o", "link", "show"])
        .output()
        .expect("ip");
    for line in String::from_utf8_lossy(&links.stdout).lines() {
        if line.contains(BRIDGE) {
            left.push(format!("link {line}"));
        }
    }
    left
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_kill_start_partition_heal_down() {
    let Some(cluster) = Cluster::prepare("cluster.sh test", BRIDGE, NET) else {
        return;
    };
    let state = cluster.state.path().join("cluster");

    let nodes = parse(&cluster.run(&["up", "3"]));
    assert_eq!(nodes.len(), 3, "one line per node");
    for (i, n) in nodes.iter().enumerate() {
        assert_eq!(n.name, format!("n{}", i + 1));
        assert!(n.amqp.starts_with(NET) && n.mqtt.starts_with(NET) && n.http.starts_with(NET));
    }
    // The three nodes form one cluster: they agree on a leader, which sees all three members
    // with no lag once the first entries are replicated.
    let bin = cluster.bin.clone();
    let (leader, _) = agreed_leader(&state, &bin, &[1, 2, 3]);
    let st = cluster_status(&state, &bin, leader as usize).expect("leader status");
    assert_eq!(st["members"].as_array().map(Vec::len), Some(3), "{st}");
    // Each node is its own broker on its own address.
    for n in &nodes {
        amqp_roundtrip(n, "script-q").await;
        mqtt_roundtrip(n).await;
    }
    // `up` again is idempotent: same lines, nothing restarted.
    let pid_before = std::fs::read_to_string(state.join("n1/pid")).expect("pid");
    let again = parse(&cluster.run(&["up", "3"]));
    assert_eq!(again.len(), 3);
    assert_eq!(
        std::fs::read_to_string(state.join("n1/pid")).expect("pid"),
        pid_before
    );

    // SIGKILL the leader: the other two elect a new one.
    cluster.run(&["kill", &format!("n{leader}")]);
    let rest: Vec<usize> = (1..=3).filter(|i| *i as u64 != leader).collect();
    let (new, took) = agreed_leader(&state, &bin, &rest);
    eprintln!(
        "cluster.sh: leader n{leader} SIGKILLed, n{new} leads after {took:?} (polled every 50 ms)"
    );
    assert_ne!(new, leader);
    cluster.run(&["start", &format!("n{leader}")]);
    let (leader, _) = agreed_leader(&state, &bin, &[1, 2, 3]);

    // SIGSTOP the leader (a hung node: its sockets stay open): the others move on without
    // it; SIGCONT, and it follows the new leader.
    cluster.run(&["pause", &format!("n{leader}")]);
    let rest: Vec<usize> = (1..=3).filter(|i| *i as u64 != leader).collect();
    let (new, _) = agreed_leader(&state, &bin, &rest);
    assert_ne!(new, leader);
    cluster.run(&["resume", &format!("n{leader}")]);
    agreed_leader(&state, &bin, &[1, 2, 3]);

    // kill is a SIGKILL of that node only; start brings it back on the same data dir.
    cluster.run(&["kill", "n2"]);
    assert!(!amqp_up(&nodes[1]).await, "n2 still answers after kill");
    assert!(amqp_up(&nodes[0]).await && amqp_up(&nodes[2]).await);
    assert!(
        cluster.run(&["status"]).contains("n2 stopped"),
        "status shows n2 stopped"
    );
    let back = parse(&cluster.run(&["start", "n2"]));
    assert_eq!(back.len(), 1);
    assert_eq!(back[0].amqp, nodes[1].amqp);
    amqp_roundtrip(&nodes[1], "script-q").await;

    // partition: n1 and the others cannot reach each other; the host reaches everyone.
    assert!(reaches(1, &nodes[1].amqp) && reaches(2, &nodes[0].amqp));
    cluster.run(&["partition", "n1"]);
    assert!(
        !reaches(1, &nodes[1].amqp),
        "n1 reaches n2 during the partition"
    );
    assert!(
        !reaches(3, &nodes[0].amqp),
        "n3 reaches n1 during the partition"
    );
    assert!(reaches(2, &nodes[2].amqp), "n2 and n3 are on the same side");
    amqp_roundtrip(&nodes[0], "script-q").await;
    amqp_roundtrip(&nodes[1], "script-q").await;
    cluster.run(&["partition", "n1"]); // idempotent
    // The majority side (n2, n3) has a leader of its own side.
    agreed_leader(&state, &bin, &[2, 3]);
    cluster.run(&["heal"]);
    let (l, _) = agreed_leader(&state, &bin, &[1, 2, 3]);
    // After the heal every member has applied the leader's whole log (the new terms' entries
    // included): n1 caught up across the namespaces.
    let start = std::time::Instant::now();
    loop {
        let last =
            cluster_status(&state, &bin, l as usize).and_then(|s| s["last_log_index"].as_u64());
        let applied: Vec<Option<u64>> = (1..=3)
            .map(|i| cluster_status(&state, &bin, i).and_then(|s| s["last_applied"].as_u64()))
            .collect();
        if last.is_some() && applied.iter().all(|a| *a >= last) {
            break;
        }
        assert!(
            start.elapsed() < WAIT,
            "not caught up: last {last:?}, applied {applied:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(reaches(1, &nodes[1].amqp) && reaches(3, &nodes[0].amqp));
    cluster.run(&["heal"]); // idempotent

    // down leaves nothing behind, and a second down is harmless.
    let pids: Vec<String> = (1..=3)
        .map(|i| std::fs::read_to_string(state.join(format!("n{i}/pid"))).expect("pid"))
        .collect();
    // A node gone for good is forgotten through `warren ctl forget-node` on another node;
    // the remaining two list only themselves.
    cluster.run(&["kill", "n3"]);
    // If n3 led, the change needs the next leader (a forget sent to a dead leader fails).
    agreed_leader(&state, &bin, &[1, 2]);
    let out = Command::new(&bin)
        .args(["ctl", "--data-dir"])
        .arg(state.join("n1/data"))
        .args(["forget-node", "3"])
        .output()
        .expect("warren ctl");
    assert!(
        out.status.success(),
        "forget-node: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    for i in [1, 2] {
        let members: Vec<u64> = cluster_status(&state, &bin, i).expect("status")["members"]
            .as_array()
            .expect("members")
            .iter()
            .filter_map(|m| m["id"].as_u64())
            .collect();
        // n2 may apply the change a moment after n1 answered.
        if members != [1, 2] {
            let start = std::time::Instant::now();
            while cluster_status(&state, &bin, i).expect("status")["members"]
                .as_array()
                .map(Vec::len)
                != Some(2)
            {
                assert!(start.elapsed() < WAIT, "n{i} still lists {members:?}");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
    agreed_leader(&state, &bin, &[1, 2]);

    cluster.run(&["down"]);
    assert_eq!(leftovers(), Vec::<String>::new());
    for pid in pids {
        assert!(
            !std::path::Path::new(&format!("/proc/{}", pid.trim())).exists(),
            "broker {pid} still running after down"
        );
    }
    assert!(!state.exists(), "state dir left behind");
    cluster.run(&["down"]);
}
