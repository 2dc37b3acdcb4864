//! What `status` reports: the daemon's state as the control socket sends it (JSON) and
//! `rpma-target status` reads it.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::metrics::{DataCounters, MetricsStatus};
use crate::namespace::CountersSnapshot;

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
    /// Admitted I/O sessions (`max_connections`; no per-source cap; evicted: sessions whose
    /// host proved no key, closed for a host of a higher standing when the target was full,
    /// the unlisted ones' included).
    pub sessions: PoolStatus,
    /// Of the admitted sessions, those of hosts their subsystem does not list (let in by
    /// `allow_any_host`): the first closed for a listed host when the target is full (limit:
    /// `max_connections`; no per-source cap; evicted: closed so). Absent from the status of a
    /// daemon before it.
    #[serde(default)]
    pub unlisted: PoolStatus,
}

/// One pool.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
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
    /// "io" (a session on a subsystem), "registering" (an admitted host whose namespaces are
    /// being registered), or "discovery".
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
