//! The memory alarm under a draining consumer, as clients see it: connection.blocked /
//! unblocked notifications counted with lapin.

use futures_lite::StreamExt;
use lapin::options::{BasicConsumeOptions, BasicPublishOptions, BasicQosOptions};
use lapin::{BasicProperties, Connection, ConnectionProperties, Event};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use warren_tests::bounded;

async fn start(config: warren_core::BrokerConfig) -> (String, tokio::sync::watch::Sender<bool>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind a loopback port");
    let addr = listener.local_addr().expect("local address");
    let (stop, stopped) = tokio::sync::watch::channel(false);
    tokio::spawn(warren_amqp::serve(
        listener,
        warren_runtime::BrokerHandle::start(config),
        Arc::new(warren_amqp::AmqpConfig::default()),
        stopped,
    ));
    (format!("amqp://guest:guest@{addr}/%2f"), stop)
}

/// A publisher pushing 1 KB messages as fast as it can into a queue that a consumer drains
/// sits at the watermark: every message the consumer took flipped the alarm (10,051
/// blocked/unblocked pairs in 10 s). With hysteresis and the hold, the publisher hears
/// about one change a second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_consumer_at_the_watermark_does_not_make_the_alarm_flap() {
    let (uri, _stop) = start(warren_core::BrokerConfig {
        memory_high_watermark: 64 * 1024,
        ..Default::default()
    })
    .await;
    let publisher = bounded(Connection::connect(&uri, ConnectionProperties::default()))
        .await
        .expect("connect");
    let changes = Arc::new(AtomicU64::new(0));
    let blocks = Arc::new(AtomicU64::new(0));
    let mut events = publisher.events_listener();
    let (c, b) = (changes.clone(), blocks.clone());
    tokio::spawn(async move {
        while let Some(event) = events.next().await {
            match event {
                Event::ConnectionBlocked(_) => {
                    b.fetch_add(1, Ordering::Relaxed);
                    c.fetch_add(1, Ordering::Relaxed);
                }
                Event::ConnectionUnblocked => {
                    c.fetch_add(1, Ordering::Relaxed);
                }
                _ => {}
            }
        }
    });
    let pch = bounded(publisher.create_channel()).await.expect("channel");
    bounded(pch.queue_declare("q".into(), Default::default(), Default::default()))
        .await
        .expect("declare");
    tokio::spawn(async move {
        let body = vec![7u8; 1000];
        loop {
            let sent = pch
                .basic_publish(
                    "".into(),
                    "q".into(),
                    BasicPublishOptions::default(),
                    &body,
                    BasicProperties::default(),
                )
                .await;
            if sent.is_err() {
                return;
            }
        }
    });
    // The queue fills past the watermark with nobody consuming.
    for _ in 0..50 {
        if blocks.load(Ordering::Relaxed) > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        blocks.load(Ordering::Relaxed) > 0,
        "the publisher was blocked"
    );
    // A consumer drains (manual acks, a small prefetch: it frees memory a message at a time).
    let consumer = bounded(Connection::connect(&uri, ConnectionProperties::default()))
        .await
        .expect("connect");
    let cch = bounded(consumer.create_channel()).await.expect("channel");
    bounded(cch.basic_qos(10, BasicQosOptions::default()))
        .await
        .expect("qos");
    let mut deliveries = bounded(cch.basic_consume(
        "q".into(),
        "drain".into(),
        BasicConsumeOptions::default(),
        Default::default(),
    ))
    .await
    .expect("consume");
    let before = changes.load(Ordering::Relaxed);
    let consumed = Arc::new(AtomicU64::new(0));
    let counted = consumed.clone();
    tokio::spawn(async move {
        while let Some(Ok(d)) = deliveries.next().await {
            if d.acker.ack(Default::default()).await.is_err() {
                return;
            }
            counted.fetch_add(1, Ordering::Relaxed);
        }
    });
    tokio::time::sleep(Duration::from_secs(3)).await;
    let changed = changes.load(Ordering::Relaxed) - before;
    let consumed = consumed.load(Ordering::Relaxed);
    eprintln!("{changed} blocked/unblocked notifications in 3 s, {consumed} messages drained");
    assert!(
        consumed > 200,
        "the consumer drained the queue past the watermark several times ({consumed})"
    );
    assert!(
        (1..=8).contains(&changed),
        "{changed} blocked/unblocked notifications in 3 s while {consumed} messages drained"
    );
}
