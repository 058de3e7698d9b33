//! `warren-amqp10`: the AMQP 1.0 gateway (OASIS AMQP 1.0, as RabbitMQ 4 serves it).
//! Sans-IO like `warren-amqp`: this crate turns bytes into typed frames and back.
//!
//! Code map: `types` (the type system: every primitive in every width, described types,
//! lists, maps, arrays) and `descriptor` (the spec's descriptor codes and names), both from
//! `warren_core::amqp10`, `performatives`
//! (open ... close, SASL frames, error, source, target, delivery states as structs), `frame`
//! (frame layout, protocol headers). Message sections (header, properties, application
//! properties, data...) are `warren_core::amqp10`'s: streams already store messages in
//! AMQP 1.0's encoding, so a transfer's payload is that same byte format.

pub mod address;
pub mod connection;
pub mod dispatch;
pub mod frame;
pub mod management;
pub mod pairs;
pub mod performatives;
pub mod sasl;
pub mod session;
/// The type system and descriptor codes live in the core, which decodes stream messages
/// with them too: one AMQP 1.0 decoder in the broker.
pub use warren_core::amqp10::{descriptor, types};

pub use connection::PeerInfo;
pub use dispatch::dispatch;
pub use frame::{Body, FrameError, RawFrame, decode_frame, encode_frame};
pub use performatives::{Performative, Sasl};
pub use types::{DecodeError, EncodeError, Value};
