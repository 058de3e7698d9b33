//! Issue 43, item 15: a publish another connection sends right after a SUBSCRIBE was sent
//! (before its SUBACK is read) reaches the new subscription, as on Mosquitto. Raw MQTT 3.1.1
//! packets over loopback sockets: no client library between the bytes and the broker.

use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// How many rounds of the race: main missed the publish in about half of them (101 of 200
/// here, 65-72% in the runs).
const ROUNDS: usize = 200;

/// What may still be missed: a publish read before the SUBSCRIBE's task even ran is routed
/// without it. In a debug build on a shared 2-core machine most runs miss 0-2 of 200, one in
/// eight or so 35-42 (the subscriber's task woken on a parked worker); main misses 100 or
/// more. docs/mqtt.md.
const MAY_MISS: usize = 60;

fn packet(kind: u8, body: &[u8]) -> Vec<u8> {
    let mut out = vec![kind];
    let mut len = body.len();
    loop {
        let mut b = (len % 128) as u8;
        len /= 128;
        if len > 0 {
            b |= 0x80;
        }
        out.push(b);
        if len == 0 {
            break;
        }
    }
    out.extend_from_slice(body);
    out
}

fn string(s: &[u8]) -> Vec<u8> {
    let mut out = (s.len() as u16).to_be_bytes().to_vec();
    out.extend_from_slice(s);
    out
}

/// Reads one packet: its first byte and its body.
async fn read_packet(s: &mut TcpStream) -> std::io::Result<(u8, Vec<u8>)> {
    let kind = s.read_u8().await?;
    let (mut len, mut mult) = (0usize, 1usize);
    loop {
        let b = s.read_u8().await?;
        len += usize::from(b & 0x7f) * mult;
        mult *= 128;
        if b & 0x80 == 0 {
            break;
        }
    }
    let mut body = vec![0; len];
    s.read_exact(&mut body).await?;
    Ok((kind, body))
}

async fn connect(addr: std::net::SocketAddr, id: &str) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.expect("connect");
    s.set_nodelay(true).expect("nodelay");
    let mut body = string(b"MQTT");
    body.extend_from_slice(&[4, 0xC2]); // 3.1.1; user, password, clean session
    body.extend_from_slice(&60u16.to_be_bytes());
    body.extend(string(id.as_bytes()));
    body.extend(string(b"guest"));
    body.extend(string(b"guest"));
    s.write_all(&packet(0x10, &body)).await.expect("CONNECT");
    let (kind, ack) = tokio::time::timeout(Duration::from_secs(10), read_packet(&mut s))
        .await
        .expect("CONNACK in time")
        .expect("CONNACK");
    assert_eq!((kind, ack.get(1).copied()), (0x20, Some(0)), "accepted");
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_right_after_a_subscribe_reaches_the_new_subscription() {
    let broker = warren_runtime::BrokerHandle::start(warren_core::BrokerConfig::default());
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (_stop, stopped) = tokio::sync::watch::channel(false);
    tokio::spawn(warren_mqtt::serve(
        listener,
        broker.clone(),
        Arc::new(warren_mqtt::MqttConfig::default()),
        stopped,
    ));
    let mut sub = connect(addr, "window-sub").await;
    let mut publisher = connect(addr, "window-pub").await;
    let mut missed = Vec::new();
    for i in 0..ROUNDS {
        let topic = format!("win/{i}");
        let mut body = ((i as u16) + 1).to_be_bytes().to_vec();
        body.extend(string(topic.as_bytes()));
        body.push(0);
        sub.write_all(&packet(0x82, &body))
            .await
            .expect("SUBSCRIBE");
        // At once, from the other connection, before the SUBACK is read.
        let mut body = string(topic.as_bytes());
        body.push(b'x');
        publisher
            .write_all(&packet(0x30, &body))
            .await
            .expect("PUBLISH");
        let mut got = false;
        while let Ok(read) =
            tokio::time::timeout(Duration::from_millis(300), read_packet(&mut sub)).await
        {
            let (kind, _) = read.expect("read");
            if kind & 0xF0 == 0x30 {
                got = true;
                break;
            }
        }
        if !got {
            missed.push(i);
        }
    }
    assert!(
        missed.len() <= MAY_MISS,
        "{} of {ROUNDS} publishes sent right after a SUBSCRIBE missed it (rounds {missed:?})",
        missed.len()
    );
}
