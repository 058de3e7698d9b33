//! Connections and channels: their state, opening, and release (which hands unacked messages
//! back to their queues and removes consumers and exclusive queues).

use super::{Broker, OpResult};
use crate::command::{OpKind, Publish};
use crate::effect::Reply;
use crate::error::{ErrorCode, ProtocolError};
use crate::ids::{ChannelRef, ConnId, QueueId, VhostId};
use crate::queue::state::{ConsumerId, Settle, Unacked};
use crate::sorted_vec::SortedSet;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

pub(crate) struct Conn {
    pub(crate) cancel_notify: bool,
    pub(crate) channels: SortedSet<u16>,
    pub(crate) exclusive_queues: SortedSet<QueueId>,
    /// Deliveries handed to the host and not yet reported written (`Op::Written`).
    pub(crate) in_flight: u32,
    /// Consumers on this connection's channels: a connection with any is never paused.
    pub(crate) consumers: u32,
    /// Queues currently pausing this connection (flow control).
    pub(crate) paused_in: SortedSet<QueueId>,
    pub(crate) user: String,
    pub(crate) vhost: VhostId,
    /// What the user may do in the vhost; `None` for the broker's internal connections
    /// (restore, admin), which may do anything.
    pub(crate) perms: Option<Arc<crate::access::Permissions>>,
    /// The routing table's version after this connection's last routing change: its
    /// pre-routed publishes must come from a snapshot at least this new (`Publish::routed`).
    pub(crate) routes_seen: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ChannelState {
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

pub(crate) struct Channel {
    pub(crate) state: ChannelState,
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
    pub(crate) tx: Option<Vec<TxOp>>,
    /// The channel's direct reply-to consumer, if any.
    pub(crate) reply_consumer: Option<super::reply_to::ReplyConsumer>,
    /// The queue `""` refers to (AMQP: the last queue declared on the channel).
    pub(crate) last_queue: Option<Arc<str>>,
}

impl Channel {
    fn new() -> Channel {
        Channel {
            state: ChannelState::Open,
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
}

impl Broker {
    pub(super) fn connection_open(
        &mut self,
        conn: ConnId,
        vhost: String,
        user: String,
        cancel_notify: bool,
    ) -> OpResult {
        let internal = conn == super::RESTORE_CONN;
        let access = match self.vhost_id(&vhost) {
            None => Err(ProtocolError::new(
                ErrorCode::NotAllowed,
                OpKind::ConnectionOpen,
                format!("vhost '{vhost}' not found"),
            )),
            Some(id) if internal => Ok((id, None)),
            Some(id) => self.vhost_access(&vhost, &user).map(|p| (id, Some(p))),
        };
        let (vhost, perms) = match access {
            Ok(a) => a,
            Err(error) => {
                // Not registered yet, so `fail` cannot find it: report directly.
                self.effects
                    .push(crate::effect::Effect::ConnectionError { conn, error });
                return Ok(());
            }
        };
        self.conns.entry(conn).or_insert_with(|| {
            Box::new(Conn {
                vhost,
                perms,
                cancel_notify,
                channels: SortedSet::default(),
                exclusive_queues: SortedSet::default(),
                in_flight: 0,
                consumers: 0,
                paused_in: SortedSet::default(),
                user,
                // A connection opened after a change may not use a snapshot from before it.
                routes_seen: self.routes.version(),
            })
        });
        if self.alarm {
            self.effects.push(crate::effect::Effect::Blocked { conn });
        }
        Ok(())
    }

    pub(super) fn channel_open(&mut self, ch: ChannelRef) -> OpResult {
        if ch.channel == 0 || self.channels.contains_key(&ch) {
            return Err(ProtocolError::new(
                ErrorCode::ChannelError,
                OpKind::ChannelOpen,
                format!("second 'channel.open' seen on channel {}", ch.channel),
            ));
        }
        self.channels.insert(ch, Box::new(Channel::new()));
        if let Some(conn) = self.conns.get_mut(&ch.conn) {
            conn.channels.insert(ch.channel);
        }
        self.reply(ch, Reply::ChannelOpenOk);
        Ok(())
    }

    /// Releases a channel's resources: cancels its consumers, requeues its unacked messages
    /// (at their original positions) and drops an open transaction. The channel entry stays
    /// (the caller removes it or marks it closing).
    pub(super) fn release_channel(&mut self, ch: ChannelRef) {
        // Consumers go first, so the requeued messages are not dispatched straight back to
        // this channel.
        self.cancel_channel_consumers(ch);
        self.requeue_channel(ch);
        self.forget_confirms(ch);
        self.release_reply_to(ch);
    }

    /// Drops the confirms a channel still waits for: nobody is left to receive them (and the
    /// client may reuse the channel number).
    fn forget_confirms(&mut self, ch: ChannelRef) {
        let Some(channel) = self.channels.get_mut(&ch) else {
            return;
        };
        if channel.pending_confirms > 0 {
            channel.pending_confirms = 0;
            self.pending_confirms.retain(|p| p.ch != ch);
        }
    }

    fn cancel_channel_consumers(&mut self, ch: ChannelRef) {
        let Some(channel) = self.channels.get_mut(&ch) else {
            return;
        };
        channel.tx = None;
        let consumers: Vec<(ConsumerId, QueueId)> = channel.consumers.values().collect();
        for (cid, queue) in consumers {
            self.remove_consumer(queue, cid);
        }
    }

    fn requeue_channel(&mut self, ch: ChannelRef) {
        let Some(channel) = self.channels.get_mut(&ch) else {
            return;
        };
        let unacked = std::mem::take(&mut channel.unacked);
        channel.consumer_unacked = 0;
        let mut touched = BTreeSet::new();
        for (_, u) in unacked {
            let (queue, len) = (u.queue, u.message.body_len() as u64);
            if self
                .with_queue(queue, |q, io| q.settle(io, u, Settle::Requeue))
                .is_some()
            {
                touched.insert(queue);
            } else {
                // Its queue was deleted while it was out: nothing holds it any more.
                self.release(len);
            }
        }
        for q in touched {
            self.dispatch(q);
        }
    }

    /// Releases everything a connection holds: its channels and its exclusive queues. All
    /// consumers go before any message is requeued, so nothing is dispatched to a channel of
    /// the dying connection.
    pub(super) fn release_connection(&mut self, conn: ConnId) {
        let Some(c) = self.conns.get(&conn) else {
            return;
        };
        let channels: Vec<ChannelRef> = c
            .channels
            .iter()
            .map(|&n| ChannelRef::new(conn, n))
            .collect();
        for &ch in &channels {
            self.cancel_channel_consumers(ch);
        }
        for &ch in &channels {
            self.requeue_channel(ch);
            self.forget_confirms(ch);
            self.release_reply_to(ch);
            self.channels.remove(&ch);
        }
        let exclusive: Vec<QueueId> = self
            .conns
            .get(&conn)
            .map(|c| c.exclusive_queues.iter().copied().collect())
            .unwrap_or_default();
        for q in exclusive {
            self.delete_queue(q);
        }
        if let Some(c) = self.conns.remove(&conn) {
            for id in c.paused_in {
                if let Some(q) = self.queues.get_mut(&id) {
                    q.pausing.retain(|&p| p != conn);
                }
            }
        }
    }

    /// The host wrote `count` deliveries: reopen the window and resume blocked consumers.
    pub(super) fn written(&mut self, conn: ConnId, count: u32) {
        let window = self.config.write_window;
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        let was_blocked = c.in_flight >= window;
        c.in_flight = c.in_flight.saturating_sub(count);
        if was_blocked && c.in_flight < window {
            let channels: Vec<u16> = c.channels.iter().copied().collect();
            let mut queues = BTreeSet::new();
            for n in channels {
                if let Some(channel) = self.channels.get(&ChannelRef::new(conn, n)) {
                    queues.extend(channel.consumers.values().map(|(_, q)| q));
                }
            }
            for q in queues {
                self.dispatch(q);
            }
        }
    }
}
