//! Durability: the [`Persister`] knows the method each namespace uses (chosen, or forced, or
//! the refusal of a forced one) and makes ranges durable over an [`Engine`]: the requests that
//! do it (an APM or visibility Read, a FLUSH, a GPSPM FlushRequest), and freeing the held
//! writes their acknowledgement covers. It is also what the engine asks for room when every
//! slot holds a write ([`MakeRoom`]): it persists the held writes by their own ranges.

use rpma_common::fabric::{SendOp, SendWr};
use rpma_common::proto::{DurabilityMethods, FlushStatus, NamespaceDescriptor, PersistenceDomain};
use std::sync::atomic::{AtomicBool, Ordering};

use smallvec::SmallVec;

use super::engine::{Engine, MakeRoom};
use crate::checks::check_healthy;
use crate::durability::{choose_method, Choice, MethodNotValid, PersistMethod};
use crate::error::{Error, Result};
use crate::replay::Handed;
use crate::writebuf::Data;

/// Requests that make ranges durable (FLUSH: one per range) posted at once, at most: the
/// Writes in flight (at most the queue depth, 128) and a batch stay within what a send queue
/// takes (256: [`QpCaps`](rpma_common::fabric::QpCaps)); each further batch goes out once the
/// one before it completed.
const PERSIST_BATCH: usize = 64;

/// The durability method of one namespace, as a queue knows it.
#[derive(Debug)]
struct NsState {
    /// The method for durable calls, or the refusal of a forced one (made into
    /// [`Error::MethodNotValid`] on each durable call: Error is not Clone).
    choice: std::result::Result<Choice, MethodNotValid>,
    forced: Option<PersistMethod>,
    /// Held writes were let go after a visibility Read only, to free their slots, while no
    /// valid method could make them durable (a forced method that is not valid): the next
    /// [`persist_own`](Persister::persist_own) covers the whole namespace, not only the writes
    /// still held, and clears it once that succeeded.
    let_go: AtomicBool,
}

/// The durability side of a queue: a method per namespace (by the queue's namespace index, as
/// the engine's descriptors) and the mechanics of making ranges durable. It holds no
/// connection: every call takes the engine it works through.
#[derive(Debug)]
pub(super) struct Persister {
    ns: Vec<NsState>,
}

impl Persister {
    /// The methods for `descs` (the engine's namespaces) on a connection whose peer does (or
    /// does not) support FLUSH, with `forced` on every namespace.
    pub(super) fn new(
        descs: &[NamespaceDescriptor],
        peer_flush: bool,
        forced: Option<PersistMethod>,
    ) -> Persister {
        Persister {
            ns: descs
                .iter()
                .map(|d| NsState {
                    choice: choice_of(d, peer_flush, forced),
                    forced,
                    let_go: AtomicBool::new(false),
                })
                .collect(),
        }
    }

    /// Namespace `idx` as a new connection describes it: its method is chosen again (its
    /// forced method kept).
    pub(super) fn refresh(&mut self, idx: usize, d: &NamespaceDescriptor, peer_flush: bool) {
        let n = &mut self.ns[idx];
        n.choice = choice_of(d, peer_flush, n.forced);
    }

    /// Forces `m` on namespace `idx` (None: the best one offered).
    pub(super) fn set_forced(&mut self, e: &Engine, idx: usize, m: Option<PersistMethod>) {
        let peer_flush = e.peer_has(|i| i.peer_flush);
        let n = &mut self.ns[idx];
        n.forced = m;
        n.choice = choice_of(e.descriptor(idx), peer_flush, m);
    }

    /// The method for durable calls on namespace `idx`.
    ///
    /// # Errors
    /// [`Error::NamespaceFailed`], [`Error::MethodNotValid`].
    pub(super) fn choice(&self, e: &Engine, idx: usize) -> Result<Choice> {
        check_healthy(e.descriptor(idx))?;
        self.ns[idx].choice.clone().map_err(Error::from)
    }

    /// The method for making a named range of namespace `idx` durable whoever wrote it
    /// ([`choose_for_range`](crate::durability::choose_for_range): never APM).
    pub(super) fn range_choice(&self, e: &Engine, idx: usize) -> Result<Choice> {
        let d = e.descriptor(idx);
        check_healthy(d)?;
        let peer_flush = e.peer_has(|i| i.peer_flush);
        crate::durability::choose_for_range(d, peer_flush, self.ns[idx].forced)
    }

    /// The send-queue request that makes the Writes posted before it durable (APM Read,
    /// FLUSH) or visible (a visibility Read) for `[offset, offset + len)` of namespace `ns`;
    /// None for GPSPM, which is a control message.
    fn persist_request(
        e: &Engine,
        ns: usize,
        offset: u64,
        len: u64,
        choice: Choice,
    ) -> Option<(&'static str, SendOp)> {
        use rpma_common::fabric::{FlushTarget, FlushType, RemoteAddr};
        let d = e.descriptor(ns);
        let at = offset.min(d.size.saturating_sub(8));
        let read = SendOp::Read {
            local: e.sink(),
            remote: RemoteAddr {
                addr: d.remote_addr + at,
                rkey: d.rkey,
            },
        };
        match choice {
            // A Read answers after every earlier Write was placed: they are visible.
            Choice::VisibleOnly => Some(("visibility read", read)),
            Choice::Method(PersistMethod::Apm) => Some(("APM read", read)),
            Choice::Method(PersistMethod::Flush) => {
                let target = if offset == 0 && len == d.size {
                    FlushTarget::Region { rkey: d.rkey }
                } else {
                    FlushTarget::Range {
                        remote: RemoteAddr {
                            addr: d.remote_addr + offset,
                            rkey: d.rkey,
                        },
                        len,
                    }
                };
                Some((
                    "flush",
                    SendOp::Flush {
                        target,
                        kind: FlushType::Persistent,
                    },
                ))
            }
            Choice::Method(PersistMethod::Gpspm) => None,
        }
    }

    /// After the request of [`persist_request`](Self::persist_request) completed: frees the
    /// held writes it covers and says what it achieved.
    fn persisted(
        e: &mut Engine,
        ns: usize,
        offset: u64,
        len: u64,
        choice: Choice,
    ) -> crate::Durability {
        use crate::Durability;
        match choice {
            Choice::Method(PersistMethod::Apm) => {
                // Everything placed on this queue pair before the Read is durable.
                e.release_held(ns, 0, 0, true);
                Durability::Durable(PersistMethod::Apm)
            }
            Choice::Method(m) => {
                e.release_held(ns, offset, offset + len, false);
                Durability::Durable(m)
            }
            Choice::VisibleOnly => {
                e.release_held(ns, offset, offset + len, false);
                Durability::VisibleOnly
            }
        }
    }

    /// Makes `[offset, offset + len)` of namespace `ns` durable with `choice`, after every
    /// Write posted before; frees the held writes the acknowledgement covers. With APM that is
    /// only this queue's own Writes: callers that name a range for its own sake choose with
    /// [`range_choice`](Self::range_choice).
    pub(super) fn persist_range(
        &self,
        e: &mut Engine,
        ns: usize,
        offset: u64,
        len: u64,
        choice: Choice,
    ) -> Result<crate::Durability> {
        e.drain()?;
        if choice != Choice::Method(PersistMethod::Gpspm) {
            return self.write_and_persist(e, ns, &[], &[(offset, offset + len)], choice);
        }
        let d = e.descriptor(ns).clone();
        let whole = offset == 0 && len == d.size;
        let status = e.flush_request(
            ns,
            if whole { 0 } else { offset },
            if whole { 0 } else { len },
        )?;
        match status {
            FlushStatus::Durable => Ok(Self::persisted(e, ns, offset, len, choice)),
            FlushStatus::VisibleOnly => {
                Ok(Self::persisted(e, ns, offset, len, Choice::VisibleOnly))
            }
            // The target is leaving: retry on the next connection.
            FlushStatus::Unavailable => Err(Error::Disconnected {
                reason: "the target answered a flush with Unavailable".into(),
            }),
            FlushStatus::NamespaceFailed => Err(Error::NamespaceFailed {
                nsid: d.nsid,
                reason: "the target answered a flush with NamespaceFailed".into(),
            }),
            status => Err(Error::NotDurable {
                nsid: d.nsid,
                status,
            }),
        }
    }

    /// Makes every held write durable (or visible, on volatile namespaces) to free their
    /// slots. A namespace whose forced method is not valid gets a visibility Read instead: this
    /// claims nothing to the caller, it only frees the slots.
    ///
    /// What it persists is the held writes' own ranges, never the span between them: a FLUSH
    /// (or a GPSPM request on dax) of the span of random writes would write back every cache
    /// line in between, milliseconds for writes scattered over 64 MiB.
    fn persist_held(&self, e: &mut Engine) -> Result<()> {
        for idx in 0..self.ns.len() {
            let ranges = e.held_ranges(idx);
            if ranges.is_empty() {
                continue;
            }
            let choice = match self.held_choice(e, idx) {
                Ok(c) => c,
                Err(_) => {
                    self.ns[idx].let_go.store(true, Ordering::SeqCst);
                    // Not durable, and no longer held: a queue that let their bytes go to
                    // them cannot count on them.
                    e.lose_writes(idx);
                    Choice::VisibleOnly
                }
            };
            self.persist_ranges(e, idx, &ranges, choice)?;
        }
        Ok(())
    }

    /// Makes durable every write this queue posted to namespace `idx` that is not durable yet
    /// (the ones it holds for a replay), with [`held_choice`](Self::held_choice).
    /// Writes it let go unpersisted to free their slots are covered too (the whole namespace:
    /// which bytes they were is not kept), and so are the writes its re-issues let go because
    /// newer writes of other queues took their bytes ([`handed`](Self::handed)).
    ///
    /// # Errors
    /// As [`handed`](Self::handed); [`Error::ApmNotForRanges`] when it owes bytes of other
    /// queues' writes and APM is forced or the only method; what the requests return.
    pub(super) fn persist_own(&self, e: &mut Engine, idx: usize) -> Result<crate::Durability> {
        let choice = self.held_choice(e, idx)?;
        if choice == Choice::VisibleOnly {
            // Nothing is durable here, nor owed.
            e.settle_handed(idx);
        }
        let handed = self.handed(e, idx)?;
        let let_go = self.ns[idx].let_go.load(Ordering::SeqCst);
        let ranges = if let_go {
            smallvec::smallvec![(0, e.descriptor(idx).size)]
        } else {
            e.held_ranges(idx)
        };
        let d = self.persist_ranges(e, idx, &ranges, choice)?;
        if let_go && d.is_durable() {
            self.ns[idx].let_go.store(false, Ordering::SeqCst);
        }
        if !d.is_durable() {
            return Ok(d);
        }
        if !handed.is_empty() {
            // Bytes other queues wrote: a method that names the range (never APM).
            let c = self.range_choice(e, idx)?;
            let h = self.persist_ranges(e, idx, &handed, c)?;
            if !h.is_durable() {
                return Ok(h);
            }
        }
        e.settle_handed(idx);
        Ok(d)
    }

    /// The bytes of namespace `idx` that this queue's re-issues let go to newer writes of
    /// other queues and that its persist of its own writes must make durable itself: those
    /// that newer writes still held hold, placed since this queue reconnected
    /// ([`crate::replay`]'s heirs; often none).
    ///
    /// # Errors
    /// [`Error::RewritesNotPlaced`] while a newer write is not known placed since (its queue
    /// is asked to learn its placement: call again once it polled);
    /// [`Error::RewritesLost`] when a newer write was let go unpersisted (reported once).
    fn handed(&self, e: &mut Engine, idx: usize) -> Result<Vec<(u64, u64)>> {
        let nsid = e.descriptor(idx).nsid;
        match e.handed(idx) {
            Handed::Persist(ranges) => Ok(ranges),
            Handed::Unplaced(queues) => {
                e.want_placed(&queues);
                Err(Error::RewritesNotPlaced { nsid, queues })
            }
            Handed::Lost(ranges) => {
                e.lost_reported(idx);
                Err(Error::RewritesLost { nsid, ranges })
            }
        }
    }

    /// The method for this queue's own held writes of namespace `idx`: the namespace's, except
    /// that where the target offers APM on a dax namespace and no method was forced, APM: one
    /// Read makes them all durable, and the target writes back only the lines they placed (its
    /// dirty list), where a FLUSH per scattered range costs a request each.
    pub(super) fn held_choice(&self, e: &Engine, idx: usize) -> Result<Choice> {
        let c = self.choice(e, idx)?;
        let apm = Choice::Method(PersistMethod::Apm);
        if c != apm
            && c != Choice::VisibleOnly
            && self.ns[idx].forced.is_none()
            && apm_for_held(e.descriptor(idx))
        {
            return Ok(apm);
        }
        Ok(c)
    }

    /// The send-queue requests that make the sorted, disjoint `ranges` of namespace `ns`
    /// durable (or visible) after the Writes posted before them, with their wr_ids: one Read
    /// for APM and visibility (it covers every earlier Write of this queue pair), one Flush per
    /// range for FLUSH (never their span: a Flush of the span between scattered writes would
    /// write back every cache line in between); none for GPSPM, a control message
    /// ([`gpspm_ranges`](Self::gpspm_ranges) after the Writes completed).
    fn persist_requests(
        e: &mut Engine,
        ns: usize,
        ranges: &[(u64, u64)],
        choice: Choice,
    ) -> SmallVec<[(&'static str, SendWr); 2]> {
        let one = matches!(
            choice,
            Choice::VisibleOnly | Choice::Method(PersistMethod::Apm)
        );
        let mut out = SmallVec::new();
        for &(lo, hi) in ranges {
            if let Some((what, op)) = Self::persist_request(e, ns, lo, hi - lo, choice) {
                out.push((what, e.waited_wr(op)));
            }
            if one {
                break;
            }
        }
        out
    }

    /// Waits for the requests of [`persist_requests`](Self::persist_requests) (posted), then
    /// frees the held writes in `ranges` and says what they achieved.
    fn await_persisted(
        e: &mut Engine,
        ns: usize,
        ranges: &[(u64, u64)],
        choice: Choice,
        requests: &[(&'static str, u64)],
    ) -> Result<crate::Durability> {
        for &(what, id) in requests {
            e.wait_for_request(ns, what, id)?;
        }
        rpma_common::steps::step("waited requests completed");
        let mut out = match choice {
            Choice::Method(m) => crate::Durability::Durable(m),
            Choice::VisibleOnly => crate::Durability::VisibleOnly,
        };
        for &(lo, hi) in ranges {
            out = Self::persisted(e, ns, lo, hi - lo, choice);
        }
        rpma_common::steps::step("held writes released");
        Ok(out)
    }

    /// Makes the sorted, disjoint `ranges` of namespace `ns` durable with `choice`, after every
    /// Write posted before, and frees the held writes they cover: the requests of
    /// [`persist_requests`](Self::persist_requests) behind one doorbell, or GPSPM's.
    fn persist_ranges(
        &self,
        e: &mut Engine,
        ns: usize,
        ranges: &[(u64, u64)],
        choice: Choice,
    ) -> Result<crate::Durability> {
        e.drain()?;
        self.write_and_persist(e, ns, &[], ranges, choice)
    }

    /// Posts the Writes of `items` to namespace `ns` and makes the sorted, disjoint `ranges`
    /// durable with `choice` after them: the requests of
    /// [`persist_requests`](Self::persist_requests) behind the last Writes with one doorbell,
    /// or, for GPSPM, the FlushRequest(s) once the Writes completed.
    pub(super) fn write_and_persist(
        &self,
        e: &mut Engine,
        ns: usize,
        items: &[(u64, Data<'_>)],
        ranges: &[(u64, u64)],
        choice: Choice,
    ) -> Result<crate::Durability> {
        if choice == Choice::Method(PersistMethod::Gpspm) {
            e.post_writes(self, ns, items, [])?;
            e.drain()?;
            return self.gpspm_ranges(e, ns, ranges);
        }
        // The first batch of requests goes out with the last Writes (one doorbell); more than
        // a send queue takes were refused whole, and the call failed every time
        // (`a_durable_batch_of_more_ranges_than_a_send_queue_takes`).
        let mut reqs = Self::persist_requests(e, ns, ranges, choice).into_iter();
        let ids_of = |b: &[(&'static str, SendWr)]| -> SmallVec<[(&'static str, u64); 2]> {
            b.iter().map(|(w, r)| (*w, r.wr_id)).collect()
        };
        let batch: SmallVec<[_; 2]> = reqs.by_ref().take(PERSIST_BATCH).collect();
        let mut ids = ids_of(&batch);
        e.post_writes(self, ns, items, batch.into_iter().map(|(_, r)| r))?;
        loop {
            let batch: SmallVec<[_; 2]> = reqs.by_ref().take(PERSIST_BATCH).collect();
            if batch.is_empty() {
                break;
            }
            for &(what, id) in &ids {
                e.wait_for_request(ns, what, id)?;
            }
            ids = ids_of(&batch);
            e.post_writes(self, ns, &[], batch.into_iter().map(|(_, r)| r))?;
        }
        Self::await_persisted(e, ns, ranges, choice, &ids)
    }

    /// GPSPM for the sorted, disjoint `ranges` after every Write posted before completed: their
    /// span on page-cache (a ranged fdatasync writes back only the dirty pages in it, where one
    /// per range would each pay the filesystem's sync), a request per range elsewhere (the
    /// target's write-back of a dax span would cover every line in between).
    fn gpspm_ranges(
        &self,
        e: &mut Engine,
        ns: usize,
        ranges: &[(u64, u64)],
    ) -> Result<crate::Durability> {
        let choice = Choice::Method(PersistMethod::Gpspm);
        let (Some(first), Some(last)) = (ranges.first(), ranges.last()) else {
            return Ok(crate::Durability::Durable(PersistMethod::Gpspm));
        };
        if e.descriptor(ns).domain == PersistenceDomain::PageCache {
            return self.persist_range(e, ns, first.0, last.1 - first.0, choice);
        }
        let mut out = crate::Durability::Durable(PersistMethod::Gpspm);
        for &(lo, hi) in ranges {
            out = self.persist_range(e, ns, lo, hi - lo, choice)?;
        }
        Ok(out)
    }
}

impl MakeRoom for Persister {
    fn make_room(&self, e: &mut Engine) -> Result<()> {
        self.persist_held(e)
    }
}

/// Whether APM may stand in for the chosen method to free held writes of namespace `d`: the
/// target offers it, and the namespace is dax (on page-cache APM would make the target msync
/// in its poll loop, which the default choice of GPSPM avoids).
fn apm_for_held(d: &NamespaceDescriptor) -> bool {
    matches!(
        d.domain,
        PersistenceDomain::Dax | PersistenceDomain::DaxForced
    ) && d.durability.contains(DurabilityMethods::APM)
}

/// The method for durable calls on `d`, or the refusal of a forced one, kept typed.
fn choice_of(
    d: &NamespaceDescriptor,
    peer_flush: bool,
    forced: Option<PersistMethod>,
) -> std::result::Result<Choice, MethodNotValid> {
    choose_method(d, peer_flush, forced)
}
