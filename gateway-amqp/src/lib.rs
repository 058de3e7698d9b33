//! `warren-amqp`: the AMQP 0.9.1 gateway. Wire-compatible with RabbitMQ's clients; all broker
//! semantics live in `warren-core`, this crate only speaks the protocol.
//!
//! Code map: `codec` (framing), `handshake` (start/tune/open), `connection` (the
//! per-connection task), `methods` (AMQP methods <-> core ops and replies), `convert`
//! (field tables and properties), `auth` (PLAIN, AMQPLAIN), `server` (TCP accept loop),
//! `spec` (the method table: why a method frame did not decode),
//! `config`, `error`.

pub mod auth;
pub mod codec;
pub mod config;
pub mod connection;
pub mod convert;
pub mod error;
pub mod handshake;
pub mod methods;
pub mod server;
pub mod spec;

pub use config::AmqpConfig;
pub use connection::{PeerInfo, serve_connection};
pub use server::serve;
