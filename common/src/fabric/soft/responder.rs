//! The responder half of the engine (and the requester's view of responses): every inbound
//! message, placed or answered. STag, bounds and rights are checked before a byte is placed;
//! every response leaves only after the Writes before it were placed and made durable.
//! What is served is counted per rkey as it is served (`placement::Counting`: Writes at their
//! placement, Reads, atomics and Flushes once answered, APM Reads and failed persists), and the
//! persist work before a response is timed.

use std::sync::atomic::{AtomicU64, Ordering};

use super::device::AccessFault;
use super::engine::*;
use super::outbound::{OnSent, Src, TxMsg};
use super::placement;
use super::placer::write_payload;
use super::status;
use super::wire::rdmap::{
    AtomicOp, AtomicResponse, FlushPlacement, FlushSelectivity, PrivateResponse,
};
use super::wire::rx::{self, DirectTarget};
use super::wire::{Body, Header, HeaderKind, Opcode, TermCause};
use crate::fabric::counters::PersistKind;
use crate::fabric::error::QpFailure;
use crate::fabric::types::{Access, QpState, WcOpcode, WcStatus};
use crate::pmem::Domain;
use crate::stats::{Stopwatch, COUNTING};

impl Engine {
    /// A data FPDU has been placed (with CRC on, after its CRC passed); `written_back`: by a
    /// copy that also wrote it back from the CPU cache.
    pub(super) fn on_data(&mut self, hdr: Header, len: usize, written_back: bool) {
        // Dropping `placing` here, once the FPDU is reported, releases the region it kept
        // alive while the receiver held a raw pointer into it.
        if let Some(p) = self.placing.take() {
            if let HeaderKind::Tagged { stag, .. } = hdr.kind {
                self.counting.write(stag, p.len, hdr.last);
            }
            if p.writeback {
                if written_back {
                    self.dirty.add_fence(&p.region);
                } else {
                    self.dirty.add(&p.region, p.offset, p.len);
                }
            }
        }
        match (hdr.opcode, hdr.kind) {
            (Opcode::ReadResponse, _) => {
                let Some(&seq) = self.in_flight.front() else {
                    return;
                };
                let Some(ent) = self.entry_mut(seq) else {
                    return;
                };
                if let Pending::Read { got, sink } = &mut ent.pending {
                    *got += len;
                    if hdr.last {
                        // A Read Response that ends before the requested length is a peer's
                        // protocol error: the Read fails and the stream is terminated.
                        let short = *got != sink.len;
                        ent.pending = Pending::Done;
                        ent.status = Some(if short {
                            WcStatus::RemoteOperation
                        } else {
                            WcStatus::Success
                        });
                        self.in_flight.pop_front();
                        if short {
                            let cause = TermCause::RDMAP_OPERATION_UNSPECIFIED;
                            self.terminate(Fault::at(cause, hdr, hdr.len() + len));
                        }
                    }
                }
            }
            (
                Opcode::Send | Opcode::SendSe | Opcode::SendInvalidate | Opcode::SendSeInvalidate,
                HeaderKind::Untagged { inv_stag, mo, .. },
            ) => {
                if !hdr.last {
                    return;
                }
                let Some(cur) = self.cur_recv.take() else {
                    return;
                };
                let mut invalidated = None;
                if matches!(
                    hdr.opcode,
                    Opcode::SendInvalidate | Opcode::SendSeInvalidate
                ) {
                    if let Err(f) =
                        self.stags
                            .invalidate_remote(inv_stag, self.domain.pd, self.qp_num)
                    {
                        let cause = status::invalidate_cause(f);
                        self.terminate(Fault::at(cause, hdr, hdr.len() + len));
                        self.recv_cq.push(self.recv_completion(
                            cur.entry.wr_id,
                            WcStatus::WrFlush,
                            0,
                        ));
                        return;
                    }
                    invalidated = Some(inv_stag);
                }
                let mut c =
                    self.recv_completion(cur.entry.wr_id, WcStatus::Success, mo as usize + len);
                c.invalidated_rkey = invalidated;
                c.solicited = matches!(hdr.opcode, Opcode::SendSe | Opcode::SendSeInvalidate);
                self.recv_cq.push(c);
            }
            _ => {}
        }
    }

    /// One step ([`RX_BYTES`]) of the large Persistent Flush in progress, if one is: answered
    /// after its last step, the queue pair terminated if a step fails. Returns whether no Flush
    /// is in progress any more.
    pub(super) fn flush_step(&mut self) -> bool {
        let Some(f) = self.flushing.as_mut() else {
            return true;
        };
        let region = std::sync::Arc::clone(&f.region);
        let Some(p) = region.persist() else {
            // Checked when the Flush started (a region's store does not go away): never
            // answered as if durable.
            let f = self.flushing.take().expect("in progress");
            let fault = Fault::at(TermCause::RDMAP_CATASTROPHIC_STREAM, f.hdr, f.ulpdu_len);
            self.terminate(fault);
            return true;
        };
        let (at, step) = (f.at, (f.end - f.at).min(RX_BYTES));
        let sw = Stopwatch::start();
        let done = p.persist(at, step);
        self.rx_bytes += step;
        match p.domain() {
            Domain::PageCache => self.counting.persisted(PersistKind::Msync, sw),
            Domain::Dax | Domain::DaxForced => self.counting.persisted(PersistKind::Writeback, sw),
            _ => {}
        }
        let f = self.flushing.as_mut().expect("in progress");
        if let Err(e) = done {
            let (hdr, ulpdu_len, stag) = (f.hdr, f.ulpdu_len, f.stag);
            self.flushing = None;
            self.counting.flush(stag, false);
            let fault = Fault::at(TermCause::RDMAP_CATASTROPHIC_STREAM, hdr, ulpdu_len);
            self.terminate(fault.with_persist(e));
            return true;
        }
        f.at += step;
        if f.at < f.end {
            return false;
        }
        let (req_id, stag) = (f.req_id, f.stag);
        self.flushing = None;
        let resp = PrivateResponse {
            req_id,
            request: Opcode::FlushRequest,
        };
        self.respond(Opcode::PrivateResponse, &resp.encode());
        self.counting.flush(stag, true);
        true
    }

    /// Makes every Write placed so far durable: called before any response leaves. Returns
    /// whether there was durable work to do (dax or page-cache ranges, or a fence), timed in
    /// the persist histograms.
    pub(super) fn persist_dirty(
        &mut self,
        hdr: Header,
        ulpdu_len: usize,
    ) -> std::result::Result<bool, Fault> {
        if self.dirty.is_empty() {
            return Ok(false);
        }
        let work = if COUNTING {
            self.dirty.durable_work()
        } else {
            None
        };
        let sw = Stopwatch::start();
        let done = self.dirty.persist_all();
        if let Some(kind) = work {
            self.counting.persisted(kind, sw);
        }
        done.map_err(|e| {
            Fault::at(TermCause::RDMAP_CATASTROPHIC_STREAM, hdr, ulpdu_len).with_persist(e)
        })?;
        Ok(work.is_some())
    }

    pub(super) fn lookup(
        &self,
        stag: u32,
        to: u64,
        len: u64,
        need: Access,
    ) -> std::result::Result<crate::fabric::soft::device::Target, AccessFault> {
        let entry = self.stags.lookup(stag).ok_or(AccessFault::InvalidStag)?;
        let t = entry.check(self.domain.pd, self.qp_num, to, len, need)?;
        // A region still registered but revoked: over a file mapping with a page the kernel
        // could not give back (crate::sigbus), which serves nothing more.
        if t.region.revoked() {
            return Err(AccessFault::InvalidStag);
        }
        Ok(t)
    }

    pub(super) fn take_ird(
        &mut self,
        hdr: Header,
        ulpdu_len: usize,
    ) -> std::result::Result<(), Fault> {
        let HeaderKind::Untagged { msn, .. } = hdr.kind else {
            return Ok(());
        };
        let fault = |cause| Fault::at(cause, hdr, ulpdu_len);
        if msn != self.rreq_expect {
            return Err(fault(TermCause::DDP_UNTAGGED_MSN_RANGE));
        }
        // The MSN is in sequence, so this is no DDP MSN error: the request overruns the
        // RDMAP stream's inbound read resources (IRD, RFC 5040 §5.2/§6.4). As Linux siw does,
        // it is a Remote Operation Error, catastrophic to this stream (RFC 5040 §7.2).
        if self.ird_used >= self.ird {
            return Err(fault(TermCause::RDMAP_CATASTROPHIC_STREAM));
        }
        self.rreq_expect = self.rreq_expect.wrapping_add(1);
        self.ird_used += 1;
        Ok(())
    }

    /// The send-queue entry of the oldest request awaiting its answer.
    fn oldest_in_flight(&mut self) -> Option<&mut SqEntry> {
        let seq = *self.in_flight.front()?;
        self.entry_mut(seq)
    }

    /// The oldest request in flight got its (atomic or private) answer: it is done.
    fn answered(&mut self) {
        if let Some(ent) = self.oldest_in_flight() {
            ent.pending = Pending::Done;
            ent.status = Some(WcStatus::Success);
        }
        self.in_flight.pop_front();
    }

    pub(super) fn respond(&mut self, opcode: Opcode, body: &[u8]) {
        let hdr = Header::untagged(opcode, self.resp_msn, true);
        self.resp_msn = self.resp_msn.wrapping_add(1);
        self.tx.push_inline(hdr, body, OnSent::ResponseDone);
    }

    pub(super) fn on_control(
        &mut self,
        hdr: Header,
        body: Body,
        ulpdu_len: usize,
    ) -> std::result::Result<(), Fault> {
        let fault = |cause| Fault::at(cause, hdr, ulpdu_len);
        match body {
            Body::ReadRequest(rr) => {
                // Every fault on a Read Request quotes it (flag R, RFC 5040 §4.8).
                let quote = |f: Fault| f.with_rreq(rr);
                self.take_ird(hdr, ulpdu_len).map_err(quote)?;
                if rr.size as usize > self.max_message {
                    return Err(quote(fault(TermCause::RDMAP_OPERATION_UNSPECIFIED)));
                }
                let t = self
                    .lookup(rr.src_stag, rr.src_to, rr.size as u64, Access::REMOTE_READ)
                    .map_err(|f| quote(fault(status::rdmap_cause(f))))?;
                // Earlier Writes to make durable: this is an APM Read.
                let apm = match self.persist_dirty(hdr, ulpdu_len) {
                    Ok(apm) => apm,
                    Err(f) => {
                        self.counting.apm(rr.src_stag, false);
                        return Err(quote(f));
                    }
                };
                let rhdr = Header::tagged(Opcode::ReadResponse, rr.sink_stag, rr.sink_to, true);
                self.tx.push(TxMsg {
                    hdr: rhdr,
                    src: Src::Mem {
                        region: t.region,
                        offset: t.offset,
                        revocable: true,
                    },
                    len: rr.size as usize,
                    on_sent: OnSent::ResponseDone,
                });
                self.counting.read(rr.src_stag, rr.size);
                if apm {
                    self.counting.apm(rr.src_stag, true);
                }
            }
            Body::AtomicRequest(ar) => {
                self.take_ird(hdr, ulpdu_len)?;
                if ar.to % 8 != 0 {
                    return Err(fault(TermCause::RDMAP_BASE_BOUNDS));
                }
                let t = self
                    .lookup(ar.stag, ar.to, 8, Access::REMOTE_ATOMIC)
                    .map_err(|f| fault(status::rdmap_cause(f)))?;
                self.persist_dirty(hdr, ulpdu_len)?;
                let ptr = t.ptr();
                if !(ptr as usize).is_multiple_of(8) {
                    return Err(fault(TermCause::RDMAP_BASE_BOUNDS));
                }
                // SAFETY: `ptr` is 8-aligned and its 8 bytes lie inside registered memory kept
                // alive by `t.region` for this call. The `&AtomicU64` lives only for this
                // statement's operation; no other Rust reference into the memory exists (the
                // RegisteredMemory contract), but the bytes are racy RDMA-style memory: other
                // queue pairs may place into them with plain copies at the same time. Rust's
                // memory model does not define such a mixed race; verbs leaves its result
                // unspecified, and the fabric inherits that: a requester that races an atomic
                // with a Write to the same bytes gets no guarantee, here as on an RNIC.
                let cell = unsafe { AtomicU64::from_ptr(ptr as *mut u64) };
                let original = match ar.op {
                    AtomicOp::FetchAdd => placement::fetch_add(cell, ar.add_swap, ar.add_swap_mask),
                    AtomicOp::CompareSwap => placement::compare_swap(
                        cell,
                        ar.compare,
                        ar.compare_mask,
                        ar.add_swap,
                        ar.add_swap_mask,
                    ),
                };
                // The operation met a page the kernel could not give back (crate::sigbus): its
                // original value is the zeros put in the page's place, not the memory's.
                if t.region.revoked() {
                    return Err(fault(status::rdmap_cause(AccessFault::InvalidStag)));
                }
                self.dirty.add(&t.region, t.offset, 8);
                self.persist_dirty(hdr, ulpdu_len)?;
                let resp = AtomicResponse {
                    req_id: ar.req_id,
                    original,
                };
                self.respond(Opcode::AtomicResponse, &resp.encode());
                self.counting.atomic(ar.stag);
            }
            Body::AtomicWriteRequest(aw) => {
                self.take_ird(hdr, ulpdu_len)?;
                let t = self
                    .lookup(aw.stag, aw.to, 8, Access::REMOTE_WRITE)
                    .map_err(|f| fault(status::rdmap_cause(f)))?;
                let ptr = t.ptr();
                if aw.to % 8 != 0 || !(ptr as usize).is_multiple_of(8) {
                    return Err(fault(TermCause::RDMAP_BASE_BOUNDS));
                }
                // SAFETY: as for the atomics above: 8-aligned, in registered memory kept alive
                // by `t.region`, only raw pointers otherwise; concurrent non-atomic placement
                // by other queue pairs is the racy RDMA-style access the verbs model allows.
                let cell = unsafe { AtomicU64::from_ptr(ptr as *mut u64) };
                cell.store(u64::from_ne_bytes(aw.data), Ordering::Release);
                // As for the atomics above: the store went to a page put in place of one the
                // kernel could not give back.
                if t.region.revoked() {
                    return Err(fault(status::rdmap_cause(AccessFault::InvalidStag)));
                }
                self.dirty.add(&t.region, t.offset, 8);
                self.persist_dirty(hdr, ulpdu_len)?;
                let resp = PrivateResponse {
                    req_id: aw.req_id,
                    request: Opcode::AtomicWriteRequest,
                };
                self.respond(Opcode::PrivateResponse, &resp.encode());
                self.counting.atomic(aw.stag);
            }
            Body::FlushRequest(fr) => {
                self.take_ird(hdr, ulpdu_len)?;
                let need = match fr.placement {
                    FlushPlacement::Visibility => Access::FLUSH_VISIBILITY,
                    FlushPlacement::Persistent => Access::FLUSH_PERSISTENT,
                };
                let t = match fr.selectivity {
                    FlushSelectivity::Range { stag, to, len } => {
                        self.lookup(stag, to, len, need).map(|t| (t, len as usize))
                    }
                    FlushSelectivity::Region { stag } => match self.stags.lookup(stag) {
                        Some(e) => e
                            .check(self.domain.pd, self.qp_num, e.base, e.len, need)
                            .map(|t| (t, e.len as usize)),
                        None => Err(AccessFault::InvalidStag),
                    },
                }
                .map_err(|f| fault(status::rdmap_cause(f)))?;
                let stag = match fr.selectivity {
                    FlushSelectivity::Range { stag, .. } | FlushSelectivity::Region { stag } => {
                        stag
                    }
                };
                crate::steps::step("Flush: looked up, IRD taken");
                if let Err(f) = self.persist_dirty(hdr, ulpdu_len) {
                    self.counting.flush(stag, false);
                    return Err(f);
                }
                crate::steps::step("Flush: earlier Writes made durable");
                if fr.placement == FlushPlacement::Persistent
                    && t.1 > RX_BYTES
                    && t.0.region.persist().is_some_and(|p| p.domain().is_dax())
                {
                    // Written back a step per receive pass (`flush_step`): in one go, a whole
                    // large region's write-back held every other queue pair of the loop up
                    // (about 0.1 s per GiB). Not on page-cache, where each step's msync would
                    // be a whole fsync of the file (and a cache flush of its device).
                    self.flushing = Some(Flushing {
                        region: std::sync::Arc::clone(&t.0.region),
                        at: t.0.offset,
                        end: t.0.offset + t.1,
                        req_id: fr.req_id,
                        stag,
                        hdr,
                        ulpdu_len,
                    });
                    return Ok(());
                }
                if fr.placement == FlushPlacement::Persistent {
                    if let Some(p) = t.0.region.persist() {
                        // Called for an empty range too: it writes nothing back, but a failed
                        // store refuses it, and its answer would say durable.
                        let sw = Stopwatch::start();
                        let done = p.persist(t.0.offset, t.1);
                        if t.1 > 0 {
                            // Counted against the pass's byte budget (RX_BYTES).
                            self.rx_bytes += t.1;
                            match p.domain() {
                                Domain::PageCache => {
                                    self.counting.persisted(PersistKind::Msync, sw)
                                }
                                Domain::Dax | Domain::DaxForced => {
                                    self.counting.persisted(PersistKind::Writeback, sw)
                                }
                                _ => {}
                            }
                        }
                        if let Err(e) = done {
                            self.counting.flush(stag, false);
                            let f = fault(TermCause::RDMAP_CATASTROPHIC_STREAM);
                            return Err(f.with_persist(e));
                        }
                    }
                }
                crate::steps::step("Flush: its range written back");
                let resp = PrivateResponse {
                    req_id: fr.req_id,
                    request: Opcode::FlushRequest,
                };
                self.respond(Opcode::PrivateResponse, &resp.encode());
                self.counting.flush(stag, true);
            }
            Body::AtomicResponse(ar) => {
                let ent = self
                    .oldest_in_flight()
                    .ok_or_else(|| fault(TermCause::RDMAP_UNEXPECTED_OPCODE))?;
                match &ent.pending {
                    Pending::Atomic { req_id, result } if *req_id == ar.req_id => {
                        // `result` was checked at post time: 8 bytes with local write inside
                        // a region kept alive by the entry's Arc. An 8-aligned result is
                        // stored in one access (the owner may be reading it).
                        let v = ar.original.to_ne_bytes();
                        if let Some(dst) = result.region().slice(result.offset, 8) {
                            let _ = dst.write_at(0, &v);
                        }
                    }
                    _ => return Err(fault(TermCause::RDMAP_UNEXPECTED_OPCODE)),
                }
                self.answered();
            }
            Body::PrivateResponse(pr) => {
                let ent = self
                    .oldest_in_flight()
                    .ok_or_else(|| fault(TermCause::RDMAP_UNEXPECTED_OPCODE))?;
                match &ent.pending {
                    Pending::Private { req_id, request }
                        if *req_id == pr.req_id && *request == pr.request => {}
                    _ => return Err(fault(TermCause::RDMAP_UNEXPECTED_OPCODE)),
                }
                self.answered();
            }
            Body::ImmediateData(b) => {
                let HeaderKind::Untagged { msn, .. } = hdr.kind else {
                    return Ok(());
                };
                if msn != self.recv_msn {
                    return Err(fault(TermCause::DDP_UNTAGGED_MSN_RANGE));
                }
                self.recv_msn = self.recv_msn.wrapping_add(1);
                let Some(r) = self.rq.pop_front() else {
                    return Err(fault(TermCause::DDP_UNTAGGED_NO_BUFFER));
                };
                let mut c = self.recv_completion(r.wr_id, WcStatus::Success, 0);
                c.opcode = WcOpcode::RecvRdmaWithImm;
                c.imm = Some(u64::from_be_bytes(b) as u32);
                c.solicited = hdr.opcode == Opcode::ImmediateDataSe;
                self.recv_cq.push(c);
            }
            Body::Terminate(t) => {
                let status = status::status_for(t.cause);
                self.closing = false;
                let why = QpFailure::TerminateReceived {
                    code: terminate_code(t.cause),
                    status,
                };
                self.enter_error(why, Some(status));
            }
        }
        Ok(())
    }
}

impl rx::Placer for Engine {
    /// Decides where an FPDU's payload goes, after checking STag, bounds and rights: nothing is
    /// placed for a request that fails them (the receiver reports the refusal, and the engine
    /// answers with a Terminate).
    fn place(&mut self, hdr: &Header, len: usize) -> std::result::Result<rx::Placement, TermCause> {
        if self.state != QpState::Rts {
            return Ok(rx::Placement::Discard);
        }
        match self.check_placement(hdr, len) {
            // SAFETY: `check_placement` checked `len` bytes at `p` against the STag's range
            // and rights (or the posted Recv or Read sink). The memory stays alive until the
            // FPDU is reported (or the receiver fails, or the QP leaves RTS and stops polling
            // it): a Write's region by the Arc in `self.placing`, which only `on_data` (the
            // report) or the next `check_placement` (the next FPDU) releases, whatever the
            // MemoryRegion's owner does meanwhile; a Recv buffer or Read sink by the Sge's Arc
            // in the work request, which stays queued until the FPDU's report completes it.
            // Other parties may access the same registered memory concurrently, as with any
            // RDMA NIC (another queue pair placing, the owner copying out), which
            // DirectTarget's contract allows; none of them holds a Rust reference to it (the
            // RegisteredMemory and register_raw contracts).
            Ok(Some((p, writeback))) => {
                // SAFETY: as above.
                let t = unsafe { DirectTarget::new(p, len) };
                let t = match self.placing.as_ref().and_then(|w| w.file) {
                    // SAFETY: the descriptor belongs to the region's memory, a shared mapping
                    // of that file from offset 0 (`RegisteredMemory::placement_file`), and
                    // stays open while `self.placing` keeps the region alive (as above).
                    Some((fd, at)) => unsafe { t.into_file(fd, at) },
                    None if writeback => t.with_cache_writeback(),
                    None => t,
                };
                Ok(rx::Placement::Direct(t))
            }
            Ok(None) => Ok(rx::Placement::Discard),
            Err((cause, recv_status)) => {
                self.refused_recv_status = recv_status;
                Err(cause)
            }
        }
    }

    /// Writes a payload the receiver gathered into the target `place` chose, with the
    /// placement module's copies.
    fn write(&mut self, target: DirectTarget, payload: &[u8]) -> super::wire::Result<bool> {
        write_payload(target, payload)
    }

    /// A Write's region revoked while its payload was still arriving (CRC off): the rest is
    /// refused as its STag would be now, so that nothing lands in the memory (a namespace a
    /// reload removed, its file perhaps another subsystem's) after the revocation. A
    /// deregistration alone lets the FPDU finish (a departing host's last Write).
    fn recheck(&mut self, _: &Header) -> std::result::Result<(), TermCause> {
        match &self.placing {
            Some(p) if p.region.revoked() => Err(TermCause::DDP_TAGGED_INVALID_STAG),
            _ => Ok(()),
        }
    }
}

/// Where to place (and whether to write the bytes back from the cache as they are copied), or
/// the Terminate cause and the receive status of a refusal.
type PlaceResult = std::result::Result<Option<(*mut u8, bool)>, (TermCause, Option<WcStatus>)>;

impl Engine {
    pub(super) fn check_placement(&mut self, hdr: &Header, len: usize) -> PlaceResult {
        self.placing = None;
        match (hdr.opcode, hdr.kind) {
            // A zero-length Write places nothing. The peer-to-peer RTR (the first FPDU of a
            // connection that negotiated it) may name any STag; every other one is checked like
            // any Write, so that a flood of them with a bogus STag (before Connect nothing is
            // registered for this queue pair) ends at the first with a Terminate instead of
            // costing the target until a deadline.
            (Opcode::Write, HeaderKind::Tagged { .. }) if len == 0 && self.rtr_pending => Ok(None),
            (Opcode::Write, HeaderKind::Tagged { stag, to }) if len == 0 => {
                match self.lookup(stag, to, 0, Access::REMOTE_WRITE) {
                    Ok(_) => Ok(None),
                    Err(f) => Err((status::tagged_cause(f), None)),
                }
            }
            (Opcode::Write, HeaderKind::Tagged { stag, to }) => {
                match self.lookup(stag, to, len as u64, Access::REMOTE_WRITE) {
                    Ok(t) => {
                        // Dax memory: ask the receiver to write the bytes back as it copies
                        // them (non-temporal stores); `on_data` records what it did. Not under
                        // the power-loss simulation: only a persist of the range reaches it.
                        let dax = t.region.persist().is_some_and(|p| p.durable_by_writeback());
                        let ptr = t.ptr();
                        if !dax {
                            self.dirty.add(&t.region, t.offset, len);
                        }
                        // A page-cache file: written with pwrite where a store would fault
                        // (the first placement after a write-back), stored into elsewhere.
                        let file = t
                            .region
                            .placement_file(t.offset, len)
                            .map(|fd| (fd, t.offset as u64));
                        // Held until `on_data`: the receiver keeps only `ptr`, possibly across
                        // several polls, and the STag entry may be gone before then.
                        self.placing = Some(Placing {
                            region: t.region,
                            offset: t.offset,
                            len,
                            writeback: dax,
                            file,
                        });
                        Ok(Some((ptr, dax)))
                    }
                    Err(f) => Err((status::tagged_cause(f), None)),
                }
            }
            (Opcode::ReadResponse, HeaderKind::Tagged { stag, to }) => {
                let head = self.in_flight.front().copied();
                let ent = head.and_then(|s| self.entry_mut(s));
                let Some(SqEntry {
                    pending: Pending::Read { sink, got },
                    ..
                }) = ent
                else {
                    return Err((TermCause::RDMAP_UNEXPECTED_OPCODE, None));
                };
                let expect_to = sink.addr() + *got as u64;
                if stag != sink.lkey() || to != expect_to || *got + len > sink.len {
                    return Err((TermCause::DDP_TAGGED_BASE_BOUNDS, None));
                }
                Ok(Some((
                    sink.region().addr().wrapping_add(sink.offset + *got),
                    false,
                )))
            }
            (
                Opcode::Send | Opcode::SendSe | Opcode::SendInvalidate | Opcode::SendSeInvalidate,
                HeaderKind::Untagged { msn, mo, .. },
            ) => {
                if mo == 0 && self.cur_recv.is_none() {
                    if msn != self.recv_msn {
                        return Err((TermCause::DDP_UNTAGGED_MSN_RANGE, None));
                    }
                    let Some(entry) = self.rq.pop_front() else {
                        return Err((TermCause::DDP_UNTAGGED_NO_BUFFER, None));
                    };
                    self.recv_msn = self.recv_msn.wrapping_add(1);
                    self.cur_recv = Some(CurRecv {
                        entry,
                        msn,
                        placed: 0,
                    });
                }
                let Some(cur) = self.cur_recv.as_mut() else {
                    return Err((TermCause::DDP_UNTAGGED_INVALID_MO, None));
                };
                if cur.msn != msn || cur.placed != mo as usize {
                    return Err((TermCause::DDP_UNTAGGED_INVALID_MO, None));
                }
                let cap = cur.entry.local.as_ref().map_or(0, |s| s.len);
                if mo as usize + len > cap {
                    return Err((
                        TermCause::DDP_UNTAGGED_TOO_LONG,
                        Some(WcStatus::LocalLength),
                    ));
                }
                cur.placed += len;
                Ok(match &cur.entry.local {
                    Some(s) if len > 0 => Some((
                        s.region().addr().wrapping_add(s.offset + mo as usize),
                        false,
                    )),
                    _ => None,
                })
            }
            _ => Err((TermCause::RDMAP_UNEXPECTED_OPCODE, None)),
        }
    }
}
