//! Reconnect waits: `reconnect-delay` first, doubling to a cap, each with ±25% jitter so a
//! fleet of shovels that lost the same broker does not come back in step.

use std::time::Duration;

/// The longest wait between attempts.
pub const MAX: Duration = Duration::from_secs(60);
/// The shortest (a `reconnect-delay` of 0 must not spin).
pub const MIN: Duration = Duration::from_millis(100);

/// Successive waits after failures.
pub struct Backoff {
    base: Duration,
    failures: u32,
}

impl Backoff {
    /// Waits starting at `base`.
    pub fn new(base: Duration) -> Backoff {
        Backoff { base, failures: 0 }
    }

    /// The link ran well: the next failure waits `base` again.
    pub fn reset(&mut self) {
        self.failures = 0;
    }

    /// The wait after one more failure; `unit` in [0, 1) is the jitter's draw.
    pub fn next(&mut self, unit: f64) -> Duration {
        let exp = self.base.saturating_mul(1 << self.failures.min(16));
        self.failures = self.failures.saturating_add(1);
        let capped = exp.clamp(MIN, MAX.max(self.base));
        capped.mul_f64(0.75 + unit.clamp(0.0, 1.0) * 0.5)
    }
}

/// A draw in [0, 1) from the standard library's random hasher keys (no RNG crate).
pub fn draw() -> f64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(0);
    (h.finish() >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_to_the_cap_with_jitter() {
        let mut b = Backoff::new(Duration::from_secs(1));
        assert_eq!(b.next(0.5), Duration::from_secs(1));
        assert_eq!(b.next(0.5), Duration::from_secs(2));
        assert_eq!(b.next(0.0), Duration::from_secs(3));
        for _ in 0..20 {
            assert!(b.next(0.99) <= MAX.mul_f64(1.25));
        }
        b.reset();
        assert_eq!(b.next(0.5), Duration::from_secs(1));
        assert!(draw() < 1.0);
    }
}
