//! A small driver for the core in tests: ops in, effects out, invariants checked after each op.
#![allow(dead_code)]

use bytes::Bytes;
use std::sync::Arc;
use warren_core::command::{Bind, Consume, ExchangeDeclare, Op, Publish, QueueDeclare};
use warren_core::effect::{Effect, Reply};
use warren_core::ids::{ChannelRef, ConnId};
use warren_core::message::{FieldTable, Properties};
use warren_core::{Broker, BrokerConfig};

pub struct Harness {
    pub broker: Broker,
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
        Harness {
            broker: Broker::new(config),
            now: 0,
        }
    }

    pub fn op(&mut self, ch: ChannelRef, op: Op) -> Vec<Effect> {
        self.now += 1;
        self.broker.handle(self.now, ch, op);
        let mut out = Vec::new();
        self.broker.poll_effects(&mut out);
        if let Err(e) = self.broker.check_invariants() {
            panic!("invariant broken: {e}");
        }
        out
    }

    /// Delivers one piece of scheduled mail (`Broker::deliver_mail`); `None` if none was
    /// pending. Invariants are checked as after an op.
    pub fn deliver_mail(&mut self, pick: usize) -> Option<Vec<Effect>> {
        self.now += 1;
        if !self.broker.deliver_mail(self.now, pick) {
            return None;
        }
        let mut out = Vec::new();
        self.broker.poll_effects(&mut out);
        if let Err(e) = self.broker.check_invariants() {
            panic!("invariant broken: {e}");
        }
        Some(out)
    }

    /// Advances the clock by `ms` and ticks (TTLs); invariants are checked as after an op.
    pub fn tick(&mut self, ms: u64) -> Vec<Effect> {
        self.now += ms;
        self.broker.tick(self.now);
        let mut out = Vec::new();
        self.broker.poll_effects(&mut out);
        if let Err(e) = self.broker.check_invariants() {
            panic!("invariant broken: {e}");
        }
        out
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
