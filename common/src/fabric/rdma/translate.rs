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
mod tests {
    use super::*;
    use crate::fabric::{AlignedBuf, Context, RemoteAddr, Sge};

    #[test]
    fn access_flags_map_both_ways() {
        assert_eq!(access_to_ibv(Access::LOCAL_WRITE, true), 1);
        assert_eq!(access_to_ibv(Access::REMOTE_WRITE, true), 2);
        assert_eq!(access_to_ibv(Access::REMOTE_READ, true), 4);
        assert_eq!(access_to_ibv(Access::REMOTE_ATOMIC, true), 8);
        assert_eq!(access_to_ibv(Access::MW_BIND, true), 16);
        // Every combination of the mapped flags round-trips.
        let mapped = [
            Access::LOCAL_WRITE,
            Access::REMOTE_WRITE,
            Access::REMOTE_READ,
            Access::REMOTE_ATOMIC,
            Access::MW_BIND,
        ];
        for bits in 0u32..32 {
            let mut a = Access::empty();
            for (i, f) in mapped.iter().enumerate() {
                if bits & (1 << i) != 0 {
                    a |= *f;
                }
            }
            assert_eq!(access_from_ibv(access_to_ibv(a, true)), a, "{a:?}");
        }
        // Flush rights have no verbs flag here; a device without atomics drops that right.
        let all = Access::LOCAL_WRITE | Access::ALL_REMOTE | Access::MW_BIND;
        assert_eq!(access_to_ibv(all, true), 0b11111);
        assert_eq!(access_to_ibv(all, false), 0b10111);
        assert_eq!(
            access_from_ibv(ia::IBV_ACCESS_ON_DEMAND.0 | 4),
            Access::REMOTE_READ
        );
    }

    #[test]
    fn every_verbs_status_maps_to_its_own_fabric_status_and_back() {
        let mut seen = std::collections::HashSet::new();
        for v in 0..=ws::IBV_WC_TM_RNDV_INCOMPLETE {
            let st = status_from_ibv(v);
            assert!(seen.insert(st), "{v} maps to {st:?}, already taken");
            assert_eq!(status_to_ibv(st), v, "{st:?}");
        }
        assert_eq!(seen.len(), 24);
        assert_eq!(status_from_ibv(ws::IBV_WC_SUCCESS), WcStatus::Success);
        assert_eq!(status_from_ibv(ws::IBV_WC_WR_FLUSH_ERR), WcStatus::WrFlush);
        assert_eq!(
            status_from_ibv(ws::IBV_WC_REM_ACCESS_ERR),
            WcStatus::RemoteAccess
        );
        assert_eq!(
            status_from_ibv(ws::IBV_WC_RETRY_EXC_ERR),
            WcStatus::RetryExceeded
        );
        assert_eq!(
            status_from_ibv(ws::IBV_WC_RNR_RETRY_EXC_ERR),
            WcStatus::RnrRetryExceeded
        );
        // A status from a newer rdma-core is a general error, never a success.
        assert_eq!(status_from_ibv(99), WcStatus::General);
    }

    #[test]
    fn completion_opcodes_map_both_ways() {
        for (v, op) in OPCODE {
            assert_eq!(opcode_from_ibv(v), Some(op));
            assert_eq!(opcode_to_ibv(op), v);
        }
        assert!(is_recv(wo::IBV_WC_RECV) && is_recv(wo::IBV_WC_RECV_RDMA_WITH_IMM));
        assert!(!is_recv(wo::IBV_WC_RDMA_READ) && !is_recv(wo::IBV_WC_ATOMIC_WRITE));
        // The transport's own completions have no fabric opcode.
        assert_eq!(opcode_from_ibv(wo::IBV_WC_BIND_MW), None);
        assert_eq!(opcode_from_ibv(wo::IBV_WC_LOCAL_INV), None);
        // Flush sits in the gap rdma-core 44 leaves between TSO and Atomic Write.
        assert_eq!(IBV_WC_FLUSH, wo::IBV_WC_TSO + 1);
        assert_eq!(IBV_WC_FLUSH + 1, wo::IBV_WC_ATOMIC_WRITE);
        assert_eq!(opcode_from_ibv(8), Some(WcOpcode::Flush));
        assert_eq!(opcode_from_ibv(10), None);
    }

    #[test]
    fn send_flags_map() {
        let s = ibv_send_flags::IBV_SEND_SIGNALED.0;
        let f = ibv_send_flags::IBV_SEND_FENCE.0;
        let so = ibv_send_flags::IBV_SEND_SOLICITED.0;
        assert_eq!(send_flags(SendFlags::SIGNALED, true), s);
        assert_eq!(send_flags(SendFlags::empty(), false), 0);
        assert_eq!(send_flags(SendFlags::empty(), true), s);
        assert_eq!(
            send_flags(SendFlags::FENCE | SendFlags::SOLICITED, false),
            f | so
        );
    }

    fn sge() -> Sge {
        let ctx = Context::soft();
        let pd = ctx.alloc_pd().unwrap();
        let mr = pd
            .register(AlignedBuf::new(4096).unwrap(), Access::LOCAL_WRITE)
            .unwrap();
        Sge::new(&mr, 64, 100)
    }

    #[test]
    fn work_request_fields_of_every_operation() {
        let local = sge();
        let base = local.addr() - local.offset as u64;
        let lkey = |s: &Sge| (s.addr(), 0x1234);
        let remote = RemoteAddr {
            addr: 0x1000_0008,
            rkey: 0x77,
        };
        let l = Some((base + 64, 100, 0x1234));
        let r = Some((0x1000_0008, 0x77));
        let cases: Vec<(SendOp, WrSpec)> = vec![
            (
                SendOp::Write {
                    local: local.clone(),
                    remote,
                },
                WrSpec {
                    opcode: wr::IBV_WR_RDMA_WRITE,
                    sge: l,
                    remote: r,
                    ..blank()
                },
            ),
            (
                SendOp::WriteWithImm {
                    local: local.clone(),
                    remote,
                    imm: 0xA0B0_C0D0,
                },
                WrSpec {
                    opcode: wr::IBV_WR_RDMA_WRITE_WITH_IMM,
                    sge: l,
                    remote: r,
                    imm: Some(0xA0B0_C0D0),
                    ..blank()
                },
            ),
            (
                SendOp::Read {
                    local: local.clone(),
                    remote,
                },
                WrSpec {
                    opcode: wr::IBV_WR_RDMA_READ,
                    sge: l,
                    remote: r,
                    ..blank()
                },
            ),
            (
                SendOp::Send {
                    local: local.clone(),
                },
                WrSpec {
                    opcode: wr::IBV_WR_SEND,
                    sge: l,
                    ..blank()
                },
            ),
            (
                SendOp::SendWithInvalidate {
                    local: local.clone(),
                    invalidate_rkey: 9,
                },
                WrSpec {
                    opcode: wr::IBV_WR_SEND_WITH_INV,
                    sge: l,
                    invalidate_rkey: Some(9),
                    ..blank()
                },
            ),
            (
                SendOp::CompareSwap {
                    local: local.clone(),
                    remote,
                    compare: 5,
                    swap: 6,
                },
                WrSpec {
                    opcode: wr::IBV_WR_ATOMIC_CMP_AND_SWP,
                    sge: l,
                    remote: r,
                    compare_add: 5,
                    swap: 6,
                    ..blank()
                },
            ),
            (
                SendOp::FetchAdd {
                    local: local.clone(),
                    remote,
                    add: 3,
                },
                WrSpec {
                    opcode: wr::IBV_WR_ATOMIC_FETCH_AND_ADD,
                    sge: l,
                    remote: r,
                    compare_add: 3,
                    ..blank()
                },
            ),
            (
                SendOp::AtomicWrite { remote, value: 42 },
                WrSpec {
                    opcode: wr::IBV_WR_ATOMIC_WRITE,
                    remote: r,
                    atomic_value: Some(42),
                    ..blank()
                },
            ),
        ];
        for (op, want) in cases {
            assert_eq!(spec(&op, 0, lkey), want, "{op:?}");
        }
    }

    fn blank() -> WrSpec {
        WrSpec {
            opcode: 0,
            send_flags: 0,
            sge: None,
            remote: None,
            compare_add: 0,
            swap: 0,
            imm: None,
            invalidate_rkey: None,
            atomic_value: None,
        }
    }

    #[test]
    fn legacy_work_requests_carry_the_fields() {
        let mut out = empty_send_wr();
        let mut sg = ibv_sge {
            addr: 0,
            length: 0,
            lkey: 0,
        };
        let write = WrSpec {
            opcode: wr::IBV_WR_RDMA_WRITE_WITH_IMM,
            send_flags: 2,
            sge: Some((0x5000, 64, 0xAB)),
            remote: Some((0x9000, 0xCD)),
            imm: Some(0x0102_0304),
            ..blank()
        };
        fill_send_wr(&write, token(7, 9), &mut out, &mut sg);
        assert_eq!(
            (out.wr_id, out.opcode, out.send_flags),
            (token(7, 9), write.opcode, 2)
        );
        assert_eq!(
            (out.num_sge, sg.addr, sg.length, sg.lkey),
            (1, 0x5000, 64, 0xAB)
        );
        assert_eq!(out.sg_list, &mut sg as *mut ibv_sge);
        // SAFETY: fill_send_wr wrote the rdma member of the union and the immediate data.
        let (rdma, imm) = unsafe { (out.wr.rdma, out.imm_data_invalidated_rkey_union.imm_data) };
        assert_eq!((rdma.remote_addr, rdma.rkey), (0x9000, 0xCD));
        assert_eq!(
            imm,
            0x0102_0304u32.to_be(),
            "immediate data goes in network order"
        );

        let cas = WrSpec {
            opcode: wr::IBV_WR_ATOMIC_CMP_AND_SWP,
            sge: Some((0x6000, 8, 1)),
            remote: Some((0xA008, 2)),
            compare_add: 11,
            swap: 22,
            ..blank()
        };
        fill_send_wr(&cas, 1, &mut out, &mut sg);
        // SAFETY: fill_send_wr wrote the atomic member for an atomic opcode.
        let at = unsafe { out.wr.atomic };
        assert_eq!(
            (at.remote_addr, at.compare_add, at.swap, at.rkey),
            (0xA008, 11, 22, 2)
        );

        let inv = WrSpec {
            opcode: wr::IBV_WR_SEND_WITH_INV,
            invalidate_rkey: Some(0x55),
            ..blank()
        };
        fill_send_wr(&inv, 2, &mut out, &mut sg);
        assert_eq!((out.num_sge, out.sg_list), (0, std::ptr::null_mut()));
        // SAFETY: fill_send_wr wrote the invalidate rkey member.
        let rkey = unsafe { out.imm_data_invalidated_rkey_union.invalidated_rkey };
        assert_eq!(rkey, 0x55);
    }

    #[test]
    fn opcodes_of_posted_requests() {
        let l = sge();
        let remote = RemoteAddr { addr: 8, rkey: 1 };
        assert_eq!(
            (SendOp::WriteWithImm {
                local: l.clone(),
                remote,
                imm: 0
            })
            .wc_opcode(),
            WcOpcode::RdmaWrite
        );
        assert_eq!(
            (SendOp::SendWithInvalidate {
                local: l,
                invalidate_rkey: 0
            })
            .wc_opcode(),
            WcOpcode::Send
        );
        assert_eq!(
            (SendOp::AtomicWrite { remote, value: 0 }).wc_opcode(),
            WcOpcode::AtomicWrite
        );
    }

    #[test]
    fn tokens_carry_tag_and_sequence() {
        for (tag, seq) in [(0, 0), (1, u32::MAX), (u32::MAX, 7), (0xDEAD, 0xBEEF)] {
            assert_eq!(untoken(token(tag, seq)), (tag, seq));
        }
    }

    #[test]
    fn the_capability_block_fits_cm_private_data() {
        let req = caps::encode(caps::ATOMICS, &[1; 52], caps::REQ_ROOM).expect("52 fit a REQ");
        assert_eq!(req.len(), 56);
        assert!(
            caps::encode(0, &[1; 53], caps::REQ_ROOM).is_none(),
            "53 do not"
        );
        assert!(caps::encode(0, &[1; 192], caps::REP_ROOM).is_some());
        assert!(caps::encode(0, &[1; 145], caps::REJ_ROOM).is_none());
        // IB CM pads the field to its size: the length says where the application's end.
        let mut padded = caps::encode(caps::ATOMICS | caps::ATOMIC_WRITE, b"hello", 56).unwrap();
        padded.resize(56, 0);
        assert_eq!(
            caps::decode(&padded),
            Ok((caps::ATOMICS | caps::ATOMIC_WRITE, &b"hello"[..]))
        );
        assert_eq!(
            caps::decode(&caps::encode(0, b"", 56).unwrap()),
            Ok((0, &b""[..]))
        );
        assert_eq!(caps::ATOMICS & caps::ATOMIC_WRITE & caps::FLUSH, 0);
        assert_eq!(
            (caps::ATOMICS | caps::ATOMIC_WRITE | caps::FLUSH).count_ones(),
            3
        );
    }

    #[test]
    fn foreign_private_data_is_refused() {
        assert!(caps::decode(b"").is_err());
        assert!(caps::decode(b"rp").is_err());
        assert!(caps::decode(b"xx\x00\x00")
            .unwrap_err()
            .contains("not rpma"));
        assert!(caps::decode(b"r\x02\x00\x00")
            .unwrap_err()
            .contains("version"));
        assert!(caps::decode(b"r\x01\x00\x09abc")
            .unwrap_err()
            .contains("longer"));
    }
}
