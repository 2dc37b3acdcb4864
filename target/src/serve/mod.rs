//! The fabric-backed [`Serve`]: listeners, poll loops and sessions.
//!
//! # Shape
//!
//! ```text
//!  accept thread (one per listener)      poll loop 0 .. poll_loops-1 (threads)
//!  Listener::accept -> ConnRequest ----> accepts into a QP on its own CQ, owns the connection:
//!                                        handshake -> session | discovery -> closing -> dropped
//! ```
//!
//! - An accept thread reads each new connection's MPA Request and hands the request to the poll
//!   loop with the fewest connections; the loop creates the queue pair on its completion queue,
//!   posts the receive slots and accepts, so a connection is owned by one loop from its first
//!   byte to its last.
//! - A poll loop waits on its completion queue (busy-polling while traffic flows,
//!   then blocking in epoll), runs each connection's control exchange and the GPSPM
//!   flush service of its own [`Flusher`](crate::flusher::Flusher) (io_uring: a slow disk never
//!   stalls the loop).
//! - Each connection has a protection domain of its own. Its namespaces are registered in that
//!   domain at admission (one memory region per namespace, rights scoped: no remote write on a
//!   read-only namespace), so its rkeys are its own, reachable from no other connection, and
//!   revoked by deregistering them at disconnect, keep-alive expiry, reload or shutdown. Nothing
//!   is registered with a remote right before the host is admitted. docs/architecture.md says
//!   why this is not one region per namespace plus memory windows.
//!
//! Counted per session: control messages received, GPSPM flushes. Not counted: RDMA Writes and
//! Reads, which the transport's placement engine serves without any target code.

mod acceptor;
mod conn;
mod poll_loop;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rpma_common::fabric::{self, ConnRequest, Context, Url};

use crate::config::{Config, Transport};
use crate::control::{ListenerStatus, SessionStatus, SESSION_COUNTED};
use crate::daemon::{Serve, ServeError};
use crate::eventfd::EventFd;
use crate::namespace::{NamespaceTable, NsKey, OpenNamespace};
use crate::reload::ConfigDiff;

/// Errors of the serving machinery outside [`Serve::bind`] (which reports [`ServeError`]).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A listen URL the fabric cannot parse.
    #[error("listen URL {url}")]
    Url {
        /// The URL.
        url: String,
        /// What the fabric reported.
        #[source]
        source: fabric::Error,
    },
    /// A transport this build does not serve yet.
    #[error("{url}: the rdma transport is not served yet (a later issue); use tcp://")]
    RdmaNotServed {
        /// The URL.
        url: String,
    },
    /// Binding a listener failed.
    #[error("cannot listen on {url}")]
    Listen {
        /// The URL.
        url: String,
        /// What the fabric reported.
        #[source]
        source: fabric::Error,
    },
    /// A thread could not be started.
    #[error("cannot start thread {name}")]
    Thread {
        /// The thread's name.
        name: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A poll loop's completion queue or flusher could not be created.
    #[error("cannot set up poll loop {index}")]
    LoopSetup {
        /// The loop's index.
        index: usize,
        /// What failed.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

/// Result of the serving machinery.
pub type Result<T> = std::result::Result<T, Error>;

/// How long a new connection may take from its MPA Request to its MPA Reply, and from then to
/// the end of its control exchange.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a connection lingers after the target sent its last message (a Refusal, or a
/// Disconnect after keep-alive expiry, reload or shutdown) so that the host reads it. Its rkeys
/// are revoked before that message is sent: a Write meanwhile is refused with RemoteAccess.
pub const LINGER: Duration = Duration::from_secs(2);

/// Shortest keep-alive period a host may ask for.
pub const MIN_KEEP_ALIVE: Duration = Duration::from_millis(100);

/// A connection's live counters and identity, shared between its poll loop and `status`.
#[derive(Debug)]
pub(crate) struct SessionInfo {
    /// "io" or "discovery".
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
}

impl SessionInfo {
    fn status(&self) -> SessionStatus {
        let age = self.started.elapsed().as_millis() as u64;
        let since = age.saturating_sub(self.last_seen_ms.load(Ordering::Relaxed));
        let ka = u64::from(self.keep_alive_ms);
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
        }
    }
}

/// What every thread of the serving machinery shares.
pub(crate) struct Shared {
    pub(crate) ctx: Context,
    config: RwLock<Arc<Config>>,
    namespaces: RwLock<Arc<BTreeMap<NsKey, Arc<OpenNamespace>>>>,
    pub(crate) stopping: AtomicBool,
    /// Connections open, all loops together (for `max_connections`).
    pub(crate) connections: AtomicUsize,
    next_controller: AtomicU32,
    sessions: Mutex<BTreeMap<u16, Arc<SessionInfo>>>,
    /// Discovery connections (controller id 0 on the wire), by a serial of their own.
    discovery: Mutex<BTreeMap<u64, Arc<SessionInfo>>>,
    next_discovery: AtomicU64,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("connections", &self.connections.load(Ordering::Relaxed))
            .field("stopping", &self.stopping.load(Ordering::Relaxed))
            .finish()
    }
}

impl Shared {
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
    }

    /// A controller id not in use (1..=0xFFFE), or None if every one is.
    pub(crate) fn register_session(
        &self,
        make: impl FnOnce(u16) -> SessionInfo,
    ) -> Option<Arc<SessionInfo>> {
        let mut s = self.sessions.lock().unwrap_or_else(|p| p.into_inner());
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

    pub(crate) fn unregister_session(&self, controller_id: u16) {
        self.sessions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&controller_id);
    }
}

/// The way to a poll loop: its command channel, and the eventfd that wakes its idle wait.
#[derive(Clone)]
pub(crate) struct LoopTx {
    tx: mpsc::Sender<LoopCmd>,
    wake: Arc<EventFd>,
}

impl LoopTx {
    /// Queues `cmd` and wakes the loop; gives `cmd` back if the loop is gone.
    pub(crate) fn send(&self, cmd: LoopCmd) -> std::result::Result<(), LoopCmd> {
        self.tx.send(cmd).map_err(|e| e.0)?;
        self.wake.signal();
        Ok(())
    }
}

/// A command to a poll loop.
pub(crate) enum LoopCmd {
    /// A new connection to accept and own.
    Accept(ConnRequest),
    /// The configuration was reloaded with this diff (shared config already updated).
    Reload(Arc<ConfigDiff>),
    /// Finish in-flight flushes, say goodbye to every session, exit.
    Stop,
}

struct LoopHandle {
    tx: LoopTx,
    load: Arc<AtomicUsize>,
    thread: Option<JoinHandle<()>>,
}

/// The fabric-backed [`Serve`]: see the module docs.
pub struct FabricServe {
    ctx: Context,
    shared: Option<Arc<Shared>>,
    loops: Vec<LoopHandle>,
    acceptors: Vec<acceptor::Acceptor>,
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

/// The `rdma://` refusal, shared by bind and check paths.
fn fabric_url(l: &crate::config::Listener) -> Result<Url> {
    let url = l.url.to_string();
    if l.url.transport == Transport::Rdma {
        return Err(Error::RdmaNotServed { url });
    }
    Url::parse(&url).map_err(|source| Error::Url { url, source })
}

impl FabricServe {
    /// A server on the soft (`tcp`) device; nothing runs until [`Serve::bind`].
    pub fn new() -> FabricServe {
        FabricServe {
            ctx: Context::soft(),
            shared: None,
            loops: Vec::new(),
            acceptors: Vec::new(),
        }
    }

    fn start(&mut self, cfg: &Config, namespaces: &NamespaceTable) -> Result<Vec<ListenerStatus>> {
        // Refuse what cannot be served before anything starts.
        let urls: Vec<Url> = cfg
            .listeners
            .iter()
            .map(fabric_url)
            .collect::<Result<_>>()?;
        let shared = Arc::new(Shared {
            ctx: self.ctx.clone(),
            config: RwLock::new(Arc::new(cfg.clone())),
            namespaces: RwLock::new(Arc::new(BTreeMap::new())),
            stopping: AtomicBool::new(false),
            connections: AtomicUsize::new(0),
            next_controller: AtomicU32::new(0),
            sessions: Mutex::new(BTreeMap::new()),
            discovery: Mutex::new(BTreeMap::new()),
            next_discovery: AtomicU64::new(0),
        });
        shared.set(cfg, namespaces);
        self.shared = Some(Arc::clone(&shared));
        for index in 0..cfg.poll_loops.max(1) as usize {
            let (tx, rx) = mpsc::channel();
            let wake = EventFd::new().map(Arc::new).map_err(|e| Error::LoopSetup {
                index,
                source: Box::new(e),
            })?;
            let load = Arc::new(AtomicUsize::new(0));
            let tx = LoopTx {
                tx,
                wake: Arc::clone(&wake),
            };
            let lp =
                poll_loop::PollLoop::new(index, Arc::clone(&shared), rx, wake, Arc::clone(&load))
                    .map_err(|source| Error::LoopSetup { index, source })?;
            let name = format!("rpma-loop-{index}");
            let thread = std::thread::Builder::new()
                .name(name.clone())
                .spawn(move || lp.run())
                .map_err(|source| Error::Thread { name, source })?;
            self.loops.push(LoopHandle {
                tx,
                load,
                thread: Some(thread),
            });
        }
        let targets: Vec<(LoopTx, Arc<AtomicUsize>)> = self
            .loops
            .iter()
            .map(|l| (l.tx.clone(), Arc::clone(&l.load)))
            .collect();
        let mut out = Vec::new();
        for (l, url) in cfg.listeners.iter().zip(urls) {
            let a = acceptor::Acceptor::start(&shared, &url, cfg.crc, targets.clone())?;
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
    fn bind(
        &mut self,
        cfg: &Config,
        namespaces: &NamespaceTable,
    ) -> std::result::Result<Vec<ListenerStatus>, ServeError> {
        self.start(cfg, namespaces).map_err(|e| {
            let url = match &e {
                Error::Url { url, .. }
                | Error::RdmaNotServed { url }
                | Error::Listen { url, .. } => url.clone(),
                _ => cfg
                    .listeners
                    .first()
                    .map(|l| l.url.to_string())
                    .unwrap_or_default(),
            };
            self.stop();
            ServeError::Bind {
                url,
                source: Box::new(e),
            }
        })
    }

    fn reloaded(&mut self, diff: &ConfigDiff, cfg: &Config, namespaces: &NamespaceTable) {
        let Some(shared) = &self.shared else { return };
        shared.set(cfg, namespaces);
        let diff = Arc::new(diff.clone());
        for l in &self.loops {
            let _ = l.tx.send(LoopCmd::Reload(Arc::clone(&diff)));
        }
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

    fn stop(&mut self) {
        if let Some(shared) = &self.shared {
            shared.stopping.store(true, Ordering::SeqCst);
        }
        for a in self.acceptors.drain(..) {
            a.stop();
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
        if !self.loops.is_empty() || !self.acceptors.is_empty() {
            self.stop();
        }
    }
}
