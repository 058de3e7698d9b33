//! Damage in a stopped store's files (issue 43, "Storage under disk faults"): a flipped byte
//! in the middle of a file is corruption, not a torn tail: only the damaged record is lost,
//! everything after it is kept, the loss is logged once and its entries are removed for
//! good; a tear is only a tail; a drained queue leaves nothing that looks torn; journal
//! damage followed by valid records does not end the replay; what replay repairs in the
//! segment files is reported; a damaged definitions database is an error, never a panic.

use bytes::Bytes;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, mpsc};
use std::time::Duration;
use warren_core::ids::QueueId;
use warren_core::message::{Message, Properties};
use warren_core::store::Store;
use warren_store::{DiskConfig, DiskStore};

const Q: QueueId = QueueId(3);

fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("warren-damage-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// A body that says which message it is and can be checked whole.
fn body(id: u64, len: usize) -> Vec<u8> {
    let mut b = id.to_le_bytes().to_vec();
    b.extend((8..len).map(|i| (id as usize * 31 + i) as u8));
    b
}

fn message(id: u64, len: usize) -> Arc<Message> {
    Arc::new(Message {
        exchange: "".into(),
        routing_key: "q".into(),
        properties: Properties {
            delivery_mode: Some(2),
            ..Properties::default()
        },
        body: Bytes::from(body(id, len)),
    })
}

/// Log lines written while `f` runs on this thread.
fn logs_of<T>(f: impl FnOnce() -> T) -> (T, String) {
    #[derive(Clone, Default)]
    struct Buf(Arc<Mutex<Vec<u8>>>);
    impl Write for Buf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().expect("lock").extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let buf = Buf::default();
    let writer = buf.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_max_level(tracing::Level::INFO)
        .with_writer(move || writer.clone())
        .finish();
    let out = tracing::subscriber::with_default(subscriber, f);
    let text = String::from_utf8_lossy(&buf.0.lock().expect("lock")).into_owned();
    (out, text)
}

struct Opened {
    store: DiskStore,
    synced: mpsc::Receiver<u64>,
}

fn open(dir: &Path) -> Opened {
    let (tx, synced) = mpsc::channel();
    let tx = Mutex::new(tx);
    let (store, _) = DiskStore::open(
        dir,
        DiskConfig::default(),
        Box::new(move |epoch, result| {
            result.expect("sync");
            let _ = tx.lock().expect("lock").send(epoch);
        }),
    )
    .expect("store opens");
    Opened { store, synced }
}

impl Opened {
    fn sync(&mut self, epoch: u64) {
        self.store.sync(epoch);
        let got = self
            .synced
            .recv_timeout(Duration::from_secs(30))
            .expect("synced");
        assert_eq!(got, epoch);
    }

    /// The ids read back, each body checked whole.
    fn ids(&mut self, len: usize) -> Vec<u64> {
        let mut out = Vec::new();
        self.store.read(Q, 0, usize::MAX, &mut out).expect("read");
        out.iter()
            .map(|m| {
                let id = u64::from_le_bytes(m.message.body[..8].try_into().expect("8"));
                assert_eq!(&m.message.body[..], &body(id, len)[..], "body of {id}");
                id
            })
            .collect()
    }
}

/// A store holding `n` confirmed messages of `len` bytes in queue `q`, stopped; reopened
/// once (so the journal no longer covers the segment files) when `settle`.
fn stored(dir: &Path, n: u64, len: usize, settle: bool) {
    let mut s = open(dir);
    s.store.open_queue(Q, "/", "q", true);
    for id in 0..n {
        s.store
            .append(Q, id, &message(id, len), None)
            .expect("append");
    }
    s.sync(1);
    drop(s);
    if settle {
        let mut s = open(dir);
        assert_eq!(s.store.open_queue(Q, "/", "q", true).count, n);
        s.sync(1);
    }
}

fn files(dir: &Path, ext: &str) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).expect("dir").flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == ext) {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

fn flip(path: &Path, at: u64, mask: u8) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .expect("open");
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, at).expect("read");
    f.write_all_at(&[b[0] ^ mask], at).expect("write");
}

/// The largest shared file (the one holding the bodies).
fn shared_file(dir: &Path) -> PathBuf {
    files(&dir.join("shared"), "ws")
        .into_iter()
        .max_by_key(|p| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0))
        .expect("a shared file")
}

#[test]
fn a_flipped_byte_mid_shared_file_loses_that_body_only_and_for_good() {
    const LEN: usize = 20_000;
    for (tag, offset_in_record, mask) in [("body", 5_000u64, 0x10u8), ("length", 1, 0x01)] {
        let dir = temp_dir(&format!("shared-{tag}"));
        stored(&dir, 300, LEN, false);
        let file = shared_file(&dir);
        // Record 100 of 300: header 16, records 8 + 8 + LEN each.
        let record = 16 + 100 * (16 + LEN as u64);
        flip(&file, record + offset_in_record, mask);
        let (ids, log) = logs_of(|| {
            let mut s = open(&dir);
            let r = s.store.open_queue(Q, "/", "q", true);
            assert_eq!(r.count, 299, "{tag}: one message lost, not a torn tail");
            let ids = s.ids(LEN);
            s.sync(1);
            ids
        });
        let expected: Vec<u64> = (0..300).filter(|&i| i != 100).collect();
        assert_eq!(ids, expected, "{tag}: every intact body kept");
        assert!(
            !log.contains("truncating a torn"),
            "{tag}: not called a tear:\n{log}"
        );
        assert!(
            log.contains("corrupt shared-store records skipped") && log.contains("lost=1"),
            "{tag}: the damage and the loss are reported:\n{log}"
        );
        // Removed for good: the next start counts 299 and reports no loss (the damaged
        // bytes stay in their file, and are named, until it is compacted or deleted).
        let (count, log) = logs_of(|| open(&dir).store.open_queue(Q, "/", "q", true).count);
        assert_eq!(count, 299, "{tag}");
        assert!(
            !log.contains("lost="),
            "{tag}: the loss is reported once:\n{log}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn a_cut_shared_file_is_a_torn_tail() {
    const LEN: usize = 10_000;
    let dir = temp_dir("shared-cut");
    stored(&dir, 50, LEN, false);
    let file = shared_file(&dir);
    let record = 16 + 40 * (16 + LEN as u64);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&file)
        .expect("open")
        .set_len(record + 100)
        .expect("cut");
    let (ids, log) = logs_of(|| open(&dir).ids_after_open(LEN));
    assert_eq!(ids, (0..40).collect::<Vec<_>>());
    assert!(log.contains("truncating a torn shared-store tail"), "{log}");
    assert!(log.contains("lost=10"), "{log}");
    let _ = std::fs::remove_dir_all(&dir);
}

impl Opened {
    fn ids_after_open(mut self, len: usize) -> Vec<u64> {
        self.store.open_queue(Q, "/", "q", true);
        self.ids(len)
    }
}

#[test]
fn a_damaged_record_in_an_older_segment_is_removed_for_good_once_read() {
    // Two segments (4096 entries each): the damage is in the first, which recovery does not
    // walk; the read finds it.
    const LEN: usize = 100;
    let dir = temp_dir("older-seg");
    stored(&dir, 4200, LEN, true);
    let data = files(&dir.join("queues"), "qd");
    assert_eq!(data.len(), 2, "two segments");
    // Record 10's body: records after the 16-byte header, each the same length.
    let total = std::fs::metadata(&data[0]).expect("meta").len() - 16;
    let rec = total / 4096;
    flip(&data[0], 16 + 10 * rec + rec - 3, 0x40);
    let (ids, log) = logs_of(|| {
        let mut s = open(&dir);
        assert_eq!(s.store.open_queue(Q, "/", "q", true).count, 4200);
        let ids = s.ids(LEN);
        s.sync(1);
        ids
    });
    assert_eq!(ids.len(), 4199);
    assert!(!ids.contains(&10));
    assert!(log.contains("corrupt record: the message is lost"), "{log}");
    // No phantom: the next start counts what is there, and says nothing.
    let (count, log) = logs_of(|| open(&dir).store.open_queue(Q, "/", "q", true).count);
    assert_eq!(count, 4199);
    assert!(!log.contains("ERROR"), "{log}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn damage_in_the_write_head_is_skipped_and_reported_not_cut() {
    const LEN: usize = 100;
    let dir = temp_dir("head-seg");
    stored(&dir, 200, LEN, true);
    let data = files(&dir.join("queues"), "qd");
    let total = std::fs::metadata(&data[0]).expect("meta").len() - 16;
    let rec = total / 200;
    // Record 50's length field.
    flip(&data[0], 16 + 50 * rec, 0x02);
    let (ids, log) = logs_of(|| {
        let mut s = open(&dir);
        let r = s.store.open_queue(Q, "/", "q", true);
        assert_eq!(r.count, 199);
        s.ids(LEN)
    });
    assert_eq!(ids, (0..200).filter(|&i| i != 50).collect::<Vec<_>>());
    assert!(
        !log.contains("truncating a torn") && !log.contains("torn journal tail"),
        "{log}"
    );
    assert!(
        log.contains("corrupt segment records skipped") && log.contains("lost=1"),
        "{log}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_queue_drained_to_empty_leaves_nothing_that_looks_torn() {
    let dir = temp_dir("drained");
    let mut s = open(&dir);
    s.store.open_queue(Q, "/", "q", true);
    for id in 0..100 {
        s.store
            .append(Q, id, &message(id, 200), None)
            .expect("append");
    }
    s.sync(1);
    for id in 0..100 {
        s.store.remove(Q, id);
    }
    s.sync(2);
    drop(s);
    let (count, log) = logs_of(|| open(&dir).store.open_queue(Q, "/", "q", true).count);
    assert_eq!(count, 0);
    assert!(
        !log.contains("truncating a torn") && !log.contains("torn journal tail"),
        "{log}"
    );
    assert!(!log.contains("WARN"), "{log}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn journal_damage_followed_by_valid_records_does_not_end_the_replay() {
    const LEN: usize = 100;
    let dir = temp_dir("journal-mid");
    let mut s = open(&dir);
    s.store.open_queue(Q, "/", "q", true);
    for batch in 0..10u64 {
        for id in batch * 10..batch * 10 + 10 {
            s.store
                .append(Q, id, &message(id, LEN), None)
                .expect("append");
        }
        s.sync(batch + 1);
    }
    drop(s);
    // Only the journal holds the messages now (a power cut lost every segment write).
    for f in files(&dir.join("queues"), "qd")
        .into_iter()
        .chain(files(&dir.join("queues"), "qi"))
    {
        std::fs::remove_file(f).expect("remove");
    }
    let journal = files(&dir.join("journal"), "wj");
    assert_eq!(journal.len(), 1);
    // A byte in the middle of the records (inside a batch's data write).
    let bytes = std::fs::read(&journal[0]).expect("read");
    let end = bytes.iter().rposition(|&b| b != 0).expect("records") as u64;
    flip(&journal[0], end / 2, 0x08);
    let (ids, log) = logs_of(|| {
        let mut s = open(&dir);
        s.store.open_queue(Q, "/", "q", true);
        s.ids(LEN)
    });
    assert!(log.contains("corrupt journal record skipped"), "{log}");
    assert!(
        !log.contains("truncating a torn") && !log.contains("torn journal tail"),
        "{log}"
    );
    // Later batches were replayed: the last message is there.
    assert!(ids.contains(&99), "{ids:?}");
    assert!(
        ids.len() >= 80,
        "at most one batch's records lost: {}",
        ids.len()
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn segment_damage_the_journal_repairs_is_reported() {
    const LEN: usize = 100;
    let dir = temp_dir("masked");
    stored(&dir, 50, LEN, false);
    let data = files(&dir.join("queues"), "qd");
    flip(&data[0], 16 + 30, 0x01);
    let index = files(&dir.join("queues"), "qi");
    flip(&index[0], 16 + 32 * 7 + 3, 0x01);
    let (ids, log) = logs_of(|| {
        let mut s = open(&dir);
        s.store.open_queue(Q, "/", "q", true);
        s.ids(LEN)
    });
    assert_eq!(
        ids,
        (0..50).collect::<Vec<_>>(),
        "repaired from the journal"
    );
    for f in [&data[0], &index[0]] {
        let name = f.file_name().expect("name").to_string_lossy().into_owned();
        assert!(
            log.lines()
                .any(|l| l.contains("repaired from the journal") && l.contains(&name)),
            "{name} reported:\n{log}"
        );
    }
    // Without damage, nothing is reported.
    let dir2 = temp_dir("masked-clean");
    stored(&dir2, 50, LEN, false);
    let (_, log) = logs_of(|| open(&dir2).store.open_queue(Q, "/", "q", true));
    assert!(!log.contains("differs"), "{log}");
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&dir2);
}

#[test]
fn a_damaged_definitions_database_is_an_error_never_a_panic() {
    let dir = temp_dir("redb");
    let mut s = open(&dir);
    for i in 0..50 {
        let q = warren_core::command::QueueDeclare {
            queue: format!("queue-{i}"),
            passive: false,
            durable: true,
            exclusive: false,
            auto_delete: false,
            nowait: false,
            arguments: Default::default(),
        };
        s.store
            .define(warren_core::store::DefinitionChange::QueueDeclared {
                vhost: "/",
                def: &q,
            })
            .expect("define");
    }
    s.sync(1);
    drop(s);
    let pristine = std::fs::read(dir.join("definitions.redb")).expect("read");
    let mut rng = 0x9E37_79B9_7F4A_7C15u64;
    let mut errors = 0;
    for _ in 0..64 {
        let mut bytes = pristine.clone();
        for _ in 0..4 {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            let at = (rng % bytes.len() as u64) as usize;
            bytes[at] ^= 1 << (rng >> 60 & 7);
        }
        std::fs::write(dir.join("definitions.redb"), &bytes).expect("write");
        let opened = std::panic::catch_unwind(|| {
            DiskStore::open(&dir, DiskConfig::default(), Box::new(|_, _| {})).map(|_| ())
        });
        match opened.expect("no panic escapes the store") {
            Ok(()) => {}
            Err(e) => {
                errors += 1;
                let text = e.to_string();
                assert!(e.is_damaged() && !e.is_locked(), "{text}");
                assert!(
                    text.contains("definitions.redb") && text.contains("To recover"),
                    "{text}"
                );
            }
        }
    }
    assert!(errors > 0, "some flips are noticed");
    let _ = std::fs::remove_dir_all(&dir);
}
