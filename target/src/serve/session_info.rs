//! A connection's identity and counters as `status` sees them ([`SessionInfo`], shared between
//! its poll loop and the readers), and what ended sessions had counted ([`Retired`]).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rpma_common::fabric::ResponderCounters;
use rpma_common::proto::Connect;
use rpma_common::stats::{Counter, Histogram};

use crate::config::Config;
use crate::control::{SessionNamespaceStatus, SessionStatus, SESSION_COUNTED};
use crate::metrics::{host_label, DataCounters, Outcomes};

/// What a session's transport counted per namespace where no placement engine counts it (an
/// NVMe/TCP controller: [`crate::nvme_tcp`]).
pub(crate) trait SessionCounts: Send + Sync + std::fmt::Debug {
    /// The counts per nsid, now.
    fn per_namespace(&self) -> Vec<(u32, DataCounters)>;
}

/// A connection's live counters and identity, shared between its poll loop and `status`.
#[derive(Debug)]
pub(crate) struct SessionInfo {
    /// "io", "discovery", or "registering" (an admitted host whose namespaces are being
    /// registered: its session's place, taken at admission).
    pub(crate) kind: &'static str,
    /// 0 on a discovery connection.
    pub(crate) controller_id: u16,
    pub(crate) host_nqn: String,
    pub(crate) subsystem_nqn: String,
    pub(crate) peer: String,
    pub(crate) queue_id: u16,
    pub(crate) started: Instant,
    pub(crate) keep_alive_ms: u32,
    /// Control messages received from the host.
    pub(crate) messages: AtomicU64,
    /// GPSPM flushes answered.
    pub(crate) flushes: AtomicU64,
    /// When the last message came in, in ms since `started`.
    pub(crate) last_seen_ms: AtomicU64,
    pub(crate) expired: AtomicBool,
    /// What the session's queue pair served (None on a transport that does not count, and on
    /// discovery connections).
    responder: Option<ResponderCounters>,
    /// The namespaces it was granted, with their rkeys and GPSPM counts.
    namespaces: Vec<SessionNs>,
    /// Counts kept by the transport itself (instead of the two above).
    counts: Option<std::sync::Arc<dyn SessionCounts>>,
}

/// A namespace of a session: the rkey its placement counts are under, and the GPSPM requests
/// the session's poll loop answered on it (that loop is their only writer).
#[derive(Debug)]
pub(crate) struct SessionNs {
    nsid: u32,
    rkey: u32,
    gpspm: Counter,
    gpspm_failed: Counter,
}

impl SessionInfo {
    /// A connection of `kind` just admitted with `c`, its counters at zero.
    pub(crate) fn new(
        kind: &'static str,
        controller_id: u16,
        c: &Connect,
        peer: SocketAddr,
        keep_alive: Duration,
    ) -> SessionInfo {
        SessionInfo {
            kind,
            controller_id,
            host_nqn: c.host_nqn.to_string(),
            subsystem_nqn: c.subsystem_nqn.to_string(),
            peer: peer.to_string(),
            queue_id: c.queue_id,
            started: Instant::now(),
            keep_alive_ms: keep_alive.as_millis() as u32,
            messages: AtomicU64::new(0),
            flushes: AtomicU64::new(0),
            last_seen_ms: AtomicU64::new(0),
            expired: AtomicBool::new(false),
            responder: None,
            namespaces: Vec::new(),
            counts: None,
        }
    }

    /// Counts the session's data path with `counts` (a transport without a placement engine).
    pub(crate) fn with_counts(mut self, counts: std::sync::Arc<dyn SessionCounts>) -> SessionInfo {
        self.counts = Some(counts);
        self
    }

    /// Counts the session's data path: its queue pair's responder counters and its
    /// namespaces as (nsid, rkey).
    pub(crate) fn with_data(
        mut self,
        responder: Option<ResponderCounters>,
        namespaces: impl IntoIterator<Item = (u32, u32)>,
    ) -> SessionInfo {
        self.responder = responder;
        self.namespaces = namespaces
            .into_iter()
            .map(|(nsid, rkey)| SessionNs {
                nsid,
                rkey,
                gpspm: Counter::new(),
                gpspm_failed: Counter::new(),
            })
            .collect();
        self
    }

    /// A GPSPM request on `nsid` was answered (`ok`: durable or visible only). Called by the
    /// session's poll loop only.
    pub(crate) fn gpspm_answered(&self, nsid: u32, ok: bool) {
        if let Some(n) = self.namespaces.iter().find(|n| n.nsid == nsid) {
            (if ok { &n.gpspm } else { &n.gpspm_failed }).add(1);
        }
    }

    /// The data counts per namespace, and the responder's persist histograms (writeback,
    /// msync), now.
    pub(super) fn data(&self) -> (Vec<(u32, DataCounters)>, Histogram, Histogram) {
        if let Some(c) = &self.counts {
            return (
                c.per_namespace(),
                Histogram::default(),
                Histogram::default(),
            );
        }
        let snap = self.responder.as_ref().map(ResponderCounters::snapshot);
        let per_ns = self
            .namespaces
            .iter()
            .map(|n| {
                let served = snap.as_ref().and_then(|s| s.region(n.rkey));
                let gpspm = Outcomes {
                    ok: n.gpspm.get(),
                    failed: n.gpspm_failed.get(),
                };
                (n.nsid, DataCounters::from_served(served, gpspm))
            })
            .collect();
        let (wb, ms) = snap
            .map(|s| (s.persist_writeback, s.persist_msync))
            .unwrap_or_default();
        (per_ns, wb, ms)
    }

    pub(super) fn status(&self) -> SessionStatus {
        let age = self.started.elapsed().as_millis() as u64;
        let since = age.saturating_sub(self.last_seen_ms.load(Ordering::Relaxed));
        let ka = u64::from(self.keep_alive_ms);
        let mut total = DataCounters::default();
        let namespaces: Vec<SessionNamespaceStatus> = self
            .data()
            .0
            .into_iter()
            .map(|(nsid, data)| {
                total.add(&data);
                SessionNamespaceStatus { nsid, data }
            })
            .collect();
        let state = if self.expired.load(Ordering::Relaxed) {
            "expired"
        } else if ka > 0 && since > ka * 3 / 4 {
            "late"
        } else {
            "ok"
        };
        SessionStatus {
            kind: self.kind.into(),
            controller_id: self.controller_id,
            host_nqn: self.host_nqn.clone(),
            subsystem_nqn: self.subsystem_nqn.clone(),
            peer: self.peer.clone(),
            queue_id: self.queue_id,
            age_ms: age,
            messages: self.messages.load(Ordering::Relaxed),
            flushes: self.flushes.load(Ordering::Relaxed),
            counted: SESSION_COUNTED.into(),
            keep_alive_ms: self.keep_alive_ms,
            last_keep_alive_ms: since,
            keep_alive_state: state.into(),
            data: total,
            namespaces,
        }
    }
}

/// What the sessions that ended had counted: per (subsystem, nsid, host label:
/// [`host_label`]), and the persist histograms of their queue pairs. Folded in under the session list's lock as each one is
/// unregistered, so that a reader never sees a session twice or a count go backwards.
#[derive(Debug, Default)]
pub(super) struct Retired {
    pub(super) hosts: BTreeMap<(String, u32, String), DataCounters>,
    pub(super) persist_writeback: Histogram,
    pub(super) persist_msync: Histogram,
}

impl Retired {
    pub(super) fn fold(&mut self, info: &SessionInfo, cfg: &Config) {
        let (per_ns, wb, ms) = info.data();
        let host = host_label(cfg, &info.subsystem_nqn, &info.host_nqn);
        for (nsid, d) in per_ns {
            if d.is_zero() {
                continue;
            }
            let key = (info.subsystem_nqn.clone(), nsid, host.clone());
            self.hosts.entry(key).or_default().add(&d);
        }
        self.persist_writeback.merge(&wb);
        self.persist_msync.merge(&ms);
    }
}
