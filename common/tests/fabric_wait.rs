//! The completion queue's idle wait: it also wakes on caller-supplied fds (`watch_fd`), and it
//! never blocks while a queue pair holds input its last pass left buffered.

mod fabric_util;

use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fabric_util::{post_read, post_write, rw, Pair};
use nix::sys::eventfd::EventFd;
use rpma_common::fabric::*;

const LONG: Option<Duration> = Some(Duration::from_secs(10));

/// A Receive (`wr_id`) posted on the initiator and a Send of `msg` from the target to it
/// (it leaves at once: posting writes what the socket takes). The buffers, to keep.
fn send_to_initiator(p: &Pair, wr_id: u64, msg: &[u8]) -> [Arc<MemoryRegion>; 2] {
    let (_imem, imr) = p.init_buf(4096, Access::LOCAL_WRITE);
    p.qp.post_recv(RecvWr {
        wr_id,
        local: Some(Sge::new(&imr, 0, 64)),
    })
    .unwrap();
    let (tmem, tmr) = p.target_buf(4096, Access::LOCAL_WRITE);
    tmem.write_at(0, msg).unwrap();
    p.tqp
        .post_send(SendWr::new(
            9,
            SendOp::Send {
                local: Sge::new(&tmr, 0, msg.len()),
            },
        ))
        .unwrap();
    [imr, tmr]
}

/// Writes `efd` from another thread after `delay`; the flag is set just before the write.
fn write_later(
    efd: &Arc<EventFd>,
    delay: Duration,
) -> (std::thread::JoinHandle<()>, Arc<AtomicBool>) {
    let written = Arc::new(AtomicBool::new(false));
    let (e2, w2) = (Arc::clone(efd), Arc::clone(&written));
    let t = std::thread::spawn(move || {
        std::thread::sleep(delay);
        w2.store(true, Ordering::SeqCst);
        e2.write(1).unwrap();
    });
    (t, written)
}

#[test]
fn an_idle_wait_wakes_on_a_watched_eventfd_written_by_another_thread() {
    let p = Pair::new(true);
    let efd = Arc::new(EventFd::new().unwrap());
    p.icq.watch_fd(efd.as_fd(), 42).unwrap();
    let (t, written) = write_later(&efd, Duration::from_millis(50));
    let mut wc = [Completion::EMPTY; 4];
    let woke = p.icq.wait_any(&mut wc, LONG).unwrap();
    assert_eq!(woke, Woken::Fd(42));
    assert!(
        written.load(Ordering::SeqCst),
        "woke before the eventfd was written"
    );
    t.join().unwrap();
    // Level-triggered: it stays ready until the caller drains it.
    assert_eq!(p.icq.wait_any(&mut wc, LONG).unwrap(), Woken::Fd(42));
    assert_eq!(efd.read().unwrap(), 1);
    let short = Some(Duration::from_millis(20));
    assert_eq!(p.icq.wait_any(&mut wc, short).unwrap(), Woken::TimedOut);
    // Plain `wait` returns 0 for a readable watched fd.
    efd.write(1).unwrap();
    assert_eq!(p.icq.wait(&mut wc, LONG).unwrap(), 0);
    efd.read().unwrap();
    // Unwatched, it no longer wakes the queue.
    p.icq.unwatch_fd(efd.as_fd()).unwrap();
    efd.write(1).unwrap();
    assert_eq!(p.icq.wait_any(&mut wc, short).unwrap(), Woken::TimedOut);
}

#[test]
fn a_watched_fd_ends_the_busy_poll_spell_without_waiting_it_out() {
    // A spell longer than the time-out: a wait that looked at its watched fds only once the
    // spell was over (in the blocking wait) would time out here instead (what a GPSPM flush
    // on page-cache paid: its fdatasync's completion waited for the target's spell to end).
    let p = Pair::new(true);
    let efd = EventFd::new().unwrap();
    p.icq.watch_fd(efd.as_fd(), 11).unwrap();
    efd.write(1).unwrap();
    let mut wc = [Completion::EMPTY; 4];
    let mut wait = |timeout| {
        p.icq
            .wait_any_with_spin(&mut wc, Some(timeout), Duration::from_secs(3600))
            .unwrap()
    };
    assert_eq!(wait(Duration::from_secs(2)), Woken::Fd(11));
    // Drained, the same spell runs to the time-out.
    efd.read().unwrap();
    let woke = wait(Duration::from_millis(20));
    assert_eq!(woke, Woken::TimedOut);
}

#[test]
fn a_watched_fd_written_during_the_spell_ends_it() {
    // The spell looks at its watched fds on its first turn and every few after it (not every
    // turn): an fd that becomes readable once the spell is going is still seen in it, not
    // after the hour-long spell (or the time-out) is over.
    let p = Pair::new(false);
    let efd = Arc::new(EventFd::new().unwrap());
    p.icq.watch_fd(efd.as_fd(), 12).unwrap();
    let (t, written) = write_later(&efd, Duration::from_millis(20));
    let mut wc = [Completion::EMPTY; 4];
    let woke = p
        .icq
        .wait_any_with_spin(&mut wc, LONG, Duration::from_secs(3600))
        .unwrap();
    assert_eq!(woke, Woken::Fd(12));
    assert!(written.load(Ordering::SeqCst), "woke before the write");
    t.join().unwrap();
}

#[test]
fn wait_any_or_watches_its_fd_for_the_call_only() {
    let p = Pair::new(false);
    let efd = EventFd::new().unwrap();
    let mut wc = [Completion::EMPTY; 4];
    let short = Some(Duration::from_millis(20));
    // Readable, no completion: woken by it.
    efd.write(1).unwrap();
    let woke = p.icq.wait_any_or(&mut wc, LONG, efd.as_fd(), 3).unwrap();
    assert_eq!(woke, Woken::Fd(3));
    // Not watched after the call: a plain wait is not woken by it.
    assert_eq!(p.icq.wait_any(&mut wc, short).unwrap(), Woken::TimedOut);
    // Drained: a completion ends the wait (whether it came before the first look or after).
    efd.read().unwrap();
    let _bufs = send_to_initiator(&p, 5, b"first");
    let woke = p.icq.wait_any_or(&mut wc, LONG, efd.as_fd(), 3).unwrap();
    assert_eq!(woke, Woken::Completions(1));
    assert_eq!(wc[0].wr_id, 5);
    // Quiet: the time-out.
    assert_eq!(
        p.icq.wait_any_or(&mut wc, short, efd.as_fd(), 3).unwrap(),
        Woken::TimedOut
    );
    // Left watched by no call: watching it now succeeds (a second watch is refused).
    p.icq.watch_fd(efd.as_fd(), 4).unwrap();
    assert!(matches!(
        p.icq.wait_any_or(&mut wc, short, efd.as_fd(), 3),
        Err(Error::Watch { .. })
    ));
    p.icq.unwatch_fd(efd.as_fd()).unwrap();
}

#[test]
fn completions_still_end_a_wait_on_a_queue_with_watched_fds() {
    let p = Pair::new(false);
    let efd = EventFd::new().unwrap();
    p.icq.watch_fd(efd.as_fd(), 7).unwrap();
    let _bufs = send_to_initiator(&p, 5, b"wake up");
    let mut wc = [Completion::EMPTY; 4];
    let woke = p.icq.wait_any(&mut wc, LONG).unwrap();
    assert_eq!(woke, Woken::Completions(1));
    assert_eq!(
        (wc[0].wr_id, wc[0].status, wc[0].byte_len),
        (5, WcStatus::Success, 7)
    );
}

#[test]
fn watch_fd_refuses_a_second_watch_an_unpollable_fd_and_unwatching_a_stranger() {
    let ctx = Context::soft();
    let cq = ctx.create_cq(4).unwrap();
    let efd = EventFd::new().unwrap();
    cq.watch_fd(efd.as_fd(), 1).unwrap();
    assert!(matches!(
        cq.watch_fd(efd.as_fd(), 2),
        Err(Error::Watch { op: "watch", .. })
    ));
    let other = EventFd::new().unwrap();
    assert!(matches!(
        cq.unwatch_fd(other.as_fd()),
        Err(Error::Watch { op: "unwatch", .. })
    ));
    // Regular files cannot be polled (EPERM from epoll).
    let f = tempfile::tempfile().unwrap();
    let err = cq.watch_fd(f.as_fd(), 3).unwrap_err();
    assert!(matches!(err, Error::Watch { op: "watch", .. }), "{err}");
    // Another queue may watch the same fd.
    let cq2 = ctx.create_cq(4).unwrap();
    cq2.watch_fd(efd.as_fd(), 1).unwrap();
}

#[test]
fn a_wait_with_read_requests_still_buffered_answers_them_before_it_blocks() {
    // The responder answers a burst of Read Requests by batches of eight, writing each batch
    // before it handles the next; what it has not handled stays in its receive buffer, where
    // epoll cannot see it. The target's wait has no spell here (it blocks as soon as a pass
    // finds no completion): if it blocked with Read Requests still buffered, the last ones
    // would be answered only when the initiator sent something else, which it never does.
    let p = Pair::new(true);
    const READS: usize = 16;
    const LEN: usize = 4096;
    let (tmem, tmr) = p.target_buf(READS * LEN, rw());
    for i in 0..READS {
        tmem.write_at(i * LEN, &[i as u8 + 1; LEN]).unwrap();
    }
    let (imem, imr) = p.init_buf(READS * LEN, Access::LOCAL_WRITE);
    let stop = Arc::new(EventFd::new().unwrap());
    p.tcq.watch_fd(stop.as_fd(), 1).unwrap();
    let tcq = p.tcq.clone();
    let target = std::thread::spawn(move || {
        // One wait, with no time-out: it serves the Reads and returns only for the stop fd.
        let mut wc = [Completion::EMPTY; 4];
        let woke = tcq.wait_any_with_spin(&mut wc, None, Duration::ZERO);
        assert_eq!(woke.unwrap(), Woken::Fd(1), "the target has no completions");
    });
    // One doorbell: the sixteen Read Requests leave in one writev and arrive together.
    p.post_reads(&imr, &tmr, READS, LEN);
    let mut done = Vec::new();
    let mut wc = [Completion::EMPTY; READS];
    while done.len() < READS {
        let n = p.icq.wait(&mut wc, LONG).unwrap();
        assert!(
            n > 0,
            "{} of {READS} Reads completed in 10 s: the target blocked with Read Requests \
             buffered",
            done.len()
        );
        done.extend(wc[..n].iter().map(|c| (c.wr_id, c.status)));
    }
    let want: Vec<_> = (0..READS as u64).map(|i| (i, WcStatus::Success)).collect();
    assert_eq!(done, want);
    for i in 0..READS {
        let mut b = vec![0u8; LEN];
        imem.read_at(i * LEN, &mut b).unwrap();
        assert!(
            b.iter().all(|&x| x == i as u8 + 1),
            "Read {i} brought other bytes"
        );
    }
    stop.write(1).unwrap();
    target.join().unwrap();
}

/// The target's side of `p` served in one wait with busy-poll spell `spell` and no time-out,
/// in a thread of its own, until the returned eventfd is written (it has no completions of its
/// own to end the wait).
fn serve_until_stopped(p: &Pair, spell: Duration) -> (std::thread::JoinHandle<()>, EventFd) {
    let stop = EventFd::new().unwrap();
    p.tcq.watch_fd(stop.as_fd(), 1).unwrap();
    let tcq = p.tcq.clone();
    let target = std::thread::spawn(move || {
        let mut wc = [Completion::EMPTY; 4];
        let woke = tcq.wait_any_with_spin(&mut wc, None, spell);
        assert_eq!(woke.unwrap(), Woken::Fd(1), "the target has no completions");
    });
    (target, stop)
}

#[test]
fn a_target_answering_requests_stays_awake_while_they_come() {
    // A target answering Reads (and Flushes) completes nothing itself. Its spell counts from
    // the last request it answered: counted from the wait's start, it ran out in the middle of
    // the client's stream and blocked, once per spell, and the next request paid the wake-up
    // (one request in four at depth 1 on AMD: docs/benchmarks.md, "A spell counted from the
    // last message"). Reads one after another for two spells and more; the target must never
    // block. A run in which the client itself stalled for a good part of a spell
    // (a loaded machine) proves nothing either way, and is done again.
    const SPELL: Duration = Duration::from_secs(1);
    for attempt in 1..=5 {
        let p = Pair::new(true);
        let (tmem, tmr) = p.target_buf(4096, rw());
        tmem.write_at(0, &[0x5A; 8]).unwrap();
        let (imem, imr) = p.init_buf(4096, Access::LOCAL_WRITE);
        // From before the target's wait starts: a stall before the first Read counts too.
        let start = Instant::now();
        let (target, stop) = serve_until_stopped(&p, SPELL);
        let (mut reads, mut last, mut longest) = (0u64, start, Duration::ZERO);
        let mut wc = [Completion::EMPTY; 4];
        while start.elapsed() < 2 * SPELL + SPELL / 4 {
            post_read(&p.qp, reads, Sge::new(&imr, 0, 8), tmr.remote(0));
            let n = p.icq.wait(&mut wc, LONG).unwrap();
            assert_eq!(n, 1, "the Read completed");
            assert_eq!((wc[0].wr_id, wc[0].status), (reads, WcStatus::Success));
            reads += 1;
            longest = longest.max(last.elapsed());
            last = Instant::now();
        }
        stop.write(1).unwrap();
        target.join().unwrap();
        let mut got = [0u8; 8];
        imem.read_at(0, &mut got).unwrap();
        assert_eq!(got, [0x5A; 8]);
        if longest >= SPELL / 4 {
            eprintln!("attempt {attempt}: the client stalled {longest:?} between two Reads");
            continue;
        }
        assert_eq!(
            p.tcq.blocked_waits(),
            0,
            "the target blocked while {reads} Reads came one after another over {:?}",
            start.elapsed()
        );
        return;
    }
    panic!("the client stalled in every attempt: the machine is too loaded to judge");
}

#[test]
fn a_stream_of_writes_alone_does_not_keep_the_target_spinning() {
    // One-sided Writes wait on no answer: a target spinning through a stream of them took the
    // CPU from the processes producing it (the NBD export's deep random writes on two CPUs,
    // docs/benchmarks.md, "A spell counted from the last message"). Its spell still counts
    // from the wait's start (or its last wake-up), so it blocks within a stream twenty spells
    // long, and every Write is placed all the same.
    const SPELL: Duration = Duration::from_millis(50);
    let p = Pair::new(true);
    let (tmem, tmr) = p.target_buf(4096, rw());
    let (imem, imr) = p.init_buf(4096, Access::LOCAL_WRITE);
    let (target, stop) = serve_until_stopped(&p, SPELL);
    let start = Instant::now();
    let mut writes = 0u64;
    let mut wc = [Completion::EMPTY; 4];
    while start.elapsed() < 20 * SPELL {
        imem.write_at(0, &writes.to_le_bytes()).unwrap();
        post_write(
            &p.qp,
            writes,
            Sge::new(&imr, 0, 8),
            tmr.remote(0),
            SendFlags::SIGNALED,
        );
        let n = p.icq.wait(&mut wc, LONG).unwrap();
        assert_eq!(
            (n, wc[0].wr_id, wc[0].status),
            (1, writes, WcStatus::Success)
        );
        writes += 1;
    }
    let blocked = p.tcq.blocked_waits();
    // The last Write is placed once the target reads it (a Read behind it on the same queue
    // pair completes only after): every Write reached the target's memory.
    post_read(&p.qp, u64::MAX, Sge::new(&imr, 8, 8), tmr.remote(0));
    assert_eq!(p.icq.wait(&mut wc, LONG).unwrap(), 1);
    assert_eq!((wc[0].wr_id, wc[0].status), (u64::MAX, WcStatus::Success));
    let mut got = [0u8; 8];
    tmem.read_at(0, &mut got).unwrap();
    assert_eq!(u64::from_le_bytes(got), writes - 1);
    stop.write(1).unwrap();
    target.join().unwrap();
    assert!(
        blocked >= 1,
        "the target spun through {writes} Writes over {:?} without blocking once",
        start.elapsed()
    );
}
