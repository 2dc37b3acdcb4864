//! Data a command fetches with R2T: one R2T per command for all of its data, answered by
//! H2CData PDUs that must come in order, within the R2T, under its transfer tag, each at most
//! MAXH2CDATA long. A Write's data goes straight into its namespace, PDU by PDU, each only after
//! its data digest matched (integrity before placement). Only two other commands read data: a
//! Connect (before it, the one command a queue takes) and a Dataset Management of an I/O queue;
//! their data (at most 8 KiB, and 4 KiB) is buffered, at most [`BUFFERED_AT_ONCE`] commands' at
//! a time, and the command runs once it is whole. Any other command runs at once without its
//! data (none that reads data is supported): asked for by R2T, every command whose opcode says
//! "data to the controller" held an 8 KiB buffer until its data came, as many as the queue had
//! entries, on any queue, a discovery controller's (which any host may open) included.
//!
//! An H2CData PDU is checked against its R2T from its header alone, before its data is read
//! into the receive buffer: data for a command that asked for none, under the wrong tag, at
//! the wrong offset or past the R2T is a fatal error with its own status (module
//! [`super::pdu`], [`Fes`]), and costs no buffer.

use super::command::{self, Sqe, Status};
use super::pdu::{self, Fatal, Fes, H2cData};
use super::queue::{Env, Queue};
use super::state::{Input, Phase, Sink, Transfer};

/// Data of commands other than Writes fetched with R2T is buffered whole: at most this much.
pub(crate) const MAX_BUFFERED: u32 = 8192;

/// A Dataset Management's data: at most 256 ranges of 16 bytes.
const MAX_DSM_DATA: u32 = 4096;

/// Commands whose data is buffered at once, per queue: more wait for one to end with a
/// retryable status (a host sends them in the capsule: Linux's are at most 4 KiB, within the
/// 8 KiB it takes).
pub(crate) const BUFFERED_AT_ONCE: usize = 4;

impl Queue {
    /// A command whose data comes with R2T: a Write goes straight into its namespace, anything
    /// else into a small buffer.
    pub(super) fn fetch(&mut self, sqe: Sqe, len: u32, env: &mut Env<'_>) {
        let cid = sqe.cid();
        // As `execute` refuses a command of a controller that is gone or not enabled: a Write
        // whose data comes with R2T was let through, and completed successfully.
        if self.controller_gone() {
            return self.complete(cid, 0, Status::SEQUENCE_ERROR);
        }
        let sink = if sqe.opcode() == command::io::WRITE && matches!(self.phase, Phase::Io(_)) {
            match self.prepare_write(&sqe, len) {
                Ok(s) => s,
                Err(st) => return self.complete(cid, 0, st),
            }
        } else {
            let Some(most) = self.reads_data(&sqe) else {
                // Nothing here reads its data: it runs without (and fails as it would with it).
                return self.run(sqe, Input::Data(&[]), env);
            };
            if len > most {
                return self.complete(cid, 0, Status::SGL_LENGTH_INVALID);
            }
            let buffered = self
                .transfers
                .values()
                .filter(|t| matches!(t.sink, Sink::Buffer(_)))
                .count();
            if buffered >= BUFFERED_AT_ONCE {
                return self.complete(cid, 0, Status::TRANSIENT_TRANSPORT);
            }
            Sink::Buffer(Vec::with_capacity(len as usize))
        };
        self.next_ttag = self.next_ttag.wrapping_add(1);
        let ttag = self.next_ttag;
        self.transfers.insert(
            cid,
            Transfer {
                sqe,
                ttag,
                len,
                received: 0,
                corrupt: false,
                refused: None,
                sink,
            },
        );
        pdu::r2t(&mut self.tx, self.c2h.hdgst, cid, ttag, 0, len);
        let _ = env;
    }

    /// The most data `sqe` reads, if it is a command that reads data other than a Write: a
    /// Connect before it, a Dataset Management on an I/O queue.
    fn reads_data(&self, sqe: &Sqe) -> Option<u32> {
        match &self.phase {
            Phase::AwaitConnect
                if sqe.opcode() == command::FABRICS && sqe.fctype() == command::fctype::CONNECT =>
            {
                Some(MAX_BUFFERED)
            }
            Phase::Io(_) if sqe.opcode() == command::io::DSM => Some(MAX_DSM_DATA),
            _ => None,
        }
    }

    /// Checks an H2CData PDU's header against the R2T it answers as soon as the header is in,
    /// before its data is buffered.
    pub(super) fn check_h2c_header(&self, input: &[u8]) -> Option<Fatal> {
        if input.len() < pdu::HLEN_24
            || input[0] != pdu::kind::H2C_DATA
            || usize::from(input[2]) != pdu::HLEN_24
            || self.limits.await_icreq
        {
            return None;
        }
        let le16 = |at: usize| u16::from_le_bytes([input[at], input[at + 1]]);
        let le32 = |at: usize| {
            u32::from_le_bytes([input[at], input[at + 1], input[at + 2], input[at + 3]])
        };
        let hdr = H2cData {
            cccid: le16(8),
            ttag: le16(10),
            datao: le32(12),
            datal: le32(16),
            last: input[1] & pdu::flag::LAST_PDU != 0,
        };
        self.check_h2c(&hdr).err()
    }

    pub(super) fn check_h2c(&self, h: &H2cData) -> Result<(), Fatal> {
        use pdu::h2c_off;
        let Some(t) = self.transfers.get(&h.cccid) else {
            return Err(Fatal::new(
                Fes::InvalidHeaderField,
                h2c_off::CCCID,
                format!(
                    "H2CData for command {} that has no R2T outstanding",
                    h.cccid
                ),
            ));
        };
        if h.ttag != t.ttag {
            return Err(Fatal::new(
                Fes::InvalidHeaderField,
                h2c_off::TTAG,
                format!("H2CData TTAG {} (the R2T's is {})", h.ttag, t.ttag),
            ));
        }
        if h.datal == 0 {
            return Err(Fatal::new(
                Fes::InvalidHeaderField,
                h2c_off::DATAL,
                "an H2CData PDU without data",
            ));
        }
        if h.datao != t.received {
            return Err(Fatal::new(
                Fes::DataOutOfRange,
                h2c_off::DATAO,
                format!("H2CData at offset {} (expected {})", h.datao, t.received),
            ));
        }
        let end = u64::from(h.datao) + u64::from(h.datal);
        if end > u64::from(t.len) {
            return Err(Fatal::new(
                Fes::DataOutOfRange,
                h2c_off::DATAL,
                format!(
                    "H2CData for bytes {}..{end} of a {}-byte R2T",
                    h.datao, t.len
                ),
            ));
        }
        if h.datal > self.limits.maxh2cdata {
            return Err(Fatal::new(
                Fes::DataLimitExceeded,
                0,
                format!("H2CData of {} bytes, more than MAXH2CDATA", h.datal),
            ));
        }
        if h.last != (end == u64::from(t.len)) {
            return Err(Fatal::new(
                Fes::InvalidHeaderField,
                1,
                "LAST_PDU does not mark the end of the R2T's data",
            ));
        }
        Ok(())
    }

    /// Whether this is an I/O queue whose controller is gone or not enabled.
    fn controller_gone(&self) -> bool {
        matches!(&self.phase, Phase::Io(q) if q.ctrl.is_dead() || !q.ctrl.ready())
    }

    pub(super) fn on_h2c_data(
        &mut self,
        h: H2cData,
        data: &[u8],
        data_ok: bool,
        header: &[u8],
        env: &mut Env<'_>,
    ) {
        if let Err(f) = self.check_h2c(&h) {
            return self.fatal(f, header, env);
        }
        // Nothing lands for a controller that is gone (its keep-alive lapsed, its host
        // disconnected on the admin queue): its host may have reconnected and written these
        // blocks again. The command fails when its data is in.
        let gone = self.controller_gone();
        let Some(t) = self.transfers.get_mut(&h.cccid) else {
            return;
        };
        t.received += h.datal;
        if !data_ok || gone {
            // Integrity before placement: data that failed its digest never lands.
            t.corrupt = true;
        } else if !t.corrupt && t.refused.is_none() {
            match &mut t.sink {
                Sink::Namespace { ns, offset, .. } => {
                    let at = *offset + u64::from(h.datao);
                    if ns.is_retired() {
                        // A reload took its namespace away while the data came: the file is
                        // the operator's again once the reload is done (the loops applied it).
                        t.refused = Some(Status::WRITE_FAULT);
                    } else if let Err(e) = ns.mapping.write_at(at as usize, data) {
                        t.refused = Some(super::io::write_status(e));
                    }
                }
                Sink::Buffer(b) => b.extend_from_slice(data),
            }
        }
        if t.received < t.len {
            return;
        }
        let Some(t) = self.transfers.remove(&h.cccid) else {
            return;
        };
        let cid = t.sqe.cid();
        if gone {
            return self.complete(cid, 0, Status::SEQUENCE_ERROR);
        }
        if t.corrupt {
            return self.complete(cid, 0, Status::TRANSIENT_TRANSPORT);
        }
        if let Some(st) = t.refused {
            return self.complete(cid, 0, st);
        }
        match t.sink {
            Sink::Namespace {
                ns,
                counts,
                offset,
                fua,
            } => {
                if let Err(st) = self.still_the_namespace(t.sqe.nsid(), &ns) {
                    if fua {
                        counts.durability(false);
                    }
                    return self.complete(cid, 0, st);
                }
                counts.wrote(u64::from(t.len));
                let r = self.after_write(&t.sqe, ns, counts, offset, u64::from(t.len), fua, env);
                self.reply(cid, r, env);
            }
            Sink::Buffer(b) => self.run(t.sqe, Input::Data(&b), env),
        }
    }
}
