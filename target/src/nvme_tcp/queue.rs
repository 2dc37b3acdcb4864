//! One NVMe/TCP connection (one queue of a controller) as a sans-I/O state machine: the poll
//! loop reads bytes into [`Queue::recv_space`], calls [`Queue::received`], writes out
//! [`Queue::pending_tx`] and carries out the [`Effect`]s (device flushes) it asks for; the
//! queue never touches a socket.
//!
//! ```text
//! AwaitIcReq --ICReq--> AwaitConnect --Connect(qid 0)--> Admin | Discovery
//!                                    --Connect(qid n)--> Io
//! any fatal transport error: C2HTermReq, then closed; a refused Connect: its completion, then closed
//! ```
//!
//! # What a peer can make it hold
//!
//! Before its Connect a connection holds its place in the unadmitted pool, a receive buffer of
//! at most one admin command capsule (8 KiB of in-capsule data, [`IN_CAPSULE_DATA`]) and a few
//! bytes to send; it may send exactly one ICReq and one command, which must be a Connect (anything
//! else is a sequence error, answered and closed; a Connect not accepted, whatever the reason,
//! is answered and closed too), before [`Queue::deadline`]. An H2CData PDU is
//! checked against the R2T it answers from its header alone, before its data is buffered. After
//! its Connect a queue buffers at most one PDU ([`MAXH2CDATA`] of data) and stops reading while
//! more than [`TX_HIGH`] bytes wait to be sent: a host that does not read its completions stops
//! being served, it does not grow the target's memory. Commands waiting for their data or for a
//! flush are bounded by the queue size the host connected with.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rpma_common::proto::RefusalReason;

use super::command::{self, DataIn, Sqe, Status};
use super::pdu::{self, C2hFraming, Fatal, Fes, Framed, Limits, Pdu};
use super::state::{Input, Phase, Transfer, Wait};
use super::Ctx;
use crate::flusher::FlushTarget;
use crate::metrics::{EndReason, HandshakeFailure, LoopStats};
use crate::serve::{budget::Ticket, LogClass, LoopTx};

/// In-capsule data accepted (IOCCSZ is this plus the 64-byte command; the Linux host sends
/// every Fabrics command, Connect included, with up to 8 KiB in the capsule on any queue).
pub const IN_CAPSULE_DATA: u32 = 8192;
/// MDTS: the largest transfer, 2^5 pages of 4 KiB.
pub const MDTS: u8 = 5;
/// The largest transfer in bytes.
pub const MAX_TRANSFER: u32 = 4096 << MDTS;
/// MAXH2CDATA offered in the ICResp: the most data per H2CData PDU, so the most a queue buffers.
/// The largest transfer, so that an R2T never asks for more than one PDU may carry: Linux hosts
/// before 5.16 sent one H2CData PDU per R2T whatever the MAXH2CDATA (64 KiB here before: their
/// Writes of 64-128 KiB were terminated, and the host reconnected for ever). Linux's nvmet
/// offers 4 MiB.
pub const MAXH2CDATA: u32 = MAX_TRANSFER;
/// Above this many bytes waiting to be sent, a queue stops taking in commands.
pub const TX_HIGH: usize = 256 * 1024;
/// Bytes a queue may zero (Write Zeroes, deallocations) in one turn of its loop: past it, what
/// it received waits for the loop's next turn (which comes at once), after the other
/// connections' turn, as the tcp fabric's receive budget does (docs/fabric.md, "Fair share of
/// the receive side"). At least the largest single command (8 MiB of deallocation).
pub const ZERO_BUDGET: u64 = 8 << 20;
/// How long a connection lingers after its last message (a refusal, a TermReq) so the host
/// reads it.
pub const LINGER: Duration = Duration::from_secs(2);
/// Spare room in the receive buffer beyond the PDU being read, so that several small PDUs
/// come in with one read.
const RX_SLACK: usize = 16 * 1024;
/// Receive buffer kept while idle.
const RX_IDLE: usize = 4096;

/// What a queue asks of its poll loop.
#[derive(Debug)]
pub(crate) enum Effect {
    /// Make `[offset, offset + len)` of `target` durable (`len` 0: all of it) and call
    /// [`Queue::flush_done`] with `token`.
    Flush {
        /// Identifies the completion.
        token: u64,
        /// The namespace.
        target: FlushTarget,
        /// Start.
        offset: u64,
        /// Length.
        len: u64,
    },
    /// A controller died: every loop should look at its I/O queues now.
    WakeAll,
}

/// What a queue works with, lent by its poll loop for one call.
pub(crate) struct Env<'a> {
    pub(crate) ctx: &'a Arc<Ctx>,
    pub(crate) now: Instant,
    /// The connection being served (its effects are tagged with it).
    pub(crate) conn: u64,
    pub(crate) effects: &'a mut Vec<(u64, Effect)>,
    pub(crate) next_token: &'a mut u64,
    pub(crate) owner: &'a LoopTx,
    pub(crate) stats: &'a LoopStats,
}

impl Env<'_> {
    pub(super) fn token(&mut self) -> u64 {
        *self.next_token += 1;
        *self.next_token
    }

    pub(crate) fn effect(&mut self, e: Effect) {
        self.effects.push((self.conn, e));
    }
}

/// Whether a command moves data to the controller (1), from it (2), or none (0), by the low
/// bits of its opcode (of its FCTYPE for a Fabrics command).
fn direction(sqe: &Sqe) -> u8 {
    if sqe.opcode() == command::FABRICS {
        sqe.fctype() & 3
    } else {
        sqe.opcode() & 3
    }
}

/// One connection.
pub(crate) struct Queue {
    pub(crate) peer: SocketAddr,
    pub(crate) local: SocketAddr,
    pub(crate) phase: Phase,
    pub(crate) limits: Limits,
    pub(crate) c2h: C2hFraming,
    pub(super) rx: Vec<u8>,
    pub(super) rx_start: usize,
    pub(super) rx_end: usize,
    /// Bytes the PDU at the front of `rx` needs in all.
    pub(super) rx_needs: usize,
    pub(super) tx: Vec<u8>,
    pub(super) tx_sent: usize,
    /// Entries of the submission queue (set at Connect; 1 before).
    pub(crate) sq_entries: u16,
    pub(super) sqhd: u16,
    /// The host disabled SQ flow control: a read's data carries the SUCCESS flag instead of a
    /// completion.
    pub(crate) sqflow_off: bool,
    pub(super) transfers: HashMap<u16, Transfer>,
    pub(super) next_ttag: u16,
    pub(super) waits: HashMap<u64, Wait>,
    pub(super) tokens: HashMap<u64, u64>,
    pub(super) next_wait: u64,
    /// Until the Connect: when the handshake time is up.
    pub(crate) deadline: Instant,
    pub(super) closing: Option<Instant>,
    /// The queue's place in the unadmitted (or discovery) pool.
    pub(crate) ticket: Option<Ticket>,
    /// The session's end was counted.
    pub(super) ended: bool,
    /// Bytes zeroed in this turn of the loop (see [`ZERO_BUDGET`]).
    pub(super) zeroed: u64,
    /// The socket is done: its peer closed it or it failed. Nothing more comes in or goes out,
    /// and its loop stops watching it (epoll reports a hang-up or an error whatever the
    /// interest: watched, a queue still waiting for a flush would be woken at every wait).
    pub(crate) socket_done: bool,
}

impl Queue {
    /// A new connection from `peer`, holding `ticket`, with `handshake` to finish its Connect.
    pub(crate) fn new(
        peer: SocketAddr,
        local: SocketAddr,
        ticket: Ticket,
        now: Instant,
        handshake: Duration,
    ) -> Queue {
        Queue {
            peer,
            local,
            phase: Phase::AwaitIcReq,
            limits: Limits::ICREQ,
            c2h: C2hFraming {
                hdgst: false,
                ddgst: false,
                hpda: 0,
            },
            rx: vec![0; pdu::IC_LEN],
            rx_start: 0,
            rx_end: 0,
            rx_needs: pdu::IC_LEN,
            tx: Vec::new(),
            tx_sent: 0,
            sq_entries: 1,
            sqhd: 0,
            sqflow_off: false,
            transfers: HashMap::new(),
            next_ttag: 0,
            waits: HashMap::new(),
            tokens: HashMap::new(),
            next_wait: 0,
            deadline: now + handshake,
            closing: None,
            ticket: Some(ticket),
            ended: false,
            zeroed: 0,
            socket_done: false,
        }
    }

    /// Whether it has been admitted (its Connect succeeded).
    pub(crate) fn connected(&self) -> bool {
        matches!(
            self.phase,
            Phase::Admin(_) | Phase::Io(_) | Phase::Discovery(_)
        )
    }

    /// Whether it still reads from its socket: not closing, not too much to send, and its
    /// zeroing budget for this turn not spent.
    pub(crate) fn wants_read(&self) -> bool {
        self.closing.is_none()
            && self.tx.len() - self.tx_sent < TX_HIGH
            && self.zeroed < ZERO_BUDGET
    }

    /// Whether it spent its zeroing budget in this turn: what it received waits, and the loop
    /// starts its next turn at once (without waiting in epoll, which does not see those bytes).
    pub(crate) fn spent(&self) -> bool {
        self.closing.is_none() && self.zeroed >= ZERO_BUDGET
    }

    /// A new turn of its loop: the budget is back, and what waited for it is handled.
    pub(crate) fn new_turn(&mut self, env: &mut Env<'_>) {
        let waited = self.spent();
        self.zeroed = 0;
        if waited {
            self.process(env);
        }
    }

    /// Whether it is closing and has nothing left to send or wait for (drop it), or its linger
    /// is over.
    pub(crate) fn finished(&self, now: Instant) -> bool {
        self.closing
            .is_some_and(|t| now >= t || (self.tx_sent == self.tx.len() && self.waits.is_empty()))
    }

    /// Where the next bytes from the socket go (empty when it should not read now).
    pub(crate) fn recv_space(&mut self) -> &mut [u8] {
        if !self.wants_read() {
            return &mut [];
        }
        if self.rx_start == self.rx_end {
            self.rx_start = 0;
            self.rx_end = 0;
        }
        &mut self.rx[self.rx_end..]
    }

    /// `n` bytes arrived in [`recv_space`](Self::recv_space): handle every whole PDU.
    pub(crate) fn received(&mut self, n: usize, env: &mut Env<'_>) {
        self.rx_end = (self.rx_end + n).min(self.rx.len());
        self.process(env);
    }

    /// Handles what was received, as far as the send backlog allows (call again once it
    /// drained).
    pub(crate) fn process(&mut self, env: &mut Env<'_>) {
        let rx = std::mem::take(&mut self.rx);
        let mut at = self.rx_start;
        while self.wants_read() && at < self.rx_end {
            let input = &rx[at..self.rx_end];
            if let Some(f) = self.check_h2c_header(input) {
                self.fatal(f, input, env);
                break;
            }
            match pdu::frame(input, &self.limits) {
                Framed::NeedMore(need) => {
                    self.rx_needs = need;
                    break;
                }
                Framed::Fatal(f) => {
                    self.fatal(f, input, env);
                    break;
                }
                Framed::Pdu(p, used) => {
                    let hlen = usize::from(input[2]).clamp(pdu::CH_LEN, used);
                    self.on_pdu(p, &input[..hlen], env);
                    at += used;
                    self.rx_needs = pdu::CH_LEN;
                }
            }
        }
        self.rx = rx;
        self.rx_start = at;
        self.size_rx();
    }

    /// Makes room in the receive buffer for the PDU at its front (and, once connected, some
    /// slack), moving what is there to its start.
    pub(super) fn size_rx(&mut self) {
        if self.closing.is_some() {
            self.rx = Vec::new();
            return;
        }
        let held = self.rx_end - self.rx_start;
        let slack = if self.connected() { RX_SLACK } else { 0 };
        let floor = if matches!(self.phase, Phase::AwaitIcReq) {
            pdu::IC_LEN
        } else {
            RX_IDLE
        };
        let want = self.rx_needs.max(held).max(floor) + slack;
        if self.rx.len() - self.rx_start >= self.rx_needs.max(floor) && self.rx.len() >= want / 2 {
            return;
        }
        self.rx.copy_within(self.rx_start..self.rx_end, 0);
        self.rx_end = held;
        self.rx_start = 0;
        self.rx.resize(want, 0);
    }

    /// What waits to be sent.
    pub(crate) fn pending_tx(&self) -> &[u8] {
        &self.tx[self.tx_sent..]
    }

    /// `n` bytes of [`pending_tx`](Self::pending_tx) were sent.
    pub(crate) fn sent(&mut self, n: usize) {
        self.tx_sent = (self.tx_sent + n).min(self.tx.len());
        if self.tx_sent == self.tx.len() {
            self.tx.clear();
            self.tx_sent = 0;
            if self.tx.capacity() > TX_HIGH * 2 {
                self.tx.shrink_to(TX_HIGH);
            }
        }
    }

    /// The earliest time [`tick`](Self::tick) has something to do.
    pub(crate) fn next_timer(&self) -> Instant {
        let mut t = match &self.phase {
            Phase::AwaitIcReq | Phase::AwaitConnect => self.deadline,
            Phase::Admin(a) => a.ctrl.keep_alive_deadline().unwrap_or(
                self.deadline
                    .max(Instant::now() + Duration::from_secs(3600)),
            ),
            Phase::Discovery(d) => d
                .ctrl
                .keep_alive_deadline()
                .unwrap_or(d.deadline)
                .min(d.deadline),
            Phase::Io(_) => Instant::now() + Duration::from_secs(3600),
        };
        if let Some(c) = self.closing {
            t = t.min(c);
        }
        t
    }

    /// Timers: the handshake deadline, keep-alive, the discovery time limit, a dead controller.
    pub(crate) fn tick(&mut self, env: &mut Env<'_>) {
        if self.closing.is_some() {
            return;
        }
        let now = env.now;
        match &self.phase {
            Phase::AwaitIcReq | Phase::AwaitConnect if now >= self.deadline => {
                env.ctx
                    .serve
                    .events
                    .handshake_failed(HandshakeFailure::Timeout);
                log::debug!(
                    "{}: no NVMe/TCP Connect within {} ms: closed",
                    self.peer,
                    self.deadline_ms(env)
                );
                self.close(env);
            }
            Phase::Admin(a) if a.ctrl.keep_alive_deadline().is_some_and(|t| now >= t) => {
                let kato = a.ctrl.kato().as_millis();
                a.reg
                    .info
                    .expired
                    .store(true, std::sync::atomic::Ordering::Relaxed);
                env.ctx.serve.peer_log.log(
                    self.peer.ip(),
                    LogClass::Session,
                    log::Level::Warn,
                    format_args!(
                        "nvme-tcp controller {} (host {} from {}): keep-alive expired ({kato} \
                         ms without a Keep Alive): closing its queues",
                        a.ctrl.cntlid, a.ctrl.host, self.peer
                    ),
                );
                self.end(EndReason::KeepAlive, env);
                self.close(env);
            }
            Phase::Discovery(d)
                if now >= d.deadline || d.ctrl.keep_alive_deadline().is_some_and(|t| now >= t) =>
            {
                log::debug!(
                    "{}: nvme-tcp discovery controller {} closed (time limit or keep-alive)",
                    self.peer,
                    d.ctrl.cntlid
                );
                self.close(env);
            }
            Phase::Io(q) if q.ctrl.is_dead() => {
                log::debug!(
                    "{}: I/O queue {} of controller {} closed with its controller",
                    self.peer,
                    q.qid,
                    q.ctrl.cntlid
                );
                self.close(env);
            }
            _ => {}
        }
    }

    pub(super) fn deadline_ms(&self, env: &Env<'_>) -> u32 {
        env.ctx.serve.config().admission.handshake_timeout_ms
    }

    /// The peer closed its side or the socket failed.
    pub(crate) fn peer_gone(&mut self, env: &mut Env<'_>) {
        self.socket_done = true;
        if self.closing.is_some() {
            // Nothing more can be sent (a C2HTermReq or a refusal waiting to go).
            self.tx.clear();
            self.tx_sent = 0;
            return;
        }
        match &self.phase {
            Phase::AwaitIcReq | Phase::AwaitConnect => env
                .ctx
                .serve
                .events
                .handshake_failed(HandshakeFailure::Abandoned),
            Phase::Admin(a) => {
                let why = if a.ctrl.was_shut_down() {
                    EndReason::Host
                } else {
                    EndReason::ConnectionLost
                };
                self.end(why, env);
            }
            _ => {}
        }
        self.close(env);
        // Nothing more can be sent.
        self.tx.clear();
        self.tx_sent = 0;
    }

    /// Counts and logs the end of an I/O controller's session (once).
    /// Whether it is an admitted controller's admin queue.
    pub(crate) fn is_admin(&self) -> bool {
        matches!(self.phase, Phase::Admin(_))
    }

    pub(crate) fn end(&mut self, why: EndReason, env: &mut Env<'_>) {
        let Phase::Admin(a) = &self.phase else { return };
        if std::mem::replace(&mut self.ended, true) {
            return;
        }
        env.ctx.serve.session_ended(
            why,
            self.peer.ip(),
            log::Level::Info,
            format_args!(
                "nvme-tcp controller {} (host {} from {}) on {} ended: {}",
                a.ctrl.cntlid,
                a.ctrl.host,
                self.peer,
                a.ctrl.subsystem,
                why.name()
            ),
        );
    }

    /// Stops taking input; the connection is dropped once what waits to be sent is out (or
    /// after [`LINGER`]). An admin queue's controller dies now, and with it its I/O queues.
    pub(crate) fn close(&mut self, env: &mut Env<'_>) {
        if self.closing.is_some() {
            return;
        }
        self.closing = Some(env.now + LINGER);
        self.transfers.clear();
        if let Phase::Admin(a) = &self.phase {
            a.ctrl.kill();
            env.effect(Effect::WakeAll);
            // No session any more: its place in the unproven or unlisted pool goes now, not
            // after the linger (a host evicting it would free nothing).
            self.ticket = None;
        }
        if let Phase::Io(q) = &self.phase {
            q.ctrl.detach_io_queue(q.qid);
        }
        self.rx = Vec::new();
        self.rx_start = 0;
        self.rx_end = 0;
    }

    /// A fatal transport error: a C2HTermReq carrying the offending header, then closed.
    pub(crate) fn fatal(&mut self, f: Fatal, offending: &[u8], env: &mut Env<'_>) {
        let cause = if f.fes == Fes::HeaderDigestError {
            3
        } else {
            1
        };
        let mut t = [0u64; 5];
        t[cause] = 1;
        env.stats.add_terminates(&t);
        env.ctx.serve.peer_log.warn(
            self.peer.ip(),
            format_args!("{}: nvme-tcp: sent C2HTermReq, closing: {f}", self.peer),
        );
        let hlen = offending
            .get(2)
            .map_or(offending.len(), |&h| usize::from(h).max(pdu::CH_LEN));
        let shown = &offending[..offending.len().min(hlen).min(pdu::TERM_DATA_MAX)];
        pdu::c2h_term_req(&mut self.tx, &f, shown);
        self.end(EndReason::ProtocolError, env);
        self.close(env);
    }

    pub(super) fn on_pdu(&mut self, p: Pdu<'_>, header: &[u8], env: &mut Env<'_>) {
        match p {
            Pdu::IcReq(r) => self.on_icreq(r, env),
            Pdu::H2cTermReq { fes, fei } => {
                env.ctx.serve.peer_log.warn(
                    self.peer.ip(),
                    format_args!(
                        "{}: nvme-tcp: the host terminated the connection (H2CTermReq FES \
                         {fes:#x}, FEI {fei:#x})",
                        self.peer
                    ),
                );
                self.end(EndReason::ProtocolError, env);
                self.close(env);
            }
            Pdu::CapsuleCmd { sqe, data, data_ok } => {
                self.on_command(Sqe::new(*sqe), data, data_ok, env);
                self.close_unadmitted(env);
            }
            Pdu::H2cData { hdr, data, data_ok } => {
                self.on_h2c_data(hdr, data, data_ok, header, env);
                self.close_unadmitted(env);
            }
        }
    }

    /// Before its Connect a peer may send one command, the Connect: once that is answered
    /// without an admission (any error, whatever its cause), the connection closes, so that a
    /// peer that never reads cannot have command after command answered into its send buffer.
    /// A Connect refused by [`Queue::fabrics`] is counted and closed there; one answered with
    /// an error before it got there (its data pointer, its length, its data digest) is a
    /// refusal too, `protocol_error`: the target decided it, the peer did not go away.
    fn close_unadmitted(&mut self, env: &mut Env<'_>) {
        if !matches!(self.phase, Phase::AwaitConnect)
            || !self.transfers.is_empty()
            || self.closing.is_some()
        {
            return;
        }
        env.ctx.serve.events.refused(RefusalReason::ProtocolError);
        env.ctx.serve.peer_log.warn(
            self.peer.ip(),
            format_args!(
                "{}: nvme-tcp Connect refused: malformed (its data pointer, length or data \
                 digest): closing",
                self.peer
            ),
        );
        self.close(env);
    }

    pub(super) fn on_icreq(&mut self, r: pdu::IcReq, env: &mut Env<'_>) {
        if r.pfv != 0 {
            let f = Fatal::new(Fes::UnsupportedParameter, 8, format!("PFV {}", r.pfv));
            return self.fatal(f, &[pdu::kind::IC_REQ, 0, pdu::IC_LEN as u8, 0], env);
        }
        if r.hpda > 31 {
            let f = Fatal::new(Fes::UnsupportedParameter, 10, format!("HPDA {}", r.hpda));
            return self.fatal(f, &[pdu::kind::IC_REQ, 0, pdu::IC_LEN as u8, 0], env);
        }
        let digest = r.digest & (pdu::dgst::HDGST | pdu::dgst::DDGST);
        pdu::ic_resp(&mut self.tx, 0, digest, MAXH2CDATA);
        self.limits = Limits {
            await_icreq: false,
            hdgst: digest & pdu::dgst::HDGST != 0,
            ddgst: digest & pdu::dgst::DDGST != 0,
            max_capsule_data: IN_CAPSULE_DATA,
            maxh2cdata: MAXH2CDATA,
        };
        self.c2h = C2hFraming {
            hdgst: self.limits.hdgst,
            ddgst: self.limits.ddgst,
            hpda: r.hpda,
        };
        self.phase = Phase::AwaitConnect;
        let _ = env;
    }

    pub(super) fn on_command(&mut self, sqe: Sqe, data: &[u8], data_ok: bool, env: &mut Env<'_>) {
        if self.sq_entries > 0 {
            self.sqhd = (self.sqhd + 1) % self.sq_entries;
        }
        let cid = sqe.cid();
        if self.transfers.len() + self.waits.len() >= usize::from(self.sq_entries) {
            let f = Fatal::new(
                Fes::PduSequenceError,
                0,
                format!(
                    "more commands outstanding than the {} entries of the queue",
                    self.sq_entries
                ),
            );
            return self.fatal(f, &[pdu::kind::CAPSULE_CMD, 0, pdu::CMD_HLEN as u8, 0], env);
        }
        if self.transfers.contains_key(&cid) || self.pending_cid(cid) {
            return self.complete(cid, 0, Status::CID_CONFLICT);
        }
        if !data_ok {
            // Integrity before use: the command does not run on data that failed its digest.
            return self.complete(cid, 0, Status::TRANSIENT_TRANSPORT);
        }
        if matches!(self.phase, Phase::AwaitConnect)
            && !(sqe.opcode() == command::FABRICS && sqe.fctype() == command::fctype::CONNECT)
        {
            env.ctx.serve.peer_log.warn(
                self.peer.ip(),
                format_args!(
                    "{}: nvme-tcp: {:?} before the Connect: closing",
                    self.peer, sqe
                ),
            );
            // As on the native listeners: a refusal, not a handshake the peer abandoned.
            env.ctx.serve.events.refused(RefusalReason::ProtocolError);
            self.complete(cid, 0, Status::SEQUENCE_ERROR);
            return self.close(env);
        }
        let dir = direction(&sqe);
        let data_in = match command::data_of(&sqe, data.len(), dir == 1) {
            Ok(d) => d,
            Err(st) => return self.complete(cid, 0, st),
        };
        match (dir, data_in) {
            (1, DataIn::Fetch(len)) => self.fetch(sqe, len, env),
            (2, DataIn::Fetch(room)) => self.run(sqe, Input::Room(room), env),
            (2, DataIn::None) => self.run(sqe, Input::Room(0), env),
            (1, _) => self.run(sqe, Input::Data(data), env),
            (_, DataIn::None) => self.run(sqe, Input::Data(&[]), env),
            _ => self.complete(cid, 0, Status::SGL_LENGTH_INVALID),
        }
    }

    pub(super) fn pending_cid(&self, cid: u16) -> bool {
        self.waits.values().any(|w| w.then.cid() == Some(cid))
    }

    /// Runs a command whose data is in hand.
    pub(super) fn run(&mut self, sqe: Sqe, input: Input<'_>, env: &mut Env<'_>) {
        let cid = sqe.cid();
        let r = self.execute(&sqe, &input, env);
        self.reply(cid, r, env);
        self.deliver_events();
    }

    /// The target stops: nothing more is taken in.
    pub(crate) fn stop(&mut self, env: &mut Env<'_>) {
        self.end(EndReason::Shutdown, env);
        self.close(env);
    }
}

#[cfg(test)]
mod tests;
