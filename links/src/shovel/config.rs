//! A shovel parameter's value: RabbitMQ 3.10's keys, checked in RabbitMQ's order with its
//! error texts (`rabbit_shovel_parameters:validate/5`: the source and destination checks,
//! then every key's own check, unrecognised keys first), so an operator's scripts see the
//! same answers. Keys RabbitMQ still takes under pre-3.7 names (`prefetch-count`,
//! `delete-after`, `add-forward-headers`, `add-timestamp-header`, `publish-properties`) are
//! taken too; the `src-`/`dest-` names win when both are given.

use crate::erlang;
use serde_json::{Map, Value};
use std::time::Duration;

/// When the source is settled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AckMode {
    /// After the destination confirmed the message (at-least-once; the default).
    OnConfirm,
    /// After the message was written to the destination.
    OnPublish,
    /// When the message arrives from the source (at-most-once).
    NoAck,
}

impl AckMode {
    /// RabbitMQ's name.
    pub fn as_str(self) -> &'static str {
        match self {
            AckMode::OnConfirm => "on-confirm",
            AckMode::OnPublish => "on-publish",
            AckMode::NoAck => "no-ack",
        }
    }
}

/// When the shovel stops and deletes itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeleteAfter {
    /// Runs until its parameter is cleared.
    Never,
    /// After moving as many messages as the source queue held when the shovel started.
    QueueLength,
    /// After moving this many messages.
    Count(u64),
}

/// Where the shovel consumes.
#[derive(Clone, Debug, PartialEq)]
pub enum Source {
    /// A queue, declared (durable) if missing, with `src-queue-args`.
    Queue(String),
    /// An exchange: the shovel binds a private queue to it with the key.
    Exchange {
        /// The exchange.
        exchange: String,
        /// The binding key (`#` by default, as RabbitMQ).
        key: String,
    },
}

/// A validated shovel definition.
#[derive(Clone, Debug, PartialEq)]
pub struct ShovelConfig {
    /// Source URIs, tried in turn.
    pub src_uris: Vec<String>,
    /// The source.
    pub source: Source,
    /// `src-queue-args` (a declared source queue's arguments).
    pub src_queue_args: Map<String, Value>,
    /// `src-consumer-args`.
    pub src_consumer_args: Map<String, Value>,
    /// Unsettled deliveries at most (the source consumer's basic.qos).
    pub prefetch: u16,
    /// When the source is settled.
    pub ack_mode: AckMode,
    /// When the shovel ends.
    pub delete_after: DeleteAfter,
    /// The first wait before a reconnect (then backing off).
    pub reconnect_delay: Duration,
    /// Destination URIs, tried in turn.
    pub dest_uris: Vec<String>,
    /// `dest-exchange` (else the message's own exchange, or `""` with a `dest-queue`).
    pub dest_exchange: Option<String>,
    /// `dest-exchange-key` (else the message's own routing key).
    pub dest_exchange_key: Option<String>,
    /// `dest-queue`: published through the default exchange; declared if missing.
    pub dest_queue: Option<String>,
    /// `dest-queue-args`.
    pub dest_queue_args: Map<String, Value>,
    /// Adds the `x-shovelled` header.
    pub add_forward_headers: bool,
    /// Adds the `x-shovelled-timestamp` header.
    pub add_timestamp_header: bool,
    /// Properties that replace the message's own (`dest-publish-properties`).
    pub publish_properties: Map<String, Value>,
}

/// RabbitMQ's default `src-prefetch-count` (`?DEFAULT_PREFETCH`).
pub const DEFAULT_PREFETCH: u16 = 1000;
/// RabbitMQ's default `reconnect-delay`, seconds.
pub const DEFAULT_RECONNECT_DELAY: f64 = 5.0;

/// A key's check.
type Check = fn(&str, &Value) -> Vec<String>;

/// The keys in RabbitMQ's order (shovel, source, destination) with their checks and
/// whether they must be there.
const KEYS: &[(&str, Check, bool)] = &[
    ("reconnect-delay", number, false),
    ("ack-mode", ack_mode, false),
    ("src-protocol", protocol, false),
    ("dest-protocol", protocol, false),
    ("src-uri", uris, true),
    ("src-exchange", binary, false),
    ("src-exchange-key", binary, false),
    ("src-queue", binary, false),
    ("src-queue-args", object, false),
    ("src-consumer-args", object, false),
    ("prefetch-count", number, false),
    ("src-prefetch-count", number, false),
    ("delete-after", delete_after, false),
    ("src-delete-after", delete_after, false),
    ("dest-uri", uris, true),
    ("dest-exchange", binary, false),
    ("dest-exchange-key", binary, false),
    ("dest-queue", binary, false),
    ("dest-queue-args", object, false),
    ("add-forward-headers", boolean, false),
    ("add-timestamp-header", boolean, false),
    ("dest-add-forward-headers", boolean, false),
    ("dest-add-timestamp-header", boolean, false),
    ("publish-properties", properties, false),
    ("dest-publish-properties", properties, false),
];

/// `dest-publish-properties` keys and whether each is a number (else a string).
const PROPERTIES: &[(&str, bool)] = &[
    ("content_type", false),
    ("content_encoding", false),
    ("delivery_mode", true),
    ("priority", true),
    ("correlation_id", false),
    ("reply_to", false),
    ("expiration", false),
    ("message_id", false),
    ("timestamp", true),
    ("type", false),
    ("user_id", false),
    ("app_id", false),
    ("cluster_id", false),
];

fn number(key: &str, v: &Value) -> Vec<String> {
    if v.is_number() {
        return Vec::new();
    }
    vec![format!(
        "{key} should be a number, actually was {}",
        erlang::term(v)
    )]
}

fn binary(key: &str, v: &Value) -> Vec<String> {
    if v.is_string() {
        return Vec::new();
    }
    vec![format!(
        "{key} should be binary, actually was {}",
        erlang::term(v)
    )]
}

fn boolean(key: &str, v: &Value) -> Vec<String> {
    if v.is_boolean() {
        return Vec::new();
    }
    vec![format!(
        "{key} should be boolean, actually was {}",
        erlang::term(v)
    )]
}

fn object(key: &str, v: &Value) -> Vec<String> {
    if v.is_object() {
        return Vec::new();
    }
    vec![format!(
        "{key} should be an object, actually was {}",
        erlang::term(v)
    )]
}

fn enum_of(key: &str, v: &Value, allowed: &[&str]) -> Vec<String> {
    if v.as_str().is_some_and(|s| allowed.contains(&s)) {
        return Vec::new();
    }
    let mut list = String::from("[");
    for (i, a) in allowed.iter().enumerate() {
        if i > 0 {
            list.push(',');
        }
        erlang::binary(a, &mut list);
    }
    list.push(']');
    vec![format!(
        "{key} should be one of {list}, actually was {}",
        erlang::term(v)
    )]
}

fn ack_mode(key: &str, v: &Value) -> Vec<String> {
    enum_of(key, v, &["no-ack", "on-publish", "on-confirm"])
}

fn protocol(key: &str, v: &Value) -> Vec<String> {
    enum_of(key, v, &["amqp10", "amqp091"])
}

fn delete_after(key: &str, v: &Value) -> Vec<String> {
    let ok = matches!(v.as_str(), Some("never" | "queue-length")) || v.as_u64().is_some();
    if ok {
        return Vec::new();
    }
    vec![format!(
        "{key} should be a number greater than or equal to 0, \"never\" or \"queue-length\", \
         actually was {}",
        erlang::term(v)
    )]
}

fn uris(key: &str, v: &Value) -> Vec<String> {
    match v {
        Value::String(s) => super::uri::check(s).err().into_iter().collect(),
        Value::Array(items) => items
            .iter()
            .flat_map(|u| match u {
                Value::String(s) => super::uri::check(s).err(),
                other => Some(format!(
                    "{key} should be binary, actually was {}",
                    erlang::term(other)
                )),
            })
            .collect(),
        other => vec![format!(
            "{key} should be list, actually was {}",
            erlang::term(other)
        )],
    }
}

fn properties(key: &str, v: &Value) -> Vec<String> {
    let Some(map) = v.as_object() else {
        return vec![format!("{key} not a list {}", erlang::term(v))];
    };
    let mut errors: Vec<String> = Vec::new();
    let unknown: Vec<(&String, &Value)> = map
        .iter()
        .filter(|(k, _)| !PROPERTIES.iter().any(|(p, _)| p == k))
        .collect();
    if !unknown.is_empty() {
        errors.push(format!(
            "Unrecognised terms {} in {key}",
            erlang::proplist(unknown)
        ));
    }
    for (p, numeric) in PROPERTIES.iter().rev() {
        if let Some(v) = map.get(*p) {
            errors.extend(if *numeric { number(p, v) } else { binary(p, v) });
        }
    }
    errors
}

/// The checks across keys (`validate_src`, `validate_dest`).
fn across(v: &Map<String, Value>) -> Vec<String> {
    let mut errors = Vec::new();
    match (v.contains_key("src-exchange"), v.contains_key("src-queue")) {
        (false, false) => errors.push("Must specify 'src-exchange' or 'src-queue'".to_string()),
        (true, true) => errors.push("Cannot specify 'src-exchange' and 'src-queue'".to_string()),
        _ => {}
    }
    let delete_after = v.get("src-delete-after").or_else(|| v.get("delete-after"));
    if delete_after.is_some_and(Value::is_i64) && v.get("ack-mode") == Some(&Value::from("no-ack"))
    {
        errors.push("Cannot specify 'no-ack' and numerical 'delete-after'".to_string());
    }
    if v.contains_key("dest-exchange") && v.contains_key("dest-queue") {
        errors.push("Cannot specify 'dest-exchange' and 'dest-queue'".to_string());
    }
    errors
}

/// "Validation failed" with the errors, one a line, as rabbitmqctl prints them.
fn failed(errors: &[String]) -> String {
    let mut out = String::from("Validation failed\n\n");
    for e in errors {
        out.push_str(e);
        out.push('\n');
    }
    out
}

impl ShovelConfig {
    /// Checks parameter `name`'s value and reads it; the error is RabbitMQ's text.
    pub fn parse(name: &str, value: &Value) -> Result<ShovelConfig, String> {
        let Some(v) = value.as_object() else {
            return Err(failed(&[format!(
                "{name} should be an object, actually was {}",
                erlang::term(value)
            )]));
        };
        // AMQP 1.0 ends have keys of their own (src-address, ...): RabbitMQ checks those
        // instead; Warren does not speak AMQP 1.0 to other brokers yet.
        for key in ["src-protocol", "dest-protocol"] {
            if v.get(key).and_then(Value::as_str) == Some("amqp10") {
                return Err(failed(&[format!(
                    "{key} amqp10 is not supported: Warren's shovels speak amqp091 only"
                )]));
            }
        }
        let mut errors = across(v);
        let unknown: Vec<(&String, &Value)> = v
            .iter()
            .filter(|(k, _)| !KEYS.iter().any(|(key, _, _)| key == k))
            .collect();
        if !unknown.is_empty() {
            errors.push(format!(
                "Unrecognised terms {} in {name}",
                erlang::proplist(unknown)
            ));
        }
        for (key, check, mandatory) in KEYS.iter().rev() {
            match v.get(*key) {
                Some(value) => errors.extend(check(key, value)),
                None if *mandatory => errors.push(format!("Key \"{key}\" not found in {name}")),
                None => {}
            }
        }
        if !errors.is_empty() {
            return Err(failed(&errors));
        }
        Ok(ShovelConfig::read(v))
    }

    /// Reads a value [`ShovelConfig::parse`] checked.
    fn read(v: &Map<String, Value>) -> ShovelConfig {
        let s = |k: &str| v.get(k).and_then(Value::as_str).map(str::to_string);
        let first = |a: &str, b: &str| v.get(a).or_else(|| v.get(b));
        let obj = |k: &str| {
            v.get(k)
                .and_then(Value::as_object)
                .cloned()
                .unwrap_or_default()
        };
        let uri_list = |k: &str| match v.get(k) {
            Some(Value::Array(items)) => items
                .iter()
                .filter_map(Value::as_str)
                .map(str::to_string)
                .collect(),
            Some(Value::String(u)) => vec![u.clone()],
            _ => Vec::new(),
        };
        let source = match s("src-queue") {
            Some(q) => Source::Queue(q),
            None => Source::Exchange {
                exchange: s("src-exchange").unwrap_or_default(),
                key: s("src-exchange-key").unwrap_or_else(|| "#".to_string()),
            },
        };
        // basic.qos takes 16 bits; 0 or less (RabbitMQ takes any number) would mean
        // unbounded, and every link is bounded: the default then.
        let prefetch = match first("src-prefetch-count", "prefetch-count").and_then(Value::as_f64) {
            Some(n) if n >= 1.0 => n.min(f64::from(u16::MAX)) as u16,
            _ => DEFAULT_PREFETCH,
        };
        let ack_mode = match s("ack-mode").as_deref() {
            Some("on-publish") => AckMode::OnPublish,
            Some("no-ack") => AckMode::NoAck,
            _ => AckMode::OnConfirm,
        };
        let delete_after = match first("src-delete-after", "delete-after") {
            Some(Value::String(x)) if x == "queue-length" => DeleteAfter::QueueLength,
            Some(n) => n.as_u64().map_or(DeleteAfter::Never, DeleteAfter::Count),
            None => DeleteAfter::Never,
        };
        let delay = v
            .get("reconnect-delay")
            .and_then(Value::as_f64)
            .unwrap_or(DEFAULT_RECONNECT_DELAY)
            .clamp(0.0, 3600.0);
        let flag = |a: &str, b: &str| first(a, b).and_then(Value::as_bool).unwrap_or(false);
        ShovelConfig {
            src_uris: uri_list("src-uri"),
            source,
            src_queue_args: obj("src-queue-args"),
            src_consumer_args: obj("src-consumer-args"),
            prefetch,
            ack_mode,
            delete_after,
            reconnect_delay: Duration::from_secs_f64(delay),
            dest_uris: uri_list("dest-uri"),
            dest_exchange: s("dest-exchange"),
            dest_exchange_key: s("dest-exchange-key"),
            dest_queue: s("dest-queue"),
            dest_queue_args: obj("dest-queue-args"),
            add_forward_headers: flag("dest-add-forward-headers", "add-forward-headers"),
            add_timestamp_header: flag("dest-add-timestamp-header", "add-timestamp-header"),
            publish_properties: first("dest-publish-properties", "publish-properties")
                .and_then(Value::as_object)
                .cloned()
                .unwrap_or_default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn base() -> Value {
        json!({"src-uri": "amqp://", "src-queue": "a", "dest-uri": "amqp://", "dest-queue": "b"})
    }

    fn with(extra: Value) -> Value {
        let mut v = base();
        for (k, x) in extra.as_object().into_iter().flatten() {
            v[k] = x.clone();
        }
        v
    }

    fn refused(v: Value) -> String {
        ShovelConfig::parse("s", &v).expect_err("refused")
    }

    // The texts below are what RabbitMQ 3.10.8 answered to the same values (rabbitmqctl's
    // form; the HTTP API escapes < and > as HTML).
    #[test]
    fn rabbitmq_texts() {
        let f = |e: &str| format!("Validation failed\n\n{e}\n");
        assert_eq!(
            refused(with(json!({"bogus": 1}))),
            f("Unrecognised terms [{<<\"bogus\">>,1}] in s")
        );
        assert_eq!(
            refused(with(json!({"src-exchange": "x"}))),
            f("Cannot specify 'src-exchange' and 'src-queue'")
        );
        let mut no_uri = base();
        no_uri.as_object_mut().map(|o| o.remove("src-uri"));
        assert_eq!(refused(no_uri), f("Key \"src-uri\" not found in s"));
        assert_eq!(
            refused(with(json!({"ack-mode": "foo"}))),
            f(
                "ack-mode should be one of [<<\"no-ack\">>,<<\"on-publish\">>,<<\"on-confirm\">>], actually was <<\"foo\">>"
            )
        );
        assert_eq!(
            refused(with(json!({"src-delete-after": -3}))),
            f(
                "src-delete-after should be a number greater than or equal to 0, \"never\" or \"queue-length\", actually was -3"
            )
        );
        assert_eq!(
            refused(with(json!({"src-prefetch-count": "x"}))),
            f("src-prefetch-count should be a number, actually was <<\"x\">>")
        );
        assert_eq!(
            refused(with(json!({"src-uri": "foo://x"}))),
            f("\"foo://x\" not a valid URI: {{unexpected_uri_scheme,\"foo\"},\"foo://x\"}")
        );
        assert_eq!(
            refused(with(json!({"src-uri": ["amqp://", "bad"]}))),
            f("\"bad\" not a valid URI: {{unable_to_parse_uri,no_scheme},\"bad\"}")
        );
        assert_eq!(
            refused(with(json!({"src-uri": 5}))),
            f("src-uri should be list, actually was 5")
        );
        assert_eq!(
            refused(with(json!({"dest-add-forward-headers": "yes"}))),
            f("dest-add-forward-headers should be boolean, actually was <<\"yes\">>")
        );
        assert_eq!(
            refused(with(json!({"src-delete-after": 5, "ack-mode": "no-ack"}))),
            f("Cannot specify 'no-ack' and numerical 'delete-after'")
        );
        assert_eq!(
            refused(with(
                json!({"dest-publish-properties": {"delivery_mode": "x"}})
            )),
            f("delivery_mode should be a number, actually was <<\"x\">>")
        );
        assert_eq!(
            refused(with(json!({"dest-publish-properties": {"headers": {}}}))),
            f("Unrecognised terms [{<<\"headers\">>,#{}}] in dest-publish-properties")
        );
        assert_eq!(
            refused(with(json!({"dest-publish-properties": "x"}))),
            f("dest-publish-properties not a list <<\"x\">>")
        );
        assert_eq!(
            refused(with(json!({"src-queue": 5}))),
            f("src-queue should be binary, actually was 5")
        );
        assert_eq!(
            refused(json!({"src-uri": "amqp://", "dest-uri": "amqp://", "dest-queue": "b"})),
            f("Must specify 'src-exchange' or 'src-queue'")
        );
    }

    #[test]
    fn reads_defaults_and_legacy_names() {
        let c = ShovelConfig::parse("s", &base()).expect("valid");
        assert_eq!(c.ack_mode, AckMode::OnConfirm);
        assert_eq!(c.prefetch, DEFAULT_PREFETCH);
        assert_eq!(c.delete_after, DeleteAfter::Never);
        assert_eq!(c.reconnect_delay, Duration::from_secs(5));
        let c = ShovelConfig::parse(
            "s",
            &with(json!({"prefetch-count": 7, "delete-after": "queue-length",
                          "add-forward-headers": true, "src-uri": ["amqp://", "amqp://h"]})),
        )
        .expect("valid");
        assert_eq!(c.prefetch, 7);
        assert_eq!(c.delete_after, DeleteAfter::QueueLength);
        assert!(c.add_forward_headers);
        assert_eq!(c.src_uris.len(), 2);
        assert!(refused(with(json!({"src-protocol": "amqp10"}))).contains("amqp091 only"));
    }
}
