//! The dirty-range set behind the durability contract: what Writes placed since the last
//! Read, Atomic or Flush response, made durable before the next such response leaves.
//!
//! Only memory made durable by a cache write-back (dax, and the power-loss simulation of it)
//! and volatile memory with a store are tracked. Page-cache memory is not: there a Read or
//! Atomic response orders the earlier Writes (they are placed) but does not make them durable,
//! because that would be an msync in the poll loop before every Read response after a Write
//! (a mixed read/write load ran at a tenth of a local server's rate). A FLUSH makes its named
//! range durable, GPSPM the range it names; APM is not offered on page-cache
//! (docs/fabric.md, "The durability contract").

use std::sync::Arc;

use crate::fabric::counters::PersistKind;
use crate::fabric::memory::Region;
use crate::pmem::Domain;

/// Beyond this many separate ranges the list is cut down: the recorded ranges are made durable
/// at once, early (always allowed: durability only ever comes sooner), and the list starts
/// over. Merging them into one covering range would write back every cache line between
/// scattered writes.
const MAX_RANGES: usize = 64;

/// The ranges placed by Writes since the last Read, Atomic or Flush response: they are made
/// durable before the next such response leaves (the RC durability contract).
#[derive(Default)]
pub(crate) struct Dirty {
    ranges: Vec<(Arc<Region>, usize, usize)>,
    /// The regions bytes were placed into with non-temporal stores (on their way out of the
    /// cache already): a store fence makes them durable, once their store is known healthy
    /// (a failed store promises nothing, whatever reached it).
    fenced: Vec<Arc<Region>>,
}

impl Dirty {
    /// Records `len` bytes at `offset` of `region` as placed. Regions without a persistence
    /// domain are not tracked (there is nothing to make durable), nor page-cache ones (see the
    /// module docs).
    pub(crate) fn add(&mut self, region: &Arc<Region>, offset: usize, len: usize) {
        let tracked = region
            .persist()
            .is_some_and(|p| p.domain() != Domain::PageCache);
        if len == 0 || !tracked {
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
        if self.ranges.len() >= MAX_RANGES {
            // A failure is not lost: the ranges that failed stay recorded, the memory's store
            // remembers it, and the next persist before a response reports it. Only if ranges
            // are left over (it failed) are they merged, to keep the list bounded.
            let _ = self.persist_all();
            if self.ranges.len() >= MAX_RANGES {
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
        }
        self.ranges.push((Arc::clone(region), offset, len));
    }

    /// Records that bytes were placed into `region` with a copy that wrote them back from the
    /// cache (non-temporal stores): they need only the fence, and their store's health check.
    pub(crate) fn add_fence(&mut self, region: &Arc<Region>) {
        if !self.fenced.iter().any(|r| Arc::ptr_eq(r, region)) {
            self.fenced.push(Arc::clone(region));
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.ranges.is_empty() && self.fenced.is_empty()
    }

    /// What persisting would take: a cache write-back (and fence) if a dax range or a fence is
    /// recorded; None when there is nothing durable to make (empty, or volatile memory only).
    pub(crate) fn durable_work(&self) -> Option<PersistKind> {
        let dax = self.ranges.iter().any(|(region, _, _)| {
            matches!(
                region.persist().map(|p| p.domain()),
                Some(Domain::Dax | Domain::DaxForced)
            )
        });
        (!self.fenced.is_empty() || dax).then_some(PersistKind::Writeback)
    }

    #[cfg(test)]
    fn ranges(&self) -> Vec<(usize, usize)> {
        self.ranges.iter().map(|r| (r.1, r.2)).collect()
    }

    /// Makes every recorded range durable through its memory's `Persist`, then forgets them.
    /// On failure the ranges that failed stay recorded and the first error is returned.
    pub(crate) fn persist_all(&mut self) -> crate::pmem::Result<()> {
        let mut failed = None;
        // The fence, then each store's health: `drain` fails once the store has failed, as a
        // persist of a range would. A failed one stays recorded, as a failed range does.
        self.fenced.retain(|region| match region.persist() {
            Some(p) => match p.drain() {
                Ok(_) => false,
                Err(e) => {
                    failed.get_or_insert(e);
                    true
                }
            },
            None => false,
        });
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fabric::mr::{AlignedBuf, Backing};
    use crate::pmem::Mapping;

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
        assert_eq!(
            d.durable_work(),
            None,
            "volatile memory: nothing to make durable"
        );
        d.persist_all().unwrap();
        assert!(d.is_empty());
    }

    #[test]
    fn a_fence_alone_is_work_to_do_and_is_done_once() {
        let mut d = Dirty::default();
        assert_eq!(d.durable_work(), None);
        let r = mapped_region();
        d.add_fence(&r);
        d.add_fence(&r);
        assert!(!d.is_empty(), "written-back bytes still need their sfence");
        assert_eq!(d.durable_work(), Some(PersistKind::Writeback));
        d.persist_all().unwrap();
        assert!(d.is_empty());
    }

    #[test]
    fn a_fence_into_a_failed_store_fails_and_stays_recorded() {
        // dax (forced) on a file: bytes written back by non-temporal stores need only the
        // fence, but once the store has failed nothing may be called durable.
        let dir = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        let m = crate::pmem::OpenOptions::new(dir.path().join("ns"))
            .size(1 << 20)
            .create(true)
            .force_dax(true)
            .open()
            .unwrap();
        assert_eq!(m.domain(), Domain::DaxForced);
        let m = Arc::new(m);
        let r = Arc::new(Region::for_test(Backing::Owned(Arc::clone(&m) as _)));
        let mut d = Dirty::default();
        d.add_fence(&r);
        d.persist_all().unwrap();
        let eio = std::io::Error::from_raw_os_error(libc::EIO);
        let failure = crate::pmem::SyncFailure::new("fdatasync", &eio);
        assert!(crate::pmem::Persist::record_failure(&*m, failure));
        d.add_fence(&r);
        assert!(matches!(
            d.persist_all(),
            Err(crate::pmem::Error::Failed { .. })
        ));
        assert!(!d.is_empty(), "the failed fence stays recorded");
        assert!(d.persist_all().is_err(), "and fails again");
    }

    #[test]
    fn past_the_limit_the_ranges_are_persisted_early_not_merged() {
        let mut d = Dirty::default();
        let r = mapped_region();
        for i in 0..(MAX_RANGES + 1) {
            d.add(&r, i * 16, 8);
        }
        // The first MAX_RANGES went out early; only the last one waits for a response.
        assert_eq!(d.ranges(), vec![(MAX_RANGES * 16, 8)]);
    }

    #[test]
    fn page_cache_ranges_are_not_tracked_a_response_only_orders_them() {
        // A file on the disk the sources are on (not /tmp, which may be a tmpfs: volatile).
        let dir = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        let m = crate::pmem::OpenOptions::new(dir.path().join("ns"))
            .size(1 << 20)
            .create(true)
            .open()
            .unwrap();
        assert_eq!(m.domain(), Domain::PageCache);
        let r = Arc::new(Region::for_test(Backing::Owned(Arc::new(m))));
        let mut d = Dirty::default();
        for i in 0..(MAX_RANGES + 1) {
            d.add(&r, i * 4096, 8);
        }
        assert!(d.is_empty(), "no msync before a Read or Atomic response");
        assert_eq!(d.durable_work(), None);
    }
}
