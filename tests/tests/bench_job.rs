//! `rpma-initiator bench --job FILE`: a tiny fio job file run against a real target, with
//! verify on, read back through the JSON report the way fio's tooling reads it.

use rpma_tests::{four_namespace_target, initiator, text, Shm, Subsystem, Target};
use serde_json::Value;

const SUB: &str = "nqn.2026-11.io.rpma:benchjob";
const HOST: &str = "nqn.2026-11.io.rpma:benchjob-host";

const JOB: &str = "\
[global]
size=1m
offset=0
stonewall
verify=crc32c

[mixed]
rw=randrw
rwmixread=50
bs=4k
iodepth=4
numjobs=2
time_based
runtime=1

[durable]
rw=write
bs=512
offset=1m
size=64k
fsync=1
";

fn start() -> (tempfile::TempDir, Shm, Target) {
    four_namespace_target("benchjob", Subsystem::new(SUB).any_host(), 512)
}

/// `rpma-initiator --target ... --nsid NSID bench ARGS`.
fn bench_cmd(t: &Target, nsid: u32, args: &[&str]) -> std::process::Output {
    let mut all = rpma_tests::conn_args(&t.url(), SUB, HOST, Some(nsid));
    all.push("bench".into());
    all.extend(args.iter().map(|a| a.to_string()));
    initiator(&all.iter().map(String::as_str).collect::<Vec<_>>())
}

fn bench(t: &Target, nsid: &str, job: &std::path::Path, extra: &[&str]) -> std::process::Output {
    let mut args = vec!["--job", job.to_str().unwrap()];
    args.extend_from_slice(extra);
    bench_cmd(t, nsid.parse().unwrap(), &args)
}

/// `bench FLAG` without --job: exit 2, naming --job.
fn refused_without_a_job(t: &Target, flag: &str) {
    let o = bench_cmd(t, 1, &[flag, "--yes"]);
    assert_eq!(o.status.code(), Some(2), "{flag}: {}", text(&o));
    assert!(text(&o).contains("--job"), "{flag}: {}", text(&o));
}

#[test]
fn a_job_file_runs_verifies_and_reports_fio_json() {
    let (d, _shm, t) = start();
    let job = d.path().join("tiny.fio");
    std::fs::write(&job, JOB).unwrap();
    // nsid 4: dax (forced), 2 MiB; nsid 1: page-cache, 8 MiB.
    for nsid in ["4", "1"] {
        let o = bench(&t, nsid, &job, &["--output-format", "json"]);
        assert!(o.status.success(), "nsid {nsid}: {}", text(&o));
        let v: Value = serde_json::from_slice(&o.stdout).expect("fio JSON on stdout");
        let jobs = v["jobs"].as_array().unwrap();
        assert_eq!(jobs.len(), 2, "one job object per section: {v}");
        let mixed = &jobs[0];
        assert_eq!(mixed["jobname"], "mixed");
        for dir in ["read", "write"] {
            let d = &mixed[dir];
            assert!(d["total_ios"].as_u64().unwrap() > 0, "{dir}: {d}");
            assert!(d["iops"].as_f64().unwrap() > 0.0, "{dir}: {d}");
            assert!(d["bw_bytes"].as_u64().unwrap() > 0, "{dir}: {d}");
            assert!(d["clat_ns"]["percentile"]["50.000000"].as_u64().unwrap() > 0);
            assert!(d["lat_ns"]["mean"].as_f64().unwrap() > 0.0);
            // time_based: about the runtime (1 s), measured.
            let ms = d["runtime"].as_u64().unwrap();
            assert!((900..5000).contains(&ms), "{ms}");
        }
        assert!(mixed["verified_blocks"].as_u64().unwrap() > 0, "{mixed}");
        let durable = &jobs[1];
        // Not time_based: exactly size/bs writes, each acknowledged durable, then read back.
        assert_eq!(durable["write"]["total_ios"], 128, "{durable}");
        assert_eq!(durable["write"]["io_bytes"], 65536);
        assert_eq!(durable["read"]["total_ios"], 0);
        assert_eq!(durable["verified_blocks"], 128);
    }
    // The bytes are where the verify pattern put them: a second, read-only pass checks them.
    let reread = d.path().join("reread.fio");
    std::fs::write(
        &reread,
        "[r]\nrw=read\nbs=512\noffset=1m\nsize=64k\nverify=crc32c\n",
    )
    .unwrap();
    let o = bench(&t, "1", &reread, &[]);
    assert!(o.status.success(), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("r: (groupid=0, jobs=1): err= 0"), "{out}");
    assert!(out.contains("read: IOPS="), "{out}");
    assert!(out.contains("clat percentiles"), "{out}");
    assert!(out.contains("verify       : 128 blocks match"), "{out}");
}

#[test]
fn an_unknown_job_option_exits_2_and_names_it() {
    let (d, _shm, t) = start();
    let job = d.path().join("bad.fio");
    std::fs::write(&job, "[j]\nrw=read\nbs=4k\niodepth_batch=8\n").unwrap();
    let o = bench(&t, "1", &job, &[]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(
        text(&o).contains("unknown job option `iodepth_batch`"),
        "{}",
        text(&o)
    );
    // A region past the namespace is refused before anything is written.
    std::fs::write(&job, "[j]\nrw=write\nbs=4k\nsize=16m\n").unwrap();
    let o = bench(&t, "1", &job, &[]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("does not fit"), "{}", text(&o));
}

/// A job's started reads go into registered buffers (no copy out) unless `--copy-reads`: either
/// way a verifying read job checks the bytes that landed (a block overwritten behind its back
/// fails it, naming the offset); and the flag means nothing without --job.
#[test]
fn reads_go_into_registered_buffers_and_are_verified_there() {
    let (d, _shm, t) = start();
    let write = d.path().join("w.fio");
    std::fs::write(
        &write,
        "[w]\nrw=write\nbs=16k\noffset=0\nsize=1m\niodepth=4\nverify=crc32c\n",
    )
    .unwrap();
    let read = d.path().join("r.fio");
    std::fs::write(
        &read,
        "[r]\nrw=randread\nbs=16k\noffset=0\nsize=1m\niodepth=4\nverify=crc32c\n\
         time_based\nruntime=1\n",
    )
    .unwrap();
    let conn = rpma_tests::conn_args(&t.url(), SUB, HOST, Some(4));
    for extra in [&[][..], &["--copy-reads"][..]] {
        let o = bench(&t, "4", &write, &[]);
        assert!(o.status.success(), "{extra:?}: {}", text(&o));
        let o = bench(&t, "4", &read, extra);
        assert!(o.status.success(), "{extra:?}: {}", text(&o));
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(out.contains("read: IOPS="), "{extra:?}: {out}");
        assert!(out.contains("blocks match"), "{extra:?}: {out}");
        // What went through the bounce buffers: nothing read, or every byte read.
        let line = out
            .lines()
            .find(|l| l.contains("bounce copy"))
            .unwrap_or_else(|| panic!("{out}"));
        let out_bytes: u64 = line
            .split_whitespace()
            .rev()
            .nth(2)
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("{line}"));
        if extra.is_empty() {
            assert_eq!(out_bytes, 0, "read into registered buffers: {line}");
        } else {
            assert!(out_bytes >= 16384, "copied out of the bounce slots: {line}");
        }
        // One block's bytes changed behind the job's back: every read of it fails the check.
        rpma_tests::cli_write_with(&conn, d.path(), 5 * 16384 + 100, &[0x5Au8; 7]);
        let o = bench(&t, "4", &read, extra);
        assert!(!o.status.success(), "{extra:?}: {}", text(&o));
        assert!(
            text(&o).contains(&format!("verify failed at offset {}", 5 * 16384 + 100)),
            "{extra:?}: {}",
            text(&o)
        );
    }
    refused_without_a_job(&t, "--copy-reads");
}

/// A job without verify writes from a registered buffer (no bounce copy): its bytes land, on
/// the started path (fsync=0) and the durable batch path alike; `--copy-writes` writes the same
/// bytes through the bounce buffers; and the flag means nothing without --job.
#[test]
fn writes_without_verify_go_from_a_registered_buffer_and_land() {
    let (d, _shm, t) = start();
    let job = d.path().join("plain.fio");
    std::fs::write(
        &job,
        "[global]\nstonewall\n\
         [s]\nrw=write\nbs=4k\noffset=0\nsize=256k\niodepth=4\n\
         [b]\nrw=randwrite\nbs=64k\noffset=256k\nsize=512k\niodepth=2\nfsync=1\n",
    )
    .unwrap();
    let conn = rpma_tests::conn_args(&t.url(), SUB, HOST, Some(1));
    for (extra, fill) in [(&[][..], 0u8), (&["--copy-writes"][..], 0x11)] {
        // Something else there first, so that the bytes read back are the job's.
        rpma_tests::cli_write_with(&conn, d.path(), 0, &vec![fill; 768 << 10]);
        let o = bench(&t, "1", &job, extra);
        assert!(o.status.success(), "{extra:?}: {}", text(&o));
        let back = rpma_tests::cli_read_with(&conn, d.path(), 0, 768 << 10);
        let (written, rest) = back.split_at(256 << 10);
        assert!(
            written.iter().all(|&b| b == 0xA5),
            "{extra:?}: the started writes"
        );
        // A random job of 8 blocks at depth 2 writes most of its region, not all of it.
        let blocks = rest
            .chunks(64 << 10)
            .filter(|c| c.iter().all(|&b| b == 0xA5));
        assert!(blocks.count() >= 4, "{extra:?}: the durable batch writes");
        assert!(
            rest.chunks(64 << 10)
                .all(|c| c.iter().all(|&b| b == 0xA5) || c.iter().all(|&b| b == fill)),
            "{extra:?}: every block whole"
        );
    }
    refused_without_a_job(&t, "--copy-writes");
}

rpma_tests::rdma_runs!(a_job_file_runs_verifies_and_reports_fio_json,);
