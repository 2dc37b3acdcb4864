//! [`Context`]: an open device, the root of every other fabric object.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use super::error::Result;
use super::memory::{MemoryBacking, Registration};
use super::transport::Device;
use super::types::Access;
use super::url::Url;

static NEXT_CONTEXT_ID: AtomicU32 = AtomicU32::new(1);

/// An open device (`ibv_context`). Cheap to clone: every clone is the same device.
///
/// [`Context::for_url`] opens the device that serves a URL's transport: `tcp://` the userspace
/// iWARP engine ([`Context::soft`]); `rdma://` (feature `rdma`) the RDMA device that owns the
/// URL's address, or that routes to it ([`Context::rdma_device`] opens one by name). Everything
/// made from a context keeps it alive.
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
            .field("transport", &self.inner.device.transport())
            .finish()
    }
}

impl Context {
    /// The device that serves `url`'s transport: for `tcp://`, a soft device
    /// ([`Context::soft`]); for `rdma://`, the RDMA device whose address the URL's host is
    /// (a listener's URL), else the one the host is routed through (a target's URL), as
    /// rdma_cm resolves it. Code that takes its URLs from users opens its context here, so
    /// that a new transport needs no change to it.
    ///
    /// # Errors
    /// [`Error::TransportUnavailable`] for `rdma://` in a build without the `rdma` feature;
    /// with it, [`Error::NoDevice`] ("no RDMA device found; use tcp://") where the machine has
    /// none, [`Error::NoSuchDevice`] when no device serves the address, [`Error::Socket`] when
    /// the host does not resolve.
    ///
    /// [`Error::TransportUnavailable`]: super::Error::TransportUnavailable
    /// [`Error::NoDevice`]: super::Error::NoDevice
    /// [`Error::NoSuchDevice`]: super::Error::NoSuchDevice
    /// [`Error::Socket`]: super::Error::Socket
    pub fn for_url(url: &Url) -> Result<Context> {
        Ok(Context::with_device(Device::for_url(url)?))
    }

    /// The RDMA device named `name` (as `ibv_devices` lists it: `mlx5_0`, `rxe0`, ...).
    ///
    /// # Errors
    /// [`Error::NoDevice`] where the machine has no RDMA device, [`Error::NoSuchDevice`] when
    /// none has that name, [`Error::Verbs`] when it cannot be opened.
    ///
    /// [`Error::NoDevice`]: super::Error::NoDevice
    /// [`Error::NoSuchDevice`]: super::Error::NoSuchDevice
    /// [`Error::Verbs`]: super::Error::Verbs
    #[cfg(feature = "rdma")]
    pub fn rdma_device(name: &str) -> Result<Context> {
        Ok(Context::with_device(Device::rdma_by_name(name)?))
    }

    fn with_device(device: Device) -> Context {
        Context {
            inner: Arc::new(ContextInner {
                id: NEXT_CONTEXT_ID.fetch_add(1, Ordering::Relaxed),
                device,
                next_pd: AtomicU32::new(1),
                next_qp: AtomicU32::new(1),
            }),
        }
    }

    /// The software device: RDMA over TCP, speaking iWARP. Always available.
    pub fn soft() -> Context {
        Context::with_device(Device::soft())
    }

    /// The device's name: `soft` for the `tcp` transport's, the RDMA device's own
    /// (`mlx5_0`, `rxe0`) for `rdma`.
    pub fn device_name(&self) -> &str {
        self.inner.device.name()
    }

    /// How this device registers memory of `backing` for `access` (what a namespace of that
    /// kind costs: pinned, on-demand paging, or nothing on `tcp`), without registering
    /// anything. `check-config` asks this for every namespace behind an `rdma://` listener.
    ///
    /// # Errors
    /// Why the device cannot register such memory at all (fsdax or page-cache pages on a
    /// device without on-demand paging for those rights): the same reason a registration
    /// would fail with.
    pub fn registration(
        &self,
        backing: MemoryBacking,
        access: Access,
    ) -> std::result::Result<Registration, String> {
        self.inner
            .device
            .registration(backing, access)
            .map_err(str::to_owned)
    }

    /// Whether the device failed or was removed (`rdma`: IBV_EVENT_DEVICE_FATAL, rdma_cm's
    /// device removal, or a completion queue that no longer answers; never on `tcp`). Nothing
    /// made on a lost device works again: a device that comes back is opened anew with
    /// [`Context::for_url`], which refuses one that is still lost.
    pub fn is_lost(&self) -> bool {
        self.inner.device.is_lost()
    }

    pub(crate) fn device(&self) -> &Device {
        &self.inner.device
    }

    pub(crate) fn next_pd_num(&self) -> u32 {
        self.inner.next_pd.fetch_add(1, Ordering::Relaxed)
    }

    pub(crate) fn next_qp_num(&self) -> u32 {
        self.inner.next_qp.fetch_add(1, Ordering::Relaxed)
    }

    /// Whether `other` is this context (a clone of it), not merely one of the same device.
    pub fn same(&self, other: &Context) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fabric::Error;

    #[test]
    fn the_url_picks_the_transport() {
        let tcp = Context::for_url(&Url::parse("tcp://127.0.0.1:0").unwrap()).unwrap();
        assert!(tcp.alloc_pd().is_ok());
        assert!(format!("{tcp:?}").contains("soft"));
    }

    #[cfg(not(feature = "rdma"))]
    #[test]
    fn rdma_is_unavailable_without_the_feature() {
        let rdma = Context::for_url(&Url::parse("rdma://127.0.0.1:4420").unwrap());
        assert!(
            matches!(rdma, Err(Error::TransportUnavailable { ref scheme }) if scheme == "rdma"),
            "{rdma:?}"
        );
    }

    /// On a machine without RDMA devices (CI), `rdma://` says so and how to go on; with a
    /// device, a loopback URL is not served by one (no RDMA device owns 127.0.0.1 unless rxe
    /// is bound to `lo`), or it is: either way the answer is a clear one.
    #[cfg(feature = "rdma")]
    #[test]
    fn rdma_without_a_device_says_use_tcp() {
        let rdma = Context::for_url(&Url::parse("rdma://127.0.0.1:4420").unwrap());
        match super::super::rdma::devices() {
            Ok(list) if list.is_empty() => {
                let e = rdma.expect_err("no device, no context");
                assert!(matches!(e, Error::NoDevice), "{e:?}");
                assert_eq!(e.to_string(), "no RDMA device found; use tcp://");
                let named = Context::rdma_device("mlx5_0").expect_err("no device");
                assert!(matches!(named, Error::NoDevice), "{named:?}");
            }
            Ok(_) => match rdma {
                Ok(ctx) => assert!(format!("{ctx:?}").contains("rdma")),
                Err(e) => assert!(matches!(e, Error::NoSuchDevice { .. }), "{e:?}"),
            },
            Err(e) => panic!("listing devices failed: {e}"),
        }
    }
}
