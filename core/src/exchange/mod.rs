//! Binding indexes, one per exchange kind, and routing through them.
//!
//! Invariants every kind upholds (the broker and the native-vs-wasm differential test rely on
//! them):
//!
//! - **Deterministic output.** [`Bindings::route`] appends matching destinations in ascending
//!   [`Destination`] order; [`Bindings::list`] returns bindings sorted by destination, then
//!   routing key, then arguments. Hash maps are only ever used for lookups, so hash seeds never
//!   reach an output.
//! - **Each destination once.** A destination bound several times (different keys or arguments)
//!   that match the same message is appended once per `route` call.
//! - **Routing cost.** Direct routing is one hash lookup; topic routing walks a trie and costs
//!   O(words x live trie states), independent of the number of bindings (only the output size
//!   adds). Fanout and headers are inherently proportional to the destinations / bindings they
//!   hold.
//! - **Removal is proportional to what is removed.** Every kind keeps a per-destination index
//!   (`DestIndex`), so deleting a queue touches only that queue's bindings, and `len`,
//!   `has_destination` and `list` never scan the routing structures.

pub mod direct;
pub mod fanout;
pub mod headers;
pub mod topic;

pub use headers::validate_x_match;

use crate::ids::Destination;
use crate::message::{FieldTable, FieldValue};
use std::cmp::Ordering;
use std::collections::BTreeMap;
use std::sync::Arc;

/// Kinds of exchange.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ExchangeKind {
    /// Routes by exact routing key.
    Direct,
    /// Routes to every binding.
    Fanout,
    /// Routes by routing-key pattern (`*`, `#`).
    Topic,
    /// Routes by message headers (`x-match`).
    Headers,
}

impl ExchangeKind {
    /// Parses the AMQP type name (`direct`, `fanout`, `topic`, `headers`).
    pub fn parse(name: &str) -> Option<ExchangeKind> {
        match name {
            "direct" => Some(ExchangeKind::Direct),
            "fanout" => Some(ExchangeKind::Fanout),
            "topic" => Some(ExchangeKind::Topic),
            "headers" => Some(ExchangeKind::Headers),
            _ => None,
        }
    }

    /// Its AMQP type name.
    pub fn as_str(self) -> &'static str {
        match self {
            ExchangeKind::Direct => "direct",
            ExchangeKind::Fanout => "fanout",
            ExchangeKind::Topic => "topic",
            ExchangeKind::Headers => "headers",
        }
    }
}

/// One binding as stored (for listing, later for `warren ctl list_bindings`).
#[derive(Clone, Debug, PartialEq)]
pub struct BindingKey {
    /// The queue or exchange bound.
    pub destination: Destination,
    /// The binding key.
    pub routing_key: Arc<str>,
    /// The binding arguments (headers exchanges match on them).
    pub arguments: FieldTable,
}

/// The bindings of one exchange, indexed for its kind.
#[derive(Clone, Debug)]
pub enum Bindings {
    /// A direct exchange's bindings.
    Direct(direct::DirectBindings),
    /// A fanout exchange's bindings.
    Fanout(fanout::FanoutBindings),
    /// A topic exchange's bindings.
    Topic(topic::TopicBindings),
    /// A headers exchange's bindings.
    Headers(headers::HeadersBindings),
}

impl Bindings {
    /// No bindings, for an exchange of `kind`.
    pub fn new(kind: ExchangeKind) -> Bindings {
        match kind {
            ExchangeKind::Direct => Bindings::Direct(direct::DirectBindings::default()),
            ExchangeKind::Fanout => Bindings::Fanout(fanout::FanoutBindings::default()),
            ExchangeKind::Topic => Bindings::Topic(topic::TopicBindings::default()),
            ExchangeKind::Headers => Bindings::Headers(headers::HeadersBindings::default()),
        }
    }

    /// The exchange kind.
    pub fn kind(&self) -> ExchangeKind {
        match self {
            Bindings::Direct(_) => ExchangeKind::Direct,
            Bindings::Fanout(_) => ExchangeKind::Fanout,
            Bindings::Topic(_) => ExchangeKind::Topic,
            Bindings::Headers(_) => ExchangeKind::Headers,
        }
    }

    /// Adds a binding. A binding's identity is (destination, routing_key, arguments), as in
    /// RabbitMQ, so re-binding identically is idempotent and returns false.
    pub fn add(
        &mut self,
        destination: Destination,
        routing_key: &str,
        arguments: &FieldTable,
    ) -> bool {
        match self {
            Bindings::Direct(b) => b.add(destination, routing_key, arguments),
            Bindings::Fanout(b) => {
                !b.index.contains(destination, routing_key, arguments)
                    && Arc::make_mut(&mut b.index).insert(destination, routing_key, arguments)
            }
            Bindings::Topic(b) => b.add(destination, routing_key, arguments),
            Bindings::Headers(b) => {
                !b.index.contains(destination, routing_key, arguments)
                    && Arc::make_mut(&mut b.index).insert(destination, routing_key, arguments)
            }
        }
    }

    /// Removes one binding; false if it did not exist.
    pub fn remove(
        &mut self,
        destination: Destination,
        routing_key: &str,
        arguments: &FieldTable,
    ) -> bool {
        match self {
            Bindings::Direct(b) => b.remove(destination, routing_key, arguments),
            Bindings::Fanout(b) => {
                b.index.contains(destination, routing_key, arguments)
                    && Arc::make_mut(&mut b.index).remove(destination, routing_key, arguments)
            }
            Bindings::Topic(b) => b.remove(destination, routing_key, arguments),
            Bindings::Headers(b) => {
                b.index.contains(destination, routing_key, arguments)
                    && Arc::make_mut(&mut b.index).remove(destination, routing_key, arguments)
            }
        }
    }

    /// Removes every binding to `destination` (the queue or exchange was deleted); returns how
    /// many.
    pub fn remove_destination(&mut self, destination: Destination) -> usize {
        match self {
            Bindings::Direct(b) => b.remove_destination(destination),
            Bindings::Fanout(b) => take_shared(&mut b.index, destination),
            Bindings::Topic(b) => b.remove_destination(destination),
            Bindings::Headers(b) => take_shared(&mut b.index, destination),
        }
    }

    /// True if any binding leads to `destination`.
    pub fn has_destination(&self, destination: Destination) -> bool {
        self.index().contains_destination(destination)
    }

    /// Appends every matching destination to `out`, each once, in ascending order. `headers`
    /// is the message's headers table (`None` = empty). Direct, fanout and, natively, topic
    /// (up to 16 live trie nodes; wasm32: two small `Vec`s) never allocate beyond `out`'s growth.
    pub fn route(
        &self,
        routing_key: &str,
        headers: Option<&FieldTable>,
        out: &mut Vec<Destination>,
    ) {
        match self {
            Bindings::Direct(b) => b.route(routing_key, out),
            Bindings::Fanout(b) => out.extend(b.index.destinations()),
            Bindings::Topic(b) => b.route(routing_key, out),
            Bindings::Headers(b) => b.route(headers, out),
        }
    }

    /// An immutable snapshot of the routing structure, O(1): what [`Router::route`] reads
    /// outside the broker (see `routing::RouteTable`).
    pub fn router(&self) -> Router {
        Router(match self {
            Bindings::Direct(b) => RouterKind::Direct(b.router()),
            Bindings::Fanout(b) => RouterKind::Fanout(Arc::clone(&b.index)),
            Bindings::Topic(b) => RouterKind::Topic(b.router()),
            Bindings::Headers(b) => RouterKind::Headers(Arc::clone(&b.index)),
        })
    }

    /// The number of bindings.
    pub fn len(&self) -> usize {
        self.index().len()
    }

    /// No bindings.
    pub fn is_empty(&self) -> bool {
        self.index().len() == 0
    }

    /// Every binding, sorted by destination, then routing key, then arguments.
    pub fn list(&self) -> Vec<BindingKey> {
        self.index().list()
    }

    fn index(&self) -> &DestIndex {
        match self {
            Bindings::Direct(b) => &b.index,
            Bindings::Fanout(b) => &b.index,
            Bindings::Topic(b) => &b.index,
            Bindings::Headers(b) => &b.index,
        }
    }
}

/// Removes every binding to `dest` from an index shared with snapshots (copying it only if
/// there is something to remove); returns how many.
fn take_shared(index: &mut Arc<DestIndex>, dest: Destination) -> usize {
    if !index.contains_destination(dest) {
        return 0;
    }
    Arc::make_mut(index).take(dest).len()
}

/// An immutable snapshot of one exchange's routing structure ([`Bindings::router`]): routes
/// exactly as the bindings did when it was taken, however they change afterwards.
#[derive(Clone, Debug)]
pub struct Router(RouterKind);

#[derive(Clone, Debug)]
enum RouterKind {
    Direct(direct::DirectRouter),
    Fanout(Arc<DestIndex>),
    Topic(topic::TopicRouter),
    Headers(Arc<DestIndex>),
}

impl Router {
    /// A topic exchange's (topic permissions apply to those only).
    pub fn is_topic(&self) -> bool {
        matches!(self.0, RouterKind::Topic(_))
    }

    /// A headers exchange's: the only kind whose routing reads a message's headers.
    pub fn reads_headers(&self) -> bool {
        matches!(self.0, RouterKind::Headers(_))
    }

    /// As [`Bindings::route`].
    pub fn route(
        &self,
        routing_key: &str,
        headers: Option<&FieldTable>,
        out: &mut Vec<Destination>,
    ) {
        match &self.0 {
            RouterKind::Direct(r) => r.route(routing_key, out),
            RouterKind::Fanout(index) => out.extend(index.destinations()),
            RouterKind::Topic(r) => r.route(routing_key, out),
            RouterKind::Headers(index) => headers::route(index, headers, out),
        }
    }
}

/// A routing key and arguments bound to one destination.
#[derive(Clone, Debug)]
pub(crate) struct KeyArgs {
    pub(crate) key: Arc<str>,
    pub(crate) args: FieldTable,
}

impl KeyArgs {
    fn cmp_to(&self, key: &str, args: &FieldTable) -> Ordering {
        (*self.key)
            .cmp(key)
            .then_with(|| cmp_table(&self.args, args))
    }
}

/// Every binding, grouped by destination: the source of truth for binding identity, `len`,
/// `list` and per-destination removal. Kinds that route through another structure (direct's
/// hash, topic's trie) keep that structure in step with this one.
#[derive(Clone, Debug, Default)]
pub(crate) struct DestIndex {
    /// Per destination, its bindings sorted by (key, arguments) with no duplicates and never
    /// an empty vector, so the map's keys are exactly the bound destinations.
    by_dest: BTreeMap<Destination, Vec<KeyArgs>>,
    len: usize,
}

impl DestIndex {
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn contains(&self, dest: Destination, key: &str, args: &FieldTable) -> bool {
        self.by_dest
            .get(&dest)
            .is_some_and(|v| v.binary_search_by(|e| e.cmp_to(key, args)).is_ok())
    }

    pub(crate) fn contains_destination(&self, dest: Destination) -> bool {
        self.by_dest.contains_key(&dest)
    }

    /// Inserts the binding; false if it already existed. Allocates a fresh `Arc` for the key;
    /// use [`DestIndex::insert_shared`] to share one already held by a routing structure.
    pub(crate) fn insert(&mut self, dest: Destination, key: &str, args: &FieldTable) -> bool {
        if self.contains(dest, key, args) {
            return false;
        }
        self.insert_shared(dest, Arc::from(key), args)
    }

    /// Inserts the binding with a caller-provided key; false if it already existed.
    pub(crate) fn insert_shared(
        &mut self,
        dest: Destination,
        key: Arc<str>,
        args: &FieldTable,
    ) -> bool {
        let entries = self.by_dest.entry(dest).or_default();
        match entries.binary_search_by(|e| e.cmp_to(&key, args)) {
            Ok(_) => false,
            Err(i) => {
                crate::sorted_vec::room_for_one(entries);
                entries.insert(
                    i,
                    KeyArgs {
                        key,
                        args: args.clone(),
                    },
                );
                self.len += 1;
                true
            }
        }
    }

    pub(crate) fn remove(&mut self, dest: Destination, key: &str, args: &FieldTable) -> bool {
        let Some(entries) = self.by_dest.get_mut(&dest) else {
            return false;
        };
        let Ok(i) = entries.binary_search_by(|e| e.cmp_to(key, args)) else {
            return false;
        };
        entries.remove(i);
        if entries.is_empty() {
            self.by_dest.remove(&dest);
        }
        self.len -= 1;
        true
    }

    /// Removes and returns every binding to `dest`.
    pub(crate) fn take(&mut self, dest: Destination) -> Vec<KeyArgs> {
        let entries = self.by_dest.remove(&dest).unwrap_or_default();
        self.len -= entries.len();
        entries
    }

    /// Bound destinations, ascending, each once.
    pub(crate) fn destinations(&self) -> impl Iterator<Item = Destination> + '_ {
        self.by_dest.keys().copied()
    }

    /// (destination, its bindings), ascending by destination.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (Destination, &[KeyArgs])> + '_ {
        self.by_dest.iter().map(|(d, v)| (*d, v.as_slice()))
    }

    pub(crate) fn list(&self) -> Vec<BindingKey> {
        let mut out = Vec::with_capacity(self.len);
        for (dest, entries) in &self.by_dest {
            out.extend(entries.iter().map(|e| BindingKey {
                destination: *dest,
                routing_key: Arc::clone(&e.key),
                arguments: e.args.clone(),
            }));
        }
        out
    }
}

/// How many bindings with one routing key lead to each destination, sorted by destination.
///
/// A count rather than a set because a destination can be bound with the same key several times
/// under different arguments; it must keep matching until the last of those is removed.
pub(crate) type DestCounts = Counts<Destination>;

/// A multiset as a vector of (key, count) sorted by key: most hold one or two keys (one MQTT
/// client's filter, one queue's source exchange), where a `BTreeMap` node costs ~150-300 B
/// and this one exact allocation of 16-24 B.
#[derive(Clone, Debug)]
pub(crate) struct Counts<K>(Vec<(K, usize)>);

impl<K> Default for Counts<K> {
    fn default() -> Counts<K> {
        Counts(Vec::new())
    }
}

impl<K: Ord + Copy> Counts<K> {
    pub(crate) fn increment(&mut self, key: K) {
        match self.0.binary_search_by_key(&key, |e| e.0) {
            Ok(i) => self.0[i].1 += 1,
            Err(i) => {
                crate::sorted_vec::room_for_one(&mut self.0);
                self.0.insert(i, (key, 1))
            }
        }
    }

    /// Returns false if `key` was not counted (the indexes disagree, which is a bug upstream).
    pub(crate) fn decrement(&mut self, dest: K) -> bool {
        let Ok(i) = self.0.binary_search_by_key(&dest, |e| e.0) else {
            return false;
        };
        if self.0[i].1 > 1 {
            self.0[i].1 -= 1;
        } else {
            self.0.remove(i);
        }
        true
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Appends the keys, ascending, each once.
    pub(crate) fn push_all(&self, out: &mut Vec<K>) {
        out.extend(self.0.iter().map(|e| e.0));
    }

    /// The keys, ascending, each once.
    pub(crate) fn keys(&self) -> impl Iterator<Item = K> + '_ {
        self.0.iter().map(|e| e.0)
    }

    #[cfg(any(test, feature = "testing"))]
    /// (key, count), ascending by key.
    pub(crate) fn entries(&self) -> &[(K, usize)] {
        &self.0
    }
}

/// Sorts `out[start..]` and removes duplicates from it, leaving `out[..start]` untouched.
pub(crate) fn sort_dedup_tail(out: &mut Vec<Destination>, start: usize) {
    let Some(tail) = out.get_mut(start..) else {
        return;
    };
    tail.sort_unstable();
    let mut kept = start;
    for i in start..out.len() {
        if kept == start || out[kept - 1] != out[i] {
            out[kept] = out[i];
            kept += 1;
        }
    }
    out.truncate(kept);
}

/// A total order on field tables, so binding arguments can be kept sorted and compared for
/// identity. `FieldValue` is only `PartialEq` (it holds floats); here floats compare by
/// `total_cmp`, so a binding with a NaN argument can still be found and removed.
pub(crate) fn cmp_table(a: &FieldTable, b: &FieldTable) -> Ordering {
    let mut ia = a.iter();
    let mut ib = b.iter();
    loop {
        match (ia.next(), ib.next()) {
            (None, None) => return Ordering::Equal,
            (None, Some(_)) => return Ordering::Less,
            (Some(_), None) => return Ordering::Greater,
            (Some((ka, va)), Some((kb, vb))) => {
                let o = ka.cmp(kb).then_with(|| cmp_value(va, vb));
                if o != Ordering::Equal {
                    return o;
                }
            }
        }
    }
}

fn cmp_value(a: &FieldValue, b: &FieldValue) -> Ordering {
    use FieldValue as V;
    match (a, b) {
        (V::Bool(x), V::Bool(y)) => x.cmp(y),
        (V::I8(x), V::I8(y)) => x.cmp(y),
        (V::U8(x), V::U8(y)) => x.cmp(y),
        (V::I16(x), V::I16(y)) => x.cmp(y),
        (V::U16(x), V::U16(y)) => x.cmp(y),
        (V::I32(x), V::I32(y)) => x.cmp(y),
        (V::U32(x), V::U32(y)) => x.cmp(y),
        (V::I64(x), V::I64(y)) => x.cmp(y),
        (V::F32(x), V::F32(y)) => x.total_cmp(y),
        (V::F64(x), V::F64(y)) => x.total_cmp(y),
        (
            V::Decimal {
                scale: sx,
                value: vx,
            },
            V::Decimal {
                scale: sy,
                value: vy,
            },
        ) => sx.cmp(sy).then_with(|| vx.cmp(vy)),
        (V::ShortString(x), V::ShortString(y)) => x.cmp(y),
        (V::LongString(x), V::LongString(y)) => x.cmp(y),
        (V::Array(x), V::Array(y)) => {
            for (p, q) in x.iter().zip(y) {
                let o = cmp_value(p, q);
                if o != Ordering::Equal {
                    return o;
                }
            }
            x.len().cmp(&y.len())
        }
        (V::Timestamp(x), V::Timestamp(y)) => x.cmp(y),
        (V::Table(x), V::Table(y)) => cmp_table(x, y),
        (V::ByteArray(x), V::ByteArray(y)) => x.cmp(y),
        (V::Void, V::Void) => Ordering::Equal,
        _ => variant_rank(a).cmp(&variant_rank(b)),
    }
}

fn variant_rank(v: &FieldValue) -> u8 {
    use FieldValue as V;
    match v {
        V::Bool(_) => 0,
        V::I8(_) => 1,
        V::U8(_) => 2,
        V::I16(_) => 3,
        V::U16(_) => 4,
        V::I32(_) => 5,
        V::U32(_) => 6,
        V::I64(_) => 7,
        V::F32(_) => 8,
        V::F64(_) => 9,
        V::Decimal { .. } => 10,
        V::ShortString(_) => 11,
        V::LongString(_) => 12,
        V::Array(_) => 13,
        V::Timestamp(_) => 14,
        V::Table(_) => 15,
        V::ByteArray(_) => 16,
        V::Void => 17,
    }
}
