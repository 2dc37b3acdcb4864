//! What a queue pair served as the responder: the remote Writes placed, Reads answered,
//! atomics executed and durability requests made good in its registered memory, per rkey; the
//! Terminates it sent, by cause; and how long the persist work before its responses took.
//!
//! The transport that serves the requests counts them where it serves them, with one writer
//! per queue pair ([`crate::stats`]): no shared atomic on the data path. Read them with
//! [`QueuePair::responder_counters`](super::QueuePair::responder_counters) and
//! [`ResponderCounters::snapshot`] from any thread. The `tcp` transport counts everything here
//! (its placement engine is software); an RNIC places without software, so `rdma` has none.

use std::sync::{Arc, Mutex};

use crate::stats::{Counter, Histogram, HistogramCell};

/// Why a Terminate was sent, in the classes a requester tells apart (its completion status),
/// plus the two an operator asks about on their own: a bad CRC and a failed persist.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum TerminateCause {
    /// An access refused: an unknown or revoked STag, out of bounds, missing rights
    /// (the requester sees RemoteAccess).
    Access,
    /// A message the responder could not take: no receive posted, MSN out of range, too long
    /// (RemoteInvalidRequest).
    InvalidRequest,
    /// Any other remote operation error: an unexpected opcode, too many Reads/atomics for the
    /// IRD, a framing error (RemoteOperation).
    Operation,
    /// An FPDU failed its MPA CRC.
    Crc,
    /// Making earlier Writes durable failed before a response could leave (the namespace
    /// failed).
    Persist,
}

impl TerminateCause {
    /// Every cause, in the order of [`ResponderSnapshot::terminates`].
    pub const ALL: [TerminateCause; 5] = [
        TerminateCause::Access,
        TerminateCause::InvalidRequest,
        TerminateCause::Operation,
        TerminateCause::Crc,
        TerminateCause::Persist,
    ];

    /// The name used in status and metrics labels: "access", "invalid_request", "operation",
    /// "crc", "persist".
    pub fn name(self) -> &'static str {
        match self {
            TerminateCause::Access => "access",
            TerminateCause::InvalidRequest => "invalid_request",
            TerminateCause::Operation => "operation",
            TerminateCause::Crc => "crc",
            TerminateCause::Persist => "persist",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// What the persist before a response was: the two kinds the placement engine does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PersistKind {
    /// dax: CPU cache write-back of the range and a store fence (or the fence alone).
    Writeback = 0,
    /// page-cache: msync of the range.
    Msync = 1,
}

/// The rkey under which a queue pair sums the counts of the rkeys it was served through past
/// the first 256 (no `tcp` STag is 0).
pub const OTHER_RKEYS: u32 = 0;

/// The counts of one rkey (a memory region or window of the queue pair's domain).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RegionServed {
    /// The rkey the peer named.
    pub rkey: u32,
    /// RDMA Write messages placed (each counted at its last segment).
    pub writes: u64,
    /// Bytes those Writes placed.
    pub write_bytes: u64,
    /// RDMA Read Requests answered.
    pub reads: u64,
    /// Bytes those Reads returned.
    pub read_bytes: u64,
    /// Atomic operations executed: fetch-and-add, compare-and-swap, Atomic Write.
    pub atomics: u64,
    /// Reads that had earlier Writes to make durable first (the APM method's Read), answered.
    pub apm: u64,
    /// Such Reads whose persist failed (answered with a Terminate instead).
    pub apm_failed: u64,
    /// FLUSH requests answered (either placement type).
    pub flushes: u64,
    /// FLUSH requests whose persist failed (answered with a Terminate instead).
    pub flushes_failed: u64,
}

impl RegionServed {
    /// Adds `o`'s counts to these (the rkey stays).
    pub fn add(&mut self, o: &RegionServed) {
        self.writes += o.writes;
        self.write_bytes += o.write_bytes;
        self.reads += o.reads;
        self.read_bytes += o.read_bytes;
        self.atomics += o.atomics;
        self.apm += o.apm;
        self.apm_failed += o.apm_failed;
        self.flushes += o.flushes;
        self.flushes_failed += o.flushes_failed;
    }
}

/// A copy of a queue pair's [`ResponderCounters`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ResponderSnapshot {
    /// Per rkey that was ever served, in the order first served.
    pub regions: Vec<RegionServed>,
    /// Terminates sent, per cause in [`TerminateCause::ALL`] order.
    pub terminates: [u64; 5],
    /// Persist work before responses on dax memory: cache write-back and fence.
    pub persist_writeback: Histogram,
    /// Persist work before responses on page-cache memory: msync.
    pub persist_msync: Histogram,
}

impl ResponderSnapshot {
    /// The counts of `rkey`, if it was served.
    pub fn region(&self, rkey: u32) -> Option<&RegionServed> {
        self.regions.iter().find(|r| r.rkey == rkey)
    }

    /// Terminates sent for `cause`.
    pub fn terminates_for(&self, cause: TerminateCause) -> u64 {
        self.terminates[cause.index()]
    }
}

/// The counters of one rkey (written by the queue pair's engine only).
#[derive(Debug, Default)]
pub(crate) struct RegionCells {
    pub(crate) writes: Counter,
    pub(crate) write_bytes: Counter,
    pub(crate) reads: Counter,
    pub(crate) read_bytes: Counter,
    pub(crate) atomics: Counter,
    pub(crate) apm: Counter,
    pub(crate) apm_failed: Counter,
    pub(crate) flushes: Counter,
    pub(crate) flushes_failed: Counter,
}

impl RegionCells {
    fn snapshot(&self, rkey: u32) -> RegionServed {
        RegionServed {
            rkey,
            writes: self.writes.get(),
            write_bytes: self.write_bytes.get(),
            reads: self.reads.get(),
            read_bytes: self.read_bytes.get(),
            atomics: self.atomics.get(),
            apm: self.apm.get(),
            apm_failed: self.apm_failed.get(),
            flushes: self.flushes.get(),
            flushes_failed: self.flushes_failed.get(),
        }
    }
}

#[derive(Debug, Default)]
struct Cells {
    /// Every rkey served so far. The engine appends under the lock the first time it serves an
    /// rkey (rare) and keeps its own clones for the data path, which takes no lock.
    regions: Mutex<Vec<(u32, Arc<RegionCells>)>>,
    terminates: [Counter; 5],
    persist: [HistogramCell; 2],
}

/// A queue pair's responder counters: a handle, cheap to clone, readable from any thread.
#[derive(Debug, Clone, Default)]
pub struct ResponderCounters(Arc<Cells>);

impl ResponderCounters {
    pub(crate) fn new() -> ResponderCounters {
        ResponderCounters::default()
    }

    /// A copy of every count now. Each value is whole; values counted together (a Write's
    /// operation and its bytes) may be a moment apart.
    pub fn snapshot(&self) -> ResponderSnapshot {
        let regions = self
            .0
            .regions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(rkey, c)| c.snapshot(*rkey))
            .collect();
        ResponderSnapshot {
            regions,
            terminates: self.terminates(),
            persist_writeback: self.0.persist[PersistKind::Writeback as usize].snapshot(),
            persist_msync: self.0.persist[PersistKind::Msync as usize].snapshot(),
        }
    }

    /// Terminates sent so far, per cause in [`TerminateCause::ALL`] order (without the
    /// per-rkey list that [`snapshot`](Self::snapshot) copies).
    pub fn terminates(&self) -> [u64; 5] {
        let mut t = [0; 5];
        for (v, c) in t.iter_mut().zip(self.0.terminates.iter()) {
            *v = c.get();
        }
        t
    }

    /// The cells of a newly served rkey, listed for readers.
    pub(crate) fn add_region(&self, rkey: u32) -> Arc<RegionCells> {
        let cells = Arc::new(RegionCells::default());
        self.0
            .regions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((rkey, Arc::clone(&cells)));
        cells
    }

    pub(crate) fn terminated(&self, cause: TerminateCause) {
        self.0.terminates[cause.index()].add(1);
    }

    pub(crate) fn persist(&self, kind: PersistKind) -> &HistogramCell {
        &self.0.persist[kind as usize]
    }
}

#[cfg(all(test, not(rpma_no_counters)))]
mod tests {
    use super::*;

    #[test]
    fn snapshots_list_regions_in_order_and_sum() {
        let c = ResponderCounters::new();
        let a = c.add_region(7);
        let b = c.add_region(9);
        a.writes.add(2);
        a.write_bytes.add(8192);
        b.reads.add(1);
        b.read_bytes.add(8);
        b.apm.add(1);
        c.terminated(TerminateCause::Access);
        c.terminated(TerminateCause::Access);
        c.terminated(TerminateCause::Persist);
        c.persist(PersistKind::Msync).record(5_000);
        let s = c.clone().snapshot();
        assert_eq!(s.regions.iter().map(|r| r.rkey).collect::<Vec<_>>(), [7, 9]);
        assert_eq!(s.region(7).unwrap().write_bytes, 8192);
        assert_eq!(s.region(9).unwrap().apm, 1);
        assert!(s.region(8).is_none());
        assert_eq!(s.terminates_for(TerminateCause::Access), 2);
        assert_eq!(s.terminates_for(TerminateCause::Persist), 1);
        assert_eq!(s.terminates_for(TerminateCause::Crc), 0);
        assert_eq!(c.terminates(), s.terminates);
        assert_eq!(s.persist_msync.count(), 1);
        assert_eq!(s.persist_writeback.count(), 0);
        let mut sum = s.regions[0];
        sum.add(&s.regions[1]);
        assert_eq!((sum.rkey, sum.writes, sum.reads, sum.apm), (7, 2, 1, 1));
        let names: Vec<&str> = TerminateCause::ALL.iter().map(|c| c.name()).collect();
        assert_eq!(
            names,
            ["access", "invalid_request", "operation", "crc", "persist"]
        );
        for (i, c) in TerminateCause::ALL.iter().enumerate() {
            assert_eq!(c.index(), i);
        }
    }
}
