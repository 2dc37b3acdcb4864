//! SIGTERM under load: in-flight flushes are answered before the goodbye, exit 0.
//! The real `rpma-target` process and the rpma-initiator library in-process (the fixture of
//! [`rpma_tests::sessions`]); every wait has a deadline.

use std::path::Path;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use rpma_common::fabric::Completion;
use rpma_common::proto::{FlushStatus, Message};
use rpma_initiator::{Error, Session, CONTROL_BIT};
use rpma_tests::sessions::*;
use rpma_tests::{scratch, Target};

#[test]
fn sigterm_during_flush_load_exits_zero() {
    let d = scratch();
    let (mut t, mut s) = sigterm_with_flushes_in_flight(d.path());
    let sent = FLUSHES_IN_FLIGHT;
    // Every completion the host's queue holds is read, as verbs would: the responses the target
    // sent before its Disconnect are valid even once the connection is closed behind them.
    // (`sigterm_answers_reach_wait_message` checks the same through Session::wait_message.)
    let mut answered = Vec::new();
    let mut disconnect = None;
    let deadline = Instant::now() + WAIT;
    let mut wcs = [Completion::EMPTY; 16];
    loop {
        assert!(
            Instant::now() < deadline,
            "no Disconnect within {WAIT:?}: answered {answered:?}"
        );
        let n = s
            .cq()
            .wait(&mut wcs, Some(Duration::from_millis(50)))
            .unwrap();
        for c in &wcs[..n] {
            assert_ne!(c.wr_id & CONTROL_BIT, 0, "{c:?}");
            match s.handle(c) {
                Ok(Some(Message::FlushResponse(r))) => {
                    // A request that crossed the target's goodbye is answered Unavailable,
                    // after it (never dropped); nothing after it claims durable.
                    assert!(
                        disconnect.is_none() || r.status == FlushStatus::Unavailable,
                        "a durable response after the Disconnect: {r:?}"
                    );
                    assert!(
                        matches!(r.status, FlushStatus::Durable | FlushStatus::Unavailable),
                        "{r:?}"
                    );
                    answered.push(r.token);
                }
                Ok(None) => {}
                Ok(Some(other)) => panic!("{other:?}"),
                Err(Error::Disconnected { reason }) if disconnect.is_none() => {
                    disconnect = Some(reason)
                }
                // Receives flushed after the end: not messages.
                Err(Error::Disconnected { .. }) => {}
                Err(e) => panic!("{e:?}: answered {answered:?}"),
            }
        }
        if n == 0 && disconnect.is_some() {
            break;
        }
    }
    let reason = disconnect.unwrap();
    assert!(reason.contains("shutting down"), "{reason}");
    eprintln!(
        "{} of {sent} flushes answered before the target went away",
        answered.len()
    );
    assert_answered_a_prefix(answered);
    let st = t.wait_exit(WAIT);
    assert!(st.success(), "{st:?}");
}

const FLUSHES_IN_FLIGHT: u64 = 48;

/// Starts a target, keeps many GPSPM flushes in flight on a session, then stops the daemon.
fn sigterm_with_flushes_in_flight(dir: &Path) -> (Target, Session) {
    let t = start(dir, "");
    let mut s = session(&t);
    send_flushes(&mut s, FLUSHES_IN_FLIGHT, 0);
    t.signal(Signal::SIGTERM);
    (t, s)
}

/// Flushes complete in any order (io_uring), and receives in arrival order: what the target had
/// received before it stopped is a prefix of what was sent, each token answered once (Durable,
/// or Unavailable after the goodbye).
fn assert_answered_a_prefix(mut answered: Vec<u64>) {
    answered.sort_unstable();
    let n = answered.len();
    answered.dedup();
    assert_eq!(answered.len(), n, "a flush was answered twice");
    assert!(answered.iter().all(|t| (1..=FLUSHES_IN_FLIGHT).contains(t)));
    assert_eq!(answered, (1..=answered.len() as u64).collect::<Vec<_>>());
}

/// The library's own wait returns every response the target sent before its goodbye, and only
/// then the Disconnect: nothing received is dropped because the connection closed behind it.
#[test]
fn sigterm_answers_reach_wait_message() {
    let d = scratch();
    let (mut t, mut s) = sigterm_with_flushes_in_flight(d.path());
    let mut answered = Vec::new();
    let end = loop {
        match s.wait_message(WAIT, "flush responses") {
            Ok(Message::FlushResponse(r)) => answered.push(r.token),
            Ok(other) => panic!("{other:?}"),
            Err(e) => break e,
        }
    };
    assert!(
        matches!(end, Error::Disconnected { ref reason } if reason.contains("shutting down")),
        "{end:?}: answered {answered:?}"
    );
    assert!(!answered.is_empty());
    assert_answered_a_prefix(answered);
    assert!(t.wait_exit(WAIT).success());
}

rpma_tests::rdma_runs!(
    sigterm_during_flush_load_exits_zero,
    sigterm_answers_reach_wait_message,
);
