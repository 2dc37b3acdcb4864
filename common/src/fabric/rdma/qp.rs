//! The rdma transport's queue pair: an RC `ibv_qp` made with its protection domain and
//! completion queues (so that receives can be posted before the connection exists), posting
//! in both directions, and the translation of its completions.
//!
//! Buffer ownership: every posted request's `Sge` (an `Arc` of its region) is kept in the
//! queue pair's send or receive table, keyed by the sequence number in the request's hardware
//! `wr_id`, until the request's completion is reaped; an unsignaled request leaves the table
//! when a later request's completion shows that it is done (RC completes in order). So memory
//! the NIC may still read or write is never deregistered or freed, whatever the user drops.
//! A run of unsignaled requests is signaled in hardware now and then (its success is not
//! reported), so that the table, and the device's send queue, never fill with requests whose
//! end nobody would hear of.
//!
//! Connection set-up (rdma_cm) is in `link.rs`; the tables and posting are here.

use std::collections::VecDeque;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rdma_sys::{
    ibv_qp, ibv_qp_attr, ibv_qp_attr_mask as am, ibv_qp_create_send_ops_flags as so, ibv_qp_ex,
    ibv_qp_init_attr_mask, ibv_qp_state, ibv_qp_type, ibv_recv_wr, ibv_send_wr, ibv_sge, ibv_wc,
    ibv_wc_flags, ibv_wr_opcode,
};

use super::cm::Conn;
use super::device::{Device, Pd};
use super::mr::Mr;
use super::sys;
use super::translate::{self, caps, WrSpec};
use crate::fabric::cq::CompletionQueue;
use crate::fabric::error::{Error, Result};
use crate::fabric::pd::ProtectionDomain;
use crate::fabric::qp::ConnInfo;
use crate::fabric::transport::{CqEngine, Entries, PdEngine};
use crate::fabric::types::{
    Access, Completion, QpCaps, QpState, RecvWr, SendFlags, SendOp, SendWr, Sge, WcOpcode, WcStatus,
};

/// Sequence numbers are 31 bits; the top bit of a hardware `wr_id`'s low half marks receives
/// (a failed completion's opcode is undefined, so it cannot say which queue it is of).
const SEQ_MASK: u32 = (1 << 31) - 1;
const RECV_BIT: u32 = 1 << 31;

/// How long closing waits for the device to flush what is outstanding.
const DRAIN_TIME: Duration = Duration::from_millis(500);
/// How long a memory window bind may take.
const BIND_TIME: Duration = Duration::from_secs(5);

static NEXT_TAG: AtomicU32 = AtomicU32::new(1);

/// A posted send-queue request, until its completion (or a later one's) is reaped.
struct SendSlot {
    seq: u32,
    wr_id: u64,
    opcode: WcOpcode,
    byte_len: u32,
    /// The user asked for its completion (errors are reported anyway).
    report: bool,
    /// A memory window bind of the transport's own.
    bind: bool,
    _local: Option<Sge>,
    _bound: Option<Mr>,
}

struct RecvSlot {
    seq: u32,
    wr_id: u64,
    _local: Option<Sge>,
}

pub(super) struct Core {
    pub(super) state: QpState,
    pub(super) error: Option<String>,
    pub(super) info: Option<ConnInfo>,
    pub(super) cm: Option<Conn>,
    pub(super) max_message: usize,
    /// The peer's capability flags (`caps::*`).
    pub(super) peer_flags: u8,
    sq: VecDeque<SendSlot>,
    next_send: u32,
    /// Unsignaled requests posted since the last one signaled in hardware.
    unsignaled: u32,
    rq: VecDeque<RecvSlot>,
    next_recv: u32,
    /// The last bind's sequence number and status.
    bind_result: Option<(u32, WcStatus)>,
}

/// An rdma queue pair. Shared by its handle and (weakly) by the device's registry, through
/// which its completion queues find it.
pub(crate) struct Qp {
    pub(crate) num: u32,
    pub(crate) pd: ProtectionDomain,
    tag: u32,
    pub(super) dev: Device,
    pub(super) raw: NonNull<ibv_qp>,
    /// The extended queue pair (the `ibv_wr_*` posting calls), made when the device has
    /// Atomic Write, which only that path posts.
    ex: Option<NonNull<ibv_qp_ex>>,
    pub(super) send_cq: CompletionQueue,
    pub(super) recv_cq: CompletionQueue,
    caps: QpCaps,
    _rpd: Pd,
    core: Mutex<Core>,
}

// SAFETY: libibverbs queue pairs may be posted to and modified from any thread; every use of
// the pointers here is under `core`'s lock or a verbs call that is itself thread-safe, and
// they are destroyed only in Drop.
unsafe impl Send for Qp {}
// SAFETY: as for Send.
unsafe impl Sync for Qp {}

fn rdma_cq(cq: &CompletionQueue) -> Result<&super::cq::Cq> {
    match cq.engine() {
        CqEngine::Rdma(c) => Ok(c),
        _ => Err(Error::WrongDomain {
            what: "completion queue",
        }),
    }
}

fn same_cq(a: &CompletionQueue, b: &CompletionQueue) -> bool {
    Arc::ptr_eq(&a.inner, &b.inner)
}

impl Device {
    /// A queue pair in Init on `pd`'s device, its receives postable.
    pub(crate) fn create_qp(
        &self,
        pd: ProtectionDomain,
        send_cq: CompletionQueue,
        recv_cq: CompletionQueue,
        caps: QpCaps,
    ) -> Result<Arc<Qp>> {
        let PdEngine::Rdma(rpd) = &pd.inner.engine else {
            return Err(Error::WrongDomain {
                what: "protection domain",
            });
        };
        let rpd = rpd.clone();
        let (scq, rcq) = (rdma_cq(&send_cq)?, rdma_cq(&recv_cq)?);
        let max = self.caps().max_qp_wr as usize;
        if caps.max_send_wr > max || caps.max_recv_wr > max {
            return Err(Error::Exhausted {
                what: "queue pair depth (the device's max_qp_wr)",
            });
        }
        let (s, r) = (caps.max_send_wr as u32, caps.max_recv_wr as u32);
        if same_cq(&send_cq, &recv_cq) {
            scq.reserve(s + r)?;
        } else {
            scq.reserve(s)?;
            if let Err(e) = rcq.reserve(r) {
                scq.release(s);
                return Err(e);
            }
        }
        let unreserve = || {
            if same_cq(&send_cq, &recv_cq) {
                scq.release(s + r);
            } else {
                scq.release(s);
                rcq.release(r);
            }
        };
        let (raw, ex) = match create_raw(self, &rpd, scq.raw(), rcq.raw(), s, r) {
            Ok(made) => made,
            Err(e) => {
                unreserve();
                return Err(e);
            }
        };
        // SAFETY: `raw` was just created and is live.
        let num = unsafe { (*raw.as_ptr()).qp_num };
        let qp = Arc::new(Qp {
            num,
            pd,
            tag: NEXT_TAG.fetch_add(1, Ordering::Relaxed),
            dev: self.clone(),
            raw,
            ex,
            send_cq,
            recv_cq,
            caps,
            _rpd: rpd,
            core: Mutex::new(Core {
                state: QpState::Reset,
                error: None,
                info: None,
                cm: None,
                max_message: 1 << 30,
                peer_flags: 0,
                sq: VecDeque::new(),
                next_send: 0,
                unsignaled: 0,
                rq: VecDeque::new(),
                next_recv: 0,
                bind_result: None,
            }),
        });
        // From here on the queue pair's Drop destroys it and gives the reservations back.
        qp.to_init()?;
        self.register_qp(num, Arc::downgrade(&qp));
        Ok(qp)
    }
}

/// Makes the `ibv_qp` (extended when the device has Atomic Write; the plain one if the
/// provider cannot make that).
fn create_raw(
    dev: &Device,
    pd: &Pd,
    scq: *mut rdma_sys::ibv_cq,
    rcq: *mut rdma_sys::ibv_cq,
    send: u32,
    recv: u32,
) -> Result<(NonNull<ibv_qp>, Option<NonNull<ibv_qp_ex>>)> {
    let cap = rdma_sys::ibv_qp_cap {
        max_send_wr: send,
        max_recv_wr: recv,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 0,
    };
    if dev.caps().atomic_write {
        // SAFETY: ibv_qp_init_attr_ex is plain C data; zero is "not set" for every field.
        let mut a: rdma_sys::ibv_qp_init_attr_ex = unsafe { std::mem::zeroed() };
        a.send_cq = scq;
        a.recv_cq = rcq;
        a.cap = cap;
        a.qp_type = ibv_qp_type::IBV_QPT_RC;
        a.pd = pd.raw();
        a.comp_mask = (ibv_qp_init_attr_mask::IBV_QP_INIT_ATTR_PD
            | ibv_qp_init_attr_mask::IBV_QP_INIT_ATTR_SEND_OPS_FLAGS)
            .0;
        a.send_ops_flags = u64::from(
            (so::IBV_QP_EX_WITH_RDMA_WRITE
                | so::IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM
                | so::IBV_QP_EX_WITH_SEND
                | so::IBV_QP_EX_WITH_SEND_WITH_INV
                | so::IBV_QP_EX_WITH_RDMA_READ
                | so::IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP
                | so::IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD
                | so::IBV_QP_EX_WITH_BIND_MW
                | so::IBV_QP_EX_WITH_ATOMIC_WRITE)
                .0,
        );
        // SAFETY: the context, PD and CQs are live and of one device; `a` is filled above.
        let qp = unsafe { rdma_sys::ibv_create_qp_ex(dev.ctx(), &mut a) };
        if let Some(qp) = qp.and_then(NonNull::new) {
            // SAFETY: `qp` was made by ibv_create_qp_ex, so it has an extended part.
            let ex = NonNull::new(unsafe { rdma_sys::ibv_qp_to_qp_ex(qp.as_ptr()) });
            if ex.is_some() {
                return Ok((qp, ex));
            }
            // SAFETY: just made, used by nothing.
            unsafe { rdma_sys::ibv_destroy_qp(qp.as_ptr()) };
        }
    }
    let mut a = rdma_sys::ibv_qp_init_attr {
        qp_context: std::ptr::null_mut(),
        send_cq: scq,
        recv_cq: rcq,
        srq: std::ptr::null_mut(),
        cap,
        qp_type: ibv_qp_type::IBV_QPT_RC,
        sq_sig_all: 0,
    };
    // SAFETY: the PD and CQs are live and of one device; `a` is valid.
    let qp = unsafe { rdma_sys::ibv_create_qp(pd.raw(), &mut a) };
    let qp = NonNull::new(qp).ok_or_else(|| sys::errno("ibv_create_qp"))?;
    Ok((qp, None))
}

impl Qp {
    pub(super) fn lock(&self) -> MutexGuard<'_, Core> {
        self.core.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Reset to Init on port 1 with the remote rights every connection of this project uses;
    /// rdma_cm's Init attributes (the route's port and P_Key) replace these at connect.
    fn to_init(&self) -> Result<()> {
        // SAFETY: ibv_qp_attr is plain C data.
        let mut attr: ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = ibv_qp_state::IBV_QPS_INIT;
        attr.pkey_index = 0;
        attr.port_num = 1;
        attr.qp_access_flags = translate::access_to_ibv(
            Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC,
            self.dev.caps().atomics,
        );
        let mask =
            am::IBV_QP_STATE | am::IBV_QP_PKEY_INDEX | am::IBV_QP_PORT | am::IBV_QP_ACCESS_FLAGS;
        // SAFETY: the queue pair is live and in Reset.
        let r = unsafe { rdma_sys::ibv_modify_qp(self.raw.as_ptr(), &mut attr, mask.0 as i32) };
        if r != 0 {
            return Err(sys::returned("ibv_modify_qp(INIT)", r));
        }
        self.lock().state = QpState::Init;
        Ok(())
    }

    pub(crate) fn state(&self) -> QpState {
        self.lock().state
    }

    pub(crate) fn info(&self) -> ConnInfo {
        self.lock()
            .info
            .clone()
            .expect("a connected queue pair has its info")
    }

    pub(crate) fn error(&self) -> Option<String> {
        self.lock().error.clone()
    }

    pub(crate) fn check_rts(&self, op: &'static str) -> Result<()> {
        let st = self.state();
        if st != QpState::Rts {
            return Err(self.wrong_state(st, op, QpState::Rts));
        }
        Ok(())
    }

    fn wrong_state(&self, state: QpState, op: &'static str, needed: QpState) -> Error {
        Error::InvalidState {
            qp_num: self.num,
            state,
            op,
            needed,
        }
    }

    /// The capability flags this side advertises (what its device executes as a responder).
    pub(super) fn local_flags(&self) -> u8 {
        let c = self.dev.caps();
        let mut f = 0;
        if c.atomics {
            f |= caps::ATOMICS;
        }
        if c.atomic_write {
            f |= caps::ATOMIC_WRITE;
        }
        f
    }

    fn check_sge(&self, s: &Sge, need: Access) -> Result<()> {
        if !s.mr.pd().same(&self.pd) {
            return Err(Error::WrongDomain {
                what: "memory region",
            });
        }
        s.mr.check_local(s.offset, s.len, need)
    }

    pub(crate) fn post_recv(&self, wr: RecvWr) -> Result<()> {
        let mut c = self.lock();
        if matches!(c.state, QpState::Reset | QpState::Error) {
            return Err(self.wrong_state(c.state, "post_recv", QpState::Rts));
        }
        if c.rq.len() >= self.caps.max_recv_wr {
            return Err(Error::QueueFull {
                qp_num: self.num,
                queue: "receive",
                depth: self.caps.max_recv_wr,
            });
        }
        if let Some(s) = &wr.local {
            self.check_sge(s, Access::LOCAL_WRITE)?;
        }
        let seq = c.next_recv;
        let mut sge = match &wr.local {
            Some(s) => ibv_sge {
                addr: s.mr.addr() + s.offset as u64,
                length: s.len as u32,
                lkey: s.mr.lkey(),
            },
            None => ibv_sge {
                addr: 0,
                length: 0,
                lkey: 0,
            },
        };
        let mut rwr = ibv_recv_wr {
            wr_id: translate::token(self.tag, seq | RECV_BIT),
            next: std::ptr::null_mut(),
            sg_list: std::ptr::null_mut(),
            num_sge: 0,
        };
        if wr.local.is_some() {
            rwr.sg_list = &mut sge;
            rwr.num_sge = 1;
        }
        let mut bad = std::ptr::null_mut();
        // SAFETY: the queue pair is live; `rwr` and `sge` outlive the call (the provider copies
        // them); the buffer they name stays registered and alive in the slot pushed below,
        // under the same lock the completion takes, until the receive completes.
        let r = unsafe { rdma_sys::ibv_post_recv(self.raw.as_ptr(), &mut rwr, &mut bad) };
        if r != 0 {
            return Err(sys::returned("ibv_post_recv", r));
        }
        c.next_recv = (seq + 1) & SEQ_MASK;
        c.rq.push_back(RecvSlot {
            seq,
            wr_id: wr.wr_id,
            _local: wr.local,
        });
        Ok(())
    }

    pub(crate) fn post_send(&self, wr: SendWr) -> Result<()> {
        self.post_sends(&mut [Some(wr)])
    }

    /// Checks a request as the soft transport does, with this transport's capabilities.
    fn validate(&self, c: &Core, wr: &SendWr) -> Result<()> {
        let too_big = |s: &Sge| s.len > c.max_message || s.len > u32::MAX as usize;
        let big = || Error::InvalidWorkRequest {
            reason: "message larger than max_message",
        };
        let aligned = |addr: u64| addr.is_multiple_of(8);
        match &wr.op {
            SendOp::Write { local, .. }
            | SendOp::WriteWithImm { local, .. }
            | SendOp::Send { local }
            | SendOp::SendWithInvalidate { local, .. } => {
                self.check_sge(local, Access::empty())?;
                if too_big(local) {
                    return Err(big());
                }
            }
            SendOp::Read { local, .. } => {
                self.check_sge(local, Access::LOCAL_WRITE)?;
                if too_big(local) {
                    return Err(big());
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
                if c.peer_flags & caps::ATOMICS == 0 || !self.dev.caps().atomics {
                    return Err(Error::PeerUnsupported { op: "atomics" });
                }
            }
            SendOp::AtomicWrite { remote, .. } => {
                if !aligned(remote.addr) {
                    return Err(Error::InvalidWorkRequest {
                        reason: "atomic write target must be 8-byte aligned",
                    });
                }
                if c.peer_flags & caps::ATOMIC_WRITE == 0 || self.ex.is_none() {
                    return Err(Error::PeerUnsupported { op: "Atomic Write" });
                }
            }
            // rdma-core 44 has no flush verb: never offered on this transport.
            SendOp::Flush { .. } => return Err(Error::PeerUnsupported { op: "Flush" }),
        }
        if wr.flags.contains(SendFlags::SOLICITED)
            && !matches!(
                wr.op,
                SendOp::Send { .. }
                    | SendOp::SendWithInvalidate { .. }
                    | SendOp::WriteWithImm { .. }
            )
        {
            return Err(Error::InvalidWorkRequest {
                reason: "solicited event only on Send and WriteWithImm",
            });
        }
        Ok(())
    }

    /// Posts every request of `wrs` (all `Some`) with one doorbell, or none of them.
    pub(crate) fn post_sends(&self, wrs: &mut [Option<SendWr>]) -> Result<()> {
        let mut c = self.lock();
        if c.state != QpState::Rts {
            return Err(self.wrong_state(c.state, "post_send", QpState::Rts));
        }
        for wr in wrs.iter().flatten() {
            self.validate(&c, wr)?;
        }
        if c.sq.len() + wrs.len() > self.caps.max_send_wr {
            return Err(Error::QueueFull {
                qp_num: self.num,
                queue: "send",
                depth: self.caps.max_send_wr,
            });
        }
        // A run of unsignaled requests is signaled in hardware at half the queue.
        let every = (self.caps.max_send_wr as u32 / 2).max(1);
        let mut run = c.unsignaled;
        let mut specs = Vec::with_capacity(wrs.len());
        for (i, wr) in wrs.iter().flatten().enumerate() {
            let asked = wr.flags.contains(SendFlags::SIGNALED);
            run = if asked { 0 } else { run + 1 };
            let signal = asked || run >= every;
            if signal {
                run = 0;
            }
            let seq = (c.next_send + i as u32) & SEQ_MASK;
            let flags = translate::send_flags(wr.flags, signal);
            let spec = translate::spec(&wr.op, flags, |s| {
                (s.mr.addr() + s.offset as u64, s.mr.lkey())
            });
            specs.push((translate::token(self.tag, seq), spec));
        }
        let posted = match self.ex {
            Some(ex) => post_ex(ex, &specs),
            None => post_legacy(self.raw, &specs),
        };
        let n = match posted {
            Ok(()) => specs.len(),
            Err((0, e)) => return Err(e),
            Err((k, e)) => {
                // Some went to the device: they complete (flushed, now) and must be tracked.
                self.push_slots(&mut c, &mut wrs[..k]);
                self.enter_error(
                    &mut c,
                    format!("the device refused request {k} of a list after the first {k}"),
                );
                return Err(e);
            }
        };
        debug_assert_eq!(n, wrs.len());
        c.unsignaled = run;
        self.push_slots(&mut c, wrs);
        Ok(())
    }

    fn push_slots(&self, c: &mut Core, wrs: &mut [Option<SendWr>]) {
        for wr in wrs.iter_mut().filter_map(Option::take) {
            let opcode = translate::opcode_of(&wr.op);
            let (local, byte_len) = match wr.op {
                SendOp::Write { local, .. }
                | SendOp::WriteWithImm { local, .. }
                | SendOp::Read { local, .. }
                | SendOp::Send { local }
                | SendOp::SendWithInvalidate { local, .. } => {
                    let n = local.len as u32;
                    (Some(local), n)
                }
                SendOp::CompareSwap { local, .. } | SendOp::FetchAdd { local, .. } => {
                    (Some(local), 8)
                }
                SendOp::AtomicWrite { .. } => (None, 8),
                SendOp::Flush { .. } => (None, 0),
            };
            let seq = c.next_send;
            c.next_send = (seq + 1) & SEQ_MASK;
            c.sq.push_back(SendSlot {
                seq,
                wr_id: wr.wr_id,
                opcode,
                byte_len,
                report: wr.flags.contains(SendFlags::SIGNALED),
                bind: false,
                _local: local,
                _bound: None,
            });
        }
    }

    /// Moves to Error (once): the device flushes every outstanding request.
    pub(super) fn enter_error(&self, c: &mut Core, why: String) {
        if c.state == QpState::Error {
            return;
        }
        c.state = QpState::Error;
        c.error = Some(why);
        // SAFETY: ibv_qp_attr is plain C data.
        let mut attr: ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = ibv_qp_state::IBV_QPS_ERR;
        // SAFETY: the queue pair is live; a move to Error is valid from every state. If it
        // fails the device is gone, and closing cleans up without its flushes.
        unsafe { rdma_sys::ibv_modify_qp(self.raw.as_ptr(), &mut attr, am::IBV_QP_STATE.0 as i32) };
    }

    pub(crate) fn to_error(&self, why: &str) {
        let mut c = self.lock();
        self.enter_error(&mut c, why.to_owned());
        if let Some(cm) = &c.cm {
            cm.id.disconnect();
        }
    }

    /// Takes a completion the queue reaped: releases what its request held and reports it.
    pub(crate) fn complete(&self, wc: &ibv_wc, entries: &Entries) {
        let (tag, low) = translate::untoken(wc.wr_id);
        if tag != self.tag {
            return; // a completion of an earlier queue pair with this number
        }
        let status = translate::status_from_ibv(wc.status);
        let mut c = self.lock();
        if status != WcStatus::Success && status != WcStatus::WrFlush {
            let why = format!(
                "a request completed with {status:?} (vendor error {:#x})",
                wc.vendor_err
            );
            self.enter_error(&mut c, why);
        } else if status == WcStatus::WrFlush && c.state != QpState::Error {
            self.enter_error(&mut c, "flushed by the device".into());
        }
        let out = if low & RECV_BIT != 0 {
            self.complete_recv(&mut c, wc, low & SEQ_MASK, status)
        } else {
            self.complete_send(&mut c, wc, low, status)
        };
        if let Some(done) = out {
            entries
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push_back(done);
        }
    }

    fn completion(&self, wr_id: u64, status: WcStatus, opcode: WcOpcode, len: u32) -> Completion {
        Completion {
            wr_id,
            status,
            opcode,
            byte_len: if status == WcStatus::Success { len } else { 0 },
            imm: None,
            invalidated_rkey: None,
            solicited: false,
            qp_num: self.num,
        }
    }

    fn complete_send(
        &self,
        c: &mut Core,
        _wc: &ibv_wc,
        seq: u32,
        status: WcStatus,
    ) -> Option<Completion> {
        // Only a sequence number still in the table counts (a duplicate or stale one is
        // dropped rather than releasing what later requests hold).
        let pos = c.sq.iter().position(|s| s.seq == seq)?;
        // The earlier ones are done: RC completes in order, and an unsignaled success has no
        // completion of its own.
        c.sq.drain(..pos);
        let slot = c.sq.pop_front()?;
        if slot.bind {
            c.bind_result = Some((seq, status));
            return None;
        }
        (status != WcStatus::Success || slot.report)
            .then(|| self.completion(slot.wr_id, status, slot.opcode, slot.byte_len))
    }

    fn complete_recv(
        &self,
        c: &mut Core,
        wc: &ibv_wc,
        seq: u32,
        status: WcStatus,
    ) -> Option<Completion> {
        let pos = c.rq.iter().position(|s| s.seq == seq)?;
        let slot = c.rq.remove(pos)?;
        let opcode = match status {
            WcStatus::Success => translate::opcode_from_ibv(wc.opcode).unwrap_or(WcOpcode::Recv),
            _ => WcOpcode::Recv,
        };
        let mut out = self.completion(slot.wr_id, status, opcode, wc.byte_len);
        if status == WcStatus::Success {
            let flags = ibv_wc_flags(wc.wc_flags);
            // SAFETY: the union holds the immediate data when the WITH_IMM flag is set and the
            // invalidated rkey when WITH_INV is: the device sets the flag it filled.
            unsafe {
                if flags.0 & ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0 {
                    out.imm = Some(u32::from_be(wc.imm_data_invalidated_rkey_union.imm_data));
                }
                if flags.0 & ibv_wc_flags::IBV_WC_WITH_INV.0 != 0 {
                    out.invalidated_rkey =
                        Some(wc.imm_data_invalidated_rkey_union.invalidated_rkey);
                }
            }
        }
        Some(out)
    }

    /// Binds type-2 window `mw` to `len` bytes at `addr` of `mr` under `rkey`, posting the bind
    /// and driving the send queue's completions until it is done.
    pub(crate) fn bind_window(
        &self,
        mw: *mut rdma_sys::ibv_mw,
        rkey: u32,
        mr: &Mr,
        addr: u64,
        len: u64,
        access: u32,
    ) -> Result<()> {
        let refused = |reason| Error::MemoryWindow { reason };
        let seq = {
            let mut c = self.lock();
            if c.state != QpState::Rts {
                return Err(self.wrong_state(c.state, "bind_mw", QpState::Rts));
            }
            if c.sq.len() >= self.caps.max_send_wr {
                return Err(Error::QueueFull {
                    qp_num: self.num,
                    queue: "send",
                    depth: self.caps.max_send_wr,
                });
            }
            let seq = c.next_send;
            let info = rdma_sys::ibv_mw_bind_info {
                mr: mr.raw(),
                addr,
                length: len,
                mw_access_flags: access,
            };
            let id = translate::token(self.tag, seq);
            let signaled = rdma_sys::ibv_send_flags::IBV_SEND_SIGNALED.0;
            let r = match self.ex {
                // SAFETY: the extended queue pair is live; the bind's fields are read during
                // the calls; start/complete bracket one request.
                Some(ex) => unsafe {
                    let q = ex.as_ptr();
                    rdma_sys::ibv_wr_start(q);
                    (*q).wr_id = id;
                    (*q).wr_flags = signaled;
                    match (*q).wr_bind_mw {
                        Some(bind) => {
                            bind(q, mw, rkey, &info);
                            rdma_sys::ibv_wr_complete(q)
                        }
                        None => {
                            rdma_sys::ibv_wr_abort(q);
                            libc::EOPNOTSUPP
                        }
                    }
                },
                None => {
                    let mut wr = translate::empty_send_wr();
                    wr.wr_id = id;
                    wr.opcode = ibv_wr_opcode::IBV_WR_BIND_MW;
                    wr.send_flags = signaled;
                    wr.bind_mw_tso_union.bind_mw = rdma_sys::bind_mw_t {
                        mw,
                        rkey,
                        bind_info: info,
                    };
                    let mut bad = std::ptr::null_mut();
                    // SAFETY: the queue pair is live; `wr` outlives the call.
                    unsafe { rdma_sys::ibv_post_send(self.raw.as_ptr(), &mut wr, &mut bad) }
                }
            };
            if r != 0 {
                return Err(sys::returned("bind memory window", r));
            }
            c.next_send = (seq + 1) & SEQ_MASK;
            c.sq.push_back(SendSlot {
                seq,
                wr_id: 0,
                opcode: WcOpcode::Send,
                byte_len: 0,
                report: false,
                bind: true,
                _local: None,
                _bound: Some(mr.clone()),
            });
            seq
        };
        let deadline = Instant::now() + BIND_TIME;
        loop {
            {
                let mut c = self.lock();
                if let Some((s, st)) = c.bind_result {
                    if s == seq {
                        c.bind_result = None;
                        return match st {
                            WcStatus::Success => Ok(()),
                            _ => Err(refused("the device refused the bind")),
                        };
                    }
                }
            }
            self.send_cq.drive()?;
            if Instant::now() >= deadline {
                return Err(refused("the bind did not complete in 5 s"));
            }
            std::thread::yield_now();
        }
    }

    /// The handle is gone: disconnect, let the device flush what is outstanding (reaped by
    /// driving this queue pair's completion queues for a short while), report what is left as
    /// flushed, and release the connection.
    pub(crate) fn close(&self) {
        self.to_error("queue pair dropped");
        let deadline = Instant::now() + DRAIN_TIME;
        loop {
            {
                let c = self.lock();
                if c.sq.is_empty() && c.rq.is_empty() {
                    break;
                }
            }
            if Instant::now() >= deadline {
                break;
            }
            let _ = self.send_cq.drive();
            if !same_cq(&self.send_cq, &self.recv_cq) {
                let _ = self.recv_cq.drive();
            }
            std::thread::sleep(Duration::from_micros(50));
        }
        let mut c = self.lock();
        let flushed: Vec<Completion> =
            c.sq.drain(..)
                .filter(|s| !s.bind)
                .map(|s| self.completion(s.wr_id, WcStatus::WrFlush, s.opcode, 0))
                .collect();
        for f in flushed {
            self.send_cq.push(f);
        }
        let flushed: Vec<Completion> =
            c.rq.drain(..)
                .map(|s| self.completion(s.wr_id, WcStatus::WrFlush, WcOpcode::Recv, 0))
                .collect();
        for f in flushed {
            self.recv_cq.push(f);
        }
        if let Some(cm) = c.cm.take() {
            self.unwatch_cm(&cm);
        }
    }

    /// Adds the connection's rdma_cm channel to its completion queues' event sets.
    pub(super) fn watch_cm(&self, cm: &Conn) {
        use std::os::fd::AsFd;
        for cq in [&self.send_cq, &self.recv_cq] {
            if let Ok(c) = rdma_cq(cq) {
                c.watch_events(cm.channel.as_fd(), self.num);
            }
        }
    }

    fn unwatch_cm(&self, cm: &Conn) {
        use std::os::fd::AsFd;
        for cq in [&self.send_cq, &self.recv_cq] {
            if let Ok(c) = rdma_cq(cq) {
                c.unwatch_events(cm.channel.as_fd());
            }
        }
    }
}

/// Posts `specs` through `ibv_post_send` as one chained list. On failure: how many went to
/// the device before the refused one, and the error.
fn post_legacy(
    qp: NonNull<ibv_qp>,
    specs: &[(u64, WrSpec)],
) -> std::result::Result<(), (usize, Error)> {
    if specs.is_empty() {
        return Ok(());
    }
    let n = specs.len();
    let mut wrs: Vec<ibv_send_wr> = specs.iter().map(|_| translate::empty_send_wr()).collect();
    let mut sges: Vec<ibv_sge> = vec![
        ibv_sge {
            addr: 0,
            length: 0,
            lkey: 0
        };
        n
    ];
    // Every write below goes through these two pointers, so the pointers the list keeps
    // (`next`, `sg_list`) are derived from them and stay valid: neither vector is touched
    // again until the call returns.
    let base = wrs.as_mut_ptr();
    let sge_base = sges.as_mut_ptr();
    for (i, (id, spec)) in specs.iter().enumerate() {
        // SAFETY: `i < n`, the length of both vectors; the references made here are the only
        // live ones to those elements.
        unsafe {
            translate::fill_send_wr(spec, *id, &mut *base.add(i), &mut *sge_base.add(i));
            if i + 1 < n {
                (*base.add(i)).next = base.add(i + 1);
            }
        }
    }
    let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
    // SAFETY: the queue pair is live; the list and its scatter entries outlive the call (the
    // provider copies them into its queue); the buffers they name are held by the caller's
    // slots until the requests complete.
    let r = unsafe { rdma_sys::ibv_post_send(qp.as_ptr(), base, &mut bad) };
    if r == 0 {
        return Ok(());
    }
    let k = if bad.is_null() {
        0
    } else {
        // SAFETY: `bad` points into `wrs` (the provider names the refused request).
        unsafe { bad.offset_from(base) }.clamp(0, specs.len() as isize) as usize
    };
    Err((k, sys::returned("ibv_post_send", r)))
}

/// Posts `specs` through the `ibv_wr_*` calls (the path with Atomic Write). All or nothing.
fn post_ex(
    ex: NonNull<ibv_qp_ex>,
    specs: &[(u64, WrSpec)],
) -> std::result::Result<(), (usize, Error)> {
    let q = ex.as_ptr();
    let unsupported = || (0, sys::returned("ibv_wr_*", libc::EOPNOTSUPP));
    // SAFETY: the extended queue pair is live; between ibv_wr_start and ibv_wr_complete (or
    // abort) each request is one opcode call then its scatter entry; every pointer passed is
    // valid for the call (the provider copies into its queue, including Atomic Write's 8
    // bytes); the buffers named are held by the caller's slots until completion.
    unsafe {
        rdma_sys::ibv_wr_start(q);
        for (id, w) in specs {
            (*q).wr_id = *id;
            (*q).wr_flags = w.send_flags;
            let (raddr, rkey) = w.remote.unwrap_or((0, 0));
            let ok = match w.opcode {
                ibv_wr_opcode::IBV_WR_RDMA_WRITE => (*q).wr_rdma_write.map(|f| f(q, rkey, raddr)),
                ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM => (*q)
                    .wr_rdma_write_imm
                    .map(|f| f(q, rkey, raddr, w.imm.unwrap_or(0).to_be())),
                ibv_wr_opcode::IBV_WR_RDMA_READ => (*q).wr_rdma_read.map(|f| f(q, rkey, raddr)),
                ibv_wr_opcode::IBV_WR_SEND => (*q).wr_send.map(|f| f(q)),
                ibv_wr_opcode::IBV_WR_SEND_WITH_INV => (*q)
                    .wr_send_inv
                    .map(|f| f(q, w.invalidate_rkey.unwrap_or(0))),
                ibv_wr_opcode::IBV_WR_ATOMIC_CMP_AND_SWP => (*q)
                    .wr_atomic_cmp_swp
                    .map(|f| f(q, rkey, raddr, w.compare_add, w.swap)),
                ibv_wr_opcode::IBV_WR_ATOMIC_FETCH_AND_ADD => (*q)
                    .wr_atomic_fetch_add
                    .map(|f| f(q, rkey, raddr, w.compare_add)),
                ibv_wr_opcode::IBV_WR_ATOMIC_WRITE => {
                    let value = w.atomic_value.unwrap_or(0);
                    (*q).wr_atomic_write
                        .map(|f| f(q, rkey, raddr, (&value as *const u64).cast()))
                }
                _ => None,
            };
            if ok.is_none() {
                rdma_sys::ibv_wr_abort(q);
                return Err(unsupported());
            }
            if let Some((addr, len, lkey)) = w.sge {
                match (*q).wr_set_sge {
                    Some(f) => f(q, lkey, addr, len),
                    None => {
                        rdma_sys::ibv_wr_abort(q);
                        return Err(unsupported());
                    }
                }
            }
        }
        let r = rdma_sys::ibv_wr_complete(q);
        if r != 0 {
            return Err((0, sys::returned("ibv_wr_complete", r)));
        }
    }
    Ok(())
}

impl Drop for Qp {
    fn drop(&mut self) {
        self.dev.unregister_qp(self.num);
        if let Some(cm) = self.lock().cm.take() {
            self.unwatch_cm(&cm);
        }
        // SAFETY: the queue pair is live and destroyed once, here; nothing posts to it any
        // more (its handle is gone) and the registry no longer names it, so no completion is
        // handed to it; the tables' buffers are released after it is gone (the fields drop
        // after this body).
        unsafe { rdma_sys::ibv_destroy_qp(self.raw.as_ptr()) };
        let (s, r) = (self.caps.max_send_wr as u32, self.caps.max_recv_wr as u32);
        if let (Ok(scq), Ok(rcq)) = (rdma_cq(&self.send_cq), rdma_cq(&self.recv_cq)) {
            if same_cq(&self.send_cq, &self.recv_cq) {
                scq.release(s + r);
            } else {
                scq.release(s);
                rcq.release(r);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn receive_tokens_are_told_from_send_tokens() {
        let send = translate::token(5, SEQ_MASK);
        let recv = translate::token(5, 3 | RECV_BIT);
        assert_eq!(translate::untoken(send).1 & RECV_BIT, 0);
        assert_eq!(translate::untoken(recv).1 & RECV_BIT, RECV_BIT);
        assert_eq!(translate::untoken(recv).1 & SEQ_MASK, 3);
        // Sequence numbers wrap inside 31 bits, never into the receive bit.
        assert_eq!((SEQ_MASK + 1) & SEQ_MASK, 0);
    }
}
