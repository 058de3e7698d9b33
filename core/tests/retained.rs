//! MQTT retained messages kept by the core (topology, per vhost): set, replace, clear,
//! filters, expiry, bounds, permissions, vhost deletion, with shards, and through a store
//! across a crash and restore.

mod common;

use bytes::Bytes;
use common::*;
use std::sync::Arc;
use warren_core::access::{PermissionDef, VhostDef};
use warren_core::command::Op;
use warren_core::effect::{Effect, Reply};
use warren_core::ids::ChannelRef;
use warren_core::mqtt::RetainedMessage;
use warren_core::store::MemoryStore;
use warren_core::{Broker, BrokerConfig};

fn msg(topic: &str, payload: &str, expiry_ms: Option<u64>) -> Box<RetainedMessage> {
    Box::new(RetainedMessage {
        topic: Arc::from(topic),
        qos: 1,
        payload: Bytes::copy_from_slice(payload.as_bytes()),
        properties: Default::default(),
        stored_at: 0,
        expiry_ms,
    })
}

fn retain(h: &mut Harness, c: ChannelRef, topic: &str, payload: &str) -> Vec<Effect> {
    h.op(
        c,
        Op::Retain {
            message: msg(topic, payload, None),
            durable: true,
        },
    )
}

/// The payloads `filter` gets, in topic order.
fn get(h: &mut Harness, c: ChannelRef, filter: &str, max: u32) -> Vec<String> {
    let fx = h.op(
        c,
        Op::RetainedGet {
            filter: filter.into(),
            max,
        },
    );
    match fx.as_slice() {
        [
            Effect::Reply {
                reply: Reply::Retained { messages },
                ..
            },
        ] => messages
            .iter()
            .map(|m| format!("{}={}", m.topic, String::from_utf8_lossy(&m.payload)))
            .collect(),
        other => panic!("expected one Retained reply, got {other:?}"),
    }
}

fn stored(fx: &[Effect]) -> bool {
    match fx {
        [
            Effect::Reply {
                reply: Reply::RetainOk { stored },
                ..
            },
        ] => *stored,
        other => panic!("expected RetainOk, got {other:?}"),
    }
}

#[test]
fn set_replace_clear_and_filters() {
    let mut h = Harness::new();
    let c = h.connect(1);
    assert!(stored(&retain(&mut h, c, "home/kitchen/temp", "21")));
    assert!(stored(&retain(&mut h, c, "home/kitchen/temp", "22")));
    assert!(stored(&retain(&mut h, c, "home/hall/temp", "19")));
    assert!(stored(&retain(&mut h, c, "$SYS/uptime", "5")));
    assert_eq!(
        get(&mut h, c, "home/+/temp", 10),
        ["home/hall/temp=19", "home/kitchen/temp=22"]
    );
    assert_eq!(
        get(&mut h, c, "home/kitchen/temp", 10),
        ["home/kitchen/temp=22"]
    );
    assert_eq!(get(&mut h, c, "#", 10).len(), 2, "# does not match $SYS");
    assert_eq!(get(&mut h, c, "#", 1), ["home/hall/temp=19"], "max");
    // An empty payload clears the topic.
    assert!(stored(&retain(&mut h, c, "home/hall/temp", "")));
    assert_eq!(get(&mut h, c, "home/#", 10), ["home/kitchen/temp=22"]);
}

#[test]
fn expiry_counts_from_the_retain_op() {
    let mut h = Harness::new();
    let c = h.connect(1);
    let at = h.now + 1;
    h.op(
        c,
        Op::Retain {
            message: msg("t", "v", Some(100)),
            durable: true,
        },
    );
    h.now = at + 98;
    assert_eq!(get(&mut h, c, "t", 10), ["t=v"]);
    h.now = at + 99;
    assert!(get(&mut h, c, "t", 10).is_empty());
    assert!(get(&mut h, c, "#", 10).is_empty());
    assert_eq!(h.shards[0].retained_stats(), [("/".to_string(), 0, 0)]);
}

/// A new topic beyond the vhost's count bound is refused (`stored: false`); replacing a
/// topic's message is not; the bytes bound refuses big payloads.
#[test]
fn bounds_per_vhost() {
    let mut h = Harness::with_config(BrokerConfig {
        max_retained_messages: 2,
        max_retained_bytes: 10,
        ..BrokerConfig::default()
    });
    let c = h.connect(1);
    assert!(stored(&retain(&mut h, c, "a", "1")));
    assert!(stored(&retain(&mut h, c, "b", "2")));
    assert!(!stored(&retain(&mut h, c, "c", "3")));
    assert!(stored(&retain(&mut h, c, "a", "111111111")));
    assert!(!stored(&retain(&mut h, c, "b", "22")));
    assert_eq!(get(&mut h, c, "#", 10), ["a=111111111", "b=2"]);
}

#[test]
fn permissions_apply_as_to_amq_topic() {
    let mut h = Harness::new();
    h.shards[0]
        .set_permissions(
            0,
            PermissionDef {
                user: "guest".into(),
                vhost: "/".into(),
                configure: ".*".into(),
                write: "^$".into(),
                read: ".*".into(),
            },
        )
        .expect("permissions");
    let c = h.connect(1);
    let fx = retain(&mut h, c, "t", "v");
    assert_eq!(error_code(&fx), Some(403), "{fx:?}");
}

#[test]
fn vhosts_keep_their_own_and_a_deleted_vhost_takes_its_messages_from_the_store() {
    let store = MemoryStore::new();
    let mut b = Broker::with_store(BrokerConfig::default(), Box::new(store.clone()));
    assert!(b.restore(0, &store.definitions()).is_empty());
    b.add_vhost(
        0,
        VhostDef {
            name: "dev".into(),
            description: String::new(),
        },
    )
    .expect("vhost");
    b.set_permissions(
        0,
        PermissionDef {
            user: "guest".into(),
            vhost: "dev".into(),
            configure: ".*".into(),
            write: ".*".into(),
            read: ".*".into(),
        },
    )
    .expect("permissions");
    let mut h = Harness {
        shards: warren_core::shards::Shards::new(vec![b]),
        now: 0,
    };
    let slash = h.connect(1);
    h.op(
        ch(2, 0),
        Op::ConnectionOpen {
            vhost: "dev".into(),
            user: "guest".into(),
            cancel_notify: true,
        },
    );
    let dev = h.open(2, 1);
    retain(&mut h, slash, "t", "slash");
    retain(&mut h, dev, "t", "dev");
    assert_eq!(get(&mut h, slash, "t", 10), ["t=slash"]);
    assert_eq!(get(&mut h, dev, "t", 10), ["t=dev"]);
    assert_eq!(store.definitions().retained.len(), 2);
    h.shards[0].delete_vhost(h.now, "dev").expect("delete");
    let left = store.definitions().retained;
    assert_eq!(left.len(), 1);
    assert_eq!(left[0].0, "/");
}

/// Durable retained messages survive a crash once synced; a non-durable one (the
/// broker's `$SYS` topics) and an expired one do not come back.
#[test]
fn durable_ones_survive_a_crash_and_restore() {
    let store = MemoryStore::new();
    let mut h = Harness {
        shards: warren_core::shards::Shards::new(vec![Broker::with_store(
            BrokerConfig::default(),
            Box::new(store.clone()),
        )]),
        now: 1_000,
    };
    let c = h.connect(1);
    retain(&mut h, c, "kept", "1");
    retain(&mut h, c, "cleared", "2");
    retain(&mut h, c, "cleared", "");
    h.op(
        c,
        Op::Retain {
            message: msg("$SYS/x", "3", None),
            durable: false,
        },
    );
    h.op(
        c,
        Op::Retain {
            message: msg("short", "4", Some(50)),
            durable: true,
        },
    );
    retain(&mut h, c, "unsynced", "5");
    let epoch = h.shards[0].start_sync().expect("a sync");
    assert_eq!(store.complete_sync(), Some(epoch));
    // Written after the sync started: lost in the crash.
    let fx = retain(&mut h, c, "late", "6");
    assert!(stored(&fx));
    store.crash();
    let mut b = Broker::with_store(BrokerConfig::default(), Box::new(store.clone()));
    let now = h.now + 100;
    assert!(b.restore(now, &store.definitions()).is_empty());
    let mut h = Harness {
        shards: warren_core::shards::Shards::new(vec![b]),
        now,
    };
    let c = h.connect(1);
    assert_eq!(get(&mut h, c, "#", 10), ["kept=1", "unsynced=5"]);
    assert!(get(&mut h, c, "$SYS/#", 10).is_empty());
    // The expired one is gone from the store too.
    assert_eq!(store.definitions().retained.len(), 2);
}

/// With shards, every connection's retained messages meet in topology (shard 0), in the
/// order each connection sent them, with mail taking its time.
#[test]
fn shards_share_one_set_in_order() {
    let mut h = Harness::sharded(BrokerConfig::default(), 3);
    let c1 = h.connect(1);
    let c2 = h.connect(2);
    h.set_mail_scheduled(true);
    h.op(
        c1,
        Op::Retain {
            message: msg("t", "first", None),
            durable: true,
        },
    );
    h.op(
        c1,
        Op::Retain {
            message: msg("t", "second", None),
            durable: true,
        },
    );
    let mut fx = h.op(
        c1,
        Op::RetainedGet {
            filter: "t".into(),
            max: 10,
        },
    );
    let mut pick = 0;
    while let Some(more) = h.deliver_mail(pick) {
        fx.extend(more);
        pick += 7;
    }
    h.set_mail_scheduled(false);
    let got: Vec<_> = fx
        .iter()
        .filter_map(|e| match e {
            Effect::Reply {
                reply: Reply::Retained { messages },
                ..
            } => Some(messages[0].payload.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(got, [Bytes::from_static(b"second")]);
    assert_eq!(get(&mut h, c2, "t", 10), ["t=second"]);
}
