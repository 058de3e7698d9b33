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

/// A set of `K` as a sorted vector, with room for one key inline: the sets this is for
/// almost always hold zero or one key, and a heap allocation of even two bytes costs a
/// 32-byte malloc chunk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct SortedSet<K>(Repr<K>);

/// `Large` holds at least two keys, so each set has one representation (`PartialEq`).
#[derive(Clone, Debug, PartialEq, Eq)]
enum Repr<K> {
    Small(Option<K>),
    Large(Vec<K>),
}

impl<K> Default for SortedSet<K> {
    fn default() -> SortedSet<K> {
        SortedSet(Repr::Small(None))
    }
}

impl<K: Ord + Copy> SortedSet<K> {
    fn as_slice(&self) -> &[K] {
        match &self.0 {
            Repr::Small(None) => &[],
            Repr::Small(Some(k)) => std::slice::from_ref(k),
            Repr::Large(v) => v,
        }
    }

    /// Returns whether `key` was not there yet.
    pub(crate) fn insert(&mut self, key: K) -> bool {
        match &mut self.0 {
            Repr::Small(slot @ None) => {
                *slot = Some(key);
                true
            }
            Repr::Small(Some(k)) => {
                if *k == key {
                    return false;
                }
                self.0 = Repr::Large(vec![(*k).min(key), (*k).max(key)]);
                true
            }
            Repr::Large(v) => match v.binary_search(&key) {
                Ok(_) => false,
                Err(at) => {
                    room_for_one(v);
                    v.insert(at, key);
                    true
                }
            },
        }
    }

    /// Returns whether `key` was there.
    pub(crate) fn remove(&mut self, key: &K) -> bool {
        match &mut self.0 {
            Repr::Small(slot) => {
                if slot.as_ref() == Some(key) {
                    *slot = None;
                    true
                } else {
                    false
                }
            }
            Repr::Large(v) => {
                let Ok(at) = v.binary_search(key) else {
                    return false;
                };
                v.remove(at);
                if v.len() == 1 {
                    self.0 = Repr::Small(v.pop());
                }
                true
            }
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.as_slice().len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.as_slice().is_empty()
    }

    /// The keys, ascending.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &K> {
        self.as_slice().iter()
    }
}

impl<K: Ord + Copy> FromIterator<K> for SortedSet<K> {
    fn from_iter<I: IntoIterator<Item = K>>(iter: I) -> SortedSet<K> {
        let mut set = SortedSet::default();
        for k in iter {
            set.insert(k);
        }
        set
    }
}

impl<K> IntoIterator for SortedSet<K> {
    type Item = K;
    type IntoIter = std::vec::IntoIter<K>;
    fn into_iter(self) -> Self::IntoIter {
        match self.0 {
            Repr::Small(k) => k.into_iter().collect::<Vec<K>>().into_iter(),
            Repr::Large(v) => v.into_iter(),
        }
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
                // One representation per set: equal sets compare equal.
                let rebuilt: SortedSet<u8> = model.iter().copied().collect();
                prop_assert_eq!(&ours, &rebuilt);
            }
        }
    }

    #[test]
    fn one_key_stays_inline_and_two_take_two_slots() {
        let mut set = SortedSet::default();
        set.insert(7u64);
        assert_eq!(set.0, super::Repr::Small(Some(7)));
        set.insert(3);
        assert_eq!(set.0, super::Repr::Large(vec![3, 7]));
        let super::Repr::Large(v) = &set.0 else {
            unreachable!("two keys are on the heap")
        };
        assert_eq!(v.capacity(), 2);
        set.remove(&3);
        assert_eq!(set.0, super::Repr::Small(Some(7)));
    }
}
