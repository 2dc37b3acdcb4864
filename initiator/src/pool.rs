//! A queue's registered bounce buffers: `slots` chunks of `chunk` bytes, registered once (and
//! again in the new protection domain after a reconnect), plus an 8-byte sink for APM Reads and
//! atomic results.
//!
//! A write's slot is kept ([`Slot::Held`]) from the moment its Write is posted until a
//! durability acknowledgement covers it: that copy is what a reconnect re-issues. A read's slot
//! is free again once its bytes are copied out.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use rpma_common::fabric::{self, Access, AlignedBuf, MemoryRegion, ProtectionDomain, Sge};

use crate::replay::{Carried, Member};

/// What a slot holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Slot {
    /// Nothing.
    Free,
    /// A posted Write, not completed yet.
    Writing(WriteRec),
    /// A completed Write not yet acknowledged as durable.
    Held(WriteRec),
    /// A posted Read of namespace index `ns`: `len` bytes for item `item` at `at` of the
    /// caller's buffer.
    Reading {
        /// The namespace read (its index in the queue), named if the Read fails.
        ns: usize,
        /// Index of the caller's buffer in its batch.
        item: usize,
        /// Offset in that buffer.
        at: usize,
        /// Bytes.
        len: usize,
    },
    /// A completed Read whose bytes are still to be copied out (same fields).
    ReadDone {
        /// Index of the caller's buffer in its batch.
        item: usize,
        /// Offset in that buffer.
        at: usize,
        /// Bytes.
        len: usize,
    },
    /// A posted Read started on its own (`Namespace::start_read`), not completed yet.
    Started {
        /// The namespace read (its index in the queue), named if the Read fails.
        ns: usize,
        /// What the caller knows it by.
        ticket: u64,
        /// Bytes.
        len: usize,
    },
    /// A started Read that completed: its bytes wait for `Namespace::take_read`.
    StartedDone {
        /// What the caller knows it by.
        ticket: u64,
        /// Bytes.
        len: usize,
    },
}

impl Slot {
    /// Its variant's index in [`Pool`]'s counts.
    fn kind(&self) -> usize {
        match self {
            Slot::Free => 0,
            Slot::Writing(_) => 1,
            Slot::Held(_) => 2,
            Slot::Reading { .. } => 3,
            Slot::ReadDone { .. } => 4,
            Slot::Started { .. } => 5,
            Slot::StartedDone { .. } => 6,
        }
    }

    /// The write it carries (posted or held).
    fn write(&self) -> Option<WriteRec> {
        match *self {
            Slot::Writing(w) | Slot::Held(w) => Some(w),
            _ => None,
        }
    }
}

/// The kinds of slot [`Pool::number`] counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Held writes.
    Held,
    /// Posted Reads of a batch.
    Reading,
    /// Started requests not completed yet: Reads, and Writes the caller waits to hear of.
    StartedOutstanding,
}

/// A write a slot carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct WriteRec {
    /// Index of the namespace in the queue's table.
    pub(crate) ns: usize,
    /// Offset in the namespace.
    pub(crate) offset: u64,
    /// Bytes.
    pub(crate) len: usize,
    /// Post order: replays go in this order, so a later write to the same bytes still wins.
    /// A started write's ticket.
    pub(crate) seq: u64,
    /// A started write (`Namespace::start_write`) whose completion the caller has not been told
    /// of yet.
    pub(crate) notify: bool,
}

impl WriteRec {
    /// Which write it is, whatever the caller was told of it.
    fn key(self) -> (usize, u64, usize, u64) {
        (self.ns, self.offset, self.len, self.seq)
    }
}

/// `ranges` (`[start, end)` each) sorted, overlapping and adjacent ones merged; empty ones
/// dropped.
pub(crate) fn merge_ranges(mut ranges: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    ranges.retain(|r| r.0 < r.1);
    ranges.sort_unstable();
    let mut merged: Vec<(u64, u64)> = Vec::with_capacity(ranges.len());
    for (lo, hi) in ranges {
        match merged.last_mut() {
            Some(last) if lo <= last.1 => last.1 = last.1.max(hi),
            _ => merged.push((lo, hi)),
        }
    }
    merged
}

/// The bounce buffers of one queue.
pub(crate) struct Pool {
    mem: Arc<AlignedBuf>,
    mr: Arc<MemoryRegion>,
    sink: Arc<AlignedBuf>,
    sink_mr: Arc<MemoryRegion>,
    chunk: usize,
    /// The most requests in flight at once.
    depth: usize,
    slots: Vec<Slot>,
    free: Vec<usize>,
    next_seq: u64,
    /// Slots with a posted request whose completion was not reaped yet.
    busy: usize,
    /// The most `busy` ever was.
    max_busy: usize,
    /// Slots per variant ([`Slot::kind`]), and posted started Writes (`notify`): so that the
    /// queue's waits never scan the slots (a pool may have thousands).
    kinds: [usize; 7],
    notify_writing: usize,
    /// The newest write (posted or held) starting at each (namespace, offset): the one a new
    /// write there may supersede ([`Pool::supersede`]).
    latest: HashMap<(usize, u64), usize>,
    /// Completed started Reads by ticket.
    done_reads: HashMap<u64, usize>,
    /// The replay order this queue shares with the other queues of its connection.
    replay: Option<Member>,
}

/// A posted request that has not completed yet.
fn in_flight(s: &Slot) -> bool {
    matches!(
        s,
        Slot::Writing(_) | Slot::Reading { .. } | Slot::Started { .. }
    )
}

impl Drop for Pool {
    /// The queue is gone: its writes leave the replay order.
    fn drop(&mut self) {
        if let Some(m) = self.replay.as_ref().filter(|m| m.entered()) {
            for w in self.slots.iter().filter_map(Slot::write) {
                m.release(w.ns, w.offset, w.len, w.seq);
            }
        }
    }
}

/// The writes `slots` carry, as the replay order takes them.
fn carried(slots: &[Slot]) -> Carried {
    slots
        .iter()
        .filter_map(Slot::write)
        .map(|w| (w.ns, w.offset, w.len, w.seq))
        .collect()
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("slots", &self.slots.len())
            .field("chunk", &self.chunk)
            .field("free", &self.free.len())
            .finish()
    }
}

impl Pool {
    /// Allocates `slots` chunks of `chunk` bytes and registers them in `pd` (local write only:
    /// the target cannot reach them); at most `depth` of them are handed out while that many
    /// requests are in flight.
    pub(crate) fn new(
        pd: &ProtectionDomain,
        depth: usize,
        slots: usize,
        chunk: usize,
    ) -> fabric::Result<Pool> {
        let mem = AlignedBuf::new(slots * chunk)?;
        let mr = pd.register(Arc::clone(&mem), Access::LOCAL_WRITE)?;
        let sink = AlignedBuf::new(64)?;
        let sink_mr = pd.register(Arc::clone(&sink), Access::LOCAL_WRITE)?;
        Ok(Pool {
            mem,
            mr,
            sink,
            sink_mr,
            chunk,
            depth,
            slots: vec![Slot::Free; slots],
            free: (0..slots).rev().collect(),
            next_seq: 0,
            busy: 0,
            max_busy: 0,
            kinds: [slots, 0, 0, 0, 0, 0, 0],
            notify_writing: 0,
            latest: HashMap::new(),
            done_reads: HashMap::new(),
            replay: None,
        })
    }

    /// Joins the replay order of the connection's queues: from now on each new write takes the
    /// bytes it covers from every older one of any of them ([`crate::replay`]).
    pub(crate) fn join(&mut self, m: Member) {
        self.replay = Some(m);
    }

    /// Whether `slot` still carries the write `w` (held or posted).
    pub(crate) fn carries(&self, slot: usize, w: &WriteRec) -> bool {
        self.get(slot)
            .and_then(|s| s.write())
            .is_some_and(|x| x.key() == w.key())
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

    /// Registers the same memory in `pd` (a new connection's domain); the slots keep their
    /// contents.
    pub(crate) fn rebind(&mut self, pd: &ProtectionDomain) -> fabric::Result<()> {
        self.mr = pd.register(Arc::clone(&self.mem), Access::LOCAL_WRITE)?;
        self.sink_mr = pd.register(Arc::clone(&self.sink), Access::LOCAL_WRITE)?;
        Ok(())
    }

    pub(crate) fn chunk(&self) -> usize {
        self.chunk
    }

    pub(crate) fn get(&self, slot: usize) -> Option<Slot> {
        self.slots.get(slot).copied()
    }

    pub(crate) fn set(&mut self, slot: usize, s: Slot) {
        let Some(&old) = self.slots.get(slot) else {
            return;
        };
        if s == Slot::Free && old != Slot::Free {
            self.free.push(slot);
        }
        match (in_flight(&old), in_flight(&s)) {
            (false, true) => {
                self.busy += 1;
                self.max_busy = self.max_busy.max(self.busy);
            }
            (true, false) => self.busy -= 1,
            _ => {}
        }
        self.kinds[old.kind()] -= 1;
        self.kinds[s.kind()] += 1;
        let notify = |x: &Slot| matches!(x, Slot::Writing(WriteRec { notify: true, .. }));
        self.notify_writing =
            self.notify_writing + usize::from(notify(&s)) - usize::from(notify(&old));
        if let Slot::StartedDone { ticket, .. } = old {
            self.done_reads.remove(&ticket);
        }
        if let Slot::StartedDone { ticket, .. } = s {
            self.done_reads.insert(ticket, slot);
        }
        if let Some(w) = old.write() {
            if self.latest.get(&(w.ns, w.offset)) == Some(&slot) {
                self.latest.remove(&(w.ns, w.offset));
            }
        }
        // The same write moving on (posted, completed, held, re-issued) stays registered; a
        // new one registers, a finished one releases.
        let (o, n) = (old.write(), s.write());
        if o.map(WriteRec::key) != n.map(WriteRec::key) && self.keep_order() {
            if let Some(m) = &self.replay {
                if let Some(w) = o {
                    m.release(w.ns, w.offset, w.len, w.seq);
                }
                if let Some(w) = n {
                    m.register(w.ns, w.offset, w.len, w.seq);
                }
            }
        }
        self.slots[slot] = s;
        if let Some(w) = s.write() {
            let newer = |p: &usize| {
                self.slots[*p]
                    .write()
                    .is_some_and(|o| o.seq > w.seq && (o.ns, o.offset) == (w.ns, w.offset))
            };
            if !self.latest.get(&(w.ns, w.offset)).is_some_and(newer) {
                self.latest.insert((w.ns, w.offset), slot);
            }
        }
    }

    /// How many slots are of `kind`.
    pub(crate) fn number(&self, kind: Kind) -> usize {
        match kind {
            Kind::Held => self.kinds[2],
            Kind::Reading => self.kinds[3],
            Kind::StartedOutstanding => self.kinds[5] + self.notify_writing,
        }
    }

    /// A new write `w` (not a re-issue) is about to be posted: an older held write of the same
    /// namespace that it covers whole, starting at the same offset, is no longer needed for a
    /// replay (the replay re-issues `w`, in post order, over the same bytes), so its slot is
    /// freed. This is what lets a pool of held writes absorb a working set it can hold without
    /// a persist: rewriting a block frees its older copy. A held write whose completion the
    /// caller still waits to hear of (a started Write to be re-issued) stays. Returns whether
    /// one was freed.
    pub(crate) fn supersede(&mut self, w: &WriteRec) -> bool {
        let Some(&p) = self.latest.get(&(w.ns, w.offset)) else {
            return false;
        };
        match self.slots[p] {
            Slot::Held(o) if !o.notify && o.len <= w.len && o.seq < w.seq => {
                self.set(p, Slot::Free);
                true
            }
            _ => false,
        }
    }

    /// The slot of the completed started Read `ticket`, and its length.
    pub(crate) fn done_read(&self, ticket: u64) -> Option<(usize, usize)> {
        let &slot = self.done_reads.get(&ticket)?;
        match self.slots[slot] {
            Slot::StartedDone { len, .. } => Some((slot, len)),
            _ => None,
        }
    }

    /// Requests posted and not completed yet.
    pub(crate) fn in_flight(&self) -> usize {
        self.busy
    }

    /// The most requests that were ever in flight at once.
    pub(crate) fn max_in_flight(&self) -> usize {
        self.max_busy
    }

    /// A free slot, now owned by the caller (set it to something other than Free); None also
    /// while `depth` requests are in flight.
    pub(crate) fn take_free(&mut self) -> Option<usize> {
        if self.busy >= self.depth {
            return None;
        }
        self.free.pop()
    }

    /// Gives back a slot from [`take_free`](Self::take_free) that was not used.
    pub(crate) fn untake(&mut self, slot: usize) {
        if self.slots.get(slot) == Some(&Slot::Free) && !self.free.contains(&slot) {
            self.free.push(slot);
        }
    }

    /// The next post-order number.
    pub(crate) fn next_seq(&mut self) -> u64 {
        self.next_seq += 1;
        self.next_seq
    }

    /// Copies `data` (at most a chunk) into `slot`.
    pub(crate) fn fill(&self, slot: usize, data: &[u8]) -> fabric::Result<()> {
        self.mem.write_at(slot * self.chunk, data)
    }

    /// Copies the first `out.len()` bytes of `slot` out.
    pub(crate) fn copy_out(&self, slot: usize, out: &mut [u8]) -> fabric::Result<()> {
        self.mem.read_at(slot * self.chunk, out)
    }

    /// The local side of a request on `len` bytes of `slot`.
    pub(crate) fn sge(&self, slot: usize, len: usize) -> Sge {
        self.sge_at(slot, 0, len)
    }

    /// The local side of a request on `len` bytes of `slot` from byte `at`.
    pub(crate) fn sge_at(&self, slot: usize, at: usize, len: usize) -> Sge {
        Sge::new(&self.mr, slot * self.chunk + at, len)
    }

    /// The 8-byte sink.
    pub(crate) fn sink_sge(&self) -> Sge {
        Sge::new(&self.sink_mr, 0, 8)
    }

    /// The value an atomic left in the sink (native endian, as the fabric stores it).
    pub(crate) fn sink_value(&self) -> fabric::Result<u64> {
        self.sink.read_u64(0)
    }

    /// Slots in a state matching `f` (tests; the queue uses [`Pool::number`]).
    #[cfg(test)]
    pub(crate) fn count(&self, f: impl Fn(&Slot) -> bool) -> usize {
        self.slots.iter().filter(|s| f(s)).count()
    }

    /// The ranges `[start, end)` of namespace `ns` that held or writing writes cover, sorted,
    /// overlapping and adjacent ones merged.
    pub(crate) fn held_ranges(&self, ns: usize) -> Vec<(u64, u64)> {
        let all: Vec<(u64, u64)> = self
            .slots
            .iter()
            .filter_map(|s| match s {
                Slot::Held(w) | Slot::Writing(w) if w.ns == ns => {
                    Some((w.offset, w.offset + w.len as u64))
                }
                _ => None,
            })
            .collect();
        merge_ranges(all)
    }

    /// Held writes of namespace `ns` inside `[start, end)` (all of them if `all`) become free.
    /// Returns how many.
    ///
    /// A held write stays held, although its range is durable, while an older write (held or
    /// still in flight) that overlaps it stays: a replay after a lost connection re-issues the
    /// older one, and without the newer one after it the older bytes would land over an
    /// acknowledged write. A persist of the held ranges, or an APM that covers them all, frees
    /// both later.
    pub(crate) fn release_held(&mut self, ns: usize, start: u64, end: u64, all: bool) -> usize {
        // The namespace's writes in post order; each one is judged after every older one, so
        // one pass settles it (keeping one write may keep a newer one over it).
        let mut mine: Vec<(WriteRec, usize, bool)> = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| match *s {
                Slot::Held(w) if w.ns == ns => Some((
                    w,
                    i,
                    all || (w.offset >= start && w.offset + w.len as u64 <= end),
                )),
                Slot::Writing(w) if w.ns == ns => Some((w, i, false)),
                _ => None,
            })
            .collect();
        mine.sort_unstable_by_key(|(w, _, _)| w.seq);
        // The kept writes so far, by start: a write is at most a chunk long, so one that
        // overlaps [a, b) starts in (a - chunk, b).
        let mut kept: BTreeMap<(u64, u64), u64> = BTreeMap::new();
        let mut n = 0;
        for (w, i, candidate) in mine {
            let (a, b) = (w.offset, w.offset + w.len as u64);
            let shadowed = !all
                && kept
                    .range((a.saturating_sub(self.chunk as u64), 0)..(b, 0))
                    .any(|(_, &end)| end > a);
            if candidate && !shadowed {
                self.set(i, Slot::Free);
                n += 1;
            } else {
                kept.insert((a, w.seq), b);
            }
        }
        n
    }

    /// After a lost connection: unfinished Writes are held for the replay, Reads in flight are
    /// dropped (their operation is re-run; a started Read's ticket is void). Returns the held
    /// writes in post order.
    pub(crate) fn on_connection_lost(&mut self) -> Vec<(usize, WriteRec)> {
        for i in 0..self.slots.len() {
            match self.slots[i] {
                Slot::Writing(w) => self.set(i, Slot::Held(w)),
                // A completed started Read keeps its bytes for take_read.
                Slot::Reading { .. } | Slot::ReadDone { .. } | Slot::Started { .. } => {
                    self.set(i, Slot::Free)
                }
                _ => {}
            }
        }
        let mut held: Vec<(usize, WriteRec)> = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| match s {
                Slot::Held(w) => Some((i, *w)),
                _ => None,
            })
            .collect();
        held.sort_by_key(|(_, w)| w.seq);
        held
    }

    /// Drops every held write (a queue that gave up).
    pub(crate) fn clear(&mut self) {
        for i in 0..self.slots.len() {
            self.set(i, Slot::Free);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rpma_common::fabric::Context;

    fn rec(ns: usize, offset: u64, len: usize, seq: u64) -> WriteRec {
        WriteRec {
            ns,
            offset,
            len,
            seq,
            notify: false,
        }
    }

    /// Two queues' pools in one replay order: a slot's write registers as it is set, moving on
    /// (posted, completed, re-issued) keeps it registered, freeing or dropping the pool
    /// releases it, and a newer write of the other pool takes the bytes it covers for good.
    #[test]
    fn pools_of_one_connection_share_the_replay_order() {
        let pd = Context::soft().alloc_pd().unwrap();
        let order = Arc::new(crate::replay::ReplayOrder::default());
        let (mut a, mut b) = (
            Pool::new(&pd, 2, 2, 16384).unwrap(),
            Pool::new(&pd, 2, 2, 16384).unwrap(),
        );
        a.join(Member::new(Arc::clone(&order), vec![1, 2]));
        b.join(Member::new(Arc::clone(&order), vec![2, 1]));
        let sa = a.take_free().unwrap();
        let seq = a.next_seq();
        let w = WriteRec {
            notify: true,
            ..rec(0, 0, 12288, seq)
        };
        a.set(sa, Slot::Writing(w));
        a.set(sa, Slot::Held(WriteRec { notify: false, ..w }));
        assert!(a.carries(sa, &w));
        assert_eq!(a.replay_pieces(&w), [(0, 12288)]);
        // B's index 1 is nsid 1 too: its write in the middle splits A's.
        let sb = b.take_free().unwrap();
        let seq = b.next_seq();
        let v = rec(1, 4096, 4096, seq);
        b.set(sb, Slot::Writing(v));
        assert_eq!(a.replay_pieces(&w), [(0, 4096), (8192, 12288)]);
        // B's write done with (durable): the bytes stay B's.
        b.set(sb, Slot::Free);
        assert_eq!(a.replay_pieces(&w), [(0, 4096), (8192, 12288)]);
        // A's re-issue moves the same write on: nothing changes.
        a.set(sa, Slot::Writing(w));
        assert_eq!(a.replay_pieces(&w), [(0, 4096), (8192, 12288)]);
        assert_eq!(order.len(), 2);
        // Another namespace of B's is apart.
        let (sb, seq) = (b.take_free().unwrap(), b.next_seq());
        b.set(sb, Slot::Held(rec(0, 0, 4096, seq)));
        assert_eq!(a.replay_pieces(&w), [(0, 4096), (8192, 12288)]);
        drop(b);
        assert_eq!(order.len(), 2, "B's write on nsid 2 released");
        a.clear();
        assert!(!a.carries(sa, &w));
        assert_eq!(order.len(), 0);
    }

    /// A queue alone on its connection keeps its write out of the map; a second queue's newer
    /// write over part of it, done with and released before the first one enters (a
    /// tombstone meanwhile), still keeps that part from the first one's replay.
    #[test]
    fn a_write_made_before_a_second_queue_joined_is_still_ordered() {
        let pd = Context::soft().alloc_pd().unwrap();
        let order = Arc::new(crate::replay::ReplayOrder::default());
        let mut a = Pool::new(&pd, 2, 2, 16384).unwrap();
        a.join(Member::new(Arc::clone(&order), vec![1]));
        let (sa, seq) = (a.take_free().unwrap(), a.next_seq());
        let w = rec(0, 0, 8192, seq);
        a.set(sa, Slot::Held(w));
        let mut b = Pool::new(&pd, 2, 2, 16384).unwrap();
        b.join(Member::new(Arc::clone(&order), vec![1]));
        let (sb, seq) = (b.take_free().unwrap(), b.next_seq());
        b.set(sb, Slot::Writing(rec(0, 0, 4096, seq)));
        b.set(sb, Slot::Free);
        assert_eq!(a.replay_pieces(&w), [(4096, 8192)]);
    }

    /// A durable acknowledgement of a newer write inside an older, larger held write must not
    /// free the newer one alone: the replay would re-issue only the older write and put its
    /// stale bytes back over the acknowledged ones.
    #[test]
    fn an_acknowledged_write_under_an_older_held_one_stays_for_the_replay() {
        let pd = Context::soft().alloc_pd().unwrap();
        let mut p = Pool::new(&pd, 4, 4, 1 << 17).unwrap();
        let (old, new, other) = (
            p.take_free().unwrap(),
            p.take_free().unwrap(),
            p.take_free().unwrap(),
        );
        p.set(old, Slot::Held(rec(0, 0, 1 << 17, 1)));
        p.set(new, Slot::Held(rec(0, 4096, 4096, 2)));
        // Newer than `new` and overlapping it, but outside the older write's shadow: free.
        p.set(other, Slot::Held(rec(0, 1 << 20, 4096, 3)));
        assert_eq!(p.release_held(0, 4096, 8192, false), 0);
        assert_eq!(p.release_held(0, 1 << 20, (1 << 20) + 4096, false), 1);
        let held = p.on_connection_lost();
        assert_eq!(
            held.iter()
                .map(|(_, w)| (w.offset, w.seq))
                .collect::<Vec<_>>(),
            [(0, 1), (4096, 2)],
            "the replay re-applies the acknowledged write after the older one"
        );
        // An in-flight older write shadows as well.
        p.set(old, Slot::Writing(rec(0, 0, 1 << 17, 1)));
        assert_eq!(p.release_held(0, 4096, 8192, false), 0);
        // A persist of the whole held span frees both; APM frees every held write.
        p.set(old, Slot::Held(rec(0, 0, 1 << 17, 1)));
        assert_eq!(p.release_held(0, 0, 1 << 17, false), 2);
        p.set(old, Slot::Held(rec(0, 0, 1 << 17, 4)));
        p.set(new, Slot::Held(rec(0, 4096, 4096, 5)));
        assert_eq!(p.release_held(0, 0, 0, true), 2);
    }

    #[test]
    fn a_newer_write_of_the_same_block_frees_the_held_older_one() {
        let pd = Context::soft().alloc_pd().unwrap();
        let mut p = Pool::new(&pd, 2, 6, 4096).unwrap();
        let s: Vec<usize> = (0..5).map(|_| p.take_free().unwrap()).collect();
        p.set(s[0], Slot::Held(rec(0, 0, 4096, 1)));
        p.set(s[1], Slot::Held(rec(0, 8192, 4096, 2)));
        p.set(s[2], Slot::Held(rec(1, 0, 4096, 3)));
        let mut pending = rec(0, 8192, 4096, 4);
        pending.notify = true;
        p.set(s[3], Slot::Held(pending));
        assert_eq!(p.number(Kind::Held), 4);
        // Same namespace and offset, at least as long: the older copy goes.
        assert!(p.supersede(&rec(0, 0, 4096, 5)));
        assert_eq!(p.get(s[0]), Some(Slot::Free));
        // Another namespace, a shorter write, or a write whose completion the caller still
        // waits for (s[3], the latest at 8192): kept.
        assert!(!p.supersede(&rec(1, 4096, 4096, 6)));
        assert!(
            !p.supersede(&rec(0, 8192, 4096, 7)),
            "a pending report stays"
        );
        p.set(s[4], Slot::Writing(rec(0, 16384, 8192, 8)));
        assert!(!p.supersede(&rec(0, 16384, 8192, 9)), "still in flight");
        assert_eq!(p.number(Kind::Held), 3);
        // The replay has every write that is still needed, in post order.
        let held = p.on_connection_lost();
        assert_eq!(
            held.iter().map(|(_, w)| w.seq).collect::<Vec<_>>(),
            vec![2, 3, 4, 8]
        );
    }

    #[test]
    fn at_most_depth_slots_are_in_flight_the_rest_hold_writes() {
        let pd = Context::soft().alloc_pd().unwrap();
        let mut p = Pool::new(&pd, 2, 8, 4096).unwrap();
        let a = p.take_free().unwrap();
        p.set(a, Slot::Writing(rec(0, 0, 4096, 1)));
        let b = p.take_free().unwrap();
        p.set(
            b,
            Slot::Reading {
                ns: 0,
                item: 0,
                at: 0,
                len: 8,
            },
        );
        assert_eq!(p.take_free(), None, "two in flight");
        p.set(a, Slot::Held(rec(0, 0, 4096, 1)));
        let c = p.take_free().unwrap();
        p.set(
            c,
            Slot::Started {
                ns: 0,
                ticket: 7,
                len: 8,
            },
        );
        assert_eq!(p.number(Kind::StartedOutstanding), 1);
        assert_eq!(p.number(Kind::Reading), 1);
        p.set(c, Slot::StartedDone { ticket: 7, len: 8 });
        assert_eq!(p.done_read(7), Some((c, 8)));
        assert_eq!(p.number(Kind::StartedOutstanding), 0);
        p.set(c, Slot::Free);
        assert_eq!(p.done_read(7), None);
    }

    #[test]
    fn slots_cycle_and_held_writes_are_released_by_range() {
        let pd = Context::soft().alloc_pd().unwrap();
        let mut p = Pool::new(&pd, 4, 4, 4096).unwrap();
        let a = p.take_free().unwrap();
        let b = p.take_free().unwrap();
        let c = p.take_free().unwrap();
        p.set(a, Slot::Held(rec(0, 0, 4096, 1)));
        p.set(b, Slot::Held(rec(0, 8192, 4096, 2)));
        p.set(c, Slot::Held(rec(1, 0, 4096, 3)));
        assert_eq!(p.count(|s| matches!(s, Slot::Held(_))), 3);
        assert_eq!(p.in_flight(), 0, "held writes are not in flight");
        // The ranges a persist of the held writes covers, per namespace: apart, not their span.
        assert_eq!(p.held_ranges(0), vec![(0, 4096), (8192, 12288)]);
        assert_eq!(p.held_ranges(1), vec![(0, 4096)]);
        assert!(p.held_ranges(2).is_empty());
        // Only namespace 0's write inside [0, 4096).
        assert_eq!(p.release_held(0, 0, 4096, false), 1);
        assert_eq!(p.get(a), Some(Slot::Free));
        // A range that covers part of a write does not release it.
        assert_eq!(p.release_held(0, 8192, 8200, false), 0);
        assert_eq!(p.release_held(0, 0, 0, true), 1);
        assert_eq!(p.count(|s| *s == Slot::Free), 3);
        p.fill(c, b"abc").unwrap();
        let mut out = [0u8; 3];
        p.copy_out(c, &mut out).unwrap();
        assert_eq!(&out, b"abc");
        assert!(
            p.fill(c, &[0u8; 4097]).is_ok(),
            "spills into the next slot's memory"
        );
        assert!(p.fill(3, &[0u8; 4097]).is_err(), "but never past the pool");
    }

    #[test]
    fn ranges_merge_when_they_overlap_or_touch_and_stay_apart_otherwise() {
        assert_eq!(
            merge_ranges(vec![
                (8192, 12288),
                (0, 4096),
                (4096, 4608),
                (100, 200),
                (9000, 9000)
            ]),
            vec![(0, 4608), (8192, 12288)]
        );
        assert!(merge_ranges(vec![(5, 5)]).is_empty());
    }

    #[test]
    fn connection_loss_voids_started_reads_in_flight_and_keeps_completed_ones() {
        let pd = Context::soft().alloc_pd().unwrap();
        let mut p = Pool::new(&pd, 3, 3, 512).unwrap();
        let s: Vec<usize> = (0..3).map(|_| p.take_free().unwrap()).collect();
        p.set(
            s[0],
            Slot::Started {
                ns: 0,
                ticket: 1,
                len: 8,
            },
        );
        p.set(s[1], Slot::StartedDone { ticket: 2, len: 8 });
        let mut w = rec(0, 0, 512, 3);
        w.notify = true;
        p.set(s[2], Slot::Writing(w));
        assert_eq!(p.in_flight(), 2);
        let held = p.on_connection_lost();
        assert_eq!(p.get(s[0]), Some(Slot::Free), "in flight: void");
        assert_eq!(p.get(s[1]), Some(Slot::StartedDone { ticket: 2, len: 8 }));
        // The started Write is held for the replay and still to be reported.
        assert_eq!(held, vec![(s[2], w)]);
        assert_eq!(p.in_flight(), 0);
    }

    #[test]
    fn connection_loss_holds_unfinished_writes_in_post_order_and_drops_reads() {
        let pd = Context::soft().alloc_pd().unwrap();
        let mut p = Pool::new(&pd, 4, 4, 512).unwrap();
        let s: Vec<usize> = (0..4).map(|_| p.take_free().unwrap()).collect();
        p.set(s[0], Slot::Writing(rec(0, 512, 512, 9)));
        p.set(s[1], Slot::Held(rec(0, 0, 512, 4)));
        p.set(
            s[2],
            Slot::Reading {
                ns: 0,
                item: 0,
                at: 0,
                len: 8,
            },
        );
        assert_eq!((p.in_flight(), p.max_in_flight()), (2, 2));
        let held = p.on_connection_lost();
        assert_eq!((p.in_flight(), p.max_in_flight()), (0, 2));
        assert_eq!(
            held.iter().map(|(_, w)| w.seq).collect::<Vec<_>>(),
            vec![4, 9]
        );
        assert_eq!(p.get(s[2]), Some(Slot::Free));
        assert_eq!(p.take_free(), Some(s[2]));
        let pd2 = Context::soft().alloc_pd().unwrap();
        p.rebind(&pd2).unwrap();
        assert_eq!(p.sge(1, 8).offset, 512);
        p.clear();
        assert_eq!(p.count(|s| *s == Slot::Free), 4);
    }
}
