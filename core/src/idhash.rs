//! A fast hasher for maps keyed by the core's own integer ids.
//!
//! Ids are assigned by the core (or the host), never chosen by clients, so there is no
//! hash-flooding risk and SipHash's cost (visible in profiles on every publish) buys nothing.
//! Maps keyed by client-chosen names keep the default, keyed hasher.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// Fx-style multiply-rotate hashing (as rustc uses for its integer-keyed maps).
#[derive(Default, Clone, Copy)]
pub struct IdHasher {
    hash: u64,
}

const SEED: u64 = 0x51_7c_c1_b7_27_22_0a_95;

impl IdHasher {
    #[inline]
    fn add(&mut self, word: u64) {
        self.hash = (self.hash.rotate_left(5) ^ word).wrapping_mul(SEED);
    }
}

impl Hasher for IdHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.add(u64::from_le_bytes(word));
        }
    }

    #[inline]
    fn write_u8(&mut self, i: u8) {
        self.add(u64::from(i));
    }

    #[inline]
    fn write_u16(&mut self, i: u16) {
        self.add(u64::from(i));
    }

    #[inline]
    fn write_u32(&mut self, i: u32) {
        self.add(u64::from(i));
    }

    #[inline]
    fn write_u64(&mut self, i: u64) {
        self.add(i);
    }

    #[inline]
    fn write_usize(&mut self, i: usize) {
        self.add(i as u64);
    }

    #[inline]
    fn finish(&self) -> u64 {
        self.hash
    }
}

/// A `HashMap` keyed by ids. Lookup only: never iterate one to produce effects.
pub type IdMap<K, V> = HashMap<K, V, BuildHasherDefault<IdHasher>>;
