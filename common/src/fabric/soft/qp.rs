//! The soft queue pair: requester and responder of one iWARP connection.
//!
//! Everything runs inside [`SoftQp::progress`] (called from completion-queue polling) and the
//! posting calls, under the queue pair's lock: read the socket, place or answer what arrived,
//! start what was posted (within ORD and fences), write what is queued, complete in order.

use std::collections::VecDeque;
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::fabric::context::Context;
use crate::fabric::cq::CompletionQueue;
use crate::fabric::error::{Error, Result};
use crate::fabric::pd::ProtectionDomain;
use crate::fabric::qp::{ConnInfo, ConnParams};
use crate::fabric::soft::conn::Negotiated;
use crate::fabric::soft::placement::{self, Dirty};
use crate::fabric::soft::poll::Poller;
use crate::fabric::soft::rx::{self, Rx};
use crate::fabric::soft::tx::{OnSent, Src, Tx, TxMsg};
use crate::fabric::soft::wire::rdmap::{
    AtomicOp, AtomicRequest, AtomicResponse, AtomicWriteRequest, Body, FlushPlacement,
    FlushRequest, FlushSelectivity, PrivateResponse, ReadRequest,
};
use crate::fabric::soft::wire::{Header, HeaderKind, Opcode, TermCause, Terminate};
use crate::fabric::types::{
    Access, Completion, FlushTarget, FlushType, QpCaps, QpState, RecvWr, SendFlags, SendOp, SendWr,
    Sge, WcOpcode, WcStatus,
};

/// How many FPDUs one progress call handles before it lets other queue pairs run.
const RX_BUDGET: usize = 256;

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

/// What a send-queue entry still needs from the wire.
enum Pending {
    /// Not started: the operation as posted.
    Unissued(SendOp),
    /// Handed to tx; completes when written (Write, Send).
    Sending,
    /// Waiting for a Read Response into `sink`.
    Read { sink: Sge, got: usize },
    /// Waiting for an Atomic Response; the original value goes to `result`.
    Atomic { req_id: u32, result: Sge },
    /// Waiting for the private response to a Flush or Atomic Write.
    Private { req_id: u32, request: Opcode },
    /// Done.
    Done,
}

struct SqEntry {
    seq: u64,
    wr_id: u64,
    opcode: WcOpcode,
    flags: SendFlags,
    byte_len: u32,
    status: Option<WcStatus>,
    pending: Pending,
}

struct RqEntry {
    wr_id: u64,
    local: Option<Sge>,
}

/// The Send being received (its segments share one MSN).
struct CurRecv {
    entry: RqEntry,
    msn: u32,
    placed: usize,
}

/// A fatal condition found while placing, to be answered with a Terminate once the FPDU is in.
struct Fault {
    cause: TermCause,
    hdr: Header,
    ulpdu_len: usize,
    recv_status: Option<WcStatus>,
}

pub(crate) struct Engine {
    qp_num: u32,
    pd: u32,
    ctx: Context,
    send_cq: CompletionQueue,
    recv_cq: CompletionQueue,
    caps: QpCaps,
    state: QpState,
    error: Option<String>,
    info: Option<ConnInfo>,
    tx: Tx,
    closing: bool,
    max_message: usize,
    // Requester.
    sq: VecDeque<SqEntry>,
    next_seq: u64,
    next_issue: u64,
    in_flight: VecDeque<u64>,
    ord: usize,
    send_msn: u32,
    rreq_msn: u32,
    next_req_id: u32,
    // Responder.
    rq: VecDeque<RqEntry>,
    cur_recv: Option<CurRecv>,
    recv_msn: u32,
    rreq_expect: u32,
    resp_msn: u32,
    ird: usize,
    ird_used: usize,
    dirty: Dirty,
    fault: Option<Fault>,
}

struct Conn {
    sock: TcpStream,
    rx: Rx,
    /// Pollers this socket is registered with, and whether writability is armed there.
    armed: Vec<(usize, bool)>,
}

struct Core {
    conn: Option<Conn>,
    e: Engine,
}

/// A soft queue pair. Shared by its handle and (weakly) by its completion queues.
pub(crate) struct SoftQp {
    pub(crate) num: u32,
    pub(crate) pd: ProtectionDomain,
    core: Mutex<Core>,
}

fn fail(qp_num: u32, state: QpState, op: &'static str, needed: QpState) -> Error {
    Error::InvalidState {
        qp_num,
        state,
        op,
        needed,
    }
}

impl SoftQp {
    pub(crate) fn new(
        num: u32,
        pd: ProtectionDomain,
        send_cq: CompletionQueue,
        recv_cq: CompletionQueue,
        caps: QpCaps,
    ) -> Arc<SoftQp> {
        let e = Engine {
            qp_num: num,
            pd: pd.inner.id,
            ctx: pd.context().clone(),
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
            fault: None,
        };
        Arc::new(SoftQp {
            num,
            pd,
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

    pub(crate) fn error(&self) -> Option<String> {
        self.lock().e.error.clone()
    }

    pub(crate) fn check_rts(&self, op: &'static str) -> Result<()> {
        let st = self.state();
        if st != QpState::Rts {
            return Err(fail(self.num, st, op, QpState::Rts));
        }
        Ok(())
    }

    /// Init -> RTR -> RTS over a connected, handshaken stream.
    pub(crate) fn start(
        self: &Arc<Self>,
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
        e.tx = Tx::new(neg.info.crc, neg.peer_max_ulpdu.min(params.max_ulpdu));
        e.ord = neg.info.ord.max(1) as usize;
        e.ird = neg.info.ird.max(1) as usize;
        e.max_message = params.max_message;
        e.info = Some(neg.info.clone());
        e.state = QpState::Rtr;
        e.state = QpState::Rts;
        c.conn = Some(Conn {
            rx: Rx::new(neg.info.crc, rx::MAX_ULPDU),
            sock,
            armed: Vec::new(),
        });
        let (scq, rcq) = (c.e.send_cq.clone(), c.e.recv_cq.clone());
        drop(c);
        scq.attach(self);
        rcq.attach(self);
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
        let mut c = self.lock();
        c.e.validate(&wr)?;
        let e = &mut c.e;
        if e.sq.len() >= e.caps.max_send_wr {
            return Err(Error::QueueFull {
                qp_num: self.num,
                queue: "send",
                depth: e.caps.max_send_wr,
            });
        }
        let opcode = match &wr.op {
            SendOp::Write { .. } | SendOp::WriteWithImm { .. } => WcOpcode::RdmaWrite,
            SendOp::Read { .. } => WcOpcode::RdmaRead,
            SendOp::Send { .. } | SendOp::SendWithInvalidate { .. } => WcOpcode::Send,
            SendOp::CompareSwap { .. } => WcOpcode::CompSwap,
            SendOp::FetchAdd { .. } => WcOpcode::FetchAdd,
            SendOp::AtomicWrite { .. } => WcOpcode::AtomicWrite,
            SendOp::Flush { .. } => WcOpcode::Flush,
        };
        let byte_len = match &wr.op {
            SendOp::Write { local, .. }
            | SendOp::WriteWithImm { local, .. }
            | SendOp::Read { local, .. }
            | SendOp::Send { local }
            | SendOp::SendWithInvalidate { local, .. } => local.len as u32,
            SendOp::CompareSwap { .. } | SendOp::FetchAdd { .. } | SendOp::AtomicWrite { .. } => 8,
            SendOp::Flush { .. } => 0,
        };
        let seq = e.next_seq;
        e.next_seq += 1;
        e.sq.push_back(SqEntry {
            seq,
            wr_id: wr.wr_id,
            opcode,
            flags: wr.flags,
            byte_len,
            status: None,
            pending: Pending::Unissued(wr.op),
        });
        // Ring the doorbell: start it and write what the socket takes now.
        let Core { conn, e } = &mut *c;
        e.issue();
        if let Some(conn) = conn.as_mut() {
            e.write(conn);
        }
        e.complete_in_order();
        Ok(())
    }

    /// One round of progress: receive, answer, issue, send, complete.
    pub(crate) fn progress(&self) {
        let mut c = self.lock();
        let Core { conn, e } = &mut *c;
        let Some(cn) = conn.as_mut() else { return };
        if e.state == QpState::Rts {
            e.receive(cn);
            e.issue();
        }
        e.write(cn);
        e.complete_in_order();
        if e.state == QpState::Error && (!e.tx.pending() || !e.closing) {
            // The Terminate (if any) is out: close the connection.
            let _ = cn.sock.shutdown(Shutdown::Both);
            *conn = None;
        }
    }

    /// Registers the socket with `poller` and arms writability if output waits.
    pub(crate) fn arm(&self, poller: &Poller) -> Result<()> {
        use std::os::fd::AsFd;
        let mut c = self.lock();
        let want_write = c.e.tx.pending();
        let key = poller as *const Poller as usize;
        let Some(cn) = c.conn.as_mut() else {
            return Ok(());
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
        Ok(())
    }

    pub(crate) fn to_error(&self, why: &str) {
        let mut c = self.lock();
        let Core { conn, e } = &mut *c;
        e.enter_error(why.to_owned(), None);
        e.complete_in_order();
        if let Some(cn) = conn.take() {
            let _ = cn.sock.shutdown(Shutdown::Both);
        }
    }

    /// The handle is gone: close the connection, flush what is left.
    pub(crate) fn close(&self) {
        self.to_error("queue pair dropped");
    }
}

impl Engine {
    fn check_sge(&self, s: &Sge, need: Access) -> Result<()> {
        if s.mr.pd().inner.id != self.pd || !s.mr.pd().context().same(&self.ctx) {
            return Err(Error::WrongDomain {
                what: "memory region",
            });
        }
        s.mr.check_local(s.offset, s.len, need)
    }

    fn peer_has(&self, what: impl Fn(&ConnInfo) -> bool, op: &'static str) -> Result<()> {
        match &self.info {
            Some(i) if what(i) => Ok(()),
            _ => Err(Error::PeerUnsupported { op }),
        }
    }

    fn validate(&self, wr: &SendWr) -> Result<()> {
        if self.state != QpState::Rts {
            return Err(fail(self.qp_num, self.state, "post_send", QpState::Rts));
        }
        let too_big = |s: &Sge| s.len > self.max_message || s.len > u32::MAX as usize;
        let aligned = |addr: u64| addr % 8 == 0;
        match &wr.op {
            SendOp::Write { local, .. }
            | SendOp::Send { local }
            | SendOp::SendWithInvalidate { local, .. } => {
                self.check_sge(local, Access::empty())?;
                if too_big(local) {
                    return Err(Error::InvalidWorkRequest {
                        reason: "message larger than max_message",
                    });
                }
            }
            SendOp::WriteWithImm { local, .. } => {
                self.check_sge(local, Access::empty())?;
                if too_big(local) {
                    return Err(Error::InvalidWorkRequest {
                        reason: "message larger than max_message",
                    });
                }
                self.peer_has(|i| i.peer_atomics, "Immediate Data (RFC 7306)")?;
            }
            SendOp::Read { local, .. } => {
                self.check_sge(local, Access::LOCAL_WRITE)?;
                if too_big(local) {
                    return Err(Error::InvalidWorkRequest {
                        reason: "message larger than max_message",
                    });
                }
            }
            SendOp::CompareSwap { local, remote, .. } | SendOp::FetchAdd { local, remote, .. } => {
                self.check_sge(local, Access::LOCAL_WRITE)?;
                if local.len != 8 {
                    return Err(Error::InvalidWorkRequest {
                        reason: "atomic result buffer must be 8 bytes",
                    });
                }
                if !aligned(remote.addr) {
                    return Err(Error::InvalidWorkRequest {
                        reason: "atomic target must be 8-byte aligned",
                    });
                }
                self.peer_has(|i| i.peer_atomics, "atomics (RFC 7306)")?;
            }
            SendOp::AtomicWrite { remote, .. } => {
                if !aligned(remote.addr) {
                    return Err(Error::InvalidWorkRequest {
                        reason: "atomic write target must be 8-byte aligned",
                    });
                }
                self.peer_has(|i| i.peer_atomic_write, "Atomic Write")?;
            }
            SendOp::Flush { .. } => self.peer_has(|i| i.peer_flush, "Flush")?,
        }
        if wr.flags.contains(SendFlags::SOLICITED)
            && !matches!(
                wr.op,
                SendOp::Send { .. } | SendOp::SendWithInvalidate { .. }
            )
        {
            return Err(Error::InvalidWorkRequest {
                reason: "solicited event only on Send",
            });
        }
        Ok(())
    }

    fn entry_mut(&mut self, seq: u64) -> Option<&mut SqEntry> {
        let front = self.sq.front()?.seq;
        self.sq.get_mut(seq.checked_sub(front)? as usize)
    }

    /// Starts posted requests in order, as far as ORD and fences allow.
    fn issue(&mut self) {
        if self.state != QpState::Rts {
            return;
        }
        while self.next_issue < self.next_seq {
            let seq = self.next_issue;
            let ord_full = self.in_flight.len() >= self.ord;
            let busy = !self.in_flight.is_empty();
            let Some(ent) = self.entry_mut(seq) else {
                return;
            };
            let needs_resp = matches!(
                &ent.pending,
                Pending::Unissued(
                    SendOp::Read { .. }
                        | SendOp::CompareSwap { .. }
                        | SendOp::FetchAdd { .. }
                        | SendOp::AtomicWrite { .. }
                        | SendOp::Flush { .. }
                )
            );
            if (needs_resp && ord_full) || (ent.flags.contains(SendFlags::FENCE) && busy) {
                return;
            }
            let Pending::Unissued(op) = std::mem::replace(&mut ent.pending, Pending::Sending)
            else {
                self.next_issue += 1;
                continue;
            };
            let solicited = ent.flags.contains(SendFlags::SOLICITED);
            self.next_issue += 1;
            self.start_op(seq, op, solicited);
        }
    }

    fn mem(s: &Sge) -> Src {
        Src::Mem {
            region: Arc::clone(s.mr.region()),
            offset: s.offset,
        }
    }

    fn req_id(&mut self) -> u32 {
        let id = self.next_req_id;
        self.next_req_id = self.next_req_id.wrapping_add(1);
        id
    }

    fn untagged(&mut self, opcode: Opcode) -> Header {
        let msn = match opcode.queue() {
            Some(0) => &mut self.send_msn,
            _ => &mut self.rreq_msn,
        };
        let h = Header::untagged(opcode, *msn, true);
        *msn = msn.wrapping_add(1);
        h
    }

    fn start_op(&mut self, seq: u64, op: SendOp, solicited: bool) {
        let pending = match op {
            SendOp::Write { local, remote } => {
                let hdr = Header::tagged(Opcode::Write, remote.rkey, remote.addr, true);
                let len = local.len;
                self.tx.push(TxMsg {
                    hdr,
                    src: Self::mem(&local),
                    len,
                    on_sent: OnSent::Complete(seq),
                });
                Pending::Sending
            }
            SendOp::WriteWithImm { local, remote, imm } => {
                let hdr = Header::tagged(Opcode::Write, remote.rkey, remote.addr, true);
                let len = local.len;
                self.tx.push(TxMsg {
                    hdr,
                    src: Self::mem(&local),
                    len,
                    on_sent: OnSent::Nothing,
                });
                let hdr = self.untagged(Opcode::ImmediateData);
                let body = (imm as u64).to_be_bytes().to_vec();
                self.tx.push(TxMsg {
                    hdr,
                    src: Src::Inline(body),
                    len: 8,
                    on_sent: OnSent::Complete(seq),
                });
                Pending::Sending
            }
            SendOp::Send { local } => {
                let opcode = if solicited {
                    Opcode::SendSe
                } else {
                    Opcode::Send
                };
                let hdr = self.untagged(opcode);
                let len = local.len;
                self.tx.push(TxMsg {
                    hdr,
                    src: Self::mem(&local),
                    len,
                    on_sent: OnSent::Complete(seq),
                });
                Pending::Sending
            }
            SendOp::SendWithInvalidate {
                local,
                invalidate_rkey,
            } => {
                let opcode = if solicited {
                    Opcode::SendSeInvalidate
                } else {
                    Opcode::SendInvalidate
                };
                let mut hdr = self.untagged(opcode);
                if let HeaderKind::Untagged { inv_stag, .. } = &mut hdr.kind {
                    *inv_stag = invalidate_rkey;
                }
                let len = local.len;
                self.tx.push(TxMsg {
                    hdr,
                    src: Self::mem(&local),
                    len,
                    on_sent: OnSent::Complete(seq),
                });
                Pending::Sending
            }
            SendOp::Read { local, remote } => {
                let rr = ReadRequest {
                    sink_stag: local.mr.lkey(),
                    sink_to: local.mr.addr() + local.offset as u64,
                    size: local.len as u32,
                    src_stag: remote.rkey,
                    src_to: remote.addr,
                };
                let hdr = self.untagged(Opcode::ReadRequest);
                let body = rr.encode().to_vec();
                self.tx.push(TxMsg {
                    hdr,
                    src: Src::Inline(body),
                    len: ReadRequest::LEN,
                    on_sent: OnSent::Nothing,
                });
                self.in_flight.push_back(seq);
                Pending::Read {
                    sink: local,
                    got: 0,
                }
            }
            SendOp::CompareSwap {
                local,
                remote,
                compare,
                swap,
            } => {
                let id = self.req_id();
                let ar = AtomicRequest::compare_swap(id, remote.rkey, remote.addr, compare, swap);
                self.push_request(Opcode::AtomicRequest, ar.encode().to_vec(), seq);
                Pending::Atomic {
                    req_id: id,
                    result: local,
                }
            }
            SendOp::FetchAdd { local, remote, add } => {
                let id = self.req_id();
                let ar = AtomicRequest::fetch_add(id, remote.rkey, remote.addr, add);
                self.push_request(Opcode::AtomicRequest, ar.encode().to_vec(), seq);
                Pending::Atomic {
                    req_id: id,
                    result: local,
                }
            }
            SendOp::AtomicWrite { remote, value } => {
                let id = self.req_id();
                let aw = AtomicWriteRequest {
                    req_id: id,
                    stag: remote.rkey,
                    to: remote.addr,
                    data: value.to_ne_bytes(),
                };
                self.push_request(Opcode::AtomicWriteRequest, aw.encode().to_vec(), seq);
                Pending::Private {
                    req_id: id,
                    request: Opcode::AtomicWriteRequest,
                }
            }
            SendOp::Flush { target, kind } => {
                let id = self.req_id();
                let placement = match kind {
                    FlushType::Visibility => FlushPlacement::Visibility,
                    FlushType::Persistent => FlushPlacement::Persistent,
                };
                let selectivity = match target {
                    FlushTarget::Range { remote, len } => FlushSelectivity::Range {
                        stag: remote.rkey,
                        to: remote.addr,
                        len,
                    },
                    FlushTarget::Region { rkey } => FlushSelectivity::Region { stag: rkey },
                };
                let fr = FlushRequest {
                    req_id: id,
                    placement,
                    selectivity,
                };
                self.push_request(Opcode::FlushRequest, fr.encode().to_vec(), seq);
                Pending::Private {
                    req_id: id,
                    request: Opcode::FlushRequest,
                }
            }
        };
        if let Some(ent) = self.entry_mut(seq) {
            ent.pending = pending;
        }
    }

    fn push_request(&mut self, opcode: Opcode, body: Vec<u8>, seq: u64) {
        let hdr = self.untagged(opcode);
        let len = body.len();
        self.tx.push(TxMsg {
            hdr,
            src: Src::Inline(body),
            len,
            on_sent: OnSent::Nothing,
        });
        self.in_flight.push_back(seq);
    }

    fn write(&mut self, conn: &mut Conn) {
        let mut done: Vec<OnSent> = Vec::new();
        let r = self.tx.flush(&mut conn.sock, |o| done.push(o));
        for o in done {
            match o {
                OnSent::Complete(seq) => {
                    if let Some(ent) = self.entry_mut(seq) {
                        if matches!(ent.pending, Pending::Sending) {
                            ent.pending = Pending::Done;
                            ent.status.get_or_insert(WcStatus::Success);
                        }
                    }
                }
                OnSent::ResponseDone => self.ird_used = self.ird_used.saturating_sub(1),
                OnSent::Nothing => {}
            }
        }
        if let Err(err) = r {
            self.tx.abort_queued();
            self.closing = false;
            self.enter_error(format!("connection lost while sending: {err}"), None);
        }
    }

    /// Moves completed entries from the head of the send queue to the CQ (in order).
    fn complete_in_order(&mut self) {
        while let Some(front) = self.sq.front() {
            let Some(status) = front.status else { return };
            let ent = self.sq.pop_front().expect("front exists");
            if status != WcStatus::Success || ent.flags.contains(SendFlags::SIGNALED) {
                self.send_cq.push(Completion {
                    wr_id: ent.wr_id,
                    status,
                    opcode: ent.opcode,
                    byte_len: if status == WcStatus::Success {
                        ent.byte_len
                    } else {
                        0
                    },
                    imm: None,
                    invalidated_rkey: None,
                    solicited: false,
                    qp_num: self.qp_num,
                });
            }
        }
    }

    /// The queue pair goes to Error: the oldest outstanding send request gets `head_status`
    /// (if given), everything else WrFlush.
    fn enter_error(&mut self, why: String, head_status: Option<WcStatus>) {
        if self.state == QpState::Error {
            return;
        }
        self.state = QpState::Error;
        self.error = Some(why);
        // The oldest unfinished request gets the error; every later one (also those done but
        // waiting behind it, whose effect at the peer is now uncertain) is flushed.
        let mut head = head_status;
        let mut behind = false;
        for ent in self.sq.iter_mut() {
            if ent.status.is_some() && !behind {
                continue;
            }
            ent.status = Some(match head.take() {
                Some(st) if !behind => st,
                _ => WcStatus::WrFlush,
            });
            behind = true;
            ent.pending = Pending::Done;
        }
        self.next_issue = self.next_seq;
        self.in_flight.clear();
        let flush = |wr_id| Completion {
            wr_id,
            status: WcStatus::WrFlush,
            opcode: WcOpcode::Recv,
            byte_len: 0,
            imm: None,
            invalidated_rkey: None,
            solicited: false,
            qp_num: self.qp_num,
        };
        if let Some(cur) = self.cur_recv.take() {
            self.recv_cq.push(flush(cur.entry.wr_id));
        }
        for r in self.rq.drain(..) {
            self.recv_cq.push(flush(r.wr_id));
        }
    }

    /// Sends a Terminate for `f` and moves to Error.
    fn terminate(&mut self, f: Fault) {
        let ulpdu = f.hdr.encode();
        let t = Terminate::new(f.cause).with_ddp(f.ulpdu_len as u16, ulpdu.as_slice());
        self.tx.abort_queued();
        let hdr = Header::untagged(Opcode::Terminate, 1, true);
        let body = t.encode();
        let len = body.len();
        self.tx.push(TxMsg {
            hdr,
            src: Src::Inline(body),
            len,
            on_sent: OnSent::Nothing,
        });
        self.closing = true;
        if let (Some(st), Some(cur)) = (f.recv_status, self.cur_recv.take()) {
            self.recv_cq.push(Completion {
                wr_id: cur.entry.wr_id,
                status: st,
                opcode: WcOpcode::Recv,
                byte_len: 0,
                imm: None,
                invalidated_rkey: None,
                solicited: false,
                qp_num: self.qp_num,
            });
        }
        let why = format!("sent Terminate {:?}", f.cause);
        self.enter_error(why, None);
    }

    fn receive(&mut self, conn: &mut Conn) {
        for _ in 0..RX_BUDGET {
            if self.state != QpState::Rts {
                return;
            }
            match conn.rx.poll(&mut conn.sock, self) {
                Ok(Some(ev)) => self.on_event(ev),
                Ok(None) => return,
                Err(rx::RxError::Closed) => {
                    self.enter_error("connection closed by the peer".into(), None);
                    return;
                }
                Err(rx::RxError::Io(e)) => {
                    self.enter_error(format!("connection lost: {e}"), None);
                    return;
                }
                Err(rx::RxError::Wire {
                    err,
                    hdr,
                    ulpdu_len,
                }) => {
                    let cause = err.terminate_cause();
                    let hdr = hdr.unwrap_or(Header::untagged(Opcode::Send, 0, true));
                    self.terminate(Fault {
                        cause,
                        hdr,
                        ulpdu_len,
                        recv_status: None,
                    });
                    return;
                }
            }
        }
    }

    fn on_event(&mut self, ev: rx::Event) {
        if let Some(f) = self.fault.take() {
            self.terminate(f);
            return;
        }
        match ev {
            rx::Event::Data { hdr, len } => self.on_data(hdr, len),
            rx::Event::Control {
                hdr,
                body,
                ulpdu_len,
            } => {
                if let Err(f) = self.on_control(hdr, body, ulpdu_len) {
                    self.terminate(f);
                }
            }
        }
    }

    /// A data FPDU has been placed (its CRC checked).
    fn on_data(&mut self, hdr: Header, len: usize) {
        match (hdr.opcode, hdr.kind) {
            (Opcode::ReadResponse, _) => {
                let Some(&seq) = self.in_flight.front() else {
                    return;
                };
                let Some(ent) = self.entry_mut(seq) else {
                    return;
                };
                if let Pending::Read { got, .. } = &mut ent.pending {
                    *got += len;
                    if hdr.last {
                        ent.pending = Pending::Done;
                        ent.status = Some(WcStatus::Success);
                        self.in_flight.pop_front();
                    }
                }
            }
            (
                Opcode::Send | Opcode::SendSe | Opcode::SendInvalidate | Opcode::SendSeInvalidate,
                HeaderKind::Untagged { inv_stag, mo, .. },
            ) => {
                if !hdr.last {
                    return;
                }
                let Some(cur) = self.cur_recv.take() else {
                    return;
                };
                let mut invalidated = None;
                if matches!(
                    hdr.opcode,
                    Opcode::SendInvalidate | Opcode::SendSeInvalidate
                ) {
                    if self
                        .ctx
                        .inner
                        .stags
                        .invalidate_remote(inv_stag, self.pd, self.qp_num)
                        .is_err()
                    {
                        self.terminate(Fault {
                            cause: TermCause::RDMAP_CANNOT_INVALIDATE,
                            hdr,
                            ulpdu_len: hdr.len() + len,
                            recv_status: None,
                        });
                        self.recv_cq.push(self.recv_completion(
                            cur.entry.wr_id,
                            WcStatus::WrFlush,
                            0,
                        ));
                        return;
                    }
                    invalidated = Some(inv_stag);
                }
                let mut c =
                    self.recv_completion(cur.entry.wr_id, WcStatus::Success, mo as usize + len);
                c.invalidated_rkey = invalidated;
                c.solicited = matches!(hdr.opcode, Opcode::SendSe | Opcode::SendSeInvalidate);
                self.recv_cq.push(c);
            }
            _ => {}
        }
        self.after_data_fault();
    }

    fn after_data_fault(&mut self) {
        if let Some(f) = self.fault.take() {
            self.terminate(f);
        }
    }

    fn recv_completion(&self, wr_id: u64, status: WcStatus, len: usize) -> Completion {
        Completion {
            wr_id,
            status,
            opcode: WcOpcode::Recv,
            byte_len: len as u32,
            imm: None,
            invalidated_rkey: None,
            solicited: false,
            qp_num: self.qp_num,
        }
    }

    /// Makes every Write placed so far durable: called before any response leaves.
    fn persist_dirty(&mut self, hdr: Header, ulpdu_len: usize) -> std::result::Result<(), Fault> {
        if self.dirty.is_empty() {
            return Ok(());
        }
        self.dirty.persist_all().map_err(|_| Fault {
            cause: TermCause::RDMAP_CATASTROPHIC_STREAM,
            hdr,
            ulpdu_len,
            recv_status: None,
        })
    }

    fn lookup(
        &self,
        stag: u32,
        to: u64,
        len: u64,
        need: Access,
    ) -> std::result::Result<
        crate::fabric::soft::device::Target,
        crate::fabric::soft::device::AccessFault,
    > {
        use crate::fabric::soft::device::AccessFault;
        let entry = self
            .ctx
            .inner
            .stags
            .lookup(stag)
            .ok_or(AccessFault::InvalidStag)?;
        entry.check(self.pd, self.qp_num, to, len, need)
    }

    fn take_ird(&mut self, hdr: Header, ulpdu_len: usize) -> std::result::Result<(), Fault> {
        let HeaderKind::Untagged { msn, .. } = hdr.kind else {
            return Ok(());
        };
        let fault = |cause| Fault {
            cause,
            hdr,
            ulpdu_len,
            recv_status: None,
        };
        if msn != self.rreq_expect {
            return Err(fault(TermCause::DDP_UNTAGGED_MSN_RANGE));
        }
        if self.ird_used >= self.ird {
            return Err(fault(TermCause::DDP_UNTAGGED_MSN_RANGE));
        }
        self.rreq_expect = self.rreq_expect.wrapping_add(1);
        self.ird_used += 1;
        Ok(())
    }

    fn respond(&mut self, opcode: Opcode, body: Vec<u8>) {
        let hdr = Header::untagged(opcode, self.resp_msn, true);
        self.resp_msn = self.resp_msn.wrapping_add(1);
        let len = body.len();
        self.tx.push(TxMsg {
            hdr,
            src: Src::Inline(body),
            len,
            on_sent: OnSent::ResponseDone,
        });
    }

    fn on_control(
        &mut self,
        hdr: Header,
        body: Body,
        ulpdu_len: usize,
    ) -> std::result::Result<(), Fault> {
        let fault = |cause| Fault {
            cause,
            hdr,
            ulpdu_len,
            recv_status: None,
        };
        match body {
            Body::ReadRequest(rr) => {
                self.take_ird(hdr, ulpdu_len)?;
                if rr.size as usize > self.max_message {
                    return Err(fault(TermCause::RDMAP_OPERATION_UNSPECIFIED));
                }
                let t = self
                    .lookup(rr.src_stag, rr.src_to, rr.size as u64, Access::REMOTE_READ)
                    .map_err(|f| fault(placement::rdmap_cause(f)))?;
                self.persist_dirty(hdr, ulpdu_len)?;
                let rhdr = Header::tagged(Opcode::ReadResponse, rr.sink_stag, rr.sink_to, true);
                self.tx.push(TxMsg {
                    hdr: rhdr,
                    src: Src::Mem {
                        region: t.region,
                        offset: t.offset,
                    },
                    len: rr.size as usize,
                    on_sent: OnSent::ResponseDone,
                });
            }
            Body::AtomicRequest(ar) => {
                self.take_ird(hdr, ulpdu_len)?;
                if ar.to % 8 != 0 {
                    return Err(fault(TermCause::RDMAP_BASE_BOUNDS));
                }
                let t = self
                    .lookup(ar.stag, ar.to, 8, Access::REMOTE_ATOMIC)
                    .map_err(|f| fault(placement::rdmap_cause(f)))?;
                self.persist_dirty(hdr, ulpdu_len)?;
                let ptr = t.ptr();
                if ptr as usize % 8 != 0 {
                    return Err(fault(TermCause::RDMAP_BASE_BOUNDS));
                }
                // SAFETY: `ptr` is 8-aligned, inside registered memory kept alive by
                // `t.region`, and the fabric accesses it only atomically.
                let cell = unsafe { AtomicU64::from_ptr(ptr as *mut u64) };
                let original = match ar.op {
                    AtomicOp::FetchAdd => placement::fetch_add(cell, ar.add_swap, ar.add_swap_mask),
                    AtomicOp::CompareSwap => placement::compare_swap(
                        cell,
                        ar.compare,
                        ar.compare_mask,
                        ar.add_swap,
                        ar.add_swap_mask,
                    ),
                };
                self.dirty.add(&t.region, t.offset, 8);
                self.persist_dirty(hdr, ulpdu_len)?;
                let resp = AtomicResponse {
                    req_id: ar.req_id,
                    original,
                };
                self.respond(Opcode::AtomicResponse, resp.encode().to_vec());
            }
            Body::AtomicWriteRequest(aw) => {
                self.take_ird(hdr, ulpdu_len)?;
                let t = self
                    .lookup(aw.stag, aw.to, 8, Access::REMOTE_WRITE)
                    .map_err(|f| fault(placement::rdmap_cause(f)))?;
                let ptr = t.ptr();
                if aw.to % 8 != 0 || ptr as usize % 8 != 0 {
                    return Err(fault(TermCause::RDMAP_BASE_BOUNDS));
                }
                // SAFETY: as for atomics: aligned, in live registered memory, accessed
                // atomically by the fabric.
                let cell = unsafe { AtomicU64::from_ptr(ptr as *mut u64) };
                cell.store(u64::from_ne_bytes(aw.data), Ordering::Release);
                self.dirty.add(&t.region, t.offset, 8);
                self.persist_dirty(hdr, ulpdu_len)?;
                let resp = PrivateResponse {
                    req_id: aw.req_id,
                    request: Opcode::AtomicWriteRequest,
                };
                self.respond(Opcode::PrivateResponse, resp.encode().to_vec());
            }
            Body::FlushRequest(fr) => {
                self.take_ird(hdr, ulpdu_len)?;
                let need = match fr.placement {
                    FlushPlacement::Visibility => Access::FLUSH_VISIBILITY,
                    FlushPlacement::Persistent => Access::FLUSH_PERSISTENT,
                };
                let t = match fr.selectivity {
                    FlushSelectivity::Range { stag, to, len } => {
                        self.lookup(stag, to, len, need).map(|t| (t, len as usize))
                    }
                    FlushSelectivity::Region { stag } => match self.ctx.inner.stags.lookup(stag) {
                        Some(e) => e
                            .check(self.pd, self.qp_num, e.base, e.len, need)
                            .map(|t| (t, e.len as usize)),
                        None => Err(crate::fabric::soft::device::AccessFault::InvalidStag),
                    },
                }
                .map_err(|f| fault(placement::rdmap_cause(f)))?;
                self.persist_dirty(hdr, ulpdu_len)?;
                if fr.placement == FlushPlacement::Persistent {
                    if let Some(p) = t.0.region.persist() {
                        if t.1 > 0 && p.persist(t.0.offset, t.1).is_err() {
                            return Err(fault(TermCause::RDMAP_CATASTROPHIC_STREAM));
                        }
                    }
                }
                let resp = PrivateResponse {
                    req_id: fr.req_id,
                    request: Opcode::FlushRequest,
                };
                self.respond(Opcode::PrivateResponse, resp.encode().to_vec());
            }
            Body::AtomicResponse(ar) => {
                let Some(&seq) = self.in_flight.front() else {
                    return Err(fault(TermCause::RDMAP_UNEXPECTED_OPCODE));
                };
                let ent = self
                    .entry_mut(seq)
                    .ok_or_else(|| fault(TermCause::RDMAP_UNEXPECTED_OPCODE))?;
                match &ent.pending {
                    Pending::Atomic { req_id, result } if *req_id == ar.req_id => {
                        let p = result.mr.as_mut_ptr().wrapping_add(result.offset);
                        let v = ar.original.to_ne_bytes();
                        // SAFETY: `result` was checked at post time: 8 bytes with local write
                        // inside a region kept alive by the entry's Arc.
                        unsafe { std::ptr::copy_nonoverlapping(v.as_ptr(), p, 8) };
                        ent.pending = Pending::Done;
                        ent.status = Some(WcStatus::Success);
                        self.in_flight.pop_front();
                    }
                    _ => return Err(fault(TermCause::RDMAP_UNEXPECTED_OPCODE)),
                }
            }
            Body::PrivateResponse(pr) => {
                let Some(&seq) = self.in_flight.front() else {
                    return Err(fault(TermCause::RDMAP_UNEXPECTED_OPCODE));
                };
                let ent = self
                    .entry_mut(seq)
                    .ok_or_else(|| fault(TermCause::RDMAP_UNEXPECTED_OPCODE))?;
                match &ent.pending {
                    Pending::Private { req_id, request }
                        if *req_id == pr.req_id && *request == pr.request =>
                    {
                        ent.pending = Pending::Done;
                        ent.status = Some(WcStatus::Success);
                        self.in_flight.pop_front();
                    }
                    _ => return Err(fault(TermCause::RDMAP_UNEXPECTED_OPCODE)),
                }
            }
            Body::ImmediateData(b) => {
                let HeaderKind::Untagged { msn, .. } = hdr.kind else {
                    return Ok(());
                };
                if msn != self.recv_msn {
                    return Err(fault(TermCause::DDP_UNTAGGED_MSN_RANGE));
                }
                self.recv_msn = self.recv_msn.wrapping_add(1);
                let Some(r) = self.rq.pop_front() else {
                    return Err(fault(TermCause::DDP_UNTAGGED_NO_BUFFER));
                };
                let mut c = self.recv_completion(r.wr_id, WcStatus::Success, 0);
                c.opcode = WcOpcode::RecvRdmaWithImm;
                c.imm = Some(u64::from_be_bytes(b) as u32);
                c.solicited = hdr.opcode == Opcode::ImmediateDataSe;
                self.recv_cq.push(c);
            }
            Body::Terminate(t) => {
                let status = placement::status_for(t.cause);
                self.closing = false;
                self.enter_error(format!("received Terminate {:?}", t.cause), Some(status));
            }
        }
        Ok(())
    }
}

impl rx::Placer for Engine {
    /// Decides where an FPDU's payload goes, after checking STag, bounds and rights: nothing is
    /// placed for a request that fails them (it is discarded and answered with a Terminate).
    fn place(&mut self, hdr: &Header, len: usize) -> rx::Placement {
        if self.fault.is_some() || self.state != QpState::Rts {
            return rx::Placement::Discard;
        }
        match self.check_placement(hdr, len) {
            Ok(p) => p,
            Err((cause, recv_status)) => {
                let ulpdu_len = hdr.len() + len;
                self.fault = Some(Fault {
                    cause,
                    hdr: *hdr,
                    ulpdu_len,
                    recv_status,
                });
                rx::Placement::Discard
            }
        }
    }
}

type PlaceResult = std::result::Result<rx::Placement, (TermCause, Option<WcStatus>)>;

impl Engine {
    fn check_placement(&mut self, hdr: &Header, len: usize) -> PlaceResult {
        match (hdr.opcode, hdr.kind) {
            // A zero-length Write places nothing (it is also the peer-to-peer RTR).
            (Opcode::Write, HeaderKind::Tagged { .. }) if len == 0 => Ok(rx::Placement::Discard),
            (Opcode::Write, HeaderKind::Tagged { stag, to }) => {
                match self.lookup(stag, to, len as u64, Access::REMOTE_WRITE) {
                    Ok(t) => {
                        self.dirty.add(&t.region, t.offset, len);
                        Ok(rx::Placement::Direct(t.ptr()))
                    }
                    Err(f) => Err((placement::tagged_cause(f), None)),
                }
            }
            (Opcode::ReadResponse, HeaderKind::Tagged { stag, to }) => {
                let head = self.in_flight.front().copied();
                let ent = head.and_then(|s| self.entry_mut(s));
                let Some(SqEntry {
                    pending: Pending::Read { sink, got },
                    ..
                }) = ent
                else {
                    return Err((TermCause::RDMAP_UNEXPECTED_OPCODE, None));
                };
                let expect_to = sink.mr.addr() + (sink.offset + *got) as u64;
                if stag != sink.mr.lkey() || to != expect_to || *got + len > sink.len {
                    return Err((TermCause::DDP_TAGGED_BASE_BOUNDS, None));
                }
                Ok(rx::Placement::Direct(
                    sink.mr.as_mut_ptr().wrapping_add(sink.offset + *got),
                ))
            }
            (
                Opcode::Send | Opcode::SendSe | Opcode::SendInvalidate | Opcode::SendSeInvalidate,
                HeaderKind::Untagged { msn, mo, .. },
            ) => {
                if mo == 0 && self.cur_recv.is_none() {
                    if msn != self.recv_msn {
                        return Err((TermCause::DDP_UNTAGGED_MSN_RANGE, None));
                    }
                    let Some(entry) = self.rq.pop_front() else {
                        return Err((TermCause::DDP_UNTAGGED_NO_BUFFER, None));
                    };
                    self.recv_msn = self.recv_msn.wrapping_add(1);
                    self.cur_recv = Some(CurRecv {
                        entry,
                        msn,
                        placed: 0,
                    });
                }
                let Some(cur) = self.cur_recv.as_mut() else {
                    return Err((TermCause::DDP_UNTAGGED_INVALID_MO, None));
                };
                if cur.msn != msn || cur.placed != mo as usize {
                    return Err((TermCause::DDP_UNTAGGED_INVALID_MO, None));
                }
                let cap = cur.entry.local.as_ref().map_or(0, |s| s.len);
                if mo as usize + len > cap {
                    return Err((
                        TermCause::DDP_UNTAGGED_TOO_LONG,
                        Some(WcStatus::LocalLength),
                    ));
                }
                cur.placed += len;
                Ok(match &cur.entry.local {
                    Some(s) if len > 0 => rx::Placement::Direct(
                        s.mr.as_mut_ptr().wrapping_add(s.offset + mo as usize),
                    ),
                    _ => rx::Placement::Discard,
                })
            }
            _ => Err((TermCause::RDMAP_UNEXPECTED_OPCODE, None)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
