//! `warren ctl` against a real `warren serve`: import of a definitions file exported from
//! RabbitMQ 3.10.8 (tests/fixtures), listings in table and JSON form, purge, delete, export
//! (which imports back), and errors that say what to do.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output};
use std::time::{Duration, Instant};

mod common;

use common::BIN;

struct Broker {
    child: Child,
    dir: PathBuf,
    port: u16,
    mqtt_port: u16,
}

impl Drop for Broker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn start(tag: &str) -> Broker {
    let dir = std::env::temp_dir().join(format!("warren-ctl-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    start_in(dir)
}

/// Starts `warren serve` (AMQP and MQTT on free ports) on `dir`, keeping what is there.
fn start_in(dir: PathBuf) -> Broker {
    let served = common::serve(&dir, true, &[]);
    Broker {
        child: served.child,
        dir,
        port: served.amqp,
        mqtt_port: served.mqtt.expect("MQTT port"),
    }
}

fn ctl(b: &Broker, args: &[&str]) -> Output {
    Command::new(BIN)
        .arg("ctl")
        .arg("--data-dir")
        .arg(&b.dir)
        .args(args)
        .output()
        .expect("run warren ctl")
}

fn ok(b: &Broker, args: &[&str]) -> String {
    let out = ctl(b, args);
    assert!(
        out.status.success(),
        "warren ctl {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn json(b: &Broker, args: &[&str]) -> Value {
    let mut all = vec!["--format", "json"];
    all.extend_from_slice(args);
    serde_json::from_str(&ok(b, &all)).expect("JSON output")
}

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/rabbitmq-3.10.8-definitions.json")
}

fn find<'a>(rows: &'a Value, key: &str, name: &str) -> &'a Value {
    rows.as_array()
        .and_then(|r| r.iter().find(|row| row[key] == name))
        .unwrap_or_else(|| panic!("no {name} in {rows}"))
}

async fn publish(port: u16, exchange: &str, key: &str, n: usize) {
    let uri = format!("amqp://guest:guest@127.0.0.1:{port}/%2f");
    let conn = tokio::time::timeout(
        Duration::from_secs(5),
        lapin::Connection::connect(&uri, lapin::ConnectionProperties::default()),
    )
    .await
    .expect("connect in time")
    .expect("connect");
    let ch = common::bounded_as("channel.open-ok", conn.create_channel())
        .await
        .expect("channel");
    common::bounded_as("confirm.select-ok", ch.confirm_select(Default::default()))
        .await
        .expect("confirms");
    for i in 0..n {
        common::bounded_as(
            "publisher confirm",
            common::bounded_as(
                "basic.publish sent (held while the connection is blocked)",
                ch.basic_publish(
                    exchange.into(),
                    key.into(),
                    Default::default(),
                    format!("m{i}").as_bytes(),
                    lapin::BasicProperties::default().with_delivery_mode(2),
                ),
            )
            .await
            .expect("publish"),
        )
        .await
        .expect("confirm");
    }
    // Stays open while the caller looks at list_connections.
    std::mem::forget(conn);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctl_imports_rabbitmq_definitions_lists_purges_deletes_and_exports() {
    let b = start("main");
    let out = ok(
        &b,
        &[
            "import-definitions",
            fixture().to_str().expect("utf-8 path"),
        ],
    );
    assert!(out.contains("Imported"), "{out}");
    assert!(
        out.contains("1 vhosts, 1 users, 1 permissions") && !out.contains("skipped"),
        "{out}"
    );

    let queues = json(&b, &["list-queues"]);
    let created = find(&queues, "name", "orders.created");
    assert_eq!(created["durable"], true);
    assert_eq!(created["arguments"]["x-dead-letter-exchange"], "orders.dlx");
    assert_eq!(created["arguments"]["x-max-length"], 10000);
    assert_eq!(
        find(&queues, "name", "jobs")["arguments"]["x-max-priority"],
        10
    );

    let bindings = json(&b, &["list-bindings"]);
    let e2e = find(&bindings, "destination_name", "audit");
    assert_eq!(
        (
            e2e["source_name"].as_str(),
            e2e["destination_kind"].as_str()
        ),
        (Some("orders"), Some("exchange"))
    );
    let exchanges = ok(&b, &["list-exchanges"]);
    assert!(
        exchanges
            .lines()
            .any(|l| l.starts_with("orders ") && l.contains("topic")),
        "{exchanges}"
    );

    publish(b.port, "orders", "order.created.eu", 3).await;
    let table = ok(&b, &["list-queues"]);
    let row = table
        .lines()
        .find(|l| l.starts_with("orders.created "))
        .unwrap_or_else(|| panic!("{table}"));
    let cols: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(cols[..3], ["orders.created", "3", "0"], "{table}");
    assert!(
        table
            .lines()
            .next()
            .is_some_and(|h| h.split_whitespace().collect::<Vec<_>>()
                == ["name", "messages", "consumers", "memory"])
    );

    let conns = json(&b, &["list-connections"]);
    assert_eq!(conns[0]["user"], "guest", "{conns}");

    assert_eq!(
        ok(&b, &["purge-queue", "orders.created"]).trim(),
        "Purged 3 messages from queue 'orders.created'"
    );
    assert_eq!(
        find(&json(&b, &["list-queues"]), "name", "orders.created")["messages"],
        0
    );

    let exported = json(&b, &["export-definitions", "-"]);
    let names: Vec<&str> = exported["queues"]
        .as_array()
        .expect("queues")
        .iter()
        .filter_map(|q| q["name"].as_str())
        .collect();
    assert!(
        names.contains(&"orders.created") && names.contains(&"jobs"),
        "{names:?}"
    );
    assert_eq!(exported["bindings"].as_array().map(Vec::len), Some(5));

    // A policy caps the existing queue at once; list, then clear it.
    publish(b.port, "orders", "order.created.us", 4).await;
    publish(b.port, "orders.dlx", "", 4).await;
    let set = ok(
        &b,
        &[
            "set-policy",
            "cap",
            "^orders\\.",
            r#"{"max-length": 2}"#,
            "--apply-to",
            "queues",
            "--priority",
            "1",
        ],
    );
    assert_eq!(set.trim(), "Set policy 'cap' for pattern '^orders\\.'");
    let queues = json(&b, &["list-queues"]);
    assert_eq!(
        find(&queues, "name", "orders.dead")["messages"],
        2,
        "capped at once"
    );
    assert_eq!(
        find(&queues, "name", "orders.created")["messages"],
        4,
        "its own x-max-length (10000) wins"
    );
    let policies = json(&b, &["list-policies"]);
    assert_eq!(
        find(&policies, "name", "cap")["definition"]["max-length"],
        2
    );
    assert_eq!(
        json(&b, &["export-definitions", "-"])["policies"][0]["apply-to"],
        "queues"
    );
    let bad = ctl(&b, &["set-policy", "bad", ".*", r#"{"max-lenght": 1}"#]);
    assert!(String::from_utf8_lossy(&bad.stderr).contains("unrecognised policy key 'max-lenght'"));
    ok(&b, &["clear-policy", "cap"]);
    let left: Vec<Value> = json(&b, &["list-policies"])
        .as_array()
        .expect("rows")
        .iter()
        .map(|p| p["name"].clone())
        .collect();
    assert_eq!(
        left,
        ["mqtt-offline-limit"],
        "only the broker's own MQTT policy remains"
    );

    ok(&b, &["delete-queue", "jobs"]);
    let missing = ctl(&b, &["delete-queue", "jobs"]);
    assert!(!missing.status.success());
    assert!(String::from_utf8_lossy(&missing.stderr).contains("NOT_FOUND - no queue 'jobs'"));

    // What we export, a fresh broker imports.
    let path = b.dir.join("exported.json");
    std::fs::write(&path, exported.to_string()).expect("write export");
    let fresh = start("fresh");
    ok(
        &fresh,
        &["import-definitions", path.to_str().expect("utf-8 path")],
    );
    assert_eq!(
        json(&fresh, &["list-bindings"]).as_array().map(Vec::len),
        Some(5)
    );
}

/// Connects over AMQP as `user` to `vhost`; the broker's reply code on refusal.
async fn amqp_login(
    port: u16,
    user: &str,
    password: &str,
    vhost: &str,
) -> Result<lapin::Connection, u16> {
    let vhost = vhost.replace('/', "%2f");
    let uri = format!("amqp://{user}:{password}@127.0.0.1:{port}/{vhost}");
    let connect = lapin::Connection::connect(&uri, lapin::ConnectionProperties::default());
    match tokio::time::timeout(Duration::from_secs(10), connect).await {
        Ok(Ok(c)) => Ok(c),
        Ok(Err(e)) => match e.kind() {
            lapin::ErrorKind::ProtocolError(p) => Err(p.get_id()),
            // lapin reports a refused login (connection.close 403 after start-ok) this way.
            lapin::ErrorKind::InvalidConnectionState(_) | lapin::ErrorKind::IOError(_) => Err(0),
            other => panic!("unexpected error {other:?}"),
        },
        Err(_) => panic!("no answer to the login within 10 s"),
    }
}

async fn declare(conn: &lapin::Connection, queue: &str) -> Result<(), u16> {
    let ch = common::bounded_as("channel.open-ok", conn.create_channel())
        .await
        .expect("channel");
    common::bounded_as(
        "queue.declare answer",
        ch.queue_declare(
            queue.into(),
            lapin::options::QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            lapin::types::FieldTable::default(),
        ),
    )
    .await
    .map(|_| ())
    .map_err(|e| match e.kind() {
        lapin::ErrorKind::ProtocolError(p) => p.get_id(),
        other => panic!("unexpected error {other:?}"),
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctl_users_vhosts_and_permissions_apply_at_once_and_survive_sigkill() {
    let b = start("users");
    ok(&b, &["add-vhost", "dev", "--description", "development"]);
    ok(&b, &["add-user", "bob", "s3cret"]);
    ok(&b, &["set-user-tags", "bob", "monitoring", "management"]);
    ok(
        &b,
        &["-p", "dev", "set-permissions", "bob", "^bob-.*", ".*", ".*"],
    );
    let dup = ctl(&b, &["add-user", "bob", "x"]);
    assert!(!dup.status.success());
    assert!(String::from_utf8_lossy(&dup.stderr).contains("already exists"));

    let users = json(&b, &["list-users"]);
    assert_eq!(
        find(&users, "user", "bob")["tags"],
        serde_json::json!(["monitoring", "management"])
    );
    assert_eq!(
        find(&users, "user", "guest")["tags"],
        serde_json::json!(["administrator"])
    );
    let perms = json(&b, &["-p", "dev", "list-permissions"]);
    assert_eq!(find(&perms, "user", "bob")["configure"], "^bob-.*");
    let vhosts = json(&b, &["list-vhosts"]);
    assert_eq!(find(&vhosts, "name", "dev")["description"], "development");

    // Permissions: bob may configure only bob-* in dev, and may not open /.
    let bob = amqp_login(b.port, "bob", "s3cret", "dev")
        .await
        .expect("bob logs in to dev");
    assert_eq!(declare(&bob, "bob-work").await, Ok(()));
    assert_eq!(declare(&bob, "alice-work").await, Err(403));
    assert_eq!(
        amqp_login(b.port, "bob", "s3cret", "/").await.err(),
        Some(530)
    );
    assert!(amqp_login(b.port, "bob", "wrong", "dev").await.is_err());
    // The queue lives in dev only.
    let in_dev = json(&b, &["-p", "dev", "list-queues"]);
    find(&in_dev, "name", "bob-work");
    assert!(
        json(&b, &["list-queues"])
            .as_array()
            .is_some_and(|q| q.iter().all(|q| q["name"] != "bob-work"))
    );

    // A change of permissions applies to the open connection at once.
    ok(
        &b,
        &["-p", "dev", "set-permissions", "bob", ".*", ".*", ".*"],
    );
    assert_eq!(declare(&bob, "alice-work").await, Ok(()));

    // Everything survives kill -9.
    drop(bob);
    let dir = b.dir.clone();
    let mut b = b;
    let _ = b.child.kill();
    let _ = b.child.wait();
    std::mem::forget(b);
    let b = start_in(dir);
    let bob = amqp_login(b.port, "bob", "s3cret", "dev")
        .await
        .expect("bob after restart");
    assert_eq!(declare(&bob, "alice-work").await, Ok(()));
    find(&json(&b, &["-p", "dev", "list-queues"]), "name", "bob-work");
    drop(bob);

    // A new password replaces the old; deleting the user closes its connections.
    ok(&b, &["change-password", "bob", "n3w"]);
    assert!(amqp_login(b.port, "bob", "s3cret", "dev").await.is_err());
    let bob = amqp_login(b.port, "bob", "n3w", "dev")
        .await
        .expect("new password");
    let exported = json(&b, &["export-definitions", "-"]);
    let user = find(&exported["users"], "name", "bob");
    assert_eq!(user["hashing_algorithm"], "rabbit_password_hashing_sha256");
    assert!(exported["vhosts"].as_array().is_some_and(|v| v.len() == 2));
    ok(&b, &["delete-user", "bob"]);
    let deadline = Instant::now() + Duration::from_secs(5);
    while bob.status().connected() {
        assert!(
            Instant::now() < deadline,
            "a deleted user's connection stays open"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        json(&b, &["list-users"])
            .as_array()
            .is_some_and(|u| u.iter().all(|u| u["user"] != "bob"))
    );
    ok(&b, &["delete-vhost", "dev"]);
    let vhosts = json(&b, &["list-vhosts"]);
    assert_eq!(vhosts.as_array().map(Vec::len), Some(1), "{vhosts}");
}

#[test]
fn ctl_without_a_broker_says_what_to_do() {
    let started = Instant::now();
    let out = Command::new(BIN)
        .args(["ctl", "--data-dir", "/nonexistent/warren", "list-queues"])
        .output()
        .expect("run");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("is `warren serve --data-dir /nonexistent/warren` running?"),
        "{err}"
    );
    assert!(started.elapsed() < Duration::from_secs(5));
}

/// An MQTT 3.1.1 packet: fixed-header byte, remaining length, body.
fn mqtt_packet(first: u8, body: &[u8]) -> Vec<u8> {
    let mut out = vec![first];
    let mut len = body.len();
    loop {
        let mut byte = (len % 128) as u8;
        len /= 128;
        if len > 0 {
            byte |= 0x80;
        }
        out.push(byte);
        if len == 0 {
            break;
        }
    }
    out.extend_from_slice(body);
    out
}

fn mqtt_str(s: &str) -> Vec<u8> {
    let mut out = (s.len() as u16).to_be_bytes().to_vec();
    out.extend_from_slice(s.as_bytes());
    out
}

/// Connects with MQTT 3.1.1 (clean session) and returns the stream after CONNACK.
fn mqtt_connect(port: u16, client: &str) -> std::net::TcpStream {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).expect("MQTT connect");
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let mut body = mqtt_str("MQTT");
    body.extend_from_slice(&[4, 0x02, 0, 60]);
    body.extend(mqtt_str(client));
    s.write_all(&mqtt_packet(0x10, &body)).expect("CONNECT");
    let mut connack = [0u8; 4];
    s.read_exact(&mut connack).expect("CONNACK");
    assert_eq!(connack, [0x20, 2, 0, 0]);
    s
}

/// Reads one QoS 0 PUBLISH: (first byte, topic, payload).
fn mqtt_read_publish(s: &mut std::net::TcpStream) -> (u8, String, Vec<u8>) {
    use std::io::Read;
    let mut head = [0u8; 2];
    s.read_exact(&mut head).expect("a PUBLISH");
    let mut rest = vec![0u8; usize::from(head[1])];
    s.read_exact(&mut rest).expect("its body");
    let topic_len = usize::from(u16::from_be_bytes([rest[0], rest[1]]));
    let topic = String::from_utf8_lossy(&rest[2..2 + topic_len]).into_owned();
    (head[0], topic, rest[2 + topic_len..].to_vec())
}

/// Subscribes to `filter` (QoS 0) and returns the retained messages that follow the SUBACK
/// as (topic, payload), checking nothing else comes.
fn mqtt_retained(port: u16, client: &str, filter: &str) -> Vec<(String, String)> {
    use std::io::{Read, Write};
    let mut sub = mqtt_connect(port, client);
    let mut body = vec![0, 1];
    body.extend(mqtt_str(filter));
    body.push(0);
    sub.write_all(&mqtt_packet(0x82, &body)).expect("SUBSCRIBE");
    let mut suback = [0u8; 5];
    sub.read_exact(&mut suback).expect("SUBACK");
    assert_eq!(suback, [0x90, 3, 0, 1, 0]);
    sub.set_read_timeout(Some(Duration::from_millis(500)))
        .expect("timeout");
    let mut got = Vec::new();
    loop {
        let mut first = [0u8; 1];
        if sub.peek(&mut first).is_err() {
            return got;
        }
        let (kind, topic, payload) = mqtt_read_publish(&mut sub);
        assert_eq!(kind, 0x31, "PUBLISH, QoS 0, retain");
        got.push((topic, String::from_utf8_lossy(&payload).into_owned()));
    }
}

/// Publishes retained QoS 0 messages (an empty payload clears the topic), then waits for a
/// PINGRESP: the broker has handled them.
fn mqtt_retain(port: u16, client: &str, messages: &[(&str, &str)]) {
    use std::io::{Read, Write};
    let mut publisher = mqtt_connect(port, client);
    for (topic, payload) in messages {
        let mut body = mqtt_str(topic);
        body.extend_from_slice(payload.as_bytes());
        publisher
            .write_all(&mqtt_packet(0x31, &body))
            .expect("PUBLISH retain");
    }
    publisher.write_all(&[0xC0, 0]).expect("PINGREQ");
    let mut pong = [0u8; 2];
    publisher.read_exact(&mut pong).expect("PINGRESP");
}

/// Retained messages are the core's, stored through its `Store` with the definitions: they
/// survive a `kill -9` once the sync after them completed, and a SIGTERM right after the
/// publish (the clean stop syncs); a cleared topic stays cleared.
#[test]
fn retained_mqtt_messages_survive_sigkill_and_sigterm() {
    let dir = std::env::temp_dir().join(format!("warren-ctl-retained-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut b = start_in(dir.clone());
    mqtt_retain(
        b.mqtt_port,
        "pub",
        &[
            ("home/kitchen/temp", "21.5"),
            ("home/hall/temp", "19"),
            ("home/hall/temp", ""),
        ],
    );
    // A retained message is durable once the sync after it completed (milliseconds, more
    // on a loaded machine): an operator's change is answered only after the sync that
    // covers it and everything before it, so its answer is the barrier.
    ok(&b, &["add-vhost", "barrier"]);
    b.child.kill().expect("SIGKILL");
    let _ = b.child.wait();
    let mut b2 = start_in(dir.clone());
    assert_eq!(
        mqtt_retained(b2.mqtt_port, "sub", "home/#"),
        [("home/kitchen/temp".to_string(), "21.5".to_string())]
    );
    mqtt_retain(b2.mqtt_port, "pub2", &[("home/garage/temp", "7")]);
    unsafe { libc::kill(b2.child.id() as libc::pid_t, libc::SIGTERM) };
    let status = common::exited(&mut b2.child, Duration::from_secs(30), "SIGTERM");
    assert_eq!(status.code(), Some(0), "a clean stop");
    let b3 = start_in(dir);
    assert_eq!(
        mqtt_retained(b3.mqtt_port, "sub", "home/+/temp"),
        [
            ("home/garage/temp".to_string(), "7".to_string()),
            ("home/kitchen/temp".to_string(), "21.5".to_string())
        ]
    );
    drop(b3);
    drop(b2);
    drop(b);
}

/// `--mqtt-max-retained` bounds the retained messages of a vhost: a retained publish to a
/// new topic beyond it is routed but not retained, and a topic that has one may replace it.
#[test]
fn mqtt_max_retained_bounds_new_topics() {
    let dir = std::env::temp_dir().join(format!("warren-ctl-retained-max-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    // Without the broker's own `$SYS` topics, which are retained too and count.
    let served = common::serve(
        &dir,
        true,
        &["--mqtt-max-retained", "1", "--sys-interval", "0"],
    );
    let b = Broker {
        child: served.child,
        dir,
        port: served.amqp,
        mqtt_port: served.mqtt.expect("MQTT port"),
    };
    mqtt_retain(b.mqtt_port, "pub", &[("a", "1"), ("b", "2"), ("a", "3")]);
    assert_eq!(
        mqtt_retained(b.mqtt_port, "sub", "#"),
        [("a".to_string(), "3".to_string())]
    );
}

/// A RabbitMQ export whose policies mix keys Warren acts on with ones it has no use for
/// (classic mirroring's ha-mode, ha-params, ha-sync-mode): the policies are imported with
/// the keys Warren supports, each dropped key is one warning, a policy left with nothing is
/// skipped, and the summary counts what was imported (it said the policies were imported
/// while none was, and exited 1).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn import_keeps_the_supported_policy_keys_and_warns_once_per_dropped_key() {
    let b = start("ha-policies");
    let export = serde_json::json!({
        "rabbit_version": "3.10.8",
        "rabbitmq_version": "3.10.8",
        "product_name": "RabbitMQ",
        "product_version": "3.10.8",
        "users": [],
        "vhosts": [{"name": "/"}],
        "permissions": [],
        "topic_permissions": [],
        "parameters": [],
        "global_parameters": [
            {"name": "internal_cluster_id", "value": "rabbitmq-cluster-id-abc"}
        ],
        "policies": [
            {"vhost": "/", "name": "ha-all", "pattern": "^orders\\.", "apply-to": "queues",
             "definition": {"ha-mode": "all", "ha-sync-mode": "automatic", "max-length": 100},
             "priority": 0},
            {"vhost": "/", "name": "ha-two", "pattern": ".*", "apply-to": "all",
             "definition": {"ha-mode": "exactly", "ha-params": 2}, "priority": 0},
            {"vhost": "/", "name": "ttl", "pattern": "^jobs$", "apply-to": "queues",
             "definition": {"message-ttl": 60000}, "priority": 1}
        ],
        "queues": [
            {"name": "orders.new", "vhost": "/", "durable": true, "auto_delete": false,
             "arguments": {"x-queue-type": "classic"}}
        ],
        "exchanges": [],
        "bindings": []
    });
    let path = b.dir.join("rabbitmq-ha-export.json");
    std::fs::write(&path, serde_json::to_vec_pretty(&export).expect("json")).expect("write");
    let out = ctl(
        &b,
        &["import-definitions", path.to_str().expect("utf-8 path")],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "import failed: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains(
            "1 vhosts, 0 users, 0 permissions, 0 topic permissions, 2 policies, 0 exchanges, 1 queues"
        ),
        "{stdout}"
    );
    let warnings: Vec<&str> = stdout
        .lines()
        .filter(|l| l.starts_with("skipped:"))
        .collect();
    for key in ["ha-mode", "ha-params", "ha-sync-mode"] {
        let about: Vec<&&str> = warnings
            .iter()
            .filter(|l| l.contains(&format!("'{key}'")))
            .collect();
        assert_eq!(about.len(), 1, "one warning for {key}: {warnings:?}");
    }
    assert!(
        warnings
            .iter()
            .any(|l| l.contains("'ha-mode'") && l.contains("ha-all, ha-two")),
        "{warnings:?}"
    );
    assert!(
        warnings.iter().any(|l| l.contains("policy 'ha-two'")),
        "{warnings:?}"
    );
    let policies = json(&b, &["list-policies"]);
    assert_eq!(
        find(&policies, "name", "ha-all")["definition"],
        serde_json::json!({"max-length": 100})
    );
    assert_eq!(
        find(&policies, "name", "ttl")["definition"]["message-ttl"],
        60000
    );
    assert!(
        policies
            .as_array()
            .expect("rows")
            .iter()
            .all(|p| p["name"] != "ha-two"),
        "{policies}"
    );
    // The imported policy acts: the queue it matches keeps at most 100 messages.
    publish(b.port, "", "orders.new", 120).await;
    let queues = json(&b, &["list-queues"]);
    assert_eq!(find(&queues, "name", "orders.new")["messages"], 100);
}

/// Publishes one message to `amq.topic` with `key` as guest and waits for its confirm; the
/// reply code when the broker closes the channel instead.
async fn topic_publish(port: u16, key: &str) -> Result<(), u16> {
    let conn = amqp_login(port, "guest", "guest", "/")
        .await
        .expect("guest logs in");
    let ch = common::bounded_as("channel.open-ok", conn.create_channel())
        .await
        .expect("channel");
    common::bounded_as("confirm.select-ok", ch.confirm_select(Default::default()))
        .await
        .expect("confirms");
    let sent = async {
        common::bounded_as(
            "publisher confirm",
            common::bounded_as(
                "basic.publish sent (held while the connection is blocked)",
                ch.basic_publish(
                    "amq.topic".into(),
                    key.into(),
                    Default::default(),
                    b"m",
                    lapin::BasicProperties::default(),
                ),
            )
            .await?,
        )
        .await
    };
    match tokio::time::timeout(Duration::from_secs(10), sent).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => match e.kind() {
            lapin::ErrorKind::ProtocolError(p) => Err(p.get_id()),
            other => panic!("unexpected error {other:?}"),
        },
        Err(_) => panic!("no confirm or close within 10 s"),
    }
}

/// Topic permissions through `warren ctl` and the HTTP API, enforced on the wire, kept in the
/// definitions store across SIGTERM and kill -9, and carried by definitions export/import.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn topic_permissions_through_ctl_and_http_survive_restarts_and_export() {
    use common::http::call;
    use serde_json::json;
    let dir = common::scratch_dir("ctl", "topic-perms");
    let api = ["--management", "127.0.0.1:0"];
    let served = common::serve(&dir, true, &api);
    let b = Broker {
        child: served.child,
        dir: dir.clone(),
        port: served.amqp,
        mqtt_port: served.mqtt.expect("MQTT port"),
    };
    let port = served.management.expect("HTTP API port");
    ok(
        &b,
        &[
            "set-topic-permissions",
            "guest",
            "amq.topic",
            "^{username}\\.",
            "^news\\.",
        ],
    );
    let rows = json(&b, &["list-topic-permissions"]);
    let row = find(&rows, "exchange", "amq.topic");
    assert_eq!(
        (&row["user"], &row["write"]),
        (&json!("guest"), &json!("^{username}\\."))
    );
    assert!(ok(&b, &["list-user-topic-permissions", "guest"]).contains("amq.topic"));
    assert_eq!(topic_publish(b.port, "guest.status").await, Ok(()));
    assert_eq!(topic_publish(b.port, "other.status").await, Err(403));

    // The HTTP API: one per exchange, listed three ways, deleted by exchange.
    let put = call(
        port,
        "PUT",
        "/api/topic-permissions/%2F/guest",
        Some(json!({"exchange": "events", "write": "^a", "read": ".*"})),
    );
    assert_eq!(put.status, 201, "{}", put.text());
    let all = call(port, "GET", "/api/topic-permissions", None).json();
    assert_eq!(all.as_array().map(Vec::len), Some(2), "{all}");
    let mine = call(port, "GET", "/api/topic-permissions/%2F/guest", None).json();
    find(&mine, "exchange", "events");
    let by_user = call(port, "GET", "/api/users/guest/topic-permissions", None).json();
    assert_eq!(by_user.as_array().map(Vec::len), Some(2), "{by_user}");
    let by_vhost = call(port, "GET", "/api/vhosts/%2F/topic-permissions", None).json();
    assert_eq!(by_vhost.as_array().map(Vec::len), Some(2), "{by_vhost}");
    let bad = call(
        port,
        "PUT",
        "/api/topic-permissions/%2F/guest",
        Some(json!({"exchange": "events", "write": "(", "read": ".*"})),
    );
    assert_eq!(bad.status, 400, "{}", bad.text());
    let gone = call(
        port,
        "DELETE",
        "/api/topic-permissions/%2F/guest",
        Some(json!({"exchange": "events"})),
    );
    assert_eq!(gone.status, 204, "{}", gone.text());
    let left = call(port, "GET", "/api/topic-permissions/%2F/guest", None).json();
    assert_eq!(left.as_array().map(Vec::len), Some(1), "{left}");
    let exported = json(&b, &["export-definitions", "-"]);
    assert_eq!(
        exported["topic_permissions"],
        json!([{"user": "guest", "vhost": "/", "exchange": "amq.topic",
                "write": "^{username}\\.", "read": "^news\\."}])
    );

    // SIGTERM: kept and enforced after the restart.
    let mut b = b;
    unsafe { libc::kill(b.child.id() as libc::pid_t, libc::SIGTERM) };
    assert_eq!(
        common::exited(&mut b.child, Duration::from_secs(30), "SIGTERM").code(),
        Some(0),
        "a clean stop"
    );
    std::mem::forget(b);
    let b = start_in(dir.clone());
    assert_eq!(topic_publish(b.port, "other.status").await, Err(403));
    assert_eq!(topic_publish(b.port, "guest.status").await, Ok(()));

    // kill -9 right after a change (answered after the sync that covers it).
    ok(
        &b,
        &[
            "set-topic-permissions",
            "guest",
            "amq.topic",
            "^other\\.",
            "",
        ],
    );
    let mut b = b;
    b.child.kill().expect("SIGKILL");
    let _ = b.child.wait();
    std::mem::forget(b);
    let b = start_in(dir.clone());
    assert_eq!(topic_publish(b.port, "other.status").await, Ok(()));
    assert_eq!(topic_publish(b.port, "guest.status").await, Err(403));
    ok(&b, &["clear-topic-permissions", "guest"]);
    let mut b = b;
    b.child.kill().expect("SIGKILL");
    let _ = b.child.wait();
    std::mem::forget(b);
    let b = start_in(dir.clone());
    assert_eq!(json(&b, &["list-topic-permissions"]), json!([]));
    assert_eq!(topic_publish(b.port, "guest.status").await, Ok(()));

    // The export imports into a fresh broker, which then enforces it.
    let file = dir.join("exported.json");
    std::fs::write(&file, exported.to_string()).expect("write the export");
    let fresh = start("topic-perms-import");
    let out = ok(
        &fresh,
        &["import-definitions", file.to_str().expect("UTF-8 path")],
    );
    assert!(out.contains("1 topic permissions"), "{out}");
    assert_eq!(topic_publish(fresh.port, "other.status").await, Err(403));
    assert_eq!(
        json(&fresh, &["list-user-topic-permissions", "guest"]),
        json!([{"vhost": "/", "user": "guest", "exchange": "amq.topic",
                "write": "^{username}\\.", "read": "^news\\."}])
    );
    drop(fresh);
    drop(b);
}

/// With `--shards 2` a queue lives on one of two shards; `purge-queue` and `delete-queue`
/// run on shard 0's admin channel and a queue of shard 1 answers by mail, after the op
/// returned: ctl must still get that answer (it printed `error: unexpected reply None` and
/// exited 1), with the count, for every queue wherever it lives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctl_purge_and_delete_report_counts_for_queues_on_every_shard() {
    let dir = common::scratch_dir("ctl", "shards");
    let served = common::serve(&dir, false, &["--shards", "2"]);
    let b = Broker {
        child: served.child,
        dir,
        port: served.amqp,
        mqtt_port: 0,
    };
    // Stored queues are placed by a hash of their name: six names span both shards.
    let names: Vec<String> = (0..6).map(|i| format!("sharded-{i}")).collect();
    {
        let (_conn, ch) = common::channel(b.port).await;
        for name in &names {
            common::bounded_as(
                "queue.declare-ok",
                ch.queue_declare(
                    name.as_str().into(),
                    lapin::options::QueueDeclareOptions {
                        durable: true,
                        ..Default::default()
                    },
                    Default::default(),
                ),
            )
            .await
            .expect("declare");
        }
    }
    for name in &names {
        publish(b.port, "", name, 3).await;
    }
    for name in &names {
        assert_eq!(
            ok(&b, &["purge-queue", name]).trim(),
            format!("Purged 3 messages from queue '{name}'")
        );
    }
    for name in &names {
        publish(b.port, "", name, 2).await;
        assert_eq!(
            ok(&b, &["delete-queue", name]).trim(),
            format!("Deleted queue '{name}' (2 messages)")
        );
    }
    let left = json(&b, &["list-queues"]);
    assert!(
        !left.to_string().contains("sharded-"),
        "every queue deleted: {left}"
    );
}
