//! Connections (their state) and channels: opening, and release (which hands unacked messages
//! back to their queues and removes consumers and exclusive queues).

use super::{Broker, OpResult};
use crate::channel::ChannelState;
use crate::channel::conn::Conn;
use crate::command::OpKind;
use crate::effect::Reply;
use crate::error::{ErrorCode, ProtocolError};
use crate::ids::{ChannelRef, ConnId, QueueId};
use crate::queue::state::{ConsumerId, Settle};
use crate::sorted_vec::SortedSet;
use std::collections::BTreeSet;
use std::sync::Arc;

impl Broker {
    pub(super) fn connection_open(
        &mut self,
        conn: ConnId,
        vhost: String,
        user: String,
        cancel_notify: bool,
    ) -> OpResult {
        let internal = conn == crate::mail::mailbox::RESTORE_CONN;
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
        self.chans.conns.entry(conn).or_insert_with(|| {
            Box::new(Conn {
                vhost,
                perms,
                client_id: None,
                cancel_notify,
                channels: SortedSet::default(),
                exclusive_queues: SortedSet::default(),
                in_flight: crate::mail::credit::Counter::default(),
                consumers: 0,
                paused_in: SortedSet::default(),
                // A connection opened after a change may not use a snapshot from before it.
                routes_seen: self.topo.routes().version(),
                closed_stats: crate::stats::MessageStats::default(),
            })
        });
        if self.alarm {
            self.effects.push(crate::effect::Effect::Blocked { conn });
        }
        Ok(())
    }

    pub(super) fn channel_open(&mut self, ch: ChannelRef) -> OpResult {
        if ch.channel == 0 || self.chans.channels.contains_key(&ch) {
            return Err(ProtocolError::new(
                ErrorCode::ChannelError,
                OpKind::ChannelOpen,
                format!("second 'channel.open' seen on channel {}", ch.channel),
            ));
        }
        let serial = self.chans.next_channel_serial;
        // Wrapping: an opening is told from the one 2^32 openings earlier only if mail for
        // that one is still on its way.
        self.chans.next_channel_serial = serial.wrapping_add(1);
        self.chans
            .channels
            .insert(ch, Box::new(ChannelState::new(serial)));
        if let Some(conn) = self.chans.conns.get_mut(&ch.conn) {
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
    pub(super) fn forget_confirms(&mut self, ch: ChannelRef) {
        if let Some(channel) = self.chans.channels.get_mut(&ch) {
            channel.forget_confirms();
        }
    }

    pub(super) fn cancel_channel_consumers(&mut self, ch: ChannelRef) {
        let Some(channel) = self.chans.channels.get_mut(&ch) else {
            return;
        };
        channel.tx = None;
        let consumers: Vec<(Arc<str>, ConsumerId, QueueId)> = channel
            .consumers
            .iter()
            .map(|(tag, cid, queue)| (tag.clone(), cid, queue))
            .collect();
        for (tag, cid, queue) in consumers {
            self.forget_consumer(ch, &tag);
            self.mail.push_back(super::mail::Mail::Cancel {
                queue,
                consumer: cid,
                reply: None,
            });
        }
    }

    pub(super) fn requeue_channel(&mut self, ch: ChannelRef) {
        let Some(channel) = self.chans.channels.get_mut(&ch) else {
            return;
        };
        let unacked = channel.take_all_unacked();
        self.send_settles(unacked, Settle::Requeue);
    }

    /// Releases everything a connection holds: its channels and its exclusive queues. All
    /// consumers go before any message is requeued, so nothing is dispatched to a channel of
    /// the dying connection.
    pub(super) fn release_connection(&mut self, conn: ConnId) {
        self.drop_holds(conn);
        let Some(c) = self.chans.conns.get(&conn) else {
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
            self.chans.remove_channel(ch);
        }
        let exclusive: Vec<QueueId> = self
            .chans
            .conns
            .get(&conn)
            .map(|c| c.exclusive_queues.iter().copied().collect())
            .unwrap_or_default();
        for q in exclusive {
            self.delete_queue(q);
        }
        self.give_owed_credit(conn, true);
        if let Some(c) = self.chans.conns.remove(&conn) {
            // Its vhost's counts keep what it did.
            self.closed_stats
                .entry(c.vhost)
                .or_default()
                .add(&c.closed_stats);
            for queue in c.paused_in {
                self.mail
                    .push_back(super::mail::Mail::PublisherGone { queue, conn });
            }
        }
    }

    /// The shared record of channel `ch`'s limits, for a queue on another shard it
    /// consumes from (made now if it has none: its counters and its connection's move
    /// into it).
    pub(super) fn share_credit(
        &mut self,
        ch: ChannelRef,
    ) -> Option<Arc<crate::mail::credit::SharedCredit>> {
        let write_window = self.config.write_window;
        let in_flight = self.chans.conns.get_mut(&ch.conn)?.in_flight.share();
        let channel = self.chans.channels.get_mut(&ch)?;
        Some(channel.share_credit(in_flight, write_window))
    }

    /// The host wrote `count` deliveries (or they bounced off a closed channel): reopen
    /// the window and resume the consumers it stopped.
    pub(super) fn written(&mut self, conn: ConnId, count: u32) {
        let window = self.config.write_window;
        let Some(c) = self.chans.conns.get_mut(&conn) else {
            return;
        };
        let before = c.in_flight.sub(count);
        if before >= window && before.saturating_sub(count) < window {
            let channels: Vec<u16> = c.channels.iter().copied().collect();
            let mut queues = BTreeSet::new();
            for n in channels {
                if let Some(channel) = self.chans.channels.get(&ChannelRef::new(conn, n)) {
                    queues.extend(channel.consumers.values().map(|(_, q)| q));
                }
            }
            for queue in queues {
                self.mail.push_back(super::mail::Mail::Dispatch { queue });
            }
        }
        self.give_owed_credit(conn, false);
    }
}
