//! Error paths of the `tcp` transport: protection faults end in a Terminate, a remote access
//! error at the requester, both queue pairs in Error with the rest flushed, other queue pairs
//! untouched, and no byte of memory changed.
//!
//! A peer that speaks the wire itself (hostile or broken) is in fabric_raw_peer.rs.

mod fabric_util;

use std::sync::Arc;
use std::time::{Duration, Instant};

use fabric_util::*;
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
    // The typed reasons: the target sent a Terminate, the initiator received it, with the
    // status its Read completed with.
    assert!(
        matches!(p.tqp.error(), Some(QpFailure::TerminateSent { .. })),
        "{:?}",
        p.tqp.error()
    );
    assert!(
        matches!(
            p.qp.error(),
            Some(QpFailure::TerminateReceived {
                status: WcStatus::RemoteAccess,
                ..
            })
        ),
        "{:?}",
        p.qp.error()
    );
    let text = p.qp.error().unwrap().to_string();
    assert!(
        text.starts_with("received Terminate (RDMAP etype: 1"),
        "{text}"
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
    // Without the `rdma` feature the transport is not in the build; with it, a queue pair of
    // the soft device cannot connect to an rdma:// URL (that needs an RDMA context).
    if cfg!(feature = "rdma") {
        assert!(matches!(r, Err(Error::BadUrl { .. })), "{r:?}");
    } else {
        assert!(
            matches!(r, Err(Error::TransportUnavailable { .. })),
            "{r:?}"
        );
    }
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
    // Once it blocked (not a wall-clock guess at when the waiter started), 200 ms more.
    while p.tcq.blocked_waits() == 0 {
        std::thread::yield_now();
    }
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
