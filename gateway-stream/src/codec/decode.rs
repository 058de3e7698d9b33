//! Every command's body decoded by its key and version (bytes -> `Frame`); bad input is a
//! `DecodeError`, never a panic.

use super::*;

pub(super) fn read_versions(r: &mut Reader) -> Result<Vec<CommandVersion>, DecodeError> {
    let n = r.count(6, "command versions")?;
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        v.push((r.u16("key")?, r.u16("min")?, r.u16("max")?));
    }
    Ok(v)
}

/// Optional trailing property map (Subscribe, ResolveOffsetSpec): absent means empty.
pub(super) fn read_opt_map(r: &mut Reader) -> Result<Vec<(String, String)>, DecodeError> {
    if r.is_empty() {
        Ok(Vec::new())
    } else {
        read_map(r, "properties")
    }
}

/// Decodes one frame body (what follows the 4-byte size). Any mismatch, including bytes left
/// over, is an error: the frame is malformed.
pub fn decode(body: Bytes) -> Result<Frame, DecodeError> {
    let mut r = Reader::new(body);
    let k = r.u16("key")?;
    let version = r.u16("version")?;
    let frame = decode_command(&mut r, k, version)?;
    r.end()?;
    Ok(frame)
}

pub(super) fn decode_command(r: &mut Reader, k: u16, version: u16) -> Result<Frame, DecodeError> {
    use Frame::*;
    let unknown = DecodeError::UnknownCommand { key: k, version };
    let versioned = matches!(k, key::PUBLISH | key::DELIVER);
    if version != 1 && !(versioned && version == 2) {
        return Err(unknown);
    }
    let response = k & key::RESPONSE != 0;
    let base = k & !key::RESPONSE;
    if response {
        if is_plain_response(base) {
            return Ok(Response {
                key: base,
                corr: r.u32("correlation id")?,
                code: r.u16("code")?,
            });
        }
        return Ok(match base {
            key::QUERY_PUBLISHER_SEQUENCE => QueryPublisherSequenceResponse {
                corr: r.u32("correlation id")?,
                code: r.u16("code")?,
                sequence: r.u64("sequence")?,
            },
            key::CREDIT => CreditResponse {
                code: r.u16("code")?,
                subscription_id: r.u8("subscription id")?,
            },
            key::QUERY_OFFSET => QueryOffsetResponse {
                corr: r.u32("correlation id")?,
                code: r.u16("code")?,
                offset: r.u64("offset")?,
            },
            key::METADATA => {
                let corr = r.u32("correlation id")?;
                let n = r.count(8, "brokers")?;
                let mut brokers = Vec::with_capacity(n);
                for _ in 0..n {
                    brokers.push(Broker {
                        reference: r.u16("broker reference")?,
                        host: r.string("host")?,
                        port: r.u32("port")?,
                    });
                }
                let n = r.count(10, "stream metadata")?;
                let mut streams = Vec::with_capacity(n);
                for _ in 0..n {
                    let stream = r.string("stream")?;
                    let code = r.u16("code")?;
                    let leader = r.u16("leader")?;
                    let m = r.count(2, "replicas")?;
                    let mut replicas = Vec::with_capacity(m);
                    for _ in 0..m {
                        replicas.push(r.u16("replica")?);
                    }
                    streams.push(StreamMetadata {
                        stream,
                        code,
                        leader,
                        replicas,
                    });
                }
                MetadataResponse {
                    corr,
                    brokers,
                    streams,
                }
            }
            key::PEER_PROPERTIES => PeerPropertiesResponse {
                corr: r.u32("correlation id")?,
                code: r.u16("code")?,
                properties: read_map(r, "peer properties")?,
            },
            key::SASL_HANDSHAKE => SaslHandshakeResponse {
                corr: r.u32("correlation id")?,
                code: r.u16("code")?,
                mechanisms: read_strings(r, "mechanisms")?,
            },
            key::SASL_AUTHENTICATE => {
                let corr = r.u32("correlation id")?;
                let code = r.u16("code")?;
                let challenge = if r.is_empty() {
                    Bytes::new()
                } else {
                    let n = r.i16("challenge")?;
                    if n <= 0 {
                        return Err(DecodeError::BadValue("challenge"));
                    }
                    r.take(n as usize, "challenge")?
                };
                SaslAuthenticateResponse {
                    corr,
                    code,
                    challenge,
                }
            }
            key::TUNE => TuneResponse {
                frame_max: r.u32("frame max")?,
                heartbeat: r.u32("heartbeat")?,
            },
            key::OPEN => {
                let corr = r.u32("correlation id")?;
                let code = r.u16("code")?;
                let properties = read_opt_map(r)?;
                OpenResponse {
                    corr,
                    code,
                    properties,
                }
            }
            key::ROUTE => RouteResponse {
                corr: r.u32("correlation id")?,
                code: r.u16("code")?,
                streams: read_strings(r, "streams")?,
            },
            key::PARTITIONS => PartitionsResponse {
                corr: r.u32("correlation id")?,
                code: r.u16("code")?,
                streams: read_strings(r, "streams")?,
            },
            key::CONSUMER_UPDATE => {
                let corr = r.u32("correlation id")?;
                let code = r.u16("code")?;
                let t = r.u16("offset type")?;
                let offset = if t == 0 {
                    None
                } else {
                    Some(OffsetSpec::read_type(r, t)?)
                };
                ConsumerUpdateResponse { corr, code, offset }
            }
            key::EXCHANGE_COMMAND_VERSIONS => ExchangeCommandVersionsResponse {
                corr: r.u32("correlation id")?,
                code: r.u16("code")?,
                versions: read_versions(r)?,
            },
            key::STREAM_STATS => {
                let corr = r.u32("correlation id")?;
                let code = r.u16("code")?;
                let n = r.count(10, "stats")?;
                let mut stats = Vec::with_capacity(n);
                for _ in 0..n {
                    stats.push((r.string("stat")?, r.i64("stat value")?));
                }
                StreamStatsResponse { corr, code, stats }
            }
            key::RESOLVE_OFFSET_SPEC => ResolveOffsetSpecResponse {
                corr: r.u32("correlation id")?,
                code: r.u16("code")?,
                offset_type: r.u16("offset type")?,
                offset: r.u64("offset")?,
            },
            _ => return Err(unknown),
        });
    }
    Ok(match base {
        key::DECLARE_PUBLISHER => DeclarePublisher {
            corr: r.u32("correlation id")?,
            publisher_id: r.u8("publisher id")?,
            reference: r.string("publisher reference")?,
            stream: r.string("stream")?,
        },
        key::PUBLISH => {
            let v2 = version == 2;
            let publisher_id = r.u8("publisher id")?;
            // id + smallest entry (4-byte size) [+ null filter string]
            let n = r.count(if v2 { 14 } else { 12 }, "published messages")?;
            let mut messages = Vec::with_capacity(n);
            for _ in 0..n {
                let publishing_id = r.u64("publishing id")?;
                let filter_value = if v2 {
                    r.opt_string("filter value")?
                } else {
                    None
                };
                let entry = Entry::read(r)?;
                messages.push(PublishedMessage {
                    publishing_id,
                    filter_value,
                    entry,
                });
            }
            Publish {
                v2,
                publisher_id,
                messages,
            }
        }
        key::PUBLISH_CONFIRM => {
            let publisher_id = r.u8("publisher id")?;
            let n = r.count(8, "publishing ids")?;
            let mut publishing_ids = Vec::with_capacity(n);
            for _ in 0..n {
                publishing_ids.push(r.u64("publishing id")?);
            }
            PublishConfirm {
                publisher_id,
                publishing_ids,
            }
        }
        key::PUBLISH_ERROR => {
            let publisher_id = r.u8("publisher id")?;
            let n = r.count(10, "publishing errors")?;
            let mut errors = Vec::with_capacity(n);
            for _ in 0..n {
                errors.push((r.u64("publishing id")?, r.u16("code")?));
            }
            PublishError {
                publisher_id,
                errors,
            }
        }
        key::QUERY_PUBLISHER_SEQUENCE => QueryPublisherSequence {
            corr: r.u32("correlation id")?,
            reference: r.string("publisher reference")?,
            stream: r.string("stream")?,
        },
        key::DELETE_PUBLISHER => DeletePublisher {
            corr: r.u32("correlation id")?,
            publisher_id: r.u8("publisher id")?,
        },
        key::SUBSCRIBE => Subscribe {
            corr: r.u32("correlation id")?,
            subscription_id: r.u8("subscription id")?,
            stream: r.string("stream")?,
            offset: OffsetSpec::read(r)?,
            credit: r.u16("credit")?,
            properties: read_opt_map(r)?,
        },
        key::DELIVER => {
            let subscription_id = r.u8("subscription id")?;
            let committed_chunk_id = if version == 2 {
                Some(r.u64("committed chunk id")?)
            } else {
                None
            };
            let chunk = r.take(r.remaining(), "chunk")?;
            Deliver {
                subscription_id,
                committed_chunk_id,
                chunk,
            }
        }
        key::CREDIT => Credit {
            subscription_id: r.u8("subscription id")?,
            credit: r.u16("credit")?,
        },
        key::STORE_OFFSET => StoreOffset {
            reference: r.string("reference")?,
            stream: r.string("stream")?,
            offset: r.u64("offset")?,
        },
        key::QUERY_OFFSET => QueryOffset {
            corr: r.u32("correlation id")?,
            reference: r.string("reference")?,
            stream: r.string("stream")?,
        },
        key::UNSUBSCRIBE => Unsubscribe {
            corr: r.u32("correlation id")?,
            subscription_id: r.u8("subscription id")?,
        },
        key::CREATE => Create {
            corr: r.u32("correlation id")?,
            stream: r.string("stream")?,
            arguments: read_map(r, "arguments")?,
        },
        key::DELETE => Delete {
            corr: r.u32("correlation id")?,
            stream: r.string("stream")?,
        },
        key::METADATA => Metadata {
            corr: r.u32("correlation id")?,
            streams: read_strings(r, "streams")?,
        },
        key::METADATA_UPDATE => MetadataUpdate {
            code: r.u16("code")?,
            stream: r.string("stream")?,
        },
        key::PEER_PROPERTIES => PeerProperties {
            corr: r.u32("correlation id")?,
            properties: read_map(r, "peer properties")?,
        },
        key::SASL_HANDSHAKE => SaslHandshake {
            corr: r.u32("correlation id")?,
        },
        key::SASL_AUTHENTICATE => SaslAuthenticate {
            corr: r.u32("correlation id")?,
            mechanism: r.string("mechanism")?,
            data: r.bytes("sasl data")?,
        },
        key::TUNE => Tune {
            frame_max: r.u32("frame max")?,
            heartbeat: r.u32("heartbeat")?,
        },
        key::OPEN => Open {
            corr: r.u32("correlation id")?,
            vhost: r.string("virtual host")?,
        },
        key::CLOSE => Close {
            corr: r.u32("correlation id")?,
            code: r.u16("code")?,
            reason: r.string("reason")?,
        },
        key::HEARTBEAT => Heartbeat,
        key::ROUTE => Route {
            corr: r.u32("correlation id")?,
            routing_key: r.string("routing key")?,
            super_stream: r.string("super stream")?,
        },
        key::PARTITIONS => Partitions {
            corr: r.u32("correlation id")?,
            super_stream: r.string("super stream")?,
        },
        key::CONSUMER_UPDATE => ConsumerUpdate {
            corr: r.u32("correlation id")?,
            subscription_id: r.u8("subscription id")?,
            active: match r.u8("active")? {
                0 => false,
                1 => true,
                _ => return Err(DecodeError::BadValue("active")),
            },
        },
        key::EXCHANGE_COMMAND_VERSIONS => ExchangeCommandVersions {
            corr: r.u32("correlation id")?,
            versions: read_versions(r)?,
        },
        key::STREAM_STATS => StreamStats {
            corr: r.u32("correlation id")?,
            stream: r.string("stream")?,
        },
        key::CREATE_SUPER_STREAM => CreateSuperStream {
            corr: r.u32("correlation id")?,
            name: r.string("super stream")?,
            partitions: read_strings(r, "partitions")?,
            binding_keys: read_strings(r, "binding keys")?,
            arguments: read_map(r, "arguments")?,
        },
        key::DELETE_SUPER_STREAM => DeleteSuperStream {
            corr: r.u32("correlation id")?,
            name: r.string("super stream")?,
        },
        key::RESOLVE_OFFSET_SPEC => ResolveOffsetSpec {
            corr: r.u32("correlation id")?,
            stream: r.string("stream")?,
            offset: OffsetSpec::read(r)?,
            properties: read_opt_map(r)?,
        },
        _ => return Err(unknown),
    })
}
