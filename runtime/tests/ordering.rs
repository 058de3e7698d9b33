//! The runtime's ordering promise: a connection's disconnect (its last sender dropped) is
//! applied after every op batch it sent, even though the two travel on different channels.

use bytes::Bytes;
use std::sync::Arc;
use warren_core::command::{Op, Publish, QueueDeclare};
use warren_core::message::{FieldTable, Properties};
use warren_runtime::{AdminRequest, AdminResponse, BrokerConfig, BrokerHandle};

mod common;
use common::bounded_as;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disconnect_never_overtakes_the_ops_sent_before_it() {
    let broker = BrokerHandle::start(BrokerConfig::default());
    let declare = Op::QueueDeclare(QueueDeclare {
        queue: "q".into(),
        passive: false,
        durable: false,
        exclusive: false,
        auto_delete: false,
        nowait: false,
        arguments: FieldTable::new(),
    });
    let declared = broker
        .admin(AdminRequest::Op {
            vhost: "/".into(),
            op: declare,
        })
        .await;
    assert!(
        matches!(declared, Ok(AdminResponse::Op(Ok(_)))),
        "{declared:?}"
    );
    const CONNECTIONS: usize = 200;
    for i in 0..CONNECTIONS {
        let link = broker.connect();
        let publish = Publish {
            exchange: Arc::from(""),
            routing_key: Arc::from("q"),
            mandatory: false,
            immediate: false,
            properties: Properties::default(),
            body: Bytes::from(format!("m{i}")),
            routed: None,
        };
        let ops = vec![
            (
                0,
                Op::ConnectionOpen {
                    vhost: "/".into(),
                    user: "guest".into(),
                    cancel_notify: false,
                },
            ),
            (1, Op::ChannelOpen),
            (1, Op::Publish(Box::new(publish))),
        ];
        bounded_as("room in the shard's mailbox", link.tx.send(ops))
            .await
            .expect("broker running");
        // Gone at once: the disconnect races the batch above to the broker task.
        drop(link);
    }
    // Admin requests may overtake op batches still queued: wait (bounded) for all of them.
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let queues = match broker.admin(AdminRequest::ListQueues).await {
            Ok(AdminResponse::Queues(q)) => q,
            other => panic!("{other:?}"),
        };
        let ready = queues
            .iter()
            .find(|q| q.name == "q")
            .map_or(0, |q| q.messages_ready);
        let conns = match broker.admin(AdminRequest::ListConnections).await {
            Ok(AdminResponse::Connections(c)) => c.len(),
            other => panic!("{other:?}"),
        };
        if ready == CONNECTIONS as u64 && conns == 0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "after 10 s: {ready} of {CONNECTIONS} publishes applied, {conns} connections left"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}
