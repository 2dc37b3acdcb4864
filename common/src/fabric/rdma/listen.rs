//! The passive side of rdma_cm: a listening id, and the connection requests it takes (each
//! moved to an event channel of its own), accepted by the queue pair (`link.rs`) or rejected.

use std::net::SocketAddr;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use rdma_sys::rdma_cm_event_type as ev;

use super::cm::{next_event, wait_readable, CmId, Conn, Event, EventChannel};
use super::device::Device;
use super::translate::caps;
use crate::fabric::error::{Error, QpFailure, Result};
use crate::fabric::url::{Scheme, Url};

/// A listening rdma_cm id.
pub(crate) struct Listen {
    conn: Conn,
    url: Url,
    /// The parent: keeps the context open while the listener is.
    dev: Device,
    blocking: AtomicBool,
}

/// How many connection requests the CM queues for a listener.
const BACKLOG: i32 = 128;

impl Listen {
    pub(crate) fn bind(dev: &Device, url: &Url) -> Result<Listen> {
        let addrs = url.socket_addrs()?;
        let addr = addrs[0];
        let channel = EventChannel::new()?;
        let id = CmId::new(&channel)?;
        id.bind(&addr)?;
        let verbs = id.verbs();
        if !verbs.is_null() && !dev.same(verbs) {
            return Err(Error::NoSuchDevice {
                wanted: format!("for {url}"),
                reason: format!(
                    "the address is on another RDMA device than this context's {}",
                    dev.inner.name
                ),
            });
        }
        // SAFETY: the id is bound.
        if unsafe { rdma_sys::rdma_listen(id.raw(), BACKLOG) } != 0 {
            return Err(Error::Socket {
                op: "listen",
                addr: addr.to_string(),
                source: std::io::Error::last_os_error(),
            });
        }
        let url = Url {
            scheme: Scheme::Rdma,
            host: addr.ip().to_string(),
            port: id.src_port(),
        };
        Ok(Listen {
            conn: Conn { id, channel },
            url,
            dev: dev.clone(),
            blocking: AtomicBool::new(true),
        })
    }

    pub(crate) fn url(&self) -> Url {
        self.url.clone()
    }

    pub(crate) fn set_nonblocking(&self, on: bool) -> Result<()> {
        self.blocking.store(!on, Ordering::Relaxed);
        Ok(())
    }

    /// Waits for the next connection request (or returns at once when non-blocking). As on
    /// `tcp`, the wait for a connection has no time limit: the fabric's timeout bounds reading
    /// the peer's request once its connection is there, and an rdma_cm request arrives whole,
    /// its private data in the event.
    pub(crate) fn accept(&self, _timeout: Duration) -> Result<Pending> {
        loop {
            if let Some(p) = self.accept_incoming()? {
                return p.check();
            }
            if !self.blocking.load(Ordering::Relaxed) {
                return Err(Error::Socket {
                    op: "accept",
                    addr: self.url.to_string(),
                    source: std::io::ErrorKind::WouldBlock.into(),
                });
            }
        }
    }

    /// The next connection request, None if the listener is non-blocking and none waits.
    /// Other events of the listening id (an address change) are read and dropped: they end
    /// no connection of this id's. The device's removal (or its failure, seen elsewhere) ends
    /// the listener: [`Error::DeviceLost`], for good (the owner drops it, which destroys the
    /// id as rdma_cm asks, and listens again on the device when it is back).
    pub(crate) fn accept_incoming(&self) -> Result<Option<Pending>> {
        let lost = || Error::DeviceLost {
            device: self.dev.inner.name.clone(),
        };
        loop {
            if self.dev.is_lost() {
                return Err(lost());
            }
            match next_event(&self.conn.channel)? {
                Some(e) if e.kind == ev::RDMA_CM_EVENT_DEVICE_REMOVAL => {
                    self.dev.lose(QpFailure::DeviceRemoved);
                    return Err(lost());
                }
                Some(mut e) if e.kind == ev::RDMA_CM_EVENT_CONNECT_REQUEST => {
                    let Some(req) = e.request.take() else {
                        continue;
                    };
                    let conn = req.adopt()?;
                    return Ok(Some(Pending::new(conn, &e)));
                }
                Some(_) => continue,
                None if self.blocking.load(Ordering::Relaxed) => {
                    wait_readable(self.conn.channel.as_fd(), None)?;
                }
                None => return Ok(None),
            }
        }
    }

    pub(crate) fn as_fd(&self) -> BorrowedFd<'_> {
        self.conn.channel.as_fd()
    }
}

/// A connection request: its id (on a channel of its own) and what the peer sent.
pub(crate) struct Pending {
    pub(crate) conn: Conn,
    pub(crate) peer: SocketAddr,
    pub(crate) local: SocketAddr,
    app: Vec<u8>,
    /// The peer's capability flags (`caps::*`).
    pub(crate) peer_flags: u8,
    /// Reads/atomics the peer serves at once, its IRD (bounds this side's ORD).
    pub(crate) peer_ird: u8,
    /// Reads/atomics the peer keeps in flight, its ORD (bounds this side's IRD).
    pub(crate) peer_ord: u8,
    /// Why the request cannot be served (its private data is not this transport's).
    problem: Option<&'static str>,
}

fn unspecified() -> SocketAddr {
    SocketAddr::from(([0, 0, 0, 0], 0))
}

impl Pending {
    fn new(conn: Conn, e: &Event) -> Pending {
        let (peer_flags, app, problem) = match caps::decode(&e.private) {
            Ok((flags, app)) => (flags, app.to_vec(), None),
            Err(why) => (0, Vec::new(), Some(why)),
        };
        let (peer_ord, peer_ird) = e.peer_depths();
        Pending {
            peer: conn.id.peer_addr().unwrap_or_else(unspecified),
            local: conn.id.local_addr().unwrap_or_else(unspecified),
            conn,
            app,
            peer_flags,
            peer_ird,
            peer_ord,
            problem,
        }
    }

    /// The request, or (rejected) the reason it cannot be served.
    pub(crate) fn check(self) -> Result<Pending> {
        match self.problem {
            None => Ok(self),
            Some(reason) => {
                let peer = self.peer;
                self.reject(&[]);
                Err(Error::Handshake {
                    peer: peer.to_string(),
                    reason: reason.to_owned(),
                    source: None,
                })
            }
        }
    }

    pub(crate) fn private_data(&self) -> &[u8] {
        &self.app
    }

    pub(crate) fn peer_addr(&self) -> SocketAddr {
        self.peer
    }

    pub(crate) fn as_fd(&self) -> BorrowedFd<'_> {
        self.conn.channel.as_fd()
    }

    /// Rejects with `data` for the peer (cut to the room a REJ has after the block).
    pub(crate) fn reject(self, data: &[u8]) {
        let room = caps::REJ_ROOM - caps::LEN;
        let block =
            caps::encode(0, &data[..data.len().min(room)], caps::REJ_ROOM).unwrap_or_default();
        self.conn.id.reject(&block);
    }
}
