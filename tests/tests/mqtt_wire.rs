//! Raw MQTT bytes over loopback: bad input closes only the offending connection (v5: with
//! the DISCONNECT reason code), keep-alive is enforced at 1.5x, unsupported levels get
//! CONNACK 0x01, invalid filters get SUBACK failures, and other clients keep working.

use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use warren_tests::WAIT;
use warren_tests::mqtt::{MqttBroker, start};

fn connect_packet(level: u8, id: &str, keep_alive: u16) -> Vec<u8> {
    let mut body = Vec::new();
    let name: &[u8] = if level == 3 { b"MQIsdp" } else { b"MQTT" };
    body.extend_from_slice(&(name.len() as u16).to_be_bytes());
    body.extend_from_slice(name);
    body.push(level);
    body.push(0x02); // clean session
    body.extend_from_slice(&keep_alive.to_be_bytes());
    if level == 5 {
        body.push(0); // no properties
    }
    body.extend_from_slice(&(id.len() as u16).to_be_bytes());
    body.extend_from_slice(id.as_bytes());
    let mut p = vec![0x10, body.len() as u8];
    p.extend(body);
    p
}

async fn open(b: &MqttBroker, level: u8, id: &str, keep_alive: u16) -> TcpStream {
    let mut s = warren_tests::bounded_as("TCP connect", TcpStream::connect(b.mqtt))
        .await
        .expect("connect");
    s.write_all(&connect_packet(level, id, keep_alive))
        .await
        .expect("write");
    let mut ack = [0u8; 2];
    tokio::time::timeout(WAIT, s.read_exact(&mut ack))
        .await
        .expect("CONNACK in time")
        .expect("read");
    assert_eq!(ack[0], 0x20, "CONNACK");
    let mut rest = vec![0u8; ack[1] as usize];
    warren_tests::bounded_as("bytes from the broker", s.read_exact(&mut rest))
        .await
        .expect("read");
    // Both versions: session-present flags, then the return / reason code.
    assert_eq!(rest[1], 0, "accepted");
    s
}

/// Everything the server sends until it closes the socket.
async fn until_closed(s: &mut TcpStream) -> Vec<u8> {
    let mut got = Vec::new();
    tokio::time::timeout(WAIT, s.read_to_end(&mut got))
        .await
        .expect("the server closed the connection in time")
        .expect("read");
    got
}

/// A pingreq/pingresp round trip: the connection still works.
async fn ping(s: &mut TcpStream) {
    s.write_all(&[0xC0, 0]).await.expect("write");
    let mut r = [0u8; 2];
    tokio::time::timeout(WAIT, s.read_exact(&mut r))
        .await
        .expect("PINGRESP in time")
        .expect("read");
    assert_eq!(r, [0xD0, 0]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_closes_only_that_connection() {
    let b = start().await;
    let mut bystander = open(&b, 4, "bystander", 60).await;
    let cases: Vec<(&str, u8, Vec<u8>, Option<u8>)> = vec![
        ("garbage packet type 0", 4, vec![0x00, 0x00], None),
        (
            "remaining length over 4 bytes",
            5,
            vec![0x30, 0xFF, 0xFF, 0xFF, 0xFF, 0x01],
            Some(0x81),
        ),
        (
            "second CONNECT",
            5,
            connect_packet(5, "again", 60),
            Some(0x82),
        ),
        (
            "PUBLISH with QoS 3",
            5,
            vec![0x36, 0x05, 0x00, 0x01, b'a', 0x00, 0x01],
            Some(0x81),
        ),
        (
            "wildcard in topic name",
            5,
            vec![0x30, 0x04, 0x00, 0x01, b'#', 0x00],
            Some(0x81),
        ),
        (
            "invalid UTF-8 topic",
            5,
            vec![0x30, 0x05, 0x00, 0x02, 0xC3, 0x28, 0x00],
            Some(0x81),
        ),
        (
            "SUBSCRIBE with wrong flags",
            5,
            vec![0x80, 0x06, 0x00, 0x01, 0x00, 0x01, b'a', 0x00],
            Some(0x81),
        ),
        (
            "oversized packet",
            5,
            vec![0x30, 0xFF, 0xFF, 0xFF, 0x7F],
            Some(0x95),
        ),
        (
            "server-to-client packet",
            4,
            vec![0x20, 0x02, 0x00, 0x00],
            None,
        ),
    ];
    for (what, level, bytes, reason) in cases {
        let mut s = open(&b, level, what, 60).await;
        s.write_all(&bytes).await.expect("write");
        let got = until_closed(&mut s).await;
        match reason {
            Some(r) => assert_eq!(got.get(..3), Some(&[0xE0, 0x01, r][..]), "{what}: {got:x?}"),
            None => assert!(got.is_empty(), "{what}: {got:x?}"),
        }
        ping(&mut bystander).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn packet_before_connect_and_truncated_connect() {
    let b = start().await;
    let mut s = warren_tests::bounded_as("TCP connect", TcpStream::connect(b.mqtt))
        .await
        .expect("connect");
    s.write_all(&[0xC0, 0]).await.expect("write");
    assert!(until_closed(&mut s).await.is_empty());
    let mut s = warren_tests::bounded_as("TCP connect", TcpStream::connect(b.mqtt))
        .await
        .expect("connect");
    let c = connect_packet(4, "cut", 60);
    s.write_all(&c[..c.len() - 3]).await.expect("write");
    s.shutdown().await.expect("half close");
    assert!(until_closed(&mut s).await.is_empty());
    // Still serving.
    let mut ok = open(&b, 4, "after", 60).await;
    ping(&mut ok).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsupported_protocol_level_gets_connack_0x01() {
    let b = start().await;
    let mut s = warren_tests::bounded_as("TCP connect", TcpStream::connect(b.mqtt))
        .await
        .expect("connect");
    s.write_all(&connect_packet(6, "x", 60))
        .await
        .expect("write");
    assert_eq!(until_closed(&mut s).await, [0x20, 0x02, 0x00, 0x01]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mqtt_3_1_connects() {
    let b = start().await;
    let mut s = open(&b, 3, "old-device", 60).await;
    ping(&mut s).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keep_alive_enforced_at_one_and_a_half_times() {
    let b = start().await;
    let mut s = open(&b, 5, "sleepy", 1).await;
    let start = tokio::time::Instant::now();
    let got = until_closed(&mut s).await;
    let took = start.elapsed();
    assert_eq!(got, [0xE0, 0x01, 0x8D], "DISCONNECT keep-alive timeout");
    assert!(
        took >= Duration::from_millis(1400) && took < Duration::from_millis(3000),
        "{took:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn takeover_sends_0x8e_to_v5_client() {
    let b = start().await;
    let mut first = open(&b, 5, "twin", 60).await;
    let _second = open(&b, 5, "twin", 60).await;
    assert_eq!(until_closed(&mut first).await, [0xE0, 0x01, 0x8E]);
}

fn subscribe_packet(level: u8, filters: &[(&str, u8)]) -> Vec<u8> {
    let mut body = vec![0x00, 0x0A];
    if level == 5 {
        body.push(0);
    }
    for (f, qos) in filters {
        body.extend_from_slice(&(f.len() as u16).to_be_bytes());
        body.extend_from_slice(f.as_bytes());
        body.push(*qos);
    }
    let mut p = vec![0x82, body.len() as u8];
    p.extend(body);
    p
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_filters_refused_in_suback_valid_ones_granted() {
    let b = start().await;
    // v3: 0x80 for each refused filter; v5: 0x8F (topic filter invalid).
    for (level, refused) in [(4u8, 0x80u8), (5, 0x8F)] {
        let mut s = open(&b, level, "filters", 60).await;
        s.write_all(&subscribe_packet(
            level,
            &[("a/#/b", 1), ("ok/+", 1), ("x+", 0), ("$share/g", 1)],
        ))
        .await
        .expect("write");
        let mut head = [0u8; 2];
        tokio::time::timeout(WAIT, s.read_exact(&mut head))
            .await
            .expect("SUBACK in time")
            .expect("read");
        assert_eq!(head[0], 0x90);
        let mut rest = vec![0u8; usize::from(head[1])];
        warren_tests::bounded_as("bytes from the broker", s.read_exact(&mut rest))
            .await
            .expect("read");
        assert_eq!(&rest[..2], [0x00, 0x0A], "packet id");
        let codes = if level == 5 {
            assert_eq!(rest[2], 0, "no SUBACK properties");
            &rest[3..]
        } else {
            &rest[2..]
        };
        assert_eq!(codes, [refused, 0x01, refused, refused], "level {level}");
        ping(&mut s).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn packets_pipelined_behind_connect_are_handled() {
    let b = start().await;
    let mut s = warren_tests::bounded_as("TCP connect", TcpStream::connect(b.mqtt))
        .await
        .expect("connect");
    let mut bytes = connect_packet(4, "eager", 60);
    bytes.extend(subscribe_packet(4, &[("eager/t", 0)]));
    bytes.extend([0x30, 0x0A, 0x00, 0x07]);
    bytes.extend(b"eager/t");
    bytes.push(b'!');
    s.write_all(&bytes).await.expect("write");
    // CONNACK, SUBACK, then our own message back.
    let want = [
        0x20, 0x02, 0x00, 0x00, 0x90, 0x03, 0x00, 0x0A, 0x00, 0x30, 0x0A, 0x00, 0x07, b'e', b'a',
        b'g', b'e', b'r', b'/', b't', b'!',
    ];
    let mut got = vec![0u8; want.len()];
    tokio::time::timeout(WAIT, s.read_exact(&mut got))
        .await
        .expect("answers in time")
        .expect("read");
    assert_eq!(got, want);
}

/// A v5 QoS 2 PUBLISH of `topic` with packet id `id` and a one-byte payload.
fn publish_qos2(topic: &str, id: u16) -> Vec<u8> {
    let mut body = Vec::new();
    body.extend_from_slice(&(topic.len() as u16).to_be_bytes());
    body.extend_from_slice(topic.as_bytes());
    body.extend_from_slice(&id.to_be_bytes());
    body.push(0); // no properties
    body.push(b'x');
    let mut p = vec![0x34, body.len() as u8];
    p.extend(body);
    p
}

/// MQTT 5 §3.3.4: a client over Receive Maximum gets DISCONNECT 0x93, also when it keeps
/// answering the server's PUBRECs with PUBRELs meanwhile (paho's interoperability test
/// `test_flow_control2`). The server reads and drops what arrives after its DISCONNECT before
/// it closes: a closed socket answers arriving bytes with a reset, and the client's next
/// write failed ("broken pipe") before it had read the reason code.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_receive_maximum_the_disconnect_arrives_while_the_client_still_sends() {
    let receive_max: u16 = 10;
    let b = warren_tests::mqtt::start_with(warren_mqtt::MqttConfig {
        max_inflight: receive_max,
        ..Default::default()
    })
    .await;
    let mut s = open(&b, 5, "over-receive-max", 60).await;
    let mut burst = Vec::new();
    for id in 1..=receive_max {
        burst.extend(publish_qos2("linger/t", id));
    }
    s.write_all(&burst).await.expect("write");
    // The server answers those with PUBRECs before the one over the maximum arrives.
    tokio::time::sleep(Duration::from_millis(200)).await;
    s.write_all(&publish_qos2("linger/t", receive_max + 1))
        .await
        .expect("write");
    // Read packet by packet, answering each PUBREC with its PUBREL at once, as a client does
    // that has not read far enough to see the DISCONNECT yet.
    let mut buf = Vec::new();
    // Small reads: the client has unread packets when its first PUBREL goes out.
    let mut chunk = [0u8; 4];
    let disconnect = tokio::time::timeout(WAIT, async {
        loop {
            while buf.len() >= 2 && buf.len() >= 2 + buf[1] as usize {
                let packet: Vec<u8> = buf.drain(..2 + buf[1] as usize).collect();
                match packet[0] {
                    0x50 => {
                        // Slow enough that the server has closed before the later PUBRELs.
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        s.write_all(&[0x62, 0x02, packet[2], packet[3]])
                            .await
                            .expect("a PUBREL before the DISCONNECT was read is not refused");
                    }
                    0xE0 => return packet,
                    other => panic!("unexpected packet type {other:#x}"),
                }
            }
            let n = s
                .read(&mut chunk)
                .await
                .expect("the server's packets, not a reset, before its DISCONNECT");
            assert!(n > 0, "closed before a DISCONNECT");
            buf.extend_from_slice(&chunk[..n]);
        }
    })
    .await
    .expect("DISCONNECT in time");
    assert_eq!(
        disconnect,
        [0xE0, 0x01, 0x93],
        "DISCONNECT Receive Maximum exceeded"
    );
}
