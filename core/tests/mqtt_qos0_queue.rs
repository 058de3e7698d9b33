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

/// What a fan-in publisher knows of itself: what the broker told it, and how many
/// publishes it still makes after a pause (they were on their way).
#[derive(Default)]
struct FanIn {
    paused: Vec<bool>,
    lag: Vec<u32>,
    resumed: Vec<u32>,
    /// Publisher indexes, in the order they were paused and resumed.
    pause_order: Vec<usize>,
    resume_order: Vec<usize>,
    delivered: u64,
}

impl FanIn {
    /// Publishes a publisher still makes after its pause.
    const LAG: u32 = 2;
    /// Connection ids of the publishers start here.
    const FIRST: u64 = 100;

    fn new(n: usize) -> FanIn {
        FanIn {
            paused: vec![false; n],
            lag: vec![0; n],
            resumed: vec![0; n],
            ..FanIn::default()
        }
    }

    fn see(&mut self, fx: &[Effect]) {
        for e in fx {
            match e {
                Effect::FlowPaused { conn } => {
                    let i = (conn.0 - Self::FIRST) as usize;
                    self.paused[i] = true;
                    self.lag[i] = Self::LAG;
                    self.pause_order.push(i);
                }
                Effect::FlowResumed { conn } => {
                    let i = (conn.0 - Self::FIRST) as usize;
                    self.paused[i] = false;
                    self.resumed[i] += 1;
                    self.resume_order.push(i);
                }
                _ => {}
            }
        }
        self.delivered += bodies(fx).len() as u64;
    }

    /// Whether publisher `i` publishes now (unpaused, or with publishes on their way).
    fn publishes(&mut self, i: usize) -> bool {
        if !self.paused[i] {
            return true;
        }
        if self.lag[i] == 0 {
            return false;
        }
        self.lag[i] -= 1;
        true
    }
}

/// Fan-in: many publishers, each still sending a few messages after its queue paused it
/// (what a real one has read and routed before the pause reaches it), into one subscriber
/// that takes a message a round. Resuming every paused publisher at once as the backlog
/// drained overshot the bounded backlog and dropped what had been read and routed (506
/// messages here); resumed a wave at a time, in pause order, nothing is dropped, every
/// publisher gets its turns (also once the ones resumed keep the queue just fed), and
/// every message published is delivered.
#[test]
fn paused_publishers_resume_a_wave_at_a_time_so_fan_in_drops_nothing() {
    const PUBLISHERS: u64 = 12;
    let mut h = Harness::with_config(BrokerConfig {
        write_window: 1,
        // Paused past 16 waiting, resumed from 8, dropped from 32.
        flow_ready_high: 16,
        ..BrokerConfig::default()
    });
    let sub = h.connect(1);
    declare(&mut h, sub, "q0", false);
    h.bind(sub, "q0", "amq.topic", "k");
    h.consume(sub, "q0", "t", true);
    let pubs: Vec<_> = (0..PUBLISHERS)
        .map(|i| h.connect(FanIn::FIRST + i))
        .collect();
    let mut f = FanIn::new(pubs.len());
    let mut sent = 0u64;
    for round in 0..1000 {
        for (i, &p) in pubs.iter().enumerate() {
            // They join one at a time (all at once, each with a lag's worth on its way
            // before its first pause, they overflow any bound).
            if round < 20 * i || !f.publishes(i) {
                continue;
            }
            let fx = h.publish(p, "amq.topic", "k", &format!("{i}-{round}"));
            sent += 1;
            f.see(&fx);
        }
        let fx = h.op(sub, Op::Written { count: 1 });
        f.see(&fx);
    }
    assert_eq!(
        h.sum(|b| b.qos0_dropped()),
        0,
        "resumed {:?}",
        f.resume_order
    );
    // The publishers take turns: each, the last to join too, was resumed many times.
    assert!(
        f.resumed.iter().all(|&n| n >= 10),
        "resumed {:?}",
        f.resumed
    );
    // The first wave is the four paused first, in pause order.
    assert_eq!(f.resume_order[..4], f.pause_order[..4]);
    // Nothing lost: what waits is delivered once the publishers stop.
    for _ in 0..64 {
        let fx = h.op(sub, Op::Written { count: 1 });
        f.see(&fx);
    }
    assert_eq!(message_count(&mut h, sub, "q0"), 0);
    assert_eq!(f.delivered, sent);
}

fn paused_conns(fx: &[Effect]) -> Vec<u64> {
    fx.iter()
        .filter_map(|e| match e {
            Effect::FlowPaused { conn } => Some(conn.0),
            _ => None,
        })
        .collect()
}

fn resumed_conns(fx: &[Effect]) -> Vec<u64> {
    fx.iter()
        .filter_map(|e| match e {
            Effect::FlowResumed { conn } => Some(conn.0),
            _ => None,
        })
        .collect()
}

/// A publisher whose message lands past the bound is paused too (before, only a kept
/// message paced its publisher: one that only ever landed past the bound went on sending
/// what was dropped). A queue that runs empty with publishers still paused resumes them a
/// wave at a time, on each dispatch and else each millisecond (`tick`), never all at once.
#[test]
fn dropping_publishers_are_paused_and_an_empty_queue_resumes_a_wave_per_millisecond() {
    let mut h = Harness::with_config(BrokerConfig {
        write_window: 1,
        // Paused past 2 waiting; at most 4 wait.
        flow_ready_high: 2,
        ..BrokerConfig::default()
    });
    let sub = h.connect(1);
    declare(&mut h, sub, "q0", false);
    h.bind(sub, "q0", "amq.topic", "k");
    h.consume(sub, "q0", "t", true);
    // One publisher fills the window and the backlog (paused at its fourth).
    let first = h.connect(10);
    for i in 0..5 {
        h.publish(first, "amq.topic", "k", &format!("f{i}"));
    }
    assert_eq!(message_count(&mut h, sub, "q0"), 4);
    // Nine more land only past the bound: each dropped message pauses its publisher.
    let mut paused = Vec::new();
    for c in 11..20 {
        let p = h.connect(c);
        let fx = h.publish(p, "amq.topic", "k", "x");
        paused.extend(paused_conns(&fx));
    }
    assert_eq!(paused, (11..20).collect::<Vec<_>>());
    assert_eq!(h.sum(|b| b.qos0_dropped()), 9);
    // Draining to half the mark resumes the four paused first, in pause order.
    let mut resumed = Vec::new();
    for _ in 0..3 {
        let fx = h.op(sub, Op::Written { count: 1 });
        resumed.extend(resumed_conns(&fx));
    }
    assert_eq!(resumed, [10, 11, 12, 13]);
    // Empty now: the dispatch that emptied it resumes the next four.
    let fx = h.op(sub, Op::Written { count: 1 });
    assert_eq!(message_count(&mut h, sub, "q0"), 0);
    assert_eq!(resumed_conns(&fx), [14, 15, 16, 17]);
    // Nobody publishes: the rest a millisecond later.
    assert!(h.all()[0].next_deadline().is_some());
    let fx = h.tick(1);
    assert_eq!(resumed_conns(&fx), [18, 19]);
    assert_eq!(h.all()[0].next_deadline(), None);
}
