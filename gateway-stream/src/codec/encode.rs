//! Every command's body encoded as the wire has it (`Frame` -> bytes).

use super::*;

/// Appends `frame` to `out`: size, key, version, body.
pub fn encode(frame: &Frame, out: &mut BytesMut) {
    let start = out.len();
    out.put_u32(0);
    out.put_u16(frame.key());
    out.put_u16(frame.version());
    encode_body(frame, out);
    let size = (out.len() - start - 4) as u32;
    out[start..start + 4].copy_from_slice(&size.to_be_bytes());
}

/// Appends a Deliver frame for `chunk` (v2 when `committed_chunk_id` is given), writing the
/// chunk header and data straight into `out` (the same bytes as [`Frame::Deliver`] with
/// `chunk.to_bytes()`).
/// A Deliver frame for `chunk`; when its data is a file range, the frame's bytes up to the
/// data, and the range that completes the frame (see [`crate::chunk::Chunk::put`]).
pub fn encode_deliver<'c>(
    subscription_id: u8,
    committed_chunk_id: Option<u64>,
    chunk: &'c crate::chunk::Chunk,
    out: &mut BytesMut,
) -> Option<&'c crate::chunk::FileRange> {
    let size = 4 + 1 + committed_chunk_id.map_or(0, |_| 8) + chunk.wire_len();
    out.reserve(4 + size);
    out.put_u32(size as u32);
    out.put_u16(key::DELIVER);
    out.put_u16(if committed_chunk_id.is_some() { 2 } else { 1 });
    out.put_u8(subscription_id);
    if let Some(c) = committed_chunk_id {
        out.put_u64(c);
    }
    chunk.put(out)
}

/// The encoding of one frame, as a buffer of its own.
pub fn to_bytes(frame: &Frame) -> Bytes {
    let mut out = BytesMut::new();
    encode(frame, &mut out);
    out.freeze()
}

pub(super) fn encode_body(frame: &Frame, out: &mut BytesMut) {
    use Frame::*;
    match frame {
        DeclarePublisher {
            corr,
            publisher_id,
            reference,
            stream,
        } => {
            out.put_u32(*corr);
            out.put_u8(*publisher_id);
            put_string(out, reference);
            put_string(out, stream);
        }
        Publish {
            v2,
            publisher_id,
            messages,
        } => {
            out.put_u8(*publisher_id);
            out.put_i32(messages.len() as i32);
            for m in messages {
                out.put_u64(m.publishing_id);
                if *v2 {
                    match &m.filter_value {
                        Some(f) => put_string(out, f),
                        None => out.put_i16(-1),
                    }
                }
                m.entry.put(out);
            }
        }
        PublishConfirm {
            publisher_id,
            publishing_ids,
        } => {
            out.put_u8(*publisher_id);
            out.put_i32(publishing_ids.len() as i32);
            for id in publishing_ids {
                out.put_u64(*id);
            }
        }
        PublishError {
            publisher_id,
            errors,
        } => {
            out.put_u8(*publisher_id);
            out.put_i32(errors.len() as i32);
            for (id, c) in errors {
                out.put_u64(*id);
                out.put_u16(*c);
            }
        }
        QueryPublisherSequence {
            corr,
            reference,
            stream,
        }
        | QueryOffset {
            corr,
            reference,
            stream,
        } => {
            out.put_u32(*corr);
            put_string(out, reference);
            put_string(out, stream);
        }
        QueryPublisherSequenceResponse {
            corr,
            code,
            sequence: value,
        }
        | QueryOffsetResponse {
            corr,
            code,
            offset: value,
        } => {
            out.put_u32(*corr);
            out.put_u16(*code);
            out.put_u64(*value);
        }
        DeletePublisher {
            corr,
            publisher_id: id,
        }
        | Unsubscribe {
            corr,
            subscription_id: id,
        } => {
            out.put_u32(*corr);
            out.put_u8(*id);
        }
        Subscribe {
            corr,
            subscription_id,
            stream,
            offset,
            credit,
            properties,
        } => {
            out.put_u32(*corr);
            out.put_u8(*subscription_id);
            put_string(out, stream);
            offset.put(out);
            out.put_u16(*credit);
            // RabbitMQ leaves out an empty property map; the Rust client writes a count of
            // 0. Both decode; we write the shorter form.
            if !properties.is_empty() {
                put_map(out, properties);
            }
        }
        Deliver {
            subscription_id,
            committed_chunk_id,
            chunk,
        } => {
            out.put_u8(*subscription_id);
            if let Some(c) = committed_chunk_id {
                out.put_u64(*c);
            }
            out.put_slice(chunk);
        }
        Credit {
            subscription_id,
            credit,
        } => {
            out.put_u8(*subscription_id);
            out.put_u16(*credit);
        }
        CreditResponse {
            code,
            subscription_id,
        } => {
            out.put_u16(*code);
            out.put_u8(*subscription_id);
        }
        StoreOffset {
            reference,
            stream,
            offset,
        } => {
            put_string(out, reference);
            put_string(out, stream);
            out.put_u64(*offset);
        }
        Create {
            corr,
            stream,
            arguments,
        } => {
            out.put_u32(*corr);
            put_string(out, stream);
            put_map(out, arguments);
        }
        Delete { corr, stream }
        | StreamStats { corr, stream }
        | Partitions {
            corr,
            super_stream: stream,
        }
        | DeleteSuperStream { corr, name: stream }
        | Open {
            corr,
            vhost: stream,
        } => {
            out.put_u32(*corr);
            put_string(out, stream);
        }
        Metadata { corr, streams } => {
            out.put_u32(*corr);
            put_strings(out, streams);
        }
        MetadataResponse {
            corr,
            brokers,
            streams,
        } => {
            out.put_u32(*corr);
            out.put_i32(brokers.len() as i32);
            for b in brokers {
                out.put_u16(b.reference);
                put_string(out, &b.host);
                out.put_u32(b.port);
            }
            out.put_i32(streams.len() as i32);
            for s in streams {
                put_string(out, &s.stream);
                out.put_u16(s.code);
                out.put_u16(s.leader);
                out.put_i32(s.replicas.len() as i32);
                for r in &s.replicas {
                    out.put_u16(*r);
                }
            }
        }
        MetadataUpdate { code, stream } => {
            out.put_u16(*code);
            put_string(out, stream);
        }
        PeerProperties { corr, properties } => {
            out.put_u32(*corr);
            put_map(out, properties);
        }
        PeerPropertiesResponse {
            corr,
            code,
            properties,
        } => {
            out.put_u32(*corr);
            out.put_u16(*code);
            put_map(out, properties);
        }
        SaslHandshake { corr } => out.put_u32(*corr),
        SaslHandshakeResponse {
            corr,
            code,
            mechanisms,
        } => {
            out.put_u32(*corr);
            out.put_u16(*code);
            put_strings(out, mechanisms);
        }
        SaslAuthenticate {
            corr,
            mechanism,
            data,
        } => {
            out.put_u32(*corr);
            put_string(out, mechanism);
            put_bytes(out, data);
        }
        SaslAuthenticateResponse {
            corr,
            code,
            challenge,
        } => {
            out.put_u32(*corr);
            out.put_u16(*code);
            if !challenge.is_empty() {
                let n = challenge.len().min(i16::MAX as usize);
                out.put_i16(n as i16);
                out.put_slice(&challenge[..n]);
            }
        }
        Tune {
            frame_max,
            heartbeat,
        }
        | TuneResponse {
            frame_max,
            heartbeat,
        } => {
            out.put_u32(*frame_max);
            out.put_u32(*heartbeat);
        }
        OpenResponse {
            corr,
            code: c,
            properties,
        } => {
            out.put_u32(*corr);
            out.put_u16(*c);
            // Clients read the map after an OK (the Rust client unconditionally).
            if *c == code::OK || !properties.is_empty() {
                put_map(out, properties);
            }
        }
        Close { corr, code, reason } => {
            out.put_u32(*corr);
            out.put_u16(*code);
            put_string(out, reason);
        }
        Heartbeat => {}
        Route {
            corr,
            routing_key,
            super_stream,
        } => {
            out.put_u32(*corr);
            put_string(out, routing_key);
            put_string(out, super_stream);
        }
        RouteResponse {
            corr,
            code,
            streams,
        }
        | PartitionsResponse {
            corr,
            code,
            streams,
        } => {
            out.put_u32(*corr);
            out.put_u16(*code);
            put_strings(out, streams);
        }
        ConsumerUpdate {
            corr,
            subscription_id,
            active,
        } => {
            out.put_u32(*corr);
            out.put_u8(*subscription_id);
            out.put_u8(u8::from(*active));
        }
        ConsumerUpdateResponse { corr, code, offset } => {
            out.put_u32(*corr);
            out.put_u16(*code);
            match offset {
                None => out.put_u16(0),
                Some(o) => o.put(out),
            }
        }
        ExchangeCommandVersions { corr, versions } => {
            out.put_u32(*corr);
            put_versions(out, versions);
        }
        ExchangeCommandVersionsResponse {
            corr,
            code,
            versions,
        } => {
            out.put_u32(*corr);
            out.put_u16(*code);
            put_versions(out, versions);
        }
        StreamStatsResponse { corr, code, stats } => {
            out.put_u32(*corr);
            out.put_u16(*code);
            out.put_i32(stats.len() as i32);
            for (k, v) in stats {
                put_string(out, k);
                out.put_i64(*v);
            }
        }
        CreateSuperStream {
            corr,
            name,
            partitions,
            binding_keys,
            arguments,
        } => {
            out.put_u32(*corr);
            put_string(out, name);
            put_strings(out, partitions);
            put_strings(out, binding_keys);
            put_map(out, arguments);
        }
        ResolveOffsetSpec {
            corr,
            stream,
            offset,
            properties,
        } => {
            out.put_u32(*corr);
            put_string(out, stream);
            offset.put(out);
            if !properties.is_empty() {
                put_map(out, properties);
            }
        }
        ResolveOffsetSpecResponse {
            corr,
            code,
            offset_type,
            offset,
        } => {
            out.put_u32(*corr);
            out.put_u16(*code);
            out.put_u16(*offset_type);
            out.put_u64(*offset);
        }
        Response { corr, code, .. } => {
            out.put_u32(*corr);
            out.put_u16(*code);
        }
    }
}

pub(super) fn put_strings(out: &mut BytesMut, list: &[String]) {
    out.put_i32(list.len() as i32);
    for s in list {
        put_string(out, s);
    }
}

pub(super) fn put_versions(out: &mut BytesMut, versions: &[CommandVersion]) {
    out.put_i32(versions.len() as i32);
    for (k, min, max) in versions {
        out.put_u16(*k);
        out.put_u16(*min);
        out.put_u16(*max);
    }
}
