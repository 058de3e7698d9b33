//! Protocol-agnostic MQTT pieces: topic and filter rules, the MQTT <-> AMQP topic mapping, and
//! the retained messages of a vhost (kept by topology). Pure data structures with no I/O, so the native MQTT gateway and
//! the wasm JS API share them.

/// The exchange MQTT topics map onto (as RabbitMQ's MQTT plugin): retained messages are
/// published through it, so `Op::Retain` needs write and `Op::RetainedGet` read access to it.
pub const EXCHANGE: &str = "amq.topic";

pub mod retained;
pub mod session;
pub mod topic;

pub use retained::{RetainOutcome, RetainedMessage, RetainedTopics};
pub use session::{StoredSession, StoredSub, StoredWill};
pub use topic::{
    FilterError, TopicError, amqp_key_to_topic, filter_to_amqp_pattern, matches, topic_to_amqp_key,
    validate_filter, validate_topic, with_swapped,
};
