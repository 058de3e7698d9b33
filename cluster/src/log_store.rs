//! The durable Raft log and vote of one group: one redb file (docs/storage.md, "Cluster").
//!
//! Every write is its own redb transaction committed with `Durability::Immediate` (an fsync)
//! before openraft is told it is done: an append is acknowledged to the leader only once it
//! is on disk, which is what makes a majority's acknowledgement mean "durable". redb calls
//! block, so they run on tokio's blocking pool.

use std::fmt::Debug;
use std::ops::{Bound, RangeBounds};
use std::path::Path;
use std::sync::Arc;

use openraft::storage::{LogFlushed, RaftLogStorage};
use openraft::{
    AnyError, Entry, LogId, LogState, OptionalSend, RaftLogId, RaftLogReader, StorageError,
    StorageIOError, Vote,
};
use redb::{Database, Durability, ReadableDatabase, ReadableTable, TableDefinition};

use crate::{NodeId, TypeConfig};

/// Log index -> the entry, JSON.
const LOG: TableDefinition<u64, &[u8]> = TableDefinition::new("log");
/// "vote", "committed", "purged" -> JSON.
const META: TableDefinition<&str, &[u8]> = TableDefinition::new("meta");

/// Entries read for one `try_get_log_entries` call at most: openraft asks for bounded
/// ranges already (max_payload_entries); this keeps a bad range from reading the whole log.
const MAX_READ: u64 = 4096;

/// The latest entries kept in memory ([`Recent`]): at most this many bytes of commands...
const RECENT_BYTES: usize = 8 * 1024 * 1024;
/// ...and this many entries.
const RECENT_ENTRIES: usize = 1024;

/// The entries written last, in index order without gaps. openraft reads every entry back
/// right after appending it (the leader once per follower to replicate it, and every
/// member to apply it once committed); from here those reads cost a copy, not a blocking
/// task, a redb read transaction and a decode each.
#[derive(Default)]
struct Recent {
    entries: std::collections::VecDeque<Entry<TypeConfig>>,
    bytes: usize,
}

fn entry_size(e: &Entry<TypeConfig>) -> usize {
    match &e.payload {
        openraft::EntryPayload::Normal(c) => c.0.len() + 64,
        _ => 256,
    }
}

impl Recent {
    fn first(&self) -> Option<u64> {
        self.entries.front().map(|e| e.log_id.index)
    }

    fn push(&mut self, e: Entry<TypeConfig>) {
        if let Some(last) = self.entries.back()
            && last.log_id.index + 1 != e.log_id.index
        {
            // Not the next one (a log rewritten after a truncation): start again from it.
            self.entries.clear();
            self.bytes = 0;
        }
        self.bytes += entry_size(&e);
        self.entries.push_back(e);
        while self.bytes > RECENT_BYTES || self.entries.len() > RECENT_ENTRIES {
            match self.entries.pop_front() {
                Some(old) => self.bytes -= entry_size(&old),
                None => break,
            }
        }
    }

    /// Drops entries from `index` on (a truncation).
    fn truncate(&mut self, index: u64) {
        while self.entries.back().is_some_and(|e| e.log_id.index >= index) {
            if let Some(e) = self.entries.pop_back() {
                self.bytes -= entry_size(&e);
            }
        }
    }

    /// Drops entries up to `index` (a purge).
    fn purge(&mut self, index: u64) {
        while self
            .entries
            .front()
            .is_some_and(|e| e.log_id.index <= index)
        {
            if let Some(e) = self.entries.pop_front() {
                self.bytes -= entry_size(&e);
            }
        }
    }

    /// Entries `start..end` if every one of them that the log has is here (the newest entry
    /// here is the log's last: every append passes through `push`).
    fn get(&self, start: u64, end: u64) -> Option<Vec<Entry<TypeConfig>>> {
        let first = self.first()?;
        let last = self.entries.back()?.log_id.index;
        if start < first {
            return None;
        }
        // A range past the last entry reads what there is, as from the file.
        let end = end.min(last + 1);
        if start >= end {
            return Some(Vec::new());
        }
        let from = (start - first) as usize;
        Some(
            self.entries
                .range(from..from + (end - start) as usize)
                .cloned()
                .collect(),
        )
    }
}

type SErr = StorageError<NodeId>;

/// A group's log and vote, in one redb file. Cheap to clone (the log reader is a clone).
#[derive(Clone)]
pub struct LogStore {
    db: Arc<Database>,
    /// The committed log id openraft last saved (JSON), not yet written: the next append
    /// writes it (`save_committed`).
    committed: Arc<std::sync::Mutex<Option<Vec<u8>>>>,
    recent: Arc<std::sync::Mutex<Recent>>,
}

impl LogStore {
    /// Opens (or creates) the log file at `path`.
    pub fn open(path: &Path) -> Result<Self, redb::Error> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(redb::Error::Io)?;
        }
        let db = Database::create(path)?;
        let mut tx = db.begin_write()?;
        tx.set_durability(Durability::Immediate)?;
        tx.open_table(LOG)?;
        tx.open_table(META)?;
        tx.commit()?;
        Ok(Self {
            db: Arc::new(db),
            committed: Arc::new(std::sync::Mutex::new(None)),
            recent: Arc::new(std::sync::Mutex::new(Recent::default())),
        })
    }

    fn recent(&self) -> std::sync::MutexGuard<'_, Recent> {
        self.recent.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The committed log id noted since the last write, if any (taken: it is written now).
    fn take_committed(&self) -> Option<Vec<u8>> {
        self.committed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
    }

    /// Runs `f` in one durable write transaction on the blocking pool.
    async fn write<F>(&self, f: F) -> Result<(), AnyError>
    where
        F: FnOnce(&redb::WriteTransaction) -> Result<(), redb::Error> + Send + 'static,
    {
        self.write_with(Durability::Immediate, f).await
    }

    /// Runs `f` in one write transaction of the given durability on the blocking pool.
    async fn write_with<F>(&self, durability: Durability, f: F) -> Result<(), AnyError>
    where
        F: FnOnce(&redb::WriteTransaction) -> Result<(), redb::Error> + Send + 'static,
    {
        let db = self.db.clone();
        let r = tokio::task::spawn_blocking(move || -> Result<(), redb::Error> {
            let mut tx = db.begin_write()?;
            tx.set_durability(durability)?;
            f(&tx)?;
            tx.commit()?;
            Ok(())
        })
        .await;
        match r {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(AnyError::new(&e)),
            Err(e) => Err(AnyError::new(&e)),
        }
    }

    async fn read_meta<T: serde::de::DeserializeOwned + Send + 'static>(
        &self,
        key: &'static str,
    ) -> Result<Option<T>, AnyError> {
        let db = self.db.clone();
        let r = tokio::task::spawn_blocking(move || -> Result<Option<T>, AnyError> {
            let tx = db.begin_read().map_err(|e| AnyError::new(&e))?;
            let t = tx.open_table(META).map_err(|e| AnyError::new(&e))?;
            match t.get(key).map_err(|e| AnyError::new(&e))? {
                None => Ok(None),
                Some(v) => serde_json::from_slice(v.value())
                    .map(Some)
                    .map_err(|e| AnyError::new(&e)),
            }
        })
        .await;
        r.map_err(|e| AnyError::new(&e))?
    }

    async fn write_meta<T: serde::Serialize>(
        &self,
        key: &'static str,
        value: &T,
    ) -> Result<(), AnyError> {
        let bytes = serde_json::to_vec(value).map_err(|e| AnyError::new(&e))?;
        self.write(move |tx| {
            tx.open_table(META)?.insert(key, bytes.as_slice())?;
            Ok(())
        })
        .await
    }

    /// The last log id in the file, if any entry is there.
    fn last_entry_id(&self) -> Result<Option<LogId<NodeId>>, AnyError> {
        let tx = self.db.begin_read().map_err(|e| AnyError::new(&e))?;
        let t = tx.open_table(LOG).map_err(|e| AnyError::new(&e))?;
        match t.last().map_err(|e| AnyError::new(&e))? {
            None => Ok(None),
            Some((_, v)) => {
                let e = crate::codec::decode_entry(v.value()).map_err(|e| AnyError::new(&e))?;
                Ok(Some(*e.get_log_id()))
            }
        }
    }
}

fn range_bounds<RB: RangeBounds<u64>>(range: &RB) -> (u64, u64) {
    let start = match range.start_bound() {
        Bound::Included(s) => *s,
        Bound::Excluded(s) => s.saturating_add(1),
        Bound::Unbounded => 0,
    };
    let end = match range.end_bound() {
        Bound::Included(e) => e.saturating_add(1),
        Bound::Excluded(e) => *e,
        Bound::Unbounded => u64::MAX,
    };
    (start, end.min(start.saturating_add(MAX_READ)))
}

impl RaftLogReader<TypeConfig> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry<TypeConfig>>, SErr> {
        let (start, end) = range_bounds(&range);
        if start >= end {
            return Ok(Vec::new());
        }
        if let Some(v) = self.recent().get(start, end) {
            return Ok(v);
        }
        let db = self.db.clone();
        let r = tokio::task::spawn_blocking(move || -> Result<Vec<Entry<TypeConfig>>, AnyError> {
            let tx = db.begin_read().map_err(|e| AnyError::new(&e))?;
            let t = tx.open_table(LOG).map_err(|e| AnyError::new(&e))?;
            let mut out = Vec::new();
            for item in t.range(start..end).map_err(|e| AnyError::new(&e))? {
                let (_, v) = item.map_err(|e| AnyError::new(&e))?;
                out.push(crate::codec::decode_entry(v.value()).map_err(|e| AnyError::new(&e))?);
            }
            Ok(out)
        })
        .await
        .map_err(|e| AnyError::new(&e));
        match r {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) | Err(e) => Err(StorageIOError::read_logs(e).into()),
        }
    }
}

impl RaftLogStorage<TypeConfig> for LogStore {
    type LogReader = LogStore;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, SErr> {
        let purged: Option<LogId<NodeId>> = self
            .read_meta("purged")
            .await
            .map_err(StorageIOError::read_logs)?;
        let this = self.clone();
        let last = tokio::task::spawn_blocking(move || this.last_entry_id())
            .await
            .map_err(|e| StorageIOError::read_logs(AnyError::new(&e)))?
            .map_err(StorageIOError::read_logs)?;
        Ok(LogState {
            last_purged_log_id: purged,
            last_log_id: last.or(purged),
        })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote<NodeId>) -> Result<(), SErr> {
        self.write_meta("vote", vote)
            .await
            .map_err(|e| StorageIOError::write_vote(e).into())
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<NodeId>>, SErr> {
        self.read_meta("vote")
            .await
            .map_err(|e| StorageIOError::read_vote(e).into())
    }

    async fn save_committed(&mut self, committed: Option<LogId<NodeId>>) -> Result<(), SErr> {
        // Lets a restarted node apply what it knows is committed without waiting for a
        // leader. Losing the latest value in a crash is harmless (the leader tells again),
        // so it costs no transaction of its own: openraft saves it at every commit, before
        // it applies, so a write here would sit on the path of every confirm (a blocking
        // task and a redb commit per entry on every member). It is kept here and rides on
        // the next append's durable commit.
        let bytes =
            serde_json::to_vec(&committed).map_err(|e| StorageIOError::write(AnyError::new(&e)))?;
        *self.committed.lock().unwrap_or_else(|p| p.into_inner()) = Some(bytes);
        Ok(())
    }

    async fn read_committed(&mut self) -> Result<Option<LogId<NodeId>>, SErr> {
        let noted = self
            .committed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        if let Some(bytes) = noted {
            let c: Option<LogId<NodeId>> = serde_json::from_slice(&bytes)
                .map_err(|e| StorageIOError::read(AnyError::new(&e)))?;
            return Ok(c);
        }
        let c: Option<Option<LogId<NodeId>>> = self
            .read_meta("committed")
            .await
            .map_err(StorageIOError::read)?;
        Ok(c.flatten())
    }

    async fn append<I>(&mut self, entries: I, callback: LogFlushed<TypeConfig>) -> Result<(), SErr>
    where
        I: IntoIterator<Item = Entry<TypeConfig>> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let mut encoded = Vec::new();
        let mut kept = Vec::new();
        for e in entries {
            let mut bytes = Vec::new();
            crate::codec::encode_entry(&e, &mut bytes).map_err(|err| {
                StorageIOError::write_log_entry(*e.get_log_id(), AnyError::new(&err))
            })?;
            encoded.push((e.get_log_id().index, bytes));
            kept.push(e);
        }
        // The committed log id noted since the last write rides on this one.
        let committed = self.take_committed();
        let r = self
            .write(move |tx| {
                let mut t = tx.open_table(LOG)?;
                for (index, bytes) in &encoded {
                    t.insert(*index, bytes.as_slice())?;
                }
                if let Some(c) = &committed {
                    tx.open_table(META)?.insert("committed", c.as_slice())?;
                }
                Ok(())
            })
            .await;
        // The commit above fsync'd (Durability::Immediate): only now is the append flushed.
        match r {
            Ok(()) => {
                let mut recent = self.recent();
                for e in kept {
                    recent.push(e);
                }
                drop(recent);
                callback.log_io_completed(Ok(()));
                Ok(())
            }
            Err(e) => {
                callback.log_io_completed(Err(std::io::Error::other(e.to_string())));
                Err(StorageIOError::write_logs(e).into())
            }
        }
    }

    async fn truncate(&mut self, log_id: LogId<NodeId>) -> Result<(), SErr> {
        let from = log_id.index;
        self.recent().truncate(from);
        self.write(move |tx| {
            let mut t = tx.open_table(LOG)?;
            t.retain_in(from.., |_, _| false)?;
            Ok(())
        })
        .await
        .map_err(|e| StorageIOError::write_logs(e).into())
    }

    async fn purge(&mut self, log_id: LogId<NodeId>) -> Result<(), SErr> {
        let bytes = serde_json::to_vec(&log_id)
            .map_err(|e| StorageIOError::write_logs(AnyError::new(&e)))?;
        let upto = log_id.index;
        self.recent().purge(upto);
        self.write(move |tx| {
            tx.open_table(META)?.insert("purged", bytes.as_slice())?;
            tx.open_table(LOG)?.retain_in(..=upto, |_, _| false)?;
            Ok(())
        })
        .await
        .map_err(|e| StorageIOError::write_logs(e).into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use openraft::{CommittedLeaderId, EntryPayload};

    fn entry(term: u64, index: u64) -> Entry<TypeConfig> {
        Entry {
            log_id: LogId::new(CommittedLeaderId::new(term, 1), index),
            payload: EntryPayload::Normal(crate::Command(vec![index as u8; 10])),
        }
    }

    fn ids(v: &[Entry<TypeConfig>]) -> Vec<(u64, u64)> {
        v.iter()
            .map(|e| (e.log_id.leader_id.term, e.log_id.index))
            .collect()
    }

    #[test]
    fn recent_entries_follow_appends_truncations_and_purges() {
        let mut r = Recent::default();
        assert!(r.get(0, 10).is_none(), "nothing here: read the file");
        for i in 1..=10 {
            r.push(entry(1, i));
        }
        assert_eq!(ids(&r.get(3, 6).expect("here")), [(1, 3), (1, 4), (1, 5)]);
        // Past the last entry: what there is (the file has no more either).
        assert_eq!(ids(&r.get(9, 100).expect("here")), [(1, 9), (1, 10)]);
        assert_eq!(r.get(11, 20).expect("here").len(), 0);
        // Before the first kept entry: the file.
        r.purge(4);
        assert!(r.get(4, 6).is_none());
        assert_eq!(ids(&r.get(5, 6).expect("here")), [(1, 5)]);
        // A truncation, then the new leader's entries from there.
        r.truncate(8);
        r.push(entry(2, 8));
        assert_eq!(ids(&r.get(6, 100).expect("here")), [(1, 6), (1, 7), (2, 8)]);
        // An entry that does not follow the last (never from openraft): start again from it.
        r.push(entry(2, 20));
        assert!(r.get(8, 9).is_none());
        assert_eq!(ids(&r.get(20, 21).expect("here")), [(2, 20)]);
        // Bounded: the oldest go first.
        for i in 21..21 + RECENT_ENTRIES as u64 + 10 {
            r.push(entry(2, i));
        }
        assert_eq!(r.entries.len(), RECENT_ENTRIES);
        assert_eq!(r.first(), Some(31));
        r.purge(u64::MAX);
        assert_eq!((r.entries.len(), r.bytes), (0, 0));
    }
}
