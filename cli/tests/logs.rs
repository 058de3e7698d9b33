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
    mqtt_connect_as(port, client_id, user, "wrong");
}

/// An MQTT 3.1.1 CONNECT with `client_id`, `user` and `password`.
fn mqtt_connect_as(port: u16, client_id: &str, user: &str, password: &str) {
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
    field(&mut body, password.as_bytes());
    let mut packet = vec![0x10, body.len() as u8];
    packet.extend(body);
    s.write_all(&packet).expect("write");
    read_a_while(&mut s);
}

/// The broker's log once `done` holds of it (or after 10 s); the broker is stopped and its
/// data dir removed.
fn log_once(
    served: common::Served,
    dir: &std::path::Path,
    done: impl Fn(&[String]) -> bool,
) -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let log = loop {
        let log = served.log.lock().expect("log").clone();
        if done(&log) || Instant::now() > deadline {
            break log;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut child = served.child;
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(dir);
    log
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
        ("login refused", "user=\"evil\\nFAKE LOG LINE\""),
        ("connection.open refused", "evil\\nFAKE LOG LINE"),
        ("MQTT login refused", "client_id=\"evil\\nFAKE LOG LINE\""),
        ("exchange type", "'evil\\nFAKE LOG LINE'"),
    ];
    let logged = |log: &[String], (what, escaped): (&str, &str)| {
        log.iter().any(|l| l.contains(what) && l.contains(escaped))
    };
    let log = log_once(served, &dir, |log| expected.iter().all(|e| logged(log, *e)));
    let forged: Vec<&String> = log.iter().filter(|l| l.starts_with("FAKE")).collect();
    assert!(
        forged.is_empty(),
        "forged log lines: {forged:?}\nlog: {log:#?}"
    );
    for e in expected {
        assert!(logged(&log, e), "not logged escaped: {e:?}\nlog: {log:#?}");
    }
}

/// The `key=value` fields a text log line shows, as logfmt reads them: split at spaces
/// outside double quotes (a backslash escapes the next character inside them).
fn fields(line: &str) -> Vec<String> {
    let (mut out, mut cur) = (Vec::new(), String::new());
    let (mut quoted, mut escaped) = (false, false);
    for c in line.chars() {
        if escaped {
            escaped = false;
        } else if quoted && c == '\\' {
            escaped = true;
        } else if c == '"' {
            quoted = !quoted;
        } else if c == ' ' && !quoted {
            out.push(std::mem::take(&mut cur));
            continue;
        }
        cur.push(c);
    }
    out.push(cur);
    out.into_iter().filter(|f| f.contains('=')).collect()
}

/// A client string with spaces and `=` forges no `key=value` field of its own: an MQTT
/// client id `x peer=10.9.9.9:1 user=admin` (accepted, then gone), an AMQP user name and
/// vhost, an MQTT topic refused by its permissions. Each is logged quoted, as one field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_strings_cannot_forge_log_fields() {
    const FORGED: &str = "x peer=10.9.9.9:1 user=admin";
    let dir = common::scratch_dir("logs", "fields");
    let served = common::serve_logging(&dir, true, &["--in-memory"], "debug");
    let (amqp, mqtt) = (served.amqp, served.mqtt.expect("MQTT port"));
    mqtt_connect_as(mqtt, FORGED, "guest", "guest");
    mqtt_connect(mqtt, "y user=admin", FORGED);
    amqp_login(amqp, FORGED, "x", "/");
    amqp_login(amqp, "guest", "guest", "v vhost=evil");
    let quoted = format!("\"{FORGED}\"");
    let expected = [
        ("accepted MQTT connection", format!("client_id={quoted}")),
        (
            "MQTT login refused",
            "client_id=\"y user=admin\"".to_string(),
        ),
        ("login refused", format!("user={quoted}")),
        ("connection.open refused", "v vhost=evil".to_string()),
    ];
    let logged = |log: &[String], (what, shown): &(&str, String)| {
        log.iter()
            .any(|l| l.contains(what) && l.contains(shown.as_str()))
    };
    let log = log_once(served, &dir, |log| expected.iter().all(|e| logged(log, e)));
    for e in &expected {
        assert!(logged(&log, e), "not logged quoted: {e:?}\nlog: {log:#?}");
    }
    let forged: Vec<(&String, String)> = log
        .iter()
        .flat_map(|l| fields(l).into_iter().map(move |f| (l, f)))
        .filter(|(_, f)| ["peer=10.9.9.9:1", "user=admin", "vhost=evil"].contains(&f.as_str()))
        .collect();
    assert!(forged.is_empty(), "forged fields: {forged:#?}");
}
