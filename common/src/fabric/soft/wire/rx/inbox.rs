//! The receiver's side of the byte stream: what it buffered (a mirrored ring, filled with reads
//! that never go past what the state machine asked for by much), the judging of the FPDU at the
//! front (its header decoded and checked, the offending segment noted for a Terminate), and the
//! delivery of an FPDU buffered whole. The states that drive it are in the parent module.

use std::io::{self, Read};

use super::super::body::Body;
use super::super::codes::Opcode;
use super::super::ddp::{Header, TAGGED_HDR_LEN, UNTAGGED_HDR_LEN};
use super::super::error::{Result, WireError};
use super::super::fpdu_len;
use super::super::rdmap::body_len;
use super::super::ring::Ring;
use super::config::{RxConfig, READ_AHEAD};
use super::placer::{DirectTarget, Placer};

/// Where a judged FPDU's payload goes.
pub(super) enum Kind {
    Direct(DirectTarget),
    Buffer,
    Discard,
    Control,
}

pub(super) enum DoneKind {
    /// Placed; whether it was also written back from the cache.
    Placed(bool),
    Buffered(usize, usize),
    Discarded,
    Control(Body),
}

pub(super) struct Done {
    pub(super) header: Header,
    pub(super) ulpdu_len: usize,
    pub(super) kind: DoneKind,
}

/// The buffered stream of one receiver: `ring[start..end]` is received and not yet consumed.
pub(super) struct Inbox {
    pub(super) cfg: RxConfig,
    pub(super) ring: Ring,
    pub(super) start: usize,
    pub(super) end: usize,
    pub(super) offending: Option<(u16, [u8; UNTAGGED_HDR_LEN], usize)>,
}

impl Inbox {
    /// A buffer that holds two maximal FPDUs.
    pub(super) fn new(cfg: RxConfig) -> Inbox {
        let size = (2 * fpdu_len(cfg.max_ulpdu)).max(2 * READ_AHEAD);
        Inbox {
            cfg,
            ring: Ring::new(size),
            start: 0,
            end: 0,
            offending: None,
        }
    }

    /// Bytes buffered and not consumed.
    pub(super) fn avail(&self) -> usize {
        self.end - self.start
    }

    /// Bytes wanted from `start` before the Idle state can make progress.
    pub(super) fn want(&self) -> usize {
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
    pub(super) fn fill<R: Read>(&mut self, src: &mut R, want: usize) -> Result<bool> {
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
                Ok(n) => {
                    crate::steps::arrived();
                    self.end += n;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) => return Err(WireError::io("FPDU receive", e)),
            }
        }
        Ok(true)
    }

    pub(super) fn note_offending(&mut self, ulpdu_len: usize) {
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

    /// Decodes and checks the header of the FPDU at `start` (its header bytes are buffered).
    pub(super) fn judge_header(&self, ulpdu_len: usize) -> Result<(Header, usize)> {
        let b = self.ring.bytes(self.start..self.end);
        let ulpdu = &b[2..(2 + ulpdu_len).min(b.len())];
        let hl = Header::peek_len(ulpdu).unwrap_or(UNTAGGED_HDR_LEN);
        if ulpdu_len < hl {
            // Blame the lowest layer that can be judged from the ULPDU's own bytes (its control
            // bytes; the rest of the header is missing).
            let opcode = match ulpdu {
                [ddp, rdmap, ..] => {
                    let tagged = ddp & super::super::ddp::DDP_TAGGED != 0;
                    if ddp & 0x03 != super::super::ddp::DDP_VERSION {
                        return Err(WireError::BadDdpVersion {
                            version: ddp & 0x03,
                            tagged,
                        });
                    }
                    if rdmap & 0xC0 != super::super::ddp::RDMAP_VERSION {
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

    /// The whole FPDU is buffered at `start` and judged: have it placed (by the placer, which
    /// is handed the payload bytes) or decode it, consume it.
    pub(super) fn deliver<P: Placer>(
        &mut self,
        header: Header,
        hl: usize,
        ulpdu_len: usize,
        kind: Kind,
        placer: &mut P,
    ) -> Result<Done> {
        let (a, b) = (self.start + 2 + hl, self.start + 2 + ulpdu_len);
        let kind = match kind {
            // dst.len() >= b - a was checked in `decide`.
            Kind::Direct(dst) => DoneKind::Placed(placer.write(dst, self.ring.bytes(a..b))?),
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
