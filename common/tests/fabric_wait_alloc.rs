//! A completion queue's idle wait allocates nothing, its first one on a connection included:
//! arming a queue pair's socket with the queue's poller, blocking, and waking on the peer's
//! message. Before, the first block of each connection grew the list of pollers its socket was
//! registered with, and a durable write that happened to block there was the one allocation
//! rpma-tests' data_path_allocations found in a thousand rounds on a loaded machine.

mod counting_alloc;
mod fabric_util;

use std::time::Duration;

use counting_alloc::allocations;
use fabric_util::Pair;
use rpma_common::fabric::*;

#[test]
fn a_first_idle_wait_and_its_wake_up_allocate_nothing() {
    let p = Pair::new(true);
    let (_imem, imr) = p.init_buf(4096, Access::LOCAL_WRITE);
    let (tmem, tmr) = p.target_buf(4096, Access::LOCAL_WRITE);
    tmem.write_at(0, b"wake").unwrap();
    let mut wc = [Completion::EMPTY; 4];
    p.qp.post_recv(RecvWr {
        wr_id: 7,
        local: Some(Sge::new(&imr, 0, 64)),
    })
    .unwrap();

    // Nothing comes: no spell, so the wait arms the socket, blocks and times out.
    let blocked = p.icq.blocked_waits();
    let (made, woken) = allocations(|| {
        p.icq
            .wait_any_with_spin(&mut wc, Some(Duration::from_millis(20)), Duration::ZERO)
            .unwrap()
    });
    assert_eq!(woken, Woken::TimedOut);
    assert!(p.icq.blocked_waits() > blocked, "the wait never blocked");
    assert_eq!(made, 0, "the first idle wait allocated {made} times");

    // The target's Send wakes a blocked wait (another thread posts it once this one blocks).
    let blocked = p.icq.blocked_waits();
    let (made, woken) = std::thread::scope(|s| {
        s.spawn(|| {
            while p.icq.blocked_waits() == blocked {
                std::thread::yield_now();
            }
            p.tqp
                .post_send(SendWr::new(
                    9,
                    SendOp::Send {
                        local: Sge::new(&tmr, 0, 4),
                    },
                ))
                .unwrap();
        });
        allocations(|| {
            p.icq
                .wait_any_with_spin(&mut wc, Some(Duration::from_secs(10)), Duration::ZERO)
                .unwrap()
        })
    });
    let Woken::Completions(n) = woken else {
        panic!("woken by {woken:?}, not the Send");
    };
    let got = &wc[..n];
    assert!(
        matches!(got, [c] if c.wr_id == 7 && c.byte_len == 4),
        "{got:?}"
    );
    assert!(p.icq.blocked_waits() > blocked);
    assert_eq!(made, 0, "a wait woken by the peer allocated {made} times");
}
