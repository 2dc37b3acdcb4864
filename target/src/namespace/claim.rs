//! The daemon's claim on each namespace file: every opening of one file in this process joins
//! the same [`Claim`], and the process holds an exclusive `flock` on the file while any of them
//! lives.
//!
//! Linux reports a failed write-back once, to the open file descriptions that were open when it
//! failed and synced after, and then marks the pages clean. So an opening made after another
//! opening's sync took the report never hears of it:
//!
//! - within the daemon, a reload that reopens a namespace (a changed setting, a replaced file)
//!   while a sync of the old opening is failing could start the new opening healthy, and it
//!   stayed healthy in memory until the next restart read the state file. A failure any
//!   opening of a file meets is now recorded in every live opening of it ([`Claim::spread`])
//!   before the failing call returns, and a new opening starts failed if a live one has failed
//!   ([`join`]);
//! - two daemons serving one file (each with its own state file) would each miss the other's
//!   failures and call lost data durable. The second is refused: its namespace does not open
//!   ([`ClaimError::InUse`]), so it does not start, or its reload is refused.
//!
//! The lock is `flock(2)`, held by a descriptor of the registry's own (the file opened again
//! through `/proc/self/fd`): it belongs to that open file description, so the daemon's own
//! openings of the file never conflict with it, and it goes with the last opening (or with the
//! process, however it ends).

use std::collections::BTreeMap;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use rpma_common::pmem::{Mapping, Persist, SyncFailure};

/// A file by device and inode.
pub(super) type FileId = (u64, u64);

/// Every file some opening in this process claims, with the descriptor holding its lock.
static CLAIMS: Mutex<BTreeMap<FileId, Entry>> = Mutex::new(BTreeMap::new());

struct Entry {
    claim: Weak<Claim>,
    /// Holds the file's flock (None where the file takes no flock: see [`join`]). Kept here,
    /// not in the claim: a claim that is being dropped while a new opening joins leaves the
    /// lock to the new claim instead of taking it with it (the new claim would find its own
    /// process holding the lock).
    _lock: Option<OwnedFd>,
}

/// The live openings of one file.
#[derive(Debug)]
pub(super) struct Claim {
    id: FileId,
    openings: Mutex<Vec<Weak<Mapping>>>,
}

/// Why a file could not be claimed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClaimError {
    /// Another process holds the file's lock.
    #[error(
        "the file is in use by another process (another rpma-target serves it, or a tool \
         holds its flock): two daemons on one file would each miss the other's write-back \
         failures"
    )]
    InUse,
    /// The file could not be examined or locked.
    #[error("cannot lock the file")]
    Io(#[source] std::io::Error),
}

fn registry() -> MutexGuard<'static, BTreeMap<FileId, Entry>> {
    CLAIMS.lock().unwrap_or_else(|e| e.into_inner())
}

/// The device and inode of the file behind `fd`.
pub(super) fn file_id(fd: BorrowedFd<'_>) -> std::io::Result<FileId> {
    let st = nix::sys::stat::fstat(fd.as_raw_fd()).map_err(std::io::Error::from)?;
    Ok((st.st_dev, st.st_ino))
}

/// Adds `mapping` to the claim on its file, making the claim (and taking the file's lock) if
/// no live opening has one. Returns the claim (None for a mapping of no file), and the failure
/// a live opening of the same file has met, which the new opening must start with. A file that
/// cannot be locked (no `/proc`, a filesystem without flock) is claimed without the lock, with
/// a warning: the daemon's own openings still share their failures.
///
/// # Errors
/// [`ClaimError::InUse`] when another process holds the lock, [`ClaimError::Io`].
pub(super) fn join(
    mapping: &Arc<Mapping>,
) -> Result<(Option<Arc<Claim>>, Option<SyncFailure>), ClaimError> {
    let Some(fd) = mapping.backing_fd() else {
        return Ok((None, None));
    };
    let id = file_id(fd).map_err(ClaimError::Io)?;
    // No claim may be dropped while this is held (its drop takes it too): one made here is
    // made only once nothing can fail.
    let mut reg = registry();
    let live = reg.get(&id).and_then(|e| e.claim.upgrade());
    let claim = match live {
        Some(c) => c,
        None => {
            // A last claim being dropped left its entry, and the lock is still ours.
            let lock = match reg.contains_key(&id) {
                true => None,
                false => Some(match lock_own(fd) {
                    Ok(lock) => Some(lock),
                    Err(ClaimError::Io(e)) => {
                        log::warn!(
                            "namespace file (device {}, inode {}): not locked against other \
                             processes ({e}): a second daemon on it would not be refused",
                            id.0,
                            id.1
                        );
                        None
                    }
                    Err(e) => return Err(e),
                }),
            };
            let claim = Arc::new(Claim {
                id,
                openings: Mutex::new(Vec::new()),
            });
            match lock {
                Some(lock) => {
                    reg.insert(
                        id,
                        Entry {
                            claim: Arc::downgrade(&claim),
                            _lock: lock,
                        },
                    );
                }
                None => {
                    if let Some(e) = reg.get_mut(&id) {
                        e.claim = Arc::downgrade(&claim);
                    }
                }
            }
            claim
        }
    };
    drop(reg);
    let failed = {
        let mut openings = claim.lock();
        openings.retain(|w| w.strong_count() > 0);
        let failed = openings
            .iter()
            .filter_map(Weak::upgrade)
            .find_map(|m| m.failure());
        openings.push(Arc::downgrade(mapping));
        failed
    };
    Ok((Some(claim), failed))
}

/// The file behind `fd` opened again (an open file description of its own: a dup would share
/// the mapping's, and the lock would live as long as that mapping's descriptor), locked.
fn lock_own(fd: BorrowedFd<'_>) -> Result<OwnedFd, ClaimError> {
    let own =
        std::fs::File::open(format!("/proc/self/fd/{}", fd.as_raw_fd())).map_err(ClaimError::Io)?;
    lock_exclusive(OwnedFd::from(own))
}

fn lock_exclusive(fd: OwnedFd) -> Result<OwnedFd, ClaimError> {
    // SAFETY: flock only reads the descriptor, which `fd` keeps open for the call.
    let r = unsafe { libc::flock(fd.as_fd().as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if r == 0 {
        return Ok(fd);
    }
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
        Err(ClaimError::InUse)
    } else {
        Err(ClaimError::Io(e))
    }
}

impl Claim {
    fn lock(&self) -> MutexGuard<'_, Vec<Weak<Mapping>>> {
        self.openings.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records `failure`, met by the opening `from`, in every live opening of the file (each
    /// one's own failure hook then runs: the state file, and this again for the others, which
    /// have it by then). Nothing if `from` is no longer one of them: the operator cleared its
    /// failure meanwhile ([`forget_failed`](Self::forget_failed)), and the opening that
    /// replaced it must not fail with the failure that was cleared.
    pub(super) fn spread(&self, from: &Weak<Mapping>, failure: &SyncFailure) {
        let live: Vec<Arc<Mapping>> = {
            let openings = self.lock();
            if !openings.iter().any(|w| w.ptr_eq(from)) {
                return;
            }
            openings.iter().filter_map(Weak::upgrade).collect()
        };
        for m in live {
            m.record_failure(*failure);
        }
    }

    /// Forgets the openings that have failed, but `clearing` (the operator cleared the file's
    /// failure through it: no opening may start failed from the others). An opening that
    /// fails after this still spreads its failure.
    pub(super) fn forget_failed(&self, clearing: &Arc<Mapping>) {
        let keep = Arc::downgrade(clearing);
        self.lock()
            .retain(|w| w.ptr_eq(&keep) || w.upgrade().is_some_and(|m| m.failure().is_none()));
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        let mut reg = registry();
        if reg
            .get(&self.id)
            .is_some_and(|e| e.claim.strong_count() == 0)
        {
            // No claim on the file lives: its lock goes.
            reg.remove(&self.id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rpma_common::pmem::OpenOptions;

    fn open(path: &std::path::Path) -> Arc<Mapping> {
        Arc::new(
            OpenOptions::new(path)
                .size(1 << 20)
                .create(true)
                .open()
                .unwrap(),
        )
    }

    fn eio() -> SyncFailure {
        SyncFailure::new("fdatasync", &std::io::Error::from_raw_os_error(libc::EIO))
    }

    /// Whether another open file description can take the file's flock now.
    fn lockable(path: &std::path::Path) -> bool {
        let f = std::fs::File::open(path).unwrap();
        lock_exclusive(OwnedFd::from(f)).is_ok()
    }

    #[test]
    fn openings_of_one_file_share_a_claim_and_its_lock_goes_with_the_last() {
        let dir = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        let path = dir.path().join("ns");
        let (a, b) = (open(&path), open(&path));
        let (ca, fa) = join(&a).unwrap();
        let (cb, fb) = join(&b).unwrap();
        let (ca, cb) = (ca.unwrap(), cb.unwrap());
        assert!(Arc::ptr_eq(&ca, &cb), "one claim per file");
        assert_eq!((fa, fb), (None, None));
        assert!(!lockable(&path), "another open file description is refused");
        drop(ca);
        assert!(!lockable(&path), "held while an opening lives");
        drop(cb);
        assert!(lockable(&path), "let go with the last");
        // And taken again by the next opening.
        let (c, _) = join(&open(&path)).unwrap();
        assert!(!lockable(&path));
        drop(c);
    }

    #[test]
    fn a_file_another_process_holds_is_refused() {
        let dir = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        let path = dir.path().join("ns");
        let m = open(&path);
        // Another open file description, as another process would have.
        let other = lock_exclusive(OwnedFd::from(std::fs::File::open(&path).unwrap())).unwrap();
        assert!(matches!(join(&m), Err(ClaimError::InUse)));
        drop(other);
        assert!(join(&m).is_ok());
    }

    #[test]
    fn a_failure_reaches_every_live_opening_and_the_next_one() {
        let dir = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        let path = dir.path().join("ns");
        let (a, b) = (open(&path), open(&path));
        let (ca, _) = join(&a).unwrap();
        let (cb, _) = join(&b).unwrap();
        let ca = ca.unwrap();
        // What the namespace's failure hook does: the failing opening records, then spreads.
        assert!(a.record_failure(eio()));
        ca.spread(&Arc::downgrade(&a), &eio());
        assert_eq!(b.failure().map(|f| f.errno), Some(libc::EIO));
        // An opening made now starts failed; another file's does not.
        let c = open(&path);
        let (_cc, fc) = join(&c).unwrap();
        assert_eq!(fc.map(|f| f.errno), Some(libc::EIO));
        let (_cd, fd) = join(&open(&dir.path().join("other"))).unwrap();
        assert_eq!(fd, None);
        // Once the operator cleared it (through c), the failed openings no longer count, and the
        // hook of one of them that was still spreading the failure reaches no opening made since.
        ca.forget_failed(&c);
        let e = open(&path);
        let (_ce, fe) = join(&e).unwrap();
        assert_eq!(fe, None);
        ca.spread(&Arc::downgrade(&a), &eio());
        assert_eq!(e.failure(), None);
        drop(cb);
    }
}
