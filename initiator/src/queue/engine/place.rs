//! What the engine knows of its Writes' placement, for the other queues of its connection
//! ([`crate::replay`]). A Write completes when the transport took it (on `tcp`, as in iWARP);
//! a Read posted after it is answered only once the target executed it. So the queue learns
//! that its writes up to a post order are placed when such a Read is answered: a started Read
//! (its ticket is its post order), or a placement Read its caller asks for
//! ([`Engine::place_writes`]), or a probe: while other queues share the connection, the
//! engine sends a KeepAlive behind every [`PROBE_EVERY`] requests (one out at a time) and
//! learns from its echo, so that another queue seldom finds this one's writes not known
//! placed. A probe, not a Read: a send queue completes in order, so every Write posted behind
//! a Read completes only once the Read was answered, a round trip later instead of when TCP
//! took it (a Read every 16 requests took the NBD export's 4 KiB random writes over four
//! connections to 0.71x: docs/benchmarks.md); a KeepAlive's echo is a receive, apart from
//! the send queue.

use rpma_common::fabric::{RemoteAddr, SendOp, SendWr};

use super::Engine;
use crate::error::{Error, Result};
use crate::queue::completion::Ticket;

/// Requests (by post order) after the last probe before the next, while the queue shares its
/// connection: a KeepAlive (and its echo) for every 16 requests at most.
const PROBE_EVERY: u64 = 16;

impl Engine {
    /// Sends a probe if one is due (none is out, no started request waits to be posted, and
    /// another queue's caller asked, [`Pool::want_placed`](crate::pool::Pool), or the queue is
    /// in the replay order with writes not known placed and [`PROBE_EVERY`] requests were
    /// posted since the last): call after posting and before waiting. An ask is answered even
    /// when every write is known placed: a queue that reconnected since may need it known
    /// again ([`crate::replay`]'s heirs). A queue that only reads, unasked, sends none.
    pub(super) fn probe_if_due(&mut self) -> Result<()> {
        let seq = self.pool.last_seq();
        // Started requests held back by the read bound are not posted: a probe now would
        // answer for them too.
        if self.probe.is_some() || !self.deferred.is_empty() {
            return Ok(());
        }
        // Taken either way: nothing unplaced answers an ask, and so does this probe.
        let asked = self.pool.take_want();
        if !asked && (!self.pool.unplaced() || seq < self.probe_mark + PROBE_EVERY) {
            return Ok(());
        }
        let sent = self.pool.order_now();
        let ka = self.session.as_mut().ok_or(Error::Broken)?.probe()?;
        self.probe = Some((ka, seq, sent));
        self.probe_mark = seq;
        Ok(())
    }

    /// After a poll: the probe out was echoed, so the writes it follows are placed.
    pub(super) fn probe_answered(&mut self) {
        let Some((ka, seq, sent)) = self.probe else {
            return;
        };
        if self.session.as_ref().is_some_and(|s| s.echoed() >= ka) {
            self.probe = None;
            self.pool.placed_fresh(seq, sent);
        }
    }

    /// A Read of 8 bytes of namespace `ns` into the placement sink (apart from the sink of
    /// APM Reads and atomics: its answer may come during an atomic's wait).
    fn placement_read(&mut self, ns: usize) -> SendWr {
        let d = &self.descs[ns];
        let op = SendOp::Read {
            local: self.pool.placement_sge(),
            remote: RemoteAddr {
                addr: d.remote_addr,
                rkey: d.rkey,
            },
        };
        self.waited_wr(op)
    }

    /// The started Read `t` was answered: every write posted before it is placed.
    pub(super) fn read_answered(&mut self, t: Ticket) {
        self.pool.placed_through(t.0.saturating_sub(1));
    }

    /// Has every Write this queue posted placed on the target: a placement Read of namespace
    /// `ns` posted behind them (started ones not posted yet go first), waited for.
    pub(in crate::queue) fn place_writes(&mut self, ns: usize) -> Result<()> {
        let seq = self.pool.last_seq();
        let sent = self.pool.order_now();
        let wr = self.placement_read(ns);
        let id = wr.wr_id;
        self.post_one(wr)?;
        self.wait_for_request(ns, "placement read", id)?;
        self.pool.placed_fresh(seq, sent);
        self.pool.take_want();
        Ok(())
    }

    /// The queues of the connection (this one too) that may hold writes of `len` bytes at
    /// `offset` of namespace `ns` not known placed (their [`Pool::order_id`](crate::pool::Pool)s).
    pub(in crate::queue) fn unplaced_writers(
        &mut self,
        ns: usize,
        offset: u64,
        len: usize,
    ) -> Vec<u64> {
        self.pool.unplaced_writers(ns, offset, len)
    }

    /// The connection is lost: nothing of this queue is known placed any more (what it
    /// re-issues is on its way again).
    pub(super) fn forget_placement(&mut self) {
        self.probe = None;
        self.probe_mark = 0;
        self.pool.unplace();
    }
}
