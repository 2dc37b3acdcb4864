//! What the page cache holds unsynced: cachestat(2) ([`rpma_common::pmem::unsynced_pages`]).

pub use rpma_common::pmem::unsynced_pages;

/// Whether cachestat(2) can tell `path`'s unsynced pages on this kernel; if not, says that the
/// test is skipped (a page-cache durability test cannot see what it checks without it).
pub fn sees_unsynced_pages(path: &std::path::Path) -> bool {
    let seen = unsynced_pages(path, 0, 4096).is_some();
    if !seen {
        eprintln!("SKIPPED: this kernel has no cachestat(2) to see unsynced pages");
    }
    seen
}
