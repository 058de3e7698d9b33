//! Dynamic shovels between real `warren serve` processes over real sockets: parameters set
//! through the HTTP API and `warren ctl`, messages moved with lapin clients checking what
//! arrived, kill -9 of the destination mid-move, `src-delete-after`, restarts; static
//! shovels (`[[shovel]]` in warren.toml), a kill -9 of the broker running one.

mod common;

use common::http::call;
use common::{BIN, Killed, Served, bounded, scratch_dir, serve, serve_amqp_at};
use lapin::options::{
    BasicAckOptions, BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions,
    QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::process::Command;
use std::time::{Duration, Instant};

fn start(tag: &str) -> (Killed, std::path::PathBuf) {
    let dir = scratch_dir("shovel", tag);
    let s = serve(&dir, false, &["--management", "127.0.0.1:0"]);
    (Killed(s), dir)
}

fn api(s: &Served) -> u16 {
    s.management.expect("HTTP API port")
}

async fn declare(ch: &Channel, q: &str) -> u32 {
    let opts = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    bounded(ch.queue_declare(q.into(), opts, FieldTable::default()))
        .await
        .expect("queue.declare")
        .message_count()
}

/// Publishes messages `from..to` (message id = the number) persistently, with confirms.
async fn publish(port: u16, q: &str, from: u32, to: u32) {
    let (_c, ch) = common::channel(port).await;
    declare(&ch, q).await;
    bounded(ch.confirm_select(ConfirmSelectOptions::default()))
        .await
        .expect("confirm.select");
    let mut confirms = Vec::new();
    for i in from..to {
        let props = BasicProperties::default()
            .with_delivery_mode(2)
            .with_message_id(i.to_string().into());
        let c = bounded(ch.basic_publish(
            "".into(),
            q.into(),
            BasicPublishOptions::default(),
            format!("body {i}").as_bytes(),
            props,
        ))
        .await
        .expect("publish");
        confirms.push(c);
    }
    for c in confirms {
        assert!(bounded(c).await.expect("confirm").is_ack(), "confirmed");
    }
}

/// Every message of `q` (drained with basic.get): message id -> times seen, and one
/// message's headers.
async fn drain(port: u16, q: &str) -> (BTreeMap<u32, u32>, Option<FieldTable>) {
    let (_c, ch) = common::channel(port).await;
    let mut seen = BTreeMap::new();
    let mut headers = None;
    while let Some(m) = bounded(ch.basic_get(q.into(), BasicGetOptions::default()))
        .await
        .expect("basic.get")
    {
        let id: u32 = m
            .delivery
            .properties
            .message_id()
            .as_ref()
            .and_then(|s| s.as_str().parse().ok())
            .expect("a message id we set");
        *seen.entry(id).or_insert(0) += 1;
        headers = headers.or_else(|| m.delivery.properties.headers().clone());
        bounded(m.delivery.acker.ack(BasicAckOptions::default()))
            .await
            .expect("ack");
    }
    (seen, headers)
}

async fn count(port: u16, q: &str) -> u32 {
    let (_c, ch) = common::channel(port).await;
    declare(&ch, q).await
}

/// Waits (up to `secs`) until `f` holds.
async fn until(what: &str, secs: u64, mut f: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !f().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn put_shovel(api: u16, name: &str, value: Value) -> u16 {
    let a = call(
        api,
        "PUT",
        &format!("/api/parameters/shovel/%2f/{name}"),
        Some(json!({ "value": value })),
    );
    assert!(
        a.status == 201 || a.status == 204,
        "{} {}",
        a.status,
        a.text()
    );
    a.status
}

fn shovel_row(api: u16, name: &str) -> Option<Value> {
    call(api, "GET", "/api/shovels", None)
        .json()
        .as_array()
        .and_then(|rows| rows.iter().find(|r| r["name"] == name).cloned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shovel_moves_a_queue_to_another_broker_exactly_once() {
    let (a, da) = start("once-a");
    let (b, _db) = start("once-b");
    const N: u32 = 2000;
    publish(a.0.amqp, "src", 0, N).await;
    let dest = format!("amqp://guest:guest@127.0.0.1:{}/%2f", b.0.amqp);
    let status = put_shovel(
        api(&a.0),
        "move",
        json!({"src-uri": "amqp://", "src-queue": "src", "dest-uri": dest,
               "dest-queue": "dst", "src-prefetch-count": 100,
               "dest-add-forward-headers": true}),
    );
    assert_eq!(status, 201, "a new parameter");
    until("every message at the destination", 60, async || {
        count(b.0.amqp, "dst").await == N
    })
    .await;
    until("the source drained", 10, async || {
        count(a.0.amqp, "src").await == 0
    })
    .await;
    // The confirms (after the destination's fsync) settle the count a little after the
    // messages are in the destination queue.
    until("every move counted", 10, async || {
        shovel_row(api(&a.0), "move").is_some_and(|r| r["messages_moved"] == N)
    })
    .await;
    let row = shovel_row(api(&a.0), "move").expect("listed");
    assert_eq!(row["state"], "running", "{row}");
    assert_eq!(row["type"], "dynamic");
    assert_eq!(row["messages_moved"], N, "{row}");
    assert_eq!(
        row["dest_uri"],
        format!("amqp://127.0.0.1:{}/%2f", b.0.amqp)
    );
    let (seen, headers) = drain(b.0.amqp, "dst").await;
    assert_eq!(seen.len() as u32, N, "every message");
    assert!(seen.values().all(|n| *n == 1), "each once");
    let headers = headers.expect("forward headers");
    let Some(AMQPValue::FieldArray(a_)) = headers.inner().get("x-shovelled") else {
        panic!("x-shovelled: {headers:?}");
    };
    let Some(AMQPValue::FieldTable(info)) = a_.as_slice().first() else {
        panic!("a table");
    };
    assert_eq!(
        info.inner().get("shovel-name"),
        Some(&AMQPValue::LongString("move".into()))
    );
    // The status and metrics name it; ctl lists it.
    let out = Command::new(BIN)
        .args(["ctl", "--data-dir"])
        .arg(&da)
        .args(["--format", "json", "shovel-status"])
        .output()
        .expect("ctl");
    let rows: Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(rows[0]["name"], "move", "{rows}");
    // Clearing the parameter stops the shovel: a new message stays in the source.
    let a2 = call(api(&a.0), "DELETE", "/api/parameters/shovel/%2f/move", None);
    assert_eq!(a2.status, 204);
    until("the shovel gone", 10, async || {
        shovel_row(api(&a.0), "move").is_none()
    })
    .await;
    publish(a.0.amqp, "src", N, N + 1).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(count(a.0.amqp, "src").await, 1, "no shovel moves it");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_confirmed_message_arrives_when_the_destination_is_killed_mid_move() {
    let (a, _da) = start("kill-a");
    let db = scratch_dir("shovel", "kill-b");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let at = format!("127.0.0.1:{port}");
    let mut b = Killed(serve_amqp_at(&db, &at, false, &[], "info"));
    const N: u32 = 5_000;
    publish(a.0.amqp, "src", 0, N).await;
    put_shovel(
        api(&a.0),
        "move",
        json!({"src-uri": "amqp://", "src-queue": "src",
               "dest-uri": format!("amqp://127.0.0.1:{port}"), "dest-queue": "dst",
               "src-prefetch-count": 5, "reconnect-delay": 0.2}),
    );
    until("the move under way", 30, async || {
        count(port, "dst").await > 0
    })
    .await;
    let _ = b.0.child.kill();
    let _ = b.0.child.wait();
    let in_flight = count(a.0.amqp, "src").await;
    assert!(
        in_flight > 0,
        "killed mid-move ({in_flight} left at the source)"
    );
    b = Killed(serve_amqp_at(&db, &at, false, &[], "info"));
    until("the source drained", 60, async || {
        count(a.0.amqp, "src").await == 0
    })
    .await;
    until("the shovel settled", 10, async || {
        shovel_row(api(&a.0), "move").is_some_and(|r| r["state"] == "running")
    })
    .await;
    let row = shovel_row(api(&a.0), "move").expect("listed");
    assert!(row["reconnects"].as_u64() >= Some(1), "{row}");
    let (seen, _) = drain(port, "dst").await;
    let missing: Vec<u32> = (0..N).filter(|i| !seen.contains_key(i)).collect();
    assert!(
        missing.is_empty(),
        "lost {} messages, e.g. {:?}",
        missing.len(),
        &missing[..missing.len().min(5)]
    );
    assert!(seen.keys().all(|i| *i < N), "nothing invented");
    drop(b);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn src_delete_after_queue_length_moves_what_was_there_and_ends() {
    let (a, _da) = start("delete-after");
    publish(a.0.amqp, "src", 0, 300).await;
    put_shovel(
        api(&a.0),
        "drain",
        json!({"src-uri": "amqp://", "src-queue": "src", "dest-uri": "amqp://",
               "dest-queue": "dst", "src-delete-after": "queue-length",
               "src-prefetch-count": 1000}),
    );
    until("the parameter deleted", 30, async || {
        call(api(&a.0), "GET", "/api/parameters/shovel/%2f/drain", None).status == 404
    })
    .await;
    assert_eq!(count(a.0.amqp, "dst").await, 300);
    until("the status gone", 10, async || {
        shovel_row(api(&a.0), "drain").is_none()
    })
    .await;
    publish(a.0.amqp, "src", 300, 310).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        count(a.0.amqp, "src").await,
        10,
        "the ended shovel moves no more"
    );
    assert!(a.0.logged(&["shovel moved what src-delete-after asked"]));
}

#[test]
fn bad_shovel_values_are_refused_with_rabbitmq_texts() {
    let (a, dir) = start("bad");
    let port = api(&a.0);
    let put = |path: &str, body: Value| call(port, "PUT", path, Some(body));
    let base =
        json!({"src-uri": "amqp://", "src-queue": "a", "dest-uri": "amqp://", "dest-queue": "b"});
    let with = |k: &str, v: Value| {
        let mut x = base.clone();
        x[k] = v;
        json!({ "value": x })
    };
    // What RabbitMQ 3.10.8 answered to the same requests.
    for (body, reason) in [
        (
            with("bogus", json!(1)),
            "Validation failed\n\nUnrecognised terms [{&lt;&lt;\"bogus\"&gt;&gt;,1}] in s\n",
        ),
        (
            with("src-exchange", json!("x")),
            "Validation failed\n\nCannot specify 'src-exchange' and 'src-queue'\n",
        ),
        (
            with("ack-mode", json!("foo")),
            "Validation failed\n\nack-mode should be one of [&lt;&lt;\"no-ack\"&gt;&gt;,&lt;&lt;\"on-publish\"&gt;&gt;,&lt;&lt;\"on-confirm\"&gt;&gt;], actually was &lt;&lt;\"foo\"&gt;&gt;\n",
        ),
        (
            with("src-uri", json!("foo://x")),
            "Validation failed\n\n\"foo://x\" not a valid URI: {{unexpected_uri_scheme,\"foo\"},\"foo://x\"}\n",
        ),
        (json!({"nope": 1}), "[{key_missing,value}]"),
    ] {
        let a = put("/api/parameters/shovel/%2f/s", body);
        assert_eq!(a.status, 400, "{}", a.text());
        assert_eq!(a.json()["reason"], reason);
    }
    let a = put("/api/parameters/bogus/%2f/s", json!({"value": {"a": 1}}));
    assert_eq!(a.status, 400);
    assert_eq!(
        a.json()["reason"],
        "Validation failed\n\ncomponent bogus not found\n"
    );
    let a = put("/api/parameters/shovel/nosuch/s", json!({"value": base}));
    assert_eq!(
        (a.status, a.json()["reason"].clone()),
        (404, json!("vhost_not_found"))
    );
    assert_eq!(
        call(port, "GET", "/api/parameters", None).json(),
        json!([]),
        "nothing refused was kept"
    );
    // warren ctl: exit 2 with RabbitMQ's text.
    let ctl = |args: &[&str]| {
        Command::new(BIN)
            .args(["ctl", "--data-dir"])
            .arg(&dir)
            .args(args)
            .output()
            .expect("ctl")
    };
    let out = ctl(&[
        "set-parameter",
        "shovel",
        "c1",
        r#"{"src-uri":"amqp://","src-queue":"a","dest-uri":"amqp://","dest-queue":"b","bogus":1}"#,
    ]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("Unrecognised terms [{<<\"bogus\">>,1}] in c1"),
        "{err}"
    );
    let out = ctl(&["set-parameter", "shovel", "c1", "notjson"]);
    assert_eq!(out.status.code(), Some(2));
    let out = ctl(&["clear-parameter", "shovel", "nosuch"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("Parameter does not exist"));
}

#[test]
fn shovel_parameters_survive_kill_9_and_travel_in_definitions() {
    let dir = scratch_dir("shovel", "restart");
    let args = ["--management", "127.0.0.1:0"];
    let value = r#"{"src-uri":"amqp://","src-queue":"a","dest-uri":"amqp://","dest-queue":"b","ack-mode":"on-publish"}"#;
    let mut exported = Value::Null;
    {
        let a = Killed(serve(&dir, false, &args));
        let out = Command::new(BIN)
            .args(["ctl", "--data-dir"])
            .arg(&dir)
            .args(["set-parameter", "shovel", "kept", value])
            .output()
            .expect("ctl");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        // kill -9 right after the answer (Killed's drop).
        drop(a);
    }
    let a = Killed(serve(&dir, false, &args));
    let listed = call(api(&a.0), "GET", "/api/parameters/shovel", None).json();
    assert_eq!(listed[0]["name"], "kept", "{listed}");
    assert_eq!(listed[0]["value"]["ack-mode"], "on-publish");
    let out = Command::new(BIN)
        .args(["ctl", "--data-dir"])
        .arg(&dir)
        .args(["list-parameters"])
        .output()
        .expect("ctl");
    assert!(String::from_utf8_lossy(&out.stdout).contains("kept"));
    let defs = call(api(&a.0), "GET", "/api/definitions", None).json();
    for p in defs["parameters"].as_array().into_iter().flatten() {
        exported = p.clone();
    }
    assert_eq!(exported["component"], "shovel", "{defs}");
    assert_eq!(exported["vhost"], "/");
    assert_eq!(exported["value"]["dest-queue"], "b");
    // Imported into a fresh broker as RabbitMQ exports them.
    let (b, _db) = start("import");
    let doc = json!({"parameters": [exported]});
    let r = call(api(&b.0), "POST", "/api/definitions", Some(doc));
    assert_eq!(r.status, 204, "{}", r.text());
    let listed = call(api(&b.0), "GET", "/api/parameters/shovel/%2f/kept", None);
    assert_eq!(listed.status, 200, "{}", listed.text());
}

/// `warren ctl --data-dir DIR ARGS`.
fn ctl(dir: &std::path::Path, args: &[&str]) -> std::process::Output {
    Command::new(BIN)
        .args(["ctl", "--data-dir"])
        .arg(dir)
        .args(args)
        .output()
        .expect("ctl")
}

/// A broker with `config` as its warren.toml (AMQP on a free port, the HTTP API on
/// another, every other listener off).
fn serve_with(dir: &std::path::Path, config: &str) -> Killed {
    let path = dir.join("warren.toml");
    std::fs::write(&path, config).expect("write warren.toml");
    let path = path.to_string_lossy().into_owned();
    let args = ["--management", "127.0.0.1:0", "--config", path.as_str()];
    Killed(serve(dir, false, &args))
}

/// A `[[shovel]]` table of warren.toml from A's queue `src` to B's queue `dst`: the
/// static shovel moves N confirmed messages exactly once, shows `type: static` in the API,
/// ctl and its forward headers, is no runtime parameter (not exported, not clearable, its
/// name refused to a dynamic shovel), and after a kill -9 of the broker running it starts
/// again from the config: every confirmed message arrives at least once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_static_shovel_moves_exactly_once_and_survives_kill_9_of_its_broker() {
    let db = scratch_dir("shovel", "static-b");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let at = format!("127.0.0.1:{port}");
    let mut b = Killed(serve_amqp_at(&db, &at, false, &[], "info"));
    let da = scratch_dir("shovel", "static-a");
    let config = format!(
        "[[shovel]]\nname = \"fixed\"\nsrc-uri = \"amqp://\"\nsrc-queue = \"src\"\n\
         \"dest-uri\" = \"amqp://guest:guest@127.0.0.1:{}/%2f\"\ndest-queue = \"dst\"\n\
         ack-mode = \"on-confirm\"\nsrc-prefetch-count = 10\nreconnect-delay = 0.2\n\
         dest-add-forward-headers = true\n",
        b.0.amqp
    );
    let a = serve_with(&da, &config);
    const N: u32 = 2000;
    publish(a.0.amqp, "src", 0, N).await;
    until("every message at the destination", 60, async || {
        count(b.0.amqp, "dst").await == N
    })
    .await;
    until("every move counted", 10, async || {
        shovel_row(api(&a.0), "fixed").is_some_and(|r| r["messages_moved"] == N)
    })
    .await;
    let row = shovel_row(api(&a.0), "fixed").expect("listed");
    assert_eq!(row["type"], "static", "{row}");
    assert_eq!(row["vhost"], "/", "{row}");
    assert_eq!(row["state"], "running", "{row}");
    assert_eq!(count(a.0.amqp, "src").await, 0, "the source drained");
    let (seen, headers) = drain(b.0.amqp, "dst").await;
    assert_eq!(seen.len() as u32, N, "every message");
    assert!(seen.values().all(|n| *n == 1), "each once");
    let headers = headers.expect("forward headers");
    let Some(AMQPValue::FieldArray(hops)) = headers.inner().get("x-shovelled") else {
        panic!("x-shovelled: {headers:?}");
    };
    let Some(AMQPValue::FieldTable(info)) = hops.as_slice().first() else {
        panic!("a table");
    };
    assert_eq!(
        info.inner().get("shovel-type"),
        Some(&AMQPValue::LongString("static".into()))
    );
    let out = ctl(&da, &["--format", "json", "shovel-status"]);
    let rows: Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(
        (&rows[0]["name"], &rows[0]["type"]),
        (&json!("fixed"), &json!("static")),
        "{rows}"
    );
    let out = ctl(&da, &["shovel-status"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("fixed") && text.contains("static"), "{text}");

    // Not a runtime parameter: not listed or exported, a clear answers as for a missing
    // one, and a dynamic shovel may not take its vhost and name.
    assert_eq!(
        call(api(&a.0), "GET", "/api/parameters", None).json(),
        json!([])
    );
    let defs = call(api(&a.0), "GET", "/api/definitions", None).json();
    assert_eq!(defs["parameters"], json!([]), "{defs}");
    let out = ctl(&da, &["clear-parameter", "shovel", "fixed"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("Parameter does not exist"));
    let value = json!({"src-uri": "amqp://", "src-queue": "a", "dest-uri": "amqp://",
                       "dest-queue": "b"});
    let r = call(
        api(&a.0),
        "PUT",
        "/api/parameters/shovel/%2f/fixed",
        Some(json!({ "value": value })),
    );
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(
        r.json()["reason"]
            .as_str()
            .is_some_and(|t| t.contains("fixed in vhost / is a static shovel")),
        "{}",
        r.text()
    );
    let out = ctl(
        &da,
        &["set-parameter", "shovel", "fixed", &value.to_string()],
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("is a static shovel"));
    assert_eq!(
        shovel_row(api(&a.0), "fixed").expect("still")["type"],
        "static"
    );

    // kill -9 of the broker running it mid-move; it starts again from the config. The
    // messages wait at the source while the destination is down, so that the kill comes
    // early in their move (moved while published, most would be gone before it).
    drop(b);
    const M: u32 = 5_000;
    publish(a.0.amqp, "src", N, N + M).await;
    b = Killed(serve_amqp_at(&db, &at, false, &[], "info"));
    until("the move under way", 60, async || {
        count(b.0.amqp, "dst").await > 0
    })
    .await;
    drop(a);
    let arrived = count(b.0.amqp, "dst").await;
    assert!(arrived < M, "killed mid-move ({arrived} of {M} arrived)");
    let a = serve_with(&da, &config);
    until("the source drained after the restart", 60, async || {
        count(a.0.amqp, "src").await == 0
    })
    .await;
    until("the shovel running again", 10, async || {
        shovel_row(api(&a.0), "fixed").is_some_and(|r| r["state"] == "running")
    })
    .await;
    assert_eq!(
        shovel_row(api(&a.0), "fixed").expect("listed")["type"],
        "static"
    );
    let (seen, _) = drain(b.0.amqp, "dst").await;
    let missing: Vec<u32> = (N..N + M).filter(|i| !seen.contains_key(i)).collect();
    assert!(
        missing.is_empty(),
        "lost {} messages, e.g. {:?}",
        missing.len(),
        &missing[..missing.len().min(5)]
    );
    // Ids below N may come back: the drain's acks at B were not yet synced when B was
    // killed.
    assert!(seen.keys().all(|i| *i < N + M), "nothing invented");
}

/// A bad `[[shovel]]` table stops `warren serve` with exit code 2, the file and the shovel
/// named, with RabbitMQ's text.
#[test]
fn bad_static_shovels_are_refused_at_start() {
    let head = "[[shovel]]\nname = \"s1\"\nsrc-uri = \"amqp://\"\nsrc-queue = \"a\"\n\
                dest-uri = \"amqp://\"\ndest-queue = \"b\"\n";
    for (tag, toml, says) in [
        (
            "unknown",
            format!("{head}bogus = 1\n"),
            "[[shovel]] \"s1\": validation failed: Unrecognised terms [{<<\"bogus\">>,1}] in s1",
        ),
        (
            "ack-mode",
            format!("{head}ack-mode = \"foo\"\n"),
            "ack-mode should be one of [<<\"no-ack\">>,<<\"on-publish\">>,<<\"on-confirm\">>], actually was <<\"foo\">>",
        ),
        (
            "uri",
            head.replace("src-uri = \"amqp://\"", "src-uri = \"foo://x\""),
            "\"foo://x\" not a valid URI",
        ),
        (
            "twice",
            format!("{head}{head}"),
            "\"s1\" in vhost \"/\" is there twice",
        ),
        (
            "no-name",
            "[[shovel]]\nsrc-uri = \"amqp://\"\n".to_string(),
            "needs a name",
        ),
    ] {
        let dir = scratch_dir("shovel-conf", tag);
        let path = dir.join("warren.toml");
        std::fs::write(&path, &toml).expect("write");
        let out = Command::new(BIN)
            .args(["serve", "--amqp", "127.0.0.1:0", "--mqtt", "none"])
            .args([
                "--management",
                "none",
                "--prometheus",
                "none",
                "--stream",
                "none",
            ])
            .arg("--data-dir")
            .arg(&dir)
            .arg("--config")
            .arg(&path)
            .output()
            .expect("run warren serve");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stderr),
            String::from_utf8_lossy(&out.stdout)
        );
        assert_eq!(out.status.code(), Some(2), "{tag}: {text}");
        assert!(
            text.contains("warren.toml:"),
            "{tag}: names the file: {text}"
        );
        assert!(text.contains(says), "{tag}: says {says:?}: {text}");
    }
}
