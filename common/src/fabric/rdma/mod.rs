//! `rdma`: the fabric on libibverbs and librdmacm (cargo feature `rdma`, crate rdma-sys), for
//! RoCEv2 and InfiniBand NICs and Soft-RoCE (rxe). docs/rdma.md has the set-up and the design.
//!
//! Each fabric object holds its verbs twin through the seam (`transport.rs`):
//!
//! | fabric | here | verbs |
//! |---|---|---|
//! | `Context` | [`Device`] (`device.rs`) | librdmacm's `ibv_context` of the device |
//! | `ProtectionDomain` | `Pd` | `ibv_pd` |
//! | `MemoryRegion` / `MemoryWindow` | `Mr` / `Mw` (`mr.rs`) | `ibv_mr` (pinned, or ODP) / `ibv_mw` type 2 |
//! | `CompletionQueue` | `Cq` (`cq.rs`) | `ibv_cq` + `ibv_comp_channel` |
//! | queue pairs | `Qp` (`qp.rs`; set-up `link.rs`, posting `submit.rs` on `post.rs`, completions `wc.rs`) | RC `ibv_qp` (extended with Atomic Write) |
//! | `Listener`, `ConnRequest` | `Listen`, `Pending` (`listen.rs`, on `cm.rs`) | `rdma_cm_id` + `rdma_event_channel` |
//!
//! `translate.rs` holds the tables between the fabric's plain data and verbs' (access
//! flags, opcodes, every completion status, work request fields, the private data block).
//! Every object is RAII and holds an `Arc` of its parent: a region its protection domain, a
//! domain its device, the device librdmacm's context list.
//!
//! What this transport does not do: RDMA Flush (rdma-core 44 has no flush verb; the target
//! then offers APM only under its operator's `direct_write_to_pmem` declaration, and GPSPM
//! always), solicited-event flags on receive completions (`ibv_wc` has none), more than one
//! scatter entry per request (as on `tcp`).

mod caps;
mod cm;
mod cq;
mod device;
mod ext;
mod link;
mod listen;
mod mr;
mod post;
mod qp;
mod submit;
mod sys;
mod translate;
mod wc;

pub(crate) use cq::Cq;
pub use device::{devices, RdmaDevice};
pub(crate) use device::{Device, Pd};
pub(crate) use listen::{Listen, Pending};
pub(crate) use mr::{Mr, Mw};
pub(crate) use qp::Qp;

use std::sync::Arc;

use crate::fabric::completions::Completions;
use crate::fabric::error::Result;
use crate::fabric::url::Url;

/// The most application private data an rdma_cm connect request carries (IB CM's 56 bytes
/// less this transport's 4-byte capability block).
pub const RDMA_MAX_CONNECT_PRIVATE_DATA: usize = translate::caps::REQ_ROOM - translate::caps::LEN;
/// The most application private data an rdma_cm accept carries.
pub const RDMA_MAX_ACCEPT_PRIVATE_DATA: usize = translate::caps::REP_ROOM - translate::caps::LEN;
/// The most application private data an rdma_cm reject carries (longer is cut).
pub const RDMA_MAX_REJECT_PRIVATE_DATA: usize = translate::caps::REJ_ROOM - translate::caps::LEN;

impl Device {
    /// A completion queue sized for `depth` completions (it grows as queue pairs are bound),
    /// reaping into `list`.
    pub(crate) fn create_cq(&self, depth: usize, list: Arc<Completions>) -> Result<Cq> {
        Cq::new(self, depth, list)
    }

    /// A listener on `url`.
    pub(crate) fn listen(&self, url: &Url) -> Result<Listen> {
        Listen::bind(self, url)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn private_data_limits() {
        assert_eq!(RDMA_MAX_CONNECT_PRIVATE_DATA, 52);
        assert_eq!(RDMA_MAX_ACCEPT_PRIVATE_DATA, 192);
        assert_eq!(RDMA_MAX_REJECT_PRIVATE_DATA, 144);
    }

    /// Listing needs no device: on a machine without one (no /sys/class/infiniband, where
    /// `ibv_get_device_list` fails with ENOSYS) the list is empty and no error.
    #[test]
    fn listing_devices_never_fails_for_want_of_one() {
        let list = devices().expect("listing RDMA devices");
        if std::path::Path::new("/sys/class/infiniband").exists() {
            for d in &list {
                assert!(!d.name.is_empty());
            }
        } else {
            assert!(list.is_empty(), "{list:?}");
        }
    }
}
