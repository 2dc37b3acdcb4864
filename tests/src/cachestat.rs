//! What the page cache holds unsynced: cachestat(2) ([`rpma_common::pmem::unsynced_pages`]).

pub use rpma_common::pmem::unsynced_pages;
