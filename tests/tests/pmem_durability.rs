//! Durability of a page-cache namespace as the kernel sees it: after `Persist::persist` the range
//! has no dirty or write-back page left in the page cache (cachestat(2)), so a power loss could
//! not take it; before, the same bytes were dirty. A persist that does nothing fails this test
//! (a SIGKILLed process could not show it: its dirty pages survive in the page cache).

use std::path::Path;

use rpma_common::pmem::{Domain, Durability, OpenOptions, Persist};

/// An unaligned range over three pages, away from the file's other pages.
const OFFSET: usize = 4096 * 2 - 5;
const LEN: usize = 3 * 4096;

#[test]
fn persist_leaves_no_dirty_page_in_the_range() {
    let scratch = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scratch");
    std::fs::create_dir_all(&scratch).unwrap();
    let dir = tempfile::Builder::new()
        .prefix("pmem-durability-")
        .tempdir_in(scratch)
        .unwrap();
    let path = dir.path().join("ns.pmem");
    let m = OpenOptions::new(&path)
        .size(64 << 10)
        .create(true)
        .open()
        .unwrap();
    assert_eq!(m.domain(), Domain::PageCache, "{m:?}");
    let Some(clean) = rpma_tests::unsynced_pages(&path, 0, 64 << 10) else {
        eprintln!("skipped: this kernel has no cachestat(2)");
        return;
    };
    assert_eq!(clean, 0, "a new file has no dirty page");

    let data: Vec<u8> = (0..LEN).map(|i| (i as u8).wrapping_mul(31)).collect();
    m.write_at(OFFSET, &data).unwrap();
    let (first, end) = (OFFSET as u64 & !4095, (OFFSET + LEN) as u64);
    let dirty = rpma_tests::unsynced_pages(&path, first, end - first).unwrap();
    assert!(
        dirty >= 3,
        "the written pages are dirty before persist: {dirty}"
    );

    assert_eq!(m.persist(OFFSET, LEN).unwrap(), Durability::Durable);
    assert_eq!(
        rpma_tests::unsynced_pages(&path, first, end - first),
        Some(0),
        "persist returned Durable with pages still dirty or under write-back"
    );
    let file = std::fs::read(&path).unwrap();
    assert_eq!(&file[OFFSET..OFFSET + LEN], &data[..]);
}
