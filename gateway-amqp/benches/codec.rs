//! AMQP framing costs per message: decoding a client's publish (method, header, body frames)
//! and encoding a delivery. `cargo bench -p warren-amqp --bench codec`.

use amq_protocol::protocol::{AMQPClass, basic};
use bytes::{Bytes, BytesMut};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use std::hint::black_box;
use warren_amqp::codec::{self, Frame};
use warren_core::message::Properties;

const FRAME_MAX: u32 = 131_072;
/// Messages per iteration: a gateway decodes a whole socket read at once.
const BATCH: usize = 1000;

fn publish_batch(body_len: usize) -> BytesMut {
    let mut buf = BytesMut::new();
    let body = Bytes::from(vec![7u8; body_len]);
    for _ in 0..BATCH {
        codec::encode_method(
            &mut buf,
            1,
            AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
                exchange: "".into(),
                routing_key: "bench".into(),
                mandatory: false,
                immediate: false,
            })),
        );
        codec::encode_content(&mut buf, 1, &Properties::default(), &body, FRAME_MAX);
    }
    buf
}

fn decode(c: &mut Criterion) {
    let mut g = c.benchmark_group("amqp_decode_publish");
    g.throughput(Throughput::Elements(BATCH as u64));
    for size in [12usize, 1000] {
        let wire = publish_batch(size);
        g.bench_function(format!("{size}B"), |b| {
            b.iter(|| {
                let mut buf = wire.clone();
                let mut frames = 0usize;
                while let Ok(Some(frame)) = codec::decode(&mut buf, FRAME_MAX) {
                    frames += usize::from(matches!(frame, Frame::Body(..)));
                }
                assert_eq!(frames, BATCH);
                black_box(frames)
            })
        });
    }
    g.finish();
}

fn encode(c: &mut Criterion) {
    let mut g = c.benchmark_group("amqp_encode_deliver");
    g.throughput(Throughput::Elements(BATCH as u64));
    let body = Bytes::from(vec![7u8; 12]);
    let props = Properties::default();
    let mut buf = BytesMut::with_capacity(BATCH * 128);
    g.bench_function("12B", |b| {
        b.iter(|| {
            buf.clear();
            for tag in 1..=BATCH as u64 {
                codec::encode_deliver(&mut buf, 1, "amq.ctag-bench", tag, false, "", "bench");
                codec::encode_content(&mut buf, 1, &props, &body, FRAME_MAX);
            }
            black_box(buf.len())
        })
    });
    g.finish();
}

criterion_group!(benches, decode, encode);
criterion_main!(benches);
