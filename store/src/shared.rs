//! The shared body store: message bodies at or above `embed_msgs_below` (4096 bytes) are
//! written once here and referenced by id from every queue's index (a fanout of one 1 MB
//! body to 10 queues writes 1 MB, not 10). Reference counts live in memory and are rebuilt
//! on recovery from the queues' index entries.
//!
//! Files `shared/<n:016x>.ws` hold framed records `len u32 | crc32 u32 | id u64 | body`;
//! a new file starts at `FILE_BYTES`, or at a sync when the current one holds 1 MiB or more
//! and no live body. Space comes back two ways: a file whose records are all
//! dead is deleted; a file less than half live is compacted a bounded step per sync (its live
//! records are copied into the current file; the old file is deleted by the sync thread once
//! the copies are durable), so publishers never wait for a whole-file rewrite.

use crate::scan;
use crate::segment::{HEADER_SIZE, frame_record, unframe_record};
use bytes::Bytes;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use warren_core::message::Message;

/// Size at which the current file is closed and a new one started.
const FILE_BYTES: u64 = 64 << 20;
/// Live bytes copied per compaction step (one step per sync).
const COMPACT_STEP_BYTES: u64 = 4 << 20;
/// A current file this large without a live body is closed (and deleted) at the next sync
/// and a new one started: a drained broker's disk use falls to near nothing instead of
/// keeping up to `FILE_BYTES` of dead bodies until the file fills.
const ROTATE_DEAD_BYTES: u64 = 1 << 20;
pub const SHARED_MAGIC: &[u8; 8] = b"WARRENSB";
/// Shared records: id u64 (1.., a counter: far below 2^48) then the body.
const FRAMING: scan::Framing = scan::Framing {
    min_payload: 8,
    max_payload: u32::MAX as usize,
    plausible: |p| {
        p.len() >= 8 && {
            let id = u64::from_le_bytes([p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7]]);
            id != 0 && id < 1 << 48
        }
    },
};

#[derive(Clone, Copy, Debug)]
struct Loc {
    file: u64,
    offset: u64,
    /// Framed record length.
    len: u32,
    refs: u32,
}

struct FileState {
    handle: Arc<File>,
    len: u64,
    live_bytes: u64,
}

/// What a sync must do for the shared store: fsync these files, then delete those.
#[derive(Default)]
pub struct SharedSync {
    pub fsync: Vec<Arc<File>>,
    pub delete: Vec<PathBuf>,
    pub dir: Option<PathBuf>,
}

pub struct SharedStore {
    dir: PathBuf,
    locs: HashMap<u64, Loc>,
    files: BTreeMap<u64, FileState>,
    current: u64,
    next_id: u64,
    /// Bodies written since the last sync, by message address: a fanout shares one `Arc`, so
    /// its body is written once. Holding the `Arc` keeps the address from being reused.
    recent: HashMap<usize, (Arc<Message>, u64)>,
    /// Files written since the last sync: the current one, and the one it replaced when a
    /// file filled up between two syncs (its last bodies need the fsync too).
    dirty: BTreeSet<u64>,
    dir_dirty: bool,
    /// Until the first sync, refcounts are still being rebuilt: nothing may be deleted.
    recovering: bool,
    pending_delete: Vec<PathBuf>,
}

fn file_path(dir: &Path, n: u64) -> PathBuf {
    dir.join(format!("{n:016x}.ws"))
}

fn file_header() -> [u8; HEADER_SIZE] {
    let mut h = [0u8; HEADER_SIZE];
    h[..8].copy_from_slice(SHARED_MAGIC);
    h[8..12].copy_from_slice(&crate::segment::FORMAT_VERSION.to_le_bytes());
    h
}

impl SharedStore {
    /// Opens the store, indexing every record (a torn tail of the last file is truncated).
    pub fn open(dir: &Path) -> io::Result<SharedStore> {
        fs::create_dir_all(dir)?;
        let mut numbers = Vec::new();
        for e in fs::read_dir(dir)? {
            let name = e?.file_name();
            if let Some(stem) = name.to_string_lossy().strip_suffix(".ws")
                && let Ok(n) = u64::from_str_radix(stem, 16)
            {
                numbers.push(n);
            }
        }
        numbers.sort_unstable();
        let mut store = SharedStore {
            dir: dir.to_path_buf(),
            locs: HashMap::new(),
            files: BTreeMap::new(),
            current: 0,
            next_id: 1,
            recent: HashMap::new(),
            dirty: BTreeSet::new(),
            dir_dirty: false,
            recovering: true,
            pending_delete: Vec::new(),
        };
        let last = numbers.last().copied();
        for n in numbers {
            store.index_file(n, Some(n) == last)?;
        }
        store.current = last.map_or(0, |n| n + 1);
        store.new_file()?;
        Ok(store)
    }

    /// Indexes file `n`'s records. Damage followed by a valid record is skipped (the
    /// bodies in it are lost, and reported by the queues that refer to them); a tail with
    /// no valid record is cut (a tear); the bytes of a damaged region are left in place.
    fn index_file(&mut self, n: u64, verify: bool) -> io::Result<()> {
        let path = file_path(&self.dir, n);
        let file = OpenOptions::new().read(true).write(true).open(&path)?;
        let len = file.metadata()?.len();
        let mut head = [0u8; HEADER_SIZE];
        let head_ok = file.read_exact_at(&mut head, 0).is_ok();
        if head_ok && head[..8] == SHARED_MAGIC[..] && head[8..12] != file_header()[8..12] {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "{} was written in shared-store format {} (this warren reads {}): \
                     start the warren that wrote it",
                    path.display(),
                    u32::from_le_bytes([head[8], head[9], head[10], head[11]]),
                    crate::segment::FORMAT_VERSION
                ),
            ));
        }
        let scanned = scan::scan(&file, HEADER_SIZE as u64, len, &FRAMING, verify)?;
        if !head_ok || head != file_header() {
            // The header is a constant: a damaged one is rewritten, the records kept.
            tracing::warn!(file = %path.display(), "shared store file with a damaged header: header rewritten, records kept");
            file.write_all_at(&file_header(), 0)?;
            file.sync_all()?;
        }
        for range in &scanned.damaged {
            tracing::warn!(
                file = %path.display(),
                offset = range.start,
                bytes = range.end - range.start,
                "corrupt shared-store records skipped (not a torn tail: valid records follow, \
                 and are kept); the bodies in them are lost, the queues that held them say how many messages"
            );
        }
        for r in &scanned.records {
            let id = u64::from_le_bytes(r.prefix[..8].try_into().unwrap_or_default());
            // A walk of frames only cannot see a damaged id: when two records claim one id,
            // the checksums decide (a compaction's copy in a later file wins when both hold).
            if let Some(old) = self.locs.get(&id).copied()
                && !scanned.verified
            {
                let new_ok = self.record_ok(&file, r.offset, r.len)?;
                let old_file = match self.files.get(&old.file) {
                    Some(f) => Some(&*f.handle),
                    None => (old.file == n).then_some(&file),
                };
                let old_ok = match old_file {
                    Some(f) => self.record_ok(f, old.offset, u64::from(old.len))?,
                    None => false,
                };
                if !new_ok || !old_ok {
                    tracing::warn!(file = %path.display(), offset = r.offset, "a corrupt shared-store record claims the id of another: skipped");
                }
                if !new_ok {
                    continue;
                }
            }
            self.locs.insert(
                id,
                Loc {
                    file: n,
                    offset: r.offset,
                    len: r.len as u32,
                    refs: 0,
                },
            );
            self.next_id = self.next_id.max(id + 1);
        }
        if let Some(tail) = scanned.tail {
            tracing::warn!(file = %path.display(), offset = tail, bytes = len - tail, "truncating a torn shared-store tail");
            file.set_len(tail)?;
            file.sync_all()?;
        }
        self.files.insert(
            n,
            FileState {
                handle: Arc::new(file),
                len: scanned.tail.unwrap_or(len).max(HEADER_SIZE as u64),
                live_bytes: 0,
            },
        );
        Ok(())
    }

    /// Whether the record at `offset` of `file` matches its checksum.
    fn record_ok(&self, file: &File, offset: u64, len: u64) -> io::Result<bool> {
        let mut rec = vec![0u8; len as usize];
        if file.read_exact_at(&mut rec, offset).is_err() {
            return Ok(false);
        }
        Ok(unframe_record(&Bytes::from(rec)).is_some())
    }

    fn new_file(&mut self) -> io::Result<()> {
        let path = file_path(&self.dir, self.current);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)?;
        file.write_all_at(&file_header(), 0)?;
        self.files.insert(
            self.current,
            FileState {
                handle: Arc::new(file),
                len: HEADER_SIZE as u64,
                live_bytes: 0,
            },
        );
        self.dir_dirty = true;
        self.dirty.insert(self.current);
        Ok(())
    }

    /// A queue index entry refers to `id` (recovery).
    pub fn add_ref(&mut self, id: u64) -> bool {
        let Some(loc) = self.locs.get_mut(&id) else {
            return false;
        };
        if loc.refs == 0
            && let Some(f) = self.files.get_mut(&loc.file)
        {
            f.live_bytes += u64::from(loc.len);
        }
        loc.refs += 1;
        true
    }

    /// Stores `m`'s body once per sync window and takes a reference; returns its id.
    pub fn put(&mut self, m: &Arc<Message>) -> io::Result<u64> {
        let key = Arc::as_ptr(m) as usize;
        // The body may have died since (every reference released): written anew then.
        if let Some(&(_, id)) = self.recent.get(&key)
            && self.add_ref(id)
        {
            return Ok(id);
        }
        let id = self.next_id;
        self.next_id += 1;
        let mut payload = Vec::with_capacity(8 + m.body.len());
        payload.extend_from_slice(&id.to_le_bytes());
        payload.extend_from_slice(&m.body);
        self.write_record(id, &payload)?;
        self.add_ref(id);
        // Dedup is an optimisation within a sync window: bound it when no sync comes.
        if self.recent.len() >= 4096 {
            self.recent.clear();
        }
        self.recent.insert(key, (m.clone(), id));
        Ok(id)
    }

    fn write_record(&mut self, id: u64, payload: &[u8]) -> io::Result<()> {
        if self
            .files
            .get(&self.current)
            .is_some_and(|f| f.len >= FILE_BYTES)
        {
            self.current += 1;
            self.new_file()?;
        }
        let mut rec = Vec::with_capacity(payload.len() + 8);
        frame_record(payload, &mut rec);
        let Some(f) = self.files.get_mut(&self.current) else {
            return Err(io::Error::other("no current shared file"));
        };
        f.handle.write_all_at(&rec, f.len)?;
        self.locs.insert(
            id,
            Loc {
                file: self.current,
                offset: f.len,
                len: rec.len() as u32,
                refs: 0,
            },
        );
        f.len += rec.len() as u64;
        self.dirty.insert(self.current);
        Ok(())
    }

    /// Drops a reference; a body without references is dead, and a file without live bodies
    /// is deleted (after the next sync).
    pub fn release(&mut self, id: u64) {
        let Some(loc) = self.locs.get_mut(&id) else {
            return;
        };
        loc.refs = loc.refs.saturating_sub(1);
        if loc.refs > 0 {
            return;
        }
        let loc = *loc;
        self.locs.remove(&id);
        if let Some(f) = self.files.get_mut(&loc.file) {
            f.live_bytes = f.live_bytes.saturating_sub(u64::from(loc.len));
        }
        self.collect(loc.file);
    }

    fn collect(&mut self, n: u64) {
        if self.recovering || n == self.current {
            return;
        }
        if self.files.get(&n).is_some_and(|f| f.live_bytes == 0) {
            self.files.remove(&n);
            self.pending_delete.push(file_path(&self.dir, n));
        }
    }

    /// Reads body `id`.
    pub fn read(&self, id: u64) -> io::Result<Bytes> {
        let loc = self
            .locs
            .get(&id)
            .ok_or_else(|| io::Error::other(format!("shared body {id} is missing")))?;
        let f = self
            .files
            .get(&loc.file)
            .ok_or_else(|| io::Error::other(format!("shared file of body {id} is missing")))?;
        let mut rec = vec![0u8; loc.len as usize];
        f.handle.read_exact_at(&mut rec, loc.offset)?;
        let payload = unframe_record(&Bytes::from(rec))
            .ok_or_else(|| io::Error::other(format!("shared body {id} fails its checksum")))?;
        Ok(payload.slice(8..))
    }

    /// Copies live bodies out of the emptiest old file, at most `COMPACT_STEP_BYTES` per
    /// call; the file is deleted after the sync that makes the copies durable.
    fn compact_step(&mut self) -> io::Result<()> {
        let victim = self
            .files
            .iter()
            .filter(|(n, f)| **n != self.current && f.live_bytes * 2 < f.len)
            .min_by_key(|(_, f)| f.live_bytes)
            .map(|(n, _)| *n);
        let Some(victim) = victim else {
            return Ok(());
        };
        let mut moved = 0u64;
        let ids: Vec<u64> = self
            .locs
            .iter()
            .filter(|(_, l)| l.file == victim)
            .map(|(id, _)| *id)
            .collect();
        for id in ids {
            if moved >= COMPACT_STEP_BYTES {
                return Ok(());
            }
            let body = self.read(id)?;
            let Some(old) = self.locs.get(&id).copied() else {
                continue;
            };
            let mut payload = Vec::with_capacity(8 + body.len());
            payload.extend_from_slice(&id.to_le_bytes());
            payload.extend_from_slice(&body);
            self.write_record(id, &payload)?;
            if let Some(l) = self.locs.get_mut(&id) {
                l.refs = old.refs;
                let len = u64::from(l.len);
                if let Some(f) = self.files.get_mut(&self.current) {
                    f.live_bytes += len;
                }
            }
            if let Some(f) = self.files.get_mut(&victim) {
                f.live_bytes = f.live_bytes.saturating_sub(u64::from(old.len));
            }
            moved += u64::from(old.len);
        }
        self.collect(victim);
        Ok(())
    }

    /// Ends the dedup window (the store calls it after each batch): a fanout appends one
    /// `Arc` to its queues within one batch, and the window's `Arc`s would otherwise keep
    /// up to 4096 bodies in memory until the next sync.
    pub fn end_window(&mut self) {
        self.recent.clear();
    }

    /// Prepares a sync: ends recovery (dead files go), starts a new current file if the
    /// current one holds only dead bodies, compacts a step, and returns what the sync
    /// thread must fsync and delete. Syncs come at least every
    /// `BrokerConfig::removal_sync_ms` after a body dies, so dead space is reclaimed
    /// within that whether or not anything persistent is published.
    pub fn take_sync(&mut self) -> io::Result<SharedSync> {
        if self.recovering {
            self.recovering = false;
            let dead: Vec<u64> = self
                .files
                .iter()
                .filter(|(n, f)| **n != self.current && f.live_bytes == 0)
                .map(|(n, _)| *n)
                .collect();
            self.locs.retain(|_, l| l.refs > 0);
            for n in dead {
                self.collect(n);
            }
        }
        if !self.recovering
            && self
                .files
                .get(&self.current)
                .is_some_and(|f| f.live_bytes == 0 && f.len >= ROTATE_DEAD_BYTES)
        {
            let dead = self.current;
            self.current += 1;
            self.new_file()?;
            self.collect(dead);
        }
        self.compact_step()?;
        self.recent.clear();
        let mut out = SharedSync::default();
        for n in std::mem::take(&mut self.dirty) {
            if let Some(f) = self.files.get(&n) {
                out.fsync.push(f.handle.clone());
            }
        }
        out.delete = std::mem::take(&mut self.pending_delete);
        if std::mem::take(&mut self.dir_dirty) || !out.delete.is_empty() {
            out.dir = Some(self.dir.clone());
        }
        Ok(out)
    }

    /// Live bodies and files (tests, metrics).
    pub fn stats(&self) -> (usize, usize) {
        (
            self.locs.values().filter(|l| l.refs > 0).count(),
            self.files.len(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(body: &[u8]) -> Arc<Message> {
        Arc::new(Message {
            exchange: "".into(),
            routing_key: "k".into(),
            properties: Default::default(),
            body: Bytes::copy_from_slice(body),
        })
    }

    #[test]
    fn a_fanout_writes_the_body_once_and_refs_keep_it() {
        let dir = std::env::temp_dir().join(format!("warren-shared-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let mut s = SharedStore::open(&dir).expect("open");
        s.take_sync().expect("end recovery");
        let m = message(&[7u8; 10_000]);
        let ids: Vec<u64> = (0..10).map(|_| s.put(&m).expect("put")).collect();
        assert!(ids.iter().all(|&id| id == ids[0]), "one id for the fanout");
        let size = s.files[&s.current].len;
        assert!(size < 2 * 10_000, "written once: {size} bytes");
        for _ in 0..9 {
            s.release(ids[0]);
        }
        assert_eq!(s.read(ids[0]).expect("still there").len(), 10_000);
        s.release(ids[0]);
        assert!(s.read(ids[0]).is_err(), "gone with its last reference");
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_current_file_of_dead_bodies_is_replaced_and_deleted_at_the_next_sync() {
        let dir = std::env::temp_dir().join(format!("warren-shared-rot-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let mut s = SharedStore::open(&dir).expect("open");
        s.take_sync().expect("end recovery");
        let first = s.current;
        let ids: Vec<u64> = (0..40)
            .map(|i| s.put(&message(&[i as u8; 64 * 1024])).expect("put"))
            .collect();
        let sync = s.take_sync().expect("sync");
        assert!(sync.delete.is_empty(), "live bodies keep their file");
        for id in ids {
            s.release(id);
        }
        let sync = s.take_sync().expect("sync");
        assert_eq!(
            sync.delete,
            vec![file_path(&dir, first)],
            "the dead file goes"
        );
        assert_ne!(s.current, first, "a new current file");
        assert_eq!(s.stats(), (0, 1));
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_body_put_again_after_it_died_is_written_anew() {
        let dir = std::env::temp_dir().join(format!("warren-shared-again-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let mut s = SharedStore::open(&dir).expect("open");
        s.take_sync().expect("end recovery");
        let m = message(&[3u8; 8000]);
        let id = s.put(&m).expect("put");
        s.release(id);
        let again = s.put(&m).expect("put again");
        assert_eq!(s.read(again).expect("readable").len(), 8000);
        let _ = fs::remove_dir_all(&dir);
    }
}
