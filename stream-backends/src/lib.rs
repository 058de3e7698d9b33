//! `warren-stream-backends`: the stream protocol's back ends, where the gateway
//! (`warren-stream`) meets the broker and the store. The gateway must not depend on the store,
//! so the join lives here and the binary only composes it, as RabbitMQ's stream plugin talks
//! to osiris directly.
//!
//! Code map: `disk` ([`DiskStreams`], the native stream log under a data directory, also the
//! store's [`warren_store::StreamHost`]), `memory` ([`MemStreams`], `--in-memory`'s logs,
//! also the core's [`warren_core::store::SharedStreams`]), `broker` (what both ask of the
//! broker: logins, each stream's AMQP queue), `super_streams` (super streams over the
//! topology, for both).

mod broker;
pub mod disk;
pub mod memory;
mod super_streams;

pub use disk::DiskStreams;
pub use memory::MemStreams;
