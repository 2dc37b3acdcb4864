//! The export's FLUSH across the queues of every connection, and the placement of other
//! connections' writes a request waits for (NBD's `CAN_MULTI_CONN`: one view of the export).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use log::Level;

use super::{Cell, Shared};
use crate::nbd::slots::Source;
use crate::Error;

/// Persists a FLUSH tries at most for a queue that owes bytes of other queues' writes
/// ([`Shared::flush_all`]). A queue named is named again only while no write of those bytes
/// is known placed since the reconnect (its client's rewrites after a placement do not count:
/// the placed write vouches for the bytes, until it or the owing queue reconnects), so a
/// round that names it again found it unable to place (reconnecting in its turn, or its link
/// slow): the rounds are counted, each one request's round trip per queue named.
const PLACE_ROUNDS: usize = 8;

/// Whether `e`, from a persist of a queue's own writes, is for bytes of other queues' writes
/// it owes: their own persists, or their placement, may settle it.
fn owes_others(e: &Error) -> bool {
    matches!(
        e,
        Error::RewritesNotPlaced { .. } | Error::ApmNotForRanges { .. }
    )
}

impl Shared {
    /// Makes every write acknowledged so far, on any connection, durable (FLUSH): each queue's
    /// own held writes are exactly the ones it acknowledged and did not make durable yet (a FUA
    /// write already is), so `persist_own_writes` on every queue that has some covers them all
    /// (one APM Read on dax, a Flush per written range, or GPSPM). Takes one cell at a time:
    /// the caller holds none. Ok(false) when the namespace is volatile (visible only): unless
    /// visible_ok, those writes stay pending, so that no later FLUSH claims them.
    ///
    /// A queue that reconnected may owe bytes newer writes of other queues hold
    /// ([`Error::RewritesNotPlaced`], or [`Error::ApmNotForRanges`] where only APM may make
    /// them durable): its cell goes after every other one, whose own persists release those
    /// writes (after which it owes nothing for them), and then has the queues named place
    /// their writes (a failure said within the log limits of `source`, the client whose FLUSH
    /// it is) and persists again, for a few rounds ([`PLACE_ROUNDS`]).
    ///
    /// A cell is marked clean only once its writes are durable, under its lock: a FLUSH of
    /// another connection meanwhile finds it still dirty and waits for the lock, and so
    /// answers after this one's persist, never before it (a flag cleared before the persist
    /// let that FLUSH skip the cell and answer success while the writes were still on their
    /// way: `a_flush_waits_for_another_connections_flush_of_the_same_writes`).
    pub(crate) fn flush_all(&self, source: Source) -> crate::Result<bool> {
        let r = self.flush_all_inner(source);
        if let Err(Error::RewritesLost { .. }) = &r {
            // Reported once by the library: counted as a queue that gave up is, so that every
            // connection's next FLUSH answers EIO, not only this one.
            self.losses.fetch_add(1, Ordering::SeqCst);
        }
        if r.is_err() {
            // Answered with an error: its client hears that something failed (a cell's error
            // that a later round got past is not an answer).
            self.told();
        }
        r
    }

    fn flush_all_inner(&self, source: Source) -> crate::Result<bool> {
        let mut durable = true;
        let mut owing = Vec::new();
        for cell in self.cells() {
            match self.flush_cell(&cell) {
                Ok(d) => durable &= d,
                Err(e) if owes_others(&e) => owing.push(cell),
                Err(e) => return Err(e),
            }
        }
        for cell in owing {
            durable &= self.flush_owing(&cell, source)?;
        }
        Ok(durable)
    }

    /// Persists the writes of `cell`'s queue if it has some that no FLUSH made durable yet:
    /// whether they are durable now (or visible, with `visible_ok`).
    fn flush_cell(&self, cell: &Cell) -> crate::Result<bool> {
        if !cell.is_dirty() {
            return Ok(true);
        }
        let mut g = self.lock(cell);
        // Another FLUSH may have made them durable while this one waited for the lock.
        if !cell.is_dirty() {
            return Ok(true);
        }
        let d = self.with_ns(cell, &mut g, |ns| ns.persist_own_writes())?;
        if d.is_durable() || self.opts.visible_ok {
            cell.mark_clean();
            return Ok(true);
        }
        Ok(false)
    }

    /// [`flush_cell`](Self::flush_cell) for a cell that owed bytes of other queues' writes,
    /// after the other cells: each round has the queues it names place their writes, or, for
    /// APM, the other cells persist theirs again (their clients wrote since), and persists
    /// again.
    fn flush_owing(&self, cell: &Cell, source: Source) -> crate::Result<bool> {
        let mut round = 1;
        loop {
            let e = match self.flush_cell(cell) {
                Err(e) if owes_others(&e) && round < PLACE_ROUNDS => e,
                r => return r,
            };
            round += 1;
            if let Error::RewritesNotPlaced { queues, .. } = &e {
                self.place_writes_of(queues, cell, source);
                continue;
            }
            for other in self.cells() {
                if std::ptr::eq(&*other, cell) {
                    continue;
                }
                // One that owes in its turn has its own round to come.
                if let Err(e) = self.flush_cell(&other) {
                    if !owes_others(&e) {
                        return Err(e);
                    }
                }
            }
        }
    }

    /// The cell other than `me` whose queue is `id` ([`Queue::order_id`]), if one is.
    pub(crate) fn cell_of(&self, id: u64, me: &Cell) -> Option<Arc<Cell>> {
        self.cells()
            .into_iter()
            .find(|c| !std::ptr::eq(&**c, me) && c.order.load(Ordering::SeqCst) == id)
    }

    /// Has the queues `ids` ([`Queue::order_id`]s) other than `me`'s place every write they
    /// sent: before a request of `me`'s client on bytes those writes covered, which another
    /// connection answered (NBD's `CAN_MULTI_CONN`: the connections share one view of the
    /// export). Takes one cell at a time: the caller holds none. A queue that fails here lost
    /// its connection: its writes are re-issued, or reported lost, as for any request.
    pub(crate) fn place_writes_of(&self, ids: &[u64], me: &Cell, source: Source) {
        self.place(ids, me, true, source);
    }

    /// [`place_writes_of`](Self::place_writes_of) for the queues no thread holds, without
    /// waiting for a lock; returns the others (held: busy with their client's requests). The
    /// caller may hold `me`.
    pub(crate) fn place_if_idle(&self, ids: &[u64], me: &Cell, source: Source) -> Vec<u64> {
        self.place(ids, me, false, source)
    }

    /// Places the writes of the queues `ids` other than `me`'s, locking each cell in turn
    /// (`wait`) or only the ones free now: the ids of the others. A failure is said within
    /// the log limits of `source`, whose request asked for the placement.
    fn place(&self, ids: &[u64], me: &Cell, wait: bool, source: Source) -> Vec<u64> {
        let mut busy = Vec::new();
        for cell in self.cells() {
            let id = cell.order.load(Ordering::SeqCst);
            if std::ptr::eq(&*cell, me) || !ids.contains(&id) {
                continue;
            }
            let g = if wait {
                Some(self.lock(&cell))
            } else {
                cell.queue.try_lock().ok()
            };
            let Some(mut g) = g else {
                busy.push(id);
                continue;
            };
            if g.is_none() {
                continue;
            }
            // Not an answer to a client (the request that asked is answered as its own
            // queue says): a loss this reveals is still owed to every connection's FLUSH.
            if let Err(e) = self.with_ns(&cell, &mut g, |ns| ns.place_writes()) {
                self.problems.log(
                    Level::Warn,
                    source,
                    format_args!(
                        "nbd: placing another connection's writes failed: {}",
                        rpma_common::error_chain(&e)
                    ),
                );
            }
        }
        busy
    }
}
