//! The state machine of a group: a byte-level trait each group type implements (the
//! metadata map now, quorum queues later), and the openraft adapter around it that tracks
//! the applied log id and membership and keeps the latest snapshot on disk.
//!
//! The state itself lives in memory; what survives a restart is the latest snapshot (a file
//! beside the log, written then renamed) plus the log after it, which openraft re-applies.

use std::io::{Cursor, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use openraft::storage::RaftStateMachine;
use openraft::{
    AnyError, Entry, EntryPayload, LogId, OptionalSend, RaftSnapshotBuilder, Snapshot,
    SnapshotMeta, StorageError, StorageIOError, StoredMembership,
};
use serde::{Deserialize, Serialize};

use crate::{Command, NodeId, Reply, TypeConfig};

/// A group's replicated state. Must be deterministic: the same commands in the same order
/// give the same state and replies on every node.
pub trait StateMachine: Send + Sync + 'static {
    /// Applies one committed command (at log `index`) and returns the reply for the client
    /// that proposed it. A command it cannot decode gets an error reply, never a panic: the
    /// log is replicated, so every node must take the same path.
    fn apply(&mut self, index: u64, command: &[u8]) -> Vec<u8>;
    /// The whole state, serialized.
    fn snapshot(&self) -> Vec<u8>;
    /// Replaces the state with a [`StateMachine::snapshot`]'s.
    fn restore(&mut self, snapshot: &[u8]) -> Result<(), String>;
}

type SErr = StorageError<NodeId>;
type Membership = StoredMembership<NodeId, openraft::BasicNode>;

/// The snapshot file's contents (JSON): openraft's metadata and the state machine's bytes.
#[derive(Serialize, Deserialize)]
struct StoredSnapshot {
    meta: SnapshotMeta<NodeId, openraft::BasicNode>,
    data: Vec<u8>,
}

struct Inner<S> {
    sm: S,
    last_applied: Option<LogId<NodeId>>,
    membership: Membership,
    snapshot: Option<StoredSnapshot>,
    snapshots_built: u64,
}

/// The openraft state machine of a group around a [`StateMachine`].
pub struct StateMachineStore<S> {
    inner: Arc<Mutex<Inner<S>>>,
    /// Where the latest snapshot is kept; `None`: memory only (tests of the network).
    path: Option<PathBuf>,
}

impl<S> Clone for StateMachineStore<S> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            path: self.path.clone(),
        }
    }
}

/// Why a snapshot file could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotFileError {
    #[error("snapshot file {0}: {1}")]
    Io(PathBuf, std::io::Error),
    #[error("snapshot file {0}: {1}")]
    Decode(PathBuf, serde_json::Error),
    #[error("snapshot file {0}: the state machine refused it: {1}")]
    Restore(PathBuf, String),
}

impl<S: StateMachine> StateMachineStore<S> {
    /// A state machine store keeping its snapshot at `path` (loaded now if it exists).
    pub fn open(path: Option<&Path>, mut sm: S) -> Result<Self, SnapshotFileError> {
        let mut last_applied = None;
        let mut membership = Membership::default();
        let mut snapshot = None;
        if let Some(p) = path {
            match std::fs::read(p) {
                Ok(bytes) => {
                    let s: StoredSnapshot = serde_json::from_slice(&bytes)
                        .map_err(|e| SnapshotFileError::Decode(p.into(), e))?;
                    sm.restore(&s.data)
                        .map_err(|e| SnapshotFileError::Restore(p.into(), e))?;
                    last_applied = s.meta.last_log_id;
                    membership = s.meta.last_membership.clone();
                    snapshot = Some(s);
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(SnapshotFileError::Io(p.into(), e)),
            }
        }
        Ok(Self {
            inner: Arc::new(Mutex::new(Inner {
                sm,
                last_applied,
                membership,
                snapshot,
                snapshots_built: 0,
            })),
            path: path.map(Path::to_path_buf),
        })
    }

    /// Reads the state machine (e.g. to serve a query) under its lock.
    pub fn with<T>(&self, f: impl FnOnce(&S) -> T) -> T {
        f(&self.lock().sm)
    }

    /// The log id of the last applied entry.
    pub fn last_applied(&self) -> Option<LogId<NodeId>> {
        self.lock().last_applied
    }

    fn lock(&self) -> MutexGuard<'_, Inner<S>> {
        // A panic while holding the lock leaves the state as it was before the entry (apply
        // is one call): keep serving it rather than poisoning every later call.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Writes `bytes` to `path` atomically and durably: a temporary file, fsync, rename, fsync
/// of the directory. The temporary file is `path` with `.tmp` appended, so two files of one
/// directory that differ only in their extension never share it.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = std::path::PathBuf::from(tmp);
    {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, path)?;
    std::fs::File::open(dir)?.sync_all()
}

impl<S: StateMachine> StateMachineStore<S> {
    fn persist(&self, s: &StoredSnapshot) -> Result<(), SErr> {
        let Some(path) = &self.path else {
            return Ok(());
        };
        let sig = Some(s.meta.signature());
        let bytes = serde_json::to_vec(s)
            .map_err(|e| StorageIOError::write_snapshot(sig.clone(), AnyError::new(&e)))?;
        write_atomic(path, &bytes)
            .map_err(|e| StorageIOError::write_snapshot(sig, AnyError::new(&e)).into())
    }
}

impl<S: StateMachine> RaftSnapshotBuilder<TypeConfig> for StateMachineStore<S> {
    async fn build_snapshot(&mut self) -> Result<Snapshot<TypeConfig>, SErr> {
        let stored = {
            let mut g = self.lock();
            g.snapshots_built += 1;
            let data = g.sm.snapshot();
            let snapshot_id = match g.last_applied {
                Some(l) => format!("{}-{}-{}", l.leader_id, l.index, g.snapshots_built),
                None => format!("none-{}", g.snapshots_built),
            };
            StoredSnapshot {
                meta: SnapshotMeta {
                    last_log_id: g.last_applied,
                    last_membership: g.membership.clone(),
                    snapshot_id,
                },
                data,
            }
        };
        // Written outside the lock: apply goes on while the file is written.
        let this = self.clone();
        let stored = tokio::task::spawn_blocking(move || this.persist(&stored).map(|()| stored))
            .await
            .map_err(|e| StorageIOError::write_snapshot(None, AnyError::new(&e)))??;
        let snapshot = Snapshot {
            meta: stored.meta.clone(),
            snapshot: Box::new(Cursor::new(stored.data.clone())),
        };
        self.lock().snapshot = Some(stored);
        Ok(snapshot)
    }
}

impl<S: StateMachine> RaftStateMachine<TypeConfig> for StateMachineStore<S> {
    type SnapshotBuilder = Self;

    async fn applied_state(&mut self) -> Result<(Option<LogId<NodeId>>, Membership), SErr> {
        let g = self.lock();
        Ok((g.last_applied, g.membership.clone()))
    }

    async fn apply<I>(&mut self, entries: I) -> Result<Vec<Reply>, SErr>
    where
        I: IntoIterator<Item = Entry<TypeConfig>> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let mut g = self.lock();
        let mut replies = Vec::new();
        for e in entries {
            g.last_applied = Some(e.log_id);
            match e.payload {
                EntryPayload::Blank => replies.push(Reply::default()),
                EntryPayload::Normal(Command(cmd)) => {
                    replies.push(Reply(g.sm.apply(e.log_id.index, &cmd)));
                }
                EntryPayload::Membership(m) => {
                    g.membership = StoredMembership::new(Some(e.log_id), m);
                    replies.push(Reply::default());
                }
            }
        }
        Ok(replies)
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        self.clone()
    }

    async fn begin_receiving_snapshot(&mut self) -> Result<Box<Cursor<Vec<u8>>>, SErr> {
        Ok(Box::new(Cursor::new(Vec::new())))
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta<NodeId, openraft::BasicNode>,
        snapshot: Box<Cursor<Vec<u8>>>,
    ) -> Result<(), SErr> {
        let stored = StoredSnapshot {
            meta: meta.clone(),
            data: snapshot.into_inner(),
        };
        // On disk first: if we crash after, the restart loads this state.
        let this = self.clone();
        let stored = tokio::task::spawn_blocking(move || this.persist(&stored).map(|()| stored))
            .await
            .map_err(|e| StorageIOError::write_snapshot(None, AnyError::new(&e)))??;
        let mut g = self.lock();
        g.sm.restore(&stored.data)
            .map_err(|e| StorageIOError::write_state_machine(AnyError::error(e)))?;
        // A member that was behind the leader's purged log (or just added) catches up this
        // way: one line, for operators and the tests.
        tracing::info!(
            index = meta.last_log_id.map_or(0, |l| l.index),
            bytes = stored.data.len(),
            "cluster: installed a snapshot from the leader"
        );
        g.last_applied = meta.last_log_id;
        g.membership = meta.last_membership.clone();
        g.snapshot = Some(stored);
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot<TypeConfig>>, SErr> {
        let g = self.lock();
        Ok(g.snapshot.as_ref().map(|s| Snapshot {
            meta: s.meta.clone(),
            snapshot: Box::new(Cursor::new(s.data.clone())),
        }))
    }
}
