//! The completions a completion queue holds until they are polled: the transport pushes them
//! (the soft engine as its queue pairs complete requests, the rdma queue as it reaps the
//! device's), `CompletionQueue::poll` takes them in order.

use std::collections::VecDeque;
use std::sync::{Mutex, MutexGuard};

use super::types::Completion;

/// A completion queue's list of completions. Shared by the queue and its transport's part.
#[derive(Debug, Default)]
pub(crate) struct Completions(Mutex<VecDeque<Completion>>);

impl Completions {
    pub(crate) fn with_capacity(n: usize) -> Completions {
        Completions(Mutex::new(VecDeque::with_capacity(n)))
    }

    fn lock(&self) -> MutexGuard<'_, VecDeque<Completion>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Appends one (never refused: the list grows beyond the queue's depth).
    pub(crate) fn push(&self, c: Completion) {
        self.lock().push_back(c);
    }

    /// Moves the oldest, at most `out.len()`, into `out`; returns how many.
    pub(crate) fn take_into(&self, out: &mut [Completion]) -> usize {
        let mut e = self.lock();
        let n = out.len().min(e.len());
        for (slot, c) in out.iter_mut().zip(e.drain(..n)) {
            *slot = c;
        }
        n
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }

    pub(crate) fn len(&self) -> usize {
        self.lock().len()
    }
}
