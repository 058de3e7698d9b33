//! `warren-amqp`: the AMQP 0.9.1 gateway. Wire-compatible with RabbitMQ's clients; all broker
//! semantics live in `warren-core`, this crate only speaks the protocol.
//!
//! Code map: `codec` (framing), `session` (the sans-IO protocol state machine of one
//! connection: bytes, effects and time in; bytes, ops, login checks and a deadline out;
//! `session::effects`: core effects -> frames), with
//! its parts `handshake` (start/tune/open), `channels` (the channel table and what arrives on
//! channels), `content` (frame assembly of published messages), `confirms` (publisher
//! confirms out, ack collapsing), `heartbeat` (heartbeats as deadlines); `connection` (the
//! tokio shell of one connection), `methods` (AMQP methods <-> core ops and replies),
//! `convert` (field tables and properties), `auth` (PLAIN, AMQPLAIN), `server` (TCP accept
//! loop), `spec` (the method table: why a method frame did not decode), `config`, `error`.

pub mod auth;
mod channels;
pub mod codec;
pub mod config;
mod confirms;
pub mod connection;
mod content;
pub mod convert;
pub mod error;
pub mod handshake;
mod heartbeat;
pub mod methods;
pub mod server;
pub mod session;
pub mod spec;

pub use config::AmqpConfig;
pub use connection::{PeerInfo, serve_connection};
pub use server::serve;
pub use session::{Ended, Session};
