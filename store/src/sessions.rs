//! MQTT sessions in redb (table `mqtt_sessions`): what a session keeps between connections
//! (subscriptions, expiry, QoS 1/2 packet state, a delayed will), so a persistent session
//! survives a restart. Written by the same ordered writer thread as retained messages
//! (`mqtt_writer::MqttWriter`). Byte layout: docs/storage.md ("MQTT sessions").

use crate::record::{DecodeError, Reader, Writer};
use bytes::Bytes;
use warren_core::mqtt::{StoredSession, StoredSub, StoredWill};

/// First byte of every session value.
pub const SESSION_VERSION: u8 = 1;

/// Packet ids, subscriptions: at most this many are read back (a corrupt count is an error,
/// never a huge allocation; MQTT has 65535 packet ids).
const MAX_IDS: u32 = 65_535;
const MAX_SUBS: u32 = 1 << 20;

const FLAG_HAS_QUEUE: u8 = 1;
const FLAG_DISCONNECTED: u8 = 2;
const FLAG_WILL: u8 = 4;

const SUB_NO_LOCAL: u8 = 1 << 2;
const SUB_RAP: u8 = 1 << 3;
const SUB_HAS_ID: u8 = 1 << 6;

fn ids(w: &mut Writer<'_>, ids: &[u16]) {
    let n = ids.len().min(MAX_IDS as usize);
    w.u32(n as u32);
    for id in &ids[..n] {
        w.0.extend_from_slice(&id.to_le_bytes());
    }
}

fn read_ids(r: &mut Reader<'_>) -> Result<Vec<u16>, DecodeError> {
    let n = r.u32()?;
    if n > MAX_IDS {
        return Err(DecodeError::Truncated);
    }
    let mut out = Vec::with_capacity(n as usize);
    for _ in 0..n {
        let lo = r.u8()?;
        let hi = r.u8()?;
        out.push(u16::from_le_bytes([lo, hi]));
    }
    Ok(out)
}

/// Encodes a session value (layout in docs/storage.md).
pub fn encode(s: &StoredSession) -> Vec<u8> {
    let mut out = Vec::with_capacity(64);
    let mut w = Writer(&mut out);
    w.u8(SESSION_VERSION);
    w.u8(s.level);
    let mut flags = 0;
    if s.has_queue {
        flags |= FLAG_HAS_QUEUE;
    }
    if s.disconnected_at.is_some() {
        flags |= FLAG_DISCONNECTED;
    }
    if s.will.is_some() {
        flags |= FLAG_WILL;
    }
    w.u8(flags);
    w.u32(s.expiry_s);
    w.u64(s.disconnected_at.unwrap_or(0));
    let n = s.subs.len().min(MAX_SUBS as usize);
    w.u32(n as u32);
    for sub in &s.subs[..n] {
        w.bytes(sub.filter.as_bytes());
        let mut opts = (sub.qos & 3) | ((sub.retain_handling & 3) << 4);
        if sub.no_local {
            opts |= SUB_NO_LOCAL;
        }
        if sub.retain_as_published {
            opts |= SUB_RAP;
        }
        if sub.id.is_some() {
            opts |= SUB_HAS_ID;
        }
        w.u8(opts);
        w.u32(sub.id.unwrap_or(0));
    }
    ids(&mut w, &s.awaiting_comp);
    ids(&mut w, &s.inbound_qos2);
    ids(&mut w, &s.outbound);
    if let Some(will) = &s.will {
        w.u64(will.due_at);
        w.bytes(will.user.as_bytes());
        w.bytes(&will.publish);
    }
    out
}

/// Decodes a session value; a corrupt or unknown-version value is an error, never a panic.
pub fn decode(v: &[u8]) -> Result<StoredSession, DecodeError> {
    let b = Bytes::copy_from_slice(v);
    let mut r = Reader::new(&b);
    let version = r.u8()?;
    if version != SESSION_VERSION {
        return Err(DecodeError::Version(version));
    }
    let level = r.u8()?;
    let flags = r.u8()?;
    let expiry_s = r.u32()?;
    let disconnected_at = r.u64()?;
    let n = r.u32()?;
    if n > MAX_SUBS {
        return Err(DecodeError::Truncated);
    }
    let mut subs = Vec::new();
    for _ in 0..n {
        let filter = r.string()?;
        let opts = r.u8()?;
        let id = r.u32()?;
        subs.push(StoredSub {
            filter,
            qos: opts & 3,
            no_local: opts & SUB_NO_LOCAL != 0,
            retain_as_published: opts & SUB_RAP != 0,
            retain_handling: (opts >> 4) & 3,
            id: (opts & SUB_HAS_ID != 0).then_some(id),
        });
    }
    let awaiting_comp = read_ids(&mut r)?;
    let inbound_qos2 = read_ids(&mut r)?;
    let outbound = read_ids(&mut r)?;
    let will = if flags & FLAG_WILL != 0 {
        Some(StoredWill {
            due_at: r.u64()?,
            user: r.string()?,
            publish: r.bytes()?,
        })
    } else {
        None
    };
    Ok(StoredSession {
        level,
        expiry_s,
        disconnected_at: (flags & FLAG_DISCONNECTED != 0).then_some(disconnected_at),
        has_queue: flags & FLAG_HAS_QUEUE != 0,
        subs,
        awaiting_comp,
        inbound_qos2,
        outbound,
        will,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> StoredSession {
        StoredSession {
            level: 5,
            expiry_s: 3600,
            disconnected_at: Some(1_700_000_000_123),
            has_queue: true,
            subs: vec![
                StoredSub {
                    filter: "a/+/c".into(),
                    qos: 2,
                    no_local: true,
                    retain_as_published: true,
                    retain_handling: 2,
                    id: Some(268_435_455),
                },
                StoredSub {
                    filter: "$share/g/x/#".into(),
                    qos: 1,
                    no_local: false,
                    retain_as_published: false,
                    retain_handling: 0,
                    id: None,
                },
            ],
            awaiting_comp: vec![7, 65535],
            inbound_qos2: vec![1],
            outbound: vec![3, 4, 5],
            will: Some(StoredWill {
                due_at: 1_700_000_010_000,
                user: "guest".into(),
                publish: Bytes::from_static(b"\x30\x05\x00\x01tx\x00"),
            }),
        }
    }

    #[test]
    fn sessions_round_trip() {
        let s = sample();
        assert_eq!(decode(&encode(&s)), Ok(s));
        let connected = StoredSession {
            level: 4,
            expiry_s: u32::MAX,
            ..StoredSession::default()
        };
        assert_eq!(decode(&encode(&connected)), Ok(connected));
    }

    /// The layout docs/storage.md documents, pinned byte by byte.
    #[test]
    fn layout_is_the_documented_one() {
        let s = StoredSession {
            level: 4,
            expiry_s: 10,
            disconnected_at: Some(0x0102),
            has_queue: true,
            subs: vec![StoredSub {
                filter: "t".into(),
                qos: 1,
                no_local: true,
                retain_as_published: false,
                retain_handling: 1,
                id: Some(9),
            }],
            awaiting_comp: vec![],
            inbound_qos2: vec![0x0203],
            outbound: vec![],
            will: None,
        };
        let mut want = vec![1u8, 4, 0b011];
        want.extend_from_slice(&10u32.to_le_bytes());
        want.extend_from_slice(&0x0102u64.to_le_bytes());
        want.extend_from_slice(&1u32.to_le_bytes());
        want.extend_from_slice(&1u32.to_le_bytes());
        want.push(b't');
        want.push(1 | 1 << 2 | 1 << 4 | 1 << 6);
        want.extend_from_slice(&9u32.to_le_bytes());
        want.extend_from_slice(&0u32.to_le_bytes());
        want.extend_from_slice(&1u32.to_le_bytes());
        want.extend_from_slice(&[0x03, 0x02]);
        want.extend_from_slice(&0u32.to_le_bytes());
        assert_eq!(encode(&s), want);
    }

    #[test]
    fn corrupt_values_are_errors_not_panics() {
        let good = encode(&sample());
        for cut in 0..good.len() {
            assert!(decode(&good[..cut]).is_err(), "truncated at {cut}");
        }
        let mut other = good.clone();
        other[0] = 9;
        assert_eq!(decode(&other), Err(DecodeError::Version(9)));
        // A huge subscription count is refused before anything is allocated for it.
        let mut huge = good[..15].to_vec();
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(decode(&huge).is_err());
    }
}
