//! Topology simulation: random declares, binds, unbinds and deletes of exchanges and queues
//! (exchange-to-exchange bindings and auto-delete cascades included) against a model of
//! the binding graph. After every op the broker's invariants hold (the harness checks them:
//! `bound_from` counts, the routing table), its bindings are the model's, and routing on the
//! published table reaches the queues the model reaches.

mod common;

use common::*;
use proptest::prelude::*;
use std::collections::BTreeSet;
use warren_core::command::{Bind, ExchangeDeclare, Op, QueueDeclare};
use warren_core::effect::Effect;
use warren_core::message::FieldTable;

const EXCHANGES: u8 = 4;
const QUEUES: u8 = 3;
const KEYS: [&str; 2] = ["a", "b"];

/// Exchanges `x0` and `x1` are auto-delete, `x2` and `x3` are not (a fixed shape per name,
/// so a redeclare is always equivalent).
fn auto_delete(x: u8) -> bool {
    x < 2
}

#[derive(Clone, Debug)]
enum TopOp {
    DeclareExchange(u8),
    DeleteExchange(u8),
    DeclareQueue(u8),
    DeleteQueue(u8),
    BindQueue {
        x: u8,
        q: u8,
        key: u8,
        add: bool,
    },
    BindExchange {
        src: u8,
        dst: u8,
        key: u8,
        add: bool,
    },
}

fn top_op() -> impl Strategy<Value = TopOp> {
    let x = 0..EXCHANGES;
    let q = 0..QUEUES;
    prop_oneof![
        3 => x.clone().prop_map(TopOp::DeclareExchange),
        1 => x.clone().prop_map(TopOp::DeleteExchange),
        2 => q.clone().prop_map(TopOp::DeclareQueue),
        1 => q.clone().prop_map(TopOp::DeleteQueue),
        4 => (x.clone(), q, 0..2u8, prop::bool::weighted(0.6))
            .prop_map(|(x, q, key, add)| TopOp::BindQueue { x, q, key, add }),
        3 => (x.clone(), x, 0..2u8, prop::bool::weighted(0.6))
            .prop_map(|(src, dst, key, add)| TopOp::BindExchange { src, dst, key, add }),
    ]
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Dest {
    Queue(u8),
    Exchange(u8),
}

#[derive(Default)]
struct Model {
    exchanges: BTreeSet<u8>,
    queues: BTreeSet<u8>,
    /// (source, destination, key).
    bindings: BTreeSet<(u8, Dest, u8)>,
}

impl Model {
    /// Removes every binding matching `gone`, then the auto-delete exchanges that lost their
    /// last binding that way, and so on.
    fn remove_bindings(&mut self, gone: impl Fn(&(u8, Dest, u8)) -> bool) {
        let sources: BTreeSet<u8> = self
            .bindings
            .iter()
            .filter(|b| gone(b))
            .map(|b| b.0)
            .collect();
        self.bindings.retain(|b| !gone(b));
        for s in sources {
            self.check_emptied(s);
        }
    }

    fn check_emptied(&mut self, x: u8) {
        if auto_delete(x) && self.exchanges.contains(&x) && !self.bindings.iter().any(|b| b.0 == x)
        {
            self.delete_exchange(x);
        }
    }

    fn delete_exchange(&mut self, x: u8) {
        if self.exchanges.remove(&x) {
            self.remove_bindings(|b| b.0 == x || b.1 == Dest::Exchange(x));
        }
    }

    /// The queues a message to exchange `x` with `key` reaches (direct exchanges only).
    fn route(&self, x: u8, key: u8) -> BTreeSet<u8> {
        let mut queues = BTreeSet::new();
        let mut seen = BTreeSet::from([x]);
        let mut work = vec![x];
        while let Some(x) = work.pop() {
            for &(_, d, _) in self.bindings.iter().filter(|b| b.0 == x && b.2 == key) {
                match d {
                    Dest::Queue(q) => {
                        queues.insert(q);
                    }
                    Dest::Exchange(e) => {
                        if seen.insert(e) {
                            work.push(e);
                        }
                    }
                }
            }
        }
        queues
    }
}

fn xname(x: u8) -> String {
    format!("x{x}")
}

fn qname(q: u8) -> String {
    format!("q{q}")
}

fn failed(effects: &[Effect]) -> bool {
    effects
        .iter()
        .any(|e| matches!(e, Effect::ChannelError { .. }))
}

fn bind(source: u8, destination: String, key: u8) -> Bind {
    Bind {
        source: xname(source),
        destination,
        routing_key: KEYS[key as usize].to_string(),
        arguments: FieldTable::new(),
        nowait: false,
    }
}

fn run(ops: &[TopOp]) -> Result<(), TestCaseError> {
    let mut h = Harness::new();
    let mut c = h.connect(1);
    let mut m = Model::default();
    for op in ops {
        let (wire, expect_ok) = match *op {
            TopOp::DeclareExchange(x) => {
                m.exchanges.insert(x);
                let op = Op::ExchangeDeclare(ExchangeDeclare {
                    exchange: xname(x),
                    kind: "direct".into(),
                    passive: false,
                    durable: false,
                    auto_delete: auto_delete(x),
                    internal: false,
                    nowait: false,
                    arguments: FieldTable::new(),
                });
                (op, true)
            }
            TopOp::DeleteExchange(x) => {
                m.delete_exchange(x);
                let op = Op::ExchangeDelete {
                    exchange: xname(x),
                    if_unused: false,
                    nowait: false,
                };
                (op, true)
            }
            TopOp::DeclareQueue(q) => {
                m.queues.insert(q);
                let op = Op::QueueDeclare(QueueDeclare {
                    queue: qname(q),
                    passive: false,
                    durable: false,
                    exclusive: false,
                    auto_delete: false,
                    nowait: false,
                    arguments: FieldTable::new(),
                });
                (op, true)
            }
            TopOp::DeleteQueue(q) => {
                if m.queues.remove(&q) {
                    m.remove_bindings(|b| b.1 == Dest::Queue(q));
                }
                let op = Op::QueueDelete {
                    queue: qname(q),
                    if_unused: false,
                    if_empty: false,
                    nowait: false,
                };
                (op, true)
            }
            TopOp::BindQueue { x, q, key, add } => {
                let ok = m.exchanges.contains(&x) && m.queues.contains(&q);
                if ok {
                    let b = (x, Dest::Queue(q), key);
                    if add {
                        m.bindings.insert(b);
                    } else if m.bindings.remove(&b) {
                        m.check_emptied(x);
                    }
                }
                let b = bind(x, qname(q), key);
                let op = if add {
                    Op::QueueBind(b)
                } else {
                    Op::QueueUnbind(b)
                };
                (op, ok)
            }
            TopOp::BindExchange { src, dst, key, add } => {
                let ok = m.exchanges.contains(&src) && m.exchanges.contains(&dst);
                if ok {
                    let b = (src, Dest::Exchange(dst), key);
                    if add {
                        m.bindings.insert(b);
                    } else if m.bindings.remove(&b) {
                        m.check_emptied(src);
                    }
                }
                let b = bind(src, xname(dst), key);
                let op = if add {
                    Op::ExchangeBind(b)
                } else {
                    Op::ExchangeUnbind(b)
                };
                (op, ok)
            }
        };
        let effects = h.op(c, wire);
        prop_assert_eq!(!failed(&effects), expect_ok, "{:?} gave {:?}", op, effects);
        if !expect_ok {
            h.op(c, Op::ChannelCloseOk);
            c = h.open(1, c.channel);
        }
        // Bindings as the broker lists them, in the model's terms.
        let listed: BTreeSet<(u8, Dest, u8)> = h.shards[0]
            .list_bindings()
            .into_iter()
            .map(|b| {
                let num = |s: &str| s[1..].parse::<u8>().expect("test names");
                let d = if b.destination_is_exchange {
                    Dest::Exchange(num(&b.destination))
                } else {
                    Dest::Queue(num(&b.destination))
                };
                let key = KEYS.iter().position(|k| *k == b.routing_key).expect("key") as u8;
                (num(&b.source), d, key)
            })
            .collect();
        prop_assert_eq!(&listed, &m.bindings, "after {:?}", op);
        let exchanges: BTreeSet<u8> = h.shards[0]
            .list_exchanges()
            .into_iter()
            .filter_map(|x| x.name.strip_prefix('x')?.parse().ok())
            .collect();
        prop_assert_eq!(&exchanges, &m.exchanges, "after {:?}", op);
        // Routing on the published table.
        let routes = h.shards[0].routes().clone();
        let vh = routes.vhost("/").expect("default vhost");
        for x in 0..EXCHANGES {
            for key in 0..2u8 {
                let routed = routes.route_publish(vh, &xname(x), KEYS[key as usize], None);
                let got: BTreeSet<u8> = match routed {
                    None => {
                        prop_assert!(!m.exchanges.contains(&x));
                        continue;
                    }
                    Some(r) => r
                        .queues
                        .iter()
                        .map(|id| {
                            (0..QUEUES)
                                .find(|&q| routes.queue(vh, &qname(q)) == Some(*id))
                                .expect("routed to a named queue")
                        })
                        .collect(),
                };
                prop_assert_eq!(got, m.route(x, key), "x{} key {} after {:?}", x, key, op);
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn topology_matches_model(ops in prop::collection::vec(top_op(), 1..60)) {
        run(&ops)?;
    }
}
