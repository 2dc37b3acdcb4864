//! A filter in front of the replay order's lock, for the question asked before every request
//! of a connection that shares its queues ([`ReplayOrder::unplaced`](super::ReplayOrder)):
//! which stretches of the namespaces may hold a write not known placed. The map answers it
//! exactly, but under the lock every write of every queue takes twice, and with a walk of a
//! tree of thousands of pieces: asked for every NBD request over four connections that cost
//! 0.9x of the 4 KiB random writes. Most requests touch no such write (a queue learns its
//! writes placed every few dozen requests), so the filter answers them without the lock.
//!
//! It counts, in 4096 slots, the writes not known placed whose bytes touch each 64 KiB
//! stretch (the stretch's number and the namespace's hashed to a slot: two stretches may
//! share one, which only sends a question to the map), and the queues that may hold any bytes
//! ("blind": kept out of the map, or reconnected and not placed since). A question whose
//! slots are all zero while no queue is blind has the answer "none".

use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};

/// Slots (a power of two).
const SLOTS: usize = 4096;
/// Bytes of a stretch, as a shift: 64 KiB.
const SHIFT: u32 = 16;

/// The counts (module doc).
#[derive(Debug)]
pub(super) struct Hot {
    slots: Box<[AtomicU32]>,
    blind: AtomicUsize,
}

impl Default for Hot {
    fn default() -> Self {
        Hot {
            slots: (0..SLOTS).map(|_| AtomicU32::new(0)).collect(),
            blind: AtomicUsize::new(0),
        }
    }
}

impl Hot {
    /// The slots of `[start, end)` of `nsid` (each once; all of them for a range longer than
    /// the slots cover).
    fn slots(nsid: u32, start: u64, end: u64) -> impl Iterator<Item = usize> {
        let first = start >> SHIFT;
        let n = if end > start {
            (((end - 1) >> SHIFT) - first + 1).min(SLOTS as u64)
        } else {
            0
        };
        let base = first.wrapping_add(u64::from(nsid).wrapping_mul(0x9e37_79b9_7f4a_7c15));
        (0..n).map(move |k| (base.wrapping_add(k) as usize) & (SLOTS - 1))
    }

    /// A write of `[start, end)` of `nsid` not known placed.
    pub(super) fn add(&self, nsid: u32, start: u64, end: u64) {
        for i in Self::slots(nsid, start, end) {
            self.slots[i].fetch_add(1, Ordering::SeqCst);
        }
    }

    /// That write is placed, or gone.
    pub(super) fn remove(&self, nsid: u32, start: u64, end: u64) {
        for i in Self::slots(nsid, start, end) {
            self.slots[i].fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// A queue that may hold writes of any bytes not known placed, or one fewer.
    pub(super) fn blind(&self, on: bool) {
        if on {
            self.blind.fetch_add(1, Ordering::SeqCst);
        } else {
            self.blind.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Whether `[start, end)` of `nsid` may touch a write not known placed (false: it touches
    /// none).
    pub(super) fn maybe(&self, nsid: u32, start: u64, end: u64) -> bool {
        self.blind.load(Ordering::SeqCst) > 0
            || Self::slots(nsid, start, end).any(|i| self.slots[i].load(Ordering::SeqCst) > 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_range_is_hot_while_a_write_touching_its_stretches_counts() {
        let h = Hot::default();
        assert!(!h.maybe(1, 0, 1 << 30));
        h.add(1, 70_000, 70_001);
        assert!(h.maybe(1, 65_536, 65_537), "the same 64 KiB stretch");
        assert!(h.maybe(1, 0, 1 << 20), "a range over it");
        assert!(!h.maybe(1, 0, 65_536), "the stretch before");
        assert!(!h.maybe(1, 131_072, 200_000), "the one after");
        assert!(!h.maybe(1, 70_000, 70_000), "empty");
        h.add(1, 70_000, 70_001);
        h.remove(1, 70_000, 70_001);
        assert!(h.maybe(1, 65_536, 65_537), "counted twice, removed once");
        h.remove(1, 70_000, 70_001);
        assert!(!h.maybe(1, 0, 1 << 30));
    }

    #[test]
    fn a_blind_queue_makes_every_range_hot_and_huge_ranges_touch_every_slot_once() {
        let h = Hot::default();
        h.blind(true);
        assert!(h.maybe(7, 0, 1));
        h.blind(false);
        assert!(!h.maybe(7, 0, 1));
        // Longer than the slots cover: each slot once, so that remove undoes add.
        h.add(3, 0, 1 << 40);
        assert!((0..SLOTS).all(|i| h.slots[i].load(Ordering::SeqCst) == 1));
        h.remove(3, 0, 1 << 40);
        assert!((0..SLOTS).all(|i| h.slots[i].load(Ordering::SeqCst) == 0));
    }
}
