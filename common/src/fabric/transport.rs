//! The transport seam: what each public fabric object holds of its transport.
//!
//! The public types ([`Context`](super::Context), [`CompletionQueue`](super::CompletionQueue),
//! [`MemoryRegion`](super::MemoryRegion), [`PreparedQueuePair`](super::PreparedQueuePair),
//! [`Listener`](super::Listener), ...) own the transport-neutral part (parents kept alive,
//! argument checks, the completion list) and one of the enums below for the rest. A context's
//! [`Device`] is chosen by URL scheme ([`Context::for_url`](super::Context::for_url)); every
//! object made from it gets the same variant, so a transport's code only ever meets its own
//! objects.
//!
//! A transport slots in as a module beside `soft` (`rdma` behind its cargo feature) and one
//! variant per enum here; nothing above the fabric changes.

use std::net::SocketAddr;
use std::os::fd::BorrowedFd;
use std::sync::Arc;
use std::time::Duration;

use std::collections::VecDeque;
use std::sync::Mutex;

use super::cq::CompletionQueue;
use super::error::{Error, Result};
use super::mr::{MemoryBacking, Region, Registration};
use super::pd::ProtectionDomain;
use super::qp::{ConnInfo, ConnParams};
#[cfg(feature = "rdma")]
use super::rdma;
use super::soft::conn;
use super::soft::cq::SoftCq;
use super::soft::device::{StagEntry, StagKind, StagTable};
use super::soft::poll::Ready;
use super::soft::qp::SoftQp;
use super::types::{Access, Completion, QpCaps, QpState, RecvWr, SendWr};
use super::url::{Scheme, Url};

/// What a memory registration or a window binding grants, whatever the transport.
pub(crate) struct Grant<'a> {
    pub(crate) region: &'a Arc<Region>,
    /// The address a peer names the first byte by.
    pub(crate) base: u64,
    pub(crate) len: u64,
    /// Where `base` is in the region.
    pub(crate) offset: u64,
    pub(crate) access: Access,
    pub(crate) pd: u32,
    /// The domain's transport part (the `ibv_pd` a verbs registration is made in).
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    pub(crate) pd_engine: &'a PdEngine,
    /// For a window binding: the region's transport part.
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    pub(crate) mr_engine: Option<&'a MrEngine>,
}

impl Grant<'_> {
    fn soft(&self, kind: StagKind) -> StagEntry {
        StagEntry {
            region: Arc::clone(self.region),
            base: self.base,
            len: self.len,
            offset: self.offset,
            access: self.access,
            pd: self.pd,
            kind,
        }
    }
}

/// An open device.
pub(crate) enum Device {
    /// `tcp`: the soft device is its STag table.
    Soft(StagTable),
    /// `rdma`: a verbs device (its `ibv_context`, shared with librdmacm).
    #[cfg(feature = "rdma")]
    Rdma(rdma::Device),
}

/// A protection domain's transport part.
pub(crate) enum PdEngine {
    /// `tcp`: the STag table names the domain by its id.
    Soft,
    /// `rdma`: an `ibv_pd`.
    #[cfg(feature = "rdma")]
    Rdma(rdma::Pd),
}

/// A memory region's transport part.
pub(crate) enum MrEngine {
    /// `tcp`: its STag, both lkey and rkey.
    Soft { key: u32 },
    /// `rdma`: an `ibv_mr`, deregistered when dropped.
    #[cfg(feature = "rdma")]
    Rdma(rdma::Mr),
}

impl MrEngine {
    pub(crate) fn lkey(&self) -> u32 {
        match self {
            MrEngine::Soft { key } => *key,
            #[cfg(feature = "rdma")]
            MrEngine::Rdma(m) => m.lkey(),
        }
    }

    pub(crate) fn rkey(&self) -> u32 {
        match self {
            MrEngine::Soft { key } => *key,
            #[cfg(feature = "rdma")]
            MrEngine::Rdma(m) => m.rkey(),
        }
    }
}

/// A memory window's transport part.
pub(crate) enum MwEngine {
    /// `tcp`: the window is its STag-table entry, named by the rkey.
    Soft,
    /// `rdma`: an `ibv_mw` of type 2.
    #[cfg(feature = "rdma")]
    Rdma(rdma::Mw),
}

/// The empty STag table an rdma device answers `stags` with: only the soft engine asks, and it
/// only ever runs on objects of a soft device.
#[cfg(feature = "rdma")]
fn no_stags() -> &'static StagTable {
    static EMPTY: std::sync::OnceLock<StagTable> = std::sync::OnceLock::new();
    EMPTY.get_or_init(StagTable::new)
}

impl Device {
    /// A fresh soft device.
    pub(crate) fn soft() -> Device {
        Device::Soft(StagTable::new())
    }

    /// The transport's name, for `Debug`.
    pub(crate) fn transport(&self) -> &'static str {
        match self {
            Device::Soft(_) => "soft",
            #[cfg(feature = "rdma")]
            Device::Rdma(_) => "rdma",
        }
    }

    /// The device's name.
    pub(crate) fn name(&self) -> &str {
        match self {
            Device::Soft(_) => "soft",
            #[cfg(feature = "rdma")]
            Device::Rdma(d) => &d.inner.name,
        }
    }

    /// How memory of `backing` would be registered for `access`, or why it cannot be.
    pub(crate) fn registration(
        &self,
        backing: MemoryBacking,
        access: Access,
    ) -> std::result::Result<Registration, &'static str> {
        match self {
            Device::Soft(_) => {
                let _ = (backing, access);
                Ok(Registration::Engine)
            }
            #[cfg(feature = "rdma")]
            Device::Rdma(d) => d.registration(backing, access),
        }
    }

    /// Refuses a URL of another transport than this device's.
    pub(crate) fn check_scheme(&self, url: &Url) -> Result<()> {
        let ok = match url.scheme {
            Scheme::Tcp => matches!(self, Device::Soft(_)),
            #[cfg(feature = "rdma")]
            Scheme::Rdma => matches!(self, Device::Rdma(_)),
            #[cfg(not(feature = "rdma"))]
            Scheme::Rdma => {
                return Err(Error::TransportUnavailable {
                    scheme: "rdma".into(),
                })
            }
        };
        if ok {
            Ok(())
        } else {
            Err(Error::BadUrl {
                url: url.to_string(),
                reason: "the URL names another transport than this context's device",
            })
        }
    }

    /// The soft device's STag table: only the soft engine calls this, and it runs only on
    /// objects of a soft device.
    pub(crate) fn stags(&self) -> &StagTable {
        match self {
            Device::Soft(t) => t,
            #[cfg(feature = "rdma")]
            Device::Rdma(_) => no_stags(),
        }
    }

    /// A protection domain's transport part.
    pub(crate) fn alloc_pd(&self) -> Result<PdEngine> {
        match self {
            Device::Soft(_) => Ok(PdEngine::Soft),
            #[cfg(feature = "rdma")]
            Device::Rdma(d) => Ok(PdEngine::Rdma(d.alloc_pd()?)),
        }
    }

    /// Registers a memory region.
    pub(crate) fn register_mr(&self, g: Grant<'_>) -> Result<MrEngine> {
        match (self, g.pd_engine) {
            (Device::Soft(t), _) => Ok(MrEngine::Soft {
                key: t.insert(g.soft(StagKind::Mr))?,
            }),
            #[cfg(feature = "rdma")]
            (Device::Rdma(d), PdEngine::Rdma(pd)) => Ok(MrEngine::Rdma(d.register_mr(pd, &g)?)),
            #[cfg(feature = "rdma")]
            (Device::Rdma(_), PdEngine::Soft) => Err(Error::WrongDomain {
                what: "protection domain",
            }),
        }
    }

    /// Allocates an unbound memory window: its key and transport part.
    pub(crate) fn alloc_mw(&self, pd: &PdEngine) -> Result<(u32, MwEngine)> {
        match (self, pd) {
            (Device::Soft(t), _) => Ok((t.reserve()?, MwEngine::Soft)),
            #[cfg(feature = "rdma")]
            (Device::Rdma(d), PdEngine::Rdma(pd)) => {
                let mw = d.alloc_mw(pd)?;
                Ok((mw.rkey(), MwEngine::Rdma(mw)))
            }
            #[cfg(feature = "rdma")]
            (Device::Rdma(_), PdEngine::Soft) => Err(Error::WrongDomain {
                what: "protection domain",
            }),
        }
    }

    /// Binds window `rkey` for queue pair `qp`; returns the new rkey.
    pub(crate) fn bind_mw(
        &self,
        mw: &MwEngine,
        rkey: u32,
        qp: &QpEngine,
        g: Grant<'_>,
    ) -> Result<u32> {
        match (self, mw, qp) {
            (Device::Soft(t), _, q) => t.rebind(rkey, g.soft(StagKind::Mw { qp: q.num() })),
            #[cfg(feature = "rdma")]
            (Device::Rdma(_), MwEngine::Rdma(w), QpEngine::Rdma(q)) => w.bind(q, &g),
            #[cfg(feature = "rdma")]
            _ => Err(Error::WrongDomain {
                what: "memory window",
            }),
        }
    }

    /// Makes window `key` refuse every access from now on (a local invalidate). Returns the
    /// window's new rkey where the transport gives it one.
    pub(crate) fn invalidate(&self, mw: &MwEngine, key: u32) -> Option<u32> {
        match (self, mw) {
            (Device::Soft(t), _) => {
                t.invalidate(key);
                None
            }
            #[cfg(feature = "rdma")]
            (Device::Rdma(_), MwEngine::Rdma(w)) => Some(w.invalidate()),
            #[cfg(feature = "rdma")]
            (Device::Rdma(_), MwEngine::Soft) => None,
        }
    }

    /// Forgets a region (deregistration). On rdma the region's own drop deregisters it.
    pub(crate) fn release_mr(&self, mr: &MrEngine) {
        match (self, mr) {
            (Device::Soft(t), MrEngine::Soft { key }) => t.remove(*key),
            #[cfg(feature = "rdma")]
            _ => {}
        }
    }

    /// Forgets window `key` (its drop). On rdma the window's own drop deallocates it.
    pub(crate) fn release_mw(&self, mw: &MwEngine, key: u32) {
        match (self, mw) {
            (Device::Soft(t), MwEngine::Soft) => t.remove(key),
            #[cfg(feature = "rdma")]
            _ => {}
        }
    }

    /// A completion queue's transport part, sized for `depth` completions.
    pub(crate) fn create_cq(&self, depth: usize) -> Result<CqEngine> {
        match self {
            Device::Soft(_) => {
                let _ = depth; // the soft queue grows as needed
                Ok(CqEngine::Soft(SoftCq::new()?))
            }
            #[cfg(feature = "rdma")]
            Device::Rdma(d) => Ok(CqEngine::Rdma(d.create_cq(depth)?)),
        }
    }

    /// A queue pair's transport part, in Init.
    pub(crate) fn create_qp(
        &self,
        num: u32,
        pd: ProtectionDomain,
        send_cq: CompletionQueue,
        recv_cq: CompletionQueue,
        caps: QpCaps,
    ) -> Result<QpEngine> {
        match self {
            Device::Soft(_) => Ok(QpEngine::Soft(SoftQp::new(num, pd, send_cq, recv_cq, caps))),
            #[cfg(feature = "rdma")]
            Device::Rdma(d) => Ok(QpEngine::Rdma(d.create_qp(pd, send_cq, recv_cq, caps)?)),
        }
    }

    /// A passive endpoint on `url`.
    pub(crate) fn listen(&self, url: &Url) -> Result<ListenEngine> {
        match self {
            Device::Soft(_) => Ok(ListenEngine::Soft(conn::TcpListen::bind(url)?)),
            #[cfg(feature = "rdma")]
            Device::Rdma(d) => Ok(ListenEngine::Rdma(d.listen(url)?)),
        }
    }
}

/// The completions a completion queue holds for its users (the soft engine pushes into it
/// through its queue pairs; the rdma engine translates what it polls into it).
pub(crate) type Entries = Mutex<VecDeque<Completion>>;

/// A completion queue's transport part: what drives progress and the idle wait.
pub(crate) enum CqEngine {
    Soft(SoftCq),
    #[cfg(feature = "rdma")]
    Rdma(rdma::Cq),
}

impl CqEngine {
    /// Makes a soft queue pair's progress part of this queue's polling.
    pub(crate) fn attach_soft(&self, qp: &Arc<SoftQp>) {
        match self {
            CqEngine::Soft(c) => c.attach(qp),
            // A soft queue pair is only ever made on a soft device's queues.
            #[cfg(feature = "rdma")]
            CqEngine::Rdma(_) => {}
        }
    }

    /// Drives the bound queue pairs once (soft), or polls the device's queue into `entries`
    /// (rdma).
    pub(crate) fn progress(&self, entries: &Entries) -> Result<()> {
        match self {
            CqEngine::Soft(c) => {
                let _ = entries; // the soft queue pairs push into it themselves
                c.progress();
                Ok(())
            }
            #[cfg(feature = "rdma")]
            CqEngine::Rdma(c) => c.progress(entries),
        }
    }

    /// Prepares the idle wait (arms what must wake it).
    pub(crate) fn arm(&self, entries: &Entries) -> Result<()> {
        match self {
            CqEngine::Soft(c) => {
                let _ = entries;
                c.arm()
            }
            #[cfg(feature = "rdma")]
            CqEngine::Rdma(c) => c.arm(entries),
        }
    }

    /// Blocks until something may have happened, or `timeout`.
    pub(crate) fn block(&self, timeout: Option<Duration>) -> Result<Ready> {
        match self {
            CqEngine::Soft(c) => c.poller().wait(timeout),
            #[cfg(feature = "rdma")]
            CqEngine::Rdma(c) => c.block(timeout),
        }
    }

    pub(crate) fn watch(&self, fd: BorrowedFd<'_>, token: u64) -> Result<()> {
        match self {
            CqEngine::Soft(c) => c.poller().watch(fd, token),
            #[cfg(feature = "rdma")]
            CqEngine::Rdma(c) => c.poller().watch(fd, token),
        }
    }

    pub(crate) fn unwatch(&self, fd: BorrowedFd<'_>) -> Result<()> {
        match self {
            CqEngine::Soft(c) => c.poller().unwatch(fd),
            #[cfg(feature = "rdma")]
            CqEngine::Rdma(c) => c.poller().unwatch(fd),
        }
    }
}

/// A queue pair's transport part.
pub(crate) enum QpEngine {
    Soft(Arc<SoftQp>),
    #[cfg(feature = "rdma")]
    Rdma(Arc<rdma::Qp>),
}

/// `$e` for whichever transport the queue pair is: both engines have the same method names.
macro_rules! each_qp {
    ($self:expr, $q:ident => $e:expr) => {
        match $self {
            QpEngine::Soft($q) => $e,
            #[cfg(feature = "rdma")]
            QpEngine::Rdma($q) => $e,
        }
    };
}

impl QpEngine {
    pub(crate) fn num(&self) -> u32 {
        each_qp!(self, q => q.num)
    }
    pub(crate) fn pd(&self) -> &ProtectionDomain {
        each_qp!(self, q => &q.pd)
    }
    pub(crate) fn state(&self) -> QpState {
        each_qp!(self, q => q.state())
    }
    pub(crate) fn info(&self) -> ConnInfo {
        each_qp!(self, q => q.info())
    }
    pub(crate) fn error(&self) -> Option<String> {
        each_qp!(self, q => q.error())
    }
    pub(crate) fn check_rts(&self, op: &'static str) -> Result<()> {
        each_qp!(self, q => q.check_rts(op))
    }
    pub(crate) fn post_recv(&self, wr: RecvWr) -> Result<()> {
        each_qp!(self, q => q.post_recv(wr))
    }
    pub(crate) fn post_send(&self, wr: SendWr) -> Result<()> {
        each_qp!(self, q => q.post_send(wr))
    }
    pub(crate) fn post_sends(&self, wrs: &mut [Option<SendWr>]) -> Result<()> {
        each_qp!(self, q => q.post_sends(wrs))
    }
    pub(crate) fn to_error(&self, why: &str) {
        each_qp!(self, q => q.to_error(why))
    }
    pub(crate) fn close(&self) {
        each_qp!(self, q => q.close())
    }
    /// What the queue pair served as the responder, where software serves it (the soft
    /// placement engine); an RNIC places without software, so `rdma` has none.
    pub(crate) fn responder_counters(&self) -> Option<super::counters::ResponderCounters> {
        match self {
            QpEngine::Soft(q) => Some(q.counters.clone()),
            #[cfg(feature = "rdma")]
            QpEngine::Rdma(_) => None,
        }
    }

    /// Connects actively (Init to RTS).
    pub(crate) fn connect(
        &self,
        url: &Url,
        params: &ConnParams,
        private_data: &[u8],
    ) -> Result<()> {
        match self {
            QpEngine::Soft(q) => {
                let (stream, neg) = conn::connect(url, params, private_data)?;
                q.start(stream, neg, params)
            }
            #[cfg(feature = "rdma")]
            QpEngine::Rdma(q) => q.connect(url, params, private_data),
        }
    }

    /// Accepts `pending` into this queue pair (Init to RTS).
    pub(crate) fn accept(
        &self,
        pending: PendingEngine,
        params: &ConnParams,
        private_data: &[u8],
    ) -> Result<()> {
        match (self, pending) {
            (QpEngine::Soft(q), PendingEngine::Soft(p)) => {
                let (stream, neg) = p.accept(params, private_data)?;
                q.start(stream, neg, params)
            }
            #[cfg(feature = "rdma")]
            (QpEngine::Rdma(q), PendingEngine::Rdma(p)) => q.accept(*p, params, private_data),
            #[cfg(feature = "rdma")]
            (_, p) => {
                p.reject(&[]);
                Err(Error::WrongDomain {
                    what: "queue pair of another transport",
                })
            }
        }
    }
}

/// A listener's transport part.
pub(crate) enum ListenEngine {
    Soft(conn::TcpListen),
    #[cfg(feature = "rdma")]
    Rdma(rdma::Listen),
}

impl ListenEngine {
    pub(crate) fn url(&self) -> Result<Url> {
        match self {
            ListenEngine::Soft(l) => l.url(),
            #[cfg(feature = "rdma")]
            ListenEngine::Rdma(l) => Ok(l.url()),
        }
    }
    pub(crate) fn accept(&self, params: &ConnParams) -> Result<PendingEngine> {
        match self {
            ListenEngine::Soft(l) => l.accept(params).map(PendingEngine::Soft),
            #[cfg(feature = "rdma")]
            ListenEngine::Rdma(l) => l
                .accept(params.timeout)
                .map(|p| PendingEngine::Rdma(Box::new(p))),
        }
    }
    pub(crate) fn accept_incoming(&self) -> Result<Option<IncomingEngine>> {
        match self {
            ListenEngine::Soft(l) => Ok(l.accept_incoming()?.map(IncomingEngine::Soft)),
            #[cfg(feature = "rdma")]
            ListenEngine::Rdma(l) => Ok(l
                .accept_incoming()?
                .map(|p| IncomingEngine::Rdma(Box::new(p)))),
        }
    }
    pub(crate) fn set_nonblocking(&self, on: bool) -> Result<()> {
        match self {
            ListenEngine::Soft(l) => l.set_nonblocking(on),
            #[cfg(feature = "rdma")]
            ListenEngine::Rdma(l) => l.set_nonblocking(on),
        }
    }
    pub(crate) fn as_fd(&self) -> BorrowedFd<'_> {
        match self {
            ListenEngine::Soft(l) => l.as_fd(),
            #[cfg(feature = "rdma")]
            ListenEngine::Rdma(l) => l.as_fd(),
        }
    }
}

/// An accepted connection whose request is still being read. (On rdma the CM delivers a
/// request whole: it is complete from the start.)
pub(crate) enum IncomingEngine {
    Soft(conn::Incoming),
    #[cfg(feature = "rdma")]
    Rdma(Box<rdma::Pending>),
}

/// Where reading an incoming request stands.
pub(crate) enum IncomingProgress {
    Complete(PendingEngine),
    Incomplete(IncomingEngine),
}

impl IncomingEngine {
    pub(crate) fn peer_addr(&self) -> SocketAddr {
        match self {
            IncomingEngine::Soft(i) => i.peer_addr(),
            #[cfg(feature = "rdma")]
            IncomingEngine::Rdma(p) => p.peer_addr(),
        }
    }
    pub(crate) fn as_fd(&self) -> BorrowedFd<'_> {
        match self {
            IncomingEngine::Soft(i) => i.as_fd(),
            #[cfg(feature = "rdma")]
            IncomingEngine::Rdma(p) => p.as_fd(),
        }
    }
    pub(crate) fn poll_request(self) -> Result<IncomingProgress> {
        match self {
            IncomingEngine::Soft(i) => Ok(match i.poll_request()? {
                conn::Progress::Complete(p) => IncomingProgress::Complete(PendingEngine::Soft(p)),
                conn::Progress::Incomplete(i) => {
                    IncomingProgress::Incomplete(IncomingEngine::Soft(i))
                }
            }),
            #[cfg(feature = "rdma")]
            IncomingEngine::Rdma(p) => Ok(IncomingProgress::Complete(PendingEngine::Rdma(
                Box::new(p.check()?),
            ))),
        }
    }
}

/// A connection request waiting for an answer.
pub(crate) enum PendingEngine {
    Soft(conn::Pending),
    /// Boxed: a request carries its rdma_cm id, channel and addresses, and the soft variant
    /// is small; every ConnRequest handed to a poll loop would otherwise be as big.
    #[cfg(feature = "rdma")]
    Rdma(Box<rdma::Pending>),
}

impl PendingEngine {
    pub(crate) fn private_data(&self) -> &[u8] {
        match self {
            PendingEngine::Soft(p) => p.private_data(),
            #[cfg(feature = "rdma")]
            PendingEngine::Rdma(p) => p.private_data(),
        }
    }
    pub(crate) fn peer_addr(&self) -> SocketAddr {
        match self {
            PendingEngine::Soft(p) => p.peer_addr(),
            #[cfg(feature = "rdma")]
            PendingEngine::Rdma(p) => p.peer_addr(),
        }
    }
    pub(crate) fn reject(self, private_data: &[u8]) {
        match self {
            PendingEngine::Soft(p) => p.reject(private_data),
            #[cfg(feature = "rdma")]
            PendingEngine::Rdma(p) => p.reject(private_data),
        }
    }
}
