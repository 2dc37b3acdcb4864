//! A pool's membership in the replay order of its connection's queues ([`crate::replay`]):
//! which bytes its held writes may still replay, and which of its writes are known placed.

use super::{carried, Pool, Slot, WriteRec};
use crate::replay::{Handed, Member};

impl Pool {
    /// Joins the replay order of the connection's queues: from now on each new write takes the
    /// bytes it covers from every older one of any of them ([`crate::replay`]).
    pub(crate) fn join(&mut self, m: Member) {
        self.replay = Some(m);
    }

    /// How long the connection's Writes must still wait for its fence
    /// ([`ReplayOrder::fence_until`](crate::replay::ReplayOrder::fence_until)), if they must.
    pub(crate) fn fence_left(&self) -> Option<std::time::Duration> {
        self.replay.as_ref()?.order().fence_left()
    }

    /// The pieces `[start, end)` of held write `w` that its re-issue may write: all of it,
    /// unless a newer write of another queue (or of this one) took some.
    pub(crate) fn replay_pieces(&mut self, w: &WriteRec) -> Vec<(u64, u64)> {
        if self.keep_order() {
            if let Some(m) = &self.replay {
                return m.owned(w.ns, w.offset, w.len, w.seq);
            }
        }
        vec![(w.offset, w.offset + w.len as u64)]
    }

    /// Whether this queue's writes go through the replay order: once the connection has
    /// another queue, when the writes it holds enter it ([`Member::keep_order`]). Cheap when
    /// alone (an atomic load): run at every poll, so that an idle queue enters soon.
    pub(crate) fn keep_order(&mut self) -> bool {
        let slots = &self.slots;
        match self.replay.as_mut() {
            Some(m) => m.keep_order(|| carried(slots)),
            None => false,
        }
    }

    /// This queue's number in its connection's replay order.
    pub(crate) fn order_id(&self) -> Option<u64> {
        self.replay.as_ref().map(Member::id)
    }

    /// The queues of the connection (this one too) that may hold writes of `len` bytes at
    /// `offset` of namespace `ns` not known placed ([`crate::replay`]): none while this queue
    /// is alone.
    pub(crate) fn unplaced_writers(&mut self, ns: usize, offset: u64, len: usize) -> Vec<u64> {
        if !self.keep_order() {
            return Vec::new();
        }
        self.replay
            .as_ref()
            .map_or_else(Vec::new, |m| m.unplaced_writers(ns, offset, len))
    }

    /// Whether this queue's writes are in the replay order (another queue of the connection
    /// came) and some of them are not known placed: only then is a probe worth sending.
    pub(crate) fn unplaced(&self) -> bool {
        self.replay
            .as_ref()
            .is_some_and(|m| m.entered() && m.unplaced())
    }

    /// Asks the queues `ids` of the connection to learn soon whether their writes are placed
    /// ([`crate::replay`]).
    pub(crate) fn want_placed(&self, ids: &[u64]) {
        if let Some(m) = &self.replay {
            m.want_placed(ids);
        }
    }

    /// Whether another queue asked this one to learn its placement soon; the ask is taken.
    pub(crate) fn take_want(&self) -> bool {
        self.replay.as_ref().is_some_and(Member::take_want)
    }

    /// This queue's writes up to post order `seq` are placed (recorded while it is in the
    /// replay order: no one asks before).
    pub(crate) fn placed_through(&mut self, seq: u64) {
        if let Some(m) = self.replay.as_mut().filter(|m| m.entered()) {
            m.placed_through(seq);
        }
    }

    /// This queue's writes up to post order `seq` are placed, told by a request sent when the
    /// replay order's clock read `sent` ([`order_now`](Self::order_now)).
    pub(crate) fn placed_fresh(&mut self, seq: u64, sent: u64) {
        if let Some(m) = self.replay.as_mut().filter(|m| m.entered()) {
            m.placed_fresh(seq, sent);
        }
    }

    /// The replay order's clock, for a request that will tell this queue's writes placed.
    pub(crate) fn order_now(&self) -> u64 {
        self.replay.as_ref().map_or(0, |m| m.order().now())
    }

    /// A re-issue of the held writes begins (on a new connection).
    pub(crate) fn reissuing(&mut self) {
        if let Some(m) = &mut self.replay {
            m.reissuing();
        }
    }

    /// The re-issue of every held write ended.
    pub(crate) fn reissued(&mut self) {
        if let Some(m) = &mut self.replay {
            m.reissued();
        }
    }

    /// The re-issue lets the held write `w` go, or writes only the `pieces` of it no newer
    /// write took: the bytes newer writes took are this queue's to vouch for
    /// ([`Member::hand_over`]). Call before its slot is freed.
    pub(crate) fn hand_over(&mut self, w: &WriteRec, pieces: &[(u64, u64)]) {
        let whole = pieces.iter().map(|(s, e)| e - s).sum::<u64>() == w.len as u64;
        if whole {
            return;
        }
        if let Some(m) = self.replay.as_mut().filter(|m| m.entered()) {
            m.hand_over(w.ns, w.offset, w.len, w.seq);
        }
    }

    /// What the persist of this queue's own writes of namespace `ns` owes for the bytes it
    /// let go to newer writes ([`Handed`]).
    pub(crate) fn handed(&self, ns: usize) -> Handed {
        match self.replay.as_ref().filter(|m| m.entered()) {
            Some(m) => m.handed(ns),
            None => Handed::Persist(Vec::new()),
        }
    }

    /// A persist of this queue's own writes of namespace `ns` covered what it owed.
    pub(crate) fn settle_handed(&mut self, ns: usize) {
        if let Some(m) = &mut self.replay {
            m.settle_handed(ns);
        }
    }

    /// The loss of bytes this queue let go on namespace `ns` was reported.
    pub(crate) fn lost_reported(&mut self, ns: usize) {
        if let Some(m) = &mut self.replay {
            m.lost_reported(ns);
        }
    }

    /// The writes of namespace `ns` (every namespace: None) this queue carries are let go
    /// unpersisted: the queues that let their bytes go to them lose them. Call before they
    /// are released.
    pub(crate) fn lose_writes(&mut self, ns: Option<usize>) {
        let Some(m) = self.replay.as_ref().filter(|m| m.entered()) else {
            return;
        };
        for w in self.slots.iter().filter_map(Slot::write) {
            if ns.is_none_or(|n| n == w.ns) {
                m.lose(w.ns, w.offset, w.len, w.seq);
            }
        }
    }

    /// None of this queue's writes is known placed any more (it reconnected).
    pub(crate) fn unplace(&mut self) {
        let last = self.next_seq;
        if let Some(m) = &mut self.replay {
            m.unplace(last);
        }
    }
}
