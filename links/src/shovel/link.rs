//! A shovel's logic without I/O: what to publish for each delivery (where, with which
//! properties and forward headers), how many messages are still to move, when it is done.
//! The I/O around it (`super::amqp`, later a browser's WebSocket client) tells it what
//! happened; it never blocks, reads a clock or touches a socket.

use super::config::{AckMode, DeleteAfter, ShovelConfig, Source};
use amq_protocol::protocol::BasicProperties;
use amq_protocol::types::{AMQPValue, FieldArray, FieldTable, LongString, ShortString};
use serde_json::Value;
use std::sync::Arc;

/// Who the shovel is, for its forward headers.
#[derive(Clone, Debug)]
pub struct Identity {
    /// The parameter's name.
    pub name: String,
    /// The parameter's vhost.
    pub vhost: String,
    /// The node running it (`shovelled-by`).
    pub node: String,
    /// Dynamic or static (`shovel-type`).
    pub kind: super::Kind,
}

/// A message from the source.
pub struct Incoming<'a> {
    /// The exchange it was published to.
    pub exchange: &'a str,
    /// Its routing key.
    pub routing_key: &'a str,
    /// Its properties.
    pub properties: &'a BasicProperties,
}

/// What to do with a delivery.
#[derive(Debug, PartialEq)]
pub enum Decision {
    /// Publish it so.
    Publish {
        /// The destination exchange.
        exchange: String,
        /// The routing key.
        routing_key: String,
        /// The properties (boxed: they are most of the decision's size).
        properties: Box<BasicProperties>,
    },
    /// Give it back to the source (requeued): the shovel moved all it was to move.
    Return,
}

/// One shovel's progress, kept across reconnects.
pub struct Link {
    cfg: Arc<ShovelConfig>,
    id: Identity,
    /// Messages still to accept (`None`: no limit; set at the first start).
    to_accept: Option<u64>,
    /// Accepted, not yet settled at the destination.
    unsettled: u64,
    /// Settled at the destination (as the ack mode counts it).
    moved: u64,
    started: bool,
}

/// A URI without its credentials (headers and status show no passwords).
pub fn redact(uri: &str) -> String {
    match uri.split_once("://") {
        Some((scheme, rest)) => {
            let (authority, path) = rest
                .find('/')
                .map_or((rest, ""), |i| (&rest[..i], &rest[i..]));
            let host = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
            format!("{scheme}://{host}{path}")
        }
        None => uri.to_string(),
    }
}

fn long(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s.as_bytes().to_vec()))
}

impl Link {
    /// A shovel that has moved nothing yet.
    pub fn new(cfg: Arc<ShovelConfig>, id: Identity) -> Link {
        Link {
            cfg,
            id,
            to_accept: None,
            unsettled: 0,
            moved: 0,
            started: false,
        }
    }

    /// The definition.
    pub fn config(&self) -> &ShovelConfig {
        &self.cfg
    }

    /// Both ends are open and the source queue held `queue_len` messages. The first
    /// start fixes how many messages the shovel moves (`src-delete-after`; RabbitMQ's
    /// `queue-length` is the count at start); a reconnect keeps what is left.
    pub fn started(&mut self, queue_len: u64) {
        if self.started {
            return;
        }
        self.started = true;
        self.to_accept = match self.cfg.delete_after {
            DeleteAfter::Never => None,
            DeleteAfter::QueueLength => Some(queue_len),
            DeleteAfter::Count(n) => Some(n),
        };
    }

    /// Messages moved so far.
    pub fn moved(&self) -> u64 {
        self.moved
    }

    /// Messages accepted and not settled yet.
    pub fn unsettled(&self) -> u64 {
        self.unsettled
    }

    /// Whether the shovel moved all it was to move (it then deletes itself).
    pub fn done(&self) -> bool {
        self.to_accept == Some(0) && self.unsettled == 0
    }

    /// Whether the source settles a delivery when it arrives.
    pub fn settles_on_receipt(&self) -> bool {
        self.cfg.ack_mode == AckMode::NoAck
    }

    /// A delivery arrived at `now_secs` (Unix seconds, for the timestamp header).
    pub fn accept(&mut self, m: &Incoming<'_>, now_secs: u64) -> Decision {
        match &mut self.to_accept {
            Some(0) => return Decision::Return,
            Some(n) => *n -= 1,
            None => {}
        }
        self.unsettled += 1;
        let cfg = &self.cfg;
        let (exchange, routing_key) = match (&cfg.dest_queue, &cfg.dest_exchange) {
            (Some(q), _) => (String::new(), q.clone()),
            (None, Some(x)) => (
                x.clone(),
                cfg.dest_exchange_key
                    .clone()
                    .unwrap_or_else(|| m.routing_key.to_string()),
            ),
            (None, None) => (
                m.exchange.to_string(),
                cfg.dest_exchange_key
                    .clone()
                    .unwrap_or_else(|| m.routing_key.to_string()),
            ),
        };
        let properties = Box::new(self.properties(m.properties.clone(), now_secs));
        Decision::Publish {
            exchange,
            routing_key,
            properties,
        }
    }

    /// The destination took an accepted message (confirmed, or written: the ack mode's
    /// meaning of moved).
    pub fn settled(&mut self) {
        self.unsettled = self.unsettled.saturating_sub(1);
        self.moved += 1;
    }

    /// An accepted message went back to the source (the destination refused it).
    pub fn returned(&mut self) {
        self.unsettled = self.unsettled.saturating_sub(1);
        if let Some(n) = &mut self.to_accept {
            *n += 1;
        }
    }

    /// An accepted message is gone without arriving (`no-ack`: settled at the source,
    /// then the destination failed).
    pub fn lost(&mut self) {
        self.unsettled = self.unsettled.saturating_sub(1);
    }

    /// The connections closed: what was accepted and not settled goes back to the source
    /// queue (the broker requeues a closed channel's unacked deliveries) and is to move
    /// again.
    pub fn disconnected(&mut self) {
        let back = std::mem::take(&mut self.unsettled);
        if let Some(n) = &mut self.to_accept {
            *n += back;
        }
    }

    /// The message's properties with `dest-publish-properties` and the forward headers.
    fn properties(&self, mut p: BasicProperties, now_secs: u64) -> BasicProperties {
        for (k, v) in &self.cfg.publish_properties {
            p = set_property(p, k, v);
        }
        if !self.cfg.add_forward_headers && !self.cfg.add_timestamp_header {
            return p;
        }
        let mut headers = p.headers().clone().unwrap_or_default();
        if self.cfg.add_forward_headers {
            let mut info = FieldTable::default();
            let cfg = &self.cfg;
            let uri = |u: &[String]| redact(u.first().map_or("", String::as_str));
            info.insert("shovelled-by".into(), long(&self.id.node));
            info.insert("shovel-type".into(), long(self.id.kind.as_str()));
            info.insert("shovel-name".into(), long(&self.id.name));
            info.insert("shovel-vhost".into(), long(&self.id.vhost));
            info.insert("src-uri".into(), long(&uri(&cfg.src_uris)));
            match &cfg.source {
                Source::Queue(q) => {
                    info.insert("src-queue".into(), long(q));
                }
                Source::Exchange { exchange, key } => {
                    info.insert("src-exchange".into(), long(exchange));
                    info.insert("src-exchange-key".into(), long(key));
                }
            }
            info.insert("dest-uri".into(), long(&uri(&cfg.dest_uris)));
            if let Some(q) = &cfg.dest_queue {
                info.insert("dest-queue".into(), long(q));
            }
            if let Some(x) = &cfg.dest_exchange {
                info.insert("dest-exchange".into(), long(x));
            }
            if let Some(k) = &cfg.dest_exchange_key {
                info.insert("dest-exchange-key".into(), long(k));
            }
            // RabbitMQ prepends to the array a message shovelled before already has.
            let mut shovelled = vec![AMQPValue::FieldTable(info)];
            if let Some(AMQPValue::FieldArray(before)) = headers.inner().get("x-shovelled") {
                shovelled.extend(before.as_slice().iter().cloned());
            }
            headers.insert(
                "x-shovelled".into(),
                AMQPValue::FieldArray(FieldArray::from(shovelled)),
            );
        }
        if self.cfg.add_timestamp_header {
            headers.insert(
                "x-shovelled-timestamp".into(),
                AMQPValue::LongLongInt(i64::try_from(now_secs).unwrap_or(i64::MAX)),
            );
        }
        p.with_headers(headers)
    }
}

/// JSON arguments (`src-queue-args`, ...) as an AMQP field table: strings as long
/// strings, integers as 64-bit, as RabbitMQ's management plugin converts them.
pub fn table(map: &serde_json::Map<String, Value>) -> FieldTable {
    let mut t = FieldTable::default();
    for (k, v) in map {
        if let Some(v) = amqp_value(v) {
            t.insert(ShortString::from(k.as_str()), v);
        }
    }
    t
}

fn amqp_value(v: &Value) -> Option<AMQPValue> {
    Some(match v {
        Value::Null => AMQPValue::Void,
        Value::Bool(b) => AMQPValue::Boolean(*b),
        Value::Number(n) => match n.as_i64() {
            Some(i) => AMQPValue::LongLongInt(i),
            None => AMQPValue::Double(n.as_f64()?),
        },
        Value::String(s) => long(s),
        Value::Array(a) => AMQPValue::FieldArray(FieldArray::from(
            a.iter().filter_map(amqp_value).collect::<Vec<_>>(),
        )),
        Value::Object(o) => AMQPValue::FieldTable(table(o)),
    })
}

/// `p` with property `key` (a `dest-publish-properties` key) set to `v`.
fn set_property(p: BasicProperties, key: &str, v: &Value) -> BasicProperties {
    let s = || ShortString::from(v.as_str().unwrap_or_default());
    let n = || v.as_f64().unwrap_or(0.0);
    match key {
        "content_type" => p.with_content_type(s()),
        "content_encoding" => p.with_content_encoding(s()),
        "delivery_mode" => p.with_delivery_mode(n().clamp(0.0, 255.0) as u8),
        "priority" => p.with_priority(n().clamp(0.0, 255.0) as u8),
        "correlation_id" => p.with_correlation_id(s()),
        "reply_to" => p.with_reply_to(s()),
        "expiration" => p.with_expiration(s()),
        "message_id" => p.with_message_id(s()),
        "timestamp" => p.with_timestamp(n().max(0.0) as u64),
        "type" => p.with_type(s()),
        "user_id" => p.with_user_id(s()),
        "app_id" => p.with_app_id(s()),
        "cluster_id" => p.with_cluster_id(s()),
        _ => p,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn link(extra: Value) -> Link {
        let mut v = json!({"src-uri": "amqp://u:secret@h/", "src-queue": "a",
                           "dest-uri": "amqp://", "dest-queue": "b"});
        for (k, x) in extra.as_object().into_iter().flatten() {
            v[k] = x.clone();
        }
        let cfg = ShovelConfig::parse("s", &v).expect("valid");
        let id = Identity {
            name: "s".into(),
            vhost: "/".into(),
            node: "warren@h".into(),
            kind: crate::shovel::Kind::Dynamic,
        };
        Link::new(Arc::new(cfg), id)
    }

    fn incoming(p: &BasicProperties) -> Incoming<'_> {
        Incoming {
            exchange: "x",
            routing_key: "k",
            properties: p,
        }
    }

    #[test]
    fn queue_length_counts_at_first_start_and_survives_reconnects() {
        let mut l = link(json!({"src-delete-after": "queue-length"}));
        l.started(2);
        let p = BasicProperties::default();
        assert!(matches!(
            l.accept(&incoming(&p), 0),
            Decision::Publish { .. }
        ));
        l.disconnected();
        l.started(9);
        assert!(matches!(
            l.accept(&incoming(&p), 0),
            Decision::Publish { .. }
        ));
        assert!(matches!(
            l.accept(&incoming(&p), 0),
            Decision::Publish { .. }
        ));
        assert_eq!(l.accept(&incoming(&p), 0), Decision::Return);
        assert!(!l.done());
        l.settled();
        l.settled();
        assert!(l.done());
        assert_eq!(l.moved(), 2);
    }

    #[test]
    fn forward_headers_as_rabbitmq_writes_them() {
        let mut l = link(json!({"dest-add-forward-headers": true,
                                "dest-add-timestamp-header": true,
                                "dest-publish-properties": {"delivery_mode": 2}}));
        l.started(0);
        let p = BasicProperties::default();
        let Decision::Publish {
            exchange,
            routing_key,
            properties,
        } = l.accept(&incoming(&p), 1_796_161_083)
        else {
            panic!("publishes");
        };
        assert_eq!((exchange.as_str(), routing_key.as_str()), ("", "b"));
        assert_eq!(properties.delivery_mode(), &Some(2));
        let h = properties.headers().clone().expect("headers");
        assert_eq!(
            h.inner().get("x-shovelled-timestamp"),
            Some(&AMQPValue::LongLongInt(1_796_161_083))
        );
        let Some(AMQPValue::FieldArray(a)) = h.inner().get("x-shovelled") else {
            panic!("x-shovelled is an array");
        };
        let Some(AMQPValue::FieldTable(t)) = a.as_slice().first() else {
            panic!("of tables");
        };
        let keys: Vec<&str> = t.inner().keys().map(ShortString::as_str).collect();
        assert_eq!(
            keys,
            [
                "dest-queue",
                "dest-uri",
                "shovel-name",
                "shovel-type",
                "shovel-vhost",
                "shovelled-by",
                "src-queue",
                "src-uri"
            ]
        );
        assert_eq!(t.inner().get("src-uri"), Some(&long("amqp://h/")));
    }
}
