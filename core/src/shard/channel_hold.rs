//! The per-channel hold. AMQP answers a channel's requests in the order the client sent
//! them, so a channel whose request went to a queue by mail (basic.consume, basic.cancel,
//! basic.get, queue.purge, queue.delete) keeps what the client sends after it until the
//! queue answers.
//!
//! With one shard the answer comes within the operation that asked, and nothing is ever
//! held (`poll_effects` asserts it). With shards, or with the simulation's scheduled mail
//! (`set_mail_scheduled`), an answer takes a while, and the hold is what keeps consume-ok,
//! get-ok, purge-ok and cancel-ok in request order.
//!
//! Each channel has at most one request out: the next one waits here like any other op.
//! An answer names the opening of the channel it is for (`ChannelAddr`); an answer for an
//! opening that closed meanwhile finds no hold to release.

use super::Broker;
use crate::channel::hold::{Hold, MAX_HELD_OPS};
use crate::command::Op;
use crate::effect::Effect;
use crate::error::{ErrorCode, ProtocolError};
use crate::ids::{ChannelAddr, ChannelRef, ConnId};
use std::collections::VecDeque;

impl Broker {
    /// Channel `ch` sent a request by mail: what comes after waits for the answer.
    pub(super) fn await_answer(&mut self, ch: ChannelRef) {
        debug_assert!(
            !self.chans.awaiting(ch),
            "a channel has one request out at a time"
        );
        self.chans.set_awaiting(ch, true);
    }

    /// The answer to a request of `to` arrived. Whether it answers a request of a live
    /// opening: if so the request is answered, and the caller runs what waited
    /// (`run_held`) once the answer is handled. An answer for a closed opening releases
    /// nothing, and neither does one no request waits for: across nodes an answer can
    /// outlive its request (a quorum queue's consumer attached again where its new leader
    /// is, answered after the client cancelled that consumer; a node's answer after the
    /// request failed when the node looked down). The caller treats it as for a closed
    /// opening, so the client hears nothing it did not ask for, and a consumer the answer
    /// attached is cancelled again. (The jepsen run found this as a debug assertion on
    /// 2026-12-02.)
    pub(super) fn take_answer(&mut self, to: ChannelAddr) -> bool {
        if !self.chans.is_live(to) || !self.chans.awaiting(to.ch) {
            return false;
        }
        self.chans.set_awaiting(to.ch, false);
        true
    }

    /// Whether an op of channel `ch` must wait: the channel waits for an answer, or
    /// already keeps earlier ops.
    #[inline]
    pub(super) fn must_hold(&self, ch: ChannelRef) -> bool {
        !(self.chans.awaiting == 0 && self.chans.holds.is_empty())
            && (self.chans.awaiting(ch) || self.chans.holds.contains_key(&ch))
    }

    /// Keeps `op` until its channel's request is answered (`must_hold` said it must wait).
    pub(super) fn hold_op(&mut self, ch: ChannelRef, op: Op) {
        let hold = self.chans.holds.entry(ch).or_insert_with(|| Hold {
            later: VecDeque::new(),
        });
        if hold.later.len() >= MAX_HELD_OPS {
            let error = ProtocolError::new(
                ErrorCode::ResourceError,
                op.kind(),
                format!(
                    "more than {MAX_HELD_OPS} operations sent on channel {} while a request \
                     was in progress; wait for replies before sending more",
                    ch.channel
                ),
            );
            self.release_connection(ch.conn);
            self.effects.push(Effect::ConnectionError {
                conn: ch.conn,
                error,
            });
            return;
        }
        hold.later.push_back(op);
    }

    /// Runs what waited on channel `ch`, in order, until an op sends a request again or
    /// nothing is left.
    pub(super) fn run_held(&mut self, ch: ChannelRef) {
        // Each turn takes one op out of a list bounded by `MAX_HELD_OPS`.
        for _ in 0..=MAX_HELD_OPS {
            if self.chans.awaiting(ch) {
                return;
            }
            let Some(hold) = self.chans.holds.get_mut(&ch) else {
                return;
            };
            let Some(op) = hold.later.pop_front() else {
                self.chans.holds.remove(&ch);
                return;
            };
            self.run_op(ch, op);
        }
        unreachable!("a hold grew while it was run");
    }

    /// Connection `conn` closes: what its channels held runs first (the client sent it
    /// before the close), without waiting for answers nobody will read.
    pub(super) fn flush_holds(&mut self, conn: ConnId) {
        let held: crate::sorted_vec::SortedSet<u16> = self
            .chans
            .holds
            .keys()
            .filter(|c| c.conn == conn)
            .map(|c| c.channel)
            .collect();
        for ch in held.into_iter().map(|n| ChannelRef::new(conn, n)) {
            while let Some(op) = self
                .chans
                .holds
                .get_mut(&ch)
                .and_then(|h| h.later.pop_front())
            {
                self.chans.set_awaiting(ch, false);
                self.run_op(ch, op);
            }
            self.chans.holds.remove(&ch);
        }
    }

    /// A channel failed: what it held is dropped, as AMQP discards a failed channel's
    /// operations until its close-ok, and it awaits no answer (late ones find it closing).
    pub(super) fn drop_hold(&mut self, ch: ChannelRef) {
        self.chans.holds.remove(&ch);
        self.chans.set_awaiting(ch, false);
    }

    /// A connection is gone: so is everything its channels held.
    pub(super) fn drop_holds(&mut self, conn: ConnId) {
        self.chans.holds.retain(|c, _| c.conn != conn);
    }

    /// Channels waiting for an answer or holding ops (none once all mail is delivered).
    #[cfg(test)]
    pub(super) fn held_channels(&self) -> usize {
        self.chans.awaiting + self.chans.holds.len()
    }
}
