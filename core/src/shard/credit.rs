//! The bridge between the channel side and the queue side for the limits that span
//! queues: `ChannelCredit` reads the channel and connection records of this shard for a
//! queue's dispatch (`queue::state::Credit`); queues of other shards use the channel's
//! `mail::credit::SharedCredit` instead. It lives in the composition because it is the one
//! place that may see both sides.

use crate::channel::ChannelState;
use crate::channel::conn::Conn;
use crate::idhash::IdMap;
use crate::ids::{ChannelAddr, ChannelRef, ConnId};
use crate::queue::state::{Credit, QueueConsumer};

/// The limits that span queues, as `QueueState` dispatch asks for them (see `Credit`).
pub(crate) struct ChannelCredit<'a> {
    pub(crate) conns: &'a mut IdMap<ConnId, Box<Conn>>,
    pub(crate) channels: &'a mut IdMap<ChannelRef, Box<ChannelState>>,
    pub(crate) write_window: u32,
}

impl ChannelCredit<'_> {
    /// The channel `to` names, if that opening of it is still open: a consumer whose
    /// channel closed or failed stays in its queue until its cancel arrives.
    fn open_channel(&self, to: ChannelAddr) -> Option<&ChannelState> {
        self.channels
            .get(&to.ch)
            .map(|c| &**c)
            .filter(|c| c.is_open_as(to.serial))
    }

    /// Gives back the credit of a delivery to `to` that did not happen (taken in this
    /// dispatch, so the queues it could have stopped are not waiting yet).
    fn give_back_to(&mut self, to: ChannelAddr, ack_required: bool) {
        if ack_required
            && let Some(c) = self.channels.get_mut(&to.ch)
            && c.serial == to.serial
        {
            c.consumer_unacked.sub(1);
        }
        if let Some(c) = self.conns.get_mut(&to.ch.conn) {
            c.in_flight.sub(1);
        }
    }
}

impl Credit for ChannelCredit<'_> {
    fn may_deliver(&self, c: &QueueConsumer) -> bool {
        let ack_required = !c.no_ack;
        if let Some(shared) = &c.shared {
            return shared.may_deliver(ack_required);
        }
        let to = c.addr();
        if self
            .conns
            .get(&to.ch.conn)
            .is_none_or(|c| c.in_flight.get() >= self.write_window)
        {
            return false;
        }
        self.open_channel(to)
            .is_some_and(|c| !ack_required || c.has_shared_credit())
    }

    fn take(&mut self, c: &QueueConsumer) -> bool {
        let ack_required = !c.no_ack;
        if let Some(shared) = &c.shared {
            return shared.take(ack_required);
        }
        let to = c.addr();
        let Some(conn) = self.conns.get_mut(&to.ch.conn) else {
            return false;
        };
        let Some(channel) = self.channels.get_mut(&to.ch) else {
            return false;
        };
        if !channel.is_open_as(to.serial) {
            return false;
        }
        if !conn.in_flight.take(self.write_window) {
            return false;
        }
        if ack_required
            && !channel
                .consumer_unacked
                .take(u32::from(channel.global_prefetch))
        {
            conn.in_flight.sub(1);
            return false;
        }
        true
    }

    fn give_back(&mut self, c: &QueueConsumer) {
        let ack_required = !c.no_ack;
        match &c.shared {
            Some(shared) => shared.give_back(ack_required),
            None => self.give_back_to(c.addr(), ack_required),
        }
    }
}
