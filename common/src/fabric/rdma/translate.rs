//! The translation tables between the fabric's plain data and verbs': access flags, work
//! request opcodes and fields, completion statuses and opcodes (both ways), the hardware
//! `wr_id` of a posted request, and the capability block this transport puts in front of the
//! application's rdma_cm private data. All pure: no verbs call, so all of it is tested here.

use rdma_sys::{
    ibv_access_flags as ia, ibv_send_flags, ibv_send_wr, ibv_sge, ibv_wc_opcode as wo,
    ibv_wc_status as ws, ibv_wr_opcode as wr,
};

use crate::fabric::types::{Access, SendFlags, WcOpcode, WcStatus};
use crate::fabric::wr::{FlushTarget, SendOp};

/// The verbs access flags for `a`. Flush rights have no verbs flag in rdma-core 44 (and this
/// transport posts no Flush), so they are dropped; `atomics: false` (a device without
/// atomics) drops remote atomic, which such a device refuses to register.
pub(crate) fn access_to_ibv(a: Access, atomics: bool) -> u32 {
    let mut f = 0;
    for (ours, theirs) in ACCESS {
        if a.contains(ours) && (atomics || ours != Access::REMOTE_ATOMIC) {
            f |= theirs.0;
        }
    }
    f
}

/// The fabric's access flags for verbs flags `f` (the ones it has a name for). The reverse
/// tables here serve the tests that prove each mapping one to one.
#[cfg(test)]
pub(crate) fn access_from_ibv(f: u32) -> Access {
    let mut a = Access::empty();
    for (ours, theirs) in ACCESS {
        if f & theirs.0 != 0 {
            a |= ours;
        }
    }
    a
}

const ACCESS: [(Access, ia); 5] = [
    (Access::LOCAL_WRITE, ia::IBV_ACCESS_LOCAL_WRITE),
    (Access::REMOTE_WRITE, ia::IBV_ACCESS_REMOTE_WRITE),
    (Access::REMOTE_READ, ia::IBV_ACCESS_REMOTE_READ),
    (Access::REMOTE_ATOMIC, ia::IBV_ACCESS_REMOTE_ATOMIC),
    (Access::MW_BIND, ia::IBV_ACCESS_MW_BIND),
];

/// Every `ibv_wc_status` and the fabric's status for it: one to one.
const STATUS: [(ws::Type, WcStatus); 24] = [
    (ws::IBV_WC_SUCCESS, WcStatus::Success),
    (ws::IBV_WC_LOC_LEN_ERR, WcStatus::LocalLength),
    (ws::IBV_WC_LOC_QP_OP_ERR, WcStatus::LocalQpOperation),
    (ws::IBV_WC_LOC_EEC_OP_ERR, WcStatus::LocalEecOperation),
    (ws::IBV_WC_LOC_PROT_ERR, WcStatus::LocalProtection),
    (ws::IBV_WC_WR_FLUSH_ERR, WcStatus::WrFlush),
    (ws::IBV_WC_MW_BIND_ERR, WcStatus::MwBind),
    (ws::IBV_WC_BAD_RESP_ERR, WcStatus::BadResponse),
    (ws::IBV_WC_LOC_ACCESS_ERR, WcStatus::LocalAccess),
    (ws::IBV_WC_REM_INV_REQ_ERR, WcStatus::RemoteInvalidRequest),
    (ws::IBV_WC_REM_ACCESS_ERR, WcStatus::RemoteAccess),
    (ws::IBV_WC_REM_OP_ERR, WcStatus::RemoteOperation),
    (ws::IBV_WC_RETRY_EXC_ERR, WcStatus::RetryExceeded),
    (ws::IBV_WC_RNR_RETRY_EXC_ERR, WcStatus::RnrRetryExceeded),
    (ws::IBV_WC_LOC_RDD_VIOL_ERR, WcStatus::LocalRddViolation),
    (
        ws::IBV_WC_REM_INV_RD_REQ_ERR,
        WcStatus::RemoteInvalidReadRequest,
    ),
    (ws::IBV_WC_REM_ABORT_ERR, WcStatus::RemoteAbort),
    (ws::IBV_WC_INV_EECN_ERR, WcStatus::InvalidEecNumber),
    (ws::IBV_WC_INV_EEC_STATE_ERR, WcStatus::InvalidEecState),
    (ws::IBV_WC_FATAL_ERR, WcStatus::Fatal),
    (ws::IBV_WC_RESP_TIMEOUT_ERR, WcStatus::ResponseTimeout),
    (ws::IBV_WC_GENERAL_ERR, WcStatus::General),
    (ws::IBV_WC_TM_ERR, WcStatus::TagMatching),
    (
        ws::IBV_WC_TM_RNDV_INCOMPLETE,
        WcStatus::TagMatchingRendezvousIncomplete,
    ),
];

/// The fabric's status for a completion's `ibv_wc_status` (a value newer than rdma-core 44's:
/// [`WcStatus::General`]).
pub(crate) fn status_from_ibv(s: ws::Type) -> WcStatus {
    STATUS
        .iter()
        .find(|(v, _)| *v == s)
        .map_or(WcStatus::General, |(_, st)| *st)
}

/// The `ibv_wc_status` of a fabric status.
#[cfg(test)]
pub(crate) fn status_to_ibv(s: WcStatus) -> ws::Type {
    STATUS
        .iter()
        .find(|(_, st)| *st == s)
        .map_or(ws::IBV_WC_GENERAL_ERR, |(v, _)| *v)
}

/// Every `ibv_wc_opcode` this transport can see and the fabric's opcode for it.
const OPCODE: [(wo::Type, WcOpcode); 9] = [
    (wo::IBV_WC_SEND, WcOpcode::Send),
    (wo::IBV_WC_RDMA_WRITE, WcOpcode::RdmaWrite),
    (wo::IBV_WC_RDMA_READ, WcOpcode::RdmaRead),
    (wo::IBV_WC_COMP_SWAP, WcOpcode::CompSwap),
    (wo::IBV_WC_FETCH_ADD, WcOpcode::FetchAdd),
    (wo::IBV_WC_ATOMIC_WRITE, WcOpcode::AtomicWrite),
    (wo::IBV_WC_RECV, WcOpcode::Recv),
    (wo::IBV_WC_RECV_RDMA_WITH_IMM, WcOpcode::RecvRdmaWithImm),
    (IBV_WC_FLUSH, WcOpcode::Flush),
];

/// `IBV_WC_FLUSH`: not in rdma-core 44's header (rdma-sys's bindings), 8 from rdma-core 45 on
/// (the kernel's `IB_UVERBS_WC_FLUSH`, between `IBV_WC_TSO` and `IBV_WC_ATOMIC_WRITE`).
const IBV_WC_FLUSH: wo::Type = 8;

/// The fabric's opcode for a successful completion's `ibv_wc_opcode`, if it has one (bind and
/// local-invalidate completions are the transport's own).
pub(crate) fn opcode_from_ibv(o: wo::Type) -> Option<WcOpcode> {
    OPCODE.iter().find(|(v, _)| *v == o).map(|(_, op)| *op)
}

/// The `ibv_wc_opcode` a completion of `o` carries.
#[cfg(test)]
pub(crate) fn opcode_to_ibv(o: WcOpcode) -> wo::Type {
    OPCODE
        .iter()
        .find(|(_, op)| *op == o)
        .map_or(wo::IBV_WC_SEND, |(v, _)| *v)
}

/// Whether a completion is a receive (`IBV_WC_RECV` is a bit of every receive opcode; only for
/// successful completions, so the queue pair tells receives by their `wr_id` instead).
#[cfg(test)]
pub(crate) fn is_recv(o: wo::Type) -> bool {
    o & wo::IBV_WC_RECV != 0
}

/// A work request, as verbs wants its fields: the neutral form both posting paths
/// (`ibv_post_send` and the `ibv_wr_*` calls) are built from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct WrSpec {
    pub(crate) opcode: wr::Type,
    pub(crate) send_flags: u32,
    /// The local buffer: address, length, lkey.
    pub(crate) sge: Option<(u64, u32, u32)>,
    /// The remote address and rkey.
    pub(crate) remote: Option<(u64, u32)>,
    /// Atomics: compare (CompareSwap) or add (FetchAdd), and swap.
    pub(crate) compare_add: u64,
    pub(crate) swap: u64,
    /// Immediate data, host order (it goes on the wire big-endian).
    pub(crate) imm: Option<u32>,
    pub(crate) invalidate_rkey: Option<u32>,
    /// Atomic Write's 8 bytes.
    pub(crate) atomic_value: Option<u64>,
}

/// The verbs send flags for `f` (and `signal`: the request is signaled in hardware, which may
/// be so although the caller did not ask, see the queue pair's unsignaled run).
pub(crate) fn send_flags(f: SendFlags, signal: bool) -> u32 {
    let mut out = 0;
    if signal {
        out |= ibv_send_flags::IBV_SEND_SIGNALED.0;
    }
    if f.contains(SendFlags::FENCE) {
        out |= ibv_send_flags::IBV_SEND_FENCE.0;
    }
    if f.contains(SendFlags::SOLICITED) {
        out |= ibv_send_flags::IBV_SEND_SOLICITED.0;
    }
    out
}

/// The verbs form of `op` (already validated: Flush never gets here, this transport has no
/// flush verb). `lkey_of` gives a local buffer's address and lkey.
pub(crate) fn spec(
    op: &SendOp,
    flags: u32,
    lkey_of: impl Fn(&crate::fabric::Sge) -> (u64, u32),
) -> WrSpec {
    let sge = |s: &crate::fabric::Sge| {
        let (addr, lkey) = lkey_of(s);
        Some((addr, s.len as u32, lkey))
    };
    let mut w = WrSpec {
        opcode: wr::IBV_WR_SEND,
        send_flags: flags,
        sge: None,
        remote: None,
        compare_add: 0,
        swap: 0,
        imm: None,
        invalidate_rkey: None,
        atomic_value: None,
    };
    match op {
        SendOp::Write { local, remote } => {
            w.opcode = wr::IBV_WR_RDMA_WRITE;
            w.sge = sge(local);
            w.remote = Some((remote.addr, remote.rkey));
        }
        SendOp::WriteWithImm { local, remote, imm } => {
            w.opcode = wr::IBV_WR_RDMA_WRITE_WITH_IMM;
            w.sge = sge(local);
            w.remote = Some((remote.addr, remote.rkey));
            w.imm = Some(*imm);
        }
        SendOp::Read { local, remote } => {
            w.opcode = wr::IBV_WR_RDMA_READ;
            w.sge = sge(local);
            w.remote = Some((remote.addr, remote.rkey));
        }
        SendOp::Send { local } => {
            w.opcode = wr::IBV_WR_SEND;
            w.sge = sge(local);
        }
        SendOp::SendWithInvalidate {
            local,
            invalidate_rkey,
        } => {
            w.opcode = wr::IBV_WR_SEND_WITH_INV;
            w.sge = sge(local);
            w.invalidate_rkey = Some(*invalidate_rkey);
        }
        SendOp::CompareSwap {
            local,
            remote,
            compare,
            swap,
        } => {
            w.opcode = wr::IBV_WR_ATOMIC_CMP_AND_SWP;
            w.sge = sge(local);
            w.remote = Some((remote.addr, remote.rkey));
            w.compare_add = *compare;
            w.swap = *swap;
        }
        SendOp::FetchAdd { local, remote, add } => {
            w.opcode = wr::IBV_WR_ATOMIC_FETCH_AND_ADD;
            w.sge = sge(local);
            w.remote = Some((remote.addr, remote.rkey));
            w.compare_add = *add;
        }
        SendOp::AtomicWrite { remote, value } => {
            w.opcode = wr::IBV_WR_ATOMIC_WRITE;
            w.remote = Some((remote.addr, remote.rkey));
            w.atomic_value = Some(*value);
        }
        SendOp::Flush { target, .. } => {
            // Refused before this point; kept total so that a mistake posts nothing harmful:
            // a zero-length Read of the target, which reads nothing.
            w.opcode = wr::IBV_WR_RDMA_READ;
            w.remote = Some(match target {
                FlushTarget::Range { remote, .. } => (remote.addr, remote.rkey),
                FlushTarget::Region { rkey } => (0, *rkey),
            });
        }
    }
    w
}

/// Fills a legacy `ibv_send_wr` from `w`, its scatter list being `sge` (one entry, filled
/// here). Atomic Write is posted through the `ibv_wr_*` path only.
pub(crate) fn fill_send_wr(w: &WrSpec, wr_id: u64, out: &mut ibv_send_wr, sge: &mut ibv_sge) {
    out.wr_id = wr_id;
    out.next = std::ptr::null_mut();
    out.opcode = w.opcode;
    out.send_flags = w.send_flags;
    match w.sge {
        Some((addr, length, lkey)) => {
            *sge = ibv_sge { addr, length, lkey };
            out.sg_list = sge;
            out.num_sge = 1;
        }
        None => {
            out.sg_list = std::ptr::null_mut();
            out.num_sge = 0;
        }
    }
    if let Some(imm) = w.imm {
        out.imm_data_invalidated_rkey_union.imm_data = imm.to_be();
    } else if let Some(rkey) = w.invalidate_rkey {
        out.imm_data_invalidated_rkey_union.invalidated_rkey = rkey;
    }
    let (remote_addr, rkey) = w.remote.unwrap_or((0, 0));
    if matches!(
        w.opcode,
        wr::IBV_WR_ATOMIC_CMP_AND_SWP | wr::IBV_WR_ATOMIC_FETCH_AND_ADD
    ) {
        out.wr.atomic = rdma_sys::atomic_t {
            remote_addr,
            compare_add: w.compare_add,
            swap: w.swap,
            rkey,
        };
    } else {
        out.wr.rdma = rdma_sys::rdma_t { remote_addr, rkey };
    }
}

/// A zeroed `ibv_send_wr` (a C struct of integers, pointers and unions of them).
pub(crate) fn empty_send_wr() -> ibv_send_wr {
    // SAFETY: ibv_send_wr is a repr(C) struct of integers, raw pointers and unions of those:
    // all-zero is a valid value of each (null pointers, zero counts).
    unsafe { std::mem::zeroed() }
}

/// The hardware `wr_id` of a posted request: the queue pair's tag (which tells a stale
/// completion of a destroyed queue pair whose number was reused from one of the live queue
/// pair) and the request's sequence number on its queue.
pub(crate) fn token(tag: u32, seq: u32) -> u64 {
    (u64::from(tag) << 32) | u64::from(seq)
}

/// The tag and sequence number of a hardware `wr_id`.
pub(crate) fn untoken(wr_id: u64) -> (u32, u32) {
    ((wr_id >> 32) as u32, wr_id as u32)
}

/// The capability block in front of the application's private data in rdma_cm's connect,
/// accept and reject messages: what the soft transport's MPA exchange carries, cut to what
/// fits IB CM's private data (56 bytes in a REQ, 196 in a REP, 148 in a REJ), with the
/// application's length (IB CM pads the field with zeros to its fixed size).
pub(crate) mod caps {
    /// 'r', version 1, flags, application length.
    pub(crate) const LEN: usize = 4;
    const MAGIC: u8 = b'r';
    const VERSION: u8 = 1;
    /// The sender executes RDMA atomics (CompareSwap, FetchAdd) as a responder.
    pub(crate) const ATOMICS: u8 = 1;
    /// The sender executes RDMA Atomic Write as a responder.
    pub(crate) const ATOMIC_WRITE: u8 = 1 << 1;
    /// The sender executes RDMA Flush as a responder: reserved for a build with a flush verb,
    /// never set by this one (and ignored when received).
    #[cfg(test)]
    pub(crate) const FLUSH: u8 = 1 << 2;

    /// IB CM's private data room: REQ, REP, REJ.
    pub(crate) const REQ_ROOM: usize = 56;
    pub(crate) const REP_ROOM: usize = 196;
    pub(crate) const REJ_ROOM: usize = 148;

    /// The block, then `app`; None if it does not fit `room`.
    pub(crate) fn encode(flags: u8, app: &[u8], room: usize) -> Option<Vec<u8>> {
        if LEN + app.len() > room || app.len() > usize::from(u8::MAX) {
            return None;
        }
        let mut v = Vec::with_capacity(LEN + app.len());
        v.extend_from_slice(&[MAGIC, VERSION, flags, app.len() as u8]);
        v.extend_from_slice(app);
        Some(v)
    }

    /// The flags and the application's bytes of a received block.
    ///
    /// # Errors
    /// What is wrong: too short, not this transport's, another version, a length past the end.
    pub(crate) fn decode(data: &[u8]) -> Result<(u8, &[u8]), &'static str> {
        let [magic, version, flags, len, rest @ ..] = data else {
            return Err("private data shorter than rpma's capability block");
        };
        if *magic != MAGIC {
            return Err("private data is not rpma's (wrong magic)");
        }
        if *version != VERSION {
            return Err("rpma capability block of an unknown version");
        }
        rest.get(..usize::from(*len))
            .map(|app| (*flags, app))
            .ok_or("rpma capability block longer than the private data")
    }
}

#[cfg(test)]
mod tests;
