//! The export: its queue (shared by every client connection), the accept loop, keep-alives
//! and shutdown.

use std::net::Shutdown;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use log::{debug, error, info, warn};
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use rpma_common::proto::{NamespaceDescriptor, PersistenceDomain};

use super::handshake::{self, ExportInfo, Outcome};
use super::proto::{
    BlockSizes, TF_CAN_MULTI_CONN, TF_HAS_FLAGS, TF_READ_ONLY, TF_SEND_FLUSH, TF_SEND_FUA,
    TF_SEND_WRITE_ZEROES,
};
use super::stream::{Listener, Stream};
use super::transmission::Client;
use super::{NbdError, Result, MAX_CLIENTS, MAX_PAYLOAD};
use crate::{Connection, Durability, Error, Namespace, Queue};

/// How long a client may take over its whole handshake.
const HANDSHAKE_WITHIN: Duration = Duration::from_secs(30);
/// How long a reply may wait for a client that does not read.
const WRITE_TIMEOUT: Duration = Duration::from_secs(30);
/// How often an idle queue is ticked (keep-alive: well under half the target's period).
const TICK: Duration = Duration::from_millis(500);
/// How long shutdown waits for the client threads.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(30);

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
}

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
    /// The span of the writes acknowledged and not yet made durable by a FLUSH: what the
    /// next FLUSH persists (a FLUSH of the whole namespace would write back all of it: on a
    /// dax namespace of 256 MiB that is 12 ms, against 0.3 ms for one 4 KiB write).
    dirty: Mutex<Option<(u64, u64)>>,
    /// Queues given up (reconnect budget spent): each may have taken acknowledged writes that
    /// were not durable yet with it. Every connection's next FLUSH answers EIO once per loss.
    pub(crate) losses: AtomicU64,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Option<Queue>> {
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
            "nbd: the queue to the target failed ({}); writes acknowledged but not yet durable              may be lost: the next FLUSH of every connection answers EIO",
            rpma_common::error_chain(e)
        );
        self.losses.fetch_add(1, Ordering::SeqCst);
        *g = None;
    }

    /// The most data requests the queue ever had in flight at once.
    pub(crate) fn max_in_flight(&self) -> usize {
        self.lock().as_ref().map_or(0, |q| q.stats().max_in_flight)
    }

    /// Records acknowledged writes in `[lo, hi)` for the next FLUSH.
    pub(crate) fn mark_dirty(&self, lo: u64, hi: u64) {
        let mut d = self.dirty.lock().unwrap_or_else(|p| p.into_inner());
        *d = Some(match *d {
            Some((a, b)) => (a.min(lo), b.max(hi)),
            None => (lo, hi),
        });
    }

    /// Makes every write acknowledged so far durable (FLUSH; FUA uses its own range): the
    /// Writes of every connection went through this queue, so `persist_written` of their span
    /// covers them all, APM included. Ok(false) when the namespace is volatile (visible
    /// only): unless visible_ok, those writes stay pending, so that no later FLUSH claims them.
    pub(crate) fn flush_all(&self) -> crate::Result<bool> {
        let span = self.dirty.lock().unwrap_or_else(|p| p.into_inner()).take();
        let Some((lo, hi)) = span else {
            return Ok(true);
        };
        let r = self.persist(lo, hi - lo);
        match r {
            Ok(true) => {}
            Ok(false) if self.opts.visible_ok => {}
            _ => self.mark_dirty(lo, hi),
        }
        r
    }

    /// `persist_written` of a range: Ok(true) durable, Ok(false) visible only.
    pub(crate) fn persist(&self, offset: u64, len: u64) -> crate::Result<bool> {
        self.with_ns(|ns| ns.persist_written(offset, len))
            .map(|d| matches!(d, Durability::Durable(_)))
    }

    fn tick(&self) {
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

/// Ticks the queue (keep-alive) until the server stops. A thread of its own: a tick that
/// reconnects to a restarted target can take seconds, and must not hold up accepting clients
/// or a SIGTERM.
fn ticker(shared: &Shared) {
    let mut last = Instant::now();
    while !shared.stopping.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(50));
        if last.elapsed() >= TICK {
            shared.tick();
            last = Instant::now();
        }
    }
}

struct ClientThread {
    id: u64,
    stream: Stream,
    thread: JoinHandle<()>,
}

/// An NBD server for one namespace.
pub struct Server {
    shared: Arc<Shared>,
    listener: Listener,
    clients: Vec<ClientThread>,
    next_id: u64,
    ticker: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("export", &self.shared.opts.name)
            .field("listener", &self.listener)
            .field("clients", &self.clients.len())
            .finish()
    }
}

impl Server {
    /// Opens the export's queue and checks the namespace: it exists, and a forced durability
    /// method can make it durable. `listener` is already bound (clients can connect: their
    /// connections wait until [`serve`](Self::serve) accepts them).
    ///
    /// # Errors
    /// [`NbdError::Library`]: those of [`Connection::open_queue`],
    /// [`Error::NoSuchNamespace`], [`Error::MethodNotValid`].
    pub fn new(conn: Connection, opts: ExportOptions, listener: Listener) -> Result<Server> {
        let mut q = conn.open_queue(0)?;
        let ns = q.namespace(opts.nsid)?;
        let desc = ns.descriptor().clone();
        if !desc.read_only {
            ns.method()?;
        }
        let info = export_info(&opts, &desc);
        let shared = Arc::new(Shared {
            conn,
            queue: Mutex::new(Some(q)),
            opts,
            desc,
            info,
            stopping: AtomicBool::new(false),
            requests: AtomicU64::new(0),
            dirty: Mutex::new(None),
            losses: AtomicU64::new(0),
        });
        let t = Arc::clone(&shared);
        let ticker = std::thread::Builder::new()
            .name("nbd-keepalive".into())
            .spawn(move || ticker(&t))
            .map_err(NbdError::Thread)?;
        Ok(Server {
            shared,
            listener,
            clients: Vec::new(),
            next_id: 1,
            ticker: Some(ticker),
        })
    }

    /// The namespace exported.
    pub fn descriptor(&self) -> &NamespaceDescriptor {
        &self.shared.desc
    }

    /// The URL clients connect to (`nbd+unix:///NAME?socket=PATH`, `nbd://HOST:PORT/NAME`).
    pub fn url(&self) -> String {
        self.listener.url(&self.shared.opts.name)
    }

    /// Accepts clients (a thread each) until `stop` is readable.
    ///
    /// # Errors
    /// [`NbdError::Poll`].
    pub fn serve(&mut self, stop: BorrowedFd<'_>) -> Result<()> {
        loop {
            let (accept, stopped) = {
                let mut fds = [
                    PollFd::new(self.listener.as_fd(), PollFlags::POLLIN),
                    PollFd::new(stop, PollFlags::POLLIN),
                ];
                match poll(&mut fds, PollTimeout::from(TICK.as_millis() as u16)) {
                    Ok(_) => {}
                    Err(nix::errno::Errno::EINTR) => continue,
                    Err(e) => return Err(NbdError::Poll(e.into())),
                }
                let ready = |f: &PollFd<'_>| f.revents().is_some_and(|r| !r.is_empty());
                (ready(&fds[0]), ready(&fds[1]))
            };
            if stopped {
                return Ok(());
            }
            self.reap();
            if accept {
                self.accept();
            }
        }
    }

    fn reap(&mut self) {
        let (done, live): (Vec<_>, Vec<_>) =
            self.clients.drain(..).partition(|c| c.thread.is_finished());
        self.clients = live;
        for c in done {
            let _ = c.thread.join();
        }
    }

    fn accept(&mut self) {
        loop {
            let (stream, peer) = match self.listener.accept() {
                Ok(Some(s)) => s,
                Ok(None) => return,
                Err(e) => {
                    // EMFILE and the like: the next poll retries.
                    warn!("nbd: accepting a connection failed: {e}");
                    return;
                }
            };
            if self.clients.len() >= MAX_CLIENTS {
                warn!("nbd: {MAX_CLIENTS} clients already connected: closing the connection from {peer}");
                continue;
            }
            let id = self.next_id;
            self.next_id += 1;
            let Ok(kill) = stream.try_clone() else {
                warn!("nbd: cannot duplicate the socket of {peer}: closing it");
                continue;
            };
            let shared = Arc::clone(&self.shared);
            let spawned = std::thread::Builder::new()
                .name(format!("nbd-client-{id}"))
                .spawn(move || run_client(&shared, stream, id, &peer));
            match spawned {
                Ok(thread) => self.clients.push(ClientThread {
                    id,
                    stream: kill,
                    thread,
                }),
                Err(e) => warn!("nbd: cannot start a thread for client {id}: {e}"),
            }
        }
    }

    /// Stops: no new requests are read, every client finishes the requests it has read and is
    /// disconnected, then every write is made durable and the queue disconnects. Returns
    /// whether the writes are durable (false: a volatile namespace, visible only).
    ///
    /// # Errors
    /// [`NbdError::FinalFlush`].
    pub fn shutdown(mut self) -> Result<bool> {
        self.shared.stopping.store(true, Ordering::SeqCst);
        for c in &self.clients {
            // Their blocking reads return end-of-file; what they already read is answered.
            let _ = c.stream.shutdown(Shutdown::Read);
        }
        let deadline = Instant::now() + DRAIN_TIMEOUT;
        while !self.clients.is_empty() && Instant::now() < deadline {
            self.reap();
            std::thread::sleep(Duration::from_millis(10));
        }
        for c in &self.clients {
            warn!(
                "nbd: client {} did not finish within {DRAIN_TIMEOUT:?}",
                c.id
            );
            let _ = c.stream.shutdown(Shutdown::Both);
        }
        if let Some(t) = self.ticker.take() {
            let _ = t.join();
        }
        let nsid = self.shared.opts.nsid;
        let durable = if self.shared.desc.read_only {
            true
        } else {
            self.shared
                .flush_all()
                .map_err(|source| NbdError::FinalFlush { nsid, source })?
        };
        info!(
            "nbd: stopped after {} request(s); writes {}",
            self.shared.requests.load(Ordering::Relaxed),
            if durable {
                "durable"
            } else {
                "visible only (volatile)"
            }
        );
        if let Some(q) = self.shared.lock().take() {
            let _ = q.close();
        }
        Ok(durable)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // Without shutdown (an error): the ticker stops; the clients end with the process.
        self.shared.stopping.store(true, Ordering::SeqCst);
    }
}

fn export_info(opts: &ExportOptions, d: &NamespaceDescriptor) -> ExportInfo {
    let mut flags = TF_HAS_FLAGS | TF_CAN_MULTI_CONN;
    if d.read_only {
        flags |= TF_READ_ONLY;
    } else {
        // Advertised on a volatile namespace too: without them a client would take every
        // acknowledged write for durable. There they fail (EIO) unless visible_ok.
        flags |= TF_SEND_FLUSH | TF_SEND_FUA | TF_SEND_WRITE_ZEROES;
    }
    ExportInfo {
        name: opts.name.clone(),
        description: format!(
            "rpma namespace {} ({} bytes, {}{})",
            d.nsid,
            d.size,
            d.domain,
            if d.read_only { ", read-only" } else { "" }
        ),
        size: d.size,
        flags,
        sizes: BlockSizes::for_block(d.block_size, MAX_PAYLOAD),
    }
}

fn run_client(shared: &Shared, mut stream: Stream, id: u64, peer: &str) {
    debug!("nbd: client {id} connected from {peer}");
    let _ = stream.set_write_timeout(Some(WRITE_TIMEOUT));
    let outcome = match handshake::negotiate(&mut stream, &shared.info, HANDSHAKE_WITHIN) {
        Ok(o) => o,
        Err(e) => {
            warn!(
                "nbd: client {id} ({peer}): handshake failed: {}; connection closed",
                rpma_common::error_chain(&e)
            );
            return;
        }
    };
    let strict = match outcome {
        Outcome::Aborted => {
            debug!("nbd: client {id} aborted the handshake");
            return;
        }
        Outcome::Transmission { strict } => strict,
    };
    // If the server is stopping, the read side was shut already: the requests the client
    // sent are answered, then end of file.
    let _ = stream.set_read_timeout(None);
    info!("nbd: client {id} ({peer}) entered transmission");
    let mut c = Client::new(shared, stream, strict);
    let r = c.run();
    let s = c.stats();
    let how = match &r {
        Ok(()) => "closed".to_owned(),
        Err(e) => format!("closed on error: {}", rpma_common::error_chain(e)),
    };
    let line = format!(
        "nbd: client {id} ({peer}) {how} after {} request(s), largest batch {}; queue max in flight {}",
        s.requests,
        s.max_batch,
        shared.max_in_flight()
    );
    if r.is_ok() {
        info!("{line}");
    } else {
        warn!("{line}");
    }
    if shared.desc.domain == PersistenceDomain::Volatile && s.visible_only > 0 {
        error!(
            "nbd: client {id}: {} FLUSH/FUA request(s) on volatile namespace {} got EIO: \
             nothing can make them durable (--visible-ok accepts visible only)",
            s.visible_only, shared.opts.nsid
        );
    }
}
