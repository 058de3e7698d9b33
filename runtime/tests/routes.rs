//! Routing on connection tasks: publishes are routed on the broker's published table before
//! they reach the broker task. What a client learned from a reply (a bind-ok) must already be
//! in the table another connection routes on, so the runtime publishes the table before it
//! sends a turn's replies.

use bytes::Bytes;
use std::sync::Arc;
use std::time::Duration;
use warren_core::command::{Bind, Op, Publish, QueueDeclare};
use warren_core::effect::{Effect, Reply};
use warren_core::message::{FieldTable, FieldValue, Properties};
use warren_runtime::{BrokerConfig, BrokerHandle, Connection};

mod common;
use common::bounded_as;

fn open() -> Vec<(u16, Op)> {
    vec![
        (
            0,
            Op::ConnectionOpen {
                vhost: "/".into(),
                user: "guest".into(),
                cancel_notify: false,
            },
        ),
        (1, Op::ChannelOpen),
    ]
}

/// Waits (bounded) for the first reply matching `want`, skipping other effects.
async fn reply(link: &mut Connection, want: impl Fn(&Reply) -> bool) -> Reply {
    let wait = async {
        loop {
            let batch = link.rx.recv().await.expect("broker running");
            for effect in batch {
                if let Effect::Reply { reply, .. } = effect
                    && want(&reply)
                {
                    return reply;
                }
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(10), wait)
        .await
        .expect("reply within 10 s")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bind_acknowledged_to_one_client_routes_the_next_publish_of_another() {
    let broker = BrokerHandle::start(BrokerConfig::default());
    let mut a = broker.connect();
    let b = broker.connect();
    bounded_as("room in the shard's mailbox", a.tx.send(open()))
        .await
        .expect("broker running");
    bounded_as("room in the shard's mailbox", b.tx.send(open()))
        .await
        .expect("broker running");
    const ROUNDS: usize = 300;
    for i in 0..ROUNDS {
        let (queue, key) = (format!("q{i}"), format!("k{i}"));
        bounded_as(
            "room in the shard's mailbox",
            a.tx.send(vec![
                (
                    1,
                    Op::QueueDeclare(QueueDeclare {
                        queue: queue.clone(),
                        passive: false,
                        durable: false,
                        exclusive: false,
                        auto_delete: false,
                        nowait: true,
                        arguments: FieldTable::new(),
                    }),
                ),
                (
                    1,
                    Op::QueueBind(Bind {
                        destination: queue.clone(),
                        source: "amq.direct".into(),
                        routing_key: key.clone(),
                        nowait: false,
                        arguments: FieldTable::new(),
                    }),
                ),
            ]),
        )
        .await
        .expect("broker running");
        reply(&mut a, |r| matches!(r, Reply::QueueBindOk)).await;
        // `a` has its bind-ok: `b`'s publish, routed on `b`'s task, must see the binding.
        let publish = Publish {
            exchange: Arc::from("amq.direct"),
            routing_key: Arc::from(key.as_str()),
            mandatory: false,
            immediate: false,
            properties: Properties::default(),
            body: Bytes::from(format!("m{i}")),
            routed: None,
        };
        bounded_as(
            "room in the shard's mailbox",
            b.tx.send(vec![(1, Op::Publish(Box::new(publish)))]),
        )
        .await
        .expect("broker running");
        bounded_as(
            "room in the shard's mailbox",
            a.tx.send(vec![(
                1,
                Op::Get {
                    queue,
                    no_ack: true,
                },
            )]),
        )
        .await
        .expect("broker running");
        let got = reply(&mut a, |r| {
            matches!(r, Reply::GetEmpty | Reply::GetOk { .. })
        })
        .await;
        assert!(
            matches!(got, Reply::GetOk { .. }),
            "round {i}: the publish missed a binding acknowledged before it: {got:?}"
        );
    }
}

fn declare(queue: &str) -> (u16, Op) {
    (
        1,
        Op::QueueDeclare(QueueDeclare {
            queue: queue.into(),
            passive: false,
            durable: false,
            exclusive: false,
            auto_delete: false,
            nowait: true,
            arguments: FieldTable::new(),
        }),
    )
}

fn bind(queue: &str, exchange: &str, key: &str, arguments: FieldTable) -> (u16, Op) {
    (
        1,
        Op::QueueBind(Bind {
            destination: queue.into(),
            source: exchange.into(),
            routing_key: key.into(),
            nowait: false,
            arguments,
        }),
    )
}

fn publish(exchange: &str, key: &str, headers: Option<FieldTable>, body: &str) -> (u16, Op) {
    (
        1,
        Op::Publish(Box::new(Publish {
            exchange: Arc::from(exchange),
            routing_key: Arc::from(key),
            mandatory: false,
            immediate: false,
            properties: Properties {
                headers,
                ..Properties::default()
            },
            body: Bytes::from(body.to_string()),
            routed: None,
        })),
    )
}

/// The body of the message `queue` holds next, `None` when it is empty.
async fn get(link: &mut Connection, queue: &str) -> Option<Bytes> {
    bounded_as(
        "room in the shard's mailbox",
        link.tx.send(vec![(
            1,
            Op::Get {
                queue: queue.into(),
                no_ack: true,
            },
        )]),
    )
    .await
    .expect("broker running");
    match reply(link, |r| matches!(r, Reply::GetEmpty | Reply::GetOk { .. })).await {
        Reply::GetOk { delivery, .. } => Some(delivery.message.body.clone()),
        _ => None,
    }
}

/// A connection task reuses its last routing result for a publish with the same exchange and
/// key (`route_repeated`), but only on the same table: a binding another client made in
/// between (acknowledged before the publish) must route the repeat. Fails when the reuse
/// ignores which table the result came from (the repeat then reaches no queue).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_publish_sees_a_binding_made_since_the_first() {
    let broker = BrokerHandle::start(BrokerConfig::default());
    let mut a = broker.connect();
    let b = broker.connect();
    bounded_as("room in the shard's mailbox", a.tx.send(open()))
        .await
        .expect("broker running");
    bounded_as("room in the shard's mailbox", b.tx.send(open()))
        .await
        .expect("broker running");
    for i in 0..50 {
        let (queue, key) = (format!("rq{i}"), format!("rk{i}"));
        // Routed to nothing: no binding yet.
        bounded_as(
            "room in the shard's mailbox",
            b.tx.send(vec![publish("amq.direct", &key, None, "before")]),
        )
        .await
        .expect("broker running");
        bounded_as(
            "room in the shard's mailbox",
            a.tx.send(vec![
                declare(&queue),
                bind(&queue, "amq.direct", &key, FieldTable::new()),
            ]),
        )
        .await
        .expect("broker running");
        reply(&mut a, |r| matches!(r, Reply::QueueBindOk)).await;
        bounded_as(
            "room in the shard's mailbox",
            b.tx.send(vec![publish("amq.direct", &key, None, "after")]),
        )
        .await
        .expect("broker running");
        assert_eq!(
            get(&mut a, &queue).await.as_deref(),
            Some(&b"after"[..]),
            "round {i}: the repeated publish missed the new binding"
        );
    }
}

/// Publishes with the same exchange and key but different headers route apart on a headers
/// exchange, in one batch (one table, one thread): a result that read headers is never
/// reused. Fails when it is (the second message then follows the first into `h1`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publishes_differing_only_in_headers_route_apart() {
    let broker = BrokerHandle::start(BrokerConfig::default());
    let mut a = broker.connect();
    bounded_as("room in the shard's mailbox", a.tx.send(open()))
        .await
        .expect("broker running");
    let table = |v: &str| {
        let mut t = FieldTable::new();
        t.insert("h".into(), FieldValue::string(v));
        t
    };
    bounded_as(
        "room in the shard's mailbox",
        a.tx.send(vec![
            declare("h1"),
            declare("h2"),
            bind("h1", "amq.headers", "", table("1")),
            bind("h2", "amq.headers", "", table("2")),
        ]),
    )
    .await
    .expect("broker running");
    // Both bind-oks may come in one batch, which `reply` takes whole: wait for one (the
    // broker reroutes a publish routed on a table older than its own connection's binds).
    reply(&mut a, |r| matches!(r, Reply::QueueBindOk)).await;
    bounded_as(
        "room in the shard's mailbox",
        a.tx.send(vec![
            publish("amq.headers", "k", Some(table("1")), "one"),
            publish("amq.headers", "k", Some(table("2")), "two"),
        ]),
    )
    .await
    .expect("broker running");
    assert_eq!(get(&mut a, "h1").await.as_deref(), Some(&b"one"[..]));
    assert_eq!(get(&mut a, "h2").await.as_deref(), Some(&b"two"[..]));
    assert_eq!(get(&mut a, "h1").await, None);
}
