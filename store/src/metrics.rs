//! Latency of the store's durable writes, for Prometheus (`warren_storage_*`): plain atomics
//! the sync thread adds to once per sync, read by the metrics endpoint at each scrape. No
//! lock and no allocation on the sync path.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Upper bounds of the buckets, in microseconds (100 µs .. 2.5 s: an fdatasync on an idle
/// SSD is ~0.1-1 ms, on a busy or networked disk tens of ms; past 2.5 s is `+Inf`).
pub const BOUNDS_US: [u64; 12] = [
    100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 500_000, 2_500_000,
];

/// A latency histogram in Prometheus' shape (cumulative when read).
pub struct Histogram {
    buckets: [AtomicU64; BOUNDS_US.len()],
    count: AtomicU64,
    sum_us: AtomicU64,
}

/// What a scrape reads: bucket upper bounds (seconds) with cumulative counts, the count and
/// the sum (seconds).
#[derive(Clone, Debug, PartialEq)]
pub struct HistogramSnapshot {
    pub buckets: Vec<(f64, u64)>,
    pub count: u64,
    pub sum_seconds: f64,
}

impl Histogram {
    const fn new() -> Histogram {
        Histogram {
            buckets: [const { AtomicU64::new(0) }; BOUNDS_US.len()],
            count: AtomicU64::new(0),
            sum_us: AtomicU64::new(0),
        }
    }

    /// Records one observation.
    pub fn observe(&self, took: Duration) {
        let us = u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
        if let Some(i) = BOUNDS_US.iter().position(|&b| us <= b) {
            self.buckets[i].fetch_add(1, Ordering::Relaxed);
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_us.fetch_add(us, Ordering::Relaxed);
    }

    /// The histogram now, buckets cumulative as Prometheus wants them.
    pub fn snapshot(&self) -> HistogramSnapshot {
        let mut running = 0;
        let buckets = BOUNDS_US
            .iter()
            .zip(&self.buckets)
            .map(|(&b, n)| {
                running += n.load(Ordering::Relaxed);
                (b as f64 / 1e6, running)
            })
            .collect();
        HistogramSnapshot {
            buckets,
            count: self.count.load(Ordering::Relaxed),
            sum_seconds: self.sum_us.load(Ordering::Relaxed) as f64 / 1e6,
        }
    }
}

/// One group commit of the sync thread, from its start to everything it covers being
/// durable (journal, definitions, shared bodies, segment files, directories): what a
/// publisher waiting for a confirm waits for, beyond its batch.
pub static SYNC: Histogram = Histogram::new();

/// The journal's own fdatasync, inside [`SYNC`].
pub static JOURNAL_FSYNC: Histogram = Histogram::new();

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_cumulative_and_the_sum_adds_up() {
        let h = Histogram::new();
        h.observe(Duration::from_micros(80));
        h.observe(Duration::from_micros(900));
        h.observe(Duration::from_millis(3));
        h.observe(Duration::from_secs(5));
        let s = h.snapshot();
        assert_eq!(s.count, 4);
        assert_eq!(s.buckets[0], (0.0001, 1));
        assert_eq!(s.buckets[3], (0.001, 2));
        assert_eq!(s.buckets[5], (0.005, 3));
        // 5 s is past the last bound: only in the count (`+Inf`).
        assert_eq!(s.buckets.last().map(|b| b.1), Some(3));
        assert!((s.sum_seconds - 5.00398).abs() < 1e-9);
    }
}
