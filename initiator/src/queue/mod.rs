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
//! The queue's parts: `connection` (where and who, queue options, the reconnect policy),
//! `engine` (posting through the bounce slots, polling and dispatching completions),
//! `reconnect` (re-running a call after a loss, re-issuing held writes) and `persist` (the
//! durability method of each namespace and the requests that make ranges durable). The
//! handle on one namespace, [`Queue::namespace`], lives in namespace.rs and drives the queue
//! through these methods only (the queue does not know the handle).

use std::time::Duration;

use rpma_common::fabric::WcStatus;
use rpma_common::proto::{FlushStatus, NamespaceDescriptor};

use crate::durability::{Choice, MethodNotValid, PersistMethod};
use crate::error::{Error, Result};
use crate::pool::Pool;
use crate::session::Session;

mod completion;
mod connection;
mod engine;
mod persist;
mod reconnect;
mod started;

pub use connection::{Connection, QueueOptions, ReconnectPolicy};
pub(crate) use reconnect::OnLoss;
pub use started::{Completed, Ticket};

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
    /// Data completions that matched no request slot (each logged, rate-limited): 0 unless
    /// something is wrong.
    pub unmatched_completions: u64,
    /// Completion errors a poll did not return because an earlier one of the same poll was
    /// (each logged at debug level): after a loss, every other flushed request gives one.
    pub errors_not_returned: u64,
}

/// A namespace as a queue knows it.
#[derive(Debug, Clone)]
struct NsState {
    desc: NamespaceDescriptor,
    /// The method for durable calls, or the refusal of a forced one (made into
    /// [`Error::MethodNotValid`] on each durable call: Error is not Clone).
    choice: std::result::Result<Choice, MethodNotValid>,
    forced: Option<PersistMethod>,
}

/// One connected queue pair and its registered buffers. Not shared between threads: open one
/// queue per thread from a [`Connection`].
pub struct Queue {
    conn: Connection,
    queue_id: u16,
    session: Option<Session>,
    pool: Pool,
    ns: Vec<NsState>,
    flush_answers: Vec<(u64, FlushStatus)>,
    reads_done: Vec<usize>,
    /// Completions of requests outside the slots (wr_id, status), until their waiter looks.
    waited_done: Vec<(u64, WcStatus)>,
    /// Started requests, made but not posted yet: they go out with the next post or wait.
    deferred: Vec<rpma_common::fabric::SendWr>,
    /// Started requests that completed, until the caller asks.
    started_done: Vec<Completed>,
    next_waited: u64,
    next_token: u64,
    reconnects: u32,
    writes_posted: u64,
    reads_posted: u64,
    doorbells: u64,
    completion_log: completion::CompletionLog,
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

impl Connection {
    /// Opens queue `queue_id` (0 is the admin queue; it carries I/O too): connects, registers
    /// the bounce buffers and chooses each namespace's durability method. A first connection
    /// that fails in a way that may pass (the target not up yet, no room for this host at
    /// the moment) is retried within the queue's [`ReconnectPolicy`], as a lost one is
    /// ([`ReconnectPolicy::first_connection`]).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for bad queue options, those of [`connect`] (the last
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
        let pool = Pool::new(
            session.pd(),
            self.queue.depth,
            self.queue.slots(),
            self.queue.chunk,
        )
        .map_err(|source| Error::Fabric {
            op: "registering the bounce buffers",
            source,
        })?;
        let mut q = Queue {
            conn: self.clone(),
            queue_id,
            session: Some(session),
            pool,
            ns: Vec::new(),
            flush_answers: Vec::new(),
            reads_done: Vec::new(),
            waited_done: Vec::new(),
            deferred: Vec::new(),
            started_done: Vec::new(),
            next_waited: 0,
            next_token: 0,
            reconnects: 0,
            writes_posted: 0,
            reads_posted: 0,
            doorbells: 0,
            completion_log: Default::default(),
            broken: false,
        };
        q.ns = q.describe_all()?;
        Ok(q)
    }
}

impl Queue {
    /// The namespaces this host may reach, by nsid.
    pub fn namespaces(&self) -> Vec<NamespaceDescriptor> {
        self.ns.iter().map(|n| n.desc.clone()).collect()
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
            unmatched_completions: self.completion_log.unmatched,
            errors_not_returned: self.completion_log.later_errors,
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
        self.run(OnLoss::Rerun, |q| {
            q.poll_completions(Duration::ZERO).map(|_| ())
        })
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

    /// The connect time-out: the deadline of every wait on this queue.
    pub(crate) fn options_timeout(&self) -> Duration {
        self.conn.options.timeout
    }

    /// The index of namespace `nsid` among this queue's namespaces.
    ///
    /// # Errors
    /// [`Error::NoSuchNamespace`], [`Error::NamespaceUnavailable`].
    pub(crate) fn namespace_index(&self, nsid: u32) -> Result<usize> {
        let idx = self
            .ns
            .iter()
            .position(|n| n.desc.nsid == nsid)
            .ok_or(Error::NoSuchNamespace { nsid })?;
        crate::checks::check_reachable(&self.ns[idx].desc)?;
        Ok(idx)
    }

    /// The descriptor of namespace `idx` (it changes across a reconnect: new rkey and address).
    pub(crate) fn descriptor(&self, idx: usize) -> &NamespaceDescriptor {
        &self.ns[idx].desc
    }

    fn session(&self) -> Result<&Session> {
        self.session.as_ref().ok_or(Error::Broken)
    }

    pub(crate) fn peer_has(&self, f: impl Fn(&rpma_common::fabric::ConnInfo) -> bool) -> bool {
        self.session.as_ref().is_some_and(|s| f(&s.qp().info()))
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
