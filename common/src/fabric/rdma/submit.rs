//! Posting on the rdma queue pair: the user's send and receive requests checked (as the soft
//! transport checks them, with this device's capabilities), entered in the queue pair's tables
//! and handed to the device with one doorbell, and the memory window binds of the transport's
//! own. The tables, and what keeps their buffers alive, are `qp.rs`'s.

use std::sync::Arc;
use std::time::Instant;

use rdma_sys::{ibv_recv_wr, ibv_sge, ibv_wr_opcode};

use super::mr::{Mr, Mw};
use super::post;
use super::qp::{hw_depth, Core, Qp, RecvSlot, SendSlot, SlotKind, BIND_TIME, RECV_BIT, SEQ_MASK};
use super::sys;
use super::translate::{self, caps};
use crate::fabric::error::{Error, QpFailure, Result};
use crate::fabric::memory::{Grant, Region};
use crate::fabric::types::{Access, QpState, SendFlags, WcOpcode, WcStatus};
use crate::fabric::wr::{check_atomic_args, RecvWr, SendOp, SendWr, Sge};

impl Qp {
    fn check_sge(&self, s: &Sge, need: Access) -> Result<()> {
        if s.domain() != self.domain {
            return Err(Error::WrongDomain {
                what: "memory region",
            });
        }
        s.check_local(need)
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
        self.reserve_recv(&mut c)?;
        let seq = c.next_recv;
        let mut sge = match &wr.local {
            Some(s) => ibv_sge {
                addr: s.addr(),
                length: s.len as u32,
                lkey: s.lkey(),
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

    /// Makes sure the receive completion queue has an entry for one more receive and the
    /// drain marker (every receive still outstanding, those closing holds included, may
    /// complete): the reservation grows by doubling, up to the queue's own depth, and fails
    /// with [`Error::Exhausted`] where the device's largest completion queue is full.
    fn reserve_recv(&self, c: &mut Core) -> Result<()> {
        let need = (c.rq.len() + c.held_recvs.len()) as u32 + 2;
        if need <= c.recv_reserved {
            return Ok(());
        }
        let full = hw_depth(self.caps.max_recv_wr);
        let grown = need.max(c.recv_reserved.saturating_mul(2)).min(full);
        let more = grown.saturating_sub(c.recv_reserved);
        // Asked for a little more than needed first; exactly what is needed if that fails.
        if more > 0 && self.recv_cq.reserve(more).is_ok() {
            c.recv_reserved = grown;
            return Ok(());
        }
        let more = need.min(full).saturating_sub(c.recv_reserved);
        self.recv_cq.reserve(more)?;
        c.recv_reserved += more;
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
                check_atomic_args(local, *remote)?;
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
            let spec = translate::spec(&wr.op, flags, |s| (s.addr(), s.lkey()));
            specs.push((translate::token(self.tag, seq), spec));
        }
        let posted = match self.ex {
            Some(ex) => post::post_ex(ex, &specs),
            None => post::post_legacy(self.raw, &specs),
        };
        let n = match posted {
            Ok(()) => specs.len(),
            Err((0, e)) => {
                if gone(&e) && !self.dev.answers() {
                    // The kernel disassociated the context: the device is lost, and the
                    // queue pair with it (its owner sees a lost connection, not a bad post),
                    // and every other one on it (after this lock).
                    self.enter_error(&mut c, QpFailure::DeviceRemoved);
                    drop(c);
                    self.dev.lose(QpFailure::DeviceRemoved);
                }
                return Err(e);
            }
            Err((k, e)) => {
                // Some went to the device: they complete (flushed, now) and must be tracked.
                self.push_slots(&mut c, &mut wrs[..k]);
                self.enter_error(&mut c, QpFailure::PostRefused { posted: k });
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

    /// Binds window `w` for this queue pair over the grant's range of region `mr`; returns the
    /// new rkey. The window keeps its own state (`mr.rs`); the bind is posted here.
    pub(crate) fn bind_mw(&self, w: &Mw, mr: &Mr, g: &Grant<'_>) -> Result<u32> {
        w.bind(mr, g, |raw, rkey, access| {
            self.bind_window(raw, rkey, mr, g.region, g.base, g.len, access)
        })
    }

    /// Binds type-2 window `mw` (unbound: type-2 windows bind only from the free state) to
    /// `len` bytes at `addr` of `mr` (whose memory is `memory`) under `rkey`, posting the bind
    /// and driving the send queue's completions until it is done.
    #[allow(clippy::too_many_arguments)]
    fn bind_window(
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
            self.send_cq.progress()?;
            if Instant::now() >= deadline {
                return Err(refused("the bind did not complete in 5 s"));
            }
            std::thread::yield_now();
        }
    }
}

/// Whether a refused post says the device is gone: EIO, which the kernel answers every call on
/// a context it disassociated (the device was removed or failed) with. A provider that posts
/// without the kernel (a doorbell in mapped memory) never sees it; its requests just never
/// complete, and the owner's time-out finds the loss.
fn gone(e: &Error) -> bool {
    matches!(e, Error::Verbs { source, .. } if source.raw_os_error() == Some(libc::EIO))
}
