//! Embeds the broker core in-process, with no sockets and no runtime: declare a topic
//! exchange and two queues, publish, consume, ack. Run: `cargo run -p warren-examples
//! --example embedded_core`.

use bytes::Bytes;
use warren_core::command::{Bind, Consume, ExchangeDeclare, Op, Publish, QueueDeclare};
use warren_core::effect::Effect;
use warren_core::ids::{ChannelRef, ConnId};
use warren_core::message::{FieldTable, Properties};
use warren_core::{Broker, BrokerConfig};

fn main() {
    let mut broker = Broker::new(BrokerConfig::default());
    let conn = ConnId(1);
    let ch = ChannelRef::new(conn, 1);
    let mut now = 0;
    let mut run = |broker: &mut Broker, ch: ChannelRef, op: Op| {
        now += 1;
        broker.handle(now, ch, op);
        let mut effects = Vec::new();
        broker.poll_effects(&mut effects);
        effects
    };
    run(
        &mut broker,
        ChannelRef::new(conn, 0),
        Op::ConnectionOpen {
            vhost: "/".into(),
            user: "guest".into(),
            cancel_notify: true,
        },
    );
    run(&mut broker, ch, Op::ChannelOpen);
    run(
        &mut broker,
        ch,
        Op::ExchangeDeclare(ExchangeDeclare {
            exchange: "sensors".into(),
            kind: "topic".into(),
            passive: false,
            durable: false,
            auto_delete: false,
            internal: false,
            nowait: false,
            arguments: FieldTable::new(),
        }),
    );
    for (queue, pattern) in [("all-kitchen", "kitchen.#"), ("all-temps", "*.temperature")] {
        run(
            &mut broker,
            ch,
            Op::QueueDeclare(QueueDeclare {
                queue: queue.into(),
                passive: false,
                durable: false,
                exclusive: false,
                auto_delete: false,
                nowait: false,
                arguments: FieldTable::new(),
            }),
        );
        run(
            &mut broker,
            ch,
            Op::QueueBind(Bind {
                destination: queue.into(),
                source: "sensors".into(),
                routing_key: pattern.into(),
                nowait: false,
                arguments: FieldTable::new(),
            }),
        );
    }
    for (key, body) in [
        ("kitchen.temperature", "21.5"),
        ("kitchen.humidity", "40"),
        ("garage.temperature", "12.0"),
    ] {
        run(
            &mut broker,
            ch,
            Op::Publish(Box::new(Publish {
                exchange: "sensors".into(),
                routing_key: key.into(),
                mandatory: false,
                immediate: false,
                properties: Properties::default(),
                body: Bytes::from_static(body.as_bytes()),
                routed: None,
            })),
        );
    }
    for queue in ["all-kitchen", "all-temps"] {
        let effects = run(
            &mut broker,
            ch,
            Op::Consume(Consume {
                queue: queue.into(),
                consumer_tag: String::new(),
                no_local: false,
                no_ack: false,
                exclusive: false,
                nowait: false,
                arguments: FieldTable::new(),
            }),
        );
        for effect in effects {
            if let Effect::Deliver { delivery, .. } = effect {
                println!(
                    "{queue:12} <- {:22} {}",
                    delivery.message.routing_key,
                    String::from_utf8_lossy(&delivery.message.body)
                );
                run(
                    &mut broker,
                    ch,
                    Op::Ack {
                        delivery_tag: delivery.delivery_tag,
                        multiple: false,
                    },
                );
            }
        }
    }
}
