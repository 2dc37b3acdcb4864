//! The crash-consistency harness (issue 14, part 2; docs/reliability.md), behind the
//! `rpma-crash` binary and tests/tests/crash_consistency.rs.
//!
//! A real `rpma-target` serves one namespace per medium under the power-loss simulation: a
//! file on the build directory's disk (`page-cache`) and a /dev/shm file with `force_dax`
//! (`dax (forced)`). Each cycle: writers (one per namespace and method, each on a block range
//! of its own: [`writer`]) issue durable writes of self-describing blocks ([`block`]) and log
//! every acknowledgement; after a random time the target is killed (SIGKILL: the power loss),
//! restarted on the same configuration (with the next eviction seed), and every block of every
//! namespace is read back through the initiator library and judged by the ledger: each block
//! acknowledged must hold its acknowledged generation or a later one. Blocks torn by writes
//! that were never acknowledged are allowed and counted.

pub mod block;
pub mod writer;

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rpma_initiator::{ConnectOptions, Connection};

use crate::nbd::{Export, HOST, SUB};
use crate::{Config, Namespace, Shm, Subsystem, Target};
use block::{Ledger, Tally, Verdict, BLOCK};
pub use writer::Method;

/// Where a namespace lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Medium {
    /// A file on a disk: the `page-cache` domain.
    PageCache,
    /// A /dev/shm file with `force_dax`: the `dax (forced)` domain.
    Dax,
}

impl Medium {
    /// Both.
    pub const ALL: [Medium; 2] = [Medium::PageCache, Medium::Dax];

    /// "page-cache" or "dax".
    pub fn name(self) -> &'static str {
        match self {
            Medium::PageCache => "page-cache",
            Medium::Dax => "dax",
        }
    }

    /// The medium named `s`.
    pub fn parse(s: &str) -> Option<Medium> {
        Medium::ALL.into_iter().find(|m| m.name() == s)
    }

    /// Whether the target offers `method` on this medium: everything but APM on page-cache,
    /// where a Read response only orders the Writes before it (docs/fabric.md, "The
    /// durability contract"); a forced APM there is refused before anything is written, so
    /// there is no writer for it.
    pub fn offers(self, method: Method) -> bool {
        !(self == Medium::PageCache && method == Method::Apm)
    }
}

/// A run's settings.
#[derive(Debug, Clone)]
pub struct Options {
    /// Kill-and-restart cycles.
    pub cycles: u32,
    /// Seeds everything random: kill times, blocks, the simulation's eviction.
    pub seed: u64,
    /// The writers run for a time drawn from this range (ms) before the kill.
    pub run_ms: (u64, u64),
    /// The simulation's eviction chance (percent).
    pub eviction_percent: u8,
    /// The simulation's eviction timer (ms; 0: evict only at persists).
    pub eviction_interval_ms: u32,
    /// Fault injection: the target's persists do nothing and still answer durable. A run with
    /// it must find losses.
    pub broken_persist: bool,
    /// The methods to write with.
    pub methods: Vec<Method>,
    /// The media to write to.
    pub media: Vec<Medium>,
    /// Blocks of each writer's range.
    pub blocks_per_writer: usize,
    /// Keep the run's directory (config, logs, acks.log) even when it passes.
    pub keep: bool,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            cycles: 3,
            seed: 1,
            run_ms: (30, 300),
            eviction_percent: 50,
            eviction_interval_ms: 1,
            broken_persist: false,
            methods: Method::ALL.to_vec(),
            media: Medium::ALL.to_vec(),
            blocks_per_writer: 32,
            keep: false,
        }
    }
}

/// What a run found.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Report {
    /// The seed it ran with.
    pub seed: u64,
    /// Cycles run.
    pub cycles: u32,
    /// SIGKILLs of the target.
    pub kills: u32,
    /// The media written to.
    pub media: Vec<&'static str>,
    /// The methods written with.
    pub methods: Vec<&'static str>,
    /// The simulation's eviction chance.
    pub eviction_percent: u8,
    /// The simulation's eviction timer (ms).
    pub eviction_interval_ms: u32,
    /// Whether persist was broken on purpose.
    pub broken_persist: bool,
    /// Durable writes acknowledged (and logged).
    pub acknowledged: u64,
    /// Acknowledgements by "MEDIUM METHOD".
    pub acknowledged_by: BTreeMap<String, u64>,
    /// The checks' counts: acknowledged blocks checked, lost, torn unacknowledged, corrupt.
    #[serde(flatten)]
    pub tally: Tally,
    /// The same, by medium.
    pub tally_by_medium: BTreeMap<&'static str, Tally>,
    /// Writers that failed before the target was killed (should be none).
    pub writer_errors_before_kill: u64,
    /// Wall time of the run.
    pub seconds: f64,
    /// The first problems, in words.
    pub problems: Vec<String>,
    /// The run's directory, when kept.
    pub dir: Option<PathBuf>,
}

impl Report {
    /// No acknowledged write lost, nothing corrupt.
    pub fn passed(&self) -> bool {
        self.tally.lost == 0 && self.tally.corrupt == 0
    }

    /// Why the run proves less than it claims, if it does: a writer failed before any kill,
    /// or a (medium, method) got no acknowledgement at all.
    pub fn hollow(&self) -> Option<String> {
        if self.writer_errors_before_kill > 0 {
            return Some(format!(
                "{} writer(s) failed before the target was killed",
                self.writer_errors_before_kill
            ));
        }
        let none: Vec<&String> = self
            .acknowledged_by
            .iter()
            .filter(|(_, &n)| n == 0)
            .map(|(k, _)| k)
            .collect();
        (!none.is_empty()).then(|| {
            let names: Vec<&str> = none.iter().map(|s| s.as_str()).collect();
            format!("no acknowledged write through {}", names.join(", "))
        })
    }

    /// The figures in words.
    pub fn summary(&self) -> String {
        let by: Vec<String> = self
            .acknowledged_by
            .iter()
            .map(|(k, n)| format!("{k} {n}"))
            .collect();
        let per = |f: fn(&Tally) -> u64| {
            let v: Vec<String> = self
                .tally_by_medium
                .iter()
                .map(|(m, t)| format!("{m} {}", f(t)))
                .collect();
            v.join(", ")
        };
        let verdict = match (self.passed(), self.hollow()) {
            (false, _) => "FAIL: acknowledged writes lost".to_owned(),
            (true, Some(h)) => format!("INCONCLUSIVE: {h}"),
            (true, None) => "PASS".to_owned(),
        };
        format!(
            "crash consistency: seed {}, media {}, methods {}, eviction {} % (at persists and \
             every {} ms){}\n\
             cycles: {}, kills (SIGKILL of the target): {}\n\
             acknowledged durable writes: {} ({})\n\
             acknowledged blocks checked after restarts: {} ({})\n\
             lost: {} ({})\n\
             torn unacknowledged blocks: {} ({})\n\
             corrupt: {} ({})\n\
             time: {:.1} s\n\
             result: {verdict}",
            self.seed,
            self.media.join(", "),
            self.methods.join(", "),
            self.eviction_percent,
            self.eviction_interval_ms,
            if self.broken_persist {
                ", persist BROKEN on purpose"
            } else {
                ""
            },
            self.cycles,
            self.kills,
            self.acknowledged,
            by.join(", "),
            self.tally.acknowledged_checked,
            per(|t| t.acknowledged_checked),
            self.tally.lost,
            per(|t| t.lost),
            self.tally.torn_unacknowledged,
            per(|t| t.torn_unacknowledged),
            self.tally.corrupt,
            per(|t| t.corrupt),
            self.seconds,
        )
    }
}

/// One namespace of the run.
struct Ns {
    nsid: u32,
    medium: Medium,
    ledger: Arc<Mutex<Ledger>>,
}

fn config(o: &Options, shm: &Shm, blocks: usize, seed: u64) -> String {
    let sim = format!(
        "seed = {}, eviction_percent = {}, eviction_interval_ms = {}, broken_persist = {}",
        seed & (i64::MAX as u64),
        o.eviction_percent,
        o.eviction_interval_ms,
        o.broken_persist
    );
    let size = format!("{}", blocks * BLOCK);
    let namespaces = o.media.iter().enumerate().map(|(i, m)| {
        let nsid = i as u32 + 1;
        let ns = match m {
            Medium::PageCache => Namespace::new(nsid, "page-cache.ns", &size),
            Medium::Dax => Namespace::new(nsid, shm.path(), &size).force_dax(),
        };
        ns.power_loss_simulation(&sim)
    });
    // Two poll loops: on page-cache, FLUSH msyncs inline in its loop and stalls the
    // loop's other connections meanwhile (docs/architecture.md), which starves the NBD writers
    // when every writer shares one loop.
    Config::new()
        .set("poll_loops = 2")
        .subsystem(Subsystem::new(SUB).any_host().namespaces(namespaces))
        .to_string()
}

/// Reads every block of `ns` back through the library and judges it.
fn verify(t: &Target, ns: &Ns, blocks: usize, report: &mut Report) {
    let mut q = Connection::new(&t.url(), crate::nqn(SUB), crate::host(HOST))
        .with_connect_options(ConnectOptions {
            timeout: Duration::from_secs(10),
            ..ConnectOptions::default()
        })
        .open_queue(0)
        .expect("connect to the restarted target to check");
    let mut data = vec![0u8; blocks * BLOCK];
    q.namespace(ns.nsid)
        .and_then(|mut n| n.read_at(0, &mut data))
        .expect("read the namespace back");
    let _ = q.close();
    let (tally, bad) = ns
        .ledger
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .check_all(&data);
    report.tally.add(&tally);
    report
        .tally_by_medium
        .entry(ns.medium.name())
        .or_default()
        .add(&tally);
    for (block, verdict, content) in bad {
        if report.problems.len() < 20 {
            let what = match verdict {
                Verdict::Lost => "LOST",
                _ => "CORRUPT",
            };
            report.problems.push(format!(
                "cycle {}: {} block {block}: {what}: found {content:?}",
                report.cycles,
                ns.medium.name()
            ));
        }
    }
}

/// Runs the harness; `progress` gets a line per cycle.
///
/// # Panics
/// When the target or an NBD export cannot be started, or the restarted target cannot be
/// read: the harness itself failed, which is not a verdict on durability.
pub fn run(o: &Options, mut progress: impl FnMut(&str)) -> Report {
    let start = Instant::now();
    let scratch = crate::scratch();
    let shm = Shm::new(&format!("crash-{}", o.seed));
    let writers = o.methods.len();
    // Blocks past the writers' ranges are never written: they must stay zero.
    let blocks = writers * o.blocks_per_writer + 16;
    let namespaces: Vec<Ns> = o
        .media
        .iter()
        .enumerate()
        .map(|(i, &medium)| Ns {
            nsid: i as u32 + 1,
            medium,
            ledger: Arc::new(Mutex::new(Ledger::new(blocks))),
        })
        .collect();
    let mut report = Report {
        seed: o.seed,
        media: o.media.iter().map(|m| m.name()).collect(),
        methods: o.methods.iter().map(|m| m.name()).collect(),
        eviction_percent: o.eviction_percent,
        eviction_interval_ms: o.eviction_interval_ms,
        broken_persist: o.broken_persist,
        ..Report::default()
    };
    for ns in &namespaces {
        for m in o.methods.iter().filter(|&&m| ns.medium.offers(m)) {
            report
                .acknowledged_by
                .insert(format!("{} {}", ns.medium.name(), m.name()), 0);
        }
    }
    let mut acks_log = std::io::BufWriter::new(
        std::fs::File::create(scratch.path().join("acks.log")).expect("create acks.log"),
    );
    let mut rng = o.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    // No direct_write_to_pmem on rdma: see rpma-crash's docs.
    let listen = crate::Transport::current().listen();
    let mut t = Target::start_on(
        scratch.path(),
        &listen,
        &config(o, &shm, blocks, o.seed),
        &[],
    );
    for ns in &namespaces {
        verify(&t, ns, blocks, &mut report);
    }
    for c in 0..o.cycles {
        let exports: Vec<Option<Export>> = namespaces
            .iter()
            .map(|ns| {
                o.methods.iter().any(|m| m.is_nbd()).then(|| {
                    Export::start(
                        &t,
                        ns.nsid,
                        &format!("nbd{}-{c}", ns.nsid),
                        &["--reconnect-timeout", "0"],
                    )
                })
            })
            .collect();
        let stop = Arc::new(AtomicBool::new(false));
        let killed = Arc::new(AtomicBool::new(false));
        let ready = Arc::new(AtomicUsize::new(0));
        let mut threads = Vec::new();
        for (ni, ns) in namespaces.iter().enumerate() {
            for (wi, &method) in o.methods.iter().enumerate() {
                if !ns.medium.offers(method) {
                    continue;
                }
                let id = (ni * 16 + wi) as u32;
                let spec = writer::Spec {
                    id,
                    method,
                    nsid: ns.nsid,
                    first: wi * o.blocks_per_writer,
                    count: o.blocks_per_writer,
                    seed: o.seed ^ (u64::from(c) << 32) ^ u64::from(id),
                    url: t.url(),
                    socket: exports[ni].as_ref().map(|e| e.sock.clone()),
                };
                let sh = writer::Shared {
                    ledger: ns.ledger.clone(),
                    stop: stop.clone(),
                    killed: killed.clone(),
                    ready: ready.clone(),
                };
                threads.push((ns.medium, writer::spawn(spec, sh)));
            }
        }
        // The kill's moment counts from when every writer has had a write acknowledged (or
        // ended without one: it is reported, having failed before the kill), not from a time
        // that a slow machine may not have written anything by.
        let connected = Instant::now() + Duration::from_secs(120);
        while ready.load(Ordering::SeqCst) < threads.len() && Instant::now() < connected {
            std::thread::sleep(Duration::from_millis(1));
        }
        let (lo, hi) = o.run_ms;
        std::thread::sleep(Duration::from_millis(lo + next() % (hi - lo + 1)));
        // The power loss.
        killed.store(true, Ordering::SeqCst);
        t.kill9();
        report.kills += 1;
        stop.store(true, Ordering::SeqCst);
        let mut acks = 0;
        for (medium, th) in threads {
            let (spec, out) = th.join().expect("a writer thread panicked");
            for &(b, g) in &out.acks {
                let _ = writeln!(acks_log, "{c} {} {b} {g} {}", spec.nsid, spec.method.name());
            }
            acks += out.acks.len() as u64;
            *report
                .acknowledged_by
                .get_mut(&format!("{} {}", medium.name(), spec.method.name()))
                .expect("every writer is listed") += out.acks.len() as u64;
            if out.error_before_kill {
                report.writer_errors_before_kill += 1;
                if report.problems.len() < 20 {
                    report.problems.push(format!(
                        "cycle {c}: {} {} failed before the kill: {}",
                        medium.name(),
                        spec.method.name(),
                        out.error.unwrap_or_default()
                    ));
                }
            }
        }
        report.acknowledged += acks;
        for e in exports.into_iter().flatten() {
            let sock = e.sock.clone();
            drop(e);
            let _ = std::fs::remove_file(sock);
        }
        report.cycles = c + 1;
        t.rewrite(&config(
            o,
            &shm,
            blocks,
            o.seed.wrapping_add(u64::from(c) + 1),
        ));
        t.restart();
        let before = report.tally;
        for ns in &namespaces {
            verify(&t, ns, blocks, &mut report);
        }
        progress(&format!(
            "cycle {}/{}: {acks} acknowledged, {} acknowledged blocks checked, lost {}, torn \
             unacknowledged {}",
            c + 1,
            o.cycles,
            report.tally.acknowledged_checked - before.acknowledged_checked,
            report.tally.lost - before.lost,
            report.tally.torn_unacknowledged - before.torn_unacknowledged,
        ));
    }
    let _ = acks_log.flush();
    drop(t);
    report.seconds = start.elapsed().as_secs_f64();
    if o.keep || !report.passed() || report.hollow().is_some() {
        report.dir = Some(scratch.keep());
    }
    report
}
