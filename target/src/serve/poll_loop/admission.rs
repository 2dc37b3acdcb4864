//! A poll loop's part in admitting hosts: taking in a new connection, and the registrations
//! its connections ask for, which go to its registrar's threads ([`crate::serve::registrar`])
//! and come back to them, so that pinning a big namespace for one host does not hold the
//! loop's other sessions.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rpma_common::fabric::{ConnParams, ConnRequest, QpCaps, TcpParams};
use rpma_common::proto::msgbuf::MsgBufs;

use super::PollLoop;
use crate::serve::budget::Ticket;
use crate::serve::conn::{Conn, CONTROL_RECV_SLOTS, CONTROL_SEND_SLOTS, RECV_SLACK, SEND_SLOTS};
use crate::serve::registrar::{Registrar, Registration, Released};
use crate::serve::session::Grant;

impl PollLoop {
    /// A connection request rejected before anything was made for it (`why`, for the log).
    fn reject(&mut self, req: ConnRequest, why: &str) {
        log::debug!("loop {}: a connection request {why}: rejected", self.index);
        req.reject(b"");
        self.load.fetch_sub(1, Ordering::Relaxed);
    }

    /// Takes in a new connection with its place in the unadmitted pool: its queue pair,
    /// domain and control slots, accepted on the loop's completion queue.
    pub(super) fn accept(&mut self, req: ConnRequest, ticket: Ticket) {
        if ticket.evicted() {
            // Its place went to a newer connection while it waited for this loop: nothing is
            // made for it (a flood of requests made a queue pair, its buffers and an accept
            // each, all closed again at the next tick).
            return self.reject(req, "whose place was taken meanwhile");
        }
        let Some(ctx) = self.device() else {
            // Its device was lost meanwhile (or a completion queue cannot be made on the one
            // that is back).
            return self.reject(req, "while the device is lost");
        };
        let cfg = self.shared.config();
        let peer = req.peer_addr();
        // The depth granted now stays this connection's, whatever a reload changes later.
        let granted = cfg.max_queue_depth;
        let depth = granted as usize + RECV_SLACK;
        let handshake = Duration::from_millis(u64::from(cfg.admission.handshake_timeout_ms));
        let serial = self.next_serial;
        self.next_serial += 1;
        let params = ConnParams {
            timeout: handshake,
            tcp: TcpParams {
                crc: cfg.crc,
                ..TcpParams::default()
            },
            ..ConnParams::default()
        };
        let made = (|| {
            let pd = ctx.alloc_pd()?;
            let caps = QpCaps {
                max_send_wr: SEND_SLOTS,
                max_recv_wr: depth.max(CONTROL_RECV_SLOTS),
            };
            let prepared = pd.create_qp(&self.cq, &self.cq, caps)?;
            // Only what the control exchange needs until admission (docs/operations.md,
            // "Memory"); the session's slots come with its ConnectResponse.
            let bufs = MsgBufs::new(&pd, CONTROL_RECV_SLOTS, CONTROL_SEND_SLOTS)?;
            for slot in 0..bufs.recv_slots() {
                prepared.post_recv(bufs.recv_wr(slot))?;
            }
            let qp = req.accept(prepared, &params, &[])?;
            Ok::<_, rpma_common::fabric::Error>(Conn::new(
                &self.shared,
                qp,
                pd,
                bufs,
                ticket,
                self.own.clone(),
                granted,
                serial,
                Instant::now() + handshake,
                Arc::clone(&self.stats),
            ))
        })();
        match made {
            Ok(conn) => {
                log::debug!("loop {}: connection from {}", self.index, conn.peer);
                if let Some(old) = self.conns.insert(conn.qp.qp_num(), conn) {
                    // A connection on a device that went away, whose queue pair number the
                    // device back in its place gave again before a tick dropped it: over, and
                    // gone as a tick would drop it.
                    self.registrar.discard(old.into_release());
                    self.load.fetch_sub(1, Ordering::Relaxed);
                }
            }
            Err(e) => {
                // Mostly a bad MPA Request (unauthenticated): rate-limited per address.
                let text = rpma_common::error_chain(&e);
                match peer {
                    Some(p) => self.shared.peer_log.warn(
                        p.ip(),
                        format_args!("cannot accept the connection from {p}: {text}"),
                    ),
                    None => log::warn!("cannot accept a connection: {text}"),
                }
                self.load.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }

    /// Sends what connection `conn` (queue pair `qp_num`) asks to have registered, and its
    /// ended session's registrations to drop, if any, to the loop's registrar; `replaced`,
    /// registrations of its own it no longer keeps, go with a registration it asks for again (to
    /// be dropped before it is made), else to be dropped.
    pub(super) fn ask_registrar(
        registrar: &mut Registrar,
        conn: &mut Conn,
        qp_num: u32,
        replaced: Vec<Grant>,
    ) {
        match conn.take_registration() {
            Some(mut req) => {
                req.replaced = replaced;
                registrar.register(req, qp_num, conn.serial);
            }
            None => registrar.discard(replaced),
        }
        let ended = conn.take_release();
        if !ended.is_empty() {
            registrar.release(ended, qp_num, conn.serial);
        }
    }

    /// Hands the registrations that are done to their connections (those no connection takes
    /// go back to the registrar to be dropped), and tells those whose ended session's
    /// registrations were dropped (their Disconnect goes out).
    pub(super) fn take_registrations(&mut self) {
        let released: Vec<Released> = self.registrar.take_released().collect();
        for r in released {
            if let Some(conn) = self
                .conns
                .get_mut(&r.qp_num)
                .filter(|c| c.serial == r.serial)
            {
                conn.released();
                self.failed |= conn.overrun();
            }
        }
        let done: Vec<Registration> = self.registrar.take().collect();
        for r in done {
            let Some(conn) = self
                .conns
                .get_mut(&r.qp_num)
                .filter(|c| c.serial == r.serial)
            else {
                let grants = Registrar::granted(r.outcomes);
                self.registrar.discard(grants);
                continue;
            };
            // What it does not keep is dropped; first, by the registering thread, when it asks
            // for a registration again (the namespaces changed meanwhile).
            let left = conn.registered(r.outcomes);
            Self::ask_registrar(&mut self.registrar, conn, r.qp_num, left);
            // A refusal is sent; an admission too: the connection may have more to do.
            self.failed |= conn.overrun();
        }
    }
}
