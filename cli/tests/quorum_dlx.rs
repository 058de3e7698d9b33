//! At-least-once dead-lettering of a quorum queue on one `warren serve` (lapin): messages
//! rejected and expired while their dead-letter exchange routes nowhere stay in the queue,
//! a kill -9 loses none of them, and once a queue is bound they arrive there exactly once,
//! with `x-death`; a second kill -9 brings none back to forward again.

use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable, ShortString};
use std::collections::BTreeSet;
use std::process::Child;
use std::time::Duration;

mod common;
use common::{bounded, channel};

/// Kills the broker when dropped, also when the test fails midway.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn durable() -> QueueDeclareOptions {
    QueueDeclareOptions {
        durable: true,
        ..Default::default()
    }
}

fn source_args() -> FieldTable {
    let mut t = FieldTable::default();
    for (k, v) in [
        ("x-queue-type", "quorum"),
        ("x-dead-letter-exchange", "dlx"),
        ("x-dead-letter-strategy", "at-least-once"),
        ("x-overflow", "reject-publish"),
    ] {
        t.insert(ShortString::from(k), AMQPValue::LongString(v.into()));
    }
    t
}

/// Messages in `queue` (a passive declare).
async fn count(ch: &lapin::Channel, queue: &str) -> u32 {
    bounded(ch.queue_declare(
        queue.into(),
        QueueDeclareOptions {
            passive: true,
            ..Default::default()
        },
        FieldTable::default(),
    ))
    .await
    .expect("passive declare")
    .message_count()
}

/// Waits (bounded) until `queue` holds `n` messages; returns what it holds then.
async fn wait_for(ch: &lapin::Channel, queue: &str, n: u32) -> u32 {
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    loop {
        let c = count(ch, queue).await;
        if c >= n || std::time::Instant::now() > deadline {
            return c;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn death_reason(props: &lapin::BasicProperties) -> Option<String> {
    let deaths = props.headers().as_ref()?.inner().get("x-death")?.clone();
    let AMQPValue::FieldArray(items) = deaths else {
        return None;
    };
    let AMQPValue::FieldTable(first) = items.as_slice().first()?.clone() else {
        return None;
    };
    match first.inner().get("reason")? {
        AMQPValue::LongString(s) => Some(s.to_string()),
        other => Some(format!("{other:?}")),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_survive_kill_9_and_arrive_exactly_once_when_routable() {
    let dir = std::env::temp_dir().join(format!("warren-quorum-dlx-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let served = common::serve(&dir, false, &[]);
    let log = served.log.clone();
    let running = Running(served.child);
    let (c, ch) = channel(served.amqp).await;
    // Without reject-publish, RabbitMQ 3.10 falls back to at-most-once and says so.
    let mut fallback = source_args();
    fallback.insert(
        ShortString::from("x-overflow"),
        AMQPValue::LongString("drop-head".into()),
    );
    bounded(ch.queue_declare("fallback".into(), durable(), fallback))
        .await
        .expect("declared, at most once");
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while !log.lock().expect("log").iter().any(|l| {
        l.contains("Falling back to dead-letter-strategy at-most-once") && l.contains("fallback")
    }) {
        assert!(
            std::time::Instant::now() < deadline,
            "no warning for the fallback"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    bounded(ch.exchange_declare(
        "dlx".into(),
        lapin::ExchangeKind::Direct,
        ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    ))
    .await
    .expect("dlx");
    bounded(ch.queue_declare("src".into(), durable(), source_args()))
        .await
        .expect("an at-least-once quorum queue");
    // The target exists but nothing routes to it yet.
    bounded(ch.queue_declare("dlq".into(), durable(), FieldTable::default()))
        .await
        .expect("dlq");
    bounded(ch.confirm_select(Default::default()))
        .await
        .expect("confirms");
    let persistent = lapin::BasicProperties::default().with_delivery_mode(2);
    for i in 0..10 {
        bounded(ch.basic_publish(
            "".into(),
            "src".into(),
            Default::default(),
            format!("r{i}").as_bytes(),
            persistent.clone(),
        ))
        .await
        .expect("publish");
    }
    for i in 0..10 {
        bounded(ch.basic_publish(
            "".into(),
            "src".into(),
            Default::default(),
            format!("e{i}").as_bytes(),
            persistent.clone().with_expiration("200".into()),
        ))
        .await
        .expect("publish");
    }
    assert!(
        bounded(ch.wait_for_confirms())
            .await
            .expect("confirms")
            .is_empty()
    );
    // r0..r9 rejected without requeue; e0..e9 then expire at the head.
    for _ in 0..10 {
        let m = bounded(ch.basic_get("src".into(), BasicGetOptions { no_ack: false }))
            .await
            .expect("get")
            .expect("a message");
        bounded(m.delivery.reject(BasicRejectOptions { requeue: false }))
            .await
            .expect("reject");
    }
    tokio::time::sleep(Duration::from_millis(600)).await;
    // Expiry is checked at the head when the queue is looked at: a get finds none.
    let none = bounded(ch.basic_get("src".into(), BasicGetOptions { no_ack: true }))
        .await
        .expect("get");
    assert!(none.is_none(), "all expired");
    // A confirmed publish: its sync covers the dead letters written before it.
    bounded(ch.basic_publish(
        "".into(),
        "other".into(),
        Default::default(),
        b"sync",
        persistent.clone(),
    ))
    .await
    .expect("publish");
    bounded(ch.wait_for_confirms()).await.expect("confirm");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(count(&ch, "dlq").await, 0, "nothing routes to dlq yet");
    drop((ch, c));
    // kill -9 while 20 dead letters wait for a route.
    drop(running);

    let served = common::serve(&dir, false, &["--management", "127.0.0.1:0"]);
    let api = served.management.expect("the HTTP API");
    let log = served.log.clone();
    let running = Running(served.child);
    let (_c, ch) = channel(served.amqp).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(count(&ch, "dlq").await, 0, "still nothing routes to dlq");
    // The held dead letters are in the listings (RabbitMQ's messages_dlx) and logged.
    let q = common::http::call(api, "GET", "/api/queues/%2f/src", None).json();
    assert_eq!(q["messages_dlx"], 20, "{q}");
    let listed = std::process::Command::new(common::BIN)
        .args(["ctl", "--data-dir"])
        .arg(&dir)
        .args(["list-queues", "name", "messages_dlx"])
        .output()
        .expect("warren ctl");
    let table = String::from_utf8_lossy(&listed.stdout);
    assert!(
        table
            .lines()
            .any(|l| l.split_whitespace().eq(["src", "20"])),
        "{table}"
    );
    let logged = |what: &str| {
        log.lock()
            .expect("log")
            .iter()
            .filter(|l| l.contains("at-least-once dead letters of queue src ") && l.contains(what))
            .count()
    };
    assert_eq!(
        logged("held: a dead letter reached no queue"),
        1,
        "logged once, not per retry"
    );
    bounded(ch.queue_bind(
        "dlq".into(),
        "dlx".into(),
        "src".into(),
        Default::default(),
        FieldTable::default(),
    ))
    .await
    .expect("bind");
    assert_eq!(
        wait_for(&ch, "dlq", 20).await,
        20,
        "every dead letter arrived"
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while logged("taken again") == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "no log line for the release"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let q = common::http::call(api, "GET", "/api/queues/%2f/src", None).json();
    assert_eq!(q["messages_dlx"], 0, "{q}");
    // Settled at the source: no second copy comes, not even after another kill -9.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(count(&ch, "dlq").await, 20, "none twice");
    drop(ch);
    drop(running);
    let served = common::serve(&dir, false, &[]);
    let running = Running(served.child);
    let (_c, ch) = channel(served.amqp).await;
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let mut bodies = BTreeSet::new();
    let mut reasons = BTreeSet::new();
    while let Some(m) = bounded(ch.basic_get("dlq".into(), BasicGetOptions { no_ack: true }))
        .await
        .expect("get")
    {
        let body = String::from_utf8_lossy(&m.delivery.data).into_owned();
        reasons.insert((body.chars().next(), death_reason(&m.delivery.properties)));
        assert!(bodies.insert(body.clone()), "{body} twice");
        assert!(bodies.len() <= 20);
    }
    let want: BTreeSet<String> = (0..10)
        .flat_map(|i| [format!("r{i}"), format!("e{i}")])
        .collect();
    assert_eq!(bodies, want);
    assert_eq!(
        reasons,
        BTreeSet::from([
            (Some('e'), Some("expired".to_string())),
            (Some('r'), Some("rejected".to_string())),
        ])
    );
    drop(running);
    let _ = std::fs::remove_dir_all(&dir);
}
