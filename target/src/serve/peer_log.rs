//! Rate-limited warnings about unauthenticated peers: a peer that sends bad MPA Requests or
//! Connects that are refused must not be able to fill the log. The first warning about an
//! address in a period (`refusal_log_period_ms`, a minute by default) is logged at WARN; more
//! about the same address within the period go to DEBUG and are counted, and once a period
//! after the first of them one WARN line says how many were suppressed, about how many
//! addresses, and which address had the most ([`PeerLog::summarize`], called by the accept
//! threads on a timer and by every warning).

use std::collections::HashMap;
use std::fmt::Arguments;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Addresses remembered at most; when full, entries older than the period are forgotten,
/// and if none is, warnings about new addresses go to DEBUG too (a flood from many addresses
/// gets one WARN per address and period at most, and the map stays bounded).
const MAX_PEERS: usize = 4096;

/// The per-address limiter, shared by the accept threads and the poll loops.
#[derive(Debug)]
pub(crate) struct PeerLog {
    /// The period in ms (a reload may change it).
    period_ms: AtomicU64,
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    last: HashMap<IpAddr, Instant>,
    /// Suppressed since the last summary, per address (at most MAX_PEERS of them)...
    suppressed: HashMap<IpAddr, u64>,
    /// ...and about addresses past that.
    suppressed_other: u64,
    /// When the first warning since the last summary was suppressed.
    since: Option<Instant>,
    /// Suppressed in all, ever.
    total: u64,
}

/// A summary line that is due.
#[derive(Debug, PartialEq, Eq)]
struct Summary {
    count: u64,
    peers: usize,
    top: Option<(IpAddr, u64)>,
    over: Duration,
}

impl PeerLog {
    /// A limiter allowing one WARN per address and `period`.
    pub(crate) fn new(period: Duration) -> PeerLog {
        PeerLog {
            period_ms: AtomicU64::new(period.as_millis() as u64),
            inner: Mutex::new(Inner::default()),
        }
    }

    /// Sets the period (for warnings from now on).
    pub(crate) fn set_period(&self, period: Duration) {
        self.period_ms
            .store(period.as_millis() as u64, Ordering::Relaxed);
    }

    fn period(&self) -> Duration {
        Duration::from_millis(self.period_ms.load(Ordering::Relaxed))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Logs `msg` about `peer` at WARN if allowed now, else at DEBUG.
    pub(crate) fn warn(&self, peer: IpAddr, msg: Arguments<'_>) {
        let now = Instant::now();
        if self.allow(peer, now) {
            log::warn!("{msg}");
        } else {
            log::debug!("{msg}");
        }
        self.summarize(now);
    }

    /// Logs the count of suppressed warnings if a period has passed since the first of them.
    pub(crate) fn summarize(&self, now: Instant) {
        if let Some(s) = self.take_summary(now) {
            let top = match s.top {
                Some((ip, n)) => format!(" (most from {ip}: {n})"),
                None => String::new(),
            };
            log::warn!(
                "{} warning(s) about {} peer address(es) suppressed in the last {} s{top}",
                s.count,
                s.peers,
                s.over.as_secs()
            );
        }
    }

    /// When [`summarize`](Self::summarize) has a line to log, if warnings were suppressed.
    pub(crate) fn next_summary(&self) -> Option<Instant> {
        self.lock().since.map(|t| t + self.period())
    }

    /// Warnings sent to DEBUG instead of WARN so far.
    #[cfg(test)]
    pub(crate) fn suppressed(&self) -> u64 {
        self.lock().total
    }

    fn take_summary(&self, now: Instant) -> Option<Summary> {
        let mut g = self.lock();
        let since = g.since?;
        let over = now.saturating_duration_since(since);
        if over < self.period() {
            return None;
        }
        let top = g
            .suppressed
            .iter()
            .max_by_key(|(_, &n)| n)
            .map(|(&ip, &n)| (ip, n));
        let count = g.suppressed.values().sum::<u64>() + g.suppressed_other;
        let peers = g.suppressed.len() + usize::from(g.suppressed_other > 0);
        g.suppressed.clear();
        g.suppressed_other = 0;
        g.since = None;
        Some(Summary {
            count,
            peers,
            top,
            over,
        })
    }

    /// Whether a warning about `peer` at `now` may go to WARN (and remembers it if so).
    fn allow(&self, peer: IpAddr, now: Instant) -> bool {
        let mut g = self.lock();
        let period = self.period();
        let recent = |t: &Instant| now.saturating_duration_since(*t) < period;
        let ok = match g.last.get(&peer) {
            Some(t) => !recent(t),
            None => {
                if g.last.len() >= MAX_PEERS {
                    g.last.retain(|_, t| recent(t));
                }
                g.last.len() < MAX_PEERS
            }
        };
        if ok {
            g.last.insert(peer, now);
        } else {
            g.total += 1;
            g.since.get_or_insert(now);
            if let Some(n) = g.suppressed.get_mut(&peer) {
                *n += 1;
            } else if g.suppressed.len() < MAX_PEERS {
                g.suppressed.insert(peer, 1);
            } else {
                g.suppressed_other += 1;
            }
        }
        ok
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const WARN_EVERY: Duration = Duration::from_secs(60);

    #[test]
    fn one_warning_per_address_and_period() {
        let l = PeerLog::new(WARN_EVERY);
        let a: IpAddr = "192.0.2.1".parse().unwrap();
        let b: IpAddr = "192.0.2.2".parse().unwrap();
        let t0 = Instant::now();
        assert!(l.allow(a, t0));
        assert!(!l.allow(a, t0 + Duration::from_secs(1)));
        assert!(!l.allow(a, t0 + WARN_EVERY - Duration::from_millis(1)));
        assert!(l.allow(b, t0 + Duration::from_secs(1)), "another address");
        assert!(l.allow(a, t0 + WARN_EVERY), "a new period");
        assert_eq!(l.suppressed(), 2);
    }

    #[test]
    fn the_map_stays_bounded() {
        let l = PeerLog::new(WARN_EVERY);
        let t0 = Instant::now();
        for i in 0..MAX_PEERS as u32 {
            assert!(l.allow(IpAddr::from(i.to_be_bytes()), t0));
        }
        let new: IpAddr = "198.51.100.1".parse().unwrap();
        assert!(
            !l.allow(new, t0 + Duration::from_secs(1)),
            "full of recent peers"
        );
        assert!(l.allow(new, t0 + WARN_EVERY), "old entries are forgotten");
        assert!(l.lock().last.len() <= MAX_PEERS);
    }

    #[test]
    fn a_summary_counts_what_was_suppressed_once_a_period() {
        let l = PeerLog::new(WARN_EVERY);
        let a: IpAddr = "192.0.2.1".parse().unwrap();
        let b: IpAddr = "192.0.2.2".parse().unwrap();
        let t0 = Instant::now();
        assert_eq!(l.next_summary(), None);
        assert!(l.allow(a, t0));
        assert!(l.allow(b, t0));
        assert_eq!(
            l.take_summary(t0 + WARN_EVERY * 2),
            None,
            "nothing suppressed"
        );
        let t1 = t0 + Duration::from_secs(1);
        for _ in 0..5 {
            assert!(!l.allow(a, t1));
        }
        assert!(!l.allow(b, t1 + Duration::from_secs(1)));
        assert_eq!(l.next_summary(), Some(t1 + WARN_EVERY));
        assert_eq!(
            l.take_summary(t1 + WARN_EVERY - Duration::from_millis(1)),
            None
        );
        assert_eq!(
            l.take_summary(t1 + WARN_EVERY),
            Some(Summary {
                count: 6,
                peers: 2,
                top: Some((a, 5)),
                over: WARN_EVERY
            })
        );
        assert_eq!(l.take_summary(t1 + WARN_EVERY * 3), None, "counted once");
        assert_eq!(l.next_summary(), None);
        assert_eq!(l.suppressed(), 6);
    }
}
