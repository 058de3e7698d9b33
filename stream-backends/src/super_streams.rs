//! Super streams (RabbitMQ 3.11) over the broker's topology, for both stream backends: a
//! super stream is a durable direct exchange of its name (argument `x-super-stream: true`)
//! whose bindings, each with `x-stream-partition-order`, name its partition streams and
//! their binding keys, as RabbitMQ's `rabbit_stream_manager` makes it. So the definitions
//! store keeps it across restarts, AMQP clients see the exchange, and a publish to it over
//! AMQP is routed to a partition by key.

use crate::broker::{BrokerLink, block_on};
use warren_core::admin::{AdminRequest, AdminResponse};
use warren_core::command::{Bind, ExchangeDeclare, Op};
use warren_core::message::{FieldTable, FieldValue};
use warren_stream::backend::{StreamBackend, StreamError};

/// Partitions a super stream may have (RabbitMQ's clients make a few to a few hundred).
pub const MAX_PARTITIONS: usize = 1000;
const ORDER: &str = "x-stream-partition-order";

fn op(link: &BrokerLink, vhost: &str, op: Op) -> Result<(), StreamError> {
    let broker = link
        .get()
        .ok_or_else(|| StreamError::Internal("the broker is not running".into()))?;
    match block_on(broker.admin(AdminRequest::Op {
        vhost: vhost.into(),
        op,
    })) {
        Ok(AdminResponse::Op(Ok(_))) => Ok(()),
        Ok(AdminResponse::Op(Err(e))) if e.code as u16 == 404 => Err(StreamError::DoesNotExist),
        Ok(AdminResponse::Op(Err(e))) if e.code as u16 == 403 => Err(StreamError::AccessRefused),
        Ok(AdminResponse::Op(Err(e))) => Err(StreamError::Precondition(e.text.to_string())),
        Ok(other) => Err(StreamError::Internal(format!(
            "unexpected answer {other:?}"
        ))),
        Err(_) => Err(StreamError::Internal("the broker is gone".into())),
    }
}

fn declare(name: &str, passive: bool) -> Op {
    Op::ExchangeDeclare(ExchangeDeclare {
        exchange: name.into(),
        kind: "direct".into(),
        passive,
        durable: true,
        auto_delete: false,
        internal: false,
        nowait: false,
        arguments: FieldTable::from([("x-super-stream".into(), FieldValue::Bool(true))]),
    })
}

/// The super stream's (partition, binding key), in partition order; `DoesNotExist` when
/// `name` is not a super stream of `vhost`.
fn bindings(
    link: &BrokerLink,
    vhost: &str,
    name: &str,
) -> Result<Vec<(String, String)>, StreamError> {
    let broker = link
        .get()
        .ok_or_else(|| StreamError::Internal("the broker is not running".into()))?;
    let exchanges = match block_on(broker.admin(AdminRequest::ListExchanges)) {
        Ok(AdminResponse::Exchanges(x)) => x,
        _ => return Err(StreamError::Internal("cannot list exchanges".into())),
    };
    let is_super = exchanges.iter().any(|x| {
        x.vhost == vhost
            && x.name == name
            && matches!(
                x.arguments.get("x-super-stream"),
                Some(FieldValue::Bool(true))
            )
    });
    if !is_super {
        return Err(StreamError::DoesNotExist);
    }
    let all = match block_on(broker.admin(AdminRequest::ListBindings)) {
        Ok(AdminResponse::Bindings(b)) => b,
        _ => return Err(StreamError::Internal("cannot list bindings".into())),
    };
    let mut found: Vec<(i64, String, String)> = all
        .into_iter()
        .filter(|b| b.vhost == vhost && b.source == name && !b.destination_is_exchange)
        .map(|b| {
            let order = b
                .arguments
                .get(ORDER)
                .and_then(FieldValue::as_i64)
                .unwrap_or(i64::MAX);
            (order, b.destination, b.routing_key)
        })
        .collect();
    found.sort();
    Ok(found.into_iter().map(|(_, p, k)| (p, k)).collect())
}

/// Creates the partitions (streams, each an AMQP queue too), then the exchange and its
/// bindings; all or nothing.
pub(crate) fn create<B: StreamBackend>(
    link: &BrokerLink,
    backend: &B,
    vhost: &str,
    name: &str,
    partitions: &[String],
    binding_keys: &[String],
    arguments: &[(String, String)],
) -> Result<(), StreamError> {
    if partitions.is_empty()
        || partitions.len() != binding_keys.len()
        || partitions.len() > MAX_PARTITIONS
    {
        return Err(StreamError::Precondition(format!(
            "super stream {name}: {} partitions and {} binding keys (1 to {MAX_PARTITIONS}, as many keys as partitions)",
            partitions.len(),
            binding_keys.len()
        )));
    }
    if op(link, vhost, declare(name, true)).is_ok()
        || partitions.iter().any(|p| backend.stream_exists(vhost, p))
    {
        return Err(StreamError::AlreadyExists);
    }
    for (i, p) in partitions.iter().enumerate() {
        if let Err(e) = backend.create_stream(vhost, p, arguments) {
            for made in &partitions[..i] {
                let _ = backend.delete_stream(vhost, made);
            }
            return Err(e);
        }
    }
    let bound = op(link, vhost, declare(name, false)).and_then(|()| {
        for (i, (p, k)) in partitions.iter().zip(binding_keys).enumerate() {
            let order = FieldValue::I64(i64::try_from(i).unwrap_or(i64::MAX));
            op(
                link,
                vhost,
                Op::QueueBind(Bind {
                    destination: p.clone(),
                    source: name.into(),
                    routing_key: k.clone(),
                    nowait: false,
                    arguments: FieldTable::from([(ORDER.into(), order)]),
                }),
            )?;
        }
        Ok(())
    });
    if let Err(e) = bound {
        let _ = delete(link, backend, vhost, name, partitions);
        return Err(e);
    }
    Ok(())
}

fn delete<B: StreamBackend>(
    link: &BrokerLink,
    backend: &B,
    vhost: &str,
    name: &str,
    partitions: &[String],
) -> Result<(), StreamError> {
    for p in partitions {
        let _ = backend.delete_stream(vhost, p);
    }
    op(
        link,
        vhost,
        Op::ExchangeDelete {
            exchange: name.into(),
            if_unused: false,
            nowait: false,
        },
    )
}

/// Deletes the exchange and the partitions; returns the partitions.
pub(crate) fn delete_super<B: StreamBackend>(
    link: &BrokerLink,
    backend: &B,
    vhost: &str,
    name: &str,
) -> Result<Vec<String>, StreamError> {
    let partitions: Vec<String> = bindings(link, vhost, name)?
        .into_iter()
        .map(|(p, _)| p)
        .collect();
    delete(link, backend, vhost, name, &partitions)?;
    Ok(partitions)
}

pub(crate) fn partitions(
    link: &BrokerLink,
    vhost: &str,
    name: &str,
) -> Result<Vec<String>, StreamError> {
    Ok(bindings(link, vhost, name)?
        .into_iter()
        .map(|(p, _)| p)
        .collect())
}

pub(crate) fn route(
    link: &BrokerLink,
    vhost: &str,
    name: &str,
    routing_key: &str,
) -> Result<Vec<String>, StreamError> {
    Ok(bindings(link, vhost, name)?
        .into_iter()
        .filter(|(_, k)| k == routing_key)
        .map(|(p, _)| p)
        .collect())
}
