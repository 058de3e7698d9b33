//! Publishes routed by the host on a snapshot of the routing table (`Publish::routed`): the
//! broker uses them as routed unless that would hide a routing change it applied before the
//! publish (the publishing connection's own, or any other's: it routes them again, as in
//! arrival order), and drops what was deleted since.

mod common;

use bytes::Bytes;
use common::Harness;
use std::sync::Arc;
use warren_core::command::{Op, Publish};
use warren_core::effect::Effect;
use warren_core::ids::ChannelRef;
use warren_core::message::{FieldTable, Properties};
use warren_core::routing::{RouteTable, Routed};

fn route(table: &RouteTable, exchange: &str, key: &str) -> Option<Routed> {
    let vhost = table.vhost("/").expect("vhost /");
    table.route_publish(vhost, exchange, key, None)
}

/// Publishes (mandatory) to `exchange` with `key`, routed by the host on `table`.
fn publish_via(
    h: &mut Harness,
    c: ChannelRef,
    table: &RouteTable,
    exchange: &str,
    key: &str,
) -> Vec<Effect> {
    let routed = route(table, exchange, key);
    h.op(
        c,
        Op::Publish(Box::new(Publish {
            exchange: Arc::from(exchange),
            routing_key: Arc::from(key),
            mandatory: true,
            immediate: false,
            properties: Properties::default(),
            body: Bytes::from_static(b"m"),
            routed,
        })),
    )
}

fn delete_queue(h: &mut Harness, c: ChannelRef, queue: &str) {
    h.op(
        c,
        Op::QueueDelete {
            queue: queue.into(),
            if_unused: false,
            if_empty: false,
            nowait: false,
        },
    );
}

fn returned(fx: &[Effect]) -> bool {
    fx.iter().any(|e| matches!(e, Effect::Return { .. }))
}

#[test]
fn a_connection_sees_its_own_bind_even_on_a_stale_snapshot() {
    let mut h = Harness::new();
    let a = h.connect(1);
    h.declare(a, "q");
    let stale = Arc::clone(h.shards[0].routes());
    h.bind(a, "q", "amq.direct", "k");
    let routed = route(&stale, "amq.direct", "k");
    assert_eq!(
        routed.map(|r| r.queues.len()),
        Some(0),
        "the stale table misses the bind"
    );
    let fx = publish_via(&mut h, a, &stale, "amq.direct", "k");
    assert!(!returned(&fx), "{fx:?}");
    assert_eq!(h.shards[0].queue_len("q"), Some(1));
}

#[test]
fn another_connections_bind_applied_first_is_seen_by_a_publish_routed_before_it() {
    let mut h = Harness::new();
    let a = h.connect(1);
    let b = h.connect(2);
    h.declare(b, "q");
    let snapshot = Arc::clone(h.shards[0].routes());
    h.bind(b, "q", "amq.direct", "k");
    // Routed by the host before b's bind reached the table, applied after it: the broker
    // routes it again, as in arrival order (an MQTT SUBSCRIBE sent just before another
    // client's publish must see it: issue 43, item 15).
    let fx = publish_via(&mut h, a, &snapshot, "amq.direct", "k");
    assert!(!returned(&fx), "{fx:?}");
    assert_eq!(h.shards[0].queue_len("q"), Some(1));
    // On the current table as well.
    let current = Arc::clone(h.shards[0].routes());
    let fx = publish_via(&mut h, a, &current, "amq.direct", "k");
    assert!(!returned(&fx), "{fx:?}");
    assert_eq!(h.shards[0].queue_len("q"), Some(2));
}

#[test]
fn a_queue_deleted_and_declared_again_since_the_snapshot_gets_the_publish() {
    let mut h = Harness::new();
    let a = h.connect(1);
    let b = h.connect(2);
    h.declare(b, "q");
    h.bind(b, "q", "amq.direct", "k");
    let snapshot = Arc::clone(h.shards[0].routes());
    delete_queue(&mut h, b, "q");
    h.declare(b, "q");
    h.bind(b, "q", "amq.direct", "k");
    let fx = publish_via(&mut h, a, &snapshot, "amq.direct", "k");
    // Applied after the new queue and its binding: routed again, it reaches that queue.
    assert!(!returned(&fx), "{fx:?}");
    assert_eq!(h.shards[0].queue_len("q"), Some(1));
}

#[test]
fn a_publish_whose_queues_were_all_deleted_is_still_confirmed() {
    let mut h = Harness::new();
    let a = h.connect(1);
    let b = h.connect(2);
    h.op(a, Op::ConfirmSelect { nowait: true });
    h.declare(b, "q");
    h.bind(b, "q", "amq.direct", "k");
    let snapshot = Arc::clone(h.shards[0].routes());
    delete_queue(&mut h, b, "q");
    let fx = publish_via(&mut h, a, &snapshot, "amq.direct", "k");
    let confirmed = fx.iter().any(|e| {
        matches!(
            e,
            Effect::Confirm {
                seq: 1,
                ack: true,
                ..
            }
        )
    });
    assert!(
        confirmed,
        "no queue left to answer, confirmed at once: {fx:?}"
    );
}

#[test]
fn an_exchange_declared_again_is_routed_by_the_broker() {
    let mut h = Harness::new();
    let a = h.connect(1);
    let b = h.connect(2);
    h.declare(b, "old");
    h.declare(b, "new");
    h.exchange(b, "x", "direct", FieldTable::new());
    h.bind(b, "old", "x", "k");
    let snapshot = Arc::clone(h.shards[0].routes());
    h.op(
        b,
        Op::ExchangeDelete {
            exchange: "x".into(),
            if_unused: false,
            nowait: false,
        },
    );
    h.exchange(b, "x", "fanout", FieldTable::new());
    h.bind(b, "new", "x", "");
    let fx = publish_via(&mut h, a, &snapshot, "x", "k");
    assert!(!returned(&fx), "{fx:?}");
    assert_eq!(h.shards[0].queue_len("old"), Some(0));
    assert_eq!(h.shards[0].queue_len("new"), Some(1));
}

#[test]
fn the_table_routes_exchange_to_exchange_and_alternate_exchanges_as_the_broker_does() {
    let mut h = Harness::new();
    let a = h.connect(1);
    h.declare(a, "via-e2e");
    h.declare(a, "via-ae");
    h.exchange(a, "ae", "fanout", FieldTable::new());
    h.bind(a, "via-ae", "ae", "");
    let mut args = FieldTable::new();
    args.insert(
        "alternate-exchange".into(),
        warren_core::message::FieldValue::string("ae"),
    );
    h.exchange(a, "front", "topic", args);
    h.exchange(a, "inner", "direct", FieldTable::new());
    h.op(
        a,
        Op::ExchangeBind(warren_core::command::Bind {
            destination: "inner".into(),
            source: "front".into(),
            routing_key: "a.*".into(),
            nowait: false,
            arguments: FieldTable::new(),
        }),
    );
    h.bind(a, "via-e2e", "inner", "a.b");
    let table = Arc::clone(h.shards[0].routes());
    let queue_of = |name: &str| table.queue(table.vhost("/").unwrap(), name).unwrap();
    assert_eq!(
        route(&table, "front", "a.b").map(|r| r.queues),
        Some(vec![queue_of("via-e2e")])
    );
    assert_eq!(
        route(&table, "front", "zzz").map(|r| r.queues),
        Some(vec![queue_of("via-ae")])
    );
    // The default exchange routes by queue name; unknown exchanges are left to the broker.
    assert_eq!(
        route(&table, "", "via-ae").map(|r| r.queues),
        Some(vec![queue_of("via-ae")])
    );
    assert_eq!(route(&table, "nope", "k"), None);
    assert_eq!(route(&table, "amq.rabbitmq.trace", "k"), None, "internal");
}
