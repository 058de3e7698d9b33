//! The `mqtt-qos0` queue type: while nothing waits in it, a routed message goes at once to a
//! consumer whose connection has write-window credit; otherwise it waits, up to twice the
//! flow-control mark, and beyond is dropped and counted. It takes only transient declares
//! and no-ack consumers.

mod common;

use common::*;
use warren_core::BrokerConfig;
use warren_core::command::{Consume, Op, QueueDeclare};
use warren_core::effect::{Effect, Reply};
use warren_core::ids::ChannelRef;
use warren_core::message::{FieldTable, FieldValue};

fn qos0_args() -> FieldTable {
    let mut t = FieldTable::new();
    t.insert("x-queue-type".into(), FieldValue::string("mqtt-qos0"));
    t
}

fn declare(h: &mut Harness, c: ChannelRef, name: &str, durable: bool) -> Vec<Effect> {
    h.op(
        c,
        Op::QueueDeclare(QueueDeclare {
            queue: name.into(),
            passive: false,
            durable,
            exclusive: true,
            auto_delete: false,
            nowait: false,
            arguments: qos0_args(),
        }),
    )
}

fn message_count(h: &mut Harness, c: ChannelRef, name: &str) -> u32 {
    let fx = h.passive_declare(c, name);
    match fx.as_slice() {
        [
            Effect::Reply {
                reply: Reply::QueueDeclareOk { message_count, .. },
                ..
            },
        ] => *message_count,
        other => panic!("passive declare: {other:?}"),
    }
}

fn confirms(fx: &[Effect]) -> Vec<(u64, bool, bool)> {
    fx.iter()
        .filter_map(|e| match e {
            Effect::Confirm {
                seq, multiple, ack, ..
            } => Some((*seq, *multiple, *ack)),
            _ => None,
        })
        .collect()
}

#[test]
fn delivers_at_once_within_the_write_window_then_holds_a_bounded_backlog_and_drops_beyond() {
    let mut h = Harness::with_config(BrokerConfig {
        write_window: 3,
        // Publishers paused past 2 waiting messages; at most 4 wait, the rest is dropped.
        flow_ready_high: 2,
        ..BrokerConfig::default()
    });
    let sub = h.connect(1);
    assert!(error_code(&declare(&mut h, sub, "q0", false)).is_none());
    h.bind(sub, "q0", "amq.topic", "a.#");
    let fx = h.consume(sub, "q0", "t", true);
    assert!(matches!(
        fx.as_slice(),
        [Effect::Reply {
            reply: Reply::ConsumeOk { .. },
            ..
        }]
    ));
    let publisher = h.connect(2);
    h.op(publisher, Op::ConfirmSelect { nowait: true });
    let mut got = Vec::new();
    let mut acked = Vec::new();
    let mut paused = Vec::new();
    for i in 0..10 {
        let fx = h.publish(publisher, "amq.topic", "a.b", &format!("m{i}"));
        got.extend(bodies(&fx));
        acked.extend(confirms(&fx));
        if fx.iter().any(|e| matches!(e, Effect::FlowPaused { .. })) {
            paused.push(i);
        }
    }
    // Three went at once (the window); four wait; three were dropped.
    assert_eq!(got, ["m0", "m1", "m2"]);
    assert_eq!(message_count(&mut h, sub, "q0"), 4);
    assert_eq!(h.sum(|b| b.qos0_dropped()), 3);
    // Paused once past the mark (3 waiting), as a classic queue's publishers are.
    assert_eq!(paused, [5]);
    // Every publish is taken (a confirm says the broker has it, as MQTT's PUBACK).
    assert_eq!(acked.len(), 10);
    assert!(acked.iter().all(|&(_, _, ack)| ack));
    // Written deliveries give their credit back: the backlog goes out in order, and the
    // publisher resumes once it is down to half the mark.
    let fx = h.op(sub, Op::Written { count: 3 });
    assert_eq!(bodies(&fx), ["m3", "m4", "m5"]);
    assert!(
        fx.iter()
            .any(|e| matches!(e, Effect::FlowResumed { conn } if *conn == publisher.conn)),
        "{fx:?}"
    );
    let fx = h.op(sub, Op::Written { count: 3 });
    assert_eq!(bodies(&fx), ["m6"]);
    assert_eq!(message_count(&mut h, sub, "q0"), 0);
    // Nothing waits: straight to the consumer again.
    let fx = h.publish(publisher, "amq.topic", "a.b", "m10");
    assert_eq!(bodies(&fx), ["m10"]);
    assert_eq!(h.sum(|b| b.qos0_dropped()), 3);
}

#[test]
fn consumers_share_it_round_robin_under_their_connection_window() {
    let mut h = Harness::with_config(BrokerConfig {
        write_window: 1,
        ..BrokerConfig::default()
    });
    let c = h.connect(1);
    declare(&mut h, c, "q0", false);
    h.bind(c, "q0", "amq.topic", "k");
    let c2 = h.open(1, 2);
    h.consume(c, "q0", "one", true);
    h.consume(c2, "q0", "two", true);
    let publisher = h.connect(2);
    let fx = h.publish(publisher, "amq.topic", "k", "x");
    assert_eq!(deliveries(&fx)[0].0, "one");
    // Both consumers share connection 1's window of one: the second message waits.
    let fx = h.publish(publisher, "amq.topic", "k", "y");
    assert!(deliveries(&fx).is_empty());
    assert_eq!(message_count(&mut h, c, "q0"), 1);
    // The window reopens: it goes to the next consumer in turn.
    let fx = h.op(c, Op::Written { count: 1 });
    assert_eq!(deliveries(&fx)[0].0, "two");
    assert_eq!(deliveries(&fx)[0].3, "y");
    assert_eq!(h.sum(|b| b.qos0_dropped()), 0);
}

#[test]
fn refuses_durable_declares_acked_consumers_and_holding_arguments() {
    let mut h = Harness::new();
    let c = h.connect(1);
    assert_eq!(error_code(&declare(&mut h, c, "d", true)), Some(406));
    let c = h.open(1, 2);
    declare(&mut h, c, "q0", false);
    let fx = h.op(
        c,
        Op::Consume(Consume {
            queue: "q0".into(),
            consumer_tag: "acked".into(),
            no_local: false,
            no_ack: false,
            exclusive: false,
            nowait: false,
            arguments: FieldTable::new(),
        }),
    );
    assert_eq!(error_code(&fx), Some(406));
    let c = h.open(1, 3);
    let mut args = qos0_args();
    args.insert("x-max-length".into(), FieldValue::I32(10));
    let fx = h.op(
        c,
        Op::QueueDeclare(QueueDeclare {
            queue: "limited".into(),
            passive: false,
            durable: false,
            exclusive: true,
            auto_delete: false,
            nowait: false,
            arguments: args,
        }),
    );
    assert_eq!(error_code(&fx), Some(406));
}
