//! Posting: the one place the engine's data requests reach the send queue. Started requests
//! wait in `deferred` until the next post or wait, and go out in order ahead of anything else;
//! started Reads that would take the Reads in flight beyond the read bound
//! ([`QueueOptions::read_bytes_in_flight`](crate::QueueOptions::read_bytes_in_flight)) stay
//! there, with what was started after them, until completions make room. Each post counts
//! what it sent ([`Counters`](super::Counters)).

use std::time::Duration;

use rpma_common::fabric::{QpState, SendOp, SendWr};

use smallvec::SmallVec;

use super::{Engine, SendList, KIND_MASK, KIND_READ, KIND_WRITE};
use crate::error::{Error, LossReason, Result};
use crate::pool::Slot;
use crate::session::Session;

impl Engine {
    /// Posts `wrs` with one doorbell (nothing when empty), after the started requests not
    /// posted yet: all of them when `wrs` has any (a request the caller waits for, a Flush
    /// that covers them, must not pass them), else those that fit the read bound
    /// ([`deferred_that_fit`](Self::deferred_that_fit)). If the post is refused for another
    /// reason than a lost connection, the slots of its Writes and Reads are freed
    /// ([`unpost`](Self::unpost)).
    pub(super) fn post_list(&mut self, mut wrs: SendList) -> Result<()> {
        if !self.deferred.is_empty() {
            let go = if wrs.is_empty() {
                self.deferred_that_fit()
            } else {
                self.deferred.len()
            };
            let mut all: SendList = self.deferred.drain(..go).collect();
            all.append(&mut wrs);
            wrs = all;
        }
        if wrs.is_empty() {
            return Ok(());
        }
        // The slots of its Writes and Reads, to free if the post is refused, and how many of
        // each, to count (no allocation without any).
        let (mut slots, mut writes, mut reads) = (SmallVec::<[usize; 4]>::new(), 0, 0);
        for w in &wrs {
            match w.wr_id & KIND_MASK {
                KIND_WRITE => writes += 1,
                KIND_READ => reads += 1,
                _ => continue,
            }
            slots.push((w.wr_id & !KIND_MASK) as usize);
        }
        if writes > 0 || wrs.iter().any(is_atomic) {
            self.wait_fence()?;
        }
        self.doorbells += 1;
        let s = self.session()?;
        rpma_common::steps::step("send list posted");
        let r = s.qp().post_send_list(wrs).map_err(|e| post_error(s, e));
        match &r {
            Ok(()) => {
                self.writes_posted += writes;
                self.reads_posted += reads;
                self.note_posted();
                self.pool.settle_superseded(&slots);
            }
            Err(e) if !e.is_connection_loss() => self.unpost(slots),
            Err(_) => {}
        }
        r
    }

    /// After a post refused for another reason than a lost connection (nothing was posted):
    /// the slots of its Writes and Reads are free again, so that none stays in flight with no
    /// request to complete it (until the next time-out or reconnect, a batch Read's slot did).
    /// A started Read's ticket is then void, as after a lost connection (the error says so to
    /// the caller).
    fn unpost(&mut self, slots: impl IntoIterator<Item = usize>) {
        for slot in slots {
            match self.pool.get(slot) {
                Some(Slot::Writing(_)) => self.pool.unpost_write(slot),
                Some(Slot::Reading { .. } | Slot::Started { .. }) => {
                    self.pool.set(slot, Slot::Free)
                }
                _ => {}
            }
        }
        // The held writes the freed ones superseded stay held.
        self.pool.settle_superseded(&[]);
    }

    /// Bytes of the started Reads not posted yet.
    fn deferred_read_bytes(&self) -> usize {
        self.deferred.iter().map(read_len).sum()
    }

    /// How many of the deferred requests, in order, may go now: all of them but for the first
    /// started Read that would take the Reads in flight beyond the read bound
    /// ([`QueueOptions::read_bytes_in_flight`](crate::QueueOptions::read_bytes_in_flight); a
    /// Read alone always goes) and everything behind it (a fenced Write must not pass it, nor
    /// a Write a later Read's answer says is placed). They go as completions make room: every
    /// poll posts what fits, so the caller goes on starting and answering meanwhile.
    fn deferred_that_fit(&self) -> usize {
        if self.read_bound == 0 {
            return self.deferred.len();
        }
        // The pool counts the deferred Reads among its Reads in flight.
        let mut reading = self
            .pool
            .read_bytes_in_flight()
            .saturating_sub(self.deferred_read_bytes());
        for (i, wr) in self.deferred.iter().enumerate() {
            let len = read_len(wr);
            if len > 0 && reading > 0 && reading + len > self.read_bound {
                return i;
            }
            reading += len;
        }
        self.deferred.len()
    }

    /// After a post: the most requests, and bytes of Reads, in flight (what the pool counts
    /// less what is still deferred).
    pub(super) fn note_posted(&mut self) {
        let posted = self.pool.in_flight().saturating_sub(self.deferred.len());
        let reading = self
            .pool
            .read_bytes_in_flight()
            .saturating_sub(self.deferred_read_bytes());
        self.max_posted = self.max_posted.max(posted);
        self.max_posted_read_bytes = self.max_posted_read_bytes.max(reading);
    }

    /// Waits out the connection's fence, if another queue of it gave up a connection that may
    /// still deliver older Writes until the target expires it
    /// ([`ReplayOrder::fence_until`](crate::replay::ReplayOrder::fence_until)): called before
    /// every post with Writes or an atomic. Its own session's keep-alives go on meanwhile
    /// (silent for the whole fence, the target would expire it too).
    pub(super) fn wait_fence(&mut self) -> Result<()> {
        while let Some(left) = self.pool.fence_left() {
            let s = self.session.as_mut().ok_or(Error::Broken)?;
            // Its echoes are not read meanwhile: the silence is this wait's, not the target's.
            match s.tick() {
                Err(Error::KeepAliveLost { .. }) | Ok(()) => {}
                Err(e) => return Err(e),
            }
            let nap = left.min(s.keep_alive() / 4).max(Duration::from_millis(1));
            std::thread::sleep(nap);
        }
        Ok(())
    }

    /// Posts one request that is not a Write through a slot (a Read, an APM Read, an atomic, a
    /// Flush): directly when no started request waits to go first, else behind them. A Read
    /// through a slot that is refused frees its slot, as [`post_list`](Self::post_list) does.
    pub(super) fn post_one(&mut self, wr: SendWr) -> Result<()> {
        if !self.deferred.is_empty() {
            return self.post_list(smallvec::smallvec![wr]);
        }
        let read = (wr.wr_id & KIND_MASK == KIND_READ).then_some((wr.wr_id & !KIND_MASK) as usize);
        if is_atomic(&wr) {
            self.wait_fence()?;
        }
        self.doorbells += 1;
        let s = self.session()?;
        if let Err(e) = s.qp().post_send(wr).map_err(|e| post_error(s, e)) {
            if !e.is_connection_loss() {
                self.unpost(read);
            }
            return Err(e);
        }
        self.reads_posted += u64::from(read.is_some());
        self.note_posted();
        Ok(())
    }
}

/// Whether `wr` is an atomic (fenced as Writes are: a connection given up may still execute
/// an older one).
fn is_atomic(wr: &SendWr) -> bool {
    matches!(
        wr.op,
        SendOp::CompareSwap { .. } | SendOp::FetchAdd { .. } | SendOp::AtomicWrite { .. }
    )
}

/// The bytes a request reads (0: not a Read).
fn read_len(wr: &SendWr) -> usize {
    match &wr.op {
        SendOp::Read { local, .. } => local.len,
        _ => 0,
    }
}

/// Posting fails locally; a queue pair in Error means the connection is gone.
pub(super) fn post_error(s: &Session, e: rpma_common::fabric::Error) -> Error {
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
