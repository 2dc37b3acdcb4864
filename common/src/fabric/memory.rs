//! Memory as the fabric sees it, whatever the transport: what may be registered
//! ([`RegisteredMemory`], [`AlignedBuf`], the pmem `Mapping`), what backs it
//! ([`MemoryBacking`]) and how a device registers it ([`Registration`]); a registered range
//! (`Region`), what a registration or a window binding grants (`Grant`), and the face a
//! registered region shows to work requests (`LocalRegion`).

use std::num::NonZeroUsize;
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::error::{Error, Result};
use super::types::{Access, DomainId};
use crate::pmem::Persist;
use crate::volatile::VolatileSlice;

/// Memory that can be registered with
/// [`ProtectionDomain::register`](super::ProtectionDomain::register).
///
/// # Safety
/// An implementor promises that [`as_mut_ptr`](Self::as_mut_ptr) is valid for reads and writes
/// of [`len`](Self::len) bytes, never changes, and stays valid for the object's lifetime; and
/// that it never hands out Rust references into that memory which assume exclusive or unchanging
/// access, because the fabric writes into it (placing a peer's Write, a Read response, an
/// atomic) from whichever thread drives progress, through raw pointers (copy through a
/// [`VolatileSlice`] rather than forming a reference).
pub unsafe trait RegisteredMemory: Send + Sync + 'static {
    /// Start of the memory.
    fn as_mut_ptr(&self) -> *mut u8;
    /// Length in bytes.
    fn len(&self) -> usize;
    /// Whether it is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// How ranges of it are made durable, if it is backed by a persistence domain. Offsets given
    /// to it are from [`as_mut_ptr`](Self::as_mut_ptr).
    fn persist(&self) -> Option<&dyn Persist> {
        None
    }
    /// What kind of memory it is, for transports that pin memory for a NIC (`rdma`): fsdax and
    /// page-cache files cannot be pinned long-term and need on-demand paging there.
    fn backing(&self) -> MemoryBacking {
        MemoryBacking::Ram
    }
    /// For placing `len` bytes at `offset`: a file whose page cache holds this memory's bytes
    /// at the same offsets (the memory is a shared mapping of it from offset 0), into which a
    /// transport that copies received payloads itself (`tcp`) places them with `pwrite(2)`
    /// instead of stores, or None to store them. A store into a page the last write-back
    /// cleaned takes a write fault (the filesystem's `page_mkwrite`, a journal handle on
    /// ext4), a `pwrite` none, but a `pwrite` pays a system call and the filesystem's work
    /// per page every time, a store into a page already dirty here nothing: a page-cache
    /// [`Mapping`](crate::pmem::Mapping) names its file for a range's first placement after
    /// its write-back and None for the later ones. Only where a `pwrite` is the same as a
    /// store for every reader of the memory and for [`persist`](Self::persist): a page-cache
    /// file, not the power-loss simulation (whose memory is not the file's page cache). The
    /// descriptor stays open as long as the memory. Called once per placement, at its start.
    fn placement_file(&self, offset: usize, len: usize) -> Option<BorrowedFd<'_>> {
        let _ = (offset, len);
        None
    }
    /// Whether its bytes are not all its backing store's any more: a page of a file mapping
    /// that the kernel could not give back (a media error, the file truncated) was replaced
    /// by zeros (docs/persistence.md). A region over such memory counts as revoked: nothing
    /// more is read from it or placed into it for a peer. Called on the data path (per FPDU
    /// of a Read Response, per STag lookup): a load or two.
    fn unreadable(&self) -> bool {
        false
    }
}

/// What backs registered memory, as far as pinning it for a NIC goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum MemoryBacking {
    /// Anonymous memory, tmpfs, hugetlbfs: pinnable.
    Ram,
    /// A devdax character device: pinnable (its pages are never moved or written back).
    DevDax,
    /// A file on a DAX filesystem: the kernel refuses long-term pins of its pages.
    FsDax,
    /// A regular file in the page cache: long-term pins of writable file pages are refused
    /// (Linux 6.5 and later) or break write-back.
    PageCache,
}

/// How a device registers memory of one [`MemoryBacking`] ([`Context::registration`]).
///
/// [`Context::registration`]: crate::fabric::Context::registration
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Registration {
    /// The `tcp` transport: its userspace engine places into the memory itself; nothing is
    /// registered with a NIC or pinned.
    Engine,
    /// Pinned for the NIC (`ibv_reg_mr`): counts against RLIMIT_MEMLOCK.
    Pinned,
    /// On-demand paging (`IBV_ACCESS_ON_DEMAND`): nothing is pinned, the NIC faults pages in.
    OnDemand,
}

impl std::fmt::Display for Registration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Registration::Engine => "placed by the userspace engine (nothing pinned)",
            Registration::Pinned => "pinned (counts against RLIMIT_MEMLOCK)",
            Registration::OnDemand => "on-demand paging (ODP, nothing pinned)",
        })
    }
}

// SAFETY: a Mapping is a live mmap of `len()` bytes at a fixed address for its whole lifetime;
// it gives access only through raw pointers, so concurrent placement by the fabric is sound.
unsafe impl RegisteredMemory for crate::pmem::Mapping {
    fn as_mut_ptr(&self) -> *mut u8 {
        crate::pmem::Mapping::as_ptr(self)
    }
    fn len(&self) -> usize {
        crate::pmem::Mapping::len(self)
    }
    fn persist(&self) -> Option<&dyn Persist> {
        Some(self)
    }
    fn placement_file(&self, offset: usize, len: usize) -> Option<BorrowedFd<'_>> {
        crate::pmem::Mapping::placement_file(self, offset, len)
    }
    fn unreadable(&self) -> bool {
        self.unreadable_at().is_some()
    }
    fn backing(&self) -> MemoryBacking {
        use crate::pmem::Domain;
        let chardev = self.backing_fd().is_some_and(|fd| {
            nix::sys::stat::fstat(std::os::fd::AsRawFd::as_raw_fd(&fd)).is_ok_and(|st| {
                nix::sys::stat::SFlag::from_bits_truncate(st.st_mode)
                    .contains(nix::sys::stat::SFlag::S_IFCHR)
            })
        });
        match self.probed_domain() {
            _ if chardev => MemoryBacking::DevDax,
            Domain::Dax | Domain::DaxForced => MemoryBacking::FsDax,
            Domain::PageCache => MemoryBacking::PageCache,
            _ => MemoryBacking::Ram,
        }
    }
}

/// An owned, zeroed, page-aligned buffer to register: volatile memory for Read sinks, Recv
/// buffers, atomic results or test targets.
///
/// The fabric writes into it from whichever thread drives progress while its owner may read
/// it, so it hands out no reference to its bytes: the accessors copy through a
/// [`VolatileSlice`] (bytes placed while they are being copied may come out torn, never
/// anything worse), and the memory is an anonymous mapping of its own rather than a Rust heap
/// allocation.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the buffer is a private anonymous mapping owned by this value and unmapped only in
// Drop; every access, from any thread, goes through raw-pointer copies or the kernel.
unsafe impl Send for AlignedBuf {}
// SAFETY: as for Send: no method hands out references into the buffer.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A zeroed buffer of `len` bytes (at least 1), aligned to the page size (4096 or more).
    ///
    /// # Errors
    /// [`Error::Register`] for a zero length, or when the kernel refuses the mapping (an
    /// absurd length, no memory).
    pub fn new(len: usize) -> Result<Arc<AlignedBuf>> {
        let refuse = |reason| Error::Register {
            addr: 0,
            len,
            reason,
        };
        let size = NonZeroUsize::new(len).ok_or(refuse("empty buffer"))?;
        use nix::sys::mman::{mmap_anonymous, MapFlags, ProtFlags};
        // SAFETY: a fresh private anonymous mapping at an address the kernel picks aliases no
        // existing memory; the kernel zeroes it.
        let ptr = unsafe {
            mmap_anonymous(
                None,
                size,
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_PRIVATE,
            )
        }
        .map_err(|_| refuse("the kernel refused an anonymous mapping of this length"))?;
        Ok(Arc::new(AlignedBuf {
            ptr: ptr.cast(),
            len,
        }))
    }

    /// The whole buffer as a view for copies.
    pub fn as_volatile(&self) -> VolatileSlice<'_> {
        // SAFETY: the mapping is valid for reads and writes of `len` bytes until Drop, which the
        // borrow of self outlasts; this type never hands out a reference to its bytes.
        unsafe { VolatileSlice::new(self.ptr.as_ptr(), self.len) }
    }

    fn bounds(&self, offset: usize, len: usize) -> Error {
        Error::LocalBounds {
            offset,
            len,
            region_len: self.len,
        }
    }

    /// Copies `out.len()` bytes at `offset` into `out`.
    ///
    /// # Errors
    /// [`Error::LocalBounds`] if the range is outside the buffer.
    pub fn read_at(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        self.as_volatile()
            .read_at(offset, out)
            .map_err(|_| self.bounds(offset, out.len()))
    }

    /// Copies `data` into the buffer at `offset`.
    ///
    /// # Errors
    /// [`Error::LocalBounds`] if the range is outside the buffer.
    pub fn write_at(&self, offset: usize, data: &[u8]) -> Result<()> {
        self.as_volatile()
            .write_at(offset, data)
            .map_err(|_| self.bounds(offset, data.len()))
    }

    /// The whole buffer, copied.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0; self.len];
        // Cannot fail: the range is the whole buffer.
        let _ = self.read_at(0, &mut v);
        v
    }

    /// The native-endian u64 at `offset` (8-byte aligned offsets read in one access).
    ///
    /// # Errors
    /// [`Error::LocalBounds`] if the range is outside the buffer.
    pub fn read_u64(&self, offset: usize) -> Result<u64> {
        let mut b = [0u8; 8];
        self.read_at(offset, &mut b)?;
        Ok(u64::from_ne_bytes(b))
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: ptr/len are the mapping made in `new`, unmapped only here; the fabric holds an
        // Arc of this buffer for as long as it may place into it.
        let _ = unsafe { nix::sys::mman::munmap(self.ptr.cast(), self.len) };
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AlignedBuf")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .finish()
    }
}

// SAFETY: ptr/len describe the live mapping owned by self; access is by raw pointer only.
unsafe impl RegisteredMemory for AlignedBuf {
    fn as_mut_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
    fn len(&self) -> usize {
        self.len
    }
}

pub(crate) enum Backing {
    Owned(Arc<dyn RegisteredMemory>),
    Raw { addr: *mut u8, len: usize },
}

/// Registered memory as the engine sees it: a fixed address range kept alive by `keep`.
pub(crate) struct Region {
    addr: *mut u8,
    len: usize,
    keep: Option<Arc<dyn RegisteredMemory>>,
    /// Registered with [`ProtectionDomain::register_stable`](super::ProtectionDomain::register_stable):
    /// nothing writes the bytes a work request reads while it is in flight.
    pub(crate) stable: bool,
    /// Revoked by its owner ([`MemoryRegion::revoke`](super::MemoryRegion::revoke)): what a
    /// peer already reached through its rkey, a Read Response still waiting to be sent or a
    /// Write still being placed, must not touch the memory any more, although the `Arc`s that
    /// keep it alive for them remain. A deregistration alone does not set it: it refuses new
    /// access only, and lets what was accepted finish.
    revoked: AtomicBool,
}

// SAFETY: the range is kept alive by `keep` (or by the register_raw contract) and is only ever
// accessed through raw pointers and atomics, from any thread.
unsafe impl Send for Region {}
// SAFETY: as for Send.
unsafe impl Sync for Region {}

impl Region {
    pub(crate) fn new(backing: Backing) -> Result<Region> {
        let (addr, len, keep) = match backing {
            Backing::Owned(m) => (m.as_mut_ptr(), m.len(), Some(m)),
            Backing::Raw { addr, len } => (addr, len, None),
        };
        if addr.is_null() || len == 0 {
            return Err(Error::Register {
                addr: addr as usize,
                len,
                reason: "null or empty range",
            });
        }
        if (addr as usize).checked_add(len).is_none() {
            return Err(Error::Register {
                addr: addr as usize,
                len,
                reason: "range wraps",
            });
        }
        Ok(Region {
            addr,
            len,
            keep,
            stable: false,
            revoked: AtomicBool::new(false),
        })
    }

    /// Marks the registration revoked for what is in flight too.
    pub(crate) fn revoke(&self) {
        self.revoked.store(true, Ordering::Release);
    }

    /// Whether the registration was revoked: a peer's access through it, queued or in
    /// progress, must stop before it reads or writes another byte. A region over a file
    /// mapping a page of which the kernel could not give back (SIGBUS: a media error, the
    /// file truncated) counts as revoked too ([`RegisteredMemory::unreadable`]): the handler
    /// put zeros in that page's place (crate::sigbus), which must never leave as data.
    pub(crate) fn revoked(&self) -> bool {
        self.revoked.load(Ordering::Acquire) || self.keep.as_ref().is_some_and(|m| m.unreadable())
    }

    /// After a system call could not read the region's bytes (EFAULT: the kernel's copy meets
    /// a page it cannot give back, and sends no signal): reads a byte of each page of
    /// `[offset, offset + len)` so that such a page faults in user space, where it is taken
    /// as in [`revoked`](Self::revoked), which this returns then.
    pub(crate) fn probe(&self, offset: usize, len: usize) -> bool {
        let len = len.min(self.len.saturating_sub(offset));
        crate::sigbus::probe(self.addr as usize + offset.min(self.len), len);
        self.revoked()
    }

    #[cfg(test)]
    pub(crate) fn for_test(backing: Backing) -> Region {
        Region::new(backing).expect("test memory")
    }

    pub(crate) fn addr(&self) -> *mut u8 {
        self.addr
    }

    /// Its length in bytes (never 0).
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The `len` bytes at `offset`, for copies and iovecs. None if they are not all inside.
    pub(crate) fn slice(&self, offset: usize, len: usize) -> Option<VolatileSlice<'_>> {
        // SAFETY: the range is kept alive by `keep` (or by the register_raw contract) for at
        // least as long as this Region, and registered memory is never covered by a Rust
        // reference (the RegisteredMemory and register_raw contracts).
        let whole = unsafe { VolatileSlice::new(self.addr, self.len) };
        whole.subslice(offset, len).ok()
    }

    /// The memory's persistence, if any (offsets from the region's start).
    pub(crate) fn persist(&self) -> Option<&dyn Persist> {
        self.keep.as_ref().and_then(|m| m.persist())
    }

    /// The file to place the `len` received bytes at `offset` into with `pwrite(2)`, at the
    /// same offset as in the region, or None to store them
    /// ([`RegisteredMemory::placement_file`]); open as long as the region.
    pub(crate) fn placement_file(&self, offset: usize, len: usize) -> Option<RawFd> {
        self.keep
            .as_ref()
            .and_then(|m| m.placement_file(offset, len))
            .map(|fd| fd.as_raw_fd())
    }

    /// What backs it; raw registrations count as RAM (the caller's memory, pinnable).
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    pub(crate) fn backing(&self) -> MemoryBacking {
        self.keep
            .as_ref()
            .map_or(MemoryBacking::Ram, |m| m.backing())
    }
}

/// What a memory registration or a window binding grants, whatever the transport.
pub(crate) struct Grant<'a> {
    pub(crate) region: &'a Arc<Region>,
    /// The address a peer names the first byte by.
    pub(crate) base: u64,
    pub(crate) len: u64,
    /// Where `base` is in the region.
    pub(crate) offset: u64,
    pub(crate) access: Access,
    /// The protection domain, by its number on the device.
    pub(crate) pd: u32,
}

/// A registered region as a work request's local buffer names it: its memory, its local key,
/// its rights and its protection domain. The public `MemoryRegion` is the one implementor; an
/// [`Sge`](super::Sge) holds it as this trait, so that the transports, which read it, never
/// name the façade. Holding it keeps the registration (and so the memory) alive.
pub(crate) trait LocalRegion: Send + Sync + std::fmt::Debug {
    /// The registered memory.
    fn memory(&self) -> &Arc<Region>;
    /// The local key.
    fn lkey(&self) -> u32;
    /// The rights it was registered with.
    fn access(&self) -> Access;
    /// Its protection domain.
    fn domain(&self) -> DomainId;
}
