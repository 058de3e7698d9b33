//! MQTT topic rules against a naive reference, the MQTT <-> AMQP key mapping's round trip, and
//! agreement between MQTT filter matching and the core's AMQP topic exchange on translated
//! filters (what makes an MQTT subscription a plain binding on `amq.topic`).

use bytes::Bytes;
use proptest::prelude::*;
use std::sync::Arc;
use warren_core::Broker;
use warren_core::command::{Bind, Op, Publish, QueueDeclare};
use warren_core::ids::{ChannelRef, ConnId};
use warren_core::mqtt::{
    amqp_key_to_topic, filter_to_amqp_pattern, matches, topic_to_amqp_key, validate_filter,
    validate_topic,
};

/// MQTT 4.7 matching, written as directly as possible from the spec.
fn naive(filter: &[&str], topic: &[&str], first: bool) -> bool {
    match (filter.first(), topic.first()) {
        (Some(&"#"), Some(t)) if first && t.starts_with('$') => false,
        (Some(&"#"), _) => true,
        (Some(&"+"), Some(t)) if first && t.starts_with('$') => false,
        (Some(&"+"), Some(_)) => naive(&filter[1..], &topic[1..], false),
        (Some(f), Some(t)) if f == t => naive(&filter[1..], &topic[1..], false),
        (None, None) => true,
        _ => false,
    }
}

fn level() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("a".to_string()),
        Just("b".to_string()),
        Just("".to_string()),
        Just("$s".to_string()),
        Just("x.y".to_string()),
    ]
}

fn topic() -> impl Strategy<Value = String> {
    prop::collection::vec(level(), 1..5)
        .prop_map(|l| l.join("/"))
        .prop_filter("topics are not empty", |t| !t.is_empty())
}

fn filter() -> impl Strategy<Value = String> {
    let lvl = prop_oneof![level(), Just("+".to_string())];
    (prop::collection::vec(lvl, 1..5), any::<bool>())
        .prop_map(|(mut l, hash)| {
            if hash {
                l.push("#".into());
            }
            l.join("/")
        })
        .prop_filter("filters are not empty", |f| !f.is_empty())
}

fn routes(filter: &str, topic: &str) -> bool {
    let mut b = Broker::new(Default::default());
    let ch = ChannelRef::new(ConnId(1), 1);
    b.handle(
        0,
        ChannelRef::new(ConnId(1), 0),
        Op::ConnectionOpen {
            vhost: "/".into(),
            user: "guest".into(),
            cancel_notify: false,
        },
    );
    b.handle(0, ch, Op::ChannelOpen);
    b.handle(
        0,
        ch,
        Op::QueueDeclare(QueueDeclare {
            queue: "q".into(),
            passive: false,
            durable: false,
            exclusive: false,
            auto_delete: false,
            nowait: true,
            arguments: Default::default(),
        }),
    );
    b.handle(
        0,
        ch,
        Op::QueueBind(Bind {
            destination: "q".into(),
            source: "amq.topic".into(),
            routing_key: filter_to_amqp_pattern(filter),
            nowait: true,
            arguments: Default::default(),
        }),
    );
    b.handle(
        0,
        ch,
        Op::Publish(Box::new(Publish {
            exchange: Arc::from("amq.topic"),
            routing_key: Arc::from(topic_to_amqp_key(topic)),
            mandatory: false,
            immediate: false,
            properties: Default::default(),
            body: Bytes::from_static(b"m"),
            routed: None,
        })),
    );
    b.queue_len("q") == Some(1)
}

proptest! {
    #[test]
    fn matching_agrees_with_reference(f in filter(), t in topic()) {
        prop_assert!(validate_filter(&f).is_ok());
        prop_assert!(validate_topic(&t).is_ok());
        let fl: Vec<&str> = f.split('/').collect();
        let tl: Vec<&str> = t.split('/').collect();
        prop_assert_eq!(matches(&f, &t), naive(&fl, &tl, true), "{} vs {}", f, t);
    }

    #[test]
    fn key_mapping_round_trips(t in topic()) {
        prop_assert_eq!(amqp_key_to_topic(&topic_to_amqp_key(&t)), t);
    }

    #[test]
    fn amqp_topic_exchange_agrees_on_translated_filters(f in filter(), t in topic()) {
        // `$` topics are the one difference: the AMQP exchange has no such rule, so the MQTT
        // gateway re-checks every delivery with `matches`.
        prop_assume!(!t.starts_with('$'));
        prop_assert_eq!(routes(&f, &t), matches(&f, &t), "{} vs {}", f, t);
    }
}
