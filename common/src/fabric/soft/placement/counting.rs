//! The engine's side of its [`ResponderCounters`]: it finds the cells of an rkey without a lock
//! (its own list, with the last one used first: a connection mostly serves one namespace at a
//! time) and writes them as their only writer, under the queue pair's lock.

use std::sync::Arc;

use crate::fabric::counters::{
    PersistKind, RegionCells, ResponderCounters, TerminateCause, OTHER_RKEYS,
};
use crate::stats::{Stopwatch, COUNTING};

/// Rkeys counted apart per queue pair; the counts of further ones (a queue pair that is served
/// through ever new window bindings) are summed under [`OTHER_RKEYS`].
pub(crate) const MAX_RKEYS: usize = 256;

/// Counting for one queue pair's engine.
#[derive(Default)]
pub(crate) struct Counting {
    shared: ResponderCounters,
    /// The rkeys served so far and their cells (the same as `shared` lists).
    slots: Vec<(u32, Arc<RegionCells>)>,
    /// The index in `slots` of the rkey served last.
    last: usize,
}

impl Counting {
    pub(crate) fn new(shared: ResponderCounters) -> Counting {
        Counting {
            shared,
            slots: Vec::new(),
            last: 0,
        }
    }

    /// The cells of `rkey`, listed for readers the first time it is served (only accesses
    /// that passed the STag check are counted); past [`MAX_RKEYS`], those of [`OTHER_RKEYS`].
    #[inline]
    fn cells(&mut self, rkey: u32) -> &RegionCells {
        if self.slots.get(self.last).is_none_or(|s| s.0 != rkey) {
            self.last = match self.slots.iter().position(|s| s.0 == rkey) {
                Some(i) => i,
                None if self.slots.len() >= MAX_RKEYS && rkey != OTHER_RKEYS => {
                    return self.cells(OTHER_RKEYS);
                }
                None => {
                    let cells = self.shared.add_region(rkey);
                    self.slots.push((rkey, cells));
                    self.slots.len() - 1
                }
            };
        }
        &self.slots[self.last].1
    }

    /// `len` bytes of a Write to `rkey` were placed; `last`: its last segment.
    #[inline]
    pub(crate) fn write(&mut self, rkey: u32, len: usize, last: bool) {
        if COUNTING {
            let c = self.cells(rkey);
            c.write_bytes.add(len as u64);
            c.writes.add(u64::from(last));
        }
    }

    /// A Read Request of `len` bytes from `rkey` is answered.
    #[inline]
    pub(crate) fn read(&mut self, rkey: u32, len: u32) {
        if COUNTING {
            let c = self.cells(rkey);
            c.reads.add(1);
            c.read_bytes.add(u64::from(len));
        }
    }

    /// A Read of `rkey` had earlier Writes to make durable: `ok`, or its persist failed.
    #[inline]
    pub(crate) fn apm(&mut self, rkey: u32, ok: bool) {
        if COUNTING {
            let c = self.cells(rkey);
            (if ok { &c.apm } else { &c.apm_failed }).add(1);
        }
    }

    /// An atomic on `rkey` was executed.
    #[inline]
    pub(crate) fn atomic(&mut self, rkey: u32) {
        if COUNTING {
            self.cells(rkey).atomics.add(1);
        }
    }

    /// A FLUSH of `rkey` was answered (`ok`) or failed its persist.
    #[inline]
    pub(crate) fn flush(&mut self, rkey: u32, ok: bool) {
        if COUNTING {
            let c = self.cells(rkey);
            (if ok { &c.flushes } else { &c.flushes_failed }).add(1);
        }
    }

    /// A Terminate was sent.
    pub(crate) fn terminated(&self, cause: TerminateCause) {
        self.shared.terminated(cause);
    }

    /// Persist work of `kind` that started at `sw` is done.
    #[inline]
    pub(crate) fn persisted(&self, kind: PersistKind, sw: Stopwatch) {
        self.shared.persist(kind).record_since(sw);
    }
}

#[cfg(all(test, not(rpma_no_counters)))]
mod tests {
    use super::*;

    #[test]
    fn counts_land_on_their_rkey_and_readers_see_them() {
        let shared = ResponderCounters::new();
        let mut c = Counting::new(shared.clone());
        c.write(5, 4000, false);
        c.write(5, 96, true);
        c.read(6, 8);
        c.apm(6, true);
        c.write(5, 10, true);
        c.atomic(6);
        c.flush(5, true);
        c.flush(5, false);
        c.apm(6, false);
        c.terminated(TerminateCause::Crc);
        c.persisted(PersistKind::Writeback, Stopwatch::start());
        let s = shared.snapshot();
        assert_eq!(s.regions.len(), 2, "one list entry per rkey: {s:?}");
        let r5 = s.region(5).unwrap();
        assert_eq!((r5.writes, r5.write_bytes), (2, 4106));
        assert_eq!((r5.flushes, r5.flushes_failed), (1, 1));
        let r6 = s.region(6).unwrap();
        assert_eq!((r6.reads, r6.read_bytes, r6.atomics), (1, 8, 1));
        assert_eq!((r6.apm, r6.apm_failed), (1, 1));
        assert_eq!(s.terminates_for(TerminateCause::Crc), 1);
        assert_eq!(s.persist_writeback.count(), 1);
    }

    #[test]
    fn past_the_limit_further_rkeys_are_summed_apart() {
        let shared = ResponderCounters::new();
        let mut c = Counting::new(shared.clone());
        for rkey in 0..(MAX_RKEYS as u32 + 10) {
            c.write(0x100 + rkey, 1, true);
        }
        c.write(0x100, 1, true);
        let s = shared.snapshot();
        assert_eq!(s.regions.len(), MAX_RKEYS + 1);
        assert_eq!(s.region(0x100).unwrap().writes, 2);
        assert_eq!(s.region(OTHER_RKEYS).unwrap().writes, 10);
        let total: u64 = s.regions.iter().map(|r| r.write_bytes).sum();
        assert_eq!(total, MAX_RKEYS as u64 + 11);
    }
}
