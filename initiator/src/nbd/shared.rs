//! What the client threads of an export share: the [`ExportOptions`], the queues (a
//! [`Cell`] each: one per client connection while it lasts, replaced after a loss), which of
//! them hold writes that await the next FLUSH, and the counters.

use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use log::{error, info, warn, Level};
use rpma_common::proto::NamespaceDescriptor;

use super::handshake::ExportInfo;
use super::ratelog::RateLog;
use super::slots::{Slot, Source};

mod flush;
use crate::{Connection, Error, Namespace, Queue};

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
    /// Queues to the target the export opens at most (each a session on the target, with its
    /// replay memory), its first one included. A connection takes one at its first request
    /// (none while it sends nothing); past this it shares one.
    pub max_queues: usize,
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
            max_queues: 16,
            log_period: Duration::from_secs(60),
        }
    }
}

/// Queues no client has that the export keeps open for the next clients
/// ([`Shared::close_spare`]).
pub(crate) const FREE_KEPT: usize = 2;

/// Spare queues closed per tick at most ([`Shared::close_spare`]).
const CLOSE_PER_TICK: usize = 4;

/// How long a thread that lets a queue go to the threads waiting for it waits for one of them
/// to take it ([`Cell::hand_over`]).
const HAND_OVER: Duration = Duration::from_millis(5);

/// Lines about one source per log period, for problems and for sessions each.
const LINES_PER_SOURCE: u32 = 5;
/// Lines about all sources per log period, for problems and for sessions each.
const LINES_IN_ALL: u32 = 50;

/// One queue of the export (one queue pair to the target) and what it holds.
///
/// A client connection takes a cell of its own at its first request ([`Shared::take`])
/// and gives it back when it leaves, so that the requests of several connections go to the
/// target on several queue pairs (and several target poll loops) at once. A cell's queue is
/// locked for a client's round of requests; the client releases it only once every request it
/// started on it completed, so that no one else ever sees its completions, and sooner when
/// another thread waits for it ([`Cell::wanted`]): a FLUSH on another connection, a client
/// that had to share it, the keep-alive.
#[derive(Debug)]
pub(crate) struct Cell {
    queue: Mutex<Option<Queue>>,
    /// The queue id it opens its queue with.
    qid: u16,
    /// Its queue's [`Queue::order_id`] (u64::MAX while it has none).
    order: AtomicU64,
    /// Writes were acknowledged on it and not yet made durable by a FLUSH.
    dirty: AtomicBool,
    /// Threads waiting for its lock.
    waiters: AtomicUsize,
    /// How many times a thread that waited for its lock got it ([`Cell::hand_over`]).
    taken: AtomicU64,
    /// The clients that have it (more than one only when a newcomer had to share it), or 1
    /// while [`Shared::close_spare`] looks at it.
    users: AtomicUsize,
}

impl Cell {
    fn new(qid: u16, q: Option<Queue>) -> Cell {
        Cell {
            order: AtomicU64::new(q.as_ref().map_or(u64::MAX, Queue::order_id)),
            queue: Mutex::new(q),
            qid,
            dirty: AtomicBool::new(false),
            waiters: AtomicUsize::new(0),
            taken: AtomicU64::new(0),
            users: AtomicUsize::new(0),
        }
    }

    /// Whether another thread waits for the queue: its holder should finish what it started
    /// and let go.
    pub(crate) fn wanted(&self) -> bool {
        self.waiters.load(Ordering::SeqCst) > 0
    }

    /// Lets `g`, its lock, go to the threads waiting for it, and waits until one of them took
    /// it (at most [`HAND_OVER`]): the lock is not fair, and a holder that locks it again at
    /// once (the next step of a long WRITE_ZEROES, its client's next batch) would take it back
    /// before a waiter woke, for as long as it had work.
    ///
    /// It watches the waiters' acquisitions, not their count: a thread whose `try_lock`
    /// barged in never counts as a waiter, and a newcomer that starts waiting meanwhile would
    /// keep the count up, so the count may not fall although a waiter got the lock.
    pub(crate) fn hand_over(&self, g: Held<'_>) {
        let taken = self.taken.load(Ordering::SeqCst);
        let waiting = self.waiters.load(Ordering::SeqCst);
        drop(g);
        if waiting == 0 {
            return;
        }
        let until = Instant::now() + HAND_OVER;
        while self.taken.load(Ordering::SeqCst) == taken && Instant::now() < until {
            std::thread::sleep(Duration::from_micros(20));
        }
    }

    /// Records that writes were acknowledged on it, or started on its queue (a started write
    /// may be answered in the call in which the queue gives up), for the next FLUSH and for
    /// counting a give-up as a loss.
    pub(crate) fn mark_dirty(&self) {
        self.dirty.store(true, Ordering::SeqCst);
    }

    /// Its writes were made durable (under its lock: see [`Shared::flush_all`]).
    fn mark_clean(&self) {
        self.dirty.store(false, Ordering::SeqCst);
    }

    /// Whether writes were acknowledged on it and not made durable yet.
    pub(crate) fn is_dirty(&self) -> bool {
        self.dirty.load(Ordering::SeqCst)
    }
}

/// A locked cell: its queue (None after a loss, until the next use opens a new one).
pub(crate) type Held<'a> = MutexGuard<'a, Option<Queue>>;

/// What the client threads share: the queues and the export.
#[derive(Debug)]
pub(crate) struct Shared {
    conn: Connection,
    /// Every queue of the export, given out to clients and back.
    cells: Mutex<Vec<Arc<Cell>>>,
    /// The queue id of the next queue opened.
    next_qid: AtomicU16,
    /// Queues being opened for a client now (outside the list's lock): they count toward
    /// `max_queues` already.
    opening: AtomicUsize,
    /// More than one queue was opened: requests may have to wait for another queue's writes
    /// to be placed ([`place_writes_of`](Self::place_writes_of)).
    pub(crate) several: AtomicBool,
    /// Large READs and WRITEs go through buffers of the connection's own, which its queue
    /// registers as it first uses each: on `tcp://`, where registering pins nothing. On
    /// `rdma://` each registration would pin memory against RLIMIT_MEMLOCK and could fail a
    /// request where the replay memory's registration did not: the copying way stays.
    pub(crate) in_place: bool,
    pub(crate) opts: ExportOptions,
    /// The namespace as the export found it at start-up: what its clients were told (size,
    /// block size, read-only). Its `identity` is the first file's: [`Shared::identity`] is
    /// the file served now.
    pub(crate) desc: NamespaceDescriptor,
    /// The identity of the file the export serves ([`NamespaceDescriptor::identity`]): the
    /// first queue's, then that of the file a later queue found in its place.
    identity: AtomicU64,
    /// A loss was counted for a queue that gave up on finding the namespace changed, and no
    /// queue opened since was checked: the change the next one finds is reported already.
    change_counted: AtomicBool,
    /// Queues are refused because the namespace no longer matches `desc` (the loss is
    /// counted once, not per refused queue).
    refusing: AtomicBool,
    pub(crate) info: ExportInfo,
    pub(crate) stopping: AtomicBool,
    /// Requests answered, over all clients.
    pub(crate) requests: AtomicU64,
    /// Queues given up (reconnect budget spent): each may have taken acknowledged writes that
    /// were not durable yet with it. Every connection's next FLUSH answers EIO once per loss.
    pub(crate) losses: AtomicU64,
    /// The most losses some client was told of: a FLUSH answered EIO for them, or a WRITE
    /// (FUA or not, WRITE_ZEROES too) answered with an error since ([`told`](Self::told); a
    /// READ's error says nothing of the writes before it). A connection starts from here as it
    /// enters transmission, so that a loss no client heard of (the connections open at the
    /// time were idle, and closed before any FLUSH) is reported by the first FLUSH of a later
    /// connection (a `nbd-client -persist` that reconnected): `CAN_MULTI_CONN` has a FLUSH
    /// cover the writes answered on every connection, the closed ones' too. One that was told
    /// (md, which failed its leg on the WRITE errors) starts afresh on its new connection; a
    /// connection already in transmission at the loss hears of it at its next FLUSH, whoever
    /// was told meanwhile.
    pub(crate) losses_reported: AtomicU64,
    /// Client-caused WARN and ERROR lines (failed handshakes, evictions, refusals, failed
    /// requests), rate-limited.
    pub(crate) problems: RateLog,
    /// Client-caused INFO lines (a client came, left, was idle too long), rate-limited.
    pub(crate) sessions: RateLog,
}

impl Shared {
    /// The state of an export of `desc` over `queue` (opened from `conn`, which opens the
    /// next ones: a queue per client connection, and one after a loss).
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
            next_qid: AtomicU16::new(queue.queue_id().wrapping_add(1)),
            opening: AtomicUsize::new(0),
            cells: Mutex::new(vec![Arc::new(Cell::new(queue.queue_id(), Some(queue)))]),
            several: AtomicBool::new(false),
            in_place: conn.registers_freely(),
            conn,
            opts,
            identity: AtomicU64::new(desc.identity),
            change_counted: AtomicBool::new(false),
            refusing: AtomicBool::new(false),
            desc,
            info,
            stopping: AtomicBool::new(false),
            requests: AtomicU64::new(0),
            losses: AtomicU64::new(0),
            losses_reported: AtomicU64::new(0),
        }
    }

    fn cells(&self) -> Vec<Arc<Cell>> {
        self.cells.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// A cell for a client at its first request: a free one, else a new queue (opened now, one
    /// connection attempt) while the export has fewer than `max_queues`, else (at the cap, or
    /// the target refused another connection, or is gone) the least busy one, shared. None if
    /// `slot` was evicted meanwhile: no queue is opened for a connection being closed. (With
    /// the reconnect budget's retries, a newcomer the target had no room for waited up to
    /// `--reconnect-timeout` before it was served, its thread and sockets held all along, and
    /// evicted meanwhile by the next newcomer, which did the same.)
    pub(crate) fn take(&self, slot: &Slot, source: Source) -> Option<Arc<Cell>> {
        {
            let cells = self.cells.lock().unwrap_or_else(|p| p.into_inner());
            let free = cells.iter().find(|c| {
                c.users
                    .compare_exchange(0, 1, Ordering::SeqCst, Ordering::SeqCst)
                    .is_ok()
            });
            if let Some(c) = free {
                return Some(Arc::clone(c));
            }
            if slot.evicted() {
                return None;
            }
            let max = self.opts.limits.max_queues.max(1);
            if cells.len() + self.opening.load(Ordering::SeqCst) >= max {
                return Some(Self::share(&cells));
            }
            self.opening.fetch_add(1, Ordering::SeqCst);
        }
        let qid = self.next_qid.fetch_add(1, Ordering::SeqCst);
        // Not under the list's lock: an attempt may take up to the connect time-out.
        let opened = self.conn.open_queue_once(qid).and_then(|q| self.checked(q));
        let mut cells = self.cells.lock().unwrap_or_else(|p| p.into_inner());
        self.opening.fetch_sub(1, Ordering::SeqCst);
        match opened {
            Ok(q) => {
                let c = Arc::new(Cell::new(qid, Some(q)));
                c.users.store(1, Ordering::SeqCst);
                cells.push(Arc::clone(&c));
                self.several.store(true, Ordering::SeqCst);
                Some(c)
            }
            Err(e) => {
                let c = Self::share(&cells);
                drop(cells);
                // Once per such newcomer: within the log limits of its source.
                self.problems.log(
                    Level::Warn,
                    source,
                    format_args!(
                        "nbd: cannot open another queue to the target ({}): this client shares \
                         one",
                        rpma_common::error_chain(&e)
                    ),
                );
                Some(c)
            }
        }
    }

    /// The least busy of `cells`, for one more client.
    fn share(cells: &[Arc<Cell>]) -> Arc<Cell> {
        let c = cells
            .iter()
            .min_by_key(|c| {
                (
                    c.users.load(Ordering::SeqCst),
                    c.waiters.load(Ordering::SeqCst),
                )
            })
            .expect("the export's first queue is never removed");
        c.users.fetch_add(1, Ordering::SeqCst);
        Arc::clone(c)
    }

    /// Gives a cell back when its client leaves (its held writes stay with it for the next
    /// FLUSH, of any connection).
    pub(crate) fn give_back(&self, cell: &Cell) {
        cell.users.fetch_sub(1, Ordering::SeqCst);
    }

    /// Closes the queues no client has beyond [`FREE_KEPT`] (the first queue is kept): each
    /// holds a session on the target, which counts against its connection budget and the
    /// host's, and a burst of clients left as many behind for good. A queue whose writes no
    /// FLUSH made durable yet stays until one did (it holds them for it), and so does one that
    /// some thread holds (a FLUSH or a placement, at work on it). Returns how many it closed.
    pub(crate) fn close_spare(&self) -> usize {
        let mut closing = Vec::new();
        {
            let mut cells = self.cells.lock().unwrap_or_else(|p| p.into_inner());
            let mut free = cells
                .iter()
                .filter(|c| c.users.load(Ordering::SeqCst) == 0)
                .count();
            let mut i = cells.len();
            // A few per tick: each goodbye may wait up to the connect time-out, and the
            // ticker runs the keep-alives of the queues in use too.
            while free > FREE_KEPT && i > 1 && closing.len() < CLOSE_PER_TICK {
                i -= 1;
                let c = &cells[i];
                // Claimed as a client would, so that no newcomer takes it meanwhile.
                if c.users
                    .compare_exchange(0, 1, Ordering::SeqCst, Ordering::SeqCst)
                    .is_err()
                {
                    continue;
                }
                let q = match c.queue.try_lock() {
                    Ok(mut g) if !c.is_dirty() => Some(g.take()),
                    _ => None,
                };
                match q {
                    Some(q) => {
                        // Nobody can find it now (its list entry is gone under the list's
                        // lock, and its order id matches no queue's).
                        c.order.store(u64::MAX, Ordering::SeqCst);
                        cells.remove(i);
                        closing.extend(q);
                        free -= 1;
                    }
                    None => {
                        c.users.store(0, Ordering::SeqCst);
                    }
                }
            }
        }
        let n = closing.len();
        for q in closing {
            // Not under the list's lock: a goodbye may take up to the connect time-out.
            let _ = q.close();
        }
        n
    }

    /// Locks `cell`'s queue, telling its holder that someone waits.
    pub(crate) fn lock<'c>(&self, cell: &'c Cell) -> Held<'c> {
        if let Ok(g) = cell.queue.try_lock() {
            return g;
        }
        cell.waiters.fetch_add(1, Ordering::SeqCst);
        let g = cell.queue.lock().unwrap_or_else(|p| p.into_inner());
        cell.taken.fetch_add(1, Ordering::SeqCst);
        cell.waiters.fetch_sub(1, Ordering::SeqCst);
        g
    }

    /// A WRITE (FUA or not, or WRITE_ZEROES) is answered with an error: its client hears that
    /// writes failed, and so of the losses so far ([`losses_reported`](Self::losses_reported)).
    pub(crate) fn told(&self) {
        let losses = self.losses.load(Ordering::SeqCst);
        self.losses_reported.fetch_max(losses, Ordering::SeqCst);
    }

    /// Runs `f` on the namespace through a locked cell. A queue that gave up (its reconnect
    /// budget spent) is replaced by a new one on the next call, with one connection attempt:
    /// while the target stays gone each request fails at once (EIO), instead of waiting out a
    /// reconnect budget of its own behind the cell's lock (a kernel client's requests, one
    /// after another, would take minutes to fail, and md above it would not fail the leg).
    pub(crate) fn with_ns<T>(
        &self,
        cell: &Cell,
        g: &mut Held<'_>,
        f: impl FnOnce(&mut Namespace<'_>) -> crate::Result<T>,
    ) -> crate::Result<T> {
        if g.is_none() {
            let q = self.checked(self.conn.open_queue_once(cell.qid)?)?;
            cell.order.store(q.order_id(), Ordering::SeqCst);
            info!("nbd: reconnected to the target with a new queue");
            **g = Some(q);
        }
        let Some(q) = g.as_mut() else {
            return Err(Error::Broken);
        };
        let r = q.namespace(self.opts.nsid).and_then(|mut ns| f(&mut ns));
        if let Err(e) = &r {
            self.check_lost(cell, g, e);
        }
        r
    }

    /// A queue opened after the export started (a replacement after a loss, a new client's),
    /// checked against what the export serves. Another file in the namespace's place (a
    /// restored file a reload or restart mapped: another identity) is a loss, counted as a
    /// queue that gave up is (the writes answered before, durable ones too, are not in it: the
    /// next FLUSH of every connection answers EIO once), and the export serves that file from
    /// then on. Another size, block size or mode than the clients were told, or no such
    /// namespace, is refused: the queue is closed and the request fails (a loss, counted
    /// once while the refusals last).
    ///
    /// # Errors
    /// [`Error::NamespaceChanged`] for a refused queue.
    fn checked(&self, q: Queue) -> crate::Result<Queue> {
        let nsid = self.opts.nsid;
        let found = q.namespaces().into_iter().find(|d| d.nsid == nsid);
        let want = &self.desc;
        let d = match found {
            Some(d)
                if d.size == want.size
                    && d.block_size == want.block_size
                    && d.read_only == want.read_only =>
            {
                d
            }
            other => {
                let what = other.map_or_else(
                    || "it is gone".to_owned(),
                    |d| {
                        format!(
                            "size {} -> {}, block size {} -> {}, read-only {} -> {}",
                            want.size,
                            d.size,
                            want.block_size,
                            d.block_size,
                            want.read_only,
                            d.read_only
                        )
                    },
                );
                let reported = self.change_counted.swap(false, Ordering::SeqCst);
                if !self.refusing.swap(true, Ordering::SeqCst) {
                    error!(
                        "nbd: namespace {nsid} is not what the export told its clients any more \
                         ({what}): refusing it, every request fails with EIO until it matches \
                         again or the export is restarted"
                    );
                    if !reported {
                        self.losses.fetch_add(1, Ordering::SeqCst);
                    }
                }
                let _ = q.close();
                return Err(Error::NamespaceChanged { nsid, what });
            }
        };
        self.refusing.store(false, Ordering::SeqCst);
        let reported = self.change_counted.swap(false, Ordering::SeqCst);
        let was = self.identity.swap(d.identity, Ordering::SeqCst);
        if was != d.identity {
            error!(
                "nbd: the target maps another file as namespace {nsid} now (identity {was:016x} \
                 -> {:016x}: a restored file moved into place?): writes answered before may not \
                 be in it, so the next FLUSH of every connection answers EIO; serving that file \
                 from now on",
                d.identity
            );
            if !reported {
                self.losses.fetch_add(1, Ordering::SeqCst);
            }
        }
        Ok(q)
    }

    /// Whether `e` from a locked cell's queue means that the queue gave up: its reconnect
    /// budget spent, or a reconnect found the namespace changed (another file, size or mode)
    /// or failed while it held writes. (A NamespaceFailed answer to a persist leaves the
    /// queue up: it still reads and writes.)
    fn gave_up(g: &Held<'_>, e: &Error) -> bool {
        matches!(e, Error::Broken | Error::ReconnectFailed { .. })
            || g.as_ref().is_some_and(Queue::is_broken)
    }

    /// After an error of a locked cell's queue: drops a queue that gave up, counting the loss
    /// if it held writes acknowledged and not made durable yet (`cell` dirty), or found the
    /// namespace changed; the next request opens a new one. (A clean queue that gave up, an idle
    /// export's while its target restarted for longer than the reconnect budget, counted a loss
    /// too: every connection's next FLUSH answered EIO over nothing lost, and ext4's journal or
    /// md above it took that for a failed disk.)
    pub(crate) fn check_lost(&self, cell: &Cell, g: &mut Held<'_>, e: &Error) {
        if !Self::gave_up(g, e) {
            return;
        }
        let changed = matches!(e, Error::NamespaceChanged { .. });
        if changed {
            self.change_counted.store(true, Ordering::SeqCst);
        }
        **g = None;
        if !changed && !cell.is_dirty() {
            warn!(
                "nbd: the queue to the target failed ({}); it held no write that was not durable \
                 yet: nothing is lost, the next request opens a new one",
                rpma_common::error_chain(e)
            );
            return;
        }
        error!(
            "nbd: the queue to the target failed ({}); writes acknowledged but not yet durable \
             may be lost: the next FLUSH of every connection answers EIO",
            rpma_common::error_chain(e)
        );
        self.losses.fetch_add(1, Ordering::SeqCst);
    }

    /// The most data requests a queue ever had in flight at once.
    pub(crate) fn max_in_flight(&self) -> usize {
        self.cells()
            .iter()
            .filter_map(|c| {
                c.queue
                    .try_lock()
                    .ok()?
                    .as_ref()
                    .map(|q| q.stats().max_in_flight)
            })
            .max()
            .unwrap_or(0)
    }

    /// Closes the spare queues ([`close_spare`](Self::close_spare)), then runs every idle
    /// queue's keep-alive (a queue in use keeps itself alive: never wait for it here).
    pub(super) fn tick(&self) {
        let closed = self.close_spare();
        if closed > 0 {
            log::debug!("nbd: closed {closed} queue(s) to the target no client had");
        }
        for cell in self.cells() {
            let Ok(mut g) = cell.queue.try_lock() else {
                continue;
            };
            if let Some(q) = g.as_mut() {
                if let Err(e) = q.tick() {
                    if Self::gave_up(&g, &e) {
                        self.check_lost(&cell, &mut g, &e);
                    } else {
                        warn!("nbd: keep-alive with the target failed: {e}");
                    }
                }
            }
        }
    }

    /// Closes every queue (at shutdown, after the final flush).
    pub(super) fn close_all(&self) {
        for cell in self.cells() {
            if let Some(q) = self.lock(&cell).take() {
                let _ = q.close();
            }
        }
    }
}
