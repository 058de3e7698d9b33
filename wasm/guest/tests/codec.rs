//! The op/effect encoding: pinned bytes for the documented layout, lossless round trips over
//! random scenarios, and clean errors (never panics) on malformed input.

use std::sync::Arc;
use warren_core::command::Op;
use warren_core::effect::Effect;
use warren_core::ids::{ChannelRef, ConnId};
use warren_guest::GuestBroker;
use warren_guest::codec::{
    DecodeError, Decoded, decode_effects, decode_op, encode_effects, encode_op,
};
use warren_guest::scenario::Scenario;

fn op_bytes(op: &Op) -> Vec<u8> {
    let mut out = Vec::new();
    encode_op(op, &mut out);
    out
}

#[test]
fn documented_bytes_are_pinned() {
    // docs/wasm-abi.md quotes these; change both together (and bump ABI_VERSION).
    assert_eq!(
        op_bytes(&Op::Ack {
            delivery_tag: 5,
            multiple: true
        }),
        [0x14, 5, 0, 0, 0, 0, 0, 0, 0, 1]
    );
    assert_eq!(
        op_bytes(&Op::Nack {
            delivery_tag: 0x0102,
            multiple: false,
            requeue: true
        }),
        [0x15, 2, 1, 0, 0, 0, 0, 0, 0, 0b10]
    );
    assert_eq!(
        op_bytes(&Op::QueuePurge {
            queue: "q".into(),
            nowait: false
        }),
        [0x0d, 1, 0, 0, 0, b'q', 0]
    );
    let mut out = Vec::new();
    encode_effects(
        &[Effect::Confirm {
            ch: ChannelRef::new(ConnId(7), 2),
            seq: 3,
            multiple: false,
            ack: true,
        }],
        &mut out,
    );
    assert_eq!(
        out,
        [
            1, 0, 0, 0, // count
            0x04, 7, 0, 0, 0, 0, 0, 0, 0, 2, 0, // Confirm, conn 7, channel 2
            3, 0, 0, 0, 0, 0, 0, 0, 0b10 // seq 3, ack
        ]
    );
}

/// Every op a scenario produces and every effect batch the core answers with survives an
/// encode/decode round trip unchanged.
#[test]
fn scenarios_round_trip() {
    let mut ops = 0;
    let mut effects = 0;
    for seed in 0..200 {
        let mut sc = Scenario::new(seed);
        let mut g = GuestBroker::new(seed);
        for _ in 0..300 {
            let step = sc.next_step();
            let bytes = op_bytes(&step.op);
            assert_eq!(decode_op(&bytes).as_ref(), Ok(&step.op), "seed {seed}");
            g.handle(step.now, step.conn, step.channel.into(), &bytes)
                .expect("a valid op");
            let batch = g.poll_effects().to_vec();
            let decoded = decode_effects(&batch).expect("a valid batch");
            let plain: Vec<Effect> = decoded
                .iter()
                .map(|d| match d {
                    Decoded::Effect(e) => e.clone(),
                    Decoded::Unknown(s) => panic!("encoder missed an effect: {s}"),
                })
                .collect();
            let mut again = Vec::new();
            encode_effects(&plain, &mut again);
            assert_eq!(again, batch, "seed {seed}");
            sc.observe(&decoded);
            ops += 1;
            effects += plain.len();
        }
        g.check_invariants().expect("invariants");
    }
    // The scenario must actually exercise the broker, not just bounce off errors.
    assert!(effects * 2 > ops, "{effects} effects for {ops} ops");
}

/// The scenario reaches the interesting paths (guards against a generator that silently
/// stops producing deliveries or errors after a refactor).
#[test]
fn scenarios_cover_the_message_path() {
    let mut seen = std::collections::BTreeMap::<&str, usize>::new();
    for seed in 0..50 {
        let mut sc = Scenario::new(seed);
        let mut g = GuestBroker::new(seed);
        for _ in 0..300 {
            let step = sc.next_step();
            g.handle(
                step.now,
                step.conn,
                step.channel.into(),
                &op_bytes(&step.op),
            )
            .expect("a valid op");
            let decoded = decode_effects(g.poll_effects()).expect("a valid batch");
            for d in &decoded {
                let Decoded::Effect(e) = d else { continue };
                let name = match e {
                    Effect::Deliver { delivery, .. } if delivery.redelivered => "redeliver",
                    Effect::Deliver { .. } => "deliver",
                    Effect::Return { .. } => "return",
                    Effect::Confirm { .. } => "confirm",
                    Effect::ChannelError { .. } => "channel error",
                    Effect::ConnectionError { .. } => "connection error",
                    Effect::ConsumerCancelled { .. } => "cancelled",
                    Effect::Reply { .. } => "reply",
                    _ => "other",
                };
                *seen.entry(name).or_default() += 1;
            }
            sc.observe(&decoded);
        }
    }
    for want in [
        "deliver",
        "redeliver",
        "return",
        "confirm",
        "channel error",
        "connection error",
        "cancelled",
    ] {
        assert!(
            seen.get(want).copied().unwrap_or(0) > 0,
            "no {want}: {seen:?}"
        );
    }
}

#[test]
fn malformed_input_is_an_error_not_a_panic() {
    assert_eq!(decode_op(&[]), Err(DecodeError::Truncated { at: 0 }));
    assert!(matches!(
        decode_op(&[0xee]),
        Err(DecodeError::BadTag { what: "op", .. })
    ));
    assert_eq!(
        decode_op(&[0x02, 0]),
        Err(DecodeError::Trailing { extra: 1 })
    );
    // A string length far beyond the buffer.
    assert!(matches!(
        decode_op(&[0x0d, 0xff, 0xff, 0xff, 0xff]),
        Err(DecodeError::Truncated { .. })
    ));
    // Invalid UTF-8 in a queue name.
    assert!(matches!(
        decode_op(&[0x0d, 1, 0, 0, 0, 0xff, 0]),
        Err(DecodeError::BadUtf8 { .. })
    ));
    // Undefined flag bits.
    assert!(matches!(
        decode_op(&[0x15, 1, 0, 0, 0, 0, 0, 0, 0, 0b100]),
        Err(DecodeError::BadTag { what: "flags", .. })
    ));
    // Arrays nested 100 deep in a queue.declare argument table.
    let mut op = vec![0x0a, 0, 0, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, b'k'];
    for _ in 0..100 {
        op.extend_from_slice(&[14, 1, 0, 0, 0]);
    }
    op.push(0);
    assert_eq!(decode_op(&op), Err(DecodeError::TooDeep));
    // Every prefix of a valid publish fails cleanly.
    let publish = op_bytes(&Op::Publish(Box::new(warren_core::command::Publish {
        exchange: Arc::from("x"),
        routing_key: Arc::from("k"),
        mandatory: true,
        immediate: false,
        properties: warren_core::message::Properties {
            content_type: Some("text/plain".into()),
            headers: Some([("a".to_string(), warren_core::message::FieldValue::I32(-1))].into()),
            timestamp: Some(9),
            ..Default::default()
        },
        body: bytes::Bytes::from_static(b"hello"),
        routed: None,
    })));
    assert!(decode_op(&publish).is_ok());
    for n in 0..publish.len() {
        assert!(decode_op(&publish[..n]).is_err(), "prefix {n}");
    }
}

#[test]
fn guest_rejects_bad_ops_without_touching_state() {
    let mut g = GuestBroker::new(1);
    assert_eq!(g.handle(1, 1, 0, &[0xee]).map_err(|e| e.status()), Err(-1));
    assert_eq!(
        g.handle(1, 1, 70_000, &op_bytes(&Op::ChannelOpen))
            .map_err(|e| e.status()),
        Err(-2)
    );
    assert_eq!(g.poll_effects(), [0, 0, 0, 0]);
}

/// Policy changes (`warren_policy`): the documented bytes, round trips of every change a
/// scenario makes, a refused policy leaving the broker as it was, and malformed input
/// refused without a panic.
#[test]
fn policy_changes_round_trip_and_apply() {
    use warren_guest::codec::{PolicyChange, decode_policy, encode_policy};
    let clear = PolicyChange::Clear {
        vhost: "/".into(),
        name: "p".into(),
    };
    let mut out = Vec::new();
    encode_policy(&clear, &mut out);
    assert_eq!(out, [0x02, 1, 0, 0, 0, b'/', 1, 0, 0, 0, b'p']);
    let mut seen = 0;
    for seed in 0..50 {
        let mut sc = Scenario::new(seed);
        for _ in 0..200 {
            if let Some(change) = sc.next_policy() {
                out.clear();
                encode_policy(&change, &mut out);
                assert_eq!(decode_policy(&out), Ok(change));
                for cut in 0..out.len() {
                    assert!(decode_policy(&out[..cut]).is_err());
                }
                seen += 1;
            }
            sc.next_step();
        }
    }
    assert!(seen > 50, "scenarios made {seen} policy changes");
    let mut b = GuestBroker::new(1);
    assert!(matches!(b.policy(1, &[0x09]), Err(e) if e.status() == -1));
    out.clear();
    encode_policy(&clear, &mut out);
    assert!(
        !b.policy(1, &out).expect("decodes"),
        "no policy 'p' to clear"
    );
}

/// The retained-message ops and replies (ABI 3) round-trip, and a QoS above 2 is refused.
#[test]
fn retained_ops_and_replies_round_trip() {
    use warren_core::effect::Reply;
    use warren_core::mqtt::RetainedMessage;
    let m = RetainedMessage {
        topic: Arc::from("a/b"),
        qos: 2,
        payload: bytes::Bytes::from_static(b"p"),
        properties: Default::default(),
        stored_at: 9,
        expiry_ms: Some(5),
    };
    let retain = Op::Retain {
        message: Box::new(m.clone()),
        durable: true,
    };
    assert_eq!(decode_op(&op_bytes(&retain)).expect("decodes"), retain);
    let get = Op::RetainedGet {
        filter: "a/#".into(),
        max: 3,
    };
    assert_eq!(
        op_bytes(&get),
        [0x1f, 3, 0, 0, 0, b'a', b'/', b'#', 3, 0, 0, 0]
    );
    assert_eq!(decode_op(&op_bytes(&get)).expect("decodes"), get);
    let ch = ChannelRef::new(ConnId(1), 1);
    let effects = vec![
        Effect::Reply {
            ch,
            reply: Reply::RetainOk { stored: false },
        },
        Effect::Reply {
            ch,
            reply: Reply::Retained {
                messages: vec![
                    m.clone(),
                    RetainedMessage {
                        expiry_ms: None,
                        ..m
                    },
                ],
            },
        },
    ];
    let mut out = Vec::new();
    encode_effects(&effects, &mut out);
    let back: Vec<Effect> = decode_effects(&out)
        .expect("decodes")
        .into_iter()
        .map(|d| match d {
            Decoded::Effect(e) => e,
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(back, effects);
    // QoS 3 (byte 1 + 4 + 3 = after the topic) is refused, not taken.
    let mut bad = op_bytes(&retain);
    bad[1 + 4 + 3] = 3;
    assert!(decode_op(&bad).is_err());
}
