//! The message path: publish and route, dispatch to consumers under prefetch and write-window
//! credit, basic.get, ack/nack/reject/recover, publisher confirms and transactions.
//!
//! Nothing here waits on a round trip (seed 002): a publish is routed, enqueued, dispatched
//! and confirmed within one `handle` call; prefetch is a counter check per delivery.

use super::mail::{Mail, Publisher};
use super::{Broker, OpResult};
use crate::access::{Perm, Resource};
use crate::channel::TxOp;
use crate::command::{OpKind, Publish};
use crate::effect::{Effect, Reply};
use crate::error::{ErrorCode, ProtocolError};
use crate::ids::{ChannelAddr, ChannelRef, ExchangeId, QueueId};
use crate::message::Message;
use std::collections::BTreeSet;
use std::sync::Arc;

/// The channel of the broker's own status messages (`AdminRequest::StatusPublish`).
const STATUS: ChannelRef = ChannelRef::new(super::RESTORE_CONN, super::admin::STATUS_CHANNEL);

impl Broker {
    pub(super) fn publish(&mut self, ch: ChannelRef, mut p: Box<Publish>) -> OpResult {
        if let Some(rt) = p.properties.reply_to.as_deref()
            && let Some(address) = self.rewrite_reply_to(ch, rt)?
        {
            p.properties.reply_to = Some(address);
        }
        let op = OpKind::Publish;
        if p.immediate {
            return Err(ProtocolError::new(
                ErrorCode::NotImplemented,
                op,
                "immediate=true",
            ));
        }
        let exchange = self.exchange_id(ch, op, &p.exchange)?;
        self.check_access(ch, op, Perm::Write, Resource::Exchange, &p.exchange)?;
        self.check_topic_access(ch, op, Perm::Write, &p.exchange, &p.routing_key)?;
        if let Some(e) = p.properties.expiration.as_deref()
            && let Err(text) = crate::queue_args::parse_expiration(e)
        {
            return Err(ProtocolError::new(ErrorCode::PreconditionFailed, op, text));
        }
        self.check_delay(exchange, &p)?;
        // Through the routing table, which every shard has (topology is shard 0's).
        if let Some((vhost, true)) = self.topo.routes().exchange_facts(exchange) {
            return Err(ProtocolError::new(
                ErrorCode::AccessRefused,
                op,
                format!(
                    "cannot publish to internal exchange '{}' in vhost '{}'",
                    p.exchange,
                    self.vhost_name(vhost)
                ),
            ));
        }
        let Some(channel) = self.chans.channels.get_mut(&ch) else {
            return Ok(());
        };
        if channel.tx.is_some() {
            // Routed at commit, against the table of that moment.
            p.routed = None;
        }
        if let Some(TxOp::Publish(p)) = channel.buffer(op, TxOp::Publish(p))? {
            self.route_and_enqueue(ch, exchange, p);
        }
        Ok(())
    }

    /// Routes a publish and sends it to the queues it reaches; returns them.
    pub(super) fn route_and_enqueue(
        &mut self,
        ch: ChannelRef,
        exchange: ExchangeId,
        mut p: Box<Publish>,
    ) -> Vec<QueueId> {
        // Checked by `publish` (`check_delay`); a transaction's publish is scheduled at
        // its commit, from then on.
        if super::delayed::DELAYED
            && let Ok(Some(due)) = self.due_of(exchange, &p.properties)
        {
            self.schedule_publish(ch, exchange, p, due);
            return Vec::new();
        }
        let (queues, routed_any) = match p.routed.take() {
            Some(routed) if self.usable(ch, exchange, &routed) => {
                let routed_any = !routed.queues.is_empty();
                (self.still_routable(exchange, routed.queues), routed_any)
            }
            _ => {
                let queues = self.route(exchange, &p);
                let routed_any = !queues.is_empty();
                (queues, routed_any)
            }
        };
        let answers = u32::try_from(queues.len()).unwrap_or(u32::MAX);
        let (seq, serial) = match self.chans.channels.get_mut(&ch) {
            Some(c) => {
                // The broker's own status messages are not traffic: counted nowhere, so the
                // stats (and the `$SYS` topics made from them) show what clients publish.
                if ch != STATUS {
                    c.stats.publish += 1;
                }
                let seq = c.next_publish_seq();
                if let Some(seq) = seq {
                    c.expect_answers(seq, answers);
                }
                (seq, c.serial)
            }
            None => (None, 0),
        };
        let mandatory = p.mandatory;
        let p = *p;
        let message = Arc::new(Message {
            exchange: p.exchange,
            routing_key: p.routing_key,
            properties: p.properties,
            body: p.body,
        });
        if !routed_any {
            let is_reply = message.exchange.is_empty()
                && self.deliver_reply(&message.routing_key.clone(), &message);
            if mandatory && !is_reply {
                self.effects.push(Effect::Return {
                    ch,
                    reply_code: ErrorCode::NoRoute.code(),
                    reply_text: "NO_ROUTE",
                    message: message.clone(),
                });
            }
        } else {
            let consumes = self
                .chans
                .conns
                .get(&ch.conn)
                .is_none_or(|c| c.consumers > 0);
            let to = ChannelAddr { ch, serial };
            for &queue in &queues {
                self.mail.push_back(Mail::Enqueue {
                    queue,
                    message: message.clone(),
                    publisher: Some(Publisher { to, seq, consumes }),
                });
            }
        }
        if seq.is_some() && queues.is_empty() {
            // Reached no queue (unrouted, or its queues were deleted since the host routed
            // it): confirmed at once, after any return. The queues' answers confirm the rest.
            self.send_confirms(ch);
        }
        queues
    }

    /// A queue's answer to publish `seq` of channel `ch` (see `ChannelState::answered`); a
    /// durable one waits for the sync of the current epoch.
    pub(super) fn answer(&mut self, ch: ChannelRef, seq: u64, taken: bool, durable: bool) {
        let epoch = durable.then_some(self.epoch);
        let Some(channel) = self.chans.channels.get_mut(&ch) else {
            return;
        };
        channel.answered(seq, taken, epoch);
        if let Some(e) = epoch
            && self.confirm_waiters.back() != Some(&(e, ch))
        {
            self.confirm_waiters.push_back((e, ch));
        }
    }

    /// Whether a publish routed by the host (`Publish::routed`) may be used as routed: through
    /// the same exchange (not one deleted and declared again), on a table that saw every
    /// routing change of the publishing connection (a client sees its own binds), and every
    /// change this shard applied before the publish reached it: a bind applied since the
    /// host routed it (another connection's SUBSCRIBE, sent before this publish) must see
    /// it, as it would on a broker that routes in arrival order (Mosquitto; issue 43, item
    /// 15). The host's table is only published after the turn that changed it, so without
    /// this such a publish missed the new subscription in half the rounds. Re-routing
    /// costs one lookup, and only while the table changes.
    pub(super) fn usable(
        &self,
        ch: ChannelRef,
        exchange: ExchangeId,
        routed: &crate::routing::Routed,
    ) -> bool {
        routed.exchange == exchange
            && routed.version >= self.topo.routes().version()
            && self
                .chans
                .conns
                .get(&ch.conn)
                .is_some_and(|c| routed.version >= c.routes_seen)
    }

    /// The queues of a host-routed publish that still exist, each once, in id order. A queue
    /// deleted since the snapshot is dropped: the publish happened before the deletion, which
    /// took the message with it (so a mandatory publish is not returned either; counted in
    /// `routed_to_deleted`).
    pub(super) fn still_routable(
        &mut self,
        exchange: ExchangeId,
        mut queues: Vec<QueueId>,
    ) -> Vec<QueueId> {
        queues.sort_unstable();
        queues.dedup();
        if self.shard != 0 {
            // No queue directory here: the owner finds the queue gone and counts it.
            return queues;
        }
        let vhost = self.topo.exchange(exchange).map(|x| x.vhost);
        let routed = queues.len();
        queues.retain(|q| self.topo.queue(*q).map(|q| q.vhost) == vhost);
        self.routed_to_deleted += (routed - queues.len()) as u64;
        queues
    }

    /// Every queue a message published to `exchange` reaches, each once, in id order
    /// (through the routing table, as hosts that route outside the broker do).
    pub(super) fn route(&self, exchange: ExchangeId, p: &Publish) -> Vec<QueueId> {
        self.topo
            .routes()
            .route(exchange, &p.routing_key, p.properties.headers.as_ref())
    }

    pub(super) fn confirm_select(&mut self, ch: ChannelRef, nowait: bool) -> OpResult {
        let Some(channel) = self.chans.channels.get_mut(&ch) else {
            return Ok(());
        };
        channel.select_confirms()?;
        if !nowait {
            self.reply(ch, Reply::ConfirmSelectOk);
        }
        Ok(())
    }

    pub(super) fn tx_select(&mut self, ch: ChannelRef) -> OpResult {
        let Some(channel) = self.chans.channels.get_mut(&ch) else {
            return Ok(());
        };
        channel.select_tx()?;
        self.reply(ch, Reply::TxSelectOk);
        Ok(())
    }

    /// tx.commit: the buffered publishes and settles go to their queues, in order; then
    /// each queue the transaction touched is asked to confirm it has them (`TxFlush`, after
    /// them on the same link), and commit-ok waits for every answer (`TxFlushed`) and, if
    /// the transaction published a persistent message, for the sync that makes it durable.
    pub(super) fn tx_commit(&mut self, ch: ChannelRef) -> OpResult {
        let ops = self.take_tx(ch, OpKind::TxCommit)?;
        let mut touched = BTreeSet::new();
        let mut persistent = false;
        for op in ops {
            match op {
                TxOp::Publish(p) => {
                    persistent |= p.properties.is_persistent();
                    // The exchange may have gone since the publish was buffered.
                    let exchange = self.exchange_id(ch, OpKind::Publish, &p.exchange)?;
                    touched.extend(self.route_and_enqueue(ch, exchange, p));
                }
                TxOp::Settle {
                    kind,
                    delivery_tag,
                    multiple,
                    settle,
                } => {
                    let Some(channel) = self.chans.channels.get_mut(&ch) else {
                        return Ok(());
                    };
                    let settled = channel.take_settled(kind, delivery_tag, multiple)?;
                    channel.count_settled(settle, settled.len());
                    touched.extend(settled.iter().map(|u| u.queue));
                    self.settle_entries(ch, settled, settle);
                }
            }
        }
        if touched.is_empty() {
            self.reply(ch, Reply::TxCommitOk);
            return Ok(());
        }
        let to = self.chans.addr(ch);
        let answers = u32::try_from(touched.len()).unwrap_or(u32::MAX);
        for queue in touched {
            self.mail.push_back(Mail::TxFlush { queue, to });
        }
        if let Some(tx) = self.chans.channels.get_mut(&ch).and_then(|c| c.tx.as_mut()) {
            tx.commit = Some((answers, persistent));
        }
        self.await_answer(ch);
        Ok(())
    }

    /// A queue the commit of channel `to` touched has what the commit sent it. Once every
    /// such queue answered: commit-ok, or, if the commit published a persistent message and
    /// writes are waiting for a sync, a wait for that sync (`tx_synced`). The wait is
    /// conservative (the writes may be another client's): at most one sync more.
    pub(super) fn tx_flushed(&mut self, to: ChannelAddr) {
        if !self.chans.is_live(to) {
            return;
        }
        let Some(tx) = self
            .chans
            .channels
            .get_mut(&to.ch)
            .and_then(|c| c.tx.as_mut())
        else {
            return;
        };
        let Some((left, persistent)) = tx.commit.as_mut() else {
            return;
        };
        *left = left.saturating_sub(1);
        if *left > 0 {
            return;
        }
        let persistent = *persistent;
        tx.commit = None;
        if persistent && let Some(epoch) = self.unsynced_epoch() {
            self.tx_sync_waiters.push_back((epoch, to));
            return;
        }
        self.tx_synced(to, true);
    }

    /// The commit of channel `to` is durable (`durable`), or its sync failed: commit-ok,
    /// or the connection closes (541), since the client cannot know what survived.
    pub(super) fn tx_synced(&mut self, to: ChannelAddr, durable: bool) {
        if !self.take_answer(to) {
            return;
        }
        if durable {
            self.reply(to.ch, Reply::TxCommitOk);
            self.run_held(to.ch);
        } else {
            let error = ProtocolError::new(
                ErrorCode::InternalError,
                OpKind::TxCommit,
                "the store failed to sync the transaction; its messages may be lost, \
                 check the broker's log and disk",
            );
            self.fail(ChannelRef::new(to.ch.conn, 0), error);
        }
    }

    pub(super) fn tx_rollback(&mut self, ch: ChannelRef) -> OpResult {
        self.take_tx(ch, OpKind::TxRollback)?;
        self.reply(ch, Reply::TxRollbackOk);
        Ok(())
    }

    /// Takes the buffered operations of a transaction, leaving the channel transactional.
    pub(super) fn take_tx(
        &mut self,
        ch: ChannelRef,
        kind: OpKind,
    ) -> Result<Vec<TxOp>, ProtocolError> {
        match self.chans.channels.get_mut(&ch) {
            Some(channel) => channel.take_tx(kind),
            None => Err(ProtocolError::new(
                ErrorCode::PreconditionFailed,
                kind,
                "channel is not transactional",
            )),
        }
    }
}

impl Broker {}
