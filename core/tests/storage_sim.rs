//! Deterministic simulation of the core with a store: lazy queues with a tiny window (paging
//! in and out all the time), publisher confirms that wait for syncs, and crashes that lose
//! everything not synced. Checks, over random scenarios:
//! - a persistent message on a durable queue is confirmed only by `synced`, never earlier;
//! - nothing is invented, nothing is delivered twice without `redelivered`;
//! - messages never redelivered arrive in publish order per queue;
//! - after any number of crashes, every confirmed persistent message on a durable queue that
//!   was not acked is still delivered; without crashes every message is;
//! - a quorum queue (`qq`) keeps every confirmed message, transient ones too, and confirms
//!   each only by `synced`.

mod common;

use common::ch;
use proptest::prelude::*;
use std::collections::{BTreeMap, BTreeSet};
use warren_core::command::{Consume, Op, Publish, QueueDeclare};
use warren_core::effect::{Effect, Reply};
use warren_core::ids::ChannelRef;
use warren_core::message::{FieldTable, FieldValue, Properties};
use warren_core::store::MemoryStore;
use warren_core::{Broker, BrokerConfig};

/// Queues: d0, d1 durable; t0 transient; qq a quorum queue (durable).
const QUEUES: [(&str, bool); 4] = [("d0", true), ("d1", true), ("t0", false), ("qq", true)];

/// The quorum queue's index in `QUEUES`.
const QUORUM: usize = 3;

/// Whether a message published to queue `queue` must be on disk before its confirm: a
/// persistent one on a durable queue, and every one on the quorum queue.
fn stored(queue: usize, persistent: bool) -> bool {
    QUEUES[queue].1 && (persistent || queue == QUORUM)
}

fn declare_args(queue: usize) -> FieldTable {
    let mut t = FieldTable::new();
    if queue == QUORUM {
        t.insert("x-queue-type".into(), FieldValue::string("quorum"));
    }
    t
}

#[derive(Clone, Debug)]
enum SimOp {
    Publish { queue: u8, persistent: bool },
    Ack { which: u8, multiple: bool },
    Requeue { which: u8 },
    Get { queue: u8 },
    StartSync,
    CompleteSync,
    Crash,
    Written,
}

fn sim_op() -> impl Strategy<Value = SimOp> {
    prop_oneof![
        8 => (0u8..4, any::<bool>()).prop_map(|(queue, persistent)| SimOp::Publish { queue, persistent }),
        4 => (any::<u8>(), any::<bool>()).prop_map(|(which, multiple)| SimOp::Ack { which, multiple }),
        1 => any::<u8>().prop_map(|which| SimOp::Requeue { which }),
        1 => (0u8..4).prop_map(|queue| SimOp::Get { queue }),
        3 => Just(SimOp::StartSync),
        3 => Just(SimOp::CompleteSync),
        1 => Just(SimOp::Crash),
        3 => Just(SimOp::Written),
    ]
}

const PUB: ChannelRef = ChannelRef {
    conn: warren_core::ids::ConnId(1),
    channel: 1,
};

fn cons() -> ChannelRef {
    ch(2, 1)
}

struct Sim {
    /// One store and one broker per shard (connection `n` on shard `n % k`).
    stores: Vec<MemoryStore>,
    brokers: Vec<Broker>,
    now: u64,
    /// Every published message: id -> (queue index, persistent).
    published: Vec<(usize, bool)>,
    /// Confirm sequence number of this connection's publishes -> message id.
    confirm_seq: BTreeMap<u64, u64>,
    next_confirm: u64,
    /// Ids confirmed with ack=true.
    confirmed: BTreeSet<u64>,
    /// Ids acked by the consumer (gone for good unless a crash brings them back).
    acked: BTreeSet<u64>,
    /// Ids delivered at least once.
    delivered: BTreeSet<u64>,
    /// Outstanding deliveries: tag -> id.
    outstanding: BTreeMap<u64, u64>,
    /// Per queue: the last id delivered with redelivered = false.
    last_fresh: [Option<u64>; 4],
    unwritten: u32,
    crashed: bool,
}

fn body_id(body: &[u8]) -> u64 {
    std::str::from_utf8(body)
        .ok()
        .and_then(|s| s.parse().ok())
        .expect("body is an id")
}

impl Sim {
    fn new() -> Sim {
        Sim::sharded(1)
    }

    /// Over `k` shards, each with its own store: the publisher (connection 1) and the
    /// consumer (connection 2) on different shards when `k > 1`, the durable queues where
    /// their names say.
    fn sharded(k: u32) -> Sim {
        let stores: Vec<MemoryStore> = (0..k).map(|_| MemoryStore::new()).collect();
        let mut sim = Sim {
            brokers: Sim::brokers(&stores),
            stores,
            now: 0,
            published: Vec::new(),
            confirm_seq: BTreeMap::new(),
            next_confirm: 1,
            confirmed: BTreeSet::new(),
            acked: BTreeSet::new(),
            delivered: BTreeSet::new(),
            outstanding: BTreeMap::new(),
            last_fresh: [None; 4],
            unwritten: 0,
            crashed: false,
        };
        sim.connect();
        for (i, (name, durable)) in QUEUES.into_iter().enumerate() {
            sim.exec(
                PUB,
                Op::QueueDeclare(QueueDeclare {
                    queue: name.into(),
                    passive: false,
                    durable,
                    exclusive: false,
                    auto_delete: false,
                    nowait: false,
                    arguments: declare_args(i),
                }),
                false,
            );
        }
        sim.subscribe();
        // Definitions are durable after the next sync, as hosts sync after every batch.
        sim.step(SimOp::StartSync);
        sim.step(SimOp::CompleteSync);
        sim
    }

    fn brokers(stores: &[MemoryStore]) -> Vec<Broker> {
        let config = BrokerConfig {
            queue_window: 3,
            flow_ready_high: usize::MAX,
            ..Default::default()
        };
        let k = stores.len() as u32;
        let mut brokers: Vec<Broker> = stores
            .iter()
            .map(|store| Broker::with_store(config.clone(), Box::new(store.clone())))
            .collect();
        if k > 1 {
            for (i, b) in brokers.iter_mut().enumerate() {
                b.set_shard(i as u32, k);
            }
        }
        brokers
    }

    fn shard_of(&self, c: ChannelRef) -> usize {
        (c.conn.0 % self.brokers.len() as u64) as usize
    }

    /// Carries the mail between shards until none is left.
    fn settle(&mut self) {
        let (first, others) = self.brokers.split_at_mut(1);
        warren_core::shards::carry(self.now, &mut first[0], others);
    }

    fn connect(&mut self) {
        for conn in [1, 2] {
            self.exec(
                ch(conn, 0),
                Op::ConnectionOpen {
                    vhost: "/".into(),
                    user: "guest".into(),
                    cancel_notify: true,
                },
                false,
            );
            self.exec(ch(conn, 1), Op::ChannelOpen, false);
        }
        self.exec(PUB, Op::ConfirmSelect { nowait: false }, false);
        self.next_confirm = 1;
        self.confirm_seq.clear();
        self.exec(
            cons(),
            Op::Qos {
                prefetch_size: 0,
                prefetch_count: 4,
                global: false,
            },
            false,
        );
    }

    fn subscribe(&mut self) {
        for (i, (name, _)) in QUEUES.iter().enumerate() {
            self.exec(
                cons(),
                Op::Consume(Consume {
                    queue: (*name).into(),
                    consumer_tag: format!("c{i}"),
                    no_local: false,
                    no_ack: false,
                    exclusive: false,
                    nowait: false,
                    arguments: FieldTable::new(),
                }),
                false,
            );
        }
    }

    fn exec(&mut self, c: ChannelRef, op: Op, from_sync: bool) {
        self.now += 1;
        let i = self.shard_of(c);
        self.brokers[i].handle(self.now, c, op);
        self.drain(from_sync);
    }

    fn drain(&mut self, from_sync: bool) {
        self.settle();
        let all: Vec<&Broker> = self.brokers.iter().collect();
        if let Err(e) = Broker::check_shards(&all) {
            panic!("invariant broken: {e}");
        }
        let mut fx = Vec::new();
        for b in &mut self.brokers {
            b.poll_effects(&mut fx);
        }
        for e in fx {
            self.observe(e, from_sync);
        }
    }

    fn observe(&mut self, e: Effect, from_sync: bool) {
        match e {
            Effect::Confirm {
                seq, ack, multiple, ..
            } => {
                assert!(!multiple);
                let id = self.confirm_seq[&seq];
                let (queue, persistent) = self.published[id as usize];
                if stored(queue, persistent) {
                    assert!(from_sync, "message {id} confirmed before a sync");
                }
                assert!(ack, "message {id} nacked");
                self.confirmed.insert(id);
            }
            Effect::Deliver { delivery, .. }
            | Effect::Reply {
                reply: Reply::GetOk { delivery, .. },
                ..
            } => {
                let id = body_id(&delivery.message.body);
                let (queue, _) = *self
                    .published
                    .get(id as usize)
                    .unwrap_or_else(|| panic!("invented message {id}"));
                assert!(
                    delivery.redelivered || self.delivered.insert(id),
                    "message {id} delivered twice without redelivered"
                );
                self.delivered.insert(id);
                if !delivery.redelivered {
                    if let Some(last) = self.last_fresh[queue] {
                        assert!(last < id, "queue {queue}: {id} after {last}");
                    }
                    self.last_fresh[queue] = Some(id);
                }
                self.unwritten += 1;
                self.outstanding.insert(delivery.delivery_tag, id);
            }
            Effect::ChannelError { error, .. } | Effect::ConnectionError { error, .. } => {
                panic!("unexpected error: {error}")
            }
            _ => {}
        }
    }

    fn step(&mut self, op: SimOp) {
        match op {
            SimOp::Publish { queue, persistent } => {
                let id = self.published.len() as u64;
                self.published.push((usize::from(queue), persistent));
                self.confirm_seq.insert(self.next_confirm, id);
                self.next_confirm += 1;
                let properties = Properties {
                    delivery_mode: Some(if persistent { 2 } else { 1 }),
                    ..Default::default()
                };
                self.exec(
                    PUB,
                    Op::Publish(Box::new(Publish {
                        exchange: "".into(),
                        routing_key: QUEUES[usize::from(queue)].0.into(),
                        mandatory: false,
                        immediate: false,
                        properties,
                        body: id.to_string().into(),
                        routed: None,
                    })),
                    false,
                );
            }
            SimOp::Ack { which, multiple } => {
                let tags: Vec<u64> = self.outstanding.keys().copied().collect();
                if tags.is_empty() {
                    return;
                }
                let tag = tags[usize::from(which) % tags.len()];
                let taken: Vec<u64> = if multiple {
                    let rest = self.outstanding.split_off(&(tag + 1));
                    std::mem::replace(&mut self.outstanding, rest)
                        .into_values()
                        .collect()
                } else {
                    self.outstanding.remove(&tag).into_iter().collect()
                };
                self.acked.extend(taken);
                self.exec(
                    cons(),
                    Op::Ack {
                        delivery_tag: tag,
                        multiple,
                    },
                    false,
                );
            }
            SimOp::Requeue { which } => {
                let tags: Vec<u64> = self.outstanding.keys().copied().collect();
                if tags.is_empty() {
                    return;
                }
                let tag = tags[usize::from(which) % tags.len()];
                self.outstanding.remove(&tag);
                self.exec(
                    cons(),
                    Op::Nack {
                        delivery_tag: tag,
                        multiple: false,
                        requeue: true,
                    },
                    false,
                );
            }
            SimOp::Get { queue } => {
                self.exec(
                    cons(),
                    Op::Get {
                        queue: QUEUES[usize::from(queue)].0.into(),
                        no_ack: false,
                    },
                    false,
                );
            }
            SimOp::StartSync => {
                for b in &mut self.brokers {
                    b.start_sync();
                }
            }
            SimOp::CompleteSync => {
                for i in 0..self.brokers.len() {
                    if let Some(epoch) = self.stores[i].complete_sync() {
                        self.now += 1;
                        self.brokers[i].synced(self.now, epoch);
                        self.drain(true);
                    }
                }
            }
            SimOp::Written => {
                if self.unwritten > 0 {
                    let count = std::mem::take(&mut self.unwritten);
                    self.exec(ch(2, 0), Op::Written { count }, false);
                }
            }
            SimOp::Crash => self.crash(),
        }
    }

    /// Power cut and restart: a new broker restores from what the store synced.
    fn crash(&mut self) {
        for store in &self.stores {
            store.crash();
        }
        self.brokers = Sim::brokers(&self.stores);
        let definitions = self.stores[0].definitions();
        let errors = warren_core::shards::restore(self.now, &definitions, &mut self.brokers);
        assert!(errors.is_empty(), "restore failed: {errors:?}");
        self.outstanding.clear();
        self.unwritten = 0;
        self.crashed = true;
        // Recovered messages are all flagged redelivered; fresh ones start a new order.
        self.last_fresh = [None; 4];
        self.connect();
        self.exec(
            PUB,
            Op::QueueDeclare(QueueDeclare {
                queue: "t0".into(),
                passive: false,
                durable: false,
                exclusive: false,
                auto_delete: false,
                nowait: false,
                arguments: FieldTable::new(),
            }),
            false,
        );
        self.subscribe();
        // Settled before the crash but not necessarily on disk: they may come back.
        self.acked.clear();
    }

    /// Syncs, acks everything still arriving until the queues are empty, and checks that
    /// nothing that had to survive went missing.
    fn finish(mut self) {
        // Finish the sync in flight, then sync what it did not cover.
        for _ in 0..2 {
            self.step(SimOp::CompleteSync);
            self.step(SimOp::StartSync);
        }
        self.step(SimOp::CompleteSync);
        for _ in 0..10_000 {
            let count = std::mem::take(&mut self.unwritten);
            if count > 0 {
                self.exec(ch(2, 0), Op::Written { count }, false);
            }
            if self.outstanding.is_empty() {
                break;
            }
            let ids: Vec<u64> = std::mem::take(&mut self.outstanding)
                .into_values()
                .collect();
            self.acked.extend(ids);
            self.exec(
                cons(),
                Op::Ack {
                    delivery_tag: 0,
                    multiple: true,
                },
                false,
            );
        }
        for (name, _) in QUEUES {
            let len = self.brokers.iter().find_map(|b| b.queue_len(name));
            assert_eq!(len, Some(0), "{name} drained");
        }
        for (id, &(queue, persistent)) in self.published.iter().enumerate() {
            let id = id as u64;
            let must_survive =
                !self.crashed || (stored(queue, persistent) && self.confirmed.contains(&id));
            if must_survive {
                assert!(
                    self.delivered.contains(&id),
                    "message {id} (queue {queue}, persistent {persistent}) was lost"
                );
            }
        }
        if !self.crashed {
            assert_eq!(
                self.confirmed.len(),
                self.published.len(),
                "every publish confirmed"
            );
        }
        let pending: usize = self.brokers.iter().map(Broker::pending_confirms).sum();
        assert_eq!(pending, 0);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn lazy_queues_with_syncs_and_crashes(ops in prop::collection::vec(sim_op(), 1..300)) {
        let mut sim = Sim::new();
        for op in ops {
            sim.step(op);
        }
        sim.finish();
    }

    /// The same over 2 or 3 shards, each with its own store and syncs: a persistent message
    /// on a durable queue of another shard is confirmed only by that shard's sync, and a
    /// crash of every shard loses nothing confirmed.
    #[test]
    fn sharded_queues_with_syncs_and_crashes(
        ops in prop::collection::vec(sim_op(), 1..300),
        k in 2u32..=3,
    ) {
        let mut sim = Sim::sharded(k);
        for op in ops {
            sim.step(op);
        }
        sim.finish();
    }
}

#[test]
fn a_backlog_pages_out_and_back_in_order() {
    let mut sim = Sim::new();
    // The consumer holds 4 unacked (prefetch); the rest is a backlog: 3 in memory, the rest
    // paged out, read back in order as acks free credit (checked by `finish`).
    for _ in 0..50 {
        sim.step(SimOp::Publish {
            queue: 0,
            persistent: true,
        });
    }
    assert_eq!(
        sim.stores[0].stored("d0"),
        50,
        "persistent messages on a durable queue are stored"
    );
    assert_eq!(sim.brokers[0].queue_len("d0"), Some(46));
    sim.finish();
}

#[test]
fn a_failing_store_nacks_and_blocks_then_recovers() {
    let mut sim = Sim::new();
    sim.stores[0].set_fail_appends(true);
    let id = sim.published.len() as u64;
    sim.published.push((0, true));
    sim.confirm_seq.insert(sim.next_confirm, id);
    sim.now += 1;
    sim.brokers[0].handle(
        sim.now,
        PUB,
        Op::Publish(Box::new(Publish {
            exchange: "".into(),
            routing_key: "d0".into(),
            mandatory: false,
            immediate: false,
            properties: Properties {
                delivery_mode: Some(2),
                ..Default::default()
            },
            body: id.to_string().into(),
            routed: None,
        })),
    );
    let mut fx = Vec::new();
    sim.brokers[0].poll_effects(&mut fx);
    assert!(
        fx.iter()
            .any(|e| matches!(e, Effect::Confirm { ack: false, .. })),
        "nacked: {fx:?}"
    );
    assert!(
        fx.iter().any(|e| matches!(e, Effect::Blocked { .. })),
        "publishers blocked: {fx:?}"
    );
    assert_eq!(sim.brokers[0].queue_len("d0"), Some(0), "not enqueued");
    let retry = sim.brokers[0].next_deadline().expect("a retry deadline");
    sim.stores[0].set_fail_appends(false);
    sim.brokers[0].tick(retry);
    fx.clear();
    sim.brokers[0].poll_effects(&mut fx);
    assert!(
        fx.iter().any(|e| matches!(e, Effect::Unblocked { .. })),
        "unblocked after the retry delay: {fx:?}"
    );
}
