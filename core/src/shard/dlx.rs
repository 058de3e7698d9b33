//! The forwarding of at-least-once dead letters (RabbitMQ's `rabbit_fifo_dlx_worker`): the
//! broker that serves a quorum queue forwards the dead letters it holds
//! (`queue/dlx.rs`) to the queues its dead-letter exchange routes them to, as a publisher
//! with confirms would: each target answers (`Mail::Answered` to this shard's dead-letter
//! address, from a queue of this shard, another shard or another node, after its sync for
//! a persistent message on a durable queue), and a dead letter leaves its queue once every
//! target took it and it is durable there. One a target refused (its store, its length
//! limit, a quorum queue without a leader), or that reached no queue (no such exchange, no
//! binding), is forwarded again `RETRY_MS` later, to the targets that have not taken it
//! yet; one whose answers do not come within `ANSWER_TIMEOUT_MS` too.

use super::Broker;
use super::mail::{Mail, Publisher};
use crate::ids::{ChannelAddr, ChannelRef, ConnId, QueueId};
use crate::message::Message;
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::Arc;

/// How long a dead letter that reached no queue, or that a target refused, waits before it
/// is forwarded again. RabbitMQ retries on a timer too (`dead_letter_worker_publisher_confirm_timeout`,
/// 3 minutes); a routing check each second costs little and lets a fixed topology take
/// the dead letters at once.
pub(crate) const RETRY_MS: u64 = 1_000;

/// How long a forwarded dead letter waits for its targets' answers before it is forwarded
/// again (RabbitMQ's `dead_letter_worker_publisher_confirm_timeout`). Answers always come
/// (a node that cannot deliver one nacks it), so this only guards against one lost.
pub(crate) const ANSWER_TIMEOUT_MS: u64 = 180_000;

/// Dead letters forwarded per call; the rest wait for the next call.
const MAX_FORWARDS_PER_CALL: usize = 10_000;

// A target's answer comes back to `DLX_CONN_BASE + shard`, this shard's forwarder.
pub(crate) use crate::mail::mailbox::{DLX_CONN_BASE, is_dlx_conn};

/// One target's answer awaited.
#[derive(Clone, Copy, Debug)]
struct Sent {
    queue: QueueId,
    seq: u64,
    attempt: u32,
    target: QueueId,
}

/// What the forwarder of one shard keeps.
#[derive(Default)]
pub(crate) struct DlxWorker {
    next_token: u64,
    /// Answers awaited, by the token the publish carried.
    pending: HashMap<u64, Sent>,
    /// Queues with dead letters to forward, and when to look at each next (so an operation
    /// does not scan dead letters that wait for a retry or for answers).
    due: BTreeMap<QueueId, u64>,
    /// Dead letters every target took, durable once the epoch syncs: (epoch, queue, seq).
    syncing: VecDeque<(u64, QueueId, u64)>,
    /// Queues whose dead letters wait (one reached no queue or was refused) since the last
    /// notice: one [`Notice::DeadLettersHeld`] when they start waiting, one
    /// [`Notice::DeadLettersReleased`] when one is taken again, not one per retry.
    stuck: HashSet<QueueId>,
    /// What the host logs (`Broker::take_notices`), oldest first; at most [`MAX_NOTICES`].
    notices: Vec<Notice>,
    /// Notices dropped because the host did not take them in time.
    notices_dropped: u64,
}

/// Whether notices are made at all (cargo feature `notices`; off in the wasm builds, whose
/// hosts keep no log): a constant, so the compiler drops their code where it is off.
pub(crate) const NOTICES: bool = cfg!(feature = "notices");

/// Notices kept for the host at most (it takes them after every turn).
const MAX_NOTICES: usize = 1024;

/// What the broker has to say for the host's log (the core has no log of its own): the
/// waits of at-least-once dead-lettering, as RabbitMQ's dead-letter worker logs them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Notice {
    /// Queue `queue`'s dead letters wait in it: one reached no queue (`unroutable`: its
    /// dead-letter exchange is missing or routes it nowhere) or a target refused it (its
    /// length limit, its store, a quorum queue without a leader). `held`: dead letters
    /// it holds now. Tried again every second until taken.
    DeadLettersHeld {
        /// The queue's vhost.
        vhost: Arc<str>,
        /// The queue.
        queue: Arc<str>,
        /// Dead letters it holds now.
        held: u64,
        /// Reached no queue (else refused by a target).
        unroutable: bool,
    },
    /// Queue `queue`'s dead letters are taken again after a wait; `held`: still held.
    DeadLettersReleased {
        /// The queue's vhost.
        vhost: Arc<str>,
        /// The queue.
        queue: Arc<str>,
        /// Dead letters it holds now.
        held: u64,
    },
    /// A policy made quorum queue `queue`'s dead-letter strategy at-least-once, which it
    /// cannot honour: `text` is RabbitMQ's warning (`queue_args::dead_letter_warning`).
    DeadLetterFallback {
        /// The queue's vhost.
        vhost: Arc<str>,
        /// The queue.
        queue: Arc<str>,
        /// RabbitMQ's warning.
        text: &'static str,
    },
}

impl Broker {
    /// Hands the host what it should log (see [`Notice`]), oldest first, and how many were
    /// dropped since the last call because more than the bound waited.
    pub fn take_notices(&mut self, out: &mut Vec<Notice>) -> u64 {
        out.append(&mut self.dlx.notices);
        std::mem::take(&mut self.dlx.notices_dropped)
    }

    pub(super) fn notice(&mut self, n: Notice) {
        if self.dlx.notices.len() >= MAX_NOTICES {
            self.dlx.notices_dropped += 1;
        } else {
            self.dlx.notices.push(n);
        }
    }

    /// Queue `id`'s dead letters started waiting (once per wait).
    fn dead_letters_stuck(&mut self, id: QueueId, unroutable: bool) {
        if !NOTICES || !self.dlx.stuck.insert(id) {
            return;
        }
        let Some(q) = self.qs.queues.get(&id) else {
            return;
        };
        let n = Notice::DeadLettersHeld {
            vhost: self.topo.vhost_name_arc(q.vhost),
            queue: q.name.clone(),
            held: q.dead_held().0,
            unroutable,
        };
        self.notice(n);
    }

    /// This shard's dead-letter address.
    fn dlx_addr(&self) -> ChannelAddr {
        ChannelAddr {
            ch: ChannelRef {
                conn: ConnId(DLX_CONN_BASE + u64::from(self.shard)),
                channel: 0,
            },
            serial: 0,
        }
    }

    /// Queue `from` holds `message` (in its dead-letter form) until its targets confirm it.
    pub(super) fn hold_dead_letter(&mut self, from: QueueId, message: Arc<Message>) {
        let vhost = match self.qs.queues.get(&from) {
            Some(q) => self.topo.vhost_name_arc(q.vhost),
            None => return,
        };
        let held = self.with_queue(from, |q, io| {
            q.open_dead_letters(io, &vhost);
            q.hold_dead_letter(io, message)
        });
        if held.flatten().is_some() {
            let now = self.now;
            self.dead_letters_due_at(from, now);
        }
    }

    /// Queue `id` has dead letters to forward at `at` (or earlier).
    fn dead_letters_due_at(&mut self, id: QueueId, at: u64) {
        self.dlx
            .due
            .entry(id)
            .and_modify(|t| *t = (*t).min(at))
            .or_insert(at);
    }

    /// Forwards the dead letters of queue `id` that are due (a bounded number).
    pub(super) fn forward_dead_letters(&mut self, id: QueueId, budget: &mut usize) {
        let now = self.now;
        self.dlx.due.remove(&id);
        let Some(q) = self.qs.queues.get_mut(&id) else {
            self.dlx.stuck.remove(&id);
            return;
        };
        let vhost = q.vhost;
        let Some(fifo) = q
            .quorum
            .as_deref_mut()
            .filter(|_| crate::queue::quorum::QUORUM)
        else {
            return;
        };
        let mut due = Vec::new();
        let mut timed_out = Vec::new();
        // When the dead letters that wait look again (`now`: the budget ran out).
        let mut next: Option<u64> = None;
        for (&seq, d) in fifo.dead.held.iter_mut() {
            if d.confirmed {
                continue;
            }
            if let Some(at) = d.at.filter(|at| *at > now) {
                next = Some(next.map_or(at, |n| n.min(at)));
                continue;
            }
            if due.len() >= *budget {
                next = Some(now);
                break;
            }
            if d.in_flight > 0 {
                // No answer within the timeout: a new attempt (late answers are ignored).
                d.in_flight = 0;
                timed_out.push(seq);
            }
            d.attempt = d.attempt.wrapping_add(1);
            d.failed = false;
            due.push((seq, d.attempt, d.message.clone(), d.settled.clone()));
        }
        *budget -= due.len();
        if let Some(at) = next {
            self.dead_letters_due_at(id, at);
        }
        if !timed_out.is_empty() {
            // Rare (answers always come): the tokens of the old attempts go.
            self.dlx
                .pending
                .retain(|_, s| s.queue != id || !timed_out.contains(&s.seq));
        }
        for (seq, attempt, message, settled) in due {
            let targets = self.dead_letter_targets(vhost, &message);
            let mut sent = 0u32;
            let mut done = false;
            // `None`: the dead-letter exchange does not exist (yet): it waits, as in RabbitMQ.
            if let Some(mut targets) = targets {
                targets.retain(|t| !settled.contains(t));
                // The routes changed so that no target still owes a confirm, and one
                // confirmed before: it arrived (RabbitMQ's rule, as `mandatory`).
                done = targets.is_empty() && !settled.is_empty();
                self.mail.from(super::mail::Dest::Queue(id));
                for target in targets {
                    let token = self.dlx.next_token;
                    self.dlx.next_token += 1;
                    self.dlx.pending.insert(
                        token,
                        Sent {
                            queue: id,
                            seq,
                            attempt,
                            target,
                        },
                    );
                    self.mail.push_back(Mail::Enqueue {
                        queue: target,
                        message: message.clone(),
                        publisher: Some(Publisher {
                            to: self.dlx_addr(),
                            seq: Some(token),
                            // Not paced: the forwarder is bounded by what its queue holds.
                            consumes: true,
                        }),
                    });
                    sent += 1;
                }
            }
            let Some(d) = self.dead_letter_mut(id, seq) else {
                continue;
            };
            if done {
                d.confirmed = true;
                self.settle_dead_letter_now(id, seq);
            } else if sent == 0 {
                let at = now.saturating_add(RETRY_MS);
                d.at = Some(at);
                self.dead_letters_due_at(id, at);
                self.dead_letters_stuck(id, true);
            } else {
                let at = now.saturating_add(ANSWER_TIMEOUT_MS);
                d.in_flight = sent;
                d.at = Some(at);
                self.dead_letters_due_at(id, at);
            }
        }
    }

    fn dead_letter_mut(
        &mut self,
        id: QueueId,
        seq: u64,
    ) -> Option<&mut crate::queue::dlx::DeadLetter> {
        self.qs
            .queues
            .get_mut(&id)?
            .quorum
            .as_deref_mut()
            .filter(|_| crate::queue::quorum::QUORUM)?
            .dead
            .held
            .get_mut(&seq)
    }

    /// A target's answer to a forwarded dead letter (`taken`; `durable`: once this
    /// shard's current epoch is synced).
    pub(super) fn dead_letter_answered(&mut self, token: u64, taken: bool, durable: bool) {
        let Some(sent) = self.dlx.pending.remove(&token) else {
            return;
        };
        let epoch = self.epoch;
        let now = self.now;
        let synced = self.synced_epoch;
        let Some(d) = self.dead_letter_mut(sent.queue, sent.seq) else {
            return;
        };
        if d.attempt != sent.attempt || d.in_flight == 0 {
            return;
        }
        d.in_flight -= 1;
        if taken {
            if !d.settled.contains(&sent.target) {
                d.settled.push(sent.target);
            }
            if durable {
                d.epoch = Some(d.epoch.map_or(epoch, |e| e.max(epoch)));
            }
        } else {
            d.failed = true;
        }
        if d.in_flight > 0 {
            return;
        }
        if d.failed {
            let at = now.saturating_add(RETRY_MS);
            d.at = Some(at);
            self.dead_letters_due_at(sent.queue, at);
            self.dead_letters_stuck(sent.queue, false);
            return;
        }
        d.confirmed = true;
        match d.epoch {
            Some(e) if synced.is_none_or(|s| s < e) => {
                self.dlx.syncing.push_back((e, sent.queue, sent.seq));
                self.sync_dirty = true;
            }
            _ => self.settle_dead_letter_now(sent.queue, sent.seq),
        }
    }

    fn settle_dead_letter_now(&mut self, id: QueueId, seq: u64) {
        self.with_queue(id, |q, io| q.settle_dead_letter(io, seq));
        if NOTICES
            && self.dlx.stuck.remove(&id)
            && let Some(q) = self.qs.queues.get(&id)
        {
            let n = Notice::DeadLettersReleased {
                vhost: self.topo.vhost_name_arc(q.vhost),
                queue: q.name.clone(),
                held: q.dead_held().0,
            };
            self.notice(n);
        }
    }

    /// The sync of `epoch` completed: dead letters whose targets' copies it covers leave.
    pub(super) fn dead_letters_synced(&mut self, epoch: u64, durable: bool) {
        let now = self.now;
        let mut ready = Vec::new();
        while self.dlx.syncing.front().is_some_and(|w| w.0 <= epoch) {
            if let Some((_, queue, seq)) = self.dlx.syncing.pop_front() {
                ready.push((queue, seq));
            }
        }
        for (queue, seq) in ready {
            if durable {
                self.settle_dead_letter_now(queue, seq);
            } else if let Some(d) = self.dead_letter_mut(queue, seq) {
                // Not durable at the target after all: forwarded again (to every target:
                // which of them lost it is not known).
                d.confirmed = false;
                d.settled.clear();
                d.epoch = None;
                let at = now.saturating_add(RETRY_MS);
                d.at = Some(at);
                self.dead_letters_due_at(queue, at);
            }
        }
    }

    /// Forwards what is due (after each operation and at each tick).
    pub(super) fn forward_due_dead_letters(&mut self) {
        let now = self.now;
        if !self.dlx.due.values().any(|at| *at <= now) {
            return;
        }
        let mut budget = MAX_FORWARDS_PER_CALL;
        let due: Vec<QueueId> = self
            .dlx
            .due
            .iter()
            .filter(|(_, at)| **at <= now)
            .map(|(id, _)| *id)
            .collect();
        for id in due {
            if budget == 0 {
                break;
            }
            self.forward_dead_letters(id, &mut budget);
        }
    }

    /// When the forwarder has something to look at again (the host's next tick).
    pub(super) fn dead_letters_due(&self) -> Option<u64> {
        self.dlx.due.values().min().copied()
    }

    /// A policy switched queue `id`'s dead-letter strategy. To at-least-once: the dead letters
    /// its log holds (from an earlier spell, or a restart before the policy applied) are
    /// forwarded. Away from it: they are deleted, as RabbitMQ's `rabbit_fifo_dlx`
    /// `switch_from` deletes them.
    pub(super) fn switch_dead_letter_strategy(&mut self, id: QueueId) {
        let Some(q) = self.qs.queues.get(&id) else {
            return;
        };
        let vhost = self.topo.vhost_name_arc(q.vhost);
        if q.at_least_once() {
            self.with_queue(id, |q, io| q.open_dead_letters(io, &vhost));
        } else {
            self.with_queue(id, |q, io| {
                q.open_dead_letters(io, &vhost);
                q.purge_dead_letters(io)
            });
        }
        self.dead_letters_reloaded(id);
    }

    /// Queue `id` was reloaded (its dead letters read again) or opened: they are forwarded.
    pub(super) fn dead_letters_reloaded(&mut self, id: QueueId) {
        self.dlx.pending.retain(|_, s| s.queue != id);
        self.dlx.syncing.retain(|w| w.1 != id);
        if self.qs.queues.get(&id).is_some_and(|q| q.dead_held().0 > 0) {
            let now = self.now;
            self.dead_letters_due_at(id, now);
        } else {
            self.dlx.due.remove(&id);
            self.dlx.stuck.remove(&id);
        }
    }
}
