//! End-to-end smoke test with lapin: confirms, ordered consume/ack, a 1 MB multi-frame body with
//! properties, and a 404 channel error that leaves the connection open.

use futures_lite::StreamExt;
use lapin::{BasicProperties, Connection, ConnectionProperties, options::*, types::FieldTable};
use std::sync::Arc;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smoke() {
    let broker = warren_runtime::BrokerHandle::start(Default::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (_stop, rx) = tokio::sync::watch::channel(false);
    tokio::spawn(warren_amqp::serve(
        listener,
        broker,
        Arc::new(Default::default()),
        rx,
    ));
    let conn = warren_tests::bounded_as(
        "connection.open-ok",
        Connection::connect(
            &format!("amqp://{addr}/%2f"),
            ConnectionProperties::default(),
        ),
    )
    .await
    .unwrap();
    let ch = warren_tests::bounded_as("channel.open-ok", conn.create_channel())
        .await
        .unwrap();
    warren_tests::bounded_as(
        "confirm.select-ok",
        ch.confirm_select(ConfirmSelectOptions::default()),
    )
    .await
    .unwrap();
    let q = warren_tests::bounded_as(
        "queue.declare answer",
        ch.queue_declare(
            "".into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        ),
    )
    .await
    .unwrap();
    println!("declared {:?}", q.name());
    let mut consumer = warren_tests::bounded_as(
        "basic.consume answer",
        ch.basic_consume(
            q.name().clone(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        ),
    )
    .await
    .unwrap();
    for i in 0..1000u32 {
        let c = warren_tests::bounded_as(
            "publisher confirm",
            warren_tests::bounded_as(
                "basic.publish sent (held while the connection is blocked)",
                ch.basic_publish(
                    "".into(),
                    q.name().clone(),
                    BasicPublishOptions::default(),
                    &i.to_be_bytes(),
                    BasicProperties::default(),
                ),
            )
            .await
            .unwrap(),
        )
        .await
        .unwrap();
        assert!(c.is_ack());
    }
    for i in 0..1000u32 {
        let d = tokio::time::timeout(std::time::Duration::from_secs(5), consumer.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert_eq!(d.data, i.to_be_bytes());
        d.ack(BasicAckOptions::default()).await.unwrap();
    }
    let big = vec![7u8; 1_000_000];
    let ch2 = warren_tests::bounded_as("channel.open-ok", conn.create_channel())
        .await
        .unwrap();
    warren_tests::bounded_as(
        "basic.publish sent (held while the connection is blocked)",
        ch2.basic_publish(
            "".into(),
            q.name().clone(),
            BasicPublishOptions::default(),
            &big,
            BasicProperties::default().with_content_type("x/y".into()),
        ),
    )
    .await
    .unwrap();
    let d = tokio::time::timeout(std::time::Duration::from_secs(5), consumer.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(d.data.len(), big.len());
    assert_eq!(
        d.properties.content_type().as_ref().map(|s| s.as_str()),
        Some("x/y")
    );
    let err = ch2
        .queue_declare(
            "nope".into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap_err();
    println!("passive error: {err}");
    assert!(conn.status().connected());
    warren_tests::bounded_as("close-ok", conn.close(200, "bye".into()))
        .await
        .unwrap();
}
