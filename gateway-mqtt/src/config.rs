//! Gateway limits.

use std::sync::Arc;
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
    /// Retained messages sent on one SUBSCRIBE at most.
    pub max_retained_per_subscribe: usize,
    /// Messages a persistent session's queue keeps while its client is away; the oldest are
    /// dropped beyond it (Mosquitto's `max_queued_messages`). Applied by the host as a policy
    /// on the session queues (`offline_policy`), so operators can see and override it.
    pub max_offline_messages: u64,
    /// On a TLS listener that verified the client's certificate: its subject CN is the user
    /// name and no password is checked (Mosquitto's `use_identity_as_username`).
    pub use_identity_as_username: bool,
    /// How often the `$SYS/broker/...` topics are published (Mosquitto's `sys_interval`);
    /// `None` disables them.
    pub sys_interval: Option<Duration>,
    /// Not a setting: the tab links' dedup windows (`link_dedup`), shared by every listener
    /// that clones this config.
    pub link_dedup: Arc<crate::link_dedup::LinkDedup>,
}

/// The name of the policy bounding offline session queues.
pub const OFFLINE_POLICY: &str = "mqtt-offline-limit";
/// The session queues' names start with this.
pub const SESSION_QUEUE_PREFIX: &str = "mqtt-subscription-";

impl MqttConfig {
    /// The policy that bounds persistent sessions' queues (lowest priority: an operator's own
    /// policy for these queues wins).
    pub fn offline_policy(&self) -> warren_core::policy::PolicyDef {
        let mut definition = warren_core::message::FieldTable::new();
        definition.insert(
            "max-length".into(),
            warren_core::message::FieldValue::I64(
                i64::try_from(self.max_offline_messages).unwrap_or(i64::MAX),
            ),
        );
        warren_core::policy::PolicyDef {
            vhost: self.vhost.clone(),
            name: OFFLINE_POLICY.into(),
            pattern: format!("^{SESSION_QUEUE_PREFIX}"),
            apply_to: warren_core::policy::ApplyTo::Queues,
            priority: -1000,
            definition,
        }
    }
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
            max_offline_messages: 100_000,
            use_identity_as_username: false,
            // Mosquitto's default. The broker's own publishes are not counted in the message
            // stats (`AdminRequest::StatusPublish`).
            sys_interval: Some(Duration::from_secs(10)),
            link_dedup: Arc::default(),
        }
    }
}
