//! Load (issue 14, part 5): 32 initiator connections at once (a thread each, with the library),
//! each doing a random mix of writes, durable writes with every method, batches, persists,
//! reads, compare-and-swap, fetch-and-add and Atomic Write against the real `rpma-target` for a
//! bounded time. Then:
//! - the target's memory and fds did not grow: VmRSS and RssAnon (/proc/PID/status) at the end
//!   are within [`RSS_SLACK_KIB`] + [`RSS_SLACK_PERCENT`] % of their value after the warm-up
//!   (which wrote every block once, so that every page of the namespaces is mapped by then,
//!   and put a message in each of the target's receive slots for the session, [`RECEIVE_SLOTS`]),
//!   and the fd count is exactly the same (the same 32 connections);
//! - every block holds its last write (read back directly and from the backing files), the
//!   shared counter holds every fetch_add, each worker's compare-and-swap word its count;
//! - after the connections close, the target's session table, regions, pools and fds are back
//!   to the baseline.
//!
//! Seeded (printed; `RPMA_RELIABILITY_SEED` replays the choices); `RPMA_RELIABILITY_LONG=1`
//! runs for minutes instead of seconds.

use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

use rpma_common::proto::nqn::Nqn;
use rpma_initiator::{
    ConnectOptions, Connection, HostIdentity, PersistMethod, QueueOptions, ReconnectPolicy,
};
use rpma_tests::stress::{self, block, memory, parse_block, Footprint, Memory, Rng};
use rpma_tests::{scratch, Config, Namespace, Subsystem, Target};

const SUB: &str = "nqn.2026-11.io.rpma:load";
const HOST: &str = "nqn.2026-11.io.rpma:load-host";
const CONNECTIONS: u64 = 32;
const BLOCK: usize = 4096;
/// Blocks of each connection's region.
const BLOCKS: u64 = 32;
/// nsid 1's first page: the shared counter (offset 0) and a compare-and-swap word per
/// connection (offset 8 + 8w); nsid 2's first page: an Atomic Write word per connection.
const WORDS: u64 = 4096;
/// Memory the target may gain between the end of the warm-up and the end of the run, in KiB,
/// on top of [`RSS_SLACK_PERCENT`]: allocator slack and the odd buffer grown to a new high.
const RSS_SLACK_KIB: u64 = 4 << 10;
/// The relative part of the memory tolerance.
const RSS_SLACK_PERCENT: u64 = 5;
/// The receive slots the target posts for a session: `max_queue_depth` (128 by default) + 4,
/// 8 KiB each (docs/operations.md, "Memory"), used in turn. A slot's pages count in the
/// target's RSS only once a message landed there, so a session that receives only keep-alives
/// (one per 2.5 s) grows its RSS by a page per keep-alive for minutes, up to that bound; the
/// warm-up sends each session a message per slot so that this does not read as a leak.
const RECEIVE_SLOTS: u64 = 128 + 4;
/// No call under load may take longer (a hang fails the test instead of blocking it).
const CALL_BOUND: Duration = Duration::from_secs(30);

fn start(dir: &std::path::Path) -> Target {
    let size = WORDS + CONNECTIONS.div_ceil(2) * BLOCKS * BLOCK as u64;
    let size = format!("{}KiB", size / 1024);
    // The 32 connections open at once from one address: past the default cap of 8
    // connections in their handshake per source (docs/control-plane.md, "Admission budgets").
    let config = Config::new()
        .set("max_unadmitted_per_source = 32")
        .subsystem(
            Subsystem::new(SUB)
                .any_host()
                .namespace(Namespace::new(1, "ns1", &size))
                .namespace(Namespace::new(2, "ns2", &size).force_dax()),
        );
    Target::start(dir, &config.to_string())
}

fn conn(url: &str) -> Connection {
    Connection::new(
        url,
        Nqn::new(SUB).unwrap(),
        HostIdentity::new(Nqn::new(HOST).unwrap()),
    )
    .with_connect_options(ConnectOptions {
        timeout: Duration::from_secs(10),
        // A worker waits at the gates for the slowest of 32 (seconds on a loaded machine)
        // and says nothing meanwhile (a queue has no thread of its own): its session must not
        // lapse there.
        keep_alive: Duration::from_secs(120),
        ..ConnectOptions::default()
    })
    .with_queue_options(QueueOptions {
        depth: 4,
        chunk: 16 << 10,
        reconnect: ReconnectPolicy::never(),
        ..QueueOptions::default()
    })
}

/// Connection `w`'s region: (nsid, first byte).
fn region(w: u64) -> (u32, u64) {
    (1 + (w % 2) as u32, WORDS + (w / 2) * BLOCKS * BLOCK as u64)
}

#[derive(Debug, Default)]
struct Outcome {
    worker: u64,
    /// Per block, the generation of its last write (every one durable by the end).
    latest: Vec<u64>,
    adds: u64,
    swaps: u64,
    /// The last value stored with Atomic Write.
    stored: u64,
    calls: stress::Calls,
    reads_checked: u64,
}

fn timed<T>(o: &mut Outcome, what: &str, call: impl FnOnce() -> T) -> T {
    let who = format_args!("connection {}", o.worker);
    o.calls.timed(CALL_BOUND, who, what, call)
}

/// Connection `w`: writes every block of its region durably (the warm-up), waits at `gate`,
/// runs random calls until `until`, makes everything durable, waits at `gate` twice more (the
/// end sample is taken between) and closes.
fn worker(c: &Connection, w: u64, mut rng: Rng, gate: &Barrier, run: Duration) -> Outcome {
    let (nsid, base) = region(w);
    let method = stress::method_for(w);
    let mut q = c.open_queue(w as u16 + 1).expect("open queue");
    let mut o = Outcome {
        worker: w,
        latest: vec![0; BLOCKS as usize],
        ..Outcome::default()
    };
    let at = |b: u64| base + b * BLOCK as u64;
    let cas_word = 8 + 8 * w;
    let store_word = 8 * w;
    let mut generation = 0;
    {
        let mut ns = q.namespace(nsid).unwrap();
        let method = stress::if_offered(&ns, method);
        ns.set_method(method).unwrap();
        for b in 0..BLOCKS {
            generation += 1;
            let d = block(w, b, generation, BLOCK);
            assert!(ns.write_durable(at(b), &d).unwrap().is_durable());
            o.latest[b as usize] = generation;
        }
        // One small message into each of the session's receive slots on the target (they are
        // used in turn): the pages they touch count in the target's RSS from then on.
        ns.set_method(Some(PersistMethod::Gpspm)).unwrap();
        for i in 0..RECEIVE_SLOTS {
            let b = i % BLOCKS;
            assert!(ns.persist(at(b), BLOCK as u64).unwrap().is_durable());
        }
        let method = stress::if_offered(&ns, method);
        ns.set_method(method).unwrap();
    }
    gate.wait();
    let until = Instant::now() + run;
    while Instant::now() < until {
        let b = rng.below(BLOCKS);
        let roll = rng.below(100);
        if roll < 20 {
            generation += 1;
            let d = block(w, b, generation, BLOCK);
            let mut ns = q.namespace(nsid).unwrap();
            let r = timed(&mut o, "write_durable", || ns.write_durable(at(b), &d));
            assert!(r.unwrap().is_durable());
            o.latest[b as usize] = generation;
        } else if roll < 35 {
            generation += 1;
            let d = block(w, b, generation, BLOCK);
            let mut ns = q.namespace(nsid).unwrap();
            timed(&mut o, "write_at", || ns.write_at(at(b), &d)).unwrap();
            o.latest[b as usize] = generation;
        } else if roll < 42 {
            let blocks: Vec<u64> = (0..rng.range(2, 6)).map(|_| rng.below(BLOCKS)).collect();
            let mut datas = Vec::new();
            for &b in &blocks {
                generation += 1;
                datas.push((b, block(w, b, generation, BLOCK)));
            }
            // Later items win where blocks repeat, as later writes do.
            let items: Vec<(u64, &[u8])> =
                datas.iter().map(|(b, d)| (at(*b), d.as_slice())).collect();
            let mut ns = q.namespace(nsid).unwrap();
            let r = timed(&mut o, "write_batch_durable", || {
                ns.write_batch_durable(&items)
            });
            assert!(r.unwrap().is_durable());
            for (b, d) in &datas {
                o.latest[*b as usize] = parse_block(d).unwrap().2;
            }
        } else if roll < 48 {
            let mut ns = q.namespace(nsid).unwrap();
            let r = if method == Some(PersistMethod::Apm) {
                timed(&mut o, "persist_own_writes", || ns.persist_own_writes())
            } else {
                timed(&mut o, "persist", || ns.persist(at(b), BLOCK as u64))
            };
            assert!(r.unwrap().is_durable());
        } else if roll < 75 {
            let mut got = vec![0u8; BLOCK];
            let mut ns = q.namespace(nsid).unwrap();
            timed(&mut o, "read_at", || ns.read_at(at(b), &mut got)).unwrap();
            assert_eq!(
                parse_block(&got),
                Some((w, b, o.latest[b as usize])),
                "connection {w} block {b}: a read saw another write than the last"
            );
            o.reads_checked += 1;
        } else if roll < 85 {
            let mut ns = q.namespace(1).unwrap();
            timed(&mut o, "fetch_add", || ns.fetch_add(0, 1)).unwrap();
            o.adds += 1;
        } else if roll < 93 {
            let mut ns = q.namespace(1).unwrap();
            let n = o.swaps;
            let before = timed(&mut o, "compare_and_swap", || {
                ns.compare_and_swap(cas_word, n, n + 1)
            });
            assert_eq!(before.unwrap(), o.swaps, "connection {w}: its own CAS word");
            o.swaps += 1;
        } else {
            let v = rng.next_u64() | 1;
            let mut ns = q.namespace(2).unwrap();
            timed(&mut o, "atomic_write", || ns.atomic_write(store_word, v)).unwrap();
            o.stored = v;
            let mut word = [0u8; 8];
            timed(&mut o, "read_at", || ns.read_at(store_word, &mut word)).unwrap();
            assert_eq!(
                u64::from_ne_bytes(word),
                v,
                "connection {w}: Atomic Write read back"
            );
        }
    }
    let mut ns = q.namespace(nsid).unwrap();
    assert!(ns.persist_own_writes().unwrap().is_durable());
    let mut ns2 = q.namespace(2).unwrap();
    if o.stored != 0 {
        assert!(ns2.persist_written(store_word, 8).unwrap().is_durable());
    }
    assert_eq!(
        q.reconnects(),
        0,
        "connection {w}: no faults, no reconnects"
    );
    gate.wait(); // the end sample
    gate.wait();
    q.close().unwrap();
    o
}

/// Whether `end` is within the tolerance of `warm`.
fn within_tolerance(warm: u64, end: u64) -> bool {
    end <= warm + RSS_SLACK_KIB + warm * RSS_SLACK_PERCENT / 100
}

#[test]
fn thirty_two_connections_of_mixed_calls_leave_memory_and_fds_flat() {
    let mut rng = Rng::for_test("load");
    let run = stress::pick(Duration::from_secs(10), Duration::from_secs(300));
    let d = scratch();
    let t = start(d.path());
    let c = conn(&t.url());
    // Baseline: after one session used every method on both namespaces and closed.
    {
        let mut q = c.open_queue(0).unwrap();
        for nsid in [1, 2] {
            let mut ns = q.namespace(nsid).unwrap();
            let domain = ns.descriptor().domain;
            for m in rpma_tests::Transport::current().methods(domain) {
                ns.set_method(Some(m)).unwrap();
                assert!(ns.write_durable(WORDS, &[0u8; 64]).unwrap().is_durable());
            }
        }
        q.close().unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    let base = loop {
        let f = Footprint::of(&t);
        if f.is_idle() {
            break f;
        }
        assert!(
            Instant::now() < deadline,
            "the warm-up session stays: {f:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let gate = Arc::new(Barrier::new(CONNECTIONS as usize + 1));
    let handles: Vec<_> = (0..CONNECTIONS)
        .map(|w| {
            let (c, r, g) = (c.clone(), rng.fork(w), Arc::clone(&gate));
            std::thread::spawn(move || worker(&c, w, r, &g, run))
        })
        .collect();
    // A worker that panics before a barrier would leave the others (and this thread) waiting
    // forever: watch for that instead of waiting blind.
    let waiter = {
        let g = Arc::clone(&gate);
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            g.wait();
            let _ = tx.send(());
        });
        rx
    };
    let wait_gate = |rx: &std::sync::mpsc::Receiver<()>, what: &str, within: Duration| {
        let deadline = Instant::now() + within;
        loop {
            if rx.recv_timeout(Duration::from_millis(100)).is_ok() {
                return;
            }
            assert!(
                !handles.iter().any(|h| h.is_finished()),
                "a connection ended early ({what}): see its panic"
            );
            assert!(
                Instant::now() < deadline,
                "{what} not reached within {within:?}"
            );
        }
    };
    wait_gate(&waiter, "the end of the warm-up", Duration::from_secs(120));
    let pid = t.pid();
    let warm = (memory(pid), stress::fd_count(pid));
    let sessions = Footprint::of(&t).sessions;
    assert_eq!(
        sessions, CONNECTIONS as usize,
        "every connection is a session"
    );
    // Samples through the run: memory must not climb (the long version makes a leak show).
    let samples: Arc<Mutex<Vec<(Memory, usize)>>> = Arc::default();
    let sampling = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let sampler = {
        let (s, on) = (Arc::clone(&samples), Arc::clone(&sampling));
        std::thread::spawn(move || {
            while on.load(std::sync::atomic::Ordering::Relaxed) {
                s.lock().unwrap().push((memory(pid), stress::fd_count(pid)));
                std::thread::sleep(Duration::from_millis(500));
            }
        })
    };
    let end_gate = {
        let g = Arc::clone(&gate);
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            g.wait();
            let _ = tx.send(());
        });
        rx
    };
    wait_gate(
        &end_gate,
        "the end of the run",
        run + Duration::from_secs(120),
    );
    sampling.store(false, std::sync::atomic::Ordering::Relaxed);
    sampler.join().unwrap();
    let end = (memory(pid), stress::fd_count(pid));
    let end_sessions = Footprint::of(&t).sessions;
    gate.wait(); // let them close
    let outcomes: Vec<Outcome> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let samples = samples.lock().unwrap().clone();
    let peak = samples.iter().map(|s| s.0.rss_kib).max().unwrap_or(0);
    eprintln!(
        "load: after warm-up VmRSS {} KiB, RssAnon {} KiB, {} fds; at the end VmRSS {} KiB, \
         RssAnon {} KiB, {} fds; peak VmRSS {peak} KiB over {} samples",
        warm.0.rss_kib,
        warm.0.anon_kib,
        warm.1,
        end.0.rss_kib,
        end.0.anon_kib,
        end.1,
        samples.len()
    );
    let step = (samples.len() / 12).max(1);
    let trend: Vec<String> = samples
        .iter()
        .step_by(step)
        .map(|s| format!("{}/{}", s.0.rss_kib, s.0.anon_kib))
        .collect();
    eprintln!(
        "load: VmRSS/RssAnon KiB through the run: {}",
        trend.join(" ")
    );
    assert_eq!(end_sessions, CONNECTIONS as usize);
    assert_eq!(
        end.1, warm.1,
        "the target's fds changed under a steady load"
    );
    assert!(
        samples.iter().all(|s| s.1 == warm.1),
        "the fd count moved during the run: {:?}",
        samples.iter().map(|s| s.1).collect::<Vec<_>>()
    );
    assert!(
        within_tolerance(warm.0.rss_kib, end.0.rss_kib),
        "VmRSS grew from {} to {} KiB",
        warm.0.rss_kib,
        end.0.rss_kib
    );
    assert!(
        within_tolerance(warm.0.anon_kib, end.0.anon_kib),
        "RssAnon grew from {} to {} KiB",
        warm.0.anon_kib,
        end.0.anon_kib
    );
    // Everything is there: through a fresh queue and in the backing files. That queue's first
    // connection may be retried, as a user's is by default: one run of the VM lab's suite
    // (two lanes, a loaded machine) saw it disconnected during its handshake over rdma right
    // after the 32 sessions ended; three quiet runs did not (not settled: docs/rdma.md). This
    // check is about the data, not about connecting.
    let mut q = conn(&t.url())
        .with_queue_options(QueueOptions {
            depth: 4,
            chunk: 16 << 10,
            reconnect: ReconnectPolicy::within(Duration::from_secs(30)),
            ..QueueOptions::default()
        })
        .open_queue(0)
        .unwrap();
    let files = [
        std::fs::read(t.dir().join("ns1")).unwrap(),
        std::fs::read(t.dir().join("ns2")).unwrap(),
    ];
    let mut checked = 0;
    for o in &outcomes {
        let (nsid, base) = region(o.worker);
        let mut ns = q.namespace(nsid).unwrap();
        for b in 0..BLOCKS {
            let off = base + b * BLOCK as u64;
            let want = Some((o.worker, b, o.latest[b as usize]));
            let mut got = vec![0u8; BLOCK];
            ns.read_at(off, &mut got).unwrap();
            assert_eq!(parse_block(&got), want, "connection {} block {b}", o.worker);
            let file = &files[nsid as usize - 1][off as usize..off as usize + BLOCK];
            assert_eq!(
                parse_block(file),
                want,
                "file: connection {} block {b}",
                o.worker
            );
            checked += 1;
        }
        let word = |f: &[u8], at: u64| {
            u64::from_ne_bytes(f[at as usize..at as usize + 8].try_into().unwrap())
        };
        assert_eq!(word(&files[0], 8 + 8 * o.worker), o.swaps, "CAS word");
        if o.stored != 0 {
            assert_eq!(word(&files[1], 8 * o.worker), o.stored, "Atomic Write word");
        }
    }
    let adds: u64 = outcomes.iter().map(|o| o.adds).sum();
    let mut counter = [0u8; 8];
    q.namespace(1).unwrap().read_at(0, &mut counter).unwrap();
    assert_eq!(u64::from_ne_bytes(counter), adds, "the shared counter");
    q.close().unwrap();
    let cleanup = Footprint::wait_back_to(&t, &base, Duration::from_secs(20));
    let sum = |f: fn(&Outcome) -> u64| outcomes.iter().map(f).sum::<u64>();
    let slowest = outcomes
        .iter()
        .map(|o| o.calls.slowest)
        .max()
        .unwrap_or_default();
    stress::figures(
        "load",
        &[
            (
                "mode",
                if stress::long() { "long" } else { "short" }.to_owned(),
            ),
            ("seed", rng.seed().to_string()),
            ("connections", CONNECTIONS.to_string()),
            ("run_s", run.as_secs().to_string()),
            ("calls", sum(|o| o.calls.count).to_string()),
            ("reads_checked", sum(|o| o.reads_checked).to_string()),
            ("blocks_verified", checked.to_string()),
            ("fetch_adds", adds.to_string()),
            ("compare_and_swaps", sum(|o| o.swaps).to_string()),
            ("slowest_call_ms", slowest.as_millis().to_string()),
            ("rss_warm_kib", warm.0.rss_kib.to_string()),
            ("rss_end_kib", end.0.rss_kib.to_string()),
            ("anon_warm_kib", warm.0.anon_kib.to_string()),
            ("anon_end_kib", end.0.anon_kib.to_string()),
            ("fds_warm", warm.1.to_string()),
            ("fds_end", end.1.to_string()),
            ("lost", "0".to_owned()),
            ("cleanup_ms", cleanup.as_millis().to_string()),
        ],
    );
}

rpma_tests::rdma_runs!(thirty_two_connections_of_mixed_calls_leave_memory_and_fds_flat,);
