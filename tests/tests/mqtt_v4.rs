//! MQTT 3.1.1 with rumqttc over loopback: QoS 0/1/2 both ways, retained messages, wills,
//! session takeover, persistent sessions, `$` topics.

use rumqttc::{ConnectReturnCode, LastWill, QoS};
use std::time::Duration;
use warren_tests::mqtt::start;

const QUIET: Duration = Duration::from_millis(300);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qos_0_1_2_delivered_at_min_of_publish_and_granted() {
    let b = start().await;
    let mut sub2 = b.connect("sub2").await;
    sub2.subscribe("a/+", QoS::ExactlyOnce).await;
    let mut sub1 = b.connect("sub1").await;
    sub1.subscribe("a/#", QoS::AtLeastOnce).await;
    let publisher = b.connect("pub").await;
    for (i, qos) in [QoS::AtMostOnce, QoS::AtLeastOnce, QoS::ExactlyOnce]
        .into_iter()
        .enumerate()
    {
        publisher
            .publish("a/b", qos, false, format!("m{i}").as_bytes())
            .await;
        let p = sub2.next_publish().await;
        assert_eq!(
            (p.topic.as_str(), &p.payload[..]),
            ("a/b", format!("m{i}").as_bytes()),
            "message {i} at {qos:?}"
        );
        assert_eq!(p.qos, qos, "granted 2: the publish QoS");
        assert!(!p.retain);
        let p = sub1.next_publish().await;
        assert_eq!(
            &p.payload[..],
            format!("m{i}").as_bytes(),
            "message {i} at {qos:?}"
        );
        let capped = if qos == QoS::ExactlyOnce {
            QoS::AtLeastOnce
        } else {
            qos
        };
        assert_eq!(p.qos, capped, "granted 1 caps QoS 2");
    }
    sub2.no_publish(QUIET).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_qos1_messages_in_order() {
    let b = start().await;
    let mut sub = b.connect("sub").await;
    sub.subscribe("load/#", QoS::AtLeastOnce).await;
    let publisher = b.connect("pub").await;
    for i in 0..3000u32 {
        publisher
            .publish("load/x", QoS::AtLeastOnce, false, &i.to_be_bytes())
            .await;
    }
    for i in 0..3000u32 {
        let p = sub.next_publish().await;
        assert_eq!(&p.payload[..], i.to_be_bytes());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retained_messages_on_subscribe_including_wildcards_and_cleared() {
    let b = start().await;
    let publisher = b.connect("pub").await;
    publisher
        .publish("r/1", QoS::AtLeastOnce, true, b"one")
        .await;
    publisher
        .publish("r/2", QoS::AtMostOnce, true, b"two")
        .await;
    publisher
        .publish("r/2", QoS::AtMostOnce, true, b"two'")
        .await;
    let mut publisher = publisher;
    publisher
        .publish("other", QoS::AtLeastOnce, true, b"x")
        .await;
    // The PUBACK of the last publish (the second QoS 1 one) means the earlier ones were
    // handled too.
    publisher.puback().await;
    publisher.puback().await;
    let mut probe = b.connect("probe").await;
    probe.subscribe("other", QoS::AtMostOnce).await;
    assert!(probe.next_publish().await.retain);

    let mut sub = b.connect("sub").await;
    sub.subscribe("r/+", QoS::AtLeastOnce).await;
    let mut got = [sub.next_publish().await, sub.next_publish().await];
    got.sort_by(|a, b| a.topic.cmp(&b.topic));
    assert_eq!(&got[0].payload[..], b"one");
    assert_eq!(got[0].qos, QoS::AtLeastOnce);
    assert_eq!(&got[1].payload[..], b"two'");
    assert_eq!(got[1].qos, QoS::AtMostOnce);
    assert!(got.iter().all(|p| p.retain));
    sub.no_publish(QUIET).await;

    // Live messages to the subscriber are not flagged retained.
    publisher
        .publish("r/1", QoS::AtLeastOnce, true, b"live")
        .await;
    let p = sub.next_publish().await;
    assert!(!p.retain);

    // An empty retained payload clears the topic.
    publisher.publish("r/1", QoS::AtLeastOnce, true, b"").await;
    publisher.publish("r/2", QoS::AtLeastOnce, true, b"").await;
    assert!(sub.next_publish().await.payload.is_empty());
    assert!(sub.next_publish().await.payload.is_empty());
    let mut late = b.connect("late").await;
    late.subscribe("r/#", QoS::AtLeastOnce).await;
    late.no_publish(QUIET).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn will_sent_on_abrupt_close_not_after_disconnect() {
    let b = start().await;
    let mut watcher = b.connect("watcher").await;
    watcher.subscribe("wills/#", QoS::AtLeastOnce).await;

    let mut o = b.options("device-1");
    o.set_last_will(LastWill::new(
        "wills/device-1",
        "gone",
        QoS::AtLeastOnce,
        false,
    ));
    let (dev, _) = b.connect_with(o).await;
    dev.kill();
    let p = watcher.next_publish().await;
    assert_eq!(p.topic, "wills/device-1");
    assert_eq!(&p.payload[..], b"gone");
    assert_eq!(p.qos, QoS::AtLeastOnce);

    let mut o = b.options("device-2");
    o.set_last_will(LastWill::new(
        "wills/device-2",
        "gone",
        QoS::AtLeastOnce,
        false,
    ));
    let (mut dev, _) = b.connect_with(o).await;
    warren_tests::bounded_as(
        "room in the client queue for DISCONNECT",
        dev.client.disconnect(),
    )
    .await
    .expect("queue disconnect");
    dev.closed().await;
    watcher.no_publish(QUIET).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn second_connection_with_same_client_id_takes_over() {
    let b = start().await;
    let mut first = b.connect("same").await;
    let mut second = b.connect("same").await;
    first.closed().await;
    // The new connection works.
    second.subscribe("t", QoS::AtLeastOnce).await;
    second.publish("t", QoS::AtLeastOnce, false, b"hi").await;
    assert_eq!(&second.next_publish().await.payload[..], b"hi");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn persistent_session_keeps_subscriptions_and_queues_while_offline() {
    let b = start().await;
    let mut o = b.options("keeper");
    o.set_clean_session(false);
    let (mut c, ack) = b.connect_with(o.clone()).await;
    assert!(!ack.session_present);
    c.subscribe("p/#", QoS::AtLeastOnce).await;
    warren_tests::bounded_as(
        "room in the client queue for DISCONNECT",
        c.client.disconnect(),
    )
    .await
    .expect("queue disconnect");
    c.closed().await;

    let publisher = b.connect("pub").await;
    for i in 0..5u8 {
        publisher
            .publish("p/x", QoS::AtLeastOnce, false, &[i])
            .await;
    }
    publisher
        .publish("p/x", QoS::AtMostOnce, false, b"q0")
        .await;
    // Let the publishes reach the queue before the client comes back.
    let mut probe = b.connect("probe").await;
    probe.subscribe("p/x", QoS::AtMostOnce).await;
    publisher
        .publish("p/x", QoS::AtLeastOnce, false, b"marker")
        .await;
    while probe.next_publish().await.payload != b"marker"[..] {}

    let (mut c, ack) = b.connect_with(o.clone()).await;
    assert!(ack.session_present);
    for i in 0..5u8 {
        let p = c.next_publish().await;
        assert_eq!(&p.payload[..], [i]);
        assert_eq!(p.qos, QoS::AtLeastOnce);
    }
    assert_eq!(&c.next_publish().await.payload[..], b"q0");
    assert_eq!(&c.next_publish().await.payload[..], b"marker");
    warren_tests::bounded_as(
        "room in the client queue for DISCONNECT",
        c.client.disconnect(),
    )
    .await
    .expect("queue disconnect");
    c.closed().await;

    // A clean session drops it all.
    let mut o2 = o.clone();
    o2.set_clean_session(true);
    let (mut c, ack) = b.connect_with(o2).await;
    assert!(!ack.session_present);
    publisher
        .publish("p/x", QoS::AtLeastOnce, false, b"after")
        .await;
    c.no_publish(QUIET).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dollar_topics_not_matched_by_leading_wildcards() {
    let b = start().await;
    let mut all = b.connect("all").await;
    all.subscribe("#", QoS::AtMostOnce).await;
    let mut plus = b.connect("plus").await;
    plus.subscribe("+/x", QoS::AtMostOnce).await;
    let mut sys = b.connect("sys").await;
    sys.subscribe("$SYS/#", QoS::AtMostOnce).await;
    let publisher = b.connect("pub").await;
    publisher
        .publish("$SYS/x", QoS::AtMostOnce, false, b"s")
        .await;
    // The broker's own retained `$SYS/broker/...` topics come first.
    let p = sys
        .wait(|p| match p {
            rumqttc::Packet::Publish(p) if p.topic == "$SYS/x" => Some(p.clone()),
            _ => None,
        })
        .await;
    assert_eq!(&p.payload[..], b"s");
    all.no_publish(QUIET).await;
    plus.no_publish(QUIET).await;
    // The literal `.` survives the AMQP key mapping.
    publisher
        .publish("v1.2/x", QoS::AtMostOnce, false, b"d")
        .await;
    let p = plus.next_publish().await;
    assert_eq!(p.topic, "v1.2/x");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsubscribe_stops_delivery() {
    let b = start().await;
    let mut c = b.connect("c").await;
    c.subscribe("u/1", QoS::AtLeastOnce).await;
    warren_tests::bounded_as(
        "room in the client queue for UNSUBSCRIBE",
        c.client.unsubscribe("u/1"),
    )
    .await
    .expect("queue unsubscribe");
    c.wait(|p| matches!(p, rumqttc::Packet::UnsubAck(_)).then_some(()))
        .await;
    c.publish("u/1", QoS::AtLeastOnce, false, b"x").await;
    c.no_publish(QUIET).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_credentials_refused() {
    let b = start().await;
    let mut o = b.options("c");
    o.set_credentials("guest", "wrong");
    let (client, mut eventloop) = rumqttc::AsyncClient::new(o, 10);
    let err = tokio::time::timeout(warren_tests::WAIT, eventloop.poll())
        .await
        .expect("answered in time")
        .expect_err("refused");
    drop(client);
    assert!(
        matches!(
            err,
            rumqttc::ConnectionError::ConnectionRefused(ConnectReturnCode::BadUserNamePassword)
        ),
        "{err:?}"
    );
    let mut o = b.options("c");
    o.set_credentials("guest", "guest");
    let (_c, ack) = b.connect_with(o).await;
    assert_eq!(ack.code, ConnectReturnCode::Success);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn suback_means_publishes_of_other_clients_reach_the_subscription() {
    // A SUBACK tells the client its subscription is in place, so a message another client
    // publishes after it (here: as soon as the test saw the SUBACK) must be delivered. The
    // load keeps the broker task busy, so a bind still queued behind it when the SUBACK
    // leaves would be missing from the routing table the publisher routes on.
    let b = start().await;
    let mut o = b.options("sink");
    o.set_clean_session(false);
    let (mut sink, _) = b.connect_with(o).await;
    sink.subscribe("load/#", QoS::AtMostOnce).await;
    warren_tests::bounded_as(
        "room in the client queue for DISCONNECT",
        sink.client.disconnect(),
    )
    .await
    .expect("queue disconnect");
    sink.closed().await;
    let mut loaders = Vec::new();
    for n in 0..2 {
        let loader = b.connect(&format!("loader-{n}")).await;
        loaders.push(tokio::spawn(async move {
            loop {
                loader
                    .publish("load/x", QoS::AtMostOnce, false, &[0; 16])
                    .await;
            }
        }));
    }
    let mut probe = b.connect("probe").await;
    let publisher = b.connect("pub").await;
    for i in 0..30 {
        let topic = format!("fresh/{i}");
        probe.subscribe(&topic, QoS::AtMostOnce).await;
        publisher
            .publish(&topic, QoS::AtMostOnce, false, b"after suback")
            .await;
        let p = probe.next_publish().await;
        assert_eq!(p.topic, topic, "round {i}");
    }
    for l in loaders {
        l.abort();
    }
}

/// A SUBSCRIBE the user may not make is answered 0x80 in the 3.1.1 SUBACK, and the
/// connection goes on (it was granted, then closed by the core's 403).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn denied_subscription_gets_0x80_in_suback_and_the_connection_lives() {
    let b = start().await;
    b.add_writer_only_user().await;
    let mut o = b.options("no-read");
    o.set_credentials("writer", "pw");
    let (mut c, ack) = b.connect_with(o).await;
    assert_eq!(ack.code, rumqttc::ConnectReturnCode::Success);
    warren_tests::bounded_as(
        "room in the client queue for SUBSCRIBE",
        c.client.subscribe("d/#", QoS::AtLeastOnce),
    )
    .await
    .expect("queue subscribe");
    assert_eq!(c.suback().await, [rumqttc::SubscribeReasonCode::Failure]);
    c.publish("d/x", QoS::AtLeastOnce, false, b"still here")
        .await;
    c.puback().await;
}

/// `$SYS/broker/...` as Mosquitto publishes them: every `sys_interval`, retained, to a
/// subscription naming `$SYS`; the version and a connected-clients count that counts the
/// connected clients. `#` alone gets none of them (MQTT-4.7.2-1).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sys_topics_published_like_mosquitto() {
    let b = warren_tests::mqtt::start_with(warren_mqtt::MqttConfig {
        sys_interval: Some(Duration::from_secs(1)),
        ..Default::default()
    })
    .await;
    let mut all = b.connect("sys-all").await;
    all.subscribe("#", QoS::AtMostOnce).await;
    let _others = [b.connect("sys-a").await, b.connect("sys-b").await];
    let mut sys = b.connect("sys-watch").await;
    sys.subscribe("$SYS/broker/#", QoS::AtMostOnce).await;
    let mut version = None;
    let mut connected = None;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    // The retained values come at SUBSCRIBE (maybe from before all four connected), then
    // every second: wait for a count that includes all four clients.
    while connected != Some(4) || version.is_none() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "got {version:?} {connected:?}"
        );
        let p = sys.next_publish().await;
        let value = String::from_utf8_lossy(&p.payload).into_owned();
        match &*p.topic {
            "$SYS/broker/version" => version = Some(value),
            "$SYS/broker/clients/connected" => connected = value.parse().ok(),
            _ => {}
        }
    }
    assert!(
        version.is_some_and(|v| v.starts_with("warren version ")),
        "version names the broker"
    );
    all.no_publish(Duration::from_millis(1500)).await;
}

/// Declares `queue` (at most one message, `reject-publish` beyond) bound to `amq.topic`
/// with `key`: a publish routed there once it holds one is nacked by the core.
async fn full_queue(b: &warren_tests::mqtt::MqttBroker, queue: &str, key: &str) {
    use warren_core::command::{Bind, Op, QueueDeclare};
    use warren_core::message::{FieldTable, FieldValue};
    use warren_runtime::{AdminRequest, AdminResponse};
    let mut arguments = FieldTable::new();
    arguments.insert("x-max-length".into(), FieldValue::I64(1));
    arguments.insert("x-overflow".into(), FieldValue::string("reject-publish"));
    for op in [
        Op::QueueDeclare(QueueDeclare {
            queue: queue.into(),
            passive: false,
            durable: false,
            exclusive: false,
            auto_delete: false,
            nowait: false,
            arguments,
        }),
        Op::QueueBind(Bind {
            destination: queue.into(),
            source: "amq.topic".into(),
            routing_key: key.into(),
            nowait: false,
            arguments: FieldTable::new(),
        }),
    ] {
        let vhost = "/".to_string();
        let answer = b.amqp.broker.admin(AdminRequest::Op { vhost, op }).await;
        assert!(matches!(answer, Ok(AdminResponse::Op(Ok(_)))), "{answer:?}");
    }
}

/// Events until the connection ends: the packet ids the broker acknowledged meanwhile.
async fn acks_until_closed(c: &mut warren_tests::mqtt::Client) -> Vec<u16> {
    use rumqttc::{Event, Packet};
    let mut acked = Vec::new();
    let deadline = tokio::time::Instant::now() + warren_tests::WAIT;
    loop {
        match tokio::time::timeout_at(deadline, c.events.recv())
            .await
            .expect("the connection closed in time")
        {
            Some(Ok(Event::Incoming(Packet::PubAck(a)))) => acked.push(a.pkid),
            Some(Ok(Event::Incoming(Packet::PubRec(a)))) => acked.push(a.pkid),
            Some(Ok(_)) => {}
            Some(Err(_)) | None => return acked,
        }
    }
}

/// A 3.1.1 QoS 1 or 2 publish the broker did not take (its queue is full and refuses
/// more, a nack from the core as from a queue on a node that is down) is never
/// acknowledged: 3.1.1 has no negative PUBACK/PUBREC, so the connection is closed without
/// one, as RabbitMQ 3.10's MQTT plugin does (a positive ack would make the client drop a
/// message nobody stored). What the queue took before is acknowledged as usual.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nacked_qos1_or_qos2_publish_is_never_acknowledged_in_3_1_1() {
    let b = start().await;
    full_queue(&b, "full", "t").await;
    let mut c = b.connect("pub1").await;
    c.publish("t", QoS::AtLeastOnce, false, b"taken").await;
    c.puback().await;
    c.publish("t", QoS::AtLeastOnce, false, b"refused").await;
    let acked = acks_until_closed(&mut c).await;
    assert_eq!(
        acked,
        Vec::<u16>::new(),
        "no PUBACK for the refused publish"
    );
    // QoS 2: no PUBREC either.
    let mut c = b.connect("pub2").await;
    c.publish("t", QoS::ExactlyOnce, false, b"refused too")
        .await;
    let acked = acks_until_closed(&mut c).await;
    assert_eq!(
        acked,
        Vec::<u16>::new(),
        "no PUBREC for the refused publish"
    );
    // Other connections go on: a publish routed elsewhere is acknowledged.
    let mut other = b.connect("pub3").await;
    other
        .publish("elsewhere", QoS::AtLeastOnce, false, b"ok")
        .await;
    other.puback().await;
}
