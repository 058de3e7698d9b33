//! Retained messages (MQTT 3.3.1.3): the last retained PUBLISH per topic, per vhost, handed to
//! every new subscription whose filter matches, wildcard filters included.

use super::topic::matches;
use crate::message::Properties;
use bytes::Bytes;
use std::collections::BTreeMap;
use std::sync::Arc;

/// One retained message. `stored_at` and `expiry_ms` let readers decrement the MQTT 5 message
/// expiry interval and drop expired messages without a timer.
#[derive(Clone, Debug, PartialEq)]
pub struct RetainedMessage {
    /// The topic it was published to.
    pub topic: Arc<str>,
    /// Its QoS.
    pub qos: u8,
    /// Its payload.
    pub payload: Bytes,
    /// Its properties (MQTT 5).
    pub properties: Properties,
    /// When it was stored (host ms).
    pub stored_at: u64,
    /// Its message expiry interval, if any (ms).
    pub expiry_ms: Option<u64>,
}

impl RetainedMessage {
    /// Whether the message has outlived its expiry interval at `now` (ms).
    pub fn expired(&self, now: u64) -> bool {
        self.expiry_ms
            .is_some_and(|e| now >= self.stored_at.saturating_add(e))
    }
}

/// Retained messages of all vhosts. `BTreeMap`s so that lookups return messages in topic order,
/// deterministically.
#[derive(Debug, Default)]
pub struct RetainedStore {
    vhosts: BTreeMap<String, BTreeMap<Arc<str>, RetainedMessage>>,
    bytes: usize,
}

impl RetainedStore {
    /// No retained messages.
    pub fn new() -> RetainedStore {
        RetainedStore::default()
    }

    /// Stores `msg` for its topic, replacing the previous one; an empty payload clears the
    /// topic instead (MQTT-3.3.1-10/11).
    pub fn set(&mut self, vhost: &str, msg: RetainedMessage) {
        let topics = self.vhosts.entry(vhost.to_string()).or_default();
        if let Some(old) = topics.remove(&msg.topic) {
            self.bytes -= old.payload.len();
        }
        if !msg.payload.is_empty() {
            self.bytes += msg.payload.len();
            topics.insert(msg.topic.clone(), msg);
        }
        if topics.is_empty() {
            self.vhosts.remove(vhost);
        }
    }

    /// The unexpired retained messages whose topics `filter` (a plain, valid MQTT filter)
    /// matches, in topic order. Expired ones are removed on the way.
    pub fn matching(&mut self, vhost: &str, filter: &str, now: u64) -> Vec<RetainedMessage> {
        let Some(topics) = self.vhosts.get_mut(vhost) else {
            return Vec::new();
        };
        let mut expired = 0;
        topics.retain(|_, m| {
            let keep = !m.expired(now);
            if !keep {
                expired += m.payload.len();
            }
            keep
        });
        self.bytes -= expired;
        let mut out = Vec::new();
        // Without wildcards the filter is one topic: a map lookup, not a scan.
        if !filter.contains(['+', '#']) {
            if let Some(m) = topics.get(filter) {
                out.push(m.clone());
            }
            return out;
        }
        out.extend(
            topics
                .values()
                .filter(|m| matches(filter, &m.topic))
                .cloned(),
        );
        out
    }

    /// Retained messages in all vhosts.
    pub fn len(&self) -> usize {
        self.vhosts.values().map(BTreeMap::len).sum()
    }

    /// No retained messages.
    pub fn is_empty(&self) -> bool {
        self.vhosts.is_empty()
    }

    /// Payload bytes held.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(topic: &str, payload: &str) -> RetainedMessage {
        RetainedMessage {
            topic: Arc::from(topic),
            qos: 1,
            payload: Bytes::copy_from_slice(payload.as_bytes()),
            properties: Properties::default(),
            stored_at: 0,
            expiry_ms: None,
        }
    }

    #[test]
    fn set_replace_clear() {
        let mut s = RetainedStore::new();
        s.set("/", msg("a/b", "1"));
        s.set("/", msg("a/b", "22"));
        s.set("/", msg("a/c", "3"));
        s.set("other", msg("a/b", "x"));
        assert_eq!(s.len(), 3);
        assert_eq!(s.bytes(), 4);
        let got = s.matching("/", "a/+", 0);
        assert_eq!(
            got.iter().map(|m| &m.payload[..]).collect::<Vec<_>>(),
            [&b"22"[..], b"3"]
        );
        assert_eq!(s.matching("/", "a/b", 0).len(), 1);
        s.set("/", msg("a/b", ""));
        assert_eq!(s.matching("/", "#", 0).len(), 1);
        assert_eq!(s.bytes(), 2);
    }

    #[test]
    fn dollar_topics_and_expiry() {
        let mut s = RetainedStore::new();
        s.set("/", msg("$SYS/x", "1"));
        assert!(s.matching("/", "#", 0).is_empty());
        assert_eq!(s.matching("/", "$SYS/#", 0).len(), 1);
        let mut m = msg("t", "v");
        m.stored_at = 100;
        m.expiry_ms = Some(50);
        s.set("/", m);
        assert_eq!(s.matching("/", "t", 149).len(), 1);
        assert!(s.matching("/", "t", 150).is_empty());
        assert_eq!(s.len(), 1);
    }
}
