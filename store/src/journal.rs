//! The write-ahead journal: one append-only file that every write to a durable queue's segment
//! files is also recorded in, so that a sync needs one `fdatasync` (of the journal) instead of
//! two per queue written (`.qd` and `.qi`). On this machine's disk an fdatasync costs
//! 130-220 us whatever it flushes, and two files synced one after the other cost twice one
//! file, while syncing them from two threads costs more still (measured: docs/benchmarks.md).
//! So a confirm round trip on one queue pays one flush instead of two, and a fanout to ten
//! durable queues one instead of twenty.
//!
//! The segment files themselves are written as before (page cache) and made durable at a
//! *checkpoint*: once a journal generation passes `CHECKPOINT_BYTES` (or names too many
//! files), the store starts a new generation, and the sync thread, after the epoch's own
//! sync, fsyncs every file the old generation wrote, then deletes the old generation.
//!
//! Replay (at open, before any queue is read): every record of every generation, oldest
//! first, is redone: writes rewritten at their offsets (idempotent), file deletions and queue
//! directory deletions repeated, so the files end as they were when the last promised record
//! was written. Replay stops at the first record whose length or CRC is wrong: records are
//! promised in order (each sync flushes a prefix of the journal), so what follows a torn
//! record was never promised.
//!
//! Byte layout (docs/storage.md, "Journal"): a 16-byte header (`WARRENWJ`, format version
//! u32 LE, zero u32), then records `len: u32 LE | crc32(payload): u32 LE | payload`, payload
//! `kind: u8 | path_len: u16 LE | path (UTF-8, relative to the data directory) | body`, body
//! for a write `offset: u64 LE | bytes`, empty for the deletions.

use crate::scan;
use std::collections::BTreeSet;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Component, Path, PathBuf};
use std::sync::{Arc, Mutex};

pub const JOURNAL_MAGIC: &[u8; 8] = b"WARRENWJ";
pub const JOURNAL_VERSION: u32 = 1;
const HEADER_SIZE: u64 = 16;
/// A generation this large is checkpointed: bounds replay time (64 MiB replays in well under
/// a second) and the disk the journal takes.
pub const CHECKPOINT_BYTES: u64 = 64 << 20;
/// Files one generation may name before it is checkpointed: bounds the set kept in memory
/// and the fsyncs one checkpoint does.
const CHECKPOINT_FILES: usize = 4096;
/// No segment file comes near this (a data file holds 4096 records of at most 128 MiB).
const MAX_FILE: u64 = 1 << 40;
/// The generation file is extended with zeros this much at a time.
const PREALLOCATE: u64 = 1 << 20;
/// Buffered record bytes written out without waiting for the sync.
const FLUSH_BYTES: usize = 1 << 20;
/// A record longer than this is corrupt (the largest write is a flush of one queue's buffer:
/// 1 MiB plus one message of at most 128 MiB, plus framing).
const MAX_RECORD: usize = 256 << 20;

const KIND_WRITE: u8 = 1;
const KIND_DELETE_FILE: u8 = 2;
const KIND_DELETE_DIR: u8 = 3;

/// The journal, shared by the store and the queue logs that write through it.
pub type SharedJournal = Arc<Mutex<Journal>>;

/// What a sync must do for the journal.
pub struct JournalSync {
    /// The generation file holding this epoch's records: fdatasynced before the epoch is
    /// reported durable.
    pub file: Arc<File>,
    /// A generation to checkpoint after the epoch is reported.
    pub checkpoint: Option<Checkpoint>,
}

/// A finished generation: once `files` (and the directories) are fsynced, `retire` can go.
pub struct Checkpoint {
    pub files: Vec<PathBuf>,
    pub dirs: Vec<PathBuf>,
    pub retire: PathBuf,
}

impl Checkpoint {
    /// Makes the generation's writes durable in their own files, then deletes it. Files
    /// deleted since need nothing.
    pub fn run(&self) -> Result<(), String> {
        for path in &self.files {
            match File::open(path) {
                Ok(f) => f
                    .sync_data()
                    .map_err(|e| format!("fsync {}: {e}", path.display()))?,
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(format!("open {} for fsync: {e}", path.display())),
            }
        }
        for d in &self.dirs {
            if let Ok(dir) = File::open(d) {
                dir.sync_all()
                    .map_err(|e| format!("fsync {}: {e}", d.display()))?;
            }
        }
        fs::remove_file(&self.retire)
            .map_err(|e| format!("delete {}: {e}", self.retire.display()))?;
        Ok(())
    }
}

/// What replay found.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Replayed {
    pub generations: usize,
    pub records: u64,
    /// A generation ended in a torn write (normal after a crash mid-write).
    pub torn: bool,
    /// A damaged record was skipped (valid records after it were replayed).
    pub damaged: bool,
}

/// See the module docs.
pub struct Journal {
    root: PathBuf,
    dir: PathBuf,
    generation: u64,
    file: Arc<File>,
    /// Bytes in the generation file, including `buf`.
    len: u64,
    buf: Vec<u8>,
    /// Files this generation wrote (relative paths are joined to `root` at checkpoint).
    written: BTreeSet<PathBuf>,
    /// Directories this generation changed (a queue's files deleted or the queue deleted).
    dirs: BTreeSet<PathBuf>,
    checkpoint_bytes: u64,
    /// The generation file's length: zeros beyond `len`.
    allocated: u64,
}

fn generation_path(dir: &Path, generation: u64) -> PathBuf {
    dir.join(format!("{generation:016x}.wj"))
}

fn header() -> [u8; HEADER_SIZE as usize] {
    let mut h = [0u8; HEADER_SIZE as usize];
    h[..8].copy_from_slice(JOURNAL_MAGIC);
    h[8..12].copy_from_slice(&JOURNAL_VERSION.to_le_bytes());
    h
}

/// A relative path made only of normal components: a record can never reach outside the
/// data directory, whatever its bytes say.
fn safe_relative(path: &Path) -> bool {
    path.components().all(|c| matches!(c, Component::Normal(_))) && !path.as_os_str().is_empty()
}

impl Journal {
    /// Replays what the journal directory under `root` holds, makes the result durable,
    /// deletes the old generations and starts a new one.
    pub fn open(root: &Path, checkpoint_bytes: u64) -> io::Result<(Journal, Replayed)> {
        let dir = root.join("journal");
        fs::create_dir_all(&dir)?;
        let mut generations: Vec<u64> = Vec::new();
        for e in fs::read_dir(&dir)? {
            let name = e?.file_name();
            if let Some(stem) = name.to_string_lossy().strip_suffix(".wj")
                && let Ok(g) = u64::from_str_radix(stem, 16)
            {
                generations.push(g);
            }
        }
        generations.sort_unstable();
        let mut replayed = Replayed::default();
        let mut touched_files = BTreeSet::new();
        let mut touched_dirs = BTreeSet::new();
        let mut plans = Vec::new();
        for &g in &generations {
            replayed.generations += 1;
            let path = generation_path(&dir, g);
            let file = File::open(&path)?;
            let records = plan_generation(&file, &path, &mut replayed)?;
            plans.push((file, records));
        }
        // Before anything is rewritten: what the journal would repair in the segment files.
        crate::journal_audit::report(root, &plans)?;
        let mut payload = Vec::new();
        for (file, records) in &plans {
            for &(at, len) in records {
                payload.resize((len - 8) as usize, 0);
                file.read_exact_at(&mut payload, at + 8)?;
                if let Some(op) = decode(&payload) {
                    apply(root, op, &mut touched_files, &mut touched_dirs)?;
                    replayed.records += 1;
                }
            }
        }
        if !generations.is_empty() {
            for f in &touched_files {
                if let Ok(file) = File::open(f) {
                    file.sync_data()?;
                }
            }
            touched_dirs.insert(root.join("queues"));
            for d in &touched_dirs {
                if let Ok(dir) = File::open(d) {
                    dir.sync_all()?;
                }
            }
            for &g in &generations {
                fs::remove_file(generation_path(&dir, g))?;
            }
            if replayed.records > 0 {
                tracing::info!(
                    records = replayed.records,
                    generations = replayed.generations,
                    torn = replayed.torn,
                    damaged = replayed.damaged,
                    "replayed the journal"
                );
            }
        }
        let generation = generations.last().map_or(1, |g| g + 1);
        let file = Journal::create_generation(&dir, generation)?;
        File::open(&dir)?.sync_all()?;
        Ok((
            Journal {
                root: root.to_path_buf(),
                dir,
                generation,
                file: Arc::new(file),
                len: HEADER_SIZE,
                buf: Vec::new(),
                written: BTreeSet::new(),
                dirs: BTreeSet::new(),
                checkpoint_bytes,
                allocated: HEADER_SIZE,
            },
            replayed,
        ))
    }

    fn create_generation(dir: &Path, generation: u64) -> io::Result<File> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(generation_path(dir, generation))?;
        file.write_all_at(&header(), 0)?;
        Ok(file)
    }

    fn relative<'a>(&self, path: &'a Path) -> io::Result<&'a Path> {
        path.strip_prefix(&self.root)
            .ok()
            .filter(|p| safe_relative(p))
            .ok_or_else(|| {
                io::Error::other(format!(
                    "journal: {} is not inside the data directory",
                    path.display()
                ))
            })
    }

    fn record(
        &mut self,
        kind: u8,
        path: &Path,
        offset: Option<u64>,
        bytes: &[u8],
    ) -> io::Result<()> {
        let rel = self.relative(path)?;
        let rel_bytes = rel.as_os_str().as_encoded_bytes();
        let path_len = u16::try_from(rel_bytes.len())
            .map_err(|_| io::Error::other("journal: path too long"))?;
        let payload_len = 1 + 2 + rel_bytes.len() + offset.map_or(0, |_| 8) + bytes.len();
        let len = u32::try_from(payload_len)
            .ok()
            .filter(|&l| (l as usize) <= MAX_RECORD)
            .ok_or_else(|| io::Error::other("journal: record too large"))?;
        let start = self.buf.len();
        self.buf.extend_from_slice(&len.to_le_bytes());
        self.buf.extend_from_slice(&[0; 4]);
        self.buf.push(kind);
        self.buf.extend_from_slice(&path_len.to_le_bytes());
        self.buf.extend_from_slice(rel_bytes);
        if let Some(offset) = offset {
            self.buf.extend_from_slice(&offset.to_le_bytes());
        }
        self.buf.extend_from_slice(bytes);
        let crc = crc32fast::hash(&self.buf[start + 8..]);
        self.buf[start + 4..start + 8].copy_from_slice(&crc.to_le_bytes());
        self.len += (self.buf.len() - start) as u64;
        match kind {
            KIND_WRITE => {
                if !self.written.contains(path) {
                    self.written.insert(path.to_path_buf());
                }
            }
            _ => {
                if let Some(parent) = path.parent() {
                    self.dirs.insert(parent.to_path_buf());
                }
            }
        }
        if self.buf.len() >= FLUSH_BYTES {
            self.flush()?;
        }
        Ok(())
    }

    /// Records that `bytes` were (or are about to be) written at `offset` of file `path`.
    pub fn write(&mut self, path: &Path, offset: u64, bytes: &[u8]) -> io::Result<()> {
        self.record(KIND_WRITE, path, Some(offset), bytes)
    }

    /// Records that file `path` was deleted.
    pub fn delete_file(&mut self, path: &Path) -> io::Result<()> {
        self.record(KIND_DELETE_FILE, path, None, &[])
    }

    /// Records that directory `path` and everything in it was deleted.
    pub fn delete_dir(&mut self, path: &Path) -> io::Result<()> {
        self.record(KIND_DELETE_DIR, path, None, &[])
    }

    /// Writes the buffered records to the generation file (no fsync).
    pub fn flush(&mut self) -> io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let at = self.len - self.buf.len() as u64;
        if self.len > self.allocated {
            // Zeros written ahead: a sync then flushes data only, not the file's new size
            // (an fdatasync that changes the size also commits the filesystem's journal:
            // ~190-220 us against ~130-175 us here). Replay stops at the zeros.
            let target = self.len.div_ceil(PREALLOCATE) * PREALLOCATE;
            let zeros = vec![0u8; (target - self.allocated) as usize];
            self.file.write_all_at(&zeros, self.allocated)?;
            self.allocated = target;
        }
        self.file.write_all_at(&self.buf, at)?;
        self.buf.clear();
        Ok(())
    }

    /// At a sync: writes the records out and says what to fsync; starts a new generation
    /// (and hands the old one over for a checkpoint) once this one is large.
    pub fn cut(&mut self) -> io::Result<JournalSync> {
        self.flush()?;
        let file = Arc::clone(&self.file);
        let checkpoint =
            if self.len >= self.checkpoint_bytes || self.written.len() >= CHECKPOINT_FILES {
                Some(self.cut_now()?.0)
            } else {
                None
            };
        Ok(JournalSync { file, checkpoint })
    }

    /// Starts a new generation now; returns the old one's checkpoint and its file (which
    /// still needs an fsync for what was written since the last sync).
    pub fn cut_now(&mut self) -> io::Result<(Checkpoint, Arc<File>)> {
        self.flush()?;
        let next = Journal::create_generation(&self.dir, self.generation + 1)?;
        let retire = generation_path(&self.dir, self.generation);
        self.generation += 1;
        let old = std::mem::replace(&mut self.file, Arc::new(next));
        self.len = HEADER_SIZE;
        self.allocated = HEADER_SIZE;
        let mut dirs: Vec<PathBuf> = std::mem::take(&mut self.dirs).into_iter().collect();
        // The new generation's directory entry, and queue directories renamed away.
        dirs.push(self.dir.clone());
        dirs.push(self.root.join("queues"));
        let cp = Checkpoint {
            files: std::mem::take(&mut self.written).into_iter().collect(),
            dirs,
            retire,
        };
        Ok((cp, old))
    }

    /// Bytes in the current generation.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// No record in the current generation.
    pub fn is_empty(&self) -> bool {
        self.len == HEADER_SIZE
    }
}

/// Journal records: kind 1-3, then a path under `queues/`.
const FRAMING: scan::Framing = scan::Framing {
    min_payload: 11,
    max_payload: MAX_RECORD,
    plausible: |p| {
        p.len() >= 10
            && (KIND_WRITE..=KIND_DELETE_DIR).contains(&p[0])
            && u16::from_le_bytes([p[1], p[2]]) >= 8
            && &p[3..10] == b"queues/"
    },
};

/// The records of one generation to replay, as (offset, framed length). A record that fails
/// followed by valid ones is damage: skipped, reported, the rest replayed. A tail without a
/// valid record is where writing stopped: zeros (space allocated ahead) end it silently;
/// anything else is a torn write, never promised (records are promised in order).
fn plan_generation(
    file: &File,
    path: &Path,
    replayed: &mut Replayed,
) -> io::Result<Vec<(u64, u64)>> {
    let len = file.metadata()?.len();
    let mut head = [0u8; HEADER_SIZE as usize];
    if file.read_exact_at(&mut head, 0).is_err() || head[..12] != header()[..12] {
        tracing::warn!(file = %path.display(), "journal generation with a damaged header: its records are replayed still");
        replayed.damaged = true;
    }
    let scanned = scan::scan(file, HEADER_SIZE, len, &FRAMING, true)?;
    let mut skipped: Vec<std::ops::Range<u64>> = scanned.damaged.clone();
    let mut records = Vec::with_capacity(scanned.records.len());
    let mut payload = Vec::new();
    for rec in &scanned.records {
        payload.resize((rec.len - 8) as usize, 0);
        file.read_exact_at(&mut payload, rec.offset + 8)?;
        if decode(&payload).is_some() {
            records.push((rec.offset, rec.len));
        } else {
            // A good checksum on a record the store could not have written: never applied.
            skipped.push(rec.offset..rec.offset + rec.len);
        }
    }
    for range in &skipped {
        tracing::warn!(
            file = %path.display(),
            offset = range.start,
            bytes = range.end - range.start,
            "corrupt journal record skipped (not a torn tail: valid records follow, and are replayed)"
        );
    }
    replayed.damaged |= !skipped.is_empty();
    if let Some(tail) = scanned.tail
        && !zeros(file, tail, len)?
    {
        tracing::warn!(file = %path.display(), offset = tail, bytes = len - tail, "torn journal tail: replay of this generation ends here (what follows was never promised)");
        replayed.torn = true;
    }
    Ok(records)
}

/// Whether `file` holds only zeros in `from..to`.
fn zeros(file: &File, from: u64, to: u64) -> io::Result<bool> {
    let mut buf = vec![0u8; 1 << 16];
    let mut at = from;
    while at < to {
        let n = ((to - at) as usize).min(buf.len());
        file.read_exact_at(&mut buf[..n], at)?;
        if buf[..n].iter().any(|&b| b != 0) {
            return Ok(false);
        }
        at += n as u64;
    }
    Ok(true)
}

pub(crate) enum Op<'a> {
    Write(&'a Path, u64, &'a [u8]),
    DeleteFile(&'a Path),
    DeleteDir(&'a Path),
}

pub(crate) fn decode(payload: &[u8]) -> Option<Op<'_>> {
    let kind = *payload.first()?;
    let path_len = u16::from_le_bytes([*payload.get(1)?, *payload.get(2)?]) as usize;
    let path_bytes = payload.get(3..3 + path_len)?;
    let path = Path::new(std::str::from_utf8(path_bytes).ok()?);
    if !safe_relative(path) {
        return None;
    }
    let rest = &payload[3 + path_len..];
    // The store journals nothing but `queues/<queue>/<file>` writes and deletions and
    // `queues/<queue>` deletions: anything else is corruption, even with a good CRC.
    let depth = path.components().count();
    if path.components().next() != Some(Component::Normal("queues".as_ref())) {
        return None;
    }
    match kind {
        KIND_WRITE if depth == 3 => {
            let offset = u64::from_le_bytes(rest.get(..8)?.try_into().ok()?);
            let bytes = &rest[8..];
            offset
                .checked_add(bytes.len() as u64)
                .filter(|&end| end <= MAX_FILE)?;
            Some(Op::Write(path, offset, bytes))
        }
        KIND_DELETE_FILE if depth == 3 && rest.is_empty() => Some(Op::DeleteFile(path)),
        KIND_DELETE_DIR if depth == 2 && rest.is_empty() => Some(Op::DeleteDir(path)),
        _ => None,
    }
}

fn apply(
    root: &Path,
    op: Op<'_>,
    touched_files: &mut BTreeSet<PathBuf>,
    touched_dirs: &mut BTreeSet<PathBuf>,
) -> io::Result<()> {
    match op {
        Op::Write(rel, offset, bytes) => {
            let path = root.join(rel);
            if let Some(parent) = path.parent() {
                fs::create_dir_all(parent)?;
                touched_dirs.insert(parent.to_path_buf());
            }
            let file = OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(false)
                .open(&path)?;
            file.write_all_at(bytes, offset)?;
            touched_files.insert(path);
        }
        Op::DeleteFile(rel) => {
            let path = root.join(rel);
            match fs::remove_file(&path) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
                _ => {}
            }
            touched_files.remove(&path);
            if let Some(parent) = path.parent() {
                touched_dirs.insert(parent.to_path_buf());
            }
        }
        Op::DeleteDir(rel) => {
            let path = root.join(rel);
            match fs::remove_dir_all(&path) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
                _ => {}
            }
            touched_files.retain(|f| !f.starts_with(&path));
            touched_dirs.retain(|d| !d.starts_with(&path));
        }
    }
    Ok(())
}

/// Writes `bytes` at `offset` of `file` (at `path`), recording the write in the journal
/// first when there is one.
pub fn write_at(
    journal: Option<&SharedJournal>,
    file: &File,
    path: &Path,
    offset: u64,
    bytes: &[u8],
) -> io::Result<()> {
    if let Some(j) = journal {
        j.lock()
            .map_err(|_| io::Error::other("journal lock poisoned"))?
            .write(path, offset, bytes)?;
    }
    file.write_all_at(bytes, offset)
}

/// Runs `f` on the journal, if there is one.
pub fn with(
    journal: Option<&SharedJournal>,
    f: impl FnOnce(&mut Journal) -> io::Result<()>,
) -> io::Result<()> {
    match journal {
        Some(j) => f(&mut *j
            .lock()
            .map_err(|_| io::Error::other("journal lock poisoned"))?),
        None => Ok(()),
    }
}
