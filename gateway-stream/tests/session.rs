//! The sans-IO session driven directly: bytes and time in, bytes, waits and deadlines out.

use bytes::{Bytes, BytesMut};
use std::sync::Arc;
use warren_stream::MemoryBackend;
use warren_stream::backend::PeerInfo;
use warren_stream::codec::{self, Entry, Frame, PublishedMessage};
use warren_stream::frame::{code, key, split_frame};
use warren_stream::session::{OutPart, Session, StreamConfig, Wait};

fn frames(s: &mut Session<MemoryBackend>) -> Vec<Frame> {
    // The in-memory backend hands out chunks in memory: bytes only.
    let mut out = BytesMut::new();
    for part in s.take_output() {
        match part {
            OutPart::Bytes(b) => out.extend_from_slice(&b),
            OutPart::File(r) => panic!("a file range from memory: {r:?}"),
        }
    }
    let mut v = Vec::new();
    while let Some(b) = split_frame(&mut out, 0).unwrap() {
        v.push(codec::decode(b).unwrap());
    }
    v
}

fn feed(s: &mut Session<MemoryBackend>, f: &Frame, now: u64) -> Vec<Frame> {
    let mut buf = BytesMut::from(&codec::to_bytes(f)[..]);
    s.handle_input(&mut buf, now);
    frames(s)
}

fn opened(heartbeat: u32) -> Session<MemoryBackend> {
    let peer = PeerInfo {
        addr: "test".into(),
        is_loopback: true,
        tls: false,
    };
    let mut s = Session::new(
        Arc::new(MemoryBackend::new()),
        Arc::new(StreamConfig::default()),
        peer,
        0,
    );
    feed(
        &mut s,
        &Frame::PeerProperties {
            corr: 1,
            properties: vec![],
        },
        0,
    );
    feed(&mut s, &Frame::SaslHandshake { corr: 2 }, 0);
    let f = feed(
        &mut s,
        &Frame::SaslAuthenticate {
            corr: 3,
            mechanism: "PLAIN".into(),
            data: Bytes::from_static(b"\0guest\0guest"),
        },
        0,
    );
    assert!(matches!(
        f[1],
        Frame::Tune {
            frame_max: 1048576,
            heartbeat: 60
        }
    ));
    feed(
        &mut s,
        &Frame::Tune {
            frame_max: 0,
            heartbeat,
        },
        0,
    );
    let f = feed(
        &mut s,
        &Frame::Open {
            corr: 4,
            vhost: "/".into(),
        },
        0,
    );
    assert!(matches!(f[0], Frame::OpenResponse { code: 1, .. }));
    assert!(s.is_open());
    s
}

#[test]
fn heartbeats_are_sent_when_idle_and_silence_closes() {
    let mut s = opened(10);
    s.flushed(1_000);
    assert_eq!(s.next_deadline(), Some(11_000));
    s.on_timer(11_000);
    assert_eq!(frames(&mut s), vec![Frame::Heartbeat]);
    s.flushed(11_000);
    // Nothing received since Open (t=0) for two intervals: the connection ends.
    s.on_timer(19_999);
    assert!(!s.is_closing());
    s.on_timer(20_000);
    assert!(s.is_closing());
}

#[test]
fn input_resets_the_heartbeat_timeout() {
    let mut s = opened(10);
    feed(&mut s, &Frame::Heartbeat, 15_000);
    s.on_timer(21_000);
    assert!(!s.is_closing());
}

#[test]
fn no_open_within_the_handshake_timeout_closes() {
    let peer = PeerInfo::default();
    let mut s = Session::new(
        Arc::new(MemoryBackend::new()),
        Arc::new(StreamConfig::default()),
        peer,
        0,
    );
    assert_eq!(s.next_deadline(), Some(10_000));
    s.on_timer(9_999);
    assert!(!s.is_closing());
    s.on_timer(10_000);
    assert!(s.is_closing());
}

#[test]
fn confirms_wait_for_durability_and_duplicates_wait_with_them() {
    let mut s = opened(0);
    feed(
        &mut s,
        &Frame::Create {
            corr: 5,
            stream: "d".into(),
            arguments: vec![],
        },
        0,
    );
    let f = feed(
        &mut s,
        &Frame::DeclarePublisher {
            corr: 6,
            publisher_id: 1,
            reference: "w".into(),
            stream: "d".into(),
        },
        0,
    );
    assert_eq!(
        f,
        vec![Frame::Response {
            key: key::DECLARE_PUBLISHER,
            corr: 6,
            code: code::OK
        }]
    );
    let msg = |id| PublishedMessage {
        publishing_id: id,
        filter_value: None,
        entry: Entry::Simple(Bytes::from_static(b"m")),
    };
    let f = feed(
        &mut s,
        &Frame::Publish {
            v2: false,
            publisher_id: 1,
            messages: vec![msg(1), msg(2)],
        },
        0,
    );
    assert!(f.is_empty(), "no confirm before the data is durable");
    assert_eq!(
        s.take_waits(),
        vec![
            // The publisher's stream is watched for its deletion (a MetadataUpdate then).
            Wait::Deleted {
                vhost: "/".into(),
                stream: "d".into(),
            },
            Wait::Durable {
                vhost: "/".into(),
                stream: "d".into(),
                offset: 1
            }
        ]
    );
    // A re-sent id while the first copy is not durable yet: not stored, not confirmed yet.
    let f = feed(
        &mut s,
        &Frame::Publish {
            v2: false,
            publisher_id: 1,
            messages: vec![msg(2), msg(3)],
        },
        0,
    );
    assert!(f.is_empty());
    assert!(
        s.take_waits().is_empty(),
        "one durability wait per stream at a time"
    );
    s.durable("/", "d", 1, Ok(()));
    assert_eq!(
        frames(&mut s),
        vec![Frame::PublishConfirm {
            publisher_id: 1,
            publishing_ids: vec![1, 2]
        }]
    );
    assert_eq!(
        s.take_waits(),
        vec![Wait::Durable {
            vhost: "/".into(),
            stream: "d".into(),
            offset: 2
        }]
    );
    s.durable("/", "d", 2, Ok(()));
    assert_eq!(
        frames(&mut s),
        vec![Frame::PublishConfirm {
            publisher_id: 1,
            publishing_ids: vec![2, 3]
        }]
    );
    // Offsets 0..3 hold 1, 2, 3 once each.
    let f = feed(
        &mut s,
        &Frame::QueryPublisherSequence {
            corr: 7,
            reference: "w".into(),
            stream: "d".into(),
        },
        0,
    );
    assert_eq!(
        f,
        vec![Frame::QueryPublisherSequenceResponse {
            corr: 7,
            code: 1,
            sequence: 3
        }]
    );
}

/// Publish frames made durable by one group commit are confirmed in one PublishConfirm per
/// run of one publisher (as RabbitMQ does), in publish order, not one frame per Publish.
#[test]
fn frames_durable_together_are_confirmed_in_one_frame_per_publisher_run() {
    let mut s = opened(0);
    feed(
        &mut s,
        &Frame::Create {
            corr: 5,
            stream: "d".into(),
            arguments: vec![],
        },
        0,
    );
    for (corr, id) in [(6, 1u8), (7, 2)] {
        feed(
            &mut s,
            &Frame::DeclarePublisher {
                corr,
                publisher_id: id,
                reference: String::new(),
                stream: "d".into(),
            },
            0,
        );
    }
    let msg = |id| PublishedMessage {
        publishing_id: id,
        filter_value: None,
        entry: Entry::Simple(Bytes::from_static(b"m")),
    };
    // Publisher 1: ids 1, 2, 3 in three frames; publisher 2: id 10; publisher 1: id 4.
    for (p, id) in [(1u8, 1u64), (1, 2), (1, 3), (2, 10), (1, 4)] {
        let f = feed(
            &mut s,
            &Frame::Publish {
                v2: false,
                publisher_id: p,
                messages: vec![msg(id)],
            },
            0,
        );
        assert!(f.is_empty());
    }
    s.durable("/", "d", 4, Ok(()));
    assert_eq!(
        frames(&mut s),
        vec![
            Frame::PublishConfirm {
                publisher_id: 1,
                publishing_ids: vec![1, 2, 3]
            },
            Frame::PublishConfirm {
                publisher_id: 2,
                publishing_ids: vec![10]
            },
            Frame::PublishConfirm {
                publisher_id: 1,
                publishing_ids: vec![4]
            },
        ]
    );
}

#[test]
fn credit_is_per_chunk_and_an_empty_stream_waits() {
    let mut s = opened(0);
    feed(
        &mut s,
        &Frame::Create {
            corr: 5,
            stream: "c".into(),
            arguments: vec![],
        },
        0,
    );
    feed(
        &mut s,
        &Frame::DeclarePublisher {
            corr: 6,
            publisher_id: 0,
            reference: String::new(),
            stream: "c".into(),
        },
        0,
    );
    for i in 0..3u64 {
        let m = PublishedMessage {
            publishing_id: i,
            filter_value: None,
            entry: Entry::Simple(Bytes::from_static(b"m")),
        };
        feed(
            &mut s,
            &Frame::Publish {
                v2: false,
                publisher_id: 0,
                messages: vec![m.clone(), m],
            },
            0,
        );
    }
    let _ = s.take_waits();
    let f = feed(
        &mut s,
        &Frame::Subscribe {
            corr: 8,
            subscription_id: 2,
            stream: "c".into(),
            offset: codec::OffsetSpec::First,
            credit: 2,
            properties: vec![],
        },
        0,
    );
    assert_eq!(f.len(), 3, "the OK and two chunks: {f:?}");
    assert!(
        s.take_waits().is_empty(),
        "out of credit, not waiting for data"
    );
    let f = feed(
        &mut s,
        &Frame::Credit {
            subscription_id: 2,
            credit: 5,
        },
        0,
    );
    assert_eq!(f.len(), 1, "the third chunk");
    let w = s.take_waits();
    assert!(
        matches!(
            w[..],
            [Wait::Data {
                from: 6,
                subscription_id: 2,
                ..
            }]
        ),
        "{w:?}"
    );
}

#[test]
fn a_full_outgoing_buffer_stops_reading_and_delivering_until_written() {
    let peer = PeerInfo {
        addr: "test".into(),
        is_loopback: true,
        tls: false,
    };
    let config = StreamConfig {
        out_high_water: 300,
        ..StreamConfig::default()
    };
    let mut s = Session::new(Arc::new(MemoryBackend::new()), Arc::new(config), peer, 0);
    feed(
        &mut s,
        &Frame::PeerProperties {
            corr: 1,
            properties: vec![],
        },
        0,
    );
    feed(&mut s, &Frame::SaslHandshake { corr: 2 }, 0);
    feed(
        &mut s,
        &Frame::SaslAuthenticate {
            corr: 3,
            mechanism: "PLAIN".into(),
            data: Bytes::from_static(b"\0guest\0guest"),
        },
        0,
    );
    feed(
        &mut s,
        &Frame::Tune {
            frame_max: 0,
            heartbeat: 0,
        },
        0,
    );
    feed(
        &mut s,
        &Frame::Open {
            corr: 4,
            vhost: "/".into(),
        },
        0,
    );
    feed(
        &mut s,
        &Frame::Create {
            corr: 5,
            stream: "b".into(),
            arguments: vec![],
        },
        0,
    );
    feed(
        &mut s,
        &Frame::DeclarePublisher {
            corr: 6,
            publisher_id: 0,
            reference: String::new(),
            stream: "b".into(),
        },
        0,
    );
    let big = Bytes::from(vec![7u8; 200]);
    for i in 0..5u64 {
        let m = PublishedMessage {
            publishing_id: i,
            filter_value: None,
            entry: Entry::Simple(big.clone()),
        };
        feed(
            &mut s,
            &Frame::Publish {
                v2: false,
                publisher_id: 0,
                messages: vec![m],
            },
            0,
        );
    }
    // Subscribe with credit for all five chunks, plus a request queued behind it.
    let mut buf = BytesMut::new();
    codec::encode(
        &Frame::Subscribe {
            corr: 8,
            subscription_id: 1,
            stream: "b".into(),
            offset: codec::OffsetSpec::First,
            credit: 5,
            properties: vec![],
        },
        &mut buf,
    );
    codec::encode(
        &Frame::QueryOffset {
            corr: 9,
            reference: "r".into(),
            stream: "b".into(),
        },
        &mut buf,
    );
    s.handle_input(&mut buf, 0);
    assert!(!s.wants_read(), "over the high water mark");
    assert!(!buf.is_empty(), "the next frame waits in the read buffer");
    let delivered = |f: &[Frame]| {
        f.iter()
            .filter(|f| matches!(f, Frame::Deliver { .. }))
            .count()
    };
    let first = frames(&mut s);
    assert_eq!(
        delivered(&first),
        2,
        "deliveries stop at the mark: {first:?}"
    );
    // Written: room again, deliveries resume, then the queued frame is read.
    s.flushed(1);
    assert_eq!(delivered(&frames(&mut s)), 2);
    s.flushed(2);
    s.handle_input(&mut buf, 2);
    let last = frames(&mut s);
    assert_eq!(delivered(&last), 1);
    assert!(matches!(
        last.last(),
        Some(Frame::QueryOffsetResponse {
            corr: 9,
            code: 0x13,
            ..
        })
    ));
}
