//! At-least-once dead-lettering of a quorum queue (RabbitMQ 3.10's `rabbit_fifo_dlx`,
//! `x-dead-letter-strategy: at-least-once` with `x-overflow: reject-publish`): a message
//! that dies (rejected or nacked without requeue, expired, over `x-delivery-limit`) stays in
//! its queue's custody, as a *dead letter*, until every queue its dead-letter exchange routes
//! it to has confirmed it; it counts against the queue's length limits meanwhile, as
//! RabbitMQ counts its "dlx" messages.
//!
//! The dead letters of a queue are kept in a log of their own beside the queue's (the
//! store's queue named by [`store_name`], keyed [`store_id`]): a dead letter is appended there
//! in the form it is forwarded in (`x-death` recorded, the dead-letter exchange and routing
//! key set), and removed once confirmed. So a restart, or a replicated queue's new leader
//! (the cluster layer carries this log in the queue's own Raft group), finds the dead
//! letters still owed and forwards them again. This module is the queue's part (what it
//! holds); the forwarding is the broker's (`shard/dlx.rs`).

use crate::ids::QueueId;
use crate::message::Message;
use std::collections::BTreeMap;
use std::sync::Arc;

/// The bit that makes a dead-letter log's store id from its queue's (queue ids stay far
/// below it).
const STORE_BIT: u64 = 1 << 62;

/// The store id of queue `id`'s dead-letter log.
pub(crate) fn store_id(id: QueueId) -> QueueId {
    QueueId(id.0 | STORE_BIT)
}

/// The prefix of a dead-letter log's name in the store: no client can declare a queue
/// named so (`amq.` names are the server's), so it never meets a queue's own log.
pub const STORE_PREFIX: &str = "amq.warren.dlx.";

/// The name of queue `name`'s dead-letter log in the store.
pub(crate) fn store_name(name: &str) -> String {
    format!("{STORE_PREFIX}{name}")
}

/// One dead letter still owed to its targets.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct DeadLetter {
    /// As forwarded: to the dead-letter exchange, with its routing key and `x-death`.
    pub(crate) message: Arc<Message>,
    /// The store has it (a failed write keeps it in memory only).
    pub(crate) stored: bool,
    /// Target queues that confirmed it: a retry skips them (RabbitMQ's `settled`).
    pub(crate) settled: Vec<QueueId>,
    /// Answers still awaited from the targets of the current attempt.
    pub(crate) in_flight: u32,
    /// A target of the current attempt refused it (store, length limit, no leader).
    pub(crate) failed: bool,
    /// The current attempt (answers to an older one are ignored).
    pub(crate) attempt: u32,
    /// When the current attempt was sent, or when to try again (`None`: now).
    pub(crate) at: Option<u64>,
    /// The sync epoch a target's confirm waits for (a persistent message on a durable
    /// queue of this shard is durable once that epoch is synced).
    pub(crate) epoch: Option<u64>,
    /// Every target took it: it leaves once `epoch` is synced.
    pub(crate) confirmed: bool,
}

impl DeadLetter {
    pub(crate) fn new(message: Arc<Message>, stored: bool) -> DeadLetter {
        DeadLetter {
            message,
            stored,
            settled: Vec::new(),
            in_flight: 0,
            failed: false,
            attempt: 0,
            at: None,
            epoch: None,
            confirmed: false,
        }
    }
}

/// A quorum queue's dead letters, by their sequence number in the dead-letter log.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct DeadLetters {
    /// The dead-letter log was opened in the store (it is opened on first use).
    pub(crate) open: bool,
    pub(crate) next_seq: u64,
    pub(crate) held: BTreeMap<u64, DeadLetter>,
    /// Body bytes held (length limits count them).
    pub(crate) bytes: u64,
}

impl DeadLetters {
    /// Dead letters held.
    pub(crate) fn len(&self) -> u64 {
        self.held.len() as u64
    }

    /// Holds `d` under the next sequence number, which it returns.
    pub(crate) fn push(&mut self, d: DeadLetter) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.bytes += d.message.body_len() as u64;
        self.held.insert(seq, d);
        seq
    }

    /// Takes dead letter `seq` out (confirmed, or purged).
    pub(crate) fn take(&mut self, seq: u64) -> Option<DeadLetter> {
        let d = self.held.remove(&seq)?;
        self.bytes = self.bytes.saturating_sub(d.message.body_len() as u64);
        Some(d)
    }

    /// Takes every dead letter out (a purge, a reload), leaving the numbering.
    pub(crate) fn take_all(&mut self) -> BTreeMap<u64, DeadLetter> {
        self.bytes = 0;
        std::mem::take(&mut self.held)
    }
}

/// Dead letters read back from the store per call while a queue opens its log.
const READ_BATCH: usize = 1024;

impl crate::queue::state::QueueState {
    /// Whether this queue dead-letters at least once: a quorum queue with a dead-letter
    /// exchange whose effective strategy is at-least-once (`set_args` falls back to
    /// at-most-once without `reject-publish`, as RabbitMQ's `dlh/5` does).
    pub(crate) fn at_least_once(&self) -> bool {
        (crate::queue::quorum::QUORUM && self.quorum.is_some())
            && self.args.dead_letter_exchange.is_some()
            && self.args.dead_letter_strategy == crate::queue_args::DeadLetterStrategy::AtLeastOnce
    }

    /// Dead letters held, and their body bytes (length limits count them).
    pub(crate) fn dead_held(&self) -> (u64, u64) {
        self.quorum
            .as_deref()
            .filter(|_| crate::queue::quorum::QUORUM)
            .map_or((0, 0), |f| (f.dead.len(), f.dead.bytes))
    }

    /// Opens the dead-letter log (once; again after `forget_dead_letters`): the dead letters
    /// the store recovers for it are held again, to be forwarded anew.
    pub(crate) fn open_dead_letters(&mut self, io: &mut super::state::QueueIo<'_>, vhost: &str) {
        let id = self.id;
        let name = store_name(&self.name);
        let Some(fifo) = self
            .quorum
            .as_deref_mut()
            .filter(|_| crate::queue::quorum::QUORUM)
        else {
            return;
        };
        if fifo.dead.open {
            return;
        }
        fifo.dead.open = true;
        let Some(store) = io.store.as_deref_mut() else {
            return;
        };
        let recovery = store.open_queue(store_id(id), vhost, &name, true);
        // Dead letters are kept whatever their delivery mode, as the queue's messages are.
        store.keep_every_message(store_id(id));
        fifo.dead.next_seq = fifo.dead.next_seq.max(recovery.next_seq);
        let mut from = recovery.first_seq;
        // Bounded by what the log holds: each batch moves `from` past what it read.
        loop {
            let mut batch = Vec::new();
            if store
                .read(store_id(id), from, READ_BATCH, &mut batch)
                .is_err()
            {
                io.out.store_failed = true;
                return;
            }
            let Some(last) = batch.last().map(|m| m.seq) else {
                return;
            };
            for m in batch {
                io.out.held += m.message.body_len() as u64;
                fifo.dead.bytes += m.message.body_len() as u64;
                fifo.dead
                    .held
                    .insert(m.seq, DeadLetter::new(m.message, true));
            }
            fifo.dead.next_seq = fifo.dead.next_seq.max(last + 1);
            from = last + 1;
        }
    }

    /// Forgets the dead letters held in memory without touching the store (a replicated
    /// queue changed hands here: its log, not this node, says what is owed); the next
    /// `open_dead_letters` reads them again.
    pub(crate) fn forget_dead_letters(&mut self, io: &mut super::state::QueueIo<'_>) {
        if let Some(fifo) = self
            .quorum
            .as_deref_mut()
            .filter(|_| crate::queue::quorum::QUORUM)
        {
            io.out.released += fifo.dead.bytes;
            fifo.dead.take_all();
            fifo.dead.open = false;
        }
    }

    /// Holds `message`, in the form it is forwarded in, as a dead letter: written to the
    /// dead-letter log (the caller opened it). Returns its number.
    pub(crate) fn hold_dead_letter(
        &mut self,
        io: &mut super::state::QueueIo<'_>,
        message: Arc<Message>,
    ) -> Option<u64> {
        let id = self.id;
        let fifo = self
            .quorum
            .as_deref_mut()
            .filter(|_| crate::queue::quorum::QUORUM)?;
        let seq = fifo.dead.next_seq;
        let stored = match io.store.as_deref_mut() {
            Some(store) => match store.append(store_id(id), seq, &message, None) {
                Ok(()) => {
                    io.out.durable_write = true;
                    true
                }
                Err(_) => {
                    // The host logged why; it is held in memory, and lost only if the
                    // broker stops before its targets have it. No alarm when the store
                    // only refused a log this node does not serve now (its quorum queue's
                    // leadership moved).
                    io.out.store_failed = store.serves(store_id(id));
                    false
                }
            },
            None => false,
        };
        io.out.held += message.body_len() as u64;
        Some(fifo.dead.push(DeadLetter::new(message, stored)))
    }

    /// Dead letter `seq` reached every target: it leaves the queue for good.
    pub(crate) fn settle_dead_letter(&mut self, io: &mut super::state::QueueIo<'_>, seq: u64) {
        let id = self.id;
        let Some(d) = self
            .quorum
            .as_deref_mut()
            .filter(|_| crate::queue::quorum::QUORUM)
            .and_then(|f| f.dead.take(seq))
        else {
            return;
        };
        io.out.released += d.message.body_len() as u64;
        if d.stored
            && let Some(store) = io.store.as_deref_mut()
        {
            store.remove(store_id(id), seq);
            io.out.removed = true;
        }
    }

    /// A purge takes the dead letters too (RabbitMQ's purge counts them): returns how many.
    pub(crate) fn purge_dead_letters(&mut self, io: &mut super::state::QueueIo<'_>) -> u64 {
        let id = self.id;
        let Some(fifo) = self
            .quorum
            .as_deref_mut()
            .filter(|_| crate::queue::quorum::QUORUM)
        else {
            return 0;
        };
        io.out.released += fifo.dead.bytes;
        let all = fifo.dead.take_all();
        if all.values().any(|d| d.stored)
            && let Some(store) = io.store.as_deref_mut()
        {
            store.remove_from(store_id(id), 0);
            io.out.removed = true;
        }
        all.len() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(body: &'static [u8]) -> Arc<Message> {
        Arc::new(Message {
            exchange: Arc::from("dlx"),
            routing_key: Arc::from("k"),
            properties: Default::default(),
            body: bytes::Bytes::from_static(body),
        })
    }

    #[test]
    fn counts_follow_what_is_held() {
        let mut d = DeadLetters::default();
        let a = d.push(DeadLetter::new(message(b"abc"), true));
        let b = d.push(DeadLetter::new(message(b"de"), true));
        assert_eq!((a, b), (0, 1));
        assert_eq!((d.len(), d.bytes), (2, 5));
        assert!(d.take(a).is_some());
        assert!(d.take(a).is_none(), "taken once");
        assert_eq!((d.len(), d.bytes), (1, 2));
        assert_eq!(d.take_all().len(), 1);
        assert_eq!((d.len(), d.bytes, d.next_seq), (0, 0, 2));
        assert_ne!(store_id(QueueId(5)), QueueId(5));
        assert!(store_name("q").starts_with("amq."));
    }
}
