//! Operators' ops answered later. An op on the admin connection (`Broker::admin`) whose
//! queue lives on another shard (purge, delete) is answered by mail after `admin` returned,
//! as an effect for the admin connection, which no host reads. Such an op keeps its channel
//! until then (the next op takes another one, so it neither waits behind it nor takes its
//! answer) and its answer is kept here for the host (`take_admin_answers`), so `warren ctl
//! purge-queue` reports the count as with one shard.

use super::Broker;
use crate::command::{Op, OpKind};
use crate::effect::{Effect, Reply};
use crate::error::{ErrorCode, ProtocolError};
use crate::ids::ChannelRef;
use crate::mail::mailbox::RESTORE_CONN;

/// An admin op's answer: its reply (none for a `nowait` op) or the error that closed its
/// channel.
type AdminAnswer = Result<Option<Reply>, ProtocolError>;

/// The first channel a deferred op's successor takes (1 is the restore's, 2 the admin
/// channel, 3 the status channel).
const FIRST_SPARE: u16 = 4;
/// Admin ops that may wait for an answer at once; more are refused (the host sends one at
/// a time per operator request, so this is many requests in flight).
pub(super) const MAX_PENDING: usize = 256;

/// The admin ops waiting for their answer (by channel, with their kind), the answers that
/// came and are not taken yet, and the channels a late error left closing.
#[derive(Default)]
pub(super) struct LateAdmin {
    pending: Vec<(u16, OpKind)>,
    answers: Vec<(u16, AdminAnswer)>,
    close_due: Vec<u16>,
    /// The channel of the last `admin` op if it waits (`take_admin_deferral`).
    deferred: Option<u16>,
    /// An operator's own op runs (`apply_admin`'s `AdminRequest::Op`): it may be answered
    /// later. The ops an import or a restore runs on the admin channel wait behind each
    /// other there, as before, and their late answers are nobody's to take.
    top_level: bool,
}

impl LateAdmin {
    pub(super) fn waiting(&self) -> bool {
        !self.pending.is_empty()
    }

    fn is_pending(&self, channel: u16) -> bool {
        self.pending.iter().any(|(c, _)| *c == channel)
    }

    fn answered(&mut self, channel: u16, answer: AdminAnswer) {
        let Some(at) = self.pending.iter().position(|(c, _)| *c == channel) else {
            return;
        };
        self.pending.swap_remove(at);
        if answer.is_err() {
            self.close_due.push(channel);
        }
        self.keep(channel, answer);
    }

    /// Keeps an answer for the host. Bounded: a host that never takes them (the
    /// simulations' `Shards`) keeps the newest `MAX_PENDING`.
    fn keep(&mut self, channel: u16, answer: AdminAnswer) {
        if self.answers.len() >= MAX_PENDING {
            let _oldest = self.answers.remove(0);
        }
        self.answers.push((channel, answer));
    }
}

impl Broker {
    /// The channel for the next admin op given `channel` (the admin channel): itself
    /// unless an op there waits for its answer, else the first spare channel free of one;
    /// `None` when `MAX_PENDING` ops wait.
    pub(super) fn admin_channel_for(&mut self, now: u64, channel: u16) -> Option<u16> {
        if !self.admin_late.top_level {
            return Some(channel);
        }
        for c in std::mem::take(&mut self.admin_late.close_due) {
            let ch = ChannelRef::new(RESTORE_CONN, c);
            if self.chans.channels.contains_key(&ch) {
                self.handle(now, ch, Op::ChannelCloseOk);
            }
        }
        if !self.admin_late.is_pending(channel) {
            return Some(channel);
        }
        if self.admin_late.pending.len() >= MAX_PENDING {
            return None;
        }
        (FIRST_SPARE..).find(|c| !self.admin_late.is_pending(*c))
    }

    /// After an admin op on `ch` got no answer in the call: if `ch` waits for one (the
    /// op went to a queue on another shard), the op is answered later.
    pub(super) fn admin_maybe_deferred(&mut self, ch: ChannelRef, kind: OpKind) {
        if self.admin_late.top_level && self.chans.awaiting(ch) {
            self.admin_late.pending.push((ch.channel, kind));
            self.admin_late.deferred = Some(ch.channel);
        }
    }

    /// Before each operator request: no deferral of an earlier one is left to take.
    pub(super) fn admin_late_reset(&mut self) {
        self.admin_late.deferred = None;
    }

    /// `admin` for an operator's own op, which another shard may answer later
    /// (`take_admin_deferral`).
    pub(super) fn admin_deferrable(
        &mut self,
        now: u64,
        vhost: &str,
        op: Op,
    ) -> Result<Option<Reply>, ProtocolError> {
        self.admin_late.top_level = true;
        let answer = self.admin(now, vhost, op);
        self.admin_late.top_level = false;
        answer
    }

    /// Whether the last `admin` op (its `Ok(None)`) waits for an answer from another
    /// shard, and if so its token: a host owes that op's requester the answer that
    /// `take_admin_answers` gives later under this token.
    pub fn take_admin_deferral(&mut self) -> Option<u16> {
        self.admin_late.deferred.take()
    }

    /// Answers of earlier deferred `admin` ops, with their tokens.
    pub fn take_admin_answers(
        &mut self,
        out: &mut Vec<(u16, Result<Option<Reply>, ProtocolError>)>,
    ) {
        out.append(&mut self.admin_late.answers);
    }

    /// The admin connection is released (an op for another vhost comes): answers for its
    /// ops in flight would find it gone, so they are answered now.
    pub(super) fn admin_released(&mut self) {
        for (channel, kind) in std::mem::take(&mut self.admin_late.pending) {
            let why = "sent to its queue, but the admin channel closed before the answer came";
            let error = ProtocolError::new(ErrorCode::ChannelError, kind, why);
            self.admin_late.keep(channel, Err(error));
        }
        self.admin_late.close_due.clear();
    }

    /// `poll_effects` while admin ops wait: their answers are taken out of the effects.
    pub(super) fn take_late_admin_effects(&mut self) {
        let late = &mut self.admin_late;
        self.effects.retain(|e| {
            let (channel, answer) = match e {
                Effect::Reply { ch, reply }
                    if ch.conn == RESTORE_CONN && *reply != Reply::ChannelOpenOk =>
                {
                    (ch.channel, Ok(Some(reply.clone())))
                }
                Effect::ChannelError { ch, error } if ch.conn == RESTORE_CONN => {
                    (ch.channel, Err(error.clone()))
                }
                _ => return true,
            };
            if !late.is_pending(channel) {
                return true;
            }
            late.answered(channel, answer);
            false
        });
    }
}
