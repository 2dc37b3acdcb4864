//! `rpma-initiator bench --job FILE`: fio job files run natively against a namespace, reported
//! like fio (text, or JSON fio's tooling reads). docs/benchmarks.md lists the options taken.

pub(crate) mod job;
pub(crate) mod report;
pub(crate) mod run;

use std::io::{IsTerminal, Write as _};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rpma_initiator::QueueOptions;
use serde_json::json;

use crate::cli::{usage, Failure, Global, JobArgs};

/// Registered memory the pool may take when slots are added beyond the deepest iodepth: the
/// writes it can hold until they are durable (the replay buffer), as a disk's write cache.
/// Anonymous memory, touched only as slots are used.
const POOL_BYTES: u64 = 64 << 20;

/// The queue's depth, slots and chunk for `jobs`: chunks of the largest block size (4 KiB to
/// 16 MiB, a multiple of 4 KiB), so that a request takes one slot; the deepest iodepth in
/// flight; and [`POOL_BYTES`] of slots for the blocks written, plus the deepest iodepth: a
/// written block keeps its slot until it is durable or a newer write of the same block
/// supersedes it, and the newer write needs a slot of its own first. So a pool that holds the
/// working set (the job files' 64 MiB) and what is in flight on top needs no persist to free
/// slots; one that holds only the working set filled up at every pass over it and persisted
/// it all (on page-cache one ranged fdatasync of 64 MiB per pass: docs/benchmarks.md).
fn pool_shape(jobs: &[job::Job]) -> (usize, usize, usize) {
    let bs = jobs.iter().map(|j| j.bs).max().unwrap_or(4096);
    let chunk = bs.div_ceil(4096).clamp(1, 4096) * 4096;
    let deepest = jobs.iter().map(|j| j.iodepth).max().unwrap_or(1).max(1);
    let room = (POOL_BYTES / chunk) as usize;
    // The queue takes at most 1 GiB of replay slots (beyond those in flight).
    let cap = (QueueOptions::MAX_REPLAY_BYTES as u64 / chunk) as usize;
    (
        deepest,
        (room + deepest).min(cap.max(deepest)),
        chunk as usize,
    )
}

/// Runs every job section of `args.job`, one after another, and prints the report.
pub(crate) fn run(g: &Global, args: &JobArgs) -> Result<(), Failure> {
    let path = args.job.as_ref().expect("called with --job");
    let text = std::fs::read_to_string(path).map_err(|e| Failure {
        code: 2,
        err: anyhow::Error::new(e).context(format!("reading {}", path.display())),
    })?;
    let mut jobs = job::parse(&text).map_err(|e| usage(format!("{}: {e}", path.display())))?;
    for j in &mut jobs {
        j.copy_writes = args.copy_writes;
        j.copy_reads = args.copy_reads;
    }
    let (depth, slots, chunk) = pool_shape(&jobs);
    let conn = g.connection_with(depth, chunk, slots * chunk)?;
    let json_out = g.json || args.output_format.as_deref() == Some("json");
    let mut done = Vec::new();
    let mut visible_only = false;
    for (i, j) in jobs.iter().enumerate() {
        let live = Arc::new(run::Live::default());
        let shown = std::io::stderr().is_terminal();
        let outcome = std::thread::scope(|s| {
            let h = s.spawn(|| run::run(&conn, g.nsid, j, i, &live));
            let start = Instant::now();
            let (mut last_r, mut last_w, mut last_t) = (0u64, 0u64, start);
            while !h.is_finished() {
                std::thread::sleep(Duration::from_millis(50));
                if shown && last_t.elapsed() >= Duration::from_millis(500) {
                    let (r, w) = (
                        live.read_bytes.load(Ordering::Relaxed),
                        live.write_bytes.load(Ordering::Relaxed),
                    );
                    let dt = last_t.elapsed().as_secs_f64();
                    eprint!(
                        "\r{}",
                        progress_line(
                            j,
                            (i, jobs.len()),
                            start.elapsed(),
                            (r - last_r) as f64 / dt,
                            (w - last_w) as f64 / dt
                        )
                    );
                    let _ = std::io::stderr().flush();
                    (last_r, last_w, last_t) = (r, w, Instant::now());
                }
            }
            if shown {
                eprint!("\r\x1b[K");
            }
            h.join()
                .unwrap_or_else(|_| Err(usage("the job runner panicked".into())))
        })?;
        visible_only |= outcome.visible_only;
        done.push((j.clone(), outcome));
    }
    if json_out {
        let extra = json!({ "nsid": g.nsid, "job_file": path.display().to_string() });
        crate::cli::print_json(&report::json(&done, extra))?;
    } else {
        print!("{}", report::text(&done));
    }
    if visible_only {
        return crate::cli::require_durable(g, rpma_initiator::Durability::VisibleOnly);
    }
    Ok(())
}

/// `Jobs: 2/4 [lat-randwrite-4k] [r=0.0MiB/s,w=12.3MiB/s] [eta 00m:07s]`
pub(crate) fn progress_line(
    j: &job::Job,
    (index, count): (usize, usize),
    elapsed: Duration,
    read_bps: f64,
    write_bps: f64,
) -> String {
    let total = j.runtime.map(|r| r + j.ramp);
    let eta = total.map_or("--m:--s".to_owned(), |t| {
        let left = t.saturating_sub(elapsed).as_secs();
        format!("{:02}m:{:02}s", left / 60, left % 60)
    });
    let mib = |b: f64| b / f64::from(1 << 20);
    format!(
        "Jobs: {}/{count} [{}] [r={:.1}MiB/s,w={:.1}MiB/s] [eta {eta}]",
        index + 1,
        j.name,
        mib(read_bps),
        mib(write_bps)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pool_takes_one_slot_per_request_and_more_slots_where_they_are_small() {
        let shape = |text: &str| pool_shape(&job::parse(text).unwrap());
        // 64 MiB of slots for the blocks written, and the deepest iodepth on top (the newer
        // write of a block needs a slot before it frees the older one's).
        assert_eq!(shape("[a]\nrw=randwrite\nbs=4k\n"), (1, 16385, 4096));
        assert_eq!(
            shape("[a]\nrw=randwrite\nbs=512\niodepth=64\n"),
            (64, 16448, 4096)
        );
        assert_eq!(
            shape("[a]\nrw=write\nbs=1m\niodepth=16\n"),
            (16, 80, 1 << 20)
        );
        assert_eq!(
            shape("[a]\nrw=write\nbs=16m\niodepth=8\n[b]\nrw=read\nbs=6k\n"),
            (8, 12, 16 << 20)
        );
        assert_eq!(shape("[a]\nrw=read\nbs=6k\n"), (1, 8193, 8192));
        // Never past the queue's 1 GiB of replay slots (64 x 16 MiB), unless in flight.
        assert_eq!(
            shape("[a]\nrw=write\nbs=16m\niodepth=64\n"),
            (64, 64, 16 << 20)
        );
    }

    #[test]
    fn job_is_an_option_of_bench_and_excludes_the_quick_bench_options() {
        use clap::Parser as _;
        let parse = |args: &[&str]| {
            crate::Cli::try_parse_from(["rpma-initiator", "bench"].iter().chain(args))
        };
        let c = parse(&["--job", "j.fio", "--output-format", "json"]).unwrap();
        match c.command {
            crate::Command::Bench { fio, .. } => {
                assert_eq!(fio.job.as_deref(), Some(std::path::Path::new("j.fio")));
                assert_eq!(fio.output_format.as_deref(), Some("json"));
            }
            other => panic!("{other:?}"),
        }
        assert!(parse(&["--job", "j.fio", "--offset", "0"]).is_err());
        assert!(parse(&["--job", "j.fio", "--depth", "4"]).is_err());
        // (clap drops the requirement when --job would conflict with a quick-bench option.)
        assert!(parse(&["--output-format", "json"]).is_err(), "needs --job");
        assert!(parse(&["--job", "j.fio", "--output-format", "terse"]).is_err());
        // The quick bench as before.
        assert!(parse(&["--yes", "--count", "5"]).is_ok());
    }

    #[test]
    fn progress_line_counts_down() {
        let j = &job::parse("[lat]\nruntime=10\nramp_time=2\n").unwrap()[0];
        let l = progress_line(j, (0, 3), Duration::from_secs(4), 0.0, 2.0 * 1048576.0);
        assert_eq!(l, "Jobs: 1/3 [lat] [r=0.0MiB/s,w=2.0MiB/s] [eta 00m:08s]");
        let j = &job::parse("[x]\n").unwrap()[0];
        assert!(progress_line(j, (0, 1), Duration::ZERO, 0.0, 0.0).contains("eta --m:--s"));
    }
}
