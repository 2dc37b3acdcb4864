//! Receive side: FPDUs cut out of a (non-blocking) byte stream that splits and packs them
//! arbitrarily, checked, and their payloads placed where a [`Placer`] says.
//!
//! Integrity before placement:
//! - CRC on: the whole FPDU is gathered in the receiver's buffer (a mirrored ring: an FPDU is
//!   one slice wherever it starts, and nothing is ever compacted), its CRC checked, then its
//!   header decoded, then the placer asked, then the payload bytes handed to the placer's
//!   [`Placer::write`], which copies them into place (with non-temporal stores where the cache
//!   write-back was asked for) or writes them into the file whose page cache the memory is (a
//!   `pwrite`, where the placer named one: no write fault on a page the last write-back
//!   cleaned). The receiver names no placement code (placer.rs).
//! - CRC off: the header is decoded and checked and the placer asked as soon as the header is in;
//!   a direct payload is then read from the stream straight into place (bytes already read ahead
//!   are copied), with no staging; a payload for a file is gathered and handed to the placer,
//!   which writes it with one `pwrite`.
//!
//! The receiver is a state machine whose states are values: each state's `step` takes its
//! state by value and returns the next one (`Next`: go on, wait for the source, or deliver
//! an FPDU and be Idle again), so every path names where the receiver goes; an error leaves it
//! Failed. The buffered bytes and the judging of an FPDU are the inbox's (inbox.rs).
//!
//! Registered memory is reached only through a [`VolatileSlice`]: copies and the iovecs of a
//! `readv` ([`ReadVolatile`]), never a Rust reference, because other poll loops may place into
//! the same bytes and the memory's owner may read them meanwhile (racing bytes may come out
//! torn, as on any RDMA NIC; nothing worse).
//!
//! With CRC off the placer is asked again ([`Placer::recheck`]) before each further piece of a
//! direct payload that arrives over several polls is placed: a registration revoked between
//! the header and the rest of the payload stops the FPDU there.
//!
//! Any error leaves nothing placed for the offending FPDU (with CRC off, an I/O error, EOF or a
//! revocation in the middle of a direct payload can leave a prefix of it written, as on any
//! RDMA NIC) and
//! poisons the receiver: the caller answers with a Terminate for
//! [`WireError::terminate_cause`], quoting [`FpduReceiver::offending_segment`], and closes.

use std::io::{self, Read};

use super::body::Body;
use super::crc::crc32c;
use super::ddp::Header;
use super::error::{Result, WireError};
use super::{fpdu_len, pad_len};
use crate::volatile::{ReadVolatile, VolatileSlice};

mod config;
mod inbox;
mod placer;

pub use config::{RxConfig, READ_AHEAD};
use inbox::{Done, DoneKind, Inbox, Kind};
use placer::too_short;
pub use placer::{DirectTarget, Placement, Placer};

/// What became of a received FPDU's payload.
#[derive(Debug, PartialEq, Eq)]
pub enum Delivered<'a> {
    /// Placed at its [`DirectTarget`].
    Placed,
    /// Kept in the receiver's buffer, valid until the next `poll`.
    Buffered(&'a [u8]),
    /// Dropped.
    Discarded,
    /// A control message, decoded.
    Control(Body),
}

/// A received FPDU.
#[derive(Debug, PartialEq, Eq)]
pub struct Received<'a> {
    /// Its DDP/RDMAP header.
    pub header: Header,
    /// Its MPA ULPDU length.
    pub ulpdu_len: usize,
    /// Its payload length (ULPDU less header).
    pub payload_len: usize,
    /// The payload's fate.
    pub data: Delivered<'a>,
    /// Placed with a copy that also wrote it back from the CPU cache (asked for with
    /// [`DirectTarget::with_cache_writeback`]): an `sfence` makes it durable, no `clwb` needed.
    pub written_back: bool,
}

/// Where the receiver is in the stream. Each state but Idle and Failed is a value its `step`
/// consumes.
enum State {
    /// Between FPDUs.
    Idle,
    /// CRC off: header accepted and placement decided; waiting for the whole FPDU.
    Gathering(Gathering),
    /// CRC off: a direct payload streaming into place.
    Streaming(Streaming),
    /// CRC off: payload placed; skipping pad and (unchecked) CRC.
    Trailer(Trailer),
    /// An error was returned.
    Failed,
}

struct Gathering {
    header: Header,
    hl: usize,
    ulpdu_len: usize,
    kind: Kind,
}

struct Streaming {
    header: Header,
    ulpdu_len: usize,
    dst: DirectTarget,
    done: usize,
}

struct Trailer {
    header: Header,
    ulpdu_len: usize,
    left: usize,
}

/// What a state's `step` decided: the state the receiver goes on in, or the FPDU it finished.
enum Next {
    /// Go on at once in this state.
    Go(State),
    /// The source would block: stay in this state until the next `poll`.
    Wait(State),
    /// An FPDU is complete: report it; the receiver is between FPDUs (Idle) again.
    Deliver(Done),
}

impl Next {
    /// `state` again: at once if `filled` (the read got what was wanted), else at the next poll.
    fn filled(filled: bool, state: State) -> Next {
        if filled {
            Next::Go(state)
        } else {
            Next::Wait(state)
        }
    }
}

/// The receive state machine of one connection. See the module docs.
pub struct FpduReceiver {
    state: State,
    inbox: Inbox,
}

impl std::fmt::Debug for FpduReceiver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FpduReceiver")
            .field("cfg", &self.inbox.cfg)
            .field("buffered", &self.inbox.avail())
            .finish_non_exhaustive()
    }
}

impl FpduReceiver {
    /// A receiver; its buffer holds two maximal FPDUs.
    pub fn new(cfg: RxConfig) -> FpduReceiver {
        FpduReceiver {
            state: State::Idle,
            inbox: Inbox::new(cfg),
        }
    }

    /// The settings.
    pub fn config(&self) -> &RxConfig {
        &self.inbox.cfg
    }

    /// Whether the receiver is between FPDUs with nothing buffered.
    pub fn is_idle(&self) -> bool {
        matches!(self.state, State::Idle) && self.inbox.avail() == 0
    }

    /// After an error: the MPA length and the DDP/RDMAP header bytes (as far as received, up to
    /// 18) of the offending FPDU, for [`super::Terminate::with_ddp`]. None if the error came
    /// before a length was read.
    pub fn offending_segment(&self) -> Option<(u16, &[u8])> {
        self.inbox
            .offending
            .as_ref()
            .map(|(len, hdr, n)| (*len, &hdr[..*n]))
    }

    /// Reads from `src` until one FPDU is complete and returns it; `Ok(None)` when `src` would
    /// block first. `src` should be non-blocking (a blocking one simply blocks here).
    ///
    /// # Errors
    /// [`WireError::Closed`] at end of stream (also mid-FPDU), [`WireError::Io`]; a malformed
    /// FPDU: [`WireError::UlpduTooLong`], [`WireError::UlpduTooShort`], [`WireError::BadCrc`],
    /// the header errors of [`Header::decode`], [`WireError::UnexpectedOpcode`] for an opcode not
    /// negotiated, [`WireError::BadBodyLength`] and the body errors of [`Body::decode`];
    /// [`WireError::Refused`] when the placer refuses, [`WireError::PlacementTooShort`]. After an
    /// error every call fails with [`WireError::Closed`].
    pub fn poll<R: Read + ReadVolatile, P: Placer>(
        &mut self,
        src: &mut R,
        placer: &mut P,
    ) -> Result<Option<Received<'_>>> {
        let Some(done) = self.step(src, placer)? else {
            return Ok(None);
        };
        let written_back = matches!(done.kind, DoneKind::Placed(true));
        let data = match done.kind {
            DoneKind::Placed(_) => Delivered::Placed,
            DoneKind::Buffered(a, b) => Delivered::Buffered(self.inbox.ring.bytes(a..b)),
            DoneKind::Discarded => Delivered::Discarded,
            DoneKind::Control(body) => Delivered::Control(body),
        };
        Ok(Some(Received {
            header: done.header,
            ulpdu_len: done.ulpdu_len,
            payload_len: done.ulpdu_len - done.header.len(),
            data,
            written_back,
        }))
    }

    /// Runs the states until one delivers an FPDU or waits for the source.
    fn step<R: Read + ReadVolatile, P: Placer>(
        &mut self,
        src: &mut R,
        placer: &mut P,
    ) -> Result<Option<Done>> {
        // Out of `self` while it runs: an error returned from a state leaves the receiver Failed.
        let mut state = std::mem::replace(&mut self.state, State::Failed);
        loop {
            let next = match state {
                State::Failed => {
                    return Err(WireError::Closed {
                        during: "receive after a failed FPDU",
                    })
                }
                State::Idle => idle(&mut self.inbox, src, placer)?,
                State::Gathering(g) => g.step(&mut self.inbox, src, placer)?,
                State::Streaming(s) => s.step(&mut self.inbox, src, placer)?,
                State::Trailer(t) => t.step(&mut self.inbox, src)?,
            };
            match next {
                Next::Go(s) => state = s,
                Next::Wait(s) => {
                    self.state = s;
                    return Ok(None);
                }
                Next::Deliver(done) => {
                    self.state = State::Idle;
                    return Ok(Some(done));
                }
            }
        }
    }
}

/// Between FPDUs: judges the next one as far as the buffered bytes allow, else reads more.
fn idle<R: Read, P: Placer>(inbox: &mut Inbox, src: &mut R, placer: &mut P) -> Result<Next> {
    if let Some(next) = parse(inbox, placer)? {
        return Ok(next);
    }
    let want = inbox.want();
    Ok(Next::filled(inbox.fill(src, want)?, State::Idle))
}

/// In the Idle state: judges the next FPDU as far as the buffered bytes allow (None: not far
/// enough to leave Idle).
fn parse<P: Placer>(inbox: &mut Inbox, placer: &mut P) -> Result<Option<Next>> {
    let avail = inbox.avail();
    if avail < 2 {
        return Ok(None);
    }
    let b = inbox.ring.bytes(inbox.start..inbox.end);
    let ulpdu_len = u16::from_be_bytes([b[0], b[1]]) as usize;
    let total = fpdu_len(ulpdu_len);
    if ulpdu_len > inbox.cfg.max_ulpdu {
        inbox.note_offending(ulpdu_len);
        return Err(WireError::UlpduTooLong {
            ulpdu_len,
            max: inbox.cfg.max_ulpdu,
        });
    }
    if inbox.cfg.crc {
        if avail < total {
            return Ok(None);
        }
        inbox.note_offending(ulpdu_len);
        let b = inbox.ring.bytes(inbox.start..inbox.start + total);
        let computed = crc32c(&b[..total - 4]);
        let received = u32::from_le_bytes([b[total - 4], b[total - 3], b[total - 2], b[total - 1]]);
        if computed != received {
            return Err(WireError::BadCrc { computed, received });
        }
        let (header, hl) = inbox.judge_header(ulpdu_len)?;
        let kind = decide(header, hl, ulpdu_len, placer)?;
        let done = inbox.deliver(header, hl, ulpdu_len, kind, placer)?;
        return Ok(Some(Next::Deliver(done)));
    }
    // CRC off: judge the header as soon as it is in.
    let Some(hl) = Header::peek_len(&b[2..]) else {
        return Ok(None);
    };
    if avail < (2 + hl).min(total) {
        return Ok(None);
    }
    inbox.note_offending(ulpdu_len);
    let (header, hl) = inbox.judge_header(ulpdu_len)?;
    let kind = decide(header, hl, ulpdu_len, placer)?;
    // A payload that is (nearly) all in or within read-ahead is gathered and copied: one
    // syscall, where reading it into place would take two (payload, then the trailer).
    let payload_len = ulpdu_len - hl;
    let buffered = avail - (2 + hl);
    let direct = payload_len.saturating_sub(buffered) > READ_AHEAD;
    let next = match kind {
        // Into a file: gathered, then one pwrite (never read from the stream into place).
        Kind::Direct(dst) if direct && dst.file.is_none() => {
            inbox.start += 2 + hl;
            State::Streaming(Streaming {
                header,
                ulpdu_len,
                dst,
                done: 0,
            })
        }
        kind => State::Gathering(Gathering {
            header,
            hl,
            ulpdu_len,
            kind,
        }),
    };
    Ok(Some(Next::Go(next)))
}

/// Asks the placer where a judged FPDU's payload goes (control messages go nowhere but to
/// their decoder).
fn decide<P: Placer>(header: Header, hl: usize, ulpdu_len: usize, placer: &mut P) -> Result<Kind> {
    if !header.opcode.carries_data() {
        return Ok(Kind::Control);
    }
    let payload_len = ulpdu_len - hl;
    match placer.place(&header, payload_len) {
        Err(cause) => Err(WireError::Refused {
            opcode: header.opcode,
            cause,
        }),
        Ok(Placement::Direct(dst)) if dst.len() < payload_len => Err(too_short(payload_len, &dst)),
        Ok(Placement::Direct(dst)) => Ok(Kind::Direct(dst)),
        Ok(Placement::Buffer) => Ok(Kind::Buffer),
        Ok(Placement::Discard) => Ok(Kind::Discard),
    }
}

impl Gathering {
    fn step<R: Read, P: Placer>(
        self,
        inbox: &mut Inbox,
        src: &mut R,
        placer: &mut P,
    ) -> Result<Next> {
        let total = fpdu_len(self.ulpdu_len);
        if inbox.avail() >= total {
            if matches!(self.kind, Kind::Direct(_)) {
                recheck(&self.header, placer)?;
            }
            let Gathering {
                header,
                hl,
                ulpdu_len,
                kind,
            } = self;
            return Ok(Next::Deliver(
                inbox.deliver(header, hl, ulpdu_len, kind, placer)?,
            ));
        }
        Ok(Next::filled(
            inbox.fill(src, total)?,
            State::Gathering(self),
        ))
    }
}

/// [`Placer::recheck`], its refusal as `poll`'s error.
fn recheck<P: Placer>(header: &Header, placer: &mut P) -> Result<()> {
    placer.recheck(header).map_err(|cause| WireError::Refused {
        opcode: header.opcode,
        cause,
    })
}

impl Streaming {
    fn step<R: ReadVolatile, P: Placer>(
        mut self,
        inbox: &mut Inbox,
        src: &mut R,
        placer: &mut P,
    ) -> Result<Next> {
        let payload_len = self.ulpdu_len - self.header.len();
        if self.done < payload_len {
            // Before each piece is placed (the receiver comes back here after every read).
            recheck(&self.header, placer)?;
        }
        let n = inbox.avail().min(payload_len - self.done);
        // dst.len() >= payload_len was checked in `decide`.
        let rest = self
            .dst
            .dst
            .subslice(self.done, payload_len - self.done)
            .map_err(|_| too_short(payload_len, &self.dst))?;
        if n > 0 {
            // The bytes read ahead: a copy through the slice, as the read below goes into it.
            rest.write_at(0, inbox.ring.bytes(inbox.start..inbox.start + n))
                .map_err(|_| too_short(payload_len, &self.dst))?;
            inbox.start += n;
            self.done += n;
        }
        if self.done == payload_len {
            return Ok(Next::Go(State::Trailer(Trailer {
                header: self.header,
                ulpdu_len: self.ulpdu_len,
                left: pad_len(self.ulpdu_len) + 4,
            })));
        }
        // Our buffer is empty here: the same readv brings the trailer and what
        // follows (up to read-ahead) into it. The payload goes straight into place
        // through an iovec: no `&mut [u8]` over registered memory that another
        // poll loop may be placing into at the same time.
        let want = payload_len - self.done;
        let rest = self
            .dst
            .dst
            .subslice(self.done, want)
            .map_err(|_| too_short(payload_len, &self.dst))?;
        inbox.start = 0;
        inbox.end = 0;
        let ahead = READ_AHEAD.min(inbox.ring.cap());
        let bufs = [rest, VolatileSlice::from(inbox.ring.bytes_mut(0..ahead))];
        match src.read_volatile(&bufs) {
            Ok(0) => {
                return Err(WireError::Closed {
                    during: "FPDU payload",
                })
            }
            Ok(k) => {
                self.done += k.min(want);
                inbox.end = k.saturating_sub(want);
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                return Ok(Next::Wait(State::Streaming(self)))
            }
            Err(e) => {
                if e.raw_os_error() == Some(libc::EFAULT) {
                    // The kernel could not write into a page of the destination (a file
                    // truncated behind its mapping: no signal for a system call's copy). Read
                    // here, such a page faults and is recorded (crate::sigbus), so that its
                    // namespace fails and is not served again, instead of every retry of the
                    // peer's Write ending its connection here.
                    crate::sigbus::probe(bufs[0].as_ptr() as usize, bufs[0].len());
                }
                return Err(WireError::io("FPDU payload", e));
            }
        }
        Ok(Next::Go(State::Streaming(self)))
    }
}

impl Trailer {
    fn step<R: Read>(mut self, inbox: &mut Inbox, src: &mut R) -> Result<Next> {
        let n = inbox.avail().min(self.left);
        inbox.start += n;
        self.left -= n;
        if self.left == 0 {
            return Ok(Next::Deliver(Done {
                header: self.header,
                ulpdu_len: self.ulpdu_len,
                kind: DoneKind::Placed(false),
            }));
        }
        let left = self.left;
        Ok(Next::filled(inbox.fill(src, left)?, State::Trailer(self)))
    }
}

#[cfg(test)]
mod tests;
