//! Benchmark (not a test): the cost of making a range durable, per method and range size.
//!
//! `cargo run --release -p rpma-common --example pmem_persist [-- --scale N]`
//!
//! For 64 B, 4 KiB and 1 MiB ranges it reports the median (and 90th percentile) nanoseconds of:
//! - cache write-back + sfence with each instruction this CPU has (clwb, clflushopt, clflush), on a
//!   /dev/shm mapping opened with force_dax (DRAM: the cost of the instructions, not of pmem
//!   media);
//! - msync(MS_SYNC) through `Persist::persist` on a page-cache file under the repo's scratch/;
//! - references from the same run: a plain memcpy of the same size into the mapping, and the cost
//!   of reading the clock twice.
//!
//! Before every timed persist the range is dirtied again (untimed), so each one writes back dirty
//! lines or pages, as after a real Write. `--scale N` multiplies the repetitions.

use std::hint::black_box;
use std::path::Path;
use std::time::Instant;

use rpma_common::pmem::{sfence, writeback_range_with, FlushInstruction, OpenOptions, Persist};
use rpma_common::units::format_size;

const SIZES: [usize; 3] = [64, 4096, 1 << 20];
const MAP_LEN: usize = 4 << 20;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let scale: usize = match std::env::args().skip_while(|a| a != "--scale").nth(1) {
        Some(s) => s.parse()?,
        None => 1,
    };
    print_machine();

    let shm = tempfile::Builder::new()
        .prefix("rpma-bench-")
        .tempfile_in("/dev/shm")?;
    let dax = OpenOptions::new(shm.path())
        .size(MAP_LEN as u64)
        .force_dax(true)
        .open()?;
    let scratch = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scratch");
    std::fs::create_dir_all(&scratch)?;
    let scratch = scratch.canonicalize()?;
    let disk = tempfile::Builder::new()
        .prefix("bench-")
        .tempfile_in(&scratch)?;
    let pc = OpenOptions::new(disk.path()).size(MAP_LEN as u64).open()?;
    println!(
        "mappings: {} ({}), {} ({})",
        shm.path().display(),
        dax.domain(),
        disk.path().display(),
        pc.domain()
    );

    let src: Vec<u8> = (0..MAP_LEN).map(|i| i as u8).collect();
    let mut round = 0u8;
    let mut dirty = |m: &rpma_common::pmem::Mapping, len: usize| {
        round = round.wrapping_add(1);
        // SAFETY: [0, len) is within the mapping (len <= 1 MiB < MAP_LEN).
        unsafe { std::ptr::write_bytes(m.as_ptr(), round, len) };
    };

    println!();
    println!(
        "{:<28} {:>8} {:>7} {:>12} {:>12}",
        "method", "size", "reps", "median ns", "p90 ns"
    );
    let timer = measure(100_000, || {}, || {});
    row("clock read (reference)", 0, &timer);
    for &len in &SIZES {
        let reps = scale * reps_for(len, false);
        let s = measure(
            reps,
            || {},
            || {
                // SAFETY: the destination is the first `len` bytes of the mapping; src is a
                // separate allocation of at least `len` bytes.
                unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dax.as_ptr(), len) };
                black_box(dax.as_ptr());
            },
        );
        row("memcpy (reference)", len, &s);
        for instr in FlushInstruction::available() {
            let s = measure(
                reps,
                || dirty(&dax, len),
                || {
                    // SAFETY: [0, len) lies within the live mapping `dax`.
                    unsafe { writeback_range_with(instr, dax.as_ptr(), len) }
                        .expect("listed as available");
                    sfence();
                },
            );
            row(&format!("{instr} + sfence (shm)"), len, &s);
        }
        let s = measure(
            scale * reps_for(len, true),
            || dirty(&pc, len),
            || {
                pc.persist(0, len).expect("msync");
            },
        );
        row("msync (page-cache file)", len, &s);
    }
    Ok(())
}

/// Repetitions: enough for a stable median, few enough that msync of 1 MiB stays in seconds.
fn reps_for(len: usize, msync: bool) -> usize {
    match (len, msync) {
        (l, false) if l <= 4096 => 20_000,
        (_, false) => 500,
        (l, true) if l <= 4096 => 300,
        (_, true) => 30,
    }
}

/// Sorted nanosecond timings of `op`, each after an untimed `prepare`.
fn measure(reps: usize, mut prepare: impl FnMut(), mut op: impl FnMut()) -> Vec<u64> {
    // Warm up page tables and caches.
    for _ in 0..reps.min(10) {
        prepare();
        op();
    }
    let mut v: Vec<u64> = (0..reps)
        .map(|_| {
            prepare();
            let t = Instant::now();
            op();
            t.elapsed().as_nanos() as u64
        })
        .collect();
    v.sort_unstable();
    v
}

fn row(name: &str, len: usize, sorted: &[u64]) {
    let pct = |p: usize| sorted[(sorted.len() - 1) * p / 100];
    let size = if len == 0 {
        "-".to_owned()
    } else {
        format_size(len as u64)
    };
    println!(
        "{name:<28} {size:>8} {:>7} {:>12} {:>12}",
        sorted.len(),
        pct(50),
        pct(90)
    );
}

fn print_machine() {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| {
            l.strip_prefix("model name")
                .map(|r| r.trim_start_matches([' ', '\t', ':']))
        })
        .unwrap_or("unknown");
    let cpus = cpuinfo
        .lines()
        .filter(|l| l.starts_with("processor"))
        .count();
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    println!("cpu: {model} ({cpus} logical CPUs)");
    println!("kernel: {}", kernel.trim());
    println!(
        "write-back instructions: {:?}; chosen: {}",
        FlushInstruction::available()
            .iter()
            .map(|i| i.as_str())
            .collect::<Vec<_>>(),
        rpma_common::pmem::flush_instruction()
    );
}
