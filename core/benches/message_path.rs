//! The core's message path in process (`cargo bench -p warren-core --bench message_path`):
//! publish -> enqueue -> dispatch -> deliver -> ack through `Broker::handle`, as the broker
//! task runs it, without sockets or a runtime. What it measures is the core's own cost per
//! message, so changes to the composition (mail between the queue and channel sides) show
//! up here without the noise of a client on the same two cores.

#[cfg(not(target_arch = "wasm32"))]
mod native {
    use bytes::Bytes;
    use criterion::{Criterion, Throughput};
    use std::hint::black_box;
    use warren_core::command::{Consume, Op, Publish, QueueDeclare};
    use warren_core::effect::Effect;
    use warren_core::ids::{ChannelRef, ConnId};
    use warren_core::message::{FieldTable, Properties};
    use warren_core::{Broker, BrokerConfig};

    /// Messages per iteration.
    const BATCH: u64 = 1000;

    struct Setup {
        broker: Broker,
        publisher: ChannelRef,
        consumer: ChannelRef,
        effects: Vec<Effect>,
        now: u64,
    }

    fn open(b: &mut Broker, conn: u64) -> ChannelRef {
        b.handle(
            0,
            ChannelRef::new(ConnId(conn), 0),
            Op::ConnectionOpen {
                vhost: "/".into(),
                user: "guest".into(),
                cancel_notify: true,
            },
        );
        let ch = ChannelRef::new(ConnId(conn), 1);
        b.handle(0, ch, Op::ChannelOpen);
        ch
    }

    /// A publisher and a consumer (acks, prefetch `prefetch`) on one queue.
    fn setup(prefetch: u16, confirms: bool) -> Setup {
        let mut broker = Broker::new(BrokerConfig::default());
        let publisher = open(&mut broker, 1);
        let consumer = open(&mut broker, 2);
        let declare = QueueDeclare {
            queue: "q".into(),
            passive: false,
            durable: false,
            exclusive: false,
            auto_delete: false,
            nowait: false,
            arguments: FieldTable::new(),
        };
        broker.handle(0, consumer, Op::QueueDeclare(declare));
        let qos = Op::Qos {
            prefetch_size: 0,
            prefetch_count: prefetch,
            global: false,
        };
        broker.handle(0, consumer, qos);
        let consume = Consume {
            queue: "q".into(),
            consumer_tag: "c".into(),
            no_local: false,
            no_ack: false,
            exclusive: false,
            nowait: false,
            arguments: FieldTable::new(),
        };
        broker.handle(0, consumer, Op::Consume(consume));
        if confirms {
            broker.handle(0, publisher, Op::ConfirmSelect { nowait: false });
        }
        let mut effects = Vec::new();
        broker.poll_effects(&mut effects);
        effects.clear();
        Setup {
            broker,
            publisher,
            consumer,
            effects,
            now: 0,
        }
    }

    /// Publishes `BATCH` messages, then acks each delivery (and returns the write credit)
    /// as a client that keeps up would.
    fn round(s: &mut Setup, body: &Bytes) -> u64 {
        s.now += 1;
        let mut delivered = 0;
        for _ in 0..BATCH {
            let p = Publish {
                exchange: "".into(),
                routing_key: "q".into(),
                mandatory: false,
                immediate: false,
                properties: Properties::default(),
                body: body.clone(),
                routed: None,
            };
            s.broker
                .handle(s.now, s.publisher, Op::Publish(Box::new(p)));
            s.broker.poll_effects(&mut s.effects);
            for e in s.effects.drain(..) {
                if let Effect::Deliver { delivery, .. } = e {
                    delivered += 1;
                    let tag = delivery.delivery_tag;
                    s.broker.handle(s.now, s.consumer, Op::Written { count: 1 });
                    let ack = Op::Ack {
                        delivery_tag: tag,
                        multiple: false,
                    };
                    s.broker.handle(s.now, s.consumer, ack);
                }
            }
        }
        s.broker.poll_effects(&mut s.effects);
        s.effects.clear();
        delivered
    }

    pub fn message_path(c: &mut Criterion) {
        let body = Bytes::from_static(&[7u8; 16]);
        let mut g = c.benchmark_group("message_path");
        g.throughput(Throughput::Elements(BATCH));
        for (name, prefetch, confirms) in [
            ("publish_deliver_ack_prefetch_100", 100, false),
            ("publish_deliver_ack_confirms", 100, true),
        ] {
            let mut s = setup(prefetch, confirms);
            g.bench_function(name, |bench| {
                bench.iter(|| {
                    let delivered = round(&mut s, &body);
                    assert_eq!(delivered, BATCH, "every message is delivered at once");
                    black_box(delivered)
                })
            });
        }
        g.finish();
    }
}

#[cfg(not(target_arch = "wasm32"))]
criterion::criterion_group! {
    name = benches;
    config = criterion::Criterion::default().sample_size(30);
    targets = native::message_path
}
#[cfg(not(target_arch = "wasm32"))]
criterion::criterion_main!(benches);

#[cfg(target_arch = "wasm32")]
fn main() {}
