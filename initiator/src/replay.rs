//! The replay order of the queues of one [`Connection`](crate::Connection): which held write
//! a re-issue may still replay, byte for byte, when several queues write the same namespace.
//!
//! A queue holds every write it acknowledged until a durability acknowledgement covers it, and
//! re-issues the held ones, in its own post order, on the next connection after a loss. Within
//! one queue that order is the order the writes were made. Across queues it is not: a block
//! written on queue A, then (after A's acknowledgement) rewritten on queue B, would get A's
//! older copy back when A reconnects and re-issues it (the NBD export's four-connection ext4
//! test saw that: a file system that needed cleaning after one of the export's queues lost
//! its connection mid-mkfs, in the VM lab under load).
//!
//! So the queues of a connection share one map of the bytes each held write is still the
//! newest writer of: a write is registered as it is posted (its range taken from every older
//! write, of any queue, that it overlaps), released when its slot lets it go, and a re-issue
//! replays only the pieces it still owns. Pieces taken away never come back: the newer write
//! owns them until it is durable, and after that no replay may touch them.
//!
//! A queue alone on its connection needs none of this, and the map costs a write about a
//! microsecond when a queue holds thousands of writes (4 KiB random writes at depth 16 ran at
//! 0.71x with every write in it: docs/benchmarks.md). So a queue stays out of the map
//! ("unentered") until the connection has a second queue; it notices at its next change of a
//! slot or poll of its completions, and enters what it holds then ([`Member::keep_order`]),
//! newest first, each write only where no one in the map wrote. That is right because a write
//! it kept out is never newer than one in the map: the second queue entered as it joined,
//! before its first write, and the first looks at the count of queues before each change, so a
//! write it made after one of the other queue's was acknowledged went in. For the map to keep
//! saying which bytes were written after the writes kept out, a write released while some
//! queue is unentered leaves its pieces behind as tombstones (owned by no queue); they go when
//! the last unentered queue enters or goes. A queue's owner polls at least every half
//! keep-alive period (the library's rule for [`Queue::tick`](crate::Queue::tick)), so
//! tombstones pile up for a few seconds at most.
//!
//! The map also says which of those writes may not be placed yet. A Write completes when the
//! transport took it (iWARP's rule, the `tcp` transport's): the bytes may still be on their way
//! to the target when a newer write of the same bytes, on another queue pair, lands. Within a
//! queue pair the target executes requests in order; across queue pairs nothing orders them.
//! So a queue records the newest write it knows placed (its post order when a Read or a probe
//! it posted after them was answered: [`Member::placed_through`]), and a caller about to write
//! or read bytes through one queue asks which queues hold writes of them not known placed
//! ([`Member::unplaced_writers`]); it has the others place their writes first, or sends its
//! request through the one queue that holds them (the NBD export does, for its connections).
//! A queue kept out of the map may hold any bytes: it is named too, until it enters. After a
//! reconnect a queue knows nothing placed again ([`Member::unplace`]): its re-issued writes
//! are on their way. A filter of atomic counters ([`hot`]) answers most questions without
//! the lock.
//!
//! And it fences the connection's writes after a queue gave up a connection it could not
//! retire ([`ReplayOrder::fence_until`]): that connection may still deliver its writes until
//! the target expires the silent session, over newer writes of any queue (a replacement queue
//! the NBD export opened at once, or another client's), so no Write of the connection is
//! posted before then.
//!
//! A write a re-issue lets go because newer writes of other queues took its bytes is not
//! durable: its queue's persist of its own writes makes those bytes durable once the newer
//! writes are placed, or says they may be lost ([`heirs`]).

mod heir;
mod heirs;
mod hot;

pub(crate) use heir::Handed;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// Who wrote: a queue of the connection, and the write's post order in that queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Writer {
    pub(crate) queue: u64,
    pub(crate) seq: u64,
}

/// The owner of a tombstone: bytes written by a write that is gone, after every write an
/// unentered queue kept out.
const TOMBSTONE: Writer = Writer {
    queue: u64::MAX,
    seq: u64::MAX,
};

/// A piece `[start, end)` of namespace `nsid` and the write that owns it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Piece {
    end: u64,
    owner: Writer,
    /// Its write was let go unpersisted and is not released yet ([`Member::lose`]): a queue
    /// that lets its bytes go before the release loses them ([`Member::hand_over`]).
    lost: bool,
}

impl Piece {
    /// A piece of a write just posted (or entered).
    fn new(end: u64, owner: Writer) -> Piece {
        Piece {
            end,
            owner,
            lost: false,
        }
    }
}

/// What the lock guards.
#[derive(Debug, Default)]
struct Inner {
    /// Disjoint pieces by (nsid, start).
    pieces: BTreeMap<(u32, u64), Piece>,
    /// Queues alive whose writes are not in the map.
    unentered: Vec<u64>,
    /// Per queue, the post order of its newest write known placed (none: nothing known).
    placed: HashMap<u64, u64>,
    /// Queues asked to learn their placement soon ([`ReplayOrder::want_placed`]).
    wanted: Vec<u64>,
    /// Queues alive (members not dropped): only they can be asked.
    alive: Vec<u64>,
    /// Per queue, the bytes it let go to newer writes at a reconnect ([`heirs`]).
    heirs: HashMap<u64, heir::Heir>,
    /// Per queue, the post order of its newest write known placed by a request sent when the
    /// clock read the second number ([`Member::placed_fresh`]): kept while a queue is an heir.
    fresh: HashMap<u64, (u64, u64)>,
}

/// The shared map (one per [`Connection`](crate::Connection) and its clones).
#[derive(Debug, Default)]
pub(crate) struct ReplayOrder {
    next_queue: AtomicU64,
    /// Queues alive.
    members: AtomicUsize,
    inner: Mutex<Inner>,
    /// Where writes not known placed may be, without the lock ([`hot`]).
    hot: hot::Hot,
    /// How many queues are in `Inner::wanted`: a queue looks without the lock.
    wanting: AtomicUsize,
    /// No Write of the connection is posted before this many nanoseconds after [`epoch`]
    /// (0: none): [`ReplayOrder::fence_until`].
    fence: AtomicU64,
    /// Orders reconnects, placements and losses ([`heirs`]).
    clock: AtomicU64,
    /// How many queues are in `Inner::heirs`: the others look without the lock.
    heirs: AtomicUsize,
    /// The clock when a write was last let go unpersisted ([`Member::lose`]).
    last_loss: AtomicU64,
}

/// The origin of [`ReplayOrder::fence`]'s instants.
fn epoch() -> std::time::Instant {
    static EPOCH: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    *EPOCH.get_or_init(std::time::Instant::now)
}

impl ReplayOrder {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A queue gave up a connection that may still deliver Writes until `until` (the target
    /// expires the silent session by then): no Write of the connection is posted before.
    pub(crate) fn fence_until(&self, until: std::time::Instant) {
        let at = u64::try_from(until.saturating_duration_since(epoch()).as_nanos())
            .unwrap_or(u64::MAX)
            .max(1);
        self.fence.fetch_max(at, Ordering::SeqCst);
    }

    /// How long Writes must still wait for the fence, if they must.
    pub(crate) fn fence_left(&self) -> Option<std::time::Duration> {
        let at = self.fence.load(Ordering::Relaxed);
        if at == 0 {
            return None;
        }
        let until = epoch() + std::time::Duration::from_nanos(at);
        let left = until.saturating_duration_since(std::time::Instant::now());
        (!left.is_zero()).then_some(left)
    }

    /// `owner` writes `[start, end)` of `nsid` (a new write, as it is posted): it owns those
    /// bytes now, whoever owned them before. (Called for every write: no allocation, and a
    /// rewrite of the same range, the common case, replaces one piece in place.)
    pub(crate) fn register(&self, nsid: u32, start: u64, end: u64, owner: Writer) {
        if start >= end {
            return;
        }
        let mut inner = self.lock();
        if self.heirs.load(Ordering::SeqCst) > 0 {
            Self::taken_from_heirs(&mut inner, nsid, start, end);
        }
        let map = &mut inner.pieces;
        // Pieces are disjoint: only the last one starting before `start` can reach into it.
        let before = map
            .range((nsid, 0)..(nsid, start))
            .next_back()
            .map(|(&(_, s), &p)| (s, p))
            .filter(|(_, p)| p.end > start);
        if let Some((s, p)) = before {
            map.insert((nsid, s), Piece { end: start, ..p });
            if p.end > end {
                map.insert((nsid, end), p);
            }
        }
        if let Some(p) = map.get_mut(&(nsid, start)) {
            if p.end >= end {
                let rest = (p.end > end).then_some(*p);
                *p = Piece::new(end, owner);
                if let Some(r) = rest {
                    map.insert((nsid, end), r);
                }
                return;
            }
        }
        while let Some((&k, &p)) = map.range((nsid, start)..(nsid, end)).next() {
            map.remove(&k);
            if p.end > end {
                map.insert((nsid, end), p);
            }
        }
        map.insert((nsid, start), Piece::new(end, owner));
    }

    /// `owner`'s write of `[start, end)` needs no replay any more (durable, superseded in its
    /// queue, or its queue gave up): the pieces it still owns go (they all start inside its
    /// range), or stay as tombstones while a queue is unentered.
    pub(crate) fn release(&self, nsid: u32, start: u64, end: u64, owner: Writer) {
        let mut inner = self.lock();
        let keep = !inner.unentered.is_empty();
        let map = &mut inner.pieces;
        let mut from = start;
        while from < end {
            let Some((&k, p)) = map.range_mut((nsid, from)..(nsid, end)).next() else {
                break;
            };
            from = p.end;
            if p.owner == owner {
                if keep {
                    p.owner = TOMBSTONE;
                } else {
                    map.remove(&k);
                }
            }
        }
    }

    /// The pieces of `[start, end)` that `owner` still owns, by start: what its re-issue may
    /// write.
    pub(crate) fn owned(&self, nsid: u32, start: u64, end: u64, owner: Writer) -> Vec<(u64, u64)> {
        let inner = self.lock();
        inner
            .pieces
            .range((nsid, start)..(nsid, end))
            .filter(|(_, p)| p.owner == owner)
            .map(|(&(_, s), p)| (s, p.end))
            .collect()
    }

    /// `owner` wrote `[start, end)` of `nsid` before every write in the map that overlaps it
    /// (a write an unentered queue kept out): it owns only the bytes no piece covers.
    fn fill(map: &mut BTreeMap<(u32, u64), Piece>, nsid: u32, start: u64, end: u64, owner: Writer) {
        let mut at = start;
        let before = map
            .range((nsid, 0)..(nsid, start))
            .next_back()
            .map(|(_, p)| p.end);
        if let Some(e) = before {
            at = at.max(e);
        }
        let inside: Vec<(u64, u64)> = map
            .range((nsid, start)..(nsid, end))
            .map(|(&(_, s), p)| (s, p.end))
            .collect();
        for (s, e) in inside {
            if s > at {
                map.insert((nsid, at), Piece::new(s, owner));
            }
            at = at.max(e);
        }
        if at < end {
            map.insert((nsid, at), Piece::new(end, owner));
        }
    }

    /// The queues that may hold writes of `[start, end)` of `nsid` not known placed: the
    /// owners of its pieces whose write is newer than what they know placed, and every queue
    /// kept out of the map. Sorted, each once.
    fn unplaced(&self, nsid: u32, start: u64, end: u64) -> Vec<u64> {
        if !self.hot.maybe(nsid, start, end) {
            return Vec::new();
        }
        self.unplaced_exact(nsid, start, end)
    }

    /// [`unplaced`](Self::unplaced) from the map alone.
    fn unplaced_exact(&self, nsid: u32, start: u64, end: u64) -> Vec<u64> {
        let inner = self.lock();
        let mut out = inner.unentered.clone();
        let before = inner
            .pieces
            .range((nsid, 0)..(nsid, start))
            .next_back()
            .filter(|(_, p)| p.end > start);
        let inside = inner.pieces.range((nsid, start)..(nsid, end));
        for (_, p) in before.into_iter().chain(inside) {
            let w = p.owner;
            if w != TOMBSTONE && inner.placed.get(&w.queue).is_none_or(|&s| w.seq > s) {
                out.push(w.queue);
            }
        }
        out.sort_unstable();
        out.dedup();
        out
    }

    /// Asks the queues `ids` to learn soon whether their writes are placed (each sends a probe
    /// with its next post or poll: [`Member::take_want`]) rather than after its next 16
    /// requests: a caller whose request waits for their writes asks.
    pub(crate) fn want_placed(&self, ids: &[u64]) {
        let mut inner = self.lock();
        for &id in ids {
            // A queue gone since the caller looked would never take its ask: every queue
            // would look under the lock from then on.
            if inner.alive.contains(&id) && !inner.wanted.contains(&id) {
                inner.wanted.push(id);
                self.wanting.fetch_add(1, Ordering::SeqCst);
            }
        }
    }

    /// Takes `queue` out of the queues asked to learn their placement: whether it was in.
    fn unwant(&self, queue: u64) -> bool {
        if self.wanting.load(Ordering::SeqCst) == 0 {
            return false;
        }
        self.unwant_locked(&mut self.lock(), queue)
    }

    /// [`unwant`](Self::unwant) under the lock.
    fn unwant_locked(&self, inner: &mut Inner, queue: u64) -> bool {
        let Some(i) = inner.wanted.iter().position(|&q| q == queue) else {
            return false;
        };
        inner.wanted.swap_remove(i);
        self.wanting.fetch_sub(1, Ordering::SeqCst);
        true
    }

    /// One unentered queue fewer (`queue` entered, or it went): the last one takes the
    /// tombstones with it.
    fn one_unentered_fewer(inner: &mut Inner, queue: u64) {
        inner.unentered.retain(|&q| q != queue);
        if inner.unentered.is_empty() {
            inner.pieces.retain(|_, p| p.owner != TOMBSTONE);
        }
    }

    /// How many pieces the map holds (its memory).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.lock().pieces.len()
    }
}

/// The writes a queue's slots carry, for its entry into the map: (ns index, offset, len, seq).
pub(crate) type Carried = Vec<(usize, u64, usize, u64)>;

/// A queue's membership: the shared order, its number in it, its namespaces' nsids by the
/// index its slots name them by, and whether its writes are in the map.
#[derive(Debug)]
pub(crate) struct Member {
    order: Arc<ReplayOrder>,
    queue: u64,
    nsids: Vec<u32>,
    entered: bool,
    /// Its writes in the map not known placed, as the filter counts them: (seq, nsid, start,
    /// end), oldest first.
    counted: VecDeque<(u64, u32, u64, u64)>,
    /// Blind in the filter (kept out of the map, or its placement unknown) until a placement
    /// through this post order.
    blind_through: Option<u64>,
    /// The clock when it last held nothing, or began a re-issue that then ended: a write let
    /// go unpersisted before could not have taken bytes of what it holds ([`heirs`]).
    settled: u64,
    /// The clock when its re-issue under way began.
    reissue_from: u64,
}

impl Drop for Member {
    fn drop(&mut self) {
        for (_, nsid, s, e) in self.counted.drain(..) {
            self.order.hot.remove(nsid, s, e);
        }
        if self.blind_through.take().is_some() {
            self.order.hot.blind(false);
        }
        self.order.members.fetch_sub(1, Ordering::SeqCst);
        let mut inner = self.order.lock();
        inner.alive.retain(|&q| q != self.queue);
        self.order.unwant_locked(&mut inner, self.queue);
        inner.placed.remove(&self.queue);
        inner.fresh.remove(&self.queue);
        ReplayOrder::unvouch(&mut inner, self.queue);
        self.order.drop_heir(&mut inner.heirs, self.queue);
        if !self.entered {
            ReplayOrder::one_unentered_fewer(&mut inner, self.queue);
        }
    }
}

impl Member {
    /// A new queue of the connection: it enters at once if another is alive (it holds no
    /// write yet), else it stays out until one comes.
    pub(crate) fn new(order: Arc<ReplayOrder>, nsids: Vec<u32>) -> Member {
        let queue = order.next_queue.fetch_add(1, Ordering::Relaxed);
        {
            let mut inner = order.lock();
            inner.unentered.push(queue);
            inner.alive.push(queue);
        }
        order.hot.blind(true);
        order.members.fetch_add(1, Ordering::SeqCst);
        let settled = order.now();
        let mut m = Member {
            queue,
            order,
            nsids,
            entered: false,
            counted: VecDeque::new(),
            blind_through: Some(u64::MAX),
            settled,
            reissue_from: settled,
        };
        m.keep_order(Vec::new);
        m
    }

    /// The connection's order (its fence: [`ReplayOrder::fence_left`]).
    pub(crate) fn order(&self) -> &ReplayOrder {
        &self.order
    }

    /// Whether this queue's writes go through the map: once another queue of the connection
    /// is (or was) alive. The first time, the writes its slots carry (`held`) enter it,
    /// newest first, each where no piece is.
    pub(crate) fn keep_order(&mut self, held: impl FnOnce() -> Carried) -> bool {
        if self.entered {
            return true;
        }
        if self.order.members.load(Ordering::SeqCst) < 2 {
            return false;
        }
        let mut held = held();
        held.sort_unstable_by_key(|h| std::cmp::Reverse(h.3));
        // What it held stays blind to the filter until placed; holding nothing, it sees.
        match held.first() {
            Some(h) => self.blind_through = Some(h.3),
            None => self.see(),
        }
        let mut inner = self.order.lock();
        for (ns, offset, len, seq) in held {
            if let Some((nsid, s, e, w)) = self.at(ns, offset, len, seq) {
                ReplayOrder::fill(&mut inner.pieces, nsid, s, e, w);
            }
        }
        ReplayOrder::one_unentered_fewer(&mut inner, self.queue);
        self.entered = true;
        true
    }

    /// Whether this queue's writes are in the map.
    pub(crate) fn entered(&self) -> bool {
        self.entered
    }

    fn at(&self, ns: usize, offset: u64, len: usize, seq: u64) -> Option<(u32, u64, u64, Writer)> {
        let nsid = *self.nsids.get(ns)?;
        let w = Writer {
            queue: self.queue,
            seq,
        };
        Some((nsid, offset, offset + len as u64, w))
    }

    /// This queue's number in the order.
    pub(crate) fn id(&self) -> u64 {
        self.queue
    }

    /// The queues (this one too) that may hold writes of `len` bytes at `offset` of namespace
    /// index `ns` that are not known placed ([`ReplayOrder`]'s module doc). Empty for a
    /// namespace the member does not know.
    pub(crate) fn unplaced_writers(&self, ns: usize, offset: u64, len: usize) -> Vec<u64> {
        match self.nsids.get(ns) {
            Some(&nsid) => self.order.unplaced(nsid, offset, offset + len as u64),
            None => Vec::new(),
        }
    }

    /// Every write of this queue up to post order `seq` is placed (a Read or a probe posted
    /// after them was answered).
    pub(crate) fn placed_through(&mut self, seq: u64) {
        // Nothing counted or blind that this places: the mark already says all that matters
        // (no lock for every answered Read).
        let pops = self.counted.front().is_some_and(|c| c.0 <= seq);
        if !pops && self.blind_through.is_none_or(|b| b > seq) {
            return;
        }
        {
            let mut inner = self.order.lock();
            let e = inner.placed.entry(self.queue).or_insert(seq);
            *e = (*e).max(seq);
        }
        while let Some(&(w, nsid, s, e)) = self.counted.front() {
            if w > seq {
                break;
            }
            self.counted.pop_front();
            self.order.hot.remove(nsid, s, e);
        }
        if self.blind_through.is_some_and(|b| b <= seq) {
            self.see();
        }
    }

    /// Nothing of this queue is known placed any more (it reconnected: what it re-issues is
    /// on its way), until a placement through `last` (its newest post order now).
    pub(crate) fn unplace(&mut self, last: u64) {
        {
            let mut inner = self.order.lock();
            inner.placed.remove(&self.queue);
            inner.fresh.remove(&self.queue);
            ReplayOrder::unvouch(&mut inner, self.queue);
        }
        for (_, nsid, s, e) in self.counted.drain(..) {
            self.order.hot.remove(nsid, s, e);
        }
        if self.blind_through.is_none() {
            self.order.hot.blind(true);
        }
        self.blind_through = Some(last);
    }

    /// Whether this queue has writes in the map not known placed (or may have: blind).
    pub(crate) fn unplaced(&self) -> bool {
        !self.counted.is_empty() || self.blind_through.is_some()
    }

    /// Asks the queues `ids` to learn their placement soon ([`ReplayOrder::want_placed`]).
    pub(crate) fn want_placed(&self, ids: &[u64]) {
        self.order.want_placed(ids);
    }

    /// Whether another caller asked this queue to learn its placement soon
    /// ([`ReplayOrder::want_placed`]); the ask is taken (one probe answers it). One atomic
    /// load while no one asks.
    pub(crate) fn take_want(&self) -> bool {
        self.order.unwant(self.queue)
    }

    /// No longer blind to the filter.
    fn see(&mut self) {
        if self.blind_through.take().is_some() {
            self.order.hot.blind(false);
        }
    }

    /// A new write of this queue, as it is posted (the queue entered).
    pub(crate) fn register(&mut self, ns: usize, offset: u64, len: usize, seq: u64) {
        if let Some((nsid, s, e, w)) = self.at(ns, offset, len, seq) {
            self.order.register(nsid, s, e, w);
            if s < e {
                self.order.hot.add(nsid, s, e);
                self.counted.push_back((seq, nsid, s, e));
            }
        }
    }

    /// A write of this queue that needs no replay any more (the queue entered).
    pub(crate) fn release(&mut self, ns: usize, offset: u64, len: usize, seq: u64) {
        if let Some((nsid, s, e, w)) = self.at(ns, offset, len, seq) {
            self.order.release(nsid, s, e, w);
            if let Some(i) = self.counted.iter().position(|c| c.0 == seq) {
                self.counted.remove(i);
                self.order.hot.remove(nsid, s, e);
            }
        }
    }

    /// The pieces of a write of this queue that its re-issue may write (the queue entered).
    pub(crate) fn owned(&self, ns: usize, offset: u64, len: usize, seq: u64) -> Vec<(u64, u64)> {
        match self.at(ns, offset, len, seq) {
            Some((nsid, s, e, w)) => self.order.owned(nsid, s, e, w),
            None => vec![(offset, offset + len as u64)],
        }
    }
}

#[cfg(test)]
mod tests;
