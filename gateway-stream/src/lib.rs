//! `warren-stream`: RabbitMQ's stream protocol (the binary protocol of
//! `rabbitmq_stream`, default port 5552), sans-IO.
//!
//! Code map: `frame` (keys, response codes, frame splitting, bounds-checked reader),
//! `codec` (every command as a value, encode/decode), `chunk` (osiris's chunk layout that
//! Deliver carries), `backend` (the [`StreamBackend`] trait: what a session needs from the
//! broker), `memory` ([`MemoryBackend`], an in-memory log behind it), `session` (the sans-IO
//! state machine of one connection), `connection` (its tokio shell), `server` (TCP accept
//! loop).

pub mod backend;
pub mod chunk;
pub mod codec;
pub mod connection;
pub mod frame;
pub mod memory;
pub mod server;
pub mod session;

pub use backend::{PeerInfo, StreamBackend};
pub use memory::MemoryBackend;
pub use server::{serve, serve_with};
pub use session::{Session, StreamConfig};
