//! `warren serve --stream`: RabbitMQ's stream protocol over the native stream log, with the
//! Rust `rabbitmq-stream-client` over real sockets against the `warren` binary: a million
//! messages with confirms read back in order, kill -9 with confirmed messages, stored
//! offsets and deduplication surviving, delete then recreate, bad input answered with the
//! protocol's codes.

use futures::StreamExt;
use rabbitmq_stream_client::Environment;
use rabbitmq_stream_client::error::{ConsumerCreateError, StreamCreateError};
use rabbitmq_stream_client::types::{Message, OffsetSpecification, ResponseCode};
use std::path::PathBuf;
use std::time::Duration;

mod common;
use common::Killed as Broker;
#[path = "common/stream_raw.rs"]
mod stream_raw;
use stream_raw::Raw;

fn data_dir(tag: &str) -> PathBuf {
    common::scratch_dir("streams", tag)
}

/// `warren serve` with the stream listener on a free port; returns it and that port.
fn serve(dir: &std::path::Path) -> (Broker, u16) {
    let served = common::serve(dir, false, &["--stream", "127.0.0.1:0"]);
    let port = served.stream.expect("stream port logged");
    (Broker(served), port)
}

async fn env(port: u16) -> Environment {
    tokio::time::timeout(
        Duration::from_secs(10),
        Environment::builder().host("127.0.0.1").port(port).build(),
    )
    .await
    .expect("connect in time")
    .expect("connect")
}

fn body(i: u64) -> Vec<u8> {
    format!("m{i}").into_bytes()
}

/// Reads `n` deliveries (offset, body), bounded in time.
async fn take(consumer: &mut rabbitmq_stream_client::Consumer, n: usize) -> Vec<(u64, Vec<u8>)> {
    let mut got = Vec::with_capacity(n);
    while got.len() < n {
        let d = tokio::time::timeout(Duration::from_secs(30), consumer.next())
            .await
            .unwrap_or_else(|_| panic!("delivery {} of {n} within 30 s", got.len()))
            .expect("consumer open")
            .expect("delivery ok");
        got.push((d.offset(), d.message().data().unwrap_or_default().to_vec()));
    }
    got
}

/// Publishes `range` in batches of `batch` with confirms; the count confirmed.
async fn publish(
    producer: &rabbitmq_stream_client::Producer<rabbitmq_stream_client::NoDedup>,
    range: std::ops::Range<u64>,
    batch: u64,
) -> usize {
    let mut confirmed = 0;
    let mut start = range.start;
    while start < range.end {
        let end = (start + batch).min(range.end);
        let msgs: Vec<Message> = (start..end)
            .map(|i| Message::builder().body(body(i)).build())
            .collect();
        let statuses = producer.batch_send_with_confirm(msgs).await.expect("send");
        confirmed += statuses.iter().filter(|s| s.confirmed()).count();
        start = end;
    }
    confirmed
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_million_messages_with_confirms_come_back_from_first_in_order() {
    let dir = data_dir("million");
    let (served, port) = serve(&dir);
    assert!(served.0.logged(&["listening on", "(stream)"]));
    let env = env(port).await;
    env.stream_creator().create("big").await.expect("create");
    let producer = env.producer().batch_size(1000).build("big").await.unwrap();
    const N: u64 = 1_000_000;
    assert_eq!(publish(&producer, 0..N, 5000).await as u64, N);
    common::bounded_as("stream producer close answer", producer.close())
        .await
        .unwrap();
    let mut consumer = env
        .consumer()
        .offset(OffsetSpecification::First)
        .build("big")
        .await
        .unwrap();
    let mut want = 0u64;
    while want < N {
        for (offset, data) in take(&mut consumer, 10_000.min((N - want) as usize)).await {
            assert_eq!(offset, want, "offsets dense and in order");
            assert_eq!(data, body(want));
            want += 1;
        }
    }
    common::bounded_as("stream consumer close answer", consumer.handle().close())
        .await
        .unwrap();
    // On disk under the escaped names (vhost `/` is `%2F`).
    assert!(dir.join("streams").join("%2F").join("big").is_dir());
    drop(served);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_keeps_confirmed_messages_offsets_stored_offsets_and_deduplication() {
    let dir = data_dir("kill9");
    let (served, port) = serve(&dir);
    let env1 = env(port).await;
    env1.stream_creator().create("durable").await.unwrap();
    let mut producer = env1
        .producer()
        .name("writer-1")
        .build("durable")
        .await
        .unwrap();
    let msgs = |r: std::ops::Range<u64>| -> Vec<Message> {
        r.map(|i| Message::builder().body(body(i)).publishing_id(i).build())
            .collect()
    };
    const N: u64 = 20_000;
    for start in (1..=N).step_by(1000) {
        let s = producer
            .batch_send_with_confirm(msgs(start..start + 1000))
            .await
            .unwrap();
        assert!(s.iter().all(|s| s.confirmed()), "confirmed (after fsync)");
    }
    let mut c = env1
        .consumer()
        .name("reader-1")
        .offset(OffsetSpecification::First)
        .build("durable")
        .await
        .unwrap();
    let got = take(&mut c, 100).await;
    c.store_offset(got[41].0).await.unwrap();
    // Answered after the store on the same connection: the offset is in the log's buffer,
    // durable with the next group commit, which the publish below waits for.
    assert_eq!(c.query_offset().await.unwrap(), 41);
    let s = producer
        .batch_send_with_confirm(msgs(N + 1..N + 2))
        .await
        .unwrap();
    assert!(s[0].confirmed());
    // SIGKILL (the drop): no shutdown, no flush.
    drop(served);
    drop((c, producer, env1));

    let (served, port) = serve(&dir);
    assert!(served.0.logged(&["stream recovered", "durable"]));
    let env2 = env(port).await;
    let mut c = env2
        .consumer()
        .name("reader-1")
        .offset(OffsetSpecification::First)
        .build("durable")
        .await
        .unwrap();
    assert_eq!(c.query_offset().await.unwrap(), 41, "stored offset kept");
    let got = take(&mut c, (N + 1) as usize).await;
    for (i, (offset, data)) in got.iter().enumerate() {
        assert_eq!(*offset, i as u64, "offsets unchanged");
        assert_eq!(data, &body(i as u64 + 1), "every confirmed message");
    }
    // The named producer's sequence survived: re-sent ids are confirmed, not stored.
    let mut producer = env2
        .producer()
        .name("writer-1")
        .build("durable")
        .await
        .unwrap();
    let s = producer
        .batch_send_with_confirm(msgs(N - 9..N + 6))
        .await
        .unwrap();
    assert!(s.iter().all(|s| s.confirmed()));
    let fresh = take(&mut c, 4).await;
    assert_eq!(
        fresh,
        (N + 2..N + 6).map(|i| (i - 1, body(i))).collect::<Vec<_>>(),
        "only the ids past the stored sequence were appended"
    );
    assert!(
        tokio::time::timeout(Duration::from_millis(300), c.next())
            .await
            .is_err(),
        "nothing stored twice"
    );
    common::bounded_as("stream producer close answer", producer.close())
        .await
        .unwrap();
    common::bounded_as("stream consumer close answer", c.handle().close())
        .await
        .unwrap();
    drop(served);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--fsync off` (the like-for-like setting against RabbitMQ, whose streams never fsync):
/// the group commit then skips its blocking thread and the connection polls its waits
/// itself. Confirms still come only after the bytes are written to the segment file, so a
/// kill -9 of the broker (not of the machine: the page cache survives) keeps every confirmed
/// message, and a subscriber waiting at the end of the stream is woken for each commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fsync_off_confirms_after_the_write_and_wakes_waiting_subscribers() {
    let dir = data_dir("fsync-off");
    let args = ["--stream", "127.0.0.1:0", "--fsync", "off"];
    let served = Broker(common::serve(&dir, false, &args));
    let port = served.0.stream.expect("stream port logged");
    let env1 = env(port).await;
    env1.stream_creator().create("nosync").await.unwrap();
    // Subscribed before anything is published: it waits at the end of the stream.
    let mut live = env1
        .consumer()
        .offset(OffsetSpecification::Next)
        .build("nosync")
        .await
        .unwrap();
    let producer = env1
        .producer()
        .batch_size(100)
        .build("nosync")
        .await
        .unwrap();
    const N: u64 = 20_000;
    for start in (0..N).step_by(2000) {
        let confirmed = tokio::time::timeout(
            Duration::from_secs(30),
            publish(&producer, start..start + 2000, 500),
        )
        .await
        .expect("confirms within 30 s");
        assert_eq!(confirmed, 2000);
        // Every commit reaches the waiting subscriber, not only the first.
        let got = take(&mut live, 2000).await;
        assert_eq!(got.first().map(|g| g.0), Some(start));
        assert_eq!(got.last().map(|g| g.1.clone()), Some(body(start + 1999)));
    }
    // SIGKILL (the drop): no shutdown, no flush of anything but what was written.
    drop(served);
    drop((live, producer, env1));

    let served = Broker(common::serve(&dir, false, &args));
    let port = served.0.stream.expect("stream port logged");
    let env2 = env(port).await;
    let mut c = env2
        .consumer()
        .offset(OffsetSpecification::First)
        .build("nosync")
        .await
        .unwrap();
    let got = take(&mut c, N as usize).await;
    for (i, (offset, data)) in got.iter().enumerate() {
        assert_eq!(*offset, i as u64, "offsets unchanged");
        assert_eq!(data, &body(i as u64), "every confirmed message kept");
    }
    c.handle().close().await.unwrap();
    drop(served);
    let _ = std::fs::remove_dir_all(&dir);
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

/// Publish frames of one message each, many in flight, from a named (deduplicating)
/// producer and a filtering one: the stream's writer merges what is queued into one chunk
/// per write (as osiris), so the streams hold far fewer chunks than frames; after kill -9
/// every confirmed message is read back in order, re-sent publishing ids are confirmed and
/// not stored again, and a filtered consumer still gets every message with its value (the
/// merged chunks' Bloom filters hold all their batches' values). (That one batch in flight
/// keeps its chunk is store/tests/stream.rs's: this client may split a batch into frames.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_in_flight_merge_into_chunks_dedup_filters_and_kill_9_hold() {
    use rabbitmq_stream_client::FilterConfiguration;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};
    let dir = data_dir("merged");
    let (served, port) = serve(&dir);
    let e = env(port).await;
    for s in ["merged", "colours"] {
        e.stream_creator().create(s).await.unwrap();
    }
    const N: u64 = 20_000;
    let mut producer = e
        .producer()
        .name("writer-m")
        .batch_size(1)
        .build("merged")
        .await
        .unwrap();
    let colours = e
        .producer()
        .batch_size(1)
        .filter_value_extractor(|m: &Message| {
            let b = std::str::from_utf8(m.data().unwrap_or_default()).unwrap_or_default();
            b.split('-').next().unwrap_or_default().to_string()
        })
        .build("colours")
        .await
        .unwrap();
    let confirmed = Arc::new(AtomicU64::new(0));
    for i in 1..=N {
        let c = confirmed.clone();
        let count = move |r: Result<rabbitmq_stream_client::ConfirmationStatus, _>| {
            let c = c.clone();
            async move {
                if r.is_ok_and(|s| s.confirmed()) {
                    c.fetch_add(1, Ordering::AcqRel);
                }
            }
        };
        let m = Message::builder().body(body(i)).publishing_id(i).build();
        common::bounded_as(
            "room in the producer window",
            producer.send(m, count.clone()),
        )
        .await
        .unwrap();
        let colour = ["red", "blue", "green"][(i % 3) as usize];
        let m = Message::builder().body(format!("{colour}-{i}")).build();
        common::bounded_as("room in the producer window", colours.send(m, count))
            .await
            .unwrap();
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while confirmed.load(Ordering::Acquire) < 2 * N {
        assert!(std::time::Instant::now() < deadline, "confirms within 60 s");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Unmerged is one chunk per frame (20,001 before merging); how many merge depends on
    // how many arrive during each write and fsync: 2,962 in a loaded full test run once
    // syncs with nothing new were skipped, hence a quarter, not a tenth.
    let merged = chunks_on_disk(&dir, "merged");
    assert!(
        merged < N / 4,
        "{merged} chunks for {N} frames in flight: merged"
    );
    assert!(chunks_on_disk(&dir, "colours") < N / 4);
    // SIGKILL (the drop): no shutdown, no flush.
    drop(served);
    drop((producer, colours, e));

    let (served, port) = serve(&dir);
    let e = env(port).await;
    let mut c = e
        .consumer()
        .offset(OffsetSpecification::First)
        .build("merged")
        .await
        .unwrap();
    let got = take(&mut c, N as usize).await;
    for (i, (offset, data)) in got.iter().enumerate() {
        assert_eq!(*offset, i as u64, "offsets dense");
        assert_eq!(
            data,
            &body(i as u64 + 1),
            "every confirmed message, in order"
        );
    }
    let mut producer = e
        .producer()
        .name("writer-m")
        .batch_size(1)
        .build("merged")
        .await
        .unwrap();
    for i in N - 99..=N + 50 {
        let m = Message::builder().body(body(i)).publishing_id(i).build();
        let s = producer.send_with_confirm(m).await.unwrap();
        assert!(s.confirmed(), "id {i} confirmed (re-sent or new)");
    }
    let fresh = take(&mut c, 50).await;
    assert_eq!(
        fresh,
        (N + 1..=N + 50)
            .map(|i| (i - 1, body(i)))
            .collect::<Vec<_>>(),
        "only ids past the stored sequence appended"
    );
    assert!(
        tokio::time::timeout(Duration::from_millis(300), c.next())
            .await
            .is_err(),
        "nothing stored twice"
    );
    let mut blue = e
        .consumer()
        .offset(OffsetSpecification::First)
        .filter_input(Some(FilterConfiguration::new(vec!["blue".into()], false)))
        .build("colours")
        .await
        .unwrap();
    let mut blues = 0;
    while let Ok(Some(Ok(d))) = tokio::time::timeout(Duration::from_millis(1000), blue.next()).await
    {
        let b = String::from_utf8_lossy(d.message().data().unwrap_or_default()).into_owned();
        if b.starts_with("blue-") {
            blues += 1;
        }
    }
    let want = (1..=N).filter(|i| i % 3 == 1).count();
    assert_eq!(blues, want, "every blue message (no false negatives)");
    common::bounded_as("stream producer close answer", producer.close())
        .await
        .unwrap();
    common::bounded_as("stream consumer close answer", c.handle().close())
        .await
        .unwrap();
    common::bounded_as("stream consumer close answer", blue.handle().close())
        .await
        .unwrap();
    drop(served);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleted_then_recreated_starts_empty_and_bad_input_gets_the_protocols_codes() {
    let dir = data_dir("delete");
    let served = Broker(common::serve(
        &dir,
        false,
        &["--stream", "127.0.0.1:0", "--management", "127.0.0.1:0"],
    ));
    let port = served.0.stream.expect("stream port");
    // Listed by the management API as RabbitMQ lists its stream listener.
    let http = served.0.management.expect("management port");
    let overview = tokio::task::spawn_blocking(move || {
        common::http::call(http, "GET", "/api/overview", None).json()
    })
    .await
    .unwrap();
    assert!(
        overview["listeners"]
            .as_array()
            .expect("listeners")
            .iter()
            .any(|l| l["protocol"] == "stream" && l["port"] == port),
        "{overview}"
    );
    // Logins are the broker's users: a wrong password is refused.
    let refused = Environment::builder()
        .host("127.0.0.1")
        .port(port)
        .password("wrong")
        .build()
        .await;
    assert!(refused.is_err(), "a wrong password is refused");
    let env = env(port).await;
    env.stream_creator().create("s").await.unwrap();
    let producer = env.producer().build("s").await.unwrap();
    assert_eq!(publish(&producer, 0..10, 10).await, 10);
    common::bounded_as("stream producer close answer", producer.close())
        .await
        .unwrap();
    // Creating it again: STREAM_ALREADY_EXISTS.
    match env.stream_creator().create("s").await {
        Err(StreamCreateError::Create { status, .. }) => {
            assert_eq!(status, ResponseCode::StreamAlreadyExists)
        }
        other => panic!("second create: {other:?}"),
    }
    env.delete_stream("s").await.unwrap();
    // A subscription to a missing stream: STREAM_DOES_NOT_EXIST.
    match env.consumer().build("s").await {
        Err(ConsumerCreateError::StreamDoesNotExist { .. }) => {}
        Err(ConsumerCreateError::Create { status, .. }) => {
            assert_eq!(status, ResponseCode::StreamDoesNotExist)
        }
        other => panic!("subscribe to a deleted stream: {:?}", other.map(|_| ())),
    }
    env.stream_creator().create("s").await.unwrap();
    let producer = env.producer().build("s").await.unwrap();
    assert_eq!(publish(&producer, 100..101, 1).await, 1);
    let mut c = env
        .consumer()
        .offset(OffsetSpecification::First)
        .build("s")
        .await
        .unwrap();
    assert_eq!(take(&mut c, 1).await, vec![(0, body(100))], "starts empty");
    // Names that are paths stay inside the data directory.
    env.stream_creator().create("../../escape").await.unwrap();
    assert!(
        dir.join("streams")
            .join("%2F")
            .join("%2E%2E%2F%2E%2E%2Fescape")
            .is_dir()
    );
    common::bounded_as("stream consumer close answer", c.handle().close())
        .await
        .unwrap();
    common::bounded_as("stream producer close answer", producer.close())
        .await
        .unwrap();
    drop(served);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Message `i` of the large-chunk test: its size and bytes vary with `i`.
fn large_body(i: u64) -> Vec<u8> {
    let len = if i.is_multiple_of(3) {
        20
    } else {
        60_000 + i as usize
    };
    (0..len)
        .map(|j| ((i as usize * 31 + j) % 251) as u8)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_chunks_sent_with_sendfile_or_copied_arrive_intact() {
    for sendfile in ["true", "false"] {
        let dir = data_dir(&format!("sendfile-{sendfile}"));
        let served = common::serve(
            &dir,
            false,
            &[
                "--stream",
                "127.0.0.1:0",
                &format!("--stream-sendfile={sendfile}"),
            ],
        );
        let port = served.stream.expect("stream port logged");
        let served = Broker(served);
        let env = env(port).await;
        env.stream_creator().create("large").await.expect("create");
        let producer = env.producer().batch_size(8).build("large").await.unwrap();
        // Chunks of one to eight messages: small ones (read ahead, copied) between large
        // ones (file ranges when sendfile is on).
        const N: u64 = 60;
        let mut i = 0;
        while i < N {
            let n = (i % 8 + 1).min(N - i);
            let msgs: Vec<Message> = (i..i + n)
                .map(|k| Message::builder().body(large_body(k)).build())
                .collect();
            let statuses = producer.batch_send_with_confirm(msgs).await.expect("send");
            assert!(statuses.iter().all(|s| s.confirmed()));
            i += n;
        }
        common::bounded_as("stream producer close answer", producer.close())
            .await
            .unwrap();
        let mut consumer = env
            .consumer()
            .offset(OffsetSpecification::First)
            .build("large")
            .await
            .unwrap();
        for (offset, data) in take(&mut consumer, N as usize).await {
            assert!(
                data == large_body(offset),
                "message {offset} intact (sendfile={sendfile})"
            );
        }
        common::bounded_as("stream consumer close answer", consumer.handle().close())
            .await
            .unwrap();
        drop(served);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// A CA and a server certificate it signs (SANs localhost and 127.0.0.1), as `ca.pem`,
/// `server.pem` and `server.key` in `dir`.
fn server_pki(dir: &std::path::Path) {
    let mut ca = rcgen::CertificateParams::new(Vec::new()).expect("params");
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(rcgen::DnType::CommonName, "stream test CA");
    let ca_key = rcgen::KeyPair::generate().expect("key");
    let ca_cert = ca.self_signed(&ca_key).expect("ca");
    let issuer = rcgen::Issuer::new(ca, ca_key);
    let mut params =
        rcgen::CertificateParams::new(vec!["localhost".into(), "127.0.0.1".into()]).unwrap();
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "localhost");
    let key = rcgen::KeyPair::generate().expect("key");
    let cert = params.signed_by(&key, &issuer).expect("sign");
    std::fs::write(dir.join("ca.pem"), ca_cert.pem()).unwrap();
    std::fs::write(dir.join("server.pem"), cert.pem()).unwrap();
    std::fs::write(dir.join("server.key"), key.serialize_pem()).unwrap();
}

/// A free loopback port (bound, then released for the broker to take).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// `--stream-tls` (RabbitMQ's 5551): the stream protocol over TLS with the shared TLS files,
/// serving the same streams as the plain port; a plain client on the TLS port gets nothing
/// but a logged failed handshake.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_listener_serves_the_same_streams() {
    // The Rust client builds its TLS configuration on the process's default provider.
    let _ = tokio_rustls::rustls::crypto::ring::default_provider().install_default();
    let dir = data_dir("tls");
    let pki = dir.join("pki");
    std::fs::create_dir_all(&pki).unwrap();
    server_pki(&pki);
    let tls_port = free_port();
    let tls_addr = format!("127.0.0.1:{tls_port}");
    let data = dir.join("data");
    std::fs::create_dir_all(&data).unwrap();
    let (cert, key) = (pki.join("server.pem"), pki.join("server.key"));
    let served = Broker(common::serve(
        &data,
        false,
        &[
            "--stream",
            "127.0.0.1:0",
            "--stream-tls",
            &tls_addr,
            "--tls-cert",
            cert.to_str().unwrap(),
            "--tls-key",
            key.to_str().unwrap(),
        ],
    ));
    assert!(served.0.logged(&["for stream-tls"]), "TLS listener started");
    let tls = rabbitmq_stream_client::TlsConfiguration::builder()
        .add_root_certificates(pki.join("ca.pem"))
        .build()
        .unwrap();
    let secure = tokio::time::timeout(
        Duration::from_secs(10),
        Environment::builder()
            .host("localhost")
            .port(tls_port)
            .tls(tls)
            .build(),
    )
    .await
    .expect("TLS connect in time")
    .expect("TLS connect");
    common::bounded_as(
        "stream create answer",
        secure.stream_creator().create("tls"),
    )
    .await
    .unwrap();
    let producer = common::bounded_as(
        "stream client declare answer",
        secure.producer().build("tls"),
    )
    .await
    .unwrap();
    assert_eq!(publish(&producer, 0..1000, 100).await, 1000);
    common::bounded_as("stream producer close answer", producer.close())
        .await
        .unwrap();
    let mut c = common::bounded_as(
        "stream client declare answer",
        secure
            .consumer()
            .offset(OffsetSpecification::First)
            .build("tls"),
    )
    .await
    .unwrap();
    let got = take(&mut c, 1000).await;
    assert!(
        got.iter()
            .enumerate()
            .all(|(i, (o, b))| *o == i as u64 && *b == body(i as u64))
    );
    common::bounded_as("stream consumer close answer", c.handle().close())
        .await
        .unwrap();
    // The plain port serves the same stream.
    let plain = env(served.0.stream.expect("stream port")).await;
    let mut c = common::bounded_as(
        "stream client declare answer",
        plain
            .consumer()
            .offset(OffsetSpecification::Offset(990))
            .build("tls"),
    )
    .await
    .unwrap();
    assert_eq!(take(&mut c, 10).await[9], (999, body(999)));
    // A plain-text client on the TLS port: no session, one log line.
    let refused = tokio::time::timeout(
        Duration::from_secs(15),
        Environment::builder()
            .host("127.0.0.1")
            .port(tls_port)
            .build(),
    )
    .await
    .expect("refused in time");
    assert!(refused.is_err(), "plain text on the TLS port");
    assert!(served.0.logged(&["TLS handshake failed", "stream-tls"]));
    drop(served);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Stream filtering (RabbitMQ 3.13) on `warren serve`, with a data directory (Bloom filters
/// in the chunk trailers, also after a restart) and in memory: a filtered subscription
/// without a client-side predicate gets only the chunks holding its values (and the
/// unfiltered ones with match-unfiltered).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn filtered_subscriptions_get_only_chunks_with_their_values() {
    use rabbitmq_stream_client::FilterConfiguration;
    for in_memory in [false, true] {
        let dir = data_dir(if in_memory { "filter-mem" } else { "filter" });
        let mut args = vec!["--stream", "127.0.0.1:0"];
        if in_memory {
            args.push("--in-memory");
        }
        let mut b = Broker(common::serve(&dir, false, &args));
        let e = env(b.0.stream.expect("stream port")).await;
        e.stream_creator().create("colours").await.unwrap();
        let producer = e
            .producer()
            .filter_value_extractor(|m: &Message| {
                let b = std::str::from_utf8(m.data().unwrap_or_default()).unwrap_or_default();
                match b.split('-').next().unwrap_or_default() {
                    "plain" => String::new(),
                    colour => colour.to_string(),
                }
            })
            .build("colours")
            .await
            .unwrap();
        // One batch (one chunk) per colour, unfiltered last.
        for colour in ["red", "blue", "red", "plain"] {
            let batch: Vec<Message> = (0..5)
                .map(|i| Message::builder().body(format!("{colour}-{i}")).build())
                .collect();
            producer.batch_send_with_confirm(batch).await.unwrap();
        }
        common::bounded_as("stream producer close answer", producer.close())
            .await
            .unwrap();
        if !in_memory {
            drop(e);
            drop(b);
            b = Broker(common::serve(&dir, false, &args));
        }
        let e = env(b.0.stream.expect("stream port")).await;
        let read = |values: Vec<String>, unfiltered: bool| {
            let e = e.clone();
            async move {
                let mut c = e
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
                        String::from_utf8_lossy(d.message().data().unwrap_or_default())
                            .into_owned(),
                    );
                }
                common::bounded_as("stream consumer close answer", c.handle().close())
                    .await
                    .unwrap();
                got
            }
        };
        let blue = read(vec!["blue".into()], false).await;
        assert_eq!(
            blue,
            (0..5).map(|i| format!("blue-{i}")).collect::<Vec<_>>(),
            "in_memory={in_memory}"
        );
        let blue_and_plain = read(vec!["blue".into()], true).await;
        assert_eq!(blue_and_plain.len(), 10, "{blue_and_plain:?}");
        assert!(blue_and_plain[5..].iter().all(|b| b.starts_with("plain-")));
        assert_eq!(read(vec!["red".into()], false).await.len(), 10);
        assert!(read(vec!["green".into()], false).await.is_empty());
        drop(b);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// RabbitMQ's Java stream client (`cli/tests/java/StreamFeatures.java`) against the stream
/// TLS listener: TLS with a verified certificate, super streams routed by key and by hash and
/// read by a super stream consumer, a filtered consumer. Ignored by default: it needs Java 17
/// and the client's jars in `target/stream-java/lib`, which scripts/test.sh fetches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Java 17 and target/stream-java/lib (scripts/test.sh)"]
async fn java_client_over_tls_super_streams_and_filtering() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let lib = root.join("../target/stream-java/lib");
    assert!(
        lib.is_dir(),
        "{} missing: fetch the jars first",
        lib.display()
    );
    let dir = data_dir("java");
    let pki = dir.join("pki");
    std::fs::create_dir_all(&pki).unwrap();
    server_pki(&pki);
    let data = dir.join("data");
    std::fs::create_dir_all(&data).unwrap();
    let tls_port = free_port();
    let tls_addr = format!("127.0.0.1:{tls_port}");
    let (cert, key) = (pki.join("server.pem"), pki.join("server.key"));
    let served = Broker(common::serve(
        &data,
        false,
        &[
            "--stream-tls",
            &tls_addr,
            "--tls-cert",
            cert.to_str().unwrap(),
            "--tls-key",
            key.to_str().unwrap(),
        ],
    ));
    assert!(served.0.logged(&["for stream-tls"]), "TLS listener started");
    let out = tokio::time::timeout(
        Duration::from_secs(300),
        tokio::process::Command::new("java")
            .arg("-cp")
            .arg(format!("{}/*", lib.display()))
            .arg(root.join("tests/java/StreamFeatures.java"))
            .args(["localhost", &tls_port.to_string()])
            .arg(pki.join("ca.pem"))
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("java finished within 300 s")
    .expect("java runs");
    println!("{}", String::from_utf8_lossy(&out.stdout));
    eprintln!("{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        out.status.success(),
        "StreamFeatures failed: {:?}",
        out.status
    );
    drop(served);
    let _ = std::fs::remove_dir_all(&dir);
}

fn published(ids: std::ops::Range<u64>) -> Vec<warren_stream::codec::PublishedMessage> {
    ids.map(|i| warren_stream::codec::PublishedMessage {
        publishing_id: i,
        filter_value: None,
        entry: warren_stream::codec::Entry::Simple(body(i).into()),
    })
    .collect()
}

/// The PublishError path over the data directory's streams, as raw frames: every message of
/// a refused Publish frame gets a PublishError with the protocol's code (an undeclared
/// publisher id: 0x12; a sub-batch of a codec this node's streams refuse (snappy): 0x11; a stream
/// deleted under its publisher, even if created again since: a MetadataUpdate at once, then
/// 0x12, the publisher having gone with it); a frame over the frame-max (a message too large) closes that
/// connection with FRAME_TOO_LARGE (0x0e), read by a client still writing that frame (the
/// server drains its input before closing: no reset); another connection's publisher is unaffected
/// throughout, and nothing refused is stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_errors_carry_the_protocols_code_for_every_message() {
    use warren_stream::codec::{Entry, Frame, PublishedMessage};
    use warren_stream::frame::code;
    let dir = data_dir("publish-errors");
    let (served, port) = serve(&dir);
    let mut a = Raw::open(port).await;
    let mut b = Raw::open(port).await;
    for (c, stream) in [(&mut a, "doomed"), (&mut b, "kept")] {
        let r = c
            .request(Frame::Create {
                corr: 10,
                stream: stream.into(),
                arguments: vec![],
            })
            .await;
        assert_eq!(r, code::OK);
        let r = c
            .request(Frame::DeclarePublisher {
                corr: 11,
                publisher_id: 1,
                reference: String::new(),
                stream: stream.into(),
            })
            .await;
        assert_eq!(r, code::OK);
    }
    let publish = |publisher_id, messages| Frame::Publish {
        v2: false,
        publisher_id,
        messages,
    };
    // Still confirmed on the other connection after each refusal.
    async fn b_confirms(b: &mut Raw, id: u64) {
        b.send(&Frame::Publish {
            v2: false,
            publisher_id: 1,
            messages: published(id..id + 1),
        })
        .await;
        assert_eq!(
            b.recv().await,
            Some(Frame::PublishConfirm {
                publisher_id: 1,
                publishing_ids: vec![id]
            })
        );
    }

    a.send(&publish(9, published(1..4))).await;
    assert_eq!(
        a.recv().await,
        Some(Frame::PublishError {
            publisher_id: 9,
            errors: vec![
                (1, code::PUBLISHER_DOES_NOT_EXIST),
                (2, code::PUBLISHER_DOES_NOT_EXIST),
                (3, code::PUBLISHER_DOES_NOT_EXIST)
            ]
        }),
        "an undeclared publisher id"
    );
    b_confirms(&mut b, 1).await;

    let mut with_sub_batch = published(4..5);
    with_sub_batch.push(PublishedMessage {
        publishing_id: 5,
        filter_value: None,
        entry: Entry::SubBatch {
            // Snappy: a codec these streams do not serve (none and gzip are).
            compression: 2,
            count: 2,
            uncompressed_size: 4,
            data: bytes::Bytes::from_static(b"\0\0\0\0"),
        },
    });
    a.send(&publish(1, with_sub_batch)).await;
    assert_eq!(
        a.recv().await,
        Some(Frame::PublishError {
            publisher_id: 1,
            errors: vec![
                (4, code::PRECONDITION_FAILED),
                (5, code::PRECONDITION_FAILED)
            ]
        }),
        "a sub-batch of a codec not served refuses its frame"
    );
    a.send(&publish(1, published(6..8))).await;
    assert_eq!(
        a.recv().await,
        Some(Frame::PublishConfirm {
            publisher_id: 1,
            publishing_ids: vec![6, 7]
        }),
        "the publisher goes on"
    );

    let r = b
        .request(Frame::Delete {
            corr: 12,
            stream: "doomed".into(),
        })
        .await;
    assert_eq!(r, code::OK);
    // Created again under the name: a new stream, not the one the publisher was declared on.
    let r = b
        .request(Frame::Create {
            corr: 14,
            stream: "doomed".into(),
            arguments: vec![],
        })
        .await;
    assert_eq!(r, code::OK);
    // Told at once, idle as it is (a MetadataUpdate to every connection using the stream,
    // as RabbitMQ), and its publisher went with the stream.
    assert_eq!(
        a.recv().await,
        Some(Frame::MetadataUpdate {
            code: code::STREAM_NOT_AVAILABLE,
            stream: "doomed".into()
        })
    );
    a.send(&publish(1, published(8..10))).await;
    assert_eq!(
        a.recv().await,
        Some(Frame::PublishError {
            publisher_id: 1,
            errors: vec![
                (8, code::PUBLISHER_DOES_NOT_EXIST),
                (9, code::PUBLISHER_DOES_NOT_EXIST)
            ]
        }),
        "its publisher went with it, though a stream of that name exists again"
    );
    b_confirms(&mut b, 2).await;

    // A message larger than the frame-max (1 MiB): the frame is refused as a whole.
    let big = vec![PublishedMessage {
        publishing_id: 11,
        filter_value: None,
        entry: Entry::Simple(vec![7u8; 1 << 20].into()),
    }];
    // The server refuses the frame from its header and sends its Close: the client, still
    // writing the frame when it arrives, writes the rest, answers and closes. The server
    // drains its input until then, so the rest's write meets no reset (a socket closed with
    // unread input is reset: the write failed with a broken pipe, and the Close could be
    // lost), and the connection ends at a clean EOF.
    {
        use tokio::io::AsyncWriteExt;
        let frame = warren_stream::codec::to_bytes(&publish(1, big));
        a.s.write_all(&frame[..4096]).await.unwrap();
        match a.recv().await {
            Some(Frame::Close { code: c, .. }) => assert_eq!(c, code::FRAME_TOO_LARGE),
            other => panic!("a close for a frame over the frame-max, got {other:?}"),
        }
        // Time for a server that closes at once to have done so.
        tokio::time::sleep(Duration::from_millis(100)).await;
        a.s.write_all(&frame[4096..])
            .await
            .expect("the rest of the frame written while the server drains, not reset");
        a.send(&Frame::Response {
            key: warren_stream::frame::key::CLOSE,
            corr: 0,
            code: code::OK,
        })
        .await;
        a.s.shutdown().await.unwrap();
        let mut rest = Vec::new();
        let read = tokio::time::timeout(
            Duration::from_secs(10),
            tokio::io::AsyncReadExt::read_to_end(&mut a.s, &mut rest),
        )
        .await
        .expect("the server closes within 10 s");
        assert_eq!(
            read.expect("a clean EOF, not a reset"),
            0,
            "nothing after the Close"
        );
    }
    b_confirms(&mut b, 3).await;

    // Nothing reached the stream created again.
    let r = b
        .request(Frame::Subscribe {
            corr: 15,
            subscription_id: 2,
            stream: "doomed".into(),
            offset: warren_stream::codec::OffsetSpec::First,
            credit: 10,
            properties: vec![],
        })
        .await;
    assert_eq!(r, code::OK);
    assert!(
        tokio::time::timeout(Duration::from_millis(300), b.recv())
            .await
            .is_err(),
        "the new stream is empty"
    );
    // Only what was confirmed is stored on the surviving stream (raw bodies: read as raw
    // chunks, not through a client that decodes AMQP 1.0 messages).
    let r = b
        .request(Frame::Subscribe {
            corr: 13,
            subscription_id: 1,
            stream: "kept".into(),
            offset: warren_stream::codec::OffsetSpec::First,
            credit: 10,
            properties: vec![],
        })
        .await;
    assert_eq!(r, code::OK);
    let mut got = Vec::new();
    while got.len() < 3 {
        let Some(Frame::Deliver { chunk, .. }) = b.recv().await else {
            panic!("a delivery");
        };
        let h = warren_stream::chunk::verify(&chunk).expect("a whole chunk");
        let mut r = warren_stream::frame::Reader::new(chunk.slice(
            warren_stream::chunk::HEADER_LEN + h.bloom_size as usize
                ..warren_stream::chunk::HEADER_LEN + h.bloom_size as usize + h.data_len as usize,
        ));
        for i in 0..h.num_entries as u64 {
            let Entry::Simple(m) = Entry::read(&mut r).expect("an entry") else {
                panic!("simple entries");
            };
            got.push((h.chunk_id + i, m.to_vec()));
        }
    }
    assert_eq!(got, vec![(0, body(1)), (1, body(2)), (2, body(3))]);
    assert!(
        tokio::time::timeout(Duration::from_millis(300), b.recv())
            .await
            .is_err(),
        "nothing else stored"
    );
    drop(served);
    let _ = std::fs::remove_dir_all(&dir);
}
