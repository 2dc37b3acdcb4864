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
//!   flush service of its own [`Flusher`](crate::flusher::Flusher) (io_uring: a slow disk
//!   stalls no busy connection for a GPSPM flush; a loop with no other flush syncs a
//!   page-cache range itself when it has one connection, or a range of up to 256 KiB beside
//!   at most four others none of which was heard from within 1 ms, unless a sync took over
//!   10 ms lately: such a host waits for one sync at most; poll_loop.rs). Polling also drives
//!   the transport's placement engine, which serves the hosts' Writes, Reads and Flushes inline:
//!   on a page-cache namespace an RDMA Flush, or the Read/Atomic that ends an APM sequence,
//!   waits for msync of the dirty range in this thread, and stalls the loop's other
//!   connections meanwhile (docs/architecture.md, "Durability and the poll loop").
//! - Every accept thread and poll loop bumps a heartbeat each turn ([`Serve::heartbeats`]); the
//!   daemon's watchdog check wakes them all and pings systemd only while every one has moved
//!   since the previous check.
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
pub(crate) mod peer_log;
mod poll_loop;
mod registrar;
mod session;
pub(crate) mod session_info;
pub(crate) mod shared;

pub use crate::seam::{Error, Result};
pub use acceptor::{MAX_PENDING, MPA_TIMEOUT};
pub(crate) use peer_log::Class as LogClass;
pub use session::{TEST_DEREGISTER_HOLD_ENV, TEST_REGISTER_HOLD_ENV};
pub(crate) use session_info::{SessionCounts, SessionInfo};
pub(crate) use shared::{Heartbeat, LoopCmd, LoopTx, Shared};
pub use shared::{LINGER, MIN_KEEP_ALIVE};

/// The message slots `cfg`'s connections register (pinned on `rdma://`), for the memlock
/// check: a session's (a receive slot per request of `max_queue_depth` and a few more, and its
/// send slots), and the full unadmitted and discovery pools' (each the control exchange's).
pub(crate) fn slots(cfg: &Config) -> crate::memlock::Slots {
    let slot = rpma_common::proto::MAX_MESSAGE_SIZE as u64;
    let session = cfg.max_queue_depth as usize + conn::RECV_SLACK + conn::SEND_SLOTS;
    let handshake = conn::CONTROL_RECV_SLOTS + conn::CONTROL_SEND_SLOTS;
    let a = &cfg.admission;
    crate::memlock::Slots {
        session: session as u64 * slot,
        pools: u64::from(a.max_unadmitted + a.max_discovery) * handshake as u64 * slot,
    }
}

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;

use rpma_common::fabric::{Context, Url};

use crate::config::{Config, Transport};
use crate::control::{AdmissionStatus, ListenerStatus, PoolStatus, SessionStatus};
use crate::eventfd::EventFd;
use crate::metrics::{LoopStats, MetricsStatus};
use crate::namespace::NamespaceTable;
use crate::reload::ConfigDiff;
use crate::seam::{ReloadAck, Serve};

struct LoopHandle {
    tx: LoopTx,
    load: Arc<AtomicUsize>,
    beat: Heartbeat,
    thread: Option<JoinHandle<()>>,
}

/// The fabric-backed [`Serve`]: see the module docs.
pub struct FabricServe {
    shared: Option<Arc<Shared>>,
    loops: Vec<LoopHandle>,
    acceptors: Vec<acceptor::Acceptor>,
    /// The `nvme-tcp://` listeners, when there are any.
    nvme: Option<crate::nvme_tcp::Server>,
}

impl std::fmt::Debug for FabricServe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FabricServe")
            .field("loops", &self.loops.len())
            .field("listeners", &self.acceptors.len())
            .field("shared", &self.shared)
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
pub(crate) fn one_transport(cfg: &Config) -> Result<()> {
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
            shared: None,
            loops: Vec::new(),
            acceptors: Vec::new(),
            nvme: None,
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
        let nvme_loops = cfg.nvme_loops();
        let nvme_loop_stats: Vec<Arc<LoopStats>> = (0..nvme_loops)
            .map(|_| Arc::new(LoopStats::default()))
            .collect();
        one_transport(cfg)?;
        // The device is the listeners' transport's (they share one: a config has one
        // transport). On rdma it is the device of the first listener's address; without one
        // this fails with "no RDMA device found; use tcp://".
        // (Kept by the shared state only: a device that is lost and back replaces it there.)
        let ctx = match urls.first() {
            Some(url) => Context::for_url(url).map_err(|source| Error::Listen {
                url: url.to_string(),
                source,
            })?,
            None => Context::soft(),
        };
        match crate::memlock::check(cfg, namespaces, slots(cfg)) {
            crate::memlock::Verdict::TooLow(message) => return Err(Error::Memlock { message }),
            crate::memlock::Verdict::Short(message) => log::warn!("{message}"),
            crate::memlock::Verdict::Fine => {}
        }
        let loop_stats: Vec<Arc<LoopStats>> = (0..cfg.native_loops())
            .map(|_| Arc::new(LoopStats::default()))
            .collect();
        let shared = Arc::new(Shared::new(
            ctx,
            cfg,
            loop_stats.clone(),
            nvme_loop_stats.clone(),
        ));
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
            let a = acceptor::Acceptor::start(&shared, &url, l.url.to_string(), targets.clone())?;
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

    fn reloaded(
        &mut self,
        diff: &ConfigDiff,
        cfg: &Config,
        namespaces: &NamespaceTable,
    ) -> Option<Arc<ReloadAck>> {
        let shared = self.shared.as_ref()?;
        shared.set(cfg, namespaces);
        shared.forget_removed(namespaces, cfg);
        // A reload that removes or replaces namespaces is done only once every loop has
        // applied it: until then a loop's sessions still reach the old file (on rdma the NIC
        // does, until the loop deregisters their regions; an NVMe/TCP transfer lands its data
        // PDU by PDU). The daemon waits for it, with no lock held, before it says READY.
        let touches_files =
            !diff.namespaces_removed.is_empty() || !diff.namespaces_changed.is_empty();
        let nvme_loops = self.nvme.as_ref().map_or(0, |n| n.loop_count());
        let ack = touches_files.then(|| ReloadAck::new(self.loops.len() + nvme_loops));
        if let Some(nvme) = &self.nvme {
            nvme.reloaded(diff, ack.as_ref());
        }
        let diff = Arc::new(diff.clone());
        for l in &self.loops {
            // (A loop that is gone serves nothing: its token drops with the refused command.)
            let _ = l.tx.send(LoopCmd::Reload(
                Arc::clone(&diff),
                ack.as_ref().map(ReloadAck::token),
            ));
        }
        ack
    }

    fn listeners_down(&self) -> Vec<(String, String)> {
        self.acceptors.iter().filter_map(|a| a.down()).collect()
    }

    fn heartbeats(&self) -> Vec<Heartbeat> {
        self.loops
            .iter()
            .map(|l| &l.beat)
            .chain(self.acceptors.iter().map(|a| a.heartbeat()))
            .chain(self.nvme.iter().flat_map(|n| n.heartbeats()))
            .cloned()
            .collect()
    }

    fn sessions(&self) -> Vec<SessionStatus> {
        let Some(shared) = &self.shared else {
            return Vec::new();
        };
        shared.statuses()
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
        let sessions = shared.session_count();
        let unlisted = shared.budgets.usage(budget::Pool::Unlisted);
        Some(AdmissionStatus {
            unadmitted: pool(budget::Pool::Unadmitted),
            discovery: pool(budget::Pool::Discovery),
            sessions: PoolStatus {
                held: sessions,
                limit: cfg.max_connections,
                per_source_limit: 0,
                sources: 0,
                // Taken back for hosts of a higher standing, from either pool of sessions.
                evicted: shared.budgets.usage(budget::Pool::Unproven).evicted + unlisted.evicted,
            },
            // Bounded by max_connections with every session, no cap per source of its own:
            // shown as the sessions are, with the addresses that hold its places.
            unlisted: PoolStatus {
                held: unlisted.held,
                limit: cfg.max_connections,
                per_source_limit: 0,
                sources: unlisted.sources,
                evicted: unlisted.evicted,
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The memlock check counts the slots connections register: at the default depth (128) a
    /// session's 132 receive and 16 send slots of 8 KiB, more than the 1 MiB it once counted;
    /// the full pools' handshake slots besides.
    #[test]
    fn the_slots_counted_are_the_slots_registered() {
        let cfg = Config::from_toml(
            "listen = [\"tcp://127.0.0.1:1\"]",
            std::path::Path::new("/"),
        )
        .unwrap();
        let slot = rpma_common::proto::MAX_MESSAGE_SIZE as u64;
        assert_eq!(cfg.max_queue_depth, 128);
        let s = slots(&cfg);
        assert_eq!(s.session, (128 + 4 + 16) * slot);
        assert!(s.session > 1 << 20);
        assert_eq!(s.pools, (64 + 16) * (4 + 2) * slot);
    }
}
