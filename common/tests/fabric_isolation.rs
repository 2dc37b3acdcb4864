//! Isolation of queue pairs that share a device and completion queues: a fault on one, while
//! another has traffic in flight, flushes only the faulty one.

mod fabric_util;

use std::time::{Duration, Instant};

use fabric_util::*;
use rpma_common::fabric::*;

fn rw() -> Access {
    Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ
}

/// Polls `p` until both queue pairs of a connection are in Error, or 5 s.
fn until_error(p: &Pair, a: &QueuePair, b: &QueuePair) {
    let end = Instant::now() + Duration::from_secs(5);
    while (a.state() != QpState::Error || b.state() != QpState::Error) && Instant::now() < end {
        p.pump();
    }
    assert_eq!((a.state(), b.state()), (QpState::Error, QpState::Error));
}

#[test]
fn out_of_bounds_read_source_is_remote_access_and_places_nothing() {
    let p = Pair::new(true);
    let (tmem, tmr) = p.target_buf(4096, rw());
    tmem.write_at(4096 - 8, b"the tail").unwrap();
    let (imem, imr) = p.init_buf(64, Access::LOCAL_WRITE);
    imem.write_at(0, &[0x5A; 64]).unwrap();
    // 16 bytes from 8 before the end: the first half exists, the second does not.
    p.qp.post_send(SendWr::new(
        1,
        SendOp::Read {
            local: Sge::new(&imr, 16, 16),
            remote: tmr.remote(4096 - 8),
        },
    ))
    .unwrap();
    p.qp.post_send(SendWr::new(
        2,
        SendOp::Read {
            local: Sge::new(&imr, 32, 8),
            remote: tmr.remote(0),
        },
    ))
    .unwrap();
    let c = p.next_init();
    assert_eq!((c.wr_id, c.status), (1, WcStatus::RemoteAccess));
    let c = p.next_init();
    assert_eq!((c.wr_id, c.status), (2, WcStatus::WrFlush));
    assert_eq!(imem.to_vec(), vec![0x5A; 64], "the sink is untouched");
    until_error(&p, &p.qp, &p.tqp);
    let mut t = vec![0u8; 4096];
    t[4096 - 8..].copy_from_slice(b"the tail");
    assert_eq!(tmem.to_vec(), t, "the source is unchanged");
    // Below the region, through the API as well.
    let p = Pair::new(false);
    let (_tmem, tmr) = p.target_buf(4096, rw());
    let (imem, imr) = p.init_buf(64, Access::LOCAL_WRITE);
    p.qp.post_send(SendWr::new(
        3,
        SendOp::Read {
            local: Sge::new(&imr, 0, 16),
            remote: RemoteAddr {
                addr: tmr.addr() - 8,
                rkey: tmr.rkey(),
            },
        },
    ))
    .unwrap();
    let c = p.next_init();
    assert_eq!((c.wr_id, c.status), (3, WcStatus::RemoteAccess));
    assert!(imem.to_vec().iter().all(|&b| b == 0));
    until_error(&p, &p.qp, &p.tqp);
}

#[test]
fn a_fault_on_one_queue_pair_spares_another_with_traffic_in_flight() {
    const N: usize = 48;
    let p = Pair::new(true);
    // QP2 shares the device, the domain and both CQs with QP1 (`p.qp`).
    let (q2, t2) = p.another();
    let (tmem, tmr) = p.target_buf(N * 64, rw());
    let (imem, imr) = p.init_buf(N * 64 * 2, Access::LOCAL_WRITE);
    for i in 0..N {
        imem.write_at(i * 64, &[i as u8 + 1; 64]).unwrap();
    }
    // Nothing is polled until everything is posted: QP2's requests are outstanding.
    for i in 0..N {
        q2.post_send(SendWr::new(
            (1000 + 2 * i) as u64,
            SendOp::Write {
                local: Sge::new(&imr, i * 64, 64),
                remote: tmr.remote((i * 64) as u64),
            },
        ))
        .unwrap();
        q2.post_send(SendWr::new(
            (1001 + 2 * i) as u64,
            SendOp::Read {
                local: Sge::new(&imr, N * 64 + i * 64, 64),
                remote: tmr.remote((i * 64) as u64),
            },
        ))
        .unwrap();
    }
    let bad = RemoteAddr {
        addr: tmr.addr(),
        rkey: tmr.rkey() ^ 0x100,
    };
    p.qp.post_send(SendWr::new(
        1,
        SendOp::Read {
            local: Sge::new(&imr, 0, 8),
            remote: bad,
        },
    ))
    .unwrap();
    for i in 0..8u64 {
        p.qp.post_send(SendWr::new(
            2 + i,
            SendOp::Read {
                local: Sge::new(&imr, 0, 8),
                remote: tmr.remote(0),
            },
        ))
        .unwrap();
    }
    let mut q1 = Vec::new();
    let mut q2c = Vec::new();
    while q1.len() < 9 || q2c.len() < 2 * N {
        let c = p.next_init();
        if c.qp_num == p.qp.qp_num() {
            q1.push(c);
        } else {
            assert_eq!(c.qp_num, q2.qp_num());
            q2c.push(c);
        }
    }
    assert_eq!((q1[0].wr_id, q1[0].status), (1, WcStatus::RemoteAccess));
    for (i, c) in q1[1..].iter().enumerate() {
        assert_eq!((c.wr_id, c.status), (2 + i as u64, WcStatus::WrFlush));
    }
    for (i, c) in q2c.iter().enumerate() {
        assert_eq!(
            (c.wr_id, c.status),
            (1000 + i as u64, WcStatus::Success),
            "QP2 completes everything, in order"
        );
    }
    for i in 0..N {
        let mut b = [0u8; 64];
        imem.read_at(N * 64 + i * 64, &mut b).unwrap();
        assert_eq!(b, [i as u8 + 1; 64], "Read {i} saw its Write");
    }
    assert_eq!(&tmem.to_vec()[..64], &[1; 64]);
    until_error(&p, &p.qp, &p.tqp);
    assert_eq!((q2.state(), t2.state()), (QpState::Rts, QpState::Rts));
}
