//! `warren-mqtt`: the MQTT 3.1, 3.1.1 and 5.0 gateway over `warren-core`.
//!
//! Code map: `codec` (framing over `mqtt-proto`, v3 <-> v5 bridge), `session` (the sans-IO
//! protocol state machine of one connection), `convert` (MQTT publish <-> core message),
//! `connection` (the tokio shell of one connection), `record` (a persistent
//! session while its client is away), `registry` (client ids, offline sessions, retained
//! messages), `server` (TCP accept loop), `sys` (`$SYS/broker` topics), `link_dedup` (tab
//! links' resends dropped), `config`, `error`.

pub mod codec;
pub mod config;
pub mod connection;
pub mod convert;
pub mod error;
pub mod link_dedup;
pub mod record;
pub mod registry;
pub mod server;
pub mod session;
pub mod sys;

pub use config::MqttConfig;
pub use connection::{PeerInfo, serve_connection};
pub use registry::Registry;
pub use server::{serve, serve_with, start_session_tasks};
