//! Gateway limits.

use std::time::Duration;

#[derive(Clone, Debug)]
pub struct MqttConfig {
    /// Largest packet accepted (announced as Maximum Packet Size in v5 CONNACK).
    pub max_packet_size: u32,
    /// How long a socket may take to send CONNECT.
    pub connect_timeout: Duration,
    /// QoS 1/2 messages in flight per direction: the prefetch of a session's queue towards the
    /// client and the Receive Maximum announced to v5 clients.
    pub max_inflight: u16,
    /// Topic aliases a v5 client may use towards the server.
    pub topic_alias_max: u16,
    /// When set, clients asking for a longer (or no) keep-alive get this one (v5: Server Keep
    /// Alive; v3 clients are not told and are held to their own value).
    pub server_keep_alive: Option<u16>,
    /// The vhost MQTT sessions live in.
    pub vhost: String,
    /// Messages a persistent session's queue keeps while the client is away is unbounded
    /// in the core today (queue length limits are not implemented yet); this caps retained
    /// messages sent on one SUBSCRIBE instead.
    pub max_retained_per_subscribe: usize,
}

impl Default for MqttConfig {
    fn default() -> MqttConfig {
        MqttConfig {
            max_packet_size: 16 << 20,
            connect_timeout: Duration::from_secs(10),
            max_inflight: 1024,
            topic_alias_max: 64,
            server_keep_alive: None,
            vhost: "/".to_string(),
            max_retained_per_subscribe: 10_000,
        }
    }
}
