//! What a persistent MQTT session keeps while its client is away (subscriptions, packet ids in
//! flight, a delayed will) and its stored form. Its own module so that the registry, which
//! holds records, and the session, which makes and resumes them, both depend on it rather
//! than on each other.

use crate::codec::{self, Level, qos_from};
use mqtt_proto::v5;
use mqtt_proto::{Pid, QoS, QosPid};
use std::collections::BTreeSet;
use std::sync::Arc;
use warren_core::mqtt::{StoredSession, StoredSub, StoredWill};

/// One subscription's options.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SubOpts {
    pub qos: QoS,
    pub no_local: bool,
    pub retain_as_published: bool,
    /// Retain Handling as subscribed (0..=2); kept so the stored session says what the
    /// client asked for.
    pub retain_handling: u8,
    pub id: Option<u32>,
}

/// A session's subscriptions by filter, in filter order. A sorted vector sized exactly: most
/// clients hold one or two filters, and a `BTreeMap` node for one entry is ~300 bytes of a
/// ~4 KiB idle-connection budget.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SubMap(Vec<(Arc<str>, SubOpts)>);

impl SubMap {
    fn find(&self, filter: &str) -> Result<usize, usize> {
        self.0.binary_search_by(|(f, _)| (**f).cmp(filter))
    }

    /// Adds or replaces; returns the options replaced.
    pub fn insert(&mut self, filter: Arc<str>, opts: SubOpts) -> Option<SubOpts> {
        match self.find(&filter) {
            Ok(i) => Some(std::mem::replace(&mut self.0[i].1, opts)),
            Err(i) => {
                self.0.reserve_exact(1);
                self.0.insert(i, (filter, opts));
                None
            }
        }
    }

    pub fn remove(&mut self, filter: &str) -> Option<SubOpts> {
        let i = self.find(filter).ok()?;
        let (_, opts) = self.0.remove(i);
        self.0.shrink_to_fit();
        Some(opts)
    }

    pub fn get(&self, filter: &str) -> Option<&SubOpts> {
        self.find(filter).ok().map(|i| &self.0[i].1)
    }

    pub fn keys(&self) -> impl Iterator<Item = &Arc<str>> {
        self.0.iter().map(|(f, _)| f)
    }

    pub fn values(&self) -> impl Iterator<Item = &SubOpts> {
        self.0.iter().map(|(_, o)| o)
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl<'a> IntoIterator for &'a SubMap {
    type Item = (&'a Arc<str>, &'a SubOpts);
    type IntoIter = std::iter::Map<
        std::slice::Iter<'a, (Arc<str>, SubOpts)>,
        fn(&'a (Arc<str>, SubOpts)) -> (&'a Arc<str>, &'a SubOpts),
    >;

    fn into_iter(self) -> Self::IntoIter {
        self.0.iter().map(|(f, o)| (f, o))
    }
}

/// What a persistent session keeps while its client is away. The messages themselves wait in
/// the session's core queue (durable: a stored session's queue always is).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SessionRecord {
    /// MQTT level of the connection that left it.
    pub level: Level,
    pub subs: SubMap,
    /// Outbound QoS 2 packet ids that got PUBREC but not yet PUBCOMP: PUBREL is resent.
    pub awaiting_comp: BTreeSet<u16>,
    /// Inbound QoS 2 packet ids routed but not yet released by PUBREL.
    pub inbound_qos2: BTreeSet<u16>,
    /// Packet ids of outbound QoS 1/2 messages sent and not acknowledged, oldest first: the
    /// core requeues them in order, and the next connection resends them under these ids
    /// (MQTT-4.4.0-1).
    pub outbound: Vec<u16>,
    pub has_queue: bool,
    pub expiry_s: u32,
    /// When the client went away (unix ms): the session expiry counts from here.
    pub stored_at: u64,
    /// A will waiting for its delay.
    pub will: Option<StoredWill>,
}

fn qos_u8(q: QoS) -> u8 {
    q as u8
}

impl SessionRecord {
    /// The stored form; `connected`: a client has the session now (its expiry is not
    /// counting).
    pub fn to_stored(&self, connected: bool) -> StoredSession {
        StoredSession {
            level: self.level,
            expiry_s: self.expiry_s,
            disconnected_at: (!connected).then_some(self.stored_at),
            has_queue: self.has_queue,
            subs: stored_subs(&self.subs),
            awaiting_comp: self.awaiting_comp.iter().copied().collect(),
            inbound_qos2: self.inbound_qos2.iter().copied().collect(),
            outbound: self.outbound.clone(),
            will: self.will.clone(),
        }
    }

    /// A session read back from storage at `now` (a broker start): one that had a client
    /// when the broker stopped without closing it (a crash) starts counting now.
    pub fn from_stored(s: StoredSession, now: u64) -> SessionRecord {
        let mut subs = SubMap::default();
        for sub in s.subs {
            subs.insert(
                Arc::from(sub.filter),
                SubOpts {
                    qos: qos_from(sub.qos.min(2)),
                    no_local: sub.no_local,
                    retain_as_published: sub.retain_as_published,
                    retain_handling: sub.retain_handling,
                    id: sub.id,
                },
            );
        }
        SessionRecord {
            level: s.level,
            subs,
            awaiting_comp: s.awaiting_comp.into_iter().collect(),
            inbound_qos2: s.inbound_qos2.into_iter().collect(),
            outbound: s.outbound,
            has_queue: s.has_queue,
            expiry_s: s.expiry_s,
            stored_at: s.disconnected_at.unwrap_or(now),
            will: s.will,
        }
    }

    /// Unix ms at which the session expires (`None`: never).
    pub fn expires_at(&self) -> Option<u64> {
        (self.expiry_s != u32::MAX).then(|| {
            self.stored_at
                .saturating_add(u64::from(self.expiry_s) * 1000)
        })
    }
}

pub(crate) fn stored_subs(subs: &SubMap) -> Vec<StoredSub> {
    subs.into_iter()
        .map(|(f, o)| StoredSub {
            filter: f.to_string(),
            qos: qos_u8(o.qos),
            no_local: o.no_local,
            retain_as_published: o.retain_as_published,
            retain_handling: o.retain_handling,
            id: o.id,
        })
        .collect()
}

impl SessionRecord {
    /// Whether the session expiry interval has run out at `now` (u32::MAX: never, MQTT 5
    /// 3.1.2.11.2). The registry's expiry task ends such sessions; a client coming back
    /// first finds it expired here.
    pub fn expired(&self, now: u64) -> bool {
        self.expires_at().is_some_and(|at| now >= at)
    }
}

/// A will as an encoded MQTT 5 PUBLISH (its delay left out), for storage.
pub fn encode_will(w: &v5::LastWill) -> bytes::Bytes {
    let publish = v5::Publish {
        dup: false,
        retain: w.retain,
        qos_pid: match w.qos {
            QoS::Level0 => QosPid::Level0,
            QoS::Level1 => QosPid::Level1(Pid::default()),
            QoS::Level2 => QosPid::Level2(Pid::default()),
        },
        topic_name: w.topic_name.clone(),
        payload: w.payload.clone(),
        properties: v5::PublishProperties {
            payload_is_utf8: w.properties.payload_is_utf8,
            message_expiry_interval: w.properties.message_expiry_interval,
            content_type: w.properties.content_type.clone(),
            response_topic: w.properties.response_topic.clone(),
            correlation_data: w.properties.correlation_data.clone(),
            user_properties: w.properties.user_properties.clone(),
            ..Default::default()
        },
    };
    let mut out = bytes::BytesMut::new();
    codec::encode(&v5::Packet::Publish(publish), 5, &mut out);
    out.freeze()
}

/// A stored will back as a will; `None` when the bytes are no MQTT 5 PUBLISH.
pub fn decode_will(b: &[u8]) -> Option<v5::LastWill> {
    let mut buf = bytes::BytesMut::from(b);
    let Ok(Some(codec::Decoded::Packet(v5::Packet::Publish(p)))) =
        codec::decode(&mut buf, Some(5), b.len().max(16))
    else {
        return None;
    };
    Some(v5::LastWill {
        qos: p.qos_pid.qos(),
        retain: p.retain,
        topic_name: p.topic_name,
        payload: p.payload,
        properties: v5::WillProperties {
            delay_interval: None,
            payload_is_utf8: p.properties.payload_is_utf8,
            message_expiry_interval: p.properties.message_expiry_interval,
            content_type: p.properties.content_type,
            response_topic: p.properties.response_topic,
            correlation_data: p.properties.correlation_data,
            user_properties: p.properties.user_properties,
        },
    })
}
