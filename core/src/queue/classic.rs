//! The ready messages of a classic queue: a bounded window in memory, the rest paged out to
//! the store (CQv2's "lazy" shape).
//!
//! Messages carry the sequence number they were given on enqueue. A requeued message goes back
//! to the position its sequence number gives it (RabbitMQ's behaviour), not to the tail: the
//! window stays sorted by sequence number, and a requeue is a binary search plus an insert.
//!
//! Paged-out messages are a suffix: every stored message of the queue whose sequence number is
//! at least `paged.from_seq` is ready and on disk only. New messages go to that suffix while it is
//! non-empty (order), and the window refills from its head. Requeued messages were delivered
//! from the window, so their sequence numbers are always below the suffix.

use crate::message::Message;
pub use crate::message::QueuedMessage;
use crate::store::{QueueRecovery, StoredMessage};
use std::collections::VecDeque;
use std::sync::Arc;

/// Ready messages that are on disk only.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Paged {
    /// Messages on disk only.
    pub count: u64,
    /// Their body bytes.
    pub bytes: u64,
    /// The sequence number the next read starts from.
    pub from_seq: u64,
}

/// Ready messages, sorted by `seq`: the window in memory, then the paged-out suffix.
///
/// A priority queue (`x-max-priority`) keeps one deque per priority level instead of the
/// single window, each sorted by `seq`, and pops from the highest non-empty level. It keeps
/// all its ready messages in memory (persistent ones are also stored, for recovery): a later
/// message may outrank everything before it, so there is no suffix to leave on disk.
#[derive(Debug, Default)]
pub struct MessageQueue {
    ready: VecDeque<QueuedMessage>,
    /// Priority levels 0..=max (empty for a plain queue; a boxed slice, not a `Vec`: one
    /// word less in every queue).
    levels: Box<[VecDeque<QueuedMessage>]>,
    /// Messages in memory (the window, or all levels).
    in_memory: usize,
    next_seq: u64,
    ready_bytes: u64,
    paged: Paged,
}

/// Inserts a requeued message at the position its sequence number gives it.
fn insert_by_seq(deque: &mut VecDeque<QueuedMessage>, entry: QueuedMessage) {
    // Requeues usually go to the head (oldest unacked), so check the ends first.
    match deque.front() {
        None => deque.push_back(entry),
        Some(front) if entry.seq < front.seq => deque.push_front(entry),
        _ => {
            let at = deque.partition_point(|m| m.seq < entry.seq);
            deque.insert(at, entry);
        }
    }
}

impl MessageQueue {
    /// An empty queue.
    pub fn new() -> MessageQueue {
        MessageQueue::default()
    }

    /// A queue whose messages a store recovered: all paged out, read back on demand.
    /// `max_priority`: a priority queue with levels 0..=max.
    pub fn recovered(r: QueueRecovery, max_priority: Option<u8>) -> MessageQueue {
        debug_assert!(r.count == 0 || r.first_seq < r.next_seq);
        MessageQueue {
            ready: VecDeque::new(),
            levels: max_priority.map_or_else(Box::default, |max| {
                (0..=max).map(|_| VecDeque::new()).collect()
            }),
            in_memory: 0,
            next_seq: r.next_seq,
            ready_bytes: 0,
            paged: Paged {
                count: r.count,
                bytes: r.bytes,
                from_seq: r.first_seq,
            },
        }
    }

    /// Issues the sequence number of a new message.
    pub fn next_seq(&mut self) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        seq
    }

    /// Whether it is a priority queue (`x-max-priority`).
    pub fn is_priority(&self) -> bool {
        !self.levels.is_empty()
    }

    /// The deque a message belongs in: the window, or its priority level (capped at the
    /// maximum, as RabbitMQ caps it).
    fn deque_for(&mut self, message: &Message) -> &mut VecDeque<QueuedMessage> {
        if self.levels.is_empty() {
            return &mut self.ready;
        }
        let top = self.levels.len() - 1;
        let level = usize::from(message.properties.priority.unwrap_or(0)).min(top);
        &mut self.levels[level]
    }

    /// Appends a new message to the window. Only while nothing is paged out (order).
    pub fn push(&mut self, seq: u64, message: Arc<Message>, stored: bool, expires_at: Option<u64>) {
        debug_assert_eq!(
            self.paged.count, 0,
            "push to the window behind paged messages"
        );
        self.ready_bytes += message.body_len() as u64;
        self.in_memory += 1;
        let deque = self.deque_for(&message);
        debug_assert!(deque.back().is_none_or(|m| m.seq < seq));
        deque.push_back(QueuedMessage {
            seq,
            message,
            redelivered: false,
            stored,
            expires_at,
            epoch: 0,
        });
    }

    /// Appends a new message that the store holds and memory does not.
    pub fn push_paged(&mut self, seq: u64, body_len: u64) {
        debug_assert!(self.levels.is_empty(), "priority queues do not page out");
        if self.paged.count == 0 {
            self.paged.from_seq = seq;
        }
        self.paged.count += 1;
        self.paged.bytes += body_len;
    }

    /// Puts a delivered message back at its original position, marked redelivered.
    pub fn requeue(
        &mut self,
        seq: u64,
        message: Arc<Message>,
        stored: bool,
        expires_at: Option<u64>,
    ) {
        // A delivery made before its queue was reloaded never comes back here: its settle is
        // stale (`QueueState::settle`), so every requeue is of a number this queue issued.
        debug_assert!(seq < self.next_seq, "requeue of a sequence never issued");
        debug_assert!(
            self.paged.count == 0 || seq < self.paged.from_seq,
            "requeue into the paged-out suffix"
        );
        self.ready_bytes += message.body_len() as u64;
        self.in_memory += 1;
        let deque = self.deque_for(&message);
        let entry = QueuedMessage {
            seq,
            message,
            redelivered: true,
            stored,
            expires_at,
            epoch: 0,
        };
        insert_by_seq(deque, entry);
    }

    /// The deque the next message comes from.
    fn front_deque(&self) -> Option<&VecDeque<QueuedMessage>> {
        if self.levels.is_empty() {
            return Some(&self.ready);
        }
        self.levels.iter().rev().find(|d| !d.is_empty())
    }

    /// Takes the next message: the first of the window, or of the highest priority level.
    pub fn pop(&mut self) -> Option<QueuedMessage> {
        let m = if self.levels.is_empty() {
            self.ready.pop_front()?
        } else {
            self.levels.iter_mut().rev().find_map(|d| d.pop_front())?
        };
        self.in_memory -= 1;
        self.ready_bytes -= m.message.body_len() as u64;
        Some(m)
    }

    /// Messages must be read back before the next pop: the window is empty but messages are
    /// paged out (a priority queue reads everything back: any of it may outrank the rest).
    pub fn needs_load(&self) -> bool {
        self.paged.count > 0 && (self.in_memory == 0 || !self.levels.is_empty())
    }

    /// Moves messages read back from the store into the window; returns their body bytes.
    pub fn load(&mut self, batch: Vec<StoredMessage>) -> u64 {
        let mut bytes = 0;
        for m in batch {
            debug_assert!(m.seq >= self.paged.from_seq, "read before the paged suffix");
            if self.paged.count == 0 {
                break;
            }
            let len = m.message.body_len() as u64;
            bytes += len;
            self.paged.count -= 1;
            self.paged.bytes = self.paged.bytes.saturating_sub(len);
            self.paged.from_seq = m.seq + 1;
            self.in_memory += 1;
            let deque = self.deque_for(&m.message);
            insert_by_seq(
                deque,
                QueuedMessage {
                    seq: m.seq,
                    message: m.message,
                    redelivered: m.redelivered,
                    stored: true,
                    expires_at: m.expires_at,
                    epoch: 0,
                },
            );
        }
        self.ready_bytes += bytes;
        bytes
    }

    /// The store lost paged messages it reported (a read came back short): forget them, so
    /// the queue does not wait for messages that will never come.
    pub fn forget_paged(&mut self) {
        self.paged = Paged::default();
    }

    /// Drops every ready message: returns the window's messages and what was paged out.
    pub fn purge(&mut self) -> (Vec<QueuedMessage>, Paged) {
        self.ready_bytes = 0;
        self.in_memory = 0;
        let paged = std::mem::take(&mut self.paged);
        let mut all: Vec<QueuedMessage> = self.ready.drain(..).collect();
        for level in self.levels.iter_mut() {
            all.extend(level.drain(..));
        }
        (all, paged)
    }

    /// Ready messages, in memory and paged out.
    pub fn len(&self) -> usize {
        usize::try_from(self.paged.count)
            .unwrap_or(usize::MAX)
            .saturating_add(self.in_memory)
    }

    /// No ready messages.
    pub fn is_empty(&self) -> bool {
        self.in_memory == 0 && self.paged.count == 0
    }

    /// Ready messages in memory.
    pub fn in_memory(&self) -> usize {
        self.in_memory
    }

    /// What is on disk only.
    pub fn paged(&self) -> Paged {
        self.paged
    }

    /// Body bytes of the ready messages in memory.
    pub fn bytes(&self) -> u64 {
        self.ready_bytes
    }

    /// Body bytes of all ready messages, in memory and paged out (length limits).
    pub fn total_bytes(&self) -> u64 {
        self.ready_bytes + self.paged.bytes
    }

    /// The next message to go, if it is in memory.
    pub fn head(&self) -> Option<&QueuedMessage> {
        self.front_deque()?.front()
    }

    /// The in-memory deques (the window, or each priority level), each sorted by sequence
    /// number (invariant checks).
    pub fn deques(&self) -> impl Iterator<Item = &VecDeque<QueuedMessage>> {
        std::iter::once(&self.ready).chain(self.levels.iter())
    }
}
