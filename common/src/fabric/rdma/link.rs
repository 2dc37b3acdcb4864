//! Connection set-up of the rdma transport, for a queue pair that already exists (in Init,
//! its receives posted): the active side resolves the address and route, moves the queue
//! pair's Init attributes to the route's port, connects, and on the connect response moves
//! through Init again (only now does rdma_cm's Init carry the remote access rights: before the
//! REQ exists it gives none, and the first move wiped those `to_init` set), RTR and RTS, and
//! tells the passive side (rdma_establish); the passive side moves to Init, RTR and RTS with
//! the negotiated depths and accepts. Later rdma_cm events of the connection (the peer's
//! disconnect, which is answered) move the queue pair to Error.
//!
//! The private data each way is this transport's capability block and the application's
//! bytes (`translate::caps`); IB CM has room for 52 application bytes in a connect, 192 in an
//! accept, 144 in a reject. The control exchange itself (NQNs, keys, descriptors) runs over
//! Send/Recv once connected, as on `tcp`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use rdma_sys::{ibv_qp_state, rdma_cm_event_type as ev};

use super::caps::Caps;
use super::cm::{self, CmId, Conn, EventChannel, Param};
use super::listen::Pending;
use super::qp::Qp;
use super::translate::caps;
use crate::fabric::error::{Error, QpFailure, Result};
use crate::fabric::params::{ConnInfo, ConnParams};
use crate::fabric::types::QpState;
use crate::fabric::url::Url;

/// IB CM's reject reason for a consumer's own reject (`IB_CM_REJ_CONSUMER_DEFINED`).
const CONSUMER_REJECT: i32 = 28;

/// The IRD and ORD of a connection, in that order: this side's wish (`want_*`, the
/// application's), bounded by the device's limits and by the peer's ORD and IRD
/// (`cm::Event::peer_depths`; `u8::MAX` before the peer has said).
pub(super) fn depths(
    want_ird: u16,
    want_ord: u16,
    c: &Caps,
    peer_ord: u8,
    peer_ird: u8,
) -> (u8, u8) {
    let ird = want_ird
        .min(u16::from(c.max_qp_rd_atom))
        .min(u16::from(peer_ord));
    let ord = want_ord
        .min(u16::from(c.max_qp_init_rd_atom))
        .min(u16::from(peer_ird));
    (ird as u8, ord as u8)
}

/// What a connection's rdma_cm event does to its queue pair.
#[derive(Debug)]
pub(super) enum CmAction {
    /// Nothing (established, time-wait exit, address changes).
    Ignore,
    /// Move to Error for this reason; `answer`: the peer disconnected, and its DREQ is
    /// answered (rdma_disconnect sends the DREP), or it waits for the CM's time-out.
    Fail { why: QpFailure, answer: bool },
}

pub(super) fn cm_action(e: &cm::Event) -> CmAction {
    let (why, answer) = match e.kind {
        ev::RDMA_CM_EVENT_DISCONNECTED => (QpFailure::PeerClosed, true),
        ev::RDMA_CM_EVENT_DEVICE_REMOVAL => (QpFailure::DeviceRemoved, false),
        ev::RDMA_CM_EVENT_REJECTED
        | ev::RDMA_CM_EVENT_UNREACHABLE
        | ev::RDMA_CM_EVENT_CONNECT_ERROR => (
            QpFailure::ConnectionFailed {
                event: e.name(),
                status: e.status,
            },
            false,
        ),
        _ => return CmAction::Ignore,
    };
    CmAction::Fail { why, answer }
}

fn timed_out(peer: &SocketAddr, during: &str) -> Error {
    Error::Handshake {
        peer: peer.to_string(),
        reason: format!("timed out during {during}"),
        source: None,
    }
}

impl Qp {
    /// Connects to `url` (Init to RTS).
    pub(crate) fn connect(
        self: &Arc<Self>,
        url: &Url,
        params: &ConnParams,
        private_data: &[u8],
    ) -> Result<()> {
        let data = caps::encode(self.local_flags(), private_data, caps::REQ_ROOM).ok_or(
            Error::InvalidWorkRequest {
                reason: "private data longer than 52 bytes (an rdma_cm connect request)",
            },
        )?;
        if self.state() != QpState::Init {
            return Err(Error::InvalidState {
                qp_num: self.num,
                state: self.state(),
                op: "connect",
                needed: QpState::Init,
            });
        }
        let deadline = Instant::now() + params.timeout;
        let mut last = None;
        for addr in url.socket_addrs()? {
            match self.try_connect(&addr, &data, params, deadline) {
                Ok(()) => return Ok(()),
                Err(e @ Error::Rejected { .. }) => return Err(e),
                Err(e) => last = Some(e),
            }
        }
        Err(last.expect("socket_addrs is never empty"))
    }

    fn try_connect(
        &self,
        addr: &SocketAddr,
        data: &[u8],
        params: &ConnParams,
        deadline: Instant,
    ) -> Result<()> {
        let left = || deadline.saturating_duration_since(Instant::now());
        let channel = EventChannel::new()?;
        let id = CmId::new(&channel)?;
        id.resolve_addr(addr, left())?;
        cm::wait_event(&channel, deadline)?
            .ok_or_else(|| timed_out(addr, "address resolution"))?
            .expect(ev::RDMA_CM_EVENT_ADDR_RESOLVED, "resolve address", addr)?;
        if !self.dev.same(id.verbs()) {
            return Err(Error::NoSuchDevice {
                wanted: format!("for {addr}"),
                reason: format!(
                    "the route leaves through another device than this queue pair's {}",
                    self.dev.inner.name
                ),
            });
        }
        id.resolve_route(left())?;
        cm::wait_event(&channel, deadline)?
            .ok_or_else(|| timed_out(addr, "route resolution"))?
            .expect(ev::RDMA_CM_EVENT_ROUTE_RESOLVED, "resolve route", addr)?;
        // SAFETY: the queue pair is live and of the id's device (checked above).
        unsafe { id.move_qp(self.raw.as_ptr(), ibv_qp_state::IBV_QPS_INIT, None, None)? };
        let (responder, initiator) =
            depths(params.ird, params.ord, self.dev.caps(), u8::MAX, u8::MAX);
        let mut p = Param::new(data.to_vec(), self.num, responder, initiator);
        id.connect(&mut p)?;
        let e = cm::wait_event(&channel, deadline)?.ok_or_else(|| timed_out(addr, "connect"))?;
        match e.kind {
            ev::RDMA_CM_EVENT_CONNECT_RESPONSE if e.status == 0 => {}
            ev::RDMA_CM_EVENT_REJECTED => return Err(rejected(addr, &e)),
            _ => {
                e.expect(ev::RDMA_CM_EVENT_CONNECT_RESPONSE, "connect", addr)?;
            }
        }
        let (flags, app) = caps::decode(&e.private).map_err(|reason| Error::Handshake {
            peer: addr.to_string(),
            reason: reason.to_owned(),
            source: None,
        })?;
        let (peer_ord, peer_ird) = e.peer_depths();
        let (ird, ord) = depths(params.ird, params.ord, self.dev.caps(), peer_ord, peer_ird);
        let moved = (|| {
            let qp = self.raw.as_ptr();
            // SAFETY: as for the first Init. Init again: rdma_cm's Init attributes carry the
            // remote access rights only now that the connection exists (ucma_modify_qp_rtr
            // does the same).
            unsafe {
                id.move_qp(qp, ibv_qp_state::IBV_QPS_INIT, None, None)?;
                id.move_qp(qp, ibv_qp_state::IBV_QPS_RTR, None, Some(ird))?;
                id.move_qp(qp, ibv_qp_state::IBV_QPS_RTS, Some(ord), None)?;
            }
            id.establish()
        })();
        if let Err(e) = moved {
            // The hardware may be in RTR or RTS: Error says what the core does (and dropping
            // the id disconnects the peer).
            let mut core = self.lock();
            let why = QpFailure::Setup {
                op: "connect",
                reason: crate::error_chain(&e),
            };
            self.enter_error(&mut core, why);
            return Err(e);
        }
        let info = ConnInfo {
            ird: u16::from(ird),
            ord: u16::from(ord),
            peer_flush: false,
            peer_atomic_write: flags & caps::ATOMIC_WRITE != 0,
            peer_atomics: flags & caps::ATOMICS != 0,
            peer_private_data: app.to_vec(),
            local_addr: id.local_addr().unwrap_or(*addr),
            peer_addr: id.peer_addr().unwrap_or(*addr),
            tcp: None,
        };
        self.connected(Conn { id, channel }, info, flags, params);
        Ok(())
    }

    /// Accepts `p` into this queue pair (Init to RTS).
    pub(crate) fn accept(
        &self,
        p: Pending,
        params: &ConnParams,
        private_data: &[u8],
    ) -> Result<()> {
        if !self.dev.same(p.conn.id.verbs()) {
            p.reject(&[]);
            return Err(Error::WrongDomain {
                what: "queue pair (the request came in on another RDMA device)",
            });
        }
        let Some(data) = caps::encode(self.local_flags(), private_data, caps::REP_ROOM) else {
            p.reject(&[]);
            return Err(Error::InvalidWorkRequest {
                reason: "private data longer than 192 bytes (an rdma_cm accept)",
            });
        };
        let (responder, initiator) = depths(
            params.ird,
            params.ord,
            self.dev.caps(),
            p.peer_ord,
            p.peer_ird,
        );
        let moved = (|| {
            let qp = self.raw.as_ptr();
            // SAFETY: the queue pair is live and of the request's device (checked above).
            unsafe {
                p.conn
                    .id
                    .move_qp(qp, ibv_qp_state::IBV_QPS_INIT, None, None)?;
                p.conn
                    .id
                    .move_qp(qp, ibv_qp_state::IBV_QPS_RTR, None, Some(responder))?;
                p.conn
                    .id
                    .move_qp(qp, ibv_qp_state::IBV_QPS_RTS, Some(initiator), None)?;
            }
            let mut param = Param::new(data, self.num, responder, initiator);
            p.conn.id.accept(&mut param)
        })();
        if let Err(e) = moved {
            // Dropping the request's id rejects it (the CM answers an unanswered request).
            let mut core = self.lock();
            let why = QpFailure::Setup {
                op: "accept",
                reason: crate::error_chain(&e),
            };
            self.enter_error(&mut core, why);
            return Err(e);
        }
        let info = ConnInfo {
            ird: u16::from(responder),
            ord: u16::from(initiator),
            peer_flush: false,
            peer_atomic_write: p.peer_flags & caps::ATOMIC_WRITE != 0,
            peer_atomics: p.peer_flags & caps::ATOMICS != 0,
            peer_private_data: p.private_data().to_vec(),
            local_addr: p.local,
            peer_addr: p.peer,
            tcp: None,
        };
        let flags = p.peer_flags;
        self.connected(p.conn, info, flags, params);
        Ok(())
    }

    fn connected(&self, conn: Conn, info: ConnInfo, peer_flags: u8, params: &ConnParams) {
        self.watch_cm(&conn);
        let mut c = self.lock();
        c.info = Some(info);
        c.peer_flags = peer_flags;
        c.max_message = params.max_message;
        c.cm = Some(conn);
        if c.state != QpState::Error {
            c.state = QpState::Rts;
        }
    }

    /// Reads this connection's rdma_cm events (non-blocking): a disconnect (answered), or a
    /// connection that failed after the accept, moves the queue pair to Error.
    pub(crate) fn handle_cm_events(&self) {
        let mut removed = false;
        let mut c = self.lock();
        loop {
            let Some(cm) = c.cm.as_ref() else { return };
            let e = match cm::next_event(&cm.channel) {
                Ok(Some(e)) => e,
                Ok(None) | Err(_) => break,
            };
            let CmAction::Fail { why, answer } = cm_action(&e) else {
                continue;
            };
            removed |= matches!(why, QpFailure::DeviceRemoved);
            self.enter_error(&mut c, why);
            if answer {
                if let Some(cm) = c.cm.as_ref() {
                    cm.id.disconnect();
                }
            }
        }
        drop(c);
        if removed {
            // The whole device is gone, not only this connection: its other queue pairs, its
            // completion queues and its listeners too (Device::lose, after this lock).
            self.dev.lose(QpFailure::DeviceRemoved);
        }
    }
}

/// The error for a REJECTED event: the peer's own reject (with its private data), or the
/// CM's (no listener on that port, a time-out).
fn rejected(addr: &SocketAddr, e: &cm::Event) -> Error {
    match caps::decode(&e.private) {
        Ok((_, app)) if e.status == CONSUMER_REJECT => Error::Rejected {
            peer: addr.to_string(),
            private_data: app.to_vec(),
        },
        _ => Error::Socket {
            op: "connect",
            addr: addr.to_string(),
            source: std::io::Error::new(
                std::io::ErrorKind::ConnectionRefused,
                format!(
                    "rejected by the connection manager (IB CM reason {})",
                    e.status
                ),
            ),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caps(rd_atom: u8, init_rd_atom: u8) -> Caps {
        Caps {
            max_qp_wr: 1024,
            max_cqe: 4096,
            max_qp_rd_atom: rd_atom,
            max_qp_init_rd_atom: init_rd_atom,
            atomics: true,
            atomic_write: false,
            mw_type2: true,
            odp: false,
            odp_rc: 0,
            odp_defect: None,
        }
    }

    #[test]
    fn depths_are_bounded_by_the_wish_the_device_and_the_peer() {
        // Before the peer has said: the wish, cut to the device.
        assert_eq!(depths(32, 32, &caps(16, 8), u8::MAX, u8::MAX), (16, 8));
        assert_eq!(depths(2, 3, &caps(16, 8), u8::MAX, u8::MAX), (2, 3));
        // This side's IRD follows the peer's ORD, its ORD the peer's IRD (not the other way).
        assert_eq!(depths(16, 16, &caps(16, 16), 4, 12), (4, 12));
        assert_eq!(depths(16, 16, &caps(16, 16), 12, 4), (12, 4));
        // A wish above 255 never wraps.
        assert_eq!(
            depths(1000, 1000, &caps(255, 255), u8::MAX, u8::MAX),
            (255, 255)
        );
        assert_eq!(depths(0, 0, &caps(16, 16), 4, 4), (0, 0));
    }

    #[test]
    fn both_sides_agree_on_the_depths() {
        // The active side offers (IRD, ORD); the passive side reads them swapped (its
        // event's responder_resources is the active side's ORD) and answers; the active side
        // reads the answer swapped too. Each side's IRD must equal the other's ORD.
        let (a_caps, p_caps) = (caps(16, 4), caps(8, 16));
        let (a_ird, a_ord) = depths(64, 64, &a_caps, u8::MAX, u8::MAX);
        // The REQ carries responder_resources = a_ird, initiator_depth = a_ord; IB CM hands
        // the passive side responder_resources = a_ord, initiator_depth = a_ird.
        let req = cm_event(a_ord, a_ird);
        let (peer_ord, peer_ird) = req.peer_depths();
        let (p_ird, p_ord) = depths(64, 64, &p_caps, peer_ord, peer_ird);
        let rep = cm_event(p_ord, p_ird);
        let (peer_ord, peer_ird) = rep.peer_depths();
        let (a_ird2, a_ord2) = depths(64, 64, &a_caps, peer_ord, peer_ird);
        assert_eq!(a_ird2, p_ord, "active IRD serves the passive ORD");
        assert_eq!(p_ird, a_ord2, "passive IRD serves the active ORD");
        assert_eq!((a_ird2, a_ord2, p_ird, p_ord), (16, 4, 4, 16));
    }

    /// An event as the receiver sees it: IB CM's swapped fields.
    fn cm_event(responder_resources: u8, initiator_depth: u8) -> cm::Event {
        cm::Event::for_test(
            ev::RDMA_CM_EVENT_CONNECT_RESPONSE,
            0,
            responder_resources,
            initiator_depth,
        )
    }

    #[test]
    fn a_peers_disconnect_is_answered() {
        let e = cm::Event::for_test(ev::RDMA_CM_EVENT_DISCONNECTED, 0, 0, 0);
        assert!(matches!(
            cm_action(&e),
            CmAction::Fail {
                why: QpFailure::PeerClosed,
                answer: true
            }
        ));
        let e = cm::Event::for_test(ev::RDMA_CM_EVENT_DEVICE_REMOVAL, 0, 0, 0);
        assert!(matches!(
            cm_action(&e),
            CmAction::Fail {
                why: QpFailure::DeviceRemoved,
                answer: false
            }
        ));
        let e = cm::Event::for_test(ev::RDMA_CM_EVENT_CONNECT_ERROR, -110, 0, 0);
        match cm_action(&e) {
            CmAction::Fail { why, answer } => {
                assert!(!answer);
                assert!(
                    matches!(why, QpFailure::ConnectionFailed { status: -110, .. }),
                    "{why:?}"
                );
                assert!(why.to_string().contains("status -110"), "{why}");
            }
            other => panic!("{other:?}"),
        }
        for kind in [
            ev::RDMA_CM_EVENT_ESTABLISHED,
            ev::RDMA_CM_EVENT_TIMEWAIT_EXIT,
            ev::RDMA_CM_EVENT_ADDR_CHANGE,
        ] {
            assert!(matches!(
                cm_action(&cm::Event::for_test(kind, 0, 0, 0)),
                CmAction::Ignore
            ));
        }
    }
}
