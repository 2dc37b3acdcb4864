//! Rate-limited log lines about peers: nothing a peer can make the target log may fill the log,
//! whether it is one peer cycling sessions as fast as it can or refusals from thousands of
//! addresses (issue 22, F6).
//!
//! Every line a peer can cause goes through [`PeerLog`], in one of two classes:
//! - [`Class::Warning`] (refusals, protocol errors, abandoned handshakes, bad MPA Requests,
//!   failed receives): one line per peer address and period;
//! - [`Class::Session`] (session start and end, keep-alive lapses, lost connections): up to
//!   [`SESSION_LINES`] per peer address and period, so that a host's own sessions are logged
//!   but an attacker cycling sessions is not.
//!
//! On top of both, at most [`GLOBAL_LINES`] such lines are logged per period from all peers
//! together, so that any number of addresses adds a bounded volume. A line over a budget goes to
//! DEBUG instead and is counted; once a period after the first of them, one line says how many
//! were suppressed, about how many addresses, and which address had the most
//! ([`PeerLog::summarize`], called by the accept threads on a timer and by every line), at the
//! level of the most severe line it counts: WARN once a warning is among them, INFO when only
//! session lines were (a host opening many queues is no warning).
//!
//! Peer-supplied text can never start a line of its own nor reorder or hide the text around it:
//! every message is escaped ([`logline::escape`]: control characters, line breaks included,
//! bidirectional overrides and other format characters are written as `\n`, `\u{1b}`,
//! `\u{202e}`...), and a peer's strings are quoted, their own quotes escaped, and cut to
//! [`PEER_TEXT`] characters ([`peer_text`]). The tally of suppressed lines is
//! [`logline::HeldBack`], as the NBD export's. The period is `refusal_log_period_ms` (a minute
//! by default).

use std::collections::HashMap;
use std::fmt::Arguments;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rpma_common::logline::{self, HeldBack, Summary};

/// Addresses remembered at most; when full, entries older than the period are forgotten,
/// and if none is, lines about new addresses are suppressed (the map stays bounded).
const MAX_PEERS: usize = 4096;

/// Session lines per peer address and period.
pub(crate) const SESSION_LINES: u32 = 20;

/// Lines per period from all peers together.
pub(crate) const GLOBAL_LINES: u32 = 256;

/// Characters of a peer-supplied string kept in a line (a Disconnect reason may be 8 KiB).
pub(crate) const PEER_TEXT: usize = 200;

/// What kind of line: each has its own budget per peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Class {
    /// About something refused or broken: one per peer and period.
    Warning,
    /// A session started or ended: [`SESSION_LINES`] per peer and period.
    Session,
}

/// The per-address limiter, shared by the accept threads and the poll loops.
#[derive(Debug)]
pub(crate) struct PeerLog {
    /// The period in ms (a reload may change it).
    period_ms: AtomicU64,
    inner: Mutex<Inner>,
}

/// One address's use of its budgets in its current period.
#[derive(Debug, Clone, Copy)]
struct Budget {
    since: Instant,
    warnings: u32,
    sessions: u32,
}

#[derive(Debug, Default)]
struct Inner {
    peers: HashMap<IpAddr, Budget>,
    /// The global budget's period and use.
    global_since: Option<Instant>,
    global_used: u32,
    /// Suppressed since the last summary.
    held: HeldBack<IpAddr>,
}

/// A peer-supplied string for a log line: quoted, escaped, at most [`PEER_TEXT`] characters
/// of it, with its full length when it was cut ([`logline::quote`]).
pub(crate) fn peer_text(s: &str) -> String {
    logline::quote(s, PEER_TEXT)
}

impl PeerLog {
    /// A limiter with budgets per `period`.
    pub(crate) fn new(period: Duration) -> PeerLog {
        PeerLog {
            period_ms: AtomicU64::new(period.as_millis() as u64),
            inner: Mutex::new(Inner::default()),
        }
    }

    /// Sets the period (for lines from now on).
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

    /// Logs `msg` (escaped) about `peer` at WARN, within the [`Class::Warning`] budget; at
    /// DEBUG past it.
    pub(crate) fn warn(&self, peer: IpAddr, msg: Arguments<'_>) {
        self.log(peer, Class::Warning, log::Level::Warn, msg);
    }

    /// Logs `msg` (escaped) about `peer` at `level` if `class`'s budgets allow it now, else at
    /// DEBUG (counted for the summary).
    pub(crate) fn log(&self, peer: IpAddr, class: Class, level: log::Level, msg: Arguments<'_>) {
        let now = Instant::now();
        let allowed = self.allow(peer, class, level, now);
        let level = if allowed { level } else { log::Level::Debug };
        if log::log_enabled!(target: module_path!(), level) {
            let text = logline::escape(&msg.to_string());
            log::log!(level, "{text}");
        }
        self.summarize(now);
    }

    /// Logs the count of suppressed lines if a period has passed since the first of them.
    pub(crate) fn summarize(&self, now: Instant) {
        if let Some(s) = self.take_summary(now) {
            let top = match s.top {
                Some((ip, n)) => format!(" (most from {ip}: {n})"),
                None => String::new(),
            };
            log::log!(
                s.level,
                "{} log line(s) about {} peer address(es) suppressed in the last {} s{top}",
                s.count,
                s.sources,
                s.over.as_secs()
            );
        }
    }

    /// When [`summarize`](Self::summarize) has a line to log, if lines were suppressed.
    pub(crate) fn next_summary(&self) -> Option<Instant> {
        self.lock().held.since().map(|t| t + self.period())
    }

    /// Lines sent to DEBUG instead of their level so far.
    #[cfg(test)]
    pub(crate) fn suppressed(&self) -> u64 {
        self.lock().held.total()
    }

    fn take_summary(&self, now: Instant) -> Option<Summary<IpAddr>> {
        let period = self.period();
        self.lock().held.take(now, period)
    }

    /// Whether a `class` line at `level` about `peer` at `now` may be logged at its level (and
    /// takes it from the budgets if so; counts it as suppressed if not).
    fn allow(&self, peer: IpAddr, class: Class, level: log::Level, now: Instant) -> bool {
        let period = self.period();
        let mut g = self.lock();
        let recent = |t: Instant| now.saturating_duration_since(t) < period;
        if !g.global_since.is_some_and(recent) {
            g.global_since = Some(now);
            g.global_used = 0;
        }
        if !g.peers.contains_key(&peer) && g.peers.len() >= MAX_PEERS {
            g.peers.retain(|_, b| recent(b.since));
        }
        let room = g.peers.len() < MAX_PEERS || g.peers.contains_key(&peer);
        let global_ok = g.global_used < GLOBAL_LINES;
        let ok = room && global_ok && {
            let b = g.peers.entry(peer).or_insert(Budget {
                since: now,
                warnings: 0,
                sessions: 0,
            });
            if !recent(b.since) {
                *b = Budget {
                    since: now,
                    warnings: 0,
                    sessions: 0,
                };
            }
            let (used, cap) = match class {
                Class::Warning => (&mut b.warnings, 1),
                Class::Session => (&mut b.sessions, SESSION_LINES),
            };
            if *used < cap {
                *used += 1;
                true
            } else {
                false
            }
        };
        if ok {
            g.global_used += 1;
        } else {
            g.held.note(peer, level, now);
        }
        ok
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EVERY: Duration = Duration::from_secs(60);

    fn ip(i: u32) -> IpAddr {
        IpAddr::from(i.to_be_bytes())
    }

    #[test]
    fn one_warning_per_address_and_period() {
        let l = PeerLog::new(EVERY);
        let a: IpAddr = "192.0.2.1".parse().unwrap();
        let b: IpAddr = "192.0.2.2".parse().unwrap();
        let t0 = Instant::now();
        assert!(l.allow(a, Class::Warning, log::Level::Warn, t0));
        assert!(!l.allow(
            a,
            Class::Warning,
            log::Level::Warn,
            t0 + Duration::from_secs(1)
        ));
        assert!(!l.allow(
            a,
            Class::Warning,
            log::Level::Warn,
            t0 + EVERY - Duration::from_millis(1)
        ));
        assert!(
            l.allow(
                b,
                Class::Warning,
                log::Level::Warn,
                t0 + Duration::from_secs(1)
            ),
            "another address"
        );
        assert!(
            l.allow(a, Class::Warning, log::Level::Warn, t0 + EVERY),
            "a new period"
        );
        assert_eq!(l.suppressed(), 2);
    }

    #[test]
    fn session_lines_have_a_budget_of_their_own() {
        let l = PeerLog::new(EVERY);
        let a: IpAddr = "192.0.2.1".parse().unwrap();
        let t0 = Instant::now();
        assert!(l.allow(a, Class::Warning, log::Level::Warn, t0));
        for i in 0..SESSION_LINES {
            assert!(
                l.allow(a, Class::Session, log::Level::Info, t0),
                "session line {i}"
            );
        }
        assert!(!l.allow(a, Class::Session, log::Level::Info, t0));
        assert!(
            l.allow(a, Class::Session, log::Level::Info, t0 + EVERY),
            "a new period"
        );
    }

    #[test]
    fn all_addresses_together_have_a_global_budget() {
        let l = PeerLog::new(EVERY);
        let t0 = Instant::now();
        let allowed = (0..1000)
            .filter(|&i| l.allow(ip(i), Class::Warning, log::Level::Warn, t0))
            .count();
        assert_eq!(allowed, GLOBAL_LINES as usize);
        assert!(
            l.allow(ip(5000), Class::Warning, log::Level::Warn, t0 + EVERY),
            "the next period"
        );
    }

    #[test]
    fn the_map_stays_bounded() {
        let l = PeerLog::new(EVERY);
        let t0 = Instant::now();
        for i in 0..(MAX_PEERS as u32 + 10) {
            l.allow(ip(i), Class::Session, log::Level::Info, t0);
        }
        assert!(l.lock().peers.len() <= MAX_PEERS);
        let new: IpAddr = "198.51.100.1".parse().unwrap();
        assert!(
            l.allow(new, Class::Warning, log::Level::Warn, t0 + EVERY),
            "old entries go"
        );
        assert!(l.lock().peers.len() <= MAX_PEERS);
    }

    #[test]
    fn a_summary_counts_what_was_suppressed_once_a_period() {
        let l = PeerLog::new(EVERY);
        let a: IpAddr = "192.0.2.1".parse().unwrap();
        let b: IpAddr = "192.0.2.2".parse().unwrap();
        let t0 = Instant::now();
        assert_eq!(l.next_summary(), None);
        assert!(l.allow(a, Class::Warning, log::Level::Warn, t0));
        assert!(l.allow(b, Class::Warning, log::Level::Warn, t0));
        assert_eq!(l.take_summary(t0 + EVERY * 2), None, "nothing suppressed");
        let t1 = t0 + Duration::from_secs(1);
        for _ in 0..5 {
            assert!(!l.allow(a, Class::Warning, log::Level::Warn, t1));
        }
        assert!(!l.allow(
            b,
            Class::Warning,
            log::Level::Warn,
            t1 + Duration::from_secs(1)
        ));
        assert_eq!(l.next_summary(), Some(t1 + EVERY));
        assert_eq!(l.take_summary(t1 + EVERY - Duration::from_millis(1)), None);
        assert_eq!(
            l.take_summary(t1 + EVERY),
            Some(Summary {
                level: log::Level::Warn,
                count: 6,
                sources: 2,
                top: Some((a, 5)),
                over: EVERY
            })
        );
        assert_eq!(l.take_summary(t1 + EVERY * 3), None, "counted once");
        assert_eq!(l.next_summary(), None);
        assert_eq!(l.suppressed(), 6);
    }

    #[test]
    fn a_summary_has_the_level_of_the_most_severe_line_it_counts() {
        let l = PeerLog::new(EVERY);
        let a: IpAddr = "192.0.2.1".parse().unwrap();
        let t0 = Instant::now();
        for _ in 0..SESSION_LINES + 3 {
            l.allow(a, Class::Session, log::Level::Info, t0);
        }
        let s = l.take_summary(t0 + EVERY).unwrap();
        assert_eq!(
            (s.level, s.count),
            (log::Level::Info, 3),
            "session lines only"
        );
        let t1 = t0 + EVERY * 2;
        assert!(l.allow(a, Class::Warning, log::Level::Warn, t1));
        assert!(!l.allow(a, Class::Warning, log::Level::Warn, t1));
        for _ in 0..SESSION_LINES + 1 {
            l.allow(a, Class::Session, log::Level::Info, t1);
        }
        let s = l.take_summary(t1 + EVERY).unwrap();
        assert_eq!(
            (s.level, s.count),
            (log::Level::Warn, 2),
            "a warning among them"
        );
    }

    #[test]
    fn peer_text_never_breaks_a_line_ends_its_quotes_or_reorders_text() {
        assert_eq!(peer_text("bye"), "\"bye\"");
        assert_eq!(
            peer_text("bye\" accepted \"x\u{202e}"),
            "\"bye\\\" accepted \\\"x\\u{202e}\""
        );
        let long = "x\n".repeat(500);
        let t = peer_text(&long);
        assert!(!t.contains('\n'), "{t}");
        assert!(t.ends_with("... (1000 bytes in all)"), "{t}");
        assert_eq!(t.matches('x').count(), PEER_TEXT / 2);
    }
}
