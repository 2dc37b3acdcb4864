//! The STag table of a soft device: rkey -> registered range, rights and owner.
//!
//! An STag is `(slot + 1) << 8 | key`: 24 bits of slot index (0 is never a valid STag) and an
//! 8-bit key that changes whenever a window is bound again, so an old rkey of a reused slot is
//! refused.

use std::sync::{Arc, RwLock};

use crate::fabric::error::{Error, Result};
use crate::fabric::memory::{Grant, Region};
use crate::fabric::types::Access;

/// What an STag names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StagKind {
    /// A memory region: any queue pair of its protection domain may use it.
    Mr,
    /// A type 2 memory window bound to queue pair `qp`.
    Mw { qp: u32 },
}

/// A valid STag's target.
pub(crate) struct StagEntry {
    pub(crate) region: Arc<Region>,
    /// Virtual address of the first byte reachable (the tagged offset that names it).
    pub(crate) base: u64,
    /// Bytes reachable.
    pub(crate) len: u64,
    /// Offset of `base` into `region`.
    pub(crate) offset: u64,
    pub(crate) access: Access,
    pub(crate) pd: u32,
    pub(crate) kind: StagKind,
}

/// Why a remote access was refused; each maps to one Terminate cause.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AccessFault {
    /// No such STag (never valid, deregistered, invalidated, or an old key).
    InvalidStag,
    /// The STag belongs to another protection domain or is a window bound to another QP.
    NotAssociated,
    /// The range reaches outside the region or window (or wraps).
    BaseBounds,
    /// A right is missing.
    Rights,
}

/// Why a peer's Send with Invalidate could not invalidate its STag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum InvalidateFault {
    /// No such STag (never valid, deregistered, already invalidated, or an old key).
    InvalidStag,
    /// An STag of another protection domain, or a window bound to another queue pair.
    NotAssociated,
    /// A memory region's STag of this domain: only windows can be invalidated remotely.
    NotAWindow,
}

/// A checked access: where the bytes live, and the region for persistence.
pub(crate) struct Target {
    pub(crate) region: Arc<Region>,
    /// Offset into the region of the first byte.
    pub(crate) offset: usize,
}

impl Target {
    pub(crate) fn ptr(&self) -> *mut u8 {
        // The offset was bounds-checked against the region when the target was made.
        self.region.addr().wrapping_add(self.offset)
    }
}

impl StagEntry {
    /// The entry for what a registration (`Mr`) or a window binding (`Mw`) grants.
    pub(crate) fn granted(g: &Grant<'_>, kind: StagKind) -> StagEntry {
        StagEntry {
            region: Arc::clone(g.region),
            base: g.base,
            len: g.len,
            offset: g.offset,
            access: g.access,
            pd: g.pd,
            kind,
        }
    }

    /// Checks an access of `len` bytes at tagged offset `to` with rights `need` by a queue pair
    /// `qp` of protection domain `pd`.
    pub(crate) fn check(
        &self,
        pd: u32,
        qp: u32,
        to: u64,
        len: u64,
        need: Access,
    ) -> std::result::Result<Target, AccessFault> {
        if self.pd != pd {
            return Err(AccessFault::NotAssociated);
        }
        if let StagKind::Mw { qp: bound } = self.kind {
            if bound != qp {
                return Err(AccessFault::NotAssociated);
            }
        }
        let rel = to.checked_sub(self.base).ok_or(AccessFault::BaseBounds)?;
        let end = rel.checked_add(len).ok_or(AccessFault::BaseBounds)?;
        if end > self.len {
            return Err(AccessFault::BaseBounds);
        }
        if !self.access.contains(need) {
            return Err(AccessFault::Rights);
        }
        Ok(Target {
            region: Arc::clone(&self.region),
            offset: (self.offset + rel) as usize,
        })
    }
}

struct Slot {
    key: u8,
    in_use: bool,
    entry: Option<Arc<StagEntry>>,
}

#[derive(Default)]
struct Slots {
    slots: Vec<Slot>,
    free: Vec<u32>,
}

const MAX_SLOTS: usize = (1 << 24) - 1;

fn split(stag: u32) -> Option<(usize, u8)> {
    let idx = (stag >> 8) as usize;
    (idx != 0).then(|| (idx - 1, stag as u8))
}

fn join(idx: usize, key: u8) -> u32 {
    ((idx as u32 + 1) << 8) | key as u32
}

/// The device-wide STag table. Lookups take a read lock; (de)registration a write lock.
pub(crate) struct StagTable {
    inner: RwLock<Slots>,
}

impl StagTable {
    pub(crate) fn new() -> StagTable {
        StagTable {
            inner: RwLock::new(Slots::default()),
        }
    }

    fn alloc(&self, entry: Option<Arc<StagEntry>>) -> Result<u32> {
        let mut t = self.inner.write().unwrap_or_else(|p| p.into_inner());
        let idx = match t.free.pop() {
            Some(i) => i as usize,
            None => {
                if t.slots.len() >= MAX_SLOTS {
                    return Err(Error::Exhausted { what: "STags" });
                }
                t.slots.push(Slot {
                    key: 0,
                    in_use: false,
                    entry: None,
                });
                t.slots.len() - 1
            }
        };
        let slot = &mut t.slots[idx];
        // A fresh key per use of the slot: an rkey of the slot's previous user stays invalid.
        slot.key = slot.key.wrapping_add(1);
        slot.in_use = true;
        slot.entry = entry;
        Ok(join(idx, slot.key))
    }

    /// Registers a valid entry; returns its STag.
    pub(crate) fn insert(&self, entry: StagEntry) -> Result<u32> {
        self.alloc(Some(Arc::new(entry)))
    }

    /// Reserves an STag with no target yet (a memory window before its first bind).
    pub(crate) fn reserve(&self) -> Result<u32> {
        self.alloc(None)
    }

    /// Points the slot of `stag` at `entry` under a new key; returns the new STag.
    pub(crate) fn rebind(&self, stag: u32, entry: StagEntry) -> Result<u32> {
        let mut t = self.inner.write().unwrap_or_else(|p| p.into_inner());
        let stale = Error::MemoryWindow {
            reason: "stale memory window",
        };
        let (idx, key) = split(stag).ok_or(Error::MemoryWindow {
            reason: "invalid STag",
        })?;
        let slot = t
            .slots
            .get_mut(idx)
            .filter(|s| s.in_use && s.key == key)
            .ok_or(stale)?;
        slot.key = slot.key.wrapping_add(1);
        slot.entry = Some(Arc::new(entry));
        Ok(join(idx, slot.key))
    }

    /// The entry of a valid STag.
    pub(crate) fn lookup(&self, stag: u32) -> Option<Arc<StagEntry>> {
        let (idx, key) = split(stag)?;
        let t = self.inner.read().unwrap_or_else(|p| p.into_inner());
        let slot = t.slots.get(idx)?;
        if slot.key != key {
            return None;
        }
        slot.entry.clone()
    }

    /// Makes `stag` invalid (local invalidate); the slot stays reserved. Returns whether it was
    /// valid.
    pub(crate) fn invalidate(&self, stag: u32) -> bool {
        let Some((idx, key)) = split(stag) else {
            return false;
        };
        let mut t = self.inner.write().unwrap_or_else(|p| p.into_inner());
        match t.slots.get_mut(idx) {
            Some(s) if s.in_use && s.key == key => s.entry.take().is_some(),
            _ => false,
        }
    }

    /// Invalidates `stag` on behalf of a peer's Send with Invalidate on queue pair `qp` of
    /// domain `pd`: only a window of that domain bound to that queue pair may be invalidated so.
    pub(crate) fn invalidate_remote(
        &self,
        stag: u32,
        pd: u32,
        qp: u32,
    ) -> std::result::Result<(), InvalidateFault> {
        let (idx, key) = split(stag).ok_or(InvalidateFault::InvalidStag)?;
        let mut t = self.inner.write().unwrap_or_else(|p| p.into_inner());
        let slot = t.slots.get_mut(idx).filter(|s| s.in_use && s.key == key);
        let slot = slot.ok_or(InvalidateFault::InvalidStag)?;
        let entry = slot.entry.as_ref().ok_or(InvalidateFault::InvalidStag)?;
        match entry.kind {
            _ if entry.pd != pd => return Err(InvalidateFault::NotAssociated),
            StagKind::Mr => return Err(InvalidateFault::NotAWindow),
            StagKind::Mw { qp: bound } if bound != qp => {
                return Err(InvalidateFault::NotAssociated)
            }
            StagKind::Mw { .. } => {}
        }
        slot.entry = None;
        Ok(())
    }

    /// Frees the slot of `stag` (deregistration, window dealloc). Deregistering a memory region
    /// also invalidates every window bound to it (the RAII analogue of verbs refusing to
    /// deregister a region with bound windows): a window's rkey must not outlive the memory it
    /// reaches. The windows keep their slots, so they can be bound again to another region.
    /// New access is refused from then on; what was accepted (a Read Response queued from it, a
    /// Write being placed into it) goes on, unless the region was revoked ([`Region::revoke`]):
    /// a daemon that deregisters a departing host's regions before its Disconnect must not
    /// have that host's last Reads fail with a remote access error.
    pub(crate) fn remove(&self, stag: u32) {
        let Some((idx, key)) = split(stag) else {
            return;
        };
        let mut t = self.inner.write().unwrap_or_else(|p| p.into_inner());
        let Some(s) = t.slots.get_mut(idx).filter(|s| s.in_use && s.key == key) else {
            return;
        };
        s.in_use = false;
        let removed = s.entry.take();
        t.free.push(idx as u32);
        let Some(removed) = removed.filter(|e| e.kind == StagKind::Mr) else {
            return;
        };
        // A scan of the table: deregistration is control path, and this keeps lookups free of
        // any per-region bookkeeping.
        for slot in &mut t.slots {
            let bound_here = slot.entry.as_ref().is_some_and(|e| {
                matches!(e.kind, StagKind::Mw { .. }) && Arc::ptr_eq(&e.region, &removed.region)
            });
            if bound_here {
                slot.entry = None;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fabric::memory::{AlignedBuf, Backing, RegisteredMemory};

    fn entry(kind: StagKind, access: Access) -> (StagEntry, u64) {
        let buf = AlignedBuf::new(4096).unwrap();
        let base = buf.as_mut_ptr() as u64;
        let region = Arc::new(Region::for_test(Backing::Owned(buf)));
        (
            StagEntry {
                region,
                base: base + 100,
                len: 200,
                offset: 100,
                access,
                pd: 1,
                kind,
            },
            base,
        )
    }

    #[test]
    fn stag_zero_is_never_valid_and_keys_change_on_reuse() {
        let t = StagTable::new();
        assert!(t.lookup(0).is_none());
        let (e, _) = entry(StagKind::Mr, Access::REMOTE_READ);
        let s1 = t.insert(e).unwrap();
        assert_ne!(s1 >> 8, 0);
        assert!(t.lookup(s1).is_some());
        t.remove(s1);
        assert!(t.lookup(s1).is_none());
        let (e, _) = entry(StagKind::Mr, Access::REMOTE_READ);
        let s2 = t.insert(e).unwrap();
        assert_eq!(s1 >> 8, s2 >> 8, "the slot is reused");
        assert_ne!(s1, s2, "under a new key");
        assert!(t.lookup(s1).is_none());
        // Removing with the old key leaves the new owner alone.
        t.remove(s1);
        assert!(t.lookup(s2).is_some());
    }

    #[test]
    fn check_enforces_domain_window_owner_bounds_and_rights() {
        let (e, base) = entry(StagKind::Mw { qp: 7 }, Access::REMOTE_READ);
        let start = base + 100;
        assert!(e.check(1, 7, start, 200, Access::REMOTE_READ).is_ok());
        let t = e.check(1, 7, start + 10, 8, Access::REMOTE_READ).unwrap();
        assert_eq!(t.offset, 110);
        assert_eq!(
            e.check(2, 7, start, 1, Access::REMOTE_READ).err(),
            Some(AccessFault::NotAssociated)
        );
        assert_eq!(
            e.check(1, 8, start, 1, Access::REMOTE_READ).err(),
            Some(AccessFault::NotAssociated)
        );
        assert_eq!(
            e.check(1, 7, start - 1, 1, Access::REMOTE_READ).err(),
            Some(AccessFault::BaseBounds)
        );
        assert_eq!(
            e.check(1, 7, start, 201, Access::REMOTE_READ).err(),
            Some(AccessFault::BaseBounds)
        );
        assert_eq!(
            e.check(1, 7, u64::MAX, 2, Access::REMOTE_READ).err(),
            Some(AccessFault::BaseBounds)
        );
        assert_eq!(
            e.check(1, 7, start, 8, Access::REMOTE_WRITE).err(),
            Some(AccessFault::Rights)
        );
    }

    #[test]
    fn rebind_changes_the_key_and_invalidate_revokes() {
        let t = StagTable::new();
        let w = t.reserve().unwrap();
        assert!(t.lookup(w).is_none(), "a fresh window is not bound");
        let (e, _) = entry(StagKind::Mw { qp: 3 }, Access::REMOTE_WRITE);
        let w1 = t.rebind(w, e).unwrap();
        assert_eq!(w1 >> 8, w >> 8);
        assert_ne!(w1, w);
        assert!(t.lookup(w1).is_some());
        assert!(t.lookup(w).is_none());
        let (e, _) = entry(StagKind::Mw { qp: 3 }, Access::REMOTE_WRITE);
        let w2 = t.rebind(w1, e).unwrap();
        assert!(t.lookup(w1).is_none(), "binding again revokes the old rkey");
        assert!(t.invalidate(w2));
        assert!(t.lookup(w2).is_none());
        assert!(!t.invalidate(w2));
        assert!(t
            .rebind(w1, entry(StagKind::Mr, Access::REMOTE_WRITE).0)
            .is_err());
    }

    #[test]
    fn removing_a_region_invalidates_the_windows_bound_to_it() {
        let t = StagTable::new();
        let (mr_entry, _) = entry(StagKind::Mr, Access::REMOTE_WRITE);
        let region = Arc::clone(&mr_entry.region);
        let mr = t.insert(mr_entry).unwrap();
        let window_on = |region: &Arc<Region>| StagEntry {
            region: Arc::clone(region),
            base: region.addr() as u64,
            len: 64,
            offset: 0,
            access: Access::REMOTE_WRITE,
            pd: 1,
            kind: StagKind::Mw { qp: 3 },
        };
        let w1 = t.rebind(t.reserve().unwrap(), window_on(&region)).unwrap();
        let w2 = t.rebind(t.reserve().unwrap(), window_on(&region)).unwrap();
        // A window on another region, and the other region itself, stay valid.
        let (other_entry, _) = entry(StagKind::Mr, Access::REMOTE_WRITE);
        let other_region = Arc::clone(&other_entry.region);
        let other = t.insert(other_entry).unwrap();
        let w3 = t
            .rebind(t.reserve().unwrap(), window_on(&other_region))
            .unwrap();
        t.remove(w3);
        assert!(
            !other_region.revoked(),
            "removing a window revokes no region"
        );
        let w3 = t
            .rebind(t.reserve().unwrap(), window_on(&other_region))
            .unwrap();
        t.remove(mr);
        assert!(t.lookup(mr).is_none());
        assert!(
            !region.revoked(),
            "a deregistration lets what was accepted finish"
        );
        assert!(t.lookup(w1).is_none(), "window 1 outlived its region");
        assert!(t.lookup(w2).is_none(), "window 2 outlived its region");
        assert!(t.lookup(other).is_some());
        assert!(t.lookup(w3).is_some());
        // The table no longer holds the region: only this test does.
        assert_eq!(Arc::strong_count(&region), 1);
        // The windows keep their slots and can be bound again.
        let w1b = t.rebind(w1, window_on(&other_region)).unwrap();
        assert!(t.lookup(w1b).is_some());
        // Removing a window leaves its region alone.
        t.remove(w3);
        assert!(t.lookup(other).is_some());
    }

    #[test]
    fn remote_invalidate_only_for_windows_of_that_qp() {
        let t = StagTable::new();
        let mr = t
            .insert(entry(StagKind::Mr, Access::REMOTE_READ).0)
            .unwrap();
        assert_eq!(
            t.invalidate_remote(mr, 1, 3),
            Err(InvalidateFault::NotAWindow)
        );
        assert_eq!(
            t.invalidate_remote(mr, 2, 3),
            Err(InvalidateFault::NotAssociated)
        );
        assert!(t.lookup(mr).is_some());
        let w = t.reserve().unwrap();
        let w = t
            .rebind(w, entry(StagKind::Mw { qp: 3 }, Access::REMOTE_READ).0)
            .unwrap();
        assert_eq!(
            t.invalidate_remote(w, 1, 4),
            Err(InvalidateFault::NotAssociated)
        );
        assert_eq!(
            t.invalidate_remote(w, 2, 3),
            Err(InvalidateFault::NotAssociated)
        );
        assert_eq!(t.invalidate_remote(w, 1, 3), Ok(()));
        assert!(t.lookup(w).is_none());
        assert_eq!(
            t.invalidate_remote(w, 1, 3),
            Err(InvalidateFault::InvalidStag)
        );
        assert_eq!(
            t.invalidate_remote(0x1234_5600, 1, 3),
            Err(InvalidateFault::InvalidStag)
        );
    }
}
