//! The writer thread of the gateway's MQTT sessions (`sessions.rs`), which commits changes
//! in arrival order: gateways hand them over without waiting, and each batch the thread finds
//! queued is one durable commit (group commit, as for messages). Sessions are state, not
//! deliveries: a client is not held back for them, so a crash can lose the last ~ms of
//! changes, never reorder them.

use crate::definitions::DefinitionStore;
use crate::retained::MqttChange;
use std::sync::mpsc;
use warren_core::mqtt::StoredSession;

/// Changes waiting for the writer; beyond this, `set_session` drops the change with a warning
/// rather than block a gateway (the next change of that session repairs it).
const QUEUE: usize = 65_536;
/// Changes committed together at most.
const BATCH: usize = 4096;

enum Job {
    // Boxed: a session is ~200 bytes, and most jobs are small retained changes.
    Change(Box<MqttChange>),
    /// Answered once every change queued before it is committed.
    Flush(mpsc::Sender<()>),
}

/// Hands MQTT session changes to the writer thread, which
/// commits them in arrival order.
#[derive(Clone)]
pub struct MqttWriter {
    tx: mpsc::SyncSender<Job>,
}

impl MqttWriter {
    pub fn start(defs: DefinitionStore) -> std::io::Result<MqttWriter> {
        let (tx, rx) = mpsc::sync_channel::<Job>(QUEUE);
        std::thread::Builder::new()
            .name("warren-mqtt-state".into())
            .spawn(move || {
                while let Ok(first) = rx.recv() {
                    let mut batch = Vec::new();
                    let mut flushes = Vec::new();
                    let mut next = Some(first);
                    while let Some(job) = next.take() {
                        match job {
                            Job::Change(c) => batch.push(*c),
                            Job::Flush(done) => flushes.push(done),
                        }
                        if batch.len() < BATCH {
                            next = rx.try_recv().ok();
                        }
                    }
                    if !batch.is_empty()
                        && let Err(e) = defs.write_mqtt(&batch)
                    {
                        tracing::error!(error = %e, changes = batch.len(), "cannot store MQTT sessions; they stay in memory");
                    }
                    for done in flushes {
                        let _ = done.send(());
                    }
                }
            })?;
        Ok(MqttWriter { tx })
    }

    /// Queues a session change (`None`: the session ended).
    pub fn set_session(&self, vhost: &str, client_id: &str, s: Option<StoredSession>) {
        let change = MqttChange::Session(vhost.to_string(), client_id.to_string(), s);
        if self.tx.try_send(Job::Change(Box::new(change))).is_err() {
            tracing::warn!(
                client_id = %warren_core::escape::Escaped(client_id),
                "MQTT state writer is behind; this session change is not stored"
            );
        }
    }

    /// Waits (at most `limit`) until every change queued so far is committed: at shutdown,
    /// so the sessions closed by it are on disk before the process exits.
    pub fn flush(&self, limit: std::time::Duration) -> bool {
        let (done, wait) = mpsc::channel();
        if self.tx.send(Job::Flush(done)).is_err() {
            return false;
        }
        wait.recv_timeout(limit).is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use warren_core::mqtt::StoredSub;

    #[test]
    fn writer_stores_sessions_in_order_and_flushes() {
        let dir = std::env::temp_dir().join(format!("warren-mqtt-writer-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("definitions.redb");
        let session = StoredSession {
            level: 4,
            expiry_s: u32::MAX,
            has_queue: true,
            subs: vec![StoredSub {
                filter: "a/#".into(),
                qos: 1,
                no_local: false,
                retain_as_published: false,
                retain_handling: 0,
                id: None,
            }],
            ..StoredSession::default()
        };
        let defs = DefinitionStore::open(&path).expect("open");
        {
            let w = MqttWriter::start(defs.clone()).expect("writer");
            w.set_session("/", "gone", Some(session.clone()));
            w.set_session("/", "kept", Some(StoredSession::default()));
            w.set_session("/", "kept", Some(session.clone()));
            w.set_session("/", "gone", None);
            assert!(w.flush(std::time::Duration::from_secs(10)), "flushed");
        }
        let sessions = defs.load_mqtt_sessions().expect("load");
        assert_eq!(sessions, vec![("/".into(), "kept".into(), session)]);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
