//! The requester half of the engine: validating and issuing posted work requests (in order,
//! within ORD and fences) as RDMAP messages.

use std::sync::Arc;

use super::engine::*;
use super::outbound::{OnSent, Src, TxMsg};
use super::wire::rdmap::{
    AtomicRequest, AtomicWriteRequest, FlushPlacement, FlushRequest, FlushSelectivity, ReadRequest,
};
use super::wire::{Header, HeaderKind, Opcode};
use crate::fabric::error::{Error, Result};
use crate::fabric::params::ConnInfo;
use crate::fabric::types::{Access, QpState, SendFlags};
use crate::fabric::wr::{check_atomic_args, FlushTarget, FlushType, SendOp, SendWr, Sge};

impl Engine {
    pub(super) fn check_sge(&self, s: &Sge, need: Access) -> Result<()> {
        if s.domain() != self.domain {
            return Err(Error::WrongDomain {
                what: "memory region",
            });
        }
        s.check_local(need)
    }

    pub(super) fn peer_has(
        &self,
        what: impl Fn(&ConnInfo) -> bool,
        op: &'static str,
    ) -> Result<()> {
        match &self.info {
            Some(i) if what(i) => Ok(()),
            _ => Err(Error::PeerUnsupported { op }),
        }
    }

    /// Appends a validated request to the send queue (not started yet).
    pub(super) fn enqueue(&mut self, wr: SendWr) {
        let opcode = wr.op.wc_opcode();
        let byte_len = match &wr.op {
            SendOp::Write { local, .. }
            | SendOp::WriteWithImm { local, .. }
            | SendOp::Read { local, .. }
            | SendOp::Send { local }
            | SendOp::SendWithInvalidate { local, .. } => local.len as u32,
            SendOp::CompareSwap { .. } | SendOp::FetchAdd { .. } | SendOp::AtomicWrite { .. } => 8,
            SendOp::Flush { .. } => 0,
        };
        let seq = self.next_seq;
        self.next_seq += 1;
        self.sq.push_back(SqEntry {
            seq,
            wr_id: wr.wr_id,
            opcode,
            flags: wr.flags,
            byte_len,
            status: None,
            pending: Pending::Unissued(wr.op),
        });
    }

    pub(super) fn validate(&self, wr: &SendWr) -> Result<()> {
        if self.state != QpState::Rts {
            return Err(fail(self.qp_num, self.state, "post_send", QpState::Rts));
        }
        let too_big = |s: &Sge| s.len > self.max_message || s.len > u32::MAX as usize;
        let aligned = |addr: u64| addr.is_multiple_of(8);
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
                check_atomic_args(local, *remote)?;
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
        wr.check_solicited()
    }

    /// Starts posted requests in order, as far as ORD and fences allow.
    pub(super) fn issue(&mut self) {
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

    /// Queues a message whose payload is the local buffer `s`.
    fn push_local(&mut self, hdr: Header, s: &Sge, on_sent: OnSent) {
        self.tx.push(TxMsg {
            hdr,
            src: Src::Mem {
                region: Arc::clone(s.region()),
                offset: s.offset,
                revocable: false,
            },
            len: s.len,
            on_sent,
        });
    }

    pub(super) fn req_id(&mut self) -> u32 {
        let id = self.next_req_id;
        self.next_req_id = self.next_req_id.wrapping_add(1);
        id
    }

    pub(super) fn untagged(&mut self, opcode: Opcode) -> Header {
        let msn = match opcode.queue() {
            Some(0) => &mut self.send_msn,
            _ => &mut self.rreq_msn,
        };
        let h = Header::untagged(opcode, *msn, true);
        *msn = msn.wrapping_add(1);
        h
    }

    pub(super) fn start_op(&mut self, seq: u64, op: SendOp, solicited: bool) {
        let pending = match op {
            SendOp::Write { local, remote } => {
                let hdr = Header::tagged(Opcode::Write, remote.rkey, remote.addr, true);
                self.push_local(hdr, &local, OnSent::Complete(seq));
                Pending::Sending
            }
            SendOp::WriteWithImm { local, remote, imm } => {
                let hdr = Header::tagged(Opcode::Write, remote.rkey, remote.addr, true);
                self.push_local(hdr, &local, OnSent::Nothing);
                let hdr = self.untagged(if solicited {
                    Opcode::ImmediateDataSe
                } else {
                    Opcode::ImmediateData
                });
                let body = (imm as u64).to_be_bytes();
                self.tx.push_inline(hdr, &body, OnSent::Complete(seq));
                Pending::Sending
            }
            SendOp::Send { local } => {
                let opcode = if solicited {
                    Opcode::SendSe
                } else {
                    Opcode::Send
                };
                let hdr = self.untagged(opcode);
                self.push_local(hdr, &local, OnSent::Complete(seq));
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
                self.push_local(hdr, &local, OnSent::Complete(seq));
                Pending::Sending
            }
            SendOp::Read { local, remote } => {
                let rr = ReadRequest {
                    sink_stag: local.lkey(),
                    sink_to: local.addr(),
                    size: local.len as u32,
                    src_stag: remote.rkey,
                    src_to: remote.addr,
                };
                let hdr = self.untagged(Opcode::ReadRequest);
                let body = rr.encode();
                self.tx.push_inline(hdr, &body, OnSent::Nothing);
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
                self.push_request(Opcode::AtomicRequest, &ar.encode(), seq);
                Pending::Atomic {
                    req_id: id,
                    result: local,
                }
            }
            SendOp::FetchAdd { local, remote, add } => {
                let id = self.req_id();
                let ar = AtomicRequest::fetch_add(id, remote.rkey, remote.addr, add);
                self.push_request(Opcode::AtomicRequest, &ar.encode(), seq);
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
                self.push_request(Opcode::AtomicWriteRequest, &aw.encode(), seq);
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
                self.push_request(Opcode::FlushRequest, &fr.encode(), seq);
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

    pub(super) fn push_request(&mut self, opcode: Opcode, body: &[u8], seq: u64) {
        let hdr = self.untagged(opcode);
        self.tx.push_inline(hdr, body, OnSent::Nothing);
        self.in_flight.push_back(seq);
    }
}
