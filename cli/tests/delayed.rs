//! Delayed delivery through a `kill -9` (docs/delayed.md): `warren serve` with confirmed
//! schedules pending is killed; what fell due while it was down is delivered at start, in
//! due order, the rest when due; nothing confirmed is lost.

mod common;

use common::*;
use futures_lite::StreamExt;
use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, ExchangeKind};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

fn unix_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_millis() as i64
}

fn table(pairs: &[(&str, AMQPValue)]) -> FieldTable {
    let mut t = FieldTable::default();
    for (k, v) in pairs {
        t.insert((*k).into(), v.clone());
    }
    t
}

/// Messages due while the broker is down, and after its restart.
const WHILE_DOWN: usize = 100;
const AFTER: usize = 100;

#[test]
fn confirmed_schedules_survive_kill_9_and_fall_due_in_order() {
    let dir = scratch_dir("delayed", "kill9");
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let broker = Killed(serve(&dir, false, &[]));
    let base = unix_ms();
    // (due time, body), published in a scrambled order.
    let mut due: Vec<(i64, String)> = (0..WHILE_DOWN)
        .map(|i| (base + 1_000 + 3 * i as i64, format!("down-{i:03}")))
        .chain((0..AFTER).map(|i| (base + 6_000 + 5 * i as i64, format!("after-{i:03}"))))
        .collect();
    let mut scrambled = due.clone();
    scrambled.sort_by_key(|(at, _)| (at * 7919) % 1009);
    rt.block_on(async {
        let (_c, ch) = channel(broker.0.amqp).await;
        bounded(ch.exchange_declare(
            "delayed".into(),
            ExchangeKind::Custom("x-delayed-message".into()),
            ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            },
            table(&[(
                "x-delayed-type",
                AMQPValue::LongString(LongString::from("direct")),
            )]),
        ))
        .await
        .expect("declare");
        bounded(ch.queue_declare(
            "q".into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        ))
        .await
        .expect("queue");
        bounded(ch.queue_bind(
            "q".into(),
            "delayed".into(),
            "k".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        ))
        .await
        .expect("bind");
        bounded(ch.confirm_select(ConfirmSelectOptions::default()))
            .await
            .expect("confirms");
        let mut confirms = Vec::new();
        for (at, body) in &scrambled {
            let props = BasicProperties::default()
                .with_delivery_mode(2)
                .with_headers(table(&[("x-deliver-at", AMQPValue::LongLongInt(*at))]));
            confirms.push(
                bounded(ch.basic_publish(
                    "delayed".into(),
                    "k".into(),
                    BasicPublishOptions::default(),
                    body.as_bytes(),
                    props,
                ))
                .await
                .expect("publish"),
            );
        }
        for c in confirms {
            assert!(bounded(c).await.expect("confirm").is_ack());
        }
    });
    // Every schedule confirmed: kill -9 at once, and stay down until the first batch is due.
    drop(broker);
    let down_until = base + 1_000 + 3 * WHILE_DOWN as i64 + 500;
    std::thread::sleep(Duration::from_millis((down_until - unix_ms()).max(0) as u64));
    let broker = Killed(serve(&dir, false, &[]));
    due.sort();
    rt.block_on(async {
        let (_c, ch) = channel(broker.0.amqp).await;
        let mut consumer = bounded(ch.basic_consume(
            "q".into(),
            "t".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        ))
        .await
        .expect("consume");
        let mut got = Vec::new();
        while got.len() < due.len() {
            let d = tokio::time::timeout(Duration::from_secs(15), consumer.next())
                .await
                .expect("every scheduled message within 15 s")
                .expect("a delivery")
                .expect("no error");
            let body = String::from_utf8_lossy(&d.data).into_owned();
            if body.starts_with("after-") {
                let at = due.iter().find(|(_, b)| *b == body).map(|(at, _)| *at);
                assert!(
                    at.is_some_and(|at| unix_ms() >= at),
                    "{body} delivered before its time"
                );
            }
            got.push(body);
        }
        let want: Vec<String> = due.iter().map(|(_, b)| b.clone()).collect();
        assert_eq!(got, want, "in due order, none lost");
    });
    drop(broker);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn operators_see_and_purge_an_exchanges_schedule() {
    let dir = scratch_dir("delayed", "operators");
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let broker = Killed(serve(
        &dir,
        false,
        &["--management", "127.0.0.1:0", "--prometheus", "127.0.0.1:0"],
    ));
    let base = unix_ms();
    rt.block_on(async {
        let (_c, ch) = channel(broker.0.amqp).await;
        bounded(ch.exchange_declare(
            "d".into(),
            ExchangeKind::Custom("x-delayed-message".into()),
            ExchangeDeclareOptions::default(),
            table(&[(
                "x-delayed-type",
                AMQPValue::LongString(LongString::from("fanout")),
            )]),
        ))
        .await
        .expect("declare");
        bounded(ch.confirm_select(ConfirmSelectOptions::default()))
            .await
            .expect("confirms");
        for i in 0..3 {
            let props = BasicProperties::default()
                .with_headers(table(&[("x-delay", AMQPValue::LongLongInt(60_000 + i))]));
            let c = bounded(ch.basic_publish(
                "d".into(),
                "".into(),
                BasicPublishOptions::default(),
                b"x",
                props,
            ))
            .await
            .expect("publish");
            assert!(bounded(c).await.expect("confirm").is_ack());
        }
    });
    let api = broker.0.management.expect("HTTP API port");
    let x = http::call(api, "GET", "/api/exchanges/%2f/d", None).json();
    assert_eq!(x["type"], "x-delayed-message", "{x}");
    assert_eq!(x["messages_delayed"], 3, "{x}");
    let next = x["next_due"].as_i64().expect("next_due");
    assert!((base + 60_000..base + 70_000).contains(&next), "{next}");
    let prom = broker.0.prometheus.expect("Prometheus port");
    let text = http::raw(prom, "GET", "/metrics", &[], b"").text();
    assert!(
        text.contains("warren_scheduled_messages{vhost=\"/\",exchange=\"d\"} 3"),
        "{text}"
    );
    let purged = http::call(api, "DELETE", "/api/exchanges/%2f/d/scheduled", None).json();
    assert_eq!(purged["purged"], 3, "{purged}");
    let x = http::call(api, "GET", "/api/exchanges/%2f/d", None).json();
    assert_eq!(x["messages_delayed"], 0, "{x}");
    drop(broker);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `warren ctl` over the admin socket, with its output as text; fails the test if it fails.
fn ctl(dir: &std::path::Path, args: &[&str]) -> String {
    let out = std::process::Command::new(BIN)
        .arg("ctl")
        .arg("--data-dir")
        .arg(dir)
        .args(args)
        .output()
        .expect("run warren ctl");
    assert!(
        out.status.success(),
        "warren ctl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The listing's (exchange, messages) rows, from its JSON form.
fn scheduled(dir: &std::path::Path) -> Vec<(String, u64)> {
    let text = ctl(dir, &["--format", "json", "list-scheduled"]);
    let rows: serde_json::Value = serde_json::from_str(&text).expect("JSON listing");
    rows.as_array()
        .expect("a JSON array")
        .iter()
        .map(|r| {
            let x = r["exchange"].as_str().expect("exchange").to_string();
            (x, r["messages"].as_u64().expect("messages"))
        })
        .collect()
}

#[test]
fn ctl_lists_and_purges_schedules_and_both_survive_restarts() {
    let dir = scratch_dir("delayed", "ctl");
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let broker = Killed(serve(&dir, false, &[]));
    rt.block_on(async {
        let (_c, ch) = channel(broker.0.amqp).await;
        for x in ["later", "keep"] {
            bounded(ch.exchange_declare(
                x.into(),
                ExchangeKind::Custom("x-delayed-message".into()),
                ExchangeDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                table(&[(
                    "x-delayed-type",
                    AMQPValue::LongString(LongString::from("fanout")),
                )]),
            ))
            .await
            .expect("declare");
        }
        bounded(ch.confirm_select(ConfirmSelectOptions::default()))
            .await
            .expect("confirms");
        for (x, n) in [("later", 3), ("keep", 2)] {
            for i in 0..n {
                let props = BasicProperties::default()
                    .with_delivery_mode(2)
                    .with_headers(table(&[("x-delay", AMQPValue::LongLongInt(600_000 + i))]));
                let c = bounded(ch.basic_publish(
                    x.into(),
                    "".into(),
                    BasicPublishOptions::default(),
                    b"x",
                    props,
                ))
                .await
                .expect("publish");
                assert!(bounded(c).await.expect("confirm").is_ack());
            }
        }
    });
    let want = vec![("keep".to_string(), 2), ("later".to_string(), 3)];
    assert_eq!(scheduled(&dir), want);
    let text = ctl(&dir, &["list-scheduled"]);
    assert!(
        text.contains("later") && text.contains("next_due"),
        "{text}"
    );
    // Schedules are durable: the same listing after a kill -9.
    drop(broker);
    let broker = Killed(serve(&dir, false, &[]));
    assert_eq!(scheduled(&dir), want);
    let text = ctl(&dir, &["purge-scheduled", "later"]);
    assert_eq!(
        text.trim(),
        "Purged 3 scheduled messages of exchange 'later'"
    );
    assert_eq!(scheduled(&dir), vec![("keep".to_string(), 2)]);
    // The purge is durable too: the purged ones do not come back, the others stay. A
    // removal is synced within `removal_sync_ms` (200 ms, as an ack's; docs/storage.md), so
    // the kill comes after that.
    std::thread::sleep(Duration::from_millis(1_000));
    drop(broker);
    let broker = Killed(serve(&dir, false, &[]));
    assert_eq!(scheduled(&dir), vec![("keep".to_string(), 2)]);
    // Another vhost's listing does not show this one's (and an unknown vhost is an error).
    let out = std::process::Command::new(BIN)
        .args(["ctl", "--data-dir"])
        .arg(&dir)
        .args(["-p", "nope", "list-scheduled"])
        .output()
        .expect("run warren ctl");
    assert!(!out.status.success(), "an unknown vhost is refused");
    drop(broker);
    let _ = std::fs::remove_dir_all(&dir);
}
