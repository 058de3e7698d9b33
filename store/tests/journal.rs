//! The write-ahead journal through the whole store: what a completed sync promised survives
//! the loss of every segment file write that was never fsynced (a power cut), a deleted and
//! re-declared queue does not get its old messages back from a replay, a torn journal tail is
//! ignored, and a checkpoint leaves one fresh generation and complete segment files.

use bytes::Bytes;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;
use warren_core::ids::QueueId;
use warren_core::message::{Message, Properties};
use warren_core::store::Store;
use warren_store::{DiskConfig, DiskStore};

fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("warren-journal-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn message(id: u64, len: usize) -> Arc<Message> {
    let mut body = id.to_le_bytes().to_vec();
    body.resize(len.max(8), (id % 251) as u8);
    Arc::new(Message {
        exchange: "".into(),
        routing_key: "q".into(),
        properties: Properties {
            delivery_mode: Some(2),
            ..Properties::default()
        },
        body: Bytes::from(body),
    })
}

struct Opened {
    store: DiskStore,
    synced: mpsc::Receiver<(u64, Result<(), warren_store::SyncError>)>,
}

fn open(dir: &Path, checkpoint_bytes: u64) -> Opened {
    let (tx, synced) = mpsc::channel();
    let tx = std::sync::Mutex::new(tx);
    let config = DiskConfig {
        journal_checkpoint_bytes: checkpoint_bytes,
        ..DiskConfig::default()
    };
    let (store, _) = DiskStore::open(
        dir,
        config,
        Box::new(move |epoch, result| {
            let _ = tx.lock().expect("lock").send((epoch, result));
        }),
    )
    .expect("store opens");
    Opened { store, synced }
}

impl Opened {
    /// Starts the sync of `epoch` and waits until the sync thread reports it.
    fn sync(&mut self, epoch: u64) {
        self.store.sync(epoch);
        let (got, result) = self
            .synced
            .recv_timeout(Duration::from_secs(30))
            .expect("the sync completes");
        assert_eq!(got, epoch);
        result.expect("the sync succeeds");
    }

    /// Appends one message per sequence number in `seqs`, the id being the sequence number.
    fn append(&mut self, queue: QueueId, seqs: std::ops::Range<u64>, len: usize) {
        for seq in seqs {
            self.store
                .append(queue, seq, &message(seq, len), None)
                .expect("append");
        }
    }

    fn ids(&mut self, queue: QueueId) -> Vec<u64> {
        let mut out = Vec::new();
        self.store
            .read(queue, 0, usize::MAX, &mut out)
            .expect("read");
        out.iter()
            .map(|m| {
                let mut id = [0u8; 8];
                id.copy_from_slice(&m.message.body[..8]);
                u64::from_le_bytes(id)
            })
            .collect()
    }
}

fn segment_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for q in std::fs::read_dir(dir.join("queues")).expect("queues dir") {
        let q = q.expect("entry").path();
        for f in std::fs::read_dir(&q).expect("queue dir") {
            let f = f.expect("entry").path();
            if matches!(f.extension().and_then(|e| e.to_str()), Some("qi" | "qd")) {
                out.push(f);
            }
        }
    }
    out
}

fn journal_generations(dir: &Path) -> usize {
    std::fs::read_dir(dir.join("journal"))
        .expect("journal dir")
        .filter(|e| {
            e.as_ref()
                .is_ok_and(|e| e.path().extension().is_some_and(|x| x == "wj"))
        })
        .count()
}

/// Where a generation's records end (the file is extended with zeros ahead of them).
fn records_end(path: &Path) -> u64 {
    let bytes = std::fs::read(path).expect("read the journal");
    let mut at = 16usize;
    while let Some(len) = bytes.get(at..at + 4) {
        let len = u32::from_le_bytes(len.try_into().expect("4 bytes")) as usize;
        if len == 0 {
            break;
        }
        at += 8 + len;
    }
    at as u64
}

const Q: QueueId = QueueId(7);

#[test]
fn synced_messages_survive_the_loss_of_unsynced_segment_writes() {
    let dir = temp_dir("power-cut");
    let mut s = open(&dir, 64 << 20);
    s.store.open_queue(Q, "/", "q", true);
    s.append(Q, 0..300, 100);
    // Acks are journalled too: they must not come back.
    for seq in 0..100 {
        s.store.remove(Q, seq);
    }
    s.sync(1);
    drop(s);
    // A power cut loses what the page cache held: the segment files were never fsynced.
    let files = segment_files(&dir);
    assert!(!files.is_empty());
    for f in files {
        std::fs::remove_file(f).expect("remove");
    }
    let mut s = open(&dir, 64 << 20);
    let r = s.store.open_queue(Q, "/", "q", true);
    assert_eq!(r.count, 200);
    assert_eq!(s.ids(Q), (100..300).collect::<Vec<_>>());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_replay_does_not_resurrect_a_deleted_queue_into_its_successor() {
    let dir = temp_dir("redeclare");
    let mut s = open(&dir, 64 << 20);
    s.store.open_queue(Q, "/", "q", true);
    s.append(Q, 0..50, 100);
    s.sync(1);
    s.store.delete_queue(Q);
    let q2 = QueueId(8);
    s.store.open_queue(q2, "/", "q", true);
    s.store
        .append(q2, 0, &message(1000, 100), None)
        .expect("append");
    s.sync(2);
    drop(s);
    let mut s = open(&dir, 64 << 20);
    let r = s.store.open_queue(q2, "/", "q", true);
    assert_eq!(r.count, 1);
    assert_eq!(s.ids(q2), vec![1000]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_torn_journal_tail_is_ignored() {
    let dir = temp_dir("torn");
    let mut s = open(&dir, 64 << 20);
    s.store.open_queue(Q, "/", "q", true);
    s.append(Q, 0..20, 100);
    s.sync(1);
    drop(s);
    // A record cut in the middle, as a crash during a write leaves it.
    let generation = std::fs::read_dir(dir.join("journal"))
        .expect("journal dir")
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "wj"))
        .expect("a generation");
    use std::os::unix::fs::FileExt;
    let end = records_end(&generation);
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&generation)
        .expect("open");
    f.write_all_at(&[200, 0, 0, 0, 1, 2, 3, 4, 1, 9], end)
        .expect("write");
    drop(f);
    for f in segment_files(&dir) {
        std::fs::remove_file(f).expect("remove");
    }
    let mut s = open(&dir, 64 << 20);
    assert_eq!(s.store.open_queue(Q, "/", "q", true).count, 20);
    assert_eq!(s.ids(Q), (0..20).collect::<Vec<_>>());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_checkpoint_makes_segment_files_durable_and_retires_the_generation() {
    let dir = temp_dir("checkpoint");
    // 64 KiB generations: a few hundred 1000-byte messages pass it.
    let mut s = open(&dir, 64 << 10);
    s.store.open_queue(Q, "/", "q", true);
    s.append(Q, 0..200, 1000);
    s.sync(1);
    // The checkpoint runs after epoch 1 is reported; epoch 2's sync waits for it.
    s.store
        .append(Q, 200, &message(200, 1000), None)
        .expect("append");
    s.sync(2);
    assert_eq!(journal_generations(&dir), 1, "the old generation is gone");
    drop(s);
    let mut s = open(&dir, 64 << 10);
    assert_eq!(s.store.open_queue(Q, "/", "q", true).count, 201);
    assert_eq!(s.ids(Q), (0..201).collect::<Vec<_>>());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn writes_no_sync_asks_for_still_keep_the_journal_bounded() {
    let dir = temp_dir("unsynced");
    let mut s = open(&dir, 64 << 10);
    s.store.open_queue(Q, "/", "q", true);
    // Transient messages paged out of a durable queue, and their acks: the core never asks
    // for a sync for them, only flushes.
    let mut transient = (*message(0, 1000)).clone();
    transient.properties.delivery_mode = Some(1);
    let transient = Arc::new(transient);
    for seq in 0..1000 {
        s.store.append(Q, seq, &transient, None).expect("append");
        if seq % 10 == 9 {
            for gone in seq - 9..=seq {
                s.store.remove(Q, gone);
            }
            s.store.flush();
        }
    }
    // The generation being written was cut recently (older ones wait for their checkpoint).
    let newest = std::fs::read_dir(dir.join("journal"))
        .expect("journal dir")
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "wj"))
        .max()
        .expect("a generation");
    let newest_bytes = records_end(&newest);
    assert!(
        newest_bytes < 2 * (64 << 10),
        "{newest_bytes} bytes in the current generation after 1 MB of unsynced writes"
    );
    // The sync thread works in order: once this sync is reported, the checkpoints queued
    // before it are done.
    s.store
        .append(Q, 1000, &message(1000, 100), None)
        .expect("append");
    s.sync(1);
    assert_eq!(journal_generations(&dir), 1);
    let journal_bytes: u64 = std::fs::read_dir(dir.join("journal"))
        .expect("journal dir")
        .filter_map(Result::ok)
        .map(|e| records_end(&e.path()))
        .sum();
    assert!(
        journal_bytes < 2 * (64 << 10),
        "{journal_bytes} journal bytes after 1 MB of unsynced writes"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Copies the files of `from` into `to` (one level of queue directories, as the store has).
fn copy_tree(from: &Path, to: &Path) {
    let _ = std::fs::remove_dir_all(to);
    std::fs::create_dir_all(to).expect("mkdir");
    for e in std::fs::read_dir(from).expect("read dir") {
        let e = e.expect("entry");
        let target = to.join(e.file_name());
        if e.file_type().expect("type").is_dir() {
            copy_tree(&e.path(), &target);
        } else {
            std::fs::copy(e.path(), target).expect("copy");
        }
    }
}

#[derive(Clone, Debug)]
enum Step {
    Append(u8),
    Remove(u16),
    Sync,
    PowerCut,
}

fn step() -> impl proptest::strategy::Strategy<Value = Step> {
    use proptest::prelude::*;
    prop_oneof![
        4 => (1u8..40).prop_map(Step::Append),
        3 => any::<u16>().prop_map(Step::Remove),
        2 => Just(Step::Sync),
        1 => Just(Step::PowerCut),
    ]
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(48))]

    /// A power cut keeps exactly what the last completed sync promised: the segment files
    /// fall back to their last durable state (what the previous start made durable), the
    /// journal to its last fdatasynced length; every message appended and not removed by
    /// then comes back, nothing removed by then does, nothing later does.
    #[test]
    fn a_power_cut_keeps_exactly_what_the_last_sync_promised(
        steps in proptest::collection::vec(step(), 1..60)
    ) {
        let dir = temp_dir(&format!("prop-{}", rand_tag(&steps)));
        let base = dir.with_extension("durable");
        let mut s = open(&dir, 1 << 40);
        s.store.open_queue(Q, "/", "q", true);
        copy_tree(&dir.join("queues"), &base);
        let mut next_seq = 0u64;
        let mut live: std::collections::BTreeSet<u64> = Default::default();
        let mut promised = live.clone();
        let mut epoch = 0;
        let mut synced_journal: Option<(PathBuf, u64)> = None;
        for st in steps {
            match st {
                Step::Append(n) => {
                    for _ in 0..n {
                        s.store.append(Q, next_seq, &message(next_seq, 200), None).expect("append");
                        live.insert(next_seq);
                        next_seq += 1;
                    }
                }
                Step::Remove(pick) => {
                    if let Some(&seq) = live.iter().nth(pick as usize % live.len().max(1)) {
                        s.store.remove(Q, seq);
                        live.remove(&seq);
                    }
                }
                Step::Sync => {
                    epoch += 1;
                    s.sync(epoch);
                    promised = live.clone();
                    let newest = std::fs::read_dir(dir.join("journal")).expect("journal dir")
                        .filter_map(Result::ok).map(|e| e.path())
                        .filter(|p| p.extension().is_some_and(|x| x == "wj"))
                        .max().expect("a generation");
                    let end = records_end(&newest);
                    synced_journal = Some((newest, end));
                }
                Step::PowerCut => {
                    drop(s);
                    // What the page cache held and no fsync covered is gone.
                    std::fs::remove_dir_all(dir.join("queues")).expect("rm queues");
                    copy_tree(&base, &dir.join("queues"));
                    for e in std::fs::read_dir(dir.join("journal")).expect("journal dir") {
                        let p = e.expect("entry").path();
                        match &synced_journal {
                            Some((synced, end)) if *synced == p => {
                                let f = std::fs::OpenOptions::new().write(true).open(&p).expect("open");
                                f.set_len(*end).expect("truncate");
                            }
                            _ => std::fs::remove_file(&p).expect("rm unsynced generation"),
                        }
                    }
                    s = open(&dir, 1 << 40);
                    s.store.open_queue(Q, "/", "q", true);
                    let got: std::collections::BTreeSet<u64> = s.ids(Q).into_iter().collect();
                    proptest::prop_assert_eq!(&got, &promised);
                    live = promised.clone();
                    next_seq = live.last().map_or(next_seq, |l| l + 1).max(next_seq);
                    // The start replayed and fsynced everything: the new durable base.
                    copy_tree(&dir.join("queues"), &base);
                    synced_journal = None;
                }
            }
        }
        drop(s);
        let _ = std::fs::remove_dir_all(&dir);
        let _ = std::fs::remove_dir_all(&base);
    }
}

/// A tag that keeps concurrent proptest cases' directories apart.
fn rand_tag(steps: &[Step]) -> String {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    format!(
        "{}-{}",
        steps.len(),
        NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    )
}

/// A journal record with a valid CRC, as an attacker or a bug could write it.
fn framed(kind: u8, path: &[u8], body: &[u8]) -> Vec<u8> {
    let mut payload = vec![kind];
    payload.extend_from_slice(&(path.len() as u16).to_le_bytes());
    payload.extend_from_slice(path);
    payload.extend_from_slice(body);
    let mut rec = (payload.len() as u32).to_le_bytes().to_vec();
    rec.extend_from_slice(&crc32fast::hash(&payload).to_le_bytes());
    rec.extend_from_slice(&payload);
    rec
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

    /// Whatever a journal holds (random bytes, records naming `..`, absolute paths, unknown
    /// kinds), opening the store never panics and never touches a file outside the data
    /// directory.
    #[test]
    fn a_hostile_journal_never_escapes_the_data_directory(
        records in proptest::collection::vec(
            (0u8..5, proptest::sample::select(vec![
                b"../outside/x".to_vec(), b"/tmp/warren-abs-escape".to_vec(),
                b"queues/q/0000000000000000.qi".to_vec(), b"queues/../../outside/y".to_vec(),
                b"".to_vec(), b"queues/q".to_vec(), vec![0xff, 0xfe],
            ]), proptest::collection::vec(proptest::prelude::any::<u8>(), 0..24)),
            0..12),
        garbage in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..64),
    ) {
        let top = temp_dir(&format!("hostile-{}", rand_tag(&[])));
        let dir = top.join("data");
        let outside = top.join("outside");
        std::fs::create_dir_all(dir.join("journal")).expect("mkdir");
        std::fs::create_dir_all(&outside).expect("mkdir");
        let mut bytes = b"WARRENWJ\x01\0\0\0\0\0\0\0".to_vec();
        for (kind, path, body) in &records {
            bytes.extend(framed(*kind, path, body));
        }
        bytes.extend_from_slice(&garbage);
        std::fs::write(dir.join("journal").join("0000000000000001.wj"), &bytes).expect("write");
        let s = open(&dir, 1 << 40);
        drop(s);
        proptest::prop_assert_eq!(std::fs::read_dir(&outside).expect("outside").count(), 0);
        proptest::prop_assert!(!Path::new("/tmp/warren-abs-escape").exists());
        let _ = std::fs::remove_dir_all(&top);
    }
}

#[test]
fn a_transient_queue_gets_its_log_at_its_first_write() {
    let dir = temp_dir("transient-lazy");
    let mut s = open(&dir, 64 << 20);
    let q = QueueId(11);
    let log_dir = dir.join("transient").join("11");
    s.store.open_queue(q, "/", "idle", false);
    // An idle transient queue (every clean MQTT session's) holds no log: no directory, no
    // record.
    assert!(!log_dir.exists(), "no log before the first write");
    assert!(s.ids(q).is_empty(), "nothing to read");
    s.store.remove(q, 0);
    s.store.remove_from(q, 0);
    s.sync(1);
    assert!(!log_dir.exists(), "reads, removals and syncs make none");
    s.append(q, 0..3, 100);
    assert!(log_dir.exists(), "the first write makes it");
    s.store.remove(q, 0);
    assert_eq!(s.ids(q), vec![1, 2]);
    s.store.delete_queue(q);
    s.sync(2);
    assert!(!log_dir.exists(), "deleted with the queue");
    // A transient queue deleted before it ever wrote leaves nothing behind either.
    s.store.open_queue(QueueId(12), "/", "never", false);
    s.store.delete_queue(QueueId(12));
    assert!(!dir.join("transient").join("12").exists());
    drop(s);
    let _ = std::fs::remove_dir_all(&dir);
}
