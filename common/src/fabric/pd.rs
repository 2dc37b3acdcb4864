//! [`ProtectionDomain`]: groups memory regions, windows and queue pairs that may use each other.

use std::sync::Arc;

use super::context::Context;
use super::error::Result;
use super::transport::PdEngine;
use super::types::DomainId;

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

// Made by its device (`ibv_alloc_pd`); the verbs that make objects in a domain are in those
// objects' files (`register`, `alloc_mw`: mr.rs; `create_qp`: qp.rs), so that the domain,
// like every parent, never names its children.
impl Context {
    /// Allocates a protection domain (`ibv_alloc_pd`).
    ///
    /// # Errors
    /// None on the soft transport; [`Error::Verbs`] when an RDMA device refuses.
    ///
    /// [`Error::Verbs`]: super::Error::Verbs
    pub fn alloc_pd(&self) -> Result<ProtectionDomain> {
        let id = self.next_pd_num();
        let engine = self.device().alloc_pd()?;
        Ok(ProtectionDomain::new(self.clone(), id, engine))
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

    pub(crate) fn same(&self, other: &ProtectionDomain) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// Its identity, for the transports' checks that a region belongs to a queue pair's domain.
    pub(crate) fn domain(&self) -> DomainId {
        DomainId {
            ctx: self.inner.ctx.inner.id,
            pd: self.inner.id,
        }
    }
}
