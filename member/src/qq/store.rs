//! The quorum-queue layer over one shard's store (`QuorumStore`): a quorum queue's writes go to
//! its group, its messages are served from what the group committed; other queues' go to the
//! store below.

use super::commit::{Batch, Job, complete, propose};
use super::*;

/// A served queue's messages by sequence number: (message, expires_at, redelivered).
pub(super) type Held = BTreeMap<u64, (Arc<Message>, Option<u64>, bool)>;

/// What the layer keeps of a quorum queue on this node.
pub(super) struct Local {
    pub(super) group: Arc<Group>,
    /// The broker serves the queue here (this node led its group at the last reload).
    pub(super) serving: bool,
    /// The serving session the queue was loaded in (valid while `serving`).
    pub(super) session: u64,
    /// Its messages, for the core to page in.
    pub(super) messages: Held,
    /// This is the queue's dead-letter log (at-least-once dead-lettering,
    /// `warren_core::queue::dlx`), carried in the queue's own group under sequence numbers
    /// with `DEAD_LETTER_BIT` set.
    pub(super) dead_letters: bool,
}

impl Local {
    /// The group's sequence number of this log's `seq`.
    pub(super) fn key(&self, seq: u64) -> u64 {
        if self.dead_letters {
            seq | DEAD_LETTER_BIT
        } else {
            seq
        }
    }
}

/// One shard's store with the quorum-queue layer over it.
pub(super) struct QuorumStore {
    pub(super) inner: Box<dyn Store>,
    pub(super) repl: Replication,
    pub(super) names: HashMap<QueueId, (String, String)>,
    pub(super) quorum: HashMap<QueueId, Local>,
    /// Writes since the last sync or flush, in order, with the serving session they were
    /// made in.
    pub(super) pending: Vec<(Arc<Group>, u64, QueueOp)>,
    pub(super) jobs: mpsc::UnboundedSender<Job>,
}

impl QuorumStore {
    /// The writes since the last sync as log entries: per group, in order, each entry at
    /// most `MAX_ENTRY_BYTES` of messages (or one larger message).
    pub(super) fn take_batches(&mut self) -> Vec<Batch> {
        let mut batches: Vec<(Batch, usize)> = Vec::new();
        for (g, session, op) in self.pending.drain(..) {
            let size = match &op {
                QueueOp::Append { message, .. } => message.len() + 32,
                _ => 16,
            };
            // The last entry of this group, if it has room; else a new one.
            match batches
                .iter_mut()
                .rev()
                .find(|((b, _, _), _)| b.id == g.id)
                .filter(|((_, t, _), bytes)| {
                    *t == session && *bytes + size <= warren_cluster::queue::MAX_ENTRY_BYTES
                }) {
                Some(((_, _, ops), bytes)) => {
                    ops.push(op);
                    *bytes += size;
                }
                None => batches.push(((g, session, vec![op]), size)),
            }
        }
        batches.into_iter().map(|(b, _)| b).collect()
    }

    /// The queue's messages (or, for `dead_letters`, its dead-letter log) from its group's
    /// copy (this node leads it now).
    pub(super) fn load_replica(g: &Group, dead_letters: bool) -> (Held, u64) {
        let Some(sm) = g.replica() else {
            return (BTreeMap::new(), 0);
        };
        sm.with(|r| {
            let mut out = BTreeMap::new();
            let range = if dead_letters {
                r.messages.range(DEAD_LETTER_BIT..)
            } else {
                r.messages.range(..DEAD_LETTER_BIT)
            };
            for (seq, held) in range {
                let seq = &(seq & !DEAD_LETTER_BIT);
                match warren_store::record::decode_message(&Bytes::from(held.message.clone()), None)
                {
                    Ok(m) => {
                        out.insert(*seq, (Arc::new(m), held.expires_at, true));
                    }
                    Err(e) => {
                        tracing::error!(queue = %Escaped(&g.name), seq, error = %e, "undecodable message in a quorum queue's log; skipped");
                    }
                }
            }
            let next = if dead_letters {
                out.keys().next_back().map_or(0, |s| s + 1)
            } else {
                r.next_seq
            };
            (out, next)
        })
    }
}

impl Store for QuorumStore {
    fn define(&mut self, change: DefinitionChange<'_>) -> Result<(), StoreError> {
        if let DefinitionChange::QueueDeclared { vhost, def } = change
            && let Some(size) = def
                .arguments
                .get("x-quorum-initial-group-size")
                .and_then(|v| v.as_i64())
        {
            let size = usize::try_from(size).unwrap_or(DEFAULT_GROUP_SIZE).max(1);
            lock(&self.repl.0.sizes).insert((vhost.to_string(), def.queue.clone()), size);
        }
        self.inner.define(change)
    }

    fn open_queue(
        &mut self,
        queue: QueueId,
        vhost: &str,
        name: &str,
        durable: bool,
    ) -> QueueRecovery {
        self.names
            .insert(queue, (vhost.to_string(), name.to_string()));
        let Some(local) = self.quorum.get_mut(&queue) else {
            return self.inner.open_queue(queue, vhost, name, durable);
        };
        // A reload: the queue changed hands here.
        local.serving = local.group.leading.load(Ordering::Acquire);
        local.session = local.group.session.load(Ordering::Acquire);
        let (messages, next_seq) = if local.serving {
            QuorumStore::load_replica(&local.group, local.dead_letters)
        } else {
            (BTreeMap::new(), 0)
        };
        local.messages = messages;
        let next_seq = next_seq.max(local.messages.keys().last().map_or(0, |s| s + 1));
        QueueRecovery {
            count: local.messages.len() as u64,
            bytes: local
                .messages
                .values()
                .map(|(m, _, _)| m.body_len() as u64)
                .sum(),
            first_seq: local.messages.keys().next().copied().unwrap_or(0),
            next_seq,
        }
    }

    fn keep_every_message(&mut self, queue: QueueId) {
        if self.quorum.contains_key(&queue) {
            return;
        }
        let Some((vhost, name)) = self.names.get(&queue).cloned() else {
            return self.inner.keep_every_message(queue);
        };
        // A quorum queue's dead-letter log goes in the queue's own group.
        let (name, dead_letters) = match name.strip_prefix(warren_core::queue::dlx::STORE_PREFIX) {
            Some(queue_name) => (queue_name.to_string(), true),
            None => (name, false),
        };
        let group = self.repl.ensure(&vhost, &name);
        // The log opens while the queue is served (its first dead letter, or a reload):
        // it is served as the queue is, with what the group's copy holds of it.
        let serving = dead_letters && group.leading.load(Ordering::Acquire);
        let session = group.session.load(Ordering::Acquire);
        let messages = if serving {
            QuorumStore::load_replica(&group, true).0
        } else {
            BTreeMap::new()
        };
        self.quorum.insert(
            queue,
            Local {
                group,
                serving,
                session,
                messages,
                dead_letters,
            },
        );
    }

    fn append(
        &mut self,
        queue: QueueId,
        seq: u64,
        message: &Arc<Message>,
        expires_at: Option<u64>,
    ) -> Result<(), StoreError> {
        let Some(local) = self.quorum.get_mut(&queue) else {
            return self.inner.append(queue, seq, message, expires_at);
        };
        if !local.serving {
            return Err(StoreError(format!(
                "quorum queue '{}': this node does not lead its group",
                local.group.name
            )));
        }
        let mut record = Vec::new();
        warren_store::record::encode_message(message, true, &mut record);
        if record.len() > warren_cluster::queue::MAX_MESSAGE {
            return Err(StoreError(format!(
                "quorum queue '{}': a message of {} bytes is over the replicated limit ({} bytes)",
                local.group.name,
                record.len(),
                warren_cluster::queue::MAX_MESSAGE
            )));
        }
        local
            .messages
            .insert(seq, (message.clone(), expires_at, false));
        self.pending.push((
            local.group.clone(),
            local.session,
            QueueOp::Append {
                seq: local.key(seq),
                expires_at,
                message: record,
            },
        ));
        Ok(())
    }

    fn serves(&self, queue: QueueId) -> bool {
        match self.quorum.get(&queue) {
            Some(local) => local.serving,
            None => self.inner.serves(queue),
        }
    }

    fn remove(&mut self, queue: QueueId, seq: u64) {
        let Some(local) = self.quorum.get_mut(&queue) else {
            return self.inner.remove(queue, seq);
        };
        if local.messages.remove(&seq).is_some() && local.serving {
            let seq = local.key(seq);
            self.pending
                .push((local.group.clone(), local.session, QueueOp::Remove { seq }));
        }
    }

    fn remove_from(&mut self, queue: QueueId, from_seq: u64) {
        let Some(local) = self.quorum.get_mut(&queue) else {
            return self.inner.remove_from(queue, from_seq);
        };
        local.messages.split_off(&from_seq);
        if local.serving {
            let seq = local.key(from_seq);
            self.pending.push((
                local.group.clone(),
                local.session,
                QueueOp::RemoveFrom { seq },
            ));
        }
    }

    fn read(
        &mut self,
        queue: QueueId,
        from_seq: u64,
        max: usize,
        out: &mut Vec<StoredMessage>,
    ) -> Result<(), StoreError> {
        let Some(local) = self.quorum.get(&queue) else {
            return self.inner.read(queue, from_seq, max, out);
        };
        out.extend(local.messages.range(from_seq..).take(max).map(
            |(seq, (message, expires_at, redelivered))| StoredMessage {
                seq: *seq,
                message: message.clone(),
                redelivered: *redelivered,
                expires_at: *expires_at,
            },
        ));
        Ok(())
    }

    fn delete_queue(&mut self, queue: QueueId) {
        if let Some(local) = self.quorum.remove(&queue)
            && !local.dead_letters
        {
            // (The dead-letter log goes with its queue's group.)
            self.pending.retain(|(g, _, _)| g.id != local.group.id);
            self.repl.delete(&local.group.vhost, &local.group.name);
        }
        self.names.remove(&queue);
        self.inner.delete_queue(queue);
    }

    fn sync(&mut self, epoch: u64) {
        let batches = self.take_batches();
        // Fails only when the runtime is shutting down: nothing to confirm then.
        let _ = self.jobs.send(Job(epoch, batches));
        self.inner.sync(epoch);
    }

    fn flush(&mut self) {
        // A quorum queue's removals wait for the next sync (the core starts one within
        // `removal_sync_ms` of a removal): one log entry for many acks, not one each.
        self.inner.flush();
    }

    fn stream_open(
        &mut self,
        queue: QueueId,
        vhost: &str,
        name: &str,
        settings: &StreamSettings,
    ) -> Result<StreamBounds, StoreError> {
        self.inner.stream_open(queue, vhost, name, settings)
    }

    fn stream_append(
        &mut self,
        queue: QueueId,
        data: Bytes,
        timestamp_ms: u64,
    ) -> Result<(), StoreError> {
        self.inner.stream_append(queue, data, timestamp_ms)
    }

    fn stream_bounds(&mut self, queue: QueueId) -> Result<StreamBounds, StoreError> {
        self.inner.stream_bounds(queue)
    }

    fn stream_start(&mut self, queue: QueueId, start: StreamStart) -> Result<u64, StoreError> {
        self.inner.stream_start(queue, start)
    }

    fn stream_read(
        &mut self,
        queue: QueueId,
        from: u64,
        max: usize,
        out: &mut Vec<StreamEntry>,
    ) -> Result<(), StoreError> {
        self.inner.stream_read(queue, from, max, out)
    }

    // The schedule of delayed messages is this node's own (docs/delayed.md): the disk
    // store's, not replicated.
    fn schedule_add(&mut self, m: &warren_core::store::ScheduledMessage) -> Result<(), StoreError> {
        self.inner.schedule_add(m)
    }

    fn schedule_remove(&mut self, key: warren_core::store::ScheduleKey) {
        self.inner.schedule_remove(key)
    }

    fn schedule_read(
        &mut self,
        after: Option<warren_core::store::ScheduleKey>,
        max: usize,
        out: &mut Vec<warren_core::store::ScheduledMessage>,
    ) -> Result<(), StoreError> {
        self.inner.schedule_read(after, max, out)
    }

    fn schedule_purge(&mut self, vhost: &str, exchange: &str) -> u64 {
        self.inner.schedule_purge(vhost, exchange)
    }

    fn schedule_recover(&mut self) -> warren_core::store::ScheduleRecovery {
        self.inner.schedule_recover()
    }
}

impl warren_runtime::StoreLayer for Replication {
    fn layer(
        &self,
        _shard: u32,
        synced: SyncCallback,
    ) -> (
        SyncCallback,
        Box<dyn FnOnce(Box<dyn Store>) -> Box<dyn Store> + Send>,
    ) {
        let (inner_tx, inner_rx) = mpsc::unbounded_channel();
        let (jobs_tx, jobs_rx) = mpsc::unbounded_channel();
        let (wait_tx, wait_rx) = mpsc::unbounded_channel();
        self.0.runtime.spawn(propose(jobs_rx, wait_tx));
        self.0.runtime.spawn(complete(wait_rx, inner_rx, synced));
        let on_inner: SyncCallback = Box::new(move |epoch, result| {
            let _ = inner_tx.send((epoch, result));
        });
        let this = self.clone();
        let wrap = Box::new(move |inner: Box<dyn Store>| -> Box<dyn Store> {
            Box::new(QuorumStore {
                inner,
                repl: this,
                names: HashMap::new(),
                quorum: HashMap::new(),
                pending: Vec::new(),
                jobs: jobs_tx,
            })
        });
        (on_inner, wrap)
    }
}
