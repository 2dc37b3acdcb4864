//! The FUSE mount itself: mount(2) of a `fuse.rpma` filesystem on an open /dev/fuse (so no
//! fusermount helper and no libfuse are needed: this needs root, or CAP_SYS_ADMIN), umount2(2),
//! and /proc/mounts look-ups.

use std::ffi::CString;
use std::fs::OpenOptions;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// The filesystem type the mount shows in /proc/mounts (`fuse.` + subtype).
pub(crate) const FSTYPE: &str = "fuse.rpma";

fn cstr(p: &Path) -> io::Result<CString> {
    CString::new(p.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a path with a NUL byte"))
}

/// Opens /dev/fuse and mounts a FUSE filesystem served through it on `dir` (nosuid, nodev;
/// read-only when `read_only`; only root may use it, as FUSE's default). The kernel queues the
/// INIT request at once: hand the descriptor to the session.
///
/// # Errors
/// Opening /dev/fuse (ENOENT without the fuse module), mount(2) (ENOENT, ENOTDIR, EPERM
/// without CAP_SYS_ADMIN).
pub(crate) fn mount(dir: &Path, source: &str, read_only: bool) -> io::Result<OwnedFd> {
    let dev = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC)
        .open("/dev/fuse")
        .map_err(|e| io::Error::new(e.kind(), format!("opening /dev/fuse: {e}")))?;
    let fd = OwnedFd::from(dev);
    let data = CString::new(format!(
        "fd={},rootmode=40755,user_id=0,group_id=0,default_permissions",
        fd.as_raw_fd()
    ))
    .expect("no NUL in the options");
    let target = cstr(dir)?;
    let src = CString::new(source.replace(['\0', ' ', ','], "_")).expect("NULs replaced");
    let fstype = CString::new(FSTYPE).expect("no NUL");
    let mut flags = libc::MS_NOSUID | libc::MS_NODEV;
    if read_only {
        flags |= libc::MS_RDONLY;
    }
    // SAFETY: every pointer is a live NUL-terminated CString of this frame; the data string is
    // the fuse option text the kernel parses; the fd it names stays open (we own it).
    let rc = unsafe {
        libc::mount(
            src.as_ptr(),
            target.as_ptr(),
            fstype.as_ptr(),
            flags,
            data.as_ptr().cast(),
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

/// umount2(2) of `dir`: plain, or lazy (MNT_DETACH: gone from the namespace now, released when
/// its last user closes it).
///
/// # Errors
/// EBUSY (a plain unmount of a file that is open), EINVAL (not a mount point), EPERM.
pub(crate) fn unmount(dir: &Path, lazy: bool) -> io::Result<()> {
    let target = cstr(dir)?;
    let flags = if lazy { libc::MNT_DETACH } else { 0 };
    // SAFETY: `target` is a live NUL-terminated path.
    let rc = unsafe { libc::umount2(target.as_ptr(), flags) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// One line of /proc/mounts: (mount point, type).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct MountEntry {
    pub(crate) dir: PathBuf,
    pub(crate) fstype: String,
}

/// Parses /proc/mounts text.
pub(crate) fn parse_mounts(text: &str) -> Vec<MountEntry> {
    text.lines()
        .filter_map(|l| {
            let mut f = l.split(' ');
            let (_source, dir, fstype) = (f.next()?, f.next()?, f.next()?);
            Some(MountEntry {
                dir: PathBuf::from(rpma_common::mountinfo::unescape(dir)),
                fstype: fstype.to_owned(),
            })
        })
        .collect()
}

/// The mounts of this mount namespace.
///
/// # Errors
/// Reading /proc/mounts.
pub(crate) fn mounts() -> io::Result<Vec<MountEntry>> {
    Ok(parse_mounts(&std::fs::read_to_string("/proc/mounts")?))
}

/// `dir` made absolute without touching `dir` itself (a mount whose server died answers
/// ENOTCONN): its parent canonicalized, its name appended.
///
/// # Errors
/// The parent does not exist.
pub(crate) fn absolute(dir: &Path) -> io::Result<PathBuf> {
    let abs = std::path::absolute(dir)?;
    match (abs.parent(), abs.file_name()) {
        (Some(parent), Some(name)) => Ok(std::fs::canonicalize(parent)?.join(name)),
        _ => Ok(abs),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mounts_parse_with_escapes() {
        let m = parse_mounts(
            "proc /proc proc rw 0 0\nrpma /mnt/a\\040b fuse.rpma rw,nosuid 0 0\nbad\n",
        );
        assert_eq!(m.len(), 2);
        assert_eq!(m[1].dir, PathBuf::from("/mnt/a b"));
        assert_eq!(m[1].fstype, FSTYPE);
    }

    #[test]
    fn absolute_does_not_stat_the_directory_itself() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("missing");
        let a = absolute(&p).unwrap();
        assert_eq!(a, std::fs::canonicalize(d.path()).unwrap().join("missing"));
        assert!(absolute(Path::new("/nonexistent-rpma/x")).is_err());
    }
}
