//! The cluster seam (`replicate.rs`) in one process, with a stand-in for the consensus
//! group: a client's durable declare is proposed before the broker sees it, the answer comes
//! after the change was applied, a change the cluster cannot commit is that channel's
//! error, a user without the permission proposes nothing, and transient or passive
//! declares are not changes (a passive one waits for the read barrier).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use warren_core::command::{ExchangeDeclare, Op, QueueDeclare};
use warren_core::effect::{Effect, Reply};
use warren_core::message::FieldTable;
use warren_runtime::replicate::ReplicateFuture;
use warren_runtime::{AdminRequest, BrokerConfig, BrokerHandle, ConnMeta, Replicator};

mod common;
use common::bounded_as;

/// Commits everything (applies it here, as a one-node cluster's applier would) or
/// nothing (no quorum), and records what it was asked.
struct Standin {
    broker: BrokerHandle,
    quorum: bool,
    asked: Mutex<Vec<String>>,
}

impl Replicator for Standin {
    fn replicate(&self, change: AdminRequest) -> ReplicateFuture {
        self.asked.lock().expect("lock").push(format!("{change:?}"));
        let (broker, quorum) = (self.broker.clone(), self.quorum);
        Box::pin(async move {
            if !quorum {
                return Err("no quorum within 5000 ms".into());
            }
            broker
                .admin_local(change)
                .await
                .map_err(|_| "stopped".into())
        })
    }

    fn barrier(
        &self,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), String>> + Send>> {
        self.asked.lock().expect("lock").push("barrier".into());
        Box::pin(async { Ok(()) })
    }
}

fn queue(name: &str, durable: bool, passive: bool) -> Op {
    Op::QueueDeclare(QueueDeclare {
        queue: name.into(),
        passive,
        durable,
        exclusive: false,
        auto_delete: false,
        nowait: false,
        arguments: FieldTable::new(),
    })
}

/// Sends `op` on channel 1 of a fresh AMQP connection as `user`; the first reply or error.
async fn ask(broker: &BrokerHandle, user: &str, op: Op) -> Effect {
    let mut link = broker.connect();
    link.tx.describe(ConnMeta {
        protocol: "AMQP 0-9-1",
        ..Default::default()
    });
    let open = Op::ConnectionOpen {
        vhost: "/".into(),
        user: user.into(),
        cancel_notify: false,
    };
    bounded_as(
        "room in the shard's mailbox",
        link.tx.send(vec![(0, open), (1, Op::ChannelOpen), (1, op)]),
    )
    .await
    .expect("broker running");
    loop {
        let batch = tokio::time::timeout(Duration::from_secs(5), link.rx.recv())
            .await
            .expect("an answer")
            .expect("broker running");
        for e in batch {
            match e {
                Effect::Reply {
                    reply: Reply::ChannelOpenOk,
                    ..
                } => {}
                e @ (Effect::Reply { .. } | Effect::ChannelError { .. }) => return e,
                _ => {}
            }
        }
    }
}

async fn standin(quorum: bool) -> (BrokerHandle, Arc<Standin>) {
    let broker = BrokerHandle::start(BrokerConfig::default());
    let s = Arc::new(Standin {
        broker: broker.clone(),
        quorum,
        asked: Mutex::new(Vec::new()),
    });
    broker.set_replicator(s.clone());
    (broker, s)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn durable_declares_are_proposed_first_and_answered_after() {
    let (broker, s) = standin(true).await;
    let e = ask(&broker, "guest", queue("dq", true, false)).await;
    assert!(
        matches!(
            e,
            Effect::Reply {
                reply: Reply::QueueDeclareOk { .. },
                ..
            }
        ),
        "{e:?}"
    );
    assert_eq!(s.asked.lock().expect("lock").len(), 1, "proposed once");
    // Transient: the node's own, not proposed. Passive: waits for the barrier only. A
    // redeclare of what exists: answered here.
    ask(&broker, "guest", queue("tq", false, false)).await;
    ask(&broker, "guest", queue("dq", true, true)).await;
    ask(&broker, "guest", queue("dq", true, false)).await;
    let asked = s.asked.lock().expect("lock").clone();
    assert_eq!(asked.len(), 2, "{asked:?}");
    assert_eq!(asked[1], "barrier");
    // Operators' changes go through it too.
    broker
        .admin(AdminRequest::AddVhost(warren_core::access::VhostDef {
            name: "v2".into(),
            description: String::new(),
        }))
        .await
        .expect("broker running");
    assert_eq!(s.asked.lock().expect("lock").len(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_quorum_the_change_is_a_channel_error_and_nothing_changes() {
    let (broker, _s) = standin(false).await;
    let x = Op::ExchangeDeclare(ExchangeDeclare {
        exchange: "dx".into(),
        kind: "topic".into(),
        passive: false,
        durable: true,
        auto_delete: false,
        internal: false,
        nowait: false,
        arguments: FieldTable::new(),
    });
    match ask(&broker, "guest", x).await {
        Effect::ChannelError { error, .. } => {
            assert_eq!(error.code.code(), 406);
            assert!(
                error.text.contains("metadata store unavailable"),
                "{}",
                error.text
            );
        }
        other => panic!("{other:?}"),
    }
    let listed = broker
        .admin(AdminRequest::ListExchanges)
        .await
        .expect("broker running");
    assert!(!format!("{listed:?}").contains("\"dx\""), "{listed:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_without_the_permission_proposes_nothing() {
    let (broker, s) = standin(true).await;
    broker
        .admin_local(AdminRequest::AddUser(warren_core::access::UserDef {
            name: "ro".into(),
            password_hash: Vec::new(),
            tags: Vec::new(),
        }))
        .await
        .expect("broker running");
    broker
        .admin_local(AdminRequest::SetPermissions(
            warren_core::access::PermissionDef {
                user: "ro".into(),
                vhost: "/".into(),
                configure: "^$".into(),
                write: ".*".into(),
                read: ".*".into(),
            },
        ))
        .await
        .expect("broker running");
    match ask(&broker, "ro", queue("nope", true, false)).await {
        Effect::ChannelError { error, .. } => assert_eq!(error.code.code(), 403),
        other => panic!("{other:?}"),
    }
    assert!(s.asked.lock().expect("lock").is_empty());
}
