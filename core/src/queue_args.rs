//! Queue arguments with RabbitMQ's names, parsed and validated once at declare time (invalid
//! values are refused with 406 and RabbitMQ's wording).

use crate::message::{FieldTable, FieldValue};

/// What a queue does when a publish would take it over its length limit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Overflow {
    /// Drop (dead-letter) messages from the head to make room (RabbitMQ's default).
    #[default]
    DropHead,
    /// Refuse the new message: its publisher gets a nack (with confirms).
    RejectPublish,
    /// As `RejectPublish`, and dead-letter the refused message.
    RejectPublishDlx,
}

/// The queue arguments Warren acts on.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct QueueArgs {
    /// `x-message-ttl`, milliseconds.
    pub message_ttl: Option<u64>,
    /// `x-expires`: the queue is deleted after this many milliseconds unused.
    pub expires: Option<u64>,
    /// `x-max-length`: ready messages at most.
    pub max_length: Option<u64>,
    /// `x-max-length-bytes`: ready body bytes at most.
    pub max_length_bytes: Option<u64>,
    /// `x-overflow`: what a full queue does.
    pub overflow: Overflow,
    /// `x-dead-letter-exchange`.
    pub dead_letter_exchange: Option<String>,
    /// `x-dead-letter-routing-key`.
    pub dead_letter_routing_key: Option<String>,
    /// `x-single-active-consumer`.
    pub single_active_consumer: bool,
    /// `x-max-priority`: a priority queue with levels 0..=max.
    pub max_priority: Option<u8>,
    /// `x-delivery-limit` (quorum queues): a message returned more often than this is
    /// dropped or dead-lettered. Only a non-negative integer sets it: RabbitMQ 3.10 accepts
    /// any value and ignores what is not a limit.
    pub delivery_limit: Option<u64>,
    /// `x-dead-letter-strategy` (quorum queues).
    pub dead_letter_strategy: DeadLetterStrategy,
    /// `x-quorum-initial-group-size`: members of a quorum queue's group (validated for any
    /// queue, as RabbitMQ does; a single node has groups of one).
    pub initial_group_size: Option<u64>,
}

/// `x-dead-letter-strategy`: how a quorum queue hands a message to its dead-letter exchange.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DeadLetterStrategy {
    /// Fire and forget (RabbitMQ's default): a dead letter lost on the way is lost.
    #[default]
    AtMostOnce,
    /// The message stays in its queue until its dead-letter queues have it (RabbitMQ only
    /// honours it with `x-overflow: reject-publish`; otherwise it falls back to
    /// at-most-once).
    AtLeastOnce,
}

/// No arguments: what nearly every queue has (an idle MQTT subscriber's included).
static NO_ARGS: QueueArgs = QueueArgs {
    message_ttl: None,
    expires: None,
    max_length: None,
    max_length_bytes: None,
    overflow: Overflow::DropHead,
    dead_letter_exchange: None,
    dead_letter_routing_key: None,
    single_active_consumer: false,
    max_priority: None,
    delivery_limit: None,
    dead_letter_strategy: DeadLetterStrategy::AtMostOnce,
    initial_group_size: None,
};

/// A queue's parsed arguments as it holds them: a pointer, null for the defaults. Inline they
/// were ~120 of a queue record's ~410 bytes, paid by every queue, used by few. Shared
/// (`HeldArgs::shared`): every queue one policy governs holds the same arguments (each MQTT
/// session's queue: the offline-queue bound), one copy of them for all.
#[derive(Debug, Default)]
pub struct HeldArgs(Option<std::sync::Arc<QueueArgs>>);

impl HeldArgs {
    /// `args`, held in `last`'s allocation when they are equal to it; else in a new one,
    /// which becomes `last`.
    pub(crate) fn shared(
        args: QueueArgs,
        last: &mut Option<std::sync::Arc<QueueArgs>>,
    ) -> HeldArgs {
        if args == NO_ARGS {
            return HeldArgs(None);
        }
        match last {
            Some(held) if **held == args => HeldArgs(Some(std::sync::Arc::clone(held))),
            _ => {
                let held = std::sync::Arc::new(args);
                *last = Some(std::sync::Arc::clone(&held));
                HeldArgs(Some(held))
            }
        }
    }
}

impl std::ops::Deref for HeldArgs {
    type Target = QueueArgs;

    fn deref(&self) -> &QueueArgs {
        self.0.as_deref().unwrap_or(&NO_ARGS)
    }
}

fn type_name(v: &FieldValue) -> &'static str {
    match v {
        FieldValue::Bool(_) => "bool",
        FieldValue::ShortString(_) => "shortstr",
        FieldValue::LongString(_) => "longstr",
        FieldValue::Table(_) => "table",
        FieldValue::Array(_) => "array",
        FieldValue::F32(_) | FieldValue::F64(_) => "float",
        FieldValue::Decimal { .. } => "decimal",
        FieldValue::Void => "void",
        FieldValue::ByteArray(_) => "binary",
        _ => "long",
    }
}

/// A refused argument: (argument name, RabbitMQ's reason term).
pub type ArgError = (&'static str, String);

fn non_negative(name: &'static str, v: &FieldValue) -> Result<u64, ArgError> {
    let n = v
        .as_i64()
        .ok_or_else(|| (name, format!("{{unacceptable_type,{}}}", type_name(v))))?;
    u64::try_from(n).map_err(|_| (name, format!("{{value_negative,{n}}}")))
}

pub(crate) fn string(name: &'static str, v: &FieldValue) -> Result<String, ArgError> {
    v.as_str()
        .map(str::to_string)
        .ok_or_else(|| (name, format!("{{unacceptable_type,{}}}", type_name(v))))
}

impl QueueArgs {
    /// Parses and validates `arguments`; unknown arguments are ignored (as RabbitMQ does).
    pub fn parse(arguments: &FieldTable) -> Result<QueueArgs, ArgError> {
        let mut a = QueueArgs::default();
        if let Some(v) = arguments.get("x-message-ttl") {
            a.message_ttl = Some(non_negative("x-message-ttl", v)?);
        }
        if let Some(v) = arguments.get("x-expires") {
            let n = non_negative("x-expires", v)?;
            if n == 0 {
                return Err(("x-expires", "{value_zero,0}".into()));
            }
            a.expires = Some(n);
        }
        if let Some(v) = arguments.get("x-max-length") {
            a.max_length = Some(non_negative("x-max-length", v)?);
        }
        if let Some(v) = arguments.get("x-max-length-bytes") {
            a.max_length_bytes = Some(non_negative("x-max-length-bytes", v)?);
        }
        if let Some(v) = arguments.get("x-overflow") {
            a.overflow = match string("x-overflow", v)?.as_str() {
                "drop-head" => Overflow::DropHead,
                "reject-publish" => Overflow::RejectPublish,
                "reject-publish-dlx" => Overflow::RejectPublishDlx,
                other => {
                    return Err((
                        "x-overflow",
                        format!("{{unknown_overflow_behaviour,<<\"{other}\">>}}"),
                    ));
                }
            };
        }
        if let Some(v) = arguments.get("x-dead-letter-exchange") {
            a.dead_letter_exchange = Some(string("x-dead-letter-exchange", v)?);
        }
        if let Some(v) = arguments.get("x-dead-letter-routing-key") {
            if a.dead_letter_exchange.is_none() {
                return Err((
                    "x-dead-letter-routing-key",
                    "{missing_dead_letter_exchange}".into(),
                ));
            }
            a.dead_letter_routing_key = Some(string("x-dead-letter-routing-key", v)?);
        }
        if let Some(v) = arguments.get("x-max-priority") {
            let n = non_negative("x-max-priority", v)?;
            let max = u8::try_from(n)
                .map_err(|_| ("x-max-priority", format!("{{value_out_of_range,{n}}}")))?;
            a.max_priority = Some(max);
        }
        if let Some(n) = arguments
            .get("x-delivery-limit")
            .and_then(FieldValue::as_i64)
        {
            a.delivery_limit = u64::try_from(n).ok();
        }
        if let Some(v) = arguments.get("x-dead-letter-strategy") {
            a.dead_letter_strategy = match v.as_str() {
                Some("at-most-once") => DeadLetterStrategy::AtMostOnce,
                Some("at-least-once") => DeadLetterStrategy::AtLeastOnce,
                _ => return Err(("x-dead-letter-strategy", "invalid_dlx_strategy".into())),
            };
        }
        if let Some(v) = arguments.get("x-quorum-initial-group-size") {
            let n = v.as_i64().ok_or_else(|| {
                (
                    "x-quorum-initial-group-size",
                    format!("\"expected integer, got {}\"", type_name(v)),
                )
            })?;
            let size = non_negative("x-quorum-initial-group-size", v)?;
            if size == 0 {
                return Err(("x-quorum-initial-group-size", format!("{{value_zero,{n}}}")));
            }
            a.initial_group_size = Some(size);
        }
        if let Some(v) = arguments.get("x-single-active-consumer") {
            a.single_active_consumer = v.as_bool().ok_or_else(|| {
                (
                    "x-single-active-consumer",
                    format!("{{unacceptable_type,{}}}", type_name(v)),
                )
            })?;
        }
        Ok(a)
    }
}

/// RabbitMQ 3.10's warning (its `rabbit_quorum_queue:dlh/5`, worded as it logs it) for a
/// quorum queue declared with `x-dead-letter-strategy: at-least-once` that will not
/// dead-letter at least once: without a dead-letter exchange it does not dead-letter at all,
/// and without `x-overflow: reject-publish` it falls back to at-most-once. `None` when there
/// is nothing to warn about. Hosts log it when a client declares such a queue.
pub fn dead_letter_warning(arguments: &FieldTable) -> Option<&'static str> {
    let text = |k: &str| arguments.get(k).and_then(FieldValue::as_str);
    if text("x-queue-type") != Some("quorum")
        || text("x-dead-letter-strategy") != Some("at-least-once")
    {
        return None;
    }
    if arguments.get("x-dead-letter-exchange").is_none() {
        return Some(
            "Disabling dead-lettering despite configured dead-letter-strategy 'at-least-once' because dead-letter-exchange is not configured.",
        );
    }
    if text("x-overflow") != Some("reject-publish") {
        return Some(
            "Falling back to dead-letter-strategy at-most-once because configured dead-letter-strategy at-least-once is incompatible with effective overflow strategy drop-head. To enable dead-letter-strategy at-least-once, set overflow strategy to reject-publish.",
        );
    }
    None
}

/// Parses a per-message `expiration` property (milliseconds as decimal text, as AMQP has it).
pub fn parse_expiration(text: &str) -> Result<u64, String> {
    text.parse::<u64>()
        .map_err(|_| format!("invalid expiration '{text}'"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_arguments_are_held_once() {
        let bounded = QueueArgs {
            max_length: Some(1000),
            ..QueueArgs::default()
        };
        let mut last = None;
        let a = HeldArgs::shared(bounded.clone(), &mut last);
        let b = HeldArgs::shared(bounded.clone(), &mut last);
        let (Some(a), Some(b)) = (&a.0, &b.0) else {
            panic!("non-default arguments are held");
        };
        assert!(std::sync::Arc::ptr_eq(a, b), "one allocation for both");
        let other = QueueArgs {
            max_length: Some(5),
            ..QueueArgs::default()
        };
        let c = HeldArgs::shared(other, &mut last);
        assert_eq!(c.max_length, Some(5));
        assert_eq!(b.max_length, Some(1000), "the first queue's are unchanged");
        assert!(
            HeldArgs::shared(QueueArgs::default(), &mut last)
                .0
                .is_none()
        );
    }

    #[test]
    fn at_least_once_without_reject_publish_is_warned_about() {
        let t = |pairs: &[(&str, &str)]| -> FieldTable {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), FieldValue::string(v)))
                .collect()
        };
        let q = ("x-queue-type", "quorum");
        let s = ("x-dead-letter-strategy", "at-least-once");
        let x = ("x-dead-letter-exchange", "dlx");
        let o = ("x-overflow", "reject-publish");
        assert_eq!(dead_letter_warning(&t(&[q, s, x, o])), None);
        assert!(dead_letter_warning(&t(&[q, s, x])).is_some_and(|w| w.starts_with("Falling back")));
        assert!(
            dead_letter_warning(&t(&[q, s, x, ("x-overflow", "reject-publish-dlx")]))
                .is_some_and(|w| w.starts_with("Falling back"))
        );
        assert!(dead_letter_warning(&t(&[q, s, o])).is_some_and(|w| w.starts_with("Disabling")));
        assert_eq!(
            dead_letter_warning(&t(&[s, x])),
            None,
            "classic queues ignore it"
        );
        assert_eq!(dead_letter_warning(&t(&[q, x])), None);
    }

    #[test]
    fn parses_rabbitmq_arguments() {
        let mut t = FieldTable::new();
        t.insert("x-message-ttl".into(), FieldValue::I32(1000));
        t.insert("x-max-length".into(), FieldValue::I64(10));
        t.insert("x-overflow".into(), FieldValue::string("reject-publish"));
        t.insert("x-dead-letter-exchange".into(), FieldValue::string("dlx"));
        let a = QueueArgs::parse(&t).expect("valid");
        assert_eq!(a.message_ttl, Some(1000));
        assert_eq!(a.max_length, Some(10));
        assert_eq!(a.overflow, Overflow::RejectPublish);
        assert_eq!(a.dead_letter_exchange.as_deref(), Some("dlx"));
    }

    #[test]
    fn refuses_bad_values_with_rabbitmq_terms() {
        let mut t = FieldTable::new();
        t.insert("x-message-ttl".into(), FieldValue::I32(-1));
        assert_eq!(
            QueueArgs::parse(&t),
            Err(("x-message-ttl", "{value_negative,-1}".to_string()))
        );
        let mut t = FieldTable::new();
        t.insert("x-dead-letter-routing-key".into(), FieldValue::string("k"));
        assert_eq!(
            QueueArgs::parse(&t).map_err(|e| e.1),
            Err("{missing_dead_letter_exchange}".to_string())
        );
        // Quorum-queue arguments, with RabbitMQ 3.10's terms (checked against it).
        for (arg, v, term) in [
            (
                "x-dead-letter-strategy",
                FieldValue::string("bogus"),
                "invalid_dlx_strategy",
            ),
            (
                "x-quorum-initial-group-size",
                FieldValue::I32(0),
                "{value_zero,0}",
            ),
            (
                "x-quorum-initial-group-size",
                FieldValue::string("x"),
                "\"expected integer, got longstr\"",
            ),
        ] {
            let mut t = FieldTable::new();
            t.insert(arg.into(), v);
            assert_eq!(QueueArgs::parse(&t), Err((arg, term.to_string())));
        }
        let mut t = FieldTable::new();
        t.insert("x-delivery-limit".into(), FieldValue::I32(2));
        t.insert(
            "x-dead-letter-strategy".into(),
            FieldValue::string("at-least-once"),
        );
        t.insert("x-quorum-initial-group-size".into(), FieldValue::I32(3));
        let a = QueueArgs::parse(&t).expect("valid");
        assert_eq!(a.delivery_limit, Some(2));
        assert_eq!(a.dead_letter_strategy, DeadLetterStrategy::AtLeastOnce);
        assert_eq!(a.initial_group_size, Some(3));
        // RabbitMQ 3.10 takes a delivery limit that is no limit and ignores it.
        let mut t = FieldTable::new();
        t.insert("x-delivery-limit".into(), FieldValue::string("a"));
        assert_eq!(QueueArgs::parse(&t).map(|a| a.delivery_limit), Ok(None));
        let mut t = FieldTable::new();
        t.insert("x-expires".into(), FieldValue::string("soon"));
        assert_eq!(
            QueueArgs::parse(&t).map_err(|e| e.1),
            Err("{unacceptable_type,longstr}".to_string())
        );
    }
}
