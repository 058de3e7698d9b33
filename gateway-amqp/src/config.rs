//! Settings of the AMQP listener: what the server proposes in `connection.tune` and enforces.

use std::time::Duration;

#[derive(Clone, Debug)]
pub struct AmqpConfig {
    /// Largest frame the server accepts and proposes (RabbitMQ's default, 128 KiB).
    pub frame_max: u32,
    /// Highest channel number a client may open.
    pub channel_max: u16,
    /// Proposed heartbeat interval; 0 disables heartbeats.
    pub heartbeat_secs: u16,
    /// Largest message body accepted (RabbitMQ's default, 128 MiB).
    pub max_message_size: u64,
    /// Time a client has to complete the handshake up to `connection.open`.
    pub handshake_timeout: Duration,
}

impl Default for AmqpConfig {
    fn default() -> AmqpConfig {
        AmqpConfig {
            frame_max: 131_072,
            channel_max: 2047,
            heartbeat_secs: 60,
            max_message_size: 128 * 1024 * 1024,
            handshake_timeout: Duration::from_secs(10),
        }
    }
}

/// The smallest frame_max AMQP allows a peer to negotiate.
pub const FRAME_MIN_SIZE: u32 = 4096;
