//! rpma-common: the layers that the target and the initiator share.
//!
//! - [`pmem`]: maps a namespace's backing store and makes ranges of it durable, reporting honestly
//!   which persistence domain the storage is in.
//! - [`fabric`]: the verbs-shaped API and its transports: `tcp` (userspace iWARP) and, with the
//!   `rdma` feature, `rdma` (libibverbs and librdmacm).
//! - [`proto`]: the control-plane wire format spoken over the fabric's Send/Recv.
//! - [`stats`]: counters and latency histograms with one writer each (the data path's
//!   counting), read by anyone.
//! - [`volatile`]: views of memory that peers, other threads or processes write concurrently
//!   (registered memory, shared mappings), reached only through copies and iovecs.
//! - [`sync`]: locking that ThreadSanitizer can follow (`make tsan`).
//! - [`steps`]: step timing of a round trip, for measurements (feature `step-timing`).
//! - [`logline`]: log lines a peer can cause: its strings escaped, and the tally of lines a
//!   rate limit held back (the target's and the NBD export's).
//!
//! Features: `rdma` pulls in rdma-sys (libibverbs/librdmacm) and builds the `rdma` transport on
//! it (docs/rdma.md). `step-timing` (measurements only) times the steps of each round trip
//! ([`steps`]). `wire-testing` (tests only) makes the soft transport's wire formats public
//! and adds `fuzz`, the fuzz targets' entry points.

#![warn(missing_docs)]

pub mod fabric;
// Test-only: the fuzz targets' entry points and seeds (fuzz/, tests/tests/fuzz_corpus.rs).
#[cfg(feature = "wire-testing")]
pub mod fuzz;
pub mod logline;
pub mod mountinfo;
pub mod notify;
pub mod pmem;
pub mod proto;
mod sigbus;
pub mod stats;
pub mod steps;
pub mod sync;
pub mod units;
pub mod volatile;

/// An error and its sources on one line, "outer: inner: innermost", for logs and for error
/// texts that must keep the errno that a wrapper's own message does not repeat.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}
