//! The daemon's requests that change its state: a reload (SIGHUP, or a `reload` request that
//! asks for one and waits for its outcome) and `clear-failure`, as methods of its shared state.

use std::time::{Duration, Instant};

use super::{
    apply_metrics_listen, ready_line, Shared, State, TEST_HOLD_STATE_ENV,
    TEST_RELOAD_APPLY_WAIT_ENV,
};
use crate::config::Config;
use crate::metrics::listener::PageFn;
use crate::notify::Notifier;
use crate::reload::{self, ConfigDiff};

/// How long a `reload` request waits for the reload it asked for to be done (a reload that
/// maps big namespaces ahead of use takes a while): below the client's wait, and the unit's
/// `TimeoutStartSec=`, which bounds its ExecReload.
const RELOAD_REQUEST_WAIT: Duration = Duration::from_secs(270);

/// [`TEST_HOLD_STATE_ENV`]: sleeps that long (tests; nothing in production).
fn test_hold_state() {
    if let Some(ms) = std::env::var(TEST_HOLD_STATE_ENV)
        .ok()
        .and_then(|v| v.parse().ok())
    {
        std::thread::sleep(Duration::from_millis(ms));
    }
}

/// How long a reload that removes or replaces namespaces waits for every poll loop to apply it
/// before it says READY (a loop applies it at the top of its next pass: at once, unless a sync
/// of its own holds it; one held longer than the watchdog's period has the daemon restarted
/// anyway, and a stop waits for this). Past it the reload says how many had not, for as long as
/// they have not (`last_reload` in `status`), and `rpma-target reload` exits 1.
/// [`TEST_RELOAD_APPLY_WAIT_ENV`] sets another (tests).
fn reload_apply_wait() -> Duration {
    std::env::var(TEST_RELOAD_APPLY_WAIT_ENV)
        .ok()
        .and_then(|v| v.parse().ok())
        .map_or(Duration::from_secs(5), Duration::from_millis)
}

impl Shared {
    /// `clear-failure SUBSYSTEM NSID` from the control socket: the operator's explicit act that
    /// makes a failed namespace durable again. Logged with what may have been lost, which is also
    /// the answer.
    pub(super) fn clear_failure(&self, req: &str) -> std::result::Result<String, String> {
        let mut words = req.split_whitespace().skip(1);
        let (Some(sub), Some(nsid), None) = (words.next(), words.next(), words.next()) else {
            return Err("usage: clear-failure SUBSYSTEM NSID".into());
        };
        let sub = rpma_common::proto::nqn::Nqn::new(sub.to_owned())
            .map_err(|e| rpma_common::error_chain(&e))?;
        let nsid: u32 = nsid
            .parse()
            .map_err(|_| format!("{nsid:?} is not a namespace id"))?;
        let key = (sub, nsid);
        let mut st = self.lock();
        test_hold_state();
        let State {
            config,
            namespaces,
            serve,
            fdstore,
            ..
        } = &mut *st;
        let cleared = namespaces
            .clear_failure(&key, config)
            .map_err(|e| rpma_common::error_chain(&e))?;
        if let Some(id) = namespaces.get(&key.0, key.1).and_then(|ns| ns.file_id()) {
            fdstore.cleared(id);
        }
        let said = cleared.what_may_be_lost(&key);
        log::warn!("clear-failure (operator, through the control socket): {said}");
        let diff = ConfigDiff {
            namespaces_cleared: vec![key.clone()],
            ..ConfigDiff::default()
        };
        // (The same file reopened: nothing to wait for.)
        let _ = serve.reloaded(&diff, config, namespaces);
        Ok(serde_json::json!({
            "cleared": { "subsystem": key.0.to_string(), "nsid": key.1,
                         "path": cleared.path, "failure": cleared.failure.to_string(),
                         "since": cleared.remembered.as_ref().map(|r| r.since()) },
            "message": said,
        })
        .to_string())
    }

    /// A `reload` request (`rpma-target reload`, the unit's ExecReload): the reload SIGHUP asks
    /// for, answered once it is done (READY, every poll loop applied it), with its outcome, so
    /// that `systemctl reload` returns when the reload took effect and fails when it failed.
    pub(super) fn reload_request(&self) -> std::result::Result<String, String> {
        // The first reload to start from now on reads the configuration as the operator left it
        // before asking; one under way may have read it before the edit. Reloads run one after the
        // other, so once that many have finished, that one has.
        let wanted = self.lock().reload_started + 1;
        // The main thread takes it as any SIGHUP (one pending already serves this request too:
        // it starts after it).
        nix::sys::signal::kill(nix::unistd::Pid::this(), nix::sys::signal::Signal::SIGHUP)
            .map_err(|e| format!("cannot ask for the reload: {e}"))?;
        let deadline = Instant::now() + RELOAD_REQUEST_WAIT;
        loop {
            {
                let st = self.lock();
                if st.reload_attempts >= wanted {
                    let (said, lagging) = st.last_reload_said();
                    return Ok(serde_json::json!({
                        "reloaded": st.last_reload_ok,
                        "message": said.unwrap_or_default(),
                        "loops_not_applied": lagging,
                    })
                    .to_string());
                }
            }
            if self.stopping.load(std::sync::atomic::Ordering::SeqCst) {
                return Err("the daemon is stopping: no reload".into());
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "the reload did not finish within {} s (see the daemon's log)",
                    RELOAD_REQUEST_WAIT.as_secs()
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGHUP: reloads the configuration (RELOADING=1, diff, apply, wait for the loops, READY=1).
    pub(super) fn reload_now(&self, notifier: &Notifier, page: &PageFn) {
        let _ = notifier.reloading();
        self.lock().reload_started += 1;
        // What the serving threads still apply in their own time (a reload that removes or
        // replaces namespace files): waited for below, with no lock held, before READY.
        let mut pending = None;
        let outcome = Config::load(&self.config_path)
            .map_err(|e| rpma_common::error_chain(&e))
            .and_then(|new| {
                let mut st = self.lock();
                test_hold_state();
                if let Some(w) = crate::failures::capacity::capacity_warning(&new) {
                    log::warn!("reload: {w}");
                }
                let mut d = reload::diff(&st.config, &new);
                for ((sub, nsid), f) in st.namespaces.reopen_failed(&mut d) {
                    log::warn!(
                        "reload: reopening subsystem {sub} namespace {nsid}, failed by {f}: its \
                     sessions are closed and its page cache is dropped, so that hosts read what \
                     the media holds; it stays FAILED (no durability) until an operator runs \
                     `rpma-target clear-failure {sub} {nsid}`"
                    );
                }
                for (sub, nsid) in st.namespaces.reopen_replaced(&mut d) {
                    log::warn!(
                    "reload: subsystem {sub} namespace {nsid}: its path names another file now: \
                     mapping that one and closing the sessions of the old"
                );
                }
                st.namespaces
                    .apply(&d, &new)
                    .map_err(|e| rpma_common::error_chain(&e))?;
                // Settings that need a restart keep their running values.
                let mut new = new;
                new.listeners = st.config.listeners.clone();
                new.control_socket = st.config.control_socket.clone();
                new.poll_loops = st.config.poll_loops;
                new.state_file = st.config.state_file.clone();
                let State {
                    serve,
                    namespaces,
                    fdstore,
                    ..
                } = &mut *st;
                pending = serve.reloaded(&d, &new, namespaces);
                fdstore.keep(namespaces, notifier);
                // New connections of the tcp listeners offer the reloaded CRC setting.
                for l in st
                    .listeners
                    .iter_mut()
                    .filter(|l| l.url.starts_with("tcp://"))
                {
                    l.crc = new.crc;
                }
                st.config = new;
                Ok(d.summary())
            });
        // Outside the state lock: a scrape in progress needs it to finish, and closing the old
        // listener waits for its accept thread.
        if outcome.is_ok() {
            let (mut current, mut status, want) = {
                let mut st = self.lock();
                let want = st.config.metrics_listen;
                (st.metrics.take(), st.metrics_status.take(), want)
            };
            if let Err(e) = apply_metrics_listen(&mut current, &mut status, want, page) {
                log::error!("reload: {}", rpma_common::error_chain(&e));
            }
            let mut st = self.lock();
            st.metrics = current;
            st.metrics_status = status;
        }
        let mut lagging = None;
        if let Some(ack) = pending {
            let within = reload_apply_wait();
            let left = ack.wait(within);
            if left > 0 {
                lagging = Some(ack);
                log::warn!(
                    "reload: {left} poll loop(s) did not apply it within {} s (busy with a \
                 long sync?): their sessions reach the removed or replaced namespace files \
                 until they do",
                    within.as_secs()
                );
            }
        }
        let mut st = self.lock();
        st.reload_attempts += 1;
        // Said, while they lag, to whoever asks (`status`, and `rpma-target reload`, which
        // exits 1): the files it removed or replaced must not be reused yet.
        st.last_reload_lagging
            .retain(|ack| ack.wait(Duration::ZERO) > 0);
        if let Some(ack) = lagging {
            st.last_reload_lagging.push(ack);
        }
        match outcome {
            Ok(summary) => {
                log::info!("reloaded {}: {summary}", self.config_path.display());
                // Counted once done (the loops applied it): what an operator waits for.
                st.reloads += 1;
                st.last_reload = Some(summary);
                st.last_reload_ok = true;
            }
            Err(e) => {
                log::error!(
                    "reload of {} failed, keeping the running configuration: {e}",
                    self.config_path.display()
                );
                st.last_reload = Some(format!("failed: {e}"));
                st.last_reload_ok = false;
            }
        }
        let line = ready_line(&st);
        let _ = notifier.ready(&line);
    }
}
