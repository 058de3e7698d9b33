//! MQTT publish <-> core message. The mapping (ARCHITECTURE.md, "MQTT <-> AMQP mapping"):
//!
//! | MQTT | AMQP message |
//! |---|---|
//! | topic `a/b` | routing key `a.b` on `amq.topic` |
//! | QoS | header `x-mqtt-publish-qos`; delivery mode 2 for QoS 1/2, 1 for QoS 0 |
//! | retain flag | header `x-mqtt-retain` (for retain-as-published) |
//! | message expiry interval (s) | `expiration` (ms) + header `x-mqtt-published-at` (unix ms) |
//! | user properties | headers (long strings), in order, last one wins on duplicates |
//! | content type | `content_type` |
//! | response topic | `reply_to` (as an AMQP routing key) |
//! | correlation data | `correlation_id` when UTF-8, else header `x-correlation-data` (bytes) |
//! | payload format indicator | header `x-mqtt-payload-format` |
//!
//! An AMQP message without `x-mqtt-publish-qos` counts as QoS 1 when persistent, else QoS 0.

use bytes::Bytes;
use mqtt_proto::v5::{PublishProperties, UserProperty};
use mqtt_proto::{QoS, TopicName};
use std::cell::RefCell;
use std::sync::Arc;
use warren_core::command::Publish;
use warren_core::message::{FieldTable, FieldValue, Message, Properties};
use warren_core::mqtt::{amqp_key_to_topic, topic_to_amqp_key, with_swapped};

pub const EXCHANGE: &str = "amq.topic";
pub const H_QOS: &str = "x-mqtt-publish-qos";
pub const H_RETAIN: &str = "x-mqtt-retain";
pub const H_PUBLISHED_AT: &str = "x-mqtt-published-at";
pub const H_CORRELATION: &str = "x-correlation-data";
pub const H_FORMAT: &str = "x-mqtt-payload-format";
/// When a `$delayed/{seconds}/{topic}` publish is due (the core's scheduled delivery,
/// docs/delayed.md); not passed on to subscribers.
pub const H_DELIVER_AT: &str = "x-deliver-at";
/// The longest `$delayed` delay, in seconds: the core's (2^32 - 1 ms), as EMQX's 4294967 s.
pub const MAX_DELAYED_SECS: u64 = warren_core::broker::MAX_DELAY_MS / 1000;

/// `$delayed/{seconds}/{topic}` (EMQX's delayed publish): the delay and the topic, or `Err`
/// when the form is bad (not a whole number of seconds, too long, or no topic after it).
/// `None`: not a delayed publish.
pub fn delayed(topic: &str) -> Option<Result<(u64, &str), String>> {
    let rest = topic.strip_prefix("$delayed/")?;
    let Some((secs, topic)) = rest.split_once('/') else {
        return Some(Err("'$delayed/{seconds}/{topic}' has no topic".into()));
    };
    Some(match secs.parse::<u64>() {
        Ok(_) if topic.is_empty() || topic.starts_with('$') => Err(format!(
            "'$delayed' topic {topic:?} is not a topic to publish to"
        )),
        Ok(s) if s <= MAX_DELAYED_SECS => Ok((s, topic)),
        Ok(_) => Err(format!(
            "'$delayed' delay {secs} is over {MAX_DELAYED_SECS} s"
        )),
        Err(_) => Err(format!(
            "'$delayed' delay {secs:?} is not a whole number of seconds"
        )),
    })
}

/// Makes `publish` due `delay_ms` from `now_ms`: the core schedules it, and its MQTT 5
/// message expiry counts from then (the message is published when due).
pub fn delay(publish: &mut Publish, now_ms: u64, delay_ms: u64) {
    let at = now_ms.saturating_add(delay_ms);
    let headers = publish
        .properties
        .headers
        .get_or_insert_with(FieldTable::new);
    if headers.contains_key(H_PUBLISHED_AT) {
        headers.insert(H_PUBLISHED_AT.into(), FieldValue::Timestamp(at));
    }
    headers.insert(
        H_DELIVER_AT.into(),
        FieldValue::I64(i64::try_from(at).unwrap_or(i64::MAX)),
    );
}

/// The publishing client id, set only by sessions that have a no-local subscription.
pub const H_PUBLISHER: &str = "x-mqtt-publisher";

/// The exchange MQTT publishes go to, shared by every publish (a reference count, not an
/// allocation per message).
fn exchange() -> Arc<str> {
    static NAME: std::sync::LazyLock<Arc<str>> = std::sync::LazyLock::new(|| Arc::from(EXCHANGE));
    NAME.clone()
}

/// The last topic this thread converted, and its routing key once asked for. A publisher
/// repeats its topic, and so do the messages a subscriber receives, so nearly every PUBLISH
/// read, routed and delivered finds its topic name and key here instead of allocating them
/// (three allocations per message otherwise). One entry per thread: nothing per connection.
struct LastTopic {
    topic: Option<TopicName>,
    /// `topic`'s routing key, when `topic` is set and its key was asked for.
    key: Option<Arc<str>>,
}

thread_local! {
    static LAST: RefCell<LastTopic> = const { RefCell::new(LastTopic { topic: None, key: None }) };
}

fn same(a: &str, b: &str) -> bool {
    std::ptr::eq(a, b) || a == b
}

/// A validated topic name for `s` (a PUBLISH's), shared with the previous one when equal.
pub fn topic_name(s: &str) -> Result<TopicName, mqtt_proto::Error> {
    LAST.with_borrow_mut(|last| {
        if let Some(t) = &last.topic
            && same(t, s)
        {
            return Ok(t.clone());
        }
        let t = TopicName::try_from(s)?;
        *last = LastTopic {
            topic: Some(t.clone()),
            key: None,
        };
        Ok(t)
    })
}

/// The routing key of `topic` (`a/b` -> `a.b`), shared with the previous one when equal.
fn routing_key(topic: &TopicName) -> Arc<str> {
    LAST.with_borrow_mut(|last| {
        if let Some(t) = &last.topic
            && same(t, topic)
        {
            return last
                .key
                .get_or_insert_with(|| with_swapped(topic, |k| Arc::from(k)))
                .clone();
        }
        let key: Arc<str> = with_swapped(topic, |k| Arc::from(k));
        *last = LastTopic {
            topic: Some(topic.clone()),
            key: Some(key.clone()),
        };
        key
    })
}

/// The MQTT topic of routing key `key` (`a.b` -> `a/b`), shared with the previous one when
/// equal; `None` when it is no valid topic name.
fn topic_of_key(key: &Arc<str>) -> Option<TopicName> {
    LAST.with_borrow_mut(|last| {
        if let (Some(t), Some(k)) = (&last.topic, &last.key)
            && (Arc::ptr_eq(k, key) || **k == **key)
        {
            return Some(t.clone());
        }
        let t = with_swapped(key, |t| TopicName::try_from(t).ok())?;
        *last = LastTopic {
            topic: Some(t.clone()),
            key: Some(key.clone()),
        };
        Some(t)
    })
}

/// The core publish for an MQTT PUBLISH. `now_ms` is unix time (for expiry).
pub fn to_core(
    topic: &TopicName,
    qos: QoS,
    retain: bool,
    payload: Bytes,
    props: &PublishProperties,
    now_ms: u64,
    publisher: Option<&Arc<str>>,
) -> Publish {
    let mut headers = FieldTable::new();
    headers.insert(H_QOS.into(), FieldValue::U8(qos as u8));
    if retain {
        headers.insert(H_RETAIN.into(), FieldValue::Bool(true));
    }
    for up in &props.user_properties {
        headers.insert(up.name.to_string(), FieldValue::string(&up.value));
    }
    let mut properties = Properties {
        delivery_mode: Some(if qos == QoS::Level0 { 1 } else { 2 }),
        content_type: props.content_type.as_deref().map(str::to_string),
        reply_to: props.response_topic.as_ref().map(|t| topic_to_amqp_key(t)),
        ..Properties::default()
    };
    if let Some(secs) = props.message_expiry_interval {
        properties.expiration = Some((u64::from(secs) * 1000).to_string());
        headers.insert(H_PUBLISHED_AT.into(), FieldValue::Timestamp(now_ms));
    }
    if let Some(cd) = &props.correlation_data {
        match std::str::from_utf8(cd) {
            Ok(s) if s.len() <= 255 => properties.correlation_id = Some(s.to_string()),
            _ => {
                headers.insert(H_CORRELATION.into(), FieldValue::ByteArray(cd.clone()));
            }
        }
    }
    if let Some(utf8) = props.payload_is_utf8 {
        headers.insert(H_FORMAT.into(), FieldValue::U8(u8::from(utf8)));
    }
    if let Some(p) = publisher {
        headers.insert(H_PUBLISHER.into(), FieldValue::string(p));
    }
    properties.headers = Some(headers);
    Publish {
        exchange: exchange(),
        // Shared with the previous publish's on the same topic; the exchange's name always.
        routing_key: routing_key(topic),
        mandatory: false,
        immediate: false,
        properties,
        body: payload,
        routed: None,
    }
}

/// What a subscriber needs from a core message.
pub struct Outgoing {
    pub topic: TopicName,
    pub qos: QoS,
    pub retain: bool,
    pub properties: PublishProperties,
    /// Unix ms after which the message must not be sent.
    pub expired: bool,
}

fn header<'a>(m: &'a Message, name: &str) -> Option<&'a FieldValue> {
    m.properties.headers.as_ref()?.get(name)
}

/// The publishing client id recorded in the message, if any.
pub fn publisher(m: &Message) -> Option<&str> {
    header(m, H_PUBLISHER)?.as_str()
}

/// The MQTT view of a core message; `None` when its routing key is no valid MQTT topic.
pub fn from_core(m: &Message, now_ms: u64) -> Option<Outgoing> {
    let topic = topic_of_key(&m.routing_key)?;
    if topic.is_empty() {
        return None;
    }
    let qos = match header(m, H_QOS).and_then(FieldValue::as_i64) {
        Some(0) => QoS::Level0,
        Some(1) => QoS::Level1,
        Some(_) => QoS::Level2,
        None if m.properties.is_persistent() => QoS::Level1,
        None => QoS::Level0,
    };
    let retain = header(m, H_RETAIN)
        .and_then(FieldValue::as_bool)
        .unwrap_or(false);
    let mut props = PublishProperties::default();
    let mut expired = false;
    if let Some(ttl) = m
        .properties
        .expiration
        .as_deref()
        .and_then(|e| e.parse::<u64>().ok())
    {
        // MQTT 5 (3.3.2.3.3): the forwarded interval is what is left of it.
        let at = header(m, H_PUBLISHED_AT)
            .and_then(FieldValue::as_i64)
            .map_or(now_ms, |v| v as u64);
        let left = (at + ttl).saturating_sub(now_ms);
        if left == 0 {
            expired = true;
        }
        props.message_expiry_interval =
            Some(u32::try_from(left.div_ceil(1000)).unwrap_or(u32::MAX));
    }
    props.content_type = m.properties.content_type.as_deref().map(Arc::from);
    props.response_topic = m
        .properties
        .reply_to
        .as_deref()
        .and_then(|r| TopicName::try_from(amqp_key_to_topic(r).as_str()).ok());
    props.correlation_data = m
        .properties
        .correlation_id
        .as_deref()
        .map(|c| Bytes::copy_from_slice(c.as_bytes()));
    if let Some(headers) = &m.properties.headers {
        for (k, v) in headers {
            match k.as_str() {
                H_QOS | H_RETAIN | H_PUBLISHED_AT | H_PUBLISHER | H_DELIVER_AT => {}
                H_CORRELATION => {
                    if let FieldValue::ByteArray(b) | FieldValue::LongString(b) = v {
                        props.correlation_data = Some(b.clone());
                    }
                }
                H_FORMAT => props.payload_is_utf8 = v.as_i64().map(|n| n == 1),
                _ => {
                    if let Some(s) = field_text(v) {
                        props.user_properties.push(UserProperty {
                            name: Arc::from(k.as_str()),
                            value: Arc::from(s.as_str()),
                        });
                    }
                }
            }
        }
    }
    Some(Outgoing {
        topic,
        qos,
        retain,
        properties: props,
        expired,
    })
}

/// An AMQP header value as MQTT user-property text.
fn field_text(v: &FieldValue) -> Option<String> {
    if let Some(s) = v.as_str() {
        return Some(s.to_string());
    }
    if let Some(i) = v.as_i64() {
        return Some(i.to_string());
    }
    v.as_bool().map(|b| b.to_string())
}
