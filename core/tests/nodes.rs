//! Queues on other cluster nodes (`shard/nodes.rs`): two brokers stand for two nodes, the
//! test carries their `NodeMail` as the host does. A publish routed to a queue of the other
//! node goes there and nowhere here; its confirm comes once that node answered, which for a
//! persistent message on a durable queue is after that node's sync; an unreachable node
//! nacks what waits for it; a message for a queue the home no longer has is confirmed (the
//! deletion took it).

mod common;

use bytes::Bytes;
use common::{Harness, bodies, deliveries};
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

    // Node 2's consumer gets it (node 1's stub holds no messages).
    let fx = n2.consume(c2, "q", "c", true);
    assert_eq!(bodies(&fx), vec!["one"]);

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
fn publishes_waiting_for_a_queues_old_home_are_nacked_when_it_moves() {
    // A quorum queue's leader moves from node 2 to node 3 (its group elected another):
    // what node 1 forwarded to node 2 and waits for is nacked at once, not after the
    // forward timeout; a publish to another queue still waiting for node 2 is not.
    let mut n1 = Harness::sharded_with_stores(BrokerConfig::default(), 1);
    let c1 = n1.connect(1);
    n1.declare_with(c1, "q", true, false, false);
    n1.declare_with(c1, "other", true, false, false);
    let home = |n1: &mut Harness, queue: &str, node: Option<u32>| {
        let now = n1.now;
        n1.shard(0).apply_admin(
            now,
            AdminRequest::QueueHome {
                vhost: "/".into(),
                queue: queue.into(),
                node,
            },
        );
    };
    home(&mut n1, "q", Some(2));
    home(&mut n1, "other", Some(2));
    n1.op(c1, Op::ConfirmSelect { nowait: false });
    n1.op(c1, persistent("q", "one"));
    n1.op(c1, persistent("other", "two"));
    assert_eq!(n1.shard(0).node_answers_pending(), 2);
    assert!(confirms(&n1.settle()).is_empty());
    home(&mut n1, "q", Some(3));
    assert_eq!(confirms(&n1.settle()), vec![(1, false)]);
    assert_eq!(n1.shard(0).node_answers_pending(), 1);
    // The same home told again changes nothing.
    home(&mut n1, "other", Some(2));
    assert!(confirms(&n1.settle()).is_empty());
    assert_eq!(n1.shard(0).node_answers_pending(), 1);
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
    // It is here: a consumer of this node's queue gets it.
    let now = n2.now;
    n2.shard(0).apply_admin(
        now,
        AdminRequest::QueueHome {
            vhost: "/".into(),
            queue: "q".into(),
            node: None,
        },
    );
    let fx = n2.consume(c2, "q", "c", true);
    assert_eq!(bodies(&fx), vec!["x"]);
}

fn replies(fx: &[Effect]) -> Vec<&warren_core::effect::Reply> {
    fx.iter()
        .filter_map(|e| match e {
            Effect::Reply { reply, .. } => Some(reply),
            _ => None,
        })
        .collect()
}

/// Two nodes: "q" lives on node 1 (`home`), node 2 (`far`) holds its stub.
fn two_nodes() -> (
    Harness,
    Harness,
    warren_core::ids::ChannelRef,
    warren_core::ids::ChannelRef,
) {
    let mut home = Harness::sharded_with_stores(BrokerConfig::default(), 1);
    let mut far = Harness::sharded_with_stores(BrokerConfig::default(), 1);
    let c1 = home.connect(1);
    let c2 = far.connect(1);
    home.declare_with(c1, "q", true, false, false);
    far.declare_with(c2, "q", true, false, false);
    let now = far.now;
    far.shard(0).apply_admin(
        now,
        AdminRequest::QueueHome {
            vhost: "/".into(),
            queue: "q".into(),
            node: Some(1),
        },
    );
    (home, far, c1, c2)
}

/// Carries mail both ways until neither node sends any; the far node's effects.
fn exchange(home: &mut Harness, far: &mut Harness) -> Vec<Effect> {
    let mut fx = Vec::new();
    for _ in 0..16 {
        let a = carry(far, 2, home, 1);
        home.settle();
        let b = carry(home, 1, far, 2);
        fx.extend(far.settle());
        if a + b == 0 {
            return fx;
        }
    }
    panic!("the nodes never stopped sending");
}

#[test]
fn a_consumer_on_another_node_gets_the_homes_messages_within_its_prefetch_and_settles_there() {
    let (mut home, mut far, c1, c2) = two_nodes();
    for i in 0..30 {
        home.op(c1, persistent("q", &format!("m{i}")));
    }
    far.op(
        c2,
        Op::Qos {
            prefetch_size: 0,
            prefetch_count: 10,
            global: false,
        },
    );
    let fx = far.consume(c2, "q", "c", false);
    assert!(
        replies(&fx).is_empty(),
        "consume-ok waits for the home: {fx:?}"
    );
    let fx = exchange(&mut home, &mut far);
    assert!(
        replies(&fx)
            .iter()
            .any(|r| matches!(r, warren_core::effect::Reply::ConsumeOk { .. })),
        "{fx:?}"
    );
    // The prefetch holds on the home: 10 out, 20 ready there, none more sent.
    let got = deliveries(&fx);
    assert_eq!(got.len(), 10, "{got:?}");
    assert_eq!(got[0].3, "m0");
    assert!(
        got.iter().all(|d| !d.2),
        "first deliveries are not redelivered"
    );
    let fx = home.passive_declare(c1, "q");
    assert!(
        replies(&fx).iter().any(|r| matches!(
            r,
            warren_core::effect::Reply::QueueDeclareOk {
                message_count: 20,
                consumer_count: 1,
                ..
            }
        )),
        "{fx:?}"
    );

    // Acks go to the home and free the prefetch: 5 acked, 5 more come.
    far.op(
        c2,
        Op::Ack {
            delivery_tag: 5,
            multiple: true,
        },
    );
    let got = deliveries(&exchange(&mut home, &mut far));
    assert_eq!(
        got.iter().map(|d| d.3.as_str()).collect::<Vec<_>>(),
        vec!["m10", "m11", "m12", "m13", "m14"]
    );
    // A requeue comes back redelivered (the next free slot of the prefetch).
    far.op(
        c2,
        Op::Nack {
            delivery_tag: 6,
            multiple: false,
            requeue: true,
        },
    );
    let got = deliveries(&exchange(&mut home, &mut far));
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(got[0].3, "m5");
    assert!(got[0].2, "a requeued message is redelivered");

    // The far node's passive declare and purge act on the home's queue, not the stub.
    far.op(
        c2,
        Op::QueueDeclare(warren_core::command::QueueDeclare {
            queue: "q".into(),
            passive: true,
            durable: false,
            exclusive: false,
            auto_delete: false,
            nowait: false,
            arguments: Default::default(),
        }),
    );
    let fx = exchange(&mut home, &mut far);
    assert!(
        replies(&fx).iter().any(|r| matches!(
            r,
            warren_core::effect::Reply::QueueDeclareOk {
                message_count: 15,
                consumer_count: 1,
                ..
            }
        )),
        "{fx:?}"
    );
    far.op(
        c2,
        Op::QueuePurge {
            queue: "q".into(),
            nowait: false,
        },
    );
    let fx = exchange(&mut home, &mut far);
    assert!(
        replies(&fx).iter().any(|r| matches!(
            r,
            warren_core::effect::Reply::QueuePurgeOk { message_count: 15 }
        )),
        "{fx:?}"
    );

    // The far node goes away: what it held unacked (10) is back on the home, for a
    // consumer there; the far node cancels its consumer (basic.cancel to the client).
    let now = home.now;
    home.shard(0).node_unreachable(now, 2);
    home.settle();
    let fx = home.consume(c1, "q", "local", true);
    let back = deliveries(&fx);
    assert_eq!(back.len(), 10, "{back:?}");
    assert!(back.iter().all(|d| d.2), "they come back redelivered");
    let now = far.now;
    far.shard(0).node_unreachable(now, 1);
    let fx = far.settle();
    assert!(
        fx.iter()
            .any(|e| matches!(e, Effect::ConsumerCancelled { consumer_tag, .. } if &**consumer_tag == "c")),
        "{fx:?}"
    );
}

#[test]
fn a_remote_consumer_gets_at_most_its_window_until_its_connection_writes() {
    // No prefetch, no acks: only the write window bounds what the home sends.
    let config = BrokerConfig {
        write_window: 8,
        ..BrokerConfig::default()
    };
    let mut home = Harness::sharded_with_stores(config.clone(), 1);
    let mut far = Harness::sharded_with_stores(config, 1);
    let c1 = home.connect(1);
    let c2 = far.connect(1);
    home.declare_with(c1, "q", true, false, false);
    far.declare_with(c2, "q", true, false, false);
    let now = far.now;
    far.shard(0).apply_admin(
        now,
        AdminRequest::QueueHome {
            vhost: "/".into(),
            queue: "q".into(),
            node: Some(1),
        },
    );
    for i in 0..100 {
        home.op(c1, persistent("q", &format!("m{i}")));
    }
    far.consume(c2, "q", "c", true);
    let got = deliveries(&exchange(&mut home, &mut far));
    // The far connection wrote nothing yet: the home's window (8) and the far
    // connection's (8) hold what crossed; the rest waits on the home.
    assert!(got.len() <= 16, "{}", got.len());
    assert!(got.len() >= 8, "{}", got.len());
    let (mut total, mut unwritten) = (got.len(), got.len());
    while total < 100 {
        let fx = far.op(
            ch_of(c2),
            Op::Written {
                count: unwritten as u32,
            },
        );
        let mut more = deliveries(&fx).len();
        more += deliveries(&exchange(&mut home, &mut far)).len();
        assert!(more > 0, "writes let more come");
        assert!(more <= 16, "{more}");
        total += more;
        unwritten = more;
    }
    assert_eq!(total, 100);
}

fn ch_of(c: warren_core::ids::ChannelRef) -> warren_core::ids::ChannelRef {
    warren_core::ids::ChannelRef::new(c.conn, 0)
}

#[test]
fn a_consumer_follows_its_queue_when_the_queue_moves_between_nodes() {
    // A quorum queue's home follows its group's leader: the client's consumer stays, and is
    // attached wherever the queue is served, without a consume-ok or a cancel.
    let (mut home, mut far, c1, c2) = two_nodes();
    far.consume(c2, "q", "c", true);
    exchange(&mut home, &mut far);
    home.op(c1, persistent("q", "on node 1"));
    assert_eq!(bodies(&exchange(&mut home, &mut far)), vec!["on node 1"]);

    // Node 2 now serves the queue (its leader moved there); node 1 stops (its consumers
    // from node 2 go when node 2 says so).
    let now = far.now;
    let fx = far.shard(0).apply_admin(
        now,
        AdminRequest::QueueHome {
            vhost: "/".into(),
            queue: "q".into(),
            node: None,
        },
    );
    drop(fx);
    let fx = far.settle();
    assert!(replies(&fx).is_empty(), "nothing for the client: {fx:?}");
    exchange(&mut home, &mut far);
    let fx = far.op(c2, persistent("q", "on node 2"));
    assert_eq!(bodies(&fx), vec!["on node 2"]);
    let fx = home.passive_declare(c1, "q");
    assert!(
        replies(&fx).iter().any(|r| matches!(
            r,
            warren_core::effect::Reply::QueueDeclareOk {
                consumer_count: 0,
                ..
            }
        )),
        "node 1 dropped node 2's consumer: {fx:?}"
    );

    // And back to node 1: the consumer attaches there again.
    let now = far.now;
    far.shard(0).apply_admin(
        now,
        AdminRequest::QueueHome {
            vhost: "/".into(),
            queue: "q".into(),
            node: Some(1),
        },
    );
    let fx = exchange(&mut home, &mut far);
    assert!(replies(&fx).is_empty(), "nothing for the client: {fx:?}");
    home.op(c1, persistent("q", "on node 1 again"));
    let fx = exchange(&mut home, &mut far);
    assert_eq!(bodies(&fx), vec!["on node 1 again"]);
    assert!(
        !fx.iter()
            .any(|e| matches!(e, Effect::ConsumerCancelled { .. })),
        "{fx:?}"
    );
}

/// Two nodes that both know quorum queue "qq", served on node 1 (`home`), with a consumer
/// "c" (manual acks) attached from node 2 (`far`) and its attach delivered; the connections
/// on each.
fn quorum_queue_consumed_far() -> (
    Harness,
    Harness,
    warren_core::ids::ChannelRef,
    warren_core::ids::ChannelRef,
) {
    let quorum = |h: &mut Harness, c| {
        let mut arguments = warren_core::message::FieldTable::new();
        arguments.insert(
            "x-queue-type".into(),
            warren_core::message::FieldValue::string("quorum"),
        );
        h.op(
            c,
            Op::QueueDeclare(warren_core::command::QueueDeclare {
                queue: "qq".into(),
                passive: false,
                durable: true,
                exclusive: false,
                auto_delete: false,
                nowait: false,
                arguments,
            }),
        );
    };
    let mut home = Harness::sharded_with_stores(BrokerConfig::default(), 1);
    let mut far = Harness::sharded_with_stores(BrokerConfig::default(), 1);
    let c1 = home.connect(1);
    let c2 = far.connect(1);
    quorum(&mut home, c1);
    quorum(&mut far, c2);
    let now = far.now;
    far.shard(0).apply_admin(
        now,
        AdminRequest::QueueHome {
            vhost: "/".into(),
            queue: "qq".into(),
            node: Some(1),
        },
    );
    far.consume(c2, "qq", "c", false);
    exchange(&mut home, &mut far);
    (home, far, c1, c2)
}

#[test]
fn a_quorum_queues_consumer_stays_while_its_node_is_unreachable_and_attaches_again() {
    let (mut home, mut far, c1, _) = quorum_queue_consumed_far();
    home.op(c1, persistent("qq", "before"));
    home.sync(0, true);
    assert_eq!(bodies(&exchange(&mut home, &mut far)), vec!["before"]);

    // Cut both ways: the home drops the far consumer; the far node keeps it (no cancel).
    let now = home.now;
    home.shard(0).node_unreachable(now, 2);
    home.settle();
    let now = far.now;
    far.shard(0).node_unreachable(now, 1);
    let fx = far.settle();
    assert!(
        !fx.iter()
            .any(|e| matches!(e, Effect::ConsumerCancelled { .. })),
        "a quorum queue's consumer is kept: {fx:?}"
    );
    // What crossed while cut is lost (the host's failed batches).
    node_mail(&mut home);
    node_mail(&mut far);

    // Back: it attaches again and gets what comes.
    let now = far.now;
    far.shard(0).node_reachable(now, 1);
    exchange(&mut home, &mut far);
    home.op(c1, persistent("qq", "after"));
    home.sync(0, true);
    let got = bodies(&exchange(&mut home, &mut far));
    assert!(got.contains(&"after".to_string()), "{got:?}");
}

#[test]
fn deleting_the_queue_on_its_home_cancels_its_consumers_on_other_nodes() {
    let (mut home, mut far, c1, c2) = two_nodes();
    far.consume(c2, "q", "c", false);
    exchange(&mut home, &mut far);
    home.op(c1, persistent("q", "m"));
    assert_eq!(bodies(&exchange(&mut home, &mut far)), vec!["m"]);
    home.op(
        c1,
        Op::QueueDelete {
            queue: "q".into(),
            if_unused: false,
            if_empty: false,
            nowait: false,
        },
    );
    let fx = exchange(&mut home, &mut far);
    assert!(
        fx.iter().any(
            |e| matches!(e, Effect::ConsumerCancelled { consumer_tag, .. } if &**consumer_tag == "c")
        ),
        "basic.cancel from the server on the far node: {fx:?}"
    );
    // The far node applies the delete too (replicated): its stub goes, and with it the
    // consumer, even when the home's word is lost.
    let mut lost = two_nodes();
    let (h2, f2, c1b, c2b) = (&mut lost.0, &mut lost.1, lost.2, lost.3);
    f2.consume(c2b, "q", "c", false);
    exchange(h2, f2);
    h2.op(
        c1b,
        Op::QueueDelete {
            queue: "q".into(),
            if_unused: false,
            if_empty: false,
            nowait: false,
        },
    );
    node_mail(h2);
    let fx = f2.op(
        c2b,
        Op::QueueDelete {
            queue: "q".into(),
            if_unused: false,
            if_empty: false,
            nowait: false,
        },
    );
    assert!(
        fx.iter()
            .any(|e| matches!(e, Effect::ConsumerCancelled { .. })),
        "{fx:?}"
    );
    far.op(
        c2,
        Op::QueueDelete {
            queue: "q".into(),
            if_unused: false,
            if_empty: false,
            nowait: false,
        },
    );
    // The delivery it holds is still the client's to ack (a no-op now, as on one node),
    // and the bytes it held are released once.
    assert_eq!(far.shard(0).stored_bytes(), 1);
    let fx = far.op(
        c2,
        Op::Ack {
            delivery_tag: 1,
            multiple: false,
        },
    );
    assert!(common::error_code(&fx).is_none(), "{fx:?}");
    assert_eq!(far.shard(0).stored_bytes(), 0);
}

#[test]
fn a_request_whose_answer_is_lost_fails_in_time_and_a_late_answer_is_dropped() {
    let (mut home, mut far, c1, c2) = two_nodes();
    home.op(c1, persistent("q", "m"));
    far.op(
        c2,
        Op::QueuePurge {
            queue: "q".into(),
            nowait: false,
        },
    );
    // The home took it and answered, but its answer is lost on the way.
    carry(&mut far, 2, &mut home, 1);
    home.settle();
    let late = node_mail(&mut home);
    assert_eq!(late.len(), 1);
    assert!(
        far.shard(0).next_deadline().is_some(),
        "the request has a deadline"
    );
    let fx = far.tick(9_000);
    assert!(common::error_code(&fx).is_none(), "not yet: {fx:?}");
    let fx = far.tick(2_000);
    assert_eq!(common::error_code(&fx), Some(404), "{fx:?}");
    // The late answer finds no request: dropped.
    let now = far.now;
    far.shard(0)
        .receive_node_mail(now, 1, late.into_iter().map(|(_, m)| m));
    let fx = far.settle();
    assert!(replies(&fx).is_empty(), "{fx:?}");
}

#[test]
fn a_declare_while_the_home_is_unreachable_fails_as_in_rabbitmq() {
    // RabbitMQ: `404 NOT_FOUND - home node ... of durable queue ... is down or
    // inaccessible` for a classic queue, declare-ok (0, 0) for a quorum queue whose leader
    // does not answer.
    let (_home, mut far, _c1, c2) = two_nodes();
    let declare = |queue: &str, passive| {
        let mut arguments = warren_core::message::FieldTable::new();
        if queue == "qq" {
            arguments.insert(
                "x-queue-type".into(),
                warren_core::message::FieldValue::string("quorum"),
            );
        }
        Op::QueueDeclare(warren_core::command::QueueDeclare {
            queue: queue.into(),
            passive,
            durable: true,
            exclusive: false,
            auto_delete: false,
            nowait: false,
            arguments,
        })
    };
    let c3 = far.open(1, 2);
    for (c, passive) in [(c2, false), (c3, true)] {
        let fx = far.op(c, declare("q", passive));
        assert!(replies(&fx).is_empty(), "asked the home: {fx:?}");
        let now = far.now;
        far.shard(0).node_unreachable(now, 1);
        let fx = far.settle();
        assert_eq!(
            common::error_code(&fx),
            Some(404),
            "passive {passive}: {fx:?}"
        );
        let text = fx
            .iter()
            .find_map(|e| match e {
                Effect::ChannelError { error, .. } => Some(error.text.clone()),
                _ => None,
            })
            .unwrap_or_default();
        assert!(
            text.contains("home node 1 of queue 'q'") && text.contains("down or inaccessible"),
            "{text}"
        );
    }
}

#[test]
fn a_quorum_queue_declare_while_its_leader_is_unreachable_is_answered_here() {
    let mut far = Harness::sharded_with_stores(BrokerConfig::default(), 1);
    let c2 = far.connect(1);
    let mut arguments = warren_core::message::FieldTable::new();
    arguments.insert(
        "x-queue-type".into(),
        warren_core::message::FieldValue::string("quorum"),
    );
    let declare = |passive| {
        Op::QueueDeclare(warren_core::command::QueueDeclare {
            queue: "qq".into(),
            passive,
            durable: true,
            exclusive: false,
            auto_delete: false,
            nowait: false,
            arguments: arguments.clone(),
        })
    };
    far.op(c2, declare(false));
    let now = far.now;
    far.shard(0).apply_admin(
        now,
        AdminRequest::QueueHome {
            vhost: "/".into(),
            queue: "qq".into(),
            node: Some(1),
        },
    );
    let fx = far.op(c2, declare(false));
    assert!(replies(&fx).is_empty(), "asked the leader: {fx:?}");
    let now = far.now;
    far.shard(0).node_unreachable(now, 1);
    let fx = far.settle();
    assert!(
        replies(&fx).iter().any(|r| matches!(
            r,
            warren_core::effect::Reply::QueueDeclareOk {
                message_count: 0,
                consumer_count: 0,
                ..
            }
        )),
        "{fx:?}"
    );
    far.op(c2, declare(true));
    let now = far.now;
    far.shard(0).node_unreachable(now, 1);
    assert_eq!(common::error_code(&far.settle()), Some(404));
}

/// What every shard of `from` (node `id`) sent, handed to `to`'s shard 0, as the host
/// hands it (consumer mail goes to shard 0, `BrokerHandle::receive_node_mail`).
fn carry_sharded(from: &mut Harness, id: u32, to: &mut Harness) -> usize {
    let mut out = Vec::new();
    for i in 0..from.k() {
        from.shard(i).take_node_mail(&mut out);
    }
    let mail: Vec<NodeMail> = out.into_iter().map(|(_, m)| m).collect();
    let n = mail.len();
    let now = to.now;
    to.shard(0).receive_node_mail(now, id, mail);
    n
}

/// Carries mail both ways (every shard) until neither node sends any; the far node's effects.
fn exchange_sharded(home: &mut Harness, far: &mut Harness) -> Vec<Effect> {
    let mut fx = Vec::new();
    for _ in 0..16 {
        let a = carry_sharded(far, 2, home);
        home.settle();
        let b = carry_sharded(home, 1, far);
        fx.extend(far.settle());
        if a + b == 0 {
            return fx;
        }
    }
    panic!("the nodes never stopped sending");
}

/// The shard of `h` that owns queue `name`.
fn queue_shard(h: &mut Harness, name: &str) -> u32 {
    (0..h.k())
        .find(|&i| h.shard(i).queue_len(name).is_some())
        .expect("a shard owns it")
}

#[test]
fn with_shards_consuming_another_nodes_queue_is_refused_where_it_cannot_be_served() {
    // docs/cluster.md, "Not yet": with --shards 2 on both nodes, only the queue on the
    // home's shard 0, its stub on the far node's shard 0 and the far connection on shard 0
    // are served; every other case is refused at once (540), not left unanswered.
    let mut home = Harness::sharded_with_stores(BrokerConfig::default(), 2);
    let mut far = Harness::sharded_with_stores(BrokerConfig::default(), 2);
    let h = home.connect(2); // shard 0
    let h1 = home.connect(1); // shard 1
    let f0 = far.connect(2); // shard 0
    let f1 = far.connect(1); // shard 1
    // A transient queue lives on its declaring connection's shard (a durable one on its
    // name's): (home's queue, far node's stub).
    let (ok, stub_on_1, home_on_1) = ("ok", "stub-on-1", "home-on-1");
    for (name, at_home, stub) in [(ok, h, f0), (stub_on_1, h, f1), (home_on_1, h1, f0)] {
        home.declare_with(at_home, name, false, false, false);
        far.declare_with(stub, name, false, false, false);
        for i in 0..far.k() {
            let now = far.now;
            far.shard(i).apply_admin(
                now,
                AdminRequest::QueueHome {
                    vhost: "/".into(),
                    queue: name.into(),
                    node: Some(1),
                },
            );
        }
        far.settle();
        home.op(h, persistent(name, "m"));
    }
    assert_eq!(queue_shard(&mut home, ok), 0);
    assert_eq!(queue_shard(&mut far, ok), 0);
    assert_eq!(queue_shard(&mut home, stub_on_1), 0);
    assert_eq!(queue_shard(&mut far, stub_on_1), 1);
    assert_eq!(queue_shard(&mut home, home_on_1), 1);
    assert_eq!(queue_shard(&mut far, home_on_1), 0);

    // All on shard 0: served (consume-ok and the home's message).
    let fx = far.consume(f0, ok, "c", false);
    assert!(replies(&fx).is_empty(), "{fx:?}");
    let fx = exchange_sharded(&mut home, &mut far);
    assert!(
        replies(&fx)
            .iter()
            .any(|r| matches!(r, warren_core::effect::Reply::ConsumeOk { .. })),
        "{fx:?}"
    );
    assert_eq!(bodies(&fx), vec!["m"]);

    let refused = |fx: &[Effect], what: &str| {
        assert_eq!(common::error_code(fx), Some(540), "{what}: {fx:?}");
        let text = fx
            .iter()
            .find_map(|e| match e {
                Effect::ChannelError { error, .. } | Effect::ConnectionError { error, .. } => {
                    Some(error.text.clone())
                }
                _ => None,
            })
            .unwrap_or_default();
        assert!(
            text.starts_with("NOT_IMPLEMENTED - ") && text.contains("--shards 1"),
            "{what}: {text}"
        );
    };
    // The far connection on shard 1: refused at once, by the far node.
    let mut fx = far.consume(f1, ok, "c1", false);
    fx.extend(exchange_sharded(&mut home, &mut far));
    refused(&fx, "consumer on shard 1");
    let f1 = far.connect(3); // shard 1
    let mut fx = far.op(
        f1,
        Op::Get {
            queue: ok.into(),
            no_ack: false,
        },
    );
    fx.extend(exchange_sharded(&mut home, &mut far));
    refused(&fx, "get on shard 1");

    // The far node's copy of the queue on shard 1.
    let f0b = far.connect(4); // shard 0
    let mut fx = far.consume(f0b, stub_on_1, "c2", false);
    fx.extend(exchange_sharded(&mut home, &mut far));
    refused(&fx, "stub on shard 1");
    let f0c = far.connect(6); // shard 0
    let mut fx = far.passive_declare(f0c, stub_on_1);
    fx.extend(exchange_sharded(&mut home, &mut far));
    refused(&fx, "declare of a stub on shard 1");

    // The home's queue on shard 1: the home refuses.
    let f0d = far.connect(8); // shard 0
    let fx = far.consume(f0d, home_on_1, "c3", false);
    assert!(replies(&fx).is_empty(), "{fx:?}");
    let fx = exchange_sharded(&mut home, &mut far);
    refused(&fx, "queue on the home's shard 1");
    // Its message stays there, for a consumer on the home.
    assert_eq!(home.shard(1).queue_len(home_on_1), Some(1));

    // The served consumer is unaffected.
    home.op(h, persistent(ok, "m2"));
    let fx = exchange_sharded(&mut home, &mut far);
    assert_eq!(bodies(&fx), vec!["m2"]);
}

/// A quorum queue "qq" served by node 1 (`home`) with a consumer "c" of node 2 (`far`)
/// attached there, then both nodes cut from each other (the far node keeps its consumer,
/// orphaned) and what crossed meanwhile lost.
fn quorum_consumer_cut_off() -> (
    Harness,
    Harness,
    warren_core::ids::ChannelRef,
    warren_core::ids::ChannelRef,
) {
    let (mut home, mut far, c1, c2) = quorum_queue_consumed_far();
    let now = home.now;
    home.shard(0).node_unreachable(now, 2);
    home.settle();
    let now = far.now;
    far.shard(0).node_unreachable(now, 1);
    far.settle();
    node_mail(&mut home);
    node_mail(&mut far);
    (home, far, c1, c2)
}

fn cancelled(fx: &[Effect], tag: &str) -> bool {
    fx.iter().any(
        |e| matches!(e, Effect::ConsumerCancelled { consumer_tag, .. } if &**consumer_tag == tag),
    )
}

fn delete(h: &mut Harness, c: warren_core::ids::ChannelRef, queue: &str) -> Vec<Effect> {
    h.op(
        c,
        Op::QueueDelete {
            queue: queue.into(),
            if_unused: false,
            if_empty: false,
            nowait: false,
        },
    )
}

#[test]
fn a_quorum_consumer_refused_where_it_attaches_again_is_cancelled_not_left_waiting() {
    // While the nodes were cut off the queue was deleted on the majority's side; the far
    // node has not applied the delete yet when it reaches the home again, and attaches
    // its consumer there: the home refuses (404, no such queue). RabbitMQ's client then
    // gets basic.cancel (consumer_cancel_notify); before, it got nothing, and the
    // consumer stayed on its channel for ever, even after the delete was applied.
    let (mut home, mut far, c1, c2) = quorum_consumer_cut_off();
    delete(&mut home, c1, "qq");
    node_mail(&mut home);
    let now = far.now;
    far.shard(0).node_reachable(now, 1);
    let fx = exchange(&mut home, &mut far);
    assert!(cancelled(&fx, "c"), "basic.cancel for the client: {fx:?}");
    // The tag is free again (the channel forgot the consumer).
    let fx = far.consume(c2, "qq", "c", false);
    assert_ne!(common::error_code(&fx), Some(530), "{fx:?}");
}

#[test]
fn a_quorum_consumer_whose_attach_is_lost_attaches_when_its_leader_is_back() {
    // The consume that attaches it again is lost with the batch (the leader's node went
    // again before answering): the consumer is kept, and attached when the node is back,
    // not left on its channel attached nowhere.
    let (mut home, mut far, c1, _c2) = quorum_consumer_cut_off();
    let now = far.now;
    far.shard(0).node_reachable(now, 1);
    far.settle();
    let lost = node_mail(&mut far);
    assert!(!lost.is_empty(), "the consume went");
    let now = far.now;
    far.shard(0).node_unreachable(now, 1);
    let fx = far.settle();
    assert!(!cancelled(&fx, "c"), "kept: {fx:?}");
    node_mail(&mut far);
    let now = far.now;
    far.shard(0).node_reachable(now, 1);
    exchange(&mut home, &mut far);
    home.op(c1, persistent("qq", "after"));
    home.sync(0, true);
    let got = bodies(&exchange(&mut home, &mut far));
    assert_eq!(got, vec!["after"]);
}

#[test]
fn a_quorum_consumer_attaching_again_when_its_queue_is_deleted_is_cancelled() {
    // Its consume to the leader in flight (or lost), the delete is applied here: the
    // consumer ends with basic.cancel like the attached ones.
    let (_home, mut far, _c1, c2) = quorum_consumer_cut_off();
    let now = far.now;
    far.shard(0).node_reachable(now, 1);
    far.settle();
    node_mail(&mut far);
    let fx = delete(&mut far, c2, "qq");
    let mut fx = fx;
    fx.extend(far.settle());
    assert!(cancelled(&fx, "c"), "basic.cancel for the client: {fx:?}");
}

/// Declares quorum queue "qq" on channel `c` of `h`.
fn declare_quorum(h: &mut Harness, c: warren_core::ids::ChannelRef) {
    let mut arguments = warren_core::message::FieldTable::new();
    arguments.insert(
        "x-queue-type".into(),
        warren_core::message::FieldValue::string("quorum"),
    );
    h.op(
        c,
        Op::QueueDeclare(warren_core::command::QueueDeclare {
            queue: "qq".into(),
            passive: false,
            durable: true,
            exclusive: false,
            auto_delete: false,
            nowait: false,
            arguments,
        }),
    );
}

fn consume_oks(fx: &[Effect]) -> Vec<String> {
    replies(fx)
        .into_iter()
        .filter_map(|r| match r {
            warren_core::effect::Reply::ConsumeOk { consumer_tag, .. } => {
                Some(consumer_tag.to_string())
            }
            _ => None,
        })
        .collect()
}

fn set_home(h: &mut Harness, node: Option<u32>) {
    let now = h.now;
    h.shard(0).apply_admin(
        now,
        AdminRequest::QueueHome {
            vhost: "/".into(),
            queue: "qq".into(),
            node,
        },
    );
}

/// Issue 43, item 3: node 2 consumes quorum queue "qq" whose leader, node 1, is lost before
/// it answers. The consume waits (no 404), a consume made meanwhile is not sent to the lost
/// node, and both attach where the group's next leader, node 3, serves the queue.
#[test]
fn a_quorum_consume_while_its_leader_is_lost_attaches_to_the_next_leader() {
    let mut next = Harness::sharded_with_stores(BrokerConfig::default(), 1);
    let mut far = Harness::sharded_with_stores(BrokerConfig::default(), 1);
    let c3 = next.connect(1);
    let c2 = far.connect(1);
    declare_quorum(&mut next, c3);
    declare_quorum(&mut far, c2);
    set_home(&mut far, Some(1));
    let fx = far.consume(c2, "qq", "c", false);
    assert!(replies(&fx).is_empty(), "asked the leader: {fx:?}");
    let lost = node_mail(&mut far);
    let Some((1, NodeMail::Consume { from: asked, .. })) = lost.first().cloned() else {
        panic!("{lost:?}");
    };
    assert_eq!(lost.len(), 1, "{lost:?}");
    let now = far.now;
    far.shard(0).node_unreachable(now, 1);
    let fx = far.settle();
    assert_eq!(common::error_code(&fx), None, "it waits: {fx:?}");
    assert!(replies(&fx).is_empty(), "{fx:?}");
    // Said again (the host says so on every failed batch): still waiting.
    let now = far.now;
    far.shard(0).node_unreachable(now, 1);
    assert_eq!(common::error_code(&far.settle()), None);
    // A consume made now waits too, and nothing goes to the lost node.
    let c2b = far.open(1, 2);
    let fx = far.consume(c2b, "qq", "d", true);
    assert!(replies(&fx).is_empty(), "{fx:?}");
    assert!(node_mail(&mut far).is_empty(), "nothing for the lost node");
    let fx = far.tick(1_000);
    assert_eq!(common::error_code(&fx), None, "{fx:?}");

    // Node 3 leads now: both consumes go there and are answered.
    set_home(&mut far, Some(3));
    let sent = node_mail(&mut far);
    assert_eq!(sent.len(), 2, "{sent:?}");
    assert!(
        sent.iter()
            .all(|(n, m)| *n == 3 && matches!(m, NodeMail::Consume { .. }))
    );
    let now = next.now;
    next.shard(0)
        .receive_node_mail(now, 2, sent.into_iter().map(|(_, m)| m));
    next.settle();
    // A late answer of the lost node (it only looked lost) is let go there.
    let now = far.now;
    far.shard(0).receive_node_mail(
        now,
        1,
        [NodeMail::ConsumeOk {
            to: asked,
            vhost: "/".into(),
            queue: "qq".into(),
            consumer: 77,
            tag: "c".into(),
            nowait: false,
        }],
    );
    let fx = far.settle();
    assert!(consume_oks(&fx).is_empty(), "{fx:?}");
    let cancel = node_mail(&mut far);
    assert!(
        matches!(&cancel[..], [(1, NodeMail::Cancel { consumer: 77, .. })]),
        "{cancel:?}"
    );
    let now = far.now;
    let back = node_mail(&mut next);
    assert!(back.iter().all(|(n, _)| *n == 2), "{back:?}");
    far.shard(0)
        .receive_node_mail(now, 3, back.into_iter().map(|(_, m)| m));
    let fx = far.settle();
    let mut oks = consume_oks(&fx);
    oks.sort();
    assert_eq!(oks, vec!["c", "d"], "{fx:?}");
    // And the new leader's messages reach them.
    next.op(c3, persistent("qq", "m"));
    next.sync(0, true);
    let now = far.now;
    let mail = node_mail(&mut next);
    far.shard(0)
        .receive_node_mail(now, 3, mail.into_iter().map(|(_, m)| m));
    let got = bodies(&far.settle());
    assert_eq!(got, vec!["m"]);
}

/// The lost leader comes back (the node only looked lost), or this node's own copy takes
/// the consume while the group has no leader it knows: the consume is answered either way.
#[test]
fn a_quorum_consume_waiting_for_a_leader_goes_to_the_node_back_or_here() {
    let mut old = Harness::sharded_with_stores(BrokerConfig::default(), 1);
    let mut far = Harness::sharded_with_stores(BrokerConfig::default(), 1);
    let c1 = old.connect(1);
    let c2 = far.connect(1);
    declare_quorum(&mut old, c1);
    declare_quorum(&mut far, c2);
    set_home(&mut far, Some(1));
    far.consume(c2, "qq", "c", false);
    node_mail(&mut far);
    let now = far.now;
    far.shard(0).node_unreachable(now, 1);
    far.settle();
    let now = far.now;
    far.shard(0).node_reachable(now, 1);
    let fx = exchange(&mut old, &mut far);
    assert_eq!(consume_oks(&fx), vec!["c"], "{fx:?}");

    // No leader known (a candidate's term): this node's copy takes it, and it moves with
    // the queue once a leader is known.
    let c2b = far.open(1, 2);
    far.consume(c2b, "qq", "d", false);
    node_mail(&mut far);
    let now = far.now;
    far.shard(0).node_unreachable(now, 1);
    far.settle();
    set_home(&mut far, None);
    let fx = far.settle();
    assert_eq!(consume_oks(&fx), vec!["d"], "{fx:?}");
}

/// No leader within the bound: RabbitMQ's 541 "timed out consuming from quorum queue" (a
/// connection error). A classic queue's consume fails at once with its 404 (its only copy
/// is on the lost node).
#[test]
fn a_quorum_consume_with_no_leader_in_time_fails_as_in_rabbitmq() {
    let mut far = Harness::sharded_with_stores(BrokerConfig::default(), 1);
    let c2 = far.connect(1);
    declare_quorum(&mut far, c2);
    set_home(&mut far, Some(1));
    far.consume(c2, "qq", "c", false);
    node_mail(&mut far);
    let now = far.now;
    far.shard(0).node_unreachable(now, 1);
    assert_eq!(common::error_code(&far.settle()), None);
    let fx = far.tick(4_000);
    assert_eq!(common::error_code(&fx), None, "not yet: {fx:?}");
    let fx = far.tick(1_500);
    assert_eq!(common::error_code(&fx), Some(541), "{fx:?}");
    let text = fx
        .iter()
        .find_map(|e| match e {
            Effect::ConnectionError { error, .. } | Effect::ChannelError { error, .. } => {
                Some(error.text.clone())
            }
            _ => None,
        })
        .unwrap_or_default();
    assert!(
        text.contains("timed out consuming from quorum queue 'qq'"),
        "{text}"
    );

    let (_home, mut far, _c1, c2) = two_nodes();
    far.consume(c2, "q", "c", false);
    let now = far.now;
    far.shard(0).node_unreachable(now, 1);
    assert_eq!(common::error_code(&far.settle()), Some(404));
}
