//! MQTT 5 with rumqttc's v5 client over loopback: assigned client ids, properties passed
//! through, topic aliases, no-local, retain handling and retain-as-published, subscription
//! identifiers, session takeover with reason 0x8E, message expiry.

use bytes::Bytes;
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::mqttbytes::v5::{
    ConnectReturnCode, Filter, PublishProperties, RetainForwardRule, SubscribeProperties,
};
use std::time::Duration;
use warren_tests::mqtt::{Packet5, start, start_sharded};

const QUIET: Duration = Duration::from_millis(300);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn empty_client_id_is_assigned_and_limits_announced() {
    let b = start().await;
    let (_c, ack) = b.connect5_with(b.options5("")).await;
    assert_eq!(ack.code, ConnectReturnCode::Success);
    let p = ack.properties.expect("CONNACK properties");
    let id = p.assigned_client_identifier.expect("assigned id");
    assert!(id.starts_with("warren-"), "{id}");
    assert_eq!(p.receive_max, Some(1024));
    assert_eq!(p.topic_alias_max, Some(64));
    assert_eq!(p.shared_subscription_available, Some(1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_properties_pass_through() {
    let b = start().await;
    let mut sub = b.connect5("sub").await;
    sub.subscribe("req/#", QoS::AtLeastOnce).await;
    let publisher = b.connect5("pub").await;
    let props = PublishProperties {
        payload_format_indicator: Some(1),
        message_expiry_interval: Some(60),
        response_topic: Some("resp/a.b".into()),
        correlation_data: Some(Bytes::from_static(b"\x00\x01corr")),
        user_properties: vec![("k".into(), "v".into()), ("tenant".into(), "42".into())],
        content_type: Some("application/json".into()),
        ..Default::default()
    };
    warren_tests::bounded_as(
        "room in the client queue for PUBLISH",
        publisher
            .client
            .publish_with_properties("req/x", QoS::AtLeastOnce, false, "{}", props),
    )
    .await
    .expect("queue publish");
    let p = sub.next_publish().await;
    let got = p.properties.expect("properties");
    assert_eq!(got.payload_format_indicator, Some(1));
    let expiry = got.message_expiry_interval.expect("expiry");
    assert!((59..=60).contains(&expiry), "{expiry}");
    assert_eq!(got.response_topic.as_deref(), Some("resp/a.b"));
    assert_eq!(got.correlation_data.as_deref(), Some(&b"\x00\x01corr"[..]));
    assert_eq!(got.content_type.as_deref(), Some("application/json"));
    let mut ups = got.user_properties.clone();
    ups.sort();
    assert_eq!(
        ups,
        [
            ("k".to_string(), "v".to_string()),
            ("tenant".into(), "42".into())
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn topic_alias_from_client() {
    let b = start().await;
    let mut sub = b.connect5("sub").await;
    sub.subscribe("alias/#", QoS::AtMostOnce).await;
    let publisher = b.connect5("pub").await;
    let with_alias = PublishProperties {
        topic_alias: Some(3),
        ..Default::default()
    };
    publisher
        .client
        .publish_with_properties(
            "alias/long/topic",
            QoS::AtLeastOnce,
            false,
            "1",
            with_alias.clone(),
        )
        .await
        .expect("queue publish");
    warren_tests::bounded_as(
        "room in the client queue for PUBLISH",
        publisher
            .client
            .publish_with_properties("", QoS::AtLeastOnce, false, "2", with_alias),
    )
    .await
    .expect("queue publish");
    for want in ["1", "2"] {
        let p = sub.next_publish().await;
        assert_eq!(&p.topic[..], b"alias/long/topic");
        assert_eq!(&p.payload[..], want.as_bytes());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_local_and_subscription_identifiers() {
    let b = start().await;
    let mut c = b.connect5("self").await;
    let mut f = Filter::new("chat/#", QoS::AtLeastOnce);
    f.nolocal = true;
    c.client
        .subscribe_many_with_properties(
            [f],
            SubscribeProperties {
                id: Some(7),
                user_properties: vec![],
            },
        )
        .await
        .expect("queue subscribe");
    c.wait(|p| matches!(p, Packet5::SubAck(_)).then_some(()))
        .await;
    warren_tests::bounded_as(
        "room in the client queue for PUBLISH",
        c.client
            .publish("chat/room", QoS::AtLeastOnce, false, "mine"),
    )
    .await
    .expect("queue publish");
    let other = b.connect5("other").await;
    warren_tests::bounded_as(
        "room in the client queue for PUBLISH",
        other
            .client
            .publish("chat/room", QoS::AtLeastOnce, false, "theirs"),
    )
    .await
    .expect("queue publish");
    let p = c.next_publish().await;
    assert_eq!(
        &p.payload[..],
        b"theirs",
        "own message not delivered (no-local)"
    );
    let props = p.properties.expect("properties");
    assert_eq!(props.subscription_identifiers, [7]);
    c.no_publish(QUIET).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retain_handling_and_retain_as_published() {
    let b = start().await;
    let mut publisher = b.connect5("pub").await;
    warren_tests::bounded_as(
        "room in the client queue for PUBLISH",
        publisher
            .client
            .publish("rh/1", QoS::AtLeastOnce, true, "kept"),
    )
    .await
    .expect("queue publish");
    publisher
        .wait(|p| matches!(p, Packet5::PubAck(_)).then_some(()))
        .await;

    let mut never = b.connect5("never").await;
    let mut f = Filter::new("rh/#", QoS::AtLeastOnce);
    f.retain_forward_rule = RetainForwardRule::Never;
    warren_tests::bounded_as(
        "room in the client queue for SUBSCRIBE",
        never.client.subscribe_many([f]),
    )
    .await
    .expect("queue");
    never
        .wait(|p| matches!(p, Packet5::SubAck(_)).then_some(()))
        .await;
    never.no_publish(QUIET).await;

    let mut once = b.connect5("once").await;
    let mut f = Filter::new("rh/#", QoS::AtLeastOnce);
    f.retain_forward_rule = RetainForwardRule::OnNewSubscribe;
    f.preserve_retain = true;
    warren_tests::bounded_as(
        "room in the client queue for SUBSCRIBE",
        once.client.subscribe_many([f.clone()]),
    )
    .await
    .expect("queue");
    once.wait(|p| matches!(p, Packet5::SubAck(_)).then_some(()))
        .await;
    let p = once.next_publish().await;
    assert!(p.retain);
    assert_eq!(&p.payload[..], b"kept");
    // Subscribing again to the same filter sends nothing with rule 1.
    warren_tests::bounded_as(
        "room in the client queue for SUBSCRIBE",
        once.client.subscribe_many([f]),
    )
    .await
    .expect("queue");
    once.wait(|p| matches!(p, Packet5::SubAck(_)).then_some(()))
        .await;
    once.no_publish(QUIET).await;
    // Retain-as-published keeps the flag on live messages.
    warren_tests::bounded_as(
        "room in the client queue for PUBLISH",
        publisher
            .client
            .publish("rh/2", QoS::AtLeastOnce, true, "live"),
    )
    .await
    .expect("queue publish");
    let p = once.next_publish().await;
    assert!(p.retain);
    let p = never.next_publish().await;
    assert!(
        !p.retain,
        "without retain-as-published the live flag is cleared"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn takeover_closes_the_first_connection() {
    // The 0x8E reason byte itself is checked on the wire in mqtt_wire.rs.
    let b = start().await;
    let mut first = b.connect5("dup").await;
    let mut second = b.connect5("dup").await;
    first.closed().await;
    second.subscribe("t", QoS::AtLeastOnce).await;
    warren_tests::bounded_as(
        "room in the client queue for PUBLISH",
        second
            .client
            .publish("t", QoS::AtLeastOnce, false, "still here"),
    )
    .await
    .expect("queue publish");
    assert_eq!(&second.next_publish().await.payload[..], b"still here");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_messages_are_not_delivered_to_returning_sessions() {
    let b = start().await;
    let mut o = b.options5("late");
    o.set_clean_start(false);
    o.set_session_expiry_interval(Some(3600));
    let (mut c, _) = b.connect5_with(o.clone()).await;
    c.subscribe("exp/#", QoS::AtLeastOnce).await;
    warren_tests::bounded_as(
        "room in the client queue for DISCONNECT",
        c.client.disconnect(),
    )
    .await
    .expect("queue disconnect");
    c.closed().await;
    let mut publisher = b.connect5("pub").await;
    let short = PublishProperties {
        message_expiry_interval: Some(1),
        ..Default::default()
    };
    warren_tests::bounded_as(
        "room in the client queue for PUBLISH",
        publisher
            .client
            .publish_with_properties("exp/a", QoS::AtLeastOnce, false, "short", short),
    )
    .await
    .expect("queue publish");
    warren_tests::bounded_as(
        "room in the client queue for PUBLISH",
        publisher
            .client
            .publish("exp/a", QoS::AtLeastOnce, false, "forever"),
    )
    .await
    .expect("queue publish");
    for _ in 0..2 {
        publisher
            .wait(|p| matches!(p, Packet5::PubAck(_)).then_some(()))
            .await;
    }
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let (mut c, ack) = b.connect5_with(o).await;
    assert!(ack.session_present);
    let p = c.next_publish().await;
    assert_eq!(&p.payload[..], b"forever");
    c.no_publish(QUIET).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_subscriptions_split_messages_within_a_group() {
    let b = start().await;
    let mut m1 = b.connect5("member-1").await;
    m1.subscribe("$share/workers/jobs/#", QoS::AtLeastOnce)
        .await;
    let mut m2 = b.connect5("member-2").await;
    m2.subscribe("$share/workers/jobs/#", QoS::AtLeastOnce)
        .await;
    let mut plain = b.connect5("plain").await;
    plain.subscribe("jobs/#", QoS::AtLeastOnce).await;
    let publisher = b.connect5("pub").await;
    for i in 0..10u8 {
        warren_tests::bounded_as(
            "room in the client queue for PUBLISH",
            publisher
                .client
                .publish("jobs/x", QoS::AtLeastOnce, false, vec![i]),
        )
        .await
        .expect("queue publish");
    }
    for i in 0..10u8 {
        assert_eq!(&plain.next_publish().await.payload[..], [i]);
    }
    let mut got = Vec::new();
    let mut per_member = [0; 2];
    for (n, m) in [&mut m1, &mut m2].into_iter().enumerate() {
        while let Ok(p) = tokio::time::timeout(QUIET, m.next_publish()).await {
            got.push(p.payload[0]);
            per_member[n] += 1;
        }
    }
    got.sort();
    assert_eq!(
        got,
        (0..10).collect::<Vec<u8>>(),
        "each message to exactly one member"
    );
    assert!(
        per_member.iter().all(|&n| n > 0),
        "both members served: {per_member:?}"
    );
    // Leaving the group: the other member gets everything.
    warren_tests::bounded_as(
        "room in the client queue for UNSUBSCRIBE",
        m1.client.unsubscribe("$share/workers/jobs/#"),
    )
    .await
    .expect("queue unsubscribe");
    m1.wait(|p| matches!(p, Packet5::UnsubAck(_)).then_some(()))
        .await;
    for i in 0..4u8 {
        warren_tests::bounded_as(
            "room in the client queue for PUBLISH",
            publisher
                .client
                .publish("jobs/y", QoS::AtLeastOnce, false, vec![i]),
        )
        .await
        .expect("queue publish");
    }
    for i in 0..4u8 {
        assert_eq!(&m2.next_publish().await.payload[..], [i]);
    }
    m1.no_publish(QUIET).await;
}

fn delayed_will_options(b: &warren_tests::mqtt::MqttBroker, id: &str) -> rumqttc::v5::MqttOptions {
    use rumqttc::v5::mqttbytes::v5::{LastWill, LastWillProperties};
    let mut o = b.options5(id);
    o.set_clean_start(false);
    o.set_session_expiry_interval(Some(60));
    o.set_last_will(LastWill::new(
        format!("wills/{id}"),
        "gone",
        QoS::AtLeastOnce,
        false,
        Some(LastWillProperties {
            delay_interval: Some(1),
            payload_format_indicator: None,
            message_expiry_interval: None,
            content_type: Some("text/plain".into()),
            response_topic: None,
            correlation_data: None,
            user_properties: vec![("why".into(), "lost".into())],
        }),
    ));
    o
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn will_delay_interval_and_cancel_on_reconnect() {
    let b = start().await;
    let mut watcher = b.connect5("watcher").await;
    watcher.subscribe("wills/#", QoS::AtLeastOnce).await;

    let (dev, _) = b.connect5_with(delayed_will_options(&b, "late-will")).await;
    dev.kill();
    let gone = tokio::time::Instant::now();
    watcher.no_publish(Duration::from_millis(700)).await;
    let p = watcher.next_publish().await;
    assert!(
        gone.elapsed() >= Duration::from_millis(900),
        "{:?}",
        gone.elapsed()
    );
    assert_eq!(&p.topic[..], b"wills/late-will");
    let props = p.properties.expect("will properties");
    assert_eq!(props.content_type.as_deref(), Some("text/plain"));
    assert_eq!(
        props.user_properties,
        [("why".to_string(), "lost".to_string())]
    );

    // Back within the delay: no will.
    let (dev, _) = b.connect5_with(delayed_will_options(&b, "back-soon")).await;
    dev.kill();
    let (_again, ack) = b.connect5_with(delayed_will_options(&b, "back-soon")).await;
    assert!(ack.session_present);
    watcher.no_publish(Duration::from_millis(1500)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn topic_aliases_towards_the_client() {
    let b = start().await;
    let mut o = b.options5("aliased");
    o.set_topic_alias_max(Some(2));
    let (mut sub, _) = b.connect5_with(o).await;
    sub.subscribe("ta/#", QoS::AtMostOnce).await;
    let publisher = b.connect5("pub").await;
    for t in ["ta/1", "ta/1", "ta/2", "ta/3", "ta/1"] {
        warren_tests::bounded_as(
            "room in the client queue for PUBLISH",
            publisher.client.publish(t, QoS::AtLeastOnce, false, t),
        )
        .await
        .expect("queue publish");
    }
    // rumqttc's events show the packets as sent: resolve the aliases here.
    let mut seen = Vec::new();
    let mut aliases = std::collections::HashMap::new();
    for want in ["ta/1", "ta/1", "ta/2", "ta/3", "ta/1"] {
        let p = sub.next_publish().await;
        let alias = p.properties.and_then(|p| p.topic_alias);
        let topic = match alias {
            Some(a) if p.topic.is_empty() => aliases.get(&a).cloned().expect("known alias"),
            Some(a) => {
                aliases.insert(a, p.topic.clone());
                p.topic.clone()
            }
            None => p.topic.clone(),
        };
        assert_eq!(&topic[..], want.as_bytes());
        assert_eq!(&p.payload[..], want.as_bytes());
        seen.push((alias, p.topic.is_empty()));
    }
    assert_eq!(
        seen,
        [
            (Some(1), false),
            (Some(1), true),
            (Some(2), false),
            (None, false),
            (Some(1), true)
        ]
    );
}

/// A client asking for a longer keep-alive than the broker allows is told the broker's in
/// CONNACK (Server Keep Alive, MQTT 5 3.2.2.3.14); one within it is not told anything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_keep_alive_announced_when_the_broker_overrides() {
    let b = warren_tests::mqtt::start_with(warren_mqtt::MqttConfig {
        server_keep_alive: Some(20),
        ..warren_mqtt::MqttConfig::default()
    })
    .await;
    let (_c, ack) = b.connect5_with(b.options5("long-ka")).await;
    let p = ack.properties.expect("CONNACK properties");
    assert_eq!(p.server_keep_alive, Some(20), "30 s asked, 20 s allowed");
    let mut o = b.options5("short-ka");
    o.set_keep_alive(Duration::from_secs(10));
    let (_c, ack) = b.connect5_with(o).await;
    let p = ack.properties.expect("CONNACK properties");
    assert_eq!(p.server_keep_alive, None);
}

/// The client's Receive Maximum bounds the QoS 1 messages the broker has in flight to it
/// (MQTT 5 4.9): with 2, a third message waits for a PUBACK.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_receive_maximum_bounds_outbound_in_flight() {
    let b = start().await;
    let mut o = b.options5("slow-reader");
    o.set_receive_maximum(Some(2));
    o.set_manual_acks(true);
    let (mut sub, _) = b.connect5_with(o).await;
    sub.subscribe("rm/#", QoS::AtLeastOnce).await;
    let publisher = b.connect5("rm-pub").await;
    for i in 0..5u8 {
        warren_tests::bounded_as(
            "room in the client queue for PUBLISH",
            publisher
                .client
                .publish("rm/x", QoS::AtLeastOnce, false, vec![i]),
        )
        .await
        .expect("queue publish");
    }
    let first = sub.next_publish().await;
    let second = sub.next_publish().await;
    assert_eq!(
        (&first.payload[..], &second.payload[..]),
        (&[0][..], &[1][..])
    );
    sub.no_publish(QUIET).await;
    sub.client.ack(&first).await.expect("queue PUBACK");
    assert_eq!(&sub.next_publish().await.payload[..], [2]);
    sub.no_publish(QUIET).await;
}

/// A message waiting in an offline session's queue is forwarded with what is left of its
/// Message Expiry Interval (MQTT 5 3.3.2.3.3), not the interval it was published with.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn message_expiry_forwarded_with_the_remaining_interval() {
    let b = start().await;
    let mut o = b.options5("expiry-reader");
    o.set_clean_start(false);
    o.set_session_expiry_interval(Some(60));
    let (mut sub, _) = b.connect5_with(o.clone()).await;
    sub.subscribe("mx/#", QoS::AtLeastOnce).await;
    warren_tests::bounded_as(
        "room in the client queue for DISCONNECT",
        sub.client.disconnect(),
    )
    .await
    .expect("queue DISCONNECT");
    sub.closed().await;
    let publisher = b.connect5("mx-pub").await;
    let props = PublishProperties {
        message_expiry_interval: Some(10),
        ..Default::default()
    };
    warren_tests::bounded_as(
        "room in the client queue for PUBLISH",
        publisher
            .client
            .publish_with_properties("mx/a", QoS::AtLeastOnce, false, "x", props),
    )
    .await
    .expect("queue publish");
    tokio::time::sleep(Duration::from_millis(2100)).await;
    let (mut sub, ack) = b.connect5_with(o).await;
    assert!(ack.session_present);
    let p = sub.next_publish().await;
    let left = p
        .properties
        .and_then(|p| p.message_expiry_interval)
        .expect("expiry forwarded");
    assert!((1..=8).contains(&left), "2 s of 10 spent: {left}");
}

/// A takeover resumes the session in the new connection, so the first connection's delayed
/// will is never published (MQTT 5 3.1.3.2.2: a new connection within the delay cancels it),
/// even though the first connection closes after the new one claimed the client id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn takeover_cancels_a_delayed_will() {
    let b = start().await;
    let mut watcher = b.connect5("watcher").await;
    watcher.subscribe("wills/#", QoS::AtLeastOnce).await;
    let (_first, _) = b.connect5_with(delayed_will_options(&b, "taken")).await;
    let (_second, ack) = b.connect5_with(delayed_will_options(&b, "taken")).await;
    assert!(ack.session_present);
    watcher.no_publish(Duration::from_millis(2000)).await;
}

/// A SUBSCRIBE the user may not make is answered 0x87 Not Authorized in the SUBACK, and the
/// connection goes on (it was granted, then closed by the core's 403): a publish after it
/// is acknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn denied_subscription_gets_0x87_in_suback_and_the_connection_lives() {
    use rumqttc::v5::mqttbytes::v5::SubscribeReasonCode;
    let b = start().await;
    b.add_writer_only_user().await;
    let mut o = b.options5("no-read");
    o.set_credentials("writer", "pw");
    let (mut c, ack) = b.connect5_with(o).await;
    assert_eq!(ack.code, ConnectReturnCode::Success);
    warren_tests::bounded_as(
        "room in the client queue for SUBSCRIBE",
        c.client.subscribe("d/#", QoS::AtLeastOnce),
    )
    .await
    .expect("queue subscribe");
    let codes = c
        .wait(|p| match p {
            Packet5::SubAck(s) => Some(s.return_codes.clone()),
            _ => None,
        })
        .await;
    assert_eq!(codes, [SubscribeReasonCode::NotAuthorized]);
    warren_tests::bounded_as(
        "room in the client queue for PUBLISH",
        c.client
            .publish("d/x", QoS::AtLeastOnce, false, "still here"),
    )
    .await
    .expect("queue publish");
    c.wait(|p| matches!(p, Packet5::PubAck(_)).then_some(()))
        .await;
}

async fn subscribe_with_id(c: &mut warren_tests::mqtt::Client5, filter: &str, id: Option<usize>) {
    c.client
        .subscribe_many_with_properties(
            [Filter::new(filter, QoS::AtLeastOnce)],
            SubscribeProperties {
                id,
                user_properties: vec![],
            },
        )
        .await
        .expect("queue subscribe");
    c.wait(|p| matches!(p, Packet5::SubAck(_)).then_some(()))
        .await;
}

/// MQTT-3.3.4-3/-5: one copy for overlapping subscriptions, carrying the identifier of every
/// matching subscription that has one (order not significant), none for one without; a
/// shared subscription's copy carries its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_matching_subscription_identifier_is_delivered() {
    let b = start().await;
    let mut c = b.connect5("ids").await;
    subscribe_with_id(&mut c, "ids/#", Some(1)).await;
    subscribe_with_id(&mut c, "ids/+/x", Some(2)).await;
    subscribe_with_id(&mut c, "ids/a/+", None).await;
    subscribe_with_id(&mut c, "solo/+", None).await;
    subscribe_with_id(&mut c, "$share/g/ids/a/x", Some(300)).await;
    let publisher = b.connect5("ids-pub").await;
    warren_tests::bounded_as(
        "room in the client queue for PUBLISH",
        publisher
            .client
            .publish("ids/a/x", QoS::AtLeastOnce, false, "one"),
    )
    .await
    .expect("queue publish");
    let mut got = Vec::new();
    for _ in 0..2 {
        let p = c.next_publish().await;
        let mut ids = p.properties.expect("properties").subscription_identifiers;
        ids.sort();
        got.push(ids);
    }
    got.sort();
    assert_eq!(
        got,
        [vec![1, 2], vec![300]],
        "the session's copy has ids 1 and 2 (not the id-less overlap), the share's 300"
    );
    c.no_publish(QUIET).await;
    warren_tests::bounded_as(
        "room in the client queue for PUBLISH",
        publisher
            .client
            .publish("solo/x", QoS::AtLeastOnce, false, "plain"),
    )
    .await
    .expect("queue publish");
    let p = c.next_publish().await;
    assert_eq!(&p.payload[..], b"plain");
    assert_eq!(
        p.properties
            .map(|pr| pr.subscription_identifiers)
            .unwrap_or_default(),
        Vec::<usize>::new(),
        "only an id-less subscription matches: no identifier"
    );
}

/// The identifiers survive the in-flight path: an unacknowledged QoS 1 message resent after
/// a reconnect carries all of them again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscription_identifiers_survive_a_resend_after_reconnect() {
    let b = start().await;
    let mut o = b.options5("ids-resend");
    o.set_clean_start(false);
    o.set_session_expiry_interval(Some(600));
    o.set_receive_maximum(Some(1));
    o.set_manual_acks(true);
    let (mut c, _) = b.connect5_with(o.clone()).await;
    subscribe_with_id(&mut c, "rs/#", Some(1)).await;
    subscribe_with_id(&mut c, "rs/+/x", Some(2)).await;
    let publisher = b.connect5("ids-resend-pub").await;
    for payload in ["one", "two"] {
        warren_tests::bounded_as(
            "room in the client queue for PUBLISH",
            publisher
                .client
                .publish("rs/a/x", QoS::AtLeastOnce, false, payload),
        )
        .await
        .expect("queue publish");
    }
    let ids = |p: &rumqttc::v5::mqttbytes::v5::Publish| {
        let mut ids = p
            .properties
            .clone()
            .expect("properties")
            .subscription_identifiers;
        ids.sort();
        ids
    };
    let p = c.next_publish().await;
    assert_eq!((&p.payload[..], ids(&p)), (&b"one"[..], vec![1, 2]));
    c.client.ack(&p).await.expect("ack");
    let p = c.next_publish().await;
    assert_eq!((&p.payload[..], ids(&p)), (&b"two"[..], vec![1, 2]));
    // Not acked: the session resends it on the next connection.
    c.kill();
    let (mut c, ack) = b.connect5_with(o).await;
    assert!(ack.session_present);
    let p = c.next_publish().await;
    assert_eq!(
        &p.payload[..],
        b"two",
        "unacked message resent after reconnect"
    );
    assert!(p.dup);
    assert_eq!(ids(&p), [1, 2], "the resend carries the same identifiers");
}

/// Retained messages are the core's (topology, shard 0): with the publisher and the
/// subscribers on other shards they still meet, a retained message keeps its MQTT 5 expiry
/// (the remaining interval is forwarded; once it passed, a new subscriber gets nothing).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retained_messages_across_shards_with_message_expiry() {
    let b = start_sharded(3).await;
    let mut publisher = b.connect5("pub").await;
    let short = PublishProperties {
        message_expiry_interval: Some(1),
        ..Default::default()
    };
    warren_tests::bounded_as(
        "room in the client queue for PUBLISH",
        publisher.client.publish_with_properties(
            "rx/short",
            QoS::AtLeastOnce,
            true,
            "short",
            short,
        ),
    )
    .await
    .expect("queue publish");
    warren_tests::bounded_as(
        "room in the client queue for PUBLISH",
        publisher
            .client
            .publish("rx/long", QoS::AtLeastOnce, true, "long"),
    )
    .await
    .expect("queue publish");
    for _ in 0..2 {
        publisher
            .wait(|p| matches!(p, Packet5::PubAck(_)).then_some(()))
            .await;
    }
    let mut early = b.connect5("early").await;
    early.subscribe("rx/#", QoS::AtLeastOnce).await;
    let first = early.next_publish().await;
    let second = early.next_publish().await;
    assert!(first.retain && second.retain);
    assert_eq!(&first.payload[..], b"long");
    assert_eq!(&second.payload[..], b"short");
    let left = second
        .properties
        .and_then(|p| p.message_expiry_interval)
        .expect("the remaining expiry interval");
    assert!(left <= 1, "{left}");
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let mut late = b.connect5("late").await;
    late.subscribe("rx/#", QoS::AtLeastOnce).await;
    let p = late.next_publish().await;
    assert_eq!(&p.payload[..], b"long");
    late.no_publish(QUIET).await;
}
