//! The control socket: a Unix stream socket where `rpma-target status` asks for the daemon's
//! state and `rpma-target clear-failure` clears a failed namespace. One request line
//! (`status`, `clear-failure SUBSYSTEM NSID`), one JSON answer, then the daemon closes the
//! connection.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::metrics::{DataCounters, MetricsStatus};
use crate::namespace::CountersSnapshot;

/// Errors of the control socket, server and client side.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ControlError {
    /// Another daemon answers on the socket.
    #[error("{0} is in use by a running daemon")]
    InUse(PathBuf),
    /// The socket could not be created.
    #[error("cannot bind the control socket {path}")]
    Bind {
        /// The socket's path.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The server thread could not start.
    #[error("cannot start the control thread")]
    Thread(#[source] std::io::Error),
    /// The client could not connect, send or receive.
    #[error("cannot talk to the daemon at {path}")]
    Connect {
        /// The socket's path.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The daemon's answer is not the JSON expected.
    #[error("the daemon's answer is not valid status JSON")]
    BadAnswer(#[source] serde_json::Error),
    /// The daemon answered with an error.
    #[error("the daemon refused the request: {0}")]
    Refused(String),
}

/// Result of the control socket.
pub type Result<T> = std::result::Result<T, ControlError>;

/// The daemon's state, as `status` reports it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Status {
    /// rpma-target's version.
    pub version: String,
    /// The daemon's pid.
    pub pid: u32,
    /// Seconds since start.
    pub uptime_s: u64,
    /// The configuration file.
    pub config: PathBuf,
    /// Successful reloads.
    pub reloads: u64,
    /// The last reload's outcome (summary or error).
    pub last_reload: Option<String>,
    /// Listeners.
    pub listeners: Vec<ListenerStatus>,
    /// Subsystems with their namespaces.
    pub subsystems: Vec<SubsystemStatus>,
    /// Sessions.
    pub sessions: Vec<SessionStatus>,
    /// The admission budgets in use (absent from a daemon that does not serve).
    #[serde(default)]
    pub admission: Option<AdmissionStatus>,
    /// Data-path and control-plane counts (absent from a daemon that does not serve).
    #[serde(default)]
    pub metrics: Option<MetricsStatus>,
    /// The metrics listener (absent unless `metrics_listen` is set).
    #[serde(default)]
    pub metrics_listener: Option<MetricsListenerStatus>,
}

/// The metrics listener.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MetricsListenerStatus {
    /// The configured address (`metrics_listen`).
    pub configured: String,
    /// The address it is bound to (port 0 configured: the one the kernel chose).
    pub addr: Option<String>,
    /// Serving.
    pub bound: bool,
    /// Why it is not bound, if it is not.
    pub note: Option<String>,
    /// Connections being served now (at most `MAX_SCRAPERS`).
    #[serde(default)]
    pub serving: usize,
}

/// The admission budgets: what each pool holds and allows.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AdmissionStatus {
    /// Connections past MPA whose Connect (and auth) has not finished.
    pub unadmitted: PoolStatus,
    /// Discovery sessions.
    pub discovery: PoolStatus,
    /// Admitted I/O sessions (`max_connections`; no per-source cap, nothing evicted).
    pub sessions: PoolStatus,
}

/// One pool.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolStatus {
    /// Held now.
    pub held: usize,
    /// At most, all sources together.
    pub limit: u32,
    /// At most per source address (0: no cap of its own).
    pub per_source_limit: u32,
    /// Source addresses holding some now.
    pub sources: usize,
    /// Taken back for newer connections since start.
    pub evicted: u64,
}

/// A listener.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ListenerStatus {
    /// URL.
    pub url: String,
    /// Accepting connections.
    pub bound: bool,
    /// CRC offered (tcp).
    pub crc: bool,
    /// The operator's declaration (rdma).
    pub direct_write_to_pmem: bool,
    /// Why it is not bound, if it is not.
    pub note: Option<String>,
}

/// An allowed host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostStatus {
    /// NQN.
    pub nqn: String,
    /// Must authenticate.
    pub psk: bool,
}

/// A subsystem.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SubsystemStatus {
    /// NQN.
    pub nqn: String,
    /// Any host may connect.
    pub allow_any_host: bool,
    /// Listed hosts.
    pub hosts: Vec<HostStatus>,
    /// Namespaces.
    pub namespaces: Vec<NamespaceStatus>,
}

/// Durability methods on one transport.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransportMethods {
    /// "tcp" or "rdma".
    pub transport: String,
    /// e.g. ["APM", "GPSPM", "FLUSH"]; empty: visible only.
    pub methods: Vec<String>,
}

/// A namespace.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NamespaceStatus {
    /// Namespace id.
    pub nsid: u32,
    /// Backing store.
    pub path: PathBuf,
    /// Bytes.
    pub size: u64,
    /// 512 or 4096.
    pub block_size: u32,
    /// Remote writes refused.
    pub read_only: bool,
    /// Persistence domain.
    pub domain: String,
    /// Methods per configured transport.
    pub durability: Vec<TransportMethods>,
    /// Counters of the GPSPM flush service and the sessions holding it.
    pub counters: CountersSnapshot,
    /// What hosts did with it: every session, those ended included.
    #[serde(default)]
    pub data: DataCounters,
    /// Set when the namespace has failed: the failed write-back call and its errno. No
    /// durability request on it succeeds until an operator clears it (`rpma-target
    /// clear-failure`); reloads and restarts keep it.
    #[serde(default)]
    pub failed: Option<String>,
    /// When it failed (UTC), as the state file remembers it.
    #[serde(default)]
    pub failed_since: Option<String>,
}

/// What a session's counters count, said in every [`SessionStatus::counted`].
pub const SESSION_COUNTED: &str = "control messages received and GPSPM flushes answered; per \
     namespace, the RDMA Writes, Reads, Atomics and Flushes the tcp transport's placement engine \
     served and the GPSPM requests";

/// A session's counts on one of its namespaces.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionNamespaceStatus {
    /// Namespace id.
    pub nsid: u32,
    /// The counts.
    pub data: DataCounters,
}

/// A connection: an I/O session, or a discovery connection.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionStatus {
    /// "io" (a session on a subsystem) or "discovery".
    pub kind: String,
    /// Controller id (0 on a discovery connection, as the host was told).
    pub controller_id: u16,
    /// Host NQN.
    pub host_nqn: String,
    /// Subsystem NQN.
    pub subsystem_nqn: String,
    /// Peer address.
    pub peer: String,
    /// Queue id.
    pub queue_id: u16,
    /// Milliseconds since connect.
    pub age_ms: u64,
    /// Control messages received from the host since it was admitted.
    pub messages: u64,
    /// GPSPM flushes answered (any status).
    pub flushes: u64,
    /// What the counters count and what they cannot: [`SESSION_COUNTED`].
    pub counted: String,
    /// Keep-alive period.
    pub keep_alive_ms: u32,
    /// Milliseconds since the last keep-alive.
    pub last_keep_alive_ms: u64,
    /// "ok", "late" or "expired".
    pub keep_alive_state: String,
    /// The data counts of the session, all its namespaces together.
    #[serde(default)]
    pub data: DataCounters,
    /// The data counts per namespace the session holds (or held: a namespace a reload removed
    /// stays listed).
    #[serde(default)]
    pub namespaces: Vec<SessionNamespaceStatus>,
}

/// Answers one request line.
pub type Handler = Arc<dyn Fn(&str) -> std::result::Result<String, String> + Send + Sync>;

/// The control socket server: a thread accepting connections until dropped.
pub struct ControlServer {
    path: PathBuf,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for ControlServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlServer")
            .field("path", &self.path)
            .finish()
    }
}

const MAX_REQUEST: u64 = 4096;

impl ControlServer {
    /// Binds `path` (creating its directory; replacing a stale socket, refusing one a live daemon
    /// answers on), mode 0660, and serves `handler` on a thread of its own. When this returns,
    /// the socket accepts.
    ///
    /// # Errors
    /// [`ControlError::InUse`], [`ControlError::Bind`], [`ControlError::Thread`].
    pub fn bind(path: &Path, handler: Handler) -> Result<Self> {
        let bind_err = |source| ControlError::Bind {
            path: path.to_owned(),
            source,
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(bind_err)?;
        }
        if let Ok(meta) = std::fs::symlink_metadata(path) {
            if meta.file_type().is_socket() {
                if UnixStream::connect(path).is_ok() {
                    return Err(ControlError::InUse(path.to_owned()));
                }
                std::fs::remove_file(path).map_err(bind_err)?;
            }
        }
        let listener = UnixListener::bind(path).map_err(bind_err)?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660)).map_err(bind_err)?;
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = stop.clone();
        let thread = std::thread::Builder::new()
            .name("rpma-control".into())
            .spawn(move || {
                for conn in listener.incoming() {
                    if stop2.load(Ordering::Acquire) {
                        break;
                    }
                    match conn {
                        Ok(c) => serve_one(c, &handler),
                        Err(e) => log::warn!("control socket: accept failed: {e}"),
                    }
                }
            })
            .map_err(ControlError::Thread)?;
        Ok(ControlServer {
            path: path.to_owned(),
            stop,
            thread: Some(thread),
        })
    }

    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for ControlServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Wake the blocking accept with a connection of our own.
        let _ = UnixStream::connect(&self.path);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

fn serve_one(conn: UnixStream, handler: &Handler) {
    let _ = conn.set_read_timeout(Some(Duration::from_secs(5)));
    let _ = conn.set_write_timeout(Some(Duration::from_secs(5)));
    let mut line = String::new();
    let read = BufReader::new((&conn).take(MAX_REQUEST)).read_line(&mut line);
    let answer = match read {
        Ok(0) => return,
        Ok(_) => match handler(line.trim()) {
            Ok(a) => a,
            Err(e) => serde_json::json!({ "error": e }).to_string(),
        },
        Err(e) => serde_json::json!({ "error": format!("bad request: {e}") }).to_string(),
    };
    let mut w = &conn;
    let _ = w
        .write_all(answer.as_bytes())
        .and_then(|_| w.write_all(b"\n"));
}

/// Sends one request and returns the raw answer.
///
/// # Errors
/// [`ControlError::Connect`].
pub fn request(path: &Path, line: &str) -> Result<String> {
    let err = |source| ControlError::Connect {
        path: path.to_owned(),
        source,
    };
    let mut s = UnixStream::connect(path).map_err(err)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .map_err(err)?;
    s.write_all(format!("{line}\n").as_bytes()).map_err(err)?;
    let mut out = String::new();
    s.read_to_string(&mut out).map_err(err)?;
    Ok(out)
}

/// Asks for the status.
///
/// # Errors
/// [`ControlError::Connect`], [`ControlError::Refused`], [`ControlError::BadAnswer`].
pub fn query_status(path: &Path) -> Result<(Status, String)> {
    let raw = request(path, "status")?;
    let v: serde_json::Value = serde_json::from_str(&raw).map_err(ControlError::BadAnswer)?;
    if let Some(e) = v.get("error").and_then(|e| e.as_str()) {
        return Err(ControlError::Refused(e.to_owned()));
    }
    let s = serde_json::from_value(v).map_err(ControlError::BadAnswer)?;
    Ok((s, raw))
}

/// Asks the daemon to clear the failure of namespace `nsid` of `subsystem` (`rpma-target
/// clear-failure`). Returns what the daemon logged: what may have been lost.
///
/// # Errors
/// [`ControlError::Connect`], [`ControlError::Refused`] (not failed, not configured, the
/// state file could not be updated), [`ControlError::BadAnswer`].
pub fn clear_failure(path: &Path, subsystem: &str, nsid: u32) -> Result<String> {
    let raw = request(path, &format!("clear-failure {subsystem} {nsid}"))?;
    let v: serde_json::Value = serde_json::from_str(&raw).map_err(ControlError::BadAnswer)?;
    if let Some(e) = v.get("error").and_then(|e| e.as_str()) {
        return Err(ControlError::Refused(e.to_owned()));
    }
    Ok(v["message"].as_str().unwrap_or_default().to_owned())
}

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

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Status {
        Status {
            version: "0.1.0".into(),
            pid: 1,
            uptime_s: 2,
            config: "/etc/rpma/rpma-target.toml".into(),
            reloads: 0,
            last_reload: None,
            listeners: vec![ListenerStatus {
                url: "tcp://127.0.0.1:7420".into(),
                bound: false,
                crc: true,
                direct_write_to_pmem: false,
                note: Some("transport not wired".into()),
            }],
            subsystems: vec![SubsystemStatus {
                nqn: "nqn.2026-11.io.rpma:demo".into(),
                allow_any_host: true,
                hosts: vec![],
                namespaces: vec![NamespaceStatus {
                    nsid: 1,
                    path: "/x".into(),
                    size: 1 << 20,
                    block_size: 4096,
                    read_only: false,
                    domain: "page-cache".into(),
                    durability: vec![TransportMethods {
                        transport: "tcp".into(),
                        methods: vec!["APM".into(), "GPSPM".into()],
                    }],
                    counters: CountersSnapshot::default(),
                    data: DataCounters {
                        writes: 3,
                        write_bytes: 12288,
                        ..DataCounters::default()
                    },
                    failed: Some("fdatasync failed: Input/output error (os error 5)".into()),
                    failed_since: Some("2026-12-01 15:00:00 UTC".into()),
                }],
            }],
            sessions: vec![SessionStatus {
                kind: "discovery".into(),
                controller_id: 0,
                host_nqn: "nqn.2026-11.io.rpma:host1".into(),
                subsystem_nqn: "nqn.2014-08.org.nvmexpress.discovery".into(),
                peer: "127.0.0.1:40000".into(),
                queue_id: 0,
                age_ms: 5,
                messages: 2,
                flushes: 0,
                counted: SESSION_COUNTED.into(),
                keep_alive_ms: 5000,
                last_keep_alive_ms: 1,
                keep_alive_state: "ok".into(),
                data: DataCounters::default(),
                namespaces: vec![SessionNamespaceStatus {
                    nsid: 1,
                    data: DataCounters {
                        reads: 2,
                        read_bytes: 16,
                        ..DataCounters::default()
                    },
                }],
            }],
            admission: Some(AdmissionStatus {
                unadmitted: PoolStatus {
                    held: 3,
                    limit: 64,
                    per_source_limit: 8,
                    sources: 2,
                    evicted: 7,
                },
                discovery: PoolStatus {
                    held: 1,
                    limit: 16,
                    per_source_limit: 4,
                    sources: 1,
                    evicted: 0,
                },
                sessions: PoolStatus {
                    held: 0,
                    limit: 64,
                    per_source_limit: 0,
                    sources: 0,
                    evicted: 0,
                },
            }),
            metrics: Some(MetricsStatus {
                counting: true,
                refusals: [("auth_failed".to_owned(), 2), ("other".to_owned(), 0)].into(),
                latency: vec![crate::metrics::LatencyStatus {
                    kind: "msync".into(),
                    path: "placement".into(),
                    histogram: {
                        let mut h = rpma_common::stats::Histogram::default();
                        h.record(3_000);
                        h
                    },
                }],
                ..MetricsStatus::default()
            }),
            metrics_listener: Some(MetricsListenerStatus {
                configured: "127.0.0.1:0".into(),
                addr: Some("127.0.0.1:9420".into()),
                bound: true,
                note: None,
                serving: 0,
            }),
        }
    }

    #[test]
    fn serves_status_and_errors() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("sub/ctl.sock");
        let st = sample();
        let json = serde_json::to_string(&st).unwrap();
        let handler: Handler = Arc::new(move |req| match req {
            "status" => Ok(json.clone()),
            other => Err(format!("unknown request {other:?}")),
        });
        let server = ControlServer::bind(&p, handler.clone()).unwrap();
        let (got, raw) = query_status(&p).unwrap();
        assert_eq!(got, st);
        assert!(raw.contains("nqn.2026-11.io.rpma:demo"));
        let e = request(&p, "frobnicate").unwrap();
        assert!(e.contains("unknown request"), "{e}");
        // A second daemon must not steal the socket.
        assert!(matches!(
            ControlServer::bind(&p, handler.clone()),
            Err(ControlError::InUse(_))
        ));
        drop(server);
        assert!(!p.exists(), "socket removed on drop");
        assert!(matches!(
            query_status(&p),
            Err(ControlError::Connect { .. })
        ));
    }

    #[test]
    fn stale_socket_is_replaced() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("ctl.sock");
        drop(UnixListener::bind(&p).unwrap());
        assert!(p.exists());
        let handler: Handler = Arc::new(|_| Err("x".into()));
        let _s = ControlServer::bind(&p, handler).unwrap();
        assert!(matches!(query_status(&p), Err(ControlError::Refused(e)) if e == "x"));
    }

    #[test]
    fn bad_answer_is_an_error() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("ctl.sock");
        let handler: Handler = Arc::new(|_| Ok("{\"not\": \"status\"}".into()));
        let _s = ControlServer::bind(&p, handler).unwrap();
        assert!(matches!(query_status(&p), Err(ControlError::BadAnswer(_))));
    }

    #[test]
    fn table_shows_the_essentials() {
        let t = render(&sample());
        assert!(t.contains("tcp://127.0.0.1:7420") && t.contains("not bound: transport not wired"));
        assert!(t.contains("page-cache") && t.contains("tcp:APM+GPSPM") && t.contains("1 MiB"));
        assert!(
            t.contains(&format!("SESSIONS (counted: {SESSION_COUNTED})")),
            "{t}"
        );
        assert!(t.contains("RDMA Writes, Reads, Atomics and Flushes"), "{t}");
        assert!(
            t.contains("127.0.0.1:0                  metrics   http://127.0.0.1:9420/metrics"),
            "{t}"
        );
        assert!(
            t.contains("writes 3 (12 KiB) reads 0 (0 B) atomics 0 apm 0/0 flush 0/0 gpspm 0/0"),
            "{t}"
        );
        assert!(
            t.contains("      nsid 1: writes 0 (0 B) reads 2 (16 B)"),
            "{t}"
        );
        assert!(t.contains("  refusals: auth_failed 2\n"), "{t}");
        assert!(t.contains("  terminates sent: none\n"), "{t}");
        assert!(
            t.contains("msync          placement  count 1        p50 <= 4.0us"),
            "{t}"
        );
        assert!(
            t.contains(
                "FAILED since 2026-12-01 15:00:00 UTC: fdatasync failed: Input/output error (os \
                 error 5); no durability until an operator runs `rpma-target clear-failure \
                 nqn.2026-11.io.rpma:demo 1`"
            ),
            "{t}"
        );
        assert!(
            t.contains("discovery ctrl 0 ") && t.contains("msgs 2 flushes 0"),
            "{t}"
        );
        assert!(
            t.contains("unadmitted     3 of 64    per source 8     sources 2     evicted 7"),
            "{t}"
        );
        let mut empty = sample();
        empty.sessions.clear();
        assert!(render(&empty).contains("\n  (none)"));
    }
}
