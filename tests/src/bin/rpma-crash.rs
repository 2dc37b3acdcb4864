//! `rpma-crash`: the crash-consistency harness (docs/reliability.md). It starts a real
//! `rpma-target` (from the same build directory) with its namespaces under the power-loss
//! simulation, writes durable self-describing blocks through every durability method and the
//! NBD export, kills the target (SIGKILL) at random moments, restarts it and checks every
//! acknowledged block.
//!
//! ```text
//! rpma-crash [--cycles N] [--seed S] [--run-ms MIN-MAX] [--eviction-percent P]
//!            [--eviction-interval-ms MS] [--methods apm,gpspm,flush,nbd-fua,nbd-flush] [--media page-cache,dax]
//!            [--blocks-per-writer N] [--broken-persist] [--results FILE] [--json FILE]
//!            [--keep] [--quiet] [--transport tcp|rdma]
//! ```
//!
//! `--transport rdma` runs it over the RDMA device `RPMA_TEST_RDMA_DEVICE` names, listening on
//! `RPMA_TEST_RDMA_ADDR` (docs/rdma.md); the default is tcp on 127.0.0.1. Over rdma the target
//! declares no `direct_write_to_pmem` (the simulation's caches are lost at a power loss, as
//! an ADR platform's are: APM would be a false "durable" there), so the methods default to
//! the ones it then offers (gpspm, nbd-fua, nbd-flush), and where the device cannot register
//! file pages (`RPMA_TEST_RDMA_SCRATCH`, docs/rdma.md) the media to `dax`.
//!
//! Exit status: 0 nothing acknowledged was lost; 1 an acknowledged write was lost (or a block
//! is corrupt); 2 the run is inconclusive (a writer failed before any kill, or a method got no
//! acknowledgement); 64 bad usage.

use std::process::ExitCode;

use rpma_tests::crash::{run, Medium, Method, Options};
use rpma_tests::transport::{self, Transport};

const USAGE: &str = "usage: rpma-crash [--cycles N] [--seed S] [--run-ms MIN-MAX] \
[--eviction-percent P] [--eviction-interval-ms MS] [--methods apm,gpspm,flush,nbd-fua,nbd-flush] [--media page-cache,dax] \
[--blocks-per-writer N] [--broken-persist] [--results FILE] [--json FILE] [--keep] [--quiet] \
[--transport tcp|rdma]";

struct Args {
    opts: Options,
    results: Option<String>,
    json: Option<String>,
    quiet: bool,
    transport: Transport,
}

fn number<T: std::str::FromStr>(flag: &str, v: Option<String>) -> Result<T, String> {
    let v = v.ok_or_else(|| format!("{flag} needs a value"))?;
    v.parse()
        .map_err(|_| format!("{flag} {v:?}: not a number in range"))
}

fn list<T>(flag: &str, v: Option<String>, parse: fn(&str) -> Option<T>) -> Result<Vec<T>, String> {
    let v = v.ok_or_else(|| format!("{flag} needs a value"))?;
    v.split(',')
        .map(|s| parse(s).ok_or_else(|| format!("{flag}: unknown {s:?}")))
        .collect()
}

fn parse(mut it: impl Iterator<Item = String>) -> Result<Args, String> {
    let mut a = Args {
        opts: Options {
            cycles: 200,
            seed: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_secs()),
            ..Options::default()
        },
        results: None,
        json: None,
        quiet: false,
        transport: Transport::Tcp,
    };
    let (mut methods_given, mut media_given) = (false, false);
    while let Some(flag) = it.next() {
        let o = &mut a.opts;
        match flag.as_str() {
            "--cycles" => o.cycles = number(&flag, it.next())?,
            "--seed" => o.seed = number(&flag, it.next())?,
            "--run-ms" => {
                let v: String = it.next().ok_or("--run-ms needs MIN-MAX")?;
                let (lo, hi) = v.split_once('-').ok_or("--run-ms needs MIN-MAX")?;
                o.run_ms = (
                    number(&flag, Some(lo.to_owned()))?,
                    number(&flag, Some(hi.to_owned()))?,
                );
                if o.run_ms.0 > o.run_ms.1 {
                    return Err(format!("--run-ms {v}: MIN is more than MAX"));
                }
            }
            "--eviction-percent" => {
                o.eviction_percent = number(&flag, it.next())?;
                if o.eviction_percent > 100 {
                    return Err("--eviction-percent: 0 to 100".into());
                }
            }
            "--eviction-interval-ms" => {
                o.eviction_interval_ms = number(&flag, it.next())?;
                if o.eviction_interval_ms > 60_000 {
                    return Err("--eviction-interval-ms: 0 to 60000".into());
                }
            }
            "--methods" => {
                o.methods = list(&flag, it.next(), Method::parse)?;
                methods_given = true;
            }
            "--media" => {
                o.media = list(&flag, it.next(), Medium::parse)?;
                media_given = true;
            }
            "--blocks-per-writer" => {
                o.blocks_per_writer = number(&flag, it.next())?;
                if o.blocks_per_writer < 2 {
                    return Err("--blocks-per-writer: at least 2".into());
                }
            }
            "--broken-persist" => o.broken_persist = true,
            "--keep" => o.keep = true,
            "--results" => a.results = Some(it.next().ok_or("--results needs a file")?),
            "--json" => a.json = Some(it.next().ok_or("--json needs a file")?),
            "--quiet" => a.quiet = true,
            "--transport" => {
                a.transport = match it.next().as_deref() {
                    Some("tcp") => Transport::Tcp,
                    Some("rdma") => Transport::rdma_from_env()?,
                    Some(t) => return Err(format!("--transport {t:?}: tcp or rdma")),
                    None => return Err("--transport needs tcp or rdma".into()),
                }
            }
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    if matches!(a.transport, Transport::Rdma { .. }) {
        if !methods_given {
            a.opts.methods = vec![Method::Gpspm, Method::NbdFua, Method::NbdFlush];
        }
        if !media_given && a.transport.file_pages_pinned() {
            a.opts.media = vec![Medium::Dax];
        }
    }
    if a.opts.cycles == 0 || a.opts.methods.is_empty() || a.opts.media.is_empty() {
        return Err("nothing to run: give at least one cycle, method and medium".into());
    }
    Ok(a)
}

fn main() -> ExitCode {
    let a = match parse(std::env::args().skip(1)) {
        Ok(a) => a,
        Err(e) => {
            if !e.is_empty() {
                eprintln!("rpma-crash: {e}");
            }
            eprintln!("{USAGE}");
            return ExitCode::from(64);
        }
    };
    let quiet = a.quiet;
    let mut report = None;
    transport::on(a.transport, || {
        report = Some(run(&a.opts, |line| {
            if !quiet {
                eprintln!("rpma-crash: {line}");
            }
        }))
    });
    let report = report.expect("the run reports");
    let summary = report.summary();
    println!("{summary}");
    for p in &report.problems {
        println!("problem: {p}");
    }
    if let Some(d) = &report.dir {
        println!("run directory kept: {}", d.display());
    }
    if let Some(f) = &a.results {
        if let Err(e) = std::fs::write(f, format!("{summary}\n")) {
            eprintln!("rpma-crash: cannot write {f}: {e}");
        }
    }
    if let Some(f) = &a.json {
        let j = serde_json::to_string_pretty(&report).expect("the report serialises");
        if let Err(e) = std::fs::write(f, j + "\n") {
            eprintln!("rpma-crash: cannot write {f}: {e}");
        }
    }
    if !report.passed() {
        ExitCode::from(1)
    } else if report.hollow().is_some() {
        ExitCode::from(2)
    } else {
        ExitCode::SUCCESS
    }
}
