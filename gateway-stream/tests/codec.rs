//! The codec: `decode(encode(x)) == x` for every command (proptest), the exact bytes of
//! representative frames (insta snapshots, hex), and arbitrary bytes never panicking the
//! decoder (the fuzz target's property, run in CI).

use bytes::{Bytes, BytesMut};
use proptest::prelude::*;
use warren_stream::codec::{
    self, Broker, Entry, Frame, OffsetSpec, PublishedMessage, StreamMetadata,
};
use warren_stream::frame::{key, split_frame};

fn s() -> impl Strategy<Value = String> {
    "[a-z0-9._-]{0,12}"
}

fn map() -> impl Strategy<Value = Vec<(String, String)>> {
    prop::collection::vec((s(), s()), 0..4)
}

fn bytes() -> impl Strategy<Value = Bytes> {
    prop::collection::vec(any::<u8>(), 0..24).prop_map(Bytes::from)
}

fn offset() -> impl Strategy<Value = OffsetSpec> {
    prop_oneof![
        Just(OffsetSpec::First),
        Just(OffsetSpec::Last),
        Just(OffsetSpec::Next),
        any::<u64>().prop_map(OffsetSpec::Offset),
        any::<i64>().prop_map(OffsetSpec::Timestamp),
    ]
}

fn entry() -> impl Strategy<Value = Entry> {
    prop_oneof![
        bytes().prop_map(Entry::Simple),
        (0u8..8, any::<u16>(), any::<u32>(), bytes()).prop_map(
            |(compression, count, uncompressed_size, data)| {
                Entry::SubBatch {
                    compression,
                    count,
                    uncompressed_size,
                    data,
                }
            }
        ),
    ]
}

fn publish() -> impl Strategy<Value = Frame> {
    (any::<bool>(), any::<u8>()).prop_flat_map(|(v2, publisher_id)| {
        let filter = if v2 {
            prop::option::of(s()).boxed()
        } else {
            Just(None).boxed()
        };
        prop::collection::vec((any::<u64>(), filter, entry()), 0..5).prop_map(move |ms| {
            Frame::Publish {
                v2,
                publisher_id,
                messages: ms
                    .into_iter()
                    .map(|(publishing_id, filter_value, entry)| PublishedMessage {
                        publishing_id,
                        filter_value,
                        entry,
                    })
                    .collect(),
            }
        })
    })
}

fn versions() -> impl Strategy<Value = Vec<(u16, u16, u16)>> {
    prop::collection::vec(any::<(u16, u16, u16)>(), 0..4)
}

fn frame() -> impl Strategy<Value = Frame> {
    use Frame::*;
    let plain = prop::sample::select(vec![
        key::DECLARE_PUBLISHER,
        key::DELETE_PUBLISHER,
        key::SUBSCRIBE,
        key::UNSUBSCRIBE,
        key::CREATE,
        key::DELETE,
        key::CLOSE,
        key::CREATE_SUPER_STREAM,
        key::DELETE_SUPER_STREAM,
    ]);
    let a = prop_oneof![
        (any::<u32>(), any::<u8>(), s(), s()).prop_map(
            |(corr, publisher_id, reference, stream)| DeclarePublisher {
                corr,
                publisher_id,
                reference,
                stream
            }
        ),
        publish(),
        (any::<u8>(), prop::collection::vec(any::<u64>(), 0..5)).prop_map(
            |(publisher_id, publishing_ids)| PublishConfirm {
                publisher_id,
                publishing_ids
            }
        ),
        (
            any::<u8>(),
            prop::collection::vec(any::<(u64, u16)>(), 0..5)
        )
            .prop_map(|(publisher_id, errors)| PublishError {
                publisher_id,
                errors
            }),
        (any::<u32>(), s(), s()).prop_map(|(corr, reference, stream)| QueryPublisherSequence {
            corr,
            reference,
            stream
        }),
        any::<(u32, u16, u64)>().prop_map(|(corr, code, sequence)| {
            QueryPublisherSequenceResponse {
                corr,
                code,
                sequence,
            }
        }),
        any::<(u32, u8)>().prop_map(|(corr, publisher_id)| DeletePublisher { corr, publisher_id }),
        (
            any::<u32>(),
            any::<u8>(),
            s(),
            offset(),
            any::<u16>(),
            map()
        )
            .prop_map(
                |(corr, subscription_id, stream, offset, credit, properties)| Subscribe {
                    corr,
                    subscription_id,
                    stream,
                    offset,
                    credit,
                    properties
                }
            ),
        (any::<u8>(), prop::option::of(any::<u64>()), bytes()).prop_map(
            |(subscription_id, committed_chunk_id, chunk)| Deliver {
                subscription_id,
                committed_chunk_id,
                chunk
            }
        ),
        any::<(u8, u16)>().prop_map(|(subscription_id, credit)| Credit {
            subscription_id,
            credit
        }),
        any::<(u16, u8)>().prop_map(|(code, subscription_id)| CreditResponse {
            code,
            subscription_id
        }),
        (s(), s(), any::<u64>()).prop_map(|(reference, stream, offset)| StoreOffset {
            reference,
            stream,
            offset
        }),
        (any::<u32>(), s(), s()).prop_map(|(corr, reference, stream)| QueryOffset {
            corr,
            reference,
            stream
        }),
        any::<(u32, u16, u64)>().prop_map(|(corr, code, offset)| QueryOffsetResponse {
            corr,
            code,
            offset
        }),
        any::<(u32, u8)>().prop_map(|(corr, subscription_id)| Unsubscribe {
            corr,
            subscription_id
        }),
        (any::<u32>(), s(), map()).prop_map(|(corr, stream, arguments)| Create {
            corr,
            stream,
            arguments
        }),
    ];
    let b = prop_oneof![
        (any::<u32>(), s()).prop_map(|(corr, stream)| Delete { corr, stream }),
        (any::<u32>(), prop::collection::vec(s(), 0..4))
            .prop_map(|(corr, streams)| Metadata { corr, streams }),
        (
            any::<u32>(),
            prop::collection::vec(
                (any::<u16>(), s(), any::<u32>()).prop_map(|(reference, host, port)| Broker {
                    reference,
                    host,
                    port
                }),
                0..3
            ),
            prop::collection::vec(
                (
                    s(),
                    any::<u16>(),
                    any::<u16>(),
                    prop::collection::vec(any::<u16>(), 0..3)
                )
                    .prop_map(|(stream, code, leader, replicas)| StreamMetadata {
                        stream,
                        code,
                        leader,
                        replicas
                    }),
                0..3
            ),
        )
            .prop_map(|(corr, brokers, streams)| MetadataResponse {
                corr,
                brokers,
                streams
            }),
        (any::<u16>(), s()).prop_map(|(code, stream)| MetadataUpdate { code, stream }),
        (any::<u32>(), map()).prop_map(|(corr, properties)| PeerProperties { corr, properties }),
        (any::<u32>(), any::<u16>(), map()).prop_map(|(corr, code, properties)| {
            PeerPropertiesResponse {
                corr,
                code,
                properties,
            }
        }),
        any::<u32>().prop_map(|corr| SaslHandshake { corr }),
        (any::<u32>(), any::<u16>(), prop::collection::vec(s(), 0..3)).prop_map(
            |(corr, code, mechanisms)| SaslHandshakeResponse {
                corr,
                code,
                mechanisms
            }
        ),
        (any::<u32>(), s(), bytes()).prop_map(|(corr, mechanism, data)| SaslAuthenticate {
            corr,
            mechanism,
            data
        }),
        (any::<u32>(), any::<u16>(), bytes()).prop_map(|(corr, code, challenge)| {
            SaslAuthenticateResponse {
                corr,
                code,
                challenge,
            }
        }),
        any::<(u32, u32)>().prop_map(|(frame_max, heartbeat)| Tune {
            frame_max,
            heartbeat
        }),
        any::<(u32, u32)>().prop_map(|(frame_max, heartbeat)| TuneResponse {
            frame_max,
            heartbeat
        }),
        (any::<u32>(), s()).prop_map(|(corr, vhost)| Open { corr, vhost }),
        // An OK open response always carries its map; another code only when non-empty.
        (any::<u32>(), any::<u16>(), map()).prop_map(|(corr, code, properties)| OpenResponse {
            corr,
            code,
            properties
        }),
        (any::<u32>(), any::<u16>(), s()).prop_map(|(corr, code, reason)| Close {
            corr,
            code,
            reason
        }),
        Just(Heartbeat),
    ];
    let c = prop_oneof![
        (any::<u32>(), s(), s()).prop_map(|(corr, routing_key, super_stream)| Route {
            corr,
            routing_key,
            super_stream
        }),
        (any::<u32>(), any::<u16>(), prop::collection::vec(s(), 0..3)).prop_map(
            |(corr, code, streams)| RouteResponse {
                corr,
                code,
                streams
            }
        ),
        (any::<u32>(), s()).prop_map(|(corr, super_stream)| Partitions { corr, super_stream }),
        (any::<u32>(), any::<u16>(), prop::collection::vec(s(), 0..3)).prop_map(
            |(corr, code, streams)| PartitionsResponse {
                corr,
                code,
                streams
            }
        ),
        any::<(u32, u8, bool)>().prop_map(|(corr, subscription_id, active)| ConsumerUpdate {
            corr,
            subscription_id,
            active
        }),
        (any::<u32>(), any::<u16>(), prop::option::of(offset()))
            .prop_map(|(corr, code, offset)| ConsumerUpdateResponse { corr, code, offset }),
        (any::<u32>(), versions())
            .prop_map(|(corr, versions)| ExchangeCommandVersions { corr, versions }),
        (any::<u32>(), any::<u16>(), versions()).prop_map(|(corr, code, versions)| {
            ExchangeCommandVersionsResponse {
                corr,
                code,
                versions,
            }
        }),
        (any::<u32>(), s()).prop_map(|(corr, stream)| StreamStats { corr, stream }),
        (
            any::<u32>(),
            any::<u16>(),
            prop::collection::vec((s(), any::<i64>()), 0..3)
        )
            .prop_map(|(corr, code, stats)| StreamStatsResponse { corr, code, stats }),
        (
            any::<u32>(),
            s(),
            prop::collection::vec(s(), 0..3),
            prop::collection::vec(s(), 0..3),
            map()
        )
            .prop_map(|(corr, name, partitions, binding_keys, arguments)| {
                CreateSuperStream {
                    corr,
                    name,
                    partitions,
                    binding_keys,
                    arguments,
                }
            }),
        (any::<u32>(), s()).prop_map(|(corr, name)| DeleteSuperStream { corr, name }),
        (any::<u32>(), s(), offset(), map()).prop_map(|(corr, stream, offset, properties)| {
            ResolveOffsetSpec {
                corr,
                stream,
                offset,
                properties,
            }
        }),
        any::<(u32, u16, u16, u64)>().prop_map(|(corr, code, offset_type, offset)| {
            ResolveOffsetSpecResponse {
                corr,
                code,
                offset_type,
                offset,
            }
        }),
        (plain, any::<u32>(), any::<u16>()).prop_map(|(key, corr, code)| Response {
            key,
            corr,
            code
        }),
    ];
    prop_oneof![a, b, c]
}

/// What decoding can legitimately normalise: an OK Open response with no properties still
/// writes the (empty) map, which reads back the same; nothing else changes.
fn roundtrip(f: &Frame) -> Frame {
    let mut buf = BytesMut::from(&codec::to_bytes(f)[..]);
    let body = split_frame(&mut buf, 0).unwrap().expect("a whole frame");
    assert!(buf.is_empty(), "one frame, nothing after it");
    codec::decode(body).expect("decodes")
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn decode_encode_roundtrip(f in frame()) {
        prop_assert_eq!(roundtrip(&f), f);
    }

    #[test]
    fn arbitrary_bodies_never_panic(body in prop::collection::vec(any::<u8>(), 0..64), k in any::<u16>()) {
        let mut b = BytesMut::new();
        b.extend_from_slice(&k.to_be_bytes());
        b.extend_from_slice(&1u16.to_be_bytes());
        b.extend_from_slice(&body);
        let _ = codec::decode(b.freeze());
    }

    /// The session reads Publish frames in place (`parse_publish`, no `Frame`): the same
    /// messages as the decoder, and an error exactly where the decoder has one (cut or
    /// padded bodies, arbitrary bytes after a Publish header).
    #[test]
    fn publish_frames_read_in_place_agree_with_the_decoder(
        f in publish(),
        cut in any::<prop::sample::Index>(),
        junk in prop::collection::vec(any::<u8>(), 0..40),
    ) {
        let body = codec::to_bytes(&f).slice(4..);
        let (publisher_id, batch) = codec::parse_publish(&body)
            .expect("a publish")
            .expect("valid");
        let Frame::Publish { v2, messages, .. } = &f else { unreachable!() };
        prop_assert_eq!(
            Frame::Publish { v2: *v2, publisher_id, messages: batch.to_messages() },
            f.clone()
        );
        prop_assert_eq!(batch.iter().count(), messages.len());
        // The parse's summary is what a walk over the decoded messages finds.
        prop_assert_eq!(batch.summary(), codec::PublishedBatch::Messages(messages).summary());
        let n = cut.index(body.len() + 1);
        let mut padded = BytesMut::from(&body[..]);
        padded.extend_from_slice(&junk);
        let mut random = BytesMut::from(&body[..body.len().min(9)]);
        random.extend_from_slice(&junk);
        for b in [body.slice(..n), padded.freeze(), random.freeze()] {
            let fast = codec::parse_publish(&b).map(|r| r.map(|(_, batch)| batch.to_messages()));
            let slow = codec::decode(b.clone());
            match (fast, slow) {
                (Some(Ok(m)), Ok(Frame::Publish { messages, .. })) => prop_assert_eq!(m, messages),
                (Some(Err(_)), Err(_)) | (None, _) => {}
                (fast, slow) => prop_assert!(false, "{:?} vs {:?} for {:?}", fast, slow, b),
            }
        }
    }

    #[test]
    fn truncating_any_frame_is_an_error_not_a_panic(f in frame(), cut in any::<prop::sample::Index>()) {
        let full = codec::to_bytes(&f);
        let body = full.slice(4..);
        let n = cut.index(body.len());
        // A shorter body is malformed unless the command ends early by design (an optional
        // trailing map or challenge, or Deliver's open-ended chunk).
        let _ = codec::decode(body.slice(..n));
    }
}

fn hex(f: &Frame) -> String {
    codec::to_bytes(f)
        .chunks(16)
        .map(|c| {
            c.iter()
                .map(|b| format!("{b:02x}"))
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn snapshots_of_server_frames() {
    insta::assert_snapshot!(
        "peer_properties_response",
        hex(&Frame::PeerPropertiesResponse {
            corr: 1,
            code: 1,
            properties: vec![("product".into(), "Warren".into())]
        })
    );
    insta::assert_snapshot!(
        "sasl_handshake_response",
        hex(&Frame::SaslHandshakeResponse {
            corr: 2,
            code: 1,
            mechanisms: vec!["PLAIN".into(), "ANONYMOUS".into()]
        })
    );
    insta::assert_snapshot!(
        "sasl_authenticate_ok",
        hex(&Frame::SaslAuthenticateResponse {
            corr: 3,
            code: 1,
            challenge: Bytes::new()
        })
    );
    insta::assert_snapshot!(
        "tune",
        hex(&Frame::Tune {
            frame_max: 1 << 20,
            heartbeat: 60
        })
    );
    insta::assert_snapshot!(
        "open_response",
        hex(&Frame::OpenResponse {
            corr: 4,
            code: 1,
            properties: vec![
                ("advertised_host".into(), "127.0.0.1".into()),
                ("advertised_port".into(), "5552".into())
            ]
        })
    );
    insta::assert_snapshot!(
        "open_refused",
        hex(&Frame::OpenResponse {
            corr: 4,
            code: 0x0c,
            properties: vec![]
        })
    );
    insta::assert_snapshot!(
        "declare_publisher_ok",
        hex(&Frame::Response {
            key: key::DECLARE_PUBLISHER,
            corr: 5,
            code: 1
        })
    );
    insta::assert_snapshot!(
        "publish_confirm",
        hex(&Frame::PublishConfirm {
            publisher_id: 0,
            publishing_ids: vec![1, 2]
        })
    );
    insta::assert_snapshot!(
        "publish_error",
        hex(&Frame::PublishError {
            publisher_id: 7,
            errors: vec![(1, 0x12)]
        })
    );
    insta::assert_snapshot!(
        "credit_response",
        hex(&Frame::CreditResponse {
            code: 0x04,
            subscription_id: 9
        })
    );
    insta::assert_snapshot!(
        "metadata_response",
        hex(&Frame::MetadataResponse {
            corr: 6,
            brokers: vec![Broker {
                reference: 0,
                host: "127.0.0.1".into(),
                port: 5552
            }],
            streams: vec![
                StreamMetadata {
                    stream: "s".into(),
                    code: 1,
                    leader: 0,
                    replicas: vec![]
                },
                StreamMetadata {
                    stream: "x".into(),
                    code: 2,
                    leader: 0xffff,
                    replicas: vec![]
                },
            ],
        })
    );
    insta::assert_snapshot!(
        "metadata_update",
        hex(&Frame::MetadataUpdate {
            code: 6,
            stream: "s".into()
        })
    );
    insta::assert_snapshot!(
        "close_unknown_frame",
        hex(&Frame::Close {
            corr: 1,
            code: 0x0d,
            reason: "unknown frame".into()
        })
    );
    insta::assert_snapshot!("heartbeat", hex(&Frame::Heartbeat));
    insta::assert_snapshot!(
        "query_offset_response",
        hex(&Frame::QueryOffsetResponse {
            corr: 7,
            code: 1,
            offset: 42
        })
    );
    insta::assert_snapshot!(
        "exchange_command_versions_response",
        hex(&Frame::ExchangeCommandVersionsResponse {
            corr: 8,
            code: 1,
            versions: warren_stream::session::server_versions()
        })
    );
    let built = warren_stream::chunk::build(
        10,
        1_700_000_000_000,
        &[&Entry::Simple(Bytes::from_static(b"hi"))],
    );
    let chunk = built.to_bytes();
    // The session's direct encoder writes the same bytes as the Deliver value.
    for committed in [None, Some(10)] {
        let mut direct = BytesMut::new();
        codec::encode_deliver(1, committed, &built, &mut direct);
        let value = codec::to_bytes(&Frame::Deliver {
            subscription_id: 1,
            committed_chunk_id: committed,
            chunk: chunk.clone(),
        });
        assert_eq!(&direct[..], &value[..]);
    }
    insta::assert_snapshot!(
        "deliver_v1",
        hex(&Frame::Deliver {
            subscription_id: 1,
            committed_chunk_id: None,
            chunk: chunk.clone()
        })
    );
    insta::assert_snapshot!(
        "deliver_v2",
        hex(&Frame::Deliver {
            subscription_id: 1,
            committed_chunk_id: Some(10),
            chunk
        })
    );
}

#[test]
fn client_frames_as_the_rust_client_writes_them_decode() {
    // Subscribe with a property count of 0 (the Rust client) and without the map (RabbitMQ's
    // own encoder) both read as no properties.
    let mut with_count = BytesMut::from(
        &codec::to_bytes(&Frame::Subscribe {
            corr: 1,
            subscription_id: 0,
            stream: "s".into(),
            offset: OffsetSpec::First,
            credit: 1,
            properties: vec![],
        })[4..],
    );
    with_count.extend_from_slice(&0i32.to_be_bytes());
    assert!(
        matches!(codec::decode(with_count.freeze()), Ok(Frame::Subscribe { ref properties, .. }) if properties.is_empty())
    );
    // A null (-1) string reads as empty; a null SASL blob as empty.
    let body: &[u8] = &[
        0x00, 0x13, 0x00, 0x01, 0, 0, 0, 3, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
    ];
    assert_eq!(
        codec::decode(Bytes::from_static(body)),
        Ok(Frame::SaslAuthenticate {
            corr: 3,
            mechanism: String::new(),
            data: Bytes::new()
        })
    );
}
