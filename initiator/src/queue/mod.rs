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
//! acknowledged as durable (in post order) and then re-runs the interrupted call. A connection
//! given up while still up (it went silent) is retired first, so that nothing it still carries
//! lands after the re-issue (docs/initiator.md, "Reconnect"). Reads and
//! persists are re-run; an atomic is not (it may have executed): it fails with the loss, and the
//! queue is usable again. When the policy runs out the call fails with
//! [`Error::ReconnectFailed`] and every later one with [`Error::Broken`].
//!
//! Dropping a queue (or closing it) says goodbye to the target with a Disconnect, so that the
//! target logs a closed session rather than a lost connection.
//!
//! The queue's parts, each a type with one job, the arrows running one way (from this file
//! down):
//!
//! - `engine`: the [`Engine`], one connection's data path: the session, the bounce slots and
//!   the namespaces' addresses; posting, started requests, waiting for single requests,
//!   polling and dispatching completions (what a completion means: `completion`).
//! - `persist`: the [`Persister`], the durability method of each namespace and the requests
//!   that make ranges durable over the engine; it makes room when every slot holds a write.
//! - `reconnect`: [`Reconnect`], the way from a lost connection to a new one (retiring a silent
//!   one, the backoff, re-issuing held writes) or to giving up, and the budget of one call.
//! - at the bottom, plain data: `connection` (where and who, queue options, the reconnect
//!   policy) and `completion` (the kinds of wr_id, what a completion does to its slot, and
//!   what a started request is known by: [`Ticket`], [`Completed`]).
//!
//! [`Queue`] composes them: it runs each call under the reconnect policy and hands it to the
//! engine and the persister. The handle on one namespace, [`Queue::namespace`], lives in
//! namespace.rs and drives the queue through its methods only (the queue does not know the
//! handle).

use std::sync::Arc;
use std::time::Duration;

use rpma_common::fabric::{ConnInfo, SendOp, SendWr, Sge};
use rpma_common::proto::NamespaceDescriptor;

use crate::durability::{Choice, Durability, PersistMethod};
use crate::error::{Error, Result};
use crate::pool::Pool;
use crate::replay::Member;
use crate::writebuf::{Data, WriteBuf};

mod completion;
mod connection;
mod engine;
mod persist;
mod reconnect;

pub use completion::{Completed, Ticket};
pub use connection::{Connection, QueueOptions, ReconnectPolicy};
use engine::Engine;
use persist::Persister;
pub(crate) use reconnect::OnLoss;
use reconnect::{retryable, Reconnect};

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
    /// The most bytes of Reads that were posted and not yet completed at once (started Reads
    /// are bounded by [`QueueOptions::read_bytes_in_flight`]).
    pub max_read_bytes_in_flight: usize,
    /// Send-queue posts of the data path (each rings the doorbell once): a `write_durable`
    /// of one chunk with APM or FLUSH takes one (the Write and the Read or Flush together).
    pub doorbells: u64,
    /// Reconnects so far.
    pub reconnects: u32,
    /// Data completions that matched no request slot (each logged, rate-limited): 0 unless
    /// something is wrong.
    pub unmatched_completions: u64,
    /// Completion errors a poll did not return because an earlier one of the same poll was
    /// (each logged at debug level): after a loss, every other flushed request gives one.
    pub errors_not_returned: u64,
    /// Bytes of writes copied into the bounce buffers: all of a plain write's, none of a write
    /// from a [`WriteBuf`](crate::WriteBuf) (re-issues copy nothing either).
    pub bytes_copied: u64,
    /// Bytes of reads copied out of the bounce buffers into the caller's: all of a plain
    /// read's ([`Namespace::read_at`](crate::Namespace::read_at),
    /// [`take_read`](crate::Namespace::take_read)), none of a Read into a
    /// [`WriteBuf`](crate::WriteBuf) freed with [`finish_read`](crate::Namespace::finish_read).
    pub read_bytes_copied: u64,
}

/// One connected queue pair and its registered buffers. Not shared between threads: open one
/// queue per thread from a [`Connection`].
pub struct Queue {
    engine: Engine,
    persister: Persister,
    reconnect: Reconnect,
}

impl std::fmt::Debug for Queue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Queue")
            .field("url", &self.reconnect.connection().url)
            .field("queue_id", &self.reconnect.queue_id())
            .field("session", &self.engine.session_opt())
            .field("pool", self.engine.pool())
            .field("reconnects", &self.reconnect.reconnects())
            .finish()
    }
}

impl Connection {
    /// Opens queue `queue_id` (0 is the admin queue; it carries I/O too): connects, registers
    /// the bounce buffers and chooses each namespace's durability method. A first connection
    /// that fails in a way that may pass (the target not up yet, no room for this host at
    /// the moment) is retried within the queue's [`ReconnectPolicy`], as a lost one is
    /// ([`ReconnectPolicy::first_connection`]).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for bad queue options, those of [`connect`](crate::connect()) (the last
    /// attempt's), and [`Error::MethodNotValid`] when a forced method is not valid on some
    /// namespace (the check is per namespace: it is made again, and reported, when that
    /// namespace is used).
    pub fn open_queue(&self, queue_id: u16) -> Result<Queue> {
        self.queue.check()?;
        let session =
            self.queue
                .reconnect
                .first_connection(&self.url, self.options.timeout, |t| {
                    self.connect_session_within(queue_id, t)
                })?;
        self.queue_on(session, queue_id)
    }

    /// As [`open_queue`](Self::open_queue) with one connection attempt (within the
    /// connection's time-out), not retried: for a caller that answers clients of its own
    /// meanwhile and would rather fail their requests at once while the target stays gone
    /// (the NBD export, after a queue spent its reconnect budget).
    ///
    /// # Errors
    /// As [`open_queue`](Self::open_queue), from the one attempt.
    pub fn open_queue_once(&self, queue_id: u16) -> Result<Queue> {
        self.queue.check()?;
        let session = self.connect_session_within(queue_id, self.options.timeout)?;
        self.queue_on(session, queue_id)
    }

    /// The queue over a connected `session`: the bounce buffers registered, each namespace's
    /// method chosen.
    fn queue_on(&self, session: crate::session::Session, queue_id: u16) -> Result<Queue> {
        let nsids = session.namespaces().iter().map(|d| d.nsid).collect();
        let mut pool = Pool::new(
            session.pd(),
            self.queue.depth,
            self.queue.slots(),
            self.queue.chunk,
        )
        .map_err(|source| Error::Fabric {
            op: "registering the bounce buffers",
            source,
        })?;
        pool.join(Member::new(Arc::clone(&self.replay), nsids));
        let engine = Engine::new(session, pool, self.options.timeout)
            .with_read_bound(self.queue.read_bytes_in_flight);
        let persister = Persister::new(
            engine.descriptors(),
            engine.peer_has(|i| i.peer_flush),
            self.queue.persist,
        );
        Ok(Queue {
            engine,
            persister,
            reconnect: Reconnect::new(self.clone(), queue_id),
        })
    }
}

impl Queue {
    /// The namespaces this host may reach: those of the queue's first connection that the
    /// current one still lists (one a reload added since is seen by queues opened after it).
    pub fn namespaces(&self) -> Vec<NamespaceDescriptor> {
        let e = &self.engine;
        (0..e.descriptors().len())
            .filter(|&i| e.listed(i))
            .map(|i| e.descriptor(i).clone())
            .collect()
    }

    /// How many times this queue reconnected.
    pub fn reconnects(&self) -> u32 {
        self.reconnect.reconnects()
    }

    /// Whether the queue gave up (its reconnect budget spent, or a reconnect found a namespace
    /// it uses changed, or failed where it held writes): every call now fails with
    /// [`Error::Broken`](crate::Error::Broken).
    pub fn is_broken(&self) -> bool {
        self.reconnect.is_broken()
    }

    /// Counters: requests posted, the most in flight at once, reconnects.
    pub fn stats(&self) -> QueueStats {
        let c = self.engine.counters();
        QueueStats {
            writes_posted: c.writes_posted,
            reads_posted: c.reads_posted,
            max_in_flight: c.max_in_flight,
            max_read_bytes_in_flight: c.max_read_bytes_in_flight,
            doorbells: c.doorbells,
            reconnects: self.reconnect.reconnects(),
            unmatched_completions: c.unmatched_completions,
            errors_not_returned: c.errors_not_returned,
            bytes_copied: c.bytes_copied,
            read_bytes_copied: c.read_bytes_copied,
        }
    }

    /// The queue id this queue asked for.
    pub fn queue_id(&self) -> u16 {
        self.reconnect.queue_id()
    }

    /// This queue's number among the queues opened from its [`Connection`] (and its clones):
    /// what [`Namespace::unplaced_writers`](crate::Namespace::unplaced_writers) names it
    /// by. It stays across reconnects.
    pub fn order_id(&self) -> u64 {
        self.engine.pool().order_id().unwrap_or(u64::MAX)
    }

    /// The controller id of the current connection.
    pub fn controller_id(&self) -> Option<u16> {
        self.engine.session_opt().map(|s| s.controller_id())
    }

    /// Whether the current connection's frames carry MPA CRC32c: `Some` on the `tcp`
    /// transport (CRC is on when either side asked for it: [`ConnectOptions::tcp`]), `None` on
    /// `rdma` (the NIC's link CRCs) and without a connection.
    ///
    /// [`ConnectOptions::tcp`]: crate::ConnectOptions::tcp
    pub fn crc(&self) -> Option<bool> {
        self.engine
            .session_opt()
            .and_then(|s| s.qp().info().tcp)
            .map(|t| t.crc)
    }

    /// The options the queue was opened with.
    pub fn options(&self) -> &QueueOptions {
        &self.reconnect.connection().queue
    }

    /// Runs keep-alives and reaps completions without blocking. Call it from an idle loop at
    /// least every half keep-alive period (every data call does it too).
    ///
    /// # Errors
    /// As the data calls: a lost connection is reconnected first.
    pub fn tick(&mut self) -> Result<()> {
        self.run(OnLoss::Rerun, |q| {
            q.engine.poll_completions(Duration::ZERO).map(|_| ())
        })
    }

    /// Disconnects (sends a Disconnect and waits, at most a second, until it is out). Writes
    /// not made durable are not persisted by this (persist them first if they must be).
    /// Dropping a queue does the same with a shorter wait.
    ///
    /// # Errors
    /// None that matter to a caller closing anyway: the connection is closed in every case.
    pub fn close(mut self) -> Result<()> {
        match self.engine.take_session() {
            Some(s) => s.disconnect(Duration::from_secs(1)),
            None => Ok(()),
        }
    }

    /// Posts the started requests not posted yet, waits until at least one started request
    /// completed and moves the completed ones into `out`. Returns at once, adding nothing, when
    /// no started request is outstanding.
    ///
    /// # Errors
    /// A time-out, or what the data calls return. After a lost connection (reported as an
    /// error; the queue reconnects) the started Reads that had not completed are void: start
    /// them again. Started Writes are re-issued by the reconnect and still complete (each
    /// reported once); completions already collected, and completed Reads' bytes, stay.
    pub fn wait_started(&mut self, out: &mut Vec<Completed>) -> Result<()> {
        self.run(OnLoss::ReconnectAndFail, |q| q.engine.wait_started(out))
    }

    /// [`wait_started`](Self::wait_started), but it also returns as soon as `input` (a socket,
    /// a pipe, an eventfd) is readable, true and adding nothing: a server can take in its
    /// client's next request while the earlier ones are in flight, instead of leaving it
    /// unread until one of them completes. False: completions were added, or none was
    /// outstanding. `input` is watched only during the call; the caller drains it (or stops
    /// passing it, at end of file: a readable fd returns at once every time).
    ///
    /// # Errors
    /// As [`wait_started`](Self::wait_started).
    pub fn wait_started_or(
        &mut self,
        out: &mut Vec<Completed>,
        input: std::os::fd::BorrowedFd<'_>,
    ) -> Result<bool> {
        self.run(OnLoss::ReconnectAndFail, |q| {
            q.engine.wait_started_or(out, Some(input))
        })
    }

    /// Copies the bytes of the completed started Read `ticket` into `buf` (its length) and
    /// frees its slot.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `ticket` is not a completed Read of this queue (a Write,
    /// not completed yet, taken already, or void after a reconnect) or `buf` is not its length.
    pub fn take_read(&mut self, ticket: Ticket, buf: &mut [u8]) -> Result<()> {
        self.engine.take_read(ticket, buf)
    }

    /// Frees a completed started Read into a caller's buffer
    /// ([`start_read_into`](Self::start_read_into)): its bytes are there.
    ///
    /// # Errors
    /// As [`take_read`](Self::take_read).
    pub(crate) fn finish_read(&mut self, ticket: Ticket) -> Result<()> {
        self.engine.finish_read(ticket)
    }

    /// Runs `op`, reconnecting after a connection loss and then re-running it or failing with
    /// the loss, as `on_loss` says.
    pub(crate) fn run<T>(
        &mut self,
        on_loss: OnLoss,
        mut op: impl FnMut(&mut Self) -> Result<T>,
    ) -> Result<T> {
        let mut call = self.reconnect.call()?;
        loop {
            if self.engine.needs_reconnect() {
                let d = call.deadline();
                let lost = self.engine.why_lost();
                self.reconnect
                    .reconnect(&mut self.engine, &mut self.persister, d, true, lost)?;
            }
            match op(self) {
                Err(e) if retryable(&e) => {
                    let d = call.deadline();
                    // An interrupted atomic must have executed, or never execute, by the time
                    // the call reports the loss: retire the connection it may still be on.
                    let fence = on_loss == OnLoss::ReconnectAndFail;
                    let lost = rpma_common::error_chain(&e);
                    self.reconnect.reconnect(
                        &mut self.engine,
                        &mut self.persister,
                        d,
                        fence,
                        lost,
                    )?;
                    if !call.rerun(on_loss) {
                        return Err(e);
                    }
                }
                r => return r,
            }
        }
    }

    /// The index of namespace `nsid` among this queue's namespaces, which the queue uses from
    /// then on: a reconnect that finds it changed gives the queue up (reconnect.rs).
    ///
    /// # Errors
    /// [`Error::NoSuchNamespace`], [`Error::NamespaceUnavailable`].
    pub(crate) fn open_namespace(&mut self, nsid: u32) -> Result<usize> {
        let idx = self
            .engine
            .index_of(nsid)
            .ok_or(Error::NoSuchNamespace { nsid })?;
        crate::checks::check_reachable(self.engine.descriptor(idx))?;
        self.engine.mark_used(idx);
        Ok(idx)
    }

    /// The descriptor of namespace `idx` (it changes across a reconnect: new rkey and address).
    pub(crate) fn descriptor(&self, idx: usize) -> &NamespaceDescriptor {
        self.engine.descriptor(idx)
    }

    /// Whether the peer of the current connection has `f`.
    pub(crate) fn peer_has(&self, f: impl Fn(&ConnInfo) -> bool) -> bool {
        self.engine.peer_has(f)
    }

    // The data path of namespace.rs, each inside `run`: the engine's and the persister's calls.

    /// Starts a Write (the engine's `start_write`) under the reconnect policy.
    pub(crate) fn start_write(
        &mut self,
        idx: usize,
        offset: u64,
        data: Data<'_>,
        fence: bool,
    ) -> Result<Ticket> {
        self.engine.check_one_chunk(data.len())?;
        self.run(OnLoss::ReconnectAndFail, |q| {
            q.engine.start_write(&q.persister, idx, offset, data, fence)
        })
    }

    /// Starts a Read (the engine's `start_read`) under the reconnect policy.
    pub(crate) fn start_read(&mut self, idx: usize, offset: u64, len: usize) -> Result<Ticket> {
        self.engine.check_one_chunk(len)?;
        self.run(OnLoss::ReconnectAndFail, |q| {
            q.engine.start_read(&q.persister, idx, offset, len)
        })
    }

    /// Starts a Read into `len` bytes from `at` of `buf` (the engine's `start_read_into`) under
    /// the reconnect policy.
    pub(crate) fn start_read_into(
        &mut self,
        idx: usize,
        offset: u64,
        buf: &mut WriteBuf,
        at: usize,
        len: usize,
    ) -> Result<Ticket> {
        self.engine.check_one_chunk(len)?;
        buf.check(at, len)?;
        if buf.writes_held() != 0 {
            return Err(Error::InvalidArgument(
                "a write from this buffer is not durable yet: persist it before reading into the \
                 buffer"
                    .into(),
            ));
        }
        let buf = &*buf;
        self.run(OnLoss::ReconnectAndFail, |q| {
            q.engine
                .start_read_into(&q.persister, idx, offset, buf, at, len)
        })
    }

    /// Reads `items` of namespace `idx` through the bounce slots.
    pub(crate) fn read_into(&mut self, idx: usize, items: &mut [(u64, &mut [u8])]) -> Result<()> {
        self.engine.read_into(&self.persister, idx, items)
    }

    /// Posts the Writes of `items` to namespace `idx`, then `tail`.
    pub(crate) fn post_writes(
        &mut self,
        idx: usize,
        items: &[(u64, Data<'_>)],
        tail: impl IntoIterator<Item = SendWr>,
    ) -> Result<()> {
        self.engine.post_writes(&self.persister, idx, items, tail)
    }

    /// Has every Write this queue posted placed on the target (the engine's `place_writes`).
    pub(crate) fn place_writes(&mut self, idx: usize) -> Result<()> {
        self.run(OnLoss::Rerun, |q| q.engine.place_writes(idx))
    }

    /// Asks the queues `ids` to learn their placement soon.
    pub(crate) fn want_placed(&mut self, ids: &[u64]) {
        self.engine.pool().want_placed(ids);
    }

    /// The queues (this one too) that may hold writes of these bytes not known placed.
    pub(crate) fn unplaced_writers(&mut self, idx: usize, offset: u64, len: usize) -> Vec<u64> {
        self.engine.unplaced_writers(idx, offset, len)
    }

    /// Waits until no Write or Read is outstanding (posted, or started and held back).
    pub(crate) fn drain(&mut self) -> Result<()> {
        self.engine.drain()
    }

    /// Posts a request outside the bounce slots and waits for its completion.
    pub(crate) fn post_and_wait(
        &mut self,
        ns: usize,
        what: &'static str,
        op: SendOp,
    ) -> Result<()> {
        self.engine.post_and_wait(ns, what, op)
    }

    /// The value the last atomic left in the sink.
    pub(crate) fn sink_value(&self) -> Result<u64> {
        self.engine.sink_value()
    }

    /// The 8-byte sink for atomic results.
    pub(crate) fn sink(&self) -> Sge {
        self.engine.sink()
    }

    /// The method for durable calls on namespace `idx` ([`Persister::choice`]).
    pub(crate) fn choice(&self, idx: usize) -> Result<Choice> {
        self.persister.choice(&self.engine, idx)
    }

    /// The method for a named range of namespace `idx` ([`Persister::range_choice`]).
    pub(crate) fn range_choice(&self, idx: usize) -> Result<Choice> {
        self.persister.range_choice(&self.engine, idx)
    }

    /// The method for this queue's held writes of namespace `idx`
    /// ([`Persister::held_choice`]).
    pub(crate) fn held_choice(&self, idx: usize) -> Result<Choice> {
        self.persister.held_choice(&self.engine, idx)
    }

    /// Forces `m` on namespace `idx` ([`Persister::set_forced`]).
    pub(crate) fn set_forced(&mut self, idx: usize, m: Option<PersistMethod>) {
        self.persister.set_forced(&self.engine, idx, m);
    }

    /// [`Persister::persist_range`].
    pub(crate) fn persist_range(
        &mut self,
        ns: usize,
        offset: u64,
        len: u64,
        choice: Choice,
    ) -> Result<Durability> {
        self.persister
            .persist_range(&mut self.engine, ns, offset, len, choice)
    }

    /// [`Persister::persist_own`].
    pub(crate) fn persist_own(&mut self, idx: usize) -> Result<Durability> {
        self.persister.persist_own(&mut self.engine, idx)
    }

    /// [`Persister::write_and_persist`].
    pub(crate) fn write_and_persist(
        &mut self,
        ns: usize,
        items: &[(u64, Data<'_>)],
        ranges: &[(u64, u64)],
        choice: Choice,
    ) -> Result<Durability> {
        self.persister
            .write_and_persist(&mut self.engine, ns, items, ranges, choice)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_queue_can_move_to_its_thread_and_a_connection_is_shared() {
        fn send<T: Send>() {}
        send::<Queue>();
        send::<Connection>();
    }
}
