//! Rates from samples of the core's counters: each object (queue, connection, channel,
//! vhost, the node) keeps its last two samples at least `MIN_INTERVAL_MS` apart, and a rate
//! is the difference of its counters over their interval. Sampled when asked (an API
//! request, a scrape), so nothing runs while nobody watches.

use std::collections::HashMap;
use warren_core::stats::MessageStats;

/// Samples closer than this do not replace the older one (a burst of requests would
/// otherwise measure over microseconds).
const MIN_INTERVAL_MS: u64 = 1000;
/// Objects tracked at most; past it the table starts afresh (rates read 0 once).
const MAX_TRACKED: usize = 200_000;

#[derive(Clone, Copy, Default)]
struct Sample {
    at_ms: u64,
    stats: MessageStats,
    /// Queue depth (ready, unacked) for the queue-length rates.
    depth: (u64, u64),
}

#[derive(Default)]
pub(crate) struct Rates {
    samples: HashMap<String, (Sample, Option<Sample>)>,
}

/// Per-second rates of one object's counters.
#[derive(Clone, Copy, Default, Debug, PartialEq)]
pub(crate) struct Rate {
    pub publish: f64,
    pub deliver_get: f64,
    pub redeliver: f64,
    pub ack: f64,
    pub ready: f64,
    pub unacked: f64,
}

fn per_sec(new: u64, old: u64, ms: u64) -> f64 {
    if ms == 0 {
        return 0.0;
    }
    // A counter that went back (an object recreated under the same key) reads 0.
    new.saturating_sub(old) as f64 * 1000.0 / ms as f64
}

fn change_per_sec(new: u64, old: u64, ms: u64) -> f64 {
    if ms == 0 {
        return 0.0;
    }
    (new as f64 - old as f64) * 1000.0 / ms as f64
}

impl Rates {
    /// Records a sample of `key` taken at `now_ms` and returns its rates.
    pub(crate) fn observe(
        &mut self,
        key: String,
        now_ms: u64,
        stats: MessageStats,
        depth: (u64, u64),
    ) -> Rate {
        if self.samples.len() >= MAX_TRACKED && !self.samples.contains_key(&key) {
            self.samples.clear();
        }
        let sample = Sample {
            at_ms: now_ms,
            stats,
            depth,
        };
        let entry = self.samples.entry(key).or_insert((sample, None));
        if now_ms.saturating_sub(entry.0.at_ms) >= MIN_INTERVAL_MS {
            entry.1 = Some(entry.0);
            entry.0 = sample;
        }
        let Some(old) = entry.1 else {
            return Rate::default();
        };
        let new = entry.0;
        let ms = new.at_ms.saturating_sub(old.at_ms);
        Rate {
            publish: per_sec(new.stats.publish, old.stats.publish, ms),
            deliver_get: per_sec(new.stats.deliver_get, old.stats.deliver_get, ms),
            redeliver: per_sec(new.stats.redeliver, old.stats.redeliver, ms),
            ack: per_sec(new.stats.ack, old.stats.ack, ms),
            ready: change_per_sec(new.depth.0, old.depth.0, ms),
            unacked: change_per_sec(new.depth.1, old.depth.1, ms),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats(publish: u64) -> MessageStats {
        MessageStats {
            publish,
            ..MessageStats::default()
        }
    }

    #[test]
    fn a_rate_is_the_difference_over_the_interval_of_samples_a_second_apart() {
        let mut r = Rates::default();
        assert_eq!(r.observe("q".into(), 0, stats(0), (0, 0)).publish, 0.0);
        // Too soon: the first sample stays the reference.
        assert_eq!(r.observe("q".into(), 10, stats(5), (0, 0)).publish, 0.0);
        let rate = r.observe("q".into(), 2000, stats(100), (10, 0));
        assert_eq!(rate.publish, 50.0);
        assert_eq!(rate.ready, 5.0);
        // Within a second of the last sample: the same interval answers.
        assert_eq!(
            r.observe("q".into(), 2500, stats(400), (10, 0)).publish,
            50.0
        );
        assert_eq!(
            r.observe("q".into(), 4000, stats(300), (0, 0)).publish,
            100.0
        );
    }
}
