//! Bad input and protocol edge cases over a raw TcpStream: the response code RabbitMQ gives,
//! and the connection (or the others) unaffected where the protocol says so.

use bytes::{BufMut, Bytes, BytesMut};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use warren_stream::MemoryBackend;
use warren_stream::codec::{self, Entry, Frame, OffsetSpec, PublishedMessage};
use warren_stream::frame::{code, key, split_frame};

struct Raw {
    s: TcpStream,
    buf: BytesMut,
}

impl Raw {
    async fn connect(port: u16) -> Raw {
        Raw {
            s: TcpStream::connect(("127.0.0.1", port)).await.unwrap(),
            buf: BytesMut::new(),
        }
    }

    async fn send(&mut self, f: &Frame) {
        self.s.write_all(&codec::to_bytes(f)).await.unwrap();
    }

    async fn send_raw(&mut self, bytes: &[u8]) {
        self.s.write_all(bytes).await.unwrap();
    }

    /// The next frame, or None on EOF; panics after 5 s naming the caller's line (a plain fn,
    /// not `async`, so that `#[track_caller]` holds).
    #[track_caller]
    fn recv(&mut self) -> impl std::future::Future<Output = Option<Frame>> + '_ {
        let at = std::panic::Location::caller();
        async move {
            tokio::time::timeout(Duration::from_secs(5), self.recv_inner())
                .await
                .unwrap_or_else(|_| panic!("no frame from the broker within 5 s (awaited at {at})"))
        }
    }

    async fn recv_inner(&mut self) -> Option<Frame> {
        loop {
            if let Some(body) = split_frame(&mut self.buf, 0).unwrap() {
                return Some(codec::decode(body).expect("server frames decode"));
            }
            if self.s.read_buf(&mut self.buf).await.unwrap_or(0) == 0 {
                return None;
            }
        }
    }

    /// Nothing arrives within `ms`.
    async fn quiet(&mut self, ms: u64) -> bool {
        tokio::time::timeout(Duration::from_millis(ms), self.recv_inner())
            .await
            .is_err()
    }

    async fn open(port: u16) -> Raw {
        let mut c = Raw::connect(port).await;
        c.send(&Frame::PeerProperties {
            corr: 1,
            properties: vec![("product".into(), "raw".into())],
        })
        .await;
        assert!(matches!(
            c.recv().await,
            Some(Frame::PeerPropertiesResponse { code: 1, .. })
        ));
        c.send(&Frame::SaslHandshake { corr: 2 }).await;
        assert!(matches!(
            c.recv().await,
            Some(Frame::SaslHandshakeResponse { .. })
        ));
        c.send(&Frame::SaslAuthenticate {
            corr: 3,
            mechanism: "PLAIN".into(),
            data: Bytes::from_static(b"\0guest\0guest"),
        })
        .await;
        assert!(matches!(
            c.recv().await,
            Some(Frame::SaslAuthenticateResponse { code: 1, .. })
        ));
        let Some(Frame::Tune { frame_max, .. }) = c.recv().await else {
            panic!("no tune")
        };
        c.send(&Frame::TuneResponse {
            frame_max,
            heartbeat: 0,
        })
        .await;
        c.send(&Frame::Open {
            corr: 4,
            vhost: "/".into(),
        })
        .await;
        assert!(matches!(
            c.recv().await,
            Some(Frame::OpenResponse { code: 1, .. })
        ));
        c
    }

    async fn request(&mut self, f: Frame) -> Frame {
        self.send(&f).await;
        self.recv().await.expect("a response")
    }
}

async fn start() -> (u16, watch::Sender<bool>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let (stop, rx) = watch::channel(false);
    tokio::spawn(warren_stream::serve(
        listener,
        Arc::new(MemoryBackend::new()),
        rx,
    ));
    (port, stop)
}

fn ok(k: u16, corr: u32) -> Frame {
    Frame::Response {
        key: k,
        corr,
        code: code::OK,
    }
}

async fn create(c: &mut Raw, stream: &str) {
    let r = c
        .request(Frame::Create {
            corr: 10,
            stream: stream.into(),
            arguments: vec![],
        })
        .await;
    assert_eq!(r, ok(key::CREATE, 10));
}

/// The connection still answers requests.
async fn alive(c: &mut Raw) {
    let r = c
        .request(Frame::Metadata {
            corr: 77,
            streams: vec!["nope".into()],
        })
        .await;
    assert!(
        matches!(r, Frame::MetadataResponse { corr: 77, .. }),
        "{r:?}"
    );
}

#[tokio::test]
async fn frame_over_frame_max_is_closed_with_frame_too_large() {
    let (port, _stop) = start().await;
    let mut other = Raw::open(port).await;
    let mut c = Raw::open(port).await;
    // 2 MiB declared, over the negotiated 1 MiB: refused before the body is read.
    let mut f = BytesMut::new();
    f.put_u32(2 << 20);
    f.put_u16(key::PUBLISH);
    c.send_raw(&f).await;
    match c.recv().await {
        Some(Frame::Close { code: c, .. }) => assert_eq!(c, code::FRAME_TOO_LARGE),
        other => panic!("expected close, got {other:?}"),
    }
    assert_eq!(c.recv().await, None, "then the connection ends");
    alive(&mut other).await;
}

#[tokio::test]
async fn frame_over_the_pre_open_ceiling_is_refused() {
    let (port, _stop) = start().await;
    let mut c = Raw::connect(port).await;
    // Before Open the ceiling is 8192 bytes whatever Tune says.
    let mut f = BytesMut::new();
    f.put_u32(9000);
    c.send_raw(&f).await;
    match c.recv().await {
        Some(Frame::Close { code: c, .. }) => assert_eq!(c, code::FRAME_TOO_LARGE),
        other => panic!("expected close, got {other:?}"),
    }
    assert_eq!(c.recv().await, None);
}

#[tokio::test]
async fn string_length_past_the_frame_end_is_an_unknown_frame() {
    let (port, _stop) = start().await;
    let mut other = Raw::open(port).await;
    let mut c = Raw::open(port).await;
    // Create whose stream name claims 30,000 bytes in a 14-byte frame.
    let mut body = BytesMut::new();
    body.put_u16(key::CREATE);
    body.put_u16(1);
    body.put_u32(9);
    body.put_i16(30_000);
    body.put_slice(b"abcd");
    let mut f = BytesMut::new();
    f.put_u32(body.len() as u32);
    f.put_slice(&body);
    c.send_raw(&f).await;
    let Some(Frame::Close { corr, code: cc, .. }) = c.recv().await else {
        panic!("expected close")
    };
    assert_eq!(cc, code::UNKNOWN_FRAME);
    // The client answers the close; the server then ends the connection.
    c.send(&ok(key::CLOSE, corr)).await;
    assert_eq!(c.recv().await, None);
    alive(&mut other).await;
}

#[tokio::test]
async fn unknown_command_key_is_closed_with_unknown_frame() {
    let (port, _stop) = start().await;
    let mut c = Raw::open(port).await;
    let mut f = BytesMut::new();
    f.put_u32(8);
    f.put_u16(0x0077);
    f.put_u16(1);
    f.put_u32(5);
    c.send_raw(&f).await;
    let Some(Frame::Close { corr, code: cc, .. }) = c.recv().await else {
        panic!("expected close")
    };
    assert_eq!(cc, code::UNKNOWN_FRAME);
    c.send(&ok(key::CLOSE, corr)).await;
    assert_eq!(c.recv().await, None);
}

#[tokio::test]
async fn credit_on_unknown_subscription_and_credit_overflow_answer_and_keep_the_connection() {
    let (port, _stop) = start().await;
    let mut c = Raw::open(port).await;
    c.send(&Frame::Credit {
        subscription_id: 9,
        credit: 1,
    })
    .await;
    assert_eq!(
        c.recv().await,
        Some(Frame::CreditResponse {
            code: code::SUBSCRIPTION_ID_DOES_NOT_EXIST,
            subscription_id: 9
        })
    );
    alive(&mut c).await;

    create(&mut c, "credit").await;
    let r = c
        .request(Frame::Subscribe {
            corr: 11,
            subscription_id: 1,
            stream: "credit".into(),
            offset: OffsetSpec::First,
            credit: 60_000,
            properties: vec![],
        })
        .await;
    assert_eq!(r, ok(key::SUBSCRIBE, 11));
    c.send(&Frame::Credit {
        subscription_id: 1,
        credit: 10_000,
    })
    .await;
    assert_eq!(
        c.recv().await,
        Some(Frame::CreditResponse {
            code: code::PRECONDITION_FAILED,
            subscription_id: 1
        })
    );
    alive(&mut c).await;
}

#[tokio::test]
async fn subscribe_to_a_missing_stream_is_stream_does_not_exist() {
    let (port, _stop) = start().await;
    let mut c = Raw::open(port).await;
    let r = c
        .request(Frame::Subscribe {
            corr: 5,
            subscription_id: 0,
            stream: "missing".into(),
            offset: OffsetSpec::First,
            credit: 1,
            properties: vec![],
        })
        .await;
    assert_eq!(
        r,
        Frame::Response {
            key: key::SUBSCRIBE,
            corr: 5,
            code: code::STREAM_DOES_NOT_EXIST
        }
    );
    alive(&mut c).await;
}

fn msg(id: u64, data: &'static [u8]) -> PublishedMessage {
    PublishedMessage {
        publishing_id: id,
        filter_value: None,
        entry: Entry::Simple(Bytes::from_static(data)),
    }
}

#[tokio::test]
async fn an_offset_past_the_end_waits_for_data() {
    let (port, _stop) = start().await;
    let mut c = Raw::open(port).await;
    create(&mut c, "tail").await;
    let r = c
        .request(Frame::DeclarePublisher {
            corr: 12,
            publisher_id: 0,
            reference: String::new(),
            stream: "tail".into(),
        })
        .await;
    assert_eq!(r, ok(key::DECLARE_PUBLISHER, 12));
    c.send(&Frame::Publish {
        v2: false,
        publisher_id: 0,
        messages: vec![msg(1, b"a"), msg(2, b"b")],
    })
    .await;
    assert_eq!(
        c.recv().await,
        Some(Frame::PublishConfirm {
            publisher_id: 0,
            publishing_ids: vec![1, 2]
        })
    );
    let r = c
        .request(Frame::Subscribe {
            corr: 13,
            subscription_id: 3,
            stream: "tail".into(),
            offset: OffsetSpec::Offset(1_000),
            credit: 5,
            properties: vec![],
        })
        .await;
    assert_eq!(r, ok(key::SUBSCRIBE, 13));
    assert!(c.quiet(200).await, "nothing past the end yet");
    c.send(&Frame::Publish {
        v2: false,
        publisher_id: 0,
        messages: vec![msg(3, b"c")],
    })
    .await;
    let mut delivered = None;
    for _ in 0..2 {
        match c.recv().await {
            Some(Frame::Deliver {
                subscription_id: 3,
                chunk,
                ..
            }) => delivered = Some(chunk),
            Some(Frame::PublishConfirm { .. }) => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    let chunk = delivered.expect("a delivery");
    let h = warren_stream::chunk::verify(&chunk).unwrap();
    assert_eq!((h.chunk_id, h.num_records), (2, 1), "the next offset, 2");
}

#[tokio::test]
async fn publish_to_an_undeclared_publisher_is_a_publish_error() {
    let (port, _stop) = start().await;
    let mut c = Raw::open(port).await;
    c.send(&Frame::Publish {
        v2: true,
        publisher_id: 7,
        messages: vec![msg(1, b"x")],
    })
    .await;
    assert_eq!(
        c.recv().await,
        Some(Frame::PublishError {
            publisher_id: 7,
            errors: vec![(1, code::PUBLISHER_DOES_NOT_EXIST)]
        })
    );
    alive(&mut c).await;
}

#[tokio::test]
async fn bad_password_is_authentication_failure_then_close() {
    let (port, _stop) = start().await;
    let mut c = Raw::connect(port).await;
    c.send(&Frame::PeerProperties {
        corr: 1,
        properties: vec![],
    })
    .await;
    c.recv().await;
    c.send(&Frame::SaslHandshake { corr: 2 }).await;
    c.recv().await;
    c.send(&Frame::SaslAuthenticate {
        corr: 3,
        mechanism: "PLAIN".into(),
        data: Bytes::from_static(b"\0guest\0wrong"),
    })
    .await;
    assert!(matches!(
        c.recv().await,
        Some(Frame::SaslAuthenticateResponse {
            code: code::AUTHENTICATION_FAILURE,
            ..
        })
    ));
    assert_eq!(c.recv().await, None);
}

#[tokio::test]
async fn deleting_a_stream_tells_its_subscribers_on_other_connections() {
    let (port, _stop) = start().await;
    let mut a = Raw::open(port).await;
    let mut b = Raw::open(port).await;
    create(&mut a, "doomed").await;
    let r = a
        .request(Frame::Subscribe {
            corr: 20,
            subscription_id: 4,
            stream: "doomed".into(),
            offset: OffsetSpec::Next,
            credit: 1,
            properties: vec![],
        })
        .await;
    assert_eq!(r, ok(key::SUBSCRIBE, 20));
    let r = b
        .request(Frame::Delete {
            corr: 21,
            stream: "doomed".into(),
        })
        .await;
    assert_eq!(r, ok(key::DELETE, 21));
    assert_eq!(
        a.recv().await,
        Some(Frame::MetadataUpdate {
            code: code::STREAM_NOT_AVAILABLE,
            stream: "doomed".into()
        })
    );
    // The subscription is gone; the connection is not.
    let r = a
        .request(Frame::Unsubscribe {
            corr: 22,
            subscription_id: 4,
        })
        .await;
    assert_eq!(
        r,
        Frame::Response {
            key: key::UNSUBSCRIBE,
            corr: 22,
            code: code::SUBSCRIPTION_ID_DOES_NOT_EXIST
        }
    );
}

#[tokio::test]
async fn super_stream_commands_answer_with_their_codes() {
    let (port, _stop) = start().await;
    let mut c = Raw::open(port).await;
    let r = c
        .request(Frame::Route {
            corr: 30,
            routing_key: "k".into(),
            super_stream: "none".into(),
        })
        .await;
    assert_eq!(
        r,
        Frame::RouteResponse {
            corr: 30,
            code: code::STREAM_DOES_NOT_EXIST,
            streams: vec![]
        }
    );
    let create = |corr, keys: &[&str]| Frame::CreateSuperStream {
        corr,
        name: "ss".into(),
        partitions: vec!["ss-a".into(), "ss-b".into()],
        binding_keys: keys.iter().map(|k| k.to_string()).collect(),
        arguments: vec![],
    };
    let r = c.request(create(31, &["a"])).await;
    assert_eq!(
        r,
        Frame::Response {
            key: key::CREATE_SUPER_STREAM,
            corr: 31,
            code: code::PRECONDITION_FAILED
        }
    );
    let r = c.request(create(32, &["a", "b"])).await;
    assert_eq!(r, ok(key::CREATE_SUPER_STREAM, 32));
    let r = c.request(create(33, &["a", "b"])).await;
    assert_eq!(
        r,
        Frame::Response {
            key: key::CREATE_SUPER_STREAM,
            corr: 33,
            code: code::STREAM_ALREADY_EXISTS
        }
    );
    let r = c
        .request(Frame::Partitions {
            corr: 34,
            super_stream: "ss".into(),
        })
        .await;
    assert_eq!(
        r,
        Frame::PartitionsResponse {
            corr: 34,
            code: code::OK,
            streams: vec!["ss-a".into(), "ss-b".into()]
        }
    );
    let r = c
        .request(Frame::Route {
            corr: 35,
            routing_key: "b".into(),
            super_stream: "ss".into(),
        })
        .await;
    assert_eq!(
        r,
        Frame::RouteResponse {
            corr: 35,
            code: code::OK,
            streams: vec!["ss-b".into()]
        }
    );
    let r = c
        .request(Frame::DeleteSuperStream {
            corr: 36,
            name: "ss".into(),
        })
        .await;
    assert_eq!(r, ok(key::DELETE_SUPER_STREAM, 36));
    let r = c
        .request(Frame::Metadata {
            corr: 37,
            streams: vec!["ss-a".into()],
        })
        .await;
    let Frame::MetadataResponse { streams, .. } = r else {
        panic!("{r:?}")
    };
    assert_eq!(streams[0].code, code::STREAM_DOES_NOT_EXIST);
}

#[tokio::test]
async fn shutdown_sends_close_and_ends_the_connection() {
    let (port, stop) = start().await;
    let mut c = Raw::open(port).await;
    stop.send(true).unwrap();
    match c.recv().await {
        Some(Frame::Close {
            code: cc, reason, ..
        }) => {
            assert_eq!((cc, reason.as_str()), (code::OK, "server shutdown"))
        }
        other => panic!("expected close, got {other:?}"),
    }
    assert_eq!(c.recv().await, None);
}

fn sac_subscribe(corr: u32, id: u8, stream: &str, name: &str, super_stream: Option<&str>) -> Frame {
    let mut properties = vec![
        ("single-active-consumer".into(), "true".into()),
        ("name".into(), name.into()),
    ];
    if let Some(ss) = super_stream {
        properties.push(("super-stream".into(), ss.into()));
    }
    Frame::Subscribe {
        corr,
        subscription_id: id,
        stream: stream.into(),
        offset: OffsetSpec::First,
        credit: 10,
        properties,
    }
}

/// The next frame is a ConsumerUpdate for `id` with `active`; its correlation id.
async fn consumer_update(c: &mut Raw, id: u8, active: bool) -> u32 {
    match c.recv().await {
        Some(Frame::ConsumerUpdate {
            corr,
            subscription_id,
            active: a,
        }) if subscription_id == id && a == active => corr,
        other => panic!("expected ConsumerUpdate({id}, active={active}), got {other:?}"),
    }
}

/// The next frame is a Deliver for `id`; its chunk id.
async fn delivered_chunk(c: &mut Raw, id: u8) -> u64 {
    match c.recv().await {
        Some(Frame::Deliver {
            subscription_id,
            chunk,
            ..
        }) if subscription_id == id => warren_stream::chunk::verify(&chunk).unwrap().chunk_id,
        other => panic!("expected a delivery to {id}, got {other:?}"),
    }
}

/// Three chunks (one per Publish frame), offsets 0, 1, 2.
async fn three_chunks(c: &mut Raw, stream: &str) {
    let r = c
        .request(Frame::DeclarePublisher {
            corr: 12,
            publisher_id: 0,
            reference: String::new(),
            stream: stream.into(),
        })
        .await;
    assert_eq!(r, ok(key::DECLARE_PUBLISHER, 12));
    for id in 0..3 {
        c.send(&Frame::Publish {
            v2: false,
            publisher_id: 0,
            messages: vec![msg(id, b"m")],
        })
        .await;
        assert!(matches!(c.recv().await, Some(Frame::PublishConfirm { .. })));
    }
}

#[tokio::test]
async fn single_active_consumer_gets_chunks_alone_from_its_answer_and_fails_over() {
    let (port, _stop) = start().await;
    let mut admin = Raw::open(port).await;
    create(&mut admin, "sac").await;
    three_chunks(&mut admin, "sac").await;

    // Without a name: refused, as RabbitMQ.
    let mut a = Raw::open(port).await;
    let r = a
        .request(Frame::Subscribe {
            corr: 19,
            subscription_id: 1,
            stream: "sac".into(),
            offset: OffsetSpec::First,
            credit: 10,
            properties: vec![("single-active-consumer".into(), "true".into())],
        })
        .await;
    assert_eq!(
        r,
        Frame::Response {
            key: key::SUBSCRIBE,
            corr: 19,
            code: code::PRECONDITION_FAILED
        }
    );

    // The first of the group is activated; the server asks it where to start, and
    // delivers nothing before the answer.
    assert_eq!(
        a.request(sac_subscribe(20, 1, "sac", "app", None)).await,
        ok(key::SUBSCRIBE, 20)
    );
    let corr = consumer_update(&mut a, 1, true).await;
    assert!(a.quiet(200).await, "no chunk before the answer");
    a.send(&Frame::ConsumerUpdateResponse {
        corr,
        code: code::OK,
        offset: Some(OffsetSpec::Offset(1)),
    })
    .await;
    assert_eq!(
        delivered_chunk(&mut a, 1).await,
        1,
        "from the answered offset"
    );
    assert_eq!(delivered_chunk(&mut a, 1).await, 2);

    // A second member waits: no update, no chunk.
    let mut b = Raw::open(port).await;
    assert_eq!(
        b.request(sac_subscribe(21, 4, "sac", "app", None)).await,
        ok(key::SUBSCRIBE, 21)
    );
    assert!(b.quiet(300).await, "a waiting member gets nothing");

    // The active one unsubscribes: the next takes over from its own answer.
    assert_eq!(
        a.request(Frame::Unsubscribe {
            corr: 22,
            subscription_id: 1
        })
        .await,
        ok(key::UNSUBSCRIBE, 22)
    );
    let corr = consumer_update(&mut b, 4, true).await;
    b.send(&Frame::ConsumerUpdateResponse {
        corr,
        code: code::OK,
        offset: Some(OffsetSpec::Offset(2)),
    })
    .await;
    assert_eq!(delivered_chunk(&mut b, 4).await, 2);

    // The active one's connection dies: the next member takes over.
    let mut c = Raw::open(port).await;
    assert_eq!(
        c.request(sac_subscribe(23, 0, "sac", "app", None)).await,
        ok(key::SUBSCRIBE, 23)
    );
    assert!(c.quiet(200).await);
    drop(b);
    let corr = consumer_update(&mut c, 0, true).await;
    // "none": where the subscription was (its own `first`).
    c.send(&Frame::ConsumerUpdateResponse {
        corr,
        code: code::OK,
        offset: None,
    })
    .await;
    assert_eq!(delivered_chunk(&mut c, 0).await, 0);
    alive(&mut admin).await;
}

#[tokio::test]
async fn super_stream_partitions_spread_over_the_group_after_a_step_down() {
    let (port, _stop) = start().await;
    let mut admin = Raw::open(port).await;
    let r = admin
        .request(Frame::CreateSuperStream {
            corr: 30,
            name: "orders".into(),
            partitions: vec!["orders-0".into(), "orders-1".into()],
            binding_keys: vec!["0".into(), "1".into()],
            arguments: vec![],
        })
        .await;
    assert_eq!(r, ok(key::CREATE_SUPER_STREAM, 30));

    // The first consumer is alone: active on both partitions.
    let mut a = Raw::open(port).await;
    for (corr, id, p) in [(31, 0, "orders-0"), (32, 1, "orders-1")] {
        let sub = sac_subscribe(corr, id, p, "g", Some("orders"));
        assert_eq!(a.request(sub).await, ok(key::SUBSCRIBE, corr));
        let u = consumer_update(&mut a, id, true).await;
        a.send(&Frame::ConsumerUpdateResponse {
            corr: u,
            code: code::OK,
            offset: None,
        })
        .await;
    }
    // A second one: partition 1 (index 1 of 2 members) moves to it, partition 0 stays. The
    // first is told to step down, and only its answer activates the second.
    let mut b = Raw::open(port).await;
    let sub = sac_subscribe(33, 0, "orders-0", "g", Some("orders"));
    assert_eq!(b.request(sub).await, ok(key::SUBSCRIBE, 33));
    let sub = sac_subscribe(34, 1, "orders-1", "g", Some("orders"));
    assert_eq!(b.request(sub).await, ok(key::SUBSCRIBE, 34));
    let down = consumer_update(&mut a, 1, false).await;
    assert!(
        b.quiet(300).await,
        "not active before the step-down is answered"
    );
    a.send(&Frame::ConsumerUpdateResponse {
        corr: down,
        code: code::OK,
        offset: None,
    })
    .await;
    let up = consumer_update(&mut b, 1, true).await;
    b.send(&Frame::ConsumerUpdateResponse {
        corr: up,
        code: code::OK,
        offset: None,
    })
    .await;
    // Publishing to each partition reaches its active consumer only.
    for (p, _) in [("orders-0", 0), ("orders-1", 1)] {
        let r = admin
            .request(Frame::DeclarePublisher {
                corr: 40,
                publisher_id: 0,
                reference: String::new(),
                stream: p.into(),
            })
            .await;
        assert_eq!(r, ok(key::DECLARE_PUBLISHER, 40));
        admin
            .send(&Frame::Publish {
                v2: false,
                publisher_id: 0,
                messages: vec![msg(1, b"x")],
            })
            .await;
        assert!(matches!(
            admin.recv().await,
            Some(Frame::PublishConfirm { .. })
        ));
        let r = admin
            .request(Frame::DeletePublisher {
                corr: 41,
                publisher_id: 0,
            })
            .await;
        assert_eq!(r, ok(key::DELETE_PUBLISHER, 41));
    }
    assert_eq!(delivered_chunk(&mut a, 0).await, 0, "orders-0 stays with a");
    assert_eq!(delivered_chunk(&mut b, 1).await, 0, "orders-1 went to b");
    assert!(a.quiet(200).await && b.quiet(200).await);
}

#[tokio::test]
async fn frames_longer_or_shorter_than_their_command_are_unknown_frames() {
    let (port, _stop) = start().await;
    let mut other = Raw::open(port).await;
    // A Heartbeat (key, version) followed by 3 bytes its length counts but the command has
    // not; then a frame too short to hold a key and version.
    let bad: [&[u8]; 2] = [&[0, 0, 0, 7, 0, 0x17, 0, 1, 9, 9, 9], &[0, 0, 0, 1, 0x17]];
    for frame in bad {
        let mut c = Raw::open(port).await;
        c.send_raw(frame).await;
        let Some(Frame::Close { corr, code: cc, .. }) = c.recv().await else {
            panic!("expected close for {frame:?}")
        };
        assert_eq!(cc, code::UNKNOWN_FRAME, "{frame:?}");
        c.send(&ok(key::CLOSE, corr)).await;
        assert_eq!(c.recv().await, None);
    }
    alive(&mut other).await;
}
