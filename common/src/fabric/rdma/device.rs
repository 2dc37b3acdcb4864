//! RDMA devices: listing them, opening one (by name, or by the address a URL names, as rdma_cm
//! binds or resolves it), what it can do, and the protection domain.
//!
//! The `ibv_context` is librdmacm's own (from `rdma_get_devices`), not one opened here: the
//! rdma_cm ids that set up connections report that context as theirs, and a queue pair must
//! be made in a protection domain of the same context as its rdma_cm id. librdmacm keeps a
//! context open while any list from `rdma_get_devices` is held, so the device holds its list.
//!
//! There is one `DeviceInner` per context, however often the device is opened: the context's
//! async fd is librdmacm's and shared, and an async event must find its queue pair in the one
//! registry that has it, whichever completion queue reads it.

use std::collections::HashMap;
use std::os::raw::c_int;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::{Duration, Instant};

use rdma_sys::{ibv_context, ibv_device, ibv_pd, ibv_transport_type};

use super::caps::{query_caps, Caps};
use super::cm::{self, CmId, EventChannel};
use super::sys;
use crate::fabric::completions::Completions;
use crate::fabric::error::{DeviceEvent, Error, QpFailure, Result};
use crate::fabric::url::Url;

/// What the device's completion queues and async events reach a queue pair by: its number
/// names it in a work completion and in an event. The queue pair (`qp.rs`) implements it; the
/// device keeps the live ones in its registry, without knowing their type, so that it stays
/// below them.
pub(crate) trait QpEvents: Send + Sync {
    /// Takes a work completion a completion queue reaped, and reports it into `list`.
    fn complete(&self, wc: &rdma_sys::ibv_wc, list: &Completions);
    /// Reads the connection's rdma_cm events (non-blocking).
    fn handle_cm_events(&self);
    /// An async event moves the queue pair to Error, for `why`.
    fn to_error(&self, why: QpFailure);
    /// The device saw the queue pair's first packet before the RTU.
    fn notify_established(&self);
}

/// An RDMA device as `ibv_get_device_list` reports it, without opening it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RdmaDevice {
    /// Its name (`mlx5_0`, `rxe0`, `siw0`, ...).
    pub name: String,
    /// Its node GUID (host order).
    pub guid: u64,
    /// `InfiniBand` (also RoCE and Soft-RoCE), `iWARP`, or what else verbs says.
    pub transport: &'static str,
}

/// The machine's RDMA devices. A machine without any (no RDMA NIC, no Soft-RoCE link, no
/// kernel RDMA support: `ibv_get_device_list` then fails with ENOSYS) has an empty list.
///
/// # Errors
/// [`Error::Verbs`] when libibverbs fails otherwise (no memory).
pub fn devices() -> Result<Vec<RdmaDevice>> {
    let mut n: c_int = 0;
    // SAFETY: ibv_get_device_list writes the count and returns a NULL-terminated array owned by
    // the caller until ibv_free_device_list, which the guard below calls.
    let list = unsafe { rdma_sys::ibv_get_device_list(&mut n) };
    let Some(list) = NonNull::new(list) else {
        let e = std::io::Error::last_os_error();
        return match e.raw_os_error() {
            // No uverbs in the kernel (no /sys/class/infiniband_verbs), no device: nothing.
            Some(libc::ENOSYS | libc::ENODEV | libc::ENOENT) | None | Some(0) => Ok(Vec::new()),
            _ => Err(Error::Verbs {
                op: "ibv_get_device_list",
                source: e,
            }),
        };
    };
    struct Guard(NonNull<*mut ibv_device>);
    impl Drop for Guard {
        fn drop(&mut self) {
            // SAFETY: the array came from ibv_get_device_list and is freed once, here.
            unsafe { rdma_sys::ibv_free_device_list(self.0.as_ptr()) };
        }
    }
    let guard = Guard(list);
    let mut out = Vec::with_capacity(n.max(0) as usize);
    for i in 0..n.max(0) as usize {
        // SAFETY: the array holds `n` device pointers (then NULL), alive until it is freed.
        let dev = unsafe { *guard.0.as_ptr().add(i) };
        if dev.is_null() {
            break;
        }
        // SAFETY: `dev` is a live ibv_device of the list; its fields are plain data.
        let (name, transport, guid) = unsafe {
            (
                sys::c_chars(&(*dev).name),
                (*dev).transport_type,
                u64::from_be(rdma_sys::ibv_get_device_guid(dev)),
            )
        };
        out.push(RdmaDevice {
            name,
            guid,
            transport: transport_name(transport),
        });
    }
    Ok(out)
}

fn transport_name(t: ibv_transport_type::Type) -> &'static str {
    match t {
        ibv_transport_type::IBV_TRANSPORT_IB => "InfiniBand",
        ibv_transport_type::IBV_TRANSPORT_IWARP => "iWARP",
        ibv_transport_type::IBV_TRANSPORT_USNIC | ibv_transport_type::IBV_TRANSPORT_USNIC_UDP => {
            "usNIC"
        }
        _ => "unknown",
    }
}

/// librdmacm's list of open device contexts: while it is held, every context in it stays open.
struct CmContexts {
    list: NonNull<*mut ibv_context>,
    len: usize,
}

// SAFETY: the list is an immutable array of pointers to contexts, which libibverbs makes safe
// to use from any thread; it is freed only in Drop.
unsafe impl Send for CmContexts {}
// SAFETY: as for Send: nothing mutates the array.
unsafe impl Sync for CmContexts {}

impl CmContexts {
    /// librdmacm's contexts; [`Error::NoDevice`] if there are none.
    fn open() -> Result<CmContexts> {
        let mut n: c_int = 0;
        // SAFETY: rdma_get_devices returns a NULL-terminated array (or NULL) that the caller
        // frees with rdma_free_devices; `n` receives its length.
        let list = unsafe { rdma_sys::rdma_get_devices(&mut n) };
        match NonNull::new(list) {
            Some(list) if n > 0 => Ok(CmContexts {
                list,
                len: n as usize,
            }),
            Some(list) => {
                // SAFETY: an empty list from rdma_get_devices, freed once.
                unsafe { rdma_sys::rdma_free_devices(list.as_ptr()) };
                Err(Error::NoDevice)
            }
            // ENODEV (no device), or no rdma_cm in the kernel: there is nothing to use.
            None => Err(Error::NoDevice),
        }
    }

    fn contexts(&self) -> impl Iterator<Item = *mut ibv_context> + '_ {
        // SAFETY: the array holds `len` context pointers and is alive as long as self.
        (0..self.len).map(move |i| unsafe { *self.list.as_ptr().add(i) })
    }

    fn names(&self) -> String {
        self.contexts()
            .map(context_name)
            .collect::<Vec<_>>()
            .join(", ")
    }
}

impl Drop for CmContexts {
    fn drop(&mut self) {
        // SAFETY: the array came from rdma_get_devices and is freed once, here.
        unsafe { rdma_sys::rdma_free_devices(self.list.as_ptr()) };
    }
}

fn context_name(ctx: *mut ibv_context) -> String {
    // SAFETY: `ctx` is an open context of librdmacm's list; its device pointer and the
    // device's name are valid while it is open.
    unsafe { sys::c_chars(&(*(*ctx).device).name) }
}

/// An open RDMA device. Cheap to clone.
#[derive(Clone)]
pub(crate) struct Device {
    pub(crate) inner: Arc<DeviceInner>,
}

pub(crate) struct DeviceInner {
    ctx: NonNull<ibv_context>,
    pub(crate) name: String,
    pub(crate) caps: Caps,
    /// The live queue pairs by number: completions and async events name them so.
    qps: RwLock<HashMap<u32, Weak<dyn QpEvents>>>,
    /// The device failed or was removed (IBV_EVENT_DEVICE_FATAL, rdma_cm's DEVICE_REMOVAL, or
    /// its completion queue no longer answers): nothing made on it works again, and a device
    /// that comes back is another context ([`Device::is_lost`]).
    lost: AtomicBool,
    /// Last: keeps `ctx` open.
    _contexts: CmContexts,
}

// SAFETY: libibverbs contexts may be used from any thread; the registry is behind a lock.
unsafe impl Send for DeviceInner {}
// SAFETY: as for Send.
unsafe impl Sync for DeviceInner {}

/// The open devices, by context address.
type Shared<T> = Mutex<Vec<(usize, Weak<T>)>>;

static OPEN: Shared<DeviceInner> = Mutex::new(Vec::new());

/// The live value of `key` in `map`, or (none live) the one `make` makes, remembered.
fn shared<T>(map: &Shared<T>, key: usize, make: impl FnOnce() -> Result<Arc<T>>) -> Result<Arc<T>> {
    let mut m = map.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(live) = m
        .iter()
        .filter(|(k, _)| *k == key)
        .find_map(|(_, w)| w.upgrade())
    {
        return Ok(live);
    }
    let made = make()?;
    m.retain(|(k, w)| *k != key && w.strong_count() > 0);
    m.push((key, Arc::downgrade(&made)));
    Ok(made)
}

/// Forgets `key`'s dead entries (its value is being dropped).
fn forget<T>(map: &Shared<T>, key: usize) {
    let mut m = map.lock().unwrap_or_else(|p| p.into_inner());
    m.retain(|(k, w)| *k != key || w.strong_count() > 0);
}

impl Drop for DeviceInner {
    fn drop(&mut self) {
        // A device opened again meanwhile has a live entry, which stays.
        forget(&OPEN, self.ctx.as_ptr() as usize);
    }
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaDevice")
            .field("name", &self.inner.name)
            .field("caps", &self.inner.caps)
            .finish()
    }
}

/// How long resolving a remote address may take when a URL picks the device.
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(2);

impl Device {
    /// The device named `name`.
    pub(crate) fn by_name(name: &str) -> Result<Device> {
        let contexts = CmContexts::open()?;
        let found = contexts.contexts().find(|&c| context_name(c) == name);
        let Some(ctx) = found else {
            return Err(Error::NoSuchDevice {
                wanted: format!("named {name:?}"),
                reason: format!("the devices here are {}", contexts.names()),
            });
        };
        Device::open(contexts, ctx)
    }

    /// The device that serves `url`: the one whose address its host is (rdma_bind_addr), or
    /// the one its host is routed through (rdma_resolve_addr). A wildcard host names the only
    /// device there is.
    pub(crate) fn for_url(url: &Url) -> Result<Device> {
        let contexts = CmContexts::open()?;
        let addrs = url.socket_addrs()?;
        let mut why = Vec::new();
        for addr in &addrs {
            if addr.ip().is_unspecified() {
                let all: Vec<*mut ibv_context> = contexts.contexts().collect();
                match all[..] {
                    [only] => return Device::open(contexts, only),
                    _ => {
                        why.push(format!(
                            "{} is the wildcard and there are several devices ({}): use one \
                             device's address",
                            addr.ip(),
                            contexts.names()
                        ));
                        continue;
                    }
                }
            }
            match cm_device_of(addr) {
                Ok(verbs) => {
                    let found = contexts.contexts().find(|&c| c == verbs);
                    if let Some(ctx) = found {
                        return Device::open(contexts, ctx);
                    }
                    why.push(format!("{addr}: rdma_cm named a device not in its list"));
                }
                Err(e) => why.push(format!("{addr}: {}", crate::error_chain(&e))),
            }
        }
        Err(Error::NoSuchDevice {
            wanted: format!("for {url}"),
            reason: why.join("; "),
        })
    }

    fn open(contexts: CmContexts, ctx: *mut ibv_context) -> Result<Device> {
        let ctx = NonNull::new(ctx).ok_or(Error::NoDevice)?;
        let inner = shared(&OPEN, ctx.as_ptr() as usize, || Device::make(contexts, ctx))?;
        let dev = Device { inner };
        if dev.is_lost() {
            // librdmacm still lists the context of a device that is gone (or not back yet).
            return Err(Error::NoSuchDevice {
                wanted: dev.inner.name.clone(),
                reason: "the device failed or was removed, and is not back".into(),
            });
        }
        Ok(dev)
    }

    /// Whether the device failed or was removed: see [`DeviceInner::lost`].
    pub(crate) fn is_lost(&self) -> bool {
        self.inner.lost.load(Ordering::Acquire)
    }

    /// The device failed or was removed: marks it lost and, the first time, moves every queue
    /// pair on it to Error for `why` (their owners see a lost connection: nothing made on the
    /// device works again). Never called with a queue pair's lock held.
    pub(crate) fn lose(&self, why: QpFailure) {
        if self.inner.lost.swap(true, Ordering::AcqRel) {
            return;
        }
        log::debug!("{}: the device is lost ({why})", self.inner.name);
        let all: Vec<Arc<dyn QpEvents>> = self
            .inner
            .qps
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .filter_map(Weak::upgrade)
            .collect();
        for qp in all {
            qp.to_error(why.clone());
        }
    }

    /// Whether the device still answers a query: false when its context was disassociated
    /// (EIO: removed, or failed). A call that failed for another reason on a device that
    /// answers is that call's error, not the device's loss.
    pub(crate) fn answers(&self) -> bool {
        // SAFETY: ibv_port_attr is plain C data that ibv_query_port fills; the context is open
        // while self lives.
        let mut attr: rdma_sys::ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: as above; port 1 exists on every device (ports are numbered from 1).
        unsafe { super::ext::query_port(self.ctx(), 1, &mut attr) == 0 }
    }

    fn make(contexts: CmContexts, ctx: NonNull<ibv_context>) -> Result<Arc<DeviceInner>> {
        // SAFETY: the context is open; its device's transport type is plain data.
        let transport = unsafe { (*(*ctx.as_ptr()).device).transport_type };
        if transport != ibv_transport_type::IBV_TRANSPORT_IB {
            // The queue pair moves (RTR, RTS, rdma_establish) are InfiniBand CM's; an iWARP
            // RNIC's CM moves the queue pair itself. The tcp transport speaks iWARP.
            return Err(Error::NoSuchDevice {
                wanted: context_name(ctx.as_ptr()),
                reason: format!(
                    "an {} device: this transport drives InfiniBand-transport devices (IB, \
                     RoCE, Soft-RoCE); use tcp://, which speaks iWARP",
                    transport_name(transport)
                ),
            });
        }
        let caps = query_caps(ctx)?;
        // The async fd is read when a completion queue's wait says so: never block there.
        // SAFETY: async_fd is the context's open fd for as long as the context is open.
        let afd = unsafe { sys::borrow_fd((*ctx.as_ptr()).async_fd) };
        sys::set_nonblocking(afd, true, "fcntl(async_fd)")?;
        Ok(Arc::new(DeviceInner {
            ctx,
            name: context_name(ctx.as_ptr()),
            caps,
            qps: RwLock::new(HashMap::new()),
            lost: AtomicBool::new(false),
            _contexts: contexts,
        }))
    }

    pub(crate) fn ctx(&self) -> *mut ibv_context {
        self.inner.ctx.as_ptr()
    }

    pub(crate) fn caps(&self) -> &Caps {
        &self.inner.caps
    }

    /// The context's async event fd (non-blocking).
    pub(crate) fn async_fd(&self) -> std::os::fd::RawFd {
        // SAFETY: the context is open while self lives.
        unsafe { (*self.ctx()).async_fd }
    }

    /// Whether `ctx` is this device's context.
    pub(crate) fn same(&self, ctx: *mut ibv_context) -> bool {
        self.ctx() == ctx
    }

    /// Allocates a protection domain.
    pub(crate) fn alloc_pd(&self) -> Result<Pd> {
        // SAFETY: the context is open while self lives; the PD is deallocated in Pd's Drop,
        // which the Arc inside keeps after every object made in it.
        let pd = unsafe { rdma_sys::ibv_alloc_pd(self.ctx()) };
        let pd = NonNull::new(pd).ok_or_else(|| sys::errno("ibv_alloc_pd"))?;
        Ok(Pd {
            inner: Arc::new(PdInner {
                pd,
                _dev: self.clone(),
            }),
        })
    }

    pub(crate) fn register_qp(&self, num: u32, qp: Weak<dyn QpEvents>) {
        self.registry_mut().insert(num, qp);
    }

    pub(crate) fn unregister_qp(&self, num: u32) {
        self.registry_mut().remove(&num);
    }

    /// The live queue pair numbered `num`.
    pub(crate) fn qp(&self, num: u32) -> Option<Arc<dyn QpEvents>> {
        self.inner
            .qps
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&num)
            .and_then(Weak::upgrade)
    }

    fn registry_mut(&self) -> std::sync::RwLockWriteGuard<'_, HashMap<u32, Weak<dyn QpEvents>>> {
        self.inner.qps.write().unwrap_or_else(|p| p.into_inner())
    }

    /// Reads the device's async events (non-blocking) and acts on those about queue pairs: a
    /// fatal or access error moves that queue pair to Error, so that its requests are flushed
    /// and its owner learns why. A fatal device error moves every queue pair to Error.
    ///
    /// Each event is acknowledged before it is acted on: acting may drop the last reference
    /// to a queue pair, whose ibv_destroy_qp waits for that queue pair's events to be
    /// acknowledged.
    pub(crate) fn handle_async_events(&self) {
        for _ in 0..64 {
            // SAFETY: ibv_async_event is a plain C struct (a union of pointers and an enum
            // whose 0 is a valid value), filled by ibv_get_async_event.
            let mut e: rdma_sys::ibv_async_event = unsafe { std::mem::zeroed() };
            // SAFETY: the context is open; the fd is non-blocking, so this returns -1 at once
            // when no event is queued.
            if unsafe { rdma_sys::ibv_get_async_event(self.ctx(), &mut e) } != 0 {
                return;
            }
            let action = async_action(e.event_type);
            let num = match action {
                AsyncAction::QpError(_) | AsyncAction::Established => {
                    // SAFETY: for these event types the union holds the queue pair, valid
                    // until the event is acknowledged below.
                    Some(unsafe { (*e.element.qp).qp_num })
                }
                AsyncAction::DeviceFatal | AsyncAction::Ignore => None,
            };
            // SAFETY: `e` came from ibv_get_async_event and is acknowledged once; nothing of
            // it is used after this (the number was copied out).
            unsafe { rdma_sys::ibv_ack_async_event(&mut e) };
            match (action, num.and_then(|n| self.qp(n))) {
                (AsyncAction::QpError(event), Some(qp)) => {
                    qp.to_error(QpFailure::DeviceEvent { event })
                }
                (AsyncAction::Established, Some(qp)) => qp.notify_established(),
                (AsyncAction::DeviceFatal, _) => self.lose(QpFailure::DeviceFatal),
                _ => {}
            }
        }
    }
}

/// What an async event does.
#[derive(Debug, PartialEq, Eq)]
enum AsyncAction {
    /// Its queue pair moves to Error, for this reason.
    QpError(DeviceEvent),
    /// Its queue pair received before the RTU: rdma_cm is told (rdma_notify).
    Established,
    /// Every queue pair moves to Error.
    DeviceFatal,
    Ignore,
}

fn async_action(t: rdma_sys::ibv_event_type) -> AsyncAction {
    use rdma_sys::ibv_event_type as ev;
    match t {
        ev::IBV_EVENT_QP_FATAL => AsyncAction::QpError(DeviceEvent::QpFatal),
        ev::IBV_EVENT_QP_REQ_ERR => AsyncAction::QpError(DeviceEvent::InvalidRequest),
        ev::IBV_EVENT_QP_ACCESS_ERR => AsyncAction::QpError(DeviceEvent::AccessError),
        ev::IBV_EVENT_COMM_EST => AsyncAction::Established,
        ev::IBV_EVENT_DEVICE_FATAL => AsyncAction::DeviceFatal,
        _ => AsyncAction::Ignore,
    }
}

/// The context rdma_cm ties `addr` to: the device that has it (bind), else the one that
/// routes to it (resolve).
fn cm_device_of(addr: &std::net::SocketAddr) -> Result<*mut ibv_context> {
    let channel = EventChannel::new()?;
    let id = CmId::new(&channel)?;
    let mut local = *addr;
    local.set_port(0);
    if id.bind(&local).is_ok() && !id.verbs().is_null() {
        return Ok(id.verbs());
    }
    drop(id);
    // Bound to nothing (a remote address, or a local one no device has): resolve it.
    let id = CmId::new(&channel)?;
    id.resolve_addr(addr, RESOLVE_TIMEOUT)?;
    let deadline = Instant::now() + RESOLVE_TIMEOUT;
    let ev = cm::wait_event(&channel, deadline)?.ok_or_else(|| Error::Socket {
        op: "resolve address",
        addr: addr.to_string(),
        source: std::io::ErrorKind::TimedOut.into(),
    })?;
    ev.expect(
        rdma_sys::rdma_cm_event_type::RDMA_CM_EVENT_ADDR_RESOLVED,
        "resolve address",
        addr,
    )?;
    let verbs = id.verbs();
    if verbs.is_null() {
        return Err(Error::NoSuchDevice {
            wanted: format!("for {addr}"),
            reason: "its route leaves through no RDMA device".into(),
        });
    }
    Ok(verbs)
}

/// A protection domain (`ibv_pd`). Cheap to clone; deallocated with its last clone, which
/// every region, window and queue pair made in it holds.
#[derive(Clone)]
pub(crate) struct Pd {
    pub(crate) inner: Arc<PdInner>,
}

pub(crate) struct PdInner {
    pd: NonNull<ibv_pd>,
    /// The parent: the context stays open while the domain exists.
    _dev: Device,
}

// SAFETY: verbs objects may be used from any thread (libibverbs locks internally); the
// pointer is only deallocated in Drop.
unsafe impl Send for PdInner {}
// SAFETY: as for Send.
unsafe impl Sync for PdInner {}

impl Pd {
    pub(crate) fn raw(&self) -> *mut ibv_pd {
        self.inner.pd.as_ptr()
    }
}

impl Drop for PdInner {
    fn drop(&mut self) {
        // SAFETY: every region, window and queue pair of this domain holds a clone of the Pd,
        // so none is left when the last one goes; the PD is deallocated once, here.
        unsafe { rdma_sys::ibv_dealloc_pd(self.pd.as_ptr()) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdma_sys::ibv_event_type as ev;

    #[test]
    fn async_events_name_what_they_do() {
        for (t, event) in [
            (ev::IBV_EVENT_QP_FATAL, DeviceEvent::QpFatal),
            (ev::IBV_EVENT_QP_REQ_ERR, DeviceEvent::InvalidRequest),
            (ev::IBV_EVENT_QP_ACCESS_ERR, DeviceEvent::AccessError),
        ] {
            assert_eq!(async_action(t), AsyncAction::QpError(event), "{t:?}");
        }
        assert_eq!(
            async_action(ev::IBV_EVENT_COMM_EST),
            AsyncAction::Established
        );
        assert_eq!(
            async_action(ev::IBV_EVENT_DEVICE_FATAL),
            AsyncAction::DeviceFatal
        );
        for t in [
            ev::IBV_EVENT_PORT_ACTIVE,
            ev::IBV_EVENT_SQ_DRAINED,
            ev::IBV_EVENT_QP_LAST_WQE_REACHED,
            ev::IBV_EVENT_CQ_ERR,
        ] {
            assert_eq!(async_action(t), AsyncAction::Ignore, "{t:?}");
        }
    }

    #[test]
    fn one_value_per_key_while_it_lives() {
        let map: Shared<u32> = Mutex::new(Vec::new());
        let made = std::cell::Cell::new(0);
        let make = |v: u32| {
            let made = &made;
            move || {
                made.set(made.get() + 1);
                Ok(Arc::new(v))
            }
        };
        let a = shared(&map, 1, make(10)).unwrap();
        let b = shared(&map, 1, make(11)).unwrap();
        assert!(Arc::ptr_eq(&a, &b), "a second open shares the first");
        assert_eq!(*b, 10);
        let c = shared(&map, 2, make(20)).unwrap();
        assert_eq!(*c, 20);
        drop((a, b));
        // Gone: the next open makes a new one, and the dead entry is not kept.
        let d = shared(&map, 1, make(12)).unwrap();
        assert_eq!(*d, 12);
        assert_eq!(map.lock().unwrap().len(), 2);
        assert_eq!(made.get(), 3, "made only when none lived");
        // A failed make leaves nothing behind and keeps the others.
        let e = shared(&map, 3, || Err::<Arc<u32>, _>(Error::NoDevice));
        assert!(matches!(e, Err(Error::NoDevice)));
        assert_eq!(map.lock().unwrap().len(), 2);
    }

    #[test]
    fn forgetting_keeps_a_live_reopened_value() {
        let map: Shared<u32> = Mutex::new(Vec::new());
        let old = shared(&map, 1, || Ok(Arc::new(1))).unwrap();
        drop(old);
        // Reopened before the old value's Drop got to forget it.
        let new = shared(&map, 1, || Ok(Arc::new(2))).unwrap();
        map.lock().unwrap().push((1, Weak::new()));
        forget(&map, 1);
        let m = map.lock().unwrap();
        assert_eq!(m.len(), 1);
        assert_eq!(m[0].1.upgrade().as_deref(), Some(&2));
        drop(m);
        drop(new);
        forget(&map, 1);
        assert!(map.lock().unwrap().is_empty());
    }
}
