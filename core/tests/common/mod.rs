//! A small driver for the core in tests: ops in, effects out, invariants checked after each op.
#![allow(dead_code)]

use bytes::Bytes;
use std::sync::Arc;
use warren_core::command::{Bind, Consume, ExchangeDeclare, Op, Publish, QueueDeclare};
use warren_core::effect::{Effect, Reply};
use warren_core::ids::{ChannelRef, ConnId};
use warren_core::message::{FieldTable, Properties};
use warren_core::shards::Shards;
use warren_core::{Broker, BrokerConfig};

pub struct Harness {
    /// The broker's shards (one, unless `sharded`), composed as the core composes them:
    /// `shards[0]` is the broker, or shard 0 of a sharded one.
    pub shards: Shards,
    pub now: u64,
}

pub fn ch(conn: u64, channel: u16) -> ChannelRef {
    ChannelRef::new(ConnId(conn), channel)
}

impl Harness {
    pub fn new() -> Harness {
        Harness::with_config(BrokerConfig::default())
    }

    pub fn with_config(config: BrokerConfig) -> Harness {
        Harness::of(vec![Broker::new(config)])
    }

    /// A broker of these shards (each with the store it was made with).
    pub fn of(brokers: Vec<Broker>) -> Harness {
        Harness {
            shards: Shards::new(brokers),
            now: 0,
        }
    }

    /// A broker of `k` shards, connection `n` on shard `n % k`.
    pub fn sharded(config: BrokerConfig, k: u32) -> Harness {
        Harness::of((0..k).map(|_| Broker::new(config.clone())).collect())
    }

    /// A broker of `k` shards, each with its own (in-memory) store: syncs are per shard
    /// (`sync`).
    pub fn sharded_with_stores(config: BrokerConfig, k: u32) -> Harness {
        let store = || Box::new(warren_core::store::MemoryStore::new());
        Harness::of(
            (0..k)
                .map(|_| Broker::with_store(config.clone(), store()))
                .collect(),
        )
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
        self.shards.k()
    }

    pub fn shard(&mut self, i: u32) -> &mut Broker {
        &mut self.shards[i as usize]
    }

    pub fn all(&self) -> Vec<&Broker> {
        self.shards.brokers().iter().collect()
    }

    /// Every shard's effects, then the invariants across shards (once no mail travels
    /// between them).
    fn effects(&mut self) -> Vec<Effect> {
        let mut out = Vec::new();
        self.shards.poll_effects(&mut out);
        if let Err(e) = self.shards.check() {
            panic!("invariant broken: {e}");
        }
        out
    }

    pub fn op(&mut self, ch: ChannelRef, op: Op) -> Vec<Effect> {
        self.now += 1;
        self.shards.handle(self.now, ch, op);
        self.effects()
    }

    /// Delivers one piece of scheduled mail: within a shard (`Broker::deliver_mail`) or
    /// between two; `pick` chooses among the shards and links with mail. `None` if none
    /// was pending. Invariants are checked as after an op.
    pub fn deliver_mail(&mut self, pick: usize) -> Option<Vec<Effect>> {
        self.now += 1;
        if !self.shards.deliver_mail(self.now, pick) {
            return None;
        }
        Some(self.effects())
    }

    /// Carries what the shards sent outside an op (`Broker::admin` on shard 0, say) and,
    /// without scheduled mail, delivers it; returns the effects.
    pub fn settle(&mut self) -> Vec<Effect> {
        self.shards.settle(self.now);
        self.effects()
    }

    /// Mail not delivered yet, within shards and between them.
    pub fn mail_pending(&self) -> usize {
        self.shards.mail_pending()
    }

    /// `Broker::set_mail_scheduled` on every shard, and for the links between them.
    pub fn set_mail_scheduled(&mut self, on: bool) {
        self.shards.set_mail_scheduled(self.now, on);
    }

    /// A counter summed over the shards.
    pub fn sum(&self, f: impl Fn(&Broker) -> u64) -> u64 {
        self.all().into_iter().map(f).sum()
    }

    /// Advances the clock by `ms` and ticks (TTLs); invariants are checked as after an op.
    pub fn tick(&mut self, ms: u64) -> Vec<Effect> {
        self.now += ms;
        self.shards.tick(self.now);
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

    /// A passive `queue.declare` of `queue`: its effects (a declare-ok with the counts, or
    /// the channel error).
    pub fn passive_declare(&mut self, c: ChannelRef, queue: &str) -> Vec<Effect> {
        self.op(
            c,
            Op::QueueDeclare(QueueDeclare {
                queue: queue.into(),
                passive: true,
                durable: false,
                exclusive: false,
                auto_delete: false,
                nowait: false,
                arguments: FieldTable::new(),
            }),
        )
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
