//! Seed 003's experiment, storage half: fill a stream with N messages of 12, 256 and 1024
//! bytes in chunks of 1, 8 and 64 messages, then read everything from `first` with
//! read-ahead off and on (4096 bytes, RabbitMQ's), and print messages per second and the
//! `pread` calls made. `cargo bench -p warren-store --bench stream`; N from
//! `WARREN_STREAM_BENCH_N` (default 100,000: a few seconds in all); each read is the best of 3. Reads come from the page
//! cache (the files were just written), so this measures system calls and copying, as the
//! seed's does.

use std::time::Instant;
use warren_store::stream::{OffsetSpec, ReadChunk, ReaderOptions, StreamConfig, StreamLog};

fn main() {
    let n: u64 = std::env::var("WARREN_STREAM_BENCH_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000);
    group_commit();
    println!("stream read-ahead, {n} messages per stream, read from `first`");
    println!(
        "| msg bytes | chunk msgs | fill msg/s | off msg/s | off preads | on msg/s | on preads | on/off |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for size in [12usize, 256, 1024] {
        for chunk in [1usize, 8, 64] {
            let dir = std::env::temp_dir().join(format!(
                "warren-stream-bench-{size}-{chunk}-{}",
                std::process::id()
            ));
            let _ = std::fs::remove_dir_all(&dir);
            let config = StreamConfig {
                fsync: false,
                ..StreamConfig::default()
            };
            let mut log = StreamLog::open(&dir, config).expect("open");
            let body = vec![0x5au8; size];
            let batch: Vec<&[u8]> = vec![&body[..]; chunk];
            let started = Instant::now();
            let mut written = 0;
            while written < n {
                let k = chunk.min((n - written) as usize);
                match log.append(&batch[..k], written, &[]) {
                    Ok(r) => written = r.end,
                    Err(warren_store::stream::StreamError::Backpressure { .. }) => {
                        log.flush().expect("flush")
                    }
                    Err(e) => panic!("append: {e}"),
                }
            }
            log.sync().expect("sync");
            let fill = n as f64 / started.elapsed().as_secs_f64();
            let mut rates = Vec::new();
            for read_ahead in [0, 4096] {
                let mut best: Option<(f64, u64)> = None;
                for _ in 0..3 {
                    let options = ReaderOptions {
                        read_ahead,
                        ranges_from: None,
                    };
                    let mut r = log.reader(OffsetSpec::First, options).expect("reader");
                    let started = Instant::now();
                    let mut got = 0u64;
                    let mut bytes = 0usize;
                    while let Some(c) = r.next_chunk().expect("read") {
                        let data = c.bytes().expect("bytes");
                        for m in ReadChunk::messages(&data) {
                            bytes += m.expect("message").len();
                            got += 1;
                        }
                    }
                    assert_eq!(got, n);
                    assert_eq!(bytes, n as usize * size);
                    let rate = n as f64 / started.elapsed().as_secs_f64();
                    if best.is_none_or(|b| rate > b.0) {
                        best = Some((rate, r.syscalls()));
                    }
                }
                rates.extend(best);
            }
            println!(
                "| {size} | {chunk} | {:.0} | {:.0} | {} | {:.0} | {} | {:.1}x |",
                fill,
                rates[0].0,
                rates[0].1,
                rates[1].0,
                rates[1].1,
                rates[1].0 / rates[0].0
            );
            drop(log);
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
}

/// What a confirm costs at the storage level: append one 100-byte message and `sync` (one
/// fdatasync), 200 times; then 200 groups of 100 messages per sync (group commit).
fn group_commit() {
    let dir = std::env::temp_dir().join(format!("warren-stream-bench-sync-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut log = StreamLog::open(&dir, StreamConfig::default()).expect("open");
    let body = [7u8; 100];
    for per_sync in [1usize, 100] {
        let rounds = 200;
        let started = Instant::now();
        for i in 0..rounds {
            for _ in 0..per_sync {
                log.append(&[&body[..]], i as u64, &[]).expect("append");
            }
            log.sync().expect("sync");
        }
        let t = started.elapsed().as_secs_f64();
        println!(
            "append + fsync'd sync, {per_sync} message(s) per sync: {:.0} us per sync, {:.0} msg/s",
            t / rounds as f64 * 1e6,
            (rounds * per_sync) as f64 / t
        );
    }
    drop(log);
    let _ = std::fs::remove_dir_all(&dir);
}
