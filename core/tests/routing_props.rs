//! Exchange routing: every kind's indexed `route` against a naive reference model (a plain scan
//! over a list of bindings with a simple recursive topic matcher), under random sequences of
//! add / remove / remove_destination, plus focused tests of AMQP edge cases.

use bytes::Bytes;
use proptest::prelude::*;
use std::time::{Duration, Instant};
use warren_core::exchange::{BindingKey, Bindings, ExchangeKind, validate_x_match};
use warren_core::ids::{Destination, ExchangeId, QueueId};
use warren_core::message::{FieldTable, FieldValue};

// ---------------------------------------------------------------------------------------------
// Reference model
// ---------------------------------------------------------------------------------------------

/// Bindings as a plain list; identity is structural equality (the generators never produce
/// floats, so `PartialEq` is a true equality here).
struct Model {
    kind: ExchangeKind,
    bindings: Vec<(Destination, String, FieldTable)>,
}

impl Model {
    fn new(kind: ExchangeKind) -> Model {
        Model {
            kind,
            bindings: Vec::new(),
        }
    }

    fn position(&self, d: Destination, key: &str, args: &FieldTable) -> Option<usize> {
        self.bindings
            .iter()
            .position(|(bd, bk, ba)| *bd == d && bk == key && ba == args)
    }

    fn add(&mut self, d: Destination, key: &str, args: &FieldTable) -> bool {
        if self.position(d, key, args).is_some() {
            return false;
        }
        self.bindings.push((d, key.to_owned(), args.clone()));
        true
    }

    fn remove(&mut self, d: Destination, key: &str, args: &FieldTable) -> bool {
        match self.position(d, key, args) {
            Some(i) => {
                self.bindings.remove(i);
                true
            }
            None => false,
        }
    }

    fn remove_destination(&mut self, d: Destination) -> usize {
        let before = self.bindings.len();
        self.bindings.retain(|(bd, _, _)| *bd != d);
        before - self.bindings.len()
    }

    fn route(&self, key: &str, headers: Option<&FieldTable>) -> Vec<Destination> {
        let mut out: Vec<Destination> = self
            .bindings
            .iter()
            .filter(|(_, bk, ba)| match self.kind {
                ExchangeKind::Direct => bk == key,
                ExchangeKind::Fanout => true,
                ExchangeKind::Topic => topic_matches(bk, key),
                ExchangeKind::Headers => headers_match(ba, headers),
            })
            .map(|(d, _, _)| *d)
            .collect();
        out.sort();
        out.dedup();
        out
    }
}

fn split_words(s: &str) -> Vec<&str> {
    if s.is_empty() {
        Vec::new()
    } else {
        s.split('.').collect()
    }
}

fn topic_matches(pattern: &str, key: &str) -> bool {
    fn go(p: &[&str], k: &[&str]) -> bool {
        match p.split_first() {
            None => k.is_empty(),
            Some((&"#", rest)) => (0..=k.len()).any(|i| go(rest, &k[i..])),
            Some((&"*", rest)) => !k.is_empty() && go(rest, &k[1..]),
            Some((w, rest)) => k.first() == Some(w) && go(rest, &k[1..]),
        }
    }
    go(&split_words(pattern), &split_words(key))
}

fn headers_match(args: &FieldTable, headers: Option<&FieldTable>) -> bool {
    let mode = args
        .get("x-match")
        .and_then(FieldValue::as_str)
        .unwrap_or("all");
    let (any, with_x) = match mode {
        "any" => (true, false),
        "all-with-x" => (false, true),
        "any-with-x" => (true, true),
        _ => (false, false),
    };
    let empty = FieldTable::new();
    let headers = headers.unwrap_or(&empty);
    let conditions: Vec<bool> = args
        .iter()
        .filter(|(k, _)| *k != "x-match" && (with_x || !k.starts_with("x-")))
        .map(|(k, v)| match headers.get(k) {
            None => false,
            Some(h) => ref_value_eq(v, h),
        })
        .collect();
    if any {
        conditions.iter().any(|&c| c)
    } else {
        conditions.iter().all(|&c| c)
    }
}

fn ref_value_eq(binding: &FieldValue, header: &FieldValue) -> bool {
    fn text(v: &FieldValue) -> Option<Vec<u8>> {
        match v {
            FieldValue::ShortString(s) => Some(s.as_bytes().to_vec()),
            FieldValue::LongString(b) => Some(b.to_vec()),
            _ => None,
        }
    }
    match (binding, header) {
        (FieldValue::Void, _) => true,
        _ => match (
            binding.as_i64(),
            header.as_i64(),
            text(binding),
            text(header),
        ) {
            (Some(a), Some(b), _, _) => a == b,
            (_, _, Some(a), Some(b)) => a == b,
            _ => binding == header,
        },
    }
}

// ---------------------------------------------------------------------------------------------
// Generators
// ---------------------------------------------------------------------------------------------

fn dest() -> impl Strategy<Value = Destination> {
    prop_oneof![
        3 => (0u64..6).prop_map(|n| Destination::Queue(QueueId(n))),
        1 => (0u64..3).prop_map(|n| Destination::Exchange(ExchangeId(n))),
    ]
}

fn words_key(alphabet: &'static [&'static str], max_words: usize) -> impl Strategy<Value = String> {
    prop::collection::vec(prop::sample::select(alphabet), 0..=max_words).prop_map(|w| w.join("."))
}

fn topic_pattern() -> impl Strategy<Value = String> {
    words_key(&["a", "b", "", "*", "#"], 5)
}

fn topic_key() -> impl Strategy<Value = String> {
    words_key(&["a", "b", "", "*", "#"], 6)
}

fn direct_key() -> impl Strategy<Value = String> {
    prop::sample::select(vec!["", "a", "b", "a.b", "A"]).prop_map(str::to_owned)
}

fn small_value() -> impl Strategy<Value = FieldValue> {
    prop_oneof![
        Just(FieldValue::Void),
        Just(FieldValue::I8(1)),
        Just(FieldValue::U16(1)),
        Just(FieldValue::I32(2)),
        Just(FieldValue::I64(1)),
        Just(FieldValue::Bool(true)),
        Just(FieldValue::ShortString("s".into())),
        Just(FieldValue::string("s")),
        Just(FieldValue::string("t")),
        Just(FieldValue::ByteArray(Bytes::from_static(b"s"))),
    ]
}

fn x_match_value() -> impl Strategy<Value = FieldValue> {
    prop_oneof![
        Just(FieldValue::string("all")),
        Just(FieldValue::string("any")),
        Just(FieldValue::string("all-with-x")),
        Just(FieldValue::string("any-with-x")),
        Just(FieldValue::ShortString("any".into())),
        Just(FieldValue::string("bogus")),
        Just(FieldValue::I32(1)),
    ]
}

fn header_args() -> impl Strategy<Value = FieldTable> {
    (
        prop::option::of(x_match_value()),
        prop::collection::btree_map(
            prop::sample::select(vec!["h1", "h2", "x-h"]).prop_map(str::to_owned),
            small_value(),
            0..3,
        ),
    )
        .prop_map(|(xm, mut t)| {
            if let Some(v) = xm {
                t.insert("x-match".to_owned(), v);
            }
            t
        })
}

fn message_headers() -> impl Strategy<Value = Option<FieldTable>> {
    prop::option::of(prop::collection::btree_map(
        prop::sample::select(vec!["h1", "h2", "x-h", "h3", "x-match"]).prop_map(str::to_owned),
        small_value(),
        0..4,
    ))
}

/// For non-headers kinds: arguments only matter for identity.
fn plain_args() -> impl Strategy<Value = FieldTable> {
    prop_oneof![
        3 => Just(FieldTable::new()),
        1 => (0i32..2).prop_map(|n| FieldTable::from([("k".to_owned(), FieldValue::I32(n))])),
    ]
}

#[derive(Clone, Debug)]
enum Op {
    Add(Destination, String, FieldTable),
    Remove(Destination, String, FieldTable),
    RemoveDestination(Destination),
    Route(String, Option<FieldTable>),
}

fn ops(
    key: impl Strategy<Value = String> + 'static,
    route_key: impl Strategy<Value = String> + 'static,
    args: impl Strategy<Value = FieldTable> + 'static,
) -> impl Strategy<Value = Vec<Op>> {
    let (key, args) = (key.boxed(), args.boxed());
    let op = prop_oneof![
        6 => (dest(), key.clone(), args.clone()).prop_map(|(d, k, a)| Op::Add(d, k, a)),
        3 => (dest(), key, args).prop_map(|(d, k, a)| Op::Remove(d, k, a)),
        1 => dest().prop_map(Op::RemoveDestination),
        6 => (route_key, message_headers()).prop_map(|(k, h)| Op::Route(k, h)),
    ];
    prop::collection::vec(op, 0..80)
}

fn all_dests() -> Vec<Destination> {
    (0..6)
        .map(|n| Destination::Queue(QueueId(n)))
        .chain((0..3).map(|n| Destination::Exchange(ExchangeId(n))))
        .collect()
}

/// Applies `ops` to both the real index and the model, checking every observable after each.
fn check_against_model(kind: ExchangeKind, ops: &[Op]) -> Result<(), TestCaseError> {
    let mut real = Bindings::new(kind);
    let mut model = Model::new(kind);
    prop_assert_eq!(real.kind(), kind);
    // Router snapshots taken along the way, with what they routed then: later changes must
    // not reach them (the broker hands them to other threads).
    let mut snapshots = Vec::new();
    for op in ops {
        match op {
            Op::Add(d, k, a) => {
                prop_assert_eq!(real.add(*d, k, a), model.add(*d, k, a), "{:?}", op)
            }
            Op::Remove(d, k, a) => {
                prop_assert_eq!(real.remove(*d, k, a), model.remove(*d, k, a), "{:?}", op)
            }
            Op::RemoveDestination(d) => {
                prop_assert_eq!(real.remove_destination(*d), model.remove_destination(*d))
            }
            Op::Route(k, h) => {
                let sentinel = Destination::Exchange(ExchangeId(u64::MAX));
                let mut out = vec![sentinel];
                real.route(k, h.as_ref(), &mut out);
                prop_assert_eq!(out.first(), Some(&sentinel), "route must only append");
                let expected = model.route(k, h.as_ref());
                prop_assert_eq!(&out[1..], expected.as_slice(), "route({:?}, {:?})", k, h);
                let router = real.router();
                let mut snap = Vec::new();
                router.route(k, h.as_ref(), &mut snap);
                prop_assert_eq!(&snap, &expected, "router({:?}, {:?})", k, h);
                snapshots.push((router, k.clone(), h.clone(), expected));
            }
        }
        prop_assert_eq!(real.len(), model.bindings.len());
        prop_assert_eq!(real.is_empty(), model.bindings.is_empty());
        for d in all_dests() {
            prop_assert_eq!(
                real.has_destination(d),
                model.bindings.iter().any(|(bd, _, _)| *bd == d)
            );
        }
        check_list(&real.list(), &model)?;
    }
    for (router, k, h, expected) in &snapshots {
        let mut out = Vec::new();
        router.route(k, h.as_ref(), &mut out);
        prop_assert_eq!(&out, expected, "snapshot changed: route({:?}, {:?})", k, h);
    }
    // A clone shares structure but not changes: it routes and lists identically, and
    // emptying it leaves the original as it was.
    let mut copy = real.clone();
    prop_assert_eq!(copy.list(), real.list());
    let routes = |b: &Bindings| -> Vec<Vec<Destination>> {
        ops.iter()
            .filter_map(|op| match op {
                Op::Route(k, h) => {
                    let mut out = Vec::new();
                    b.route(k, h.as_ref(), &mut out);
                    Some(out)
                }
                _ => None,
            })
            .collect()
    };
    let before = routes(&real);
    prop_assert_eq!(routes(&copy), before.clone());
    for d in all_dests() {
        copy.remove_destination(d);
    }
    prop_assert!(copy.is_empty());
    prop_assert_eq!(routes(&real), before);
    prop_assert_eq!(real.len(), model.bindings.len());
    Ok(())
}

fn check_list(list: &[BindingKey], model: &Model) -> Result<(), TestCaseError> {
    prop_assert_eq!(list.len(), model.bindings.len());
    for pair in list.windows(2) {
        let (a, b) = (&pair[0], &pair[1]);
        prop_assert!(
            (a.destination, &*a.routing_key) <= (b.destination, &*b.routing_key),
            "list not sorted: {:?} then {:?}",
            a,
            b
        );
    }
    for (d, k, a) in &model.bindings {
        prop_assert!(
            list.iter()
                .any(|b| b.destination == *d && &*b.routing_key == k && b.arguments == *a),
            "missing from list: {:?} {:?} {:?}",
            d,
            k,
            a
        );
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn direct_matches_model(ops in ops(direct_key(), direct_key(), plain_args())) {
        check_against_model(ExchangeKind::Direct, &ops)?;
    }

    #[test]
    fn fanout_matches_model(ops in ops(direct_key(), direct_key(), plain_args())) {
        check_against_model(ExchangeKind::Fanout, &ops)?;
    }

    #[test]
    fn topic_matches_model(ops in ops(topic_pattern(), topic_key(), plain_args())) {
        check_against_model(ExchangeKind::Topic, &ops)?;
    }

    #[test]
    fn headers_matches_model(ops in ops(direct_key(), direct_key(), header_args())) {
        check_against_model(ExchangeKind::Headers, &ops)?;
    }

    /// Many bindings at once, routed with many keys: exercises deep shared trie branches.
    #[test]
    fn topic_bulk_matches_model(
        patterns in prop::collection::vec((dest(), topic_pattern()), 0..60),
        keys in prop::collection::vec(topic_key(), 1..30),
    ) {
        let mut real = Bindings::new(ExchangeKind::Topic);
        let mut model = Model::new(ExchangeKind::Topic);
        for (d, p) in &patterns {
            prop_assert_eq!(real.add(*d, p, &FieldTable::new()), model.add(*d, p, &FieldTable::new()));
        }
        for k in &keys {
            let mut out = Vec::new();
            real.route(k, None, &mut out);
            prop_assert_eq!(out, model.route(k, None), "key {:?}", k);
        }
    }

    /// `list` (and therefore everything derived from it) does not depend on insertion order.
    #[test]
    fn list_is_insertion_order_independent(
        bindings in prop::collection::vec((dest(), topic_pattern(), header_args()), 0..40),
    ) {
        for kind in [ExchangeKind::Direct, ExchangeKind::Fanout, ExchangeKind::Topic, ExchangeKind::Headers] {
            let mut forward = Bindings::new(kind);
            let mut backward = Bindings::new(kind);
            for (d, k, a) in &bindings {
                forward.add(*d, k, a);
            }
            for (d, k, a) in bindings.iter().rev() {
                backward.add(*d, k, a);
            }
            prop_assert_eq!(forward.list(), backward.list());
        }
    }

    /// Unbinding everything returns the trie to a bare root, whatever the order.
    #[test]
    fn topic_prunes_to_root(
        patterns in prop::collection::vec((dest(), topic_pattern()), 0..60),
        remove_by_destination in any::<bool>(),
    ) {
        let mut b = Bindings::new(ExchangeKind::Topic);
        for (d, p) in &patterns {
            b.add(*d, p, &FieldTable::new());
        }
        if remove_by_destination {
            for d in all_dests() {
                b.remove_destination(d);
            }
        } else {
            for (d, p) in patterns.iter().rev() {
                b.remove(*d, p, &FieldTable::new());
            }
        }
        prop_assert!(b.is_empty());
        prop_assert_eq!(topic_nodes(&b), 1);
    }
}

// ---------------------------------------------------------------------------------------------
// Focused edge cases
// ---------------------------------------------------------------------------------------------

fn q(n: u64) -> Destination {
    Destination::Queue(QueueId(n))
}

fn route(b: &Bindings, key: &str, headers: Option<&FieldTable>) -> Vec<Destination> {
    let mut out = Vec::new();
    b.route(key, headers, &mut out);
    out
}

fn topic_nodes(b: &Bindings) -> usize {
    match b {
        Bindings::Topic(t) => t.node_count(),
        _ => 0,
    }
}

fn topic_with(pattern: &str) -> Bindings {
    let mut b = Bindings::new(ExchangeKind::Topic);
    assert!(b.add(q(1), pattern, &FieldTable::new()));
    b
}

fn topic_hits(pattern: &str, key: &str) -> bool {
    let hit = route(&topic_with(pattern), key, None) == vec![q(1)];
    assert_eq!(
        hit,
        topic_matches(pattern, key),
        "model disagrees: {pattern:?} {key:?}"
    );
    hit
}

#[test]
fn topic_empty_key_is_zero_words() {
    assert!(topic_hits("#", ""));
    assert!(topic_hits("", ""));
    assert!(!topic_hits("*", ""));
    assert!(!topic_hits("", "a"));
    assert!(topic_hits("#.#", ""));
    assert!(!topic_hits("a.#", ""));
}

#[test]
fn topic_empty_words_are_ordinary() {
    assert!(topic_hits("a.*.b", "a..b"));
    assert!(topic_hits("a..b", "a..b"));
    assert!(!topic_hits("a.b", "a..b"));
    assert!(topic_hits("a.*", "a."));
    assert!(!topic_hits("a.*", "a"));
    assert!(topic_hits("*.*", "."));
    assert!(!topic_hits("*", "."));
    assert!(topic_hits("#", "."));
    assert!(topic_hits(".", "."));
}

#[test]
fn topic_star_is_exactly_one_word() {
    assert!(topic_hits("*", "a"));
    assert!(!topic_hits("*", "a.b"));
    assert!(topic_hits("a.*.c", "a.b.c"));
    assert!(!topic_hits("a.*.c", "a.c"));
    assert!(!topic_hits("a.*.c", "a.b.b.c"));
    // Only whole words are wildcards.
    assert!(!topic_hits("a*", "ab"));
    assert!(topic_hits("a*", "a*"));
    assert!(!topic_hits("a#", "a.b"));
}

#[test]
fn topic_hash_positions() {
    assert!(topic_hits("#", "a.b.c"));
    assert!(topic_hits("a.#", "a"));
    assert!(topic_hits("a.#", "a.b.c"));
    assert!(!topic_hits("a.#", "b.a"));
    assert!(topic_hits("#.a", "a"));
    assert!(topic_hits("#.a", "b.c.a"));
    assert!(!topic_hits("#.a", "a.b"));
    assert!(topic_hits("a.#.b", "a.b"));
    assert!(topic_hits("a.#.b", "a.x.b"));
    assert!(topic_hits("a.#.b", "a.x.y.b"));
    assert!(topic_hits("a.#.b", "a.b.b"));
    assert!(!topic_hits("a.#.b", "a.b.c"));
    assert!(topic_hits("#.#", "a.b"));
    assert!(topic_hits("#.*", "a"));
    assert!(!topic_hits("#.*", ""));
    assert!(topic_hits("*.#", "a"));
    assert!(topic_hits("#.*.#", "a.b.c"));
    assert!(topic_hits("#.a.#", "x.a.y"));
    assert!(!topic_hits("#.a.#", "x.b.y"));
    // Literal `*` / `#` in a routing key are plain words.
    assert!(topic_hits("*", "#"));
    assert!(!topic_hits("a", "*"));
}

#[test]
fn topic_many_hashes_do_not_blow_up() {
    let pattern = vec!["#"; 40].join(".");
    let pattern_a = [pattern.as_str(), "a", pattern.as_str(), "b"].join(".");
    let mut b = Bindings::new(ExchangeKind::Topic);
    b.add(q(1), &pattern, &FieldTable::new());
    b.add(q(2), &pattern_a, &FieldTable::new());
    let key = vec!["x"; 300].join(".");
    let start = Instant::now();
    assert_eq!(route(&b, &key, None), vec![q(1)]);
    let key_ab = format!("{key}.a.{key}.b");
    assert_eq!(route(&b, &key_ab, None), vec![q(1), q(2)]);
    assert_eq!(route(&b, &format!("{key_ab}.c"), None), vec![q(1)]);
    // Exponential matching would take astronomically long; linear takes milliseconds even
    // unoptimised. Generous bound so a loaded CI machine does not flake.
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "took {:?}",
        start.elapsed()
    );
}

#[test]
fn topic_each_destination_once_and_sorted() {
    let mut b = Bindings::new(ExchangeKind::Topic);
    for p in ["a.b", "a.*", "#", "*.b", "a.#"] {
        b.add(q(3), p, &FieldTable::new());
        b.add(q(1), p, &FieldTable::new());
    }
    b.add(
        Destination::Exchange(ExchangeId(0)),
        "a.b",
        &FieldTable::new(),
    );
    b.add(q(2), "x", &FieldTable::new());
    assert_eq!(
        route(&b, "a.b", None),
        vec![q(1), q(3), Destination::Exchange(ExchangeId(0))]
    );
}

#[test]
fn topic_removal_keeps_other_bindings_and_prunes() {
    let mut b = Bindings::new(ExchangeKind::Topic);
    let none = FieldTable::new();
    b.add(q(1), "a.b.c", &none);
    b.add(q(2), "a.b", &none);
    b.add(q(3), "a.b.c.d.e", &none);
    let full = topic_nodes(&b);
    assert!(b.remove(q(3), "a.b.c.d.e", &none));
    assert_eq!(topic_nodes(&b), full - 2, "d and e pruned");
    assert_eq!(route(&b, "a.b.c", None), vec![q(1)]);
    assert!(b.remove(q(1), "a.b.c", &none));
    assert_eq!(route(&b, "a.b", None), vec![q(2)]);
    assert_eq!(topic_nodes(&b), 3, "root, a, b");
    assert!(!b.remove(q(1), "a.b.c", &none));
    assert!(!b.remove(q(2), "a", &none));
    assert!(b.remove(q(2), "a.b", &none));
    assert_eq!(topic_nodes(&b), 1);
}

#[test]
fn topic_same_pattern_different_arguments_counts_separately() {
    let mut b = Bindings::new(ExchangeKind::Topic);
    let one = FieldTable::from([("k".to_owned(), FieldValue::I32(1))]);
    let none = FieldTable::new();
    assert!(b.add(q(1), "a.*", &none));
    assert!(b.add(q(1), "a.*", &one));
    assert!(!b.add(q(1), "a.*", &one));
    assert_eq!(b.len(), 2);
    assert_eq!(route(&b, "a.x", None), vec![q(1)]);
    assert!(b.remove(q(1), "a.*", &none));
    assert_eq!(route(&b, "a.x", None), vec![q(1)]);
    assert!(b.remove(q(1), "a.*", &one));
    assert!(route(&b, "a.x", None).is_empty());
    assert!(b.is_empty());
}

#[test]
fn topic_deep_pattern_is_not_recursive() {
    // 20,000 words: recursion per word would risk the stack on small threads.
    let pattern = vec!["w"; 20_000].join(".");
    let mut b = Bindings::new(ExchangeKind::Topic);
    b.add(q(1), &pattern, &FieldTable::new());
    assert_eq!(route(&b, &pattern, None), vec![q(1)]);
    let copy = b.clone();
    assert_eq!(route(&copy, &pattern, None), vec![q(1)]);
    assert!(format!("{copy:?}").contains("trie_nodes: 20001"));
    drop(copy);
    assert_eq!(b.remove_destination(q(1)), 1);
    assert_eq!(topic_nodes(&b), 1);
}

#[test]
fn direct_exact_match_only() {
    let mut b = Bindings::new(ExchangeKind::Direct);
    let none = FieldTable::new();
    b.add(q(2), "k", &none);
    b.add(q(1), "k", &none);
    b.add(q(3), "K", &none);
    b.add(q(4), "", &none);
    assert_eq!(route(&b, "k", None), vec![q(1), q(2)]);
    assert_eq!(route(&b, "K", None), vec![q(3)]);
    assert_eq!(route(&b, "", None), vec![q(4)]);
    assert!(route(&b, "k.", None).is_empty());
    assert!(route(&b, "*", None).is_empty());
    assert_eq!(b.remove_destination(q(1)), 1);
    assert_eq!(route(&b, "k", None), vec![q(2)]);
}

#[test]
fn direct_idempotent_rebind_and_argument_identity() {
    let mut b = Bindings::new(ExchangeKind::Direct);
    let none = FieldTable::new();
    let one = FieldTable::from([("k".to_owned(), FieldValue::I32(1))]);
    assert!(b.add(q(1), "k", &none));
    assert!(!b.add(q(1), "k", &none));
    assert!(b.add(q(1), "k", &one));
    assert_eq!(route(&b, "k", None), vec![q(1)]);
    assert!(b.remove(q(1), "k", &one));
    assert!(!b.remove(q(1), "k", &one));
    assert_eq!(route(&b, "k", None), vec![q(1)]);
    assert!(b.has_destination(q(1)));
    assert!(b.remove(q(1), "k", &none));
    assert!(!b.has_destination(q(1)));
    assert!(route(&b, "k", None).is_empty());
}

#[test]
fn nan_arguments_can_be_unbound() {
    let nan = FieldTable::from([("f".to_owned(), FieldValue::F64(f64::NAN))]);
    for kind in [
        ExchangeKind::Direct,
        ExchangeKind::Fanout,
        ExchangeKind::Topic,
        ExchangeKind::Headers,
    ] {
        let mut b = Bindings::new(kind);
        assert!(b.add(q(1), "k", &nan));
        assert!(!b.add(q(1), "k", &nan));
        assert!(b.remove(q(1), "k", &nan));
        assert!(b.is_empty());
    }
}

#[test]
fn fanout_ignores_key_and_headers() {
    let mut b = Bindings::new(ExchangeKind::Fanout);
    b.add(q(2), "x", &FieldTable::new());
    b.add(q(2), "y", &FieldTable::new());
    b.add(q(1), "", &FieldTable::new());
    let h = FieldTable::from([("a".to_owned(), FieldValue::I32(1))]);
    assert_eq!(route(&b, "anything", Some(&h)), vec![q(1), q(2)]);
    assert_eq!(b.len(), 3);
    assert_eq!(b.remove_destination(q(2)), 2);
    assert_eq!(route(&b, "", None), vec![q(1)]);
}

#[test]
fn list_is_sorted_by_destination_then_key() {
    let mut b = Bindings::new(ExchangeKind::Direct);
    let none = FieldTable::new();
    b.add(Destination::Exchange(ExchangeId(0)), "a", &none);
    b.add(q(2), "b", &none);
    b.add(q(2), "a", &none);
    b.add(q(1), "z", &none);
    let got: Vec<(Destination, String)> = b
        .list()
        .into_iter()
        .map(|k| (k.destination, k.routing_key.to_string()))
        .collect();
    assert_eq!(
        got,
        vec![
            (q(1), "z".to_owned()),
            (q(2), "a".to_owned()),
            (q(2), "b".to_owned()),
            (Destination::Exchange(ExchangeId(0)), "a".to_owned()),
        ]
    );
}

// Headers -------------------------------------------------------------------------------------

fn table(pairs: &[(&str, FieldValue)]) -> FieldTable {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), v.clone()))
        .collect()
}

fn headers_hit(args: &[(&str, FieldValue)], headers: Option<&[(&str, FieldValue)]>) -> bool {
    let args = table(args);
    let headers = headers.map(table);
    let mut b = Bindings::new(ExchangeKind::Headers);
    b.add(q(1), "", &args);
    let hit = route(&b, "ignored", headers.as_ref()) == vec![q(1)];
    assert_eq!(
        hit,
        headers_match(&args, headers.as_ref()),
        "model disagrees"
    );
    hit
}

fn s(v: &str) -> FieldValue {
    FieldValue::string(v)
}

#[test]
fn headers_all_is_default_and_needs_every_argument() {
    let args = [("a", s("1")), ("b", s("2"))];
    assert!(headers_hit(
        &args,
        Some(&[("a", s("1")), ("b", s("2")), ("c", s("3"))])
    ));
    assert!(!headers_hit(&args, Some(&[("a", s("1"))])));
    assert!(!headers_hit(&args, Some(&[("a", s("1")), ("b", s("x"))])));
    let explicit = [("x-match", s("all")), ("a", s("1"))];
    assert!(headers_hit(&explicit, Some(&[("a", s("1"))])));
}

#[test]
fn headers_any_needs_one_argument() {
    let args = [("x-match", s("any")), ("a", s("1")), ("b", s("2"))];
    assert!(headers_hit(&args, Some(&[("b", s("2"))])));
    assert!(!headers_hit(&args, Some(&[("a", s("2")), ("b", s("1"))])));
    assert!(!headers_hit(&args, None));
}

#[test]
fn headers_empty_conditions() {
    // `all` over nothing is vacuously true; `any` over nothing is false.
    assert!(headers_hit(&[], None));
    assert!(headers_hit(
        &[("x-match", s("all"))],
        Some(&[("a", s("1"))])
    ));
    assert!(!headers_hit(
        &[("x-match", s("any"))],
        Some(&[("a", s("1"))])
    ));
    assert!(!headers_hit(
        &[("x-match", s("any")), ("x-a", s("1"))],
        Some(&[("x-a", s("1"))])
    ));
}

#[test]
fn headers_x_arguments_ignored_unless_with_x() {
    let all = [("x-a", s("1")), ("b", s("2"))];
    assert!(headers_hit(&all, Some(&[("b", s("2"))])));
    let all_x = [("x-match", s("all-with-x")), ("x-a", s("1")), ("b", s("2"))];
    assert!(!headers_hit(&all_x, Some(&[("b", s("2"))])));
    assert!(headers_hit(&all_x, Some(&[("x-a", s("1")), ("b", s("2"))])));
    let any_x = [("x-match", s("any-with-x")), ("x-a", s("1"))];
    assert!(headers_hit(&any_x, Some(&[("x-a", s("1"))])));
    let any = [("x-match", s("any")), ("x-a", s("1"))];
    assert!(!headers_hit(&any, Some(&[("x-a", s("1"))])));
    // `x-match` itself is never a condition, even with -with-x.
    assert!(headers_hit(&[("x-match", s("all-with-x"))], None));
}

#[test]
fn headers_void_matches_presence() {
    let args = [("a", FieldValue::Void)];
    assert!(headers_hit(&args, Some(&[("a", s("anything"))])));
    assert!(headers_hit(&args, Some(&[("a", FieldValue::Void)])));
    assert!(!headers_hit(&args, Some(&[("b", s("x"))])));
    assert!(!headers_hit(&args, None));
}

#[test]
fn headers_value_equivalences() {
    assert!(headers_hit(
        &[("a", FieldValue::I8(7))],
        Some(&[("a", FieldValue::I64(7))])
    ));
    assert!(headers_hit(
        &[("a", FieldValue::U32(7))],
        Some(&[("a", FieldValue::I16(7))])
    ));
    assert!(!headers_hit(
        &[("a", FieldValue::I8(7))],
        Some(&[("a", FieldValue::I8(8))])
    ));
    assert!(headers_hit(
        &[("a", FieldValue::ShortString("v".into()))],
        Some(&[("a", s("v"))])
    ));
    assert!(!headers_hit(&[("a", s("v"))], Some(&[("a", s("w"))])));
    assert!(!headers_hit(
        &[("a", s("1"))],
        Some(&[("a", FieldValue::I32(1))])
    ));
    assert!(!headers_hit(
        &[("a", FieldValue::ByteArray(Bytes::from_static(b"v")))],
        Some(&[("a", s("v"))])
    ));
    assert!(headers_hit(
        &[("a", FieldValue::Bool(true))],
        Some(&[("a", FieldValue::Bool(true))])
    ));
    assert!(!headers_hit(
        &[("a", FieldValue::Bool(true))],
        Some(&[("a", FieldValue::I8(1))])
    ));
}

#[test]
fn headers_invalid_x_match_routes_as_all() {
    let args = [("x-match", s("bogus")), ("a", s("1")), ("b", s("2"))];
    assert!(!headers_hit(&args, Some(&[("a", s("1"))])));
    assert!(headers_hit(&args, Some(&[("a", s("1")), ("b", s("2"))])));
    let typed = [("x-match", FieldValue::I32(1)), ("a", s("1"))];
    assert!(headers_hit(&typed, Some(&[("a", s("1"))])));
}

#[test]
fn headers_destination_once_across_bindings() {
    let mut b = Bindings::new(ExchangeKind::Headers);
    b.add(q(2), "", &table(&[("a", s("1"))]));
    b.add(q(2), "", &table(&[("x-match", s("any")), ("a", s("1"))]));
    b.add(q(1), "", &table(&[("b", s("1"))]));
    b.add(q(1), "", &table(&[]));
    let h = table(&[("a", s("1"))]);
    assert_eq!(route(&b, "", Some(&h)), vec![q(1), q(2)]);
}

#[test]
fn validate_x_match_values() {
    assert!(validate_x_match(&table(&[])).is_ok());
    for ok in ["all", "any", "all-with-x", "any-with-x"] {
        assert!(
            validate_x_match(&table(&[("x-match", s(ok))])).is_ok(),
            "{ok}"
        );
    }
    assert_eq!(
        validate_x_match(&table(&[("x-match", s("foo"))])),
        Err(
            r#"Invalid x-match field value "foo"; expected all, any, all-with-x, or any-with-x"#
                .to_owned()
        )
    );
    assert!(validate_x_match(&table(&[("x-match", s("ALL"))])).is_err());
    assert!(validate_x_match(&table(&[("x-match", FieldValue::I32(1))])).is_err());
}
