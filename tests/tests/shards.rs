//! A broker of several shards (ARCHITECTURE.md, "warren-runtime") with lapin over real
//! sockets: connections take turns over the shards (connection ids are numbered in
//! connect order), and a queue lives on the shard of the connection that declared it, so
//! these clients publish, route, consume and ack across shards.

use futures_lite::StreamExt;
use lapin::BasicProperties;
use lapin::options::*;
use lapin::types::{FieldTable, ShortString};
use std::collections::BTreeSet;
use std::time::Duration;
use warren_tests::TestBroker;
use warren_tests::*;

/// A work queue declared on one shard, a confirming producer on another, and three
/// consumers spread over the shards with prefetch 1: every message is confirmed and
/// delivered exactly once, and every consumer works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_queue_across_shards() {
    for shards in [2, 3] {
        let b = start_sharded(shards).await;
        let (_owner, owner) = b.channel().await;
        declare(&owner, "work").await;
        let mut workers = Vec::new();
        for _ in 0..3 {
            let (conn, ch) = b.channel().await;
            bounded(ch.basic_qos(1, BasicQosOptions::default()))
                .await
                .expect("qos");
            let consumer = consume(&ch, "work", false).await;
            workers.push((conn, ch, consumer));
        }
        let (_p, producer) = b.channel().await;
        bounded(producer.confirm_select(ConfirmSelectOptions::default()))
            .await
            .expect("confirm.select");
        const N: usize = 300;
        for i in 0..N {
            let confirm = bounded(producer.basic_publish(
                "".into(),
                "work".into(),
                BasicPublishOptions::default(),
                i.to_string().as_bytes(),
                BasicProperties::default(),
            ))
            .await
            .expect("publish");
            if i % 50 == 49 {
                assert!(bounded(confirm).await.expect("confirm").is_ack());
            }
        }
        let returned = bounded(producer.wait_for_confirms())
            .await
            .expect("every publish confirmed");
        assert!(returned.is_empty(), "nothing returned: {returned:?}");
        let mut seen = BTreeSet::new();
        let mut per_worker = vec![0usize; workers.len()];
        while seen.len() < N {
            for (w, (_, _, consumer)) in workers.iter_mut().enumerate() {
                let Ok(Some(d)) =
                    tokio::time::timeout(Duration::from_millis(20), consumer.next()).await
                else {
                    continue;
                };
                let d = d.expect("a delivery");
                assert!(seen.insert(body(&d)), "delivered twice: {}", body(&d));
                per_worker[w] += 1;
                bounded(d.ack(BasicAckOptions::default()))
                    .await
                    .expect("ack");
            }
        }
        assert!(
            per_worker.iter().all(|&n| n > 0),
            "{shards} shards: every worker got some: {per_worker:?}"
        );
        assert!(drain(&owner, "work").await.is_empty(), "nothing left");
    }
}

/// Queues declared on different shards, bound to a topic exchange declared on another:
/// a publish reaches every matching queue, and a mandatory one that matches none comes
/// back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn topic_routing_reaches_queues_on_every_shard() {
    let b = start_sharded(3).await;
    let (_x, xch) = b.channel().await;
    bounded(xch.exchange_declare(
        "logs".into(),
        lapin::ExchangeKind::Topic,
        ExchangeDeclareOptions::default(),
        FieldTable::default(),
    ))
    .await
    .expect("exchange.declare");
    let mut chans = Vec::new();
    for (queue, key) in [("all", "#"), ("errors", "*.error"), ("kern", "kern.*")] {
        let (conn, ch) = b.channel().await;
        declare(&ch, queue).await;
        bounded(ch.queue_bind(
            queue.into(),
            "logs".into(),
            key.into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        ))
        .await
        .expect("queue.bind");
        chans.push((conn, ch, queue));
    }
    let (_p, p) = b.channel().await;
    bounded(p.confirm_select(ConfirmSelectOptions::default()))
        .await
        .expect("confirm.select");
    for key in ["kern.error", "app.error", "kern.info", "app.info"] {
        bounded(p.basic_publish(
            "logs".into(),
            key.into(),
            BasicPublishOptions::default(),
            key.as_bytes(),
            BasicProperties::default(),
        ))
        .await
        .expect("publish");
    }
    // Confirms go out in publish order: once all are in, every publish above reached its
    // queues, whichever shard holds them. (Awaited before the mandatory publish below: a
    // client pairs a basic.return with the next ack, which would otherwise be an earlier
    // publish's, still waiting for a queue on another shard.)
    let returned = bounded(p.wait_for_confirms()).await.expect("confirms");
    assert!(returned.is_empty(), "{returned:?}");
    // Every key matches "#" on logs: the mandatory publish that comes back goes through
    // amq.direct, where nothing is bound.
    let confirm = bounded(p.basic_publish(
        "amq.direct".into(),
        "nobody".into(),
        BasicPublishOptions {
            mandatory: true,
            ..Default::default()
        },
        b"lost",
        BasicProperties::default(),
    ))
    .await
    .expect("publish");
    match bounded(confirm).await.expect("confirm") {
        lapin::Confirmation::Ack(Some(returned)) => assert_eq!(returned.reply_code, 312),
        other => panic!("expected the publish back (312), got {other:?}"),
    }
    let mut got = Vec::new();
    for (_, ch, queue) in &chans {
        got.push((queue.to_string(), drain(ch, queue).await));
    }
    let want = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    assert_eq!(
        got,
        vec![
            (
                "all".to_string(),
                want(&["kern.error", "app.error", "kern.info", "app.info"])
            ),
            ("errors".to_string(), want(&["kern.error", "app.error"])),
            ("kern".to_string(), want(&["kern.error", "kern.info"])),
        ]
    );
}

/// RabbitMQ tutorial 6 (RPC) across shards: the client's exclusive, server-named reply
/// queue lives on its shard; the server consumes `rpc_queue` on another and replies to
/// `reply_to` with the `correlation_id`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rpc_across_shards() {
    let b = start_sharded(2).await;
    let (_s, server) = b.channel().await;
    declare(&server, "rpc_queue").await;
    let mut requests = consume(&server, "rpc_queue", false).await;
    let (_c, client) = b.channel().await;
    let reply_queue = bounded(client.queue_declare(
        "".into(),
        QueueDeclareOptions {
            exclusive: true,
            ..Default::default()
        },
        FieldTable::default(),
    ))
    .await
    .expect("reply queue");
    let mut replies = consume(&client, reply_queue.name().as_str(), true).await;
    for n in 0..5u32 {
        let id = format!("req-{n}");
        bounded(
            client.basic_publish(
                "".into(),
                "rpc_queue".into(),
                BasicPublishOptions::default(),
                n.to_string().as_bytes(),
                BasicProperties::default()
                    .with_reply_to(reply_queue.name().clone())
                    .with_correlation_id(ShortString::from(id.clone())),
            ),
        )
        .await
        .expect("request");
        let req = next(&mut requests).await;
        let reply_to = req.properties.reply_to().clone().expect("reply_to");
        let square = body(&req).parse::<u32>().expect("a number").pow(2);
        bounded(
            server.basic_publish(
                "".into(),
                reply_to.as_str().into(),
                BasicPublishOptions::default(),
                square.to_string().as_bytes(),
                BasicProperties::default()
                    .with_correlation_id(req.properties.correlation_id().clone().expect("id")),
            ),
        )
        .await
        .expect("reply");
        bounded(req.ack(BasicAckOptions::default()))
            .await
            .expect("ack");
        let reply = next(&mut replies).await;
        assert_eq!(body(&reply), (n * n).to_string());
        assert_eq!(
            reply
                .properties
                .correlation_id()
                .as_ref()
                .map(|s| s.as_str()),
            Some(id.as_str())
        );
    }
}

/// A channel's global prefetch spans queues on two shards: with a limit of 2, two
/// deliveries in all are unacked, whichever queues they come from, and each ack lets one
/// more come.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn global_prefetch_spans_queues_on_two_shards() {
    let b = start_sharded(2).await;
    let (_a, a) = b.channel().await;
    declare(&a, "left").await;
    let (_z, z) = b.channel().await;
    declare(&z, "right").await;
    for (ch, queue) in [(&a, "left"), (&z, "right")] {
        for i in 0..5 {
            bounded(ch.basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions::default(),
                format!("{queue}-{i}").as_bytes(),
                BasicProperties::default(),
            ))
            .await
            .expect("publish");
        }
    }
    let (_c, c) = b.channel().await;
    bounded(c.basic_qos(2, BasicQosOptions { global: true }))
        .await
        .expect("qos global");
    let mut left = consume(&c, "left", false).await;
    let mut right = consume(&c, "right", false).await;
    let mut unacked = Vec::new();
    let (mut total, mut idle) = (0, 0);
    while total < 10 {
        let mut got_one = false;
        for consumer in [&mut left, &mut right] {
            if let Ok(Some(d)) =
                tokio::time::timeout(Duration::from_millis(30), consumer.next()).await
            {
                unacked.push(d.expect("a delivery"));
                total += 1;
                got_one = true;
            }
        }
        assert!(
            unacked.len() <= 2,
            "the global prefetch of 2 holds across shards: {} unacked",
            unacked.len()
        );
        idle = if got_one { 0 } else { idle + 1 };
        assert!(idle < 50, "stalled with {total} of 10 delivered");
        if unacked.len() == 2 || (!got_one && !unacked.is_empty()) {
            let d = unacked.remove(0);
            bounded(d.ack(BasicAckOptions::default()))
                .await
                .expect("ack");
        }
    }
}

/// MQTT sessions on different shards: each session's queue lives on its connection's
/// shard, and QoS 1 publishes from another shard (MQTT and AMQP) reach every matching
/// subscriber in publish order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mqtt_subscribers_on_every_shard() {
    let b = warren_tests::mqtt::start_sharded(3).await;
    let mut subscribers = Vec::new();
    for (id, filter) in [
        ("s1", "sensors/+/temp"),
        ("s2", "sensors/#"),
        ("s3", "sensors/hall/temp"),
    ] {
        let mut c = b.connect(id).await;
        c.subscribe(filter, rumqttc::QoS::AtLeastOnce).await;
        subscribers.push(c);
    }
    let mut publisher = b.connect("pub").await;
    for i in 0..10 {
        publisher
            .publish(
                "sensors/hall/temp",
                rumqttc::QoS::AtLeastOnce,
                false,
                i.to_string().as_bytes(),
            )
            .await;
        publisher.puback().await;
    }
    let (_conn, ch) = b.amqp.channel().await;
    bounded(ch.basic_publish(
        "amq.topic".into(),
        "sensors.hall.temp".into(),
        BasicPublishOptions::default(),
        b"amqp",
        BasicProperties::default().with_delivery_mode(2),
    ))
    .await
    .expect("basic.publish");
    for s in &mut subscribers {
        let mut got = Vec::new();
        for _ in 0..11 {
            let p = s.next_publish().await;
            assert_eq!(p.topic, "sensors/hall/temp");
            got.push(String::from_utf8_lossy(&p.payload).into_owned());
        }
        let want: Vec<String> = (0..10)
            .map(|i| i.to_string())
            .chain(["amqp".to_string()])
            .collect();
        assert_eq!(got, want);
    }
}

/// Users and permissions an operator adds reach every shard: a user's connections log in
/// and work whichever shard they land on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_user_works_on_every_shard() {
    use warren_core::access::{PermissionDef, UserDef, hash_password};
    use warren_runtime::{AdminRequest, AdminResponse};
    let b = start_sharded(2).await;
    for request in [
        AdminRequest::AddUser(UserDef {
            name: "alice".into(),
            password_hash: hash_password([1, 2, 3, 4], "pw"),
            tags: vec![],
        }),
        AdminRequest::SetPermissions(PermissionDef {
            user: "alice".into(),
            vhost: "/".into(),
            configure: ".*".into(),
            write: ".*".into(),
            read: ".*".into(),
        }),
    ] {
        match b.broker.admin(request).await.expect("broker up") {
            AdminResponse::Done(Ok(())) => {}
            other => panic!("{other:?}"),
        }
    }
    let uri = format!("amqp://alice:pw@{}/%2f", b.addr);
    let mut chans = Vec::new();
    for _ in 0..4 {
        let conn = bounded(lapin::Connection::connect(
            &uri,
            lapin::ConnectionProperties::default(),
        ))
        .await
        .expect("alice logs in on every shard");
        let ch = bounded(conn.create_channel()).await.expect("channel");
        chans.push((conn, ch));
    }
    for (i, (_, ch)) in chans.iter().enumerate() {
        declare(ch, &format!("alice-{i}")).await;
    }
    // Deleted on every shard too: a new connection is refused, wherever it lands.
    match b
        .broker
        .admin(AdminRequest::DeleteUser("alice".into()))
        .await
        .expect("broker up")
    {
        AdminResponse::Done(Ok(())) => {}
        other => panic!("{other:?}"),
    }
    for _ in 0..2 {
        let refused = bounded(lapin::Connection::connect(
            &uri,
            lapin::ConnectionProperties::default(),
        ))
        .await;
        assert!(refused.is_err(), "a deleted user is refused on every shard");
    }
}

/// `warren ctl list-queues` (and consumers, connections) on a sharded broker lists what
/// every shard holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listings_gather_every_shard() {
    use warren_runtime::{AdminRequest, AdminResponse};
    let b = start_sharded(3).await;
    let mut chans = Vec::new();
    for i in 0..3 {
        let (conn, ch) = b.channel().await;
        declare(&ch, &format!("q{i}")).await;
        let consumer = consume(&ch, &format!("q{i}"), true).await;
        chans.push((conn, ch, consumer));
    }
    let names = match b.broker.admin(AdminRequest::ListQueues).await.expect("up") {
        AdminResponse::Queues(q) => q.into_iter().map(|q| q.name).collect::<Vec<_>>(),
        other => panic!("{other:?}"),
    };
    assert_eq!(
        names,
        ["q0", "q1", "q2"],
        "queues of all three shards, sorted"
    );
    match b
        .broker
        .admin(AdminRequest::ListConsumers)
        .await
        .expect("up")
    {
        AdminResponse::Consumers(c) => assert_eq!(c.len(), 3, "{c:?}"),
        other => panic!("{other:?}"),
    }
    match b
        .broker
        .admin(AdminRequest::ListConnections)
        .await
        .expect("up")
    {
        AdminResponse::Connections(c) => assert_eq!(c.len(), 3, "{c:?}"),
        other => panic!("{other:?}"),
    }
}

/// RPC with direct reply-to (`amq.rabbitmq.reply-to`) across shards: the reply, published
/// on the server's shard, reaches the client's reply consumer on another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_reply_to_across_shards() {
    let b = start_sharded(2).await;
    let (_s, server) = b.channel().await;
    declare(&server, "rpc").await;
    let mut requests = consume(&server, "rpc", false).await;
    let (_c, client) = b.channel().await;
    let mut replies = consume(&client, "amq.rabbitmq.reply-to", true).await;
    for n in 0..3u32 {
        bounded(client.basic_publish(
            "".into(),
            "rpc".into(),
            BasicPublishOptions::default(),
            n.to_string().as_bytes(),
            BasicProperties::default().with_reply_to("amq.rabbitmq.reply-to".into()),
        ))
        .await
        .expect("request");
        let req = next(&mut requests).await;
        let address = req.properties.reply_to().clone().expect("reply_to");
        assert!(
            address.as_str().starts_with("amq.rabbitmq.reply-to."),
            "{address}"
        );
        bounded(server.basic_publish(
            "".into(),
            address.as_str().into(),
            BasicPublishOptions::default(),
            format!("re {n}").as_bytes(),
            BasicProperties::default(),
        ))
        .await
        .expect("reply");
        bounded(req.ack(BasicAckOptions::default()))
            .await
            .expect("ack");
        assert_eq!(body(&next(&mut replies).await), format!("re {n}"));
    }
}

async fn done(b: &TestBroker, request: warren_runtime::AdminRequest) {
    match b.broker.admin(request).await.expect("broker up") {
        warren_runtime::AdminResponse::Done(Ok(())) => {}
        other => panic!("{other:?}"),
    }
}

/// A vhost an operator adds works on every shard; deleting it closes its connections on
/// every shard (320) and takes its queues, wherever they live.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vhost_lives_and_dies_on_every_shard() {
    use warren_core::access::{PermissionDef, VhostDef};
    use warren_runtime::{AdminRequest, AdminResponse};
    let b = start_sharded(2).await;
    done(
        &b,
        AdminRequest::AddVhost(VhostDef {
            name: "dev".into(),
            description: String::new(),
        }),
    )
    .await;
    done(
        &b,
        AdminRequest::SetPermissions(PermissionDef {
            user: "guest".into(),
            vhost: "dev".into(),
            configure: ".*".into(),
            write: ".*".into(),
            read: ".*".into(),
        }),
    )
    .await;
    let uri = format!("amqp://guest:guest@{}/dev", b.addr);
    let mut conns = Vec::new();
    for i in 0..2 {
        let conn = bounded(lapin::Connection::connect(
            &uri,
            lapin::ConnectionProperties::default(),
        ))
        .await
        .expect("vhost dev on every shard");
        let ch = bounded(conn.create_channel()).await.expect("channel");
        declare(&ch, &format!("dev-{i}")).await;
        conns.push((conn, ch));
    }
    // Published on one shard, to the other's queue, and confirmed before the get: without
    // the confirm the get on the other shard can overtake the enqueue (no order holds
    // between two connections).
    bounded(conns[1].1.confirm_select(ConfirmSelectOptions::default()))
        .await
        .expect("confirm.select");
    let confirm = bounded(conns[1].1.basic_publish(
        "".into(),
        "dev-0".into(),
        BasicPublishOptions::default(),
        b"hi",
        BasicProperties::default(),
    ))
    .await
    .expect("publish");
    assert!(bounded(confirm).await.expect("confirm").is_ack());
    let got = bounded(
        conns[0]
            .1
            .basic_get("dev-0".into(), BasicGetOptions { no_ack: true }),
    )
    .await
    .expect("get")
    .expect("the message");
    assert_eq!(got.delivery.data, b"hi");
    done(&b, AdminRequest::DeleteVhost("dev".into())).await;
    for (conn, _) in &conns {
        bounded(async {
            while conn.status().connected() {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
    }
    match b.broker.admin(AdminRequest::ListQueues).await.expect("up") {
        AdminResponse::Queues(q) => {
            assert!(
                q.iter().all(|q| q.vhost != "dev"),
                "dev's queues are gone: {q:?}"
            )
        }
        other => panic!("{other:?}"),
    }
}

/// A policy set after its queue exists applies on the queue's shard: max-length trims a
/// queue that lives on shard 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_reaches_queues_on_every_shard() {
    use warren_core::message::FieldValue;
    use warren_core::policy::{ApplyTo, PolicyDef};
    use warren_runtime::AdminRequest;
    let b = start_sharded(2).await;
    // Connection 1 is shard 1's: its queue lives there.
    let (_c, ch) = b.channel().await;
    declare(&ch, "lim").await;
    for i in 0..5 {
        bounded(ch.basic_publish(
            "".into(),
            "lim".into(),
            BasicPublishOptions::default(),
            i.to_string().as_bytes(),
            BasicProperties::default(),
        ))
        .await
        .expect("publish");
    }
    let mut definition = warren_core::message::FieldTable::new();
    definition.insert("max-length".into(), FieldValue::I64(2));
    done(
        &b,
        AdminRequest::SetPolicy(PolicyDef {
            vhost: "/".into(),
            name: "limit".into(),
            pattern: "^lim$".into(),
            apply_to: ApplyTo::Queues,
            priority: 0,
            definition,
        }),
    )
    .await;
    assert_eq!(
        drain(&ch, "lim").await,
        ["3", "4"],
        "trimmed to the newest two"
    );
}
