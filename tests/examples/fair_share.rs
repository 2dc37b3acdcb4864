//! The fair-share benchmark (issue 22, F8; docs/benchmarks.md, "Fair share"): an allowed
//! host's QD1 durable 4 KiB write + read-back on its own, then while attacker sessions each
//! keep large RDMA Reads in flight and read their answers as fast as they can.
//!
//! ```text
//! cargo build --release --workspace
//! cargo run --release -p rpma-tests --example fair_share -- [--target-bin PATH]
//!     [--attackers 48] [--reads 16] [--read-size 64MiB] [--ops 500] [--reps 3]
//!     [--attacker-nice 0]
//! ```
//!
//! It starts the `rpma-target` given (default: the one built beside this example) on a forced
//! dax namespace under /dev/shm, so that the figures are the target's and the transport's, not
//! a disk's. Per repetition: a fresh target, 50 warm-up operations, `--ops` operations alone,
//! then the attackers connect and start reading; once every attacker has had a Read answered,
//! `--ops` operations again. It prints p50 and p99 of each, their ratio, and what the target
//! sent meanwhile (its `wchar`, nearly all of it to the attackers); then the medians over the
//! repetitions. A benchmark, run by
//! hand side by side (`--target-bin` of two builds), never a test.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rpma_common::fabric::{
    Access, AlignedBuf, Completion, RemoteAddr, SendOp, SendWr, Sge, WcStatus,
};
use rpma_initiator::{ConnectOptions, Connection, HostIdentity, CONTROL_BIT};
use rpma_tests::free_port;

const SUB: &str = "nqn.2026-11.io.rpma:fair";

struct Args {
    target_bin: PathBuf,
    attackers: usize,
    reads: usize,
    read_size: usize,
    ops: usize,
    reps: usize,
    /// The attackers' threads' nice value (0: as the rest): with 19 they get CPU only when
    /// nothing else wants it, which separates the target's fairness from the CPU the
    /// attackers take on the same machine.
    nice: i32,
}

fn parse_args() -> Args {
    let mut exe = std::env::current_exe().expect("current_exe");
    exe.pop();
    if exe.ends_with("examples") {
        exe.pop();
    }
    let mut a = Args {
        target_bin: exe.join("rpma-target"),
        attackers: 48,
        reads: 16,
        read_size: 64 << 20,
        ops: 500,
        reps: 3,
        nice: 0,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let v = it.next().unwrap_or_else(|| panic!("{k} needs a value"));
        let n = || rpma_common::units::parse_size(&v).expect("a number") as usize;
        match k.as_str() {
            "--target-bin" => a.target_bin = PathBuf::from(&v),
            "--attackers" => a.attackers = n(),
            "--reads" => a.reads = n(),
            "--read-size" => a.read_size = n(),
            "--ops" => a.ops = n(),
            "--reps" => a.reps = n(),
            "--attacker-nice" => a.nice = v.parse().expect("a nice value"),
            other => panic!("unknown option {other}"),
        }
    }
    a
}

/// A running target on its own directory; killed on drop.
struct Daemon {
    child: Child,
    url: String,
    _dir: tempfile::TempDir,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(bin: &Path, ns_size: usize) -> Daemon {
    let dir = tempfile::tempdir_in("/dev/shm").expect("a directory under /dev/shm");
    let port = free_port();
    let cfg = dir.path().join("target.toml");
    std::fs::write(
        &cfg,
        format!(
            "listen = [\"tcp://127.0.0.1:{port}\"]\ncontrol_socket = \"ctl.sock\"\n\
             max_connections = 256\nmax_unadmitted_per_source = 64\n\
             [[subsystem]]\nnqn = \"{SUB}\"\nallow_any_host = true\n\
             [[subsystem.namespace]]\nnsid = 1\npath = \"ns1\"\nsize = {ns_size}\nforce_dax = true\n"
        ),
    )
    .unwrap();
    let child = Command::new(bin)
        .arg("--config")
        .arg(&cfg)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap_or_else(|e| panic!("{}: {e}", bin.display()));
    let deadline = Instant::now() + Duration::from_secs(60);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "the target did not listen");
        std::thread::sleep(Duration::from_millis(20));
    }
    Daemon {
        child,
        url: format!("tcp://127.0.0.1:{port}"),
        _dir: dir,
    }
}

/// Bytes the target process wrote so far (`wchar` of /proc/PID/io: its socket writes).
fn sent_by(d: &Daemon) -> u64 {
    let io = std::fs::read_to_string(format!("/proc/{}/io", d.child.id())).unwrap_or_default();
    io.lines()
        .find_map(|l| l.strip_prefix("wchar: "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

fn nqn(s: &str) -> rpma_common::proto::nqn::Nqn {
    rpma_common::proto::nqn::Nqn::new(s.to_owned()).unwrap()
}

/// p-quantile (nearest rank) of sorted `v`.
fn quantile(v: &[Duration], p: f64) -> Duration {
    let i = ((v.len() as f64 * p).ceil() as usize).clamp(1, v.len()) - 1;
    v[i]
}

/// `ops` QD1 durable 4 KiB writes, each read back and checked: their latencies, sorted.
fn measure(q: &mut rpma_initiator::Queue, ops: usize, base: u64) -> Vec<Duration> {
    let mut out = Vec::with_capacity(ops);
    let mut back = vec![0u8; 4096];
    for i in 0..ops {
        let data: Vec<u8> = (0..4096)
            .map(|b| (b as u64 ^ i as u64 ^ base) as u8)
            .collect();
        let off = base + (i as u64 % 256) * 4096;
        let t = Instant::now();
        let mut ns = q.namespace(1).unwrap();
        ns.write_durable(off, &data).expect("durable write");
        ns.read_at(off, &mut back).expect("read back");
        out.push(t.elapsed());
        assert_eq!(back, data, "read back wrong");
    }
    out.sort();
    out
}

/// What the attackers share.
#[derive(Clone)]
struct Attack {
    url: String,
    reads: usize,
    size: usize,
    nice: i32,
    sink: Arc<AlignedBuf>,
    stop: Arc<AtomicBool>,
    /// Bytes the attackers were sent.
    bytes: Arc<AtomicU64>,
    /// Attackers that had a Read answered.
    answered: Arc<AtomicU64>,
}

/// Attacker `i`: a session that keeps `reads` Reads of `size` bytes in flight into `sink`,
/// reposting each as it completes, until `stop`.
fn attacker(i: usize, a: Attack) {
    let Attack {
        url,
        reads,
        size,
        nice,
        sink,
        stop,
        bytes,
        answered,
    } = a;
    if nice != 0 {
        // SAFETY: setpriority reads its integer arguments only; gettid names this thread.
        unsafe {
            libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, nice);
        }
    }
    // A long keep-alive: a target that leaves the attackers' own messages waiting must not
    // end the attack by expiring them.
    let opts = ConnectOptions {
        timeout: Duration::from_secs(60),
        keep_alive: Duration::from_secs(600),
        ..ConnectOptions::default()
    };
    let host = HostIdentity::new(nqn(&format!("nqn.2026-11.io.rpma:attacker-{i}")));
    let mut s = rpma_initiator::connect(&url, &nqn(SUB), &host, &opts).expect("attacker session");
    let desc = s.namespace(1).unwrap().clone();
    let mr = s
        .pd()
        .register(Arc::clone(&sink), Access::LOCAL_WRITE)
        .unwrap();
    let remote = RemoteAddr {
        addr: desc.remote_addr,
        rkey: desc.rkey,
    };
    let read = |id: u64| {
        SendWr::new(
            id,
            SendOp::Read {
                local: Sge::new(&mr, 0, size),
                remote,
            },
        )
    };
    for id in 0..reads as u64 {
        s.qp().post_send(read(id)).expect("post a Read");
    }
    let mut wcs = [Completion::EMPTY; 16];
    let mut first = true;
    while !stop.load(Ordering::Relaxed) {
        let n = s
            .cq()
            .wait(&mut wcs, Some(Duration::from_millis(100)))
            .unwrap();
        for c in &wcs[..n] {
            if c.wr_id & CONTROL_BIT != 0 {
                let _ = s.handle(c);
                continue;
            }
            if c.status != WcStatus::Success {
                eprintln!("attacker {i}: a Read completed {:?}; it stops", c.status);
                return;
            }
            bytes.fetch_add(size as u64, Ordering::Relaxed);
            if first {
                answered.fetch_add(1, Ordering::SeqCst);
                first = false;
            }
            s.qp().post_send(read(c.wr_id)).expect("repost a Read");
        }
        let _ = s.tick();
    }
}

struct Run {
    alone: (Duration, Duration),
    attacked: (Duration, Duration),
    attack_gbps: f64,
}

fn one_run(a: &Args) -> Run {
    let ns_size = a.read_size.max(64 << 20) + (64 << 20);
    let d = start(&a.target_bin, ns_size);
    let host = HostIdentity::new(nqn("nqn.2026-11.io.rpma:allowed-host"));
    let mut q = Connection::new(&d.url, nqn(SUB), host)
        .open_queue(0)
        .expect("the allowed host's queue");
    let base = a.read_size.max(64 << 20) as u64;
    measure(&mut q, 50, base);
    let alone = measure(&mut q, a.ops, base);

    let attack = Attack {
        url: d.url.clone(),
        reads: a.reads,
        size: a.read_size,
        nice: a.nice,
        sink: AlignedBuf::new(a.read_size).unwrap(),
        stop: Arc::new(AtomicBool::new(false)),
        bytes: Arc::new(AtomicU64::new(0)),
        answered: Arc::new(AtomicU64::new(0)),
    };
    let threads: Vec<_> = (0..a.attackers)
        .map(|i| {
            let at = attack.clone();
            std::thread::spawn(move || attacker(i, at))
        })
        .collect();
    let Attack {
        stop,
        bytes,
        answered,
        ..
    } = attack;
    // The attack is on once every attacker has been answered at least once.
    let deadline = Instant::now() + Duration::from_secs(300);
    while answered.load(Ordering::SeqCst) < a.attackers as u64 {
        assert!(
            Instant::now() < deadline,
            "the attackers were never answered"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // What the target sent meanwhile, from its own I/O accounting (a Read is counted by the
    // attackers only once all of its 64 MiB arrived: too coarse for a short window).
    let (b0, t0) = (sent_by(&d), Instant::now());
    let attacked = measure(&mut q, a.ops, base);
    let attack_gbps = (sent_by(&d) - b0) as f64 / t0.elapsed().as_secs_f64() / 1e9;
    let _ = bytes.load(Ordering::Relaxed);
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        t.join().expect("an attacker");
    }
    let pq = |v: &[Duration]| (quantile(v, 0.5), quantile(v, 0.99));
    Run {
        alone: pq(&alone),
        attacked: pq(&attacked),
        attack_gbps,
    }
}

fn cpu_model() -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = info
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .map(|m| m.trim_start_matches([' ', '\t', ':']).to_owned())
        .unwrap_or_default();
    format!("{model}, {} CPU(s)", info.matches("processor\t:").count())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let a = parse_args();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    println!(
        "fair share: {} ({}), {} attackers x {} Reads of {} B in flight (nice {}), {} ops per measure, {} rep(s)",
        a.target_bin.display(),
        cpu_model(),
        a.attackers,
        a.reads,
        a.read_size,
        a.nice,
        a.ops,
        a.reps
    );
    let mut runs = Vec::new();
    for r in 0..a.reps {
        let run = one_run(&a);
        println!(
            "rep {r}: alone p50 {:.0} us p99 {:.0} us; attacked p50 {:.0} us p99 {:.0} us; p99 x{:.1}; target sent {:.2} GB/s",
            us(run.alone.0),
            us(run.alone.1),
            us(run.attacked.0),
            us(run.attacked.1),
            us(run.attacked.1) / us(run.alone.1),
            run.attack_gbps
        );
        let _ = std::io::stdout().flush();
        runs.push(run);
    }
    let m = |f: &dyn Fn(&Run) -> f64| median(runs.iter().map(f).collect());
    println!(
        "median: alone p50 {:.0} us p99 {:.0} us; attacked p50 {:.0} us p99 {:.0} us; p99 ratio x{:.1}; target sent {:.2} GB/s",
        m(&|r| us(r.alone.0)),
        m(&|r| us(r.alone.1)),
        m(&|r| us(r.attacked.0)),
        m(&|r| us(r.attacked.1)),
        m(&|r| us(r.attacked.1) / us(r.alone.1)),
        m(&|r| r.attack_gbps)
    );
}
