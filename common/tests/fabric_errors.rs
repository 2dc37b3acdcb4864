//! Error paths of the `tcp` transport: protection faults end in a Terminate, a remote access
//! error at the requester, both queue pairs in Error with the rest flushed, other queue pairs
//! untouched, and no byte of memory changed.

mod fabric_util;

use std::io::{Read, Write};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fabric_util::*;
use rpma_common::fabric::soft::wire::{self, CapFlags, Caps, Header, Opcode, TermCause};
use rpma_common::fabric::*;

/// Writes `len` bytes of 0xAB to `remote`, then Reads 8 bytes back (APM): returns the Read's
/// completion.
fn write_then_read(p: &Pair, remote: RemoteAddr, len: usize) -> (Vec<Completion>, Completion) {
    let (imem, imr) = p.init_buf(len + 8, Access::LOCAL_WRITE);
    imem.write_at(0, &vec![0xAB; len]).unwrap();
    post_write_read(
        &p.qp,
        Sge::new(&imr, 0, len),
        Sge::new(&imr, len, 8),
        remote,
        SendFlags::SIGNALED,
    );
    p.until_init(2)
}

#[test]
fn bad_rkey_read_is_remote_access() {
    let p = Pair::new(true);
    let (tmem, tmr) = p.target_buf(4096, rw());
    let (_imem, imr) = p.init_buf(64, Access::LOCAL_WRITE);
    let bad = RemoteAddr {
        addr: tmr.addr(),
        rkey: tmr.rkey() ^ 0x100,
    };
    post_read(&p.qp, 1, Sge::new(&imr, 0, 8), bad);
    post_read(&p.qp, 2, Sge::new(&imr, 8, 8), tmr.remote(0));
    p.expect_init(1, WcStatus::RemoteAccess);
    p.expect_init(2, WcStatus::WrFlush);
    p.assert_both_error();
    assert!(
        p.tqp.error().unwrap().contains("Terminate"),
        "{:?}",
        p.tqp.error()
    );
    assert!(
        p.qp.error().unwrap().contains("Terminate"),
        "{:?}",
        p.qp.error()
    );
    assert_untouched(&tmem);
}

#[test]
fn bad_rkey_write_fails_the_following_read_and_places_nothing() {
    for crc in [true, false] {
        let p = Pair::new(crc);
        let (tmem, tmr) = p.target_buf(1 << 16, rw());
        let bad = RemoteAddr {
            addr: tmr.addr(),
            rkey: 0xFFFF_FF00,
        };
        let (_, read) = write_then_read(&p, bad, 5000);
        assert_eq!(read.status, WcStatus::RemoteAccess);
        p.assert_both_error();
        assert_untouched(&tmem);
    }
}

#[test]
fn out_of_bounds_write_places_nothing() {
    let p = Pair::new(false);
    let (tmem, tmr) = p.target_buf(4096, rw());
    // Starts inside, ends 1 byte past the region.
    let (_, read) = write_then_read(&p, tmr.remote(4096 - 100), 101);
    assert_eq!(read.status, WcStatus::RemoteAccess);
    p.assert_both_error();
    assert_untouched(&tmem);
    let p = Pair::new(true);
    let (tmem, tmr) = p.target_buf(4096, rw());
    let below = RemoteAddr {
        addr: tmr.addr() - 8,
        rkey: tmr.rkey(),
    };
    let (_, read) = write_then_read(&p, below, 16);
    assert_eq!(read.status, WcStatus::RemoteAccess);
    assert_untouched(&tmem);
}

#[test]
fn write_to_read_only_region_is_refused() {
    let p = Pair::new(true);
    let (tmem, tmr) = p.target_buf(4096, Access::REMOTE_READ);
    let (_, read) = write_then_read(&p, tmr.remote(0), 64);
    assert_eq!(read.status, WcStatus::RemoteAccess);
    p.assert_both_error();
    assert_untouched(&tmem);
}

#[test]
fn error_flushes_outstanding_and_spares_other_queue_pairs() {
    let p = Pair::new(true);
    let (q2, t2) = p.another();
    let (tmem, tmr) = p.target_buf(4096, rw());
    let (imem, imr) = p.init_buf(4096, Access::LOCAL_WRITE);
    // Many requests behind a bad one.
    let bad = RemoteAddr {
        addr: tmr.addr(),
        rkey: 0x0ABC_DE00,
    };
    post_read(&p.qp, 100, Sge::new(&imr, 0, 8), bad);
    for i in 0..10 {
        post_write(
            &p.qp,
            101 + i,
            Sge::new(&imr, 0, 8),
            tmr.remote(8),
            SendFlags::SIGNALED,
        );
    }
    p.tqp
        .post_recv(RecvWr {
            wr_id: 7,
            local: Some(Sge::new(&tmr, 0, 8)),
        })
        .unwrap();
    p.expect_init(100, WcStatus::RemoteAccess);
    for i in 0..10 {
        p.expect_init(101 + i, WcStatus::WrFlush);
    }
    let r = p.next_target();
    assert_eq!(
        (r.wr_id, r.status, r.opcode),
        (7, WcStatus::WrFlush, WcOpcode::Recv)
    );
    p.assert_both_error();
    assert_untouched(&tmem);
    // The second connection on the same device and CQs still works.
    assert_eq!((q2.state(), t2.state()), (QpState::Rts, QpState::Rts));
    imem.write_at(0, b"isolated").unwrap();
    q2.post_send(SendWr::new(
        9,
        SendOp::Write {
            local: Sge::new(&imr, 0, 8),
            remote: tmr.remote(0),
        },
    ))
    .unwrap();
    q2.post_send(SendWr::new(
        10,
        SendOp::Read {
            local: Sge::new(&imr, 8, 8),
            remote: tmr.remote(0),
        },
    ))
    .unwrap();
    assert_eq!(p.next_init().status, WcStatus::Success);
    let c = p.next_init();
    assert_eq!(
        (c.wr_id, c.status, c.qp_num),
        (10, WcStatus::Success, q2.qp_num())
    );
    let mut b = [0u8; 8];
    imem.read_at(8, &mut b).unwrap();
    assert_eq!(&b, b"isolated");
}

#[test]
fn send_without_posted_recv_is_a_terminate() {
    let p = Pair::new(true);
    let (_tmem, tmr) = p.target_buf(4096, rw());
    let (_imem, imr) = p.init_buf(64, Access::LOCAL_WRITE);
    p.qp.post_send(SendWr::new(
        1,
        SendOp::Send {
            local: Sge::new(&imr, 0, 16),
        },
    ))
    .unwrap();
    p.qp.post_send(SendWr::new(
        2,
        SendOp::Read {
            local: Sge::new(&imr, 16, 8),
            remote: tmr.remote(0),
        },
    ))
    .unwrap();
    let c = p.next_init();
    assert_eq!(
        (c.wr_id, c.status),
        (1, WcStatus::Success),
        "a Send completes when sent"
    );
    let c = p.next_init();
    assert_eq!((c.wr_id, c.status), (2, WcStatus::RemoteInvalidRequest));
    p.assert_both_error();
}

#[test]
fn send_longer_than_the_recv_is_local_length_there() {
    let p = Pair::new(false);
    let (_tmem, tmr) = p.target_buf(4096, rw());
    p.tqp
        .post_recv(RecvWr {
            wr_id: 5,
            local: Some(Sge::new(&tmr, 0, 8)),
        })
        .unwrap();
    let (_imem, imr) = p.init_buf(64, Access::LOCAL_WRITE);
    p.qp.post_send(SendWr::new(
        1,
        SendOp::Send {
            local: Sge::new(&imr, 0, 16),
        },
    ))
    .unwrap();
    let r = p.next_target();
    assert_eq!((r.wr_id, r.status), (5, WcStatus::LocalLength));
    p.assert_both_error();
}

#[test]
fn posting_needs_rts_and_valid_requests() {
    let p = Pair::new(true);
    let (_tmem, tmr) = p.target_buf(4096, rw());
    let (_imem, imr) = p.init_buf(64, Access::LOCAL_WRITE);
    let ro = p.init_buf(64, Access::empty()).1;
    let post = |op| p.qp.post_send(SendWr::new(1, op));
    assert!(matches!(
        post(SendOp::Write {
            local: Sge::new(&imr, 60, 8),
            remote: tmr.remote(0)
        }),
        Err(Error::LocalBounds { .. })
    ));
    assert!(matches!(
        post(SendOp::Read {
            local: Sge::new(&ro, 0, 8),
            remote: tmr.remote(0)
        }),
        Err(Error::LocalAccess { .. })
    ));
    assert!(matches!(
        post(SendOp::FetchAdd {
            local: Sge::new(&imr, 0, 8),
            remote: tmr.remote(4),
            add: 1
        }),
        Err(Error::InvalidWorkRequest { .. })
    ));
    assert!(matches!(
        post(SendOp::CompareSwap {
            local: Sge::new(&imr, 0, 4),
            remote: tmr.remote(0),
            compare: 0,
            swap: 1
        }),
        Err(Error::InvalidWorkRequest { .. })
    ));
    let other_pd = p.ctx.alloc_pd().unwrap();
    let foreign = other_pd
        .register(AlignedBuf::new(64).unwrap(), Access::LOCAL_WRITE)
        .unwrap();
    assert!(matches!(
        post(SendOp::Send {
            local: Sge::new(&foreign, 0, 8)
        }),
        Err(Error::WrongDomain { .. })
    ));
    p.qp.to_error();
    assert_eq!(p.qp.state(), QpState::Error);
    assert!(matches!(
        post(SendOp::Write {
            local: Sge::new(&imr, 0, 8),
            remote: tmr.remote(0)
        }),
        Err(Error::InvalidState {
            state: QpState::Error,
            ..
        })
    ));
    assert!(matches!(
        p.qp.post_recv(RecvWr {
            wr_id: 1,
            local: None
        }),
        Err(Error::InvalidState { .. })
    ));
    // The peer sees the close.
    p.assert_both_error();
}

#[test]
fn peer_close_flushes_outstanding_requests() {
    let p = Pair::new(true);
    let (_tmem, tmr) = p.target_buf(4096, rw());
    let (_imem, imr) = p.init_buf(64, Access::LOCAL_WRITE);
    // The target never polls, so the Read stays unanswered; then its queue pair goes away.
    p.qp.post_send(SendWr::new(
        1,
        SendOp::Read {
            local: Sge::new(&imr, 0, 8),
            remote: tmr.remote(0),
        },
    ))
    .unwrap();
    let Pair { qp, tqp, icq, .. } = p;
    drop(tqp);
    let mut wc = [Completion::EMPTY; 4];
    let n = icq.wait(&mut wc, Some(Duration::from_secs(10))).unwrap();
    assert_eq!(n, 1);
    assert_eq!((wc[0].wr_id, wc[0].status), (1, WcStatus::WrFlush));
    assert_eq!(qp.state(), QpState::Error);
}

#[test]
fn wait_times_out_when_idle() {
    let p = Pair::new(true);
    let mut wc = [Completion::EMPTY; 4];
    let t = Instant::now();
    assert_eq!(
        p.icq
            .wait(&mut wc, Some(Duration::from_millis(50)))
            .unwrap(),
        0
    );
    assert!(t.elapsed() >= Duration::from_millis(50));
}

/// Accepts one connection on a fresh target and returns (listener url, a thread handle that
/// yields the target's queue pair and CQ).
fn target(
    ird: u16,
) -> (
    Url,
    std::thread::JoinHandle<(QueuePair, CompletionQueue, std::sync::Arc<MemoryRegion>)>,
) {
    let ctx = Context::soft();
    let listener = Listener::bind(&ctx, &"tcp://127.0.0.1:0".parse().unwrap()).unwrap();
    let url = listener.url().unwrap();
    let h = std::thread::spawn(move || {
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(16).unwrap();
        let mr = pd.register(AlignedBuf::new(4096).unwrap(), rw()).unwrap();
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
fn connect_errors() {
    let ctx = Context::soft();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(16).unwrap();
    let prep = || pd.create_qp(&cq, &cq, QpCaps::default()).unwrap();
    // Nobody listens on port 1.
    let r = prep().connect(
        &"tcp://127.0.0.1:1".parse().unwrap(),
        &ConnParams::default(),
        b"",
    );
    assert!(matches!(r, Err(Error::Socket { .. })), "{r:?}");
    let r = prep().connect(
        &"rdma://127.0.0.1:1".parse().unwrap(),
        &ConnParams::default(),
        b"",
    );
    assert!(matches!(r, Err(Error::TransportUnavailable { .. })));
    let r = prep().connect(
        &"tcp://127.0.0.1:1".parse().unwrap(),
        &ConnParams::default(),
        &[0; 241],
    );
    assert!(matches!(r, Err(Error::InvalidWorkRequest { .. })));
    // A rejected request.
    let listener = Listener::bind(&ctx, &"tcp://127.0.0.1:0".parse().unwrap()).unwrap();
    let url = listener.url().unwrap();
    let h = std::thread::spawn(move || {
        listener
            .accept(&ConnParams::default())
            .unwrap()
            .reject(b"no")
    });
    let r = prep().connect(&url, &ConnParams::default(), b"");
    h.join().unwrap();
    match r {
        Err(Error::Rejected { private_data, .. }) => assert_eq!(private_data, b"no"),
        r => panic!("{r:?}"),
    }
    // A max ULPDU below the wire layer's minimum is refused before connecting.
    for max_ulpdu in [127, 65536] {
        let r = prep().connect(
            &"tcp://127.0.0.1:1".parse().unwrap(),
            &ConnParams {
                tcp: TcpParams {
                    max_ulpdu,
                    ..TcpParams::default()
                },
                ..ConnParams::default()
            },
            b"",
        );
        assert!(matches!(r, Err(Error::InvalidWorkRequest { .. })), "{r:?}");
    }
}

/// Builds a request from (local region, target region).
type MakeOp = dyn Fn(&Arc<MemoryRegion>, &Arc<MemoryRegion>) -> SendOp;

#[test]
fn atomics_and_flush_need_their_rights() {
    let ops: Vec<Box<MakeOp>> = vec![
        Box::new(|l, t| SendOp::FetchAdd {
            local: Sge::new(l, 0, 8),
            remote: t.remote(0),
            add: 1,
        }),
        Box::new(|_, t| SendOp::Flush {
            target: FlushTarget::Range {
                remote: t.remote(0),
                len: 8,
            },
            kind: FlushType::Persistent,
        }),
        Box::new(|_, t| SendOp::Flush {
            target: FlushTarget::Region { rkey: t.rkey() },
            kind: FlushType::Visibility,
        }),
        Box::new(|_, t| SendOp::AtomicWrite {
            remote: t.remote(0),
            value: 1,
        }),
    ];
    for op in ops {
        let p = Pair::new(true);
        // Read-only: no atomic, flush or write right.
        let (tmem, tmr) = p.target_buf(4096, Access::REMOTE_READ);
        let (_imem, imr) = p.init_buf(64, Access::LOCAL_WRITE);
        p.qp.post_send(SendWr::new(1, op(&imr, &tmr))).unwrap();
        let c = p.next_init();
        assert_eq!((c.wr_id, c.status), (1, WcStatus::RemoteAccess));
        p.assert_both_error();
        assert_untouched(&tmem);
    }
}

#[test]
fn misaligned_atomic_write_is_refused_locally() {
    let p = Pair::new(true);
    let (_tmem, tmr) = p.target_buf(4096, rw());
    let r = p.qp.post_send(SendWr::new(
        1,
        SendOp::AtomicWrite {
            remote: tmr.remote(3),
            value: 1,
        },
    ));
    assert!(matches!(r, Err(Error::InvalidWorkRequest { .. })));
    let (_imem, imr) = p.init_buf(64, Access::LOCAL_WRITE);
    let r = p.qp.post_send(
        SendWr::new(
            2,
            SendOp::Read {
                local: Sge::new(&imr, 0, 8),
                remote: tmr.remote(0),
            },
        )
        .with_flags(SendFlags::SOLICITED),
    );
    assert!(
        matches!(r, Err(Error::InvalidWorkRequest { .. })),
        "SE only on Send"
    );
    assert_eq!(p.qp.state(), QpState::Rts);
}

#[test]
fn an_idle_target_blocks_in_epoll_and_wakes_on_traffic() {
    let p = Pair::new(false);
    let (_tmem, tmr) = p.target_buf(4096, rw());
    p.tqp
        .post_recv(RecvWr {
            wr_id: 42,
            local: Some(Sge::new(&tmr, 0, 64)),
        })
        .unwrap();
    let tcq = p.tcq.clone();
    let waiter = std::thread::spawn(move || {
        let mut wc = [Completion::EMPTY; 4];
        let (t, cpu) = (Instant::now(), thread_cpu());
        let n = tcq.wait(&mut wc, Some(Duration::from_secs(20))).unwrap();
        (n, wc[0], t.elapsed(), thread_cpu() - cpu)
    });
    std::thread::sleep(Duration::from_millis(200));
    let (imem, imr) = p.init_buf(64, Access::LOCAL_WRITE);
    imem.write_at(0, b"wake up").unwrap();
    p.qp.post_send(SendWr::new(
        1,
        SendOp::Send {
            local: Sge::new(&imr, 0, 7),
        },
    ))
    .unwrap();
    let (n, c, waited, cpu) = waiter.join().unwrap();
    assert_eq!(n, 1);
    assert_eq!((c.wr_id, c.status, c.byte_len), (42, WcStatus::Success, 7));
    assert!(
        waited >= Duration::from_millis(150),
        "it waited for the Send, not timed out early"
    );
    assert!(
        waited < Duration::from_secs(20),
        "woken by the traffic, not by the time-out"
    );
    assert!(
        cpu < waited / 2,
        "the idle wait slept ({cpu:?} of CPU in {waited:?})"
    );
}

/// CPU time used by the calling thread.
fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_THREAD_CPUTIME_ID needs nothing else.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0);
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
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
        let params = ConnParams {
            tcp: TcpParams {
                crc: false,
                ..TcpParams::default()
            },
            ..ConnParams::default()
        };
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
