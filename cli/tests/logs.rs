//! Client strings never forge log lines: a newline in an AMQP user name (logged before it
//! authenticates), vhost or exchange type, or in an MQTT client id or user name, is logged
//! escaped, inside the line that reports it.

mod common;

use amq_protocol::frame::AMQPFrame;
use amq_protocol::protocol::{AMQPClass, connection};
use amq_protocol::types::{FieldTable, LongString};
use bytes::BytesMut;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

const EVIL: &str = "evil\nFAKE LOG LINE";

fn send(s: &mut TcpStream, method: AMQPClass) {
    let mut b = BytesMut::new();
    warren_amqp::codec::encode_frame(&mut b, &AMQPFrame::Method(0, method));
    // The server may have closed already (a refused login): what it logged is the point.
    let _ = s.write_all(&b);
}

/// Reads what the server sends within a moment (its frames are not needed, only its log).
fn read_a_while(s: &mut TcpStream) {
    s.set_read_timeout(Some(Duration::from_millis(300)))
        .expect("timeout");
    let mut buf = [0u8; 4096];
    let _ = s.read(&mut buf);
}

/// An AMQP handshake as `user`/`password`, opening `vhost`, by hand (clients would not
/// send these names).
fn amqp_login(port: u16, user: &str, password: &str, vhost: &str) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    s.write_all(warren_amqp::codec::PROTOCOL_HEADER)
        .expect("header");
    read_a_while(&mut s);
    send(
        &mut s,
        AMQPClass::Connection(connection::AMQPMethod::StartOk(connection::StartOk {
            client_properties: FieldTable::default(),
            mechanism: "PLAIN".into(),
            response: LongString::from(format!("\0{user}\0{password}")),
            locale: "en_US".into(),
        })),
    );
    read_a_while(&mut s);
    send(
        &mut s,
        AMQPClass::Connection(connection::AMQPMethod::TuneOk(connection::TuneOk {
            channel_max: 0,
            frame_max: 131_072,
            heartbeat: 0,
        })),
    );
    send(
        &mut s,
        AMQPClass::Connection(connection::AMQPMethod::Open(connection::Open {
            virtual_host: vhost.into(),
        })),
    );
    read_a_while(&mut s);
}

/// An MQTT 3.1.1 CONNECT with `client_id`, user `user` and a wrong password.
fn mqtt_connect(port: u16, client_id: &str, user: &str) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    let field = |out: &mut Vec<u8>, v: &[u8]| {
        out.extend_from_slice(&(v.len() as u16).to_be_bytes());
        out.extend_from_slice(v);
    };
    let mut body = Vec::new();
    field(&mut body, b"MQTT");
    body.extend_from_slice(&[4, 0xC2, 0, 60]);
    field(&mut body, client_id.as_bytes());
    field(&mut body, user.as_bytes());
    field(&mut body, b"wrong");
    let mut packet = vec![0x10, body.len() as u8];
    packet.extend(body);
    s.write_all(&packet).expect("write");
    read_a_while(&mut s);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_strings_cannot_forge_log_lines() {
    let dir = std::env::temp_dir().join(format!("warren-logs-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let served = common::serve_logging(&dir, true, &["--in-memory"], "debug");
    let (amqp, mqtt) = (served.amqp, served.mqtt.expect("MQTT port"));
    // Refused before authentication, by user name; refused at connection.open, by vhost.
    amqp_login(amqp, EVIL, "x", "/");
    amqp_login(amqp, "guest", "guest", EVIL);
    // An exchange type no broker has.
    let uri = format!("amqp://guest:guest@127.0.0.1:{amqp}/%2f");
    let conn = common::bounded_as(
        "connection.open-ok",
        lapin::Connection::connect(&uri, Default::default()),
    )
    .await
    .expect("connect");
    let ch = common::bounded_as("channel.open-ok", conn.create_channel())
        .await
        .expect("channel");
    let refused = common::bounded_as(
        "exchange.declare answer",
        ch.exchange_declare(
            "x".into(),
            lapin::ExchangeKind::Custom(EVIL.into()),
            Default::default(),
            Default::default(),
        ),
    )
    .await;
    assert!(refused.is_err(), "an unknown exchange type is refused");
    // MQTT: a client id and a user name, refused at login.
    mqtt_connect(mqtt, EVIL, EVIL);
    // Each refusal is logged, with the name escaped, on the line that reports it (the
    // exchange type's once the connection it closed has ended).
    let expected = [
        ("login refused", "user=evil\\nFAKE LOG LINE"),
        ("connection.open refused", "evil\\nFAKE LOG LINE"),
        ("MQTT login refused", "client_id=evil\\nFAKE LOG LINE"),
        ("exchange type", "'evil\\nFAKE LOG LINE'"),
    ];
    let logged = |log: &[String], (what, escaped): (&str, &str)| {
        log.iter().any(|l| l.contains(what) && l.contains(escaped))
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    let log = loop {
        let log = served.log.lock().expect("log").clone();
        if expected.iter().all(|e| logged(&log, *e)) || Instant::now() > deadline {
            break log;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut child = served.child;
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&dir);
    let forged: Vec<&String> = log.iter().filter(|l| l.starts_with("FAKE")).collect();
    assert!(
        forged.is_empty(),
        "forged log lines: {forged:?}\nlog: {log:#?}"
    );
    for e in expected {
        assert!(logged(&log, e), "not logged escaped: {e:?}\nlog: {log:#?}");
    }
}
