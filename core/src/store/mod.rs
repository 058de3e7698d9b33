//! Storage, injected by the host: the core decides *what* must be stored and *when* it may be
//! considered safe; the host's [`Store`] decides *how* (segment files natively, memory in the
//! browser and in simulation tests).
//!
//! The contract, which keeps the core deterministic:
//! - Writes ([`Store::append`], [`Store::define`]) are accepted in call order and are readable
//!   at once ([`Store::read`]), but durable only once the sync that covers them completes.
//! - [`Store::sync`] starts a sync of everything written so far under an epoch the core chose;
//!   the host reports its completion with [`crate::Broker::synced`]. Publisher confirms of
//!   persistent messages on durable queues wait for it (group commit: one sync covers every
//!   write made before it started).
//! - Removals ([`Store::remove`], [`Store::remove_from`], [`Store::delete_queue`]) need no sync:
//!   losing one in a crash only brings a message back, which at-least-once delivery allows.
//! - Errors never lose a confirmed message: a failed append nacks the publish instead of
//!   confirming it, and the message stays in memory.

mod memory;
mod schedule;
mod stream;

pub use memory::MemoryStore;
pub use schedule::{ScheduleKey, ScheduleRecovery, ScheduledMessage};
pub use stream::{MemLog, SharedStreams, StreamBounds, StreamEntry, StreamSettings, StreamStart};

use crate::access::{PermissionDef, TopicPermissionDef, UserDef, VhostDef};
use crate::command::{Bind, ExchangeDeclare, QueueDeclare};
use crate::ids::QueueId;
use crate::message::Message;
use std::sync::Arc;

/// A change to the durable definitions (only durable entities are reported). Exchanges,
/// queues, bindings and policies are named within their vhost.
#[derive(Clone, Copy, Debug)]
pub enum DefinitionChange<'a> {
    /// A vhost was added.
    VhostAdded(&'a VhostDef),
    /// Its exchanges, queues, bindings, policies and permissions were deleted before (each
    /// reported on its own).
    VhostDeleted(&'a str),
    /// A user was added or changed (password, tags).
    UserPut(&'a UserDef),
    /// Also removes the user's permissions.
    UserDeleted(&'a str),
    /// A user's permissions in a vhost were set.
    PermissionSet(&'a PermissionDef),
    /// A user's permissions in a vhost were cleared.
    PermissionCleared {
        /// The vhost it is in.
        vhost: &'a str,
        /// The user.
        user: &'a str,
    },
    /// A user's topic permissions on an exchange of a vhost were set.
    TopicPermissionSet(&'a TopicPermissionDef),
    /// A user's topic permissions in a vhost were cleared: on one exchange, or (`None`) on
    /// every exchange.
    TopicPermissionCleared {
        /// The vhost.
        vhost: &'a str,
        /// The user.
        user: &'a str,
        /// The exchange; `None`: all.
        exchange: Option<&'a str>,
    },
    /// A durable exchange was declared.
    ExchangeDeclared {
        /// The vhost it is in.
        vhost: &'a str,
        /// The declare, as replayed at restore.
        def: &'a ExchangeDeclare,
    },
    /// Also removes every stored binding from or to the exchange.
    ExchangeDeleted {
        /// The vhost it is in.
        vhost: &'a str,
        /// Its name.
        name: &'a str,
    },
    /// A durable queue was declared.
    QueueDeclared {
        /// The vhost it is in.
        vhost: &'a str,
        /// The declare, as replayed at restore.
        def: &'a QueueDeclare,
    },
    /// Also removes every stored binding to the queue, and its messages.
    QueueDeleted {
        /// The vhost it is in.
        vhost: &'a str,
        /// Its name.
        name: &'a str,
    },
    /// A binding between two durable ends; `to_exchange` tells what `destination` names.
    Bound {
        /// The vhost it is in.
        vhost: &'a str,
        /// The binding.
        bind: &'a Bind,
        /// The destination is an exchange.
        to_exchange: bool,
    },
    /// A stored binding was removed.
    Unbound {
        /// The vhost it is in.
        vhost: &'a str,
        /// The binding.
        bind: &'a Bind,
        /// The destination is an exchange.
        to_exchange: bool,
    },
    /// A policy was set.
    PolicySet(&'a crate::policy::PolicyDef),
    /// A policy was cleared.
    PolicyCleared {
        /// The vhost it is in.
        vhost: &'a str,
        /// Its name.
        name: &'a str,
    },
    /// A runtime parameter was set.
    ParameterSet(&'a crate::parameter::ParameterDef),
    /// A runtime parameter was cleared.
    ParameterCleared {
        /// The vhost it is in.
        vhost: &'a str,
        /// Its component.
        component: &'a str,
        /// Its name.
        name: &'a str,
    },
    /// An MQTT retained message was set (replacing its topic's previous one).
    RetainedSet {
        /// The vhost it is in.
        vhost: &'a str,
        /// The message.
        message: &'a crate::mqtt::RetainedMessage,
    },
    /// An MQTT retained message is gone (cleared, expired, or its vhost deleted).
    RetainedCleared {
        /// The vhost it was in.
        vhost: &'a str,
        /// Its topic.
        topic: &'a str,
    },
}

/// Durable definitions, as a host loads them at start-up: replayed into the core in this
/// order (vhosts, users, permissions, policies, exchanges, queues, then bindings, which refer
/// to both). Exchanges, queues and bindings come with their vhost's name.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Definitions {
    /// Vhosts.
    pub vhosts: Vec<VhostDef>,
    /// Users.
    pub users: Vec<UserDef>,
    /// Permissions.
    pub permissions: Vec<PermissionDef>,
    /// Topic permissions (replayed after permissions).
    pub topic_permissions: Vec<TopicPermissionDef>,
    /// Policies.
    pub policies: Vec<crate::policy::PolicyDef>,
    /// Runtime parameters (restored after the policies, on shard 0 only).
    pub parameters: Vec<crate::parameter::ParameterDef>,
    /// Durable exchanges, with their vhost.
    pub exchanges: Vec<(String, ExchangeDeclare)>,
    /// Durable queues, with their vhost.
    pub queues: Vec<(String, QueueDeclare)>,
    /// (vhost, binding, destination is an exchange).
    pub bindings: Vec<(String, Bind, bool)>,
    /// MQTT retained messages, with their vhost (restored last, into topology).
    pub retained: Vec<(String, crate::mqtt::RetainedMessage)>,
}

/// What a store already holds for a queue when the core opens it (recovery).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QueueRecovery {
    /// Stored messages still to be delivered.
    pub count: u64,
    /// Their body bytes.
    pub bytes: u64,
    /// The lowest sequence number among them (0 when there are none).
    pub first_seq: u64,
    /// The next sequence number to issue: above every stored one.
    pub next_seq: u64,
}

/// A message read back from a store.
#[derive(Clone, Debug)]
pub struct StoredMessage {
    /// Its position in its queue.
    pub seq: u64,
    /// The message.
    pub message: Arc<Message>,
    /// It survived a restart: it may have been delivered before (delivery is not recorded on
    /// disk, so every recovered message is flagged, as RabbitMQ's CQv2 does).
    pub redelivered: bool,
    /// When it expires (TTL), in the host's clock, as given to `append`.
    pub expires_at: Option<u64>,
}

/// Why a store operation failed. The host logs the details; the core only needs to know it
/// failed, and never confirms what was not stored.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("store: {0}")]
pub struct StoreError(pub String);

/// Where messages and definitions go. See the module docs for the contract.
pub trait Store: Send {
    /// Records a change to the durable definitions.
    fn define(&mut self, change: DefinitionChange<'_>) -> Result<(), StoreError>;

    /// Opens the message log of a queue under the core's id `queue`. A durable queue gets back
    /// what the store holds for `name` in `vhost`; a transient one starts empty (leftovers
    /// are dropped).
    fn open_queue(
        &mut self,
        queue: QueueId,
        vhost: &str,
        name: &str,
        durable: bool,
    ) -> QueueRecovery;

    /// Stores message `seq` of `queue`. Sequence numbers of one queue only grow. A fanout
    /// appends the same `Arc` to several queues; a store may keep its body once.
    fn append(
        &mut self,
        queue: QueueId,
        seq: u64,
        message: &Arc<Message>,
        expires_at: Option<u64>,
    ) -> Result<(), StoreError>;

    /// Every message appended to `queue` from now on survives a restart whatever its
    /// delivery mode (a quorum queue keeps transient messages too); otherwise only
    /// persistent messages of a durable queue do.
    fn keep_every_message(&mut self, queue: QueueId) {
        let _ = queue;
    }

    /// Whether this node serves `queue` now. A replicated quorum queue is served by the
    /// node that leads its group only; elsewhere [`Store::append`] refuses its messages, and
    /// that refusal (the publisher gets a nack) is no failure of the store: it raises no
    /// alarm.
    fn serves(&self, queue: QueueId) -> bool {
        let _ = queue;
        true
    }

    /// The message left the queue (acked, dropped, purged).
    fn remove(&mut self, queue: QueueId, seq: u64);

    /// Every stored message of `queue` with a sequence number >= `from_seq` left the queue.
    fn remove_from(&mut self, queue: QueueId, from_seq: u64);

    /// Reads up to `max` stored messages of `queue` with sequence numbers >= `from_seq`, in
    /// order, into `out`.
    fn read(
        &mut self,
        queue: QueueId,
        from_seq: u64,
        max: usize,
        out: &mut Vec<StoredMessage>,
    ) -> Result<(), StoreError>;

    /// The queue is gone with everything it stored.
    fn delete_queue(&mut self, queue: QueueId);

    /// Starts making every write so far durable; the host calls [`crate::Broker::synced`]
    /// with `epoch` once it is.
    fn sync(&mut self, epoch: u64);

    /// Hands buffered writes to the operating system without waiting for the disk (the core
    /// calls it after each batch that needs no sync), so acks and pages survive a crash of
    /// the process, if not of the machine.
    fn flush(&mut self) {}

    // Streams (`x-queue-type: stream`): an append-only log per stream, read from any offset
    // by any number of consumers. A store that has no streams refuses them (the declare
    // fails). See `stream.rs` for the vocabulary.

    /// Opens (creating it if new) the log of stream `queue`, named `name` in `vhost`: the
    /// same log the stream protocol serves under that name. Streams are always durable.
    fn stream_open(
        &mut self,
        queue: QueueId,
        vhost: &str,
        name: &str,
        settings: &StreamSettings,
    ) -> Result<StreamBounds, StoreError> {
        let _ = (queue, vhost, name, settings);
        Err(StoreError("this store has no streams".into()))
    }

    /// Appends one message (AMQP 1.0 bytes) stamped `timestamp_ms`; the messages appended
    /// between two syncs (or flushes) may form one chunk. Durable, and readable, once the next
    /// [`Store::sync`] completes.
    fn stream_append(
        &mut self,
        queue: QueueId,
        data: bytes::Bytes,
        timestamp_ms: u64,
    ) -> Result<(), StoreError> {
        let _ = (queue, data, timestamp_ms);
        Err(StoreError("this store has no streams".into()))
    }

    /// The offsets stream `queue` holds (`next` counts appends not yet synced).
    fn stream_bounds(&mut self, queue: QueueId) -> Result<StreamBounds, StoreError> {
        let _ = queue;
        Err(StoreError("this store has no streams".into()))
    }

    /// Resolves where a consumer of stream `queue` starts.
    fn stream_start(&mut self, queue: QueueId, start: StreamStart) -> Result<u64, StoreError> {
        let _ = (queue, start);
        Err(StoreError("this store has no streams".into()))
    }

    /// Reads committed messages of stream `queue` from offset `from` (from the first
    /// retained one if `from` was dropped), in order, into `out`: about `max`, whole chunks
    /// (a store may return the rest of a chunk it had to read anyway).
    fn stream_read(
        &mut self,
        queue: QueueId,
        from: u64,
        max: usize,
        out: &mut Vec<StreamEntry>,
    ) -> Result<(), StoreError> {
        let _ = (queue, from, max, out);
        Err(StoreError("this store has no streams".into()))
    }

    // Scheduled messages (delayed delivery, docs/delayed.md): kept in due order, read back
    // from any key. A store without a schedule refuses them (the publish is nacked).

    /// Stores scheduled message `m`; durable (when `m.durable`) once the next sync completes,
    /// and readable at once.
    fn schedule_add(&mut self, m: &ScheduledMessage) -> Result<(), StoreError> {
        let _ = m;
        Err(StoreError("this store has no schedule".into()))
    }

    /// Scheduled message `key` was routed (or dropped): it is gone. Like every removal it
    /// needs no sync of its own, but a store must not make it durable before the writes made
    /// before it (the enqueues of its message).
    fn schedule_remove(&mut self, key: ScheduleKey) {
        let _ = key;
    }

    /// Reads up to `max` stored scheduled messages with keys above `after` (all: `None`), in
    /// key order, into `out`.
    fn schedule_read(
        &mut self,
        after: Option<ScheduleKey>,
        max: usize,
        out: &mut Vec<ScheduledMessage>,
    ) -> Result<(), StoreError> {
        let _ = (after, max, out);
        Ok(())
    }

    /// Removes every scheduled message of exchange `exchange` in `vhost`; returns how many.
    fn schedule_purge(&mut self, vhost: &str, exchange: &str) -> u64 {
        let _ = (vhost, exchange);
        0
    }

    /// What the store holds of the schedule (called once, at restore).
    fn schedule_recover(&mut self) -> ScheduleRecovery {
        ScheduleRecovery::default()
    }
}
