//! Topic routing with 1M bindings (`cargo bench -p warren-core --bench topic_routing`): the
//! trie must make a lookup cost depend on the key's depth, not on the number of bindings.

#[cfg(not(target_arch = "wasm32"))]
mod native {
    use criterion::{Criterion, Throughput};
    use std::hint::black_box;
    use warren_core::exchange::{Bindings, ExchangeKind};
    use warren_core::ids::{Destination, QueueId};
    use warren_core::message::FieldTable;

    const BINDINGS: u64 = 1_000_000;
    /// Keys routed per iteration.
    const KEYS: usize = 1000;

    /// `device.{site}.{id}` exact bindings, plus a few wildcard ones every lookup must visit.
    fn bindings() -> Bindings {
        let mut b = Bindings::new(ExchangeKind::Topic);
        let args = FieldTable::default();
        for i in 0..BINDINGS {
            let key = format!("device.{}.{}", i % 1000, i / 1000);
            b.add(Destination::Queue(QueueId(i % 10_000)), &key, &args);
        }
        b.add(Destination::Queue(QueueId(1_000_001)), "device.*.7", &args);
        b.add(Destination::Queue(QueueId(1_000_002)), "device.#", &args);
        b.add(Destination::Queue(QueueId(1_000_003)), "#.alarm", &args);
        b
    }

    pub fn route(c: &mut Criterion) {
        let b = bindings();
        let keys: Vec<String> = (0..KEYS as u64)
            .map(|i| {
                let n = i.wrapping_mul(7919) % BINDINGS;
                format!("device.{}.{}", n % 1000, n / 1000)
            })
            .collect();
        let mut g = c.benchmark_group("topic_route_1M_bindings");
        g.throughput(Throughput::Elements(KEYS as u64));
        let mut out = Vec::with_capacity(16);
        g.bench_function("exact_plus_wildcards", |bench| {
            bench.iter(|| {
                let mut matched = 0usize;
                for key in &keys {
                    out.clear();
                    b.route(key, None, &mut out);
                    matched += out.len();
                }
                // Each key matches its exact binding and `device.#`.
                assert!(matched >= 2 * KEYS);
                black_box(matched)
            })
        });
        g.finish();
    }
}

#[cfg(not(target_arch = "wasm32"))]
criterion::criterion_group! {
    name = benches;
    config = criterion::Criterion::default().sample_size(20);
    targets = native::route
}
#[cfg(not(target_arch = "wasm32"))]
criterion::criterion_main!(benches);

#[cfg(target_arch = "wasm32")]
fn main() {}
