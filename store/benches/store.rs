//! Store append and read costs (`cargo bench -p warren-store --bench store`): small bodies
//! inline in a queue's segment files, large ones in the shared body store. Writes go to
//! the OS buffer; fsync is off here because the group commit is measured end to end by
//! `warren bench`, not per append.

use bytes::Bytes;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use std::hint::black_box;
use std::path::PathBuf;
use std::sync::Arc;
use warren_core::ids::QueueId;
use warren_core::message::{Message, Properties};
use warren_core::store::Store;
use warren_store::{DiskConfig, DiskStore};

/// Messages appended (and then read) per iteration.
const BATCH: u64 = 1000;

fn open(tag: &str) -> (DiskStore, PathBuf) {
    let dir = std::env::temp_dir().join(format!("warren-store-bench-{tag}-{}", std::process::id()));
    // A previous run's leftovers would be recovered as messages; start empty.
    let _ = std::fs::remove_dir_all(&dir);
    let config = DiskConfig {
        fsync: false,
        ..DiskConfig::default()
    };
    let (store, _defs) =
        DiskStore::open(&dir, config, Box::new(|_, _| {})).expect("bench store opens");
    (store, dir)
}

fn message(size: usize) -> Arc<Message> {
    Arc::new(Message {
        exchange: "".into(),
        routing_key: "bench".into(),
        properties: Properties {
            delivery_mode: Some(2),
            ..Properties::default()
        },
        body: Bytes::from(vec![7u8; size]),
    })
}

fn append_read(c: &mut Criterion) {
    let mut g = c.benchmark_group("store");
    g.throughput(Throughput::Elements(BATCH));
    for size in [100usize, 5000] {
        let (mut store, dir) = open(&format!("{size}"));
        let q = QueueId(1);
        store.open_queue(q, "/", "bench", true);
        let msg = message(size);
        let mut seq = 0u64;
        g.bench_function(format!("append_{size}B"), |b| {
            b.iter(|| {
                for _ in 0..BATCH {
                    store.append(q, seq, &msg, None).expect("append");
                    seq += 1;
                }
                store.flush();
            })
        });
        let total = seq;
        let mut out = Vec::with_capacity(BATCH as usize);
        let mut from = 0u64;
        g.bench_function(format!("read_{size}B"), |b| {
            b.iter(|| {
                if from + BATCH > total {
                    from = 0;
                }
                out.clear();
                store.read(q, from, BATCH as usize, &mut out).expect("read");
                assert_eq!(out.len(), BATCH as usize);
                from += BATCH;
                black_box(out.len())
            })
        });
        drop(store);
        let _ = std::fs::remove_dir_all(&dir);
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20);
    targets = append_read
}
criterion_main!(benches);
