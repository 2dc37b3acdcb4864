//! A client's requests and the other connections' writes of their bytes: which queues hold
//! such writes not known placed yet, and the two ways a request lands after them: held back
//! while the connection's other requests go on, or waited for in line.
//!
//! A WRITE answered on one connection may still be on its way to the target when a request of
//! another connection comes for the same bytes (`CAN_MULTI_CONN`: that request must land after
//! it, or read it). Waiting for it in line (this connection's started requests complete, then
//! it takes the other connection's queue, or has it place its writes) stalls the whole
//! connection on a hand-off between two busy threads: 4 KiB random writes over four
//! connections ran at 0.73x of the export without the ordering (docs/benchmarks.md). So such
//! a request is held back instead (a WRITE's payload copied, up to [`MAX_COPY`] bytes a
//! connection): the queues holding those writes are asked to learn their placement soon (a
//! busy one sends a probe with its next post or wait; an idle one places them at once), and
//! the connection looks again after each of its completions, or every [`LOOK`] while nothing
//! of it is in flight (watching for its client's next bytes meanwhile). What is held back
//! goes in the order it came; a later request on bytes it covers is held back behind it. It
//! goes the waiting way before a FLUSH, a FUA write or WRITE_ZEROES (they wait for everything
//! before them), when another thread wants this queue, at the client's end, and after
//! [`TRIES`] looks (another connection may keep rewriting those bytes).

use std::os::fd::AsFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use log::Level;

use nix::poll::{ppoll, PollFd, PollFlags};
use nix::sys::time::TimeSpec;

use super::super::pipeline::errno;
use super::super::proto::{self, simple_reply, EIO};
use super::super::shared::Cell;
use super::super::ConnError;
use super::held::{overlap, Data, Others, Parked};
use super::parse::{Action, Item};
use super::Client;

/// Looks (completions of this connection) a request is held back for at most.
const TRIES: u32 = 64;
/// How long a connection with nothing in flight waits for its client's next bytes before it
/// looks at what it holds back again.
const LOOK: Duration = Duration::from_micros(20);
/// A WRITE's payload is copied when it is held back: the copies of a connection's held-back
/// WRITEs take this many bytes at most (a WRITE that does not fit waits in line).
const MAX_COPY: usize = 1 << 20;

impl Client<'_> {
    /// Where `req` goes so that it lands after (or reads) every WRITE of its bytes another
    /// connection answered: a WRITE is answered once TCP took it, and may not be placed on
    /// the target yet when this request comes. None: this connection's queue (no other
    /// queue's write of these bytes is unplaced, or the others placed theirs now: each
    /// answers a Read). Some: the one other queue that holds such writes, when `route` and this
    /// queue holds none there (that queue's own order puts the request after them, without a
    /// round trip). Costs nothing while the export has one queue, a question to the shared
    /// replay order otherwise (its filter answers most without a lock); when another queue is
    /// named, this connection's started requests complete first and it lets its queue go
    /// (`CAN_MULTI_CONN`: every connection sees what any answered).
    pub(super) fn after_other_connections(
        &mut self,
        req: &proto::Request,
        route: bool,
    ) -> Result<Option<Arc<Cell>>, ConnError> {
        match self.others_unplaced(req) {
            Some(o) => self.wait_for_others(o, route),
            None => Ok(None),
        }
    }

    /// The other queues that hold writes of `req`'s bytes not known placed, and whether this
    /// connection's queue holds some too; None when no other queue does.
    pub(super) fn others_unplaced(&mut self, req: &proto::Request) -> Option<Others> {
        let (shared, cell) = (self.shared, self.cell);
        if !shared.several.load(Ordering::Relaxed) {
            return None;
        }
        let g = self.held.get_or_insert_with(|| shared.lock(cell));
        let len = usize::try_from(req.len).unwrap_or(usize::MAX);
        // A queue that gave up is replaced first, as for any request: asked without one, no
        // other queue seemed to hold these bytes, and the request went out on the new queue
        // ahead of writes other connections had answered. If it cannot be opened, the request
        // fails the same way where it is sent.
        let mut writers = shared
            .with_ns(cell, g, |ns| Ok(ns.unplaced_writers(req.offset, len)))
            .ok()?;
        let me = g.as_ref()?.order_id();
        let mine = writers.contains(&me);
        writers.retain(|&w| w != me);
        (!writers.is_empty()).then_some(Others { writers, mine })
    }

    /// The rest of [`after_other_connections`](Self::after_other_connections), once `o` was
    /// found: this connection's started requests complete and it lets its queue go; then the
    /// one other queue to route through, or the others placed their writes.
    pub(super) fn wait_for_others(
        &mut self,
        o: Others,
        route: bool,
    ) -> Result<Option<Arc<Cell>>, ConnError> {
        let (shared, cell) = (self.shared, self.cell);
        let Others { writers, mine } = o;
        self.stats.waited += 1;
        self.drain()?;
        self.held = None;
        if let ([one], true, false) = (writers.as_slice(), route, mine) {
            if let Some(c) = shared.cell_of(*one, cell) {
                return Ok(Some(c));
            }
        }
        shared.place_writes_of(&writers, cell, self.source);
        Ok(None)
    }

    /// A READ or a (non-FUA) WRITE through `other`'s queue (the one queue whose writes of its
    /// bytes may not be placed yet: [`after_other_connections`](Self::after_other_connections)),
    /// answered once it completed. This connection holds no queue meanwhile.
    pub(super) fn on_other(&mut self, other: &Cell, req: &proto::Request, a: Action, data: &Data) {
        let shared = self.shared;
        let (off, len, handle) = (req.offset, req.len as usize, req.handle);
        let mut g = shared.lock(other);
        // What this connection's own queue answered is credited to it, not to `other`'s cell
        // below (its started requests completed before it let its queue go).
        if self.pipe.take_written() > 0 {
            self.cell.mark_dirty();
        }
        if g.is_none() {
            // Its queue went since it was named: given up (what it held is reported lost) or
            // closed as a clean spare, and perhaps taken off the export's list, which a FLUSH
            // walks. A queue opened on it here would take a WRITE no FLUSH ever covers: the
            // request goes on this connection's own queue instead, behind nothing unplaced.
            drop(g);
            return self.start(req, a, data);
        }
        let (pipe, buf, bufs) = (&mut self.pipe, &self.buf, &self.bufs);
        let mut taken = false;
        if a != Action::Read {
            // Before it is started, as `start` does.
            other.mark_dirty();
        }
        let mut r = shared.with_ns(other, &mut g, |ns| {
            taken = true;
            let chunk = ns.chunk();
            match a {
                Action::Read => pipe.start_read(ns, chunk, handle, off, len),
                _ => pipe.start_write(ns, chunk, handle, off, data.payload(buf, bufs)),
            }
        });
        // As `drain`: the pipeline deals with errors (fails, or restarts after a reconnect);
        // a queue that gave up fails what is left.
        while !pipe.is_empty() {
            if g.is_none() {
                pipe.fail_all(EIO);
                break;
            }
            let c = shared.with_ns(other, &mut g, |ns| pipe.complete(ns));
            if r.is_ok() {
                r = c;
            }
        }
        if pipe.take_written() > 0 {
            other.mark_dirty();
        }
        drop(g);
        if let Err(e) = r {
            let what = if a == Action::Read { "READ" } else { "WRITE" };
            self.shared.problems.log(
                Level::Warn,
                self.source,
                format_args!(
                    "nbd: {what} on another connection's queue failed: {}",
                    rpma_common::error_chain(&e)
                ),
            );
            if !taken {
                if a != Action::Read {
                    self.shared.told();
                }
                simple_reply(&mut self.out, errno(&e, a != Action::Read), handle);
                self.answered(1);
            }
        }
        self.collect();
    }

    /// A READ or a (non-FUA) WRITE: started, held back, or started once the other
    /// connections' writes of its bytes are placed (the module doc).
    pub(super) fn read_or_write(&mut self, it: &Item, a: Action) -> Result<(), ConnError> {
        let behind = self.parked.iter().any(|p| overlap(&p.req, &it.req));
        let others = if behind {
            None
        } else {
            self.others_unplaced(&it.req)
        };
        // With nothing in flight yet, the rest of the batch may start something; if nothing
        // does, the loop lets it go the waiting way before it waits for the client.
        let copies: usize = self.parked.iter().map(|p| p.data.len()).sum();
        // A payload received in place goes the waiting way (not copied again).
        let can_park = it.from.is_none() && copies + it.payload.len() <= MAX_COPY;
        if (behind || others.is_some()) && can_park {
            if let Some(o) = &others {
                self.nudge(&o.writers);
            }
            let data = match a {
                Action::Read => Data::Own(Vec::new()),
                _ => Data::Own(self.buf.bytes()[it.payload.clone()].to_vec()),
            };
            self.stats.held_back += 1;
            self.parked.push(Parked {
                req: it.req,
                a,
                data,
                tries: 0,
            });
            return Ok(());
        }
        let others = match (behind, others) {
            (true, _) => {
                self.settle()?;
                self.others_unplaced(&it.req)
            }
            (false, o) => o,
        };
        let data = match it.from {
            Some(idx) => Data::Direct {
                idx,
                len: it.req.len as usize,
            },
            None => Data::Buf(it.payload.clone()),
        };
        match others {
            Some(o) => match self.wait_for_others(o, true)? {
                Some(other) => self.on_other(&other, &it.req, a, &data),
                None => self.start(&it.req, a, &data),
            },
            None => self.start(&it.req, a, &data),
        }
        Ok(())
    }

    /// After completions: starts what was held back and need not wait any more (in order: one
    /// behind an earlier held-back request on its bytes stays), asks again for the rest.
    pub(super) fn retry_parked(&mut self) -> Result<(), ConnError> {
        if self.parked.is_empty() {
            return Ok(());
        }
        let mut i = 0;
        while i < self.parked.len() {
            let req = self.parked[i].req;
            let behind = self.parked[..i].iter().any(|p| overlap(&p.req, &req));
            if !behind {
                match self.others_unplaced(&req) {
                    None => {
                        let p = self.parked.remove(i);
                        self.start(&p.req, p.a, &p.data);
                        continue;
                    }
                    Some(o) => self.nudge(&o.writers),
                }
            }
            self.parked[i].tries += 1;
            i += 1;
        }
        if self.parked.iter().any(|p| p.tries >= TRIES) {
            self.settle()?;
        }
        Ok(())
    }

    /// Nothing in flight, and requests held back: looks at them again every [`LOOK`] until
    /// one went (the loop waits for it), the client sent more (the loop takes it in) or
    /// [`TRIES`] looks; the connection's queue is free for others meanwhile.
    pub(super) fn wait_parked(&mut self) -> Result<(), ConnError> {
        while !self.parked.is_empty() {
            if self.eof {
                return self.settle();
            }
            self.held = None;
            let mut fds = [PollFd::new(self.stream.as_fd(), PollFlags::POLLIN)];
            let input =
                ppoll(&mut fds, Some(TimeSpec::from_duration(LOOK)), None).is_ok_and(|n| n > 0);
            // A look either way: a socket that stays readable (the read-ahead full) must not
            // keep this loop from counting its looks.
            self.retry_parked()?;
            if input || !self.pipe.is_empty() {
                return Ok(());
            }
        }
        Ok(())
    }

    /// Everything held back goes, in order, the waiting way; then every started request is
    /// answered.
    pub(super) fn settle(&mut self) -> Result<(), ConnError> {
        for p in std::mem::take(&mut self.parked) {
            match self.after_other_connections(&p.req, true)? {
                Some(other) => self.on_other(&other, &p.req, p.a, &p.data),
                None => self.start(&p.req, p.a, &p.data),
            }
        }
        self.drain()
    }

    /// Has the idle ones of the queues `ids` place their writes now, and asks the busy ones to
    /// learn their placement soon.
    fn nudge(&mut self, ids: &[u64]) {
        let (shared, cell) = (self.shared, self.cell);
        let busy = shared.place_if_idle(ids, cell, self.source);
        if busy.is_empty() {
            return;
        }
        let g = self.held.get_or_insert_with(|| shared.lock(cell));
        if let Some(q) = g.as_mut() {
            if let Ok(mut ns) = q.namespace(shared.opts.nsid) {
                ns.want_placed(&busy);
            }
        }
    }
}
