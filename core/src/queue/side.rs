//! The queue side's state: the queues a shard owns, by id. Its handlers are the
//! composition's (`shard/queue_side.rs`); what it holds is reached through this record only.

use crate::idhash::IdMap;
use crate::ids::QueueId;
use crate::queue::state::QueueState;

/// The queues of one shard.
#[derive(Default)]
pub(crate) struct QueueSide {
    // Records boxed: a hash table keeps up to half its slots empty after growing, and an
    // empty slot of a boxed map costs a pointer instead of a whole record (a queue is ~400
    // bytes); with one queue, channel and connection per idle MQTT client this matters.
    pub(crate) queues: IdMap<QueueId, Box<QueueState>>,
    /// Queues that may hold messages with a TTL or have `x-expires`: `tick` looks at their
    /// heads and deadlines (not at every queue).
    pub(crate) expiring: std::collections::BTreeSet<QueueId>,
    /// Stream queues: dispatched after each sync (their consumers see synced messages
    /// only) and on `tick` (the stream protocol appends to their logs too).
    pub(crate) streams: std::collections::BTreeSet<QueueId>,
    /// Stream queues that held back a consumer with free prefetch (`queue::stream::Room`),
    /// and since when the oldest of them waits: `tick` lets them go `REFILL_HOLD_MS` later.
    pub(crate) refill_held: std::collections::BTreeSet<QueueId>,
    pub(crate) refill_held_since: Option<u64>,
    /// The consumers reading `streams` (`Broker::stream_readers`).
    pub(crate) stream_readers: crate::queue::stream::StreamReaders,
    /// Queues that ran empty with publishers still paused: `tick` resumes a wave of them
    /// each millisecond until one refills the queue or none is left (resumed publishers
    /// may have nothing more to send, and nothing else would wake the rest).
    pub(crate) starving: std::collections::BTreeSet<QueueId>,
    /// The arguments last set on a queue (`HeldArgs::shared`).
    pub(crate) last_args: Option<std::sync::Arc<crate::queue_args::QueueArgs>>,
    /// The declared arguments last set on a queue (`QueueState::set_arguments`).
    pub(crate) last_arguments: Option<std::sync::Arc<crate::message::FieldTable>>,
}
