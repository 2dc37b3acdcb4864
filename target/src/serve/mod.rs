//! The fabric-backed [`Serve`]: listeners, poll loops and sessions.
//!
//! # Shape
//!
//! ```text
//!  accept thread (one per listener)      poll loop 0 .. poll_loops-1 (threads)
//!  Listener::accept_incoming, then the
//!  MPA Requests of every pending peer
//!  read at once -> ConnRequest --------> accepts into a QP on its own CQ, owns the connection:
//!                                        handshake -> session | discovery -> closing -> dropped
//! ```
//!
//! - An accept thread takes new TCP connections and reads their MPA Requests concurrently,
//!   without blocking, each with a deadline (so a slow or silent peer delays nobody), gives each
//!   complete request a place in the unadmitted pool (`budget.rs`: bounded in total and per
//!   source address, its oldest evicted when full) and hands it to the poll loop with the
//!   fewest connections; the loop creates the queue pair on its completion queue, posts the few
//!   receive slots the control exchange needs and accepts, so a connection is owned by one loop
//!   from its first byte to its last. At admission a session gets the rest of its slots (its
//!   queue depth); a discovery connection moves to the discovery pool.
//! - A poll loop waits on its completion queue (busy-polling while traffic flows,
//!   then blocking in epoll), runs each connection's control exchange and the GPSPM
//!   flush service of its own [`Flusher`](crate::flusher::Flusher) (io_uring: a slow disk never
//!   stalls the loop for a GPSPM flush). Polling also drives the transport's placement engine,
//!   which serves the hosts' Writes, Reads and Flushes inline: on a page-cache namespace an RDMA
//!   Flush, or the Read/Atomic that ends an APM sequence, waits for msync of the dirty range in
//!   this thread, and stalls the loop's other connections meanwhile (docs/architecture.md,
//!   "Durability and the poll loop").
//! - Every accept thread and poll loop bumps a heartbeat each turn; the daemon's watchdog
//!   check ([`Serve::check_progress`]) wakes them all and pings systemd only while every one
//!   has moved since the previous check.
//! - Each connection has a protection domain of its own. Its namespaces are registered in that
//!   domain at admission (one memory region per namespace, rights scoped: no remote write on a
//!   read-only namespace), so its rkeys are its own, reachable from no other connection, and
//!   revoked by deregistering them at disconnect, keep-alive expiry, reload or shutdown. Nothing
//!   is registered with a remote right before the host is admitted. docs/architecture.md says
//!   why this is not one region per namespace plus memory windows.
//!
//! Counted per session: control messages received, GPSPM flushes, and per namespace what the
//! transport's placement engine served (its per-queue-pair counters, read through the session's
//! rkeys) and the GPSPM requests answered. A session's counts are folded into its host's totals
//! when it ends ([`crate::metrics`] has the model).

mod acceptor;
pub(crate) mod budget;
mod conn;
mod peer_log;
mod poll_loop;
mod session_info;

pub use crate::seam::{Error, Result};
pub use acceptor::{MAX_PENDING, MPA_TIMEOUT};
use session_info::Retired;
pub(crate) use session_info::{SessionCounts, SessionInfo};

use std::collections::BTreeMap;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::Duration;

use rpma_common::fabric::{ConnRequest, Context, Url};
use rpma_common::stats::Histogram;

use crate::config::{Config, Transport};
use crate::control::{AdmissionStatus, ListenerStatus, PoolStatus, SessionStatus};
use crate::eventfd::EventFd;
use crate::metrics::{Events, HostCounters, LatencyStatus, LoopStats, MetricsStatus};
use crate::namespace::{NamespaceTable, NsKey, OpenNamespace};
use crate::reload::ConfigDiff;
use crate::seam::Serve;

/// How long a connection lingers after the target sent its last message (a Refusal, or a
/// Disconnect after keep-alive expiry, reload or shutdown) so that the host reads it. Its rkeys
/// are revoked before that message is sent: a Write meanwhile is refused with RemoteAccess.
pub const LINGER: Duration = Duration::from_secs(2);

/// Shortest keep-alive period a host may ask for.
pub const MIN_KEEP_ALIVE: Duration = Duration::from_millis(100);

/// A thread's sign of life: a counter it bumps every turn, and the eventfd that wakes it (so
/// that an idle thread, blocked in its wait, turns once when checked).
#[derive(Clone, Debug)]
pub(crate) struct Heartbeat(Arc<(String, AtomicU64, Arc<EventFd>)>);

impl Heartbeat {
    pub(crate) fn new(name: String, wake: Arc<EventFd>) -> Heartbeat {
        Heartbeat(Arc::new((name, AtomicU64::new(0), wake)))
    }

    /// The thread's name.
    pub(crate) fn name(&self) -> &str {
        &self.0 .0
    }

    /// Called by the thread each turn.
    pub(crate) fn tick(&self) {
        self.0 .1.fetch_add(1, Ordering::Relaxed);
    }

    /// Turns counted so far.
    pub(crate) fn count(&self) -> u64 {
        self.0 .1.load(Ordering::Relaxed)
    }

    /// Wakes the thread.
    pub(crate) fn ping(&self) {
        self.0 .2.signal();
    }

    /// Called by the woken thread.
    pub(crate) fn clear(&self) {
        self.0 .2.clear();
    }

    pub(crate) fn wake_fd(&self) -> BorrowedFd<'_> {
        self.0 .2.as_fd()
    }
}

/// What every thread of the serving machinery shares.
pub(crate) struct Shared {
    pub(crate) ctx: Context,
    config: RwLock<Arc<Config>>,
    namespaces: RwLock<Arc<BTreeMap<NsKey, Arc<OpenNamespace>>>>,
    pub(crate) stopping: AtomicBool,
    /// The pools of unadmitted connections and discovery sessions.
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
    /// A shared state serving `cfg` and `table`, without threads (unit tests of the code that
    /// uses it).
    #[cfg(test)]
    pub(crate) fn for_tests(cfg: &Config, table: &NamespaceTable) -> Arc<Shared> {
        let s = Arc::new(Shared {
            ctx: Context::soft(),
            config: RwLock::new(Arc::new(cfg.clone())),
            namespaces: RwLock::new(Arc::new(BTreeMap::new())),
            stopping: AtomicBool::new(false),
            budgets: Arc::new(budget::Budgets::default()),
            next_controller: AtomicU32::new(0),
            sessions: Mutex::new(BTreeMap::new()),
            discovery: Mutex::new(BTreeMap::new()),
            next_discovery: AtomicU64::new(0),
            peer_log: peer_log::PeerLog::new(Duration::from_secs(60)),
            events: Events::default(),
            loop_stats: Vec::new(),
            nvme_loop_stats: Vec::new(),
            retired: Mutex::new(Retired::default()),
        });
        s.set(cfg, table);
        s
    }

    pub(crate) fn config(&self) -> Arc<Config> {
        Arc::clone(&self.config.read().unwrap_or_else(|p| p.into_inner()))
    }

    pub(crate) fn namespaces(&self) -> Arc<BTreeMap<NsKey, Arc<OpenNamespace>>> {
        Arc::clone(&self.namespaces.read().unwrap_or_else(|p| p.into_inner()))
    }

    fn set(&self, cfg: &Config, table: &NamespaceTable) {
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
        };
        budget::Limits {
            total: total as usize,
            per_source: per_source as usize,
        }
    }

    /// Registers an admitted session under a controller id not in use (1..=0xFFFE): None if
    /// `max_connections` sessions are admitted already or every id is in use.
    pub(crate) fn register_session(
        &self,
        make: impl FnOnce(u16) -> SessionInfo,
    ) -> Option<Arc<SessionInfo>> {
        let limit = self.config().max_connections as usize;
        let mut s = self.sessions.lock().unwrap_or_else(|p| p.into_inner());
        if s.len() >= limit {
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

    /// The target-wide counts now.
    fn metrics(&self) -> MetricsStatus {
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
        let (mut req, mut gwb, mut fds) = (
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
    fn forget_removed(&self, table: &NamespaceTable, cfg: &Config) {
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

    /// Queues `cmd` and wakes the loop; gives `cmd` back if the loop is gone.
    pub(crate) fn send(&self, cmd: LoopCmd) -> std::result::Result<(), LoopCmd> {
        self.tx.send(cmd).map_err(|e| e.0)?;
        self.wake.signal();
        Ok(())
    }
}

/// A command to a poll loop.
pub(crate) enum LoopCmd {
    /// A new connection to accept and own, with its place in the unadmitted pool.
    Accept(ConnRequest, Box<budget::Ticket>),
    /// A connection of this loop lost its place in a pool to a newer one: close it.
    Evicted,
    /// The configuration was reloaded with this diff (shared config already updated).
    Reload(Arc<ConfigDiff>),
    /// Finish in-flight flushes, say goodbye to every session, exit.
    Stop,
}

struct LoopHandle {
    tx: LoopTx,
    load: Arc<AtomicUsize>,
    beat: Heartbeat,
    thread: Option<JoinHandle<()>>,
}

/// The fabric-backed [`Serve`]: see the module docs.
pub struct FabricServe {
    ctx: Context,
    shared: Option<Arc<Shared>>,
    loops: Vec<LoopHandle>,
    acceptors: Vec<acceptor::Acceptor>,
    /// The `nvme-tcp://` listeners, when there are any.
    nvme: Option<crate::nvme_tcp::Server>,
    /// Each thread's heartbeat count at the previous [`Serve::check_progress`], by name.
    beats_seen: BTreeMap<String, u64>,
}

impl std::fmt::Debug for FabricServe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FabricServe")
            .field("loops", &self.loops.len())
            .field("listeners", &self.acceptors.len())
            .field("shared", &self.shared)
            .field("ctx", &self.ctx)
            .finish()
    }
}

impl Default for FabricServe {
    fn default() -> Self {
        Self::new()
    }
}

/// A listener's fabric URL; `rdma://` is refused by a build without the `rdma` feature
/// (`nvme-tcp://` listeners are not the fabric's: [`crate::nvme_tcp`] serves them).
fn fabric_url(l: &crate::config::Listener) -> Result<Url> {
    let url = l.url.to_string();
    if l.url.transport == Transport::Rdma && !cfg!(feature = "rdma") {
        return Err(Error::RdmaNotServed { url });
    }
    Url::parse(&url).map_err(|source| Error::Url { url, source })
}

/// Refuses a configuration whose fabric listeners mix transports (one device serves every loop;
/// `nvme-tcp://` listeners have loops of their own).
fn one_transport(cfg: &Config) -> Result<()> {
    let of = |t| cfg.listeners.iter().find(|l| l.url.transport == t);
    match (of(Transport::Tcp), of(Transport::Rdma)) {
        (Some(t), Some(r)) => Err(Error::MixedTransports {
            tcp: t.url.to_string(),
            rdma: r.url.to_string(),
        }),
        _ => Ok(()),
    }
}

impl FabricServe {
    /// A server; nothing runs until [`Serve::bind`], which opens the device its listeners'
    /// URLs name.
    pub fn new() -> FabricServe {
        FabricServe {
            ctx: Context::soft(),
            shared: None,
            loops: Vec::new(),
            acceptors: Vec::new(),
            nvme: None,
            beats_seen: BTreeMap::new(),
        }
    }

    fn start(&mut self, cfg: &Config, namespaces: &NamespaceTable) -> Result<Vec<ListenerStatus>> {
        // Refuse what cannot be served before anything starts.
        let urls: Vec<Url> = cfg
            .listeners
            .iter()
            .filter(|l| l.url.transport.is_fabric())
            .map(fabric_url)
            .collect::<Result<_>>()?;
        let nvme_loops = if cfg.listeners.iter().any(|l| !l.url.transport.is_fabric()) {
            cfg.poll_loops.max(1) as usize
        } else {
            0
        };
        let nvme_loop_stats: Vec<Arc<LoopStats>> = (0..nvme_loops)
            .map(|_| Arc::new(LoopStats::default()))
            .collect();
        one_transport(cfg)?;
        // The device is the listeners' transport's (they share one: a config has one
        // transport). On rdma it is the device of the first listener's address; without one
        // this fails with "no RDMA device found; use tcp://".
        if let Some(url) = urls.first() {
            self.ctx = Context::for_url(url).map_err(|source| Error::Listen {
                url: url.to_string(),
                source,
            })?;
        }
        match crate::memlock::check(cfg, namespaces) {
            crate::memlock::Verdict::TooLow(message) => return Err(Error::Memlock { message }),
            crate::memlock::Verdict::Short(message) => log::warn!("{message}"),
            crate::memlock::Verdict::Fine => {}
        }
        let loop_stats: Vec<Arc<LoopStats>> = (0..cfg.poll_loops.max(1))
            .map(|_| Arc::new(LoopStats::default()))
            .collect();
        let shared = Arc::new(Shared {
            ctx: self.ctx.clone(),
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
            loop_stats: loop_stats.clone(),
            nvme_loop_stats: nvme_loop_stats.clone(),
            retired: Mutex::new(Retired::default()),
        });
        shared.set(cfg, namespaces);
        self.shared = Some(Arc::clone(&shared));
        for (index, stats) in loop_stats.iter().enumerate() {
            let (tx, rx) = mpsc::channel();
            let wake = EventFd::new().map(Arc::new).map_err(|e| Error::LoopSetup {
                index,
                source: Box::new(e),
            })?;
            let load = Arc::new(AtomicUsize::new(0));
            let tx = LoopTx::new(tx, Arc::clone(&wake));
            let name = format!("rpma-loop-{index}");
            let beat = Heartbeat::new(name.clone(), Arc::clone(&wake));
            let lp = poll_loop::PollLoop::new(
                index,
                Arc::clone(&shared),
                tx.clone(),
                rx,
                beat.clone(),
                Arc::clone(&load),
                Arc::clone(stats),
            )
            .map_err(|source| Error::LoopSetup { index, source })?;
            let thread = std::thread::Builder::new()
                .name(name.clone())
                .spawn(move || lp.run())
                .map_err(|source| Error::Thread { name, source })?;
            self.loops.push(LoopHandle {
                tx,
                load,
                beat,
                thread: Some(thread),
            });
        }
        let targets: Vec<(LoopTx, Arc<AtomicUsize>)> = self
            .loops
            .iter()
            .map(|l| (l.tx.clone(), Arc::clone(&l.load)))
            .collect();
        if nvme_loops > 0 {
            self.nvme = Some(crate::nvme_tcp::Server::start(&shared, &nvme_loop_stats)?);
        }
        let mut out = Vec::new();
        let mut urls = urls.into_iter();
        for l in &cfg.listeners {
            if let (false, Some(nvme)) = (l.url.transport.is_fabric(), self.nvme.as_mut()) {
                let bound = nvme.listen(&l.url)?;
                log::info!("listening on nvme-tcp://{bound} (NVMe/TCP)");
                out.push(ListenerStatus {
                    url: l.url.to_string(),
                    bound: true,
                    crc: false,
                    direct_write_to_pmem: false,
                    note: None,
                });
                continue;
            }
            let Some(url) = urls.next() else { continue };
            let a = acceptor::Acceptor::start(&shared, &url, targets.clone())?;
            log::info!("listening on {}", a.url());
            self.acceptors.push(a);
            out.push(ListenerStatus {
                url: l.url.to_string(),
                bound: true,
                crc: cfg.crc,
                direct_write_to_pmem: l.direct_write_to_pmem,
                note: None,
            });
        }
        Ok(out)
    }
}

impl Serve for FabricServe {
    fn bind(&mut self, cfg: &Config, namespaces: &NamespaceTable) -> Result<Vec<ListenerStatus>> {
        let started = self.start(cfg, namespaces);
        if started.is_err() {
            self.stop();
        }
        started
    }

    fn reloaded(&mut self, diff: &ConfigDiff, cfg: &Config, namespaces: &NamespaceTable) {
        let Some(shared) = &self.shared else { return };
        shared.set(cfg, namespaces);
        shared.forget_removed(namespaces, cfg);
        if let Some(nvme) = &self.nvme {
            nvme.reloaded(diff);
        }
        let diff = Arc::new(diff.clone());
        for l in &self.loops {
            let _ = l.tx.send(LoopCmd::Reload(Arc::clone(&diff)));
        }
    }

    fn check_progress(&mut self) -> Vec<String> {
        let beats = self
            .loops
            .iter()
            .map(|l| &l.beat)
            .chain(self.acceptors.iter().map(|a| a.heartbeat()))
            .chain(self.nvme.iter().flat_map(|n| n.heartbeats()));
        let mut stuck = Vec::new();
        for b in beats {
            let now = b.count();
            if self.beats_seen.insert(b.name().to_owned(), now) == Some(now) {
                stuck.push(b.name().to_owned());
            }
            // Woken so that an idle thread turns (and counts) before the next check.
            b.ping();
        }
        stuck
    }

    fn sessions(&self) -> Vec<SessionStatus> {
        let Some(shared) = &self.shared else {
            return Vec::new();
        };
        let s = shared.sessions.lock().unwrap_or_else(|p| p.into_inner());
        let mut out: Vec<SessionStatus> = s.values().map(|i| i.status()).collect();
        drop(s);
        let d = shared.discovery.lock().unwrap_or_else(|p| p.into_inner());
        out.extend(d.values().map(|i| i.status()));
        out
    }

    fn metrics(&self) -> Option<MetricsStatus> {
        Some(self.shared.as_ref()?.metrics())
    }

    fn admission(&self) -> Option<AdmissionStatus> {
        let shared = self.shared.as_ref()?;
        let cfg = shared.config();
        let pool = |p: budget::Pool| {
            let u = shared.budgets.usage(p);
            let l = shared.limits(p);
            PoolStatus {
                held: u.held,
                limit: l.total as u32,
                per_source_limit: l.per_source as u32,
                sources: u.sources,
                evicted: u.evicted,
            }
        };
        let sessions = shared
            .sessions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .len();
        Some(AdmissionStatus {
            unadmitted: pool(budget::Pool::Unadmitted),
            discovery: pool(budget::Pool::Discovery),
            sessions: PoolStatus {
                held: sessions,
                limit: cfg.max_connections,
                per_source_limit: 0,
                sources: 0,
                evicted: 0,
            },
        })
    }

    fn stop(&mut self) {
        if let Some(shared) = &self.shared {
            shared.stopping.store(true, Ordering::SeqCst);
        }
        for a in self.acceptors.drain(..) {
            a.stop();
        }
        if let Some(mut nvme) = self.nvme.take() {
            nvme.stop();
        }
        for l in &self.loops {
            let _ = l.tx.send(LoopCmd::Stop);
        }
        for l in &mut self.loops {
            if let Some(t) = l.thread.take() {
                if t.join().is_err() {
                    log::error!("a poll loop panicked while stopping");
                }
            }
        }
        self.loops.clear();
    }
}

impl Drop for FabricServe {
    fn drop(&mut self) {
        if !self.loops.is_empty() || !self.acceptors.is_empty() || self.nvme.is_some() {
            self.stop();
        }
    }
}
