//! RabbitMQ queue features over the wire with lapin: TTL, dead-lettering with the exact
//! `x-death` headers, length limits, single active consumer, consumer priorities, queue
//! expiry, argument validation.

use lapin::BasicProperties;
use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable, ShortString};
use std::time::Duration;
use warren_tests::*;

fn table(pairs: &[(&str, AMQPValue)]) -> FieldTable {
    let mut t = FieldTable::default();
    for (k, v) in pairs {
        t.insert(ShortString::from(*k), v.clone());
    }
    t
}

fn text(s: &str) -> AMQPValue {
    AMQPValue::LongString(s.into())
}

async fn declare_with(
    ch: &lapin::Channel,
    name: &str,
    args: FieldTable,
) -> Result<lapin::Queue, lapin::Error> {
    bounded(ch.queue_declare(name.into(), QueueDeclareOptions::default(), args)).await
}

async fn publish(
    ch: &lapin::Channel,
    exchange: &str,
    key: &str,
    body: &str,
    props: BasicProperties,
) {
    bounded(ch.basic_publish(
        exchange.into(),
        key.into(),
        Default::default(),
        body.as_bytes(),
        props,
    ))
    .await
    .expect("publish");
}

/// `dlx` (fanout) -> `dlq`, and `q` dead-lettering into `dlx` with `extra` arguments.
async fn dead_letter_setup(ch: &lapin::Channel, q: &str, extra: &[(&str, AMQPValue)]) {
    bounded(ch.exchange_declare(
        "dlx".into(),
        lapin::ExchangeKind::Fanout,
        ExchangeDeclareOptions::default(),
        FieldTable::default(),
    ))
    .await
    .expect("dlx");
    declare(ch, "dlq").await;
    bounded(ch.queue_bind(
        "dlq".into(),
        "dlx".into(),
        "".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    ))
    .await
    .expect("bind dlq");
    let mut args = vec![("x-dead-letter-exchange", text("dlx"))];
    args.extend(extra.iter().cloned());
    declare_with(ch, q, table(&args)).await.expect("declare q");
}

async fn get(ch: &lapin::Channel, queue: &str) -> Option<lapin::message::BasicGetMessage> {
    bounded(ch.basic_get(queue.into(), BasicGetOptions { no_ack: true }))
        .await
        .expect("basic.get")
}

async fn get_eventually(ch: &lapin::Channel, queue: &str) -> lapin::message::BasicGetMessage {
    for _ in 0..100 {
        if let Some(m) = get(ch, queue).await {
            return m;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("nothing arrived in {queue} within 2 s");
}

fn x_death(m: &lapin::message::BasicGetMessage) -> (Vec<AMQPValue>, FieldTable) {
    let headers = m
        .delivery
        .properties
        .headers()
        .clone()
        .expect("dead-lettered messages have headers");
    match headers.inner().get(&ShortString::from("x-death")) {
        Some(AMQPValue::FieldArray(items)) => (items.as_slice().to_vec(), headers),
        other => panic!("x-death: {other:?}"),
    }
}

fn entry(v: &AMQPValue) -> &FieldTable {
    match v {
        AMQPValue::FieldTable(t) => t,
        other => panic!("x-death entry: {other:?}"),
    }
}

fn field<'a>(t: &'a FieldTable, k: &str) -> &'a AMQPValue {
    t.inner()
        .get(&ShortString::from(k))
        .unwrap_or_else(|| panic!("{k} missing in {t:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_messages_are_dead_lettered_with_x_death() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    dead_letter_setup(&ch, "ttl-q", &[("x-message-ttl", AMQPValue::LongInt(50))]).await;
    let props = BasicProperties::default()
        .with_expiration("10000".into())
        .with_message_id("m-1".into());
    publish(&ch, "", "ttl-q", "payload", props).await;
    let m = get_eventually(&ch, "dlq").await;
    assert_eq!(m.delivery.data, b"payload");
    assert_eq!(m.delivery.exchange.as_str(), "dlx");
    assert_eq!(m.delivery.routing_key.as_str(), "ttl-q");
    assert_eq!(
        m.delivery.properties.expiration(),
        &None,
        "expiration removed"
    );
    assert_eq!(
        m.delivery
            .properties
            .message_id()
            .as_ref()
            .map(|s| s.as_str()),
        Some("m-1")
    );
    let (deaths, headers) = x_death(&m);
    assert_eq!(deaths.len(), 1);
    let d = entry(&deaths[0]);
    assert_eq!(field(d, "reason"), &text("expired"));
    assert_eq!(field(d, "queue"), &text("ttl-q"));
    assert_eq!(field(d, "exchange"), &text(""));
    assert_eq!(field(d, "count"), &AMQPValue::LongLongInt(1));
    assert_eq!(field(d, "original-expiration"), &text("10000"));
    assert!(
        matches!(field(d, "time"), AMQPValue::Timestamp(t) if *t > 1_700_000_000),
        "unix seconds"
    );
    match field(d, "routing-keys") {
        AMQPValue::FieldArray(keys) => assert_eq!(keys.as_slice(), &[text("ttl-q")]),
        other => panic!("routing-keys: {other:?}"),
    }
    assert_eq!(field(&headers, "x-first-death-reason"), &text("expired"));
    assert_eq!(field(&headers, "x-first-death-queue"), &text("ttl-q"));
    assert_eq!(field(&headers, "x-first-death-exchange"), &text(""));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rejected_and_nacked_messages_are_dead_lettered() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    dead_letter_setup(&ch, "rej-q", &[("x-dead-letter-routing-key", text("rk"))]).await;
    publish(&ch, "", "rej-q", "a", BasicProperties::default()).await;
    publish(&ch, "", "rej-q", "b", BasicProperties::default()).await;
    let mut consumer = consume(&ch, "rej-q", false).await;
    let first = next(&mut consumer).await;
    let second = next(&mut consumer).await;
    first
        .reject(BasicRejectOptions { requeue: false })
        .await
        .expect("reject");
    second
        .nack(BasicNackOptions {
            requeue: false,
            multiple: false,
        })
        .await
        .expect("nack");
    for expected in ["a", "b"] {
        let m = get_eventually(&ch, "dlq").await;
        assert_eq!(m.delivery.data, expected.as_bytes());
        assert_eq!(
            m.delivery.routing_key.as_str(),
            "rk",
            "x-dead-letter-routing-key"
        );
        let (deaths, _) = x_death(&m);
        assert_eq!(field(entry(&deaths[0]), "reason"), &text("rejected"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_length_drops_the_head_or_rejects_publishes() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    dead_letter_setup(&ch, "len-q", &[("x-max-length", AMQPValue::LongInt(2))]).await;
    for m in ["1", "2", "3"] {
        publish(&ch, "", "len-q", m, BasicProperties::default()).await;
    }
    let dropped = get_eventually(&ch, "dlq").await;
    assert_eq!(dropped.delivery.data, b"1");
    assert_eq!(
        field(entry(&x_death(&dropped).0[0]), "reason"),
        &text("maxlen")
    );
    assert_eq!(drain(&ch, "len-q").await, vec!["2", "3"]);

    let (_c2, confirm_ch) = b.channel().await;
    bounded(confirm_ch.confirm_select(ConfirmSelectOptions::default()))
        .await
        .expect("confirm mode");
    declare_with(
        &confirm_ch,
        "full-q",
        table(&[
            ("x-max-length", AMQPValue::LongInt(1)),
            ("x-overflow", text("reject-publish")),
        ]),
    )
    .await
    .expect("declare");
    let mut acks = Vec::new();
    for m in ["kept", "refused"] {
        let confirm = bounded(confirm_ch.basic_publish(
            "".into(),
            "full-q".into(),
            Default::default(),
            m.as_bytes(),
            BasicProperties::default(),
        ))
        .await
        .expect("publish");
        acks.push(bounded(confirm).await.expect("confirm").is_ack());
    }
    assert_eq!(acks, vec![true, false], "the second publish is nacked");
    assert_eq!(drain(&confirm_ch, "full-q").await, vec!["kept"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_active_consumer_and_consumer_priorities() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_with(
        &ch,
        "sac-q",
        table(&[("x-single-active-consumer", AMQPValue::Boolean(true))]),
    )
    .await
    .expect("declare");
    let mut first = consume(&ch, "sac-q", true).await;
    let (_c2, ch2) = b.channel().await;
    let mut second = consume(&ch2, "sac-q", true).await;
    for i in 0..3 {
        publish(&ch, "", "sac-q", &i.to_string(), BasicProperties::default()).await;
    }
    assert_eq!(
        take(&mut first, 3)
            .await
            .iter()
            .map(body)
            .collect::<Vec<_>>(),
        ["0", "1", "2"]
    );
    nothing_within(&mut second, Duration::from_millis(100)).await;

    let (_c3, pch) = b.channel().await;
    declare(&pch, "prio-q").await;
    bounded(pch.basic_qos(1, BasicQosOptions::default()))
        .await
        .expect("qos");
    let mut low = bounded(pch.basic_consume(
        "prio-q".into(),
        "low".into(),
        BasicConsumeOptions::default(),
        table(&[("x-priority", AMQPValue::LongInt(1))]),
    ))
    .await
    .expect("consume low");
    let mut high = bounded(pch.basic_consume(
        "prio-q".into(),
        "high".into(),
        BasicConsumeOptions::default(),
        table(&[("x-priority", AMQPValue::LongInt(5))]),
    ))
    .await
    .expect("consume high");
    publish(&pch, "", "prio-q", "first", BasicProperties::default()).await;
    assert_eq!(body(&next(&mut high).await), "first");
    publish(&pch, "", "prio-q", "second", BasicProperties::default()).await;
    assert_eq!(
        body(&next(&mut low).await),
        "second",
        "high is at its prefetch of 1"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unused_queues_expire_and_bad_arguments_are_refused() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_with(
        &ch,
        "short-lived",
        table(&[("x-expires", AMQPValue::LongInt(100))]),
    )
    .await
    .expect("declare");
    let passive = QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    let mut gone = false;
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(20)).await;
        let (_c, probe) = b.channel().await;
        if let Err(e) =
            bounded(probe.queue_declare("short-lived".into(), passive, FieldTable::default())).await
        {
            assert_eq!(code(&e), 404);
            gone = true;
            break;
        }
    }
    assert!(gone, "the queue expired within 1 s");

    let err = declare_with(
        &ch,
        "bad",
        table(&[("x-max-length", AMQPValue::LongInt(-1))]),
    )
    .await
    .expect_err("negative max-length");
    assert_eq!(
        reply(&err),
        (
            406,
            "PRECONDITION_FAILED - invalid arg 'x-max-length' for queue 'bad' in vhost '/': {value_negative,-1}".into(),
            false
        )
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn priority_queues_deliver_the_highest_priority_first() {
    let b = start().await;
    let (_c, ch) = b.channel().await;
    declare_with(
        &ch,
        "prio",
        table(&[("x-max-priority", AMQPValue::ShortShortUInt(10))]),
    )
    .await
    .expect("declare");
    for (body, priority) in [("p1", 1u8), ("p9", 9), ("p0", 0), ("p5", 5)] {
        publish(
            &ch,
            "",
            "prio",
            body,
            BasicProperties::default().with_priority(priority),
        )
        .await;
    }
    assert_eq!(drain(&ch, "prio").await, vec!["p9", "p5", "p1", "p0"]);
}

/// Types Warren does not serve are refused with 406 (RabbitMQ's text for a type it does not
/// know) instead of silently giving a classic queue; quorum queues and streams are served,
/// durable only, as in RabbitMQ. The channel error leaves the connection open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_types_other_than_classic_are_refused() {
    let b = start().await;
    let (c, ch) = b.channel().await;
    let kind = |k: &str| table(&[("x-queue-type", AMQPValue::LongString(k.into()))]);
    declare_with(&ch, "classic-q", kind("classic"))
        .await
        .expect("classic is what every queue is");
    let err = declare_with(&ch, "quorum-q", kind("quorum"))
        .await
        .expect_err("a quorum queue is durable only");
    assert_eq!(
        reply(&err),
        (
            406,
            "PRECONDITION_FAILED - invalid property 'non-durable' for queue 'quorum-q' in vhost '/'"
                .into(),
            false
        )
    );
    let ch = bounded(c.create_channel()).await.expect("channel");
    let durable = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    bounded(ch.queue_declare("quorum-ok".into(), durable, kind("quorum")))
        .await
        .expect("a durable quorum queue is served");
    for (k, detail) in [("bogus", "\"unsupported queue type 'bogus'\"")] {
        let ch = bounded(c.create_channel()).await.expect("channel");
        let err = declare_with(&ch, &format!("{k}-q"), kind(k))
            .await
            .expect_err(k);
        assert_eq!(
            reply(&err),
            (
                406,
                format!(
                    "PRECONDITION_FAILED - invalid arg 'x-queue-type' for queue '{k}-q' in vhost '/': {detail}"
                ),
                false
            )
        );
    }
    // Nothing was created by the refused declares.
    let (_c, probe) = b.channel().await;
    let passive = QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    let err = bounded(probe.queue_declare("quorum-q".into(), passive, FieldTable::default()))
        .await
        .expect_err("no quorum-q");
    assert_eq!(code(&err), 404);
}
