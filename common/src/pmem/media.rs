//! The mapping of a backing store as it is ([`Media`], opened by open.rs or anonymous) and its
//! persistence: the [`Persist`] implementation (cache write-back, msync or nothing, by domain)
//! and the failure a write-back leaves behind. The public `Mapping` (map.rs) is one of these,
//! or the power-loss simulation over one (sim.rs).

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::{Mutex, OnceLock};

use super::domain::{Domain, Durability, SyncFailure};
use super::error::{Error, Result};
use super::flush::{sfence, writeback_range};
use super::persist::Persist;
use super::placed::PlacedPages;
use crate::sigbus::Watch;

/// What [`Mapping::set_failure_hook`](super::Mapping::set_failure_hook) takes.
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
/// domain probed when it was opened. Dropping it unmaps the memory and closes the file. It
/// hands out raw pointers only (see [`Mapping`](super::Mapping), which documents the rules for
/// its users).
pub(super) struct Media {
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
    /// Held across an msync and the record of its failure: Linux reports a write-back error
    /// once to each open file, so of two msyncs at once (two poll loops' FLUSHes) one gets it
    /// and the other 0; the second, after the first, then finds the failure recorded.
    syncing: Mutex<()>,
    /// Page-cache files: the pages placed into since their last write-back started, which the
    /// next placement stores into instead of writing with `pwrite` (placed.rs).
    placed: Option<PlacedPages>,
    /// The first failed write-back: set once, cleared only by reopening (a new Mapping).
    failure: OnceLock<SyncFailure>,
    /// Called once, with the first failure, before the call that recorded it returns
    /// ([`Media::set_failure_hook`]).
    on_failure: OnceLock<FailureHook>,
    /// A file mapping's pages that the kernel could not give back (SIGBUS), replaced by
    /// anonymous ones (sigbus.rs); None for anonymous memory, or when no slot was free.
    watch: Option<Watch>,
}

// SAFETY: Media owns its mapping (unmapped only in Drop) and exposes the memory only through raw
// pointers and copy methods, the same as a shared file seen by several processes; the only interior
// state (`pending`, `failure`) is behind a Mutex or a OnceLock.
unsafe impl Send for Media {}
// SAFETY: as above: every &self method is either read-only on plain fields, a raw-memory copy whose
// coordination is the caller's protocol, or goes through the Mutex.
unsafe impl Sync for Media {}

impl std::fmt::Debug for Media {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Media")
            .field("path", &self.path)
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .field("domain", &self.domain)
            .field("probed", &self.probed)
            .field("map_sync", &self.map_sync)
            .finish()
    }
}

impl Drop for Media {
    fn drop(&mut self) {
        // Unwatched first: once unmapped, the range may be reused by anyone.
        self.watch = None;
        // SAFETY: ptr/len are exactly the region this Media mapped and still owns; nothing
        // borrows from it past the Mapping's lifetime (only raw pointers, whose use is the
        // caller's contract).
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

pub(super) fn page_size() -> usize {
    static PAGE: OnceLock<usize> = OnceLock::new();
    // SAFETY: sysconf has no memory-safety preconditions.
    *PAGE.get_or_init(|| match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
        n if n > 0 => n as usize,
        _ => 4096,
    })
}

impl Media {
    /// A mapping of `len` bytes of `file` (at `path`) at `ptr`, which it owns from now on (and
    /// unmaps when dropped), in `domain` (`probed` is what the probe found, `map_sync` whether
    /// the kernel accepted MAP_SYNC): the persist method follows from the domain.
    pub(super) fn of_file(
        file: File,
        path: PathBuf,
        ptr: NonNull<u8>,
        len: usize,
        domain: Domain,
        probed: Domain,
        map_sync: bool,
    ) -> Media {
        let method = match domain {
            Domain::Volatile => Method::Nothing,
            Domain::PageCache => Method::Msync,
            // Off x86-64 there is no cache write-back here: the kernel's msync does it for fsdax.
            _ if cfg!(target_arch = "x86_64") => Method::CacheWriteBack,
            _ => Method::Msync,
        };
        let placed = (domain == Domain::PageCache).then(|| PlacedPages::new(len, page_size()));
        let watch = Watch::new(ptr.as_ptr(), len);
        if watch.is_none() {
            log::warn!(
                "{}: mapped without a SIGBUS guard (more than {} file mappings at once, or the \
                 handler could not be installed): a page the kernel cannot give back takes the \
                 process down",
                path.display(),
                crate::sigbus::SLOTS
            );
        }
        Media {
            ptr,
            len,
            domain,
            probed,
            method,
            map_sync,
            file: Some(file),
            path: Some(path),
            pending: Mutex::new(None),
            syncing: Mutex::new(()),
            placed,
            failure: OnceLock::new(),
            on_failure: OnceLock::new(),
            watch,
        }
    }

    /// Maps `len` bytes of private anonymous memory: [`Domain::Volatile`], for buffers and tests.
    ///
    /// Errors: [`Error::Map`] when `len` is 0 or the kernel refuses.
    pub(super) fn anonymous(len: usize) -> Result<Media> {
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
        Ok(Media {
            ptr: NonNull::new(p.cast()).ok_or_else(|| map_err(io::Error::other("mmap gave 0")))?,
            len,
            domain: Domain::Volatile,
            probed: Domain::Volatile,
            method: Method::Nothing,
            map_sync: false,
            file: None,
            path: None,
            pending: Mutex::new(None),
            syncing: Mutex::new(()),
            placed: None,
            failure: OnceLock::new(),
            on_failure: OnceLock::new(),
            watch: None,
        })
    }

    /// The first byte of the mapping.
    pub(super) fn ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Length of the mapping in bytes (the namespace size).
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// Always false: a mapping is never empty.
    pub(super) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The persistence domain every interface reports ([`Domain::DaxForced`] when forced).
    pub(super) fn domain(&self) -> Domain {
        self.domain
    }

    /// The domain the probe found, before any `force_dax` override.
    pub(super) fn probed_domain(&self) -> Domain {
        self.probed
    }

    /// Whether the kernel accepted MAP_SYNC for this mapping (page faults then never leave
    /// filesystem metadata behind the data: the dax guarantee for fsdax files).
    pub(super) fn map_sync(&self) -> bool {
        self.map_sync
    }

    /// The backing file or device (None for anonymous memory).
    pub(super) fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// The backing file (None for anonymous memory).
    pub(super) fn file(&self) -> Option<&File> {
        self.file.as_ref()
    }

    /// The file descriptor of the backing file (None for anonymous), so that the target can
    /// fdatasync it through io_uring. It stays open as long as the mapping.
    pub(super) fn backing_fd(&self) -> Option<BorrowedFd<'_>> {
        self.file.as_ref().map(|f| f.as_fd())
    }

    /// For placing `len` bytes at `offset` of a page-cache file: the file to `pwrite` them
    /// into when one of the pages they touch was not placed into since its last write-back
    /// (marking them all placed now), None when every one was (a store then takes no fault:
    /// placed.rs). None on every other domain.
    pub(super) fn placement_file(&self, offset: usize, len: usize) -> Option<BorrowedFd<'_>> {
        match &self.placed {
            Some(p) if !p.placed_or_mark(offset, len) => self.backing_fd(),
            _ => None,
        }
    }

    /// The pages of `[offset, offset + len)` are about to be written back: their next
    /// placement is a `pwrite` again.
    fn forget_placed(&self, offset: usize, len: usize) {
        if let Some(p) = &self.placed {
            p.forget(offset, len);
        }
    }

    /// Sets what is called with the mapping's first write-back failure, in the thread that
    /// recorded it and before that call returns (so before any caller can report the failure
    /// onwards): the target remembers failures across restarts there. Only the first hook set
    /// is kept (returns false for any later one); a failure recorded before the hook was set
    /// is not replayed to it.
    pub(super) fn set_failure_hook(&self, hook: FailureHook) -> bool {
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
    pub(super) fn drop_page_cache(&self) -> Result<()> {
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
        if let Some(p) = &self.placed {
            p.forget_all();
        }
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

    pub(super) fn out_of_range(&self, offset: usize, len: usize) -> Error {
        Error::OutOfRange {
            offset,
            len,
            mapping_len: self.len,
        }
    }

    pub(super) fn check_range(&self, offset: usize, len: usize) -> Result<()> {
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
        let _one_at_a_time = self.syncing.lock().unwrap_or_else(|e| e.into_inner());
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
        // A 0 after another sync of this open file took the error report proves nothing; nor
        // does one over a file cut short behind the mapping.
        self.check_size();
        self.check_healthy()
    }

    /// The offset of the first page that the kernel could not give back (SIGBUS), if there was
    /// one, or of the end of a file found shorter than the mapping: the bytes of every page
    /// that faulted are zeros of anonymous memory now, not the file's.
    pub(super) fn unreadable_at(&self) -> Option<usize> {
        self.watch.as_ref()?.first_fault()
    }

    /// Whether the backing file is shorter than the mapping now (another process truncated
    /// it): its bytes from the new end on are gone, and a `pwrite` placement past that end
    /// would grow it back with zeros between, which no fault would ever show. Marks the watch
    /// there as a fault would ([`unreadable_at`](Self::unreadable_at) says where). One
    /// `fstat`: called by the page-cache syncs (msync, and before the flush service's
    /// fdatasync) and by the target every second, not on the dax path.
    pub(super) fn check_size(&self) -> Option<usize> {
        let meta = self.file.as_ref()?.metadata().ok()?;
        // A devdax device has no size to shrink.
        if !meta.file_type().is_file() || meta.len() >= self.len as u64 {
            return None;
        }
        match &self.watch {
            Some(watch) => watch.mark(meta.len() as usize),
            // Unwatched (no slot was free): failed all the same.
            None => {
                self.record_failure(SyncFailure::unreadable());
            }
        }
        Some(meta.len() as usize)
    }

    /// Fails the mapping (records [`SyncFailure::unreadable`], calling the hook) if a page of
    /// it faulted and nothing failed it before; returns the offset of that page.
    pub(super) fn note_unreadable(&self) -> Option<usize> {
        let at = self.unreadable_at()?;
        if self.failure.get().is_none() {
            self.record_failure(SyncFailure::unreadable());
        }
        Some(at)
    }

    /// [`Error::Unreadable`] when a page of the mapping faulted (failing the mapping then).
    pub(super) fn check_readable(&self) -> Result<()> {
        // The copy's loads before the fault record's (weakly ordered CPUs): a page another
        // thread replaced while this one copied from it is seen recorded here.
        std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
        match self.note_unreadable() {
            Some(offset) => Err(Error::Unreadable {
                path: self.path.clone().unwrap_or_default(),
                offset,
            }),
            None => Ok(()),
        }
    }

    /// [`Error::Failed`] once the store has failed: checked before every persist, flush and
    /// drain, because the kernel reports a write-back error only once (and after a cache
    /// write-back, which faults on a page the kernel cannot give back).
    pub(super) fn check_healthy(&self) -> Result<()> {
        self.note_unreadable();
        match self.failure.get() {
            Some(&failure) => Err(Error::Failed {
                path: self.path.clone().unwrap_or_default(),
                failure,
            }),
            None => Ok(()),
        }
    }

    pub(super) fn sync_error(
        &self,
        op: &'static str,
        offset: usize,
        len: usize,
        source: io::Error,
    ) -> Error {
        Error::Sync {
            path: self.path.clone().unwrap_or_default(),
            op,
            offset,
            len,
            source,
        }
    }

    fn outcome(&self) -> Durability {
        if self.domain.is_durable() {
            Durability::Durable
        } else {
            Durability::VisibleOnly
        }
    }
}

impl Persist for Media {
    fn domain(&self) -> Domain {
        self.domain
    }

    fn persist(&self, offset: usize, len: usize) -> Result<Durability> {
        self.check_range(offset, len)?;
        self.check_healthy()?;
        match self.method {
            Method::Nothing => {}
            Method::CacheWriteBack => {
                // SAFETY: the range is inside the live file mapping (checked above).
                unsafe { writeback_range(self.ptr.as_ptr().add(offset), len) };
                sfence();
                // A line of a page the kernel could not give back faults in the write-back
                // (the page is zeros now): not durable.
                self.check_healthy()?;
            }
            Method::Msync if len > 0 => {
                let (start, end) = self.page_range(offset, len);
                self.forget_placed(start, end - start);
                self.msync(start, end)?;
            }
            Method::Msync => {}
        }
        Ok(self.outcome())
    }

    fn flush(&self, offset: usize, len: usize) -> Result<()> {
        self.check_range(offset, len)?;
        self.check_healthy()?;
        match self.method {
            Method::Nothing => {}
            Method::CacheWriteBack => {
                // SAFETY: the range is inside the live file mapping (checked above).
                unsafe { writeback_range(self.ptr.as_ptr().add(offset), len) };
                self.check_healthy()?;
            }
            Method::Msync if len > 0 => {
                let (start, end) = self.page_range(offset, len);
                self.forget_placed(start, end - start);
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
        match self.method {
            Method::Nothing => {}
            Method::CacheWriteBack => {
                sfence();
                // A flush since the check above may have faulted (its own check too).
                self.check_healthy()?;
            }
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
        // A fault is reported at once but recorded (the hook called) only by the calls that
        // record write-back failures: this one is called with the callers' locks held.
        self.failure
            .get()
            .copied()
            .or_else(|| self.unreadable_at().map(|_| SyncFailure::unreadable()))
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
        if self.method == Method::Msync {
            // The flush service's fdatasync would return 0 over a file cut short.
            self.check_size();
        }
        self.check_healthy()?;
        self.forget_placed(offset, len);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_range_covers_the_range_and_stays_in_the_mapping() {
        let m = Media::anonymous(3 * page_size() + 100).unwrap();
        let p = page_size();
        assert_eq!(m.page_range(0, 1), (0, p));
        assert_eq!(m.page_range(p - 1, 2), (0, 2 * p));
        assert_eq!(m.page_range(p, p), (p, 2 * p));
        // The tail of the last, partial page is still one whole page for msync.
        assert_eq!(m.page_range(3 * p + 99, 1), (3 * p, 4 * p));
    }
}
