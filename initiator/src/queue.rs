//! The data path: a [`Connection`] (where and who) opens [`Queue`]s; a queue is one connected
//! queue pair with its registered bounce buffers, driven by the calling thread only.
//!
//! Each queue is its own transport connection and session (the target admits every
//! connection on its own: queue ids above 0 get a controller id of their own, with the same
//! host and subsystem). Use one queue per thread.
//!
//! Reconnect: when the connection breaks (a queue pair in Error, a Disconnect, a lapsed
//! keep-alive, a target that stopped answering) the next call reconnects with capped
//! exponential backoff for up to [`ReconnectPolicy::timeout`] (60 s by default: long enough
//! for a target restart that allocates large namespaces), re-issues every write not yet
//! acknowledged as durable (in post order) and then re-runs the interrupted call. Reads and
//! persists are re-run; an atomic is not (it may have executed): it fails with the loss, and the
//! queue is usable again. When the policy runs out the call fails with
//! [`Error::ReconnectFailed`] and every later one with [`Error::Broken`].
//!
//! Dropping a queue (or closing it) says goodbye to the target with a Disconnect, so that the
//! target logs a closed session rather than a lost connection.

use std::time::{Duration, Instant};

use rpma_common::fabric::{Completion, QpState, SendOp, SendWr, WcStatus};
use rpma_common::proto::nqn::Nqn;
use rpma_common::proto::{FlushStatus, Message, NamespaceDescriptor};

use crate::connect::{connect, ConnectOptions, HostIdentity};
use crate::durability::{choose, Choice, PersistMethod};
use crate::error::{Error, Result};
use crate::namespace::Namespace;
use crate::pool::{Pool, Slot, WriteRec};
use crate::session::Session;
use rpma_common::proto::msgbuf::CONTROL_BIT;

/// wr_id kinds of the data path (bits 60-61; bits 62-63 are the session's).
const KIND_SHIFT: u32 = 60;
const KIND_WRITE: u64 = 1 << KIND_SHIFT;
const KIND_READ: u64 = 2 << KIND_SHIFT;
const KIND_SMALL: u64 = 3 << KIND_SHIFT;
const KIND_MASK: u64 = 3 << KIND_SHIFT;

/// How often the polling loops wake to run keep-alives when nothing completes.
const TICK: Duration = Duration::from_millis(100);

/// How a queue retries a lost connection: attempts spaced by a backoff that doubles from
/// `initial_backoff` up to `max_backoff`, for at most `timeout` after the loss was seen and at
/// most `max_attempts` attempts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReconnectPolicy {
    /// Attempts before giving up (0: never reconnect; `u32::MAX`, the default: only
    /// `timeout` limits them).
    pub max_attempts: u32,
    /// No attempt starts later than this after the loss was seen, and each attempt's connect
    /// deadline is cut to what is left of it (60 s by default: a target restart that
    /// allocates large namespaces takes seconds).
    pub timeout: Duration,
    /// The wait before the first attempt; doubled after each failure.
    pub initial_backoff: Duration,
    /// The longest wait between attempts.
    pub max_backoff: Duration,
}

impl Default for ReconnectPolicy {
    fn default() -> Self {
        ReconnectPolicy {
            max_attempts: u32::MAX,
            timeout: Duration::from_secs(60),
            initial_backoff: Duration::from_millis(50),
            max_backoff: Duration::from_secs(2),
        }
    }
}

impl ReconnectPolicy {
    /// The default backoff, trying for `timeout` (zero: never reconnect).
    pub fn within(timeout: Duration) -> ReconnectPolicy {
        ReconnectPolicy {
            timeout,
            ..ReconnectPolicy::default()
        }
    }

    /// Never reconnect: a lost connection fails the call at once.
    pub fn never() -> ReconnectPolicy {
        ReconnectPolicy {
            max_attempts: 0,
            timeout: Duration::ZERO,
            ..ReconnectPolicy::default()
        }
    }

    /// The wait before attempt `n` (1-based).
    pub fn backoff(&self, n: u32) -> Duration {
        let exp = n.saturating_sub(1).min(20);
        self.initial_backoff
            .saturating_mul(1u32 << exp)
            .min(self.max_backoff)
    }

    /// The waits before each attempt this policy allows when every attempt fails at once
    /// (attempts start while their wait ends within `timeout`).
    pub fn schedule(&self) -> Vec<Duration> {
        let mut at = Duration::ZERO;
        let mut out = Vec::new();
        for n in 1..=self.max_attempts {
            at = at.saturating_add(self.backoff(n));
            if at > self.timeout {
                break;
            }
            out.push(self.backoff(n));
        }
        out
    }
}

/// Counters of a queue, for tests and diagnostics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QueueStats {
    /// Write requests posted (re-issues after a reconnect included).
    pub writes_posted: u64,
    /// Read requests posted (APM and visibility Reads not included).
    pub reads_posted: u64,
    /// The most data requests (Writes and Reads) that were posted and not yet completed at
    /// once: 1 for a queue that never had more than one request in flight.
    pub max_in_flight: usize,
    /// Send-queue posts of the data path (each rings the doorbell once): a `write_durable`
    /// of one chunk with APM or FLUSH takes one (the Write and the Read or Flush together).
    pub doorbells: u64,
    /// Reconnects so far.
    pub reconnects: u32,
}

/// Sizes and policies of a queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueOptions {
    /// Registered bounce slots: the most requests in flight at once (and the most written
    /// chunks kept for a replay until they are durable). 1..=128.
    pub depth: usize,
    /// Bytes per slot: transfers are split into requests of at most this size. 4 KiB..=16 MiB,
    /// a multiple of 4096.
    pub chunk: usize,
    /// Force a durability method on every namespace (None: the best one offered).
    pub persist: Option<PersistMethod>,
    /// Reconnect behaviour.
    pub reconnect: ReconnectPolicy,
}

impl Default for QueueOptions {
    fn default() -> Self {
        QueueOptions {
            depth: 32,
            chunk: 256 << 10,
            persist: None,
            reconnect: ReconnectPolicy::default(),
        }
    }
}

impl QueueOptions {
    fn check(&self) -> Result<()> {
        if !(1..=128).contains(&self.depth) {
            return Err(Error::InvalidArgument(format!(
                "queue depth {} is not in 1..=128",
                self.depth
            )));
        }
        if !(4096..=16 << 20).contains(&self.chunk) || !self.chunk.is_multiple_of(4096) {
            return Err(Error::InvalidArgument(format!(
                "chunk {} is not a multiple of 4096 in 4 KiB..=16 MiB",
                self.chunk
            )));
        }
        Ok(())
    }
}

/// Where and who: a target URL, a subsystem, a host identity and options. Cheap to clone:
/// hand one to each thread and open a queue there.
#[derive(Debug, Clone)]
pub struct Connection {
    url: String,
    subsystem: Nqn,
    host: HostIdentity,
    options: ConnectOptions,
    queue: QueueOptions,
}

impl Connection {
    /// A connection to `subsystem` at `url` as `host`, with default options.
    pub fn new(url: &str, subsystem: Nqn, host: HostIdentity) -> Connection {
        Connection {
            url: url.to_owned(),
            subsystem,
            host,
            options: ConnectOptions::default(),
            queue: QueueOptions::default(),
        }
    }

    /// The same with these connect options (time-out, keep-alive, CRC).
    pub fn with_connect_options(mut self, o: ConnectOptions) -> Connection {
        self.options = o;
        self
    }

    /// The same with these queue options.
    pub fn with_queue_options(mut self, q: QueueOptions) -> Connection {
        self.queue = q;
        self
    }

    /// Opens queue `queue_id` (0 is the admin queue; it carries I/O too): connects, registers
    /// the bounce buffers and chooses each namespace's durability method.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for bad queue options, those of [`connect`], and
    /// [`Error::MethodNotValid`] when a forced method is not valid on some namespace (the
    /// check is per namespace: it is made again, and reported, when that namespace is used).
    pub fn open_queue(&self, queue_id: u16) -> Result<Queue> {
        self.queue.check()?;
        let session = self.connect_session(queue_id)?;
        let pool =
            Pool::new(session.pd(), self.queue.depth, self.queue.chunk).map_err(|source| {
                Error::Fabric {
                    op: "registering the bounce buffers",
                    source,
                }
            })?;
        let mut q = Queue {
            conn: self.clone(),
            queue_id,
            session: Some(session),
            pool,
            ns: Vec::new(),
            flush_answers: Vec::new(),
            reads_done: Vec::new(),
            small_done: None,
            next_small: 0,
            next_token: 0,
            reconnects: 0,
            writes_posted: 0,
            reads_posted: 0,
            doorbells: 0,
            broken: false,
        };
        q.ns = q.describe_all()?;
        Ok(q)
    }

    fn connect_session(&self, queue_id: u16) -> Result<Session> {
        self.connect_session_within(queue_id, self.options.timeout)
    }

    fn connect_session_within(&self, queue_id: u16, timeout: Duration) -> Result<Session> {
        let opts = ConnectOptions {
            queue_id,
            timeout,
            ..self.options.clone()
        };
        connect(&self.url, &self.subsystem, &self.host, &opts)
    }
}

/// A namespace as a queue knows it.
#[derive(Debug, Clone)]
pub(crate) struct NsState {
    pub(crate) desc: NamespaceDescriptor,
    /// The method for durable calls, or the error a forced one gave.
    pub(crate) choice: std::result::Result<Choice, (PersistMethod, String)>,
    pub(crate) forced: Option<PersistMethod>,
}

/// One connected queue pair and its registered buffers. Not shared between threads: open one
/// queue per thread from a [`Connection`].
pub struct Queue {
    conn: Connection,
    queue_id: u16,
    session: Option<Session>,
    pub(crate) pool: Pool,
    pub(crate) ns: Vec<NsState>,
    flush_answers: Vec<(u64, FlushStatus)>,
    pub(crate) reads_done: Vec<usize>,
    small_done: Option<(u64, WcStatus)>,
    next_small: u64,
    next_token: u64,
    reconnects: u32,
    writes_posted: u64,
    reads_posted: u64,
    doorbells: u64,
    broken: bool,
}

impl std::fmt::Debug for Queue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Queue")
            .field("url", &self.conn.url)
            .field("queue_id", &self.queue_id)
            .field("session", &self.session)
            .field("pool", &self.pool)
            .field("reconnects", &self.reconnects)
            .finish()
    }
}

impl Queue {
    /// The namespaces this host may reach, by nsid.
    pub fn namespaces(&self) -> Vec<NamespaceDescriptor> {
        self.ns.iter().map(|n| n.desc.clone()).collect()
    }

    /// A handle on namespace `nsid` for reads, writes, persists and atomics.
    ///
    /// # Errors
    /// [`Error::NoSuchNamespace`].
    pub fn namespace(&mut self, nsid: u32) -> Result<Namespace<'_>> {
        let idx = self
            .ns
            .iter()
            .position(|n| n.desc.nsid == nsid)
            .ok_or(Error::NoSuchNamespace { nsid })?;
        Ok(Namespace::new(self, idx))
    }

    /// How many times this queue reconnected.
    pub fn reconnects(&self) -> u32 {
        self.reconnects
    }

    /// Counters: requests posted, the most in flight at once, reconnects.
    pub fn stats(&self) -> QueueStats {
        QueueStats {
            writes_posted: self.writes_posted,
            reads_posted: self.reads_posted,
            max_in_flight: self.pool.max_in_flight(),
            doorbells: self.doorbells,
            reconnects: self.reconnects,
        }
    }

    /// The queue id this queue asked for.
    pub fn queue_id(&self) -> u16 {
        self.queue_id
    }

    /// The controller id of the current connection.
    pub fn controller_id(&self) -> Option<u16> {
        self.session.as_ref().map(Session::controller_id)
    }

    /// The options the queue was opened with.
    pub fn options(&self) -> &QueueOptions {
        &self.conn.queue
    }

    /// Runs keep-alives and reaps completions without blocking. Call it from an idle loop at
    /// least every half keep-alive period (every data call does it too).
    ///
    /// # Errors
    /// As the data calls: a lost connection is reconnected first.
    pub fn tick(&mut self) -> Result<()> {
        self.run(true, |q| q.pump(Duration::ZERO).map(|_| ()))
    }

    /// Disconnects (sends a Disconnect and waits, at most a second, until it is out). Writes
    /// not made durable are not persisted by this (persist them first if they must be).
    /// Dropping a queue does the same with a shorter wait.
    ///
    /// # Errors
    /// None that matter to a caller closing anyway: the connection is closed in every case.
    pub fn close(mut self) -> Result<()> {
        match self.session.take() {
            Some(s) => s.disconnect(Duration::from_secs(1)),
            None => Ok(()),
        }
    }

    // ---- engine ----

    pub(crate) fn options_timeout(&self) -> Duration {
        self.conn.options.timeout
    }

    fn describe_all(&self) -> Result<Vec<NsState>> {
        let s = self.session()?;
        let peer_flush = s.qp().info().peer_flush;
        let forced = self.conn.queue.persist;
        Ok(s.namespaces()
            .iter()
            .map(|d| NsState {
                desc: d.clone(),
                choice: choice_of(d, peer_flush, forced),
                forced,
            })
            .collect())
    }

    fn session(&self) -> Result<&Session> {
        self.session.as_ref().ok_or(Error::Broken)
    }

    pub(crate) fn peer_has(&self, f: impl Fn(&rpma_common::fabric::ConnInfo) -> bool) -> bool {
        self.session.as_ref().is_some_and(|s| f(&s.qp().info()))
    }

    pub(crate) fn set_forced(&mut self, idx: usize, m: Option<PersistMethod>) {
        let peer_flush = self.peer_has(|i| i.peer_flush);
        let n = &mut self.ns[idx];
        n.forced = m;
        n.choice = choice_of(&n.desc, peer_flush, m);
    }

    pub(crate) fn choice(&self, idx: usize) -> Result<Choice> {
        let n = &self.ns[idx];
        crate::namespace::check_healthy(&n.desc)?;
        n.choice.clone().map_err(|(method, offered)| {
            // Rebuild the error with its context (Error is not Clone).
            Error::MethodNotValid {
                nsid: n.desc.nsid,
                method,
                domain: n.desc.domain,
                offered,
            }
        })
    }

    /// The method for making a named range of namespace `idx` durable whoever wrote it
    /// ([`choose_for_range`](crate::durability::choose_for_range): never APM).
    pub(crate) fn range_choice(&self, idx: usize) -> Result<Choice> {
        let n = &self.ns[idx];
        crate::namespace::check_healthy(&n.desc)?;
        let peer_flush = self.peer_has(|i| i.peer_flush);
        crate::durability::choose_for_range(&n.desc, peer_flush, n.forced)
    }

    /// Runs `op`, reconnecting and re-running it after a connection loss (if `rerun`; else
    /// the loss is returned once the queue is connected again).
    pub(crate) fn run<T>(
        &mut self,
        rerun: bool,
        mut op: impl FnMut(&mut Self) -> Result<T>,
    ) -> Result<T> {
        if self.broken {
            return Err(Error::Broken);
        }
        // A target that admits and then drops every connection must not keep a call forever:
        // the policy's time budget starts at the first loss this call sees and covers reruns.
        let mut reruns = 0;
        let mut deadline = None;
        let budget = self.conn.queue.reconnect.timeout;
        loop {
            if self.needs_reconnect() {
                let d = *deadline.get_or_insert_with(|| Instant::now() + budget);
                self.reconnect(d)?;
            }
            match op(self) {
                Err(e) if retryable(&e) => {
                    let d = *deadline.get_or_insert_with(|| Instant::now() + budget);
                    self.reconnect(d)?;
                    reruns += 1;
                    if !rerun
                        || reruns > self.conn.queue.reconnect.max_attempts
                        || Instant::now() >= d
                    {
                        return Err(e);
                    }
                }
                r => return r,
            }
        }
    }

    fn needs_reconnect(&self) -> bool {
        match &self.session {
            Some(s) => s.qp().state() == QpState::Error,
            None => true,
        }
    }

    /// Reconnects with the policy's backoff; no attempt starts after `deadline`.
    fn reconnect(&mut self, deadline: Instant) -> Result<()> {
        let started = Instant::now();
        if let Some(s) = self.session.take() {
            drop(s);
        }
        let held = self.pool.on_connection_lost();
        self.flush_answers.clear();
        self.reads_done.clear();
        self.small_done = None;
        let policy = self.conn.queue.reconnect.clone();
        let mut last = None;
        let mut attempts = 0;
        for attempt in 1..=policy.max_attempts {
            let wait = policy.backoff(attempt);
            if Instant::now() + wait > deadline {
                break;
            }
            std::thread::sleep(wait);
            attempts = attempt;
            // Each attempt gets the connect deadline, cut to what is left of the budget.
            let left = deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(100));
            match self.try_reconnect(&held, self.conn.options.timeout.min(left)) {
                Ok(()) => {
                    self.reconnects += 1;
                    log::info!(
                        "queue {} reconnected to {} (attempt {attempt}), {} write(s) re-issued",
                        self.queue_id,
                        self.conn.url,
                        held.len()
                    );
                    return Ok(());
                }
                Err(e @ (Error::NamespaceChanged { .. } | Error::NamespaceFailed { .. })) => {
                    self.give_up();
                    return Err(e);
                }
                Err(e) => {
                    log::debug!("reconnect attempt {attempt} failed: {e}");
                    self.session = None;
                    last = Some(e);
                }
            }
        }
        self.give_up();
        Err(Error::ReconnectFailed {
            attempts,
            elapsed: started.elapsed(),
            last: Box::new(last.unwrap_or_else(|| Error::ConnectionLost {
                detail: "the reconnect policy allowed no attempt".into(),
            })),
        })
    }

    fn give_up(&mut self) {
        self.broken = true;
        self.session = None;
        self.pool.clear();
    }

    fn try_reconnect(&mut self, held: &[(usize, WriteRec)], timeout: Duration) -> Result<()> {
        let s = self.conn.connect_session_within(self.queue_id, timeout)?;
        let peer_flush = s.qp().info().peer_flush;
        for (idx, n) in self.ns.iter_mut().enumerate() {
            let nsid = n.desc.nsid;
            let Some(d) = s.namespace(nsid) else {
                return Err(Error::NamespaceChanged {
                    nsid,
                    what: "it is gone".into(),
                });
            };
            if d.size != n.desc.size || d.read_only != n.desc.read_only {
                return Err(Error::NamespaceChanged {
                    nsid,
                    what: format!(
                        "size {} -> {}, read-only {} -> {}",
                        n.desc.size, d.size, n.desc.read_only, d.read_only
                    ),
                });
            }
            // Held writes on a namespace that failed meanwhile can never be made durable:
            // re-issuing them would only be refused.
            if held.iter().any(|(_, w)| w.ns == idx) {
                crate::namespace::check_healthy(d)?;
            }
            n.desc = d.clone();
            n.choice = choice_of(d, peer_flush, n.forced);
        }
        self.pool.rebind(s.pd()).map_err(|source| Error::Fabric {
            op: "registering the bounce buffers",
            source,
        })?;
        self.session = Some(s);
        let wrs: Vec<SendWr> = held
            .iter()
            .map(|&(slot, w)| self.write_wr(slot, w))
            .collect();
        self.post_list(wrs)
    }

    /// The Write of what a slot holds (its bytes are in the slot already); the slot is marked
    /// in flight: post the request with [`post_list`](Self::post_list).
    pub(crate) fn write_wr(&mut self, slot: usize, w: WriteRec) -> SendWr {
        let d = &self.ns[w.ns].desc;
        let remote = rpma_common::fabric::RemoteAddr {
            addr: d.remote_addr + w.offset,
            rkey: d.rkey,
        };
        let wr = SendWr::new(
            KIND_WRITE | slot as u64,
            SendOp::Write {
                local: self.pool.sge(slot, w.len),
                remote,
            },
        );
        self.pool.set(slot, Slot::Writing(w));
        self.writes_posted += 1;
        wr
    }

    /// Posts `wrs` with one doorbell (nothing when empty). If the post is refused for another
    /// reason than a lost connection, the slots of its Writes are freed (nothing was posted).
    pub(crate) fn post_list(&mut self, wrs: Vec<SendWr>) -> Result<()> {
        if wrs.is_empty() {
            return Ok(());
        }
        let kinds: Vec<u64> = wrs.iter().map(|w| w.wr_id).collect();
        self.doorbells += 1;
        let s = self.session()?;
        let r = s.qp().post_send_list(wrs).map_err(|e| post_error(s, e));
        if let Err(e) = &r {
            if !e.is_connection_loss() {
                for id in kinds {
                    if id & KIND_MASK == KIND_WRITE {
                        self.pool.set((id & !KIND_MASK) as usize, Slot::Free);
                    }
                }
            }
        }
        r
    }

    /// Posts a Read of `len` bytes at `offset` of namespace `ns` into `slot`.
    pub(crate) fn post_read_slot(
        &mut self,
        slot: usize,
        ns: usize,
        offset: u64,
        len: usize,
        item: usize,
        at: usize,
    ) -> Result<()> {
        let d = &self.ns[ns].desc;
        let remote = rpma_common::fabric::RemoteAddr {
            addr: d.remote_addr + offset,
            rkey: d.rkey,
        };
        let wr = SendWr::new(
            KIND_READ | slot as u64,
            SendOp::Read {
                local: self.pool.sge(slot, len),
                remote,
            },
        );
        self.pool.set(slot, Slot::Reading { item, at, len });
        self.reads_posted += 1;
        self.doorbells += 1;
        let s = self.session()?;
        s.qp().post_send(wr).map_err(|e| post_error(s, e))
    }

    /// A free slot, waiting for in-flight requests, or making held writes durable when every
    /// slot holds one. None when a Read completed: copy it out ([`Queue::reads_done`]) first.
    pub(crate) fn free_slot(&mut self) -> Result<Option<usize>> {
        let deadline = Instant::now() + self.conn.options.timeout;
        loop {
            if let Some(s) = self.pool.take_free() {
                return Ok(Some(s));
            }
            if !self.reads_done.is_empty() {
                return Ok(None);
            }
            if self.pool.in_flight() == 0 {
                self.persist_held()?;
                continue;
            }
            self.pump_until(deadline, "a free request slot")?;
        }
    }

    /// Makes every held write durable (or visible, on volatile namespaces) to free their
    /// slots. A namespace whose forced method is not valid gets a visibility Read instead: this
    /// claims nothing to the caller, it only frees the slots.
    fn persist_held(&mut self) -> Result<()> {
        for idx in 0..self.ns.len() {
            // Only the span the held writes cover: the whole namespace would cost a persist of
            // all of it (a cache write-back of every line on dax).
            if let Some((start, end)) = self.pool.held_span(idx) {
                // The held writes are this queue's own: APM covers them.
                let choice = self.choice(idx).unwrap_or(Choice::VisibleOnly);
                self.persist_range(idx, start, end - start, choice)?;
            }
        }
        Ok(())
    }

    /// Waits until no posted Write or Read is outstanding.
    pub(crate) fn drain(&mut self) -> Result<()> {
        let deadline = Instant::now() + self.conn.options.timeout;
        while self.pool.in_flight() > 0 {
            self.pump_until(deadline, "data completions")?;
        }
        Ok(())
    }

    /// One wait on the completion queue (at most `TICK`, or `deadline`): dispatches what
    /// completed and returns, with a Timeout past `deadline`.
    pub(crate) fn pump_until(&mut self, deadline: Instant, what: &'static str) -> Result<()> {
        let now = Instant::now();
        if now >= deadline {
            return Err(Error::Timeout {
                what,
                after: self.conn.options.timeout,
            });
        }
        self.pump((deadline - now).min(TICK))?;
        Ok(())
    }

    /// Waits up to `timeout` for completions, dispatches them and runs the keep-alive.
    fn pump(&mut self, timeout: Duration) -> Result<usize> {
        let mut wcs = [Completion::EMPTY; 32];
        let s = self.session.as_mut().ok_or(Error::Broken)?;
        s.tick()?;
        let n = s
            .cq()
            .wait(&mut wcs, Some(timeout))
            .map_err(|source| Error::Fabric {
                op: "waiting for completions",
                source,
            })?;
        let mut first_err = None;
        for c in &wcs[..n] {
            if let Err(e) = self.dispatch(c) {
                first_err.get_or_insert(e);
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(n),
        }
    }

    fn dispatch(&mut self, c: &Completion) -> Result<()> {
        if c.wr_id & CONTROL_BIT != 0 {
            let s = self.session.as_mut().ok_or(Error::Broken)?;
            if let Some(Message::FlushResponse(r)) = s.handle(c)? {
                self.flush_answers.push((r.token, r.status));
            }
            return Ok(());
        }
        let slot = (c.wr_id & !KIND_MASK) as usize;
        match c.wr_id & KIND_MASK {
            KIND_WRITE => {
                if let Some(Slot::Writing(w)) = self.pool.get(slot) {
                    // Placed or not, the slot keeps the bytes until they are durable.
                    self.pool.set(slot, Slot::Held(w));
                    if c.status != WcStatus::Success {
                        return Err(self.failed(w.ns, "write", c.status));
                    }
                }
            }
            KIND_READ => {
                if let Some(Slot::Reading { item, at, len }) = self.pool.get(slot) {
                    if c.status == WcStatus::Success {
                        self.pool.set(slot, Slot::ReadDone { item, at, len });
                        self.reads_done.push(slot);
                    } else {
                        self.pool.set(slot, Slot::Free);
                        return Err(self.failed(usize::MAX, "read", c.status));
                    }
                }
            }
            KIND_SMALL => self.small_done = Some((c.wr_id, c.status)),
            _ => {}
        }
        Ok(())
    }

    /// The error for a failed data completion: a lost connection, or what the target refused.
    fn failed(&self, ns: usize, op: &'static str, status: WcStatus) -> Error {
        if matches!(status, WcStatus::WrFlush | WcStatus::RetryExceeded) {
            let detail = self
                .session
                .as_ref()
                .and_then(|s| s.qp().error())
                .unwrap_or_else(|| format!("{op} completed with {status:?}"));
            return Error::ConnectionLost { detail };
        }
        Error::Remote {
            nsid: self.ns.get(ns).map_or(0, |n| n.desc.nsid),
            op,
            status,
        }
    }

    /// Posts an 8-byte request (APM Read, atomic, Atomic Write, Flush) and waits for it.
    pub(crate) fn small_op(&mut self, ns: usize, what: &'static str, op: SendOp) -> Result<()> {
        let wr = self.small_wr(op);
        let wr_id = wr.wr_id;
        self.doorbells += 1;
        {
            let s = self.session()?;
            s.qp().post_send(wr).map_err(|e| post_error(s, e))?;
        }
        self.wait_small(ns, what, wr_id)
    }

    /// A small request with a fresh wr_id (post it, then [`wait_small`](Self::wait_small)).
    pub(crate) fn small_wr(&mut self, op: SendOp) -> SendWr {
        self.next_small += 1;
        let wr_id = KIND_SMALL | (self.next_small & !KIND_MASK & !CONTROL_BIT);
        self.small_done = None;
        SendWr::new(wr_id, op)
    }

    /// Waits for the small request `wr_id` to complete.
    pub(crate) fn wait_small(&mut self, ns: usize, what: &'static str, wr_id: u64) -> Result<()> {
        let deadline = Instant::now() + self.conn.options.timeout;
        loop {
            if let Some((id, status)) = self.small_done {
                if id == wr_id {
                    self.small_done = None;
                    if status == WcStatus::Success {
                        return Ok(());
                    }
                    return Err(self.failed(ns, what, status));
                }
            }
            self.pump_until(deadline, what)?;
        }
    }

    /// GPSPM: a FlushRequest for the range, and its answer.
    fn gpspm(&mut self, ns: usize, offset: u64, len: u64) -> Result<FlushStatus> {
        self.next_token += 1;
        let token = self.next_token;
        let req = rpma_common::proto::FlushRequest {
            nsid: self.ns[ns].desc.nsid,
            offset,
            length: len,
            token,
        };
        self.doorbells += 1;
        self.session
            .as_mut()
            .ok_or(Error::Broken)?
            .send_message(&Message::FlushRequest(req))?;
        let deadline = Instant::now() + self.conn.options.timeout;
        loop {
            if let Some(i) = self.flush_answers.iter().position(|a| a.0 == token) {
                return Ok(self.flush_answers.swap_remove(i).1);
            }
            self.pump_until(deadline, "flush response")?;
        }
    }

    pub(crate) fn sink_value(&self) -> Result<u64> {
        self.pool.sink_value().map_err(|source| Error::Fabric {
            op: "reading an atomic result",
            source,
        })
    }

    pub(crate) fn sink(&self) -> rpma_common::fabric::Sge {
        self.pool.sink_sge()
    }

    /// The send-queue request that makes the Writes posted before it durable (APM Read,
    /// FLUSH) or visible (a visibility Read) for `[offset, offset + len)` of namespace `ns`;
    /// None for GPSPM, which is a control message.
    pub(crate) fn persist_request(
        &self,
        ns: usize,
        offset: u64,
        len: u64,
        choice: Choice,
    ) -> Option<(&'static str, SendOp)> {
        use rpma_common::fabric::{FlushTarget, FlushType, RemoteAddr};
        let d = &self.ns[ns].desc;
        let at = offset.min(d.size.saturating_sub(8));
        let read = SendOp::Read {
            local: self.sink(),
            remote: RemoteAddr {
                addr: d.remote_addr + at,
                rkey: d.rkey,
            },
        };
        match choice {
            // A Read answers after every earlier Write was placed: they are visible.
            Choice::VisibleOnly => Some(("visibility read", read)),
            Choice::Method(PersistMethod::Apm) => Some(("APM read", read)),
            Choice::Method(PersistMethod::Flush) => {
                let target = if offset == 0 && len == d.size {
                    FlushTarget::Region { rkey: d.rkey }
                } else {
                    FlushTarget::Range {
                        remote: RemoteAddr {
                            addr: d.remote_addr + offset,
                            rkey: d.rkey,
                        },
                        len,
                    }
                };
                Some((
                    "flush",
                    SendOp::Flush {
                        target,
                        kind: FlushType::Persistent,
                    },
                ))
            }
            Choice::Method(PersistMethod::Gpspm) => None,
        }
    }

    /// After the request of [`persist_request`](Self::persist_request) completed: frees the
    /// held writes it covers and says what it achieved.
    pub(crate) fn persisted(
        &mut self,
        ns: usize,
        offset: u64,
        len: u64,
        choice: Choice,
    ) -> crate::Durability {
        use crate::Durability;
        match choice {
            Choice::Method(PersistMethod::Apm) => {
                // Everything placed on this queue pair before the Read is durable.
                self.pool.release_held(ns, 0, 0, true);
                Durability::Durable(PersistMethod::Apm)
            }
            Choice::Method(m) => {
                self.pool.release_held(ns, offset, offset + len, false);
                Durability::Durable(m)
            }
            Choice::VisibleOnly => {
                self.pool.release_held(ns, offset, offset + len, false);
                Durability::VisibleOnly
            }
        }
    }

    /// Makes `[offset, offset + len)` of namespace `ns` durable with `choice`, after every
    /// Write posted before; frees the held writes the acknowledgement covers. With APM that is
    /// only this queue's own Writes: callers that name a range for its own sake choose with
    /// [`range_choice`](Self::range_choice).
    pub(crate) fn persist_range(
        &mut self,
        ns: usize,
        offset: u64,
        len: u64,
        choice: Choice,
    ) -> Result<crate::Durability> {
        self.drain()?;
        if let Some((what, op)) = self.persist_request(ns, offset, len, choice) {
            self.small_op(ns, what, op)?;
            return Ok(self.persisted(ns, offset, len, choice));
        }
        let d = self.ns[ns].desc.clone();
        let whole = offset == 0 && len == d.size;
        let status = self.gpspm(
            ns,
            if whole { 0 } else { offset },
            if whole { 0 } else { len },
        )?;
        match status {
            FlushStatus::Durable => Ok(self.persisted(ns, offset, len, choice)),
            FlushStatus::VisibleOnly => Ok(self.persisted(ns, offset, len, Choice::VisibleOnly)),
            // The target is leaving: retry on the next connection.
            FlushStatus::Unavailable => Err(Error::Disconnected {
                reason: "the target answered a flush with Unavailable".into(),
            }),
            FlushStatus::NamespaceFailed => Err(Error::NamespaceFailed {
                nsid: d.nsid,
                reason: "the target answered a flush with NamespaceFailed".into(),
            }),
            status => Err(Error::NotDurable {
                nsid: d.nsid,
                status,
            }),
        }
    }
}

fn choice_of(
    d: &NamespaceDescriptor,
    peer_flush: bool,
    forced: Option<PersistMethod>,
) -> std::result::Result<Choice, (PersistMethod, String)> {
    choose(d, peer_flush, forced).map_err(|e| match e {
        Error::MethodNotValid {
            method, offered, ..
        } => (method, offered),
        other => (PersistMethod::Gpspm, other.to_string()),
    })
}

/// Posting fails locally; a queue pair in Error means the connection is gone.
fn post_error(s: &Session, e: rpma_common::fabric::Error) -> Error {
    if s.qp().state() == QpState::Error {
        return Error::ConnectionLost {
            detail: s.qp().error().unwrap_or_else(|| e.to_string()),
        };
    }
    match e {
        rpma_common::fabric::Error::PeerUnsupported { .. } => Error::Unsupported {
            op: "this operation (the peer did not advertise it)",
        },
        source => Error::Fabric {
            op: "posting a request",
            source,
        },
    }
}

fn retryable(e: &Error) -> bool {
    e.is_connection_loss()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_its_cap() {
        let p = ReconnectPolicy {
            max_attempts: 5,
            timeout: Duration::from_secs(60),
            initial_backoff: Duration::from_millis(10),
            max_backoff: Duration::from_millis(50),
        };
        let waits: Vec<u128> = (1..=5).map(|n| p.backoff(n).as_millis()).collect();
        assert_eq!(waits, vec![10, 20, 40, 50, 50]);
        assert_eq!(p.backoff(200), Duration::from_millis(50), "no overflow");
        assert_eq!(p.schedule().len(), 5, "the attempt limit");
        let p = ReconnectPolicy {
            max_attempts: u32::MAX,
            timeout: Duration::from_millis(200),
            ..p
        };
        // 10 + 20 + 40 + 50 + 50 = 170; the next would start at 220.
        assert_eq!(p.schedule().len(), 5, "the time limit");
        assert!(ReconnectPolicy::never().schedule().is_empty());
        assert!(ReconnectPolicy::within(Duration::ZERO)
            .schedule()
            .is_empty());
    }

    #[test]
    fn default_reconnect_covers_a_minute_with_capped_backoff() {
        let p = ReconnectPolicy::default();
        let waits = p.schedule();
        let total: Duration = waits.iter().sum();
        assert!(
            total > Duration::from_secs(55) && total <= Duration::from_secs(60),
            "{total:?}"
        );
        assert!(waits.iter().all(|w| *w <= Duration::from_secs(2)), "capped");
        assert_eq!(waits[0], Duration::from_millis(50));
        assert_eq!(
            ReconnectPolicy::within(Duration::from_secs(5)).timeout,
            Duration::from_secs(5)
        );
    }

    #[test]
    fn queue_options_are_checked() {
        let ok = QueueOptions::default();
        assert!(ok.check().is_ok());
        for bad in [
            QueueOptions {
                depth: 0,
                ..ok.clone()
            },
            QueueOptions {
                depth: 129,
                ..ok.clone()
            },
            QueueOptions {
                chunk: 1000,
                ..ok.clone()
            },
            QueueOptions {
                chunk: 32 << 20,
                ..ok.clone()
            },
        ] {
            assert!(
                matches!(bad.check(), Err(Error::InvalidArgument(_))),
                "{bad:?}"
            );
        }
        // And open_queue checks before connecting anywhere.
        let c = Connection::new(
            "tcp://127.0.0.1:9",
            "nqn.2026-11.io.rpma:x".parse().unwrap(),
            HostIdentity::new("nqn.2026-11.io.rpma:h".parse().unwrap()),
        )
        .with_queue_options(QueueOptions { depth: 0, ..ok });
        assert!(matches!(c.open_queue(1), Err(Error::InvalidArgument(_))));
    }

    #[test]
    fn a_queue_can_move_to_its_thread_and_a_connection_is_shared() {
        fn send<T: Send>() {}
        send::<Queue>();
        send::<Connection>();
    }

    #[test]
    fn wr_id_kinds_stay_clear_of_the_session_bits() {
        for k in [KIND_WRITE, KIND_READ, KIND_SMALL] {
            assert_eq!(k & CONTROL_BIT, 0);
            assert_eq!(k & rpma_common::proto::msgbuf::SEND_BIT, 0);
            assert_eq!(k & KIND_MASK, k);
        }
    }
}
