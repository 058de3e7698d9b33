//! Topic exchange: routing keys are `.`-separated words; in binding patterns `*` matches exactly
//! one word and `#` matches zero or more.
//!
//! The empty key is zero words (pattern `#` and pattern `` match it, `*` does not); empty
//! words inside a key (`a..b`, `a.`) are ordinary words.

use super::{DestCounts, DestIndex, sort_dedup_tail};
use crate::ids::Destination;
use crate::message::FieldTable;
use crate::pmap::PMap;
use std::fmt;
use std::sync::Arc;

/// Bindings of a topic exchange: a trie over pattern words.
///
/// Routing simulates the pattern automaton one routing-key word at a time over the set of live
/// trie nodes, de-duplicated after every word. Its cost is O(words x live nodes), independent
/// of how many bindings exist, and never exponential: patterns like `#.#.#.#` collapse to at
/// most one state per trie node per word instead of one per way of splitting the key.
///
/// The trie is persistent: nodes are shared (`Arc`) and children sit in a [`PMap`], so
/// [`TopicBindings::router`] hands out an immutable snapshot in O(1), and a change after a
/// snapshot copies only the nodes on its path (and the map path to each), never the trie.
#[derive(Default, Clone)]
pub struct TopicBindings {
    pub(super) index: DestIndex,
    root: Arc<Node>,
}

/// Summarises the trie instead of printing it: a derived `Debug` would recurse once per
/// pattern word and could overflow the stack on a hostile, very deep pattern.
impl fmt::Debug for TopicBindings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TopicBindings")
            .field("index", &self.index)
            .field("trie_nodes", &self.node_count())
            .finish()
    }
}

/// An immutable snapshot of a topic exchange's trie, for routing outside the broker.
#[derive(Clone, Default)]
pub struct TopicRouter {
    root: Arc<Node>,
}

impl fmt::Debug for TopicRouter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("TopicRouter")
    }
}

#[derive(Default, Clone)]
struct Node {
    /// Children by word. A persistent map: most nodes have none or one child (an MQTT
    /// client's own filter `client/cmd`), a few have a million (`client/<id>/cmd`), and a
    /// change must not copy those siblings while a snapshot shares them.
    words: PMap<Arc<str>, Arc<Node>>,
    star: Option<Arc<Node>>,
    hash: Option<Arc<Node>>,
    /// Destinations whose pattern ends exactly here.
    dests: DestCounts,
    /// Reached through a `#` edge, so it may also swallow any number of further words.
    is_hash: bool,
}

impl Node {
    fn is_empty(&self) -> bool {
        self.dests.is_empty() && self.edge_count() == 0
    }

    fn edge_count(&self) -> usize {
        self.words.len() + usize::from(self.star.is_some()) + usize::from(self.hash.is_some())
    }

    /// The child along pattern word `w` (`*` and `#` are their own edges).
    fn child(&self, w: &str) -> Option<&Node> {
        match w {
            "*" => self.star.as_deref(),
            "#" => self.hash.as_deref(),
            _ => self.words.get(w).map(|n| &**n),
        }
    }

    /// The child along `w`, copied first if a snapshot shares it.
    fn child_mut(&mut self, w: &str) -> Option<&mut Node> {
        let child = match w {
            "*" => self.star.as_mut(),
            "#" => self.hash.as_mut(),
            _ => self.words.get_mut(w),
        }?;
        Some(Arc::make_mut(child))
    }

    fn child_or_insert(&mut self, w: &str) -> &mut Node {
        let child = match w {
            "*" => self.star.get_or_insert_default(),
            "#" => self.hash.get_or_insert_with(|| {
                let mut n = Node::default();
                n.is_hash = true;
                Arc::new(n)
            }),
            _ => self.words.get_or_insert_with(Arc::from(w), Arc::default),
        };
        Arc::make_mut(child)
    }

    fn remove_child(&mut self, w: &str) {
        match w {
            "*" => self.star = None,
            "#" => self.hash = None,
            _ => {
                self.words.remove(w);
            }
        }
    }
}

/// Drops descendants from an explicit stack: the derived drop would recurse once per level.
/// A child still shared with a snapshot is only released (`Arc::into_inner` gives back the
/// node only to its last owner), so the snapshot's owner does that part of the work later,
/// just as flat.
impl Drop for Node {
    fn drop(&mut self) {
        let mut stack = Vec::new();
        self.move_children_to(&mut stack);
        while let Some(mut n) = stack.pop() {
            // `n` is dropped childless at the end of this iteration, so its own drop is flat.
            n.move_children_to(&mut stack);
        }
    }
}

impl Node {
    fn move_children_to(&mut self, stack: &mut Vec<Node>) {
        let words = std::mem::take(&mut self.words);
        stack.extend(
            words
                .into_unique_values()
                .into_iter()
                .filter_map(Arc::into_inner),
        );
        stack.extend(self.star.take().and_then(Arc::into_inner));
        stack.extend(self.hash.take().and_then(Arc::into_inner));
    }

    /// Adds one count of `dest` at the end of `pattern`, creating the path as needed.
    fn link(&mut self, dest: Destination, pattern: &str) {
        let mut node = self;
        for w in words(pattern) {
            node = node.child_or_insert(w);
        }
        node.dests.increment(dest);
    }
}

/// The words of a key or pattern; the empty string has none.
fn words(key: &str) -> impl Iterator<Item = &str> {
    (!key.is_empty())
        .then(|| key.split('.'))
        .into_iter()
        .flatten()
}

impl TopicBindings {
    /// Trie nodes currently allocated, root included: for memory metrics and for checking that
    /// unbinding returns memory (an empty exchange has exactly 1).
    pub fn node_count(&self) -> usize {
        let mut count = 0;
        let mut stack: Vec<&Node> = vec![&self.root];
        while let Some(n) = stack.pop() {
            count += 1;
            stack.extend(n.words.values().map(|n| &**n));
            stack.extend(n.star.as_deref());
            stack.extend(n.hash.as_deref());
        }
        count
    }

    pub(super) fn add(&mut self, dest: Destination, key: &str, args: &FieldTable) -> bool {
        if !self.index.insert(dest, key, args) {
            return false;
        }
        Arc::make_mut(&mut self.root).link(dest, key);
        true
    }

    pub(super) fn remove(&mut self, dest: Destination, key: &str, args: &FieldTable) -> bool {
        if !self.index.remove(dest, key, args) {
            return false;
        }
        self.unlink(dest, key);
        true
    }

    pub(super) fn remove_destination(&mut self, dest: Destination) -> usize {
        let removed = self.index.take(dest);
        for e in &removed {
            self.unlink(dest, &e.key);
        }
        removed.len()
    }

    /// Drops one count of `dest` at the end of `pattern`, then prunes the branch that became
    /// empty so memory returns. Iterative (two walks from the root) rather than recursive, so
    /// a pattern with tens of thousands of words cannot overflow the stack.
    fn unlink(&mut self, dest: Destination, pattern: &str) {
        let path: Vec<&str> = words(pattern).collect();
        let mut node = Arc::make_mut(&mut self.root);
        for w in &path {
            match node.child_mut(w) {
                Some(child) => node = child,
                None => return,
            }
        }
        if !node.dests.decrement(dest) || !node.is_empty() {
            return;
        }
        // The end node is now empty. Find the deepest node on the path that must stay (the
        // root, or one with destinations or another edge); everything below it on the path
        // exists only for this pattern.
        let mut keep = 0;
        let mut node: &Node = &self.root;
        for (depth, w) in path.iter().enumerate() {
            if !node.dests.is_empty() || node.edge_count() > 1 {
                keep = depth;
            }
            match node.child(w) {
                Some(child) => node = child,
                None => return,
            }
        }
        let Some(cut) = path.get(keep) else {
            return; // Empty pattern: the root is never removed.
        };
        let mut node = Arc::make_mut(&mut self.root);
        for w in &path[..keep] {
            match node.child_mut(w) {
                Some(child) => node = child,
                None => return,
            }
        }
        node.remove_child(cut);
    }

    pub(super) fn route(&self, key: &str, out: &mut Vec<Destination>) {
        route(&self.root, key, out);
    }

    /// An immutable snapshot of the trie, O(1).
    pub(super) fn router(&self) -> TopicRouter {
        TopicRouter {
            root: Arc::clone(&self.root),
        }
    }
}

impl TopicRouter {
    pub(super) fn route(&self, key: &str, out: &mut Vec<Destination>) {
        route(&self.root, key, out);
    }
}

/// Nodes of the live and next sets routed in a stack array, before the heap is tried.
/// An MQTT publish against per-client filters keeps one or two live nodes per word.
#[cfg(not(target_arch = "wasm32"))]
const STACK_NODES: usize = 16;

#[cfg(not(target_arch = "wasm32"))]
fn route(root: &Node, key: &str, out: &mut Vec<Destination>) {
    // No allocation per routed publish in the usual case (two `Vec`s per publish were ~5 %
    // of an MQTT broker's samples, docs/benchmarks.md); a larger set routes again on the
    // heap, twice as large each time. Bounded: a set never holds more than the trie's nodes
    // three times over (one per edge kind), so some size fits.
    if route_in(root, key, out, &mut [root; STACK_NODES]) {
        return;
    }
    let mut cap = STACK_NODES * 4;
    while !route_in(root, key, out, &mut vec![root; cap]) {
        cap *= 2;
    }
}

/// Routes `key` with `buf` holding the live set and, behind it, the next one; false, with
/// nothing added to `out`, when they do not fit in `buf` (never empty).
#[cfg(not(target_arch = "wasm32"))]
fn route_in<'a>(
    root: &'a Node,
    key: &str,
    out: &mut Vec<Destination>,
    buf: &mut [&'a Node],
) -> bool {
    buf[0] = root;
    let Some(mut len) = close(buf, 1) else {
        return false;
    };
    for w in words(key) {
        let live = len;
        for i in 0..live {
            let n = buf[i];
            let hash = n.is_hash.then_some(n);
            let word = n.words.get(w).map(|c| &**c);
            for c in [hash, word, n.star.as_deref()].into_iter().flatten() {
                let Some(slot) = buf.get_mut(len) else {
                    return false;
                };
                *slot = c;
                len += 1;
            }
        }
        buf.copy_within(live..len, 0);
        let Some(next) = close(buf, len - live) else {
            return false;
        };
        if next == 0 {
            return true;
        }
        len = next;
    }
    let start = out.len();
    for n in &buf[..len] {
        n.dests.push_all(out);
    }
    // Several end nodes may hold the same destination.
    sort_dedup_tail(out, start);
    true
}

/// Adds to the set `buf[..len]` every node reachable through `#` edges (a `#` may match zero
/// words), then removes duplicates so each trie node is processed once per word; the set's
/// new length, `None` when it outgrows `buf`. Node identity is the address, which only
/// orders this internal set; outputs are sorted by destination afterwards.
#[cfg(not(target_arch = "wasm32"))]
fn close(buf: &mut [&Node], mut len: usize) -> Option<usize> {
    let mut i = 0;
    // Bounded: each push is a strictly deeper node, and trie depth is finite.
    while i < len {
        if let Some(h) = buf[i].hash.as_deref() {
            *buf.get_mut(len)? = h;
            len += 1;
        }
        i += 1;
    }
    let set = &mut buf[..len];
    set.sort_unstable_by_key(|n| std::ptr::from_ref::<Node>(n) as usize);
    let mut kept = 0;
    for i in 0..len {
        if kept == 0 || !std::ptr::eq(set[kept - 1], set[i]) {
            set[kept] = set[i];
            kept += 1;
        }
    }
    Some(kept)
}

/// The wasm32 builds route as before the stack pass (two `Vec`s per call): the JS `.wasm`
/// has a size budget, which the stack pass grew by ~700 bytes, and a browser tab is not
/// CPU-bound. The same automaton and the same output as the native `route`.
#[cfg(target_arch = "wasm32")]
fn route(root: &Node, key: &str, out: &mut Vec<Destination>) {
    let mut live: Vec<&Node> = vec![root];
    close_vec(&mut live);
    let mut next: Vec<&Node> = Vec::new();
    for w in words(key) {
        next.clear();
        for &n in &live {
            if n.is_hash {
                next.push(n);
            }
            if let Some(c) = n.words.get(w).map(|c| &**c) {
                next.push(c);
            }
            if let Some(c) = n.star.as_deref() {
                next.push(c);
            }
        }
        close_vec(&mut next);
        std::mem::swap(&mut live, &mut next);
        if live.is_empty() {
            return;
        }
    }
    let start = out.len();
    for n in &live {
        n.dests.push_all(out);
    }
    sort_dedup_tail(out, start);
}

/// `close` over a `Vec` (wasm32 builds).
#[cfg(target_arch = "wasm32")]
fn close_vec(set: &mut Vec<&Node>) {
    let mut i = 0;
    // Bounded: each push is a strictly deeper node, and trie depth is finite.
    while let Some(&n) = set.get(i) {
        if let Some(h) = n.hash.as_deref() {
            set.push(h);
        }
        i += 1;
    }
    set.sort_unstable_by_key(|n| std::ptr::from_ref::<Node>(n) as usize);
    set.dedup_by(|a, b| std::ptr::eq(*a, *b));
}
