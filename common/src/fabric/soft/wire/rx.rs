//! Receive side: FPDUs cut out of a (non-blocking) byte stream that splits and packs them
//! arbitrarily, checked, and their payloads placed where a [`Placer`] says.
//!
//! Integrity before placement:
//! - CRC on: the whole FPDU is gathered in the receiver's buffer, its CRC checked, then its
//!   header decoded, then the placer asked, then the payload copied into place
//!   ([`place_copy`], the one function that writes received bytes into registered memory).
//! - CRC off: the header is decoded and checked and the placer asked as soon as the header is in;
//!   a direct payload is then read from the stream straight into place (bytes already read ahead
//!   are copied), with no staging.
//!
//! Any error leaves nothing placed for the offending FPDU (with CRC off, an I/O error or EOF
//! in the middle of a direct payload can leave a prefix of it written, as on any RDMA NIC) and
//! poisons the receiver: the caller answers with a Terminate for
//! [`WireError::terminate_cause`], quoting [`FpduReceiver::offending_segment`], and closes.

use std::io::{self, Read};

use super::caps::CapFlags;
use super::ddp::{Header, Opcode, TAGGED_HDR_LEN, UNTAGGED_HDR_LEN};
use super::mpa::Negotiated;
use super::rdmap::Body;
use super::terminate::TermCause;
use super::tx::MIN_MAX_ULPDU;
use super::{crc32c, fpdu_len, pad_len, Result, WireError, MAX_ULPDU_LIMIT};

/// With CRC off, how far past the bytes it needs the receiver reads ahead. Small enough that a
/// large direct payload mostly lands straight in place, large enough to batch small FPDUs.
pub const READ_AHEAD: usize = 4096;

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

/// Registered memory a payload is placed into.
#[derive(Debug)]
pub struct DirectTarget {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: `DirectTarget::new`'s contract makes the range writable from whichever thread polls
// the receiver; the pointer is only dereferenced by the receiver that holds it.
unsafe impl Send for DirectTarget {}

impl DirectTarget {
    /// A placement at `ptr` for up to `len` bytes.
    ///
    /// # Safety
    /// From the moment this is returned to the receiver until the `poll` call that reports the
    /// FPDU (or fails, or the receiver is dropped): `ptr..ptr + len` is valid for writes from the
    /// polling thread, does not overlap the receiver's own buffer, and nothing reads or writes it
    /// through another reference (the receiver may form a `&mut [u8]` over it to `read` into).
    /// The caller has checked STag, bounds and rights for it.
    pub unsafe fn new(ptr: *mut u8, len: usize) -> DirectTarget {
        DirectTarget { ptr, len }
    }

    /// Bytes available at the target.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the target is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
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
    Placed,
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
    buf: Box<[u8]>,
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

/// Copies a checked payload into its placement: the one place where received bytes are written
/// into registered memory on the staged path (a non-temporal copy, which doubles as the cache
/// write-back for pmem, would go here).
///
/// # Safety
/// `dst` must be valid for writes of `src.len()` bytes and must not overlap `src`.
pub unsafe fn place_copy(dst: *mut u8, src: &[u8]) {
    // SAFETY: the caller guarantees `dst` is writable for `src.len()` bytes and disjoint.
    unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) }
}

impl FpduReceiver {
    /// A receiver; its buffer holds two maximal FPDUs.
    pub fn new(cfg: RxConfig) -> FpduReceiver {
        let size = (2 * fpdu_len(cfg.max_ulpdu)).max(2 * READ_AHEAD);
        FpduReceiver {
            cfg,
            buf: vec![0u8; size].into_boxed_slice(),
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
    pub fn poll<R: Read, P: Placer>(
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
        let data = match done.kind {
            DoneKind::Placed => Delivered::Placed,
            DoneKind::Buffered(a, b) => Delivered::Buffered(&self.buf[a..b]),
            DoneKind::Discarded => Delivered::Discarded,
            DoneKind::Control(body) => Delivered::Control(body),
        };
        Ok(Some(Received {
            header: done.header,
            ulpdu_len: done.ulpdu_len,
            payload_len: done.ulpdu_len - done.header.len(),
            data,
        }))
    }

    fn step<R: Read, P: Placer>(&mut self, src: &mut R, placer: &mut P) -> Result<Option<Done>> {
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
                    if n > 0 {
                        // SAFETY: DirectTarget's contract: `dst` is writable for dst.len bytes
                        // (>= payload_len, checked in parse) and disjoint from our buffer.
                        unsafe {
                            place_copy(dst.ptr.add(done), &self.buf[self.start..self.start + n])
                        };
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
                    // SAFETY: as above; done < payload_len <= dst.len, and no other reference to
                    // the range exists while the receiver holds the target.
                    let rest = unsafe {
                        std::slice::from_raw_parts_mut(dst.ptr.add(done), payload_len - done)
                    };
                    match src.read(rest) {
                        Ok(0) => {
                            return Err(WireError::Closed {
                                during: "FPDU payload",
                            })
                        }
                        Ok(k) => done += k,
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
                            kind: DoneKind::Placed,
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
        let avail = &self.buf[self.start..self.end];
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
        let len = self.buf.len();
        if self.start > 0 && (self.start == self.end || self.end > len / 2) {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        while self.end - self.start < want {
            // With CRC off, read only a little past what is needed so that a direct payload
            // mostly bypasses this buffer.
            let limit = if self.cfg.crc {
                len
            } else {
                (self.start + want).max(self.end + READ_AHEAD).min(len)
            };
            match src.read(&mut self.buf[self.end..limit]) {
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
        let avail = &self.buf[self.start..self.end];
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
        let b = &self.buf[self.start..self.end];
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
            let b = &self.buf[self.start..self.start + total];
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
        match kind {
            Kind::Direct(dst) => {
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
        let b = &self.buf[self.start..self.end];
        let ulpdu = &b[2..(2 + ulpdu_len).min(b.len())];
        let hl = Header::peek_len(ulpdu).unwrap_or(UNTAGGED_HDR_LEN);
        if ulpdu_len < hl {
            // Blame the lowest layer that can be judged from what the ULPDU holds.
            let opcode = match Header::decode(&b[2..]) {
                Ok((h, _)) => Some(h.opcode),
                Err(WireError::Truncated { .. }) => None,
                Err(e) => return Err(e),
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
        if let Some(expected) = header.opcode.body_len() {
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
            Ok(Placement::Direct(dst)) if dst.len < payload_len => {
                Err(WireError::PlacementTooShort {
                    need: payload_len,
                    given: dst.len,
                })
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
            Kind::Direct(dst) => {
                // SAFETY: DirectTarget's contract; dst.len >= b - a was checked in `decide`, and
                // the target does not overlap our buffer.
                unsafe { place_copy(dst.ptr, &self.buf[a..b]) };
                DoneKind::Placed
            }
            Kind::Buffer => DoneKind::Buffered(a, b),
            Kind::Discard => DoneKind::Discarded,
            Kind::Control => match Body::decode(header.opcode, &self.buf[a..b])? {
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

#[cfg(test)]
mod tests {
    use super::super::ddp::HeaderKind;
    use super::super::rdmap::{AtomicRequest, ReadRequest};
    use super::super::terminate::Terminate;
    use super::super::tx::{encode_fpdu, segment, TxConfig};
    use super::*;
    use proptest::prelude::*;

    /// A source that hands out the stream in planned chunks, WouldBlock for `None`, and
    /// WouldBlock (or EOF when `eof`) at the end.
    struct Chunky<'a> {
        data: &'a [u8],
        pos: usize,
        plan: Vec<Option<usize>>,
        step: usize,
        eof: bool,
        blocked: bool,
    }

    impl<'a> Chunky<'a> {
        fn new(data: &'a [u8], plan: Vec<Option<usize>>) -> Self {
            Chunky {
                data,
                pos: 0,
                plan,
                step: 0,
                eof: false,
                blocked: false,
            }
        }
    }

    impl Read for Chunky<'_> {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            if self.pos == self.data.len() {
                return if self.eof {
                    Ok(0)
                } else {
                    Err(io::ErrorKind::WouldBlock.into())
                };
            }
            let p = if self.plan.is_empty() {
                Some(usize::MAX)
            } else {
                self.plan[self.step % self.plan.len()]
            };
            self.step += 1;
            // Never two WouldBlocks in a row: the stream always makes progress.
            match p {
                None if !self.blocked => {
                    self.blocked = true;
                    Err(io::ErrorKind::WouldBlock.into())
                }
                p => {
                    self.blocked = false;
                    let n = p.unwrap_or(1);
                    let n = n.max(1).min(buf.len()).min(self.data.len() - self.pos);
                    buf[..n].copy_from_slice(&self.data[self.pos..self.pos + n]);
                    self.pos += n;
                    Ok(n)
                }
            }
        }
    }

    /// Places tagged segments of STag 1 into `base[..len]`; buffers untagged ones.
    struct MemPlacer {
        base: *mut u8,
        len: usize,
        calls: usize,
        refuse: Option<TermCause>,
    }

    impl MemPlacer {
        fn new(mem: &mut [u8]) -> Self {
            MemPlacer {
                base: mem.as_mut_ptr(),
                len: mem.len(),
                calls: 0,
                refuse: None,
            }
        }
    }

    impl Placer for MemPlacer {
        fn place(
            &mut self,
            header: &Header,
            payload_len: usize,
        ) -> std::result::Result<Placement, TermCause> {
            self.calls += 1;
            if let Some(c) = self.refuse {
                return Err(c);
            }
            match header.kind {
                HeaderKind::Tagged { stag: 1, to } => {
                    let to = to as usize;
                    if to.checked_add(payload_len).is_none_or(|e| e > self.len) {
                        return Err(TermCause::DDP_TAGGED_BASE_BOUNDS);
                    }
                    // SAFETY: to + payload_len <= len, inside the test's memory, which nothing
                    // else touches while the receiver runs.
                    Ok(Placement::Direct(unsafe {
                        DirectTarget::new(self.base.add(to), payload_len)
                    }))
                }
                HeaderKind::Tagged { .. } => Err(TermCause::DDP_TAGGED_INVALID_STAG),
                HeaderKind::Untagged { .. } => Ok(Placement::Buffer),
            }
        }
    }

    #[derive(Debug, PartialEq, Eq, Clone)]
    enum Got {
        Placed(Header),
        Buffered(Header, Vec<u8>),
        Control(Header, Body),
    }

    fn drain<P: Placer>(
        rx: &mut FpduReceiver,
        src: &mut Chunky<'_>,
        placer: &mut P,
    ) -> Result<Vec<Got>> {
        let mut out = Vec::new();
        loop {
            match rx.poll(src, placer)? {
                None if src.pos == src.data.len() => break,
                None => {}
                Some(r) => {
                    assert_eq!(r.payload_len, r.ulpdu_len - r.header.len());
                    out.push(match r.data {
                        Delivered::Placed => Got::Placed(r.header),
                        Delivered::Buffered(b) => Got::Buffered(r.header, b.to_vec()),
                        Delivered::Control(body) => Got::Control(r.header, body),
                        Delivered::Discarded => panic!("nothing is discarded here"),
                    });
                }
            }
        }
        // Whatever the source's last read completed is out by now.
        if let Some(r) = rx.poll(src, placer)? {
            panic!("late FPDU {r:?}");
        }
        Ok(out)
    }

    fn all_caps(crc: bool, max: usize) -> RxConfig {
        RxConfig::new(crc, max, CapFlags::ALL).unwrap()
    }

    #[derive(Debug, Clone)]
    enum Msg {
        Write { to: usize, data: Vec<u8> },
        Send { data: Vec<u8> },
        Read(ReadRequest),
        Atomic(AtomicRequest),
    }

    fn msg() -> impl Strategy<Value = Msg> {
        prop_oneof![
            (
                0usize..4096,
                proptest::collection::vec(any::<u8>(), 0..3000)
            )
                .prop_map(|(to, data)| Msg::Write { to, data }),
            proptest::collection::vec(any::<u8>(), 0..600).prop_map(|data| Msg::Send { data }),
            (any::<u32>(), any::<u64>(), any::<u32>()).prop_map(|(s, t, n)| Msg::Read(
                ReadRequest {
                    sink_stag: s,
                    sink_to: t,
                    size: n,
                    src_stag: 1,
                    src_to: 8
                }
            )),
            (any::<u32>(), any::<u64>())
                .prop_map(|(id, add)| Msg::Atomic(AtomicRequest::fetch_add(id, 1, 16, add))),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

        /// Random messages, segmented by the tx code, fed in random chunks with WouldBlocks:
        /// every FPDU comes out, in order, and the memory holds exactly what was written.
        #[test]
        fn reassembles_any_split(
            msgs in proptest::collection::vec(msg(), 1..12),
            crc in any::<bool>(),
            max_ulpdu in 128usize..2048,
            plan in proptest::collection::vec(proptest::option::weighted(0.8, 1usize..700), 1..16),
        ) {
            let tx = TxConfig::new(crc, max_ulpdu).unwrap();
            let mut stream = Vec::new();
            let mut expect_mem = vec![0u8; 8192];
            let mut expect = Vec::new();
            let mut msn = 0u32;
            let mut rmsn = 0u32;
            for m in &msgs {
                match m {
                    Msg::Write { to, data } => {
                        expect_mem[*to..*to + data.len()].copy_from_slice(data);
                        let sg = [&data[..]];
                        for f in segment(Header::tagged(Opcode::Write, 1, *to as u64, false), &sg, &tx) {
                            f.append_to(&mut stream);
                            expect.push(Got::Placed(*f.header()));
                        }
                    }
                    Msg::Send { data } => {
                        msn += 1;
                        let sg = [&data[..]];
                        for f in segment(Header::untagged(Opcode::Send, msn, false), &sg, &tx) {
                            f.append_to(&mut stream);
                            let p: Vec<u8> = f.payload().flatten().copied().collect();
                            expect.push(Got::Buffered(*f.header(), p));
                        }
                    }
                    Msg::Read(rr) => {
                        rmsn += 1;
                        let h = Header::untagged(Opcode::ReadRequest, rmsn, true);
                        encode_fpdu(&h, &rr.encode(), crc, &mut stream).unwrap();
                        expect.push(Got::Control(h, Body::ReadRequest(*rr)));
                    }
                    Msg::Atomic(a) => {
                        rmsn += 1;
                        let h = Header::untagged(Opcode::AtomicRequest, rmsn, true);
                        encode_fpdu(&h, &a.encode(), crc, &mut stream).unwrap();
                        expect.push(Got::Control(h, Body::AtomicRequest(*a)));
                    }
                }
            }
            let mut mem = vec![0u8; 8192];
            let mut placer = MemPlacer::new(&mut mem);
            let mut rx = FpduReceiver::new(all_caps(crc, max_ulpdu));
            let mut src = Chunky::new(&stream, plan);
            let got = drain(&mut rx, &mut src, &mut placer).unwrap();
            prop_assert_eq!(src.pos, stream.len());
            prop_assert!(rx.is_idle());
            prop_assert_eq!(got, expect);
            prop_assert!(mem == expect_mem);
        }
    }

    #[test]
    fn packed_fpdus_in_one_read_and_eof() {
        let mut stream = Vec::new();
        for i in 0..5u32 {
            let h = Header::untagged(Opcode::Send, i + 1, true);
            encode_fpdu(&h, &[i as u8; 3], true, &mut stream).unwrap();
        }
        let mut mem = vec![0u8; 16];
        let mut placer = MemPlacer::new(&mut mem);
        let mut rx = FpduReceiver::new(all_caps(true, 1454));
        let mut src = Chunky::new(&stream, vec![]);
        src.eof = true;
        for i in 0..5u32 {
            let r = rx.poll(&mut src, &mut placer).unwrap().unwrap();
            assert_eq!(r.data, Delivered::Buffered(&[i as u8; 3]));
            if i == 0 {
                assert_eq!(src.step, 1, "all five arrive in one read");
            }
        }
        assert!(matches!(
            rx.poll(&mut src, &mut placer),
            Err(WireError::Closed { .. })
        ));
        // Poisoned from now on.
        assert!(matches!(
            rx.poll(&mut src, &mut placer),
            Err(WireError::Closed { .. })
        ));
    }

    #[test]
    fn eof_inside_a_direct_payload_is_closed() {
        let data = vec![9u8; 1000];
        let mut stream = Vec::new();
        encode_fpdu(
            &Header::tagged(Opcode::Write, 1, 0, true),
            &data,
            false,
            &mut stream,
        )
        .unwrap();
        stream.truncate(600);
        let mut mem = vec![0u8; 2048];
        let mut placer = MemPlacer::new(&mut mem);
        let mut rx = FpduReceiver::new(all_caps(false, 1454));
        let mut src = Chunky::new(&stream, vec![Some(100)]);
        src.eof = true;
        let err = loop {
            match rx.poll(&mut src, &mut placer) {
                Ok(None) => continue,
                Ok(Some(r)) => panic!("{r:?}"),
                Err(e) => break e,
            }
        };
        assert!(matches!(
            err,
            WireError::Closed {
                during: "FPDU payload"
            }
        ));
        assert_eq!(err.terminate_cause(), TermCause::MPA_TCP_LOST);
    }

    #[test]
    fn large_direct_payload_mostly_bypasses_the_buffer() {
        // CRC off, 60000-byte Write: the receiver reads the header with little read-ahead and
        // the rest straight into place.
        let data: Vec<u8> = (0..60000u32).map(|i| (i % 251) as u8).collect();
        let mut stream = Vec::new();
        encode_fpdu(
            &Header::tagged(Opcode::Write, 1, 100, true),
            &data,
            false,
            &mut stream,
        )
        .unwrap();
        let mut mem = vec![0u8; 65536];
        let mut placer = MemPlacer::new(&mut mem);
        let mut rx = FpduReceiver::new(all_caps(false, 65535));
        let mut src = Chunky::new(&stream, vec![]);
        let r = rx.poll(&mut src, &mut placer).unwrap().unwrap();
        assert_eq!(r.data, Delivered::Placed);
        assert_eq!(r.payload_len, 60000);
        // Header read with read-ahead, then one direct read, then the trailer.
        assert!(src.step <= 3, "{} reads", src.step);
        drop(rx);
        assert_eq!(&mem[100..60100], &data[..]);
    }

    /// A well-formed FPDU mutated by `f`, with its CRC recomputed when `crc`.
    fn mutated(h: Header, body: &[u8], crc: bool, f: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
        let mut v = Vec::new();
        encode_fpdu(&h, body, crc, &mut v).unwrap();
        f(&mut v);
        if crc {
            let n = v.len() - 4;
            let c = crc32c(&v[..n]).to_le_bytes();
            v[n..].copy_from_slice(&c);
        }
        v
    }

    fn reject(
        frame: &[u8],
        crc: bool,
        allowed: CapFlags,
        refuse: Option<TermCause>,
    ) -> (WireError, usize, Vec<u8>) {
        let mut mem = vec![0u8; 256];
        let mut placer = MemPlacer::new(&mut mem);
        placer.refuse = refuse;
        let mut rx = FpduReceiver::new(RxConfig::new(crc, 1454, allowed).unwrap());
        let mut src = Chunky::new(frame, vec![Some(7)]);
        let err = loop {
            match rx.poll(&mut src, &mut placer) {
                Ok(None) if src.pos == frame.len() => panic!("frame accepted as incomplete"),
                Ok(None) => continue,
                Ok(Some(r)) => panic!("accepted {r:?}"),
                Err(e) => break e,
            }
        };
        let calls = placer.calls;
        assert!(rx.offending_segment().is_some());
        drop(rx);
        (err, calls, mem)
    }

    #[test]
    fn malformed_frames_rejected_with_the_right_cause_and_nothing_placed() {
        let write = Header::tagged(Opcode::Write, 1, 0, true);
        let payload = [0xEEu8; 40];
        let rr = ReadRequest {
            sink_stag: 1,
            sink_to: 0,
            size: 8,
            src_stag: 1,
            src_to: 0,
        }
        .encode();
        let rreq = Header::untagged(Opcode::ReadRequest, 1, true);
        type Case = (
            &'static str,
            Vec<u8>,
            CapFlags,
            Option<TermCause>,
            TermCause,
        );
        for crc in [true, false] {
            let m = |h, body: &[u8], f: fn(&mut Vec<u8>)| mutated(h, body, crc, f);
            let mut cases: Vec<Case> = vec![
                (
                    "DDP version",
                    m(write, &payload, |v| v[2] = 0xC2),
                    CapFlags::ALL,
                    None,
                    TermCause::DDP_TAGGED_VERSION,
                ),
                (
                    "DDP version untagged",
                    m(rreq, &rr, |v| v[2] = 0x40),
                    CapFlags::ALL,
                    None,
                    TermCause::DDP_UNTAGGED_VERSION,
                ),
                (
                    "RDMAP version",
                    m(write, &payload, |v| v[3] = 0x80),
                    CapFlags::ALL,
                    None,
                    TermCause::RDMAP_VERSION,
                ),
                (
                    "opcode 0xF",
                    m(rreq, &rr, |v| v[3] = 0x4F),
                    CapFlags::ALL,
                    None,
                    TermCause::RDMAP_UNEXPECTED_OPCODE,
                ),
                (
                    "untagged Write",
                    m(write, &payload, |v| v[2] = 0x41),
                    CapFlags::ALL,
                    None,
                    TermCause::RDMAP_UNEXPECTED_OPCODE,
                ),
                (
                    "too long",
                    m(write, &payload, |v| {
                        v[..2].copy_from_slice(&1455u16.to_be_bytes())
                    }),
                    CapFlags::ALL,
                    None,
                    TermCause::MPA_LENGTH_MISMATCH,
                ),
                (
                    "wrong QN",
                    m(rreq, &rr, |v| v[11] = 0),
                    CapFlags::ALL,
                    None,
                    TermCause::DDP_UNTAGGED_INVALID_QN,
                ),
                (
                    "not negotiated",
                    mutated(
                        Header::untagged(Opcode::FlushRequest, 1, true),
                        &[0; 28],
                        crc,
                        |_| {},
                    ),
                    CapFlags::RFC7306_ATOMICS,
                    None,
                    TermCause::RDMAP_UNEXPECTED_OPCODE,
                ),
                (
                    "atomics not negotiated",
                    mutated(
                        Header::untagged(Opcode::AtomicRequest, 1, true),
                        &[0; 52],
                        crc,
                        |_| {},
                    ),
                    CapFlags::FLUSH,
                    None,
                    TermCause::RDMAP_UNEXPECTED_OPCODE,
                ),
                (
                    "short read request",
                    mutated(rreq, &rr[..27], crc, |_| {}),
                    CapFlags::ALL,
                    None,
                    TermCause::RDMAP_OPERATION_UNSPECIFIED,
                ),
                (
                    "bounds",
                    mutated(
                        Header::tagged(Opcode::Write, 1, 250, true),
                        &payload,
                        crc,
                        |_| {},
                    ),
                    CapFlags::ALL,
                    None,
                    TermCause::DDP_TAGGED_BASE_BOUNDS,
                ),
                (
                    "stag",
                    mutated(
                        Header::tagged(Opcode::Write, 2, 0, true),
                        &payload,
                        crc,
                        |_| {},
                    ),
                    CapFlags::ALL,
                    None,
                    TermCause::DDP_TAGGED_INVALID_STAG,
                ),
                (
                    "no recv",
                    mutated(
                        Header::untagged(Opcode::Send, 1, true),
                        &payload,
                        crc,
                        |_| {},
                    ),
                    CapFlags::ALL,
                    Some(TermCause::DDP_UNTAGGED_NO_BUFFER),
                    TermCause::DDP_UNTAGGED_NO_BUFFER,
                ),
            ];
            // ULPDU length 10: shorter than a tagged header; the FPDU is 16 bytes.
            let mut short = vec![0, 10, 0xC1, 0x40, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0];
            if crc {
                let c = crc32c(&short[..12]).to_le_bytes();
                short[12..].copy_from_slice(&c);
            }
            cases.push((
                "too short",
                short,
                CapFlags::ALL,
                None,
                TermCause::MPA_LENGTH_MISMATCH,
            ));
            if crc {
                cases.push((
                    "bad CRC",
                    mutated(write, &payload, false, |v| v[20] ^= 1),
                    CapFlags::ALL,
                    None,
                    TermCause::MPA_CRC,
                ));
            }
            for (name, frame, allowed, refuse, cause) in cases {
                let (err, calls, mem) = reject(&frame, crc, allowed, refuse);
                assert_eq!(err.terminate_cause(), cause, "{name} (crc {crc}): {err}");
                assert!(mem.iter().all(|&b| b == 0), "{name}: memory touched");
                if refuse.is_none() && !matches!(err, WireError::Refused { .. }) {
                    assert_eq!(calls, 0, "{name}: placer consulted");
                }
            }
        }
    }

    #[test]
    fn bad_crc_quotes_the_offending_header() {
        let h = Header::tagged(Opcode::Write, 1, 0x20, true);
        let mut v = Vec::new();
        encode_fpdu(&h, &[1, 2, 3, 4], true, &mut v).unwrap();
        v[18] ^= 0xFF; // a payload byte
        let mut mem = vec![0u8; 64];
        let mut placer = MemPlacer::new(&mut mem);
        let mut rx = FpduReceiver::new(all_caps(true, 1454));
        let err = rx
            .poll(&mut Chunky::new(&v, vec![]), &mut placer)
            .unwrap_err();
        assert!(matches!(err, WireError::BadCrc { .. }));
        let (seg_len, hdr) = rx.offending_segment().unwrap();
        assert_eq!(seg_len, 18);
        assert_eq!(hdr, h.encode().as_slice());
        let t = Terminate::new(err.terminate_cause()).with_ddp(seg_len, hdr);
        assert_eq!(&t.encode()[..6], &[0x20, 0x02, 0xC0, 0x00, 0x00, 18]);
        drop(rx);
        assert!(mem.iter().all(|&b| b == 0));
    }

    #[test]
    fn discard_and_control_bodies() {
        struct Drop1;
        impl Placer for Drop1 {
            fn place(&mut self, _: &Header, _: usize) -> std::result::Result<Placement, TermCause> {
                Ok(Placement::Discard)
            }
        }
        let mut v = Vec::new();
        encode_fpdu(
            &Header::tagged(Opcode::Write, 1, 0, true),
            &[5; 10],
            true,
            &mut v,
        )
        .unwrap();
        let t = Terminate::new(TermCause::RDMAP_ACCESS_RIGHTS);
        encode_fpdu(
            &Header::untagged(Opcode::Terminate, 1, true),
            &t.encode(),
            true,
            &mut v,
        )
        .unwrap();
        let mut rx = FpduReceiver::new(all_caps(true, 1454));
        let mut src = Chunky::new(&v, vec![]);
        let r = rx.poll(&mut src, &mut Drop1).unwrap().unwrap();
        assert_eq!(r.data, Delivered::Discarded);
        let r = rx.poll(&mut src, &mut Drop1).unwrap().unwrap();
        assert_eq!(r.data, Delivered::Control(Body::Terminate(t)));
        assert!(rx.poll(&mut src, &mut Drop1).unwrap().is_none());
    }

    #[test]
    fn placement_shorter_than_payload_is_an_error() {
        struct Short(Vec<u8>);
        impl Placer for Short {
            fn place(&mut self, _: &Header, _: usize) -> std::result::Result<Placement, TermCause> {
                // SAFETY: the vector outlives the receiver's use of it in this test.
                Ok(Placement::Direct(unsafe {
                    DirectTarget::new(self.0.as_mut_ptr(), self.0.len())
                }))
            }
        }
        let mut v = Vec::new();
        encode_fpdu(
            &Header::tagged(Opcode::Write, 1, 0, true),
            &[5; 10],
            false,
            &mut v,
        )
        .unwrap();
        let mut rx = FpduReceiver::new(all_caps(false, 1454));
        let mut p = Short(vec![0; 4]);
        let err = rx.poll(&mut Chunky::new(&v, vec![]), &mut p).unwrap_err();
        assert!(matches!(
            err,
            WireError::PlacementTooShort { need: 10, given: 4 }
        ));
        assert_eq!(p.0, [0; 4]);
    }

    #[test]
    fn config_limits() {
        assert!(RxConfig::new(true, 127, CapFlags::ALL).is_err());
        assert!(RxConfig::new(true, 65536, CapFlags::ALL).is_err());
        let n = Negotiated {
            crc: true,
            ird: 1,
            ord: 1,
            caps: super::super::Caps::foreign(vec![]),
            shared: CapFlags::FLUSH,
            rtr: None,
        };
        let c = RxConfig::from_negotiated(&n, 9000).unwrap();
        assert!(c.check_allowed(Opcode::FlushRequest).is_ok());
        assert!(c.check_allowed(Opcode::PrivateResponse).is_ok());
        assert!(c.check_allowed(Opcode::AtomicWriteRequest).is_err());
        assert!(c.check_allowed(Opcode::ImmediateData).is_err());
        assert!(c.check_allowed(Opcode::Send).is_ok());
    }
}
