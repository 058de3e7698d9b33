//! Queue types (`x-queue-type`) and their capabilities: the vocabulary of the queue-type
//! seam that topology, the mail and the listings share. The behaviour a type implements is
//! `queue::kind::QueueBehaviour`.

use crate::message::FieldTable;
use crate::queue_args::ArgError;

/// A queue's type, as `x-queue-type` names it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum QueueType {
    /// RabbitMQ's classic queue: FIFO (by priority with `x-max-priority`), destructive
    /// reads, messages paged to the store past a window.
    #[default]
    Classic,
    /// RabbitMQ's stream: an append-only log that consumers read from any offset without
    /// removing anything (`queue::stream`); durable only, read with a prefetch.
    Stream,
    /// RabbitMQ's quorum queue: durable only, every message stored and confirmed after
    /// the sync, delivery counts with `x-delivery-limit`; its state moves by the commands
    /// of `queue::quorum` (a Raft log's entries once it is replicated; a group of one on a
    /// single node).
    Quorum,
    /// The queue of the QoS 0 subscribers of MQTT clean sessions (RabbitMQ's
    /// `rabbit_mqtt_qos0_queue`): while none waits in it, a routed message goes at once to
    /// a no-ack consumer with write-window credit (no enqueue, no settle); otherwise it
    /// waits as in a classic queue (publishers paused past `flow_ready_high`) up to twice
    /// that, and beyond is dropped and counted (at most once, as MQTT allows for QoS 0).
    /// Transient and no-ack only.
    MqttQos0,
}

/// What the rest of the broker may rely on for a queue type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Capabilities {
    /// `basic.get` is served (a stream refuses it, as RabbitMQ does).
    pub basic_get: bool,
    /// An ack removes the message from the queue; otherwise it only returns the consumer's
    /// credit (a stream's consumers read a log that stays).
    pub ack_removes: bool,
    /// A nack or reject with requeue puts the message back for another delivery.
    pub requeue: bool,
    /// The queue must be declared durable (406 otherwise: streams and quorum queues).
    pub durable_only: bool,
    /// The queue may be exclusive to its declaring connection.
    pub exclusive: bool,
    /// A consumer must set a prefetch (`basic.qos`) first (streams).
    pub needs_prefetch: bool,
    /// The queue may be auto-delete (406 otherwise: quorum queues).
    pub auto_delete: bool,
    /// The server may name the queue (`queue.declare` with an empty name).
    pub server_named: bool,
    /// A consumer may share its channel's global prefetch (`basic.qos` global) with it;
    /// otherwise consuming on such a channel closes the connection with 540, as in
    /// RabbitMQ.
    pub global_qos: bool,
    /// The queue may not be durable (406 otherwise: `mqtt-qos0` queues keep nothing).
    pub transient_only: bool,
    /// Its consumers must not ask for acks (406 otherwise: a `mqtt-qos0` queue keeps no
    /// message to redeliver).
    pub no_ack_only: bool,
    /// Queue arguments RabbitMQ knows that this type refuses (406 "invalid arg ... of queue
    /// type ..."); arguments nobody knows are ignored, as RabbitMQ ignores them.
    pub refused_arguments: &'static [&'static str],
}

impl QueueType {
    /// The types Warren will know, with whether it serves them yet: a declare of a type
    /// listed but not served is refused with a message that says so.
    const NAMED: &'static [(&'static str, Option<QueueType>)] = &[
        ("classic", Some(QueueType::Classic)),
        ("quorum", Some(QueueType::Quorum)),
        ("stream", Some(QueueType::Stream)),
        ("mqtt-qos0", Some(QueueType::MqttQos0)),
    ];

    /// The type `x-queue-type` in `arguments` asks for (classic when absent). A type Warren
    /// does not have is an error for a 406: RabbitMQ's text for a type it does not know, a
    /// plain one for quorum and stream queues, which Warren does not have yet. A client
    /// that asked for their semantics (delivery limits, replicated logs, non-destructive
    /// reads) must not silently get a classic queue.
    pub fn from_arguments(arguments: &FieldTable) -> Result<QueueType, ArgError> {
        let Some(v) = arguments.get("x-queue-type") else {
            return Ok(QueueType::Classic);
        };
        let name = crate::queue_args::string("x-queue-type", v)?;
        match Self::NAMED.iter().find(|(n, _)| *n == name) {
            Some((_, Some(kind))) => Ok(*kind),
            Some((kind, None)) => Err((
                "x-queue-type",
                format!("\"queue type '{kind}' is not supported yet by Warren; use 'classic'\""),
            )),
            None => Err((
                "x-queue-type",
                format!("\"unsupported queue type '{name}'\""),
            )),
        }
    }

    /// Its `x-queue-type` name.
    pub fn name(self) -> &'static str {
        match self {
            QueueType::Classic => "classic",
            QueueType::Stream => "stream",
            QueueType::Quorum => "quorum",
            QueueType::MqttQos0 => "mqtt-qos0",
        }
    }

    /// RabbitMQ's module for the type, as its errors name it ("... of queue type
    /// rabbit_quorum_queue").
    pub fn module(self) -> &'static str {
        match self {
            QueueType::Classic => "rabbit_classic_queue",
            QueueType::Stream => "rabbit_stream_queue",
            QueueType::Quorum => "rabbit_quorum_queue",
            QueueType::MqttQos0 => "rabbit_mqtt_qos0_queue",
        }
    }

    /// What the rest of the broker may rely on for this type.
    pub fn capabilities(self) -> &'static Capabilities {
        match self {
            QueueType::Classic => &CLASSIC,
            QueueType::Stream => &STREAM,
            QueueType::Quorum => &QUORUM,
            QueueType::MqttQos0 => &MQTT_QOS0,
        }
    }
}

const CLASSIC: Capabilities = Capabilities {
    basic_get: true,
    ack_removes: true,
    requeue: true,
    durable_only: false,
    exclusive: true,
    needs_prefetch: false,
    auto_delete: true,
    server_named: true,
    global_qos: true,
    transient_only: false,
    no_ack_only: false,
    refused_arguments: &[],
};

/// A queue that delivers at once, holds a bounded backlog and drops beyond it: arguments
/// about what a queue holds (length, TTL, dead letters, priorities) are refused.
const MQTT_QOS0: Capabilities = Capabilities {
    basic_get: false,
    ack_removes: true,
    requeue: false,
    durable_only: false,
    exclusive: true,
    needs_prefetch: false,
    auto_delete: true,
    server_named: true,
    global_qos: true,
    transient_only: true,
    no_ack_only: true,
    refused_arguments: &[
        "x-message-ttl",
        "x-dead-letter-exchange",
        "x-dead-letter-routing-key",
        "x-max-length",
        "x-max-length-bytes",
        "x-overflow",
        "x-max-priority",
        "x-queue-mode",
        "x-single-active-consumer",
        "x-delivery-limit",
    ],
};

/// RabbitMQ 3.10's quorum queue (`rabbit_quorum_queue:capabilities/0`, checked against
/// 3.10.8): the arguments RabbitMQ knows that a quorum queue refuses. `x-message-ttl` is
/// allowed since 3.10; `x-overflow: reject-publish-dlx` is taken and acts as drop-head.
const QUORUM: Capabilities = Capabilities {
    basic_get: true,
    ack_removes: true,
    requeue: true,
    durable_only: true,
    exclusive: false,
    needs_prefetch: false,
    auto_delete: false,
    server_named: false,
    global_qos: false,
    transient_only: false,
    no_ack_only: false,
    refused_arguments: &[
        "x-max-priority",
        "x-queue-mode",
        "x-queue-version",
        "x-queue-master-locator",
        "x-max-age",
        "x-stream-max-segment-size-bytes",
        "x-initial-cluster-size",
    ],
};

/// RabbitMQ 3.10's stream (`rabbit_stream_queue:capabilities/0`, checked against 3.10.8):
/// the arguments of other types it refuses; its own (`x-max-length-bytes`, `x-max-age`,
/// `x-stream-max-segment-size-bytes`) are read by `queue::stream::settings`.
const STREAM: Capabilities = Capabilities {
    basic_get: false,
    ack_removes: false,
    requeue: false,
    durable_only: true,
    exclusive: false,
    needs_prefetch: true,
    auto_delete: false,
    server_named: false,
    // RabbitMQ refuses a stream consumer on a channel with a global prefetch as well.
    global_qos: false,
    transient_only: false,
    no_ack_only: false,
    refused_arguments: &[
        "x-expires",
        "x-message-ttl",
        "x-dead-letter-exchange",
        "x-dead-letter-routing-key",
        "x-max-length",
        "x-max-in-memory-length",
        "x-max-in-memory-bytes",
        "x-overflow",
        "x-max-priority",
        "x-queue-mode",
        "x-queue-version",
        "x-single-active-consumer",
        "x-delivery-limit",
        "x-dead-letter-strategy",
        "x-queue-master-locator",
    ],
};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::FieldValue;

    #[test]
    fn classic_quorum_and_stream_queues_are_served() {
        let with = |v: FieldValue| {
            let mut t = FieldTable::default();
            t.insert("x-queue-type".into(), v);
            QueueType::from_arguments(&t)
        };
        assert_eq!(
            QueueType::from_arguments(&FieldTable::default()),
            Ok(QueueType::Classic)
        );
        assert_eq!(with(FieldValue::string("classic")), Ok(QueueType::Classic));
        assert_eq!(with(FieldValue::string("quorum")), Ok(QueueType::Quorum));
        assert_eq!(with(FieldValue::string("stream")), Ok(QueueType::Stream));
        let stream = QueueType::Stream.capabilities();
        assert!(!stream.basic_get && !stream.ack_removes && stream.durable_only);
        assert!(stream.needs_prefetch && !stream.exclusive && !stream.auto_delete);
        assert!(stream.refused_arguments.contains(&"x-max-length"));
        assert_eq!(QueueType::Stream.name(), "stream");
        assert_eq!(QueueType::Stream.module(), "rabbit_stream_queue");
        assert_eq!(
            with(FieldValue::string("bogus")),
            Err(("x-queue-type", "\"unsupported queue type 'bogus'\"".into()))
        );
        assert_eq!(
            with(FieldValue::I32(1)),
            Err(("x-queue-type", "{unacceptable_type,long}".into()))
        );
        assert_eq!(QueueType::Classic.name(), "classic");
        assert!(QueueType::Classic.capabilities().basic_get);
        let quorum = QueueType::Quorum.capabilities();
        assert_eq!(QueueType::Quorum.name(), "quorum");
        assert!(quorum.durable_only && !quorum.exclusive && !quorum.auto_delete);
        assert!(quorum.refused_arguments.contains(&"x-max-priority"));
    }
}
