//! Publishing over the wire with lapin: mandatory returns, publisher confirms, transactions,
//! large multi-frame messages, properties, and errors that close the connection.

use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Confirmation, ExchangeKind};
use warren_tests::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mandatory_unroutable_message_comes_back_312_no_route() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    warren_tests::bounded_as("confirm.select-ok", ch.confirm_select(Default::default()))
        .await
        .expect("confirms");
    let confirm = bounded(async {
        ch.basic_publish(
            "amq.direct".into(),
            "nobody-listens".into(),
            BasicPublishOptions {
                mandatory: true,
                ..Default::default()
            },
            b"boomerang",
            BasicProperties::default(),
        )
        .await?
        .await
    })
    .await
    .expect("publish");
    match confirm {
        Confirmation::Ack(Some(returned)) => {
            assert_eq!(returned.reply_code, 312);
            assert_eq!(returned.reply_text.as_str(), "NO_ROUTE");
            assert_eq!(returned.delivery.data, b"boomerang");
        }
        other => panic!("expected an ack with the returned message, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_publish_is_confirmed_in_order() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    warren_tests::bounded_as("confirm.select-ok", ch.confirm_select(Default::default()))
        .await
        .expect("confirms");
    declare(&ch, "confirmed").await;
    let mut pending = Vec::new();
    for i in 0..500u32 {
        pending.push(
            bounded(ch.basic_publish(
                "".into(),
                "confirmed".into(),
                Default::default(),
                &i.to_be_bytes(),
                BasicProperties::default(),
            ))
            .await
            .expect("publish"),
        );
    }
    for p in pending {
        assert!(bounded(p).await.expect("confirm").is_ack());
    }
    let q = declare(&ch, "confirmed").await;
    assert_eq!(q.message_count(), 500);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactions_commit_and_rollback_publishes_and_acks() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare(&ch, "txq").await;
    bounded(ch.tx_select()).await.expect("tx.select");
    for body in ["a", "b"] {
        bounded(ch.basic_publish(
            "".into(),
            "txq".into(),
            Default::default(),
            body.as_bytes(),
            BasicProperties::default(),
        ))
        .await
        .expect("publish");
    }
    bounded(ch.tx_rollback()).await.expect("rollback");
    assert_eq!(declare(&ch, "txq").await.message_count(), 0, "rolled back");
    bounded(ch.basic_publish(
        "".into(),
        "txq".into(),
        Default::default(),
        b"c",
        BasicProperties::default(),
    ))
    .await
    .expect("publish");
    assert_eq!(
        declare(&ch, "txq").await.message_count(),
        0,
        "not before commit"
    );
    bounded(ch.tx_commit()).await.expect("commit");
    assert_eq!(declare(&ch, "txq").await.message_count(), 1);
    // An ack inside a transaction takes effect on commit only.
    let m = bounded(ch.basic_get("txq".into(), Default::default()))
        .await
        .expect("get")
        .expect("message");
    bounded(m.delivery.ack(Default::default()))
        .await
        .expect("ack");
    bounded(ch.tx_rollback()).await.expect("rollback the ack");
    bounded(ch.basic_recover(BasicRecoverOptions { requeue: true }))
        .await
        .expect("recover");
    let again = bounded(ch.basic_get("txq".into(), BasicGetOptions { no_ack: true }))
        .await
        .expect("get")
        .expect("the ack was rolled back");
    assert!(again.delivery.redelivered);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_message_with_properties_round_trips() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare(&ch, "big").await;
    let body: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
    let mut headers = FieldTable::default();
    headers.insert(
        "trace".into(),
        AMQPValue::LongString(LongString::from("abc")),
    );
    headers.insert("n".into(), AMQPValue::LongInt(-7));
    let props = BasicProperties::default()
        .with_content_type("application/octet-stream".into())
        .with_delivery_mode(2)
        .with_priority(3)
        .with_correlation_id("c-1".into())
        .with_reply_to("replies".into())
        .with_message_id("m-1".into())
        .with_timestamp(1_700_000_000)
        .with_type("blob".into())
        .with_app_id("tests".into())
        .with_headers(headers);
    bounded(ch.basic_publish(
        "".into(),
        "big".into(),
        Default::default(),
        &body,
        props.clone(),
    ))
    .await
    .expect("publish");
    let mut consumer = consume(&ch, "big", true).await;
    let d = next(&mut consumer).await;
    assert_eq!(d.data.len(), body.len());
    assert!(d.data == body, "body intact across frames");
    assert_eq!(d.properties, props);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_exchange_type_is_a_connection_error_503() {
    let b = start().await;
    let (conn, ch) = b.channel().await;
    let err = bounded(ch.exchange_declare(
        "weird".into(),
        ExchangeKind::Custom("x-nonexistent".into()),
        Default::default(),
        FieldTable::default(),
    ))
    .await
    .expect_err("unknown type");
    assert_eq!(code(&err), 503);
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    assert!(
        !conn.status().connected(),
        "a connection exception closes the connection"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publishing_to_a_missing_exchange_closes_the_channel_with_404() {
    let b = start().await;
    let (conn, ch) = b.channel().await;
    warren_tests::bounded_as("confirm.select-ok", ch.confirm_select(Default::default()))
        .await
        .expect("confirms");
    let res = bounded(async {
        ch.basic_publish(
            "no-such-exchange".into(),
            "k".into(),
            Default::default(),
            b"x",
            BasicProperties::default(),
        )
        .await?
        .await
    })
    .await;
    assert_eq!(code(&res.expect_err("missing exchange")), 404);
    assert!(conn.status().connected());
}
