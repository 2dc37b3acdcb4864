//! The callers' buffers a pool's slots write from or read into ([`WriteBuf`]): which slot's
//! request is on which buffer, and each buffer's registration in the pool's domain.

use std::sync::{Arc, Weak};

use rpma_common::fabric::{self, AlignedBuf, MemoryRegion, ProtectionDomain, Sge};

use super::register::register;
use crate::idmap::IdMap;
use crate::writebuf::{Hold, Holds, WriteBuf};

/// Where the bytes of a slot's request are when they are not in the slot: a caller's
/// [`WriteBuf`], from byte `at`.
struct Ext {
    id: u64,
    mem: Arc<AlignedBuf>,
    mr: Arc<MemoryRegion>,
    at: usize,
    /// Keeps the caller from refilling the buffer until the slot is free.
    hold: Hold,
}

/// The slots whose request is on a caller's buffer.
#[derive(Default)]
pub(super) struct Callers {
    slots: IdMap<usize, Ext>,
    /// This pool's registrations of callers' buffers, by buffer id, while a buffer lives (its
    /// weak handle tells); made again in a new domain.
    mrs: IdMap<u64, (Weak<Holds>, Arc<MemoryRegion>)>,
}

impl Callers {
    /// Puts `slot`'s request on `buf` from byte `at` (registered in `pd` the first time) and
    /// holds the buffer: for a write from it, or with `read` for a Read into it.
    pub(super) fn put(
        &mut self,
        pd: &ProtectionDomain,
        slot: usize,
        buf: &WriteBuf,
        at: usize,
        read: bool,
    ) -> fabric::Result<()> {
        debug_assert!(
            if read {
                buf.writes_held() == 0
            } else {
                buf.reads_held() == 0
            },
            "a Read into a buffer a write from it is held for, or the reverse"
        );
        if !self.mrs.contains_key(&buf.id()) {
            self.mrs.retain(|_, (alive, _)| alive.strong_count() > 0);
        }
        let mr = registration(&mut self.mrs, pd, buf.id(), buf.mem(), || buf.alive())?;
        let e = Ext {
            id: buf.id(),
            mem: Arc::clone(buf.mem()),
            mr,
            at,
            hold: buf.hold(read),
        };
        self.slots.insert(slot, e);
        Ok(())
    }

    /// Takes `slot`'s request off its buffer, if it is on one: the hold, to let go.
    pub(super) fn take(&mut self, slot: usize) -> Option<Hold> {
        self.slots.remove(&slot).map(|e| e.hold)
    }

    /// Whether `slot`'s request is on a caller's buffer.
    pub(super) fn contains(&self, slot: usize) -> bool {
        self.slots.contains_key(&slot)
    }

    /// The local side of `len` bytes from byte `at` of `slot`'s request, if it is on a
    /// caller's buffer.
    pub(super) fn sge(&self, slot: usize, at: usize, len: usize) -> Option<Sge> {
        self.slots
            .get(&slot)
            .map(|e| Sge::new(&e.mr, e.at + at, len))
    }

    /// Copies the first `out.len()` bytes of `slot`'s request out of its caller's buffer, if
    /// it is on one.
    pub(super) fn read(&self, slot: usize, out: &mut [u8]) -> Option<fabric::Result<()>> {
        self.slots.get(&slot).map(|e| e.mem.read_at(e.at, out))
    }

    /// The registration `slot`'s request uses (tests).
    #[cfg(test)]
    pub(super) fn mr(&self, slot: usize) -> Option<Arc<MemoryRegion>> {
        self.slots.get(&slot).map(|e| Arc::clone(&e.mr))
    }

    /// Registers the buffers that slots are on in `pd` (a new connection's domain), once each,
    /// into the cache the next requests on them find; the others register again when next
    /// used.
    pub(super) fn rebind(&mut self, pd: &ProtectionDomain) -> fabric::Result<()> {
        self.mrs.clear();
        for e in self.slots.values_mut() {
            e.mr = registration(&mut self.mrs, pd, e.id, &e.mem, || e.hold.alive())?;
        }
        Ok(())
    }
}

/// Buffer `id`'s registration in `mrs`, registering `mem` in `pd` (and keeping it, with the
/// buffer's weak handle) when there is none.
fn registration(
    mrs: &mut IdMap<u64, (Weak<Holds>, Arc<MemoryRegion>)>,
    pd: &ProtectionDomain,
    id: u64,
    mem: &Arc<AlignedBuf>,
    alive: impl FnOnce() -> Weak<Holds>,
) -> fabric::Result<Arc<MemoryRegion>> {
    if let Some((_, mr)) = mrs.get(&id) {
        return Ok(Arc::clone(mr));
    }
    let mr = register(pd, mem)?;
    mrs.insert(id, (alive(), Arc::clone(&mr)));
    Ok(mr)
}
