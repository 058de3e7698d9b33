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

type SErr = StorageError<NodeId>;

/// A group's log and vote, in one redb file. Cheap to clone (the log reader is a clone).
#[derive(Clone)]
pub struct LogStore {
    db: Arc<Database>,
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
        Ok(Self { db: Arc::new(db) })
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
                let e: Entry<TypeConfig> =
                    serde_json::from_slice(v.value()).map_err(|e| AnyError::new(&e))?;
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
        let db = self.db.clone();
        let r = tokio::task::spawn_blocking(move || -> Result<Vec<Entry<TypeConfig>>, AnyError> {
            let tx = db.begin_read().map_err(|e| AnyError::new(&e))?;
            let t = tx.open_table(LOG).map_err(|e| AnyError::new(&e))?;
            let mut out = Vec::new();
            for item in t.range(start..end).map_err(|e| AnyError::new(&e))? {
                let (_, v) = item.map_err(|e| AnyError::new(&e))?;
                out.push(serde_json::from_slice(v.value()).map_err(|e| AnyError::new(&e))?);
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
        // so it costs no fsync of its own: a non-durable commit that the next append's
        // durable commit makes durable with it (redb's Durability::None).
        let bytes =
            serde_json::to_vec(&committed).map_err(|e| StorageIOError::write(AnyError::new(&e)))?;
        self.write_with(Durability::None, move |tx| {
            tx.open_table(META)?.insert("committed", bytes.as_slice())?;
            Ok(())
        })
        .await
        .map_err(|e| StorageIOError::write(e).into())
    }

    async fn read_committed(&mut self) -> Result<Option<LogId<NodeId>>, SErr> {
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
        for e in entries {
            let bytes = serde_json::to_vec(&e).map_err(|err| {
                StorageIOError::write_log_entry(*e.get_log_id(), AnyError::new(&err))
            })?;
            encoded.push((e.get_log_id().index, bytes));
        }
        let r = self
            .write(move |tx| {
                let mut t = tx.open_table(LOG)?;
                for (index, bytes) in &encoded {
                    t.insert(*index, bytes.as_slice())?;
                }
                Ok(())
            })
            .await;
        // The commit above fsync'd (Durability::Immediate): only now is the append flushed.
        match r {
            Ok(()) => {
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
        self.write(move |tx| {
            tx.open_table(META)?.insert("purged", bytes.as_slice())?;
            tx.open_table(LOG)?.retain_in(..=upto, |_, _| false)?;
            Ok(())
        })
        .await
        .map_err(|e| StorageIOError::write_logs(e).into())
    }
}
