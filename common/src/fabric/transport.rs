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

use super::cq::CompletionQueue;
use super::error::Result;
use super::mr::Region;
use super::pd::ProtectionDomain;
use super::qp::{ConnInfo, ConnParams};
#[cfg(feature = "rdma")]
use super::rdma;
use super::soft::conn;
use super::soft::cq::SoftCq;
use super::soft::device::{StagEntry, StagKind, StagTable};
use super::soft::poll::Ready;
use super::soft::qp::SoftQp;
use super::types::{Access, QpCaps, QpState, RecvWr, SendWr};
use super::url::Url;

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
    /// `rdma`: a skeleton that cannot be opened yet.
    #[cfg(feature = "rdma")]
    #[allow(dead_code)] // the skeleton has no values yet
    Rdma(rdma::Device),
}

impl Device {
    /// A fresh soft device.
    pub(crate) fn soft() -> Device {
        Device::Soft(StagTable::new())
    }

    /// The soft device's STag table: only the soft engine calls this, and it runs only on
    /// objects of a soft device.
    pub(crate) fn stags(&self) -> &StagTable {
        match self {
            Device::Soft(t) => t,
            #[cfg(feature = "rdma")]
            Device::Rdma(d) => match *d {},
        }
    }

    /// Registers a memory region; returns its key.
    pub(crate) fn register_mr(&self, g: Grant<'_>) -> Result<u32> {
        match self {
            Device::Soft(t) => t.insert(g.soft(StagKind::Mr)),
            #[cfg(feature = "rdma")]
            Device::Rdma(d) => match *d {},
        }
    }

    /// Allocates an unbound memory window's key.
    pub(crate) fn alloc_mw(&self) -> Result<u32> {
        match self {
            Device::Soft(t) => t.reserve(),
            #[cfg(feature = "rdma")]
            Device::Rdma(d) => match *d {},
        }
    }

    /// Binds window `rkey` for queue pair `qp`; returns the new rkey.
    pub(crate) fn bind_mw(&self, rkey: u32, qp: u32, g: Grant<'_>) -> Result<u32> {
        match self {
            Device::Soft(t) => t.rebind(rkey, g.soft(StagKind::Mw { qp })),
            #[cfg(feature = "rdma")]
            Device::Rdma(d) => match *d {},
        }
    }

    /// Makes `key` refuse every access from now on (a local invalidate).
    pub(crate) fn invalidate(&self, key: u32) {
        match self {
            Device::Soft(t) => {
                t.invalidate(key);
            }
            #[cfg(feature = "rdma")]
            Device::Rdma(d) => match *d {},
        }
    }

    /// Forgets `key` (deregistration, a window's drop).
    pub(crate) fn release(&self, key: u32) {
        match self {
            Device::Soft(t) => t.remove(key),
            #[cfg(feature = "rdma")]
            Device::Rdma(d) => match *d {},
        }
    }

    /// A completion queue's transport part.
    pub(crate) fn create_cq(&self) -> Result<CqEngine> {
        match self {
            Device::Soft(_) => Ok(CqEngine::Soft(SoftCq::new()?)),
            #[cfg(feature = "rdma")]
            Device::Rdma(d) => match *d {},
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
    ) -> QpEngine {
        match self {
            Device::Soft(_) => QpEngine::Soft(SoftQp::new(num, pd, send_cq, recv_cq, caps)),
            #[cfg(feature = "rdma")]
            Device::Rdma(d) => match *d {},
        }
    }

    /// A passive endpoint on `url`.
    pub(crate) fn listen(&self, url: &Url) -> Result<ListenEngine> {
        match self {
            Device::Soft(_) => Ok(ListenEngine::Soft(conn::TcpListen::bind(url)?)),
            #[cfg(feature = "rdma")]
            Device::Rdma(d) => match *d {},
        }
    }
}

/// A completion queue's transport part: what drives progress and the idle wait.
pub(crate) enum CqEngine {
    Soft(SoftCq),
    #[cfg(feature = "rdma")]
    #[allow(dead_code)] // the skeleton has no values yet
    Rdma(rdma::Cq),
}

impl CqEngine {
    /// Makes a soft queue pair's progress part of this queue's polling.
    pub(crate) fn attach_soft(&self, qp: &Arc<SoftQp>) {
        match self {
            CqEngine::Soft(c) => c.attach(qp),
            #[cfg(feature = "rdma")]
            CqEngine::Rdma(c) => match *c {},
        }
    }

    /// Drives the bound queue pairs once.
    pub(crate) fn progress(&self) {
        match self {
            CqEngine::Soft(c) => c.progress(),
            #[cfg(feature = "rdma")]
            CqEngine::Rdma(c) => match *c {},
        }
    }

    /// Prepares the idle wait (arms what must wake it).
    pub(crate) fn arm(&self) -> Result<()> {
        match self {
            CqEngine::Soft(c) => c.arm(),
            #[cfg(feature = "rdma")]
            CqEngine::Rdma(c) => match *c {},
        }
    }

    /// Blocks until something may have happened, or `timeout`.
    pub(crate) fn block(&self, timeout: Option<Duration>) -> Result<Ready> {
        match self {
            CqEngine::Soft(c) => c.poller().wait(timeout),
            #[cfg(feature = "rdma")]
            CqEngine::Rdma(c) => match *c {},
        }
    }

    pub(crate) fn watch(&self, fd: BorrowedFd<'_>, token: u64) -> Result<()> {
        match self {
            CqEngine::Soft(c) => c.poller().watch(fd, token),
            #[cfg(feature = "rdma")]
            CqEngine::Rdma(c) => match *c {},
        }
    }

    pub(crate) fn unwatch(&self, fd: BorrowedFd<'_>) -> Result<()> {
        match self {
            CqEngine::Soft(c) => c.poller().unwatch(fd),
            #[cfg(feature = "rdma")]
            CqEngine::Rdma(c) => match *c {},
        }
    }
}

/// A queue pair's transport part.
pub(crate) enum QpEngine {
    Soft(Arc<SoftQp>),
    #[cfg(feature = "rdma")]
    #[allow(dead_code)] // the skeleton has no values yet
    Rdma(rdma::Qp),
}

macro_rules! each_qp {
    ($self:expr, $q:ident => $e:expr) => {
        match $self {
            QpEngine::Soft($q) => $e,
            #[cfg(feature = "rdma")]
            QpEngine::Rdma($q) => match *$q {},
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
        each_qp!(self, q => {
            let (stream, neg) = conn::connect(url, params, private_data)?;
            q.start(stream, neg, params)
        })
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
            (QpEngine::Rdma(q), _) => match *q {},
            #[cfg(feature = "rdma")]
            (_, PendingEngine::Rdma(p)) => match p {},
        }
    }
}

/// A listener's transport part.
pub(crate) enum ListenEngine {
    Soft(conn::TcpListen),
    #[cfg(feature = "rdma")]
    #[allow(dead_code)] // the skeleton has no values yet
    Rdma(rdma::Listen),
}

macro_rules! each {
    ($ty:ident, $self:expr, $x:ident => $e:expr) => {
        match $self {
            $ty::Soft($x) => $e,
            #[cfg(feature = "rdma")]
            $ty::Rdma($x) => match *$x {},
        }
    };
}

impl ListenEngine {
    pub(crate) fn url(&self) -> Result<Url> {
        each!(ListenEngine, self, l => l.url())
    }
    pub(crate) fn accept(&self, params: &ConnParams) -> Result<PendingEngine> {
        each!(ListenEngine, self, l => l.accept(params).map(PendingEngine::Soft))
    }
    pub(crate) fn accept_incoming(&self) -> Result<Option<IncomingEngine>> {
        each!(ListenEngine, self, l => Ok(l.accept_incoming()?.map(IncomingEngine::Soft)))
    }
    pub(crate) fn set_nonblocking(&self, on: bool) -> Result<()> {
        each!(ListenEngine, self, l => l.set_nonblocking(on))
    }
    pub(crate) fn as_fd(&self) -> BorrowedFd<'_> {
        each!(ListenEngine, self, l => l.as_fd())
    }
}

/// An accepted connection whose request is still being read.
pub(crate) enum IncomingEngine {
    Soft(conn::Incoming),
    #[cfg(feature = "rdma")]
    #[allow(dead_code)] // the skeleton has no values yet
    Rdma(rdma::Never),
}

/// Where reading an incoming request stands.
pub(crate) enum IncomingProgress {
    Complete(PendingEngine),
    Incomplete(IncomingEngine),
}

impl IncomingEngine {
    pub(crate) fn peer_addr(&self) -> SocketAddr {
        each!(IncomingEngine, self, i => i.peer_addr())
    }
    pub(crate) fn as_fd(&self) -> BorrowedFd<'_> {
        each!(IncomingEngine, self, i => i.as_fd())
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
            IncomingEngine::Rdma(n) => match n {},
        }
    }
}

/// A connection request waiting for an answer.
pub(crate) enum PendingEngine {
    Soft(conn::Pending),
    #[cfg(feature = "rdma")]
    #[allow(dead_code)] // the skeleton has no values yet
    Rdma(rdma::Never),
}

impl PendingEngine {
    pub(crate) fn private_data(&self) -> &[u8] {
        each!(PendingEngine, self, p => p.private_data())
    }
    pub(crate) fn peer_addr(&self) -> SocketAddr {
        each!(PendingEngine, self, p => p.peer_addr())
    }
    pub(crate) fn reject(self, private_data: &[u8]) {
        match self {
            PendingEngine::Soft(p) => p.reject(private_data),
            #[cfg(feature = "rdma")]
            PendingEngine::Rdma(n) => match n {},
        }
    }
}
