//! Link faults under load (issue 14, part 3). Initiator queues keep writing (durable, and placed
//! then persisted), reading and counting while a relay between them and the real `rpma-target`
//! cuts (FIN), resets (RST), stalls, orphans (the host sees a reset, the target's side is left
//! hanging) and resets mid-stream (after a random byte count: mid-FPDU, mid-handshake) their
//! links at random moments, and the library reconnects and re-issues what was not
//! acknowledged. Then:
//! - no call took longer than [`CALL_BOUND`] (every call returned or failed within it);
//! - every write acknowledged as durable is on the target, read back directly (not through the
//!   relay) and from the backing file, and reads during the run saw the latest write;
//! - the target holds nothing for the lost connections: its session table, the regions (rkeys)
//!   registered for them, its admission pools and its open fds are back to the baseline.
//!
//! Seeded (the seed is printed; `RPMA_RELIABILITY_SEED` replays it), bounded loops; the long
//! version runs under `RPMA_RELIABILITY_LONG=1`. A variant in a network namespace of its own
//! drops real packets (iptables' statistic match on lo) and blacks the link out for a while; it
//! skips, saying why, where namespaces or iptables are missing.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rpma_common::proto::nqn::Nqn;
use rpma_initiator::{
    ConnectOptions, Connection, Error, HostIdentity, PersistMethod, QueueOptions, ReconnectPolicy,
};
use rpma_tests::stress::{self, block, parse_block, Footprint, Rng};
use rpma_tests::{run_tool, scratch, Config, Fault, Namespace, Relay, Subsystem, Target};

const SUB: &str = "nqn.2026-11.io.rpma:faults";
const HOST: &str = "nqn.2026-11.io.rpma:faults-host";
const BLOCK: usize = 4096;
/// Blocks of each worker's region.
const BLOCKS: u64 = 48;
/// The first page of nsid 1 holds the workers' counters (one u64 each).
const COUNTERS: u64 = 4096;
/// The connect time-out: the deadline of every wait of a call (a stall longer than this makes
/// the queue give the connection up and reconnect).
const OP_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a queue keeps reconnecting after a loss.
const RECONNECT_BUDGET: Duration = Duration::from_secs(20);
/// No call may take longer: the reconnect budget, then the waits of the re-run call.
const CALL_BOUND: Duration = Duration::from_secs(20 + 4 * 2);
/// The target's footprint is back to its baseline within this after the last link closed.
const CLEANUP_WITHIN: Duration = Duration::from_secs(20);

/// A target serving SUB to any host: nsid 1 on page-cache, nsid 2 dax (forced), each with room
/// for `workers` regions (and nsid 1 the counters page).
fn start(dir: &std::path::Path, workers: u64, top: &str) -> Target {
    let size = COUNTERS + workers.div_ceil(2) * BLOCKS * BLOCK as u64;
    let size = format!("{}KiB", size.div_ceil(1024));
    let config = Config::new().set(top).subsystem(
        Subsystem::new(SUB)
            .any_host()
            .namespace(Namespace::new(1, "ns1", &size))
            .namespace(Namespace::new(2, "ns2", &size).force_dax()),
    );
    Target::start(dir, &config.to_string())
}

/// Queues to `url` with short waits and a reconnect policy that rides out every fault here.
fn conn(url: &str, timeout: Duration) -> Connection {
    Connection::new(
        url,
        Nqn::new(SUB).unwrap(),
        HostIdentity::new(Nqn::new(HOST).unwrap()),
    )
    .with_connect_options(ConnectOptions {
        timeout,
        ..ConnectOptions::default()
    })
    .with_queue_options(QueueOptions {
        depth: 8,
        chunk: 16 << 10,
        reconnect: ReconnectPolicy {
            max_attempts: u32::MAX,
            timeout: RECONNECT_BUDGET,
            initial_backoff: Duration::from_millis(20),
            max_backoff: Duration::from_millis(250),
        },
        ..QueueOptions::default()
    })
}

/// Where worker `w` writes: (nsid, first byte of its region).
fn region(w: u64) -> (u32, u64) {
    (
        1 + (w % 2) as u32,
        COUNTERS + (w / 2) * BLOCKS * BLOCK as u64,
    )
}

/// What a worker did, for the checks after the run.
#[derive(Debug, Default)]
struct Outcome {
    worker: u64,
    /// Per block: the generation of its last write (0: never written). Every one was
    /// acknowledged durable by the end of the run.
    latest: Vec<u64>,
    /// Writes acknowledged durable (a block written twice counts twice).
    acked: u64,
    /// fetch_adds that returned / that failed with the loss (they may have executed).
    adds_ok: u64,
    adds_lost: u64,
    calls: stress::Calls,
    reads_checked: u64,
    reconnects: u32,
}

/// Runs `call`, failing the test if it outlasts [`CALL_BOUND`].
fn timed<T>(o: &mut Outcome, what: &str, call: impl FnOnce() -> T) -> T {
    let who = format_args!("worker {}", o.worker);
    o.calls.timed(CALL_BOUND, who, what, call)
}

/// Worker `w`: random calls on its own region through `c` until `until`, each call checked
/// (durable calls must be durable, reads must see the latest write).
fn worker(
    c: &Connection,
    w: u64,
    mut rng: Rng,
    opened: &std::sync::mpsc::Sender<()>,
    run: Duration,
) -> Outcome {
    let (nsid, base) = region(w);
    let method = stress::method_for(w);
    // Opened before the faults start (faults_during_the_handshake_leave_nothing_behind is the
    // test of a first connection that meets one).
    let mut q = c.open_queue(w as u16 + 1).expect("open queue");
    let _ = opened.send(());
    let until = Instant::now() + run;
    let mut o = Outcome {
        worker: w,
        latest: vec![0; BLOCKS as usize],
        ..Outcome::default()
    };
    let mut generation = 0u64;
    // Written blocks not yet acknowledged durable.
    let mut placed: Vec<u64> = Vec::new();
    let at = |b: u64| base + b * BLOCK as u64;
    q.namespace(nsid).unwrap().set_method(method).unwrap();
    while Instant::now() < until {
        let mut ns = q.namespace(nsid).unwrap();
        let b = rng.below(BLOCKS);
        let roll = rng.below(100);
        if roll < 30 {
            generation += 1;
            let data = block(w, b, generation, BLOCK);
            let d = timed(&mut o, "write_durable", || ns.write_durable(at(b), &data));
            assert!(d.expect("write_durable").is_durable(), "worker {w}");
            o.latest[b as usize] = generation;
            placed.retain(|&x| x != b);
            o.acked += 1;
        } else if roll < 50 {
            generation += 1;
            let data = block(w, b, generation, BLOCK);
            timed(&mut o, "write_at", || ns.write_at(at(b), &data)).expect("write_at");
            o.latest[b as usize] = generation;
            if rng.chance(50) {
                let d = timed(&mut o, "persist_written", || {
                    ns.persist_written(at(b), BLOCK as u64)
                });
                assert!(d.expect("persist_written").is_durable(), "worker {w}");
                placed.retain(|&x| x != b);
                o.acked += 1;
            } else if !placed.contains(&b) {
                placed.push(b);
            }
        } else if roll < 60 {
            let n = rng.range(2, 5);
            let mut blocks: Vec<u64> = (0..n).map(|_| rng.below(BLOCKS)).collect();
            blocks.sort_unstable();
            blocks.dedup();
            let datas: Vec<(u64, Vec<u8>)> = blocks
                .iter()
                .map(|&b| {
                    generation += 1;
                    (b, block(w, b, generation, BLOCK))
                })
                .collect();
            let items: Vec<(u64, &[u8])> =
                datas.iter().map(|(b, d)| (at(*b), d.as_slice())).collect();
            let d = timed(&mut o, "write_batch_durable", || {
                ns.write_batch_durable(&items)
            });
            assert!(d.expect("write_batch_durable").is_durable(), "worker {w}");
            for (b, d) in &datas {
                o.latest[*b as usize] = parse_block(d).unwrap().2;
                placed.retain(|x| x != b);
                o.acked += 1;
            }
        } else if roll < 65 {
            let d = timed(&mut o, "persist_own_writes", || ns.persist_own_writes());
            assert!(d.expect("persist_own_writes").is_durable(), "worker {w}");
            o.acked += placed.len() as u64;
            placed.clear();
        } else if roll < 90 {
            let mut got = vec![0u8; BLOCK];
            timed(&mut o, "read_at", || ns.read_at(at(b), &mut got)).expect("read_at");
            check_block(w, b, o.latest[b as usize], &got, "a read during the run");
            o.reads_checked += 1;
        } else {
            let mut counters = q.namespace(1).unwrap();
            match timed(&mut o, "fetch_add", || counters.fetch_add(8 * w, 1)) {
                Ok(_) => o.adds_ok += 1,
                Err(e) if e.is_connection_loss() => o.adds_lost += 1,
                Err(e) => panic!("worker {w}: fetch_add: {e}"),
            }
        }
    }
    let mut ns = q.namespace(nsid).unwrap();
    let d = timed(&mut o, "persist_own_writes", || ns.persist_own_writes());
    assert!(d.expect("the last persist_own_writes").is_durable());
    o.acked += placed.len() as u64;
    o.reconnects = q.reconnects();
    q.close().unwrap();
    o
}

/// Block `b` of worker `w` holds generation `generation` (zeros if never written).
fn check_block(w: u64, b: u64, generation: u64, got: &[u8], when: &str) {
    if generation == 0 {
        assert!(
            got.iter().all(|&x| x == 0),
            "worker {w} block {b}: never written, yet not zero ({when})"
        );
        return;
    }
    assert_eq!(
        parse_block(got),
        Some((w, b, generation)),
        "worker {w} block {b}: not its latest write, generation {generation} ({when})"
    );
}

/// Every block of every worker, read through a fresh queue straight to the target and from the
/// backing files; the counters within what the fetch_adds could have done. Returns the blocks
/// checked.
fn verify(t: &Target, outcomes: &[Outcome]) -> u64 {
    let mut q = conn(&t.url(), Duration::from_secs(10))
        .open_queue(0)
        .unwrap();
    let files = [
        std::fs::read(t.dir().join("ns1")).unwrap(),
        std::fs::read(t.dir().join("ns2")).unwrap(),
    ];
    let mut checked = 0;
    for o in outcomes {
        let (nsid, base) = region(o.worker);
        let mut ns = q.namespace(nsid).unwrap();
        for b in 0..BLOCKS {
            let off = base + b * BLOCK as u64;
            let mut got = vec![0u8; BLOCK];
            ns.read_at(off, &mut got).unwrap();
            let g = o.latest[b as usize];
            check_block(o.worker, b, g, &got, "read back after the run");
            let file = &files[nsid as usize - 1][off as usize..off as usize + BLOCK];
            check_block(o.worker, b, g, file, "the backing file after the run");
            checked += u64::from(g > 0);
        }
        let mut word = [0u8; 8];
        q.namespace(1)
            .unwrap()
            .read_at(8 * o.worker, &mut word)
            .unwrap();
        let v = u64::from_ne_bytes(word);
        assert!(
            (o.adds_ok..=o.adds_ok + o.adds_lost).contains(&v),
            "worker {}: counter {v}, {} adds returned and {} were lost with a link",
            o.worker,
            o.adds_ok,
            o.adds_lost
        );
    }
    q.close().unwrap();
    checked
}

/// A warm-up through `url` (every method offered on both namespaces, then a clean close),
/// then the target's footprint once it holds nothing: the baseline to come back to.
fn baseline(t: &Target, url: &str) -> Footprint {
    let mut q = conn(url, Duration::from_secs(10)).open_queue(0).unwrap();
    for nsid in [1, 2] {
        let mut ns = q.namespace(nsid).unwrap();
        for m in [
            PersistMethod::Apm,
            PersistMethod::Gpspm,
            PersistMethod::Flush,
        ] {
            if rpma_tests::stress::if_offered(&ns, Some(m)).is_none() {
                continue;
            }
            ns.set_method(Some(m)).unwrap();
            ns.write_durable(COUNTERS, &[0u8; 512]).unwrap();
        }
        ns.fetch_add(1024, 0).unwrap();
    }
    q.close().unwrap();
    let deadline = Instant::now() + CLEANUP_WITHIN;
    loop {
        let f = Footprint::of(t);
        if f.is_idle() {
            return f;
        }
        assert!(
            Instant::now() < deadline,
            "the warm-up session stays: {f:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Injects random faults into `relay`'s links every 30..400 ms until `stop`.
fn injector(relay: Arc<Relay>, mut rng: Rng, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        // Bounded: at most one fault per 30 ms of the longest run.
        for _ in 0..20_000 {
            if stop.load(Ordering::Relaxed) {
                return;
            }
            std::thread::sleep(rng.duration(Duration::from_millis(30), Duration::from_millis(400)));
            let n = rng.below(1 << 16) as usize;
            match rng.below(100) {
                0..=19 => {
                    relay.inject_one(Fault::Cut, n);
                }
                20..=34 => {
                    relay.inject_one(Fault::Reset, n);
                }
                35..=54 => {
                    relay.inject_one(Fault::ResetAfter(rng.below(64 << 10)), n);
                }
                55..=64 => {
                    relay.inject_one(Fault::Orphan, n);
                }
                65..=84 => {
                    let d = rng.duration(Duration::from_millis(50), Duration::from_millis(3000));
                    relay.inject_one(Fault::Stall(d), n);
                }
                85..=89 => {
                    relay.cut();
                }
                90..=94 => {
                    relay.reset();
                }
                _ => {
                    // A link that dies with data in flight: what the hosts send is lost, then
                    // the links are cut.
                    relay.swallow();
                    std::thread::sleep(rng.duration(Duration::ZERO, Duration::from_millis(100)));
                    relay.cut();
                }
            }
        }
    })
}

/// Runs `workers` workers through `url` for `run`, with `inject` (started with the workers and
/// stopped when they are done) injecting faults; returns their outcomes.
fn run_workers(
    url: &str,
    workers: u64,
    run: Duration,
    rng: &mut Rng,
    inject: impl FnOnce(Rng, Arc<AtomicBool>) -> std::thread::JoinHandle<()>,
) -> Vec<Outcome> {
    let c = conn(url, OP_TIMEOUT);
    let stop = Arc::new(AtomicBool::new(false));
    let (tx, opened) = std::sync::mpsc::channel();
    let handles: Vec<_> = (0..workers)
        .map(|w| {
            let (c, r, tx) = (c.clone(), rng.fork(w), tx.clone());
            std::thread::spawn(move || worker(&c, w, r, &tx, run))
        })
        .collect();
    for _ in 0..workers {
        opened
            .recv_timeout(Duration::from_secs(30))
            .expect("every worker opens its queue (see its panic)");
    }
    let faults = inject(rng.fork(u64::MAX), Arc::clone(&stop));
    // Every worker ends within its run and one bounded call (a hang fails here, not never).
    let deadline = Instant::now() + run + CALL_BOUND + Duration::from_secs(10);
    let mut outcomes = Vec::new();
    for h in handles {
        while !h.is_finished() {
            assert!(Instant::now() < deadline, "a worker hangs");
            std::thread::sleep(Duration::from_millis(20));
        }
        match h.join() {
            Ok(o) => outcomes.push(o),
            Err(p) => {
                stop.store(true, Ordering::Relaxed);
                std::panic::resume_unwind(p)
            }
        }
    }
    stop.store(true, Ordering::Relaxed);
    faults.join().unwrap();
    outcomes
}

/// The figures of a run (stress::figures): what was done, what was checked, lost = 0.
fn report(
    test: &str,
    seed: u64,
    outcomes: &[Outcome],
    checked: u64,
    faults: &[(&str, u64)],
    cleanup: Duration,
) {
    let sum = |f: fn(&Outcome) -> u64| outcomes.iter().map(f).sum::<u64>();
    let slowest = outcomes
        .iter()
        .map(|o| o.calls.slowest)
        .max()
        .unwrap_or_default();
    let mut pairs = vec![
        (
            "mode",
            if stress::long() { "long" } else { "short" }.to_owned(),
        ),
        ("seed", seed.to_string()),
        ("workers", outcomes.len().to_string()),
        ("calls", sum(|o| o.calls.count).to_string()),
        ("acked_durable", sum(|o| o.acked).to_string()),
        ("reads_checked", sum(|o| o.reads_checked).to_string()),
        ("blocks_verified", checked.to_string()),
        ("fetch_adds", sum(|o| o.adds_ok + o.adds_lost).to_string()),
        (
            "fetch_adds_lost_with_link",
            sum(|o| o.adds_lost).to_string(),
        ),
        ("reconnects", sum(|o| u64::from(o.reconnects)).to_string()),
    ];
    pairs.extend(faults.iter().map(|(k, v)| (*k, v.to_string())));
    pairs.extend([
        ("slowest_call_ms", slowest.as_millis().to_string()),
        ("bound_ms", CALL_BOUND.as_millis().to_string()),
        ("lost", "0".to_owned()),
        ("cleanup_ms", cleanup.as_millis().to_string()),
    ]);
    stress::figures(test, &pairs);
}

#[test]
fn random_cuts_resets_and_stalls_under_load_lose_no_acknowledged_write() {
    let mut rng = Rng::for_test("link faults");
    let seed = rng.seed();
    let workers = stress::pick(4, 8);
    let run = stress::pick(Duration::from_secs(10), Duration::from_secs(240));
    let d = scratch();
    let t = start(d.path(), workers, "");
    let relay = Arc::new(Relay::start(&format!("127.0.0.1:{}", t.port())));
    let base = baseline(&t, &relay.url());
    let outcomes = run_workers(&relay.url(), workers, run, &mut rng, |r, stop| {
        injector(Arc::clone(&relay), r, stop)
    });
    let counts = relay.counts();
    // Nothing may still be on its way from a stalled link when the blocks are checked.
    relay.resume();
    let checked = verify(&t, &outcomes);
    // With the relay still up: the target must end the orphaned links' sessions itself (its
    // keep-alive), not wait for the relay to close them.
    let cleanup = Footprint::wait_back_to(&t, &base, CLEANUP_WITHIN);
    drop(Arc::into_inner(relay).expect("the injector is done"));
    assert!(
        counts.total() >= 10,
        "too few faults to mean anything: {counts:?}"
    );
    assert!(
        outcomes.iter().map(|o| o.reconnects).sum::<u32>() >= 5,
        "the faults should have made the queues reconnect"
    );
    report(
        "link-faults",
        seed,
        &outcomes,
        checked,
        &[
            ("faults", counts.total()),
            ("cuts", counts.cuts),
            ("resets", counts.resets),
            ("stalls", counts.stalls),
            ("orphans", counts.orphans),
            ("swallows", counts.swallows),
        ],
        cleanup,
    );
}

/// A link that goes silent while a Write is on it, and delivers it late (after the queue gave
/// the connection up, reconnected, re-issued the Write and went on to write the block again),
/// must not overwrite the later, acknowledged write: the old connection's bytes must reach a
/// session that is gone (its rkeys revoked) or arrive before the re-issue.
#[test]
fn a_stalled_link_delivering_late_overwrites_no_acknowledged_write() {
    let d = scratch();
    // The target's keep-alive outlasts the queue's time-out: the target still holds the old
    // session when the queue gives it up.
    // 2.5 s, not 1: any call slower than the time-out on a loaded machine reconnects once more.
    let t = start(d.path(), 2, "keep_alive_ms = 4000");
    let relay = Relay::start(&format!("127.0.0.1:{}", t.port()));
    let mut q = conn(&relay.url(), Duration::from_millis(2500))
        .open_queue(0)
        .unwrap();
    let mut ns = q.namespace(1).unwrap();
    let (a, b, c) = (
        block(0, 0, 1, BLOCK),
        block(0, 0, 2, BLOCK),
        block(0, 0, 3, BLOCK),
    );
    assert!(ns.write_durable(COUNTERS, &a).unwrap().is_durable());
    assert_eq!(relay.stall_links(), 1);
    // B goes into the silent link; its persist times out, the queue reconnects on a new link
    // and re-issues B there.
    ns.write_at(COUNTERS, &b).unwrap();
    let started = Instant::now();
    assert!(ns
        .persist_written(COUNTERS, BLOCK as u64)
        .unwrap()
        .is_durable());
    let persisted_after = started.elapsed();
    assert!(ns.write_durable(COUNTERS, &c).unwrap().is_durable());
    assert_eq!(q.reconnects(), 1);
    // Now the old link wakes up and delivers what it held: B's Write, the persist, keep-alives
    // and the goodbye.
    relay.resume();
    let deadline = Instant::now() + CLEANUP_WITHIN;
    while Footprint::of(&t).sessions > 1 {
        assert!(Instant::now() < deadline, "the old session stays");
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut got = vec![0u8; BLOCK];
    q.namespace(1).unwrap().read_at(COUNTERS, &mut got).unwrap();
    assert_eq!(
        parse_block(&got).map(|b| b.2),
        Some(3),
        "the stalled link's late Write overwrote the acknowledged one (persist took \
         {persisted_after:?})"
    );
    let file = std::fs::read(t.dir().join("ns1")).unwrap();
    assert_eq!(parse_block(&file[4096..8192]).map(|b| b.2), Some(3));
    stress::figures(
        "stalled-link",
        &[
            ("target_keep_alive_ms", "4000".to_owned()),
            ("queue_timeout_ms", "2500".to_owned()),
            ("persist_took_ms", persisted_after.as_millis().to_string()),
            ("lost", "0".to_owned()),
        ],
    );
}

/// A queue that gives up a connection it could not retire (its link silent, its reconnect
/// budget shorter than the target's keep-alive) leaves that connection able to deliver its
/// Writes late, until the target expires it: a queue opened in its place from the same
/// connection (the NBD export opens one at once) must not write before then, or its
/// acknowledged, durable write is overwritten by the late one. (It wrote at once, and the late
/// Write landed over it.)
#[test]
fn a_queue_opened_in_place_of_one_given_up_writes_after_the_old_connection_expired() {
    let d = scratch();
    let t = start(d.path(), 2, "keep_alive_ms = 4000");
    let relay = Relay::start(&format!("127.0.0.1:{}", t.port()));
    let c = conn(&relay.url(), Duration::from_millis(1000)).with_queue_options(QueueOptions {
        depth: 8,
        chunk: 16 << 10,
        reconnect: ReconnectPolicy::never(),
        ..QueueOptions::default()
    });
    let mut q = c.open_queue(0).unwrap();
    let (a, b, cc) = (
        block(0, 0, 1, BLOCK),
        block(0, 0, 2, BLOCK),
        block(0, 0, 3, BLOCK),
    );
    {
        let mut ns = q.namespace(1).unwrap();
        assert!(ns.write_durable(COUNTERS, &a).unwrap().is_durable());
        assert_eq!(relay.stall_links(), 1);
        // B goes into the silent link; its persist times out and the queue gives up.
        ns.write_at(COUNTERS, &b).unwrap();
        assert!(ns.persist_written(COUNTERS, BLOCK as u64).is_err());
    }
    // A queue in its place writes C durably.
    let mut q2 = c.open_queue(1).unwrap();
    assert!(q2
        .namespace(1)
        .unwrap()
        .write_durable(COUNTERS, &cc)
        .unwrap()
        .is_durable());
    // The old link wakes up and delivers B.
    relay.resume();
    let deadline = Instant::now() + CLEANUP_WITHIN;
    while Footprint::of(&t).sessions > 1 {
        assert!(Instant::now() < deadline, "the old session stays");
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut got = vec![0u8; BLOCK];
    q2.namespace(1)
        .unwrap()
        .read_at(COUNTERS, &mut got)
        .unwrap();
    assert_eq!(
        parse_block(&got).map(|b| b.2),
        Some(3),
        "the given-up connection's late Write overwrote the durable one"
    );
    drop(q);
}

/// A target, a relay to it, and two queues of one connection through the relay: A on the
/// relay's first link, B on its second.
fn two_queues_through_a_relay(
    dir: &std::path::Path,
) -> (Target, Relay, rpma_initiator::Queue, rpma_initiator::Queue) {
    let t = start(dir, 2, "");
    let relay = Relay::start(&format!("127.0.0.1:{}", t.port()));
    let c = conn(&relay.url(), Duration::from_secs(5));
    let a = c.open_queue(0).unwrap();
    let b = c.open_queue(1).unwrap();
    assert_eq!(relay.live(), 2);
    (t, relay, a, b)
}

/// [`two_queues_through_a_relay`], and a block of A's (`[1; BLOCK]` at `COUNTERS`) written
/// and held in A's stalled link: B finds it not placed.
fn a_write_held_in_its_link(
    dir: &std::path::Path,
) -> (Target, Relay, rpma_initiator::Queue, rpma_initiator::Queue) {
    let (t, relay, mut a, mut b) = two_queues_through_a_relay(dir);
    assert_ne!(a.order_id(), b.order_id());
    assert!(relay.inject_one(Fault::Stall(Duration::MAX), 0), "A's link");
    a.namespace(1)
        .unwrap()
        .write_at(COUNTERS, &[1; BLOCK])
        .unwrap();
    let writers = b.namespace(1).unwrap().unplaced_writers(COUNTERS, BLOCK);
    assert_eq!(writers, [a.order_id()]);
    (t, relay, a, b)
}

/// Two queues of one connection write the same bytes, the second after the first's
/// acknowledgement; the first queue's link is reset and it re-issues the writes it holds (none
/// durable yet). It replays only the bytes no newer write took: the second queue's block stays
/// (although that write was made durable, and so released, before the replay), the rest of the
/// first queue's write comes back, and a started Write that a newer one covers whole is not
/// re-issued at all but still reported complete. Without the shared replay order the older
/// copy landed over the newer one (the NBD export's four-connection ext4 test found it).
#[test]
fn a_replay_never_writes_over_a_newer_write_of_another_queue() {
    let d = scratch();
    let (t, relay, mut a, mut b) = two_queues_through_a_relay(d.path());
    let at = COUNTERS;
    // A: three blocks (one held write), placed on the target (a Write completes when TCP
    // took it: B's newer write could land first), and a started block after them, not posted
    // yet.
    let mut na = a.namespace(1).unwrap();
    na.write_at(at, &[1; 3 * BLOCK]).unwrap();
    na.place_writes().unwrap();
    let ticket = a
        .namespace(1)
        .unwrap()
        .start_write(at + 3 * BLOCK as u64, &[4; BLOCK])
        .unwrap();
    // B, later: the middle block and the started one, durable (B holds neither afterwards).
    let mut nb = b.namespace(1).unwrap();
    assert!(nb
        .write_durable(at + BLOCK as u64, &[2; BLOCK])
        .unwrap()
        .is_durable());
    assert!(nb
        .write_durable(at + 3 * BLOCK as u64, &[5; BLOCK])
        .unwrap()
        .is_durable());
    assert!(relay.inject_one(Fault::Reset, 0), "A's link");
    // A's next wait finds its link gone: it reconnects, re-issues, and reports the loss to
    // the waiter; the started Write still completes, once.
    let mut done = Vec::new();
    let first = a.wait_started(&mut done);
    assert!(
        matches!(first, Err(Error::ConnectionLost { .. })),
        "{first:?}"
    );
    while done.is_empty() {
        a.wait_started(&mut done).unwrap();
    }
    assert_eq!(done, [rpma_initiator::Completed::Write(ticket)]);
    assert_eq!(a.reconnects(), 1);
    let mut got = vec![0u8; 4 * BLOCK];
    a.namespace(1).unwrap().read_at(at, &mut got).unwrap();
    let want: Vec<u8> = [[1; BLOCK], [2; BLOCK], [1; BLOCK], [5; BLOCK]].concat();
    let old: Vec<usize> = (0..4)
        .filter(|&i| got[i * BLOCK..(i + 1) * BLOCK] != want[i * BLOCK..(i + 1) * BLOCK])
        .collect();
    assert!(
        old.is_empty(),
        "A's replay wrote over B's newer blocks: {old:?}"
    );
    // Durable as read: A's persist covers its own replayed bytes.
    assert!(persisted(&mut a));
    let file = std::fs::read(t.dir().join("ns1")).unwrap();
    assert!(file[at as usize..at as usize + 4 * BLOCK] == want[..]);
}

/// [`two_queues_through_a_relay`], a block written by A (placed) and rewritten whole by B
/// (placed), neither durable, and A's link reset: A reconnects, and its re-issue lets its write
/// go (B's bytes are the newest). Returns the block's offset and how many of its pages the
/// page cache holds unsynced, the latter None where cachestat cannot tell.
fn a_write_rewritten_by_another_queue_before_a_reconnect(
    t: &Target,
    relay: &Relay,
    a: &mut rpma_initiator::Queue,
    b: &mut rpma_initiator::Queue,
) -> (u64, Option<impl Fn() -> u64>) {
    let file = t.dir().join("ns1");
    let seen = rpma_tests::unsynced_pages(&file, 0, 4096).is_some();
    let at = COUNTERS;
    let mut na = a.namespace(1).unwrap();
    na.write_at(at, &[1; BLOCK]).unwrap();
    na.place_writes().unwrap();
    let mut nb = b.namespace(1).unwrap();
    nb.write_at(at, &[2; BLOCK]).unwrap();
    nb.place_writes().unwrap();
    assert!(relay.inject_one(Fault::Reset, 0), "A's link");
    while a.reconnects() == 0 {
        a.tick().unwrap();
    }
    let unsynced = move || rpma_tests::unsynced_pages(&file, at, BLOCK as u64).unwrap();
    if !seen {
        return (at, None);
    }
    assert!(unsynced() > 0, "nothing made the block durable yet");
    (at, Some(unsynced))
}

/// A write of queue A that a newer write of queue B (same connection) rewrote whole, neither
/// durable when A's link was reset: A's re-issue lets it go, and A's `persist_own_writes`
/// does not say durable until the block's bytes (B's) are. While B's write is not known placed
/// since A reconnected (a target restart could have taken it) it fails, naming B, and asks B
/// to learn its placement; once B polled, A's persist makes the block durable (cachestat sees
/// no unsynced page). (It said durable at once, covering nothing: the block stayed unsynced.)
#[test]
fn persist_own_writes_covers_its_writes_another_queue_rewrote_before_a_reconnect() {
    let d = scratch();
    let (t, relay, mut a, mut b) = two_queues_through_a_relay(d.path());
    let (at, Some(unsynced)) =
        a_write_rewritten_by_another_queue_before_a_reconnect(&t, &relay, &mut a, &mut b)
    else {
        eprintln!("SKIPPED: this kernel has no cachestat(2) to see unsynced pages");
        return;
    };
    let first = a.namespace(1).unwrap().persist_own_writes();
    if let Ok(d) = &first {
        assert!(
            !d.is_durable() || unsynced() == 0,
            "A's persist said {d:?} with the block's pages unsynced"
        );
    }
    assert!(
        matches!(&first, Err(Error::RewritesNotPlaced { nsid: 1, queues }) if *queues == [b.order_id()]),
        "{first:?}"
    );
    assert!(unsynced() > 0);
    // B sends a probe at its next poll (asked), and learns its write placed from the echo.
    let deadline = Instant::now() + Duration::from_secs(30);
    let durable = loop {
        b.tick().unwrap();
        match a.namespace(1).unwrap().persist_own_writes() {
            Ok(d) => break d,
            Err(Error::RewritesNotPlaced { .. }) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(e) => panic!("A's persist after B polled: {e}"),
        }
    };
    assert!(durable.is_durable(), "{durable:?}");
    assert_eq!(
        unsynced(),
        0,
        "A's persist said durable with the block's pages unsynced"
    );
    let mut got = vec![0u8; BLOCK];
    a.namespace(1).unwrap().read_at(at, &mut got).unwrap();
    assert!(got == [2; BLOCK], "the block is not B's newer write");
    // B's write is still B's to persist; A owes nothing more.
    assert!(persisted(&mut b));
    assert!(persisted(&mut a));
}

/// The same, but B's client writes the block again after B's write was placed (learned since
/// A reconnected) and before A's persist: any write of the block newer than A's will do, and
/// A's persist makes the block durable at once, without waiting for the placement of B's
/// newest write. (It named B again: a client that rewrites a block faster than a placement's
/// round trip kept every persist waiting, and the NBD export's FLUSH answered EIO after its
/// rounds.)
#[test]
fn persist_own_writes_does_not_wait_for_a_rewrite_after_a_placement() {
    let d = scratch();
    let (t, relay, mut a, mut b) = two_queues_through_a_relay(d.path());
    let (at, _) = a_write_rewritten_by_another_queue_before_a_reconnect(&t, &relay, &mut a, &mut b);
    b.namespace(1).unwrap().place_writes().unwrap();
    b.namespace(1).unwrap().write_at(at, &[3; BLOCK]).unwrap();
    assert_eq!(
        a.namespace(1).unwrap().unplaced_writers(at, BLOCK),
        [b.order_id()],
        "B's rewrite is not known placed"
    );
    let durable = a
        .namespace(1)
        .unwrap()
        .persist_own_writes()
        .expect("A's persist with B's rewrite not yet placed");
    assert!(durable.is_durable(), "{durable:?}");
    let mut got = vec![0u8; BLOCK];
    a.namespace(1).unwrap().read_at(at, &mut got).unwrap();
    assert!(got == [3; BLOCK], "the block is not B's newest write");
    assert!(persisted(&mut b));
    assert!(persisted(&mut a));
}

/// The same, but B's client writes the block again before A's persist, with no placement of
/// B's learned since A reconnected: A's persist must not say durable while the block's pages
/// are unsynced. (It did, after the vouching change: the rewrite freed B's older write before
/// registering the new one, and the heir took the moment no write held the bytes for a
/// durable release.)
#[test]
fn persist_own_writes_is_not_durable_over_a_rewrite_nothing_placed() {
    let d = scratch();
    let (t, relay, mut a, mut b) = two_queues_through_a_relay(d.path());
    let (at, Some(unsynced)) =
        a_write_rewritten_by_another_queue_before_a_reconnect(&t, &relay, &mut a, &mut b)
    else {
        eprintln!("SKIPPED: this kernel has no cachestat(2) to see unsynced pages");
        return;
    };
    b.namespace(1).unwrap().write_at(at, &[3; BLOCK]).unwrap();
    match a.namespace(1).unwrap().persist_own_writes() {
        Ok(d) => assert!(
            !d.is_durable() || unsynced() == 0,
            "A's persist said {d:?} with the block's pages unsynced"
        ),
        Err(Error::RewritesNotPlaced { queues, .. }) => assert_eq!(queues, [b.order_id()]),
        Err(e) => panic!("A's persist: {e}"),
    }
}

/// The same, but B is dropped with its newer write held (never durable) before A's persist:
/// the block may hold neither write, and A's persist says so once (`RewritesLost`) instead of
/// durable; its next persist covers what it still holds. (It said durable.)
#[test]
fn persist_own_writes_reports_its_writes_lost_with_the_newer_write_that_took_them() {
    let d = scratch();
    let (t, relay, mut a, mut b) = two_queues_through_a_relay(d.path());
    // Needs no cachestat: runs on every kernel.
    let (at, _) = a_write_rewritten_by_another_queue_before_a_reconnect(&t, &relay, &mut a, &mut b);
    drop(b);
    let first = a.namespace(1).unwrap().persist_own_writes();
    assert!(
        matches!(&first, Err(Error::RewritesLost { nsid: 1, ranges }) if *ranges == [(at, at + BLOCK as u64)]),
        "{first:?}"
    );
    assert!(persisted(&mut a));
}

/// A Write completes when the transport took it (on `tcp`, as in iWARP): one queue's write
/// may still be on its way when another queue of the connection writes the same bytes, and
/// land after it. Either queue finds it in `unplaced_writers` (only where it wrote); once the
/// first queue placed its writes (`place_writes`, or any started Read answered after them), it
/// is gone from there and a newer write lands after it. A queue that reconnected knows nothing
/// placed again: what it re-issued is on its way.
#[test]
fn a_queue_finds_another_queues_unplaced_writes_and_lands_after_them_once_placed() {
    let d = scratch();
    let (_t, relay, mut a, mut b) = a_write_held_in_its_link(d.path());
    let (at, a_id) = (COUNTERS, a.order_id());
    let mut nb = b.namespace(1).unwrap();
    assert_eq!(nb.unplaced_writers(at + 100, 1), [a_id], "inside it");
    assert!(nb.unplaced_writers(at + BLOCK as u64, BLOCK).is_empty());
    assert_eq!(a.namespace(1).unwrap().unplaced_writers(at, BLOCK), [a_id]);
    relay.resume();
    a.namespace(1).unwrap().place_writes().unwrap();
    assert!(nb.unplaced_writers(at, BLOCK).is_empty());
    assert!(nb.write_durable(at, &[2; BLOCK]).unwrap().is_durable());
    let mut got = vec![0u8; BLOCK];
    a.namespace(1).unwrap().read_at(at, &mut got).unwrap();
    assert!(
        got == [2; BLOCK],
        "A's older write landed over B's newer one"
    );
    // A writes the next block and loses its link: the re-issued write is on its way again.
    let mut na = a.namespace(1).unwrap();
    na.write_at(at + BLOCK as u64, &[3; BLOCK]).unwrap();
    na.place_writes().unwrap();
    assert!(nb.unplaced_writers(at + BLOCK as u64, BLOCK).is_empty());
    assert!(relay.inject_one(Fault::Reset, 0), "A's link");
    while a.reconnects() == 0 {
        a.tick().unwrap();
    }
    assert_eq!(nb.unplaced_writers(at + BLOCK as u64, BLOCK), [a_id]);
    assert!(nb.unplaced_writers(at, BLOCK).is_empty(), "B's block");
    a.namespace(1).unwrap().place_writes().unwrap();
    assert!(nb.unplaced_writers(at + BLOCK as u64, BLOCK).is_empty());
    // A started Read answered places every write posted before it.
    let mut na = a.namespace(1).unwrap();
    let next = at + 2 * BLOCK as u64;
    na.write_at(next, &[4; BLOCK]).unwrap();
    assert_eq!(nb.unplaced_writers(next, BLOCK), [a_id]);
    let ticket = na.start_read(next, BLOCK).unwrap();
    let mut done = Vec::new();
    while done.is_empty() {
        na.wait_started(&mut done).unwrap();
    }
    assert_eq!(done, [rpma_initiator::Completed::Read(ticket)]);
    assert!(nb.unplaced_writers(next, BLOCK).is_empty());
}

/// A queue asked to learn its placement (another queue's caller waits for its writes) sends a
/// probe the next time its owner polls, not after its next 16 requests: its one write is known
/// placed once the echo came, without a placement Read.
#[test]
fn a_queue_asked_learns_its_placement_at_its_next_poll() {
    let d = scratch();
    let (_t, relay, mut a, mut b) = a_write_held_in_its_link(d.path());
    let (at, a_id) = (COUNTERS, a.order_id());
    let mut nb = b.namespace(1).unwrap();
    let held = relay.waiting_from_client(0);
    nb.want_placed(&[a_id]);
    a.tick().unwrap();
    // The probe goes behind A's write, into the stalled link.
    let deadline = Instant::now() + Duration::from_secs(30);
    while relay.waiting_from_client(0) <= held {
        assert!(Instant::now() < deadline, "no probe after the ask");
        std::thread::sleep(Duration::from_millis(1));
    }
    relay.resume();
    while !nb.unplaced_writers(at, BLOCK).is_empty() {
        assert!(
            Instant::now() < deadline,
            "A never learned its write placed"
        );
        a.tick().unwrap();
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(nb.write_durable(at, &[2; BLOCK]).unwrap().is_durable());
    let mut got = vec![0u8; BLOCK];
    a.namespace(1).unwrap().read_at(at, &mut got).unwrap();
    assert!(got == [2; BLOCK], "A's older write landed over B's");
}

/// A queue holding more writes than its send queue takes (512 slots; a send queue takes 256)
/// loses its link after writes that never reached the target (swallowed on the way). Its
/// re-issue puts every one of them in place: they go out in batches, each once the one before
/// completed. (Posted at once they were refused, and the slots of the refused post were freed:
/// the reconnect failed every attempt and gave up.)
#[test]
fn a_queue_holding_more_writes_than_its_send_queue_reissues_them_all() {
    let d = scratch();
    let t = start(d.path(), 20, "");
    let relay = Relay::start(&format!("127.0.0.1:{}", t.port()));
    let c = conn(&relay.url(), Duration::from_secs(5)).with_queue_options(QueueOptions {
        depth: 8,
        chunk: BLOCK,
        replay_bytes: 512 * BLOCK,
        reconnect: ReconnectPolicy::within(RECONNECT_BUDGET),
        ..QueueOptions::default()
    });
    let mut q = c.open_queue(0).unwrap();
    let n = 400u64;
    relay.swallow();
    for i in 0..n {
        let b = block(9, i, 1, BLOCK);
        q.namespace(1)
            .unwrap()
            .write_at(COUNTERS + i * BLOCK as u64, &b)
            .unwrap();
    }
    relay.reset();
    let mut got = vec![0u8; BLOCK];
    for i in 0..n {
        q.namespace(1)
            .unwrap()
            .read_at(COUNTERS + i * BLOCK as u64, &mut got)
            .unwrap();
        assert_eq!(parse_block(&got), Some((9, i, 1)), "block {i}");
    }
    assert_eq!(q.reconnects(), 1);
    assert!(persisted(&mut q));
}

/// A reconnect attempt that breaks while it re-issues (its first batch of Writes posted, the
/// link reset under it) leaves the next attempt everything to re-issue: the Writes of that
/// batch are held again, not left in flight on a connection that is gone. (They were left in
/// flight: every later attempt waited for their completions until it timed out, and the queue
/// gave up, dropping all 300 writes.)
#[test]
fn a_reconnect_attempt_broken_while_it_reissues_leaves_the_writes_to_the_next() {
    let d = scratch();
    let t = start(d.path(), 20, "");
    let relay = Relay::start(&format!("127.0.0.1:{}", t.port()));
    let c = conn(&relay.url(), Duration::from_secs(5)).with_queue_options(QueueOptions {
        depth: 8,
        chunk: BLOCK,
        replay_bytes: 512 * BLOCK,
        reconnect: ReconnectPolicy::within(RECONNECT_BUDGET),
        ..QueueOptions::default()
    });
    let mut q = c.open_queue(0).unwrap();
    // More than one re-issue batch (128 Writes), none of them on the target.
    let n = 300u64;
    relay.swallow();
    for i in 0..n {
        let b = block(7, i, 1, BLOCK);
        q.namespace(1)
            .unwrap()
            .write_at(COUNTERS + i * BLOCK as u64, &b)
            .unwrap();
    }
    // The first attempt's link is reset 64 KiB in: after its handshake, inside the first
    // batch of re-issued Writes (about 520 KiB).
    relay.arm_next(Fault::ResetAfter(64 << 10));
    relay.reset();
    let mut got = vec![0u8; BLOCK];
    for i in 0..n {
        q.namespace(1)
            .unwrap()
            .read_at(COUNTERS + i * BLOCK as u64, &mut got)
            .unwrap();
        assert_eq!(parse_block(&got), Some((7, i, 1)), "block {i}");
    }
    // (A loaded machine may lose a later link to a time-out too: at least one reconnect.)
    assert!(q.reconnects() >= 1);
    assert!(relay.counts().resets >= 2, "{:?}", relay.counts());
    assert!(persisted(&mut q));
}

/// A held write whose bytes another queue of the connection rewrote in many small places since
/// is re-issued in more pieces than a send queue takes (301 here; a send queue takes 256): they
/// go out a batch at a time, and every byte ends up as the newest write left it. (Posted as one
/// list they were refused, every reconnect attempt failed the same way, and the queue gave up
/// with its writes.)
#[test]
fn a_held_write_in_more_pieces_than_a_send_queue_takes_is_reissued() {
    let d = scratch();
    let t = start(d.path(), 20, "");
    let relay = Relay::start(&format!("127.0.0.1:{}", t.port()));
    let c = conn(&relay.url(), Duration::from_secs(5)).with_queue_options(QueueOptions {
        depth: 8,
        chunk: 256 << 10,
        reconnect: ReconnectPolicy::within(RECONNECT_BUDGET),
        ..QueueOptions::default()
    });
    let mut a = c.open_queue(0).unwrap();
    let mut b = c.open_queue(1).unwrap();
    assert_eq!(relay.live(), 2);
    let at = COUNTERS;
    let mut want = rpma_tests::noise(31, 256 << 10);
    a.namespace(1).unwrap().write_at(at, &want).unwrap();
    // Placed before B writes (a Write completes when TCP took it: across queues, a later one
    // may land first unless the earlier is placed), and still held: not durable.
    a.namespace(1).unwrap().place_writes().unwrap();
    // 300 single bytes of it rewritten through B, newer than A's write, which A still holds.
    for k in 0..300u64 {
        let off = 1 + k * 800;
        want[off as usize] = !want[off as usize];
        b.namespace(1)
            .unwrap()
            .write_at(at + off, &want[off as usize..off as usize + 1])
            .unwrap();
    }
    assert!(persisted(&mut b));
    // A's link is reset: its next call reconnects and re-issues its write, around B's bytes.
    assert!(relay.inject_one(Fault::Reset, 0));
    let mut got = vec![0u8; want.len()];
    a.namespace(1).unwrap().read_at(at, &mut got).unwrap();
    assert!(a.reconnects() >= 1);
    assert!(persisted(&mut a));
    b.namespace(1).unwrap().read_at(at, &mut got).unwrap();
    let wrong = got.iter().zip(&want).filter(|(g, w)| g != w).count();
    assert_eq!(wrong, 0, "bytes not as the newest write left them");
}

/// Faults at chosen points of the handshake (a reset after n bytes of MPA and Connect, a stall
/// longer than the time-out, a cut at once), on a fresh queue and on a queue's reconnect: each
/// attempt fails or succeeds within its deadline, the next one succeeds, and the target keeps
/// nothing of the broken attempts.
#[test]
fn faults_during_the_handshake_leave_nothing_behind() {
    let mut rng = Rng::for_test("handshake faults");
    let d = scratch();
    let t = start(d.path(), 2, "");
    let relay = Relay::start(&format!("127.0.0.1:{}", t.port()));
    let base = baseline(&t, &relay.url());
    let c = conn(&relay.url(), Duration::from_secs(1));
    // A host sends about 200 bytes before its ConnectResponse (MPA Request, Connect): most
    // resets fall inside the handshake, some in the first write after it.
    let mut faults: Vec<Fault> = (0..stress::pick(12, 80))
        .map(|i| Fault::ResetAfter(rng.below(if i % 4 == 3 { 2000 } else { 200 })))
        .collect();
    faults.extend([
        Fault::Cut,
        Fault::Reset,
        Fault::ResetAfter(0),
        Fault::Stall(Duration::from_millis(1500)),
    ]);
    let mut q = c.open_queue(0).unwrap();
    let mut opened = 0;
    for (i, f) in faults.iter().enumerate() {
        // A fresh queue whose first connection meets the fault (open_queue retries a first
        // connection that failed: the fault is armed for one connection only).
        relay.arm_next(*f);
        let started = Instant::now();
        match c.open_queue(1) {
            Ok(q1) => {
                opened += 1;
                q1.close().unwrap();
            }
            Err(e) => assert!(
                e.is_connection_loss() || matches!(e, Error::Connect { .. }),
                "{f:?}: {e}"
            ),
        }
        // Bounded as every call is (a loaded machine's handshakes may need retries).
        assert!(started.elapsed() < CALL_BOUND, "{f:?}: too slow");
        // A queue whose reconnect meets it: the call still succeeds.
        relay.arm_next(*f);
        relay.cut();
        let v = block(9, i as u64, i as u64 + 1, BLOCK);
        let started = Instant::now();
        let mut ns = q.namespace(1).unwrap();
        assert!(
            ns.write_durable(COUNTERS, &v).unwrap().is_durable(),
            "{f:?}"
        );
        assert!(started.elapsed() < CALL_BOUND, "{f:?}: too slow");
        let mut got = vec![0u8; BLOCK];
        ns.read_at(COUNTERS, &mut got).unwrap();
        assert!(got == v, "{f:?}");
    }
    stress::figures(
        "handshake-faults",
        &[
            ("seed", rng.seed().to_string()),
            ("faults_on_fresh_queues", faults.len().to_string()),
            ("fresh_queues_opened_anyway", opened.to_string()),
            ("faults_on_reconnects", faults.len().to_string()),
            ("reconnects", q.reconnects().to_string()),
        ],
    );
    q.close().unwrap();
    drop(relay);
    Footprint::wait_back_to(&t, &base, CLEANUP_WITHIN);
}

/// Moves the calling thread into a network namespace of its own (unshare(2) acts on the
/// calling thread: the rest of the test binary stays where it was) with lo up, and checks that
/// iptables works there. What the thread starts afterwards (threads, the target, iptables)
/// shares the namespace. Err: why not, for the skip message.
fn enter_fresh_netns() -> Result<(), String> {
    // SAFETY: unshare(2) takes no pointers; CLONE_NEWNET changes only the calling thread's
    // network namespace, which no other thread of this process relies on.
    if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
        return Err(format!(
            "unshare(CLONE_NEWNET): {} (needs root / CAP_SYS_ADMIN)",
            std::io::Error::last_os_error()
        ));
    }
    run_tool("ip", &["link", "set", "lo", "up"])?;
    run_tool("iptables", &["-w", "5", "-L", "INPUT", "-n"])
        .map_err(|e| format!("{e} (scripts/install-deps.sh installs iptables)"))?;
    Ok(())
}

/// `iptables -w 5 ACTION INPUT -i lo -p tcp --PORT_SIDE port MATCH -j DROP`, which must work.
fn drop_rule(action: &str, side: &str, port: u16, matching: &[&str]) {
    let port = port.to_string();
    let mut args = vec![
        "-w", "5", action, "INPUT", "-i", "lo", "-p", "tcp", side, &port,
    ];
    args.extend_from_slice(matching);
    args.extend(["-j", "DROP"]);
    run_tool("iptables", &args).unwrap();
}

/// Real packets lost: in a network namespace of the test's own, iptables drops a share of the
/// target's packets on lo both ways (the kernel's TCP retransmits them) and, at random
/// moments, all of them for up to 4 s (a blackout longer than the time-out: the queues give
/// their connections up while the packets still in flight retransmit late). Same checks as
/// through the relay. The drop share is the kernel's randomness, not the seed's.
#[test]
fn real_packet_loss_and_a_blackout_in_a_network_namespace() {
    let h = std::thread::spawn(|| {
        if let Err(why) = enter_fresh_netns() {
            eprintln!("SKIP real_packet_loss_and_a_blackout_in_a_network_namespace: {why}");
            return;
        }
        let mut rng = Rng::for_test("packet loss");
        let seed = rng.seed();
        let workers = stress::pick(3, 6);
        let run = stress::pick(Duration::from_secs(8), Duration::from_secs(120));
        let d = scratch();
        let t = start(d.path(), workers, "");
        let port = t.port();
        let base = baseline(&t, &t.url());
        let loss = [
            "-m",
            "statistic",
            "--mode",
            "random",
            "--probability",
            "0.03",
        ];
        let blackouts = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let b = Arc::clone(&blackouts);
        let outcomes = run_workers(&t.url(), workers, run, &mut rng, move |mut r, stop| {
            // The loss starts once the queues are open, as every fault here.
            for side in ["--dport", "--sport"] {
                drop_rule("-A", side, port, &loss);
            }
            std::thread::spawn(move || {
                for _ in 0..1000 {
                    std::thread::sleep(
                        r.duration(Duration::from_millis(500), Duration::from_millis(3000)),
                    );
                    if stop.load(Ordering::Relaxed) {
                        return;
                    }
                    for side in ["--dport", "--sport"] {
                        drop_rule("-I", side, port, &[]);
                    }
                    b.fetch_add(1, Ordering::Relaxed);
                    std::thread::sleep(
                        r.duration(Duration::from_millis(300), Duration::from_millis(4000)),
                    );
                    for side in ["--dport", "--sport"] {
                        drop_rule("-D", side, port, &[]);
                    }
                }
            })
        });
        for side in ["--dport", "--sport"] {
            drop_rule("-D", side, port, &loss);
        }
        let checked = verify(&t, &outcomes);
        let cleanup = Footprint::wait_back_to(&t, &base, CLEANUP_WITHIN);
        report(
            "packet-loss",
            seed,
            &outcomes,
            checked,
            &[
                ("drop_percent", 3),
                ("blackouts", blackouts.load(Ordering::Relaxed)),
            ],
            cleanup,
        );
    });
    if let Err(p) = h.join() {
        std::panic::resume_unwind(p);
    }
}

/// A host that vanishes (its side reset, the target's side left open and silent) costs the
/// target nothing for long: the target expires the session on its keep-alive, revokes its
/// rkeys and closes the connection, with the relay still holding its side open; the host's
/// queue reconnects and its held write is re-issued.
#[test]
fn a_vanished_host_is_expired_by_the_target() {
    let d = scratch();
    let t = start(d.path(), 2, "");
    let relay = Relay::start(&format!("127.0.0.1:{}", t.port()));
    let base = baseline(&t, &relay.url());
    let c = conn(&relay.url(), Duration::from_secs(2)).with_connect_options(ConnectOptions {
        timeout: Duration::from_secs(2),
        keep_alive: Duration::from_millis(500),
        ..ConnectOptions::default()
    });
    let mut q = c.open_queue(0).unwrap();
    let v = block(5, 0, 1, BLOCK);
    q.namespace(1).unwrap().write_at(COUNTERS, &v).unwrap();
    assert!(relay.inject_one(Fault::Orphan, 0));
    let orphaned = Instant::now();
    // The target holds the session until its keep-alive lapses (it hears nothing more): seen
    // when the status call came back within the keep-alive (on a loaded machine it may not;
    // the lapse's log line below shows the hold either way).
    let held = Footprint::of(&t).sessions;
    if orphaned.elapsed() < Duration::from_millis(500) {
        assert_eq!(held, 1);
    }
    assert!(q
        .namespace(1)
        .unwrap()
        .persist_written(COUNTERS, BLOCK as u64)
        .unwrap()
        .is_durable());
    assert_eq!(q.reconnects(), 1);
    q.close().unwrap();
    Footprint::wait_back_to(&t, &base, CLEANUP_WITHIN);
    let back_after = orphaned.elapsed();
    let lines = t.log_lines(
        &["ctrl 2", "lapsed; its rkeys are revoked"],
        Duration::from_secs(1),
    );
    assert_eq!(lines.len(), 1, "{}", t.log());
    stress::figures(
        "vanished-host",
        &[
            ("keep_alive_ms", "500".to_owned()),
            ("back_to_baseline_ms", back_after.as_millis().to_string()),
        ],
    );
    let file = std::fs::read(t.dir().join("ns1")).unwrap();
    assert!(file[4096..8192] == v[..], "the held write was re-issued");
    drop(relay);
}

/// Whether `q`'s persist of its own writes of nsid 1 says durable (panics on an error).
fn persisted(q: &mut rpma_initiator::Queue) -> bool {
    q.namespace(1)
        .unwrap()
        .persist_own_writes()
        .unwrap()
        .is_durable()
}
