//! RabbitMQ semantics of the core, op by op.

mod common;

use common::*;
use warren_core::BrokerConfig;
use warren_core::command::{Bind, Op, QueueDeclare};
use warren_core::effect::{Effect, Reply};
use warren_core::message::FieldTable;

#[test]
fn publish_consume_ack_through_default_exchange() {
    let mut h = Harness::new();
    let c = h.connect(1);
    h.declare(c, "q");
    assert!(h.publish(c, "", "q", "hello").is_empty());
    let fx = h.consume(c, "q", "t", false);
    assert_eq!(
        fx[0],
        Effect::Reply {
            ch: c,
            reply: Reply::ConsumeOk {
                consumer_tag: "t".into()
            }
        }
    );
    assert_eq!(
        deliveries(&fx),
        vec![("t".into(), 1, false, "hello".into())]
    );
    assert!(
        h.op(
            c,
            Op::Ack {
                delivery_tag: 1,
                multiple: false
            }
        )
        .is_empty()
    );
    assert_eq!(h.shards[0].queue_len("q"), Some(0));
}

#[test]
fn round_robin_between_consumers() {
    let mut h = Harness::new();
    let c = h.connect(1);
    h.declare(c, "q");
    h.consume(c, "q", "a", true);
    h.consume(c, "q", "b", true);
    let tags: Vec<String> = (0..4)
        .flat_map(|i| deliveries(&h.publish(c, "", "q", &i.to_string())))
        .map(|d| d.0)
        .collect();
    assert_eq!(tags, ["a", "b", "a", "b"]);
}

#[test]
fn per_consumer_prefetch_limits_unacked() {
    let mut h = Harness::new();
    let c = h.connect(1);
    h.declare(c, "q");
    h.op(
        c,
        Op::Qos {
            prefetch_size: 0,
            prefetch_count: 2,
            global: false,
        },
    );
    for i in 0..5 {
        h.publish(c, "", "q", &i.to_string());
    }
    let fx = h.consume(c, "q", "t", false);
    assert_eq!(bodies(&fx), ["0", "1"]);
    let fx = h.op(
        c,
        Op::Ack {
            delivery_tag: 2,
            multiple: true,
        },
    );
    assert_eq!(bodies(&fx), ["2", "3"]);
}

#[test]
fn global_prefetch_is_shared_by_the_channel() {
    let mut h = Harness::new();
    let c = h.connect(1);
    h.declare(c, "q1");
    h.declare(c, "q2");
    h.op(
        c,
        Op::Qos {
            prefetch_size: 0,
            prefetch_count: 3,
            global: true,
        },
    );
    for i in 0..3 {
        h.publish(c, "", "q1", &format!("a{i}"));
        h.publish(c, "", "q2", &format!("b{i}"));
    }
    let mut got = bodies(&h.consume(c, "q1", "t1", false));
    got.extend(bodies(&h.consume(c, "q2", "t2", false)));
    assert_eq!(got, ["a0", "a1", "a2"]);
    let fx = h.op(
        c,
        Op::Ack {
            delivery_tag: 1,
            multiple: false,
        },
    );
    assert_eq!(bodies(&fx), ["b0"]);
}

#[test]
fn requeued_message_returns_to_its_original_position_redelivered() {
    let mut h = Harness::new();
    let c = h.connect(1);
    h.declare(c, "q");
    for b in ["m1", "m2", "m3"] {
        h.publish(c, "", "q", b);
    }
    for _ in 0..2 {
        h.op(
            c,
            Op::Get {
                queue: "q".into(),
                no_ack: false,
            },
        );
    }
    // m1 (tag 1) and m2 (tag 2) are out; requeue m2 then m1: order must be m1, m2, m3.
    h.op(
        c,
        Op::Reject {
            delivery_tag: 2,
            requeue: true,
        },
    );
    h.op(
        c,
        Op::Nack {
            delivery_tag: 1,
            multiple: false,
            requeue: true,
        },
    );
    let fx = h.consume(c, "q", "t", true);
    let d = deliveries(&fx);
    assert_eq!(
        d.iter().map(|d| (d.3.as_str(), d.2)).collect::<Vec<_>>(),
        [("m1", true), ("m2", true), ("m3", false)]
    );
}

#[test]
fn mandatory_unroutable_is_returned_before_its_confirm() {
    let mut h = Harness::new();
    let c = h.connect(1);
    assert_eq!(
        h.op(c, Op::ConfirmSelect { nowait: false }),
        vec![Effect::Reply {
            ch: c,
            reply: Reply::ConfirmSelectOk
        }]
    );
    let fx = h.publish_full(c, "amq.direct", "nowhere", "x", true);
    assert!(matches!(
        fx[0],
        Effect::Return {
            reply_code: 312,
            reply_text: "NO_ROUTE",
            ..
        }
    ));
    assert_eq!(
        fx[1],
        Effect::Confirm {
            ch: c,
            seq: 1,
            multiple: false,
            ack: true
        }
    );
    let fx = h.publish_full(c, "amq.direct", "nowhere", "y", false);
    assert_eq!(
        fx,
        vec![Effect::Confirm {
            ch: c,
            seq: 2,
            multiple: false,
            ack: true
        }]
    );
}

/// A commit that published a persistent message to a durable queue is answered once the
/// sync that makes it durable completed (RabbitMQ's tx.commit-ok means on disk); a commit of
/// transient messages is answered at once; a failed sync closes the connection (541).
#[test]
fn commit_ok_of_persistent_messages_waits_for_the_sync() {
    use bytes::Bytes;
    use std::sync::Arc;
    use warren_core::command::Publish;
    use warren_core::message::Properties;
    let mut h = Harness {
        shards: warren_core::shards::Shards::new(vec![warren_core::Broker::with_store(
            BrokerConfig::default(),
            Box::new(warren_core::store::MemoryStore::new()),
        )]),
        now: 0,
    };
    let c = h.connect(1);
    h.declare_with(c, "q", true, false, false);
    while let Some(epoch) = h.shards[0].start_sync() {
        h.shards[0].synced(h.now, epoch);
    }
    h.op(c, Op::TxSelect);
    let publish = |persistent: bool| {
        Op::Publish(Box::new(Publish {
            exchange: Arc::from(""),
            routing_key: Arc::from("q"),
            mandatory: false,
            immediate: false,
            properties: Properties {
                delivery_mode: Some(if persistent { 2 } else { 1 }),
                ..Properties::default()
            },
            body: Bytes::from_static(b"m"),
            routed: None,
        }))
    };
    let commit_ok = Effect::Reply {
        ch: c,
        reply: Reply::TxCommitOk,
    };
    h.op(c, publish(false));
    assert_eq!(
        h.op(c, Op::TxCommit),
        vec![commit_ok.clone()],
        "transient: at once"
    );
    h.op(c, publish(true));
    assert_eq!(
        h.op(c, Op::TxCommit),
        vec![],
        "persistent: waits for the sync"
    );
    assert_eq!(
        h.op(
            c,
            Op::Qos {
                prefetch_size: 0,
                prefetch_count: 1,
                global: false
            }
        ),
        vec![],
        "and so does what follows"
    );
    let epoch = h.shards[0].start_sync().expect("a sync is due");
    let mut fx = Vec::new();
    h.shards[0].poll_effects(&mut fx);
    assert_eq!(fx, vec![], "not before it completes");
    h.shards[0].synced(h.now, epoch);
    h.shards[0].poll_effects(&mut fx);
    let qos_ok = Effect::Reply {
        ch: c,
        reply: Reply::QosOk,
    };
    assert_eq!(fx, vec![commit_ok, qos_ok]);
    h.op(c, publish(true));
    h.op(c, Op::TxCommit);
    let epoch = h.shards[0].start_sync().expect("a sync is due");
    h.shards[0].sync_failed(h.now, epoch);
    fx.clear();
    h.shards[0].poll_effects(&mut fx);
    assert!(
        matches!(fx.as_slice(), [Effect::ConnectionError { error, .. }] if error.code.code() == 541),
        "{fx:?}"
    );
}

#[test]
fn transactions_defer_publishes_and_acks() {
    let mut h = Harness::new();
    let c = h.connect(1);
    h.declare(c, "q");
    h.op(c, Op::TxSelect);
    h.publish(c, "", "q", "a");
    assert_eq!(h.shards[0].queue_len("q"), Some(0));
    h.op(c, Op::TxRollback);
    h.op(c, Op::TxCommit);
    assert_eq!(h.shards[0].queue_len("q"), Some(0));
    h.publish(c, "", "q", "b");
    assert_eq!(
        h.op(c, Op::TxCommit),
        vec![Effect::Reply {
            ch: c,
            reply: Reply::TxCommitOk
        }]
    );
    assert_eq!(h.shards[0].queue_len("q"), Some(1));
    assert_eq!(
        error_code(&h.op(c, Op::ConfirmSelect { nowait: false })),
        Some(406)
    );
}

#[test]
fn closing_a_channel_requeues_unacked_as_redelivered() {
    let mut h = Harness::new();
    let c1 = h.connect(1);
    h.declare(c1, "q");
    h.publish(c1, "", "q", "m");
    h.consume(c1, "q", "t", false);
    assert_eq!(
        h.op(c1, Op::ChannelClose),
        vec![Effect::Reply {
            ch: c1,
            reply: Reply::ChannelCloseOk
        }]
    );
    let c2 = h.connect(2);
    let fx = h.consume(c2, "q", "t2", false);
    assert_eq!(deliveries(&fx), vec![("t2".into(), 1, true, "m".into())]);
}

#[test]
fn exclusive_queues_are_locked_and_die_with_their_connection() {
    let mut h = Harness::new();
    let c1 = h.connect(1);
    let c2 = h.connect(2);
    h.declare_with(c1, "ex", false, true, false);
    let fx = h.consume(c2, "ex", "t", false);
    assert_eq!(error_code(&fx), Some(405));
    // Binding is decided by topology's copy of the queue's owner, not the queue.
    let bind = |queue: &str| {
        Op::QueueBind(Bind {
            destination: queue.into(),
            source: "amq.fanout".into(),
            routing_key: String::new(),
            nowait: false,
            arguments: FieldTable::new(),
        })
    };
    let other = h.open(2, 2);
    assert_eq!(error_code(&h.op(other, bind("ex"))), Some(405));
    let fx = h.op(c1, bind("ex"));
    assert_eq!(
        fx,
        vec![Effect::Reply {
            ch: c1,
            reply: Reply::QueueBindOk
        }]
    );
    h.publish(c1, "amq.fanout", "", "m");
    assert_eq!(h.shards[0].queue_len("ex"), Some(1));
    h.op(ch(1, 0), Op::ConnectionClose);
    assert_eq!(h.shards[0].queue_len("ex"), None);
    // Its binding went with it.
    assert!(h.shards[0].list_bindings().is_empty());
}

#[test]
fn auto_delete_queue_goes_with_its_last_consumer() {
    let mut h = Harness::new();
    let c = h.connect(1);
    h.declare_with(c, "ad", false, false, true);
    h.consume(c, "ad", "t", false);
    h.op(
        c,
        Op::Cancel {
            consumer_tag: "t".into(),
            nowait: false,
        },
    );
    assert_eq!(h.shards[0].queue_len("ad"), None);
}

#[test]
fn deleting_a_queue_cancels_its_consumers() {
    let mut h = Harness::new();
    let c1 = h.connect(1);
    let c2 = h.connect(2);
    h.declare(c1, "q");
    h.consume(c2, "q", "t", false);
    let fx = h.op(
        c1,
        Op::QueueDelete {
            queue: "q".into(),
            if_unused: false,
            if_empty: false,
            nowait: false,
        },
    );
    assert!(fx.contains(&Effect::ConsumerCancelled {
        ch: c2,
        consumer_tag: "t".into()
    }));
    assert!(fx.contains(&Effect::Reply {
        ch: c1,
        reply: Reply::QueueDeleteOk { message_count: 0 }
    }));
}

#[test]
fn unknown_delivery_tag_is_a_channel_error_that_leaves_other_channels_alone() {
    let mut h = Harness::new();
    let c = h.connect(1);
    let other = h.open(1, 2);
    let fx = h.op(
        c,
        Op::Ack {
            delivery_tag: 7,
            multiple: false,
        },
    );
    match fx.as_slice() {
        [Effect::ChannelError { ch: errch, error }] => {
            assert_eq!(*errch, c);
            assert_eq!(error.code.code(), 406);
            assert_eq!(error.text, "PRECONDITION_FAILED - unknown delivery tag 7");
        }
        other => panic!("{other:?}"),
    }
    // Ops on the failed channel are dropped until the close handshake completes.
    assert!(h.publish(c, "", "x", "y").is_empty());
    h.op(c, Op::ChannelCloseOk);
    h.open(1, 1);
    assert_eq!(h.declare(other, "still-works"), "still-works");
}

#[test]
fn a_host_refusal_is_that_channels_error_and_changes_nothing() {
    // A cluster host whose metadata change could not commit refuses the request (Op::Refuse).
    let mut h = Harness::new();
    let c = h.connect(1);
    let other = h.open(1, 2);
    let refused = warren_core::error::ProtocolError::new(
        warren_core::error::ErrorCode::PreconditionFailed,
        warren_core::command::OpKind::QueueDeclare,
        "cluster metadata store unavailable",
    );
    match h.op(c, Op::Refuse(refused.clone())).as_slice() {
        [Effect::ChannelError { ch, error }] => {
            assert_eq!(*ch, c);
            assert_eq!(*error, refused);
        }
        other => panic!("{other:?}"),
    }
    assert!(h.publish(c, "", "x", "y").is_empty());
    h.op(c, Op::ChannelCloseOk);
    assert_eq!(h.declare(other, "still-works"), "still-works");
}

#[test]
fn passive_declare_of_a_missing_queue_is_404() {
    let mut h = Harness::new();
    let c = h.connect(1);
    let fx = h.passive_declare(c, "missing");
    match fx.as_slice() {
        [Effect::ChannelError { error, .. }] => {
            assert_eq!(error.text, "NOT_FOUND - no queue 'missing' in vhost '/'")
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn server_named_queues_and_consumer_tags_are_generated() {
    let mut h = Harness::new();
    let c = h.connect(1);
    let q = h.declare(c, "");
    assert!(q.starts_with("amq.gen-") && q.len() == 30, "{q}");
    let fx = h.consume(c, "", "", true);
    match &fx[0] {
        Effect::Reply {
            reply: Reply::ConsumeOk { consumer_tag },
            ..
        } => {
            assert!(consumer_tag.starts_with("amq.ctag-"))
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn write_window_holds_deliveries_until_written() {
    let mut h = Harness::with_config(BrokerConfig {
        write_window: 2,
        ..BrokerConfig::default()
    });
    let c = h.connect(1);
    h.declare(c, "q");
    h.consume(c, "q", "t", true);
    let mut got = Vec::new();
    for i in 0..4 {
        got.extend(bodies(&h.publish(c, "", "q", &i.to_string())));
    }
    assert_eq!(got, ["0", "1"]);
    let fx = h.op(ch(1, 0), Op::Written { count: 2 });
    assert_eq!(bodies(&fx), ["2", "3"]);
}

#[test]
fn reserved_names_and_redeclare_mismatches_are_refused() {
    let mut h = Harness::new();
    let c = h.connect(1);
    let fx = h.op(
        c,
        Op::QueueDeclare(QueueDeclare {
            queue: "amq.mine".into(),
            passive: false,
            durable: false,
            exclusive: false,
            auto_delete: false,
            nowait: false,
            arguments: FieldTable::new(),
        }),
    );
    assert_eq!(error_code(&fx), Some(403));
    let c = h.open(1, 2);
    h.declare(c, "d");
    let fx = h.op(
        c,
        Op::QueueDeclare(QueueDeclare {
            queue: "d".into(),
            passive: false,
            durable: true,
            exclusive: false,
            auto_delete: false,
            nowait: false,
            arguments: FieldTable::new(),
        }),
    );
    assert_eq!(error_code(&fx), Some(406));
}

#[test]
fn exchange_to_exchange_and_alternate_exchange_routing() {
    let mut h = Harness::new();
    let c = h.connect(1);
    h.exchange(c, "src", "direct", FieldTable::new());
    h.exchange(c, "dst", "fanout", FieldTable::new());
    let mut args = FieldTable::new();
    args.insert(
        "alternate-exchange".into(),
        warren_core::message::FieldValue::string("dst"),
    );
    h.exchange(c, "with-ae", "direct", args);
    h.declare(c, "q");
    h.bind(c, "q", "dst", "");
    let fx = h.op(
        c,
        Op::ExchangeBind(warren_core::command::Bind {
            destination: "dst".into(),
            source: "src".into(),
            routing_key: "k".into(),
            nowait: false,
            arguments: FieldTable::new(),
        }),
    );
    assert_eq!(
        fx,
        vec![Effect::Reply {
            ch: c,
            reply: Reply::ExchangeBindOk
        }]
    );
    h.publish(c, "src", "k", "via-e2e");
    h.publish(c, "src", "other", "dropped");
    h.publish(c, "with-ae", "any", "via-ae");
    let fx = h.consume(c, "q", "t", true);
    assert_eq!(bodies(&fx), ["via-e2e", "via-ae"]);
}

#[test]
fn memory_alarm_blocks_every_connection_above_the_watermark_and_clears_below() {
    let mut h = Harness::with_config(BrokerConfig {
        memory_high_watermark: 10,
        ..BrokerConfig::default()
    });
    let c1 = h.connect(1);
    h.connect(2);
    h.declare(c1, "q");
    assert!(
        h.publish(c1, "", "q", "12345678").is_empty(),
        "8 bytes: under"
    );
    let fx = h.publish(c1, "", "q", "123");
    assert_eq!(
        fx,
        vec![
            Effect::Blocked {
                conn: ch(1, 0).conn
            },
            Effect::Blocked {
                conn: ch(2, 0).conn
            }
        ]
    );
    assert_eq!(h.shards[0].stored_bytes(), 11);
    // A connection opened during the alarm is blocked at once.
    let fx = h.op(
        ch(3, 0),
        Op::ConnectionOpen {
            vhost: "/".into(),
            user: "guest".into(),
            cancel_notify: true,
        },
    );
    assert_eq!(
        fx,
        vec![Effect::Blocked {
            conn: ch(3, 0).conn
        }]
    );
    // Consuming without ack releases the bytes and clears the alarm, once publishers were
    // blocked for the hold (`ALARM_HOLD_MS`: at most about one change a second).
    let fx = h.consume(c1, "q", "t", true);
    assert_eq!(bodies(&fx), ["12345678", "123"]);
    assert_eq!(h.shards[0].stored_bytes(), 0);
    assert!(!fx.iter().any(|e| matches!(e, Effect::Unblocked { .. })));
    assert!(
        h.shards[0].next_deadline().is_some(),
        "a tick is due when the hold ends"
    );
    let fx = h.tick(warren_core::broker::ALARM_HOLD_MS);
    assert!(fx.contains(&Effect::Unblocked {
        conn: ch(2, 0).conn
    }));
}

/// Blocked / unblocked effects for connection 1 in `fx`: +1 per block, -1 per unblock.
fn alarm_changes(fx: &[Effect]) -> Vec<bool> {
    fx.iter()
        .filter_map(|e| match e {
            Effect::Blocked { conn } if *conn == ch(1, 0).conn => Some(true),
            Effect::Unblocked { conn } if *conn == ch(1, 0).conn => Some(false),
            _ => None,
        })
        .collect()
}

#[test]
fn memory_alarm_clears_only_well_below_the_watermark_so_a_draining_queue_does_not_flap() {
    let mut h = Harness::with_config(BrokerConfig {
        memory_high_watermark: 100,
        ..BrokerConfig::default()
    });
    let publisher = h.connect(1);
    let consumer = h.connect(2);
    h.declare(publisher, "q");
    let mut changes = Vec::new();
    for _ in 0..11 {
        changes.extend(alarm_changes(&h.publish(publisher, "", "q", "0123456789")));
    }
    assert_eq!(changes, [true], "110 bytes > 100: raised once");
    // A consumer takes one message at a time while the publisher (as a blocked client
    // whose publishes were already read) adds one after each: at the watermark this
    // flipped the alarm on every message.
    for _ in 0..20 {
        let get = Op::Get {
            queue: "q".into(),
            no_ack: true,
        };
        changes.extend(alarm_changes(&h.op(consumer, get)));
        changes.extend(alarm_changes(&h.publish(publisher, "", "q", "0123456789")));
    }
    assert_eq!(
        changes,
        [true],
        "between 90 and 110 bytes: still raised, no flapping"
    );
    // Drained to 90% of the watermark: cleared, once (the hold since the block is over).
    h.tick(warren_core::broker::ALARM_HOLD_MS);
    let mut drained = Vec::new();
    for _ in 0..2 {
        let get = Op::Get {
            queue: "q".into(),
            no_ack: true,
        };
        drained.extend(alarm_changes(&h.op(consumer, get)));
    }
    assert_eq!(h.shards[0].stored_bytes(), 90);
    assert_eq!(drained, [false], "cleared at 90 bytes");
    // Refilling to the watermark itself does not raise it again; passing it does.
    assert!(alarm_changes(&h.publish(publisher, "", "q", "0123456789")).is_empty());
    assert_eq!(
        alarm_changes(&h.publish(publisher, "", "q", "0")),
        [true],
        "101 bytes"
    );
}

#[test]
fn the_hosts_memory_figure_and_free_disk_space_raise_the_alarm_with_hysteresis() {
    use warren_core::Resources;
    let mut h = Harness::with_config(BrokerConfig {
        memory_high_watermark: 1000,
        disk_free_limit: 500,
        ..BrokerConfig::default()
    });
    h.connect(1);
    // Each report a second after the last: past the hold (`ALARM_HOLD_MS`).
    let mut now = 0;
    let mut report = |h: &mut Harness, memory: Option<u64>, disk_free: Option<u64>| {
        now += warren_core::broker::ALARM_HOLD_MS;
        h.shards[0].report_resources(now, Resources { memory, disk_free });
        let mut fx = Vec::new();
        h.shards[0].poll_effects(&mut fx);
        (alarm_changes(&fx), h.shards[0].alarms())
    };
    // The queues hold nothing, but the process holds more than the watermark (its RSS):
    // blocked, until the figure falls to 90% of it.
    assert_eq!(report(&mut h, Some(1001), None).0, [true]);
    assert!(h.shards[0].alarms().memory);
    assert_eq!(report(&mut h, Some(950), None).0, []);
    let (changes, alarms) = report(&mut h, Some(900), None);
    assert_eq!(changes, [false]);
    assert!(!alarms.any());
    // Free disk below the limit: blocked until 10% above it.
    assert_eq!(report(&mut h, Some(0), Some(499)).0, [true]);
    assert_eq!(report(&mut h, Some(0), Some(540)).0, []);
    // Both alarms at once are one block; clearing one keeps publishers blocked.
    let (changes, alarms) = report(&mut h, Some(5000), Some(540));
    assert_eq!(changes, []);
    assert!(alarms.memory && alarms.disk);
    let (changes, alarms) = report(&mut h, Some(5000), Some(550));
    assert_eq!(changes, []);
    assert!(alarms.memory && !alarms.disk);
    assert_eq!(report(&mut h, Some(10), Some(550)).0, [false]);
    // Not measured (or no limit): no alarm.
    assert_eq!(report(&mut h, None, Some(0)).0, [true]);
    assert_eq!(report(&mut h, None, None).0, [false]);
}

#[test]
fn publishers_stay_blocked_for_the_hold_so_the_alarm_changes_at_most_about_once_a_second() {
    use warren_core::Resources;
    use warren_core::broker::ALARM_HOLD_MS;
    let mut h = Harness::with_config(BrokerConfig {
        memory_high_watermark: 1000,
        ..BrokerConfig::default()
    });
    h.connect(1);
    let mut changes = Vec::new();
    // The figure swings across the watermark every millisecond for 3 s.
    for ms in 1..=3000u64 {
        let memory = if ms % 2 == 0 { 2000 } else { 0 };
        h.shards[0].report_resources(
            ms,
            Resources {
                memory: Some(memory),
                disk_free: None,
            },
        );
        let mut fx = Vec::new();
        h.shards[0].poll_effects(&mut fx);
        changes.extend(alarm_changes(&fx));
    }
    assert!(
        changes.len() <= 2 * (3000 / ALARM_HOLD_MS as usize) + 1,
        "{} changes in 3 s",
        changes.len()
    );
    // Recovered for good: unblocked by the tick the hold asks for.
    h.shards[0].report_resources(
        3001,
        Resources {
            memory: Some(0),
            disk_free: None,
        },
    );
    let due = h.shards[0]
        .next_deadline()
        .expect("a tick at the hold's end");
    h.shards[0].tick(due);
    let mut fx = Vec::new();
    h.shards[0].poll_effects(&mut fx);
    assert!(!h.shards[0].publishers_blocked());
}

#[test]
fn flow_control_paces_pure_publishers_to_their_consumers() {
    let mut h = Harness::with_config(BrokerConfig {
        flow_ready_high: 4,
        write_window: 1,
        ..BrokerConfig::default()
    });
    let publisher = h.connect(1);
    let consumer = h.connect(2);
    h.declare(publisher, "q");
    // No consumer yet: the queue buffers, nobody is paused.
    for i in 0..6 {
        assert!(h.publish(publisher, "", "q", &i.to_string()).is_empty());
    }
    // A consumer whose write window holds one delivery at a time: the backlog stays.
    let fx = h.consume(consumer, "q", "t", true);
    assert_eq!(bodies(&fx), ["0"]);
    let fx = h.publish(publisher, "", "q", "6");
    assert_eq!(
        fx,
        vec![Effect::FlowPaused {
            conn: ch(1, 0).conn
        }]
    );
    // A connection that consumes is never paused, whatever it publishes.
    assert!(
        !h.publish(consumer, "", "q", "7")
            .contains(&Effect::FlowResumed {
                conn: ch(2, 0).conn
            })
    );
    assert!(
        !h.publish(consumer, "", "q", "8")
            .iter()
            .any(|e| matches!(e, Effect::FlowPaused { .. }))
    );
    // Draining to half the mark (2) resumes the publisher.
    let mut resumed = false;
    for _ in 0..10 {
        let fx = h.op(ch(2, 0), Op::Written { count: 1 });
        resumed |= fx.contains(&Effect::FlowResumed {
            conn: ch(1, 0).conn,
        });
        if resumed {
            break;
        }
    }
    assert!(resumed);
    assert!(h.shards[0].queue_len("q").is_some_and(|n| n <= 2));
}

/// A queue drained by basic.get while its consumers wait for credit resumes the publishers
/// it paused: before, only a dispatch checked for the drain, and a consumer without credit
/// never dispatches, so the publisher stayed paused at an empty queue until that consumer
/// wrote something.
#[test]
fn a_queue_drained_by_basic_get_resumes_its_paused_publisher() {
    let mut h = Harness::with_config(BrokerConfig {
        flow_ready_high: 4,
        write_window: 1,
        ..BrokerConfig::default()
    });
    let publisher = h.connect(1);
    let consumer = h.connect(2);
    let getter = h.connect(3);
    h.declare(publisher, "q");
    for i in 0..6 {
        h.publish(publisher, "", "q", &i.to_string());
    }
    // The consumer's window holds one delivery, and it never reports it written.
    assert_eq!(bodies(&h.consume(consumer, "q", "t", true)), ["0"]);
    assert_eq!(
        h.publish(publisher, "", "q", "6"),
        vec![Effect::FlowPaused {
            conn: publisher.conn
        }]
    );
    let mut resumed = false;
    for _ in 0..6 {
        let fx = h.op(
            getter,
            Op::Get {
                queue: "q".into(),
                no_ack: true,
            },
        );
        resumed |= fx.contains(&Effect::FlowResumed {
            conn: publisher.conn,
        });
    }
    assert_eq!(h.shards[0].queue_len("q"), Some(0));
    assert!(resumed, "the publisher stays paused at an empty queue");
}

/// Flow control, the write window and paging together (issue 21, one_fast stalls): a
/// publisher that obeys `FlowPaused` (with a few publishes already on their way, as the
/// runtime's in-flight batches allow), an autoack consumer whose host reports writes in
/// random chunks, a store that pages the queue out. Whatever the interleaving, once the
/// publisher stops and the host reports every delivery written, the queue drains to empty
/// and the publisher is resumed: no wake-up is lost between the pause, the window and a
/// refill from the store.
#[test]
fn flow_control_the_write_window_and_paging_never_strand_a_paused_publisher() {
    for seed in 1..=12u64 {
        let mut rng = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let mut next = |n: u64| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng % n.max(1)
        };
        let mut h = Harness::sharded_with_stores(
            BrokerConfig {
                flow_ready_high: 64,
                write_window: 16,
                queue_window: 8,
                ..BrokerConfig::default()
            },
            1,
        );
        let publisher = h.connect(1);
        let consumer = h.connect(2);
        h.declare(publisher, "q");
        let mut unwritten = 0u32;
        let mut paused = false;
        let mut published = 0u64;
        let mut received = 0u64;
        let count = |fx: &[Effect], unwritten: &mut u32, received: &mut u64, paused: &mut bool| {
            for e in fx {
                match e {
                    Effect::Deliver { .. } => {
                        *unwritten += 1;
                        *received += 1;
                    }
                    Effect::FlowPaused { conn } if conn.0 == 1 => *paused = true,
                    Effect::FlowResumed { conn } if conn.0 == 1 => *paused = false,
                    _ => {}
                }
            }
        };
        let fx = h.consume(consumer, "q", "c", true);
        count(&fx, &mut unwritten, &mut received, &mut paused);
        let mut late = 0;
        for _ in 0..1000 {
            match next(3) {
                // Publishes: while paused, only those already on their way (a few).
                0 | 1 if !paused || late < 8 => {
                    if paused {
                        late += 1;
                    } else {
                        late = 0;
                    }
                    for _ in 0..=next(10) {
                        let fx = h.publish(publisher, "", "q", "m");
                        published += 1;
                        count(&fx, &mut unwritten, &mut received, &mut paused);
                    }
                }
                _ if unwritten > 0 => {
                    let n = 1 + next(u64::from(unwritten)) as u32;
                    unwritten -= n;
                    let fx = h.op(ch(2, 0), Op::Written { count: n });
                    count(&fx, &mut unwritten, &mut received, &mut paused);
                }
                _ => {}
            }
        }
        // The publisher stops; the host writes everything it is given.
        let mut rounds = 0;
        while unwritten > 0 {
            rounds += 1;
            assert!(rounds < 100_000, "seed {seed}: does not drain");
            let n = unwritten;
            unwritten = 0;
            let fx = h.op(ch(2, 0), Op::Written { count: n });
            count(&fx, &mut unwritten, &mut received, &mut paused);
        }
        assert_eq!(
            (received, h.shards[0].queue_len("q")),
            (published, Some(0)),
            "seed {seed}: every message reached the consumer (paused: {paused})"
        );
        assert!(
            !paused,
            "seed {seed}: the drained queue resumed its publisher"
        );
    }
}
