//! What a data-path completion means: the wr_id kinds the engine names its requests by, what
//! a completion does to the bounce slot it names (a started request's is a [`Completed`]
//! naming its [`Ticket`]), and the log of what a poll could not hand back. Plain data and
//! functions over the pool, no connection: the engine (engine/) polls and calls them.

use rpma_common::fabric::{Completion, WcStatus};

use crate::error::Error;
use crate::pool::{Pool, Slot, WriteRec};

/// wr_id kinds of the data path (bits 60-61; bits 62-63 are the session's): a Write or a Read
/// through a bounce slot (the slot number in the low bits), or a request outside the slots
/// that its caller waits for by wr_id (an APM or visibility Read, an atomic, an Atomic Write,
/// a Flush).
const KIND_SHIFT: u32 = 60;
pub(super) const KIND_WRITE: u64 = 1 << KIND_SHIFT;
pub(super) const KIND_READ: u64 = 2 << KIND_SHIFT;
pub(super) const KIND_WAITED: u64 = 3 << KIND_SHIFT;
pub(super) const KIND_MASK: u64 = 3 << KIND_SHIFT;

/// What a started request is known by: unique within its queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Ticket(pub(crate) u64);

/// A started request that completed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Completed {
    /// The Write was handed to the transport: sent, as after `write_at` (not durable; the
    /// queue keeps its bytes until a durability call covers them).
    Write(Ticket),
    /// The Read's bytes are in the queue: take them with
    /// [`Queue::take_read`](super::Queue::take_read).
    Read(Ticket),
}

/// What a completion of a Write or Read through a bounce slot did.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Outcome {
    /// Nothing more to do (a Write that completed).
    Done,
    /// A Read completed into this slot: its bytes wait to be copied out.
    ReadDone(usize),
    /// A started request completed.
    Started(Completed),
    /// The request failed; it was on namespace index `ns`.
    Failed { ns: usize, op: &'static str },
    /// No slot waits for this completion.
    Unmatched,
}

/// Moves the slot `c` names on: a completed Write is held until durable, a completed Read's
/// bytes wait to be copied out, a failed Read frees its slot.
pub(super) fn complete_slot(pool: &mut Pool, c: &Completion) -> Outcome {
    let slot = (c.wr_id & !KIND_MASK) as usize;
    let ok = c.status == WcStatus::Success;
    match (c.wr_id & KIND_MASK, pool.get(slot)) {
        (KIND_WRITE, Some(Slot::Writing(w))) => {
            // Placed or not, the slot keeps the bytes until they are durable. A started
            // Write whose completion failed is reported when its re-issue completes.
            let notify = w.notify && !ok;
            pool.set(slot, Slot::Held(WriteRec { notify, ..w }));
            if !ok {
                return Outcome::Failed {
                    ns: w.ns,
                    op: "write",
                };
            }
            if w.notify {
                return Outcome::Started(Completed::Write(Ticket(w.seq)));
            }
            Outcome::Done
        }
        (KIND_READ, Some(Slot::Reading { ns, item, at, len })) => {
            if !ok {
                pool.set(slot, Slot::Free);
                return Outcome::Failed { ns, op: "read" };
            }
            pool.set(slot, Slot::ReadDone { item, at, len });
            Outcome::ReadDone(slot)
        }
        (KIND_READ, Some(Slot::Started { ns, ticket, len })) => {
            if !ok {
                pool.set(slot, Slot::Free);
                return Outcome::Failed { ns, op: "read" };
            }
            pool.set(slot, Slot::StartedDone { ticket, len });
            Outcome::Started(Completed::Read(Ticket(ticket)))
        }
        _ => Outcome::Unmatched,
    }
}

/// What the completion poll could not hand back: completions that matched no request slot,
/// and errors after the first of a poll (the first is returned). Neither is lost silently:
/// both are counted ([`QueueStats`](super::QueueStats)) and logged.
#[derive(Debug, Default)]
pub(super) struct CompletionLog {
    /// Data completions that matched no slot.
    pub(super) unmatched: u64,
    /// Errors of a poll after its first.
    pub(super) later_errors: u64,
}

impl CompletionLog {
    /// Counts a completion that matched no slot (a request this queue does not track: a bug,
    /// or a slot reused too early) and logs it, at the 1st, 2nd, 4th, 8th... so that a storm
    /// costs a line per doubling. Returns whether it logged.
    pub(super) fn unmatched(&mut self, c: &Completion) -> bool {
        self.unmatched += 1;
        let log = self.unmatched.is_power_of_two();
        if log {
            log::warn!(
                "a completion matched no request slot (wr_id {:#x}, {:?}, {:?}); {} so far",
                c.wr_id,
                c.opcode,
                c.status,
                self.unmatched
            );
        }
        log
    }

    /// Keeps `e` in `first` if it is the poll's first error; a later one is counted and
    /// logged (at debug: after a loss every flushed request gives one).
    pub(super) fn error(&mut self, first: &mut Option<Error>, e: Error) {
        match first {
            None => *first = Some(e),
            Some(kept) => {
                self.later_errors += 1;
                log::debug!("a completion failed after the error returned ({kept}): {e}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rpma_common::proto::msgbuf::CONTROL_BIT;

    #[test]
    fn wr_id_kinds_stay_clear_of_the_session_bits() {
        for k in [KIND_WRITE, KIND_READ, KIND_WAITED] {
            assert_eq!(k & CONTROL_BIT, 0);
            assert_eq!(k & rpma_common::proto::msgbuf::SEND_BIT, 0);
            assert_eq!(k & KIND_MASK, k);
        }
    }

    fn completion(wr_id: u64, status: WcStatus) -> Completion {
        Completion {
            wr_id,
            status,
            ..Completion::EMPTY
        }
    }

    #[test]
    fn a_failed_read_names_its_namespace() {
        let pd = rpma_common::fabric::Context::soft().alloc_pd().unwrap();
        let mut p = Pool::new(&pd, 3, 3, 512).unwrap();
        let a = p.take_free().unwrap();
        p.set(
            a,
            Slot::Reading {
                ns: 2,
                item: 0,
                at: 0,
                len: 8,
            },
        );
        let b = p.take_free().unwrap();
        p.set(
            b,
            Slot::Started {
                ns: 1,
                ticket: 5,
                len: 8,
            },
        );
        let failed = |slot: usize| completion(KIND_READ | slot as u64, WcStatus::RemoteAccess);
        assert_eq!(
            complete_slot(&mut p, &failed(a)),
            Outcome::Failed { ns: 2, op: "read" }
        );
        assert_eq!(
            complete_slot(&mut p, &failed(b)),
            Outcome::Failed { ns: 1, op: "read" }
        );
        assert_eq!((p.get(a), p.get(b)), (Some(Slot::Free), Some(Slot::Free)));
        assert_eq!(p.in_flight(), 0);
    }

    #[test]
    fn a_completion_no_slot_waits_for_is_unmatched() {
        let pd = rpma_common::fabric::Context::soft().alloc_pd().unwrap();
        let mut p = Pool::new(&pd, 3, 3, 512).unwrap();
        let a = p.take_free().unwrap();
        p.set(
            a,
            Slot::Reading {
                ns: 0,
                item: 0,
                at: 0,
                len: 8,
            },
        );
        let ok = |wr_id: u64| completion(wr_id, WcStatus::Success);
        // A Write's completion for a slot that reads, a free slot, a slot out of range, no kind.
        for wr_id in [
            KIND_WRITE | a as u64,
            KIND_READ | 2,
            KIND_READ | 99,
            a as u64,
        ] {
            assert_eq!(
                complete_slot(&mut p, &ok(wr_id)),
                Outcome::Unmatched,
                "{wr_id:#x}"
            );
        }
        // The slot is untouched, and its own completion still finds it.
        assert_eq!(
            complete_slot(&mut p, &ok(KIND_READ | a as u64)),
            Outcome::ReadDone(a)
        );
    }

    #[test]
    fn completions_a_poll_cannot_return_are_counted() {
        let mut log = CompletionLog::default();
        let c = Completion::EMPTY;
        let logged: Vec<bool> = (0..9).map(|_| log.unmatched(&c)).collect();
        assert_eq!(
            logged,
            [true, true, false, true, false, false, false, true, false],
            "logged at the 1st, 2nd, 4th and 8th"
        );
        assert_eq!(log.unmatched, 9);
        let mut first = None;
        for nsid in [1, 2, 3] {
            log.error(&mut first, Error::NoSuchNamespace { nsid });
        }
        assert!(
            matches!(first, Some(Error::NoSuchNamespace { nsid: 1 })),
            "{first:?}"
        );
        assert_eq!(log.later_errors, 2, "the others are counted");
    }
}
