//! One connection's record on the channel side: its channels, exclusive queues, flow
//! control and write credit, its vhost and permissions.

use crate::ids::{QueueId, VhostId};
use crate::mail::credit::Counter;
use crate::sorted_vec::SortedSet;
use std::sync::Arc;

/// A connection, as the channel side holds it.
pub(crate) struct Conn {
    pub(crate) cancel_notify: bool,
    pub(crate) channels: SortedSet<u16>,
    pub(crate) exclusive_queues: SortedSet<QueueId>,
    /// Deliveries handed to the host and not yet reported written (`Op::Written`).
    pub(crate) in_flight: Counter,
    /// Consumers on this connection's channels: a connection with any is never paused.
    pub(crate) consumers: u32,
    /// Queues currently pausing this connection (flow control).
    pub(crate) paused_in: SortedSet<QueueId>,
    pub(crate) vhost: VhostId,
    /// What the user may do in the vhost (it names the user too); `None` for the broker's
    /// internal connection (restore, admin), which may do anything.
    pub(crate) perms: Option<Arc<crate::access::Permissions>>,
    /// The client identifier the host gave (`Op::ClientId`: MQTT's), which expands
    /// `{client_id}` in topic permissions.
    pub(crate) client_id: Option<Arc<str>>,
    /// The routing table's version after this connection's last routing change: its
    /// pre-routed publishes must come from a snapshot at least this new (`Publish::routed`).
    pub(crate) routes_seen: u64,
    /// The message counts of its closed channels.
    pub(crate) closed_stats: crate::stats::MessageStats,
}

impl Conn {
    /// The user the connection logged in as (`""` for the internal connection).
    pub(crate) fn user(&self) -> &str {
        self.perms.as_ref().map_or("", |p| p.def.user.as_str())
    }
}
