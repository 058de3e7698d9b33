//! Deterministic simulation: random operation sequences from several connections, checking
//! after every step the core's internal invariants and, at the end, message conservation:
//! every published message is acked, dropped, purged or still in its queue, exactly once,
//! and only a message delivered before is ever flagged redelivered.

mod common;

use common::*;
use proptest::prelude::*;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use warren_core::command::{Op, Publish};
use warren_core::effect::{Effect, Reply};
use warren_core::ids::ChannelRef;
use warren_core::message::Properties;

const CONNS: u64 = 3;
const CHANNELS: u16 = 2;
const QUEUES: usize = 3;

#[derive(Clone, Debug)]
enum SimOp {
    Publish {
        ch: u8,
        queue: u8,
    },
    Consume {
        ch: u8,
        queue: u8,
        no_ack: bool,
    },
    Cancel {
        ch: u8,
        which: u8,
    },
    Get {
        ch: u8,
        queue: u8,
        no_ack: bool,
    },
    Ack {
        ch: u8,
        which: u8,
        multiple: bool,
    },
    Nack {
        ch: u8,
        which: u8,
        multiple: bool,
        requeue: bool,
    },
    BogusAck {
        ch: u8,
    },
    Recover {
        ch: u8,
    },
    Qos {
        ch: u8,
        count: u8,
        global: bool,
    },
    CloseChannel {
        ch: u8,
    },
    CloseConnection {
        conn: u8,
    },
    Purge {
        ch: u8,
        queue: u8,
    },
    Written {
        conn: u8,
    },
}

fn sim_op() -> impl Strategy<Value = SimOp> {
    let ch = 0u8..(CONNS as u8 * CHANNELS as u8);
    let q = 0u8..QUEUES as u8;
    prop_oneof![
        6 => (ch.clone(), q.clone()).prop_map(|(ch, queue)| SimOp::Publish { ch, queue }),
        2 => (ch.clone(), q.clone(), any::<bool>())
            .prop_map(|(ch, queue, no_ack)| SimOp::Consume { ch, queue, no_ack }),
        1 => (ch.clone(), any::<u8>()).prop_map(|(ch, which)| SimOp::Cancel { ch, which }),
        1 => (ch.clone(), q.clone(), any::<bool>())
            .prop_map(|(ch, queue, no_ack)| SimOp::Get { ch, queue, no_ack }),
        4 => (ch.clone(), any::<u8>(), any::<bool>())
            .prop_map(|(ch, which, multiple)| SimOp::Ack { ch, which, multiple }),
        2 => (ch.clone(), any::<u8>(), any::<bool>(), any::<bool>()).prop_map(
            |(ch, which, multiple, requeue)| SimOp::Nack { ch, which, multiple, requeue }
        ),
        1 => ch.clone().prop_map(|ch| SimOp::BogusAck { ch }),
        1 => ch.clone().prop_map(|ch| SimOp::Recover { ch }),
        1 => (ch.clone(), 0u8..4, any::<bool>())
            .prop_map(|(ch, count, global)| SimOp::Qos { ch, count, global }),
        1 => ch.clone().prop_map(|ch| SimOp::CloseChannel { ch }),
        1 => (0u8..CONNS as u8).prop_map(|conn| SimOp::CloseConnection { conn }),
        1 => (ch, q).prop_map(|(ch, queue)| SimOp::Purge { ch, queue }),
        3 => (0u8..CONNS as u8).prop_map(|conn| SimOp::Written { conn }),
    ]
}

/// What the simulated clients have seen.
#[derive(Default)]
struct Ledger {
    published: u64,
    /// Message ids settled for good (acked, delivered without ack, dropped by nack/reject).
    settled: Vec<u64>,
    purged: u64,
    /// Ids ever delivered (to catch a first delivery flagged redelivered).
    seen: BTreeSet<u64>,
    /// Per channel: outstanding delivery tag -> message id.
    outstanding: BTreeMap<ChannelRef, BTreeMap<u64, u64>>,
    consumers: BTreeMap<ChannelRef, Vec<String>>,
    open: BTreeSet<ChannelRef>,
    conns: BTreeSet<u64>,
    unwritten: HashMap<u64, u32>,
    next_tag: u64,
}

fn channel_of(i: u8) -> ChannelRef {
    ch(
        1 + u64::from(i) / u64::from(CHANNELS),
        1 + u16::from(i) % CHANNELS,
    )
}

struct Sim {
    h: Harness,
    l: Ledger,
    trace: Vec<String>,
    /// The mode of the basic.get in flight (get-ok does not say).
    get_no_ack: bool,
    /// Publishes arrive routed by the host on the broker's current table, as the native
    /// runtime sends them (`Publish::routed`).
    host_routes: bool,
}

impl Sim {
    fn new() -> Sim {
        let mut s = Sim {
            h: Harness::with_config(warren_core::BrokerConfig {
                flow_ready_high: 3,
                ..Default::default()
            }),
            l: Ledger::default(),
            trace: Vec::new(),
            get_no_ack: false,
            host_routes: false,
        };
        for conn in 1..=CONNS {
            s.connect(conn);
        }
        let c = ch(1, 1);
        for q in 0..QUEUES {
            s.h.declare(c, &format!("q{q}"));
        }
        s
    }

    fn connect(&mut self, conn: u64) {
        self.exec(
            ch(conn, 0),
            Op::ConnectionOpen {
                vhost: "/".into(),
                user: "guest".into(),
                cancel_notify: true,
            },
        );
        self.l.conns.insert(conn);
        for n in 1..=CHANNELS {
            self.exec(ch(conn, n), Op::ChannelOpen);
        }
    }

    /// Makes sure the channel is usable, reopening its connection or the channel itself.
    fn ensure(&mut self, c: ChannelRef) {
        if !self.l.conns.contains(&c.conn.0) {
            self.connect(c.conn.0);
        }
        if !self.l.open.contains(&c) {
            self.exec(c, Op::ChannelOpen);
        }
    }

    fn exec(&mut self, c: ChannelRef, op: Op) {
        let fx = self.h.op(c, op);
        for e in fx {
            self.trace.push(format!("{e:?}"));
            self.observe(e);
        }
    }

    fn observe(&mut self, e: Effect) {
        match e {
            Effect::Reply {
                ch,
                reply: Reply::ChannelOpenOk,
            } => {
                self.l.open.insert(ch);
            }
            Effect::Reply {
                ch,
                reply: Reply::ConsumeOk { consumer_tag },
            } => {
                self.l
                    .consumers
                    .entry(ch)
                    .or_default()
                    .push(consumer_tag.to_string());
            }
            Effect::Reply {
                reply: Reply::QueuePurgeOk { message_count },
                ..
            } => {
                self.l.purged += u64::from(message_count);
            }
            Effect::Reply {
                ch,
                reply: Reply::GetOk { delivery, .. },
            } => {
                self.delivered(
                    ch,
                    delivery.delivery_tag,
                    delivery.redelivered,
                    &delivery.message.body,
                    None,
                );
            }
            Effect::Deliver {
                ch,
                consumer_tag,
                delivery,
            } => {
                *self.l.unwritten.entry(ch.conn.0).or_default() += 1;
                let no_ack = consumer_tag.ends_with("-noack");
                self.delivered(
                    ch,
                    delivery.delivery_tag,
                    delivery.redelivered,
                    &delivery.message.body,
                    Some(no_ack),
                );
            }
            Effect::ChannelError { ch, .. } => {
                // The core requeued everything outstanding; the client forgets it.
                self.drop_channel(ch);
                self.h.op(ch, Op::ChannelCloseOk);
            }
            Effect::ConnectionError { conn, .. } => {
                panic!("unexpected connection error on {conn:?}")
            }
            _ => {}
        }
    }

    fn delivered(
        &mut self,
        c: ChannelRef,
        tag: u64,
        redelivered: bool,
        body: &[u8],
        no_ack: Option<bool>,
    ) {
        let id: u64 = std::str::from_utf8(body)
            .ok()
            .and_then(|s| s.parse().ok())
            .expect("body is an id");
        assert!(id < self.l.published, "invented message {id}");
        assert!(
            redelivered || self.l.seen.insert(id),
            "message {id} delivered twice without redelivered"
        );
        self.l.seen.insert(id);
        let is_no_ack = no_ack.unwrap_or(self.get_no_ack);
        if is_no_ack {
            self.l.settled.push(id);
        } else {
            self.l.outstanding.entry(c).or_default().insert(tag, id);
        }
    }

    fn drop_channel(&mut self, c: ChannelRef) {
        self.l.outstanding.remove(&c);
        self.l.consumers.remove(&c);
        self.l.open.remove(&c);
    }

    fn step(&mut self, op: SimOp) {
        match op {
            SimOp::Publish { ch: i, queue } => {
                let c = channel_of(i);
                self.ensure(c);
                let id = self.l.published;
                self.l.published += 1;
                let key = format!("q{queue}");
                let routed = self.host_routes.then(|| {
                    let table = self.h.broker.routes();
                    let vhost = table.vhost("/").expect("vhost /");
                    table.route_publish(vhost, "", &key, None)
                });
                self.exec(
                    c,
                    Op::Publish(Box::new(Publish {
                        exchange: "".into(),
                        routing_key: key.into(),
                        mandatory: false,
                        immediate: false,
                        properties: Properties::default(),
                        body: id.to_string().into(),
                        routed: routed.flatten(),
                    })),
                );
            }
            SimOp::Consume {
                ch: i,
                queue,
                no_ack,
            } => {
                let c = channel_of(i);
                self.ensure(c);
                self.l.next_tag += 1;
                let tag = format!("c{}{}", self.l.next_tag, if no_ack { "-noack" } else { "" });
                self.h_consume(c, &format!("q{queue}"), &tag, no_ack);
            }
            SimOp::Cancel { ch: i, which } => {
                let c = channel_of(i);
                let Some(tags) = self.l.consumers.get_mut(&c) else {
                    return;
                };
                if tags.is_empty() {
                    return;
                }
                let tag = tags.remove(usize::from(which) % tags.len());
                self.exec(
                    c,
                    Op::Cancel {
                        consumer_tag: tag,
                        nowait: false,
                    },
                );
            }
            SimOp::Get {
                ch: i,
                queue,
                no_ack,
            } => {
                let c = channel_of(i);
                self.ensure(c);
                self.get_no_ack = no_ack;
                self.exec(
                    c,
                    Op::Get {
                        queue: format!("q{queue}"),
                        no_ack,
                    },
                );
            }
            SimOp::Ack {
                ch: i,
                which,
                multiple,
            } => self.settle(i, which, multiple, None),
            SimOp::Nack {
                ch: i,
                which,
                multiple,
                requeue,
            } => self.settle(i, which, multiple, Some(requeue)),
            SimOp::BogusAck { ch: i } => {
                let c = channel_of(i);
                self.ensure(c);
                self.exec(
                    c,
                    Op::Ack {
                        delivery_tag: u64::MAX,
                        multiple: false,
                    },
                );
            }
            SimOp::Recover { ch: i } => {
                let c = channel_of(i);
                self.ensure(c);
                self.l.outstanding.remove(&c);
                self.exec(c, Op::Recover { requeue: true });
            }
            SimOp::Qos {
                ch: i,
                count,
                global,
            } => {
                let c = channel_of(i);
                self.ensure(c);
                self.exec(
                    c,
                    Op::Qos {
                        prefetch_size: 0,
                        prefetch_count: u16::from(count),
                        global,
                    },
                );
            }
            SimOp::CloseChannel { ch: i } => {
                let c = channel_of(i);
                if self.l.open.contains(&c) {
                    self.drop_channel(c);
                    self.exec(c, Op::ChannelClose);
                }
            }
            SimOp::CloseConnection { conn } => {
                let conn = 1 + u64::from(conn);
                if self.l.conns.remove(&conn) {
                    for n in 1..=CHANNELS {
                        self.drop_channel(ch(conn, n));
                    }
                    self.l.unwritten.remove(&conn);
                    self.exec(ch(conn, 0), Op::ConnectionClose);
                }
            }
            SimOp::Purge { ch: i, queue } => {
                let c = channel_of(i);
                self.ensure(c);
                self.exec(
                    c,
                    Op::QueuePurge {
                        queue: format!("q{queue}"),
                        nowait: false,
                    },
                );
            }
            SimOp::Written { conn } => {
                let conn = 1 + u64::from(conn);
                if let Some(n) = self.l.unwritten.remove(&conn) {
                    self.exec(ch(conn, 0), Op::Written { count: n });
                }
            }
        }
    }

    fn h_consume(&mut self, c: ChannelRef, queue: &str, tag: &str, no_ack: bool) {
        let fx = self.h.consume(c, queue, tag, no_ack);
        for e in fx {
            self.trace.push(format!("{e:?}"));
            self.observe(e);
        }
    }

    fn settle(&mut self, i: u8, which: u8, multiple: bool, nack: Option<bool>) {
        let c = channel_of(i);
        let Some(out) = self.l.outstanding.get_mut(&c) else {
            return;
        };
        if out.is_empty() {
            return;
        }
        let tags: Vec<u64> = out.keys().copied().collect();
        let tag = tags[usize::from(which) % tags.len()];
        let taken: Vec<u64> = if multiple {
            let rest = out.split_off(&(tag + 1));
            std::mem::replace(out, rest).into_values().collect()
        } else {
            out.remove(&tag).into_iter().collect()
        };
        match nack {
            Some(true) => {} // back in the queue
            _ => self.l.settled.extend(taken),
        }
        let op = match nack {
            None => Op::Ack {
                delivery_tag: tag,
                multiple,
            },
            Some(requeue) => Op::Nack {
                delivery_tag: tag,
                multiple,
                requeue,
            },
        };
        self.exec(c, op);
    }

    /// Closes everything, drains every queue, and checks conservation.
    fn finish(mut self) -> Vec<String> {
        for conn in 1..=CONNS {
            if self.l.conns.remove(&conn) {
                self.exec(ch(conn, 0), Op::ConnectionClose);
            }
        }
        self.l.outstanding.clear();
        self.connect(9);
        self.get_no_ack = true;
        for q in 0..QUEUES {
            loop {
                let before = self.l.settled.len();
                self.exec(
                    ch(9, 1),
                    Op::Get {
                        queue: format!("q{q}"),
                        no_ack: true,
                    },
                );
                if self.l.settled.len() == before {
                    break;
                }
            }
        }
        let unique: BTreeSet<u64> = self.l.settled.iter().copied().collect();
        assert_eq!(
            unique.len(),
            self.l.settled.len(),
            "a message was settled twice"
        );
        assert_eq!(
            unique.len() as u64 + self.l.purged,
            self.l.published,
            "messages lost or invented (settled {}, purged {}, published {})",
            unique.len(),
            self.l.purged,
            self.l.published
        );
        self.trace
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn random_operations_conserve_messages(ops in prop::collection::vec(sim_op(), 1..300)) {
        let mut sim = Sim::new();
        for op in ops.iter().cloned() {
            sim.step(op);
        }
        sim.finish();
    }

    #[test]
    fn same_inputs_same_effects(ops in prop::collection::vec(sim_op(), 1..150)) {
        let run = |ops: &[SimOp]| {
            let mut sim = Sim::new();
            for op in ops.iter().cloned() {
                sim.step(op);
            }
            sim.finish()
        };
        prop_assert_eq!(run(&ops), run(&ops));
    }

    /// The two compositions agree: publishes routed by the host on the table give the same
    /// effects, in the same order, as publishes the broker routes itself.
    #[test]
    fn host_routing_gives_the_same_effects(ops in prop::collection::vec(sim_op(), 1..150)) {
        let run = |ops: &[SimOp], host_routes: bool| {
            let mut sim = Sim::new();
            sim.host_routes = host_routes;
            for op in ops.iter().cloned() {
                sim.step(op);
            }
            sim.finish()
        };
        prop_assert_eq!(run(&ops, true), run(&ops, false));
    }
}
