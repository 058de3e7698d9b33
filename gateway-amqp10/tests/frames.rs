//! Every frame the gateway encodes, pinned byte for byte (insta snapshots of hex dumps), and
//! each decoded back to what went in; plus frames written by hand from the spec's layout, as
//! a client sends them, decoded.

use bytes::{Bytes, BytesMut};
use warren_amqp10::frame::{self, Body, encode_heartbeat, encode_sasl};
use warren_amqp10::performatives::{
    Attach, Begin, DeliveryState, Detach, Disposition, Error, Flow, Open, Performative, Role, Sasl,
    Source, Target, Transfer, condition,
};
use warren_amqp10::types::Value;

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

/// Encodes `p`, checks it decodes back to itself (with `payload`), returns the hex dump.
fn amqp(channel: u16, p: Performative, payload: &[u8]) -> String {
    let mut buf = BytesMut::new();
    frame::encode_frame(&mut buf, channel, &p, payload).expect("encodes");
    let wire = buf.clone();
    let raw = frame::decode_frame(&mut buf, u32::MAX)
        .expect("decodes")
        .expect("whole frame");
    assert!(buf.is_empty(), "one frame, all consumed");
    assert_eq!(raw.channel, channel);
    assert_eq!(
        raw.body().expect("body"),
        Body::Amqp(p, Bytes::copy_from_slice(payload))
    );
    hex(&wire)
}

fn sasl(s: Sasl) -> String {
    let mut buf = BytesMut::new();
    encode_sasl(&mut buf, &s).expect("encodes");
    let wire = buf.clone();
    let raw = frame::decode_frame(&mut buf, 512)
        .expect("decodes")
        .expect("whole");
    assert_eq!(raw.body().expect("body"), Body::Sasl(s));
    hex(&wire)
}

fn open() -> Open {
    Open {
        container_id: "warren".into(),
        hostname: Some("vhost:/".into()),
        max_frame_size: 131_072,
        channel_max: 255,
        idle_time_out: Some(30_000),
        outgoing_locales: vec![],
        incoming_locales: vec![],
        offered_capabilities: vec!["ANONYMOUS-RELAY".into()],
        desired_capabilities: vec![],
        properties: Some(Value::Map(vec![
            (Value::symbol("product"), Value::String("RabbitMQ".into())),
            (Value::symbol("version"), Value::String("4.0.0".into())),
        ])),
    }
}

#[test]
fn open_begin_close() {
    insta::assert_snapshot!("open", amqp(0, Performative::Open(Box::new(open())), b""));
    insta::assert_snapshot!(
        "begin",
        amqp(
            1,
            Performative::Begin(Begin {
                remote_channel: Some(0),
                next_outgoing_id: 0,
                incoming_window: 2048,
                outgoing_window: u32::MAX,
                handle_max: 255,
                offered_capabilities: vec![],
                desired_capabilities: vec![],
                properties: None,
            }),
            b""
        )
    );
    insta::assert_snapshot!("end", amqp(1, Performative::End(None), b""));
    insta::assert_snapshot!(
        "close_error",
        amqp(
            0,
            Performative::Close(Some(Error::new(
                condition::FRAMING_ERROR,
                "frame of 9000 bytes exceeds max-frame-size 4096"
            ))),
            b""
        )
    );
}

#[test]
fn links() {
    let attach = Attach {
        name: "sender-1".into(),
        handle: 0,
        role: Role::Receiver,
        snd_settle_mode: 2,
        rcv_settle_mode: 0,
        source: Some(Source {
            address: Some("/queues/q1".into()),
            outcomes: vec!["amqp:accepted:list".into(), "amqp:rejected:list".into()],
            default_outcome: Some(DeliveryState::Released.to_value()),
            ..Source::default()
        }),
        target: Some(Target {
            address: Some("/exchanges/amq.direct/rk".into()),
            durable: Some(2),
            ..Target::default()
        }),
        unsettled: None,
        incomplete_unsettled: false,
        initial_delivery_count: Some(0),
        max_message_size: Some(1 << 27),
        offered_capabilities: vec![],
        desired_capabilities: vec![],
        properties: None,
    };
    insta::assert_snapshot!(
        "attach",
        amqp(0, Performative::Attach(Box::new(attach)), b"")
    );
    insta::assert_snapshot!(
        "flow",
        amqp(
            0,
            Performative::Flow(Flow {
                next_incoming_id: Some(7),
                incoming_window: 2048,
                next_outgoing_id: 1,
                outgoing_window: 2048,
                handle: Some(0),
                delivery_count: Some(300),
                link_credit: Some(200),
                drain: true,
                ..Flow::default()
            }),
            b""
        )
    );
    insta::assert_snapshot!(
        "detach_error",
        amqp(
            0,
            Performative::Detach(Detach {
                handle: 3,
                closed: true,
                error: Some(Error::new(condition::NOT_FOUND, "no queue 'q9'")),
            }),
            b""
        )
    );
}

#[test]
fn deliveries() {
    // A transfer's payload is the message: a data section of 12 bytes.
    let payload = b"\x00\x53\x75\xa0\x0chello world!";
    insta::assert_snapshot!(
        "transfer",
        amqp(
            0,
            Performative::Transfer(Transfer {
                handle: 0,
                delivery_id: Some(70_000),
                delivery_tag: Some(Bytes::from_static(&[0, 0, 0, 1])),
                message_format: Some(0),
                settled: Some(false),
                more: true,
                ..Transfer::default()
            }),
            payload
        )
    );
    for (name, state) in [
        ("disposition_accepted", DeliveryState::Accepted),
        ("disposition_released", DeliveryState::Released),
        (
            "disposition_rejected",
            DeliveryState::Rejected {
                error: Some(Error::new(condition::RESOURCE_LIMIT_EXCEEDED, "queue full")),
            },
        ),
        (
            "disposition_modified",
            DeliveryState::Modified {
                delivery_failed: true,
                undeliverable_here: true,
                message_annotations: None,
            },
        ),
    ] {
        insta::assert_snapshot!(
            name,
            amqp(
                0,
                Performative::Disposition(Disposition {
                    role: Role::Receiver,
                    first: 4,
                    last: Some(9),
                    settled: true,
                    state: Some(state),
                    batchable: false,
                }),
                b""
            )
        );
    }
}

#[test]
fn sasl_frames() {
    insta::assert_snapshot!(
        "sasl_mechanisms",
        sasl(Sasl::Mechanisms(vec!["PLAIN".into(), "ANONYMOUS".into()]))
    );
    insta::assert_snapshot!(
        "sasl_init",
        sasl(Sasl::Init {
            mechanism: "PLAIN".into(),
            initial_response: Some(Bytes::from_static(b"\0guest\0guest")),
            hostname: Some("localhost".into()),
        })
    );
    insta::assert_snapshot!(
        "sasl_outcome",
        sasl(Sasl::Outcome {
            code: 0,
            additional_data: None
        })
    );
}

#[test]
fn heartbeat_is_an_empty_frame() {
    let mut buf = BytesMut::new();
    encode_heartbeat(&mut buf);
    assert_eq!(&buf[..], &[0, 0, 0, 8, 2, 0, 0, 0]);
    let raw = frame::decode_frame(&mut buf, 512)
        .expect("ok")
        .expect("frame");
    assert_eq!(raw.body().expect("body"), Body::Empty);
}

/// A frame laid out by hand from the spec (2.3.1, 2.7.1): how a client's open looks, with a
/// 4-byte extended header (doff 3), the `amqp:open:list` symbolic descriptor and wide forms
/// (`0xd0` list, `0x70` uint, `0xb1` string) where the encoder would pick narrow ones.
#[test]
fn a_hand_written_open_decodes() {
    let mut body = vec![0x00, 0xa3, 14];
    body.extend_from_slice(b"amqp:open:list");
    let mut items = vec![0xb1, 0, 0, 0, 2];
    items.extend_from_slice(b"c1");
    items.extend_from_slice(&[0x40]); // hostname
    items.extend_from_slice(&[0x70, 0, 0, 0x10, 0]); // max-frame-size 4096
    items.extend_from_slice(&[0x60, 0, 7]); // channel-max 7
    body.push(0xd0);
    body.extend_from_slice(&(items.len() as u32 + 4).to_be_bytes());
    body.extend_from_slice(&4u32.to_be_bytes());
    body.extend_from_slice(&items);
    let mut wire = ((12 + body.len()) as u32).to_be_bytes().to_vec();
    wire.extend_from_slice(&[3, 0, 0, 0, 0xde, 0xad, 0xbe, 0xef]);
    wire.extend_from_slice(&body);
    let mut buf = BytesMut::from(&wire[..]);
    // Not all there yet: no frame, nothing consumed.
    let mut part = BytesMut::from(&wire[..wire.len() - 1]);
    assert_eq!(frame::decode_frame(&mut part, 4096), Ok(None));
    let raw = frame::decode_frame(&mut buf, 4096)
        .expect("ok")
        .expect("frame");
    let Body::Amqp(Performative::Open(o), payload) = raw.body().expect("body") else {
        panic!("not an open");
    };
    assert!(payload.is_empty());
    assert_eq!(o.container_id, "c1");
    assert_eq!(o.hostname, None);
    assert_eq!(o.max_frame_size, 4096);
    assert_eq!(o.channel_max, 7);
    assert_eq!(o.idle_time_out, None);
}

#[test]
fn bad_frames_are_typed_errors() {
    use warren_amqp10::FrameError;
    // Over max-frame-size: refused from the header alone.
    let mut big = BytesMut::from(&[0, 0, 0x10, 0, 2, 0, 0, 0][..]);
    assert_eq!(
        frame::decode_frame(&mut big, 512),
        Err(FrameError::TooLarge {
            size: 4096,
            max: 512
        })
    );
    let mut doff = BytesMut::from(&[0, 0, 0, 8, 1, 0, 0, 0][..]);
    assert_eq!(
        frame::decode_frame(&mut doff, 512),
        Err(FrameError::BadDoff(1))
    );
    let mut kind = BytesMut::from(&[0, 0, 0, 8, 2, 7, 0, 0][..]);
    assert_eq!(
        frame::decode_frame(&mut kind, 512),
        Err(FrameError::UnknownType(7))
    );
    let mut small = BytesMut::from(&[0, 0, 0, 4, 2, 0, 0, 0][..]);
    assert_eq!(
        frame::decode_frame(&mut small, 512),
        Err(FrameError::TooSmall(4))
    );
    // A body that is not a performative: an unknown descriptor, and a bare value.
    for body in [
        &[0x00, 0x53, 0x99, 0x45][..],
        &[0x45][..],
        &[0x00, 0x53, 0x10, 0x45][..],
    ] {
        let mut wire = ((8 + body.len()) as u32).to_be_bytes().to_vec();
        wire.extend_from_slice(&[2, 0, 0, 0]);
        wire.extend_from_slice(body);
        let raw = frame::decode_frame(&mut BytesMut::from(&wire[..]), 512)
            .expect("framing is fine")
            .expect("frame");
        assert!(raw.body().is_err(), "{body:?}");
    }
}
