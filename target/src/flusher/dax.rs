//! Dax write-backs longer than one step ([`DAX_STEP`](super::DAX_STEP)), taken a step per poll
//! in turn, so that a flush of a whole big namespace never holds its loop for long.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use rpma_common::pmem::{Durability, Persist};
use rpma_common::proto::FlushStatus;

/// One write-back taken in steps.
struct DaxWork {
    token: u64,
    store: Arc<dyn Persist>,
    /// What is left: `[next, end)`.
    next: u64,
    end: u64,
    /// Whether a step was visible only (the store cannot make it durable).
    visible_only: bool,
    /// The steps' time so far (ns).
    spent: u64,
}

/// The write-backs taken in steps, served in turn.
#[derive(Default)]
pub(super) struct DaxQueue(VecDeque<DaxWork>);

impl DaxQueue {
    /// Flush `token`: `[offset, offset + length)` of `store`, within its length.
    pub(super) fn start(&mut self, token: u64, store: Arc<dyn Persist>, offset: u64, length: u64) {
        self.0.push_back(DaxWork {
            token,
            store,
            next: offset,
            end: offset + length,
            visible_only: false,
            spent: 0,
        });
    }

    pub(super) fn len(&self) -> usize {
        self.0.len()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Drops those whose token `keep` refuses; returns how many.
    pub(super) fn cancel(&mut self, keep: &mut impl FnMut(u64) -> bool) -> usize {
        let before = self.0.len();
        self.0.retain(|w| keep(w.token));
        before - self.0.len()
    }

    /// Takes `budget` bytes of them in turn; each one finished goes to `done` with its
    /// answer and the time its steps took (ns).
    pub(super) fn steps(&mut self, mut budget: u64, mut done: impl FnMut(u64, FlushStatus, u64)) {
        while budget > 0 {
            let Some(mut w) = self.0.pop_front() else {
                return;
            };
            let n = (w.end - w.next).min(budget);
            let t0 = Instant::now();
            // Within the namespace's length (checked at submit), which fits usize.
            let persisted = w.store.persist(w.next as usize, n as usize);
            w.spent = w
                .spent
                .saturating_add(u64::try_from(t0.elapsed().as_nanos()).unwrap_or(u64::MAX));
            budget -= n;
            w.next += n;
            let status = match persisted {
                Ok(Durability::VisibleOnly) => {
                    w.visible_only = true;
                    None
                }
                Ok(Durability::Durable) => None,
                Err(e) => Some(persist_status(Err(e))),
            };
            let status = match (status, w.next == w.end) {
                (Some(failed), _) => failed,
                (None, false) => {
                    self.0.push_back(w);
                    continue;
                }
                (None, true) if w.visible_only => FlushStatus::VisibleOnly,
                (None, true) => FlushStatus::Durable,
            };
            done(w.token, status, w.spent);
        }
    }
}

/// The answer to a flush made by the store's own persist.
pub(super) fn persist_status(done: rpma_common::pmem::Result<Durability>) -> FlushStatus {
    match done {
        Ok(Durability::Durable) => FlushStatus::Durable,
        Ok(Durability::VisibleOnly) => FlushStatus::VisibleOnly,
        // Failed before (the store has the errno).
        Err(rpma_common::pmem::Error::Failed { .. }) => FlushStatus::NamespaceFailed,
        Err(_) => FlushStatus::IoError,
    }
}
