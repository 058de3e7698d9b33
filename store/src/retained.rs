//! MQTT retained messages in redb (table `retained`), written by one thread in arrival order:
//! gateways hand over changes without waiting, and each batch the thread finds queued is one
//! durable commit (group commit, as for messages). Retained messages are state, not
//! deliveries: a publisher is not held back for them, so a crash can lose the last ~ms of
//! changes, never reorder them.

use crate::definitions::DefinitionStore;
use crate::record::{DecodeError, Reader, Writer, decode_message, encode_message};
use bytes::Bytes;
use std::sync::Arc;
use std::sync::mpsc;
use warren_core::message::Message;
use warren_core::mqtt::RetainedMessage;

/// Changes waiting for the writer; beyond this, `set` drops the change with a warning rather
/// than block a gateway (the next change of that topic repairs it).
const QUEUE: usize = 65_536;
/// Changes committed together at most.
const BATCH: usize = 4096;

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
pub(crate) fn encode(m: &RetainedMessage) -> Vec<u8> {
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

pub(crate) fn decode(v: &[u8]) -> Result<RetainedMessage, DecodeError> {
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

/// Hands retained-message changes to the writer thread.
#[derive(Clone)]
pub struct RetainedWriter {
    tx: mpsc::SyncSender<(String, RetainedMessage)>,
}

impl RetainedWriter {
    pub fn start(defs: DefinitionStore) -> std::io::Result<RetainedWriter> {
        let (tx, rx) = mpsc::sync_channel::<(String, RetainedMessage)>(QUEUE);
        std::thread::Builder::new()
            .name("warren-retained".into())
            .spawn(move || {
                while let Ok(first) = rx.recv() {
                    let mut batch = vec![first];
                    while batch.len() < BATCH {
                        match rx.try_recv() {
                            Ok(change) => batch.push(change),
                            Err(_) => break,
                        }
                    }
                    if let Err(e) = defs.write_retained(&batch) {
                        tracing::error!(error = %e, changes = batch.len(), "cannot store retained messages; they stay in memory");
                    }
                }
            })?;
        Ok(RetainedWriter { tx })
    }

    /// Queues a change (an empty payload deletes the topic's message).
    pub fn set(&self, vhost: &str, m: &RetainedMessage) {
        if self.tx.try_send((vhost.to_string(), m.clone())).is_err() {
            tracing::warn!(
                topic = %warren_core::escape::Escaped(&m.topic),
                "retained-message writer is behind; this change is not stored"
            );
        }
    }
}
