//! Operators' message counters (`warren_core::stats`): per queue, channel, connection and
//! vhost; what closed channels and connections counted stays in their connection's and
//! vhost's totals, so rates computed from them never go negative. Also the operator's
//! close of a connection (320 with the reason) and the run-time memory watermark.

mod common;

use common::*;
use warren_core::command::Op;
use warren_core::effect::Effect;
use warren_core::stats::MessageStats;

fn stats(publish: u64, deliver_get: u64, redeliver: u64, ack: u64) -> MessageStats {
    MessageStats {
        publish,
        deliver_get,
        redeliver,
        ack,
    }
}

#[test]
fn counters_follow_publishes_deliveries_redeliveries_and_acks() {
    let mut h = Harness::new();
    let p = h.connect(1);
    let c = h.connect(2);
    h.declare(p, "q");
    for body in ["a", "b", "c"] {
        h.publish(p, "", "q", body);
    }
    h.publish(p, "", "nowhere", "unrouted");
    let fx = h.consume(c, "q", "t", false);
    assert_eq!(deliveries(&fx).len(), 3);
    // Ack the first, requeue the other two: they come back redelivered.
    h.op(
        c,
        Op::Ack {
            delivery_tag: 1,
            multiple: false,
        },
    );
    let fx = h.op(
        c,
        Op::Nack {
            delivery_tag: 3,
            multiple: true,
            requeue: true,
        },
    );
    let again = deliveries(&fx);
    assert_eq!(again.len(), 2);
    assert!(again.iter().all(|d| d.2), "redelivered: {again:?}");

    let queue = &h.shards[0].list_queues()[0];
    assert_eq!(queue.stats, stats(3, 5, 2, 1), "the queue's");
    let channels = h.shards[0].list_channels();
    let of = |conn: u64| {
        channels
            .iter()
            .find(|i| i.conn.0 == conn)
            .expect("channel listed")
            .stats
    };
    assert_eq!(
        of(1),
        stats(4, 0, 0, 0),
        "the publisher's channel counts unrouted too"
    );
    assert_eq!(of(2), stats(0, 5, 2, 1), "the consumer's channel");

    // A basic.get counts as a delivery; acks of a closed channel stay in its connection.
    h.declare(p, "r");
    h.publish(p, "", "r", "got");
    let g = h.open(2, 2);
    let fx = h.op(
        g,
        Op::Get {
            queue: "r".into(),
            no_ack: true,
        },
    );
    assert!(
        fx.iter().any(|e| matches!(
            e,
            Effect::Reply {
                reply: warren_core::effect::Reply::GetOk { .. },
                ..
            }
        )),
        "{fx:?}"
    );
    h.op(g, Op::ChannelClose);
    h.op(g, Op::ChannelCloseOk);
    let conn = |h: &Harness, id: u64| {
        h.shards[0]
            .list_connections()
            .into_iter()
            .find(|i| i.conn.0 == id)
            .map(|i| i.stats)
    };
    assert_eq!(conn(&h, 2), Some(stats(0, 6, 2, 1)), "closed channel kept");
    assert_eq!(
        h.shards[0].list_queues()[1].stats,
        stats(1, 1, 0, 0),
        "queue r's"
    );

    // A closed connection's counts stay in its vhost's.
    h.op(ch(1, 0), Op::ConnectionClose);
    assert_eq!(conn(&h, 1), None);
    assert_eq!(
        h.shards[0].vhost_stats(),
        vec![("/".to_string(), stats(5, 6, 2, 1))]
    );
    h.shards[0].check_invariants().expect("invariants");
}

#[test]
fn an_operator_closes_a_connection_with_320_and_the_reason() {
    let mut h = Harness::new();
    let c = h.connect(7);
    h.declare(c, "q");
    h.consume(c, "q", "t", false);
    assert!(h.shards[0].close_connection(c.conn, "maintenance window"));
    let mut fx = Vec::new();
    h.shards[0].poll_effects(&mut fx);
    assert!(
        fx.iter()
            .any(|e| matches!(e, Effect::ConnectionError { conn, error }
            if conn.0 == 7 && error.code.code() == 320
                && error.text == "CONNECTION_FORCED - maintenance window")),
        "{fx:?}"
    );
    assert!(h.shards[0].list_connections().is_empty());
    assert!(h.shards[0].list_consumers().is_empty(), "its consumer went");
    assert!(
        !h.shards[0].close_connection(c.conn, "again"),
        "already gone"
    );
    h.shards[0].check_invariants().expect("invariants");
}

#[test]
fn the_memory_watermark_changes_at_run_time() {
    let mut h = Harness::new();
    let c = h.connect(1);
    h.declare(c, "q");
    h.publish(c, "", "q", "0123456789");
    assert!(!h.shards[0].memory_status().alarm);
    h.shards[0].set_memory_high_watermark(h.now, 5);
    let mut fx = Vec::new();
    h.shards[0].poll_effects(&mut fx);
    assert!(fx.contains(&Effect::Blocked { conn: c.conn }), "{fx:?}");
    let status = h.shards[0].memory_status();
    assert!(status.alarm);
    assert_eq!((status.held, status.watermark), (10, 5));
    // Cleared once the alarm has been held its minimum time (no flapping).
    let later = h.now + warren_core::broker::ALARM_HOLD_MS;
    h.shards[0].set_memory_high_watermark(later, 1 << 30);
    fx.clear();
    h.shards[0].poll_effects(&mut fx);
    assert!(fx.contains(&Effect::Unblocked { conn: c.conn }), "{fx:?}");
}

/// The broker's own status messages (the MQTT `$SYS` topics) reach their subscribers but
/// are not counted as publishes: the vhost's stats show what clients publish, so an idle
/// broker has no publish rate. An operator's publish through the admin channel counts.
#[test]
fn status_publishes_are_delivered_but_not_counted() {
    use warren_core::admin::{AdminRequest, AdminResponse};
    let mut h = Harness::new();
    let c = h.connect(1);
    h.declare(c, "q");
    let message = |body: &'static str| {
        Box::new(warren_core::command::Publish {
            exchange: "".into(),
            routing_key: "q".into(),
            mandatory: false,
            immediate: false,
            properties: Default::default(),
            body: bytes::Bytes::from_static(body.as_bytes()),
            routed: None,
        })
    };
    let now = h.now;
    for body in ["status 1", "status 2"] {
        let answer = h.shards.admin(
            now,
            AdminRequest::StatusPublish {
                vhost: "/".into(),
                publish: message(body),
            },
        );
        assert!(matches!(answer, AdminResponse::Op(Ok(_))), "{answer:?}");
    }
    let answer = h.shards.admin(
        now,
        AdminRequest::Op {
            vhost: "/".into(),
            op: Op::Publish(message("operator")),
        },
    );
    assert!(matches!(answer, AdminResponse::Op(Ok(_))), "{answer:?}");
    let fx = h.consume(c, "q", "t", true);
    assert_eq!(bodies(&fx), ["status 1", "status 2", "operator"]);
    assert_eq!(
        h.shards[0].vhost_stats(),
        vec![("/".to_string(), stats(1, 3, 0, 0))],
        "only the operator's publish counts; the deliveries all do"
    );
    h.shards[0].check_invariants().expect("invariants");
}
