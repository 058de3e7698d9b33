//! Queues over the wire with lapin: flags, server naming, declare-ok counts, purge, delete
//! conditions, exclusivity.

use lapin::BasicProperties;
use lapin::options::*;
use lapin::types::FieldTable;
use std::time::Duration;
use warren_tests::*;

async fn publish(ch: &lapin::Channel, queue: &str, body: &str) {
    bounded(ch.basic_publish(
        "".into(),
        queue.into(),
        Default::default(),
        body.as_bytes(),
        BasicProperties::default(),
    ))
    .await
    .expect("publish");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_named_queue_and_declare_ok_counts() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    let q = declare(&ch, "").await;
    assert!(q.name().as_str().starts_with("amq.gen-"), "{}", q.name());
    for i in 0..3 {
        publish(&ch, q.name().as_str(), &i.to_string()).await;
    }
    let _consumer = consume(&ch, q.name().as_str(), false).await;
    let ch2 = b.channel().await.1;
    let other = declare(&ch2, "counted").await;
    assert_eq!((other.message_count(), other.consumer_count()), (0, 0));
    publish(&ch2, "counted", "a").await;
    publish(&ch2, "counted", "b").await;
    let _c2 = consume(&ch2, "counted", false).await;
    let _c3 = {
        let ch3 = b.channel().await.1;
        let c = consume(&ch3, "counted", false).await;
        (ch3, c)
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    let passive = QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    let again = bounded(ch2.queue_declare("counted".into(), passive, FieldTable::default()))
        .await
        .expect("passive");
    assert_eq!(again.consumer_count(), 2);
    assert_eq!(
        again.message_count(),
        0,
        "both messages went out to consumers"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_and_conditional_delete() {
    let b = start().await;
    let (conn, ch) = b.channel().await;
    declare(&ch, "p").await;
    for i in 0..5 {
        publish(&ch, "p", &i.to_string()).await;
    }
    assert_eq!(
        bounded(ch.queue_purge("p".into(), Default::default()))
            .await
            .expect("purge"),
        5
    );
    publish(&ch, "p", "left").await;
    let err = bounded(ch.queue_delete(
        "p".into(),
        QueueDeleteOptions {
            if_empty: true,
            ..Default::default()
        },
    ))
    .await
    .expect_err("not empty");
    assert_eq!(code(&err), 406);
    let ch = warren_tests::bounded_as("channel.open-ok", conn.create_channel())
        .await
        .expect("channel");
    let _consumer = consume(&ch, "p", false).await;
    let ch2 = warren_tests::bounded_as("channel.open-ok", conn.create_channel())
        .await
        .expect("channel");
    let err = bounded(ch2.queue_delete(
        "p".into(),
        QueueDeleteOptions {
            if_unused: true,
            ..Default::default()
        },
    ))
    .await
    .expect_err("in use");
    assert_eq!(code(&err), 406);
    let ch3 = warren_tests::bounded_as("channel.open-ok", conn.create_channel())
        .await
        .expect("channel");
    let count = bounded(ch3.queue_delete("p".into(), Default::default()))
        .await
        .expect("delete");
    assert_eq!(count, 0, "the one message was delivered, not ready");
    let passive = QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    let err = bounded(ch3.queue_declare("p".into(), passive, FieldTable::default()))
        .await
        .expect_err("deleted");
    assert_eq!(code(&err), 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exclusive_queue_is_locked_to_its_connection_and_dies_with_it() {
    let b = start().await;
    let (owner, ch) = b.channel().await;
    let exclusive = QueueDeclareOptions {
        exclusive: true,
        ..Default::default()
    };
    bounded(ch.queue_declare("mine".into(), exclusive, FieldTable::default()))
        .await
        .expect("exclusive");
    let (_other, ch2) = b.channel().await;
    let err = bounded(ch2.basic_consume(
        "mine".into(),
        "".into(),
        Default::default(),
        FieldTable::default(),
    ))
    .await
    .expect_err("locked");
    assert_eq!(code(&err), 405);
    bounded(owner.close(200, "bye".into()))
        .await
        .expect("close");
    let (_c, ch3) = b.channel().await;
    let passive = QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    let err = bounded(ch3.queue_declare("mine".into(), passive, FieldTable::default()))
        .await
        .expect_err("gone with its owner");
    assert_eq!(code(&err), 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_delete_queue_goes_with_its_last_consumer() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    let auto = QueueDeclareOptions {
        auto_delete: true,
        ..Default::default()
    };
    bounded(ch.queue_declare("ad".into(), auto, FieldTable::default()))
        .await
        .expect("declare");
    let consumer = consume(&ch, "ad", false).await;
    bounded(ch.basic_cancel(consumer.tag(), Default::default()))
        .await
        .expect("cancel");
    let passive = QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    let err = bounded(ch.queue_declare("ad".into(), passive, FieldTable::default()))
        .await
        .expect_err("deleted");
    assert_eq!(code(&err), 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn durable_redeclare_must_match() {
    let b = start().await;
    let (conn, ch) = b.channel().await;
    let durable = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    bounded(ch.queue_declare("d".into(), durable, FieldTable::default()))
        .await
        .expect("durable");
    bounded(ch.queue_declare("d".into(), durable, FieldTable::default()))
        .await
        .expect("same again");
    let err = bounded(ch.queue_declare("d".into(), Default::default(), FieldTable::default()))
        .await
        .expect_err("inequivalent");
    assert_eq!(code(&err), 406);
    let ch = warren_tests::bounded_as("channel.open-ok", conn.create_channel())
        .await
        .expect("channel");
    let err = bounded(ch.queue_declare(
        "amq.reserved".into(),
        Default::default(),
        FieldTable::default(),
    ))
    .await
    .expect_err("reserved");
    assert_eq!(code(&err), 403);
    assert!(conn.status().connected());
}
