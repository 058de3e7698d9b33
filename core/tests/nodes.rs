//! Queues on other cluster nodes (`shard/nodes.rs`): two brokers stand for two nodes, the
//! test carries their `NodeMail` as the host does. A publish routed to a queue of the other
//! node goes there and nowhere here; its confirm comes once that node answered, which for a
//! persistent message on a durable queue is after that node's sync; an unreachable node
//! nacks what waits for it; a message for a queue the home no longer has is confirmed (the
//! deletion took it).

mod common;

use bytes::Bytes;
use common::{Harness, bodies};
use std::sync::Arc;
use warren_core::admin::AdminRequest;
use warren_core::command::{Op, Publish};
use warren_core::effect::Effect;
use warren_core::message::Properties;
use warren_core::{BrokerConfig, NodeMail};

fn confirms(fx: &[Effect]) -> Vec<(u64, bool)> {
    fx.iter()
        .filter_map(|e| match e {
            Effect::Confirm { seq, ack, .. } => Some((*seq, *ack)),
            _ => None,
        })
        .collect()
}

fn persistent(queue: &str, body: &str) -> Op {
    Op::Publish(Box::new(Publish {
        exchange: Arc::from(""),
        routing_key: Arc::from(queue),
        mandatory: false,
        immediate: false,
        properties: Properties {
            delivery_mode: Some(2),
            ..Default::default()
        },
        body: Bytes::copy_from_slice(body.as_bytes()),
        routed: None,
    }))
}

fn node_mail(h: &mut Harness) -> Vec<(u32, NodeMail)> {
    let mut out = Vec::new();
    h.shard(0).take_node_mail(&mut out);
    out
}

/// Hands what `from` (node `id`) sent to node `to_id` over to `to`.
fn carry(from: &mut Harness, id: u32, to: &mut Harness, to_id: u32) -> usize {
    let mail: Vec<NodeMail> = node_mail(from)
        .into_iter()
        .map(|(n, m)| {
            assert_eq!(n, to_id, "mail for node {n}");
            m
        })
        .collect();
    let n = mail.len();
    let now = to.now;
    to.shard(0).receive_node_mail(now, id, mail);
    n
}

#[test]
fn a_publish_to_a_queue_of_another_node_goes_there_and_is_confirmed_after_its_sync() {
    // Node 1 knows the durable queue "q" (replicated metadata) but it lives on node 2.
    let mut n1 = Harness::sharded_with_stores(BrokerConfig::default(), 1);
    let mut n2 = Harness::sharded_with_stores(BrokerConfig::default(), 1);
    let c1 = n1.connect(1);
    let c2 = n2.connect(1);
    n1.declare_with(c1, "q", true, false, false);
    n2.declare_with(c2, "q", true, false, false);
    let now = n1.now;
    n1.shard(0).apply_admin(
        now,
        AdminRequest::QueueHome {
            vhost: "/".into(),
            queue: "q".into(),
            node: Some(2),
        },
    );
    n1.op(c1, Op::ConfirmSelect { nowait: false });

    let fx = n1.op(c1, persistent("q", "one"));
    assert!(
        confirms(&fx).is_empty(),
        "not confirmed before node 2 answered"
    );
    // Node 1's sync covers nothing of it: still no confirm.
    let fx = n1.sync(0, true);
    assert!(confirms(&fx).is_empty(), "{fx:?}");
    assert_eq!(n1.shard(0).node_answers_pending(), 1);
    assert_eq!(carry(&mut n1, 1, &mut n2, 2), 1);
    // Node 2 has it, and answers only after its own sync.
    assert!(
        node_mail(&mut n2).is_empty(),
        "answered before node 2's sync"
    );
    n2.sync(0, true);
    assert_eq!(carry(&mut n2, 2, &mut n1, 1), 1);
    let fx = n1.settle();
    assert_eq!(confirms(&fx), vec![(1, true)]);
    assert_eq!(n1.shard(0).node_answers_pending(), 0);

    // Node 2's consumer gets it; node 1's gets nothing (its stub holds no messages).
    let fx = n2.consume(c2, "q", "c", true);
    assert_eq!(bodies(&fx), vec!["one"]);
    let fx = n1.consume(c1, "q", "c", true);
    assert!(bodies(&fx).is_empty(), "{fx:?}");

    // Node 2 unreachable: what waits for it is nacked.
    let fx = n1.op(c1, persistent("q", "two"));
    assert!(confirms(&fx).is_empty());
    assert_eq!(node_mail(&mut n1).len(), 1);
    let now = n1.now;
    n1.shard(0).node_unreachable(now, 2);
    assert_eq!(confirms(&n1.settle()), vec![(2, false)]);

    // A message for a queue node 2 no longer has: the deletion took it, confirmed.
    n1.op(c1, persistent("q", "three"));
    n2.op(
        c2,
        Op::QueueDelete {
            queue: "q".into(),
            if_unused: false,
            if_empty: false,
            nowait: false,
        },
    );
    carry(&mut n1, 1, &mut n2, 2);
    n2.sync(0, true);
    carry(&mut n2, 2, &mut n1, 1);
    assert_eq!(confirms(&n1.settle()), vec![(3, true)]);
}

#[test]
fn a_message_forwarded_here_is_never_forwarded_again() {
    // Both nodes think the other is the home (they never do when they apply one log): the
    // message stays at the first node it is forwarded to.
    let mut n1 = Harness::new();
    let mut n2 = Harness::new();
    let c1 = n1.connect(1);
    let c2 = n2.connect(1);
    n1.declare(c1, "q");
    n2.declare(c2, "q");
    for (h, other) in [(&mut n1, 2), (&mut n2, 1)] {
        let now = h.now;
        h.shard(0).apply_admin(
            now,
            AdminRequest::QueueHome {
                vhost: "/".into(),
                queue: "q".into(),
                node: Some(other),
            },
        );
    }
    n1.publish(c1, "", "q", "x");
    assert_eq!(carry(&mut n1, 1, &mut n2, 2), 1);
    assert!(node_mail(&mut n2).is_empty(), "sent back");
    let fx = n2.consume(c2, "q", "c", true);
    assert_eq!(bodies(&fx), vec!["x"]);
}
