//! One broker, two protocols: MQTT publishes reach AMQP queues bound to `amq.topic`, AMQP
//! publishes to `amq.topic` reach MQTT subscribers, with the topic <-> routing key mapping.

use lapin::BasicProperties;
use lapin::options::{BasicPublishOptions, QueueBindOptions};
use lapin::types::{AMQPValue, FieldTable};
use rumqttc::QoS;
use warren_tests::mqtt::start;
use warren_tests::{body, bounded, consume, declare, next};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mqtt_publish_reaches_lapin_consumer() {
    let b = start().await;
    let (_conn, ch) = b.amqp.channel().await;
    declare(&ch, "from-mqtt").await;
    bounded(ch.queue_bind(
        "from-mqtt".into(),
        "amq.topic".into(),
        "sensors.*.temp".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    ))
    .await
    .expect("queue.bind");
    let mut consumer = consume(&ch, "from-mqtt", true).await;
    let mut publisher = b.connect("dev").await;
    publisher
        .publish("sensors/kitchen/temp", QoS::AtLeastOnce, false, b"21.5")
        .await;
    publisher.puback().await;
    let d = next(&mut consumer).await;
    assert_eq!(body(&d), "21.5");
    assert_eq!(d.routing_key.as_str(), "sensors.kitchen.temp");
    assert_eq!(d.exchange.as_str(), "amq.topic");
    let headers = d.properties.headers().clone().expect("headers");
    assert_eq!(
        headers.inner().get("x-mqtt-publish-qos"),
        Some(&AMQPValue::ShortShortUInt(1))
    );
    assert_eq!(*d.properties.delivery_mode(), Some(2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lapin_publish_reaches_mqtt_subscribers() {
    let b = start().await;
    let mut exact = b.connect("exact").await;
    exact.subscribe("sensors/hall/hum", QoS::AtLeastOnce).await;
    let mut wild = b.connect("wild").await;
    wild.subscribe("sensors/+/hum", QoS::AtLeastOnce).await;
    let (_conn, ch) = b.amqp.channel().await;
    bounded(ch.basic_publish(
        "amq.topic".into(),
        "sensors.hall.hum".into(),
        BasicPublishOptions::default(),
        b"40%",
        BasicProperties::default().with_delivery_mode(2),
    ))
    .await
    .expect("basic.publish");
    for c in [&mut exact, &mut wild] {
        let p = c.next_publish().await;
        assert_eq!(p.topic, "sensors/hall/hum");
        assert_eq!(&p.payload[..], b"40%");
        assert_eq!(
            p.qos,
            QoS::AtLeastOnce,
            "persistent AMQP messages count as QoS 1"
        );
    }
    // Transient ones as QoS 0.
    bounded(ch.basic_publish(
        "amq.topic".into(),
        "sensors.hall.hum".into(),
        BasicPublishOptions::default(),
        b"41%",
        BasicProperties::default(),
    ))
    .await
    .expect("basic.publish");
    assert_eq!(exact.next_publish().await.qos, QoS::AtMostOnce);
}
