//! The connection task end to end over an in-memory stream, with the real broker behind it:
//! the gateway-side behaviours no client library shows directly (confirm collapsing, the
//! close handshakes, shutdown, oversized content).

use amq_protocol::frame::AMQPFrame;
use amq_protocol::protocol::{AMQPClass, basic, channel, confirm, connection, queue};
use amq_protocol::types::{FieldTable, LongString};
use bytes::{Bytes, BytesMut};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};
use tokio::sync::watch;
use warren_amqp::codec::{self, Frame};
use warren_amqp::{AmqpConfig, PeerInfo};

const T: Duration = Duration::from_secs(5);

struct Client {
    s: DuplexStream,
    buf: BytesMut,
    out: BytesMut,
}

impl Client {
    /// Starts a broker and a connection task over a duplex stream; runs the handshake.
    async fn open(config: AmqpConfig, shutdown: watch::Receiver<bool>) -> Client {
        let broker = warren_runtime::BrokerHandle::start(Default::default());
        let (client, server) = tokio::io::duplex(256 * 1024);
        tokio::spawn(warren_amqp::serve_connection(
            server,
            PeerInfo {
                addr: "test".into(),
                is_loopback: true,
                identity: None,
                tls: false,
            },
            broker,
            Arc::new(config),
            shutdown,
        ));
        let mut c = Client {
            s: client,
            buf: BytesMut::new(),
            out: BytesMut::new(),
        };
        c.s.write_all(codec::PROTOCOL_HEADER).await.expect("write");
        assert!(matches!(
            c.recv().await,
            Some(Frame::Method(
                0,
                AMQPClass::Connection(connection::AMQPMethod::Start(_))
            ))
        ));
        c.method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::StartOk(connection::StartOk {
                client_properties: FieldTable::default(),
                mechanism: "PLAIN".into(),
                response: LongString::from("\0guest\0guest"),
                locale: "en_US".into(),
            })),
        );
        c.method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::TuneOk(connection::TuneOk {
                channel_max: 0,
                frame_max: 0,
                heartbeat: 0,
            })),
        );
        c.method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Open(connection::Open {
                virtual_host: "/".into(),
            })),
        );
        c.flush().await;
        assert!(matches!(
            c.recv().await,
            Some(Frame::Method(
                0,
                AMQPClass::Connection(connection::AMQPMethod::Tune(_))
            ))
        ));
        assert!(matches!(
            c.recv().await,
            Some(Frame::Method(
                0,
                AMQPClass::Connection(connection::AMQPMethod::OpenOk(_))
            ))
        ));
        c
    }

    /// Queues a method; `flush` sends everything queued in one write.
    fn method(&mut self, ch: u16, m: AMQPClass) {
        codec::encode_frame(&mut self.out, &AMQPFrame::Method(ch, m));
    }

    fn publish(&mut self, ch: u16, queue: &str, body: &[u8]) {
        self.method(
            ch,
            AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
                exchange: "".into(),
                routing_key: queue.into(),
                mandatory: false,
                immediate: false,
            })),
        );
        codec::encode_content(
            &mut self.out,
            ch,
            &Default::default(),
            &Bytes::copy_from_slice(body),
            131_072,
        );
    }

    async fn flush(&mut self) {
        self.s.write_all(&self.out).await.expect("write");
        self.out.clear();
    }

    /// The next frame, skipping heartbeats; None once the server closed the stream. A plain
    /// fn (not `async`) so that `#[track_caller]` holds: a timeout names the caller's line.
    #[track_caller]
    fn recv(&mut self) -> impl std::future::Future<Output = Option<Frame>> + '_ {
        let at = std::panic::Location::caller();
        async move {
            loop {
                if let Some(f) =
                    codec::decode(&mut self.buf, 1 << 20).expect("server frames decode")
                {
                    return Some(f);
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

    async fn open_channel(&mut self, ch: u16) {
        self.method(
            ch,
            AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
        );
        self.flush().await;
        let got = self.recv().await;
        assert!(
            matches!(got, Some(Frame::Method(c, AMQPClass::Channel(channel::AMQPMethod::OpenOk(_)))) if c == ch),
            "expected channel.open-ok, got {got:?}"
        );
    }

    async fn declare(&mut self, ch: u16, name: &str) {
        self.method(
            ch,
            AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
                queue: name.into(),
                passive: false,
                durable: false,
                exclusive: false,
                auto_delete: false,
                nowait: false,
                arguments: FieldTable::default(),
            })),
        );
        self.flush().await;
        let got = self.recv().await;
        assert!(
            matches!(
                got,
                Some(Frame::Method(
                    _,
                    AMQPClass::Queue(queue::AMQPMethod::DeclareOk(_))
                ))
            ),
            "expected queue.declare-ok, got {got:?}"
        );
    }

    async fn expect_connection_close(&mut self) -> connection::Close {
        match self.recv().await {
            Some(Frame::Method(0, AMQPClass::Connection(connection::AMQPMethod::Close(c)))) => c,
            other => panic!("expected connection.close, got {other:?}"),
        }
    }

    /// The server closes the stream (read returns 0) in time.
    async fn expect_eof(&mut self) {
        loop {
            let n = tokio::time::timeout(T, self.s.read_buf(&mut self.buf))
                .await
                .expect("server closes in time")
                .unwrap_or(0);
            if n == 0 {
                return;
            }
        }
    }
}

#[tokio::test]
async fn pipelined_publishes_are_confirmed_by_one_multiple_ack() {
    let (_stop, stopped) = watch::channel(false);
    let mut c = Client::open(AmqpConfig::default(), stopped).await;
    c.open_channel(1).await;
    c.declare(1, "q").await;
    c.method(
        1,
        AMQPClass::Confirm(confirm::AMQPMethod::Select(confirm::Select {
            nowait: false,
        })),
    );
    c.flush().await;
    assert!(matches!(
        c.recv().await,
        Some(Frame::Method(
            1,
            AMQPClass::Confirm(confirm::AMQPMethod::SelectOk(_))
        ))
    ));
    for _ in 0..50 {
        c.publish(1, "q", b"m");
    }
    c.flush().await;
    // However the reads split the publishes, the acks cover 1..=50 in order, and every ack
    // frame confirms a contiguous run: fewer frames than messages.
    let mut confirmed = 0;
    let mut frames = 0;
    while confirmed < 50 {
        match c.recv().await {
            Some(Frame::Method(1, AMQPClass::Basic(basic::AMQPMethod::Ack(a)))) => {
                frames += 1;
                assert!(a.delivery_tag > confirmed);
                assert!(a.multiple || a.delivery_tag == confirmed + 1);
                confirmed = a.delivery_tag;
            }
            other => panic!("expected basic.ack, got {other:?}"),
        }
    }
    assert_eq!(confirmed, 50);
    assert!(frames < 50, "{frames} ack frames for 50 messages");
}

#[tokio::test]
async fn broker_shutdown_closes_with_320() {
    let (stop, stopped) = watch::channel(false);
    let mut c = Client::open(AmqpConfig::default(), stopped).await;
    c.open_channel(1).await;
    stop.send(true).expect("connection watches");
    let close = c.expect_connection_close().await;
    assert_eq!(close.reply_code, 320);
    assert_eq!(
        close.reply_text.as_str(),
        "CONNECTION_FORCED - broker shutdown"
    );
    c.method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::CloseOk(connection::CloseOk {})),
    );
    c.flush().await;
    c.expect_eof().await;
}

#[tokio::test]
async fn a_dropped_shutdown_sender_does_not_end_connections() {
    let (stop, stopped) = watch::channel(false);
    let mut c = Client::open(AmqpConfig::default(), stopped).await;
    drop(stop);
    c.open_channel(1).await;
    c.open_channel(2).await;
}

#[tokio::test]
async fn a_client_close_crossing_ours_gets_close_ok() {
    let (_stop, stopped) = watch::channel(false);
    let mut c = Client::open(AmqpConfig::default(), stopped).await;
    // basic.ack on a channel never opened: 504 from the gateway.
    c.method(
        3,
        AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
            delivery_tag: 1,
            multiple: false,
        })),
    );
    c.flush().await;
    let close = c.expect_connection_close().await;
    assert_eq!(close.reply_code, 504);
    c.method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::Close(connection::Close {
            reply_code: 200,
            reply_text: "bye".into(),
            class_id: 0,
            method_id: 0,
        })),
    );
    c.flush().await;
    assert!(matches!(
        c.recv().await,
        Some(Frame::Method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::CloseOk(_))
        ))
    ));
    c.expect_eof().await;
}

#[tokio::test]
async fn a_channel_close_sent_before_the_client_saw_our_error_gets_close_ok() {
    // pika's and amqp091-go's race: a publish to a missing exchange and the client's
    // channel.close in one write reach the core together, so the close arrives after the
    // core closed the channel for the 404. The client waits for its close-ok (it used to
    // wait forever), then sends the close-ok to ours.
    let (_stop, stopped) = watch::channel(false);
    let mut c = Client::open(AmqpConfig::default(), stopped).await;
    for round in 0..3 {
        c.open_channel(1).await;
        c.method(
            1,
            AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
                exchange: "no-such-exchange".into(),
                routing_key: "k".into(),
                mandatory: false,
                immediate: false,
            })),
        );
        codec::encode_content(&mut c.out, 1, &Default::default(), &Bytes::new(), 131_072);
        c.method(
            1,
            AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
                reply_code: 200,
                reply_text: "bye".into(),
                class_id: 0,
                method_id: 0,
            })),
        );
        c.flush().await;
        match c.recv().await {
            Some(Frame::Method(1, AMQPClass::Channel(channel::AMQPMethod::Close(close)))) => {
                assert_eq!(close.reply_code, 404, "round {round}")
            }
            other => panic!("round {round}: expected channel.close 404, got {other:?}"),
        }
        let got = c.recv().await;
        assert!(
            matches!(
                got,
                Some(Frame::Method(
                    1,
                    AMQPClass::Channel(channel::AMQPMethod::CloseOk(_))
                ))
            ),
            "round {round}: expected channel.close-ok, got {got:?}"
        );
        c.method(
            1,
            AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
        );
    }
    // The connection is open, and channel 1 could be opened again each round.
    c.open_channel(2).await;
}

#[tokio::test]
async fn oversized_message_closes_its_channel_with_406_and_the_channel_can_reopen() {
    let (_stop, stopped) = watch::channel(false);
    let config = AmqpConfig {
        max_message_size: 1000,
        ..AmqpConfig::default()
    };
    let mut c = Client::open(config, stopped).await;
    c.open_channel(1).await;
    c.publish(1, "q", &[0u8; 1001]);
    c.flush().await;
    match c.recv().await {
        Some(Frame::Method(1, AMQPClass::Channel(channel::AMQPMethod::Close(close)))) => {
            assert_eq!(close.reply_code, 406);
            assert_eq!(
                close.reply_text.as_str(),
                "PRECONDITION_FAILED - message size 1001 is larger than configured max size 1000"
            );
            assert_eq!((close.class_id, close.method_id), (60, 40));
        }
        other => panic!("expected channel.close, got {other:?}"),
    }
    c.method(
        1,
        AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
    );
    c.open_channel(1).await;
    c.declare(1, "q").await;
}

#[tokio::test]
async fn a_broken_frame_is_refused_with_501_even_with_input_left_unread() {
    let (_stop, stopped) = watch::channel(false);
    let mut c = Client::open(AmqpConfig::default(), stopped).await;
    c.open_channel(1).await;
    // A body frame header announcing 1 MiB (over frame_max), followed by some of it.
    let mut bad = vec![codec::FRAME_BODY, 0, 1];
    bad.extend_from_slice(&(1u32 << 20).to_be_bytes());
    bad.extend_from_slice(&[0u8; 100_000]);
    c.s.write_all(&bad).await.expect("write");
    let close = c.expect_connection_close().await;
    assert_eq!(close.reply_code, 501);
    c.expect_eof().await;
}
