//! Rate-limited warnings about unauthenticated peers: a peer that sends bad MPA Requests or
//! Connects that are refused must not be able to fill the log. The first warning about an
//! address is logged at WARN; more about the same address within [`WARN_EVERY`] go to DEBUG and
//! are counted.

use std::collections::HashMap;
use std::fmt::Arguments;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// At most one WARN per peer address in this period.
pub(crate) const WARN_EVERY: Duration = Duration::from_secs(60);

/// Addresses remembered at most; when full, entries older than [`WARN_EVERY`] are forgotten,
/// and if none is, warnings about new addresses go to DEBUG too (a flood from many addresses
/// gets one WARN per address and period at most, and the map stays bounded).
const MAX_PEERS: usize = 4096;

/// The per-address limiter, shared by the accept threads and the poll loops.
#[derive(Debug, Default)]
pub(crate) struct PeerLog {
    last: Mutex<HashMap<IpAddr, Instant>>,
    suppressed: AtomicU64,
}

impl PeerLog {
    /// Logs `msg` about `peer` at WARN if allowed now, else at DEBUG.
    pub(crate) fn warn(&self, peer: IpAddr, msg: Arguments<'_>) {
        if self.allow(peer, Instant::now()) {
            log::warn!("{msg}");
        } else {
            log::debug!("{msg}");
        }
    }

    /// Warnings sent to DEBUG instead of WARN so far.
    #[cfg(test)]
    pub(crate) fn suppressed(&self) -> u64 {
        self.suppressed.load(Ordering::Relaxed)
    }

    /// Whether a warning about `peer` at `now` may go to WARN (and remembers it if so).
    fn allow(&self, peer: IpAddr, now: Instant) -> bool {
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        let recent = |t: &Instant| now.saturating_duration_since(*t) < WARN_EVERY;
        let ok = match last.get(&peer) {
            Some(t) => !recent(t),
            None => {
                if last.len() >= MAX_PEERS {
                    last.retain(|_, t| recent(t));
                }
                last.len() < MAX_PEERS
            }
        };
        if ok {
            last.insert(peer, now);
        } else {
            self.suppressed.fetch_add(1, Ordering::Relaxed);
        }
        ok
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_warning_per_address_and_period() {
        let l = PeerLog::default();
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
        let l = PeerLog::default();
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
        assert!(l.last.lock().unwrap().len() <= MAX_PEERS);
    }
}
