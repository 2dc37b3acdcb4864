//! An NVMe/TCP poll loop: an epoll over its connections' sockets, its command eventfd and its
//! flusher's eventfd.
//!
//! A loop owns a connection from its hand-over on: it reads into the connection's [`Queue`],
//! writes out what the queue has to send, submits the flushes it asks for to its [`Flusher`] and
//! hands back their completions, and runs the queues' timers. It blocks in epoll until a socket,
//! a flush, a command or the earliest timer needs it: an idle loop uses no CPU. A queue that
//! stops reading (too much to send) is left out of the read interest until it drained; one that
//! spent its zeroing budget for the turn ([`super::queue::ZERO_BUDGET`]) is left out until the
//! next turn, which then starts without waiting.

use std::collections::{HashMap, VecDeque};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout};
use nix::sys::socket::{setsockopt, sockopt};

use super::queue::{Effect, Env, Queue};
use super::Ctx;
use crate::flusher::{FlushCompletion, FlushTarget, Flusher, FlusherError};
use crate::metrics::LoopStats;
use crate::reload::ConfigDiff;
use crate::seam::Applied;
use crate::serve::budget::Ticket;
use crate::serve::{Heartbeat, LoopCmd, LoopTx};

/// Epoll token of a loop's command eventfd.
const WAKE: u64 = 0;
/// Epoll token of a loop's flusher eventfd.
const FLUSH: u64 = 1;
/// Reads per connection and turn, so that one busy host does not starve the others.
const READS_PER_TURN: usize = 8;
/// TCP keep-alive on every connection: a host that vanished (power off, cable) is noticed even
/// where it asked for no NVMe keep-alive.
const TCP_KEEPIDLE_S: u32 = 60;
const TCP_KEEPINTVL_S: u32 = 10;
const TCP_KEEPCNT: u32 = 6;

/// A command to a loop.
pub(super) enum Cmd {
    Accept(TcpStream, Box<Ticket>),
    /// A reload, and the token that says this loop applied it (dropped once every queue
    /// heard of it: no transfer of this loop writes into a retired namespace after that).
    Reload(Arc<ConfigDiff>, Option<Applied>),
    Stop,
}

/// A connection of a loop.
struct Conn {
    stream: TcpStream,
    queue: Queue,
    /// The epoll interest registered now.
    interest: EpollFlags,
    /// Registered with the loop's epoll (until its socket is done: [`Queue::socket_done`]).
    watched: bool,
}

/// An NVMe/TCP poll loop: one thread, the connections handed to it.
pub(super) struct Loop {
    index: usize,
    ctx: Arc<Ctx>,
    rx: mpsc::Receiver<Cmd>,
    evictions: mpsc::Receiver<LoopCmd>,
    evict: LoopTx,
    beat: Heartbeat,
    load: Arc<AtomicUsize>,
    stats: Arc<LoopStats>,
    epoll: Epoll,
    flusher: Flusher,
    conns: HashMap<u64, Conn>,
    next_key: u64,
    next_token: u64,
    /// Flush tokens by connection.
    tokens: HashMap<u64, u64>,
    /// Flushes waiting for a free flusher slot.
    waiting: VecDeque<(u64, FlushTarget, u64, u64)>,
    /// What the queues asked for, with the key of the connection that asked.
    effects: Vec<(u64, Effect)>,
}

impl Loop {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        index: usize,
        ctx: Arc<Ctx>,
        rx: mpsc::Receiver<Cmd>,
        evictions: mpsc::Receiver<LoopCmd>,
        evict: LoopTx,
        beat: Heartbeat,
        load: Arc<AtomicUsize>,
        stats: Arc<LoopStats>,
    ) -> std::result::Result<Loop, Box<dyn std::error::Error + Send + Sync>> {
        let cfg = ctx.serve.config();
        // The flush services after the native loops' (Config::flush_services).
        let mut flusher = Flusher::new(cfg.max_queue_depth, cfg.native_flush_services() + index)?;
        flusher.set_stats(Arc::clone(&stats));
        let epoll = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC)?;
        epoll.add(beat.wake_fd(), EpollEvent::new(EpollFlags::EPOLLIN, WAKE))?;
        epoll.add(
            flusher.wait_fd(),
            EpollEvent::new(EpollFlags::EPOLLIN, FLUSH),
        )?;
        Ok(Loop {
            index,
            ctx,
            rx,
            evictions,
            evict,
            beat,
            load,
            stats,
            epoll,
            flusher,
            conns: HashMap::new(),
            next_key: 2,
            next_token: 0,
            tokens: HashMap::new(),
            waiting: VecDeque::new(),
            effects: Vec::new(),
        })
    }

    pub(super) fn run(mut self) {
        let mut events = vec![EpollEvent::empty(); 64];
        loop {
            self.beat.tick();
            // Queues that spent their zeroing budget last turn take in what waited.
            self.each(|q, env| q.new_turn(env));
            loop {
                match self.rx.try_recv() {
                    Ok(Cmd::Accept(s, t)) => self.accept(s, *t),
                    Ok(Cmd::Reload(d, applied)) => {
                        self.each(|q, env| q.reloaded(&d, env));
                        drop(applied);
                    }
                    Ok(Cmd::Stop) | Err(mpsc::TryRecvError::Disconnected) => {
                        return self.shutdown();
                    }
                    Err(mpsc::TryRecvError::Empty) => break,
                }
            }
            // Evictions: the queues whose tickets were taken back are closed now.
            while self.evictions.try_recv().is_ok() {}
            self.evicted();
            // What the commands made the queues say (a reload's events) goes out before the wait.
            self.finish_turn();
            let now = Instant::now();
            let next = self.conns.values().map(|c| c.queue.next_timer()).min();
            let spent = self.conns.values().any(|c| c.queue.spent());
            let timeout = match next {
                _ if spent => EpollTimeout::ZERO,
                None => EpollTimeout::NONE,
                Some(t) => {
                    let ms = t
                        .saturating_duration_since(now)
                        .as_millis()
                        .saturating_add(1);
                    EpollTimeout::try_from(ms.min(i32::MAX as u128) as i32)
                        .unwrap_or(EpollTimeout::MAX)
                }
            };
            let n = match self.epoll.wait(&mut events, timeout) {
                Ok(n) => n,
                Err(nix::errno::Errno::EINTR) => 0,
                Err(e) => {
                    log::error!("nvme loop {}: epoll failed: {e}", self.index);
                    std::thread::sleep(Duration::from_millis(20));
                    0
                }
            };
            for ev in &events[..n] {
                match ev.data() {
                    WAKE => self.beat.clear(),
                    FLUSH => self.flusher.clear_wake(),
                    key => self.serve(key, ev.events()),
                }
            }
            self.reap_flushes();
            self.each(|q, env| q.tick(env));
            self.finish_turn();
        }
    }

    fn env_parts(&mut self) -> (Env<'_>, &mut HashMap<u64, Conn>) {
        (
            Env {
                ctx: &self.ctx,
                now: Instant::now(),
                conn: 0,
                effects: &mut self.effects,
                next_token: &mut self.next_token,
                owner: &self.evict,
                stats: &self.stats,
            },
            &mut self.conns,
        )
    }

    /// Runs `f` on every queue.
    fn each(&mut self, mut f: impl FnMut(&mut Queue, &mut Env<'_>)) {
        let (mut env, conns) = self.env_parts();
        for (key, c) in conns.iter_mut() {
            env.conn = *key;
            f(&mut c.queue, &mut env);
        }
        self.after_effects();
    }

    fn accept(&mut self, stream: TcpStream, ticket: Ticket) {
        let peer = stream.peer_addr();
        let local = stream.local_addr();
        let (Ok(peer), Ok(local)) = (peer, local) else {
            self.load.fetch_sub(1, Ordering::Relaxed);
            return;
        };
        let _ = stream.set_nodelay(true);
        let _ = setsockopt(&stream, sockopt::KeepAlive, &true);
        let _ = setsockopt(&stream, sockopt::TcpKeepIdle, &TCP_KEEPIDLE_S);
        let _ = setsockopt(&stream, sockopt::TcpKeepInterval, &TCP_KEEPINTVL_S);
        let _ = setsockopt(&stream, sockopt::TcpKeepCount, &TCP_KEEPCNT);
        if let Err(e) = stream.set_nonblocking(true) {
            log::debug!("{peer}: {e}");
            self.load.fetch_sub(1, Ordering::Relaxed);
            return;
        }
        let key = self.next_key;
        self.next_key += 1;
        let interest = EpollFlags::EPOLLIN | EpollFlags::EPOLLRDHUP;
        if let Err(e) = self
            .epoll
            .add(stream.as_fd(), EpollEvent::new(interest, key))
        {
            log::warn!("nvme loop {}: cannot watch {peer}: {e}", self.index);
            self.load.fetch_sub(1, Ordering::Relaxed);
            return;
        }
        let handshake = Duration::from_millis(u64::from(
            self.ctx.serve.config().admission.handshake_timeout_ms,
        ));
        let queue = Queue::new(peer, local, ticket, Instant::now(), handshake);
        self.conns.insert(
            key,
            Conn {
                stream,
                queue,
                interest,
                watched: true,
            },
        );
    }

    /// A socket is ready.
    fn serve(&mut self, key: u64, ready: EpollFlags) {
        let (mut env, conns) = self.env_parts();
        let Some(c) = conns.get_mut(&key) else {
            return;
        };
        env.conn = key;
        if ready.intersects(EpollFlags::EPOLLIN | EpollFlags::EPOLLERR | EpollFlags::EPOLLHUP) {
            for _ in 0..READS_PER_TURN {
                let space = c.queue.recv_space();
                if space.is_empty() {
                    break;
                }
                let room = space.len();
                match (&c.stream).read(space) {
                    Ok(0) => {
                        c.queue.peer_gone(&mut env);
                        break;
                    }
                    // A short read took everything there was: no second read for its EAGAIN.
                    Ok(n) if n < room => {
                        c.queue.received(n, &mut env);
                        break;
                    }
                    Ok(n) => c.queue.received(n, &mut env),
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => {
                        log::debug!("{}: {e}", c.queue.peer);
                        c.queue.peer_gone(&mut env);
                        break;
                    }
                }
            }
        }
        flush_tx(c, &mut env);
        // A hang-up or an error that no read will see (the queue does not read now: it is
        // closing, or waits for its host to take its output): the socket is done. Epoll reports
        // them whatever the interest, so left as they are, they would wake every wait.
        if ready.intersects(EpollFlags::EPOLLERR | EpollFlags::EPOLLHUP)
            && !c.queue.wants_read()
            && !c.queue.socket_done
        {
            c.queue.peer_gone(&mut env);
        }
        self.after_effects();
    }

    /// Carries out what the queues asked for.
    fn after_effects(&mut self) {
        for (key, e) in std::mem::take(&mut self.effects) {
            match e {
                Effect::Flush {
                    token,
                    target,
                    offset,
                    len,
                } => {
                    self.tokens.insert(token, key);
                    self.waiting.push_back((token, target, offset, len));
                }
                Effect::WakeAll => self.ctx.wake_all(),
            }
        }
        self.submit_waiting();
    }

    fn submit_waiting(&mut self) {
        while let Some((token, target, offset, len)) = self.waiting.pop_front() {
            match self.flusher.submit(token, &target, offset, len) {
                Ok(()) => {}
                Err(FlusherError::Full(_)) => {
                    self.waiting.push_front((token, target, offset, len));
                    break;
                }
                Err(e) => {
                    log::error!("nvme loop {}: flush submission failed: {e}", self.index);
                    self.flush_done(FlushCompletion {
                        token,
                        status: rpma_common::proto::FlushStatus::Unavailable,
                    });
                }
            }
        }
    }

    fn reap_flushes(&mut self) {
        let mut done = Vec::new();
        self.flusher.poll(&mut done);
        for c in done {
            self.flush_done(c);
        }
        if !self.waiting.is_empty() {
            self.submit_waiting();
            let mut done = Vec::new();
            self.flusher.poll(&mut done);
            for c in done {
                self.flush_done(c);
            }
        }
        self.after_effects();
    }

    fn flush_done(&mut self, c: FlushCompletion) {
        let Some(key) = self.tokens.remove(&c.token) else {
            return;
        };
        let (mut env, conns) = self.env_parts();
        if let Some(conn) = conns.get_mut(&key) {
            env.conn = key;
            conn.queue.flush_done(c.token, c.status, &mut env);
            flush_tx(conn, &mut env);
        }
    }

    /// Closes the queues whose place in a pool was taken for a newer connection.
    fn evicted(&mut self) {
        let (mut env, conns) = self.env_parts();
        for (key, c) in conns.iter_mut() {
            env.conn = *key;
            if c.queue.ticket.as_ref().is_some_and(Ticket::evicted) {
                // An admitted controller's place went to a host of a higher standing (the
                // target was full: a host that proved its key, or a listed one for a
                // controller of an unlisted host); the others' to a newer connection of their
                // pool.
                if c.queue.is_admin() {
                    c.queue.end(crate::metrics::EndReason::Evicted, &mut env);
                } else {
                    log::debug!(
                        "{}: closed for a newer connection (the pool was full)",
                        c.queue.peer
                    );
                }
                c.queue.ticket = None;
                c.queue.close(&mut env);
            }
        }
        self.after_effects();
    }

    /// Writes what is pending, resumes queues that had stopped for it, updates the epoll
    /// interests and drops the connections that are done.
    fn finish_turn(&mut self) {
        let now = Instant::now();
        let (mut env, conns) = self.env_parts();
        let mut done = Vec::new();
        let mut changed = Vec::new();
        let mut unwatch = Vec::new();
        for (key, c) in conns.iter_mut() {
            env.conn = *key;
            flush_tx(c, &mut env);
            if c.queue.finished(now) {
                done.push(*key);
                continue;
            }
            if c.queue.socket_done {
                // Its peer is gone: not watched any more (it waits only for its flushes).
                if c.watched {
                    unwatch.push(*key);
                }
                continue;
            }
            // The peer's half-close only with the reads: it is level-triggered, and a queue that
            // does not read (closing, or its host not taking its output) would be woken by it
            // at every wait, spinning its loop. Such a queue sees its peer go when it reads
            // again or when a write fails.
            let mut want = EpollFlags::empty();
            if c.queue.wants_read() {
                want |= EpollFlags::EPOLLIN | EpollFlags::EPOLLRDHUP;
            }
            if !c.queue.pending_tx().is_empty() {
                want |= EpollFlags::EPOLLOUT;
            }
            if want != c.interest {
                changed.push((*key, want));
            }
        }
        for (key, want) in changed {
            if let Some(c) = self.conns.get_mut(&key) {
                let mut ev = EpollEvent::new(want, key);
                if self.epoll.modify(c.stream.as_fd(), &mut ev).is_ok() {
                    c.interest = want;
                }
            }
        }
        for key in unwatch {
            if let Some(c) = self.conns.get_mut(&key) {
                let _ = self.epoll.delete(c.stream.as_fd());
                c.watched = false;
            }
        }
        for key in done {
            if let Some(c) = self.conns.remove(&key) {
                if c.watched {
                    let _ = self.epoll.delete(c.stream.as_fd());
                }
                self.load.fetch_sub(1, Ordering::Relaxed);
            }
        }
        self.tokens.retain(|_, k| self.conns.contains_key(k));
        self.after_effects();
    }

    /// Stop: no more input, in-flight flushes answered (up to 10 s), what waits to be sent
    /// given a second to leave, then every connection closed.
    fn shutdown(mut self) {
        self.each(|q, env| q.stop(env));
        let deadline = Instant::now() + Duration::from_secs(10);
        while !self.tokens.is_empty() && Instant::now() < deadline {
            let mut pfd = [PollFd::new(self.flusher.wait_fd(), PollFlags::POLLIN)];
            let _ = poll(&mut pfd, PollTimeout::from(100u16));
            self.flusher.clear_wake();
            self.reap_flushes();
        }
        self.flusher.finish_all();
        let deadline = Instant::now() + Duration::from_secs(1);
        while Instant::now() < deadline {
            self.finish_turn();
            if self.conns.is_empty() {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let n = self.conns.len();
        self.conns.clear();
        self.load.fetch_sub(n, Ordering::Relaxed);
        log::debug!("nvme loop {} stopped", self.index);
    }
}

/// Writes as much of `c`'s pending output as the socket takes, then lets the queue take in what
/// it had stopped for.
fn flush_tx(c: &mut Conn, env: &mut Env<'_>) {
    for _ in 0..4 {
        let mut full = false;
        while !c.queue.pending_tx().is_empty() {
            match (&c.stream).write(c.queue.pending_tx()) {
                Ok(0) => break,
                Ok(n) => c.queue.sent(n),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    full = true;
                    break;
                }
                Err(e) => {
                    log::debug!("{}: {e}", c.queue.peer);
                    c.queue.peer_gone(env);
                    return;
                }
            }
        }
        // What it received and left for the backlog is handled as far as the backlog now
        // allows, even when the socket did not take all of it: a queue back under its high mark
        // with its receive buffer full of commands would otherwise be woken by its readable
        // socket at every wait and read nothing, its loop spinning until its host read.
        let before = c.queue.pending_tx().len();
        c.queue.process(env);
        if full || c.queue.pending_tx().len() == before {
            return;
        }
    }
}
