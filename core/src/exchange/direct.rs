//! Direct exchange: a destination matches when the routing key equals its binding key exactly.

use super::{DestCounts, DestIndex};
use crate::ids::Destination;
use crate::message::FieldTable;
use std::collections::HashMap;
use std::sync::Arc;

/// Bindings of a direct exchange.
///
/// Routing is one hash lookup. The hash map is never iterated, so its (seeded) order cannot
/// reach an output; each entry's destinations are kept sorted instead.
#[derive(Clone, Debug, Default)]
pub struct DirectBindings {
    pub(super) index: DestIndex,
    by_key: HashMap<Arc<str>, DestCounts>,
}

impl DirectBindings {
    pub(super) fn add(&mut self, dest: Destination, key: &str, args: &FieldTable) -> bool {
        if self.index.contains(dest, key, args) {
            return false;
        }
        // Share one allocation of the key between the hash map and the destination index.
        let shared = match self.by_key.get_key_value(key) {
            Some((k, _)) => Arc::clone(k),
            None => Arc::from(key),
        };
        self.by_key
            .entry(Arc::clone(&shared))
            .or_default()
            .increment(dest);
        self.index.insert_shared(dest, shared, args)
    }

    pub(super) fn remove(&mut self, dest: Destination, key: &str, args: &FieldTable) -> bool {
        if !self.index.remove(dest, key, args) {
            return false;
        }
        self.uncount(dest, key);
        true
    }

    pub(super) fn remove_destination(&mut self, dest: Destination) -> usize {
        let removed = self.index.take(dest);
        for e in &removed {
            self.uncount(dest, &e.key);
        }
        removed.len()
    }

    pub(super) fn route(&self, key: &str, out: &mut Vec<Destination>) {
        if let Some(dests) = self.by_key.get(key) {
            dests.push_all(out);
        }
    }

    fn uncount(&mut self, dest: Destination, key: &str) {
        let Some(dests) = self.by_key.get_mut(key) else {
            return;
        };
        dests.decrement(dest);
        if dests.is_empty() {
            self.by_key.remove(key);
            // Give memory back after mass unbinding (e.g. many auto-delete queues going away);
            // the factor-4 hysteresis keeps shrink/grow cycles amortised O(1).
            if self.by_key.capacity() > 64 && self.by_key.len() * 4 < self.by_key.capacity() {
                self.by_key.shrink_to_fit();
            }
        }
    }
}
