//! The decoder never panics and never loops on arbitrary bytes (the fuzz target's property,
//! run in CI), and the session survives arbitrary decoded packets: bad input ends in an error
//! for that connection, nothing else.

use bytes::BytesMut;
use proptest::prelude::*;
use std::sync::Arc;
use warren_mqtt::codec;
use warren_mqtt::session::{Session, check_connect};

fn drain(bytes: &[u8], level: Option<u8>, max: usize) -> Vec<codec::Decoded> {
    let mut buf = BytesMut::from(bytes);
    let mut out = Vec::new();
    while let Ok(Some(p)) = codec::decode(&mut buf, level, max) {
        out.push(p);
        assert!(out.len() <= bytes.len(), "every packet consumes bytes");
    }
    out
}

/// Valid packets to mutate: CONNECT v4/v5, PUBLISH, SUBSCRIBE (v3/v5), PINGREQ.
fn seeds() -> Vec<Vec<u8>> {
    vec![
        vec![
            0x10, 0x10, 0x00, 0x04, b'M', b'Q', b'T', b'T', 0x04, 0x02, 0x00, 0x3c, 0x00, 0x04,
            b't', b'e', b's', b't',
        ],
        vec![
            0x10, 0x11, 0x00, 0x04, b'M', b'Q', b'T', b'T', 0x05, 0x02, 0x00, 0x3c, 0x00, 0x00,
            0x04, b't', b'e', b's', b't',
        ],
        vec![0x32, 0x08, 0x00, 0x03, b'a', b'/', b'b', 0x00, 0x01, b'x'],
        vec![0x82, 0x08, 0x00, 0x01, 0x00, 0x03, b'a', b'/', b'#', 0x01],
        vec![
            0x82, 0x09, 0x00, 0x01, 0x00, 0x00, 0x03, b'a', b'/', b'+', 0x2d,
        ],
        vec![0xC0, 0x00],
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes(data in prop::collection::vec(any::<u8>(), 0..512)) {
        for level in [None, Some(3), Some(4), Some(5)] {
            for max in [16, 1 << 20] {
                drain(&data, level, max);
            }
        }
    }

    #[test]
    fn mutated_valid_packets(seed in 0usize..6, flips in prop::collection::vec((any::<usize>(), any::<u8>()), 1..4), cut in any::<usize>()) {
        let mut bytes = seeds()[seed].clone();
        for (i, b) in flips {
            let n = bytes.len();
            bytes[i % n] = b;
        }
        bytes.truncate(cut % (bytes.len() + 1));
        let config = Arc::new(warren_mqtt::MqttConfig::default());
        for level in [4u8, 5] {
            let mut c = mqtt_proto::v5::Connect::new(Arc::from("fuzz"), 30);
            c.protocol = if level == 5 { mqtt_proto::Protocol::V500 } else { mqtt_proto::Protocol::V311 };
            let info = check_connect(&c, true, &config, || "x".into()).expect("accepted");
            let mut s = Session::new(info, None, 0, config.clone());
            for p in drain(&bytes, Some(level), 1 << 20) {
                if s.handle(1, p).is_err() {
                    break;
                }
            }
            s.take_packets();
            s.take_ops();
        }
    }

    /// The gateway decodes v3 PUBLISH itself (the hot path): whatever the flags, topic, packet
    /// id and payload, it accepts what `mqtt-proto`'s v3 decoder accepts, as the same packet,
    /// and refuses what it refuses.
    #[test]
    fn v3_publish_decodes_as_mqtt_proto_does(
        flags in 0u8..16,
        topic in prop::collection::vec(prop_oneof![Just(b'a'), Just(b'/'), Just(b'+'), Just(b'#'), Just(0u8), Just(0xC3), Just(0xA9), Just(0xFF)], 0..6),
        topic_len_delta in -2i32..3,
        body in prop::collection::vec(any::<u8>(), 0..8),
    ) {
        let mut rest = Vec::new();
        let declared = (topic.len() as i32 + topic_len_delta).max(0) as u16;
        rest.extend_from_slice(&declared.to_be_bytes());
        rest.extend_from_slice(&topic);
        rest.extend_from_slice(&body);
        let mut frame = vec![0x30 | flags, rest.len() as u8];
        frame.extend_from_slice(&rest);
        let mut buf = BytesMut::from(&frame[..]);
        let ours = codec::decode(&mut buf, Some(4), 1 << 20);
        let theirs = mqtt_proto::v3::Packet::decode(&frame);
        match (ours, theirs) {
            (Ok(Some(codec::Decoded::Packet(mqtt_proto::v5::Packet::Publish(a)))), Ok(Some(mqtt_proto::v3::Packet::Publish(b)))) => {
                prop_assert_eq!((a.dup, a.retain, a.qos_pid, &*a.topic_name, &a.payload), (b.dup, b.retain, b.qos_pid, &*b.topic_name, &b.payload));
                prop_assert_eq!(a.properties, Default::default());
                prop_assert!(buf.is_empty());
            }
            (Err(_), Err(_) | Ok(None)) => {}
            (a, b) => prop_assert!(false, "gateway {a:?}, mqtt-proto {b:?}"),
        }
    }
}
