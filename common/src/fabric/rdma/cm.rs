//! rdma_cm: event channels and ids (RAII), events (copied out and acknowledged at once), and
//! the queue pair state moves rdma_cm's attributes drive. The listener and its connection
//! requests are in `listen.rs`.
//!
//! Every id has an event channel of its own (a listener's requests are moved to a new one the
//! moment they arrive), so that a connection's events (established, disconnected) reach the
//! completion queues its queue pair is bound to, and no thread reading one connection's events
//! can take another's. Channels are non-blocking: events are read when poll says so.
//!
//! The queue pair is the caller's (`ibv_create_qp`, made before the connection so that
//! receives can be posted first), not rdma_cm's: this side moves it through Init, RTR and RTS
//! with the attributes `rdma_init_qp_attr` gives, as librdmacm does for its own queue pairs.

use std::net::SocketAddr;
use std::os::fd::{AsFd, BorrowedFd, RawFd};
use std::ptr::NonNull;
use std::time::{Duration, Instant};

use rdma_sys::{
    ibv_qp, ibv_qp_attr, ibv_qp_state, rdma_cm_event, rdma_cm_event_type as ev, rdma_cm_id,
    rdma_conn_param, rdma_event_channel, rdma_port_space,
};

use super::ext;
use super::sys;
use super::translate::caps;
use crate::fabric::error::{Error, Result};

/// An rdma_cm event channel (its fd is non-blocking).
pub(crate) struct EventChannel(NonNull<rdma_event_channel>);

// SAFETY: an event channel is an fd librdmacm reads and writes with its own locking; it is
// destroyed only in Drop, after every id on it (see `Conn`).
unsafe impl Send for EventChannel {}
// SAFETY: as for Send.
unsafe impl Sync for EventChannel {}

impl EventChannel {
    pub(crate) fn new() -> Result<EventChannel> {
        // SAFETY: no preconditions; the channel is destroyed in Drop.
        let ch = unsafe { rdma_sys::rdma_create_event_channel() };
        let ch = match NonNull::new(ch) {
            Some(ch) => EventChannel(ch),
            None => {
                let e = std::io::Error::last_os_error();
                // No rdma_cm device node, or no device behind it.
                if matches!(
                    e.raw_os_error(),
                    Some(libc::ENODEV | libc::ENOENT | libc::ENOSYS)
                ) {
                    return Err(Error::NoDevice);
                }
                return Err(Error::Verbs {
                    op: "rdma_create_event_channel",
                    source: e,
                });
            }
        };
        sys::set_nonblocking(ch.as_fd(), true, "fcntl(rdma_cm channel)")?;
        Ok(ch)
    }

    pub(crate) fn raw(&self) -> *mut rdma_event_channel {
        self.0.as_ptr()
    }

    pub(crate) fn fd(&self) -> RawFd {
        // SAFETY: the channel is live while self is.
        unsafe { (*self.0.as_ptr()).fd }
    }
}

impl AsFd for EventChannel {
    fn as_fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the channel's fd stays open until Drop, which the borrow of self outlasts.
        unsafe { sys::borrow_fd(self.fd()) }
    }
}

impl Drop for EventChannel {
    fn drop(&mut self) {
        // SAFETY: every id on this channel was destroyed first (the types that hold both drop
        // the id before the channel); destroyed once, here.
        unsafe { rdma_sys::rdma_destroy_event_channel(self.0.as_ptr()) };
    }
}

/// An rdma_cm id. Destroyed in Drop, which must come before its channel's (a `Conn` holds both
/// in that order; a free-standing id is declared after its channel).
pub(crate) struct CmId(NonNull<rdma_cm_id>);

// SAFETY: librdmacm ids may be used from any thread (its calls are writes to the channel fd
// plus state under the id's own mutex); destroyed only in Drop.
unsafe impl Send for CmId {}
// SAFETY: as for Send.
unsafe impl Sync for CmId {}

impl CmId {
    pub(crate) fn new(channel: &EventChannel) -> Result<CmId> {
        let mut id = std::ptr::null_mut();
        // SAFETY: `channel` is live; the id is written on success and destroyed in Drop.
        let r = unsafe {
            rdma_sys::rdma_create_id(
                channel.raw(),
                &mut id,
                std::ptr::null_mut(),
                rdma_port_space::RDMA_PS_TCP,
            )
        };
        match NonNull::new(id) {
            Some(id) if r == 0 => Ok(CmId(id)),
            _ => Err(sys::errno("rdma_create_id")),
        }
    }

    pub(crate) fn raw(&self) -> *mut rdma_cm_id {
        self.0.as_ptr()
    }

    /// The device context rdma_cm tied this id to (NULL until bound to a device's address or
    /// resolved).
    pub(crate) fn verbs(&self) -> *mut rdma_sys::ibv_context {
        // SAFETY: the id is live; `verbs` is a plain field librdmacm sets.
        unsafe { (*self.raw()).verbs }
    }

    fn port_num(&self) -> u8 {
        // SAFETY: as for verbs.
        unsafe { (*self.raw()).port_num }
    }

    pub(crate) fn bind(&self, addr: &SocketAddr) -> Result<()> {
        let mut ss = sys::to_sockaddr(addr);
        // SAFETY: the id is live; `ss` is a sockaddr of the address's family, read only.
        let r = unsafe { rdma_sys::rdma_bind_addr(self.raw(), &mut ss as *mut _ as *mut _) };
        if r != 0 {
            return Err(Error::Socket {
                op: "bind",
                addr: addr.to_string(),
                source: std::io::Error::last_os_error(),
            });
        }
        Ok(())
    }

    pub(crate) fn resolve_addr(&self, dst: &SocketAddr, timeout: Duration) -> Result<()> {
        let mut ss = sys::to_sockaddr(dst);
        // SAFETY: the id is live; a NULL source lets rdma_cm pick it from the route.
        let r = unsafe {
            rdma_sys::rdma_resolve_addr(
                self.raw(),
                std::ptr::null_mut(),
                &mut ss as *mut _ as *mut _,
                millis(timeout),
            )
        };
        if r != 0 {
            return Err(Error::Socket {
                op: "resolve address",
                addr: dst.to_string(),
                source: std::io::Error::last_os_error(),
            });
        }
        Ok(())
    }

    pub(crate) fn resolve_route(&self, timeout: Duration) -> Result<()> {
        // SAFETY: the id is live and its address resolved.
        let r = unsafe { rdma_sys::rdma_resolve_route(self.raw(), millis(timeout)) };
        if r != 0 {
            return Err(sys::errno("rdma_resolve_route"));
        }
        Ok(())
    }

    pub(crate) fn local_addr(&self) -> Option<SocketAddr> {
        // SAFETY: the id is live; the route's source address is a sockaddr_storage-sized union
        // librdmacm fills when the id is bound or resolved.
        unsafe { sys::from_sockaddr(rdma_sys::rdma_get_local_addr(&*self.raw())) }
    }

    pub(crate) fn peer_addr(&self) -> Option<SocketAddr> {
        // SAFETY: as for local_addr, the destination half.
        unsafe { sys::from_sockaddr(rdma_sys::rdma_get_peer_addr(&*self.raw())) }
    }

    pub(super) fn src_port(&self) -> u16 {
        // SAFETY: the id is live.
        u16::from_be(unsafe { rdma_sys::rdma_get_src_port(self.raw()) })
    }

    pub(crate) fn connect(&self, p: &mut Param) -> Result<()> {
        // SAFETY: the id's route is resolved; the parameters (and the private data they point
        // to, owned by `p`) are read during the call only.
        let r = unsafe { rdma_sys::rdma_connect(self.raw(), &mut p.raw) };
        if r != 0 {
            return Err(sys::errno("rdma_connect"));
        }
        Ok(())
    }

    pub(crate) fn accept(&self, p: &mut Param) -> Result<()> {
        // SAFETY: the id is a connection request's; as for connect.
        let r = unsafe { rdma_sys::rdma_accept(self.raw(), &mut p.raw) };
        if r != 0 {
            return Err(sys::errno("rdma_accept"));
        }
        Ok(())
    }

    /// Tells the passive side this side's queue pair is ready (a caller-owned queue pair's
    /// last step, after RTS).
    pub(crate) fn establish(&self) -> Result<()> {
        // SAFETY: the id received its connect response and has no rdma_cm queue pair.
        let r = unsafe { rdma_sys::rdma_establish(self.raw()) };
        if r != 0 {
            return Err(sys::errno("rdma_establish"));
        }
        Ok(())
    }

    pub(super) fn reject(&self, data: &[u8]) {
        // SAFETY: the id is an unanswered request's; `data` (at most 148 bytes, checked by the
        // caller) is read during the call only. A failure leaves the request to the CM's
        // time-out, which rejects it too.
        let _ = unsafe {
            rdma_sys::rdma_reject(
                self.raw(),
                data.as_ptr().cast(),
                data.len().min(caps::REJ_ROOM) as u8,
            )
        };
    }

    /// Starts the disconnect (a DREQ); the peer sees DISCONNECTED. Errors are of no use here:
    /// the id is destroyed next either way.
    pub(crate) fn disconnect(&self) {
        // SAFETY: the id is live; disconnecting an id that is not connected fails harmlessly.
        let _ = unsafe { rdma_sys::rdma_disconnect(self.raw()) };
    }

    /// Tells rdma_cm that the queue pair received its first packet before the RTU (the
    /// device's `IBV_EVENT_COMM_EST`), so the CM moves the connection to established.
    pub(crate) fn notify_established(&self) {
        // SAFETY: the id is live; a failure (the connection is already established, or gone)
        // changes nothing.
        let _ = unsafe {
            rdma_sys::rdma_notify(self.raw(), rdma_sys::ibv_event_type::IBV_EVENT_COMM_EST)
        };
    }

    fn migrate(&self, channel: &EventChannel) -> Result<()> {
        // SAFETY: both live; the id has no unacknowledged event (every event is acknowledged
        // as it is read).
        let r = unsafe { rdma_sys::rdma_migrate_id(self.raw(), channel.raw()) };
        if r != 0 {
            return Err(sys::errno("rdma_migrate_id"));
        }
        Ok(())
    }

    /// Moves `qp` to `state` with the attributes rdma_cm has for this id's connection (port,
    /// P_Key, path, PSNs, time-outs); `rd_atomic` overrides the RTS ORD, `dest_rd_atomic` the
    /// RTR IRD, as librdmacm does for the values negotiated in the CM exchange.
    ///
    /// # Safety
    /// `qp` must be a live queue pair of this id's device.
    pub(crate) unsafe fn move_qp(
        &self,
        qp: *mut ibv_qp,
        state: ibv_qp_state::Type,
        rd_atomic: Option<u8>,
        dest_rd_atomic: Option<u8>,
    ) -> Result<()> {
        // SAFETY: ibv_qp_attr is plain C data; zero is valid for each field.
        let mut attr: ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = state;
        let mut mask = 0;
        // SAFETY: the id is live and connected (or a request); both out-parameters are valid.
        let r = unsafe { rdma_sys::rdma_init_qp_attr(self.raw(), &mut attr, &mut mask) };
        if r != 0 {
            return Err(sys::errno("rdma_init_qp_attr"));
        }
        let infiniband =
            state == ibv_qp_state::IBV_QPS_RTR && self.link_layer() == sys::LINK_LAYER_INFINIBAND;
        adjust_attr(
            &mut attr,
            &mut mask,
            state,
            infiniband,
            rd_atomic,
            dest_rd_atomic,
        );
        // SAFETY: the caller promises a live queue pair of this device; attr/mask come from
        // rdma_cm for this transition.
        let r = unsafe { rdma_sys::ibv_modify_qp(qp, &mut attr, mask) };
        if r != 0 {
            return Err(sys::returned("ibv_modify_qp", r));
        }
        Ok(())
    }

    fn link_layer(&self) -> u8 {
        // SAFETY: ibv_port_attr is plain C data.
        let mut pa: rdma_sys::ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: the id is tied to a device (verbs non-NULL once resolved or a request) and
        // `pa` is a valid out-parameter.
        let r = unsafe { ext::query_port(self.verbs(), self.port_num(), &mut pa) };
        if r != 0 {
            return 0;
        }
        pa.link_layer
    }
}

/// The RNR NAK timer code this side's queue pair asks a sender to wait between RNR retries:
/// 12 is 0.64 ms. rdma_cm's RTR attributes carry 0, which IBTA encodes as 655.36 ms.
pub(crate) const MIN_RNR_TIMER: u8 = 12;

/// This transport's changes to the attributes rdma_cm gives for a move to `state`: on RTR the
/// IRD (`dest_rd_atomic`) and the RNR timer, and on InfiniBand librdmacm's work-around for an
/// rdma_ucm bug (mask bits 21-23, RoCE-only attributes, must not be passed); on RTS the ORD.
fn adjust_attr(
    attr: &mut ibv_qp_attr,
    mask: &mut i32,
    state: ibv_qp_state::Type,
    infiniband: bool,
    rd_atomic: Option<u8>,
    dest_rd_atomic: Option<u8>,
) {
    if state == ibv_qp_state::IBV_QPS_RTR {
        if infiniband {
            *mask &= !0xe0_0000;
        }
        if let Some(d) = dest_rd_atomic {
            attr.max_dest_rd_atomic = d;
        }
        attr.min_rnr_timer = MIN_RNR_TIMER;
        *mask |= rdma_sys::ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER.0 as i32;
    }
    if let (ibv_qp_state::IBV_QPS_RTS, Some(r)) = (state, rd_atomic) {
        attr.max_rd_atomic = r;
    }
}

impl Drop for CmId {
    fn drop(&mut self) {
        // SAFETY: every event of this id was acknowledged when it was read (rdma_destroy_id
        // waits for those); its channel outlives it (see the type's docs). Destroyed once.
        unsafe { rdma_sys::rdma_destroy_id(self.0.as_ptr()) };
    }
}

fn millis(d: Duration) -> i32 {
    d.as_millis().clamp(1, i32::MAX as u128) as i32
}

/// An id with its own channel: a connection (or a request), whose events only it reads.
pub(crate) struct Conn {
    // Declared first: dropped before the channel.
    pub(crate) id: CmId,
    pub(crate) channel: EventChannel,
}

/// rdma_cm connection parameters, and the private data they point to.
pub(crate) struct Param {
    raw: rdma_conn_param,
    _data: Vec<u8>,
}

impl Param {
    /// Parameters carrying `data` for queue pair `qp_num`.
    pub(crate) fn new(data: Vec<u8>, qp_num: u32, responder: u8, initiator: u8) -> Param {
        let raw = rdma_conn_param {
            private_data: data.as_ptr().cast(),
            private_data_len: data.len().min(usize::from(u8::MAX)) as u8,
            responder_resources: responder,
            initiator_depth: initiator,
            flow_control: 1,
            // Transport retries (time-outs, lost packets) and RNR retries: 7 is the most for
            // the former and "retry forever" for the latter; a peer that never posts a Recv
            // is caught by the control plane's keep-alive.
            retry_count: 7,
            rnr_retry_count: 7,
            srq: 0,
            qp_num,
        };
        Param { raw, _data: data }
    }
}

/// A connection request whose id is still on the listener's channel.
pub(crate) struct RawRequest(Option<NonNull<rdma_cm_id>>);

// SAFETY: as for CmId: a live rdma_cm id, used from one thread at a time (it is owned).
unsafe impl Send for RawRequest {}

impl RawRequest {
    /// Moves the request to a channel of its own.
    pub(super) fn adopt(mut self) -> Result<Conn> {
        let id = self.0.take().expect("a request is adopted once");
        let id = CmId(id);
        let channel = match EventChannel::new() {
            Ok(c) => c,
            Err(e) => {
                id.reject(&[]);
                return Err(e);
            }
        };
        if let Err(e) = id.migrate(&channel) {
            id.reject(&[]);
            return Err(e);
        }
        Ok(Conn { id, channel })
    }
}

impl Drop for RawRequest {
    fn drop(&mut self) {
        if let Some(id) = self.0.take() {
            let id = CmId(id);
            id.reject(&[]);
        }
    }
}

/// An rdma_cm event, copied out (the event itself is acknowledged when read).
pub(crate) struct Event {
    pub(crate) kind: ev::Type,
    pub(crate) status: i32,
    pub(crate) private: Vec<u8>,
    pub(crate) responder_resources: u8,
    pub(crate) initiator_depth: u8,
    /// A connection request's new id.
    pub(super) request: Option<RawRequest>,
}

impl Event {
    /// The peer's ORD and IRD, in that order, from a connect request or response. IB CM
    /// reports them in the receiver's view (cm_format_req_event / cm_format_rep_event swap the
    /// message's fields): `responder_resources` is what this side must serve, the peer's
    /// initiator depth; `initiator_depth` is what the peer serves, its responder resources.
    pub(crate) fn peer_depths(&self) -> (u8, u8) {
        (self.responder_resources, self.initiator_depth)
    }

    #[cfg(test)]
    pub(crate) fn for_test(
        kind: ev::Type,
        status: i32,
        responder_resources: u8,
        initiator_depth: u8,
    ) -> Event {
        Event {
            kind,
            status,
            private: Vec::new(),
            responder_resources,
            initiator_depth,
            request: None,
        }
    }

    /// The event's name (`RDMA_CM_EVENT_ESTABLISHED`, ...).
    pub(crate) fn name(&self) -> String {
        // SAFETY: rdma_event_str returns a static string for any value.
        let s = unsafe { std::ffi::CStr::from_ptr(rdma_sys::rdma_event_str(self.kind)) };
        s.to_string_lossy().into_owned()
    }

    /// Ok if this is `want` with no error; else the error it stands for.
    pub(crate) fn expect(&self, want: ev::Type, op: &'static str, peer: &SocketAddr) -> Result<()> {
        if self.kind == want && self.status == 0 {
            return Ok(());
        }
        let errno = self.status.unsigned_abs() as i32;
        Err(match self.kind {
            ev::RDMA_CM_EVENT_ADDR_ERROR | ev::RDMA_CM_EVENT_ROUTE_ERROR => Error::Socket {
                op,
                addr: peer.to_string(),
                source: std::io::Error::from_raw_os_error(errno.max(1)),
            },
            ev::RDMA_CM_EVENT_UNREACHABLE => Error::Socket {
                op,
                addr: peer.to_string(),
                source: std::io::Error::new(
                    std::io::ErrorKind::HostUnreachable,
                    format!("the peer did not answer (rdma_cm status {})", self.status),
                ),
            },
            _ => Error::Handshake {
                peer: peer.to_string(),
                reason: format!(
                    "{op}: rdma_cm reported {} (status {})",
                    self.name(),
                    self.status
                ),
                source: None,
            },
        })
    }
}

/// The next event of `channel`, or None if none is queued.
pub(crate) fn next_event(channel: &EventChannel) -> Result<Option<Event>> {
    let mut e: *mut rdma_cm_event = std::ptr::null_mut();
    // SAFETY: the channel is live and non-blocking; on success `e` points to an event that
    // stays valid until acknowledged below.
    if unsafe { rdma_sys::rdma_get_cm_event(channel.raw(), &mut e) } != 0 {
        let err = std::io::Error::last_os_error();
        if err.kind() == std::io::ErrorKind::WouldBlock {
            return Ok(None);
        }
        return Err(Error::Verbs {
            op: "rdma_get_cm_event",
            source: err,
        });
    }
    // SAFETY: `e` is the event just read; connection events carry `param.conn`, whose private
    // data (if any) is `private_data_len` bytes owned by the event.
    let out = unsafe {
        let kind = (*e).event;
        let conn = &(*e).param.conn;
        let private = match NonNull::new(conn.private_data as *mut u8) {
            Some(p) => {
                std::slice::from_raw_parts(p.as_ptr(), usize::from(conn.private_data_len)).to_vec()
            }
            None => Vec::new(),
        };
        Event {
            kind,
            status: (*e).status,
            private,
            responder_resources: conn.responder_resources,
            initiator_depth: conn.initiator_depth,
            request: (kind == ev::RDMA_CM_EVENT_CONNECT_REQUEST)
                .then(|| RawRequest(NonNull::new((*e).id))),
        }
    };
    // SAFETY: `e` came from rdma_get_cm_event and is acknowledged once; nothing of it is used
    // after this (the data was copied out).
    unsafe { rdma_sys::rdma_ack_cm_event(e) };
    Ok(Some(out))
}

/// The next event of `channel`, waiting until `deadline` (None: it passed first).
pub(crate) fn wait_event(channel: &EventChannel, deadline: Instant) -> Result<Option<Event>> {
    loop {
        if let Some(e) = next_event(channel)? {
            return Ok(Some(e));
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Ok(None);
        }
        wait_readable(channel.as_fd(), Some(left))?;
    }
}

pub(super) fn wait_readable(fd: BorrowedFd<'_>, timeout: Option<Duration>) -> Result<()> {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    let t = match timeout {
        None => PollTimeout::NONE,
        Some(d) => PollTimeout::try_from(d.as_millis().clamp(1, i32::MAX as u128) as i32)
            .unwrap_or(PollTimeout::MAX),
    };
    match poll(&mut [PollFd::new(fd, PollFlags::POLLIN)], t) {
        Ok(_) | Err(nix::errno::Errno::EINTR) => Ok(()),
        Err(e) => Err(Error::Wait {
            source: std::io::Error::from(e),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn millis_rounds_into_range() {
        assert_eq!(millis(Duration::ZERO), 1);
        assert_eq!(millis(Duration::from_millis(2500)), 2500);
        assert_eq!(millis(Duration::from_secs(u64::MAX / 1000)), i32::MAX);
    }

    #[test]
    fn parameters_point_at_their_private_data() {
        let p = Param::new(vec![1, 2, 3], 77, 16, 8);
        assert_eq!(p.raw.private_data_len, 3);
        assert_eq!(p.raw.private_data, p._data.as_ptr().cast());
        assert_eq!(
            (
                p.raw.qp_num,
                p.raw.responder_resources,
                p.raw.initiator_depth
            ),
            (77, 16, 8)
        );
        assert_eq!((p.raw.retry_count, p.raw.rnr_retry_count), (7, 7));
    }

    #[test]
    fn peer_depths_are_read_in_the_receivers_view() {
        // A request whose sender has ORD 4 (its initiator depth) and IRD 16 (its responder
        // resources) arrives, swapped by IB CM, as responder_resources 4, initiator_depth 16.
        let e = Event {
            kind: ev::RDMA_CM_EVENT_CONNECT_REQUEST,
            status: 0,
            private: Vec::new(),
            responder_resources: 4,
            initiator_depth: 16,
            request: None,
        };
        assert_eq!(e.peer_depths(), (4, 16));
    }

    fn attr() -> ibv_qp_attr {
        // SAFETY: ibv_qp_attr is plain C data; zero is valid for each field.
        unsafe { std::mem::zeroed() }
    }

    #[test]
    fn rtr_gets_the_ird_and_a_short_rnr_timer() {
        use rdma_sys::ibv_qp_attr_mask as am;
        let rnr = am::IBV_QP_MIN_RNR_TIMER.0 as i32;
        let (mut a, mut mask) = (attr(), 0xe0_0000 | am::IBV_QP_STATE.0 as i32);
        adjust_attr(
            &mut a,
            &mut mask,
            ibv_qp_state::IBV_QPS_RTR,
            true,
            Some(3),
            Some(9),
        );
        assert_eq!((a.max_dest_rd_atomic, a.max_rd_atomic), (9, 0));
        assert_eq!(a.min_rnr_timer, MIN_RNR_TIMER);
        assert_eq!(mask, am::IBV_QP_STATE.0 as i32 | rnr);
        // RoCE keeps the RoCE-only bits.
        let (mut a, mut mask) = (attr(), 0xe0_0000);
        adjust_attr(
            &mut a,
            &mut mask,
            ibv_qp_state::IBV_QPS_RTR,
            false,
            None,
            None,
        );
        assert_eq!(mask, 0xe0_0000 | rnr);
        assert_eq!(a.max_dest_rd_atomic, 0);
    }

    #[test]
    fn rts_gets_the_ord_and_init_is_left_alone() {
        let (mut a, mut mask) = (attr(), 0);
        adjust_attr(
            &mut a,
            &mut mask,
            ibv_qp_state::IBV_QPS_RTS,
            true,
            Some(3),
            Some(9),
        );
        assert_eq!(
            (a.max_rd_atomic, a.max_dest_rd_atomic, a.min_rnr_timer),
            (3, 0, 0)
        );
        assert_eq!(mask, 0);
        let (mut a, mut mask) = (attr(), 0x7);
        adjust_attr(
            &mut a,
            &mut mask,
            ibv_qp_state::IBV_QPS_INIT,
            true,
            Some(3),
            Some(9),
        );
        assert_eq!(
            (a.max_rd_atomic, a.max_dest_rd_atomic, a.min_rnr_timer),
            (0, 0, 0)
        );
        assert_eq!(mask, 0x7);
    }

    /// Without an RDMA stack (CI), an event channel cannot be made and says so as "no device".
    #[test]
    fn no_rdma_cm_means_no_device() {
        match EventChannel::new() {
            Ok(ch) => assert!(ch.fd() >= 0),
            Err(e) => assert!(matches!(e, Error::NoDevice), "{e:?}"),
        }
    }
}
