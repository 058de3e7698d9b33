//! RabbitMQ queue features in the core: message TTL (queue and per message), dead-lettering
//! with `x-death`, length limits with each overflow mode, queue expiry, single active
//! consumer, consumer priorities, argument validation.

mod common;

use bytes::Bytes;
use common::*;
use std::sync::Arc;
use warren_core::command::{Consume, Op, Publish, QueueDeclare};
use warren_core::effect::{Effect, Reply};
use warren_core::ids::ChannelRef;
use warren_core::message::{FieldTable, FieldValue, Properties};

fn args(pairs: &[(&str, FieldValue)]) -> FieldTable {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect()
}

fn declare(h: &mut Harness, c: ChannelRef, name: &str, arguments: FieldTable) -> Vec<Effect> {
    h.op(
        c,
        Op::QueueDeclare(QueueDeclare {
            queue: name.into(),
            passive: false,
            durable: false,
            exclusive: false,
            auto_delete: false,
            nowait: false,
            arguments,
        }),
    )
}

fn publish_with(
    h: &mut Harness,
    c: ChannelRef,
    key: &str,
    body: &str,
    properties: Properties,
) -> Vec<Effect> {
    h.op(
        c,
        Op::Publish(Box::new(Publish {
            exchange: Arc::from(""),
            routing_key: Arc::from(key),
            mandatory: false,
            immediate: false,
            properties,
            body: Bytes::copy_from_slice(body.as_bytes()),
            routed: None,
        })),
    )
}

fn get(
    h: &mut Harness,
    c: ChannelRef,
    queue: &str,
) -> Option<(String, Properties, String, String)> {
    let fx = h.op(
        c,
        Op::Get {
            queue: queue.into(),
            no_ack: true,
        },
    );
    fx.into_iter().find_map(|e| match e {
        Effect::Reply {
            reply: Reply::GetOk { delivery, .. },
            ..
        } => Some((
            String::from_utf8_lossy(&delivery.message.body).into_owned(),
            delivery.message.properties.clone(),
            delivery.message.exchange.to_string(),
            delivery.message.routing_key.to_string(),
        )),
        _ => None,
    })
}

/// Advances the clock by `by` ms and ticks.
fn after(h: &mut Harness, by: u64) -> Vec<Effect> {
    let to = h.now + by;
    tick(h, to)
}

fn tick(h: &mut Harness, to: u64) -> Vec<Effect> {
    h.now = to;
    h.shards[0].tick(to);
    let mut fx = Vec::new();
    h.shards[0].poll_effects(&mut fx);
    h.shards[0].check_invariants().expect("invariants");
    fx
}

/// A queue `q` dead-lettering to `dlq` through the fanout exchange `dlx`.
fn with_dlx(h: &mut Harness, c: ChannelRef, extra: &[(&str, FieldValue)]) {
    h.exchange(c, "dlx", "fanout", FieldTable::new());
    h.declare(c, "dlq");
    h.bind(c, "dlq", "dlx", "");
    let mut a = vec![("x-dead-letter-exchange", FieldValue::string("dlx"))];
    a.extend(extra.iter().cloned());
    let fx = declare(h, c, "q", args(&a));
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

fn death(props: &Properties) -> FieldTable {
    match props.headers.as_ref().and_then(|h| h.get("x-death")) {
        Some(FieldValue::Array(items)) => match items.first() {
            Some(FieldValue::Table(t)) => t.clone(),
            other => panic!("x-death entry: {other:?}"),
        },
        other => panic!("x-death: {other:?}"),
    }
}

#[test]
fn queue_ttl_expires_at_the_head_and_dead_letters_with_x_death() {
    let mut h = Harness::new();
    let c = h.connect(1);
    with_dlx(&mut h, c, &[("x-message-ttl", FieldValue::I32(1000))]);
    h.now = 9_999; // the harness advances the clock by 1 ms per op: published at 10_000
    publish_with(&mut h, c, "q", "m1", Properties::default());
    assert_eq!(h.shards[0].next_deadline(), Some(11_001));
    assert!(tick(&mut h, 11_000).is_empty());
    assert_eq!(
        h.shards[0].queue_len("q"),
        Some(1),
        "not yet expired at the deadline"
    );
    tick(&mut h, 11_001);
    assert_eq!(h.shards[0].queue_len("q"), Some(0));
    assert_eq!(h.shards[0].queue_len("dlq"), Some(1));
    let (body, props, exchange, key) = get(&mut h, c, "dlq").expect("dead-lettered");
    assert_eq!(
        (body.as_str(), exchange.as_str(), key.as_str()),
        ("m1", "dlx", "q")
    );
    let d = death(&props);
    assert_eq!(d.get("reason"), Some(&FieldValue::string("expired")));
    assert_eq!(d.get("queue"), Some(&FieldValue::string("q")));
    assert_eq!(d.get("exchange"), Some(&FieldValue::string("")));
    assert_eq!(d.get("count"), Some(&FieldValue::I64(1)));
    assert_eq!(d.get("time"), Some(&FieldValue::Timestamp(11)));
    assert_eq!(
        d.get("routing-keys"),
        Some(&FieldValue::Array(vec![FieldValue::string("q")]))
    );
    let headers = props.headers.expect("headers");
    assert_eq!(
        headers.get("x-first-death-reason"),
        Some(&FieldValue::string("expired"))
    );
    assert_eq!(
        headers.get("x-first-death-queue"),
        Some(&FieldValue::string("q"))
    );
    assert_eq!(
        headers.get("x-first-death-exchange"),
        Some(&FieldValue::string(""))
    );
}

#[test]
fn per_message_expiration_goes_into_original_expiration() {
    let mut h = Harness::new();
    let c = h.connect(1);
    with_dlx(&mut h, c, &[]);
    let props = Properties {
        expiration: Some("50".into()),
        ..Default::default()
    };
    publish_with(&mut h, c, "q", "m1", props);
    after(&mut h, 51);
    let (_, props, _, _) = get(&mut h, c, "dlq").expect("dead-lettered");
    assert_eq!(props.expiration, None, "expiration removed");
    assert_eq!(
        death(&props).get("original-expiration"),
        Some(&FieldValue::string("50"))
    );
}

#[test]
fn a_ttl_of_zero_still_reaches_a_ready_consumer() {
    let mut h = Harness::new();
    let c = h.connect(1);
    declare(
        &mut h,
        c,
        "q",
        args(&[("x-message-ttl", FieldValue::I32(0))]),
    );
    h.consume(c, "q", "ct", true);
    let fx = publish_with(&mut h, c, "q", "now", Properties::default());
    assert_eq!(deliveries(&fx).len(), 1);
    // Without a consumer it expires right away.
    h.op(
        c,
        Op::Cancel {
            consumer_tag: "ct".into(),
            nowait: false,
        },
    );
    publish_with(&mut h, c, "q", "later", Properties::default());
    after(&mut h, 1);
    assert_eq!(h.shards[0].queue_len("q"), Some(0));
}

#[test]
fn rejected_messages_dead_letter_and_counts_accumulate() {
    let mut h = Harness::new();
    let c = h.connect(1);
    with_dlx(&mut h, c, &[]);
    // dlq dead-letters back to q's exchange path? No: republish by hand twice.
    for round in 1..=2 {
        h.consume(c, "q", &format!("c{round}"), false);
        let body = if round == 1 {
            "m".to_string()
        } else {
            String::new()
        };
        let fx = if round == 1 {
            publish_with(&mut h, c, "q", &body, Properties::default())
        } else {
            // Move the dead-lettered message back into q, keeping its headers.
            let (_, props, _, _) = get(&mut h, c, "dlq").expect("in dlq");
            publish_with(&mut h, c, "q", "m", props)
        };
        let tag = deliveries(&fx)[0].1;
        h.op(
            c,
            Op::Reject {
                delivery_tag: tag,
                requeue: false,
            },
        );
        h.op(
            c,
            Op::Cancel {
                consumer_tag: format!("c{round}"),
                nowait: false,
            },
        );
    }
    let (_, props, _, _) = get(&mut h, c, "dlq").expect("dead-lettered twice");
    let d = death(&props);
    assert_eq!(d.get("reason"), Some(&FieldValue::string("rejected")));
    assert_eq!(d.get("count"), Some(&FieldValue::I64(2)), "{d:?}");
    match props.headers.as_ref().and_then(|h| h.get("x-death")) {
        Some(FieldValue::Array(items)) => {
            assert_eq!(items.len(), 1, "one entry per (queue, reason)")
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn max_length_drop_head_dead_letters_the_oldest() {
    let mut h = Harness::new();
    let c = h.connect(1);
    with_dlx(&mut h, c, &[("x-max-length", FieldValue::I32(2))]);
    for m in ["a", "b", "c"] {
        publish_with(&mut h, c, "q", m, Properties::default());
    }
    assert_eq!(h.shards[0].queue_len("q"), Some(2));
    let (body, props, _, _) = get(&mut h, c, "dlq").expect("dropped head");
    assert_eq!(body, "a");
    assert_eq!(
        death(&props).get("reason"),
        Some(&FieldValue::string("maxlen"))
    );
    assert_eq!(get(&mut h, c, "q").map(|m| m.0).as_deref(), Some("b"));
}

#[test]
fn reject_publish_nacks_and_keeps_the_queue() {
    let mut h = Harness::new();
    let c = h.connect(1);
    h.op(c, Op::ConfirmSelect { nowait: false });
    with_dlx(
        &mut h,
        c,
        &[
            ("x-max-length-bytes", FieldValue::I32(3)),
            ("x-overflow", FieldValue::string("reject-publish-dlx")),
        ],
    );
    let fx = publish_with(&mut h, c, "q", "abc", Properties::default());
    assert!(
        fx.iter()
            .any(|e| matches!(e, Effect::Confirm { ack: true, .. }))
    );
    let fx = publish_with(&mut h, c, "q", "d", Properties::default());
    assert!(
        fx.iter()
            .any(|e| matches!(e, Effect::Confirm { ack: false, .. })),
        "over the byte limit: nacked: {fx:?}"
    );
    assert_eq!(h.shards[0].queue_len("q"), Some(1));
    let (body, props, _, _) = get(&mut h, c, "dlq").expect("refused message dead-lettered");
    assert_eq!(body, "d");
    assert_eq!(
        death(&props).get("reason"),
        Some(&FieldValue::string("maxlen"))
    );
}

#[test]
fn an_expiry_cycle_without_rejection_is_dropped() {
    let mut h = Harness::new();
    let c = h.connect(1);
    // q dead-letters to itself through the default exchange.
    declare(
        &mut h,
        c,
        "q",
        args(&[
            ("x-message-ttl", FieldValue::I32(10)),
            ("x-dead-letter-exchange", FieldValue::string("")),
        ]),
    );
    publish_with(&mut h, c, "q", "loop", Properties::default());
    after(&mut h, 11);
    after(&mut h, 11);
    assert_eq!(h.shards[0].queue_len("q"), Some(0), "dropped, not looping");
    assert_eq!(h.shards[0].next_deadline(), None);
}

#[test]
fn unused_queues_expire() {
    let mut h = Harness::new();
    let c = h.connect(1);
    declare(&mut h, c, "q", args(&[("x-expires", FieldValue::I32(100))]));
    let start = h.now;
    h.consume(c, "q", "ct", false);
    tick(&mut h, start + 1000);
    assert_eq!(
        h.shards[0].queue_len("q"),
        Some(0),
        "in use while it has a consumer"
    );
    h.op(
        c,
        Op::Cancel {
            consumer_tag: "ct".into(),
            nowait: false,
        },
    );
    let left = h.now;
    tick(&mut h, left + 100);
    assert!(h.shards[0].queue_len("q").is_some());
    tick(&mut h, left + 101);
    assert_eq!(
        h.shards[0].queue_len("q"),
        None,
        "deleted after 100 ms unused"
    );
}

#[test]
fn single_active_consumer_gets_everything_until_it_leaves() {
    let mut h = Harness::new();
    let c = h.connect(1);
    declare(
        &mut h,
        c,
        "q",
        args(&[("x-single-active-consumer", FieldValue::Bool(true))]),
    );
    h.consume(c, "q", "first", true);
    h.consume(c, "q", "second", true);
    let mut tags = Vec::new();
    for i in 0..4 {
        let fx = publish_with(&mut h, c, "q", &i.to_string(), Properties::default());
        tags.extend(deliveries(&fx).into_iter().map(|d| d.0));
    }
    assert_eq!(tags, vec!["first"; 4]);
    h.op(
        c,
        Op::Cancel {
            consumer_tag: "first".into(),
            nowait: false,
        },
    );
    let fx = publish_with(&mut h, c, "q", "x", Properties::default());
    assert_eq!(deliveries(&fx)[0].0, "second");
}

#[test]
fn higher_priority_consumers_go_first_while_they_have_credit() {
    let mut h = Harness::new();
    let c = h.connect(1);
    h.declare(c, "q");
    h.op(
        c,
        Op::Qos {
            prefetch_size: 0,
            prefetch_count: 1,
            global: false,
        },
    );
    for (tag, priority) in [("low", 0), ("high", 10)] {
        h.op(
            c,
            Op::Consume(Consume {
                queue: "q".into(),
                consumer_tag: tag.into(),
                no_local: false,
                no_ack: false,
                exclusive: false,
                nowait: false,
                arguments: args(&[("x-priority", FieldValue::I32(priority))]),
            }),
        );
    }
    let first = publish_with(&mut h, c, "q", "1", Properties::default());
    assert_eq!(deliveries(&first)[0].0, "high");
    let second = publish_with(&mut h, c, "q", "2", Properties::default());
    assert_eq!(deliveries(&second)[0].0, "low", "high is at its prefetch");
}

#[test]
fn invalid_arguments_are_refused_with_rabbitmq_texts() {
    let mut h = Harness::new();
    let c = h.connect(1);
    let fx = declare(
        &mut h,
        c,
        "q",
        args(&[("x-message-ttl", FieldValue::I32(-5))]),
    );
    match fx.as_slice() {
        [Effect::ChannelError { error, .. }] => {
            assert_eq!(error.code.code(), 406);
            assert_eq!(
                error.to_string(),
                "PRECONDITION_FAILED - invalid arg 'x-message-ttl' for queue 'q' in vhost '/': {value_negative,-5}"
            );
        }
        other => panic!("{other:?}"),
    }
    let c2 = h.open(1, 2);
    let fx = publish_with(
        &mut h,
        c2,
        "q",
        "m",
        Properties {
            expiration: Some("soon".into()),
            ..Default::default()
        },
    );
    assert!(
        matches!(fx.as_slice(), [Effect::ChannelError { error, .. }] if error.code.code() == 406),
        "{fx:?}"
    );
}

#[test]
fn priority_queues_deliver_highest_first_and_requeue_in_place() {
    let mut h = Harness::new();
    let c = h.connect(1);
    declare(
        &mut h,
        c,
        "pq",
        args(&[("x-max-priority", FieldValue::U8(5))]),
    );
    for (body, priority) in [
        ("low", 1),
        ("none", 0),
        ("high", 5),
        ("capped", 9),
        ("mid", 3),
    ] {
        let props = Properties {
            priority: (priority > 0).then_some(priority),
            ..Default::default()
        };
        publish_with(&mut h, c, "pq", body, props);
    }
    // 9 is capped at the maximum (5) and queues behind "high", which came first.
    let order: Vec<String> = std::iter::from_fn(|| get(&mut h, c, "pq").map(|m| m.0)).collect();
    assert_eq!(order, ["high", "capped", "mid", "low", "none"]);
    let fx = declare(
        &mut h,
        c,
        "bad",
        args(&[("x-max-priority", FieldValue::I32(300))]),
    );
    assert!(
        matches!(fx.as_slice(), [Effect::ChannelError { error, .. }] if error.to_string().contains("{value_out_of_range,300}")),
        "{fx:?}"
    );
}

#[test]
fn a_restored_priority_queue_keeps_its_order() {
    use warren_core::store::MemoryStore;
    let store = MemoryStore::new();
    let config = warren_core::BrokerConfig {
        queue_window: 2,
        ..Default::default()
    };
    let mut h = Harness {
        shards: warren_core::shards::Shards::new(vec![warren_core::Broker::with_store(
            config.clone(),
            Box::new(store.clone()),
        )]),
        now: 0,
    };
    let c = h.connect(1);
    h.op(
        c,
        Op::QueueDeclare(QueueDeclare {
            queue: "pq".into(),
            passive: false,
            durable: true,
            exclusive: false,
            auto_delete: false,
            nowait: false,
            arguments: args(&[("x-max-priority", FieldValue::U8(3))]),
        }),
    );
    for (body, priority) in [("a", 0), ("b", 2), ("c", 1), ("d", 2), ("e", 0)] {
        let props = Properties {
            priority: Some(priority),
            delivery_mode: Some(2),
            ..Default::default()
        };
        publish_with(&mut h, c, "pq", body, props);
    }
    let epoch = h.shards[0].start_sync().expect("a sync");
    assert_eq!(store.complete_sync(), Some(epoch));
    store.crash();
    let mut h = Harness {
        shards: warren_core::shards::Shards::new(vec![warren_core::Broker::with_store(
            config,
            Box::new(store.clone()),
        )]),
        now: 100,
    };
    assert!(h.shards[0].restore(100, &store.definitions()).is_empty());
    let c = h.connect(1);
    let order: Vec<String> = std::iter::from_fn(|| get(&mut h, c, "pq").map(|m| m.0)).collect();
    assert_eq!(order, ["b", "d", "c", "a", "e"]);
}

#[test]
fn direct_reply_to_delivers_replies_without_a_queue() {
    let mut h = Harness::new();
    let client = h.connect(1);
    let server = h.connect(2);
    h.declare(server, "rpc");
    // Without a reply consumer, asking for direct reply-to is refused.
    let refused = publish_with(
        &mut h,
        client,
        "rpc",
        "req",
        Properties {
            reply_to: Some("amq.rabbitmq.reply-to".into()),
            ..Default::default()
        },
    );
    assert!(
        matches!(refused.as_slice(), [Effect::ChannelError { error, .. }] if error.to_string().contains("fast reply consumer does not exist")),
        "{refused:?}"
    );
    let client = h.open(1, 2);
    let fx = h.consume(client, "amq.rabbitmq.reply-to", "replies", true);
    assert!(
        matches!(
            fx.as_slice(),
            [Effect::Reply {
                reply: Reply::ConsumeOk { .. },
                ..
            }]
        ),
        "{fx:?}"
    );
    publish_with(
        &mut h,
        client,
        "rpc",
        "req",
        Properties {
            reply_to: Some("amq.rabbitmq.reply-to".into()),
            ..Default::default()
        },
    );
    let (_, props, _, _) = get(&mut h, server, "rpc").expect("request");
    let address = props.reply_to.expect("rewritten reply-to");
    assert!(address.starts_with("amq.rabbitmq.reply-to."), "{address}");
    let fx = publish_with(&mut h, server, &address, "resp", Properties::default());
    let got = deliveries(&fx);
    assert_eq!(got.len(), 1, "{fx:?}");
    assert_eq!((got[0].0.as_str(), got[0].3.as_str()), ("replies", "resp"));
    // Once the client's channel is gone, replies to it are dropped.
    h.op(client, Op::ChannelClose);
    let fx = publish_with(&mut h, server, &address, "late", Properties::default());
    assert!(deliveries(&fx).is_empty());
}

fn policy(
    name: &str,
    pattern: &str,
    pairs: &[(&str, FieldValue)],
) -> warren_core::policy::PolicyDef {
    warren_core::policy::PolicyDef {
        vhost: "/".into(),
        name: name.into(),
        pattern: pattern.into(),
        apply_to: warren_core::policy::ApplyTo::Queues,
        priority: 0,
        definition: args(pairs),
    }
}

#[test]
fn policies_apply_to_existing_queues_at_once_and_arguments_win() {
    let mut h = Harness::new();
    let c = h.connect(1);
    h.declare(c, "orders.a");
    declare(
        &mut h,
        c,
        "orders.b",
        args(&[("x-max-length", FieldValue::I32(5))]),
    );
    h.declare(c, "other");
    for q in ["orders.a", "orders.b", "other"] {
        for i in 0..4 {
            publish_with(&mut h, c, q, &i.to_string(), Properties::default());
        }
    }
    h.shards[0]
        .set_policy(
            h.now,
            policy("cap", "^orders\\.", &[("max-length", FieldValue::I64(2))]),
        )
        .expect("valid policy");
    assert_eq!(
        h.shards[0].queue_len("orders.a"),
        Some(2),
        "applied without a redeclare"
    );
    assert_eq!(
        h.shards[0].queue_len("orders.b"),
        Some(4),
        "its own x-max-length (5) wins"
    );
    assert_eq!(
        h.shards[0].queue_len("other"),
        Some(4),
        "pattern does not match"
    );
    assert_eq!(
        h.shards[0].queue_policy("/", "orders.a").as_deref(),
        Some("cap")
    );
    h.shards[0].clear_policy(h.now, "/", "cap").expect("exists");
    for i in 0..3 {
        publish_with(&mut h, c, "orders.a", &i.to_string(), Properties::default());
    }
    assert_eq!(
        h.shards[0].queue_len("orders.a"),
        Some(5),
        "no limit once cleared"
    );
    assert!(h.shards[0].clear_policy(h.now, "/", "cap").is_err());
    let err = h.shards[0]
        .set_policy(
            h.now,
            policy("bad", ".*", &[("max-length", FieldValue::I64(-3))]),
        )
        .expect_err("refused");
    assert_eq!(
        err,
        warren_core::admin::AdminError::Invalid(
            "invalid value for policy key 'max-length': {value_negative,-3}".into()
        )
    );
    h.shards[0].check_invariants().expect("invariants");
}

#[test]
fn a_ttl_policy_dead_letters_and_policies_survive_a_restart() {
    use warren_core::store::MemoryStore;
    let store = MemoryStore::new();
    let mut h = Harness {
        shards: warren_core::shards::Shards::new(vec![warren_core::Broker::with_store(
            Default::default(),
            Box::new(store.clone()),
        )]),
        now: 0,
    };
    let c = h.connect(1);
    h.exchange(c, "dlx", "fanout", FieldTable::new());
    h.declare(c, "dlq");
    h.bind(c, "dlq", "dlx", "");
    h.shards[0]
        .set_policy(
            h.now,
            policy(
                "ttl",
                "^work$",
                &[
                    ("message-ttl", FieldValue::I64(10)),
                    ("dead-letter-exchange", FieldValue::string("dlx")),
                ],
            ),
        )
        .expect("valid");
    h.declare(c, "work");
    publish_with(&mut h, c, "work", "job", Properties::default());
    after(&mut h, 11);
    assert_eq!(
        h.shards[0].queue_len("dlq"),
        Some(1),
        "expired through the policy's DLX"
    );
    let defs = store.definitions();
    assert_eq!(defs.policies.len(), 1, "stored");
    let mut restarted =
        warren_core::Broker::with_store(Default::default(), Box::new(store.clone()));
    assert!(restarted.restore(100, &defs).is_empty());
    assert_eq!(restarted.list_policies().len(), 1);
}

/// A durable queue `name` (server-named when empty) on `h`; returns its name.
fn declare_durable(h: &mut Harness, c: ChannelRef, name: &str) -> String {
    let fx = h.op(
        c,
        Op::QueueDeclare(QueueDeclare {
            queue: name.into(),
            passive: false,
            durable: true,
            exclusive: false,
            auto_delete: false,
            nowait: false,
            arguments: FieldTable::default(),
        }),
    );
    fx.into_iter()
        .find_map(|e| match e {
            Effect::Reply {
                reply: Reply::QueueDeclareOk { queue, .. },
                ..
            } => Some(queue.to_string()),
            _ => None,
        })
        .expect("declare-ok")
}

fn persistent() -> Properties {
    Properties {
        delivery_mode: Some(2),
        ..Default::default()
    }
}

/// A broker on `store` after a crash of the previous one, restored at `now`.
fn restarted(store: &warren_core::store::MemoryStore, now: u64) -> Harness {
    store.crash();
    let mut h = Harness {
        shards: warren_core::shards::Shards::new(vec![warren_core::Broker::with_store(
            Default::default(),
            Box::new(store.clone()),
        )]),
        now,
    };
    let errors = h.shards[0].restore(now, &store.definitions());
    assert!(errors.is_empty(), "restore: {errors:?}");
    h
}

#[test]
fn acks_are_synced_within_the_removal_bound_without_a_publish() {
    use warren_core::store::MemoryStore;
    let store = MemoryStore::new();
    let bound = warren_core::BrokerConfig::default().removal_sync_ms;
    let mut h = Harness {
        shards: warren_core::shards::Shards::new(vec![warren_core::Broker::with_store(
            Default::default(),
            Box::new(store.clone()),
        )]),
        now: 0,
    };
    let c = h.connect(1);
    declare_durable(&mut h, c, "q");
    for body in ["a", "b", "c"] {
        publish_with(&mut h, c, "q", body, persistent());
    }
    let epoch = h.shards[0].start_sync().expect("a sync for the publishes");
    assert_eq!(store.complete_sync(), Some(epoch));
    h.shards[0].synced(h.now, epoch);
    let got: Vec<String> = std::iter::from_fn(|| get(&mut h, c, "q").map(|m| m.0)).collect();
    assert_eq!(got, ["a", "b", "c"]);
    let removed_at = h.now;
    // The gets confirm nothing, so they start no sync at once...
    assert_eq!(h.shards[0].start_sync(), None);
    // ...but one is due `removal_sync_ms` after the first of them.
    let due = h.shards[0]
        .next_deadline()
        .expect("a deadline for the removals");
    assert!(
        due <= removed_at + bound,
        "due at {due}, removals at {removed_at}"
    );
    tick(&mut h, due - 1);
    assert_eq!(h.shards[0].start_sync(), None, "not before the bound");
    tick(&mut h, due);
    let epoch = h.shards[0].start_sync().expect("a sync for the removals");
    assert_eq!(store.complete_sync(), Some(epoch));
    h.shards[0].synced(h.now, epoch);
    assert_eq!(h.shards[0].next_deadline(), None, "nothing left to sync");
    let mut h = restarted(&store, h.now + 1);
    let c = h.connect(1);
    assert_eq!(
        get(&mut h, c, "q").map(|m| m.0),
        None,
        "nothing acked comes back"
    );
}

#[test]
fn a_requested_sync_covers_removals_at_once() {
    use warren_core::store::MemoryStore;
    let store = MemoryStore::new();
    let mut h = Harness {
        shards: warren_core::shards::Shards::new(vec![warren_core::Broker::with_store(
            Default::default(),
            Box::new(store.clone()),
        )]),
        now: 0,
    };
    let c = h.connect(1);
    declare_durable(&mut h, c, "q");
    publish_with(&mut h, c, "q", "a", persistent());
    let epoch = h.shards[0].start_sync().expect("a sync");
    assert_eq!(store.complete_sync(), Some(epoch));
    h.shards[0].synced(h.now, epoch);
    assert!(get(&mut h, c, "q").is_some());
    assert!(!h.shards[0].all_synced(), "the removal is not synced yet");
    // A clean stop: the host asks for a sync and waits for it.
    h.shards[0].request_sync();
    let epoch = h.shards[0].start_sync().expect("the requested sync");
    assert!(!h.shards[0].all_synced());
    assert_eq!(store.complete_sync(), Some(epoch));
    h.shards[0].synced(h.now, epoch);
    assert!(h.shards[0].all_synced());
    let mut h = restarted(&store, h.now + 1);
    let c = h.connect(1);
    assert_eq!(get(&mut h, c, "q").map(|m| m.0), None);
}

#[test]
fn a_server_named_durable_queue_is_restored_with_its_messages() {
    use warren_core::store::MemoryStore;
    let store = MemoryStore::new();
    let mut h = Harness {
        shards: warren_core::shards::Shards::new(vec![warren_core::Broker::with_store(
            Default::default(),
            Box::new(store.clone()),
        )]),
        now: 0,
    };
    let c = h.connect(1);
    let name = declare_durable(&mut h, c, "");
    assert!(name.starts_with("amq.gen-"), "{name}");
    publish_with(&mut h, c, &name, "kept", persistent());
    let epoch = h.shards[0].start_sync().expect("a sync");
    assert_eq!(store.complete_sync(), Some(epoch));
    let mut h = restarted(&store, h.now + 1);
    let c = h.connect(1);
    assert_eq!(get(&mut h, c, &name).map(|m| m.0).as_deref(), Some("kept"));
    // Clients still may not take the prefix.
    let fx = h.op(
        c,
        Op::QueueDeclare(QueueDeclare {
            queue: "amq.gen-mine".into(),
            passive: false,
            durable: true,
            exclusive: false,
            auto_delete: false,
            nowait: false,
            arguments: FieldTable::default(),
        }),
    );
    assert_eq!(error_code(&fx), Some(403), "{fx:?}");
}

/// The `x-delivery-count` header of each delivery in `fx`, with its tag and redelivered flag.
fn counted(fx: &[Effect]) -> Vec<(u64, bool, Option<FieldValue>)> {
    fx.iter()
        .filter_map(|e| match e {
            Effect::Deliver { delivery, .. } => Some((
                delivery.delivery_tag,
                delivery.redelivered,
                delivery
                    .message
                    .properties
                    .headers
                    .as_ref()
                    .and_then(|h| h.get("x-delivery-count").cloned()),
            )),
            _ => None,
        })
        .collect()
}

#[test]
fn a_quorum_queue_counts_returns_and_dead_letters_past_its_delivery_limit() {
    let mut h = Harness::new();
    let c = h.connect(1);
    h.exchange(c, "dlx", "fanout", FieldTable::new());
    h.declare(c, "dlq");
    h.bind(c, "dlq", "dlx", "");
    let fx = h.op(
        c,
        Op::QueueDeclare(QueueDeclare {
            queue: "qq".into(),
            passive: false,
            durable: true,
            exclusive: false,
            auto_delete: false,
            nowait: false,
            arguments: args(&[
                ("x-queue-type", FieldValue::string("quorum")),
                ("x-delivery-limit", FieldValue::I32(1)),
                ("x-dead-letter-exchange", FieldValue::string("dlx")),
            ]),
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
    h.consume(c, "qq", "c", false);
    let mut fx = publish_with(&mut h, c, "qq", "poison", Properties::default());
    let mut seen = Vec::new();
    for _ in 0..3 {
        let Some((tag, redelivered, count)) = counted(&fx).pop() else {
            break;
        };
        seen.push((redelivered, count));
        fx = h.op(
            c,
            Op::Nack {
                delivery_tag: tag,
                multiple: false,
                requeue: true,
            },
        );
    }
    // Two deliveries; the second return took it past the limit of 1.
    assert_eq!(seen, [(false, None), (true, Some(FieldValue::I64(1)))]);
    let (body, props, _, _) = get(&mut h, c, "dlq").expect("dead-lettered");
    assert_eq!(body, "poison");
    let d = death(&props);
    assert_eq!(d.get("reason"), Some(&FieldValue::string("delivery_limit")));
    assert_eq!(d.get("queue"), Some(&FieldValue::string("qq")));
    let headers = props.headers.as_ref().expect("x-death");
    assert!(!headers.contains_key("x-delivery-count"), "{headers:?}");
    assert_eq!(get(&mut h, c, "qq"), None, "gone from the quorum queue");
}
