//! How a command is answered: a completion (CapsuleResp), data first (one C2HData PDU, with
//! the SUCCESS flag and no completion where the host disabled SQ flow control), or later, once
//! the flushes it waits for are done (Flush, FUA, the write cache disabled, a shutdown) or an
//! event comes for a held Asynchronous Event Request.

use std::sync::Arc;

use rpma_common::proto::FlushStatus;

use super::command::{Cqe, Status};
use super::controller::NsCounts;
use super::pdu;
use super::queue::{Effect, Env, Queue};
use super::state::{Phase, Then, Wait};
use crate::flusher::FlushTarget;
use crate::namespace::OpenNamespace;

/// Flushes to start: (namespace, offset, length; 0 for all of it).
pub(crate) type Flushes = Vec<(FlushTarget, u64, u64)>;

/// What a command handler decided.
pub(crate) enum Reply {
    /// Complete now.
    Done { dw0: u32, status: Status },
    /// Complete successfully with a 64-bit result (dwords 0 and 1).
    Value(u64),
    /// Send this data, then complete successfully.
    Data(Vec<u8>),
    /// Send `len` bytes of `ns` from byte `offset`, then complete.
    Read {
        ns: Arc<OpenNamespace>,
        counts: Arc<NsCounts>,
        offset: u64,
        len: u32,
    },
    /// The completion comes later (a flush, a held event request).
    Later,
    /// Complete with `status` (and `dw0`), then close the connection.
    Refuse { dw0: u32, status: Status },
}

impl Reply {
    pub(crate) fn ok() -> Reply {
        Reply::Done {
            dw0: 0,
            status: Status::SUCCESS,
        }
    }

    pub(crate) fn status(status: Status) -> Reply {
        Reply::Done { dw0: 0, status }
    }

    pub(crate) fn dw0(dw0: u32) -> Reply {
        Reply::Done {
            dw0,
            status: Status::SUCCESS,
        }
    }
}

impl Queue {
    /// Sends what `r` says for command `cid`.
    pub(crate) fn reply(&mut self, cid: u16, r: Reply, env: &mut Env<'_>) {
        match r {
            Reply::Done { dw0, status } => self.complete(cid, dw0, status),
            Reply::Value(v) => self.complete_with(cid, v as u32, (v >> 32) as u32, Status::SUCCESS),
            Reply::Later => {}
            Reply::Refuse { dw0, status } => {
                self.complete(cid, dw0, status);
                self.close(env);
            }
            Reply::Data(d) => self.send_data(cid, &d),
            Reply::Read {
                ns,
                counts,
                offset,
                len,
            } => {
                let (framing, header) = (self.c2h, self.c2h_header(cid, len));
                let done = pdu::c2h_data(&mut self.tx, framing, header, |buf| {
                    ns.mapping.read_at(offset as usize, buf)
                });
                match done {
                    Ok(()) => {
                        counts.read(u64::from(len));
                        if !self.sqflow_off {
                            self.complete(cid, 0, Status::SUCCESS);
                        }
                    }
                    // The copy met a page the kernel could not give back (the namespace
                    // has failed): the zeros put in its place were taken back above.
                    Err(rpma_common::pmem::Error::Unreadable { .. }) => {
                        self.complete(cid, 0, Status::UNRECOVERED_READ_ERROR)
                    }
                    Err(_) => self.complete(cid, 0, Status::LBA_OUT_OF_RANGE),
                }
            }
        }
    }

    /// A completion.
    pub(crate) fn complete(&mut self, cid: u16, dw0: u32, status: Status) {
        self.complete_with(cid, dw0, 0, status);
    }

    pub(super) fn complete_with(&mut self, cid: u16, dw0: u32, dw1: u32, status: Status) {
        let cqe = Cqe {
            dw0,
            dw1,
            sqhd: if self.sqflow_off { 0xffff } else { self.sqhd },
            cid,
            status,
        };
        pdu::capsule_resp(&mut self.tx, self.c2h.hdgst, &cqe.bytes());
    }

    /// The header of a command's whole data in one C2HData PDU.
    pub(super) fn c2h_header(&self, cid: u16, len: u32) -> pdu::C2hData {
        pdu::C2hData {
            cccid: cid,
            offset: 0,
            len,
            last: true,
            success: self.sqflow_off,
        }
    }

    /// Data for the host (all of it in one C2HData PDU), then the completion.
    pub(super) fn send_data(&mut self, cid: u16, data: &[u8]) {
        let (framing, header) = (self.c2h, self.c2h_header(cid, data.len() as u32));
        let sent = pdu::c2h_data(&mut self.tx, framing, header, |buf| {
            buf.copy_from_slice(data);
            Ok::<(), ()>(())
        });
        if sent.is_ok() && !self.sqflow_off {
            self.complete(cid, 0, Status::SUCCESS);
        }
    }

    /// Starts `flushes` and completes per `then` when all are done.
    pub(crate) fn wait_for(
        &mut self,
        then: Then,
        flushes: Flushes,
        counted: Vec<Arc<NsCounts>>,
        namespaces: Vec<Arc<OpenNamespace>>,
        env: &mut Env<'_>,
    ) -> Reply {
        if flushes.is_empty() {
            for c in &counted {
                c.durability(true);
            }
            return match then {
                Then::Complete(_) | Then::Write { .. } => Reply::ok(),
                Then::ShutdownDone => Reply::Later,
            };
        }
        self.next_wait += 1;
        let id = self.next_wait;
        self.waits.insert(
            id,
            Wait {
                then,
                remaining: flushes.len(),
                status: Status::SUCCESS,
                counted,
                namespaces,
            },
        );
        for (target, offset, len) in flushes {
            let token = env.token();
            self.tokens.insert(token, id);
            env.effect(Effect::Flush {
                token,
                target,
                offset,
                len,
            });
        }
        Reply::Later
    }

    /// A flush this queue asked for finished.
    pub(crate) fn flush_done(&mut self, token: u64, status: FlushStatus, env: &mut Env<'_>) {
        let Some(id) = self.tokens.remove(&token) else {
            return;
        };
        let Some(w) = self.waits.get_mut(&id) else {
            return;
        };
        let st = match status {
            FlushStatus::Durable | FlushStatus::VisibleOnly => Status::SUCCESS,
            FlushStatus::OutOfRange => Status::LBA_OUT_OF_RANGE,
            FlushStatus::InvalidNamespace => Status::INVALID_NS,
            FlushStatus::Unavailable => Status::INTERNAL,
            // NamespaceFailed, IoError and whatever comes later: not durable, for good.
            _ => Status::WRITE_FAULT,
        };
        if !st.is_success() && w.status.is_success() {
            w.status = st;
        }
        w.remaining = w.remaining.saturating_sub(1);
        if w.remaining > 0 {
            return;
        }
        let Some(mut w) = self.waits.remove(&id) else {
            return;
        };
        if let (Then::Write { nsid, .. }, true, Some(ns)) =
            (w.then, w.status.is_success(), w.namespaces.first())
        {
            let ns = Arc::clone(ns);
            if let Err(st) = self.still_the_namespace(nsid, &ns) {
                w.status = st;
            }
        }
        let ok = w.status.is_success();
        for c in &w.counted {
            c.durability(ok);
        }
        if !ok {
            for ns in &w.namespaces {
                ns.note_failure();
            }
        }
        match w.then {
            // Answered even while closing: the target's stop answers what it took in.
            Then::Complete(cid) | Then::Write { cid, .. } => self.complete(cid, 0, w.status),
            Then::ShutdownDone => self.shutdown_flushed(ok),
        }
        let _ = env;
    }

    /// The shutdown's flushes are done (`ok`: all succeeded).
    pub(super) fn shutdown_flushed(&mut self, ok: bool) {
        match &self.phase {
            Phase::Admin(a) => a.ctrl.shutdown_done(ok && !a.ctrl.any_failed()),
            Phase::Discovery(d) => d.ctrl.shutdown_done(ok),
            _ => {}
        }
    }

    /// Completes held Asynchronous Event Requests with the controller's waiting events.
    pub(crate) fn deliver_events(&mut self) {
        let (ctrl, aers) = match &mut self.phase {
            Phase::Admin(a) => (Arc::clone(&a.ctrl), &mut a.aers),
            Phase::Discovery(d) => (Arc::clone(&d.ctrl), &mut d.aers),
            _ => return,
        };
        let mut done = Vec::new();
        while !aers.is_empty() {
            let Some(e) = ctrl.take_event() else { break };
            done.push((aers.remove(0), e));
        }
        for (cid, e) in done {
            self.complete(cid, e, Status::SUCCESS);
        }
    }
}
