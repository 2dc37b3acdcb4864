//! What the client threads of an export share: the [`ExportOptions`], the queue (taken for one
//! batch at a time, replaced after a loss), whether a write awaits the next FLUSH, and the
//! counters.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use log::{error, info, warn};
use rpma_common::proto::NamespaceDescriptor;

use super::handshake::ExportInfo;
use super::ratelog::RateLog;
use crate::{Connection, Durability, Error, Namespace, Queue};

/// What to export and how.
#[derive(Debug, Clone)]
pub struct ExportOptions {
    /// The export name clients ask for (the empty name selects it too).
    pub name: String,
    /// The namespace.
    pub nsid: u32,
    /// On a volatile namespace, answer FLUSH and FUA writes with success although the bytes
    /// are only visible (else they fail with EIO: nothing can make them durable).
    pub visible_ok: bool,
    /// Requests of one client issued together (at most the queue depth helps).
    pub max_batch: usize,
    /// How many clients, for how long, and how much they may make the export log.
    pub limits: ClientLimits,
}

/// The export's limits on its clients (docs/mount.md, "Limits"): what a client that holds a
/// connection without using it, or that fails in a loop, can cost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientLimits {
    /// Connections served at once. A newcomer past it evicts a client that is still in its
    /// handshake or idle (none: it is refused).
    pub max_clients: usize,
    /// Connections from one source at once (a TCP client's address, a Unix-socket client's
    /// user id). A newcomer past it evicts one of its own source's.
    pub max_per_source: usize,
    /// A client's whole handshake must be over within this.
    pub handshake_timeout: Duration,
    /// A client that sends no request for this long is closed; `None`: never.
    pub idle_timeout: Option<Duration>,
    /// The period of the log limits: per period, a few lines about one source and a few
    /// dozen in all, then one line counting what was held back.
    pub log_period: Duration,
}

impl Default for ClientLimits {
    fn default() -> Self {
        ClientLimits {
            max_clients: 64,
            max_per_source: 16,
            handshake_timeout: Duration::from_secs(10),
            idle_timeout: Some(Duration::from_secs(600)),
            log_period: Duration::from_secs(60),
        }
    }
}

/// Lines about one source per log period, for problems and for sessions each.
const LINES_PER_SOURCE: u32 = 5;
/// Lines about all sources per log period, for problems and for sessions each.
const LINES_IN_ALL: u32 = 50;

/// What the client threads share: the queue (taken for one batch at a time) and the export.
#[derive(Debug)]
pub(crate) struct Shared {
    conn: Connection,
    queue: Mutex<Option<Queue>>,
    pub(crate) opts: ExportOptions,
    pub(crate) desc: NamespaceDescriptor,
    pub(crate) info: ExportInfo,
    pub(crate) stopping: AtomicBool,
    /// Requests answered, over all clients.
    pub(crate) requests: AtomicU64,
    /// Writes were acknowledged and not yet made durable by a FLUSH (which persists the
    /// queue's own held writes, not a range: the queue knows them).
    dirty: AtomicBool,
    /// Queues given up (reconnect budget spent): each may have taken acknowledged writes that
    /// were not durable yet with it. Every connection's next FLUSH answers EIO once per loss.
    pub(crate) losses: AtomicU64,
    /// Client-caused WARN and ERROR lines (failed handshakes, evictions, refusals, failed
    /// requests), rate-limited.
    pub(crate) problems: RateLog,
    /// Client-caused INFO lines (a client came, left, was idle too long), rate-limited.
    pub(crate) sessions: RateLog,
}

impl Shared {
    /// The state of an export of `desc` over `queue` (opened from `conn`, which opens the
    /// next one after a loss).
    pub(super) fn new(
        conn: Connection,
        queue: Queue,
        opts: ExportOptions,
        desc: NamespaceDescriptor,
        info: ExportInfo,
    ) -> Shared {
        let period = opts.limits.log_period;
        Shared {
            problems: RateLog::new("warning(s)", LINES_PER_SOURCE, LINES_IN_ALL, period),
            sessions: RateLog::new("session line(s)", LINES_PER_SOURCE, LINES_IN_ALL, period),
            conn,
            queue: Mutex::new(Some(queue)),
            opts,
            desc,
            info,
            stopping: AtomicBool::new(false),
            requests: AtomicU64::new(0),
            dirty: AtomicBool::new(false),
            losses: AtomicU64::new(0),
        }
    }

    /// The queue (None after a loss, until the next request opens a new one).
    pub(super) fn lock(&self) -> MutexGuard<'_, Option<Queue>> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `f` on the namespace. A queue that gave up (its reconnect budget spent) is
    /// replaced by a new one on the next call.
    pub(crate) fn with_ns<T>(
        &self,
        f: impl FnOnce(&mut Namespace<'_>) -> crate::Result<T>,
    ) -> crate::Result<T> {
        let mut g = self.lock();
        if g.is_none() {
            let q = self.conn.open_queue(0)?;
            info!("nbd: reconnected to the target with a new queue");
            *g = Some(q);
        }
        let Some(q) = g.as_mut() else {
            return Err(Error::Broken);
        };
        let r = q.namespace(self.opts.nsid).and_then(|mut ns| f(&mut ns));
        if let Err(e @ (Error::Broken | Error::ReconnectFailed { .. })) = &r {
            self.lost(&mut g, e);
        }
        r
    }

    /// Drops a queue that gave up; the next request opens a new one.
    fn lost(&self, g: &mut Option<Queue>, e: &Error) {
        error!(
            "nbd: the queue to the target failed ({}); writes acknowledged but not yet durable \
             may be lost: the next FLUSH of every connection answers EIO",
            rpma_common::error_chain(e)
        );
        self.losses.fetch_add(1, Ordering::SeqCst);
        *g = None;
    }

    /// The most data requests the queue ever had in flight at once.
    pub(crate) fn max_in_flight(&self) -> usize {
        self.lock().as_ref().map_or(0, |q| q.stats().max_in_flight)
    }

    /// Records that writes were acknowledged, for the next FLUSH.
    pub(crate) fn mark_dirty(&self) {
        self.dirty.store(true, Ordering::SeqCst);
    }

    /// Makes every write acknowledged so far durable (FLUSH): the Writes of every connection
    /// went through this queue, so `persist_own_writes` covers them all (one APM Read on dax,
    /// a Flush per written range, or GPSPM). Ok(false) when the namespace is volatile (visible
    /// only): unless visible_ok, those writes stay pending, so that no later FLUSH claims them.
    pub(crate) fn flush_all(&self) -> crate::Result<bool> {
        if !self.dirty.swap(false, Ordering::SeqCst) {
            return Ok(true);
        }
        // Every write acknowledged on any connection went through this queue: its own pending
        // writes are exactly the ones not made durable yet (a FUA write already is).
        let r = self
            .with_ns(|ns| ns.persist_own_writes())
            .map(|d| matches!(d, Durability::Durable(_)));
        match r {
            Ok(true) => {}
            Ok(false) if self.opts.visible_ok => {}
            _ => self.mark_dirty(),
        }
        r
    }

    /// Runs the queue's keep-alive, unless a batch holds the queue (it keeps it alive itself).
    pub(super) fn tick(&self) {
        // A batch in progress keeps the queue alive itself: never wait for it here.
        let Ok(mut g) = self.queue.try_lock() else {
            return;
        };
        if let Some(q) = g.as_mut() {
            if let Err(e) = q.tick() {
                if matches!(e, Error::Broken | Error::ReconnectFailed { .. }) {
                    self.lost(&mut g, &e);
                } else {
                    warn!("nbd: keep-alive with the target failed: {e}");
                }
            }
        }
    }
}
