//! The byte format of the browser store's records (docs/javascript.md, "Byte format"): binary
//! IndexedDB keys that sort by kind, queue and sequence number, and values that carry a
//! format version and a CRC-32C over key and value, so a damaged record is found on open
//! instead of becoming a wrong broker.
//!
//! Every payload is AMQP 1.0 message bytes (`amqp10::encode`, the encoding streams store,
//! already in the module): a message as itself, a definition or retained message as a message
//! whose fields hold its names, flags and arguments (the table in [`definition`]). So this
//! module adds framing, not a codec; the JS side replays definitions from the decoded
//! messages through the public API (`persist.js`).

use warren_core::amqp10;
use warren_core::message::{FieldTable, Message, Properties};

/// The version byte every value starts with.
pub const VERSION: u8 = 1;
/// Key prefixes: one object store holds every kind, told apart by the first key byte, in
/// the order a restore replays them (keys come back sorted).
pub const EXCHANGE: u8 = 1;
pub const QUEUE: u8 = 2;
pub const BINDING: u8 = 3;
pub const RETAINED: u8 = 4;
pub const MESSAGE: u8 = 5;
/// `expires_at` absent.
const NONE: u64 = u64::MAX;

/// Why a record could not be read back (a fixed text: formatting the codec's own errors
/// would cost the module kilobytes for no decision the app can make differently).
pub type RecordError = &'static str;

/// CRC-32C (Castagnoli, reflected, as iSCSI and ext4), one table of 256 entries.
const CRC_TABLE: [u32; 256] = {
    let mut table = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 {
                (c >> 1) ^ 0x82f6_3b78
            } else {
                c >> 1
            };
            k += 1;
        }
        table[i] = c;
        i += 1;
    }
    table
};

fn crc_update(mut crc: u32, data: &[u8]) -> u32 {
    for &b in data {
        crc = CRC_TABLE[((crc ^ u32::from(b)) & 0xff) as usize] ^ (crc >> 8);
    }
    crc
}

/// CRC-32C of `key` followed by `payload`.
pub fn crc32c(key: &[u8], payload: &[u8]) -> u32 {
    !crc_update(crc_update(!0, key), payload)
}

/// A value: version, CRC-32C (little-endian) of key and payload, payload.
pub fn seal(key: &[u8], payload: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(payload.len() + 5);
    v.push(VERSION);
    v.extend_from_slice(&crc32c(key, payload).to_le_bytes());
    v.extend_from_slice(payload);
    v
}

/// The payload of a value stored under `key`, checked.
pub fn open<'a>(key: &[u8], value: &'a [u8]) -> Result<&'a [u8], RecordError> {
    match value {
        [VERSION, a, b, c, d, payload @ ..] => {
            if [*a, *b, *c, *d] == crc32c(key, payload).to_le_bytes() {
                Ok(payload)
            } else {
                Err("checksum mismatch")
            }
        }
        [] | [VERSION, ..] => Err("truncated"),
        _ => Err("unknown format version"),
    }
}

fn put_name(k: &mut Vec<u8>, s: &str) {
    // Names are bounded by the core (255 bytes for AMQP names); a longer topic is cut in
    // its key only. The big-endian prefix keeps one queue's keys contiguous.
    let b = &s.as_bytes()[..s.len().min(usize::from(u16::MAX))];
    k.extend_from_slice(&(b.len() as u16).to_be_bytes());
    k.extend_from_slice(b);
}

/// A key: its kind, then u16-prefixed names.
pub fn key(kind: u8, names: &[&str]) -> Vec<u8> {
    let mut k = vec![kind];
    for n in names {
        put_name(&mut k, n);
    }
    k
}

/// The key prefix of every message of queue `name` in `vhost`.
pub fn queue_prefix(vhost: &str, name: &str) -> Vec<u8> {
    key(MESSAGE, &[vhost, name])
}

/// `prefix` + a big-endian sequence number: keys sort in queue order.
pub fn message_key(prefix: &[u8], seq: u64) -> Vec<u8> {
    let mut k = Vec::with_capacity(prefix.len() + 8);
    k.extend_from_slice(prefix);
    k.extend_from_slice(&seq.to_be_bytes());
    k
}

/// A chunk entry after its seq: expiry (u64 LE, all ones: none), then the AMQP 1.0
/// message, u32-LE-length-prefixed.
pub fn message_entry(m: &Message, expires_at: Option<u64>) -> Vec<u8> {
    let bytes = amqp10::encode(m);
    let mut p = Vec::with_capacity(bytes.len() + 12);
    p.extend_from_slice(&((bytes.len() + 8) as u32).to_le_bytes());
    p.extend_from_slice(&expires_at.unwrap_or(NONE).to_le_bytes());
    p.extend_from_slice(&bytes);
    p
}

/// An entry's expiry and message (after its length).
pub fn read_message(payload: &[u8]) -> Result<(Option<u64>, Message), RecordError> {
    let (at, m) = payload.split_at_checked(8).ok_or("truncated")?;
    let mut a = [0; 8];
    a.copy_from_slice(at);
    let at = u64::from_le_bytes(a);
    let m =
        amqp10::decode(&bytes::Bytes::copy_from_slice(m)).map_err(|_| "bad AMQP 1.0 message")?;
    Ok(((at != NONE).then_some(at), m))
}

/// The fields of a definition record's message (docs/javascript.md has the table):
/// `exchange` and `routing_key` its two names (an exchange: name, type; a queue: "", name;
/// a binding: source, routing key), `reply_to` a binding's destination, `app_id` the vhost,
/// `priority` the flags (bit 0 durable or to-an-exchange, 1 auto-delete or exclusive, 2
/// internal or auto-delete), `headers` the arguments; a retained message: `routing_key`
/// its topic, its properties and payload as they are.
pub struct Def<'a> {
    pub vhost: &'a str,
    pub names: [&'a str; 2],
    pub destination: Option<&'a str>,
    pub flags: [bool; 3],
    pub arguments: &'a FieldTable,
}

pub fn definition(key: &[u8], d: &Def<'_>) -> Vec<u8> {
    let flags = d
        .flags
        .iter()
        .enumerate()
        .fold(0, |f, (i, &b)| f | (u8::from(b) << i));
    let m = Message {
        exchange: d.names[0].into(),
        routing_key: d.names[1].into(),
        properties: Properties {
            headers: Some(d.arguments.clone()),
            priority: Some(flags),
            reply_to: d.destination.map(str::to_string),
            app_id: Some(d.vhost.to_string()),
            ..Properties::default()
        },
        body: bytes::Bytes::new(),
    };
    seal(key, &amqp10::encode(&m))
}

pub fn retained(key: &[u8], r: &warren_core::mqtt::RetainedMessage) -> Vec<u8> {
    let m = Message {
        exchange: "".into(),
        routing_key: r.topic.clone(),
        properties: r.properties.clone(),
        body: r.payload.clone(),
    };
    seal(key, &amqp10::encode(&m))
}
