//! What the link-fault and load tests share: the short/long switch, a seeded random source, the
//! target's footprint (sessions, registered regions, admission pools, fds, memory) and
//! self-describing blocks.
//!
//! - `RPMA_RELIABILITY_LONG=1` selects the long versions (minutes instead of seconds); `make
//!   test` runs the short ones.
//! - `RPMA_RELIABILITY_SEED=N` replays a run's fault and operation schedule (each test prints
//!   its seed). Threads still interleave as the scheduler likes: a seed fixes what each thread
//!   and the fault injector choose, not the exact order in which they meet.

use std::time::{Duration, Instant};

use crate::Target;

/// Whether the long versions were asked for (`RPMA_RELIABILITY_LONG` set to anything but
/// empty or `0`).
pub fn long() -> bool {
    std::env::var("RPMA_RELIABILITY_LONG").is_ok_and(|v| !v.is_empty() && v != "0")
}

/// Reports a test's figures: one line, `TEST: key=value ...`, on stderr and, when
/// `RPMA_RELIABILITY_FIGURES` names a file, appended to it (`make reliability` collects the
/// figures docs/reliability.md quotes this way).
pub fn figures(test: &str, pairs: &[(&str, String)]) {
    let kv: Vec<String> = pairs.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let line = format!("{test}: {}", kv.join(" "));
    eprintln!("{line}");
    if let Ok(path) = std::env::var("RPMA_RELIABILITY_FIGURES") {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .unwrap_or_else(|e| panic!("RPMA_RELIABILITY_FIGURES={path}: {e}"));
        writeln!(f, "{line}").unwrap_or_else(|e| panic!("RPMA_RELIABILITY_FIGURES={path}: {e}"));
    }
}

/// `short` normally, `long` under `RPMA_RELIABILITY_LONG=1`.
pub fn pick<T>(short: T, long: T) -> T {
    if self::long() {
        long
    } else {
        short
    }
}

/// A small seeded random source (splitmix64): the same seed, the same choices.
#[derive(Debug, Clone)]
pub struct Rng {
    state: u64,
    seed: u64,
}

impl Rng {
    /// A source for `test`: seeded from `RPMA_RELIABILITY_SEED`, else from the clock and the
    /// pid; prints the seed (and how to replay it) either way.
    pub fn for_test(test: &str) -> Rng {
        let seed = std::env::var("RPMA_RELIABILITY_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                let t = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap_or_default();
                (t.as_nanos() as u64) ^ (u64::from(std::process::id()) << 32)
            });
        eprintln!("{test}: seed {seed} (replay with RPMA_RELIABILITY_SEED={seed})");
        Rng::new(seed)
    }

    /// A source seeded with `seed`.
    pub fn new(seed: u64) -> Rng {
        Rng { state: seed, seed }
    }

    /// The seed it started from.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// An independent source derived from this one (for one thread of a test).
    pub fn fork(&mut self, n: u64) -> Rng {
        Rng::new(self.next_u64() ^ n.wrapping_mul(0xA076_1D64_78BD_642F))
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// Uniform in `lo..hi` (lo < hi).
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo)
    }

    /// True `percent` times in a hundred.
    pub fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }

    /// A duration uniform in `lo..hi`.
    pub fn duration(&mut self, lo: Duration, hi: Duration) -> Duration {
        Duration::from_micros(self.range(lo.as_micros() as u64, hi.as_micros() as u64))
    }
}

/// The durability method worker `w` forces, in turn: the queue's choice, GPSPM, FLUSH, APM.
pub fn method_for(w: u64) -> Option<rpma_initiator::PersistMethod> {
    use rpma_initiator::PersistMethod;
    [
        None,
        Some(PersistMethod::Gpspm),
        Some(PersistMethod::Flush),
        Some(PersistMethod::Apm),
    ][(w % 4) as usize]
}

/// `m` where the namespace's target offers it, else None (the queue's own choice): FLUSH is
/// offered on tcp only, APM on dax only (docs/rdma.md; docs/fabric.md for page-cache on tcp).
pub fn if_offered(
    ns: &rpma_initiator::Namespace<'_>,
    m: Option<rpma_initiator::PersistMethod>,
) -> Option<rpma_initiator::PersistMethod> {
    use rpma_common::proto::DurabilityMethods as D;
    use rpma_initiator::PersistMethod as P;
    let offered = ns.descriptor().durability;
    m.filter(|m| {
        offered.contains(match m {
            P::Apm => D::APM,
            P::Gpspm => D::GPSPM,
            P::Flush => D::FLUSH,
        })
    })
}

/// The calls of one worker: how many, and the slowest; each one bounded.
#[derive(Debug, Default, Clone, Copy)]
pub struct Calls {
    /// Calls made.
    pub count: u64,
    /// The slowest of them.
    pub slowest: Duration,
}

impl Calls {
    /// Runs `call`, failing the test if it outlasts `bound` (the message names `who`, e.g.
    /// "worker 3", and `what`).
    pub fn timed<T>(
        &mut self,
        bound: Duration,
        who: impl std::fmt::Display,
        what: &str,
        call: impl FnOnce() -> T,
    ) -> T {
        let t = Instant::now();
        let r = call();
        let took = t.elapsed();
        assert!(
            took <= bound,
            "{who}: {what} took {took:?} (bound {bound:?})"
        );
        self.slowest = self.slowest.max(took);
        self.count += 1;
        r
    }
}

/// Open file descriptors of process `pid` (entries of /proc/PID/fd).
pub fn fd_count(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

/// The open descriptors of process `pid`, each as what it points to (for a message when a
/// count differs).
pub fn fds(pid: u32) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter_map(|e| std::fs::read_link(e.path()).ok())
                .map(|p| p.display().to_string())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// Memory of a process, from /proc/PID/status, in KiB.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Memory {
    /// VmRSS: resident set, mapped namespace pages included.
    pub rss_kib: u64,
    /// RssAnon: the anonymous part (heap, stacks): what a leak grows.
    pub anon_kib: u64,
}

/// The memory of process `pid`.
pub fn memory(pid: u32) -> Memory {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        s.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or(0)
    };
    Memory {
        rss_kib: field("VmRSS:"),
        anon_kib: field("RssAnon:"),
    }
}

/// What a target holds for its connections: sessions, the regions registered for them (one
/// per namespace and session: its rkeys), the admission pools and its open descriptors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Footprint {
    /// Entries of `status --json`'s session table.
    pub sessions: usize,
    /// Per namespace (subsystem NQN, nsid): the sessions holding a region of it.
    pub regions: Vec<(String, u64, u64)>,
    /// Held in the unadmitted, discovery and sessions pools.
    pub pools: [u64; 3],
    /// Open file descriptors.
    pub fds: usize,
}

impl Footprint {
    /// The footprint of `t` now.
    pub fn of(t: &Target) -> Footprint {
        let v = t.status();
        let mut regions = Vec::new();
        for s in v["subsystems"].as_array().into_iter().flatten() {
            for n in s["namespaces"].as_array().into_iter().flatten() {
                regions.push((
                    s["nqn"].as_str().unwrap_or_default().to_owned(),
                    n["nsid"].as_u64().unwrap_or_default(),
                    n["counters"]["sessions"].as_u64().unwrap_or(u64::MAX),
                ));
            }
        }
        let pool = |p: &str| v["admission"][p]["held"].as_u64().unwrap_or(u64::MAX);
        Footprint {
            sessions: v["sessions"].as_array().map_or(usize::MAX, Vec::len),
            regions,
            pools: [pool("unadmitted"), pool("discovery"), pool("sessions")],
            fds: fd_count(t.pid()),
        }
    }

    /// Whether nothing is held for any connection (every count 0; the fds aside).
    pub fn is_idle(&self) -> bool {
        self.sessions == 0 && self.regions.iter().all(|r| r.2 == 0) && self.pools == [0; 3]
    }

    /// Whether this footprint is back to `baseline`: the same sessions, regions and pools, and
    /// no more descriptors (a leak grows them; fewer is a descriptor of the baseline's own
    /// moment closed since: over rdma, the warm-up connection's device files can outlive its
    /// session's status entry by a little).
    pub fn is_back_to(&self, baseline: &Footprint) -> bool {
        self.sessions == baseline.sessions
            && self.regions == baseline.regions
            && self.pools == baseline.pools
            && self.fds <= baseline.fds
    }

    /// Waits up to `within` until `t`'s footprint is back to `baseline` ([`is_back_to`]):
    /// returns how long it took, or panics naming what is still held.
    ///
    /// [`is_back_to`]: Footprint::is_back_to
    pub fn wait_back_to(t: &Target, baseline: &Footprint, within: Duration) -> Duration {
        let start = Instant::now();
        loop {
            let now = Footprint::of(t);
            if now.is_back_to(baseline) {
                return start.elapsed();
            }
            if start.elapsed() > within {
                panic!(
                    "the target is not back to its baseline after {within:?}:\n now {now:?}\n \
                     baseline {baseline:?}\n fds now {:?}\n status {}",
                    fds(t.pid()),
                    t.status()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// Size of the header and trailer of a [`block`].
const BLOCK_META: usize = 40;
const MAGIC: u64 = 0x6b6c_6241_4d50_5221; // "!RPMAblk"

/// A self-describing block of `len` bytes (at least 64): magic, writer, block number and
/// generation, bytes that depend on all three, and a checksum over everything before it.
pub fn block(writer: u64, no: u64, generation: u64, len: usize) -> Vec<u8> {
    assert!(len >= 64);
    let mut b = Vec::with_capacity(len);
    for v in [MAGIC, writer, no, generation] {
        b.extend_from_slice(&v.to_le_bytes());
    }
    let seed = writer.wrapping_mul(1_000_003) ^ no.wrapping_mul(7919) ^ generation << 20;
    b.extend(crate::noise(seed, len - BLOCK_META));
    let sum = fnv(&b);
    b.extend_from_slice(&sum.to_le_bytes());
    b
}

/// What a block says of itself: (writer, block number, generation), or None if it is not a
/// whole block (never written, torn, or damaged).
pub fn parse_block(b: &[u8]) -> Option<(u64, u64, u64)> {
    if b.len() < 64 {
        return None;
    }
    let word = |i: usize| u64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().unwrap());
    let (body, sum) = b.split_at(b.len() - 8);
    if word(0) != MAGIC || fnv(body) != u64::from_le_bytes(sum.try_into().unwrap()) {
        return None;
    }
    Some((word(1), word(2), word(3)))
}

fn fnv(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325, |h, &x| {
        (h ^ u64::from(x)).wrapping_mul(0x0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_replays_its_choices() {
        let (mut a, mut b) = (Rng::new(42), Rng::new(42));
        let x: Vec<u64> = (0..8).map(|_| a.below(1000)).collect();
        let y: Vec<u64> = (0..8).map(|_| b.below(1000)).collect();
        assert_eq!(x, y);
        assert_ne!(Rng::new(43).next_u64(), Rng::new(42).next_u64());
        let mut r = Rng::new(7);
        assert!((0..1000).all(|_| (5..9).contains(&r.range(5, 9))));
    }

    #[test]
    fn blocks_describe_themselves_and_damage_shows() {
        let b = block(3, 17, 99, 4096);
        assert_eq!(b.len(), 4096);
        assert_eq!(parse_block(&b), Some((3, 17, 99)));
        assert_ne!(block(3, 17, 98, 4096), b);
        let mut torn = b.clone();
        torn[2048..].copy_from_slice(&block(3, 17, 100, 4096)[2048..]);
        assert_eq!(parse_block(&torn), None);
        assert_eq!(parse_block(&[0u8; 4096]), None);
        assert_eq!(parse_block(&b[..32]), None);
    }

    #[test]
    fn memory_and_fds_of_this_process() {
        let me = std::process::id();
        let m = memory(me);
        assert!(
            m.rss_kib > 0 && m.anon_kib > 0 && m.anon_kib <= m.rss_kib,
            "{m:?}"
        );
        // Other tests of this binary may open files meanwhile: one clean try of ten is enough.
        let one_more = (0..10).any(|_| {
            let n = fd_count(me);
            let f = std::fs::File::open("/proc/self/status").unwrap();
            let seen = fd_count(me) == n + 1 && fds(me).iter().any(|p| p.ends_with("/status"));
            drop(f);
            seen
        });
        assert!(one_more, "an open file shows in the count: {:?}", fds(me));
    }
}
