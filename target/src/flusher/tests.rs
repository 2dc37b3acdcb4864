use std::fs::File;
use std::os::unix::fs::OpenOptionsExt;

use std::os::fd::AsRawFd;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use super::backend::Job;
use super::*;
use rpma_common::pmem::{Domain, Durability, Mapping, OpenOptions};

fn page_cache_file(dir: &std::path::Path, len: u64) -> FlushTarget {
    let p = dir.join("f");
    let f = File::options()
        .create(true)
        .truncate(true)
        .read(true)
        .write(true)
        .open(&p)
        .unwrap();
    f.set_len(len).unwrap();
    FlushTarget::page_cache(f.into(), store(len), len)
}

/// A store that only remembers failures (the file's mapping in the daemon).
fn store(len: u64) -> Arc<dyn Persist> {
    Arc::new(Mapping::anonymous(len as usize).unwrap())
}

fn run_many(mut fl: Flusher) {
    let d = tempfile::tempdir().unwrap();
    let t = page_cache_file(d.path(), 1 << 20);
    let mut want: Vec<u64> = Vec::new();
    let mut got = Vec::new();
    for i in 0..200u64 {
        loop {
            match fl.submit(1000 + i, &t, (i % 256) * 4096, 4096) {
                Ok(()) => break,
                Err(FlusherError::Full(_)) => fl.drain(&mut got),
                Err(e) => panic!("{e}"),
            }
        }
        want.push(1000 + i);
    }
    fl.drain(&mut got);
    assert_eq!(fl.in_flight(), 0);
    let mut tokens: Vec<u64> = got.iter().map(|c| c.token).collect();
    tokens.sort_unstable();
    assert_eq!(tokens, want);
    assert!(
        got.iter().all(|c| c.status == FlushStatus::Durable),
        "{got:?}"
    );
}

#[test]
fn many_concurrent_flushes_complete_with_their_tokens() {
    let fl = Flusher::new(32, 0).unwrap();
    eprintln!("flusher backend: {}", fl.backend_name());
    run_many(fl);
}

#[test]
fn many_concurrent_flushes_on_the_worker_thread() {
    let fl = Flusher::new_threaded(8, 0).unwrap();
    assert_eq!(fl.backend_name(), "thread");
    run_many(fl);
}

#[test]
fn wait_fd_becomes_readable() {
    let d = tempfile::tempdir().unwrap();
    let t = page_cache_file(d.path(), 8192);
    let mut fl = Flusher::new(4, 0).unwrap();
    fl.submit(7, &t, 0, 8192).unwrap();
    let mut pfd = libc::pollfd {
        fd: fl.wait_fd().as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one live pollfd.
    let n = unsafe { libc::poll(&mut pfd, 1, 10_000) };
    assert_eq!(n, 1, "eventfd never became readable");
    let mut out = Vec::new();
    fl.drain(&mut out);
    assert_eq!(
        out,
        [FlushCompletion {
            token: 7,
            status: FlushStatus::Durable
        }]
    );
}

fn unflushable_fd(dir: &std::path::Path) -> OwnedFd {
    // An O_PATH descriptor is open but not for I/O: fsync on it fails with EBADF, exactly as
    // on a closed descriptor, without the test closing an fd that something else owns.
    let p = dir.join("g");
    File::create(&p).unwrap();
    File::options()
        .read(true)
        .custom_flags(libc::O_PATH)
        .open(&p)
        .unwrap()
        .into()
}

#[test]
fn a_failed_fdatasync_is_remembered_with_its_errno_and_fails_every_later_flush() {
    for mut fl in [
        Flusher::new(4, 0).unwrap(),
        Flusher::new_threaded(4, 0).unwrap(),
    ] {
        let d = tempfile::tempdir().unwrap();
        let st = store(4096);
        let t = FlushTarget::page_cache(unflushable_fd(d.path()), st.clone(), 4096);
        assert_eq!(t.failure(), None);
        fl.submit(9, &t, 0, 4096).unwrap();
        let mut out = Vec::new();
        fl.drain(&mut out);
        assert_eq!(
            out,
            [FlushCompletion {
                token: 9,
                status: FlushStatus::IoError
            }],
            "{}",
            fl.backend_name()
        );
        let f = t.failure().expect("the failure is recorded in the store");
        assert_eq!((f.op, f.errno), ("fdatasync", libc::EBADF));
        // Linux would now report success on the same file (the error was reported once):
        // a flush of a good descriptor with the same store must still fail, without I/O.
        let good = File::create(d.path().join("h")).unwrap();
        let t2 = FlushTarget::page_cache(good.into(), st, 4096);
        fl.submit(10, &t2, 0, 4096).unwrap();
        assert_eq!(
            fl.in_flight(),
            0,
            "nothing submitted for a failed namespace"
        );
        out.clear();
        fl.poll(&mut out);
        assert_eq!(out[0].status, FlushStatus::NamespaceFailed);
    }
}

#[test]
fn out_of_range_and_volatile_complete_inline() {
    let mut fl = Flusher::new(4, 0).unwrap();
    let v = FlushTarget::volatile(4096);
    fl.submit(1, &v, 0, 4096).unwrap();
    fl.submit(2, &v, 4000, 200).unwrap();
    fl.submit(3, &v, u64::MAX, 2).unwrap();
    let mut out = Vec::new();
    assert_eq!(fl.poll(&mut out), 3);
    assert_eq!(
        out,
        [
            FlushCompletion {
                token: 1,
                status: FlushStatus::VisibleOnly
            },
            FlushCompletion {
                token: 2,
                status: FlushStatus::OutOfRange
            },
            FlushCompletion {
                token: 3,
                status: FlushStatus::OutOfRange
            },
        ]
    );
}

#[test]
fn dax_and_mapped_targets() {
    let d = tempfile::tempdir().unwrap();
    let m = Arc::new(
        OpenOptions::new(d.path().join("ns"))
            .size(1 << 20)
            .create(true)
            .force_dax(true)
            .open()
            .unwrap(),
    );
    let t = FlushTarget::for_mapping(&m, 1).unwrap();
    assert!(format!("{t:?}").contains("dax"));
    assert!(!t.syncs_a_file());
    assert!(!FlushTarget::volatile(4096).syncs_a_file());
    let mut fl = Flusher::new(4, 0).unwrap();
    m.write_at(10, b"x").unwrap();
    fl.submit(5, &t, 0, 0).unwrap();
    fl.submit(6, &t, 4096, 4096).unwrap();
    let mut out = Vec::new();
    fl.poll(&mut out);
    assert_eq!(out.len(), 2);
    assert!(out.iter().all(|c| c.status == FlushStatus::Durable));

    let pc = Arc::new(
        OpenOptions::new(d.path().join("pc"))
            .size(1 << 20)
            .create(true)
            .open()
            .unwrap(),
    );
    let t = FlushTarget::for_mapping(&pc, 1).unwrap();
    if pc.domain() == Domain::PageCache {
        assert!(format!("{t:?}").contains("page-cache"));
        assert!(t.syncs_a_file());
        pc.write_at(0, b"y").unwrap();
        fl.submit(8, &t, 0, 4096).unwrap();
        let mut out = Vec::new();
        fl.drain(&mut out);
        assert_eq!(
            out,
            [FlushCompletion {
                token: 8,
                status: FlushStatus::Durable
            }]
        );
    }
}

#[test]
fn full_is_an_error_not_a_panic() {
    let d = tempfile::tempdir().unwrap();
    let t = page_cache_file(d.path(), 4096);
    let d2 = tempfile::tempdir().unwrap();
    let other = page_cache_file(d2.path(), 4096);
    let mut fl = Flusher::new_threaded(1, 0).unwrap();
    fl.submit(1, &t, 0, 4096).unwrap();
    // The single slot is taken until the first completion is reaped (a flush of the same
    // file waits for it without one).
    assert!(matches!(
        fl.submit(2, &other, 0, 4096),
        Err(FlusherError::Full(1))
    ));
    let mut out = Vec::new();
    fl.drain(&mut out);
    fl.submit(2, &other, 0, 4096).unwrap();
    fl.drain(&mut out);
    assert_eq!(out.iter().map(|c| c.token).collect::<Vec<_>>(), [1, 2]);
}

#[test]
fn flushes_are_timed_in_the_loops_histograms() {
    let d = tempfile::tempdir().unwrap();
    let pc = page_cache_file(d.path(), 1 << 16);
    let dax = FlushTarget::dax(store(1 << 16), 1 << 16);
    let stats = Arc::new(LoopStats::default());
    let mut fl = Flusher::new(4, 0).unwrap();
    fl.set_stats(Arc::clone(&stats));
    fl.submit(1, &pc, 0, 4096).unwrap();
    fl.submit(2, &pc, 4096, 4096).unwrap();
    fl.submit(3, &dax, 0, 4096).unwrap();
    // Refused before any work: not timed.
    fl.submit(4, &pc, 1 << 16, 4096).unwrap();
    let mut out = Vec::new();
    fl.drain(&mut out);
    assert_eq!(out.len(), 4);
    let fds = stats.gpspm_fdatasync.snapshot();
    assert_eq!(fds.count(), 2, "{fds:?}");
    assert!(fds.sum_ns > 0);
    assert_eq!(stats.gpspm_msync.snapshot().count(), 0);
    assert_eq!(stats.gpspm_writeback.snapshot().count(), 1);
    assert_eq!(
        stats.gpspm_request.snapshot().count(),
        0,
        "the loop times requests"
    );
}

/// GPSPM under the power-loss simulation: the range reaches the media (the backing file)
/// through the flusher on both domains, io_uring's fdatasync included; a range nobody flushed
/// does not, and a broken persist answers Durable with nothing written.
#[test]
fn gpspm_flushes_reach_the_simulations_media() {
    use rpma_common::pmem::Simulation;
    let disk = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
    let shm = tempfile::tempdir_in("/dev/shm").unwrap();
    for (dir, force_dax) in [(disk.path(), false), (shm.path(), true)] {
        for broken_persist in [false, true] {
            let path = dir.join(format!("sim-{broken_persist}"));
            let sim = Simulation {
                eviction_percent: 0,
                broken_persist,
                ..Simulation::default()
            };
            let m = Arc::new(
                OpenOptions::new(&path)
                    .size(1 << 20)
                    .create(true)
                    .force_dax(force_dax)
                    .power_loss_simulation(Some(sim))
                    .open()
                    .unwrap(),
            );
            let t = FlushTarget::for_mapping(&m, 1).unwrap();
            let kind = if force_dax { "dax" } else { "page-cache" };
            assert!(format!("{t:?}").contains(kind), "{t:?}");
            m.write_at(8192, b"flushed").unwrap();
            m.write_at(65536, b"not flushed").unwrap();
            m.write_at(16384, b"flushed inline").unwrap();
            let mut fl = Flusher::new(4, 0).unwrap();
            fl.submit(1, &t, 8192, 7).unwrap();
            // As a poll loop with nothing else to do asks (an inline msync on page-cache).
            fl.submit_inline(2, &t, 16384, 14).unwrap();
            let mut out = Vec::new();
            fl.drain(&mut out);
            out.sort_by_key(|c| c.token);
            assert_eq!(
                out,
                [1, 2].map(|token| FlushCompletion {
                    token,
                    status: FlushStatus::Durable
                })
            );
            let media = std::fs::read(&path).unwrap();
            let want: &[u8] = if broken_persist { &[0; 7] } else { b"flushed" };
            assert_eq!(&media[8192..8199], want, "{kind}, broken {broken_persist}");
            let want: &[u8] = if broken_persist {
                &[0; 14]
            } else {
                b"flushed inline"
            };
            assert_eq!(
                &media[16384..16398],
                want,
                "{kind}, broken {broken_persist}"
            );
            assert_eq!(&media[65536..65547], &[0; 11], "{kind}");
            drop(t);
            Arc::into_inner(m).unwrap().simulate_power_loss();
        }
    }
}

/// Under the power-loss simulation a GPSPM flush's range reaches the media when its sync
/// returns 0, not when it is submitted: a flush answered without a sync (or a sync of another
/// range) would leave the bytes to the simulated power loss, as a real one. (They were copied
/// at submit: the power-loss tests passed whether or not a sync ran, or covered the range.)
/// Flushes that waited for the file's sync are copied by the sync of their span.
#[test]
fn the_simulations_media_gets_a_flushed_range_once_its_sync_returned() {
    use rpma_common::pmem::Simulation;
    let disk = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
    let path = disk.path().join("sim");
    let sim = Simulation {
        eviction_percent: 0,
        ..Simulation::default()
    };
    let m = Arc::new(
        OpenOptions::new(&path)
            .size(1 << 20)
            .create(true)
            .power_loss_simulation(Some(sim))
            .open()
            .unwrap(),
    );
    let t = FlushTarget::for_mapping(&m, 1).unwrap();
    assert!(format!("{t:?}").contains("page-cache"), "{t:?}");
    let media = |at: usize, n: usize| std::fs::read(&path).unwrap()[at..at + n].to_vec();
    m.write_at(8192, b"first").unwrap();
    m.write_at(65536, b"waited").unwrap();
    let (mut fl, jobs, done) = by_hand(4);
    fl.submit(1, &t, 8192, 5).unwrap();
    fl.submit(2, &t, 65536, 6).unwrap();
    let first: Vec<usize> = jobs.try_iter().map(|j| j.slot).collect();
    assert_eq!(first.len(), 1, "the second waits for the file's sync");
    assert_eq!(
        media(8192, 5),
        [0; 5],
        "on the media before its sync returned"
    );
    let mut out = Vec::new();
    done.send((first[0], 0)).unwrap();
    fl.poll(&mut out);
    assert_eq!(
        out,
        [FlushCompletion {
            token: 1,
            status: FlushStatus::Durable
        }]
    );
    assert_eq!(media(8192, 5), b"first");
    assert_eq!(
        media(65536, 6),
        [0; 6],
        "the waiting flush's range, before its sync"
    );
    let merged: Vec<usize> = jobs.try_iter().map(|j| j.slot).collect();
    assert_eq!(merged.len(), 1);
    out.clear();
    done.send((merged[0], 0)).unwrap();
    fl.drain(&mut out);
    assert_eq!(
        out,
        [FlushCompletion {
            token: 2,
            status: FlushStatus::Durable
        }]
    );
    assert_eq!(media(65536, 6), b"waited");
    drop(t);
    Arc::into_inner(m).unwrap().simulate_power_loss();
}

/// A page-cache namespace's mapping of a file on a disk (not tmpfs: that is volatile).
fn page_cache_mapping(dir: &std::path::Path, len: u64) -> Arc<Mapping> {
    let m = OpenOptions::new(dir.join("pc"))
        .size(len)
        .create(true)
        .open()
        .unwrap();
    assert_eq!(m.domain(), rpma_common::pmem::Domain::PageCache);
    Arc::new(m)
}

#[test]
fn an_inline_flush_is_done_when_submit_returns_and_timed_as_a_sync() {
    let d = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
    let m = page_cache_mapping(d.path(), 1 << 16);
    let t = FlushTarget::for_mapping(&m, 1).unwrap();
    let stats = Arc::new(LoopStats::default());
    for mut fl in [
        Flusher::new(4, 0).unwrap(),
        Flusher::new_threaded(4, 0).unwrap(),
    ] {
        fl.set_stats(Arc::clone(&stats));
        m.write_at(4096, b"inline").unwrap();
        fl.submit_inline(5, &t, 4096, 6).unwrap();
        assert_eq!(fl.in_flight(), 0, "nothing left to a worker");
        let mut out = Vec::new();
        assert_eq!(fl.poll(&mut out), 1);
        assert_eq!(
            out,
            [FlushCompletion {
                token: 5,
                status: FlushStatus::Durable
            }]
        );
        // A bad range is refused before any sync, inline or not.
        fl.submit_inline(6, &t, 1 << 16, 1).unwrap();
        out.clear();
        fl.poll(&mut out);
        assert_eq!(out[0].status, FlushStatus::OutOfRange);
    }
    // Timed as the loop's own syncs, apart from the worker's fdatasyncs.
    assert_eq!(stats.gpspm_msync.snapshot().count(), 2);
    assert_eq!(stats.gpspm_fdatasync.snapshot().count(), 0);
    assert_eq!(stats.gpspm_writeback.snapshot().count(), 0);
}

#[test]
fn a_slow_inline_sync_sends_the_next_flushes_to_the_worker() {
    let d = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
    let m = page_cache_mapping(d.path(), 1 << 16);
    let t = FlushTarget::for_mapping(&m, 1).unwrap();
    let mut fl = Flusher::new(4, 0).unwrap();
    assert!(fl.inline_on());
    // Every sync is "slow" for this flusher.
    fl.set_inline_slow(Duration::ZERO);
    fl.submit_inline(1, &t, 0, 4096).unwrap();
    assert_eq!(fl.in_flight(), 0, "the first one still inline");
    assert!(!fl.inline_on(), "off for INLINE_BACKOFF after a slow one");
    fl.submit_inline(2, &t, 0, 4096).unwrap();
    assert_eq!(fl.in_flight(), 1, "the next one on the worker");
    let mut out = Vec::new();
    fl.drain(&mut out);
    assert_eq!(out.iter().map(|c| c.token).collect::<Vec<_>>(), [1, 2]);
    assert!(
        out.iter().all(|c| c.status == FlushStatus::Durable),
        "{out:?}"
    );
    // The backoff ends.
    fl.inline_off_until = Some(Instant::now());
    assert!(fl.inline_on());
    assert_eq!(fl.inline_off_until, None);
}

/// A page-cache store whose msync fails the way a lost write-back does, once; then it is failed.
struct FailingMsync(Mapping);

impl Persist for FailingMsync {
    fn domain(&self) -> rpma_common::pmem::Domain {
        rpma_common::pmem::Domain::PageCache
    }
    fn persist(&self, offset: usize, len: usize) -> rpma_common::pmem::Result<Durability> {
        if let Some(failure) = self.0.failure() {
            return Err(rpma_common::pmem::Error::Failed {
                path: "f".into(),
                failure,
            });
        }
        let e = std::io::Error::from_raw_os_error(libc::EIO);
        self.0.record_failure(SyncFailure::new("msync", &e));
        Err(rpma_common::pmem::Error::Sync {
            path: "f".into(),
            op: "msync",
            offset,
            len,
            source: e,
        })
    }
    fn flush(&self, _: usize, _: usize) -> rpma_common::pmem::Result<()> {
        Ok(())
    }
    fn drain(&self) -> rpma_common::pmem::Result<Durability> {
        Ok(Durability::Durable)
    }
    fn failure(&self) -> Option<SyncFailure> {
        self.0.failure()
    }
    fn record_failure(&self, failure: SyncFailure) -> bool {
        self.0.record_failure(failure)
    }
}

#[test]
fn a_failed_inline_sync_is_an_io_error_then_the_namespace_has_failed() {
    let d = tempfile::tempdir().unwrap();
    let st: Arc<dyn Persist> = Arc::new(FailingMsync(Mapping::anonymous(4096).unwrap()));
    let t = FlushTarget::page_cache(unflushable_fd(d.path()), st.clone(), 4096);
    let mut fl = Flusher::new(4, 0).unwrap();
    fl.submit_inline(1, &t, 0, 4096).unwrap();
    let mut out = Vec::new();
    fl.poll(&mut out);
    assert_eq!(out[0].status, FlushStatus::IoError);
    let f = st.failure().expect("recorded");
    assert_eq!((f.op, f.errno), ("msync", libc::EIO));
    // Every later flush fails without I/O, inline or on the worker.
    fl.submit_inline(2, &t, 0, 4096).unwrap();
    fl.submit(3, &t, 0, 4096).unwrap();
    assert_eq!(fl.in_flight(), 0);
    out.clear();
    fl.poll(&mut out);
    assert!(
        out.iter().all(|c| c.status == FlushStatus::NamespaceFailed),
        "{out:?}"
    );
}

/// Two syncs of one namespace reaped in one batch, the one that returned 0 first: it is not
/// answered durable beside the one that failed (of two syncs of one open file, Linux gives the
/// error report to one; the other's 0 proves nothing). It was: the failure was recorded only
/// when its own completion came up.
#[test]
fn a_sync_reaped_beside_a_failed_one_is_not_answered_durable() {
    let mut fl = Flusher::new(4, 0).unwrap();
    if !matches!(fl.backend, Backend::Uring(_)) {
        eprintln!("SKIPPED: io_uring is not available here");
        return;
    }
    let completed = |fl: &mut Flusher| match &mut fl.backend {
        Backend::Uring(r) => r.completion().len(),
        Backend::Thread { .. } => unreachable!(),
    };
    let wait_for = |fl: &mut Flusher, n: usize| {
        let deadline = Instant::now() + Duration::from_secs(30);
        while completed(fl) < n {
            assert!(Instant::now() < deadline, "no completion");
            std::thread::sleep(Duration::from_millis(1));
        }
    };
    let d = tempfile::tempdir().unwrap();
    let st = store(4096);
    let good = File::create(d.path().join("h")).unwrap();
    let t_good = FlushTarget::page_cache(good.into(), st.clone(), 4096);
    let t_bad = FlushTarget::page_cache(unflushable_fd(d.path()), st, 4096);
    fl.submit(1, &t_good, 0, 4096).unwrap();
    wait_for(&mut fl, 1);
    fl.submit(2, &t_bad, 0, 4096).unwrap();
    wait_for(&mut fl, 2);
    let mut out = Vec::new();
    assert_eq!(fl.poll(&mut out), 2);
    out.sort_by_key(|c| c.token);
    assert_eq!(
        out,
        [
            FlushCompletion {
                token: 1,
                status: FlushStatus::NamespaceFailed
            },
            FlushCompletion {
                token: 2,
                status: FlushStatus::IoError
            }
        ]
    );
}

/// Before a loop ends, the syncs still in flight (their connections gone) are reaped, so that a
/// write-back error one of them reports is recorded: dropped unreaped, it was lost with them.
#[test]
fn finish_all_reaps_the_syncs_in_flight_and_records_their_failure() {
    for mut fl in [
        Flusher::new(4, 0).unwrap(),
        Flusher::new_threaded(4, 0).unwrap(),
    ] {
        let d = tempfile::tempdir().unwrap();
        let st = store(4096);
        let t = FlushTarget::page_cache(unflushable_fd(d.path()), st.clone(), 4096);
        fl.submit(3, &t, 0, 4096).unwrap();
        assert_eq!(fl.finish_all(), 1, "{}", fl.backend_name());
        assert_eq!(fl.in_flight(), 0);
        assert!(st.failure().is_some(), "{}", fl.backend_name());
        assert_eq!(fl.finish_all(), 0);
    }
}

/// A sync pushed into the ring whose `io_uring_enter` failed (-EAGAIN) stays in flight and is
/// submitted by the next poll: its flush is answered for itself, and the next flush gets its
/// own slot. (Its slot was freed and handed to the next flush, whose answer was then this
/// sync's: here the unflushable file's error, recorded on the good file's store, and the
/// unflushable one's store left healthy.)
#[test]
fn a_sync_the_kernel_did_not_take_is_submitted_again_and_answered_for_itself() {
    let mut fl = Flusher::new(4, 0).unwrap();
    if fl.backend_name() != "io_uring" {
        eprintln!("skipped: no io_uring here");
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let (st1, st2) = (store(4096), store(4096));
    let bad = FlushTarget::page_cache(unflushable_fd(d.path()), st1.clone(), 4096);
    let good = File::create(d.path().join("h")).unwrap();
    let good = FlushTarget::page_cache(good.into(), st2.clone(), 4096);
    fl.fail_next_submit = true;
    fl.submit(1, &bad, 0, 4096)
        .expect("in the ring: answered later");
    assert_eq!(fl.in_flight(), 1, "it keeps its slot");
    fl.submit(2, &good, 0, 4096).unwrap();
    let mut out = Vec::new();
    fl.drain(&mut out);
    out.sort_by_key(|c| c.token);
    assert_eq!(
        out,
        [
            FlushCompletion {
                token: 1,
                status: FlushStatus::IoError
            },
            FlushCompletion {
                token: 2,
                status: FlushStatus::Durable
            }
        ]
    );
    assert!(bad.failure().is_some(), "the failure is the bad file's");
    assert_eq!(good.failure(), None, "the good file's store is healthy");
}

/// A flusher whose syncs the test answers itself, in any order, as io_uring's workers may:
/// (flusher, the jobs it sent, where to answer them). The worker thread's backend without its
/// thread.
fn by_hand(depth: u32) -> (Flusher, mpsc::Receiver<Job>, mpsc::Sender<(usize, i32)>) {
    let (jobs, job_rx) = mpsc::channel();
    let (done_tx, done) = mpsc::channel();
    let eventfd = Arc::new(EventFd::new().unwrap());
    let backend = Backend::Thread {
        jobs: Some(jobs),
        done,
        worker: None,
    };
    (
        Flusher::with_backend(backend, eventfd, depth, 0),
        job_rx,
        done_tx,
    )
}

/// A flush of a file whose sync is in flight waits for it, and the flushes that waited are
/// synced together by the next sync of the file: never two syncs of one open file at once,
/// where the one that took a write-back error's report could post its completion after the
/// other's 0 was reaped and answered durable (a kernel worker preempted between its check and
/// its completion). A flush of another file is synced beside it. (Each flush had a sync of its
/// own, all at once.)
#[test]
fn a_flush_of_a_file_whose_sync_is_in_flight_waits_and_is_synced_with_the_others() {
    let d = tempfile::tempdir().unwrap();
    let t = page_cache_file(d.path(), 1 << 20);
    let d2 = tempfile::tempdir().unwrap();
    let other = page_cache_file(d2.path(), 4096);
    let (mut fl, jobs, done) = by_hand(4);
    fl.submit(1, &t, 0, 4096).unwrap();
    fl.submit(2, &t, 8192, 4096).unwrap();
    fl.submit(3, &t, 4096, 4096).unwrap();
    fl.submit(4, &other, 0, 4096).unwrap();
    let first: Vec<usize> = jobs.try_iter().map(|j| j.slot).collect();
    assert_eq!(first.len(), 2, "one sync per file at a time");
    assert_eq!(fl.in_flight(), 4);
    let mut out = Vec::new();
    done.send((first[1], 0)).unwrap();
    fl.poll(&mut out);
    assert_eq!(
        out,
        [FlushCompletion {
            token: 4,
            status: FlushStatus::Durable
        }]
    );
    assert!(jobs.try_iter().next().is_none());
    out.clear();
    done.send((first[0], 0)).unwrap();
    fl.poll(&mut out);
    assert_eq!(
        out,
        [FlushCompletion {
            token: 1,
            status: FlushStatus::Durable
        }]
    );
    let merged: Vec<usize> = jobs.try_iter().map(|j| j.slot).collect();
    assert_eq!(merged.len(), 1, "the two that waited, synced together");
    out.clear();
    done.send((merged[0], 0)).unwrap();
    fl.drain(&mut out);
    out.sort_by_key(|c| c.token);
    let got: Vec<(u64, FlushStatus)> = out.iter().map(|c| (c.token, c.status)).collect();
    assert_eq!(got, [(2, FlushStatus::Durable), (3, FlushStatus::Durable)]);
    assert_eq!(fl.in_flight(), 0);
}

/// A sync of a file that fails fails the flushes that waited for it too, without another sync
/// (none can vouch for them now).
#[test]
fn a_failed_sync_fails_the_flushes_that_waited_for_it() {
    let d = tempfile::tempdir().unwrap();
    let st = store(1 << 20);
    let p = d.path().join("f");
    std::fs::write(&p, vec![0u8; 1 << 20]).unwrap();
    let t = FlushTarget::page_cache(File::open(&p).unwrap().into(), st.clone(), 1 << 20);
    let (mut fl, jobs, done) = by_hand(4);
    fl.submit(1, &t, 0, 4096).unwrap();
    fl.submit(2, &t, 4096, 4096).unwrap();
    let slots: Vec<usize> = jobs.try_iter().map(|j| j.slot).collect();
    assert_eq!(slots.len(), 1);
    done.send((slots[0], -libc::EIO)).unwrap();
    let mut out = Vec::new();
    fl.poll(&mut out);
    out.sort_by_key(|c| c.token);
    assert_eq!(
        out,
        [
            FlushCompletion {
                token: 1,
                status: FlushStatus::IoError
            },
            FlushCompletion {
                token: 2,
                status: FlushStatus::NamespaceFailed
            }
        ]
    );
    assert!(
        jobs.try_iter().next().is_none(),
        "no sync after the failure"
    );
    assert_eq!(fl.in_flight(), 0);
    assert!(st.failure().is_some());
}

/// Under a steady stream of flushes of one file (two new ones whenever the sync in flight is
/// answered), every flush is answered, one sync of the file at a time, the flushes that came
/// meanwhile synced together.
#[test]
fn a_steady_stream_of_flushes_of_one_file_is_answered_one_sync_at_a_time() {
    let d = tempfile::tempdir().unwrap();
    let t = page_cache_file(d.path(), 1 << 20);
    let (mut fl, jobs, done) = by_hand(8);
    let mut answered = Vec::new();
    let mut syncs = 0;
    let mut next = 0u64;
    let two_more = |fl: &mut Flusher, next: &mut u64| {
        for _ in 0..2 {
            fl.submit(*next, &t, *next * 4096 % (1 << 20), 4096)
                .unwrap();
            *next += 1;
        }
    };
    two_more(&mut fl, &mut next);
    while next < 100 || fl.in_flight() > 0 {
        let pushed: Vec<usize> = jobs.try_iter().map(|j| j.slot).collect();
        assert!(pushed.len() <= 1, "one sync of the file at a time");
        for slot in pushed {
            syncs += 1;
            done.send((slot, 0)).unwrap();
        }
        fl.poll(&mut answered);
        if next < 100 {
            two_more(&mut fl, &mut next);
        }
    }
    assert!(syncs <= 52, "{syncs} syncs for 100 flushes");
    let mut tokens: Vec<u64> = answered.iter().map(|c| c.token).collect();
    tokens.sort_unstable();
    assert_eq!(tokens, (0..100).collect::<Vec<_>>());
    assert!(answered.iter().all(|c| c.status == FlushStatus::Durable));
}
