//! The failure mark on a namespace file itself: the extended attribute `user.rpma.failed`
//! (the failed call and its errno, e.g. `fdatasync 28`), set when the file fails and removed
//! only by `clear-failure`.
//!
//! The state file (`crate::failures`) is what the daemon remembers failures by; the mark is a
//! second record that travels with the file, for what the state file cannot see: a daemon
//! started with another `state_file` (moved after its filesystem failed, as the daemon's own
//! message suggests, or a second configuration), or a state file removed by hand. A file
//! that carries the mark opens failed, and the state file learns it again. A small attribute
//! lives in the inode on ext4 and XFS, so a full filesystem still takes it; where the
//! filesystem has no user attributes (or the file is a device, as devdax is) there is no mark
//! and the state file alone remembers.

use std::ffi::CStr;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

use rpma_common::pmem::SyncFailure;

/// The attribute's name.
pub const NAME: &CStr = c"user.rpma.failed";

/// Errnos that mean "this file cannot carry a mark" (no user attributes here), not a failure.
fn unsupported(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::ENOTSUP | libc::EPERM | libc::EACCES)
    )
}

/// Marks the file of `fd` failed with `f`. Ok(false): the file cannot carry a mark.
///
/// # Errors
/// The attribute could not be written (EIO, EROFS, ENOSPC, ...).
pub fn set(fd: BorrowedFd<'_>, f: &SyncFailure) -> io::Result<bool> {
    let value = format!("{} {}", f.op, f.errno);
    // SAFETY: the name is NUL-terminated, the value's pointer and length describe its bytes,
    // and the fd is open for the call.
    let r = unsafe {
        libc::fsetxattr(
            fd.as_raw_fd(),
            NAME.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    if r == 0 {
        return Ok(true);
    }
    let e = io::Error::last_os_error();
    if unsupported(&e) {
        return Ok(false);
    }
    Err(e)
}

/// The failure the file of `fd` is marked with, if any (a value this build cannot read is a
/// failed write-back with EIO: a mark is never ignored).
///
/// # Errors
/// The attribute could not be read (EIO, ...).
pub fn get(fd: BorrowedFd<'_>) -> io::Result<Option<SyncFailure>> {
    let mut buf = [0u8; 64];
    // SAFETY: the name is NUL-terminated; the buffer's pointer and length describe writable
    // bytes; the fd is open for the call.
    let n = unsafe {
        libc::fgetxattr(
            fd.as_raw_fd(),
            NAME.as_ptr(),
            buf.as_mut_ptr().cast(),
            buf.len(),
        )
    };
    if n < 0 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::ENODATA) || unsupported(&e) {
            return Ok(None);
        }
        if e.raw_os_error() == Some(libc::ERANGE) {
            return Ok(Some(parse(b"")));
        }
        return Err(e);
    }
    Ok(Some(parse(&buf[..n as usize])))
}

/// Removes the mark of the file of `fd` (nothing to do where there is none).
///
/// # Errors
/// The attribute could not be removed (EIO, EROFS, ...).
pub fn remove(fd: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: the name is NUL-terminated; the fd is open for the call.
    if unsafe { libc::fremovexattr(fd.as_raw_fd(), NAME.as_ptr()) } == 0 {
        return Ok(());
    }
    let e = io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::ENODATA) || unsupported(&e) {
        return Ok(());
    }
    Err(e)
}

/// `op errno` as [`set`] writes it; anything else reads as a failed write-back with EIO.
fn parse(value: &[u8]) -> SyncFailure {
    let text = String::from_utf8_lossy(value);
    let mut words = text.split_whitespace();
    let op = match words.next() {
        Some("msync") => "msync",
        Some("fdatasync") => "fdatasync",
        Some("pwrite") => "pwrite",
        Some("load/store") => "load/store",
        _ => "write-back",
    };
    let errno = words
        .next()
        .and_then(|w| w.parse().ok())
        .filter(|&e: &i32| e > 0)
        .unwrap_or(libc::EIO);
    SyncFailure { op, errno }
}

/// The device and inode of the file of `fd`.
pub fn file_id_of(fd: std::os::fd::BorrowedFd<'_>) -> Option<(u64, u64)> {
    let st = nix::sys::stat::fstat(std::os::fd::AsRawFd::as_raw_fd(&fd)).ok()?;
    Some((st.st_dev, st.st_ino))
}

/// Marks the file of `fd` failed with `f` ([`set`]); a mark that cannot be written is
/// logged (the state file still remembers).
pub(super) fn mark_file(
    fd: std::os::fd::BorrowedFd<'_>,
    subsystem: &str,
    nsid: u32,
    f: &SyncFailure,
) {
    if let Err(e) = set(fd, f) {
        log::warn!(
            "subsystem {subsystem} namespace {nsid}: the file could not be marked failed ({e}); \
             the state file alone remembers the failure"
        );
    }
}

/// The regular file at `path`, opened read-only without blocking; None for anything else (none,
/// a FIFO, whose open would wait for a writer, a device) or an open that fails. For looking at
/// a file before (or instead of) serving it: its mark, its lock.
pub fn open_regular(path: &std::path::Path) -> Option<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    if !std::fs::metadata(path).is_ok_and(|m| m.is_file()) {
        return None;
    }
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .ok()
}

/// Whether the regular file at `path` carries the failure mark, or one that cannot be read
/// (taken as failed, as an opening does); anything else at the path says no
/// ([`open_regular`]). For a file that may open short
/// ([`OpenNamespace::open_remembering`](super::OpenNamespace::open_remembering), check-config).
pub fn marked_failed(path: &std::path::Path) -> bool {
    open_regular(path).is_some_and(|f| !matches!(get(std::os::fd::AsFd::as_fd(&f)), Ok(None)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn a_mark_reads_back_and_goes_with_remove() {
        let d = tempfile::tempdir().unwrap();
        let f = std::fs::File::create(d.path().join("ns")).unwrap();
        let fail = SyncFailure {
            op: "fdatasync",
            errno: libc::ENOSPC,
        };
        if !set(f.as_fd(), &fail).unwrap() {
            eprintln!("skipped: this filesystem has no user attributes");
            return;
        }
        assert_eq!(get(f.as_fd()).unwrap(), Some(fail));
        // Another descriptor of the same file sees it: the mark is the file's.
        let g = std::fs::File::open(d.path().join("ns")).unwrap();
        assert_eq!(get(g.as_fd()).unwrap(), Some(fail));
        remove(f.as_fd()).unwrap();
        assert_eq!(get(g.as_fd()).unwrap(), None);
        // Removing what is not there is not an error.
        remove(f.as_fd()).unwrap();
    }

    #[test]
    fn a_value_this_build_cannot_read_is_still_a_failure() {
        assert_eq!(
            parse(b"fdatasync 5"),
            SyncFailure {
                op: "fdatasync",
                errno: 5
            }
        );
        assert_eq!(parse(b"load/store 5"), SyncFailure::unreadable());
        assert_eq!(
            parse(b"flushed-by-a-newer-build x"),
            SyncFailure {
                op: "write-back",
                errno: libc::EIO
            }
        );
        assert_eq!(
            parse(b""),
            SyncFailure {
                op: "write-back",
                errno: libc::EIO
            }
        );
        assert_eq!(
            parse(b"msync -3"),
            SyncFailure {
                op: "msync",
                errno: libc::EIO
            }
        );
    }

    #[test]
    fn a_device_or_a_filesystem_without_attributes_carries_no_mark() {
        let null = std::fs::File::open("/dev/null").unwrap();
        let fail = SyncFailure {
            op: "msync",
            errno: libc::EIO,
        };
        // /dev/null is a device: no user attributes (EPERM), so no mark and no error.
        assert!(!set(null.as_fd(), &fail).unwrap());
        assert_eq!(get(null.as_fd()).unwrap(), None);
        remove(null.as_fd()).unwrap();
    }
}
