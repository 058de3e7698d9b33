//! Stream queues in the core: the log held by the broker itself (no store) or by the host's
//! `Store` (`MemoryStore` with its crash model), consumers reading independently from their
//! offsets, deliveries only of synced messages, confirms after the sync, a crash keeping
//! every synced message at its offset, retention set by a policy.

mod common;

use common::*;
use warren_core::admin::AdminRequest;
use warren_core::command::{Consume, Op, QueueDeclare};
use warren_core::effect::Effect;
use warren_core::ids::ChannelRef;
use warren_core::message::{FieldTable, FieldValue};
use warren_core::shards::Shards;
use warren_core::store::{
    MemLog, MemoryStore, SharedStreams, StreamBounds, StreamEntry, StreamSettings, StreamStart,
};
use warren_core::{Broker, BrokerConfig};

fn stream_args() -> FieldTable {
    FieldTable::from([("x-queue-type".into(), FieldValue::string("stream"))])
}

fn declare_stream(h: &mut Harness, c: ChannelRef, name: &str, mut args: FieldTable) {
    args.extend(stream_args());
    let fx = h.op(
        c,
        Op::QueueDeclare(QueueDeclare {
            queue: name.into(),
            passive: false,
            durable: true,
            exclusive: false,
            auto_delete: false,
            nowait: false,
            arguments: args,
        }),
    );
    assert_eq!(error_code(&fx), None, "declare {name}: {fx:?}");
}

/// Consumes `queue` on channel `c` with prefetch `prefetch` from `offset`.
fn consume_from(
    h: &mut Harness,
    c: ChannelRef,
    queue: &str,
    tag: &str,
    prefetch: u16,
    offset: Option<FieldValue>,
) -> Vec<Effect> {
    h.op(
        c,
        Op::Qos {
            prefetch_size: 0,
            prefetch_count: prefetch,
            global: false,
        },
    );
    let arguments = offset
        .map(|v| FieldTable::from([("x-stream-offset".into(), v)]))
        .unwrap_or_default();
    h.op(
        c,
        Op::Consume(Consume {
            queue: queue.into(),
            consumer_tag: tag.into(),
            no_local: false,
            no_ack: false,
            exclusive: false,
            nowait: false,
            arguments,
        }),
    )
}

/// (consumer tag, delivery tag, x-stream-offset, body) of every delivery in `fx`.
fn stream_deliveries(fx: &[Effect]) -> Vec<(String, u64, i64, String)> {
    fx.iter()
        .filter_map(|e| match e {
            Effect::Deliver {
                consumer_tag,
                delivery,
                ..
            } => {
                let offset = delivery
                    .message
                    .properties
                    .headers
                    .as_ref()
                    .and_then(|h| h.get("x-stream-offset"))
                    .and_then(FieldValue::as_i64)
                    .expect("x-stream-offset header");
                Some((
                    consumer_tag.to_string(),
                    delivery.delivery_tag,
                    offset,
                    String::from_utf8_lossy(&delivery.message.body).into_owned(),
                ))
            }
            _ => None,
        })
        .collect()
}

/// A broker over `store`.
fn over(store: &MemoryStore) -> Shards {
    Shards::new(vec![Broker::with_store(
        BrokerConfig::default(),
        Box::new(store.clone()),
    )])
}

/// A sync that completes: the store makes it durable, then the broker hears of it.
fn sync(h: &mut Harness, store: &MemoryStore) -> Vec<Effect> {
    let now = h.now;
    if let Some(epoch) = h.shard(0).start_sync() {
        assert_eq!(store.complete_sync(), Some(epoch));
        h.shard(0).synced(now, epoch);
    }
    h.settle()
}

/// A broker without a store holding stream `s` with messages `m0`..`m{n-1}`, and the
/// channel that published them.
fn stream_of(n: usize) -> (Harness, ChannelRef) {
    let mut h = Harness::new();
    let c = h.connect(1);
    declare_stream(&mut h, c, "s", FieldTable::new());
    for i in 0..n {
        h.publish(c, "", "s", &format!("m{i}"));
    }
    (h, c)
}

fn first() -> Option<FieldValue> {
    Some(FieldValue::string("first"))
}

#[test]
fn without_a_store_the_broker_holds_the_log_and_consumers_read_it_independently() {
    let (mut h, c) = stream_of(5);
    let a = h.connect(2);
    let b = h.open(2, 2);
    let fa = stream_deliveries(&consume_from(&mut h, a, "s", "a", 2, first()));
    // Prefetch 2: two deliveries, the rest after acks (which only return credit).
    assert_eq!(
        fa.iter().map(|d| (d.2, d.3.as_str())).collect::<Vec<_>>(),
        [(0, "m0"), (1, "m1")]
    );
    let fb = stream_deliveries(&consume_from(&mut h, b, "s", "b", 10, first()));
    assert_eq!(fb.len(), 5, "the second consumer reads everything too");
    let more = stream_deliveries(&h.op(
        a,
        Op::Ack {
            delivery_tag: 2,
            multiple: true,
        },
    ));
    assert_eq!(
        more.iter().map(|d| d.2).collect::<Vec<_>>(),
        [2, 3],
        "acks return credit"
    );
    // Nack with requeue only returns credit too (RabbitMQ 3.10): no redelivery.
    let after_nack = stream_deliveries(&h.op(
        a,
        Op::Nack {
            delivery_tag: 4,
            multiple: true,
            requeue: true,
        },
    ));
    assert_eq!(after_nack.iter().map(|d| d.2).collect::<Vec<_>>(), [4]);
    // A new publish reaches both consumers that have credit.
    let fx = stream_deliveries(&h.publish(c, "", "s", "m5"));
    assert_eq!(fx.len(), 2, "{fx:?}");
    // basic.get is refused: 540 closes the connection.
    let g = h.connect(3);
    let fx = h.op(
        g,
        Op::Get {
            queue: "s".into(),
            no_ack: false,
        },
    );
    assert_eq!(error_code(&fx), Some(540));
}

#[test]
fn with_a_store_confirms_and_deliveries_wait_for_the_sync() {
    let store = MemoryStore::new();
    let mut h = Harness {
        shards: over(&store),
        now: 0,
    };
    let c = h.connect(1);
    declare_stream(&mut h, c, "s", FieldTable::new());
    h.op(c, Op::ConfirmSelect { nowait: false });
    let r = h.connect(2);
    let fx = consume_from(&mut h, r, "s", "r", 100, first());
    assert!(stream_deliveries(&fx).is_empty());
    let mut fx = Vec::new();
    for i in 0..3 {
        fx.extend(h.publish(c, "", "s", &format!("m{i}")));
    }
    assert!(
        !fx.iter().any(|e| matches!(e, Effect::Confirm { .. })),
        "no confirm before the sync"
    );
    assert!(
        stream_deliveries(&fx).is_empty(),
        "no delivery of unsynced messages"
    );
    let fx = sync(&mut h, &store);
    let confirms = fx
        .iter()
        .filter(|e| matches!(e, Effect::Confirm { ack: true, .. }))
        .count();
    assert_eq!(confirms, 3);
    assert_eq!(
        stream_deliveries(&fx)
            .iter()
            .map(|d| (d.2, d.3.as_str()))
            .collect::<Vec<_>>(),
        [(0, "m0"), (1, "m1"), (2, "m2")]
    );
}

#[test]
fn a_crash_keeps_every_synced_message_at_its_offset() {
    let store = MemoryStore::new();
    let mut h = Harness {
        shards: over(&store),
        now: 0,
    };
    let c = h.connect(1);
    declare_stream(&mut h, c, "s", FieldTable::new());
    for i in 0..4 {
        h.publish(c, "", "s", &format!("m{i}"));
    }
    sync(&mut h, &store);
    // Written but never synced: lost in the crash, and never delivered before it.
    h.publish(c, "", "s", "lost");
    let r = h.connect(2);
    let seen = stream_deliveries(&consume_from(&mut h, r, "s", "r", 100, first()));
    assert_eq!(
        seen.len(),
        4,
        "only synced messages are delivered: {seen:?}"
    );
    store.crash();
    h.shards = over(&store);
    let definitions = store.definitions();
    assert!(h.shards.restore(h.now, &definitions).is_empty());
    let c = h.connect(1);
    let r = h.connect(2);
    let got = stream_deliveries(&consume_from(&mut h, r, "s", "r", 100, first()));
    assert_eq!(
        got.iter().map(|d| (d.2, d.3.as_str())).collect::<Vec<_>>(),
        [(0, "m0"), (1, "m1"), (2, "m2"), (3, "m3")]
    );
    // The lost message's offset goes to the next one: no consumer saw it before.
    h.publish(c, "", "s", "m4");
    let fx = sync(&mut h, &store);
    assert_eq!(
        stream_deliveries(&fx)
            .iter()
            .map(|d| (d.2, d.3.as_str()))
            .collect::<Vec<_>>(),
        [(4, "m4")]
    );
}

#[test]
fn retention_from_a_policy_truncates_whole_segments() {
    let mut h = Harness::new();
    let policy = warren_core::policy::PolicyDef {
        vhost: "/".into(),
        name: "retain".into(),
        pattern: "^capped$".into(),
        apply_to: warren_core::policy::ApplyTo::Queues,
        priority: 0,
        definition: FieldTable::from([
            ("max-length-bytes".into(), FieldValue::I64(1000)),
            ("stream-max-segment-size-bytes".into(), FieldValue::I64(300)),
        ]),
    };
    h.shards.admin(h.now, AdminRequest::SetPolicy(policy));
    h.settle();
    let c = h.connect(1);
    declare_stream(&mut h, c, "capped", FieldTable::new());
    // 100 messages; each encodes to about 60 bytes: several per 300-byte segment.
    for i in 0..100 {
        h.publish(c, "", "capped", &format!("{i:03}"));
    }
    let r = h.connect(2);
    let got = stream_deliveries(&consume_from(&mut h, r, "capped", "r", 1000, first()));
    let oldest = got.first().map(|d| d.2).expect("something retained");
    assert!(oldest > 0, "retention dropped the oldest segments");
    assert_eq!(got.last().map(|d| d.2), Some(99));
    assert_eq!(
        got.len() as i64,
        100 - oldest,
        "dense from the first retained"
    );
    // Whole segments only: what is left is at most the limit plus one segment.
    let bytes: usize = got.len() * 60;
    assert!(bytes <= 1000 + 300 + 60 * 5, "{bytes}");
    // A policy set after the declare applies to the stream at once.
    declare_stream(
        &mut h,
        c,
        "later",
        FieldTable::from([(
            "x-stream-max-segment-size-bytes".into(),
            FieldValue::I64(300),
        )]),
    );
    for i in 0..100 {
        h.publish(c, "", "later", &format!("{i:03}"));
    }
    let policy = warren_core::policy::PolicyDef {
        vhost: "/".into(),
        name: "later".into(),
        pattern: "^later$".into(),
        apply_to: warren_core::policy::ApplyTo::Queues,
        priority: 0,
        definition: FieldTable::from([("max-length-bytes".into(), FieldValue::I64(1000))]),
    };
    h.shards.admin(h.now, AdminRequest::SetPolicy(policy));
    h.settle();
    let r = h.connect(3);
    let got = stream_deliveries(&consume_from(&mut h, r, "later", "r", 1000, first()));
    assert!(
        got.first().is_some_and(|d| d.2 > 0),
        "the new policy's retention dropped the oldest segments"
    );
    assert_eq!(got.last().map(|d| d.2), Some(99));
}

#[test]
fn stream_declares_and_consumes_are_checked_as_rabbitmq_checks_them() {
    let mut h = Harness::new();
    let c = h.connect(1);
    let fx = h.op(
        c,
        Op::QueueDeclare(QueueDeclare {
            queue: "t".into(),
            passive: false,
            durable: false,
            exclusive: false,
            auto_delete: false,
            nowait: false,
            arguments: stream_args(),
        }),
    );
    assert_eq!(error_code(&fx), Some(406), "non-durable refused");
    let c = h.open(1, 2);
    declare_stream(&mut h, c, "s", FieldTable::new());
    // No prefetch: 406; no-ack: 540; an offset it cannot read: 406.
    let fx = h.op(
        c,
        Op::Consume(Consume {
            queue: "s".into(),
            consumer_tag: "x".into(),
            no_local: false,
            no_ack: false,
            exclusive: false,
            nowait: false,
            arguments: FieldTable::new(),
        }),
    );
    assert_eq!(error_code(&fx), Some(406));
    let c = h.open(1, 3);
    let fx = consume_from(&mut h, c, "s", "x", 1, Some(FieldValue::string("bogus")));
    assert_eq!(error_code(&fx), Some(406));
    let c = h.open(1, 4);
    let fx = consume_from(&mut h, c, "s", "x", 1, Some(FieldValue::Bool(true)));
    assert_eq!(error_code(&fx), Some(406));
}

/// A host's shared logs for the test: `MemLog`s by name, which "another protocol" appends
/// to directly.
#[derive(Default)]
struct HostLogs(std::sync::Mutex<std::collections::HashMap<(String, String), MemLog>>);

impl HostLogs {
    fn with<T>(
        &self,
        vhost: &str,
        name: &str,
        f: impl FnOnce(&mut MemLog) -> T,
    ) -> Result<T, String> {
        let mut logs = self.0.lock().unwrap();
        logs.get_mut(&(vhost.to_string(), name.to_string()))
            .map(f)
            .ok_or_else(|| format!("no stream {name}"))
    }
}

impl SharedStreams for HostLogs {
    fn open(&self, vhost: &str, name: &str, settings: &StreamSettings) -> Result<(), String> {
        let mut logs = self.0.lock().unwrap();
        logs.entry((vhost.to_string(), name.to_string()))
            .or_insert_with(|| MemLog::new(settings.clone()));
        Ok(())
    }
    fn append(&self, vhost: &str, name: &str, data: bytes::Bytes, ts: u64) -> Result<(), String> {
        self.with(vhost, name, |l| l.append([data], ts))
    }
    fn bounds(&self, vhost: &str, name: &str) -> Result<StreamBounds, String> {
        self.with(vhost, name, |l| l.bounds())
    }
    fn start(&self, vhost: &str, name: &str, start: StreamStart) -> Result<u64, String> {
        self.with(vhost, name, |l| l.start(start))
    }
    fn read(
        &self,
        vhost: &str,
        name: &str,
        from: u64,
        max: usize,
        out: &mut Vec<StreamEntry>,
    ) -> Result<(), String> {
        self.with(vhost, name, |l| l.read(from, max, out))
    }
    fn delete(&self, vhost: &str, name: &str) {
        self.0
            .lock()
            .unwrap()
            .remove(&(vhost.to_string(), name.to_string()));
    }
}

#[test]
fn shared_logs_take_the_hosts_appends_and_consumers_get_them_when_told() {
    let logs = std::sync::Arc::new(HostLogs::default());
    let mut broker = Broker::new(BrokerConfig::default());
    broker.set_shared_streams(logs.clone());
    let mut h = Harness {
        shards: Shards::new(vec![broker]),
        now: 0,
    };
    let c = h.connect(1);
    declare_stream(&mut h, c, "s", FieldTable::new());
    h.publish(c, "", "s", "amqp0");
    assert_eq!(
        logs.with("/", "s", |l| l.bounds().next),
        Ok(1),
        "the core appends to the host's log"
    );
    let r = h.connect(2);
    let fx = stream_deliveries(&consume_from(&mut h, r, "s", "r", 10, first()));
    assert_eq!(
        fx.iter().map(|d| d.3.as_str()).collect::<Vec<_>>(),
        ["amqp0"]
    );
    // Another protocol appends: nothing moves until the host says so (no timer polls)...
    logs.with("/", "s", |l| {
        l.append([bytes::Bytes::from_static(b"other1")], 5)
    })
    .unwrap();
    assert!(stream_deliveries(&h.tick(1000)).is_empty());
    // ... a stream of another name growing wakes nobody here ...
    let now = h.now;
    h.shard(0).streams_grew(now, &[("/".into(), "t".into())]);
    assert!(stream_deliveries(&h.settle()).is_empty());
    // ... and its own name delivers, at the next offset.
    h.shard(0).streams_grew(now, &[("/".into(), "s".into())]);
    let fx = stream_deliveries(&h.settle());
    assert_eq!(
        fx.iter().map(|d| (d.2, d.3.as_str())).collect::<Vec<_>>(),
        [(1, "other1")]
    );
    // Deleting the queue deletes the host's log.
    let fx = h.op(
        c,
        Op::QueueDelete {
            queue: "s".into(),
            if_unused: false,
            if_empty: false,
            nowait: false,
        },
    );
    assert_eq!(error_code(&fx), None);
    assert!(
        logs.with("/", "s", |_| ()).is_err(),
        "log deleted with its queue"
    );
}

#[test]
fn a_shard_counts_its_stream_readers_so_hosts_wake_only_shards_someone_reads_on() {
    let logs = std::sync::Arc::new(HostLogs::default());
    let mut broker = Broker::new(BrokerConfig::default());
    broker.set_shared_streams(logs.clone());
    let readers = broker.stream_readers();
    let mut h = Harness {
        shards: Shards::new(vec![broker]),
        now: 0,
    };
    let c = h.connect(1);
    declare_stream(&mut h, c, "s", FieldTable::new());
    declare_stream(&mut h, c, "t", FieldTable::new());
    assert!(
        !readers.any(),
        "streams with no consumer are read by nobody"
    );
    let r1 = h.connect(2);
    consume_from(&mut h, r1, "s", "a", 10, first());
    assert!(readers.any(), "a consumer reads");
    let r2 = h.connect(3);
    consume_from(&mut h, r2, "t", "b", 10, first());
    let fx = h.op(
        r1,
        Op::Cancel {
            consumer_tag: "a".into(),
            nowait: false,
        },
    );
    assert_eq!(error_code(&fx), None);
    assert!(readers.any(), "one cancelled, the other still reads");
    // A queue deleted under its consumer takes its count along.
    let fx = h.op(
        c,
        Op::QueueDelete {
            queue: "t".into(),
            if_unused: false,
            if_empty: false,
            nowait: false,
        },
    );
    assert_eq!(error_code(&fx), None);
    assert!(!readers.any(), "no reader left after the delete");
    // And a consumer that comes back counts again.
    consume_from(&mut h, r1, "s", "a2", 10, first());
    assert!(readers.any());
}

#[test]
fn a_full_stream_consumer_refills_a_quarter_of_its_prefetch_at_a_time_or_after_a_moment() {
    let (mut h, _) = stream_of(40);
    let r = h.connect(2);
    let offsets = |fx: &[Effect]| {
        stream_deliveries(fx)
            .iter()
            .map(|d| d.2)
            .collect::<Vec<_>>()
    };
    let ack = |h: &mut Harness, tag: u64| {
        h.op(
            r,
            Op::Ack {
                delivery_tag: tag,
                multiple: false,
            },
        )
    };
    assert_eq!(
        offsets(&consume_from(&mut h, r, "s", "r", 16, first())),
        (0..16).collect::<Vec<_>>()
    );
    // Full at 16: three acks free less than a quarter (4) and bring nothing ...
    for tag in 1..=3 {
        assert_eq!(offsets(&ack(&mut h, tag)), Vec::<i64>::new(), "ack {tag}");
    }
    // ... the fourth brings four at once.
    assert_eq!(offsets(&ack(&mut h, 4)), [16, 17, 18, 19]);
    // Full again: a consumer whose acks stop short gets what is free after a moment, not never.
    assert_eq!(offsets(&ack(&mut h, 5)), Vec::<i64>::new());
    assert_eq!(offsets(&h.tick(2)), [20]);
    // That filled it again: held again.
    assert_eq!(offsets(&ack(&mut h, 6)), Vec::<i64>::new());
    // A small prefetch refills per ack, as before.
    let s = h.connect(3);
    assert_eq!(
        offsets(&consume_from(&mut h, s, "s", "s", 4, first())),
        [0, 1, 2, 3]
    );
    let fx = h.op(
        s,
        Op::Ack {
            delivery_tag: 1,
            multiple: false,
        },
    );
    assert_eq!(offsets(&fx), [4]);
}
