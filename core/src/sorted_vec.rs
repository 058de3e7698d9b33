//! Small sorted sets as vectors, sized exactly while small.
//!
//! A broker keeps several sets per connection and channel (its channels, its exclusive
//! queues, the queues pausing it, a channel's consumers), and with a million idle MQTT
//! connections almost all of them hold zero or one element. A `BTreeSet` leaf has room for
//! eleven keys (~40-110 B for one); a vector grown one slot at a time holds one key in one
//! exact allocation. Inserts and removals are O(n), which stays cheap for the sizes sets of
//! this kind reach (channels per connection are capped by `channel_max`).

/// Makes room for one more element, exactly while the vector is small: most of these hold
/// one entry, where a vector's first growth would reserve four.
pub(crate) fn room_for_one<T>(v: &mut Vec<T>) {
    if v.len() == v.capacity() && v.len() < 4 {
        v.reserve_exact(1);
    }
}

/// A set of `K` as a sorted vector.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct SortedSet<K>(Vec<K>);

impl<K> Default for SortedSet<K> {
    fn default() -> SortedSet<K> {
        SortedSet(Vec::new())
    }
}

impl<K: Ord + Copy> SortedSet<K> {
    /// Returns whether `key` was not there yet.
    pub(crate) fn insert(&mut self, key: K) -> bool {
        match self.0.binary_search(&key) {
            Ok(_) => false,
            Err(at) => {
                room_for_one(&mut self.0);
                self.0.insert(at, key);
                true
            }
        }
    }

    /// Returns whether `key` was there.
    pub(crate) fn remove(&mut self, key: &K) -> bool {
        match self.0.binary_search(key) {
            Ok(at) => {
                self.0.remove(at);
                true
            }
            Err(_) => false,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.0.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The keys, ascending.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &K> {
        self.0.iter()
    }
}

impl<K: Ord + Copy> FromIterator<K> for SortedSet<K> {
    fn from_iter<I: IntoIterator<Item = K>>(iter: I) -> SortedSet<K> {
        let mut keys: Vec<K> = iter.into_iter().collect();
        keys.sort_unstable();
        keys.dedup();
        SortedSet(keys)
    }
}

impl<K> IntoIterator for SortedSet<K> {
    type Item = K;
    type IntoIter = std::vec::IntoIter<K>;
    fn into_iter(self) -> Self::IntoIter {
        self.0.into_iter()
    }
}

#[cfg(test)]
mod tests {
    use super::SortedSet;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    proptest! {
        /// Any sequence of inserts and removals leaves the same set as a `BTreeSet`, and the
        /// same answers on the way.
        #[test]
        fn behaves_as_a_btree_set(ops in proptest::collection::vec((any::<bool>(), 0u8..16), 0..200)) {
            let mut ours = SortedSet::default();
            let mut model = BTreeSet::new();
            for (insert, key) in ops {
                if insert {
                    prop_assert_eq!(ours.insert(key), model.insert(key));
                } else {
                    prop_assert_eq!(ours.remove(&key), model.remove(&key));
                }
                prop_assert_eq!(ours.len(), model.len());
                prop_assert!(ours.iter().eq(model.iter()));
                prop_assert_eq!(ours.iter().any(|k| *k == key), model.contains(&key));
            }
        }
    }

    #[test]
    fn one_key_takes_one_slot() {
        let mut set = SortedSet::default();
        set.insert(7u64);
        assert_eq!(set.0.capacity(), 1);
        set.insert(3);
        assert_eq!(set.0.capacity(), 2);
        assert!(set.iter().copied().eq([3, 7]));
    }
}
