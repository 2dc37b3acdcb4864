//! The persistent-memory layer: map a namespace's backing store and make ranges of it durable,
//! reporting honestly which persistence domain the storage is in.
//!
//! # Quick start
//!
//! ```no_run
//! use rpma_common::pmem::{Durability, OpenOptions, Persist, Resize};
//!
//! # fn main() -> rpma_common::pmem::Result<()> {
//! let ns = OpenOptions::new("/var/lib/rpma/ns1.pmem")
//!     .size(64 << 20)
//!     .create(true)
//!     .resize(Resize::Grow)
//!     .open()?;
//! println!("{} is {}", ns.path().unwrap().display(), ns.domain());
//! ns.write_at(4000, b"hello")?;
//! match ns.persist(4000, 5)? {
//!     Durability::Durable => println!("durable"),
//!     Durability::VisibleOnly => println!("visible only: the memory is volatile"),
//! }
//! # Ok(()) }
//! ```
//!
//! # Domains
//!
//! | [`Domain`] | probed by | durable after [`Persist::persist`] |
//! |---|---|---|
//! | `dax` | MAP_SHARED_VALIDATE \| MAP_SYNC accepted, or a devdax device | cache write-back ([`flush_instruction`]) + sfence |
//! | `dax (forced)` | `force_dax` asked for | the same instructions; the media is whatever it is |
//! | `page-cache` | any other regular file | msync(MS_SYNC) of the page-aligned range |
//! | `volatile` | tmpfs/ramfs/hugetlbfs (statfs magic) or anonymous | never: [`Durability::VisibleOnly`] |
//!
//! # Promises
//!
//! - Threads: [`Mapping`] is `Send + Sync`; persist/flush/drain may be called from any thread.
//!   `drain` waits for every flush made before it, from any thread.
//! - Cleanup: dropping a [`Mapping`] unmaps it and closes the file; a file created by a failed
//!   [`OpenOptions::open`] is removed.
//! - A file is allocated in full before it is mapped, so a full filesystem is an error at open,
//!   never a SIGBUS on a later store.
//! - [`OpenOptions::plan`] says what `open` would do (create, grow, refuse, the domain) and
//!   changes nothing: no file is created, opened for writing, resized, allocated or mapped.
//! - No logging: this layer sits on the data path.
//! - [`OpenOptions::power_loss_simulation`] (tests and debugging only) keeps a working copy in
//!   memory and lets the file receive only what was persisted (and some evicted units): a
//!   SIGKILL of the process is then a power loss. Its domain reads with
//!   [`SIMULATION_LABEL`] everywhere ([`Mapping::domain_label`]).
//!
//! docs/persistence.md has the details.

mod devdax;
mod domain;
mod error;
mod flush;
mod map;
mod open;
mod plan;
mod sim;

pub use domain::{Domain, Durability, SyncFailure};
pub use error::{Error, Result};
pub use flush::{
    cache_line_size, flush_instruction, sfence, writeback_range, writeback_range_with,
    FlushInstruction,
};
pub use map::{FailureHook, Mapping};
pub use open::{OpenOptions, Resize};
pub use plan::{Plan, PlanAction};
pub use sim::{SimStats, Simulation, SIMULATION_LABEL};

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
/// every persist, flush and drain fails with [`Error::Failed`] until the store is reopened.
pub trait Persist: Send + Sync {
    /// The domain this store is in.
    fn domain(&self) -> Domain;
    /// Makes `[offset, offset+len)` of the mapping durable (cache write-back + sfence for dax,
    /// msync(MS_SYNC) of the page-aligned range for page-cache, nothing for volatile ->
    /// `Ok(Durability::VisibleOnly)`). Unaligned ranges allowed; out-of-range -> `Err`.
    fn persist(&self, offset: usize, len: usize) -> Result<Durability>;
    /// Starts write-back of a range without waiting (dax: clwb/clflushopt without the fence;
    /// page-cache: sync_file_range start); [`Persist::drain`] then waits for everything flushed
    /// so far. Out-of-range -> `Err`.
    fn flush(&self, offset: usize, len: usize) -> Result<()>;
    /// Waits until every range flushed so far is durable (or, on volatile memory, visible).
    fn drain(&self) -> Result<Durability>;
    /// The first write-back failure of this store, if it has failed.
    fn failure(&self) -> Option<SyncFailure>;
    /// Records a write-back failure seen outside this trait (an fdatasync of the backing file
    /// made elsewhere, for example through io_uring): from now on the store is failed. Returns
    /// true for the first failure (the one to log), false when it had failed already.
    fn record_failure(&self, failure: SyncFailure) -> bool;
    /// Called by whoever is about to make `[offset, offset+len)` durable by syncing the
    /// backing file another way (the target's io_uring fdatasync for GPSPM), before that sync.
    /// Real media: nothing to do, the kernel's sync writes what the mapping's stores left in
    /// the page cache. The power-loss simulation: copies the range from its working copy to
    /// the media file, which the sync then writes. Errors as [`Persist::persist`].
    fn before_sync(&self, offset: usize, len: usize) -> Result<()> {
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
