//! Connection set-up of the rdma transport, for a queue pair that already exists (in Init,
//! its receives posted): the active side resolves the address and route, moves the queue
//! pair's Init attributes to the route's port, connects, and on the connect response moves to
//! RTR and RTS and tells the passive side (rdma_establish); the passive side moves to RTR and
//! RTS with the negotiated depths and accepts. Later rdma_cm events of the connection (the
//! peer's disconnect) move the queue pair to Error.
//!
//! The private data each way is this transport's capability block and the application's
//! bytes (`translate::caps`); IB CM has room for 52 application bytes in a connect, 192 in an
//! accept, 144 in a reject. The control exchange itself (NQNs, keys, descriptors) runs over
//! Send/Recv once connected, as on `tcp`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use rdma_sys::{ibv_qp_state, rdma_cm_event_type as ev};

use super::cm::{self, CmId, Conn, EventChannel, Param, Pending};
use super::qp::Qp;
use super::translate::caps;
use crate::fabric::error::{Error, Result};
use crate::fabric::qp::{ConnInfo, ConnParams};
use crate::fabric::types::QpState;
use crate::fabric::url::Url;

/// IB CM's reject reason for a consumer's own reject (`IB_CM_REJ_CONSUMER_DEFINED`).
const CONSUMER_REJECT: i32 = 28;

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
        let c = self.dev.caps();
        let responder = params.ird.min(u16::from(c.max_qp_rd_atom)) as u8;
        let initiator = params.ord.min(u16::from(c.max_qp_init_rd_atom)) as u8;
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
        // SAFETY: as for Init.
        unsafe {
            id.move_qp(self.raw.as_ptr(), ibv_qp_state::IBV_QPS_RTR, None, None)?;
            id.move_qp(self.raw.as_ptr(), ibv_qp_state::IBV_QPS_RTS, None, None)?;
        }
        id.establish()?;
        let info = ConnInfo {
            ird: u16::from(responder.min(e.initiator_depth)),
            ord: u16::from(initiator.min(e.responder_resources)),
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
        let c = self.dev.caps();
        let responder = params
            .ird
            .min(u16::from(c.max_qp_rd_atom))
            .min(u16::from(p.peer_initiator)) as u8;
        let initiator = params
            .ord
            .min(u16::from(c.max_qp_init_rd_atom))
            .min(u16::from(p.peer_responder)) as u8;
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
            self.enter_error(
                &mut core,
                format!("accept failed: {}", crate::error_chain(&e)),
            );
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

    /// Reads this connection's rdma_cm events (non-blocking): a disconnect, or a connection
    /// that failed after the accept, moves the queue pair to Error.
    pub(crate) fn handle_cm_events(&self) {
        let mut c = self.lock();
        loop {
            let Some(cm) = c.cm.as_ref() else { return };
            let e = match cm::next_event(&cm.channel) {
                Ok(Some(e)) => e,
                Ok(None) | Err(_) => return,
            };
            let why = match e.kind {
                ev::RDMA_CM_EVENT_DISCONNECTED => "the peer disconnected".to_owned(),
                ev::RDMA_CM_EVENT_DEVICE_REMOVAL => "the RDMA device was removed".to_owned(),
                ev::RDMA_CM_EVENT_REJECTED
                | ev::RDMA_CM_EVENT_UNREACHABLE
                | ev::RDMA_CM_EVENT_CONNECT_ERROR => {
                    format!("the connection failed: {} (status {})", e.name(), e.status)
                }
                // Established, time-wait exit, address changes: nothing to do.
                _ => continue,
            };
            self.enter_error(&mut c, why);
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
