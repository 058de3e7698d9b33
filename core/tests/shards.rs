//! A broker of several shards run in one thread (ARCHITECTURE.md, "warren-runtime"): a
//! queue lives on the shard of the connection that declared it, and a consumer on another
//! shard takes its channel's limits that span queues (global prefetch, the connection's
//! write window) through the channel's shared record.

mod common;

use common::*;
use std::sync::Arc;
use warren_core::command::{Op, Publish};
use warren_core::effect::Effect;
use warren_core::message::{FieldTable, FieldValue, Properties};
use warren_core::{Broker, BrokerConfig};

/// Two shards: connection 2 (shard 0) declares `q` and publishes `n` messages to it;
/// connection 1 (shard 1) is the consumer's.
fn two_shards(config: BrokerConfig, n: usize) -> (Harness, warren_core::ids::ChannelRef) {
    let mut h = Harness::sharded(config, 2);
    let owner = h.connect(2);
    h.declare(owner, "q");
    for i in 0..n {
        h.publish(owner, "", "q", &i.to_string());
    }
    assert_eq!(h.shards[0].queue_len("q"), Some(n), "q lives on shard 0");
    let c = h.connect(1);
    (h, c)
}

fn qos(h: &mut Harness, c: warren_core::ids::ChannelRef, count: u16, global: bool) {
    let fx = h.op(
        c,
        Op::Qos {
            prefetch_size: 0,
            prefetch_count: count,
            global,
        },
    );
    assert_eq!(fx.len(), 1, "qos-ok: {fx:?}");
}

#[test]
fn a_consumer_on_another_shard_gets_messages_within_its_global_prefetch() {
    let (mut h, c) = two_shards(BrokerConfig::default(), 5);
    qos(&mut h, c, 2, true);
    let fx = h.consume(c, "q", "remote", false);
    let got = deliveries(&fx);
    assert_eq!(
        got.len(),
        2,
        "the global prefetch holds on shard 0: {got:?}"
    );
    assert_eq!(bodies(&fx), ["0", "1"]);
    // An ack frees one: the queue on shard 0 hears of it and sends one more.
    let fx = h.op(
        c,
        Op::Ack {
            delivery_tag: got[0].1,
            multiple: false,
        },
    );
    assert_eq!(bodies(&fx), ["2"]);
    // A second consumer on the same channel, of a queue on its own shard, shares the
    // limit: nothing more while two are unacked.
    h.declare(c, "local");
    h.publish(c, "", "local", "x");
    let fx = h.consume(c, "local", "local", false);
    assert!(
        deliveries(&fx).is_empty(),
        "over the shared prefetch: {fx:?}"
    );
    let fx = h.op(
        c,
        Op::Ack {
            delivery_tag: 0,
            multiple: true,
        },
    );
    assert_eq!(
        deliveries(&fx).len(),
        2,
        "both queues fill the freed credit: {fx:?}"
    );
}

#[test]
fn a_remote_no_ack_consumer_stops_at_its_connections_write_window() {
    let config = BrokerConfig {
        write_window: 3,
        ..Default::default()
    };
    let (mut h, c) = two_shards(config, 5);
    let fx = h.consume(c, "q", "remote", true);
    assert_eq!(bodies(&fx), ["0", "1", "2"], "three written at most");
    let fx = h.op(ch(1, 0), Op::Written { count: 2 });
    assert_eq!(
        bodies(&fx),
        ["3", "4"],
        "the window reopened on shard 1 reaches shard 0"
    );
    assert_eq!(h.shards[0].queue_len("q"), Some(0));
}

#[test]
fn a_closed_remote_channel_takes_no_more_credit_and_its_deliveries_go_back() {
    let (mut h, c) = two_shards(BrokerConfig::default(), 3);
    qos(&mut h, c, 1, true);
    let fx = h.consume(c, "q", "remote", false);
    assert_eq!(bodies(&fx), ["0"]);
    // With mail that takes time, the channel closes (its unacked delivery requeued, its
    // shared prefetch free again) while its consumer's cancel travels to shard 0. A
    // publish there makes q dispatch before the cancel arrives: the closed opening must
    // take nothing (a delivery sent to it would bounce back flagged redelivered).
    h.set_mail_scheduled(true);
    h.op(c, Op::ChannelClose);
    let owner = ch(2, 1);
    h.publish(owner, "", "q", "3");
    let mut fx = Vec::new();
    while let Some(more) = h.deliver_mail(0) {
        fx.extend(more);
    }
    assert!(
        !fx.iter().any(|e| matches!(e, Effect::Deliver { .. })),
        "nothing for a closed channel: {fx:?}"
    );
    h.set_mail_scheduled(false);
    assert_eq!(
        h.shards[0].queue_len("q"),
        Some(4),
        "all back in q on shard 0"
    );
    let again = h.open(1, 2);
    let fx = h.consume(again, "q", "again", true);
    let got: Vec<(String, bool)> = deliveries(&fx)
        .into_iter()
        .map(|(_, _, redelivered, body)| (body, redelivered))
        .collect();
    let expected = [("0", true), ("1", false), ("2", false), ("3", false)];
    let expected: Vec<(String, bool)> = expected.iter().map(|(b, r)| (b.to_string(), *r)).collect();
    assert_eq!(
        got, expected,
        "only the delivery the close requeued is redelivered"
    );
    assert_eq!(h.sum(Broker::lost_in_flight), 0);
}

/// A delivery that bounces off a channel closed while it travelled gives its write-window
/// credit back as a written one does: when it had filled the window, the connection's other
/// queues, stopped by it, are dispatched again. Before, the credit came back silently: the
/// other queue waited for an `Op::Written` that never came (nothing else was in flight),
/// and its consumer got nothing until something was published to that queue. Every
/// interleaving of the mail in 64 seeded orders.
#[test]
fn a_bounced_delivery_reopens_the_write_window_for_the_connections_other_queues() {
    let mut stalled_before = 0;
    for seed in 0..64u64 {
        let config = BrokerConfig {
            write_window: 1,
            ..Default::default()
        };
        let (mut h, a) = two_shards(config, 3);
        let owner = ch(2, 1);
        h.declare(owner, "q2");
        h.publish(owner, "", "q2", "b");
        let fx = h.consume(a, "q", "a", true);
        assert_eq!(bodies(&fx), ["0"], "the window (1) is full");
        let b = h.open(1, 2);
        let fx = h.consume(b, "q2", "b", true);
        assert!(
            deliveries(&fx).is_empty(),
            "q2 waits for the window: {fx:?}"
        );
        // The window reopens: q and q2 are dispatched, in some order.
        h.set_mail_scheduled(true);
        h.op(ch(1, 0), Op::Written { count: 1 });
        let mut rng = seed;
        let mut pick = || {
            rng = rng
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (rng >> 33) as usize
        };
        let mut fx = Vec::new();
        while h.shards[0].queue_len("q") == Some(2) {
            match h.deliver_mail(pick()) {
                Some(more) => fx.extend(more),
                None => break,
            }
        }
        if h.shards[0].queue_len("q") == Some(1) {
            // q took the window for `a`, and `a` closes while that delivery travels.
            stalled_before += 1;
            h.op(a, Op::ChannelClose);
        }
        while let Some(more) = h.deliver_mail(pick()) {
            fx.extend(more);
        }
        h.set_mail_scheduled(false);
        assert_eq!(
            bodies(&fx),
            ["b"],
            "seed {seed}: the window reached q2 (or the bounced delivery's credit did)"
        );
        assert_eq!(h.shards[0].queue_len("q2"), Some(0));
    }
    assert!(stalled_before > 0, "some orders bounce a delivery");
}

/// An operator's op runs on shard 0 (`Broker::admin`); one on a queue of another shard is
/// answered there later, and the admin channel is not left waiting: the next admin op
/// runs at once.
#[test]
fn admin_ops_on_a_queue_of_another_shard_do_not_wedge_the_admin_channel() {
    let mut h = Harness::sharded(BrokerConfig::default(), 2);
    let c = h.connect(1);
    h.declare(c, "q");
    for i in 0..3 {
        h.publish(c, "", "q", &i.to_string());
    }
    let now = h.now;
    let purge = Op::QueuePurge {
        queue: "q".into(),
        nowait: false,
    };
    // Answered later, by mail from shard 1: the answer is kept for the host under the
    // op's token, with the count (`warren ctl purge-queue` prints it).
    let request = warren_core::admin::AdminRequest::Op {
        vhost: "/".into(),
        op: purge,
    };
    assert!(matches!(
        h.shards[0].apply_admin(now, request),
        warren_core::admin::AdminResponse::Op(Ok(None))
    ));
    let token = h.shards[0]
        .take_admin_deferral()
        .expect("the purge waits for shard 1");
    h.settle();
    assert_eq!(h.shard(1).queue_len("q"), Some(0), "purged on shard 1");
    let mut answers = Vec::new();
    h.shards[0].take_admin_answers(&mut answers);
    assert_eq!(
        answers,
        [(
            token,
            Ok(Some(warren_core::effect::Reply::QueuePurgeOk {
                message_count: 3
            }))
        )]
    );
    h.publish(c, "", "q", "x");
    let declare = Op::QueueDeclare(warren_core::command::QueueDeclare {
        queue: "fresh".into(),
        passive: false,
        durable: false,
        exclusive: false,
        auto_delete: false,
        nowait: false,
        arguments: Default::default(),
    });
    let reply = h.shards[0].admin(now, "/", declare);
    assert!(
        matches!(
            reply,
            Ok(Some(warren_core::effect::Reply::QueueDeclareOk { .. })) | Ok(None)
        ),
        "{reply:?}"
    );
    h.settle();
    let again = h.open(1, 2);
    let fx = h.passive_declare(again, "fresh");
    assert!(
        matches!(
            fx.as_slice(),
            [Effect::Reply {
                reply: warren_core::effect::Reply::QueueDeclareOk { .. },
                ..
            }]
        ),
        "the admin declare after the purge ran: {fx:?}"
    );
}

/// Publishes a persistent message to `queue` through the default exchange.
fn publish_persistent(
    h: &mut Harness,
    c: warren_core::ids::ChannelRef,
    queue: &str,
) -> Vec<Effect> {
    h.op(
        c,
        Op::Publish(Box::new(Publish {
            exchange: Arc::from(""),
            routing_key: Arc::from(queue),
            mandatory: false,
            immediate: false,
            properties: Properties {
                delivery_mode: Some(2),
                ..Properties::default()
            },
            body: bytes::Bytes::from_static(b"p"),
            routed: None,
        })),
    )
}

fn confirms(fx: &[Effect]) -> Vec<(u64, bool)> {
    fx.iter()
        .filter_map(|e| match e {
            Effect::Confirm { seq, ack, .. } => Some((*seq, *ack)),
            _ => None,
        })
        .collect()
}

/// A persistent message on a durable queue of another shard is confirmed once that
/// shard's sync covers it, not the publisher's; a failed sync there nacks it.
#[test]
fn a_remote_durable_publish_is_confirmed_after_the_owners_sync() {
    let mut h = Harness::sharded_with_stores(BrokerConfig::default(), 2);
    let owner = h.connect(2);
    h.declare_with(owner, "d", true, false, false);
    h.sync(0, true);
    let c = h.connect(1);
    h.op(c, Op::ConfirmSelect { nowait: false });
    let fx = publish_persistent(&mut h, c, "d");
    assert!(confirms(&fx).is_empty(), "not durable yet: {fx:?}");
    assert!(
        confirms(&h.sync(1, true)).is_empty(),
        "the publisher's sync covers nothing"
    );
    assert_eq!(
        confirms(&h.sync(0, true)),
        [(1, true)],
        "the owner's sync does"
    );
    publish_persistent(&mut h, c, "d");
    assert_eq!(
        confirms(&h.sync(0, false)),
        [(2, false)],
        "a failed sync nacks"
    );
}

/// A transaction's commit-ok waits for the sync of every shard its persistent messages
/// went to.
#[test]
fn a_remote_durable_commit_waits_for_the_owners_sync() {
    let mut h = Harness::sharded_with_stores(BrokerConfig::default(), 2);
    let owner = h.connect(2);
    h.declare_with(owner, "d", true, false, false);
    h.sync(0, true);
    let c = h.connect(1);
    h.op(c, Op::TxSelect);
    publish_persistent(&mut h, c, "d");
    let commit_ok = |fx: &[Effect]| {
        fx.iter().any(|e| {
            matches!(
                e,
                Effect::Reply {
                    reply: warren_core::effect::Reply::TxCommitOk,
                    ..
                }
            )
        })
    };
    let fx = h.op(c, Op::TxCommit);
    assert!(!commit_ok(&fx), "not durable yet: {fx:?}");
    assert!(!commit_ok(&h.sync(1, true)));
    assert!(commit_ok(&h.sync(0, true)), "durable on shard 0");
}

/// The memory alarm counts the bytes of every shard: a publisher on shard 1 filling a queue
/// on shard 0 past the watermark is blocked, and unblocked once a consumer drains it.
#[test]
fn the_memory_alarm_counts_every_shard() {
    let config = BrokerConfig {
        memory_high_watermark: 10,
        ..Default::default()
    };
    let mut h = Harness::sharded(config, 2);
    let owner = h.connect(2);
    h.declare(owner, "q");
    let c = h.connect(1);
    let blocked = |fx: &[Effect], conn: u64| {
        fx.iter()
            .any(|e| matches!(e, Effect::Blocked { conn: c } if c.0 == conn))
    };
    let mut fx = Vec::new();
    for i in 0..4 {
        fx.extend(h.publish(c, "", "q", &format!("body{i}")));
    }
    assert!(
        blocked(&fx, 1),
        "20 bytes on shard 0 block shard 1's publisher: {fx:?}"
    );
    let fx = h.consume(owner, "q", "drain", true);
    assert_eq!(deliveries(&fx).len(), 4);
    // Past the hold (`ALARM_HOLD_MS`); shard 1 rechecks the shared count on its timer.
    let fx = h.tick(warren_core::broker::ALARM_HOLD_MS + 200);
    assert!(
        fx.iter()
            .any(|e| matches!(e, Effect::Unblocked { conn } if conn.0 == 1)),
        "drained on shard 0: shard 1 looks again and unblocks: {fx:?}"
    );
}

/// Each shard names queues on its own: a server-named queue of one shard's client must not
/// be the one another shard's client was given (a second client would share it, or be
/// refused its own exclusive queue).
#[test]
fn server_named_queues_of_two_shards_differ() {
    let mut h = Harness::sharded(BrokerConfig::default(), 2);
    let a = h.connect(2);
    let b = h.connect(1);
    let qa = h.declare_with(a, "", false, true, false);
    let qb = h.declare_with(b, "", false, true, false);
    assert!(qa.starts_with("amq.gen-") && qb.starts_with("amq.gen-"));
    assert_ne!(qa, qb, "two shards drew the same name");
}

/// The multi-shard composition's admin rule (`AdminRequest::replica`): a vhost, a user's
/// permissions and a policy an operator adds reach every shard, so a connection on shard 1
/// may open the vhost and its queue there takes the policy set later; listings gather
/// every shard's.
#[test]
fn an_operators_changes_reach_every_shard_and_listings_gather_them() {
    use warren_core::access::{PermissionDef, VhostDef};
    use warren_core::admin::{AdminRequest, AdminResponse};
    let mut h = Harness::sharded(BrokerConfig::default(), 2);
    let now = h.now;
    let done = |r: AdminResponse| matches!(r, AdminResponse::Done(Ok(())));
    let vhost = VhostDef {
        name: "v".into(),
        description: String::new(),
    };
    assert!(done(h.shards.admin(now, AdminRequest::AddVhost(vhost))));
    let perms = PermissionDef {
        user: "guest".into(),
        vhost: "v".into(),
        configure: ".*".into(),
        write: ".*".into(),
        read: ".*".into(),
    };
    assert!(done(
        h.shards.admin(now, AdminRequest::SetPermissions(perms))
    ));
    // Connection 1 is shard 1's: it opens "v" only if the vhost and the permissions
    // reached shard 1.
    let open = Op::ConnectionOpen {
        vhost: "v".into(),
        user: "guest".into(),
        cancel_notify: true,
    };
    assert_eq!(h.op(ch(1, 0), open), vec![], "shard 1 knows vhost v");
    let c = h.open(1, 1);
    h.declare(c, "capped");
    let zero = h.connect(2);
    h.declare(zero, "on-zero");
    for body in ["a", "b"] {
        h.publish(c, "", "capped", body);
    }
    // The policy comes after the queue: shard 1 applies it to the queue it owns.
    let policy = warren_core::policy::PolicyDef {
        vhost: "v".into(),
        name: "cap".into(),
        pattern: ".*".into(),
        apply_to: warren_core::policy::ApplyTo::Queues,
        priority: 0,
        definition: FieldTable::from([("max-length".into(), FieldValue::I64(1))]),
    };
    assert!(done(h.shards.admin(h.now, AdminRequest::SetPolicy(policy))));
    let AdminResponse::Queues(queues) = h.shards.admin(h.now, AdminRequest::ListQueues) else {
        panic!("a queue listing");
    };
    let listed: Vec<(&str, &str, u64)> = queues
        .iter()
        .map(|q| (q.vhost.as_str(), q.name.as_str(), q.messages_ready))
        .collect();
    assert_eq!(
        listed,
        [("/", "on-zero", 0), ("v", "capped", 1)],
        "both shards listed; shard 1's queue got the policy (max-length 1)"
    );
}
