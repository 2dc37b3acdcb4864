//! Completions of the rdma queue pair: a work completion the queue reaped, matched to its
//! request by the sequence number in its `wr_id` (the tag in it tells one of an earlier queue
//! pair with the same number), what the request held released, and the fabric's completion
//! made from the request's own record (a failed completion's opcode is undefined).

use rdma_sys::{ibv_wc, ibv_wc_flags};

use super::qp::{Core, Qp, RECV_BIT, SEQ_MASK};
use super::translate;
use crate::fabric::transport::Entries;
use crate::fabric::types::{Completion, QpState, WcOpcode, WcStatus};

impl Qp {
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

    pub(super) fn completion(
        &self,
        wr_id: u64,
        status: WcStatus,
        opcode: WcOpcode,
        len: u32,
    ) -> Completion {
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
}
