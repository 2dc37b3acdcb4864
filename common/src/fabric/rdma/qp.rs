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
//! Closing drains as `ib_drain_sq`/`ib_drain_rq` do: in Error, one signaled marker is posted
//! to each queue (the device queues have a slot more than the tables allow, for it); a request
//! posted in Error completes at once, flushed, and after everything before it, so its
//! completion retires what is left in the table, unsignaled requests that ran included. The
//! tables' buffers are released only after `ibv_destroy_qp`.
//!
//! Connection set-up (rdma_cm) is in `link.rs`; the tables and posting are here.

use std::collections::VecDeque;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rdma_sys::{
    ibv_qp, ibv_qp_attr, ibv_qp_attr_mask as am, ibv_qp_ex, ibv_qp_state, ibv_recv_wr, ibv_sge,
    ibv_wr_opcode,
};

use super::cm::Conn;
use super::device::{Device, Pd};
use super::mr::Mr;
use super::post;
use super::sys;
use super::translate::{self, caps};
use crate::fabric::cq::CompletionQueue;
use crate::fabric::error::{Error, Result};
use crate::fabric::mr::Region;
use crate::fabric::pd::ProtectionDomain;
use crate::fabric::qp::ConnInfo;
use crate::fabric::transport::{CqEngine, PdEngine};
use crate::fabric::types::{
    Access, QpCaps, QpState, RecvWr, SendFlags, SendOp, SendWr, Sge, WcOpcode, WcStatus,
};

/// Sequence numbers are 31 bits; the top bit of a hardware `wr_id`'s low half marks receives
/// (a failed completion's opcode is undefined, so it cannot say which queue it is of).
pub(super) const SEQ_MASK: u32 = (1 << 31) - 1;
pub(super) const RECV_BIT: u32 = 1 << 31;

/// How long closing waits for the device to flush what is outstanding.
const DRAIN_TIME: Duration = Duration::from_millis(500);
/// How long a memory window bind may take.
const BIND_TIME: Duration = Duration::from_secs(5);

static NEXT_TAG: AtomicU32 = AtomicU32::new(1);

/// Whose a send-queue request is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum SlotKind {
    /// The user's.
    Request,
    /// A memory window bind of the transport's own.
    Bind,
    /// The marker closing posts (see the module docs).
    Drain,
}

/// A posted send-queue request, until its completion (or a later one's) is reaped.
pub(super) struct SendSlot {
    pub(super) seq: u32,
    pub(super) wr_id: u64,
    pub(super) opcode: WcOpcode,
    pub(super) byte_len: u32,
    /// The user asked for its completion (errors are reported anyway).
    pub(super) report: bool,
    pub(super) kind: SlotKind,
    pub(super) _local: Option<Sge>,
    // A bind's region: the registration, then (dropped after it) the memory it names.
    pub(super) _bound: Option<Mr>,
    pub(super) _memory: Option<Arc<Region>>,
}

pub(super) struct RecvSlot {
    pub(super) seq: u32,
    pub(super) wr_id: u64,
    /// The marker closing posts.
    pub(super) drain: bool,
    pub(super) _local: Option<Sge>,
}

pub(super) struct Core {
    pub(super) state: QpState,
    pub(super) error: Option<String>,
    pub(super) info: Option<ConnInfo>,
    pub(super) cm: Option<Conn>,
    pub(super) max_message: usize,
    /// The peer's capability flags (`caps::*`).
    pub(super) peer_flags: u8,
    pub(super) sq: VecDeque<SendSlot>,
    next_send: u32,
    /// Unsignaled requests posted since the last one signaled in hardware.
    unsignaled: u32,
    pub(super) rq: VecDeque<RecvSlot>,
    next_recv: u32,
    /// Completed binds (sequence number and status) until their binder takes them.
    pub(super) bind_results: Vec<(u32, WcStatus)>,
    /// Closing posted its drain markers.
    drain_posted: bool,
    /// What closing found still outstanding: kept until the queue pair is destroyed, since
    /// the device may still use it.
    pub(super) held_sends: Vec<SendSlot>,
    pub(super) held_recvs: Vec<RecvSlot>,
}

impl Core {
    pub(super) fn new() -> Core {
        Core {
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
            bind_results: Vec::new(),
            drain_posted: false,
            held_sends: Vec::new(),
            held_recvs: Vec::new(),
        }
    }
}

/// The device queue's depth for a table of `n` requests: one more, for the drain marker.
pub(super) fn hw_depth(n: usize) -> u32 {
    n as u32 + 1
}

/// An rdma queue pair. Shared by its handle and (weakly) by the device's registry, through
/// which its completion queues find it.
pub(crate) struct Qp {
    pub(crate) num: u32,
    pub(crate) pd: ProtectionDomain,
    pub(super) tag: u32,
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
        // The device queues have a slot more than the tables (`hw_depth`).
        let max = self.caps().max_qp_wr as usize;
        if caps.max_send_wr >= max || caps.max_recv_wr >= max {
            return Err(Error::Exhausted {
                what: "queue pair depth (the device's max_qp_wr, less one for the drain marker)",
            });
        }
        let (s, r) = (hw_depth(caps.max_send_wr), hw_depth(caps.max_recv_wr));
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
        let (raw, ex) = match post::create_raw(self, &rpd, scq.raw(), rcq.raw(), s, r) {
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
            core: Mutex::new(Core::new()),
        });
        // From here on the queue pair's Drop destroys it and gives the reservations back.
        qp.to_init()?;
        self.register_qp(num, Arc::downgrade(&qp));
        Ok(qp)
    }
}

impl Qp {
    pub(super) fn lock(&self) -> MutexGuard<'_, Core> {
        self.core.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Reset to Init on port 1 with the remote rights every connection of this project uses
    /// (receives may be posted from Init on). rdma_cm's Init attributes replace these at
    /// connect: the route's port and P_Key, and the rights, which it gives as none until the
    /// connection exists; `link.rs` moves through Init again once it does.
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
            drain: false,
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
                crate::fabric::types::check_atomic_args(local, *remote)?;
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
        wr.check_solicited()
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
            Some(ex) => post::post_ex(ex, &specs),
            None => post::post_legacy(self.raw, &specs),
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
            let opcode = wr.op.wc_opcode();
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
                kind: SlotKind::Request,
                _local: local,
                _bound: None,
                _memory: None,
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

    /// The device saw this queue pair's first packet before the RTU: rdma_cm is told.
    pub(crate) fn notify_established(&self) {
        if let Some(cm) = &self.lock().cm {
            cm.id.notify_established();
        }
    }

    /// Binds type-2 window `mw` (unbound: type-2 windows bind only from the free state) to
    /// `len` bytes at `addr` of `mr` (whose memory is `memory`) under `rkey`, posting the bind
    /// and driving the send queue's completions until it is done.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn bind_window(
        &self,
        mw: *mut rdma_sys::ibv_mw,
        rkey: u32,
        mr: &Mr,
        memory: &Arc<Region>,
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
                kind: SlotKind::Bind,
                _local: None,
                _bound: Some(mr.clone()),
                _memory: Some(memory.clone()),
            });
            seq
        };
        let deadline = Instant::now() + BIND_TIME;
        loop {
            {
                let mut c = self.lock();
                if let Some(i) = c.bind_results.iter().position(|&(s, _)| s == seq) {
                    let (_, st) = c.bind_results.swap_remove(i);
                    return match st {
                        WcStatus::Success => Ok(()),
                        _ => Err(refused("the device refused the bind")),
                    };
                }
            }
            self.send_cq.drive()?;
            if Instant::now() >= deadline {
                return Err(refused("the bind did not complete in 5 s"));
            }
            std::thread::yield_now();
        }
    }

    /// The handle is gone: disconnect, drain both queues (see the module docs; reaped by
    /// driving this queue pair's completion queues, for at most a short while should the
    /// device not answer), report what the user still waits for as flushed, and release the
    /// connection.
    pub(crate) fn close(&self) {
        self.to_error("queue pair dropped");
        self.post_drain_markers();
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
        let (sends, recvs) = c.hold_leftovers();
        for (wr_id, opcode) in sends {
            self.send_cq
                .push(self.completion(wr_id, WcStatus::WrFlush, opcode, 0));
        }
        for wr_id in recvs {
            self.recv_cq
                .push(self.completion(wr_id, WcStatus::WrFlush, WcOpcode::Recv, 0));
        }
        if let Some(cm) = c.cm.take() {
            self.unwatch_cm(&cm);
        }
    }

    /// Posts the drain markers (once, in Error). One that the device refuses leaves that
    /// queue to the drain's time limit.
    fn post_drain_markers(&self) {
        let mut c = self.lock();
        if c.drain_posted || c.state != QpState::Error {
            return;
        }
        c.drain_posted = true;
        let seq = c.next_send;
        let mut wr = translate::empty_send_wr();
        wr.wr_id = translate::token(self.tag, seq);
        // A zero-length Write, as ib_drain_sq posts: no buffer, no remote key is used.
        wr.opcode = ibv_wr_opcode::IBV_WR_RDMA_WRITE;
        wr.send_flags = rdma_sys::ibv_send_flags::IBV_SEND_SIGNALED.0;
        let mut bad = std::ptr::null_mut();
        // SAFETY: the queue pair is live and in Error; `wr` (no scatter list) outlives the
        // call; the device queue has room for it (`hw_depth`). On an extended queue pair the
        // plain post is serialized with the `ibv_wr_*` ones by the core lock, held here.
        if unsafe { rdma_sys::ibv_post_send(self.raw.as_ptr(), &mut wr, &mut bad) } == 0 {
            c.next_send = (seq + 1) & SEQ_MASK;
            c.sq.push_back(SendSlot {
                seq,
                wr_id: 0,
                opcode: WcOpcode::RdmaWrite,
                byte_len: 0,
                report: false,
                kind: SlotKind::Drain,
                _local: None,
                _bound: None,
                _memory: None,
            });
        }
        let seq = c.next_recv;
        let mut rwr = ibv_recv_wr {
            wr_id: translate::token(self.tag, seq | RECV_BIT),
            next: std::ptr::null_mut(),
            sg_list: std::ptr::null_mut(),
            num_sge: 0,
        };
        let mut bad = std::ptr::null_mut();
        // SAFETY: as for the send marker; a receive with no buffer.
        if unsafe { rdma_sys::ibv_post_recv(self.raw.as_ptr(), &mut rwr, &mut bad) } == 0 {
            c.next_recv = (seq + 1) & SEQ_MASK;
            c.rq.push_back(RecvSlot {
                seq,
                wr_id: 0,
                drain: true,
                _local: None,
            });
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

impl Drop for Qp {
    fn drop(&mut self) {
        self.dev.unregister_qp(self.num);
        if let Some(cm) = self.lock().cm.take() {
            self.unwatch_cm(&cm);
        }
        // SAFETY: the queue pair is live and destroyed once, here; nothing posts to it any
        // more (its handle is gone) and the registry no longer names it, so no completion is
        // handed to it; the tables' buffers, and those closing held, are released after it is
        // gone (`core` drops after this body).
        unsafe { rdma_sys::ibv_destroy_qp(self.raw.as_ptr()) };
        let (s, r) = (
            hw_depth(self.caps.max_send_wr),
            hw_depth(self.caps.max_recv_wr),
        );
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
