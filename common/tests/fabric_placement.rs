//! Placement on the responder: the memory a Write FPDU is placed into stays alive for the whole
//! FPDU, and what an out-of-bounds multi-FPDU Write may and may not change.

mod fabric_util;

use std::io::Write;
use std::net::TcpStream;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use fabric_util::*;
use rpma_common::fabric::soft::wire::{mpa, CapFlags, Header, Opcode};
use rpma_common::fabric::*;

/// A target queue pair (CRC off) accepting a raw peer: (target QP, its CQ, its PD, the peer).
fn raw_pair() -> (
    QueuePair,
    CompletionQueue,
    ProtectionDomain,
    TcpStream,
    mpa::Negotiated,
) {
    let ctx = Context::soft();
    let listener = Listener::bind(&ctx, &"tcp://127.0.0.1:0".parse().unwrap()).unwrap();
    let url = listener.url().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(16).unwrap();
    let (pd2, cq2) = (pd.clone(), cq.clone());
    let h = std::thread::spawn(move || {
        let params = params(false);
        let req = listener.accept(&params).unwrap();
        let qp = pd2.create_qp(&cq2, &cq2, QpCaps::default()).unwrap();
        req.accept(qp, &params, b"").unwrap()
    });
    let (s, n) = raw_peer(&url, CapFlags::ALL, 4);
    let qp = h.join().unwrap();
    (qp, cq, pd, s, n)
}

/// Polls `cq` (which drives the target) for `d`.
fn drive(cq: &CompletionQueue, d: Duration) {
    let end = Instant::now() + d;
    let mut wc = [Completion::EMPTY; 4];
    while Instant::now() < end {
        cq.poll(&mut wc).unwrap();
    }
}

#[test]
fn dropping_the_mr_mid_fpdu_keeps_its_memory_alive_until_the_fpdu_is_in() {
    let (qp, cq, pd, mut s, n) = raw_pair();
    assert!(!n.crc, "CRC off: the payload is read straight into place");
    let buf = AlignedBuf::new(1 << 16).unwrap();
    let mr = pd.register(Arc::clone(&buf), rw()).unwrap();
    let payload = vec![0x5Au8; 30000]; // long enough to be read straight into place
    let frame = fpdu(
        Header::tagged(Opcode::Write, mr.rkey(), mr.addr() + 100, true),
        &payload,
    );
    // The MPA length, the DDP/RDMAP header and 3000 payload bytes.
    let split = 2 + 14 + 3000;
    s.write_all(&frame[..split]).unwrap();
    drive(&cq, Duration::from_millis(200));
    assert_eq!(
        buf.read_u64(100).unwrap(),
        0x5A5A_5A5A_5A5A_5A5A,
        "placing began"
    );
    let weak: Weak<AlignedBuf> = Arc::downgrade(&buf);
    drop(mr);
    drop(buf);
    assert!(
        weak.upgrade().is_some(),
        "the FPDU in placement keeps the memory alive after its MR is dropped"
    );
    drive(&cq, Duration::from_millis(50));
    assert!(weak.upgrade().is_some(), "still: the FPDU is not complete");
    s.write_all(&frame[split..]).unwrap();
    let end = Instant::now() + Duration::from_secs(10);
    while weak.upgrade().is_some() && Instant::now() < end {
        drive(&cq, Duration::from_millis(10));
    }
    assert!(
        weak.upgrade().is_none(),
        "released once the FPDU is reported"
    );
    assert_eq!(
        qp.state(),
        QpState::Rts,
        "the Write was valid when it began"
    );
}

#[test]
fn a_multi_fpdu_write_running_out_of_bounds_lands_only_its_full_in_bounds_segments() {
    // 128-byte ULPDUs: 14 bytes of tagged DDP/RDMAP header, 114 of payload per FPDU.
    const SEG: usize = 128 - 14;
    let ip = ConnParams {
        tcp: TcpParams {
            max_ulpdu: 128,
            ..TcpParams::default()
        },
        ..params(true)
    };
    let p = Pair::with(ip, params(true), |_| {});
    let (tmem, tmr) = p.target_buf(4096, rw());
    let inside = 300; // bytes of the Write that fall inside the region
    let start = 4096 - inside;
    let len = 500;
    let (imem, imr) = p.init_buf(len + 8, Access::LOCAL_WRITE);
    imem.write_at(0, &vec![0xAB; len]).unwrap();
    p.qp.post_send(SendWr::new(
        1,
        SendOp::Write {
            local: Sge::new(&imr, 0, len),
            remote: tmr.remote(start as u64),
        },
    ))
    .unwrap();
    p.qp.post_send(SendWr::new(
        2,
        SendOp::Read {
            local: Sge::new(&imr, len, 8),
            remote: tmr.remote(0),
        },
    ))
    .unwrap();
    assert_eq!(p.until_init(2).1.status, WcStatus::RemoteAccess);
    p.assert_both_error();
    let mem = tmem.to_vec();
    // DDP tagged segments carry no message length: each FPDU is checked on its own. The full
    // segments before the offending one were in bounds and landed; the offending segment (the
    // one that would cross the end) placed nothing, and nothing after it was placed.
    let landed = (inside / SEG) * SEG;
    assert_eq!(landed, 228);
    assert!(
        mem[..start].iter().all(|&b| b == 0),
        "nothing before the Write"
    );
    assert!(
        mem[start..start + landed].iter().all(|&b| b == 0xAB),
        "the in-bounds full segments landed"
    );
    assert!(
        mem[start + landed..].iter().all(|&b| b == 0),
        "the offending segment placed nothing"
    );
}
