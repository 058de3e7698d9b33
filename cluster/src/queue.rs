//! A quorum queue's group state machine (docs/cluster.md, "Quorum queues"): the messages the
//! queue holds, as its leader's broker stored them. The leader's store hands every write of
//! the queue (a message appended under its sequence number, one removed, a purge) to the
//! group as a [`QueueCommand`]; a publish is confirmed once the command carrying it is
//! committed (a majority has it on disk). Every member applies the same commands, so a new
//! leader holds every confirmed message not yet settled, and serves them from there.
//!
//! Messages are opaque bytes here (the broker's own record encoding), so this crate knows
//! nothing of AMQP.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::state_machine::StateMachine;

/// One write of the queue's store.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum QueueOp {
    /// Message `seq` (its record bytes) joined the queue; `expires_at` as the broker gave it.
    Append {
        seq: u64,
        expires_at: Option<u64>,
        message: Vec<u8>,
    },
    /// Message `seq` left the queue (acked, dropped, expired, returned to the tail as a new
    /// sequence number).
    Remove { seq: u64 },
    /// Every message from `seq` on left (a purge).
    RemoveFrom { seq: u64 },
}

/// A batch of writes, committed as one log entry (group commit: one sync of the broker).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueueCommand(pub Vec<QueueOp>);

/// The most message bytes one log entry carries: a broker sync with more becomes several
/// entries. With [`MAX_ENTRIES`] per append request and base64 in the JSON frame, a request
/// stays under the transport's 16 MiB frame limit.
pub const MAX_ENTRY_BYTES: usize = 1024 * 1024;
/// Entries per append request for a queue group.
pub const MAX_ENTRIES: u64 = 8;
/// The largest message a replicated quorum queue takes (one entry on its own, still under
/// the frame limit once base64'd).
pub const MAX_MESSAGE: usize = 8 * 1024 * 1024;

/// The bit that marks a sequence number of the queue's dead-letter log (at-least-once
/// dead-lettering: dead letters owed to their targets, `warren_core::queue::dlx`): that log
/// is carried in the queue's own group, so a new leader finds them with its messages. The
/// queue's own sequence numbers stay below it.
pub const DEAD_LETTER_BIT: u64 = 1 << 63;

/// The first byte of an encoded [`QueueCommand`] (its format's version): 1 without a
/// session, 2 with one ([`QueueCommand::encode_in`], [`QueueCommand::encode_session_start`]).
const FORMAT: u8 = 1;
const FORMAT_SESSION: u8 = 2;

/// The reply of a command whose writes a leader's broker made in another serving session
/// than the group's current one ([`QueueCommand::encode_in`]): not applied, and its proposer
/// fails the sync (its publishes are nacked).
pub const STALE: &[u8] = b"stale queue command: made in an earlier serving session";

impl QueueCommand {
    /// The bytes to propose to the group: binary, since a message is most of it. Byte by
    /// byte: the format (1), then per op a tag (1 append, 2 remove, 3 remove-from) and the
    /// sequence number (u64 big-endian); an append then has 0, or 1 and `expires_at` (u64),
    /// and the message's length (u32) and bytes.
    pub fn encode(&self) -> crate::Command {
        self.encode_with(None)
    }

    /// The bytes to propose for writes a leader's broker made while it served the queue in
    /// serving session `session` (the log index of the session's start,
    /// [`QueueCommand::encode_session_start`]; format 2: the format byte, the session as u64
    /// big-endian, then the ops as in format 1). Every member applies them only while that
    /// session is the group's latest ([`STALE`] otherwise): writes the broker made from the
    /// queue as loaded in one session (its sequence numbers, which messages it holds) are
    /// meaningless against the group's state once another session started (another leader,
    /// or this node again after losing the leadership), even when the proposal reaches the
    /// log only after it (docs/cluster.md, "Quorum queues").
    pub fn encode_in(&self, session: u64) -> crate::Command {
        self.encode_with(Some(session))
    }

    /// The command a leader commits before its broker loads the queue: applied, it starts a
    /// new serving session numbered by its own log index (format 2, session 0, no ops), and
    /// every write of an earlier session that comes after it in the log is refused.
    pub fn encode_session_start() -> crate::Command {
        QueueCommand(Vec::new()).encode_with(Some(0))
    }

    fn encode_with(&self, session: Option<u64>) -> crate::Command {
        let size: usize = self
            .0
            .iter()
            .map(|op| match op {
                QueueOp::Append { message, .. } => 22 + message.len(),
                _ => 9,
            })
            .sum();
        let mut out = Vec::with_capacity(9 + size);
        match session {
            None => out.push(FORMAT),
            Some(t) => {
                out.push(FORMAT_SESSION);
                out.extend_from_slice(&t.to_be_bytes());
            }
        }
        for op in &self.0 {
            match op {
                QueueOp::Append {
                    seq,
                    expires_at,
                    message,
                } => {
                    out.push(1);
                    out.extend_from_slice(&seq.to_be_bytes());
                    match expires_at {
                        Some(t) => {
                            out.push(1);
                            out.extend_from_slice(&t.to_be_bytes());
                        }
                        None => out.push(0),
                    }
                    // A message is at most the broker's frame limit, far below 4 GiB.
                    out.extend_from_slice(&(message.len() as u32).to_be_bytes());
                    out.extend_from_slice(message);
                }
                QueueOp::Remove { seq } => {
                    out.push(2);
                    out.extend_from_slice(&seq.to_be_bytes());
                }
                QueueOp::RemoveFrom { seq } => {
                    out.push(3);
                    out.extend_from_slice(&seq.to_be_bytes());
                }
            }
        }
        crate::Command(out)
    }

    /// Reads [`QueueCommand::encode`]'s bytes.
    pub fn decode(b: &[u8]) -> Result<QueueCommand, String> {
        Self::decode_with_session(b).map(|(_, c)| c)
    }

    /// Reads [`QueueCommand::encode`]'s or [`QueueCommand::encode_in`]'s bytes: the session
    /// (format 2) and the command.
    pub fn decode_with_session(mut b: &[u8]) -> Result<(Option<u64>, QueueCommand), String> {
        fn take<'a>(b: &mut &'a [u8], n: usize) -> Result<&'a [u8], String> {
            if b.len() < n {
                return Err("truncated queue command".into());
            }
            let (head, rest) = b.split_at(n);
            *b = rest;
            Ok(head)
        }
        fn u64_of(b: &mut &[u8]) -> Result<u64, String> {
            let mut a = [0u8; 8];
            a.copy_from_slice(take(b, 8)?);
            Ok(u64::from_be_bytes(a))
        }
        let session = match take(&mut b, 1)?[0] {
            FORMAT => None,
            FORMAT_SESSION => Some(u64_of(&mut b)?),
            v => return Err(format!("queue command format {v} unknown")),
        };
        let mut ops = Vec::new();
        while !b.is_empty() {
            let tag = take(&mut b, 1)?[0];
            let seq = u64_of(&mut b)?;
            ops.push(match tag {
                1 => {
                    let expires_at = match take(&mut b, 1)?[0] {
                        0 => None,
                        _ => Some(u64_of(&mut b)?),
                    };
                    let mut l = [0u8; 4];
                    l.copy_from_slice(take(&mut b, 4)?);
                    let len = u32::from_be_bytes(l) as usize;
                    QueueOp::Append {
                        seq,
                        expires_at,
                        message: take(&mut b, len)?.to_vec(),
                    }
                }
                2 => QueueOp::Remove { seq },
                3 => QueueOp::RemoveFrom { seq },
                t => return Err(format!("queue op {t} unknown")),
            });
        }
        Ok((session, QueueCommand(ops)))
    }
}

/// A message the queue holds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Held {
    pub expires_at: Option<u64>,
    #[serde(with = "crate::b64")]
    pub message: Vec<u8>,
}

/// The replicated queue: its messages by sequence number, and the next sequence number a
/// new leader issues (above every one ever appended, so no two messages share one).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueueReplica {
    pub messages: BTreeMap<u64, Held>,
    pub next_seq: u64,
    /// Commands applied, session starts not counted (tests compare members with it; a
    /// member's broker takes a count above 0 as a leader serving the group: the empty
    /// command each new leader writes once its broker serves, after its session start).
    pub applied: u64,
    /// The current serving session: the log index of the last session start applied
    /// ([`QueueCommand::encode_session_start`]); 0 before any.
    #[serde(default)]
    pub session: u64,
}

impl QueueReplica {
    pub fn new() -> Self {
        Self::default()
    }

    fn apply_op(&mut self, op: QueueOp) {
        match op {
            QueueOp::Append {
                seq,
                expires_at,
                message,
            } => {
                if seq & DEAD_LETTER_BIT == 0 {
                    self.next_seq = self.next_seq.max(seq.saturating_add(1));
                }
                self.messages.insert(
                    seq,
                    Held {
                        expires_at,
                        message,
                    },
                );
            }
            QueueOp::Remove { seq } => {
                self.messages.remove(&seq);
            }
            QueueOp::RemoveFrom { seq } => {
                // A purge of the queue's messages keeps the dead-letter log, and one of the
                // dead-letter log keeps the messages.
                let mut from = self.messages.split_off(&seq);
                if seq & DEAD_LETTER_BIT == 0 {
                    let mut dead = from.split_off(&DEAD_LETTER_BIT);
                    self.messages.append(&mut dead);
                }
            }
        }
    }
}

impl StateMachine for QueueReplica {
    fn apply(&mut self, index: u64, command: &[u8]) -> Vec<u8> {
        let decoded = QueueCommand::decode_with_session(command);
        if let Ok((Some(0), _)) = decoded {
            self.session = index;
            return Vec::new();
        }
        self.applied += 1;
        match decoded {
            Ok((Some(made), _)) if made != self.session => {
                // Every member has the same session at this entry: every member skips it.
                tracing::debug!(
                    target: "warren::qq::trace",
                    made,
                    session = self.session,
                    index,
                    "quorum queue: command of an earlier session skipped"
                );
                STALE.to_vec()
            }
            Ok((_, QueueCommand(ops))) => {
                for op in ops {
                    self.apply_op(op);
                }
                Vec::new()
            }
            // Every member takes the same path on the same bytes: nothing changes anywhere.
            Err(e) => format!("undecodable queue command: {e}").into_bytes(),
        }
    }

    fn snapshot(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    fn restore(&mut self, snapshot: &[u8]) -> Result<(), String> {
        *self = serde_json::from_slice(snapshot).map_err(|e| e.to_string())?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn append(seq: u64) -> QueueOp {
        QueueOp::Append {
            seq,
            expires_at: None,
            message: vec![seq as u8],
        }
    }

    #[test]
    fn appends_removes_and_purges_replay_the_same_everywhere() {
        let log = [
            QueueCommand(vec![append(0), append(1), append(2)]),
            QueueCommand(vec![QueueOp::Remove { seq: 1 }, append(3)]),
            QueueCommand(vec![QueueOp::RemoveFrom { seq: 2 }, append(4)]),
        ];
        let mut a = QueueReplica::new();
        for (i, c) in log.iter().enumerate() {
            assert!(a.apply(i as u64 + 1, &c.encode().0).is_empty());
        }
        assert_eq!(a.messages.keys().copied().collect::<Vec<_>>(), vec![0, 4]);
        assert_eq!(a.next_seq, 5);
        // A member restored from a's snapshot is a.
        let mut b = QueueReplica::new();
        b.restore(&a.snapshot()).expect("snapshot");
        assert_eq!(a, b);
        // Bytes that are no command change nothing and answer why.
        let before = a.clone();
        assert!(!a.apply(4, b"junk").is_empty());
        assert!(!a.apply(5, &[1, 1, 0]).is_empty(), "truncated");
        assert_eq!(a.messages, before.messages);
        // The empty command a new leader writes once it serves: counted, changes nothing.
        let applied = a.applied;
        assert!(a.apply(6, &QueueCommand(Vec::new()).encode().0).is_empty());
        assert_eq!(a.applied, applied + 1);
        assert_eq!(a.messages, before.messages);
        // The dead-letter log shares the map: a purge of either leaves the other, and its
        // numbers do not move the queue's next one.
        let mut d = QueueReplica::new();
        let log = QueueCommand(vec![
            append(0),
            append(1),
            append(DEAD_LETTER_BIT),
            append(DEAD_LETTER_BIT | 1),
            QueueOp::RemoveFrom { seq: 1 },
        ]);
        d.apply(1, &log.encode().0);
        assert_eq!(
            d.messages.keys().copied().collect::<Vec<_>>(),
            vec![0, DEAD_LETTER_BIT, DEAD_LETTER_BIT | 1]
        );
        assert_eq!(d.next_seq, 2);
        let purge_dead = QueueCommand(vec![QueueOp::RemoveFrom {
            seq: DEAD_LETTER_BIT,
        }]);
        d.apply(2, &purge_dead.encode().0);
        assert_eq!(d.messages.keys().copied().collect::<Vec<_>>(), vec![0]);
        let with_expiry = QueueCommand(vec![QueueOp::Append {
            seq: 9,
            expires_at: Some(77),
            message: b"body".to_vec(),
        }]);
        assert_eq!(
            QueueCommand::decode(&with_expiry.encode().0).expect("decode"),
            with_expiry
        );
        // Serving sessions: a session start at index 7 makes writes of session 7 apply and
        // refuses those of another; the snapshot keeps the session.
        let mut e = QueueReplica::new();
        assert_eq!(
            QueueCommand::decode_with_session(&with_expiry.encode_in(7).0).expect("decode"),
            (Some(7), with_expiry.clone())
        );
        assert!(
            e.apply(7, &QueueCommand::encode_session_start().0)
                .is_empty()
        );
        assert_eq!(
            (e.session, e.applied),
            (7, 0),
            "a session start is not counted"
        );
        assert!(e.apply(8, &with_expiry.encode_in(7).0).is_empty());
        assert_eq!(
            e.apply(9, &QueueCommand(vec![append(9)]).encode_in(3).0),
            STALE
        );
        assert_eq!(e.messages.keys().copied().collect::<Vec<_>>(), vec![9]);
        assert!(
            e.apply(10, &QueueCommand::encode_session_start().0)
                .is_empty()
        );
        assert_eq!(
            e.apply(
                11,
                &QueueCommand(vec![QueueOp::Remove { seq: 9 }])
                    .encode_in(7)
                    .0
            ),
            STALE
        );
        let mut f = QueueReplica::new();
        f.restore(&e.snapshot()).expect("snapshot");
        assert_eq!((f.session, f.messages.len()), (10, 1));
    }
}
