//! The engine: one connection's data path. It owns the session (queue pair, completion queue,
//! control messages), the bounce slots, the namespaces as this connection addresses them, and
//! everything between a post and its completion: posting Writes and Reads through the slots,
//! started requests, single requests the caller waits for, polling the completion queue and
//! dispatching what completed. It knows nothing of durability methods or reconnects: when
//! every slot holds a write waiting to be made durable it asks its caller ([`MakeRoom`]), and
//! a reconnect takes its session away and installs a new one ([`Engine::lose_connection`],
//! [`Engine::install`]).
//!
//! # Waiting for a slot, and what keeps it from spinning
//!
//! [`Engine::free_slot`] returns a free slot, or asks [`MakeRoom`] to make the held writes durable
//! when nothing is in flight, or polls (with a deadline) for a completion, or fails when none of
//! these can free one (every slot a completed started Read, which only `take_read` frees, as a
//! start finds in `started`); and it hands the turn back (`None`) while a completed batch Read
//! waits in `reads_done`, because only [`Engine::read_into`], which owns the batch's buffers, can
//! copy it out and free its slot. [`Engine::post_writes`] cannot, and calls it until it gets a
//! slot: it would spin forever if `reads_done` were not empty outside a batch. Everything that
//! touches `reads_done` is in this file: the poll fills it (a batch Read completed), `read_into`
//! empties it and returns only once every Read of its batch is copied out, and
//! [`Engine::forget_owed`] clears it with a lost connection. A `read_into` that fails early
//! (a Read the fabric refused to post) still waits for the Reads it posted and frees their
//! slots; it may leave some behind only with a connection loss (the reconnect forgets them) or
//! a failed completion, which leaves the queue pair in Error (verbs), so that the next call
//! reconnects first.
//!
//! Started requests (their own slot states, never in `reads_done`) are in `started`; single
//! requests outside the slots that the caller waits for (APM Reads, atomics, Flushes, GPSPM
//! FlushRequests) in `waited`; the posts themselves, and the started Reads held back by the
//! read bound, in `post`.

use std::os::fd::BorrowedFd;
use std::time::{Duration, Instant};

use rpma_common::fabric::{Completion, ConnInfo, RemoteAddr, SendOp, SendWr, WcStatus, Woken};
use rpma_common::proto::msgbuf::CONTROL_BIT;
use rpma_common::proto::{FlushStatus, Message, NamespaceDescriptor};

use super::completion::{
    complete_slot, Completed, CompletionLog, Outcome, KIND_MASK, KIND_READ, KIND_WAITED, KIND_WRITE,
};
use crate::error::{Error, LossReason, Result};
use crate::pool::{Kind, Pool, Slot, WriteRec};
use crate::session::Session;
use crate::writebuf::Data;

/// Requests posted behind one doorbell: inline for a few (a durable write and its Flush
/// allocate nothing).
pub(super) type SendList = smallvec::SmallVec<[SendWr; 4]>;

mod lost;
mod place;
mod post;
mod started;
#[cfg(test)]
mod tests;
mod waited;

pub(in crate::queue) use lost::Lost;

/// How often the polling loops wake to run keep-alives when nothing completes.
const TICK: Duration = Duration::from_millis(100);

/// What the engine asks of its caller when every slot holds a write that waits for a
/// durability acknowledgement and nothing is in flight: make them durable (or visible), which
/// frees their slots. The durability side of the queue answers it (persist.rs).
pub(super) trait MakeRoom {
    /// Makes every held write of `e` durable (or visible) and frees its slot.
    ///
    /// # Errors
    /// What the requests that make them durable return.
    fn make_room(&self, e: &mut Engine) -> Result<()>;
}

/// The engine's counters, for [`QueueStats`](super::QueueStats).
#[derive(Debug, Clone, Copy)]
pub(super) struct Counters {
    pub(super) writes_posted: u64,
    pub(super) reads_posted: u64,
    pub(super) max_in_flight: usize,
    pub(super) max_read_bytes_in_flight: usize,
    pub(super) doorbells: u64,
    pub(super) unmatched_completions: u64,
    pub(super) errors_not_returned: u64,
    pub(super) bytes_copied: u64,
    pub(super) read_bytes_copied: u64,
}

/// One connection's data path (the module's doc).
pub(super) struct Engine {
    /// None once the connection was taken (a reconnect under way, a queue given up or closed).
    session: Option<Session>,
    pool: Pool,
    /// The queue's namespaces by index, as the current connection addresses them (a reconnect
    /// replaces them: new rkey and address). The indexes are the first connection's and never
    /// shift: a namespace a later connection no longer lists keeps its place (`gone`).
    descs: Vec<NamespaceDescriptor>,
    /// By index: the queue uses the namespace (a handle was taken on it), so a reconnect that
    /// finds it changed gives the queue up.
    used: Vec<bool>,
    /// By index: the current connection does not list the namespace (a reload removed it).
    gone: Vec<bool>,
    /// The deadline of every wait: the connect time-out.
    timeout: Duration,
    /// [`QueueOptions::read_bytes_in_flight`](crate::QueueOptions::read_bytes_in_flight).
    read_bound: usize,
    /// The answer (token, status) to the GPSPM FlushRequest sent last, until its waiter looks
    /// (a queue has at most one outstanding; answers to earlier ones, which timed out, are
    /// dropped).
    flush_answer: Option<(u64, FlushStatus)>,
    /// Slots of batch Reads that completed, until [`read_into`](Self::read_into) copies them
    /// out. Non-empty only while a batch Read runs (the module's doc: no wait without
    /// progress).
    reads_done: Vec<usize>,
    /// Completions of requests outside the slots (wr_id, status), until their waiter looks.
    waited_done: Vec<(u64, WcStatus)>,
    /// Started requests, made but not posted yet: they go out with the next post or wait, but
    /// for started Reads beyond the read bound and what follows them
    /// ([`deferred_that_fit`](Self::deferred_that_fit)).
    deferred: Vec<SendWr>,
    /// Started requests that completed, until the caller asks.
    started_done: Vec<Completed>,
    next_waited: u64,
    /// The placement probe out ([`place`]): its KeepAlive seq, the post order it places
    /// through, and the replay order's clock when it was sent.
    probe: Option<(u64, u64, u64)>,
    /// The post order the last probe places through.
    probe_mark: u64,
    writes_posted: u64,
    reads_posted: u64,
    /// The most requests, and bytes of Reads, posted and not completed at once.
    max_posted: usize,
    max_posted_read_bytes: usize,
    doorbells: u64,
    completion_log: CompletionLog,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("session", &self.session)
            .field("pool", &self.pool)
            .finish()
    }
}

impl Engine {
    /// The engine of a new connection: `session`'s namespaces, in its order, are the queue's.
    pub(super) fn new(session: Session, pool: Pool, timeout: Duration) -> Engine {
        let n = session.namespaces().len();
        Engine {
            descs: session.namespaces().to_vec(),
            used: vec![false; n],
            gone: vec![false; n],
            session: Some(session),
            pool,
            timeout,
            read_bound: 0,
            flush_answer: None,
            reads_done: Vec::new(),
            waited_done: Vec::new(),
            deferred: Vec::new(),
            started_done: Vec::new(),
            next_waited: 0,
            probe: None,
            probe_mark: 0,
            writes_posted: 0,
            reads_posted: 0,
            max_posted: 0,
            max_posted_read_bytes: 0,
            doorbells: 0,
            completion_log: CompletionLog::default(),
        }
    }

    /// The same with started Reads bounded to `bytes` in flight (0: no bound).
    pub(super) fn with_read_bound(mut self, bytes: usize) -> Engine {
        self.read_bound = bytes;
        self
    }

    pub(super) fn counters(&self) -> Counters {
        Counters {
            writes_posted: self.writes_posted,
            reads_posted: self.reads_posted,
            max_in_flight: self.max_posted,
            max_read_bytes_in_flight: self.max_posted_read_bytes,
            doorbells: self.doorbells,
            unmatched_completions: self.completion_log.unmatched,
            errors_not_returned: self.completion_log.later_errors,
            bytes_copied: self.pool.bytes_copied(),
            read_bytes_copied: self.pool.bytes_copied_out(),
        }
    }

    /// The bounce slots (for Debug).
    pub(super) fn pool(&self) -> &Pool {
        &self.pool
    }

    /// The current session, if the connection is up (or thought to be).
    pub(super) fn session_opt(&self) -> Option<&Session> {
        self.session.as_ref()
    }

    fn session(&self) -> Result<&Session> {
        self.session.as_ref().ok_or(Error::Broken)
    }

    /// Takes the session away (closing the queue).
    pub(super) fn take_session(&mut self) -> Option<Session> {
        self.session.take()
    }

    /// Whether the peer of the current connection has `f`; false without one.
    pub(super) fn peer_has(&self, f: impl Fn(&ConnInfo) -> bool) -> bool {
        self.session.as_ref().is_some_and(|s| f(&s.qp().info()))
    }

    /// The queue's namespaces, by index (those the current connection no longer lists too:
    /// [`listed`](Self::listed)).
    pub(super) fn descriptors(&self) -> &[NamespaceDescriptor] {
        &self.descs
    }

    /// The descriptor of namespace `idx`.
    pub(super) fn descriptor(&self, idx: usize) -> &NamespaceDescriptor {
        &self.descs[idx]
    }

    /// The index of namespace `nsid`, if the current connection lists it.
    pub(super) fn index_of(&self, nsid: u32) -> Option<usize> {
        (0..self.descs.len()).find(|&i| self.descs[i].nsid == nsid && !self.gone[i])
    }

    /// Whether the current connection lists namespace `idx`.
    pub(super) fn listed(&self, idx: usize) -> bool {
        !self.gone[idx]
    }

    /// The queue uses namespace `idx` from now on (a handle was taken on it).
    pub(super) fn mark_used(&mut self, idx: usize) {
        self.used[idx] = true;
    }

    /// Whether the queue uses namespace `idx`: a handle was taken on it, on this connection or
    /// an earlier one.
    pub(super) fn uses(&self, idx: usize) -> bool {
        self.used[idx]
    }

    /// The sorted, merged ranges of namespace `ns` that held or posted writes cover.
    pub(super) fn held_ranges(&self, ns: usize) -> crate::pool::Ranges {
        self.pool.held_ranges(ns)
    }

    /// A durability acknowledgement covers `[start, end)` of namespace `ns` (every write of
    /// it if `all`): frees the held writes it covers ([`Pool::release_held`]).
    pub(super) fn release_held(&mut self, ns: usize, start: u64, end: u64, all: bool) {
        self.pool.release_held(ns, start, end, all);
    }

    /// The Write of what a slot holds (its bytes are in the slot already); the slot is marked
    /// in flight: post the request with [`post_list`](Self::post_list).
    fn write_wr(&mut self, slot: usize, w: WriteRec) -> SendWr {
        let wr = self.piece_wr(slot, w, w.offset, w.offset + w.len as u64);
        self.pool.set(slot, Slot::Writing(w));
        wr
    }

    /// [`write_wr`](Self::write_wr) of a new write; the older held write it supersedes
    /// ([`Pool::superseded`]) is freed once the new one is posted
    /// ([`Pool::settle_superseded`]): freed first, the bytes were held by neither for a
    /// moment, which an heir's bookkeeping took for a durable release of the bytes it owes,
    /// and a post refused then left them to nobody (a persist said durable without them).
    fn write_wr_superseding(&mut self, slot: usize, w: WriteRec) -> SendWr {
        let old = self.pool.superseded(&w);
        let wr = self.write_wr(slot, w);
        if let Some(p) = old {
            self.pool.supersede_when_posted(slot, &w, p);
        }
        wr
    }

    /// A Write of the piece `[start, end)` of the write `w` in `slot` (signaled, with the
    /// slot's wr_id); the slot is left as it is.
    fn piece_wr(&self, slot: usize, w: WriteRec, start: u64, end: u64) -> SendWr {
        let d = &self.descs[w.ns];
        let remote = RemoteAddr {
            addr: d.remote_addr + start,
            rkey: d.rkey,
        };
        let at = (start - w.offset) as usize;
        SendWr::new(
            KIND_WRITE | slot as u64,
            SendOp::Write {
                local: self.pool.write_sge(slot, at, (end - start) as usize),
                remote,
            },
        )
    }

    /// Posts a Read of `len` bytes at `offset` of namespace `ns` into `slot`.
    fn post_read_slot(
        &mut self,
        slot: usize,
        ns: usize,
        offset: u64,
        len: usize,
        item: usize,
        at: usize,
    ) -> Result<()> {
        let wr = self.read_wr(slot, ns, offset, len);
        self.pool.set(slot, Slot::Reading { ns, item, at, len });
        self.post_one(wr)
    }

    /// The Read of `len` bytes at `offset` of namespace `ns` into `slot` (mark the slot, then
    /// post it).
    fn read_wr(&self, slot: usize, ns: usize, offset: u64, len: usize) -> SendWr {
        let d = &self.descs[ns];
        let remote = RemoteAddr {
            addr: d.remote_addr + offset,
            rkey: d.rkey,
        };
        SendWr::new(
            KIND_READ | slot as u64,
            SendOp::Read {
                // The slot, or the caller's buffer a started Read goes into.
                local: self.pool.write_sge(slot, 0, len),
                remote,
            },
        )
    }

    /// A free slot, waiting for in-flight requests, or making held writes durable (`room`)
    /// when every slot holds one. None, when `batch` (a batch call, not a started request),
    /// once a Read of the batch completed: copy it out ([`read_into`](Self::read_into)) first.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when every slot holds a completed started Read nobody took;
    /// a time-out, or what the poll and `room` return.
    fn free_slot(&mut self, room: &(impl MakeRoom + ?Sized), batch: bool) -> Result<Option<usize>> {
        // The clock is read only when a slot is waited for (not per request).
        let mut deadline = None;
        loop {
            if let Some(s) = self.pool.take_free() {
                return Ok(Some(s));
            }
            if batch && !self.reads_done.is_empty() {
                return Ok(None);
            }
            if self.pool.in_flight() == 0 {
                // Nothing will complete and no held write frees a slot: every slot holds a
                // completed started Read that only take_read frees.
                if self.pool.number(Kind::Held) == 0 {
                    return Err(Error::InvalidArgument(
                        "every bounce slot holds a completed read: take_read them first".into(),
                    ));
                }
                room.make_room(self)?;
                continue;
            }
            let deadline = *deadline.get_or_insert_with(|| crate::deadline::after(self.timeout));
            self.poll_or_time_out(deadline, "completion to free a request slot")?;
        }
    }

    /// Waits until no Write or Read is outstanding (posted, or started and held back).
    pub(super) fn drain(&mut self) -> Result<()> {
        let deadline = crate::deadline::after(self.timeout);
        while self.pool.in_flight() > 0 {
            self.poll_or_time_out(deadline, "data completions")?;
        }
        Ok(())
    }

    /// One wait on the completion queue (at most `TICK`, or `deadline`): dispatches what
    /// completed and returns, with a Timeout past `deadline`.
    fn poll_or_time_out(&mut self, deadline: Instant, what: &'static str) -> Result<()> {
        self.poll_or_input(deadline, what, None).map(|_| ())
    }

    /// [`poll_or_time_out`](Self::poll_or_time_out) that also returns, true, as soon as
    /// `input` is readable.
    fn poll_or_input(
        &mut self,
        deadline: Instant,
        what: &'static str,
        input: Option<BorrowedFd<'_>>,
    ) -> Result<bool> {
        let now = Instant::now();
        if now >= deadline {
            return Err(Error::Timeout {
                what,
                after: self.timeout,
            });
        }
        self.poll_completions_or((deadline - now).min(TICK), input)
            .map(|(_, ready)| ready)
    }

    /// Waits up to `timeout` for completions, dispatches them and runs the keep-alive.
    pub(super) fn poll_completions(&mut self, timeout: Duration) -> Result<usize> {
        self.poll_completions_or(timeout, None).map(|(n, _)| n)
    }

    /// [`poll_completions`](Self::poll_completions) that also returns as soon as `input` is
    /// readable: how many completions, and whether `input` woke it (then none came). `input`
    /// joins the completion queue's wait for this call only, and only when no completion is
    /// there at once (`CompletionQueue::wait_any_or`: the queue's session, and so its
    /// completion queue, may be another one the next time).
    fn poll_completions_or(
        &mut self,
        timeout: Duration,
        input: Option<BorrowedFd<'_>>,
    ) -> Result<(usize, bool)> {
        // Started requests go out before any wait for completions (and a placement probe
        // behind them, when one is due).
        self.post_list(SendList::new())?;
        // An idle queue, too, enters the replay order soon after another queue came.
        self.pool.keep_order();
        self.probe_if_due()?;
        let mut wcs = [Completion::EMPTY; 32];
        let s = self.session.as_mut().ok_or(Error::Broken)?;
        s.tick()?;
        let cq = s.cq();
        let woken = match input {
            None => cq.wait_any(&mut wcs, Some(timeout)),
            Some(fd) => cq.wait_any_or(&mut wcs, Some(timeout), fd, 0),
        }
        .map_err(crate::error::wait_error)?;
        rpma_common::steps::step("completions out of the wait");
        let (n, ready) = match woken {
            Woken::Completions(n) => (n, false),
            Woken::Fd(_) => (0, true),
            _ => (0, false),
        };
        let mut first_err = None;
        for c in &wcs[..n] {
            if let Err(e) = self.dispatch(c) {
                self.completion_log.error(&mut first_err, e);
            }
        }
        rpma_common::steps::step("completions dispatched");
        self.probe_answered();
        match first_err {
            Some(e) => Err(e),
            None => Ok((n, ready)),
        }
    }

    fn dispatch(&mut self, c: &Completion) -> Result<()> {
        if c.wr_id & CONTROL_BIT != 0 {
            let s = self.session.as_mut().ok_or(Error::Broken)?;
            match s.handle(c) {
                Ok(Some(Message::FlushResponse(r))) => {
                    if r.token == s.next_token {
                        self.flush_answer = Some((r.token, r.status));
                    }
                }
                Ok(_) => {}
                // A target that sends what this host cannot decode is not trusted with the
                // rest of the connection: it is lost, for this call and the next (which
                // reconnects, retiring it first), so that nothing a call left behind (a batch's
                // Reads in flight) is taken for the next call's.
                // (`handle` marked the session for the other violations it found.)
                Err(Error::Decode(e)) => {
                    let what = rpma_common::error_chain(&e);
                    s.violated = Some(what.clone());
                    return Err(Error::ConnectionLost {
                        reason: LossReason::Protocol(what),
                    });
                }
                Err(e) => return Err(e),
            }
            return Ok(());
        }
        if c.wr_id & KIND_MASK == KIND_WAITED {
            self.waited_done.push((c.wr_id, c.status));
            return Ok(());
        }
        match complete_slot(&mut self.pool, c) {
            Outcome::Done => {}
            Outcome::ReadDone(slot) => self.reads_done.push(slot),
            Outcome::Started(done) => {
                if let Completed::Read(t) = done {
                    self.read_answered(t);
                }
                self.started_done.push(done);
            }
            Outcome::Failed { ns, op } => return Err(self.completion_error(ns, op, c.status)),
            Outcome::Unmatched => {
                self.completion_log.unmatched(c);
            }
        }
        Ok(())
    }

    /// The error for a failed data completion on namespace index `ns`: a lost connection, or
    /// what the target refused.
    fn completion_error(&self, ns: usize, op: &'static str, status: WcStatus) -> Error {
        if matches!(status, WcStatus::WrFlush | WcStatus::RetryExceeded) {
            let reason = self
                .session
                .as_ref()
                .and_then(|s| s.qp().error())
                .map_or(LossReason::Completion { op, status }, LossReason::QueuePair);
            return Error::ConnectionLost { reason };
        }
        Error::Remote {
            nsid: self.descs.get(ns).map_or(0, |d| d.nsid),
            op,
            status,
        }
    }

    /// Posts the Writes of `items` through the bounce slots, as many per doorbell as there are
    /// free slots, and `tail` (requests that must follow them) with the last of them. Returns
    /// once everything is posted; the completions are the caller's to wait for.
    pub(super) fn post_writes(
        &mut self,
        room: &(impl MakeRoom + ?Sized),
        idx: usize,
        items: &[(u64, Data<'_>)],
        tail: impl IntoIterator<Item = SendWr>,
    ) -> Result<()> {
        let chunk = self.pool.chunk();
        let mut pending = SendList::new();
        for (off, data) in items {
            for (i, piece) in data.pieces(chunk).enumerate() {
                let slot = match self.pool.take_free() {
                    Some(s) => s,
                    None => {
                        // Out of slots: what is pending goes out before waiting for completions.
                        self.post_list(std::mem::take(&mut pending))?;
                        // No batch Read runs here, so `reads_done` is empty and free_slot
                        // returns a slot (the module's doc).
                        loop {
                            if let Some(s) = self.free_slot(room, true)? {
                                break s;
                            }
                        }
                    }
                };
                if let Err(source) = self.pool.load(slot, piece, false) {
                    self.pool.untake(slot);
                    // The Writes made so far are marked in flight with their post orders: they
                    // go out, so that none stays in flight unposted (a drain would wait for it,
                    // a placement answer count it placed, a reconnect re-issue it).
                    self.post_list(pending)?;
                    return Err(Error::Fabric {
                        op: piece.load_op(),
                        source,
                    });
                }
                let rec = WriteRec {
                    ns: idx,
                    offset: off + (i * chunk) as u64,
                    len: piece.len(),
                    seq: self.pool.next_seq(),
                    notify: false,
                };
                pending.push(self.write_wr_superseding(slot, rec));
            }
        }
        pending.extend(tail);
        self.post_list(pending)
    }

    /// Copies the completed Reads out of their slots into `items` and frees the slots (a
    /// failed copy's too).
    fn collect_reads(&mut self, items: &mut [(u64, &mut [u8])]) -> Result<()> {
        while let Some(slot) = self.reads_done.pop() {
            if let Some(Slot::ReadDone { item, at, len }) = self.pool.get(slot) {
                let out = &mut items[item].1[at..at + len];
                let copied = self.pool.copy_out(slot, out);
                self.pool.set(slot, Slot::Free);
                copied.map_err(|source| Error::Fabric {
                    op: "copying a read out",
                    source,
                })?;
            }
        }
        Ok(())
    }

    /// Reads `items` (each range into its buffer) of namespace `idx` through the bounce slots,
    /// up to the queue depth in flight, and returns when every byte is copied out. When it
    /// fails with the connection still up (a refused post), it returns only once the Reads it
    /// posted completed and their slots are free (the module's doc).
    pub(super) fn read_into(
        &mut self,
        room: &(impl MakeRoom + ?Sized),
        idx: usize,
        items: &mut [(u64, &mut [u8])],
    ) -> Result<()> {
        let posted = self.post_reads(room, idx, items);
        // A lost connection drops the Reads posted (the reconnect frees their slots and
        // `reads_done`).
        if posted
            .as_ref()
            .is_err_and(|e| e.is_connection_loss() || self.needs_reconnect())
        {
            return posted;
        }
        let deadline = crate::deadline::after(self.timeout);
        loop {
            self.collect_reads(items)?;
            if self.pool.number(Kind::Reading) == 0 {
                return posted;
            }
            self.poll_or_time_out(deadline, "read completions")?;
        }
    }

    /// Posts the Reads of [`read_into`](Self::read_into), copying out those that completed
    /// meanwhile.
    fn post_reads(
        &mut self,
        room: &(impl MakeRoom + ?Sized),
        idx: usize,
        items: &mut [(u64, &mut [u8])],
    ) -> Result<()> {
        let chunk = self.pool.chunk();
        for item in 0..items.len() {
            let (off, total) = (items[item].0, items[item].1.len());
            let mut at = 0;
            while at < total {
                let len = chunk.min(total - at);
                let slot = loop {
                    self.collect_reads(items)?;
                    if let Some(s) = self.free_slot(room, true)? {
                        break s;
                    }
                };
                self.post_read_slot(slot, idx, off + at as u64, len, item, at)?;
                at += len;
            }
        }
        Ok(())
    }

    /// Forgets what the lost connection owed: flush answers, completed batch Reads, waited
    /// completions, and started requests not posted yet. Started Writes are held (re-issued)
    /// and started Reads in flight dropped (their tickets void); the completions already
    /// collected stay, completed Reads with their bytes.
    pub(super) fn forget_owed(&mut self) {
        self.flush_answer = None;
        self.reads_done.clear();
        self.waited_done.clear();
        self.deferred.clear();
    }
}
