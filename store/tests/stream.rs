//! The stream log (`warren_store::stream`): appends, group commit, segment rolls, retention,
//! recovery of torn tails, offset specifications, read-ahead, tracking state; and a property
//! test against a `Vec` of every message appended.

use bytes::Bytes;
use proptest::prelude::*;
use std::fs::{self, OpenOptions};
use std::path::{Path, PathBuf};
use warren_store::stream::{
    Bounds, ChunkData, OffsetSpec, ReadChunk, ReaderOptions, StreamConfig, StreamError, StreamLog,
};

fn temp_dir(tag: &str) -> PathBuf {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("warren-stream-{tag}-{}-{n}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    dir
}

fn config() -> StreamConfig {
    StreamConfig {
        // Tests run many reopenings; the data is in the page cache either way.
        fsync: false,
        ..StreamConfig::default()
    }
}

/// [`config`] with fsync on: for the tests of group commit pacing.
fn fsynced() -> StreamConfig {
    StreamConfig {
        fsync: true,
        ..config()
    }
}

fn msg(offset: u64, len: usize) -> Vec<u8> {
    let mut m = offset.to_le_bytes().to_vec();
    m.resize(len.max(8), (offset % 251) as u8);
    m
}

fn opts(read_ahead: usize) -> ReaderOptions {
    ReaderOptions {
        read_ahead,
        ranges_from: None,
    }
}

/// Every message (offset, bytes) a reader returns until it catches up, and its chunks.
fn read_all(log: &mut StreamLog, spec: OffsetSpec, o: ReaderOptions) -> Vec<(u64, Vec<u8>)> {
    let mut r = log.reader(spec, o).expect("reader");
    let mut out = Vec::new();
    while let Some(c) = r.next_chunk().expect("chunk") {
        out.extend(chunk_messages(&c));
    }
    out
}

fn chunk_messages(c: &ReadChunk) -> Vec<(u64, Vec<u8>)> {
    let data = c.bytes().expect("bytes");
    let ms: Vec<Bytes> = ReadChunk::messages(&data)
        .collect::<Result<_, _>>()
        .expect("messages");
    assert_eq!(ms.len() as u32, c.count);
    assert_eq!(u32::from(c.entries), c.count);
    ms.into_iter()
        .enumerate()
        .map(|(i, m)| (c.first_offset + i as u64, m.to_vec()))
        .collect()
}

fn segment_files(dir: &Path, ext: &str) -> Vec<PathBuf> {
    let mut v: Vec<_> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == ext))
        .collect();
    v.sort();
    v
}

#[test]
fn appends_are_dense_offsets_visible_after_sync_and_read_back_with_and_without_read_ahead() {
    let dir = temp_dir("basic");
    let mut log = StreamLog::open(&dir, config()).unwrap();
    assert_eq!(log.sync().unwrap(), None);
    let r = log.append(&[msg(0, 10), msg(1, 20)], 100, &[]).unwrap();
    assert_eq!(r, 0..2);
    // Not synced: readers see nothing yet.
    assert!(read_all(&mut log, OffsetSpec::First, opts(4096)).is_empty());
    assert_eq!(log.append(&[msg(2, 5)], 101, &[]).unwrap(), 2..3);
    assert_eq!(log.sync().unwrap(), Some(2));
    let want: Vec<_> = [(0, 10), (1, 20), (2, 5)]
        .iter()
        .map(|&(o, l)| (o, msg(o, l)))
        .collect();
    assert_eq!(read_all(&mut log, OffsetSpec::First, opts(4096)), want);
    assert_eq!(read_all(&mut log, OffsetSpec::First, opts(0)), want);
    assert_eq!(
        log.bounds(),
        Bounds {
            first: 0,
            next: 3,
            committed: 3
        }
    );
    drop(log);
    let mut log = StreamLog::open(&dir, config()).unwrap();
    assert_eq!(read_all(&mut log, OffsetSpec::First, opts(4096)), want);
    assert_eq!(log.append(&[msg(3, 1)], 102, &[]).unwrap(), 3..4);
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_reader_follows_new_chunks_and_segment_rolls() {
    let dir = temp_dir("follow");
    let mut log = StreamLog::open(
        &dir,
        // With fsync (the default): syncs, rolls and new directory entries fsynced.
        StreamConfig {
            max_segment_size_bytes: 600,
            ..StreamConfig::default()
        },
    )
    .unwrap();
    let mut r = log.reader(OffsetSpec::Next, opts(4096)).unwrap();
    assert!(r.next_chunk().unwrap().is_none());
    let mut got = Vec::new();
    for o in 0..40u64 {
        log.append(&[msg(o, 50)], o, &[]).unwrap();
        if o % 3 == 0 {
            log.sync().unwrap();
            while let Some(c) = r.next_chunk().unwrap() {
                got.extend(chunk_messages(&c));
            }
        }
    }
    log.sync().unwrap();
    while let Some(c) = r.next_chunk().unwrap() {
        got.extend(chunk_messages(&c));
    }
    assert!(log.segment_count() > 5, "{}", log.segment_count());
    let want: Vec<_> = (0..40).map(|o| (o, msg(o, 50))).collect();
    assert_eq!(got, want);
    fs::remove_dir_all(&dir).unwrap();
}

/// Writes 6 chunks, then for every byte position inside the last chunk (cut there) and a
/// flipped byte at each position (corrupt), reopens: exactly the 5 whole chunks remain and
/// appends continue at offset 5's successor.
#[test]
fn a_torn_or_corrupt_last_chunk_is_cut_at_every_byte_and_appends_continue() {
    let base = temp_dir("torn-base");
    let mut log = StreamLog::open(&base, config()).unwrap();
    for o in 0..6u64 {
        log.append(&[msg(o * 2, 9), msg(o * 2 + 1, 30)], o, &[("p", o)])
            .unwrap();
    }
    log.sync().unwrap();
    drop(log);
    let data = segment_files(&base, "sd").pop().unwrap();
    let bytes = fs::read(&data).unwrap();
    let chunk = 48 + (4 + 9) + (4 + 30) + (1 + 2 + 1 + 8);
    let last_start = bytes.len() - chunk;
    let want: Vec<_> = (0..10)
        .map(|o| (o, msg(o, if o % 2 == 0 { 9 } else { 30 })))
        .collect();
    for (i, cut) in (last_start..bytes.len()).enumerate() {
        for corrupt in [false, true] {
            let dir = temp_dir("torn");
            fs::create_dir_all(&dir).unwrap();
            for f in fs::read_dir(&base).unwrap() {
                let f = f.unwrap().path();
                fs::copy(&f, dir.join(f.file_name().unwrap())).unwrap();
            }
            let d = dir.join(data.file_name().unwrap());
            if corrupt {
                let mut b = bytes.clone();
                b[cut] ^= 0x5a;
                fs::write(&d, b).unwrap();
            } else {
                OpenOptions::new()
                    .write(true)
                    .open(&d)
                    .unwrap()
                    .set_len(cut as u64)
                    .unwrap();
            }
            // Every other case without the index too: it is rebuilt from the segment.
            if i % 2 == 0 {
                for idx in segment_files(&dir, "si") {
                    fs::remove_file(idx).unwrap();
                }
            }
            let mut log = StreamLog::open(&dir, config()).unwrap();
            assert_eq!(log.bounds().next, 10, "cut {cut} corrupt {corrupt}");
            assert_eq!(fs::metadata(&d).unwrap().len(), last_start as u64);
            assert_eq!(read_all(&mut log, OffsetSpec::First, opts(4096)), want);
            assert_eq!(read_all(&mut log, OffsetSpec::First, opts(0)), want);
            // The trailer of the cut chunk is gone with it.
            assert_eq!(log.publisher_sequence("p"), Some(4));
            assert_eq!(log.append(&[msg(10, 3)], 9, &[]).unwrap(), 10..11);
            log.sync().unwrap();
            assert_eq!(
                read_all(&mut log, OffsetSpec::Offset(10), opts(4096)),
                vec![(10, msg(10, 3))]
            );
            drop(log);
            fs::remove_dir_all(&dir).unwrap();
        }
    }
    fs::remove_dir_all(&base).unwrap();
}

#[test]
fn an_index_behind_ahead_or_garbled_is_rebuilt_and_seeks_still_work() {
    let dir = temp_dir("index");
    let mut log = StreamLog::open(&dir, config()).unwrap();
    for o in 0..50u64 {
        log.append(&[msg(o, 20)], 1000 + o * 10, &[]).unwrap();
    }
    log.sync().unwrap();
    drop(log);
    let idx = segment_files(&dir, "si").pop().unwrap();
    let full = fs::read(&idx).unwrap();
    let check = |dir: &Path| {
        let mut log = StreamLog::open(dir, config()).unwrap();
        assert_eq!(log.bounds().next, 50);
        assert_eq!(
            read_all(&mut log, OffsetSpec::Offset(37), opts(4096))[0].0,
            37
        );
        assert_eq!(
            read_all(&mut log, OffsetSpec::Timestamp(1205), opts(4096))[0].0,
            21
        );
        assert_eq!(
            fs::read(segment_files(dir, "si").pop().unwrap()).unwrap(),
            full
        );
    };
    // Behind (cut mid-entry), ahead (an entry past the data), garbled (a byte flipped).
    fs::write(&idx, &full[..full.len() - 32 * 7 - 5]).unwrap();
    check(&dir);
    let mut ahead = full.clone();
    ahead.extend_from_slice(&full[full.len() - 32..]);
    fs::write(&idx, &ahead).unwrap();
    check(&dir);
    let mut garbled = full.clone();
    garbled[24 + 32 * 10 + 3] ^= 1;
    fs::write(&idx, &garbled).unwrap();
    check(&dir);
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn read_ahead_serves_many_small_chunks_per_syscall() {
    let dir = temp_dir("readahead");
    let mut log = StreamLog::open(&dir, config()).unwrap();
    let n = 2000u64;
    for o in 0..n {
        log.append(&[msg(o, 12)], o, &[]).unwrap();
    }
    log.sync().unwrap();
    let count = |log: &mut StreamLog, read_ahead| {
        let mut r = log.reader(OffsetSpec::First, opts(read_ahead)).unwrap();
        let mut chunks = 0;
        while let Some(c) = r.next_chunk().unwrap() {
            assert_eq!(
                chunk_messages(&c),
                vec![(c.first_offset, msg(c.first_offset, 12))]
            );
            chunks += 1;
        }
        assert_eq!(chunks, n);
        r.syscalls()
    };
    let off = count(&mut log, 0);
    let on = count(&mut log, 4096);
    // Off: a header read and a data read per chunk. On: one 4096-byte read per ~64 chunks
    // of 64 bytes.
    assert!(off >= 2 * n, "off {off}");
    assert!(on * 20 < n, "on {on} for {n} chunks");
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn large_chunks_are_read_in_one_call_each_without_reading_ahead_past_them() {
    // RabbitMQ 4.2 reads ahead after a small chunk only: reading `read_ahead` bytes past every
    // 16 KiB chunk read each chunk's first 4 KiB twice.
    let dir = temp_dir("large");
    let mut log = StreamLog::open(&dir, config()).unwrap();
    let (n, size) = (50u64, 16 * 1024);
    for o in 0..n {
        log.append(&[msg(o, size)], o, &[]).unwrap();
    }
    log.sync().unwrap();
    let file_len: u64 = segment_files(&dir, "sd")
        .iter()
        .map(|p| fs::metadata(p).unwrap().len())
        .sum();
    let read = |log: &mut StreamLog, read_ahead| {
        let mut r = log.reader(OffsetSpec::First, opts(read_ahead)).unwrap();
        let mut o = 0;
        while let Some(c) = r.next_chunk().unwrap() {
            assert_eq!(chunk_messages(&c), vec![(o, msg(o, size))]);
            o += 1;
        }
        assert_eq!(o, n);
        (r.syscalls(), r.bytes_read())
    };
    let (off_calls, off_bytes) = read(&mut log, 0);
    let (on_calls, on_bytes) = read(&mut log, 4096);
    // Off: a header read and a data read per chunk. On: one read per chunk (the chunk and
    // the next header), and the file's bytes about once (the first header read's 4096
    // bytes aside).
    assert!(off_calls >= 2 * n, "off {off_calls}");
    assert!(on_calls <= n + 2, "on {on_calls} for {n} chunks");
    assert!(off_bytes <= file_len, "off read {off_bytes} of {file_len}");
    assert!(
        on_bytes <= file_len + 4096 + n * 64,
        "on read {on_bytes} of {file_len}"
    );
    // A small chunk after the large ones is read ahead again.
    for o in n..n + 100 {
        log.append(&[msg(o, 12)], o, &[]).unwrap();
    }
    log.sync().unwrap();
    let mut r = log.reader(OffsetSpec::Offset(n), opts(4096)).unwrap();
    let mut got = 0;
    while let Some(c) = r.next_chunk().unwrap() {
        got += u64::from(c.first_offset >= n);
    }
    assert_eq!(got, 100);
    assert!(
        r.syscalls() <= 5,
        "{} calls for 100 small chunks",
        r.syscalls()
    );
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn large_chunks_come_as_file_ranges_small_ones_in_memory() {
    let dir = temp_dir("ranges");
    let mut log = StreamLog::open(&dir, config()).unwrap();
    log.append(&[msg(0, 10)], 1, &[]).unwrap();
    log.append(&[msg(1, 10_000), msg(2, 10)], 2, &[]).unwrap();
    log.append(&[msg(3, 10)], 3, &[]).unwrap();
    log.sync().unwrap();
    let mut r = log
        .reader(
            OffsetSpec::First,
            ReaderOptions {
                read_ahead: 4096,
                ranges_from: Some(0),
            },
        )
        .unwrap();
    let a = r.next_chunk().unwrap().unwrap();
    assert!(matches!(a.data, ChunkData::Bytes(_)));
    let b = r.next_chunk().unwrap().unwrap();
    let ChunkData::File { offset, len, .. } = &b.data else {
        panic!("a 10 kB chunk in memory");
    };
    assert_eq!(*len as usize, 4 + 10_000 + 4 + 10);
    assert_eq!(b.data_len(), *len);
    // The range is the message section as it is on disk: what sendfile would send.
    let file = fs::read(segment_files(&dir, "sd").pop().unwrap()).unwrap();
    let on_disk = &file[*offset as usize..*offset as usize + *len as usize];
    assert_eq!(crc32fast::hash(on_disk), b.data_crc);
    assert_eq!(
        chunk_messages(&b),
        vec![(1, msg(1, 10_000)), (2, msg(2, 10))]
    );
    let c = r.next_chunk().unwrap().unwrap();
    assert_eq!(c.first_offset, 3);
    assert!(r.next_chunk().unwrap().is_none());
    // Below `ranges_from` a chunk comes in memory, read-ahead or not.
    let mut r = log
        .reader(
            OffsetSpec::Offset(1),
            ReaderOptions {
                read_ahead: 0,
                ranges_from: Some(20_000),
            },
        )
        .unwrap();
    let b = r.next_chunk().unwrap().unwrap();
    assert_eq!(b.first_offset, 1);
    assert!(matches!(b.data, ChunkData::Bytes(_)));
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn offset_specs_first_last_next_offset_timestamp_and_clamping() {
    let dir = temp_dir("specs");
    let mut log = StreamLog::open(
        &dir,
        StreamConfig {
            max_segment_size_bytes: 400,
            max_length_bytes: Some(1000),
            ..config()
        },
    )
    .unwrap();
    // Chunks of 3 messages, timestamps 10 apart.
    for c in 0..30u64 {
        let ms: Vec<_> = (0..3).map(|i| msg(c * 3 + i, 20)).collect();
        log.append(&ms, 1000 + c * 10, &[]).unwrap();
    }
    log.sync().unwrap();
    let b = log.bounds();
    assert!(
        b.first > 0 && b.first.is_multiple_of(3),
        "retention kept {b:?}"
    );
    assert_eq!(b.next, 90);
    let first_of = |log: &mut StreamLog, spec| read_all(log, spec, opts(4096)).first().map(|m| m.0);
    assert_eq!(first_of(&mut log, OffsetSpec::First), Some(b.first));
    assert_eq!(first_of(&mut log, OffsetSpec::Offset(0)), Some(b.first));
    assert_eq!(first_of(&mut log, OffsetSpec::Last), Some(87));
    assert_eq!(first_of(&mut log, OffsetSpec::Next), None);
    assert_eq!(first_of(&mut log, OffsetSpec::Offset(500)), None);
    // Whole chunks: offset 85 starts the chunk of 84..87.
    assert_eq!(first_of(&mut log, OffsetSpec::Offset(85)), Some(84));
    assert_eq!(
        log.reader(OffsetSpec::Offset(85), opts(0))
            .unwrap()
            .start_offset(),
        85
    );
    assert_eq!(first_of(&mut log, OffsetSpec::Timestamp(1255)), Some(78));
    assert_eq!(first_of(&mut log, OffsetSpec::Timestamp(1250)), Some(75));
    assert_eq!(first_of(&mut log, OffsetSpec::Timestamp(0)), Some(b.first));
    assert_eq!(first_of(&mut log, OffsetSpec::Timestamp(99_999)), None);
    // Next and Last readers see what comes after.
    let mut next = log.reader(OffsetSpec::Next, opts(4096)).unwrap();
    log.append(&[msg(90, 5)], 2000, &[]).unwrap();
    log.sync().unwrap();
    assert_eq!(next.next_chunk().unwrap().unwrap().first_offset, 90);
    assert_eq!(first_of(&mut log, OffsetSpec::Last), Some(90));
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn retention_deletes_whole_oldest_segments_never_the_active_one_and_offsets_are_not_reused() {
    let dir = temp_dir("retention");
    let cfg = StreamConfig {
        max_segment_size_bytes: 500,
        max_length_bytes: Some(1500),
        max_age_ms: Some(60_000),
        ..config()
    };
    let mut log = StreamLog::open(&dir, cfg.clone()).unwrap();
    for o in 0..100u64 {
        log.append(&[msg(o, 40)], o * 100, &[]).unwrap();
        // Evaluated at roll: never more than the limit plus the segment that just filled.
        assert!(log.size_bytes() <= 1500 + 500, "{}", log.size_bytes());
    }
    log.sync().unwrap();
    let b = log.bounds();
    assert!(b.first > 50, "{b:?}");
    // Every retained message is still there and whole.
    let got = read_all(&mut log, OffsetSpec::First, opts(4096));
    assert_eq!(got.first().map(|m| m.0), Some(b.first));
    assert_eq!(got.len() as u64, 100 - b.first);
    assert_eq!(segment_files(&dir, "sd").len(), log.segment_count());
    // By age, on demand: everything older than a minute at now, but never the active one.
    let r = log.retain(10_000_000).unwrap();
    assert!(r.segments >= 1);
    assert_eq!(log.segment_count(), 1);
    assert_eq!(log.bounds().next, 100);
    drop(log);
    let mut log = StreamLog::open(&dir, cfg).unwrap();
    assert_eq!(log.append(&[msg(100, 1)], 0, &[]).unwrap(), 100..101);
    log.sync().unwrap();
    assert_eq!(
        read_all(&mut log, OffsetSpec::Last, opts(0)),
        vec![(100, msg(100, 1))]
    );
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn publisher_sequences_and_consumer_offsets_survive_reopen_rolls_and_retention() {
    let dir = temp_dir("tracking");
    let cfg = StreamConfig {
        max_segment_size_bytes: 300,
        max_length_bytes: Some(600),
        ..config()
    };
    let mut log = StreamLog::open(&dir, cfg.clone()).unwrap();
    log.append(&[msg(0, 10)], 1, &[("pub-a", 7), ("pub-b", 1)])
        .unwrap();
    log.store_offsets(&[("app", 0)], 1).unwrap();
    for o in 1..60u64 {
        log.append(&[msg(o, 30)], 1 + o, &[("pub-b", o + 1)])
            .unwrap();
    }
    log.store_offsets(&[("app", 42), ("other", 3)], 70).unwrap();
    log.sync().unwrap();
    assert!(log.bounds().first > 0, "the first segments were deleted");
    drop(log);
    let mut log = StreamLog::open(&dir, cfg.clone()).unwrap();
    assert_eq!(log.publisher_sequence("pub-a"), Some(7));
    assert_eq!(log.publisher_sequence("pub-b"), Some(60));
    assert_eq!(log.publisher_sequence("nobody"), None);
    assert_eq!(log.consumer_offset("app"), Some(42));
    assert_eq!(log.consumer_offset("other"), Some(3));
    // Tracking chunks take no offsets.
    assert_eq!(log.bounds().next, 60);
    assert_eq!(
        read_all(&mut log, OffsetSpec::Last, opts(4096)),
        vec![(59, msg(59, 30))]
    );
    log.store_offsets(&[("app", 59)], 99).unwrap();
    log.sync().unwrap();
    drop(log);
    let log = StreamLog::open(&dir, cfg).unwrap();
    assert_eq!(log.consumer_offset("app"), Some(59));
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn tracked_names_are_bounded_oldest_update_replaced() {
    let dir = temp_dir("tracked-bound");
    let cfg = StreamConfig {
        max_tracked: 3,
        ..config()
    };
    let mut log = StreamLog::open(&dir, cfg.clone()).unwrap();
    for (i, name) in ["a", "b", "c", "d"].iter().enumerate() {
        log.store_offsets(&[(name, i as u64)], 0).unwrap();
    }
    log.sync().unwrap();
    drop(log);
    let log = StreamLog::open(&dir, cfg).unwrap();
    assert_eq!(log.consumer_offset("a"), None);
    assert_eq!(log.consumer_offset("d"), Some(3));
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_full_buffer_refuses_appends_until_flushed_and_bad_batches_are_refused() {
    let dir = temp_dir("backpressure");
    let mut log = StreamLog::open(
        &dir,
        StreamConfig {
            buffer_limit_bytes: 1000,
            ..config()
        },
    )
    .unwrap();
    log.append(&[msg(0, 500)], 0, &[]).unwrap();
    match log.append(&[msg(1, 500)], 0, &[]) {
        Err(StreamError::Backpressure { buffered, limit }) => {
            assert!(buffered > 500);
            assert_eq!(limit, 1000);
        }
        other => panic!("{other:?}"),
    }
    assert!(log.buffered_bytes() < 1000);
    log.flush().unwrap();
    assert_eq!(log.buffered_bytes(), 0);
    // An empty buffer takes a chunk over the limit (written out at the next flush).
    assert_eq!(log.append(&[msg(1, 5000)], 0, &[]).unwrap(), 1..2);
    assert_eq!(log.sync().unwrap(), Some(1));
    let empty: [&[u8]; 0] = [];
    assert!(matches!(
        log.append(&empty, 0, &[]),
        Err(StreamError::Invalid(_))
    ));
    assert!(matches!(
        log.append(&[b"x"], 0, &[("", 1)]),
        Err(StreamError::Invalid(_))
    ));
    let too_many = vec![&b""[..]; 65_536];
    assert!(matches!(
        log.append(&too_many, 0, &[]),
        Err(StreamError::Invalid(_))
    ));
    assert_eq!(log.bounds().next, 2);
    fs::remove_dir_all(&dir).unwrap();
}

/// One step of the property test.
#[derive(Clone, Debug)]
enum Op {
    Append(Vec<usize>),
    Sync,
    Reopen,
    /// The process dies: buffers not written out are lost (the log is leaked, not dropped).
    Crash,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => prop::collection::vec(prop_oneof![0usize..40, 2000usize..6000], 1..12).prop_map(Op::Append),
        2 => Just(Op::Sync),
        1 => Just(Op::Reopen),
        1 => Just(Op::Crash),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Random batches appended, synced, reopened (unsynced appends are written out at close,
    /// so they survive a clean reopen), crashed (synced ones survive) and read from random offsets, with and without
    /// read-ahead and ranges, give exactly the messages appended from there, in order.
    #[test]
    fn reads_from_any_offset_return_exactly_what_was_appended(
        ops in prop::collection::vec(op(), 1..40),
        starts in prop::collection::vec(0u64..400, 4),
        segment in 1_000u64..20_000,
    ) {
        let dir = temp_dir("prop");
        let cfg = StreamConfig { max_segment_size_bytes: segment, ..config() };
        let mut log = StreamLog::open(&dir, cfg.clone()).unwrap();
        let mut model: Vec<Vec<u8>> = Vec::new();
        let mut durable = 0u64;
        let mut ts = 0;
        for op in ops {
            match op {
                Op::Append(sizes) => {
                    let first = model.len() as u64;
                    let ms: Vec<_> = sizes.iter().enumerate().map(|(i, &l)| msg(first + i as u64, l)).collect();
                    ts += 1;
                    let r = log.append(&ms, ts, &[]).unwrap();
                    prop_assert_eq!(r, first..first + ms.len() as u64);
                    model.extend(ms);
                }
                Op::Sync => {
                    prop_assert_eq!(log.sync().unwrap(), (model.len() as u64).checked_sub(1));
                    durable = model.len() as u64;
                }
                Op::Reopen => {
                    drop(log);
                    log = StreamLog::open(&dir, cfg.clone()).unwrap();
                    durable = model.len() as u64;
                }
                Op::Crash => {
                    std::mem::forget(log);
                    log = StreamLog::open(&dir, cfg.clone()).unwrap();
                    // Everything synced survives; what was written out before the crash
                    // (at rolls, at full buffers) may too, whole chunks only.
                    let next = log.bounds().next;
                    prop_assert!(durable <= next && next <= model.len() as u64, "{} {} {}", durable, next, model.len());
                    model.truncate(next as usize);
                    durable = next;
                }
            }
        }
        log.sync().unwrap();
        let n = model.len() as u64;
        for (i, s) in starts.iter().enumerate() {
            let start = if n == 0 { 0 } else { s % (n + 1) };
            let o = ReaderOptions { read_ahead: [0, 64, 4096, 100_000][i], ranges_from: (i % 2 == 1).then_some(0) };
            let mut r = log.reader(OffsetSpec::Offset(start), o).unwrap();
            let mut got = Vec::new();
            let mut first = true;
            while let Some(c) = r.next_chunk().unwrap() {
                // Whole chunks: the first one holds `start`.
                if first {
                    prop_assert!(c.first_offset <= start && start < c.first_offset + u64::from(c.count));
                    first = false;
                }
                got.extend(chunk_messages(&c).into_iter().filter(|m| m.0 >= start));
            }
            let want: Vec<_> = (start..n).map(|o| (o, model[o as usize].clone())).collect();
            prop_assert_eq!(got, want);
        }
        drop(log);
        fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn timestamps_never_decrease_so_seeks_by_time_bisect() {
    let dir = temp_dir("clock");
    let mut log = StreamLog::open(&dir, config()).unwrap();
    for (o, ts) in [100u64, 300, 200, 400, 350, 500].iter().enumerate() {
        log.append(&[msg(o as u64, 8)], *ts, &[]).unwrap();
    }
    log.sync().unwrap();
    let mut r = log.reader(OffsetSpec::First, opts(4096)).unwrap();
    let mut stamps = Vec::new();
    while let Some(c) = r.next_chunk().unwrap() {
        stamps.push(c.timestamp);
    }
    // A caller's clock that steps back is raised to the previous chunk's time.
    assert_eq!(stamps, vec![100, 300, 300, 400, 400, 500]);
    let first = |log: &mut StreamLog, t| read_all(log, OffsetSpec::Timestamp(t), opts(0))[0].0;
    assert_eq!(first(&mut log, 250), 1);
    assert_eq!(first(&mut log, 400), 3);
    assert_eq!(first(&mut log, 401), 5);
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_crash_keeps_what_sync_returned_and_appends_resume_after_it() {
    let dir = temp_dir("crash");
    let mut log = StreamLog::open(&dir, StreamConfig::default()).unwrap();
    log.append(&[msg(0, 10), msg(1, 10)], 1, &[("p", 2)])
        .unwrap();
    assert_eq!(log.sync().unwrap(), Some(1));
    log.append(&[msg(2, 10)], 2, &[("p", 3)]).unwrap();
    log.store_offsets(&[("c", 1)], 2).unwrap();
    // Dies with the last append and the stored offset only in its buffer.
    std::mem::forget(log);
    let mut log = StreamLog::open(&dir, StreamConfig::default()).unwrap();
    assert_eq!(log.bounds().next, 2);
    assert_eq!(log.publisher_sequence("p"), Some(2));
    assert_eq!(log.consumer_offset("c"), None);
    assert_eq!(log.append(&[msg(2, 7)], 3, &[]).unwrap(), 2..3);
    log.sync().unwrap();
    let want = vec![(0, msg(0, 10)), (1, msg(1, 10)), (2, msg(2, 7))];
    assert_eq!(read_all(&mut log, OffsetSpec::First, opts(4096)), want);
    fs::remove_dir_all(&dir).unwrap();
}

/// A reader on another thread, polling while the writer appends, syncs and rolls, sees every
/// message once, in order (that unsynced chunks stay invisible is checked single-threaded
/// above, where it is deterministic).
#[test]
fn a_reader_on_another_thread_sees_only_committed_chunks_in_order() {
    let dir = temp_dir("threads");
    let mut log = StreamLog::open(
        &dir,
        StreamConfig {
            max_segment_size_bytes: 4000,
            ..config()
        },
    )
    .unwrap();
    let mut r = log.reader(OffsetSpec::First, opts(4096)).unwrap();
    let n = 3000u64;
    let reader = std::thread::spawn(move || {
        let mut got = Vec::new();
        // Bounded: a chunk that never becomes visible (or a writer that stopped) fails the
        // test naming how far the reader got, instead of spinning while join() waits.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while (got.len() as u64) < n {
            assert!(
                std::time::Instant::now() < deadline,
                "the reader saw {} of {n} messages within 60 s",
                got.len()
            );
            match r.next_chunk().unwrap() {
                Some(c) => got.extend(chunk_messages(&c)),
                None => std::thread::yield_now(),
            }
        }
        got
    });
    for o in 0..n {
        log.append(&[msg(o, 30)], o, &[]).unwrap();
        if o % 7 == 6 || o + 1 == n {
            log.sync().unwrap();
        }
    }
    let got = reader.join().unwrap();
    let want: Vec<_> = (0..n).map(|o| (o, msg(o, 30))).collect();
    assert_eq!(got, want);
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_split_sync_commits_only_what_was_flushed_at_its_begin_while_appends_go_on() {
    let dir = temp_dir("split-sync");
    let mut log = StreamLog::open(&dir, fsynced()).unwrap();
    log.append(&[msg(0, 10), msg(1, 10)], 100, &[]).unwrap();
    let pending = log.begin_sync().unwrap();
    assert_eq!(pending.next_offset(), 2);
    // Appended while the fsync runs: not covered by it, so not visible after it.
    log.append(&[msg(2, 10)], 101, &[]).unwrap();
    pending.wait().unwrap();
    assert_eq!(log.end_sync(&pending, Ok(())).unwrap(), Some(1));
    assert_eq!(log.bounds().committed, 2);
    assert_eq!(read_all(&mut log, OffsetSpec::First, opts(4096)).len(), 2);
    let pending = log.begin_sync().unwrap();
    pending.wait().unwrap();
    assert_eq!(log.end_sync(&pending, Ok(())).unwrap(), Some(2));
    assert_eq!(read_all(&mut log, OffsetSpec::First, opts(4096)).len(), 3);
    // A failed fsync fails the log: nothing more is accepted until it is reopened.
    log.append(&[msg(3, 10)], 102, &[]).unwrap();
    let pending = log.begin_sync().unwrap();
    let err = StreamError::Invalid("simulated fsync failure".into());
    assert!(log.end_sync(&pending, Err(err)).is_err());
    assert_eq!(log.bounds().committed, 3);
    assert!(matches!(
        log.append(&[msg(4, 10)], 103, &[]),
        Err(StreamError::Failed(_))
    ));
    drop(log);
    fs::remove_dir_all(&dir).unwrap();
}

/// Group commit pacing: a sync that begins while another one's fsync is still running
/// fsyncs too, even with nothing new written (the bytes are not durable until one
/// completes), and one that begins after a completed sync with nothing new written runs no
/// fsync at all (queued sync requests after a merged write cost no disk flush).
#[test]
fn a_sync_with_nothing_written_since_a_completed_one_runs_no_fsync() {
    let dir = temp_dir("no-empty-fsync");
    let mut log = StreamLog::open(&dir, fsynced()).unwrap();
    log.append_merged(&[msg(0, 10)], &[], 100, &[]).unwrap();
    let first = log.begin_sync().unwrap();
    assert!(first.fsyncs_data());
    let overlapping = log.begin_sync().unwrap();
    assert!(
        overlapping.fsyncs_data(),
        "the first fsync has not completed: its bytes are not durable yet"
    );
    first.wait().unwrap();
    log.end_sync(&first, Ok(())).unwrap();
    overlapping.wait().unwrap();
    log.end_sync(&overlapping, Ok(())).unwrap();
    let idle = log.begin_sync().unwrap();
    assert!(
        !idle.fsyncs_data(),
        "nothing written since a completed sync"
    );
    assert_eq!(log.end_sync(&idle, Ok(())).unwrap(), Some(0));
    log.append_merged(&[msg(1, 10)], &[], 101, &[]).unwrap();
    let next = log.begin_sync().unwrap();
    assert!(next.fsyncs_data(), "new bytes written");
    next.wait().unwrap();
    assert_eq!(log.end_sync(&next, Ok(())).unwrap(), Some(1));
    drop(log);
    fs::remove_dir_all(&dir).unwrap();
}

/// What the catalog's group commit skips its blocking thread for: a sync with no fsync to
/// run (`--fsync off`, or nothing new since a completed one) blocks nothing, and its
/// `end_sync` still commits what was written at its begin (confirms and readers go on).
#[test]
fn a_sync_with_no_fsync_to_run_blocks_nothing_and_still_commits() {
    let dir = temp_dir("no-blocking-sync");
    let mut log = StreamLog::open(&dir, config()).unwrap();
    log.append_merged(&[msg(0, 10), msg(1, 10)], &[], 100, &[])
        .unwrap();
    let pending = log.begin_sync().unwrap();
    assert!(!pending.blocks(), "fsync off: nothing to wait for");
    assert_eq!(pending.next_offset(), 2);
    assert_eq!(log.end_sync(&pending, Ok(())).unwrap(), Some(1));
    assert_eq!(read_all(&mut log, OffsetSpec::First, opts(4096)).len(), 2);
    drop(log);
    fs::remove_dir_all(&dir).unwrap();

    let dir = temp_dir("blocking-sync");
    let mut log = StreamLog::open(&dir, fsynced()).unwrap();
    log.append_merged(&[msg(0, 10)], &[], 100, &[]).unwrap();
    let first = log.begin_sync().unwrap();
    assert!(
        first.blocks(),
        "fsync on with bytes written: an fsync to run"
    );
    first.wait().unwrap();
    log.end_sync(&first, Ok(())).unwrap();
    let idle = log.begin_sync().unwrap();
    assert!(!idle.blocks(), "nothing written since a completed sync");
    assert_eq!(log.end_sync(&idle, Ok(())).unwrap(), Some(0));
    drop(log);
    fs::remove_dir_all(&dir).unwrap();
}

/// Retention deletes the segments a lagging reader is in or heading for: it goes on from the
/// oldest segment left (the messages in between are gone), whole chunks, in order.
#[test]
fn a_reader_behind_retention_continues_from_the_oldest_segment_left() {
    let dir = temp_dir("lagging");
    let mut log = StreamLog::open(
        &dir,
        StreamConfig {
            max_segment_size_bytes: 500,
            max_length_bytes: Some(1200),
            ..config()
        },
    )
    .unwrap();
    for o in 0..8u64 {
        log.append(&[msg(o, 40)], o, &[]).unwrap();
    }
    log.sync().unwrap();
    assert_eq!(log.bounds().first, 0);
    // One reader has its segment file open, one has not touched it yet.
    let mut open = log.reader(OffsetSpec::First, opts(0)).unwrap();
    assert_eq!(open.next_chunk().unwrap().unwrap().first_offset, 0);
    let mut lazy = log.reader(OffsetSpec::First, opts(4096)).unwrap();
    for o in 8..60u64 {
        log.append(&[msg(o, 40)], o, &[]).unwrap();
    }
    log.sync().unwrap();
    let first = log.bounds().first;
    assert!(first > 8, "{first}");
    for r in [&mut open, &mut lazy] {
        let mut got = Vec::new();
        while let Some(c) = r.next_chunk().unwrap() {
            got.extend(chunk_messages(&c).into_iter().map(|m| m.0));
        }
        // Whatever was still readable (an open file outlives its unlink), then from the
        // oldest retained segment on, without gaps.
        let resumed = got
            .iter()
            .position(|&o| o == first)
            .expect("oldest retained read");
        assert_eq!(got[resumed..], (first..60).collect::<Vec<_>>()[..]);
        assert!(got[..resumed].windows(2).all(|w| w[0] + 1 == w[1]));
    }
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn an_older_segments_missing_or_short_index_is_rebuilt() {
    let dir = temp_dir("old-index");
    let cfg = StreamConfig {
        max_segment_size_bytes: 400,
        ..config()
    };
    let mut log = StreamLog::open(&dir, cfg.clone()).unwrap();
    for o in 0..30u64 {
        log.append(&[msg(o, 40)], 100 + o, &[]).unwrap();
    }
    log.sync().unwrap();
    drop(log);
    let indexes = segment_files(&dir, "si");
    assert!(indexes.len() >= 4);
    let whole: Vec<_> = indexes.iter().map(|p| fs::read(p).unwrap()).collect();
    fs::remove_file(&indexes[1]).unwrap();
    let short = &whole[2][..whole[2].len() - 32];
    fs::write(&indexes[2], short).unwrap();
    let mut log = StreamLog::open(&dir, cfg).unwrap();
    for (p, w) in indexes.iter().zip(&whole) {
        assert_eq!(&fs::read(p).unwrap(), w, "{}", p.display());
    }
    for o in 0..30 {
        assert_eq!(read_all(&mut log, OffsetSpec::Offset(o), opts(0))[0].0, o);
        assert_eq!(
            read_all(&mut log, OffsetSpec::Timestamp(100 + o), opts(64))[0].0,
            o
        );
    }
    fs::remove_dir_all(&dir).unwrap();
}

/// Stream filtering: chunks appended with filter values carry a Bloom filter in their
/// trailer; a filtered reader gets the chunks that may hold its values (or, with
/// match-unfiltered, messages without one), an unfiltered reader everything, with and without
/// read-ahead, and after a reopen (replay skips the filter entries; publisher sequences in
/// the same trailer survive).
#[test]
fn filtered_readers_skip_chunks_without_their_values() {
    use warren_store::stream::bloom::ChunkFilter;
    let dir = temp_dir("filter");
    let mut log = StreamLog::open(&dir, config()).unwrap();
    // Chunk 0: red x2; chunk 1: blue + unfiltered; chunk 2: unfiltered only; chunk 3: green,
    // with a publisher sequence in the same trailer.
    type Chunk<'a> = (&'a [Option<&'a str>], &'a [(&'a str, u64)]);
    let chunks: [Chunk; 4] = [
        (&[Some("red"), Some("red")], &[]),
        (&[Some("blue"), None], &[]),
        (&[None], &[]),
        (&[Some("green")], &[("p", 7)]),
    ];
    let mut next = 0;
    for (values, publishers) in chunks {
        let ms: Vec<Vec<u8>> = (0..values.len())
            .map(|i| msg(next + i as u64, 10))
            .collect();
        log.append_filtered(&ms, values, 1, publishers).unwrap();
        next += values.len() as u64;
    }
    log.sync().unwrap();
    let firsts = |log: &mut StreamLog, f: Option<ChunkFilter>, read_ahead: usize| {
        let mut r = log.reader(OffsetSpec::First, opts(read_ahead)).unwrap();
        r.set_filter(f);
        let mut out = Vec::new();
        while let Some(c) = r.next_chunk().unwrap() {
            out.push(c.first_offset);
        }
        out
    };
    let f = |v: &[&str], u: bool| {
        Some(ChunkFilter {
            values: v.iter().map(|s| s.to_string()).collect(),
            match_unfiltered: u,
        })
    };
    for round in 0..2 {
        for ra in [0, 4096] {
            assert_eq!(firsts(&mut log, None, ra), [0, 2, 4, 5], "round {round}");
            assert_eq!(firsts(&mut log, f(&["red"], false), ra), [0]);
            assert_eq!(firsts(&mut log, f(&["blue", "green"], false), ra), [2, 5]);
            assert_eq!(firsts(&mut log, f(&["nope"], true), ra), [2, 4]);
            assert_eq!(firsts(&mut log, f(&["nope"], false), ra), Vec::<u64>::new());
        }
        assert_eq!(log.publisher_sequence("p"), Some(7));
        drop(log);
        log = StreamLog::open(&dir, config()).unwrap();
    }
    let _ = fs::remove_dir_all(&dir);
}

/// First offset and message count of every committed chunk.
fn chunk_shapes(log: &mut StreamLog) -> Vec<(u64, u32)> {
    let mut r = log.reader(OffsetSpec::First, opts(4096)).unwrap();
    let mut out = Vec::new();
    while let Some(c) = r.next_chunk().unwrap() {
        out.push((c.first_offset, c.count));
    }
    out
}

#[test]
fn merged_batches_become_one_chunk_per_write_and_one_batch_per_write_keeps_its_chunk() {
    let dir = temp_dir("merged");
    let mut log = StreamLog::open(&dir, config()).unwrap();
    // Three batches staged between two writes: one chunk, dense offsets per batch.
    assert_eq!(log.append_merged(&[msg(0, 9)], &[], 5, &[]).unwrap(), 0..1);
    assert_eq!(
        log.append_merged(&[msg(1, 9), msg(2, 9)], &[], 7, &[])
            .unwrap(),
        1..3
    );
    assert_eq!(log.append_merged(&[msg(3, 9)], &[], 6, &[]).unwrap(), 3..4);
    assert_eq!(log.bounds().next, 4, "staged offsets are taken");
    assert_eq!(log.bounds().committed, 0);
    assert!(
        chunk_shapes(&mut log).is_empty(),
        "nothing visible before the sync"
    );
    assert_eq!(log.sync().unwrap(), Some(3));
    assert_eq!(chunk_shapes(&mut log), [(0, 4)]);
    assert_eq!(log.last_chunk(), Some(0));
    // One batch per write (one batch in flight): the batch is the chunk, as seed 003 fills.
    for (first, n) in [(4u64, 64usize), (68, 1), (69, 8)] {
        let ms: Vec<_> = (first..first + n as u64).map(|o| msg(o, 9)).collect();
        log.append_merged(&ms, &[], 8, &[]).unwrap();
        log.sync().unwrap();
    }
    // An unmerged append and a tracking chunk seal what is staged first (offset order).
    log.append_merged(&[msg(77, 9)], &[], 9, &[]).unwrap();
    log.append(&[msg(78, 9), msg(79, 9)], 9, &[]).unwrap();
    log.append_merged(&[msg(80, 9)], &[], 9, &[]).unwrap();
    log.store_offsets(&[("c", 3)], 9).unwrap();
    log.append_merged(&[msg(81, 9)], &[], 9, &[]).unwrap();
    log.sync().unwrap();
    let want_shapes = [
        (0, 4),
        (4, 64),
        (68, 1),
        (69, 8),
        (77, 1),
        (78, 2),
        (80, 1),
        (81, 1),
    ];
    assert_eq!(chunk_shapes(&mut log), want_shapes);
    let want: Vec<_> = (0..82).map(|o| (o, msg(o, 9))).collect();
    assert_eq!(read_all(&mut log, OffsetSpec::First, opts(4096)), want);
    // The merged chunk's timestamp is its newest batch's; seeks by time still work.
    let mut r = log.reader(OffsetSpec::Timestamp(7), opts(0)).unwrap();
    assert_eq!(r.next_chunk().unwrap().unwrap().timestamp, 7);
    drop(log);
    let mut log = StreamLog::open(&dir, config()).unwrap();
    assert_eq!(chunk_shapes(&mut log), want_shapes);
    assert_eq!(log.consumer_offset("c"), Some(3));
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_merged_chunk_is_bounded_by_messages_and_bytes_and_a_batch_is_never_split() {
    let dir = temp_dir("merged-bounds");
    let mut log = StreamLog::open(
        &dir,
        StreamConfig {
            buffer_limit_bytes: 1000,
            ..config()
        },
    )
    .unwrap();
    // 100-byte messages (104 bytes each in the chunk): a chunk stops below 1000 bytes.
    let mut next = 0u64;
    for n in [3usize, 3, 3, 3] {
        let ms: Vec<_> = (next..next + n as u64).map(|o| msg(o, 100)).collect();
        match log.append_merged(&ms, &[], 1, &[]) {
            Err(StreamError::Backpressure { .. }) => {
                log.flush().unwrap();
                log.append_merged(&ms, &[], 1, &[]).unwrap();
            }
            r => assert_eq!(r.unwrap(), next..next + n as u64),
        }
        next += n as u64;
    }
    log.sync().unwrap();
    let shapes = chunk_shapes(&mut log);
    assert_eq!(shapes.iter().map(|s| s.1).sum::<u32>(), 12);
    assert!(shapes.len() >= 2, "{shapes:?}");
    assert!(
        shapes.iter().all(|s| s.1 % 3 == 0),
        "batches whole: {shapes:?}"
    );
    let want: Vec<_> = (0..12).map(|o| (o, msg(o, 100))).collect();
    assert_eq!(read_all(&mut log, OffsetSpec::First, opts(4096)), want);
    drop(log);
    // By messages: MAX_CHUNK_MESSAGES per chunk.
    let dir2 = temp_dir("merged-count");
    let mut log = StreamLog::open(
        &dir2,
        StreamConfig {
            buffer_limit_bytes: 64 << 20,
            ..config()
        },
    )
    .unwrap();
    let max = warren_store::stream::format::MAX_CHUNK_MESSAGES;
    let batch: Vec<Vec<u8>> = vec![vec![1u8]; 1000];
    let batches = max / 1000 + 2;
    for _ in 0..batches {
        log.append_merged(&batch, &[], 1, &[]).unwrap();
    }
    log.sync().unwrap();
    let shapes = chunk_shapes(&mut log);
    assert_eq!(
        shapes.iter().map(|s| s.1 as usize).collect::<Vec<_>>(),
        [max / 1000 * 1000, (batches - max / 1000) * 1000]
    );
    fs::remove_dir_all(&dir).unwrap();
    fs::remove_dir_all(&dir2).unwrap();
}

#[test]
fn deduplication_sees_staged_batches_and_a_merged_chunk_keeps_each_publishers_highest_id() {
    let dir = temp_dir("merged-dedup");
    let mut log = StreamLog::open(&dir, StreamConfig::default()).unwrap();
    log.append_merged(&[msg(0, 9)], &[], 1, &[("a", 5)])
        .unwrap();
    log.append_merged(&[msg(1, 9)], &[], 1, &[("b", 2)])
        .unwrap();
    // Staged, not yet a chunk: a re-sent id must already be known.
    assert_eq!(log.publisher_sequence("a"), Some(5));
    log.append_merged(&[msg(2, 9)], &[], 1, &[("a", 9)])
        .unwrap();
    assert_eq!(log.publisher_sequence("a"), Some(9));
    assert_eq!(log.sync().unwrap(), Some(2));
    assert_eq!(chunk_shapes(&mut log), [(0, 3)]);
    // Staged but never synced (a crash): its ids are not kept, so re-sent they are stored.
    log.append_merged(&[msg(3, 9)], &[], 1, &[("a", 10), ("b", 3)])
        .unwrap();
    assert_eq!(log.publisher_sequence("a"), Some(10));
    std::mem::forget(log);
    let mut log = StreamLog::open(&dir, StreamConfig::default()).unwrap();
    assert_eq!(log.publisher_sequence("a"), Some(9));
    assert_eq!(log.publisher_sequence("b"), Some(2));
    assert_eq!(log.bounds().next, 3);
    assert_eq!(
        read_all(&mut log, OffsetSpec::First, opts(4096)),
        (0..3).map(|o| (o, msg(o, 9))).collect::<Vec<_>>()
    );
    // A segment roll while a chunk is staged: the snapshot (first chunk of the new segment)
    // must not claim the staged ids before their chunk.
    log.set_limits(None, None, Some(1));
    log.append_merged(&[msg(3, 9)], &[], 1, &[("a", 11)])
        .unwrap();
    log.sync().unwrap();
    log.append_merged(&[msg(4, 9)], &[], 1, &[("a", 12)])
        .unwrap();
    assert_eq!(log.segment_count(), 2, "rolled at the seal of chunk 3");
    std::mem::forget(log);
    let log = StreamLog::open(&dir, StreamConfig::default()).unwrap();
    assert_eq!(log.publisher_sequence("a"), Some(11));
    assert_eq!(log.bounds().next, 4);
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_merged_chunks_bloom_filter_holds_every_batchs_values() {
    use warren_store::stream::bloom::ChunkFilter;
    let dir = temp_dir("merged-filter");
    let mut log = StreamLog::open(&dir, config()).unwrap();
    // Chunk 0: red, then blue + unfiltered, merged; chunk 1: unfiltered only; chunk 2: green.
    log.append_merged(&[msg(0, 9)], &[Some("red")], 1, &[])
        .unwrap();
    log.append_merged(&[msg(1, 9), msg(2, 9)], &[Some("blue"), None], 1, &[])
        .unwrap();
    log.sync().unwrap();
    log.append_merged(&[msg(3, 9)], &[], 1, &[]).unwrap();
    log.sync().unwrap();
    log.append_merged(&[msg(4, 9)], &[Some("green")], 1, &[])
        .unwrap();
    log.sync().unwrap();
    let firsts = |log: &mut StreamLog, values: &[&str], u: bool| {
        let mut r = log.reader(OffsetSpec::First, opts(4096)).unwrap();
        r.set_filter(Some(ChunkFilter {
            values: values.iter().map(|s| s.to_string()).collect(),
            match_unfiltered: u,
        }));
        let mut out = Vec::new();
        while let Some(c) = r.next_chunk().unwrap() {
            out.push(c.first_offset);
        }
        out
    };
    assert_eq!(firsts(&mut log, &["red"], false), [0]);
    assert_eq!(
        firsts(&mut log, &["blue"], false),
        [0],
        "the second batch's value"
    );
    assert_eq!(
        firsts(&mut log, &["nope"], true),
        [0, 3],
        "its unfiltered message"
    );
    assert_eq!(firsts(&mut log, &["green"], false), [4]);
    assert!(firsts(&mut log, &["nope"], false).is_empty());
    fs::remove_dir_all(&dir).unwrap();
}
