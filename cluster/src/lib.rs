//! Warren's cluster: Raft groups between `warren serve` nodes, on openraft 0.9 (docs/cluster.md).
//!
//! What exists now: one group type ([`TypeConfig`]) whose log carries opaque commands, a durable
//! log and vote store ([`log_store::LogStore`], one redb file per group, fsync'd before an
//! append is acknowledged), a byte-level state machine trait ([`state_machine::StateMachine`])
//! with snapshot build/install persisted next to the log, the metadata group's first state
//! machine ([`definitions::Definitions`], a replicated key -> record map), an authenticated TCP
//! transport ([`transport`]) and an in-process network for deterministic tests ([`mem`]).
//! The wiring of the definitions into the core's topology, and quorum queues, come with the
//! core's queue-type seam.

// openraft's traits fix the error types (StorageError, RPCError, ConfigError are 128-256
// bytes); boxing them in our helpers would only add unboxing at every trait boundary.
#![allow(clippy::result_large_err)]

pub mod codec;
pub mod definitions;
pub mod log_store;
pub mod mem;
mod membership;
pub mod node;
pub mod queue;
pub mod state_machine;
pub mod transport;

use std::io::Cursor;

/// openraft, for hosts that drive a group's handle (its metrics, its write responders).
pub use openraft;

use serde::{Deserialize, Serialize};

/// A node's id in the cluster (`--node-id`), unique and stable for its data directory.
pub type NodeId = u64;

/// A command in a group's log: opaque bytes the group's state machine decodes. One
/// [`TypeConfig`] (and so one log store and one transport) serves every kind of group.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Command(#[serde(with = "b64")] pub Vec<u8>);

/// What the state machine answered to a [`Command`] (opaque bytes, as the command).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reply(#[serde(with = "b64")] pub Vec<u8>);

/// Bytes as one base64 string in JSON (the log's entries and the wire's frames are JSON;
/// serde's default, an array of numbers, costs about four bytes per byte). Reads the old
/// array form too, so logs written before stay readable.
pub(crate) mod b64 {
    use base64::Engine;
    use base64::engine::general_purpose::STANDARD;
    use serde::de::{self, SeqAccess, Visitor};
    use serde::{Deserializer, Serializer};

    pub fn serialize<S: Serializer>(bytes: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&STANDARD.encode(bytes))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Vec<u8>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a base64 string or an array of bytes")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Vec<u8>, E> {
                STANDARD.decode(v).map_err(E::custom)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<u8>, A::Error> {
                let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 20));
                while let Some(b) = seq.next_element::<u8>()? {
                    out.push(b);
                }
                Ok(out)
            }
        }
        d.deserialize_any(V)
    }

    #[cfg(test)]
    mod tests {
        use crate::Command;

        #[test]
        fn commands_are_base64_and_the_old_array_form_still_reads() {
            let c = Command(vec![0, 1, 2, 255]);
            let json = serde_json::to_string(&c).expect("encode");
            assert_eq!(json, "\"AAEC/w==\"");
            assert_eq!(serde_json::from_str::<Command>(&json).expect("decode"), c);
            assert_eq!(
                serde_json::from_str::<Command>("[0,1,2,255]").expect("old form"),
                c
            );
        }
    }
}

openraft::declare_raft_types!(
    /// The Raft types of every Warren group.
    pub TypeConfig:
        D = Command,
        R = Reply,
        NodeId = NodeId,
        Node = openraft::BasicNode,
        Entry = openraft::Entry<TypeConfig>,
        SnapshotData = Cursor<Vec<u8>>,
        AsyncRuntime = openraft::TokioRuntime,
);

/// The Raft handle of a group.
pub type Raft = openraft::Raft<TypeConfig>;

/// The group id of the metadata group (quorum queues get their own ids later).
pub const META_GROUP: u64 = 0;

/// Raft timing and snapshot settings for a group. Election timeouts are what a client sees
/// as the pause after a leader dies (docs/cluster.md, "Failover").
pub fn raft_config(
    heartbeat_ms: u64,
    election_min_ms: u64,
    snapshot_every: u64,
) -> Result<std::sync::Arc<openraft::Config>, openraft::ConfigError> {
    let config = openraft::Config {
        cluster_name: "warren".into(),
        heartbeat_interval: heartbeat_ms,
        election_timeout_min: election_min_ms,
        election_timeout_max: election_min_ms * 2,
        snapshot_policy: openraft::SnapshotPolicy::LogsSinceLast(snapshot_every),
        // Entries kept after a snapshot: lagging followers catch up from the log rather
        // than by a snapshot when they are only a little behind.
        max_in_snapshot_log_to_keep: snapshot_every / 2,
        // Bounded snapshot chunks: each is one frame on the wire (transport::MAX_FRAME).
        // Purge in batches of a quarter snapshot period (openraft's default, 256, would keep
        // logs far longer than the snapshot makes necessary for a small period).
        purge_batch_size: (snapshot_every / 4).max(1),
        snapshot_max_chunk_size: 1024 * 1024,
        max_payload_entries: 256,
        ..Default::default()
    };
    Ok(std::sync::Arc::new(config.validate()?))
}
