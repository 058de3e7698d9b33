//! State shared by all MQTT connections of a server: which connection owns each client id
//! (session takeover), persistent sessions while their client is away, retained messages.

use crate::session::SessionRecord;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use tokio::sync::oneshot;
use warren_core::ids::ConnId;
use warren_core::mqtt::{RetainedMessage, RetainedStore};

/// Asks a connection to close for a takeover; it answers on the enclosed sender once its
/// session is released in the core and stored here.
pub type Kick = oneshot::Sender<oneshot::Sender<()>>;

struct Owner {
    conn: ConnId,
    kick: Kick,
}

#[derive(Default)]
pub struct Registry {
    owners: Mutex<HashMap<Arc<str>, Owner>>,
    sessions: Mutex<HashMap<Arc<str>, SessionRecord>>,
    retained: Mutex<RetainedStore>,
    next_id: AtomicU64,
    /// Delayed wills by client id, with the token of the connection that left them.
    wills: Mutex<HashMap<Arc<str>, u64>>,
    /// Told of every retained-message change (persistence), before it is applied.
    retained_hook: Option<RetainedHook>,
}

/// Receives retained-message changes: (vhost, message); an empty payload clears the topic.
pub type RetainedHook = Box<dyn Fn(&str, &RetainedMessage) + Send + Sync>;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding these locks cannot leave them half-updated (each critical section
    // is one map operation), so a poisoned lock is still consistent.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Registry {
    pub fn new() -> Registry {
        Registry::default()
    }

    /// A registry starting with `retained` (recovered from storage) that reports every
    /// retained change to `hook` (which stores it).
    pub fn with_retained(retained: RetainedStore, hook: RetainedHook) -> Registry {
        Registry {
            retained: Mutex::new(retained),
            retained_hook: Some(hook),
            ..Registry::default()
        }
    }

    /// Sets (or, with an empty payload, clears) the retained message of a topic.
    pub fn set_retained(&self, vhost: &str, msg: RetainedMessage) {
        if let Some(hook) = &self.retained_hook {
            hook(vhost, &msg);
        }
        lock(&self.retained).set(vhost, msg);
    }

    /// Makes `conn` the owner of `client_id`; returns the previous owner's kick, if any. A
    /// delayed will of that client id is cancelled (MQTT 5 3.1.3.2.2).
    pub fn claim(&self, client_id: &Arc<str>, conn: ConnId, kick: Kick) -> Option<Kick> {
        lock(&self.wills).remove(client_id);
        lock(&self.owners)
            .insert(client_id.clone(), Owner { conn, kick })
            .map(|o| o.kick)
    }

    /// Gives up `client_id` if `conn` still owns it.
    pub fn release(&self, client_id: &Arc<str>, conn: ConnId) {
        let mut owners = lock(&self.owners);
        if owners.get(client_id).is_some_and(|o| o.conn == conn) {
            owners.remove(client_id);
        }
    }

    pub fn take_session(&self, client_id: &str) -> Option<SessionRecord> {
        lock(&self.sessions).remove(client_id)
    }

    pub fn store_session(&self, client_id: Arc<str>, record: SessionRecord) {
        lock(&self.sessions).insert(client_id, record);
    }

    pub fn retained(&self) -> MutexGuard<'_, RetainedStore> {
        lock(&self.retained)
    }

    /// Registers a delayed will of `client_id` left by connection `conn`.
    pub fn delay_will(&self, client_id: Arc<str>, conn: ConnId) {
        lock(&self.wills).insert(client_id, conn.0);
    }

    /// Whether the delayed will left by `conn` is still due (not cancelled by a reconnect);
    /// removes it.
    pub fn take_will(&self, client_id: &str, conn: ConnId) -> bool {
        let mut wills = lock(&self.wills);
        if wills.get(client_id) == Some(&conn.0) {
            wills.remove(client_id);
            true
        } else {
            false
        }
    }

    /// A client id for a client that sent an empty one.
    pub fn assign_id(&self) -> String {
        format!(
            "warren-{}",
            self.next_id.fetch_add(1, Ordering::Relaxed) + 1
        )
    }

    /// Connected clients.
    pub fn clients(&self) -> usize {
        lock(&self.owners).len()
    }

    /// Persistent sessions kept for clients that are not connected.
    pub fn stored_sessions(&self) -> usize {
        lock(&self.sessions).len()
    }
}
