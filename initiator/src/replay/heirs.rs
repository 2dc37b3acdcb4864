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
mod tests {
    use std::sync::Arc;

    use super::*;

    /// An order with two queues in it: A and B.
    fn two() -> (Arc<ReplayOrder>, Member, Member) {
        let o = Arc::new(ReplayOrder::default());
        let mut a = Member::new(Arc::clone(&o), vec![1]);
        let b = Member::new(Arc::clone(&o), vec![1]);
        assert!(a.keep_order(Vec::new));
        (o, a, b)
    }

    /// [`two`], A's write of `len` bytes at 0 rewritten whole by B's, and A re-issued after a
    /// reconnect: A is B's heir for them.
    fn heir_of_b(len: usize) -> (Arc<ReplayOrder>, Member, Member) {
        let (o, mut a, mut b) = two();
        a.register(0, 0, len, 1);
        b.register(0, 0, len, 1);
        reissue(&mut a, 0, len);
        (o, a, b)
    }

    /// A re-issues its write (ns 0, `offset`, `len`, seq 1) after a reconnect.
    fn reissue(a: &mut Member, offset: u64, len: usize) {
        a.reissuing();
        a.hand_over(0, offset, len, 1);
        a.reissued();
    }

    #[test]
    fn bytes_let_go_to_a_held_write_are_owed_once_it_is_placed_since_the_reconnect() {
        let (o, mut a, mut b) = two();
        a.register(0, 0, 8192, 1);
        b.register(0, 4096, 4096, 1);
        let before = o.now();
        reissue(&mut a, 0, 8192);
        assert_eq!(a.handed(0), Handed::Unplaced(vec![b.id()]));
        // Told by a request sent before A reconnected: a target restarted since kept nothing.
        b.placed_fresh(1, before);
        assert_eq!(a.handed(0), Handed::Unplaced(vec![b.id()]));
        b.placed_fresh(1, o.now());
        assert_eq!(a.handed(0), Handed::Persist(vec![(4096, 8192)]));
        // A newer write of B there does not put it off again: the bytes of the placed one are
        // vouched for (any write newer than A's will do); one of A's own is A's anyway.
        b.register(0, 6144, 2048, 2);
        assert_eq!(a.handed(0), Handed::Persist(vec![(4096, 8192)]));
        a.register(0, 6144, 2048, 2);
        assert_eq!(a.handed(0), Handed::Persist(vec![(4096, 6144)]));
        // B reconnected: what it re-issues is on its way again.
        b.unplace(2);
        assert_eq!(a.handed(0), Handed::Unplaced(vec![b.id()]));
        b.placed_fresh(2, o.now());
        // A's own bytes are A's persist's anyway.
        assert_eq!(a.handed(0), Handed::Persist(vec![(4096, 6144)]));
        // Made durable: nothing owed, and nothing kept.
        a.settle_handed(0);
        assert_eq!(a.handed(0), Handed::Persist(Vec::new()));
        assert_eq!(o.heirs.load(Ordering::SeqCst), 0);
        assert!(o.lock().heirs.is_empty());
    }

    #[test]
    fn a_client_rewriting_the_bytes_after_each_placement_does_not_keep_the_heir_waiting() {
        // The NBD export's FLUSH has the queues named place their writes and asks again, for
        // a few rounds: B's client rewrote the bytes after each placement, so every round
        // named B again, and the FLUSH answered EIO.
        let (o, mut a, mut b) = heir_of_b(4096);
        assert_eq!(a.handed(0), Handed::Unplaced(vec![b.id()]));
        for seq in 1..=8 {
            b.placed_fresh(seq, o.now());
            // As a rewrite is posted: the new write registered, then the one it supersedes
            // released.
            b.register(0, 0, 4096, seq + 1);
            b.release(0, 0, 4096, seq);
            assert_eq!(a.handed(0), Handed::Persist(vec![(0, 4096)]), "round {seq}");
        }
        // A reconnects again: what was placed before vouches for nothing now.
        a.reissuing();
        assert_eq!(a.handed(0), Handed::Unplaced(vec![b.id()]));
        b.placed_fresh(9, o.now());
        assert_eq!(a.handed(0), Handed::Persist(vec![(0, 4096)]));
        a.settle_handed(0);
        assert_eq!(a.handed(0), Handed::Persist(Vec::new()));
        assert_eq!(o.heirs.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn bytes_the_heirs_own_write_held_need_nothing_when_a_third_queue_takes_them() {
        let (o, mut a, mut b) = two();
        let mut c = Member::new(Arc::clone(&o), vec![1]);
        a.register(0, 0, 4096, 1);
        b.register(0, 0, 4096, 1);
        reissue(&mut a, 0, 4096);
        // A writes the bytes again (held: its own persist covers the write's whole range),
        // then C takes them: A owes nothing for them.
        a.register(0, 0, 4096, 2);
        c.register(0, 0, 4096, 1);
        assert_eq!(a.handed(0), Handed::Persist(Vec::new()));
        // A reconnects again and lets its second write go to C's: owed until C's is placed.
        a.reissuing();
        a.hand_over(0, 0, 4096, 2);
        a.reissued();
        assert_eq!(a.handed(0), Handed::Unplaced(vec![c.id()]));
        c.placed_fresh(1, o.now());
        assert_eq!(a.handed(0), Handed::Persist(vec![(0, 4096)]));
    }

    #[test]
    fn what_a_write_takes_from_an_heir_is_found_among_many_spans_and_namespaces() {
        let o = Arc::new(ReplayOrder::default());
        let mut a = Member::new(Arc::clone(&o), vec![1, 2]);
        let mut b = Member::new(Arc::clone(&o), vec![1, 2]);
        assert!(a.keep_order(Vec::new));
        // A's writes, every other 4 KiB of 1 MiB of both namespaces, each rewritten by B.
        let mut seq = 0;
        for ns in 0..2 {
            for i in (0..256u64).step_by(2) {
                seq += 1;
                a.register(ns, i * 4096, 4096, seq);
                b.register(ns, i * 4096, 4096, seq);
            }
        }
        a.reissuing();
        let mut seq = 0;
        for ns in 0..2 {
            for i in (0..256u64).step_by(2) {
                seq += 1;
                a.hand_over(ns, i * 4096, 4096, seq);
            }
        }
        a.reissued();
        b.placed_fresh(seq, o.now());
        // B writes namespace 2's blocks again, and a run across namespace 1's gaps.
        for i in (0..256u64).step_by(2) {
            seq += 1;
            b.register(1, i * 4096, 4096, seq);
        }
        seq += 1;
        b.register(0, 8192, 3 * 4096, seq);
        let every_other = |from: u64| -> Vec<(u64, u64)> {
            (from..256)
                .step_by(2)
                .map(|i| (i * 4096, i * 4096 + 4096))
                .collect()
        };
        assert_eq!(a.handed(0), Handed::Persist(every_other(0)));
        assert_eq!(a.handed(1), Handed::Persist(every_other(0)));
        // Namespace 2's bytes are vouched for; namespace 1's run (8 KiB-20 KiB) too, and its
        // gap (12-16 KiB) was never owed.
        let inner = o.lock();
        let h = &inner.heirs[&a.id()];
        assert_eq!(h.vouched.iter().filter(|v| v.0 == 2).count(), 128);
        assert_eq!(
            merged(&h.vouched_spans(), 1),
            [(8192, 12288), (16384, 20480)]
        );
    }

    #[test]
    fn vouched_bytes_are_owed_again_when_the_vouching_queue_reconnects() {
        let (o, a, mut b) = heir_of_b(4096);
        b.placed_fresh(1, o.now());
        b.register(0, 0, 4096, 2);
        assert_eq!(a.handed(0), Handed::Persist(vec![(0, 4096)]));
        b.unplace(2);
        assert_eq!(a.handed(0), Handed::Unplaced(vec![b.id()]));
    }

    #[test]
    fn vouched_bytes_whose_newer_write_is_let_go_unpersisted_are_lost() {
        let (o, mut a, mut b) = heir_of_b(4096);
        b.placed_fresh(1, o.now());
        b.register(0, 0, 4096, 2);
        b.lose(0, 0, 4096, 2);
        b.release(0, 0, 4096, 2);
        assert_eq!(a.handed(0), Handed::Lost(vec![(0, 4096)]));
        a.lost_reported(0);
        assert_eq!(a.handed(0), Handed::Persist(Vec::new()));
    }

    /// Bytes whose newer write was made durable and released need nothing when a client
    /// writes them again, each time: a writer that makes its block durable before rewriting
    /// it (FUA, a flush between rewrites: a journal) does not keep the heir waiting for the
    /// placement of each new write.
    #[test]
    fn bytes_whose_newer_write_was_made_durable_need_nothing_when_written_again() {
        let (o, mut a, mut b) = heir_of_b(8192);
        b.placed_fresh(1, o.now());
        b.release(0, 0, 8192, 1);
        for seq in 2..=9 {
            b.register(0, 0, 4096, seq);
            assert_eq!(a.handed(0), Handed::Persist(Vec::new()), "write {seq}");
            b.release(0, 0, 4096, seq);
        }
        a.settle_handed(0);
        assert_eq!(o.heirs.load(Ordering::SeqCst), 0);
    }

    /// Vouched bytes whose writes were made durable and released since need nothing more:
    /// a method that cannot name a range (APM) is not asked for them. (They were named for
    /// ever: a forced APM failed every persist until a reconnect.)
    #[test]
    fn vouched_bytes_no_write_holds_any_more_need_nothing() {
        let (o, mut a, mut b) = two();
        let mut c = Member::new(Arc::clone(&o), vec![1]);
        a.register(0, 0, 4096, 1);
        b.register(0, 0, 4096, 1);
        reissue(&mut a, 0, 4096);
        b.placed_fresh(1, o.now());
        c.register(0, 0, 4096, 1);
        assert_eq!(a.handed(0), Handed::Persist(vec![(0, 4096)]));
        b.release(0, 0, 4096, 1);
        c.release(0, 0, 4096, 1);
        assert_eq!(a.handed(0), Handed::Persist(Vec::new()));
    }

    #[test]
    fn bytes_whose_newer_write_is_let_go_unpersisted_are_reported_lost_once() {
        let (_o, mut a, mut b) = two();
        a.register(0, 0, 12288, 1);
        b.register(0, 0, 4096, 1);
        b.register(0, 8192, 4096, 2);
        reissue(&mut a, 0, 12288);
        // B goes with both writes: one was made durable before, the other is lost.
        b.release(0, 8192, 4096, 2);
        b.lose(0, 0, 4096, 1);
        b.release(0, 0, 4096, 1);
        assert_eq!(a.handed(0), Handed::Lost(vec![(0, 4096)]));
        a.lost_reported(0);
        assert_eq!(a.handed(0), Handed::Persist(Vec::new()));
    }

    #[test]
    fn bytes_let_go_between_a_loss_and_its_release_are_lost() {
        let (_o, mut a, mut b) = two();
        a.register(0, 0, 4096, 1);
        b.register(0, 0, 4096, 1);
        // B's queue lets its write go unpersisted, and releases it only after a visibility
        // Read (or in a loop of its own): A's re-issue lets its write go in between.
        b.lose(0, 0, 4096, 1);
        reissue(&mut a, 0, 4096);
        b.release(0, 0, 4096, 1);
        assert_eq!(a.handed(0), Handed::Lost(vec![(0, 4096)]));
        a.lost_reported(0);
        assert_eq!(a.handed(0), Handed::Persist(Vec::new()));
    }

    #[test]
    fn bytes_a_write_let_go_unpersisted_had_taken_before_the_reconnect_are_lost() {
        let (o, mut a, mut b) = two();
        a.register(0, 0, 4096, 1);
        b.register(0, 0, 4096, 1);
        b.lose(0, 0, 4096, 1);
        b.release(0, 0, 4096, 1);
        reissue(&mut a, 0, 4096);
        assert_eq!(a.handed(0), Handed::Lost(vec![(0, 4096)]));
        a.lost_reported(0);
        // Made durable before: nothing owed. And a loss before A last held nothing is of
        // older bytes than any A holds now.
        a.release(0, 0, 4096, 1);
        a.emptied();
        a.register(0, 0, 4096, 1);
        b.register(0, 0, 4096, 2);
        b.release(0, 0, 4096, 2);
        reissue(&mut a, 0, 4096);
        assert_eq!(a.handed(0), Handed::Persist(Vec::new()));
        assert_eq!(o.heirs.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn bytes_a_newer_write_of_the_same_queue_took_are_not_handed_over() {
        let (o, mut a, _b) = two();
        a.register(0, 0, 8192, 1);
        a.register(0, 4096, 4096, 2);
        reissue(&mut a, 0, 8192);
        assert_eq!(o.heirs.load(Ordering::SeqCst), 0);
        assert_eq!(a.handed(0), Handed::Persist(Vec::new()));
    }

    #[test]
    fn a_queue_that_goes_takes_what_it_owed_and_its_placement_with_it() {
        let (o, a, mut b) = heir_of_b(4096);
        b.placed_fresh(1, o.now());
        assert_eq!(o.lock().fresh.len(), 1);
        drop(a);
        drop(b);
        assert_eq!(o.heirs.load(Ordering::SeqCst), 0);
        assert!(o.lock().heirs.is_empty() && o.lock().fresh.is_empty());
    }

    #[test]
    fn ranges_without_a_cut_keep_what_is_outside_it() {
        assert_eq!(without(&[(0, 100)], &[]), [(0, 100)]);
        assert_eq!(without(&[(0, 100)], &[(0, 100)]), []);
        assert_eq!(
            without(&[(0, 100), (200, 300)], &[(50, 60), (90, 250)]),
            [(0, 50), (60, 90), (250, 300)]
        );
        assert_eq!(merged(&vec![(1, 5, 9), (2, 0, 4), (1, 0, 5)], 1), [(0, 9)]);
    }
}
