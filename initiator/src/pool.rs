//! A queue's registered bounce buffers: `slots` chunks of `chunk` bytes, registered once (and
//! again in the new protection domain after a reconnect), plus an 8-byte sink for APM Reads and
//! atomic results.
//!
//! A write's slot is kept ([`Slot::Held`]) from the moment its Write is posted until a
//! durability acknowledgement covers it: that copy is what a reconnect re-issues. A read's slot
//! is free again once its bytes are copied out.
//!
//! A write from a caller's [`WriteBuf`](crate::writebuf::WriteBuf) takes a slot too (the count
//! of writes in flight and held stays the pool's), but not its memory: the slot writes from the
//! buffer, registered in the pool's domain, and keeps a hold on it ([`crate::writebuf`])
//! instead of a copy; so does a Read into a caller's buffer. Which slot is on which buffer, and
//! the buffers' registrations: `ext.rs`.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use rpma_common::fabric::{self, Access, AlignedBuf, MemoryRegion, ProtectionDomain, Sge};
use smallvec::SmallVec;

use self::ext::Callers;
use self::register::register;
use crate::idmap::IdMap;
use crate::replay::{Carried, Member};
use crate::writebuf::{Data, Hold};

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

/// A few `[start, end)` ranges, inline (a durable call's own: no allocation).
pub(crate) type Ranges = SmallVec<[(u64, u64); 4]>;

/// `ranges` (`[start, end)` each) sorted, overlapping and adjacent ones merged; empty ones
/// dropped.
pub(crate) fn merge_ranges(mut ranges: Ranges) -> Ranges {
    ranges.retain(|r| r.0 < r.1);
    ranges.sort_unstable();
    // Merged in place: `kept` ranges so far, each next one joins the last or follows it.
    let mut kept = 0usize;
    for i in 0..ranges.len() {
        let (lo, hi) = ranges[i];
        match kept.checked_sub(1).map(|k| &mut ranges[k]) {
            Some(last) if lo <= last.1 => last.1 = last.1.max(hi),
            _ => {
                ranges[kept] = (lo, hi);
                kept += 1;
            }
        }
    }
    ranges.truncate(kept);
    ranges
}

/// The bounce buffers of one queue.
pub(crate) struct Pool {
    /// The domain the memory is registered in (the connection's).
    pd: ProtectionDomain,
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
    /// Slots with a request posted, or started and to be posted, whose completion was not
    /// reaped yet.
    busy: usize,
    /// Bytes of the Reads among them ([`Pool::read_bytes_in_flight`]).
    reading: usize,
    /// Slots per variant ([`Slot::kind`]), and posted started Writes (`notify`): so that the
    /// queue's waits never scan the slots (a pool may have thousands).
    kinds: [usize; 7],
    notify_writing: usize,
    /// The newest write (posted or held) starting at each (namespace, offset): the one a new
    /// write there may supersede ([`Pool::supersede`]).
    latest: HashMap<(usize, u64), usize>,
    /// Completed started Reads by ticket.
    done_reads: IdMap<u64, usize>,
    /// (post order, slot) of every write that came into a slot, oldest first: what a persist
    /// walks instead of every slot (a pool may have thousands, a durable job holds a few). An
    /// entry whose slot no longer carries that write is stale: skipped, and dropped once the
    /// stale ones outnumber the writes carried.
    order: Vec<(u64, usize)>,
    /// Bytes copied into slots by [`Pool::load`].
    copied: u64,
    /// Bytes copied out by [`Pool::copy_out`].
    copied_out: u64,
    /// The slots whose request is on a caller's buffer.
    ext: Callers,
    /// The replay order this queue shares with the other queues of its connection.
    replay: Option<Member>,
    /// Held writes superseded by new writes not known posted yet: (the new write's slot and
    /// post order, the held write's slot and post order). The held one is freed once the new
    /// one is posted ([`settle_superseded`](Pool::settle_superseded)), never before: a post
    /// refused after it was freed left the bytes held by neither write, and a persist (this
    /// queue's, or an heir's) said durable without them.
    superseding: Vec<(usize, u64, usize, u64)>,
}

/// Whether `slots[i]` still carries the write of post order `seq`.
fn live(slots: &[Slot], seq: u64, i: usize) -> bool {
    slots[i].write().is_some_and(|w| w.seq == seq)
}

/// The bytes of a posted (or started) Read that has not completed yet (0 for any other slot).
fn reading(s: &Slot) -> usize {
    match s {
        Slot::Reading { len, .. } | Slot::Started { len, .. } => *len,
        _ => 0,
    }
}

/// A posted (or started) request that has not completed yet.
fn in_flight(s: &Slot) -> bool {
    matches!(
        s,
        Slot::Writing(_) | Slot::Reading { .. } | Slot::Started { .. }
    )
}

impl Drop for Pool {
    /// The queue is gone: its writes leave the replay order, let go unpersisted.
    fn drop(&mut self) {
        self.lose_writes(None);
        if let Some(m) = self.replay.as_mut().filter(|m| m.entered()) {
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
        let mr = register(pd, &mem)?;
        let sink = AlignedBuf::new(64)?;
        let sink_mr = pd.register(Arc::clone(&sink), Access::LOCAL_WRITE)?;
        Ok(Pool {
            pd: pd.clone(),
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
            reading: 0,
            kinds: [slots, 0, 0, 0, 0, 0, 0],
            notify_writing: 0,
            latest: HashMap::new(),
            done_reads: IdMap::default(),
            order: Vec::new(),
            copied: 0,
            copied_out: 0,
            ext: Callers::default(),
            replay: None,
            superseding: Vec::new(),
        })
    }

    /// Whether `slot` still carries the write `w` (held or posted).
    pub(crate) fn carries(&self, slot: usize, w: &WriteRec) -> bool {
        self.get(slot)
            .and_then(|s| s.write())
            .is_some_and(|x| x.key() == w.key())
    }

    /// Registers the same memory in `pd` (a new connection's domain); the slots keep their
    /// contents.
    pub(crate) fn rebind(&mut self, pd: &ProtectionDomain) -> fabric::Result<()> {
        self.mr = register(pd, &self.mem)?;
        self.sink_mr = pd.register(Arc::clone(&self.sink), Access::LOCAL_WRITE)?;
        self.pd = pd.clone();
        self.ext.rebind(pd)
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
            (false, true) => self.busy += 1,
            (true, false) => self.busy -= 1,
            _ => {}
        }
        self.reading = self.reading + reading(&s) - reading(&old);
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
        if s == Slot::Free
            || old
                .write()
                .is_some_and(|o| s.write().map(WriteRec::key) != Some(o.key()))
        {
            self.ext.take(slot);
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
            if let Some(m) = &mut self.replay {
                if let Some(w) = o {
                    m.release(w.ns, w.offset, w.len, w.seq);
                }
                if let Some(w) = n {
                    m.register(w.ns, w.offset, w.len, w.seq);
                }
            }
        }
        self.slots[slot] = s;
        if let Some(w) = n.filter(|w| o.map(WriteRec::key) != Some(w.key())) {
            self.order.push((w.seq, slot));
            self.compact();
        }
        if o.is_some() && n.is_none() && self.kinds[1] + self.kinds[2] == 0 {
            if let Some(m) = &mut self.replay {
                m.emptied();
            }
        }
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

    /// The slot of the completed started Read `ticket`, and its length.
    pub(crate) fn done_read(&self, ticket: u64) -> Option<(usize, usize)> {
        let &slot = self.done_reads.get(&ticket)?;
        match self.slots[slot] {
            Slot::StartedDone { len, .. } => Some((slot, len)),
            _ => None,
        }
    }

    /// Requests posted (or started, to be posted) and not completed yet.
    pub(crate) fn in_flight(&self) -> usize {
        self.busy
    }

    /// Bytes of the Reads posted (or started, to be posted) and not completed yet.
    pub(crate) fn read_bytes_in_flight(&self) -> usize {
        self.reading
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
        if self.slots.get(slot) == Some(&Slot::Free) {
            self.ext.take(slot);
            if !self.free.contains(&slot) {
                self.free.push(slot);
            }
        }
    }

    /// The newest post-order number given out (0: none yet).
    pub(crate) fn last_seq(&self) -> u64 {
        self.next_seq
    }

    /// The next post-order number.
    pub(crate) fn next_seq(&mut self) -> u64 {
        self.next_seq += 1;
        self.next_seq
    }

    /// Puts a write's bytes (at most a chunk) in `slot`, taken and not set yet: copies them in,
    /// or makes the slot write from the caller's buffer (registered in this pool's domain the
    /// first time) and holds it; with `read`, makes a Read's slot the caller's buffer instead
    /// (and holds it as a Read into it).
    pub(crate) fn load(&mut self, slot: usize, data: Data<'_>, read: bool) -> fabric::Result<()> {
        match data {
            Data::Bytes(b) => {
                self.ext.take(slot);
                self.mem.write_at(slot * self.chunk, b)?;
                self.copied += b.len() as u64;
                Ok(())
            }
            Data::Buf { buf, at, .. } => self.ext.put(&self.pd, slot, buf, at, read),
        }
    }

    /// Bytes copied into slots by [`load`](Self::load) so far.
    pub(crate) fn bytes_copied(&self) -> u64 {
        self.copied
    }

    /// Bytes copied out of slots (or of the buffers Reads went into) by
    /// [`copy_out`](Self::copy_out) so far.
    pub(crate) fn bytes_copied_out(&self) -> u64 {
        self.copied_out
    }

    /// The local side of a Write of `len` bytes from byte `at` of the write `slot` carries: the
    /// slot, or the caller's buffer it writes from.
    pub(crate) fn write_sge(&self, slot: usize, at: usize, len: usize) -> Sge {
        self.ext
            .sge(slot, at, len)
            .unwrap_or_else(|| self.sge_at(slot, at, len))
    }

    /// Copies the first `out.len()` bytes of `slot` out: of the slot, or of the caller's buffer
    /// a Read into it went to.
    pub(crate) fn copy_out(&mut self, slot: usize, out: &mut [u8]) -> fabric::Result<()> {
        self.copied_out += out.len() as u64;
        match self.ext.read(slot, out) {
            Some(r) => r,
            None => self.mem.read_at(slot * self.chunk, out),
        }
    }

    /// The local side of a request on `len` bytes of `slot` from byte `at`.
    pub(crate) fn sge_at(&self, slot: usize, at: usize, len: usize) -> Sge {
        Sge::new(&self.mr, slot * self.chunk + at, len)
    }

    /// The 8-byte sink.
    pub(crate) fn sink_sge(&self) -> Sge {
        Sge::new(&self.sink_mr, 0, 8)
    }

    /// The sink of placement Reads (apart from [`sink_sge`](Self::sink_sge)'s 8 bytes).
    pub(crate) fn placement_sge(&self) -> Sge {
        Sge::new(&self.sink_mr, 8, 8)
    }

    /// The value an atomic left in the sink (native endian, as the fabric stores it).
    pub(crate) fn sink_value(&self) -> fabric::Result<u64> {
        self.sink.read_u64(0)
    }

    /// Whether `slot`'s request is on a caller's buffer (a write from it, a Read into it).
    pub(crate) fn is_ext(&self, slot: usize) -> bool {
        self.ext.contains(slot)
    }

    /// The registration a slot's write from a caller's buffer uses (tests).
    #[cfg(test)]
    pub(crate) fn ext_mr(&self, slot: usize) -> Option<Arc<MemoryRegion>> {
        self.ext.mr(slot)
    }

    /// Slots in a state matching `f` (tests; the queue uses [`Pool::number`]).
    #[cfg(test)]
    pub(crate) fn count(&self, f: impl Fn(&Slot) -> bool) -> usize {
        self.slots.iter().filter(|s| f(s)).count()
    }

    /// The ranges `[start, end)` of namespace `ns` that held or writing writes cover, sorted,
    /// overlapping and adjacent ones merged.
    pub(crate) fn held_ranges(&self, ns: usize) -> Ranges {
        let all: Ranges = self
            .writes()
            .filter(|(w, _)| w.ns == ns)
            .map(|(w, _)| (w.offset, w.offset + w.len as u64))
            .collect();
        merge_ranges(all)
    }

    /// Drops the stale entries of the index once they outnumber the writes carried (amortized:
    /// at most one pass per as many writes as it keeps).
    fn compact(&mut self) {
        let carried = self.kinds[1] + self.kinds[2];
        if self.order.len() > 2 * carried + 64 {
            let slots = &self.slots;
            self.order.retain(|&(seq, i)| live(slots, seq, i));
        }
    }

    /// The writes the slots carry (posted or held), with their slots; in no set order.
    fn writes(&self) -> impl Iterator<Item = (WriteRec, usize)> + '_ {
        self.order.iter().filter_map(|&(seq, i)| {
            let w = self.slots[i].write()?;
            (w.seq == seq).then_some((w, i))
        })
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
        let mut mine: SmallVec<[(WriteRec, usize, bool); 8]> = self
            .writes()
            .filter(|(w, _)| w.ns == ns)
            .map(|(w, i)| {
                let held = matches!(self.slots[i], Slot::Held(_));
                let inside = w.offset >= start && w.offset + w.len as u64 <= end;
                (w, i, held && (all || inside))
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
        self.compact();
        n
    }

    /// After a lost connection: unfinished Writes are held for the replay, Reads in flight are
    /// dropped (their operation is re-run; a started Read's ticket is void). Returns the held
    /// writes in post order, and the holds of the dropped Reads that went into callers'
    /// buffers: the old connection may still place their bytes until it is closed, so they are
    /// to be let go only then.
    pub(crate) fn on_connection_lost(&mut self) -> (Vec<(usize, WriteRec)>, Vec<Hold>) {
        let mut voided = Vec::new();
        for i in 0..self.slots.len() {
            match self.slots[i] {
                Slot::Writing(w) => self.set(i, Slot::Held(w)),
                // A completed started Read keeps its bytes for take_read.
                Slot::Reading { .. } | Slot::ReadDone { .. } | Slot::Started { .. } => {
                    voided.extend(self.ext.take(i));
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
        (held, voided)
    }

    /// Drops every held write (a queue that gave up): let go unpersisted.
    pub(crate) fn clear(&mut self) {
        self.lose_writes(None);
        for i in 0..self.slots.len() {
            self.set(i, Slot::Free);
        }
        self.order.clear();
    }
}

mod ext;
mod order;
mod register;
mod supersede;
#[cfg(test)]
mod tests;
