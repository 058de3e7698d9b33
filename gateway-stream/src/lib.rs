//! `warren-stream`: RabbitMQ's stream protocol (the binary protocol of
//! `rabbitmq_stream`, default port 5552), sans-IO.
//!
//! Code map: `frame` (keys, response codes, frame splitting, bounds-checked reader),
//! `codec` (every command as a value, encode/decode), `chunk` (osiris's chunk layout that
//! Deliver carries), `backend` (the [`StreamBackend`] trait: what a session needs from the
//! broker), `memory` ([`MemoryBackend`], an in-memory log behind it), `session` (the sans-IO
//! state machine of one connection), `connection` (its tokio shell), `server` (TCP accept
//! loop), `sac` (single-active-consumer groups across connections), `tail` (a stream's committed tail and the one wait on it both backends use).

pub mod backend;
pub mod chunk;
pub mod codec;
pub mod connection;
pub mod frame;
pub mod memory;
pub mod sac;
pub mod server;
pub mod session;
pub mod tail;

pub use backend::{PeerInfo, StreamBackend};
pub use memory::MemoryBackend;
pub use server::{serve, serve_layered, serve_with};
pub use session::{Session, StreamConfig};
