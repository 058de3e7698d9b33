//! Server-generated names, drawn from a seeded generator so runs are reproducible.

/// SplitMix64: tiny, fast, and good enough for unique-looking names (not for security).
#[derive(Clone, Debug)]
pub struct NameGen {
    state: u64,
}

const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";

impl NameGen {
    /// A generator seeded with `seed` (shard 0's sequence).
    pub fn new(seed: u64) -> NameGen {
        NameGen { state: seed }
    }

    /// The generator of shard `shard` of a broker seeded with `seed`: every shard names
    /// queues and consumers on its own, so each needs its own sequence (one seed for all
    /// would hand two shards' clients the same `amq.gen-` name).
    pub fn for_shard(seed: u64, shard: u32) -> NameGen {
        if shard == 0 {
            return NameGen::new(seed);
        }
        // Mix the shard in through one SplitMix step, so neighbouring shards do not walk
        // overlapping stretches of one sequence.
        let mut mixer = NameGen::new(seed ^ u64::from(shard).rotate_left(32));
        NameGen::new(mixer.next_u64())
    }

    fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// `prefix` followed by 22 URL-safe base64 characters (128 bits), as RabbitMQ's names look.
    pub fn name(&mut self, prefix: &str) -> String {
        let mut out = String::with_capacity(prefix.len() + 22);
        out.push_str(prefix);
        let (a, b) = (self.next_u64(), self.next_u64());
        for i in 0..22 {
            let bits = if i < 11 {
                a >> (i * 6)
            } else {
                b >> ((i - 11) * 6)
            };
            out.push(char::from(ALPHABET[(bits & 63) as usize]));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_reproducible_and_distinct() {
        let mut a = NameGen::new(7);
        let mut b = NameGen::new(7);
        let first = a.name("amq.gen-");
        assert_eq!(first, b.name("amq.gen-"));
        assert_eq!(first.len(), "amq.gen-".len() + 22);
        assert_ne!(first, a.name("amq.gen-"));
    }

    #[test]
    fn shards_draw_different_names() {
        let first = NameGen::for_shard(7, 0).name("amq.gen-");
        assert_eq!(first, NameGen::new(7).name("amq.gen-"));
        assert_ne!(first, NameGen::for_shard(7, 1).name("amq.gen-"));
        assert_ne!(
            NameGen::for_shard(7, 1).name("amq.gen-"),
            NameGen::for_shard(7, 2).name("amq.gen-")
        );
    }
}
