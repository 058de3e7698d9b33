//! Protocol-agnostic MQTT pieces: topic and filter rules, the MQTT <-> AMQP topic mapping, and
//! the retained-message store. Pure data structures with no I/O, so the native MQTT gateway and
//! the wasm JS API share them.

pub mod retained;
pub mod session;
pub mod topic;

pub use retained::{RetainedMessage, RetainedStore};
pub use session::{StoredSession, StoredSub, StoredWill};
pub use topic::{
    FilterError, TopicError, amqp_key_to_topic, filter_to_amqp_pattern, matches, topic_to_amqp_key,
    validate_filter, validate_topic, with_swapped,
};
