//! A one-line progress bar on stderr for large transfers, drawn only when stdout is a terminal
//! (scripts and pipes get clean output).

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

/// Transfers above this size get a bar.
pub(crate) const BAR_THRESHOLD: u64 = 4 << 20;

#[derive(Debug)]
pub(crate) struct Progress {
    what: &'static str,
    total: u64,
    done: u64,
    start: Instant,
    last: Option<Instant>,
    enabled: bool,
}

impl Progress {
    pub(crate) fn new(what: &'static str, total: u64, json: bool) -> Progress {
        Progress {
            what,
            total,
            done: 0,
            start: Instant::now(),
            last: None,
            enabled: !json && total > BAR_THRESHOLD && std::io::stdout().is_terminal(),
        }
    }

    pub(crate) fn add(&mut self, n: u64) {
        self.done += n;
        if !self.enabled {
            return;
        }
        let now = Instant::now();
        if self
            .last
            .is_some_and(|l| now.duration_since(l) < Duration::from_millis(100))
            && self.done < self.total
        {
            return;
        }
        self.last = Some(now);
        eprint!(
            "\r{}",
            line(self.what, self.done, self.total, self.start.elapsed())
        );
        let _ = std::io::stderr().flush();
    }

    pub(crate) fn finish(&mut self) {
        if self.take_open_line() {
            let _ = writeln!(std::io::stderr());
        }
    }

    /// Whether a bar was drawn and its line not ended yet; ended from now on.
    fn take_open_line(&mut self) -> bool {
        let open = self.enabled && self.last.is_some();
        self.last = None;
        open
    }
}

impl Drop for Progress {
    /// A transfer that failed part-way ends the bar's line, so that the error message the
    /// command prints next starts on a line of its own.
    fn drop(&mut self) {
        // (Never a panic here: a broken stderr while unwinding would abort.)
        if self.take_open_line() {
            let _ = writeln!(std::io::stderr());
        }
    }
}

/// `write [##########----------]  32.0/64.0 MiB  512.3 MiB/s`
pub(crate) fn line(what: &str, done: u64, total: u64, elapsed: Duration) -> String {
    const WIDTH: u64 = 30;
    let filled = (done.min(total) * WIDTH)
        .checked_div(total)
        .unwrap_or(WIDTH) as usize;
    let mib = |b: u64| b as f64 / f64::from(1 << 20);
    let rate = mib(done) / elapsed.as_secs_f64().max(1e-9);
    format!(
        "{what} [{}{}] {:>7.1}/{:.1} MiB {:>8.1} MiB/s",
        "#".repeat(filled),
        "-".repeat(WIDTH as usize - filled),
        mib(done),
        mib(total),
        rate
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bar_fills_in_proportion_and_never_overflows() {
        let l = line("write", 32 << 20, 64 << 20, Duration::from_secs(1));
        assert!(
            l.starts_with("write [###############---------------]"),
            "{l}"
        );
        assert!(l.contains("32.0/64.0 MiB"), "{l}");
        assert!(l.contains("32.0 MiB/s"), "{l}");
        let l = line("read", 10, 5, Duration::ZERO);
        assert!(l.contains(&"#".repeat(30)), "{l}");
        let l = line("read", 0, 0, Duration::ZERO);
        assert!(l.contains(&"#".repeat(30)), "{l}");
        // The line a drawn bar is on is ended once: by finish, else when dropped (a failure).
        let mut p = Progress::new("x", 1 << 30, false);
        p.enabled = true;
        assert!(!p.take_open_line(), "nothing drawn yet");
        p.last = Some(Instant::now());
        assert!(p.take_open_line());
        assert!(!p.take_open_line(), "ended once");
        // Small or scripted transfers get none.
        assert!(!Progress::new("x", 1 << 20, false).enabled);
        assert!(!Progress::new("x", 1 << 30, true).enabled);
    }
}
