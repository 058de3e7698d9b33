//! What an MQTT session keeps between connections, in protocol-neutral types: the gateway
//! builds it from its session state and a host may store it (natively, the definitions store's
//! `mqtt_sessions` table; docs/storage.md) so sessions survive a broker restart. The messages
//! of a session are not here: they wait in the session's durable core queue.

use bytes::Bytes;

/// One subscription of a stored session.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredSub {
    /// The MQTT filter as the client sent it (`$share/{group}/...` included).
    pub filter: String,
    /// Maximum QoS granted (0..=2).
    pub qos: u8,
    /// MQTT 5 no-local: the session's own publishes are not delivered to it.
    pub no_local: bool,
    /// MQTT 5 retain-as-published.
    pub retain_as_published: bool,
    /// Retain Handling (0..=2) as subscribed.
    pub retain_handling: u8,
    /// Subscription Identifier (MQTT 5).
    pub id: Option<u32>,
}

/// A will waiting for its delay (MQTT 5 Will Delay Interval) when the session was stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredWill {
    /// Unix ms at which it is due.
    pub due_at: u64,
    /// The user its publish runs as.
    pub user: String,
    /// The will as an encoded MQTT 5 PUBLISH packet (topic, QoS, retain, payload, properties),
    /// so its format is the protocol's own.
    pub publish: Bytes,
}

/// A session as stored.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StoredSession {
    /// MQTT protocol level of the connection that last had it (3, 4 or 5).
    pub level: u8,
    /// Session Expiry Interval in seconds (`u32::MAX`: never; 3.1.1 persistent sessions).
    pub expiry_s: u32,
    /// Unix ms at which the client went away and the expiry began counting; `None` while a
    /// client is connected (after a crash the count begins at the restart).
    pub disconnected_at: Option<u64>,
    /// Whether the session's durable queue exists.
    pub has_queue: bool,
    /// Its subscriptions.
    pub subs: Vec<StoredSub>,
    /// Outbound QoS 2 packet ids that got PUBREC but no PUBCOMP (PUBREL is resent).
    pub awaiting_comp: Vec<u16>,
    /// Inbound QoS 2 packet ids routed but not yet released by PUBREL.
    pub inbound_qos2: Vec<u16>,
    /// Packet ids of outbound QoS 1/2 messages sent but not acknowledged, oldest first: the
    /// core requeues those messages in order, and they are resent under these ids.
    pub outbound: Vec<u16>,
    /// The will to publish when it ends, if any.
    pub will: Option<StoredWill>,
}

impl StoredSession {
    /// Unix ms at which the session expires, if it is counting and can expire.
    pub fn expires_at(&self) -> Option<u64> {
        if self.expiry_s == u32::MAX {
            return None;
        }
        self.disconnected_at
            .map(|at| at.saturating_add(u64::from(self.expiry_s) * 1000))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expiry_counts_from_disconnect_and_never_for_max() {
        let mut s = StoredSession {
            expiry_s: 10,
            ..StoredSession::default()
        };
        assert_eq!(s.expires_at(), None, "connected: not counting");
        s.disconnected_at = Some(1_000);
        assert_eq!(s.expires_at(), Some(11_000));
        s.expiry_s = u32::MAX;
        assert_eq!(s.expires_at(), None);
    }
}
