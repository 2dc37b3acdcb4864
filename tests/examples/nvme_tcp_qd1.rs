//! QD1 latencies of an `nvme-tcp://` listener, through the tests' own NVMe/TCP host over one
//! I/O queue: plain writes, writes each followed by a Flush, FUA writes, reads. A benchmark run
//! by hand (docs/benchmarks.md, "NVMe/TCP"), not a test.
//!
//! ```text
//! cargo run --release -p rpma-tests --example nvme_tcp_qd1 -- 127.0.0.1:4420 SUBNQN HOSTNQN \
//!     [--nsid 1] [--bs 4096] [--count 20000] [--digests]
//! ```

use std::time::Instant;

use rpma_tests::nvme::Controller;

fn arg(args: &[String], name: &str, default: u64) -> u64 {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map(|v| v.parse().expect("a number"))
        .unwrap_or(default)
}

/// Median and 90th percentile in microseconds.
fn stats(mut ns: Vec<u64>) -> (f64, f64) {
    ns.sort_unstable();
    let at = |q: f64| ns[((ns.len() - 1) as f64 * q) as usize] as f64 / 1000.0;
    (at(0.5), at(0.9))
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 4 {
        eprintln!(
            "usage: nvme_tcp_qd1 ADDR SUBNQN HOSTNQN [--nsid N] [--bs B] [--count C] [--digests]"
        );
        std::process::exit(2);
    }
    let (addr, sub, host) = (&args[1], &args[2], &args[3]);
    let nsid = arg(&args, "--nsid", 1) as u32;
    let bs = arg(&args, "--bs", 4096) as usize;
    let count = arg(&args, "--count", 20000) as usize;
    let digests = args.iter().any(|a| a == "--digests");
    let c = Controller::connect(addr, sub, host, (digests, digests)).expect("admitted");
    let mut q = c.io_queue(1).expect("an I/O queue");
    let data = rpma_tests::noise(1, bs);
    let span = 4096u64; // blocks of 4 KiB written round-robin: 16 MiB
    let blocks = (bs / 4096).max(1) as u64;
    let time = |q: &mut rpma_tests::nvme::Host, what: &str| {
        let mut lat = Vec::with_capacity(count);
        for i in 0..count as u64 {
            let slba = (i * blocks) % span;
            let t = Instant::now();
            let ok = match what {
                "write" => q.write(nsid, slba, 4096, &data, false).unwrap().ok(),
                "write+flush" => {
                    q.write(nsid, slba, 4096, &data, false).unwrap().ok()
                        && q.flush(nsid).unwrap().ok()
                }
                "fua write" => q.write(nsid, slba, 4096, &data, true).unwrap().ok(),
                _ => q.read(nsid, slba, 4096, blocks as u32).unwrap().ok(),
            };
            lat.push(t.elapsed().as_nanos() as u64);
            assert!(ok, "{what} failed");
        }
        lat
    };
    // Warm up: every block written once, so no first-touch cost lands in the figures.
    for i in 0..span / blocks {
        q.write(nsid, i * blocks, 4096, &data, false).unwrap();
    }
    println!("| operation | bs | count | median us | p90 us |");
    println!("|---|---:|---:|---:|---:|");
    for what in ["write", "write+flush", "fua write", "read"] {
        let (p50, p90) = stats(time(&mut q, what));
        println!("| {what} | {bs} | {count} | {p50:.1} | {p90:.1} |");
    }
}
