//! The GPSPM flush service's backend: makes namespace ranges durable without blocking the poll
//! loop that serves the connections, unless the loop asks it to (below).
//!
//! - `dax` / `dax (forced)` ranges: the pmem layer's persist (cache write-back + sfence), inline;
//!   it costs about as much as the Writes it follows and never waits for a device.
//! - `page-cache` ranges: a ranged `fdatasync` submitted through io_uring (`IORING_OP_FSYNC` with
//!   `IORING_FSYNC_DATASYNC` and an offset/length), which the kernel runs in its own workers.
//!   Why not `sync_file_range`: it neither writes the metadata that the first write into a
//!   fallocated (unwritten) extent needs, nor flushes the device's write cache, so it cannot make a
//!   range durable; a ranged fdatasync does both and writes back only the range asked for.
//!   A poll loop with nothing else to do (no other flush in flight, and one connection or
//!   only quiet others: `serve/poll_loop.rs`) asks for the sync inline instead
//!   ([`Flusher::submit_inline`]): the mapping's own ranged `msync(MS_SYNC)` in the loop's
//!   thread, with no hand-off to a kernel worker and back, which took a tenth to a third of a
//!   durable write's time at queue depth 1 on two CPUs (docs/benchmarks.md, "The loop's own sync when it has nothing else to do"). A sync that
//!   took over [`INLINE_SLOW`] (a slow or failing disk) turns that off for [`INLINE_BACKOFF`],
//!   so that a disk in trouble blocks a loop for one sync at most before its flushes are back
//!   on the workers.
//! - `volatile` ranges: answered [`FlushStatus::VisibleOnly`] at once.
//!
//! A failed write-back is never forgotten: Linux reports it once per open file and then marks
//! the pages clean, so a later fdatasync "succeeds" over lost data. The first failure (its call
//! and errno) is recorded in the namespace's store ([`Persist::record_failure`]), whichever
//! path saw it (this service's fdatasync or inline msync, or the placement engine's msync for
//! APM and FLUSH); from then on every flush of that namespace is answered
//! [`FlushStatus::NamespaceFailed`] without touching the file, until the namespace is reopened.
//!
//! If io_uring is unavailable (an old kernel, `kernel.io_uring_disabled`, a seccomp filter), a
//! single worker thread runs whole-file `fdatasync` calls instead, and that is logged once.
//!
//! Completions are reaped with [`Flusher::poll`], which never blocks; [`Flusher::wait_fd`] is an
//! eventfd that becomes readable when a device flush completes, for the poll loop's idle wait.
//! Inline completions (dax, volatile, bad ranges, inline syncs) do not signal it: poll after
//! submitting.
//!
//! Timings: the inline write-back and each page-cache sync (an fdatasync from submission to
//! completion; an inline sync, its own length, apart) are recorded in the histograms of the
//! loop's [`LoopStats`] ([`Flusher::set_stats`]); the flusher is their only writer.
//!
//! Threads: a [`Flusher`] belongs to one poll loop (`Send`, not shared). Cleanup: every file a
//! submitted flush refers to is kept open by the in-flight table until its completion is reaped.

use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::{Arc, Once};
use std::time::{Duration, Instant};

use rpma_common::pmem::{Persist, SyncFailure};
use rpma_common::proto::FlushStatus;
use rpma_common::stats::Stopwatch;

use crate::eventfd::EventFd;
use crate::metrics::LoopStats;

mod backend;
mod dax;
mod error;
mod flush_target;
use backend::Backend;
use dax::{persist_status, DaxQueue};
pub use error::{FlusherError, Result};
pub use flush_target::FlushTarget;
use flush_target::Kind;

/// An inline sync that takes longer than this turns inline syncs off for [`INLINE_BACKOFF`]: a
/// disk's sync takes tens of microseconds (an SSD) to a few milliseconds (a spike of a virtual
/// disk, a spinning one); one that takes longer holds its loop's keep-alives and next requests
/// back for as long, which the kernel's workers would not.
pub const INLINE_SLOW: Duration = Duration::from_millis(10);
/// How long inline syncs stay off after a slow one.
pub const INLINE_BACKOFF: Duration = Duration::from_secs(10);
/// A dax write-back longer than this is done this much per [`Flusher::poll`] (all such
/// write-backs together, in turn), not in one go: a host's flush of a whole namespace of some
/// GiB (about 0.1 s per GiB) held its poll loop, its other hosts' requests and keep-alives, and
/// the watchdog's heartbeat for as long (a helper's review). The fabric's own RDMA Flush takes
/// the same steps.
pub const DAX_STEP: u64 = 1 << 20;

/// A finished flush.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlushCompletion {
    /// The request's token.
    pub token: u64,
    /// What happened.
    pub status: FlushStatus,
}

struct InFlight {
    /// The flushes it answers: one, or those that waited for the file's last sync (merged).
    tokens: Vec<u64>,
    /// Keeps the file open until the kernel (or the worker) is done with it.
    fd: Arc<OwnedFd>,
    /// Where a failure of this fdatasync is recorded.
    store: Arc<dyn Persist>,
    /// The range it syncs (offset, length): [`Persist::after_sync`]'s once it returned 0.
    range: (u64, u64),
    /// When it was submitted.
    started: Stopwatch,
}

/// A flush of a file whose sync is in flight in this flusher, waiting for it.
struct Waiting {
    token: u64,
    store: Arc<dyn Persist>,
    /// Its range: `[start, end)`.
    start: u64,
    end: u64,
}

/// A flusher's syncs of one open file: at most one in flight at a time, and the flushes that
/// came meanwhile waiting to be synced together by the next. Linux reports a write-back error
/// once per open file, to whichever sync of it looks first: of two syncs of one file at once,
/// the one that returned 0 could be reaped and answered durable before the one that took the
/// report was reaped and its failure recorded (a kernel worker preempted between its check and
/// its completion). One at a time, the next starts only once the last one's answer is known.
#[derive(Default)]
struct FileSyncs {
    busy: bool,
    waiting: Vec<Waiting>,
}

/// The flush service of one poll loop.
pub struct Flusher {
    /// Which of a page-cache target's open files its syncs use: the daemon numbers its flush
    /// services 0, 1, ... and opens each page-cache namespace's file once for each
    /// ([`FlushTarget::for_mapping`]), so that no two loops sync through one open file.
    service: usize,
    backend: Backend,
    eventfd: Arc<EventFd>,
    slots: Vec<Option<InFlight>>,
    free: Vec<usize>,
    /// Per open file with a sync in flight (keyed by its address, kept alive by that sync):
    /// the flushes waiting for it ([`FileSyncs`]).
    files: HashMap<usize, FileSyncs>,
    /// How many flushes wait there.
    waiting: usize,
    /// The last poll's completions, reused.
    finished: Vec<(usize, i32)>,
    /// Dax write-backs longer than [`DAX_STEP`], served in turn.
    dax: DaxQueue,
    ready: VecDeque<FlushCompletion>,
    stats: Arc<LoopStats>,
    /// Inline syncs are off until then (a slow one was seen).
    inline_off_until: Option<Instant>,
    /// [`INLINE_SLOW`], or a test's.
    inline_slow: Duration,
    /// Syncs are in the ring's submission queue that `io_uring_enter` did not take (it failed:
    /// -EAGAIN, -EBUSY): they stay in flight, and the next [`poll`](Self::poll) submits them.
    unsubmitted: bool,
    /// Tests: the next submit fails after its push, as `io_uring_enter` may.
    #[cfg(test)]
    fail_next_submit: bool,
}

impl std::fmt::Debug for Flusher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Flusher")
            .field("backend", &self.backend_name())
            .field("in_flight", &self.in_flight())
            .finish()
    }
}

static FALLBACK_LOGGED: Once = Once::new();

impl Flusher {
    /// A flusher for up to `depth` concurrent device flushes: io_uring if the kernel allows it,
    /// else the worker thread (logged once per process). `service` is its number among the
    /// daemon's flush services: it syncs a page-cache namespace through that open file of it.
    ///
    /// # Errors
    /// [`FlusherError::EventFd`], [`FlusherError::Thread`].
    pub fn new(depth: u32, service: usize) -> Result<Self> {
        let depth = depth.clamp(1, 4096);
        let eventfd = Arc::new(EventFd::new().map_err(FlusherError::EventFd)?);
        let backend = match Backend::uring(depth, &eventfd) {
            Ok(ring) => ring,
            Err(e) => {
                FALLBACK_LOGGED.call_once(|| {
                    log::warn!(
                        "io_uring unavailable ({e}); page-cache flushes use a worker thread instead"
                    )
                });
                Backend::thread(Arc::clone(&eventfd))?
            }
        };
        Ok(Self::with_backend(backend, eventfd, depth, service))
    }

    /// A flusher that uses the worker thread even where io_uring works.
    ///
    /// # Errors
    /// [`FlusherError::EventFd`], [`FlusherError::Thread`].
    pub fn new_threaded(depth: u32, service: usize) -> Result<Self> {
        let eventfd = Arc::new(EventFd::new().map_err(FlusherError::EventFd)?);
        let backend = Backend::thread(Arc::clone(&eventfd))?;
        Ok(Self::with_backend(
            backend,
            eventfd,
            depth.clamp(1, 4096),
            service,
        ))
    }

    fn with_backend(backend: Backend, eventfd: Arc<EventFd>, depth: u32, service: usize) -> Self {
        Flusher {
            service,
            backend,
            eventfd,
            slots: (0..depth).map(|_| None).collect(),
            free: (0..depth as usize).rev().collect(),
            files: HashMap::new(),
            waiting: 0,
            finished: Vec::new(),
            dax: DaxQueue::default(),
            ready: VecDeque::new(),
            stats: Arc::default(),
            inline_off_until: None,
            inline_slow: INLINE_SLOW,
            unsubmitted: false,
            #[cfg(test)]
            fail_next_submit: false,
        }
    }

    /// Records the flush timings in `stats` (the poll loop's) from now on.
    pub fn set_stats(&mut self, stats: Arc<LoopStats>) {
        self.stats = stats;
    }

    /// "io_uring" or "thread".
    pub fn backend_name(&self) -> &'static str {
        self.backend.name()
    }

    /// Flushes submitted and not yet reaped: device flushes, and dax write-backs taken in
    /// steps ([`DAX_STEP`]).
    pub fn in_flight(&self) -> usize {
        self.slots.len() - self.free.len() + self.dax.len() + self.waiting
    }

    /// Drops the dax write-backs taken in steps whose token `keep` refuses (their connection
    /// is gone: its host hears no answer, and replays what it did not hear): a host that asks
    /// for whole-namespace flushes and reconnects leaves no work behind. Returns how many.
    pub fn cancel_dax(&mut self, mut keep: impl FnMut(u64) -> bool) -> usize {
        self.dax.cancel(&mut keep)
    }

    /// Readable when a device flush may have completed; wait on it, then call [`Flusher::poll`].
    pub fn wait_fd(&self) -> BorrowedFd<'_> {
        self.eventfd.as_fd()
    }

    /// Starts making `[offset, offset + length)` of `target` durable (`length` 0: the whole
    /// namespace). Never blocks. Bad ranges and inline work complete at once with their status
    /// and are returned by the next [`Flusher::poll`].
    ///
    /// # Errors
    /// [`FlusherError::Full`] when `depth` device flushes are in flight (the caller answers
    /// [`FlushStatus::Unavailable`] or queues); [`FlusherError::Submit`] if io_uring refuses.
    pub fn submit(
        &mut self,
        token: u64,
        target: &FlushTarget,
        offset: u64,
        length: u64,
    ) -> Result<()> {
        self.submit_inner(token, target, offset, length, false)
    }

    /// As [`submit`](Self::submit), but a page-cache flush is made durable before this
    /// returns, in this thread, by the store's own persist (`msync(MS_SYNC)` of the range's
    /// pages: a ranged fdatasync, as an RDMA Flush on page-cache is served), unless inline
    /// syncs are off after a slow one ([`INLINE_SLOW`], [`INLINE_BACKOFF`]): then it is
    /// submitted as by `submit`. Its completion is returned by the next [`poll`](Self::poll)
    /// either way. It blocks the caller for the length of a disk flush: for a poll loop that
    /// has nothing else to do meanwhile.
    ///
    /// # Errors
    /// As [`submit`](Self::submit).
    pub fn submit_inline(
        &mut self,
        token: u64,
        target: &FlushTarget,
        offset: u64,
        length: u64,
    ) -> Result<()> {
        self.submit_inner(token, target, offset, length, true)
    }

    /// Whether [`submit_inline`](Self::submit_inline) syncs inline now (not off after a slow
    /// sync); clears an ended backoff.
    fn inline_on(&mut self) -> bool {
        match self.inline_off_until {
            Some(t) if Instant::now() < t => false,
            Some(_) => {
                self.inline_off_until = None;
                true
            }
            None => true,
        }
    }

    #[cfg(test)]
    fn set_inline_slow(&mut self, d: Duration) {
        self.inline_slow = d;
    }

    fn submit_inner(
        &mut self,
        token: u64,
        target: &FlushTarget,
        offset: u64,
        length: u64,
        inline: bool,
    ) -> Result<()> {
        let (offset, length) = if length == 0 {
            (0, target.len)
        } else {
            (offset, length)
        };
        if offset
            .checked_add(length)
            .is_none_or(|end| end > target.len)
        {
            self.ready.push_back(FlushCompletion {
                token,
                status: FlushStatus::OutOfRange,
            });
            return Ok(());
        }
        if target.failure().is_some() {
            self.ready.push_back(FlushCompletion {
                token,
                status: FlushStatus::NamespaceFailed,
            });
            return Ok(());
        }
        let (fd, store) = match &target.kind {
            Kind::Volatile => {
                self.ready.push_back(FlushCompletion {
                    token,
                    status: FlushStatus::VisibleOnly,
                });
                return Ok(());
            }
            Kind::Dax(p) if length > DAX_STEP => {
                self.dax.start(token, p.clone(), offset, length);
                // The loop's wait wakes at once, and its poll takes the first step.
                self.eventfd.signal();
                return Ok(());
            }
            Kind::Dax(p) => {
                // The range was checked against the namespace's length above, which fits usize.
                let sw = Stopwatch::start();
                let done = p.persist(offset as usize, length as usize);
                self.stats.gpspm_writeback.record_since(sw);
                let status = persist_status(done);
                self.ready.push_back(FlushCompletion { token, status });
                return Ok(());
            }
            Kind::PageCache(_, store) if inline && self.inline_on() => {
                // The store's own persist: msync(MS_SYNC) of the range's pages, which the
                // kernel runs as a ranged fdatasync (vfs_fsync_range) in this thread; a failure
                // is recorded in the store as the worker's would be.
                let t0 = Instant::now();
                let done = store.persist(offset as usize, length as usize);
                let took = t0.elapsed();
                self.stats
                    .gpspm_msync
                    .record(u64::try_from(took.as_nanos()).unwrap_or(u64::MAX));
                if took > self.inline_slow {
                    log::info!(
                        "an inline page-cache sync took {} us: flushes go to the kernel's \
                         workers for the next {} s",
                        took.as_micros(),
                        INLINE_BACKOFF.as_secs()
                    );
                    self.inline_off_until = Some(Instant::now() + INLINE_BACKOFF);
                }
                let status = persist_status(done);
                self.ready.push_back(FlushCompletion { token, status });
                return Ok(());
            }
            Kind::PageCache(fds, store) => {
                // Prepared for the daemon's flush services (every one of its flushers has a
                // file of its own); a target prepared for fewer (a test's) is shared in turn.
                debug_assert!(
                    fds.len() == 1 || self.service < fds.len(),
                    "flush service {} of a target prepared for {}",
                    self.service,
                    fds.len()
                );
                (fds[self.service % fds.len()].clone(), store.clone())
            }
        };
        // The store's own checks first (its range, a page-cache file's size); the
        // power-loss simulation copies the range to its media once the sync returned 0
        // ([`Persist::after_sync`]).
        if let Err(e) = store.before_sync(offset as usize, length as usize) {
            let status = match e {
                rpma_common::pmem::Error::Failed { .. } => FlushStatus::NamespaceFailed,
                _ => FlushStatus::IoError,
            };
            self.ready.push_back(FlushCompletion { token, status });
            return Ok(());
        }
        let file = self.files.entry(file_key(&fd)).or_default();
        if file.busy {
            // Synced with the others that wait, by the next sync of the file.
            file.waiting.push(Waiting {
                token,
                store,
                start: offset,
                end: offset + length,
            });
            self.waiting += 1;
            return Ok(());
        }
        self.start_sync(vec![token], fd, store, (offset, length))
    }

    /// Hands the sync of `range` of `fd` answering `tokens` to the backend.
    ///
    /// # Errors
    /// [`FlusherError::Full`] with no slot free; those of the backend's push.
    fn start_sync(
        &mut self,
        tokens: Vec<u64>,
        fd: Arc<OwnedFd>,
        store: Arc<dyn Persist>,
        range: (u64, u64),
    ) -> Result<()> {
        let Some(slot) = self.free.pop() else {
            return Err(FlusherError::Full(self.slots.len()));
        };
        let started = Stopwatch::start();
        #[cfg(test)]
        let fail = std::mem::take(&mut self.fail_next_submit);
        #[cfg(not(test))]
        let fail = false;
        let depth = self.slots.len();
        let eventfd = &self.eventfd;
        let submitted = self
            .backend
            .push(slot, &fd, range, depth, fail)
            .map(|taken| {
                if !taken {
                    // The next poll submits it: the loop's wait must not sleep before it.
                    self.unsubmitted = true;
                    eventfd.signal();
                }
            });
        match submitted {
            Ok(()) => {
                self.files.entry(file_key(&fd)).or_default().busy = true;
                self.slots[slot] = Some(InFlight {
                    tokens,
                    fd,
                    store,
                    range,
                    started,
                });
                Ok(())
            }
            Err(e) => {
                self.free.push(slot);
                let key = file_key(&fd);
                if self
                    .files
                    .get(&key)
                    .is_some_and(|f| !f.busy && f.waiting.is_empty())
                {
                    self.files.remove(&key);
                }
                Err(e)
            }
        }
    }

    /// Clears [`wait_fd`](Self::wait_fd): for a waiter it woke while nothing was in flight (a
    /// completion's signal can land just after [`poll`](Self::poll) reaped it).
    pub fn clear_wake(&self) {
        self.eventfd.clear();
    }

    /// Appends every finished flush to `out` without blocking; returns how many were appended.
    /// With nothing in flight it makes no system call (and leaves [`wait_fd`](Self::wait_fd)
    /// alone: see [`clear_wake`](Self::clear_wake)).
    pub fn poll(&mut self, out: &mut Vec<FlushCompletion>) -> usize {
        let before = out.len();
        out.extend(self.ready.drain(..));
        if self.in_flight() == 0 {
            // Nothing can complete: no system call on a poll loop's turn without device flushes.
            return out.len() - before;
        }
        // Clear the eventfd before reaping so that a completion arriving meanwhile re-arms it.
        self.eventfd.clear();
        if !self.dax.is_empty() {
            self.dax_steps(out);
            if !self.dax.is_empty() {
                // More steps: the loop's wait must not sleep on them.
                self.eventfd.signal();
            }
        }
        let mut finished = std::mem::take(&mut self.finished);
        self.unsubmitted = self.backend.reap(self.unsubmitted, &mut finished);
        // Every failure of the batch is recorded before any answer is decided: of two syncs of
        // one file (two openings of it, a reload's old and new), the one that returned 0 beside
        // the one that took the error report must not be answered durable for being reaped
        // first.
        for &(slot, res) in &finished {
            if let (true, Some(Some(f))) = (res < 0, self.slots.get(slot)) {
                let e = std::io::Error::from_raw_os_error(-res);
                f.store.record_failure(SyncFailure::new("fdatasync", &e));
            }
        }
        for (slot, res) in finished.drain(..) {
            let Some(f) = self.slots.get_mut(slot).and_then(Option::take) else {
                continue;
            };
            self.free.push(slot);
            self.stats.gpspm_fdatasync.record_since(f.started);
            let mut status = sync_status(res, &*f.store);
            if status == FlushStatus::Durable {
                // Within the namespace's length (checked at submit), which fits usize.
                let (offset, len) = (f.range.0 as usize, f.range.1 as usize);
                if let Err(e) = f.store.after_sync(offset, len) {
                    status = persist_status(Err(e));
                }
            }
            out.extend(
                f.tokens
                    .iter()
                    .map(|&token| FlushCompletion { token, status }),
            );
            self.next_sync(f.fd, out);
        }
        self.finished = finished;
        out.len() - before
    }

    /// The sync of `fd` was reaped: the flushes that waited for it are synced together by one
    /// sync of the span of their ranges (answered at once as failed if the namespace has
    /// failed meanwhile: no sync can vouch for them).
    fn next_sync(&mut self, fd: Arc<OwnedFd>, out: &mut Vec<FlushCompletion>) {
        let key = file_key(&fd);
        let Some(file) = self.files.get_mut(&key) else {
            return;
        };
        file.busy = false;
        let waiting = std::mem::take(&mut file.waiting);
        self.files.remove(&key);
        let Some(first) = waiting.first() else {
            return;
        };
        self.waiting -= waiting.len();
        let store = Arc::clone(&first.store);
        let tokens: Vec<u64> = waiting.iter().map(|w| w.token).collect();
        if store.failure().is_some() {
            out.extend(tokens.iter().map(|&token| FlushCompletion {
                token,
                status: FlushStatus::NamespaceFailed,
            }));
            return;
        }
        let start = waiting.iter().map(|w| w.start).min().unwrap_or(0);
        let end = waiting.iter().map(|w| w.end).max().unwrap_or(0);
        // A slot is free: the reaped sync's.
        if let Err(e) = self.start_sync(tokens.clone(), fd, store, (start, end - start)) {
            log::error!("flusher: the sync of flushes that waited could not start: {e}");
            out.extend(tokens.iter().map(|&token| FlushCompletion {
                token,
                status: FlushStatus::Unavailable,
            }));
        }
    }

    /// Takes [`DAX_STEP`] bytes of the dax write-backs in turn, answering those done.
    fn dax_steps(&mut self, out: &mut Vec<FlushCompletion>) {
        self.dax.steps(DAX_STEP, |token, status, spent| {
            self.stats.gpspm_writeback.record(spent);
            out.push(FlushCompletion { token, status });
        });
    }

    /// Blocks until every sync in flight completed and was reaped, dropping the answers (their
    /// connections are gone), and returns how many there were: before a loop ends. A write-back
    /// error one of them reports is recorded as it is reaped (and so written to the state
    /// file); a sync left unreaped took the file's one report of it with it, and the next start
    /// served the lost pages as healthy.
    pub fn finish_all(&mut self) -> usize {
        // A dax write-back taken in steps reports nothing the kernel would not tell again:
        // dropped, not finished, for connections gone.
        self.cancel_dax(|_| false);
        let n = self.in_flight();
        if n > 0 {
            log::info!("waiting for {n} sync(s) of connections gone: a write-back error they report is remembered");
            let mut out = Vec::new();
            self.drain(&mut out);
        }
        n
    }

    /// Blocks until every submitted flush has completed, appending them to `out` (shutdown:
    /// answer what is in flight before exiting).
    pub fn drain(&mut self, out: &mut Vec<FlushCompletion>) {
        loop {
            self.poll(out);
            if self.in_flight() == 0 {
                return;
            }
            let mut pfd = libc::pollfd {
                fd: self.eventfd.as_fd().as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one live pollfd; a 100 ms timeout bounds the wait even if a wake-up is lost.
            unsafe { libc::poll(&mut pfd, 1, 100) };
        }
    }
}

/// The key of an open file in [`Flusher::files`]: its address, which its sync in flight keeps.
fn file_key(fd: &Arc<OwnedFd>) -> usize {
    Arc::as_ptr(fd) as usize
}

/// The answer to a flush whose fdatasync returned `res` (0, or -errno), a failure recorded in
/// `store`.
fn sync_status(res: i32, store: &dyn Persist) -> FlushStatus {
    if res < 0 {
        let e = std::io::Error::from_raw_os_error(-res);
        store.record_failure(SyncFailure::new("fdatasync", &e));
        FlushStatus::IoError
    } else if store.failure().is_some() {
        // Another sync of the file failed meanwhile and took the error report: this one's 0
        // proves nothing about the lost pages.
        FlushStatus::NamespaceFailed
    } else {
        FlushStatus::Durable
    }
}

#[cfg(test)]
mod tests;
