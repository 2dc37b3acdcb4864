//! [`ProtectionDomain`]: groups memory regions, windows and queue pairs that may use each other.

use std::sync::Arc;

use super::context::Context;
use super::cq::CompletionQueue;
use super::error::{Error, Result};
use super::mr::{self, MemoryRegion, MemoryWindow, RegisteredMemory};
use super::qp::PreparedQueuePair;
use super::transport::PdEngine;
use super::types::{Access, QpCaps};

/// A protection domain (`ibv_pd`). Cheap to clone; its objects keep it (and its context) alive.
///
/// A queue pair reaches only memory registered in its own domain: an rkey of another domain is
/// answered like a bad rkey.
#[derive(Clone)]
pub struct ProtectionDomain {
    pub(crate) inner: Arc<PdInner>,
}

pub(crate) struct PdInner {
    pub(crate) ctx: Context,
    pub(crate) id: u32,
    /// The transport's part (`ibv_pd` on rdma; nothing on the soft transport, whose STag
    /// table names the domain by `id`).
    pub(crate) engine: PdEngine,
}

impl std::fmt::Debug for ProtectionDomain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProtectionDomain")
            .field("id", &self.inner.id)
            .finish()
    }
}

impl ProtectionDomain {
    pub(crate) fn new(ctx: Context, id: u32, engine: PdEngine) -> ProtectionDomain {
        ProtectionDomain {
            inner: Arc::new(PdInner { ctx, id, engine }),
        }
    }

    /// The device it belongs to.
    pub fn context(&self) -> &Context {
        &self.inner.ctx
    }

    /// Registers `mem` (`ibv_reg_mr`): the region keeps `mem` alive, and remembers its
    /// [`Persist`](crate::pmem::Persist) so that the responder can make remote writes durable.
    ///
    /// # Errors
    /// [`Error::InvalidAccess`] for flags that need [`Access::LOCAL_WRITE`] without it,
    /// [`Error::Register`] for empty memory (and on `rdma` for memory the device cannot
    /// register: fsdax or page-cache files without on-demand paging), [`Error::Exhausted`] when
    /// no STag is left, [`Error::Verbs`] when the device refuses the registration.
    pub fn register<M: RegisteredMemory>(
        &self,
        mem: Arc<M>,
        access: Access,
    ) -> Result<Arc<MemoryRegion>> {
        mr::register(self, mr::Backing::Owned(mem), access)
    }

    /// Registers raw memory (`ibv_reg_mr` on a pointer).
    ///
    /// # Safety
    /// `addr` must be valid for reads and writes of `len` bytes, and stay so — not freed, not
    /// unmapped, not moved — until the returned region and every work request that uses it are
    /// gone (the fabric keeps an `Arc` of the region per outstanding request). Dropping the
    /// region's last `Arc` revokes its rkey and the rkeys of every memory window bound to it
    /// (they are refused with a remote access error from then on); a peer's Write FPDU already
    /// being placed when it is dropped holds the region until that FPDU is in, so the memory
    /// must also stay valid until the queue pairs that could be placing into it have made
    /// progress past that FPDU (or are gone). Peers with the rkey write into it at any time
    /// from the thread that drives progress: no Rust reference that assumes exclusive or
    /// unchanging access may exist to it meanwhile.
    ///
    /// # Errors
    /// As [`ProtectionDomain::register`].
    pub unsafe fn register_raw(
        &self,
        addr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<Arc<MemoryRegion>> {
        mr::register(self, mr::Backing::Raw { addr, len }, access)
    }

    /// Allocates a memory window (type 2: bound to one queue pair by
    /// [`QueuePair::bind_mw`](super::QueuePair::bind_mw)).
    ///
    /// # Errors
    /// [`Error::Exhausted`] when no STag is left; on `rdma`, [`Error::MemoryWindow`] when the
    /// device has no type-2 windows, [`Error::Verbs`] when it refuses one.
    pub fn alloc_mw(&self) -> Result<MemoryWindow> {
        MemoryWindow::new(self)
    }

    /// Creates a reliable-connected queue pair in state Init (`ibv_create_qp`): receives may be
    /// posted; [`PreparedQueuePair::connect`] or
    /// [`ConnRequest::accept`](super::ConnRequest::accept) bring it to RTS.
    ///
    /// # Errors
    /// [`Error::WrongDomain`] if a completion queue belongs to another context,
    /// [`Error::InvalidWorkRequest`] for zero queue sizes; on `rdma`, [`Error::Exhausted`] when
    /// the device's queue or completion queue limits are passed, [`Error::Verbs`].
    pub fn create_qp(
        &self,
        send_cq: &CompletionQueue,
        recv_cq: &CompletionQueue,
        caps: QpCaps,
    ) -> Result<PreparedQueuePair> {
        if !send_cq.context().same(&self.inner.ctx) || !recv_cq.context().same(&self.inner.ctx) {
            return Err(Error::WrongDomain {
                what: "completion queue",
            });
        }
        if caps.max_send_wr == 0 || caps.max_recv_wr == 0 {
            return Err(Error::InvalidWorkRequest {
                reason: "queue sizes must be at least 1",
            });
        }
        PreparedQueuePair::new(self.clone(), send_cq.clone(), recv_cq.clone(), caps)
    }

    pub(crate) fn same(&self, other: &ProtectionDomain) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}
