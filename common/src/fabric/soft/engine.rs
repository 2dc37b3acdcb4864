//! The engine of one soft queue pair: its state, and what requester and responder share
//! (completions in order, the move to Error, Terminates, driving the socket).

use std::collections::VecDeque;
use std::net::TcpStream;
use std::sync::Arc;

use super::device::StagTable;
use super::outbound::{OnSent, Tx};
use super::placement::{Counting, Dirty};
use super::status;
use super::wire::rdmap::ReadRequest;
use super::wire::rx::{Delivered, FpduReceiver};
use super::wire::{Header, Opcode, TermCause, Terminate, WireError};
use crate::fabric::completions::Completions;
use crate::fabric::error::{Error, QpFailure, TerminateCode, TerminateLayer};
use crate::fabric::memory::Region;
use crate::fabric::params::ConnInfo;
use crate::fabric::types::{Completion, DomainId, QpCaps, QpState, SendFlags, WcOpcode, WcStatus};
use crate::fabric::wr::{SendOp, Sge};

/// How many FPDUs one progress call handles before it lets other queue pairs run ...
const RX_BUDGET: usize = 256;

/// ... and how many bytes of a peer's Writes they may carry, with those a Flush among them made
/// durable: a peer sending FPDUs of 64 KiB (the largest ULPDU taken) had one pass place 12 MB
/// while the loop's other connections waited (an honest initiator's FPDUs, of its path MTU,
/// come to a few hundred KB in 256), and a peer's Flushes of a whole region on dax wrote back
/// as many lines as it named, eight to a pass.
pub(super) const RX_BYTES: usize = 1 << 20;

/// How many answers (Read Responses, Flush and Atomic responses, Terminates) a receive pass
/// queues before it returns so that they are written: the peer starts on the first ones while
/// the rest are prepared. Sixteen 4 KiB Read Requests arriving together were answered in one
/// `writev` of 64 KiB, and the two processes took turns instead of working side by side (1.62x
/// to 1.71x the random reads at depth 16 and 64 when answered by eights: docs/benchmarks.md,
/// "Answering by eights"). Linux's nvmet-tcp alternates receiving and sending by 8 too.
pub(super) const ANSWER_BATCH: usize = 8;

/// What a send-queue entry still needs from the wire.
pub(super) enum Pending {
    /// Not started: the operation as posted.
    Unissued(SendOp),
    /// Handed to tx; completes when written (Write, Send).
    Sending,
    /// Waiting for a Read Response into `sink`.
    Read { sink: Sge, got: usize },
    /// Waiting for an Atomic Response; the original value goes to `result`.
    Atomic { req_id: u32, result: Sge },
    /// Waiting for the private response to a Flush or Atomic Write.
    Private { req_id: u32, request: Opcode },
    /// Done.
    Done,
}

pub(super) struct SqEntry {
    pub(super) seq: u64,
    pub(super) wr_id: u64,
    pub(super) opcode: WcOpcode,
    pub(super) flags: SendFlags,
    pub(super) byte_len: u32,
    pub(super) status: Option<WcStatus>,
    pub(super) pending: Pending,
}

pub(super) struct RqEntry {
    pub(super) wr_id: u64,
    pub(super) local: Option<Sge>,
}

/// The Send being received (its segments share one MSN).
pub(super) struct CurRecv {
    pub(super) entry: RqEntry,
    pub(super) msn: u32,
    pub(super) placed: usize,
}

/// A fatal condition found while placing, to be answered with a Terminate once the FPDU is in.
pub(super) struct Fault {
    pub(super) cause: TermCause,
    /// The offending segment: its MPA length and DDP/RDMAP header bytes.
    pub(super) offending: Option<(u16, Vec<u8>)>,
    pub(super) recv_status: Option<WcStatus>,
    /// The offending RDMA Read Request, quoted with flag R (RFC 5040 §4.8).
    pub(super) rreq: Option<ReadRequest>,
    /// The persist that failed before a response could leave (the durability contract): it
    /// becomes part of the queue pair's error, errno included.
    /// Boxed: rare, and it would double the size of every `Result<_, Fault>`.
    pub(super) persist: Option<Box<crate::pmem::Error>>,
}

impl Fault {
    pub(super) fn at(cause: TermCause, hdr: Header, ulpdu_len: usize) -> Fault {
        Fault {
            cause,
            offending: Some((ulpdu_len as u16, hdr.encode().as_slice().to_vec())),
            recv_status: None,
            rreq: None,
            persist: None,
        }
    }

    /// The fault was found on Read Request `rr`: the Terminate quotes it.
    pub(super) fn with_rreq(mut self, rr: ReadRequest) -> Fault {
        self.rreq = Some(rr);
        self
    }

    /// The fault is a failed persist: the queue pair's error carries it.
    pub(super) fn with_persist(mut self, e: crate::pmem::Error) -> Fault {
        self.persist = Some(Box::new(e));
        self
    }
}

pub(crate) struct Engine {
    pub(super) qp_num: u32,
    /// The protection domain: local buffers and STags must be of it.
    pub(super) domain: DomainId,
    /// The device's STag table, where peers' rkeys are looked up.
    pub(super) stags: Arc<StagTable>,
    pub(super) send_cq: Arc<Completions>,
    pub(super) recv_cq: Arc<Completions>,
    pub(super) caps: QpCaps,
    pub(super) state: QpState,
    pub(super) error: Option<QpFailure>,
    pub(super) info: Option<ConnInfo>,
    pub(super) tx: Tx,
    pub(super) closing: bool,
    pub(super) max_message: usize,
    // Requester.
    pub(super) sq: VecDeque<SqEntry>,
    pub(super) next_seq: u64,
    pub(super) next_issue: u64,
    pub(super) in_flight: VecDeque<u64>,
    pub(super) ord: usize,
    pub(super) send_msn: u32,
    pub(super) rreq_msn: u32,
    pub(super) next_req_id: u32,
    // Responder.
    pub(super) rq: VecDeque<RqEntry>,
    pub(super) cur_recv: Option<CurRecv>,
    pub(super) recv_msn: u32,
    pub(super) rreq_expect: u32,
    pub(super) resp_msn: u32,
    pub(super) ird: usize,
    pub(super) ird_used: usize,
    pub(super) dirty: Dirty,
    /// The Write FPDU being placed: set by `check_placement`, taken by `on_data` when the FPDU
    /// is reported. It holds the region's Arc for the whole FPDU, because the receiver keeps
    /// only a raw pointer into it across `WouldBlock` (and the MemoryRegion, with its STag
    /// entry, may be dropped by another thread meanwhile).
    pub(super) placing: Option<Placing>,
    /// The receive status for the Recv whose Send the placer just refused (LocalLength).
    pub(super) refused_recv_status: Option<WcStatus>,
    /// What this queue pair served as the responder (its `ResponderCounters`' only writer).
    pub(super) counting: Counting,
    /// The next FPDU may be a peer-to-peer RTR (a zero-length Write naming any STag): set at
    /// connection for a passive side that negotiated it, cleared by the first FPDU.
    pub(super) rtr_pending: bool,
    /// The last receive pass returned with an FPDU or more still buffered (its answers went
    /// out first, or its budget was spent): the socket will not say so, so the idle wait must
    /// not block before the next pass.
    pub(super) rx_held: bool,
    /// Bytes of payload placed, and made durable by Flushes, in this receive pass
    /// ([`RX_BYTES`]).
    pub(super) rx_bytes: usize,
    /// FPDUs taken from the peer so far (Writes, Read Requests, Sends, responses): what
    /// [`SoftQp::fpdus_received`](super::qp::SoftQp::fpdus_received) reports.
    pub(super) fpdus_in: u64,
    /// A Persistent Flush of more than [`RX_BYTES`] being made durable, a step per receive
    /// pass; nothing after it is taken from the peer until it is answered.
    pub(super) flushing: Option<Flushing>,
}

/// A large Persistent Flush in progress (see `Engine::flushing`).
pub(super) struct Flushing {
    /// The region flushed, kept alive until the answer.
    pub(super) region: Arc<Region>,
    /// The next byte to make durable, and the end.
    pub(super) at: usize,
    pub(super) end: usize,
    pub(super) req_id: u32,
    pub(super) stag: u32,
    /// The request's header and length, for a Terminate if a step fails.
    pub(super) hdr: Header,
    pub(super) ulpdu_len: usize,
}

/// A Write FPDU in placement (see `Engine::placing`).
pub(super) struct Placing {
    /// Keeps the registered memory alive until the FPDU is reported.
    pub(super) region: Arc<Region>,
    pub(super) offset: usize,
    pub(super) len: usize,
    /// The receiver was asked to write the bytes back from the cache as it copies them (dax):
    /// `on_data` records them as needing only a fence, or as dirty if it could not.
    pub(super) writeback: bool,
    /// The region's page-cache file and the offset in it to `pwrite` the payload at, instead
    /// of copying it into the mapping (`RegisteredMemory::placement_file`).
    pub(super) file: Option<(std::os::fd::RawFd, u64)>,
}

pub(super) struct Conn {
    pub(super) sock: TcpStream,
    pub(super) rx: FpduReceiver,
    /// Pollers this socket is registered with, and whether writability is armed there: a
    /// queue pair's send and receive completion queues', in place (the first idle wait of a
    /// connection allocated here, on its data path).
    pub(super) armed: smallvec::SmallVec<[(usize, bool); 2]>,
    /// In Error, after our last bytes went out: our side is shut and we read (and drop) what
    /// the peer still sends until it closes or this deadline passes. Closing with unread
    /// input would reset the connection and could destroy our Terminate before the peer reads it.
    pub(super) draining: Option<std::time::Instant>,
}

impl Engine {
    pub(super) fn entry_mut(&mut self, seq: u64) -> Option<&mut SqEntry> {
        let front = self.sq.front()?.seq;
        self.sq.get_mut(seq.checked_sub(front)? as usize)
    }

    /// Writes what is queued, at most `budget` bytes: the rest waits for the next progress
    /// call, after the other queue pairs of the completion queue had their turn. A Read
    /// Response whose region was revoked while it waited (a reload removed the namespace
    /// while the peer was not reading) is not sent: the stream is terminated with an RDMAP
    /// Invalid STag (the peer's Read fails with a remote access error), as a Read Request for
    /// that rkey would be from then on; or, if an FPDU of it was partly written, the connection
    /// ends there (the peer's Read fails as on a connection loss, never with a success).
    pub(super) fn write(&mut self, conn: &mut Conn, budget: usize) {
        self.write_some(conn, budget);
        if self.tx.revoked() {
            if self.state == QpState::Rts && !self.tx.partial_revoked() {
                self.terminate(Fault {
                    cause: TermCause::RDMAP_INVALID_STAG,
                    offending: None,
                    recv_status: None,
                    rreq: None,
                    persist: None,
                });
            } else {
                self.tx.drop_revoked();
            }
            self.write_some(conn, budget);
        }
        if self.tx.cut_short() {
            // Nothing more to send: the queue pair closes its connection at once (after its
            // drain), with its stream ended in the middle of the FPDU.
            self.closing = false;
            self.enter_error(
                QpFailure::Link {
                    op: "sending",
                    source: Arc::new(std::io::Error::other(
                        "a Read Response's region was revoked (or a page of it could not be \
                         read) in the middle of an FPDU: the stream ends there",
                    )),
                },
                None,
            );
        }
    }

    fn write_some(&mut self, conn: &mut Conn, budget: usize) {
        let mut done: smallvec::SmallVec<[OnSent; 8]> = smallvec::SmallVec::new();
        let r = self.tx.flush(&mut conn.sock, budget, |o| done.push(o));
        for o in done {
            match o {
                OnSent::Complete(seq) => {
                    if let Some(ent) = self.entry_mut(seq) {
                        if matches!(ent.pending, Pending::Sending) {
                            ent.pending = Pending::Done;
                            ent.status.get_or_insert(WcStatus::Success);
                        }
                    }
                }
                OnSent::ResponseDone => self.ird_used = self.ird_used.saturating_sub(1),
                OnSent::Nothing => {}
            }
        }
        if let Err(err) = r {
            self.tx.abort_queued();
            self.closing = false;
            self.enter_error(
                QpFailure::Link {
                    op: "sending",
                    source: Arc::new(err),
                },
                None,
            );
        }
    }

    /// Moves completed entries from the head of the send queue to the CQ (in order).
    pub(super) fn complete_in_order(&mut self) {
        while let Some(front) = self.sq.front() {
            let Some(status) = front.status else { return };
            let ent = self.sq.pop_front().expect("front exists");
            if status != WcStatus::Success || ent.flags.contains(SendFlags::SIGNALED) {
                let len = if status == WcStatus::Success {
                    ent.byte_len
                } else {
                    0
                };
                let mut c = self.recv_completion(ent.wr_id, status, len as usize);
                c.opcode = ent.opcode;
                self.send_cq.push(c);
            }
        }
    }

    /// The queue pair goes to Error: the oldest outstanding send request gets `head_status`
    /// (if given), everything else WrFlush.
    pub(super) fn enter_error(&mut self, why: QpFailure, head_status: Option<WcStatus>) {
        if self.state == QpState::Error {
            return;
        }
        self.state = QpState::Error;
        self.error = Some(why);
        // A large Flush in progress is not answered (nor its region kept alive) any more.
        self.flushing = None;
        // Nor is the receiver polled again: the region of a Write it was placing is let go.
        self.placing = None;
        // The oldest unfinished request gets the error; every later one (also those done but
        // waiting behind it, whose effect at the peer is now uncertain) is flushed.
        let mut head = head_status;
        let mut behind = false;
        for ent in self.sq.iter_mut() {
            if ent.status.is_some() && !behind {
                continue;
            }
            ent.status = Some(match head.take() {
                Some(st) if !behind => st,
                _ => WcStatus::WrFlush,
            });
            behind = true;
            ent.pending = Pending::Done;
        }
        self.next_issue = self.next_seq;
        self.in_flight.clear();
        let qp_num = self.qp_num;
        let flush = |wr_id| completion(qp_num, wr_id, WcStatus::WrFlush, 0);
        if let Some(cur) = self.cur_recv.take() {
            self.recv_cq.push(flush(cur.entry.wr_id));
        }
        for r in self.rq.drain(..) {
            self.recv_cq.push(flush(r.wr_id));
        }
    }

    /// Sends a Terminate for `f` and moves to Error.
    pub(super) fn terminate(&mut self, f: Fault) {
        let mut t = Terminate::new(f.cause);
        if let Some((len, hdr)) = &f.offending {
            t = t.with_ddp(*len, hdr);
        }
        t.rreq = f.rreq;
        self.tx.abort_queued();
        self.counting
            .terminated(status::terminate_cause(f.cause, f.persist.is_some()));
        let hdr = Header::untagged(Opcode::Terminate, 1, true);
        let body = t.encode();
        self.tx.push_inline(hdr, &body, OnSent::Nothing);
        self.closing = true;
        if let (Some(st), Some(cur)) = (f.recv_status, self.cur_recv.take()) {
            let c = self.recv_completion(cur.entry.wr_id, st, 0);
            self.recv_cq.push(c);
        }
        let code = terminate_code(f.cause);
        let why = match f.persist {
            None => QpFailure::TerminateSent { code },
            Some(e) => QpFailure::PersistFailed {
                code,
                source: Arc::from(e),
            },
        };
        self.enter_error(why, None);
    }

    /// Reads the socket and handles what arrived, up to `RX_BUDGET` FPDUs. Returns whether
    /// that queued an answer (a Read Response, a Flush's or an atomic's response, a
    /// Terminate): a peer waiting on us, which keeps the completion queue's busy-poll spell
    /// going although nothing completes here. One-sided Writes alone do not: their sender waits
    /// for nothing, and a target that slept between them left the CPU to the processes that
    /// produce them (measured in docs/benchmarks.md, "A spell counted from the last message").
    pub(super) fn receive(&mut self, conn: &mut Conn) -> bool {
        let queued = self.tx.queued_messages();
        self.receive_fpdus(conn);
        self.tx.queued_messages() > queued
    }

    fn receive_fpdus(&mut self, conn: &mut Conn) {
        self.rx_held = false;
        self.rx_bytes = 0;
        if !self.flush_step() {
            // This pass's step of a large Flush is done: the other queue pairs' turn.
            self.rx_held = true;
            return;
        }
        let answers = self.tx.queued_messages() + ANSWER_BATCH;
        for _ in 0..RX_BUDGET {
            if self.state != QpState::Rts {
                return;
            }
            match conn.rx.poll(&mut conn.sock, self) {
                Ok(Some(r)) => {
                    crate::steps::nth(&crate::steps::FPDU_TAKEN);
                    self.fpdus_in = self.fpdus_in.wrapping_add(1);
                    self.rtr_pending = false;
                    let (hdr, ulpdu_len, len) = (r.header, r.ulpdu_len, r.payload_len);
                    match r.data {
                        Delivered::Control(body) => {
                            if let Err(f) = self.on_control(hdr, body, ulpdu_len) {
                                self.terminate(f);
                            }
                        }
                        _ => self.on_data(hdr, len, r.written_back),
                    }
                    crate::steps::nth(&crate::steps::FPDU_HANDLED);
                    // A large Flush started: it goes on in the next passes, and nothing after
                    // it is taken before its answer.
                    if self.flushing.is_some() {
                        self.rx_held = true;
                        return;
                    }
                    // A peer's Writes (Read Responses answer this side's own Reads, which
                    // it sized and bounded itself: not counted, their passes stay long).
                    if hdr.opcode == Opcode::Write {
                        self.rx_bytes += len;
                    }
                    // Nothing more buffered: let the caller write the answers and report the
                    // completions now rather than after one more read that would likely block.
                    if conn.rx.is_idle() {
                        return;
                    }
                    // This pass's bytes are spent: the other queue pairs' turn.
                    if self.rx_bytes >= RX_BYTES {
                        self.rx_held = true;
                        return;
                    }
                    // A batch of answers is ready: written now, the peer works on them while
                    // the next pass prepares the rest (ANSWER_BATCH).
                    if self.tx.queued_messages() >= answers {
                        self.rx_held = true;
                        return;
                    }
                }
                Ok(None) => return,
                Err(WireError::Closed { .. }) => {
                    self.enter_error(QpFailure::PeerClosed, None);
                    return;
                }
                Err(WireError::Io { source, .. }) => {
                    let source = Arc::new(source);
                    self.enter_error(
                        QpFailure::Link {
                            op: "receiving",
                            source,
                        },
                        None,
                    );
                    return;
                }
                Err(e) => {
                    let offending = conn.rx.offending_segment().map(|(l, h)| (l, h.to_vec()));
                    let recv_status = self.refused_recv_status.take();
                    self.terminate(Fault {
                        cause: e.terminate_cause(),
                        offending,
                        recv_status,
                        rreq: None,
                        persist: None,
                    });
                    return;
                }
            }
        }
        // The budget is spent: what is still buffered waits for the next pass.
        self.rx_held = !conn.rx.is_idle();
    }

    /// A completion of this queue pair, as a receive (callers change the opcode for sends).
    pub(super) fn recv_completion(&self, wr_id: u64, status: WcStatus, len: usize) -> Completion {
        completion(self.qp_num, wr_id, status, len)
    }
}

/// A receive completion of queue pair `qp_num`.
fn completion(qp_num: u32, wr_id: u64, status: WcStatus, len: usize) -> Completion {
    Completion {
        wr_id,
        status,
        opcode: WcOpcode::Recv,
        byte_len: len as u32,
        imm: None,
        invalidated_rkey: None,
        solicited: false,
        qp_num,
    }
}

/// A Terminate's cause as the fabric's neutral layer names it.
pub(super) fn terminate_code(c: TermCause) -> TerminateCode {
    use super::wire::Layer;
    TerminateCode {
        layer: match c.layer {
            Layer::Rdmap => TerminateLayer::Rdmap,
            Layer::Ddp => TerminateLayer::Ddp,
            Layer::Mpa => TerminateLayer::Mpa,
        },
        etype: c.etype,
        ecode: c.ecode,
    }
}

pub(super) fn fail(qp_num: u32, state: QpState, op: &'static str, needed: QpState) -> Error {
    Error::InvalidState {
        qp_num,
        state,
        op,
        needed,
    }
}
