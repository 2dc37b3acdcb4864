//! Remote keys: per connection (useless on any other queue pair), revoked when a keep-alive
//! lapses.
//! The real `rpma-target` process and the rpma-initiator library in-process (the fixture of
//! [`rpma_tests::sessions`]); every wait has a deadline.

use std::time::{Duration, Instant};

use rpma_common::fabric::{RemoteAddr, WcStatus};
use rpma_initiator::{connect, ConnectOptions, Error};
use rpma_tests::sessions::*;
use rpma_tests::{host, nqn, opts, scratch};

#[test]
fn rkeys_are_per_connection() {
    let d = scratch();
    let t = start(d.path(), "");
    let a = session(&t);
    let mut b = session(&t);
    let (na, nb) = (
        a.namespace(1).unwrap().clone(),
        b.namespace(1).unwrap().clone(),
    );
    assert_ne!(na.rkey, nb.rkey);
    // A's rkey on B's connection is refused.
    let stolen = RemoteAddr {
        addr: na.remote_addr,
        rkey: na.rkey,
    };
    assert_write_refused(&mut b, stolen, &d.path().join("ns1"));
    // B's connection broke on the RemoteAccess, A disconnects: both sessions' regions are
    // deregistered (the namespace's holder count drops to 0) and they leave the list.
    a.disconnect(WAIT).unwrap();
    let deadline = Instant::now() + WAIT;
    loop {
        let v = t.status();
        let holders = &v["subsystems"][1]["namespaces"][0]["counters"]["sessions"];
        if holders == 0 && v["sessions"].as_array().unwrap().is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "rkeys not released: {v}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn keep_alive_lapse_revokes_rkeys() {
    let d = scratch();
    let t = start(d.path(), "");
    // A period long enough that a loaded machine (or an emulated guest) keeps it while the
    // host ticks every 20 ms; short enough for the test.
    let o = ConnectOptions {
        keep_alive: Duration::from_millis(2000),
        ..opts()
    };
    let mut s = connect(&t.url(), &nqn(SUB), &host(PLAIN), &o).unwrap();
    assert_eq!(s.keep_alive(), Duration::from_millis(2000));
    let n1 = s.namespace(1).unwrap().clone();
    let remote = RemoteAddr {
        addr: n1.remote_addr,
        rkey: n1.rkey,
    };
    // Ticking keeps the session alive well past its period.
    let until = Instant::now() + Duration::from_millis(5000);
    while Instant::now() < until {
        s.tick().unwrap();
        let _ = s.wait_message(Duration::from_millis(20), "nothing");
    }
    assert_eq!(
        write_then_read(&mut s, remote, b"alive"),
        [WcStatus::Success, WcStatus::Success]
    );
    // Stop ticking: the target revokes the rkeys and says why.
    match s.wait_message(Duration::from_secs(30), "Disconnect") {
        Err(Error::Disconnected { reason }) => assert!(reason.contains("keep-alive"), "{reason}"),
        other => panic!("{other:?}"),
    }
    // tcp: the connection lingers and the stale rkey gets RemoteAccess; rdma: the target has
    // torn the connection down, so both requests are flushed. Either way nothing is placed.
    let st = write_then_read(&mut s, remote, b"stale rkey");
    match rpma_tests::Transport::current() {
        rpma_tests::Transport::Tcp => {
            assert_eq!(st.last(), Some(&WcStatus::RemoteAccess), "{st:?}")
        }
        rpma_tests::Transport::Rdma { .. } => {
            assert!(!st.contains(&WcStatus::Success), "{st:?}")
        }
    }
    let file = std::fs::read(d.path().join("ns1")).unwrap();
    assert_eq!(&file[..5], b"alive", "the stale Write placed nothing");
    assert!(file[5..10].iter().all(|&b| b == 0));
}

rpma_tests::rdma_runs!(rkeys_are_per_connection, keep_alive_lapse_revokes_rkeys,);
