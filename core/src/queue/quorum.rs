//! Quorum queues (RabbitMQ's `rabbit_quorum_queue`): what a quorum queue keeps beyond a
//! classic queue's ready list, as a deterministic state machine over a log of commands, in
//! the shape of RabbitMQ's `rabbit_fifo`.
//!
//! A quorum queue is a `QueueState` (its ready messages, consumers and limits are the
//! classic machinery: paging, prefetch, consumer priorities, single active consumer, TTL,
//! length limits) whose `quorum` part is a [`Fifo`]. Every transition of the queue is one
//! [`Command`], applied to the `Fifo` in order by [`Fifo::apply`]: an enqueue, a checkout
//! (a delivery or a `basic.get`), a settle (the message left for good: acked, delivered
//! without ack, dropped, expired, dead-lettered), a return (requeue, or its channel or
//! consumer went), a consumer attaching or going, a purge, a new delivery limit. `apply`
//! reads nothing but the command and the state, so replaying the same log gives the same
//! state (the tests check it): that is what lets a Raft group carry the log to other nodes next
//! (docs/cluster.md, "Quorum queues").
//!
//! On a single node the queue is a group of one: a command is committed when the local
//! store has synced it. What a client sees follows from that: every message is written to
//! the store whatever its delivery mode, and its confirm waits for the sync; a return
//! re-appends the message at the tail (RabbitMQ 3.10's order) with its `x-delivery-count`
//! header, so the count survives a restart in the message itself.
//!
//! Dispatch stays the leader's decision (credit spans queues and channels, which only the
//! node serving the consumer knows); its outcome is logged as `Checkout`, so followers
//! replay it rather than decide it.

use crate::mail::delivery::ConsumerId;
use crate::message::{FieldValue, Message};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

/// Whether this build serves quorum queues (the `quorum` feature; the JS package's build
/// leaves them out to fit its size budget, issue 39). Without it a quorum declare is refused
/// (406) and every path through a queue's `Fifo` is dead code (each reads `quorum` through
/// `queue::variant::Variant`'s accessors).
pub(crate) const QUORUM: bool = cfg!(feature = "quorum");

/// The header a quorum queue's redeliveries carry: how many times the message was returned.
pub(crate) const DELIVERY_COUNT: &str = "x-delivery-count";

/// One entry of a quorum queue's log. Sequence numbers are the queue's own (issued by its
/// ready list in log order), so a follower replaying the log issues the same ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Command {
    /// A message joins the tail as `seq`, returned `delivery_count` times before (0 for a
    /// publish; the count a recovered message carries in its header).
    Enqueue { seq: u64, delivery_count: u32 },
    /// Message `seq` went to `consumer` (`None`: `basic.get`). One taken without ack is
    /// settled by the next command.
    Checkout {
        seq: u64,
        consumer: Option<ConsumerId>,
    },
    /// Message `seq` left the queue for good.
    Settle { seq: u64 },
    /// Message `seq` came back: it goes to the tail as `to_seq`, its count one higher, or,
    /// over the delivery limit, it is settled (dropped or dead-lettered).
    Return { seq: u64, to_seq: u64 },
    /// A consumer attached (`true`) or went.
    Consumer { id: ConsumerId, attached: bool },
    /// Every ready message left (the checked-out ones stay out).
    Purge,
    /// The delivery limit is now `limit` (declared, or a policy changed): counts stay, the
    /// limit applies from the next return.
    Limit { limit: Option<u64> },
}

/// What applying a command decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Applied {
    /// Nothing to act on.
    Done,
    /// The message's delivery count now (a checkout's, for its header; a return's).
    Count(u32),
    /// A return took the message over the delivery limit: it leaves the queue.
    OverLimit(u32),
}

/// The quorum-only state of a quorum queue (the part of `rabbit_fifo` a classic queue does
/// not have): delivery counts, which messages are checked out and by whom, the consumers,
/// and how far the log has been applied. Bounded by the queue's messages and consumers.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Fifo {
    /// `x-delivery-limit`.
    limit: Option<u64>,
    /// Delivery counts of the messages in the queue (ready or out) returned at least once.
    counts: BTreeMap<u64, u32>,
    /// Messages checked out and awaiting a settle or return, with their consumer.
    out: BTreeMap<u64, Option<ConsumerId>>,
    consumers: BTreeSet<ConsumerId>,
    /// Index of the last command applied (a Raft log index once replicated).
    applied: u64,
    /// Dead letters owed to their targets (`x-dead-letter-strategy: at-least-once`).
    pub(crate) dead: crate::queue::dlx::DeadLetters,
}

impl Fifo {
    /// A quorum queue's state with its delivery limit (tests; a queue starts from the
    /// default and applies `Command::Limit`).
    #[cfg(test)]
    pub(crate) fn new(limit: Option<u64>) -> Fifo {
        Fifo {
            limit,
            ..Fifo::default()
        }
    }

    /// The queue was reloaded (`QueueState::reload`): nothing is checked out any more, and
    /// the reloaded messages carry their delivery counts in their `x-delivery-count` headers
    /// (taken again at their next checkout).
    pub(crate) fn returned_all(&mut self) {
        self.out.clear();
        self.counts.clear();
    }

    /// Applies the next command of the log.
    pub(crate) fn apply(&mut self, command: Command) -> Applied {
        self.applied += 1;
        match command {
            Command::Enqueue {
                seq,
                delivery_count,
            } => {
                if delivery_count > 0 {
                    self.counts.insert(seq, delivery_count);
                }
                Applied::Done
            }
            Command::Checkout { seq, consumer } => {
                self.out.insert(seq, consumer);
                Applied::Count(self.count(seq))
            }
            Command::Settle { seq } => {
                self.out.remove(&seq);
                self.counts.remove(&seq);
                Applied::Done
            }
            Command::Return { seq, to_seq } => {
                self.out.remove(&seq);
                let count = self.counts.remove(&seq).unwrap_or(0).saturating_add(1);
                if self.limit.is_some_and(|limit| u64::from(count) > limit) {
                    return Applied::OverLimit(count);
                }
                self.counts.insert(to_seq, count);
                Applied::Count(count)
            }
            Command::Consumer { id, attached } => {
                if attached {
                    self.consumers.insert(id);
                } else {
                    self.consumers.remove(&id);
                }
                Applied::Done
            }
            Command::Purge => {
                let out = &self.out;
                self.counts.retain(|seq, _| out.contains_key(seq));
                Applied::Done
            }
            Command::Limit { limit } => {
                self.limit = limit;
                Applied::Done
            }
        }
    }

    /// Message `seq`'s delivery count.
    pub(crate) fn count(&self, seq: u64) -> u32 {
        self.counts.get(&seq).copied().unwrap_or(0)
    }

    /// How many commands were applied.
    #[cfg(test)]
    pub(crate) fn applied(&self) -> u64 {
        self.applied
    }

    /// Messages checked out.
    #[cfg(test)]
    pub(crate) fn checked_out(&self) -> usize {
        self.out.len()
    }
}

/// The delivery count a message carries in its header (a quorum queue writes it when it
/// re-appends a returned message, so a restart keeps it).
pub(crate) fn header_count(m: &Message) -> u32 {
    m.properties
        .headers
        .as_ref()
        .and_then(|h| h.get(DELIVERY_COUNT))
        .and_then(FieldValue::as_i64)
        .and_then(|n| u32::try_from(n).ok())
        .unwrap_or(0)
}

/// `m` with its `x-delivery-count` header set to `count` (a copy of the properties; the
/// body is shared).
pub(crate) fn with_count(m: &Arc<Message>, count: u32) -> Arc<Message> {
    let mut copy = Message::clone(m);
    copy.properties
        .headers
        .get_or_insert_with(Default::default)
        .insert(DELIVERY_COUNT.into(), FieldValue::I64(i64::from(count)));
    Arc::new(copy)
}

/// `m` without its `x-delivery-count` header (a copy only if it has one).
pub(crate) fn without_count(m: Arc<Message>) -> Arc<Message> {
    let has = m
        .properties
        .headers
        .as_ref()
        .is_some_and(|h| h.contains_key(DELIVERY_COUNT));
    if !has {
        return m;
    }
    let mut copy = Message::clone(&m);
    if let Some(h) = copy.properties.headers.as_mut() {
        h.remove(DELIVERY_COUNT);
        if h.is_empty() {
            copy.properties.headers = None;
        }
    }
    Arc::new(copy)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small deterministic generator (the core has no entropy source).
    struct Lcg(u64);

    impl Lcg {
        fn next(&mut self, n: u64) -> u64 {
            self.0 = self
                .0
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (self.0 >> 33) % n.max(1)
        }
    }

    #[test]
    fn a_poison_message_goes_after_the_limit_with_counts_1_and_2_seen() {
        let mut f = Fifo::new(Some(2));
        f.apply(Command::Enqueue {
            seq: 0,
            delivery_count: 0,
        });
        let c = Some(ConsumerId(1));
        let mut seen = Vec::new();
        let mut seq = 0;
        for to_seq in 1.. {
            let checkout = Command::Checkout { seq, consumer: c };
            let Applied::Count(n) = f.apply(checkout) else {
                panic!("a checkout answers a count")
            };
            seen.push(n);
            match f.apply(Command::Return { seq, to_seq }) {
                Applied::Count(_) => seq = to_seq,
                Applied::OverLimit(n) => {
                    assert_eq!(n, 3);
                    break;
                }
                Applied::Done => panic!("a return answers"),
            }
        }
        assert_eq!(seen, [0, 1, 2], "three deliveries, the last two counted");
        assert_eq!(f.checked_out(), 0);
        assert!(f.counts.is_empty(), "nothing left of the message");
    }

    #[test]
    fn settle_and_purge_forget_what_left_and_keep_what_is_out() {
        let mut f = Fifo::new(None);
        for seq in 0..3 {
            f.apply(Command::Enqueue {
                seq,
                delivery_count: 2,
            });
        }
        f.apply(Command::Checkout {
            seq: 0,
            consumer: None,
        });
        f.apply(Command::Purge);
        assert_eq!(f.count(0), 2, "out during the purge: stays");
        assert_eq!((f.count(1), f.count(2)), (0, 0), "ready: purged");
        f.apply(Command::Settle { seq: 0 });
        assert_eq!(f, {
            let mut empty = Fifo::new(None);
            empty.applied = 6;
            empty
        });
    }

    /// The property replication rests on: the state is a function of the log. Random logs
    /// (seeded) applied twice, and in two halves through a clone, give equal states.
    #[test]
    fn replaying_a_log_gives_the_same_state() {
        for seed in 0..50 {
            let mut rng = Lcg(seed);
            let mut log = Vec::new();
            let mut next = 0u64;
            for _ in 0..400 {
                let seq = rng.next(next.max(1));
                let command = match rng.next(6) {
                    0 => {
                        next += 1;
                        Command::Enqueue {
                            seq: next - 1,
                            delivery_count: u32::try_from(rng.next(3)).unwrap_or(0),
                        }
                    }
                    1 => Command::Checkout {
                        seq,
                        consumer: Some(ConsumerId(rng.next(3))),
                    },
                    2 => Command::Settle { seq },
                    3 => {
                        next += 1;
                        Command::Return {
                            seq,
                            to_seq: next - 1,
                        }
                    }
                    4 => Command::Consumer {
                        id: ConsumerId(rng.next(3)),
                        attached: rng.next(2) == 0,
                    },
                    5 if rng.next(10) == 0 => Command::Limit {
                        limit: Some(rng.next(4)),
                    },
                    _ => Command::Purge,
                };
                log.push(command);
            }
            let limit = Some(rng.next(4));
            let mut a = Fifo::new(limit);
            let answers: Vec<Applied> = log.iter().map(|c| a.apply(*c)).collect();
            let mut b = Fifo::new(limit);
            let (first, second) = log.split_at(log.len() / 2);
            for c in first {
                b.apply(*c);
            }
            let mut follower = b.clone();
            for c in second {
                b.apply(*c);
                follower.apply(*c);
            }
            assert_eq!(a, b, "seed {seed}");
            assert_eq!(a, follower, "seed {seed}");
            assert_eq!(a.applied(), 400);
            let again: Vec<Applied> = {
                let mut c = Fifo::new(limit);
                log.iter().map(|cmd| c.apply(*cmd)).collect()
            };
            assert_eq!(answers, again, "seed {seed}: the same decisions");
        }
    }

    #[test]
    fn the_count_travels_in_the_header() {
        let m = Arc::new(Message {
            exchange: Arc::from(""),
            routing_key: Arc::from("q"),
            properties: Default::default(),
            body: bytes::Bytes::from_static(b"poison"),
        });
        assert_eq!(header_count(&m), 0);
        let counted = with_count(&m, 2);
        assert_eq!(header_count(&counted), 2);
        assert_eq!(header_count(&with_count(&counted, 3)), 3);
        let plain = without_count(counted);
        assert_eq!(plain.properties.headers, None);
        assert!(
            Arc::ptr_eq(&without_count(m.clone()), &m),
            "no copy without a count"
        );
    }
}
