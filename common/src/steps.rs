//! Step timing of a round trip: a measurement, not part of the data path's function.
//!
//! With the feature `step-timing` and `RPMA_STEP_TIMING=1` in a process's environment, each
//! thread that serves a round trip keeps, per named step, the time since the `recv` that brought
//! its peer's message ([`arrived`]) to that step ([`step`]), up to the `writev` of its answer or
//! next request ([`sending`], which ends the round trip). Every [`ROUND_TRIPS`] round trips it
//! prints, on standard error, the median of each step since the arrival, in order. Both
//! processes of a QD1 job, the target's poll loop and the initiator's caller, print theirs: what
//! each side does between receiving and sending (docs/benchmarks.md, "A durable write's round
//! trip, step by step", has the commands). Each timed step costs its thread a clock read and a
//! push (about 30 ns on the machines of docs/benchmarks.md), so the steps after it are that much
//! later.
//!
//! Without the feature (every build but a measurement's) the functions are empty and inline to
//! nothing; with it and without the variable, each costs a load of a cached flag.

/// Round trips per printed summary; also the most times one step is kept between two
/// summaries (a thread that receives without answering, a Write-only stream's target, ends no
/// round trip: its steps stop being kept there, not its memory growing).
pub const ROUND_TRIPS: usize = 200_000;

/// The `n`th FPDU of a receive pass taken (its CRC checked, a Write's payload placed), counted
/// from the arrival; the fourth and later share a name. A static: [`nth`] tells its lists apart
/// by address.
pub static FPDU_TAKEN: [&str; 4] = [
    "1st FPDU taken",
    "2nd FPDU taken",
    "3rd FPDU taken",
    "later FPDU taken",
];

/// The `n`th FPDU of a receive pass handled (reported, or its request answered).
pub static FPDU_HANDLED: [&str; 4] = [
    "1st FPDU handled",
    "2nd FPDU handled",
    "3rd FPDU handled",
    "later FPDU handled",
];

#[cfg(feature = "step-timing")]
mod imp {
    use std::cell::RefCell;
    use std::time::Instant;

    use super::{Recorder, ROUND_TRIPS};

    thread_local! {
        static REC: RefCell<Recorder> = RefCell::new(Recorder::default());
    }

    fn on() -> bool {
        static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *ON.get_or_init(|| std::env::var_os("RPMA_STEP_TIMING").is_some_and(|v| v == "1"))
    }

    pub(super) fn arrived() {
        if on() {
            REC.with(|r| r.borrow_mut().arrived(Instant::now()));
        }
    }

    pub(super) fn step(name: &'static str) {
        if on() {
            REC.with(|r| r.borrow_mut().step(name, Instant::now()));
        }
    }

    pub(super) fn nth(names: &'static [&'static str; 4]) {
        if on() {
            REC.with(|r| r.borrow_mut().nth(names, Instant::now()));
        }
    }

    pub(super) fn sending() {
        if on() {
            REC.with(|r| {
                let mut r = r.borrow_mut();
                if r.sending(Instant::now()) >= ROUND_TRIPS {
                    let who = std::thread::current()
                        .name()
                        .map_or_else(|| "a thread".to_owned(), str::to_owned);
                    eprintln!(
                        "step timing, {who} of pid {}, medians of {} round trips: {}",
                        std::process::id(),
                        ROUND_TRIPS,
                        r.summary()
                    );
                }
            });
        }
    }
}

/// The peer's bytes came (a `recv` returned some): a round trip's time starts here, unless
/// it started already.
#[inline(always)]
pub fn arrived() {
    #[cfg(feature = "step-timing")]
    imp::arrived();
}

/// The round trip reached step `name`.
#[inline(always)]
pub fn step(name: &'static str) {
    #[cfg(feature = "step-timing")]
    imp::step(name);
    #[cfg(not(feature = "step-timing"))]
    let _ = name;
}

/// The round trip reached the next of `names` ([`FPDU_TAKEN`], [`FPDU_HANDLED`]): the first
/// call since the arrival records the first name, and so on.
#[inline(always)]
pub fn nth(names: &'static [&'static str; 4]) {
    #[cfg(feature = "step-timing")]
    imp::nth(names);
    #[cfg(not(feature = "step-timing"))]
    let _ = names;
}

/// About to `writev` the answer or the next request: the round trip ends here (recorded as
/// "writev").
#[inline(always)]
pub fn sending() {
    #[cfg(feature = "step-timing")]
    imp::sending();
}

/// One thread's timings: per step, the nanoseconds since the arrival, for the round trips
/// since the last summary.
#[cfg(any(feature = "step-timing", test))]
#[derive(Debug, Default)]
struct Recorder {
    start: Option<std::time::Instant>,
    /// Calls of `nth` since the arrival, per list of names (by address).
    counts: Vec<(usize, usize)>,
    steps: Vec<(&'static str, Vec<u32>)>,
    round_trips: usize,
}

#[cfg(any(feature = "step-timing", test))]
impl Recorder {
    fn arrived(&mut self, now: std::time::Instant) {
        if self.start.is_none() {
            self.start = Some(now);
            self.counts.clear();
        }
    }

    fn step(&mut self, name: &'static str, now: std::time::Instant) {
        let Some(start) = self.start else { return };
        let ns = u32::try_from(now.duration_since(start).as_nanos()).unwrap_or(u32::MAX);
        match self.steps.iter_mut().find(|(n, _)| *n == name) {
            Some((_, v)) if v.len() < ROUND_TRIPS => v.push(ns),
            Some(_) => {}
            None => self.steps.push((name, vec![ns])),
        }
    }

    fn nth(&mut self, names: &'static [&'static str; 4], now: std::time::Instant) {
        if self.start.is_none() {
            return;
        }
        let key = names.as_ptr() as usize;
        let i = match self.counts.iter_mut().find(|(k, _)| *k == key) {
            Some((_, c)) => {
                *c += 1;
                *c - 1
            }
            None => {
                self.counts.push((key, 1));
                0
            }
        };
        self.step(names[i.min(3)], now);
    }

    /// Ends the round trip, if one started; returns how many ended since the last summary.
    fn sending(&mut self, now: std::time::Instant) -> usize {
        if self.start.is_some() {
            self.step("writev", now);
            self.start = None;
            self.round_trips += 1;
        }
        self.round_trips
    }

    /// "step p50 ns, ..." in the order of the medians, and a fresh start.
    fn summary(&mut self) -> String {
        let mut rows: Vec<(u32, &'static str, usize)> = self
            .steps
            .iter_mut()
            .filter(|(_, v)| !v.is_empty())
            .map(|(n, v)| {
                v.sort_unstable();
                (v[v.len() / 2], *n, v.len())
            })
            .collect();
        rows.sort();
        self.steps.clear();
        self.round_trips = 0;
        rows.iter()
            .map(|(p50, n, k)| format!("{n} {p50} ns ({k})"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    const US: Duration = Duration::from_micros(1);

    #[test]
    fn steps_are_timed_from_the_first_arrival_to_the_send_and_summed_up_by_median() {
        let mut r = Recorder::default();
        let t0 = Instant::now();
        // Before any arrival nothing is recorded, nor counted as a round trip.
        r.step("placed", t0);
        assert_eq!(r.sending(t0), 0);
        for (i, late) in [1u32, 3, 2].into_iter().enumerate() {
            let t = t0 + 100 * US * i as u32;
            r.arrived(t);
            // A second recv in the same round trip does not restart it.
            r.arrived(t + US);
            r.nth(&FPDU_TAKEN, t + US);
            r.nth(&FPDU_TAKEN, t + 2 * US);
            r.step("placed", t + late * US * 3);
            assert_eq!(r.sending(t + 10 * US), i + 1);
        }
        let s = r.summary();
        assert_eq!(
            s,
            "1st FPDU taken 1000 ns (3), 2nd FPDU taken 2000 ns (3), placed 6000 ns (3), \
             writev 10000 ns (3)"
        );
        // A fresh start: the next summary holds only what came after.
        assert_eq!(r.sending(t0), 0);
        assert_eq!(r.summary(), "");
    }

    #[test]
    fn a_thread_that_never_sends_keeps_at_most_a_summary_s_worth_of_each_step() {
        let mut r = Recorder::default();
        let t0 = Instant::now();
        r.arrived(t0);
        for _ in 0..ROUND_TRIPS + 10 {
            r.step("placed", t0 + US);
        }
        assert_eq!(r.steps[0].1.len(), ROUND_TRIPS);
        assert_eq!(r.sending(t0 + 2 * US), 1);
        assert!(r
            .summary()
            .starts_with(&format!("placed 1000 ns ({ROUND_TRIPS})")));
    }

    #[test]
    fn the_fourth_and_later_fpdus_share_a_name() {
        let mut r = Recorder::default();
        let t0 = Instant::now();
        r.arrived(t0);
        for k in 1..=6u32 {
            r.nth(&FPDU_HANDLED, t0 + k * US);
        }
        r.sending(t0 + 10 * US);
        let s = r.summary();
        assert!(s.contains("later FPDU handled 5000 ns (3)"), "{s}");
        assert!(s.contains("1st FPDU handled 1000 ns (1)"), "{s}");
    }
}
