//! At-least-once dead-lettering of quorum queues (`x-dead-letter-strategy: at-least-once`
//! with `x-overflow: reject-publish`, RabbitMQ 3.10's `rabbit_fifo_dlx`): a dead letter
//! stays in its queue, counted against its limits, until its targets confirm it; a crash
//! keeps it; a target that is missing or refuses it gets it again later.

mod common;

use bytes::Bytes;
use common::*;
use std::sync::Arc;
use warren_core::command::{ExchangeDeclare, Op, Publish, QueueDeclare};
use warren_core::effect::{Effect, Reply};
use warren_core::ids::ChannelRef;
use warren_core::message::{FieldTable, FieldValue, Properties};
use warren_core::store::MemoryStore;

fn args(pairs: &[(&str, FieldValue)]) -> FieldTable {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect()
}

fn on_store(store: &MemoryStore, now: u64) -> Harness {
    Harness {
        shards: warren_core::shards::Shards::new(vec![warren_core::Broker::with_store(
            Default::default(),
            Box::new(store.clone()),
        )]),
        now,
    }
}

/// A broker on `store` after a crash of the previous one, restored at `now`.
fn restarted(store: &MemoryStore, now: u64) -> Harness {
    store.crash();
    let mut h = on_store(store, now);
    let errors = h.shards[0].restore(now, &store.definitions());
    assert!(errors.is_empty(), "restore: {errors:?}");
    h
}

/// Completes whatever sync the broker has to start (the host's part).
fn sync(h: &mut Harness, store: &MemoryStore) {
    while let Some(epoch) = h.shards[0].start_sync() {
        assert_eq!(store.complete_sync(), Some(epoch));
        h.shards[0].synced(h.now, epoch);
        let mut fx = Vec::new();
        h.shards[0].poll_effects(&mut fx);
    }
}

fn tick(h: &mut Harness, ms: u64) {
    h.now += ms;
    let now = h.now;
    h.shards[0].tick(now);
    let mut fx = Vec::new();
    h.shards[0].poll_effects(&mut fx);
    h.shards[0].check_invariants().expect("invariants");
}

fn declare(h: &mut Harness, c: ChannelRef, name: &str, arguments: FieldTable) -> Vec<Effect> {
    h.op(
        c,
        Op::QueueDeclare(QueueDeclare {
            queue: name.into(),
            passive: false,
            durable: true,
            exclusive: false,
            auto_delete: false,
            nowait: false,
            arguments,
        }),
    )
}

fn direct_exchange(h: &mut Harness, c: ChannelRef, name: &str) {
    let fx = h.op(
        c,
        Op::ExchangeDeclare(ExchangeDeclare {
            exchange: name.into(),
            kind: "direct".into(),
            passive: false,
            durable: true,
            auto_delete: false,
            internal: false,
            nowait: false,
            arguments: FieldTable::new(),
        }),
    );
    assert_eq!(fx.len(), 1, "{fx:?}");
}

/// The source: a quorum queue dead-lettering to `dlx` at least once, at most `max` long.
fn source(h: &mut Harness, c: ChannelRef, strategy_args: &[(&str, FieldValue)], max: i32) {
    let mut a = args(&[
        ("x-queue-type", FieldValue::string("quorum")),
        ("x-dead-letter-exchange", FieldValue::string("dlx")),
        (
            "x-dead-letter-strategy",
            FieldValue::string("at-least-once"),
        ),
        ("x-max-length", FieldValue::I32(max)),
    ]);
    a.extend(args(strategy_args));
    let fx = declare(h, c, "src", a);
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
}

fn reject_publish() -> [(&'static str, FieldValue); 1] {
    [("x-overflow", FieldValue::string("reject-publish"))]
}

/// Publishes `body` to `queue` (persistent, confirmed); true if the queue took it.
fn publish(h: &mut Harness, store: &MemoryStore, c: ChannelRef, queue: &str, body: &str) -> bool {
    let mut fx = h.op(
        c,
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
        })),
    );
    while let Some(epoch) = h.shards[0].start_sync() {
        assert_eq!(store.complete_sync(), Some(epoch));
        h.shards[0].synced(h.now, epoch);
        h.shards[0].poll_effects(&mut fx);
    }
    fx.iter()
        .find_map(|e| match e {
            Effect::Confirm { ack, .. } => Some(*ack),
            _ => None,
        })
        .expect("a confirm")
}

/// Gets the next message of `queue` with an ack and rejects it without requeue.
fn get_and_reject(h: &mut Harness, c: ChannelRef, queue: &str) -> String {
    let fx = h.op(
        c,
        Op::Get {
            queue: queue.into(),
            no_ack: false,
        },
    );
    let (tag, body) = fx
        .iter()
        .find_map(|e| match e {
            Effect::Reply {
                reply: Reply::GetOk { delivery, .. },
                ..
            } => Some((
                delivery.delivery_tag,
                String::from_utf8_lossy(&delivery.message.body).into_owned(),
            )),
            _ => None,
        })
        .expect("a message");
    h.op(
        c,
        Op::Reject {
            delivery_tag: tag,
            requeue: false,
        },
    );
    body
}

/// Drains `queue` with no-ack gets: the bodies and the `x-death` reason of each.
fn drain(h: &mut Harness, c: ChannelRef, queue: &str) -> Vec<(String, Option<FieldValue>)> {
    let mut out = Vec::new();
    loop {
        let fx = h.op(
            c,
            Op::Get {
                queue: queue.into(),
                no_ack: true,
            },
        );
        let got = fx.into_iter().find_map(|e| match e {
            Effect::Reply {
                reply: Reply::GetOk { delivery, .. },
                ..
            } => Some(delivery),
            _ => None,
        });
        let Some(d) = got else {
            return out;
        };
        let reason = match d
            .message
            .properties
            .headers
            .as_ref()
            .and_then(|h| h.get("x-death"))
        {
            Some(FieldValue::Array(items)) => match items.first() {
                Some(FieldValue::Table(t)) => t.get("reason").cloned(),
                _ => None,
            },
            _ => None,
        };
        out.push((
            String::from_utf8_lossy(&d.message.body).into_owned(),
            reason,
        ));
    }
}

fn confirm_mode(h: &mut Harness, c: ChannelRef) {
    h.op(c, Op::ConfirmSelect { nowait: false });
}

/// A broker on `store` at time 0 with one connection in confirm mode and the direct
/// exchange "dlx" declared: where most tests here start.
fn confirming_with_dlx(store: &MemoryStore) -> (Harness, ChannelRef) {
    let mut h = on_store(store, 0);
    let c = h.connect(1);
    confirm_mode(&mut h, c);
    direct_exchange(&mut h, c, "dlx");
    (h, c)
}

#[test]
fn dead_letters_wait_in_their_queue_through_a_crash_until_a_target_takes_them() {
    let store = MemoryStore::new();
    let (mut h, c) = confirming_with_dlx(&store);
    source(&mut h, c, &reject_publish(), 3);
    assert!(publish(&mut h, &store, c, "src", "a"));
    assert!(publish(&mut h, &store, c, "src", "b"));
    assert_eq!(get_and_reject(&mut h, c, "src"), "a");
    assert_eq!(get_and_reject(&mut h, c, "src"), "b");
    sync(&mut h, &store);
    // The broker asks for a tick when the unroutable dead letters are to be tried again.
    let due = h.shards[0].next_deadline().expect("a retry deadline");
    assert!(
        due > h.now && due <= h.now + 1_000,
        "due {due} at {}",
        h.now
    );
    // Nothing is bound to `dlx`: both dead letters stay in `src`, and count against its
    // limit of 3 (RabbitMQ counts its "dlx" messages): one more fits, not two.
    assert!(publish(&mut h, &store, c, "src", "c"));
    assert!(
        !publish(&mut h, &store, c, "src", "d"),
        "the held dead letters count"
    );
    tick(&mut h, 5_000);
    sync(&mut h, &store);
    // A crash keeps them.
    let mut h = restarted(&store, h.now + 1);
    let c = h.connect(1);
    confirm_mode(&mut h, c);
    tick(&mut h, 5_000);
    declare(&mut h, c, "dlq", FieldTable::new());
    h.bind(c, "dlq", "dlx", "src");
    // Forwarded once the retry comes round, each exactly once.
    tick(&mut h, 1_000);
    sync(&mut h, &store);
    tick(&mut h, 5_000);
    sync(&mut h, &store);
    let got = drain(&mut h, c, "dlq");
    let rejected = Some(FieldValue::string("rejected"));
    assert_eq!(
        got,
        vec![
            ("a".to_string(), rejected.clone()),
            ("b".to_string(), rejected)
        ]
    );
    // Confirmed, they left `src`: two publishes fit again, and a crash brings none back.
    assert!(publish(&mut h, &store, c, "src", "e"));
    assert!(publish(&mut h, &store, c, "src", "f"));
    sync(&mut h, &store);
    let mut h = restarted(&store, h.now + 1);
    let c = h.connect(1);
    tick(&mut h, 5_000);
    assert_eq!(drain(&mut h, c, "dlq"), vec![], "none forwarded twice");
    let left: Vec<String> = drain(&mut h, c, "src").into_iter().map(|m| m.0).collect();
    assert_eq!(left, ["c", "e", "f"]);
}

#[test]
fn a_target_that_refuses_gets_the_dead_letter_again_once_it_has_room() {
    let store = MemoryStore::new();
    let (mut h, c) = confirming_with_dlx(&store);
    // The target takes one message at a time.
    declare(
        &mut h,
        c,
        "dlq",
        args(&[
            ("x-max-length", FieldValue::I32(1)),
            ("x-overflow", FieldValue::string("reject-publish")),
        ]),
    );
    h.bind(c, "dlq", "dlx", "src");
    source(&mut h, c, &reject_publish(), 10);
    for body in ["a", "b", "c"] {
        assert!(publish(&mut h, &store, c, "src", body));
    }
    // Expired, rejected and over the delivery limit all go the same way; rejections here.
    for body in ["a", "b", "c"] {
        assert_eq!(get_and_reject(&mut h, c, "src"), body);
    }
    sync(&mut h, &store);
    let mut got = Vec::new();
    for _ in 0..3 {
        got.extend(drain(&mut h, c, "dlq").into_iter().map(|m| m.0));
        tick(&mut h, 1_000);
        sync(&mut h, &store);
    }
    got.extend(drain(&mut h, c, "dlq").into_iter().map(|m| m.0));
    assert_eq!(got, ["a", "b", "c"], "each once, in order, as room came");
    tick(&mut h, 5_000);
    assert_eq!(drain(&mut h, c, "dlq"), vec![]);
    // All confirmed: `src` is empty, and a crash brings nothing back.
    let mut h = restarted(&store, h.now + 1);
    let c = h.connect(1);
    tick(&mut h, 5_000);
    assert_eq!(drain(&mut h, c, "dlq"), vec![]);
    assert_eq!(drain(&mut h, c, "src"), vec![]);
}

#[test]
fn without_reject_publish_at_least_once_falls_back_to_at_most_once() {
    let store = MemoryStore::new();
    let (mut h, c) = confirming_with_dlx(&store);
    // drop-head (the default overflow): RabbitMQ 3.10 falls back to at-most-once.
    source(&mut h, c, &[], 3);
    assert!(publish(&mut h, &store, c, "src", "a"));
    assert_eq!(get_and_reject(&mut h, c, "src"), "a");
    sync(&mut h, &store);
    declare(&mut h, c, "dlq", FieldTable::new());
    h.bind(c, "dlq", "dlx", "src");
    tick(&mut h, 5_000);
    assert_eq!(
        drain(&mut h, c, "dlq"),
        vec![],
        "dropped when it died unroutable"
    );
}

#[test]
fn a_purge_takes_the_held_dead_letters_too() {
    let store = MemoryStore::new();
    let (mut h, c) = confirming_with_dlx(&store);
    source(&mut h, c, &reject_publish(), 10);
    assert!(publish(&mut h, &store, c, "src", "a"));
    assert!(publish(&mut h, &store, c, "src", "b"));
    assert_eq!(get_and_reject(&mut h, c, "src"), "a");
    let fx = h.op(
        c,
        Op::QueuePurge {
            queue: "src".into(),
            nowait: false,
        },
    );
    assert!(
        fx.iter().any(|e| matches!(
            e,
            Effect::Reply {
                reply: Reply::QueuePurgeOk { message_count: 2 },
                ..
            }
        )),
        "{fx:?}"
    );
    sync(&mut h, &store);
    declare(&mut h, c, "dlq", FieldTable::new());
    h.bind(c, "dlq", "dlx", "src");
    tick(&mut h, 5_000);
    assert_eq!(drain(&mut h, c, "dlq"), vec![]);
    let mut h = restarted(&store, h.now + 1);
    let c = h.connect(1);
    tick(&mut h, 5_000);
    assert_eq!(drain(&mut h, c, "dlq"), vec![]);
}

/// Publishes `body` (persistent) on `c` of a sharded harness, syncing `sync_shards` until
/// the confirm comes; true if acked.
fn publish_sharded(h: &mut Harness, c: ChannelRef, queue: &str, body: &str) -> bool {
    let mut fx = h.op(
        c,
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
        })),
    );
    for _ in 0..3 {
        for i in 0..h.k() {
            fx.extend(h.sync(i, true));
        }
    }
    fx.iter()
        .find_map(|e| match e {
            Effect::Confirm { ack, .. } => Some(*ack),
            _ => None,
        })
        .expect("a confirm")
}

#[test]
fn a_target_on_another_shard_confirms_after_its_own_sync() {
    let mut h = Harness::sharded_with_stores(Default::default(), 2);
    // Connection n is on shard n % 2, and a queue lives on its declarer's shard.
    let c0 = h.connect(2);
    let c1 = h.connect(1);
    confirm_mode(&mut h, c0);
    direct_exchange(&mut h, c0, "dlx");
    declare(&mut h, c1, "dlq", FieldTable::new());
    h.bind(c1, "dlq", "dlx", "src");
    source(&mut h, c0, &reject_publish(), 2);
    assert!(publish_sharded(&mut h, c0, "src", "a"));
    assert_eq!(get_and_reject(&mut h, c0, "src"), "a");
    // Forwarded to shard 1, which has not synced it yet: `src` still holds it, and it
    // counts against the limit of 2.
    let fx = h.op(
        c0,
        Op::Publish(Box::new(Publish {
            exchange: Arc::from(""),
            routing_key: Arc::from("src"),
            mandatory: false,
            immediate: false,
            properties: Properties::default(),
            body: Bytes::from_static(b"x"),
            routed: None,
        })),
    );
    assert!(fx.is_empty(), "{fx:?}");
    let mut refused = h.op(
        c0,
        Op::Publish(Box::new(Publish {
            exchange: Arc::from(""),
            routing_key: Arc::from("src"),
            mandatory: false,
            immediate: false,
            properties: Properties::default(),
            body: Bytes::from_static(b"y"),
            routed: None,
        })),
    );
    // Confirms go in publish order: `x`'s waits for shard 0's sync.
    refused.extend(h.sync(0, true));
    assert!(
        refused
            .iter()
            .any(|e| matches!(e, Effect::Confirm { ack: false, .. })),
        "held until shard 1 syncs: {refused:?}"
    );
    // Shard 1's sync releases its answer; the dead letter leaves `src`.
    let _ = h.sync(1, true);
    let _ = h.sync(0, true);
    assert!(publish_sharded(&mut h, c0, "src", "z"), "room again");
    let got: Vec<String> = drain(&mut h, c1, "dlq").into_iter().map(|m| m.0).collect();
    assert_eq!(got, ["a"]);
    let left: Vec<String> = drain(&mut h, c0, "src").into_iter().map(|m| m.0).collect();
    assert_eq!(left, ["x", "z"]);
}

#[test]
fn a_message_over_its_delivery_limit_is_held_like_a_rejected_one() {
    let store = MemoryStore::new();
    let (mut h, c) = confirming_with_dlx(&store);
    source(
        &mut h,
        c,
        &[
            ("x-overflow", FieldValue::string("reject-publish")),
            ("x-delivery-limit", FieldValue::I32(0)),
        ],
        10,
    );
    assert!(publish(&mut h, &store, c, "src", "poison"));
    // Returned once: over a limit of 0, so it dies (with no queue bound yet).
    let fx = h.op(
        c,
        Op::Get {
            queue: "src".into(),
            no_ack: false,
        },
    );
    let tag = fx
        .iter()
        .find_map(|e| match e {
            Effect::Reply {
                reply: Reply::GetOk { delivery, .. },
                ..
            } => Some(delivery.delivery_tag),
            _ => None,
        })
        .expect("a message");
    h.op(
        c,
        Op::Nack {
            delivery_tag: tag,
            multiple: false,
            requeue: true,
        },
    );
    sync(&mut h, &store);
    assert_eq!(drain(&mut h, c, "src"), vec![], "not ready any more");
    let mut h = restarted(&store, h.now + 1);
    let c = h.connect(1);
    declare(&mut h, c, "dlq", FieldTable::new());
    h.bind(c, "dlq", "dlx", "src");
    tick(&mut h, 1_000);
    assert_eq!(
        drain(&mut h, c, "dlq"),
        vec![(
            "poison".to_string(),
            Some(FieldValue::string("delivery_limit"))
        )]
    );
}

fn strategy_policy(h: &mut Harness, on: bool) {
    use warren_core::admin::AdminRequest;
    let request = if on {
        AdminRequest::SetPolicy(warren_core::policy::PolicyDef {
            vhost: "/".into(),
            name: "alo".into(),
            pattern: "^src$".into(),
            apply_to: warren_core::policy::ApplyTo::Queues,
            priority: 0,
            definition: FieldTable::from([(
                "dead-letter-strategy".into(),
                FieldValue::string("at-least-once"),
            )]),
        })
    } else {
        AdminRequest::ClearPolicy {
            vhost: "/".into(),
            name: "alo".into(),
        }
    };
    let now = h.now;
    h.shards.admin(now, request);
    h.settle();
}

#[test]
fn a_policy_switches_the_strategy_and_switching_away_deletes_what_is_held() {
    let store = MemoryStore::new();
    let (mut h, c) = confirming_with_dlx(&store);
    let fx = declare(
        &mut h,
        c,
        "src",
        args(&[
            ("x-queue-type", FieldValue::string("quorum")),
            ("x-dead-letter-exchange", FieldValue::string("dlx")),
            ("x-overflow", FieldValue::string("reject-publish")),
        ]),
    );
    assert_eq!(fx.len(), 1, "{fx:?}");
    // At least once by policy: held while unroutable; the policy going deletes it
    // (RabbitMQ's switch_from).
    strategy_policy(&mut h, true);
    assert!(publish(&mut h, &store, c, "src", "a"));
    assert_eq!(get_and_reject(&mut h, c, "src"), "a");
    sync(&mut h, &store);
    strategy_policy(&mut h, false);
    sync(&mut h, &store);
    declare(&mut h, c, "dlq", FieldTable::new());
    h.bind(c, "dlq", "dlx", "src");
    tick(&mut h, 5_000);
    assert_eq!(drain(&mut h, c, "dlq"), vec![], "deleted with the policy");
    // Back on, through a restart: the policy is restored and the dead letter still owed
    // is forwarded.
    strategy_policy(&mut h, true);
    let fx = h.op(
        c,
        Op::QueueUnbind(warren_core::command::Bind {
            destination: "dlq".into(),
            source: "dlx".into(),
            routing_key: "src".into(),
            nowait: false,
            arguments: FieldTable::new(),
        }),
    );
    assert_eq!(fx.len(), 1, "{fx:?}");
    assert!(publish(&mut h, &store, c, "src", "b"));
    assert_eq!(get_and_reject(&mut h, c, "src"), "b");
    sync(&mut h, &store);
    let mut h = restarted(&store, h.now + 1);
    let c = h.connect(1);
    h.bind(c, "dlq", "dlx", "src");
    tick(&mut h, 1_000);
    let got: Vec<String> = drain(&mut h, c, "dlq").into_iter().map(|m| m.0).collect();
    assert_eq!(got, ["b"]);
}

fn notices(h: &mut Harness) -> Vec<warren_core::Notice> {
    let mut out = Vec::new();
    assert_eq!(h.shard(0).take_notices(&mut out), 0, "none dropped");
    out
}

fn held_in_listing(h: &mut Harness, queue: &str) -> u64 {
    h.shard(0)
        .list_queues()
        .into_iter()
        .find(|q| q.name == queue)
        .map(|q| q.messages_dlx)
        .expect("listed")
}

#[test]
fn held_dead_letters_are_counted_in_listings_and_noted_once_when_held_and_released() {
    use warren_core::Notice;
    let store = MemoryStore::new();
    let (mut h, c) = confirming_with_dlx(&store);
    source(&mut h, c, &reject_publish(), 10);
    notices(&mut h);
    assert!(publish(&mut h, &store, c, "src", "a"));
    assert!(publish(&mut h, &store, c, "src", "b"));
    assert_eq!(get_and_reject(&mut h, c, "src"), "a");
    assert_eq!(held_in_listing(&mut h, "src"), 1, "RabbitMQ's messages_dlx");
    assert_eq!(get_and_reject(&mut h, c, "src"), "b");
    sync(&mut h, &store);
    assert_eq!(held_in_listing(&mut h, "src"), 2);
    // Unroutable (nothing bound to `dlx`): one notice for the wait, not one per retry.
    tick(&mut h, 3_000);
    let got = notices(&mut h);
    assert_eq!(
        got,
        vec![Notice::DeadLettersHeld {
            vhost: "/".into(),
            queue: "src".into(),
            held: 1,
            unroutable: true,
        }],
        "the first dead letter's wait, noted once over several retries"
    );
    declare(&mut h, c, "dlq", FieldTable::new());
    h.bind(c, "dlq", "dlx", "src");
    tick(&mut h, 1_000);
    sync(&mut h, &store);
    tick(&mut h, 1_000);
    sync(&mut h, &store);
    let got = notices(&mut h);
    assert!(
        matches!(got.first(), Some(Notice::DeadLettersReleased { queue, .. }) if &**queue == "src"),
        "{got:?}"
    );
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(held_in_listing(&mut h, "src"), 0);
    assert_eq!(drain(&mut h, c, "dlq").len(), 2);
}

#[test]
fn a_policy_asking_for_at_least_once_without_reject_publish_is_warned_about() {
    let store = MemoryStore::new();
    let mut h = on_store(&store, 0);
    let c = h.connect(1);
    direct_exchange(&mut h, c, "dlx");
    declare(
        &mut h,
        c,
        "src",
        args(&[
            ("x-queue-type", FieldValue::string("quorum")),
            ("x-dead-letter-exchange", FieldValue::string("dlx")),
        ]),
    );
    notices(&mut h);
    // drop-head (the default overflow): RabbitMQ 3.10 falls back to at-most-once, and
    // says so.
    strategy_policy(&mut h, true);
    let got = notices(&mut h);
    assert!(
        matches!(
            got.as_slice(),
            [warren_core::Notice::DeadLetterFallback { queue, text, .. }]
                if &**queue == "src" && text.starts_with("Falling back to dead-letter-strategy at-most-once")
        ),
        "{got:?}"
    );
}
