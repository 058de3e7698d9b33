//! Seeded random client behaviour for differential tests and benchmarks: a few connections
//! and channels declaring, binding, publishing, consuming, acking, nacking, rejecting,
//! purging, deleting and closing, with time advancing. It follows the effects it is shown
//! (delivery tags, consumer tags, channel errors) so most ops are meaningful, and it
//! deliberately makes mistakes (wrong exchange kinds, unknown tags, bad vhosts) so error
//! paths are covered too.
//!
//! Same seed, same effects shown -> same ops: the generator has no other input.

use crate::codec::{Decoded, PolicyChange};
use bytes::Bytes;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use warren_core::command::{Bind, Consume, ExchangeDeclare, Op, Publish, QueueDeclare};
use warren_core::effect::{Effect, Reply};
use warren_core::message::{FieldTable, FieldValue, Properties};
use warren_core::policy::{ApplyTo, PolicyDef};

/// splitmix64: tiny, seedable, identical everywhere.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in `0..n` (n > 0); the modulo bias is irrelevant here.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
    pub fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len() as u64) as usize]
    }
}

/// One op to apply.
#[derive(Clone, Debug, PartialEq)]
pub struct Step {
    pub now: u64,
    pub conn: u64,
    pub channel: u16,
    pub op: Op,
}

const CONNS: u64 = 3;
const CHANNELS: u16 = 2;
const QUEUES: [&str; 4] = ["q0", "q1", "q2", "q3"];
const EXCHANGES: [(&str, &str); 4] = [
    ("x.direct", "direct"),
    ("x.topic", "topic"),
    ("x.fanout", "fanout"),
    ("x.headers", "headers"),
];
const PUBLISH_TO: [&str; 9] = [
    "",
    "",
    "x.direct",
    "x.topic",
    "x.fanout",
    "x.headers",
    "amq.topic",
    "amq.fanout",
    "missing",
];
const KEYS: [&str; 9] = ["", "q0", "q1", "q2", "q3", "a", "a.b", "a.b.c", "b.a"];
const PATTERNS: [&str; 8] = ["a", "a.b", "*.b", "#", "a.#", "q0", "q1", ""];

type Ch = (u64, u16);

#[derive(Default)]
struct ChannelView {
    /// Highest delivery tag seen on the channel.
    max_tag: u64,
    consumers: Vec<Arc<str>>,
}

/// The generator; see the module docs.
pub struct Scenario {
    rng: Rng,
    now: u64,
    open_conns: BTreeSet<u64>,
    open: BTreeMap<Ch, ChannelView>,
    /// Channels with a channel error the client has not acknowledged yet.
    closing: BTreeSet<Ch>,
    unwritten: BTreeMap<u64, u32>,
    next_consumer: u32,
}

impl Scenario {
    pub fn new(seed: u64) -> Scenario {
        Scenario {
            rng: Rng::new(seed),
            now: 1,
            open_conns: BTreeSet::new(),
            open: BTreeMap::new(),
            closing: BTreeSet::new(),
            unwritten: BTreeMap::new(),
            next_consumer: 0,
        }
    }

    /// The time of the last step (ms).
    pub fn now(&self) -> u64 {
        self.now
    }

    /// The next op, given what the effects so far have shown.
    pub fn next_step(&mut self) -> Step {
        // Mostly small steps; sometimes past a 100 ms message TTL; rarely past queue expiry.
        self.now += match self.rng.below(20) {
            0 => 1000 + self.rng.below(60_000),
            1..=2 => 50 + self.rng.below(200),
            3..=10 => 0,
            _ => 1 + self.rng.below(5),
        };
        let conn = 1 + self.rng.below(CONNS);
        let channel = 1 + self.rng.below(u64::from(CHANNELS)) as u16;
        let step = |now, channel, op| Step {
            now,
            conn,
            channel,
            op,
        };
        if !self.open_conns.contains(&conn) {
            let vhost = if self.rng.chance(3) { "/nope" } else { "/" };
            if vhost == "/" {
                self.open_conns.insert(conn);
            }
            let op = Op::ConnectionOpen {
                vhost: vhost.into(),
                user: "guest".into(),
                cancel_notify: self.rng.chance(80),
            };
            return step(self.now, 0, op);
        }
        let ch = (conn, channel);
        if self.closing.contains(&ch) {
            self.closing.remove(&ch);
            return step(self.now, channel, Op::ChannelCloseOk);
        }
        // Mostly open a closed channel first; sometimes use it unopened (504 CHANNEL_ERROR,
        // a connection error).
        let op = if self.open.contains_key(&ch) || self.rng.chance(2) {
            self.random_op(ch)
        } else {
            Op::ChannelOpen
        };
        match &op {
            Op::ConnectionClose => self.drop_conn(conn),
            Op::Written { count } => {
                let left = self.unwritten.entry(conn).or_default();
                *left = left.saturating_sub(*count);
            }
            _ => {}
        }
        let channel = if matches!(op, Op::ConnectionClose | Op::Written { .. }) {
            0
        } else {
            channel
        };
        step(self.now, channel, op)
    }

    /// Sometimes (3% of calls) an operator's policy change: a length limit with an
    /// overflow behaviour, a TTL with dead-lettering, an alternate exchange, a clear, or a
    /// policy the broker refuses (a bad value, an unknown vhost). A host calls it before
    /// each step; it draws from the same generator, so the same seed gives the same changes.
    pub fn next_policy(&mut self) -> Option<PolicyChange> {
        if !self.rng.chance(3) {
            return None;
        }
        let name = *self.rng.pick(&["p-len", "p-ttl", "p-ae", "p-bad"]);
        if self.rng.chance(25) {
            return Some(PolicyChange::Clear {
                vhost: "/".into(),
                name: name.into(),
            });
        }
        let mut definition = FieldTable::new();
        let (pattern, apply_to) = match name {
            "p-len" => {
                definition.insert(
                    "max-length".into(),
                    FieldValue::I64(self.rng.below(3) as i64),
                );
                let overflow = *self.rng.pick(&["drop-head", "reject-publish"]);
                definition.insert("overflow".into(), FieldValue::string(overflow));
                ("^q[0-2]$", ApplyTo::Queues)
            }
            "p-ttl" => {
                definition.insert("message-ttl".into(), FieldValue::I64(50));
                definition.insert(
                    "dead-letter-exchange".into(),
                    FieldValue::string("x.fanout"),
                );
                ("^q", ApplyTo::All)
            }
            "p-ae" => {
                definition.insert(
                    "alternate-exchange".into(),
                    FieldValue::string("amq.fanout"),
                );
                ("^x\\.", ApplyTo::Exchanges)
            }
            _ => {
                definition.insert("max-length".into(), FieldValue::I64(-1));
                (".*", ApplyTo::All)
            }
        };
        let vhost = if self.rng.chance(5) { "/nope" } else { "/" };
        Some(PolicyChange::Set(PolicyDef {
            vhost: vhost.into(),
            name: name.into(),
            pattern: pattern.into(),
            apply_to,
            priority: self.rng.below(3) as i64,
            definition,
        }))
    }

    /// Learns from the effects of the last step.
    pub fn observe(&mut self, effects: &[Decoded]) {
        for e in effects {
            let Decoded::Effect(e) = e else { continue };
            match e {
                Effect::Reply { ch, reply } => {
                    let key = (ch.conn.0, ch.channel);
                    match reply {
                        Reply::ChannelOpenOk => {
                            self.open.insert(key, ChannelView::default());
                        }
                        Reply::ChannelCloseOk => {
                            self.open.remove(&key);
                        }
                        Reply::ConsumeOk { consumer_tag } => {
                            if let Some(v) = self.open.get_mut(&key) {
                                v.consumers.push(consumer_tag.clone());
                            }
                        }
                        Reply::CancelOk { consumer_tag } => self.forget(key, consumer_tag),
                        Reply::GetOk { delivery, .. } => self.saw_tag(key, delivery.delivery_tag),
                        _ => {}
                    }
                }
                Effect::Deliver { ch, delivery, .. } => {
                    self.saw_tag((ch.conn.0, ch.channel), delivery.delivery_tag);
                    *self.unwritten.entry(ch.conn.0).or_default() += 1;
                }
                Effect::ConsumerCancelled { ch, consumer_tag } => {
                    self.forget((ch.conn.0, ch.channel), consumer_tag)
                }
                Effect::ChannelError { ch, .. } => {
                    let key = (ch.conn.0, ch.channel);
                    self.open.remove(&key);
                    self.closing.insert(key);
                }
                Effect::ConnectionError { conn, .. } => self.drop_conn(conn.0),
                _ => {}
            }
        }
    }

    fn saw_tag(&mut self, ch: Ch, tag: u64) {
        if let Some(v) = self.open.get_mut(&ch) {
            v.max_tag = v.max_tag.max(tag);
        }
    }

    fn forget(&mut self, ch: Ch, tag: &str) {
        if let Some(v) = self.open.get_mut(&ch) {
            v.consumers.retain(|t| &**t != tag);
        }
    }

    fn drop_conn(&mut self, conn: u64) {
        self.open_conns.remove(&conn);
        self.open.retain(|(c, _), _| *c != conn);
        self.closing.retain(|(c, _)| *c != conn);
        self.unwritten.remove(&conn);
    }

    fn nowait(&mut self) -> bool {
        self.rng.chance(10)
    }

    fn tag(&mut self, ch: Ch) -> u64 {
        let max = self.open.get(&ch).map_or(0, |v| v.max_tag);
        // 0 with multiple = "everything"; max + 1 is unknown (406 PRECONDITION_FAILED).
        self.rng.below(max + 2)
    }

    fn queue(&mut self) -> String {
        (*self.rng.pick(&QUEUES)).to_string()
    }

    fn exchange(&mut self) -> (String, String) {
        let (name, kind) = *self.rng.pick(&EXCHANGES);
        // Sometimes redeclare with the wrong kind: 406 PRECONDITION_FAILED.
        let kind = if self.rng.chance(5) {
            EXCHANGES[self.rng.below(4) as usize].1
        } else {
            kind
        };
        (name.to_string(), kind.to_string())
    }

    fn table(&mut self) -> FieldTable {
        let mut t = FieldTable::new();
        if self.rng.chance(50) {
            let m = if self.rng.chance(50) { "all" } else { "any" };
            t.insert("x-match".into(), FieldValue::string(m));
        }
        if self.rng.chance(60) {
            t.insert("k".into(), FieldValue::I32(self.rng.below(3) as i32));
        }
        if self.rng.chance(30) {
            let key: &str = KEYS[self.rng.below(KEYS.len() as u64) as usize];
            t.insert("s".into(), FieldValue::string(key));
        }
        t
    }

    /// Each queue name has its own arguments (TTL with dead-lettering, a length limit,
    /// expiry and a byte limit), so redeclares agree; 5% of declares use another queue's
    /// (406 PRECONDITION_FAILED on an existing queue). Cores without these features ignore
    /// them; cores with them get their timers and limits exercised.
    fn queue_arguments(&mut self, queue: &str) -> FieldTable {
        let as_queue = if self.rng.chance(5) {
            (*self.rng.pick(&QUEUES)).to_string()
        } else {
            queue.to_string()
        };
        let mut t = FieldTable::new();
        match as_queue.as_str() {
            "q1" => {
                t.insert("x-message-ttl".into(), FieldValue::I64(100));
                t.insert(
                    "x-dead-letter-exchange".into(),
                    FieldValue::string("x.fanout"),
                );
            }
            "q2" => {
                t.insert("x-max-length".into(), FieldValue::I64(3));
            }
            "q3" => {
                t.insert("x-expires".into(), FieldValue::I64(2000));
                t.insert("x-max-length-bytes".into(), FieldValue::I64(64));
            }
            _ => {}
        }
        t
    }

    fn properties(&mut self) -> Properties {
        let mut p = Properties::default();
        if self.rng.chance(30) {
            p.content_type = Some("text/plain".into());
        }
        if self.rng.chance(40) {
            let mut h = self.table();
            if self.rng.chance(20) {
                h.insert(
                    "nested".into(),
                    FieldValue::Array(vec![
                        FieldValue::F64(0.5),
                        FieldValue::Bool(true),
                        FieldValue::Timestamp(self.now),
                        FieldValue::Decimal { scale: 2, value: 7 },
                    ]),
                );
            }
            p.headers = Some(h);
        }
        if self.rng.chance(30) {
            p.delivery_mode = Some(1 + self.rng.below(2) as u8);
        }
        if self.rng.chance(10) {
            p.priority = Some(self.rng.below(10) as u8);
        }
        if self.rng.chance(20) {
            p.correlation_id = Some(format!("corr-{}", self.rng.below(100)));
        }
        if self.rng.chance(10) {
            p.expiration = Some(format!("{}", self.rng.below(10_000)));
        }
        if self.rng.chance(20) {
            p.timestamp = Some(self.now / 1000);
        }
        p
    }

    fn body(&mut self) -> Bytes {
        let n = self.rng.below(48) as usize;
        let mut body = Vec::with_capacity(n);
        for _ in 0..n {
            body.push(self.rng.next_u64() as u8);
        }
        Bytes::from(body)
    }

    fn bind(&mut self, to_exchange: bool) -> Bind {
        let (source, _) = self.exchange();
        let destination = if to_exchange {
            self.exchange().0
        } else {
            self.queue()
        };
        Bind {
            destination,
            source,
            routing_key: (*self.rng.pick(&PATTERNS)).to_string(),
            nowait: self.nowait(),
            arguments: if self.rng.chance(40) {
                self.table()
            } else {
                FieldTable::new()
            },
        }
    }

    fn random_op(&mut self, ch: Ch) -> Op {
        match self.rng.below(100) {
            0..=29 => Op::Publish(Box::new(Publish {
                exchange: Arc::from(*self.rng.pick(&PUBLISH_TO)),
                routing_key: Arc::from(*self.rng.pick(&KEYS)),
                mandatory: self.rng.chance(30),
                immediate: false,
                properties: self.properties(),
                body: self.body(),
                routed: None,
            })),
            30..=35 => {
                self.next_consumer += 1;
                Op::Consume(Consume {
                    queue: self.queue(),
                    consumer_tag: if self.rng.chance(50) {
                        String::new()
                    } else {
                        format!("c{}", self.next_consumer)
                    },
                    no_local: false,
                    no_ack: self.rng.chance(25),
                    exclusive: self.rng.chance(5),
                    nowait: self.nowait(),
                    arguments: FieldTable::new(),
                })
            }
            36..=37 => {
                let known = self.open.get(&ch).map(|v| v.consumers.clone());
                let consumer_tag = match known {
                    Some(tags) if !tags.is_empty() && self.rng.chance(85) => {
                        self.rng.pick(&tags).to_string()
                    }
                    _ => "nobody".to_string(),
                };
                Op::Cancel {
                    consumer_tag,
                    nowait: self.nowait(),
                }
            }
            38..=40 => Op::Get {
                queue: self.queue(),
                no_ack: self.rng.chance(30),
            },
            41..=50 => Op::Ack {
                delivery_tag: self.tag(ch),
                multiple: self.rng.chance(30),
            },
            51..=55 => Op::Nack {
                delivery_tag: self.tag(ch),
                multiple: self.rng.chance(30),
                requeue: self.rng.chance(60),
            },
            56..=58 => Op::Reject {
                delivery_tag: self.tag(ch),
                requeue: self.rng.chance(60),
            },
            59..=62 => {
                let queue = if self.rng.chance(10) {
                    String::new()
                } else {
                    self.queue()
                };
                let arguments = self.queue_arguments(&queue);
                Op::QueueDeclare(QueueDeclare {
                    queue,
                    passive: self.rng.chance(5),
                    durable: false,
                    exclusive: self.rng.chance(5),
                    auto_delete: self.rng.chance(5),
                    nowait: self.nowait(),
                    arguments,
                })
            }
            63..=65 => {
                let (exchange, kind) = self.exchange();
                Op::ExchangeDeclare(ExchangeDeclare {
                    exchange,
                    kind,
                    passive: self.rng.chance(5),
                    durable: false,
                    auto_delete: self.rng.chance(5),
                    internal: self.rng.chance(3),
                    nowait: self.nowait(),
                    arguments: FieldTable::new(),
                })
            }
            66..=70 => Op::QueueBind(self.bind(false)),
            71 => Op::QueueUnbind(self.bind(false)),
            72 => Op::ExchangeBind(self.bind(true)),
            73 => Op::ExchangeUnbind(self.bind(true)),
            74..=75 => Op::QueuePurge {
                queue: self.queue(),
                nowait: self.nowait(),
            },
            76 => Op::QueueDelete {
                queue: self.queue(),
                if_unused: self.rng.chance(30),
                if_empty: self.rng.chance(30),
                nowait: self.nowait(),
            },
            77 => {
                let (exchange, _) = self.exchange();
                Op::ExchangeDelete {
                    exchange,
                    if_unused: self.rng.chance(30),
                    nowait: self.nowait(),
                }
            }
            78..=79 => Op::Qos {
                prefetch_size: 0,
                prefetch_count: self.rng.below(5) as u16,
                global: self.rng.chance(30),
            },
            80 => Op::Recover {
                requeue: self.rng.chance(80),
            },
            81 => Op::ConfirmSelect {
                nowait: self.nowait(),
            },
            82 => Op::TxSelect,
            83 => Op::TxCommit,
            84 => Op::TxRollback,
            85..=91 => Op::Written {
                count: self.unwritten.get(&ch.0).copied().unwrap_or(0),
            },
            92..=94 => Op::ChannelClose,
            95 => Op::ConnectionClose,
            96..=97 => Op::Retain {
                message: Box::new(warren_core::mqtt::RetainedMessage {
                    topic: Arc::from(*self.rng.pick(&["a/b", "a/c", "$SYS/x"])),
                    qos: self.rng.below(3) as u8,
                    payload: if self.rng.chance(20) {
                        bytes::Bytes::new()
                    } else {
                        self.body()
                    },
                    properties: self.properties(),
                    stored_at: 0,
                    expiry_ms: self.rng.chance(30).then_some(self.rng.below(50)),
                }),
                durable: self.rng.chance(80),
            },
            98 => Op::RetainedGet {
                filter: (*self.rng.pick(&["a/+", "#", "a/b", "$SYS/#"])).to_string(),
                max: self.rng.below(3) as u32,
            },
            _ => Op::Ack {
                delivery_tag: 0,
                multiple: true,
            },
        }
    }
}
