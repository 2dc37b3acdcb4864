//! Loopback end-to-end tests of the `tcp` transport: every operation, CRC on and off.

mod fabric_util;

use std::sync::Arc;

use fabric_util::*;
use rpma_common::fabric::*;

fn write_then_read(crc: bool, len: usize) {
    let p = Pair::new(crc);
    let (tmem, tmr) = p.target_buf(
        len + 64,
        Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
    );
    let (imem, imr) = p.init_buf(2 * len + 64, Access::LOCAL_WRITE);
    let data: Vec<u8> = (0..len).map(|i| (i * 31 + 7) as u8).collect();
    imem.write_at(0, &data).unwrap();
    p.qp.post_send(SendWr::new(
        1,
        SendOp::Write {
            local: Sge::new(&imr, 0, len),
            remote: tmr.remote(16),
        },
    ))
    .unwrap();
    let c = p.next_init();
    assert_eq!(
        (c.wr_id, c.status, c.opcode, c.byte_len),
        (1, WcStatus::Success, WcOpcode::RdmaWrite, len as u32)
    );
    p.qp.post_send(SendWr::new(
        2,
        SendOp::Read {
            local: Sge::new(&imr, len, len),
            remote: tmr.remote(16),
        },
    ))
    .unwrap();
    let c = p.next_init();
    assert_eq!(
        (c.wr_id, c.status, c.opcode, c.byte_len),
        (2, WcStatus::Success, WcOpcode::RdmaRead, len as u32)
    );
    let mut back = vec![0u8; len];
    imem.read_at(len, &mut back).unwrap();
    assert!(back == data, "read back what was written");
    tmem.read_at(16, &mut back).unwrap();
    assert!(back == data, "placed at the right offset");
    let mut head = [1u8; 16];
    tmem.read_at(0, &mut head).unwrap();
    assert_eq!(head, [0u8; 16], "nothing before the target range");
}

#[test]
fn write_read_small_crc_on_and_off() {
    write_then_read(true, 100);
    write_then_read(false, 100);
}

#[test]
fn write_read_larger_than_one_fpdu() {
    write_then_read(true, 1 << 20);
    write_then_read(false, 1 << 20);
    write_then_read(false, 5000);
}

#[test]
fn send_recv_with_se_and_imm() {
    for crc in [true, false] {
        let p = Pair::new(crc);
        let (tmem, tmr) = p.target_buf(8192, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
        p.tqp
            .post_recv(RecvWr {
                wr_id: 10,
                local: Some(Sge::new(&tmr, 0, 8192)),
            })
            .unwrap();
        p.tqp
            .post_recv(RecvWr {
                wr_id: 11,
                local: Some(Sge::new(&tmr, 0, 8192)),
            })
            .unwrap();
        p.tqp
            .post_recv(RecvWr {
                wr_id: 12,
                local: None,
            })
            .unwrap();
        let (imem, imr) = p.init_buf(8192, Access::LOCAL_WRITE);
        let data: Vec<u8> = (0..5000).map(|i| (i % 251) as u8).collect();
        imem.write_at(0, &data).unwrap();
        p.qp.post_send(SendWr::new(
            1,
            SendOp::Send {
                local: Sge::new(&imr, 0, 5000),
            },
        ))
        .unwrap();
        p.qp.post_send(
            SendWr::new(
                2,
                SendOp::Send {
                    local: Sge::new(&imr, 0, 3),
                },
            )
            .with_flags(SendFlags::SIGNALED | SendFlags::SOLICITED),
        )
        .unwrap();
        p.qp.post_send(SendWr::new(
            3,
            SendOp::WriteWithImm {
                local: Sge::new(&imr, 0, 8),
                remote: tmr.remote(100),
                imm: 0xDEAD_BEEF,
            },
        ))
        .unwrap();
        for id in 1..=3 {
            let c = p.next_init();
            assert_eq!((c.wr_id, c.status), (id, WcStatus::Success));
        }
        let r = p.next_target();
        assert_eq!(
            (r.wr_id, r.status, r.opcode, r.byte_len, r.solicited),
            (10, WcStatus::Success, WcOpcode::Recv, 5000, false)
        );
        let r = p.next_target();
        assert_eq!((r.wr_id, r.byte_len, r.solicited), (11, 3, true));
        let r = p.next_target();
        assert_eq!(
            (r.wr_id, r.opcode, r.imm, r.solicited),
            (12, WcOpcode::RecvRdmaWithImm, Some(0xDEAD_BEEF), false)
        );
        // A solicited WriteWithImm: Immediate Data with SE (0x9).
        p.tqp
            .post_recv(RecvWr {
                wr_id: 13,
                local: None,
            })
            .unwrap();
        p.qp.post_send(
            SendWr::new(
                4,
                SendOp::WriteWithImm {
                    local: Sge::new(&imr, 0, 8),
                    remote: tmr.remote(200),
                    imm: 7,
                },
            )
            .with_flags(SendFlags::SIGNALED | SendFlags::SOLICITED),
        )
        .unwrap();
        let r = p.next_target();
        assert_eq!(
            (r.wr_id, r.opcode, r.imm, r.solicited),
            (13, WcOpcode::RecvRdmaWithImm, Some(7), true)
        );
        // Not on a Write.
        let err =
            p.qp.post_send(
                SendWr::new(
                    5,
                    SendOp::Write {
                        local: Sge::new(&imr, 0, 8),
                        remote: tmr.remote(200),
                    },
                )
                .with_flags(SendFlags::SOLICITED),
            )
            .unwrap_err();
        assert!(matches!(err, Error::InvalidWorkRequest { .. }), "{err}");
        let mut b = [0u8; 3];
        tmem.read_at(0, &mut b).unwrap();
        assert_eq!(b, [0, 1, 2]);
        tmem.read_at(100, &mut b).unwrap();
        assert_eq!(b, [0, 1, 2]);
    }
}

#[test]
fn atomics_run_on_target_memory() {
    let p = Pair::new(true);
    let (tmem, tmr) = p.target_buf(
        4096,
        Access::LOCAL_WRITE | Access::REMOTE_ATOMIC | Access::REMOTE_WRITE,
    );
    tmem.write_at(8, &100u64.to_ne_bytes()).unwrap();
    let (imem, imr) = p.init_buf(64, Access::LOCAL_WRITE);
    p.qp.post_send(SendWr::new(
        1,
        SendOp::FetchAdd {
            local: Sge::new(&imr, 0, 8),
            remote: tmr.remote(8),
            add: 5,
        },
    ))
    .unwrap();
    assert_eq!(p.next_init().status, WcStatus::Success);
    assert_eq!(imem.read_u64(0).unwrap(), 100);
    assert_eq!(tmem.read_u64(8).unwrap(), 105);
    let cs = |id, compare, swap| {
        SendWr::new(
            id,
            SendOp::CompareSwap {
                local: Sge::new(&imr, 8, 8),
                remote: tmr.remote(8),
                compare,
                swap,
            },
        )
    };
    p.qp.post_send(cs(2, 1, 7)).unwrap();
    let c = p.next_init();
    assert_eq!(
        (c.status, c.opcode),
        (WcStatus::Success, WcOpcode::CompSwap)
    );
    assert_eq!(imem.read_u64(8).unwrap(), 105);
    assert_eq!(tmem.read_u64(8).unwrap(), 105, "no swap on mismatch");
    p.qp.post_send(cs(3, 105, 7)).unwrap();
    p.next_init();
    assert_eq!(tmem.read_u64(8).unwrap(), 7);
    p.qp.post_send(SendWr::new(
        4,
        SendOp::AtomicWrite {
            remote: tmr.remote(16),
            value: 0x0102_0304_0506_0708,
        },
    ))
    .unwrap();
    let c = p.next_init();
    assert_eq!(
        (c.wr_id, c.status, c.opcode),
        (4, WcStatus::Success, WcOpcode::AtomicWrite)
    );
    assert_eq!(tmem.read_u64(16).unwrap(), 0x0102_0304_0506_0708);
}

#[test]
fn many_in_flight_complete_in_order() {
    let p = Pair::new(false);
    let (_tmem, tmr) = p.target_buf(
        1 << 16,
        Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
    );
    let (imem, imr) = p.init_buf(1 << 17, Access::LOCAL_WRITE);
    for i in 0..64u64 {
        imem.write_at(i as usize * 1024, &[i as u8; 1024]).unwrap();
    }
    for i in 0..64u64 {
        let off = i as usize * 1024;
        p.qp.post_send(SendWr::new(
            i,
            SendOp::Write {
                local: Sge::new(&imr, off, 1024),
                remote: tmr.remote(off as u64),
            },
        ))
        .unwrap();
        p.qp.post_send(SendWr::new(
            1000 + i,
            SendOp::Read {
                local: Sge::new(&imr, 65536 + off, 1024),
                remote: tmr.remote(off as u64),
            },
        ))
        .unwrap();
    }
    for i in 0..64u64 {
        let c = p.next_init();
        assert_eq!((c.wr_id, c.status), (i, WcStatus::Success));
        let c = p.next_init();
        assert_eq!((c.wr_id, c.status), (1000 + i, WcStatus::Success));
    }
    let mut b = vec![0u8; 65536];
    imem.read_at(65536, &mut b).unwrap();
    for i in 0..64 {
        assert!(
            b[i * 1024..(i + 1) * 1024].iter().all(|&x| x == i as u8),
            "block {i}"
        );
    }
}

#[test]
fn flush_both_kinds_and_unsignaled_writes() {
    let p = Pair::new(true);
    let m = Arc::new(rpma_common::pmem::Mapping::anonymous(1 << 16).unwrap());
    let tmr =
        p.pd.register(
            Arc::clone(&m),
            Access::LOCAL_WRITE
                | Access::REMOTE_WRITE
                | Access::FLUSH_PERSISTENT
                | Access::FLUSH_VISIBILITY,
        )
        .unwrap();
    let (imem, imr) = p.init_buf(64, Access::LOCAL_WRITE);
    imem.write_at(0, b"flushed!").unwrap();
    p.qp.post_send(
        SendWr::new(
            1,
            SendOp::Write {
                local: Sge::new(&imr, 0, 8),
                remote: tmr.remote(0),
            },
        )
        .with_flags(SendFlags::empty()),
    )
    .unwrap();
    p.qp.post_send(SendWr::new(
        2,
        SendOp::Flush {
            target: FlushTarget::Range {
                remote: tmr.remote(0),
                len: 8,
            },
            kind: FlushType::Persistent,
        },
    ))
    .unwrap();
    p.qp.post_send(SendWr::new(
        3,
        SendOp::Flush {
            target: FlushTarget::Region { rkey: tmr.rkey() },
            kind: FlushType::Visibility,
        },
    ))
    .unwrap();
    let c = p.next_init();
    assert_eq!(
        (c.wr_id, c.status, c.opcode),
        (2, WcStatus::Success, WcOpcode::Flush),
        "unsignaled Write gives none"
    );
    assert_eq!(p.next_init().wr_id, 3);
    let mut b = [0u8; 8];
    // SAFETY: the mapping is live and 8 bytes long at least; the target wrote it before the
    // flush was answered.
    unsafe { std::ptr::copy_nonoverlapping(m.as_ptr(), b.as_mut_ptr(), 8) };
    assert_eq!(&b, b"flushed!");
}

#[test]
fn fenced_and_ord_limited_requests_all_complete_in_order() {
    // ORD 1: every Read waits for the one before; FENCE holds Writes behind them.
    let ip = ConnParams {
        ord: 1,
        ..params(true)
    };
    let p = Pair::with(ip, params(true), |_| {});
    assert_eq!(p.qp.info().ord, 1);
    let (tmem, tmr) = p.target_buf(
        4096,
        Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
    );
    tmem.write_at(0, &[7u8; 64]).unwrap();
    let (imem, imr) = p.init_buf(4096, Access::LOCAL_WRITE);
    for i in 0..8u64 {
        let off = i as usize * 8;
        p.qp.post_send(SendWr::new(
            i,
            SendOp::Read {
                local: Sge::new(&imr, off, 8),
                remote: tmr.remote(off as u64),
            },
        ))
        .unwrap();
        p.qp.post_send(
            SendWr::new(
                100 + i,
                SendOp::Write {
                    local: Sge::new(&imr, 2048, 8),
                    remote: tmr.remote(off as u64),
                },
            )
            .with_flags(SendFlags::SIGNALED | SendFlags::FENCE),
        )
        .unwrap();
    }
    for i in 0..8u64 {
        assert_eq!((p.next_init().wr_id, p.next_init().wr_id), (i, 100 + i));
    }
    let mut b = [0u8; 64];
    imem.read_at(0, &mut b).unwrap();
    assert_eq!(
        b, [7u8; 64],
        "each Read saw the value before its fenced Write"
    );
    tmem.read_at(0, &mut b).unwrap();
    assert_eq!(b, [0u8; 64], "and every fenced Write landed after");
}

#[test]
fn writes_from_stably_registered_memory_carry_good_crcs() {
    // The sender computes the CRC over such memory itself (no copy): a wrong one would have
    // the target terminate the connection and the Write fail.
    for ulpdu in [1454, 65535] {
        let ip = ConnParams {
            tcp: TcpParams {
                max_ulpdu: ulpdu,
                ..TcpParams::default()
            },
            ..params(true)
        };
        let p = Pair::with(ip, params(true), |_| {});
        let len = 200_000;
        let (tmem, tmr) = p.target_buf(len + 4096, rw());
        let imem = AlignedBuf::new(len + 4096).unwrap();
        let data: Vec<u8> = (0..len).map(|i| (i * 7 + i / 251) as u8).collect();
        imem.write_at(13, &data).unwrap();
        // SAFETY: nothing writes the source bytes while the Write is in flight (this thread
        // waits for its completion before touching them again).
        let imr = unsafe { p.pd.register_stable(Arc::clone(&imem), Access::LOCAL_WRITE) }.unwrap();
        p.qp.post_send(SendWr::new(
            1,
            SendOp::Write {
                local: Sge::new(&imr, 13, len),
                remote: tmr.remote(100),
            },
        ))
        .unwrap();
        let (_, c) = p.until_init(1);
        assert_eq!(c.status, WcStatus::Success, "ulpdu {ulpdu}: {c:?}");
        // A Read behind it: answered only if the connection survived the Write's FPDUs.
        p.qp.post_send(SendWr::new(
            2,
            SendOp::Read {
                local: Sge::new(&imr, 0, 8),
                remote: tmr.remote(0),
            },
        ))
        .unwrap();
        assert_eq!(p.until_init(2).1.status, WcStatus::Success, "ulpdu {ulpdu}");
        let mut got = vec![0u8; len];
        tmem.read_at(100, &mut got).unwrap();
        assert!(got == data, "ulpdu {ulpdu}: the bytes landed");
        assert_eq!(p.qp.state(), QpState::Rts);
    }
}

#[test]
fn messages_above_max_message_are_refused() {
    let ip = ConnParams {
        max_message: 4096,
        ..params(false)
    };
    let p = Pair::with(ip, params(false), |_| {});
    let (_tmem, tmr) = p.target_buf(
        8192,
        Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
    );
    let (_imem, imr) = p.init_buf(8192, Access::LOCAL_WRITE);
    for op in [
        SendOp::Write {
            local: Sge::new(&imr, 0, 4097),
            remote: tmr.remote(0),
        },
        SendOp::Read {
            local: Sge::new(&imr, 0, 4097),
            remote: tmr.remote(0),
        },
        SendOp::Send {
            local: Sge::new(&imr, 0, 4097),
        },
    ] {
        assert!(matches!(
            p.qp.post_send(SendWr::new(1, op)),
            Err(Error::InvalidWorkRequest { .. })
        ));
    }
    p.qp.post_send(SendWr::new(
        2,
        SendOp::Write {
            local: Sge::new(&imr, 0, 4096),
            remote: tmr.remote(0),
        },
    ))
    .unwrap();
    assert_eq!(p.next_init().status, WcStatus::Success);
}

#[test]
fn a_target_refuses_reads_above_its_max_message() {
    let tp = ConnParams {
        max_message: 1024,
        ..params(true)
    };
    let p = Pair::with(params(true), tp, |_| {});
    let (_tmem, tmr) = p.target_buf(8192, Access::LOCAL_WRITE | Access::REMOTE_READ);
    let (_imem, imr) = p.init_buf(8192, Access::LOCAL_WRITE);
    p.qp.post_send(SendWr::new(
        1,
        SendOp::Read {
            local: Sge::new(&imr, 0, 2048),
            remote: tmr.remote(0),
        },
    ))
    .unwrap();
    let c = p.next_init();
    assert_eq!((c.wr_id, c.status), (1, WcStatus::RemoteOperation));
}

#[test]
fn receives_posted_before_accept_catch_the_first_send() {
    // A device and domain to work in (the pair itself is not used).
    let p = Pair::new(true);
    // A prepared QP takes receives before it is connected.
    let (tmem, tmr) = p.target_buf(64, Access::LOCAL_WRITE);
    let cq = p.ctx.create_cq(8).unwrap();
    let prepared = p.pd.create_qp(&cq, &cq, QpCaps::default()).unwrap();
    prepared
        .post_recv(RecvWr {
            wr_id: 77,
            local: Some(Sge::new(&tmr, 0, 64)),
        })
        .unwrap();
    let listener = Listener::bind(&p.ctx, &"tcp://127.0.0.1:0".parse().unwrap()).unwrap();
    let url = listener.url().unwrap();
    let t = std::thread::spawn(move || {
        let req = listener.accept(&ConnParams::default()).unwrap();
        req.accept(prepared, &ConnParams::default(), b"").unwrap()
    });
    let icq = p.ctx.create_cq(8).unwrap();
    let qp =
        p.pd.create_qp(&icq, &icq, QpCaps::default())
            .unwrap()
            .connect(&url, &ConnParams::default(), b"")
            .unwrap();
    let (imem, imr) = p.init_buf(64, Access::LOCAL_WRITE);
    imem.write_at(0, b"first").unwrap();
    // Sent at once, possibly before the target thread has returned from accept.
    qp.post_send(SendWr::new(
        1,
        SendOp::Send {
            local: Sge::new(&imr, 0, 5),
        },
    ))
    .unwrap();
    let tqp = t.join().unwrap();
    let mut wc = [Completion::EMPTY; 2];
    assert_eq!(
        cq.wait(&mut wc, Some(std::time::Duration::from_secs(10)))
            .unwrap(),
        1
    );
    assert_eq!(
        (wc[0].wr_id, wc[0].status, wc[0].byte_len, wc[0].qp_num),
        (77, WcStatus::Success, 5, tqp.qp_num())
    );
    let mut b = [0u8; 5];
    tmem.read_at(0, &mut b).unwrap();
    assert_eq!(&b, b"first");
}

/// Writes into a `dax (forced)` mapping (the engine copies them in with non-temporal stores and
/// fences before the Read answers), at odd offsets and lengths, CRC on and off: every byte is
/// where it belongs and nothing around it moved.
#[test]
fn writes_into_dax_memory_land_exactly() {
    use rpma_common::pmem::OpenOptions;
    for crc in [true, false] {
        let p = Pair::new(crc);
        let file = tempfile::NamedTempFile::new_in("/dev/shm").unwrap();
        let m = OpenOptions::new(file.path())
            .size(1 << 20)
            .force_dax(true)
            .open()
            .unwrap();
        assert!(m.domain().is_dax());
        let access = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
        let tmr = p.pd.register(Arc::new(m), access).unwrap();
        let (imem, imr) = p.init_buf(1 << 20, Access::LOCAL_WRITE);
        let mut expect = vec![0u8; 1 << 20];
        let cases = [
            (0usize, 4096usize),
            (5, 1),
            (17, 100),
            (4099, 70001),
            (200_003, 300_000),
        ];
        for (i, &(off, len)) in cases.iter().enumerate() {
            let data: Vec<u8> = (0..len).map(|j| (j * 7 + i * 3 + 1) as u8).collect();
            imem.write_at(0, &data).unwrap();
            expect[off..off + len].copy_from_slice(&data);
            p.qp.post_send(SendWr::new(
                i as u64,
                SendOp::Write {
                    local: Sge::new(&imr, 0, len),
                    remote: tmr.remote(off as u64),
                },
            ))
            .unwrap();
            assert_eq!(p.next_init().status, WcStatus::Success);
        }
        // The Read answers after everything before it is placed and fenced; read it all back.
        let all = 1 << 20;
        let (back, bmr) = p.init_buf(all, Access::LOCAL_WRITE);
        p.qp.post_send(SendWr::new(
            99,
            SendOp::Read {
                local: Sge::new(&bmr, 0, all),
                remote: tmr.remote(0),
            },
        ))
        .unwrap();
        let c = p.next_init();
        assert_eq!((c.wr_id, c.status), (99, WcStatus::Success));
        let mut got = vec![0u8; all];
        back.read_at(0, &mut got).unwrap();
        assert!(got == expect, "crc {crc}");
    }
}
