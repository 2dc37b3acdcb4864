//! The pmem layer's error type.

use std::io;
use std::path::PathBuf;

use super::domain::SyncFailure;

/// Everything that can go wrong while opening, mapping or persisting a namespace's backing store.
///
/// Each variant names the failing step and carries the path (or range) it was working on, so that
/// the message alone tells an operator what to fix.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The block size is neither 512 nor 4096.
    #[error("block size {block_size} is not supported (use 512 or 4096)")]
    BadBlockSize {
        /// The block size asked for.
        block_size: u64,
    },
    /// A size of zero was asked for, or an existing backing store is empty.
    #[error("{}: size is 0; a namespace needs at least one block", path.display())]
    ZeroSize {
        /// The backing store.
        path: PathBuf,
    },
    /// The size is not a whole number of blocks.
    #[error("{}: size {size} is not a multiple of the block size {block_size}", path.display())]
    SizeNotMultiple {
        /// The backing store.
        path: PathBuf,
        /// The size asked for (or found, for an existing store).
        size: u64,
        /// The block size.
        block_size: u64,
    },
    /// The size does not fit in this process's address space.
    #[error("{}: size {size} does not fit in the address space", path.display())]
    SizeTooLarge {
        /// The backing store.
        path: PathBuf,
        /// The size asked for.
        size: u64,
    },
    /// A new file must be created but no size was given.
    #[error("{}: the file does not exist yet, so a size is needed to create it", path.display())]
    SizeRequired {
        /// The file to create.
        path: PathBuf,
    },
    /// The path does not exist and creation was not asked for (or its parent directory is missing).
    #[error("{}: no such file or directory", path.display())]
    NotFound {
        /// The missing path.
        path: PathBuf,
        /// What the kernel said.
        #[source]
        source: io::Error,
    },
    /// The path is a directory.
    #[error("{}: is a directory, not a file or a devdax device", path.display())]
    IsDirectory {
        /// The path.
        path: PathBuf,
    },
    /// The path is neither a regular file nor a character device (a FIFO, socket or block device).
    #[error("{}: is a {kind}; a namespace needs a regular file or a devdax device", path.display())]
    UnsupportedFileType {
        /// The path.
        path: PathBuf,
        /// What it is instead.
        kind: &'static str,
    },
    /// This process may not open the path for reading and writing.
    #[error("{}: permission denied (the namespace is opened read-write)", path.display())]
    PermissionDenied {
        /// The path.
        path: PathBuf,
        /// What the kernel said.
        #[source]
        source: io::Error,
    },
    /// Opening or inspecting the path failed for another reason.
    #[error("{}: cannot {op}", path.display())]
    Io {
        /// The path.
        path: PathBuf,
        /// The operation: "open", "stat", "statfs", "resize", ...
        op: &'static str,
        /// What the kernel said.
        #[source]
        source: io::Error,
    },
    /// An existing file is larger than the size asked for and shrinking was not allowed.
    #[error(
        "{}: the file is {existing} bytes, larger than the {requested} asked for; \
         refusing to shrink it unless shrinking is allowed (the bytes past the new end would be lost)",
        path.display()
    )]
    WouldShrink {
        /// The file.
        path: PathBuf,
        /// Its current size.
        existing: u64,
        /// The size asked for.
        requested: u64,
    },
    /// An existing file is smaller than the size asked for and growing was not allowed.
    #[error(
        "{}: the file is {existing} bytes, smaller than the {requested} asked for; \
         refusing to grow it unless growing is allowed",
        path.display()
    )]
    WouldGrow {
        /// The file.
        path: PathBuf,
        /// Its current size.
        existing: u64,
        /// The size asked for.
        requested: u64,
    },
    /// The filesystem has no room to allocate the whole size up front.
    #[error(
        "{}: the filesystem has no room for {size} bytes (allocating the whole namespace up front \
         failed, so nothing was mapped)",
        path.display()
    )]
    NoSpace {
        /// The file.
        path: PathBuf,
        /// The size that could not be allocated.
        size: u64,
        /// What the kernel said.
        #[source]
        source: io::Error,
    },
    /// A character device that is not a devdax device (for example /dev/null).
    #[error("{}: is a character device but not a devdax device ({reason})", path.display())]
    NotDevDax {
        /// The device.
        path: PathBuf,
        /// Why it was judged not to be devdax.
        reason: String,
    },
    /// A devdax device is smaller than the size asked for.
    #[error("{}: the devdax device has {available} bytes, fewer than the {requested} asked for", path.display())]
    DevDaxTooSmall {
        /// The device.
        path: PathBuf,
        /// The device's size.
        available: u64,
        /// The size asked for.
        requested: u64,
    },
    /// The size asked of a devdax device is not a multiple of its mapping alignment.
    #[error("{}: {size} bytes is not a multiple of the devdax alignment {align}", path.display())]
    DevDaxAlignment {
        /// The device.
        path: PathBuf,
        /// The size asked for.
        size: u64,
        /// The device's alignment (sysfs `align`).
        align: u64,
    },
    /// mmap failed.
    #[error("{}: cannot map {len} bytes", path.as_deref().map_or("anonymous memory".into(), |p| p.display().to_string()))]
    Map {
        /// The backing store (None for anonymous memory).
        path: Option<PathBuf>,
        /// The length asked for.
        len: usize,
        /// What the kernel said.
        #[source]
        source: io::Error,
    },
    /// A range reaches outside the mapping.
    #[error("range [{offset}, {offset}+{len}) is outside the {mapping_len}-byte mapping")]
    OutOfRange {
        /// Start of the range.
        offset: usize,
        /// Length of the range.
        len: usize,
        /// Length of the mapping.
        mapping_len: usize,
    },
    /// msync, sync_file_range or fdatasync failed, so the range may not be durable. The store
    /// is failed from then on ([`Error::Failed`]).
    #[error("{}: {op} of [{offset}, {offset}+{len}) failed; the range may not be durable", path.display())]
    Sync {
        /// The backing file.
        path: PathBuf,
        /// "msync", "sync_file_range".
        op: &'static str,
        /// Start of the range.
        offset: usize,
        /// Length of the range.
        len: usize,
        /// What the kernel said.
        #[source]
        source: io::Error,
    },
    /// An earlier write-back of this store failed ([`SyncFailure`]): the kernel may since have
    /// marked the lost pages clean, so no later persist can be trusted. The store stays failed
    /// until it is reopened.
    #[error(
        "{}: the namespace has failed: an earlier {failure}; nothing on it can be made durable \
         until it is reopened",
        path.display()
    )]
    Failed {
        /// The backing file.
        path: PathBuf,
        /// The first failure.
        failure: SyncFailure,
    },
    /// A page of the mapping could not be read or written (SIGBUS: a media error, poisoned
    /// pmem, or the file truncated by another process), so the bytes of the copy are not the
    /// file's. The namespace has failed from then on ([`SyncFailure::unreadable`]).
    #[error(
        "{}: the page at offset {offset} could not be read or written (a media error, or the file \
         was truncated by another process); the namespace has failed",
        path.display()
    )]
    Unreadable {
        /// The backing file.
        path: PathBuf,
        /// The first page that faulted, as an offset into the mapping.
        offset: usize,
    },
    /// A cache flush instruction that this CPU does not have was asked for.
    #[error("this CPU does not support the {instruction} instruction")]
    UnsupportedInstruction {
        /// The instruction's name.
        instruction: &'static str,
    },
    /// The power-loss simulation was asked for on a store it cannot simulate (a devdax
    /// device, a volatile domain) or one open already in this process with other settings.
    #[error("{}: no power-loss simulation here: {reason}", path.display())]
    SimulationUnsupported {
        /// The backing store.
        path: PathBuf,
        /// Why.
        reason: &'static str,
    },
    /// The filesystem has fewer free bytes than opening would allocate (found by
    /// [`OpenOptions::plan`](crate::pmem::OpenOptions::plan), which allocates nothing).
    #[error(
        "{}: the filesystem has {available} bytes free, fewer than the {needed} the namespace \
         would allocate",
        path.display()
    )]
    NotEnoughSpace {
        /// The backing store.
        path: PathBuf,
        /// The bytes opening would allocate.
        needed: u64,
        /// The bytes free for this user.
        available: u64,
    },
}

/// The pmem layer's result type.
pub type Result<T> = std::result::Result<T, Error>;
