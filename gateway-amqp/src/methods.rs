//! Translation between AMQP methods and core operations/replies: the protocol-specific
//! vocabulary on one side, `warren_core`'s on the other.

use crate::convert::table_from_amqp;
use crate::error::GatewayError;
use amq_protocol::protocol::{AMQPClass, basic, channel, confirm, exchange, queue, tx};
use amq_protocol::types::ShortString;
use std::sync::Arc;
use warren_core::command::{Bind, Consume, ExchangeDeclare, Op, OpKind, QueueDeclare};
use warren_core::effect::Reply;

/// What a channel-level method asks of the gateway.
#[derive(Debug)]
pub enum Incoming {
    /// Forward to the core.
    Op(Op),
    /// `basic.publish`: content frames follow.
    Publish(basic::Publish),
    /// `channel.flow`: answered locally.
    Flow(bool),
    /// `channel.close-ok` from the client.
    CloseOk,
}

/// Maps a method received on a channel (not channel 0) to what to do with it.
pub fn incoming(method: AMQPClass) -> Result<Incoming, GatewayError> {
    let op = match method {
        AMQPClass::Channel(m) => match m {
            channel::AMQPMethod::Open(_) => Op::ChannelOpen,
            channel::AMQPMethod::Close(_) => Op::ChannelClose,
            channel::AMQPMethod::CloseOk(_) => return Ok(Incoming::CloseOk),
            channel::AMQPMethod::Flow(f) => return Ok(Incoming::Flow(f.active)),
            other => return Err(invalid(&other)),
        },
        AMQPClass::Exchange(m) => match m {
            exchange::AMQPMethod::Declare(d) => Op::ExchangeDeclare(ExchangeDeclare {
                exchange: d.exchange.to_string(),
                kind: d.kind.to_string(),
                passive: d.passive,
                durable: d.durable,
                auto_delete: d.auto_delete,
                internal: d.internal,
                nowait: d.nowait,
                arguments: table_from_amqp(&d.arguments),
            }),
            exchange::AMQPMethod::Delete(d) => Op::ExchangeDelete {
                exchange: d.exchange.to_string(),
                if_unused: d.if_unused,
                nowait: d.nowait,
            },
            exchange::AMQPMethod::Bind(b) => Op::ExchangeBind(Bind {
                destination: b.destination.to_string(),
                source: b.source.to_string(),
                routing_key: b.routing_key.to_string(),
                nowait: b.nowait,
                arguments: table_from_amqp(&b.arguments),
            }),
            exchange::AMQPMethod::Unbind(b) => Op::ExchangeUnbind(Bind {
                destination: b.destination.to_string(),
                source: b.source.to_string(),
                routing_key: b.routing_key.to_string(),
                nowait: b.nowait,
                arguments: table_from_amqp(&b.arguments),
            }),
            other => return Err(invalid(&other)),
        },
        AMQPClass::Queue(m) => match m {
            queue::AMQPMethod::Declare(d) => {
                let arguments = table_from_amqp(&d.arguments);
                if !d.passive
                    && let Some(warning) = warren_core::queue_args::dead_letter_warning(&arguments)
                {
                    tracing::warn!(queue = %warren_core::escape::Escaped(d.queue.as_str()), "{}", warren_core::escape::Escaped(warning));
                }
                Op::QueueDeclare(QueueDeclare {
                    queue: d.queue.to_string(),
                    passive: d.passive,
                    durable: d.durable,
                    exclusive: d.exclusive,
                    auto_delete: d.auto_delete,
                    nowait: d.nowait,
                    arguments,
                })
            }
            queue::AMQPMethod::Bind(b) => Op::QueueBind(Bind {
                destination: b.queue.to_string(),
                source: b.exchange.to_string(),
                routing_key: b.routing_key.to_string(),
                nowait: b.nowait,
                arguments: table_from_amqp(&b.arguments),
            }),
            queue::AMQPMethod::Unbind(b) => Op::QueueUnbind(Bind {
                destination: b.queue.to_string(),
                source: b.exchange.to_string(),
                routing_key: b.routing_key.to_string(),
                nowait: false,
                arguments: table_from_amqp(&b.arguments),
            }),
            queue::AMQPMethod::Purge(p) => Op::QueuePurge {
                queue: p.queue.to_string(),
                nowait: p.nowait,
            },
            queue::AMQPMethod::Delete(d) => Op::QueueDelete {
                queue: d.queue.to_string(),
                if_unused: d.if_unused,
                if_empty: d.if_empty,
                nowait: d.nowait,
            },
            other => return Err(invalid(&other)),
        },
        AMQPClass::Basic(m) => match m {
            basic::AMQPMethod::Qos(q) => Op::Qos {
                // amq-protocol drops prefetch-size while parsing; RabbitMQ refuses non-zero
                // values, and no mainstream client sends one.
                prefetch_size: 0,
                prefetch_count: q.prefetch_count,
                global: q.global,
            },
            basic::AMQPMethod::Consume(c) => Op::Consume(Consume {
                queue: c.queue.to_string(),
                consumer_tag: c.consumer_tag.to_string(),
                no_local: c.no_local,
                no_ack: c.no_ack,
                exclusive: c.exclusive,
                nowait: c.nowait,
                arguments: table_from_amqp(&c.arguments),
            }),
            basic::AMQPMethod::Cancel(c) => Op::Cancel {
                consumer_tag: c.consumer_tag.to_string(),
                nowait: c.nowait,
            },
            basic::AMQPMethod::Publish(p) => return Ok(Incoming::Publish(p)),
            basic::AMQPMethod::Get(g) => Op::Get {
                queue: g.queue.to_string(),
                no_ack: g.no_ack,
            },
            basic::AMQPMethod::Ack(a) => Op::Ack {
                delivery_tag: a.delivery_tag,
                multiple: a.multiple,
            },
            basic::AMQPMethod::Nack(n) => Op::Nack {
                delivery_tag: n.delivery_tag,
                multiple: n.multiple,
                requeue: n.requeue,
            },
            basic::AMQPMethod::Reject(r) => Op::Reject {
                delivery_tag: r.delivery_tag,
                requeue: r.requeue,
            },
            basic::AMQPMethod::Recover(r) => Op::Recover { requeue: r.requeue },
            basic::AMQPMethod::RecoverAsync(r) => Op::Recover { requeue: r.requeue },
            other => return Err(invalid(&other)),
        },
        AMQPClass::Confirm(confirm::AMQPMethod::Select(s)) => {
            Op::ConfirmSelect { nowait: s.nowait }
        }
        AMQPClass::Tx(m) => match m {
            tx::AMQPMethod::Select(_) => Op::TxSelect,
            tx::AMQPMethod::Commit(_) => Op::TxCommit,
            tx::AMQPMethod::Rollback(_) => Op::TxRollback,
            other => return Err(invalid(&other)),
        },
        other => return Err(invalid(&other)),
    };
    Ok(Incoming::Op(op))
}

fn invalid<M: std::fmt::Debug>(m: &M) -> GatewayError {
    let mut name = format!("{m:?}");
    name.truncate(name.find(['(', ' ', '{']).unwrap_or(name.len()));
    GatewayError::CommandInvalid(format!("unexpected method {name} from the client"))
}

/// AMQP (class-id, method-id) of the method an op came from, for `channel.close` and
/// `connection.close`.
pub fn method_ids(kind: OpKind) -> (u16, u16) {
    match kind {
        OpKind::ConnectionOpen => (10, 40),
        OpKind::ConnectionClose => (10, 50),
        OpKind::ChannelOpen => (20, 10),
        OpKind::ChannelClose => (20, 40),
        OpKind::ChannelCloseOk => (20, 41),
        OpKind::ExchangeDeclare => (40, 10),
        OpKind::ExchangeDelete => (40, 20),
        OpKind::ExchangeBind => (40, 30),
        OpKind::ExchangeUnbind => (40, 40),
        OpKind::QueueDeclare => (50, 10),
        OpKind::QueueBind => (50, 20),
        OpKind::QueuePurge => (50, 30),
        OpKind::QueueDelete => (50, 40),
        OpKind::QueueUnbind => (50, 50),
        OpKind::Qos => (60, 10),
        OpKind::Consume => (60, 20),
        OpKind::Cancel => (60, 30),
        OpKind::Publish => (60, 40),
        OpKind::Get => (60, 70),
        OpKind::Ack => (60, 80),
        OpKind::Reject => (60, 90),
        OpKind::Recover => (60, 110),
        OpKind::Nack => (60, 120),
        OpKind::ConfirmSelect => (85, 10),
        OpKind::TxSelect => (90, 10),
        OpKind::TxCommit => (90, 20),
        OpKind::TxRollback => (90, 30),
        // Not AMQP methods (host bookkeeping, MQTT's retained messages).
        OpKind::Written | OpKind::Retain | OpKind::RetainedGet => (0, 0),
    }
}

fn ss(s: &str) -> ShortString {
    ShortString::from(s)
}

/// The method frame of a synchronous reply. `GetOk` is encoded by the caller (it carries
/// content) and returns `None` here, as do MQTT's retained-message replies (never asked for
/// over AMQP).
pub fn reply_method(reply: &Reply) -> Option<AMQPClass> {
    Some(match reply {
        Reply::ChannelOpenOk => AMQPClass::Channel(channel::AMQPMethod::OpenOk(channel::OpenOk {})),
        Reply::ChannelCloseOk => {
            AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {}))
        }
        Reply::ExchangeDeclareOk => {
            AMQPClass::Exchange(exchange::AMQPMethod::DeclareOk(exchange::DeclareOk {}))
        }
        Reply::ExchangeDeleteOk => {
            AMQPClass::Exchange(exchange::AMQPMethod::DeleteOk(exchange::DeleteOk {}))
        }
        Reply::ExchangeBindOk => {
            AMQPClass::Exchange(exchange::AMQPMethod::BindOk(exchange::BindOk {}))
        }
        Reply::ExchangeUnbindOk => {
            AMQPClass::Exchange(exchange::AMQPMethod::UnbindOk(exchange::UnbindOk {}))
        }
        Reply::QueueDeclareOk {
            queue,
            message_count,
            consumer_count,
        } => AMQPClass::Queue(queue::AMQPMethod::DeclareOk(queue::DeclareOk {
            queue: ss(queue),
            message_count: *message_count,
            consumer_count: *consumer_count,
        })),
        Reply::QueueBindOk => AMQPClass::Queue(queue::AMQPMethod::BindOk(queue::BindOk {})),
        Reply::QueueUnbindOk => AMQPClass::Queue(queue::AMQPMethod::UnbindOk(queue::UnbindOk {})),
        Reply::QueuePurgeOk { message_count } => {
            AMQPClass::Queue(queue::AMQPMethod::PurgeOk(queue::PurgeOk {
                message_count: *message_count,
            }))
        }
        Reply::QueueDeleteOk { message_count } => {
            AMQPClass::Queue(queue::AMQPMethod::DeleteOk(queue::DeleteOk {
                message_count: *message_count,
            }))
        }
        Reply::QosOk => AMQPClass::Basic(basic::AMQPMethod::QosOk(basic::QosOk {})),
        Reply::ConsumeOk { consumer_tag } => {
            AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(basic::ConsumeOk {
                consumer_tag: ss(consumer_tag),
            }))
        }
        Reply::CancelOk { consumer_tag } => {
            AMQPClass::Basic(basic::AMQPMethod::CancelOk(basic::CancelOk {
                consumer_tag: ss(consumer_tag),
            }))
        }
        Reply::GetOk { .. } => return None,
        Reply::GetEmpty => AMQPClass::Basic(basic::AMQPMethod::GetEmpty(basic::GetEmpty {})),
        Reply::RecoverOk => AMQPClass::Basic(basic::AMQPMethod::RecoverOk(basic::RecoverOk {})),
        Reply::ConfirmSelectOk => {
            AMQPClass::Confirm(confirm::AMQPMethod::SelectOk(confirm::SelectOk {}))
        }
        Reply::TxSelectOk => AMQPClass::Tx(tx::AMQPMethod::SelectOk(tx::SelectOk {})),
        Reply::TxCommitOk => AMQPClass::Tx(tx::AMQPMethod::CommitOk(tx::CommitOk {})),
        Reply::TxRollbackOk => AMQPClass::Tx(tx::AMQPMethod::RollbackOk(tx::RollbackOk {})),
        // MQTT's retained-message ops have no AMQP method; this gateway never sends them.
        Reply::RetainOk { .. } | Reply::Retained { .. } => return None,
    })
}

/// Server-sent `basic.cancel` (consumer cancel notification).
pub fn server_cancel(tag: &Arc<str>) -> AMQPClass {
    AMQPClass::Basic(basic::AMQPMethod::Cancel(basic::Cancel {
        consumer_tag: ss(tag),
        nowait: true,
    }))
}

pub fn get_ok(
    delivery_tag: u64,
    redelivered: bool,
    exchange: &str,
    routing_key: &str,
    message_count: u32,
) -> AMQPClass {
    AMQPClass::Basic(basic::AMQPMethod::GetOk(basic::GetOk {
        delivery_tag,
        redelivered,
        exchange: ss(exchange),
        routing_key: ss(routing_key),
        message_count,
    }))
}

pub fn basic_return(code: u16, text: &str, exchange: &str, routing_key: &str) -> AMQPClass {
    AMQPClass::Basic(basic::AMQPMethod::Return(basic::Return {
        reply_code: code,
        reply_text: ss(text),
        exchange: ss(exchange),
        routing_key: ss(routing_key),
    }))
}

pub fn channel_close(code: u16, text: &str, ids: (u16, u16)) -> AMQPClass {
    AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
        reply_code: code,
        reply_text: ss(truncate(text)),
        class_id: ids.0,
        method_id: ids.1,
    }))
}

pub fn channel_close_ok() -> AMQPClass {
    AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {}))
}

pub fn flow_ok(active: bool) -> AMQPClass {
    AMQPClass::Channel(channel::AMQPMethod::FlowOk(channel::FlowOk { active }))
}

/// Reply texts are short strings: keep them under 255 bytes on a character boundary.
pub fn truncate(text: &str) -> &str {
    if text.len() <= 255 {
        return text;
    }
    let mut end = 255;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// A short name for a method, for error texts and logs (`basic.publish`).
pub fn method_name(m: &AMQPClass) -> String {
    let s = format!("{m:?}");
    // Debug prints `Basic(Publish(Publish { .. }))`: keep the first two names.
    let mut parts = s.split(['(', ' ', '{']).filter(|p| !p.is_empty());
    match (parts.next(), parts.next()) {
        (Some(class), Some(method)) => format!("{}.{}", class.to_lowercase(), to_snake(method)),
        _ => "unknown method".into(),
    }
}

fn to_snake(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 4);
    for (i, c) in s.chars().enumerate() {
        if c.is_ascii_uppercase() {
            if i > 0 {
                out.push('-');
            }
            out.push(c.to_ascii_lowercase());
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod name_tests {
    use super::*;

    #[test]
    fn method_names_read_like_the_spec() {
        let m = AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {}));
        assert_eq!(method_name(&m), "channel.close-ok");
    }
}
