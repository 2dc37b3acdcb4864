//! `QueuePair::post_send_list`: several requests, one doorbell, all or nothing.

mod fabric_util;

use std::time::Duration;

use fabric_util::{rw, Pair};
use rpma_common::fabric::*;

#[test]
fn a_write_and_a_read_posted_as_a_list_complete_in_order() {
    for crc in [true, false] {
        let p = Pair::new(crc);
        let (tmem, tmr) = p.target_buf(8192, rw());
        let (imem, imr) = p.init_buf(8192, Access::LOCAL_WRITE);
        let data: Vec<u8> = (0..4096).map(|i| (i % 253) as u8).collect();
        imem.write_at(0, &data).unwrap();
        p.qp.post_send_list([
            SendWr::new(
                1,
                SendOp::Write {
                    local: Sge::new(&imr, 0, 4096),
                    remote: tmr.remote(0),
                },
            ),
            SendWr::new(
                2,
                SendOp::Read {
                    local: Sge::new(&imr, 4096, 8),
                    remote: tmr.remote(4088),
                },
            ),
        ])
        .unwrap();
        let (a, b) = (p.next_init(), p.next_init());
        assert_eq!(
            (a.wr_id, a.status, a.opcode),
            (1, WcStatus::Success, WcOpcode::RdmaWrite)
        );
        assert_eq!(
            (b.wr_id, b.status, b.opcode),
            (2, WcStatus::Success, WcOpcode::RdmaRead)
        );
        let mut got = vec![0u8; 4096];
        tmem.read_at(0, &mut got).unwrap();
        assert_eq!(got, data);
        let mut back = [0u8; 8];
        imem.read_at(4096, &mut back).unwrap();
        assert_eq!(back, data[4088..]);
    }
}

#[test]
fn a_refused_request_in_a_list_posts_none_of_it() {
    let p = Pair::new(true);
    let (tmem, tmr) = p.target_buf(4096, rw());
    let (imem, imr) = p.init_buf(4096, Access::LOCAL_WRITE);
    imem.write_at(0, &[9u8; 64]).unwrap();
    let write = SendWr::new(
        1,
        SendOp::Write {
            local: Sge::new(&imr, 0, 64),
            remote: tmr.remote(0),
        },
    );
    let bad = SendWr::new(
        2,
        SendOp::Read {
            local: Sge::new(&imr, 4090, 8), // past the end of the local region
            remote: tmr.remote(0),
        },
    );
    let err = p.qp.post_send_list([write.clone(), bad]).unwrap_err();
    assert!(matches!(err, Error::LocalBounds { .. }), "{err}");
    let (i, t) = p.settle(Duration::from_millis(100));
    assert!(i.is_empty() && t.is_empty(), "{i:?} {t:?}");
    let mut got = [0u8; 64];
    tmem.read_at(0, &mut got).unwrap();
    assert_eq!(
        got, [0u8; 64],
        "the Write before the refused request was not sent"
    );
    assert_eq!(p.qp.state(), QpState::Rts);

    // No room for all of them: none posted either.
    let caps = QpCaps::default().max_send_wr;
    let err =
        p.qp.post_send_list(std::iter::repeat_n(write.clone(), caps + 1))
            .unwrap_err();
    assert!(
        matches!(err, Error::QueueFull { queue: "send", .. }),
        "{err}"
    );
    let (i, _) = p.settle(Duration::from_millis(100));
    assert!(i.is_empty(), "{i:?}");
    // An empty list is fine and does nothing.
    p.qp.post_send_list([]).unwrap();
    // After the refusals the queue pair still works.
    p.qp.post_send_list([write]).unwrap();
    assert_eq!(p.next_init().status, WcStatus::Success);
}

#[test]
fn post_send_list_needs_rts() {
    let p = Pair::new(true);
    let (_tmem, tmr) = p.target_buf(4096, rw());
    let (_imem, imr) = p.init_buf(4096, Access::LOCAL_WRITE);
    p.qp.to_error();
    let err =
        p.qp.post_send_list([SendWr::new(
            1,
            SendOp::Write {
                local: Sge::new(&imr, 0, 8),
                remote: tmr.remote(0),
            },
        )])
        .unwrap_err();
    assert!(matches!(err, Error::InvalidState { .. }), "{err}");
}
