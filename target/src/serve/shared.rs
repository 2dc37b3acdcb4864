//! What the threads of the serving machinery share: the state every accept thread and poll
//! loop reads ([`Shared`]: configuration, namespaces, pools, sessions, peer log, counts), the
//! way to a poll loop ([`LoopTx`], [`LoopCmd`]), each thread's [`Heartbeat`], and the times
//! every connection keeps. The fabric's threads (mod.rs and its files) and the NVMe/TCP
//! listener's ([`crate::nvme_tcp`]) build on this file; it names neither.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex, RwLock};
use std::time::Duration;

use rpma_common::fabric::{ConnRequest, Context};
use rpma_common::stats::Histogram;

use super::budget;
use super::peer_log;
use super::session_info::{Retired, SessionInfo};
use crate::config::Config;
use crate::control::SessionStatus;
use crate::eventfd::EventFd;
use crate::metrics::{Events, HostCounters, LatencyStatus, LoopStats, MetricsStatus};
use crate::namespace::{NamespaceTable, NsKey, OpenNamespace};
use crate::reload::ConfigDiff;
pub(crate) use crate::seam::Heartbeat;

/// How long a connection lingers after the target sent its last message (a Refusal, or a
/// Disconnect after keep-alive expiry, reload or shutdown) so that the host reads it. Its rkeys
/// are revoked before that message is sent: a Write meanwhile is refused with RemoteAccess.
pub const LINGER: Duration = Duration::from_secs(2);

/// Shortest keep-alive period a host may ask for.
pub const MIN_KEEP_ALIVE: Duration = Duration::from_millis(100);

/// What every thread of the serving machinery shares.
pub(crate) struct Shared {
    /// The device the loops and listeners use; replaced when an RDMA device that failed or was
    /// removed is back ([`Shared::revive_device`]).
    ctx: RwLock<Option<Context>>,
    config: RwLock<Arc<Config>>,
    namespaces: RwLock<Arc<BTreeMap<NsKey, Arc<OpenNamespace>>>>,
    pub(crate) stopping: AtomicBool,
    /// The pools of unadmitted connections, discovery sessions, and admitted sessions whose
    /// host proved no key (unproven, unlisted).
    pub(crate) budgets: Arc<budget::Budgets>,
    next_controller: AtomicU32,
    sessions: Mutex<BTreeMap<u16, Arc<SessionInfo>>>,
    /// Discovery connections (controller id 0 on the wire), by a serial of their own.
    discovery: Mutex<BTreeMap<u64, Arc<SessionInfo>>>,
    next_discovery: AtomicU64,
    /// Warnings about unauthenticated peers, rate-limited per address.
    pub(crate) peer_log: peer_log::PeerLog,
    /// Control-plane events.
    pub(crate) events: Events,
    /// Each poll loop's own counts.
    loop_stats: Vec<Arc<LoopStats>>,
    /// Each NVMe/TCP loop's own counts (its flushes' timings, its TermReqs).
    nvme_loop_stats: Vec<Arc<LoopStats>>,
    /// What ended sessions counted. Locked only while `sessions` is (in that order).
    retired: Mutex<Retired>,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("stopping", &self.stopping.load(Ordering::Relaxed))
            .finish()
    }
}

impl Shared {
    /// The state of serving `cfg` with these poll loops' counts (the namespaces come with
    /// [`set`](Self::set)).
    pub(super) fn new(
        ctx: Context,
        cfg: &Config,
        loop_stats: Vec<Arc<LoopStats>>,
        nvme_loop_stats: Vec<Arc<LoopStats>>,
    ) -> Shared {
        Shared {
            ctx: RwLock::new(Some(ctx)),
            config: RwLock::new(Arc::new(cfg.clone())),
            namespaces: RwLock::new(Arc::new(BTreeMap::new())),
            stopping: AtomicBool::new(false),
            budgets: Arc::new(budget::Budgets::default()),
            next_controller: AtomicU32::new(0),
            sessions: Mutex::new(BTreeMap::new()),
            discovery: Mutex::new(BTreeMap::new()),
            next_discovery: AtomicU64::new(0),
            peer_log: peer_log::PeerLog::new(Duration::from_millis(u64::from(
                cfg.admission.refusal_log_period_ms,
            ))),
            events: Events::default(),
            loop_stats,
            nvme_loop_stats,
            retired: Mutex::new(Retired::default()),
        }
    }

    /// A shared state serving `cfg` and `table`, without threads (unit tests of the code that
    /// uses it).
    #[cfg(test)]
    pub(crate) fn for_tests(cfg: &Config, table: &NamespaceTable) -> Arc<Shared> {
        let s = Arc::new(Shared::new(Context::soft(), cfg, Vec::new(), Vec::new()));
        s.set(cfg, table);
        s
    }

    pub(crate) fn config(&self) -> Arc<Config> {
        Arc::clone(&self.config.read().unwrap_or_else(|p| p.into_inner()))
    }

    /// The device the loops and listeners use now; None while it is lost (released so that
    /// the kernel can finish removing it: a driver that cannot disassociate a context waits for
    /// every process to close it).
    pub(crate) fn ctx(&self) -> Option<Context> {
        self.ctx.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The device in use is lost: let it go ([`revive_device`](Self::revive_device) opens it
    /// again). Called by the loops and listeners that saw it, which drop their own objects on
    /// it.
    pub(crate) fn release_lost_device(&self) {
        let mut ctx = self.ctx.write().unwrap_or_else(|p| p.into_inner());
        if ctx.as_ref().is_some_and(Context::is_lost) {
            *ctx = None;
        }
    }

    /// The device to listen on for `url`: the one in use while it works; once it is lost, the
    /// device that serves `url` now, opened anew (outside the lock: resolving may take a
    /// moment), put in its place and handed to `tell` (which tells the loops) before anyone
    /// else can see it, so that a listener hands a loop a connection on the new device only
    /// after the loop heard of it. Several listeners of one lost device open it once: the
    /// first back replaces it, the others find it working.
    pub(crate) fn revive_device(
        &self,
        url: &rpma_common::fabric::Url,
        tell: impl FnOnce(&Context),
    ) -> Result<Context, rpma_common::fabric::Error> {
        let working = |c: &Option<Context>| c.as_ref().filter(|c| !c.is_lost()).cloned();
        if let Some(c) = working(&self.ctx.read().unwrap_or_else(|p| p.into_inner())) {
            return Ok(c);
        }
        let new = Context::for_url(url)?;
        let mut ctx = self.ctx.write().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = working(&ctx) {
            return Ok(c);
        }
        tell(&new);
        *ctx = Some(new.clone());
        Ok(new)
    }

    pub(crate) fn namespaces(&self) -> Arc<BTreeMap<NsKey, Arc<OpenNamespace>>> {
        Arc::clone(&self.namespaces.read().unwrap_or_else(|p| p.into_inner()))
    }

    pub(super) fn set(&self, cfg: &Config, table: &NamespaceTable) {
        let map: BTreeMap<NsKey, Arc<OpenNamespace>> = table
            .iter()
            .map(|(k, ns)| (k.clone(), Arc::clone(ns)))
            .collect();
        *self.namespaces.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(map);
        *self.config.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(cfg.clone());
        self.peer_log.set_period(Duration::from_millis(u64::from(
            cfg.admission.refusal_log_period_ms,
        )));
    }

    /// The limits of `pool` in the current configuration.
    pub(crate) fn limits(&self, pool: budget::Pool) -> budget::Limits {
        let a = &self.config().admission;
        let (total, per_source) = match pool {
            budget::Pool::Unadmitted => (a.max_unadmitted, a.max_unadmitted_per_source),
            budget::Pool::Discovery => (a.max_discovery, a.max_discovery_per_source),
            // Bounded by max_connections with every session; nobody is evicted for its own
            // kind (see register_session).
            budget::Pool::Unproven | budget::Pool::Unlisted => {
                let m = self.config().max_connections;
                (m, m)
            }
        };
        budget::Limits {
            total: total as usize,
            per_source: per_source as usize,
        }
    }

    /// Registers an admitted session under a controller id not in use (1..=0xFFFE): None if
    /// `max_connections` sessions are admitted already or every id is in use. A host finding
    /// the target full takes the place of the oldest session of a class below its `standing`
    /// ([`budget::Budgets::make_room`]: a proven host that of an unlisted session, else of an
    /// unproven one; a listed host that of an unlisted one); its loop closes that one (until
    /// then the target holds it over its limit). So peers a subsystem does not
    /// list, from any address, cannot lock listed hosts out, nor peers that proved nothing
    /// keyed hosts. Without such a session it is refused too.
    pub(crate) fn register_session(
        &self,
        standing: budget::Standing,
        make: impl FnOnce(u16) -> SessionInfo,
    ) -> Option<Arc<SessionInfo>> {
        let limit = self.config().max_connections as usize;
        let mut s = self.sessions.lock().unwrap_or_else(|p| p.into_inner());
        if s.len() >= limit && self.budgets.make_room(standing).is_none() {
            return None;
        }
        for _ in 0..0xFFFE {
            let id = (self.next_controller.fetch_add(1, Ordering::Relaxed) % 0xFFFE + 1) as u16;
            if let std::collections::btree_map::Entry::Vacant(v) = s.entry(id) {
                let info = Arc::new(make(id));
                v.insert(Arc::clone(&info));
                return Some(info);
            }
        }
        None
    }

    /// Lists a discovery connection in `status` until the returned key is unregistered.
    /// A session ended for `why`: counted, and its line logged about `peer` (a session line,
    /// under the peer log's budgets) — the count and the line always go together.
    pub(crate) fn session_ended(
        &self,
        why: crate::metrics::EndReason,
        peer: std::net::IpAddr,
        level: log::Level,
        msg: std::fmt::Arguments<'_>,
    ) {
        self.events.ended(why);
        self.peer_log
            .log(peer, peer_log::Class::Session, level, msg);
    }

    pub(crate) fn register_discovery(&self, info: Arc<SessionInfo>) -> u64 {
        let key = self.next_discovery.fetch_add(1, Ordering::Relaxed);
        self.discovery
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key, info);
        key
    }

    pub(crate) fn unregister_discovery(&self, key: u64) {
        self.discovery
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&key);
    }

    /// Removes an ended session from the list, folding its counts into its host's totals.
    pub(crate) fn unregister_session(&self, controller_id: u16) {
        let cfg = self.config();
        let mut s = self.sessions.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(info) = s.remove(&controller_id) {
            self.retired
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .fold(&info, &cfg);
        }
    }

    /// The sessions and discovery connections, for `status`.
    pub(super) fn statuses(&self) -> Vec<SessionStatus> {
        let s = self.sessions.lock().unwrap_or_else(|p| p.into_inner());
        let mut out: Vec<SessionStatus> = s.values().map(|i| i.status()).collect();
        drop(s);
        let d = self.discovery.lock().unwrap_or_else(|p| p.into_inner());
        out.extend(d.values().map(|i| i.status()));
        out
    }

    /// Takes a session's place for an admitted host whose namespaces are still to be
    /// registered, as [`register_session`](Self::register_session) does (a full target makes
    /// room for a host of a higher standing, or refuses: None); the host is a session in every
    /// count from now on. The place is given back when the returned [`Reserved`] drops, unless
    /// the session took it over ([`Reserved::keep`]).
    pub(crate) fn reserve_session(
        self: &Arc<Self>,
        standing: budget::Standing,
        make: impl FnOnce(u16) -> SessionInfo,
    ) -> Option<Reserved> {
        let info = self.register_session(standing, make)?;
        Some(Reserved {
            shared: Arc::clone(self),
            controller_id: info.controller_id,
            cancel: Arc::new(AtomicBool::new(false)),
            kept: false,
        })
    }

    /// Puts `info` in place of the session entry with its controller id (a session whose
    /// place was [reserved](Self::reserve_session), with its data now).
    pub(crate) fn replace_session(&self, info: Arc<SessionInfo>) {
        let mut s = self.sessions.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(e) = s.get_mut(&info.controller_id) {
            *e = info;
        }
    }

    /// How many sessions are admitted.
    pub(super) fn session_count(&self) -> usize {
        self.sessions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .len()
    }

    /// The target-wide counts now.
    pub(super) fn metrics(&self) -> MetricsStatus {
        let mut m = MetricsStatus {
            counting: rpma_common::stats::COUNTING,
            ..MetricsStatus::default()
        };
        self.events.fill(&mut m);
        let cfg = self.config();
        let (hosts, wb, ms) = {
            let live = self.sessions.lock().unwrap_or_else(|p| p.into_inner());
            let r = self.retired.lock().unwrap_or_else(|p| p.into_inner());
            let (mut hosts, mut wb, mut ms) =
                (r.hosts.clone(), r.persist_writeback, r.persist_msync);
            drop(r);
            for info in live.values() {
                let (per_ns, w, m) = info.data();
                let host = crate::metrics::host_label(&cfg, &info.subsystem_nqn, &info.host_nqn);
                for (nsid, d) in per_ns {
                    let key = (info.subsystem_nqn.clone(), nsid, host.clone());
                    hosts.entry(key).or_default().add(&d);
                }
                wb.merge(&w);
                ms.merge(&m);
            }
            (hosts, wb, ms)
        };
        m.hosts = hosts
            .into_iter()
            .map(|((subsystem, nsid, host), data)| HostCounters {
                subsystem,
                nsid,
                host,
                data,
            })
            .collect();
        let mut terminates = [0u64; 5];
        let (mut req, mut gwb, mut fds, mut gms) = (
            Histogram::default(),
            Histogram::default(),
            Histogram::default(),
            Histogram::default(),
        );
        for l in &self.loop_stats {
            for (t, n) in terminates.iter_mut().zip(l.terminates()) {
                *t += n;
            }
            Histogram::merge(&mut req, &l.gpspm_request.snapshot());
            Histogram::merge(&mut gwb, &l.gpspm_writeback.snapshot());
            Histogram::merge(&mut fds, &l.gpspm_fdatasync.snapshot());
            Histogram::merge(&mut gms, &l.gpspm_msync.snapshot());
        }
        // The NVMe/TCP loops: their C2HTermReqs, their per-Write write-backs (dax) and their
        // flushes' fdatasyncs (page-cache), kept in the same cells.
        let (mut nwb, mut nfds) = (Histogram::default(), Histogram::default());
        for l in &self.nvme_loop_stats {
            for (t, n) in terminates.iter_mut().zip(l.terminates()) {
                *t += n;
            }
            Histogram::merge(&mut nwb, &l.gpspm_writeback.snapshot());
            Histogram::merge(&mut nfds, &l.gpspm_fdatasync.snapshot());
        }
        m.terminates = crate::metrics::terminates_by_name(&terminates);
        let lat = |kind: &str, path: &str, histogram: Histogram| LatencyStatus {
            kind: kind.into(),
            path: path.into(),
            histogram,
        };
        m.latency = vec![
            lat("writeback", "placement", wb),
            lat("msync", "placement", ms),
            lat("writeback", "gpspm", gwb),
            lat("fdatasync", "gpspm", fds),
            lat("msync", "gpspm", gms),
            lat("gpspm_request", "gpspm", req),
        ];
        if !self.nvme_loop_stats.is_empty() {
            m.latency.push(lat("writeback", "nvme-tcp", nwb));
            m.latency.push(lat("fdatasync", "nvme-tcp", nfds));
        }
        m
    }

    /// After a reload: forget the ended sessions' counts of namespaces no longer configured,
    /// and of hosts their subsystem no longer lists.
    pub(super) fn forget_removed(&self, table: &NamespaceTable, cfg: &Config) {
        let _live = self.sessions.lock().unwrap_or_else(|p| p.into_inner());
        let mut r = self.retired.lock().unwrap_or_else(|p| p.into_inner());
        r.hosts.retain(|(sub, nsid, host), _| {
            table
                .iter()
                .any(|((s, n), _)| n == nsid && s.as_str() == sub.as_str())
                && (host == crate::metrics::ANY_HOST
                    || crate::metrics::host_label(cfg, sub, host) == *host)
        });
    }
}

/// A session's place taken for an admitted host whose namespaces are being registered
/// ([`Shared::reserve_session`]). When it drops, a registration not started yet is called off
/// and, unless the session took the place over, the place is given back.
pub(crate) struct Reserved {
    shared: Arc<Shared>,
    /// The session's controller id.
    pub(crate) controller_id: u16,
    cancel: Arc<AtomicBool>,
    kept: bool,
}

impl Reserved {
    /// Set once the place is given back or kept: the registrar skips what it has not
    /// registered yet.
    pub(crate) fn cancel(&self) -> Arc<AtomicBool> {
        Arc::clone(&self.cancel)
    }

    /// The session takes the place over (and gives it back itself, when it ends).
    pub(crate) fn keep(mut self) {
        self.kept = true;
    }
}

impl Drop for Reserved {
    fn drop(&mut self) {
        self.cancel.store(true, Ordering::Relaxed);
        if !self.kept {
            self.shared.unregister_session(self.controller_id);
        }
    }
}

/// The way to a poll loop: its command channel, and the eventfd that wakes its idle wait.
#[derive(Clone)]
pub(crate) struct LoopTx {
    tx: mpsc::Sender<LoopCmd>,
    wake: Arc<EventFd>,
}

impl std::fmt::Debug for LoopTx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LoopTx")
    }
}

impl LoopTx {
    pub(crate) fn new(tx: mpsc::Sender<LoopCmd>, wake: Arc<EventFd>) -> LoopTx {
        LoopTx { tx, wake }
    }

    /// Wakes the loop (something for it waits elsewhere: its registrar's results).
    pub(crate) fn wake(&self) {
        self.wake.signal();
    }

    /// Queues `cmd` and wakes the loop; gives `cmd` back if the loop is gone.
    pub(crate) fn send(&self, cmd: LoopCmd) -> std::result::Result<(), LoopCmd> {
        self.tx.send(cmd).map_err(|e| e.0)?;
        self.wake.signal();
        Ok(())
    }
}

/// A command to a poll loop.
pub(crate) enum LoopCmd {
    /// The RDMA device failed or was removed and is back as this context: make the loop's
    /// completion queue on it (the connections on the old one are over).
    Device(Context),
    /// The RDMA device is lost (a listener saw it): let go of the completion queue on it, if
    /// the loop has not already.
    Lost,
    /// A new connection to accept and own, with its place in the unadmitted pool.
    Accept(ConnRequest, Box<budget::Ticket>),
    /// A connection of this loop lost its place in a pool to a newer one: close it.
    Evicted,
    /// The configuration was reloaded with this diff (shared config already updated); the
    /// loop confirms it has applied it by dropping the token, when there is one (also if it
    /// panics, or the command is never taken).
    Reload(Arc<ConfigDiff>, Option<crate::seam::Applied>),
    /// Finish in-flight flushes, say goodbye to every session, exit.
    Stop,
}

impl budget::Owner for LoopTx {
    fn evicted(&self) {
        let _ = self.send(LoopCmd::Evicted);
    }
}
