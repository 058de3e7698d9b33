//! Every packet the server encodes, for MQTT 3.1.1 and 5, pinned byte for byte (insta
//! snapshots of hex dumps), plus decode round trips through the gateway's own decoder.

use bytes::{Bytes, BytesMut};
use mqtt_proto::v5::{self, Packet};
use mqtt_proto::{Pid, Protocol, QosPid, TopicName};
use std::sync::Arc;
use warren_mqtt::codec::{self, Decoded};
use warren_mqtt::session::{Session, check_connect, refusal};

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

/// The packet as sent to a v3.1.1 client and to a v5 client.
fn both(p: &Packet) -> String {
    let mut v3 = BytesMut::new();
    let mut v5 = BytesMut::new();
    let has3 = codec::encode(p, 4, &mut v3);
    assert!(
        codec::encode(p, 5, &mut v5),
        "every server packet encodes in v5"
    );
    let v3 = if has3 { hex(&v3) } else { "(not sent)".into() };
    format!("v3.1.1:\n{v3}\nv5:\n{}", hex(&v5))
}

fn pid(n: u16) -> Pid {
    Pid::try_from(n).expect("pid")
}

#[test]
fn connack_accepted_as_sessions_send_it() {
    let config = Arc::new(warren_mqtt::MqttConfig::default());
    for (level, name) in [(4u8, "connack_v3"), (5, "connack_v5_assigned_id")] {
        let mut c = v5::Connect::new(Arc::from(""), 30);
        c.protocol = if level == 5 {
            Protocol::V500
        } else {
            Protocol::V311
        };
        c.clean_start = true;
        let info = check_connect(&c, true, &config, || "warren-1".into()).expect("accepted");
        let mut s = Session::new(info, None, 0, config.clone());
        let packets = s.take_packets();
        let mut out = BytesMut::new();
        assert!(codec::encode(&packets[0], level, &mut out));
        insta::assert_snapshot!(name, hex(&out));
    }
}

#[test]
fn connack_refusals() {
    use v5::ConnectReasonCode as C;
    for code in [
        C::UnsupportedProtocolVersion,
        C::ClientIdentifierNotValid,
        C::BadUserNameOrPassword,
        C::NotAuthorized,
        C::BadAuthMethod,
        C::TopicNameInvalid,
    ] {
        insta::assert_snapshot!(format!("connack_{code:?}"), both(&refusal(code)));
    }
}

#[test]
fn publish_variants() {
    let topic = TopicName::try_from("a/b").expect("topic");
    let body = Bytes::from_static(b"hi");
    let q0 = v5::Publish::new(QosPid::Level0, topic.clone(), body.clone());
    insta::assert_snapshot!("publish_qos0", both(&Packet::Publish(q0)));
    let mut q1 = v5::Publish::new(QosPid::Level1(pid(1)), topic.clone(), body.clone());
    q1.dup = true;
    insta::assert_snapshot!("publish_qos1_dup", both(&Packet::Publish(q1)));
    let mut q2 = v5::Publish::new(QosPid::Level2(pid(2)), topic, body);
    q2.retain = true;
    q2.properties = v5::PublishProperties {
        payload_is_utf8: Some(true),
        message_expiry_interval: Some(59),
        response_topic: Some(TopicName::try_from("r/t").expect("topic")),
        correlation_data: Some(Bytes::from_static(b"c")),
        user_properties: vec![v5::UserProperty {
            name: Arc::from("k"),
            value: Arc::from("v"),
        }],
        subscription_id: Some(v5::VarByteInt::try_from(7).expect("id")),
        content_type: Some(Arc::from("text/plain")),
        topic_alias: None,
    };
    insta::assert_snapshot!("publish_qos2_retain_properties", both(&Packet::Publish(q2)));
}

/// A PUBLISH matching several subscriptions repeats property 0x0B once per identifier
/// (MQTT-3.3.4-3), which `mqtt-proto` cannot encode: framed by the gateway around its
/// encoding of the other properties. rumqttc decodes these bytes in
/// `mqtt_v5::every_matching_subscription_identifier_is_delivered`.
#[test]
fn publish_with_several_subscription_identifiers() {
    let topic = TopicName::try_from("a/b").expect("topic");
    let mut p = v5::Publish::new(QosPid::Level1(pid(9)), topic, Bytes::from_static(b"hi"));
    p.properties.message_expiry_interval = Some(59);
    p.properties.subscription_id = Some(v5::VarByteInt::try_from(1).expect("id"));
    p.properties.content_type = Some(Arc::from("t"));
    let out = codec::Out {
        packet: Packet::Publish(p.clone()),
        more_sub_ids: vec![2, 300],
    };
    let mut v5b = BytesMut::new();
    assert!(codec::encode_out(&out, 5, &mut v5b));
    assert_eq!(codec::out_len(&out, 5), v5b.len());
    insta::assert_snapshot!("publish_several_subscription_ids", hex(&v5b));
    // With one id the framing decodes, through the gateway's own decoder, to the same packet
    // as mqtt-proto's encoding (the properties' order differs, which MQTT allows).
    let mut one = BytesMut::new();
    assert!(codec::encode(&Packet::Publish(p.clone()), 5, &mut one));
    let mut mine = BytesMut::new();
    let mut without_first = p.clone();
    without_first.properties.subscription_id = None;
    let single = codec::Out {
        packet: Packet::Publish(without_first),
        more_sub_ids: vec![1],
    };
    assert!(codec::encode_out(&single, 5, &mut mine));
    assert_eq!(one.len(), mine.len());
    let decoded = |mut b: BytesMut| match codec::decode(&mut b, Some(5), 1 << 20) {
        Ok(Some(Decoded::Packet(p))) => p,
        other => panic!("not decoded: {other:?}"),
    };
    assert_eq!(decoded(one), decoded(mine));
    // v3.1.1 has no properties: the identifiers are dropped, the packet unchanged.
    let mut v3a = BytesMut::new();
    let mut v3b = BytesMut::new();
    assert!(codec::encode_out(&out, 4, &mut v3a));
    assert!(codec::encode(&Packet::Publish(p), 4, &mut v3b));
    assert_eq!(v3a, v3b);
}

#[test]
fn acks() {
    insta::assert_snapshot!(
        "puback",
        both(&Packet::Puback(v5::Puback::new_success(pid(1))))
    );
    insta::assert_snapshot!(
        "puback_unspecified_error",
        both(&Packet::Puback(v5::Puback::new(
            pid(1),
            v5::PubackReasonCode::UnspecifiedError
        )))
    );
    insta::assert_snapshot!(
        "pubrec",
        both(&Packet::Pubrec(v5::Pubrec::new_success(pid(2))))
    );
    insta::assert_snapshot!(
        "pubrec_unspecified_error",
        both(&Packet::Pubrec(v5::Pubrec::new(
            pid(2),
            v5::PubrecReasonCode::UnspecifiedError
        )))
    );
    insta::assert_snapshot!(
        "pubrel",
        both(&Packet::Pubrel(v5::Pubrel::new_success(pid(3))))
    );
    insta::assert_snapshot!(
        "pubrel_not_found",
        both(&Packet::Pubrel(v5::Pubrel::new(
            pid(3),
            v5::PubrelReasonCode::PacketIdentifierNotFound
        )))
    );
    insta::assert_snapshot!(
        "pubcomp",
        both(&Packet::Pubcomp(v5::Pubcomp::new_success(pid(4))))
    );
    insta::assert_snapshot!(
        "pubcomp_not_found",
        both(&Packet::Pubcomp(v5::Pubcomp::new(
            pid(4),
            v5::PubcompReasonCode::PacketIdentifierNotFound
        )))
    );
    insta::assert_snapshot!("pingresp", both(&Packet::Pingresp));
}

#[test]
fn suback_and_unsuback() {
    use v5::SubscribeReasonCode as S;
    insta::assert_snapshot!(
        "suback",
        both(&Packet::Suback(v5::Suback::new(
            pid(10),
            vec![
                S::GrantedQoS0,
                S::GrantedQoS1,
                S::GrantedQoS2,
                S::TopicFilterInvalid,
                S::SharedSubscriptionNotSupported
            ]
        )))
    );
    insta::assert_snapshot!(
        "unsuback",
        both(&Packet::Unsuback(v5::Unsuback::new(
            pid(11),
            vec![
                v5::UnsubscribeReasonCode::Success,
                v5::UnsubscribeReasonCode::NoSubscriptionExisted
            ]
        )))
    );
}

#[test]
fn server_disconnects() {
    use v5::DisconnectReasonCode as D;
    for code in [
        D::MalformedPacket,
        D::ProtocolError,
        D::ImplementationSpecificError,
        D::ServerShuttingDown,
        D::KeepAliveTimeout,
        D::SessionTakenOver,
        D::TopicNameInvalid,
        D::ReceiveMaximumExceeded,
        D::TopicAliasInvalid,
        D::PacketTooLarge,
        D::AdministrativeAction,
    ] {
        insta::assert_snapshot!(
            format!("disconnect_{code:?}"),
            both(&Packet::Disconnect(v5::Disconnect::new(code)))
        );
    }
}

#[test]
fn decoder_round_trip_of_client_packets() {
    let topic = TopicName::try_from("x/y").expect("topic");
    let packets = [
        Packet::Publish(v5::Publish::new(
            QosPid::Level1(pid(5)),
            topic.clone(),
            Bytes::from_static(b"p"),
        )),
        Packet::Puback(v5::Puback::new_success(pid(5))),
        Packet::Pubrec(v5::Pubrec::new_success(pid(6))),
        Packet::Pubrel(v5::Pubrel::new_success(pid(6))),
        Packet::Pubcomp(v5::Pubcomp::new_success(pid(6))),
        Packet::Pingreq,
        Packet::Disconnect(v5::Disconnect::new_normal()),
    ];
    for p in packets {
        let mut buf = BytesMut::from(p.encode().expect("encode").as_ref());
        let got = codec::decode(&mut buf, Some(5), 1 << 20).expect("decodes");
        assert_eq!(got, Some(Decoded::Packet(p)));
        assert!(buf.is_empty());
    }
    // Split anywhere: nothing until the last byte.
    let p = Packet::Publish(v5::Publish::new(
        QosPid::Level0,
        topic,
        Bytes::from_static(b"abc"),
    ));
    let bytes = p.encode().expect("encode").as_ref().to_vec();
    let mut buf = BytesMut::new();
    for (i, b) in bytes.iter().enumerate() {
        buf.extend_from_slice(&[*b]);
        let got = codec::decode(&mut buf, Some(4), 1 << 20).expect("no error");
        assert_eq!(got.is_some(), i + 1 == bytes.len());
    }
}
