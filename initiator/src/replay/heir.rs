//! The data of what a queue let go at a reconnect to newer writes of other queues, and what
//! its persist owes for it ([`super::heirs`] keeps it up to date).

/// `[start, end)` pieces of namespace `nsid`.
pub(super) type Spans = Vec<(u32, u64, u64)>;

/// The bytes a queue let go to newer writes of other queues ([`Member::hand_over`](super::Member::hand_over)).
#[derive(Debug, Default)]
pub(super) struct Heir {
    /// The order's clock when the queue last re-issued ([`ReplayOrder::tick`](super::ReplayOrder::tick)): a placement
    /// of another queue vouches for its bytes only if learned from a request sent since.
    pub(super) since: u64,
    /// The bytes it let go that newer writes of other queues held then.
    pub(super) ranges: Spans,
    /// The parts of them whose newest write was let go unpersisted.
    pub(super) lost: Spans,
    /// Bytes taken out of `ranges` by a newer write while the write that held them was known
    /// placed since the reconnect (the queue that vouched for it, last): made durable by the
    /// heir's persist without waiting for the newer write's placement
    /// ([`ReplayOrder::taken_from_heirs`](super::ReplayOrder::taken_from_heirs)).
    pub(super) vouched: Vec<(u32, u64, u64, u64)>,
    /// `ranges` is sorted by namespace and start, overlapping and adjacent spans merged
    /// ([`Heir::sort`]): a write looks up what it takes from them by a binary search. Whatever
    /// changes `ranges` but [`ReplayOrder::taken_from_heirs`](super::ReplayOrder::taken_from_heirs)
    /// clears it.
    pub(super) sorted: bool,
}

impl Heir {
    /// Sorts and merges `ranges` (see [`Heir::sorted`]).
    pub(super) fn sort(&mut self) {
        if self.sorted {
            return;
        }
        self.ranges.sort_unstable();
        let mut out: Spans = Vec::with_capacity(self.ranges.len());
        for &(n, s, e) in &self.ranges {
            match out.last_mut() {
                Some(last) if last.0 == n && s <= last.2 => last.2 = last.2.max(e),
                _ => out.push((n, s, e)),
            }
        }
        self.ranges = out;
        self.sorted = true;
    }

    /// The span of `ranges` (sorted) that overlaps `[start, end)` of `nsid`: its indices.
    pub(super) fn overlapping(&self, nsid: u32, start: u64, end: u64) -> std::ops::Range<usize> {
        debug_assert!(self.sorted);
        let lo = self.ranges.partition_point(|r| (r.0, r.2) <= (nsid, start));
        let n = self.ranges[lo..]
            .iter()
            .take_while(|r| r.0 == nsid && r.1 < end)
            .count();
        lo..lo + n
    }

    /// Whether it owes nothing.
    pub(super) fn is_empty(&self) -> bool {
        self.ranges.is_empty() && self.lost.is_empty() && self.vouched.is_empty()
    }

    /// The spans of `vouched`, without the queue that vouched for them.
    pub(super) fn vouched_spans(&self) -> Spans {
        self.vouched.iter().map(|&(n, s, e, _)| (n, s, e)).collect()
    }
}

/// What the persist of a queue's own writes of a namespace owes for the bytes it let go
/// ([`Member::handed`](super::Member::handed)).
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Handed {
    /// Also make these ranges durable (sorted, disjoint; often none): bytes newer writes of
    /// other queues hold, known placed since this queue reconnected.
    Persist(Vec<(u64, u64)>),
    /// Newer writes of these queues (sorted, each once) are not known placed since this queue
    /// reconnected.
    Unplaced(Vec<u64>),
    /// The newest writes of these ranges (sorted, disjoint) were let go unpersisted.
    Lost(Vec<(u64, u64)>),
}

/// The spans of `nsid` in `spans`, sorted, overlapping and adjacent ones merged.
pub(super) fn merged(spans: &Spans, nsid: u32) -> Vec<(u64, u64)> {
    let mut r: Vec<(u64, u64)> = spans
        .iter()
        .filter(|s| s.0 == nsid)
        .map(|s| (s.1, s.2))
        .collect();
    r.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(r.len());
    for (s, e) in r {
        match out.last_mut() {
            Some(last) if s <= last.1 => last.1 = last.1.max(e),
            _ => out.push((s, e)),
        }
    }
    out
}

/// `ranges` (of one namespace) without the bytes of `cut` (sorted, disjoint).
pub(super) fn without(ranges: &[(u64, u64)], cut: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    for &(s, e) in ranges {
        let mut at = s;
        for &(cs, ce) in cut.iter().filter(|c| c.1 > s && c.0 < e) {
            if cs > at {
                out.push((at, cs));
            }
            at = at.max(ce);
        }
        if at < e {
            out.push((at, e));
        }
    }
    out
}
