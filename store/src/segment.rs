//! One queue's message log: segment files of `ENTRIES` sequence numbers each, as CQv2 lays
//! them out. Per segment, an index file of fixed-size entries (one slot per sequence number,
//! so an ack is a 32-byte overwrite at a computed offset) and a data file of checksummed
//! records (message bodies below `embed_below` inline; larger bodies in the shared store).
//! Byte layouts: docs/storage.md.
//!
//! Writes are buffered and written out by [`QueueLog::flush`] (before reads, before syncs,
//! and when the buffers pass `FLUSH_BYTES`), so a burst of publishes costs a few large
//! writes, not two syscalls per message.

use crate::journal::{self, SharedJournal};
use crate::record::{DecodeError, decode_message, encode_message};
use crate::scan;
use bytes::Bytes;
use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use warren_core::message::Message;

/// Sequence numbers per segment: a 128 KiB index file, and at 1 kB messages a ~4 MB data file.
pub const ENTRIES: u64 = 4096;
pub const ENTRY_SIZE: usize = 32;
pub const HEADER_SIZE: usize = 16;
pub const INDEX_MAGIC: &[u8; 8] = b"WARRENQI";
pub const DATA_MAGIC: &[u8; 8] = b"WARRENQD";
pub const FORMAT_VERSION: u32 = 1;
/// Buffered bytes that force a flush.
const FLUSH_BYTES: usize = 1 << 20;
/// Segments whose files stay open at once per queue (the write head and the read head are
/// the usual two).
const OPEN_SEGMENTS: usize = 4;

/// Data records: the expiry (u64: `NO_EXPIRY` or ms in the broker's clock, far below
/// 2^56), then an encoded message (its version byte, 1).
const FRAMING: scan::Framing = scan::Framing {
    min_payload: 9,
    max_payload: u32::MAX as usize,
    plausible: |p| p.len() >= 9 && (p[7] == 0 || p[..8] == [0xFF; 8]) && p[8] == 1,
};

const KIND_INLINE: u8 = 1;
const KIND_SHARED: u8 = 2;
const FLAG_PERSISTENT: u8 = 1;

/// One index entry, decoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    pub shared: Option<u64>,
    pub persistent: bool,
    pub record_len: u32,
    pub record_offset: u64,
    pub body_len: u32,
}

impl Entry {
    pub fn encode(&self) -> [u8; ENTRY_SIZE] {
        let mut e = [0u8; ENTRY_SIZE];
        e[0] = if self.shared.is_some() {
            KIND_SHARED
        } else {
            KIND_INLINE
        };
        e[1] = if self.persistent { FLAG_PERSISTENT } else { 0 };
        e[4..8].copy_from_slice(&self.record_len.to_le_bytes());
        e[8..16].copy_from_slice(&self.record_offset.to_le_bytes());
        e[16..24].copy_from_slice(&self.shared.unwrap_or(0).to_le_bytes());
        e[24..28].copy_from_slice(&self.body_len.to_le_bytes());
        let crc = crc32fast::hash(&e[..28]);
        e[28..32].copy_from_slice(&crc.to_le_bytes());
        e
    }

    /// `None` for an empty slot (all zeros: never written or removed) or a corrupt one.
    pub fn decode(e: &[u8]) -> Option<Entry> {
        if e.len() != ENTRY_SIZE || e[0] == 0 {
            return None;
        }
        let crc = u32::from_le_bytes(e[28..32].try_into().ok()?);
        if crc32fast::hash(&e[..28]) != crc {
            return None;
        }
        let shared_id = u64::from_le_bytes(e[16..24].try_into().ok()?);
        let shared = match e[0] {
            KIND_INLINE => None,
            KIND_SHARED => Some(shared_id),
            _ => return None,
        };
        Some(Entry {
            shared,
            persistent: e[1] & FLAG_PERSISTENT != 0,
            record_len: u32::from_le_bytes(e[4..8].try_into().ok()?),
            record_offset: u64::from_le_bytes(e[8..16].try_into().ok()?),
            body_len: u32::from_le_bytes(e[24..28].try_into().ok()?),
        })
    }
}

fn header(magic: &[u8; 8]) -> [u8; HEADER_SIZE] {
    let mut h = [0u8; HEADER_SIZE];
    h[..8].copy_from_slice(magic);
    h[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    h[12..16].copy_from_slice(&(ENTRIES as u32).to_le_bytes());
    h
}

fn check_header(h: &[u8], magic: &[u8; 8]) -> bool {
    h.len() >= HEADER_SIZE
        && &h[..8] == magic
        && h[8..12] == FORMAT_VERSION.to_le_bytes()
        && h[12..16] == (ENTRIES as u32).to_le_bytes()
}

/// A data-file record: length, CRC-32 of the payload, payload.
pub fn frame_record(payload: &[u8], out: &mut Vec<u8>) {
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    out.extend_from_slice(&crc32fast::hash(payload).to_le_bytes());
    out.extend_from_slice(payload);
}

/// Checks a framed record and returns its payload.
pub fn unframe_record(rec: &Bytes) -> Option<Bytes> {
    let len = u32::from_le_bytes(rec.get(..4)?.try_into().ok()?) as usize;
    let crc = u32::from_le_bytes(rec.get(4..8)?.try_into().ok()?);
    let payload = rec.slice(8..8usize.checked_add(len)?.min(rec.len()));
    (payload.len() == len && crc32fast::hash(&payload) == crc).then_some(payload)
}

struct SegmentState {
    live: Vec<u64>,
    live_count: u32,
    /// End of the data file, including buffered bytes.
    data_len: u64,
    /// Shared-store references of live entries (to release them on removal).
    shared: BTreeMap<u16, u64>,
}

impl SegmentState {
    fn new(data_len: u64) -> SegmentState {
        SegmentState {
            live: vec![0; (ENTRIES / 64) as usize],
            live_count: 0,
            data_len,
            shared: BTreeMap::new(),
        }
    }
    fn is_live(&self, i: u64) -> bool {
        self.live[(i / 64) as usize] & (1 << (i % 64)) != 0
    }
    fn set(&mut self, i: u64, on: bool) {
        let w = &mut self.live[(i / 64) as usize];
        if on {
            *w |= 1 << (i % 64);
        } else {
            *w &= !(1 << (i % 64));
        }
    }
}

/// Open files of one segment.
#[derive(Clone)]
pub struct SegmentFiles {
    pub index: Arc<File>,
    pub data: Arc<File>,
}

/// What recovery found in a queue's log.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Recovered {
    /// Shared-store ids referenced by the recovered entries (one per entry).
    pub shared_refs: Vec<u64>,
    pub count: u64,
    pub bytes: u64,
    pub first_seq: u64,
    pub next_seq: u64,
    /// Entries dropped: torn, corrupt, or transient (paged out before a restart).
    pub dropped: u64,
    /// Of those, the ones lost to damage (a corrupt index entry or record, not a tear nor a
    /// transient message): messages that were stored and cannot be read.
    pub lost: u64,
    /// Of those, the ones whose record was past a torn tail of the data file.
    pub torn: u64,
    /// The sequence number and body length of each entry of `shared_refs`.
    pub shared_seqs: Vec<(u64, u32)>,
}

/// A message read back.
pub struct ReadBack {
    pub seq: u64,
    pub expires_at: Option<u64>,
    pub body: Body,
}

/// The message itself, or (body in the shared store) its encoded record and the body's id.
pub enum Body {
    Whole(Box<Message>),
    Shared(Bytes, u64),
}

/// Why recovery dropped an entry.
enum Dropped {
    /// Its entry or record is damaged.
    Lost,
    /// Its record was past a torn tail.
    Torn,
    /// A transient message (paged out before the restart).
    Transient,
}

/// Record payloads start with the message's expiry (u64, `NO_EXPIRY` for none).
const NO_EXPIRY: u64 = u64::MAX;

/// See the module docs.
pub struct QueueLog {
    dir: PathBuf,
    embed_below: usize,
    segments: BTreeMap<u64, SegmentState>,
    open: Vec<(u64, SegmentFiles)>,
    /// Buffered data bytes of segment `data_seg`, to be written at `data_at`.
    data_buf: Vec<u8>,
    data_seg: u64,
    data_at: u64,
    /// Buffered index writes: sequence number -> entry bytes (zeros: removal).
    index_buf: BTreeMap<u64, [u8; ENTRY_SIZE]>,
    /// Segments written since the last `take_dirty`. Kept as numbers, not open files: the
    /// sync thread opens them by path, so a sync covering 10k queues holds no descriptors
    /// meanwhile.
    dirty: std::collections::BTreeSet<u64>,
    /// A segment file was created or deleted since the last `take_dirty`: the directory
    /// needs an fsync too.
    dir_dirty: bool,
    scratch: Vec<u8>,
    /// Durable queues write through the journal (every write recorded there first, so a
    /// sync is one fdatasync of the journal); transient queues' pages do not.
    journal: Option<SharedJournal>,
    /// Every entry is written persistent, whatever the message's delivery mode (a quorum
    /// queue's log: `Store::keep_every_message`).
    keep_all: bool,
}

fn seg_path(dir: &Path, seg: u64, ext: &str) -> PathBuf {
    dir.join(format!("{seg:016x}.{ext}"))
}

impl QueueLog {
    /// Opens (creating if needed) the log in `dir`, recovering what it holds.
    pub fn open(
        dir: &Path,
        embed_below: usize,
        journal: Option<SharedJournal>,
    ) -> io::Result<(QueueLog, Recovered)> {
        fs::create_dir_all(dir)?;
        let mut log = QueueLog {
            dir: dir.to_path_buf(),
            embed_below,
            segments: BTreeMap::new(),
            open: Vec::new(),
            data_buf: Vec::new(),
            data_seg: 0,
            data_at: 0,
            index_buf: BTreeMap::new(),
            dirty: std::collections::BTreeSet::new(),
            dir_dirty: false,
            scratch: Vec::new(),
            journal,
            keep_all: false,
        };
        let recovered = log.recover()?;
        Ok((log, recovered))
    }

    /// Rebuilds the in-memory state from the files: validates every index entry by checksum,
    /// drops entries whose record is missing or corrupt, and cuts a torn tail of the write
    /// head's data file (only a tail: damage followed by valid records is corruption,
    /// reported and skipped, docs/storage.md). Returns the shared-store references found.
    fn recover(&mut self) -> io::Result<Recovered> {
        let mut r = Recovered::default();
        let mut segs: Vec<u64> = Vec::new();
        for e in fs::read_dir(&self.dir)? {
            let name = e?.file_name();
            let name = name.to_string_lossy();
            if let Some(stem) = name.strip_suffix(".qi")
                && let Ok(seg) = u64::from_str_radix(stem, 16)
            {
                segs.push(seg);
            }
        }
        segs.sort_unstable();
        let last_seg = segs.last().copied();
        let mut first = None;
        for seg in segs {
            // Only the write head can have a torn tail (appends go nowhere else); older
            // segments get bounds checks, and record checksums when they are read.
            let head = Some(seg) == last_seg;
            if let Some(state) = self.recover_segment(seg, head, &mut r, &mut first)? {
                self.segments.insert(seg, state);
            }
        }
        r.first_seq = first.unwrap_or(0);
        if r.lost > 0 || r.torn > 0 {
            tracing::warn!(
                dir = %self.dir.display(),
                lost = r.lost,
                torn = r.torn,
                "messages lost on recovery: damaged index entries or records (lost), or \
                 written past a torn tail (torn: never confirmed while the journal is intact); \
                 their entries are removed"
            );
        }
        let transient = r.dropped - r.lost - r.torn;
        if transient > 0 {
            tracing::info!(dir = %self.dir.display(), transient, "dropped transient entries on recovery");
        }
        Ok(r)
    }

    /// One segment's part of [`QueueLog::recover`]; `None`: nothing live in it (its files
    /// are deleted).
    fn recover_segment(
        &mut self,
        seg: u64,
        head: bool,
        r: &mut Recovered,
        first: &mut Option<u64>,
    ) -> io::Result<Option<SegmentState>> {
        let index_path = seg_path(&self.dir, seg, "qi");
        let data_path = seg_path(&self.dir, seg, "qd");
        let mut index = fs::read(&index_path)?;
        let Ok(data) = File::options().read(true).write(true).open(&data_path) else {
            tracing::warn!(dir = %self.dir.display(), seg, "segment index without its data file: dropped");
            let _ = fs::remove_file(&index_path);
            return Ok(None);
        };
        // The headers are constants: a damaged one is rewritten, the entries kept.
        if !check_header(&index, INDEX_MAGIC) {
            tracing::warn!(file = %index_path.display(), "segment index with a damaged header: header rewritten");
            let f = File::options().write(true).open(&index_path)?;
            f.write_all_at(&header(INDEX_MAGIC), 0)?;
            f.sync_all()?;
            if index.len() < HEADER_SIZE {
                index.resize(HEADER_SIZE, 0);
            }
            index[..HEADER_SIZE].copy_from_slice(&header(INDEX_MAGIC));
        }
        let data_file_len = data.metadata()?.len();
        let mut dhead = [0u8; HEADER_SIZE];
        if data.read_exact_at(&mut dhead, 0).is_err() || !check_header(&dhead, DATA_MAGIC) {
            tracing::warn!(file = %data_path.display(), "segment data file with a damaged header: header rewritten");
            data.write_all_at(&header(DATA_MAGIC), 0)?;
            data.sync_all()?;
        }
        let data_file_len = data_file_len.max(HEADER_SIZE as u64);
        // The write head's records are walked (and their checksums verified); an entry must
        // point at one of them.
        let scanned = if head {
            let s = scan::scan(&data, HEADER_SIZE as u64, data_file_len, &FRAMING, true)?;
            for range in &s.damaged {
                tracing::warn!(
                    file = %data_path.display(),
                    offset = range.start,
                    bytes = range.end - range.start,
                    "corrupt segment records skipped (not a torn tail: valid records follow, and are kept)"
                );
            }
            Some(s)
        } else {
            None
        };
        let records: std::collections::HashMap<u64, u64> = scanned
            .iter()
            .flat_map(|s| s.records.iter().map(|rec| (rec.offset, rec.len)))
            .collect();
        let tail = scanned.as_ref().and_then(|s| s.tail);
        let mut state = SegmentState::new(tail.unwrap_or(data_file_len));
        let mut zero = Vec::new();
        // The highest live slot and where its record ends.
        let mut highest_live = None;
        for i in 0..ENTRIES {
            let at = HEADER_SIZE + i as usize * ENTRY_SIZE;
            let Some(raw) = index.get(at..at + ENTRY_SIZE) else {
                break;
            };
            if raw.iter().all(|&b| b == 0) {
                continue;
            }
            let seq = seg * ENTRIES + i;
            let verdict = match Entry::decode(raw) {
                None => Err(Dropped::Lost),
                Some(e) if !e.persistent => Err(Dropped::Transient),
                Some(e) => {
                    let end = e.record_offset + u64::from(e.record_len);
                    let in_bounds = e.record_offset >= HEADER_SIZE as u64 && end <= data_file_len;
                    let exact = records.get(&e.record_offset) == Some(&u64::from(e.record_len));
                    match &scanned {
                        _ if !in_bounds => Err(Dropped::Lost),
                        None => Ok(e),
                        Some(_) if exact => Ok(e),
                        // Written past the tear: never promised (or not synced).
                        Some(_) if tail.is_some_and(|t| end > t) => Err(Dropped::Torn),
                        Some(_) => Err(Dropped::Lost),
                    }
                }
            };
            match verdict {
                Ok(e) => {
                    highest_live = Some((i, e.record_offset + u64::from(e.record_len)));
                    state.set(i, true);
                    state.live_count += 1;
                    if let Some(id) = e.shared {
                        state.shared.insert(i as u16, id);
                        r.shared_refs.push(id);
                        r.shared_seqs.push((seq, e.body_len));
                    }
                    r.count += 1;
                    r.bytes += u64::from(e.body_len);
                    first.get_or_insert(seq);
                    r.next_seq = r.next_seq.max(seq + 1);
                }
                Err(why) => {
                    r.dropped += 1;
                    match why {
                        Dropped::Lost => r.lost += 1,
                        Dropped::Torn => r.torn += 1,
                        Dropped::Transient => {}
                    }
                    zero.push(i);
                }
            }
        }
        if let Some(s) = &scanned {
            // Each record after the last live one has its own slot above the last live
            // slot, written when it was appended (acks zero a slot, they never shorten the
            // file): an index shorter than that was cut, and those messages lost.
            let slots = (index.len().saturating_sub(HEADER_SIZE) / ENTRY_SIZE) as u64;
            let (live_slots, live_end) =
                highest_live.map_or((0, HEADER_SIZE as u64), |(i, end)| (i + 1, end));
            let after = s
                .records
                .iter()
                .filter(|rec| rec.offset >= live_end)
                .count() as u64;
            if live_slots + after > slots {
                let missing = live_slots + after - slots;
                tracing::warn!(
                    file = %index_path.display(),
                    missing,
                    "segment index cut short: records past its end have no entry (or a crash \
                     cut the index writes of unconfirmed messages)"
                );
                r.dropped += missing;
                r.lost += missing;
            }
        }
        if let Some(tail) = tail {
            tracing::warn!(
                file = %data_path.display(),
                offset = tail,
                bytes = data_file_len - tail,
                "truncating a torn data-file tail"
            );
            data.set_len(tail)?;
            data.sync_all()?;
        }
        if !zero.is_empty() {
            let index_file = File::options().write(true).open(&index_path)?;
            for i in zero {
                index_file.write_all_at(
                    &[0u8; ENTRY_SIZE],
                    (HEADER_SIZE + i as usize * ENTRY_SIZE) as u64,
                )?;
            }
            index_file.sync_all()?;
        }
        if state.live_count == 0 {
            fs::remove_file(&index_path)?;
            fs::remove_file(&data_path)?;
            self.dir_dirty = true;
            return Ok(None);
        }
        Ok(Some(state))
    }

    fn files(&mut self, seg: u64) -> io::Result<SegmentFiles> {
        if let Some((_, f)) = self.open.iter().find(|(s, _)| *s == seg) {
            return Ok(f.clone());
        }
        let index_path = seg_path(&self.dir, seg, "qi");
        let data_path = seg_path(&self.dir, seg, "qd");
        let fresh = !index_path.exists();
        let mut opts = OpenOptions::new();
        opts.read(true).write(true).create(true);
        let index = opts.open(&index_path)?;
        let data = opts.open(&data_path)?;
        if fresh {
            let j = self.journal.as_ref();
            journal::write_at(j, &index, &index_path, 0, &header(INDEX_MAGIC))?;
            journal::write_at(j, &data, &data_path, 0, &header(DATA_MAGIC))?;
            self.dir_dirty = true;
        }
        let files = SegmentFiles {
            index: Arc::new(index),
            data: Arc::new(data),
        };
        if self.open.len() >= OPEN_SEGMENTS {
            // Keep the write head (highest segment) open; evict the oldest other.
            let head = self.segments.keys().next_back().copied();
            if let Some(pos) = self.open.iter().position(|(s, _)| Some(*s) != head) {
                self.open.remove(pos);
            }
        }
        self.open.push((seg, files.clone()));
        Ok(files)
    }

    /// Buffers message `seq`. `shared`: the body's id in the shared store (bodies at or above
    /// `embed_below`), which the caller wrote there.
    pub fn append(
        &mut self,
        seq: u64,
        m: &Message,
        shared: Option<u64>,
        expires_at: Option<u64>,
    ) -> io::Result<()> {
        let seg = seq / ENTRIES;
        if !self.data_buf.is_empty() && self.data_seg != seg {
            self.flush()?;
        }
        if !self.segments.contains_key(&seg) {
            self.files(seg)?;
            self.segments
                .insert(seg, SegmentState::new(HEADER_SIZE as u64));
        }
        let Some(state) = self.segments.get_mut(&seg) else {
            return Err(io::Error::other("segment vanished"));
        };
        if self.data_buf.is_empty() {
            self.data_seg = seg;
            self.data_at = state.data_len;
        }
        self.scratch.clear();
        self.scratch
            .extend_from_slice(&expires_at.unwrap_or(NO_EXPIRY).to_le_bytes());
        encode_message(m, shared.is_none(), &mut self.scratch);
        let offset = state.data_len;
        let before = self.data_buf.len();
        frame_record(&self.scratch, &mut self.data_buf);
        let record_len = (self.data_buf.len() - before) as u32;
        state.data_len += u64::from(record_len);
        let i = seq % ENTRIES;
        if !state.is_live(i) {
            state.live_count += 1;
        }
        state.set(i, true);
        if let Some(id) = shared {
            state.shared.insert(i as u16, id);
        }
        let entry = Entry {
            shared,
            persistent: self.keep_all || m.properties.is_persistent(),
            record_len,
            record_offset: offset,
            body_len: u32::try_from(m.body_len()).unwrap_or(u32::MAX),
        };
        self.index_buf.insert(seq, entry.encode());
        if self.data_buf.len() + self.index_buf.len() * ENTRY_SIZE >= FLUSH_BYTES {
            self.flush()?;
        }
        Ok(())
    }

    /// From now on every entry is written persistent (see `keep_all`).
    pub fn keep_all(&mut self) {
        self.keep_all = true;
    }

    /// Whether bodies of this size go to the shared store.
    pub fn shares(&self, body_len: usize) -> bool {
        body_len >= self.embed_below
    }

    /// Removes message `seq`; returns its shared-store id, if its body lives there. Deletes
    /// the segment's files once nothing in it is live (unless it is the write head).
    pub fn remove(&mut self, seq: u64) -> io::Result<Option<u64>> {
        let seg = seq / ENTRIES;
        let i = seq % ENTRIES;
        let head = self.segments.keys().next_back().copied();
        let Some(state) = self.segments.get_mut(&seg) else {
            return Ok(None);
        };
        if !state.is_live(i) {
            return Ok(None);
        }
        state.set(i, false);
        state.live_count -= 1;
        let shared = state.shared.remove(&(i as u16));
        if state.live_count == 0 && Some(seg) != head {
            self.drop_segment(seg)?;
        } else {
            self.index_buf.insert(seq, [0u8; ENTRY_SIZE]);
            if self.index_buf.len() * ENTRY_SIZE >= FLUSH_BYTES {
                self.flush()?;
            }
        }
        Ok(shared)
    }

    fn drop_segment(&mut self, seg: u64) -> io::Result<()> {
        self.segments.remove(&seg);
        self.open.retain(|(s, _)| *s != seg);
        let lo = seg * ENTRIES;
        let rest = self.index_buf.split_off(&(lo + ENTRIES));
        self.index_buf.split_off(&lo);
        self.index_buf.extend(rest);
        if self.data_seg == seg {
            self.data_buf.clear();
        }
        for ext in ["qi", "qd"] {
            let path = seg_path(&self.dir, seg, ext);
            journal::with(self.journal.as_ref(), |j| j.delete_file(&path))?;
            fs::remove_file(&path)?;
        }
        self.dir_dirty = true;
        Ok(())
    }

    /// Removes every live message with a sequence number >= `from`; returns the shared ids
    /// released.
    pub fn remove_from(&mut self, from: u64) -> io::Result<Vec<u64>> {
        let mut released = Vec::new();
        let live: Vec<u64> = self.live_from(from, usize::MAX);
        for seq in live {
            if let Some(id) = self.remove(seq)? {
                released.push(id);
            }
        }
        Ok(released)
    }

    /// Up to `max` live sequence numbers >= `from`, in order.
    fn live_from(&self, from: u64, max: usize) -> Vec<u64> {
        let mut out = Vec::new();
        for (&seg, state) in self.segments.range(from / ENTRIES..) {
            let start = if seg == from / ENTRIES {
                from % ENTRIES
            } else {
                0
            };
            for i in start..ENTRIES {
                if out.len() >= max {
                    return out;
                }
                if state.is_live(i) {
                    out.push(seg * ENTRIES + i);
                }
            }
        }
        out
    }

    /// Reads up to `max` live messages with sequence numbers >= `from`, in order. A message
    /// whose record turns out unreadable is removed for good (logged once, never counted
    /// again); returns the shared-store ids those removals released.
    pub fn read(&mut self, from: u64, max: usize, out: &mut Vec<ReadBack>) -> io::Result<Vec<u64>> {
        self.flush()?;
        let mut unreadable = Vec::new();
        let seqs = self.live_from(from, max);
        let mut i = 0;
        while i < seqs.len() {
            let seg = seqs[i] / ENTRIES;
            let mut j = i;
            while j < seqs.len() && seqs[j] / ENTRIES == seg {
                j += 1;
            }
            let files = self.files(seg)?;
            let lo = seqs[i] % ENTRIES;
            let hi = seqs[j - 1] % ENTRIES;
            let mut index = vec![0u8; (hi - lo + 1) as usize * ENTRY_SIZE];
            files
                .index
                .read_exact_at(&mut index, (HEADER_SIZE + lo as usize * ENTRY_SIZE) as u64)?;
            let entries: Vec<(u64, Entry)> = seqs[i..j]
                .iter()
                .filter_map(|&seq| {
                    let at = ((seq % ENTRIES) - lo) as usize * ENTRY_SIZE;
                    Entry::decode(&index[at..at + ENTRY_SIZE]).map(|e| (seq, e))
                })
                .collect();
            // One read for the span of records (they are contiguous in publish order).
            if let (Some(start), Some(end)) = (
                entries.iter().map(|(_, e)| e.record_offset).min(),
                entries
                    .iter()
                    .map(|(_, e)| e.record_offset + u64::from(e.record_len))
                    .max(),
            ) {
                let mut span = vec![0u8; (end - start) as usize];
                files.data.read_exact_at(&mut span, start)?;
                let span = Bytes::from(span);
                for (seq, e) in entries {
                    let at = (e.record_offset - start) as usize;
                    let rec = span.slice(at..at + e.record_len as usize);
                    let Some(payload) = unframe_record(&rec) else {
                        tracing::error!(dir = %self.dir.display(), seq, offset = e.record_offset, "corrupt record: the message is lost, its entry removed");
                        unreadable.push(seq);
                        continue;
                    };
                    let Some(expiry) = payload.get(..8) else {
                        tracing::error!(dir = %self.dir.display(), seq, "short record: the message is lost, its entry removed");
                        unreadable.push(seq);
                        continue;
                    };
                    let mut at = [0u8; 8];
                    at.copy_from_slice(expiry);
                    let expires_at = Some(u64::from_le_bytes(at)).filter(|&a| a != NO_EXPIRY);
                    let payload = payload.slice(8..);
                    let body = match e.shared {
                        Some(id) => Body::Shared(payload, id),
                        None => match decode_message(&payload, None) {
                            Ok(m) => Body::Whole(Box::new(m)),
                            Err(err) => {
                                tracing::error!(dir = %self.dir.display(), seq, %err, "undecodable record: the message is lost, its entry removed");
                                unreadable.push(seq);
                                continue;
                            }
                        },
                    };
                    out.push(ReadBack {
                        seq,
                        expires_at,
                        body,
                    });
                }
            }
            i = j;
        }
        let mut released = Vec::new();
        for seq in unreadable {
            released.extend(self.remove(seq)?);
        }
        Ok(released)
    }

    /// Writes the buffers out (no fsync).
    pub fn flush(&mut self) -> io::Result<()> {
        if !self.data_buf.is_empty() {
            let files = self.files(self.data_seg)?;
            let path = seg_path(&self.dir, self.data_seg, "qd");
            journal::write_at(
                self.journal.as_ref(),
                &files.data,
                &path,
                self.data_at,
                &self.data_buf,
            )?;
            self.data_buf.clear();
            self.dirty.insert(self.data_seg);
        }
        if self.index_buf.is_empty() {
            return Ok(());
        }
        // Runs of consecutive entries go out in one write each. On an error, the entries not
        // yet written stay buffered for the next flush (a retry rewrites the same bytes).
        let writes = std::mem::take(&mut self.index_buf);
        let mut runs: Vec<(u64, Vec<u8>)> = Vec::new();
        let mut prev: Option<u64> = None;
        for (seq, bytes) in &writes {
            let contiguous = prev.is_some_and(|p| p + 1 == *seq && p / ENTRIES == seq / ENTRIES);
            match runs.last_mut() {
                Some((_, run)) if contiguous => run.extend_from_slice(bytes),
                _ => runs.push((*seq, bytes.to_vec())),
            }
            prev = Some(*seq);
        }
        for (first, run) in runs {
            if let Err(e) = self.write_index(first, &run) {
                self.index_buf.extend(writes.range(first..));
                return Err(e);
            }
        }
        Ok(())
    }

    fn write_index(&mut self, first_seq: u64, bytes: &[u8]) -> io::Result<()> {
        let seg = first_seq / ENTRIES;
        if !self.segments.contains_key(&seg) {
            return Ok(()); // dropped meanwhile
        }
        let files = self.files(seg)?;
        let at = HEADER_SIZE as u64 + (first_seq % ENTRIES) * ENTRY_SIZE as u64;
        let path = seg_path(&self.dir, seg, "qi");
        journal::write_at(self.journal.as_ref(), &files.index, &path, at, bytes)?;
        self.dirty.insert(seg);
        Ok(())
    }

    /// Flushes, then hands over the paths of the files written since the last call (for
    /// the sync thread; segments deleted meanwhile are left out) and whether the directory
    /// changed.
    pub fn take_dirty(&mut self) -> io::Result<(Vec<PathBuf>, Option<PathBuf>)> {
        self.flush()?;
        let dir = std::mem::take(&mut self.dir_dirty).then(|| self.dir.clone());
        let mut paths = Vec::new();
        for seg in std::mem::take(&mut self.dirty) {
            if self.segments.contains_key(&seg) {
                paths.push(seg_path(&self.dir, seg, "qd"));
                paths.push(seg_path(&self.dir, seg, "qi"));
            }
        }
        Ok((paths, dir))
    }

    /// Closes the open segment files (they reopen on demand): bounds file descriptors when
    /// many queues hold messages. Buffered writes are written out first.
    pub fn close_files(&mut self) -> io::Result<()> {
        self.flush()?;
        self.open.clear();
        Ok(())
    }

    /// Shared-store ids of the live entries (released when the queue is deleted).
    pub fn live_shared(&self) -> Vec<u64> {
        self.segments
            .values()
            .flat_map(|s| s.shared.values().copied())
            .collect()
    }

    /// Deletes the whole log: the directory is renamed into `trash` (instant, so the queue
    /// is gone for a restart at once) and removed by a background thread, so deleting a queue
    /// of 10M messages does not stall the broker for the seconds `unlink` takes.
    pub fn destroy(self, trash: &Path) -> io::Result<()> {
        journal::with(self.journal.as_ref(), |j| j.delete_dir(&self.dir))?;
        fs::create_dir_all(trash)?;
        let name = self
            .dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let target = trash.join(format!("{name}-{}", std::process::id()));
        let target = (0..)
            .map(|n| target.with_extension(n.to_string()))
            .find(|t| !t.exists())
            .unwrap_or(target);
        fs::rename(&self.dir, &target)?;
        std::thread::Builder::new()
            .name("warren-trash".into())
            .spawn(move || {
                if let Err(e) = fs::remove_dir_all(&target) {
                    tracing::warn!(dir = %target.display(), error = %e, "cannot delete a deleted queue's files");
                }
            })?;
        Ok(())
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl From<DecodeError> for io::Error {
    fn from(e: DecodeError) -> io::Error {
        io::Error::new(io::ErrorKind::InvalidData, e)
    }
}
