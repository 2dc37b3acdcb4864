//! The fallocate-up-front guarantee: on a filesystem without room, open fails with a clear
//! error and nothing is mapped (so no later store can SIGBUS). Uses a tmpfs with a tiny `size=`
//! mounted under a temp dir, which needs root (CAP_SYS_ADMIN); without it the test says why it
//! skipped.

use std::ffi::CString;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use rpma_common::pmem::{Domain, Error, OpenOptions, Resize};

/// A tmpfs mounted for one test, unmounted (lazily if busy) when dropped.
struct TinyTmpfs {
    dir: tempfile::TempDir,
}

impl TinyTmpfs {
    fn mount(size: &str) -> Option<TinyTmpfs> {
        let dir = tempfile::Builder::new()
            .prefix("rpma-tiny-tmpfs-")
            .tempdir()
            .unwrap();
        let target = CString::new(dir.path().as_os_str().as_bytes()).unwrap();
        let opts = CString::new(format!("size={size},mode=0700")).unwrap();
        // SAFETY: every pointer is a NUL-terminated string that outlives the call.
        let rc = unsafe {
            libc::mount(
                c"tmpfs".as_ptr(),
                target.as_ptr(),
                c"tmpfs".as_ptr(),
                0,
                opts.as_ptr().cast(),
            )
        };
        if rc != 0 {
            eprintln!(
                "skipped: cannot mount a tmpfs ({}); this test needs root",
                std::io::Error::last_os_error()
            );
            return None;
        }
        Some(TinyTmpfs { dir })
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for TinyTmpfs {
    fn drop(&mut self) {
        let target = CString::new(self.dir.path().as_os_str().as_bytes()).unwrap();
        // SAFETY: target is a NUL-terminated path that outlives the calls.
        unsafe {
            if libc::umount2(target.as_ptr(), 0) != 0 {
                libc::umount2(target.as_ptr(), libc::MNT_DETACH);
            }
        }
    }
}

#[test]
fn full_filesystem_fails_at_open_not_later() {
    let Some(fs_) = TinyTmpfs::mount("256k") else {
        return;
    };
    let path = fs_.path().join("ns.pmem");
    let err = OpenOptions::new(&path)
        .size(1 << 20)
        .create(true)
        .open()
        .unwrap_err();
    assert!(
        matches!(err, Error::NoSpace { size, .. } if size == 1 << 20),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(msg.contains("no room") && msg.contains("ns.pmem"), "{msg}");
    assert!(!path.exists(), "the failed create left a file behind");

    // What fits is allocated in full: a store to its last byte cannot fault.
    let m = OpenOptions::new(&path)
        .size(128 << 10)
        .create(true)
        .open()
        .unwrap();
    assert_eq!(m.domain(), Domain::Volatile);
    m.write_at((128 << 10) - 1, &[0xAB]).unwrap();

    // The first file holds half the space now: a second as large no longer fits.
    let err = OpenOptions::new(fs_.path().join("second.pmem"))
        .size(192 << 10)
        .create(true)
        .open()
        .unwrap_err();
    assert!(matches!(err, Error::NoSpace { .. }), "{err:?}");
    drop(m);
}

#[test]
fn failed_grow_leaves_the_file_as_it_was() {
    let Some(fs_) = TinyTmpfs::mount("128k") else {
        return;
    };
    let path = fs_.path().join("ns.pmem");
    let m = OpenOptions::new(&path)
        .size(64 << 10)
        .create(true)
        .open()
        .unwrap();
    m.write_at(100, b"still here").unwrap();
    drop(m);
    let err = OpenOptions::new(&path)
        .size(1 << 20)
        .resize(Resize::Grow)
        .open()
        .unwrap_err();
    assert!(matches!(err, Error::NoSpace { .. }), "{err:?}");
    let bytes = fs::read(&path).unwrap();
    assert_eq!(bytes.len(), 64 << 10, "a failed grow changed the size");
    assert_eq!(&bytes[100..110], b"still here");
}
