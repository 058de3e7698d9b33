//! Three `warren serve` nodes in network namespaces (`scripts/cluster.sh` with
//! `WARREN_CLUSTER_TLS_DIR`) whose cluster port is mutual TLS (docs/cluster.md "Transport"):
//! certificates made here (rcgen), each naming its node's IP. A quorum queue declared on one
//! node (its Raft group runs over TLS), publishes confirmed through another (forwarded over
//! the mail connection), every message fetched on the third; a plaintext peer dialling a
//! node's cluster port gets no challenge and the node logs why.
//!
//! Needs root and `ip netns`, and the broker binary (`cargo build -p warren-cli`, or
//! WARREN_BIN); skipped otherwise unless WARREN_CLUSTER_REQUIRE=1.

mod common;

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use common::{Cluster, Node, bounded, parse};
use lapin::options::{
    BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection};

const BRIDGE: &str = "wbt0";
const NET: &str = "10.87.0";
const QUEUE: &str = "qq-tls";

/// Writes `ca.pem` and, per node i of 1..=3, `ni.pem` / `ni.key` for NET.(10+i) into `dir`.
fn pki(dir: &std::path::Path) {
    let mut ca = rcgen::CertificateParams::new(Vec::new()).expect("params");
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(rcgen::DnType::CommonName, "warren cluster CA");
    let ca_key = rcgen::KeyPair::generate().expect("key");
    let ca_cert = ca.self_signed(&ca_key).expect("ca");
    std::fs::write(dir.join("ca.pem"), ca_cert.pem()).expect("write");
    let issuer = rcgen::Issuer::from_params(&ca, &ca_key);
    for i in 1..=3 {
        let params =
            rcgen::CertificateParams::new(vec![format!("{NET}.{}", 10 + i)]).expect("params");
        let key = rcgen::KeyPair::generate().expect("key");
        let cert = params.signed_by(&key, &issuer).expect("sign");
        std::fs::write(dir.join(format!("n{i}.pem")), cert.pem()).expect("write");
        std::fs::write(dir.join(format!("n{i}.key")), key.serialize_pem()).expect("write");
    }
}

async fn channel(node: &Node) -> (Connection, Channel) {
    let (conn, ch) = common::amqp_channel(node).await;
    common::answered(
        "confirm.select-ok",
        ch.confirm_select(ConfirmSelectOptions::default()),
    )
    .await
    .expect("confirm.select");
    (conn, ch)
}

fn log(cluster: &Cluster, i: u32) -> String {
    std::fs::read_to_string(cluster.state.path().join(format!("cluster/n{i}/log")))
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quorum_queue_works_over_a_tls_cluster_port_and_plaintext_is_refused() {
    let Some(mut cluster) = Cluster::prepare("cluster TLS test", BRIDGE, NET) else {
        return;
    };
    let tls = tempfile::tempdir().expect("tempdir");
    pki(tls.path());
    cluster
        .env
        .push(("WARREN_CLUSTER_TLS_DIR", tls.path().to_path_buf()));
    let nodes = parse(&cluster.run(&["up", "3"]));
    assert_eq!(nodes.len(), 3);
    for i in 1..=3 {
        let l = log(&cluster, i);
        assert!(
            l.contains("(cluster)") && l.contains("tls=true"),
            "n{i} runs its cluster port with TLS:\n{l}"
        );
    }
    // The declare-ok waits until the queue's group has a leader: elected over TLS.
    let (_c1, ch1) = channel(&nodes[0]).await;
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".into()),
    );
    let durable = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    bounded("declare", ch1.queue_declare(QUEUE.into(), durable, args))
        .await
        .expect("declare a quorum queue");
    // Publishes through n2: confirmed once the group's majority has them.
    let (_c2, ch2) = channel(&nodes[1]).await;
    let n = 100;
    for i in 0..n {
        let confirm = bounded(
            "publish",
            ch2.basic_publish(
                "".into(),
                QUEUE.into(),
                BasicPublishOptions::default(),
                format!("m{i}").as_bytes(),
                BasicProperties::default().with_delivery_mode(2),
            ),
        )
        .await
        .expect("publish");
        assert!(
            bounded("confirm", confirm).await.expect("confirm").is_ack(),
            "m{i} confirmed"
        );
    }
    // Every one fetched on n3, in order.
    let (_c3, ch3) = channel(&nodes[2]).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut got = Vec::new();
    while got.len() < n && Instant::now() < deadline {
        match bounded(
            "get",
            ch3.basic_get(QUEUE.into(), BasicGetOptions { no_ack: true }),
        )
        .await
        .expect("basic.get")
        {
            Some(m) => got.push(String::from_utf8_lossy(&m.delivery.data).into_owned()),
            None => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
    let want: Vec<String> = (0..n).map(|i| format!("m{i}")).collect();
    assert_eq!(got, want, "every confirmed message, in order, on n3");

    // A plaintext peer (a node without --cluster-tls-*): its hello gets no challenge.
    let addr = format!("{NET}.11:25672");
    let mut s = std::net::TcpStream::connect(&addr).expect("dial n1's cluster port");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let hello = br#"{"Hello":{"version":1,"from":9,"nonce":[0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0]}}"#;
    let mut frame = (hello.len() as u32).to_be_bytes().to_vec();
    frame.extend_from_slice(hello);
    s.write_all(&frame).expect("send a plaintext hello");
    let mut buf = [0u8; 64];
    // The node hangs up at once: end-of-file (or a reset), never a challenge.
    let read = s.read(&mut buf);
    assert!(
        matches!(read, Ok(0) | Err(_)),
        "a plaintext peer was answered: {read:?}"
    );
    let deadline = Instant::now() + Duration::from_secs(5);
    while !log(&cluster, 1).contains("does not speak TLS") && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        log(&cluster, 1).contains("does not speak TLS"),
        "n1 logs why it refused the plaintext peer"
    );
    cluster.run(&["down"]);
}
