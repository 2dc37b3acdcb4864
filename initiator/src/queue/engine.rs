//! The engine: posting Writes and Reads through the bounce slots, single requests the caller
//! waits for, polling the completion queue and dispatching what completed.

use std::time::{Duration, Instant};

use rpma_common::fabric::{Completion, QpState, SendOp, SendWr, WcStatus};
use rpma_common::proto::msgbuf::CONTROL_BIT;
use rpma_common::proto::Message;

use super::completion::{complete_slot, Outcome, KIND_MASK, KIND_READ, KIND_WAITED, KIND_WRITE};
use super::Queue;
use crate::error::{Error, LossReason, Result};
use crate::pool::{Kind, Slot, WriteRec};
use crate::session::Session;

/// How often the polling loops wake to run keep-alives when nothing completes.
const TICK: Duration = Duration::from_millis(100);

impl Queue {
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

    /// Posts `wrs` with one doorbell (nothing when empty), after the started requests not
    /// posted yet. If the post is refused for another reason than a lost connection, the slots
    /// of its Writes are freed (nothing was posted).
    pub(crate) fn post_list(&mut self, mut wrs: Vec<SendWr>) -> Result<()> {
        if !self.deferred.is_empty() {
            let mut all = std::mem::take(&mut self.deferred);
            all.append(&mut wrs);
            wrs = all;
        }
        if wrs.is_empty() {
            return Ok(());
        }
        // The slots of its Writes, to free if the post is refused (no allocation without any).
        let writes: Vec<usize> = if wrs.iter().any(|w| w.wr_id & KIND_MASK == KIND_WRITE) {
            wrs.iter()
                .filter(|w| w.wr_id & KIND_MASK == KIND_WRITE)
                .map(|w| (w.wr_id & !KIND_MASK) as usize)
                .collect()
        } else {
            Vec::new()
        };
        self.doorbells += 1;
        let s = self.session()?;
        let r = s.qp().post_send_list(wrs).map_err(|e| post_error(s, e));
        if let Err(e) = &r {
            if !e.is_connection_loss() {
                for slot in writes {
                    self.pool.set(slot, Slot::Free);
                }
            }
        }
        r
    }

    /// Posts one request that is not a Write through a slot (a Read, an APM Read, an atomic, a
    /// Flush): directly when no started request waits to go first, else behind them.
    fn post_one(&mut self, wr: SendWr) -> Result<()> {
        if !self.deferred.is_empty() {
            return self.post_list(vec![wr]);
        }
        self.doorbells += 1;
        let s = self.session()?;
        s.qp().post_send(wr).map_err(|e| post_error(s, e))
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
        let wr = self.read_wr(slot, ns, offset, len);
        self.pool.set(slot, Slot::Reading { ns, item, at, len });
        self.reads_posted += 1;
        self.post_one(wr)
    }

    /// The Read of `len` bytes at `offset` of namespace `ns` into `slot` (mark the slot, then
    /// post it).
    pub(crate) fn read_wr(&self, slot: usize, ns: usize, offset: u64, len: usize) -> SendWr {
        let d = &self.ns[ns].desc;
        let remote = rpma_common::fabric::RemoteAddr {
            addr: d.remote_addr + offset,
            rkey: d.rkey,
        };
        SendWr::new(
            KIND_READ | slot as u64,
            SendOp::Read {
                local: self.pool.sge(slot, len),
                remote,
            },
        )
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
            self.poll_or_time_out(deadline, "a free request slot")?;
        }
    }

    /// Waits until no posted Write or Read is outstanding.
    pub(crate) fn drain(&mut self) -> Result<()> {
        let deadline = Instant::now() + self.conn.options.timeout;
        while self.pool.in_flight() > 0 {
            self.poll_or_time_out(deadline, "data completions")?;
        }
        Ok(())
    }

    /// One wait on the completion queue (at most `TICK`, or `deadline`): dispatches what
    /// completed and returns, with a Timeout past `deadline`.
    pub(crate) fn poll_or_time_out(&mut self, deadline: Instant, what: &'static str) -> Result<()> {
        let now = Instant::now();
        if now >= deadline {
            return Err(Error::Timeout {
                what,
                after: self.conn.options.timeout,
            });
        }
        self.poll_completions((deadline - now).min(TICK))?;
        Ok(())
    }

    /// Waits up to `timeout` for completions, dispatches them and runs the keep-alive.
    pub(super) fn poll_completions(&mut self, timeout: Duration) -> Result<usize> {
        // Started requests go out before any wait for completions.
        self.post_list(Vec::new())?;
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
                self.completion_log.error(&mut first_err, e);
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
        if c.wr_id & KIND_MASK == KIND_WAITED {
            self.waited_done.push((c.wr_id, c.status));
            return Ok(());
        }
        match complete_slot(&mut self.pool, c) {
            Outcome::Done => {}
            Outcome::ReadDone(slot) => self.reads_done.push(slot),
            Outcome::Started(done) => self.started_done.push(done),
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
            nsid: self.ns.get(ns).map_or(0, |n| n.desc.nsid),
            op,
            status,
        }
    }

    /// Posts a request outside the bounce slots (APM Read, atomic, Atomic Write, Flush) and
    /// waits for its completion.
    pub(crate) fn post_and_wait(
        &mut self,
        ns: usize,
        what: &'static str,
        op: SendOp,
    ) -> Result<()> {
        let wr = self.waited_wr(op);
        let wr_id = wr.wr_id;
        self.post_one(wr)?;
        self.wait_for_request(ns, what, wr_id)
    }

    /// A request outside the bounce slots with a fresh wr_id (post it, then
    /// [`wait_for_request`](Self::wait_for_request)).
    pub(crate) fn waited_wr(&mut self, op: SendOp) -> SendWr {
        self.next_waited += 1;
        let wr_id = KIND_WAITED | (self.next_waited & !KIND_MASK & !CONTROL_BIT);
        SendWr::new(wr_id, op)
    }

    /// Waits for the request `wr_id` of [`waited_wr`](Self::waited_wr) to complete. Several may
    /// be in flight: wait for them in the order they were made (the completions of earlier ones,
    /// waited for or abandoned, are dropped once a later one is found).
    pub(crate) fn wait_for_request(
        &mut self,
        ns: usize,
        what: &'static str,
        wr_id: u64,
    ) -> Result<()> {
        let deadline = Instant::now() + self.conn.options.timeout;
        loop {
            if let Some(&(_, status)) = self.waited_done.iter().find(|d| d.0 == wr_id) {
                // wr_ids of waited requests grow (within the kind's bits): older entries
                // belong to requests nobody waits for any longer.
                self.waited_done.retain(|d| d.0 > wr_id);
                if status == WcStatus::Success {
                    return Ok(());
                }
                return Err(self.completion_error(ns, what, status));
            }
            self.poll_or_time_out(deadline, what)?;
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

    /// Posts the Writes of `items` through the bounce slots, as many per doorbell as there are
    /// free slots, and `tail` (requests that must follow them) with the last of them. Returns
    /// once everything is posted; the completions are the caller's to wait for.
    pub(crate) fn post_writes(
        &mut self,
        idx: usize,
        items: &[(u64, &[u8])],
        tail: Vec<SendWr>,
    ) -> Result<()> {
        let chunk = self.pool.chunk();
        let mut pending = Vec::new();
        for (off, data) in items {
            for (i, piece) in data.chunks(chunk).enumerate() {
                let slot = match self.pool.take_free() {
                    Some(s) => s,
                    None => {
                        // Out of slots: what is pending goes out before waiting for completions.
                        self.post_list(std::mem::take(&mut pending))?;
                        loop {
                            if let Some(s) = self.free_slot()? {
                                break s;
                            }
                        }
                    }
                };
                if let Err(source) = self.pool.fill(slot, piece) {
                    self.pool.untake(slot);
                    return Err(Error::Fabric {
                        op: "filling a bounce buffer",
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
                self.pool.supersede(&rec);
                pending.push(self.write_wr(slot, rec));
            }
        }
        pending.extend(tail);
        self.post_list(pending)
    }

    /// Copies the completed Reads out of their slots into `items` and frees the slots.
    fn collect_reads(&mut self, items: &mut [(u64, &mut [u8])]) -> Result<()> {
        while let Some(slot) = self.reads_done.pop() {
            if let Some(Slot::ReadDone { item, at, len }) = self.pool.get(slot) {
                let out = &mut items[item].1[at..at + len];
                self.pool
                    .copy_out(slot, out)
                    .map_err(|source| Error::Fabric {
                        op: "copying a read out",
                        source,
                    })?;
                self.pool.set(slot, Slot::Free);
            }
        }
        Ok(())
    }

    /// Reads `items` (each range into its buffer) of namespace `idx` through the bounce slots,
    /// up to the queue depth in flight, and returns when every byte is copied out.
    pub(crate) fn read_into(&mut self, idx: usize, items: &mut [(u64, &mut [u8])]) -> Result<()> {
        let chunk = self.pool.chunk();
        for item in 0..items.len() {
            let (off, total) = (items[item].0, items[item].1.len());
            let mut at = 0;
            while at < total {
                let len = chunk.min(total - at);
                let slot = loop {
                    self.collect_reads(items)?;
                    if let Some(s) = self.free_slot()? {
                        break s;
                    }
                };
                self.post_read_slot(slot, idx, off + at as u64, len, item, at)?;
                at += len;
            }
        }
        let deadline = Instant::now() + self.options_timeout();
        loop {
            self.collect_reads(items)?;
            if self.pool.number(Kind::Reading) == 0 {
                return Ok(());
            }
            self.poll_or_time_out(deadline, "read completions")?;
        }
    }
}

/// Posting fails locally; a queue pair in Error means the connection is gone.
fn post_error(s: &Session, e: rpma_common::fabric::Error) -> Error {
    if s.qp().state() == QpState::Error {
        return Error::ConnectionLost {
            reason: LossReason::of(s.qp()),
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
