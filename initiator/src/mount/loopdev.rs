//! Loop devices over the FUSE file, through the kernel's loop ioctls (linux/loop.h):
//! LOOP_CTL_GET_FREE + LOOP_CONFIGURE to attach (direct I/O asked for, and checked), LOOP_CLR_FD
//! to detach, /sys/block/loopN/loop/backing_file to find the devices over a file.
//!
//! No autoclear: the mount process does not keep the device open, so nothing detaches it
//! behind an operator's back; `rpma-initiator umount` and SIGTERM detach it explicitly.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

const LOOP_CLR_FD: libc::c_ulong = 0x4C01;
const LOOP_CONFIGURE: libc::c_ulong = 0x4C0A;
const LOOP_CTL_GET_FREE: libc::c_ulong = 0x4C82;
const LO_FLAGS_READ_ONLY: u32 = 1;
const LO_FLAGS_DIRECT_IO: u32 = 16;
const LO_NAME_SIZE: usize = 64;

/// struct loop_info64 (linux/loop.h).
#[repr(C)]
struct LoopInfo64 {
    lo_device: u64,
    lo_inode: u64,
    lo_rdevice: u64,
    lo_offset: u64,
    lo_sizelimit: u64,
    lo_number: u32,
    lo_encrypt_type: u32,
    lo_encrypt_key_size: u32,
    lo_flags: u32,
    lo_file_name: [u8; LO_NAME_SIZE],
    lo_crypt_name: [u8; LO_NAME_SIZE],
    lo_encrypt_key: [u8; 32],
    lo_init: [u64; 2],
}

/// struct loop_config (linux/loop.h, Linux 5.8+).
#[repr(C)]
struct LoopConfig {
    fd: u32,
    block_size: u32,
    info: LoopInfo64,
    reserved: [u64; 8],
}

/// An attached loop device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LoopDev {
    /// /dev/loopN.
    pub(crate) path: PathBuf,
    /// The kernel does direct I/O on the file (no second page cache).
    pub(crate) direct_io: bool,
}

fn name_of(dev: &Path) -> Option<String> {
    dev.file_name().map(|n| n.to_string_lossy().into_owned())
}

/// Attaches a free loop device to `file` with logical blocks of `block_size` bytes, read-only
/// when `read_only`, direct I/O when the kernel allows it on the file.
///
/// # Errors
/// /dev/loop-control missing (no loop module), no free device, LOOP_CONFIGURE refused.
pub(crate) fn attach(file: &Path, block_size: u32, read_only: bool) -> io::Result<LoopDev> {
    let ctl = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC)
        .open("/dev/loop-control")
        .map_err(|e| io::Error::new(e.kind(), format!("opening /dev/loop-control: {e}")))?;
    let backing = OpenOptions::new()
        .read(true)
        .write(!read_only)
        .custom_flags(libc::O_CLOEXEC)
        .open(file)
        .map_err(|e| io::Error::new(e.kind(), format!("opening {}: {e}", file.display())))?;
    // Another process may take the free device between the two calls: try again.
    let mut last = io::Error::other("no attempt");
    for _ in 0..16 {
        // SAFETY: LOOP_CTL_GET_FREE takes no argument; `ctl` is an open descriptor.
        let n = unsafe { libc::ioctl(ctl.as_raw_fd(), LOOP_CTL_GET_FREE) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        let path = PathBuf::from(format!("/dev/loop{n}"));
        let dev = match open_dev(&path, read_only, false) {
            Ok(d) => d,
            Err(e) => {
                last = e;
                std::thread::sleep(std::time::Duration::from_millis(20));
                continue;
            }
        };
        let flags = LO_FLAGS_DIRECT_IO | if read_only { LO_FLAGS_READ_ONLY } else { 0 };
        match configure(&dev, &backing, file, block_size, flags) {
            Ok(()) => {
                let direct_io = sysfs(&path, "dio").is_some_and(|v| v == "1");
                return Ok(LoopDev { path, direct_io });
            }
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => last = e,
            // The file refuses direct I/O: buffered, as losetup does then.
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                configure(
                    &dev,
                    &backing,
                    file,
                    block_size,
                    flags & !LO_FLAGS_DIRECT_IO,
                )?;
                return Ok(LoopDev {
                    path,
                    direct_io: false,
                });
            }
            Err(e) => return Err(e),
        }
    }
    Err(last)
}

fn open_dev(path: &Path, read_only: bool, exclusive: bool) -> io::Result<File> {
    let mut flags = libc::O_CLOEXEC;
    if exclusive {
        flags |= libc::O_EXCL;
    }
    OpenOptions::new()
        .read(true)
        .write(!read_only)
        .custom_flags(flags)
        .open(path)
}

fn configure(
    dev: &File,
    backing: &File,
    name: &Path,
    block_size: u32,
    flags: u32,
) -> io::Result<()> {
    let mut file_name = [0u8; LO_NAME_SIZE];
    let b = name.as_os_str().as_bytes();
    let n = b.len().min(LO_NAME_SIZE - 1);
    file_name[..n].copy_from_slice(&b[..n]);
    let cfg = LoopConfig {
        fd: backing.as_raw_fd() as u32,
        block_size,
        info: LoopInfo64 {
            lo_device: 0,
            lo_inode: 0,
            lo_rdevice: 0,
            lo_offset: 0,
            lo_sizelimit: 0,
            lo_number: 0,
            lo_encrypt_type: 0,
            lo_encrypt_key_size: 0,
            lo_flags: flags,
            lo_file_name: file_name,
            lo_crypt_name: [0; LO_NAME_SIZE],
            lo_encrypt_key: [0; 32],
            lo_init: [0; 2],
        },
        reserved: [0; 8],
    };
    // SAFETY: LOOP_CONFIGURE reads one struct loop_config, laid out as linux/loop.h declares
    // it, from a live local; the descriptors it names are open for the call.
    let rc = unsafe { libc::ioctl(dev.as_raw_fd(), LOOP_CONFIGURE, &cfg as *const LoopConfig) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Why a detach did not happen.
#[derive(Debug, thiserror::Error)]
pub(crate) enum DetachError {
    /// Someone holds the device exclusively (a mounted filesystem, mkfs running).
    #[error("{} is in use (a filesystem on it is mounted?): unmount it first", .0.display())]
    Busy(PathBuf),
    /// Another failure.
    #[error("detaching {}: {source}", .path.display())]
    Io {
        /// The device.
        path: PathBuf,
        /// What the kernel said.
        #[source]
        source: io::Error,
    },
}

/// Detaches `dev` now, or refuses (Busy) while something holds it: a detach of a busy device
/// would only be deferred (autoclear), and the file under it would stay open.
///
/// # Errors
/// [`DetachError`].
pub(crate) fn detach(dev: &Path) -> Result<(), DetachError> {
    let io_err = |source| DetachError::Io {
        path: dev.to_owned(),
        source,
    };
    // O_EXCL on a block device: EBUSY while a filesystem (or anyone else) claims it.
    let f = match open_dev(dev, true, true) {
        Ok(f) => f,
        Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
            return Err(DetachError::Busy(dev.to_owned()))
        }
        Err(e) => return Err(io_err(e)),
    };
    // SAFETY: LOOP_CLR_FD takes no argument; `f` is an open descriptor of the device.
    let rc = unsafe { libc::ioctl(f.as_raw_fd(), LOOP_CLR_FD, 0) };
    if rc != 0 {
        let e = io::Error::last_os_error();
        // ENXIO: not attached (any more): nothing to do.
        if e.raw_os_error() != Some(libc::ENXIO) {
            return Err(io_err(e));
        }
    }
    Ok(())
}

/// [`detach`], waiting up to `settle` for a Busy device to be released: a filesystem unmounted
/// a moment ago may let go of its device only after its `umount` returned (the kernel can drop
/// the last reference to it from a worker), so a script's `umount` followed at once by ours
/// would otherwise be refused. Still Busy after `settle`: Busy.
///
/// # Errors
/// [`DetachError`].
pub(crate) fn detach_settled(dev: &Path, settle: std::time::Duration) -> Result<(), DetachError> {
    let until = std::time::Instant::now() + settle;
    loop {
        match detach(dev) {
            Err(DetachError::Busy(_)) if std::time::Instant::now() < until => {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            r => return r,
        }
    }
}

/// Detaches `dev` once its last user closes it (the kernel's autoclear): for a device that
/// [`detach`] found busy, so that unmounting the filesystem on it also releases the file.
///
/// # Errors
/// Opening the device, LOOP_CLR_FD.
pub(crate) fn detach_deferred(dev: &Path) -> io::Result<()> {
    let f = open_dev(dev, true, false)?;
    // SAFETY: as in detach; with other openers the kernel only sets LO_FLAGS_AUTOCLEAR.
    let rc = unsafe { libc::ioctl(f.as_raw_fd(), LOOP_CLR_FD, 0) };
    if rc != 0 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::ENXIO) {
            return Err(e);
        }
    }
    Ok(())
}

fn sysfs(dev: &Path, attr: &str) -> Option<String> {
    let name = name_of(dev)?;
    std::fs::read_to_string(format!("/sys/block/{name}/loop/{attr}"))
        .ok()
        .map(|s| s.trim_end().to_owned())
}

/// The loop devices whose backing file lies under `dir` (by the path the kernel records, so a
/// dead FUSE mount's devices are found too).
pub(crate) fn backed_under(dir: &Path) -> Vec<PathBuf> {
    let Ok(rd) = std::fs::read_dir("/sys/block") else {
        return Vec::new();
    };
    let mut v: Vec<PathBuf> = rd
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("loop"))
        .filter_map(|e| {
            let dev = PathBuf::from("/dev").join(e.file_name());
            let backing = PathBuf::from(sysfs(&dev, "backing_file")?);
            (backing.parent() == Some(dir)).then_some(dev)
        })
        .collect();
    v.sort();
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loop_config_has_the_uapi_size() {
        // linux/loop.h: loop_info64 is 232 bytes, loop_config 304.
        assert_eq!(std::mem::size_of::<LoopInfo64>(), 232);
        assert_eq!(std::mem::size_of::<LoopConfig>(), 304);
    }

    #[test]
    fn nothing_is_backed_by_a_fresh_directory() {
        let d = tempfile::tempdir().unwrap();
        assert!(backed_under(d.path()).is_empty());
        assert_eq!(sysfs(Path::new("/dev/loop-none"), "backing_file"), None);
    }
}
