//! A small driver for the core in tests: ops in, effects out, invariants checked after each op.
#![allow(dead_code)]

use bytes::Bytes;
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use warren_core::command::{Bind, Consume, ExchangeDeclare, Op, Publish, QueueDeclare};
use warren_core::effect::{Effect, Reply};
use warren_core::ids::{ChannelRef, ConnId};
use warren_core::message::{FieldTable, Properties};
use warren_core::{Broker, BrokerConfig, ShardMail};

pub struct Harness {
    /// The broker, or shard 0 of a sharded one.
    pub broker: Broker,
    pub now: u64,
    /// Shards 1.. of a sharded broker, and the mail between shards.
    pub shards: Shards,
}

/// The other shards of a sharded broker (ARCHITECTURE.md, "warren-runtime") run in one
/// thread: mail between shards waits on FIFO links, one per (from, to) pair.
#[derive(Default)]
pub struct Shards {
    pub others: Vec<Broker>,
    links: BTreeMap<(u32, u32), VecDeque<ShardMail>>,
    /// Mail within each shard waits too (`Broker::set_mail_scheduled`).
    scheduled: bool,
}

pub fn ch(conn: u64, channel: u16) -> ChannelRef {
    ChannelRef::new(ConnId(conn), channel)
}

impl Harness {
    pub fn new() -> Harness {
        Harness::with_config(BrokerConfig::default())
    }

    pub fn with_config(config: BrokerConfig) -> Harness {
        Harness {
            broker: Broker::new(config),
            now: 0,
            shards: Shards::default(),
        }
    }

    /// A broker of `k` shards, connection `n` on shard `n % k`.
    pub fn sharded(config: BrokerConfig, k: u32) -> Harness {
        let mut h = Harness::with_config(config.clone());
        h.broker.set_shard(0, k);
        for i in 1..k {
            let mut b = Broker::new(config.clone());
            b.set_shard(i, k);
            b.adopt_routes(h.broker.routes().clone());
            h.shards.others.push(b);
        }
        h.share_memory_count();
        h
    }

    /// One memory count for every shard (as the runtime gives them).
    fn share_memory_count(&mut self) {
        if self.k() > 1 {
            let count = Arc::new(std::sync::atomic::AtomicU64::new(0));
            for i in 0..self.k() {
                self.shard(i).share_memory_count(count.clone());
            }
        }
    }

    /// A broker of `k` shards, each with its own (in-memory) store: syncs are per shard
    /// (`sync`).
    pub fn sharded_with_stores(config: BrokerConfig, k: u32) -> Harness {
        let store = || Box::new(warren_core::store::MemoryStore::new());
        let mut h = Harness::with_config(config.clone());
        h.broker = Broker::with_store(config.clone(), store());
        h.broker.set_shard(0, k);
        for i in 1..k {
            let mut b = Broker::with_store(config.clone(), store());
            b.set_shard(i, k);
            b.adopt_routes(h.broker.routes().clone());
            h.shards.others.push(b);
        }
        h.share_memory_count();
        h
    }

    /// Shard `i` syncs what it wrote (`ok`), or its sync fails; returns the effects.
    pub fn sync(&mut self, i: u32, ok: bool) -> Vec<Effect> {
        let now = self.now;
        if let Some(epoch) = self.shard(i).start_sync() {
            if ok {
                self.shard(i).synced(now, epoch);
            } else {
                self.shard(i).sync_failed(now, epoch);
            }
        }
        self.settle()
    }

    /// The number of shards.
    pub fn k(&self) -> u32 {
        1 + self.shards.others.len() as u32
    }

    pub fn shard(&mut self, i: u32) -> &mut Broker {
        match i {
            0 => &mut self.broker,
            _ => &mut self.shards.others[i as usize - 1],
        }
    }

    pub fn all(&self) -> Vec<&Broker> {
        std::iter::once(&self.broker)
            .chain(self.shards.others.iter())
            .collect()
    }

    fn shard_of(&self, ch: ChannelRef) -> u32 {
        (ch.conn.0 % u64::from(self.k())) as u32
    }

    /// Moves shard `i`'s outbox onto the links; what shard 0 sends goes after the routing
    /// table it published (the other shards adopt it first, as the runtime does).
    fn collect(&mut self, i: u32) {
        if self.k() == 1 {
            return;
        }
        if i == 0 {
            let routes = self.broker.routes().clone();
            for b in &mut self.shards.others {
                b.adopt_routes(routes.clone());
            }
        }
        let mut out = Vec::new();
        self.shard(i).take_outbox(&mut out);
        for m in out {
            let link = self.shards.links.entry((i, m.shard())).or_default();
            link.push_back(m);
        }
    }

    /// Delivers the front of link `(from, to)`.
    fn deliver_link(&mut self, link: (u32, u32)) {
        let Some(m) = self.shards.links.get_mut(&link).and_then(|l| l.pop_front()) else {
            return;
        };
        let now = self.now;
        self.shard(link.1).receive_mail(now, m);
        self.collect(link.1);
    }

    /// Without scheduled mail, mail between shards arrives before the op returns.
    fn drain_links(&mut self) {
        if self.shards.scheduled {
            return;
        }
        let mut rounds = 0u32;
        while let Some(&link) = self
            .shards
            .links
            .iter()
            .find(|(_, l)| !l.is_empty())
            .map(|(k, _)| k)
        {
            rounds += 1;
            assert!(rounds < 1 << 20, "mail between shards loops");
            self.deliver_link(link);
        }
    }

    fn links_pending(&self) -> usize {
        self.shards.links.values().map(VecDeque::len).sum()
    }

    /// Every shard's effects, then the invariants across shards (once no mail travels
    /// between them).
    fn effects(&mut self) -> Vec<Effect> {
        let mut out = Vec::new();
        for i in 0..self.k() {
            self.shard(i).poll_effects(&mut out);
        }
        if self.links_pending() == 0
            && let Err(e) = Broker::check_shards(&self.all())
        {
            panic!("invariant broken: {e}");
        }
        out
    }

    pub fn op(&mut self, ch: ChannelRef, op: Op) -> Vec<Effect> {
        self.now += 1;
        let (i, now) = (self.shard_of(ch), self.now);
        self.shard(i).handle(now, ch, op);
        self.collect(i);
        self.drain_links();
        self.effects()
    }

    /// Delivers one piece of scheduled mail: within a shard (`Broker::deliver_mail`) or
    /// between two; `pick` chooses among the shards and links with mail. `None` if none
    /// was pending. Invariants are checked as after an op.
    pub fn deliver_mail(&mut self, pick: usize) -> Option<Vec<Effect>> {
        self.now += 1;
        let now = self.now;
        let mut places: Vec<Result<u32, (u32, u32)>> = (0..self.k())
            .filter(|&i| self.all()[i as usize].mail_pending() > 0)
            .map(Ok)
            .collect();
        places.extend(
            self.shards
                .links
                .iter()
                .filter(|(_, l)| !l.is_empty())
                .map(|(k, _)| Err(*k)),
        );
        if places.is_empty() {
            return None;
        }
        match places[pick % places.len()] {
            Ok(i) => {
                assert!(self.shard(i).deliver_mail(now, pick / places.len()));
                self.collect(i);
            }
            Err(link) => self.deliver_link(link),
        }
        Some(self.effects())
    }

    /// Carries what the shards sent outside an op (`Broker::admin` on shard 0, say) and,
    /// without scheduled mail, delivers it; returns the effects.
    pub fn settle(&mut self) -> Vec<Effect> {
        for i in 0..self.k() {
            self.collect(i);
        }
        self.drain_links();
        self.effects()
    }

    /// Mail not delivered yet, within shards and between them.
    pub fn mail_pending(&self) -> usize {
        self.all().iter().map(|b| b.mail_pending()).sum::<usize>() + self.links_pending()
    }

    /// `Broker::set_mail_scheduled` on every shard, and for the links between them.
    pub fn set_mail_scheduled(&mut self, on: bool) {
        self.shards.scheduled = on;
        for i in 0..self.k() {
            self.shard(i).set_mail_scheduled(on);
            self.collect(i);
        }
        self.drain_links();
    }

    /// A counter summed over the shards.
    pub fn sum(&self, f: impl Fn(&Broker) -> u64) -> u64 {
        self.all().into_iter().map(f).sum()
    }

    /// Advances the clock by `ms` and ticks (TTLs); invariants are checked as after an op.
    pub fn tick(&mut self, ms: u64) -> Vec<Effect> {
        self.now += ms;
        let now = self.now;
        for i in 0..self.k() {
            self.shard(i).tick(now);
            self.collect(i);
        }
        self.drain_links();
        self.effects()
    }

    /// Opens connection `conn` with channel 1.
    pub fn connect(&mut self, conn: u64) -> ChannelRef {
        let c = ch(conn, 0);
        assert!(
            self.op(
                c,
                Op::ConnectionOpen {
                    vhost: "/".into(),
                    user: "guest".into(),
                    cancel_notify: true,
                },
            )
            .is_empty()
        );
        self.open(conn, 1)
    }

    pub fn open(&mut self, conn: u64, channel: u16) -> ChannelRef {
        let c = ch(conn, channel);
        let fx = self.op(c, Op::ChannelOpen);
        assert_eq!(
            fx,
            vec![Effect::Reply {
                ch: c,
                reply: Reply::ChannelOpenOk
            }]
        );
        c
    }

    pub fn declare(&mut self, c: ChannelRef, queue: &str) -> String {
        self.declare_with(c, queue, false, false, false)
    }

    pub fn declare_with(
        &mut self,
        c: ChannelRef,
        queue: &str,
        durable: bool,
        exclusive: bool,
        auto_delete: bool,
    ) -> String {
        let fx = self.op(
            c,
            Op::QueueDeclare(QueueDeclare {
                queue: queue.into(),
                passive: false,
                durable,
                exclusive,
                auto_delete,
                nowait: false,
                arguments: FieldTable::new(),
            }),
        );
        match fx.as_slice() {
            [
                Effect::Reply {
                    reply: Reply::QueueDeclareOk { queue, .. },
                    ..
                },
            ] => queue.to_string(),
            other => panic!("declare {queue}: {other:?}"),
        }
    }

    pub fn exchange(&mut self, c: ChannelRef, name: &str, kind: &str, args: FieldTable) {
        let fx = self.op(
            c,
            Op::ExchangeDeclare(ExchangeDeclare {
                exchange: name.into(),
                kind: kind.into(),
                passive: false,
                durable: false,
                auto_delete: false,
                internal: false,
                nowait: false,
                arguments: args,
            }),
        );
        assert_eq!(fx.len(), 1, "{fx:?}");
    }

    pub fn bind(&mut self, c: ChannelRef, queue: &str, exchange: &str, key: &str) {
        let fx = self.op(
            c,
            Op::QueueBind(Bind {
                destination: queue.into(),
                source: exchange.into(),
                routing_key: key.into(),
                nowait: false,
                arguments: FieldTable::new(),
            }),
        );
        assert_eq!(
            fx,
            vec![Effect::Reply {
                ch: c,
                reply: Reply::QueueBindOk
            }]
        );
    }

    pub fn publish(&mut self, c: ChannelRef, exchange: &str, key: &str, body: &str) -> Vec<Effect> {
        self.publish_full(c, exchange, key, body, false)
    }

    pub fn publish_full(
        &mut self,
        c: ChannelRef,
        exchange: &str,
        key: &str,
        body: &str,
        mandatory: bool,
    ) -> Vec<Effect> {
        self.op(
            c,
            Op::Publish(Box::new(Publish {
                exchange: Arc::from(exchange),
                routing_key: Arc::from(key),
                mandatory,
                immediate: false,
                properties: Properties::default(),
                body: Bytes::copy_from_slice(body.as_bytes()),
                routed: None,
            })),
        )
    }

    pub fn consume(&mut self, c: ChannelRef, queue: &str, tag: &str, no_ack: bool) -> Vec<Effect> {
        self.op(
            c,
            Op::Consume(Consume {
                queue: queue.into(),
                consumer_tag: tag.into(),
                no_local: false,
                no_ack,
                exclusive: false,
                nowait: false,
                arguments: FieldTable::new(),
            }),
        )
    }
}

/// (consumer tag, delivery tag, redelivered, body) of every delivery in `fx`.
pub fn deliveries(fx: &[Effect]) -> Vec<(String, u64, bool, String)> {
    fx.iter()
        .filter_map(|e| match e {
            Effect::Deliver {
                consumer_tag,
                delivery,
                ..
            } => Some((
                consumer_tag.to_string(),
                delivery.delivery_tag,
                delivery.redelivered,
                String::from_utf8_lossy(&delivery.message.body).into_owned(),
            )),
            _ => None,
        })
        .collect()
}

pub fn bodies(fx: &[Effect]) -> Vec<String> {
    deliveries(fx).into_iter().map(|d| d.3).collect()
}

/// The reply code of the channel or connection error in `fx`, if any.
pub fn error_code(fx: &[Effect]) -> Option<u16> {
    fx.iter().find_map(|e| match e {
        Effect::ChannelError { error, .. } | Effect::ConnectionError { error, .. } => {
            Some(error.code.code())
        }
        _ => None,
    })
}
