//! A quorum queue reloaded when its group's leader moves (docs/cluster.md, "Quorum queues"):
//! its consumers, on its node and on others, keep the deliveries they got before, while the
//! reloaded queue has those messages again (the group never saw them settled). As RabbitMQ
//! returns a quorum queue's checked-out messages, they are delivered again, flagged
//! redelivered; a settle of a delivery made before the reload (ack, requeue or reject) is
//! stale and ignored, so no message is duplicated, dropped or settled twice, and the queue
//! never takes back a sequence number it did not issue (the debug assertion that panicked a
//! node in jepsen's `three_nodes_quorum_queue_under_faults`).
//!
//! Two brokers stand for two nodes (the test carries their `NodeMail`), and they share one
//! in-memory store that stands for the group's replicated state: the node that leads serves
//! it, the other reads and writes nothing, as `member/src/qq.rs`'s layer does.

mod common;

use bytes::Bytes;
use common::{Harness, deliveries};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use warren_core::admin::AdminRequest;
use warren_core::command::{Op, Publish, QueueDeclare};
use warren_core::effect::{Effect, Reply};
use warren_core::ids::QueueId;
use warren_core::message::{FieldTable, FieldValue, Message, Properties};
use warren_core::store::{
    DefinitionChange, MemoryStore, QueueRecovery, Store, StoreError, StoredMessage,
};
use warren_core::{Broker, BrokerConfig, NodeMail};

/// One node's view of the group: the shared copy while this node leads, nothing otherwise.
struct Member {
    group: MemoryStore,
    leading: Arc<AtomicBool>,
}

impl Member {
    fn leads(&self) -> bool {
        self.leading.load(Ordering::SeqCst)
    }
}

impl Store for Member {
    fn define(&mut self, change: DefinitionChange<'_>) -> Result<(), StoreError> {
        self.group.define(change)
    }
    fn open_queue(&mut self, q: QueueId, vhost: &str, name: &str, durable: bool) -> QueueRecovery {
        let recovery = self.group.open_queue(q, vhost, name, durable);
        if self.leads() {
            recovery
        } else {
            QueueRecovery::default()
        }
    }
    fn append(
        &mut self,
        q: QueueId,
        seq: u64,
        m: &Arc<Message>,
        expires_at: Option<u64>,
    ) -> Result<(), StoreError> {
        if !self.leads() {
            return Err(StoreError("not the leader".into()));
        }
        self.group.append(q, seq, m, expires_at)
    }
    fn serves(&self, _: QueueId) -> bool {
        self.leads()
    }
    fn remove(&mut self, q: QueueId, seq: u64) {
        if self.leads() {
            self.group.remove(q, seq);
        }
    }
    fn remove_from(&mut self, q: QueueId, from_seq: u64) {
        if self.leads() {
            self.group.remove_from(q, from_seq);
        }
    }
    fn read(
        &mut self,
        q: QueueId,
        from_seq: u64,
        max: usize,
        out: &mut Vec<StoredMessage>,
    ) -> Result<(), StoreError> {
        // A node reads the group's copy only after a reload here: every message it holds
        // then may have been delivered before (`member/src/qq.rs` flags them so too).
        let from = out.len();
        self.group.read(q, from_seq, max, out)?;
        for m in &mut out[from..] {
            m.redelivered = true;
        }
        Ok(())
    }
    fn delete_queue(&mut self, q: QueueId) {
        self.group.delete_queue(q);
    }
    fn sync(&mut self, epoch: u64) {
        self.group.sync(epoch);
    }
}

struct Node {
    h: Harness,
    leading: Arc<AtomicBool>,
    c: warren_core::ids::ChannelRef,
}

fn node(group: &MemoryStore, leading: bool) -> Node {
    let leading = Arc::new(AtomicBool::new(leading));
    let store = Member {
        group: group.clone(),
        leading: leading.clone(),
    };
    let mut h = Harness::of(vec![Broker::with_store(
        BrokerConfig::default(),
        Box::new(store),
    )]);
    let c = h.connect(1);
    let mut arguments = FieldTable::new();
    arguments.insert("x-queue-type".into(), FieldValue::string("quorum"));
    let fx = h.op(
        c,
        Op::QueueDeclare(QueueDeclare {
            queue: "qq".into(),
            passive: false,
            durable: true,
            exclusive: false,
            auto_delete: false,
            nowait: false,
            arguments,
        }),
    );
    assert!(
        matches!(
            fx.as_slice(),
            [Effect::Reply {
                reply: Reply::QueueDeclareOk { .. },
                ..
            }]
        ),
        "{fx:?}"
    );
    Node { h, leading, c }
}

fn admin(n: &mut Node, request: AdminRequest) {
    let now = n.h.now;
    n.h.shard(0).apply_admin(now, request);
}

fn home_is(n: &mut Node, node: Option<u32>) {
    admin(
        n,
        AdminRequest::QueueHome {
            vhost: "/".into(),
            queue: "qq".into(),
            node,
        },
    );
}

fn reload(n: &mut Node, leading: bool) {
    n.leading.store(leading, Ordering::SeqCst);
    admin(
        n,
        AdminRequest::ReloadQueue {
            vhost: "/".into(),
            name: "qq".into(),
        },
    );
}

fn carry(from: &mut Node, from_id: u32, to: &mut Node) -> usize {
    let mut out: Vec<(u32, NodeMail)> = Vec::new();
    from.h.shard(0).take_node_mail(&mut out);
    let mail: Vec<NodeMail> = out.into_iter().map(|(_, m)| m).collect();
    let n = mail.len();
    let now = to.h.now;
    to.h.shard(0).receive_node_mail(now, from_id, mail);
    n
}

/// Carries mail both ways until it stops; each node's effects.
fn exchange(one: &mut Node, two: &mut Node) -> (Vec<Effect>, Vec<Effect>) {
    let (mut fx1, mut fx2) = (one.h.settle(), two.h.settle());
    for _ in 0..16 {
        let a = carry(two, 2, one);
        fx1.extend(one.h.settle());
        let b = carry(one, 1, two);
        fx2.extend(two.h.settle());
        if a + b == 0 {
            return (fx1, fx2);
        }
    }
    panic!("the nodes never stopped sending");
}

fn publish(n: &mut Node, body: &str) -> Vec<Effect> {
    let mut fx = n.h.op(
        n.c,
        Op::Publish(Box::new(Publish {
            exchange: Arc::from(""),
            routing_key: Arc::from("qq"),
            mandatory: false,
            immediate: false,
            properties: Properties::default(),
            body: Bytes::copy_from_slice(body.as_bytes()),
            routed: None,
        })),
    );
    fx.extend(n.h.sync(0, true));
    fx
}

fn settle(n: &mut Node, tag: u64, op: &str) -> Vec<Effect> {
    let op = match op {
        "ack" => Op::Ack {
            delivery_tag: tag,
            multiple: false,
        },
        "requeue" => Op::Nack {
            delivery_tag: tag,
            multiple: false,
            requeue: true,
        },
        _ => Op::Reject {
            delivery_tag: tag,
            requeue: false,
        },
    };
    let c = n.c;
    n.h.op(c, op)
}

fn ready(n: &mut Node) -> u32 {
    let c = n.c;
    let fx = n.h.passive_declare(c, "qq");
    fx.iter()
        .find_map(|e| match e {
            Effect::Reply {
                reply: Reply::QueueDeclareOk { message_count, .. },
                ..
            } => Some(*message_count),
            _ => None,
        })
        .unwrap_or_else(|| panic!("{fx:?}"))
}

/// (delivery tag, redelivered, body).
fn got(fx: &[Effect]) -> Vec<(u64, bool, String)> {
    deliveries(fx)
        .into_iter()
        .map(|d| (d.1, d.2, d.3))
        .collect()
}

#[test]
fn a_consumer_on_another_node_keeps_its_deliveries_across_the_move_and_their_settles_are_ignored() {
    let group = MemoryStore::new();
    let mut one = node(&group, true);
    let mut two = node(&group, false);
    home_is(&mut two, Some(1));
    two.h.consume(two.c, "qq", "c", false);
    exchange(&mut one, &mut two);
    for body in ["a", "b", "c"] {
        publish(&mut one, body);
    }
    let (_, fx) = exchange(&mut one, &mut two);
    assert_eq!(
        got(&fx),
        vec![
            (1, false, "a".into()),
            (2, false, "b".into()),
            (3, false, "c".into())
        ]
    );

    // The leader moves to node 2: node 1 stops serving, node 2 serves what the group holds
    // (the three messages, unsettled), and the consumer attaches to node 2's own queue.
    reload(&mut one, false);
    reload(&mut two, true);
    home_is(&mut two, None);
    home_is(&mut one, Some(2));
    let (_, fx) = exchange(&mut one, &mut two);
    assert_eq!(
        got(&fx),
        vec![
            (4, true, "a".into()),
            (5, true, "b".into()),
            (6, true, "c".into())
        ],
        "the consumer gets them again, flagged redelivered"
    );

    // Settles of the deliveries made before the move are stale: ignored (no copy requeued,
    // none dropped or dead-lettered, none removed from the group).
    let mut fx = settle(&mut two, 1, "ack");
    fx.extend(settle(&mut two, 2, "requeue"));
    fx.extend(settle(&mut two, 3, "reject"));
    let (fx1, fx2) = exchange(&mut one, &mut two);
    fx.extend(fx2);
    assert!(got(&fx).is_empty(), "nothing delivered again: {fx:?}");
    assert!(got(&fx1).is_empty(), "{fx1:?}");
    assert_eq!(ready(&mut two), 0);

    // The deliveries of the new leader settle as usual: a requeue comes back once, acks
    // leave the group empty.
    let fx = settle(&mut two, 5, "requeue");
    assert_eq!(got(&fx), vec![(7, true, "b".into())]);
    for tag in [4, 6, 7] {
        settle(&mut two, tag, "ack");
    }
    two.h.sync(0, true);
    reload(&mut two, true);
    assert_eq!(ready(&mut two), 0, "the group holds nothing more");
    let (_, fx) = exchange(&mut one, &mut two);
    assert!(got(&fx).is_empty(), "{fx:?}");
}

#[test]
fn a_requeue_on_the_node_that_stopped_leading_is_ignored_and_the_new_leader_redelivers() {
    // The consumer is on node 1, which leads; then node 2 leads and node 1, reloaded empty,
    // gets its client's requeue before it learns where the queue went (the jepsen panic).
    let group = MemoryStore::new();
    let mut one = node(&group, true);
    let mut two = node(&group, false);
    home_is(&mut two, Some(1));
    one.h.consume(one.c, "qq", "c", false);
    let mut fx = publish(&mut one, "a");
    fx.extend(publish(&mut one, "b"));
    fx.extend(exchange(&mut one, &mut two).0);
    let delivered = got(&fx);
    assert_eq!(
        delivered,
        vec![(1, false, "a".into()), (2, false, "b".into())]
    );

    reload(&mut one, false);
    let mut fx = settle(&mut one, 1, "requeue");
    fx.extend(settle(&mut one, 2, "reject"));
    fx.extend(one.h.settle());
    assert!(
        got(&fx).is_empty(),
        "a node that does not lead delivers nothing: {fx:?}"
    );
    assert_eq!(ready(&mut one), 0);

    reload(&mut two, true);
    home_is(&mut two, None);
    home_is(&mut one, Some(2));
    let (fx, _) = exchange(&mut one, &mut two);
    assert_eq!(
        got(&fx),
        vec![(3, true, "a".into()), (4, true, "b".into())],
        "the new leader has both (the stale reject dropped nothing)"
    );
    settle(&mut one, 3, "ack");
    settle(&mut one, 4, "ack");
    exchange(&mut one, &mut two);
    two.h.sync(0, true);
    reload(&mut two, true);
    assert_eq!(ready(&mut two), 0);
}
