//! Routing on connection tasks: publishes are routed on the broker's published table before
//! they reach the broker task. What a client learned from a reply (a bind-ok) must already be
//! in the table another connection routes on, so the runtime publishes the table before it
//! sends a turn's replies.

use bytes::Bytes;
use std::sync::Arc;
use std::time::Duration;
use warren_core::command::{Bind, Op, Publish, QueueDeclare};
use warren_core::effect::{Effect, Reply};
use warren_core::message::{FieldTable, Properties};
use warren_runtime::{BrokerConfig, BrokerHandle, Connection};

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
    a.tx.send(open()).await.expect("broker running");
    b.tx.send(open()).await.expect("broker running");
    const ROUNDS: usize = 300;
    for i in 0..ROUNDS {
        let (queue, key) = (format!("q{i}"), format!("k{i}"));
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
        ])
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
        b.tx.send(vec![(1, Op::Publish(Box::new(publish)))])
            .await
            .expect("broker running");
        a.tx.send(vec![(
            1,
            Op::Get {
                queue,
                no_ack: true,
            },
        )])
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
