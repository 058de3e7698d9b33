//! `PMap`: a persistent (structurally shared) hash map, a hash array mapped trie.
//!
//! Cloning is O(1); a change to one clone copies only the nodes on the path it touches
//! (`Arc::make_mut`), at most [`MAX_DEPTH`] of them, so the broker can hand out immutable
//! snapshots of its routing tables (`routing::RouteTable`) and keep changing its own copy at a
//! cost that does not grow with the table: a SUBSCRIBE next to a million bindings copies
//! about five nodes of at most 32 slots, never the million.
//!
//! Layout: a node is a branch of up to 32 slots indexed by 5 bits of the key's hash (a `u32`
//! bitmap says which are present; the slot vector holds exactly those, so a sparse node costs
//! only its entries) or, once all 64 hash bits are used, a collision list. A slot is an entry
//! (key and value inline, no allocation of its own) or a child node. An empty map allocates
//! nothing; a one-entry map is one node with one slot.
//!
//! Keys are chosen by clients (queue names, routing keys), so the hash is keyed with a
//! process-wide random key (hash flooding would only lengthen collision lists, which need
//! 64 equal hash bits). Iteration order is therefore unspecified and must never reach an
//! output (the core's determinism rule): callers sort what they emit.
//!
//! Bounds: depth at most `MAX_DEPTH` (13 branch levels and a collision list), so every walk
//! and the recursion in `insert`/`remove`/`into_values` are bounded; removal lifts a lone
//! entry into its parent and drops empty nodes, so memory returns after mass removal.

use std::borrow::Borrow;
use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hash};
use std::sync::{Arc, OnceLock};

const BITS: u32 = 5;
const MASK: u64 = (1 << BITS) - 1;
/// Branch levels needed to use all 64 hash bits, plus the collision level.
pub const MAX_DEPTH: u32 = 64_u32.div_ceil(BITS) + 1;

fn hash_of<Q: Hash + ?Sized>(key: &Q) -> u64 {
    static KEYS: OnceLock<RandomState> = OnceLock::new();
    KEYS.get_or_init(RandomState::new).hash_one(key)
}

/// A persistent map. See the module docs.
pub struct PMap<K, V> {
    root: Option<Arc<Node<K, V>>>,
    len: usize,
}

#[derive(Clone)]
enum Node<K, V> {
    Branch {
        bitmap: u32,
        slots: Vec<Slot<K, V>>,
    },
    /// Every key here has the same 64-bit hash.
    Collision(Vec<(K, V)>),
}

#[derive(Clone)]
enum Slot<K, V> {
    Entry(K, V),
    Child(Arc<Node<K, V>>),
}

impl<K, V> Clone for PMap<K, V> {
    fn clone(&self) -> Self {
        PMap {
            root: self.root.clone(),
            len: self.len,
        }
    }
}

impl<K, V> Default for PMap<K, V> {
    fn default() -> Self {
        PMap { root: None, len: 0 }
    }
}

impl<K: std::fmt::Debug, V: std::fmt::Debug> std::fmt::Debug for PMap<K, V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut entries = Vec::new();
        if let Some(root) = &self.root {
            collect(root, &mut entries);
        }
        f.debug_map().entries(entries).finish()
    }
}

/// The bit of `hash` at `shift` in a branch's bitmap, and the index its slot has (or would
/// have) in the branch's slot vector.
fn position(bitmap: u32, hash: u64, shift: u32) -> (u32, usize) {
    let bit = 1u32 << ((hash >> shift) & MASK);
    (bit, (bitmap & (bit - 1)).count_ones() as usize)
}

fn collect<'a, K, V>(node: &'a Node<K, V>, out: &mut Vec<(&'a K, &'a V)>) {
    match node {
        Node::Branch { slots, .. } => {
            for slot in slots {
                match slot {
                    Slot::Entry(k, v) => out.push((k, v)),
                    Slot::Child(child) => collect(child, out),
                }
            }
        }
        Node::Collision(entries) => out.extend(entries.iter().map(|(k, v)| (k, v))),
    }
}

/// Makes room for one more slot exactly: nodes are mostly small and long-lived, so a
/// vector's doubling would waste up to half of every node.
fn insert_exact<T>(v: &mut Vec<T>, index: usize, item: T) {
    v.reserve_exact(1);
    v.insert(index, item);
}

impl<K, V> PMap<K, V>
where
    K: Hash + Eq + Clone,
    V: Clone,
{
    /// An empty map.
    pub fn new() -> Self {
        PMap::default()
    }

    /// The number of entries.
    pub fn len(&self) -> usize {
        self.len
    }

    /// No entries.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The value of `key`.
    pub fn get<Q>(&self, key: &Q) -> Option<&V>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.get_key_value(key).map(|(_, v)| v)
    }

    /// The entry of `key`.
    pub fn get_key_value<Q>(&self, key: &Q) -> Option<(&K, &V)>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let hash = hash_of(key);
        let mut node = self.root.as_deref()?;
        let mut shift = 0;
        loop {
            match node {
                Node::Branch { bitmap, slots } => {
                    let (bit, i) = position(*bitmap, hash, shift);
                    if bitmap & bit == 0 {
                        return None;
                    }
                    match slots.get(i)? {
                        Slot::Entry(k, v) => {
                            return (k.borrow() == key).then_some((k, v));
                        }
                        Slot::Child(child) => {
                            node = child;
                            shift += BITS;
                        }
                    }
                }
                Node::Collision(entries) => {
                    return entries
                        .iter()
                        .find(|(k, _)| k.borrow() == key)
                        .map(|(k, v)| (k, v));
                }
            }
        }
    }

    /// Whether `key` has an entry.
    pub fn contains_key<Q>(&self, key: &Q) -> bool
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.get(key).is_some()
    }

    /// The value for `key`, for changing in place: copies the path to it if it is shared with
    /// another clone (and nothing if the key is absent).
    pub fn get_mut<Q>(&mut self, key: &Q) -> Option<&mut V>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        if !self.contains_key(key) {
            return None;
        }
        let hash = hash_of(key);
        let mut node = Arc::make_mut(self.root.as_mut()?);
        let mut shift = 0;
        loop {
            match node {
                Node::Branch { bitmap, slots } => {
                    let (_, i) = position(*bitmap, hash, shift);
                    match slots.get_mut(i)? {
                        Slot::Entry(k, v) => return ((*k).borrow() == key).then_some(v),
                        Slot::Child(child) => {
                            node = Arc::make_mut(child);
                            shift += BITS;
                        }
                    }
                }
                Node::Collision(entries) => {
                    return entries
                        .iter_mut()
                        .find(|(k, _)| (*k).borrow() == key)
                        .map(|(_, v)| v);
                }
            }
        }
    }

    /// Inserts or replaces; returns the previous value.
    pub fn insert(&mut self, key: K, value: V) -> Option<V> {
        let hash = hash_of(&key);
        let old = match self.root.as_mut() {
            None => {
                let (bit, _) = position(0, hash, 0);
                self.root = Some(Arc::new(Node::Branch {
                    bitmap: bit,
                    slots: vec![Slot::Entry(key, value)],
                }));
                None
            }
            Some(root) => insert_at(root, 0, hash, key, value),
        };
        if old.is_none() {
            self.len += 1;
        }
        old
    }

    /// The value for `key`, inserted with `make` if absent.
    pub fn get_or_insert_with(&mut self, key: K, make: impl FnOnce() -> V) -> &mut V {
        if !self.contains_key(&key) {
            self.insert(key.clone(), make());
        }
        match self.get_mut(&key) {
            Some(v) => v,
            // Just inserted: reaching this is a bug in this module.
            None => unreachable!("PMap: an inserted key is missing"),
        }
    }

    /// Removes `key`'s entry, copying only its path; returns its value.
    pub fn remove<Q>(&mut self, key: &Q) -> Option<V>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        if !self.contains_key(key) {
            return None;
        }
        let hash = hash_of(key);
        let root = self.root.as_mut()?;
        let value = remove_at(root, 0, hash, key)?;
        self.len -= 1;
        if self.len == 0 {
            self.root = None;
        }
        Some(value)
    }

    /// Every entry, in unspecified order.
    pub fn iter(&self) -> impl Iterator<Item = (&K, &V)> + '_ {
        let mut entries = Vec::with_capacity(self.len);
        if let Some(root) = &self.root {
            collect(root, &mut entries);
        }
        entries.into_iter()
    }

    /// The values, in no particular order.
    pub fn values(&self) -> impl Iterator<Item = &V> + '_ {
        self.iter().map(|(_, v)| v)
    }
}

impl<K: Clone, V: Clone> PMap<K, V> {
    /// Consumes the map and returns the values this map alone owned; nodes shared with
    /// another clone are only released (that clone keeps them and their values). For a caller
    /// dropping deep structures held in values without recursion, at a cost proportional to
    /// what it really frees: a node next to a snapshot must not walk the snapshot's million
    /// siblings.
    pub fn into_unique_values(self) -> Vec<V> {
        let mut out = Vec::new();
        if let Some(root) = self.root {
            take_unique_values(root, &mut out);
        }
        out
    }
}

fn take_unique_values<K, V>(node: Arc<Node<K, V>>, out: &mut Vec<V>) {
    match Arc::into_inner(node) {
        Some(Node::Branch { slots, .. }) => {
            for slot in slots {
                match slot {
                    Slot::Entry(_, v) => out.push(v),
                    Slot::Child(child) => take_unique_values(child, out),
                }
            }
        }
        Some(Node::Collision(entries)) => out.extend(entries.into_iter().map(|(_, v)| v)),
        None => {}
    }
}

fn insert_at<K: Hash + Eq + Clone, V: Clone>(
    node: &mut Arc<Node<K, V>>,
    shift: u32,
    hash: u64,
    key: K,
    value: V,
) -> Option<V> {
    match Arc::make_mut(node) {
        Node::Branch { bitmap, slots } => {
            let (bit, i) = position(*bitmap, hash, shift);
            if *bitmap & bit == 0 {
                *bitmap |= bit;
                insert_exact(slots, i, Slot::Entry(key, value));
                return None;
            }
            match slots.get_mut(i)? {
                Slot::Child(child) => return insert_at(child, shift + BITS, hash, key, value),
                Slot::Entry(k, v) if *k == key => return Some(std::mem::replace(v, value)),
                Slot::Entry(..) => {}
            }
            // Two keys share this slot: push both one level down. (Removed and put back, so
            // the vector keeps its length and allocation.)
            let Slot::Entry(old_key, old_value) = slots.remove(i) else {
                return None;
            };
            let old_hash = hash_of(&old_key);
            let child = pair(
                shift + BITS,
                (old_hash, old_key, old_value),
                (hash, key, value),
            );
            slots.insert(i, Slot::Child(Arc::new(child)));
            None
        }
        Node::Collision(entries) => match entries.iter_mut().find(|(k, _)| *k == key) {
            Some((_, v)) => Some(std::mem::replace(v, value)),
            None => {
                entries.push((key, value));
                None
            }
        },
    }
}

/// A node holding two entries whose hashes agree below `shift`.
fn pair<K, V>(shift: u32, a: (u64, K, V), b: (u64, K, V)) -> Node<K, V> {
    if shift >= 64 {
        return Node::Collision(vec![(a.1, a.2), (b.1, b.2)]);
    }
    let (ia, ib) = ((a.0 >> shift) & MASK, (b.0 >> shift) & MASK);
    if ia == ib {
        return Node::Branch {
            bitmap: 1 << ia,
            slots: vec![Slot::Child(Arc::new(pair(shift + BITS, a, b)))],
        };
    }
    let bitmap = (1 << ia) | (1 << ib);
    let (first, second) = if ia < ib { (a, b) } else { (b, a) };
    Node::Branch {
        bitmap,
        slots: vec![
            Slot::Entry(first.1, first.2),
            Slot::Entry(second.1, second.2),
        ],
    }
}

/// Removes `key` (known to be present) below `node`, then keeps the trie compact: an empty
/// child is dropped and a child left with a single entry is replaced by that entry.
fn remove_at<K, V, Q>(node: &mut Arc<Node<K, V>>, shift: u32, hash: u64, key: &Q) -> Option<V>
where
    K: Hash + Eq + Clone + Borrow<Q>,
    V: Clone,
    Q: Hash + Eq + ?Sized,
{
    match Arc::make_mut(node) {
        Node::Branch { bitmap, slots } => {
            let (bit, i) = position(*bitmap, hash, shift);
            if *bitmap & bit == 0 {
                return None;
            }
            let removed = match slots.get_mut(i)? {
                Slot::Entry(k, _) if (*k).borrow() == key => {
                    *bitmap &= !bit;
                    return match slots.remove(i) {
                        Slot::Entry(_, v) => Some(v),
                        Slot::Child(_) => None,
                    };
                }
                Slot::Entry(..) => return None,
                Slot::Child(child) => {
                    let removed = remove_at(child, shift + BITS, hash, key)?;
                    // The child was made unique on the way down, so it can be taken apart.
                    if let Some(lone) = Arc::get_mut(child).and_then(take_lone_entry) {
                        slots[i] = lone;
                    } else if is_empty(child) {
                        slots.remove(i);
                        *bitmap &= !bit;
                    }
                    removed
                }
            };
            Some(removed)
        }
        Node::Collision(entries) => {
            let i = entries.iter().position(|(k, _)| k.borrow() == key)?;
            Some(entries.swap_remove(i).1)
        }
    }
}

/// A node's only slot if it is an entry, taken out (the node is left empty).
fn take_lone_entry<K, V>(node: &mut Node<K, V>) -> Option<Slot<K, V>> {
    match node {
        Node::Branch { bitmap, slots } if slots.len() == 1 => {
            if !matches!(slots.first(), Some(Slot::Entry(..))) {
                return None;
            }
            *bitmap = 0;
            slots.pop()
        }
        Node::Collision(entries) if entries.len() == 1 => {
            entries.pop().map(|(k, v)| Slot::Entry(k, v))
        }
        _ => None,
    }
}

fn is_empty<K, V>(node: &Node<K, V>) -> bool {
    match node {
        Node::Branch { slots, .. } => slots.is_empty(),
        Node::Collision(entries) => entries.is_empty(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    #[derive(Clone, Debug)]
    enum Op {
        Insert(u16, u32),
        Remove(u16),
        Bump(u16),
        GetOrInsert(u16, u32),
        Snapshot,
    }

    fn op() -> impl Strategy<Value = Op> {
        // Keys from a small range, so inserts, hits and removals mix.
        let key = 0u16..300;
        prop_oneof![
            5 => (key.clone(), any::<u32>()).prop_map(|(k, v)| Op::Insert(k, v)),
            3 => key.clone().prop_map(Op::Remove),
            2 => key.clone().prop_map(Op::Bump),
            2 => (key, any::<u32>()).prop_map(|(k, v)| Op::GetOrInsert(k, v)),
            1 => Just(Op::Snapshot),
        ]
    }

    fn key(k: u16) -> Arc<str> {
        Arc::from(format!("k{k}"))
    }

    fn check(map: &PMap<Arc<str>, u32>, model: &BTreeMap<Arc<str>, u32>) {
        assert_eq!(map.len(), model.len());
        assert_eq!(map.is_empty(), model.is_empty());
        for (k, v) in model {
            assert_eq!(map.get(&**k), Some(v));
        }
        let mut all: Vec<(Arc<str>, u32)> = map.iter().map(|(k, v)| (k.clone(), *v)).collect();
        all.sort();
        let expected: Vec<(Arc<str>, u32)> = model.iter().map(|(k, v)| (k.clone(), *v)).collect();
        assert_eq!(all, expected);
    }

    proptest! {
        #[test]
        fn matches_a_btreemap_and_snapshots_never_change(ops in prop::collection::vec(op(), 0..400)) {
            let mut map: PMap<Arc<str>, u32> = PMap::new();
            let mut model = BTreeMap::new();
            let mut snapshots = Vec::new();
            for op in ops {
                match op {
                    Op::Insert(k, v) => {
                        prop_assert_eq!(map.insert(key(k), v), model.insert(key(k), v));
                    }
                    Op::Remove(k) => {
                        prop_assert_eq!(map.remove(&*key(k)), model.remove(&key(k)));
                    }
                    Op::Bump(k) => {
                        let got = map.get_mut(&*key(k)).map(|v| {
                            *v = v.wrapping_add(1);
                            *v
                        });
                        let want = model.get_mut(&key(k)).map(|v| {
                            *v = v.wrapping_add(1);
                            *v
                        });
                        prop_assert_eq!(got, want);
                    }
                    Op::GetOrInsert(k, v) => {
                        let got = *map.get_or_insert_with(key(k), || v);
                        let want = *model.entry(key(k)).or_insert(v);
                        prop_assert_eq!(got, want);
                    }
                    Op::Snapshot => snapshots.push((map.clone(), model.clone())),
                }
            }
            check(&map, &model);
            for (snapshot, then) in &snapshots {
                check(snapshot, then);
            }
            drop(snapshots);
            // Shared with `copy`: nothing is owned alone.
            let copy = map.clone();
            prop_assert!(map.into_unique_values().is_empty() || model.is_empty());
            let mut values = copy.into_unique_values();
            values.sort_unstable();
            let mut want: Vec<u32> = model.values().copied().collect();
            want.sort_unstable();
            prop_assert_eq!(values, want);
        }
    }

    /// A key type whose hashes all collide: exercises the collision lists at full depth.
    #[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
    struct Colliding(u32);

    impl Hash for Colliding {
        fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
            0u8.hash(state);
        }
    }

    #[test]
    fn colliding_keys_live_in_collision_lists() {
        let mut map = PMap::new();
        for i in 0..50 {
            assert_eq!(map.insert(Colliding(i), i), None);
        }
        let snapshot = map.clone();
        for i in 0..50 {
            assert_eq!(map.get(&Colliding(i)), Some(&i));
        }
        for i in (0..50).step_by(2) {
            assert_eq!(map.remove(&Colliding(i)), Some(i));
        }
        assert_eq!(map.len(), 25);
        assert_eq!(map.get(&Colliding(2)), None);
        assert_eq!(map.get(&Colliding(3)), Some(&3));
        assert_eq!(snapshot.len(), 50);
        assert_eq!(snapshot.get(&Colliding(2)), Some(&2));
        for i in (1..50).step_by(2) {
            assert_eq!(map.remove(&Colliding(i)), Some(i));
        }
        assert!(map.is_empty());
        assert!(map.root.is_none(), "an emptied map holds no node");
    }

    #[test]
    fn removal_returns_to_a_compact_trie() {
        let mut map = PMap::new();
        for i in 0..10_000u32 {
            map.insert(i, i);
        }
        for i in 1..10_000u32 {
            map.remove(&i);
        }
        assert_eq!(map.len(), 1);
        // The last entry was lifted back into the root.
        match map.root.as_deref() {
            Some(Node::Branch { slots, .. }) => {
                assert_eq!(slots.len(), 1);
                assert!(matches!(slots[0], Slot::Entry(0, 0)));
            }
            _ => panic!("expected a root branch"),
        }
    }

    #[test]
    fn a_change_next_to_a_snapshot_copies_a_path_not_the_map() {
        let mut map = PMap::new();
        for i in 0..100_000u32 {
            map.insert(i, i);
        }
        let snapshot = map.clone();
        map.insert(100_000, 1);
        // Every root slot but the one on the path is still shared with the snapshot.
        let (Some(Node::Branch { slots: a, .. }), Some(Node::Branch { slots: b, .. })) =
            (map.root.as_deref(), snapshot.root.as_deref())
        else {
            panic!("expected root branches");
        };
        let shared = a
            .iter()
            .zip(b)
            .filter(|(x, y)| match (x, y) {
                (Slot::Child(x), Slot::Child(y)) => Arc::ptr_eq(x, y),
                _ => false,
            })
            .count();
        assert_eq!(shared, 31);
        assert_eq!(snapshot.len(), 100_000);
        assert_eq!(snapshot.get(&100_000), None);
        assert_eq!(map.get(&100_000), Some(&1));
    }
}
