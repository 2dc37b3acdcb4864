//! The persist seam: the narrow interface through which the fabric's placement engine and the
//! target's flush service make ranges durable. A real mapping implements it by its domain
//! (`media.rs`), the power-loss simulation over one (`sim.rs`), and `Mapping` dispatches to
//! whichever the namespace was opened with.

use super::domain::{Domain, Durability, SyncFailure};
use super::error::Result;

/// The narrow interface the fabric's placement engine and the target's flush service use, and
/// that a power-loss simulator can implement instead of real media.
///
/// Contract: after `persist(r)` returns `Ok(Durable)`, every store to `r` made before the call
/// (by this thread, or by another one or a NIC and made visible to this thread first) survives a
/// crash of the process, and on a durable domain a power loss. `Ok(VisibleOnly)` says only that
/// the bytes are visible; nothing survives power loss. An `Err` promises nothing about the range.
///
/// A failed write-back is not forgotten: after the first one (seen by this store, or reported
/// to it with [`Persist::record_failure`] by whoever synced the backing file another way),
/// every persist, flush and drain fails with [`Error::Failed`](super::Error::Failed) until the
/// store is reopened.
pub trait Persist: Send + Sync {
    /// The domain this store is in.
    fn domain(&self) -> Domain;
    /// Makes `[offset, offset+len)` of the mapping durable (cache write-back + sfence for dax,
    /// msync(MS_SYNC) of the page-aligned range for page-cache, nothing for volatile ->
    /// `Ok(Durability::VisibleOnly)`). Unaligned ranges allowed; out-of-range -> `Err`.
    fn persist(&self, offset: usize, len: usize) -> Result<Durability>;
    /// Starts write-back of a range without waiting (dax: clwb/clflushopt without the fence;
    /// page-cache: sync_file_range start); [`Persist::drain`] on the same thread then waits for
    /// it (on dax the fence orders only the write-backs of the CPU that runs it: drain on the
    /// thread that flushed). Out-of-range -> `Err`.
    fn flush(&self, offset: usize, len: usize) -> Result<()>;
    /// Waits until every range this thread flushed so far is durable (or, on volatile memory,
    /// visible); page-cache waits for those of every thread.
    fn drain(&self) -> Result<Durability>;
    /// The first write-back failure of this store, if it has failed.
    fn failure(&self) -> Option<SyncFailure>;
    /// Records a write-back failure seen outside this trait (an fdatasync of the backing file
    /// made elsewhere, for example through io_uring): from now on the store is failed. Returns
    /// true for the first failure (the one to log), false when it had failed already.
    fn record_failure(&self, failure: SyncFailure) -> bool;
    /// Called by whoever is about to make `[offset, offset+len)` durable by syncing the
    /// backing file another way (the target's io_uring fdatasync for GPSPM), before that sync:
    /// the range is checked (and a page-cache file's size). Real media: the kernel's sync
    /// writes what the mapping's stores left in the page cache. Errors as
    /// [`Persist::persist`].
    fn before_sync(&self, offset: usize, len: usize) -> Result<()> {
        let _ = (offset, len);
        Ok(())
    }
    /// Called by whoever made `[offset, offset+len)` durable by syncing the backing file
    /// another way, once that sync returned 0. Real media: nothing to do. The power-loss
    /// simulation: copies the range from its working copy to its media here, not before the
    /// sync, so that only a sync that completed, of the range it was for, reaches the media (a
    /// flush answered without one, or by a sync of another range, leaves the bytes to be lost
    /// at the simulated power loss, as a real one would). Errors as [`Persist::persist`].
    fn after_sync(&self, offset: usize, len: usize) -> Result<()> {
        let _ = (offset, len);
        Ok(())
    }
    /// Whether a copy that writes cache lines back as it stores (non-temporal stores), then a
    /// store fence, makes placed bytes durable, so that their ranges need no persist: true on
    /// dax. False under the power-loss simulation, whose media only a persist reaches.
    fn durable_by_writeback(&self) -> bool {
        self.domain().is_dax()
    }
}
