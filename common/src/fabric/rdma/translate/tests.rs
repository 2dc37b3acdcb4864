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
