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
//! | `volatile` | tmpfs/ramfs/hugetlbfs (statfs magic), an overlay over one, or anonymous | never: [`Durability::VisibleOnly`] |
//!
//! # Promises
//!
//! - Threads: [`Mapping`] is `Send + Sync`; persist/flush/drain may be called from any thread.
//!   `drain` waits for every flush made before it by the same thread; on page-cache by any
//!   thread too, but not on dax, where the fence orders only its own CPU's write-backs: a
//!   thread drains what it flushed itself (as the placement engine does).
//! - Cleanup: dropping a [`Mapping`] unmaps it and closes the file; a file created by a failed
//!   [`OpenOptions::open`] is removed.
//! - A file is allocated in full before it is mapped, so a full filesystem is an error at open,
//!   never a SIGBUS on a later store (except on a copy-on-write filesystem, where an overwrite
//!   needs new blocks: docs/persistence.md, "Allocation up front").
//! - [`OpenOptions::plan`] says what `open` would do (create, grow, refuse, the domain) and
//!   changes nothing: no file is created, opened for writing, resized, allocated or mapped.
//! - No logging: this layer sits on the data path.
//! - [`OpenOptions::power_loss_simulation`] (tests and debugging only) keeps a working copy in
//!   memory and lets the file receive only what was persisted (and some evicted units): a
//!   SIGKILL of the process is then a power loss. Its domain reads with
//!   [`SIMULATION_LABEL`] everywhere ([`Mapping::domain_label`]).
//!
//! docs/persistence.md has the details.

mod cachestat;
mod devdax;
mod domain;
mod error;
mod flush;
mod map;
mod media;
mod open;
mod persist;
mod placed;
mod plan;
mod sim;

pub use cachestat::unsynced_pages;
pub use domain::{Domain, Durability, SyncFailure};
pub use error::{Error, Result};
pub use flush::{
    cache_line_size, flush_instruction, sfence, writeback_range, writeback_range_with,
    FlushInstruction,
};
pub use map::Mapping;
pub use media::FailureHook;
pub use open::{OpenOptions, Resize};
pub use persist::Persist;
pub use plan::{Plan, PlanAction};
pub use sim::{SimStats, Simulation, SIMULATION_LABEL};
