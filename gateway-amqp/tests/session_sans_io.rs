//! The AMQP session without a socket: byte sequences in, bytes and core ops out. Encoded
//! answers are pinned as insta snapshots (hex dumps plus the decoded frame); bad input gets
//! the protocol's answer, never a panic; and the output does not depend on how the input
//! bytes were split into reads (a proptest over random chunkings of one transcript).

use amq_protocol::frame::{AMQPContentHeader, AMQPFrame};
use amq_protocol::protocol::{
    AMQPClass, BasicProperties, basic, channel, confirm, connection, queue,
};
use amq_protocol::types::{FieldTable, LongString};
use bytes::{Bytes, BytesMut};
use proptest::prelude::*;
use std::sync::Arc;
use warren_amqp::codec::{self, Frame};
use warren_amqp::handshake::Login;
use warren_amqp::{AmqpConfig, Ended, Session};
use warren_core::command::Op;
use warren_core::command::OpKind;
use warren_core::effect::Effect;
use warren_core::error::{ErrorCode, ProtocolError};
use warren_core::ids::{ChannelRef, ConnId};

const FRAME_MAX: u32 = 4096;

fn hex(bytes: &[u8]) -> String {
    bytes
        .chunks(16)
        .map(|row| {
            row.iter()
                .map(|b| format!("{b:02x}"))
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The frames in `bytes`, decoded (as a client would).
fn frames(bytes: &[u8]) -> Vec<Frame> {
    let mut buf = BytesMut::from(bytes);
    let mut out = Vec::new();
    while let Some(f) = codec::decode(&mut buf, 1 << 20).expect("the server's frames decode") {
        out.push(f);
    }
    assert!(buf.is_empty(), "a partial frame in the output");
    out
}

/// Output as pinned in snapshots: each frame decoded, then the bytes.
fn transcript(bytes: &[u8]) -> String {
    let decoded: Vec<String> = frames(bytes).iter().map(|f| format!("{f:?}")).collect();
    format!("{}\n--\n{}", decoded.join("\n"), hex(bytes))
}

fn method(ch: u16, m: AMQPClass) -> Vec<u8> {
    let mut buf = BytesMut::new();
    codec::encode_method(&mut buf, ch, m);
    buf.to_vec()
}

fn header(ch: u16, size: u64) -> Vec<u8> {
    let mut buf = BytesMut::new();
    codec::encode_frame(
        &mut buf,
        &AMQPFrame::Header(
            ch,
            AMQPContentHeader {
                class_id: 60,
                body_size: size,
                properties: BasicProperties::default(),
            },
        ),
    );
    buf.to_vec()
}

fn body(ch: u16, bytes: &[u8]) -> Vec<u8> {
    let mut out = vec![3];
    out.extend_from_slice(&ch.to_be_bytes());
    out.extend_from_slice(&(bytes.len() as u32).to_be_bytes());
    out.extend_from_slice(bytes);
    out.push(0xCE);
    out
}

fn start_ok() -> Vec<u8> {
    method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::StartOk(connection::StartOk {
            client_properties: FieldTable::default(),
            mechanism: "PLAIN".into(),
            response: LongString::from("\0guest\0guest"),
            locale: "en_US".into(),
        })),
    )
}

fn tune_ok(heartbeat: u16) -> Vec<u8> {
    method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::TuneOk(connection::TuneOk {
            channel_max: 16,
            frame_max: FRAME_MAX,
            heartbeat,
        })),
    )
}

fn open() -> Vec<u8> {
    method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::Open(connection::Open {
            virtual_host: "/".into(),
        })),
    )
}

fn channel_open(ch: u16) -> Vec<u8> {
    method(
        ch,
        AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})),
    )
}

fn publish(ch: u16) -> Vec<u8> {
    method(
        ch,
        AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
            exchange: "".into(),
            routing_key: "q".into(),
            mandatory: false,
            immediate: false,
        })),
    )
}

fn connection_close_ok() -> Vec<u8> {
    method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::CloseOk(connection::CloseOk {})),
    )
}

/// A session driven by hand: every login check is granted unless told otherwise.
struct Driver {
    s: Session,
    input: BytesMut,
    now: u64,
    ops: Vec<(u16, Op)>,
}

impl Driver {
    fn new() -> Driver {
        let config = AmqpConfig {
            heartbeat_secs: 10,
            ..AmqpConfig::default()
        };
        Driver {
            s: Session::new(Arc::new(config), None, "test".into(), 0),
            input: BytesMut::new(),
            now: 0,
            ops: Vec::new(),
        }
    }

    /// Feeds bytes; grants login checks as they come.
    fn feed(&mut self, bytes: &[u8]) {
        self.input.extend_from_slice(bytes);
        self.s.handle_input(self.now, &mut self.input);
        while self.s.take_login().is_some() {
            self.s.on_login(self.now, Ok(()));
            self.s.handle_input(self.now, &mut self.input);
        }
        self.ops.extend(self.s.take_ops());
    }

    /// What the session wrote since the last call.
    fn out(&mut self) -> Vec<u8> {
        let out = self.s.output().to_vec();
        self.s.output_written(self.now);
        self.ops.extend(self.s.take_ops());
        out
    }

    /// An open connection (frame_max 4096, heartbeat `heartbeat` s) with channel 1 open.
    fn opened(heartbeat: u16) -> Driver {
        let mut d = Driver::new();
        d.feed(codec::PROTOCOL_HEADER);
        d.feed(&start_ok());
        d.feed(&tune_ok(heartbeat));
        d.feed(&open());
        d.feed(&channel_open(1));
        assert!(d.s.is_open());
        assert!(d.s.take_opened().is_some());
        d.out();
        d.ops.clear();
        d
    }

    fn op_names(&self) -> Vec<String> {
        self.ops
            .iter()
            .map(|(ch, op)| {
                let s = format!("{op:?}");
                let name = s.split([' ', '(', '{']).next().unwrap_or("").to_string();
                format!("{ch}:{name}")
            })
            .collect()
    }
}

#[test]
fn handshake_asks_for_two_login_checks_and_opens() {
    let mut s = Session::new(Arc::new(AmqpConfig::default()), None, "test".into(), 0);
    let mut input = BytesMut::new();
    // The header split over two reads.
    input.extend_from_slice(&codec::PROTOCOL_HEADER[..3]);
    s.handle_input(0, &mut input);
    assert!(s.output().is_empty());
    input.extend_from_slice(&codec::PROTOCOL_HEADER[3..]);
    s.handle_input(0, &mut input);
    let start = frames(s.output());
    assert!(matches!(
        start[..],
        [Frame::Method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Start(_))
        )]
    ));
    s.output_written(0);
    input.extend_from_slice(&start_ok());
    s.handle_input(0, &mut input);
    assert_eq!(
        s.take_login(),
        Some(Login {
            user: "guest".into(),
            password: Some("guest".into()),
            vhost: None
        })
    );
    // Input behind start-ok waits for the answer.
    input.extend_from_slice(&tune_ok(0));
    input.extend_from_slice(&open());
    input.extend_from_slice(&channel_open(1));
    s.handle_input(0, &mut input);
    assert!(s.output().is_empty());
    s.on_login(0, Ok(()));
    insta::assert_snapshot!("handshake_tune", transcript(s.output()));
    s.output_written(0);
    s.handle_input(0, &mut input);
    assert_eq!(s.take_login().and_then(|l| l.vhost), Some("/".to_string()));
    assert!(!s.is_open());
    s.on_login(0, Ok(()));
    s.handle_input(0, &mut input);
    insta::assert_snapshot!("handshake_open_ok", transcript(s.output()));
    assert!(s.is_open());
    let opened = s.take_opened().expect("opened once");
    assert_eq!((opened.frame_max, opened.heartbeat_secs), (FRAME_MAX, 0));
    let ops = s.take_ops();
    assert!(matches!(ops[0], (0, Op::ConnectionOpen { .. })));
    assert!(matches!(ops[1], (1, Op::ChannelOpen)));
    assert!(input.is_empty());
}

#[test]
fn a_foreign_protocol_header_gets_ours_and_the_end() {
    let mut s = Session::new(Arc::new(AmqpConfig::default()), None, "test".into(), 0);
    let mut input = BytesMut::from(&b"GET / HTTP/1.1\r\n"[..]);
    s.handle_input(0, &mut input);
    assert_eq!(s.output(), &codec::PROTOCOL_HEADER[..]);
    assert!(matches!(
        s.ended(),
        Some(Ended::Refused(ErrorCode::FrameError, _))
    ));
}

#[test]
fn a_refused_login_is_a_403_close() {
    let mut s = Session::new(Arc::new(AmqpConfig::default()), None, "test".into(), 0);
    let mut input = BytesMut::from(&codec::PROTOCOL_HEADER[..]);
    input.extend_from_slice(&start_ok());
    s.handle_input(0, &mut input);
    s.output_written(0);
    assert!(s.take_login().is_some());
    s.on_login(0, Err("invalid credentials".into()));
    insta::assert_snapshot!("login_refused", transcript(s.output()));
    assert!(matches!(
        s.ended(),
        Some(Ended::Refused(ErrorCode::AccessRefused, _))
    ));
}

#[test]
fn the_handshake_times_out() {
    let mut s = Session::new(Arc::new(AmqpConfig::default()), None, "test".into(), 0);
    assert_eq!(s.deadline(), Some(10_000));
    s.on_timeout(9_999);
    assert!(s.ended().is_none());
    s.on_timeout(10_000);
    assert_eq!(s.ended(), Some(&Ended::HandshakeTimeout));
}

/// A connection error: connection.close out, nothing more read until close-ok.
fn closes_with(d: &mut Driver, bad: &[u8], name: &str) {
    d.feed(bad);
    insta::assert_snapshot!(name, transcript(&d.out()));
    assert!(d.s.ended().is_none(), "waiting for close-ok");
    // A publish behind the error is not read.
    d.feed(&publish(1));
    d.feed(&header(1, 0));
    assert!(d.out().is_empty());
    assert!(!d.op_names().iter().any(|n| n.contains("Publish")));
    d.feed(&connection_close_ok());
    assert!(matches!(d.s.ended(), Some(Ended::Closed(_, _))));
}

#[test]
fn a_wrong_frame_end_octet_is_a_frame_error() {
    let mut d = Driver::opened(0);
    let mut bad = channel_open(2);
    *bad.last_mut().expect("a frame") = 0x00;
    d.input.extend_from_slice(&bad);
    d.s.handle_input(0, &mut d.input);
    insta::assert_snapshot!("bad_frame_end", transcript(&d.out()));
    // The input that no longer frames is discarded; close-ok still ends it.
    d.feed(&connection_close_ok());
    assert_eq!(
        d.s.ended(),
        Some(&Ended::Closed(
            501,
            "FRAME_ERROR - frame end byte 0x00 instead of 0xCE".into()
        ))
    );
}

#[test]
fn a_frame_over_frame_max_is_refused_from_its_header() {
    let mut d = Driver::opened(0);
    // Only the frame header: the size alone decides.
    let mut big = vec![3, 0, 1];
    big.extend_from_slice(&(FRAME_MAX).to_be_bytes());
    d.input.extend_from_slice(&big);
    d.s.handle_input(0, &mut d.input);
    insta::assert_snapshot!("frame_over_frame_max", transcript(&d.out()));
    d.feed(&connection_close_ok());
    assert!(matches!(d.s.ended(), Some(Ended::Closed(501, _))));
}

#[test]
fn a_method_on_a_channel_that_is_not_open_is_a_channel_error() {
    let mut d = Driver::opened(0);
    let declare = method(
        5,
        AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
            queue: "q".into(),
            ..Default::default()
        })),
    );
    closes_with(&mut d, &declare, "method_on_closed_channel");
}

#[test]
fn a_channel_closed_for_an_error_drops_all_but_its_close_handshake() {
    let mut d = Driver::opened(0);
    let ch = ChannelRef {
        conn: ConnId(1),
        channel: 1,
    };
    let error = ProtocolError::new(ErrorCode::NotFound, OpKind::QueueDeclare, "no queue 'x'");
    d.s.handle_effects(0, vec![Effect::ChannelError { ch, error }], || None);
    insta::assert_snapshot!("channel_error_close", transcript(&d.out()));
    // Dropped while closing: a publish and its content.
    d.feed(&publish(1));
    d.feed(&header(1, 0));
    assert!(d.ops.is_empty() && d.out().is_empty());
    d.feed(&method(
        1,
        AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
    ));
    assert_eq!(d.op_names(), ["1:ChannelCloseOk"]);
    // The channel is gone: a method on it now is a connection error (504).
    closes_with(&mut d, &publish(1), "method_on_closed_channel_after_error");
}

#[test]
fn closes_that_cross_wait_for_the_close_ok_to_ours() {
    let mut d = Driver::opened(0);
    let ch = ChannelRef {
        conn: ConnId(1),
        channel: 1,
    };
    let error = ProtocolError::new(ErrorCode::NotFound, OpKind::Publish, "no exchange 'x'");
    d.s.handle_effects(0, vec![Effect::ChannelError { ch, error }], || None);
    let _ = d.out();
    // The client's close crossed ours: it gets its close-ok, and the channel waits on.
    d.feed(&method(
        1,
        AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
            reply_code: 200,
            reply_text: "bye".into(),
            class_id: 0,
            method_id: 0,
        })),
    ));
    let out = frames(&d.out());
    assert!(
        matches!(
            out.as_slice(),
            [codec::Frame::Method(
                1,
                AMQPClass::Channel(channel::AMQPMethod::CloseOk(_))
            )]
        ),
        "{out:?}"
    );
    assert!(d.ops.is_empty());
    // The client's close-ok to ours ends the channel, and is no connection error.
    d.feed(&method(
        1,
        AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
    ));
    assert_eq!(d.op_names(), ["1:ChannelCloseOk"]);
    assert!(d.out().is_empty());
}

#[test]
fn a_body_without_its_header_is_an_unexpected_frame() {
    let mut d = Driver::opened(0);
    let mut bad = publish(1);
    bad.extend(body(1, b"hello"));
    closes_with(&mut d, &bad, "body_without_header");
}

#[test]
fn a_body_without_a_publish_is_an_unexpected_frame() {
    let mut d = Driver::opened(0);
    closes_with(&mut d, &body(1, b"hello"), "body_without_publish");
}

#[test]
fn a_heartbeat_on_a_channel_is_a_frame_error() {
    let mut d = Driver::opened(0);
    closes_with(&mut d, &[8, 0, 1, 0, 0, 0, 0, 0xCE], "heartbeat_on_channel");
}

#[test]
fn channel_flow_is_answered_by_the_gateway() {
    let mut d = Driver::opened(0);
    d.feed(&method(
        1,
        AMQPClass::Channel(channel::AMQPMethod::Flow(channel::Flow { active: false })),
    ));
    insta::assert_snapshot!("flow_ok", transcript(&d.out()));
    assert!(d.ops.is_empty());
}

#[test]
fn the_client_close_gets_close_ok() {
    let mut d = Driver::opened(0);
    d.feed(&method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::Close(connection::Close {
            reply_code: 200,
            reply_text: "bye".into(),
            class_id: 0,
            method_id: 0,
        })),
    ));
    insta::assert_snapshot!("client_close", transcript(&d.out()));
    assert_eq!(d.s.ended(), Some(&Ended::ClientClosed));
    assert_eq!(d.op_names(), ["0:ConnectionClose"]);
}

#[test]
fn an_unanswered_close_gives_up_after_three_seconds() {
    let mut d = Driver::opened(0);
    d.feed(&body(1, b"x"));
    d.out();
    assert_eq!(d.s.deadline(), Some(3_000));
    d.s.on_timeout(3_000);
    assert!(matches!(d.s.ended(), Some(Ended::Closed(505, _))));
}

#[test]
fn a_message_is_assembled_from_its_frames() {
    let mut d = Driver::opened(0);
    d.feed(&publish(1));
    d.feed(&header(1, 10));
    d.feed(&body(1, b"hello"));
    assert!(d.ops.is_empty());
    d.feed(&body(1, b"world"));
    let [(1, Op::Publish(p))] = &d.ops[..] else {
        panic!("one publish: {:?}", d.op_names())
    };
    assert_eq!(&p.body[..], b"helloworld");
    assert_eq!((&*p.exchange, &*p.routing_key), ("", "q"));
    // A body longer than announced is a connection error.
    d.ops.clear();
    d.feed(&publish(1));
    d.feed(&header(1, 3));
    d.feed(&body(1, b"four"));
    assert!(transcript(&d.out()).contains("longer than the 3 bytes"));
}

#[test]
fn heartbeats_are_deadlines() {
    let mut d = Driver::opened(10);
    assert_eq!(d.s.deadline(), Some(5_000));
    d.now = 5_000;
    d.s.on_timeout(d.now);
    assert_eq!(d.out(), [8, 0, 0, 0, 0, 0, 0, 0xCE]);
    // The client's heartbeats keep it alive.
    d.now = 19_000;
    d.feed(&[8, 0, 0, 0, 0, 0, 0, 0xCE]);
    d.now = 38_000;
    d.s.on_timeout(d.now);
    assert!(d.s.ended().is_none());
    d.out();
    d.now = 39_000;
    d.s.on_timeout(d.now);
    assert_eq!(d.s.ended(), Some(&Ended::MissedHeartbeats(10)));
}

fn conn_effect(f: fn(ConnId) -> Effect) -> Vec<Effect> {
    vec![f(ConnId(1))]
}

#[test]
fn a_publisher_is_blocked_and_unblocked() {
    let mut d = Driver::opened(0);
    // Not yet a publisher: an alarm does not stop reading (consumers ack to free memory).
    d.s.handle_effects(0, conn_effect(|conn| Effect::Blocked { conn }), || None);
    assert!(!d.s.read_paused());
    assert!(d.out().is_empty());
    d.feed(&publish(1));
    d.feed(&header(1, 0));
    assert!(d.s.read_paused());
    // This client announced no connection.blocked capability: no frame, only the pause.
    assert!(d.out().is_empty());
    d.s.handle_effects(0, conn_effect(|conn| Effect::Unblocked { conn }), || None);
    assert!(!d.s.read_paused());
    d.s.handle_effects(0, conn_effect(|conn| Effect::FlowPaused { conn }), || None);
    assert!(d.s.read_paused());
    d.s.handle_effects(0, conn_effect(|conn| Effect::FlowResumed { conn }), || None);
    assert!(!d.s.read_paused());
}

#[test]
fn in_order_confirms_collapse_into_one_multiple_ack() {
    let mut d = Driver::opened(0);
    d.feed(&method(
        1,
        AMQPClass::Confirm(confirm::AMQPMethod::Select(confirm::Select {
            nowait: false,
        })),
    ));
    let ch = ChannelRef {
        conn: ConnId(1),
        channel: 1,
    };
    let ack = |seq| Effect::Confirm {
        ch,
        seq,
        multiple: false,
        ack: true,
    };
    let mut later = vec![vec![ack(3)], vec![ack(4)]].into_iter();
    d.s.handle_effects(0, vec![ack(1), ack(2)], || later.next());
    insta::assert_snapshot!("acks_collapsed", transcript(&d.out()));
}

/// The shell hands `handle_effects` the first waiting batch of effects and a source of the
/// rest (the mailbox's `try_recv`), then writes and sends the ops. However many batches wait,
/// each is encoded once and every delivery in it counted in `Op::Written`: a batch taken and
/// then dropped (the 65th, when 64 are encoded per write) lost its messages, and their
/// write-window credit, never returned, stayed taken for good. Under a loaded machine
/// PerfTest's consumer connection leaked most of its window that way: it then got a few
/// deliveries per round trip while its publisher sat paused (issue 21, item 7).
#[test]
fn every_waiting_effect_batch_is_encoded_and_its_deliveries_counted() {
    let mut d = Driver::opened(0);
    let ch = ChannelRef {
        conn: ConnId(1),
        channel: 1,
    };
    let message = Arc::new(warren_core::message::Message {
        exchange: "".into(),
        routing_key: "q".into(),
        properties: Default::default(),
        body: Bytes::from_static(b"m"),
    });
    let deliver = |delivery_tag| Effect::Deliver {
        ch,
        consumer_tag: "c".into(),
        delivery: warren_core::effect::Delivery {
            delivery_tag,
            redelivered: false,
            message: message.clone(),
        },
    };
    // 200 one-delivery batches wait, as after 200 broker turns (one per publish) while
    // this connection's task waited for its socket or for a CPU.
    let mut waiting: std::collections::VecDeque<Vec<Effect>> =
        (1..=200).map(|tag| vec![deliver(tag)]).collect();
    let mut tags = Vec::new();
    // The shell's loop: one batch received, the session takes more, the output is written.
    while let Some(first) = waiting.pop_front() {
        d.s.handle_effects(0, first, || waiting.pop_front());
        for f in frames(&d.out()) {
            if let Frame::Method(1, AMQPClass::Basic(basic::AMQPMethod::Deliver(m))) = f {
                tags.push(m.delivery_tag);
            }
        }
    }
    assert_eq!(
        tags,
        (1..=200).collect::<Vec<u64>>(),
        "every delivery, once, in order"
    );
    let written: u32 = d
        .ops
        .iter()
        .map(|(_, op)| match op {
            Op::Written { count } => *count,
            _ => 0,
        })
        .sum();
    assert_eq!(written, 200, "the write window gets back every delivery");
}

/// One session transcript: handshake, a channel, a publish split over bodies, a heartbeat,
/// errors on a second channel, the close.
fn transcript_input() -> Vec<u8> {
    let mut t = Vec::new();
    t.extend_from_slice(codec::PROTOCOL_HEADER);
    t.extend(start_ok());
    t.extend(tune_ok(0));
    t.extend(open());
    t.extend(channel_open(1));
    for _ in 0..3 {
        t.extend(publish(1));
        t.extend(header(1, 12));
        t.extend(body(1, b"hello "));
        t.extend(body(1, b"world!"));
    }
    t.extend([8, 0, 0, 0, 0, 0, 0, 0xCE]);
    t.extend(channel_open(2));
    t.extend(method(
        2,
        AMQPClass::Channel(channel::AMQPMethod::Flow(channel::Flow { active: true })),
    ));
    t.extend(publish(2));
    t.extend(header(2, 0));
    t.extend(method(
        0,
        AMQPClass::Connection(connection::AMQPMethod::Close(connection::Close {
            reply_code: 200,
            reply_text: "bye".into(),
            class_id: 0,
            method_id: 0,
        })),
    ));
    t
}

/// Runs `input` split at `cuts`; returns bytes out and ops (as text).
fn run_chunked(input: &[u8], cuts: &[usize]) -> (Vec<u8>, Vec<String>) {
    let mut d = Driver::new();
    let mut out = Vec::new();
    let mut from = 0;
    for &cut in cuts.iter().chain(std::iter::once(&input.len())) {
        let cut = cut.clamp(from, input.len());
        d.feed(&input[from..cut]);
        out.extend(d.out());
        from = cut;
    }
    let ops = d.ops.iter().map(|o| format!("{o:?}")).collect();
    (out, ops)
}

proptest! {
    #[test]
    fn output_does_not_depend_on_how_input_is_split(
        mut cuts in proptest::collection::vec(0usize..1200, 0..40)
    ) {
        let input = transcript_input();
        cuts.sort_unstable();
        let whole = run_chunked(&input, &[]);
        prop_assert_eq!(run_chunked(&input, &cuts), whole);
    }

    /// Arbitrary bytes after an open handshake: an answer, never a panic, and input that
    /// frames is consumed.
    #[test]
    fn arbitrary_input_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
        let mut d = Driver::opened(10);
        d.feed(&bytes);
        let _ = d.out();
        d.s.on_timeout(100_000);
        let _ = d.out();
    }
}

#[test]
fn the_transcript_runs_to_the_client_close() {
    let (out, ops) = run_chunked(&transcript_input(), &[]);
    let decoded = frames(&out);
    assert!(matches!(
        decoded.last(),
        Some(Frame::Method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::CloseOk(_))
        ))
    ));
    assert_eq!(ops.iter().filter(|o| o.contains("Publish")).count(), 4);
    assert!(Bytes::from(out).len() > 100);
}
