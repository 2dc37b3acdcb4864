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
//! The seam is the only file that names the transports: it matches the variants of the
//! objects that meet (a queue pair and its completion queues, a window and its region) and
//! hands each transport its own parts and neutral data (a `DomainId`, a `Grant`, a completion
//! list), never a public object. Objects of two transports meeting are refused with
//! `Error::WrongDomain`. A transport slots in as a module beside `soft` (`rdma` behind its
//! cargo feature) and one variant per enum here; nothing above the fabric changes.

use std::net::SocketAddr;
use std::os::fd::BorrowedFd;
use std::sync::Arc;
use std::time::Duration;

use super::completions::Completions;
use super::counters::ResponderCounters;
use super::error::{Error, QpFailure, Result};
use super::memory::{Grant, MemoryBacking, Registration};
use super::params::{ConnInfo, ConnParams};
#[cfg(feature = "rdma")]
use super::rdma;
use super::soft::conn;
use super::soft::cq::SoftCq;
use super::soft::device::{StagEntry, StagKind, StagTable};
use super::soft::qp::SoftQp;
use super::types::{Access, DomainId, QpCaps, QpState};
use super::url::{Scheme, Url};
use super::wait::Ready;
use super::wr::{RecvWr, SendWr};

/// An open device.
pub(crate) enum Device {
    /// `tcp`: the soft device is its STag table, which its queue pairs share.
    Soft(Arc<StagTable>),
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

/// The error for objects of two transports (or two devices) meeting.
#[cfg(feature = "rdma")]
fn wrong(what: &'static str) -> Error {
    Error::WrongDomain { what }
}

impl Device {
    /// A fresh soft device.
    pub(crate) fn soft() -> Device {
        Device::Soft(Arc::new(StagTable::new()))
    }

    /// The device that serves `url`'s transport (see `Context::for_url`).
    pub(crate) fn for_url(url: &Url) -> Result<Device> {
        match url.scheme {
            Scheme::Tcp => Ok(Device::soft()),
            #[cfg(feature = "rdma")]
            Scheme::Rdma => Ok(Device::Rdma(rdma::Device::for_url(url)?)),
            #[cfg(not(feature = "rdma"))]
            Scheme::Rdma => Err(Error::TransportUnavailable {
                scheme: "rdma".into(),
            }),
        }
    }

    /// The RDMA device named `name`.
    #[cfg(feature = "rdma")]
    pub(crate) fn rdma_by_name(name: &str) -> Result<Device> {
        Ok(Device::Rdma(rdma::Device::by_name(name)?))
    }

    /// Whether the device failed or was removed (never, for the soft device).
    pub(crate) fn is_lost(&self) -> bool {
        match self {
            Device::Soft(_) => false,
            #[cfg(feature = "rdma")]
            Device::Rdma(d) => d.is_lost(),
        }
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

    /// A protection domain's transport part.
    pub(crate) fn alloc_pd(&self) -> Result<PdEngine> {
        match self {
            Device::Soft(_) => Ok(PdEngine::Soft),
            #[cfg(feature = "rdma")]
            Device::Rdma(d) => Ok(PdEngine::Rdma(d.alloc_pd()?)),
        }
    }

    /// Registers a memory region in domain `pd`.
    pub(crate) fn register_mr(&self, pd: &PdEngine, g: Grant<'_>) -> Result<MrEngine> {
        match (self, pd) {
            (Device::Soft(t), PdEngine::Soft) => Ok(MrEngine::Soft {
                key: t.insert(StagEntry::granted(&g, StagKind::Mr))?,
            }),
            #[cfg(feature = "rdma")]
            (Device::Rdma(d), PdEngine::Rdma(pd)) => Ok(MrEngine::Rdma(d.register_mr(pd, &g)?)),
            #[cfg(feature = "rdma")]
            _ => Err(wrong("protection domain")),
        }
    }

    /// Allocates an unbound memory window: its key and transport part.
    pub(crate) fn alloc_mw(&self, pd: &PdEngine) -> Result<(u32, MwEngine)> {
        match (self, pd) {
            (Device::Soft(t), PdEngine::Soft) => Ok((t.reserve()?, MwEngine::Soft)),
            #[cfg(feature = "rdma")]
            (Device::Rdma(d), PdEngine::Rdma(pd)) => {
                let mw = d.alloc_mw(pd)?;
                Ok((mw.rkey(), MwEngine::Rdma(mw)))
            }
            #[cfg(feature = "rdma")]
            _ => Err(wrong("protection domain")),
        }
    }

    /// Binds window `rkey` to region `mr` for queue pair `qp`; returns the new rkey.
    pub(crate) fn bind_mw(
        &self,
        mw: &MwEngine,
        rkey: u32,
        qp: &QpEngine,
        mr: &MrEngine,
        g: Grant<'_>,
    ) -> Result<u32> {
        match (self, mw, qp, mr) {
            (Device::Soft(t), MwEngine::Soft, q, MrEngine::Soft { .. }) => {
                t.rebind(rkey, StagEntry::granted(&g, StagKind::Mw { qp: q.num() }))
            }
            #[cfg(feature = "rdma")]
            (Device::Rdma(_), MwEngine::Rdma(w), QpEngine::Rdma(q), MrEngine::Rdma(m)) => {
                q.bind_mw(w, m, &g)
            }
            #[cfg(feature = "rdma")]
            _ => Err(wrong("memory window")),
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

    /// A completion queue's transport part, sized for `depth` completions, which it pushes
    /// into `list`.
    pub(crate) fn create_cq(&self, depth: usize, list: &Arc<Completions>) -> Result<CqEngine> {
        match self {
            Device::Soft(_) => {
                let _ = depth; // the soft queue grows as needed
                Ok(CqEngine::Soft(Arc::new(SoftCq::new(Arc::clone(list))?)))
            }
            #[cfg(feature = "rdma")]
            Device::Rdma(d) => Ok(CqEngine::Rdma(Arc::new(
                d.create_cq(depth, Arc::clone(list))?,
            ))),
        }
    }

    /// A queue pair's transport part, in Init, in domain `pd` (`domain`), completing into
    /// `send` and `recv`.
    pub(crate) fn create_qp(
        &self,
        num: u32,
        domain: DomainId,
        pd: &PdEngine,
        send: &CqEngine,
        recv: &CqEngine,
        caps: QpCaps,
    ) -> Result<QpEngine> {
        match (self, pd, send, recv) {
            (Device::Soft(t), PdEngine::Soft, CqEngine::Soft(s), CqEngine::Soft(r)) => {
                let qp = SoftQp::new(num, domain, Arc::clone(t), s.list(), r.list(), caps);
                Ok(QpEngine::Soft {
                    qp,
                    cqs: [Arc::clone(s), Arc::clone(r)],
                })
            }
            #[cfg(feature = "rdma")]
            (Device::Rdma(d), PdEngine::Rdma(pd), CqEngine::Rdma(s), CqEngine::Rdma(r)) => {
                Ok(QpEngine::Rdma(d.create_qp(domain, pd, s, r, caps)?))
            }
            #[cfg(feature = "rdma")]
            (_, _, CqEngine::Soft(_), _) | (_, _, _, CqEngine::Soft(_)) => {
                Err(wrong("completion queue"))
            }
            #[cfg(feature = "rdma")]
            _ => Err(wrong("protection domain")),
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

/// A completion queue's transport part: what drives progress and the idle wait. Shared with
/// the queue pairs made on it.
pub(crate) enum CqEngine {
    Soft(Arc<SoftCq>),
    #[cfg(feature = "rdma")]
    Rdma(Arc<rdma::Cq>),
}

impl CqEngine {
    /// Drives the bound queue pairs once (soft: they push their completions), or polls the
    /// device's queue into the completion list (rdma). Returns whether a peer's request was
    /// answered that completes nothing here: on the soft transport a Read, a Flush or an
    /// atomic served in this call; on rdma always false (the device serves those without the
    /// CPU).
    pub(crate) fn progress(&self) -> Result<bool> {
        match self {
            CqEngine::Soft(c) => Ok(c.progress()),
            #[cfg(feature = "rdma")]
            CqEngine::Rdma(c) => c.progress().map(|()| false),
        }
    }

    /// Prepares the idle wait (arms what must wake it). Returns whether work is waiting that
    /// nothing would wake the wait for (the soft engine's input buffered and not yet handled):
    /// the caller drives the queue again instead of blocking.
    pub(crate) fn arm(&self) -> Result<bool> {
        match self {
            CqEngine::Soft(c) => c.arm(),
            #[cfg(feature = "rdma")]
            CqEngine::Rdma(c) => c.arm().map(|()| false),
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

    /// The token of a watched fd that is readable now (never blocks).
    pub(crate) fn watched_ready(&self) -> Result<Option<u64>> {
        match self {
            CqEngine::Soft(c) => c.poller().watched_ready(),
            #[cfg(feature = "rdma")]
            CqEngine::Rdma(c) => c.poller().watched_ready(),
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
    /// The soft queue pair, and its send and receive queues, whose polling drives it once it
    /// is connected.
    Soft {
        qp: Arc<SoftQp>,
        cqs: [Arc<SoftCq>; 2],
    },
    #[cfg(feature = "rdma")]
    Rdma(Arc<rdma::Qp>),
}

/// `$e` for whichever transport the queue pair is: both engines have the same method names.
macro_rules! each_qp {
    ($self:expr, $q:ident => $e:expr) => {
        match $self {
            QpEngine::Soft { qp: $q, .. } => $e,
            #[cfg(feature = "rdma")]
            QpEngine::Rdma($q) => $e,
        }
    };
}

impl QpEngine {
    pub(crate) fn num(&self) -> u32 {
        each_qp!(self, q => q.num)
    }
    pub(crate) fn state(&self) -> QpState {
        each_qp!(self, q => q.state())
    }
    pub(crate) fn info(&self) -> ConnInfo {
        each_qp!(self, q => q.info())
    }
    pub(crate) fn error(&self) -> Option<QpFailure> {
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
    pub(crate) fn to_error(&self, why: QpFailure) {
        each_qp!(self, q => q.to_error(why))
    }
    pub(crate) fn close(&self) {
        each_qp!(self, q => q.close())
    }
    /// What the queue pair served as the responder, where software serves it (the soft
    /// placement engine); an RNIC places without software, so `rdma` has none.
    pub(crate) fn responder_counters(&self) -> Option<ResponderCounters> {
        match self {
            QpEngine::Soft { qp, .. } => Some(qp.counters.clone()),
            #[cfg(feature = "rdma")]
            QpEngine::Rdma(_) => None,
        }
    }

    /// Messages taken from the peer so far, where software takes them (the soft engine: every
    /// FPDU, one-sided ones too); an RNIC serves one-sided operations without software, so
    /// `rdma` has none.
    pub(crate) fn messages_received(&self) -> Option<u64> {
        match self {
            QpEngine::Soft { qp, .. } => Some(qp.fpdus_received()),
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
            QpEngine::Soft { qp, cqs } => {
                let (stream, neg) = conn::connect(url, params, private_data)?;
                qp.start(stream, neg, params)?;
                cqs.iter().for_each(|c| c.attach(qp));
                Ok(())
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
            (QpEngine::Soft { qp, cqs }, PendingEngine::Soft(p)) => {
                let (stream, neg) = p.accept(params, private_data)?;
                qp.start(stream, neg, params)?;
                cqs.iter().for_each(|c| c.attach(qp));
                Ok(())
            }
            #[cfg(feature = "rdma")]
            (QpEngine::Rdma(q), PendingEngine::Rdma(p)) => q.accept(*p, params, private_data),
            #[cfg(feature = "rdma")]
            (_, p) => {
                p.reject(&[]);
                Err(wrong("queue pair of another transport"))
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
