//! [`Context`]: an open device, the root of every other fabric object.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use super::cq::CompletionQueue;
use super::error::{Error, Result};
use super::pd::ProtectionDomain;
use super::transport::Device;
use super::url::{Scheme, Url};

static NEXT_CONTEXT_ID: AtomicU32 = AtomicU32::new(1);

/// An open device (`ibv_context`). Cheap to clone: every clone is the same device.
///
/// [`Context::for_url`] opens the device that serves a URL's transport: `tcp://` the userspace
/// iWARP engine ([`Context::soft`]); `rdma://` is refused until that transport is built and
/// implemented. Everything made from a context keeps it alive.
#[derive(Clone)]
pub struct Context {
    pub(crate) inner: Arc<ContextInner>,
}

pub(crate) struct ContextInner {
    pub(crate) id: u32,
    pub(crate) device: Device,
    next_pd: AtomicU32,
    next_qp: AtomicU32,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("id", &self.inner.id)
            .field(
                "transport",
                &match self.inner.device {
                    Device::Soft(_) => "soft",
                    #[cfg(feature = "rdma")]
                    Device::Rdma(ref d) => match *d {},
                },
            )
            .finish()
    }
}

impl Context {
    /// The device that serves `url`'s transport: for `tcp://`, a soft device
    /// ([`Context::soft`]). Code that takes its URLs from users opens its context here, so that
    /// a new transport needs no change to it.
    ///
    /// # Errors
    /// [`Error::TransportUnavailable`] for `rdma://`: that transport is not built in this
    /// binary or not implemented yet.
    pub fn for_url(url: &Url) -> Result<Context> {
        match url.scheme {
            Scheme::Tcp => Ok(Context::soft()),
            Scheme::Rdma => Err(Error::TransportUnavailable {
                scheme: "rdma".into(),
            }),
        }
    }

    /// The software device: RDMA over TCP, speaking iWARP. Always available.
    pub fn soft() -> Context {
        Context {
            inner: Arc::new(ContextInner {
                id: NEXT_CONTEXT_ID.fetch_add(1, Ordering::Relaxed),
                device: Device::soft(),
                next_pd: AtomicU32::new(1),
                next_qp: AtomicU32::new(1),
            }),
        }
    }

    /// Allocates a protection domain (`ibv_alloc_pd`).
    pub fn alloc_pd(&self) -> Result<ProtectionDomain> {
        let id = self.inner.next_pd.fetch_add(1, Ordering::Relaxed);
        Ok(ProtectionDomain::new(self.clone(), id))
    }

    /// Creates a completion queue (`ibv_create_cq`). `depth` is the number of completions it is
    /// sized for; see [`CompletionQueue`].
    pub fn create_cq(&self, depth: usize) -> Result<CompletionQueue> {
        CompletionQueue::new(self.clone(), depth)
    }

    pub(crate) fn device(&self) -> &Device {
        &self.inner.device
    }

    pub(crate) fn next_qp_num(&self) -> u32 {
        self.inner.next_qp.fetch_add(1, Ordering::Relaxed)
    }

    pub(crate) fn same(&self, other: &Context) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_url_picks_the_transport() {
        let tcp = Context::for_url(&Url::parse("tcp://127.0.0.1:0").unwrap()).unwrap();
        assert!(tcp.alloc_pd().is_ok());
        let rdma = Context::for_url(&Url::parse("rdma://127.0.0.1:4420").unwrap());
        assert!(
            matches!(rdma, Err(Error::TransportUnavailable { ref scheme }) if scheme == "rdma"),
            "{rdma:?}"
        );
    }
}
