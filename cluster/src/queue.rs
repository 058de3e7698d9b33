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

impl QueueCommand {
    /// The bytes to propose to the group.
    pub fn encode(&self) -> crate::Command {
        // A vector of integers and byte strings always serializes.
        crate::Command(serde_json::to_vec(self).unwrap_or_default())
    }
}

/// A message the queue holds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Held {
    pub expires_at: Option<u64>,
    pub message: Vec<u8>,
}

/// The replicated queue: its messages by sequence number, and the next sequence number a
/// new leader issues (above every one ever appended, so no two messages share one).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueueReplica {
    pub messages: BTreeMap<u64, Held>,
    pub next_seq: u64,
    /// Commands applied (tests compare members with it).
    pub applied: u64,
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
                self.next_seq = self.next_seq.max(seq.saturating_add(1));
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
                self.messages.split_off(&seq);
            }
        }
    }
}

impl StateMachine for QueueReplica {
    fn apply(&mut self, _index: u64, command: &[u8]) -> Vec<u8> {
        self.applied += 1;
        match serde_json::from_slice::<QueueCommand>(command) {
            Ok(QueueCommand(ops)) => {
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
        assert_eq!(a.messages, before.messages);
    }
}
