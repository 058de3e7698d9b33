//! Delayed delivery in the core (docs/delayed.md): `x-delayed-message` exchanges with the
//! plugin's interface, `x-deliver-at`, the schedule's order, its window paged through the
//! store, confirms after the schedule is durable, a crash with schedules pending, limits.

mod common;

use bytes::Bytes;
use common::*;
use std::sync::Arc;
use warren_core::command::{ExchangeDeclare, Op, Publish, QueueDeclare};
use warren_core::effect::{Effect, Reply};
use warren_core::message::{FieldTable, FieldValue, Properties};
use warren_core::store::MemoryStore;
use warren_core::{Broker, BrokerConfig};

fn delayed_args(kind: &str) -> FieldTable {
    let mut t = FieldTable::new();
    t.insert("x-delayed-type".into(), FieldValue::string(kind));
    t
}

fn declare_exchange(
    h: &mut Harness,
    c: warren_core::ids::ChannelRef,
    name: &str,
    kind: &str,
    args: FieldTable,
    durable: bool,
) -> Vec<Effect> {
    h.op(
        c,
        Op::ExchangeDeclare(ExchangeDeclare {
            exchange: name.into(),
            kind: kind.into(),
            passive: false,
            durable,
            auto_delete: false,
            internal: false,
            nowait: false,
            arguments: args,
        }),
    )
}

#[allow(clippy::too_many_arguments)] // a test helper: each flag is a case
fn publish_with(
    h: &mut Harness,
    c: warren_core::ids::ChannelRef,
    exchange: &str,
    key: &str,
    body: &str,
    headers: FieldTable,
    persistent: bool,
    mandatory: bool,
) -> Vec<Effect> {
    h.op(
        c,
        Op::Publish(Box::new(Publish {
            exchange: Arc::from(exchange),
            routing_key: Arc::from(key),
            mandatory,
            immediate: false,
            properties: Properties {
                headers: Some(headers),
                delivery_mode: Some(if persistent { 2 } else { 1 }),
                ..Default::default()
            },
            body: Bytes::copy_from_slice(body.as_bytes()),
            routed: None,
        })),
    )
}

fn delay(ms: FieldValue) -> FieldTable {
    let mut t = FieldTable::new();
    t.insert("x-delay".into(), ms);
    t
}

/// A delayed exchange `d` (direct) bound to queue `q` with key `k`, a no-ack consumer on it.
fn setup(h: &mut Harness) -> warren_core::ids::ChannelRef {
    let c = h.connect(1);
    let fx = declare_exchange(
        h,
        c,
        "d",
        "x-delayed-message",
        delayed_args("direct"),
        false,
    );
    assert!(
        matches!(
            fx.as_slice(),
            [Effect::Reply {
                reply: Reply::ExchangeDeclareOk,
                ..
            }]
        ),
        "{fx:?}"
    );
    h.declare(c, "q");
    h.bind(c, "q", "d", "k");
    h.consume(c, "q", "t", true);
    c
}

#[test]
fn routed_when_due_in_due_order() {
    let mut h = Harness::new();
    let c = setup(&mut h);
    assert!(
        bodies(&publish_with(
            &mut h,
            c,
            "d",
            "k",
            "late",
            delay(FieldValue::I64(300)),
            false,
            false
        ))
        .is_empty()
    );
    assert!(
        bodies(&publish_with(
            &mut h,
            c,
            "d",
            "k",
            "early",
            delay(FieldValue::I32(100)),
            false,
            false
        ))
        .is_empty()
    );
    // No delay, zero or negative: at once, as the plugin does.
    assert_eq!(
        bodies(&publish_with(
            &mut h,
            c,
            "d",
            "k",
            "now",
            FieldTable::new(),
            false,
            false
        )),
        ["now"]
    );
    assert_eq!(
        bodies(&publish_with(
            &mut h,
            c,
            "d",
            "k",
            "neg",
            delay(FieldValue::I64(-5)),
            false,
            false
        )),
        ["neg"]
    );
    assert_eq!(h.shard(0).scheduled_counts().0, 2);
    assert!(bodies(&h.tick(50)).is_empty());
    let fx = h.tick(60);
    assert_eq!(bodies(&fx), ["early"]);
    // Routed with the delay negated, as the plugin does.
    let Some(Effect::Deliver { delivery, .. }) =
        fx.iter().find(|e| matches!(e, Effect::Deliver { .. }))
    else {
        panic!("no delivery: {fx:?}");
    };
    let headers = delivery
        .message
        .properties
        .headers
        .as_ref()
        .expect("headers");
    assert_eq!(headers.get("x-delay"), Some(&FieldValue::I64(-100)));
    assert_eq!(bodies(&h.tick(200)), ["late"]);
    assert_eq!(h.shard(0).scheduled_counts().0, 0);
    assert_eq!(h.shard(0).next_deadline(), None, "nothing left to wake for");
}

#[test]
fn the_next_deadline_is_the_earliest_due_time() {
    let mut h = Harness::new();
    let c = setup(&mut h);
    let now = h.now;
    publish_with(
        &mut h,
        c,
        "d",
        "k",
        "b",
        delay(FieldValue::I64(500)),
        false,
        false,
    );
    publish_with(
        &mut h,
        c,
        "d",
        "k",
        "a",
        delay(FieldValue::I64(200)),
        false,
        false,
    );
    assert_eq!(h.shard(0).next_deadline(), Some(now + 2 + 200));
}

#[test]
fn x_delay_as_the_plugin_reads_it_and_bad_ones_refused() {
    let mut h = Harness::new();
    let c = setup(&mut h);
    // Floats are truncated, numeric strings parsed.
    publish_with(
        &mut h,
        c,
        "d",
        "k",
        "f",
        delay(FieldValue::F64(50.9)),
        false,
        false,
    );
    publish_with(
        &mut h,
        c,
        "d",
        "k",
        "s",
        delay(FieldValue::string("60")),
        false,
        false,
    );
    assert_eq!(bodies(&h.tick(55)), ["f"]);
    assert_eq!(bodies(&h.tick(10)), ["s"]);
    let fx = publish_with(
        &mut h,
        c,
        "d",
        "k",
        "x",
        delay(FieldValue::string("soon")),
        false,
        false,
    );
    assert_eq!(error_code(&fx), Some(406), "{fx:?}");
    let c2 = h.open(1, 2);
    let fx = publish_with(
        &mut h,
        c2,
        "d",
        "k",
        "x",
        delay(FieldValue::I64(1 << 33)),
        false,
        false,
    );
    assert_eq!(error_code(&fx), Some(406), "beyond 2^32-1 ms: {fx:?}");
    let c3 = h.open(1, 3);
    let fx = publish_with(
        &mut h,
        c3,
        "d",
        "k",
        "x",
        delay(FieldValue::Bool(true)),
        false,
        false,
    );
    assert_eq!(error_code(&fx), Some(406), "{fx:?}");
    // Nothing else was affected: the consumer's channel still gets what is due.
    publish_with(
        &mut h,
        c3,
        "d",
        "k",
        "after",
        FieldTable::new(),
        false,
        false,
    );
    assert_eq!(h.shard(0).queue_len("q"), Some(0));
}

#[test]
fn declare_checks_x_delayed_type_as_the_plugin() {
    let mut h = Harness::new();
    let c = h.connect(1);
    let cases: [(FieldTable, u16); 3] = [
        (FieldTable::new(), 406),
        (delayed_args("x-delayed-message"), 406),
        (delayed_args("nope"), 503),
    ];
    // Each on a connection of its own: 503 is a connection error.
    for (i, (args, code)) in cases.into_iter().enumerate() {
        let c = h.connect(10 + i as u64);
        let fx = declare_exchange(&mut h, c, "d", "x-delayed-message", args, false);
        assert_eq!(error_code(&fx), Some(code), "{fx:?}");
    }
    for kind in ["direct", "topic", "fanout", "headers"] {
        let fx = declare_exchange(
            &mut h,
            c,
            &format!("d-{kind}"),
            "x-delayed-message",
            delayed_args(kind),
            false,
        );
        assert!(
            matches!(
                fx.as_slice(),
                [Effect::Reply {
                    reply: Reply::ExchangeDeclareOk,
                    ..
                }]
            ),
            "{kind}: {fx:?}"
        );
    }
    // A delayed exchange is not equivalent to its underlying type.
    let fx = declare_exchange(&mut h, c, "d-direct", "direct", FieldTable::new(), false);
    assert_eq!(error_code(&fx), Some(406), "{fx:?}");
    let c = h.open(1, 2);
    let mut args = delayed_args("direct");
    args.insert("x-max-scheduled".into(), FieldValue::I64(-1));
    let fx = declare_exchange(&mut h, c, "d-bad", "x-delayed-message", args, false);
    assert_eq!(error_code(&fx), Some(406), "{fx:?}");
}

#[test]
fn topic_underlying_type_routes_by_pattern_when_due() {
    let mut h = Harness::new();
    let c = h.connect(1);
    declare_exchange(
        &mut h,
        c,
        "dt",
        "x-delayed-message",
        delayed_args("topic"),
        false,
    );
    h.declare(c, "q");
    h.bind(c, "q", "dt", "a.*");
    h.consume(c, "q", "t", true);
    publish_with(
        &mut h,
        c,
        "dt",
        "a.b",
        "yes",
        delay(FieldValue::I64(10)),
        false,
        false,
    );
    publish_with(
        &mut h,
        c,
        "dt",
        "b.b",
        "no",
        delay(FieldValue::I64(10)),
        false,
        false,
    );
    assert_eq!(bodies(&h.tick(20)), ["yes"]);
}

#[test]
fn mandatory_is_returned_at_once_as_the_plugin_does() {
    let mut h = Harness::new();
    let c = setup(&mut h);
    let fx = publish_with(
        &mut h,
        c,
        "d",
        "k",
        "m",
        delay(FieldValue::I64(10)),
        false,
        true,
    );
    assert!(
        fx.iter().any(|e| matches!(
            e,
            Effect::Return {
                reply_code: 312,
                ..
            }
        )),
        "{fx:?}"
    );
    assert_eq!(bodies(&h.tick(20)), ["m"], "and still delivered when due");
}

#[test]
fn x_deliver_at_schedules_on_any_exchange() {
    let mut h = Harness::new();
    let c = h.connect(1);
    h.declare(c, "q");
    h.bind(c, "q", "amq.direct", "k");
    h.consume(c, "q", "t", true);
    let at = h.now + 100;
    let mut headers = FieldTable::new();
    headers.insert("x-deliver-at".into(), FieldValue::I64(at as i64));
    assert!(
        bodies(&publish_with(
            &mut h,
            c,
            "amq.direct",
            "k",
            "at",
            headers,
            false,
            false
        ))
        .is_empty()
    );
    assert!(bodies(&h.tick(90)).is_empty());
    assert_eq!(bodies(&h.tick(10)), ["at"]);
    // In the past: at once.
    let mut headers = FieldTable::new();
    headers.insert("x-deliver-at".into(), FieldValue::I64(1));
    assert_eq!(
        bodies(&publish_with(
            &mut h,
            c,
            "amq.direct",
            "k",
            "past",
            headers,
            false,
            false
        )),
        ["past"]
    );
}

fn confirm_acks(fx: &[Effect]) -> Vec<(u64, bool)> {
    fx.iter()
        .filter_map(|e| match e {
            Effect::Confirm { seq, ack, .. } => Some((*seq, *ack)),
            _ => None,
        })
        .collect()
}

/// A sync of shard 0 whose store keeps it (what survives `MemoryStore::crash`).
fn sync(h: &mut Harness, store: &MemoryStore) -> Vec<Effect> {
    let now = h.now;
    if let Some(epoch) = h.shard(0).start_sync() {
        assert_eq!(store.complete_sync(), Some(epoch));
        h.shard(0).synced(now, epoch);
    }
    h.settle()
}

fn durable_setup(
    h: &mut Harness,
    store: &MemoryStore,
    args: FieldTable,
) -> warren_core::ids::ChannelRef {
    let c = h.connect(1);
    declare_exchange(h, c, "d", "x-delayed-message", args, true);
    h.op(
        c,
        Op::QueueDeclare(QueueDeclare {
            queue: "q".into(),
            passive: false,
            durable: true,
            exclusive: false,
            auto_delete: false,
            nowait: false,
            arguments: FieldTable::new(),
        }),
    );
    h.bind(c, "q", "d", "k");
    h.op(c, Op::ConfirmSelect { nowait: false });
    sync(h, store);
    c
}

#[test]
fn confirmed_after_the_sync_and_kept_through_a_crash() {
    let store = MemoryStore::new();
    let mut h = Harness::of(vec![Broker::with_store(
        BrokerConfig::default(),
        Box::new(store.clone()),
    )]);
    let c = durable_setup(&mut h, &store, delayed_args("direct"));
    let fx = publish_with(
        &mut h,
        c,
        "d",
        "k",
        "kept",
        delay(FieldValue::I64(1000)),
        true,
        false,
    );
    assert!(confirm_acks(&fx).is_empty(), "not before the sync: {fx:?}");
    let fx = sync(&mut h, &store);
    assert_eq!(confirm_acks(&fx), [(1, true)]);
    // A transient one is confirmed at once and does not survive.
    let fx = publish_with(
        &mut h,
        c,
        "d",
        "k",
        "lost",
        delay(FieldValue::I64(500)),
        false,
        false,
    );
    assert_eq!(confirm_acks(&fx), [(2, true)]);
    // Unsynced and persistent: not confirmed, may be lost.
    publish_with(
        &mut h,
        c,
        "d",
        "k",
        "unsynced",
        delay(FieldValue::I64(500)),
        true,
        false,
    );
    assert_eq!(store.scheduled(), 3);
    store.crash();
    assert_eq!(
        store.scheduled(),
        1,
        "only the synced persistent one survives"
    );
    let defs = store.definitions();
    let mut b = Broker::with_store(BrokerConfig::default(), Box::new(store.clone()));
    // Restarted after its due time: delivered at the first tick.
    let now = h.now + 5000;
    assert!(b.restore(now, &defs).is_empty());
    assert_eq!(b.scheduled_counts().0, 1);
    assert!(b.next_deadline().is_some_and(|at| at <= now));
    b.tick(now);
    assert_eq!(b.queue_len("q"), Some(1));
    assert_eq!(b.scheduled_counts().0, 0);
}

#[test]
fn the_window_pages_through_the_store_in_due_order() {
    let store = MemoryStore::new();
    let mut b = Broker::with_store(BrokerConfig::default(), Box::new(store.clone()));
    b.set_schedule_window(8, u64::MAX);
    let mut h = Harness::of(vec![b]);
    let c = setup(&mut h);
    let start = h.now;
    // 100 messages in a scrambled due order, 8 at most in memory.
    let dues: Vec<u64> = (0..100u64).map(|i| (i * 37) % 100 + 10).collect();
    for (i, d) in dues.iter().enumerate() {
        // Labelled by due time (the op's time, one ms after the last, plus the delay).
        let due = h.now + 1 + d;
        publish_with(
            &mut h,
            c,
            "d",
            "k",
            &format!("{due:06}-{i:03}"),
            delay(FieldValue::I64(*d as i64)),
            false,
            false,
        );
        assert!(
            h.shard(0).scheduled_counts().1 <= 8,
            "the window is bounded"
        );
    }
    assert_eq!(h.shard(0).scheduled_counts().0, 100);
    let mut got = Vec::new();
    for _ in 0..30 {
        got.extend(bodies(&h.tick(5)));
    }
    assert_eq!(got.len(), 100);
    let mut sorted = got.clone();
    sorted.sort();
    assert_eq!(got, sorted, "in due order");
    assert!(h.now > start);
    assert_eq!(store.scheduled(), 0, "removed from the store once routed");
}

#[test]
fn x_max_scheduled_refuses_with_406_or_nacks() {
    let mut h = Harness::new();
    let c = h.connect(1);
    let mut args = delayed_args("direct");
    args.insert("x-max-scheduled".into(), FieldValue::I64(2));
    declare_exchange(&mut h, c, "d", "x-delayed-message", args.clone(), false);
    for i in 0..2 {
        let fx = publish_with(
            &mut h,
            c,
            "d",
            "k",
            &i.to_string(),
            delay(FieldValue::I64(100)),
            false,
            false,
        );
        assert!(error_code(&fx).is_none());
    }
    let fx = publish_with(
        &mut h,
        c,
        "d",
        "k",
        "over",
        delay(FieldValue::I64(100)),
        false,
        false,
    );
    assert_eq!(error_code(&fx), Some(406), "{fx:?}");
    // Not delayed: not limited.
    let c = h.open(1, 2);
    let fx = publish_with(&mut h, c, "d", "k", "now", FieldTable::new(), false, false);
    assert!(error_code(&fx).is_none());

    args.insert("x-overflow".into(), FieldValue::string("reject-publish"));
    declare_exchange(&mut h, c, "r", "x-delayed-message", args, false);
    h.op(c, Op::ConfirmSelect { nowait: false });
    let mut acks = Vec::new();
    for i in 0..3 {
        acks.extend(confirm_acks(&publish_with(
            &mut h,
            c,
            "r",
            "k",
            &i.to_string(),
            delay(FieldValue::I64(100)),
            false,
            false,
        )));
    }
    assert_eq!(acks, [(1, true), (2, true), (3, false)]);
}

#[test]
fn purge_and_listing() {
    let mut h = Harness::new();
    let c = setup(&mut h);
    publish_with(
        &mut h,
        c,
        "d",
        "k",
        "a",
        delay(FieldValue::I64(100)),
        false,
        false,
    );
    publish_with(
        &mut h,
        c,
        "d",
        "k",
        "b",
        delay(FieldValue::I64(50)),
        false,
        false,
    );
    let now = h.now;
    let list = h.shard(0).list_scheduled();
    assert_eq!(
        list,
        [("/".to_string(), "d".to_string(), 2, Some(now + 50))]
    );
    assert_eq!(h.shard(0).purge_scheduled("/", "d"), 2);
    assert!(h.shard(0).list_scheduled().is_empty());
    assert!(bodies(&h.tick(200)).is_empty());
}
