//! Vhosts keep names apart (the default exchange, alternate and dead-letter exchanges,
//! policies route within one vhost); users and permissions survive a restore from a store,
//! and a stored set of users replaces the defaults (a deleted guest stays deleted).

mod common;

use common::*;
use warren_core::access::{PermissionDef, UserDef, VhostDef, hash_password};
use warren_core::command::Op;
use warren_core::effect::Effect;
use warren_core::message::{FieldTable, FieldValue};
use warren_core::policy::{ApplyTo, PolicyDef};
use warren_core::store::{MemoryStore, Store};
use warren_core::{Broker, BrokerConfig};

fn open_in(h: &mut Harness, conn: u64, vhost: &str, user: &str) -> Vec<Effect> {
    h.op(
        ch(conn, 0),
        Op::ConnectionOpen {
            vhost: vhost.into(),
            user: user.into(),
            cancel_notify: true,
        },
    )
}

fn dev(broker: &mut Broker) {
    broker
        .add_vhost(
            0,
            VhostDef {
                name: "dev".into(),
                description: String::new(),
            },
        )
        .expect("vhost");
    broker
        .set_permissions(
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
}

#[test]
fn names_routing_and_policies_stay_in_their_vhost() {
    let mut h = Harness::new();
    dev(&mut h.shards[0]);
    let slash = h.connect(1);
    assert!(open_in(&mut h, 2, "dev", "guest").is_empty());
    let devc = h.open(2, 1);
    h.declare(slash, "q");
    h.declare(devc, "q");
    // A dead-letter exchange of the same name in both vhosts: each queue uses its own.
    h.exchange(slash, "dlx", "fanout", FieldTable::new());
    h.exchange(devc, "dlx", "fanout", FieldTable::new());
    h.declare(slash, "dead");
    h.declare(devc, "dead");
    h.bind(slash, "dead", "dlx", "");
    h.bind(devc, "dead", "dlx", "");
    let mut ttl = FieldTable::new();
    ttl.insert("dead-letter-exchange".into(), FieldValue::string("dlx"));
    ttl.insert("message-ttl".into(), FieldValue::I64(5));
    h.shards[0]
        .set_policy(
            h.now,
            PolicyDef {
                vhost: "dev".into(),
                name: "expire".into(),
                pattern: "^q$".into(),
                apply_to: ApplyTo::Queues,
                priority: 0,
                definition: ttl,
            },
        )
        .expect("policy");
    h.publish(devc, "", "q", "dev message");
    h.publish(slash, "", "q", "slash message");
    h.now += 100;
    h.shards[0].tick(h.now);
    // The policy of dev expired dev's message into dev's dead-letter queue only.
    assert_eq!(h.shards[0].queue_len("q"), Some(1), "/'s q is untouched");
    assert_eq!(h.shards[0].queue_len("dead"), Some(0));
    let queues = h.shards[0].list_queues();
    let len = |vhost: &str, name: &str| {
        queues
            .iter()
            .find(|q| q.vhost == vhost && q.name == name)
            .map(|q| q.messages_ready)
    };
    assert_eq!(len("dev", "q"), Some(0));
    assert_eq!(len("dev", "dead"), Some(1));
    assert_eq!(len("/", "q"), Some(1));
    assert_eq!(
        h.shards[0].queue_policy("dev", "q").as_deref(),
        Some("expire")
    );
    assert_eq!(h.shards[0].queue_policy("/", "q"), None);

    // Deleting dev closes its connection (320) and leaves / alone.
    h.shards[0].delete_vhost(h.now, "dev").expect("delete");
    let mut fx = Vec::new();
    h.shards[0].poll_effects(&mut fx);
    assert!(
        fx.iter()
            .any(|e| matches!(e, Effect::ConnectionError { error, .. }
            if error.code.code() == 320 && error.text.contains("vhost 'dev' is deleted"))),
        "{fx:?}"
    );
    assert!(h.shards[0].list_queues().iter().all(|q| q.vhost == "/"));
    h.shards[0].check_invariants().expect("invariants");
}

#[test]
fn a_connection_needs_permissions_in_its_vhost() {
    let mut h = Harness::new();
    h.shards[0]
        .add_vhost(
            0,
            VhostDef {
                name: "dev".into(),
                description: String::new(),
            },
        )
        .expect("vhost");
    let fx = open_in(&mut h, 1, "dev", "guest");
    assert!(
        matches!(fx.as_slice(), [Effect::ConnectionError { error, .. }]
            if error.code.code() == 530
                && error.text == "NOT_ALLOWED - access to vhost 'dev' refused for user 'guest'"),
        "{fx:?}"
    );
    let fx = open_in(&mut h, 2, "nowhere", "guest");
    assert!(
        matches!(fx.as_slice(), [Effect::ConnectionError { error, .. }] if error.code.code() == 530),
        "{fx:?}"
    );
}

#[test]
fn users_and_vhosts_survive_a_restore_and_replace_the_defaults() {
    let store = MemoryStore::new();
    let mut b = Broker::with_store(BrokerConfig::default(), Box::new(store.clone()));
    let errors = b.restore(0, &store.definitions());
    assert!(errors.is_empty(), "{errors:?}");
    // A fresh store gets the defaults written.
    let defs = store.definitions();
    assert_eq!(defs.vhosts.len(), 1);
    assert_eq!(defs.users.len(), 1);
    dev(&mut b);
    b.put_user(
        0,
        UserDef {
            name: "bob".into(),
            password_hash: hash_password([1, 1, 1, 1], "pw"),
            tags: vec![],
        },
    )
    .expect("user");
    b.delete_user(0, "guest").expect("delete guest");
    let mut s: Box<dyn Store> = Box::new(store.clone());
    s.sync(1);
    store.complete_sync();
    store.crash();

    let mut again = Broker::with_store(BrokerConfig::default(), Box::new(store.clone()));
    let errors = again.restore(0, &store.definitions());
    assert!(errors.is_empty(), "{errors:?}");
    let users: Vec<String> = again.list_users().into_iter().map(|u| u.name).collect();
    assert_eq!(users, vec!["bob"], "guest stays deleted");
    let vhosts: Vec<String> = again.list_vhosts().into_iter().map(|v| v.name).collect();
    assert_eq!(vhosts, vec!["/", "dev"]);
    assert!(again.authenticate("bob", "pw", false, None).is_ok());
    assert!(again.authenticate("guest", "guest", true, None).is_err());
}
