//! Isolation of queue pairs that share a device and completion queues: a fault on one, while
//! another has traffic in flight, flushes only the faulty one.

mod fabric_util;

use fabric_util::*;
use rpma_common::fabric::*;

#[test]
fn out_of_bounds_read_source_is_remote_access_and_places_nothing() {
    let p = Pair::new(true);
    let (tmem, tmr) = p.target_buf(4096, rw());
    tmem.write_at(4096 - 8, b"the tail").unwrap();
    let (imem, imr) = p.init_buf(64, Access::LOCAL_WRITE);
    imem.write_at(0, &[0x5A; 64]).unwrap();
    // 16 bytes from 8 before the end: the first half exists, the second does not.
    post_read(&p.qp, 1, Sge::new(&imr, 16, 16), tmr.remote(4096 - 8));
    post_read(&p.qp, 2, Sge::new(&imr, 32, 8), tmr.remote(0));
    p.expect_init(1, WcStatus::RemoteAccess);
    p.expect_init(2, WcStatus::WrFlush);
    assert_eq!(imem.to_vec(), vec![0x5A; 64], "the sink is untouched");
    p.assert_both_error();
    let mut t = vec![0u8; 4096];
    t[4096 - 8..].copy_from_slice(b"the tail");
    assert_eq!(tmem.to_vec(), t, "the source is unchanged");
    // Below the region, through the API as well.
    let p = Pair::new(false);
    let (_tmem, tmr) = p.target_buf(4096, rw());
    let (imem, imr) = p.init_buf(64, Access::LOCAL_WRITE);
    let below = RemoteAddr {
        addr: tmr.addr() - 8,
        rkey: tmr.rkey(),
    };
    post_read(&p.qp, 3, Sge::new(&imr, 0, 16), below);
    p.expect_init(3, WcStatus::RemoteAccess);
    assert!(imem.to_vec().iter().all(|&b| b == 0));
    p.assert_both_error();
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
        let remote = tmr.remote((i * 64) as u64);
        let (w, r) = ((1000 + 2 * i) as u64, (1001 + 2 * i) as u64);
        post_write(
            &q2,
            w,
            Sge::new(&imr, i * 64, 64),
            remote,
            SendFlags::SIGNALED,
        );
        post_read(&q2, r, Sge::new(&imr, N * 64 + i * 64, 64), remote);
    }
    let bad = RemoteAddr {
        addr: tmr.addr(),
        rkey: tmr.rkey() ^ 0x100,
    };
    post_read(&p.qp, 1, Sge::new(&imr, 0, 8), bad);
    for i in 0..8u64 {
        post_read(&p.qp, 2 + i, Sge::new(&imr, 0, 8), tmr.remote(0));
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
    p.assert_both_error();
    assert_eq!((q2.state(), t2.state()), (QpState::Rts, QpState::Rts));
}
