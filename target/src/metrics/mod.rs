//! Observability: what the target counts, how `status` and the metrics endpoint show it.
//!
//! # Where the counts come from
//!
//! - The data path (RDMA Writes placed, Reads answered, atomics, APM Reads and FLUSH requests,
//!   Terminates, the persist work before responses) is counted by the transport's placement
//!   engine per queue pair and rkey, with one writer and no shared atomic
//!   ([`rpma_common::fabric::ResponderCounters`]); a session maps its rkeys to its namespaces.
//! - GPSPM requests are counted per session and namespace by the poll loop that answers them,
//!   and timed (arrival to answer, and the flusher's write-back or fdatasync) in the loop's own
//!   histograms ([`LoopStats`]).
//! - Control-plane events (admissions, refusals, ends of sessions, failed handshakes) are
//!   counted in [`Events`], shared atomics: they are not on the data path.
//!
//! Reading aggregates: per (subsystem, namespace, host), the sessions alive now plus what the
//! sessions that ended had counted (folded in as they end, under the same lock as the session
//! list, so that no count is seen twice or goes backwards). [`MetricsStatus`] is the result,
//! part of `status --json`; [`exposition`] renders it (with the rest of the status and the
//! process figures of [`process`]) as Prometheus text, which [`listener`] serves.

pub mod exposition;
pub mod listener;
pub mod process;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};

use rpma_common::fabric::{RegionServed, TerminateCause};
use rpma_common::proto::RefusalReason;
use rpma_common::stats::{Counter, Histogram, HistogramCell};
use serde::{Deserialize, Serialize};

/// Requests of one durability method: answered, and failed (an error status or a Terminate).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Outcomes {
    /// Answered: durable (or visible only, on a volatile namespace).
    pub ok: u64,
    /// Failed.
    pub failed: u64,
}

/// Durability requests by method.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DurabilityCounts {
    /// APM: Reads that had earlier Writes to make durable first.
    pub apm: Outcomes,
    /// FLUSH work requests.
    pub flush: Outcomes,
    /// GPSPM FlushRequests.
    pub gpspm: Outcomes,
}

/// What a host did with a namespace: one session's, or summed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataCounters {
    /// RDMA Write messages placed.
    pub writes: u64,
    /// Bytes placed by them.
    pub write_bytes: u64,
    /// RDMA Read Requests answered (APM Reads included).
    pub reads: u64,
    /// Bytes returned by them.
    pub read_bytes: u64,
    /// Atomics executed (fetch-and-add, compare-and-swap, Atomic Write).
    pub atomics: u64,
    /// Durability requests by method and outcome.
    pub durability: DurabilityCounts,
}

impl DataCounters {
    /// The placement engine's counts of one rkey, plus the GPSPM requests answered on it.
    pub fn from_served(r: Option<&RegionServed>, gpspm: Outcomes) -> DataCounters {
        let r = r.copied().unwrap_or_default();
        DataCounters {
            writes: r.writes,
            write_bytes: r.write_bytes,
            reads: r.reads,
            read_bytes: r.read_bytes,
            atomics: r.atomics,
            durability: DurabilityCounts {
                apm: Outcomes {
                    ok: r.apm,
                    failed: r.apm_failed,
                },
                flush: Outcomes {
                    ok: r.flushes,
                    failed: r.flushes_failed,
                },
                gpspm,
            },
        }
    }

    /// Adds `o` to these.
    pub fn add(&mut self, o: &DataCounters) {
        self.writes += o.writes;
        self.write_bytes += o.write_bytes;
        self.reads += o.reads;
        self.read_bytes += o.read_bytes;
        self.atomics += o.atomics;
        let (d, e) = (&mut self.durability, &o.durability);
        for (a, b) in [
            (&mut d.apm, e.apm),
            (&mut d.flush, e.flush),
            (&mut d.gpspm, e.gpspm),
        ] {
            a.ok += b.ok;
            a.failed += b.failed;
        }
    }

    /// Nothing counted.
    pub fn is_zero(&self) -> bool {
        *self == DataCounters::default()
    }
}

/// One host's counts on one namespace: its sessions now and those that ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostCounters {
    /// Subsystem NQN.
    pub subsystem: String,
    /// Namespace id.
    pub nsid: u32,
    /// Host NQN, for a host its subsystem lists; [`ANY_HOST`] for all the hosts
    /// `allow_any_host` admitted ([`host_label`]).
    pub host: String,
    /// The counts.
    pub data: DataCounters,
}

/// The host name the counts of every host a subsystem does not list (admitted by its
/// `allow_any_host`) are summed under.
pub const ANY_HOST: &str = "(allow_any_host)";

/// The `host` label of `host`'s counts on `subsystem`: its NQN if the configuration lists it
/// there (allow-listed or keyed), else [`ANY_HOST`]. So the per-host series and the status'
/// per-host table hold only hosts the operator named, plus one line per namespace for all the
/// others: an unauthenticated peer claiming a new host NQN per session adds nothing to them,
/// and can push no configured host's counts out (issue 22, F7).
pub fn host_label(cfg: &crate::config::Config, subsystem: &str, host: &str) -> String {
    let listed = cfg
        .subsystems
        .iter()
        .find(|s| s.nqn.as_str() == subsystem)
        .is_some_and(|s| s.hosts.iter().any(|h| h.nqn.as_str() == host));
    if listed {
        host.to_owned()
    } else {
        ANY_HOST.to_owned()
    }
}

/// A latency histogram with what it measures.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LatencyStatus {
    /// "writeback" (cache write-back + fence), "msync", "fdatasync" or "gpspm_request".
    pub kind: String,
    /// Where: "placement" (before an APM/FLUSH/atomic response) or "gpspm" (the flush service).
    pub path: String,
    /// The samples.
    pub histogram: Histogram,
}

/// The target-wide counts of `status --json` (`metrics`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MetricsStatus {
    /// Whether this build counts the data path (false: built with `--cfg rpma_no_counters`).
    pub counting: bool,
    /// Per subsystem, namespace and host, sessions ended included.
    pub hosts: Vec<HostCounters>,
    /// I/O sessions admitted since start.
    pub sessions_admitted: u64,
    /// Discovery sessions admitted since start.
    pub discovery_admitted: u64,
    /// I/O sessions ended since start, by reason ([`EndReason`] names).
    pub sessions_ended: BTreeMap<String, u64>,
    /// Connections refused since start, by reason ([`refusal_name`]).
    pub refusals: BTreeMap<String, u64>,
    /// Handshakes that ended without admission or refusal: "timeout", "abandoned",
    /// "bad_mpa_request".
    pub handshakes_failed: BTreeMap<String, u64>,
    /// Terminates sent, by cause ([`TerminateCause::name`]); counted when the connection ends.
    pub terminates: BTreeMap<String, u64>,
    /// Latency histograms.
    pub latency: Vec<LatencyStatus>,
}

/// Why an I/O session ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndReason {
    /// The host sent a Disconnect.
    Host,
    /// Its keep-alive lapsed.
    KeepAlive,
    /// The connection failed (closed, a Terminate either way).
    ConnectionLost,
    /// A reload changed its subsystem, host entry or one of its namespaces.
    Reload,
    /// The host broke the protocol.
    ProtocolError,
    /// The target stopped.
    Shutdown,
    /// A host of a higher standing took its place in the full target: one that proved its key
    /// (this one proved none), or one its subsystem lists (this one's does not list it).
    Evicted,
    /// A page of one of its namespaces could not be read or written (the namespace failed:
    /// docs/persistence.md, "A page the kernel cannot give back").
    NamespaceFailed,
}

impl EndReason {
    const ALL: [EndReason; 8] = [
        EndReason::Host,
        EndReason::KeepAlive,
        EndReason::ConnectionLost,
        EndReason::Reload,
        EndReason::ProtocolError,
        EndReason::Shutdown,
        EndReason::Evicted,
        EndReason::NamespaceFailed,
    ];

    /// "host", "keep_alive", "connection_lost", "reload", "protocol_error", "shutdown",
    /// "evicted", "namespace_failed".
    pub fn name(self) -> &'static str {
        match self {
            EndReason::Host => "host",
            EndReason::KeepAlive => "keep_alive",
            EndReason::ConnectionLost => "connection_lost",
            EndReason::Reload => "reload",
            EndReason::ProtocolError => "protocol_error",
            EndReason::Shutdown => "shutdown",
            EndReason::Evicted => "evicted",
            EndReason::NamespaceFailed => "namespace_failed",
        }
    }
}

/// The name a refusal is counted under.
pub fn refusal_name(r: RefusalReason) -> &'static str {
    match r {
        RefusalReason::UnknownSubsystem => "unknown_subsystem",
        RefusalReason::HostNotAllowed => "host_not_allowed",
        RefusalReason::AuthFailed => "auth_failed",
        RefusalReason::VersionUnsupported => "version_unsupported",
        RefusalReason::TooManyConnections => "too_many_connections",
        RefusalReason::ProtocolError => "protocol_error",
        RefusalReason::ShuttingDown => "shutting_down",
        _ => "other",
    }
}

const REFUSALS: [&str; 8] = [
    "unknown_subsystem",
    "host_not_allowed",
    "auth_failed",
    "version_unsupported",
    "too_many_connections",
    "protocol_error",
    "shutting_down",
    "other",
];

/// A handshake that ended without admission or refusal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HandshakeFailure {
    /// No complete Connect (and auth) within `handshake_timeout_ms`.
    Timeout,
    /// The peer went away (closed, or sent a Disconnect) before its Connect was admitted or
    /// refused. A Connect the target answers with an error, or a message other than the
    /// Connect before it, is a refusal, not this.
    Abandoned,
    /// The MPA Request was malformed (not an rpma client).
    BadMpaRequest,
}

const HANDSHAKE_FAILURES: [&str; 3] = ["timeout", "abandoned", "bad_mpa_request"];

/// Control-plane events, counted by whichever thread sees them (shared atomics: off the data
/// path, at most a few per connection).
#[derive(Debug, Default)]
pub struct Events {
    sessions_admitted: AtomicU64,
    discovery_admitted: AtomicU64,
    ended: [AtomicU64; EndReason::ALL.len()],
    refusals: [AtomicU64; 8],
    handshakes: [AtomicU64; 3],
}

impl Events {
    /// An I/O session (`discovery`: a discovery session) was admitted.
    pub fn admitted(&self, discovery: bool) {
        let c = if discovery {
            &self.discovery_admitted
        } else {
            &self.sessions_admitted
        };
        c.fetch_add(1, Ordering::Relaxed);
    }

    /// An I/O session ended.
    pub fn ended(&self, why: EndReason) {
        self.ended[why as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// A connection was refused with `reason`.
    pub fn refused(&self, reason: RefusalReason) {
        let i = REFUSALS
            .iter()
            .position(|n| *n == refusal_name(reason))
            .unwrap_or(7);
        self.refusals[i].fetch_add(1, Ordering::Relaxed);
    }

    /// A handshake failed.
    pub fn handshake_failed(&self, why: HandshakeFailure) {
        self.handshakes[why as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Fills the event counts of `m`.
    pub fn fill(&self, m: &mut MetricsStatus) {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        m.sessions_admitted = get(&self.sessions_admitted);
        m.discovery_admitted = get(&self.discovery_admitted);
        m.sessions_ended = EndReason::ALL
            .iter()
            .map(|r| (r.name().to_owned(), get(&self.ended[*r as usize])))
            .collect();
        m.refusals = REFUSALS
            .iter()
            .zip(self.refusals.iter())
            .map(|(n, a)| ((*n).to_owned(), get(a)))
            .collect();
        m.handshakes_failed = HANDSHAKE_FAILURES
            .iter()
            .zip(self.handshakes.iter())
            .map(|(n, a)| ((*n).to_owned(), get(a)))
            .collect();
    }
}

/// A poll loop's own counts: written by the loop's thread only, read by `status`.
#[derive(Debug, Default)]
pub struct LoopStats {
    /// GPSPM requests from arrival (the loop took the message) to answer (the response posted).
    pub gpspm_request: HistogramCell,
    /// The flusher's inline cache write-back + fence (dax).
    pub gpspm_writeback: HistogramCell,
    /// The flusher's fdatasync (page-cache), submission to completion.
    pub gpspm_fdatasync: HistogramCell,
    /// The loop's own sync of a page-cache range (the mapping's msync, when the loop had
    /// nothing else to do: `Flusher::submit_inline`), its length.
    pub gpspm_msync: HistogramCell,
    /// Terminates sent by the loop's connections that ended, by cause.
    terminates: [Counter; 5],
}

impl LoopStats {
    /// Adds the Terminates of a connection that ended.
    pub fn add_terminates(&self, t: &[u64; 5]) {
        for (c, n) in self.terminates.iter().zip(t.iter()) {
            if *n > 0 {
                c.add(*n);
            }
        }
    }

    /// The Terminates counted so far, in [`TerminateCause::ALL`] order.
    pub fn terminates(&self) -> [u64; 5] {
        let mut t = [0; 5];
        for (v, c) in t.iter_mut().zip(self.terminates.iter()) {
            *v = c.get();
        }
        t
    }
}

/// `terminates` (in [`TerminateCause::ALL`] order) by name.
pub fn terminates_by_name(t: &[u64; 5]) -> BTreeMap<String, u64> {
    TerminateCause::ALL
        .iter()
        .zip(t.iter())
        .map(|(c, n)| (c.name().to_owned(), *n))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_counters_come_from_the_engine_and_add_up() {
        let r = RegionServed {
            rkey: 3,
            writes: 2,
            write_bytes: 8192,
            reads: 1,
            read_bytes: 8,
            atomics: 4,
            apm: 1,
            apm_failed: 0,
            flushes: 5,
            flushes_failed: 1,
        };
        let g = Outcomes { ok: 7, failed: 2 };
        let d = DataCounters::from_served(Some(&r), g);
        assert_eq!(
            (d.writes, d.write_bytes, d.reads, d.atomics),
            (2, 8192, 1, 4)
        );
        assert_eq!(d.durability.flush, Outcomes { ok: 5, failed: 1 });
        assert_eq!(d.durability.apm, Outcomes { ok: 1, failed: 0 });
        assert_eq!(d.durability.gpspm, g);
        let mut sum = DataCounters::default();
        assert!(sum.is_zero());
        sum.add(&d);
        sum.add(&d);
        assert_eq!(sum.write_bytes, 16384);
        assert_eq!(sum.durability.gpspm, Outcomes { ok: 14, failed: 4 });
        assert!(!sum.is_zero());
        let none = DataCounters::from_served(None, Outcomes::default());
        assert!(none.is_zero());
    }

    #[test]
    fn events_are_listed_by_name_with_zeros() {
        let e = Events::default();
        e.admitted(false);
        e.admitted(false);
        e.admitted(true);
        e.ended(EndReason::KeepAlive);
        e.refused(RefusalReason::AuthFailed);
        e.refused(RefusalReason::Other(1000));
        e.handshake_failed(HandshakeFailure::Timeout);
        let mut m = MetricsStatus::default();
        e.fill(&mut m);
        assert_eq!((m.sessions_admitted, m.discovery_admitted), (2, 1));
        assert_eq!(m.sessions_ended["keep_alive"], 1);
        assert_eq!(m.sessions_ended["host"], 0);
        assert_eq!(m.sessions_ended.len(), 8);
        assert_eq!(m.sessions_ended["namespace_failed"], 0);
        assert_eq!(m.sessions_ended["evicted"], 0);
        assert_eq!(m.refusals["auth_failed"], 1);
        assert_eq!(m.refusals["other"], 1);
        assert_eq!(m.refusals["host_not_allowed"], 0);
        assert_eq!(m.refusals.len(), REFUSALS.len());
        for r in [
            RefusalReason::UnknownSubsystem,
            RefusalReason::HostNotAllowed,
            RefusalReason::VersionUnsupported,
            RefusalReason::TooManyConnections,
            RefusalReason::ProtocolError,
            RefusalReason::ShuttingDown,
        ] {
            assert!(m.refusals.contains_key(refusal_name(r)));
        }
        assert_eq!(m.handshakes_failed["timeout"], 1);
        assert_eq!(m.handshakes_failed["bad_mpa_request"], 0);
    }

    #[test]
    fn loops_sum_the_terminates_of_ended_connections() {
        let l = LoopStats::default();
        l.add_terminates(&[1, 0, 2, 0, 0]);
        l.add_terminates(&[1, 0, 0, 0, 3]);
        assert_eq!(l.terminates(), [2, 0, 2, 0, 3]);
        let m = terminates_by_name(&l.terminates());
        assert_eq!(m["access"], 2);
        assert_eq!(m["persist"], 3);
        assert_eq!(m["crc"], 0);
    }

    #[test]
    fn only_listed_hosts_have_a_label_of_their_own() {
        let d = std::path::Path::new("/");
        let cfg = crate::config::Config::from_toml(
            "[[subsystem]]\nnqn = \"nqn.2026-11.io.rpma:a\"\nallow_any_host = true\n\
             hosts = [{ nqn = \"nqn.2026-11.io.rpma:listed\" }]\n\
             [[subsystem]]\nnqn = \"nqn.2026-11.io.rpma:b\"\nallow_any_host = true\n",
            d,
        )
        .unwrap();
        let label = |s: &str, h: &str| host_label(&cfg, s, h);
        assert_eq!(
            label("nqn.2026-11.io.rpma:a", "nqn.2026-11.io.rpma:listed"),
            "nqn.2026-11.io.rpma:listed"
        );
        assert_eq!(
            label("nqn.2026-11.io.rpma:a", "nqn.2026-11.io.x:y"),
            ANY_HOST
        );
        // Listed on another subsystem only: not a name of its own here.
        assert_eq!(
            label("nqn.2026-11.io.rpma:b", "nqn.2026-11.io.rpma:listed"),
            ANY_HOST
        );
    }
}
