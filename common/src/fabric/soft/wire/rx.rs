//! Receive side: FPDUs cut out of a (non-blocking) byte stream that splits and packs them
//! arbitrarily, checked, and their payloads placed where a [`Placer`] says.
//!
//! Integrity before placement:
//! - CRC on: the whole FPDU is gathered in the receiver's buffer (a mirrored ring: an FPDU is
//!   one slice wherever it starts, and nothing is ever compacted), its CRC checked, then its
//!   header decoded, then the placer asked, then the payload copied into place (`place_copy`,
//!   or `place_copy_writeback` with non-temporal stores where the placer asked for the cache
//!   write-back: the only functions that write received bytes into registered memory), or
//!   written into the file whose page cache the memory is (`place_pwrite`, where the placer
//!   named one: no write fault on a page the last write-back cleaned).
//! - CRC off: the header is decoded and checked and the placer asked as soon as the header is in;
//!   a direct payload is then read from the stream straight into place (bytes already read ahead
//!   are copied), with no staging; a payload for a file is gathered and written with one
//!   `pwrite`.
//!
//! Registered memory is reached only through a [`VolatileSlice`]: copies and the iovecs of a
//! `readv` ([`ReadVolatile`]), never a Rust reference, because other poll loops may place into
//! the same bytes and the memory's owner may read them meanwhile (racing bytes may come out
//! torn, as on any RDMA NIC; nothing worse).
//!
//! Any error leaves nothing placed for the offending FPDU (with CRC off, an I/O error or EOF
//! in the middle of a direct payload can leave a prefix of it written, as on any RDMA NIC) and
//! poisons the receiver: the caller answers with a Terminate for
//! [`WireError::terminate_cause`], quoting [`FpduReceiver::offending_segment`], and closes.

use std::io::{self, Read};

use super::body::Body;
use super::caps::CapFlags;
use super::codes::{Opcode, TermCause};
use super::crc::crc32c;
use super::ddp::{Header, TAGGED_HDR_LEN, UNTAGGED_HDR_LEN};
use super::error::{Result, WireError};
use super::mpa::Negotiated;
use super::rdmap::body_len;
use super::ring::Ring;
use super::tx::MIN_MAX_ULPDU;
use super::{fpdu_len, pad_len, MAX_ULPDU_LIMIT};
pub use crate::fabric::soft::placement::DirectTarget;
use crate::fabric::soft::placement::{place_copy, place_copy_writeback, place_pwrite};
use crate::volatile::{ReadVolatile, VolatileSlice};

/// With CRC off, how far past the bytes it needs the receiver reads ahead. Small enough that a
/// large direct payload mostly lands straight in place, large enough that a 4 KiB Write and the
/// Read Request behind it come in one read.
pub const READ_AHEAD: usize = 8192;

/// Settings of the receive side.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RxConfig {
    crc: bool,
    max_ulpdu: usize,
    allowed: CapFlags,
}

impl RxConfig {
    /// `crc`: check CRC32c; `max_ulpdu`: the longest ULPDU accepted (a longer one is an error);
    /// `allowed`: the optional opcodes accepted (RFC 7306 atomics and Immediate Data, private
    /// Flush, private Atomic Write), normally [`Negotiated::shared`].
    ///
    /// # Errors
    /// [`WireError::InvalidConfig`] if `max_ulpdu` is outside `128..=65535`.
    pub fn new(crc: bool, max_ulpdu: usize, allowed: CapFlags) -> Result<RxConfig> {
        if !(MIN_MAX_ULPDU..=MAX_ULPDU_LIMIT).contains(&max_ulpdu) {
            return Err(WireError::InvalidConfig {
                what: "max ULPDU outside 128..=65535",
            });
        }
        Ok(RxConfig {
            crc,
            max_ulpdu,
            allowed,
        })
    }

    /// The settings a negotiation implies, accepting ULPDUs up to `max_ulpdu` (what our
    /// capability block advertised).
    ///
    /// # Errors
    /// As [`RxConfig::new`].
    pub fn from_negotiated(n: &Negotiated, max_ulpdu: usize) -> Result<RxConfig> {
        RxConfig::new(n.crc, max_ulpdu, n.shared)
    }

    fn check_allowed(&self, opcode: Opcode) -> Result<()> {
        use Opcode::*;
        let ok = match opcode {
            ImmediateData | ImmediateDataSe | AtomicRequest | AtomicResponse => {
                self.allowed.contains(CapFlags::RFC7306_ATOMICS)
            }
            FlushRequest => self.allowed.contains(CapFlags::FLUSH),
            AtomicWriteRequest => self.allowed.contains(CapFlags::ATOMIC_WRITE),
            PrivateResponse => {
                self.allowed.contains(CapFlags::FLUSH)
                    || self.allowed.contains(CapFlags::ATOMIC_WRITE)
            }
            _ => true,
        };
        if ok {
            Ok(())
        } else {
            Err(WireError::UnexpectedOpcode {
                opcode,
                reason: "not negotiated",
            })
        }
    }
}

/// Where a data payload goes.
#[derive(Debug)]
pub enum Placement {
    /// Straight into registered memory.
    Direct(DirectTarget),
    /// Into the receiver's buffer, handed back in [`Delivered::Buffered`] (small untagged
    /// messages the engine copies itself).
    Buffer,
    /// Nowhere (read and dropped).
    Discard,
}

/// Decides placement for each data segment (Write, Read Response, the Sends).
pub trait Placer {
    /// Called once per data FPDU, after its header (and with CRC on, its CRC) passed and before
    /// any payload byte is placed. `Err(cause)` refuses it: nothing is placed and `poll` fails
    /// with [`WireError::Refused`].
    ///
    /// # Errors
    /// The Terminate cause that the refusal calls for.
    fn place(
        &mut self,
        header: &Header,
        payload_len: usize,
    ) -> std::result::Result<Placement, TermCause>;
}

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

enum Kind {
    Direct(DirectTarget),
    Buffer,
    Discard,
    Control,
}

enum State {
    /// Between FPDUs.
    Idle,
    /// CRC off: header accepted and placement decided; waiting for the whole FPDU.
    Gathering {
        header: Header,
        hl: usize,
        ulpdu_len: usize,
        kind: Kind,
    },
    /// CRC off: a direct payload streaming into place.
    Streaming {
        header: Header,
        ulpdu_len: usize,
        dst: DirectTarget,
        done: usize,
    },
    /// CRC off: payload placed; skipping pad and (unchecked) CRC.
    Trailer {
        header: Header,
        ulpdu_len: usize,
        left: usize,
    },
    /// An error was returned.
    Failed,
}

enum DoneKind {
    /// Placed; whether it was also written back from the cache.
    Placed(bool),
    Buffered(usize, usize),
    Discarded,
    Control(Body),
}

struct Done {
    header: Header,
    ulpdu_len: usize,
    kind: DoneKind,
}

/// The receive state machine of one connection. See the module docs.
pub struct FpduReceiver {
    cfg: RxConfig,
    ring: Ring,
    start: usize,
    end: usize,
    state: State,
    offending: Option<(u16, [u8; UNTAGGED_HDR_LEN], usize)>,
}

impl std::fmt::Debug for FpduReceiver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FpduReceiver")
            .field("cfg", &self.cfg)
            .field("buffered", &(self.end - self.start))
            .finish_non_exhaustive()
    }
}

impl FpduReceiver {
    /// A receiver; its buffer holds two maximal FPDUs.
    pub fn new(cfg: RxConfig) -> FpduReceiver {
        let size = (2 * fpdu_len(cfg.max_ulpdu)).max(2 * READ_AHEAD);
        FpduReceiver {
            cfg,
            ring: Ring::new(size),
            start: 0,
            end: 0,
            state: State::Idle,
            offending: None,
        }
    }

    /// The settings.
    pub fn config(&self) -> &RxConfig {
        &self.cfg
    }

    /// Whether the receiver is between FPDUs with nothing buffered.
    pub fn is_idle(&self) -> bool {
        matches!(self.state, State::Idle) && self.start == self.end
    }

    /// After an error: the MPA length and the DDP/RDMAP header bytes (as far as received, up to
    /// 18) of the offending FPDU, for [`super::Terminate::with_ddp`]. None if the error came
    /// before a length was read.
    pub fn offending_segment(&self) -> Option<(u16, &[u8])> {
        self.offending
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
        let done = match self.step(src, placer) {
            Ok(Some(d)) => d,
            Ok(None) => return Ok(None),
            Err(e) => {
                self.state = State::Failed;
                return Err(e);
            }
        };
        let written_back = matches!(done.kind, DoneKind::Placed(true));
        let data = match done.kind {
            DoneKind::Placed(_) => Delivered::Placed,
            DoneKind::Buffered(a, b) => Delivered::Buffered(self.ring.bytes(a..b)),
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

    fn step<R: Read + ReadVolatile, P: Placer>(
        &mut self,
        src: &mut R,
        placer: &mut P,
    ) -> Result<Option<Done>> {
        loop {
            match std::mem::replace(&mut self.state, State::Idle) {
                State::Failed => {
                    self.state = State::Failed;
                    return Err(WireError::Closed {
                        during: "receive after a failed FPDU",
                    });
                }
                State::Idle => {
                    if let Some(d) = self.parse(placer)? {
                        return Ok(Some(d));
                    }
                    if !matches!(self.state, State::Idle) {
                        continue;
                    }
                    let want = self.want();
                    if !self.fill(src, want)? {
                        return Ok(None);
                    }
                }
                State::Gathering {
                    header,
                    hl,
                    ulpdu_len,
                    kind,
                } => {
                    let total = fpdu_len(ulpdu_len);
                    if self.end - self.start >= total {
                        return self.deliver(header, hl, ulpdu_len, kind).map(Some);
                    }
                    self.state = State::Gathering {
                        header,
                        hl,
                        ulpdu_len,
                        kind,
                    };
                    if !self.fill(src, total)? {
                        return Ok(None);
                    }
                }
                State::Streaming {
                    header,
                    ulpdu_len,
                    dst,
                    mut done,
                } => {
                    let payload_len = ulpdu_len - header.len();
                    let n = (self.end - self.start).min(payload_len - done);
                    // dst.len() >= payload_len was checked in `decide`.
                    let rest = dst
                        .dst
                        .subslice(done, payload_len - done)
                        .map_err(|_| too_short(payload_len, &dst))?;
                    if n > 0 {
                        place_copy(rest, self.ring.bytes(self.start..self.start + n))
                            .map_err(|_| too_short(payload_len, &dst))?;
                        self.start += n;
                        done += n;
                    }
                    if done == payload_len {
                        let left = pad_len(ulpdu_len) + 4;
                        self.state = State::Trailer {
                            header,
                            ulpdu_len,
                            left,
                        };
                        continue;
                    }
                    // Our buffer is empty here: the same readv brings the trailer and what
                    // follows (up to read-ahead) into it. The payload goes straight into place
                    // through an iovec: no `&mut [u8]` over registered memory that another
                    // poll loop may be placing into at the same time.
                    let want = payload_len - done;
                    let rest = dst
                        .dst
                        .subslice(done, want)
                        .map_err(|_| too_short(payload_len, &dst))?;
                    self.start = 0;
                    self.end = 0;
                    let ahead = READ_AHEAD.min(self.ring.cap());
                    let bufs = [rest, VolatileSlice::from(self.ring.bytes_mut(0..ahead))];
                    match src.read_volatile(&bufs) {
                        Ok(0) => {
                            return Err(WireError::Closed {
                                during: "FPDU payload",
                            })
                        }
                        Ok(k) => {
                            done += k.min(want);
                            self.end = k.saturating_sub(want);
                        }
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                            self.state = State::Streaming {
                                header,
                                ulpdu_len,
                                dst,
                                done,
                            };
                            return Ok(None);
                        }
                        Err(e) => return Err(WireError::io("FPDU payload", e)),
                    }
                    self.state = State::Streaming {
                        header,
                        ulpdu_len,
                        dst,
                        done,
                    };
                }
                State::Trailer {
                    header,
                    ulpdu_len,
                    mut left,
                } => {
                    let n = (self.end - self.start).min(left);
                    self.start += n;
                    left -= n;
                    if left == 0 {
                        return Ok(Some(Done {
                            header,
                            ulpdu_len,
                            kind: DoneKind::Placed(false),
                        }));
                    }
                    self.state = State::Trailer {
                        header,
                        ulpdu_len,
                        left,
                    };
                    if !self.fill(src, left)? {
                        return Ok(None);
                    }
                }
            }
        }
    }

    /// Bytes wanted from `start` before `parse` can make progress in the Idle state.
    fn want(&self) -> usize {
        let avail = self.ring.bytes(self.start..self.end);
        if avail.len() < 2 {
            return 3;
        }
        let total = fpdu_len(u16::from_be_bytes([avail[0], avail[1]]) as usize);
        if self.cfg.crc {
            total
        } else {
            let hl = Header::peek_len(&avail[2..]).unwrap_or(TAGGED_HDR_LEN);
            (2 + hl).min(total)
        }
    }

    /// Reads until `want` bytes are buffered from `start` or the source would block
    /// (returns false then).
    fn fill<R: Read>(&mut self, src: &mut R, want: usize) -> Result<bool> {
        if self.start == self.end {
            (self.start, self.end) = (0, 0);
        } else if self.start >= self.ring.cap() {
            (self.start, self.end) = self.ring.wrap(self.start, self.end);
        }
        // The free space behind the data: the ring never moves what it holds.
        let len = self.start + self.ring.cap();
        while self.end - self.start < want {
            // With CRC off, read only a little past what is needed so that a direct payload
            // mostly bypasses this buffer.
            let limit = if self.cfg.crc {
                len
            } else {
                (self.start + want).max(self.end + READ_AHEAD).min(len)
            };
            match src.read(self.ring.bytes_mut(self.end..limit)) {
                Ok(0) => {
                    return Err(WireError::Closed {
                        during: "FPDU receive",
                    })
                }
                Ok(n) => self.end += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) => return Err(WireError::io("FPDU receive", e)),
            }
        }
        Ok(true)
    }

    fn note_offending(&mut self, ulpdu_len: usize) {
        let avail = self.ring.bytes(self.start..self.end);
        let mut hdr = [0u8; UNTAGGED_HDR_LEN];
        let hl = avail
            .get(2..)
            .and_then(Header::peek_len)
            .unwrap_or(UNTAGGED_HDR_LEN);
        let n = avail.len().saturating_sub(2).min(ulpdu_len).min(hl);
        hdr[..n].copy_from_slice(&avail[2..2 + n]);
        self.offending = Some((ulpdu_len as u16, hdr, n));
    }

    /// In the Idle state: judges the next FPDU as far as the buffered bytes allow.
    fn parse<P: Placer>(&mut self, placer: &mut P) -> Result<Option<Done>> {
        let avail = self.end - self.start;
        if avail < 2 {
            return Ok(None);
        }
        let b = self.ring.bytes(self.start..self.end);
        let ulpdu_len = u16::from_be_bytes([b[0], b[1]]) as usize;
        let total = fpdu_len(ulpdu_len);
        if ulpdu_len > self.cfg.max_ulpdu {
            self.note_offending(ulpdu_len);
            return Err(WireError::UlpduTooLong {
                ulpdu_len,
                max: self.cfg.max_ulpdu,
            });
        }
        if self.cfg.crc {
            if avail < total {
                return Ok(None);
            }
            self.note_offending(ulpdu_len);
            let b = self.ring.bytes(self.start..self.start + total);
            let computed = crc32c(&b[..total - 4]);
            let received =
                u32::from_le_bytes([b[total - 4], b[total - 3], b[total - 2], b[total - 1]]);
            if computed != received {
                return Err(WireError::BadCrc { computed, received });
            }
            let (header, hl) = self.judge_header(ulpdu_len)?;
            let kind = self.decide(header, hl, ulpdu_len, placer)?;
            return self.deliver(header, hl, ulpdu_len, kind).map(Some);
        }
        // CRC off: judge the header as soon as it is in.
        let Some(hl) = Header::peek_len(&b[2..]) else {
            return Ok(None);
        };
        if avail < (2 + hl).min(total) {
            return Ok(None);
        }
        self.note_offending(ulpdu_len);
        let (header, hl) = self.judge_header(ulpdu_len)?;
        let kind = self.decide(header, hl, ulpdu_len, placer)?;
        // A payload that is (nearly) all in or within read-ahead is gathered and copied: one
        // syscall, where reading it into place would take two (payload, then the trailer).
        let payload_len = ulpdu_len - hl;
        let buffered = avail - (2 + hl);
        let direct = payload_len.saturating_sub(buffered) > READ_AHEAD;
        match kind {
            // Into a file: gathered, then one pwrite (never read from the stream into place).
            Kind::Direct(dst) if direct && dst.file.is_none() => {
                self.start += 2 + hl;
                self.state = State::Streaming {
                    header,
                    ulpdu_len,
                    dst,
                    done: 0,
                };
                Ok(None)
            }
            kind => {
                self.state = State::Gathering {
                    header,
                    hl,
                    ulpdu_len,
                    kind,
                };
                Ok(None)
            }
        }
    }

    /// Decodes and checks the header of the FPDU at `start` (its header bytes are buffered).
    fn judge_header(&self, ulpdu_len: usize) -> Result<(Header, usize)> {
        let b = self.ring.bytes(self.start..self.end);
        let ulpdu = &b[2..(2 + ulpdu_len).min(b.len())];
        let hl = Header::peek_len(ulpdu).unwrap_or(UNTAGGED_HDR_LEN);
        if ulpdu_len < hl {
            // Blame the lowest layer that can be judged from the ULPDU's own bytes (its control
            // bytes; the rest of the header is missing).
            let opcode = match ulpdu {
                [ddp, rdmap, ..] => {
                    let tagged = ddp & super::ddp::DDP_TAGGED != 0;
                    if ddp & 0x03 != super::ddp::DDP_VERSION {
                        return Err(WireError::BadDdpVersion {
                            version: ddp & 0x03,
                            tagged,
                        });
                    }
                    if rdmap & 0xC0 != super::ddp::RDMAP_VERSION {
                        return Err(WireError::BadRdmapVersion {
                            version: rdmap >> 6,
                        });
                    }
                    Some(
                        Opcode::from_u8(rdmap & 0x0F).ok_or(WireError::UnknownOpcode {
                            opcode: rdmap & 0x0F,
                        })?,
                    )
                }
                _ => None,
            };
            return Err(WireError::UlpduTooShort {
                opcode,
                ulpdu_len,
                need: hl,
            });
        }
        let (header, hl) = Header::decode(&ulpdu[..hl])?;
        self.cfg.check_allowed(header.opcode)?;
        let payload_len = ulpdu_len - hl;
        if let Some(expected) = body_len(header.opcode) {
            if payload_len != expected {
                return Err(WireError::BadBodyLength {
                    opcode: header.opcode,
                    len: payload_len,
                    expected,
                });
            }
        }
        Ok((header, hl))
    }

    fn decide<P: Placer>(
        &self,
        header: Header,
        hl: usize,
        ulpdu_len: usize,
        placer: &mut P,
    ) -> Result<Kind> {
        if !header.opcode.carries_data() {
            return Ok(Kind::Control);
        }
        let payload_len = ulpdu_len - hl;
        match placer.place(&header, payload_len) {
            Err(cause) => Err(WireError::Refused {
                opcode: header.opcode,
                cause,
            }),
            Ok(Placement::Direct(dst)) if dst.len() < payload_len => {
                Err(too_short(payload_len, &dst))
            }
            Ok(Placement::Direct(dst)) => Ok(Kind::Direct(dst)),
            Ok(Placement::Buffer) => Ok(Kind::Buffer),
            Ok(Placement::Discard) => Ok(Kind::Discard),
        }
    }

    /// The whole FPDU is buffered at `start` and judged: place or decode it, consume it.
    fn deliver(&mut self, header: Header, hl: usize, ulpdu_len: usize, kind: Kind) -> Result<Done> {
        let (a, b) = (self.start + 2 + hl, self.start + 2 + ulpdu_len);
        let kind = match kind {
            Kind::Direct(DirectTarget {
                file: Some((fd, at)),
                ..
            }) => {
                place_pwrite(fd, at, self.ring.bytes(a..b))
                    .map_err(|source| WireError::PlacementFailed { len: b - a, source })?;
                DoneKind::Placed(false)
            }
            // dst.len() >= b - a was checked in `decide`.
            Kind::Direct(dst) if dst.writeback => DoneKind::Placed(
                place_copy_writeback(dst.dst, self.ring.bytes(a..b))
                    .map_err(|_| too_short(b - a, &dst))?,
            ),
            Kind::Direct(dst) => {
                place_copy(dst.dst, self.ring.bytes(a..b)).map_err(|_| too_short(b - a, &dst))?;
                DoneKind::Placed(false)
            }
            Kind::Buffer => DoneKind::Buffered(a, b),
            Kind::Discard => DoneKind::Discarded,
            Kind::Control => match Body::decode(header.opcode, self.ring.bytes(a..b))? {
                Some(body) => DoneKind::Control(body),
                None => DoneKind::Discarded,
            },
        };
        self.start += fpdu_len(ulpdu_len);
        Ok(Done {
            header,
            ulpdu_len,
            kind,
        })
    }
}

fn too_short(need: usize, dst: &DirectTarget) -> WireError {
    WireError::PlacementTooShort {
        need,
        given: dst.len(),
    }
}

#[cfg(test)]
mod tests;
