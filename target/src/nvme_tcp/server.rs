//! The threads of the `nvme-tcp://` listeners: one accept thread per listener and `poll_loops`
//! poll loops (poll_loop.rs), each an epoll over its connections' sockets, its command eventfd
//! and its flusher's eventfd.
//!
//! An accept thread takes a connection, gives it a place in the unadmitted pool (a source past
//! its cap is closed at once, logged rate-limited) and hands it to the loop with the fewest
//! connections, which owns it from then on.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};

use super::poll_loop::{Cmd, Loop};
use super::Ctx;
use crate::config::ListenUrl;
use crate::eventfd::EventFd;
use crate::metrics::LoopStats;
use crate::reload::ConfigDiff;
use crate::seam::ReloadAck;
use crate::serve::budget::Pool;
use crate::serve::{Error, Heartbeat, LoopTx, Result, Shared};

/// How long an accept thread pauses after accept itself failed (EMFILE and the like).
const ACCEPT_FAILED_PAUSE: Duration = Duration::from_millis(100);

struct LoopHandle {
    tx: mpsc::Sender<Cmd>,
    wake: Arc<EventFd>,
    load: Arc<AtomicUsize>,
    /// What the pools use to tell the loop it lost a connection's place.
    evict: LoopTx,
    beat: Heartbeat,
    thread: Option<JoinHandle<()>>,
}

impl LoopHandle {
    fn send(&self, cmd: Cmd) -> std::result::Result<(), Cmd> {
        self.tx.send(cmd).map_err(|e| e.0)?;
        self.wake.signal();
        Ok(())
    }
}

/// The NVMe/TCP listeners and loops.
pub(crate) struct Server {
    ctx: Arc<Ctx>,
    loops: Arc<Vec<LoopHandle>>,
    acceptors: Vec<Acceptor>,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("nvme_tcp::Server")
            .field("loops", &self.loops.len())
            .field("listeners", &self.acceptors.len())
            .finish()
    }
}

impl Server {
    /// Starts one loop per entry of `stats` (their counts), none listening yet.
    pub(crate) fn start(shared: &Arc<Shared>, stats: &[Arc<LoopStats>]) -> Result<Server> {
        let ctx = Arc::new(Ctx::new(Arc::clone(shared)));
        let mut loops = Vec::new();
        for (index, stats) in stats.iter().enumerate() {
            let setup = |e: std::io::Error| Error::LoopSetup {
                index,
                source: Box::new(e),
            };
            let wake = Arc::new(EventFd::new().map_err(setup)?);
            let (tx, rx) = mpsc::channel();
            let (etx, erx) = mpsc::channel();
            let evict = LoopTx::new(etx, Arc::clone(&wake));
            let name = format!("rpma-nvme-{index}");
            let beat = Heartbeat::new(name.clone(), Arc::clone(&wake));
            let load = Arc::new(AtomicUsize::new(0));
            let lp = Loop::new(
                index,
                Arc::clone(&ctx),
                rx,
                erx,
                evict.clone(),
                beat.clone(),
                Arc::clone(&load),
                Arc::clone(stats),
            )
            .map_err(|source| Error::LoopSetup { index, source })?;
            ctx.add_waker(Arc::clone(&wake));
            let thread = std::thread::Builder::new()
                .name(name.clone())
                .spawn(move || lp.run())
                .map_err(|source| Error::Thread { name, source })?;
            loops.push(LoopHandle {
                tx,
                wake,
                load,
                evict,
                beat,
                thread: Some(thread),
            });
        }
        Ok(Server {
            ctx,
            loops: Arc::new(loops),
            acceptors: Vec::new(),
        })
    }

    /// Binds `url` and starts accepting on it; returns the bound address.
    pub(crate) fn listen(&mut self, url: &ListenUrl) -> Result<SocketAddr> {
        let a = Acceptor::start(&self.ctx, url, Arc::clone(&self.loops))?;
        let addr = a.addr;
        self.acceptors.push(a);
        Ok(addr)
    }

    /// Every thread's heartbeat.
    pub(crate) fn heartbeats(&self) -> Vec<&Heartbeat> {
        self.loops
            .iter()
            .map(|l| &l.beat)
            .chain(self.acceptors.iter().map(|a| &a.beat))
            .collect()
    }

    /// How many poll loops it runs (each applies a reload in its own time).
    pub(crate) fn loop_count(&self) -> usize {
        self.loops.len()
    }

    /// A reload was applied (the shared configuration and namespaces are the new ones). Each
    /// loop takes a token of `ack`, dropped once it applied the reload.
    pub(crate) fn reloaded(&self, diff: &ConfigDiff, ack: Option<&Arc<ReloadAck>>) {
        self.ctx.bump_generation();
        let diff = Arc::new(diff.clone());
        for l in self.loops.iter() {
            // (A loop that is gone serves nothing: its token drops with the refused command.)
            let _ = l.send(Cmd::Reload(Arc::clone(&diff), ack.map(ReloadAck::token)));
        }
    }

    /// Stops accepting, answers what is in flight, closes every connection.
    pub(crate) fn stop(&mut self) {
        for a in self.acceptors.drain(..) {
            a.stop();
        }
        for l in self.loops.iter() {
            let _ = l.send(Cmd::Stop);
        }
        if let Some(loops) = Arc::get_mut(&mut self.loops) {
            for l in loops.iter_mut() {
                if let Some(t) = l.thread.take() {
                    if t.join().is_err() {
                        log::error!("an nvme-tcp loop panicked while stopping");
                    }
                }
            }
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
    }
}

/// One listener's accept thread.
struct Acceptor {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    beat: Heartbeat,
    thread: Option<JoinHandle<()>>,
}

impl Acceptor {
    fn start(ctx: &Arc<Ctx>, url: &ListenUrl, loops: Arc<Vec<LoopHandle>>) -> Result<Acceptor> {
        let text = url.to_string();
        let listen_err = |source: std::io::Error| Error::NvmeListen {
            url: text.clone(),
            source,
        };
        let host = if url.host.contains(':') {
            format!("[{}]", url.host)
        } else {
            url.host.clone()
        };
        let listener = TcpListener::bind(format!("{host}:{}", url.port)).map_err(listen_err)?;
        listener.set_nonblocking(true).map_err(listen_err)?;
        let addr = listener.local_addr().map_err(listen_err)?;
        let name = format!("rpma-nvme-accept-{}", addr.port());
        let wake = Arc::new(EventFd::new().map_err(|source| Error::Thread {
            name: name.clone(),
            source,
        })?);
        let beat = Heartbeat::new(name.clone(), wake);
        let stop = Arc::new(AtomicBool::new(false));
        let (ctx2, stop2, beat2) = (Arc::clone(ctx), Arc::clone(&stop), beat.clone());
        let thread = std::thread::Builder::new()
            .name(name.clone())
            .spawn(move || accept_loop(listener, ctx2, loops, stop2, beat2))
            .map_err(|source| Error::Thread { name, source })?;
        Ok(Acceptor {
            addr,
            stop,
            beat,
            thread: Some(thread),
        })
    }

    fn stop(mut self) {
        self.stop.store(true, Ordering::SeqCst);
        self.beat.ping();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn accept_loop(
    listener: TcpListener,
    ctx: Arc<Ctx>,
    loops: Arc<Vec<LoopHandle>>,
    stop: Arc<AtomicBool>,
    beat: Heartbeat,
) {
    while !stop.load(Ordering::SeqCst) {
        beat.tick();
        let timeout = match ctx.serve.peer_log.next_summary() {
            None => PollTimeout::NONE,
            Some(t) => {
                let ms = t.saturating_duration_since(Instant::now()).as_millis() + 1;
                PollTimeout::try_from(ms.min(i32::MAX as u128) as i32).unwrap_or(PollTimeout::MAX)
            }
        };
        let mut fds = [
            PollFd::new(beat.wake_fd(), PollFlags::POLLIN),
            PollFd::new(listener.as_fd(), PollFlags::POLLIN),
        ];
        let _ = poll(&mut fds, timeout);
        if fds[0].revents().is_some_and(|r| !r.is_empty()) {
            beat.clear();
        }
        for _ in 0..64 {
            match listener.accept() {
                Ok((stream, peer)) => hand_over(&ctx, &loops, stream, peer),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    log::warn!("nvme-tcp: accepting a connection failed: {e}");
                    std::thread::sleep(ACCEPT_FAILED_PAUSE);
                    break;
                }
            }
        }
        ctx.serve.peer_log.summarize(Instant::now());
    }
}

fn hand_over(ctx: &Ctx, loops: &[LoopHandle], stream: TcpStream, peer: SocketAddr) {
    let Some(l) = loops.iter().min_by_key(|l| l.load.load(Ordering::Relaxed)) else {
        return;
    };
    if ctx.serve.stopping.load(Ordering::SeqCst) {
        return;
    }
    let limits = ctx.serve.limits(Pool::Unadmitted);
    // At a cap the budget makes room by evicting the oldest of the pool or of this source
    // (issue 22): nothing is refused here.
    let ticket = ctx
        .serve
        .budgets
        .take(Pool::Unadmitted, peer.ip(), limits, l.evict.clone());
    l.load.fetch_add(1, Ordering::Relaxed);
    if let Err(Cmd::Accept(..)) = l.send(Cmd::Accept(stream, Box::new(ticket))) {
        l.load.fetch_sub(1, Ordering::Relaxed);
    }
}
