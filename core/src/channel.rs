//! One channel's state and the operations that need nothing but the channel: delivery
//! tags and the deliveries awaiting acks, the shared (global) prefetch, consumer tags,
//! publish sequence numbers in confirm mode, and the operations a transaction buffers.
//!
//! Like `queue::state`, this is a unit meant to get an owner of its own (the connection's
//! task, ARCHITECTURE.md "warren-runtime"): it refers to queues and consumers only by id.

use crate::command::{OpKind, Publish};
use crate::error::{ErrorCode, ProtocolError};
use crate::ids::QueueId;
use crate::queue::state::{ConsumerId, Settle, Unacked};
use std::collections::BTreeMap;
use std::sync::Arc;

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

    pub(crate) fn remove(&mut self, tag: &str) {
        if let Ok(i) = self.find(tag) {
            self.0.remove(i);
        }
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

/// One channel's state: its deliveries awaiting acks (by delivery tag), prefetch, consumers,
/// confirm and transaction mode.
pub(crate) struct ChannelState {
    pub(crate) phase: Phase,
    pub(crate) next_delivery_tag: u64,
    pub(crate) unacked: BTreeMap<u64, Unacked>,
    /// Unacked consumer deliveries: what `global` prefetch limits.
    pub(crate) consumer_unacked: u32,
    /// basic.qos global=false: the limit given to consumers created from now on.
    pub(crate) prefetch_count: u16,
    /// basic.qos global=true: one limit shared by all consumers of the channel.
    pub(crate) global_prefetch: u16,
    pub(crate) consumers: ConsumerTags,
    /// The next publish sequence number, once in confirm mode.
    pub(crate) confirm_next: Option<u64>,
    /// Confirms of this channel waiting for a sync: later confirms queue behind them.
    pub(crate) pending_confirms: u32,
    /// Boxed, as the reply consumer: few channels are transactional, and every idle MQTT
    /// connection has a channel.
    #[expect(
        clippy::box_collection,
        reason = "one word inline instead of three in every channel"
    )]
    pub(crate) tx: Option<Box<Vec<TxOp>>>,
    /// The channel's direct reply-to consumer, if any.
    pub(crate) reply_consumer: Option<Box<crate::broker::reply_to::ReplyConsumer>>,
    /// The queue `""` refers to (AMQP: the last queue declared on the channel).
    pub(crate) last_queue: Option<Arc<str>>,
}

impl ChannelState {
    pub(crate) fn new() -> ChannelState {
        ChannelState {
            phase: Phase::Open,
            next_delivery_tag: 1,
            unacked: BTreeMap::new(),
            consumer_unacked: 0,
            prefetch_count: 0,
            global_prefetch: 0,
            consumers: ConsumerTags::default(),
            confirm_next: None,
            pending_confirms: 0,
            tx: None,
            last_queue: None,
            reply_consumer: None,
        }
    }

    /// Gives a delivery its tag. A delivery that needs an ack is held until settled; one
    /// from a consumer also counts against the shared prefetch.
    pub(crate) fn deliver(&mut self, unacked: Option<Unacked>) -> u64 {
        let tag = self.next_delivery_tag;
        self.next_delivery_tag += 1;
        if let Some(u) = unacked {
            if u.consumer.is_some() {
                self.consumer_unacked += 1;
            }
            self.unacked.insert(tag, u);
        }
        tag
    }

    /// Whether the shared (global) prefetch allows one more consumer delivery that needs an
    /// ack.
    pub(crate) fn has_shared_credit(&self) -> bool {
        self.global_prefetch == 0 || self.consumer_unacked < u32::from(self.global_prefetch)
    }

    /// basic.qos: `global` sets the limit all consumers of the channel share; otherwise the
    /// limit each consumer created from now on gets.
    pub(crate) fn set_prefetch(&mut self, prefetch_count: u16, global: bool) {
        if global {
            self.global_prefetch = prefetch_count;
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
        let from_consumers = settled.iter().filter(|u| u.consumer.is_some()).count();
        self.consumer_unacked = self
            .consumer_unacked
            .saturating_sub(u32::try_from(from_consumers).unwrap_or(u32::MAX));
        Ok(settled)
    }

    /// Takes every delivery awaiting an ack (recover, channel close).
    pub(crate) fn take_all_unacked(&mut self) -> Vec<Unacked> {
        self.consumer_unacked = 0;
        std::mem::take(&mut self.unacked).into_values().collect()
    }

    /// The sequence number of the next publish, in confirm mode.
    pub(crate) fn next_publish_seq(&mut self) -> Option<u64> {
        let seq = self.confirm_next?;
        self.confirm_next = Some(seq + 1);
        Some(seq)
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
        if self.confirm_next.is_none() {
            self.confirm_next = Some(1);
        }
        Ok(())
    }

    /// tx.select (a channel in confirm mode cannot switch).
    pub(crate) fn select_tx(&mut self) -> Result<(), ProtocolError> {
        if self.confirm_next.is_some() {
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
        if tx.len() >= MAX_TX_OPS {
            return Err(ProtocolError::new(
                ErrorCode::PreconditionFailed,
                kind,
                format!("transaction exceeds {MAX_TX_OPS} operations; commit more often"),
            ));
        }
        tx.push(op);
        Ok(None)
    }

    /// Takes the buffered operations of a transaction, leaving the channel transactional.
    pub(crate) fn take_tx(&mut self, kind: OpKind) -> Result<Vec<TxOp>, ProtocolError> {
        match self.tx.as_mut() {
            Some(tx) => Ok(std::mem::take(&mut **tx)),
            None => Err(ProtocolError::new(
                ErrorCode::PreconditionFailed,
                kind,
                "channel is not transactional",
            )),
        }
    }
}
