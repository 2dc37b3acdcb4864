//! The export: its queues (one per client connection), the accept loop, keep-alives and
//! shutdown.

use std::net::Shutdown;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use log::{debug, info, warn, Level};
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use rpma_common::proto::{NamespaceDescriptor, PersistenceDomain};

use super::handshake::{self, ExportInfo, Outcome};
use super::proto::{
    BlockSizes, TF_CAN_MULTI_CONN, TF_HAS_FLAGS, TF_READ_ONLY, TF_SEND_FLUSH, TF_SEND_FUA,
    TF_SEND_WRITE_ZEROES,
};
use super::shared::{ExportOptions, Shared};
use super::slots::{self, Caps, Decision, Held, Slot, Source, State};
use super::stream::{Listener, Peer, Stream, WRITE_TIMEOUT};
use super::transmission::{Client, Stats};
use super::{ConnError, NbdError, Result, MAX_PAYLOAD};
use crate::Connection;

/// Connections taken in per round of the accept loop at most.
const ACCEPTS_PER_ROUND: usize = 16;
/// How long accepts pause after one failed (out of file descriptors: until a client leaves).
const ACCEPT_PAUSE: Duration = Duration::from_millis(100);
/// How often an idle queue is ticked (keep-alive: well under half the target's period).
const TICK: Duration = Duration::from_millis(500);
/// How long shutdown waits for the client threads.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(30);

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
    peer: Peer,
    slot: Arc<Slot>,
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
    /// The clock of the clients' slots.
    epoch: Instant,
    /// An accept failed (out of file descriptors, most likely): the listener is not watched
    /// until then (it stays readable, and the loop spun on it).
    accept_paused: Option<Instant>,
    /// Accepts failed since the last line said so, and when that line was.
    accept_failures: u64,
    accept_said: Option<Instant>,
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
    /// [`Error::NoSuchNamespace`](crate::Error::NoSuchNamespace),
    /// [`Error::MethodNotValid`](crate::Error::MethodNotValid).
    pub fn new(conn: Connection, opts: ExportOptions, listener: Listener) -> Result<Server> {
        let mut q = conn.open_queue(0)?;
        let ns = q.namespace(opts.nsid)?;
        let desc = ns.descriptor().clone();
        if !desc.read_only {
            ns.method()?;
        }
        let info = export_info(&opts, &desc);
        let shared = Arc::new(Shared::new(conn, q, opts, desc, info));
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
            epoch: Instant::now(),
            accept_paused: None,
            accept_failures: 0,
            accept_said: None,
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
            let now = Instant::now();
            let paused = self.accept_paused.filter(|&t| t > now);
            let (accept, stopped) = {
                let watch = match paused {
                    Some(_) => PollFlags::empty(),
                    None => PollFlags::POLLIN,
                };
                let mut fds = [
                    PollFd::new(self.listener.as_fd(), watch),
                    PollFd::new(stop, PollFlags::POLLIN),
                ];
                let wait = paused.map_or(TICK, |t| (t - now).min(TICK));
                match poll(&mut fds, PollTimeout::from(wait.as_millis() as u16)) {
                    Ok(_) => {}
                    Err(nix::errno::Errno::EINTR) => continue,
                    Err(e) => return Err(NbdError::Poll(e.into())),
                }
                let ready = |f: &PollFd<'_>| f.revents().is_some_and(|r| !r.is_empty());
                (paused.is_none() && ready(&fds[0]), ready(&fds[1]))
            };
            if stopped {
                return Ok(());
            }
            self.reap();
            self.shared.problems.tick();
            self.shared.sessions.tick();
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

    /// Takes in the connections waiting, [`ACCEPTS_PER_ROUND`] at most: the next round's poll
    /// looks at the stop descriptor first (a peer connecting and closing as fast as it could
    /// kept the backlog from emptying, and the export from hearing SIGTERM).
    fn accept(&mut self) {
        for _ in 0..ACCEPTS_PER_ROUND {
            let (stream, peer) = match self.listener.accept() {
                Ok(Some(s)) => s,
                Ok(None) => return,
                Err(e) => {
                    // EMFILE and the like: retried after a pause, said once per log period.
                    let now = Instant::now();
                    self.accept_paused = Some(now + ACCEPT_PAUSE);
                    self.accept_failures += 1;
                    let period = self.shared.opts.limits.log_period;
                    if self.accept_said.is_none_or(|t| now - t >= period) {
                        warn!(
                            "nbd: accepting a connection failed: {e} ({} time(s) since the last \
                             such line); accepts pause {} ms after each failure",
                            self.accept_failures,
                            ACCEPT_PAUSE.as_millis()
                        );
                        self.accept_said = Some(now);
                        self.accept_failures = 0;
                    }
                    return;
                }
            };
            self.reap();
            if !self.make_room(&peer) {
                continue;
            }
            let id = self.next_id;
            self.next_id += 1;
            let Ok(kill) = stream.try_clone() else {
                self.shared.problems.log(
                    Level::Warn,
                    peer.source,
                    format_args!(
                        "nbd: cannot duplicate the socket of {}: closing it",
                        peer.name
                    ),
                );
                continue;
            };
            let slot = Arc::new(Slot::new(self.epoch));
            let (shared, s, p) = (Arc::clone(&self.shared), Arc::clone(&slot), peer.clone());
            let spawned = std::thread::Builder::new()
                .name(format!("nbd-client-{id}"))
                .spawn(move || run_client(&shared, stream, id, &p, &s));
            match spawned {
                Ok(thread) => self.clients.push(ClientThread {
                    id,
                    peer,
                    slot,
                    stream: kill,
                    thread,
                }),
                Err(e) => self.shared.problems.log(
                    Level::Warn,
                    peer.source,
                    format_args!("nbd: cannot start a thread for client {id}: {e}"),
                ),
            }
        }
    }

    /// Makes room for a newcomer from `peer` within the limits, evicting a client in its
    /// handshake or idle if need be ([`slots::decide`]); false if it must be turned away.
    fn make_room(&mut self, peer: &Peer) -> bool {
        let l = self.shared.opts.limits;
        let caps = Caps {
            total: l.max_clients,
            per_source: l.max_per_source,
        };
        // A victim that turned busy meanwhile is not evicted: decide again.
        for _ in 0..8 {
            let held: Vec<Held> = self
                .clients
                .iter()
                .map(|c| Held::of(c.peer.source, &c.slot))
                .collect();
            match slots::decide(&held, peer.source, caps) {
                Decision::Admit => return true,
                Decision::Refuse(why) => {
                    self.shared.problems.log(
                        Level::Warn,
                        peer.source,
                        format_args!("nbd: refused a connection from {}: {why}", peer.name),
                    );
                    return false;
                }
                Decision::Evict(i) => {
                    let (c, h) = (&self.clients[i], held[i]);
                    if !c.slot.evict() {
                        continue;
                    }
                    // Its thread sees end of file (or a failed write) and leaves.
                    let _ = c.stream.shutdown(Shutdown::Both);
                    let what = match h.state {
                        State::Handshake => "in its handshake",
                        State::Unused => "idle, no request sent,",
                        State::Stalled => "executing requests, its replies unread",
                        _ => "idle",
                    };
                    // Charged to the newcomer's source: the cause, whose flood of newcomers
                    // must not use up the budget of the sources it pushes out.
                    self.shared.problems.log(
                        Level::Warn,
                        peer.source,
                        format_args!(
                            "nbd: client {} ({}) evicted for a new connection from {}: {what} \
                             for {} s (at most {} connection(s) per source, {} in all)",
                            c.id,
                            c.peer.name,
                            peer.name,
                            h.since.elapsed().as_secs(),
                            l.max_per_source,
                            l.max_clients
                        ),
                    );
                    return true;
                }
            }
        }
        self.shared.problems.log(
            Level::Warn,
            peer.source,
            format_args!(
                "nbd: refused a connection from {}: each client chosen to make room for it \
                 began executing requests first",
                peer.name
            ),
        );
        false
    }

    /// Stops: no new requests are read, every client finishes the requests it has read and is
    /// disconnected, then every write is made durable and the queue disconnects. Returns
    /// whether the writes are durable (false: a volatile namespace, visible only).
    ///
    /// # Errors
    /// [`NbdError::FinalFlush`]; [`NbdError::WritesLost`] when a queue gave up during the run
    /// holding writes that were not durable yet, or the namespace changed (those writes may be
    /// lost: no final flush can vouch for them).
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
            // No client's: the export's own last FLUSH, its lines under no client's source.
            self.shared
                .flush_all(Source::Unknown)
                .map_err(|source| NbdError::FinalFlush { nsid, source })?
        };
        self.shared.close_all();
        let losses = self.shared.losses.load(Ordering::SeqCst);
        if losses > 0 {
            return Err(NbdError::WritesLost { nsid, losses });
        }
        info!(
            "nbd: stopped after {} request(s); writes {}",
            self.shared.requests.load(Ordering::Relaxed),
            if durable {
                "durable"
            } else {
                "visible only (volatile)"
            }
        );
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
            d.domain_label(),
            if d.read_only { ", read-only" } else { "" }
        ),
        size: d.size,
        flags,
        sizes: BlockSizes::for_block(d.block_size, MAX_PAYLOAD),
    }
}

/// Serves one client, then shuts its socket down: the accept loop holds a clone of it until
/// it reaps this thread, and the client must see the end at once.
fn run_client(shared: &Shared, stream: Stream, id: u64, peer: &Peer, slot: &Slot) {
    let end = match stream.try_clone() {
        Ok(s) => s,
        Err(_) => return,
    };
    serve_client(shared, stream, id, peer, slot);
    let _ = end.shutdown(Shutdown::Both);
}

fn serve_client(shared: &Shared, mut stream: Stream, id: u64, peer: &Peer, slot: &Slot) {
    debug!("nbd: client {id} connected from {}", peer.name);
    let src = peer.source;
    let _ = stream.set_write_timeout(Some(WRITE_TIMEOUT));
    let within = shared.opts.limits.handshake_timeout;
    let outcome = match handshake::negotiate(&mut stream, &shared.info, within) {
        Ok(o) => o,
        Err(_) if slot.evicted() => return,
        Err(e) => {
            shared.problems.log(
                Level::Warn,
                src,
                format_args!(
                    "nbd: client {id} ({}): handshake failed: {}; connection closed",
                    peer.name,
                    rpma_common::error_chain(&e)
                ),
            );
            return;
        }
    };
    let strict = match outcome {
        Outcome::Aborted => {
            debug!("nbd: client {id} aborted the handshake");
            return;
        }
        // Evicted for a newcomer, or the server stopping, before its first byte: said elsewhere.
        Outcome::Probe if slot.evicted() => return,
        Outcome::Probe => {
            debug!(
                "nbd: client {id} ({}) closed before its handshake (a port probe)",
                peer.name
            );
            return;
        }
        Outcome::Transmission { strict } => strict,
    };
    if !slot.entered_transmission() {
        return;
    }
    // If the server is stopping, the read side was shut already: the requests the client
    // sent are answered, then end of file.
    let _ = stream.set_read_timeout(None);
    shared.sessions.log(
        Level::Info,
        src,
        format_args!("nbd: client {id} ({}) entered transmission", peer.name),
    );
    // The losses some client was told of so far, and all so far: a FLUSH of this connection
    // answers EIO for any later one (its writes may be among what went), and for an earlier
    // one no client was told of yet.
    let losses = (
        shared.losses_reported.load(Ordering::SeqCst),
        shared.losses.load(Ordering::SeqCst),
    );
    // No queue until the first request: a connection that sends nothing costs the target no
    // session and the export no replay memory.
    let idle = shared.opts.limits.idle_timeout;
    let first = stream.wait_first_byte(
        idle.map(|d| (slot.since() + d).saturating_duration_since(Instant::now())),
    );
    let (r, s) = match first {
        Ok(true) => {
            let Some(cell) = shared.take(slot, src) else {
                return;
            };
            let mut c = Client::new(shared, &cell, stream, strict, (slot, src), losses);
            let r = c.run();
            let s = c.stats();
            drop(c);
            shared.give_back(&cell);
            (r, s)
        }
        Ok(false) => (Ok(()), Stats::default()),
        Err(e) => match (e.kind(), idle) {
            (std::io::ErrorKind::TimedOut, Some(d)) => (Err(ConnError::Idle(d)), Stats::default()),
            _ => (Err(e.into()), Stats::default()),
        },
    };
    if slot.evicted() || matches!(r, Err(ConnError::Evicted)) {
        // The accept loop said why.
        return;
    }
    let how = match &r {
        Ok(()) => "closed".to_owned(),
        Err(ConnError::Idle(d)) => {
            format!("closed: no request for {} s (--idle-timeout)", d.as_secs())
        }
        Err(e) => format!("closed on error: {}", rpma_common::error_chain(e)),
    };
    let mut line = format!(
        "nbd: client {id} ({}) {how} after {} request(s), at most {} in flight; queue max in flight {}",
        peer.name,
        s.requests,
        s.max_batch,
        shared.max_in_flight()
    );
    if s.early > 0 {
        line += &format!(
            "; {} WRITE(s) made durable before their FLUSH came",
            s.early
        );
    }
    if s.direct > 0 {
        line += &format!("; {} WRITE payload(s) received in place", s.direct);
    }
    if s.held_back + s.waited > 0 {
        line += &format!(
            "; for another connection's writes: {} held back, {} waited in line",
            s.held_back, s.waited
        );
    }
    match r {
        Ok(()) | Err(ConnError::Idle(_)) => {
            shared
                .sessions
                .log(Level::Info, src, format_args!("{line}"))
        }
        Err(_) => shared
            .problems
            .log(Level::Warn, src, format_args!("{line}")),
    }
    if shared.desc.domain == PersistenceDomain::Volatile && s.visible_only > 0 {
        shared.problems.log(
            Level::Error,
            src,
            format_args!(
                "nbd: client {id}: {} FLUSH/FUA request(s) on volatile namespace {} got EIO: \
                 nothing can make them durable (--visible-ok accepts visible only)",
                s.visible_only, shared.opts.nsid
            ),
        );
    }
}
