//! The segment log and the shared store against an in-memory model: random appends, removals,
//! purges, reads and reopenings (recovery) must agree with a `BTreeMap`; a data file or shared
//! file cut at any byte of its last record recovers everything before it and nothing torn.

use bytes::Bytes;
use proptest::prelude::*;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use warren_core::message::{FieldTable, FieldValue, Message, Properties};
use warren_store::segment::{Body, ENTRIES, QueueLog};
use warren_store::shared::SharedStore;

fn temp_dir(tag: &str) -> PathBuf {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("warren-{tag}-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn message(id: u64, len: usize, persistent: bool) -> Message {
    let mut headers = FieldTable::new();
    headers.insert("id".into(), FieldValue::I64(id as i64));
    Message {
        exchange: "x".into(),
        routing_key: format!("k.{id}").into(),
        properties: Properties {
            delivery_mode: Some(if persistent { 2 } else { 1 }),
            headers: Some(headers),
            ..Default::default()
        },
        body: Bytes::from(vec![(id % 251) as u8; len]),
    }
}

/// The expiry the tests give message `seq` (some have none).
fn expiry_of(seq: u64) -> Option<u64> {
    (!seq.is_multiple_of(3)).then_some(seq * 1000)
}

fn read_all(log: &mut QueueLog, from: u64) -> Vec<(u64, Message)> {
    let mut out = Vec::new();
    log.read(from, usize::MAX, &mut out).expect("read");
    out.into_iter()
        .map(|b| match b.body {
            Body::Whole(m) => {
                assert_eq!(b.expires_at, expiry_of(b.seq), "expiry of {}", b.seq);
                (b.seq, *m)
            }
            Body::Shared(..) => panic!("no shared bodies in this test"),
        })
        .collect()
}

#[derive(Clone, Debug)]
enum LogOp {
    Append { gap: u8, len: u16, persistent: bool },
    Remove { which: u16 },
    RemoveFrom { which: u16 },
    Read { which: u16, max: u8 },
    Flush,
    Reopen,
}

fn log_op() -> impl Strategy<Value = LogOp> {
    prop_oneof![
        8 => (0u8..3, 0u16..300, prop::bool::weighted(0.8))
            .prop_map(|(gap, len, persistent)| LogOp::Append { gap, len, persistent }),
        4 => any::<u16>().prop_map(|which| LogOp::Remove { which }),
        1 => any::<u16>().prop_map(|which| LogOp::RemoveFrom { which }),
        2 => (any::<u16>(), 1u8..20).prop_map(|(which, max)| LogOp::Read { which, max }),
        1 => Just(LogOp::Flush),
        1 => Just(LogOp::Reopen),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn segment_log_matches_a_model(ops in prop::collection::vec(log_op(), 1..200), jump in 0u64..3) {
        let dir = temp_dir("seg");
        let (mut log, _) = QueueLog::open(&dir, usize::MAX, None).expect("open");
        let mut model: BTreeMap<u64, Message> = BTreeMap::new();
        // Start near a segment boundary sometimes, so runs cross segments.
        let mut next = jump * (ENTRIES - 3);
        for op in ops {
            match op {
                LogOp::Append { gap, len, persistent } => {
                    next += u64::from(gap);
                    let m = message(next, usize::from(len), persistent);
                    log.append(next, &m, None, expiry_of(next)).expect("append");
                    model.insert(next, m);
                    next += 1;
                }
                LogOp::Remove { which } => {
                    if model.is_empty() { continue; }
                    let seq = *model.keys().nth(usize::from(which) % model.len()).expect("key");
                    log.remove(seq).expect("remove");
                    model.remove(&seq);
                }
                LogOp::RemoveFrom { which } => {
                    if model.is_empty() { continue; }
                    let seq = *model.keys().nth(usize::from(which) % model.len()).expect("key");
                    log.remove_from(seq).expect("remove_from");
                    model.split_off(&seq);
                }
                LogOp::Read { which, max } => {
                    let from = if model.is_empty() { 0 } else {
                        *model.keys().nth(usize::from(which) % model.len()).expect("key")
                    };
                    let mut out = Vec::new();
                    log.read(from, usize::from(max), &mut out).expect("read");
                    let got: Vec<u64> = out.iter().map(|b| b.seq).collect();
                    let want: Vec<u64> = model.range(from..).take(usize::from(max)).map(|(s, _)| *s).collect();
                    prop_assert_eq!(got, want);
                }
                LogOp::Flush => log.flush().expect("flush"),
                LogOp::Reopen => {
                    log.flush().expect("flush");
                    drop(log);
                    let (reopened, r) = QueueLog::open(&dir, usize::MAX, None).expect("reopen");
                    log = reopened;
                    // Transient entries do not survive a restart.
                    model.retain(|_, m| m.properties.is_persistent());
                    prop_assert_eq!(r.count, model.len() as u64);
                    prop_assert_eq!(r.first_seq, model.keys().next().copied().unwrap_or(0));
                    prop_assert_eq!(r.bytes, model.values().map(|m| m.body.len() as u64).sum::<u64>());
                    if let Some(last) = model.keys().next_back() {
                        prop_assert!(r.next_seq > *last);
                        next = next.max(r.next_seq);
                    }
                }
            }
        }
        let all = read_all(&mut log, 0);
        let want: Vec<(u64, Message)> = model.into_iter().collect();
        prop_assert_eq!(all, want);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// Writes `n` persistent messages, then cuts the data file at every byte offset of the last
/// record: recovery keeps the first n - 1 intact and drops the torn one, and never fails.
#[test]
fn a_data_file_cut_anywhere_in_its_last_record_recovers_the_rest() {
    let dir = temp_dir("torn");
    let n = 5u64;
    let (mut log, _) = QueueLog::open(&dir, usize::MAX, None).expect("open");
    for seq in 0..n {
        log.append(seq, &message(seq, 40, true), None, expiry_of(seq))
            .expect("append");
    }
    log.flush().expect("flush");
    drop(log);
    let data = dir.join(format!("{:016x}.qd", 0));
    let full = std::fs::read(&data).expect("data file");
    let index = std::fs::read(dir.join(format!("{:016x}.qi", 0))).expect("index file");
    // Equal-sized records after the 16-byte header.
    let record = (full.len() - 16) / n as usize;
    let last_start = full.len() - record;
    let mut checked = 0;
    for cut in last_start..full.len() {
        std::fs::write(&data, &full[..cut]).expect("cut");
        std::fs::write(dir.join(format!("{:016x}.qi", 0)), &index).expect("restore index");
        let (mut log, r) = QueueLog::open(&dir, usize::MAX, None).expect("recovery never fails");
        let got = read_all(&mut log, 0);
        let seqs: Vec<u64> = got.iter().map(|(s, _)| *s).collect();
        assert_eq!(seqs, (0..n - 1).collect::<Vec<_>>(), "cut at {cut}");
        assert_eq!(r.count, seqs.len() as u64);
        for (seq, m) in got {
            assert_eq!(m, message(seq, 40, true), "record {seq} intact");
        }
        // The torn tail was truncated: the file ends at the last good record.
        assert!(std::fs::metadata(&data).expect("data").len() <= cut as u64);
        checked += 1;
    }
    assert_eq!(checked, record);
    // A flipped byte inside the last record is caught by its checksum too.
    let mut flipped = full.clone();
    let at = full.len() - 3;
    flipped[at] ^= 0xff;
    std::fs::write(&data, &flipped).expect("flip");
    std::fs::write(dir.join(format!("{:016x}.qi", 0)), &index).expect("restore index");
    let (mut log, r) = QueueLog::open(&dir, usize::MAX, None).expect("recovery never fails");
    assert_eq!(r.count, n - 1);
    assert_eq!(read_all(&mut log, 0).len() as u64, n - 1);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The shared store cut at every byte of its last record: earlier bodies stay readable, the
/// torn one is gone, and opening never fails.
#[test]
fn a_shared_file_cut_anywhere_in_its_last_record_recovers_the_rest() {
    let dir = temp_dir("shared-torn");
    let mut ids = Vec::new();
    {
        let mut s = SharedStore::open(&dir).expect("open");
        s.take_sync().expect("end recovery");
        for i in 0..4u64 {
            ids.push(s.put(&Arc::new(message(i, 5000, true))).expect("put"));
        }
        s.take_sync().expect("sync");
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("dir")
        .map(|e| e.expect("entry").path())
        .collect();
    files.sort();
    let file = files
        .iter()
        .find(|p| std::fs::metadata(p).map(|m| m.len() > 16).unwrap_or(false))
        .expect("a file with records")
        .clone();
    let full = std::fs::read(&file).expect("read");
    let last_start = full.len() - (8 + 8 + 5000);
    for cut in last_start..full.len() {
        // Remove files newer than ours (opening creates a fresh current file each time).
        for p in std::fs::read_dir(&dir)
            .expect("dir")
            .map(|e| e.expect("entry").path())
        {
            if p != file {
                std::fs::remove_file(p).expect("remove");
            }
        }
        std::fs::write(&file, &full[..cut]).expect("cut");
        let mut s = SharedStore::open(&dir).expect("recovery never fails");
        for (i, &id) in ids.iter().enumerate().take(3) {
            s.add_ref(id);
            assert_eq!(
                s.read(id).expect("intact").len(),
                5000,
                "body {i} at cut {cut}"
            );
        }
        assert!(!s.add_ref(ids[3]), "torn body {} gone at cut {cut}", ids[3]);
    }
    let _ = std::fs::remove_dir_all(&dir);
}
