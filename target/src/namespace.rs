//! Open namespaces: each configured namespace mapped through the pmem layer, with its flush
//! target and counters, in a table keyed by (subsystem NQN, nsid).
//!
//! Namespaces are shared as `Arc<OpenNamespace>`: a reload that replaces or removes one drops
//! the table's reference, and sessions still holding it keep the mapping alive until they close.
//!
//! A namespace whose write-back failed stays failed across reloads and restarts: the table
//! records the failure in the [`FailureLedger`] (the state file) from the mapping's failure
//! hook, before the failed call returns, and every later opening of that file drops its page
//! cache (so that hosts read what the media holds) and marks the new mapping failed, until
//! [`NamespaceTable::clear_failure`] (the operator's `rpma-target clear-failure`).
//!
//! This file opens one namespace ([`OpenNamespace`]) and says what it offers (its durability
//! methods and rights per domain and transport); the table of them, which opens, reloads and
//! clears them together, is in table.rs, over it.

mod claim;
pub(crate) mod mark;
mod methods;
mod notes;
mod table;

pub use claim::ClaimError;
pub use mark::{file_id_of, marked_failed, open_regular};
pub use methods::{access_for, durability_methods, offered_methods, wire_domain};
pub use table::{ApplyReport, Cleared, NamespaceTable};

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use rpma_common::pmem::{self, Domain, Mapping, OpenOptions, Persist, Resize, SyncFailure};
use rpma_common::proto::nqn::Nqn;

use crate::config;
pub use crate::config::NsKey;
use crate::failures::{self, Failed, FailureLedger, LedgerError};
use crate::flusher::{FlushTarget, FlusherError};

/// Errors opening namespaces.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NamespaceError {
    /// The pmem layer could not open or map the backing store.
    #[error("subsystem {subsystem} namespace {nsid} ({path}): cannot open")]
    Open {
        /// Subsystem.
        subsystem: Nqn,
        /// Namespace id.
        nsid: u32,
        /// Backing store.
        path: PathBuf,
        /// What the pmem layer reported.
        #[source]
        source: pmem::Error,
    },
    /// An existing file is smaller than the configured size, and the namespace does not say
    /// `grow = true`.
    #[error(
        "subsystem {subsystem} namespace {nsid} ({path}): the file is smaller than the configured \
         size; set `grow = true` on the namespace to grow it"
    )]
    WouldGrow {
        /// Subsystem.
        subsystem: Nqn,
        /// Namespace id.
        nsid: u32,
        /// Backing store.
        path: PathBuf,
        /// What the pmem layer reported (the sizes).
        #[source]
        source: pmem::Error,
    },
    /// A reload turns the power-loss simulation on or off for the file a namespace maps: the
    /// simulated opening and the real one would each write their own copy over the other's
    /// durable writes (the simulation's clean close writes its working copy to the file, and
    /// a new simulation's persists write whole pages of what it read at its opening).
    #[error(
        "subsystem {subsystem} namespace {nsid} ({path}): a reload cannot turn the power-loss \
         simulation on or off for the file it serves; restart the target to change it"
    )]
    SimulationChanged {
        /// Subsystem.
        subsystem: Nqn,
        /// Namespace id.
        nsid: u32,
        /// Backing store.
        path: PathBuf,
    },
    /// The namespace to clear is not configured.
    #[error("subsystem {subsystem} has no namespace {nsid}")]
    NotFound {
        /// Subsystem.
        subsystem: Nqn,
        /// Namespace id.
        nsid: u32,
    },
    /// The namespace failed again while its failure was being cleared (the space or the
    /// device still failing): it stays failed.
    #[error(
        "subsystem {subsystem} namespace {nsid} failed again while its failure was being \
         cleared ({failure}): it stays FAILED; fix the cause first"
    )]
    FailedAgain {
        /// Subsystem.
        subsystem: Nqn,
        /// Namespace id.
        nsid: u32,
        /// The new failure.
        failure: SyncFailure,
    },
    /// The namespace to clear has not failed.
    #[error("subsystem {subsystem} namespace {nsid} has not failed: nothing to clear")]
    NotFailed {
        /// Subsystem.
        subsystem: Nqn,
        /// Namespace id.
        nsid: u32,
    },
    /// The file's failure mark (`user.rpma.failed`) could not be removed (clear-failure).
    #[error("subsystem {subsystem} namespace {nsid} ({path}): its failure mark")]
    Mark {
        /// Subsystem.
        subsystem: Nqn,
        /// Namespace id.
        nsid: u32,
        /// Backing path.
        path: PathBuf,
        /// What went wrong.
        #[source]
        source: std::io::Error,
    },
    /// The state file could not be updated.
    #[error("subsystem {subsystem} namespace {nsid}: the state file was not updated")]
    Ledger {
        /// Subsystem.
        subsystem: Nqn,
        /// Namespace id.
        nsid: u32,
        /// What went wrong.
        #[source]
        source: LedgerError,
    },
    /// The file could not be claimed for this daemon (another process serves it).
    #[error("subsystem {subsystem} namespace {nsid} ({path}): not served")]
    Claim {
        /// Subsystem.
        subsystem: Nqn,
        /// Namespace id.
        nsid: u32,
        /// Backing store.
        path: PathBuf,
        /// Why.
        #[source]
        source: ClaimError,
    },
    /// The flush target could not be prepared.
    #[error("subsystem {subsystem} namespace {nsid}: cannot prepare flushing")]
    Flush {
        /// Subsystem.
        subsystem: Nqn,
        /// Namespace id.
        nsid: u32,
        /// What went wrong.
        #[source]
        source: FlusherError,
    },
}

/// Result of namespace operations.
pub type Result<T> = std::result::Result<T, NamespaceError>;

/// Per-namespace counters, updated by the sessions and the flush service.
#[derive(Debug, Default)]
pub struct Counters {
    /// Flush requests answered.
    pub flushes: AtomicU64,
    /// Flush requests answered with an error status.
    pub flush_errors: AtomicU64,
    /// Bytes made durable on request.
    pub flushed_bytes: AtomicU64,
    /// Sessions currently holding the namespace.
    pub sessions: AtomicU64,
}

impl Counters {
    /// A plain copy for status output.
    pub fn snapshot(&self) -> CountersSnapshot {
        CountersSnapshot {
            flushes: self.flushes.load(Ordering::Relaxed),
            flush_errors: self.flush_errors.load(Ordering::Relaxed),
            flushed_bytes: self.flushed_bytes.load(Ordering::Relaxed),
            sessions: self.sessions.load(Ordering::Relaxed),
        }
    }
}

/// A copy of [`Counters`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CountersSnapshot {
    /// See [`Counters::flushes`].
    pub flushes: u64,
    /// See [`Counters::flush_errors`].
    pub flush_errors: u64,
    /// See [`Counters::flushed_bytes`].
    pub flushed_bytes: u64,
    /// See [`Counters::sessions`].
    pub sessions: u64,
}

/// The identity of namespace `nsid` of `subsystem` mapping `mapping`'s file, for the wire's
/// [`NamespaceDescriptor::identity`](rpma_common::proto::NamespaceDescriptor::identity): the
/// first 8 bytes of a SHA-256 over them and what tells the file apart (`file_key`), so that
/// hosts learn whether a reconnect found the same file without learning where it lives. A
/// reopening of the same file (a reload, a cleared failure, a restart, a reboot) keeps it; a
/// file moved over the path, or a symlink retargeted, changes it. Memory of no file (unit
/// tests) hashes zeros.
pub fn identity_of(subsystem: &Nqn, nsid: u32, mapping: &Mapping) -> u64 {
    use sha2::{Digest, Sha256};
    let file = mapping.backing_fd().map_or((0, 0, 0, 0), file_key);
    let mut h = Sha256::new();
    h.update(b"rpma namespace identity v1\0");
    h.update(subsystem.as_str().as_bytes());
    h.update([0]);
    h.update(nsid.to_le_bytes());
    h.update([file.0]);
    h.update(file.1.to_le_bytes());
    h.update(file.2.to_le_bytes());
    h.update(file.3.to_le_bytes());
    let d = h.finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&d[..8]);
    u64::from_le_bytes(first)
}

/// What tells the file behind `fd` apart from any other, as stable as the file itself: a file's
/// inode and birth time (both on disk: the device number is not, a reboot may renumber the
/// filesystem's device), else (no birth time from this filesystem) its device and inode; a
/// devdax device's device number (its node's inode is new at every boot). A kind byte first.
fn file_key(fd: std::os::fd::BorrowedFd<'_>) -> (u8, u64, u64, u64) {
    // SAFETY: a plain C struct of integers: all zeros is a valid value.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: statx writes one such struct through the pointer, which outlives the call; the
    // empty path with AT_EMPTY_PATH names the descriptor itself, kept open by `fd`.
    let r = unsafe {
        libc::statx(
            std::os::fd::AsRawFd::as_raw_fd(&fd),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            libc::STATX_TYPE | libc::STATX_INO | libc::STATX_BTIME,
            &mut stx,
        )
    };
    if r != 0 {
        return (0, 0, 0, 0);
    }
    let dev = |major: u32, minor: u32| (u64::from(major) << 32) | u64::from(minor);
    if u32::from(stx.stx_mode) & libc::S_IFMT == libc::S_IFCHR {
        (1, dev(stx.stx_rdev_major, stx.stx_rdev_minor), 0, 0)
    } else if stx.stx_mask & libc::STATX_BTIME != 0 {
        let born = (stx.stx_btime.tv_sec as u64) << 32 | u64::from(stx.stx_btime.tv_nsec);
        (3, stx.stx_ino, born, 0)
    } else {
        (2, dev(stx.stx_dev_major, stx.stx_dev_minor), stx.stx_ino, 0)
    }
}

/// A mapped namespace.
#[derive(Debug)]
pub struct OpenNamespace {
    /// Its subsystem.
    pub subsystem: Nqn,
    /// Its configuration.
    pub config: config::Namespace,
    /// The mapping.
    pub mapping: Arc<Mapping>,
    /// What the flush service uses for it.
    pub flush_target: FlushTarget,
    /// Counters.
    pub counters: Counters,
    /// Whether its failure was logged (once per opening).
    failure_logged: AtomicBool,
    /// Whether a transport's refusal to register it was logged (once per opening).
    unregistrable_logged: AtomicBool,
    /// Whether a page of it that could not be read or written was logged (once per opening).
    unreadable_logged: AtomicBool,
    /// Whether its sessions were closed for it (once per opening).
    unreadable_closed: AtomicBool,
    /// The backing file's canonical path (the state file's key).
    key: PathBuf,
    /// Where its failure is remembered (None: only in memory, as in unit tests).
    ledger: Option<Arc<FailureLedger>>,
    /// The claim every opening of its file in this process shares (None for no file).
    claim: Option<Arc<claim::Claim>>,
    /// Which file it maps, as hosts are told ([`identity_of`]).
    identity: u64,
    /// Whether a reload took it out of service ([`OpenNamespace::retire`]).
    retired: AtomicBool,
}

impl OpenNamespace {
    /// Opens (creating and allocating a missing file when a size is configured) and maps a
    /// namespace. An existing file of another size is refused, never silently resized, except
    /// that a smaller one is grown when the namespace says `grow = true` (the same rule at
    /// start-up and on reload).
    ///
    /// Failures are not remembered (see [`OpenNamespace::open_remembering`]).
    ///
    /// # Errors
    /// [`NamespaceError::WouldGrow`], [`NamespaceError::Open`], [`NamespaceError::Flush`].
    pub fn open(subsystem: &Nqn, ns: &config::Namespace) -> Result<Self> {
        Self::open_remembering(subsystem, ns, None, None, 1)
    }

    /// [`OpenNamespace::open`], failed from the start if `failed` says so, `ledger`
    /// remembers a failure of its file, or another live opening of the file in this process
    /// has failed: its page cache is then dropped first (what hosts read is what the media
    /// holds) and no durability request on it succeeds. With a `ledger`, its first failure
    /// from now on is recorded there before the failing call returns. A page-cache file is
    /// opened once more for each of the daemon's `services` flush services
    /// ([`config::Config::flush_services`]; [`OpenNamespace::open`]: one).
    ///
    /// # Errors
    /// As [`OpenNamespace::open`], and [`NamespaceError::Claim`] when another process serves
    /// the file.
    pub fn open_remembering(
        subsystem: &Nqn,
        ns: &config::Namespace,
        ledger: Option<&Arc<FailureLedger>>,
        failed: Option<SyncFailure>,
        services: usize,
    ) -> Result<Self> {
        Self::open_with(subsystem, ns, ledger, ledger, failed, services, false)
    }

    /// [`OpenNamespace::open_remembering`], with the ledger it starts failed from (`from`)
    /// apart from the one its failures are recorded in (`into`), and `clearing`: the opening
    /// that clears the file's failure, which the file's failed openings (still live until the
    /// clear succeeds) do not make start failed. Clearing a failure opens the file anew with
    /// the first None, the second Some and `clearing`.
    fn open_with(
        subsystem: &Nqn,
        ns: &config::Namespace,
        from: Option<&Arc<FailureLedger>>,
        into: Option<&Arc<FailureLedger>>,
        failed: Option<SyncFailure>,
        services: usize,
        clearing: bool,
    ) -> Result<Self> {
        // A file known failed (remembered, carried by a reload, or marked) that is shorter
        // than its size now (cut short under the daemon: the failure it was remembered for)
        // opens failed, as it is, rather than stop the start or the reload of everything else.
        let key = failures::key_of(&ns.path);
        let known_failed = !clearing
            && (failed.is_some()
                || from.is_some_and(|l| l.get(&key).is_some())
                || marked_failed(&ns.path));
        let opts = Self::options(ns).short_ok(known_failed);
        let mapping = Arc::new(opts.open().map_err(|source| {
            let (subsystem, nsid, path) = (subsystem.clone(), ns.nsid, ns.path.clone());
            match source {
                pmem::Error::WouldGrow { .. } => NamespaceError::WouldGrow {
                    subsystem,
                    nsid,
                    path,
                    source,
                },
                source => NamespaceError::Open {
                    subsystem,
                    nsid,
                    path,
                    source,
                },
            }
        })?);
        let (claim, live_failure) =
            claim::join(&mapping).map_err(|source| NamespaceError::Claim {
                subsystem: subsystem.clone(),
                nsid: ns.nsid,
                path: ns.path.clone(),
                source,
            })?;
        if ns.prefault && matches!(mapping.domain(), Domain::Dax | Domain::DaxForced) {
            // The first Write to each page would otherwise pay a page fault in the poll loop
            // (about half the speed of a first pass over a fresh namespace).
            let t = std::time::Instant::now();
            match mapping.prefault() {
                Ok(()) => log::info!(
                    "subsystem {subsystem} nsid {}: {} bytes mapped in ahead of use in {} ms",
                    ns.nsid,
                    mapping.len(),
                    t.elapsed().as_millis()
                ),
                Err(e) => log::warn!(
                    "subsystem {subsystem} nsid {}: not mapped in ahead of use (first writes \
                     to each page fault): {}",
                    ns.nsid,
                    rpma_common::error_chain(&e)
                ),
            }
        }
        if mapping.simulation().is_some() {
            log::warn!(
                "subsystem {subsystem} nsid {} ({}): domain {}: only what was persisted survives \
                 a SIGKILL of this daemon; NOT for production",
                ns.nsid,
                ns.path.display(),
                mapping.domain_label()
            );
        }
        let flush_target = FlushTarget::for_mapping(&mapping, services).map_err(|source| {
            NamespaceError::Flush {
                subsystem: subsystem.clone(),
                nsid: ns.nsid,
                source,
            }
        })?;
        let remembered = from.and_then(|l| l.get(&key));
        // The file's own mark, read with the ledger (not by the opening that clears it).
        // A mark that cannot be read (EIO from a failing device) counts as one: the namespace
        // opens failed, the others are served.
        let marked = match (from, mapping.backing_fd()) {
            (Some(_), Some(fd)) => mark::get(fd).unwrap_or_else(|e| {
                log::warn!(
                    "subsystem {subsystem} namespace {} ({}): its failure mark cannot be read \
                     ({e}): it is taken as failed",
                    ns.nsid,
                    ns.path.display()
                );
                Some(SyncFailure {
                    op: "write-back",
                    errno: e.raw_os_error().unwrap_or(libc::EIO),
                })
            }),
            _ => None,
        };
        if let (Some(m), None) = (&marked, &remembered) {
            log::warn!(
                "subsystem {subsystem} namespace {} ({}): the file is marked failed ({m}, its \
                 attribute {}) and the state file does not list it (another state_file, or \
                 one removed): it stays failed",
                ns.nsid,
                ns.path.display(),
                mark::NAME.to_string_lossy()
            );
        }
        let failed = remembered
            .as_ref()
            .map(Failed::sync_failure)
            .or(failed)
            .or(live_failure.filter(|_| !clearing))
            .or(marked);
        let identity = identity_of(subsystem, ns.nsid, &mapping);
        let opened = OpenNamespace {
            identity,
            retired: AtomicBool::new(false),
            subsystem: subsystem.clone(),
            config: ns.clone(),
            mapping,
            flush_target,
            counters: Counters::default(),
            failure_logged: AtomicBool::new(failed.is_some()),
            unregistrable_logged: AtomicBool::new(false),
            unreadable_logged: AtomicBool::new(false),
            unreadable_closed: AtomicBool::new(false),
            key,
            ledger: into.cloned(),
            claim,
        };
        if let Some(f) = failed {
            opened.reopen_failed(f, remembered);
        }
        opened.remember_failures();
        if let Some(end) = opened.mapping.unreadable_at() {
            opened.unreadable_logged.store(true, Ordering::Relaxed);
            log::error!(
                "subsystem {subsystem} namespace {} ({}) opened FAILED: the file is {end} bytes, \
                 shorter than its size {}; nothing of it is read or written, and every \
                 durability request on it is refused, until the file has its size back and an \
                 operator clears the failure with `rpma-target clear-failure {subsystem} {}` (the \
                 other namespaces are served)",
                ns.nsid,
                ns.path.display(),
                opened.mapping.len(),
                ns.nsid
            );
        }
        Ok(opened)
    }

    /// From now on the mapping's first failure is recorded in the ledger (if there is one)
    /// and in every other live opening of its file before the call that met it returns.
    fn remember_failures(&self) {
        let (l, claim, me, sub, nsid, path) = (
            self.ledger.clone(),
            self.claim.clone(),
            Arc::downgrade(&self.mapping),
            self.subsystem.to_string(),
            self.config.nsid,
            self.key.clone(),
        );
        // The file's own descriptor: the mark goes on the file that failed, whatever its path
        // names by then.
        let file = self
            .mapping
            .backing_fd()
            .and_then(|fd| fd.try_clone_to_owned().ok());
        self.mapping.set_failure_hook(Box::new(move |f| {
            use std::os::fd::AsFd;
            if let Some(fd) = &file {
                mark::mark_file(fd.as_fd(), &sub, nsid, f);
            }
            if let Some(l) = &l {
                // The file that failed, not whatever its path names by now.
                let id = match &file {
                    Some(fd) => mark::file_id_of(fd.as_fd()),
                    None => failures::file_id_of(&path),
                };
                if let Err(e) = l.record_file(&sub, nsid, &path, id, f) {
                    log::error!(
                        "subsystem {sub} namespace {nsid} failed ({f}) and the failure could \
                         not be remembered: {}; a restart would forget it",
                        rpma_common::error_chain(&e)
                    );
                }
            }
            if let Some(c) = &claim {
                c.spread(&me, f);
            }
        }));
    }

    /// The file failed before this opening: drop its page cache (the pages Linux marked
    /// clean after the failed write-back hold bytes the media does not), mark the mapping
    /// failed, make sure the ledger has it, and say so once.
    fn reopen_failed(&self, f: SyncFailure, remembered: Option<Failed>) {
        let dropped = self.mapping.drop_page_cache();
        self.mapping.record_failure(f);
        if let Some(fd) = self.mapping.backing_fd() {
            mark::mark_file(fd, self.subsystem.as_str(), self.config.nsid, &f);
        }
        // Recorded even when remembered: nothing to do then, unless a write of the state file
        // failed since, which this writes again (a reload reopens every failed namespace).
        let entry = match &self.ledger {
            Some(l) => {
                let id = self.file_id().or_else(|| failures::file_id_of(&self.key));
                match l.record_file(self.subsystem.as_str(), self.config.nsid, &self.key, id, &f) {
                    Ok(e) => Some(e),
                    Err(e) => {
                        log::error!(
                            "subsystem {} namespace {}: the failure could not be remembered: \
                             {}; a restart would forget it",
                            self.subsystem,
                            self.config.nsid,
                            rpma_common::error_chain(&e)
                        );
                        remembered
                    }
                }
            }
            None => remembered,
        };
        let since = entry.map_or_else(String::new, |e| format!(" since {}", e.since()));
        let cache = match dropped {
            Ok(()) => "its page cache was dropped, so hosts read what the media holds".to_owned(),
            Err(e) => format!(
                "dropping its page cache failed ({}): hosts may read bytes the media does not hold",
                rpma_common::error_chain(&e)
            ),
        };
        log::error!(
            "subsystem {} namespace {} ({}) has FAILED{since}: {f} (errno {}); {cache}; every \
             durability request on it is refused until an operator clears it with `rpma-target \
             clear-failure {} {}` (writes not acknowledged as durable before it failed may be \
             lost)",
            self.subsystem,
            self.config.nsid,
            self.config.path.display(),
            f.errno,
            self.subsystem,
            self.config.nsid
        );
    }

    /// What the state file remembers about this namespace's failure (None while healthy, or
    /// without a state file).
    pub fn remembered(&self) -> Option<Failed> {
        self.ledger.as_ref()?.get(&self.key)
    }

    /// The pmem options a namespace is opened with: created when it has a size, grown only with
    /// `grow = true`. `check-config` plans with the same options, so it reports what opening does.
    pub fn options(ns: &config::Namespace) -> OpenOptions {
        let opts = OpenOptions::new(&ns.path)
            .resize(if ns.grow {
                Resize::Grow
            } else {
                Resize::Refuse
            })
            .block_size(u64::from(ns.block_size))
            .force_dax(ns.force_dax)
            .power_loss_simulation(ns.power_loss_simulation)
            .create(ns.size.is_some());
        match ns.size {
            Some(size) => opts.size(size),
            None => opts,
        }
    }

    /// The probed (or forced) domain.
    pub fn domain(&self) -> Domain {
        self.mapping.domain()
    }

    /// The file this opening maps (device and inode), if it maps one.
    pub fn file_id(&self) -> Option<(u64, u64)> {
        mark::file_id_of(self.mapping.backing_fd()?)
    }

    /// Which file it maps, as its descriptor tells hosts ([`identity_of`]).
    pub fn identity(&self) -> u64 {
        self.identity
    }

    /// A reload took it out of service: its namespace was removed, or now maps another file.
    /// Nothing is written into it after this (a transfer under way is refused: its file is
    /// the operator's again once the reload is reported done).
    pub fn retire(&self) {
        self.retired.store(true, Ordering::Release);
    }

    /// Whether a reload took it out of service ([`OpenNamespace::retire`]).
    pub fn is_retired(&self) -> bool {
        self.retired.load(Ordering::Acquire)
    }

    /// The domain as every interface shows it, with the power-loss simulation's label when
    /// it is on ("page-cache, power-loss simulation (test only)").
    pub fn domain_label(&self) -> String {
        self.mapping.domain_label()
    }

    /// Size in bytes.
    pub fn size(&self) -> u64 {
        self.mapping.len() as u64
    }

    /// The first failed write-back of the namespace (from any path: a GPSPM fdatasync, the
    /// placement engine's msync for APM and FLUSH), if it has failed. A failed namespace answers
    /// no durability request until an operator clears it ([`NamespaceTable::clear_failure`]);
    /// a reload or restart reopens it failed.
    pub fn failure(&self) -> Option<SyncFailure> {
        self.mapping.failure()
    }
}

#[cfg(test)]
mod tests;
