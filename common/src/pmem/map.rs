//! [`Mapping`]: a namespace's memory as every user of the pmem layer holds it. Behind it is
//! either the mapping of the backing store itself (`media.rs`) or, for tests and debugging,
//! the power-loss simulation over that mapping (`sim.rs`); both implement the persist seam
//! ([`Persist`]), and `Mapping` hands each call to the one the namespace was opened with.
//! Neither knows the other: the production mapping has no simulation in it.

use std::io;
use std::os::fd::BorrowedFd;
use std::path::Path;

use super::domain::{Domain, Durability, SyncFailure};
use super::error::{Error, Result};
use super::media::{FailureHook, Media};
use super::persist::Persist;
use super::sim::{SimStats, Simulated, Simulation};
use crate::volatile::VolatileSlice;

/// A shared mapping of a namespace's backing store (or anonymous memory), with the persistence
/// domain probed when it was opened. Dropping it unmaps the memory and closes the file.
///
/// The mapping hands out raw pointers, never references: the bytes may be changed at any time
/// by other processes sharing the file, by a NIC, or by the fabric placing a peer's Write from
/// another thread. Readers and writers coordinate through the protocol above this layer;
/// [`Mapping::read_at`]/[`Mapping::write_at`] are copies through a [`VolatileSlice`], sound
/// under such concurrent access (racing bytes may come out torn).
///
/// Under the power-loss simulation
/// ([`OpenOptions::power_loss_simulation`](super::OpenOptions::power_loss_simulation), sim.rs)
/// the memory handed out is the simulation's working copy, and the file is its media.
#[derive(Debug)]
pub struct Mapping {
    inner: Inner,
}

#[derive(Debug)]
enum Inner {
    /// The backing store itself.
    Real(Media),
    /// The power-loss simulation over it.
    Simulated(Simulated),
}

impl Mapping {
    pub(super) fn real(media: Media) -> Mapping {
        Mapping {
            inner: Inner::Real(media),
        }
    }

    pub(super) fn simulated(s: Simulated) -> Mapping {
        Mapping {
            inner: Inner::Simulated(s),
        }
    }

    /// Maps `len` bytes of private anonymous memory: [`Domain::Volatile`], for buffers and tests.
    ///
    /// Errors: [`Error::Map`] when `len` is 0 or the kernel refuses.
    pub fn anonymous(len: usize) -> Result<Mapping> {
        Ok(Mapping::real(Media::anonymous(len)?))
    }

    /// The mapping of the backing store (under the simulation: the media's).
    fn media(&self) -> &Media {
        match &self.inner {
            Inner::Real(m) => m,
            Inner::Simulated(s) => s.media(),
        }
    }

    /// The first byte of the mapping (under the power-loss simulation, of its working copy).
    pub fn as_ptr(&self) -> *mut u8 {
        match &self.inner {
            Inner::Real(m) => m.ptr(),
            Inner::Simulated(s) => s.working_ptr(),
        }
    }

    /// The power-loss simulation's settings, when it is on.
    pub fn simulation(&self) -> Option<Simulation> {
        match &self.inner {
            Inner::Real(_) => None,
            Inner::Simulated(s) => Some(s.settings()),
        }
    }

    /// What the power-loss simulation did so far, when it is on.
    pub fn simulation_stats(&self) -> Option<SimStats> {
        match &self.inner {
            Inner::Real(_) => None,
            Inner::Simulated(s) => Some(s.stats()),
        }
    }

    /// The domain as every interface shows it: "page-cache", or under the power-loss
    /// simulation "page-cache, power-loss simulation (test only)".
    pub fn domain_label(&self) -> String {
        match self.simulation() {
            Some(s) => format!("{}, {}", self.domain(), s.label()),
            None => self.domain().to_string(),
        }
    }

    /// Simulates a power loss (tests): the mapping is dropped without the clean close's
    /// write-back, so only what reached the media survives, and the next open of the file in
    /// this process starts from the media. Every other mapping of the same file in this
    /// process loses its cache with it. Without the simulation it is a plain drop.
    pub fn simulate_power_loss(self) {
        if let Inner::Simulated(s) = &self.inner {
            s.lose_power();
        }
    }

    /// Length of the mapping in bytes (the namespace size).
    pub fn len(&self) -> usize {
        self.media().len()
    }

    /// Always false: a mapping is never empty.
    pub fn is_empty(&self) -> bool {
        self.media().is_empty()
    }

    /// The persistence domain every interface reports ([`Domain::DaxForced`] when forced).
    pub fn domain(&self) -> Domain {
        self.media().domain()
    }

    /// The domain the probe found, before any `force_dax` override.
    pub fn probed_domain(&self) -> Domain {
        self.media().probed_domain()
    }

    /// Maps every page of the mapping in, writable, ahead of use (`madvise(MADV_POPULATE_WRITE)`,
    /// Linux 5.14): the first Write to each page then takes no page fault. On dax and tmpfs
    /// memory that fault is most of the cost of a first write: a first pass over a fresh /dev/shm
    /// namespace ran at about half the speed of the next. Not for page-cache files: on those it
    /// would read the whole file in. Costs the page tables (about 2 MiB per GiB with 4 KiB
    /// pages) and, on a tmpfs file that was not allocated, the memory.
    ///
    /// Errors: [`Error::Io`] when the kernel refuses (`EINVAL` before 5.14); the mapping is
    /// usable as before.
    pub fn prefault(&self) -> Result<()> {
        // SAFETY: the range is exactly the live memory this mapping hands out (the file's
        // mapping, or the simulation's working copy); MADV_POPULATE_WRITE only faults its pages
        // in (writable) and changes no byte of them.
        let r =
            unsafe { libc::madvise(self.as_ptr().cast(), self.len(), libc::MADV_POPULATE_WRITE) };
        if r != 0 {
            return Err(Error::Io {
                path: self.path().map(Path::to_path_buf).unwrap_or_default(),
                op: "madvise(MADV_POPULATE_WRITE)",
                source: io::Error::last_os_error(),
            });
        }
        Ok(())
    }

    /// Whether the kernel accepted MAP_SYNC for this mapping (page faults then never leave
    /// filesystem metadata behind the data: the dax guarantee for fsdax files).
    pub fn map_sync(&self) -> bool {
        self.media().map_sync()
    }

    /// The backing file or device (None for anonymous memory).
    pub fn path(&self) -> Option<&Path> {
        self.media().path()
    }

    /// The file descriptor of the backing file (None for anonymous), so that the target can
    /// fdatasync it through io_uring. It stays open as long as the mapping.
    pub fn backing_fd(&self) -> Option<BorrowedFd<'_>> {
        self.media().backing_fd()
    }

    /// Sets what is called with the mapping's first write-back failure, in the thread that
    /// recorded it and before that call returns (so before any caller can report the failure
    /// onwards): the target remembers failures across restarts there. Only the first hook set
    /// is kept (returns false for any later one); a failure recorded before the hook was set
    /// is not replayed to it.
    pub fn set_failure_hook(&self, hook: FailureHook) -> bool {
        self.media().set_failure_hook(hook)
    }

    /// Makes the backing file's page cache show what its media holds: writes back what is
    /// dirty (`fdatasync`), takes this mapping's own pages out of its page tables
    /// (`madvise(MADV_DONTNEED)`, which for a shared file mapping discards nothing but the
    /// mapping of the pages), then drops every clean page of the file from the page cache
    /// (`posix_fadvise(POSIX_FADV_DONTNEED)` of the whole file). The next access reads the
    /// media. Why: after a failed write-back Linux marks the pages it could not write clean,
    /// and they would otherwise be served, and synced "successfully", as if they were on the
    /// media (docs/persistence.md, "A failed write-back is not forgotten").
    ///
    /// The kernel keeps pages that another mapping (in any process) still maps or that are
    /// dirty again; a store into the mapping racing this call may fault a page back in. A
    /// no-op for anonymous memory and devdax; the power-loss simulation's working copy is
    /// not the page cache and is left alone.
    ///
    /// Errors: [`Error::Sync`] when fdatasync fails (the clean pages are dropped anyway, and
    /// the failure is recorded as for any sync), [`Error::Io`] when madvise or fadvise do.
    pub fn drop_page_cache(&self) -> Result<()> {
        self.media().drop_page_cache()
    }

    /// For placing `len` bytes at `offset` (a peer's Write, by a transport that copies
    /// received payloads itself): the backing file to write them into with `pwrite(2)` at that
    /// offset, or None to store them into the mapping. A `pwrite` is the same as a store for
    /// every reader of the mapping and for [`Persist`] only on a `page-cache` mapping (the
    /// file's own page cache, from offset 0), not under the power-loss simulation (whose memory
    /// is a working copy): None elsewhere (on dax a placed byte must also leave the CPU cache,
    /// which a `pwrite` does not promise). On page-cache, the file when one of the pages the
    /// range touches was not placed into since its last write-back started, None when all
    /// were (a store into a page that is dirty and writable here costs only the copy; into a
    /// page a write-back cleaned, a write fault): each call marks the range placed, and a
    /// persist, flush or [`Persist::before_sync`] of a range forgets its pages.
    pub fn placement_file(&self, offset: usize, len: usize) -> Option<BorrowedFd<'_>> {
        match &self.inner {
            Inner::Real(m) => m.placement_file(offset, len),
            Inner::Simulated(_) => None,
        }
    }

    /// The whole mapping as a view for copies and iovecs.
    fn volatile(&self) -> VolatileSlice<'_> {
        // SAFETY: the mapping is valid for reads and writes of `len` bytes until Drop, which the
        // borrow of self outlasts, and this type never hands out a reference to its bytes.
        unsafe { VolatileSlice::new(self.as_ptr(), self.len()) }
    }

    /// Copies `data` into the mapping at `offset`. Not durable until persisted. Others reading
    /// the range meanwhile may see a mix of old and new bytes.
    ///
    /// Errors: [`Error::OutOfRange`]; [`Error::Unreadable`] when a page of the mapping could
    /// not be written (or read) since it was opened (SIGBUS: the bytes went to a page that is
    /// not the file's, and the namespace has failed).
    pub fn write_at(&self, offset: usize, data: &[u8]) -> Result<()> {
        self.volatile()
            .write_at(offset, data)
            .map_err(|_| self.media().out_of_range(offset, data.len()))?;
        self.check_readable()
    }

    /// Copies bytes at `offset` out of the mapping into `buf`. Bytes written meanwhile by others
    /// (a peer's Write being placed) may come out torn.
    ///
    /// Errors: [`Error::OutOfRange`]; [`Error::Unreadable`] when a page of the mapping could
    /// not be read (or written) since it was opened: a media error, poisoned pmem or the file
    /// truncated by another process is a SIGBUS, which the pmem layer takes instead of the
    /// process (the page is replaced by zeros, `buf` may hold some of them, and the namespace
    /// has failed: docs/persistence.md).
    pub fn read_at(&self, offset: usize, buf: &mut [u8]) -> Result<()> {
        self.volatile()
            .read_at(offset, buf)
            .map_err(|_| self.media().out_of_range(offset, buf.len()))?;
        self.check_readable()
    }

    /// The offset of the first page the kernel could not give back (SIGBUS) since the mapping
    /// was made, if any: from then on its bytes are not the file's and the mapping has failed
    /// ([`Persist::failure`] says [`SyncFailure::unreadable`]). Always None under the
    /// power-loss simulation, whose memory is a working copy.
    pub fn unreadable_at(&self) -> Option<usize> {
        match &self.inner {
            Inner::Real(m) => m.unreadable_at(),
            Inner::Simulated(_) => None,
        }
    }

    /// [`unreadable_at`](Self::unreadable_at), having recorded the failure (calling the
    /// failure hook) if nothing failed the mapping before: what a caller that learns of it
    /// outside a copy or a persist calls. A load or two.
    pub fn fail_if_unreadable(&self) -> Option<usize> {
        match &self.inner {
            Inner::Real(m) => m.note_unreadable(),
            Inner::Simulated(_) => None,
        }
    }

    /// Whether the backing file is shorter than the mapping now (truncated by another
    /// process): if so the mapping fails as for a page that faulted at the file's end (see
    /// [`unreadable_at`](Self::unreadable_at)), and this returns that end. One `fstat`: the
    /// page-cache syncs call it themselves; the target calls it every second.
    pub fn check_size(&self) -> Option<usize> {
        match &self.inner {
            Inner::Real(m) => m.check_size(),
            Inner::Simulated(_) => None,
        }
    }

    fn check_readable(&self) -> Result<()> {
        match &self.inner {
            Inner::Real(m) => m.check_readable(),
            Inner::Simulated(_) => Ok(()),
        }
    }
}

/// `$e` for whichever store is behind the mapping: both implement [`Persist`].
macro_rules! each {
    ($self:expr, $p:ident => $e:expr) => {
        match &$self.inner {
            Inner::Real($p) => $e,
            Inner::Simulated($p) => $e,
        }
    };
}

impl Persist for Mapping {
    fn domain(&self) -> Domain {
        each!(self, p => p.domain())
    }
    fn persist(&self, offset: usize, len: usize) -> Result<Durability> {
        each!(self, p => p.persist(offset, len))
    }
    fn flush(&self, offset: usize, len: usize) -> Result<()> {
        each!(self, p => p.flush(offset, len))
    }
    fn drain(&self) -> Result<Durability> {
        each!(self, p => p.drain())
    }
    fn failure(&self) -> Option<SyncFailure> {
        each!(self, p => p.failure())
    }
    fn record_failure(&self, failure: SyncFailure) -> bool {
        each!(self, p => p.record_failure(failure))
    }
    fn before_sync(&self, offset: usize, len: usize) -> Result<()> {
        each!(self, p => p.before_sync(offset, len))
    }
    fn after_sync(&self, offset: usize, len: usize) -> Result<()> {
        each!(self, p => p.after_sync(offset, len))
    }
    fn durable_by_writeback(&self) -> bool {
        each!(self, p => p.durable_by_writeback())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;
    use crate::pmem::media::page_size;
    use crate::pmem::OpenOptions;

    /// Minor page faults of the calling thread so far.
    fn thread_minor_faults() -> i64 {
        // SAFETY: getrusage writes one plain struct, zero-initialisable, that outlives the call.
        unsafe {
            let mut ru: libc::rusage = std::mem::zeroed();
            assert_eq!(libc::getrusage(libc::RUSAGE_THREAD, &mut ru), 0);
            ru.ru_minflt
        }
    }

    /// Writes one byte in every page; returns this thread's minor faults meanwhile.
    fn faults_touching(m: &Mapping) -> i64 {
        let before = thread_minor_faults();
        for off in (0..m.len()).step_by(page_size()) {
            m.write_at(off, &[1]).unwrap();
        }
        thread_minor_faults() - before
    }

    #[test]
    fn prefault_maps_every_page_in_ahead_of_the_first_write() {
        let d = tempfile::tempdir_in("/dev/shm").unwrap();
        let pages = 512;
        let open = |name: &str| {
            OpenOptions::new(d.path().join(name))
                .size((pages * page_size()) as u64)
                .create(true)
                .force_dax(true)
                .open()
                .unwrap()
        };
        // Without it, the first write to each page faults (the control: it can fail).
        let cold = open("cold");
        assert!(faults_touching(&cold) >= pages as i64 / 2);
        let warm = open("warm");
        warm.prefault().unwrap();
        let f = faults_touching(&warm);
        assert!(f < pages as i64 / 16, "{f} faults after prefault");
    }

    #[test]
    fn a_recorded_failure_fails_every_later_persist_until_reopened() {
        let d = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        let path = d.path().join("ns");
        let open = || {
            OpenOptions::new(&path)
                .size(1 << 16)
                .create(true)
                .open()
                .unwrap()
        };
        let m = open();
        assert_eq!(m.domain(), Domain::PageCache);
        assert_eq!(m.persist(0, 4096).unwrap(), Durability::Durable);
        assert_eq!(m.failure(), None);
        let eio = SyncFailure::new("fdatasync", &io::Error::from_raw_os_error(libc::EIO));
        assert!(m.record_failure(eio), "the first failure");
        let enospc = SyncFailure::new("msync", &io::Error::from_raw_os_error(libc::ENOSPC));
        assert!(!m.record_failure(enospc), "a second one changes nothing");
        assert_eq!(m.failure(), Some(eio));
        for e in [
            m.persist(0, 4096).unwrap_err(),
            m.persist(8192, 0).unwrap_err(),
            m.flush(0, 4096).unwrap_err(),
            m.drain().unwrap_err(),
        ] {
            assert!(
                matches!(e, Error::Failed { failure, .. } if failure == eio),
                "{e:?}"
            );
            let t = e.to_string();
            assert!(
                t.contains("fdatasync failed: Input/output error") && t.contains("reopened"),
                "{t}"
            );
        }
        // A bad range is still reported as such.
        assert!(matches!(
            m.persist(1 << 20, 1).unwrap_err(),
            Error::OutOfRange { .. }
        ));
        drop(m);
        let m = open();
        assert_eq!(m.failure(), None, "reopening clears it");
        assert_eq!(m.persist(0, 4096).unwrap(), Durability::Durable);
    }

    /// Cuts the file at `path` to `len` bytes, as another process could behind a mapping.
    fn cut(path: &std::path::Path, len: u64) {
        std::fs::OpenOptions::new()
            .write(true)
            .open(path)
            .unwrap()
            .set_len(len)
            .unwrap();
    }

    #[test]
    fn a_page_truncated_behind_the_mapping_fails_it_instead_of_killing_the_process() {
        for dax in [false, true] {
            let d = if dax {
                tempfile::tempdir_in("/dev/shm").unwrap()
            } else {
                tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap()
            };
            let path = d.path().join("ns");
            let p = page_size();
            let m = OpenOptions::new(&path)
                .size(8 * p as u64)
                .create(true)
                .force_dax(dax)
                .open()
                .unwrap();
            let seen = Arc::new(Mutex::new(Vec::new()));
            let s2 = Arc::clone(&seen);
            assert!(m.set_failure_hook(Box::new(move |f| s2.lock().unwrap().push(*f))));
            m.write_at(0, &[0x5a; 100]).unwrap();
            m.write_at(6 * p, &[0x5a; 100]).unwrap();
            assert!(m.persist(0, 8 * p).is_ok());
            // Another process (here: another descriptor) cuts the file to four pages.
            cut(&path, 4 * p as u64);
            let mut b = [0u8; 100];
            m.read_at(0, &mut b).unwrap();
            assert_eq!(b, [0x5a; 100], "dax {dax}: a page still in the file reads");
            assert_eq!(m.failure(), None);
            // A SIGBUS without the pmem layer's handler: the test process would end here.
            let e = m.read_at(6 * p + 10, &mut b).unwrap_err();
            assert!(
                matches!(e, Error::Unreadable { offset, .. } if offset == 6 * p + 10),
                "dax {dax}: {e:?}"
            );
            assert!(e.to_string().contains("truncated"), "{e}");
            assert_eq!(m.unreadable_at(), Some(6 * p + 10));
            assert_eq!(m.failure(), Some(SyncFailure::unreadable()));
            assert_eq!(
                *seen.lock().unwrap(),
                [SyncFailure::unreadable()],
                "dax {dax}"
            );
            // From then on nothing of it reads, writes or persists, the pages still in the
            // file included.
            assert!(matches!(
                m.read_at(0, &mut b),
                Err(Error::Unreadable { .. })
            ));
            assert!(matches!(
                m.write_at(7 * p, &b),
                Err(Error::Unreadable { .. })
            ));
            assert!(matches!(m.persist(0, p), Err(Error::Failed { .. })));
            assert_eq!(m.fail_if_unreadable(), Some(6 * p + 10));
            assert_eq!(seen.lock().unwrap().len(), 1, "dax {dax}: recorded once");
        }
    }

    #[test]
    fn a_dax_persist_whose_write_back_met_a_truncated_page_is_not_durable() {
        let d = tempfile::tempdir_in("/dev/shm").unwrap();
        let path = d.path().join("ns");
        let p = page_size();
        for how in ["persist", "flush"] {
            let m = OpenOptions::new(&path)
                .size(8 * p as u64)
                .create(true)
                .resize(crate::pmem::Resize::Grow)
                .force_dax(true)
                .open()
                .unwrap();
            m.write_at(6 * p, &[0x5a; 100]).unwrap();
            cut(&path, 4 * p as u64);
            // The cache write-back is the first touch of the page since the truncation.
            let r = match how {
                "persist" => m.persist(6 * p, 100).map(|_| ()),
                _ => m.flush(6 * p, 100),
            };
            assert!(matches!(r, Err(Error::Failed { .. })), "{how}: {r:?}");
            assert_eq!(m.unreadable_at(), Some(6 * p), "{how}");
            drop(m);
            std::fs::remove_file(&path).unwrap();
        }
    }

    #[test]
    fn a_sync_over_a_file_cut_short_is_not_durable() {
        let p = page_size();
        for how in ["persist", "flush+drain", "before_sync"] {
            let d = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
            let path = d.path().join("ns");
            let m = OpenOptions::new(&path)
                .size(8 * p as u64)
                .create(true)
                .open()
                .unwrap();
            assert_eq!(m.domain(), Domain::PageCache);
            m.write_at(0, &[0x5a; 100]).unwrap();
            m.persist(0, 8 * p).unwrap();
            cut(&path, 2 * p as u64);
            // The transport's placement of a Write after the sync: a pwrite into the file,
            // which grows it back to 7 pages with a hole between; no page of the mapping faults.
            let fd = m
                .placement_file(6 * p, 100)
                .expect("placed by pwrite after a sync");
            let n = nix::sys::uio::pwrite(fd, &[7u8; 100], (6 * p) as i64).unwrap();
            assert_eq!(n, 100);
            let r = match how {
                "persist" => m.persist(6 * p, 100).map(|_| ()),
                "flush+drain" => m.flush(6 * p, 100).and_then(|()| m.drain().map(|_| ())),
                _ => m.before_sync(6 * p, 100),
            };
            assert!(matches!(r, Err(Error::Failed { .. })), "{how}: {r:?}");
            assert_eq!(m.failure(), Some(SyncFailure::unreadable()), "{how}");
            // Where the file ends now (the pwrite grew it back to 6 pages and 100 bytes).
            assert_eq!(m.unreadable_at(), Some(6 * p + 100), "{how}");
        }
    }

    #[test]
    fn the_failure_hook_sees_the_first_failure_before_the_call_returns() {
        let d = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        let m = OpenOptions::new(d.path().join("ns"))
            .size(1 << 16)
            .create(true)
            .open()
            .unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s2 = Arc::clone(&seen);
        assert!(m.set_failure_hook(Box::new(move |f| s2.lock().unwrap().push(*f))));
        assert!(!m.set_failure_hook(Box::new(|_| {})), "one hook");
        let eio = SyncFailure::new("fdatasync", &io::Error::from_raw_os_error(libc::EIO));
        m.record_failure(eio);
        assert_eq!(
            *seen.lock().unwrap(),
            [eio],
            "called before record_failure returned"
        );
        m.record_failure(SyncFailure::new("msync", &io::Error::from_raw_os_error(5)));
        assert_eq!(seen.lock().unwrap().len(), 1, "only the first");
    }

    #[test]
    fn a_page_cache_range_is_pwritten_first_and_stored_into_until_its_next_write_back() {
        let d = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        let p = page_size();
        let open = |name: &str, dax: bool, sim: bool| {
            OpenOptions::new(d.path().join(name))
                .size((16 * p) as u64)
                .create(true)
                .force_dax(dax)
                .power_loss_simulation(sim.then(Default::default))
                .open()
                .unwrap()
        };
        let m = open("ns", false, false);
        assert_eq!(m.domain(), Domain::PageCache);
        let file = |off, len| m.placement_file(off, len).is_some();
        // Each way a range is written back forgets its pages (and only those).
        let write_backs: [(&str, &dyn Fn()); 4] = [
            ("persist", &|| assert!(m.persist(p + 1, 10).is_ok())),
            ("flush", &|| m.flush(p + 1, 10).unwrap()),
            ("before_sync", &|| m.before_sync(p + 1, 10).unwrap()),
            ("drop_page_cache", &|| m.drop_page_cache().unwrap()),
        ];
        for (name, write_back) in write_backs {
            assert!(file(p, 2 * p), "{name}: the first placement is a pwrite");
            assert!(!file(p + 100, 200), "{name}: the second a store");
            assert!(!file(2 * p, p), "{name}: so is one into the other page");
            assert!(
                file(2 * p, p + 1),
                "{name}: a range reaching an unplaced page"
            );
            write_back();
            assert!(file(p, p), "{name}: written back, a pwrite again");
            assert!(!file(p, p));
            m.drain().unwrap();
            m.persist(0, 16 * p).unwrap();
        }
        // Nowhere else is there a file to place into.
        for (name, dax, sim) in [("dax", true, false), ("sim", false, true)] {
            let o = open(name, dax, sim);
            assert!(o.placement_file(0, p).is_none(), "{name}");
            assert!(o.placement_file(0, p).is_none(), "{name}");
        }
        assert!(Mapping::anonymous(p)
            .unwrap()
            .placement_file(0, 1)
            .is_none());
    }

    /// Pages of `m` resident in the page cache (mincore).
    fn resident(m: &Mapping) -> usize {
        let pages = m.len().div_ceil(page_size());
        let mut v = vec![0u8; pages];
        // SAFETY: ptr/len are the live file mapping; mincore writes one byte per page into v.
        let rc = unsafe { libc::mincore(m.as_ptr().cast(), m.len(), v.as_mut_ptr()) };
        assert_eq!(rc, 0);
        v.iter().filter(|&&b| b & 1 != 0).count()
    }

    #[test]
    fn dropping_the_page_cache_keeps_the_bytes_and_empties_the_cache() {
        let d = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        let path = d.path().join("ns");
        let m = OpenOptions::new(&path)
            .size(1 << 20)
            .create(true)
            .open()
            .unwrap();
        if m.domain() != Domain::PageCache {
            eprintln!("SKIPPED: {} is not page-cache here", path.display());
            return;
        }
        m.write_at(4096, b"on the media").unwrap();
        assert!(resident(&m) > 0);
        m.drop_page_cache().unwrap();
        assert_eq!(resident(&m), 0, "nothing left cached");
        let mut back = [0u8; 12];
        m.read_at(4096, &mut back).unwrap();
        assert_eq!(
            &back, b"on the media",
            "written back first, then read from the file"
        );
        // Anonymous memory has no page cache: nothing happens to it.
        let a = Mapping::anonymous(4096).unwrap();
        a.write_at(0, b"kept").unwrap();
        a.drop_page_cache().unwrap();
        let mut k = [0u8; 4];
        a.read_at(0, &mut k).unwrap();
        assert_eq!(&k, b"kept");
    }
}
