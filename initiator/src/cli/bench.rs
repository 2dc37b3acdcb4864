//! `rpma-initiator bench`: a short QD1 latency run (durable writes, then reads) and a bandwidth
//! run (writes made durable at the end, then reads) on one queue. Numbers, not a benchmark
//! suite: bench/ runs this beside the fabric and pmem benchmarks and prints medians.

use std::time::{Duration, Instant};

use rpma_initiator::{Choice, Durability};
use serde::Serialize;

use super::args::Global;
use super::failure::{usage, Failure};
use super::json::print_json;

/// What to run.
#[derive(Debug)]
pub(crate) struct Params {
    /// None: not given (refused unless `yes`).
    pub(crate) offset: Option<u64>,
    /// Overwrite from offset 0 when no offset was given.
    pub(crate) yes: bool,
    pub(crate) io_size: u64,
    pub(crate) count: u32,
    pub(crate) total: u64,
    pub(crate) depth: usize,
}

#[derive(Debug, Serialize, PartialEq)]
pub(crate) struct Latency {
    pub(crate) avg_us: f64,
    pub(crate) p50_us: f64,
    pub(crate) p99_us: f64,
    pub(crate) max_us: f64,
}

/// Where the overwritten range starts: an explicit --offset, or 0 with --yes.
fn start_offset(p: &Params) -> Result<u64, Failure> {
    match (p.offset, p.yes) {
        (Some(o), _) => Ok(o),
        (None, true) => Ok(0),
        (None, false) => Err(usage(
            "bench overwrites up to --total bytes of the namespace from --offset on: give \
             --offset explicitly (where the range may start), or --yes to overwrite from 0"
                .into(),
        )),
    }
}

/// Summary of per-operation times.
pub(crate) fn summarize(mut t: Vec<Duration>) -> Latency {
    if t.is_empty() {
        return Latency {
            avg_us: 0.0,
            p50_us: 0.0,
            p99_us: 0.0,
            max_us: 0.0,
        };
    }
    t.sort();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let pick = |q: f64| t[((t.len() - 1) as f64 * q).round() as usize];
    Latency {
        avg_us: t.iter().map(|d| us(*d)).sum::<f64>() / t.len() as f64,
        p50_us: us(pick(0.5)),
        p99_us: us(pick(0.99)),
        max_us: us(t[t.len() - 1]),
    }
}

#[derive(Serialize)]
struct Out {
    nsid: u32,
    method: String,
    domain: String,
    /// Whether the frames carried MPA CRC32c (`null`: not the tcp transport).
    crc: Option<bool>,
    io_size: u64,
    count: u32,
    write_latency: Latency,
    read_latency: Latency,
    total: u64,
    depth: usize,
    write_mib_s: f64,
    read_mib_s: f64,
}

pub(crate) fn run(g: &Global, p: &Params) -> Result<(), Failure> {
    if p.io_size == 0 || p.count == 0 || p.total == 0 {
        return Err(usage(
            "--io-size, --count and --total must be above 0".into(),
        ));
    }
    if !(1..=128).contains(&p.depth) {
        return Err(usage(format!("--depth {} is not in 1..=128", p.depth)));
    }
    let offset = start_offset(p)?;
    let mut q = g.connection(p.depth)?.open_queue(0)?;
    let crc = q.crc();
    let mut ns = q.namespace(g.nsid)?;
    let d = ns.descriptor().clone();
    let room = d.size.saturating_sub(offset);
    if p.io_size > room {
        return Err(usage(format!(
            "--io-size {} does not fit nsid {} past offset {}",
            p.io_size, d.nsid, offset
        )));
    }
    let method = match ns.method()? {
        Choice::Method(m) => m.to_string(),
        Choice::VisibleOnly => "visible only (volatile)".to_owned(),
    };
    // Latency: QD1, cycling over the room the namespace has (at most 64 distinct blocks).
    let slots = (room / p.io_size).clamp(1, 64);
    let buf: Vec<u8> = (0..p.io_size).map(|i| i as u8).collect();
    let mut back = vec![0u8; p.io_size as usize];
    let mut wt = Vec::with_capacity(p.count as usize);
    let mut last = Durability::VisibleOnly;
    for i in 0..u64::from(p.count) {
        let off = offset + (i % slots) * p.io_size;
        let t = Instant::now();
        last = ns.write_durable(off, &buf)?;
        wt.push(t.elapsed());
    }
    let mut rt = Vec::with_capacity(p.count as usize);
    for i in 0..u64::from(p.count) {
        let off = offset + (i % slots) * p.io_size;
        let t = Instant::now();
        ns.read_at(off, &mut back)?;
        rt.push(t.elapsed());
    }
    // Bandwidth: the requests of each 4 MiB call are in flight together (up to --depth).
    let total = p.total.min(room);
    let piece = (4u64 << 20).min(total) as usize;
    let big = vec![0xA5u8; piece];
    let t = Instant::now();
    let mut at = 0;
    while at < total {
        let n = (total - at).min(piece as u64) as usize;
        ns.write_at(offset + at, &big[..n])?;
        at += n as u64;
    }
    ns.persist_written(offset, total)?;
    let write_secs = t.elapsed().as_secs_f64();
    let mut rbuf = vec![0u8; piece];
    let t = Instant::now();
    let mut at = 0;
    while at < total {
        let n = (total - at).min(piece as u64) as usize;
        ns.read_at(offset + at, &mut rbuf[..n])?;
        at += n as u64;
    }
    let read_secs = t.elapsed().as_secs_f64();
    let _ = q.close();
    if last == Durability::VisibleOnly && g.visible_ok {
        eprintln!(
            "rpma-initiator: warning: namespace {} is volatile: the writes were visible, NOT durable",
            g.nsid
        );
    }
    let mib = total as f64 / f64::from(1 << 20);
    let out = Out {
        nsid: g.nsid,
        method,
        domain: d.domain_label(),
        crc,
        io_size: p.io_size,
        count: p.count,
        write_latency: summarize(wt),
        read_latency: summarize(rt),
        total,
        depth: p.depth,
        write_mib_s: mib / write_secs.max(1e-9),
        read_mib_s: mib / read_secs.max(1e-9),
    };
    if g.json {
        print_json(&out)?;
        return crate::cli::require_durable(g, last);
    }
    let show = |l: &Latency| {
        format!(
            "avg {:.1} us, p50 {:.1} us, p99 {:.1} us, max {:.1} us",
            l.avg_us, l.p50_us, l.p99_us, l.max_us
        )
    };
    println!(
        "latency, QD1, {} x {}:",
        out.count,
        rpma_common::units::format_size(out.io_size)
    );
    println!(
        "  durable write ({}, {}): {}",
        out.method,
        out.domain,
        show(&out.write_latency)
    );
    println!("  read: {}", show(&out.read_latency));
    println!(
        "bandwidth, up to {} in flight, {}:",
        out.depth,
        rpma_common::units::format_size(out.total)
    );
    println!("  write (durable at the end): {:.1} MiB/s", out.write_mib_s);
    println!("  read: {:.1} MiB/s", out.read_mib_s);
    match out.crc {
        Some(true) => println!("tcp frames with CRC32c"),
        Some(false) => println!("tcp frames WITHOUT CRC32c (--crc off, target crc = false)"),
        None => {}
    }
    crate::cli::require_durable(g, last)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_of_known_samples() {
        let t: Vec<Duration> = (1..=100).rev().map(Duration::from_micros).collect();
        let l = summarize(t);
        assert!((l.avg_us - 50.5).abs() < 1e-6, "{l:?}");
        assert!(
            (l.p50_us - 51.0).abs() < 1e-6 || (l.p50_us - 50.0).abs() < 1e-6,
            "{l:?}"
        );
        assert!((l.p99_us - 99.0).abs() < 1e-6, "{l:?}");
        assert!((l.max_us - 100.0).abs() < 1e-6, "{l:?}");
        assert_eq!(summarize(Vec::new()).max_us, 0.0);
    }

    #[test]
    fn the_overwritten_range_needs_an_explicit_offset_or_yes() {
        let p = |offset, yes| Params {
            offset,
            yes,
            io_size: 4096,
            count: 1,
            total: 4096,
            depth: 1,
        };
        let e = start_offset(&p(None, false)).err().unwrap();
        assert_eq!(e.code, 2);
        assert!(e.err.to_string().contains("--offset"), "{}", e.err);
        assert_eq!(start_offset(&p(None, true)).ok(), Some(0));
        assert_eq!(start_offset(&p(Some(8192), false)).ok(), Some(8192));
    }
}
