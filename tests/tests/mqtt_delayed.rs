//! MQTT `$delayed/{seconds}/{topic}` (EMQX's delayed publish) with rumqttc's v5 client
//! (docs/delayed.md): published to the topic when due, message expiry counted from then,
//! bad forms answered with PUBACK 0x90 and nothing else affected.

use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::mqttbytes::v5::{PubAckReason, PublishProperties};
use std::time::{Duration, Instant};
use warren_tests::mqtt::{Packet5, start};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delayed_publish_arrives_on_its_topic_when_due() {
    let b = start().await;
    let mut sub = b.connect5("sub").await;
    sub.subscribe("sensors/#", QoS::AtLeastOnce).await;
    let mut publisher = b.connect5("pub").await;
    let props = PublishProperties {
        message_expiry_interval: Some(60),
        ..Default::default()
    };
    let sent = Instant::now();
    warren_tests::bounded(publisher.client.publish_with_properties(
        "$delayed/1/sensors/t1",
        QoS::AtLeastOnce,
        false,
        "late",
        props,
    ))
    .await
    .expect("queue publish");
    let reason = publisher
        .wait(|p| match p {
            Packet5::PubAck(a) => Some(a.reason),
            _ => None,
        })
        .await;
    assert_eq!(reason, PubAckReason::Success);
    sub.no_publish(Duration::from_millis(700)).await;
    let p = sub.next_publish().await;
    assert!(
        sent.elapsed() >= Duration::from_secs(1),
        "{:?}",
        sent.elapsed()
    );
    assert_eq!(&p.topic[..], b"sensors/t1");
    assert_eq!(&p.payload[..], b"late");
    let props = p.properties.expect("properties");
    // Counted from delivery: the second it waited is not taken off.
    let expiry = props.message_expiry_interval.expect("expiry");
    assert!((59..=60).contains(&expiry), "{expiry}");
    assert!(
        props
            .user_properties
            .iter()
            .all(|(k, _)| k != "x-deliver-at"),
        "{:?}",
        props.user_properties
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_delayed_forms_get_puback_0x90_and_nothing_else_is_affected() {
    let b = start().await;
    let mut sub = b.connect5("sub").await;
    sub.subscribe("#", QoS::AtLeastOnce).await;
    let mut publisher = b.connect5("pub").await;
    for topic in [
        "$delayed/abc/topic",
        "$delayed/5",
        "$delayed/99999999999/t",
        "$delayed/1/",
    ] {
        warren_tests::bounded(
            publisher
                .client
                .publish(topic, QoS::AtLeastOnce, false, "x"),
        )
        .await
        .expect("queue publish");
        let reason = publisher
            .wait(|p| match p {
                Packet5::PubAck(a) => Some(a.reason),
                _ => None,
            })
            .await;
        assert_eq!(reason, PubAckReason::TopicNameInvalid, "{topic}");
    }
    warren_tests::bounded(publisher.client.publish(
        "$delayed/0/now",
        QoS::AtLeastOnce,
        false,
        "now",
    ))
    .await
    .expect("queue publish");
    let p = sub.next_publish().await;
    assert_eq!(&p.topic[..], b"now", "zero seconds: at once");
}
