//! Identifiers. All are plain integers chosen by the core or the host, never pointers, so the
//! effect stream is identical natively and in WebAssembly.

/// A client connection, numbered by the host (gateway). Unique for the broker's lifetime.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnId(pub u64);

/// A channel of a connection: AMQP's channel number, or 1 for an MQTT session.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChannelRef {
    /// The connection.
    pub conn: ConnId,
    /// The channel number (0: the connection itself).
    pub channel: u16,
}

impl ChannelRef {
    /// Channel `channel` of connection `conn`.
    pub const fn new(conn: ConnId, channel: u16) -> ChannelRef {
        ChannelRef { conn, channel }
    }
}

/// A channel as mail and credit address it: its number, and which opening of that number
/// (`ChannelState::serial`). A client may close a channel and open the same number again
/// while mail for the old one travels; the serial tells the two apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ChannelAddr {
    pub(crate) ch: ChannelRef,
    pub(crate) serial: u32,
}

/// A queue. Never reused, so a stale id (an unacked delivery of a deleted queue) cannot alias a
/// newer queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct QueueId(pub u64);

/// A vhost. Never reused, so a connection of a deleted vhost cannot reach its successor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct VhostId(pub u64);

/// An exchange. Never reused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ExchangeId(pub u64);

/// Where a binding leads: a queue or (exchange-to-exchange binding) another exchange.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Destination {
    /// A queue.
    Queue(QueueId),
    /// An exchange (exchange-to-exchange bindings).
    Exchange(ExchangeId),
}
