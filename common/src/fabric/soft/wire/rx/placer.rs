//! The receiver's contract with whoever owns placement: a [`Placer`] says where each data
//! payload goes ([`Placement`], a [`DirectTarget`] for registered memory) and writes the checked
//! payloads the receiver hands it. The receiver names no placement code: it yields headers and
//! payload bytes, and reads a large payload from the stream into the [`VolatileSlice`] of a
//! target; the copies into place (plain, with non-temporal stores, a `pwrite` into a page-cache
//! file) are the placer's.

use std::os::fd::RawFd;

use super::super::codes::TermCause;
use super::super::ddp::Header;
use super::super::error::{Result, WireError};
use crate::volatile::VolatileSlice;

/// Registered memory a payload is placed into.
#[derive(Debug)]
pub struct DirectTarget {
    pub(crate) dst: VolatileSlice<'static>,
    pub(crate) writeback: bool,
    /// The memory is a shared mapping of this file's page cache: the payload goes in with
    /// `pwrite` at this file offset (the offset of `dst`'s first byte) instead of a copy.
    pub(crate) file: Option<(RawFd, u64)>,
}

// SAFETY: `DirectTarget::new`'s contract makes the range valid from whichever thread polls the
// receiver; the slice only reaches it through copies and iovecs, which any thread may use.
unsafe impl Send for DirectTarget {}

impl DirectTarget {
    /// A placement at `ptr` for up to `len` bytes.
    ///
    /// # Safety
    /// From the moment this is returned to the receiver until the `poll` call that reports the
    /// FPDU (or fails, or the receiver is dropped): `ptr..ptr + len` stays valid for reads and
    /// writes, and no Rust reference to its bytes is used (the contract of
    /// [`VolatileSlice::new`]). Other parties may read and write the bytes meanwhile through raw
    /// pointers or the kernel: another queue pair placing into them, the memory's owner
    /// copying out of them; the receiver forms no reference to them either. The caller has
    /// checked STag, bounds and rights for it.
    pub unsafe fn new(ptr: *mut u8, len: usize) -> DirectTarget {
        DirectTarget {
            // SAFETY: this function's own contract, for as long as the receiver holds it.
            dst: unsafe { VolatileSlice::new(ptr, len) },
            writeback: false,
            file: None,
        }
    }

    /// Asks that the payload be written into `fd` at `offset` with `pwrite(2)` rather than
    /// copied into the memory: the memory is that file's page cache (a shared mapping of it,
    /// [`RegisteredMemory::placement_file`](crate::fabric::RegisteredMemory::placement_file)),
    /// so the bytes land in the same place without a store into a mapped page (no write fault
    /// where the last write-back cleaned the page). A payload placed this way is never staged
    /// through the memory, and the receiver gathers it before writing it (never read from the
    /// stream into place).
    ///
    /// # Safety
    /// `fd` stays open, and is the file the memory maps from its offset `offset` at the
    /// target's first byte, for as long as the receiver holds this target (as for
    /// [`DirectTarget::new`]'s range).
    pub unsafe fn into_file(mut self, fd: RawFd, offset: u64) -> DirectTarget {
        self.file = Some((fd, offset));
        self
    }

    /// Asks that the placed bytes also leave the CPU cache (memory made durable by a cache
    /// write-back: dax). Where the receiver copies the payload into place it then uses
    /// non-temporal stores (and writes back the partial lines at either end), and says so in
    /// [`Received::written_back`](super::Received::written_back): only a store fence is then
    /// needed to make the bytes durable.
    /// A payload the receiver reads from the stream straight into place is not written back.
    pub fn with_cache_writeback(mut self) -> DirectTarget {
        self.writeback = true;
        self
    }

    /// Bytes available at the target.
    pub fn len(&self) -> usize {
        self.dst.len()
    }

    /// Whether the target is empty.
    #[cfg_attr(not(feature = "wire-testing"), allow(dead_code))] // `len`'s pair
    pub fn is_empty(&self) -> bool {
        self.dst.is_empty()
    }
}

/// Where a data payload goes.
#[derive(Debug)]
pub enum Placement {
    /// Straight into registered memory.
    Direct(DirectTarget),
    /// Into the receiver's buffer, handed back in
    /// [`Delivered::Buffered`](super::Delivered::Buffered) (small untagged messages the engine
    /// copies itself).
    Buffer,
    /// Nowhere (read and dropped).
    Discard,
}

/// Decides placement for each data segment (Write, Read Response, the Sends), and places what
/// the receiver gathered.
pub trait Placer {
    /// Called once per data FPDU, after its header (and with CRC on, its CRC) passed and before
    /// any payload byte is placed. `Err(cause)` refuses it: nothing is placed and `poll` fails
    /// with [`WireError::Refused`].
    ///
    /// # Errors
    /// The Terminate cause that the refusal calls for.
    fn place(
        &mut self,
        header: &Header,
        payload_len: usize,
    ) -> std::result::Result<Placement, TermCause>;

    /// Writes a checked payload, whole, into the target [`Placer::place`] chose for it: every
    /// direct payload with CRC on (after its CRC passed), and with CRC off those the receiver
    /// gathered instead of reading them from the stream into place. `target` is at least
    /// `payload.len()` long (the receiver checked). Returns whether the bytes also left the CPU
    /// cache ([`Received::written_back`](super::Received::written_back)).
    ///
    /// # Errors
    /// What `poll` then fails with: [`WireError::PlacementTooShort`] for a target shorter than
    /// the payload, [`WireError::PlacementFailed`] when writing into a page-cache file failed.
    fn write(&mut self, target: DirectTarget, payload: &[u8]) -> Result<bool>;

    /// With CRC off, where a direct payload arrives over several polls: called before each
    /// further piece of it is read into place, and before a gathered one is handed to
    /// [`Placer::write`]. `Err(cause)`: the target [`Placer::place`] chose may not be written
    /// any more (its registration was revoked since); the FPDU stops there, what was placed
    /// of it before stays, and `poll` fails with [`WireError::Refused`]. The default allows.
    ///
    /// # Errors
    /// The Terminate cause that the refusal calls for.
    fn recheck(&mut self, header: &Header) -> std::result::Result<(), TermCause> {
        let _ = header;
        Ok(())
    }
}

/// The error of a direct placement of `dst` for a payload of `need` bytes.
pub(super) fn too_short(need: usize, dst: &DirectTarget) -> WireError {
    WireError::PlacementTooShort {
        need,
        given: dst.len(),
    }
}
