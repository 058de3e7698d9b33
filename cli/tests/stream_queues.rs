//! Stream queues over AMQP 0.9.1 (`x-queue-type: stream`) against the `warren` binary with
//! lapin, and the same streams over the stream protocol with the Rust
//! `rabbitmq-stream-client`: RabbitMQ 3.10's semantics (declare checks, prefetch required,
//! `x-stream-offset` first/last/next/numeric/timestamp/interval with the offset in each
//! delivery, basic.get refused, independent consumers), one log for both protocols, and
//! kill -9 after confirms keeping every confirmed message at its offset.

use futures::StreamExt;
use lapin::options::*;
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Channel, Connection, Consumer};
use rabbitmq_stream_client::Environment;
use rabbitmq_stream_client::types::{Message, OffsetSpecification};
use std::path::PathBuf;
use std::time::Duration;

mod common;
use common::Killed as Broker;

fn data_dir(tag: &str) -> PathBuf {
    common::scratch_dir("sq", tag)
}

fn serve(dir: &std::path::Path) -> Broker {
    Broker(common::serve(dir, false, &["--stream", "127.0.0.1:0"]))
}

/// `f` within 30 s. A plain fn (not `async`) so that `#[track_caller]` holds: the panic
/// names the test's line, that is what was waited for.
#[track_caller]
fn bounded<F: std::future::Future>(f: F) -> impl std::future::Future<Output = F::Output> {
    let at = std::panic::Location::caller();
    async move {
        tokio::time::timeout(Duration::from_secs(30), f)
            .await
            .unwrap_or_else(|_| panic!("no answer within 30 s (awaited at {at})"))
    }
}

async fn connect(port: u16) -> Connection {
    let uri = format!("amqp://guest:guest@127.0.0.1:{port}/%2f");
    bounded(lapin::Connection::connect(
        &uri,
        lapin::ConnectionProperties::default(),
    ))
    .await
    .expect("connect")
}

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

async fn declare_stream(ch: &Channel, name: &str) {
    bounded(ch.queue_declare(
        name.into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        table(&[("x-queue-type", text("stream"))]),
    ))
    .await
    .expect("declare the stream");
}

/// The broker's reply code and text for a failed operation.
fn reply(err: &lapin::Error) -> (u16, String) {
    match err.kind() {
        lapin::ErrorKind::ProtocolError(e) => (e.get_id(), e.get_message().to_string()),
        other => panic!("expected a protocol error from the broker, got {other:?}"),
    }
}

/// Publishes `bodies` to the stream with confirms; all must be acked.
async fn publish(ch: &Channel, queue: &str, bodies: impl Iterator<Item = String>) {
    for b in bodies {
        bounded(ch.basic_publish(
            "".into(),
            queue.into(),
            BasicPublishOptions::default(),
            b.as_bytes(),
            BasicProperties::default().with_delivery_mode(2),
        ))
        .await
        .expect("publish");
    }
    let nacked = bounded(ch.wait_for_confirms()).await.expect("confirms");
    assert!(nacked.is_empty(), "every publish confirmed");
}

/// A consumer of `queue` from `offset` (absent: the default, `next`) with prefetch 100.
async fn consume_from(conn: &Connection, queue: &str, offset: Option<AMQPValue>) -> Consumer {
    let ch = bounded(conn.create_channel()).await.expect("channel");
    bounded(ch.basic_qos(100, BasicQosOptions::default()))
        .await
        .expect("qos");
    let args = match offset {
        Some(v) => table(&[("x-stream-offset", v)]),
        None => FieldTable::default(),
    };
    bounded(ch.basic_consume(
        queue.into(),
        "".into(),
        BasicConsumeOptions::default(),
        args,
    ))
    .await
    .expect("consume")
}

/// The next `n` deliveries as (x-stream-offset, body), each acked (acks return credit).
async fn take(consumer: &mut Consumer, n: usize) -> Vec<(i64, String)> {
    let mut got = Vec::with_capacity(n);
    while got.len() < n {
        let d = tokio::time::timeout(Duration::from_secs(20), consumer.next())
            .await
            .unwrap_or_else(|_| panic!("delivery {} of {n} within 20 s", got.len()))
            .expect("consumer open")
            .expect("delivery");
        let offset = match d.properties.headers().as_ref().and_then(|h| {
            h.inner()
                .get(&ShortString::from("x-stream-offset"))
                .cloned()
        }) {
            Some(AMQPValue::LongLongInt(o)) => o,
            other => panic!("x-stream-offset header missing or mistyped: {other:?}"),
        };
        got.push((offset, String::from_utf8_lossy(&d.data).into_owned()));
        bounded(d.acker.ack(BasicAckOptions::default()))
            .await
            .expect("ack");
    }
    got
}

async fn nothing_within(consumer: &mut Consumer, quiet: Duration) {
    if let Ok(Some(d)) = tokio::time::timeout(quiet, consumer.next()).await {
        panic!("unexpected delivery: {:?}", d.map(|d| d.data));
    }
}

fn expect_bodies(got: &[(i64, String)], from: i64, prefix: &str) {
    for (i, (offset, body)) in got.iter().enumerate() {
        assert_eq!(*offset, from + i as i64, "offsets dense and in order");
        assert_eq!(*body, format!("{prefix}{}", from + i as i64));
    }
}

async fn stream_env(port: u16) -> Environment {
    bounded(Environment::builder().host("127.0.0.1").port(port).build())
        .await
        .expect("stream connect")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn declare_publish_10k_with_confirms_and_two_consumers_read_all_from_first() {
    let dir = data_dir("10k");
    let b = serve(&dir);
    let conn = connect(b.0.amqp).await;
    let ch = bounded(conn.create_channel()).await.unwrap();
    // Durable only, with RabbitMQ's text; no exclusive or auto-delete streams.
    for (opts, property) in [
        (QueueDeclareOptions::default(), "non-durable"),
        (
            QueueDeclareOptions {
                durable: true,
                exclusive: true,
                ..Default::default()
            },
            "exclusive-owner",
        ),
        (
            QueueDeclareOptions {
                durable: true,
                auto_delete: true,
                ..Default::default()
            },
            "auto-delete",
        ),
    ] {
        let ch = bounded(conn.create_channel()).await.unwrap();
        let err = bounded(ch.queue_declare(
            "refused".into(),
            opts,
            table(&[("x-queue-type", text("stream"))]),
        ))
        .await
        .expect_err("refused");
        assert_eq!(
            reply(&err),
            (
                406,
                format!(
                    "PRECONDITION_FAILED - invalid property '{property}' for queue 'refused' in vhost '/'"
                )
            )
        );
    }
    declare_stream(&ch, "s").await;
    bounded(ch.confirm_select(ConfirmSelectOptions::default()))
        .await
        .unwrap();
    const N: usize = 10_000;
    publish(&ch, "s", (0..N).map(|i| format!("m{i}"))).await;
    // Two consumers on two connections, each reads everything from the first offset.
    let other = connect(b.0.amqp).await;
    let mut c1 = consume_from(&conn, "s", Some(text("first"))).await;
    let mut c2 = consume_from(&other, "s", Some(text("first"))).await;
    let (got1, got2) = tokio::join!(take(&mut c1, N), take(&mut c2, N));
    expect_bodies(&got1, 0, "m");
    expect_bodies(&got2, 0, "m");
    // Acks do not remove: a third consumer still reads from the first.
    let mut c3 = consume_from(&conn, "s", Some(text("first"))).await;
    expect_bodies(&take(&mut c3, 5).await, 0, "m");
    // A consumer without a prefetch is refused, as RabbitMQ refuses it.
    let noqos = bounded(conn.create_channel()).await.unwrap();
    let err = bounded(noqos.basic_consume(
        "s".into(),
        "".into(),
        BasicConsumeOptions::default(),
        FieldTable::default(),
    ))
    .await
    .expect_err("refused");
    assert_eq!(
        reply(&err),
        (
            406,
            "PRECONDITION_FAILED - consumer prefetch count is not set for 'queue 's' in vhost '/''"
                .into()
        )
    );
    // basic.get is refused with a connection error (540), as RabbitMQ refuses it.
    let third = connect(b.0.amqp).await;
    let gch = bounded(third.create_channel()).await.unwrap();
    let err = bounded(gch.basic_get("s".into(), BasicGetOptions::default()))
        .await
        .expect_err("refused");
    assert_eq!(
        reply(&err),
        (
            540,
            "NOT_IMPLEMENTED - basic.get not supported by stream queues queue 's' in vhost '/'"
                .into()
        )
    );
    // declare-ok counts what the stream holds.
    let q = bounded(ch.queue_declare(
        "s".into(),
        QueueDeclareOptions {
            passive: true,
            ..Default::default()
        },
        FieldTable::default(),
    ))
    .await
    .expect("passive declare");
    assert_eq!(q.message_count() as usize, N);
    drop(b);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn offsets_next_last_numeric_timestamp_and_interval() {
    let dir = data_dir("offsets");
    let b = serve(&dir);
    let conn = connect(b.0.amqp).await;
    let ch = bounded(conn.create_channel()).await.unwrap();
    declare_stream(&ch, "o").await;
    bounded(ch.confirm_select(ConfirmSelectOptions::default()))
        .await
        .unwrap();
    // Two batches a second apart (timestamps are seconds in AMQP 0.9.1).
    publish(&ch, "o", (0..5).map(|i| format!("a{i}"))).await;
    let mut next = consume_from(&conn, "o", Some(text("next"))).await;
    let mut default = consume_from(&conn, "o", None).await;
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    // Past the second boundary the timestamp names, so the second batch is stamped after it.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    publish(&ch, "o", std::iter::once("b5".to_string())).await;
    // `next` and the default read only what came after they started.
    assert_eq!(take(&mut next, 1).await, vec![(5, "b5".to_string())]);
    assert_eq!(take(&mut default, 1).await, vec![(5, "b5".to_string())]);
    // `last`: the last chunk (the single message of the second batch).
    let mut last = consume_from(&conn, "o", Some(text("last"))).await;
    assert_eq!(take(&mut last, 1).await, vec![(5, "b5".to_string())]);
    nothing_within(&mut last, Duration::from_millis(200)).await;
    // A numeric offset.
    let mut numeric = consume_from(&conn, "o", Some(AMQPValue::LongLongInt(3))).await;
    let got = take(&mut numeric, 3).await;
    assert_eq!(got[0], (3, "a3".to_string()));
    assert_eq!(got[2], (5, "b5".to_string()));
    // A timestamp (AMQP's timestamp type): the chunks stamped at or after it.
    let mut ts = consume_from(&conn, "o", Some(AMQPValue::Timestamp(secs))).await;
    assert_eq!(take(&mut ts, 1).await, vec![(5, "b5".to_string())]);
    nothing_within(&mut ts, Duration::from_millis(200)).await;
    // An interval: everything of the last hour.
    let mut hour = consume_from(&conn, "o", Some(text("1h"))).await;
    assert_eq!(
        take(&mut hour, 6).await.first(),
        Some(&(0, "a0".to_string()))
    );
    // Past the end: waits for the next message.
    let mut past = consume_from(&conn, "o", Some(AMQPValue::LongLongInt(99))).await;
    nothing_within(&mut past, Duration::from_millis(200)).await;
    drop(b);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_stream_two_protocols() {
    let dir = data_dir("interop");
    one_stream_two_protocols_on(serve(&dir)).await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// With `--in-memory` too: the logs are in memory, and still one per stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_stream_two_protocols_in_memory() {
    let dir = data_dir("interop-mem");
    let b = Broker(common::serve(
        &dir,
        false,
        &["--in-memory", "--stream", "127.0.0.1:0"],
    ));
    one_stream_two_protocols_on(b).await;
    let _ = std::fs::remove_dir_all(&dir);
}

async fn one_stream_two_protocols_on(b: Broker) {
    let port = b.0.stream.expect("stream port");
    let conn = connect(b.0.amqp).await;
    let ch = bounded(conn.create_channel()).await.unwrap();
    declare_stream(&ch, "both").await;
    bounded(ch.confirm_select(ConfirmSelectOptions::default()))
        .await
        .unwrap();
    // AMQP 0.9.1 publishes (through an exchange and a binding too) ...
    publish(&ch, "both", (0..100).map(|i| format!("q{i}"))).await;
    bounded(ch.exchange_declare(
        "x".into(),
        lapin::ExchangeKind::Direct,
        ExchangeDeclareOptions::default(),
        FieldTable::default(),
    ))
    .await
    .unwrap();
    bounded(ch.queue_bind(
        "both".into(),
        "x".into(),
        "k".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    ))
    .await
    .unwrap();
    bounded(ch.basic_publish(
        "x".into(),
        "k".into(),
        BasicPublishOptions::default(),
        b"q100",
        BasicProperties::default().with_message_id("id-100".into()),
    ))
    .await
    .unwrap();
    assert!(bounded(ch.wait_for_confirms()).await.unwrap().is_empty());
    // ... and the stream protocol's client reads them at the same offsets.
    let env = stream_env(port).await;
    let mut reader = env
        .consumer()
        .offset(OffsetSpecification::First)
        .build("both")
        .await
        .expect("subscribe to the AMQP-declared stream");
    for i in 0..=100u64 {
        let d = bounded(reader.next())
            .await
            .expect("open")
            .expect("delivery");
        assert_eq!(d.offset(), i);
        assert_eq!(
            d.message().data().map(<[u8]>::to_vec),
            Some(format!("q{i}").into_bytes())
        );
        if i == 100 {
            let id = d
                .message()
                .properties()
                .and_then(|p| p.message_id.clone())
                .map(|id| format!("{id:?}"));
            assert!(
                id.is_some_and(|id| id.contains("id-100")),
                "properties kept"
            );
        }
    }
    // The stream protocol publishes; an AMQP consumer reads those at the next offsets.
    let producer = env.producer().build("both").await.unwrap();
    for i in 101..151 {
        producer
            .send_with_confirm(Message::builder().body(format!("p{i}")).build())
            .await
            .expect("stream publish confirmed");
    }
    common::bounded_as("stream producer close answer", producer.close())
        .await
        .unwrap();
    let mut c = consume_from(&conn, "both", Some(AMQPValue::LongLongInt(101))).await;
    expect_bodies(&take(&mut c, 50).await, 101, "p");
    // A stream created over the stream protocol is the queue AMQP declares by that name.
    env.stream_creator().create("fromstream").await.unwrap();
    let producer = env.producer().build("fromstream").await.unwrap();
    for i in 0..10 {
        producer
            .send_with_confirm(Message::builder().body(format!("s{i}")).build())
            .await
            .unwrap();
    }
    common::bounded_as("stream producer close answer", producer.close())
        .await
        .unwrap();
    let passive = QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    let q = bounded(ch.queue_declare("fromstream".into(), passive, FieldTable::default()))
        .await
        .expect("the stream protocol's stream is an AMQP queue");
    assert_eq!(q.message_count(), 10);
    let mut c = consume_from(&conn, "fromstream", Some(text("first"))).await;
    expect_bodies(&take(&mut c, 10).await, 0, "s");
    // Deleted over the stream protocol: gone for AMQP too.
    env.delete_stream("fromstream").await.expect("delete");
    let probe = bounded(conn.create_channel()).await.unwrap();
    let err = bounded(probe.queue_declare("fromstream".into(), passive, FieldTable::default()))
        .await
        .expect_err("gone");
    assert_eq!(reply(&err).0, 404);
    // Deleted over AMQP: gone for the stream protocol too.
    bounded(ch.queue_delete("both".into(), QueueDeleteOptions::default()))
        .await
        .expect("delete over AMQP");
    assert!(
        env.consumer().build("both").await.is_err(),
        "no stream 'both' left to subscribe to"
    );
    drop(b);
}

/// The median of `rounds` one-message trips, each from `send` until `received` has it.
async fn median_trip<S, R>(rounds: usize, mut send: S, mut received: R) -> Duration
where
    S: AsyncFnMut(usize),
    R: AsyncFnMut(usize),
{
    let mut trips = Vec::with_capacity(rounds);
    for i in 0..rounds {
        let at = std::time::Instant::now();
        send(i).await;
        received(i).await;
        trips.push(at.elapsed());
    }
    trips.sort();
    trips[rounds / 2]
}

/// A message published on the stream port reaches an AMQP consumer waiting at the end of
/// the stream in about the time the broker takes, and the other way round: the stream
/// protocol's appends are pushed to the core, not found by a timer (a 20 ms poll gave a
/// median of ~10 ms). With and without a data directory (fsync off: the disk is not what
/// this measures).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_port_publishes_reach_amqp_consumers_at_once_and_back() {
    for in_memory in [false, true] {
        let dir = data_dir(if in_memory { "push-mem" } else { "push" });
        let mut args = vec!["--stream", "127.0.0.1:0", "--fsync", "off"];
        if in_memory {
            args.push("--in-memory");
        }
        let b = Broker(common::serve(&dir, false, &args));
        let conn = connect(b.0.amqp).await;
        let ch = bounded(conn.create_channel()).await.unwrap();
        declare_stream(&ch, "push").await;
        let mut amqp = consume_from(&conn, "push", Some(text("next"))).await;
        let env = stream_env(b.0.stream.expect("stream port")).await;
        let producer = env.producer().build("push").await.unwrap();
        let to_amqp = median_trip(
            50,
            async |i| {
                producer
                    .send_with_confirm(Message::builder().body(format!("p{i}")).build())
                    .await
                    .expect("confirmed");
            },
            async |i| {
                let got = take(&mut amqp, 1).await;
                assert_eq!(got[0].1, format!("p{i}"));
            },
        )
        .await;
        let mut reader = env
            .consumer()
            .offset(OffsetSpecification::Next)
            .build("push")
            .await
            .unwrap();
        let to_stream = median_trip(
            50,
            async |i| {
                bounded(ch.basic_publish(
                    "".into(),
                    "push".into(),
                    BasicPublishOptions::default(),
                    format!("q{i}").as_bytes(),
                    BasicProperties::default(),
                ))
                .await
                .expect("publish");
            },
            async |i| {
                let d = bounded(reader.next())
                    .await
                    .expect("open")
                    .expect("delivery");
                assert_eq!(d.message().data(), Some(format!("q{i}").as_bytes()));
            },
        )
        .await;
        eprintln!(
            "in_memory={in_memory}: stream port -> AMQP {to_amqp:?}, AMQP -> stream port {to_stream:?}"
        );
        for (what, median) in [
            ("stream port -> AMQP", to_amqp),
            ("AMQP -> stream port", to_stream),
        ] {
            assert!(
                median < Duration::from_millis(5),
                "{what}: median {median:?} over 50 one-message trips (in_memory={in_memory})"
            );
        }
        common::bounded_as("stream producer close answer", producer.close())
            .await
            .unwrap();
        drop(b);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_truncates_whole_segments() {
    let dir = data_dir("retention");
    let b = serve(&dir);
    let conn = connect(b.0.amqp).await;
    let ch = bounded(conn.create_channel()).await.unwrap();
    bounded(ch.queue_declare(
        "r".into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        table(&[
            ("x-queue-type", text("stream")),
            ("x-max-length-bytes", AMQPValue::LongLongInt(20_000)),
            (
                "x-stream-max-segment-size-bytes",
                AMQPValue::LongLongInt(4_000),
            ),
            ("x-max-age", text("7D")),
        ]),
    ))
    .await
    .expect("declare");
    bounded(ch.confirm_select(ConfirmSelectOptions::default()))
        .await
        .unwrap();
    // 1000 messages of ~100 bytes in batches of 10: ~100 KB, five times the limit.
    for batch in 0..100 {
        let pad = "x".repeat(90);
        publish(
            &ch,
            "r",
            (batch * 10..batch * 10 + 10).map(|i| format!("{i:04}{pad}")),
        )
        .await;
    }
    let stream_dir = dir.join("streams").join("%2F").join("r");
    let mut firsts: Vec<u64> = std::fs::read_dir(&stream_dir)
        .expect("the stream's directory")
        .filter_map(|e| {
            let name = e.ok()?.file_name().into_string().ok()?;
            u64::from_str_radix(name.strip_suffix(".sd")?, 16).ok()
        })
        .collect();
    firsts.sort_unstable();
    let oldest = *firsts.first().expect("segments");
    assert!(oldest > 0, "the oldest segments were deleted: {firsts:?}");
    let mut c = consume_from(&conn, "r", Some(text("first"))).await;
    let got = take(&mut c, 1000 - oldest as usize).await;
    assert_eq!(
        got.first().map(|g| g.0),
        Some(oldest as i64),
        "reads start at the first retained segment, a whole one"
    );
    assert_eq!(got.last().map(|g| g.0), Some(999));
    drop(b);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mqtt_publishers_reach_a_stream_through_a_binding() {
    let dir = data_dir("mqtt");
    let b = Broker(common::serve(&dir, true, &[]));
    let conn = connect(b.0.amqp).await;
    let ch = bounded(conn.create_channel()).await.unwrap();
    declare_stream(&ch, "readings").await;
    bounded(ch.queue_bind(
        "readings".into(),
        "amq.topic".into(),
        "sensors.#".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    ))
    .await
    .unwrap();
    let port = b.0.mqtt.expect("MQTT port");
    let mut o = rumqttc::MqttOptions::new("sensor-1", "127.0.0.1", port);
    o.set_keep_alive(Duration::from_secs(30));
    let (client, mut events) = rumqttc::AsyncClient::new(o, 16);
    for i in 0..3 {
        common::bounded_as(
            "room in the client queue for PUBLISH",
            client.publish(
                format!("sensors/t{i}"),
                rumqttc::QoS::AtLeastOnce,
                false,
                format!("r{i}"),
            ),
        )
        .await
        .unwrap();
    }
    // Drive the client until the three PUBACKs (sent once the stream holds them durably).
    bounded(async {
        let mut acked = 0;
        while acked < 3 {
            if let rumqttc::Event::Incoming(rumqttc::Packet::PubAck(_)) =
                events.poll().await.expect("MQTT client")
            {
                acked += 1;
            }
        }
    })
    .await;
    let mut c = consume_from(&conn, "readings", Some(text("first"))).await;
    expect_bodies(&take(&mut c, 3).await, 0, "r");
    drop(b);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_after_confirms_keeps_every_message_at_its_offset() {
    let dir = data_dir("kill9");
    const N: usize = 3000;
    {
        let b = serve(&dir);
        let conn = connect(b.0.amqp).await;
        let ch = bounded(conn.create_channel()).await.unwrap();
        declare_stream(&ch, "k").await;
        bounded(ch.confirm_select(ConfirmSelectOptions::default()))
            .await
            .unwrap();
        publish(&ch, "k", (0..N).map(|i| format!("k{i}"))).await;
        // Every message is confirmed: kill -9 (the Broker's drop) loses none of them.
    }
    let b = serve(&dir);
    let conn = connect(b.0.amqp).await;
    let ch = bounded(conn.create_channel()).await.unwrap();
    // Restored with the definitions: declaring again is equivalent.
    declare_stream(&ch, "k").await;
    let mut c = consume_from(&conn, "k", Some(text("first"))).await;
    expect_bodies(&take(&mut c, N).await, 0, "k");
    // New messages go on at the next offset.
    bounded(ch.confirm_select(ConfirmSelectOptions::default()))
        .await
        .unwrap();
    publish(&ch, "k", std::iter::once(format!("k{N}"))).await;
    assert_eq!(take(&mut c, 1).await, vec![(N as i64, format!("k{N}"))]);
    drop(b);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The partition a message of the super stream test goes to: the key is `i % 3`.
fn partition_key(m: &Message) -> String {
    let body = m.data().unwrap_or_default();
    let n: u64 = std::str::from_utf8(body)
        .ok()
        .and_then(|s| s.trim_start_matches('k').parse().ok())
        .unwrap_or(0);
    (n % 3).to_string()
}

/// A super stream made over the stream protocol is RabbitMQ's: a direct exchange bound to
/// its partition streams (queues for AMQP too), kept across a restart; the Rust client's
/// producer routes by key (Route) and by hash (Partitions); AMQP publishes to the exchange
/// reach the partition of their key; deleting it deletes exchange and partitions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn super_streams_are_an_exchange_over_partition_streams() {
    use rabbitmq_stream_client::types::{
        HashRoutingMurmurStrategy, RoutingKeyRoutingStrategy, RoutingStrategy,
    };
    for in_memory in [false, true] {
        let dir = data_dir(if in_memory { "super-mem" } else { "super" });
        let mut args = vec!["--stream", "127.0.0.1:0"];
        if in_memory {
            args.push("--in-memory");
        }
        let mut b = Broker(common::serve(&dir, false, &args));
        let env = stream_env(b.0.stream.expect("stream port")).await;
        env.stream_creator()
            .create_super_stream("orders", 3, None)
            .await
            .expect("create the super stream");
        if !in_memory {
            // Definitions are durable: the super stream routes after a restart.
            drop(env);
            drop(b);
            b = Broker(common::serve(&dir, false, &args));
        }
        let env = stream_env(b.0.stream.expect("stream port")).await;
        let mut producer = env
            .super_stream_producer(RoutingStrategy::RoutingKeyStrategy(
                RoutingKeyRoutingStrategy {
                    routing_extractor: &partition_key,
                },
            ))
            .build("orders")
            .await
            .expect("a producer routing by key");
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        for i in 0..30u64 {
            let tx = tx.clone();
            common::bounded_as(
                "room in the producer window",
                producer.send(Message::builder().body(format!("k{i}")).build(), move |r| {
                    let tx = tx.clone();
                    async move {
                        let _ = tx.send(r.map(|s| s.confirmed()).unwrap_or(false));
                    }
                }),
            )
            .await
            .unwrap();
        }
        for _ in 0..30 {
            assert!(bounded(rx.recv()).await.unwrap(), "confirmed");
        }
        common::bounded_as("stream producer close answer", producer.close())
            .await
            .unwrap();
        let mut hashed = env
            .super_stream_producer(RoutingStrategy::HashRoutingStrategy(
                HashRoutingMurmurStrategy {
                    routing_extractor: &partition_key,
                },
            ))
            .build("orders")
            .await
            .expect("Partitions lists the three");
        common::bounded_as(
            "room in the producer window",
            hashed.send(Message::builder().body("k99").build(), |_| async {}),
        )
        .await
        .unwrap();
        common::bounded_as("close-ok", hashed.close())
            .await
            .unwrap();
        // AMQP: the exchange routes by key to the partition queue.
        let conn = connect(b.0.amqp).await;
        let ch = bounded(conn.create_channel()).await.unwrap();
        bounded(ch.basic_publish(
            "orders".into(),
            "2".into(),
            BasicPublishOptions {
                mandatory: true,
                ..Default::default()
            },
            b"k32",
            BasicProperties::default(),
        ))
        .await
        .expect("publish to the super stream's exchange");
        for p in 0..3u64 {
            let mut c = consume_from(&conn, &format!("orders-{p}"), Some(text("first"))).await;
            let want: Vec<String> = (0..30)
                .filter(|i| i % 3 == p)
                .map(|i| format!("k{i}"))
                .collect();
            let got: Vec<String> = take(&mut c, 10).await.into_iter().map(|(_, b)| b).collect();
            assert_eq!(got, want, "partition orders-{p} (in_memory={in_memory})");
            if p == 2 {
                // After the hashed k99 if it hashed here.
                let mut rest = take(&mut c, 1).await;
                if rest[0].1 == "k99" {
                    rest = take(&mut c, 1).await;
                }
                assert_eq!(rest[0].1, "k32", "the AMQP publish by key 2");
            }
        }
        env.delete_super_stream("orders").await.expect("delete");
        let probe = bounded(conn.create_channel()).await.unwrap();
        let passive = ExchangeDeclareOptions {
            passive: true,
            ..Default::default()
        };
        let err = bounded(probe.exchange_declare(
            "orders".into(),
            lapin::ExchangeKind::Direct,
            passive,
            FieldTable::default(),
        ))
        .await
        .expect_err("the exchange went with it");
        assert_eq!(reply(&err).0, 404);
        assert!(
            env.consumer().build("orders-0").await.is_err(),
            "partitions deleted with the super stream"
        );
        drop(b);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// User and tracking chunks a stream's segments hold, from their index files (a 24-byte
/// header, then 32 bytes per chunk: docs/storage.md).
fn chunks_on_disk(dir: &std::path::Path, stream: &str) -> u64 {
    let sdir = dir.join("streams").join("%2F").join(stream);
    std::fs::read_dir(&sdir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "si"))
        .map(|p| (std::fs::metadata(p).unwrap().len() - 24) / 32)
        .sum()
}

/// Many AMQP publishers, each waiting for every confirm, so the broker task's batches are a
/// message or a few: the batches that reach the stream between two writes of its log are
/// merged into one chunk (as the stream protocol's frames are), so the stream holds far
/// fewer chunks than publishes; after kill -9 every confirmed message is there, each
/// publisher's in its order, offsets dense. (The broker's own batching keeps the count low
/// here even without merging, 281-284 chunks for 2,400 publishes against 198-266 merged on
/// a loaded machine: `streams::tests::stream_queue_batches_between_two_writes_become_one_chunk`
/// is the exact check of the merge.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_publishes_merge_into_chunks_and_survive_kill_9() {
    let dir = data_dir("merge");
    const PUBLISHERS: usize = 16;
    const EACH: usize = 150;
    {
        let b = serve(&dir);
        let conn = connect(b.0.amqp).await;
        let ch = bounded(conn.create_channel()).await.unwrap();
        declare_stream(&ch, "m").await;
        let mut tasks = Vec::new();
        for p in 0..PUBLISHERS {
            let ch = bounded(conn.create_channel()).await.unwrap();
            bounded(ch.confirm_select(ConfirmSelectOptions::default()))
                .await
                .unwrap();
            tasks.push(tokio::spawn(async move {
                for i in 0..EACH {
                    let confirm = bounded(ch.basic_publish(
                        "".into(),
                        "m".into(),
                        BasicPublishOptions::default(),
                        format!("p{p}-{i}").as_bytes(),
                        BasicProperties::default().with_delivery_mode(2),
                    ))
                    .await
                    .expect("publish");
                    let c = bounded(confirm).await.expect("confirm");
                    assert!(c.is_ack(), "publish {p}/{i} acked");
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        let chunks = chunks_on_disk(&dir, "m");
        let n = (PUBLISHERS * EACH) as u64;
        assert!(
            chunks < n / 4,
            "{chunks} chunks for {n} publishes from {PUBLISHERS} publishers: merged"
        );
        // Every message is confirmed: kill -9 (the Broker's drop) loses none of them.
    }
    let b = serve(&dir);
    let conn = connect(b.0.amqp).await;
    let ch = bounded(conn.create_channel()).await.unwrap();
    declare_stream(&ch, "m").await;
    let mut c = consume_from(&conn, "m", Some(text("first"))).await;
    let got = take(&mut c, PUBLISHERS * EACH).await;
    let mut next = [0usize; PUBLISHERS];
    for (i, (offset, body)) in got.iter().enumerate() {
        assert_eq!(*offset, i as i64, "offsets dense");
        let (p, n) = body
            .strip_prefix('p')
            .and_then(|b| b.split_once('-'))
            .map(|(p, n)| (p.parse::<usize>().unwrap(), n.parse::<usize>().unwrap()))
            .expect("a published body");
        assert_eq!(n, next[p], "publisher {p}'s messages in order, none lost");
        next[p] += 1;
    }
    assert!(next.iter().all(|&n| n == EACH));
    drop(b);
    let _ = std::fs::remove_dir_all(&dir);
}
