//! What a flush applies to ([`FlushTarget`]): one namespace, prepared once when it is opened,
//! with the open files its page-cache syncs go through, one per flush service.

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;

use rpma_common::pmem::{Domain, Mapping, Persist, SyncFailure};

use super::error::{FlusherError, Result};

/// What a flush applies to: one namespace, prepared once when the namespace is opened.
#[derive(Clone)]
pub struct FlushTarget {
    pub(super) kind: Kind,
    pub(super) len: u64,
}

#[derive(Clone)]
pub(super) enum Kind {
    Dax(Arc<dyn Persist>),
    /// The descriptors to fdatasync (open files of their own: one per flush service, the
    /// flusher's [`service`](super::Flusher::new) number its index), and the store that
    /// remembers a failure of them.
    PageCache(Arc<[Arc<OwnedFd>]>, Arc<dyn Persist>),
    Volatile,
}

impl std::fmt::Debug for FlushTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match &self.kind {
            Kind::Dax(_) => "dax".to_owned(),
            Kind::PageCache(fds, _) => format!(
                "page-cache fds {:?}",
                fds.iter().map(|f| f.as_raw_fd()).collect::<Vec<_>>()
            ),
            Kind::Volatile => "volatile".to_owned(),
        };
        write!(f, "FlushTarget({kind}, {} bytes)", self.len)
    }
}

impl FlushTarget {
    /// The target for a mapped namespace, chosen by its domain, for `services` flush services
    /// (a page-cache namespace opens its file again once for each: flushers numbered 0 to
    /// `services - 1` each sync through a file of their own).
    ///
    /// # Errors
    /// [`FlusherError::NoBackingFile`], [`FlusherError::Reopen`].
    pub fn for_mapping(m: &Arc<Mapping>, services: usize) -> Result<Self> {
        let len = m.len() as u64;
        Ok(match m.domain() {
            Domain::Dax | Domain::DaxForced => Self::dax(m.clone(), len),
            Domain::PageCache => {
                let fd = m.backing_fd().ok_or(FlusherError::NoBackingFile)?;
                // Open files of their own (the same inode, through /proc, whatever its path is
                // now), not dups, opened now, before any sync: Linux reports a write-back error
                // once to each open file. A dup shares the mapping's, whose msync (a FLUSH) then
                // returned 0 after an fdatasync took the report, before the poll loop had
                // reaped it; one file shared by two poll loops' flushers let one loop answer
                // its 0 durable while another held the report (tests/tests/failed_namespace.rs,
                // `the_flush_service_and_the_mapping_each_hear_of_a_writeback_error`,
                // `every_flush_service_hears_of_a_writeback_error`).
                let fds = (0..services.max(1))
                    .map(|_| {
                        std::fs::File::open(format!("/proc/self/fd/{}", fd.as_raw_fd()))
                            .map(|f| Arc::new(OwnedFd::from(f)))
                    })
                    .collect::<std::io::Result<Vec<_>>>()
                    .map_err(FlusherError::Reopen)?;
                FlushTarget {
                    kind: Kind::PageCache(fds.into(), m.clone()),
                    len,
                }
            }
            _ => Self::volatile(len),
        })
    }

    /// Inline persist through the pmem layer.
    pub fn dax(p: Arc<dyn Persist>, len: u64) -> Self {
        FlushTarget {
            kind: Kind::Dax(p),
            len,
        }
    }

    /// fdatasync of `fd` through io_uring (or the worker thread), for every flush service; a
    /// failure is recorded in `store` (the mapping of the same file), which then fails every
    /// later flush.
    pub fn page_cache(fd: OwnedFd, store: Arc<dyn Persist>, len: u64) -> Self {
        FlushTarget {
            kind: Kind::PageCache(Arc::from([Arc::new(fd)]), store),
            len,
        }
    }

    /// Whether a flush of it syncs a page-cache file (the one kind of flush that waits for a
    /// device, and that [`Flusher::submit_inline`](super::Flusher::submit_inline) may run in
    /// the caller's thread).
    pub fn syncs_a_file(&self) -> bool {
        matches!(self.kind, Kind::PageCache(..))
    }

    /// How many open files of its own a page-cache target syncs through (one per flush
    /// service it was prepared for); 0 for the other kinds.
    pub fn open_files(&self) -> usize {
        match &self.kind {
            Kind::PageCache(fds, _) => fds.len(),
            _ => 0,
        }
    }

    /// The store's first write-back failure, if the namespace has failed.
    pub fn failure(&self) -> Option<SyncFailure> {
        match &self.kind {
            Kind::Dax(p) | Kind::PageCache(_, p) => p.failure(),
            Kind::Volatile => None,
        }
    }

    /// Nothing can make it durable.
    pub fn volatile(len: u64) -> Self {
        FlushTarget {
            kind: Kind::Volatile,
            len,
        }
    }
}
