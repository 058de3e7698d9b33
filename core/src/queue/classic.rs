//! The ready messages of a classic queue.
//!
//! Messages carry the sequence number they were given on enqueue. A requeued message goes back
//! to the position its sequence number gives it (RabbitMQ's behaviour), not to the tail: the
//! list stays sorted by sequence number, and a requeue is a binary search plus an insert.

use crate::message::Message;
use std::collections::VecDeque;
use std::sync::Arc;

/// One ready message.
#[derive(Clone, Debug)]
pub struct QueuedMessage {
    pub seq: u64,
    pub message: Arc<Message>,
    /// It was delivered before and came back (requeue, channel close).
    pub redelivered: bool,
}

/// Ready messages, sorted by `seq`.
#[derive(Debug, Default)]
pub struct MessageQueue {
    ready: VecDeque<QueuedMessage>,
    next_seq: u64,
    ready_bytes: u64,
}

impl MessageQueue {
    pub fn new() -> MessageQueue {
        MessageQueue::default()
    }

    /// Appends a newly published message; returns its sequence number.
    pub fn push(&mut self, message: Arc<Message>) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.ready_bytes += message.body_len() as u64;
        self.ready.push_back(QueuedMessage {
            seq,
            message,
            redelivered: false,
        });
        seq
    }

    /// Puts a delivered message back at its original position, marked redelivered.
    pub fn requeue(&mut self, seq: u64, message: Arc<Message>) {
        debug_assert!(seq < self.next_seq, "requeue of a sequence never issued");
        self.ready_bytes += message.body_len() as u64;
        let entry = QueuedMessage {
            seq,
            message,
            redelivered: true,
        };
        // Requeues usually go to the head (oldest unacked), so check the ends first.
        match self.ready.front() {
            None => self.ready.push_back(entry),
            Some(front) if seq < front.seq => self.ready.push_front(entry),
            _ => {
                let at = self.ready.partition_point(|m| m.seq < seq);
                self.ready.insert(at, entry);
            }
        }
    }

    pub fn pop(&mut self) -> Option<QueuedMessage> {
        let m = self.ready.pop_front()?;
        self.ready_bytes -= m.message.body_len() as u64;
        Some(m)
    }

    /// Drops every ready message; returns how many there were.
    pub fn purge(&mut self) -> usize {
        let n = self.ready.len();
        self.ready.clear();
        self.ready_bytes = 0;
        n
    }

    pub fn len(&self) -> usize {
        self.ready.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ready.is_empty()
    }

    /// Body bytes of the ready messages.
    pub fn bytes(&self) -> u64 {
        self.ready_bytes
    }
}
