//! MQTT retained messages and sessions as redb records (table `retained`, written through the
//! core's `Store` as definitions: `DefinitionStore::apply`; sessions by `mqtt_writer`): their
//! keys and encodings, and the change the session writer commits.

use crate::record::{DecodeError, Reader, Writer, decode_message, encode_message};
use bytes::Bytes;
use std::sync::Arc;
use warren_core::message::Message;
use warren_core::mqtt::{RetainedMessage, StoredSession};

/// Key of a retained message: vhost, NUL, topic.
pub(crate) fn key(vhost: &str, topic: &str) -> Vec<u8> {
    let mut k = Vec::with_capacity(vhost.len() + 1 + topic.len());
    k.extend_from_slice(vhost.as_bytes());
    k.push(0);
    k.extend_from_slice(topic.as_bytes());
    k
}

pub(crate) fn split_key(k: &[u8]) -> Option<(String, String)> {
    let at = k.iter().position(|&b| b == 0)?;
    Some((
        String::from_utf8(k[..at].to_vec()).ok()?,
        String::from_utf8(k[at + 1..].to_vec()).ok()?,
    ))
}

/// Value: qos u8, stored_at u64, expiry u64 (`u64::MAX`: none), then the payload and
/// properties as a message record.
pub fn encode(m: &RetainedMessage) -> Vec<u8> {
    let mut out = Vec::new();
    let mut w = Writer(&mut out);
    w.u8(m.qos);
    w.u64(m.stored_at);
    w.u64(m.expiry_ms.unwrap_or(u64::MAX));
    encode_message(
        &Message {
            exchange: Arc::from(""),
            routing_key: m.topic.clone(),
            properties: m.properties.clone(),
            body: m.payload.clone(),
        },
        true,
        &mut out,
    );
    out
}

pub fn decode(v: &[u8]) -> Result<RetainedMessage, DecodeError> {
    let b = Bytes::copy_from_slice(v);
    let mut r = Reader::new(&b);
    let qos = r.u8()?;
    let stored_at = r.u64()?;
    let expiry = r.u64()?;
    let m = decode_message(&b.slice(17..), None)?;
    Ok(RetainedMessage {
        topic: m.routing_key,
        qos,
        payload: m.body,
        properties: m.properties,
        stored_at,
        expiry_ms: (expiry != u64::MAX).then_some(expiry),
    })
}

/// One change of the gateway's MQTT state.
#[derive(Clone, Debug)]
pub enum MqttChange {
    /// vhost, client id, the session (`None`: it ended).
    Session(String, String, Option<StoredSession>),
}
