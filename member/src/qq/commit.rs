//! From the broker's sync to the group's commit: each sync's writes proposed in order without
//! waiting (openraft pipelines them), completed in the same order once committed and the local
//! disk synced.

use super::*;

/// A batch of writes for one group, made while this node served it in a session.
pub(super) type Batch = (Arc<Group>, u64, Vec<QueueOp>);

/// The broker's sync `epoch`: these writes committed, and the disk's own sync, complete it.
pub(super) struct Job(pub(super) u64, pub(super) Vec<Batch>);

pub(super) type WriteResult = Result<
    warren_cluster::openraft::raft::ClientWriteResponse<warren_cluster::TypeConfig>,
    warren_cluster::openraft::error::ClientWriteError<NodeId, warren_cluster::openraft::BasicNode>,
>;

pub(super) type Responder = tokio::sync::oneshot::Receiver<WriteResult>;

/// Proposes each job's writes in order without waiting for their commit (openraft
/// pipelines them); [`complete`] waits for them in the same order.
pub(super) async fn propose(
    mut jobs: mpsc::UnboundedReceiver<Job>,
    wait: mpsc::UnboundedSender<(u64, Vec<Proposed>)>,
) {
    while let Some(job) = jobs.recv().await {
        let Job(epoch, batches) = job;
        let mut waits = Vec::with_capacity(batches.len());
        for (g, session, ops) in batches {
            let w = match g.raft() {
                // Writes of the queue as served in an older session are refused here (the
                // broker reloads it for the new one), and by every member at apply if a
                // new session starts after this look.
                Some(raft)
                    if g.leading.load(Ordering::Acquire)
                        && g.session.load(Ordering::Acquire) == session =>
                {
                    if tracing::enabled!(target: "warren::qq::trace", tracing::Level::DEBUG) {
                        trace_ops(&g, session, epoch, &ops);
                    }
                    raft.client_write_ff(QueueCommand(ops).encode_in(session))
                        .await
                        .map_err(|e| e.to_string())
                }
                _ => {
                    // A write of an older session while this node serves a newer one: what
                    // the session check is for (before it, such a write was proposed).
                    tracing::debug!(
                        target: "warren::qq::trace",
                        queue = %Escaped(&g.name),
                        session,
                        current = g.session.load(Ordering::Acquire),
                        leading = g.leading.load(Ordering::Acquire),
                        epoch,
                        ops = ops.len(),
                        "quorum queue: write refused: not made in this node's serving session"
                    );
                    Err(format!(
                        "quorum queue '{}': this node does not lead its group (in the session its writes were made in)",
                        g.name
                    ))
                }
            };
            waits.push((g, session, w));
        }
        if wait.send((epoch, waits)).is_err() {
            return;
        }
    }
}

/// The `warren::qq::trace` debug target (`RUST_LOG=warren::qq::trace=debug`): each write a
/// leader proposes, by sequence number, with the serving session it was made in and the broker's sync
/// epoch (whose "committed" line gives its log index), to follow one message through
/// leader changes. Costs nothing unless enabled.
pub(super) fn trace_ops(g: &Group, session: u64, epoch: u64, ops: &[QueueOp]) {
    let mut appended = Vec::new();
    let mut removed = Vec::new();
    for op in ops {
        match op {
            QueueOp::Append { seq, message, .. } => {
                // The body is the record's tail: enough of it to name a test's message.
                let tail = &message[message.len().saturating_sub(12)..];
                appended.push(format!("{seq}={}", String::from_utf8_lossy(tail)));
            }
            QueueOp::Remove { seq } => removed.push(seq.to_string()),
            QueueOp::RemoveFrom { seq } => removed.push(format!("{seq}..")),
        }
    }
    tracing::debug!(target: "warren::qq::trace", queue = %Escaped(&g.name), session, epoch, appended = ?appended, removed = ?removed, "quorum queue: proposing");
}

/// A group's write as proposed: the group, the serving session it was made in, and the
/// group's answer to come (or why it was not proposed).
pub(super) type Proposed = (Arc<Group>, u64, Result<Responder, String>);

/// How often a write waiting for its commit checks that its serving session still runs.
pub(super) const SESSION_CHECK: std::time::Duration = std::time::Duration::from_millis(50);

/// The group's answer to a write made in serving session `session`, or `None` once that
/// session ended here (this node's broker stopped serving the queue: its lease was lost, or
/// another session started): a leader cut off by a partition would otherwise hold the
/// shard's sync, and every confirm behind it, until the heal. The write is then nacked,
/// whatever the group does with it later: refused at apply once a newer session
/// committed, or, if it still commits, a message the publisher republished (at least once).
pub(super) async fn answer(
    g: &Group,
    session: u64,
    rx: Responder,
) -> Option<Result<WriteResult, tokio::sync::oneshot::error::RecvError>> {
    tokio::pin!(rx);
    loop {
        tokio::select! {
            r = &mut rx => return Some(r),
            _ = tokio::time::sleep(SESSION_CHECK) => {
                if !g.leading.load(Ordering::Acquire) || g.session.load(Ordering::Acquire) != session {
                    return None;
                }
            }
        }
    }
}

/// Completes the broker's syncs in order: once its group writes are committed and the disk
/// reported the same epoch synced.
pub(super) async fn complete(
    mut waits: mpsc::UnboundedReceiver<(u64, Vec<Proposed>)>,
    mut inner: mpsc::UnboundedReceiver<(u64, Result<(), SyncError>)>,
    synced: SyncCallback,
) {
    // Disk syncs reported before their group writes committed (at most the syncs in flight).
    let mut early: HashMap<u64, Result<(), SyncError>> = HashMap::new();
    while let Some((epoch, rxs)) = waits.recv().await {
        let mut result = Ok(());
        for (g, session, rx) in rxs {
            let r = match rx {
                Ok(rx) => match answer(&g, session, rx).await {
                    // A reply is an error the group's state machine gave (a stale or
                    // undecodable command: not applied).
                    Some(Ok(Ok(resp))) if !resp.data.0.is_empty() => {
                        Err(String::from_utf8_lossy(&resp.data.0).into_owned())
                    }
                    Some(Ok(Ok(resp))) => {
                        tracing::debug!(target: "warren::qq::trace", epoch, index = resp.log_id.index, term = resp.log_id.leader_id.term, "quorum queue: committed");
                        Ok(())
                    }
                    Some(Ok(Err(e))) => Err(e.to_string()),
                    Some(Err(_)) => Err("the group stopped".to_string()),
                    None => Err(format!(
                        "quorum queue '{}': this node stopped serving it before the write committed",
                        g.name
                    )),
                },
                Err(e) => Err(e),
            };
            if let Err(e) = r {
                tracing::debug!(error = %e, "quorum queue write not committed");
                result = result.and(Err(SyncError::NotReplicated(e)));
            }
        }
        let disk = loop {
            if let Some(r) = early.remove(&epoch) {
                break r;
            }
            match inner.recv().await {
                Some((e, r)) => {
                    early.insert(e, r);
                }
                None => return,
            }
        };
        // A disk failure first: it is the one that blocks publishers (the store alarm); a
        // write a quorum queue's group did not commit only nacks the epoch's confirms.
        synced(epoch, disk.and(result));
    }
}
