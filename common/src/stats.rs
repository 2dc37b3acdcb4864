//! Counters and latency histograms kept where the work happens, with one writer each.
//!
//! A [`Counter`] or [`HistogramCell`] is written by its owner only (a poll loop, or the thread
//! that holds a queue pair's lock: a lock handed from thread to thread keeps one writer at a
//! time) with a relaxed load and a relaxed store, which compile to plain moves: no
//! read-modify-write instruction, no cache line bouncing between cores. Any thread may read
//! them at any time (`status`, a metrics scrape) and sees each value whole, possibly a moment
//! old. Two writers at once would lose increments (never memory safety): that is the rule the
//! owners keep.
//!
//! [`Histogram`] is a plain copy with fixed log-2 buckets from 250 ns to about 1 s
//! ([`BUCKETS`], [`bucket_upper_ns`]), the shape the Prometheus text exposition wants
//! (cumulative `le` buckets, a sum and a count).
//!
//! Benchmark builds can remove the counting: compiled with `--cfg rpma_no_counters` (in
//! `RUSTFLAGS`), [`Counter::add`] and [`HistogramCell::record`] do nothing and [`Stopwatch`]
//! never reads the clock (docs/benchmarks.md, "What the counters cost").

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// Whether this build counts (false when built with `--cfg rpma_no_counters`).
pub const COUNTING: bool = !cfg!(rpma_no_counters);

/// A monotonic counter with one writer (module docs).
#[derive(Debug, Default)]
pub struct Counter(AtomicU64);

impl Counter {
    /// Zero.
    pub const fn new() -> Counter {
        Counter(AtomicU64::new(0))
    }

    /// Adds `n`. Only the counter's owner calls this (module docs).
    #[inline]
    pub fn add(&self, n: u64) {
        if COUNTING {
            let v = self.0.load(Ordering::Relaxed);
            self.0.store(v.wrapping_add(n), Ordering::Relaxed);
        }
    }

    /// The value now.
    #[inline]
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// Histogram buckets: 23 finite ones (250 ns doubling to 1.048576 s) and the last, +Inf.
pub const BUCKETS: usize = 24;

/// The smallest bucket's upper bound.
const FIRST_UPPER_NS: u64 = 250;

/// The upper bound (inclusive) of bucket `i` in nanoseconds; None for the last (+Inf) and
/// beyond.
pub fn bucket_upper_ns(i: usize) -> Option<u64> {
    (i < BUCKETS - 1).then(|| FIRST_UPPER_NS << i)
}

/// The bucket that counts a sample of `ns` nanoseconds.
fn bucket_of(ns: u64) -> usize {
    // Bucket i holds (250 << (i-1), 250 << i]: i = ceil(log2(ceil(ns / 250))).
    let q = ns.div_ceil(FIRST_UPPER_NS).max(1);
    let i = (64 - (q - 1).leading_zeros()) as usize;
    i.min(BUCKETS - 1)
}

/// A copy of a latency histogram: a count per bucket (not cumulative) and the sum.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Histogram {
    /// Samples per bucket ([`bucket_upper_ns`]); the last is +Inf.
    pub counts: [u64; BUCKETS],
    /// The sum of every sample, in nanoseconds.
    pub sum_ns: u64,
}

impl Histogram {
    /// Adds one sample of `ns` nanoseconds.
    pub fn record(&mut self, ns: u64) {
        self.counts[bucket_of(ns)] += 1;
        self.sum_ns = self.sum_ns.wrapping_add(ns);
    }

    /// Samples in all.
    pub fn count(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// Adds `other`'s samples to this one.
    pub fn merge(&mut self, other: &Histogram) {
        for (a, b) in self.counts.iter_mut().zip(other.counts.iter()) {
            *a += b;
        }
        self.sum_ns = self.sum_ns.wrapping_add(other.sum_ns);
    }

    /// (upper bound in ns, None for +Inf; samples at or below it): the cumulative buckets of
    /// the Prometheus exposition.
    pub fn cumulative(&self) -> impl Iterator<Item = (Option<u64>, u64)> + '_ {
        let mut acc = 0;
        self.counts.iter().enumerate().map(move |(i, c)| {
            acc += c;
            (bucket_upper_ns(i), acc)
        })
    }

    /// The upper bound of the bucket that holds quantile `q` (0..=1) of the samples: a value at
    /// most twice the true one. None without samples, or when it falls in the +Inf bucket.
    pub fn quantile_upper_ns(&self, q: f64) -> Option<u64> {
        let n = self.count();
        if n == 0 {
            return None;
        }
        let rank = ((q.clamp(0.0, 1.0) * n as f64).ceil() as u64).max(1);
        self.cumulative()
            .find(|&(_, c)| c >= rank)
            .and_then(|(upper, _)| upper)
    }
}

/// A latency histogram with one writer (module docs).
#[derive(Debug, Default)]
pub struct HistogramCell {
    counts: [Counter; BUCKETS],
    sum_ns: Counter,
}

impl HistogramCell {
    /// Empty.
    pub fn new() -> HistogramCell {
        HistogramCell::default()
    }

    /// Adds one sample of `ns` nanoseconds. Only the owner calls this.
    #[inline]
    pub fn record(&self, ns: u64) {
        if COUNTING {
            self.counts[bucket_of(ns)].add(1);
            self.sum_ns.add(ns);
        }
    }

    /// Adds the time since `sw` started, if it was started (a counting build).
    #[inline]
    pub fn record_since(&self, sw: Stopwatch) {
        if let Some(ns) = sw.elapsed_ns() {
            self.record(ns);
        }
    }

    /// A copy.
    pub fn snapshot(&self) -> Histogram {
        let mut h = Histogram {
            sum_ns: self.sum_ns.get(),
            ..Histogram::default()
        };
        for (c, cell) in h.counts.iter_mut().zip(self.counts.iter()) {
            *c = cell.get();
        }
        h
    }
}

/// A start time for a latency sample; reads the clock only in a counting build.
#[derive(Debug, Clone, Copy)]
pub struct Stopwatch(Option<Instant>);

impl Stopwatch {
    /// Now (in a counting build).
    #[inline]
    pub fn start() -> Stopwatch {
        Stopwatch(COUNTING.then(Instant::now))
    }

    /// Nanoseconds since [`start`](Self::start); None in a build without counting.
    #[inline]
    pub fn elapsed_ns(&self) -> Option<u64> {
        self.0
            .map(|t| u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX))
    }
}

#[cfg(all(test, not(rpma_no_counters)))]
mod tests {
    use super::*;

    #[test]
    fn buckets_double_from_250_ns_and_end_with_inf() {
        assert_eq!(bucket_upper_ns(0), Some(250));
        assert_eq!(bucket_upper_ns(1), Some(500));
        assert_eq!(bucket_upper_ns(22), Some(250 << 22));
        assert_eq!(bucket_upper_ns(23), None);
        for (ns, i) in [
            (0, 0),
            (1, 0),
            (250, 0),
            (251, 1),
            (500, 1),
            (501, 2),
            (1000, 2),
            (1001, 3),
            (250 << 22, 22),
            ((250 << 22) + 1, 23),
            (u64::MAX, 23),
        ] {
            assert_eq!(bucket_of(ns), i, "{ns} ns");
            // Every sample is at most its bucket's bound and above the one before.
            if let Some(up) = bucket_upper_ns(i) {
                assert!(ns <= up);
            }
            if i > 0 {
                assert!(ns > bucket_upper_ns(i - 1).unwrap());
            }
        }
    }

    #[test]
    fn cells_count_and_copies_merge_cumulatively() {
        let cell = HistogramCell::new();
        for ns in [100, 300, 300, 2_000_000, 5_000_000_000] {
            cell.record(ns);
        }
        let h = cell.snapshot();
        assert_eq!(h.count(), 5);
        assert_eq!(h.sum_ns, 100 + 600 + 2_000_000 + 5_000_000_000);
        let cum: Vec<(Option<u64>, u64)> = h.cumulative().collect();
        assert_eq!(cum.len(), BUCKETS);
        assert_eq!(cum[0], (Some(250), 1));
        assert_eq!(cum[1], (Some(500), 3));
        assert_eq!(cum[BUCKETS - 2].1, 4, "5 s is past the last finite bucket");
        assert_eq!(cum[BUCKETS - 1], (None, 5));
        assert!(cum.windows(2).all(|w| w[0].1 <= w[1].1), "cumulative");
        let mut m = h;
        m.merge(&h);
        assert_eq!(m.count(), 10);
        assert_eq!(m.sum_ns, 2 * h.sum_ns);
        assert_eq!(h.quantile_upper_ns(0.5), Some(500));
        assert_eq!(
            h.quantile_upper_ns(0.8),
            Some(250 << 13),
            "2 ms: (1.02, 2.05] ms"
        );
        assert_eq!(h.quantile_upper_ns(1.0), None, "in +Inf");
        assert_eq!(Histogram::default().quantile_upper_ns(0.5), None);
    }

    #[test]
    fn counters_add_and_stopwatches_measure() {
        let c = Counter::new();
        c.add(3);
        c.add(4);
        assert_eq!(c.get(), 7);
        let sw = Stopwatch::start();
        std::thread::sleep(std::time::Duration::from_millis(2));
        let ns = sw.elapsed_ns().expect("a counting build reads the clock");
        assert!(ns >= 2_000_000, "{ns}");
        let cell = HistogramCell::new();
        cell.record_since(sw);
        assert_eq!(cell.snapshot().count(), 1);
    }
}
