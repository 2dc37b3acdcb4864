//! The mapping of a backing store ([`Mapping`], opened by open.rs or anonymous) and its
//! persistence: the [`Persist`] implementation (cache write-back, msync or nothing, by domain)
//! and the failure a write-back leaves behind.

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, OnceLock};

use super::domain::{Domain, Durability, SyncFailure};
use super::error::{Error, Result};
use super::flush::{sfence, writeback_range};
use super::sim::{Sim, SimStats, Simulation};
use super::Persist;

/// What [`Mapping::set_failure_hook`] takes.
pub type FailureHook = Box<dyn Fn(&SyncFailure) + Send + Sync>;

/// How persist/flush/drain make a range durable, decided once at open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Method {
    /// clwb/clflushopt/clflush + sfence.
    CacheWriteBack,
    /// msync(MS_SYNC) of the page-aligned range (sync_file_range to start it).
    Msync,
    /// Volatile memory: nothing can make it durable.
    Nothing,
}

/// A shared mapping of a namespace's backing store (or anonymous memory), with the persistence
/// domain probed when it was opened. Dropping it unmaps the memory and closes the file.
///
/// The mapping hands out raw pointers, never references: the bytes may be changed at any time
/// by other processes sharing the file, by a NIC, or by the fabric placing a peer's Write from
/// another thread. Readers and writers coordinate through the protocol above this layer;
/// [`Mapping::read_at`]/[`Mapping::write_at`] are copies through a
/// [`VolatileSlice`](crate::volatile::VolatileSlice), sound under such concurrent access
/// (racing bytes may come out torn).
///
/// Under the power-loss simulation ([`OpenOptions::power_loss_simulation`](super::OpenOptions::power_loss_simulation),
/// sim.rs) the memory handed out is the simulation's working copy, and the file is its media.
pub struct Mapping {
    /// The mapping of the backing file (or anonymous memory).
    ptr: NonNull<u8>,
    len: usize,
    domain: Domain,
    probed: Domain,
    method: Method,
    map_sync: bool,
    file: Option<File>,
    path: Option<PathBuf>,
    /// Page-aligned union of the ranges flushed (write-back started) but not yet drained.
    pending: Mutex<Option<(usize, usize)>>,
    /// The first failed write-back: set once, cleared only by reopening (a new Mapping).
    failure: OnceLock<SyncFailure>,
    /// Called once, with the first failure, before the call that recorded it returns
    /// ([`Mapping::set_failure_hook`]).
    on_failure: OnceLock<FailureHook>,
    /// The power-loss simulation, when on: the working copy the process sees.
    sim: Option<Arc<Sim>>,
}

// SAFETY: Mapping owns its mapping (unmapped only in Drop) and exposes the memory only through raw
// pointers and copy methods, the same as a shared file seen by several processes; the only interior
// state (`pending`, `failure`) is behind a Mutex or a OnceLock.
unsafe impl Send for Mapping {}
// SAFETY: as above: every &self method is either read-only on plain fields, a raw-memory copy whose
// coordination is the caller's protocol, or goes through the Mutex.
unsafe impl Sync for Mapping {}

impl std::fmt::Debug for Mapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mapping")
            .field("path", &self.path)
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .field("domain", &self.domain)
            .field("probed", &self.probed)
            .field("map_sync", &self.map_sync)
            .field("sim", &self.sim)
            .finish()
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: ptr/len are exactly the region this Mapping mapped and still owns; nothing
        // borrows from it past the Mapping's lifetime (only raw pointers, whose use is the
        // caller's contract).
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

fn page_size() -> usize {
    static PAGE: OnceLock<usize> = OnceLock::new();
    // SAFETY: sysconf has no memory-safety preconditions.
    *PAGE.get_or_init(|| match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
        n if n > 0 => n as usize,
        _ => 4096,
    })
}

impl Mapping {
    /// A mapping of `len` bytes of `file` (at `path`) at `ptr`, which it owns from now on (and
    /// unmaps when dropped), in `domain` (`probed` is what the probe found, `map_sync` whether
    /// the kernel accepted MAP_SYNC): the persist method follows from the domain. With `sim`,
    /// the memory handed out is the simulation's working copy.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn of_file(
        file: File,
        path: PathBuf,
        ptr: NonNull<u8>,
        len: usize,
        domain: Domain,
        probed: Domain,
        map_sync: bool,
        sim: Option<Arc<Sim>>,
    ) -> Mapping {
        let method = match domain {
            Domain::Volatile => Method::Nothing,
            Domain::PageCache => Method::Msync,
            // Off x86-64 there is no cache write-back here: the kernel's msync does it for fsdax.
            _ if cfg!(target_arch = "x86_64") => Method::CacheWriteBack,
            _ => Method::Msync,
        };
        Mapping {
            ptr,
            len,
            domain,
            probed,
            method,
            map_sync,
            file: Some(file),
            path: Some(path),
            pending: Mutex::new(None),
            failure: OnceLock::new(),
            on_failure: OnceLock::new(),
            sim,
        }
    }

    /// Maps `len` bytes of private anonymous memory: [`Domain::Volatile`], for buffers and tests.
    ///
    /// Errors: [`Error::Map`] when `len` is 0 or the kernel refuses.
    pub fn anonymous(len: usize) -> Result<Mapping> {
        let map_err = |source| Error::Map {
            path: None,
            len,
            source,
        };
        if len == 0 {
            return Err(map_err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "length is 0",
            )));
        }
        // SAFETY: a fresh anonymous mapping chosen by the kernel aliases no existing memory.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(map_err(io::Error::last_os_error()));
        }
        Ok(Mapping {
            ptr: NonNull::new(p.cast()).ok_or_else(|| map_err(io::Error::other("mmap gave 0")))?,
            len,
            domain: Domain::Volatile,
            probed: Domain::Volatile,
            method: Method::Nothing,
            map_sync: false,
            file: None,
            path: None,
            pending: Mutex::new(None),
            failure: OnceLock::new(),
            on_failure: OnceLock::new(),
            sim: None,
        })
    }

    /// The first byte of the mapping (under the power-loss simulation, of its working copy).
    pub fn as_ptr(&self) -> *mut u8 {
        match &self.sim {
            Some(sim) => sim.working_ptr(),
            None => self.ptr.as_ptr(),
        }
    }

    /// The power-loss simulation's settings, when it is on.
    pub fn simulation(&self) -> Option<Simulation> {
        self.sim.as_ref().map(|s| s.options())
    }

    /// What the power-loss simulation did so far, when it is on.
    pub fn simulation_stats(&self) -> Option<SimStats> {
        self.sim.as_ref().map(|s| s.stats())
    }

    /// The domain as every interface shows it: "page-cache", or under the power-loss
    /// simulation "page-cache, power-loss simulation (test only)".
    pub fn domain_label(&self) -> String {
        match self.simulation() {
            Some(s) => format!("{}, {}", self.domain, s.label()),
            None => self.domain.to_string(),
        }
    }

    /// Simulates a power loss (tests): the mapping is dropped without the clean close's
    /// write-back, so only what reached the media survives, and the next open of the file in
    /// this process starts from the media. Every other mapping of the same file in this
    /// process loses its cache with it. Without the simulation it is a plain drop.
    pub fn simulate_power_loss(self) {
        if let Some(sim) = &self.sim {
            sim.lose_power();
        }
    }

    /// Length of the mapping in bytes (the namespace size).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: a mapping is never empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The persistence domain every interface reports ([`Domain::DaxForced`] when forced).
    pub fn domain(&self) -> Domain {
        self.domain
    }

    /// The domain the probe found, before any `force_dax` override.
    pub fn probed_domain(&self) -> Domain {
        self.probed
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
        let r = unsafe { libc::madvise(self.as_ptr().cast(), self.len, libc::MADV_POPULATE_WRITE) };
        if r != 0 {
            return Err(Error::Io {
                path: self.path.clone().unwrap_or_default(),
                op: "madvise(MADV_POPULATE_WRITE)",
                source: io::Error::last_os_error(),
            });
        }
        Ok(())
    }

    /// Whether the kernel accepted MAP_SYNC for this mapping (page faults then never leave
    /// filesystem metadata behind the data: the dax guarantee for fsdax files).
    pub fn map_sync(&self) -> bool {
        self.map_sync
    }

    /// The backing file or device (None for anonymous memory).
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// The file descriptor of the backing file (None for anonymous), so that the target can
    /// fdatasync it through io_uring. It stays open as long as the mapping.
    pub fn backing_fd(&self) -> Option<BorrowedFd<'_>> {
        self.file.as_ref().map(|f| f.as_fd())
    }

    /// Sets what is called with the mapping's first write-back failure, in the thread that
    /// recorded it and before that call returns (so before any caller can report the failure
    /// onwards): the target remembers failures across restarts there. Only the first hook set
    /// is kept (returns false for any later one); a failure recorded before the hook was set
    /// is not replayed to it.
    pub fn set_failure_hook(&self, hook: FailureHook) -> bool {
        self.on_failure.set(hook).is_ok()
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
        let Some(file) = &self.file else {
            return Ok(());
        };
        if !file.metadata().map(|m| m.is_file()).unwrap_or(false) {
            return Ok(());
        }
        let io_err = |op, source| Error::Io {
            path: self.path.clone().unwrap_or_default(),
            op,
            source,
        };
        let synced = file.sync_data().map_err(|e| {
            self.record_failure(SyncFailure::new("fdatasync", &e));
            self.sync_error("fdatasync", 0, self.len, e)
        });
        // SAFETY: ptr/len are exactly this Mapping's shared file mapping (never the anonymous
        // memory of `Mapping::anonymous`: that has no file). MADV_DONTNEED on a MAP_SHARED file
        // mapping only drops page table entries: the bytes stay in the file and the page cache,
        // and the next access faults them back in from there. No reference into the range
        // exists (the type hands out raw pointers only).
        if unsafe { libc::madvise(self.ptr.as_ptr().cast(), self.len, libc::MADV_DONTNEED) } != 0 {
            return Err(io_err("madvise(MADV_DONTNEED)", io::Error::last_os_error()));
        }
        // SAFETY: posix_fadvise only reads the descriptor and the integer arguments.
        let rc = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        if rc != 0 {
            return Err(io_err(
                "posix_fadvise(POSIX_FADV_DONTNEED)",
                io::Error::from_raw_os_error(rc),
            ));
        }
        synced
    }

    /// The backing file, where writing into it with `pwrite(2)` at an offset is the same as a
    /// store into the mapping at that offset, for every reader of the mapping and for
    /// [`Persist`]: a `page-cache` mapping (the file's own page cache, from offset 0), not
    /// under the power-loss simulation (whose memory is a working copy). None elsewhere: on dax
    /// a placed byte must also leave the CPU cache, which a `pwrite` does not promise.
    pub fn placement_file(&self) -> Option<BorrowedFd<'_>> {
        if self.domain == Domain::PageCache && self.sim.is_none() {
            self.backing_fd()
        } else {
            None
        }
    }

    /// The whole mapping as a view for copies and iovecs.
    fn volatile(&self) -> crate::volatile::VolatileSlice<'_> {
        // SAFETY: the mapping is valid for reads and writes of `len` bytes until Drop, which the
        // borrow of self outlasts, and this type never hands out a reference to its bytes.
        unsafe { crate::volatile::VolatileSlice::new(self.as_ptr(), self.len) }
    }

    /// Copies `data` into the mapping at `offset`. Not durable until persisted. Others reading
    /// the range meanwhile may see a mix of old and new bytes.
    ///
    /// Errors: [`Error::OutOfRange`].
    pub fn write_at(&self, offset: usize, data: &[u8]) -> Result<()> {
        self.volatile()
            .write_at(offset, data)
            .map_err(|_| self.out_of_range(offset, data.len()))
    }

    /// Copies bytes at `offset` out of the mapping into `buf`. Bytes written meanwhile by others
    /// (a peer's Write being placed) may come out torn.
    ///
    /// Errors: [`Error::OutOfRange`].
    pub fn read_at(&self, offset: usize, buf: &mut [u8]) -> Result<()> {
        self.volatile()
            .read_at(offset, buf)
            .map_err(|_| self.out_of_range(offset, buf.len()))
    }

    fn out_of_range(&self, offset: usize, len: usize) -> Error {
        Error::OutOfRange {
            offset,
            len,
            mapping_len: self.len,
        }
    }

    fn check_range(&self, offset: usize, len: usize) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(Error::OutOfRange {
                offset,
                len,
                mapping_len: self.len,
            }),
        }
    }

    /// The page-aligned range covering [offset, offset+len), clipped to the mapping.
    fn page_range(&self, offset: usize, len: usize) -> (usize, usize) {
        let page = page_size();
        let start = offset & !(page - 1);
        let end = (offset + len).div_ceil(page) * page;
        (start, end.min(self.len.div_ceil(page) * page))
    }

    fn msync(&self, start: usize, end: usize) -> Result<()> {
        // SAFETY: start is page-aligned and [start, end) lies within the pages of the file's
        // mapping.
        let rc = unsafe {
            libc::msync(
                self.ptr.as_ptr().add(start).cast(),
                end - start,
                libc::MS_SYNC,
            )
        };
        if rc != 0 {
            let e = io::Error::last_os_error();
            self.record_failure(SyncFailure::new("msync", &e));
            return Err(self.sync_error("msync", start, end - start, e));
        }
        Ok(())
    }

    /// [`Error::Failed`] once the store has failed: checked before every persist, flush and
    /// drain, because the kernel reports a write-back error only once.
    fn check_healthy(&self) -> Result<()> {
        match self.failure.get() {
            Some(&failure) => Err(Error::Failed {
                path: self.path.clone().unwrap_or_default(),
                failure,
            }),
            None => Ok(()),
        }
    }

    fn sync_error(&self, op: &'static str, offset: usize, len: usize, source: io::Error) -> Error {
        Error::Sync {
            path: self.path.clone().unwrap_or_default(),
            op,
            offset,
            len,
            source,
        }
    }

    /// The simulation's part of a persist, flush, drain or sync (`what` says which): its
    /// copy to the media, whose failure is a failed write-back like any other.
    fn simulated(
        &self,
        offset: usize,
        len: usize,
        what: impl FnOnce(&Sim) -> io::Result<()>,
    ) -> Result<()> {
        let Some(sim) = &self.sim else {
            return Ok(());
        };
        what(sim).map_err(|e| {
            self.record_failure(SyncFailure::new("pwrite", &e));
            self.sync_error(
                "pwrite to the power-loss simulation's media",
                offset,
                len,
                e,
            )
        })
    }

    fn outcome(&self) -> Durability {
        if self.domain.is_durable() {
            Durability::Durable
        } else {
            Durability::VisibleOnly
        }
    }
}

impl Persist for Mapping {
    fn domain(&self) -> Domain {
        self.domain
    }

    fn persist(&self, offset: usize, len: usize) -> Result<Durability> {
        self.check_range(offset, len)?;
        self.check_healthy()?;
        self.simulated(offset, len, |s| s.persist(offset, len))?;
        match self.method {
            Method::Nothing => {}
            Method::CacheWriteBack => {
                // SAFETY: the range is inside the live file mapping (checked above).
                unsafe { writeback_range(self.ptr.as_ptr().add(offset), len) };
                sfence();
            }
            Method::Msync if len > 0 => {
                let (start, end) = self.page_range(offset, len);
                self.msync(start, end)?;
            }
            Method::Msync => {}
        }
        Ok(self.outcome())
    }

    fn flush(&self, offset: usize, len: usize) -> Result<()> {
        self.check_range(offset, len)?;
        self.check_healthy()?;
        self.simulated(offset, len, |s| s.flush(offset, len))?;
        match self.method {
            Method::Nothing => {}
            Method::CacheWriteBack => {
                // SAFETY: the range is inside the live file mapping (checked above).
                unsafe { writeback_range(self.ptr.as_ptr().add(offset), len) };
            }
            Method::Msync if len > 0 => {
                let (start, end) = self.page_range(offset, len);
                if let Some(file) = &self.file {
                    // Start write-back now so that drain() has less to wait for. Failure here is
                    // not final: drain()'s msync writes whatever is still dirty and reports its
                    // error.
                    // SAFETY: sync_file_range only reads the descriptor and the integer arguments.
                    unsafe {
                        libc::sync_file_range(
                            file.as_raw_fd(),
                            start as libc::off64_t,
                            (end - start) as libc::off64_t,
                            libc::SYNC_FILE_RANGE_WRITE,
                        )
                    };
                }
                let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
                *pending = Some(match *pending {
                    Some((s, e)) => (s.min(start), e.max(end)),
                    None => (start, end),
                });
            }
            Method::Msync => {}
        }
        Ok(())
    }

    fn drain(&self) -> Result<Durability> {
        self.check_healthy()?;
        self.simulated(0, 0, Sim::drain)?;
        match self.method {
            Method::Nothing => {}
            Method::CacheWriteBack => sfence(),
            Method::Msync => {
                let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
                if let Some((start, end)) = *pending {
                    self.msync(start, end)?;
                    *pending = None;
                }
            }
        }
        Ok(self.outcome())
    }

    fn failure(&self) -> Option<SyncFailure> {
        self.failure.get().copied()
    }

    fn record_failure(&self, failure: SyncFailure) -> bool {
        let first = self.failure.set(failure).is_ok();
        if first {
            if let Some(hook) = self.on_failure.get() {
                hook(&failure);
            }
        }
        first
    }

    fn before_sync(&self, offset: usize, len: usize) -> Result<()> {
        self.check_range(offset, len)?;
        self.check_healthy()?;
        self.simulated(offset, len, |s| s.persist(offset, len))
    }

    fn durable_by_writeback(&self) -> bool {
        self.domain.is_dax() && self.sim.is_none()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pmem::OpenOptions;

    #[test]
    fn page_range_covers_the_range_and_stays_in_the_mapping() {
        let m = Mapping::anonymous(3 * page_size() + 100).unwrap();
        let p = page_size();
        assert_eq!(m.page_range(0, 1), (0, p));
        assert_eq!(m.page_range(p - 1, 2), (0, 2 * p));
        assert_eq!(m.page_range(p, p), (p, 2 * p));
        // The tail of the last, partial page is still one whole page for msync.
        assert_eq!(m.page_range(3 * p + 99, 1), (3 * p, 4 * p));
    }

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

    /// Pages of `m` resident in the page cache (mincore).
    fn resident(m: &Mapping) -> usize {
        let pages = m.len().div_ceil(page_size());
        let mut v = vec![0u8; pages];
        // SAFETY: ptr/len are the live file mapping; mincore writes one byte per page into v.
        let rc = unsafe { libc::mincore(m.ptr.as_ptr().cast(), m.len(), v.as_mut_ptr()) };
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
