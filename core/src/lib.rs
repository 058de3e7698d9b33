//! `warren-core`: Warren's broker as a sans-IO, deterministic state machine.
//!
//! Hosts feed it operations ([`command::Op`]) on channels together with the current time in
//! milliseconds, and drain the resulting [`effect::Effect`]s. It never does I/O, never reads a
//! clock, never draws randomness it was not seeded with, and never lets hash-map iteration
//! order reach its outputs: the same inputs give byte-identical effects natively and in
//! WebAssembly. See ARCHITECTURE.md for the code map and invariants.

#![warn(missing_docs, unreachable_pub)]

pub mod access;
pub mod admin;
pub mod amqp10;
pub(crate) mod channel;
pub mod command;
pub mod config;
pub mod effect;
pub mod error;
pub mod escape;
pub mod exchange;
pub mod idhash;
pub mod ids;
pub(crate) mod mail;
pub mod message;
pub mod mqtt;
pub mod naming;
pub mod op_kind;
pub mod parameter;
pub mod pmap;
pub mod policy;
pub mod queue;
pub mod queue_args;
pub mod queue_type;
pub mod routing;
pub(crate) mod schedule;
pub mod shard;
pub mod shards;
pub(crate) mod sorted_vec;
pub mod stats;
pub mod store;
pub(crate) mod topology;

pub use config::BrokerConfig;
/// The old path of the shard composition (`shard`), kept for hosts.
pub use shard as broker;
pub use shard::{
    Alarms, Broker, NodeChannel, NodeConsumer, NodeGot, NodeMail, NodeRequest, NodeSettle, Notice,
    Resources, ShardMail,
};
