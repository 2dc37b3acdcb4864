//! A poll loop: one thread, one completion queue, one flusher, the connections handed to it.
//!
//! Each turn: take commands (new connections, reloads, stop), wait on the completion queue,
//! handle the completions (control messages in, sends done), submit the flush requests they
//! carried, reap finished flushes and answer them, and run the connections' timers when one is
//! due or a connection failed.
//!
//! The wait busy-polls while traffic flows, then blocks in the completion queue's epoll set,
//! which holds the connections' sockets and two fds of the loop's own: the flusher's eventfd
//! (a device flush completed) and the loop's command eventfd (an accept thread handed over a
//! connection, a reload, stop; see [`LoopTx`](super::LoopTx)). Its time-out is the earliest
//! timer of the loop's connections (handshake deadline, keep-alive lapse, linger), and none
//! without connections: an idle loop sleeps until something happens and uses no CPU.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use rpma_common::fabric::{
    Completion, CompletionQueue, Context, QpState, WcOpcode, WcStatus, Woken,
};
use rpma_common::proto::{FlushResponse, FlushStatus};
use rpma_common::stats::Stopwatch;

use super::conn::{Conn, FlushJob, Phase};
use super::registrar::Registrar;
use super::{Heartbeat, LoopCmd, LoopTx, Shared};
use crate::flusher::{FlushCompletion, Flusher, FlusherError};
use crate::metrics::{EndReason, LoopStats};
use crate::namespace::OpenNamespace;
use crate::reload::ConfigDiff;

mod admission;
mod device;
use rpma_common::proto::msgbuf::SEND_BIT;

/// The watched-fd token of the loop's command eventfd.
const WAKE_CMD: u64 = 1;
/// The watched-fd token of the flusher's eventfd.
const WAKE_FLUSH: u64 = 2;
/// How long a loop pauses after its completion queue's wait failed (so as not to spin on it).
const WAIT_FAILED_PAUSE: Duration = Duration::from_millis(20);
/// A wait that keeps failing is logged once per this period (with the count), not per try.
const WAIT_FAILED_LOG_PERIOD: Duration = Duration::from_secs(60);
/// How long a stopping loop waits for its goodbyes to leave.
const STOP_GRACE: Duration = Duration::from_secs(1);
/// A page-cache flush is synced in the loop's own thread beside other connections only if each
/// was last heard from at least this long ago ([`inline_may_hold`]): a host whose traffic flows
/// is never kept waiting by another host's sync, one that was quiet waits for one sync at most.
const INLINE_QUIET: Duration = Duration::from_millis(1);
/// ... and only if the loop has at most this many other connections (each is looked at per
/// flush) ...
const INLINE_MAX_OTHERS: usize = 4;
/// ... and only for a range of at most this many bytes (a sync's time grows with the dirty
/// pages in its range; a whole-namespace flush, length 0, never qualifies). A lone connection's
/// flushes qualify at any length: only that host waits for them.
const INLINE_SHARED_MAX_LEN: u64 = 256 << 10;

/// Whether a page-cache flush of `len` bytes (0: the whole namespace) may be synced in the
/// loop's thread, where the loop has `others` other connections, the most recently heard from
/// `quiet` ago (the flush being the only one in flight or waiting).
fn inline_may_hold(len: u64, others: usize, quiet: Duration) -> bool {
    others == 0
        || (others <= INLINE_MAX_OTHERS
            && len != 0
            && len <= INLINE_SHARED_MAX_LEN
            && quiet >= INLINE_QUIET)
}

/// Test hook (never set in production): a loop that takes a reload command sleeps this many
/// milliseconds first, so that a test can see the watchdog notice a stuck loop.
pub const TEST_STALL_ON_RELOAD_ENV: &str = "RPMA_TARGET_TEST_STALL_ON_RELOAD_MS";

/// New connections a loop accepts per pass at most; the rest wait for the next pass.
const ACCEPTS_PER_PASS: usize = 16;

struct PendingFlush {
    qp_num: u32,
    /// Its connection's [`Conn::serial`].
    serial: u64,
    host_token: u64,
    ns: Arc<OpenNamespace>,
    offset: u64,
    len: u64,
    arrived: Stopwatch,
}

pub(crate) struct PollLoop {
    index: usize,
    shared: Arc<Shared>,
    /// The way to this loop, for the pools to wake it when they evict one of its connections.
    own: LoopTx,
    rx: mpsc::Receiver<LoopCmd>,
    /// Bumped every turn; its eventfd is the loop's command eventfd.
    beat: Heartbeat,
    load: Arc<AtomicUsize>,
    /// [`TEST_STALL_ON_RELOAD_ENV`].
    stall_on_reload: Option<Duration>,
    cq: CompletionQueue,
    /// The device `cq` is on: the server's, or (its RDMA device lost) a soft placeholder that
    /// only waits on the loop's fds.
    cq_ctx: Context,
    flusher: Flusher,
    /// A connection failed (a receive or send completed in error): run the timers now, which
    /// drop it.
    failed: bool,
    conns: HashMap<u32, Conn>,
    pending: HashMap<u64, PendingFlush>,
    /// Flushes waiting for a free flusher slot, in arrival order.
    waiting: VecDeque<u64>,
    next_token: u64,
    /// The next connection's [`Conn::serial`].
    next_serial: u64,
    /// Flush requests taken in this turn: their connection's queue pair number and serial.
    jobs: Vec<(u32, u64, FlushJob)>,
    scratch: Vec<u8>,
    /// This loop's counts (it is their only writer; its flusher writes the flush timings).
    stats: Arc<LoopStats>,
    /// The device that is back on which a completion queue could not be made (said once).
    cq_failed_on: Option<Context>,
    /// Registers its connections' namespaces off the loop ([`crate::serve::registrar`]).
    registrar: Registrar,
    /// Waits on the completion queue that failed in a row, and when that was last logged.
    wait_failures: u64,
    wait_failure_said: Option<Instant>,
}

impl PollLoop {
    pub(crate) fn new(
        index: usize,
        shared: Arc<Shared>,
        own: LoopTx,
        rx: mpsc::Receiver<LoopCmd>,
        beat: Heartbeat,
        load: Arc<AtomicUsize>,
        stats: Arc<LoopStats>,
    ) -> Result<PollLoop, Box<dyn std::error::Error + Send + Sync>> {
        let cfg = shared.config();
        // Native loops are the flush services numbered first (Config::flush_services).
        let mut flusher = Flusher::new(cfg.max_queue_depth, index)?;
        flusher.set_stats(Arc::clone(&stats));
        let cq_ctx = shared
            .ctx()
            .ok_or("the RDMA device was lost before the loop started")?;
        let cq = PollLoop::loop_cq(&cq_ctx, &beat, &flusher)?;
        Ok(PollLoop {
            index,
            shared,
            registrar: Registrar::new(index, own.clone()),
            own,
            rx,
            beat,
            load,
            stall_on_reload: std::env::var(TEST_STALL_ON_RELOAD_ENV)
                .ok()
                .and_then(|v| v.parse().ok())
                .map(Duration::from_millis),
            cq,
            cq_ctx,
            flusher,
            failed: false,
            conns: HashMap::new(),
            pending: HashMap::new(),
            waiting: VecDeque::new(),
            next_token: 1,
            next_serial: 1,
            jobs: Vec::new(),
            scratch: Vec::with_capacity(rpma_common::proto::MAX_MESSAGE_SIZE),
            stats,
            cq_failed_on: None,
            wait_failures: 0,
            wait_failure_said: None,
        })
    }

    pub(crate) fn run(mut self) {
        log::debug!(
            "poll loop {} running (flusher: {})",
            self.index,
            self.flusher.backend_name()
        );
        loop {
            self.beat.tick();
            // Commands left for the next pass: new connections beyond a pass's share.
            let mut more = false;
            let mut accepted = 0;
            loop {
                match self.rx.try_recv() {
                    Ok(LoopCmd::Accept(req, ticket)) => {
                        self.accept(req, *ticket);
                        accepted += 1;
                        // A flood of new connections waits for the next pass: the loop's
                        // sessions, its timers and its watchdog heartbeat go first.
                        if accepted >= ACCEPTS_PER_PASS {
                            more = true;
                            break;
                        }
                    }
                    // The timers run this turn and drop the evicted connections.
                    Ok(LoopCmd::Evicted) => self.failed = true,
                    Ok(LoopCmd::Lost) => {
                        if self.cq_ctx.is_lost() {
                            self.device_lost();
                        }
                    }
                    Ok(LoopCmd::Device(ctx)) => {
                        // (Stale when the device flapped again meanwhile: a later command
                        // tells of the next one.)
                        if !ctx.same(&self.cq_ctx) && !ctx.is_lost() {
                            self.new_device(&ctx)
                        }
                    }
                    Ok(LoopCmd::Reload(diff, ack)) => {
                        if let Some(d) = self.stall_on_reload {
                            log::warn!("loop {}: test hook: stalling {d:?}", self.index);
                            // Told to the service manager too: a test sees when it starts and
                            // ends in order with the watchdog's pings.
                            let n = crate::notify::Notifier::from_env().ok();
                            let say = |what| n.as_ref().map(|n| n.status(what));
                            say("test hook: stalling");
                            std::thread::sleep(d);
                            say("test hook: stall over");
                        }
                        // Goodbyes whose registrations are dropped go first (a reload that
                        // touches a session still releasing closes it without one).
                        self.take_registrations();
                        self.reload(&diff);
                        // Applied: the daemon may say READY once every loop's token is gone.
                        drop(ack);
                    }
                    Ok(LoopCmd::Stop) | Err(mpsc::TryRecvError::Disconnected) => {
                        return self.shutdown();
                    }
                    Err(mpsc::TryRecvError::Empty) => break,
                }
            }
            self.take_registrations();
            // An eviction (already flagged as failed) is handled this turn, and commands left
            // for the next pass are taken after it: no wait.
            let next = if self.failed || more {
                Some(Instant::now())
            } else {
                self.next_timer()
            };
            let now = Instant::now();
            self.turn(Some(next.map(|t| t.saturating_duration_since(now))));
            // The queue says a lost device once, to whoever polls it first (a dropped queue
            // pair's drain, say): the loop looks at the device itself too.
            if self.cq_ctx.is_lost() {
                self.device_lost();
            }
            let now = Instant::now();
            if self.failed || next.is_some_and(|t| now >= t) {
                self.failed = false;
                self.tick(now);
            }
        }
    }

    /// The earliest timer of the loop's connections; None without connections.
    fn next_timer(&self) -> Option<Instant> {
        self.conns.values().map(Conn::next_timer).min()
    }

    fn reload(&mut self, diff: &ConfigDiff) {
        for c in self.conns.values_mut() {
            c.reloaded(diff);
        }
        // Lingering connections the reload cut short go now, before another send of theirs.
        self.tick(Instant::now());
    }

    /// One wait on the completion queue (`None`: poll only; `Some(None)`: no time-out) and
    /// everything it brings.
    fn turn(&mut self, wait: Option<Option<Duration>>) {
        let mut wcs = [Completion::EMPTY; 64];
        let woken = match wait {
            Some(t) => self.cq.wait_any(&mut wcs, t),
            None => self.cq.poll(&mut wcs).map(Woken::Completions),
        };
        if woken.is_ok() {
            self.wait_failures = 0;
        }
        match woken {
            Ok(Woken::Completions(n)) => {
                for c in &wcs[..n] {
                    self.on_completion(c);
                }
            }
            // Commands are taken at the top of the run loop; a flush completion just below.
            Ok(Woken::Fd(WAKE_CMD)) => self.beat.clear(),
            Ok(Woken::Fd(WAKE_FLUSH)) => self.flusher.clear_wake(),
            Ok(_) => {}
            Err(e) => self.wait_failed(&e),
        }
        self.submit_jobs();
        self.reap_flushes();
    }

    /// The completion queue's wait failed: said once per [`WAIT_FAILED_LOG_PERIOD`] while it
    /// keeps failing (a broken queue must not fill the journal), a lost device once.
    fn wait_failed(&mut self, e: &rpma_common::fabric::Error) {
        self.wait_failures += 1;
        let now = Instant::now();
        if let rpma_common::fabric::Error::DeviceLost { .. } = e {
            self.device_lost();
            return;
        }
        let due = self
            .wait_failure_said
            .is_none_or(|t| now.saturating_duration_since(t) >= WAIT_FAILED_LOG_PERIOD);
        if due {
            self.wait_failure_said = Some(now);
            log::error!(
                "loop {}: waiting for completions failed ({} in a row): {e}",
                self.index,
                self.wait_failures
            );
        }
        std::thread::sleep(WAIT_FAILED_PAUSE);
    }

    fn on_completion(&mut self, c: &Completion) {
        let Some(conn) = self.conns.get_mut(&c.qp_num) else {
            return;
        };
        if c.status != WcStatus::Success {
            self.failed = true;
        }
        if c.wr_id & SEND_BIT != 0 {
            if let Err(e) = conn.bufs.on_send_done(&conn.qp, c.wr_id) {
                log::debug!("{}: cannot send: {e}", conn.peer);
            }
            return;
        }
        if c.status != WcStatus::Success {
            // WrFlush after the queue pair went to Error, or a message too long for a slot
            // (LocalLength): the connection is over; tick drops it.
            if c.status != WcStatus::WrFlush {
                let p = conn.peer;
                self.shared
                    .peer_log
                    .warn(p.ip(), format_args!("{p}: receive failed: {:?}", c.status));
            }
            return;
        }
        if c.opcode != WcOpcode::Recv {
            // A Write with immediate data consumed the receive: it writes no message into
            // the slot, which still holds an earlier one (decoded, it replayed the peer's own
            // earlier Flush Request or Connect). Not part of the protocol.
            conn.unexpected_receive(c.opcode);
            Self::ask_registrar(&mut self.registrar, conn, c.qp_num, Vec::new());
            return;
        }
        let mut buf = std::mem::take(&mut self.scratch);
        if let Some(slot) = conn.bufs.take(c, &mut buf) {
            // Posted again before the message is handled, so that the slot count stays full.
            if let Err(e) = conn.qp.post_recv(conn.bufs.recv_wr(slot)) {
                log::debug!("{}: cannot post a receive: {e}", conn.peer);
            }
            let mut jobs = Vec::new();
            conn.on_message(&buf, &mut jobs);
            Self::ask_registrar(&mut self.registrar, conn, c.qp_num, Vec::new());
            let serial = conn.serial;
            self.jobs
                .extend(jobs.into_iter().map(|j| (c.qp_num, serial, j)));
            // A peer that does not take its answers is dropped this turn.
            self.failed |= conn.overrun();
        }
        self.scratch = buf;
    }

    fn submit_jobs(&mut self) {
        for (qp_num, serial, job) in std::mem::take(&mut self.jobs) {
            let token = self.next_token;
            self.next_token += 1;
            self.pending.insert(
                token,
                PendingFlush {
                    qp_num,
                    serial,
                    host_token: job.req.token,
                    ns: job.ns,
                    offset: job.req.offset,
                    len: job.req.length,
                    arrived: job.arrived,
                },
            );
            // Behind earlier requests that found the flusher full, so that none starves.
            self.waiting.push_back(token);
        }
        self.submit_waiting();
    }

    /// Submits waiting flushes in order until the flusher is full.
    fn submit_waiting(&mut self) {
        while let Some(&token) = self.waiting.front() {
            let Some(p) = self.pending.get(&token) else {
                self.waiting.pop_front();
                continue;
            };
            // Its connection is gone (its host has no one to hear the answer, and replays what
            // it did not hear): dropped, not synced.
            if self
                .conns
                .get(&p.qp_num)
                .is_none_or(|c| c.serial != p.serial)
            {
                self.pending.remove(&token);
                self.waiting.pop_front();
                continue;
            }
            let (target, offset, len) = (p.ns.flush_target.clone(), p.offset, p.len);
            let submitted = if target.syncs_a_file() && self.may_sync_inline(token) {
                self.flusher.submit_inline(token, &target, offset, len)
            } else {
                self.flusher.submit(token, &target, offset, len)
            };
            match submitted {
                Ok(()) => {
                    self.waiting.pop_front();
                }
                Err(FlusherError::Full(_)) => break,
                Err(e) => {
                    self.waiting.pop_front();
                    log::error!("loop {}: flush submission failed: {e}", self.index);
                    self.finish(FlushCompletion {
                        token,
                        status: FlushStatus::Unavailable,
                    });
                }
            }
        }
    }

    /// Whether flush `token` may be synced in this thread ([`Flusher::submit_inline`]): the
    /// hand-off of a page-cache sync to a kernel worker and back costs more than the loop's own
    /// sync (docs/benchmarks.md, "The loop's own sync when it has nothing else to do"). It must
    /// be the only flush in flight or waiting, and any other connection of the loop quiet:
    /// [`inline_may_hold`] of its length and how long since each other peer was last heard
    /// from. A host that sends meanwhile waits for this one sync, and is then heard from, which
    /// sends the next flush to the workers (a sync over 10 ms turns this loop's inline syncs
    /// off for 10 s: the flusher's backoff; docs/operations.md); a host heard from within
    /// [`INLINE_QUIET`] never waits for one.
    fn may_sync_inline(&mut self, token: u64) -> bool {
        if self.pending.len() != 1 || self.waiting.len() != 1 || self.flusher.in_flight() != 0 {
            return false;
        }
        let Some(p) = self.pending.get(&token) else {
            return false;
        };
        let (own, len) = (p.qp_num, p.len);
        let others = self.conns.len().saturating_sub(1);
        if others == 0 {
            return true;
        }
        if !inline_may_hold(len, others, Duration::MAX) {
            return false;
        }
        // Every other connection is looked at (none skipped once one is busy), so that each
        // one's record of when it was last heard from stays recent.
        let now = Instant::now();
        let mut quiet = Duration::MAX;
        for (num, c) in &mut self.conns {
            if *num != own {
                quiet = quiet.min(now.saturating_duration_since(c.last_heard(now)));
            }
        }
        inline_may_hold(len, others, quiet)
    }

    fn reap_flushes(&mut self) {
        // Dax write-backs taken in steps whose connection is gone are dropped, not finished:
        // a host that asks for whole-namespace flushes and reconnects leaves no work behind.
        let (pending, conns) = (&mut self.pending, &self.conns);
        self.flusher.cancel_dax(|token| {
            let alive = pending
                .get(&token)
                .is_some_and(|p| conns.get(&p.qp_num).is_some_and(|c| c.serial == p.serial));
            if !alive {
                pending.remove(&token);
            }
            alive
        });
        let mut done = Vec::new();
        self.flusher.poll(&mut done);
        for c in done {
            self.finish(c);
        }
        if !self.waiting.is_empty() {
            self.submit_waiting();
            // Inline completions (dax, volatile, bad ranges) are ready at once.
            let mut done = Vec::new();
            self.flusher.poll(&mut done);
            for c in done {
                self.finish(c);
            }
        }
    }

    fn finish(&mut self, c: FlushCompletion) {
        let Some(p) = self.pending.remove(&c.token) else {
            return;
        };
        let counters = &p.ns.counters;
        counters.flushes.fetch_add(1, Ordering::Relaxed);
        let ok = matches!(c.status, FlushStatus::Durable | FlushStatus::VisibleOnly);
        if ok {
            let len = if p.len == 0 { p.ns.size() } else { p.len };
            counters.flushed_bytes.fetch_add(len, Ordering::Relaxed);
        } else {
            counters.flush_errors.fetch_add(1, Ordering::Relaxed);
            p.ns.note_failure();
        }
        if let Some(conn) = self.conn_of(p.qp_num, p.serial) {
            if let Phase::Session(s) = &conn.phase {
                s.info.flushes.fetch_add(1, Ordering::Relaxed);
                s.info.gpspm_answered(p.ns.config.nsid, ok);
            }
            conn.flush_answered(&FlushResponse {
                token: p.host_token,
                status: c.status,
            });
            self.failed |= conn.overrun();
        }
        self.stats.gpspm_request.record_since(p.arrived);
    }

    /// The connection a flush came from, if it is still there.
    fn conn_of(&mut self, qp_num: u32, serial: u64) -> Option<&mut Conn> {
        self.conns.get_mut(&qp_num).filter(|c| c.serial == serial)
    }

    fn tick(&mut self, now: Instant) {
        let mut dead = Vec::new();
        for (&n, c) in self.conns.iter_mut() {
            if c.tick(now) {
                // A session its timers ended (a keep-alive lapse, an eviction) has its
                // registrations dropped by the registrar before its Disconnect goes out.
                Self::ask_registrar(&mut self.registrar, c, n, Vec::new());
            } else {
                dead.push(n);
            }
        }
        for n in dead {
            if let Some(c) = self.conns.remove(&n) {
                // Its queue pair is gone with it: what it had registered is unreachable, and
                // dropped off the loop.
                let left = c.into_release();
                self.registrar.discard(left);
            }
            self.load.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Stop: take in what arrived, answer every flush, say goodbye, let the goodbyes out and
    /// give the hosts a moment to close first (so that no Send of ours is cut off), drop.
    fn shutdown(mut self) {
        self.turn(None);
        let deadline = Instant::now() + STOP_GRACE * 10;
        while !self.pending.is_empty() {
            let now = Instant::now();
            if now >= deadline {
                log::error!(
                    "loop {}: {} flush(es) still in flight after {} s: closing without their answers",
                    self.index,
                    self.pending.len(),
                    (STOP_GRACE * 10).as_secs()
                );
                break;
            }
            self.turn(Some(Some(deadline - now)));
        }
        self.flusher.finish_all();
        for c in self.conns.values_mut() {
            match c.phase {
                Phase::Session(_) | Phase::Discovery { .. } => {
                    c.session_ended(EndReason::Shutdown);
                    // Dropped here: every session ends, and no goodbye waits behind the
                    // registrar's other work past the stop's grace.
                    c.goodbye_here("the target is shutting down");
                }
                Phase::Registering(_) => c.refuse_registering_at_stop(),
                Phase::Handshake { .. } | Phase::Closing { .. } => {}
            }
        }
        let deadline = Instant::now() + STOP_GRACE;
        loop {
            // Until the host closes, its queue pair stays out of Error: sends still go out.
            let lingering = self.conns.values().any(|c| {
                matches!(c.phase, Phase::Closing { .. }) && c.qp.state() != QpState::Error
            });
            let now = Instant::now();
            if !lingering || now >= deadline {
                break;
            }
            // (Goodbyes that waited for the registrar before the stop go out when it is done.)
            self.take_registrations();
            self.turn(Some(Some(deadline - now)));
        }
        let n = self.conns.len();
        self.conns.clear();
        self.load.fetch_sub(n, Ordering::Relaxed);
        log::debug!("poll loop {} stopped", self.index);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lone_connections_flush_is_synced_inline_at_any_length() {
        for len in [0, 4096, INLINE_SHARED_MAX_LEN + 1, u64::MAX] {
            assert!(inline_may_hold(len, 0, Duration::ZERO), "{len}");
        }
    }

    #[test]
    fn beside_other_connections_only_a_short_range_while_they_are_quiet() {
        let q = INLINE_QUIET;
        assert!(inline_may_hold(4096, 1, q));
        assert!(inline_may_hold(
            INLINE_SHARED_MAX_LEN,
            INLINE_MAX_OTHERS,
            Duration::MAX
        ));
        // A peer heard from just now keeps the flush on the kernel's workers.
        assert!(!inline_may_hold(4096, 1, q - Duration::from_nanos(1)));
        assert!(!inline_may_hold(4096, 1, Duration::ZERO));
        // Too long a range, the whole namespace, too many others.
        assert!(!inline_may_hold(
            INLINE_SHARED_MAX_LEN + 1,
            1,
            Duration::MAX
        ));
        assert!(!inline_may_hold(0, 1, Duration::MAX));
        assert!(!inline_may_hold(4096, INLINE_MAX_OTHERS + 1, Duration::MAX));
    }
}
