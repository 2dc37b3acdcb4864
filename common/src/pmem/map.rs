//! Opening a backing store, mapping it shared, probing its persistence domain, and the
//! [`Persist`] implementation on the mapping.

use std::fs::{self, File};
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::{Mutex, OnceLock};

use super::devdax;
use super::domain::{Domain, Durability, SyncFailure};
use super::error::{Error, Result};
use super::flush::{sfence, writeback_range};
use super::Persist;

/// statfs magic numbers of filesystems that live in RAM.
const TMPFS_MAGIC: u32 = 0x0102_1994;
const RAMFS_MAGIC: u32 = 0x8584_58f6;
const HUGETLBFS_MAGIC: u32 = 0x9584_58f6;

/// What to do when an existing file's size differs from the size asked for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Resize {
    /// Refuse with [`Error::WouldGrow`] or [`Error::WouldShrink`] (the default).
    #[default]
    Refuse,
    /// Grow a smaller file (the new part is allocated up front like the rest); refuse to shrink.
    Grow,
    /// Grow or shrink to the size asked for. Shrinking discards the bytes past the new end.
    GrowOrShrink,
}

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
pub struct Mapping {
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
            .finish()
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: ptr/len are exactly the region this Mapping mapped and still owns; nothing borrows
        // from it past the Mapping's lifetime (only raw pointers, whose use is the caller's contract).
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
        })
    }

    /// The first byte of the mapping.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
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
        // SAFETY: start is page-aligned and [start, end) lies within the pages of this mapping.
        let rc =
            unsafe { libc::msync(self.as_ptr().add(start).cast(), end - start, libc::MS_SYNC) };
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
        match self.method {
            Method::Nothing => {}
            Method::CacheWriteBack => {
                // SAFETY: the range is inside the live mapping (checked above).
                unsafe { writeback_range(self.as_ptr().add(offset), len) };
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
        match self.method {
            Method::Nothing => {}
            Method::CacheWriteBack => {
                // SAFETY: the range is inside the live mapping (checked above).
                unsafe { writeback_range(self.as_ptr().add(offset), len) };
            }
            Method::Msync if len > 0 => {
                let (start, end) = self.page_range(offset, len);
                if let Some(file) = &self.file {
                    // Start write-back now so that drain() has less to wait for. Failure here is not
                    // final: drain()'s msync writes whatever is still dirty and reports its error.
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
        self.failure.set(failure).is_ok()
    }
}

/// Opens a namespace's backing store: a regular file (created and allocated if asked) or a devdax
/// character device, and maps it. See [`OpenOptions::open`].
#[derive(Debug, Clone)]
pub struct OpenOptions {
    pub(super) path: PathBuf,
    pub(super) size: Option<u64>,
    pub(super) block_size: u64,
    pub(super) force_dax: bool,
    pub(super) resize: Resize,
    pub(super) create: bool,
}

impl OpenOptions {
    /// Options for `path`: no size (use the existing size), block size 4096, no force_dax,
    /// [`Resize::Refuse`], no create.
    pub fn new(path: impl Into<PathBuf>) -> OpenOptions {
        OpenOptions {
            path: path.into(),
            size: None,
            block_size: 4096,
            force_dax: false,
            resize: Resize::Refuse,
            create: false,
        }
    }

    /// Namespace size in bytes: needed to create a file; for an existing one it must match unless
    /// [`OpenOptions::resize`] allows the change; for devdax it maps that much of the device.
    pub fn size(mut self, size: u64) -> OpenOptions {
        self.size = Some(size);
        self
    }

    /// Block size, 512 or 4096 (default). The size must be a multiple of it.
    pub fn block_size(mut self, block_size: u64) -> OpenOptions {
        self.block_size = block_size;
        self
    }

    /// Treat the mapping as dax whatever the probe finds (testing and benchmarking on DRAM, like
    /// PMDK's PMEM_IS_PMEM_FORCE): persists use cache write-back + sfence and the domain reads
    /// `dax (forced)`. It promises nothing about the media.
    pub fn force_dax(mut self, force: bool) -> OpenOptions {
        self.force_dax = force;
        self
    }

    /// Whether an existing file may be grown or shrunk to the size asked for.
    pub fn resize(mut self, resize: Resize) -> OpenOptions {
        self.resize = resize;
        self
    }

    /// Create the file if it does not exist (a size is then required).
    pub fn create(mut self, create: bool) -> OpenOptions {
        self.create = create;
        self
    }

    /// Validates the options, opens (creating and allocating the whole size up front, so that a
    /// full filesystem fails here and never as SIGBUS later), maps the store shared (trying
    /// MAP_SHARED_VALIDATE | MAP_SYNC first) and probes the persistence domain.
    ///
    /// An existing empty file is treated like a new one: it is grown to the size without a
    /// [`Resize`] choice, since there is nothing in it to lose.
    ///
    /// Errors: [`Error::BadBlockSize`], [`Error::ZeroSize`], [`Error::SizeNotMultiple`],
    /// [`Error::SizeTooLarge`], [`Error::SizeRequired`], [`Error::NotFound`],
    /// [`Error::IsDirectory`], [`Error::UnsupportedFileType`], [`Error::PermissionDenied`],
    /// [`Error::WouldGrow`], [`Error::WouldShrink`], [`Error::NoSpace`], [`Error::NotDevDax`],
    /// [`Error::DevDaxTooSmall`], [`Error::DevDaxAlignment`], [`Error::Map`], [`Error::Io`].
    pub fn open(&self) -> Result<Mapping> {
        if self.block_size != 512 && self.block_size != 4096 {
            return Err(Error::BadBlockSize {
                block_size: self.block_size,
            });
        }
        if let Some(size) = self.size {
            self.check_size(size)?;
        }
        match fs::metadata(&self.path) {
            Ok(meta) => {
                let ft = meta.file_type();
                if ft.is_dir() {
                    Err(Error::IsDirectory {
                        path: self.path.clone(),
                    })
                } else if ft.is_char_device() {
                    self.open_devdax(&meta)
                } else if ft.is_file() {
                    self.open_file(false)
                } else {
                    Err(Error::UnsupportedFileType {
                        path: self.path.clone(),
                        kind: unsupported_kind(ft),
                    })
                }
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound && self.create => {
                if self.size.is_none() {
                    return Err(Error::SizeRequired {
                        path: self.path.clone(),
                    });
                }
                self.open_file(true)
            }
            Err(e) => Err(self.open_error("stat", e)),
        }
    }

    pub(super) fn check_size(&self, size: u64) -> Result<()> {
        if size == 0 {
            return Err(Error::ZeroSize {
                path: self.path.clone(),
            });
        }
        if !size.is_multiple_of(self.block_size) {
            return Err(Error::SizeNotMultiple {
                path: self.path.clone(),
                size,
                block_size: self.block_size,
            });
        }
        if usize::try_from(size).is_err() || size > isize::MAX as u64 {
            return Err(Error::SizeTooLarge {
                path: self.path.clone(),
                size,
            });
        }
        Ok(())
    }

    pub(super) fn open_error(&self, op: &'static str, source: io::Error) -> Error {
        let path = self.path.clone();
        match source.raw_os_error() {
            Some(libc::ENOENT) => Error::NotFound { path, source },
            Some(libc::EACCES) | Some(libc::EPERM) => Error::PermissionDenied { path, source },
            Some(libc::EISDIR) => Error::IsDirectory { path },
            _ => Error::Io { path, op, source },
        }
    }

    fn open_file(&self, create: bool) -> Result<Mapping> {
        let mut opts = fs::OpenOptions::new();
        opts.read(true).write(true);
        if create {
            opts.create_new(true).mode(0o600);
        }
        let (file, created) = match opts.open(&self.path) {
            Ok(f) => (f, create),
            // Someone created it between our stat and open: open what is there.
            Err(e) if create && e.kind() == io::ErrorKind::AlreadyExists => {
                return self.open_file(false);
            }
            Err(e) => return Err(self.open_error("open", e)),
        };
        let result = self.size_and_map_file(&file, created);
        if result.is_err() && created {
            // Leave nothing behind for a namespace that could not be opened.
            let _ = fs::remove_file(&self.path);
        }
        let (len, probed, map_sync, ptr) = result?;
        Ok(self.finish(file, len, probed, map_sync, ptr))
    }

    /// Settles the file's size, allocates it, maps it and probes the domain.
    fn size_and_map_file(
        &self,
        file: &File,
        created: bool,
    ) -> Result<(usize, Domain, bool, NonNull<u8>)> {
        let io_err = |op, source| Error::Io {
            path: self.path.clone(),
            op,
            source,
        };
        let existing = file.metadata().map_err(|e| io_err("stat", e))?.len();
        let size = match self.size {
            None => {
                self.check_size(existing)?;
                existing
            }
            Some(size) => size,
        };
        // An empty file has nothing to lose, so growing it needs no Resize choice.
        if !created && existing != 0 && size != existing {
            match self.resize {
                Resize::Refuse | Resize::Grow if size < existing => {
                    return Err(Error::WouldShrink {
                        path: self.path.clone(),
                        existing,
                        requested: size,
                    })
                }
                Resize::Refuse => {
                    return Err(Error::WouldGrow {
                        path: self.path.clone(),
                        existing,
                        requested: size,
                    })
                }
                _ => {}
            }
        }
        if size < existing {
            file.set_len(size).map_err(|e| io_err("shrink", e))?;
        }
        // Allocate every block now, holes included, so that no store into the mapping ever needs
        // the filesystem to find space (which would be SIGBUS on a full filesystem).
        // SAFETY: posix_fallocate only reads the descriptor and the integer arguments.
        let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, size as libc::off_t) };
        if rc != 0 {
            let source = io::Error::from_raw_os_error(rc);
            if size > existing && !created {
                // Undo a partial grow; the original bytes are untouched.
                let _ = file.set_len(existing);
            }
            return Err(match rc {
                libc::ENOSPC | libc::EDQUOT | libc::EFBIG => Error::NoSpace {
                    path: self.path.clone(),
                    size,
                    source,
                },
                _ => io_err("allocate (posix_fallocate)", source),
            });
        }
        let len = size as usize; // fits: check_size
        let (ptr, map_sync) = self.map_shared(file, len)?;
        let probed = if map_sync {
            Domain::Dax
        } else if is_ram_fs(file).map_err(|e| io_err("statfs", e))? {
            Domain::Volatile
        } else {
            Domain::PageCache
        };
        Ok((len, probed, map_sync, ptr))
    }

    fn open_devdax(&self, meta: &fs::Metadata) -> Result<Mapping> {
        use std::os::unix::fs::MetadataExt;
        let info = devdax::probe(&self.path, meta.rdev())?;
        let size = devdax::mapping_len(&self.path, info, self.size)?;
        self.check_size(size)?;
        let file = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&self.path)
            .map_err(|e| self.open_error("open", e))?;
        let len = size as usize; // fits: check_size
        let (ptr, map_sync) = self.map_shared(&file, len)?;
        Ok(self.finish(file, len, Domain::Dax, map_sync, ptr))
    }

    /// Maps the whole file shared, with MAP_SYNC when the kernel and filesystem accept it.
    fn map_shared(&self, file: &File, len: usize) -> Result<(NonNull<u8>, bool)> {
        let map = |flags| {
            // SAFETY: a new shared mapping of our own descriptor at an address the kernel picks
            // aliases no Rust-owned memory; the file is at least `len` bytes (allocated above).
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    flags,
                    file.as_raw_fd(),
                    0,
                )
            };
            if p == libc::MAP_FAILED {
                Err(io::Error::last_os_error())
            } else {
                Ok(p)
            }
        };
        let map_err = |source| Error::Map {
            path: Some(self.path.clone()),
            len,
            source,
        };
        let (p, map_sync) = match map(libc::MAP_SHARED_VALIDATE | libc::MAP_SYNC) {
            Ok(p) => (p, true),
            // EOPNOTSUPP: no DAX here; EINVAL: a kernel that predates MAP_SHARED_VALIDATE.
            Err(e) if matches!(e.raw_os_error(), Some(libc::EOPNOTSUPP | libc::EINVAL)) => {
                (map(libc::MAP_SHARED).map_err(map_err)?, false)
            }
            Err(e) => return Err(map_err(e)),
        };
        let ptr = NonNull::new(p.cast()).ok_or_else(|| map_err(io::Error::other("mmap gave 0")))?;
        Ok((ptr, map_sync))
    }

    fn finish(
        &self,
        file: File,
        len: usize,
        probed: Domain,
        map_sync: bool,
        ptr: NonNull<u8>,
    ) -> Mapping {
        let domain = if self.force_dax {
            Domain::DaxForced
        } else {
            probed
        };
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
            path: Some(self.path.clone()),
            pending: Mutex::new(None),
            failure: OnceLock::new(),
        }
    }
}

/// What to call a file that is neither a regular file, a directory nor a character device.
pub(super) fn unsupported_kind(ft: fs::FileType) -> &'static str {
    if ft.is_block_device() {
        "block device"
    } else if ft.is_fifo() {
        "FIFO"
    } else if ft.is_socket() {
        "socket"
    } else {
        "special file"
    }
}

/// Whether a statfs magic number is a RAM filesystem's (tmpfs, ramfs, hugetlbfs).
pub(super) fn is_ram_magic(magic: u32) -> bool {
    matches!(magic, TMPFS_MAGIC | RAMFS_MAGIC | HUGETLBFS_MAGIC)
}

/// Whether the file lives on a RAM filesystem (tmpfs, ramfs, hugetlbfs).
fn is_ram_fs(file: &File) -> io::Result<bool> {
    let mut st = std::mem::MaybeUninit::<libc::statfs>::zeroed();
    // SAFETY: fstatfs writes a statfs into the buffer, which is large enough and ours.
    let rc = unsafe { libc::fstatfs(file.as_raw_fd(), st.as_mut_ptr()) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fstatfs succeeded, so it initialised the struct (and it was zeroed before).
    let magic = unsafe { st.assume_init() }.f_type as u32;
    Ok(is_ram_magic(magic))
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn ram_filesystems_are_recognised() {
        let shm = tempfile::tempfile_in("/dev/shm").unwrap();
        assert!(is_ram_fs(&shm).unwrap());
        let disk = tempfile::tempfile_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        let disk_is_ram = is_ram_fs(&disk).unwrap();
        let df = nix::sys::statfs::fstatfs(&disk).unwrap();
        assert_eq!(
            disk_is_ram,
            df.filesystem_type() == nix::sys::statfs::TMPFS_MAGIC
        );
    }
}
