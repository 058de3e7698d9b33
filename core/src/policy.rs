//! Policies, as RabbitMQ has them: a name, a regular expression matched against queue (and
//! exchange) names, what they apply to, a priority, and a definition of settings. Of the
//! policies that match a queue, the one with the highest priority applies; the queue's own
//! `x-` arguments win over it. Changing a policy re-applies it to existing queues at once.

use crate::message::{FieldTable, FieldValue};

/// What a policy applies to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ApplyTo {
    /// Queues and exchanges.
    #[default]
    All,
    /// Queues only.
    Queues,
    /// Exchanges only.
    Exchanges,
}

impl ApplyTo {
    /// Parses RabbitMQ's `apply-to` value.
    pub fn parse(s: &str) -> Option<ApplyTo> {
        match s {
            "all" => Some(ApplyTo::All),
            "queues" => Some(ApplyTo::Queues),
            "exchanges" => Some(ApplyTo::Exchanges),
            _ => None,
        }
    }

    /// RabbitMQ's `apply-to` value.
    pub fn as_str(self) -> &'static str {
        match self {
            ApplyTo::All => "all",
            ApplyTo::Queues => "queues",
            ApplyTo::Exchanges => "exchanges",
        }
    }
}

/// A policy as operators define it (and as stores keep it).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PolicyDef {
    /// The vhost it applies in.
    pub vhost: String,
    /// Its name, unique in its vhost.
    pub name: String,
    /// The regex of the names it applies to.
    pub pattern: String,
    /// Which kind of resource it applies to.
    pub apply_to: ApplyTo,
    /// The highest priority among the matching policies wins.
    pub priority: i64,
    /// Keys as RabbitMQ names them: `message-ttl`, `expires`, `max-length`,
    /// `max-length-bytes`, `overflow`, `dead-letter-exchange`, `dead-letter-routing-key`,
    /// `alternate-exchange`.
    pub definition: FieldTable,
}

/// Policy keys for queues and the queue argument each stands for.
const QUEUE_KEYS: &[(&str, &str)] = &[
    ("message-ttl", "x-message-ttl"),
    ("expires", "x-expires"),
    ("max-length", "x-max-length"),
    ("max-length-bytes", "x-max-length-bytes"),
    ("overflow", "x-overflow"),
    ("dead-letter-exchange", "x-dead-letter-exchange"),
    ("dead-letter-routing-key", "x-dead-letter-routing-key"),
    // Streams' (RabbitMQ's policy keys of the same names).
    ("max-age", "x-max-age"),
    (
        "stream-max-segment-size-bytes",
        "x-stream-max-segment-size-bytes",
    ),
    // Quorum queues' (a classic queue ignores them, as RabbitMQ's do).
    ("delivery-limit", "x-delivery-limit"),
    ("dead-letter-strategy", "x-dead-letter-strategy"),
];
/// Policy keys for exchanges.
const EXCHANGE_KEYS: &[(&str, &str)] = &[("alternate-exchange", "alternate-exchange")];

/// Whether `key` is a policy key Warren acts on (an import drops the others, such as
/// RabbitMQ's `ha-mode`, instead of refusing the policy).
pub fn is_supported_key(key: &str) -> bool {
    QUEUE_KEYS
        .iter()
        .chain(EXCHANGE_KEYS)
        .any(|(k, _)| *k == key)
}

/// A policy with its pattern compiled.
#[derive(Clone, Debug)]
pub(crate) struct Policy {
    pub(crate) def: PolicyDef,
    regex: regex_lite::Regex,
}

impl Policy {
    /// Validates and compiles a policy; the error says what is wrong, as rabbitmqctl does.
    pub(crate) fn new(def: PolicyDef) -> Result<Policy, String> {
        let regex = regex_lite::Regex::new(&def.pattern)
            .map_err(|e| format!("invalid pattern '{}': {e}", def.pattern))?;
        if def.definition.is_empty() {
            return Err("a policy definition must not be empty".into());
        }
        for key in def.definition.keys() {
            if !is_supported_key(key) {
                return Err(format!("unrecognised policy key '{key}'"));
            }
        }
        // The queue keys must make valid queue arguments (same checks as x- arguments).
        crate::queue_args::QueueArgs::parse(&as_queue_arguments(&def.definition)).map_err(
            |(arg, reason)| {
                let key = QUEUE_KEYS
                    .iter()
                    .find(|(_, a)| *a == arg)
                    .map_or(arg, |(k, _)| *k);
                format!("invalid value for policy key '{key}': {reason}")
            },
        )?;
        Ok(Policy { def, regex })
    }

    fn matches(&self, name: &str, queue: bool) -> bool {
        let kind = match self.def.apply_to {
            ApplyTo::All => true,
            ApplyTo::Queues => queue,
            ApplyTo::Exchanges => !queue,
        };
        kind && self.regex.is_match(name)
    }
}

/// A policy definition's queue keys as `x-` arguments.
fn as_queue_arguments(definition: &FieldTable) -> FieldTable {
    QUEUE_KEYS
        .iter()
        .filter_map(|(key, arg)| Some((arg.to_string(), definition.get(*key)?.clone())))
        .collect()
}

/// The policy that applies to `name` (highest priority; on a tie, the first by name), if any.
pub(crate) fn applicable<'a>(
    policies: impl Iterator<Item = &'a Policy>,
    name: &str,
    queue: bool,
) -> Option<&'a Policy> {
    let mut best: Option<&Policy> = None;
    for p in policies {
        if p.matches(name, queue) && best.is_none_or(|b| p.def.priority > b.def.priority) {
            best = Some(p);
        }
    }
    best
}

/// A queue's effective arguments: its own, over the applicable policy's.
pub(crate) fn queue_arguments(own: &FieldTable, policy: Option<&Policy>) -> FieldTable {
    let mut merged = policy.map_or_else(FieldTable::new, |p| as_queue_arguments(&p.def.definition));
    merged.extend(own.iter().map(|(k, v)| (k.clone(), v.clone())));
    merged
}

/// An exchange's alternate exchange: its own argument, else the applicable policy's.
pub(crate) fn alternate_exchange(own: Option<&str>, policy: Option<&Policy>) -> Option<String> {
    own.map(str::to_string).or_else(|| {
        policy
            .and_then(|p| p.def.definition.get("alternate-exchange"))
            .and_then(FieldValue::as_str)
            .map(str::to_string)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn def(name: &str, pattern: &str, priority: i64, key: &str, v: FieldValue) -> PolicyDef {
        let mut definition = FieldTable::new();
        definition.insert(key.into(), v);
        PolicyDef {
            vhost: "/".into(),
            name: name.into(),
            pattern: pattern.into(),
            apply_to: ApplyTo::Queues,
            priority,
            definition,
        }
    }

    #[test]
    fn the_highest_priority_match_applies_and_queue_arguments_win() {
        let low = Policy::new(def("low", "^orders", 0, "max-length", FieldValue::I64(10)))
            .expect("valid");
        let high = Policy::new(def(
            "high",
            "created$",
            5,
            "message-ttl",
            FieldValue::I64(1000),
        ))
        .expect("valid");
        let all = [low, high];
        let p = applicable(all.iter(), "orders.created", true).expect("a policy");
        assert_eq!(p.def.name, "high");
        assert_eq!(
            applicable(all.iter(), "orders.x", true).map(|p| p.def.name.as_str()),
            Some("low")
        );
        assert!(
            applicable(all.iter(), "orders.x", false).is_none(),
            "queues only"
        );
        let mut own = FieldTable::new();
        own.insert("x-message-ttl".into(), FieldValue::I64(5));
        let merged = queue_arguments(&own, Some(p));
        assert_eq!(merged.get("x-message-ttl"), Some(&FieldValue::I64(5)));
    }

    #[test]
    fn bad_policies_are_refused_with_reasons() {
        assert!(
            Policy::new(def("p", "(", 0, "max-length", FieldValue::I64(1)))
                .unwrap_err()
                .starts_with("invalid pattern")
        );
        assert_eq!(
            Policy::new(def("p", ".*", 0, "max-lenght", FieldValue::I64(1))).unwrap_err(),
            "unrecognised policy key 'max-lenght'"
        );
        assert_eq!(
            Policy::new(def("p", ".*", 0, "message-ttl", FieldValue::I64(-1))).unwrap_err(),
            "invalid value for policy key 'message-ttl': {value_negative,-1}"
        );
    }
}
