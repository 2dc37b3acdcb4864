//! Log lines that clients can cause, rate-limited: a client that connects and fails (or
//! connects and leaves) in a loop must not be able to fill the log, from one source or from
//! many.
//!
//! Each [`RateLog`] lets through, per period (`--log-period`, a minute by default), at most
//! `per_source` lines about one [`Source`] and `global` lines in all; the rest go to DEBUG and
//! are counted. Once a period after the first line it held back, it logs one line saying how
//! many it held back, about how many sources, and which source had the most
//! ([`RateLog::tick`], called by the accept loop on its timer and by every line), at the level
//! of the most severe line it held back: held-back INFO lines of healthy clients coming and
//! going (a benchmark's jobs) say so at INFO, not as a warning an operator is paged for. The export
//! keeps two: one for problems (failed handshakes, evictions, refusals, failed requests, a
//! newcomer sharing a queue the target had no room for) and
//! one for the INFO lines of clients coming and going, so that a busy but healthy source
//! cannot use up the budget that would report its failures.
//!
//! Strings a client sent (an export name) go into a line only through [`escape`]. The escaping
//! and the tally of held-back lines are [`rpma_common::logline`]'s, as the target's.

use std::collections::HashMap;
use std::fmt::{self, Arguments};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use log::Level;
use rpma_common::logline::{self, HeldBack, Summary};

use super::slots::Source;

/// Characters of a client's string shown at most.
const MAX_SHOWN: usize = 128;

/// One kind of client-caused line, rate-limited per source and in all.
#[derive(Debug)]
pub(crate) struct RateLog {
    /// What the summary calls the lines ("warning(s)", "session line(s)").
    what: &'static str,
    per_source: u32,
    global: u32,
    period: Duration,
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    /// Start of the current period of the budgets.
    window: Option<Instant>,
    /// Lines let through in this period, per source (only sources that got one: at most
    /// `global` entries)...
    used: HashMap<Source, u32>,
    /// ...and in all.
    used_all: u32,
    /// Held back since the last summary.
    held: HeldBack<Source>,
}

impl RateLog {
    /// At most `per_source` lines about one source and `global` in all per `period`.
    pub(crate) fn new(what: &'static str, per_source: u32, global: u32, period: Duration) -> Self {
        RateLog {
            what,
            per_source,
            global,
            period: period.max(Duration::from_millis(1)),
            inner: Mutex::new(Inner::default()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Logs `msg` about `source` at `level` if the budgets allow, else at DEBUG (counted).
    pub(crate) fn log(&self, level: Level, source: Source, msg: Arguments<'_>) {
        let now = Instant::now();
        if self.allow(source, now, level) {
            log::log!(level, "{msg}");
        } else {
            log::debug!("{msg}");
        }
        self.tick_at(now);
    }

    /// Logs the count of held-back lines if a period has passed since the first of them.
    pub(crate) fn tick(&self) {
        self.tick_at(Instant::now());
    }

    fn tick_at(&self, now: Instant) {
        if let Some(s) = self.take_summary(now) {
            let top = match s.top {
                Some((src, n)) => format!(" (most about {src}: {n})"),
                None => String::new(),
            };
            log::log!(
                s.level,
                "nbd: {} {} about {} client source(s) suppressed in the last {} s{top}",
                s.count,
                self.what,
                s.sources,
                s.over.as_secs()
            );
        }
    }

    /// Lines held back so far.
    #[cfg(test)]
    fn suppressed(&self) -> u64 {
        self.lock().held.total()
    }

    /// Whether a line at `level` about `source` at `now` may go out (and counts it either
    /// way).
    fn allow(&self, source: Source, now: Instant, level: Level) -> bool {
        let mut g = self.lock();
        match g.window {
            Some(w) if now.saturating_duration_since(w) < self.period => {}
            _ => {
                g.window = Some(now);
                g.used.clear();
                g.used_all = 0;
            }
        }
        let mine = g.used.get(&source).copied().unwrap_or(0);
        if mine < self.per_source && g.used_all < self.global {
            g.used.insert(source, mine + 1);
            g.used_all += 1;
            return true;
        }
        g.held.note(source, level, now);
        false
    }

    fn take_summary(&self, now: Instant) -> Option<Summary<Source>> {
        self.lock().held.take(now, self.period)
    }
}

/// A client's string as it may appear in a log line: quoted, escaped, cut after 128
/// characters ([`logline::quote`]).
pub(crate) fn escape(s: &str) -> String {
    logline::quote(s, MAX_SHOWN)
}

/// `escape` as a `Display` (for format arguments).
pub(crate) struct Escaped<'a>(pub(crate) &'a str);

impl fmt::Display for Escaped<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&escape(self.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::IpAddr;

    const PERIOD: Duration = Duration::from_secs(60);

    fn src(n: u8) -> Source {
        Source::Addr(IpAddr::from([192, 0, 2, n]))
    }

    #[test]
    fn a_source_gets_its_budget_per_period_and_all_share_a_cap() {
        let l = RateLog::new("warning(s)", 2, 3, PERIOD);
        let t0 = Instant::now();
        assert!(l.allow(src(1), t0, Level::Warn));
        assert!(l.allow(src(1), t0, Level::Warn));
        assert!(!l.allow(src(1), t0, Level::Warn), "its budget is spent");
        assert!(l.allow(src(2), t0, Level::Warn), "another source");
        assert!(!l.allow(src(3), t0, Level::Warn), "the global cap is spent");
        let t1 = t0 + PERIOD;
        assert!(l.allow(src(1), t1, Level::Warn), "a new period");
        assert!(l.allow(src(3), t1, Level::Warn));
        assert_eq!(l.suppressed(), 2);
    }

    #[test]
    fn a_summary_counts_what_was_held_back_once_a_period() {
        let l = RateLog::new("warning(s)", 1, 100, PERIOD);
        let t0 = Instant::now();
        assert!(l.allow(src(1), t0, Level::Warn));
        assert_eq!(l.take_summary(t0 + PERIOD * 2), None, "nothing held back");
        for _ in 0..5 {
            assert!(!l.allow(src(1), t0, Level::Warn));
        }
        assert!(l.allow(src(2), t0, Level::Warn));
        assert!(!l.allow(src(2), t0 + Duration::from_secs(1), Level::Warn));
        assert_eq!(l.take_summary(t0 + PERIOD - Duration::from_millis(1)), None);
        assert_eq!(
            l.take_summary(t0 + PERIOD),
            Some(Summary {
                level: Level::Warn,
                count: 6,
                sources: 2,
                top: Some((src(1), 5)),
                over: PERIOD
            })
        );
        assert_eq!(l.take_summary(t0 + PERIOD * 3), None, "counted once");
    }

    #[test]
    fn a_summary_has_the_level_of_the_most_severe_line_it_held_back() {
        let l = RateLog::new("session line(s)", 1, 100, PERIOD);
        let t0 = Instant::now();
        assert!(l.allow(src(1), t0, Level::Info));
        assert!(!l.allow(src(1), t0, Level::Info));
        assert!(!l.allow(src(1), t0, Level::Info));
        let s = l.take_summary(t0 + PERIOD).unwrap();
        assert_eq!(
            (s.level, s.count),
            (Level::Info, 2),
            "clients coming and going"
        );
        assert!(l.allow(src(1), t0 + PERIOD, Level::Info), "a new period");
        assert!(!l.allow(src(1), t0 + PERIOD, Level::Info));
        assert!(!l.allow(src(1), t0 + PERIOD, Level::Warn));
        assert!(!l.allow(src(1), t0 + PERIOD, Level::Info));
        let s = l.take_summary(t0 + PERIOD * 2).unwrap();
        assert_eq!((s.level, s.count), (Level::Warn, 3), "a warning among them");
    }

    #[test]
    fn the_maps_stay_bounded_under_many_sources() {
        let l = RateLog::new("warning(s)", 1, 10, PERIOD);
        let t0 = Instant::now();
        let max = HeldBack::<Source>::MAX_SOURCES;
        for i in 0..(max as u32 + 100) {
            l.allow(Source::Uid(i), t0, Level::Warn);
        }
        {
            let g = l.lock();
            assert_eq!(g.used.len(), 10);
            assert_eq!(g.held.sources(), max);
        }
        let s = l.take_summary(t0 + PERIOD).unwrap();
        assert_eq!((s.count, s.sources), (max as u64 + 90, max + 1));
    }

    #[test]
    fn escaped_strings_cannot_break_a_line_or_hide_text() {
        assert_eq!(escape("disk1"), "\"disk1\"");
        assert_eq!(
            escape("a\nWARN forged\r\u{1b}[2J"),
            "\"a\\nWARN forged\\r\\u{1b}[2J\""
        );
        assert_eq!(escape("x\u{2028}y\u{202e}z"), "\"x\\u{2028}y\\u{202e}z\"");
        assert_eq!(escape("q\"b\\"), "\"q\\\"b\\\\\"");
        let long = "é".repeat(300);
        let e = escape(&long);
        assert!(e.ends_with("\"... (600 bytes in all)"), "{e}");
        assert_eq!(e.chars().filter(|&c| c == 'é').count(), MAX_SHOWN);
        assert!(!escape(&"\n".repeat(5000)).contains('\n'));
    }
}
