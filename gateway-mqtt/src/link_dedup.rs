//! Drops the resends of tab links (the JS package's `broker.connect`, docs/javascript.md): a
//! link forwards each local message as a QoS 1 PUBLISH carrying its message id in the user
//! property `warren-link-id`, and sends it again after a reconnect when the PUBACK was lost.
//! A PUBLISH whose id this client id already had routed into the core within the window is
//! acknowledged with success and not routed again.
//!
//! An id joins the window when its publish is handed to the core, not at its confirm: the
//! resends that matter are of publishes whose connection died before their PUBACK, and a
//! dead connection's session never sees the confirm. A publish the core refuses (nack) leaves
//! the window again, so its resend goes through; one refused after its connection died stays
//! (its resend is dropped: the one case where a link message can be lost, which needs a
//! server queue that refuses publishes, `x-overflow: reject-publish`, and a cut connection).
//!
//! Bounded: the last [`WINDOW_IDS`] ids per client id, at most [`MAX_IDS`] across all
//! client ids (past it, the least recently used client's window is dropped whole). Ids are
//! kept as 64-bit keyed hashes (SipHash with a random key per server), so an id's length
//! costs nothing; two ids in one window collide with odds of about 2^-48. In memory only: a
//! server restart (or a session resumed on another cluster node) starts with empty windows,
//! so a message stored just before a stop and resent after it is delivered twice
//! (at-least-once, as without the link).

use std::collections::hash_map::RandomState;
use std::collections::{HashMap, HashSet, VecDeque};
use std::hash::BuildHasher;
use std::sync::{Arc, Mutex, PoisonError};

/// The MQTT 5 user property that names a tab link's message.
pub const LINK_ID_PROPERTY: &str = "warren-link-id";
/// Ids remembered per client id (a link's in-flight window is at most 65,535).
pub const WINDOW_IDS: usize = 65_536;
/// Ids remembered across client ids (16 bytes each in the window, ~40 MiB at most).
pub const MAX_IDS: usize = 1 << 20;

struct Window {
    order: VecDeque<u64>,
    set: HashSet<u64>,
    last_use: u64,
}

#[derive(Default)]
struct Windows {
    by_client: HashMap<Arc<str>, Window>,
    ids: usize,
    tick: u64,
}

/// The windows of every client id of one server (shared by its MQTT listeners through
/// `MqttConfig::link_dedup`).
#[derive(Default)]
pub struct LinkDedup {
    hasher: RandomState,
    windows: Mutex<Windows>,
}

impl std::fmt::Debug for LinkDedup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LinkDedup").finish_non_exhaustive()
    }
}

impl LinkDedup {
    fn lock(&self) -> std::sync::MutexGuard<'_, Windows> {
        // The state is a cache of ids: one left half-updated by a panic is still usable.
        self.windows.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The key of a PUBLISH's link id, if it carries one.
    pub fn key(&self, props: &mqtt_proto::v5::PublishProperties) -> Option<u64> {
        props
            .user_properties
            .iter()
            .find(|u| &*u.name == LINK_ID_PROPERTY)
            .map(|u| self.hasher.hash_one(u.value.as_bytes()))
    }

    /// Whether `client_id` already had the message of `key` accepted.
    pub fn seen(&self, client_id: &str, key: u64) -> bool {
        let mut w = self.lock();
        w.tick += 1;
        let tick = w.tick;
        match w.by_client.get_mut(client_id) {
            Some(win) => {
                win.last_use = tick;
                win.set.contains(&key)
            }
            None => false,
        }
    }

    /// Records that the message of `key` from `client_id` was accepted.
    pub fn accept(&self, client_id: &Arc<str>, key: u64) {
        let mut w = self.lock();
        w.tick += 1;
        let tick = w.tick;
        let win = w
            .by_client
            .entry(client_id.clone())
            .or_insert_with(|| Window {
                order: VecDeque::new(),
                set: HashSet::new(),
                last_use: tick,
            });
        win.last_use = tick;
        if !win.set.insert(key) {
            return;
        }
        win.order.push_back(key);
        let mut added = 1isize;
        if win.order.len() > WINDOW_IDS
            && let Some(old) = win.order.pop_front()
        {
            win.set.remove(&old);
            added = 0;
        }
        w.ids = w.ids.saturating_add_signed(added);
        while w.ids > MAX_IDS {
            let Some(lru) = w
                .by_client
                .iter()
                .filter(|(id, _)| id.as_ref() != client_id.as_ref())
                .min_by_key(|(_, win)| win.last_use)
                .map(|(id, _)| id.clone())
            else {
                break;
            };
            if let Some(gone) = w.by_client.remove(&lru) {
                w.ids -= gone.order.len();
            }
        }
    }

    /// Takes `key` out of `client_id`'s window (its publish was refused: a resend must go
    /// through). Rare, so a linear search of the window's order is fine.
    pub fn forget(&self, client_id: &str, key: u64) {
        let mut w = self.lock();
        let Some(win) = w.by_client.get_mut(client_id) else {
            return;
        };
        if win.set.remove(&key) {
            if let Some(i) = win.order.iter().rposition(|&k| k == key) {
                win.order.remove(i);
            }
            w.ids = w.ids.saturating_sub(1);
        }
    }

    /// Client ids with a window (for tests and listings).
    pub fn clients(&self) -> usize {
        self.lock().by_client.len()
    }
}

/// A session's link ids (already in the window) waiting for their publish's confirm: (the
/// core's confirm number, the key), in publish order.
#[derive(Default)]
pub struct Unconfirmed(VecDeque<(u64, u64)>);

impl Unconfirmed {
    pub fn push(&mut self, seq: u64, key: u64) {
        self.0.push_back((seq, key));
    }

    /// The core's answer for confirms up to (or at) `seq`: refused ids leave the window.
    pub fn settle(
        &mut self,
        seq: u64,
        multiple: bool,
        ack: bool,
        dedup: &LinkDedup,
        client_id: &Arc<str>,
    ) {
        while let Some(&(s, key)) = self.0.front() {
            if s > seq || (!multiple && s < seq) {
                if !multiple && s < seq {
                    // Another publish's confirm comes first: look further (rare).
                    if let Some(i) = self.0.iter().position(|&(s, _)| s == seq)
                        && let Some((_, key)) = self.0.remove(i)
                        && !ack
                    {
                        dedup.forget(client_id, key);
                    }
                }
                return;
            }
            self.0.pop_front();
            if !ack {
                dedup.forget(client_id, key);
            }
            if !multiple {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepted_ids_are_seen_per_client_and_the_window_is_bounded() {
        let d = LinkDedup::default();
        let (a, b): (Arc<str>, Arc<str>) = (Arc::from("a"), Arc::from("b"));
        d.accept(&a, 1);
        assert!(d.seen("a", 1));
        assert!(!d.seen("b", 1), "windows are per client id");
        for k in 2..=(WINDOW_IDS as u64 + 1) {
            d.accept(&a, k);
        }
        assert!(!d.seen("a", 1), "the oldest id left the window");
        assert!(d.seen("a", 2));
        d.accept(&b, 7);
        assert_eq!(d.clients(), 2);
    }

    #[test]
    fn a_refused_publish_leaves_the_window() {
        let d = LinkDedup::default();
        let c: Arc<str> = Arc::from("c");
        let mut u = Unconfirmed::default();
        for (seq, key) in [(1, 10), (2, 20), (3, 30)] {
            d.accept(&c, key);
            u.push(seq, key);
        }
        u.settle(2, false, false, &d, &c);
        u.settle(3, true, true, &d, &c);
        assert!(d.seen("c", 10) && d.seen("c", 30));
        assert!(
            !d.seen("c", 20),
            "a nacked publish may be resent and must go through"
        );
    }
}
