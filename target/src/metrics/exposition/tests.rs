use std::collections::BTreeSet;

use super::*;
use crate::control::{
    ListenerStatus, NamespaceStatus, SessionStatus, Status, SubsystemStatus, SESSION_COUNTED,
};
use crate::metrics::{HostCounters, LatencyStatus, Outcomes};
use crate::namespace::CountersSnapshot;

fn status() -> Status {
    let mut h = Histogram::default();
    for ns in [200, 900, 40_000] {
        h.record(ns);
    }
    let data = DataCounters {
        writes: 4,
        write_bytes: 16384,
        reads: 2,
        read_bytes: 16,
        atomics: 1,
        durability: crate::metrics::DurabilityCounts {
            apm: Outcomes { ok: 2, failed: 0 },
            flush: Outcomes { ok: 3, failed: 1 },
            gpspm: Outcomes { ok: 5, failed: 0 },
        },
    };
    Status {
        version: "0.1.0".into(),
        pid: 1,
        uptime_s: 2,
        config: "/etc/rpma/rpma-target.toml".into(),
        reloads: 1,
        last_reload: Some("failed: bad".into()),
        listeners: vec![ListenerStatus {
            url: "tcp://127.0.0.1:7420".into(),
            bound: true,
            crc: true,
            direct_write_to_pmem: false,
            note: None,
        }],
        subsystems: vec![SubsystemStatus {
            nqn: "nqn.2026-11.io.rpma:demo".into(),
            allow_any_host: false,
            hosts: vec![],
            namespaces: vec![NamespaceStatus {
                nsid: 1,
                path: "/x".into(),
                size: 1 << 20,
                block_size: 4096,
                read_only: false,
                domain: "dax (forced)".into(),
                durability: vec![],
                counters: CountersSnapshot {
                    flushes: 5,
                    flush_errors: 0,
                    flushed_bytes: 20480,
                    sessions: 1,
                },
                data,
                failed: Some("msync failed".into()),
                failed_since: None,
            }],
        }],
        sessions: vec![SessionStatus {
            kind: "io".into(),
            controller_id: 1,
            host_nqn: "nqn.2026-11.io.rpma:h\"1".into(),
            subsystem_nqn: "nqn.2026-11.io.rpma:demo".into(),
            peer: "127.0.0.1:1".into(),
            queue_id: 0,
            age_ms: 1,
            messages: 1,
            flushes: 0,
            counted: SESSION_COUNTED.into(),
            keep_alive_ms: 5000,
            last_keep_alive_ms: 0,
            keep_alive_state: "ok".into(),
            data,
            namespaces: vec![],
        }],
        admission: None,
        metrics: Some(MetricsStatus {
            counting: true,
            hosts: vec![HostCounters {
                subsystem: "nqn.2026-11.io.rpma:demo".into(),
                nsid: 1,
                host: "nqn.2026-11.io.rpma:h\"1\\x\ny".into(),
                data,
            }],
            sessions_admitted: 3,
            refusals: [("auth_failed".to_owned(), 2)].into(),
            terminates: [("access".to_owned(), 1)].into(),
            latency: vec![
                LatencyStatus {
                    kind: "msync".into(),
                    path: "placement".into(),
                    histogram: h,
                },
                LatencyStatus {
                    kind: "gpspm_request".into(),
                    path: "gpspm".into(),
                    histogram: h,
                },
            ],
            ..MetricsStatus::default()
        }),
        metrics_listener: None,
    }
}

fn process() -> Process {
    Process {
        open_fds: Some(12),
        max_fds: Some(1024),
        resident_bytes: Some(1 << 20),
        virtual_bytes: Some(1 << 30),
        cpu_seconds: Some(0.25),
        start_time_seconds: Some(1_700_000_000.5),
    }
}

#[test]
fn every_family_has_help_and_type_once_before_its_samples() {
    let text = render(&status(), &process());
    let mut helped = BTreeSet::new();
    let mut typed: Vec<(String, String)> = Vec::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let name = rest.split(' ').next().unwrap().to_owned();
            assert!(helped.insert(name.clone()), "HELP twice for {name}");
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut p = rest.split(' ');
            let (name, kind) = (p.next().unwrap(), p.next().unwrap());
            assert!(helped.contains(name), "TYPE before HELP: {name}");
            typed.push((name.to_owned(), kind.to_owned()));
        } else {
            let name = line.split(['{', ' ']).next().unwrap();
            let (fam, kind) = typed.last().expect("a sample before any TYPE");
            let base = name
                .strip_suffix("_bucket")
                .or_else(|| name.strip_suffix("_sum"))
                .or_else(|| name.strip_suffix("_count"))
                .filter(|_| kind == "histogram")
                .unwrap_or(name);
            assert_eq!(base, fam, "sample {line:?} outside its family");
            if kind == "counter" {
                assert!(fam.ends_with("_total"), "{fam}");
            }
        }
    }
    for want in [
        "rpma_target_writes_total",
        "rpma_target_write_bytes_total",
        "rpma_target_durability_requests_total",
        "rpma_target_refusals_total",
        "rpma_target_terminates_sent_total",
        "rpma_target_sessions_ended_total",
        "rpma_target_persist_duration_seconds",
        "rpma_target_gpspm_request_duration_seconds",
        "rpma_target_namespace_failed",
        "process_open_fds",
        "process_resident_memory_bytes",
        "process_cpu_seconds_total",
    ] {
        assert!(helped.contains(want), "{want} missing:\n{text}");
    }
}

#[test]
fn samples_carry_the_counts_and_escaped_labels() {
    let text = render(&status(), &process());
    let host = r#"host="nqn.2026-11.io.rpma:h\"1\\x\ny""#;
    let labels = format!(r#"subsystem="nqn.2026-11.io.rpma:demo",nsid="1",{host}"#);
    for want in [
        format!("rpma_target_write_bytes_total{{{labels}}} 16384"),
        format!("rpma_target_writes_total{{{labels}}} 4"),
        format!("rpma_target_reads_total{{{labels}}} 2"),
        format!(
            "rpma_target_durability_requests_total{{{labels},method=\"flush\",outcome=\"failed\"}} 1"
        ),
        format!(
            "rpma_target_durability_requests_total{{{labels},method=\"gpspm\",outcome=\"ok\"}} 5"
        ),
        r#"rpma_target_namespace_failed{subsystem="nqn.2026-11.io.rpma:demo",nsid="1"} 1"#.into(),
        r#"rpma_target_sessions{kind="io",subsystem="nqn.2026-11.io.rpma:demo"} 1"#.into(),
        r#"rpma_target_sessions{kind="discovery",subsystem="nqn.2014-08.org.nvmexpress.discovery"} 0"#
            .into(),
        r#"rpma_target_refusals_total{reason="auth_failed"} 2"#.into(),
        r#"rpma_target_terminates_sent_total{cause="access"} 1"#.into(),
        r#"rpma_target_sessions_admitted_total{kind="io"} 3"#.into(),
        "rpma_target_last_reload_failed 1".into(),
        r#"rpma_target_listener_up{url="tcp://127.0.0.1:7420"} 1"#.into(),
        "process_open_fds 12".into(),
        "process_cpu_seconds_total 0.25".into(),
        "process_start_time_seconds 1700000000.5".into(),
    ] {
        assert!(text.contains(&format!("{want}\n")), "{want}\n---\n{text}");
    }
}

#[test]
fn histograms_are_cumulative_and_end_with_inf_equal_to_count() {
    let text = render(&status(), &process());
    let name = "rpma_target_persist_duration_seconds";
    let buckets: Vec<(String, u64)> = text
        .lines()
        .filter(|l| l.starts_with(&format!("{name}_bucket{{")))
        .map(|l| {
            let le = l.split("le=\"").nth(1).unwrap().split('"').next().unwrap();
            (
                le.to_owned(),
                l.rsplit(' ').next().unwrap().parse().unwrap(),
            )
        })
        .collect();
    assert_eq!(buckets.len(), rpma_common::stats::BUCKETS);
    assert_eq!(buckets[0], ("0.00000025".to_owned(), 1));
    assert_eq!(buckets[2], ("0.000001".to_owned(), 2));
    assert!(buckets.windows(2).all(|w| w[0].1 <= w[1].1));
    assert_eq!(buckets.last().unwrap(), &("+Inf".to_owned(), 3));
    assert!(text.contains(&format!(
        "{name}_count{{kind=\"msync\",path=\"placement\"}} 3\n"
    )));
    assert!(text.contains(&format!(
        "{name}_sum{{kind=\"msync\",path=\"placement\"}} 0.0000411\n"
    )));
    assert!(text.contains("rpma_target_gpspm_request_duration_seconds_count 3\n"));
}

#[test]
fn a_daemon_without_metrics_still_renders_and_missing_figures_are_left_out() {
    let mut s = status();
    s.metrics = None;
    let text = render(&s, &Process::default());
    assert!(!text.contains("rpma_target_writes_total"));
    assert!(!text.contains("process_"));
    assert!(text.contains("rpma_target_build_info{version=\"0.1.0\",counting=\"false\"} 1\n"));
}

/// The real tool, where it is installed (tests/tests/metrics.rs runs it on a live daemon).
#[test]
fn promtool_accepts_the_text() {
    use std::io::Write as _;
    use std::process::{Command, Stdio};
    let Ok(mut child) = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
    else {
        eprintln!("skipped: promtool is not installed (Debian package prometheus)");
        return;
    };
    let text = render(&status(), &process());
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool: {}{}\n---\n{text}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
