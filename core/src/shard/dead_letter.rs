//! Dead-lettering, as RabbitMQ does it: a message rejected without requeue, expired, or
//! dropped by a length limit is republished to the queue's `x-dead-letter-exchange` (with
//! `x-dead-letter-routing-key` or its own routing key), carrying an `x-death` history.
//!
//! Dead letters are queued and routed after the operation that produced them, a bounded
//! number per call, so a chain of dead-lettering queues cannot recurse or run unbounded.

use super::Broker;
use super::mail::Mail;
use crate::command::Publish;
use crate::ids::QueueId;
use crate::message::{FieldTable, FieldValue, Message};
pub(crate) use crate::queue::state::DeathReason;
use std::sync::Arc;

/// Dead letters routed per `handle`/`tick` call; the rest wait for the next call.
const MAX_DEAD_LETTERS_PER_CALL: usize = 10_000;

/// A message on its way to a dead-letter exchange.
pub(crate) struct DeadLetter {
    /// The vhost of the queue it died in: the dead-letter exchange is looked up there.
    vhost: crate::ids::VhostId,
    exchange: String,
    routing_key: Option<String>,
    queue: Arc<str>,
    message: Arc<Message>,
    reason: DeathReason,
}

fn text(s: &str) -> FieldValue {
    FieldValue::string(s)
}

/// The message as dead-lettered from `queue`: `x-death` updated (an entry for the same queue
/// and reason has its count raised and moves to the front; otherwise a new entry goes in
/// front), `x-first-death-*` set once, `expiration` moved into the entry as
/// `original-expiration` (so it does not expire again).
fn dead_lettered(d: &DeadLetter, now_ms: u64) -> Message {
    let m = &d.message;
    let mut properties = m.properties.clone();
    let mut headers = properties.headers.take().unwrap_or_default();
    let mut deaths: Vec<FieldValue> = match headers.remove("x-death") {
        Some(FieldValue::Array(items)) => items,
        _ => Vec::new(),
    };
    let same = |t: &FieldTable| {
        t.get("queue").and_then(|v| v.as_str()) == Some(&*d.queue)
            && t.get("reason").and_then(|v| v.as_str()) == Some(d.reason.as_str())
    };
    let existing = deaths
        .iter()
        .position(|v| matches!(v, FieldValue::Table(t) if same(t)));
    let entry = match existing {
        Some(i) => {
            let mut entry = match deaths.remove(i) {
                FieldValue::Table(t) => t,
                _ => FieldTable::new(),
            };
            let count = entry.get("count").and_then(|v| v.as_i64()).unwrap_or(0);
            entry.insert("count".into(), FieldValue::I64(count + 1));
            entry
        }
        None => {
            let mut entry = FieldTable::new();
            entry.insert("count".into(), FieldValue::I64(1));
            entry.insert("reason".into(), text(d.reason.as_str()));
            entry.insert("queue".into(), text(&d.queue));
            entry.insert("time".into(), FieldValue::Timestamp(now_ms / 1000));
            entry.insert("exchange".into(), text(&m.exchange));
            entry.insert(
                "routing-keys".into(),
                FieldValue::Array(vec![text(&m.routing_key)]),
            );
            if let Some(e) = &properties.expiration {
                entry.insert("original-expiration".into(), text(e));
            }
            entry
        }
    };
    deaths.insert(0, FieldValue::Table(entry));
    headers.insert("x-death".into(), FieldValue::Array(deaths));
    for (key, value) in [
        ("x-first-death-reason", d.reason.as_str()),
        ("x-first-death-queue", &*d.queue),
        ("x-first-death-exchange", &*m.exchange),
    ] {
        headers.entry(key.into()).or_insert_with(|| text(value));
    }
    properties.headers = Some(headers);
    properties.expiration = None;
    Message {
        exchange: Arc::from(d.exchange.as_str()),
        routing_key: d
            .routing_key
            .as_deref()
            .map_or_else(|| m.routing_key.clone(), Arc::from),
        properties,
        body: m.body.clone(),
    }
}

/// The queues named in a message's `x-death`, and whether any death was a rejection. A
/// message goes round a dead-letter cycle only while some death in it was a rejection (a
/// client decision); otherwise it would loop forever, so RabbitMQ drops it.
fn history(m: &Message) -> (Vec<String>, bool) {
    let Some(FieldValue::Array(items)) =
        m.properties.headers.as_ref().and_then(|h| h.get("x-death"))
    else {
        return (Vec::new(), false);
    };
    let mut queues = Vec::new();
    let mut rejected = false;
    for item in items {
        if let FieldValue::Table(t) = item {
            if let Some(q) = t.get("queue").and_then(|v| v.as_str()) {
                queues.push(q.to_string());
            }
            rejected |= t.get("reason").and_then(|v| v.as_str()) == Some("rejected");
        }
    }
    (queues, rejected)
}

impl Broker {
    /// Queues `message`, which left queue `from` for `reason`, for its dead-letter exchange
    /// (dropped when the queue has none, as RabbitMQ does).
    pub(crate) fn dead_letter(
        &mut self,
        from: QueueId,
        message: Arc<Message>,
        reason: DeathReason,
    ) {
        let Some(q) = self.qs.queues.get(&from) else {
            return;
        };
        let Some(exchange) = q.args.dead_letter_exchange.clone() else {
            return;
        };
        // A quorum queue's count is its own business (its stored copy of a returned message
        // carries it): RabbitMQ's dead letters do not carry `x-delivery-count`.
        let message = if crate::queue::quorum::QUORUM && q.quorum.is_some() {
            crate::queue::quorum::without_count(message)
        } else {
            message
        };
        let d = DeadLetter {
            vhost: q.vhost,
            exchange,
            routing_key: q.args.dead_letter_routing_key.clone(),
            queue: q.name.clone(),
            message,
            reason,
        };
        // At least once: the queue holds it, in the form it is forwarded in, until its
        // targets confirm it (`shard/dlx.rs`). Length-limit drops are at most once, as in
        // RabbitMQ (and a queue with at-least-once refuses publishes at its limit instead).
        if q.at_least_once() && reason != DeathReason::MaxLen {
            let form = Arc::new(dead_lettered(&d, self.now));
            self.hold_dead_letter(from, form);
            return;
        }
        self.dead_letters.push_back(d);
    }

    /// The queues dead letter `message` (already in its dead-letter form) goes to from
    /// vhost `vhost`: routed through its exchange (`None` when that exchange does not
    /// exist), less the queues of a cycle it may not go round again.
    pub(super) fn dead_letter_targets(
        &self,
        vhost: crate::ids::VhostId,
        message: &Message,
    ) -> Option<Vec<QueueId>> {
        let exchange = self.find_exchange(vhost, &message.exchange)?;
        let (seen, rejected) = history(message);
        let probe = Publish {
            exchange: message.exchange.clone(),
            routing_key: message.routing_key.clone(),
            mandatory: false,
            immediate: false,
            properties: message.properties.clone(),
            body: message.body.clone(),
            routed: None,
        };
        let mut queues = self.route(exchange, &probe);
        if !rejected {
            // Back to a queue it already died in, with no client decision in between:
            // a cycle, dropped. (Names are unique in the vhost, where routing stays.)
            let died_in: Vec<QueueId> = seen
                .iter()
                .filter_map(|name| self.find_queue(vhost, name))
                .collect();
            queues.retain(|q| !died_in.contains(q));
        }
        Some(queues)
    }

    /// Routes queued dead letters (a bounded number per call).
    pub(crate) fn route_dead_letters(&mut self) {
        for _ in 0..MAX_DEAD_LETTERS_PER_CALL {
            let Some(d) = self.dead_letters.pop_front() else {
                return;
            };
            let message = Arc::new(dead_lettered(&d, self.now));
            // A missing dead-letter exchange drops the message (RabbitMQ logs nothing either).
            let Some(queues) = self.dead_letter_targets(d.vhost, &message) else {
                continue;
            };
            for queue in queues {
                self.mail.push_back(Mail::Enqueue {
                    queue,
                    message: message.clone(),
                    publisher: None,
                });
            }
        }
    }
}
