//! The soft transport's part of a completion queue: the queue pairs whose sockets its polling
//! drives, and the epoll set its idle wait blocks in.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};

use super::outbound::quantum;
use super::qp::SoftQp;
use crate::fabric::completions::Completions;
use crate::fabric::error::Result;
use crate::fabric::wait::Poller;

pub(crate) struct SoftCq {
    /// Where the bound queue pairs push their completions (the completion queue's list).
    list: Arc<Completions>,
    qps: Mutex<Arc<Vec<Weak<SoftQp>>>>,
    poller: Poller,
    /// Queue pairs that still had output waiting after the previous pass: they share the
    /// next pass's send budget (fair share, `outbound::quantum`).
    busy: AtomicUsize,
}

impl SoftCq {
    pub(crate) fn new(list: Arc<Completions>) -> Result<SoftCq> {
        Ok(SoftCq {
            list,
            qps: Mutex::new(Arc::new(Vec::new())),
            poller: Poller::new()?,
            busy: AtomicUsize::new(0),
        })
    }

    pub(crate) fn poller(&self) -> &Poller {
        &self.poller
    }

    /// The completion list a queue pair made on this queue completes into.
    pub(crate) fn list(&self) -> Arc<Completions> {
        Arc::clone(&self.list)
    }

    /// Makes a connected queue pair's progress part of this queue's polling.
    pub(crate) fn attach(&self, qp: &Arc<SoftQp>) {
        let mut qps = self.qps.lock().unwrap_or_else(|p| p.into_inner());
        let mut list: Vec<Weak<SoftQp>> = qps
            .iter()
            .filter(|w| w.strong_count() > 0)
            .cloned()
            .collect();
        if !list
            .iter()
            .any(|w| std::ptr::eq(w.as_ptr(), Arc::as_ptr(qp)))
        {
            list.push(Arc::downgrade(qp));
        }
        *qps = Arc::new(list);
    }

    /// The bound queue pairs still alive. A snapshot: attaching copies the list, so polling
    /// neither allocates nor holds the list's lock while it drives the queue pairs.
    fn live_qps(&self) -> Arc<Vec<Weak<SoftQp>>> {
        Arc::clone(&self.qps.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Drives the bound queue pairs once, round-robin: each writes at most its share of the
    /// pass's send budget, split between those that had output waiting after the last pass.
    /// Returns whether what arrived on any of them queued an answer (`Engine::receive`).
    pub(crate) fn progress(&self) -> bool {
        let share = quantum(self.busy.load(Ordering::Relaxed));
        let (mut busy, mut answered) = (0, false);
        for qp in self.live_qps().iter().filter_map(Weak::upgrade) {
            let pass = qp.progress(share);
            busy += usize::from(pass.busy);
            answered |= pass.answered;
        }
        self.busy.store(busy, Ordering::Relaxed);
        answered
    }

    /// Arms the sockets for the idle wait (writability where output waits). Returns whether a
    /// queue pair holds buffered input (the wait must not block then).
    pub(crate) fn arm(&self) -> Result<bool> {
        let mut held = false;
        for qp in self.live_qps().iter().filter_map(Weak::upgrade) {
            held |= qp.arm(&self.poller)?;
        }
        Ok(held)
    }
}
