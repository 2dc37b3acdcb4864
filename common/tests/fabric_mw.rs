//! Memory windows: bind to a QP with a sub-range and a subset of rights, rebind and
//! invalidate (locally, or by the peer's Send with Invalidate) revoke the old rkey.

mod fabric_util;

use std::sync::Arc;

use fabric_util::*;
use rpma_common::fabric::*;

fn target_mr(p: &Pair) -> (Arc<AlignedBuf>, Arc<MemoryRegion>) {
    p.target_buf(
        8192,
        Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ | Access::MW_BIND,
    )
}

/// Write 8 bytes then Read them back through `remote`; returns the Read's status.
fn apm(p: &Pair, imr: &Arc<MemoryRegion>, remote: RemoteAddr) -> WcStatus {
    apm_on(&p.qp, imr, remote);
    p.until_init(2).1.status
}

/// Posts `apm`'s Write (unsignalled, wr 1) and Read (wr 2) on `qp`.
fn apm_on(qp: &QueuePair, imr: &Arc<MemoryRegion>, remote: RemoteAddr) {
    post_write_read(
        qp,
        Sge::new(imr, 0, 8),
        Sge::new(imr, 8, 8),
        remote,
        SendFlags::empty(),
    );
}

/// Binds `mw` to `mr[0..64]` through the target QP with remote read and write; returns the
/// window's address at offset 0.
fn bind_rw64(p: &Pair, mw: &MemoryWindow, mr: &Arc<MemoryRegion>) -> RemoteAddr {
    bind_rw64_on(&p.tqp, mw, mr)
}

fn bind_rw64_on(tqp: &QueuePair, mw: &MemoryWindow, mr: &Arc<MemoryRegion>) -> RemoteAddr {
    let rkey = tqp
        .bind_mw(mw, mr, 0, 64, Access::REMOTE_READ | Access::REMOTE_WRITE)
        .unwrap();
    RemoteAddr {
        addr: mr.addr(),
        rkey,
    }
}

#[test]
fn bind_scopes_range_and_rights_and_rebind_revokes() {
    let p = Pair::new(true);
    let (tmem, mr) = target_mr(&p);
    let (imem, imr) = p.init_buf(64, Access::LOCAL_WRITE);
    imem.write_at(0, b"windowed").unwrap();
    let mw = p.pd.alloc_mw().unwrap();
    let rkey = p
        .tqp
        .bind_mw(
            &mw,
            &mr,
            4096,
            1024,
            Access::REMOTE_WRITE | Access::REMOTE_READ,
        )
        .unwrap();
    assert_eq!(rkey, mw.rkey());
    assert_ne!(rkey, mr.rkey());
    let at = |off: u64, rkey| RemoteAddr {
        addr: mr.addr() + off,
        rkey,
    };
    assert_eq!(apm(&p, &imr, at(4096 + 8, rkey)), WcStatus::Success);
    let mut b = [0u8; 8];
    tmem.read_at(4096 + 8, &mut b).unwrap();
    assert_eq!(&b, b"windowed");
    // Rebinding gives a new rkey; the old one is refused.
    let rkey2 = p
        .tqp
        .bind_mw(&mw, &mr, 0, 1024, Access::REMOTE_READ)
        .unwrap();
    assert_ne!(rkey2, rkey);
    assert_eq!(apm(&p, &imr, at(4096 + 8, rkey)), WcStatus::RemoteAccess);
    assert_eq!(p.tqp.state(), QpState::Error);
}

#[test]
fn window_outside_its_range_or_rights_is_refused() {
    let p = Pair::new(false);
    let (tmem, mr) = target_mr(&p);
    let (_imem, imr) = p.init_buf(64, Access::LOCAL_WRITE);
    let mw = p.pd.alloc_mw().unwrap();
    let rkey = p
        .tqp
        .bind_mw(&mw, &mr, 4096, 1024, Access::REMOTE_READ)
        .unwrap();
    // A read-only window refuses the Write even though the region allows it.
    let remote = RemoteAddr {
        addr: mr.addr() + 4096,
        rkey,
    };
    assert_eq!(apm(&p, &imr, remote), WcStatus::RemoteAccess);
    assert_untouched(&tmem);
    let p = Pair::new(false);
    let (_tmem, mr) = target_mr(&p);
    let mw = p.pd.alloc_mw().unwrap();
    let rkey = p
        .tqp
        .bind_mw(
            &mw,
            &mr,
            4096,
            1024,
            Access::REMOTE_READ | Access::REMOTE_WRITE,
        )
        .unwrap();
    let (_imem, imr) = p.init_buf(64, Access::LOCAL_WRITE);
    // Below the window, inside the region.
    let remote = RemoteAddr {
        addr: mr.addr() + 4000,
        rkey,
    };
    assert_eq!(apm(&p, &imr, remote), WcStatus::RemoteAccess);
}

#[test]
fn bind_errors() {
    let p = Pair::new(true);
    let (_tmem, mr) = target_mr(&p);
    let mw = p.pd.alloc_mw().unwrap();
    let no_bind = p
        .target_buf(64, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
        .1;
    assert!(matches!(
        p.tqp.bind_mw(&mw, &no_bind, 0, 8, Access::REMOTE_WRITE),
        Err(Error::MemoryWindow { .. })
    ));
    assert!(matches!(
        p.tqp.bind_mw(&mw, &mr, 8190, 8, Access::REMOTE_READ),
        Err(Error::MemoryWindow { .. })
    ));
    assert!(matches!(
        p.tqp.bind_mw(&mw, &mr, 0, 0, Access::REMOTE_READ),
        Err(Error::MemoryWindow { .. })
    ));
    assert!(matches!(
        p.tqp.bind_mw(&mw, &mr, 0, 8, Access::REMOTE_ATOMIC),
        Err(Error::MemoryWindow { .. })
    ));
    let other = p.ctx.alloc_pd().unwrap().alloc_mw().unwrap();
    assert!(matches!(
        p.tqp.bind_mw(&other, &mr, 0, 8, Access::REMOTE_READ),
        Err(Error::WrongDomain { .. })
    ));
}

#[test]
fn bind_through_a_queue_pair_of_another_domain_is_refused() {
    let p = Pair::new(true);
    let pd2 = p.ctx.alloc_pd().unwrap();
    let mr2 = pd2
        .register(
            AlignedBuf::new(4096).unwrap(),
            Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ | Access::MW_BIND,
        )
        .unwrap();
    let mw2 = pd2.alloc_mw().unwrap();
    let old = mw2.rkey();
    // Window and region agree, but the queue pair is of `p.pd`.
    let r = p.tqp.bind_mw(&mw2, &mr2, 0, 64, Access::REMOTE_READ);
    match r {
        Err(e @ Error::WrongDomain { .. }) => {
            assert!(e.to_string().contains("queue pair"), "{e}")
        }
        r => panic!("{r:?}"),
    }
    assert_eq!(mw2.rkey(), old, "nothing was bound");
    // The refusal leaves the queue pair usable: a bind in its own domain works.
    let (_tmem, mr) = target_mr(&p);
    let mw = p.pd.alloc_mw().unwrap();
    assert!(p.tqp.bind_mw(&mw, &mr, 0, 64, Access::REMOTE_READ).is_ok());
    assert_eq!(p.tqp.state(), QpState::Rts);
}

#[test]
fn local_invalidate_revokes() {
    let p = Pair::new(true);
    let (_tmem, mr) = target_mr(&p);
    let (_imem, imr) = p.init_buf(64, Access::LOCAL_WRITE);
    let mw = p.pd.alloc_mw().unwrap();
    let remote = bind_rw64(&p, &mw, &mr);
    assert_eq!(apm(&p, &imr, remote), WcStatus::Success);
    mw.invalidate();
    assert_eq!(apm(&p, &imr, remote), WcStatus::RemoteAccess);
}

#[test]
fn send_with_invalidate_revokes_the_rkey() {
    let p = Pair::new(true);
    let (_tmem, mr) = target_mr(&p);
    let (_imem, imr) = p.init_buf(64, Access::LOCAL_WRITE);
    let mw = p.pd.alloc_mw().unwrap();
    let remote = bind_rw64(&p, &mw, &mr);
    let rkey = remote.rkey;
    p.tqp
        .post_recv(RecvWr {
            wr_id: 9,
            local: Some(Sge::new(&mr, 1024, 64)),
        })
        .unwrap();
    assert_eq!(apm(&p, &imr, remote), WcStatus::Success);
    p.qp.post_send(SendWr::new(
        3,
        SendOp::SendWithInvalidate {
            local: Sge::new(&imr, 0, 4),
            invalidate_rkey: rkey,
        },
    ))
    .unwrap();
    assert_eq!(p.next_init().wr_id, 3);
    let r = p.next_target();
    assert_eq!(
        (r.wr_id, r.status, r.byte_len, r.invalidated_rkey),
        (9, WcStatus::Success, 4, Some(rkey))
    );
    assert_eq!(apm(&p, &imr, remote), WcStatus::RemoteAccess);
}

#[test]
fn send_with_invalidate_of_a_region_rkey_is_refused() {
    let p = Pair::new(true);
    let (_tmem, mr) = target_mr(&p);
    let (_imem, imr) = p.init_buf(64, Access::LOCAL_WRITE);
    let (c, r) = post_send_with_invalidate_and_read(&p, &mr, &imr, mr.rkey());
    assert_eq!((c.wr_id, c.status), (4, WcStatus::RemoteOperation));
    assert_eq!((r.wr_id, r.status), (9, WcStatus::WrFlush));
}

#[test]
fn dropping_the_region_revokes_its_windows() {
    let p = Pair::new(true);
    let (tmem, mr) = target_mr(&p);
    let (imem, imr) = p.init_buf(64, Access::LOCAL_WRITE);
    imem.write_at(0, b"too late").unwrap();
    let mw = p.pd.alloc_mw().unwrap();
    let remote = bind_rw64(&p, &mw, &mr);
    let rkey = remote.rkey;
    drop(mr);
    // The window's rkey died with its region: the Write is refused and places nothing, and
    // the Read behind it reports RemoteAccess (a Write completes when sent).
    assert_eq!(apm(&p, &imr, remote), WcStatus::RemoteAccess);
    assert_eq!(p.qp.state(), QpState::Error);
    assert_untouched(&tmem);
    assert_eq!(mw.rkey(), rkey, "the window object itself is untouched");
}

/// Posts a Send with Invalidate of `rkey` (wr 3) and a Read behind it (wr 4) on `p.qp`, with a
/// Recv (wr 9) posted on the target; returns (the Read's status, the Recv's status).
fn send_with_invalidate_then_read(
    p: &Pair,
    mr: &Arc<MemoryRegion>,
    imr: &Arc<MemoryRegion>,
    rkey: u32,
) -> (WcStatus, WcStatus) {
    let (c, r) = post_send_with_invalidate_and_read(p, mr, imr, rkey);
    assert_eq!(c.wr_id, 4);
    assert_eq!(r.wr_id, 9);
    assert_eq!(p.tqp.state(), QpState::Error);
    (c.status, r.status)
}

/// The posts of [`send_with_invalidate_then_read`]; asserts the Send completed first and
/// returns (the next initiator completion, the next target completion).
fn post_send_with_invalidate_and_read(
    p: &Pair,
    mr: &Arc<MemoryRegion>,
    imr: &Arc<MemoryRegion>,
    rkey: u32,
) -> (Completion, Completion) {
    p.tqp
        .post_recv(RecvWr {
            wr_id: 9,
            local: Some(Sge::new(mr, 1024, 64)),
        })
        .unwrap();
    p.qp.post_send(SendWr::new(
        3,
        SendOp::SendWithInvalidate {
            local: Sge::new(imr, 0, 4),
            invalidate_rkey: rkey,
        },
    ))
    .unwrap();
    post_read(&p.qp, 4, Sge::new(imr, 8, 8), mr.remote(0));
    assert_eq!(p.next_init().wr_id, 3);
    (p.next_init(), p.next_target())
}

#[test]
fn send_with_invalidate_of_a_window_of_another_qp_is_a_protection_error() {
    let p = Pair::new(true);
    let (_tmem, mr) = target_mr(&p);
    let (_imem, imr) = p.init_buf(64, Access::LOCAL_WRITE);
    let (qp2, tqp2) = p.another();
    let mw = p.pd.alloc_mw().unwrap();
    let rkey = bind_rw64_on(&tqp2, &mw, &mr).rkey;
    // RDMAP Remote Protection Error "STag cannot be invalidated" (0x0/0x1/0x09): RemoteAccess.
    assert_eq!(
        send_with_invalidate_then_read(&p, &mr, &imr, rkey),
        (WcStatus::RemoteAccess, WcStatus::WrFlush)
    );
    assert!(
        p.tqp
            .error()
            .is_some_and(|e| e.to_string().contains("etype: 1, ecode: 9")),
        "{:?}",
        p.tqp.error()
    );
    // The window was not invalidated: it still works for its own queue pair.
    assert_eq!(tqp2.state(), QpState::Rts);
    let remote = RemoteAddr {
        addr: mr.addr(),
        rkey,
    };
    post_write(&qp2, 5, Sge::new(&imr, 0, 8), remote, SendFlags::SIGNALED);
    p.expect_init(5, WcStatus::Success);
}

#[test]
fn send_with_invalidate_of_another_domains_stag_is_a_protection_error() {
    let p = Pair::new(true);
    let (_tmem, mr) = target_mr(&p);
    let (_imem, imr) = p.init_buf(64, Access::LOCAL_WRITE);
    let other = p.ctx.alloc_pd().unwrap();
    let foreign = other
        .register(
            AlignedBuf::new(64).unwrap(),
            Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::MW_BIND,
        )
        .unwrap();
    assert_eq!(
        send_with_invalidate_then_read(&p, &mr, &imr, foreign.rkey()),
        (WcStatus::RemoteAccess, WcStatus::WrFlush)
    );
}

#[test]
fn send_with_invalidate_of_an_unknown_stag_is_an_operation_error() {
    let p = Pair::new(true);
    let (_tmem, mr) = target_mr(&p);
    let (_imem, imr) = p.init_buf(64, Access::LOCAL_WRITE);
    let mw = p.pd.alloc_mw().unwrap();
    let rkey = p.tqp.bind_mw(&mw, &mr, 0, 64, Access::REMOTE_READ).unwrap();
    mw.invalidate();
    // RDMAP Remote Operation Error "STag cannot be invalidated" (0x0/0x2/0x09).
    assert_eq!(
        send_with_invalidate_then_read(&p, &mr, &imr, rkey),
        (WcStatus::RemoteOperation, WcStatus::WrFlush)
    );
    assert!(
        p.tqp
            .error()
            .is_some_and(|e| e.to_string().contains("etype: 2, ecode: 9")),
        "{:?}",
        p.tqp.error()
    );
}

#[test]
fn a_window_bound_to_one_queue_pair_is_refused_through_another() {
    let p = Pair::new(true);
    // B: a second connection on the same domain and CQs.
    let (qb, tb) = p.another();
    let (tmem, mr) = target_mr(&p);
    let (imem, imr) = p.init_buf(64, Access::LOCAL_WRITE);
    imem.write_at(0, b"stranger").unwrap();
    imem.write_at(8, b"untouchd").unwrap();
    let mw = p.pd.alloc_mw().unwrap();
    // Bound to A's target side.
    let remote = bind_rw64(&p, &mw, &mr);
    apm_on(&qb, &imr, remote);
    let c = p.next_init();
    assert_eq!(
        (c.wr_id, c.status, c.qp_num),
        (2, WcStatus::RemoteAccess, qb.qp_num())
    );
    assert_untouched(&tmem);
    let mut b = [0u8; 8];
    imem.read_at(8, &mut b).unwrap();
    assert_eq!(&b, b"untouchd", "the failed Read placed nothing");
    p.until_error(&qb, &tb);
    // A, the window's queue pair, keeps working through the same rkey.
    assert_eq!((p.qp.state(), p.tqp.state()), (QpState::Rts, QpState::Rts));
    imem.write_at(0, b"welcome!").unwrap();
    assert_eq!(apm(&p, &imr, remote), WcStatus::Success);
    tmem.read_at(0, &mut b).unwrap();
    assert_eq!(&b, b"welcome!");
    imem.read_at(8, &mut b).unwrap();
    assert_eq!(&b, b"welcome!");
}
