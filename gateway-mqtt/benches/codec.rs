//! MQTT framing costs per message: decoding a client's PUBLISH batch (v3.1.1 and v5) and
//! encoding deliveries. `cargo bench -p warren-mqtt --bench codec`.

use bytes::{Bytes, BytesMut};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use mqtt_proto::v5;
use mqtt_proto::{Pid, QosPid, TopicName};
use std::hint::black_box;
use warren_mqtt::codec::{self, Decoded};

/// Packets per iteration: a gateway decodes a whole socket read at once.
const BATCH: usize = 1000;
const MAX_PACKET: usize = 1 << 20;

fn publish(qos1: bool, size: usize) -> v5::Packet {
    let qos_pid = if qos1 {
        QosPid::Level1(Pid::try_from(1).expect("1 is a valid packet id"))
    } else {
        QosPid::Level0
    };
    v5::Packet::Publish(v5::Publish {
        dup: false,
        retain: false,
        qos_pid,
        topic_name: TopicName::try_from("bench/sensor/1").expect("valid topic"),
        payload: Bytes::from(vec![7u8; size]),
        properties: Default::default(),
    })
}

fn decode(c: &mut Criterion) {
    let mut g = c.benchmark_group("mqtt_decode_publish");
    g.throughput(Throughput::Elements(BATCH as u64));
    for (level, qos1) in [(4u8, false), (4, true), (5, false), (5, true)] {
        let packet = publish(qos1, 12);
        let mut wire = BytesMut::new();
        for _ in 0..BATCH {
            assert!(codec::encode(&packet, level, &mut wire));
        }
        let name = format!("v{level}_qos{}_12B", u8::from(qos1));
        g.bench_function(name, |b| {
            b.iter(|| {
                let mut buf = wire.clone();
                let mut n = 0usize;
                while let Ok(Some(Decoded::Packet(_))) =
                    codec::decode(&mut buf, Some(level), MAX_PACKET)
                {
                    n += 1;
                }
                assert_eq!(n, BATCH);
                black_box(n)
            })
        });
    }
    g.finish();
}

fn encode(c: &mut Criterion) {
    let mut g = c.benchmark_group("mqtt_encode_publish");
    g.throughput(Throughput::Elements(BATCH as u64));
    let mut out = BytesMut::with_capacity(BATCH * 64);
    for level in [4u8, 5] {
        let packet = publish(true, 12);
        g.bench_function(format!("v{level}_qos1_12B"), |b| {
            b.iter(|| {
                out.clear();
                for _ in 0..BATCH {
                    codec::encode(&packet, level, &mut out);
                }
                black_box(out.len())
            })
        });
    }
    g.finish();
}

criterion_group!(benches, decode, encode);
criterion_main!(benches);
