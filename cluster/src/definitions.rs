//! The metadata group's state machine: a replicated map from keys to opaque records, one per
//! definition (vhost, user, permission, policy, exchange, binding, queue definition and its
//! location). The records are the serialized forms the broker already stores; this map does
//! not interpret them.
//!
//! It also carries the broker's metadata changes ([`DefCommand::Change`]): opaque to this
//! crate, kept in a bounded window in log order ([`Definitions::changes_after`]) from which
//! every node's broker applies them to its own core, in the same order everywhere
//! (docs/cluster.md, "What is replicated").
//!
//! Every applied command also advances a hash chain over (index, command): two nodes that
//! applied up to the same index in the same order have the same digest, which is how the
//! tests check "same commands, same order" on every node.

use std::collections::{BTreeMap, VecDeque};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::state_machine::StateMachine;

/// Keys are `<kind>/<name parts...>`; [`key`] builds them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Vhost,
    User,
    Permission,
    Policy,
    Exchange,
    Binding,
    Queue,
    /// Per-node facts other nodes show (a node's resource alarms).
    Node,
    /// MQTT sessions, one record per vhost and client id (docs/storage.md, "MQTT sessions
    /// in a cluster").
    Mqtt,
}

impl Kind {
    fn prefix(self) -> &'static str {
        match self {
            Kind::Vhost => "vhost",
            Kind::User => "user",
            Kind::Permission => "permission",
            Kind::Policy => "policy",
            Kind::Exchange => "exchange",
            Kind::Binding => "binding",
            Kind::Queue => "queue",
            Kind::Node => "node",
            Kind::Mqtt => "mqtt-session",
        }
    }
}

/// The key of a definition: its kind and the parts that name it (e.g. vhost and queue name).
/// Parts are length-prefixed so no name can forge another's key.
pub fn key(kind: Kind, parts: &[&str]) -> String {
    let mut k = String::from(kind.prefix());
    for p in parts {
        k.push('/');
        k.push_str(&p.len().to_string());
        k.push(':');
        k.push_str(p);
    }
    k
}

/// A change to the definitions.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum DefCommand {
    /// Sets `key` to `record`.
    Put { key: String, record: Vec<u8> },
    /// Removes `key`.
    Delete { key: String },
    /// Sets `key` only if its current record is `expected` (None: absent). Declares use it
    /// so two nodes declaring the same name concurrently cannot both win.
    PutIf {
        key: String,
        expected: Option<Vec<u8>>,
        record: Vec<u8>,
    },
    /// Removes `key` only if its current record is `expected`: a node ends an MQTT session
    /// it owns only if no other node took it meanwhile.
    DeleteIf { key: String, expected: Vec<u8> },
    /// A broker metadata change (a declare, a delete, a user...), opaque here: kept in the
    /// window every node's broker applies from. `origin` and `seq` let the proposing node
    /// match the entry to its waiting client.
    Change {
        origin: u64,
        seq: u64,
        change: Vec<u8>,
    },
}

/// A committed [`DefCommand::Change`], as [`Definitions::changes_after`] returns it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Change {
    /// Its log index: changes are applied in this order.
    pub index: u64,
    pub origin: u64,
    pub seq: u64,
    pub change: Vec<u8>,
}

/// How many changes the window keeps: a broker applies them within milliseconds of the
/// commit; one that falls further behind (or a member that came in by snapshot) sees a
/// gap and says so (docs/cluster.md, "Failure modes").
pub const CHANGE_WINDOW: usize = 4096;

/// The reply to a [`DefCommand`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum DefReply {
    /// Done; the record the key had before.
    Done { previous: Option<Vec<u8>> },
    /// A `PutIf` whose expectation failed: nothing changed; the current record.
    Conflict { current: Option<Vec<u8>> },
    /// The command could not be decoded (a node of another version?): nothing changed.
    Invalid { reason: String },
    /// A [`DefCommand::Change`] was committed at log `index`.
    Logged { index: u64 },
}

impl DefCommand {
    /// The bytes to propose to the group.
    pub fn encode(&self) -> crate::Command {
        // Serializing this enum of strings and bytes cannot fail.
        crate::Command(serde_json::to_vec(self).unwrap_or_default())
    }
}

impl DefReply {
    /// Decodes a reply from the group.
    pub fn decode(reply: &crate::Reply) -> Result<Self, serde_json::Error> {
        serde_json::from_slice(&reply.0)
    }
}

/// Upper bound on one record (a queue definition with arguments is a few hundred bytes);
/// bigger ones are refused so a bad client cannot balloon every node's memory.
pub const MAX_RECORD: usize = 1 << 20;

/// The replicated definitions map.
#[derive(Default, Serialize, Deserialize)]
pub struct Definitions {
    records: BTreeMap<String, Vec<u8>>,
    digest: [u8; 32],
    applied: u64,
    /// The last [`CHANGE_WINDOW`] changes, by index (in the snapshot too, so a node restarted
    /// from its snapshot still has the ones its broker may not have applied).
    #[serde(default)]
    changes: VecDeque<Change>,
    /// The index of the newest change that left the window (0: none did).
    #[serde(default)]
    evicted: u64,
}

impl Definitions {
    pub fn new() -> Self {
        Self::default()
    }
    pub fn get(&self, key: &str) -> Option<&[u8]> {
        self.records.get(key).map(Vec::as_slice)
    }
    /// The records whose keys start with `prefix`, in key order.
    pub fn scan<'a>(&'a self, prefix: &'a str) -> impl Iterator<Item = (&'a str, &'a [u8])> + 'a {
        self.records
            .range(prefix.to_string()..)
            .take_while(move |(k, _)| k.starts_with(prefix))
            .map(|(k, v)| (k.as_str(), v.as_slice()))
    }
    pub fn len(&self) -> usize {
        self.records.len()
    }
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }
    /// The hash chain over every command applied so far, in order.
    pub fn digest(&self) -> [u8; 32] {
        self.digest
    }
    /// How many commands were applied (including refused ones).
    pub fn applied(&self) -> u64 {
        self.applied
    }

    /// Up to `max` changes after log index `after`, in order, and the index of the newest
    /// change that left the window (a caller whose `after` is below it missed some; other
    /// entries, such as membership changes, take indexes too, so gaps between changes'
    /// indexes are normal).
    pub fn changes_after(&self, after: u64, max: usize) -> (u64, Vec<Change>) {
        let start = self.changes.partition_point(|c| c.index <= after);
        let out = self.changes.range(start..).take(max).cloned().collect();
        (self.evicted, out)
    }

    /// The index of the newest change (0 if none).
    pub fn last_change(&self) -> u64 {
        self.changes.back().map_or(0, |c| c.index)
    }

    fn run(&mut self, cmd: DefCommand) -> DefReply {
        let too_big = |r: &Vec<u8>| r.len() > MAX_RECORD;
        match cmd {
            DefCommand::Put { record, .. } | DefCommand::PutIf { record, .. }
                if too_big(&record) =>
            {
                DefReply::Invalid {
                    reason: format!("record over {MAX_RECORD} bytes"),
                }
            }
            DefCommand::Change { change, .. } if change.len() > MAX_RECORD => DefReply::Invalid {
                reason: format!("change over {MAX_RECORD} bytes"),
            },
            // Handled in `apply`, which knows the index.
            DefCommand::Change { .. } => DefReply::Invalid {
                reason: "change without an index".into(),
            },
            DefCommand::Put { key, record } => DefReply::Done {
                previous: self.records.insert(key, record),
            },
            DefCommand::Delete { key } => DefReply::Done {
                previous: self.records.remove(&key),
            },
            DefCommand::DeleteIf { key, expected } => {
                let current = self.records.get(&key);
                if current != Some(&expected) {
                    return DefReply::Conflict {
                        current: current.cloned(),
                    };
                }
                DefReply::Done {
                    previous: self.records.remove(&key),
                }
            }
            DefCommand::PutIf {
                key,
                expected,
                record,
            } => {
                let current = self.records.get(&key);
                if current != expected.as_ref() {
                    return DefReply::Conflict {
                        current: current.cloned(),
                    };
                }
                DefReply::Done {
                    previous: self.records.insert(key, record),
                }
            }
        }
    }
}

impl StateMachine for Definitions {
    fn apply(&mut self, index: u64, command: &[u8]) -> Vec<u8> {
        let mut h = Sha256::new();
        h.update(self.digest);
        h.update(index.to_be_bytes());
        h.update(command);
        self.digest = h.finalize().into();
        self.applied += 1;
        let reply = match serde_json::from_slice::<DefCommand>(command) {
            Ok(DefCommand::Change {
                origin,
                seq,
                change,
            }) if change.len() <= MAX_RECORD => {
                // A restart re-applies the log after the snapshot: keep each index once.
                if index > self.last_change() {
                    if self.changes.len() == CHANGE_WINDOW
                        && let Some(old) = self.changes.pop_front()
                    {
                        self.evicted = old.index;
                    }
                    self.changes.push_back(Change {
                        index,
                        origin,
                        seq,
                        change,
                    });
                }
                DefReply::Logged { index }
            }
            Ok(cmd) => self.run(cmd),
            Err(e) => DefReply::Invalid {
                reason: e.to_string(),
            },
        };
        serde_json::to_vec(&reply).unwrap_or_default()
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

    fn apply(d: &mut Definitions, i: u64, c: &DefCommand) -> DefReply {
        serde_json::from_slice(&d.apply(i, &c.encode().0)).unwrap()
    }

    #[test]
    fn put_delete_put_if_and_digest_follows_order() {
        let (mut a, mut b) = (Definitions::new(), Definitions::new());
        let k = key(Kind::Queue, &["/", "q1"]);
        let put = DefCommand::Put {
            key: k.clone(),
            record: b"r1".to_vec(),
        };
        let del = DefCommand::Delete { key: k.clone() };
        assert_eq!(apply(&mut a, 1, &put), DefReply::Done { previous: None });
        assert_eq!(
            apply(&mut a, 2, &del),
            DefReply::Done {
                previous: Some(b"r1".to_vec())
            }
        );
        // Same commands, other order: other state and other digest.
        apply(&mut b, 1, &del);
        apply(&mut b, 2, &put);
        assert_eq!(a.get(&k), None);
        assert_eq!(b.get(&k), Some(&b"r1"[..]));
        assert_ne!(a.digest(), b.digest());
        // PutIf: only one of two racing declares wins.
        let declare = |r: &[u8]| DefCommand::PutIf {
            key: k.clone(),
            expected: None,
            record: r.to_vec(),
        };
        assert!(matches!(
            apply(&mut a, 3, &declare(b"x")),
            DefReply::Done { .. }
        ));
        assert_eq!(
            apply(&mut a, 4, &declare(b"y")),
            DefReply::Conflict {
                current: Some(b"x".to_vec())
            }
        );
        // DeleteIf: only the record it expects.
        let del_if = |r: &[u8]| DefCommand::DeleteIf {
            key: k.clone(),
            expected: r.to_vec(),
        };
        assert!(matches!(
            apply(&mut a, 5, &del_if(b"y")),
            DefReply::Conflict { .. }
        ));
        assert_eq!(a.get(&k), Some(&b"x"[..]));
        assert!(matches!(
            apply(&mut a, 6, &del_if(b"x")),
            DefReply::Done { .. }
        ));
        assert_eq!(a.get(&k), None);
        // Garbage is refused the same way everywhere, never a panic.
        let r: DefReply = serde_json::from_slice(&a.apply(7, b"\xff not json")).unwrap();
        assert!(matches!(r, DefReply::Invalid { .. }));
        // Snapshot round trip keeps records and digest.
        let mut c = Definitions::new();
        c.restore(&a.snapshot()).unwrap();
        assert_eq!((c.get(&k), c.digest()), (a.get(&k), a.digest()));
    }

    #[test]
    fn changes_are_kept_in_log_order_once_and_bounded() {
        let mut d = Definitions::new();
        let change = |seq: u64| DefCommand::Change {
            origin: 2,
            seq,
            change: seq.to_be_bytes().to_vec(),
        };
        for i in 1..=3 {
            assert_eq!(apply(&mut d, i, &change(i)), DefReply::Logged { index: i });
        }
        // A restart re-applies entries the snapshot already had: not kept twice.
        apply(&mut d, 2, &change(2));
        let (evicted, got) = d.changes_after(1, 10);
        assert_eq!(evicted, 0);
        assert_eq!(got.iter().map(|c| c.index).collect::<Vec<_>>(), [2, 3]);
        assert_eq!((got[0].origin, got[0].seq), (2, 2));
        // Survives a snapshot.
        let mut e = Definitions::new();
        e.restore(&d.snapshot()).unwrap();
        assert_eq!(e.changes_after(0, 10), d.changes_after(0, 10));
        // Bounded: the oldest go, and a reader behind them can tell.
        for i in 4..=(CHANGE_WINDOW as u64 + 10) {
            apply(&mut d, i, &change(i));
        }
        let (evicted, got) = d.changes_after(0, 5);
        assert_eq!(evicted, 10);
        assert_eq!(got.len(), 5);
        assert_eq!(got[0].index, 11);
    }

    #[test]
    fn keys_cannot_collide_across_parts() {
        assert_ne!(
            key(Kind::Queue, &["a/1:b", "c"]),
            key(Kind::Queue, &["a", "b/1:c"])
        );
        assert_ne!(key(Kind::Queue, &["a"]), key(Kind::Exchange, &["a"]));
    }
}
