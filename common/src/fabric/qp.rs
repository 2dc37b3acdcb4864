//! Queue pairs (reliable connected) and connection management.
//!
//! A queue pair is made by [`ProtectionDomain::create_qp`] as a [`PreparedQueuePair`] (state
//! Init: receives may be posted), and becomes a connected [`QueuePair`] (state RTS) by consuming
//! itself: actively with [`PreparedQueuePair::connect`], passively with
//! [`ConnRequest::accept`] on a request from [`Listener::accept`]. This is rdma_cm's shape: the
//! URL picks the transport (`tcp://host:port`, `rdma://host:port`).

use std::net::SocketAddr;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::Arc;

use super::context::Context;
use super::counters::ResponderCounters;
use super::cq::CompletionQueue;
use super::error::{Error, QpFailure, Result};
use super::mr::{MemoryRegion, MemoryWindow};
use super::params::{ConnInfo, ConnParams};
use super::pd::ProtectionDomain;
use super::transport::{IncomingEngine, IncomingProgress, ListenEngine, PendingEngine, QpEngine};
use super::types::{Access, QpCaps, QpState};
use super::url::Url;
use super::wr::{RecvWr, SendWr};

/// A queue pair's parts: the transport's, and the objects it was made from, which it keeps
/// alive (a verbs queue pair keeps its domain and completion queues).
pub(crate) struct QpParts {
    pub(crate) engine: QpEngine,
    pd: ProtectionDomain,
    _send_cq: CompletionQueue,
    _recv_cq: CompletionQueue,
}

impl ProtectionDomain {
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
}

/// A queue pair that is not connected yet (state Init).
pub struct PreparedQueuePair {
    inner: QpParts,
}

impl std::fmt::Debug for PreparedQueuePair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreparedQueuePair")
            .field("qp_num", &self.inner.engine.num())
            .finish()
    }
}

impl PreparedQueuePair {
    pub(crate) fn new(
        pd: ProtectionDomain,
        send_cq: CompletionQueue,
        recv_cq: CompletionQueue,
        caps: QpCaps,
    ) -> Result<PreparedQueuePair> {
        let num = pd.context().next_qp_num();
        let engine = pd.context().device().create_qp(
            num,
            pd.domain(),
            &pd.inner.engine,
            send_cq.engine(),
            recv_cq.engine(),
            caps,
        )?;
        Ok(PreparedQueuePair {
            inner: QpParts {
                engine,
                pd,
                _send_cq: send_cq,
                _recv_cq: recv_cq,
            },
        })
    }

    /// The queue pair number.
    pub fn qp_num(&self) -> u32 {
        self.inner.engine.num()
    }

    /// Posts a receive before the connection exists, so that the peer's first Send finds it
    /// (iWARP has no RNR retry: a Send that finds no receive is fatal).
    ///
    /// # Errors
    /// As [`QueuePair::post_recv`].
    pub fn post_recv(&self, wr: RecvWr) -> Result<()> {
        self.inner.engine.post_recv(wr)
    }

    /// Connects to a listener at `url` (rdma_connect): on `tcp`, TCP connect and the MPA
    /// exchange carrying `private_data` (at most [`TcpParams::MAX_PRIVATE_DATA`] bytes); on
    /// `rdma`, rdma_cm address and route resolution and the CM exchange (at most
    /// `RDMA_MAX_CONNECT_PRIVATE_DATA`, 52 bytes); then RTS.
    ///
    /// # Errors
    /// [`Error::TransportUnavailable`] for `rdma://` in a build without the `rdma` feature,
    /// [`Error::BadUrl`] for a URL of another transport than the queue pair's,
    /// [`Error::Socket`], [`Error::Handshake`], [`Error::Rejected`], [`Error::Verbs`].
    ///
    /// [`TcpParams::MAX_PRIVATE_DATA`]: super::TcpParams::MAX_PRIVATE_DATA
    pub fn connect(self, url: &Url, params: &ConnParams, private_data: &[u8]) -> Result<QueuePair> {
        self.inner.pd.context().device().check_scheme(url)?;
        self.inner.engine.connect(url, params, private_data)?;
        Ok(QueuePair { inner: self.inner })
    }
}

/// A connected reliable queue pair (`ibv_qp` of type RC), in RTS until an error moves it to
/// Error. Dropping it closes the connection; the peer's queue pair goes to Error.
pub struct QueuePair {
    inner: QpParts,
}

impl std::fmt::Debug for QueuePair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueuePair")
            .field("qp_num", &self.inner.engine.num())
            .field("state", &self.inner.engine.state())
            .finish()
    }
}

impl QueuePair {
    /// The queue pair number (the `qp_num` of its completions).
    pub fn qp_num(&self) -> u32 {
        self.inner.engine.num()
    }

    /// The current state: RTS, or Error after a fatal error.
    pub fn state(&self) -> QpState {
        self.inner.engine.state()
    }

    /// What was agreed when connecting.
    pub fn info(&self) -> ConnInfo {
        self.inner.engine.info()
    }

    /// Why the queue pair went to Error, if it did: the first cause (a received or sent
    /// Terminate, a closed or broken connection, a failed device, a local move to Error), typed
    /// so that a caller can branch on it. Its text names the cause; print it with its sources
    /// ([`error_chain`](crate::error_chain)) to keep the errno under it.
    pub fn error(&self) -> Option<QpFailure> {
        self.inner.engine.error()
    }

    /// Posts a send-queue work request (`ibv_post_send`). It starts at once if the send queue
    /// and the ORD allow, else when progress (polling a completion queue) lets it.
    ///
    /// Buffer ownership: the queue pair holds a clone of every `Arc<MemoryRegion>` the request
    /// names until the request's completion is generated (for an unsignaled request: until the
    /// queue pair has finished with it), so the memory stays registered and alive while the
    /// fabric reads or writes it; dropping your handles meanwhile frees nothing. Do not read a
    /// Read's or an atomic's local buffer before its completion.
    ///
    /// Write and Send complete when handed to TCP, as RFC 5040 has it: an error they cause at
    /// the peer comes back as a Terminate that completes the oldest outstanding request with
    /// the error status (for APM, the Read that follows the Writes) and flushes the rest.
    ///
    /// # Errors
    /// [`Error::InvalidState`] unless in RTS, [`Error::QueueFull`], [`Error::LocalBounds`],
    /// [`Error::LocalAccess`], [`Error::WrongDomain`] (a region of another protection domain),
    /// [`Error::InvalidWorkRequest`] (misaligned or wrong-sized atomics, a message larger than
    /// `max_message`), [`Error::PeerUnsupported`] (Flush, Atomic Write or atomics to a peer
    /// that did not advertise them).
    pub fn post_send(&self, wr: SendWr) -> Result<()> {
        self.inner.engine.post_send(wr)
    }

    /// Posts several send-queue work requests at once, like `ibv_post_send` with a chained
    /// list, and rings the doorbell once: what can start goes out in one `writev` (for APM,
    /// the Write(s) and the Read travel together). Same ownership and completion rules as
    /// [`post_send`](Self::post_send), in list order.
    ///
    /// All or nothing: if any request is refused, none is posted (unlike `ibv_post_send`, which
    /// posts those before the bad one).
    ///
    /// # Errors
    /// Those of [`post_send`](Self::post_send), for the first request refused;
    /// [`Error::QueueFull`] if the send queue has no room for all of them.
    pub fn post_send_list(&self, wrs: impl IntoIterator<Item = SendWr>) -> Result<()> {
        // Inline for the short lists of the data path (a request and its Flush): no allocation.
        let mut list: smallvec::SmallVec<[Option<SendWr>; 4]> = wrs.into_iter().map(Some).collect();
        self.inner.engine.post_sends(&mut list)
    }

    /// Posts a receive (`ibv_post_recv`). Same buffer ownership as
    /// [`post_send`](Self::post_send).
    ///
    /// # Errors
    /// [`Error::InvalidState`] in Error, [`Error::QueueFull`], [`Error::LocalBounds`],
    /// [`Error::LocalAccess`] (the buffer lacks [`Access::LOCAL_WRITE`]), [`Error::WrongDomain`].
    pub fn post_recv(&self, wr: RecvWr) -> Result<()> {
        self.inner.engine.post_recv(wr)
    }

    /// Binds `mw` to `len` bytes at `offset` of `mr` with the remote rights `access`, for this
    /// queue pair only (`ibv_bind_mw`, type 2). Returns the new rkey; the previous one stops
    /// working. Executed at once on this transport.
    ///
    /// # Errors
    /// [`Error::MemoryWindow`] (no MW_BIND on the region, rights beyond the region's, range
    /// outside it), [`Error::WrongDomain`] (the window, the region and this queue pair are not
    /// all of one protection domain, which verbs refuses too), [`Error::InvalidState`] unless
    /// in RTS.
    pub fn bind_mw(
        &self,
        mw: &MemoryWindow,
        mr: &Arc<MemoryRegion>,
        offset: usize,
        len: usize,
        access: Access,
    ) -> Result<u32> {
        self.inner.engine.check_rts("bind_mw")?;
        // The window's domain is the region's (`MemoryWindow::bind` checks that): a rkey bound
        // here would otherwise serve a queue pair of another domain.
        if !self.inner.pd.same(mr.pd()) {
            return Err(Error::WrongDomain {
                what: "the queue pair binding the window",
            });
        }
        mw.bind(&self.inner.engine, mr, offset, len, access)
    }

    /// Moves the queue pair to Error (`ibv_modify_qp` to ERR): the connection is closed and
    /// every outstanding request is completed with `WrFlush`.
    pub fn to_error(&self) {
        self.inner.engine.to_error(QpFailure::Local);
    }

    /// What this queue pair served as the responder (Writes placed, Reads answered, atomics,
    /// durability requests per rkey; Terminates sent; persist latencies), where the transport
    /// serves remote requests in software: `tcp` does; `rdma` (an RNIC) gives None. The handle
    /// stays readable after the queue pair is dropped. Counting takes no lock and no shared
    /// atomic on the data path ([`ResponderCounters`](super::ResponderCounters)).
    pub fn responder_counters(&self) -> Option<ResponderCounters> {
        self.inner.engine.responder_counters()
    }

    /// How many messages the transport has taken from the peer so far, every one-sided Write
    /// and Read Request included, where software serves them in the thread that polls this
    /// queue pair's completion queue (`tcp`: a count that only grows, wrapping at `u64::MAX`).
    /// `rdma` gives None: an RNIC serves one-sided operations without software, so they wait
    /// on no thread of ours. A poll loop uses it to tell a quiet connection from a busy one.
    pub fn messages_received(&self) -> Option<u64> {
        self.inner.engine.messages_received()
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        self.inner.engine.close();
    }
}

/// A passive endpoint (rdma_listen): accepts connections on a `tcp://host:port` URL (or an
/// `rdma://` one, from an RDMA device's context: rdma_cm's own listener, whose requests arrive
/// whole, so [`Incoming::poll_request`] completes at once).
pub struct Listener {
    ctx: Context,
    inner: ListenEngine,
}

impl std::fmt::Debug for Listener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Listener")
            .field("url", &self.url().ok())
            .finish()
    }
}

impl Listener {
    /// Binds to `url` (port 0: an ephemeral port; see [`Listener::url`]).
    ///
    /// # Errors
    /// [`Error::TransportUnavailable`] for `rdma://` in a build without the `rdma` feature,
    /// [`Error::BadUrl`] for a URL of another transport than the context's,
    /// [`Error::Socket`] (on `rdma`: rdma_cm's bind or listen).
    pub fn bind(ctx: &Context, url: &Url) -> Result<Listener> {
        ctx.device().check_scheme(url)?;
        Ok(Listener {
            ctx: ctx.clone(),
            inner: ctx.device().listen(url)?,
        })
    }

    /// The URL it listens on, with the real port.
    ///
    /// # Errors
    /// [`Error::Socket`] if the socket cannot say.
    pub fn url(&self) -> Result<Url> {
        self.inner.url()
    }

    /// Waits for the next connection and reads its MPA Request (rdma_get_request). The peer's
    /// private data is in the returned request, which must be accepted or rejected.
    ///
    /// # Errors
    /// [`Error::Socket`], [`Error::Handshake`] (a peer that does not speak MPA; the listener
    /// stays usable).
    pub fn accept(&self, params: &ConnParams) -> Result<ConnRequest> {
        let pending = self.inner.accept(params)?;
        Ok(ConnRequest {
            ctx: self.ctx.clone(),
            pending: Some(pending),
        })
    }

    /// Accepts the next TCP connection without reading anything from it: its MPA Request is
    /// read, without blocking, by [`Incoming::poll_request`]. A server that reads the Requests
    /// of many peers at once (polling their fds) cannot be held up by a slow or silent one.
    /// `None` if the listener is non-blocking ([`Listener::set_nonblocking`]) and no connection
    /// is waiting.
    ///
    /// # Errors
    /// [`Error::Socket`] (EMFILE and the like; the listener stays usable);
    /// [`Error::DeviceLost`] (`rdma`) once its device failed or was removed: the listener is
    /// over (drop it; bind again on the device when it is back).
    pub fn accept_incoming(&self) -> Result<Option<Incoming>> {
        Ok(self.inner.accept_incoming()?.map(|inner| Incoming {
            ctx: self.ctx.clone(),
            inner,
        }))
    }

    /// Makes [`accept_incoming`](Self::accept_incoming) return `None` at once instead of
    /// waiting when no connection is queued (poll [`AsFd::as_fd`] for readability).
    ///
    /// # Errors
    /// [`Error::Socket`].
    pub fn set_nonblocking(&self, on: bool) -> Result<()> {
        self.inner.set_nonblocking(on)
    }

    /// Whether its device failed or was removed ([`Context::is_lost`]; never on `tcp`).
    pub fn is_lost(&self) -> bool {
        self.ctx.is_lost()
    }

    /// Its device's name ([`Context::device_name`]).
    pub fn device_name(&self) -> &str {
        self.ctx.device_name()
    }
}

impl AsFd for Listener {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.inner.as_fd()
    }
}

/// A TCP connection from [`Listener::accept_incoming`] whose MPA Request has not been read in
/// full yet. Dropping it closes the connection without an answer.
pub struct Incoming {
    ctx: Context,
    inner: IncomingEngine,
}

impl std::fmt::Debug for Incoming {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Incoming")
            .field("peer", &self.inner.peer_addr())
            .finish()
    }
}

/// Where reading an [`Incoming`] connection's MPA Request stands.
#[derive(Debug)]
pub enum RequestProgress {
    /// The Request is in: accept or reject it.
    Complete(ConnRequest),
    /// Not all of it has arrived: call [`Incoming::poll_request`] again when
    /// [`AsFd::as_fd`] is readable.
    Incomplete(Incoming),
}

impl Incoming {
    /// The peer's address.
    pub fn peer_addr(&self) -> SocketAddr {
        self.inner.peer_addr()
    }

    /// Reads what the peer has sent so far, without blocking and never past the MPA Request.
    /// The caller keeps the deadline: a peer that never completes its Request is dropped by
    /// dropping the [`Incoming`].
    ///
    /// # Errors
    /// [`Error::ClosedBeforeRequest`]: the peer closed (or reset) the connection before
    /// sending a byte (a port probe or health check); [`Error::Handshake`]: the peer closed
    /// within its Request, or sent a malformed one (answered with a reject Reply, as
    /// [`Listener::accept`] does); [`Error::Socket`].
    pub fn poll_request(self) -> Result<RequestProgress> {
        let ctx = self.ctx;
        Ok(match self.inner.poll_request()? {
            IncomingProgress::Complete(pending) => RequestProgress::Complete(ConnRequest {
                ctx,
                pending: Some(pending),
            }),
            IncomingProgress::Incomplete(inner) => {
                RequestProgress::Incomplete(Incoming { ctx, inner })
            }
        })
    }
}

impl AsFd for Incoming {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.inner.as_fd()
    }
}

/// An incoming connection waiting for an answer. Dropping it unanswered rejects it.
pub struct ConnRequest {
    ctx: Context,
    pending: Option<PendingEngine>,
}

impl std::fmt::Debug for ConnRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnRequest")
            .field("peer", &self.peer_addr())
            .finish()
    }
}

impl ConnRequest {
    /// The private data the peer sent.
    pub fn private_data(&self) -> &[u8] {
        self.pending
            .as_ref()
            .map(|p| p.private_data())
            .unwrap_or(&[])
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        self.pending.as_ref().map(|p| p.peer_addr())
    }

    /// Accepts into `qp` (rdma_accept) with `private_data` for the peer; `qp` goes to RTS.
    ///
    /// # Errors
    /// [`Error::WrongDomain`] if `qp` is of another device, [`Error::Socket`],
    /// [`Error::Handshake`].
    pub fn accept(
        mut self,
        qp: PreparedQueuePair,
        params: &ConnParams,
        private_data: &[u8],
    ) -> Result<QueuePair> {
        if !qp.inner.pd.context().same(&self.ctx) {
            return Err(Error::WrongDomain { what: "queue pair" });
        }
        let pending = self.pending.take().ok_or(Error::InvalidWorkRequest {
            reason: "connection request already answered",
        })?;
        qp.inner.engine.accept(pending, params, private_data)?;
        Ok(QueuePair { inner: qp.inner })
    }

    /// Rejects the connection with `private_data` for the peer.
    pub fn reject(mut self, private_data: &[u8]) {
        if let Some(p) = self.pending.take() {
            p.reject(private_data);
        }
    }
}

impl Drop for ConnRequest {
    fn drop(&mut self) {
        if let Some(p) = self.pending.take() {
            log::warn!(
                "connection request from {} dropped unanswered: rejected",
                p.peer_addr()
            );
            p.reject(&[]);
        }
    }
}
