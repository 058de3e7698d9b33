//! The bridge's logic without I/O (no tokio, no client library; the browser build reuses
//! it): which topic line a message falls under and the topic it gets on the other side
//! (Mosquitto's prefix rules), the QoS it is forwarded with, the loop guard, and the
//! settlement bookkeeping of QoS 1: a message taken from one side is acknowledged there
//! only after the other side acknowledged its copy.
//!
//! The I/O layer tells the link what happened on each side, in order: a message arrived
//! ([`Link::arrived`]), it published something ([`Link::sent`]: the copy, a notification),
//! the client gave a publish its packet id ([`Link::numbered`]), a PUBACK came
//! ([`Link::acked`]). What is waiting is bounded: a peer that sends more unacknowledged
//! messages than [`MAX_IN_FLIGHT`] is an error, which ends the session (nothing is lost:
//! every unacknowledged message is sent again by its source on the next session).

use super::config::{BridgeConfig, Direction, TopicLine};
use std::collections::{BTreeMap, VecDeque};
use std::hash::{Hash, Hasher};

/// Unacknowledged messages per direction at most; the receive maximum a bridge asks of
/// MQTT 5 peers is [`RECEIVE_MAXIMUM`], this is the hard bound for peers that ignore it
/// or speak 3.1.1 (Warren's default `mqtt_max_inflight` is 1024, Mosquitto's 20).
pub const MAX_IN_FLIGHT: usize = 2048;

/// What the bridge asks of its peers (receive maximum, outgoing in-flight window).
pub const RECEIVE_MAXIMUM: u16 = 256;

/// How long a message sent out is remembered for the echo guard (milliseconds).
const ECHO_TTL_MS: u64 = 30_000;

/// The echo guard remembers at most this many messages sent out.
const ECHO_MAX: usize = 4096;

/// A broker of the bridge.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Side {
    Local,
    Remote,
}

impl Side {
    /// The other side.
    pub fn other(self) -> Side {
        match self {
            Side::Local => Side::Remote,
            Side::Remote => Side::Local,
        }
    }

    fn ix(self) -> usize {
        match self {
            Side::Local => 0,
            Side::Remote => 1,
        }
    }
}

/// What to do with a message that arrived on one side.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Publish it on the other side with this topic and QoS (then call [`Link::sent`]).
    Forward { topic: String, qos: u8 },
    /// Acknowledge it at once (QoS 1) and forward nothing.
    Drop(Dropped),
}

/// Why a message is not forwarded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dropped {
    /// No topic line of the right direction matches (a subscription left in a persistent
    /// session by an older configuration).
    NoTopic,
    /// The remote broker sent back what the bridge published (MQTT 3.1.1 has no no_local).
    Echo,
    /// The copy would be larger than the other side takes (`bridge_max_packet_size`, or
    /// the maximum packet size an MQTT 5 broker announced), as Mosquitto drops it.
    TooLarge,
}

/// A session's bookkeeping went wrong: the session ends (and the next one starts clean).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LinkError {
    #[error(
        "the {0} broker has more than {MAX_IN_FLIGHT} unacknowledged messages in flight to the bridge"
    )]
    TooManyInFlight(&'static str),
    #[error("the {0} broker acknowledged packet id {1}, which the bridge did not send")]
    UnknownAck(&'static str, u16),
    #[error("the {0} client numbered a publish the bridge did not make")]
    UnknownPublish(&'static str),
}

fn side_name(s: Side) -> &'static str {
    match s {
        Side::Local => "local",
        Side::Remote => "remote",
    }
}

/// A publish handed to one side's client, waiting for its packet id.
enum Slot<A> {
    /// A forwarded copy, with the source's acknowledgement (`None`: QoS 0).
    Copy(Option<A>),
    /// The bridge's own (a notification).
    Own,
}

/// What a side's client owes or is owed.
struct Lane<A> {
    /// Published, not yet numbered, in order.
    unnumbered: VecDeque<Slot<A>>,
    /// Numbered QoS 1 copies waiting for this side's PUBACK: the source's acknowledgement.
    awaiting: BTreeMap<u16, Option<A>>,
    /// Messages that arrived from this side and are not acknowledged to it yet.
    taken: usize,
}

impl<A> Default for Lane<A> {
    fn default() -> Self {
        Lane {
            unnumbered: VecDeque::new(),
            awaiting: BTreeMap::new(),
            taken: 0,
        }
    }
}

/// One bridge session's state (a new session starts a new `Link`; the counters the
/// operator sees live in the status).
pub struct Link<A> {
    topics: Vec<TopicLine>,
    /// Each line's (local, remote) filter, made once.
    filters: Vec<(String, String)>,
    /// The remote side echoes what the bridge publishes (MQTT 3.1.1: no no_local).
    echoes: bool,
    /// Messages sent out whose echo may come back: fingerprint, when (ms).
    recent: VecDeque<(u64, u64)>,
    lanes: [Lane<A>; 2],
    /// The largest packet each side takes from the bridge.
    max_packet: [usize; 2],
}

/// MQTT's filter matching, the broker's own (MQTT 4.7; `$` topics only under a filter
/// naming them).
pub use warren_core::mqtt::topic::matches;

fn fingerprint(topic: &str, payload: &[u8]) -> u64 {
    // SipHash with fixed keys: the same on every run and target.
    #[allow(deprecated)]
    let mut h = std::hash::SipHasher::new();
    topic.hash(&mut h);
    payload.hash(&mut h);
    h.finish()
}

/// Maps `topic` (a message's topic on side `from`) under `line`, Mosquitto's rule: the
/// prefix of `from` is taken off (when the topic starts with it), the other's put on.
fn remap(line: &TopicLine, from: Side, topic: &str) -> String {
    let (strip, add) = match from {
        Side::Local => (&line.local_prefix, &line.remote_prefix),
        Side::Remote => (&line.remote_prefix, &line.local_prefix),
    };
    let rest = match strip {
        Some(p) => topic.strip_prefix(p.as_str()).unwrap_or(topic),
        None => topic,
    };
    format!("{}{rest}", add.as_deref().unwrap_or(""))
}

/// The subscriptions a side makes: (filter, QoS), one per line of its direction, the
/// higher QoS where two lines name the same filter.
pub fn subscriptions(topics: &[TopicLine], side: Side) -> Vec<(String, u8)> {
    let mut out: Vec<(String, u8)> = Vec::new();
    for t in topics {
        let (wanted, filter) = match side {
            Side::Local => (t.direction.out(), t.local_topic()),
            Side::Remote => (t.direction.inward(), t.remote_topic()),
        };
        if !wanted {
            continue;
        }
        match out.iter_mut().find(|(f, _)| *f == filter) {
            Some((_, q)) => *q = (*q).max(t.qos),
            None => out.push((filter, t.qos)),
        }
    }
    out
}

impl<A> Link<A> {
    /// A session of `cfg`'s bridge; `echoes`: the remote side sends the bridge's own
    /// publishes back (an MQTT 3.1.1 remote, which has no no_local).
    pub fn new(cfg: &BridgeConfig, echoes: bool) -> Link<A> {
        Link {
            topics: cfg.topics.clone(),
            filters: cfg
                .topics
                .iter()
                .map(|t| (t.local_topic(), t.remote_topic()))
                .collect(),
            echoes,
            recent: VecDeque::new(),
            lanes: [Lane::default(), Lane::default()],
            max_packet: [
                super::config::MQTT_MAX_PACKET as usize,
                cfg.max_packet_size as usize,
            ],
        }
    }

    /// Side `to` announced the largest packet it takes (an MQTT 5 CONNACK's).
    pub fn limit(&mut self, to: Side, max: u32) {
        let m = &mut self.max_packet[to.ix()];
        *m = (*m).min(max as usize);
    }

    /// [`Link::arrived`] for a message whose copy's packet size does not matter.
    pub fn arrived(
        &mut self,
        from: Side,
        topic: &str,
        qos: u8,
        payload: &[u8],
        now_ms: u64,
    ) -> Result<Verdict, LinkError> {
        self.arrived_sized(from, topic, qos, payload, now_ms, |_, _| 0)
    }

    /// A message arrived from side `from` on `topic` with `qos` (0 or 1, as delivered),
    /// at `now_ms`. With QoS 1 the caller holds its acknowledgement until [`Link::acked`]
    /// gives it back (Forward) or sends it now (Drop). `size` tells the packet size of the
    /// copy with a topic and QoS (the client's encoding).
    pub fn arrived_sized(
        &mut self,
        from: Side,
        topic: &str,
        qos: u8,
        payload: &[u8],
        now_ms: u64,
        size: impl FnOnce(&str, u8) -> usize,
    ) -> Result<Verdict, LinkError> {
        self.expire(now_ms);
        if from == Side::Remote && self.echoes {
            let fp = fingerprint(topic, payload);
            if let Some(i) = self.recent.iter().position(|&(f, _)| f == fp) {
                self.recent.remove(i);
                return Ok(Verdict::Drop(Dropped::Echo));
            }
        }
        let line = self
            .topics
            .iter()
            .zip(&self.filters)
            .find(|(t, (local, remote))| match from {
                Side::Local => t.direction.out() && matches(local, topic),
                Side::Remote => t.direction.inward() && matches(remote, topic),
            })
            .map(|(t, _)| t);
        let Some(line) = line else {
            return Ok(Verdict::Drop(Dropped::NoTopic));
        };
        let mapped = remap(line, from, topic);
        if mapped.is_empty() {
            // `x/#` with prefix `x/` matches `x/`, which maps to nothing: no topic to use.
            return Ok(Verdict::Drop(Dropped::NoTopic));
        }
        let qos = qos.min(line.qos);
        if size(&mapped, qos) > self.max_packet[from.other().ix()] {
            return Ok(Verdict::Drop(Dropped::TooLarge));
        }
        if qos > 0 {
            let lane = &mut self.lanes[from.ix()];
            if lane.taken >= MAX_IN_FLIGHT {
                return Err(LinkError::TooManyInFlight(side_name(from)));
            }
            lane.taken += 1;
        }
        if from == Side::Local && self.echoes && self.echo_possible(&mapped) {
            if self.recent.len() >= ECHO_MAX {
                self.recent.pop_front();
            }
            self.recent
                .push_back((fingerprint(&mapped, payload), now_ms));
        }
        Ok(Verdict::Forward { topic: mapped, qos })
    }

    /// Whether a message published on the remote side under `topic` comes back to the
    /// bridge's remote subscriptions.
    fn echo_possible(&self, topic: &str) -> bool {
        self.topics
            .iter()
            .zip(&self.filters)
            .any(|(t, (_, remote))| t.direction.inward() && matches(remote, topic))
    }

    fn expire(&mut self, now_ms: u64) {
        while let Some(&(_, at)) = self.recent.front() {
            if now_ms.saturating_sub(at) <= ECHO_TTL_MS {
                break;
            }
            self.recent.pop_front();
        }
    }

    /// The copy of a message (or, with `None` and `own`, the bridge's own publish) was
    /// handed to side `to`'s client; `ack` is the source's acknowledgement (`None` for QoS
    /// 0).
    pub fn sent(&mut self, to: Side, ack: Option<A>, own: bool) {
        let slot = if own { Slot::Own } else { Slot::Copy(ack) };
        self.lanes[to.ix()].unnumbered.push_back(slot);
    }

    /// Side `to`'s client wrote the next publish with packet id `pkid` (0 for QoS 0).
    /// Returns whether a QoS 0 copy was moved by it.
    pub fn numbered(&mut self, to: Side, pkid: u16) -> Result<bool, LinkError> {
        let lane = &mut self.lanes[to.ix()];
        let slot = lane
            .unnumbered
            .pop_front()
            .ok_or(LinkError::UnknownPublish(side_name(to)))?;
        match slot {
            Slot::Own | Slot::Copy(None) if pkid == 0 => Ok(matches!(slot, Slot::Copy(_))),
            Slot::Own => {
                lane.awaiting.insert(pkid, None);
                Ok(false)
            }
            Slot::Copy(ack) => {
                if lane.awaiting.len() >= MAX_IN_FLIGHT {
                    return Err(LinkError::TooManyInFlight(side_name(to)));
                }
                lane.awaiting.insert(pkid, ack);
                Ok(false)
            }
        }
    }

    /// Side `to` acknowledged packet `pkid`: `Some(ack)` is the source's acknowledgement
    /// to send now (a copy moved), `None` an own publish or a QoS 0 one.
    pub fn acked(&mut self, to: Side, pkid: u16) -> Result<Option<A>, LinkError> {
        match self.lanes[to.ix()].awaiting.remove(&pkid) {
            Some(Some(ack)) => {
                let src = &mut self.lanes[to.other().ix()];
                src.taken = src.taken.saturating_sub(1);
                Ok(Some(ack))
            }
            Some(None) => Ok(None),
            None => Err(LinkError::UnknownAck(side_name(to), pkid)),
        }
    }

    /// Unacknowledged messages taken from `from`.
    pub fn in_flight(&self, from: Side) -> usize {
        self.lanes[from.ix()].taken
    }

    /// Whether anything is still waiting for an acknowledgement on either side.
    pub fn idle(&self) -> bool {
        self.lanes
            .iter()
            .all(|l| l.awaiting.is_empty() && l.unnumbered.is_empty())
    }

    /// The topic lines.
    pub fn topics(&self) -> &[TopicLine] {
        &self.topics
    }
}

/// Decorrelated jitter (Mosquitto's `restart_timeout BASE CAP`): the next wait after
/// `last`, from a draw `unit` in [0, 1): uniform in [base, 3 * last], at most `cap`.
pub fn decorrelated(
    base: std::time::Duration,
    cap: std::time::Duration,
    last: std::time::Duration,
    unit: f64,
) -> std::time::Duration {
    let hi = last.saturating_mul(3).max(base);
    let span = hi.saturating_sub(base);
    (base + span.mul_f64(unit.clamp(0.0, 1.0))).min(cap)
}

/// Direction label of a side's arrivals (`out` from local, `in` from remote).
pub fn direction_of(from: Side) -> Direction {
    match from {
        Side::Local => Direction::Out,
        Side::Remote => Direction::In,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bridge::config::BridgeConfig;

    fn cfg(topics: &[&str]) -> BridgeConfig {
        serde_json::from_value(serde_json::json!({
            "name": "t", "address": "h", "topic": topics
        }))
        .unwrap()
    }

    #[test]
    fn prefixes_as_mosquitto_maps_them() {
        let c = cfg(&["# both 1 local/ remote/", "plain in 0"]);
        let mut l: Link<u32> = Link::new(&c, false);
        let v = l.arrived(Side::Local, "local/a/b", 1, b"x", 0).unwrap();
        assert_eq!(
            v,
            Verdict::Forward {
                topic: "remote/a/b".into(),
                qos: 1
            }
        );
        let v = l.arrived(Side::Remote, "remote/z", 1, b"x", 0).unwrap();
        assert_eq!(
            v,
            Verdict::Forward {
                topic: "local/z".into(),
                qos: 1
            }
        );
        // `plain` is in only, QoS 0 at most.
        let v = l.arrived(Side::Remote, "plain", 1, b"x", 0).unwrap();
        assert_eq!(
            v,
            Verdict::Forward {
                topic: "plain".into(),
                qos: 0
            }
        );
        assert_eq!(
            l.arrived(Side::Local, "plain", 1, b"x", 0).unwrap(),
            Verdict::Drop(Dropped::NoTopic)
        );
        let c = cfg(&["\"\" out 1 a/b c/d", "x in 1 \"\" r/"]);
        let mut l: Link<u32> = Link::new(&c, false);
        let v = l.arrived(Side::Local, "a/b", 1, b"", 0).unwrap();
        assert_eq!(
            v,
            Verdict::Forward {
                topic: "c/d".into(),
                qos: 1
            }
        );
        let v = l.arrived(Side::Remote, "r/x", 1, b"", 0).unwrap();
        assert_eq!(
            v,
            Verdict::Forward {
                topic: "x".into(),
                qos: 1
            }
        );
        assert_eq!(
            subscriptions(c.topics.as_slice(), Side::Remote),
            vec![("r/x".to_string(), 1)]
        );
        assert!(!matches("#", "$SYS/x") && matches("a/+/c", "a/b/c") && matches("a/#", "a"));
        let c = cfg(&["# out 1 x/ \"\""]);
        let mut l: Link<u32> = Link::new(&c, false);
        assert_eq!(
            l.arrived(Side::Local, "x/", 1, b"", 0).unwrap(),
            Verdict::Drop(Dropped::NoTopic)
        );
    }

    #[test]
    fn acks_wait_for_the_other_side() {
        let c = cfg(&["a/# out 1"]);
        let mut l: Link<u32> = Link::new(&c, false);
        for i in 0..3u32 {
            assert!(matches!(
                l.arrived(Side::Local, "a/x", 1, b"p", 0).unwrap(),
                Verdict::Forward { .. }
            ));
            l.sent(Side::Remote, Some(i), false);
        }
        l.sent(Side::Remote, None, true);
        assert_eq!(l.in_flight(Side::Local), 3);
        for pkid in 1..=3 {
            assert!(!l.numbered(Side::Remote, pkid).unwrap());
        }
        assert!(!l.numbered(Side::Remote, 4).unwrap());
        assert_eq!(l.acked(Side::Remote, 2).unwrap(), Some(1));
        assert_eq!(l.acked(Side::Remote, 4).unwrap(), None);
        assert!(l.acked(Side::Remote, 9).is_err());
        assert_eq!(l.in_flight(Side::Local), 2);
        assert!(l.numbered(Side::Remote, 5).is_err());
    }

    #[test]
    fn echoes_of_a_311_remote_are_dropped_once() {
        let c = cfg(&["a/# both 1"]);
        let mut l: Link<u32> = Link::new(&c, true);
        assert!(matches!(
            l.arrived(Side::Local, "a/1", 1, b"p", 0).unwrap(),
            Verdict::Forward { .. }
        ));
        assert_eq!(
            l.arrived(Side::Remote, "a/1", 1, b"p", 10).unwrap(),
            Verdict::Drop(Dropped::Echo)
        );
        // The same message published on the remote side by someone else passes.
        assert!(matches!(
            l.arrived(Side::Remote, "a/1", 1, b"p", 20).unwrap(),
            Verdict::Forward { .. }
        ));
    }

    #[test]
    fn copies_larger_than_the_far_side_takes_are_dropped() {
        let mut c = cfg(&["# both 1"]);
        c.max_packet_size = 200;
        let mut l: Link<u32> = Link::new(&c, false);
        let big = |_: &str, _: u8| 300;
        let v = l.arrived_sized(Side::Local, "t", 1, b"", 0, big).unwrap();
        assert_eq!(v, Verdict::Drop(Dropped::TooLarge));
        assert_eq!(l.in_flight(Side::Local), 0);
        // Inward the local broker's limit holds, until it announces a lower one.
        assert!(matches!(
            l.arrived_sized(Side::Remote, "t", 1, b"", 0, big).unwrap(),
            Verdict::Forward { .. }
        ));
        l.limit(Side::Local, 250);
        let v = l.arrived_sized(Side::Remote, "t", 1, b"", 0, big).unwrap();
        assert_eq!(v, Verdict::Drop(Dropped::TooLarge));
    }

    #[test]
    fn the_in_flight_bound_holds() {
        let c = cfg(&["# in 1"]);
        let mut l: Link<u32> = Link::new(&c, false);
        for _ in 0..MAX_IN_FLIGHT {
            l.arrived(Side::Remote, "t", 1, b"", 0).unwrap();
        }
        assert!(l.arrived(Side::Remote, "t", 1, b"", 0).is_err());
    }

    #[test]
    fn jitter_stays_between_base_and_cap() {
        use std::time::Duration as D;
        let (b, c) = (D::from_secs(5), D::from_secs(30));
        assert_eq!(decorrelated(b, c, D::ZERO, 0.0), b);
        assert_eq!(decorrelated(b, c, D::from_secs(20), 0.99), c);
        let w = decorrelated(b, c, D::from_secs(5), 0.5);
        assert!(w > b && w <= D::from_secs(15));
    }
}
