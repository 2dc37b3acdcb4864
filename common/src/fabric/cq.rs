//! [`CompletionQueue`]: where work requests end, and what drives progress.

use std::os::fd::BorrowedFd;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::completions::Completions;
use super::context::Context;
use super::error::Result;
use super::transport::CqEngine;
use super::types::Completion;

/// How long [`CompletionQueue::wait`] busy-polls after the last completion (or, on the soft
/// transport, the last request of a peer it answered) before it blocks in epoll, at least (the
/// spell grows toward [`MAX_IDLE_SPIN`] while the waits it blocks in end soon: docs/fabric.md).
pub const DEFAULT_IDLE_SPIN: Duration = Duration::from_micros(50);

/// The longest busy-poll spell [`CompletionQueue::wait`] grows to.
pub const MAX_IDLE_SPIN: Duration = Duration::from_micros(200);

/// The busy-poll spell of one completion queue's [`wait`](CompletionQueue::wait), fitted to its
/// traffic. A wait that blocked in epoll and was woken soon after (within [`MAX_IDLE_SPIN`])
/// would have been spared the wake-up, and its sleep, by a spell a little longer than that
/// sleep: the spell grows to 1.5 times it. A wait that slept longer, or timed out, shrinks it
/// by a quarter, down to [`DEFAULT_IDLE_SPIN`]. So a peer that sends its next request soon
/// after each answer (a client at depth 1, a target answering it) finds the loop awake, and a
/// quiet or sparse one costs the default spell per burst as before; an idle queue blocks and
/// uses no CPU either way.
///
/// Why: the target's poll loop went to sleep 50 us after each answer, and the NBD export's next
/// request (its own round trip to its client in between) came later, so every request paid a
/// wake-up; in a KVM guest on AMD EPYC that was most of a 4 KiB read at depth 1 through the
/// export (docs/benchmarks.md, "The idle spin").
#[derive(Debug)]
struct IdleSpin(AtomicU64);

impl IdleSpin {
    fn new() -> IdleSpin {
        IdleSpin(AtomicU64::new(DEFAULT_IDLE_SPIN.as_nanos() as u64))
    }

    fn get(&self) -> Duration {
        Duration::from_nanos(self.0.load(Ordering::Relaxed))
    }

    /// A blocking wait slept `slept` (woken by traffic), or timed out (`None`).
    fn after_sleep(&self, slept: Option<Duration>) {
        let now = self.0.load(Ordering::Relaxed);
        let next = match slept {
            Some(s) if s < MAX_IDLE_SPIN => (s.as_nanos() as u64 * 3 / 2).max(now),
            _ => now - now / 4,
        };
        let next = next.clamp(
            DEFAULT_IDLE_SPIN.as_nanos() as u64,
            MAX_IDLE_SPIN.as_nanos() as u64,
        );
        self.0.store(next, Ordering::Relaxed);
    }
}

/// A yield that took this long gave the CPU to another thread (alone on its CPU, a
/// `sched_yield` returns in well under a microsecond, in a KVM guest too).
const YIELD_RAN_OTHERS: Duration = Duration::from_micros(3);

/// At most this many spin turns between two yields.
const MAX_YIELD_EVERY: u32 = 16;

/// A busy-poll spell looks at its watched fds every this many turns (one `epoll_wait` each),
/// not every turn: a target's loop watches two (its commands, its flusher's fdatasyncs), and a
/// look each turn doubled the turn, and so the time an arriving request waited to be seen.
/// What the fds announce (a command, a page-cache fdatasync done) takes far longer than the
/// turns in between.
const WATCHED_EVERY: u32 = 8;

/// How often a busy-poll spell yields the CPU, fitted to what yielding does: every turn while a
/// yield gives the CPU to someone (on 2 CPUs shared by a client, the NBD export and the target,
/// the spinning loop would otherwise keep the one that answers it off the CPU), every second,
/// fourth, ... up to [`MAX_YIELD_EVERY`]th turn while yields return at once (nobody else wants
/// the CPU: a yield is a system call each turn then, and the spin sees its completion that
/// much later; at depth 1 through the NBD export that was 1.5 us of a 4 KiB write:
/// docs/benchmarks.md, "Yielding in the spin" and "Yielding as often as it helps").
#[derive(Debug)]
struct SpinYield {
    /// Yield every `every`th turn (kept across waits: the queue's traffic changes slowly).
    every: AtomicU32,
}

impl SpinYield {
    fn new() -> SpinYield {
        SpinYield {
            every: AtomicU32::new(1),
        }
    }

    /// Spin turn `turn` (from 1) of a spell: yields when it is time to, and learns from how
    /// long the yield took.
    fn turn(&self, turn: u32) {
        let every = self.every.load(Ordering::Relaxed);
        if !turn.is_multiple_of(every) {
            return;
        }
        let t = Instant::now();
        std::thread::yield_now();
        self.learn(t.elapsed());
    }

    fn learn(&self, took: Duration) {
        let every = self.every.load(Ordering::Relaxed);
        let next = if took >= YIELD_RAN_OTHERS {
            1
        } else {
            (every * 2).min(MAX_YIELD_EVERY)
        };
        self.every.store(next, Ordering::Relaxed);
    }
}

/// A completion queue (`ibv_cq`). Cheap to clone; every clone is the same queue.
///
/// Polling it drives the sockets of every queue pair bound to it, in the calling thread: there
/// is no background thread on the data path. That progress also serves the peers' requests
/// (placing their Writes, answering their Reads, atomics and Flushes), so a target polls its
/// completion queues even when it posts nothing. Several threads may poll one queue; each
/// queue pair is driven by one of them at a time.
///
/// `depth` is a sizing hint: completions are never dropped, the queue grows beyond it.
#[derive(Clone)]
pub struct CompletionQueue {
    pub(crate) inner: Arc<CqInner>,
}

pub(crate) struct CqInner {
    ctx: Context,
    /// What the transport completed and nobody polled yet: the transport pushes, `poll` takes.
    list: Arc<Completions>,
    engine: CqEngine,
    /// The busy-poll spell of `wait` and `wait_any`.
    spin: IdleSpin,
    /// How often the spell yields.
    yielder: SpinYield,
    /// Waits that blocked (`blocked_waits`).
    blocked: AtomicU64,
}

impl std::fmt::Debug for CompletionQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompletionQueue")
            .field("ready", &self.inner.list.len())
            .finish()
    }
}

impl Context {
    /// Creates a completion queue (`ibv_create_cq`). `depth` is the number of completions it is
    /// sized for; see [`CompletionQueue`].
    pub fn create_cq(&self, depth: usize) -> Result<CompletionQueue> {
        CompletionQueue::new(self.clone(), depth)
    }
}

impl CompletionQueue {
    pub(crate) fn new(ctx: Context, depth: usize) -> Result<CompletionQueue> {
        let list = Arc::new(Completions::with_capacity(depth.min(1 << 16)));
        let engine = ctx.device().create_cq(depth, &list)?;
        Ok(CompletionQueue {
            inner: Arc::new(CqInner {
                ctx,
                list,
                engine,
                spin: IdleSpin::new(),
                yielder: SpinYield::new(),
                blocked: AtomicU64::new(0),
            }),
        })
    }

    /// The device it belongs to.
    pub fn context(&self) -> &Context {
        &self.inner.ctx
    }

    /// How many times a wait on this queue ended its busy-poll spell and blocked (in epoll, or
    /// on the device's completion channel): a statistic. Each block is a wake-up for whatever
    /// ends it; under steady traffic a queue should block about never.
    pub fn blocked_waits(&self) -> u64 {
        self.inner.blocked.load(Ordering::Relaxed)
    }

    /// The transport's part.
    pub(crate) fn engine(&self) -> &CqEngine {
        &self.inner.engine
    }

    /// Drives the bound queue pairs once and moves up to `out.len()` completions into `out`
    /// (`ibv_poll_cq`). Returns how many. Never blocks.
    ///
    /// # Errors
    /// None on the soft transport; on `rdma`, [`Error::Verbs`](super::Error::Verbs) when the
    /// device fails to poll its completion queue (the device is gone or broken).
    pub fn poll(&self, out: &mut [Completion]) -> Result<usize> {
        Ok(self.poll_traffic(out)?.0)
    }

    /// [`poll`](Self::poll), and whether a peer's request was answered that completes nothing
    /// here (see `CqEngine::progress`).
    fn poll_traffic(&self, out: &mut [Completion]) -> Result<(usize, bool)> {
        if out.is_empty() {
            return Ok((0, false));
        }
        let answered = self.inner.engine.progress()?;
        Ok((self.inner.list.take_into(out), answered))
    }

    /// Like [`poll`](Self::poll), but waits up to `timeout` (None: forever) for at least one
    /// completion: it busy-polls for a spell fitted to the traffic (see [`DEFAULT_IDLE_SPIN`]
    /// and [`MAX_IDLE_SPIN`]), yielding the CPU each turn and looking at the fds given to
    /// [`watch_fd`](Self::watch_fd) too, and then blocks in epoll on the queue pairs' sockets
    /// and those fds. Returns 0 if the time ran out or a watched fd became readable;
    /// [`wait_any`](Self::wait_any) tells those apart.
    ///
    /// # Errors
    /// [`Error::Wait`](super::Error::Wait) if epoll fails.
    pub fn wait(&self, out: &mut [Completion], timeout: Option<Duration>) -> Result<usize> {
        self.wait_with_spin(out, timeout, self.inner.spin.get())
    }

    /// [`wait`](Self::wait) with a chosen busy-poll spell.
    ///
    /// # Errors
    /// [`Error::Wait`](super::Error::Wait) if epoll fails.
    pub fn wait_with_spin(
        &self,
        out: &mut [Completion],
        timeout: Option<Duration>,
        spin: Duration,
    ) -> Result<usize> {
        Ok(match self.wait_any_with_spin(out, timeout, spin)? {
            Woken::Completions(n) => n,
            Woken::Fd(_) | Woken::TimedOut => 0,
        })
    }

    /// Adds `fd` to this queue's idle wait (the way an `ibv_comp_channel` fd joins a poll set,
    /// turned around): while it is readable, [`wait_any`](Self::wait_any) returns
    /// [`Woken::Fd(token)`](Woken::Fd) instead of blocking. Level-triggered: the caller drains
    /// the fd (reads its eventfd, pipe, ...) or it keeps waking the queue. A watched fd is looked
    /// at only when the queue has no completions to return, so a caller that is busy with
    /// completions checks its fds between calls (cheap and non-blocking for an eventfd).
    ///
    /// The fd must stay open while watched, or be [`unwatch_fd`](Self::unwatch_fd)ed first
    /// (epoll forgets a closed fd by itself, but a new fd with the same number is not watched).
    ///
    /// # Errors
    /// [`Error::Watch`](super::Error::Watch) if the fd is already watched by this queue or
    /// cannot be polled (a regular file).
    pub fn watch_fd(&self, fd: BorrowedFd<'_>, token: u64) -> Result<()> {
        self.inner.engine.watch(fd, token)
    }

    /// Removes `fd` from this queue's idle wait.
    ///
    /// # Errors
    /// [`Error::Watch`](super::Error::Watch) if the fd is not watched by this queue.
    pub fn unwatch_fd(&self, fd: BorrowedFd<'_>) -> Result<()> {
        self.inner.engine.unwatch(fd)
    }

    /// Like [`wait`](Self::wait), and says why it returned: completions (moved into `out`), a
    /// readable watched fd, or the time-out.
    ///
    /// # Errors
    /// [`Error::Wait`](super::Error::Wait) if epoll fails.
    pub fn wait_any(&self, out: &mut [Completion], timeout: Option<Duration>) -> Result<Woken> {
        self.wait_any_with_spin(out, timeout, self.inner.spin.get())
    }

    /// [`wait_any`](Self::wait_any) with a chosen busy-poll spell.
    ///
    /// # Errors
    /// [`Error::Wait`](super::Error::Wait) if epoll fails.
    pub fn wait_any_with_spin(
        &self,
        out: &mut [Completion],
        timeout: Option<Duration>,
        spin: Duration,
    ) -> Result<Woken> {
        self.wait_watching(out, timeout, spin, &mut None)
    }

    /// [`wait_any`](Self::wait_any) that also returns [`Woken::Fd(token)`](Woken::Fd) once `fd`
    /// is readable, watching it for this call only ([`watch_fd`](Self::watch_fd), then
    /// [`unwatch_fd`](Self::unwatch_fd)): and only if no completion is there at once, so that a
    /// caller busy with completions pays no `epoll_ctl` for it (two system calls per wait).
    ///
    /// # Errors
    /// [`Error::Wait`](super::Error::Wait) if epoll fails; [`Error::Watch`](super::Error::Watch)
    /// if `fd` is watched already or cannot be polled.
    pub fn wait_any_or(
        &self,
        out: &mut [Completion],
        timeout: Option<Duration>,
        fd: BorrowedFd<'_>,
        token: u64,
    ) -> Result<Woken> {
        let mut lazy = Some((fd, token));
        let r = self.wait_watching(out, timeout, self.inner.spin.get(), &mut lazy);
        if lazy.is_some() {
            // Completions came at once: never watched.
            return r;
        }
        let u = self.unwatch_fd(fd);
        r.and_then(|w| u.map(|()| w))
    }

    /// The wait of [`wait_any_with_spin`](Self::wait_any_with_spin); `lazy`, an fd to watch
    /// (with its token) from the first pass that finds no completion on, is taken once it is.
    fn wait_watching(
        &self,
        out: &mut [Completion],
        timeout: Option<Duration>,
        spin: Duration,
        lazy: &mut Option<(BorrowedFd<'_>, u64)>,
    ) -> Result<Woken> {
        let start = Instant::now();
        let deadline = timeout.map(|t| start + t);
        let mut last_activity = start;
        let mut turn = 0u32;
        loop {
            let (n, answered) = self.poll_traffic(out)?;
            if n > 0 {
                return Ok(Woken::Completions(n));
            }
            if let Some((fd, token)) = *lazy {
                self.watch_fd(fd, token)?;
                *lazy = None;
            }
            let now = Instant::now();
            if deadline.is_some_and(|d| now >= d) {
                return Ok(Woken::TimedOut);
            }
            // A peer's request answered here is activity too: a target answering Reads and
            // Flushes completes nothing, and a spell counted from the wait's start went to sleep
            // in the middle of its client's stream, every spell (docs/benchmarks.md, "A spell
            // counted from the last message"). Writes alone are not: nobody waits on them.
            if answered {
                last_activity = now;
            }
            if now.duration_since(last_activity) < spin {
                // A watched fd (a flusher's completion) is answered as it comes, not after
                // the spell: a GPSPM flush on page-cache waited out the spell (up to
                // MAX_IDLE_SPIN) on top of its fdatasync. Every WATCHED_EVERY turns.
                if turn.is_multiple_of(WATCHED_EVERY) {
                    if let Some(token) = self.inner.engine.watched_ready()? {
                        return Ok(Woken::Fd(token));
                    }
                }
                // The spell is the caller's to spend, not the machine's: a thread that is
                // ready to run on this CPU (the client this loop serves, the process that
                // answers it) runs first, as often as yielding finds one (SpinYield).
                turn = turn.wrapping_add(1);
                self.inner.yielder.turn(turn);
                continue;
            }
            // Idle: block until a socket is ready (arming writability where output waits), or
            // the completion channel fires (rdma: armed, then polled once more, so that a
            // completion that came just before the arming is not slept through). Not while a
            // queue pair holds input buffered that the last pass left (soft: a batch of answers
            // went out first), which no fd would announce.
            if self.inner.engine.arm()? || !self.inner.list.is_empty() {
                continue;
            }
            let left = deadline.map(|d| d.saturating_duration_since(now));
            self.inner.blocked.fetch_add(1, Ordering::Relaxed);
            let ready = self.inner.engine.block(left)?;
            if let Some(token) = ready.user {
                return Ok(Woken::Fd(token));
            }
            if ready.any {
                last_activity = Instant::now();
                self.inner
                    .spin
                    .after_sleep(Some(last_activity.duration_since(now)));
            } else {
                self.inner.spin.after_sleep(None);
            }
        }
    }
}

/// Why [`CompletionQueue::wait_any`] returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Woken {
    /// This many completions were moved into the caller's slice (at least one).
    Completions(usize),
    /// A watched fd is readable: the token given to
    /// [`watch_fd`](CompletionQueue::watch_fd). Others may be readable too (the next wait
    /// reports them at once).
    Fd(u64),
    /// The time-out passed with nothing to report.
    TimedOut,
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: Duration = Duration::from_micros(1);

    #[test]
    fn the_spell_yields_less_often_while_yields_return_at_once_and_every_turn_once_one_did_not() {
        let y = SpinYield::new();
        let every = |y: &SpinYield| y.every.load(Ordering::Relaxed);
        assert_eq!(every(&y), 1);
        for want in [2, 4, 8, 16, 16] {
            y.learn(Duration::from_nanos(300));
            assert_eq!(every(&y), want);
        }
        // A yield that gave the CPU away: back to every turn.
        y.learn(YIELD_RAN_OTHERS);
        assert_eq!(every(&y), 1);
        // turn() yields only on every `every`th turn: off-turns learn nothing.
        y.learn(Duration::ZERO);
        assert_eq!(every(&y), 2);
        y.turn(1);
        assert_eq!(every(&y), 2);
    }

    #[test]
    fn the_spin_grows_to_cover_short_sleeps_and_shrinks_after_long_ones() {
        let s = IdleSpin::new();
        assert_eq!(s.get(), DEFAULT_IDLE_SPIN);
        // Woken 80 us after blocking: a 120 us spell would have caught it.
        s.after_sleep(Some(80 * US));
        assert_eq!(s.get(), 120 * US);
        // A shorter sleep does not shrink it; one past the cap does not grow it past the cap.
        s.after_sleep(Some(10 * US));
        assert_eq!(s.get(), 120 * US);
        s.after_sleep(Some(190 * US));
        assert_eq!(s.get(), MAX_IDLE_SPIN);
        // Long sleeps and time-outs take it back down, never below the default.
        s.after_sleep(Some(Duration::from_millis(5)));
        assert_eq!(s.get(), 150 * US);
        for _ in 0..20 {
            s.after_sleep(None);
        }
        assert_eq!(s.get(), DEFAULT_IDLE_SPIN);
    }
}
