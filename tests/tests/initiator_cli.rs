//! `rpma-initiator`'s data subcommands as real processes against a real `rpma-target`: output
//! (text and JSON), the documented exit codes, and durability across a SIGKILL of the target.

use rpma_common::proto::PersistenceDomain;
use rpma_initiator::PersistMethod;
use rpma_tests::{four_namespace_target, initiator, text, Shm, Subsystem, Target, Transport};

const SUB: &str = "nqn.2026-11.io.rpma:cli-data";
const HOST: &str = "nqn.2026-11.io.rpma:cli-data-host";

/// A target in a scratch dir of its own serving SUB to HOST: [`four_namespaces`], nsid 2 of
/// 4096-byte blocks, nsid 3 on `/dev/shm/rpma-test-PID-N-TAG`.
fn start(tag: &str) -> (tempfile::TempDir, Shm, Target) {
    four_namespace_target(tag, Subsystem::new(SUB).host(HOST), 4096)
}

/// The words of a command line (none of which holds a space).
fn words(line: &str) -> Vec<&str> {
    line.split_whitespace().collect()
}

/// The initiator's arguments: the target at `url`, subsystem and host given, then `args`.
fn with_target<'a>(url: &'a str, args: &[&'a str]) -> Vec<&'a str> {
    let mut a = vec!["--target", url, "--nqn", SUB, "--hostnqn", HOST];
    a.extend_from_slice(args);
    a
}

/// Runs the initiator with the target, subsystem and host given, then `args`.
fn run(t: &Target, args: &[&str]) -> (Option<i32>, String, String) {
    let url = t.url();
    let o = initiator(&with_target(&url, args));
    (
        o.status.code(),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        text(&o),
    )
}

/// [`run`] with a command line: `cli(&t, "--nsid 2 read --offset 0 --length 1")`.
fn cli(t: &Target, line: &str) -> (Option<i32>, String, String) {
    run(t, &words(line))
}

/// [`cli`] with a path as the last argument (a path may hold a space).
fn cli_path(t: &Target, line: &str, path: &std::path::Path) -> (Option<i32>, String, String) {
    let mut a = words(line);
    a.push(path.to_str().unwrap());
    run(t, &a)
}

/// [`json`] with a command line.
fn json_cli(t: &Target, line: &str) -> serde_json::Value {
    json(t, &words(line))
}

fn json(t: &Target, args: &[&str]) -> serde_json::Value {
    let mut a = args.to_vec();
    a.push("--json");
    let (c, out, all) = run(t, &a);
    assert_eq!(c, Some(0), "{args:?}: {all}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{args:?}: {e}: {out}"))
}

#[test]
fn every_subcommand_against_a_running_target() {
    let (d, _shm, t) = start("all");
    // What this run's namespaces are and what the target offers on them (page cache on tcp;
    // over rdma, where the device cannot register file pages, dax (forced): Transport).
    let tr = Transport::current();
    let name = |m: PersistMethod| m.to_string().to_uppercase();
    let files = tr.file_domain().to_string();
    let files_best = name(tr.methods(tr.file_domain())[0]);
    let dax = tr.methods(PersistenceDomain::DaxForced);
    let dax_best = name(dax[0]);
    // A range written by another process: APM cannot make it durable (it covers its own
    // connection's writes only), so FLUSH or GPSPM.
    let dax_range = name(*dax.iter().find(|m| **m != PersistMethod::Apm).unwrap());

    // list
    let v = json_cli(&t, "list");
    assert_eq!(v.as_array().unwrap().len(), 4, "{v}");
    // page-cache: GPSPM (msync through io_uring, off the target's poll loop); dax: FLUSH.
    assert_eq!(v[0]["method"], files_best, "{v}");
    assert_eq!(v[3]["method"], dax_best, "{v}");
    assert_eq!(v[2]["domain"], "volatile");
    assert!(v[2]["method"].is_null());
    // Read-only: no method for writes, and no error either.
    assert_eq!(v[1]["read_only"], true, "{v}");
    assert!(v[1]["method"].is_null(), "{v}");
    assert!(v[1]["method_error"].is_null(), "{v}");
    let (c, out, all) = cli(&t, "list");
    assert_eq!(c, Some(0), "{all}");
    assert!(
        out.contains(&format!(
            "nsid 1: 8 MiB, block 4096, {files}, read-write, durable with {files_best}"
        )),
        "{out}"
    );
    assert!(
        out.contains(&format!(
            "nsid 2: 1 MiB, block 4096, {files}, read-only, no writes, so no durability method"
        )),
        "{out}"
    );
    let ro_line = out.lines().find(|l| l.starts_with("nsid 2:")).unwrap();
    assert!(!ro_line.contains("durable with"), "{ro_line}");
    assert!(out.contains("visible only (volatile)"), "{out}");

    // identify with the global --nqn (before the subcommand here).
    let (c, out, all) = cli(&t, "identify");
    assert_eq!(c, Some(0), "{all}");
    assert!(out.contains("4 namespace(s)"), "{out}");

    // write --pattern --durable, then verify and read.
    let v = json_cli(
        &t,
        "write --offset 4k --pattern 0x5a --length 1MiB --durable",
    );
    assert_eq!(v["state"], "durable", "{v}");
    assert_eq!(v["method"], files_best);
    assert_eq!(v["domain"], files);
    assert_eq!(v["length"], 1 << 20);
    let (c, out, all) = cli(&t, "verify --offset 4096 --pattern 90 --length 1m");
    assert_eq!(c, Some(0), "{all}");
    assert!(
        out.contains("1048576 bytes at offset 4096 of nsid 1 match"),
        "{out}"
    );
    // One byte further: the first differing offset, exit 1.
    let (c, _, all) = cli(&t, "verify --offset 4097 --pattern 0x5a --length 1MiB");
    assert_eq!(c, Some(1), "{all}");
    assert!(all.contains("mismatch at offset 1052672"), "{all}");
    let v = {
        let (c, out, all) = cli(&t, "verify --offset 0 --pattern 0x5a --length 8k --json");
        assert_eq!(c, Some(1), "{all}");
        serde_json::from_str::<serde_json::Value>(&out).unwrap()
    };
    assert_eq!(v["matches"], false);
    assert_eq!(v["first_mismatch"], 0);
    assert_eq!(v["found"], 0);

    // write --in FILE (placed), flush, read --out, compare files.
    let src = d.path().join("in.bin");
    let data: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 251) as u8).collect();
    std::fs::write(&src, &data).unwrap();
    let (c, out, all) = cli_path(&t, "write --offset 2MiB --in", &src);
    assert_eq!(c, Some(0), "{all}");
    // A Write is not acknowledged by the target: the CLI says "sent", never "placed".
    assert!(
        out.contains("sent, not acknowledged by the target and not yet durable"),
        "{out}"
    );
    assert!(!out.contains("placed"), "{out}");
    let v = json(
        &t,
        &["write", "--offset", "2MiB", "--in", src.to_str().unwrap()],
    );
    assert_eq!(v["state"], "sent", "{v}");
    assert!(v["method"].is_null(), "{v}");
    let v = json_cli(&t, "flush --offset 2MiB --length 300000");
    assert_eq!(v["state"], "durable", "{v}");
    let dst = d.path().join("out.bin");
    let (c, _, all) = cli_path(&t, "read --offset 2MiB --length 300000 --out", &dst);
    assert_eq!(c, Some(0), "{all}");
    assert!(std::fs::read(&dst).unwrap() == data);
    let (c, _, all) = cli_path(&t, "verify --offset 2097152 --in", &src);
    assert_eq!(c, Some(0), "{all}");
    // read to a pipe: raw bytes; --json: hex.
    let (c, out, _) = cli(&t, "read --offset 4096 --length 4");
    assert_eq!(c, Some(0));
    assert_eq!(out, "ZZZZ");
    let v = json_cli(&t, "read --offset 4096 --length 2");
    assert_eq!(v["hex"], "5a5a");
    assert!(v["out"].is_null(), "{v}");
    // More than one 4 MiB piece, streamed to the pipe: every byte in order.
    let url = t.url();
    let o = initiator(&with_target(&url, &words("read --offset 0 --length 5MiB")));
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert_eq!(o.stdout.len(), 5 << 20);
    assert!(o.stdout[4096..4096 + (1 << 20)].iter().all(|&b| b == 0x5a));
    assert!(o.stdout[2 << 20..(2 << 20) + data.len()] == data[..]);
    // JSON across a piece boundary stays one valid object.
    let v = json_cli(&t, "read --offset 4194302 --length 4");
    assert_eq!(v["hex"].as_str().map(str::len), Some(8), "{v}");
    assert_eq!(v["length"], 4);

    // cas and faa on the u64 at 0 (zero so far).
    let v = json_cli(&t, "cas --offset 0 --expected 0 --new 0x10");
    assert_eq!(
        (v["old"].as_u64(), v["swapped"].as_bool()),
        (Some(0), Some(true)),
        "{v}"
    );
    let v = json_cli(&t, "cas --offset 0 --expected 0 --new 5");
    assert_eq!(
        (v["old"].as_u64(), v["swapped"].as_bool()),
        (Some(16), Some(false)),
        "{v}"
    );
    let (c, out, all) = cli(&t, "faa --offset 0 --add 4");
    assert_eq!(c, Some(0), "{all}");
    assert!(out.contains("old 16 (0x10), new 20"), "{out}");

    // The dax (forced) namespace: the domain is shown as it is, "(forced)" included.
    let (c, out, all) = cli(
        &t,
        "--nsid 4 write --offset 0 --pattern 1 --length 4k --durable",
    );
    assert_eq!(c, Some(0), "{all}");
    assert!(
        out.contains(&format!("durable ({dax_best}, dax (forced))")),
        "{out}"
    );
    let v = json_cli(&t, "--nsid 4 flush --offset 0 --length 4k");
    assert_eq!(v["domain"], "dax (forced)", "{v}");
    assert_eq!(v["method"], dax_range, "{v}");
    let (c, out, all) = cli(&t, "--nsid 4 flush --offset 0 --length 4k");
    assert_eq!(c, Some(0), "{all}");
    assert!(
        out.contains(&format!("durable ({dax_range}, dax (forced))")),
        "{out}"
    );

    // Forced methods, on the dax (forced) namespace.
    for m in dax.iter().map(|m| m.to_string().to_lowercase()) {
        let v = json_cli(
            &t,
            &format!("--nsid 4 --persist {m} write --offset 0 --pattern 1 --length 64k --durable"),
        );
        assert_eq!(v["method"], m.to_uppercase(), "{v}");
        assert_eq!(v["domain"], "dax (forced)", "{v}");
    }

    // Forced dax: every "durable" says so, in text and JSON (flush and bench too).
    let (c, out, all) = cli(&t, "--nsid 4 flush --offset 0 --length 4k");
    assert_eq!(c, Some(0), "{all}");
    assert!(
        out.contains(&format!("durable ({dax_range}, dax (forced))")),
        "{out}"
    );
    let v = json_cli(&t, "--nsid 4 flush --offset 0 --length 4k");
    assert_eq!(
        (&v["state"], &v["domain"]),
        (&"durable".into(), &"dax (forced)".into())
    );
    let (c, out, all) = cli(&t, "--nsid 4 bench --count 5 --total 64k --offset 0");
    assert_eq!(c, Some(0), "{all}");
    assert!(
        out.contains(&format!("durable write ({dax_best}, dax (forced))")),
        "{out}"
    );
    let v = json_cli(&t, "--nsid 4 bench --count 5 --total 64k --offset 0");
    assert_eq!(v["domain"], "dax (forced)", "{v}");

    // Volatile: a durable request that got "visible only" exits 7 (a script checking $? is
    // not misled), after printing the outcome; --visible-ok accepts it, with a warning.
    for cmd in [
        "--nsid 3 write --offset 0 --pattern 7 --length 4k --durable",
        "--nsid 3 flush --offset 0 --length 4k",
        "--nsid 3 bench --count 5 --total 64k --offset 0",
    ] {
        let (c, out, all) = cli(&t, cmd);
        assert_eq!(c, Some(7), "{cmd}: {all}");
        assert!(
            all.contains("NOT durable") && all.contains("--visible-ok"),
            "{cmd}: {all}"
        );
        assert!(!out.is_empty(), "{cmd}: the outcome is printed first");
        let (c, _, all) = cli(&t, &format!("--visible-ok {cmd}"));
        assert_eq!(c, Some(0), "{cmd}: {all}");
        assert!(all.contains("warning: namespace 3 is volatile"), "{all}");
    }
    let (c, out, all) = cli(
        &t,
        "--nsid 3 write --offset 0 --pattern 7 --length 4k --durable --json",
    );
    assert_eq!(c, Some(7), "{all}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["state"], "visible-only", "{v}");
    let (c, out, _) = cli(
        &t,
        "--nsid 3 write --offset 0 --pattern 7 --length 4k --durable --visible-ok",
    );
    assert_eq!(c, Some(0));
    assert!(
        out.contains("visible only (volatile): NOT durable"),
        "{out}"
    );

    // bench (small), JSON.
    let v = json_cli(&t, "bench --count 50 --total 4MiB --offset 4MiB");
    assert_eq!(v["count"], 50);
    assert!(v["write_latency"]["p50_us"].as_f64().unwrap() > 0.0, "{v}");
    assert!(v["read_mib_s"].as_f64().unwrap() > 0.0, "{v}");
    assert_eq!(v["method"], files_best);
    assert_eq!(v["domain"], files);
    // bench overwrites: without an explicit --offset it refuses (exit 2) and writes nothing,
    // unless --yes.
    let (c, _, all) = cli(&t, "--nsid 4 write --offset 0 --pattern 0x77 --length 64k");
    assert_eq!(c, Some(0), "{all}");
    let (c, _, all) = cli(&t, "--nsid 4 bench --count 5 --total 64k");
    assert_eq!(c, Some(2), "{all}");
    assert!(all.contains("--offset"), "{all}");
    let (c, _, all) = cli(&t, "--nsid 4 verify --offset 0 --pattern 0x77 --length 64k");
    assert_eq!(c, Some(0), "the refused bench wrote: {all}");
    let v = json_cli(&t, "--nsid 4 bench --yes --count 5 --total 64k");
    assert_eq!(v["method"], dax_best, "{v}");
    assert_eq!(v["domain"], "dax (forced)", "{v}");

    // completions need no target.
    let o = initiator(&["completions", "bash"]);
    assert!(o.status.success());
    assert!(String::from_utf8_lossy(&o.stdout).contains("rpma-initiator"));
}

#[test]
fn each_error_has_its_exit_code() {
    let (_d, _shm, t) = start("errors");
    // Counted from the target's status, not its log: session lines are rate-limited per peer.
    let ended = |why: &str| {
        t.status()["metrics"]["sessions_ended"][why]
            .as_u64()
            .unwrap()
    };
    let (closed_before, lost_before) = (ended("host"), ended("connection_lost"));
    // Wrong subsystem NQN: refused.
    let url = t.url();
    let o = initiator(&[
        "--target",
        &url,
        "--nqn",
        "nqn.2026-11.io.rpma:nope",
        "--hostnqn",
        HOST,
        "list",
    ]);
    assert_eq!(o.status.code(), Some(4), "{}", text(&o));
    // Unknown host: refused.
    let o = initiator(&[
        "--target",
        &url,
        "--nqn",
        SUB,
        "--hostnqn",
        "nqn.2026-11.io.rpma:stranger",
        "list",
    ]);
    assert_eq!(o.status.code(), Some(4), "{}", text(&o));
    assert!(text(&o).contains("not allowed"), "{}", text(&o));
    // Unknown host name (does not resolve): unreachable (one attempt: a first connection
    // that fails is retried within --reconnect-timeout).
    let o = initiator(&[
        "--target",
        "tcp://no-such-host.invalid:7420",
        "--nqn",
        SUB,
        "--timeout",
        "3",
        "--reconnect-timeout",
        "0",
        "list",
    ]);
    assert_eq!(o.status.code(), Some(3), "{}", text(&o));
    // Out of range.
    let (c, _, all) = cli(&t, "write --offset 8MiB --pattern 1 --length 1");
    assert_eq!(c, Some(6), "{all}");
    assert!(all.contains("outside namespace 1"), "{all}");
    let (c, _, all) = cli(&t, "read --offset 0 --length 9MiB");
    assert_eq!(c, Some(6), "{all}");
    // The whole range is checked before --out is created: nothing written, and the message
    // names the range asked for (not a 4 MiB piece of it).
    let f = _d.path().join("never.bin");
    let (c, out, all) = cli_path(&t, "read --offset 6MiB --length 4MiB --out", &f);
    assert_eq!(c, Some(6), "{all}");
    assert!(
        !f.exists(),
        "--out was created for a range that does not fit"
    );
    assert!(out.is_empty(), "{out}");
    assert!(
        all.contains("4194304 bytes at offset 6291456 are outside namespace 1"),
        "{all}"
    );
    let (c, out, all) = cli(&t, "read --offset 6MiB --length 4MiB");
    assert_eq!(c, Some(6), "{all}");
    assert!(out.is_empty(), "nothing on stdout before the error: {out}");
    let (c, _, all) = cli(&t, "verify --offset 6MiB --pattern 0 --length 4MiB");
    assert_eq!(c, Some(6), "{all}");
    assert!(all.contains("4194304 bytes at offset 6291456"), "{all}");
    // Read-only namespace.
    let (c, _, all) = cli(&t, "--nsid 2 write --offset 0 --pattern 1 --length 1");
    assert_eq!(c, Some(6), "{all}");
    assert!(all.contains("read-only"), "{all}");
    // Misaligned atomic.
    let (c, _, all) = cli(&t, "faa --offset 12 --add 1");
    assert_eq!(c, Some(6), "{all}");
    assert!(all.contains("not a multiple of 8"), "{all}");
    // APM forced where it cannot make the namespace durable (volatile): nothing written.
    let (c, _, all) = cli(
        &t,
        "--nsid 3 --persist apm write --offset 0 --pattern 9 --length 8 --durable",
    );
    assert_eq!(c, Some(6), "{all}");
    assert!(all.contains("APM cannot make namespace 3"), "{all}");
    let v = json_cli(&t, "--nsid 3 read --offset 0 --length 1");
    assert_eq!(v["hex"], "00", "the refused write wrote nothing");
    let (c, _, all) = cli(&t, "--nsid 3 --persist gpspm flush --offset 0 --length 8");
    assert_eq!(c, Some(6), "{all}");
    // No such namespace.
    let (c, _, all) = cli(&t, "--nsid 9 read --offset 0 --length 1");
    assert_eq!(c, Some(6), "{all}");
    // Usage.
    let (c, _, _) = cli(&t, "write --offset 0");
    assert_eq!(c, Some(2));
    let (c, _, _) = cli(&t, "read --offset 1x --length 1");
    assert_eq!(c, Some(2));
    let o = initiator(&["--target", &url, "list"]);
    assert_eq!(o.status.code(), Some(2), "missing --nqn: {}", text(&o));
    // An NBD --listen that is not HOST:PORT is a usage error, said before any connection; one
    // that cannot be bound (not this machine's address) is the environment's.
    let (c, _, all) = cli(&t, "nbd --listen not-an-address");
    assert_eq!(c, Some(2), "{all}");
    assert!(all.contains("not HOST:PORT"), "{all}");
    let (c, _, all) = cli(&t, "nbd --listen 192.0.2.1:10809");
    assert_eq!(c, Some(1), "{all}");

    // Every admitted session above ended in an error, and said goodbye: the target saw its
    // Disconnect. (11 admitted sessions, 10 of them failed.) The CLI's close right behind the
    // Disconnect can reach the target's reader first on a loaded machine, as
    // hostile_availability's cycling test notes: such a session ends "connection_lost", so the
    // two are counted together, and at least one Disconnect must have been read.
    let all = || ended("host") + ended("connection_lost");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while all() < closed_before + lost_before + 11 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(all() >= closed_before + lost_before + 11, "{}", t.status());
    assert!(ended("host") > closed_before, "{}", t.status());
}

#[test]
fn durable_cli_write_survives_sigkill_of_the_target() {
    for nsid in ["1", "4"] {
        let (_d, _shm, mut t) = start(&format!("kill{nsid}"));
        let (c, _, all) = cli(
            &t,
            &format!("--nsid {nsid} write --offset 64k --pattern 0xc3 --length 1MiB --durable"),
        );
        assert_eq!(c, Some(0), "{all}");
        t.kill9();
        t.restart();
        let (c, _, all) = cli(
            &t,
            &format!("--nsid {nsid} verify --offset 64k --pattern 0xc3 --length 1MiB"),
        );
        assert_eq!(c, Some(0), "nsid {nsid} lost durable bytes: {all}");
    }
}

#[test]
fn two_initiator_processes_on_separate_namespaces_do_not_interfere() {
    let (_d, _shm, t) = start("two");
    let url = t.url();
    let spawn = |nsid: &str, byte: &str| {
        std::process::Command::new(rpma_tests::built("rpma-initiator"))
            .args(with_target(
                &url,
                &words(&format!(
                    "--nsid {nsid} write --offset 0 --pattern {byte} --length 2MiB --durable"
                )),
            ))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap()
    };
    // Both at once, several rounds, each overwriting its own namespace only.
    for round in 0..3 {
        let (a, b) = (format!("{}", 0x10 + round), format!("{}", 0x20 + round));
        let mut pa = spawn("1", &a);
        let mut pb = spawn("4", &b);
        assert!(pa.wait().unwrap().success());
        assert!(pb.wait().unwrap().success());
        let (c, _, all) = cli(
            &t,
            &format!("--nsid 1 verify --offset 0 --pattern {a} --length 2MiB"),
        );
        assert_eq!(c, Some(0), "{all}");
        let (c, _, all) = cli(
            &t,
            &format!("--nsid 4 verify --offset 0 --pattern {b} --length 2MiB"),
        );
        assert_eq!(c, Some(0), "{all}");
    }
}

/// The flush service's own path (an fdatasync through io_uring, not the poll loop's inline
/// msync: a second connection on the loop and a range over 256 KiB send it there) syncs every
/// page of the range it answers durable (cachestat). Without this only the inline msync was
/// checked against the page cache: a wrong range or a skipped fdatasync there passed
/// everything.
#[test]
fn a_gpspm_flush_through_the_flush_service_syncs_its_range() {
    let (d, _shm, t) = start("uring");
    let file = d.path().join("ns1");
    if !rpma_tests::sees_unsynced_pages(&file) {
        return;
    }
    let idle = rpma_initiator::Connection::new(
        &t.url(),
        rpma_tests::nqn(SUB),
        rpma_initiator::HostIdentity::new(rpma_tests::nqn(HOST)),
    )
    .open_queue(0)
    .unwrap();
    let (off, len) = (2u64 << 20, 1u64 << 20);
    let mut seen_dirty = false;
    for pattern in 0x61..0x66 {
        let (c, _, all) = cli(
            &t,
            &format!("write --offset {off} --pattern {pattern} --length {len}"),
        );
        assert_eq!(c, Some(0), "{all}");
        if rpma_tests::unsynced_pages(&file, off, len).unwrap() > 0 {
            seen_dirty = true;
            break;
        }
    }
    assert!(
        seen_dirty,
        "five writes in a row were written back before they could be checked"
    );
    let before = t.gpspm_syncs().0;
    let (c, out, all) = cli(
        &t,
        &format!("--persist gpspm flush --offset {off} --length {len}"),
    );
    assert_eq!(c, Some(0), "{all}");
    assert!(out.contains("durable ("), "{out}");
    assert!(
        t.gpspm_syncs().0 > before,
        "the flush was not the flush service's fdatasync"
    );
    assert_eq!(
        rpma_tests::unsynced_pages(&file, off, len),
        Some(0),
        "answered durable with pages unsynced"
    );
    drop(idle);
}

#[test]
fn a_flush_of_a_range_makes_it_durable_whoever_wrote_it_or_refuses() {
    let (d, _shm, t) = start("whoever");
    let file = d.path().join("ns1");
    if !rpma_tests::sees_unsynced_pages(&file) {
        return;
    }
    let dirty = |off: u64| rpma_tests::unsynced_pages(&file, off, 64 << 10).unwrap();
    // Each range written by one connection (sent, not durable), flushed by another. Written
    // once more first: the target places a page's first Write after its write-back with
    // `pwrite` and the later ones with stores into its mapping (docs/fabric.md), which the
    // flush must write back as well.
    for (off, method, want) in [
        (0u64, "--persist apm", Some(6)),
        (1 << 20, "--persist gpspm", Some(0)),
        (2 << 20, "--persist flush", Some(0)),
        (3 << 20, "", Some(0)),
    ] {
        let (c, _, all) = cli(
            &t,
            &format!("write --offset {off} --pattern 89 --length 64k"),
        );
        assert_eq!(c, Some(0), "{all}");
        // The kernel's background write-back (another process's dirty data past the threshold)
        // may clean the pages before we look: write again until some are seen dirty.
        let mut seen_dirty = false;
        for pattern in 0x5a..0x5f {
            let (c, _, all) = cli(
                &t,
                &format!("write --offset {off} --pattern {pattern} --length 64k"),
            );
            assert_eq!(c, Some(0), "{all}");
            if dirty(off) > 0 {
                seen_dirty = true;
                break;
            }
        }
        assert!(
            seen_dirty,
            "five writes in a row were written back before they could be checked"
        );
        let (c, out, all) = cli(&t, &format!("{method} flush --offset {off} --length 64k"));
        assert_eq!(c, want, "{method}: {all}");
        if c == Some(6) {
            // APM is not offered on page-cache (a Read response there makes nothing durable):
            // it says so and claims nothing.
            assert!(
                all.contains("APM cannot make namespace 1 (page-cache) durable")
                    && all.contains("the target offers GPSPM FLUSH"),
                "{all}"
            );
        } else {
            assert!(out.contains("durable ("), "{out}");
            assert_eq!(
                dirty(off),
                0,
                "{method}: answered durable with pages unsynced"
            );
        }
    }
    // Nor on a write of its own: refused before anything is written.
    let (c, _, all) = cli(
        &t,
        "--persist apm write --offset 0 --pattern 1 --length 64k --durable",
    );
    assert_eq!(c, Some(6), "{all}");
    assert!(all.contains("APM cannot make namespace 1"), "{all}");
}

// Not over rdma: a_flush_of_a_range_makes_it_durable_whoever_wrote_it_or_refuses, which
// watches page-cache write-back (cachestat), where the device cannot register page cache
// (Soft-RoCE: docs/rdma.md) and the run pins its files.
rpma_tests::rdma_runs!(
    every_subcommand_against_a_running_target,
    durable_cli_write_survives_sigkill_of_the_target,
    two_initiator_processes_on_separate_namespaces_do_not_interfere,
    crc_is_on_when_either_side_asks_for_it,
);

/// `--crc`: CRC32c is on when either side asks (RFC 5044's C bit), so `--crc off` turns it off
/// only against a target configured with `crc = false`; the data goes through either way. On
/// rdma the option is ignored and there is no MPA CRC to report.
#[test]
fn crc_is_on_when_either_side_asks_for_it() {
    let tcp = Transport::current() == Transport::Tcp;
    for target_crc in [true, false] {
        let d = rpma_tests::scratch();
        let config = rpma_tests::Config::new()
            .set(&format!("crc = {target_crc}"))
            .subsystem(
                Subsystem::new(SUB)
                    .host(HOST)
                    .namespace(rpma_tests::Namespace::new(1, "ns1", "4MiB")),
            );
        let t = Target::start(d.path(), &config.to_string());
        for ours in ["on", "off"] {
            let want = match tcp {
                true => serde_json::Value::Bool(target_crc || ours == "on"),
                false => serde_json::Value::Null,
            };
            let what = format!("target crc = {target_crc}, --crc {ours}");
            let v = json_cli(
                &t,
                &format!("--crc {ours} bench --count 3 --total 1MiB --offset 0"),
            );
            assert_eq!(v["crc"], want, "{what}: {v}");
            let (c, out, all) = cli(
                &t,
                &format!("--crc {ours} bench --count 3 --total 64k --offset 0"),
            );
            assert_eq!(c, Some(0), "{what}: {all}");
            let says_off = out.contains("WITHOUT CRC32c");
            assert_eq!(says_off, want == false, "{what}: {out}");
            // The data goes through without CRC too: a 1 MiB write (many FPDUs) and its
            // verify, each on a connection of its own.
            let pattern = if ours == "on" { "0x3c" } else { "0xc3" };
            let (c, _, all) = cli(
                &t,
                &format!(
                    "--crc {ours} write --offset 8k --pattern {pattern} --length 1MiB --durable"
                ),
            );
            assert_eq!(c, Some(0), "{what}: {all}");
            let (c, _, all) = cli(
                &t,
                &format!("--crc {ours} verify --offset 8k --pattern {pattern} --length 1MiB"),
            );
            assert_eq!(c, Some(0), "{what}: {all}");
        }
        // A bad value is a usage error (exit 2) naming the choices.
        let (c, _, all) = cli(&t, "--crc none list");
        assert_eq!(c, Some(2), "{all}");
        assert!(all.contains("on") && all.contains("off"), "{all}");
    }
}

/// A read whose `--out` names something that was there (here a device that fails every
/// write, as /dev/full does) fails and leaves it: only a file the read created is removed.
/// (A failed read removed whatever the path named, a device node included: a read into
/// /dev/sdX that met a link error took the node with it.)
#[test]
fn a_failed_read_leaves_an_out_path_it_did_not_create() {
    let (d, _shm, t) = start("out");
    let full = d.path().join("full");
    nix::sys::stat::mknod(
        &full,
        nix::sys::stat::SFlag::S_IFCHR,
        nix::sys::stat::Mode::from_bits_truncate(0o600),
        nix::sys::stat::makedev(1, 7),
    )
    .unwrap();
    let (c, _, all) = cli_path(&t, "read --offset 0 --length 64k --out", &full);
    assert_ne!(c, Some(0), "{all}");
    assert!(all.contains("writing"), "{all}");
    let kind = std::fs::symlink_metadata(&full)
        .unwrap_or_else(|e| panic!("{} is gone ({e}): {all}", full.display()))
        .file_type();
    assert!(
        std::os::unix::fs::FileTypeExt::is_char_device(&kind),
        "{kind:?}"
    );
    // A file it creates gets the bytes; so does the file a symbolic link to nothing names.
    let out = d.path().join("out");
    let (c, _, all) = cli_path(&t, "read --offset 0 --length 64k --out", &out);
    assert_eq!(c, Some(0), "{all}");
    assert_eq!(std::fs::metadata(&out).unwrap().len(), 64 << 10);
    let link = d.path().join("link");
    std::os::unix::fs::symlink(d.path().join("linked"), &link).unwrap();
    let (c, _, all) = cli_path(&t, "read --offset 0 --length 64k --out", &link);
    assert_eq!(c, Some(0), "{all}");
    assert_eq!(
        std::fs::metadata(d.path().join("linked")).unwrap().len(),
        64 << 10
    );
}

/// `write --in` and `verify --in` from a FIFO (a pipe: `zcat img | ... --in /dev/stdin`) are
/// refused as bad input, saying why: there is no length to check the range with first. (Its
/// metadata's length, 0, was taken: 0 bytes written, exit 0.)
#[test]
fn write_and_verify_from_a_pipe_are_refused_not_empty() {
    let (d, _shm, t) = start("pipe");
    let fifo = d.path().join("fifo");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
    for line in ["write --offset 0 --durable --in", "verify --offset 0 --in"] {
        // The writer's end, so that the initiator's open of the FIFO returns.
        let writer = {
            let fifo = fifo.clone();
            std::thread::spawn(move || {
                use std::io::Write;
                let mut f = std::fs::OpenOptions::new().write(true).open(&fifo).unwrap();
                let _ = f.write_all(b"hello");
            })
        };
        let (c, _, all) = cli_path(&t, line, &fifo);
        assert_eq!(c, Some(2), "{line}: {all}");
        assert!(
            all.contains("not a regular file or a block device"),
            "{all}"
        );
        writer.join().unwrap();
    }
}

/// A `tcp://` URL naming a port where something else answers (an nvme-tcp:// port, another
/// service): exit 3 at once, saying so, not a minute of retries of "bad MPA key".
#[test]
fn a_port_that_does_not_speak_mpa_fails_at_once_saying_so() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("tcp://{}", l.local_addr().unwrap());
    let server = std::thread::spawn(move || {
        use std::io::{Read, Write};
        // Every connection made (one, unless retried) gets an answer that is no MPA Reply.
        l.set_nonblocking(false).unwrap();
        let (mut s, _) = l.accept().unwrap();
        let mut req = [0u8; 16];
        let _ = s.read(&mut req);
        let _ = s.write_all(b"HTTP/1.0 400 Bad Request\r\n\r\n");
        // Until the initiator closes: a close with its bytes unread would reset the
        // connection before it read the answer.
        let _ = s.shutdown(std::net::Shutdown::Write);
        let _ = std::io::copy(&mut s, &mut std::io::sink());
    });
    let o = initiator(&[
        "--target",
        &url,
        "--nqn",
        SUB,
        "--hostnqn",
        HOST,
        "--reconnect-timeout",
        "30",
        "list",
    ]);
    let all = text(&o);
    assert_eq!(o.status.code(), Some(3), "{all}");
    assert!(all.contains("does not speak MPA"), "{all}");
    assert!(!all.contains("retrying"), "{all}");
    server.join().unwrap();
}
