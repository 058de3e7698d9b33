//! Deterministic simulation: random operation sequences from several connections, checking
//! after every step the core's internal invariants and, at the end, message conservation:
//! every published message is acked, dropped, purged or still in its queue, exactly once,
//! and only a message delivered before is ever flagged redelivered. Every channel's replies
//! come in the order of its requests. Queue `q0` has a message TTL and dead-letters (expired
//! or rejected messages) to `dlq`, so dead letters are part of the flow. Queues bind and
//! unbind themselves to `amq.direct` (queue `qN` with key `kN`), and mandatory publishes
//! there either reach the queue or come back (basic.return), whichever the bindings say
//! when topology routes them. Queue `q1` is a quorum queue. Queue `t` is deleted and declared again while mandatory
//! publishes, consumers and gets use it: each message reaches the queue (and is consumed,
//! counted by its delete-ok or drained at the end), comes back, reaches a `t` deleted on
//! its way (`Broker::routed_to_deleted`), or is requeued to a deleted `t`
//! (`Broker::requeued_to_deleted`); a consume or get that finds `t` gone fails its channel
//! with 404, and `t`'s consumers are cancelled when it goes.
//!
//! With scheduled mail (`Broker::set_mail_scheduled`), the mail between the queue side and
//! the channel side takes random time, as it will between shards: the ops interleave with
//! its deliveries, and the client model below behaves as a real client must (a reply may
//! come long after its request; what arrives between a close and its close-ok belongs to
//! the closed opening).

mod common;

use common::*;
use proptest::prelude::*;
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use warren_core::Broker;
use warren_core::command::{Bind, Op, Publish, QueueDeclare};
use warren_core::effect::{Delivery, Effect, Reply};
use warren_core::ids::ChannelRef;
use warren_core::message::{FieldTable, FieldValue, Properties};

const CONNS: u64 = 3;
const CHANNELS: u16 = 2;
/// Queues publishes go to (`q0`..); consumers and gets also use the dead-letter queue,
/// index `QUEUES`.
const QUEUES: usize = 3;
/// `q0`'s message TTL (sim time: each op is 1 ms).
const Q0_TTL_MS: i32 = 40;

/// Consumers and gets also use `t` (index `QUEUES + 1`), which may not exist.
const T_INDEX: u8 = QUEUES as u8 + 1;

fn queue_name(i: u8) -> String {
    if usize::from(i) == QUEUES {
        "dlq".into()
    } else if i == T_INDEX {
        T.into()
    } else {
        format!("q{i}")
    }
}

/// `q0` dead-letters to `dlq` through the default exchange; `q1` is a quorum queue (its
/// returns go to the tail, counted); the others have no arguments.
fn queue_args(i: u8) -> FieldTable {
    if i == 1 {
        return [("x-queue-type".to_string(), FieldValue::string("quorum"))]
            .into_iter()
            .collect();
    }
    if i != 0 {
        return FieldTable::new();
    }
    [
        ("x-dead-letter-exchange", FieldValue::string("")),
        ("x-dead-letter-routing-key", FieldValue::string("dlq")),
        ("x-message-ttl", FieldValue::I32(Q0_TTL_MS)),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

#[derive(Clone, Debug)]
enum SimOp {
    /// To `qN` through the default exchange, or (`direct`) mandatory through `amq.direct`
    /// with key `kN`, which reaches `qN` only while it is bound.
    Publish {
        ch: u8,
        queue: u8,
        direct: bool,
    },
    /// queue.bind (`add`) or queue.unbind of `qN` to `amq.direct` with key `kN`.
    Bind {
        ch: u8,
        queue: u8,
        add: bool,
    },
    /// A bind from an exchange that does not exist: topology refuses it (404), which
    /// closes the channel after the replies to its earlier requests.
    BogusBind {
        ch: u8,
    },
    /// queue.declare of `t` (creating it if it is gone), or queue.delete of it.
    DeclareT {
        ch: u8,
    },
    DeleteT {
        ch: u8,
    },
    /// A mandatory publish to `t` through the default exchange.
    PublishT {
        ch: u8,
    },
    Consume {
        ch: u8,
        queue: u8,
        no_ack: bool,
    },
    Cancel {
        ch: u8,
        which: u8,
    },
    Get {
        ch: u8,
        queue: u8,
        no_ack: bool,
    },
    Ack {
        ch: u8,
        which: u8,
        multiple: bool,
    },
    Nack {
        ch: u8,
        which: u8,
        multiple: bool,
        requeue: bool,
    },
    BogusAck {
        ch: u8,
    },
    Recover {
        ch: u8,
    },
    Qos {
        ch: u8,
        count: u8,
        global: bool,
    },
    CloseChannel {
        ch: u8,
    },
    CloseConnection {
        conn: u8,
    },
    Purge {
        ch: u8,
        queue: u8,
    },
    Written {
        conn: u8,
    },
    /// tx.select, tx.commit, tx.rollback (`what` 0, 1, 2).
    Tx {
        ch: u8,
        what: u8,
    },
    /// Time passes: the broker's tick (message TTLs).
    Tick {
        ms: u8,
    },
    /// confirm.select: every later publish on the channel must be confirmed, in order.
    Confirm {
        ch: u8,
    },
    /// queue.declare of an existing queue (equivalent, or passive).
    Redeclare {
        ch: u8,
        queue: u8,
        passive: bool,
    },
    /// Scheduled mail: deliver up to `count` pieces, picked from `pick` on.
    Mail {
        count: u8,
        pick: u16,
    },
}

/// A reply a channel waits for, in request order.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Expect {
    OpenOk,
    CloseOk,
    ConsumeOk,
    CancelOk,
    /// get-ok or get-empty (get-ok does not say whether it needs an ack).
    Get {
        no_ack: bool,
    },
    PurgeOk,
    QosOk,
    RecoverOk,
    ConfirmSelectOk,
    DeclareOk,
    TxSelectOk,
    TxCommitOk,
    TxRollbackOk,
    BindOk,
    UnbindOk,
    /// declare-ok of `t`.
    DeclareTOk,
    DeleteOk,
}

/// The name of the queue that is deleted and declared again, and the origin its messages
/// are recorded with.
const T: &str = "t";
const T_ORIGIN: u8 = 9;

fn declare_t() -> Op {
    declare(T.into(), false, FieldTable::new())
}

/// queue.declare of a shared queue, transient unless a quorum queue (durable only).
fn declare(queue: String, passive: bool, arguments: FieldTable) -> Op {
    Op::QueueDeclare(QueueDeclare {
        queue,
        passive,
        durable: arguments.contains_key("x-queue-type"),
        exclusive: false,
        auto_delete: false,
        nowait: false,
        arguments,
    })
}

fn scheduled_op() -> impl Strategy<Value = SimOp> {
    prop_oneof![
        3 => sim_op(),
        2 => (1u8..8, any::<u16>()).prop_map(|(count, pick)| SimOp::Mail { count, pick }),
    ]
}

fn sim_op() -> impl Strategy<Value = SimOp> {
    let ch = 0u8..(CONNS as u8 * CHANNELS as u8);
    let q = 0u8..=QUEUES as u8;
    let qt = 0u8..=T_INDEX;
    prop_oneof![
        6 => (ch.clone(), 0u8..QUEUES as u8, prop::bool::weighted(0.3))
            .prop_map(|(ch, queue, direct)| SimOp::Publish { ch, queue, direct }),
        2 => (ch.clone(), 0u8..QUEUES as u8, prop::bool::weighted(0.6))
            .prop_map(|(ch, queue, add)| SimOp::Bind { ch, queue, add }),
        1 => ch.clone().prop_map(|ch| SimOp::BogusBind { ch }),
        1 => ch.clone().prop_map(|ch| SimOp::DeclareT { ch }),
        1 => ch.clone().prop_map(|ch| SimOp::DeleteT { ch }),
        2 => ch.clone().prop_map(|ch| SimOp::PublishT { ch }),
        2 => (ch.clone(), qt.clone(), any::<bool>())
            .prop_map(|(ch, queue, no_ack)| SimOp::Consume { ch, queue, no_ack }),
        1 => (ch.clone(), any::<u8>()).prop_map(|(ch, which)| SimOp::Cancel { ch, which }),
        1 => (ch.clone(), qt, any::<bool>())
            .prop_map(|(ch, queue, no_ack)| SimOp::Get { ch, queue, no_ack }),
        4 => (ch.clone(), any::<u8>(), any::<bool>())
            .prop_map(|(ch, which, multiple)| SimOp::Ack { ch, which, multiple }),
        2 => (ch.clone(), any::<u8>(), any::<bool>(), any::<bool>()).prop_map(
            |(ch, which, multiple, requeue)| SimOp::Nack { ch, which, multiple, requeue }
        ),
        1 => ch.clone().prop_map(|ch| SimOp::BogusAck { ch }),
        1 => ch.clone().prop_map(|ch| SimOp::Recover { ch }),
        1 => (ch.clone(), 0u8..4, any::<bool>())
            .prop_map(|(ch, count, global)| SimOp::Qos { ch, count, global }),
        1 => ch.clone().prop_map(|ch| SimOp::CloseChannel { ch }),
        1 => ch.clone().prop_map(|ch| SimOp::Confirm { ch }),
        1 => (ch.clone(), q.clone(), any::<bool>())
            .prop_map(|(ch, queue, passive)| SimOp::Redeclare { ch, queue, passive }),
        1 => (0u8..CONNS as u8).prop_map(|conn| SimOp::CloseConnection { conn }),
        1 => (ch.clone(), q).prop_map(|(ch, queue)| SimOp::Purge { ch, queue }),
        3 => (0u8..CONNS as u8).prop_map(|conn| SimOp::Written { conn }),
        1 => (1u8..60).prop_map(|ms| SimOp::Tick { ms }),
        2 => (ch, 0u8..3).prop_map(|(ch, what)| SimOp::Tx { ch, what }),
    ]
}

/// What the simulated clients have seen.
#[derive(Default)]
struct Ledger {
    published: u64,
    /// Message ids settled for good (acked, delivered without ack, dropped by nack/reject).
    settled: Vec<u64>,
    purged: u64,
    /// Ids ever delivered, and whether from `dlq` (to catch a first delivery flagged
    /// redelivered; a dead letter is a new message in `dlq`).
    seen: BTreeSet<(bool, u64)>,
    /// The queue each message was published to, by id.
    origin: Vec<u8>,
    /// Per channel: outstanding delivery tag -> (message id, delivered from `dlq`).
    outstanding: BTreeMap<ChannelRef, BTreeMap<u64, (u64, bool)>>,
    consumers: BTreeMap<ChannelRef, Vec<String>>,
    open: BTreeSet<ChannelRef>,
    conns: BTreeSet<u64>,
    unwritten: HashMap<u64, u32>,
    next_tag: u64,
    /// Per channel: the replies it waits for, in request order.
    expect: BTreeMap<ChannelRef, VecDeque<Expect>>,
    /// Channels closed (by the client) whose close-ok has not come: what arrives for them
    /// meanwhile belongs to the closed opening (its unacked deliveries go back to queues).
    closing: BTreeMap<ChannelRef, u32>,
    /// Channels whose basic.recover has not been answered: deliveries before recover-ok
    /// are among those it requeues.
    recovering: BTreeMap<ChannelRef, u32>,
    /// Channels sent a bad ack whose channel error has not come yet: the client sends
    /// nothing more on them (the broker would drop it).
    doomed: BTreeSet<ChannelRef>,
    /// Purges and deletes of `t` whose purge-ok or delete-ok never came (their connection
    /// closed first): how many messages they took is not known.
    unanswered_purges: usize,
    /// Messages `t` held when it was deleted (delete-ok counts).
    deleted: u64,
    /// Declares of `t` sent so far, and those not answered yet; `t_unknown`: one's
    /// connection closed before its answer came (when it was applied is unknown).
    t_declares_sent: u32,
    t_declares_pending: u32,
    t_unknown: bool,
    /// Per channel: its deletes of `t` not answered yet, each with `t_declares_sent` when it
    /// was sent if no declare of `t` was pending then.
    deleting_t: BTreeMap<ChannelRef, VecDeque<Option<u32>>>,
    /// Per connection: a delete-ok of `t` reached it, stamped as above. While no declare of
    /// `t` was sent since, `t` does not exist, and a client sees its own deletes: its
    /// mandatory publishes to `t` must come back.
    t_deleted_seen: BTreeMap<u64, u32>,
    /// Ids that must come back for that reason.
    must_return: BTreeSet<u64>,
    /// Channels whose last request is a consume or get on `t` (also `doomed` until its
    /// answer: a 404 if `t` is gone).
    risky: BTreeSet<ChannelRef>,
    /// Channels with a global prefetch (this opening): they do not consume from the quorum
    /// queue `q1`, which would close their connection with 540, as RabbitMQ does.
    global_qos: BTreeSet<ChannelRef>,
    /// Channels in confirm mode (this opening): (publishes sent, confirmed up to).
    confirms: BTreeMap<ChannelRef, (u64, u64)>,
    /// Channels in tx mode (this opening), with the ids published since the last commit.
    tx: BTreeMap<ChannelRef, Vec<u64>>,
    /// Ids of publishes rolled back (or never committed): they must never arrive.
    rolled_back: BTreeSet<u64>,
    /// Per channel: its binds not answered yet, in order: the queue, and `unbinds_sent`
    /// when the bind was sent if no unbind of the queue could still be applied after it.
    binding: BTreeMap<ChannelRef, VecDeque<(u8, Option<u32>)>>,
    /// Per channel: the queues of its unbinds not answered yet, in order.
    unbinding: BTreeMap<ChannelRef, VecDeque<u8>>,
    /// Per queue: unbinds sent (by anyone) so far, and those not answered yet.
    unbinds_sent: [u32; QUEUES],
    unbinds_pending: [u32; QUEUES],
    /// Per queue: an unbind's connection closed before its answer came, so when (or
    /// whether) it was applied is unknown.
    unbind_unknown: [bool; QUEUES],
    /// Per (connection, queue): a bind-ok reached the connection, of a bind sent when no
    /// unbind was pending, and `unbinds_sent` then. While no unbind was sent since, the
    /// binding exists, and a client sees its own binds: its publishes must not come back.
    bound_seen: BTreeMap<(u64, u8), u32>,
}

fn channel_of(i: u8) -> ChannelRef {
    ch(
        1 + u64::from(i) / u64::from(CHANNELS),
        1 + u16::from(i) % CHANNELS,
    )
}

struct Sim {
    h: Harness,
    l: Ledger,
    trace: Vec<String>,
    /// Publishes arrive routed by the host on the broker's current table, as the native
    /// runtime sends them (`Publish::routed`).
    host_routes: bool,
}

impl Sim {
    fn new() -> Sim {
        Sim::sharded(1)
    }

    /// A broker of `k` shards (connection `n` on shard `n % k`); with more than one, each
    /// queue is declared by a different connection, so the queues spread over the shards.
    fn sharded(k: u32) -> Sim {
        let config = warren_core::BrokerConfig {
            flow_ready_high: 3,
            ..Default::default()
        };
        let mut s = Sim {
            h: Harness::sharded(config, k),
            l: Ledger::default(),
            trace: Vec::new(),
            host_routes: false,
        };
        for conn in 1..=CONNS {
            s.connect(conn);
        }
        for q in 0..=QUEUES as u8 {
            let conn = if k == 1 { 1 } else { 1 + u64::from(q) % CONNS };
            let op = declare(queue_name(q), false, queue_args(q));
            s.send(ch(conn, 1), op, Some(Expect::DeclareOk));
        }
        s
    }

    fn connect(&mut self, conn: u64) {
        self.exec(
            ch(conn, 0),
            Op::ConnectionOpen {
                vhost: "/".into(),
                user: "guest".into(),
                cancel_notify: true,
            },
        );
        self.l.conns.insert(conn);
        for n in 1..=CHANNELS {
            self.open(ch(conn, n));
        }
    }

    /// Opens channel `c`: usable at once (the broker applies a channel's ops in order).
    fn open(&mut self, c: ChannelRef) {
        self.l.open.insert(c);
        self.send(c, Op::ChannelOpen, Some(Expect::OpenOk));
    }

    /// Sends `op` on `c`, which answers with `expect`.
    fn send(&mut self, c: ChannelRef, op: Op, expect: Option<Expect>) {
        if let Some(e) = expect {
            self.l.expect.entry(c).or_default().push_back(e);
        }
        self.exec(c, op);
    }

    /// Whether what arrives on `c` now belongs to an opening the client closed.
    fn stale(&self, c: ChannelRef) -> bool {
        self.l.closing.get(&c).is_some_and(|&n| n > 0) || !self.l.conns.contains(&c.conn.0)
    }

    /// A reply arrived on `c`: it must be the one its oldest request waits for.
    fn replied(&mut self, c: ChannelRef, got: &Reply) -> Option<Expect> {
        if !self.l.conns.contains(&c.conn.0) {
            // Replies to what a closing connection held; nobody reads them.
            return None;
        }
        let expected = self.l.expect.get_mut(&c).and_then(|q| q.pop_front());
        if self.l.expect.get(&c).is_none_or(|q| q.is_empty()) && self.l.risky.remove(&c) {
            // The op on `t` succeeded: the channel is usable again.
            self.l.doomed.remove(&c);
        }
        let fits = matches!(
            (expected, got),
            (Some(Expect::OpenOk), Reply::ChannelOpenOk)
                | (Some(Expect::CloseOk), Reply::ChannelCloseOk)
                | (Some(Expect::ConsumeOk), Reply::ConsumeOk { .. })
                | (Some(Expect::CancelOk), Reply::CancelOk { .. })
                | (
                    Some(Expect::Get { .. }),
                    Reply::GetOk { .. } | Reply::GetEmpty
                )
                | (Some(Expect::PurgeOk), Reply::QueuePurgeOk { .. })
                | (Some(Expect::QosOk), Reply::QosOk)
                | (Some(Expect::RecoverOk), Reply::RecoverOk)
                | (Some(Expect::ConfirmSelectOk), Reply::ConfirmSelectOk)
                | (
                    Some(Expect::DeclareOk | Expect::DeclareTOk),
                    Reply::QueueDeclareOk { .. }
                )
                | (Some(Expect::TxSelectOk), Reply::TxSelectOk)
                | (Some(Expect::TxCommitOk), Reply::TxCommitOk)
                | (Some(Expect::TxRollbackOk), Reply::TxRollbackOk)
                | (Some(Expect::BindOk), Reply::QueueBindOk)
                | (Some(Expect::UnbindOk), Reply::QueueUnbindOk)
                | (Some(Expect::DeleteOk), Reply::QueueDeleteOk { .. })
        );
        assert!(fits, "{c:?}: {got:?} came while waiting for {expected:?}");
        expected
    }

    /// Makes sure the channel is usable, reopening its connection or the channel itself.
    fn ensure(&mut self, c: ChannelRef) {
        if !self.l.conns.contains(&c.conn.0) {
            self.connect(c.conn.0);
        }
        if !self.l.open.contains(&c) {
            self.open(c);
        }
    }

    /// Delivers up to `count` pieces of scheduled mail.
    fn mail(&mut self, count: u8, pick: u16) {
        for i in 0..usize::from(count) {
            let pick = usize::from(pick).wrapping_mul(31).wrapping_add(i * 7);
            let Some(fx) = self.h.deliver_mail(pick) else {
                return;
            };
            for e in fx {
                self.trace.push(format!("{e:?}"));
                self.observe(e);
            }
        }
    }

    fn exec(&mut self, c: ChannelRef, op: Op) {
        let fx = self.h.op(c, op);
        for e in fx {
            self.trace.push(format!("{e:?}"));
            self.observe(e);
        }
    }

    fn observe(&mut self, e: Effect) {
        match e {
            Effect::Reply { ch, reply } => {
                let expected = self.replied(ch, &reply);
                let stale = self.stale(ch);
                match reply {
                    Reply::ChannelCloseOk => {
                        if let Some(n) = self.l.closing.get_mut(&ch) {
                            *n = n.saturating_sub(1);
                        }
                    }
                    Reply::RecoverOk => {
                        if let Some(n) = self.l.recovering.get_mut(&ch) {
                            *n = n.saturating_sub(1);
                        }
                    }
                    Reply::ConsumeOk { consumer_tag } if !stale => {
                        self.l
                            .consumers
                            .entry(ch)
                            .or_default()
                            .push(consumer_tag.to_string());
                    }
                    Reply::QueueBindOk if self.l.conns.contains(&ch.conn.0) => {
                        let b = self.l.binding.get_mut(&ch).and_then(|b| b.pop_front());
                        let (q, stamp) = b.expect("a bind-ok answers a bind");
                        if let Some(n) = stamp {
                            self.l.bound_seen.insert((ch.conn.0, q), n);
                        }
                    }
                    Reply::QueueUnbindOk if self.l.conns.contains(&ch.conn.0) => {
                        let q = self.l.unbinding.get_mut(&ch).and_then(|b| b.pop_front());
                        let q = q.expect("an unbind-ok answers an unbind");
                        self.l.unbinds_pending[usize::from(q)] -= 1;
                    }
                    Reply::QueuePurgeOk { message_count } => {
                        self.l.purged += u64::from(message_count);
                    }
                    Reply::QueueDeleteOk { message_count } => {
                        self.l.deleted += u64::from(message_count);
                        if self.l.conns.contains(&ch.conn.0) {
                            let d = self.l.deleting_t.get_mut(&ch).and_then(|d| d.pop_front());
                            let stamp = d.expect("a delete-ok answers a delete");
                            if let Some(n) = stamp {
                                self.l.t_deleted_seen.insert(ch.conn.0, n);
                            }
                        }
                    }
                    Reply::QueueDeclareOk { .. } if expected == Some(Expect::DeclareTOk) => {
                        self.l.t_declares_pending -= 1;
                    }
                    Reply::GetOk { delivery, .. } => {
                        let Some(Expect::Get { no_ack }) = expected else {
                            // A closing connection's get: the broker requeued it or lost
                            // it with the connection (`lost_in_flight`).
                            unreachable!("get-ok on a closed connection");
                        };
                        self.delivered(ch, &delivery, no_ack);
                    }
                    _ => {}
                }
            }
            Effect::Deliver {
                ch,
                consumer_tag,
                delivery,
            } => {
                *self.l.unwritten.entry(ch.conn.0).or_default() += 1;
                let no_ack = consumer_tag.ends_with("-noack");
                self.delivered(ch, &delivery, no_ack);
            }
            Effect::Confirm {
                ch,
                seq,
                multiple,
                ack,
            } => {
                if self.stale(ch) {
                    return;
                }
                let (sent, confirmed) = self
                    .l
                    .confirms
                    .get_mut(&ch)
                    .unwrap_or_else(|| panic!("{ch:?}: a confirm outside confirm mode"));
                assert!(ack, "{ch:?}: publish {seq} nacked");
                assert!(seq <= *sent, "{ch:?}: confirm {seq} of {sent} publishes");
                if multiple {
                    assert!(seq > *confirmed, "{ch:?}: confirm {seq} after {confirmed}");
                } else {
                    assert_eq!(seq, *confirmed + 1, "{ch:?}: confirms out of order");
                }
                *confirmed = seq;
            }
            Effect::Return { ch, message, .. } => {
                // Settled for good: the publisher has it back (even if it closed the
                // channel meanwhile, the publish was applied before the close).
                let id: u64 = std::str::from_utf8(&message.body)
                    .ok()
                    .and_then(|s| s.parse().ok())
                    .expect("body is an id");
                let q = self.l.origin[id as usize];
                assert!(
                    &*message.exchange == "amq.direct" || q == T_ORIGIN,
                    "message {id} returned but published to an existing queue"
                );
                if let Some(&n) = self.l.bound_seen.get(&(ch.conn.0, q)) {
                    assert!(
                        n != self.l.unbinds_sent[usize::from(q)]
                            || self.l.unbind_unknown[usize::from(q)],
                        "message {id} returned though its connection saw q{q} bound"
                    );
                }
                self.l.must_return.remove(&id);
                self.l.settled.push(id);
            }
            Effect::ChannelError { ch, error } => {
                // Only the bad ack, the bad bind and an op on a missing `t` fail a channel
                // here, and the client sent nothing after them: every earlier request was
                // answered first.
                let waiting = self.l.expect.get(&ch).map_or(0, |q| q.len());
                let risky = self.l.risky.remove(&ch);
                assert!(
                    waiting == 0 || (risky && waiting == 1 && error.code.code() == 404),
                    "{ch:?}: channel error {error:?} before the replies to earlier requests"
                );
                self.l.expect.remove(&ch);
                self.l.doomed.remove(&ch);
                self.l.confirms.remove(&ch);
                // The core requeued everything outstanding; the client forgets it.
                self.drop_channel(ch);
                self.h.op(ch, Op::ChannelCloseOk);
            }
            Effect::ConnectionError { conn, .. } => {
                panic!("unexpected connection error on {conn:?}")
            }
            Effect::ConsumerCancelled { ch, consumer_tag } => {
                // `t` was deleted under its consumer; its unacked deliveries stay out.
                if let Some(tags) = self.l.consumers.get_mut(&ch) {
                    tags.retain(|t| **t != *consumer_tag);
                }
            }
            _ => {}
        }
    }

    fn delivered(&mut self, c: ChannelRef, delivery: &Delivery, no_ack: bool) {
        let id: u64 = std::str::from_utf8(&delivery.message.body)
            .ok()
            .and_then(|s| s.parse().ok())
            .expect("body is an id");
        assert!(id < self.l.published, "invented message {id}");
        assert!(
            !self.l.rolled_back.contains(&id),
            "message {id} was rolled back"
        );
        let dead = &*delivery.message.routing_key == "dlq";
        assert!(
            !dead || self.l.origin[id as usize] == 0,
            "message {id} dead-lettered from a queue without a dead-letter exchange"
        );
        assert!(
            delivery.redelivered || self.l.seen.insert((dead, id)),
            "message {id} delivered twice without redelivered"
        );
        self.l.seen.insert((dead, id));
        let requeued_later = self.stale(c) || self.l.recovering.get(&c).is_some_and(|&n| n > 0);
        if no_ack {
            self.l.settled.push(id);
        } else if !requeued_later {
            let tag = delivery.delivery_tag;
            self.l
                .outstanding
                .entry(c)
                .or_default()
                .insert(tag, (id, dead));
        }
    }

    /// An op on `t`, which may be gone (404, closing the channel): the client sends nothing
    /// more on `c` until its answer (`risky`) comes.
    fn risk(&mut self, c: ChannelRef, queue: u8) {
        if queue == T_INDEX {
            self.l.doomed.insert(c);
            self.l.risky.insert(c);
        }
    }

    fn drop_channel(&mut self, c: ChannelRef) {
        // A closed or failed channel's open transaction is rolled back.
        if let Some(ids) = self.l.tx.remove(&c) {
            self.l.rolled_back.extend(ids);
        }
        self.l.outstanding.remove(&c);
        self.l.consumers.remove(&c);
        self.l.open.remove(&c);
        self.l.global_qos.remove(&c);
    }

    fn step(&mut self, op: SimOp) {
        let on = |i: u8| channel_of(i);
        let doomed = match &op {
            SimOp::Publish { ch, .. }
            | SimOp::Consume { ch, .. }
            | SimOp::Cancel { ch, .. }
            | SimOp::Get { ch, .. }
            | SimOp::Ack { ch, .. }
            | SimOp::Nack { ch, .. }
            | SimOp::BogusAck { ch }
            | SimOp::Recover { ch }
            | SimOp::Qos { ch, .. }
            | SimOp::CloseChannel { ch }
            | SimOp::Confirm { ch }
            | SimOp::Redeclare { ch, .. }
            | SimOp::Tx { ch, .. }
            | SimOp::Bind { ch, .. }
            | SimOp::BogusBind { ch }
            | SimOp::DeclareT { ch }
            | SimOp::DeleteT { ch }
            | SimOp::PublishT { ch }
            | SimOp::Purge { ch, .. } => self.l.doomed.contains(&on(*ch)),
            SimOp::CloseConnection { .. }
            | SimOp::Written { .. }
            | SimOp::Tick { .. }
            | SimOp::Mail { .. } => false,
        };
        if doomed {
            return;
        }
        match op {
            SimOp::Publish {
                ch: i,
                queue,
                direct,
            } => {
                let c = channel_of(i);
                self.ensure(c);
                if direct {
                    self.publish(c, queue, "amq.direct", format!("k{queue}"), true);
                } else {
                    self.publish(c, queue, "", format!("q{queue}"), false);
                }
            }
            SimOp::Consume {
                ch: i,
                queue,
                no_ack,
            } => {
                let c = channel_of(i);
                self.ensure(c);
                let queue = if queue == 1 && self.l.global_qos.contains(&c) {
                    2
                } else {
                    queue
                };
                self.l.next_tag += 1;
                let tag = format!("c{}{}", self.l.next_tag, if no_ack { "-noack" } else { "" });
                self.risk(c, queue);
                self.h_consume(c, &queue_name(queue), &tag, no_ack);
            }
            SimOp::Cancel { ch: i, which } => {
                let c = channel_of(i);
                let Some(tags) = self.l.consumers.get_mut(&c) else {
                    return;
                };
                if tags.is_empty() {
                    return;
                }
                let tag = tags.remove(usize::from(which) % tags.len());
                self.send(
                    c,
                    Op::Cancel {
                        consumer_tag: tag,
                        nowait: false,
                    },
                    Some(Expect::CancelOk),
                );
            }
            SimOp::Get {
                ch: i,
                queue,
                no_ack,
            } => {
                let c = channel_of(i);
                self.ensure(c);
                self.risk(c, queue);
                self.send(
                    c,
                    Op::Get {
                        queue: queue_name(queue),
                        no_ack,
                    },
                    Some(Expect::Get { no_ack }),
                );
            }
            SimOp::Ack {
                ch: i,
                which,
                multiple,
            } => self.settle(i, which, multiple, None),
            SimOp::Nack {
                ch: i,
                which,
                multiple,
                requeue,
            } => self.settle(i, which, multiple, Some(requeue)),
            SimOp::BogusAck { ch: i } => {
                let c = channel_of(i);
                self.ensure(c);
                if self.l.tx.contains_key(&c) {
                    // Buffered until commit; the model keeps settles out of transactions.
                    return;
                }
                self.l.doomed.insert(c);
                self.exec(
                    c,
                    Op::Ack {
                        delivery_tag: u64::MAX,
                        multiple: false,
                    },
                );
            }
            SimOp::Recover { ch: i } => {
                let c = channel_of(i);
                self.ensure(c);
                self.l.outstanding.remove(&c);
                *self.l.recovering.entry(c).or_default() += 1;
                self.send(c, Op::Recover { requeue: true }, Some(Expect::RecoverOk));
            }
            SimOp::Qos {
                ch: i,
                count,
                global,
            } => {
                let c = channel_of(i);
                self.ensure(c);
                if global && count > 0 {
                    self.l.global_qos.insert(c);
                } else if global {
                    self.l.global_qos.remove(&c);
                }
                self.send(
                    c,
                    Op::Qos {
                        prefetch_size: 0,
                        prefetch_count: u16::from(count),
                        global,
                    },
                    Some(Expect::QosOk),
                );
            }
            SimOp::CloseChannel { ch: i } => {
                let c = channel_of(i);
                if self.l.open.contains(&c) {
                    self.drop_channel(c);
                    self.l.confirms.remove(&c);
                    *self.l.closing.entry(c).or_default() += 1;
                    self.send(c, Op::ChannelClose, Some(Expect::CloseOk));
                }
            }
            SimOp::CloseConnection { conn } => {
                let conn = 1 + u64::from(conn);
                if self.l.conns.remove(&conn) {
                    for n in 1..=CHANNELS {
                        let c = ch(conn, n);
                        self.drop_channel(c);
                        let waiting = self.l.expect.remove(&c).unwrap_or_default();
                        self.l.binding.remove(&c);
                        self.l.deleting_t.remove(&c);
                        self.l.risky.remove(&c);
                        if waiting.contains(&Expect::DeclareTOk) {
                            self.l.t_unknown = true;
                            self.l.t_declares_pending -=
                                waiting.iter().filter(|e| **e == Expect::DeclareTOk).count() as u32;
                        }
                        for q in self.l.unbinding.remove(&c).unwrap_or_default() {
                            self.l.unbinds_pending[usize::from(q)] -= 1;
                            self.l.unbind_unknown[usize::from(q)] = true;
                        }
                        // A purge answered to nobody: how much it took is not known.
                        self.l.unanswered_purges += waiting
                            .iter()
                            .filter(|e| matches!(e, Expect::PurgeOk | Expect::DeleteOk))
                            .count();
                        self.l.closing.remove(&c);
                        self.l.recovering.remove(&c);
                        self.l.doomed.remove(&c);
                        self.l.confirms.remove(&c);
                    }
                    self.l.unwritten.remove(&conn);
                    self.exec(ch(conn, 0), Op::ConnectionClose);
                }
            }
            SimOp::Purge { ch: i, queue } => {
                let c = channel_of(i);
                self.ensure(c);
                self.send(
                    c,
                    Op::QueuePurge {
                        queue: queue_name(queue),
                        nowait: false,
                    },
                    Some(Expect::PurgeOk),
                );
            }
            SimOp::Written { conn } => {
                let conn = 1 + u64::from(conn);
                if let Some(n) = self.l.unwritten.remove(&conn) {
                    self.exec(ch(conn, 0), Op::Written { count: n });
                }
            }
            SimOp::Confirm { ch: i } => {
                let c = channel_of(i);
                self.ensure(c);
                if self.l.tx.contains_key(&c) {
                    return;
                }
                if let std::collections::btree_map::Entry::Vacant(e) = self.l.confirms.entry(c) {
                    e.insert((0, 0));
                    let select = Op::ConfirmSelect { nowait: false };
                    self.send(c, select, Some(Expect::ConfirmSelectOk));
                }
            }
            SimOp::Redeclare {
                ch: i,
                queue,
                passive,
            } => {
                let c = channel_of(i);
                self.ensure(c);
                let op = declare(queue_name(queue), passive, queue_args(queue));
                self.send(c, op, Some(Expect::DeclareOk));
            }
            SimOp::Tx { ch: i, what } => {
                let c = channel_of(i);
                self.ensure(c);
                match (what, self.l.tx.get_mut(&c)) {
                    (0, None) if !self.l.confirms.contains_key(&c) => {
                        self.l.tx.insert(c, Vec::new());
                        self.send(c, Op::TxSelect, Some(Expect::TxSelectOk));
                    }
                    (1, Some(ids)) => {
                        ids.clear();
                        self.send(c, Op::TxCommit, Some(Expect::TxCommitOk));
                    }
                    (2, Some(ids)) => {
                        let ids = std::mem::take(ids);
                        self.l.rolled_back.extend(ids);
                        self.send(c, Op::TxRollback, Some(Expect::TxRollbackOk));
                    }
                    _ => {}
                }
            }
            SimOp::Tick { ms } => {
                for e in self.h.tick(u64::from(ms)) {
                    self.trace.push(format!("{e:?}"));
                    self.observe(e);
                }
            }
            SimOp::Bind { ch: i, queue, add } => {
                let c = channel_of(i);
                self.ensure(c);
                let bind = Bind {
                    destination: queue_name(queue),
                    source: "amq.direct".into(),
                    routing_key: format!("k{queue}"),
                    nowait: false,
                    arguments: FieldTable::new(),
                };
                let qi = usize::from(queue);
                if add {
                    let stamp =
                        (self.l.unbinds_pending[qi] == 0).then_some(self.l.unbinds_sent[qi]);
                    self.l
                        .binding
                        .entry(c)
                        .or_default()
                        .push_back((queue, stamp));
                    self.send(c, Op::QueueBind(bind), Some(Expect::BindOk));
                } else {
                    self.l.unbinds_sent[qi] += 1;
                    self.l.unbinds_pending[qi] += 1;
                    self.l.unbinding.entry(c).or_default().push_back(queue);
                    self.send(c, Op::QueueUnbind(bind), Some(Expect::UnbindOk));
                }
            }
            SimOp::BogusBind { ch: i } => {
                let c = channel_of(i);
                self.ensure(c);
                if self.l.tx.contains_key(&c) {
                    // Its failure would roll the transaction back; the model keeps it simple.
                    return;
                }
                self.l.doomed.insert(c);
                let bind = Bind {
                    destination: queue_name(0),
                    source: "no-such-exchange".into(),
                    routing_key: String::new(),
                    nowait: false,
                    arguments: FieldTable::new(),
                };
                self.exec(c, Op::QueueBind(bind));
            }
            SimOp::DeclareT { ch: i } => {
                let c = channel_of(i);
                self.ensure(c);
                self.l.t_declares_sent += 1;
                self.l.t_declares_pending += 1;
                // A publish that must come back and has not yet was not applied yet (a
                // return is seen as it is applied): it may now reach the new `t`.
                self.l.must_return.clear();
                self.send(c, declare_t(), Some(Expect::DeclareTOk));
            }
            SimOp::DeleteT { ch: i } => {
                let c = channel_of(i);
                self.ensure(c);
                let stamp = (self.l.t_declares_pending == 0).then_some(self.l.t_declares_sent);
                self.l.deleting_t.entry(c).or_default().push_back(stamp);
                let delete = Op::QueueDelete {
                    queue: T.into(),
                    if_unused: false,
                    if_empty: false,
                    nowait: false,
                };
                self.send(c, delete, Some(Expect::DeleteOk));
            }
            SimOp::PublishT { ch: i } => {
                let c = channel_of(i);
                self.ensure(c);
                let seen_gone = self.l.t_deleted_seen.get(&c.conn.0);
                if seen_gone == Some(&self.l.t_declares_sent)
                    && !self.l.t_unknown
                    && !self.l.tx.contains_key(&c)
                {
                    self.l.must_return.insert(self.l.published);
                }
                self.publish(c, T_ORIGIN, "", T.into(), true);
            }
            SimOp::Mail { count, pick } => self.mail(count, pick),
        }
    }

    /// Publishes the next message id on `c`, recorded with `origin`.
    fn publish(&mut self, c: ChannelRef, origin: u8, exchange: &str, key: String, mandatory: bool) {
        let id = self.l.published;
        self.l.published += 1;
        self.l.origin.push(origin);
        if let Some(ids) = self.l.tx.get_mut(&c) {
            ids.push(id);
        }
        if let Some((sent, _)) = self.l.confirms.get_mut(&c) {
            *sent += 1;
        }
        let routed = self.host_routes.then(|| {
            // The host routes on the table of the publisher's shard: shard 0's, which the
            // other shards adopt before they see the mail it sent after it.
            let table = self.h.shards[0].routes();
            let vhost = table.vhost("/").expect("vhost /");
            table.route_publish(vhost, exchange, &key, None)
        });
        self.exec(
            c,
            Op::Publish(Box::new(Publish {
                exchange: exchange.into(),
                routing_key: key.into(),
                mandatory,
                immediate: false,
                properties: Properties::default(),
                body: id.to_string().into(),
                routed: routed.flatten(),
            })),
        );
    }

    fn h_consume(&mut self, c: ChannelRef, queue: &str, tag: &str, no_ack: bool) {
        self.l
            .expect
            .entry(c)
            .or_default()
            .push_back(Expect::ConsumeOk);
        let fx = self.h.consume(c, queue, tag, no_ack);
        for e in fx {
            self.trace.push(format!("{e:?}"));
            self.observe(e);
        }
    }

    fn settle(&mut self, i: u8, which: u8, multiple: bool, nack: Option<bool>) {
        let c = channel_of(i);
        if self.l.tx.contains_key(&c) {
            // A transaction's settles wait for its commit; the model keeps them out.
            return;
        }
        let Some(out) = self.l.outstanding.get_mut(&c) else {
            return;
        };
        if out.is_empty() {
            return;
        }
        let tags: Vec<u64> = out.keys().copied().collect();
        let tag = tags[usize::from(which) % tags.len()];
        let taken: Vec<(u64, bool)> = if multiple {
            let rest = out.split_off(&(tag + 1));
            std::mem::replace(out, rest).into_values().collect()
        } else {
            out.remove(&tag).into_iter().collect()
        };
        for (id, dead) in taken {
            match nack {
                Some(true) => {} // back in its queue
                // Rejected from q0: dead-lettered to dlq, where the drain finds it.
                Some(false) if !dead && self.l.origin[id as usize] == 0 => {}
                _ => self.l.settled.push(id),
            }
        }
        let op = match nack {
            None => Op::Ack {
                delivery_tag: tag,
                multiple,
            },
            Some(requeue) => Op::Nack {
                delivery_tag: tag,
                multiple,
                requeue,
            },
        };
        self.exec(c, op);
    }

    /// Closes everything, drains every queue, and checks conservation.
    fn finish(mut self) -> Vec<String> {
        // What is still on its way arrives, and the replies it carries are checked.
        while self.h.mail_pending() > 0 {
            self.mail(8, 0);
        }
        for (c, waiting) in &self.l.expect {
            if self.l.conns.contains(&c.conn.0) {
                assert!(waiting.is_empty(), "{c:?} still waits for {waiting:?}");
            }
        }
        for (c, (sent, confirmed)) in &self.l.confirms {
            assert_eq!(sent, confirmed, "{c:?}: publishes left unconfirmed");
        }
        assert!(
            self.l.must_return.is_empty(),
            "publishes to t after their connection saw it deleted, not returned: {:?}",
            self.l.must_return
        );
        for conn in 1..=CONNS {
            if self.l.conns.remove(&conn) {
                for n in 1..=CHANNELS {
                    self.drop_channel(ch(conn, n));
                }
                self.exec(ch(conn, 0), Op::ConnectionClose);
            }
        }
        self.h.set_mail_scheduled(false);
        self.l.outstanding.clear();
        self.connect(9);
        self.send(ch(9, 1), declare_t(), Some(Expect::DeclareOk));
        let names = (0..=QUEUES as u8).map(queue_name).chain([T.to_string()]);
        for name in names {
            loop {
                let before = self.l.settled.len();
                self.send(
                    ch(9, 1),
                    Op::Get {
                        queue: name.clone(),
                        no_ack: true,
                    },
                    Some(Expect::Get { no_ack: true }),
                );
                if self.l.settled.len() == before {
                    break;
                }
            }
        }
        let unique: BTreeSet<u64> = self.l.settled.iter().copied().collect();
        assert_eq!(
            unique.len(),
            self.l.settled.len(),
            "a message was settled twice"
        );
        let lost = self.h.sum(Broker::lost_in_flight);
        let rolled_back = self.l.rolled_back.len() as u64;
        let gone = self.l.deleted
            + self.h.sum(Broker::routed_to_deleted)
            + self.h.sum(Broker::requeued_to_deleted);
        let accounted = unique.len() as u64 + self.l.purged + lost + rolled_back + gone;
        if self.l.unanswered_purges > 0 {
            // Some purges took an unknown number: nothing may be invented, at least.
            assert!(
                accounted <= self.l.published,
                "messages invented: {accounted} of {}",
                self.l.published
            );
            return self.trace;
        }
        assert_eq!(
            accounted,
            self.l.published,
            "messages lost or invented (settled {}, purged {}, lost with a closed channel {}, \
             rolled back {rolled_back}, deleted with t {gone}, published {})",
            unique.len(),
            self.l.purged,
            lost,
            self.l.published
        );
        self.trace
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn random_operations_conserve_messages(ops in prop::collection::vec(sim_op(), 1..300)) {
        let mut sim = Sim::new();
        for op in ops.iter().cloned() {
            sim.step(op);
        }
        sim.finish();
    }

    /// The same, with the mail between queues, channels and topology taking random time,
    /// publishes routed by the broker or by the host.
    #[test]
    fn mail_in_flight_conserves_messages_and_reply_order(
        ops in prop::collection::vec(scheduled_op(), 1..300),
        host_routes in any::<bool>(),
    ) {
        let mut sim = Sim::new();
        sim.host_routes = host_routes;
        sim.h.set_mail_scheduled(true);
        for op in ops.iter().cloned() {
            sim.step(op);
        }
        sim.finish();
    }

    /// The same over 2 or 3 shards: queues, channels and topology on different shards,
    /// the mail between shards on FIFO links, delivered in random order across links.
    #[test]
    fn shards_conserve_messages_and_reply_order(
        ops in prop::collection::vec(scheduled_op(), 1..300),
        host_routes in any::<bool>(),
        k in 2u32..=3,
    ) {
        let mut sim = Sim::sharded(k);
        sim.host_routes = host_routes;
        sim.h.set_mail_scheduled(true);
        for op in ops.iter().cloned() {
            sim.step(op);
        }
        sim.finish();
    }

    #[test]
    fn same_inputs_same_effects(ops in prop::collection::vec(sim_op(), 1..150)) {
        let run = |ops: &[SimOp]| {
            let mut sim = Sim::new();
            for op in ops.iter().cloned() {
                sim.step(op);
            }
            sim.finish()
        };
        prop_assert_eq!(run(&ops), run(&ops));
    }

    /// The two compositions agree: publishes routed by the host on the table give the same
    /// effects, in the same order, as publishes the broker routes itself.
    #[test]
    fn host_routing_gives_the_same_effects(ops in prop::collection::vec(sim_op(), 1..150)) {
        let run = |ops: &[SimOp], host_routes: bool| {
            let mut sim = Sim::new();
            sim.host_routes = host_routes;
            for op in ops.iter().cloned() {
                sim.step(op);
            }
            sim.finish()
        };
        prop_assert_eq!(run(&ops, true), run(&ops, false));
    }
}
