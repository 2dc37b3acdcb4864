//! What the page cache holds unsynced: cachestat(2), for tests and diagnostics.

use std::path::Path;

/// Pages of `[offset, offset + len)` of the file at `path` that are dirty or under write-back in
/// the page cache (cachestat(2), Linux 6.5+): what a power loss would take. None when the
/// kernel has no cachestat (the caller skips, saying why).
///
/// # Panics
/// When the file cannot be opened or cachestat fails otherwise: it is a helper for tests and
/// diagnostics, which want to stop there.
pub fn unsynced_pages(path: &Path, offset: u64, len: u64) -> Option<u64> {
    /// struct cachestat_range
    #[repr(C)]
    struct Range {
        off: u64,
        len: u64,
    }
    /// struct cachestat
    #[repr(C)]
    #[derive(Default)]
    struct Stat {
        nr_cache: u64,
        nr_dirty: u64,
        nr_writeback: u64,
        nr_evicted: u64,
        nr_recently_evicted: u64,
    }
    const SYS_CACHESTAT: libc::c_long = 451;
    let f = std::fs::File::open(path).expect("open the file to inspect");
    let range = Range { off: offset, len };
    let mut st = Stat::default();
    // SAFETY: cachestat reads `range` and writes one struct cachestat into `st`, both live locals
    // of the layouts the kernel's uapi defines; the descriptor is open for the call.
    let rc = unsafe {
        libc::syscall(
            SYS_CACHESTAT,
            std::os::fd::AsRawFd::as_raw_fd(&f),
            &range as *const Range,
            &mut st as *mut Stat,
            0u32,
        )
    };
    if rc != 0 {
        let e = std::io::Error::last_os_error();
        assert_eq!(e.raw_os_error(), Some(libc::ENOSYS), "cachestat: {e}");
        return None;
    }
    Some(st.nr_dirty + st.nr_writeback)
}
