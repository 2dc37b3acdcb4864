//! A filesystem whose write-back fails on demand, for the failed-namespace tests of both
//! listeners: ext4 on a loop device whose 256 MiB sparse image lies on a 48 MiB tmpfs. Once the
//! tmpfs is full ([`FragileFs::fill`]), the next write-back to the loop device fails; a
//! namespace file on the ext4 sees that as an error of its `fdatasync`.

use std::path::{Path, PathBuf};

use crate::run_tool as sh;

/// The ext4 filesystem, mounted at [`FragileFs::mnt`]; unmounted, detached and its tmpfs
/// unmounted on drop.
#[derive(Debug)]
pub struct FragileFs {
    /// Where the ext4 filesystem is mounted.
    pub mnt: PathBuf,
    tmpfs: PathBuf,
    loopdev: String,
}

impl FragileFs {
    /// Mounts the tmpfs at `dir/t`, the ext4 at `dir/m`.
    ///
    /// # Errors
    /// Not root, or a command (mount, truncate, mkfs.ext4, losetup) failed: the caller skips.
    pub fn new(dir: &Path) -> Result<FragileFs, String> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return Err("needs root (mount, losetup)".into());
        }
        let (tmpfs, mnt) = (dir.join("t"), dir.join("m"));
        std::fs::create_dir_all(&tmpfs).map_err(|e| e.to_string())?;
        std::fs::create_dir_all(&mnt).map_err(|e| e.to_string())?;
        let t = tmpfs.to_str().unwrap();
        sh("mount", &["-t", "tmpfs", "-o", "size=48M", "tmpfs", t])?;
        let mut fs = FragileFs {
            tmpfs: tmpfs.clone(),
            mnt: mnt.clone(),
            loopdev: String::new(),
        };
        let img = tmpfs.join("img");
        let img = img.to_str().unwrap();
        sh("truncate", &["-s", "256M", img])?;
        sh("mkfs.ext4", &["-q", "-F", img])?;
        fs.loopdev = sh("losetup", &["--find", "--show", img])?;
        // noinit_itable: no background zeroing that would fill the tmpfs on its own.
        sh(
            "mount",
            &["-o", "noinit_itable", &fs.loopdev, mnt.to_str().unwrap()],
        )?;
        Ok(fs)
    }

    /// As [`FragileFs::new`], or None where it cannot be built, with a line saying the test is
    /// skipped and why.
    pub fn or_skip(dir: &Path) -> Option<FragileFs> {
        FragileFs::new(dir)
            .map_err(|why| eprintln!("SKIPPED: cannot build the failing filesystem here: {why}"))
            .ok()
    }

    /// Fills the tmpfs under the image: the next write-back to the loop device fails.
    pub fn fill(&self) {
        let _ = std::fs::write(self.tmpfs.join("fill"), vec![0u8; 64 << 20]);
        assert_eq!(free_blocks(&self.tmpfs), 0, "the tmpfs is full");
    }

    /// Frees the tmpfs again: write-backs succeed.
    pub fn free(&self) {
        std::fs::remove_file(self.tmpfs.join("fill")).unwrap();
    }

    /// Unmounts the ext4 filesystem, drops the loop device's buffers and mounts it again: what
    /// the files then hold is what reached the media (the tmpfs under the loop device).
    pub fn remount(&self) {
        let m = self.mnt.to_str().unwrap();
        sh("umount", &[m]).unwrap();
        sh("blockdev", &["--flushbufs", &self.loopdev]).unwrap();
        sh("mount", &["-o", "noinit_itable", &self.loopdev, m]).unwrap();
    }
}

/// Free blocks of the filesystem at `p`.
fn free_blocks(p: &Path) -> u64 {
    let c = std::ffi::CString::new(p.to_str().unwrap()).unwrap();
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::zeroed();
    // SAFETY: a valid C string and a buffer of the right type, written by statvfs.
    let rc = unsafe { libc::statvfs(c.as_ptr(), st.as_mut_ptr()) };
    assert_eq!(rc, 0);
    // SAFETY: statvfs succeeded, so it filled the buffer.
    unsafe { st.assume_init() }.f_bavail
}

impl Drop for FragileFs {
    fn drop(&mut self) {
        let _ = sh("umount", &["-l", self.mnt.to_str().unwrap()]);
        if !self.loopdev.is_empty() {
            let _ = sh("losetup", &["-d", &self.loopdev]);
        }
        let _ = sh("umount", &["-l", self.tmpfs.to_str().unwrap()]);
    }
}
