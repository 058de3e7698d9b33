//! Topic permissions (RabbitMQ's `set_topic_permissions`) over real sockets: a user's write
//! regex is checked against the routing key of a publish to a topic exchange and its read
//! regex against the binding key of a bind from one (AMQP: 403 ACCESS_REFUSED closing the
//! channel), and MQTT topics are checked in their AMQP form: a refused SUBSCRIBE filter gets
//! its failure code in the SUBACK (0x80 in 3.1.1, 0x87 in MQTT 5) while the others of the same
//! SUBSCRIBE are granted, a refused PUBLISH is dropped with the connection kept (MQTT 5 tells
//! QoS 1/2 publishers 0x87), as RabbitMQ with `mqtt.disconnect_on_unauthorized = false`.
//! `{username}`, `{vhost}` and (MQTT) `{client_id}` expand to the connection's own.

use lapin::options::*;
use lapin::types::FieldTable;
use lapin::{BasicProperties, ExchangeKind};
use rumqttc::QoS;
use std::time::Duration;
use warren_core::access::{PermissionDef, TopicPermissionDef, UserDef, hash_password};
use warren_runtime::{AdminRequest, AdminResponse, BrokerHandle};
use warren_tests::*;

async fn admin(broker: &BrokerHandle, request: AdminRequest) {
    match bounded(broker.admin(request)).await {
        Ok(AdminResponse::Done(Ok(()))) => {}
        other => panic!("admin request failed: {other:?}"),
    }
}

fn topic_perm(user: &str, exchange: &str, write: &str, read: &str) -> AdminRequest {
    AdminRequest::SetTopicPermissions(TopicPermissionDef {
        user: user.into(),
        vhost: "/".into(),
        exchange: exchange.into(),
        write: write.into(),
        read: read.into(),
    })
}

/// Adds user `spy` (password `pw`) with every permission in `/` and no topic permission: it
/// watches what reaches subscribers.
async fn spy(broker: &BrokerHandle) {
    admin(
        broker,
        AdminRequest::AddUser(UserDef {
            name: "spy".into(),
            password_hash: hash_password([3, 1, 4, 1], "pw"),
            tags: vec![],
        }),
    )
    .await;
    admin(
        broker,
        AdminRequest::SetPermissions(PermissionDef {
            user: "spy".into(),
            vhost: "/".into(),
            configure: ".*".into(),
            write: ".*".into(),
            read: ".*".into(),
        }),
    )
    .await;
}

async fn publish_confirmed(c: lapin::Channel, exchange: &str, key: &str) -> lapin::Result<()> {
    warren_tests::bounded_as(
        "confirm.select-ok",
        c.confirm_select(ConfirmSelectOptions::default()),
    )
    .await?;
    c.basic_publish(
        exchange.into(),
        key.into(),
        BasicPublishOptions::default(),
        b"m",
        BasicProperties::default(),
    )
    .await?
    .await?;
    Ok(())
}

async fn bind(c: lapin::Channel, queue: &str, exchange: &str, key: &str) -> lapin::Result<()> {
    c.queue_bind(
        queue.into(),
        exchange.into(),
        key.into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_publish_and_bind_are_checked_on_topic_exchanges_only() {
    let b = start().await;
    admin(
        &b.broker,
        topic_perm("guest", "amq.topic", "^{username}\\.", "^news\\."),
    )
    .await;
    // On a direct exchange a topic permission means nothing (RabbitMQ checks topic
    // exchanges only).
    admin(&b.broker, topic_perm("guest", "amq.direct", "", "")).await;
    let conn = b.connect().await;
    let ch = bounded(conn.create_channel()).await.expect("channel");
    declare(&ch, "tp-q").await;

    bounded(publish_confirmed(ch.clone(), "amq.topic", "guest.status"))
        .await
        .expect("an allowed routing key");
    channel_error(
        &conn,
        403,
        "ACCESS_REFUSED",
        "write access to topic 'other.status' in exchange 'amq.topic' in vhost '/' refused \
         for user 'guest'",
        |c| publish_confirmed(c, "amq.topic", "other.status"),
    )
    .await;
    bounded(bind(ch.clone(), "tp-q", "amq.topic", "news.#"))
        .await
        .expect("an allowed binding key");
    channel_error(
        &conn,
        403,
        "ACCESS_REFUSED",
        "read access to topic 'secret.#' in exchange 'amq.topic' in vhost '/' refused for \
         user 'guest'",
        |c| bind(c, "tp-q", "amq.topic", "secret.#"),
    )
    .await;
    // amq.direct's empty patterns would refuse every key on a topic exchange.
    bounded(publish_confirmed(ch.clone(), "amq.direct", "anything"))
        .await
        .expect("direct exchange: no topic check");
    bounded(bind(ch.clone(), "tp-q", "amq.direct", "anything"))
        .await
        .expect("direct exchange: no topic check");
    // Another topic exchange without topic permissions: everything allowed.
    bounded(ch.exchange_declare(
        "tp-events".into(),
        ExchangeKind::Topic,
        ExchangeDeclareOptions::default(),
        FieldTable::default(),
    ))
    .await
    .expect("declare");
    bounded(publish_confirmed(ch.clone(), "tp-events", "other.status"))
        .await
        .expect("no topic permission for this exchange");

    // What reached the queue: only the allowed publish through amq.topic (news.# bound
    // after it, so nothing) and nothing refused.
    bounded(publish_confirmed(ch.clone(), "amq.topic", "guest.x"))
        .await
        .expect("allowed");
    assert!(drain(&ch, "tp-q").await.is_empty());

    // Cleared: the open connection may publish anything at once.
    admin(
        &b.broker,
        AdminRequest::ClearTopicPermissions {
            vhost: "/".into(),
            user: "guest".into(),
            exchange: Some("amq.topic".into()),
        },
    )
    .await;
    bounded(publish_confirmed(ch.clone(), "amq.topic", "other.status"))
        .await
        .expect("cleared");
    match bounded(b.broker.admin(AdminRequest::ListTopicPermissions)).await {
        Ok(AdminResponse::TopicPermissions(ps)) => {
            assert_eq!(ps.len(), 1, "{ps:?}");
            assert_eq!(ps[0].exchange, "amq.direct");
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mqtt_3_refused_filters_get_0x80_and_refused_publishes_are_dropped() {
    let m = warren_tests::mqtt::start().await;
    spy(&m.amqp.broker).await;
    // MQTT connects without credentials as guest. `{client_id}` is the MQTT client id.
    admin(
        &m.amqp.broker,
        topic_perm(
            "guest",
            "amq.topic",
            "^(public|{client_id})\\.",
            "^(public|{client_id})\\.",
        ),
    )
    .await;
    let mut options = m.options("spy-1");
    options.set_credentials("spy", "pw");
    let (mut watcher, _) = m.connect_with(options).await;
    watcher.subscribe("#", QoS::AtLeastOnce).await;

    let mut dev = m.connect("dev1").await;
    dev.client
        .subscribe_many([
            rumqttc::SubscribeFilter::new("public/#".into(), QoS::AtLeastOnce),
            rumqttc::SubscribeFilter::new("secret/#".into(), QoS::AtLeastOnce),
            rumqttc::SubscribeFilter::new("dev1/+/in".into(), QoS::AtMostOnce),
            rumqttc::SubscribeFilter::new("dev2/+/in".into(), QoS::AtMostOnce),
        ])
        .await
        .expect("queue the subscribe");
    assert_eq!(
        dev.suback().await,
        [
            rumqttc::SubscribeReasonCode::Success(QoS::AtLeastOnce),
            rumqttc::SubscribeReasonCode::Failure,
            rumqttc::SubscribeReasonCode::Success(QoS::AtMostOnce),
            rumqttc::SubscribeReasonCode::Failure,
        ]
    );
    // Refused publishes of every QoS: acknowledged as 3.1.1 allows, not delivered, and the
    // connection stays.
    dev.publish("secret/a", QoS::AtMostOnce, false, b"no 0")
        .await;
    dev.publish("secret/a", QoS::AtLeastOnce, false, b"no 1")
        .await;
    dev.puback().await;
    dev.publish("dev2/a", QoS::ExactlyOnce, false, b"no 2")
        .await;
    dev.wait(|p| matches!(p, rumqttc::Packet::PubComp(_)).then_some(()))
        .await;
    dev.publish("dev1/a", QoS::AtLeastOnce, false, b"mine")
        .await;
    assert_eq!(&watcher.next_publish().await.payload[..], b"mine");
    dev.publish("public/a", QoS::AtLeastOnce, false, b"public")
        .await;
    assert_eq!(&watcher.next_publish().await.payload[..], b"public");
    // The granted subscriptions work.
    assert_eq!(&dev.next_publish().await.payload[..], b"public");
    watcher
        .publish("dev1/x/in", QoS::AtMostOnce, false, b"to dev1")
        .await;
    assert_eq!(&dev.next_publish().await.payload[..], b"to dev1");
    watcher
        .publish("secret/b", QoS::AtLeastOnce, false, b"not for dev1")
        .await;
    dev.no_publish(Duration::from_millis(200)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mqtt_5_refusals_carry_0x87() {
    use rumqttc::v5::mqttbytes::QoS as Q;
    use rumqttc::v5::mqttbytes::v5::{
        Filter, Packet, PubAckReason, PubRecReason, SubscribeReasonCode,
    };
    let m = warren_tests::mqtt::start().await;
    spy(&m.amqp.broker).await;
    admin(
        &m.amqp.broker,
        topic_perm(
            "guest",
            "amq.topic",
            "^{username}\\.",
            "^(public|{vhost})\\.",
        ),
    )
    .await;
    let mut options = m.options5("spy-5");
    options.set_credentials("spy", "pw");
    let (mut watcher, _) = m.connect5_with(options).await;
    watcher.subscribe("#", Q::AtLeastOnce).await;

    let mut dev = m.connect5("dev5").await;
    dev.client
        .subscribe_many([
            Filter::new("secret/#", Q::AtLeastOnce),
            Filter::new("public/#", Q::ExactlyOnce),
            // `{vhost}` is `/`, escaped: the AMQP key `/.x` is MQTT's `./x`.
            Filter::new("./x", Q::AtMostOnce),
        ])
        .await
        .expect("queue the subscribe");
    let codes = dev
        .wait(|p| match p {
            Packet::SubAck(s) => Some(s.return_codes.clone()),
            _ => None,
        })
        .await;
    assert_eq!(
        codes,
        [
            SubscribeReasonCode::NotAuthorized,
            SubscribeReasonCode::Success(Q::ExactlyOnce),
            SubscribeReasonCode::Success(Q::AtMostOnce),
        ]
    );
    warren_tests::bounded_as(
        "room in the client queue for PUBLISH",
        dev.client.publish("other/a", Q::AtMostOnce, false, "no 0"),
    )
    .await
    .expect("queue");
    assert_eq!(
        puback_reason(&mut dev, "other/a", "no 1").await,
        PubAckReason::NotAuthorized
    );
    warren_tests::bounded_as(
        "room in the client queue for PUBLISH",
        dev.client.publish("other/a", Q::ExactlyOnce, false, "no 2"),
    )
    .await
    .expect("queue");
    let reason = dev
        .wait(|p| match p {
            Packet::PubRec(a) => Some(a.reason),
            _ => None,
        })
        .await;
    assert_eq!(reason, PubRecReason::NotAuthorized);
    // Still connected; an allowed topic (`guest/...` is `guest.` in AMQP) goes through.
    assert_eq!(
        puback_reason(&mut dev, "guest/a", "yes").await,
        PubAckReason::Success
    );
    assert_eq!(&watcher.next_publish().await.payload[..], b"yes");
    watcher.no_publish(Duration::from_millis(200)).await;
}

/// A subscription an earlier connection of a persistent session made, which a topic
/// permission set since refuses: UNSUBSCRIBE gets 0x87 and keeps it, as RabbitMQ (the core
/// would refuse the unbind and the connection would close).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mqtt_5_unsubscribe_of_a_now_refused_filter_gets_0x87() {
    use rumqttc::v5::mqttbytes::QoS as Q;
    use rumqttc::v5::mqttbytes::v5::{Packet, PubAckReason, UnsubAckReason};
    let m = warren_tests::mqtt::start().await;
    let mut o = m.options5("keeper");
    o.set_clean_start(false);
    o.set_session_expiry_interval(Some(600));
    let (mut c, _) = m.connect5_with(o.clone()).await;
    c.subscribe("old/#", Q::AtLeastOnce).await;
    c.subscribe("new/#", Q::AtLeastOnce).await;
    warren_tests::bounded_as(
        "room in the client queue for DISCONNECT",
        c.client.disconnect(),
    )
    .await
    .expect("queue disconnect");
    c.closed().await;
    admin(
        &m.amqp.broker,
        topic_perm("guest", "amq.topic", ".*", "^new\\."),
    )
    .await;
    let (mut c, ack) = m.connect5_with(o).await;
    assert!(ack.session_present);
    warren_tests::bounded_as(
        "room in the client queue for UNSUBSCRIBE",
        c.client.unsubscribe("old/#"),
    )
    .await
    .expect("queue");
    warren_tests::bounded_as(
        "room in the client queue for UNSUBSCRIBE",
        c.client.unsubscribe("new/#"),
    )
    .await
    .expect("queue");
    for want in [UnsubAckReason::NotAuthorized, UnsubAckReason::Success] {
        let got = c
            .wait(|p| match p {
                Packet::UnsubAck(a) => Some(a.reasons.clone()),
                _ => None,
            })
            .await;
        assert_eq!(got, [want]);
    }
    // Still connected, and the kept subscription still delivers.
    warren_tests::bounded_as(
        "room in the client queue for PUBLISH",
        c.client.publish("old/x", Q::AtLeastOnce, false, "kept"),
    )
    .await
    .expect("queue");
    let reason = c
        .wait(|p| match p {
            Packet::PubAck(a) => Some(a.reason),
            _ => None,
        })
        .await;
    assert_eq!(reason, PubAckReason::Success);
    assert_eq!(&c.next_publish().await.payload[..], b"kept");
}

/// Publishes `payload` to `topic` at QoS 1 from `dev` and returns its PUBACK's reason.
async fn puback_reason(
    dev: &mut warren_tests::mqtt::Client5,
    topic: &str,
    payload: &'static str,
) -> rumqttc::v5::mqttbytes::v5::PubAckReason {
    warren_tests::bounded_as(
        "room in the client queue for PUBLISH",
        dev.client.publish(
            topic,
            rumqttc::v5::mqttbytes::QoS::AtLeastOnce,
            false,
            payload,
        ),
    )
    .await
    .expect("queue");
    dev.wait(|p| match p {
        rumqttc::v5::mqttbytes::v5::Packet::PubAck(a) => Some(a.reason),
        _ => None,
    })
    .await
}
