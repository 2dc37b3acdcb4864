//! The rdma transport's queue pair: an RC `ibv_qp` made with its protection domain and
//! completion queues (so that receives can be posted before the connection exists), its
//! tables of posted requests, and its life (made, in Error, drained, destroyed). Posting is in
//! `submit.rs`, the verbs calls in `post.rs`, completions in `wc.rs`.
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
//! Here: the queue pair, its tables and its life (made, moved to Error, drained, destroyed).
//! Posting into the tables is in `submit.rs`, the completions that empty them in `wc.rs`,
//! connection set-up (rdma_cm) in `link.rs`.

use std::collections::VecDeque;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rdma_sys::{
    ibv_qp, ibv_qp_attr, ibv_qp_attr_mask as am, ibv_qp_ex, ibv_qp_state, ibv_recv_wr,
    ibv_wr_opcode,
};

use super::cm::Conn;
use super::cq::Cq;
use super::device::{Device, Pd, QpEvents};
use super::mr::Mr;
use super::post;
use super::sys;
use super::translate::{self, caps};
use crate::fabric::completions::Completions;
use crate::fabric::error::{Error, QpFailure, Result};
use crate::fabric::memory::Region;
use crate::fabric::params::ConnInfo;
use crate::fabric::types::{Access, DomainId, QpCaps, QpState, WcOpcode, WcStatus};
use crate::fabric::wr::Sge;

/// Sequence numbers are 31 bits; the top bit of a hardware `wr_id`'s low half marks receives
/// (a failed completion's opcode is undefined, so it cannot say which queue it is of).
pub(super) const SEQ_MASK: u32 = (1 << 31) - 1;
pub(super) const RECV_BIT: u32 = 1 << 31;

/// How long closing waits for the device to flush what is outstanding.
const DRAIN_TIME: Duration = Duration::from_millis(500);
/// How long a memory window bind may take.
pub(super) const BIND_TIME: Duration = Duration::from_secs(5);

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
    pub(super) error: Option<QpFailure>,
    pub(super) info: Option<ConnInfo>,
    pub(super) cm: Option<Conn>,
    pub(super) max_message: usize,
    /// The peer's capability flags (`caps::*`).
    pub(super) peer_flags: u8,
    pub(super) sq: VecDeque<SendSlot>,
    pub(super) next_send: u32,
    /// Unsignaled requests posted since the last one signaled in hardware.
    pub(super) unsignaled: u32,
    pub(super) rq: VecDeque<RecvSlot>,
    pub(super) next_recv: u32,
    /// The receive completion queue's entries reserved for this queue pair's receives (the
    /// drain marker's included): grown as receives are posted, up to `hw_depth(max_recv_wr)`,
    /// so that a queue pair made for a deep session but holding only a few receives (a
    /// connection not yet admitted) takes only as many entries as it may complete.
    pub(super) recv_reserved: u32,
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
            recv_reserved: RECV_RESERVED_FIRST,
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

/// The receive completion entries a new queue pair reserves (its drain marker and a few
/// receives); posting more grows the reservation (`Qp::post_recv`).
const RECV_RESERVED_FIRST: u32 = 8;

/// An rdma queue pair. Shared by its handle and (weakly) by the device's registry, through
/// which its completion queues find it.
pub(crate) struct Qp {
    pub(crate) num: u32,
    /// The protection domain: local buffers must be of it.
    pub(super) domain: DomainId,
    pub(super) tag: u32,
    pub(super) dev: Device,
    pub(super) raw: NonNull<ibv_qp>,
    /// The extended queue pair (the `ibv_wr_*` posting calls), made when the device has
    /// Atomic Write, which only that path posts.
    pub(super) ex: Option<NonNull<ibv_qp_ex>>,
    pub(super) send_cq: Arc<Cq>,
    pub(super) recv_cq: Arc<Cq>,
    pub(super) caps: QpCaps,
    _rpd: Pd,
    core: Mutex<Core>,
}

// SAFETY: libibverbs queue pairs may be posted to and modified from any thread; every use of
// the pointers here is under `core`'s lock or a verbs call that is itself thread-safe, and
// they are destroyed only in Drop.
unsafe impl Send for Qp {}
// SAFETY: as for Send.
unsafe impl Sync for Qp {}

impl Device {
    /// A queue pair in Init in `rpd` (protection domain `domain`), its receives postable.
    pub(crate) fn create_qp(
        &self,
        domain: DomainId,
        rpd: &Pd,
        send_cq: &Arc<Cq>,
        recv_cq: &Arc<Cq>,
        caps: QpCaps,
    ) -> Result<Arc<Qp>> {
        let rpd = rpd.clone();
        let (scq, rcq) = (send_cq, recv_cq);
        // The device queues have a slot more than the tables (`hw_depth`).
        let max = self.caps().max_qp_wr as usize;
        if caps.max_send_wr >= max || caps.max_recv_wr >= max {
            return Err(Error::Exhausted {
                what: "queue pair depth (the device's max_qp_wr, less one for the drain marker)",
            });
        }
        // The send queue's entries at once; the receive queue's as receives are posted.
        let s = hw_depth(caps.max_send_wr);
        let r = RECV_RESERVED_FIRST.min(hw_depth(caps.max_recv_wr));
        if Arc::ptr_eq(scq, rcq) {
            scq.reserve(s + r)?;
        } else {
            scq.reserve(s)?;
            if let Err(e) = rcq.reserve(r) {
                scq.release(s);
                return Err(e);
            }
        }
        let unreserve = || {
            if Arc::ptr_eq(scq, rcq) {
                scq.release(s + r);
            } else {
                scq.release(s);
                rcq.release(r);
            }
        };
        let depths = (s, hw_depth(caps.max_recv_wr));
        let (raw, ex) = match post::create_raw(self, &rpd, scq.raw(), rcq.raw(), depths.0, depths.1)
        {
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
            domain,
            tag: NEXT_TAG.fetch_add(1, Ordering::Relaxed),
            dev: self.clone(),
            raw,
            ex,
            send_cq: Arc::clone(send_cq),
            recv_cq: Arc::clone(recv_cq),
            caps,
            _rpd: rpd,
            core: Mutex::new(Core {
                recv_reserved: r,
                ..Core::new()
            }),
        });
        // From here on the queue pair's Drop destroys it and gives the reservations back.
        qp.to_init()?;
        let events: Arc<dyn QpEvents> = qp.clone();
        self.register_qp(num, Arc::downgrade(&events));
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

    pub(crate) fn error(&self) -> Option<QpFailure> {
        self.lock().error.clone()
    }

    pub(crate) fn check_rts(&self, op: &'static str) -> Result<()> {
        let st = self.state();
        if st != QpState::Rts {
            return Err(self.wrong_state(st, op, QpState::Rts));
        }
        Ok(())
    }

    pub(super) fn wrong_state(&self, state: QpState, op: &'static str, needed: QpState) -> Error {
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

    /// Moves to Error (once): the device flushes every outstanding request.
    pub(super) fn enter_error(&self, c: &mut Core, why: QpFailure) {
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

    pub(crate) fn to_error(&self, why: QpFailure) {
        let mut c = self.lock();
        self.enter_error(&mut c, why);
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

    /// The handle is gone: disconnect, drain both queues (see the module docs; reaped by
    /// driving this queue pair's completion queues, for at most a short while should the
    /// device not answer), report what the user still waits for as flushed, and release the
    /// connection.
    pub(crate) fn close(&self) {
        self.to_error(QpFailure::Dropped);
        self.post_drain_markers();
        // A lost device completes nothing more: what is left is reported flushed at once
        // (a poll loop dropping every session of a removed device must not wait for each).
        let deadline = if self.dev.is_lost() {
            Instant::now()
        } else {
            Instant::now() + DRAIN_TIME
        };
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
            let _ = self.send_cq.progress();
            if !Arc::ptr_eq(&self.send_cq, &self.recv_cq) {
                let _ = self.recv_cq.progress();
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
            cq.watch_events(cm.channel.as_fd(), self.num);
        }
    }

    fn unwatch_cm(&self, cm: &Conn) {
        use std::os::fd::AsFd;
        for cq in [&self.send_cq, &self.recv_cq] {
            cq.unwatch_events(cm.channel.as_fd());
        }
    }
}

impl QpEvents for Qp {
    fn complete(&self, wc: &rdma_sys::ibv_wc, list: &Completions) {
        Qp::complete(self, wc, list)
    }
    fn handle_cm_events(&self) {
        Qp::handle_cm_events(self)
    }
    fn to_error(&self, why: QpFailure) {
        Qp::to_error(self, why)
    }
    fn notify_established(&self) {
        Qp::notify_established(self)
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
        let s = hw_depth(self.caps.max_send_wr);
        let r = self
            .core
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .recv_reserved;
        if Arc::ptr_eq(&self.send_cq, &self.recv_cq) {
            self.send_cq.release(s + r);
        } else {
            self.send_cq.release(s);
            self.recv_cq.release(r);
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
