//! The Prometheus text exposition (format 0.0.4) of a [`Status`] and the [`Process`] figures.
//!
//! Every family has HELP and TYPE lines and its samples together; names are `rpma_target_*`
//! (counters end in `_total`, units are seconds and bytes) plus the usual `process_*`.
//! Labels: `subsystem`, `nsid`, `host` for the data counters; `method`/`outcome`, `reason`,
//! `cause`, `kind`/`path` where a count is split. docs/operations.md has the reference.
//!
//! Written here rather than with the official `prometheus-client` crate (weighed for issue 24):
//! that crate writes only the OpenMetrics text format (`# EOF`, its own `_total` suffixing) and
//! is built around metrics that own their atomics in a registry; every figure here is a
//! snapshot of a [`Status`] taken at the scrape (the counters live in the poll loops, one
//! writer each), which it takes only through a `Collector` of const metrics, and its
//! histogram is one that values are observed into (sum, count and buckets behind a lock), with
//! no constant form for buckets counted elsewhere, as [`Histogram`]'s are (a hand-written
//! `EncodeMetric` would be needed anyway). What this file owns is small (escaping, float text, HELP/TYPE once per
//! family), and the output is checked by `promtool check metrics` and scraped by a real
//! Prometheus in tests/tests/metrics.rs.

use std::fmt::Write as _;

use rpma_common::stats::Histogram;

use super::process::Process;
use super::{DataCounters, MetricsStatus};
use crate::control::Status;

/// The `Content-Type` of [`render`]'s text.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Escapes a label value (backslash, double quote, line feed).
fn escape(v: &str) -> String {
    let mut o = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => o.push_str("\\\\"),
            '"' => o.push_str("\\\""),
            '\n' => o.push_str("\\n"),
            c => o.push(c),
        }
    }
    o
}

/// A float as the exposition writes it.
fn float(v: f64) -> String {
    if v.is_infinite() {
        if v > 0.0 { "+Inf" } else { "-Inf" }.to_owned()
    } else if v.is_nan() {
        "NaN".to_owned()
    } else {
        format!("{v}")
    }
}

struct Out {
    text: String,
}

impl Out {
    fn family(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.text, "# HELP {name} {help}");
        let _ = writeln!(self.text, "# TYPE {name} {kind}");
    }

    fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: impl std::fmt::Display) {
        self.text.push_str(name);
        if !labels.is_empty() {
            self.text.push('{');
            for (i, (k, v)) in labels.iter().enumerate() {
                if i > 0 {
                    self.text.push(',');
                }
                let _ = write!(self.text, "{k}=\"{}\"", escape(v));
            }
            self.text.push('}');
        }
        let _ = writeln!(self.text, " {value}");
    }

    /// A family with one sample per item of `items`.
    fn each<T>(
        &mut self,
        name: &str,
        kind: &str,
        help: &str,
        items: &[T],
        mut f: impl FnMut(&mut Out, &str, &T),
    ) {
        self.family(name, kind, help);
        for it in items {
            f(self, name, it);
        }
    }

    fn histogram(&mut self, name: &str, labels: &[(&str, &str)], h: &Histogram) {
        let bucket = format!("{name}_bucket");
        for (upper, count) in h.cumulative() {
            let le = match upper {
                Some(ns) => float(ns as f64 / 1e9),
                None => "+Inf".to_owned(),
            };
            let mut l = labels.to_vec();
            l.push(("le", &le));
            self.sample(&bucket, &l, count);
        }
        self.sample(&format!("{name}_sum"), labels, float(h.sum_ns as f64 / 1e9));
        self.sample(&format!("{name}_count"), labels, h.count());
    }
}

/// The data counters of one label set.
struct Series<'a> {
    labels: Vec<(&'a str, &'a str)>,
    data: &'a DataCounters,
}

fn data_families(o: &mut Out, series: &[Series<'_>]) {
    type Get = fn(&DataCounters) -> u64;
    let plain: [(&str, &str, Get); 5] = [
        (
            "rpma_target_writes_total",
            "RDMA Write messages placed into the namespace by the host; on nvme-tcp, Write and \
             Write Zeroes commands.",
            |d| d.writes,
        ),
        (
            "rpma_target_write_bytes_total",
            "Bytes placed by RDMA Writes of the host.",
            |d| d.write_bytes,
        ),
        (
            "rpma_target_reads_total",
            "RDMA Read Requests of the host answered (APM Reads included).",
            |d| d.reads,
        ),
        (
            "rpma_target_read_bytes_total",
            "Bytes returned by RDMA Reads of the host.",
            |d| d.read_bytes,
        ),
        (
            "rpma_target_atomics_total",
            "Atomics of the host executed (fetch-and-add, compare-and-swap, Atomic Write).",
            |d| d.atomics,
        ),
    ];
    for (name, help, get) in plain {
        o.each(name, "counter", help, series, |o, n, s| {
            o.sample(n, &s.labels, get(s.data))
        });
    }
    o.family(
        "rpma_target_durability_requests_total",
        "counter",
        "Durability requests of the host by method (apm, flush, gpspm) and outcome (ok, failed).",
    );
    for s in series {
        let d = &s.data.durability;
        for (method, out) in [("apm", d.apm), ("flush", d.flush), ("gpspm", d.gpspm)] {
            for (outcome, v) in [("ok", out.ok), ("failed", out.failed)] {
                let mut l = s.labels.clone();
                l.push(("method", method));
                l.push(("outcome", outcome));
                o.sample("rpma_target_durability_requests_total", &l, v);
            }
        }
    }
}

fn event_family(
    o: &mut Out,
    name: &str,
    help: &str,
    label: &str,
    m: &std::collections::BTreeMap<String, u64>,
) {
    o.family(name, "counter", help);
    for (k, v) in m {
        o.sample(name, &[(label, k)], v);
    }
}

fn metrics_families(o: &mut Out, m: &MetricsStatus) {
    let nsids: Vec<String> = m.hosts.iter().map(|h| h.nsid.to_string()).collect();
    let series: Vec<Series<'_>> = m
        .hosts
        .iter()
        .zip(nsids.iter())
        .map(|(h, nsid)| Series {
            labels: vec![
                ("subsystem", h.subsystem.as_str()),
                ("nsid", nsid.as_str()),
                ("host", h.host.as_str()),
            ],
            data: &h.data,
        })
        .collect();
    data_families(o, &series);
    o.family(
        "rpma_target_sessions_admitted_total",
        "counter",
        "Sessions admitted since start, by kind (io, discovery).",
    );
    o.sample(
        "rpma_target_sessions_admitted_total",
        &[("kind", "io")],
        m.sessions_admitted,
    );
    o.sample(
        "rpma_target_sessions_admitted_total",
        &[("kind", "discovery")],
        m.discovery_admitted,
    );
    event_family(
        o,
        "rpma_target_sessions_ended_total",
        "I/O sessions ended since start, by reason (keep_alive: the host's keep-alive lapsed).",
        "reason",
        &m.sessions_ended,
    );
    event_family(
        o,
        "rpma_target_refusals_total",
        "Connections refused since start, by reason.",
        "reason",
        &m.refusals,
    );
    event_family(
        o,
        "rpma_target_handshakes_failed_total",
        "Handshakes that ended without admission or refusal, by reason.",
        "reason",
        &m.handshakes_failed,
    );
    event_family(
        o,
        "rpma_target_terminates_sent_total",
        "Terminates sent to peers, by cause (counted when the connection ends).",
        "cause",
        &m.terminates,
    );
    let (req, persist): (Vec<_>, Vec<_>) =
        m.latency.iter().partition(|l| l.kind == "gpspm_request");
    o.family(
        "rpma_target_persist_duration_seconds",
        "histogram",
        "Persist work on the target by kind (writeback: cache write-back and fence; msync; \
         fdatasync) and path (placement: before an APM, FLUSH or atomic response; gpspm: the \
         flush service; nvme-tcp: an NVMe/TCP Write on dax, Flush or FUA).",
    );
    for l in persist {
        o.histogram(
            "rpma_target_persist_duration_seconds",
            &[("kind", &l.kind), ("path", &l.path)],
            &l.histogram,
        );
    }
    o.family(
        "rpma_target_gpspm_request_duration_seconds",
        "histogram",
        "GPSPM FlushRequests from arrival to answer.",
    );
    for l in req {
        o.histogram(
            "rpma_target_gpspm_request_duration_seconds",
            &[],
            &l.histogram,
        );
    }
}

fn process_families(o: &mut Out, p: &Process) {
    let fams: [(&str, &str, &str, Option<String>); 6] = [
        (
            "process_open_fds",
            "gauge",
            "Open file descriptors.",
            p.open_fds.map(|v| v.to_string()),
        ),
        (
            "process_max_fds",
            "gauge",
            "The limit of open file descriptors.",
            p.max_fds.map(|v| v.to_string()),
        ),
        (
            "process_resident_memory_bytes",
            "gauge",
            "Resident memory.",
            p.resident_bytes.map(|v| v.to_string()),
        ),
        (
            "process_virtual_memory_bytes",
            "gauge",
            "Virtual memory.",
            p.virtual_bytes.map(|v| v.to_string()),
        ),
        (
            "process_cpu_seconds_total",
            "counter",
            "User and system CPU time.",
            p.cpu_seconds.map(float),
        ),
        (
            "process_start_time_seconds",
            "gauge",
            "Start time of the process since the Unix epoch.",
            p.start_time_seconds.map(float),
        ),
    ];
    for (name, kind, help, v) in fams {
        if let Some(v) = v {
            o.family(name, kind, help);
            o.sample(name, &[], v);
        }
    }
}

/// The exposition of `s` and `p`.
pub fn render(s: &Status, p: &Process) -> String {
    let mut o = Out {
        text: String::with_capacity(16 << 10),
    };
    o.family(
        "rpma_target_build_info",
        "gauge",
        "Always 1; the version and whether the data path is counted.",
    );
    let counting = s.metrics.as_ref().is_some_and(|m| m.counting);
    o.sample(
        "rpma_target_build_info",
        &[
            ("version", &s.version),
            ("counting", if counting { "true" } else { "false" }),
        ],
        1,
    );
    o.family(
        "rpma_target_reloads_total",
        "counter",
        "Successful configuration reloads.",
    );
    o.sample("rpma_target_reloads_total", &[], s.reloads);
    o.family(
        "rpma_target_last_reload_failed",
        "gauge",
        "1 if the last reload failed (the running configuration was kept).",
    );
    let failed = s
        .last_reload
        .as_deref()
        .is_some_and(|r| r.starts_with("failed"));
    o.sample("rpma_target_last_reload_failed", &[], u8::from(failed));
    o.each(
        "rpma_target_listener_up",
        "gauge",
        "1 if the listener is bound.",
        &s.listeners,
        |o, n, l| o.sample(n, &[("url", &l.url)], u8::from(l.bound)),
    );

    let namespaces: Vec<(&str, &crate::control::NamespaceStatus, String)> = s
        .subsystems
        .iter()
        .flat_map(|sub| {
            sub.namespaces
                .iter()
                .map(move |ns| (sub.nqn.as_str(), ns, ns.nsid.to_string()))
        })
        .collect();
    o.each(
        "rpma_target_namespace_info",
        "gauge",
        "Always 1, per namespace: its persistence domain and whether it is read-only.",
        &namespaces,
        |o, n, (sub, ns, id)| {
            let ro = if ns.read_only { "true" } else { "false" };
            let labels = [
                ("subsystem", *sub),
                ("nsid", id.as_str()),
                ("domain", ns.domain.as_str()),
                ("read_only", ro),
            ];
            o.sample(n, &labels, 1)
        },
    );
    o.each(
        "rpma_target_namespace_size_bytes",
        "gauge",
        "Namespace size.",
        &namespaces,
        |o, n, (sub, ns, id)| o.sample(n, &[("subsystem", *sub), ("nsid", id)], ns.size),
    );
    o.each(
        "rpma_target_namespace_failed",
        "gauge",
        "1 if the namespace has failed (a write-back error): no durability until it is reopened.",
        &namespaces,
        |o, n, (sub, ns, id)| {
            let v = u8::from(ns.failed.is_some());
            o.sample(n, &[("subsystem", *sub), ("nsid", id)], v)
        },
    );
    o.each(
        "rpma_target_namespace_sessions",
        "gauge",
        "Sessions holding the namespace.",
        &namespaces,
        |o, n, (sub, ns, id)| {
            o.sample(
                n,
                &[("subsystem", *sub), ("nsid", id)],
                ns.counters.sessions,
            )
        },
    );
    o.each(
        "rpma_target_gpspm_flushed_bytes_total",
        "counter",
        "Bytes GPSPM requests made durable (or visible, on a volatile namespace).",
        &namespaces,
        |o, n, (sub, ns, id)| {
            let v = ns.counters.flushed_bytes;
            o.sample(n, &[("subsystem", *sub), ("nsid", id)], v)
        },
    );

    // Every configured subsystem and the discovery subsystem, with zero when none is open.
    let mut open = std::collections::BTreeMap::<(&str, &str), u64>::new();
    for sub in &s.subsystems {
        open.insert(("io", sub.nqn.as_str()), 0);
    }
    open.insert(("discovery", rpma_common::proto::nqn::DISCOVERY_NQN), 0);
    for x in &s.sessions {
        *open
            .entry((x.kind.as_str(), x.subsystem_nqn.as_str()))
            .or_default() += 1;
    }
    o.family(
        "rpma_target_sessions",
        "gauge",
        "Sessions open now, by kind (io, registering, discovery, nvme-tcp, nvme-discovery) and \
         subsystem.",
    );
    for ((kind, sub), n) in &open {
        o.sample(
            "rpma_target_sessions",
            &[("kind", kind), ("subsystem", sub)],
            n,
        );
    }

    if let Some(a) = &s.admission {
        let pools = [
            ("unadmitted", &a.unadmitted),
            ("discovery", &a.discovery),
            ("sessions", &a.sessions),
            ("unlisted", &a.unlisted),
        ];
        o.each(
            "rpma_target_admission_held",
            "gauge",
            "Places held in each admission pool.",
            &pools,
            |o, n, (p, s)| o.sample(n, &[("pool", p)], s.held),
        );
        o.each(
            "rpma_target_admission_limit",
            "gauge",
            "The size of each admission pool.",
            &pools,
            |o, n, (p, s)| o.sample(n, &[("pool", p)], s.limit),
        );
        o.each(
            "rpma_target_admission_evicted_total",
            "counter",
            "Connections closed to make room for newer ones, per pool.",
            &pools,
            |o, n, (p, s)| o.sample(n, &[("pool", p)], s.evicted),
        );
    }
    if let Some(m) = &s.metrics {
        metrics_families(&mut o, m);
    }
    process_families(&mut o, p);
    o.text
}

#[cfg(test)]
mod tests;
