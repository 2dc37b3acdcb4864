//! Hash maps keyed by ids this crate hands out itself (request ids, tickets, slot numbers,
//! buffer ids): sequence numbers no peer chooses, hashed with one multiplication instead of
//! the standard library's SipHash, whose resistance to chosen keys they do not need. SipHash
//! was about 4% of the NBD export's samples at 4 KiB random writes, depth 64
//! (docs/benchmarks.md, "Maps keyed by our own ids"). A map keyed by anything a peer or a
//! client chooses (an offset, an NBD handle) keeps the standard hasher.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// A [`HashMap`] keyed by the crate's own ids.
pub(crate) type IdMap<K, V> = HashMap<K, V, BuildHasherDefault<IdHasher>>;

/// 2^64 / the golden ratio, odd: multiplying by it is a bijection of `u64` that moves the
/// differences between nearby keys into the high bits as well as the low ones (hashbrown takes
/// the bucket from the low bits and a tag from the top seven).
const K: u64 = 0x9E37_79B9_7F4A_7C15;

/// The hasher of [`IdMap`]: each integer written is mixed in with a xor and a multiplication.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct IdHasher(u64);

impl Hasher for IdHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(26) ^ n).wrapping_mul(K);
    }

    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }

    fn write_u32(&mut self, n: u32) {
        self.write_u64(u64::from(n));
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;
    use std::hash::BuildHasher;

    fn hash<T: std::hash::Hash>(t: T) -> u64 {
        BuildHasherDefault::<IdHasher>::default().hash_one(t)
    }

    #[test]
    fn sequential_ids_spread_over_buckets_and_tags() {
        // 4,096 sequential ids: all hashes distinct, and both the low bits (the bucket) and
        // the top seven (the tag) of them take many values.
        let hs: Vec<u64> = (0..4096u64).map(hash).collect();
        assert_eq!(hs.iter().collect::<HashSet<_>>().len(), hs.len());
        let low: HashSet<u64> = hs.iter().map(|h| h & 4095).collect();
        assert!(low.len() > 4000, "{} buckets of 4096", low.len());
        let tags: HashSet<u64> = hs.iter().map(|h| h >> 57).collect();
        assert_eq!(tags.len(), 128, "every tag");
        // Pairs and strided ids (slot numbers times a chunk) too.
        let pairs: HashSet<u64> = (0..64usize)
            .flat_map(|a| (0..64u64).map(move |b| hash((a, b << 20))))
            .collect();
        assert_eq!(pairs.len(), 64 * 64);
    }

    #[test]
    fn a_map_keyed_by_ids_behaves_as_a_map() {
        let mut m: IdMap<u64, u64> = IdMap::default();
        for i in 0..10_000u64 {
            m.insert(i, i * 3);
        }
        for i in (0..10_000u64).step_by(2) {
            assert_eq!(m.remove(&i), Some(i * 3));
        }
        assert_eq!(m.len(), 5_000);
        assert!((1..10_000u64)
            .step_by(2)
            .all(|i| m.get(&i) == Some(&(i * 3))));
        assert_eq!(m.get(&0), None);
    }
}
