//! One accept thread per listener: takes new TCP connections, reads their MPA Requests
//! concurrently and without blocking, and hands each complete request to the least-loaded poll
//! loop, which accepts it into a queue pair of its own.
//!
//! No peer can hold up another: the thread polls the listener and every pending connection at
//! once, a connection has [`MPA_TIMEOUT`] from its TCP accept to its complete Request (then it
//! is closed), and at most [`MAX_PENDING`] wait at a time (past that the oldest is closed to
//! make room: a real initiator sends its Request as soon as it connects, so it is through long
//! before it becomes the oldest).
//!
//! A complete Request takes a place in the unadmitted pool ([`super::budget`]) before it is
//! handed over; a source at its cap makes room by evicting its own oldest connection.
//! The thread also logs the periodic count of suppressed warnings ([`super::peer_log`]).
//!
//! An `rdma://` listener whose device fails or is removed (a NIC reset, a driver reload, `rdma
//! link delete`) ends: the thread says so once, then tries every [`RELISTEN_EVERY`] to open the
//! device that serves its address again and listen on it (the first listener back replaces the
//! server's device and tells the poll loops, [`Shared::revive_device`]); hosts reconnect as
//! they do after a restart. It also looks at its device every [`RELISTEN_EVERY`], for a device
//! that failed without telling the listener.
//!
//! The thread is woken through an eventfd: to stop (with its flag set), and by the watchdog
//! check, which reads its heartbeat (a counter bumped every turn) to tell a live thread from a
//! stuck one.

use std::collections::VecDeque;
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use rpma_common::fabric::{self, Incoming, Listener, RequestProgress, Url};

use super::budget::Pool;
use super::{Error, Heartbeat, LoopCmd, LoopTx, Result, Shared};
use crate::eventfd::EventFd;

/// How long a new connection may take from its TCP accept to a complete MPA Request.
pub const MPA_TIMEOUT: Duration = Duration::from_secs(5);

/// Most connections whose MPA Request is still being read, per listener.
pub const MAX_PENDING: usize = 256;

/// Most connections taken from the kernel's queue in one turn (so that the pending ones are
/// read between bursts).
const ACCEPTS_PER_TURN: usize = 64;

/// How long the thread pauses after accept itself failed (EMFILE and the like).
const ACCEPT_FAILED_PAUSE: Duration = Duration::from_millis(100);

/// How often an `rdma://` listener whose device was lost tries to listen again, and how often
/// one that listens looks at whether its device is lost.
pub(crate) const RELISTEN_EVERY: Duration = Duration::from_secs(1);

/// Why a listener is down (its device was lost), while it is; shared with its status.
type Down = Arc<Mutex<Option<String>>>;

/// A running accept thread.
pub(crate) struct Acceptor {
    url: Url,
    /// The listener's URL as the configuration gives it (its status's).
    config_url: String,
    down: Down,
    stop: Arc<AtomicBool>,
    beat: Heartbeat,
    thread: Option<JoinHandle<()>>,
}

/// A connection whose MPA Request is being read.
struct Waiting {
    inc: Incoming,
    deadline: Instant,
}

struct AcceptLoop {
    /// None while its RDMA device is lost.
    listener: Option<Listener>,
    /// The bound URL: where it listens again once a lost device is back.
    url: Url,
    /// `rdma://`: the device can be lost.
    rdma: bool,
    /// When to try listening again, or to look at the device.
    next_look: Instant,
    /// Tries to listen again since the device was lost.
    relisten_tries: u64,
    down: Down,
    shared: Arc<Shared>,
    stop: Arc<AtomicBool>,
    beat: Heartbeat,
    loops: Vec<(LoopTx, Arc<AtomicUsize>)>,
    /// In arrival order, so also in deadline order.
    pending: VecDeque<Waiting>,
}

impl Acceptor {
    /// Binds `url` and starts accepting into `loops`. When this returns the socket is listening:
    /// a connect succeeds (the kernel queues it until the thread takes it).
    pub(crate) fn start(
        shared: &Arc<Shared>,
        url: &Url,
        config_url: String,
        loops: Vec<(LoopTx, Arc<AtomicUsize>)>,
    ) -> Result<Acceptor> {
        let listen_err = |source| Error::Listen {
            url: url.to_string(),
            source,
        };
        let ctx = shared
            .ctx()
            .ok_or_else(|| fabric::Error::DeviceLost {
                device: url.to_string(),
            })
            .map_err(listen_err)?;
        let listener = Listener::bind(&ctx, url).map_err(listen_err)?;
        let bound = listener.url().map_err(listen_err)?;
        listener.set_nonblocking(true).map_err(listen_err)?;
        let name = format!("rpma-accept-{}", bound.port);
        let wake = EventFd::new()
            .map(Arc::new)
            .map_err(|source| Error::Thread {
                name: name.clone(),
                source,
            })?;
        let beat = Heartbeat::new(name.clone(), wake);
        let stop = Arc::new(AtomicBool::new(false));
        let down: Down = Arc::default();
        let lp = AcceptLoop {
            down: Arc::clone(&down),
            listener: Some(listener),
            url: bound.clone(),
            rdma: bound.scheme == fabric::Scheme::Rdma,
            next_look: Instant::now() + RELISTEN_EVERY,
            relisten_tries: 0,
            shared: Arc::clone(shared),
            stop: Arc::clone(&stop),
            beat: beat.clone(),
            loops,
            pending: VecDeque::new(),
        };
        let thread = std::thread::Builder::new()
            .name(name.clone())
            .spawn(move || lp.run())
            .map_err(|source| Error::Thread { name, source })?;
        Ok(Acceptor {
            url: bound,
            config_url,
            down,
            stop,
            beat,
            thread: Some(thread),
        })
    }

    /// The bound URL (with the real port).
    pub(crate) fn url(&self) -> &Url {
        &self.url
    }

    /// The listener's configured URL and why it is down, if it is (its device was lost).
    pub(crate) fn down(&self) -> Option<(String, String)> {
        let why = self
            .down
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()?;
        Some((self.config_url.clone(), why))
    }

    /// The thread's heartbeat, for the watchdog check.
    pub(crate) fn heartbeat(&self) -> &Heartbeat {
        &self.beat
    }

    /// Stops accepting (pending connections are closed) and joins the thread.
    pub(crate) fn stop(mut self) {
        self.stop.store(true, Ordering::SeqCst);
        self.beat.ping();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl AcceptLoop {
    fn run(mut self) {
        while !self.stop.load(Ordering::SeqCst) {
            self.beat.tick();
            let (wake, listen, ready) = self.wait();
            if wake {
                self.beat.clear();
            }
            // Requests first (their fds were polled), then the new connections.
            let now = Instant::now();
            let mut kept = VecDeque::with_capacity(self.pending.len());
            for (w, readable) in std::mem::take(&mut self.pending).into_iter().zip(ready) {
                if readable {
                    if let Some(w) = self.read_request(w) {
                        kept.push_back(w);
                    }
                } else if now >= w.deadline {
                    log::debug!(
                        "{}: no MPA Request within {} s: closed",
                        w.inc.peer_addr(),
                        MPA_TIMEOUT.as_secs()
                    );
                } else {
                    kept.push_back(w);
                }
            }
            self.pending = kept;
            if listen {
                self.accept_new();
            }
            if self.rdma && Instant::now() >= self.next_look {
                self.look_at_device();
            }
            self.shared.peer_log.summarize(Instant::now());
        }
        log::debug!("accept thread {} stopped", self.beat.name());
    }

    /// Waits for the wake eventfd, the listener or a pending connection, until the earliest
    /// deadline: (woken, listener readable, readable per pending connection).
    fn wait(&self) -> (bool, bool, Vec<bool>) {
        let next = self
            .pending
            .front()
            .map(|w| w.deadline)
            .into_iter()
            .chain(self.shared.peer_log.next_summary())
            .chain(self.rdma.then_some(self.next_look))
            .min();
        let timeout = match next {
            None => PollTimeout::NONE,
            Some(t) => {
                let left = t.saturating_duration_since(Instant::now());
                // Rounded up so that the deadline has passed when poll returns.
                let ms = left.as_millis().saturating_add(1);
                PollTimeout::try_from(ms.min(i32::MAX as u128) as i32).unwrap_or(PollTimeout::MAX)
            }
        };
        let mut fds = Vec::with_capacity(2 + self.pending.len());
        fds.push(PollFd::new(self.beat.wake_fd(), PollFlags::POLLIN));
        // Without a listener (its device lost) a placeholder that is never ready.
        fds.push(match &self.listener {
            Some(l) => PollFd::new(l.as_fd(), PollFlags::POLLIN),
            None => PollFd::new(self.beat.wake_fd(), PollFlags::empty()),
        });
        fds.extend(
            self.pending
                .iter()
                .map(|w| PollFd::new(w.inc.as_fd(), PollFlags::POLLIN)),
        );
        let ready = |fd: &PollFd<'_>| {
            fd.revents().is_some_and(|r| {
                r.intersects(PollFlags::POLLIN | PollFlags::POLLERR | PollFlags::POLLHUP)
            })
        };
        match poll(&mut fds, timeout) {
            Ok(_) => (
                ready(&fds[0]),
                ready(&fds[1]),
                fds[2..].iter().map(ready).collect(),
            ),
            Err(nix::errno::Errno::EINTR) => (false, false, vec![false; self.pending.len()]),
            Err(e) => {
                log::error!("{}: poll failed: {e}", self.beat.name());
                std::thread::sleep(ACCEPT_FAILED_PAUSE);
                (false, false, vec![false; self.pending.len()])
            }
        }
    }

    /// Reads what `w`'s peer sent; gives it back if its Request is not complete yet.
    fn read_request(&self, w: Waiting) -> Option<Waiting> {
        let peer = w.inc.peer_addr();
        match w.inc.poll_request() {
            Ok(RequestProgress::Incomplete(inc)) => Some(Waiting {
                inc,
                deadline: w.deadline,
            }),
            Ok(RequestProgress::Complete(req)) => {
                self.hand_over(req);
                None
            }
            Err(e @ fabric::Error::Handshake { .. }) => {
                // A peer that does not speak MPA (a port scan, a wrong client): unauthenticated,
                // so rate-limited.
                self.shared
                    .events
                    .handshake_failed(crate::metrics::HandshakeFailure::BadMpaRequest);
                self.shared.peer_log.warn(
                    peer.ip(),
                    format_args!("{peer}: bad MPA Request: {}", rpma_common::error_chain(&e)),
                );
                None
            }
            Err(e @ fabric::Error::ClosedBeforeRequest { .. }) => {
                // A port probe or health check: counted as a handshake the peer broke off (as
                // the NVMe/TCP listener counts one that closes before its ICReq), not a warning.
                self.shared
                    .events
                    .handshake_failed(crate::metrics::HandshakeFailure::Abandoned);
                log::debug!("{}", rpma_common::error_chain(&e));
                None
            }
            Err(e) => {
                log::debug!("{peer}: {}", rpma_common::error_chain(&e));
                None
            }
        }
    }

    fn hand_over(&self, req: fabric::ConnRequest) {
        if self.stop.load(Ordering::SeqCst) {
            req.reject(b"");
            return;
        }
        let Some((tx, load)) = self
            .loops
            .iter()
            .min_by_key(|(_, l)| l.load(Ordering::Relaxed))
        else {
            req.reject(b"");
            return;
        };
        let source = req
            .peer_addr()
            .map_or(std::net::Ipv4Addr::UNSPECIFIED.into(), |p| p.ip());
        let limits = self.shared.limits(Pool::Unadmitted);
        let ticket = self
            .shared
            .budgets
            .take(Pool::Unadmitted, source, limits, tx.clone());
        // Counted here so that a burst spreads over the loops; the loop takes it back when the
        // connection ends.
        load.fetch_add(1, Ordering::Relaxed);
        if let Err(LoopCmd::Accept(req, _)) = tx.send(LoopCmd::Accept(req, Box::new(ticket))) {
            load.fetch_sub(1, Ordering::Relaxed);
            req.reject(b"");
        }
    }

    /// `rdma://`, every [`RELISTEN_EVERY`]: a listener whose device is lost ends; one that
    /// ended tries to listen again.
    fn look_at_device(&mut self) {
        self.next_look = Instant::now() + RELISTEN_EVERY;
        match &self.listener {
            Some(l) if l.is_lost() => {
                let e = fabric::Error::DeviceLost {
                    device: l.device_name().to_owned(),
                };
                self.listener_lost(&e);
            }
            Some(_) => {}
            None => self.relisten(),
        }
    }

    /// The listener's RDMA device failed or was removed: the listener ends (dropping it
    /// destroys its rdma_cm id, as rdma_cm asks), and so do the requests it was reading.
    fn listener_lost(&mut self, e: &fabric::Error) {
        log::warn!(
            "{}: {e}: not accepting connections; listening again once the device is back \
             (tried every {} s)",
            self.url,
            RELISTEN_EVERY.as_secs()
        );
        *self.down.lock().unwrap_or_else(|p| p.into_inner()) =
            Some(format!("{e}; listening again once it is back"));
        self.listener = None;
        self.pending.clear();
        // Nothing of this thread's is on the lost device now: the server lets it go too, and
        // so do the loops (one without connections might not hear of it by itself).
        self.shared.release_lost_device();
        for (tx, _) in &self.loops {
            let _ = tx.send(LoopCmd::Lost);
        }
        self.relisten_tries = 0;
        self.next_look = Instant::now() + RELISTEN_EVERY;
    }

    /// Opens the device that serves the listener's address again, if it is back, and listens
    /// on it (the first listener back tells the loops of the new device).
    fn relisten(&mut self) {
        self.relisten_tries += 1;
        let loops = &self.loops;
        let made = self
            .shared
            .revive_device(&self.url, |ctx| {
                for (tx, _) in loops {
                    // A loop that is gone is stopping with the rest.
                    let _ = tx.send(LoopCmd::Device(ctx.clone()));
                }
            })
            .and_then(|ctx| {
                let l = Listener::bind(&ctx, &self.url)?;
                l.set_nonblocking(true)?;
                Ok((l, ctx))
            });
        match made {
            Ok((l, ctx)) => {
                self.listener = Some(l);
                *self.down.lock().unwrap_or_else(|p| p.into_inner()) = None;
                log::info!(
                    "{}: listening again: the RDMA device {} is back",
                    self.url,
                    ctx.device_name()
                );
            }
            // Said once, at the first try: the device is usually just not back yet.
            Err(e) if self.relisten_tries == 1 => log::info!(
                "{}: cannot listen yet: {}",
                self.url,
                rpma_common::error_chain(&e)
            ),
            Err(e) => log::debug!(
                "{}: cannot listen yet: {}",
                self.url,
                rpma_common::error_chain(&e)
            ),
        }
    }

    /// Takes the connections the kernel queued (up to [`ACCEPTS_PER_TURN`]) and starts reading
    /// their Requests at once (a real initiator's is usually there already).
    fn accept_new(&mut self) {
        for _ in 0..ACCEPTS_PER_TURN {
            let Some(listener) = &self.listener else {
                return;
            };
            let inc = match listener.accept_incoming() {
                Ok(Some(inc)) => inc,
                Ok(None) => return,
                Err(e @ fabric::Error::DeviceLost { .. }) => {
                    self.listener_lost(&e);
                    return;
                }
                Err(e) => {
                    // EMFILE and the like: say so, and do not spin on it.
                    // Peers can cause it (by holding descriptors): rate-limited too.
                    self.shared.peer_log.warn(
                        std::net::Ipv4Addr::UNSPECIFIED.into(),
                        format_args!(
                            "accepting a connection failed: {}",
                            rpma_common::error_chain(&e)
                        ),
                    );
                    std::thread::sleep(ACCEPT_FAILED_PAUSE);
                    return;
                }
            };
            let w = Waiting {
                inc,
                deadline: Instant::now() + MPA_TIMEOUT,
            };
            let Some(w) = self.read_request(w) else {
                continue;
            };
            if self.pending.len() >= MAX_PENDING {
                if let Some(old) = self.pending.pop_front() {
                    log::debug!(
                        "{}: closed before its MPA Request: {MAX_PENDING} connections were waiting",
                        old.inc.peer_addr()
                    );
                }
            }
            self.pending.push_back(w);
        }
    }
}
