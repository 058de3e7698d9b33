//! Broker settings that change the core's behaviour.

/// Settings of one broker instance.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BrokerConfig {
    /// Seed for server-generated names (`amq.gen-...`, `amq.ctag-...`): the core's only
    /// source of "randomness", so runs are reproducible.
    pub seed: u64,
    /// Deliveries a connection may have handed to its host but not yet written to the socket
    /// (`Op::Written` returns them). Bounds each connection's outbound buffer whatever the
    /// consumers' prefetch: at 1 kB messages, 2048 deliveries is ~2 MB per connection at most.
    pub write_window: u32,
    /// The virtual host every connection gets for now.
    pub default_vhost: String,
    /// The user a new broker starts with (RabbitMQ's `default_user`), an administrator with
    /// full permissions on `default_vhost`; created on the first start only (a store keeps
    /// the users it holds). Only `guest` is limited to loopback.
    pub default_user: String,
    /// Its password hash ([`crate::access::hash_password`]; RabbitMQ's `default_pass`).
    pub default_pass_hash: Vec<u8>,
    /// Message bytes (bodies held ready or unacked, counted per queue) above which the broker
    /// raises its memory alarm and publishing connections are blocked, as RabbitMQ's
    /// `vm_memory_high_watermark` does. The host sizes it (the CLI: a fraction of RAM);
    /// the core cannot look at the machine.
    pub memory_high_watermark: u64,
    /// Free bytes on the host's data disk below which publishers are blocked, as RabbitMQ's
    /// `disk_free_limit` (default there 50 MB). 0: no limit. The host measures the free
    /// space and reports it (`Broker::report_resources`); the core cannot look at a disk.
    pub disk_free_limit: u64,
    /// Ready messages in a queue with consumers above which connections publishing into it
    /// (and consuming nothing themselves) are paused until it drains to half, where they
    /// resume a few at a time (`queue::state::RESUME_WAVE`, in pause order): paces
    /// publishers to their consumers, as RabbitMQ's credit flow does, so latency stays
    /// bounded. Connections that consume are never paused: pausing their reads would hold
    /// back the acks that drain queues.
    pub flow_ready_high: usize,
    /// Ready messages a queue keeps in memory when the broker has a store; the rest wait in
    /// the store and are read back in batches of this size (RabbitMQ's CQv2 keeps at most
    /// 2048). At 1 kB messages that is ~2 MB per busy queue.
    pub queue_window: usize,
    /// Body bytes a queue keeps in memory when the broker has a store (the window's other
    /// bound, for big messages): 8 MiB.
    pub queue_window_bytes: u64,
    /// With a store: the longest a removal (ack, basic.get without ack, purge, drop,
    /// queue deletion) waits for a sync when nothing else starts one. Persistent publishes
    /// start a sync at once (their confirms wait for it); removals confirm nothing, so they
    /// ride on the next sync, and this bounds how long that may take: after a `kill -9`
    /// at most the removals of the last `removal_sync_ms` come back, and dead space in the
    /// store is reclaimed at that pace too. 200 ms is RabbitMQ's queue sync interval
    /// (`rabbit_amqqueue_process`, `SYNC_INTERVAL`); it costs an idle-publisher,
    /// busy-consumer broker at most 5 syncs a second.
    pub removal_sync_ms: u64,
    /// MQTT retained messages a vhost holds at most (`Op::Retain`): beyond it a retained
    /// publish to a new topic is routed but not retained (a topic that has one may still
    /// replace it), as EMQX's `max_retained_messages`. Mosquitto has no bound and EMQX's
    /// is 0 (none) by default; unbounded, a client publishing to ever-new topics grows the
    /// broker's memory without limit, so 100,000 (the first EMQ retainer's default).
    pub max_retained_messages: usize,
    /// MQTT retained payload bytes a vhost holds at most: the other bound, for big
    /// payloads (a retained message that would exceed it is routed but not retained).
    /// 256 MiB.
    pub max_retained_bytes: u64,
}

impl Default for BrokerConfig {
    fn default() -> BrokerConfig {
        BrokerConfig {
            seed: 0x5741_5252_454e_0001,
            write_window: 2048,
            default_vhost: "/".to_string(),
            default_user: "guest".to_string(),
            default_pass_hash: crate::access::DEFAULT_GUEST_HASH.to_vec(),
            memory_high_watermark: u64::MAX,
            disk_free_limit: 0,
            flow_ready_high: 4096,
            queue_window: 2048,
            queue_window_bytes: 8 << 20,
            removal_sync_ms: 200,
            max_retained_messages: 100_000,
            max_retained_bytes: 256 << 20,
        }
    }
}
