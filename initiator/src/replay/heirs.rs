//! What a queue's persist of its own writes still owes for the writes it let go at a
//! reconnect because newer writes of other queues of the connection had taken their bytes
//! (its re-issue writes only the pieces a write still owns: [`super`]).
//!
//! Such a write is not durable, and its queue no longer holds it: the bytes are the newer
//! writes' now, and those are durable only once their own queues persist them, or on the
//! target at all only once those queues placed them (a target restarted under the
//! power-loss simulation, or a real one, kept nothing unpersisted). So the queue that let it
//! go is their heir ([`Heir`]): it keeps those bytes, and its `persist_own_writes` says
//! durable only once every one of them is ([`Member::handed`]):
//! - bytes a newer write of another queue still holds are made durable by the heir itself
//!   (a FLUSH or GPSPM of them), but only once that write is known placed through a request
//!   its queue sent after the heir's last reconnect ([`Member::placed_fresh`]): a placement
//!   learned before says nothing of a target that restarted since. Until then the persist
//!   fails, naming those queues, and asks them to learn their placement. Once such a write is
//!   known placed, a yet newer write of the bytes does not put that off again: they are
//!   vouched for ([`Heir::vouched`]) until the vouching queue or the heir reconnects (a
//!   client rewriting them faster than a placement's round trip kept every persist waiting);
//! - bytes whose newer write was let go unpersisted (its queue gave up or was dropped while
//!   holding it, or freed its slot after a visibility Read only: [`Member::lose`]) may hold
//!   neither write: the persist fails with that, once. Such a write's pieces are marked lost
//!   until its release (which may come a visibility Read later), so a hand-over in between
//!   counts them lost. A released loss before the heir let its write go leaves no trace of
//!   its bytes in the map (a durable release leaves none either), so
//!   there it counts every byte whose newer write is gone as lost if any write of the
//!   connection was let go unpersisted since the heir last held nothing or re-issued
//!   ([`Member::hand_over`]): a loss reported that a durable write would not have needed,
//!   never a durable said over a lost one;
//! - bytes whose newer write was made durable and released need nothing more (nor bytes this
//!   queue wrote again: its own persist covers them).

use std::collections::HashMap;
use std::sync::atomic::Ordering;

use super::heir::{merged, without, Handed, Heir};
use super::{Inner, Member, ReplayOrder, Writer, TOMBSTONE};

impl ReplayOrder {
    /// The clock's reading, for a request about to be sent that will tell its queue's writes
    /// placed ([`Member::placed_fresh`]).
    pub(crate) fn now(&self) -> u64 {
        self.clock.load(Ordering::SeqCst)
    }

    /// A new reading of the clock, after every reading [`now`](Self::now) gave so far.
    fn tick(&self) -> u64 {
        self.clock.fetch_add(1, Ordering::SeqCst) + 1
    }

    /// The pieces of `[start, end)` of `nsid` that `owner` still owns are let go unpersisted:
    /// every other queue that let those bytes go to them loses them, and a queue that lets
    /// released bytes go later may have lost them ([`Member::hand_over`]).
    fn mark_lost(&self, nsid: u32, start: u64, end: u64, owner: Writer) {
        let mut inner = self.lock();
        let Inner { pieces, heirs, .. } = &mut *inner;
        // Marked in the pieces too: the release comes later (after a visibility Read, or in
        // a loop of its own), and a queue that lets these bytes go meanwhile must not count
        // them as held, nor, once released, as a gap a durable write left.
        let owned: Vec<(u64, u64)> = pieces
            .range_mut((nsid, start)..(nsid, end))
            .filter(|(_, p)| p.owner == owner)
            .map(|(&(_, s), p)| {
                p.lost = true;
                (s, p.end)
            })
            .collect();
        if owned.is_empty() {
            return;
        }
        self.last_loss.fetch_max(self.tick(), Ordering::SeqCst);
        for (_, h) in heirs.iter_mut().filter(|(&q, _)| q != owner.queue) {
            let mut lost = Vec::new();
            // Vouched bytes too: the placement that vouched for them says nothing once the
            // write that took them is let go (its queue may have given up on a target that
            // restarted and kept neither).
            let vouched = h.vouched_spans();
            for &(n, s, e) in h.ranges.iter().chain(&vouched).filter(|r| r.0 == nsid) {
                for &(ps, pe) in &owned {
                    let (lo, hi) = (s.max(ps), e.min(pe));
                    if lo < hi {
                        lost.push((n, lo, hi));
                    }
                }
            }
            h.lost.append(&mut lost);
        }
    }

    /// Drops `queue`'s entry once it holds nothing.
    fn drop_heir_if_empty(&self, heirs: &mut HashMap<u64, Heir>, queue: u64) {
        if heirs.get(&queue).is_some_and(Heir::is_empty) {
            self.drop_heir(heirs, queue);
        }
    }

    /// `[start, end)` of `nsid` is taken by a write being registered: of the bytes an heir
    /// still owes there, those no write holds (a gap or a tombstone: their write was made
    /// durable and released, or let go unpersisted and marked lost first) or the heir's own
    /// write holds (its own persist covers that write's whole range) need nothing more from
    /// it, and those whose write is known placed since its reconnect it makes durable as they
    /// are ([`Heir::vouched`]): any write of them newer than the one it let go will do, and
    /// waiting for the newest one's placement would wait for ever on a client that rewrites
    /// the bytes faster than a placement's round trip (the NBD export's FLUSH gave up after
    /// its rounds and answered EIO). A gap never stands for a write its queue superseded: the
    /// queue frees that one only once the new one is registered and posted
    /// ([`Pool::settle_superseded`](crate::pool::Pool::settle_superseded)). A piece of a write
    /// let go unpersisted stays owed: its loss is counted ([`mark_lost`](Self::mark_lost)).
    pub(super) fn taken_from_heirs(inner: &mut Inner, nsid: u32, start: u64, end: u64) {
        let Inner {
            pieces,
            heirs,
            fresh,
            ..
        } = inner;
        for (&q, h) in heirs.iter_mut() {
            // Most writes touch nothing an heir owes: a binary search, no allocation.
            h.sort();
            let window = h.overlapping(nsid, start, end);
            if window.is_empty() {
                continue;
            }
            let mut cut = Vec::new();
            let mut vouched = Vec::new();
            for &(_, s, e) in &h.ranges[window.clone()] {
                let (s, e) = (s.max(start), e.min(end));
                if s >= e {
                    continue;
                }
                let before = pieces
                    .range((nsid, 0)..(nsid, s))
                    .next_back()
                    .filter(|(_, p)| p.end > s);
                let mut at = s;
                for (&(_, ps), p) in before.into_iter().chain(pieces.range((nsid, s)..(nsid, e))) {
                    let (ps, pe) = (ps.max(s), p.end.min(e));
                    if ps > at {
                        cut.push((at, ps));
                    }
                    at = at.max(pe);
                    let w = p.owner;
                    if p.lost {
                        continue;
                    }
                    if w == TOMBSTONE || w.queue == q {
                        cut.push((ps, pe));
                    } else if fresh
                        .get(&w.queue)
                        .is_some_and(|&(seq, sent)| seq >= w.seq && sent >= h.since)
                    {
                        cut.push((ps, pe));
                        vouched.push((nsid, ps, pe, w.queue));
                    }
                }
                if at < e {
                    cut.push((at, e));
                }
            }
            if cut.is_empty() {
                continue;
            }
            cut.sort_unstable();
            let owed: Vec<(u64, u64)> = h.ranges[window.clone()]
                .iter()
                .map(|&(_, s, e)| (s, e))
                .collect();
            let kept = without(&owed, &cut);
            // Still sorted and merged: the window's spans, cut, in their place.
            h.ranges
                .splice(window, kept.into_iter().map(|(s, e)| (nsid, s, e)));
            h.vouched.append(&mut vouched);
        }
    }

    /// `queue` no longer knows its writes placed (it reconnected, or went): the bytes it
    /// vouched for are owed as before, until a placement vouches again.
    pub(super) fn unvouch(inner: &mut Inner, queue: u64) {
        for h in inner.heirs.values_mut() {
            let ranges = &mut h.ranges;
            let mut moved = false;
            h.vouched.retain(|&(n, s, e, by)| {
                if by == queue {
                    ranges.push((n, s, e));
                    moved = true;
                }
                by != queue
            });
            h.sorted &= !moved;
        }
    }

    /// Drops `queue`'s entry (it is gone, or holds nothing).
    pub(super) fn drop_heir(&self, heirs: &mut HashMap<u64, Heir>, queue: u64) {
        if heirs.remove(&queue).is_some() {
            self.heirs.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

impl Member {
    /// This queue re-issues its held writes on a new connection: placements other queues
    /// learned before vouch for none of the bytes it let go ([`Heir::since`]).
    pub(crate) fn reissuing(&mut self) {
        self.reissue_from = self.order.now();
        if self.order.heirs.load(Ordering::SeqCst) == 0 {
            return;
        }
        let since = self.order.tick();
        if let Some(h) = self.order.lock().heirs.get_mut(&self.queue) {
            h.since = since;
            // Placements learned before vouch for nothing now.
            let vouched = h.vouched_spans();
            h.vouched.clear();
            h.sorted &= vouched.is_empty();
            h.ranges.extend(vouched);
        }
    }

    /// This queue re-issued (or let go) every write it held: the bytes of a write it still
    /// holds were its own when the re-issue began, so only a write let go unpersisted since
    /// could have been newer ([`hand_over`](Self::hand_over)).
    pub(crate) fn reissued(&mut self) {
        self.settled = self.settled.max(self.reissue_from);
    }

    /// This queue holds no write any more: every write it holds from now on is newer than
    /// the writes let go unpersisted so far.
    pub(crate) fn emptied(&mut self) {
        self.settled = self.settled.max(self.order.now());
    }

    /// This queue's re-issue lets the held write of `len` bytes at `offset` of namespace
    /// index `ns` (post order `seq`) go, or re-issues only part of it, because newer writes
    /// took the rest (call before its slot is freed). Of those bytes, the ones a newer write
    /// of another queue holds are this queue's to vouch for ([`handed`](Self::handed)); the
    /// ones whose newer write is let go unpersisted and not yet released are lost; the ones
    /// whose newer write is gone were made durable, or were let go unpersisted: lost, if any
    /// write of the connection was let go unpersisted since this queue last held nothing or
    /// re-issued (the map keeps no trace of how a released write went).
    pub(crate) fn hand_over(&mut self, ns: usize, offset: u64, len: usize, seq: u64) {
        let Some((nsid, start, end, _)) = self.at(ns, offset, len, seq) else {
            return;
        };
        let since = self.order.tick();
        let mut inner = self.order.lock();
        // Under the lock: a loss marks before its release, so a gap seen here is counted.
        let may_be_lost = self.order.last_loss.load(Ordering::SeqCst) > self.settled;
        let Inner { pieces, heirs, .. } = &mut *inner;
        let before = pieces
            .range((nsid, 0)..(nsid, start))
            .next_back()
            .filter(|(_, p)| p.end > start);
        let inside = pieces.range((nsid, start)..(nsid, end));
        let (mut held, mut gone, mut lost) = (Vec::new(), Vec::new(), Vec::new());
        let mut at = start;
        for (&(_, s), p) in before.into_iter().chain(inside) {
            let (s, e) = (s.max(start), p.end.min(end));
            if s > at {
                gone.push((nsid, at, s));
            }
            at = at.max(e);
            if p.lost && p.owner.queue != self.queue {
                lost.push((nsid, s, e));
            } else if p.owner == TOMBSTONE {
                gone.push((nsid, s, e));
            } else if p.owner.queue != self.queue {
                held.push((nsid, s, e));
            }
        }
        if at < end {
            gone.push((nsid, at, end));
        }
        if may_be_lost {
            lost.append(&mut gone);
        }
        if held.is_empty() && lost.is_empty() {
            return;
        }
        let h = heirs.entry(self.queue).or_insert_with(|| {
            self.order.heirs.fetch_add(1, Ordering::SeqCst);
            Heir::default()
        });
        h.since = h.since.max(since);
        h.sorted &= held.is_empty();
        h.ranges.append(&mut held);
        h.lost.append(&mut lost);
    }

    /// What this queue's persist of its own writes of namespace index `ns` owes for the bytes
    /// it let go to newer writes ([`Handed`]; the module's doc).
    pub(crate) fn handed(&self, ns: usize) -> Handed {
        let nothing = Handed::Persist(Vec::new());
        let Some(&nsid) = self.nsids.get(ns) else {
            return nothing;
        };
        if self.order.heirs.load(Ordering::SeqCst) == 0 {
            return nothing;
        }
        let inner = self.order.lock();
        let Some(h) = inner.heirs.get(&self.queue) else {
            return nothing;
        };
        let lost = merged(&h.lost, nsid);
        if !lost.is_empty() {
            return Handed::Lost(lost);
        }
        let mut unplaced = Vec::new();
        let mut persist = Vec::new();
        // The bytes still owed, and (true) those vouched for: placed since the reconnect.
        let owed = merged(&h.ranges, nsid).into_iter().map(|r| (r, false));
        let vouched = merged(&h.vouched_spans(), nsid)
            .into_iter()
            .map(|r| (r, true));
        for ((s, e), vouched) in owed.chain(vouched) {
            let before = inner
                .pieces
                .range((nsid, 0)..(nsid, s))
                .next_back()
                .filter(|(_, p)| p.end > s);
            let inside = inner.pieces.range((nsid, s)..(nsid, e));
            for (&(_, ps), p) in before.into_iter().chain(inside) {
                let w = p.owner;
                // Released since (durable: a loss is marked) or this queue's own: nothing to
                // do.
                if w == TOMBSTONE || w.queue == self.queue {
                    continue;
                }
                let placed = vouched
                    || inner
                        .fresh
                        .get(&w.queue)
                        .is_some_and(|&(seq, sent)| seq >= w.seq && sent >= h.since);
                if placed {
                    persist.push((nsid, ps.max(s), p.end.min(e)));
                } else {
                    unplaced.push(w.queue);
                }
            }
        }
        if !unplaced.is_empty() {
            unplaced.sort_unstable();
            unplaced.dedup();
            return Handed::Unplaced(unplaced);
        }
        Handed::Persist(merged(&persist, nsid))
    }

    /// A persist of this queue's own writes of namespace index `ns` covered everything
    /// [`handed`](Self::handed) named: the bytes it let go there need nothing more. (A loss
    /// marked meanwhile is of a write found placed, whose bytes that persist covered.)
    pub(crate) fn settle_handed(&mut self, ns: usize) {
        self.forget_handed(ns, |_, _| Vec::new());
    }

    /// The loss [`handed`](Self::handed) found on namespace index `ns` was reported: those
    /// bytes are forgotten, the others still owed.
    pub(crate) fn lost_reported(&mut self, ns: usize) {
        self.forget_handed(ns, without);
    }

    /// Replaces this queue's ranges of namespace index `ns` by what `keep` makes of them and
    /// their losses, and forgets those losses.
    fn forget_handed(
        &mut self,
        ns: usize,
        keep: impl Fn(&[(u64, u64)], &[(u64, u64)]) -> Vec<(u64, u64)>,
    ) {
        let Some(&nsid) = self.nsids.get(ns) else {
            return;
        };
        if self.order.heirs.load(Ordering::SeqCst) == 0 {
            return;
        }
        let mut inner = self.order.lock();
        let Some(h) = inner.heirs.get_mut(&self.queue) else {
            return;
        };
        let lost = merged(&h.lost, nsid);
        let kept = keep(&merged(&h.ranges, nsid), &lost);
        let mut vouched = Vec::new();
        for &(n, s, e, by) in h.vouched.iter().filter(|v| v.0 == nsid) {
            vouched.extend(
                keep(&[(s, e)], &lost)
                    .into_iter()
                    .map(|(s, e)| (n, s, e, by)),
            );
        }
        h.ranges.retain(|r| r.0 != nsid);
        h.lost.retain(|r| r.0 != nsid);
        h.vouched.retain(|v| v.0 != nsid);
        h.ranges.extend(kept.into_iter().map(|(s, e)| (nsid, s, e)));
        h.sorted = false;
        h.vouched.append(&mut vouched);
        self.order.drop_heir_if_empty(&mut inner.heirs, self.queue);
    }

    /// A write of this queue is let go unpersisted (the queue gave up or goes, or it freed
    /// the slot after a visibility Read only): the queues that let its bytes go to it lose
    /// them. Call before it is released (the queue entered).
    pub(crate) fn lose(&self, ns: usize, offset: u64, len: usize, seq: u64) {
        if let Some((nsid, s, e, w)) = self.at(ns, offset, len, seq) {
            self.order.mark_lost(nsid, s, e, w);
        }
    }

    /// Every write of this queue up to post order `seq` is placed, told by a request sent
    /// when the order's clock read `sent` ([`ReplayOrder::now`]): it vouches for them to the
    /// queues that reconnected before ([`handed`](Self::handed)).
    pub(crate) fn placed_fresh(&mut self, seq: u64, sent: u64) {
        // No queue owes anything: nothing to vouch for (one that became an heir since the
        // request was sent, in that instant, only asks again).
        if self.order.heirs.load(Ordering::SeqCst) > 0 {
            let mut inner = self.order.lock();
            let f = inner.fresh.entry(self.queue).or_insert((seq, sent));
            // Both grow with the time a request was sent.
            *f = (f.0.max(seq), f.1.max(sent));
        }
        self.placed_through(seq);
    }
}

#[cfg(test)]
mod tests;
