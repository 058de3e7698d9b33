//! The HTTP management API (`warren serve --management`) and Prometheus metrics
//! (`--prometheus`) over real sockets: state made by real AMQP (lapin) and MQTT clients,
//! read and changed through the API as rabbitmqadmin and Terraform do; bad input answered
//! with RabbitMQ's status codes, a log line and no effect.

mod common;

use common::http::{basic, call, call_as, raw};
use common::{Broker, eventually, mqtt_connect};

use serde_json::{Value, json};
use std::io::Write;
use std::time::{Duration, Instant};

fn start(tag: &str) -> Broker {
    Broker::start(
        "mgmt",
        tag,
        &["--management", "127.0.0.1:0", "--prometheus", "127.0.0.1:0"],
    )
}

async fn amqp(port: u16, name: &str) -> lapin::Connection {
    let props = lapin::ConnectionProperties::default().with_connection_name(name.into());
    tokio::time::timeout(
        Duration::from_secs(5),
        lapin::Connection::connect(&format!("amqp://guest:guest@127.0.0.1:{port}/%2f"), props),
    )
    .await
    .expect("connect in time")
    .expect("connect")
}

/// Declares `queue` and publishes `count` copies of `body` to it, each confirmed.
async fn publish_confirmed(c: &lapin::Connection, queue: &str, count: usize, body: &[u8]) {
    use lapin::options::*;
    let ch = common::bounded_as("channel.open-ok", c.create_channel())
        .await
        .expect("channel");
    common::bounded_as(
        "queue.declare answer",
        ch.queue_declare(
            queue.into(),
            QueueDeclareOptions::default(),
            Default::default(),
        ),
    )
    .await
    .expect("declare");
    common::bounded_as(
        "confirm.select-ok",
        ch.confirm_select(ConfirmSelectOptions::default()),
    )
    .await
    .expect("confirm.select");
    for _ in 0..count {
        common::bounded_as(
            "publisher confirm",
            common::bounded_as(
                "basic.publish sent (held while the connection is blocked)",
                ch.basic_publish(
                    "".into(),
                    queue.into(),
                    BasicPublishOptions::default(),
                    body,
                    Default::default(),
                ),
            )
            .await
            .expect("publish"),
        )
        .await
        .expect("confirm");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queues_show_counts_consumers_rates_pages_and_columns() {
    use lapin::options::*;
    let b = start("queues");
    let port = b.api();
    let c = amqp(b.served.amqp, "counts").await;
    let ch = common::bounded_as("channel.open-ok", c.create_channel())
        .await
        .unwrap();
    for q in ["q1", "q2", "q3"] {
        common::bounded_as(
            "queue.declare answer",
            ch.queue_declare(q.into(), QueueDeclareOptions::default(), Default::default()),
        )
        .await
        .unwrap();
    }
    for i in 0..5 {
        common::bounded_as(
            "basic.publish sent (held while the connection is blocked)",
            ch.basic_publish(
                "".into(),
                "q1".into(),
                BasicPublishOptions::default(),
                format!("m{i}").as_bytes(),
                Default::default(),
            ),
        )
        .await
        .unwrap();
    }
    let consumer_ch = common::bounded_as("channel.open-ok", c.create_channel())
        .await
        .unwrap();
    common::bounded_as(
        "basic.qos-ok",
        consumer_ch.basic_qos(2, BasicQosOptions::default()),
    )
    .await
    .unwrap();
    let mut consumer = common::bounded_as(
        "basic.consume answer",
        consumer_ch.basic_consume(
            "q1".into(),
            "watcher".into(),
            BasicConsumeOptions::default(),
            Default::default(),
        ),
    )
    .await
    .unwrap();
    use futures_lite::StreamExt;
    let first = common::bounded_as("next delivery or event", consumer.next())
        .await
        .expect("a delivery")
        .expect("ok");
    first.ack(BasicAckOptions::default()).await.unwrap();
    let q1 = eventually("q1's counts", || {
        let q = call(port, "GET", "/api/queues/%2F/q1", None).json();
        (q["messages_unacknowledged"] == 2 && q["message_stats"]["ack"] == 1).then_some(q)
    });
    assert_eq!(q1["messages_ready"], 2);
    assert_eq!(q1["messages"], 4);
    assert_eq!(q1["consumers"], 1);
    assert_eq!(q1["message_stats"]["publish"], 5);
    assert_eq!(q1["message_stats"]["deliver_get"], 3);
    assert_eq!(q1["vhost"], "/");
    assert_eq!(q1["type"], "classic");
    assert!(q1["message_stats"]["publish_details"]["rate"].is_number());

    // Rates: sampled before and more than a second after 10 publishes, the rate is
    // positive.
    let before = call(port, "GET", "/api/queues/%2F/q2", None).json();
    assert_eq!(before["message_stats"]["publish"], 0);
    for _ in 0..10 {
        common::bounded_as(
            "basic.publish sent (held while the connection is blocked)",
            ch.basic_publish(
                "".into(),
                "q2".into(),
                BasicPublishOptions::default(),
                b"x",
                Default::default(),
            ),
        )
        .await
        .unwrap();
    }
    std::thread::sleep(Duration::from_millis(1100));
    let q2 = eventually("a publish rate", || {
        let q = call(port, "GET", "/api/queues/%2F/q2", None).json();
        (q["messages"] == 10).then_some(q)
    });
    let rate = q2["message_stats"]["publish_details"]["rate"]
        .as_f64()
        .unwrap();
    assert!(rate > 0.0, "publish rate of q2: {q2}");

    // Pagination as RabbitMQ's (page object) and columns.
    let page = call(port, "GET", "/api/queues?page=2&page_size=2", None).json();
    assert_eq!(page["total_count"], 3);
    assert_eq!(page["page_count"], 2);
    assert_eq!(page["item_count"], 1);
    assert_eq!(page["items"][0]["name"], "q3");
    let cols = call(
        port,
        "GET",
        "/api/queues/%2F?columns=name,messages_ready,message_stats.publish",
        None,
    )
    .json();
    assert_eq!(
        cols[0],
        json!({"name": "q1", "messages_ready": 2, "message_stats": {"publish": 5}})
    );
    let filtered = call(port, "GET", "/api/queues?name=q2", None).json();
    assert_eq!(filtered.as_array().unwrap().len(), 1);
    assert_eq!(
        call(port, "GET", "/api/queues?page=9", None).status,
        400,
        "a page past the end"
    );

    // Overview totals and the node.
    let o = call(port, "GET", "/api/overview", None).json();
    assert_eq!(o["object_totals"]["queues"], 3);
    assert_eq!(o["object_totals"]["connections"], 1);
    assert_eq!(o["object_totals"]["channels"], 2);
    assert_eq!(o["queue_totals"]["messages"], 14);
    assert_eq!(o["message_stats"]["publish"], 15);
    let nodes = call(port, "GET", "/api/nodes", None).json();
    assert_eq!(nodes[0]["name"], o["node"]);
    assert_eq!(
        call(port, "GET", "/api/whoami", None).json(),
        json!({"name": "guest", "tags": ["administrator"]})
    );
    let consumers = call(port, "GET", "/api/consumers", None).json();
    assert_eq!(consumers[0]["consumer_tag"], "watcher");
    assert_eq!(consumers[0]["queue"], json!({"name": "q1", "vhost": "/"}));
    assert_eq!(consumers[0]["prefetch_count"], 2);
    let channels = call(port, "GET", "/api/channels", None).json();
    let consuming = channels
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["consumer_count"] == 1)
        .expect("the consumer's channel");
    assert_eq!(consuming["messages_unacknowledged"], 2);
    assert_eq!(consuming["message_stats"]["ack"], 1);
    common::bounded_as("close-ok", c.close(200, "bye".into()))
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn declare_publish_get_purge_and_delete_through_the_api() {
    let b = start("objects");
    let port = b.api();
    let created = call(
        port,
        "PUT",
        "/api/exchanges/%2F/orders",
        Some(json!({"type": "topic", "durable": true})),
    );
    assert_eq!(created.status, 201, "{}", created.text());
    assert_eq!(
        call(
            port,
            "PUT",
            "/api/queues/%2F/eu",
            Some(json!({"durable": true, "arguments": {"x-max-length": 100}}))
        )
        .status,
        201
    );
    let bound = call(
        port,
        "POST",
        "/api/bindings/%2F/e/orders/q/eu",
        Some(json!({"routing_key": "eu.*"})),
    );
    assert_eq!(bound.status, 201);
    assert!(
        bound
            .headers
            .to_ascii_lowercase()
            .contains("location: eu.*")
    );
    let listed = call(port, "GET", "/api/bindings/%2F/e/orders/q/eu", None).json();
    assert_eq!(listed[0]["routing_key"], "eu.*");
    assert_eq!(listed[0]["properties_key"], "eu.*");
    let published = call(
        port,
        "POST",
        "/api/exchanges/%2F/orders/publish",
        Some(
            json!({"routing_key": "eu.fr", "payload": "bonjour", "payload_encoding": "string",
                    "properties": {"delivery_mode": 2, "headers": {"k": "v"}}}),
        ),
    );
    assert_eq!(published.json(), json!({"routed": true}));
    let nowhere = call(
        port,
        "POST",
        "/api/exchanges/%2F/orders/publish",
        Some(
            json!({"routing_key": "us.ny", "payload": "hi", "payload_encoding": "string", "properties": {}}),
        ),
    );
    assert_eq!(nowhere.json(), json!({"routed": false}));
    // get with requeue leaves the message; without, takes it.
    let got = call(
        port,
        "POST",
        "/api/queues/%2F/eu/get",
        Some(json!({"count": 5, "ackmode": "ack_requeue_true", "encoding": "auto"})),
    )
    .json();
    assert_eq!(got.as_array().unwrap().len(), 1);
    assert_eq!(got[0]["payload"], "bonjour");
    assert_eq!(got[0]["routing_key"], "eu.fr");
    assert_eq!(got[0]["properties"]["headers"], json!({"k": "v"}));
    assert_eq!(got[0]["properties"]["delivery_mode"], 2);
    let again = call(
        port,
        "POST",
        "/api/queues/%2F/eu/get",
        Some(json!({"count": 1, "ackmode": "ack_requeue_false", "encoding": "base64"})),
    )
    .json();
    assert_eq!(again[0]["redelivered"], true);
    assert_eq!(again[0]["payload_encoding"], "base64");
    assert_eq!(
        call(port, "GET", "/api/queues/%2F/eu", None).json()["messages"],
        0
    );
    // purge
    call(
        port,
        "POST",
        "/api/exchanges/%2F/amq.default/publish",
        Some(
            json!({"routing_key": "eu", "payload": "x", "payload_encoding": "string", "properties": {}}),
        ),
    );
    assert_eq!(
        call(port, "GET", "/api/queues/%2F/eu", None).json()["messages"],
        1
    );
    assert_eq!(
        call(port, "DELETE", "/api/queues/%2F/eu/contents", None).status,
        204
    );
    assert_eq!(
        call(port, "GET", "/api/queues/%2F/eu", None).json()["messages"],
        0
    );
    // unbind, delete
    let unbound = call(port, "DELETE", "/api/bindings/%2F/e/orders/q/eu/eu.*", None);
    assert_eq!(unbound.status, 204, "{}", unbound.text());
    assert_eq!(
        call(port, "GET", "/api/bindings/%2F/e/orders/q/eu", None).json(),
        json!([])
    );
    assert_eq!(call(port, "DELETE", "/api/queues/%2F/eu", None).status, 204);
    assert_eq!(call(port, "GET", "/api/queues/%2F/eu", None).status, 404);
    assert_eq!(
        call(port, "DELETE", "/api/exchanges/%2F/orders", None).status,
        204
    );
    assert_eq!(
        call(port, "GET", "/api/exchanges/%2F/orders", None).status,
        404
    );
    // vhosts, users, permissions, policies
    assert_eq!(
        call(port, "PUT", "/api/vhosts/dev", Some(json!({}))).status,
        201
    );
    assert_eq!(
        call(
            port,
            "PUT",
            "/api/users/ops",
            Some(json!({"password": "s3cret", "tags": "management"}))
        )
        .status,
        201
    );
    assert_eq!(
        call(
            port,
            "PUT",
            "/api/permissions/dev/ops",
            Some(json!({"configure": "^ops-", "write": ".*", "read": ".*"}))
        )
        .status,
        201
    );
    assert_eq!(
        call(
            port,
            "PUT",
            "/api/policies/dev/ttl",
            Some(json!({"pattern": "^ops-", "definition": {"message-ttl": 60000}, "apply-to": "queues"}))
        )
        .status,
        201
    );
    let ops = ("ops", "s3cret");
    // The management user sees its vhost only, and may configure only what its
    // permissions allow.
    let vhosts = call_as(port, ops, "GET", "/api/vhosts", None).json();
    assert_eq!(vhosts.as_array().unwrap().len(), 1);
    assert_eq!(vhosts[0]["name"], "dev");
    assert_eq!(
        call_as(port, ops, "PUT", "/api/queues/dev/ops-q", Some(json!({}))).status,
        201
    );
    assert_eq!(
        call_as(port, ops, "PUT", "/api/queues/dev/other", Some(json!({}))).status,
        401
    );
    assert_eq!(call_as(port, ops, "GET", "/api/users", None).status, 401);
    let policies = call(port, "GET", "/api/policies/dev", None).json();
    assert_eq!(policies[0]["definition"], json!({"message-ttl": 60000}));
    let q = call(port, "GET", "/api/queues/dev/ops-q", None).json();
    assert_eq!(q["policy"], "ttl");
    assert_eq!(
        q["effective_policy_definition"],
        json!({"message-ttl": 60000})
    );
    assert_eq!(
        call(port, "DELETE", "/api/policies/dev/ttl", None).status,
        204
    );
    assert_eq!(call(port, "DELETE", "/api/users/ops", None).status, 204);
    assert_eq!(call(port, "DELETE", "/api/vhosts/dev", None).status, 204);
    assert_eq!(call(port, "GET", "/api/vhosts/dev", None).status, 404);
    assert_eq!(
        call(port, "GET", "/api/aliveness-test/%2F", None).json(),
        json!({"status": "ok"})
    );
    assert_eq!(
        call(port, "GET", "/api/health/checks/alarms", None).json(),
        json!({"status": "ok"})
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_show_peer_protocol_and_client_and_close_with_a_reason() {
    let b = start("conns");
    let port = b.api();
    let c = amqp(b.served.amqp, "billing-worker").await;
    let _mqtt = mqtt_connect(b.served.mqtt.expect("MQTT port"), "sensor-7");
    // With the trailing slash, as amqp091-go's recovery tests list them: RabbitMQ's router
    // takes both spellings of every path.
    let list = eventually("two connections", || {
        let l = call(port, "GET", "/api/connections/", None).json();
        (l.as_array().map(Vec::len) == Some(2)).then_some(l)
    });
    assert_eq!(
        call(port, "GET", "/api/vhosts/", None).json(),
        call(port, "GET", "/api/vhosts", None).json()
    );
    let amqp_conn = list
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["protocol"] == "AMQP 0-9-1")
        .expect("the AMQP connection");
    assert_eq!(
        amqp_conn["client_properties"]["connection_name"],
        "billing-worker"
    );
    assert_eq!(amqp_conn["peer_host"], "127.0.0.1");
    assert_eq!(amqp_conn["user"], "guest");
    assert_eq!(amqp_conn["port"], b.served.amqp);
    let name = amqp_conn["name"].as_str().unwrap().to_string();
    assert!(
        name.ends_with(&format!("-> 127.0.0.1:{}", b.served.amqp)),
        "{name}"
    );
    let mqtt_conn = list
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["protocol"] == "MQTT 3.1.1")
        .expect("the MQTT connection");
    assert_eq!(mqtt_conn["client_properties"]["client_id"], "sensor-7");

    // DELETE closes it with 320 and the X-Reason header's text, as RabbitMQ.
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
    let path = format!(
        "/api/connections/{}",
        name.replace(' ', "%20").replace('>', "%3E")
    );
    let auth = basic("guest", "guest");
    let closed = raw(
        port,
        "DELETE",
        &path,
        &[("Authorization", &auth), ("X-Reason", "rolling restart")],
        b"",
    );
    assert_eq!(closed.status, 204, "{}", closed.text());
    let error = rx
        .recv_timeout(Duration::from_secs(5))
        .expect("the client is told");
    assert!(
        error.contains("CONNECTION_FORCED") && error.contains("rolling restart"),
        "{error}"
    );
    eventually("one connection left", || {
        let l = call(port, "GET", "/api/connections", None).json();
        (l.as_array().map(Vec::len) == Some(1)).then_some(())
    });
    assert!(b.served.logged(&["closing connection", "rolling restart"]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_its_status_a_log_line_and_no_effect() {
    let b = start("bad");
    let port = b.api();
    let auth = basic("guest", "guest");
    let queues = || {
        call(port, "GET", "/api/queues", None)
            .json()
            .as_array()
            .unwrap()
            .len()
    };
    // Malformed JSON: 400.
    let r = raw(
        port,
        "PUT",
        "/api/queues/%2F/broken",
        &[
            ("Authorization", &auth),
            ("Content-Type", "application/json"),
        ],
        b"{\"durable\": tru",
    );
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"], "bad_request");
    // Wrong content type: 415.
    let r = raw(
        port,
        "PUT",
        "/api/queues/%2F/typed",
        &[("Authorization", &auth), ("Content-Type", "text/plain")],
        b"{}",
    );
    assert_eq!(r.status, 415);
    // A body over the limit: 413, unread.
    let huge = vec![b' '; 21 << 20];
    let r = raw(
        port,
        "POST",
        "/api/definitions",
        &[
            ("Authorization", &auth),
            ("Content-Type", "application/json"),
        ],
        &huge,
    );
    assert_eq!(r.status, 413);
    assert_eq!(queues(), 0, "nothing was declared");
    // `..` in paths: no route, nothing touched.
    call(port, "PUT", "/api/queues/%2F/keep", Some(json!({})));
    for path in [
        "/api/../api/queues/%2F/keep",
        "/api/queues/%2F/..%2F..%2Fetc%2Fpasswd",
        "/../../etc/passwd",
    ] {
        let r = raw(port, "DELETE", path, &[("Authorization", &auth)], b"");
        assert_eq!(r.status, 404, "{path}: {}", r.text());
    }
    assert_eq!(queues(), 1, "'keep' is still there");
    // No or wrong credentials: 401 with a Basic challenge.
    let r = raw(port, "GET", "/api/queues", &[], b"");
    assert_eq!(r.status, 401);
    assert!(
        r.headers
            .to_ascii_lowercase()
            .contains("www-authenticate: basic")
    );
    let wrong = basic("guest", "nope");
    let r = raw(
        port,
        "DELETE",
        "/api/queues/%2F/keep",
        &[("Authorization", &wrong)],
        b"",
    );
    assert_eq!(r.status, 401);
    // A monitoring user reads everything, deletes nothing.
    call(
        port,
        "PUT",
        "/api/users/watcher",
        Some(json!({"password": "w", "tags": "monitoring"})),
    );
    let watcher = ("watcher", "w");
    assert_eq!(
        call_as(port, watcher, "GET", "/api/queues", None).status,
        200
    );
    assert_eq!(
        call_as(port, watcher, "GET", "/api/nodes", None).status,
        200
    );
    assert_eq!(
        call_as(port, watcher, "DELETE", "/api/queues/%2F/keep", None).status,
        401
    );
    assert_eq!(
        call_as(port, watcher, "DELETE", "/api/users/guest", None).status,
        401
    );
    assert_eq!(queues(), 1, "'keep' survived the monitoring user");
    assert_eq!(call(port, "GET", "/api/users/guest", None).status, 200);
    // A user without a management tag cannot use the API at all.
    call(
        port,
        "PUT",
        "/api/users/app",
        Some(json!({"password": "a", "tags": ""})),
    );
    assert_eq!(
        call_as(port, ("app", "a"), "GET", "/api/overview", None).status,
        401
    );
    // Each refusal was logged.
    for (status, path) in [
        ("400", "/api/queues/%2F/broken"),
        ("415", "/api/queues/%2F/typed"),
        ("413", "/api/definitions"),
        ("404", "etc%2Fpasswd"),
        ("401", "/api/users/guest"),
    ] {
        assert!(
            b.served.logged(&["HTTP API request refused", status, path]),
            "no log line for {status} {path}"
        );
    }
    assert!(
        b.served
            .logged(&["HTTP API login refused", "wrong password"])
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn definitions_export_matches_ctl_and_imports_into_another_broker() {
    let a = start("defs-a");
    let port = a.api();
    call(port, "PUT", "/api/vhosts/shop", Some(json!({})));
    call(
        port,
        "PUT",
        "/api/exchanges/shop/orders",
        Some(json!({"type": "direct", "durable": true})),
    );
    call(
        port,
        "PUT",
        "/api/queues/shop/invoices",
        Some(json!({"durable": true})),
    );
    call(
        port,
        "POST",
        "/api/bindings/shop/e/orders/q/invoices",
        Some(json!({"routing_key": "paid"})),
    );
    let exported = call(port, "GET", "/api/definitions", None).json();
    let ctl = std::process::Command::new(common::BIN)
        .args(["ctl", "--data-dir"])
        .arg(&a.dir)
        .args(["export-definitions", "-"])
        .output()
        .expect("warren ctl");
    let from_ctl: Value = serde_json::from_slice(&ctl.stdout).expect("ctl's export is JSON");
    assert_eq!(exported, from_ctl, "the API's export is ctl's");
    assert_eq!(exported["queues"][0]["name"], "invoices");

    let b = start("defs-b");
    let posted = call(b.api(), "POST", "/api/definitions", Some(exported.clone()));
    assert_eq!(posted.status, 204, "{}", posted.text());
    let q = call(b.api(), "GET", "/api/queues/shop/invoices", None).json();
    assert_eq!(q["durable"], true);
    let bindings = call(
        b.api(),
        "GET",
        "/api/bindings/shop/e/orders/q/invoices",
        None,
    )
    .json();
    assert_eq!(bindings[0]["routing_key"], "paid");
    assert_eq!(
        call(b.api(), "GET", "/api/definitions", None).json(),
        exported
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_metrics_count_messages_and_pass_promtool() {
    let b = start("metrics");
    let c = amqp(b.served.amqp, "metrics").await;
    publish_confirmed(&c, "jobs", 7, b"work").await;
    let ch = common::bounded_as("channel.open-ok", c.create_channel())
        .await
        .unwrap();
    common::bounded_as(
        "confirm.select-ok",
        ch.confirm_select(lapin::options::ConfirmSelectOptions::default()),
    )
    .await
    .unwrap();
    // One persistent message on a durable queue: its confirm waits for a group commit.
    common::bounded_as(
        "queue.declare answer",
        ch.queue_declare(
            "durable-jobs".into(),
            lapin::options::QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            Default::default(),
        ),
    )
    .await
    .unwrap();
    common::bounded_as(
        "publisher confirm",
        common::bounded_as(
            "basic.publish sent (held while the connection is blocked)",
            ch.basic_publish(
                "".into(),
                "durable-jobs".into(),
                lapin::options::BasicPublishOptions::default(),
                b"kept",
                lapin::BasicProperties::default().with_delivery_mode(2),
            ),
        )
        .await
        .unwrap(),
    )
    .await
    .unwrap();
    let port = b.served.prometheus.expect("Prometheus port");
    let text = raw(port, "GET", "/metrics", &[], b"").text();
    // The sync latency histograms: a group commit was counted, buckets end at +Inf.
    for name in [
        "warren_storage_sync_seconds",
        "warren_storage_journal_fsync_seconds",
    ] {
        let count = text
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name}_count ")))
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or_else(|| panic!("no {name}_count in:\n{text}"));
        assert!(count >= 1, "{name}_count {count}");
        assert!(
            text.lines()
                .any(|l| l == format!("{name}_bucket{{le=\"+Inf\"}} {count}")),
            "{name}'s +Inf bucket is not its count:\n{text}"
        );
    }
    for line in [
        "rabbitmq_queue_messages_ready{vhost=\"/\",queue=\"jobs\"} 7",
        "rabbitmq_queue_messages_unacked{vhost=\"/\",queue=\"jobs\"} 0",
        "rabbitmq_global_messages_received_total 8",
        "rabbitmq_connections 1",
        "rabbitmq_queues 2",
        "warren_mqtt_connections 0",
        "# TYPE rabbitmq_global_messages_received_total counter",
    ] {
        assert!(
            text.lines().any(|l| l == line),
            "no line {line:?} in:\n{text}"
        );
    }
    let promtool = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn();
    let Ok(mut promtool) = promtool else {
        // CI installs Debian's prometheus (scripts/test.sh); elsewhere it may be missing.
        assert!(
            std::env::var_os("CI").is_none(),
            "promtool is not installed (apt-get install prometheus)"
        );
        eprintln!("promtool not installed: skipping `promtool check metrics`");
        return;
    };
    promtool
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = promtool.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool check metrics: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Kills a started process when the test ends, however it ends.
struct Killed(std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prometheus_server_scrapes_the_metrics() {
    if std::process::Command::new("prometheus")
        .arg("--version")
        .output()
        .is_err()
    {
        assert!(
            std::env::var_os("CI").is_none(),
            "prometheus is not installed (apt-get install prometheus)"
        );
        eprintln!("prometheus not installed: skipping");
        return;
    }
    let b = start("scrape");
    let c = amqp(b.served.amqp, "scraped").await;
    publish_confirmed(&c, "scraped", 3, b"x").await;
    let target = b.served.prometheus.expect("Prometheus port");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let dir = b.dir.join("prometheus");
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: warren\n    \
             static_configs:\n      - targets: ['127.0.0.1:{target}']\n"
        ),
    )
    .unwrap();
    let _server = Killed(
        std::process::Command::new("prometheus")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start prometheus"),
    );
    // The server scraped the target and stored the queue's depth under its labels.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let answer = std::net::TcpStream::connect(("127.0.0.1", port))
            .ok()
            .map(|_| {
                raw(
                    port,
                    "GET",
                    "/api/v1/query?query=rabbitmq_queue_messages_ready%7Bqueue%3D%22scraped%22%7D",
                    &[],
                    b"",
                )
            });
        if let Some(a) = answer.filter(|a| a.status == 200) {
            let v = a.json();
            if let Some(sample) = v["data"]["result"].get(0) {
                assert_eq!(sample["metric"]["vhost"], "/");
                assert_eq!(sample["metric"]["job"], "warren");
                assert_eq!(sample["value"][1], "3", "{v}");
                break;
            }
        }
        assert!(
            Instant::now() < deadline,
            "Prometheus did not scrape the queue"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let up = raw(port, "GET", "/api/v1/query?query=up", &[], b"").json();
    assert_eq!(
        up["data"]["result"][0]["value"][1], "1",
        "the target is up: {up}"
    );
}

/// A vhost created through the API gives its creator full permissions, as RabbitMQ 3.10's
/// API does (checked: PUT /api/vhosts/v as guest is 201, then GET
/// /api/permissions/v/guest is configure/write/read ".*"); tools that create a vhost and
/// then use it need that. A PUT of an existing vhost leaves its permissions as they are
/// (RabbitMQ: 204, narrowed permissions stay narrowed). Both survive a SIGKILL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vhost_created_through_the_api_gives_its_creator_full_permissions() {
    let args = ["--management", "127.0.0.1:0"];
    let mut b = Broker::start("mgmt", "vhost-creator", &args);
    let port = b.api();
    assert_eq!(
        call(port, "PUT", "/api/vhosts/made", Some(json!({}))).status,
        201
    );
    let full =
        json!({"user": "guest", "vhost": "made", "configure": ".*", "write": ".*", "read": ".*"});
    let got = call(port, "GET", "/api/permissions/made/guest", None);
    assert_eq!(got.status, 200, "{}", got.text());
    assert_eq!(got.json(), full);
    let amqp_in = |port: u16| async move {
        tokio::time::timeout(
            Duration::from_secs(5),
            lapin::Connection::connect(
                &format!("amqp://guest:guest@127.0.0.1:{port}/made"),
                Default::default(),
            ),
        )
        .await
        .expect("connect in time")
    };
    let c = amqp_in(b.served.amqp)
        .await
        .expect("guest may open the new vhost");
    let ch = c.create_channel().await.expect("channel");
    ch.queue_declare("in-made".into(), Default::default(), Default::default())
        .await
        .expect("guest may configure in it");
    drop(c);
    // A second PUT changes nothing (its permissions included).
    let narrow = json!({"configure": "^x", "write": ".*", "read": ".*"});
    assert_eq!(
        call(port, "PUT", "/api/permissions/made/guest", Some(narrow)).status,
        204
    );
    assert_eq!(
        call(port, "PUT", "/api/vhosts/made", Some(json!({}))).status,
        204
    );
    let narrowed = call(port, "GET", "/api/permissions/made/guest", None).json();
    assert_eq!(narrowed["configure"], "^x", "{narrowed}");
    // Another user who is an administrator gets them too, and guest does not.
    assert_eq!(
        call(
            port,
            "PUT",
            "/api/users/boss",
            Some(json!({"password": "pw", "tags": "administrator"}))
        )
        .status,
        201
    );
    assert_eq!(
        call_as(
            port,
            ("boss", "pw"),
            "PUT",
            "/api/vhosts/bosses",
            Some(json!({}))
        )
        .status,
        201
    );
    let boss = call(port, "GET", "/api/permissions/bosses/boss", None).json();
    assert_eq!(boss["configure"], ".*", "{boss}");
    assert_eq!(
        call(port, "GET", "/api/permissions/bosses/guest", None).status,
        404
    );
    // Durable: a SIGKILL and a restart keep the grant.
    let _ = b.served.child.kill();
    let _ = b.served.child.wait();
    b.served = common::serve(&b.dir, true, &args);
    let port = b.api();
    let boss = call(port, "GET", "/api/permissions/bosses/boss", None).json();
    assert_eq!(boss["configure"], ".*", "after the restart: {boss}");
    amqp_in(b.served.amqp)
        .await
        .expect("guest still opens the vhost after the restart");
}

/// RabbitMQ's health checks with RabbitMQ 3.10.8's answers (each asked of it with the same
/// paths): 200 `{"status":"ok",...}`, or 503 `{"status":"failed","reason":...}` naming what
/// is missing; 400 for a port that is no number. `/api/nodes` has `being_drained`.
#[test]
fn health_checks_answer_as_rabbitmqs() {
    let b = start("health");
    let port = b.api();
    let amqp = b.served.amqp;
    let check = |path: &str| {
        let a = call(port, "GET", &format!("/api/health/checks/{path}"), None);
        (a.status, a.json())
    };
    assert_eq!(
        check(&format!("port-listener/{amqp}")),
        (200, json!({"status": "ok", "port": amqp}))
    );
    let (status, missing) = check("port-listener/1");
    assert_eq!(status, 503, "{missing}");
    assert_eq!(missing["status"], "failed");
    assert_eq!(missing["reason"], "No active listener");
    assert_eq!(missing["missing"], 1);
    let ports = missing["ports"].as_array().expect("ports").clone();
    assert!(
        ports.contains(&json!(amqp)) && ports.contains(&json!(port)),
        "{missing}"
    );
    let (status, invalid) = check("port-listener/abc");
    assert_eq!(
        (status, invalid),
        (
            400,
            json!({"error": "bad_request", "reason": "Invalid port"})
        )
    );
    for (asked, protocol) in [
        ("amqp", "amqp"),
        ("AMQP0.9.1", "amqp"),
        ("mqtt311", "mqtt"),
        ("management", "http"),
    ] {
        assert_eq!(
            check(&format!("protocol-listener/{asked}")),
            (200, json!({"status": "ok", "protocol": protocol})),
            "{asked}"
        );
    }
    let (status, stomp) = check("protocol-listener/stomp");
    assert_eq!(status, 503, "{stomp}");
    assert_eq!(stomp["reason"], "No active listener");
    assert_eq!(stomp["missing"], "stomp");
    let protocols = stomp["protocols"].as_array().expect("protocols").clone();
    assert!(
        protocols.contains(&json!("amqp")) && protocols.contains(&json!("http")),
        "{stomp}"
    );
    assert_eq!(check("virtual-hosts"), (200, json!({"status": "ok"})));
    assert_eq!(
        check("node-is-quorum-critical"),
        (
            200,
            json!({"status": "ok", "reason": "single node cluster"})
        )
    );
    // Without credentials: 401, as every other endpoint.
    let anonymous = raw(port, "GET", "/api/health/checks/virtual-hosts", &[], b"");
    assert_eq!(anonymous.status, 401);
    let nodes = call(port, "GET", "/api/nodes", None).json();
    assert_eq!(nodes[0]["being_drained"], false, "{nodes}");
}

/// Changes that name what does not exist get RabbitMQ 3.10.8's status for each (measured
/// side by side, 2026-12-03): a delete of something missing is 404; setting permissions for
/// a missing user or vhost is 400 `vhost_or_user_not_found`; a policy in a missing vhost is
/// 404; a policy value refused by validation is 400. The core's `AdminError` kinds carry it.
#[test]
fn changes_naming_missing_things_get_rabbitmqs_statuses() {
    let b = start("missing");
    let port = b.api();
    let perms = json!({"configure": ".*", "write": ".*", "read": ".*"});
    let topic = json!({"exchange": "amq.topic", "write": ".*", "read": ".*"});
    // (method, path, body, RabbitMQ's status, its reason where the test pins it)
    type Check<'a> = (&'a str, &'a str, Option<Value>, u16, Option<&'a str>);
    let checks: Vec<Check> = vec![
        ("DELETE", "/api/users/nobody", None, 404, None),
        (
            "PUT",
            "/api/permissions/%2F/nobody",
            Some(perms.clone()),
            400,
            Some("vhost_or_user_not_found"),
        ),
        (
            "PUT",
            "/api/permissions/novhost/guest",
            Some(perms),
            400,
            Some("vhost_or_user_not_found"),
        ),
        ("DELETE", "/api/permissions/%2F/nobody", None, 404, None),
        (
            "PUT",
            "/api/users/u1",
            Some(json!({"password": "p", "tags": ""})),
            201,
            None,
        ),
        ("DELETE", "/api/permissions/%2F/u1", None, 404, None),
        (
            "PUT",
            "/api/topic-permissions/%2F/nobody",
            Some(topic),
            400,
            Some("vhost_or_user_not_found"),
        ),
        ("DELETE", "/api/topic-permissions/%2F/u1", None, 404, None),
        ("DELETE", "/api/policies/%2F/nopolicy", None, 404, None),
        (
            "PUT",
            "/api/policies/%2F/bad",
            Some(json!({"pattern": ".*", "definition": {"max-length": -3}})),
            400,
            None,
        ),
        (
            "PUT",
            "/api/policies/novhost/p",
            Some(json!({"pattern": ".*", "definition": {"max-length": 3}})),
            404,
            None,
        ),
        ("DELETE", "/api/parameters/shovel/%2F/nope", None, 404, None),
        ("DELETE", "/api/vhosts/novhost", None, 404, None),
        ("DELETE", "/api/users/u1", None, 204, None),
    ];
    for (method, path, body, status, reason) in checks {
        let a = call(port, method, path, body);
        assert_eq!(
            a.status,
            status,
            "{method} {path}: {}",
            String::from_utf8_lossy(&a.body)
        );
        if let Some(reason) = reason {
            assert_eq!(a.json()["reason"], reason, "{method} {path}");
        }
    }
    // None of them changed anything: guest's permissions on / are as they were.
    let p = call(port, "GET", "/api/permissions/%2F/guest", None).json();
    assert_eq!(p["configure"], ".*", "{p}");
    assert_eq!(call(port, "GET", "/api/users/u1", None).status, 404);
}
