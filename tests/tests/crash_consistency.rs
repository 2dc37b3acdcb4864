//! The crash-consistency harness, short (docs/reliability.md; the long run is
//! scripts/reliability.sh): `rpma-crash` kills a target under the power-loss simulation a few
//! times while every durability method and the NBD export write, and finds every acknowledged
//! block after each restart; with persist broken on purpose it must find the losses and fail.

use std::process::Command;
use std::time::Duration;

use rpma_tests::{run_with_deadline, scratch, text, Transport};

/// `rpma-crash ARGS --quiet --json FILE` (and `--transport rdma` in the `rdma::` twins): its
/// exit code and its report.
fn crash(args: &[&str]) -> (Option<i32>, serde_json::Value, String) {
    let d = scratch();
    let json = d.path().join("report.json");
    let o = run_with_deadline(
        Command::new(env!("CARGO_BIN_EXE_rpma-crash"))
            .args(args)
            .args(["--quiet", "--json", json.to_str().unwrap()])
            .args(match Transport::current() {
                Transport::Tcp => &[][..],
                Transport::Rdma { .. } => &["--transport", "rdma"],
            }),
        // A bound for a hung run, not a margin: a loaded machine or an emulated guest is slow.
        Duration::from_secs(900),
    );
    let report = std::fs::read(&json)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or(serde_json::Value::Null);
    (o.status.code(), report, text(&o))
}

#[test]
fn every_acknowledged_write_survives_a_few_power_losses() {
    let (code, r, out) = crash(&["--cycles", "4", "--seed", "1401", "--run-ms", "200-400"]);
    assert_eq!(code, Some(0), "{out}");
    assert_eq!(r["cycles"], 4, "{r}");
    assert_eq!(r["kills"], 4, "{r}");
    assert_eq!(r["lost"], 0, "{r}");
    assert_eq!(r["corrupt"], 0, "{r}");
    assert_eq!(r["writer_errors_before_kill"], 0, "{r}");
    // Every medium and method was exercised: exit 0 says so too (2 would be inconclusive).
    // Over rdma: the methods the target offers without direct_write_to_pmem (rpma-crash).
    // On tcp APM is not offered on page-cache: no writer for it there.
    let by = r["acknowledged_by"].as_object().unwrap();
    let runs = r["media"].as_array().unwrap().len() * r["methods"].as_array().unwrap().len();
    match Transport::current() {
        Transport::Tcp => {
            assert_eq!(runs, 10, "{r}");
            assert_eq!(by.len(), runs - 1, "{r}");
            assert!(!by.contains_key("page-cache apm"), "{r}");
        }
        Transport::Rdma { .. } => {
            assert_eq!(by.len(), runs, "{r}");
            assert_eq!(
                r["methods"],
                serde_json::json!(["gpspm", "nbd-fua", "nbd-flush"]),
                "{r}"
            );
        }
    }
    assert!(by.values().all(|n| n.as_u64() > Some(0)), "{r}");
    assert!(r["acknowledged_checked"].as_u64() > Some(0), "{r}");
    assert!(out.contains("result: PASS"), "{out}");
}

#[test]
fn a_broken_persist_is_caught_and_fails_the_run() {
    // The target acknowledges durable writes whose persist did nothing: the harness must see
    // acknowledged blocks gone after the restarts, say so, and exit 1.
    let (code, r, out) = crash(&[
        "--cycles",
        "3",
        "--seed",
        "1402",
        "--run-ms",
        "200-400",
        "--broken-persist",
    ]);
    assert_eq!(code, Some(1), "{out}");
    assert!(r["lost"].as_u64() > Some(0), "{r}");
    assert_eq!(r["broken_persist"], true, "{r}");
    assert!(
        out.contains("result: FAIL: acknowledged writes lost"),
        "{out}"
    );
    assert!(out.contains("LOST"), "the problems name the blocks: {out}");
    // A failed run keeps its directory (config, logs, the acknowledgement log) to look at.
    let dir = r["dir"].as_str().expect("kept");
    let acks = std::fs::read_to_string(std::path::Path::new(dir).join("acks.log")).unwrap();
    assert_eq!(
        Some(acks.lines().count() as u64),
        r["acknowledged"].as_u64()
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn bad_arguments_are_refused_with_the_usage() {
    for args in [
        &["--cycles", "x"][..],
        &["--media", "floppy"],
        &["--methods", "apm,telepathy"],
        &["--run-ms", "300-100"],
        &["--eviction-percent", "101"],
        &["--cycles", "0"],
        &["--frobnicate"],
        &["--transport", "carrier-pigeon"],
        &["--transport"],
    ] {
        let o = run_with_deadline(
            Command::new(env!("CARGO_BIN_EXE_rpma-crash")).args(args),
            Duration::from_secs(10),
        );
        assert_eq!(o.status.code(), Some(64), "{args:?}: {}", text(&o));
        assert!(
            text(&o).contains("usage: rpma-crash"),
            "{args:?}: {}",
            text(&o)
        );
    }
}

#[test]
fn an_rdma_run_needs_its_device_named() {
    let o = run_with_deadline(
        Command::new(env!("CARGO_BIN_EXE_rpma-crash"))
            .args(["--transport", "rdma", "--cycles", "1"])
            .env_remove("RPMA_TEST_RDMA_DEVICE")
            .env_remove("RPMA_TEST_RDMA_ADDR"),
        Duration::from_secs(10),
    );
    assert_eq!(o.status.code(), Some(64), "{}", text(&o));
    assert!(
        text(&o).contains("RPMA_TEST_RDMA_DEVICE is not set"),
        "{}",
        text(&o)
    );
}

rpma_tests::rdma_runs!(
    every_acknowledged_write_survives_a_few_power_losses,
    a_broken_persist_is_caught_and_fails_the_run,
);
