//! Benchmark (not a test): the `tcp` transport over loopback against raw TCP, in one run.
//!
//! `cargo run --release -p rpma-common --example fabric_bench [-- --reps N --iters N --gib N]
//! [--only TEXT] [--no-floor] [--pin]` (`--only`: the cases whose name contains TEXT, `--only
//! floor` none of them: the floor alone; `--no-floor`: the cases alone, no ratios: to profile a
//! case without the floor's samples; `--pin`: each end of every pair on a CPU of its own, the
//! first and the last this process may use, as two machines would be: unpinned, the scheduler
//! may leave both busy-polling ends on one CPU for seconds, and a run then measures that)
//!
//! Measures, for each combination of CRC (on, off), maximum ULPDU (1454, one FPDU per segment of
//! a 1500-byte MTU, and the default: 65535 cut to the connection's MSS) and target memory (a
//! volatile `AlignedBuf`, and a /dev/shm file mapped `dax (forced)`, whose Writes the engine writes
//! back with clwb + sfence before it answers a Read):
//! - QD1 latency: a 4 KiB Write (unsignaled) then an 8-byte Read, waiting for the Read's
//!   completion before the next pair: p50 and p99 of the round trip;
//! - bandwidth: 1 MiB Writes, 16 outstanding, then one 8-byte Read (so that the time includes
//!   placement and, on dax, the write-back of everything written).
//!
//! The floor, in the same run: a raw TCP ping-pong (4 KiB one way, 8 B back, both ends
//! busy-polling non-blocking sockets with TCP_NODELAY), the same with each 4 KiB sent from a
//! random place in a 64 MiB dax (forced) region (what data outside the sender's caches costs
//! it, as a random read of a namespace larger than the L3 has), the same ping-pong carrying the
//! iWARP wire's own work and nothing else (a Read Request answered by a 4 KiB Read Response from
//! a random place in the 64 MiB region; a 4 KiB Write and a Flush Request, placed at a random
//! place and written back, the Flush answered; each FPDU built, CRC'd and checked by the
//! transport's own wire code, CRC on and off, with no engine: no queue, completion or
//! bookkeeping; what any implementation of the protocol pays), and a raw TCP stream (1 MiB
//! writes, the reader busy-polling into a 1 MiB buffer, which stays in its caches). Beside it,
//! what a receiver that does nothing but land the stream durably in memory gets, the floor of
//! the bandwidth cases on dax (these rows have no latency): received straight into a dax
//! (forced) region and written back (clwb + sfence) as it lands, into a 16 MiB region (the
//! cases' own, which the L3 may hold) and into a 64 MiB one (as large as the bench jobs' range
//! of a namespace, where the product's 1 MiB writes land: twice the L3 of the AMD machines); and
//! received into a 64 KiB buffer whose bytes are then streamed into the 64 MiB region with
//! non-temporal stores, as the transport's target places a large checked payload. And the
//! stream sent with `MSG_ZEROCOPY`, with the share of its sends the kernel reports it copied
//! after all: whether the socket allows a zero-copy send here.
//!
//! Both ends run in this process, on two threads (the initiator in the main thread, the target
//! busy-polling its completion queue in another): on a 2-CPU machine one CPU each when the
//! scheduler spreads them, and always with `--pin`.
//! Every figure is the median over `--reps` repetitions; ratios are to the raw-TCP floor.

use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use rpma_common::fabric::soft::placer::write_payload;
use rpma_common::fabric::soft::wire::rx::DirectTarget;
use rpma_common::fabric::*;
use rpma_common::pmem::OpenOptions;

const SMALL: usize = 4096;
const MIB: usize = 1 << 20;
/// Target region: 16 slots of 1 MiB.
const REGION: usize = 16 * MIB;
const BW_QD: usize = 16;

type BoxResult<T> = std::result::Result<T, Box<dyn std::error::Error>>;

struct Args {
    reps: usize,
    iters: usize,
    gib: usize,
    only: Option<String>,
    no_floor: bool,
    pin: bool,
}

/// With `--pin`: the CPU the other end's threads run on (the last one; this process's main
/// thread, one end of every pair, runs on the first).
static PIN_OTHER: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(usize::MAX);

/// Puts the calling thread on CPU `cpu` alone (`sched_setaffinity`).
fn pin_to(cpu: usize) -> std::io::Result<()> {
    // SAFETY: a zeroed cpu_set_t is an empty set; CPU_SET writes within it (cpu < CPU_SETSIZE,
    // checked); sched_setaffinity(0, ..) reads it for the calling thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if cpu >= libc::CPU_SETSIZE as usize {
            return Err(std::io::Error::from(ErrorKind::InvalidInput));
        }
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// The first and the last CPU this process may run on.
fn allowed_cpus() -> std::io::Result<(usize, usize)> {
    // SAFETY: sched_getaffinity(0, ..) fills the set we own for the calling thread; CPU_ISSET
    // reads within it (i < CPU_SETSIZE).
    let cpus: Vec<usize> = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        (0..libc::CPU_SETSIZE as usize)
            .filter(|&i| libc::CPU_ISSET(i, &set))
            .collect()
    };
    match (cpus.first(), cpus.last()) {
        (Some(&f), Some(&l)) => Ok((f, l)),
        _ => Err(std::io::Error::from(ErrorKind::NotFound)),
    }
}

/// Called first in every thread this program spawns: with `--pin`, on the other end's CPU.
fn pin_other_end() {
    let cpu = PIN_OTHER.load(Ordering::Relaxed);
    if cpu != usize::MAX {
        pin_to(cpu).expect("pin a thread to its CPU");
    }
}

fn args() -> BoxResult<Args> {
    let mut a = Args {
        reps: 5,
        iters: 20_000,
        gib: 1,
        only: None,
        no_floor: false,
        pin: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        if k == "--no-floor" {
            a.no_floor = true;
            continue;
        }
        if k == "--pin" {
            a.pin = true;
            continue;
        }
        let v = it.next().ok_or("missing value")?;
        match k.as_str() {
            "--reps" => a.reps = v.parse()?,
            "--iters" => a.iters = v.parse()?,
            "--gib" => a.gib = v.parse()?,
            "--only" => a.only = Some(v),
            _ => return Err(format!("unknown argument {k}").into()),
        }
    }
    Ok(a)
}

fn main() -> BoxResult<()> {
    let a = args()?;
    print_machine();
    if a.pin {
        let (first, last) = allowed_cpus()?;
        if first == last {
            return Err("--pin needs two CPUs".into());
        }
        pin_to(first)?;
        PIN_OTHER.store(last, Ordering::Relaxed);
        println!("pinned: one end of every pair on CPU {first}, the other on CPU {last}");
    }
    println!(
        "reps {} (medians shown), QD1 iterations {} per rep, bandwidth {} GiB per rep",
        a.reps, a.iters, a.gib
    );

    let shm = tempfile::Builder::new()
        .prefix("rpma-fabric-bench-")
        .tempfile_in("/dev/shm")?;
    let mut cases = Vec::new();
    for dax in [false, true] {
        for crc in [true, false] {
            for ulpdu in [1454usize, 65535] {
                cases.push(Case::new(dax, crc, ulpdu, false));
            }
        }
    }
    // The same pair posted with two post_send calls (two writevs) instead of one list.
    cases.push(Case::new(false, true, 1454, true));
    cases.push(Case::new(false, false, 65535, true));
    cases.retain(|c| match &a.only {
        Some(o) => c.name.contains(o.as_str()),
        None => true,
    });

    // Each repetition measures the floor and then every case, so that a case is compared with
    // a floor measured moments before it (the machine is shared: its load drifts).
    let mut floor = Stats::default();
    let mut placed = Stats::default();
    let mut cold = Stats::default();
    let mut zerocopy = Stats::default();
    let mut zc_copied = Vec::new();
    let mut placed_large = Stats::default();
    let mut streamed_large = Stats::default();
    // The wire's own work, CRC on and off.
    let mut wire_read = [Stats::default(), Stats::default()];
    let mut wire_write = [Stats::default(), Stats::default()];
    // The large region has a file of its own: a file's size is fixed once made.
    let shm_large = tempfile::Builder::new()
        .prefix("rpma-fabric-bench-")
        .tempfile_in("/dev/shm")?;
    let dax_region_in =
        |file: &tempfile::NamedTempFile, size: usize| -> BoxResult<Arc<dyn Target>> {
            let m = OpenOptions::new(file.path())
                .size(size as u64)
                .force_dax(true)
                .open()?;
            assert!(m.domain().is_durable(), "{}", m.domain());
            Ok(Arc::new(m))
        };
    let dax_region = || dax_region_in(&shm, REGION);
    for rep in 0..a.reps {
        let (p50, p99, bw) = if a.no_floor {
            (f64::NAN, f64::NAN, f64::NAN)
        } else {
            let (p50, p99) = raw_ping_pong(a.iters, None)?;
            let cold_src = ColdSource::new()?;
            let (c50, c99) = raw_ping_pong(a.iters, Some(cold_src.bytes()))?;
            cold.push(c50, c99, f64::NAN, c50 / p50, f64::NAN);
            for (st, crc) in wire_read.iter_mut().zip([true, false]) {
                let (r50, r99) = wire_floor::read(a.iters, &cold_src.map, crc)?;
                st.push(r50, r99, f64::NAN, r50 / p50, f64::NAN);
            }
            drop(cold_src);
            let bw = raw_stream(a.gib)?;
            let pbw = raw_stream_placed(a.gib, &*dax_region()?)?;
            placed.push(f64::NAN, f64::NAN, pbw, f64::NAN, pbw / bw);
            let large = dax_region_in(&shm_large, COLD)?;
            let lbw = raw_stream_placed(a.gib, &*large)?;
            placed_large.push(f64::NAN, f64::NAN, lbw, f64::NAN, lbw / bw);
            let sbw = raw_stream_streamed(a.gib, &*large)?;
            streamed_large.push(f64::NAN, f64::NAN, sbw, f64::NAN, sbw / bw);
            for (st, crc) in wire_write.iter_mut().zip([true, false]) {
                let (w50, w99) = wire_floor::durable_write(a.iters, &*large, crc)?;
                st.push(w50, w99, f64::NAN, w50 / p50, f64::NAN);
            }
            let (zbw, copied) = raw_stream_zerocopy(a.gib)?;
            zerocopy.push(f64::NAN, f64::NAN, zbw, f64::NAN, zbw / bw);
            zc_copied.push(copied);
            (p50, p99, bw)
        };
        floor.push(p50, p99, bw, 1.0, 1.0);
        for c in cases.iter_mut() {
            let mem: Arc<dyn Target> = if c.dax {
                dax_region()?
            } else {
                AlignedBuf::new(REGION)?
            };
            let mut s = Setup::new(c.crc, c.ulpdu, mem)?;
            s.separate = c.separate;
            let (l50, l99) = s.qd1(a.iters)?;
            let cbw = s.bandwidth(a.gib)?;
            s.stop()?;
            c.stats.push(l50, l99, cbw, l50 / p50, cbw / bw);
        }
        eprintln!("rep {} of {} done", rep + 1, a.reps);
    }
    println!();
    println!("| case | QD1 p50 us | QD1 p99 us | p50 / floor | bandwidth GB/s | bw / floor |");
    println!("|---|---:|---:|---:|---:|---:|");
    if !a.no_floor {
        floor.print("raw TCP (floor)");
        cold.print(&format!(
            "raw TCP, the 4 KiB sent from a random place in a {} MiB dax (forced) region \
             (not in the sender's caches)",
            COLD / MIB
        ));
        for (crc, on) in [(0, "made and checked"), (1, "off")] {
            wire_read[crc].print(&format!(
                "raw TCP carrying an iWARP Read and nothing else: a Read Request, its 4 KiB \
                 Response from a random place in a {} MiB dax (forced) region, CRCs {on}, no \
                 engine",
                COLD / MIB
            ));
        }
        for (crc, on) in [(0, "made and checked"), (1, "off")] {
            wire_write[crc].print(&format!(
                "raw TCP carrying a durable iWARP Write and nothing else: a 4 KiB Write and a \
                 Flush Request in one writev, CRCs {on}, placed at a random place in a {} MiB \
                 dax (forced) region and written back, the Flush answered, no engine",
                COLD / MIB
            ));
        }
        placed.print(&format!(
            "raw TCP into a {} MiB dax (forced) region, written back",
            REGION / MIB
        ));
        placed_large.print(&format!(
            "raw TCP into a {} MiB dax (forced) region (the jobs' range), written back",
            COLD / MIB
        ));
        streamed_large.print(&format!(
            "raw TCP into a 64 KiB buffer, then streamed (non-temporal stores) into a {} MiB dax \
             (forced) region",
            COLD / MIB
        ));
        zerocopy.print(&format!(
            "raw TCP sent with MSG_ZEROCOPY ({:.0}% of the sends copied by the kernel)",
            100.0 * median(&mut zc_copied)
        ));
    }
    for c in cases.iter_mut() {
        c.stats.print(&c.name);
    }
    println!();
    println!("(ratios: median over the repetitions of the ratio to that repetition's floor)");
    Ok(())
}

struct Case {
    name: String,
    dax: bool,
    crc: bool,
    ulpdu: usize,
    separate: bool,
    stats: Stats,
}

impl Case {
    fn new(dax: bool, crc: bool, ulpdu: usize, separate: bool) -> Case {
        let name = format!(
            "crc {}, ulpdu {}, {}{}",
            if crc { "on" } else { "off" },
            if ulpdu == 1454 {
                "1454"
            } else {
                "default (MSS)"
            },
            if dax { "dax (forced)" } else { "volatile" },
            if separate {
                ", Write and Read posted apart"
            } else {
                ""
            }
        );
        Case {
            name,
            dax,
            crc,
            ulpdu,
            separate,
            stats: Stats::default(),
        }
    }
}

/// Per-repetition figures of one case.
#[derive(Default)]
struct Stats {
    p50: Vec<f64>,
    p99: Vec<f64>,
    bw: Vec<f64>,
    lat_ratio: Vec<f64>,
    bw_ratio: Vec<f64>,
}

impl Stats {
    fn push(&mut self, p50: f64, p99: f64, bw: f64, lat_ratio: f64, bw_ratio: f64) {
        self.p50.push(p50);
        self.p99.push(p99);
        self.bw.push(bw);
        self.lat_ratio.push(lat_ratio);
        self.bw_ratio.push(bw_ratio);
    }

    fn print(&mut self, name: &str) {
        // A row without latencies (NaN) shows "-" there.
        let us = |v: f64| {
            if v.is_nan() {
                "-".into()
            } else {
                format!("{:.2}", v / 1e3)
            }
        };
        let ratio = |v: f64| {
            if v.is_nan() {
                "-".into()
            } else {
                format!("{v:.2}")
            }
        };
        let gbs = |v: f64| {
            if v.is_nan() {
                "-".into()
            } else {
                format!("{:.2}", v / 1e9)
            }
        };
        println!(
            "| {name} | {} | {} | {} | {} | {} |",
            us(median(&mut self.p50)),
            us(median(&mut self.p99)),
            ratio(median(&mut self.lat_ratio)),
            gbs(median(&mut self.bw)),
            ratio(median(&mut self.bw_ratio))
        );
    }
}

fn print_machine() {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .map(|l| l.trim_start_matches([' ', '\t', ':']))
        .unwrap_or("unknown");
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    println!("cpu: {model}, {cpus} logical CPUs; both ends in this process on two threads");
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn percentile(sorted: &[u64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i] as f64
}

/// Registered target memory of either kind.
trait Target: RegisteredMemory + Send + Sync {}
impl<T: RegisteredMemory + Send + Sync> Target for T {}

struct Setup {
    icq: CompletionQueue,
    qp: QueuePair,
    local: Arc<MemoryRegion>,
    remote: Arc<MemoryRegion>,
    stop: Arc<AtomicBool>,
    /// Post the Write and the Read with two `post_send` calls instead of one list.
    separate: bool,
    target: JoinHandle<Result<QueuePair>>,
}

impl Setup {
    fn new(crc: bool, max_ulpdu: usize, mem: Arc<dyn Target>) -> BoxResult<Setup> {
        let params = ConnParams {
            tcp: TcpParams { crc, max_ulpdu },
            ..ConnParams::default()
        };
        let ctx = Context::soft();
        let pd = ctx.alloc_pd()?;
        let icq = ctx.create_cq(256)?;
        let tcq = ctx.create_cq(256)?;
        let access = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
        let remote = register_dyn(&pd, mem, access)?;
        let local_mem = AlignedBuf::new(REGION)?;
        for i in 0..REGION / 4096 {
            local_mem.write_at(i * 4096, &[i as u8; 4096])?;
        }
        let local = pd.register(local_mem, Access::LOCAL_WRITE)?;
        let listener = Listener::bind(&ctx, &"tcp://127.0.0.1:0".parse()?)?;
        let url = listener.url()?;
        let stop = Arc::new(AtomicBool::new(false));
        let (pd2, p2, stop2) = (pd.clone(), params.clone(), Arc::clone(&stop));
        let target = std::thread::spawn(move || -> Result<QueuePair> {
            pin_other_end();
            let req = listener.accept(&p2)?;
            let qp = pd2.create_qp(&tcq, &tcq, QpCaps::default())?;
            let qp = req.accept(qp, &p2, b"")?;
            // The target only serves: busy-poll its queue until told to stop.
            let mut wc = [Completion::EMPTY; 16];
            while !stop2.load(Ordering::Relaxed) {
                tcq.poll(&mut wc)?;
            }
            Ok(qp)
        });
        let qp = pd
            .create_qp(&icq, &icq, QpCaps::default())?
            .connect(&url, &params, b"")?;
        Ok(Setup {
            icq,
            qp,
            local,
            remote,
            stop,
            separate: false,
            target,
        })
    }

    fn stop(self) -> BoxResult<()> {
        self.stop.store(true, Ordering::Relaxed);
        let tqp = self.target.join().map_err(|_| "target thread panicked")??;
        drop((self.qp, tqp));
        Ok(())
    }

    fn next(&self) -> BoxResult<Completion> {
        let mut wc = [Completion::EMPTY; 1];
        loop {
            if self.icq.poll(&mut wc)? == 1 {
                if wc[0].status != WcStatus::Success {
                    return Err(format!("completion failed: {:?}", wc[0]).into());
                }
                return Ok(wc[0]);
            }
        }
    }

    fn read_wr(&self, wr_id: u64) -> SendWr {
        SendWr::new(
            wr_id,
            SendOp::Read {
                local: Sge::new(&self.local, REGION - 8, 8),
                remote: self.remote.remote(0),
            },
        )
    }

    fn read8(&self, wr_id: u64) -> BoxResult<()> {
        self.qp.post_send(self.read_wr(wr_id))?;
        let c = self.next()?;
        assert_eq!(c.wr_id, wr_id);
        Ok(())
    }

    /// Write(4 KiB) + Read(8 B) round trips: (p50, p99) in ns.
    fn qd1(&self, iters: usize) -> BoxResult<(f64, f64)> {
        let mut lat = Vec::with_capacity(iters);
        let slots = (REGION / SMALL) as u64;
        for i in 0..(iters + iters / 10) as u64 {
            let off = (i % slots) * SMALL as u64;
            let t = Instant::now();
            let write = SendWr::new(
                i,
                SendOp::Write {
                    local: Sge::new(&self.local, off as usize, SMALL),
                    remote: self.remote.remote(off),
                },
            )
            .with_flags(SendFlags::empty());
            if self.separate {
                self.qp.post_send(write)?;
                self.read8(i)?;
            } else {
                self.qp.post_send_list([write, self.read_wr(i)])?;
                assert_eq!(self.next()?.wr_id, i);
            }
            if i >= (iters / 10) as u64 {
                lat.push(t.elapsed().as_nanos() as u64);
            }
        }
        lat.sort_unstable();
        Ok((percentile(&lat, 0.5), percentile(&lat, 0.99)))
    }

    /// 1 MiB Writes, BW_QD outstanding, then a Read: bytes per second.
    fn bandwidth(&self, gib: usize) -> BoxResult<f64> {
        let total = gib * 1024;
        let t = Instant::now();
        let (mut posted, mut done) = (0usize, 0usize);
        let mut wc = [Completion::EMPTY; 16];
        while done < total {
            while posted < total && posted - done < BW_QD {
                let off = (posted % (REGION / MIB)) * MIB;
                self.qp.post_send(SendWr::new(
                    posted as u64,
                    SendOp::Write {
                        local: Sge::new(&self.local, off, MIB),
                        remote: self.remote.remote(off as u64),
                    },
                ))?;
                posted += 1;
            }
            let n = self.icq.poll(&mut wc)?;
            for c in &wc[..n] {
                if c.status != WcStatus::Success {
                    return Err(format!("write failed: {c:?}").into());
                }
            }
            done += n;
        }
        self.read8(u64::MAX)?;
        Ok((total * MIB) as f64 / t.elapsed().as_secs_f64())
    }
}

fn register_dyn(
    pd: &ProtectionDomain,
    mem: Arc<dyn Target>,
    access: Access,
) -> Result<Arc<MemoryRegion>> {
    pd.register(Arc::new(Shared(mem)), access)
}

/// An `Arc<dyn Target>` as a sized `RegisteredMemory` that keeps the pmem `Persist` visible.
struct Shared(Arc<dyn Target>);

// SAFETY: forwards to the inner memory, which upholds the contract.
unsafe impl RegisteredMemory for Shared {
    fn as_mut_ptr(&self) -> *mut u8 {
        self.0.as_mut_ptr()
    }
    fn len(&self) -> usize {
        self.0.len()
    }
    fn persist(&self) -> Option<&dyn rpma_common::pmem::Persist> {
        self.0.persist()
    }
}

fn pair() -> BoxResult<(TcpStream, TcpStream)> {
    let l = TcpListener::bind("127.0.0.1:0")?;
    let c = TcpStream::connect(l.local_addr()?)?;
    let (s, _) = l.accept()?;
    for x in [&c, &s] {
        x.set_nodelay(true)?;
        x.set_nonblocking(true)?;
    }
    Ok((c, s))
}

fn spin_write(s: &mut TcpStream, mut buf: &[u8]) -> std::io::Result<()> {
    while !buf.is_empty() {
        match s.write(buf) {
            Ok(n) => buf = &buf[n..],
            Err(e) if e.kind() == ErrorKind::WouldBlock => std::hint::spin_loop(),
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn spin_read(s: &mut TcpStream, mut buf: &mut [u8]) -> std::io::Result<()> {
    while !buf.is_empty() {
        match s.read(buf) {
            Ok(0) => return Err(ErrorKind::UnexpectedEof.into()),
            Ok(n) => buf = &mut buf[n..],
            Err(e) if e.kind() == ErrorKind::WouldBlock => std::hint::spin_loop(),
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// The cold floor's source and the large landing region: larger than the L3 of this project's
/// AMD machines (32 MiB), as the bench jobs' 64 MiB range of a namespace is.
const COLD: usize = 64 * MIB;

/// A [`COLD`]-byte /dev/shm file mapped as the dax rows' memory, every byte written once (so
/// that every page exists before the floor reads it).
struct ColdSource {
    map: rpma_common::pmem::Mapping,
    _file: tempfile::NamedTempFile,
}

impl ColdSource {
    fn new() -> BoxResult<ColdSource> {
        let file = tempfile::Builder::new()
            .prefix("rpma-fabric-bench-cold-")
            .tempfile_in("/dev/shm")?;
        let map = OpenOptions::new(file.path())
            .size(COLD as u64)
            .force_dax(true)
            .open()?;
        // SAFETY: the mapping is COLD bytes, ours alone (a new file), alive while `map` is.
        unsafe { std::ptr::write_bytes(map.as_mut_ptr(), 0x5A, map.len()) };
        Ok(ColdSource { map, _file: file })
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: as in `new`; nothing writes the mapping after it (the floor only sends from
        // it), and the slice borrows `self`, which keeps it mapped.
        unsafe { std::slice::from_raw_parts(self.map.as_mut_ptr(), self.map.len()) }
    }
}

/// 4 KiB one way, 8 B back, both ends busy-polling: (p50, p99) in ns. With `from`, each 4 KiB
/// is sent from a random 4 KiB-aligned place in it instead of one buffer: what a sender pays for
/// data that is not in its caches (a random read of a namespace larger than the L3).
fn raw_ping_pong(iters: usize, from: Option<&[u8]>) -> BoxResult<(f64, f64)> {
    let (mut c, mut s) = pair()?;
    let total = iters + iters / 10;
    let server = std::thread::spawn(move || -> std::io::Result<()> {
        pin_other_end();
        let mut buf = vec![0u8; SMALL];
        for _ in 0..total {
            spin_read(&mut s, &mut buf)?;
            spin_write(&mut s, &buf[..8])?;
        }
        Ok(())
    });
    let out = vec![7u8; SMALL];
    let places = from.map_or(1, |f| f.len() / SMALL);
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let mut back = [0u8; 8];
    let mut lat = Vec::with_capacity(iters);
    for i in 0..total {
        // xorshift64: a new place each time, the same sequence every run.
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let at = (x % places as u64) as usize * SMALL;
        let src = from.map_or(&out[..], |f| &f[at..at + SMALL]);
        let t = Instant::now();
        spin_write(&mut c, src)?;
        spin_read(&mut c, &mut back)?;
        if i >= iters / 10 {
            lat.push(t.elapsed().as_nanos() as u64);
        }
    }
    server.join().map_err(|_| "server panicked")??;
    lat.sort_unstable();
    Ok((percentile(&lat, 0.5), percentile(&lat, 0.99)))
}

/// A connected pair whose writer thread sends `total` bytes in 1 MiB writes; the reading end.
fn stream_writer(total: usize) -> BoxResult<(JoinHandle<std::io::Result<()>>, TcpStream)> {
    let (mut c, s) = pair()?;
    let writer = std::thread::spawn(move || -> std::io::Result<()> {
        pin_other_end();
        let buf = vec![3u8; MIB];
        for _ in 0..total / MIB {
            spin_write(&mut c, &buf)?;
        }
        Ok(())
    });
    Ok((writer, s))
}

/// Reads `total` bytes from `s` into a 1 MiB buffer, busy-polling: how long it took.
fn drain(s: &mut TcpStream, total: usize) -> BoxResult<std::time::Duration> {
    let mut buf = vec![0u8; MIB];
    let t = Instant::now();
    let mut got = 0;
    while got < total {
        match s.read(&mut buf) {
            Ok(0) => return Err("writer closed early".into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == ErrorKind::WouldBlock => std::hint::spin_loop(),
            Err(e) => return Err(e.into()),
        }
    }
    Ok(t.elapsed())
}

/// 1 MiB writes, the reader busy-polling: bytes per second.
fn raw_stream(gib: usize) -> BoxResult<f64> {
    let total = gib << 30;
    let (writer, mut s) = stream_writer(total)?;
    let el = drain(&mut s, total)?;
    writer.join().map_err(|_| "writer panicked")??;
    Ok(total as f64 / el.as_secs_f64())
}

/// [`raw_stream`] received straight into `mem` (a dax region), 1 MiB at a time round it, each
/// read's bytes written back (clwb + sfence) as they land: bytes per second.
fn raw_stream_placed(gib: usize, mem: &dyn Target) -> BoxResult<f64> {
    let persist = mem.persist().ok_or("a dax region has a Persist")?;
    let (base, len) = (mem.as_mut_ptr(), mem.len());
    let total = gib << 30;
    let (writer, mut s) = stream_writer(total)?;
    let t = Instant::now();
    let (mut got, mut at) = (0, 0);
    while got < total {
        let room = (len - at).min(MIB);
        // SAFETY: `mem` is mapped for `len` bytes and `at + room <= len`; nothing else reads or
        // writes it while this runs (a region of its own, not registered anywhere).
        let dst = unsafe { std::slice::from_raw_parts_mut(base.add(at), room) };
        match s.read(dst) {
            Ok(0) => return Err("writer closed early".into()),
            Ok(n) => {
                persist.persist(at, n)?;
                got += n;
                at = (at + n) % len;
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => std::hint::spin_loop(),
            Err(e) => return Err(e.into()),
        }
    }
    let el = t.elapsed();
    writer.join().map_err(|_| "writer panicked")??;
    Ok(total as f64 / el.as_secs_f64())
}

/// [`raw_stream`] received into a 64 KiB buffer of the reader's (which stays in its caches),
/// each read's bytes then placed into `mem` (a dax region), round it, by the transport's own
/// placement of a checked payload into memory that asks for the cache write-back
/// (`placer::write_payload`: non-temporal stores, the partial lines at either end written back)
/// and an `sfence`: bytes per second. Against [`raw_stream_placed`]'s `recv` straight into place,
/// whose stores first read every line they write when the region is not cached.
fn raw_stream_streamed(gib: usize, mem: &dyn Target) -> BoxResult<f64> {
    let persist = mem.persist().ok_or("a dax region has a Persist")?;
    let (base, len) = (mem.as_mut_ptr(), mem.len());
    let total = gib << 30;
    let (writer, mut s) = stream_writer(total)?;
    let mut buf = vec![0u8; 64 << 10];
    let t = Instant::now();
    let (mut got, mut at) = (0, 0);
    while got < total {
        match s.read(&mut buf) {
            Ok(0) => return Err("writer closed early".into()),
            Ok(n) => {
                got += n;
                let mut done = 0;
                while done < n {
                    let run = (n - done).min(len - at);
                    // SAFETY: `mem` is mapped for `len` bytes and `at + run <= len`; nothing
                    // else reads or writes it while this runs (a region of its own, not
                    // registered anywhere), and the target is dropped by the call below.
                    let dst = unsafe { DirectTarget::new(base.add(at), run) };
                    let chunk = &buf[done..done + run];
                    // Not streamed (too short, or no write-back instruction): written back
                    // as the target's durability contract would.
                    if !write_payload(dst.with_cache_writeback(), chunk)? {
                        persist.persist(at, run)?;
                    }
                    done += run;
                    at = (at + run) % len;
                }
                rpma_common::pmem::sfence();
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => std::hint::spin_loop(),
            Err(e) => return Err(e.into()),
        }
    }
    let el = t.elapsed();
    writer.join().map_err(|_| "writer panicked")??;
    Ok(total as f64 / el.as_secs_f64())
}

/// `SO_ZEROCOPY` (asm-generic/socket.h; not in the libc crate).
const SO_ZEROCOPY: libc::c_int = 60;
/// `SO_EE_ORIGIN_ZEROCOPY` and `SO_EE_CODE_ZEROCOPY_COPIED` (linux/errqueue.h).
const SO_EE_ORIGIN_ZEROCOPY: u8 = 5;
const SO_EE_CODE_ZEROCOPY_COPIED: u8 = 1;
/// Buffers the zero-copy writer sends from in turn.
const ZC_BUFS: usize = 16;

/// [`raw_stream`] with the writer sending by `MSG_ZEROCOPY` from sixteen 1 MiB buffers in turn,
/// each reused only once the kernel's completion notices cover its sends: bytes per second, and
/// the share of the sends the kernel reported it copied after all.
fn raw_stream_zerocopy(gib: usize) -> BoxResult<(f64, f64)> {
    use std::os::fd::AsRawFd;
    let (c, mut s) = pair()?;
    let total = gib << 30;
    let writer = std::thread::spawn(move || -> std::io::Result<(u64, u64)> {
        pin_other_end();
        let fd = c.as_raw_fd();
        let one: libc::c_int = 1;
        // SAFETY: a socket of ours and an int option of the size given.
        let r = unsafe {
            libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                SO_ZEROCOPY,
                (&one as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if r != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let bufs: Vec<Vec<u8>> = (0..ZC_BUFS).map(|_| vec![3u8; MIB]).collect();
        let mut last_send: [Option<u64>; ZC_BUFS] = [None; ZC_BUFS];
        let (mut sends, mut done, mut copied) = (0u64, 0u64, 0u64);
        for i in 0..total / MIB {
            let b = i % ZC_BUFS;
            while last_send[b].is_some_and(|n| n >= done) {
                reap_zerocopy(fd, &mut done, &mut copied)?;
            }
            let mut off = 0;
            while off < MIB {
                let rest = &bufs[b][off..];
                // SAFETY: `rest` is valid for its length, and its buffer is not written while
                // the kernel may read it (never, here; reused only once the notices cover it).
                let r = unsafe {
                    libc::send(
                        fd,
                        rest.as_ptr().cast(),
                        rest.len(),
                        libc::MSG_ZEROCOPY | libc::MSG_DONTWAIT,
                    )
                };
                if r < 0 {
                    let e = std::io::Error::last_os_error();
                    match e.raw_os_error() {
                        Some(libc::EAGAIN) | Some(libc::ENOBUFS) => {
                            reap_zerocopy(fd, &mut done, &mut copied)?;
                            continue;
                        }
                        _ => return Err(e),
                    }
                }
                last_send[b] = Some(sends);
                sends += 1;
                off += r as usize;
            }
        }
        while done < sends {
            reap_zerocopy(fd, &mut done, &mut copied)?;
        }
        Ok((sends, copied))
    });
    let el = drain(&mut s, total)?;
    let (sends, copied) = writer.join().map_err(|_| "writer panicked")??;
    Ok((
        total as f64 / el.as_secs_f64(),
        copied as f64 / sends.max(1) as f64,
    ))
}

/// Takes the zero-copy completion notices queued on `fd`'s error queue, if any: each covers a
/// range of sends (in order, on TCP); `done` counts the sends covered, `copied` those the
/// kernel copied after all.
fn reap_zerocopy(fd: libc::c_int, done: &mut u64, copied: &mut u64) -> std::io::Result<()> {
    loop {
        let mut control = [0u64; 16];
        // SAFETY: an all-zero msghdr is valid (no name, no iovec).
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = std::mem::size_of_val(&control) as _;
        // SAFETY: `msg` and its control buffer are valid for the call.
        let r = unsafe { libc::recvmsg(fd, &mut msg, libc::MSG_ERRQUEUE | libc::MSG_DONTWAIT) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EAGAIN) {
                std::hint::spin_loop();
                return Ok(());
            }
            return Err(e);
        }
        // SAFETY: the kernel filled `msg`'s control buffer; the CMSG_* macros walk within it.
        let mut cm = unsafe { libc::CMSG_FIRSTHDR(&msg) };
        while !cm.is_null() {
            // SAFETY: `cm` is a control message header inside `control`.
            let h = unsafe { &*cm };
            if h.cmsg_level == libc::SOL_IP && h.cmsg_type == libc::IP_RECVERR {
                // SAFETY: an IP_RECVERR message carries a sock_extended_err.
                let ee = unsafe {
                    std::ptr::read_unaligned(libc::CMSG_DATA(cm).cast::<libc::sock_extended_err>())
                };
                if ee.ee_origin == SO_EE_ORIGIN_ZEROCOPY && ee.ee_errno == 0 {
                    let n = u64::from(ee.ee_data.wrapping_sub(ee.ee_info)) + 1;
                    *done += n;
                    if ee.ee_code & SO_EE_CODE_ZEROCOPY_COPIED != 0 {
                        *copied += n;
                    }
                }
            }
            // SAFETY: as above.
            cm = unsafe { libc::CMSG_NXTHDR(&msg, cm) };
        }
    }
}

/// The work of the iWARP wire itself, on both ends, beside the raw ping-pong: what any
/// implementation of the protocol (MPA framing with CRC32c, DDP/RDMAP headers) pays per round
/// trip whatever its engine does around it. Every byte is built and checked by the transport's
/// own wire code (`Framing`, `encode_fpdu`, `Header::decode`, the body codecs, the CRC and the
/// placement of `placer::write_payload`); nothing else runs: no queue, no completion, no
/// ordering, no bookkeeping of any kind.
mod wire_floor {
    use super::*;
    use rpma_common::fabric::soft::wire::rdmap::{
        FlushPlacement, FlushRequest, FlushSelectivity, PrivateResponse, ReadRequest,
    };
    use rpma_common::fabric::soft::wire::tx::{encode_fpdu, Framing};
    use rpma_common::fabric::soft::wire::{crc32c, fpdu_len, Header, Opcode};
    use rpma_common::volatile::VolatileSlice;
    use std::os::fd::AsRawFd;

    /// The servers' result: their errors cross the thread.
    type SResult<T> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

    /// The FPDU `buf`: its CRC checked (when `crc`), its header decoded; the header and the
    /// bytes after it.
    fn check(buf: &[u8], crc: bool) -> SResult<(Header, &[u8])> {
        let (body, trailer) = buf.split_at(buf.len() - 4);
        if crc && crc32c(body) != u32::from_le_bytes(trailer.try_into()?) {
            return Err("CRC mismatch".into());
        }
        let ulpdu_len = u16::from_be_bytes([buf[0], buf[1]]) as usize;
        let (h, hlen) = Header::decode(&buf[2..2 + ulpdu_len])?;
        Ok((h, &buf[2 + hlen..2 + ulpdu_len]))
    }

    fn tagged_to(h: &Header) -> u64 {
        match h.kind {
            rpma_common::fabric::soft::wire::HeaderKind::Tagged { to, .. } => to,
            _ => u64::MAX,
        }
    }

    /// `writev` of `iov` in full, busy-polling a non-blocking socket.
    fn spin_writev(fd: libc::c_int, iov: &mut [libc::iovec]) -> std::io::Result<()> {
        let mut first = 0;
        while first < iov.len() {
            let rest = &iov[first..];
            // SAFETY: every iovec names memory valid for reads for the call (the caller's
            // buffers, or a mapping the caller keeps alive); the kernel only reads them.
            let n = unsafe { libc::writev(fd, rest.as_ptr(), rest.len() as libc::c_int) };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == ErrorKind::WouldBlock {
                    std::hint::spin_loop();
                    continue;
                }
                return Err(e);
            }
            let mut n = n as usize;
            while first < iov.len() && n >= iov[first].iov_len {
                n -= iov[first].iov_len;
                first += 1;
            }
            if n > 0 {
                // SAFETY: n < this iovec's length, so the advanced base stays inside it.
                iov[first].iov_base = unsafe { iov[first].iov_base.cast::<u8>().add(n) }.cast();
                iov[first].iov_len -= n;
            }
        }
        Ok(())
    }

    /// Bytes on the wire of one FPDU of `header` and `body` bytes after it (with or without
    /// the CRC: its four bytes are there either way).
    fn wire_len(header: Header, body: usize) -> usize {
        fpdu_len(header.len() + body)
    }

    /// Joins the responder; (p50, p99) of the requester's round trips, in ns.
    fn finish(
        server: std::thread::ScopedJoinHandle<'_, SResult<()>>,
        mut lat: Vec<u64>,
    ) -> BoxResult<(f64, f64)> {
        server
            .join()
            .map_err(|_| "server panicked")?
            .map_err(|e| e.to_string())?;
        lat.sort_unstable();
        Ok((percentile(&lat, 0.5), percentile(&lat, 0.99)))
    }

    fn iov(p: *const u8, len: usize) -> libc::iovec {
        libc::iovec {
            iov_base: p as *mut libc::c_void,
            iov_len: len,
        }
    }

    fn next_place(x: &mut u64, places: usize) -> usize {
        *x ^= *x << 13;
        *x ^= *x >> 7;
        *x ^= *x << 17;
        (*x % places as u64) as usize * SMALL
    }

    /// A Read Request (its FPDU built and CRC'd by the requester, checked and decoded by the
    /// responder), answered by a 4 KiB Read Response from a random place in `src` (a dax
    /// region larger than the L3, as the bench jobs' range): its CRC over a copy of the bytes
    /// (`Framing::for_volatile`, as the target's), sent with one `writev` straight from the
    /// region, checked by the requester. (p50, p99) in ns.
    pub fn read(iters: usize, src: &dyn Target, crc: bool) -> BoxResult<(f64, f64)> {
        let (mut c, mut s) = pair()?;
        let total = iters + iters / 10;
        let req_len = wire_len(
            Header::untagged(Opcode::ReadRequest, 1, true),
            ReadRequest::LEN,
        );
        let resp_len = wire_len(Header::tagged(Opcode::ReadResponse, 0, 0, true), SMALL);
        let places = src.len() / SMALL;
        std::thread::scope(|scope| -> BoxResult<(f64, f64)> {
            let server = scope.spawn(move || -> SResult<()> {
                pin_other_end();
                let fd = s.as_raw_fd();
                let mut buf = vec![0u8; req_len];
                for _ in 0..total {
                    spin_read(&mut s, &mut buf)?;
                    let (_, body) = check(&buf, crc)?;
                    let r = ReadRequest::decode(body)?;
                    let at = r.src_to as usize;
                    if at + r.size as usize > src.len() {
                        return Err("read out of range".into());
                    }
                    // SAFETY: the region is mapped for its length, alive while `src` is, and
                    // at + size <= len; nothing holds a reference to its bytes.
                    let payload =
                        unsafe { VolatileSlice::new(src.as_mut_ptr().add(at), r.size as usize) };
                    let f = Framing::for_volatile(
                        &Header::tagged(Opcode::ReadResponse, r.sink_stag, r.sink_to, true),
                        payload,
                        crc,
                    );
                    let mut v = [
                        iov(f.head().as_ptr(), f.head().len()),
                        iov(payload.as_ptr(), payload.len()),
                        iov(f.trailer().as_ptr(), f.trailer().len()),
                    ];
                    spin_writev(fd, &mut v)?;
                }
                Ok(())
            });
            let mut x = 0x9E37_79B9_7F4A_7C15u64;
            let mut req = Vec::with_capacity(req_len);
            let mut resp = vec![0u8; resp_len];
            let mut lat = Vec::with_capacity(iters);
            for i in 0..total {
                let at = next_place(&mut x, places);
                let t = Instant::now();
                req.clear();
                let body = ReadRequest {
                    sink_stag: 7,
                    sink_to: 0,
                    size: SMALL as u32,
                    src_stag: 9,
                    src_to: at as u64,
                };
                encode_fpdu(
                    &Header::untagged(Opcode::ReadRequest, i as u32 + 1, true),
                    &body.encode(),
                    crc,
                    &mut req,
                )?;
                spin_write(&mut c, &req)?;
                spin_read(&mut c, &mut resp)?;
                let (h, payload) = check(&resp, crc).map_err(|e| e.to_string())?;
                if h.opcode != Opcode::ReadResponse || payload.len() != SMALL || tagged_to(&h) != 0
                {
                    return Err("not the Read Response asked for".into());
                }
                if i >= iters / 10 {
                    lat.push(t.elapsed().as_nanos() as u64);
                }
            }
            finish(server, lat)
        })
    }

    /// A 4 KiB Write and a Flush Request of its range, sent in one `writev` (the Write's CRC
    /// over its source, as the initiator's); the responder checks both CRCs, places the
    /// payload at a random place in `dst` (a dax region as large as the bench jobs' range)
    /// as the target does (`placer::write_payload`: non-temporal stores, then the fence), and
    /// answers the Flush. (p50, p99) in ns.
    pub fn durable_write(iters: usize, dst: &dyn Target, crc: bool) -> BoxResult<(f64, f64)> {
        if dst.persist().is_none() {
            return Err("a dax region has a Persist".into());
        }
        let (mut c, mut s) = pair()?;
        let total = iters + iters / 10;
        let write_len = wire_len(Header::tagged(Opcode::Write, 0, 0, true), SMALL);
        let flush_body = |req_id: u32, to: u64| FlushRequest {
            req_id,
            placement: FlushPlacement::Persistent,
            selectivity: FlushSelectivity::Range {
                stag: 9,
                to,
                len: SMALL as u64,
            },
        };
        let flush_len = wire_len(
            Header::untagged(Opcode::FlushRequest, 1, true),
            FlushRequest::LEN,
        );
        let answer_len = wire_len(
            Header::untagged(Opcode::PrivateResponse, 1, true),
            PrivateResponse::LEN,
        );
        let places = dst.len() / SMALL;
        std::thread::scope(|scope| -> BoxResult<(f64, f64)> {
            let server = scope.spawn(move || -> SResult<()> {
                pin_other_end();
                let persist = dst.persist().ok_or("a dax region has a Persist")?;
                let mut buf = vec![0u8; write_len + flush_len];
                let mut answer = Vec::with_capacity(answer_len);
                for i in 0..total {
                    spin_read(&mut s, &mut buf)?;
                    let (h, payload) = check(&buf[..write_len], crc)?;
                    let at = tagged_to(&h) as usize;
                    if h.opcode != Opcode::Write || at + payload.len() > dst.len() {
                        return Err("not a Write in range".into());
                    }
                    // SAFETY: the region is mapped for its length and alive while `dst` is;
                    // at + len <= its length; nothing else reads or writes it meanwhile.
                    let place =
                        unsafe { DirectTarget::new(dst.as_mut_ptr().add(at), payload.len()) };
                    if !write_payload(place.with_cache_writeback(), payload)? {
                        persist.persist(at, payload.len())?;
                    }
                    rpma_common::pmem::sfence();
                    let (h, body) = check(&buf[write_len..], crc)?;
                    let f = FlushRequest::decode(body)?;
                    if h.opcode != Opcode::FlushRequest {
                        return Err("not a Flush".into());
                    }
                    answer.clear();
                    let r = PrivateResponse {
                        req_id: f.req_id,
                        request: Opcode::FlushRequest,
                    };
                    encode_fpdu(
                        &Header::untagged(Opcode::PrivateResponse, i as u32 + 1, true),
                        &r.encode(),
                        crc,
                        &mut answer,
                    )?;
                    spin_write(&mut s, &answer)?;
                }
                Ok(())
            });
            let fd = c.as_raw_fd();
            let src = vec![7u8; SMALL];
            let mut x = 0x9E37_79B9_7F4A_7C15u64;
            let mut flush = Vec::with_capacity(flush_len);
            let mut back = vec![0u8; answer_len];
            let mut lat = Vec::with_capacity(iters);
            for i in 0..total {
                let at = next_place(&mut x, places) as u64;
                let t = Instant::now();
                let f = Framing::new(
                    &Header::tagged(Opcode::Write, 9, at, true),
                    SMALL,
                    [&src[..]],
                    crc,
                );
                flush.clear();
                encode_fpdu(
                    &Header::untagged(Opcode::FlushRequest, i as u32 + 1, true),
                    &flush_body(i as u32, at).encode(),
                    crc,
                    &mut flush,
                )?;
                let mut v = [
                    iov(f.head().as_ptr(), f.head().len()),
                    iov(src.as_ptr(), src.len()),
                    iov(f.trailer().as_ptr(), f.trailer().len()),
                    iov(flush.as_ptr(), flush.len()),
                ];
                spin_writev(fd, &mut v)?;
                spin_read(&mut c, &mut back)?;
                let (h, body) = check(&back, crc).map_err(|e| e.to_string())?;
                let r = PrivateResponse::decode(body)?;
                if h.opcode != Opcode::PrivateResponse || r.req_id != i as u32 {
                    return Err("not the Flush's answer".into());
                }
                if i >= iters / 10 {
                    lat.push(t.elapsed().as_nanos() as u64);
                }
            }
            finish(server, lat)
        })
    }
}
