//! Log lines a peer can cause, for the two places that log them: the target's lines about its
//! peers and the NBD export's about its clients. Two things are the same in both:
//!
//! - **What a peer sent never shapes a line.** [`escape`] writes every character that could end
//!   the line, move a terminal's cursor or reorder or hide text ([`hidden`]: control
//!   characters, line and paragraph separators, bidirectional overrides and isolates,
//!   zero-width and other format characters) as an escape (`\n`, `\u{202e}`); [`quote`] also
//!   quotes a peer's string, escapes the quote and backslash in it, and cuts it.
//! - **What a rate limit held back is counted and said once a period.** The budgets differ
//!   (per address and class on the target, per source on the export), so each place keeps its
//!   own; [`HeldBack`] is the tally behind both: how many lines, about how many sources (at most
//!   [`HeldBack::MAX_SOURCES`] counted one by one, so that a flood from many sources costs
//!   bounded memory), which had the most, since when, and the most severe level among them, the
//!   summary's level: a held-back INFO line about a host coming and going is no warning.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::hash::Hash;
use std::time::{Duration, Instant};

use log::Level;

/// Characters a log line must not carry raw: they end the line, drive a terminal, or reorder,
/// join or hide the text around them. Controls, the line and paragraph separators and
/// interlinear annotations, and every default-ignorable code point of Unicode (its
/// DerivedCoreProperties: the bidirectional marks, embeddings, overrides and isolates,
/// zero-width characters, joiners, variation selectors, fillers, tag characters...).
pub fn hidden(c: char) -> bool {
    c.is_control()
        || matches!(c,
            '\u{ad}'                         // soft hyphen
            | '\u{34f}'                      // combining grapheme joiner
            | '\u{61c}'                      // Arabic letter mark (a bidi mark)
            | '\u{115f}'..='\u{1160}'        // Hangul fillers
            | '\u{17b4}'..='\u{17b5}'        // Khmer inherent vowels
            | '\u{180b}'..='\u{180f}'        // Mongolian selectors, vowel separator
            | '\u{200b}'..='\u{200f}'        // zero-width, joiners, LRM/RLM
            | '\u{2028}'..='\u{202e}'        // line/paragraph separators, bidi embeddings/overrides
            | '\u{2060}'..='\u{206f}'        // word joiner, bidi isolates, invisible operators
            | '\u{3164}'                     // Hangul filler
            | '\u{fe00}'..='\u{fe0f}'        // variation selectors
            | '\u{feff}'                     // byte order mark
            | '\u{ffa0}'                     // halfwidth Hangul filler
            | '\u{fff0}'..='\u{fffb}'        // unassigned specials, interlinear annotations
            | '\u{1bca0}'..='\u{1bca3}'      // shorthand format controls
            | '\u{1d173}'..='\u{1d17a}'      // musical format controls
            | '\u{e0000}'..='\u{e0fff}') // tags, variation selectors supplement
}

/// `c` written as an escape (as Rust writes it in a string: `\n`, `\t`, `\u{1b}`, `\u{202e}`).
fn push_escaped(out: &mut String, c: char) {
    match c {
        '\n' => out.push_str("\\n"),
        '\r' => out.push_str("\\r"),
        '\t' => out.push_str("\\t"),
        c => {
            let _ = write!(out, "\\u{{{:x}}}", c as u32);
        }
    }
}

/// `s` with every [`hidden`] character escaped, so that it stays one line of visible text in
/// its own order. Escaping twice changes nothing more. For a whole line that may carry what a
/// peer sent; a peer's string on its own goes through [`quote`].
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if hidden(c) {
            push_escaped(&mut out, c);
        } else {
            out.push(c);
        }
    }
    out
}

/// A peer's string as it may appear in a log line: quoted, its quote and backslash characters
/// escaped (it cannot end its quotes and go on as text of ours) and every [`hidden`] one; cut
/// after `max_chars` characters, with its length in bytes said.
pub fn quote(s: &str, max_chars: usize) -> String {
    let mut out = String::with_capacity(s.len().min(max_chars) + 2);
    out.push('"');
    for (i, c) in s.chars().enumerate() {
        if i == max_chars {
            let _ = write!(out, "\"... ({} bytes in all)", s.len());
            return out;
        }
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if hidden(c) => push_escaped(&mut out, c),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// The lines a rate limit held back since its last summary, by source (an address, a client):
/// see the [module](self).
#[derive(Debug)]
pub struct HeldBack<K> {
    /// Per source, at most [`MAX_SOURCES`](Self::MAX_SOURCES) of them...
    by_source: HashMap<K, u64>,
    /// ...and about sources past that, together.
    other: u64,
    /// When the first of them was held back.
    since: Option<Instant>,
    /// The most severe level among them.
    worst: Option<Level>,
    /// Held back in all, ever (summaries do not reset it).
    total: u64,
}

/// What a summary line says: from [`HeldBack::take`].
#[derive(Debug, PartialEq, Eq)]
pub struct Summary<K> {
    /// The most severe level among the lines it counts: the summary's own.
    pub level: Level,
    /// Lines held back.
    pub count: u64,
    /// Sources they were about (those past [`HeldBack::MAX_SOURCES`] count as one).
    pub sources: usize,
    /// The source with the most, and how many.
    pub top: Option<(K, u64)>,
    /// Since the first of them.
    pub over: Duration,
}

impl<K> Default for HeldBack<K> {
    fn default() -> Self {
        HeldBack {
            by_source: HashMap::new(),
            other: 0,
            since: None,
            worst: None,
            total: 0,
        }
    }
}

impl<K: Hash + Eq + Copy> HeldBack<K> {
    /// Sources counted one by one; past that they are counted together.
    pub const MAX_SOURCES: usize = 4096;

    /// Counts a line at `level` about `source`, held back at `now`.
    pub fn note(&mut self, source: K, level: Level, now: Instant) {
        self.total += 1;
        self.since.get_or_insert(now);
        // log::Level orders the most severe first.
        self.worst = Some(self.worst.map_or(level, |w| w.min(level)));
        if let Some(n) = self.by_source.get_mut(&source) {
            *n += 1;
        } else if self.by_source.len() < Self::MAX_SOURCES {
            self.by_source.insert(source, 1);
        } else {
            self.other += 1;
        }
    }

    /// When the first line since the last summary was held back (None: none was).
    pub fn since(&self) -> Option<Instant> {
        self.since
    }

    /// Lines held back in all, ever.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// Sources counted one by one now.
    pub fn sources(&self) -> usize {
        self.by_source.len()
    }

    /// The summary, once `period` has passed since the first line it counts; the tally then
    /// starts again (but for [`total`](Self::total)).
    pub fn take(&mut self, now: Instant, period: Duration) -> Option<Summary<K>> {
        let since = self.since?;
        let over = now.saturating_duration_since(since);
        if over < period {
            return None;
        }
        let top = self
            .by_source
            .iter()
            .max_by_key(|(_, &n)| n)
            .map(|(&k, &n)| (k, n));
        let count = self.by_source.values().sum::<u64>() + self.other;
        let sources = self.by_source.len() + usize::from(self.other > 0);
        self.by_source.clear();
        self.other = 0;
        self.since = None;
        Some(Summary {
            level: self.worst.take().unwrap_or(Level::Warn),
            count,
            sources,
            top,
            over,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PERIOD: Duration = Duration::from_secs(60);

    #[test]
    fn escaped_text_stays_one_visible_line() {
        assert_eq!(
            escape("a\nERROR forged\r\x1b[31m\t"),
            "a\\nERROR forged\\r\\u{1b}[31m\\t"
        );
        assert_eq!(escape(&escape("a\nb")), escape("a\nb"), "idempotent");
        assert_eq!(escape("plain text, ünïcode"), "plain text, ünïcode");
        assert_eq!(
            escape("x\u{2028}y\u{202e}z\u{2066}\u{200b}\u{feff}"),
            "x\\u{2028}y\\u{202e}z\\u{2066}\\u{200b}\\u{feff}"
        );
        // The rest of Unicode's default-ignorable code points: an Arabic letter mark, a tag
        // character, a variation selector, a Hangul filler.
        for c in ['\u{61c}', '\u{e0041}', '\u{fe0f}', '\u{3164}', '\u{1d173}'] {
            assert!(hidden(c), "{c:?}");
            assert_eq!(escape(&c.to_string()), format!("\\u{{{:x}}}", c as u32));
        }
        for c in ['a', 'é', 'ß', 'д', '中', '🙂', ':', '.'] {
            assert!(!hidden(c), "{c:?}");
        }
    }

    #[test]
    fn a_quoted_string_cannot_end_its_quotes_break_a_line_or_hide_text() {
        assert_eq!(quote("disk1", 128), "\"disk1\"");
        assert_eq!(
            quote("a\nWARN forged\r\u{1b}[2J", 128),
            "\"a\\nWARN forged\\r\\u{1b}[2J\""
        );
        assert_eq!(
            quote("x\u{2028}y\u{202e}z", 128),
            "\"x\\u{2028}y\\u{202e}z\""
        );
        assert_eq!(quote("q\" ok \"b\\", 128), "\"q\\\" ok \\\"b\\\\\"");
        let long = "é".repeat(300);
        let q = quote(&long, 128);
        assert!(q.ends_with("\"... (600 bytes in all)"), "{q}");
        assert_eq!(q.chars().filter(|&c| c == 'é').count(), 128);
        assert!(!quote(&"\n".repeat(5000), 200).contains('\n'));
    }

    #[test]
    fn a_summary_counts_what_was_held_back_once_a_period() {
        let mut h = HeldBack::default();
        let t0 = Instant::now();
        assert_eq!(h.take(t0 + PERIOD * 2, PERIOD), None, "nothing held back");
        for _ in 0..5 {
            h.note(1u32, Level::Warn, t0);
        }
        h.note(2, Level::Warn, t0 + Duration::from_secs(1));
        assert_eq!(h.since(), Some(t0));
        assert_eq!(h.take(t0 + PERIOD - Duration::from_millis(1), PERIOD), None);
        assert_eq!(
            h.take(t0 + PERIOD, PERIOD),
            Some(Summary {
                level: Level::Warn,
                count: 6,
                sources: 2,
                top: Some((1, 5)),
                over: PERIOD
            })
        );
        assert_eq!(h.take(t0 + PERIOD * 3, PERIOD), None, "counted once");
        assert_eq!(h.since(), None);
        assert_eq!(h.total(), 6);
    }

    #[test]
    fn a_summary_has_the_level_of_the_most_severe_line_it_counts() {
        let mut h = HeldBack::default();
        let t0 = Instant::now();
        h.note(1u32, Level::Info, t0);
        h.note(1, Level::Info, t0);
        let s = h.take(t0 + PERIOD, PERIOD).unwrap();
        assert_eq!((s.level, s.count), (Level::Info, 2), "session lines only");
        h.note(1, Level::Info, t0 + PERIOD);
        h.note(1, Level::Warn, t0 + PERIOD);
        h.note(1, Level::Info, t0 + PERIOD);
        let s = h.take(t0 + PERIOD * 2, PERIOD).unwrap();
        assert_eq!((s.level, s.count), (Level::Warn, 3), "a warning among them");
    }

    #[test]
    fn many_sources_cost_bounded_memory_and_are_all_counted() {
        let mut h = HeldBack::default();
        let t0 = Instant::now();
        let n = HeldBack::<u32>::MAX_SOURCES as u32 + 100;
        for i in 0..n {
            h.note(i, Level::Warn, t0);
        }
        assert_eq!(h.sources(), HeldBack::<u32>::MAX_SOURCES);
        let s = h.take(t0 + PERIOD, PERIOD).unwrap();
        assert_eq!(s.count, u64::from(n));
        assert_eq!(
            s.sources,
            HeldBack::<u32>::MAX_SOURCES + 1,
            "the rest as one"
        );
        assert_eq!(h.sources(), 0, "cleared");
    }
}
