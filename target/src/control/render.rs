//! `rpma-target status` as a table: the [`Status`] the control socket answers, for people.

use super::status::{Status, SESSION_COUNTED};
use crate::metrics::{DataCounters, MetricsStatus};

/// The status as a human-readable table.
pub fn render(s: &Status) -> String {
    use std::fmt::Write as _;
    let mut o = String::new();
    let _ = writeln!(
        o,
        "rpma-target {} (pid {}), up {}s, config {}, {} reload(s){}",
        s.version,
        s.pid,
        s.uptime_s,
        s.config.display(),
        s.reloads,
        s.last_reload
            .as_ref()
            .map(|r| format!(", last: {r}"))
            .unwrap_or_default()
    );
    let _ = writeln!(o, "\nLISTENERS");
    for l in &s.listeners {
        let state = if l.bound {
            "listening".to_owned()
        } else {
            format!("not bound: {}", l.note.as_deref().unwrap_or("-"))
        };
        let _ = writeln!(o, "  {:<28} crc={:<5} {}", l.url, l.crc, state);
    }
    if let Some(m) = &s.metrics_listener {
        let state = match (&m.addr, m.bound) {
            (Some(a), true) => format!("http://{a}/metrics"),
            _ => format!("not bound: {}", m.note.as_deref().unwrap_or("-")),
        };
        let _ = writeln!(o, "  {:<28} metrics   {state}", m.configured);
    }
    let _ = writeln!(o, "\nNAMESPACES");
    let _ = writeln!(
        o,
        "  {:<36} {:>5} {:>10} {:>5} {:<3} {:<13} {:<22} {:>8} {:>6}",
        "SUBSYSTEM", "NSID", "SIZE", "BLOCK", "RO", "DOMAIN", "DURABILITY", "FLUSHES", "ERRORS"
    );
    for sub in &s.subsystems {
        if sub.namespaces.is_empty() {
            let _ = writeln!(o, "  {:<36} (no namespaces)", sub.nqn);
        }
        for ns in &sub.namespaces {
            let methods: Vec<String> = ns
                .durability
                .iter()
                .map(|t| {
                    let m = if t.methods.is_empty() {
                        "visible-only".to_owned()
                    } else {
                        t.methods.join("+")
                    };
                    format!("{}:{m}", t.transport)
                })
                .collect();
            let _ = writeln!(
                o,
                "  {:<36} {:>5} {:>10} {:>5} {:<3} {:<13} {:<22} {:>8} {:>6}",
                sub.nqn,
                ns.nsid,
                rpma_common::units::format_size(ns.size),
                ns.block_size,
                if ns.read_only { "yes" } else { "no" },
                ns.domain,
                methods.join(" "),
                ns.counters.flushes,
                ns.counters.flush_errors
            );
            if let Some(f) = &ns.failed {
                let since = ns
                    .failed_since
                    .as_ref()
                    .map_or_else(String::new, |t| format!(" since {t}"));
                let _ = writeln!(
                    o,
                    "  {:<36} {:>5} FAILED{since}: {f}; no durability until an operator runs \
                     `rpma-target clear-failure {} {}`",
                    "", ns.nsid, sub.nqn, ns.nsid
                );
            }
        }
    }
    let _ = writeln!(
        o,
        "\nDATA (per namespace, every host, ended sessions included; durability ok/failed)"
    );
    for sub in &s.subsystems {
        for ns in &sub.namespaces {
            let _ = writeln!(
                o,
                "  {:<36} {:>5} {}",
                sub.nqn,
                ns.nsid,
                data_line(&ns.data)
            );
        }
    }
    if let Some(a) = &s.admission {
        let _ = writeln!(o, "\nADMISSION");
        for (name, p) in [
            ("unadmitted", &a.unadmitted),
            ("discovery", &a.discovery),
            ("sessions", &a.sessions),
            ("unlisted", &a.unlisted),
        ] {
            let _ = writeln!(
                o,
                "  {name:<10} {:>5} of {:<5} per source {:<5} sources {:<5} evicted {}",
                p.held, p.limit, p.per_source_limit, p.sources, p.evicted
            );
        }
    }
    let _ = writeln!(o, "\nSESSIONS (counted: {SESSION_COUNTED})");
    if s.sessions.is_empty() {
        let _ = writeln!(o, "  (none)");
    }
    for x in &s.sessions {
        let _ = writeln!(
            o,
            "  {:<9} ctrl {:<5} {} -> {} from {} q{} age {}ms msgs {} flushes {} keep-alive {} ({}ms ago)",
            x.kind,
            x.controller_id,
            x.host_nqn,
            x.subsystem_nqn,
            x.peer,
            x.queue_id,
            x.age_ms,
            x.messages,
            x.flushes,
            x.keep_alive_state,
            x.last_keep_alive_ms
        );
        for n in &x.namespaces {
            let _ = writeln!(o, "      nsid {}: {}", n.nsid, data_line(&n.data));
        }
    }
    if let Some(m) = &s.metrics {
        render_metrics(&mut o, m);
    }
    o
}

/// One line of data counts.
fn data_line(d: &DataCounters) -> String {
    use rpma_common::units::format_size;
    let du = &d.durability;
    format!(
        "writes {} ({}) reads {} ({}) atomics {} apm {}/{} flush {}/{} gpspm {}/{}",
        d.writes,
        format_size(d.write_bytes),
        d.reads,
        format_size(d.read_bytes),
        d.atomics,
        du.apm.ok,
        du.apm.failed,
        du.flush.ok,
        du.flush.failed,
        du.gpspm.ok,
        du.gpspm.failed
    )
}

/// "name n, name n" of the non-zero counts, or "none".
fn nonzero(m: &std::collections::BTreeMap<String, u64>) -> String {
    let v: Vec<String> = m
        .iter()
        .filter(|(_, n)| **n > 0)
        .map(|(k, n)| format!("{k} {n}"))
        .collect();
    if v.is_empty() {
        "none".into()
    } else {
        v.join(", ")
    }
}

/// A latency bound for people: 250ns, 1.0us, 2.0ms, 1.05s.
fn fmt_ns(ns: Option<u64>) -> String {
    match ns {
        None => "-".into(),
        Some(n) if n < 1_000 => format!("{n}ns"),
        Some(n) if n < 1_000_000 => format!("{:.1}us", n as f64 / 1e3),
        Some(n) if n < 1_000_000_000 => format!("{:.1}ms", n as f64 / 1e6),
        Some(n) => format!("{:.2}s", n as f64 / 1e9),
    }
}

fn render_metrics(o: &mut String, m: &MetricsStatus) {
    use std::fmt::Write as _;
    let _ = writeln!(o, "\nEVENTS");
    let _ = writeln!(
        o,
        "  sessions admitted {} (discovery {}); ended: {}",
        m.sessions_admitted,
        m.discovery_admitted,
        nonzero(&m.sessions_ended)
    );
    let _ = writeln!(o, "  refusals: {}", nonzero(&m.refusals));
    let _ = writeln!(o, "  handshakes failed: {}", nonzero(&m.handshakes_failed));
    let _ = writeln!(o, "  terminates sent: {}", nonzero(&m.terminates));
    if !m.counting {
        let _ = writeln!(o, "  (this build does not count the data path)");
    }
    let _ = writeln!(o, "\nLATENCY (bucket bounds: at most twice the true value)");
    for l in &m.latency {
        let h = &l.histogram;
        let _ = writeln!(
            o,
            "  {:<14} {:<10} count {:<8} p50 <= {:<8} p99 <= {:<8} mean {}",
            l.kind,
            l.path,
            h.count(),
            fmt_ns(h.quantile_upper_ns(0.5)),
            fmt_ns(h.quantile_upper_ns(0.99)),
            fmt_ns(h.sum_ns.checked_div(h.count()))
        );
    }
}
