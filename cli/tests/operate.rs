//! `warren ctl` as an operator uses it, against a real `warren serve` with real clients:
//! connections with peer, protocol, user and client id (AMQP and MQTT), channels, closing a
//! connection with a reason, status and ping, column selection, rabbitmqctl's underscore
//! spellings, an unknown vhost as an error, and the memory watermark set at run time.

mod common;

use common::{Broker, eventually, mqtt_connect};

use serde_json::Value;
use std::io::{Read, Write};
use std::process::Command;
use std::time::{Duration, Instant};

fn start(tag: &str) -> Broker {
    Broker::start("operate", tag, &["--management", "127.0.0.1:0"])
}

/// `warren ctl ARGS`: (success, stdout, stderr).
fn ctl(b: &Broker, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(common::BIN)
        .arg("ctl")
        .arg("--data-dir")
        .arg(&b.dir)
        .args(args)
        .output()
        .expect("run warren ctl");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn ok(b: &Broker, args: &[&str]) -> String {
    let (success, out, err) = ctl(b, args);
    assert!(success, "warren ctl {args:?} failed: {err}");
    out
}

fn json(b: &Broker, args: &[&str]) -> Value {
    let mut all = vec!["--format", "json"];
    all.extend_from_slice(args);
    serde_json::from_str(&ok(b, &all)).expect("JSON output")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_sees_and_closes_connections_and_channels() {
    use lapin::options::*;
    let b = start("conns");
    let uri = format!("amqp://guest:guest@127.0.0.1:{}/%2f", b.served.amqp);
    let c = common::bounded_as(
        "connection.open-ok",
        lapin::Connection::connect(
            &uri,
            lapin::ConnectionProperties::default().with_connection_name("orders-api".into()),
        ),
    )
    .await
    .expect("connect");
    let ch = common::bounded_as("channel.open-ok", c.create_channel())
        .await
        .unwrap();
    common::bounded_as("basic.qos-ok", ch.basic_qos(10, BasicQosOptions::default()))
        .await
        .unwrap();
    let _mqtt = mqtt_connect(b.served.mqtt.expect("MQTT port"), "thermostat-3");

    let conns = eventually("two connections listed", || {
        let conns = json(&b, &["list-connections"]);
        (conns.as_array().map(Vec::len) == Some(2)).then_some(conns)
    });
    let amqp = conns
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["protocol"] == "AMQP 0-9-1")
        .expect("the AMQP connection");
    assert_eq!(amqp["user"], "guest");
    assert_eq!(amqp["client_name"], "orders-api");
    assert_eq!(amqp["channels"], 1);
    assert!(
        amqp["peer"].as_str().unwrap().starts_with("127.0.0.1:"),
        "{amqp}"
    );
    let mqtt = conns
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["protocol"] == "MQTT 3.1.1")
        .expect("the MQTT connection");
    assert_eq!(mqtt["client_id"], "thermostat-3");
    // The table shows them too, under the underscore spelling as well.
    let table = ok(&b, &["list_connections"]);
    let header: Vec<&str> = table.lines().next().unwrap().split_whitespace().collect();
    assert_eq!(
        header,
        [
            "id",
            "peer",
            "protocol",
            "user",
            "vhost",
            "client_id",
            "ssl",
            "channels",
            "state"
        ]
    );
    assert!(
        table.contains("thermostat-3") && table.contains("AMQP 0-9-1"),
        "{table}"
    );
    // Channels, and only the columns asked for.
    let channels = ok(&b, &["list_channels", "connection", "prefetch_count"]);
    let id = amqp["id"].as_u64().unwrap();
    assert!(
        channels
            .lines()
            .any(|l| l.split_whitespace().collect::<Vec<_>>() == [id.to_string(), "10".into()]),
        "{channels}"
    );
    let (success, _, err) = ctl(&b, &["list_channels", "connection", "bogus"]);
    assert!(!success && err.contains("unknown column(s) bogus"), "{err}");

    // close_connection ID REASON: the client gets 320 with the reason.
    let (tx, rx) = std::sync::mpsc::channel();
    let mut events = c.events_listener();
    tokio::spawn(async move {
        use futures_lite::StreamExt;
        while let Some(e) = events.next().await {
            if let lapin::Event::Error(e) = e {
                let _ = tx.send(e.to_string());
            }
        }
    });
    let out = ok(
        &b,
        &["close_connection", &id.to_string(), "moving to a new host"],
    );
    assert!(out.contains(&format!("Closed connection {id}")), "{out}");
    let error = rx
        .recv_timeout(Duration::from_secs(5))
        .expect("the client is told");
    assert!(
        error.contains("CONNECTION_FORCED") && error.contains("moving to a new host"),
        "{error}"
    );
    let (success, _, err) = ctl(&b, &["close-connection", "999999", "x"]);
    assert!(
        !success && err.contains("no connection with id 999999"),
        "{err}"
    );
}

#[test]
fn status_ping_columns_unknown_vhosts_and_the_watermark() {
    let b = start("status");
    assert_eq!(ok(&b, &["ping"]).trim(), "Ping succeeded");
    let status = ok(&b, &["status"]);
    for want in [
        "Version",
        "Uptime (seconds)",
        "Memory alarm at",
        "Alarms                (none)",
        "Disk free (bytes)",
        &format!("Listener              127.0.0.1:{} (amqp)", b.served.amqp),
    ] {
        assert!(status.contains(want), "no {want:?} in:\n{status}");
    }
    // Column selection, rabbitmqctl style.
    let api = b.served.management.expect("HTTP API port");
    let put = |path: &str| {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", api)).unwrap();
        // Bounded: an answer that never ends leaves `out` short and the assert names it.
        s.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("read timeout");
        let req = format!(
            "PUT {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Basic Z3Vlc3Q6Z3Vlc3Q=\r\n\
             Content-Type: application/json\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{{}}"
        );
        s.write_all(req.as_bytes()).unwrap();
        let mut out = String::new();
        let _ = s.read_to_string(&mut out);
        out
    };
    assert!(put("/api/queues/%2F/jobs").starts_with("HTTP/1.1 201"));
    let table = ok(
        &b,
        &[
            "list_queues",
            "name",
            "messages_ready",
            "messages_unacknowledged",
        ],
    );
    assert_eq!(
        table,
        "name  messages_ready  messages_unacknowledged\njobs               0                        0\n"
    );
    // An unknown vhost is an error, not an empty table.
    let (success, _, err) = ctl(&b, &["-p", "nope", "list_queues"]);
    assert!(!success, "an unknown vhost fails");
    assert!(err.contains("Virtual host 'nope' does not exist"), "{err}");
    // The watermark at run time: below what is held raises the alarm, then clears.
    let mut s = std::net::TcpStream::connect(("127.0.0.1", api)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("read timeout");
    let body = r#"{"routing_key":"jobs","payload":"0123456789","payload_encoding":"string","properties":{}}"#;
    let req = format!(
        "POST /api/exchanges/%2F/amq.default/publish HTTP/1.1\r\nHost: x\r\n\
         Authorization: Basic Z3Vlc3Q6Z3Vlc3Q=\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    assert!(out.contains("\"routed\":true"), "{out}");
    let set = ok(&b, &["set_vm_memory_high_watermark", "absolute", "5"]);
    assert!(set.contains("5 bytes"), "{set}");
    assert!(ok(&b, &["status"]).contains("Alarms                memory"));
    ok(&b, &["set-vm-memory-high-watermark", "0.4"]);
    // The alarm clears once held its minimum time (ALARM_HOLD_MS).
    let deadline = Instant::now() + Duration::from_secs(10);
    while !ok(&b, &["status"]).contains("Alarms                (none)") {
        assert!(Instant::now() < deadline, "the alarm did not clear");
        std::thread::sleep(Duration::from_millis(100));
    }
    let (success, _, err) = ctl(&b, &["set-vm-memory-high-watermark", "lots"]);
    assert!(
        !success && err.contains("is not a fraction of RAM"),
        "{err}"
    );
}
