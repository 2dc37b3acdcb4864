//! Completions of the rdma queue pair: a work completion the queue reaped, matched to its
//! request by the sequence number in its `wr_id` (the tag in it tells one of an earlier queue
//! pair with the same number), what the request held released, and the fabric's completion
//! made from the request's own record (a failed completion's opcode is undefined).

use rdma_sys::{ibv_wc, ibv_wc_flags};

use super::qp::{Core, Qp, SlotKind, RECV_BIT, SEQ_MASK};
use super::translate;
use crate::fabric::completions::Completions;
use crate::fabric::error::QpFailure;
use crate::fabric::types::{Completion, QpState, WcOpcode, WcStatus};

impl Qp {
    /// Takes a completion the queue reaped: releases what its request held and reports it.
    pub(crate) fn complete(&self, wc: &ibv_wc, list: &Completions) {
        let (tag, low) = translate::untoken(wc.wr_id);
        if tag != self.tag {
            return; // a completion of an earlier queue pair with this number
        }
        let status = translate::status_from_ibv(wc.status);
        let mut c = self.lock();
        if status != WcStatus::Success && status != WcStatus::WrFlush {
            let why = QpFailure::RequestFailed {
                status,
                vendor_err: wc.vendor_err,
            };
            self.enter_error(&mut c, why);
        } else if status == WcStatus::WrFlush && c.state != QpState::Error {
            self.enter_error(&mut c, QpFailure::Flushed);
        }
        let out = if low & RECV_BIT != 0 {
            self.complete_recv(&mut c, wc, low & SEQ_MASK, status)
        } else {
            self.complete_send(&mut c, wc, low, status)
        };
        if let Some(done) = out {
            list.push(done);
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
        let (wr_id, opcode, byte_len) = c.retire_send(seq, status)?;
        Some(self.completion(wr_id, status, opcode, byte_len))
    }

    fn complete_recv(
        &self,
        c: &mut Core,
        wc: &ibv_wc,
        seq: u32,
        status: WcStatus,
    ) -> Option<Completion> {
        let slot = c.retire_recv(seq)?;
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

impl Core {
    /// Takes send request `seq`'s completion out of the table: what the user is told of it
    /// (wr_id, opcode, length), if anything. Only a sequence number still in the table counts
    /// (a duplicate or stale one is dropped rather than releasing what later requests hold).
    pub(super) fn retire_send(
        &mut self,
        seq: u32,
        status: WcStatus,
    ) -> Option<(u64, WcOpcode, u32)> {
        let pos = self.sq.iter().position(|s| s.seq == seq)?;
        // The earlier ones are done: RC completes in order, and an unsignaled success has no
        // completion of its own.
        self.sq.drain(..pos);
        let slot = self.sq.pop_front()?;
        match slot.kind {
            SlotKind::Bind => {
                self.bind_results.push((seq, status));
                None
            }
            // Everything before it is retired (above); it is nobody's.
            SlotKind::Drain => None,
            SlotKind::Request => (status != WcStatus::Success || slot.report).then_some((
                slot.wr_id,
                slot.opcode,
                slot.byte_len,
            )),
        }
    }

    /// Takes receive `seq` out of the table; None for a stale one or the drain marker (whose
    /// completion comes after every earlier receive's: they are done).
    pub(super) fn retire_recv(&mut self, seq: u32) -> Option<super::qp::RecvSlot> {
        let pos = self.rq.iter().position(|s| s.seq == seq)?;
        if self.rq[pos].drain {
            self.rq.drain(..=pos);
            return None;
        }
        self.rq.remove(pos)
    }

    /// What closing found outstanding: the send requests (wr_id, opcode) and receives (wr_id)
    /// to report as flushed (the user's that it asked to hear of: an unsignaled request left
    /// here may well have run, and a failed one would have been reported by the device), their
    /// buffers moved aside to be released after the queue pair is destroyed.
    pub(super) fn hold_leftovers(&mut self) -> (Vec<(u64, WcOpcode)>, Vec<u64>) {
        let sends = self
            .sq
            .iter()
            .filter(|s| s.kind == SlotKind::Request && s.report)
            .map(|s| (s.wr_id, s.opcode))
            .collect();
        let recvs = self
            .rq
            .iter()
            .filter(|s| !s.drain)
            .map(|s| s.wr_id)
            .collect();
        let sq: Vec<_> = self.sq.drain(..).collect();
        self.held_sends.extend(sq);
        let rq: Vec<_> = self.rq.drain(..).collect();
        self.held_recvs.extend(rq);
        (sends, recvs)
    }
}

#[cfg(test)]
mod tests {
    use super::super::qp::{RecvSlot, SendSlot};
    use super::*;

    fn send(seq: u32, report: bool, kind: SlotKind) -> SendSlot {
        SendSlot {
            seq,
            wr_id: 100 + u64::from(seq),
            opcode: WcOpcode::RdmaWrite,
            byte_len: 4096,
            report,
            kind,
            _local: None,
            _bound: None,
            _memory: None,
        }
    }

    fn recv(seq: u32, drain: bool) -> RecvSlot {
        RecvSlot {
            seq,
            wr_id: 200 + u64::from(seq),
            drain,
            _local: None,
        }
    }

    #[test]
    fn a_signaled_completion_retires_the_unsignaled_ones_before_it() {
        let mut c = Core::new();
        c.sq.extend([
            send(0, false, SlotKind::Request),
            send(1, false, SlotKind::Request),
            send(2, true, SlotKind::Request),
            send(3, false, SlotKind::Request),
        ]);
        assert_eq!(
            c.retire_send(2, WcStatus::Success),
            Some((102, WcOpcode::RdmaWrite, 4096))
        );
        assert_eq!(c.sq.len(), 1);
        // Stale and duplicate numbers change nothing.
        assert_eq!(c.retire_send(2, WcStatus::Success), None);
        assert_eq!(c.retire_send(77, WcStatus::Success), None);
        assert_eq!(c.sq.len(), 1);
        // An unsignaled request's failure is reported.
        assert_eq!(
            c.retire_send(3, WcStatus::WrFlush),
            Some((103, WcOpcode::RdmaWrite, 4096))
        );
        assert!(c.sq.is_empty());
    }

    #[test]
    fn the_drain_marker_retires_what_ran_unsignaled_and_is_not_reported() {
        let mut c = Core::new();
        // 0 and 1 ran unsignaled before the queue pair went to Error: no completion of
        // their own. 2 was flushed (reported), then the marker completes.
        c.sq.extend([
            send(0, false, SlotKind::Request),
            send(1, false, SlotKind::Request),
            send(2, true, SlotKind::Request),
            send(3, false, SlotKind::Drain),
        ]);
        assert_eq!(
            c.retire_send(2, WcStatus::WrFlush),
            Some((102, WcOpcode::RdmaWrite, 4096))
        );
        assert_eq!(c.retire_send(3, WcStatus::WrFlush), None);
        assert!(c.sq.is_empty(), "the marker empties the table");
        assert_eq!(c.hold_leftovers(), (vec![], vec![]));
    }

    #[test]
    fn binds_keep_their_own_results() {
        let mut c = Core::new();
        c.sq.extend([
            send(0, false, SlotKind::Bind),
            send(1, false, SlotKind::Bind),
        ]);
        assert_eq!(c.retire_send(0, WcStatus::Success), None);
        assert_eq!(c.retire_send(1, WcStatus::MwBind), None);
        // Two binds in flight at once: neither result overwrites the other.
        assert_eq!(
            c.bind_results,
            vec![(0, WcStatus::Success), (1, WcStatus::MwBind)]
        );
    }

    #[test]
    fn the_receive_marker_retires_the_receives_before_it() {
        let mut c = Core::new();
        c.rq.extend([recv(0, false), recv(1, false), recv(2, true)]);
        // Receives complete out of the table's order only by number; each is its own.
        assert_eq!(c.retire_recv(1).map(|s| s.wr_id), Some(201));
        assert!(c.retire_recv(1).is_none());
        assert!(c.retire_recv(2).is_none(), "the marker is nobody's");
        assert!(c.rq.is_empty());
    }

    #[test]
    fn leftovers_reported_are_only_those_the_user_waits_for() {
        let mut c = Core::new();
        c.sq.extend([
            send(0, false, SlotKind::Request),
            send(1, true, SlotKind::Request),
            send(2, false, SlotKind::Bind),
            send(3, false, SlotKind::Drain),
        ]);
        c.rq.extend([recv(0, false), recv(1, true)]);
        let (sends, recvs) = c.hold_leftovers();
        assert_eq!(sends, vec![(101, WcOpcode::RdmaWrite)]);
        assert_eq!(recvs, vec![200]);
        // Nothing is released yet: the device may still use the buffers.
        assert!(c.sq.is_empty() && c.rq.is_empty());
        assert_eq!((c.held_sends.len(), c.held_recvs.len()), (4, 2));
    }
}
