//! Memory regions and windows: what peers may reach, under which rkey, with which rights.
//! The memory itself, and what a registration grants, are the neutral layer's (`memory.rs`);
//! the transport's part is behind the seam.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use super::error::{Error, Result};
use super::memory::{Grant, LocalRegion, RegisteredMemory};
use super::pd::ProtectionDomain;
use super::transport::{MrEngine, MwEngine, QpEngine};
use super::types::{Access, DomainId};
use super::wr::{RemoteAddr, Sge};

// soft/outbound.rs and soft/placement/dirty.rs (and their tests) still name these by this
// path: the issue-23 branch changes those files, so they move to `memory` once it has merged.
#[cfg(test)]
pub(crate) use super::memory::AlignedBuf;
pub(crate) use super::memory::{Backing, Region};

/// A registered memory region (`ibv_mr`). Dropping the last `Arc` deregisters it and
/// invalidates every memory window bound to it; the fabric holds an `Arc` per outstanding work
/// request that uses it, so memory in flight is never freed.
pub struct MemoryRegion {
    // Drop order matters: the registration goes first (ibv_dereg_mr), then the memory it
    // names (its unmapping), then the domain. Unmapped first, a new mapping at the same
    // address could take a peer's writes through a still-registered (ODP) region.
    engine: MrEngine,
    region: Arc<Region>,
    pd: ProtectionDomain,
    access: Access,
}

impl std::fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("addr", &self.region.addr())
            .field("len", &self.region.len())
            .field("rkey", &format_args!("{:#x}", self.engine.rkey()))
            .field("access", &self.access)
            .finish()
    }
}

impl ProtectionDomain {
    /// Registers `mem` (`ibv_reg_mr`): the region keeps `mem` alive, and remembers its
    /// [`Persist`](crate::pmem::Persist) so that the responder can make remote writes durable.
    ///
    /// # Errors
    /// [`Error::InvalidAccess`] for flags that need [`Access::LOCAL_WRITE`] without it,
    /// [`Error::Register`] for empty memory (and on `rdma` for memory the device cannot
    /// register: fsdax or page-cache files without on-demand paging), [`Error::Exhausted`] when
    /// no STag is left, [`Error::Verbs`] when the device refuses the registration.
    pub fn register<M: RegisteredMemory>(
        &self,
        mem: Arc<M>,
        access: Access,
    ) -> Result<Arc<MemoryRegion>> {
        register(self, Backing::Owned(mem), access, false)
    }

    /// [`register`](Self::register), for memory whose owner writes no byte that a work request
    /// is reading: the soft transport then computes the CRC of a payload sent from it over the
    /// memory itself, not over a copy of each piece (`register`'s memory may be written by
    /// others while it is sent, so a reference must never cover it; the copy was 8.6% of the
    /// NBD export's samples on 1 MiB writes: docs/benchmarks.md, "A sent payload's CRC over
    /// the memory itself"). Same errors as `register`.
    ///
    /// # Safety
    /// While a work request that reads bytes of the region is in flight (a Send's or Write's
    /// local source, from posting to its completion or the queue pair's end; a peer's Read of
    /// it, while the Read Response goes out), nothing writes those bytes: not the owner, not
    /// another work request (a Read's sink, a Receive's buffer, a peer's Write or atomic, on
    /// any queue pair, through any registration of the same memory).
    ///
    /// # Errors
    /// As for [`register`](Self::register).
    pub unsafe fn register_stable<M: RegisteredMemory>(
        &self,
        mem: Arc<M>,
        access: Access,
    ) -> Result<Arc<MemoryRegion>> {
        register(self, Backing::Owned(mem), access, true)
    }

    /// Registers raw memory (`ibv_reg_mr` on a pointer).
    ///
    /// # Safety
    /// `addr` must be valid for reads and writes of `len` bytes, and stay so — not freed, not
    /// unmapped, not moved — until the returned region and every work request that uses it are
    /// gone (the fabric keeps an `Arc` of the region per outstanding request). Dropping the
    /// region's last `Arc` revokes its rkey and the rkeys of every memory window bound to it
    /// (they are refused with a remote access error from then on); a peer's Write FPDU already
    /// being placed when it is dropped holds the region until that FPDU is in (or refused: on
    /// `tcp` with CRC off, the rest of a region [revoked](MemoryRegion::revoke) first is refused
    /// at the queue pair's next poll), so the memory must also stay valid until the queue pairs that could be placing into it have made
    /// progress past that FPDU (or are gone). Peers with the rkey write into it at any time
    /// from the thread that drives progress: no Rust reference that assumes exclusive or
    /// unchanging access may exist to it meanwhile.
    ///
    /// # Errors
    /// As [`ProtectionDomain::register`].
    pub unsafe fn register_raw(
        &self,
        addr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<Arc<MemoryRegion>> {
        register(self, Backing::Raw { addr, len }, access, false)
    }

    /// Allocates a memory window (type 2: bound to one queue pair by
    /// [`QueuePair::bind_mw`](super::QueuePair::bind_mw)).
    ///
    /// # Errors
    /// [`Error::Exhausted`] when no STag is left; on `rdma`, [`Error::MemoryWindow`] when the
    /// device has no type-2 windows, [`Error::Verbs`] when it refuses one.
    pub fn alloc_mw(&self) -> Result<MemoryWindow> {
        MemoryWindow::new(self)
    }
}

pub(crate) fn check_access(access: Access) -> Result<()> {
    let needs_local = Access::REMOTE_WRITE | Access::REMOTE_ATOMIC;
    if !(access & needs_local).is_empty() && !access.contains(Access::LOCAL_WRITE) {
        return Err(Error::InvalidAccess {
            access,
            reason: "remote write and remote atomic need local write",
        });
    }
    Ok(())
}

/// `stable`: the [`ProtectionDomain::register_stable`] contract holds for the memory.
fn register(
    pd: &ProtectionDomain,
    backing: Backing,
    access: Access,
    stable: bool,
) -> Result<Arc<MemoryRegion>> {
    check_access(access)?;
    let mut region = Region::new(backing)?;
    region.stable = stable;
    let region = Arc::new(region);
    let (addr, len) = (region.addr(), region.len());
    let grant = Grant {
        region: &region,
        base: addr as u64,
        len: len as u64,
        offset: 0,
        access,
        pd: pd.inner.id,
    };
    let engine = pd.context().device().register_mr(&pd.inner.engine, grant)?;
    Ok(Arc::new(MemoryRegion {
        engine,
        region,
        pd: pd.clone(),
        access,
    }))
}

impl MemoryRegion {
    /// The start address: the peer names bytes of this region as `addr() + offset`.
    pub fn addr(&self) -> u64 {
        self.region.addr() as u64
    }

    /// The start as a pointer.
    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.region.addr()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.region.len()
    }

    /// Whether it is empty (never: registration refuses empty memory).
    pub fn is_empty(&self) -> bool {
        self.region.len() == 0
    }

    /// The local key. On the soft transport it equals the rkey.
    pub fn lkey(&self) -> u32 {
        self.engine.lkey()
    }

    /// The key a peer needs to reach this region.
    pub fn rkey(&self) -> u32 {
        self.engine.rkey()
    }

    /// The rights it was registered with.
    pub fn access(&self) -> Access {
        self.access
    }

    /// The protection domain.
    pub fn pd(&self) -> &ProtectionDomain {
        &self.pd
    }

    /// Revokes what peers already reached through this region, not only new access: on `tcp`,
    /// a Read Response from it still queued sends no further byte (the queue pair sends an
    /// RDMAP Invalid STag Terminate, or, in the middle of an FPDU, ends the connection there)
    /// and a Write being placed into it places no further byte (CRC off). For memory that is
    /// about to serve someone else (a namespace a reload removed): revoke, then drop the
    /// region. Dropping it alone deregisters it (new access refused) and lets what was
    /// accepted finish. On `rdma` it does nothing: the device stops at the deregistration.
    pub fn revoke(&self) {
        self.region.revoke();
    }

    /// What to hand a peer so it can reach `offset` of this region.
    pub fn remote(&self, offset: u64) -> RemoteAddr {
        RemoteAddr {
            addr: self.addr() + offset,
            rkey: self.engine.rkey(),
        }
    }
}

impl MemoryRegion {
    /// The registered memory (the soft transport's tests reach it so).
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn region(&self) -> &Arc<Region> {
        &self.region
    }
}

impl LocalRegion for MemoryRegion {
    fn memory(&self) -> &Arc<Region> {
        &self.region
    }
    fn lkey(&self) -> u32 {
        self.engine.lkey()
    }
    fn access(&self) -> Access {
        self.access
    }
    fn domain(&self) -> DomainId {
        self.pd.domain()
    }
}

// The constructors of the neutral `Sge` live with the region they take: below the façade, an
// `Sge` knows its region only as a `LocalRegion`.
impl Sge {
    /// A range of `mr`; bounds are checked when the request is posted.
    pub fn new(mr: &Arc<MemoryRegion>, offset: usize, len: usize) -> Sge {
        Sge {
            mr: Arc::clone(mr) as Arc<dyn LocalRegion>,
            offset,
            len,
        }
    }

    /// The whole region.
    pub fn whole(mr: &Arc<MemoryRegion>) -> Sge {
        Sge::new(mr, 0, mr.len())
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        self.pd.context().device().release_mr(&self.engine);
    }
}

/// A memory window (`ibv_mw`, type 2): a sub-range of a region with a subset of its rights,
/// under an rkey of its own, usable by one queue pair. Binding again or invalidating changes
/// the rkey, so an old rkey is refused with a remote access error. Dropping it invalidates it.
pub struct MemoryWindow {
    pd: ProtectionDomain,
    rkey: AtomicU32,
    engine: MwEngine,
}

impl std::fmt::Debug for MemoryWindow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryWindow")
            .field(
                "rkey",
                &format_args!("{:#x}", self.rkey.load(Ordering::Relaxed)),
            )
            .finish()
    }
}

impl MemoryWindow {
    pub(crate) fn new(pd: &ProtectionDomain) -> Result<MemoryWindow> {
        let (rkey, engine) = pd.context().device().alloc_mw(&pd.inner.engine)?;
        Ok(MemoryWindow {
            pd: pd.clone(),
            rkey: AtomicU32::new(rkey),
            engine,
        })
    }

    /// The current rkey (valid only while bound).
    pub fn rkey(&self) -> u32 {
        self.rkey.load(Ordering::Acquire)
    }

    /// Invalidates the window locally (`IBV_WR_LOCAL_INV`): its rkey stops working at once.
    pub fn invalidate(&self) {
        if let Some(rkey) = self
            .pd
            .context()
            .device()
            .invalidate(&self.engine, self.rkey())
        {
            self.rkey.store(rkey, Ordering::Release);
        }
    }

    pub(crate) fn bind(
        &self,
        qp: &QpEngine,
        mr: &Arc<MemoryRegion>,
        offset: usize,
        len: usize,
        access: Access,
    ) -> Result<u32> {
        if !mr.pd.same(&self.pd) {
            return Err(Error::WrongDomain {
                what: "memory region",
            });
        }
        if !mr.access.contains(Access::MW_BIND) {
            return Err(Error::MemoryWindow {
                reason: "the region was not registered with MW_BIND",
            });
        }
        if !mr.access.contains(access & Access::ALL_REMOTE) || access.contains(Access::MW_BIND) {
            return Err(Error::MemoryWindow {
                reason: "rights beyond the region's",
            });
        }
        check_access(access | (mr.access & Access::LOCAL_WRITE))?;
        match offset.checked_add(len) {
            Some(end) if end <= mr.len() && len > 0 => {}
            _ => {
                return Err(Error::MemoryWindow {
                    reason: "range outside the region",
                })
            }
        }
        let grant = Grant {
            region: &mr.region,
            base: mr.addr() + offset as u64,
            len: len as u64,
            offset: offset as u64,
            access,
            pd: self.pd.inner.id,
        };
        let rkey =
            self.pd
                .context()
                .device()
                .bind_mw(&self.engine, self.rkey(), qp, &mr.engine, grant)?;
        self.rkey.store(rkey, Ordering::Release);
        Ok(rkey)
    }
}

impl Drop for MemoryWindow {
    fn drop(&mut self) {
        self.pd
            .context()
            .device()
            .release_mw(&self.engine, self.rkey());
    }
}
