//! The AMQP wire protocol over raw sockets: handshake, negotiated limits and bad input. A
//! malformed connection is closed with the right reply code and never disturbs another one.

use amq_protocol::frame::AMQPFrame;
use amq_protocol::protocol::{AMQPClass, basic, channel, connection, queue};
use amq_protocol::types::{AMQPValue, FieldTable, LongString};
use bytes::BytesMut;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use warren_amqp::codec::{self, Frame};

const T: Duration = Duration::from_secs(5);

async fn start(
    config: warren_amqp::AmqpConfig,
) -> (std::net::SocketAddr, tokio::sync::watch::Sender<bool>) {
    start_with(config, Default::default()).await
}

async fn start_with(
    config: warren_amqp::AmqpConfig,
    broker: warren_core::BrokerConfig,
) -> (std::net::SocketAddr, tokio::sync::watch::Sender<bool>) {
    let broker = warren_runtime::BrokerHandle::start(broker);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (stop, stopped) = tokio::sync::watch::channel(false);
    tokio::spawn(warren_amqp::serve(
        listener,
        broker,
        Arc::new(config),
        stopped,
    ));
    (addr, stop)
}

struct Raw<S = TcpStream> {
    s: S,
    buf: BytesMut,
}

impl Raw {
    async fn connect(addr: std::net::SocketAddr) -> Raw {
        Raw {
            s: warren_tests::bounded_as("TCP connect", TcpStream::connect(addr))
                .await
                .expect("connect"),
            buf: BytesMut::new(),
        }
    }

    async fn start_ok(addr: std::net::SocketAddr, password: &str) -> Raw {
        let s = warren_tests::bounded_as("TCP connect", TcpStream::connect(addr))
            .await
            .expect("connect");
        Raw::start_ok_on(s, password).await
    }

    async fn open(addr: std::net::SocketAddr) -> Raw {
        warren_tests::bounded_as(
            "TCP connect",
            Raw::open_on(
                warren_tests::bounded_as("TCP connect", TcpStream::connect(addr))
                    .await
                    .expect("connect"),
            ),
        )
        .await
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> Raw<S> {
    async fn send(&mut self, frame: AMQPFrame) {
        let mut b = BytesMut::new();
        codec::encode_frame(&mut b, &frame);
        self.s.write_all(&b).await.expect("write");
    }

    async fn method(&mut self, ch: u16, m: AMQPClass) {
        self.send(AMQPFrame::Method(ch, m)).await;
    }

    /// The next frame from the server, skipping heartbeats; None when the socket closed. A
    /// plain fn (not `async`) so that `#[track_caller]` holds: a timeout names the caller.
    #[track_caller]
    fn recv(&mut self) -> impl std::future::Future<Output = Option<Frame>> + '_ {
        let at = std::panic::Location::caller();
        async move {
            loop {
                match codec::decode(&mut self.buf, 1 << 20).expect("server frames decode") {
                    Some(Frame::Heartbeat(_)) => continue,
                    Some(f) => return Some(f),
                    None => {}
                }
                let n = tokio::time::timeout(T, self.s.read_buf(&mut self.buf))
                    .await
                    .unwrap_or_else(|_| {
                        panic!("no frame from the server within {T:?} (awaited at {at})")
                    })
                    .unwrap_or(0);
                if n == 0 {
                    return None;
                }
            }
        }
    }

    async fn expect_close(&mut self) -> (u16, String) {
        match self.recv().await {
            Some(Frame::Method(0, AMQPClass::Connection(connection::AMQPMethod::Close(c)))) => {
                (c.reply_code, c.reply_text.to_string())
            }
            other => panic!("expected connection.close, got {other:?}"),
        }
    }

    /// Sends the protocol header and start-ok with PLAIN credentials guest/`password`.
    async fn start_ok_on(s: S, password: &str) -> Raw<S> {
        let mut r = Raw {
            s,
            buf: BytesMut::new(),
        };
        r.s.write_all(codec::PROTOCOL_HEADER).await.expect("header");
        match r.recv().await {
            Some(Frame::Method(0, AMQPClass::Connection(connection::AMQPMethod::Start(s)))) => {
                assert_eq!((s.version_major, s.version_minor), (0, 9));
                let caps = s
                    .server_properties
                    .inner()
                    .get("capabilities")
                    .expect("capabilities");
                assert!(format!("{caps:?}").contains("publisher_confirms"));
            }
            other => panic!("expected connection.start, got {other:?}"),
        }
        r.method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::StartOk(connection::StartOk {
                client_properties: client_properties(),
                mechanism: "PLAIN".into(),
                response: LongString::from(format!("\0guest\0{password}")),
                locale: "en_US".into(),
            })),
        )
        .await;
        r
    }

    /// Reads connection.tune (checking the server's proposal) and answers tune-ok.
    async fn tune_ok(&mut self, channel_max: u16, frame_max: u32, heartbeat: u16) {
        match self.recv().await {
            Some(Frame::Method(0, AMQPClass::Connection(connection::AMQPMethod::Tune(t)))) => {
                assert_eq!(
                    (t.channel_max, t.frame_max, t.heartbeat),
                    (2047, 131_072, 60)
                );
            }
            other => panic!("expected connection.tune, got {other:?}"),
        }
        self.method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::TuneOk(connection::TuneOk {
                channel_max,
                frame_max,
                heartbeat,
            })),
        )
        .await;
    }

    /// Sends connection.open for `/` and expects open-ok.
    async fn open_vhost(&mut self) {
        self.method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Open(connection::Open {
                virtual_host: "/".into(),
            })),
        )
        .await;
        assert!(matches!(
            self.recv().await,
            Some(Frame::Method(
                0,
                AMQPClass::Connection(connection::AMQPMethod::OpenOk(_))
            ))
        ));
    }

    /// Runs the handshake up to open-ok with frame_max 4096 and no heartbeats.
    async fn open_on(s: S) -> Raw<S> {
        let mut r = Raw::start_ok_on(s, "guest").await;
        r.tune_ok(10, 4096, 0).await;
        r.open_vhost().await;
        r
    }

    async fn open_channel(&mut self, ch: u16) {
        self.method(
            ch,
            AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
        )
        .await;
        assert!(matches!(
            self.recv().await,
            Some(Frame::Method(c, AMQPClass::Channel(channel::AMQPMethod::OpenOk(_)))) if c == ch
        ));
    }
}

/// What real clients announce: they understand server cancels and connection.blocked.
fn client_properties() -> FieldTable {
    let mut caps = FieldTable::default();
    caps.insert("connection.blocked".into(), AMQPValue::Boolean(true));
    caps.insert("consumer_cancel_notify".into(), AMQPValue::Boolean(true));
    let mut props = FieldTable::default();
    props.insert("capabilities".into(), AMQPValue::FieldTable(caps));
    props
}

/// A healthy connection, used to show that another one's failure did not affect it.
async fn still_serves<S: AsyncRead + AsyncWrite + Unpin>(r: &mut Raw<S>) {
    r.method(
        1,
        AMQPClass::Basic(basic::AMQPMethod::Qos(basic::Qos {
            prefetch_count: 5,
            global: false,
        })),
    )
    .await;
    assert!(matches!(
        r.recv().await,
        Some(Frame::Method(
            1,
            AMQPClass::Basic(basic::AMQPMethod::QosOk(_))
        ))
    ));
}

#[tokio::test]
async fn wrong_protocol_header_gets_ours_back() {
    let (addr, _stop) = start(Default::default()).await;
    let mut r = Raw::connect(addr).await;
    r.s.write_all(b"AMQP\x01\x01\x00\x0a").await.expect("write");
    let mut got = Vec::new();
    tokio::time::timeout(T, r.s.read_to_end(&mut got))
        .await
        .expect("closed in time")
        .expect("read");
    assert_eq!(got, codec::PROTOCOL_HEADER);
}

#[tokio::test]
async fn bad_credentials_are_refused_with_403() {
    let (addr, _stop) = start(Default::default()).await;
    let mut r = Raw::start_ok(addr, "wrong").await;
    let (code, text) = r.expect_close().await;
    assert_eq!(code, 403);
    assert!(
        text.starts_with("ACCESS_REFUSED - Login was refused"),
        "{text}"
    );
}

#[tokio::test]
async fn tune_ok_above_the_server_limits_is_refused_with_530() {
    let (addr, _stop) = start(Default::default()).await;
    let mut r = Raw::start_ok(addr, "guest").await;
    r.tune_ok(2047, 1 << 20, 0).await;
    let (code, text) = r.expect_close().await;
    assert_eq!(code, 530, "{text}");
}

#[tokio::test]
async fn oversized_frame_closes_only_its_connection_with_501() {
    let (addr, _stop) = start(Default::default()).await;
    let mut good = Raw::open(addr).await;
    good.open_channel(1).await;
    let mut bad = Raw::open(addr).await;
    // A body frame header claiming 1 MiB on a connection that negotiated frame_max 4096.
    bad.s
        .write_all(&[3, 0, 1, 0, 0x10, 0, 0])
        .await
        .expect("write");
    let (code, text) = bad.expect_close().await;
    assert_eq!(code, 501, "{text}");
    still_serves(&mut good).await;
}

#[tokio::test]
async fn garbage_and_unexpected_frames_close_with_the_right_codes() {
    let (addr, _stop) = start(Default::default()).await;
    let mut good = Raw::open(addr).await;
    good.open_channel(1).await;

    let mut bad = Raw::open(addr).await;
    bad.s
        .write_all(&[1, 0, 1, 0, 0, 0, 4, 0xFF, 0xFF, 0xFF, 0xFF, 0xCE])
        .await
        .expect("write");
    assert_eq!(
        bad.expect_close().await,
        (
            503,
            "COMMAND_INVALID - unknown method (class 65535, method 65535) on channel 1".into()
        ),
        "a method the protocol does not have"
    );

    let mut bad = Raw::open(addr).await;
    bad.open_channel(1).await;
    bad.send(AMQPFrame::Body(1, b"no publish before me".to_vec()))
        .await;
    assert_eq!(
        bad.expect_close().await.0,
        505,
        "a body without publish is unexpected"
    );

    let mut bad = Raw::open(addr).await;
    bad.method(
        3,
        AMQPClass::Basic(basic::AMQPMethod::Qos(basic::Qos {
            prefetch_count: 1,
            global: false,
        })),
    )
    .await;
    assert_eq!(
        bad.expect_close().await.0,
        504,
        "a method on a channel never opened"
    );

    let mut bad = Raw::open(addr).await;
    bad.send(AMQPFrame::InvalidHeartbeat(2)).await;
    assert_eq!(
        bad.expect_close().await.0,
        501,
        "a heartbeat on a channel other than 0"
    );

    still_serves(&mut good).await;
}

#[tokio::test]
async fn channel_errors_close_the_channel_not_the_connection() {
    let (addr, _stop) = start(Default::default()).await;
    let mut r = Raw::open(addr).await;
    r.open_channel(1).await;
    r.open_channel(2).await;
    r.method(
        2,
        AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
            delivery_tag: 99,
            multiple: false,
        })),
    )
    .await;
    match r.recv().await {
        Some(Frame::Method(2, AMQPClass::Channel(channel::AMQPMethod::Close(c)))) => {
            assert_eq!(c.reply_code, 406);
            assert_eq!(
                c.reply_text.as_str(),
                "PRECONDITION_FAILED - unknown delivery tag 99"
            );
            assert_eq!((c.class_id, c.method_id), (60, 80));
        }
        other => panic!("expected channel.close, got {other:?}"),
    }
    r.method(
        2,
        AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
    )
    .await;
    still_serves(&mut r).await;
    // The channel number is free again.
    r.open_channel(2).await;
}

#[tokio::test]
async fn dead_peers_are_dropped_after_two_missed_heartbeats() {
    let (addr, _stop) = start(Default::default()).await;
    let mut r = Raw::start_ok(addr, "guest").await;
    r.tune_ok(0, 0, 1).await;
    r.open_vhost().await;
    // Say nothing: the server sends heartbeats, then gives up after 2 s of silence.
    let start = tokio::time::Instant::now();
    let mut heartbeats = 0;
    let mut buf = [0u8; 64];
    loop {
        match tokio::time::timeout(T, r.s.read(&mut buf))
            .await
            .expect("closed in time")
        {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                heartbeats += buf[..n]
                    .iter()
                    .filter(|&&b| b == codec::FRAME_HEARTBEAT)
                    .count()
            }
        }
    }
    let waited = start.elapsed();
    assert!(heartbeats >= 1, "the server sent heartbeats");
    assert!(
        waited >= Duration::from_millis(1500) && waited < Duration::from_secs(4),
        "{waited:?}"
    );
}

#[tokio::test]
async fn socketless_in_process_connection_speaks_the_same_protocol() {
    // The gateway is generic over the byte stream: an in-memory duplex stands in for a socket,
    // which is how benchmarks go past the file-descriptor limit.
    let broker = warren_runtime::BrokerHandle::start(Default::default());
    let (client, server) = tokio::io::duplex(64 * 1024);
    let (_stop, stopped) = tokio::sync::watch::channel(false);
    tokio::spawn(warren_amqp::serve_connection(
        server,
        warren_amqp::PeerInfo {
            addr: "in-process".into(),
            is_loopback: true,
            identity: None,
            tls: false,
        },
        broker,
        Arc::new(Default::default()),
        stopped,
    ));
    let mut r = Raw::open_on(client).await;
    r.open_channel(1).await;
    still_serves(&mut r).await;
}

impl<S: AsyncRead + AsyncWrite + Unpin> Raw<S> {
    async fn publish(&mut self, ch: u16, queue: &str, body: &[u8]) {
        self.method(
            ch,
            AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
                exchange: "".into(),
                routing_key: queue.into(),
                mandatory: false,
                immediate: false,
            })),
        )
        .await;
        let mut b = BytesMut::new();
        codec::encode_content(
            &mut b,
            ch,
            &Default::default(),
            &bytes::Bytes::copy_from_slice(body),
            4096,
        );
        self.s.write_all(&b).await.expect("write");
    }

    async fn declare_queue(&mut self, ch: u16, queue: &str, passive: bool) -> u32 {
        self.method(
            ch,
            AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
                queue: queue.into(),
                passive,
                durable: false,
                exclusive: false,
                auto_delete: false,
                nowait: false,
                arguments: FieldTable::default(),
            })),
        )
        .await;
        loop {
            match self.recv().await {
                // Memory-alarm notices may arrive at any time on channel 0.
                Some(Frame::Method(0, AMQPClass::Connection(_))) => continue,
                Some(Frame::Method(_, AMQPClass::Queue(queue::AMQPMethod::DeclareOk(ok)))) => {
                    return ok.message_count;
                }
                other => panic!("expected queue.declare-ok, got {other:?}"),
            }
        }
    }
}

#[tokio::test]
async fn memory_alarm_blocks_a_publisher_until_consumers_free_memory() {
    let (addr, _stop) = start_with(
        Default::default(),
        warren_core::BrokerConfig {
            memory_high_watermark: 1500,
            ..Default::default()
        },
    )
    .await;
    let mut publisher = Raw::open(addr).await;
    publisher.open_channel(1).await;
    publisher.declare_queue(1, "alarm", false).await;
    publisher.publish(1, "alarm", &[1; 1000]).await;
    publisher.publish(1, "alarm", &[2; 1000]).await;
    assert!(matches!(
        publisher.recv().await,
        Some(Frame::Method(0, AMQPClass::Connection(connection::AMQPMethod::Blocked(b)))) if b.reason.as_str() == "low on memory"
    ));
    // Blocked: this publish stays unread in the socket.
    publisher.publish(1, "alarm", &[3; 1000]).await;
    // A connection that only consumes is not told (as RabbitMQ): clients stop sending
    // everything while blocked, and a consumer must keep acking to free memory.
    let mut consumer = Raw::open(addr).await;
    consumer.open_channel(1).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        consumer.declare_queue(1, "alarm", true).await,
        2,
        "the third publish was not read"
    );
    // Each get frees 1000 bytes; once the hold (1 s) is over the alarm clears, the third
    // publish is read (1000 bytes, under the watermark: no alarm again).
    for _ in 0..2 {
        consumer
            .method(
                1,
                AMQPClass::Basic(basic::AMQPMethod::Get(basic::Get {
                    queue: "alarm".into(),
                    no_ack: true,
                })),
            )
            .await;
        let mut content = Vec::new();
        while content.len() < 3 {
            match consumer.recv().await {
                Some(Frame::Method(0, AMQPClass::Connection(_))) => {}
                Some(f) => content.push(f),
                None => panic!("consumer connection closed"),
            }
        }
        assert!(matches!(
            content[0],
            Frame::Method(1, AMQPClass::Basic(basic::AMQPMethod::GetOk(_)))
        ));
    }
    assert!(matches!(
        publisher.recv().await,
        Some(Frame::Method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Unblocked(_))
        ))
    ));
    // Unblocked, the publisher is read again and its third message arrives.
    let mut count = 0;
    for _ in 0..50 {
        count = consumer.declare_queue(1, "alarm", true).await;
        if count == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(count, 1);
}

/// A method frame on channel `ch` with `payload` (class and method ids, then arguments).
fn method_frame(ch: u16, payload: &[u8]) -> Vec<u8> {
    let mut f = vec![codec::FRAME_METHOD];
    f.extend_from_slice(&ch.to_be_bytes());
    f.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    f.extend_from_slice(payload);
    f.push(codec::FRAME_END);
    f
}

/// Method frames that do not decode are answered in the protocol's terms, never with the
/// decoder's internals (it said `Nom(MapOpt)`): an unknown method is 503 COMMAND_INVALID,
/// arguments that do not fit are 502 SYNTAX_ERROR naming the method; a name that is not
/// UTF-8 is a bad argument, so 406 on its channel only (it closed the connection), and the
/// content of a publish refused that way is skipped.
#[tokio::test]
async fn undecodable_methods_get_protocol_texts_and_bad_utf8_closes_only_its_channel() {
    let (addr, _stop) = start(Default::default()).await;
    let mut bad = Raw::open(addr).await;
    bad.s
        .write_all(&method_frame(0, &[0, 99, 0, 7]))
        .await
        .expect("write");
    assert_eq!(
        bad.expect_close().await,
        (
            503,
            "COMMAND_INVALID - unknown method (class 99, method 7) on channel 0".into()
        )
    );

    let mut bad = Raw::open(addr).await;
    bad.open_channel(1).await;
    // queue.declare whose queue name claims 5 bytes and has 1.
    bad.s
        .write_all(&method_frame(1, &[0, 50, 0, 10, 0, 0, 5, b'q']))
        .await
        .expect("write");
    assert_eq!(
        bad.expect_close().await,
        (
            502,
            "SYNTAX_ERROR - cannot decode the arguments of queue.declare on channel 1".into()
        )
    );

    let mut r = Raw::open(addr).await;
    r.open_channel(1).await;
    r.open_channel(2).await;
    // queue.declare of "q\xC3(" (not UTF-8), passive off, no arguments.
    let declare = [0, 50, 0, 10, 0, 0, 3, b'q', 0xC3, 0x28, 0, 0, 0, 0, 0];
    // basic.publish to exchange "" with routing key "\xFF", then its header and body.
    let publish = [0, 60, 0, 40, 0, 0, 0, 1, 0xFF, 0];
    let mut frames = method_frame(1, &declare);
    frames.extend(method_frame(2, &publish));
    let mut content = BytesMut::new();
    codec::encode_content(
        &mut content,
        2,
        &Default::default(),
        &bytes::Bytes::from_static(b"body"),
        4096,
    );
    frames.extend_from_slice(&content);
    r.s.write_all(&frames).await.expect("write");
    for (ch, ids, field, name) in [
        (1, (50, 10), "queue", "queue.declare"),
        (2, (60, 40), "routing-key", "basic.publish"),
    ] {
        match r.recv().await {
            Some(Frame::Method(c, AMQPClass::Channel(channel::AMQPMethod::Close(close)))) => {
                assert_eq!(c, ch);
                assert_eq!(close.reply_code, 406);
                assert_eq!(
                    close.reply_text.as_str(),
                    format!("PRECONDITION_FAILED - invalid UTF-8 in argument '{field}' of {name}")
                );
                assert_eq!((close.class_id, close.method_id), ids);
            }
            other => panic!("expected channel.close on {ch}, got {other:?}"),
        }
        r.method(
            ch,
            AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
        )
        .await;
    }
    // The connection carries on: channel 1 opens again and serves.
    r.open_channel(1).await;
    still_serves(&mut r).await;
}

impl<S: AsyncRead + AsyncWrite + Unpin> Raw<S> {
    async fn update_secret(&mut self, secret: &str) {
        self.method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::UpdateSecret(
                connection::UpdateSecret {
                    new_secret: LongString::from(secret),
                    reason: "token refresh".into(),
                },
            )),
        )
        .await;
    }
}

/// `connection.update-secret` (RabbitMQ 3.8+; OAuth 2 clients refresh their token with it)
/// is answered with update-secret-ok (it closed the connection with 503), and the connection
/// carries on. A password user's secret is not checked, as RabbitMQ 3.10's internal users'
/// is not (pika's TestUpdateSecret sends `new_secret` for guest; checking it as the password
/// closed the connection with 530); a user who may no longer use the vhost gets 530, as
/// RabbitMQ's refusal. The server properties advertise every capability Warren has, RabbitMQ
/// 3.10's list.
#[tokio::test]
async fn update_secret_rechecks_the_user_and_capabilities_are_advertised() {
    let broker = warren_runtime::BrokerHandle::start(Default::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (_stop, stopped) = tokio::sync::watch::channel(false);
    tokio::spawn(warren_amqp::serve(
        listener,
        broker.clone(),
        Arc::new(Default::default()),
        stopped,
    ));
    let mut r = Raw::connect(addr).await;
    r.s.write_all(codec::PROTOCOL_HEADER).await.expect("header");
    match r.recv().await {
        Some(Frame::Method(0, AMQPClass::Connection(connection::AMQPMethod::Start(s)))) => {
            let Some(AMQPValue::FieldTable(caps)) = s.server_properties.inner().get("capabilities")
            else {
                panic!("no capabilities table");
            };
            for cap in [
                "publisher_confirms",
                "exchange_exchange_bindings",
                "basic.nack",
                "consumer_cancel_notify",
                "connection.blocked",
                "consumer_priorities",
                "authentication_failure_close",
                "per_consumer_qos",
                "direct_reply_to",
            ] {
                assert_eq!(
                    caps.inner().get(cap),
                    Some(&AMQPValue::Boolean(true)),
                    "{cap}"
                );
            }
        }
        other => panic!("expected connection.start, got {other:?}"),
    }

    let mut r = Raw::open(addr).await;
    r.open_channel(1).await;
    r.update_secret("guest").await;
    assert!(
        matches!(
            r.recv().await,
            Some(Frame::Method(
                0,
                AMQPClass::Connection(connection::AMQPMethod::UpdateSecretOk(_))
            ))
        ),
        "update-secret-ok"
    );
    still_serves(&mut r).await;
    r.update_secret("an OAuth 2 token, not guest's password")
        .await;
    assert!(
        matches!(
            r.recv().await,
            Some(Frame::Method(
                0,
                AMQPClass::Connection(connection::AMQPMethod::UpdateSecretOk(_))
            ))
        ),
        "update-secret-ok for a secret that is not the password, as RabbitMQ 3.10"
    );
    still_serves(&mut r).await;
    match broker
        .admin(warren_runtime::AdminRequest::ClearPermissions {
            vhost: "/".into(),
            user: "guest".into(),
        })
        .await
    {
        Ok(warren_runtime::AdminResponse::Done(Ok(()))) => {}
        other => panic!("{other:?}"),
    }
    r.update_secret("guest").await;
    match r.recv().await {
        Some(Frame::Method(0, AMQPClass::Connection(connection::AMQPMethod::Close(c)))) => {
            assert_eq!(
                (c.reply_code, c.reply_text.as_str(), c.class_id, c.method_id),
                (
                    530,
                    "NOT_ALLOWED - New secret was refused by one of the backends",
                    10,
                    70
                )
            );
        }
        other => panic!("expected connection.close, got {other:?}"),
    }
}

/// A consumer whose connection task waits on a full socket while the broker hands it one
/// delivery per turn gets every delivery once it reads again, and its write window comes
/// back whole (issue 21, item 7). The connection used to take a 65th batch of effects from
/// its mailbox after encoding 64 and drop it: its deliveries were lost and the write-window
/// credit they held was never returned, so under load PerfTest's consumer leaked its window
/// (`in_flight` stuck at 600+ between bursts) until it crawled at a few deliveries per round
/// trip while its publisher sat paused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_behind_a_full_socket_gets_every_delivery_and_its_window_back() {
    use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
    const BIG: usize = 16;
    const SMALL: usize = 200;
    let b = warren_tests::start().await;
    let (_pc, publisher) = b.channel().await;
    warren_tests::declare(&publisher, "window").await;
    warren_tests::bounded_as(
        "confirm.select-ok",
        publisher.confirm_select(ConfirmSelectOptions::default()),
    )
    .await
    .expect("confirms");
    // The consumer's socket reads nothing until told: a small receive buffer, so the
    // broker's side fills quickly.
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket.set_recv_buffer_size(16 * 1024).expect("rcvbuf");
    let mut consumer = Raw::open_on(socket.connect(b.addr).await.expect("connect")).await;
    consumer.open_channel(1).await;
    consumer
        .method(
            1,
            AMQPClass::Basic(basic::AMQPMethod::Consume(basic::Consume {
                queue: "window".into(),
                consumer_tag: "c".into(),
                no_local: false,
                no_ack: true,
                exclusive: false,
                nowait: false,
                arguments: FieldTable::default(),
            })),
        )
        .await;
    assert!(matches!(
        consumer.recv().await,
        Some(Frame::Method(
            1,
            AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(_))
        ))
    ));
    let publish = |body: Vec<u8>| {
        let publisher = publisher.clone();
        async move {
            let confirm = warren_tests::bounded(publisher.basic_publish(
                "".into(),
                "window".into(),
                BasicPublishOptions::default(),
                &body,
                lapin::BasicProperties::default(),
            ))
            .await
            .expect("publish");
            assert!(
                warren_tests::bounded(confirm)
                    .await
                    .expect("confirm")
                    .is_ack()
            );
        }
    };
    // 16 MiB of deliveries: more than the socket buffers of both ends hold (Linux's
    // default send buffer tops out at 4 MiB), so the consumer's connection task ends up
    // waiting in its write.
    for _ in 0..BIG {
        publish(vec![b'x'; 1 << 20]).await;
    }
    // Then one delivery per broker turn (each publish waits for its confirm): each is an
    // effect batch of its own, waiting in the connection's mailbox behind the big ones.
    for i in 0..SMALL {
        publish(format!("{i}").into_bytes()).await;
    }
    // The premise: the connection task waits in its write, the small deliveries unwritten.
    let waiting = consumer_in_flight(&b.broker).await;
    assert!(
        waiting >= Some(SMALL as u32),
        "the consumer's socket should be full: {waiting:?} deliveries in flight"
    );
    let mut deliveries = 0;
    let mut small = Vec::new();
    // Read until the last small body, or until nothing more comes (a lost delivery).
    while small.len() < SMALL {
        let Ok(frame) = tokio::time::timeout(Duration::from_secs(2), consumer.recv()).await else {
            break;
        };
        match frame {
            Some(Frame::Method(1, AMQPClass::Basic(basic::AMQPMethod::Deliver(_)))) => {
                deliveries += 1
            }
            Some(Frame::Body(1, body)) if body.len() < 16 => {
                small.push(String::from_utf8(body.to_vec()).expect("utf-8"))
            }
            Some(_) => {}
            None => panic!("the consumer's connection closed"),
        }
    }
    // Every delivery was written: the consumer's write window is whole again.
    let mut in_flight = None;
    for _ in 0..100 {
        in_flight = consumer_in_flight(&b.broker).await;
        if in_flight == Some(0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        (deliveries, in_flight),
        (BIG + SMALL, Some(0)),
        "(deliveries received, deliveries the broker still counts in flight)"
    );
    let expected: Vec<String> = (0..SMALL).map(|i| i.to_string()).collect();
    assert_eq!(small, expected, "every small message, once, in order");
}

/// The broker's count of deliveries handed to the (one) consuming connection and not yet
/// written to its socket.
async fn consumer_in_flight(broker: &warren_runtime::BrokerHandle) -> Option<u32> {
    use warren_runtime::{AdminRequest, AdminResponse};
    match broker.admin(AdminRequest::ListConnections).await {
        Ok(AdminResponse::Connections(conns)) => {
            conns.iter().find(|c| c.consumers == 1).map(|c| c.in_flight)
        }
        other => panic!("connections expected, got {other:?}"),
    }
}
