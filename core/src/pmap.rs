//! `PMap`: a persistent (structurally shared) hash map.
//!
//! Cloning is O(1); a change to one clone copies only what it touches, so the broker can hand
//! out immutable snapshots of its routing tables (`routing::RouteTable`) and keep changing its
//! own copy at a cost that does not grow with the table (a SUBSCRIBE next to a million
//! bindings must not copy them).
//!
//! Iteration order is unspecified and must never reach an output (the core's determinism
//! rule): callers sort what they emit.
//!
//! PLACEHOLDER IMPLEMENTATION: an `Arc<BTreeMap>` copied on write (O(n) per change while a
//! snapshot is alive). To be replaced by a hash array mapped trie with the same API.

use std::borrow::Borrow;
use std::collections::BTreeMap;
use std::hash::Hash;
use std::sync::Arc;

/// A persistent map. See the module docs.
pub struct PMap<K, V> {
    inner: Option<Arc<BTreeMap<K, V>>>,
}

impl<K, V> Clone for PMap<K, V> {
    fn clone(&self) -> Self {
        PMap {
            inner: self.inner.clone(),
        }
    }
}

impl<K, V> Default for PMap<K, V> {
    fn default() -> Self {
        PMap { inner: None }
    }
}

impl<K: std::fmt::Debug + Ord, V: std::fmt::Debug> std::fmt::Debug for PMap<K, V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map()
            .entries(self.inner.iter().flat_map(|m| m.iter()))
            .finish()
    }
}

impl<K, V> PMap<K, V>
where
    K: Hash + Eq + Ord + Clone,
    V: Clone,
{
    pub fn new() -> Self {
        PMap::default()
    }

    pub fn len(&self) -> usize {
        self.inner.as_ref().map_or(0, |m| m.len())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn get<Q>(&self, key: &Q) -> Option<&V>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + Ord + ?Sized,
    {
        self.inner.as_ref()?.get(key)
    }

    pub fn get_key_value<Q>(&self, key: &Q) -> Option<(&K, &V)>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + Ord + ?Sized,
    {
        self.inner.as_ref()?.get_key_value(key)
    }

    pub fn contains_key<Q>(&self, key: &Q) -> bool
    where
        K: Borrow<Q>,
        Q: Hash + Eq + Ord + ?Sized,
    {
        self.get(key).is_some()
    }

    /// The value for `key`, for changing in place: copies the path to it if it is shared with
    /// another clone.
    pub fn get_mut<Q>(&mut self, key: &Q) -> Option<&mut V>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + Ord + ?Sized,
    {
        let map = self.inner.as_mut()?;
        if !map.contains_key(key) {
            return None;
        }
        Arc::make_mut(map).get_mut(key)
    }

    /// Inserts or replaces; returns the previous value.
    pub fn insert(&mut self, key: K, value: V) -> Option<V> {
        let map = self.inner.get_or_insert_with(Default::default);
        Arc::make_mut(map).insert(key, value)
    }

    /// The value for `key`, inserted with `make` if absent.
    pub fn get_or_insert_with(&mut self, key: K, make: impl FnOnce() -> V) -> &mut V {
        let map = self.inner.get_or_insert_with(Default::default);
        Arc::make_mut(map).entry(key).or_insert_with(make)
    }

    pub fn remove<Q>(&mut self, key: &Q) -> Option<V>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + Ord + ?Sized,
    {
        let map = self.inner.as_mut()?;
        if !map.contains_key(key) {
            return None;
        }
        let value = Arc::make_mut(map).remove(key);
        if map.is_empty() {
            self.inner = None;
        }
        value
    }

    /// Every entry, in unspecified order.
    pub fn iter(&self) -> impl Iterator<Item = (&K, &V)> + '_ {
        self.inner.iter().flat_map(|m| m.iter())
    }

    pub fn values(&self) -> impl Iterator<Item = &V> + '_ {
        self.iter().map(|(_, v)| v)
    }
}

impl<K: Clone, V: Clone> PMap<K, V> {
    /// Consumes the map and returns its values (cloned where a node is shared with another
    /// clone), so a caller can drop deep structures held in values without recursion.
    pub fn into_values(self) -> Vec<V> {
        match self.inner {
            None => Vec::new(),
            Some(map) => match Arc::try_unwrap(map) {
                Ok(map) => map.into_values().collect(),
                Err(shared) => shared.values().cloned().collect(),
            },
        }
    }
}
