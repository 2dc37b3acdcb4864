//! The daemon: load the configuration, map every namespace, start the control socket, bind the
//! listeners (through the [`Serve`] seam), then READY=1; serve signals until SIGTERM/SIGINT.
//!
//! Order and readiness: READY=1 is sent only after every namespace is mapped, the control socket
//! accepts and [`Serve::bind`] returned; its STATUS= line says how many listeners are bound, so a
//! daemon whose listeners are not bound does not claim to serve anything.
//!
//! Signals are taken through a signalfd (blocked in every thread, read by the main loop):
//! SIGHUP reloads (RELOADING=1, diff, apply, READY=1), SIGTERM/SIGINT stop (STOPPING=1, then
//! [`Serve::stop`] completes in-flight flushes and closes sessions, then exit 0).
//!
//! The metrics endpoint (`metrics_listen`, off by default) is started with the control socket,
//! before READY=1, and moved by a reload that changes the address; every scrape renders the
//! same [`Status`] that `status` answers ([`crate::metrics::exposition`]).

use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::signal::{SigSet, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};

use crate::config::{Config, ConfigError, Transport};
use crate::control::{
    self, ControlError, ControlServer, HostStatus, ListenerStatus, MetricsListenerStatus,
    NamespaceStatus, SessionStatus, Status, SubsystemStatus, TransportMethods,
};
use crate::failures::FailureLedger;
use crate::fdstore::FdStore;
use crate::metrics::listener::{ListenerError, MetricsServer, PageFn};
use crate::metrics::DataCounters;
use crate::namespace::{NamespaceError, NamespaceTable};
use crate::notify::{Notifier, NotifyError};
use crate::reload::ConfigDiff;
pub use crate::seam::Serve;

mod reloading;
mod watchdog;

/// Errors that stop the daemon.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DaemonError {
    /// Signal handling could not be set up.
    #[error("cannot set up signal handling")]
    Signals(#[source] nix::Error),
    /// The notification socket is misconfigured.
    #[error(transparent)]
    Notify(#[from] NotifyError),
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A namespace could not be opened.
    #[error(transparent)]
    Namespace(#[from] NamespaceError),
    /// The state file (failed namespaces) could not be opened or read.
    #[error(transparent)]
    Ledger(#[from] crate::failures::LedgerError),
    /// The control socket could not be started.
    #[error(transparent)]
    Control(#[from] ControlError),
    /// The listeners could not be bound.
    #[error(transparent)]
    Serve(#[from] crate::seam::Error),
    /// The metrics listener could not be started.
    #[error(transparent)]
    Metrics(#[from] ListenerError),
}

/// Result of the daemon.
pub type Result<T> = std::result::Result<T, DaemonError>;

/// No transport: binds nothing and says so in every listener's status (tests of the daemon's
/// own machinery; the binary serves with [`crate::serve::FabricServe`]).
#[derive(Debug, Default)]
pub struct NoTransport;

impl Serve for NoTransport {
    fn bind(
        &mut self,
        cfg: &Config,
        _: &NamespaceTable,
    ) -> crate::seam::Result<Vec<ListenerStatus>> {
        log::warn!("no listener is bound: this daemon runs without a transport");
        Ok(cfg
            .listeners
            .iter()
            .map(|l| ListenerStatus {
                url: l.url.to_string(),
                bound: false,
                crc: cfg.crc,
                direct_write_to_pmem: l.direct_write_to_pmem,
                note: Some("no transport".into()),
            })
            .collect())
    }

    fn reloaded(
        &mut self,
        _: &ConfigDiff,
        _: &Config,
        _: &NamespaceTable,
    ) -> Option<std::sync::Arc<crate::seam::ReloadAck>> {
        None
    }

    fn sessions(&self) -> Vec<SessionStatus> {
        Vec::new()
    }

    fn stop(&mut self) {}
}

struct State {
    config: Config,
    namespaces: NamespaceTable,
    listeners: Vec<ListenerStatus>,
    reloads: u64,
    last_reload: Option<String>,
    /// Reloads started, and finished (failed ones too): what a `reload` request waits for.
    reload_started: u64,
    reload_attempts: u64,
    /// Whether the last reload succeeded ([`last_reload`](Self::last_reload) says what).
    last_reload_ok: bool,
    /// The acknowledgements of reloads that poll loops had not applied when the reload stopped
    /// waiting for them: while they have not, their sessions still reach the namespace files
    /// those reloads removed or replaced ([`State::last_reload_said`]). Kept across later
    /// reloads (one that changes nothing waits for nothing, and must not hide them).
    last_reload_lagging: Vec<Arc<crate::seam::ReloadAck>>,
    serve: Box<dyn Serve>,
    metrics: Option<MetricsServer>,
    metrics_status: Option<MetricsListenerStatus>,
    /// The page-cache namespace files' descriptors kept with the service manager.
    fdstore: FdStore,
}

impl State {
    /// What the last reload did (`last_reload`), with, while poll loops have not applied a
    /// reload yet (this one or an earlier), how many and what that means; and how many.
    fn last_reload_said(&self) -> (Option<String>, usize) {
        let lagging = self
            .last_reload_lagging
            .iter()
            .map(|ack| ack.wait(Duration::ZERO))
            .max()
            .unwrap_or(0);
        let said = self.last_reload.as_ref().map(|s| match lagging {
            0 => s.clone(),
            n => format!(
                "{s}; but {n} poll loop(s) have not applied it yet: until they do, their \
                 sessions still reach the removed or replaced namespace files (do not reuse \
                 those files yet)"
            ),
        });
        (said, lagging)
    }
}

struct Shared {
    config_path: PathBuf,
    started: Instant,
    state: Mutex<State>,
    /// The daemon stops (or failed to start): no reload will run, a `reload` request waiting
    /// for one is answered so.
    stopping: std::sync::atomic::AtomicBool,
}

/// Sets [`Shared::stopping`] when dropped: on every way out of [`run`], before the control
/// server (declared before it) waits for the requests it is answering.
struct Stopping<'a>(&'a std::sync::atomic::AtomicBool);

impl Drop for Stopping<'_> {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic elsewhere must not take the status and reload paths down with it.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// [`lock`](Self::lock), unless another thread holds the state (None).
    fn try_lock(&self) -> Option<MutexGuard<'_, State>> {
        match self.state.try_lock() {
            Ok(g) => Some(g),
            Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }
}

fn transports(cfg: &Config) -> Vec<(Transport, bool)> {
    let mut v: Vec<(Transport, bool)> = Vec::new();
    for l in &cfg.listeners {
        let t = (l.url.transport, l.direct_write_to_pmem);
        if !v.contains(&t) {
            v.push(t);
        }
    }
    v
}

fn transport_name(t: Transport, dwp: bool) -> String {
    match (t, dwp) {
        (Transport::Tcp, _) => "tcp".into(),
        (Transport::Rdma, false) => "rdma".into(),
        (Transport::Rdma, true) => "rdma(direct_write_to_pmem)".into(),
        (Transport::NvmeTcp, _) => "nvme-tcp".into(),
    }
}

fn status(shared: &Shared) -> Status {
    let st = shared.lock();
    let cfg = &st.config;
    let ts = transports(cfg);
    // The sessions before the counts: a session ends by counting its end, then leaving the list,
    // so one missing from the list is in the counts read after it. (Read the other way round,
    // a session that ended in between was in neither: a status with no session and none ended,
    // which tests/tests/metrics.rs's wait for the end then took for the final state.)
    let sessions = st.serve.sessions();
    let metrics = st.serve.metrics();
    let data_of = |sub: &str, nsid: u32| {
        let mut d = DataCounters::default();
        for h in metrics.iter().flat_map(|m| m.hosts.iter()) {
            if h.nsid == nsid && h.subsystem == sub {
                d.add(&h.data);
            }
        }
        d
    };
    Status {
        version: env!("CARGO_PKG_VERSION").into(),
        pid: std::process::id(),
        uptime_s: shared.started.elapsed().as_secs(),
        config: shared.config_path.clone(),
        reloads: st.reloads,
        last_reload: st.last_reload_said().0,
        listeners: {
            let down = st.serve.listeners_down();
            st.listeners
                .iter()
                .map(|l| match down.iter().find(|(url, _)| *url == l.url) {
                    Some((_, why)) => ListenerStatus {
                        bound: false,
                        note: Some(why.clone()),
                        ..l.clone()
                    },
                    None => l.clone(),
                })
                .collect()
        },
        subsystems: cfg
            .subsystems
            .iter()
            .map(|s| SubsystemStatus {
                nqn: s.nqn.to_string(),
                allow_any_host: s.allow_any_host,
                hosts: s
                    .hosts
                    .iter()
                    .map(|h| HostStatus {
                        nqn: h.nqn.to_string(),
                        psk: h.psk.is_some(),
                    })
                    .collect(),
                namespaces: st
                    .namespaces
                    .of_subsystem(&s.nqn)
                    .map(|ns| NamespaceStatus {
                        nsid: ns.config.nsid,
                        path: ns.config.path.clone(),
                        size: ns.size(),
                        block_size: ns.config.block_size,
                        read_only: ns.config.read_only,
                        domain: ns.domain_label(),
                        durability: ts
                            .iter()
                            .map(|&(t, dwp)| TransportMethods {
                                transport: transport_name(t, dwp),
                                methods: ns
                                    .methods(t, dwp)
                                    .names()
                                    .into_iter()
                                    .map(String::from)
                                    .collect(),
                            })
                            .collect(),
                        counters: ns.counters.snapshot(),
                        data: data_of(s.nqn.as_str(), ns.config.nsid),
                        failed: ns.failure().map(|f| f.to_string()),
                        failed_since: ns.remembered().map(|r| r.since()),
                    })
                    .collect(),
            })
            .collect(),
        sessions,
        admission: st.serve.admission(),
        metrics,
        metrics_listener: st.metrics_status.clone().map(|mut m| {
            m.serving = st.metrics.as_ref().map_or(0, MetricsServer::serving);
            m
        }),
    }
}

/// The metrics page of the daemon behind `weak`.
fn metrics_page(weak: std::sync::Weak<Shared>) -> PageFn {
    Arc::new(move || match weak.upgrade() {
        Some(sh) => crate::metrics::exposition::render(
            &status(&sh),
            &crate::metrics::process::Process::current(),
        ),
        None => String::new(),
    })
}

/// Moves the metrics listener to what `want` says: kept if it is already there, else bound
/// anew (the new address first, so that a failure keeps the old one serving; if the two
/// conflict, after the old one is closed).
fn apply_metrics_listen(
    current: &mut Option<MetricsServer>,
    status: &mut Option<MetricsListenerStatus>,
    want: Option<std::net::SocketAddr>,
    page: &PageFn,
) -> std::result::Result<(), ListenerError> {
    // Already serving what is wanted (a failed attempt is retried, even at the same address).
    let configured = status.as_ref().map(|s| s.configured.clone());
    let failed = status.as_ref().is_some_and(|s| s.note.is_some());
    if configured == want.map(|a| a.to_string()) && !failed && (current.is_some() || want.is_none())
    {
        return Ok(());
    }
    let Some(addr) = want else {
        if current.take().is_some() {
            log::info!("metrics listener closed");
        }
        *status = None;
        return Ok(());
    };
    let bound = MetricsServer::bind(addr, Arc::clone(page)).or_else(|e| {
        // In use, by the old listener itself (say 0.0.0.0:9420 -> 127.0.0.1:9420): close it
        // and try again.
        let ours = current
            .as_ref()
            .is_some_and(|c| c.local_addr().port() == addr.port());
        match &e {
            ListenerError::Bind { source, .. }
                if ours && source.kind() == std::io::ErrorKind::AddrInUse =>
            {
                current.take();
                MetricsServer::bind(addr, Arc::clone(page))
            }
            _ => Err(e),
        }
    });
    match bound {
        Ok(server) => {
            log::info!("metrics on http://{}/metrics", server.local_addr());
            *status = Some(MetricsListenerStatus {
                configured: addr.to_string(),
                addr: Some(server.local_addr().to_string()),
                bound: true,
                note: None,
                serving: 0,
            });
            *current = Some(server);
            Ok(())
        }
        Err(e) => {
            let why = rpma_common::error_chain(&e);
            *status = Some(match current {
                // The old address still serves: say so beside the failure.
                Some(old) => MetricsListenerStatus {
                    configured: addr.to_string(),
                    addr: Some(old.local_addr().to_string()),
                    bound: true,
                    note: Some(format!("{why}; still serving on {}", old.local_addr())),
                    serving: 0,
                },
                None => MetricsListenerStatus {
                    configured: addr.to_string(),
                    addr: None,
                    bound: false,
                    note: Some(why),
                    serving: 0,
                },
            });
            Err(e)
        }
    }
}

fn ready_line(st: &State) -> String {
    let bound = st.listeners.iter().filter(|l| l.bound).count();
    format!(
        "{} namespace(s) in {} subsystem(s) mapped; control socket {}; {bound} of {} listener(s) bound",
        st.namespaces.len(),
        st.config.subsystems.len(),
        st.config.control_socket.display(),
        st.listeners.len()
    )
}

/// Runs the daemon until SIGTERM or SIGINT.
///
/// # Errors
/// Any [`DaemonError`] before READY=1. After it, failures (a bad reload) are logged and the
/// daemon keeps serving with the configuration it has.
pub fn run(config_path: &Path, serve: Box<dyn Serve>) -> Result<()> {
    let mut mask = SigSet::empty();
    for s in [Signal::SIGTERM, Signal::SIGHUP, Signal::SIGINT] {
        mask.add(s);
    }
    // Blocked before any thread starts, so every thread inherits the mask and only the signalfd
    // sees these signals.
    mask.thread_block().map_err(DaemonError::Signals)?;
    let sfd = SignalFd::with_flags(&mask, SfdFlags::SFD_CLOEXEC | SfdFlags::SFD_NONBLOCK)
        .map_err(DaemonError::Signals)?;
    let notifier = Notifier::from_env()?;
    // Taken before any thread starts (it removes $LISTEN_FDS and the rest).
    let mut fdstore = FdStore::from_env();

    // Absolute, so that status and reloads name the same file whatever the working directory.
    let config_path =
        &std::fs::canonicalize(config_path).unwrap_or_else(|_| config_path.to_owned());
    let config = Config::load(config_path)?;
    let ledger = Arc::new(FailureLedger::open(&config.state_file)?);
    let remembered = ledger.all();
    log::info!(
        "state file {}: {} failed namespace(s) remembered",
        config.state_file.display(),
        remembered.len()
    );
    warn_if_state_shares_a_filesystem(&config);
    if let Some(w) = crate::failures::capacity::capacity_warning(&config) {
        log::warn!("{w}");
    }
    let namespaces = NamespaceTable::open_all_remembering(&config, Some(Arc::clone(&ledger)))?;
    log::info!("{} namespace(s) mapped", namespaces.len());
    // Before anything is served: a write-back failure the last run's sync took the report of
    // as it died fails its namespace now (crate::fdstore).
    let kept = fdstore.len();
    let failed = fdstore.check(&namespaces, &ledger, &notifier);
    if kept > 0 {
        log::info!(
            "{kept} namespace file descriptor(s) kept from the last run checked: {failed} \
             namespace(s) failed by a write-back error it did not record"
        );
    }
    let socket = config.control_socket.clone();
    let shared = Arc::new(Shared {
        config_path: config_path.to_owned(),
        stopping: std::sync::atomic::AtomicBool::new(false),
        started: Instant::now(),
        state: Mutex::new(State {
            config,
            namespaces,
            listeners: Vec::new(),
            reloads: 0,
            last_reload: None,
            reload_started: 0,
            reload_attempts: 0,
            last_reload_ok: false,
            last_reload_lagging: Vec::new(),
            serve,
            metrics: None,
            metrics_status: None,
            fdstore,
        }),
    });
    let weak = Arc::downgrade(&shared);
    let me = nix::unistd::geteuid().as_raw();
    let handler: control::Handler = Arc::new(move |req, peer| {
        let verb = req.split_whitespace().next().unwrap_or("");
        match (verb, weak.upgrade()) {
            ("status", Some(sh)) => serde_json::to_string(&status(&sh)).map_err(|e| e.to_string()),
            // Status is the group's; a change is root's or the daemon's user's.
            ("clear-failure", Some(sh)) => peer
                .may_change_state(verb, me)
                .and_then(|()| sh.clear_failure(req)),
            ("reload", Some(sh)) => peer
                .may_change_state(verb, me)
                .and_then(|()| sh.reload_request()),
            ("status" | "clear-failure" | "reload", None) => Err("the daemon is stopping".into()),
            (other, _) => Err(format!(
                "unknown request {other:?} (try \"status\", \"reload\" or \"clear-failure \
                 SUBSYSTEM NSID\")"
            )),
        }
    });
    let control = ControlServer::bind(&socket, handler)?;
    let _stopping = Stopping(&shared.stopping);
    log::info!("control socket {}", control.path().display());
    let page = metrics_page(Arc::downgrade(&shared));
    {
        let mut st = shared.lock();
        let want = st.config.metrics_listen;
        let State {
            metrics,
            metrics_status,
            ..
        } = &mut *st;
        apply_metrics_listen(metrics, metrics_status, want, &page)?;
        let State {
            config,
            namespaces,
            serve,
            ..
        } = &mut *st;
        let listeners = serve.bind(config, namespaces)?;
        st.listeners = listeners;
        let line = ready_line(&st);
        log::info!("ready: {line}");
        notifier.ready(&line)?;
    }

    // The serving threads are all started: their heartbeats, read with no lock held.
    let beats = shared.lock().serve.heartbeats();
    let mut pinger = watchdog::Pinger::start(&notifier, beats)?;
    loop {
        let left = pinger.left().unwrap_or(UNREADABLE_CHECK);
        let timeout = PollTimeout::try_from(left.min(UNREADABLE_CHECK)).unwrap_or(PollTimeout::MAX);
        let mut fds = [PollFd::new(sfd.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, timeout) {
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(DaemonError::Signals(e)),
        }
        // A page a Read met that the kernel could not give back (or a file found cut short)
        // fails its namespace: recorded and logged here, so that a restart remembers it even
        // if no host asks for durability on it again, and its sessions closed (the tcp
        // transport already serves nothing more of it; a NIC would reach its memory). Not
        // while a clear-failure holds the state: the next turn looks (waiting for the lock, the
        // watchdog's pings waited too).
        if let Some(mut st) = shared.try_lock() {
            note_unreadable(&mut st);
        }
        pinger.tick();
        while let Ok(Some(info)) = sfd.read_signal() {
            match Signal::try_from(info.ssi_signo as i32) {
                // The pings go on while the reload holds this thread.
                Ok(Signal::SIGHUP) => pinger.during(|| shared.reload_now(&notifier, &page)),
                Ok(sig @ (Signal::SIGTERM | Signal::SIGINT)) => {
                    log::info!("{sig}: stopping");
                    let _ = notifier.stopping();
                    shared
                        .stopping
                        .store(true, std::sync::atomic::Ordering::SeqCst);
                    shared.lock().serve.stop();
                    drop(control);
                    let metrics = shared.lock().metrics.take();
                    drop(metrics);
                    return Ok(());
                }
                _ => {}
            }
        }
    }
}

/// Fails the namespaces with a page that could not be read or written since the last look, and
/// closes their sessions.
fn note_unreadable(st: &mut State) {
    let unreadable = st.namespaces.note_unreadable();
    if unreadable.is_empty() {
        return;
    }
    let State {
        config,
        namespaces,
        serve,
        ..
    } = st;
    let diff = ConfigDiff {
        namespaces_unreadable: unreadable,
        ..ConfigDiff::default()
    };
    // (Nothing removed or replaced: nothing to wait for.)
    let _ = serve.reloaded(&diff, config, namespaces);
}

/// How often the daemon looks for namespaces with a page that could not be read or written
/// ([`NamespaceTable::note_unreadable`]).
const UNREADABLE_CHECK: Duration = Duration::from_secs(1);

/// Warns when the state file lies on the filesystem of a page-cache namespace: a full
/// filesystem there (the usual cause of a failed write-back) could keep the failure from being
/// remembered. The file's blocks are allocated up front, which covers a full filesystem but
/// not a failing device.
fn warn_if_state_shares_a_filesystem(cfg: &Config) {
    use std::os::unix::fs::MetadataExt;
    let Some(dev) = std::fs::metadata(&cfg.state_file).ok().map(|m| m.dev()) else {
        return;
    };
    for s in &cfg.subsystems {
        for ns in &s.namespaces {
            let same = std::fs::metadata(&ns.path).is_ok_and(|m| m.is_file() && m.dev() == dev);
            if same && !ns.force_dax {
                log::warn!(
                    "state file {} is on the same filesystem as subsystem {} namespace {} ({}): \
                     put it on another one (`state_file`) so that a failing device there cannot \
                     keep a failure from being remembered",
                    cfg.state_file.display(),
                    s.nqn,
                    ns.nsid,
                    ns.path.display()
                );
                return;
            }
        }
    }
}

/// Test hook (never set in production): how long, in milliseconds, a reload waits for the
/// poll loops to apply it (`reloading::reload_apply_wait`): a test that holds a loop up gives
/// it more time than the hold, whatever the machine's load.
pub const TEST_RELOAD_APPLY_WAIT_ENV: &str = "RPMA_TARGET_TEST_RELOAD_APPLY_WAIT_MS";

/// Test hook (never set in production): a reload and a clear-failure hold the daemon's state
/// this many milliseconds longer, as one that maps a big namespace ahead of use does, so that a
/// test can see the watchdog's pings go on meanwhile.
pub const TEST_HOLD_STATE_ENV: &str = "RPMA_TARGET_TEST_HOLD_STATE_MS";
