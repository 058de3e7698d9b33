//! One channel's state and the operations that need nothing but the channel: delivery
//! tags and the deliveries awaiting acks, the shared (global) prefetch, consumer tags,
//! publish sequence numbers in confirm mode, and the operations a transaction buffers.
//!
//! Like `queue::state`, this is a unit meant to get an owner of its own (the connection's
//! task, ARCHITECTURE.md "warren-runtime"): it refers to queues and consumers only by id.

pub(crate) mod conn;
pub(crate) mod hold;
pub(crate) mod reply_to;
pub(crate) mod side;

use crate::command::{OpKind, Publish};
use crate::error::{ErrorCode, ProtocolError};
use crate::ids::QueueId;
use crate::mail::delivery::{ConsumerId, Settle, Unacked};
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

/// Operations one transaction may buffer: bounds a channel's memory however long the
/// client keeps a transaction open.
const MAX_TX_OPS: usize = 65_536;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Phase {
    Open,
    /// A channel error was reported; waiting for the host's `ChannelCloseOk`.
    Closing,
}

/// A channel's consumers by tag, with the queue each consumes from: a vector sorted by tag,
/// sized exactly while small (`sorted_vec`). Most channels have one consumer (every idle MQTT subscriber's
/// has), and a `BTreeMap` leaf would hold room for eleven.
#[derive(Default)]
pub(crate) struct ConsumerTags(Vec<(Arc<str>, ConsumerId, QueueId)>);

impl ConsumerTags {
    fn find(&self, tag: &str) -> Result<usize, usize> {
        self.0.binary_search_by(|(t, _, _)| (**t).cmp(tag))
    }

    pub(crate) fn contains_key(&self, tag: &str) -> bool {
        self.find(tag).is_ok()
    }

    pub(crate) fn get(&self, tag: &str) -> Option<(ConsumerId, QueueId)> {
        let i = self.find(tag).ok()?;
        let (_, cid, queue) = self.0[i];
        Some((cid, queue))
    }

    /// Adds a consumer under a tag the channel does not use yet (the caller checked).
    pub(crate) fn insert(&mut self, tag: Arc<str>, cid: ConsumerId, queue: QueueId) {
        match self.find(&tag) {
            Ok(_) => debug_assert!(false, "consumer tag {tag} reused"),
            Err(at) => {
                crate::sorted_vec::room_for_one(&mut self.0);
                self.0.insert(at, (tag, cid, queue));
            }
        }
    }

    /// Removes a tag; the consumer it named, if it was there.
    pub(crate) fn remove(&mut self, tag: &str) -> Option<(ConsumerId, QueueId)> {
        let i = self.find(tag).ok()?;
        let (_, cid, queue) = self.0.remove(i);
        Some((cid, queue))
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (&Arc<str>, ConsumerId, QueueId)> {
        self.0.iter().map(|(tag, cid, queue)| (tag, *cid, *queue))
    }

    pub(crate) fn values(&self) -> impl Iterator<Item = (ConsumerId, QueueId)> + '_ {
        self.0.iter().map(|&(_, cid, queue)| (cid, queue))
    }
}

/// An operation deferred by a transaction until commit.
pub(crate) enum TxOp {
    Publish(Box<Publish>),
    Settle {
        kind: OpKind,
        delivery_tag: u64,
        multiple: bool,
        settle: Settle,
    },
}

/// A transactional channel's state.
#[derive(Default)]
pub(crate) struct TxState {
    /// The operations buffered since the last commit or rollback.
    ops: Vec<TxOp>,
    /// A commit in progress: the queues that have yet to answer (`TxFlushed`), and whether
    /// it published a persistent message (then commit-ok waits for a sync too).
    pub(crate) commit: Option<(u32, bool)>,
}

/// A publish in confirm mode whose confirm has not gone out.
struct Unconfirmed {
    seq: u64,
    /// Queues that have not answered yet.
    waiting: u32,
    /// No queue refused it so far.
    ack: bool,
    /// The sync it waits for: the newest epoch among the durable answers.
    epoch: Option<u64>,
}

/// One channel's state: its deliveries awaiting acks (by delivery tag), prefetch, consumers,
/// confirm and transaction mode.
pub(crate) struct ChannelState {
    pub(crate) phase: Phase,
    pub(crate) next_delivery_tag: u64,
    pub(crate) unacked: BTreeMap<u64, Unacked>,
    /// Unacked consumer deliveries: what `global` prefetch limits.
    pub(crate) consumer_unacked: crate::mail::credit::Counter,
    /// This opening's limits, shared with queues on other shards it consumes from
    /// (`broker/credit.rs`); `None` while it consumes from its own shard only.
    shared: Option<Arc<crate::mail::credit::SharedCredit>>,
    /// basic.qos global=false: the limit given to consumers created from now on.
    pub(crate) prefetch_count: u16,
    /// basic.qos global=true: one limit shared by all consumers of the channel.
    pub(crate) global_prefetch: u16,
    pub(crate) consumers: ConsumerTags,
    /// The next publish sequence number in confirm mode; 0 before confirm.select (numbers
    /// start at 1).
    confirm_next: u64,
    /// Publishes in confirm mode not confirmed yet, in publish order (`None` until the
    /// channel's first publish in confirm mode: an idle subscriber's channel holds nothing).
    #[expect(
        clippy::box_collection,
        reason = "one word inline instead of four in every channel"
    )]
    unconfirmed: Option<Box<VecDeque<Unconfirmed>>>,
    /// Boxed, as the reply consumer: few channels are transactional, and every idle MQTT
    /// connection has a channel.
    pub(crate) tx: Option<Box<TxState>>,
    /// The channel's direct reply-to consumer, if any.
    pub(crate) reply_consumer: Option<Box<crate::channel::reply_to::ReplyConsumer>>,
    /// The queue `""` refers to (AMQP: the last queue declared on the channel).
    pub(crate) last_queue: Option<Arc<str>>,
    /// Which opening of this channel number this is (`ChannelAddr`): a client may close a
    /// channel and open the same number while mail for the old one travels.
    pub(crate) serial: u32,
    /// A request of this channel went to a queue by mail and is not answered yet: what the
    /// client sends meanwhile waits (`broker/hold.rs`).
    pub(crate) awaiting: bool,
    /// Published, delivered, redelivered and acked messages, for operators' rates.
    pub(crate) stats: crate::stats::MessageStats,
}

impl Drop for ChannelState {
    fn drop(&mut self) {
        if let Some(s) = &self.shared {
            s.open.store(false, Ordering::Release);
        }
    }
}

impl ChannelState {
    pub(crate) fn new(serial: u32) -> ChannelState {
        ChannelState {
            serial,
            awaiting: false,
            phase: Phase::Open,
            next_delivery_tag: 1,
            unacked: BTreeMap::new(),
            consumer_unacked: crate::mail::credit::Counter::default(),
            shared: None,
            prefetch_count: 0,
            global_prefetch: 0,
            consumers: ConsumerTags::default(),
            confirm_next: 0,
            unconfirmed: None,
            tx: None,
            last_queue: None,
            reply_consumer: None,
            stats: crate::stats::MessageStats::default(),
        }
    }

    /// Gives a delivery its tag. A delivery that needs an ack is held until settled (one
    /// from a consumer counted against the shared prefetch already, when its queue took
    /// the credit: `queue::state::Credit`).
    pub(crate) fn deliver(&mut self, unacked: Option<Unacked>) -> u64 {
        let tag = self.next_delivery_tag;
        self.next_delivery_tag += 1;
        if let Some(u) = unacked {
            self.unacked.insert(tag, u);
        }
        tag
    }

    /// Whether the shared (global) prefetch allows one more consumer delivery that needs an
    /// ack.
    pub(crate) fn has_shared_credit(&self) -> bool {
        self.global_prefetch == 0 || self.consumer_unacked.get() < u32::from(self.global_prefetch)
    }

    /// basic.qos: `global` sets the limit all consumers of the channel share; otherwise the
    /// limit each consumer created from now on gets.
    pub(crate) fn set_prefetch(&mut self, prefetch_count: u16, global: bool) {
        if global {
            self.global_prefetch = prefetch_count;
            if let Some(s) = &self.shared {
                s.global_prefetch
                    .store(u32::from(prefetch_count), Ordering::Release);
            }
        } else {
            self.prefetch_count = prefetch_count;
        }
    }

    /// Takes the deliveries named by (`delivery_tag`, `multiple`), with RabbitMQ's rules:
    /// tag 0 with `multiple` means all; otherwise the tag must be unacked.
    pub(crate) fn take_settled(
        &mut self,
        kind: OpKind,
        delivery_tag: u64,
        multiple: bool,
    ) -> Result<Vec<Unacked>, ProtocolError> {
        let settled: Vec<Unacked> = if multiple && delivery_tag == 0 {
            std::mem::take(&mut self.unacked).into_values().collect()
        } else if !self.unacked.contains_key(&delivery_tag) {
            return Err(ProtocolError::new(
                ErrorCode::PreconditionFailed,
                kind,
                format!("unknown delivery tag {delivery_tag}"),
            ));
        } else if multiple {
            let rest = self.unacked.split_off(&(delivery_tag + 1));
            std::mem::replace(&mut self.unacked, rest)
                .into_values()
                .collect()
        } else {
            self.unacked.remove(&delivery_tag).into_iter().collect()
        };
        Ok(self.release_shared_credit(settled))
    }

    /// Deliveries leave the channel: the shared prefetch they held is free again (only
    /// theirs: deliveries still on their way keep the credit their queue took for them).
    fn release_shared_credit(&mut self, taken: Vec<Unacked>) -> Vec<Unacked> {
        let from_consumers = taken.iter().filter(|u| u.consumer.is_some()).count();
        self.consumer_unacked
            .sub(u32::try_from(from_consumers).unwrap_or(u32::MAX));
        taken
    }

    /// The channel closes (client close, or a channel error): queues on other shards
    /// take no more credit for it.
    pub(crate) fn close(&mut self) {
        self.phase = Phase::Closing;
        if let Some(s) = &self.shared {
            s.open.store(false, Ordering::Release);
        }
    }

    /// This opening's shared record (made now if it has none, its counter moved into
    /// it), with its connection's in-flight counter, already shared.
    pub(crate) fn share_credit(
        &mut self,
        in_flight: Arc<AtomicU32>,
        write_window: u32,
    ) -> Arc<crate::mail::credit::SharedCredit> {
        if let Some(s) = &self.shared {
            return s.clone();
        }
        let s = Arc::new(crate::mail::credit::SharedCredit {
            open: AtomicBool::new(self.phase == Phase::Open),
            global_prefetch: AtomicU32::new(u32::from(self.global_prefetch)),
            consumer_unacked: self.consumer_unacked.share(),
            in_flight,
            write_window,
        });
        self.shared = Some(s.clone());
        s
    }

    /// Whether this is opening `serial` of the channel, and open: what mail and credit
    /// addressed to a `ChannelAddr` may reach.
    pub(crate) fn is_open_as(&self, serial: u32) -> bool {
        self.serial == serial && self.phase == Phase::Open
    }

    /// Takes every delivery awaiting an ack (recover, channel close).
    pub(crate) fn take_all_unacked(&mut self) -> Vec<Unacked> {
        let all = std::mem::take(&mut self.unacked).into_values().collect();
        self.release_shared_credit(all)
    }

    /// The sequence number of the next publish, in confirm mode.
    pub(crate) fn next_publish_seq(&mut self) -> Option<u64> {
        if self.confirm_next == 0 {
            return None;
        }
        let seq = self.confirm_next;
        self.confirm_next += 1;
        Some(seq)
    }

    /// Publish `seq` went to `queues` queues; each answers once (`answered`). With none, it
    /// is confirmed (as an ack) once the publishes before it are.
    pub(crate) fn expect_answers(&mut self, seq: u64, queues: u32) {
        let list = self.unconfirmed.get_or_insert_with(Box::default);
        debug_assert!(list.back().is_none_or(|u| u.seq < seq), "publish order");
        list.push_back(Unconfirmed {
            seq,
            waiting: queues,
            ack: true,
            epoch: None,
        });
    }

    /// A queue's answer for publish `seq`: it took the message (`taken`; durable once the
    /// sync of `durable_at` completes) or refused it (store failure, `x-overflow`).
    pub(crate) fn answered(&mut self, seq: u64, taken: bool, durable_at: Option<u64>) {
        let Some(u) = self
            .unconfirmed
            .as_deref_mut()
            .and_then(|list| list.iter_mut().rev().find(|u| u.seq == seq))
        else {
            return;
        };
        debug_assert!(u.waiting > 0, "more answers than queues");
        u.waiting = u.waiting.saturating_sub(1);
        u.ack &= taken;
        if let Some(e) = durable_at {
            u.epoch = Some(u.epoch.map_or(e, |old| old.max(e)));
        }
    }

    /// The sync of every epoch up to `epoch` failed: what waits for one of them is not
    /// durable and is nacked.
    pub(crate) fn sync_failed(&mut self, epoch: u64) {
        for u in self.unconfirmed.iter_mut().flat_map(|list| list.iter_mut()) {
            if u.epoch.is_some_and(|e| e <= epoch) {
                u.ack = false;
                u.epoch = None;
            }
        }
    }

    /// Takes the confirms that may go out now, in publish order, into `out` as (seq, ack):
    /// every queue answered, and the sync the publish waits for (if any) completed, where
    /// `synced` is the newest epoch whose sync completed.
    pub(crate) fn take_confirms(&mut self, synced: Option<u64>, out: &mut Vec<(u64, bool)>) {
        let Some(list) = self.unconfirmed.as_deref_mut() else {
            return;
        };
        while let Some(u) = list.front() {
            let durable = u.epoch.is_none_or(|e| synced.is_some_and(|s| e <= s));
            if u.waiting > 0 || !durable {
                break;
            }
            out.push((u.seq, u.ack));
            list.pop_front();
        }
        // The list stays allocated while the channel lives: a publisher in confirm mode
        // would otherwise allocate and free it for every publish.
    }

    /// Publishes whose confirm has not gone out (they wait for answers, a sync, or an
    /// earlier publish).
    pub(crate) fn unconfirmed(&self) -> impl Iterator<Item = (u64, u32, Option<u64>)> + '_ {
        self.unconfirmed
            .iter()
            .flat_map(|list| list.iter())
            .map(|u| (u.seq, u.waiting, u.epoch))
    }

    /// Drops the confirms still owed: nobody is left to receive them (the channel closes,
    /// and the client may reuse its number).
    pub(crate) fn forget_confirms(&mut self) {
        self.unconfirmed = None;
    }

    /// Counts `n` deliveries settled as `how` (acks, for operators' rates).
    pub(crate) fn count_settled(&mut self, how: Settle, n: usize) {
        if how == Settle::Ack {
            self.stats.ack += n as u64;
        }
    }

    /// Whether confirm.select was sent on it.
    pub(crate) fn confirms(&self) -> bool {
        self.confirm_next != 0
    }

    /// Consumers on the channel.
    pub(crate) fn consumer_count(&self) -> usize {
        self.consumers.0.len()
    }

    /// confirm.select (a channel in tx mode cannot switch).
    pub(crate) fn select_confirms(&mut self) -> Result<(), ProtocolError> {
        if self.tx.is_some() {
            return Err(ProtocolError::new(
                ErrorCode::PreconditionFailed,
                OpKind::ConfirmSelect,
                "cannot switch from tx to confirm mode",
            ));
        }
        if self.confirm_next == 0 {
            self.confirm_next = 1;
        }
        Ok(())
    }

    /// tx.select (a channel in confirm mode cannot switch).
    pub(crate) fn select_tx(&mut self) -> Result<(), ProtocolError> {
        if self.confirm_next != 0 {
            return Err(ProtocolError::new(
                ErrorCode::PreconditionFailed,
                OpKind::TxSelect,
                "cannot switch from confirm to tx mode",
            ));
        }
        if self.tx.is_none() {
            self.tx = Some(Box::default());
        }
        Ok(())
    }

    /// In a transaction, buffers `op` until commit (`Ok(None)`); otherwise hands it back
    /// to be applied now.
    pub(crate) fn buffer(&mut self, kind: OpKind, op: TxOp) -> Result<Option<TxOp>, ProtocolError> {
        let Some(tx) = self.tx.as_mut() else {
            return Ok(Some(op));
        };
        if tx.ops.len() >= MAX_TX_OPS {
            return Err(ProtocolError::new(
                ErrorCode::PreconditionFailed,
                kind,
                format!("transaction exceeds {MAX_TX_OPS} operations; commit more often"),
            ));
        }
        tx.ops.push(op);
        Ok(None)
    }

    /// Takes the buffered operations of a transaction, leaving the channel transactional.
    pub(crate) fn take_tx(&mut self, kind: OpKind) -> Result<Vec<TxOp>, ProtocolError> {
        match self.tx.as_mut() {
            Some(tx) => Ok(std::mem::take(&mut tx.ops)),
            None => Err(ProtocolError::new(
                ErrorCode::PreconditionFailed,
                kind,
                "channel is not transactional",
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::ChannelState;

    fn confirms(c: &mut ChannelState, synced: Option<u64>) -> Vec<(u64, bool)> {
        let mut out = Vec::new();
        c.take_confirms(synced, &mut out);
        out
    }

    /// The countdown the owner-task composition needs: a publish to three queues is
    /// confirmed once all three answered, in publish order, after the sync its durable
    /// answers wait for, and nacked if any queue refused it.
    #[test]
    fn a_confirm_waits_for_every_queue_its_sync_and_the_publishes_before_it() {
        let mut c = ChannelState::new(0);
        c.select_confirms().expect("confirm mode");
        let (a, b) = (
            c.next_publish_seq().expect("seq"),
            c.next_publish_seq().expect("seq"),
        );
        c.expect_answers(a, 3);
        c.expect_answers(b, 1);
        c.answered(b, true, None);
        c.answered(a, true, None);
        c.answered(a, true, Some(7));
        assert_eq!(
            confirms(&mut c, None),
            [],
            "a still waits for a queue; b waits for a"
        );
        c.answered(a, true, None);
        assert_eq!(
            confirms(&mut c, Some(6)),
            [],
            "a waits for the sync of epoch 7"
        );
        assert_eq!(confirms(&mut c, Some(7)), [(a, true), (b, true)]);
        assert_eq!(c.unconfirmed().count(), 0);

        let d = c.next_publish_seq().expect("seq");
        c.expect_answers(d, 2);
        c.answered(d, false, None);
        c.answered(d, true, Some(8));
        c.sync_failed(8);
        assert_eq!(
            confirms(&mut c, Some(7)),
            [(d, false)],
            "refused and not durable"
        );

        let e = c.next_publish_seq().expect("seq");
        c.expect_answers(e, 2);
        c.answered(e, true, None);
        assert_eq!(
            confirms(&mut c, Some(100)),
            [],
            "one queue has not answered"
        );
        c.answered(e, true, None);
        assert_eq!(confirms(&mut c, Some(100)), [(e, true)]);
    }
}
