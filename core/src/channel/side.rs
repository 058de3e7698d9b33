//! The channel side's state: the connections and channels of one shard, what channels hold
//! while a request is out, and the direct reply-to addresses. Its handlers are the
//! composition's (`shard/channel_*.rs`) except those that need nothing but this state,
//! which are here.

use crate::channel::ChannelState;
use crate::channel::conn::Conn;
use crate::channel::hold::Hold;
use crate::idhash::IdMap;
use crate::ids::{ChannelAddr, ChannelRef, ConnId};
use std::collections::HashMap;
use std::sync::Arc;

/// The connections and channels of one shard.
#[derive(Default)]
pub(crate) struct ChannelSide {
    pub(crate) conns: IdMap<ConnId, Box<Conn>>,
    pub(crate) channels: IdMap<ChannelRef, Box<ChannelState>>,
    /// What channels whose request is not answered yet received meanwhile (`hold.rs`).
    pub(crate) holds: IdMap<ChannelRef, Hold>,
    /// Channels with `ChannelState::awaiting` set: while none are, no op can wait, and
    /// `hold_op` costs two compares.
    pub(crate) awaiting: usize,
    /// The serial of the next channel opened (`ChannelAddr`).
    pub(crate) next_channel_serial: u32,
    /// Direct reply-to addresses -> the channel consuming replies (lookup only).
    pub(crate) reply_addresses: HashMap<Arc<str>, ChannelRef>,
    /// The last client-chosen consumer tag (`shared_tag`).
    pub(crate) last_tag: Option<Arc<str>>,
}

impl ChannelSide {
    /// How mail addresses channel `ch` now (its current opening).
    pub(crate) fn addr(&self, ch: ChannelRef) -> ChannelAddr {
        let serial = self.channels.get(&ch).map_or(0, |c| c.serial);
        ChannelAddr { ch, serial }
    }

    /// Whether `to` is the current opening of its channel, and open.
    pub(crate) fn is_live(&self, to: ChannelAddr) -> bool {
        self.channels
            .get(&to.ch)
            .is_some_and(|c| c.is_open_as(to.serial))
    }

    /// Whether channel `ch` has a request out.
    pub(crate) fn awaiting(&self, ch: ChannelRef) -> bool {
        self.awaiting > 0 && self.channels.get(&ch).is_some_and(|c| c.awaiting)
    }

    /// Sets or clears `ChannelState::awaiting`, keeping the count.
    pub(crate) fn set_awaiting(&mut self, ch: ChannelRef, on: bool) {
        if let Some(c) = self.channels.get_mut(&ch)
            && c.awaiting != on
        {
            c.awaiting = on;
            if on {
                self.awaiting += 1;
            } else {
                self.awaiting -= 1;
            }
        }
    }

    /// Removes channel `ch`'s state and its number from its connection (closed, or its
    /// connection gone).
    pub(crate) fn remove_channel(&mut self, ch: ChannelRef) {
        let removed = self.channels.remove(&ch);
        if removed.as_ref().is_some_and(|c| c.awaiting) {
            self.awaiting -= 1;
        }
        if let Some(conn) = self.conns.get_mut(&ch.conn) {
            conn.channels.remove(&ch.channel);
            // The connection's counts outlive its channels (operators' rates never fall).
            if let Some(c) = &removed {
                conn.closed_stats.add(&c.stats);
            }
        }
    }
}
