//! Benchmark (not a test): what the copy in front of the sender's CRC costs on memory the CPU
//! has not touched lately, as a Read Response's payload usually is.
//!
//! `cargo run --release -p rpma-common --example crc_volatile [-- --bytes N --reps N]`
//!
//! The sender computes the MPA CRC of a payload in registered memory with
//! `crc32c_append_volatile`: copied out a chunk at a time into a buffer of its own, the CRC over
//! that, because no Rust reference may cover memory peers write into (common/src/volatile.rs).
//! Here, per payload of `--bytes` (default 4096) at a random aligned offset of a 1 GiB buffer
//! (far more than the caches hold):
//! - `volatile`: `crc32c_append_volatile`, as the sender runs it;
//! - `direct`: `crc32c` over a slice of the same bytes (sound here: this buffer is the
//!   program's own, no one else writes it): what a CRC that reads registered memory itself
//!   would cost;
//! - `copy`: the copy alone, into an L1-sized buffer;
//! - each of the first two followed by a copy of the same bytes, as the kernel's copy into the
//!   socket follows the CRC.
//!
//! ns per payload, the median of `--reps` rounds (default 7) of 200,000 payloads each, after
//! one round of warm-up.

use std::time::Instant;

use rpma_common::fabric::soft::wire::crc::{crc32c, crc32c_append_volatile};
use rpma_common::volatile::VolatileSlice;

const SPAN: usize = 1 << 30;
const PER_ROUND: usize = 200_000;

fn main() {
    let mut bytes = 4096usize;
    let mut reps = 7usize;
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < args.len() {
        let v = args.get(i + 1).and_then(|s| s.parse().ok());
        match (args[i].as_str(), v) {
            ("--bytes", Some(n)) if n > 0 && n <= 1 << 20 => bytes = n,
            ("--reps", Some(n)) if n > 0 => reps = n,
            _ => {
                eprintln!("usage: crc_volatile [--bytes 1..=1048576] [--reps N>0]");
                std::process::exit(2);
            }
        }
        i += 2;
    }
    let mut buf: Vec<u8> = (0..SPAN).map(|i| (i * 31 + (i >> 12)) as u8).collect();
    let mut out = vec![0u8; bytes];
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let offs: Vec<usize> = (0..PER_ROUND)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x as usize % (SPAN / bytes)) * bytes
        })
        .collect();
    let base = buf.as_mut_ptr();
    let cases: [(&str, u8); 5] = [
        ("volatile", 0),
        ("direct", 1),
        ("copy", 2),
        ("volatile + copy", 3),
        ("direct + copy", 4),
    ];
    let mut ns: Vec<Vec<f64>> = vec![Vec::new(); cases.len()];
    for round in 0..=reps {
        for (c, &(_, which)) in cases.iter().enumerate() {
            let t = Instant::now();
            let mut acc = 0u32;
            for &o in &offs {
                // SAFETY: o + bytes <= SPAN, inside `buf`, which lives to the end of main and
                // which nothing writes meanwhile.
                let (p, s) = unsafe {
                    (
                        VolatileSlice::new(base.add(o), bytes),
                        std::slice::from_raw_parts(base.add(o), bytes),
                    )
                };
                acc ^= match which {
                    0 => crc32c_append_volatile(0, p),
                    1 => crc32c(s),
                    2 => {
                        out.copy_from_slice(s);
                        u32::from(out[7])
                    }
                    3 => {
                        let c = crc32c_append_volatile(0, p);
                        out.copy_from_slice(s);
                        c ^ u32::from(out[7])
                    }
                    _ => {
                        let c = crc32c(s);
                        out.copy_from_slice(s);
                        c ^ u32::from(out[7])
                    }
                };
            }
            std::hint::black_box(acc);
            if round > 0 {
                ns[c].push(t.elapsed().as_nanos() as f64 / PER_ROUND as f64);
            }
        }
    }
    println!("# {bytes} B payloads at random offsets of 1 GiB, median of {reps} rounds");
    for (c, (name, _)) in cases.iter().enumerate() {
        let v = &mut ns[c];
        v.sort_by(f64::total_cmp);
        println!("{name:16} {:8.1} ns", v[v.len() / 2]);
    }
}
