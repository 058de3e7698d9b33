//! Binary forms of a group's log entries and of an append request (docs/storage.md,
//! "Cluster"; docs/cluster.md, "Transport"): a quorum queue's entries are mostly message
//! bytes, which JSON carried as base64 (about 4/3 the size, and an encode or decode pass at
//! every step: the leader's log write, each replication read, the frame to each follower, the
//! follower's log write, every apply's read). Here the command's bytes go as they are.
//!
//! An entry, byte by byte: the format byte [`ENTRY_V1`] (a JSON entry starts with `{`, so
//! both read), the log id (term, leader node id, index: u64 big-endian each), the payload's
//! tag (0 blank, 1 a command, 2 a membership) and then, to the end: a command's bytes as they
//! are, or a membership as JSON (rare: a change of members).

use openraft::{CommittedLeaderId, Entry, EntryPayload, LogId, Vote};

use crate::{Command, NodeId, TypeConfig};

/// The first byte of a binary entry.
pub const ENTRY_V1: u8 = 1;

/// Why bytes are no entry or request.
#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    #[error("truncated")]
    Truncated,
    #[error("unknown format or tag {0}")]
    Unknown(u8),
    #[error("membership: {0}")]
    Json(#[from] serde_json::Error),
}

/// Appends entry `e`'s binary form to `out`.
pub fn encode_entry(e: &Entry<TypeConfig>, out: &mut Vec<u8>) -> Result<(), CodecError> {
    out.push(ENTRY_V1);
    put_log_id(out, &e.log_id);
    match &e.payload {
        EntryPayload::Blank => out.push(0),
        EntryPayload::Normal(Command(bytes)) => {
            out.push(1);
            out.extend_from_slice(bytes);
        }
        EntryPayload::Membership(m) => {
            out.push(2);
            serde_json::to_writer(&mut *out, m)?;
        }
    }
    Ok(())
}

/// Reads a binary entry ([`encode_entry`]), or a JSON one (logs written before).
pub fn decode_entry(b: &[u8]) -> Result<Entry<TypeConfig>, CodecError> {
    if b.first() == Some(&b'{') {
        return Ok(serde_json::from_slice(b)?);
    }
    let mut r = b;
    match take(&mut r, 1)?[0] {
        ENTRY_V1 => {}
        v => return Err(CodecError::Unknown(v)),
    }
    let log_id = get_log_id(&mut r)?;
    let payload = match take(&mut r, 1)?[0] {
        0 => EntryPayload::Blank,
        1 => EntryPayload::Normal(Command(r.to_vec())),
        2 => EntryPayload::Membership(serde_json::from_slice(r)?),
        t => return Err(CodecError::Unknown(t)),
    };
    Ok(Entry { log_id, payload })
}

fn take<'a>(b: &mut &'a [u8], n: usize) -> Result<&'a [u8], CodecError> {
    if b.len() < n {
        return Err(CodecError::Truncated);
    }
    let (head, rest) = b.split_at(n);
    *b = rest;
    Ok(head)
}

fn get_u64(b: &mut &[u8]) -> Result<u64, CodecError> {
    let mut a = [0u8; 8];
    a.copy_from_slice(take(b, 8)?);
    Ok(u64::from_be_bytes(a))
}

fn put_log_id(out: &mut Vec<u8>, id: &LogId<NodeId>) {
    out.extend_from_slice(&id.leader_id.term.to_be_bytes());
    out.extend_from_slice(&id.leader_id.node_id.to_be_bytes());
    out.extend_from_slice(&id.index.to_be_bytes());
}

fn get_log_id(b: &mut &[u8]) -> Result<LogId<NodeId>, CodecError> {
    let term = get_u64(b)?;
    let node = get_u64(b)?;
    let index = get_u64(b)?;
    Ok(LogId::new(CommittedLeaderId::new(term, node), index))
}

fn put_opt_log_id(out: &mut Vec<u8>, id: &Option<LogId<NodeId>>) {
    match id {
        None => out.push(0),
        Some(id) => {
            out.push(1);
            put_log_id(out, id);
        }
    }
}

fn get_opt_log_id(b: &mut &[u8]) -> Result<Option<LogId<NodeId>>, CodecError> {
    match take(b, 1)?[0] {
        0 => Ok(None),
        1 => Ok(Some(get_log_id(b)?)),
        t => Err(CodecError::Unknown(t)),
    }
}

/// An append request of group `group`, binary (after the transport's frame byte): the group
/// (u64), the vote (term, node id: u64 each; committed: one byte 0/1), the previous log id
/// and the leader's commit (each: 0 for none, or 1 and a log id), the number of entries
/// (u32), then each entry's length (u32) and binary form.
pub fn encode_append(
    group: u64,
    r: &openraft::raft::AppendEntriesRequest<TypeConfig>,
    out: &mut Vec<u8>,
) -> Result<(), CodecError> {
    out.extend_from_slice(&group.to_be_bytes());
    out.extend_from_slice(&r.vote.leader_id.term.to_be_bytes());
    out.extend_from_slice(&r.vote.leader_id.node_id.to_be_bytes());
    out.push(u8::from(r.vote.committed));
    put_opt_log_id(out, &r.prev_log_id);
    put_opt_log_id(out, &r.leader_commit);
    // Bounded by max_payload_entries (256).
    out.extend_from_slice(&(r.entries.len() as u32).to_be_bytes());
    for e in &r.entries {
        let at = out.len();
        out.extend_from_slice(&[0; 4]);
        encode_entry(e, out)?;
        // An entry is at most the transport's frame (16 MiB).
        let len = (out.len() - at - 4) as u32;
        out[at..at + 4].copy_from_slice(&len.to_be_bytes());
    }
    Ok(())
}

/// Reads [`encode_append`]'s bytes: the group and the request.
pub fn decode_append(
    mut b: &[u8],
) -> Result<(u64, openraft::raft::AppendEntriesRequest<TypeConfig>), CodecError> {
    let group = get_u64(&mut b)?;
    let term = get_u64(&mut b)?;
    let node = get_u64(&mut b)?;
    let committed = take(&mut b, 1)?[0] != 0;
    let mut vote = Vote::new(term, node);
    vote.committed = committed;
    let prev_log_id = get_opt_log_id(&mut b)?;
    let leader_commit = get_opt_log_id(&mut b)?;
    let mut n = [0u8; 4];
    n.copy_from_slice(take(&mut b, 4)?);
    let n = u32::from_be_bytes(n) as usize;
    // Each entry takes at least 4 bytes: a count beyond what is there is a bad frame, not
    // an allocation.
    if n > b.len() / 4 {
        return Err(CodecError::Truncated);
    }
    let mut entries = Vec::with_capacity(n);
    for _ in 0..n {
        let mut l = [0u8; 4];
        l.copy_from_slice(take(&mut b, 4)?);
        let l = u32::from_be_bytes(l) as usize;
        entries.push(decode_entry(take(&mut b, l)?)?);
    }
    if !b.is_empty() {
        return Err(CodecError::Truncated);
    }
    Ok((
        group,
        openraft::raft::AppendEntriesRequest {
            vote,
            prev_log_id,
            leader_commit,
            entries,
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    /// openraft's entries and requests have no `PartialEq`: compared by their JSON.
    fn json<T: serde::Serialize>(v: &T) -> serde_json::Value {
        serde_json::to_value(v).expect("json")
    }

    fn entries() -> Vec<Entry<TypeConfig>> {
        let id = |i| LogId::new(CommittedLeaderId::new(3, 2), i);
        let members: BTreeSet<NodeId> = [1, 2, 3].into();
        vec![
            Entry {
                log_id: id(7),
                payload: EntryPayload::Blank,
            },
            Entry {
                log_id: id(8),
                payload: EntryPayload::Normal(Command(vec![0, 1, b'{', 255])),
            },
            Entry {
                log_id: id(9),
                payload: EntryPayload::Normal(Command(Vec::new())),
            },
            Entry {
                log_id: id(10),
                payload: EntryPayload::Membership(openraft::Membership::new(vec![members], None)),
            },
        ]
    }

    #[test]
    fn entries_round_trip_binary_and_json_entries_still_read() {
        for e in entries() {
            let mut b = Vec::new();
            encode_entry(&e, &mut b).expect("encode");
            assert_eq!(b[0], ENTRY_V1);
            assert_eq!(json(&decode_entry(&b).expect("decode")), json(&e));
            // A log written before holds JSON.
            let bytes = serde_json::to_vec(&e).expect("json");
            assert_eq!(json(&decode_entry(&bytes).expect("json decode")), json(&e));
        }
        // A command's bytes go as they are: 1 KB of message costs 1 KB plus 26 bytes.
        let big = Entry::<TypeConfig> {
            log_id: LogId::new(CommittedLeaderId::new(1, 1), 1),
            payload: EntryPayload::Normal(Command(vec![7; 1024])),
        };
        let mut b = Vec::new();
        encode_entry(&big, &mut b).expect("encode");
        assert_eq!(b.len(), 1024 + 26);
        assert!(decode_entry(&b[..20]).is_err());
        assert!(decode_entry(&[9]).is_err());
        assert!(decode_entry(&[]).is_err());
    }

    #[test]
    fn append_requests_round_trip_and_bad_ones_are_errors() {
        let mut vote = Vote::new(3, 2);
        vote.committed = true;
        let req = openraft::raft::AppendEntriesRequest::<TypeConfig> {
            vote,
            prev_log_id: Some(LogId::new(CommittedLeaderId::new(2, 1), 6)),
            leader_commit: None,
            entries: entries(),
        };
        let mut b = Vec::new();
        encode_append(42, &req, &mut b).expect("encode");
        let (g, back) = decode_append(&b).expect("decode");
        assert_eq!(g, 42);
        assert_eq!(json(&back), json(&req));
        // A heartbeat: no entries.
        let hb = openraft::raft::AppendEntriesRequest::<TypeConfig> {
            entries: Vec::new(),
            ..req.clone()
        };
        let mut b2 = Vec::new();
        encode_append(1, &hb, &mut b2).expect("encode");
        assert_eq!(json(&decode_append(&b2).expect("decode").1), json(&hb));
        // Every truncation is an error, never a panic; so is a byte too many.
        for n in 0..b.len() {
            assert!(decode_append(&b[..n]).is_err(), "truncated at {n}");
        }
        b.push(0);
        assert!(decode_append(&b).is_err());
        // A count of entries beyond the bytes there.
        let mut c = Vec::new();
        encode_append(1, &hb, &mut c).expect("encode");
        let at = c.len() - 4;
        c[at..].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(decode_append(&c).is_err());
    }
}
