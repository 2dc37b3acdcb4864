//! Deadlines from durations a caller gives (time-outs, reconnect budgets, backoffs).

use std::time::{Duration, Instant};

/// The longest wait a deadline stands for: a hundred years, "for ever".
const FOREVER: Duration = Duration::from_secs(100 * 365 * 86_400);

/// `d` from now, or a hundred years from now when `d` is longer: a caller's "for ever" (a
/// reconnect budget of `Duration::MAX`) is one, where `Instant`'s addition panicked.
pub(crate) fn after(d: Duration) -> Instant {
    Instant::now() + d.min(FOREVER)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_deadline_for_ever_is_a_hundred_years_not_a_panic() {
        let now = Instant::now();
        let far = after(Duration::MAX);
        assert!(far > now + Duration::from_secs(99 * 365 * 86_400));
        let soon = after(Duration::from_millis(5));
        assert!(soon >= now && soon < now + Duration::from_secs(60));
    }
}
