//! Memory registration on an RDMA device, and type-2 memory windows.
//!
//! What may be pinned is pinned (`ibv_reg_mr`): anonymous memory, tmpfs, and devdax, whose
//! pages are never moved or written back. fsdax files cannot be: the kernel refuses
//! long-term pins of DAX file pages, so they are registered with on-demand paging
//! (`IBV_ACCESS_ON_DEMAND`) where the device has it for the rights asked, and refused with the
//! reason where it does not. Page-cache files are registered the same way: long-term pins of
//! writable file pages are refused (Linux 6.5 and later) or keep write-back from working.
//!
//! A window is an `ibv_mw` of type 2, bound to one queue pair by a posted bind. Invalidating
//! one (locally, or because its region is deregistered) replaces the `ibv_mw` with a fresh one:
//! the old rkey is then refused by the device, and no local-invalidate request has to be
//! posted on a queue pair that may be gone. Binding a window that is bound replaces it the
//! same way first: a type-2 window binds only from the free state (IBTA o10-37.2.30; rxe
//! refuses with EINVAL and the queue pair goes to Error).

use std::ptr::NonNull;
use std::sync::{Arc, Mutex, Weak};

use rdma_sys::{
    ibv_access_flags as ia, ibv_mr, ibv_mw, ibv_mw_type, ibv_odp_transport_cap_bits as odp,
};

use super::caps::Caps;
use super::device::Pd;
use super::sys;
use super::translate;
use crate::fabric::error::{Error, Result};
use crate::fabric::memory::{Grant, MemoryBacking, Registration};
use crate::fabric::types::Access;

/// A registered region (`ibv_mr`). Cheap to clone: windows bound to it hold a clone.
#[derive(Clone)]
pub(crate) struct Mr {
    inner: Arc<MrInner>,
}

struct MrInner {
    mr: NonNull<ibv_mr>,
    /// The windows bound to it, invalidated before it is deregistered (verbs refuses to
    /// deregister a region with bound windows).
    windows: Mutex<Vec<Weak<MwInner>>>,
    _pd: Pd,
}

// SAFETY: a registration is used only through verbs calls, which are thread-safe, and read
// fields that never change; it is deregistered only in Drop.
unsafe impl Send for MrInner {}
// SAFETY: as for Send.
unsafe impl Sync for MrInner {}

impl Mr {
    pub(crate) fn lkey(&self) -> u32 {
        // SAFETY: the registration is live while self is; lkey never changes.
        unsafe { (*self.inner.mr.as_ptr()).lkey }
    }

    pub(crate) fn rkey(&self) -> u32 {
        // SAFETY: as for lkey.
        unsafe { (*self.inner.mr.as_ptr()).rkey }
    }

    pub(crate) fn raw(&self) -> *mut ibv_mr {
        self.inner.mr.as_ptr()
    }
}

impl Drop for MrInner {
    fn drop(&mut self) {
        let windows = std::mem::take(&mut *self.windows.lock().unwrap_or_else(|p| p.into_inner()));
        for w in windows.iter().filter_map(Weak::upgrade) {
            w.invalidate_if_on(self.mr.as_ptr());
        }
        // SAFETY: every request that used this region held a clone of its MemoryRegion until
        // completed, and every window bound to it was just invalidated: nothing refers to it.
        unsafe { rdma_sys::ibv_dereg_mr(self.mr.as_ptr()) };
    }
}

/// The rights ODP must cover for `access` (`IBV_ODP_SUPPORT_*`).
fn odp_needed(access: Access) -> u32 {
    let mut need = 0;
    if access.contains(Access::REMOTE_WRITE) {
        need |= odp::IBV_ODP_SUPPORT_WRITE.0;
    }
    if access.contains(Access::REMOTE_READ) {
        need |= odp::IBV_ODP_SUPPORT_READ.0;
    }
    if access.contains(Access::REMOTE_ATOMIC) {
        need |= odp::IBV_ODP_SUPPORT_ATOMIC.0;
    }
    need
}

/// Whether the memory must be registered with on-demand paging, or the reason it cannot be
/// registered on this device at all.
pub(crate) fn plan(
    backing: MemoryBacking,
    access: Access,
    caps: &Caps,
) -> std::result::Result<bool, &'static str> {
    let odp_ok = caps.odp
        && caps.odp_defect.is_none()
        && caps.odp_rc & odp_needed(access) == odp_needed(access);
    if let (Some(defect), MemoryBacking::FsDax | MemoryBacking::PageCache) =
        (caps.odp_defect, backing)
    {
        if caps.odp {
            return Err(defect);
        }
    }
    match backing {
        MemoryBacking::FsDax if odp_ok => Ok(true),
        MemoryBacking::FsDax => Err(
            "fsdax pages cannot be pinned for a NIC (the kernel refuses long-term pins of DAX \
             file pages) and this device has no on-demand paging (ODP) for these rights: use a \
             devdax namespace, or an ODP-capable NIC",
        ),
        MemoryBacking::PageCache if odp_ok => Ok(true),
        MemoryBacking::PageCache => Err(
            "page-cache file pages cannot be pinned for a NIC (long-term pins of writable file \
             pages are refused by Linux 6.5 and later, and break write-back before) and this \
             device has no on-demand paging (ODP) for these rights: use devdax, tmpfs, or an \
             ODP-capable NIC",
        ),
        _ => Ok(false),
    }
}

/// Whether the pages of `len` bytes at `addr` alone are more than the process's
/// RLIMIT_MEMLOCK (soft) allows (the kernel counts whole pages).
fn exceeds_memlock(addr: usize, len: u64) -> bool {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the struct it is given.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut r) } != 0 {
        return true;
    }
    // SAFETY: sysconf has no preconditions.
    let page = (unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).max(4096) as u64;
    let first = addr as u64 / page;
    let last = (addr as u64).saturating_add(len.max(1)).div_ceil(page);
    let pinned = (last - first).saturating_mul(page);
    r.rlim_cur != libc::RLIM_INFINITY && pinned > r.rlim_cur
}

impl super::device::Device {
    /// How memory of `backing` would be registered for `access` on this device, or why it
    /// cannot be.
    pub(crate) fn registration(
        &self,
        backing: MemoryBacking,
        access: Access,
    ) -> std::result::Result<Registration, &'static str> {
        plan(backing, access, self.caps()).map(|on_demand| {
            if on_demand {
                Registration::OnDemand
            } else {
                Registration::Pinned
            }
        })
    }

    /// Registers the grant's range in `pd`.
    pub(crate) fn register_mr(&self, pd: &Pd, g: &Grant<'_>) -> Result<Mr> {
        let refuse = |reason| Error::Register {
            addr: g.base as usize,
            len: g.len as usize,
            reason,
        };
        let odp_on = plan(g.region.backing(), g.access, self.caps()).map_err(refuse)?;
        let mut flags = translate::access_to_ibv(g.access, self.caps().atomics);
        if odp_on {
            flags |= ia::IBV_ACCESS_ON_DEMAND.0;
        }
        let addr = g.region.addr().wrapping_add(g.offset as usize);
        // SAFETY: the PD is live; [addr, addr+len) is the region's registered memory, which
        // the Region (kept by the MemoryRegion that will own this registration, and by every
        // request using it) keeps mapped for as long as the registration exists.
        let mr =
            unsafe { rdma_sys::ibv_reg_mr(pd.raw(), addr.cast(), g.len as usize, flags as i32) };
        let Some(mr) = NonNull::new(mr) else {
            let e = std::io::Error::last_os_error();
            // An on-demand paging registration pins nothing: its ENOMEM is the kernel's own
            // memory, said as such (the namespace is listed unavailable with it).
            let pinned = !odp_on;
            if pinned && matches!(e.raw_os_error(), Some(libc::ENOMEM | libc::EPERM)) {
                // The limit counts every pin of the process: one this range alone exceeds never
                // fits; one that fits alone was refused for what other registrations hold,
                // and fits again when they are gone.
                if !exceeds_memlock(addr as usize, g.len) {
                    return Err(Error::Exhausted {
                        what: "locked memory (RLIMIT_MEMLOCK, held by other registrations)",
                    });
                }
                return Err(refuse(
                    "the kernel refused to pin it (ENOMEM/EPERM): RLIMIT_MEMLOCK is too low; \
                     raise LimitMEMLOCK (systemd) or `ulimit -l`, or grant CAP_IPC_LOCK",
                ));
            }
            return Err(Error::Verbs {
                op: "ibv_reg_mr",
                source: e,
            });
        };
        Ok(Mr {
            inner: Arc::new(MrInner {
                mr,
                windows: Mutex::new(Vec::new()),
                _pd: pd.clone(),
            }),
        })
    }

    /// A type-2 memory window in `pd`.
    pub(crate) fn alloc_mw(&self, pd: &Pd) -> Result<Mw> {
        if !self.caps().mw_type2 {
            return Err(Error::MemoryWindow {
                reason: "this RDMA device has no type-2 memory windows: use a region per \
                         connection",
            });
        }
        let raw = alloc_raw(pd)?;
        Ok(Mw {
            inner: Arc::new(MwInner {
                pd: pd.clone(),
                state: Mutex::new(MwState {
                    raw: Some(raw),
                    // SAFETY: just allocated, live.
                    rkey: unsafe { (*raw.as_ptr()).rkey },
                    on: None,
                }),
            }),
        })
    }
}

fn alloc_raw(pd: &Pd) -> Result<NonNull<ibv_mw>> {
    // SAFETY: the PD is live; the window is deallocated by MwInner (invalidate or Drop).
    let mw = unsafe { rdma_sys::ibv_alloc_mw(pd.raw(), ibv_mw_type::IBV_MW_TYPE_2) };
    mw.and_then(NonNull::new)
        .ok_or_else(|| sys::errno("ibv_alloc_mw"))
}

/// A type-2 memory window.
pub(crate) struct Mw {
    inner: Arc<MwInner>,
}

struct MwInner {
    pd: Pd,
    state: Mutex<MwState>,
}

struct MwState {
    /// None after a failed re-allocation: the window then refuses to bind.
    raw: Option<NonNull<ibv_mw>>,
    rkey: u32,
    /// The region it is bound to.
    on: Option<*mut ibv_mr>,
}

// SAFETY: the window is used only under its lock, through thread-safe verbs calls.
unsafe impl Send for MwInner {}
// SAFETY: as for Send.
unsafe impl Sync for MwInner {}

impl Mw {
    pub(crate) fn rkey(&self) -> u32 {
        self.inner.lock().rkey
    }

    /// Binds the window over the grant's range of `mr` (its region): `post` posts the bind
    /// (`ibv_mw`, new rkey, rights) on the queue pair and waits for it. Returns the new rkey.
    pub(crate) fn bind(
        &self,
        mr: &Mr,
        g: &Grant<'_>,
        post: impl FnOnce(*mut ibv_mw, u32, u32) -> Result<()>,
    ) -> Result<u32> {
        let mut st = self.inner.lock();
        if needs_fresh(&st) {
            self.inner.replace(&mut st);
        }
        let raw = st.raw.ok_or(Error::MemoryWindow {
            reason: "the window could not be re-allocated after its last invalidation",
        })?;
        let rkey = inc_rkey(st.rkey);
        let access = translate::access_to_ibv(g.access, true);
        post(raw.as_ptr(), rkey, access)?;
        st.rkey = rkey;
        st.on = Some(mr.raw());
        remember(
            &mut mr.inner.windows.lock().unwrap_or_else(|p| p.into_inner()),
            &self.inner,
        );
        Ok(rkey)
    }

    /// Invalidates the window (see the module docs); returns its new rkey.
    pub(crate) fn invalidate(&self) -> u32 {
        self.inner.reset();
        self.rkey()
    }
}

/// Whether the window must be replaced before a bind: a bound type-2 window cannot be bound
/// again (only a free one can).
fn needs_fresh(st: &MwState) -> bool {
    st.on.is_some()
}

/// The next rkey of a window: the same index, the key byte (the low 8 bits) one on, wrapping
/// (rdma-sys's `ibv_inc_rkey` adds one to the whole key, which overflows at `u32::MAX`).
fn inc_rkey(rkey: u32) -> u32 {
    (rkey & !0xff) | (rkey.wrapping_add(1) & 0xff)
}

/// Adds `w` to a region's windows, once, and forgets the ones that are gone.
fn remember<T>(windows: &mut Vec<Weak<T>>, w: &Arc<T>) {
    windows.retain(|x| x.strong_count() > 0 && !std::ptr::eq(x.as_ptr(), Arc::as_ptr(w)));
    windows.push(Arc::downgrade(w));
}

impl MwInner {
    fn lock(&self) -> std::sync::MutexGuard<'_, MwState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Replaces the `ibv_mw` with a fresh, unbound one.
    fn reset(&self) {
        let mut st = self.lock();
        self.replace(&mut st);
    }

    fn replace(&self, st: &mut MwState) {
        if let Some(raw) = st.raw.take() {
            // SAFETY: the window is live and deallocated once (it was taken out of the state).
            unsafe { rdma_sys::ibv_dealloc_mw(raw.as_ptr()) };
        }
        st.on = None;
        match alloc_raw(&self.pd) {
            Ok(raw) => {
                // SAFETY: just allocated, live.
                st.rkey = unsafe { (*raw.as_ptr()).rkey };
                st.raw = Some(raw);
            }
            Err(_) => st.rkey = 0,
        }
    }

    fn invalidate_if_on(&self, mr: *mut ibv_mr) {
        if self.lock().on == Some(mr) {
            self.reset();
        }
    }
}

impl Drop for MwInner {
    fn drop(&mut self) {
        if let Some(raw) = self
            .state
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .raw
            .take()
        {
            // SAFETY: the window is live and deallocated once, here.
            unsafe { rdma_sys::ibv_dealloc_mw(raw.as_ptr()) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caps(with_odp: bool, odp_rc: u32) -> Caps {
        Caps {
            max_qp_wr: 1024,
            max_cqe: 4096,
            max_qp_rd_atom: 16,
            max_qp_init_rd_atom: 16,
            atomics: true,
            atomic_write: false,
            mw_type2: true,
            odp: with_odp,
            odp_rc,
            odp_defect: None,
        }
    }

    #[test]
    fn what_is_pinned_and_what_needs_odp() {
        let rw = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
        let none = caps(false, 0);
        assert_eq!(plan(MemoryBacking::Ram, rw, &none), Ok(false));
        assert_eq!(plan(MemoryBacking::DevDax, rw, &none), Ok(false));
        let e = plan(MemoryBacking::FsDax, rw, &none).unwrap_err();
        assert!(
            e.contains("fsdax") && e.contains("ODP") && e.contains("devdax"),
            "{e}"
        );
        let e = plan(MemoryBacking::PageCache, rw, &none).unwrap_err();
        assert!(e.contains("page-cache") && e.contains("ODP"), "{e}");

        let full = odp::IBV_ODP_SUPPORT_WRITE.0
            | odp::IBV_ODP_SUPPORT_READ.0
            | odp::IBV_ODP_SUPPORT_ATOMIC.0;
        assert_eq!(plan(MemoryBacking::FsDax, rw, &caps(true, full)), Ok(true));
        assert_eq!(
            plan(MemoryBacking::PageCache, rw, &caps(true, full)),
            Ok(true)
        );
        // ODP that does not cover a right asked for is no ODP for this registration.
        let no_atomic = odp::IBV_ODP_SUPPORT_WRITE.0 | odp::IBV_ODP_SUPPORT_READ.0;
        assert!(plan(
            MemoryBacking::FsDax,
            rw | Access::REMOTE_ATOMIC,
            &caps(true, no_atomic)
        )
        .is_err());
        assert_eq!(
            plan(MemoryBacking::FsDax, rw, &caps(true, no_atomic)),
            Ok(true)
        );
        // Pinnable memory never uses ODP, even where the device has it.
        assert_eq!(
            plan(MemoryBacking::DevDax, rw, &caps(true, full)),
            Ok(false)
        );
        // A device whose ODP misplaces data (Soft-RoCE): file pages are refused with that
        // reason, pinnable memory is registered as ever.
        let broken = Caps {
            odp_defect: Some(super::super::caps::RXE_ODP_DEFECT),
            ..caps(true, full)
        };
        for b in [MemoryBacking::PageCache, MemoryBacking::FsDax] {
            let e = plan(b, rw, &broken).unwrap_err();
            assert!(e.contains("wrong offset"), "{b:?}: {e}");
        }
        assert_eq!(plan(MemoryBacking::Ram, rw, &broken), Ok(false));
        assert_eq!(plan(MemoryBacking::DevDax, rw, &broken), Ok(false));
    }

    #[test]
    fn rkeys_step_in_the_key_byte_only() {
        assert_eq!(inc_rkey(0x1234_5600), 0x1234_5601);
        assert_eq!(inc_rkey(0x1234_56ff), 0x1234_5600);
        // No overflow at the top (a debug build's panic with rkey + 1).
        assert_eq!(inc_rkey(u32::MAX), 0xffff_ff00);
        assert_eq!(inc_rkey(0), 1);
    }

    #[test]
    fn a_bound_window_is_replaced_before_it_is_bound_again() {
        let mut st = MwState {
            raw: None,
            rkey: 7,
            on: None,
        };
        assert!(!needs_fresh(&st), "a free window binds as it is");
        st.on = Some(std::ptr::null_mut::<ibv_mr>().wrapping_add(1));
        assert!(needs_fresh(&st), "a bound one must be replaced first");
    }

    #[test]
    fn a_region_remembers_each_window_once_and_forgets_dead_ones() {
        let mut list: Vec<Weak<u8>> = Vec::new();
        let (a, b) = (Arc::new(1u8), Arc::new(2u8));
        for _ in 0..5 {
            remember(&mut list, &a);
        }
        assert_eq!(list.len(), 1, "rebinding does not grow the list");
        remember(&mut list, &b);
        assert_eq!(list.len(), 2);
        drop(a);
        let c = Arc::new(3u8);
        remember(&mut list, &c);
        let live: Vec<u8> = list.iter().filter_map(Weak::upgrade).map(|x| *x).collect();
        assert_eq!(live, vec![2, 3]);
        assert_eq!(list.len(), 2, "the dead window's entry is gone");
    }

    #[test]
    fn odp_rights_follow_the_access() {
        assert_eq!(odp_needed(Access::LOCAL_WRITE), 0);
        assert_eq!(odp_needed(Access::REMOTE_READ), odp::IBV_ODP_SUPPORT_READ.0);
        assert_eq!(
            odp_needed(Access::REMOTE_WRITE | Access::REMOTE_ATOMIC),
            odp::IBV_ODP_SUPPORT_WRITE.0 | odp::IBV_ODP_SUPPORT_ATOMIC.0
        );
    }
}
