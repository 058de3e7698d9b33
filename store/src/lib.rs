//! `warren-store`: the native [`Store`] behind `warren serve --data-dir`.
//!
//! - definitions in redb (`definitions.redb`), see [`definitions`];
//! - one message log per queue (`queues/<hash>/`, segment files), see [`segment`];
//! - a write-ahead journal every durable segment write is recorded in, see [`journal`];
//! - streams: append-only chunk logs with read-ahead readers, see [`stream`];
//! - a sync thread that makes written data durable (fdatasync of the journal, shared bodies,
//!   new directories, and an `Immediate` redb commit) and reports each epoch back through a
//!   callback: group commit, so one fsync covers every message written while the previous
//!   one ran. Segment files are fsynced at journal checkpoints.
//!
//! Layout and byte formats: docs/storage.md.

pub mod definitions;
mod guard;
pub mod journal;
mod journal_audit;
pub mod lock;
pub mod metrics;
pub mod mqtt_writer;
mod open_error;
mod pending;
pub mod record;
pub mod retained;
mod scan;
pub mod schedule;
pub mod segment;
pub mod sessions;
pub mod shared;
pub mod stream;
pub mod stream_host;

pub use open_error::OpenError;
pub use stream_host::StreamHost;

use definitions::DefinitionStore;
use segment::{Body, QueueLog};
use shared::SharedStore;
use std::collections::{BTreeSet, HashMap};
use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::mpsc;
use warren_core::ids::QueueId;
use warren_core::message::Message;
use warren_core::store::{
    DefinitionChange, Definitions, QueueRecovery, Store, StoreError, StoredMessage,
};

/// Queues whose segment files stay open between batches: each keeps at most 4 segments (8
/// descriptors) open, so this bounds the store at ~2k descriptors however many queues there
/// are (the process may hold 20k here, most of them for connections).
const OPEN_QUEUES: usize = 256;

/// Called by the sync thread when the sync of an epoch completed (or failed).
pub type SyncCallback = Box<dyn Fn(u64, Result<(), SyncError>) + Send>;

/// Why the sync of an epoch did not make everything it covered durable: its confirms become
/// nacks either way; only a failure of the store itself blocks publishers for a while (the
/// `store` resource alarm).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SyncError {
    /// This node's disk failed the writes or their fsync.
    #[error("{0}")]
    Store(String),
    /// A store layer over the disk (quorum-queue replication) could not have the writes of
    /// one queue committed: its group's leadership moved. Nothing is wrong with the store,
    /// and other queues' publishers must not be blocked for it.
    #[error("not replicated: {0}")]
    NotReplicated(String),
}

/// Work for the sync thread, done in order.
enum Job {
    Sync(Box<SyncJob>),
    /// A journal generation cut between syncs (it grew past its bound while nothing asked
    /// for a sync: acks, transient page-outs): fsync it and its files, then delete it.
    Checkpoint(journal::Checkpoint, Arc<File>),
}

struct SyncJob {
    epoch: u64,
    /// A write this sync was to cover failed: report the epoch failed, fsync nothing.
    failed: Option<String>,
    files: Vec<PathBuf>,
    shared: shared::SharedSync,
    dirs: Vec<PathBuf>,
    definitions: bool,
    /// The definition changes of the epoch, written in its durable commit (`pending`).
    changes: Vec<pending::PendingChange>,
    /// With the journal: the one file whose fdatasync covers every queue write of the epoch,
    /// and a finished generation to checkpoint after.
    journal: Option<journal::JournalSync>,
    /// Streams appended to in the epoch.
    streams: Vec<stream_host::StreamSync>,
    /// The schedule's changes of the epoch, committed after the journal's fdatasync.
    schedule: Option<schedule::ScheduleSync>,
}

/// Storage settings.
#[derive(Clone, Debug)]
pub struct DiskConfig {
    /// Bodies of at least this many bytes go to the shared store (RabbitMQ's
    /// `queue_index_embed_msgs_below`, 4096 by default); smaller ones inline in the queue's
    /// own segment files.
    pub embed_msgs_below: usize,
    /// fsync before confirming (the default). Off: confirms go out once the data is written
    /// to the operating system (it survives a crash of the broker process, not of the
    /// machine), which is what RabbitMQ's classic queues do; lower latency, weaker promise.
    pub fsync: bool,
    /// A journal generation this large is checkpointed (its files fsynced, then deleted).
    pub journal_checkpoint_bytes: u64,
    /// Where stream queues' logs are (`None`: stream declares are refused).
    pub streams: Option<Arc<dyn StreamHost>>,
}

impl Default for DiskConfig {
    fn default() -> DiskConfig {
        DiskConfig {
            embed_msgs_below: 4096,
            fsync: true,
            journal_checkpoint_bytes: journal::CHECKPOINT_BYTES,
            streams: None,
        }
    }
}

struct OpenQueue {
    /// `None`: a transient queue nothing was written to yet. Its log (a directory and a
    /// ~210-byte record) is made at its first write: most transient queues (every clean
    /// MQTT session's) never page a message out, and each idle connection paid for one.
    log: Option<Box<QueueLog>>,
    durable: bool,
    /// Sequence numbers below this were recovered from an earlier run.
    recovered_below: u64,
}

/// See the crate docs.
pub struct DiskStore {
    root: PathBuf,
    config: DiskConfig,
    shared: SharedStore,
    definitions: DefinitionStore,
    definitions_dirty: bool,
    /// Definition changes for the next sync's commit (`pending`).
    pending_definitions: Vec<pending::PendingChange>,
    /// Small records (the log boxed): a hash table keeps up to half its slots empty after
    /// growing, and with one queue per MQTT session inline logs cost ~380 bytes per idle
    /// connection at 10k sessions.
    queues: HashMap<QueueId, OpenQueue>,
    /// Queues written since the last sync started.
    dirty: BTreeSet<QueueId>,
    /// Queues with buffered writes.
    unflushed: BTreeSet<QueueId>,
    /// A write failed since the last sync: the next sync must report failure (its confirms
    /// become nacks), whatever fsync says about the bytes that did get written.
    write_failed: Option<String>,
    /// Queues that may hold open segment files (bounded by `OPEN_QUEUES`).
    with_files: BTreeSet<QueueId>,
    /// Directories whose entries changed (new queue directories).
    dirty_dirs: Vec<PathBuf>,
    /// New queue `name` files.
    dirty_names: Vec<PathBuf>,
    sync_tx: mpsc::SyncSender<Job>,
    /// Stream queues the core opened (their logs are `config.streams`').
    streams: HashMap<QueueId, stream_host::OpenStream>,
    /// The write-ahead journal durable queues write through (`None` with `--fsync off`:
    /// nothing is fsynced then, so recording writes twice would buy nothing).
    journal: Option<journal::SharedJournal>,
    sync_thread: Option<std::thread::JoinHandle<()>>,
    /// Scheduled messages' time index (`schedule.redb`), and what it held at open.
    schedule: schedule::ScheduleIndex,
    schedule_recovery: Option<warren_core::store::ScheduleRecovery>,
}

impl Drop for DiskStore {
    /// Lets the sync thread finish what it was given (a sync, a checkpoint) and release the
    /// definitions database, so the same directory can be opened again at once.
    fn drop(&mut self) {
        let (closed, _) = mpsc::sync_channel(1);
        drop(std::mem::replace(&mut self.sync_tx, closed));
        if let Some(t) = self.sync_thread.take() {
            let _ = t.join();
        }
    }
}

/// FNV-1a: a stable name -> directory hash (std's hasher is randomly seeded per process).
fn fnv64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

fn dir_err(dir: &Path) -> impl FnOnce(std::io::Error) -> OpenError + '_ {
    move |source| OpenError::Dir {
        dir: dir.to_path_buf(),
        source,
    }
}

impl DiskStore {
    /// Opens the store under `root` (created if missing) and loads the definitions to
    /// replay. Messages are recovered queue by queue when the core reopens each queue.
    pub fn open(
        root: &Path,
        config: DiskConfig,
        on_synced: SyncCallback,
    ) -> Result<(DiskStore, Definitions), OpenError> {
        fs::create_dir_all(root.join("queues")).map_err(dir_err(root))?;
        // Transient queues' pages never outlive the process, nor do deleted queues' files.
        let transient = root.join("transient");
        for dir in [&transient, &root.join("trash")] {
            if dir.exists() {
                fs::remove_dir_all(dir).map_err(dir_err(dir))?;
            }
        }
        fs::create_dir_all(&transient).map_err(dir_err(&transient))?;
        // Before anything reads a queue's files: redo what the journal promised.
        let journal = if config.fsync {
            let (j, _) = journal::Journal::open(root, config.journal_checkpoint_bytes)
                .map_err(dir_err(root))?;
            Some(Arc::new(std::sync::Mutex::new(j)))
        } else {
            None
        };
        let defs_path = root.join("definitions.redb");
        let defs_err = |source| OpenError::Definitions {
            path: defs_path.clone(),
            source,
        };
        let definitions = DefinitionStore::open(&defs_path).map_err(defs_err)?;
        let shared_dir = root.join("shared");
        let shared = SharedStore::open(&shared_dir).map_err(|e| {
            if e.kind() == std::io::ErrorKind::InvalidData {
                OpenError::Unreadable {
                    path: shared_dir.clone(),
                    reason: e.to_string(),
                }
            } else {
                dir_err(&shared_dir)(e)
            }
        })?;
        let loaded = match definitions.load() {
            Ok(loaded) => loaded,
            Err(e) => {
                // Closing a damaged database may fail the same way reading it did.
                let _ = guard::catch_quietly(move || drop(definitions));
                return Err(defs_err(e));
            }
        };
        let (schedule, schedule_recovery) =
            schedule::ScheduleIndex::open(root).map_err(|reason| OpenError::Unreadable {
                path: root.join("schedule.redb"),
                reason,
            })?;
        let (sync_tx, sync_rx) = mpsc::sync_channel::<Job>(4);
        let defs = definitions.clone();
        let fsync = config.fsync;
        let sync_thread = std::thread::Builder::new()
            .name("warren-sync".into())
            .spawn(move || sync_thread(sync_rx, defs, fsync, on_synced))
            .map_err(dir_err(root))?;
        Ok((
            DiskStore {
                root: root.to_path_buf(),
                config,
                shared,
                definitions,
                definitions_dirty: false,
                pending_definitions: Vec::new(),
                queues: HashMap::new(),
                dirty: BTreeSet::new(),
                unflushed: BTreeSet::new(),
                write_failed: None,
                with_files: BTreeSet::new(),
                dirty_dirs: Vec::new(),
                dirty_names: Vec::new(),
                streams: HashMap::new(),
                sync_tx,
                journal,
                sync_thread: Some(sync_thread),
                schedule,
                schedule_recovery: Some(schedule_recovery),
            },
            loaded,
        ))
    }

    /// The directory of durable queue `name`: `queues/<fnv64 hex>-<n>`, the first whose
    /// `name` file matches (or a new one).
    fn durable_dir(&mut self, vhost: &str, name: &str) -> std::io::Result<PathBuf> {
        let identity = queue_identity(vhost, name);
        let name = identity.as_slice();
        let base = format!("{:016x}", fnv64(name));
        for n in 0..1024 {
            let dir = self.root.join("queues").join(format!("{base}-{n}"));
            let name_file = dir.join("name");
            match fs::read(&name_file) {
                Ok(stored) if stored == name => return Ok(dir),
                // A directory is named for its queue's hash, so a name that does not hash to
                // it is a damaged name file (a collision's would): repaired, not skipped
                // (skipping it would orphan the queue's messages).
                Ok(stored) if fnv64(&stored) != fnv64(name) && n == 0 => {
                    tracing::warn!(file = %name_file.display(), "damaged queue name file: rewritten");
                    journal::with(self.journal.as_ref(), |j| j.write(&name_file, 0, name))?;
                    fs::write(&name_file, name)?;
                    self.dirty_names.push(name_file);
                    return Ok(dir);
                }
                Ok(_) => continue,
                Err(_) if dir.exists() => {
                    // A directory without its name file: an interrupted creation.
                    journal::with(self.journal.as_ref(), |j| j.write(&name_file, 0, name))?;
                    fs::write(&name_file, name)?;
                    return Ok(dir);
                }
                Err(_) => {
                    // Journalled too: replaying the deletion of an earlier queue of the same
                    // directory must not leave this one without its name.
                    journal::with(self.journal.as_ref(), |j| j.write(&name_file, 0, name))?;
                    fs::create_dir_all(&dir)?;
                    fs::write(&name_file, name)?;
                    // Made durable by the next sync (with the definitions that name the
                    // queue), not here: a declare costs no fsync of its own.
                    self.dirty_names.push(name_file);
                    self.dirty_dirs.push(self.root.join("queues"));
                    self.dirty_dirs.push(dir.clone());
                    return Ok(dir);
                }
            }
        }
        Err(std::io::Error::other(format!(
            "too many hash collisions for queue '{}'",
            String::from_utf8_lossy(name)
        )))
    }

    /// The log of open queue `queue` (`None`: not open), made now if it is a transient
    /// queue's first write.
    fn log_for_write(&mut self, queue: QueueId) -> std::io::Result<Option<&mut QueueLog>> {
        let Some(q) = self.queues.get_mut(&queue) else {
            return Ok(None);
        };
        if q.log.is_none() {
            let dir = self.root.join("transient").join(queue.0.to_string());
            let (log, _) = QueueLog::open(&dir, self.config.embed_msgs_below, None)?;
            q.log = Some(Box::new(log));
        }
        Ok(q.log.as_deref_mut())
    }

    /// Notes that `queue` may open segment files now; closes another queue's files when more
    /// than `OPEN_QUEUES` queues have some, so the descriptor count stays bounded even when
    /// one batch touches thousands of queues.
    fn touch(&mut self, queue: QueueId) {
        self.unflushed.insert(queue);
        if !self.with_files.insert(queue) || self.with_files.len() <= OPEN_QUEUES {
            return;
        }
        let victim = self.with_files.iter().copied().find(|&id| id != queue);
        if let Some(id) = victim {
            self.with_files.remove(&id);
            if let Some(log) = self.queues.get_mut(&id).and_then(|q| q.log.as_mut())
                && let Err(e) = log.close_files()
            {
                tracing::warn!(error = %e, "store: writing buffers out failed");
            }
        }
    }

    /// The definitions database, for what lives beside the broker core (MQTT retained
    /// messages).
    pub fn definitions(&self) -> DefinitionStore {
        self.definitions.clone()
    }

    fn fail(&self, what: &str, e: impl std::fmt::Display) -> StoreError {
        tracing::error!(error = %e, "store: {what} failed; publishers are blocked for a while and unstored messages are nacked");
        StoreError(format!("{what}: {e}"))
    }
}

fn sync_thread(
    rx: mpsc::Receiver<Job>,
    defs: DefinitionStore,
    fsync: bool,
    on_synced: SyncCallback,
) {
    // A checkpoint between syncs failed: the next sync cannot promise what it covered.
    let mut poisoned: Option<String> = None;
    while let Ok(job) = rx.recv() {
        let job = match job {
            Job::Sync(job) => *job,
            Job::Checkpoint(cp, file) => {
                let done = file
                    .sync_data()
                    .map_err(|e| format!("fsync the journal: {e}"))
                    .and_then(|()| cp.run());
                if let Err(e) = done {
                    tracing::error!(error = %e, "journal checkpoint failed; the next sync reports failure");
                    poisoned = Some(e);
                }
                continue;
            }
        };
        let started = std::time::Instant::now();
        let result = (|| -> Result<(), String> {
            if let Some(e) = &job.failed {
                return Err(format!("a write failed before this sync: {e}"));
            }
            if let Some(e) = poisoned.take() {
                return Err(format!("a journal checkpoint failed before this sync: {e}"));
            }
            // Each stream's log fsyncs itself (as its own `fsync` setting says).
            for s in &job.streams {
                s.run()?;
            }
            if !fsync {
                // Written to the OS already (the broker task wrote the buffers out); the
                // definitions still get their durable commit, which is rare.
                if job.definitions {
                    defs.commit_changes(&job.changes)
                        .map_err(|e| e.to_string())?;
                }
                if let Some(s) = &job.schedule {
                    s.commit()?;
                }
                for path in &job.shared.delete {
                    let _ = fs::remove_file(path);
                }
                return Ok(());
            }
            if let Some(j) = &job.journal {
                let t = std::time::Instant::now();
                j.file
                    .sync_data()
                    .map_err(|e| format!("fsync the journal: {e}"))?;
                metrics::JOURNAL_FSYNC.observe(t.elapsed());
            }
            if job.definitions {
                defs.commit_changes(&job.changes)
                    .map_err(|e| e.to_string())?;
            }
            // After the journal: a removal of a delivered scheduled message must not be
            // durable before the enqueues of its message, written before it.
            if let Some(s) = &job.schedule {
                s.commit()?;
            }
            for f in &job.shared.fsync {
                f.sync_data()
                    .map_err(|e| format!("fsync shared file: {e}"))?;
            }
            for path in &job.files {
                // Opened by path: fsync flushes the file's data whatever descriptor wrote it.
                // A segment deleted since (all acked) needs no sync.
                match File::open(path) {
                    Ok(f) => f
                        .sync_data()
                        .map_err(|e| format!("fsync {}: {e}", path.display()))?,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => return Err(format!("open {} for fsync: {e}", path.display())),
                }
            }
            // Compacted shared files go only once their copies are durable (just above).
            for path in &job.shared.delete {
                if let Err(e) = fs::remove_file(path) {
                    tracing::warn!(file = %path.display(), error = %e, "cannot delete a compacted shared file");
                }
            }
            if let Some(d) = &job.shared.dir
                && let Ok(dir) = File::open(d)
            {
                dir.sync_all()
                    .map_err(|e| format!("fsync {}: {e}", d.display()))?;
            }
            for d in &job.dirs {
                if let Ok(dir) = File::open(d) {
                    dir.sync_all()
                        .map_err(|e| format!("fsync {}: {e}", d.display()))?;
                }
            }
            Ok(())
        })();
        if fsync {
            metrics::SYNC.observe(started.elapsed());
        }
        if let Err(e) = &result {
            tracing::error!(epoch = job.epoch, error = %e, "sync failed: its confirms become nacks");
        }
        let ok = result.is_ok();
        on_synced(job.epoch, result.map_err(SyncError::Store));
        // After the report: a checkpoint's fsyncs delay the next sync, not this confirm.
        if let Some(cp) = job.journal.and_then(|j| j.checkpoint)
            && ok
            && let Err(e) = cp.run()
        {
            // The old generation stays and is replayed at the next start; nothing is lost.
            tracing::error!(error = %e, "journal checkpoint failed; the journal is kept for replay");
        }
    }
}

/// What a durable queue's `name` file holds: the queue name for vhost `/` (as before vhosts
/// existed), else NUL, the vhost, NUL, the name (no queue name of `/` starts with NUL).
fn queue_identity(vhost: &str, name: &str) -> Vec<u8> {
    if vhost == "/" {
        return name.as_bytes().to_vec();
    }
    let mut id = Vec::with_capacity(vhost.len() + name.len() + 2);
    id.push(0);
    id.extend_from_slice(vhost.as_bytes());
    id.push(0);
    id.extend_from_slice(name.as_bytes());
    id
}

impl Store for DiskStore {
    fn schedule_add(&mut self, m: &warren_core::store::ScheduledMessage) -> Result<(), StoreError> {
        self.schedule.add(m);
        Ok(())
    }

    fn schedule_remove(&mut self, key: warren_core::store::ScheduleKey) {
        self.schedule.remove(key);
    }

    fn schedule_read(
        &mut self,
        after: Option<warren_core::store::ScheduleKey>,
        max: usize,
        out: &mut Vec<warren_core::store::ScheduledMessage>,
    ) -> Result<(), StoreError> {
        self.schedule.read(after, max, out)
    }

    fn schedule_purge(&mut self, vhost: &str, exchange: &str) -> u64 {
        self.schedule.purge(vhost, exchange)
    }

    fn schedule_recover(&mut self) -> warren_core::store::ScheduleRecovery {
        self.schedule_recovery.take().unwrap_or_default()
    }

    fn define(&mut self, change: DefinitionChange<'_>) -> Result<(), StoreError> {
        // Written by the sync thread in the sync's durable commit: never a redb write
        // transaction here, which would wait for one in progress there (`pending`).
        self.definitions_dirty = true;
        self.pending_definitions
            .push(pending::PendingChange::new(&change));
        Ok(())
    }

    fn open_queue(
        &mut self,
        queue: QueueId,
        vhost: &str,
        name: &str,
        durable: bool,
    ) -> QueueRecovery {
        if !durable {
            // The transient directory is emptied at start: nothing to recover, and the log
            // is made when the queue first writes (`transient_log`).
            self.queues.insert(
                queue,
                OpenQueue {
                    log: None,
                    durable,
                    recovered_below: 0,
                },
            );
            return QueueRecovery::default();
        }
        let dir = match self.durable_dir(vhost, name) {
            Ok(dir) => dir,
            Err(e) => {
                self.fail("opening a queue directory", e);
                return QueueRecovery::default();
            }
        };
        let journal = self.journal.clone();
        match QueueLog::open(&dir, self.config.embed_msgs_below, journal) {
            Ok((mut log, mut r)) => {
                // Entries whose body is gone (its shared record was damaged) are removed for
                // good: never counted, never reported again.
                let mut missing = 0u64;
                for (&id, &(seq, body_len)) in r.shared_refs.iter().zip(&r.shared_seqs) {
                    if self.shared.add_ref(id) {
                        continue;
                    }
                    missing += 1;
                    r.count -= 1;
                    r.bytes = r.bytes.saturating_sub(u64::from(body_len));
                    if let Err(e) = log.remove(seq) {
                        tracing::warn!(error = %e, "store: removing an unreadable message failed");
                    }
                }
                if missing > 0 {
                    tracing::warn!(
                        queue = %warren_core::escape::Escaped(name),
                        lost = missing,
                        "messages lost: their bodies were in damaged shared-store records; their entries are removed"
                    );
                    self.dirty.insert(queue);
                    self.unflushed.insert(queue);
                }
                if r.count > 0 {
                    tracing::info!(
                        queue = name,
                        messages = r.count,
                        dropped = r.dropped,
                        "recovered queue"
                    );
                }
                self.queues.insert(
                    queue,
                    OpenQueue {
                        log: Some(Box::new(log)),
                        durable,
                        recovered_below: r.next_seq,
                    },
                );
                QueueRecovery {
                    count: r.count,
                    bytes: r.bytes,
                    first_seq: r.first_seq,
                    next_seq: r.next_seq,
                }
            }
            Err(e) => {
                self.fail("opening a queue log", e);
                QueueRecovery::default()
            }
        }
    }

    fn append(
        &mut self,
        queue: QueueId,
        seq: u64,
        message: &Arc<Message>,
        expires_at: Option<u64>,
    ) -> Result<(), StoreError> {
        let log = match self.log_for_write(queue) {
            Ok(log) => log,
            Err(e) => return Err(self.fail("opening a queue log", e)),
        };
        let Some(log) = log else {
            return Err(StoreError(format!("queue {} is not open", queue.0)));
        };
        let shared = if log.shares(message.body_len()) {
            match self.shared.put(message) {
                Ok(id) => Some(id),
                Err(e) => return Err(self.fail("shared body write", e)),
            }
        } else {
            None
        };
        let Some(q) = self.queues.get_mut(&queue) else {
            return Err(StoreError(format!("queue {} is not open", queue.0)));
        };
        let Some(log) = q.log.as_mut() else {
            return Err(StoreError(format!("queue {} has no log", queue.0)));
        };
        let result = log.append(seq, message, shared, expires_at);
        if q.durable {
            self.dirty.insert(queue);
        }
        self.touch(queue);
        result.map_err(|e| self.fail("message write", e))
    }

    fn keep_every_message(&mut self, queue: QueueId) {
        match self.log_for_write(queue) {
            Ok(Some(log)) => log.keep_all(),
            Ok(None) => {}
            Err(e) => {
                self.fail("opening a queue log", e);
            }
        }
    }

    fn remove(&mut self, queue: QueueId, seq: u64) {
        if let Some(q) = self.queues.get_mut(&queue)
            && let Some(log) = q.log.as_mut()
        {
            match log.remove(seq) {
                Ok(Some(id)) => self.shared.release(id),
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "store: removing a message failed; it may come back after a restart")
                }
            }
            if q.durable {
                self.dirty.insert(queue);
            }
            self.touch(queue);
        }
    }

    fn remove_from(&mut self, queue: QueueId, from_seq: u64) {
        if let Some(q) = self.queues.get_mut(&queue)
            && let Some(log) = q.log.as_mut()
        {
            match log.remove_from(from_seq) {
                Ok(ids) => {
                    for id in ids {
                        self.shared.release(id);
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "store: purging failed; messages may come back after a restart")
                }
            }
            if q.durable {
                self.dirty.insert(queue);
            }
            self.touch(queue);
        }
    }

    fn read(
        &mut self,
        queue: QueueId,
        from_seq: u64,
        max: usize,
        out: &mut Vec<StoredMessage>,
    ) -> Result<(), StoreError> {
        let Some(q) = self.queues.get_mut(&queue) else {
            return Err(StoreError(format!("queue {} is not open", queue.0)));
        };
        let Some(log) = q.log.as_mut() else {
            // A transient queue that never wrote: nothing to read.
            return Ok(());
        };
        let mut back = Vec::new();
        let read = log.read(from_seq, max, &mut back);
        let recovered_below = q.recovered_below;
        self.touch(queue);
        match read {
            Ok(released) => {
                for id in released {
                    self.shared.release(id);
                }
            }
            Err(e) => return Err(self.fail("message read", e)),
        }
        // Delivery is not recorded on disk: a message from an earlier run may have been
        // delivered before, so it is flagged (as RabbitMQ's CQv2 does).
        let mut unreadable = Vec::new();
        for b in back {
            let (seq, expires_at) = (b.seq, b.expires_at);
            let message = match b.body {
                Body::Whole(message) => *message,
                Body::Shared(record, id) => {
                    let decoded =
                        self.shared
                            .read(id)
                            .map_err(|e| e.to_string())
                            .and_then(|body| {
                                record::decode_message(&record, Some(body))
                                    .map_err(|e| e.to_string())
                            });
                    match decoded {
                        Ok(m) => m,
                        Err(e) => {
                            tracing::error!(seq, error = %e, "store: a message's shared body is unreadable: the message is lost, its entry removed");
                            unreadable.push(seq);
                            continue;
                        }
                    }
                }
            };
            out.push(StoredMessage {
                seq,
                redelivered: seq < recovered_below,
                expires_at,
                message: Arc::new(message),
            });
        }
        // Removed for good: not counted, nor reported, at the next start.
        for seq in unreadable {
            self.remove(queue, seq);
        }
        Ok(())
    }

    fn delete_queue(&mut self, queue: QueueId) {
        if let Some(s) = self.streams.remove(&queue) {
            if let Some(host) = &self.config.streams {
                s.delete(host.as_ref());
            }
            return;
        }
        self.dirty.remove(&queue);
        self.unflushed.remove(&queue);
        self.with_files.remove(&queue);
        if let Some(q) = self.queues.remove(&queue)
            && let Some(log) = q.log
        {
            for id in log.live_shared() {
                self.shared.release(id);
            }
            let durable = q.durable;
            if let Err(e) = log.destroy(&self.root.join("trash")) {
                tracing::warn!(error = %e, "store: deleting a queue's files failed");
            }
            if durable {
                // The rename must be durable too, or a crash could bring the files back
                // for a queue the definitions no longer have.
                self.dirty_dirs.push(self.root.join("queues"));
            }
        }
    }

    fn flush(&mut self) {
        self.flush_queues();
        self.flush_streams();
        self.shared.end_window();
        // Writes no sync asks for (acks, transient page-outs in durable queues) still go
        // through the journal: cut it here too, or it would grow without bound.
        let Some(j) = &self.journal else { return };
        let cut = match j.lock() {
            Ok(mut j) if j.len() >= self.config.journal_checkpoint_bytes => j.cut_now(),
            _ => return,
        };
        match cut {
            Ok((cp, file)) => {
                if self.sync_tx.send(Job::Checkpoint(cp, file)).is_err() {
                    tracing::error!("store: the sync thread is gone");
                }
            }
            Err(e) => {
                tracing::error!(error = %e, "store: a journal write failed");
                self.write_failed.get_or_insert_with(|| e.to_string());
            }
        }
    }

    fn stream_open(
        &mut self,
        queue: QueueId,
        vhost: &str,
        name: &str,
        settings: &warren_core::store::StreamSettings,
    ) -> Result<warren_core::store::StreamBounds, StoreError> {
        let host = self
            .config
            .streams
            .clone()
            .ok_or_else(|| self.fail("stream open", "this node has no stream storage"))?;
        if let Some(s) = self.streams.get(&queue) {
            // Open already: new settings (a policy changed).
            s.reopen(host.as_ref(), settings)
                .map_err(|e| self.fail("stream open", e))?;
            return s.bounds(host.as_ref());
        }
        let s = stream_host::OpenStream::open(host.as_ref(), vhost, name, settings)
            .map_err(|e| self.fail("stream open", e))?;
        let bounds = s.bounds(host.as_ref())?;
        self.streams.insert(queue, s);
        Ok(bounds)
    }

    fn stream_append(
        &mut self,
        queue: QueueId,
        data: bytes::Bytes,
        timestamp_ms: u64,
    ) -> Result<(), StoreError> {
        let (host, s) = self.stream(queue)?;
        let r = s.append(host, data, timestamp_ms);
        r.map_err(|e| self.fail("stream append", e))
    }

    fn stream_bounds(
        &mut self,
        queue: QueueId,
    ) -> Result<warren_core::store::StreamBounds, StoreError> {
        let (host, s) = self.stream(queue)?;
        s.bounds(host)
    }

    fn stream_start(
        &mut self,
        queue: QueueId,
        start: warren_core::store::StreamStart,
    ) -> Result<u64, StoreError> {
        let (host, s) = self.stream(queue)?;
        s.start(host, start)
    }

    fn stream_read(
        &mut self,
        queue: QueueId,
        from: u64,
        max: usize,
        out: &mut Vec<warren_core::store::StreamEntry>,
    ) -> Result<(), StoreError> {
        let (host, s) = self.stream(queue)?;
        let r = s.read(host, from, max, out);
        r.map_err(|e| self.fail("stream read", e))
    }

    fn sync(&mut self, epoch: u64) {
        self.flush_queues();
        self.flush_streams();
        let mut files = std::mem::take(&mut self.dirty_names);
        let mut dirs = std::mem::take(&mut self.dirty_dirs);
        let mut failed = self.write_failed.take();
        let mut streams = Vec::new();
        if let Some(host) = &self.config.streams {
            for s in self.streams.values_mut().filter(|s| s.dirty) {
                s.dirty = false;
                streams.push(s.sync_job(host));
            }
        }
        for id in std::mem::take(&mut self.dirty) {
            if let Some(log) = self.queues.get_mut(&id).and_then(|q| q.log.as_mut()) {
                match log.take_dirty() {
                    Ok((f, dir)) => {
                        // With the journal, the journal's fsync covers the segment files
                        // (they are fsynced at checkpoints).
                        if self.journal.is_none() {
                            files.extend(f);
                        }
                        dirs.extend(dir);
                    }
                    Err(e) => {
                        // Its segments stay dirty; a later sync covers them once writes work.
                        self.dirty.insert(id);
                        failed.get_or_insert_with(|| e.to_string());
                    }
                }
            }
        }
        let shared = match self.shared.take_sync() {
            Ok(s) => s,
            Err(e) => {
                failed.get_or_insert_with(|| e.to_string());
                shared::SharedSync::default()
            }
        };
        dirs.sort();
        dirs.dedup();
        if let Some(e) = &failed {
            tracing::error!(epoch, error = %e, "store: a write failed: this sync's confirms become nacks and publishers are blocked for a while");
            // Nothing of this epoch is promised; what is pending stays for the next sync.
            self.dirty_names.append(&mut files);
            self.dirty_dirs.append(&mut dirs);
        }
        let (definitions, changes) = if failed.is_some() {
            // Kept for the next sync's commit, as the dirty files are.
            (false, Vec::new())
        } else {
            (
                std::mem::take(&mut self.definitions_dirty),
                std::mem::take(&mut self.pending_definitions),
            )
        };
        let journal = match (&failed, &self.journal) {
            (None, Some(j)) => match j
                .lock()
                .map_err(|_| "journal lock poisoned".to_string())
                .and_then(|mut j| j.cut().map_err(|e| e.to_string()))
            {
                Ok(js) => Some(js),
                Err(e) => {
                    tracing::error!(epoch, error = %e, "store: a journal write failed: this sync's confirms become nacks");
                    failed = Some(e);
                    None
                }
            },
            _ => None,
        };
        // A failed epoch promises nothing: its schedule changes are dropped with it (the
        // publishes are nacked), which is what the core's confirms already say.
        let schedule = match failed {
            None => self.schedule.take_sync(self.config.fsync),
            // Kept for the next sync, as the dirty files are.
            Some(_) => None,
        };
        let job = SyncJob {
            epoch,
            failed,
            files,
            shared,
            dirs,
            definitions,
            changes,
            journal,
            streams,
            schedule,
        };
        if self.sync_tx.send(Job::Sync(Box::new(job))).is_err() {
            tracing::error!("store: the sync thread is gone");
        }
    }
}

impl DiskStore {
    /// Hands the streams' pending messages to their logs (merged there until the next write).
    fn flush_streams(&mut self) {
        let Some(host) = &self.config.streams else {
            return;
        };
        for s in self.streams.values_mut() {
            if let Err(e) = s.write_out(host.as_ref()) {
                tracing::error!(error = %e, "store: a stream write failed: this sync's confirms become nacks");
                self.write_failed.get_or_insert_with(|| e.to_string());
            }
        }
    }

    fn stream(
        &mut self,
        queue: QueueId,
    ) -> Result<(&dyn StreamHost, &mut stream_host::OpenStream), StoreError> {
        let host = self
            .config
            .streams
            .as_deref()
            .ok_or_else(|| StoreError("this node has no stream storage".into()))?;
        let s = self
            .streams
            .get_mut(&queue)
            .ok_or_else(|| StoreError(format!("stream {} is not open", queue.0)))?;
        Ok((host, s))
    }

    fn flush_queues(&mut self) {
        let touched = std::mem::take(&mut self.unflushed);
        for id in &touched {
            if let Some(log) = self.queues.get_mut(id).and_then(|q| q.log.as_mut())
                && let Err(e) = log.flush()
            {
                tracing::warn!(error = %e, "store: writing buffers out failed; retried at the next flush, confirms waiting for the next sync become nacks");
                self.write_failed.get_or_insert_with(|| e.to_string());
                // Still buffered: try again at the next flush.
                self.unflushed.insert(*id);
            }
        }
    }
}
