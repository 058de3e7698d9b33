//! Invariant checks over one shard or all of them (simulation tests and debug builds):
//! the queue side, the channel side and topology agree once no mail travels.

use super::*;
use crate::ids::ChannelRef;
#[cfg(any(test, feature = "testing"))]
use crate::ids::QueueId;
#[cfg(any(test, feature = "testing"))]
use crate::queue::state::ConsumerId;
#[cfg(any(test, feature = "testing"))]
use std::collections::HashMap;

impl Broker {
    /// With no mail left, a channel waits only for a sync (its commit), and holds ops only
    /// while it waits: the first channel that breaks this, described.
    pub(super) fn stuck_channel(&self) -> Option<String> {
        self.stuck_channel_but(&|_| false)
    }

    /// `stuck_channel`, where `synced_elsewhere` says which channels wait for another
    /// shard's sync (an answer held in its `remote_answers`).
    pub(super) fn stuck_channel_but(
        &self,
        synced_elsewhere: &dyn Fn(&ChannelRef) -> bool,
    ) -> Option<String> {
        if !self.mail.is_empty() || (self.chans.awaiting == 0 && self.chans.holds.is_empty()) {
            return None;
        }
        // O(channels x waiters): for checks only.
        let syncing = |ch: &ChannelRef| {
            let serial = self.chans.channels.get(ch).map(|c| c.serial);
            synced_elsewhere(ch)
                || serial.is_some_and(|serial| {
                    self.nodes
                        .attached
                        .awaits(crate::ids::ChannelAddr { ch: *ch, serial })
                })
                || self
                    .tx_sync_waiters
                    .iter()
                    .any(|(_, to)| to.ch == *ch && Some(to.serial) == serial)
        };
        if let Some((ch, _)) = self
            .chans
            .channels
            .iter()
            .find(|(ch, c)| c.awaiting && !syncing(ch))
        {
            return Some(format!("{ch:?} waits for an answer with no mail left"));
        }
        self.chans
            .holds
            .keys()
            .find(|ch| !syncing(ch))
            .map(|ch| format!("{ch:?} holds ops with nothing to wait for"))
    }

    /// Verifies the cross-references the module docs promise (counters match the unacked
    /// entries, consumers are where queues and channels say they are). For simulation tests
    /// and debug builds; O(state).
    #[cfg(any(test, feature = "testing"))]
    pub fn check_invariants(&self) -> Result<(), String> {
        Broker::check_shards(&[self])
    }

    /// `check_invariants` over every shard of a sharded broker, in shard order: the queue
    /// side, the channel side and topology agree across shards once no mail travels.
    #[cfg(any(test, feature = "testing"))]
    pub fn check_shards(shards: &[&Broker]) -> Result<(), String> {
        let Some(first) = shards.first() else {
            return Ok(());
        };
        for (i, b) in shards.iter().enumerate() {
            if b.shard as usize != i || b.shards as usize != shards.len() {
                return Err(format!("shard {} of {} given as {i}", b.shard, b.shards));
            }
        }
        let topo = &first.topo;
        topo.check_invariants()?;
        // What follows compares the queue side with the channel side and with topology,
        // which agree only once the mail between them has arrived (with scheduled mail, not
        // after every op).
        if shards
            .iter()
            .any(|b| !b.mail.is_empty() || b.mail.outbox_len() > 0)
        {
            return Ok(());
        }
        // Consumers across nodes split a consumer between two brokers (`nodes_consume.rs`):
        // what follows sees one; tests/nodes.rs checks those by what the clients see.
        if shards.iter().any(|b| b.crosses_nodes()) {
            return Ok(());
        }
        let owner = |id: QueueId| &shards[(id.0 % shards.len() as u64) as usize];
        let queue = |id: QueueId| owner(id).qs.queues.get(&id).map(|q| &**q);
        let channel = |ch: &ChannelRef| {
            let b = &shards[first.conn_shard(ch.conn) as usize];
            b.chans.channels.get(ch).map(|c| &**c)
        };
        let queues = || shards.iter().flat_map(|b| b.qs.queues.iter());
        let channels = || shards.iter().flat_map(|b| b.chans.channels.iter());
        // Topology's copy of each queue's fixed facts matches the queue (a queue being
        // created or removed differs only while the mail about it travels).
        for (&id, q) in queues() {
            let entry = topo
                .queue(id)
                .ok_or_else(|| format!("queue {id:?} '{}' unknown to topology", q.name))?;
            let stored = q.durable && q.exclusive_owner.is_none();
            if (
                entry.vhost,
                &entry.name,
                entry.exclusive_owner,
                entry.stored,
            ) != (q.vhost, &q.name, q.exclusive_owner, stored)
            {
                return Err(format!("topology's entry of queue {id:?} differs from it"));
            }
        }
        let total: usize = shards.iter().map(|b| b.qs.queues.len()).sum();
        if topo.queue_count() != total {
            return Err(format!(
                "topology knows {} queues, the shards have {total}",
                topo.queue_count()
            ));
        }
        // Answers held until their queue's shard syncs (`remote_answers`), by channel.
        let mut held_answers: HashMap<(ChannelRef, u64), u32> = HashMap::new();
        let mut held_flushes: std::collections::BTreeSet<ChannelRef> = Default::default();
        for b in shards {
            for (_, m) in &b.remote_answers {
                match m {
                    mail::Mail::Answered { to, seq, .. } => {
                        *held_answers.entry((to.ch, *seq)).or_default() += 1;
                    }
                    mail::Mail::TxFlushed { to, .. } => {
                        held_flushes.insert(to.ch);
                    }
                    _ => return Err("a held answer that is not one".into()),
                }
            }
            // Answers another cluster node owes (`nodes.rs`): the host carries them.
            for (to, seq) in b.node_pending() {
                *held_answers.entry((to.ch, seq)).or_default() += 1;
            }
        }
        for b in shards {
            let awaiting = b.chans.channels.values().filter(|c| c.awaiting).count();
            if awaiting != b.chans.awaiting {
                return Err(format!(
                    "{awaiting} channels await an answer but the count says {}",
                    b.chans.awaiting
                ));
            }
            if let Some(stuck) = b.stuck_channel_but(&|ch| held_flushes.contains(ch)) {
                return Err(stuck);
            }
            if let Some(q) =
                b.qs.queues
                    .values()
                    .find(|q| b.queue_shard(q.id) != b.shard)
            {
                return Err(format!(
                    "queue {} on shard {}, not its own",
                    q.name, b.shard
                ));
            }
        }
        let held: u64 = queues()
            .map(|(_, q)| q.messages.bytes() + q.dead_held().1)
            .chain(
                channels()
                    .flat_map(|(_, c)| c.unacked.values())
                    .map(|u| u.message.body_len() as u64),
            )
            .sum();
        let stored_bytes: u64 = shards.iter().map(|b| b.stored_bytes).sum();
        if held != stored_bytes {
            return Err(format!(
                "stored_bytes {stored_bytes} but queues and unacked hold {held}"
            ));
        }
        let mut queue_unacked: HashMap<QueueId, u64> = HashMap::new();
        let mut consumer_unacked: HashMap<ConsumerId, u32> = HashMap::new();
        for (ch, channel) in channels() {
            let mut from_consumers = 0u32;
            for u in channel.unacked.values() {
                // A delivery made before its queue was reloaded counts on its channel only
                // (the queue took it back: `QueueState::reload`).
                let current = queue(u.queue).is_none_or(|q| q.epoch == u.epoch);
                if current {
                    *queue_unacked.entry(u.queue).or_default() += 1;
                }
                if let Some(cid) = u.consumer {
                    from_consumers += 1;
                    if current {
                        *consumer_unacked.entry(cid).or_default() += 1;
                    }
                }
            }
            if channel.phase == Phase::Open && from_consumers != channel.consumer_unacked.get() {
                return Err(format!(
                    "{ch:?}: consumer_unacked {} but {} entries",
                    channel.consumer_unacked.get(),
                    from_consumers
                ));
            }
            for (tag, cid, q) in channel.consumers.iter() {
                let c = queue(q)
                    .and_then(|q| q.consumer(cid))
                    .ok_or_else(|| format!("{ch:?}: consumer {tag} missing from its queue"))?;
                if c.ch != *ch || c.tag != *tag {
                    return Err(format!("{ch:?}: consumer {tag} points elsewhere"));
                }
            }
        }
        for b in shards {
            for (ch, channel) in &b.chans.channels {
                let mut last = 0;
                for (seq, waiting, epoch) in channel.unconfirmed() {
                    if seq <= last {
                        return Err(format!("{ch:?}: confirms out of publish order"));
                    }
                    last = seq;
                    // Every queue answers (by mail) once the mail has arrived, or holds
                    // its answer until its shard's sync.
                    if waiting > held_answers.get(&(*ch, seq)).copied().unwrap_or(0) {
                        return Err(format!("{ch:?}: publish {seq} waits for {waiting} queues"));
                    }
                    // (A publish whose sync is done may still wait, in order, behind
                    // an earlier one that a queue on another shard has not answered.)
                    if let Some(e) = epoch
                        && b.synced_epoch.is_none_or(|s| e > s)
                        && !b.confirm_waiters.contains(&(e, *ch))
                    {
                        return Err(format!(
                            "{ch:?}: publish {seq} waits for epoch {e} unlisted"
                        ));
                    }
                }
            }
            if b.confirm_waiters
                .iter()
                .zip(b.confirm_waiters.iter().skip(1))
                .any(|(a, b)| a.0 > b.0)
            {
                return Err("confirm waiters out of epoch order".into());
            }
            for q in b.qs.queues.values() {
                let paged = q.messages.paged();
                if b.store.is_none() && paged.count > 0 {
                    return Err(format!("queue {}: paged out without a store", q.name));
                }
                for deque in q.messages.deques() {
                    let mut last = None;
                    for m in deque {
                        if last.is_some_and(|l| l >= m.seq) {
                            return Err(format!("queue {}: window out of order", q.name));
                        }
                        // A priority queue reads everything back before popping: its levels
                        // may hold messages above a partly read suffix meanwhile.
                        if paged.count > 0 && m.seq >= paged.from_seq && !q.messages.is_priority() {
                            return Err(format!(
                                "queue {}: window overlaps the paged suffix",
                                q.name
                            ));
                        }
                        last = Some(m.seq);
                    }
                }
            }
        }
        for (id, q) in queues() {
            let expected = queue_unacked.get(id).copied().unwrap_or(0);
            if q.unacked != expected {
                return Err(format!(
                    "queue {}: unacked {} but {} entries",
                    q.name, q.unacked, expected
                ));
            }
            if q.consumers
                .iter()
                .zip(q.consumers.iter().skip(1))
                .any(|(a, b)| a.id >= b.id)
            {
                return Err(format!("queue {}: consumers out of id order", q.name));
            }
            for c in &q.consumers {
                let expected = consumer_unacked.get(&c.id).copied().unwrap_or(0);
                if c.unacked != expected {
                    return Err(format!(
                        "consumer {}: unacked {} but {} entries",
                        c.tag, c.unacked, expected
                    ));
                }
                let listed = channel(&c.ch).and_then(|channel| channel.consumers.get(&c.tag));
                if listed != Some((c.id, *id)) {
                    return Err(format!("consumer {} not on its channel", c.tag));
                }
            }
        }
        for (id, conn) in shards.iter().flat_map(|b| b.chans.conns.iter()) {
            let consumers = queues()
                .flat_map(|(_, q)| &q.consumers)
                .filter(|c| c.ch.conn == *id)
                .count();
            if conn.consumers as usize != consumers {
                return Err(format!(
                    "{id:?}: consumers {} but {consumers} exist",
                    conn.consumers
                ));
            }
            let pausing: crate::sorted_vec::SortedSet<QueueId> = queues()
                .filter(|(_, q)| q.pausing.contains(id))
                .map(|(qid, _)| *qid)
                .collect();
            if conn.paused_in != pausing {
                return Err(format!(
                    "{id:?}: paused in {:?} but {pausing:?} pause it",
                    conn.paused_in
                ));
            }
        }
        Ok(())
    }
}
