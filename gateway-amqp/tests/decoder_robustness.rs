//! The frame decoder under hostile input: it must answer "frame", "need more" or an error,
//! never panic, and refuse an oversized frame from its header alone.

use amq_protocol::protocol::{AMQPClass, basic};
use bytes::BytesMut;
use proptest::prelude::*;
use warren_amqp::codec;

fn valid_frames() -> Vec<u8> {
    let mut buf = BytesMut::new();
    codec::encode_method(
        &mut buf,
        1,
        AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
            exchange: "amq.direct".into(),
            routing_key: "k".into(),
            mandatory: false,
            immediate: false,
        })),
    );
    codec::encode_content(
        &mut buf,
        1,
        &warren_core::message::Properties {
            content_type: Some("text/plain".into()),
            ..Default::default()
        },
        &bytes::Bytes::from_static(b"hello"),
        4096,
    );
    buf.to_vec()
}

/// Decodes until the input is exhausted or rejected; returns frames decoded.
fn drain(input: &[u8]) -> usize {
    let mut buf = BytesMut::from(input);
    let mut frames = 0;
    while let Ok(Some(_)) = codec::decode(&mut buf, 131_072) {
        frames += 1;
    }
    frames
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes_never_panic(input in prop::collection::vec(any::<u8>(), 0..512)) {
        drain(&input);
    }

    #[test]
    fn mutated_valid_frames_never_panic(
        flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in any::<prop::sample::Index>(),
    ) {
        let mut input = valid_frames();
        for (at, byte) in flips {
            let i = at.index(input.len());
            input[i] = byte;
        }
        let end = cut.index(input.len() + 1);
        drain(&input[..end]);
    }

    #[test]
    fn every_prefix_of_valid_frames_is_incomplete_not_an_error(cut in any::<prop::sample::Index>()) {
        let input = valid_frames();
        let end = cut.index(input.len());
        let mut buf = BytesMut::from(&input[..end]);
        loop {
            match codec::decode(&mut buf, 131_072) {
                Ok(Some(_)) => continue,
                Ok(None) => break,
                Err(e) => prop_assert!(false, "valid prefix rejected: {e}"),
            }
        }
    }
}

#[test]
fn valid_frames_decode() {
    assert_eq!(drain(&valid_frames()), 3);
}

#[test]
fn oversized_frame_is_refused_from_its_header() {
    // A body frame claiming 1 GiB: refused with only its 7 header bytes present.
    let mut buf = BytesMut::from(&[3u8, 0, 1, 0x40, 0, 0, 0][..]);
    let err = codec::decode(&mut buf, 131_072).expect_err("oversized");
    assert!(err.to_string().starts_with("FRAME_ERROR"), "{err}");
    assert!(
        buf.capacity() < 1024 * 1024,
        "nothing was reserved for the claimed payload"
    );
}

#[test]
fn bad_frame_end_is_a_frame_error() {
    let mut frames = valid_frames();
    let end = frames.iter().position(|&b| b == 0xCE).expect("frame end");
    frames[end] = 0x00;
    let err = codec::decode(&mut BytesMut::from(&frames[..]), 131_072).expect_err("bad end");
    assert!(err.to_string().contains("frame end"), "{err}");
}
