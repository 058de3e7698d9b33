//! The Rust `rabbitmq-stream-client` 0.11 against `warren_stream::serve` with the in-memory
//! backend, over real sockets on 127.0.0.1.

use futures::StreamExt;
use rabbitmq_stream_client::Environment;
use rabbitmq_stream_client::types::{ByteCapacity, Message, OffsetSpecification};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::watch;
use warren_stream::MemoryBackend;

struct Broker {
    port: u16,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl Broker {
    async fn start(backend: MemoryBackend) -> Broker {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (stop, rx) = watch::channel(false);
        let task = tokio::spawn(warren_stream::serve(listener, Arc::new(backend), rx));
        Broker { port, stop, task }
    }

    async fn env(&self) -> Environment {
        bounded_as(
            "stream connection (peer properties, SASL, tune, open)",
            Environment::builder()
                .host("127.0.0.1")
                .port(self.port)
                .build(),
        )
        .await
        .unwrap()
    }

    async fn stop(self) {
        let _ = self.stop.send(true);
        let _ = tokio::time::timeout(Duration::from_secs(10), self.task).await;
    }
}

/// `f` within 10 s; the panic names `what` and the caller's line (a plain fn, not `async`, so
/// that `#[track_caller]` holds).
#[track_caller]
fn bounded_as<F: std::future::Future>(
    what: &'static str,
    f: F,
) -> impl std::future::Future<Output = F::Output> {
    let at = std::panic::Location::caller();
    async move {
        tokio::time::timeout(Duration::from_secs(10), f)
            .await
            .unwrap_or_else(|_| panic!("no {what} within 10 s (awaited at {at})"))
    }
}

fn body(i: u64) -> Vec<u8> {
    format!("message-{i}").into_bytes()
}

/// Reads `n` deliveries (offset, body) from a consumer, bounded in time.
async fn take(consumer: &mut rabbitmq_stream_client::Consumer, n: usize) -> Vec<(u64, Vec<u8>)> {
    let mut got = Vec::with_capacity(n);
    while got.len() < n {
        let d = tokio::time::timeout(Duration::from_secs(20), consumer.next())
            .await
            .unwrap_or_else(|_| panic!("delivery {} of {n} within 20 s", got.len()))
            .expect("consumer open")
            .expect("delivery ok");
        got.push((d.offset(), d.message().data().unwrap_or_default().to_vec()));
    }
    got
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_100k_with_confirms_and_consume_from_first_in_order() {
    let broker = Broker::start(MemoryBackend::new()).await;
    let env = broker.env().await;
    env.stream_creator()
        .max_length(ByteCapacity::GB(1))
        .create("s1")
        .await
        .unwrap();
    let producer = env.producer().batch_size(1000).build("s1").await.unwrap();
    const N: u64 = 100_000;
    let mut confirmed = 0;
    for start in (0..N).step_by(1000) {
        let batch: Vec<Message> = (start..start + 1000)
            .map(|i| Message::builder().body(body(i)).build())
            .collect();
        let statuses = producer.batch_send_with_confirm(batch).await.unwrap();
        confirmed += statuses.iter().filter(|s| s.confirmed()).count();
    }
    assert_eq!(confirmed as u64, N);
    bounded_as("stream producer close answer", producer.close())
        .await
        .unwrap();

    let mut consumer = env
        .consumer()
        .offset(OffsetSpecification::First)
        .build("s1")
        .await
        .unwrap();
    let got = take(&mut consumer, N as usize).await;
    for (i, (offset, data)) in got.iter().enumerate() {
        assert_eq!(*offset, i as u64);
        assert_eq!(data, &body(i as u64));
    }
    bounded_as("stream consumer close answer", consumer.handle().close())
        .await
        .unwrap();
    broker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn offset_specifications_next_last_offset_timestamp() {
    let broker = Broker::start(MemoryBackend::new()).await;
    let env = broker.env().await;
    env.stream_creator().create("s2").await.unwrap();
    let producer = env.producer().build("s2").await.unwrap();
    // Two batches, far apart in time: a timestamp between them selects the second.
    let first: Vec<Message> = (0..10)
        .map(|i| Message::builder().body(body(i)).build())
        .collect();
    producer.batch_send_with_confirm(first).await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let between = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    tokio::time::sleep(Duration::from_millis(50)).await;
    let second: Vec<Message> = (10..20)
        .map(|i| Message::builder().body(body(i)).build())
        .collect();
    producer.batch_send_with_confirm(second).await.unwrap();
    // A message on its own: one frame, so the last chunk is exactly it (a batch may be
    // split over several frames by the client).
    producer
        .send_with_confirm(Message::builder().body(body(20)).build())
        .await
        .unwrap();
    let range = |r: std::ops::RangeInclusive<u64>| r.map(|i| (i, body(i))).collect::<Vec<_>>();

    // timestamp: the chunks stamped after `between`, i.e. offsets 10..
    let mut c = env
        .consumer()
        .offset(OffsetSpecification::Timestamp(between))
        .build("s2")
        .await
        .unwrap();
    assert_eq!(take(&mut c, 11).await, range(10..=20));
    bounded_as("stream consumer close answer", c.handle().close())
        .await
        .unwrap();

    // offset 15: the chunk holding it is delivered; the client skips the records before 15.
    let mut c = env
        .consumer()
        .offset(OffsetSpecification::Offset(15))
        .build("s2")
        .await
        .unwrap();
    assert_eq!(take(&mut c, 6).await, range(15..=20));
    bounded_as("stream consumer close answer", c.handle().close())
        .await
        .unwrap();

    // last: the last chunk.
    let mut c = env
        .consumer()
        .offset(OffsetSpecification::Last)
        .build("s2")
        .await
        .unwrap();
    assert_eq!(take(&mut c, 1).await, range(20..=20));
    bounded_as("stream consumer close answer", c.handle().close())
        .await
        .unwrap();

    // next: nothing until new data, then exactly it. (An offset past the end is checked
    // at the protocol level in raw_socket.rs: this client drops offsets below the one it
    // asked for.)
    let mut next = env
        .consumer()
        .offset(OffsetSpecification::Next)
        .build("s2")
        .await
        .unwrap();
    assert!(
        tokio::time::timeout(Duration::from_millis(300), next.next())
            .await
            .is_err(),
        "next delivers only new data"
    );
    producer
        .send_with_confirm(Message::builder().body(body(21)).build())
        .await
        .unwrap();
    assert_eq!(take(&mut next, 1).await, range(21..=21));
    bounded_as("stream consumer close answer", next.handle().close())
        .await
        .unwrap();
    bounded_as("stream producer close answer", producer.close())
        .await
        .unwrap();
    broker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_offset_is_queried_back() {
    let broker = Broker::start(MemoryBackend::new()).await;
    let env = broker.env().await;
    env.stream_creator().create("s3").await.unwrap();
    let producer = env.producer().build("s3").await.unwrap();
    let batch: Vec<Message> = (0..5)
        .map(|i| Message::builder().body(body(i)).build())
        .collect();
    producer.batch_send_with_confirm(batch).await.unwrap();
    let mut c = env
        .consumer()
        .name("reader-1")
        .offset(OffsetSpecification::First)
        .build("s3")
        .await
        .unwrap();
    assert!(c.query_offset().await.is_err(), "no offset stored yet");
    let got = take(&mut c, 5).await;
    c.store_offset(got[3].0).await.unwrap();
    // StoreOffset has no response: QueryOffset on the same connection comes after it.
    assert_eq!(c.query_offset().await.unwrap(), 3);
    bounded_as("stream consumer close answer", c.handle().close())
        .await
        .unwrap();
    // Another connection sees it too (server-side tracking).
    let env2 = broker.env().await;
    let c2 = env2
        .consumer()
        .name("reader-1")
        .offset(OffsetSpecification::Next)
        .build("s3")
        .await
        .unwrap();
    assert_eq!(c2.query_offset().await.unwrap(), 3);
    bounded_as("stream consumer close answer", c2.handle().close())
        .await
        .unwrap();
    bounded_as("stream producer close answer", producer.close())
        .await
        .unwrap();
    broker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resent_publishing_ids_are_confirmed_and_not_stored_again() {
    let broker = Broker::start(MemoryBackend::new()).await;
    let env = broker.env().await;
    env.stream_creator().create("s4").await.unwrap();
    let mut producer = env.producer().name("writer-1").build("s4").await.unwrap();
    let msgs = |r: std::ops::Range<u64>| -> Vec<Message> {
        r.map(|i| Message::builder().body(body(i)).publishing_id(i).build())
            .collect()
    };
    let s = producer.batch_send_with_confirm(msgs(1..11)).await.unwrap();
    assert!(s.iter().all(|s| s.confirmed()));
    // 5..10 again, with 11..15 new: all confirmed, only 11..15 stored.
    let s = producer.batch_send_with_confirm(msgs(5..16)).await.unwrap();
    assert_eq!(s.len(), 11);
    assert!(s.iter().all(|s| s.confirmed()));
    bounded_as("stream producer close answer", producer.close())
        .await
        .unwrap();

    // A new producer with the same reference learns where the writer is.
    let p2 = env.producer().name("writer-1").build("s4").await.unwrap();
    bounded_as("stream producer close answer", p2.close())
        .await
        .unwrap();

    let mut c = env
        .consumer()
        .offset(OffsetSpecification::First)
        .build("s4")
        .await
        .unwrap();
    let got = take(&mut c, 15).await;
    let bodies: Vec<Vec<u8>> = got.iter().map(|(_, b)| b.clone()).collect();
    assert_eq!(bodies, (1..16).map(body).collect::<Vec<_>>());
    assert!(
        tokio::time::timeout(Duration::from_millis(300), c.next())
            .await
            .is_err(),
        "nothing stored twice"
    );
    bounded_as("stream consumer close answer", c.handle().close())
        .await
        .unwrap();
    broker.stop().await;
}

fn routing_key(m: &Message) -> String {
    // Bodies are "message-N": key N % 3, the binding keys the client gives partitions 0..3.
    let body = std::str::from_utf8(m.data().unwrap_or_default()).unwrap_or_default();
    let n: u64 = body
        .rsplit('-')
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    (n % 3).to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn super_stream_routes_by_key_and_is_consumed_whole() {
    use rabbitmq_stream_client::types::{
        HashRoutingMurmurStrategy, RoutingKeyRoutingStrategy, RoutingStrategy,
    };
    let broker = Broker::start(MemoryBackend::new()).await;
    let env = broker.env().await;
    env.stream_creator()
        .create_super_stream("orders", 3, None)
        .await
        .unwrap();
    // Route: each message to the partition bound with its key.
    let mut producer = env
        .super_stream_producer(RoutingStrategy::RoutingKeyStrategy(
            RoutingKeyRoutingStrategy {
                routing_extractor: &routing_key,
            },
        ))
        .build("orders")
        .await
        .unwrap();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    for i in 0..30u64 {
        let tx = tx.clone();
        producer
            .send(Message::builder().body(body(i)).build(), move |r| {
                let tx = tx.clone();
                async move {
                    let _ = tx.send(r.map(|s| s.confirmed()).unwrap_or(false));
                }
            })
            .await
            .unwrap();
    }
    for _ in 0..30 {
        let ok = tokio::time::timeout(Duration::from_secs(10), rx.recv())
            .await
            .unwrap()
            .unwrap();
        assert!(ok, "confirmed");
    }
    bounded_as("stream producer close answer", producer.close())
        .await
        .unwrap();
    // Partitions (used by hash routing) lists orders-0..2 in binding order.
    let mut hashed = env
        .super_stream_producer(RoutingStrategy::HashRoutingStrategy(
            HashRoutingMurmurStrategy {
                routing_extractor: &routing_key,
            },
        ))
        .build("orders")
        .await
        .unwrap();
    bounded_as(
        "room in the producer window",
        hashed.send(Message::builder().body(body(99)).build(), |_| async {}),
    )
    .await
    .unwrap();
    bounded_as("stream producer close answer", hashed.close())
        .await
        .unwrap();

    for p in 0..3u64 {
        let mut c = env
            .consumer()
            .offset(OffsetSpecification::First)
            .build(&format!("orders-{p}"))
            .await
            .unwrap();
        let got = take(&mut c, 10).await;
        let want: Vec<Vec<u8>> = (0..30).filter(|i| i % 3 == p).map(body).collect();
        let bodies: Vec<Vec<u8>> = got.into_iter().map(|(_, b)| b).collect();
        assert_eq!(bodies, want, "partition orders-{p}");
        bounded_as("stream consumer close answer", c.handle().close())
            .await
            .unwrap();
    }
    env.delete_super_stream("orders").await.unwrap();
    assert!(
        env.consumer().build("orders-0").await.is_err(),
        "partitions deleted with the super stream"
    );
    broker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn filtered_subscription_gets_only_chunks_with_its_values() {
    use rabbitmq_stream_client::FilterConfiguration;
    let broker = Broker::start(MemoryBackend::new()).await;
    let env = broker.env().await;
    env.stream_creator().create("colours").await.unwrap();
    // Filter values from the body: "red-N", "blue-N"; "plain-N" has none.
    let producer = bounded_as(
        "stream client declare answer",
        env.producer()
            .filter_value_extractor(|m: &Message| {
                let b = std::str::from_utf8(m.data().unwrap_or_default()).unwrap_or_default();
                let colour = b.split('-').next().unwrap_or_default();
                if colour == "plain" {
                    String::new()
                } else {
                    colour.to_string()
                }
            })
            .build("colours"),
    )
    .await
    .unwrap();
    // One batch (one chunk) per colour, unfiltered last.
    for colour in ["red", "blue", "red", "plain"] {
        let batch: Vec<Message> = (0..5)
            .map(|i| Message::builder().body(format!("{colour}-{i}")).build())
            .collect();
        producer.batch_send_with_confirm(batch).await.unwrap();
    }
    bounded_as("stream producer close answer", producer.close())
        .await
        .unwrap();

    let read = |values: Vec<String>, unfiltered: bool| {
        let env = env.clone();
        async move {
            let mut c = env
                .consumer()
                .offset(OffsetSpecification::First)
                .filter_input(Some(FilterConfiguration::new(values, unfiltered)))
                .build("colours")
                .await
                .unwrap();
            let mut got = Vec::new();
            while let Ok(Some(Ok(d))) =
                tokio::time::timeout(Duration::from_millis(500), c.next()).await
            {
                got.push(
                    String::from_utf8_lossy(d.message().data().unwrap_or_default()).into_owned(),
                );
            }
            bounded_as("stream consumer close answer", c.handle().close())
                .await
                .unwrap();
            got
        }
    };
    // No client-side predicate: whatever arrives is what the server chose to send.
    let blue = read(vec!["blue".into()], false).await;
    assert_eq!(
        blue,
        (0..5).map(|i| format!("blue-{i}")).collect::<Vec<_>>()
    );
    let blue_and_plain = read(vec!["blue".into()], true).await;
    assert_eq!(blue_and_plain.len(), 10, "{blue_and_plain:?}");
    assert!(blue_and_plain[5..].iter().all(|b| b.starts_with("plain-")));
    let red = read(vec!["red".into()], false).await;
    assert_eq!(red.len(), 10);
    broker.stop().await;
}
