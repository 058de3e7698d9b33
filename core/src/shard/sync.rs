//! Sync epochs: durable writes ride on the next sync (group commit), and the confirms,
//! commits and cross-shard answers that wait for an epoch go out once its sync completes
//! (as nacks if it failed).

use super::*;
use crate::effect::Effect;
use crate::ids::ChannelRef;

impl Broker {
    /// Starts a sync of the durable writes made so far, if there are any and no sync is
    /// running. Hosts call it after applying a batch of ops (group commit: everything
    /// written meanwhile rides on the next sync). Returns the epoch handed to the store.
    pub fn start_sync(&mut self) -> Option<u64> {
        let store = self.store.as_mut()?;
        if self.sync_in_flight || !self.sync_dirty {
            store.flush();
            return None;
        }
        let epoch = self.epoch;
        self.epoch += 1;
        self.sync_in_flight = true;
        self.sync_dirty = false;
        // Every removal made so far rides on this sync.
        self.removed_since = None;
        store.sync(epoch);
        Some(epoch)
    }

    /// Asks for a sync of everything written so far, removals included, at the next
    /// `start_sync` (or right after the one in flight). Hosts call it at a clean stop,
    /// then wait until `all_synced`, so nothing acked comes back after a
    /// restart; and once after a restore, which ends the store's recovery.
    pub fn request_sync(&mut self) {
        if self.store.is_some() {
            self.sync_dirty = true;
        }
    }

    /// A stored message left a queue (acked, dropped, purged, its queue deleted): a sync
    /// must cover it within `removal_sync_ms` (`tick`, `next_deadline`).
    pub(super) fn note_removal(&mut self) {
        if self.store.is_some() && self.removed_since.is_none() {
            self.removed_since = Some(self.now);
        }
    }

    /// The store reports that the sync of `epoch` completed: everything written before it
    /// started is durable, and the confirms waiting for it go out.
    pub fn synced(&mut self, now: u64, epoch: u64) {
        self.now = self.now.max(now);
        debug_assert!(epoch < self.epoch, "synced an epoch never started");
        self.sync_in_flight = false;
        self.release_confirms(epoch, true);
        // Stream consumers see synced messages only: the sync made more visible.
        self.dispatch_streams();
        self.after_op();
    }

    /// A store layer reports that writes the sync of `epoch` covered were not replicated
    /// (a quorum queue's leadership moved before they committed): the confirms waiting for
    /// it become nacks, as after a failed sync, but publishers are not blocked: the store
    /// is fine, and a publish to that queue is refused (nacked) until its new leader serves
    /// it, while every other queue goes on.
    pub fn sync_not_replicated(&mut self, now: u64, epoch: u64) {
        self.now = self.now.max(now);
        self.sync_in_flight = false;
        self.release_confirms(epoch, false);
        self.after_op();
    }

    /// The store reports that the sync of `epoch` failed: nothing it covered can be called
    /// durable, so the confirms waiting for it become nacks, and publishers are blocked for a
    /// while (as after a failed write).
    pub fn sync_failed(&mut self, now: u64, epoch: u64) {
        self.now = self.now.max(now);
        self.sync_in_flight = false;
        self.store_failed_at = Some(self.now);
        self.release_confirms(epoch, false);
        self.after_op();
    }

    /// The sync of `epoch` completed (`durable`) or failed: the confirms waiting for it go
    /// out, as decided at publish if it completed, as nacks if it failed.
    pub(super) fn release_confirms(&mut self, epoch: u64, durable: bool) {
        if durable {
            self.synced_epoch = Some(self.synced_epoch.map_or(epoch, |s| s.max(epoch)));
        }
        let mut channels = std::collections::BTreeSet::new();
        while self.confirm_waiters.front().is_some_and(|w| w.0 <= epoch) {
            if let Some((_, ch)) = self.confirm_waiters.pop_front() {
                channels.insert(ch);
            }
        }
        for ch in channels {
            if !durable && let Some(channel) = self.chans.channels.get_mut(&ch) {
                channel.sync_failed(epoch);
            }
            self.send_confirms(ch);
        }
        while self.remote_answers.front().is_some_and(|w| w.0 <= epoch) {
            let answer = match self.remote_answers.pop_front() {
                Some((_, mail::Mail::Answered { to, seq, taken, .. })) => mail::Mail::Answered {
                    to,
                    seq,
                    // A failed sync makes the message not durable: nacked.
                    taken: taken && durable,
                    durable: false,
                },
                Some((_, mail::Mail::TxFlushed { to, .. })) => {
                    mail::Mail::TxFlushed { to, durable }
                }
                _ => continue,
            };
            self.mail.push_back(answer);
        }
        self.dead_letters_synced(epoch, durable);
        while self.tx_sync_waiters.front().is_some_and(|w| w.0 <= epoch) {
            if let Some((_, to)) = self.tx_sync_waiters.pop_front() {
                self.tx_synced(to, durable);
            }
        }
    }

    /// Sends the confirms of channel `ch` that may go out now, in publish order.
    pub(super) fn send_confirms(&mut self, ch: ChannelRef) {
        let Some(channel) = self.chans.channels.get_mut(&ch) else {
            return;
        };
        let mut ready = Vec::new();
        channel.take_confirms(self.synced_epoch, &mut ready);
        for (seq, ack) in ready {
            self.effects.push(Effect::Confirm {
                ch,
                seq,
                multiple: false,
                ack,
            });
        }
    }

    /// The epoch whose completed sync makes every write so far durable, if some write is not
    /// durable yet (`None` without a store). Hosts hold answers to operators (a user added, a
    /// policy set) until then, so "done" means it survives a crash.
    pub fn unsynced_epoch(&self) -> Option<u64> {
        self.store.as_ref()?;
        if self.sync_dirty {
            Some(self.epoch)
        } else if self.sync_in_flight {
            Some(self.epoch - 1)
        } else {
            None
        }
    }

    /// Whether everything written so far, removals included, is covered by a completed
    /// sync (always without a store): a clean stop waits for it after `request_sync`.
    pub fn all_synced(&self) -> bool {
        self.store.is_none()
            || (!self.sync_dirty && !self.sync_in_flight && self.removed_since.is_none())
    }

    /// Confirms waiting for a sync (hosts and tests).
    pub fn pending_confirms(&self) -> usize {
        self.chans
            .channels
            .values()
            .map(|c| c.unconfirmed().count())
            .sum()
    }
}
