//! The report, shaped like fio's: `--output-format=json` gives the fields fio's own tooling
//! reads (jobs[].read/write: io_bytes, bw_bytes, bw (KiB/s), iops, runtime (ms), total_ios,
//! clat_ns/lat_ns with min/max/mean/stddev/N and clat_ns.percentile["50.000000"]), one job
//! object per job section; `normal` gives fio's text summary.

use serde_json::{json, Map, Value};

use super::job::Job;
use super::run::{Dir, Outcome};

/// fio's default percentile list.
pub(crate) const PERCENTILES: [f64; 17] = [
    1.0, 5.0, 10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0, 90.0, 95.0, 99.0, 99.5, 99.9, 99.95,
    99.99,
];

fn secs(o: &Outcome) -> f64 {
    o.runtime.as_secs_f64().max(1e-9)
}

fn lat_stats(d: &Dir, with_percentiles: bool) -> Value {
    let h = &d.clat;
    let mut m = Map::new();
    let n = h.len();
    m.insert("min".into(), json!(if n == 0 { 0 } else { h.min() }));
    m.insert("max".into(), json!(h.max()));
    m.insert("mean".into(), json!(if n == 0 { 0.0 } else { h.mean() }));
    m.insert("stddev".into(), json!(if n == 0 { 0.0 } else { h.stdev() }));
    m.insert("N".into(), json!(n));
    if with_percentiles && n > 0 {
        let p: Map<String, Value> = PERCENTILES
            .iter()
            .map(|&q| (format!("{q:.6}"), json!(h.value_at_percentile(q))))
            .collect();
        m.insert("percentile".into(), Value::Object(p));
    }
    Value::Object(m)
}

fn dir_json(d: &Dir, o: &Outcome) -> Value {
    let s = secs(o);
    let bw_bytes = (d.bytes as f64 / s) as u64;
    json!({
        "io_bytes": d.bytes,
        "io_kbytes": d.bytes / 1024,
        "bw_bytes": bw_bytes,
        "bw": bw_bytes / 1024,
        "iops": d.ios as f64 / s,
        "runtime": o.runtime.as_millis() as u64,
        "total_ios": d.ios,
        "short_ios": 0,
        "drop_ios": 0,
        // Submission is not timed apart: the batch call is the whole request.
        "slat_ns": { "min": 0, "max": 0, "mean": 0.0, "stddev": 0.0, "N": 0 },
        "clat_ns": lat_stats(d, true),
        "lat_ns": lat_stats(d, false),
    })
}

/// The fio JSON document for these sections.
pub(crate) fn json(jobs: &[(Job, Outcome)], extra: Value) -> Value {
    let list: Vec<Value> = jobs
        .iter()
        .enumerate()
        .map(|(i, (j, o))| {
            let opts: Map<String, Value> = j
                .options
                .iter()
                .map(|(k, v)| (k.clone(), json!(v)))
                .collect();
            let pct = |t: std::time::Duration| 100.0 * t.as_secs_f64() / secs(o);
            json!({
                "jobname": j.name,
                "groupid": i,
                "error": 0,
                "job options": opts,
                "read": dir_json(&o.read, o),
                "write": dir_json(&o.write, o),
                "trim": dir_json(&Outcome::empty().read, o),
                // fio times an fsync apart; here a durable write's clat includes it.
                "sync": { "total_ios": 0, "lat_ns": lat_stats(&Outcome::empty().read, false) },
                "job_runtime": o.runtime.as_millis() as u64,
                "usr_cpu": pct(o.usr),
                "sys_cpu": pct(o.sys),
                "numjobs": j.numjobs,
                "iodepth": j.iodepth,
                "verified_blocks": o.verified,
            })
        })
        .collect();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    json!({
        "fio version": format!("rpma-initiator-{}", env!("CARGO_PKG_VERSION")),
        "timestamp": now.as_secs(),
        "timestamp_ms": now.as_millis() as u64,
        "global options": {},
        "rpma": extra,
        "jobs": list,
    })
}

/// fio's unit choice for a latency in ns: (divisor, unit name).
fn unit(max_ns: u64) -> (f64, &'static str) {
    if max_ns >= 10_000_000 {
        (1e6, "msec")
    } else if max_ns >= 10_000 {
        (1e3, "usec")
    } else {
        (1.0, "nsec")
    }
}

fn human_rate(bytes_per_s: f64) -> String {
    let mib = bytes_per_s / f64::from(1 << 20);
    if mib >= 1024.0 {
        format!("{:.2}GiB/s ({:.1}GB/s)", mib / 1024.0, bytes_per_s / 1e9)
    } else if mib >= 1.0 {
        format!("{mib:.1}MiB/s ({:.1}MB/s)", bytes_per_s / 1e6)
    } else {
        format!(
            "{:.1}KiB/s ({:.1}kB/s)",
            bytes_per_s / 1024.0,
            bytes_per_s / 1e3
        )
    }
}

fn human_iops(iops: f64) -> String {
    if iops >= 10_000.0 {
        format!("{:.1}k", iops / 1000.0)
    } else {
        format!("{iops:.0}")
    }
}

fn dir_text(name: &str, d: &Dir, o: &Outcome, out: &mut String) {
    if d.ios == 0 {
        return;
    }
    let s = secs(o);
    let h = &d.clat;
    out.push_str(&format!(
        "  {name}: IOPS={}, BW={}({}/{}msec)\n",
        human_iops(d.ios as f64 / s),
        human_rate(d.bytes as f64 / s),
        rpma_common::units::format_size(d.bytes).replace(' ', ""),
        o.runtime.as_millis()
    ));
    let (div, u) = unit(h.max());
    for what in ["clat", " lat"] {
        out.push_str(&format!(
            "    {what} ({u}): min={:.0}, max={:.0}, avg={:.2}, stdev={:.2}\n",
            h.min() as f64 / div,
            h.max() as f64 / div,
            h.mean() / div,
            h.stdev() / div
        ));
    }
    out.push_str(&format!("    clat percentiles ({u}):\n"));
    for row in PERCENTILES.chunks(4) {
        let cells: Vec<String> = row
            .iter()
            .map(|&q| {
                format!(
                    "{:>5.2}th=[{:>5.0}]",
                    q,
                    h.value_at_percentile(q) as f64 / div
                )
            })
            .collect();
        out.push_str(&format!("     | {}\n", cells.join(", ")));
    }
}

/// fio's text summary.
pub(crate) fn text(jobs: &[(Job, Outcome)]) -> String {
    let mut out = String::new();
    for (i, (j, o)) in jobs.iter().enumerate() {
        out.push_str(&format!(
            "{}: (groupid={i}, jobs={}): err= 0: pid={}\n",
            j.name,
            j.numjobs,
            std::process::id()
        ));
        dir_text("read", &o.read, o, &mut out);
        dir_text("write", &o.write, o, &mut out);
        let pct = |t: std::time::Duration| 100.0 * t.as_secs_f64() / secs(o);
        out.push_str(&format!(
            "  cpu          : usr={:.2}%, sys={:.2}%\n  IO depths    : {}=100.0%\n",
            pct(o.usr),
            pct(o.sys),
            j.iodepth
        ));
        if o.verified > 0 {
            out.push_str(&format!("  verify       : {} blocks match\n", o.verified));
        }
        out.push_str(&format!(
            "  bounce copy  : writes {} bytes in, reads {} bytes out\n",
            o.copied.0, o.copied.1
        ));
        out.push('\n');
    }
    out.push_str("Run status (each job section its own group):\n");
    for (i, (_, o)) in jobs.iter().enumerate() {
        for (name, d) in [("READ", &o.read), ("WRITE", &o.write)] {
            if d.ios > 0 {
                out.push_str(&format!(
                    "  group {i}: {name}: bw={}, io={}, run={}msec\n",
                    human_rate(d.bytes as f64 / secs(o)),
                    rpma_common::units::format_size(d.bytes).replace(' ', ""),
                    o.runtime.as_millis()
                ));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn sample() -> Vec<(Job, Outcome)> {
        let job = super::super::job::parse("[w]\nrw=randrw\nbs=4k\niodepth=2\n").unwrap();
        let mut o = Outcome::empty();
        o.runtime = Duration::from_secs(2);
        for us in 1..=100 {
            o.write.clat.record(us * 1000).unwrap();
            o.write.ios += 1;
            o.write.bytes += 4096;
        }
        o.read.clat.record(5000).unwrap();
        o.read.ios = 1;
        o.read.bytes = 4096;
        vec![(job[0].clone(), o.clone()), (job[0].clone(), o)]
    }

    #[test]
    fn json_has_the_fields_fio_tooling_reads() {
        let text = serde_json::to_string(&json(&sample(), json!({}))).unwrap();
        // Read back as a consumer would.
        let v: Value = serde_json::from_str(&text).unwrap();
        let jobs = v["jobs"].as_array().unwrap();
        assert_eq!(jobs.len(), 2, "one job object per section");
        let w = &jobs[0]["write"];
        assert_eq!(jobs[0]["jobname"], "w");
        assert_eq!(w["total_ios"], 100);
        assert_eq!(w["io_bytes"], 409_600);
        assert!((w["iops"].as_f64().unwrap() - 50.0).abs() < 1e-9);
        assert_eq!(w["bw_bytes"], 204_800);
        assert_eq!(w["bw"], 200);
        assert_eq!(w["runtime"], 2000);
        let p50 = w["clat_ns"]["percentile"]["50.000000"].as_u64().unwrap();
        assert!((49_900..=50_100).contains(&p50), "{p50}");
        let p99 = w["clat_ns"]["percentile"]["99.000000"].as_u64().unwrap();
        assert!((98_900..=99_100).contains(&p99), "{p99}");
        assert!(w["clat_ns"]["percentile"]["99.990000"].is_u64());
        assert_eq!(w["lat_ns"]["N"], 100);
        let mean = w["lat_ns"]["mean"].as_f64().unwrap();
        assert!((mean - 50_500.0).abs() < 100.0, "{mean}");
        assert!(w["lat_ns"]["min"].as_u64().unwrap() <= 1000);
        assert_eq!(jobs[0]["read"]["total_ios"], 1);
        assert_eq!(jobs[0]["trim"]["total_ios"], 0);
        assert_eq!(jobs[0]["sync"]["total_ios"], 0);
        assert_eq!(jobs[0]["job options"]["rw"], "randrw");
        assert!(v["fio version"]
            .as_str()
            .unwrap()
            .starts_with("rpma-initiator"));
    }

    #[test]
    fn text_reads_like_fio() {
        let t = text(&sample());
        assert!(t.contains("w: (groupid=0, jobs=1): err= 0"), "{t}");
        assert!(t.contains("  write: IOPS=50, BW="), "{t}");
        assert!(t.contains("clat percentiles (usec):"), "{t}");
        assert!(t.contains("50.00th=[   50]"), "{t}");
        assert!(t.contains("WRITE: bw="), "{t}");
    }
}
