//! Responder helpers: the dirty-range set behind the durability contract, the atomics executed
//! on registered memory, and the mapping from Terminate causes to completion statuses.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::fabric::mr::Region;
use crate::fabric::soft::device::{AccessFault, InvalidateFault};
use crate::fabric::soft::wire::{Layer, TermCause};
use crate::fabric::types::WcStatus;

/// Beyond this many separate ranges per region, they are merged into one covering range: one
/// larger persist beats an unbounded list.
const MAX_RANGES: usize = 64;

/// The ranges placed by Writes since the last Read, Atomic or Flush response: they are made
/// durable before the next such response leaves (the RC durability contract).
#[derive(Default)]
pub(crate) struct Dirty {
    ranges: Vec<(Arc<Region>, usize, usize)>,
    /// Bytes were placed with non-temporal stores (on their way out of the cache already):
    /// a store fence makes them durable.
    fence: bool,
}

impl Dirty {
    /// Records `len` bytes at `offset` of `region` as placed. Regions without a persistence
    /// domain are not tracked: there is nothing to make durable.
    pub(crate) fn add(&mut self, region: &Arc<Region>, offset: usize, len: usize) {
        if len == 0 || region.persist().is_none() {
            return;
        }
        let end = offset + len;
        // Merge with an overlapping or adjacent range of the same region (the common case:
        // consecutive FPDUs of one Write).
        for r in self.ranges.iter_mut().rev() {
            if Arc::ptr_eq(&r.0, region) && offset <= r.1 + r.2 && r.1 <= end {
                let start = r.1.min(offset);
                r.2 = (r.1 + r.2).max(end) - start;
                r.1 = start;
                return;
            }
        }
        let same = self
            .ranges
            .iter()
            .filter(|r| Arc::ptr_eq(&r.0, region))
            .count();
        if same >= MAX_RANGES {
            let (mut lo, mut hi) = (offset, end);
            self.ranges.retain(|r| {
                if Arc::ptr_eq(&r.0, region) {
                    lo = lo.min(r.1);
                    hi = hi.max(r.1 + r.2);
                    false
                } else {
                    true
                }
            });
            self.ranges.push((Arc::clone(region), lo, hi - lo));
            return;
        }
        self.ranges.push((Arc::clone(region), offset, len));
    }

    /// Records that bytes were placed with a copy that wrote them back from the cache
    /// (non-temporal stores): they need only the fence.
    pub(crate) fn add_fence(&mut self) {
        self.fence = true;
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.ranges.is_empty() && !self.fence
    }

    #[cfg(test)]
    fn ranges(&self) -> Vec<(usize, usize)> {
        self.ranges.iter().map(|r| (r.1, r.2)).collect()
    }

    /// Makes every recorded range durable through its memory's `Persist`, then forgets them.
    /// On failure the ranges that failed stay recorded and the first error is returned.
    pub(crate) fn persist_all(&mut self) -> crate::pmem::Result<()> {
        if std::mem::take(&mut self.fence) {
            crate::pmem::sfence();
        }
        let mut failed = None;
        self.ranges
            .retain(|(region, off, len)| match region.persist() {
                Some(p) => match p.persist(*off, *len) {
                    Ok(_) => false,
                    Err(e) => {
                        failed.get_or_insert(e);
                        true
                    }
                },
                None => false,
            });
        match failed {
            None => Ok(()),
            Some(e) => Err(e),
        }
    }
}

/// Executes an RFC 7306 masked fetch-and-add on the 8 bytes at `ptr`; returns the original.
///
/// A set bit `i` in `mask` stops the carry out of bit `i` (partitioned adds); mask 0 is a plain
/// 64-bit add, done with one `lock xadd`.
pub(crate) fn fetch_add(target: &AtomicU64, add: u64, mask: u64) -> u64 {
    if mask == 0 {
        return target.fetch_add(add, Ordering::AcqRel);
    }
    let mut cur = target.load(Ordering::Acquire);
    loop {
        let new = masked_add(cur, add, mask);
        match target.compare_exchange_weak(cur, new, Ordering::AcqRel, Ordering::Acquire) {
            Ok(orig) => return orig,
            Err(actual) => cur = actual,
        }
    }
}

fn masked_add(a: u64, b: u64, mask: u64) -> u64 {
    let mut r = 0u64;
    let mut carry = 0u64;
    for i in 0..64 {
        let s = ((a >> i) & 1) + ((b >> i) & 1) + carry;
        r |= (s & 1) << i;
        carry = if (mask >> i) & 1 == 1 { 0 } else { s >> 1 };
    }
    r
}

/// Executes an RFC 7306 masked compare-and-swap; returns the original value. The swap happens
/// when the bits selected by `cmp_mask` equal `compare`'s; then the bits selected by
/// `swap_mask` take `swap`'s.
pub(crate) fn compare_swap(
    target: &AtomicU64,
    compare: u64,
    cmp_mask: u64,
    swap: u64,
    swap_mask: u64,
) -> u64 {
    let mut cur = target.load(Ordering::Acquire);
    loop {
        if cur & cmp_mask != compare & cmp_mask {
            return cur;
        }
        let new = (cur & !swap_mask) | (swap & swap_mask);
        match target.compare_exchange_weak(cur, new, Ordering::AcqRel, Ordering::Acquire) {
            Ok(orig) => return orig,
            Err(actual) => cur = actual,
        }
    }
}

/// The Terminate cause for a refused tagged access (a Write or a Read Response's target).
pub(crate) fn tagged_cause(f: AccessFault) -> TermCause {
    match f {
        AccessFault::InvalidStag => TermCause::DDP_TAGGED_INVALID_STAG,
        AccessFault::NotAssociated => TermCause::DDP_TAGGED_STAG_NOT_ASSOCIATED,
        AccessFault::BaseBounds => TermCause::DDP_TAGGED_BASE_BOUNDS,
        AccessFault::Rights => TermCause::RDMAP_ACCESS_RIGHTS,
    }
}

/// The Terminate cause for a refused access named in a control message (Read source, atomic,
/// Flush, Atomic Write): RDMAP remote protection errors.
pub(crate) fn rdmap_cause(f: AccessFault) -> TermCause {
    match f {
        AccessFault::InvalidStag => TermCause::RDMAP_INVALID_STAG,
        AccessFault::NotAssociated => TermCause::RDMAP_STAG_NOT_ASSOCIATED,
        AccessFault::BaseBounds => TermCause::RDMAP_BASE_BOUNDS,
        AccessFault::Rights => TermCause::RDMAP_ACCESS_RIGHTS,
    }
}

/// The Terminate cause for a refused Send with Invalidate (RFC 5040 §7.2 has "STag cannot be
/// invalidated" under both error types): an STag of another protection domain, or a window
/// bound to another queue pair, is a Remote Protection Error; an unknown STag, or a region's
/// (only windows can be invalidated remotely), a Remote Operation Error.
pub(crate) fn invalidate_cause(f: InvalidateFault) -> TermCause {
    match f {
        InvalidateFault::NotAssociated => TermCause::RDMAP_PROTECTION_CANNOT_INVALIDATE,
        InvalidateFault::InvalidStag | InvalidateFault::NotAWindow => {
            TermCause::RDMAP_CANNOT_INVALIDATE
        }
    }
}

/// The status a requester reports for the request a received Terminate ended.
pub(crate) fn status_for(cause: TermCause) -> WcStatus {
    match (cause.layer, cause.etype) {
        (Layer::Rdmap, 1) | (Layer::Ddp, 1) => WcStatus::RemoteAccess,
        (Layer::Ddp, 2) => WcStatus::RemoteInvalidRequest,
        (Layer::Rdmap, 2) if cause == TermCause::RDMAP_UNEXPECTED_OPCODE => {
            WcStatus::RemoteInvalidRequest
        }
        _ => WcStatus::RemoteOperation,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fabric::mr::{AlignedBuf, Backing};
    use crate::pmem::{Domain, Mapping};

    fn volatile_region() -> Arc<Region> {
        Arc::new(Region::for_test(Backing::Owned(
            AlignedBuf::new(8192).unwrap(),
        )))
    }

    fn mapped_region() -> Arc<Region> {
        let m = Mapping::anonymous(1 << 16).unwrap();
        Arc::new(Region::for_test(Backing::Owned(Arc::new(m))))
    }

    #[test]
    fn dirty_ranges_merge_and_skip_memory_without_persistence() {
        let mut d = Dirty::default();
        d.add(&volatile_region(), 0, 100);
        assert!(d.is_empty(), "no Persist: nothing to track");
        let r = mapped_region();
        assert_eq!(r.persist().map(|p| p.domain()), Some(Domain::Volatile));
        d.add(&r, 0, 100);
        d.add(&r, 100, 50); // adjacent
        d.add(&r, 20, 10); // inside
        assert_eq!(d.ranges(), vec![(0, 150)]);
        d.add(&r, 1000, 8);
        d.add(&r, 990, 10); // adjacent below
        assert_eq!(d.ranges(), vec![(0, 150), (990, 18)]);
        d.add(&r, 5, 0);
        assert_eq!(d.ranges().len(), 2);
        d.persist_all().unwrap();
        assert!(d.is_empty());
    }

    #[test]
    fn a_fence_alone_is_work_to_do_and_is_done_once() {
        let mut d = Dirty::default();
        d.add_fence();
        assert!(!d.is_empty(), "written-back bytes still need their sfence");
        d.persist_all().unwrap();
        assert!(d.is_empty());
    }

    #[test]
    fn dirty_ranges_collapse_past_the_limit() {
        let mut d = Dirty::default();
        let r = mapped_region();
        for i in 0..(MAX_RANGES + 1) {
            d.add(&r, i * 16, 8);
        }
        assert_eq!(d.ranges(), vec![(0, MAX_RANGES * 16 + 8)]);
    }

    #[test]
    fn masked_atomics() {
        let a = AtomicU64::new(5);
        assert_eq!(fetch_add(&a, 3, 0), 5);
        assert_eq!(a.load(Ordering::Relaxed), 8);
        // Two 32-bit lanes: the carry out of bit 31 is stopped.
        let a = AtomicU64::new(0x0000_0001_FFFF_FFFF);
        assert_eq!(fetch_add(&a, 1, 1 << 31), 0x0000_0001_FFFF_FFFF);
        assert_eq!(a.load(Ordering::Relaxed), 0x0000_0001_0000_0000);
        let a = AtomicU64::new(10);
        assert_eq!(compare_swap(&a, 11, !0, 99, !0), 10);
        assert_eq!(a.load(Ordering::Relaxed), 10, "no swap on mismatch");
        assert_eq!(compare_swap(&a, 10, !0, 99, !0), 10);
        assert_eq!(a.load(Ordering::Relaxed), 99);
        // Compare only the low byte, swap only the high byte.
        let a = AtomicU64::new(0x1100_0000_0000_0022);
        compare_swap(&a, 0x22, 0xFF, 0xAA00_0000_0000_0000, 0xFF00_0000_0000_0000);
        assert_eq!(a.load(Ordering::Relaxed), 0xAA00_0000_0000_0022);
    }

    #[test]
    fn terminate_causes_map_to_statuses() {
        assert_eq!(
            status_for(tagged_cause(AccessFault::InvalidStag)),
            WcStatus::RemoteAccess
        );
        assert_eq!(
            status_for(tagged_cause(AccessFault::BaseBounds)),
            WcStatus::RemoteAccess
        );
        assert_eq!(
            status_for(rdmap_cause(AccessFault::Rights)),
            WcStatus::RemoteAccess
        );
        assert_eq!(
            status_for(TermCause::DDP_UNTAGGED_NO_BUFFER),
            WcStatus::RemoteInvalidRequest
        );
        assert_eq!(
            status_for(TermCause::DDP_UNTAGGED_MSN_RANGE),
            WcStatus::RemoteInvalidRequest
        );
        assert_eq!(
            status_for(TermCause::RDMAP_UNEXPECTED_OPCODE),
            WcStatus::RemoteInvalidRequest
        );
        assert_eq!(
            status_for(TermCause::RDMAP_CATASTROPHIC_STREAM),
            WcStatus::RemoteOperation
        );
        assert_eq!(status_for(TermCause::MPA_CRC), WcStatus::RemoteOperation);
        assert_eq!(
            status_for(invalidate_cause(InvalidateFault::NotAssociated)),
            WcStatus::RemoteAccess
        );
        assert_eq!(
            status_for(invalidate_cause(InvalidateFault::InvalidStag)),
            WcStatus::RemoteOperation
        );
        assert_eq!(
            status_for(invalidate_cause(InvalidateFault::NotAWindow)),
            WcStatus::RemoteOperation
        );
    }
}
