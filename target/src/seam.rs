//! The seam between the daemon and what serves listeners and sessions: the [`Serve`] trait and
//! the errors its [`Serve::bind`] reports. The daemon ([`crate::daemon`]) runs any [`Serve`];
//! the fabric-backed one ([`crate::serve`], with [`crate::nvme_tcp`]) implements it. Both build on
//! this file and neither names the other, so the daemon's imports run one way.

use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use rpma_common::fabric;

use crate::config::Config;
use crate::control::{AdmissionStatus, ListenerStatus, SessionStatus};
use crate::eventfd::EventFd;
use crate::metrics::MetricsStatus;
use crate::namespace::NamespaceTable;
use crate::reload::ConfigDiff;

/// A thread's sign of life: a counter it bumps every turn, and the eventfd that wakes it (so
/// that an idle thread, blocked in its wait, turns once when checked).
#[derive(Clone, Debug)]
pub struct Heartbeat(Arc<(String, AtomicU64, Arc<EventFd>)>);

impl Heartbeat {
    pub(crate) fn new(name: String, wake: Arc<EventFd>) -> Heartbeat {
        Heartbeat(Arc::new((name, AtomicU64::new(0), wake)))
    }

    /// The thread's name.
    pub(crate) fn name(&self) -> &str {
        &self.0 .0
    }

    /// Called by the thread each turn.
    pub(crate) fn tick(&self) {
        self.0 .1.fetch_add(1, Ordering::Relaxed);
    }

    /// Turns counted so far.
    pub(crate) fn count(&self) -> u64 {
        self.0 .1.load(Ordering::Relaxed)
    }

    /// Wakes the thread.
    pub(crate) fn ping(&self) {
        self.0 .2.signal();
    }

    /// Called by the woken thread.
    pub(crate) fn clear(&self) {
        self.0 .2.clear();
    }

    pub(crate) fn wake_fd(&self) -> BorrowedFd<'_> {
        self.0 .2.as_fd()
    }
}

/// Errors of the serving machinery, as [`Serve::bind`] reports them.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A listen URL the fabric cannot parse.
    #[error("listen URL {url}")]
    Url {
        /// The URL.
        url: String,
        /// What the fabric reported.
        #[source]
        source: fabric::Error,
    },
    /// A transport this build does not serve (built without the `rdma` feature).
    #[error("{url}: the rdma transport is not served by this build; use tcp://")]
    RdmaNotServed {
        /// The URL.
        url: String,
    },
    /// Listeners of both transports in one configuration: the poll loops share one device.
    #[error("listeners {tcp} and {rdma}: one configuration serves one transport (tcp or rdma)")]
    MixedTransports {
        /// A `tcp://` listener.
        tcp: String,
        /// An `rdma://` listener.
        rdma: String,
    },
    /// Binding an `nvme-tcp://` listener failed.
    #[error("cannot listen on {url}")]
    NvmeListen {
        /// The URL.
        url: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// RLIMIT_MEMLOCK is too low for one rdma session's registrations.
    #[error("{message}")]
    Memlock {
        /// What is too low and what to change.
        message: String,
    },
    /// Binding a listener failed.
    #[error("cannot listen on {url}")]
    Listen {
        /// The URL.
        url: String,
        /// What the fabric reported.
        #[source]
        source: fabric::Error,
    },
    /// A thread could not be started.
    #[error("cannot start thread {name}")]
    Thread {
        /// The thread's name.
        name: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A poll loop's completion queue or flusher could not be created.
    #[error("cannot set up poll loop {index}")]
    LoopSetup {
        /// The loop's index.
        index: usize,
        /// What failed.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

/// Result of the serving machinery.
pub type Result<T> = std::result::Result<T, Error>;

/// The threads that have yet to apply a reload, which the reload waits for before it says
/// READY ([`Serve::reloaded`]).
#[derive(Debug)]
pub struct ReloadAck {
    left: Mutex<usize>,
    done: Condvar,
}

impl ReloadAck {
    /// `threads` to wait for; each gets an [`Applied`] token ([`ReloadAck::token`]).
    pub(crate) fn new(threads: usize) -> Arc<ReloadAck> {
        Arc::new(ReloadAck {
            left: Mutex::new(threads),
            done: Condvar::new(),
        })
    }

    /// A thread's token: it counts as having applied the reload when the token drops (after
    /// applying it, when it panics, or when its command is never taken).
    pub(crate) fn token(self: &Arc<Self>) -> Applied {
        Applied(Arc::clone(self))
    }

    /// Waits until every thread applied it, or `within` passed: how many have not.
    pub fn wait(&self, within: Duration) -> usize {
        let left = self.left.lock().unwrap_or_else(|p| p.into_inner());
        let (left, _) = self
            .done
            .wait_timeout_while(left, within, |l| *l > 0)
            .unwrap_or_else(|p| p.into_inner());
        *left
    }
}

/// One thread's part of a [`ReloadAck`]: applied when dropped.
#[derive(Debug)]
pub struct Applied(Arc<ReloadAck>);

impl Drop for Applied {
    fn drop(&mut self) {
        let mut left = self.0.left.lock().unwrap_or_else(|p| p.into_inner());
        *left = left.saturating_sub(1);
        self.0.done.notify_all();
    }
}

/// The seam where listeners and sessions plug in: [`crate::serve::FabricServe`] serves them on
/// the fabric; [`NoTransport`](crate::daemon::NoTransport) binds nothing (a daemon without listeners, for tests of its own
/// machinery).
pub trait Serve: Send {
    /// Binds every listener of `cfg`; called after the namespaces are mapped and the control
    /// socket accepts, before READY=1. Returns one status per listener.
    ///
    /// # Errors
    /// Any error stops the daemon before READY=1.
    fn bind(&mut self, cfg: &Config, namespaces: &NamespaceTable) -> Result<Vec<ListenerStatus>>;

    /// A reload was applied: `namespaces` is the new table. Close the sessions that
    /// [`ConfigDiff::touches_session`] names and revoke rkeys of removed or changed namespaces;
    /// leave every other session alone. Returns what to wait for before the reload is done
    /// (READY=1), when the serving threads apply it in their own time: the caller waits with
    /// no lock held ([`ReloadAck::wait`]).
    fn reloaded(
        &mut self,
        diff: &ConfigDiff,
        cfg: &Config,
        namespaces: &NamespaceTable,
    ) -> Option<Arc<ReloadAck>>;

    /// The sessions, for `status`.
    fn sessions(&self) -> Vec<SessionStatus>;

    /// The listeners [`bind`](Self::bind) bound that are down now (an `rdma://` listener whose
    /// device was lost, until it is back): each one's URL as `bind` gave it, and why.
    fn listeners_down(&self) -> Vec<(String, String)> {
        Vec::new()
    }

    /// The admission budgets in use, for `status` (None before [`Serve::bind`]).
    fn admission(&self) -> Option<AdmissionStatus> {
        None
    }

    /// The data-path and control-plane counts, for `status` and the metrics endpoint (None
    /// before [`Serve::bind`], and from a daemon that serves nothing).
    fn metrics(&self) -> Option<MetricsStatus> {
        None
    }

    /// The serving threads' heartbeats, for the watchdog check (the daemon reads them with no
    /// lock held: a reload that maps big namespaces, or a clear-failure, holds its state for
    /// a while, and the pings go on meanwhile while every serving thread turns).
    fn heartbeats(&self) -> Vec<Heartbeat> {
        Vec::new()
    }

    /// Stops accepting, answers in-flight flush requests, closes every session.
    fn stop(&mut self);
}
