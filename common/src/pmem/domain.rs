//! Persistence domains and the outcome of a persist.

use std::fmt;

/// Where a byte stored into a mapping is once the layer has made it "durable".
///
/// Probed when a backing store is opened, never assumed; see docs/persistence.md.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Domain {
    /// Persistent memory mapped directly (MAP_SYNC accepted, or a devdax device): a CPU cache
    /// write-back plus a store fence makes a byte durable.
    Dax,
    /// Treated as [`Domain::Dax`] because the operator forced it (`force_dax`), for testing and
    /// benchmarking on DRAM; the same cache write-back is done, but the media may be anything.
    DaxForced,
    /// A regular file on a filesystem without DAX: msync/fdatasync writes a range to storage.
    PageCache,
    /// RAM (tmpfs, ramfs, hugetlbfs, an overlay over one, anonymous memory): nothing makes a byte durable; a persist
    /// only makes it visible.
    Volatile,
}

impl Domain {
    /// The name shown everywhere the domain is shown: "dax", "dax (forced)", "page-cache",
    /// "volatile".
    pub fn as_str(&self) -> &'static str {
        match self {
            Domain::Dax => "dax",
            Domain::DaxForced => "dax (forced)",
            Domain::PageCache => "page-cache",
            Domain::Volatile => "volatile",
        }
    }

    /// Whether a persist on this domain is meant to survive power loss (false only for
    /// [`Domain::Volatile`]). [`Domain::DaxForced`] counts as durable because the operator said so.
    pub fn is_durable(&self) -> bool {
        !matches!(self, Domain::Volatile)
    }

    /// Whether bytes are made durable by a CPU cache write-back (dax and forced dax).
    pub fn is_dax(&self) -> bool {
        matches!(self, Domain::Dax | Domain::DaxForced)
    }
}

impl fmt::Display for Domain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The outcome of a persist or a drain.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Durability {
    /// The range is in the domain's durable medium (or, for [`Domain::DaxForced`], would be if
    /// the memory were persistent).
    Durable,
    /// The range is visible to every reader of the mapping but not durable: the memory is
    /// volatile. Acknowledgements on such a namespace mean "visible", never "durable".
    VisibleOnly,
}

impl Durability {
    /// "durable" or "visible only".
    pub fn as_str(&self) -> &'static str {
        match self {
            Durability::Durable => "durable",
            Durability::VisibleOnly => "visible only",
        }
    }
}

impl fmt::Display for Durability {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The first failed write-back of a store: which call failed and the errno it returned.
///
/// Linux reports a write-back error once per open file and then marks the pages clean, so a
/// later sync of the same range "succeeds" over data that never reached the media. A store that
/// has seen one failure therefore fails every later persist, flush and drain with
/// [`Error::Failed`](crate::pmem::Error::Failed) until it is reopened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SyncFailure {
    /// The call that failed: "msync", "fdatasync", ...
    pub op: &'static str,
    /// Its errno.
    pub errno: i32,
}

impl SyncFailure {
    /// The failure of `op` with the errno of `e` (EIO when `e` carries none).
    pub fn new(op: &'static str, e: &std::io::Error) -> SyncFailure {
        SyncFailure {
            op,
            errno: e.raw_os_error().unwrap_or(libc::EIO),
        }
    }

    /// What a mapping whose page the kernel could not give back (SIGBUS) records: its
    /// bytes there are not the file's any more ([`Error::Unreadable`](super::Error::Unreadable)).
    pub fn unreadable() -> SyncFailure {
        SyncFailure {
            op: "load/store",
            errno: libc::EIO,
        }
    }

    /// The errno as an io::Error, for its text.
    pub fn io_error(&self) -> std::io::Error {
        std::io::Error::from_raw_os_error(self.errno)
    }
}

impl fmt::Display for SyncFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} failed: {}", self.op, self.io_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_names_are_exact() {
        assert_eq!(Domain::Dax.to_string(), "dax");
        assert_eq!(Domain::DaxForced.to_string(), "dax (forced)");
        assert_eq!(Domain::PageCache.to_string(), "page-cache");
        assert_eq!(Domain::Volatile.to_string(), "volatile");
        assert_eq!(Durability::VisibleOnly.to_string(), "visible only");
        assert_eq!(Durability::Durable.to_string(), "durable");
    }

    #[test]
    fn sync_failure_names_the_call_and_the_errno() {
        let f = SyncFailure::new(
            "fdatasync",
            &std::io::Error::from_raw_os_error(libc::ENOSPC),
        );
        assert_eq!(f.errno, libc::ENOSPC);
        let t = f.to_string();
        assert!(t.starts_with("fdatasync failed: No space left"), "{t}");
        let no_errno = SyncFailure::new("msync", &std::io::Error::other("x"));
        assert_eq!(no_errno.errno, libc::EIO);
    }

    #[test]
    fn only_volatile_is_not_durable() {
        assert!(Domain::Dax.is_durable());
        assert!(Domain::DaxForced.is_durable());
        assert!(Domain::PageCache.is_durable());
        assert!(!Domain::Volatile.is_durable());
        assert!(Domain::DaxForced.is_dax() && Domain::Dax.is_dax());
        assert!(!Domain::PageCache.is_dax() && !Domain::Volatile.is_dax());
    }
}
