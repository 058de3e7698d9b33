//! Publisher confirms on their way out: which sequence numbers a channel has confirmed, and
//! runs of acks gathered during one write so they leave as one `multiple` ack when that is
//! exact.

use crate::codec;
use bytes::BytesMut;

/// The publisher confirms sent on one channel: every sequence number up to `through` has been
/// confirmed (acked or nacked), `above` holds those confirmed out of order beyond it. A run of
/// acks may collapse into one `multiple` ack only when it starts right after `through`: a
/// `multiple` ack would otherwise also confirm a message still in flight.
#[derive(Default)]
pub(crate) struct Confirmed {
    through: u64,
    /// Empty while the core confirms in order (today it always does).
    above: std::collections::BTreeSet<u64>,
}

impl Confirmed {
    /// Whether every sequence number before `seq` has been confirmed.
    pub(crate) fn follows(&self, seq: u64) -> bool {
        seq == self.through.saturating_add(1)
    }

    /// Records `first..=last` as confirmed (`first` = 1 for a core-sent `multiple` confirm).
    pub(crate) fn mark(&mut self, first: u64, last: u64) {
        if first <= self.through.saturating_add(1) {
            self.through = self.through.max(last);
            self.above = self.above.split_off(&self.through.saturating_add(1));
        } else {
            self.above.extend(first..=last);
        }
        while self.above.first() == Some(&self.through.saturating_add(1)) {
            self.above.pop_first();
            self.through += 1;
        }
    }

    /// Encodes acks for seqs `first..=last`: one `multiple` ack when the run directly follows
    /// the last one sent, individual acks otherwise.
    pub(crate) fn emit_acks(&mut self, out: &mut BytesMut, ch: u16, first: u64, last: u64) {
        if self.follows(first) {
            codec::encode_confirm(out, ch, last, last > first, true);
        } else {
            for seq in first..=last {
                codec::encode_confirm(out, ch, seq, false, true);
            }
        }
        self.mark(first, last);
    }
}

/// Runs of consecutive single acks per channel (channel, first, last), held until the write
/// they belong to is complete or another frame on their channel must go out first.
#[derive(Default)]
pub(crate) struct PendingAcks(Vec<(u16, u64, u64)>);

impl PendingAcks {
    /// Adds `seq`; returns a run that it could not extend (to be emitted now).
    pub(crate) fn add(&mut self, ch: u16, seq: u64) -> Option<(u16, u64, u64)> {
        if let Some(p) = self.0.iter_mut().find(|p| p.0 == ch)
            && seq == p.2 + 1
        {
            p.2 = seq;
            return None;
        }
        let done = self.take(ch);
        self.0.push((ch, seq, seq));
        done
    }

    /// The run of channel `ch`, if any, taken out.
    pub(crate) fn take(&mut self, ch: u16) -> Option<(u16, u64, u64)> {
        let i = self.0.iter().position(|p| p.0 == ch)?;
        Some(self.0.swap_remove(i))
    }

    /// Every run, taken out.
    pub(crate) fn drain(&mut self) -> std::vec::Drain<'_, (u16, u64, u64)> {
        self.0.drain(..)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn acks_collapse_only_when_nothing_before_them_is_outstanding() {
        let mut c = Confirmed::default();
        assert!(c.follows(1));
        c.mark(1, 3);
        assert!(c.follows(4));
        // 5 confirmed before 4: a multiple ack at 6 or later would confirm 4 too.
        c.mark(5, 5);
        assert!(!c.follows(6));
        assert_eq!(c.through, 3);
        c.mark(4, 4);
        assert_eq!(c.through, 5);
        assert!(c.follows(6));
        assert!(c.above.is_empty());
        // A core-sent multiple confirm covers everything up to its seq.
        c.mark(9, 9);
        c.mark(1, 7);
        assert_eq!(c.through, 7);
        c.mark(8, 8);
        assert_eq!(c.through, 9);
        assert!(c.above.is_empty());
    }

    #[test]
    fn pending_runs_extend_only_with_the_next_seq() {
        let mut p = PendingAcks::default();
        assert_eq!(p.add(1, 5), None);
        assert_eq!(p.add(1, 6), None);
        assert_eq!(p.add(2, 1), None);
        assert_eq!(p.add(1, 9), Some((1, 5, 6)));
        assert_eq!(p.take(1), Some((1, 9, 9)));
        assert_eq!(p.drain().collect::<Vec<_>>(), [(2, 1, 1)]);
    }
}
