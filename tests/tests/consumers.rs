//! Consuming over the wire with lapin: no-ack, exclusive consumers, generated tags, cancel,
//! server cancel notification, round-robin, prefetch per consumer and per channel, get,
//! ack/nack/reject with multiple and requeue, recover, redelivered, requeue position.

use lapin::BasicProperties;
use lapin::options::*;
use lapin::types::FieldTable;
use std::time::Duration;
use warren_tests::*;

async fn publish_n(ch: &lapin::Channel, queue: &str, n: usize) {
    for i in 0..n {
        bounded(ch.basic_publish(
            "".into(),
            queue.into(),
            Default::default(),
            i.to_string().as_bytes(),
            BasicProperties::default(),
        ))
        .await
        .expect("publish");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_ack_consumer_with_generated_tag_and_cancel() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare(&ch, "q").await;
    let mut consumer = consume(&ch, "q", true).await;
    assert!(
        consumer.tag().as_str().starts_with("amq.ctag-"),
        "{}",
        consumer.tag()
    );
    publish_n(&ch, "q", 3).await;
    for i in 0..3 {
        let d = next(&mut consumer).await;
        assert_eq!(body(&d), i.to_string());
        assert!(!d.redelivered);
    }
    bounded(ch.basic_cancel(consumer.tag(), Default::default()))
        .await
        .expect("cancel");
    publish_n(&ch, "q", 1).await;
    let got = bounded(ch.basic_get("q".into(), BasicGetOptions { no_ack: true }))
        .await
        .expect("get");
    assert_eq!(got.expect("kept for the next consumer").delivery.data, b"0");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_robin_between_consumers() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare(&ch, "rr").await;
    let mut a = consume(&ch, "rr", true).await;
    let mut z = consume(&ch, "rr", true).await;
    publish_n(&ch, "rr", 6).await;
    let mut from_a = Vec::new();
    let mut from_z = Vec::new();
    for _ in 0..3 {
        from_a.push(body(&next(&mut a).await));
        from_z.push(body(&next(&mut z).await));
    }
    assert_eq!(from_a, ["0", "2", "4"]);
    assert_eq!(from_z, ["1", "3", "5"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exclusive_consumer_refuses_others_with_403() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare(&ch, "solo").await;
    let _held = bounded(ch.basic_consume(
        "solo".into(),
        "only".into(),
        BasicConsumeOptions {
            exclusive: true,
            ..Default::default()
        },
        FieldTable::default(),
    ))
    .await
    .expect("exclusive consumer");
    let (_c2, ch2) = b.channel().await;
    let err = bounded(ch2.basic_consume(
        "solo".into(),
        "".into(),
        Default::default(),
        FieldTable::default(),
    ))
    .await
    .expect_err("exclusive use");
    assert_eq!(code(&err), 403);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_queue_cancels_its_consumers() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare(&ch, "doomed").await;
    let mut consumer = consume(&ch, "doomed", true).await;
    let (_c2, ch2) = b.channel().await;
    bounded(ch2.queue_delete("doomed".into(), Default::default()))
        .await
        .expect("delete");
    // The server's basic.cancel ends the consumer's stream.
    let end = bounded(futures_lite::StreamExt::next(&mut consumer)).await;
    assert!(
        end.is_none(),
        "consumer should be cancelled, got {:?}",
        end.map(|d| d.map(|d| d.data))
    );
    // basic.cancel from the server leaves the channel open.
    assert!(ch.status().connected(), "the consumer's channel stays open");
    declare(&ch, "after-cancel").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_consumer_prefetch_limits_unacked_deliveries() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare(&ch, "pf").await;
    bounded(ch.basic_qos(2, BasicQosOptions { global: false }))
        .await
        .expect("qos");
    publish_n(&ch, "pf", 5).await;
    let mut consumer = consume(&ch, "pf", false).await;
    let first = next(&mut consumer).await;
    let second = next(&mut consumer).await;
    nothing_within(&mut consumer, Duration::from_millis(200)).await;
    bounded(second.ack(BasicAckOptions { multiple: true }))
        .await
        .expect("ack both");
    let _ = first;
    assert_eq!(body(&next(&mut consumer).await), "2");
    assert_eq!(body(&next(&mut consumer).await), "3");
    nothing_within(&mut consumer, Duration::from_millis(200)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn global_prefetch_is_shared_across_the_channels_consumers() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare(&ch, "g1").await;
    declare(&ch, "g2").await;
    bounded(ch.basic_qos(3, BasicQosOptions { global: true }))
        .await
        .expect("qos");
    publish_n(&ch, "g1", 3).await;
    publish_n(&ch, "g2", 3).await;
    let mut c1 = consume(&ch, "g1", false).await;
    let mut c2 = consume(&ch, "g2", false).await;
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(next(&mut c1).await);
    }
    nothing_within(&mut c2, Duration::from_millis(200)).await;
    bounded(held[0].ack(Default::default())).await.expect("ack");
    assert_eq!(body(&next(&mut c2).await), "0");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nack_reject_requeue_redelivered_at_original_position() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare(&ch, "rq").await;
    publish_n(&ch, "rq", 4).await;
    let get = || async {
        bounded(ch.basic_get("rq".into(), BasicGetOptions { no_ack: false }))
            .await
            .expect("get")
            .expect("a message")
    };
    let m0 = get().await;
    let m1 = get().await;
    let m2 = get().await;
    assert_eq!(m2.message_count, 1);
    // Requeue m1 (reject) then m0 and m2 (nack multiple): the queue is 0,1,2,3 again.
    bounded(m1.delivery.reject(BasicRejectOptions { requeue: true }))
        .await
        .expect("reject");
    bounded(m2.delivery.nack(BasicNackOptions {
        multiple: true,
        requeue: true,
    }))
    .await
    .expect("nack");
    let _ = m0;
    let mut order = Vec::new();
    while let Some(m) = bounded(ch.basic_get("rq".into(), BasicGetOptions { no_ack: true }))
        .await
        .expect("get")
    {
        order.push((body(&m.delivery), m.delivery.redelivered));
    }
    assert_eq!(
        order,
        [
            ("0".into(), true),
            ("1".into(), true),
            ("2".into(), true),
            ("3".into(), false)
        ]
    );
    // Rejected without requeue: dropped.
    publish_n(&ch, "rq", 1).await;
    let m = get().await;
    bounded(m.delivery.reject(BasicRejectOptions { requeue: false }))
        .await
        .expect("reject");
    assert!(
        bounded(ch.basic_get("rq".into(), Default::default()))
            .await
            .expect("get")
            .is_none()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recover_redelivers_unacked_messages() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare(&ch, "rec").await;
    publish_n(&ch, "rec", 2).await;
    let mut consumer = consume(&ch, "rec", false).await;
    let a = next(&mut consumer).await;
    let b2 = next(&mut consumer).await;
    assert!(!a.redelivered && !b2.redelivered);
    bounded(ch.basic_recover(BasicRecoverOptions { requeue: true }))
        .await
        .expect("recover");
    let again = next(&mut consumer).await;
    assert_eq!(body(&again), "0");
    assert!(again.redelivered);
    assert!(next(&mut consumer).await.redelivered);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closing_a_channel_requeues_its_unacked_messages() {
    let b = start().await;
    let conn = b.connect().await;
    let ch = warren_tests::bounded_as("channel.open-ok", conn.create_channel())
        .await
        .expect("channel");
    declare(&ch, "cl").await;
    publish_n(&ch, "cl", 1).await;
    let mut consumer = consume(&ch, "cl", false).await;
    let d = next(&mut consumer).await;
    assert!(!d.redelivered);
    bounded(ch.close(200, "done".into())).await.expect("close");
    let ch2 = warren_tests::bounded_as("channel.open-ok", conn.create_channel())
        .await
        .expect("channel");
    let m = bounded(ch2.basic_get("cl".into(), BasicGetOptions { no_ack: true }))
        .await
        .expect("get")
        .expect("requeued");
    assert!(m.delivery.redelivered);
    assert!(
        bounded(ch2.basic_get("cl".into(), Default::default()))
            .await
            .expect("get")
            .is_none()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_delivery_tag_closes_the_channel_with_406() {
    let b = start().await;
    let (conn, ch) = b.channel().await;
    let _ = bounded(ch.basic_ack(42, Default::default())).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        !ch.status().connected(),
        "the channel was closed by the broker"
    );
    assert!(conn.status().connected(), "the connection stays open");
    let ch2 = warren_tests::bounded_as("channel.open-ok", conn.create_channel())
        .await
        .expect("channel");
    declare(&ch2, "alive").await;
}
