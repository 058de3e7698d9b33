//! Retained messages (MQTT 3.3.1.3): the last retained PUBLISH per topic of one vhost, handed
//! to every new subscription whose filter matches, wildcard filters included. Topology keeps
//! one [`RetainedTopics`] per vhost (`Op::Retain`, `Op::RetainedGet`); this is the data
//! structure, with its bounds and MQTT 5 expiry.

use super::topic::matches;
use crate::message::Properties;
use bytes::Bytes;
use std::sync::Arc;

/// One retained message. `stored_at` and `expiry_ms` let readers decrement the MQTT 5 message
/// expiry interval and drop expired messages without a timer.
#[derive(Clone, Debug, PartialEq)]
pub struct RetainedMessage {
    /// The topic it was published to.
    pub topic: Arc<str>,
    /// Its QoS.
    pub qos: u8,
    /// Its payload (empty in an `Op::Retain`: clear the topic).
    pub payload: Bytes,
    /// Its properties (the core message's: MQTT 5 properties travel in headers).
    pub properties: Properties,
    /// When it was stored (host ms; the core sets it to the time of the `Op::Retain`).
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

/// What [`RetainedTopics::set`] did.
#[derive(Clone, Debug, PartialEq)]
pub enum RetainOutcome {
    /// The message is now the topic's (it replaced `replaced_durable`'s message, if any,
    /// stored or not).
    Stored {
        /// The topic's previous message was kept across restarts.
        replaced_durable: bool,
    },
    /// The topic's message was removed (an empty payload); `durable`: it was kept across
    /// restarts, so the store must forget it too.
    Cleared {
        /// The removed message was kept across restarts.
        durable: bool,
    },
    /// An empty payload for a topic with no message: nothing to do.
    Unchanged,
    /// Over the vhost's bound (`BrokerConfig::max_retained_messages` or
    /// `max_retained_bytes`): not retained (the publish itself is still routed), and the
    /// topic's previous message, if any, stays.
    Full,
}

struct Entry {
    msg: RetainedMessage,
    /// Kept across restarts (the broker's own `$SYS` topics are not).
    durable: bool,
}

/// The retained messages of one vhost, sorted by topic, so lookups return messages in topic
/// order, deterministically. A sorted vector of boxes rather than a `BTreeMap`: a new topic
/// moves one pointer per later topic (~0.1 ms at the default bound of 100,000), replacing a
/// topic's message (what sensors do) moves nothing, and the JS `.wasm` (400 KB budget)
/// does not carry a B-tree's code for one more key and value type (~9 KB).
#[derive(Default)]
pub struct RetainedTopics {
    // Boxed on purpose (clippy's vec_box): an entry is ~350 bytes (the properties), and an
    // insert moves every later one.
    #[allow(clippy::vec_box)]
    topics: Vec<Box<Entry>>,
    /// Payload bytes held.
    bytes: u64,
}

impl RetainedTopics {
    /// No retained messages.
    pub fn new() -> RetainedTopics {
        RetainedTopics::default()
    }

    /// Stores `msg` for its topic, replacing the previous one; an empty payload clears the
    /// topic instead (MQTT-3.3.1-10/11). A new topic beyond `max_messages`, or a payload
    /// that would take the vhost beyond `max_bytes`, is refused (`Full`) once expired
    /// messages are dropped (their topics go to `expired`, for the store).
    pub fn set(
        &mut self,
        msg: RetainedMessage,
        durable: bool,
        max_messages: usize,
        max_bytes: u64,
        expired: &mut Vec<(Arc<str>, bool)>,
    ) -> RetainOutcome {
        if msg.payload.is_empty() {
            return match self.remove(&msg.topic) {
                Some(e) => RetainOutcome::Cleared { durable: e.durable },
                None => RetainOutcome::Unchanged,
            };
        }
        let size = msg.payload.len() as u64;
        let fits = |t: &RetainedTopics| {
            let old = t
                .find(&msg.topic)
                .ok()
                .map(|i| t.topics[i].msg.payload.len() as u64);
            let count_ok = old.is_some() || t.topics.len() < max_messages;
            count_ok && t.bytes - old.unwrap_or(0) + size <= max_bytes
        };
        if !fits(self) {
            self.drop_expired(msg.stored_at, expired);
            if !fits(self) {
                return RetainOutcome::Full;
            }
        }
        self.bytes += size;
        match self.find(&msg.topic) {
            Ok(i) => {
                let old = std::mem::replace(&mut *self.topics[i], Entry { msg, durable });
                self.bytes -= old.msg.payload.len() as u64;
                RetainOutcome::Stored {
                    replaced_durable: old.durable,
                }
            }
            Err(i) => {
                self.topics.insert(i, Box::new(Entry { msg, durable }));
                RetainOutcome::Stored {
                    replaced_durable: false,
                }
            }
        }
    }

    /// Where `topic` is (or would be).
    fn find(&self, topic: &str) -> Result<usize, usize> {
        self.topics.binary_search_by(|e| (*e.msg.topic).cmp(topic))
    }

    fn remove(&mut self, topic: &str) -> Option<Box<Entry>> {
        let e = self.topics.remove(self.find(topic).ok()?);
        self.bytes -= e.msg.payload.len() as u64;
        Some(e)
    }

    /// Drops the messages expired at `now`; their topics (and whether each was durable)
    /// go to `expired`.
    pub fn drop_expired(&mut self, now: u64, expired: &mut Vec<(Arc<str>, bool)>) {
        let mut freed = 0;
        self.topics.retain(|e| {
            let keep = !e.msg.expired(now);
            if !keep {
                freed += e.msg.payload.len() as u64;
                expired.push((e.msg.topic.clone(), e.durable));
            }
            keep
        });
        self.bytes -= freed;
    }

    /// Up to `max` unexpired retained messages whose topics `filter` (a plain, valid MQTT
    /// filter) matches, in topic order. Expired ones are dropped on the way (into
    /// `expired`, as [`RetainedTopics::drop_expired`]).
    pub fn matching(
        &mut self,
        filter: &str,
        now: u64,
        max: usize,
        expired: &mut Vec<(Arc<str>, bool)>,
    ) -> Vec<RetainedMessage> {
        // Without wildcards the filter is one topic: a map lookup, not a scan.
        if !filter.contains(['+', '#']) {
            let Ok(i) = self.find(filter) else {
                return Vec::new();
            };
            let e = &self.topics[i];
            if e.msg.expired(now) {
                if let Some(e) = self.remove(filter) {
                    expired.push((e.msg.topic, e.durable));
                }
                return Vec::new();
            }
            return if max > 0 {
                vec![e.msg.clone()]
            } else {
                Vec::new()
            };
        }
        self.drop_expired(now, expired);
        self.topics
            .iter()
            .filter(|e| matches(filter, &e.msg.topic))
            .take(max)
            .map(|e| e.msg.clone())
            .collect()
    }

    /// Messages held.
    pub fn len(&self) -> usize {
        self.topics.len()
    }

    /// No messages held.
    pub fn is_empty(&self) -> bool {
        self.topics.is_empty()
    }

    /// Payload bytes held.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Every topic with whether its message is durable (when the vhost goes).
    pub fn topics(&self) -> impl Iterator<Item = (&Arc<str>, bool)> {
        self.topics.iter().map(|e| (&e.msg.topic, e.durable))
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

    const NO_LIMIT: (usize, u64) = (usize::MAX, u64::MAX);

    fn set(s: &mut RetainedTopics, m: RetainedMessage) -> RetainOutcome {
        s.set(m, true, NO_LIMIT.0, NO_LIMIT.1, &mut Vec::new())
    }

    #[test]
    fn set_replace_clear() {
        let mut s = RetainedTopics::new();
        set(&mut s, msg("a/b", "1"));
        assert_eq!(
            set(&mut s, msg("a/b", "22")),
            RetainOutcome::Stored {
                replaced_durable: true
            }
        );
        set(&mut s, msg("a/c", "3"));
        assert_eq!(s.len(), 2);
        assert_eq!(s.bytes(), 3);
        let got = s.matching("a/+", 0, usize::MAX, &mut Vec::new());
        assert_eq!(
            got.iter().map(|m| &m.payload[..]).collect::<Vec<_>>(),
            [&b"22"[..], b"3"]
        );
        assert_eq!(s.matching("a/b", 0, 10, &mut Vec::new()).len(), 1);
        assert_eq!(s.matching("a/#", 0, 1, &mut Vec::new()).len(), 1, "max");
        assert_eq!(
            set(&mut s, msg("a/b", "")),
            RetainOutcome::Cleared { durable: true }
        );
        assert_eq!(set(&mut s, msg("a/b", "")), RetainOutcome::Unchanged);
        assert_eq!(s.matching("#", 0, 10, &mut Vec::new()).len(), 1);
        assert_eq!(s.bytes(), 1);
    }

    #[test]
    fn dollar_topics_and_expiry() {
        let mut s = RetainedTopics::new();
        set(&mut s, msg("$SYS/x", "1"));
        assert!(s.matching("#", 0, 10, &mut Vec::new()).is_empty());
        assert_eq!(s.matching("$SYS/#", 0, 10, &mut Vec::new()).len(), 1);
        let mut m = msg("t", "v");
        m.stored_at = 100;
        m.expiry_ms = Some(50);
        set(&mut s, m);
        assert_eq!(s.matching("t", 149, 10, &mut Vec::new()).len(), 1);
        let mut expired = Vec::new();
        assert!(s.matching("t", 150, 10, &mut expired).is_empty());
        assert_eq!(expired, vec![(Arc::from("t"), true)]);
        assert_eq!(s.len(), 1);
    }

    /// A new topic beyond the count bound, or a payload beyond the byte bound, is refused
    /// and the topic keeps its message; replacing within the bounds works; expired
    /// messages make room.
    #[test]
    fn bounds_refuse_new_topics_and_expired_messages_make_room() {
        let mut s = RetainedTopics::new();
        let mut exp = Vec::new();
        assert!(matches!(
            s.set(msg("a", "12"), true, 2, 5, &mut exp),
            RetainOutcome::Stored { .. }
        ));
        let mut short = msg("b", "1");
        short.expiry_ms = Some(10);
        assert!(matches!(
            s.set(short, false, 2, 5, &mut exp),
            RetainOutcome::Stored { .. }
        ));
        assert_eq!(
            s.set(msg("c", "1"), true, 2, 5, &mut exp),
            RetainOutcome::Full
        );
        assert_eq!(
            s.set(msg("a", "12345"), true, 2, 5, &mut exp),
            RetainOutcome::Full
        );
        assert_eq!(s.matching("a", 0, 10, &mut exp)[0].payload, "12");
        assert!(matches!(
            s.set(msg("a", "1234"), true, 2, 5, &mut exp),
            RetainOutcome::Stored { .. }
        ));
        // At 10 ms "b" expired: "c" takes its place.
        let mut later = msg("c", "1");
        later.stored_at = 10;
        assert!(matches!(
            s.set(later, true, 2, 5, &mut exp),
            RetainOutcome::Stored { .. }
        ));
        assert_eq!(exp, vec![(Arc::from("b"), false)]);
        assert_eq!((s.len(), s.bytes()), (2, 5));
    }
}
