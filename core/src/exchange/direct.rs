//! Direct exchange: a destination matches when the routing key equals its binding key exactly.

use super::{DestCounts, DestIndex};
use crate::ids::Destination;
use crate::message::FieldTable;
use crate::pmap::PMap;
use std::sync::Arc;

/// Bindings of a direct exchange.
///
/// Routing is one hash lookup. The map is never iterated, so its (seeded) order cannot reach
/// an output; each entry's destinations are kept sorted instead. The map is persistent, so a
/// routing snapshot ([`DirectBindings::router`]) costs O(1) and a later change copies only
/// its own path.
#[derive(Clone, Debug, Default)]
pub struct DirectBindings {
    pub(super) index: DestIndex,
    by_key: PMap<Arc<str>, DestCounts>,
}

/// An immutable snapshot of a direct exchange's routing keys.
#[derive(Clone, Debug, Default)]
pub struct DirectRouter {
    by_key: PMap<Arc<str>, DestCounts>,
}

impl DirectRouter {
    pub(super) fn route(&self, key: &str, out: &mut Vec<Destination>) {
        if let Some(dests) = self.by_key.get(key) {
            dests.push_all(out);
        }
    }
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
            .get_or_insert_with(Arc::clone(&shared), DestCounts::default)
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

    pub(super) fn router(&self) -> DirectRouter {
        DirectRouter {
            by_key: self.by_key.clone(),
        }
    }

    fn uncount(&mut self, dest: Destination, key: &str) {
        let Some(dests) = self.by_key.get_mut(key) else {
            return;
        };
        dests.decrement(dest);
        if dests.is_empty() {
            self.by_key.remove(key);
        }
    }
}
