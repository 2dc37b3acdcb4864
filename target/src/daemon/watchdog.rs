//! The service manager's watchdog: pinged (WATCHDOG=1) at half its period while every serving
//! thread turns ([`Serve::heartbeats`](crate::seam::Serve::heartbeats)), by the main thread, and
//! by a thread of its own while a reload holds the main thread ([`Pinger::during`]). Neither
//! takes the daemon's state lock: a reload that maps big namespaces ahead of use, or a
//! clear-failure that reopens one, holds it for as long, and the pings stopped meanwhile (the
//! main thread waited for the lock, or ran the reload), so that the service manager killed a
//! daemon that served on (38 s without a ping for a reload adding an 8 GiB namespace).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::notify::Notifier;
use crate::seam::Heartbeat;

/// How long a reload may hold the main thread with the pings going on (the longest a `reload`
/// request waits for one, and half a minute more): past it the pings stop, so that a reload
/// stuck for good has the service manager restart the daemon.
const LONGEST_RELOAD: Duration = Duration::from_secs(300);

/// The watchdog's pings (none without a watchdog).
pub(super) struct Pinger<'n> {
    notifier: &'n Notifier,
    /// Half the watchdog's period.
    every: Option<Duration>,
    beats: Vec<Heartbeat>,
    /// Each thread's heartbeat count at the previous check, by name.
    seen: BTreeMap<String, u64>,
    last: Instant,
    /// A thread was found stuck (said once, until every thread turns again).
    stalled: bool,
}

impl<'n> Pinger<'n> {
    /// The pings of `notifier`'s watchdog, while the threads of `beats` turn; the first goes now.
    ///
    /// # Errors
    /// The first ping could not be sent.
    pub(super) fn start(
        notifier: &'n Notifier,
        beats: Vec<Heartbeat>,
    ) -> crate::notify::Result<Pinger<'n>> {
        let every = notifier.watchdog_interval();
        if every.is_some() {
            notifier.watchdog()?;
        }
        Ok(Pinger {
            notifier,
            every,
            beats,
            seen: BTreeMap::new(),
            last: Instant::now(),
            stalled: false,
        })
    }

    /// How long until the next check is due (None without a watchdog).
    pub(super) fn left(&self) -> Option<Duration> {
        self.every.map(|w| {
            w.saturating_sub(self.last.elapsed())
                .max(Duration::from_millis(1))
        })
    }

    /// The check, when it is due: pings if every serving thread turned since the previous one
    /// (and wakes them all, so that an idle thread turns by the next); else says which did
    /// not, once.
    pub(super) fn tick(&mut self) {
        let Some(w) = self.every else {
            return;
        };
        if self.last.elapsed() < w {
            return;
        }
        let stuck = self.stuck();
        if stuck.is_empty() {
            if self.stalled {
                log::info!("every serving thread makes progress again: watchdog pings resume");
                self.stalled = false;
            }
            if let Err(e) = self.notifier.watchdog() {
                log::warn!("{}", rpma_common::error_chain(&e));
            }
        } else if !self.stalled {
            // Said once; the service manager restarts the daemon if it stays so.
            log::error!(
                "{} made no progress within {} ms: not pinging the watchdog",
                stuck.join(", "),
                w.as_millis()
            );
            self.stalled = true;
        }
        self.last = Instant::now();
    }

    /// The threads that made no progress since the previous call (none on the first), after
    /// waking every one.
    fn stuck(&mut self) -> Vec<String> {
        let mut stuck = Vec::new();
        for b in &self.beats {
            let now = b.count();
            if self.seen.insert(b.name().to_owned(), now) == Some(now) {
                stuck.push(b.name().to_owned());
            }
            b.ping();
        }
        stuck
    }

    /// Runs `f` (a reload) on this thread while a thread of its own does the checks, for at
    /// most [`LONGEST_RELOAD`]. Without a watchdog, or if that thread cannot be started, `f`
    /// alone.
    pub(super) fn during<T>(&mut self, f: impl FnOnce() -> T) -> T {
        if self.every.is_none() {
            return f();
        }
        let done = AtomicBool::new(false);
        let started = Instant::now();
        std::thread::scope(|s| {
            let (me, done_ref) = (&mut *self, &done);
            let pinger = std::thread::Builder::new()
                .name("rpma-watchdog".into())
                .spawn_scoped(s, move || {
                    while !done_ref.load(Ordering::Acquire) {
                        if started.elapsed() >= LONGEST_RELOAD {
                            log::error!(
                                "a reload has run for {} s: not pinging the watchdog",
                                LONGEST_RELOAD.as_secs()
                            );
                            return;
                        }
                        me.tick();
                        std::thread::park_timeout(me.left().unwrap_or(LONGEST_RELOAD));
                    }
                });
            if let Err(e) = &pinger {
                log::warn!("cannot start the watchdog's thread for the reload ({e})");
            }
            // Ends the pinging thread when `f` returns, or unwinds (the scope waits for it).
            struct Done<'d>(&'d AtomicBool, Option<std::thread::Thread>);
            impl Drop for Done<'_> {
                fn drop(&mut self) {
                    self.0.store(true, Ordering::Release);
                    if let Some(t) = &self.1 {
                        t.unpark();
                    }
                }
            }
            let _done = Done(&done, pinger.as_ref().ok().map(|t| t.thread().clone()));
            f()
        })
    }
}
