//! Delayed delivery over the wire with lapin (docs/delayed.md): the
//! `rabbitmq_delayed_message_exchange` plugin's interface (a MassTransit-style declare of
//! `x-delayed-message` with `x-delayed-type`, the `x-delay` header), its answers to bad
//! input, and Warren's `x-deliver-at`.

use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, ExchangeKind};
use std::time::{Duration, Instant};
use warren_tests::*;

fn table(pairs: &[(&str, AMQPValue)]) -> FieldTable {
    let mut t = FieldTable::default();
    for (k, v) in pairs {
        t.insert((*k).into(), v.clone());
    }
    t
}

fn text(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s))
}

fn delayed(_underlying: &str) -> ExchangeKind {
    ExchangeKind::Custom("x-delayed-message".into())
}

async fn declare_delayed(ch: &lapin::Channel, name: &str, kind: &str) {
    bounded(ch.exchange_declare(
        name.into(),
        delayed(kind),
        ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        },
        table(&[("x-delayed-type", text(kind))]),
    ))
    .await
    .expect("declare the delayed exchange");
}

fn with_delay(v: AMQPValue) -> BasicProperties {
    BasicProperties::default().with_headers(table(&[("x-delay", v)]))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn x_delay_holds_a_message_back_and_routes_it_by_the_underlying_type() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_delayed(&ch, "delayed", "topic").await;
    declare(&ch, "q").await;
    bounded(ch.queue_bind(
        "q".into(),
        "delayed".into(),
        "orders.*".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    ))
    .await
    .expect("bind");
    bounded(ch.confirm_select(ConfirmSelectOptions::default()))
        .await
        .expect("confirms");
    let mut consumer = consume(&ch, "q", true).await;
    let sent = Instant::now();
    for (body, ms) in [("second", 600i64), ("first", 300)] {
        bounded(
            bounded(ch.basic_publish(
                "delayed".into(),
                "orders.new".into(),
                BasicPublishOptions::default(),
                body.as_bytes(),
                with_delay(AMQPValue::LongLongInt(ms)),
            ))
            .await
            .expect("publish"),
        )
        .await
        .expect("confirm");
    }
    bounded(
        bounded(ch.basic_publish(
            "delayed".into(),
            "other.new".into(),
            BasicPublishOptions::default(),
            b"unrouted",
            with_delay(AMQPValue::LongLongInt(100)),
        ))
        .await
        .expect("publish"),
    )
    .await
    .expect("confirm");
    nothing_within(&mut consumer, Duration::from_millis(200)).await;
    let d = next(&mut consumer).await;
    assert_eq!(body(&d), "first");
    let waited = sent.elapsed();
    assert!(
        waited >= Duration::from_millis(300),
        "delivered after {waited:?}"
    );
    // The plugin's mark: routed with the delay negated.
    let headers = d.properties.headers().clone().expect("headers");
    let got = headers.inner().get(&ShortString::from("x-delay")).cloned();
    assert!(matches!(got, Some(AMQPValue::LongLongInt(-300))), "{got:?}");
    assert_eq!(body(&next(&mut consumer).await), "second");
    nothing_within(&mut consumer, Duration::from_millis(200)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_underlying_type_and_bad_declares_get_the_plugins_answers() {
    let b = start().await;
    let conn = b.connect().await;
    let ch = bounded(conn.create_channel()).await.expect("channel");
    for kind in ["direct", "topic", "fanout", "headers"] {
        declare_delayed(&ch, &format!("d-{kind}"), kind).await;
    }
    channel_error(
        &conn,
        406,
        "PRECONDITION_FAILED",
        "x-delayed-type",
        |ch| async move {
            ch.exchange_declare(
                "d-none".into(),
                delayed(""),
                ExchangeDeclareOptions::default(),
                FieldTable::default(),
            )
            .await
        },
    )
    .await;
    channel_error(
        &conn,
        406,
        "PRECONDITION_FAILED",
        "x-delayed-message",
        |ch| async move {
            ch.exchange_declare(
                "d-self".into(),
                delayed(""),
                ExchangeDeclareOptions::default(),
                table(&[("x-delayed-type", text("x-delayed-message"))]),
            )
            .await
        },
    )
    .await;
    // An unknown type: RabbitMQ's type check, 503, a connection error.
    let c3 = b.connect().await;
    let ch3 = bounded(c3.create_channel()).await.expect("channel");
    let err = bounded(ch3.exchange_declare(
        "d-nope".into(),
        delayed(""),
        ExchangeDeclareOptions::default(),
        table(&[("x-delayed-type", text("nope"))]),
    ))
    .await
    .expect_err("503");
    let (code, text, hard) = reply(&err);
    assert_eq!((code, hard), (503, true), "{text}");
    assert!(text.contains("nope"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_x_delay_closes_only_its_channel_with_406() {
    let b = start().await;
    let conn = b.connect().await;
    let ch = bounded(conn.create_channel()).await.expect("channel");
    declare_delayed(&ch, "d", "direct").await;
    declare(&ch, "q").await;
    bounded(ch.queue_bind(
        "q".into(),
        "d".into(),
        "k".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    ))
    .await
    .expect("bind");
    let mut consumer = consume(&ch, "q", true).await;
    for bad in [text("soon"), AMQPValue::LongLongInt(1 << 40)] {
        let c2 = b.connect().await;
        channel_error(
            &c2,
            406,
            "PRECONDITION_FAILED",
            "x-delay",
            |ch| async move {
                ch.confirm_select(ConfirmSelectOptions::default()).await?;
                ch.basic_publish(
                    "d".into(),
                    "k".into(),
                    BasicPublishOptions::default(),
                    b"x",
                    with_delay(bad),
                )
                .await?
                .await
            },
        )
        .await;
    }
    // Nothing else was affected.
    bounded(ch.basic_publish(
        "d".into(),
        "k".into(),
        BasicPublishOptions::default(),
        b"fine",
        with_delay(AMQPValue::LongLongInt(50)),
    ))
    .await
    .expect("publish");
    assert_eq!(body(&next(&mut consumer).await), "fine");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mandatory_is_returned_at_once_and_still_delivered_when_due() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_delayed(&ch, "d", "direct").await;
    declare(&ch, "q").await;
    bounded(ch.queue_bind(
        "q".into(),
        "d".into(),
        "k".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    ))
    .await
    .expect("bind");
    bounded(ch.confirm_select(ConfirmSelectOptions::default()))
        .await
        .expect("confirms");
    let mut consumer = consume(&ch, "q", true).await;
    let confirm = bounded(ch.basic_publish(
        "d".into(),
        "k".into(),
        BasicPublishOptions {
            mandatory: true,
            ..Default::default()
        },
        b"m",
        with_delay(AMQPValue::LongLongInt(200)),
    ))
    .await
    .expect("publish");
    let confirmation = bounded(confirm).await.expect("confirm");
    let returned = confirmation
        .take_message()
        .expect("returned at once, as the plugin does");
    assert_eq!(returned.reply_code, 312);
    assert_eq!(body(&next(&mut consumer).await), "m");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn x_deliver_at_schedules_on_a_plain_exchange() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare(&ch, "q").await;
    let mut consumer = consume(&ch, "q", true).await;
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_millis() as i64;
    let props = BasicProperties::default().with_headers(table(&[(
        "x-deliver-at",
        AMQPValue::LongLongInt(now_ms + 300),
    )]));
    bounded(ch.basic_publish(
        "".into(),
        "q".into(),
        BasicPublishOptions::default(),
        b"at",
        props,
    ))
    .await
    .expect("publish");
    nothing_within(&mut consumer, Duration::from_millis(150)).await;
    assert_eq!(body(&next(&mut consumer).await), "at");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scheduled_on_every_shard() {
    let b = start_sharded(3).await;
    let (_c, ch) = b.channel().await;
    declare_delayed(&ch, "d", "fanout").await;
    declare(&ch, "q").await;
    bounded(ch.queue_bind(
        "q".into(),
        "d".into(),
        "".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    ))
    .await
    .expect("bind");
    let mut consumer = consume(&ch, "q", true).await;
    let mut publishers = Vec::new();
    for i in 0..3 {
        let (c, p) = b.channel().await;
        bounded(p.basic_publish(
            "d".into(),
            "".into(),
            BasicPublishOptions::default(),
            format!("m{i}").as_bytes(),
            with_delay(AMQPValue::LongLongInt(100 + 50 * i)),
        ))
        .await
        .expect("publish");
        publishers.push((c, p));
    }
    let got: Vec<String> = take(&mut consumer, 3).await.iter().map(body).collect();
    assert_eq!(got, ["m0", "m1", "m2"]);
}
