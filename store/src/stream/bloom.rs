//! Stream filtering (RabbitMQ 3.13): each user chunk whose publisher set filter values
//! carries a Bloom filter of them in its trailer (a tracking entry of kind 3, see
//! docs/storage.md), so a filtered reader skips chunks that hold none of its values without
//! reading their messages. A Bloom filter has false positives, never false negatives: a
//! filtered reader may get chunks without its values (clients filter messages themselves,
//! as with RabbitMQ), never miss one.

/// Filter bytes per chunk (RabbitMQ's default `stream-filter-size-bytes`).
pub const FILTER_BYTES: usize = 16;
/// Bit positions set per value.
const HASHES: u32 = 3;
/// The entry's value, bit 0: the chunk holds a message without a filter value.
pub const HAS_UNFILTERED: u64 = 1;

/// FNV-1a, 64 bits: the two halves give the double hashing's two hashes.
fn hash(value: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in value {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The bits value `v` sets in a filter of `bits` bits.
fn positions(v: &[u8], bits: u32) -> impl Iterator<Item = u32> {
    let h = hash(v);
    let (h1, h2) = (h as u32, ((h >> 32) as u32) | 1);
    (0..HASHES).map(move |i| h1.wrapping_add(i.wrapping_mul(h2)) % bits)
}

/// A chunk's filter from its messages' filter values (`None` or empty: a message without
/// one, as clients send it), and the entry value's flags; `None` when no message has a
/// value (nothing to store: the chunk is unfiltered).
pub fn build(values: &[Option<&str>]) -> Option<(Vec<u8>, u64)> {
    let mut b = Builder::default();
    for v in values {
        b.add(*v);
    }
    b.finish()
}

/// [`build`] one message at a time: a chunk the writer merges from several Publish frames
/// gets the filter of all its messages without keeping their values.
#[derive(Clone, Debug, Default)]
pub struct Builder {
    bits: [u8; FILTER_BYTES],
    any_value: bool,
    flags: u64,
}

impl Builder {
    pub fn add(&mut self, value: Option<&str>) {
        match value.filter(|v| !v.is_empty()) {
            Some(v) => {
                self.any_value = true;
                for p in positions(v.as_bytes(), (FILTER_BYTES * 8) as u32) {
                    self.bits[(p / 8) as usize] |= 1 << (p % 8);
                }
            }
            None => self.flags |= HAS_UNFILTERED,
        }
    }

    /// The filter and flags, as [`build`] returns them.
    pub fn finish(&self) -> Option<(Vec<u8>, u64)> {
        self.any_value.then(|| (self.bits.to_vec(), self.flags))
    }
}

/// What a filtered reader wants: chunks that may hold one of `values`, and, with
/// `match_unfiltered`, chunks holding messages without a value.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ChunkFilter {
    pub values: Vec<String>,
    pub match_unfiltered: bool,
}

impl ChunkFilter {
    /// Whether a chunk with this stored filter (`None`: the chunk has none, all its
    /// messages are unfiltered) may hold a wanted message.
    pub fn matches(&self, stored: Option<(&[u8], u64)>) -> bool {
        let Some((bits, flags)) = stored else {
            return self.match_unfiltered;
        };
        if self.match_unfiltered && flags & HAS_UNFILTERED != 0 {
            return true;
        }
        if bits.is_empty() {
            return false;
        }
        let n = (bits.len() * 8) as u32;
        self.values.iter().any(|v| {
            positions(v.as_bytes(), n).all(|p| bits[(p / 8) as usize] & (1 << (p % 8)) != 0)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_false_negatives_and_few_false_positives() {
        let f = |v: &[&str], u: bool| ChunkFilter {
            values: v.iter().map(|s| s.to_string()).collect(),
            match_unfiltered: u,
        };
        let (bits, flags) = build(&[Some("red"), Some("blue"), None]).unwrap();
        let stored = Some((&bits[..], flags));
        assert!(f(&["red"], false).matches(stored));
        assert!(f(&["blue", "nope"], false).matches(stored));
        assert!(
            f(&["zzz"], true).matches(stored),
            "unfiltered messages in it"
        );
        assert!(!f(&[], false).matches(None), "unfiltered chunk, unwanted");
        assert!(f(&[], true).matches(None));
        assert_eq!(build(&[None, Some("")]), None);
        // A chunk of one value: other values mostly miss (3 of 128 bits set).
        let (bits, flags) = build(&[Some("v0")]).unwrap();
        let hits = (1..1000)
            .filter(|i| f(&[&format!("v{i}")], false).matches(Some((&bits, flags))))
            .count();
        assert!(hits < 20, "{hits} false positives in 999");
    }
}
