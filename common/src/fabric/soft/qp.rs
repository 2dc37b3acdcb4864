//! The soft queue pair: requester and responder of one iWARP connection.
//!
//! Everything runs inside [`SoftQp::progress`] (called from completion-queue polling) and the
//! posting calls, under the queue pair's lock: read the socket, place or answer what arrived,
//! start what was posted (within ORD and fences), write what is queued, complete in order.
//! The engine is split in `engine` (shared state), `requester` and `responder`.

use std::collections::VecDeque;
use std::io::{ErrorKind, Read};
use std::net::{Shutdown, TcpStream};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::conn::{self, Negotiated};
use super::device::StagTable;
use super::engine::*;
use super::outbound::{Tx, TX_QUANTUM};
use super::placement::{Counting, Dirty};
use super::wire::rx::FpduReceiver;
use crate::fabric::completions::Completions;
use crate::fabric::counters::ResponderCounters;
use crate::fabric::error::{Error, QpFailure, Result};
use crate::fabric::params::{ConnInfo, ConnParams};
use crate::fabric::types::{Access, DomainId, QpCaps, QpState};
use crate::fabric::wait::Poller;
use crate::fabric::wr::{RecvWr, SendWr};

/// Whether a state may move to another (`ibv_modify_qp` rules, as far as RC uses them).
pub(crate) fn can_transition(from: QpState, to: QpState) -> bool {
    use QpState::*;
    matches!(
        (from, to),
        (Reset, Init)
            | (Init, Init)
            | (Init, Rtr)
            | (Rtr, Rts)
            | (Rts, Rts)
            | (_, Reset)
            | (_, Error)
    )
}

struct Core {
    conn: Option<Conn>,
    e: Engine,
}

/// What one [`SoftQp::progress`] pass did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Pass {
    /// Output is still waiting to be written, and the socket took all it was offered (one
    /// that took no more is not counted: its peer is not reading as fast).
    pub(crate) busy: bool,
    /// What arrived queued an answer (`Engine::receive`): the peer waits on us.
    pub(crate) answered: bool,
}

/// A soft queue pair. Shared by its handle and (weakly) by its completion queues.
pub(crate) struct SoftQp {
    pub(crate) num: u32,
    /// What the engine served as the responder; read without the queue pair's lock.
    pub(crate) counters: ResponderCounters,
    core: Mutex<Core>,
}

impl SoftQp {
    /// A queue pair in Init, of protection domain `domain` on the device whose STag table is
    /// `stags`, completing into `send_cq` and `recv_cq`.
    pub(crate) fn new(
        num: u32,
        domain: DomainId,
        stags: Arc<StagTable>,
        send_cq: Arc<Completions>,
        recv_cq: Arc<Completions>,
        caps: QpCaps,
    ) -> Arc<SoftQp> {
        let counters = ResponderCounters::new();
        let e = Engine {
            qp_num: num,
            domain,
            stags,
            send_cq,
            recv_cq,
            caps,
            state: QpState::Init,
            error: None,
            info: None,
            tx: Tx::new(false, 1024),
            closing: false,
            max_message: 1 << 30,
            sq: VecDeque::new(),
            next_seq: 0,
            next_issue: 0,
            in_flight: VecDeque::new(),
            ord: 1,
            send_msn: 1,
            rreq_msn: 1,
            next_req_id: 1,
            rq: VecDeque::new(),
            cur_recv: None,
            recv_msn: 1,
            rreq_expect: 1,
            resp_msn: 1,
            ird: 1,
            ird_used: 0,
            dirty: Dirty::default(),
            placing: None,
            refused_recv_status: None,
            counting: Counting::new(counters.clone()),
            rtr_pending: false,
            rx_held: false,
            rx_bytes: 0,
            fpdus_in: 0,
            flushing: None,
        };
        Arc::new(SoftQp {
            num,
            counters,
            core: Mutex::new(Core { conn: None, e }),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Core> {
        self.core.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn state(&self) -> QpState {
        self.lock().e.state
    }

    pub(crate) fn info(&self) -> ConnInfo {
        self.lock()
            .e
            .info
            .clone()
            .expect("a connected queue pair has its info")
    }

    pub(crate) fn error(&self) -> Option<QpFailure> {
        self.lock().e.error.clone()
    }

    pub(crate) fn check_rts(&self, op: &'static str) -> Result<()> {
        let st = self.state();
        if st != QpState::Rts {
            return Err(fail(self.num, st, op, QpState::Rts));
        }
        Ok(())
    }

    /// Init -> RTR -> RTS over a connected, handshaken stream. The caller then attaches the
    /// queue pair to its completion queues, whose polling drives it.
    pub(crate) fn start(
        &self,
        sock: TcpStream,
        neg: Negotiated,
        params: &ConnParams,
    ) -> Result<()> {
        let sockerr = |source| Error::Socket {
            op: "configure",
            addr: neg.info.peer_addr.to_string(),
            source,
        };
        sock.set_nonblocking(true).map_err(sockerr)?;
        sock.set_nodelay(true).map_err(sockerr)?;
        let mut c = self.lock();
        if !can_transition(c.e.state, QpState::Rtr) {
            return Err(fail(self.num, c.e.state, "connect", QpState::Init));
        }
        let e = &mut c.e;
        // RFC 5044: an FPDU should fit one TCP segment (MULPDU), whatever was asked for.
        let mulpdu = conn::mulpdu(&sock).unwrap_or(conn::DEFAULT_MAX_ULPDU);
        let max_ulpdu = neg.peer_max_ulpdu.min(params.tcp.max_ulpdu).min(mulpdu);
        e.tx = Tx::new(neg.crc, max_ulpdu);
        e.ord = neg.info.ord.max(1) as usize;
        e.ird = neg.info.ird.max(1) as usize;
        e.max_message = params.max_message;
        e.info = Some(neg.info.clone());
        e.rtr_pending = neg.rtr_write_expected;
        e.state = QpState::Rtr;
        e.state = QpState::Rts;
        c.conn = Some(Conn {
            draining: None,
            rx: FpduReceiver::new(neg.rx),
            sock,
            armed: smallvec::SmallVec::new(),
        });
        Ok(())
    }

    pub(crate) fn post_recv(&self, wr: RecvWr) -> Result<()> {
        let mut c = self.lock();
        let e = &mut c.e;
        if matches!(e.state, QpState::Reset | QpState::Error) {
            return Err(fail(self.num, e.state, "post_recv", QpState::Rts));
        }
        if e.rq.len() + e.cur_recv.is_some() as usize >= e.caps.max_recv_wr {
            return Err(Error::QueueFull {
                qp_num: self.num,
                queue: "receive",
                depth: e.caps.max_recv_wr,
            });
        }
        if let Some(s) = &wr.local {
            e.check_sge(s, Access::LOCAL_WRITE)?;
        }
        e.rq.push_back(RqEntry {
            wr_id: wr.wr_id,
            local: wr.local,
        });
        Ok(())
    }

    pub(crate) fn post_send(&self, wr: SendWr) -> Result<()> {
        self.post_sends(&mut [Some(wr)])
    }

    /// Posts every request of `wrs` (all `Some`) or none, then rings the doorbell once: one
    /// `writev` carries them all as far as ORD and fences let them start.
    pub(crate) fn post_sends(&self, wrs: &mut [Option<SendWr>]) -> Result<()> {
        let mut c = self.lock();
        for wr in wrs.iter().flatten() {
            c.e.validate(wr)?;
        }
        let e = &mut c.e;
        if e.sq.len() + wrs.len() > e.caps.max_send_wr {
            return Err(Error::QueueFull {
                qp_num: self.num,
                queue: "send",
                depth: e.caps.max_send_wr,
            });
        }
        for wr in wrs.iter_mut().filter_map(Option::take) {
            e.enqueue(wr);
        }
        // Ring the doorbell: start them and write what the socket takes now.
        let Core { conn, e } = &mut *c;
        e.issue();
        if let Some(conn) = conn.as_mut() {
            e.write(conn, TX_QUANTUM);
        }
        e.complete_in_order();
        Ok(())
    }

    /// One round of progress: receive, answer, issue, send (at most `share` bytes), complete.
    pub(crate) fn progress(&self, share: usize) -> Pass {
        let mut c = self.lock();
        let Core { conn, e } = &mut *c;
        let Some(cn) = conn.as_mut() else {
            return Pass::default();
        };
        let mut answered = false;
        if e.state == QpState::Rts {
            answered = e.receive(cn);
            crate::steps::step("receive pass done");
            e.issue();
            crate::steps::step("issued");
        }
        e.write(cn, share);
        e.complete_in_order();
        if e.state == QpState::Error && (!e.tx.pending() || !e.closing) && drain(cn) {
            *conn = None;
        }
        // Output its socket would not take (a peer that stopped reading) is not a share of
        // the next pass: counted, a few such peers shrank every other queue pair's share to
        // MIN_QUANTUM.
        Pass {
            busy: e.tx.pending() && !e.tx.blocked(),
            answered,
        }
    }

    /// Registers the socket with `poller` and arms writability if output waits. Returns whether
    /// input is buffered that the last progress call left (`Engine::rx_held`): the socket will
    /// not wake the wait for it, so the caller must not block.
    pub(crate) fn arm(&self, poller: &Poller) -> Result<bool> {
        use std::os::fd::AsFd;
        let mut c = self.lock();
        let want_write = c.e.tx.pending();
        let held = c.e.rx_held && c.e.state == QpState::Rts;
        let key = poller as *const Poller as usize;
        let Some(cn) = c.conn.as_mut() else {
            return Ok(false);
        };
        match cn.armed.iter_mut().find(|(k, _)| *k == key) {
            None => {
                poller.add(cn.sock.as_fd(), self.num as u64, want_write)?;
                cn.armed.push((key, want_write));
            }
            Some((_, w)) if *w != want_write => {
                poller.set_write(cn.sock.as_fd(), self.num as u64, want_write)?;
                *w = want_write;
            }
            Some(_) => {}
        }
        Ok(held)
    }

    /// FPDUs taken from the peer so far (every message: one-sided Writes and Read Requests
    /// too, which this engine serves in the thread that polls it).
    pub(crate) fn fpdus_received(&self) -> u64 {
        self.lock().e.fpdus_in
    }

    pub(crate) fn to_error(&self, why: QpFailure) {
        let mut c = self.lock();
        let Core { conn, e } = &mut *c;
        e.enter_error(why, None);
        e.complete_in_order();
        if let Some(cn) = conn.take() {
            let _ = cn.sock.shutdown(Shutdown::Both);
        }
    }

    /// The handle is gone: close the connection, flush what is left.
    pub(crate) fn close(&self) {
        self.to_error(QpFailure::Dropped);
    }
}

/// How long a queue pair in Error keeps reading what its peer still sends before it closes.
const DRAIN_TIME: Duration = Duration::from_secs(2);

/// Half-closes a connection whose last bytes (a Terminate, if any) are out and drops what the
/// peer still sends. Returns whether the connection can now be closed.
fn drain(cn: &mut Conn) -> bool {
    let deadline = *cn.draining.get_or_insert_with(|| {
        let _ = cn.sock.shutdown(Shutdown::Write);
        Instant::now() + DRAIN_TIME
    });
    drain_until(&mut cn.sock, deadline)
}

/// Reads and drops from `sock` until it reports end of stream (true), an error (true), or would
/// block (whether `deadline` has passed). The deadline is checked on every turn: a peer that
/// keeps sending cannot pin the caller here.
fn drain_until(mut sock: impl Read, deadline: Instant) -> bool {
    let mut buf = [0u8; 4096];
    loop {
        match sock.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) | Err(_) if Instant::now() >= deadline => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) if e.kind() == ErrorKind::WouldBlock => return false,
            Err(_) => return true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A peer that never stops sending: every read returns data.
    struct Flood(usize);
    impl Read for Flood {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            self.0 += 1;
            buf.fill(0xEE);
            Ok(buf.len())
        }
    }

    #[test]
    fn draining_a_flooding_peer_stops_at_the_deadline() {
        let mut flood = Flood(0);
        let deadline = Instant::now() + Duration::from_millis(50);
        assert!(
            drain_until(&mut flood, deadline),
            "gives up at the deadline"
        );
        assert!(Instant::now() >= deadline);
        assert!(flood.0 > 1, "it did drain until then");
        // A deadline already passed: one read, then done.
        let mut flood = Flood(0);
        assert!(drain_until(&mut flood, Instant::now()));
        assert_eq!(flood.0, 1);
    }

    #[test]
    fn draining_stops_at_end_of_stream_and_waits_on_would_block() {
        let far = Instant::now() + Duration::from_secs(60);
        assert!(drain_until(&b"some bytes"[..], far), "EOF after the bytes");
        struct Blocked;
        impl Read for Blocked {
            fn read(&mut self, _: &mut [u8]) -> std::io::Result<usize> {
                Err(ErrorKind::WouldBlock.into())
            }
        }
        assert!(
            !drain_until(Blocked, far),
            "not yet: the peer may still close"
        );
        assert!(drain_until(Blocked, Instant::now()), "past the deadline");
    }

    #[test]
    fn state_machine_follows_verbs() {
        use QpState::*;
        assert!(can_transition(Reset, Init));
        assert!(can_transition(Init, Rtr));
        assert!(can_transition(Rtr, Rts));
        assert!(can_transition(Rts, Error));
        assert!(can_transition(Error, Reset));
        assert!(!can_transition(Reset, Rts));
        assert!(!can_transition(Init, Rts));
        assert!(!can_transition(Error, Rts));
        assert!(!can_transition(Rts, Rtr));
    }
}
