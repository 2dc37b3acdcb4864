//! The `tcp` transport against a raw peer that speaks the wire itself: a Read Request past the
//! IRD, a refused Read quoted in the Terminate, a Read whose region is revoked (or only
//! deregistered) while the peer is not reading, private opcodes without the peer's caps, a short Read Response, and a
//! peer flooding after the Terminate.

mod fabric_util;

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use fabric_util::*;
use rpma_common::fabric::soft::wire::{self, CapFlags, Caps, Header, Opcode, TermCause};
use rpma_common::fabric::*;

type Served = (QueuePair, CompletionQueue, std::sync::Arc<MemoryRegion>);

fn target(ird: u16) -> (Url, std::thread::JoinHandle<Served>) {
    target_over(ird, AlignedBuf::new(4096).unwrap())
}

/// A target queue pair (IRD `ird`, CRC off) with `mem` registered, accepting the raw peer.
fn target_over(
    ird: u16,
    mem: std::sync::Arc<AlignedBuf>,
) -> (Url, std::thread::JoinHandle<Served>) {
    let ctx = Context::soft();
    let listener = Listener::bind(&ctx, &"tcp://127.0.0.1:0".parse().unwrap()).unwrap();
    let url = listener.url().unwrap();
    let h = std::thread::spawn(move || {
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(16).unwrap();
        let mr = pd.register(mem, rw()).unwrap();
        let params = ConnParams {
            ird,
            tcp: TcpParams {
                crc: false,
                ..TcpParams::default()
            },
            ..ConnParams::default()
        };
        let req = listener.accept(&params).unwrap();
        assert_eq!(req.private_data(), b"raw");
        let qp = pd.create_qp(&cq, &cq, QpCaps::default()).unwrap();
        (req.accept(qp, &params, b"").unwrap(), cq, mr)
    });
    (url, h)
}

#[test]
fn ird_overflow_is_a_terminate() {
    let (url, h) = target(2);
    let (mut s, n) = raw_peer(&url, CapFlags::ALL, 8);
    let (tqp, cq, mr) = h.join().unwrap();
    assert_eq!(tqp.info().ird, 2);
    assert_eq!(n.ord, 2, "the raw peer was told IRD 2");
    // Five Read Requests in one segment: the target may hold two.
    let mut batch = Vec::new();
    for msn in 1..=5u32 {
        let rr = wire::rdmap::ReadRequest {
            sink_stag: 0x100,
            sink_to: 0,
            size: 8,
            src_stag: mr.rkey(),
            src_to: mr.addr(),
        };
        batch.extend(fpdu(
            Header::untagged(Opcode::ReadRequest, msn, true),
            &rr.encode(),
        ));
    }
    s.write_all(&batch).unwrap();
    s.set_read_timeout(Some(Duration::from_millis(20))).unwrap();
    let mut got = Vec::new();
    let end = Instant::now() + Duration::from_secs(10);
    let mut wc = [Completion::EMPTY; 4];
    while Instant::now() < end && tqp.state() == QpState::Rts
        || got.len() < 4 && Instant::now() < end
    {
        cq.poll(&mut wc).unwrap();
        let mut b = [0u8; 4096];
        match s.read(&mut b) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&b[..n]),
            Err(_) => {}
        }
    }
    assert_eq!(tqp.state(), QpState::Error);
    // Find the Terminate among the FPDUs the target sent.
    let mut off = 0;
    let mut cause = None;
    while off + 2 <= got.len() {
        let len = u16::from_be_bytes([got[off], got[off + 1]]) as usize;
        let (hdr, hl) = Header::decode(&got[off + 2..off + 2 + len]).unwrap();
        if hdr.opcode == Opcode::Terminate {
            let t = wire::Terminate::decode(&got[off + 2 + hl..off + 2 + len]).unwrap();
            cause = Some(t.cause);
        }
        off += 2 + len + wire::pad_len(len) + 4;
    }
    // RFC 5040 §7.2, as Linux siw: RDMAP Remote Operation Error, catastrophic to the stream;
    // the third Read Request is quoted (flag R).
    assert_eq!(cause, Some(TermCause::RDMAP_CATASTROPHIC_STREAM));
    let t = terminate_in(&got).expect("a Terminate");
    assert_eq!(t.rreq.map(|r| r.src_stag), Some(mr.rkey()));
}

#[test]
fn a_refused_read_request_is_quoted_in_the_terminate() {
    let (url, h) = target(4);
    let (mut s, _n) = raw_peer(&url, CapFlags::ALL, 4);
    let (tqp, cq, mr) = h.join().unwrap();
    // A Read whose source runs past the region's end.
    let rr = wire::rdmap::ReadRequest {
        sink_stag: 0x1234,
        sink_to: 0x40,
        size: 16,
        src_stag: mr.rkey(),
        src_to: mr.addr() + 4090,
    };
    let hdr = Header::untagged(Opcode::ReadRequest, 1, true);
    s.write_all(&fpdu(hdr, &rr.encode())).unwrap();
    let mut wc = [Completion::EMPTY; 4];
    let got = read_while(&mut s, || {
        cq.poll(&mut wc).unwrap();
        tqp.state() == QpState::Error
    });
    assert_eq!(tqp.state(), QpState::Error);
    let t = terminate_in(&got).expect("a Terminate");
    assert_eq!(t.cause, TermCause::RDMAP_BASE_BOUNDS);
    // Flag R: the Read Request as sent; flag D: its DDP header.
    assert_eq!(t.rreq, Some(rr));
    assert_eq!(&t.encode()[2..4], &[0xE0, 0x00], "M, D and R set");
    let d = t.ddp.expect("the offending DDP header");
    assert_eq!(d.header, hdr.encode().as_slice());
}

/// A target answering a peer's `LEN`-byte Read of `mem` while the peer does not read, until
/// the socket takes no more; then `end` is done to the region, 0xBB written over the memory,
/// and what the peer gets from then on returned: until the stream ends, `enough` says so
/// when nothing more comes, or 10 s.
fn a_read_held_by_a_peer_then(
    len: usize,
    end: impl FnOnce(std::sync::Arc<MemoryRegion>),
    enough: impl Fn(&[u8]) -> bool,
) -> (Vec<u8>, QueuePair) {
    let mem = AlignedBuf::new(len).unwrap();
    mem.write_at(0, &vec![0xAA; len]).unwrap();
    let (url, h) = target_over(4, std::sync::Arc::clone(&mem));
    let (mut s, _n) = raw_peer(&url, CapFlags::ALL, 4);
    let (tqp, cq, mr) = h.join().unwrap();
    let rr = wire::rdmap::ReadRequest {
        sink_stag: 0x1234,
        sink_to: 0,
        size: len as u32,
        src_stag: mr.rkey(),
        src_to: mr.addr(),
    };
    s.write_all(&fpdu(
        Header::untagged(Opcode::ReadRequest, 1, true),
        &rr.encode(),
    ))
    .unwrap();
    // The target answers until the socket takes no more: the peer reads nothing yet.
    let mut wc = [Completion::EMPTY; 4];
    let until = Instant::now() + Duration::from_millis(500);
    while Instant::now() < until {
        cq.poll(&mut wc).unwrap();
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(tqp.state(), QpState::Rts);
    end(mr);
    mem.write_at(0, &vec![0xBB; len]).unwrap();
    s.set_read_timeout(Some(Duration::from_millis(10))).unwrap();
    let mut got = Vec::new();
    let mut b = vec![0u8; 1 << 16];
    let until = Instant::now() + Duration::from_secs(10);
    while Instant::now() < until {
        cq.poll(&mut wc).unwrap();
        match s.read(&mut b) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&b[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
            // Asked only when nothing came for a while: it may parse all of `got`.
            Err(_) if enough(&got) => break,
            Err(_) => {}
        }
    }
    (got, tqp)
}

/// A peer's large Read, answered while the peer does not read, and the region revoked
/// meanwhile (a reload removed the namespace): what the socket had not taken by then never
/// leaves. The peer gets an RDMAP Invalid STag Terminate, or, if an FPDU was partly sent, its
/// stream ends in the middle of that FPDU; never a byte the region held after its revocation
/// (the memory lives on: the file it maps may serve someone else).
#[test]
fn a_read_response_stops_at_the_revocation_of_its_region() {
    const LEN: usize = 64 << 20;
    let (got, tqp) = a_read_held_by_a_peer_then(
        LEN,
        |mr| {
            mr.revoke();
            drop(mr);
        },
        |_| false,
    );
    let mut answered = 0;
    let mut framed = 0;
    for (h, payload) in fpdus(&got) {
        if h.opcode == Opcode::ReadResponse {
            assert!(
                !payload.contains(&0xBB),
                "bytes written after the revocation were sent, {answered} bytes in"
            );
            answered += payload.len();
        }
        framed += wire::fpdu_len(payload.len() + h.len());
    }
    assert!(answered < LEN, "the whole Read was answered");
    match terminate_in(&got) {
        Some(t) => assert_eq!(t.cause, TermCause::RDMAP_INVALID_STAG),
        None => assert!(
            framed < got.len() && !got[framed..].contains(&0xBB),
            "neither a Terminate nor a stream cut in the middle of an FPDU"
        ),
    }
    assert_eq!(tqp.state(), QpState::Error);
}

/// The same Read, its region only deregistered (a daemon drops a departing host's regions
/// before its Disconnect): new access is refused, but the Read accepted before goes out whole,
/// with no Terminate (its host would take a remote access error for a graceful goodbye).
#[test]
fn a_read_response_outlives_the_deregistration_of_its_region() {
    const LEN: usize = 16 << 20;
    let answered = |got: &[u8]| -> usize {
        fpdus(got)
            .iter()
            .filter(|(h, _)| h.opcode == Opcode::ReadResponse)
            .map(|(_, p)| p.len())
            .sum()
    };
    let (got, tqp) = a_read_held_by_a_peer_then(LEN, drop, |got| answered(got) >= LEN);
    assert!(terminate_in(&got).is_none(), "a Terminate");
    assert_eq!(answered(&got), LEN, "the Read was not answered whole");
    assert_eq!(tqp.state(), QpState::Rts, "{:?}", tqp.error());
}

#[test]
fn private_opcodes_need_the_peers_caps() {
    // A peer that advertises nothing: Flush, Atomic Write and atomics fail locally.
    let RawTarget { pd, qp, peer, .. } = raw_target(
        Caps::foreign(b"siw".to_vec()),
        &ConnParams::default(),
        |s| s,
    );
    let _peer = peer.join().unwrap();
    let info = qp.info();
    assert!(!info.peer_flush && !info.peer_atomic_write && !info.peer_atomics);
    assert_eq!(info.peer_private_data, b"siw");
    let mr = pd
        .register(AlignedBuf::new(64).unwrap(), Access::LOCAL_WRITE)
        .unwrap();
    let remote = RemoteAddr {
        addr: 0x1000,
        rkey: 0x100,
    };
    for op in [
        SendOp::Flush {
            target: FlushTarget::Region { rkey: 0x100 },
            kind: FlushType::Persistent,
        },
        SendOp::AtomicWrite { remote, value: 1 },
        SendOp::FetchAdd {
            local: Sge::new(&mr, 0, 8),
            remote,
            add: 1,
        },
        SendOp::CompareSwap {
            local: Sge::new(&mr, 0, 8),
            remote,
            compare: 0,
            swap: 1,
        },
        SendOp::WriteWithImm {
            local: Sge::new(&mr, 0, 8),
            remote,
            imm: 1,
        },
    ] {
        assert!(matches!(
            qp.post_send(SendWr::new(1, op)),
            Err(Error::PeerUnsupported { .. })
        ));
    }
    assert_eq!(
        qp.state(),
        QpState::Rts,
        "a local refusal does not break the queue pair"
    );
}

#[test]
fn a_short_read_response_fails_the_read_and_terminates() {
    let caps = Caps::new(CapFlags::ALL, None, b"raw".to_vec());
    let RawTarget {
        pd, cq, qp, peer, ..
    } = raw_target(caps, &params(false), |mut s| {
        // Wait for the Read Request, answer it with half the bytes asked for.
        let mut got = Vec::new();
        let rr = loop {
            let mut b = [0u8; 256];
            let n = s.read(&mut b).unwrap();
            assert!(n > 0, "the initiator sends a Read Request");
            got.extend_from_slice(&b[..n]);
            if let Some((_, body)) = fpdus(&got)
                .into_iter()
                .find(|(h, _)| h.opcode == Opcode::ReadRequest)
            {
                break wire::rdmap::ReadRequest::decode(&body).unwrap();
            }
        };
        let half = vec![0x77u8; rr.size as usize / 2];
        let resp = Header::tagged(Opcode::ReadResponse, rr.sink_stag, rr.sink_to, true);
        s.write_all(&fpdu(resp, &half)).unwrap();
        let rest = read_while(&mut s, || false);
        terminate_in(&rest).map(|t| t.cause)
    });
    let mr = pd
        .register(AlignedBuf::new(64).unwrap(), Access::LOCAL_WRITE)
        .unwrap();
    qp.post_send(SendWr::new(
        1,
        SendOp::Read {
            local: Sge::new(&mr, 0, 64),
            remote: RemoteAddr {
                addr: 0x1000,
                rkey: 0x100,
            },
        },
    ))
    .unwrap();
    let mut wc = [Completion::EMPTY; 1];
    let end = Instant::now() + Duration::from_secs(10);
    while cq.poll(&mut wc).unwrap() == 0 && Instant::now() < end {}
    assert_eq!((wc[0].wr_id, wc[0].status), (1, WcStatus::RemoteOperation));
    assert_eq!(qp.state(), QpState::Error);
    drop(qp);
    assert_eq!(
        peer.join().unwrap(),
        Some(TermCause::RDMAP_OPERATION_UNSPECIFIED),
        "the peer is told"
    );
}

/// A raw peer that keeps sending FPDUs after it was sent a Terminate: the queue pair goes to
/// Error, drains what arrives for a bounded time (the drain deadline, 2 s) and then closes;
/// no poll of the shared completion queue is held up meanwhile, and a second queue pair on that
/// completion queue keeps working.
#[test]
fn a_peer_flooding_after_the_terminate_cannot_pin_the_completion_queue() {
    let p = Pair::new(false);
    let listener = Listener::bind(&p.ctx, &"tcp://127.0.0.1:0".parse().unwrap()).unwrap();
    let url = listener.url().unwrap();
    let (pd, tcq) = (p.pd.clone(), p.tcq.clone());
    let h = std::thread::spawn(move || {
        let params = params(false);
        let req = listener.accept(&params).unwrap();
        let qp = pd.create_qp(&tcq, &tcq, QpCaps::default()).unwrap();
        req.accept(qp, &params, b"").unwrap()
    });
    let (mut s, _n) = raw_peer(&url, CapFlags::ALL, 4);
    let rawq = h.join().unwrap();
    let bad = |len| {
        fpdu(
            Header::tagged(Opcode::Write, 0xFFFF_FF00, 0, true),
            &vec![0xEE; len],
        )
    };
    let flooder = std::thread::spawn(move || {
        s.write_all(&bad(64)).unwrap();
        // Wait for the Terminate (the target half-closes after it).
        s.set_read_timeout(Some(Duration::from_millis(10))).unwrap();
        let mut got = Vec::new();
        let end = Instant::now() + Duration::from_secs(10);
        let mut b = [0u8; 4096];
        while terminate_in(&got).is_none() && Instant::now() < end {
            match s.read(&mut b) {
                Ok(0) => break,
                Ok(n) => got.extend_from_slice(&b[..n]),
                Err(_) => {}
            }
        }
        let term = terminate_in(&got);
        // Then flood until the target closes the connection (or 20 s).
        let mut burst = Vec::new();
        while burst.len() < 64 * 1024 {
            burst.extend(bad(1000));
        }
        let (start, mut sent) = (Instant::now(), 0usize);
        let closed = loop {
            if start.elapsed() > Duration::from_secs(20) {
                break false;
            }
            match s.write_all(&burst) {
                Ok(()) => sent += burst.len(),
                Err(_) => break true,
            }
        };
        (term, closed, sent, start.elapsed())
    });
    let (_tmem, tmr) = p.target_buf(4096, rw());
    let (imem, imr) = p.init_buf(64, Access::LOCAL_WRITE);
    let mut slowest = Duration::ZERO;
    let mut rounds = 0u32;
    while !flooder.is_finished() {
        let t = Instant::now();
        p.pump();
        slowest = slowest.max(t.elapsed());
        // The second queue pair on the target's completion queue: a Write and a Read back.
        rounds += 1;
        imem.write_at(0, &rounds.to_le_bytes()).unwrap();
        post_write_read(
            &p.qp,
            Sge::new(&imr, 0, 4),
            Sge::new(&imr, 8, 4),
            tmr.remote(0),
            SendFlags::empty(),
        );
        let t = Instant::now();
        let c = p.next_init();
        slowest = slowest.max(t.elapsed());
        assert_eq!((c.wr_id, c.status), (2, WcStatus::Success));
        let mut b = [0u8; 4];
        imem.read_at(8, &mut b).unwrap();
        assert_eq!(u32::from_le_bytes(b), rounds);
    }
    let (term, closed, sent, flooded) = flooder.join().unwrap();
    let term = term.expect("the raw peer was sent a Terminate");
    assert_eq!(term.cause, TermCause::DDP_TAGGED_INVALID_STAG);
    assert_eq!(rawq.state(), QpState::Error);
    assert!(
        closed,
        "the target closed the connection ({sent} bytes in {flooded:?})"
    );
    assert!(sent > 0, "the peer did flood");
    // Bounds far above the 2 s drain deadline, far below "never".
    assert!(
        flooded < Duration::from_secs(10),
        "closed after {flooded:?}"
    );
    assert!(slowest < Duration::from_secs(3), "a poll took {slowest:?}");
    assert!(rounds > 1);
    assert_eq!((p.qp.state(), p.tqp.state()), (QpState::Rts, QpState::Rts));
}
