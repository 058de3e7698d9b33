//! State shared by all MQTT connections of a server: which connection owns each client id
//! (session takeover), persistent sessions while their client is away (ordered by when they
//! expire), and the hook that stores sessions. Retained messages are the core's
//! (`Op::Retain`, `Op::RetainedGet`).

use crate::record::SessionRecord;
use std::collections::{BTreeSet, HashMap, HashSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use tokio::sync::oneshot;
use warren_core::ids::ConnId;
use warren_core::mqtt::{StoredSession, StoredWill};

/// The owner token of the task that ends expired sessions (no connection has it).
pub const EXPIRY_TASK: ConnId = ConnId(u64::MAX);

/// Offline sessions, and the expiring ones by when they expire.
#[derive(Default)]
struct Sessions {
    map: HashMap<Arc<str>, SessionRecord>,
    by_expiry: BTreeSet<(u64, Arc<str>)>,
}

impl Sessions {
    fn remove(&mut self, client_id: &str) -> Option<(Arc<str>, SessionRecord)> {
        let (id, r) = self.map.remove_entry(client_id)?;
        if let Some(at) = r.expires_at() {
            self.by_expiry.remove(&(at, id.clone()));
        }
        Some((id, r))
    }

    fn insert(&mut self, client_id: Arc<str>, record: SessionRecord) {
        self.remove(&client_id);
        if let Some(at) = record.expires_at() {
            self.by_expiry.insert((at, client_id.clone()));
        }
        self.map.insert(client_id, record);
    }
}

/// Receives session changes: (client id, the session; `None` when it ended).
pub type SessionHook = Box<dyn Fn(&str, Option<StoredSession>) + Send + Sync>;

/// What [`ClusterSessions`]' futures return.
pub type ClusterFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// A cluster's registry of MQTT sessions (docs/cluster.md, "MQTT sessions across nodes"):
/// one session per client id across the nodes. The host implements it over its metadata
/// group; the gateway knows no cluster.
pub trait ClusterSessions: Send + Sync + 'static {
    /// Makes this node the owner of `client_id` cluster-wide: a connection of it on
    /// another node is closed (session taken over) and hands its session over, bounded in
    /// time. Answers the session to resume (the cluster's latest state of it; `None`: it
    /// has none), or `Err(why)` when the cluster could not be asked (no quorum): the node
    /// then goes on with what it knows.
    fn claim(&self, client_id: &str) -> ClusterFuture<Result<Option<StoredSession>, String>>;
    /// A change of a session this node owns (`None`: it ended, or, `live`, its connected
    /// client keeps none); a change that is not `live` is its connection's last state,
    /// which goes to the node that took it over if one did. Ordered per client id, without
    /// waiting.
    fn store(&self, client_id: &str, session: Option<StoredSession>, live: bool);
    /// Another node claimed `client_id` while no connection here had it: hand over what
    /// the cluster holds of it (the claimer waits for no connection here).
    fn release(&self, client_id: &str);
    /// Ends the offline session of `client_id` in the cluster if this node still owns it,
    /// unchanged (no other node resumed it meanwhile); whether it did.
    fn expire(&self, client_id: &str) -> ClusterFuture<bool>;
    /// Whether the cluster says this node has `client_id` now (a connection that finished
    /// its claim and finds it false was taken over during the claim).
    fn owns(&self, client_id: &str) -> bool;
}

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
    sessions: Mutex<Sessions>,
    /// Woken when a session that may expire is stored (the expiry task's next deadline may
    /// be earlier).
    expiry_changed: tokio::sync::Notify,
    /// Told of every session change (persistence).
    session_hook: Option<SessionHook>,
    /// Delayed wills read back from storage, for the server to schedule.
    restored_wills: Mutex<Vec<(Arc<str>, StoredWill)>>,
    next_id: AtomicU64,
    /// Delayed wills by client id, with the token of the connection that left them.
    wills: Mutex<HashMap<Arc<str>, u64>>,
    /// The cluster's session registry, on a cluster node.
    cluster: std::sync::OnceLock<Arc<dyn ClusterSessions>>,
    /// Client ids whose connection here another node took over: its close hands the
    /// session over instead of keeping it (bounded by the connections of this node).
    handed_over: Mutex<HashSet<Arc<str>>>,
    /// Client ids whose connection here is claiming them in the cluster: a takeover
    /// applied meanwhile may be older than that claim, so the connection checks for itself
    /// once its claim is done ([`Registry::end_claim`]). Empty while no connection claims.
    claiming: Mutex<HashSet<Arc<str>>>,
    /// Connections whose SUBSCRIBE was read and whose bindings are not sent to the broker
    /// yet ([`SubscribeGate`]): publishers read meanwhile let them go first.
    subscribing: std::sync::atomic::AtomicUsize,
}

/// Held by a connection from reading a SUBSCRIBE until its bindings went to the broker
/// (`connection.rs`, issue 43 item 15): a publish read meanwhile on another connection
/// waits (a few scheduler turns at most) so it is routed after them, as in arrival order.
pub struct SubscribeGate(Arc<Registry>);

impl SubscribeGate {
    pub fn new(registry: &Arc<Registry>) -> SubscribeGate {
        registry.subscribing.fetch_add(1, Ordering::AcqRel);
        SubscribeGate(registry.clone())
    }
}

impl Drop for SubscribeGate {
    fn drop(&mut self) {
        self.0.subscribing.fetch_sub(1, Ordering::AcqRel);
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding these locks cannot leave them half-updated (each critical section
    // is one map operation), so a poisoned lock is still consistent.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Registry {
    pub fn new() -> Registry {
        Registry::default()
    }

    /// Whether a connection's SUBSCRIBE is between its read and its bindings' send.
    pub fn subscribing(&self) -> bool {
        self.subscribing.load(Ordering::Acquire) > 0
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

    /// Whether `conn` owns `client_id` (a takeover, here or from another node, ends that).
    pub fn owns(&self, client_id: &str, conn: ConnId) -> bool {
        lock(&self.owners)
            .get(client_id)
            .is_some_and(|o| o.conn == conn)
    }

    /// Adds the sessions read back from storage, stored through `hook` from now on: sessions
    /// keep their expiry (counted from when their client went away, so the broker's downtime
    /// counts), and their delayed wills are handed to the server ([`Registry::take_restored_wills`]).
    pub fn with_sessions(
        mut self,
        records: Vec<(Arc<str>, SessionRecord)>,
        hook: SessionHook,
    ) -> Registry {
        {
            let sessions = self.sessions.get_mut().unwrap_or_else(|e| e.into_inner());
            let wills = self
                .restored_wills
                .get_mut()
                .unwrap_or_else(|e| e.into_inner());
            for (id, r) in records {
                if let Some(w) = &r.will {
                    wills.push((id.clone(), w.clone()));
                }
                sessions.insert(id, r);
            }
        }
        self.session_hook = Some(hook);
        self
    }

    pub fn take_session(&self, client_id: &str) -> Option<SessionRecord> {
        lock(&self.sessions).remove(client_id).map(|(_, r)| r)
    }

    /// Makes this registry a cluster node's: sessions are claimed, stored and expired
    /// through `cluster` too (once; later calls are ignored).
    pub fn set_cluster(&self, cluster: Arc<dyn ClusterSessions>) {
        let _ = self.cluster.set(cluster);
    }

    /// The cluster's session registry, on a cluster node.
    pub fn cluster(&self) -> Option<&Arc<dyn ClusterSessions>> {
        self.cluster.get()
    }

    /// Another node took `client_id` (a connection there claimed it): a connection of it
    /// here is closed with "session taken over" and hands its session over; an offline
    /// copy here (and its expiry, and a delayed will) is dropped, the other node owns the
    /// session now. Whether a connection here had it.
    pub fn taken_elsewhere(&self, client_id: &str) -> bool {
        if lock(&self.claiming).contains(client_id) {
            return false;
        }
        lock(&self.wills).remove(client_id);
        let had_offline = lock(&self.sessions).remove(client_id).is_some();
        if had_offline && let Some(hook) = &self.session_hook {
            // Only this node's own store: the cluster's record is the new owner's.
            hook(client_id, None);
        }
        let mut owners = lock(&self.owners);
        let Some((id, owner)) = owners.remove_entry(client_id) else {
            drop(owners);
            if let Some(c) = self.cluster() {
                c.release(client_id);
            }
            return false;
        };
        if owner.conn == EXPIRY_TASK {
            // The expiry task ends it only if the cluster still says this node owns it.
            owners.insert(id, owner);
            drop(owners);
            if let Some(c) = self.cluster() {
                c.release(client_id);
            }
            return false;
        }
        drop(owners);
        lock(&self.handed_over).insert(id);
        // The connection answers on the sender once closed; nobody waits for it here.
        let (done, _) = oneshot::channel();
        let _ = owner.kick.send(done);
        true
    }

    /// A connection here starts claiming `client_id` in the cluster.
    pub fn begin_claim(&self, client_id: &Arc<str>) {
        lock(&self.claiming).insert(client_id.clone());
    }

    /// The claim of `client_id` is done; `owned`: the cluster still says this node has it.
    /// If not, another node's connection claimed it meanwhile (a takeover applied during
    /// the claim left it alone): the connection here is closed as taken over now.
    pub fn end_claim(&self, client_id: &str, owned: bool) {
        lock(&self.claiming).remove(client_id);
        if !owned {
            self.taken_elsewhere(client_id);
        }
    }

    /// Keeps (and stores) the session of a client that went away.
    pub fn store_session(&self, client_id: Arc<str>, record: SessionRecord) {
        if lock(&self.handed_over).remove(&client_id) {
            // Another node took the session over: its last state goes to that node, and
            // this node keeps no copy (nor an expiry for it).
            if let Some(c) = self.cluster() {
                c.store(&client_id, Some(record.to_stored(false)), false);
            }
            if let Some(hook) = &self.session_hook {
                hook(&client_id, None);
            }
            return;
        }
        self.persist_session(&client_id, Some(record.to_stored(false)));
        let expires = record.expires_at().is_some();
        lock(&self.sessions).insert(client_id, record);
        if expires {
            self.expiry_changed.notify_one();
        }
    }

    /// Stores the state of a connected client's session (`None`: it has none to keep).
    pub fn persist_session(&self, client_id: &str, session: Option<StoredSession>) {
        if session.is_none() {
            lock(&self.handed_over).remove(client_id);
        }
        if let Some(c) = self.cluster() {
            c.store(client_id, session.clone(), false);
        }
        if let Some(hook) = &self.session_hook {
            hook(client_id, session);
        }
    }

    /// Stores the state of the session of a connected client (`None`: it keeps none).
    pub fn persist_live(&self, client_id: &str, session: Option<StoredSession>) {
        if let Some(c) = self.cluster() {
            c.store(client_id, session.clone(), true);
        }
        if let Some(hook) = &self.session_hook {
            hook(client_id, session);
        }
    }

    /// A connection of `client_id` without a session to keep closed: on a cluster node,
    /// its claim on the client id ends (another node's connection waits for no handover).
    pub fn closed_without_session(&self, client_id: &str) {
        lock(&self.handed_over).remove(client_id);
        if let Some(c) = self.cluster() {
            c.store(client_id, None, false);
        }
    }

    /// Forgets this node's copy of a session (offline map and own store) without telling
    /// the cluster: the cluster ended or moved it.
    pub fn forget_local(&self, client_id: &str) {
        lock(&self.sessions).remove(client_id);
        if let Some(hook) = &self.session_hook {
            hook(client_id, None);
        }
    }

    /// Offline sessions.
    pub fn sessions(&self) -> usize {
        lock(&self.sessions).map.len()
    }

    /// When the next offline session expires.
    pub fn next_expiry(&self) -> Option<u64> {
        lock(&self.sessions).by_expiry.first().map(|(at, _)| *at)
    }

    /// Waits until a session that may expire was stored.
    pub async fn expiry_changed(&self) {
        self.expiry_changed.notified().await
    }

    /// Takes an offline session expired at `now` whose client id no connection owns, and
    /// makes the expiry task its owner (a connection arriving meanwhile waits for
    /// [`Registry::release`] through `kick`, as for a takeover), all under one lock, so a
    /// returning client either finds the session or waits until its queue is gone.
    pub fn claim_expired(&self, now: u64, kick: Kick) -> Option<(Arc<str>, SessionRecord)> {
        let mut owners = lock(&self.owners);
        let mut sessions = lock(&self.sessions);
        let id = sessions
            .by_expiry
            .iter()
            .take_while(|(at, _)| *at <= now)
            .find(|(_, id)| !owners.contains_key(id))
            .map(|(_, id)| id.clone())?;
        let taken = sessions.remove(&id)?;
        owners.insert(
            id,
            Owner {
                conn: EXPIRY_TASK,
                kick,
            },
        );
        Some(taken)
    }

    /// The delayed wills of the restored sessions (once).
    pub fn take_restored_wills(&self) -> Vec<(Arc<str>, StoredWill)> {
        std::mem::take(&mut *lock(&self.restored_wills))
    }

    /// A delayed will was published: the offline session no longer holds it.
    pub fn will_published(&self, client_id: &str) {
        let stored = {
            let mut sessions = lock(&self.sessions);
            match sessions.map.get_mut(client_id) {
                Some(r) if r.will.is_some() => {
                    r.will = None;
                    Some(r.to_stored(false))
                }
                _ => None,
            }
        };
        if let Some(s) = stored {
            self.persist_session(client_id, Some(s));
        }
    }

    /// Cancels a delayed will of `client_id`, whoever left it; whether one was due.
    pub fn cancel_will(&self, client_id: &str) -> bool {
        lock(&self.wills).remove(client_id).is_some()
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
        lock(&self.sessions).map.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records what the registry asks of the cluster.
    #[derive(Default)]
    struct Fake {
        stores: Mutex<Vec<(String, bool, bool)>>,
        released: Mutex<Vec<String>>,
    }

    impl ClusterSessions for Fake {
        fn claim(&self, _: &str) -> ClusterFuture<Result<Option<StoredSession>, String>> {
            Box::pin(async { Ok(None) })
        }
        fn store(&self, client_id: &str, session: Option<StoredSession>, live: bool) {
            lock(&self.stores).push((client_id.into(), session.is_some(), live));
        }
        fn release(&self, client_id: &str) {
            lock(&self.released).push(client_id.into());
        }
        fn expire(&self, _: &str) -> ClusterFuture<bool> {
            Box::pin(async { true })
        }
        fn owns(&self, _: &str) -> bool {
            false
        }
    }

    #[test]
    fn another_nodes_claim_closes_the_connection_here_once_its_own_claim_is_done() {
        let r = Registry::new();
        let fake = Arc::new(Fake::default());
        r.set_cluster(fake.clone());
        let id: Arc<str> = "c".into();
        let (kick, mut kicked) = oneshot::channel();
        assert!(r.claim(&id, ConnId(1), kick).is_none());
        // A takeover applied while this connection still claims may be older than its
        // claim: left alone...
        r.begin_claim(&id);
        assert!(!r.taken_elsewhere("c"));
        assert!(kicked.try_recv().is_err());
        // ...until the claim is done and the cluster no longer names this node.
        r.end_claim("c", false);
        assert!(kicked.try_recv().is_ok(), "closed as taken over");
        // Its close hands the session over and keeps no copy (nor an expiry) here.
        r.store_session(id.clone(), SessionRecord::default());
        assert_eq!(r.stored_sessions(), 0);
        assert_eq!(*lock(&fake.stores), [("c".to_string(), true, false)]);
        // Not connected here but held offline: the copy goes and the claimer is answered.
        r.store_session("d".into(), SessionRecord::default());
        assert_eq!(r.stored_sessions(), 1);
        assert!(!r.taken_elsewhere("d"));
        assert_eq!(r.stored_sessions(), 0);
        assert_eq!(*lock(&fake.released), ["d".to_string()]);
        // A claim that is done and still this node's: nothing happens.
        let (kick, mut kept) = oneshot::channel();
        assert!(r.claim(&Arc::from("e"), ConnId(2), kick).is_none());
        r.begin_claim(&Arc::from("e"));
        r.end_claim("e", true);
        assert!(kept.try_recv().is_err());
        assert!(r.owns("e", ConnId(2)));
    }
}
