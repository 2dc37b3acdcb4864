//! DDP (RFC 5041) and RDMAP (RFC 5040, RFC 7306) headers: the control bytes, the tagged and
//! untagged buffer models, and the opcode table including this project's private opcodes.
//!
//! Offsets below are from the start of the ULPDU (the MPA length precedes it):
//!
//! | offset | size | tagged (T=1) | untagged (T=0) |
//! |---|---|---|---|
//! | 0 | 1 | DDP control: T 0x80, L 0x40, DV 0x03 = 1 | same |
//! | 1 | 1 | RDMAP control: RV 0xC0 = 1, opcode 0x0F | same |
//! | 2 | 4 | STag | Invalidate STag (Send with Invalidate) or zero |
//! | 6 | 8 | Tagged Offset | QN (4), MSN (4) |
//! | 14 | 4 | payload | MO |
//! | 18 | | | payload |

pub use super::codes::{Opcode, QN_READ_REQUEST, QN_RESPONSE, QN_SEND, QN_TERMINATE};
use super::error::{Result, WireError};

/// DDP control: T, the tagged buffer model.
pub const DDP_TAGGED: u8 = 0x80;
/// DDP control: L, the last segment of a message.
pub const DDP_LAST: u8 = 0x40;
/// DDP version 1 in the DV bits.
pub const DDP_VERSION: u8 = 0x01;
/// RDMAP version 1 in the RV bits.
pub const RDMAP_VERSION: u8 = 0x40;

/// Length of the tagged DDP/RDMAP header.
pub const TAGGED_HDR_LEN: usize = 14;
/// Length of the untagged DDP/RDMAP header.
pub const UNTAGGED_HDR_LEN: usize = 18;

/// The DDP/RDMAP header length for an opcode: 14 if tagged, else 18.
pub const fn header_len(opcode: Opcode) -> usize {
    if opcode.is_tagged() {
        TAGGED_HDR_LEN
    } else {
        UNTAGGED_HDR_LEN
    }
}

/// The buffer model part of a header.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HeaderKind {
    /// Tagged: placement at (STag, TO).
    Tagged {
        /// Steering tag of the sink buffer.
        stag: u32,
        /// Tagged offset of this segment's first byte.
        to: u64,
    },
    /// Untagged: the MO-th byte of message MSN on queue QN.
    Untagged {
        /// The STag to invalidate (Send with Invalidate), else zero.
        inv_stag: u32,
        /// Queue number.
        qn: u32,
        /// Message sequence number, per queue, from 1.
        msn: u32,
        /// Message offset of this segment's first byte.
        mo: u32,
    },
}

/// A DDP/RDMAP segment header.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Header {
    /// The RDMAP opcode.
    pub opcode: Opcode,
    /// L: the last segment of the message.
    pub last: bool,
    /// Buffer model fields.
    pub kind: HeaderKind,
}

/// An encoded header, at most 18 bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeaderBytes {
    bytes: [u8; UNTAGGED_HDR_LEN],
    len: u8,
}

impl HeaderBytes {
    /// The encoded bytes.
    pub fn as_slice(&self) -> &[u8] {
        &self.bytes[..self.len as usize]
    }
}

impl Header {
    /// A tagged header (Write, Read Response).
    pub fn tagged(opcode: Opcode, stag: u32, to: u64, last: bool) -> Header {
        Header {
            opcode,
            last,
            kind: HeaderKind::Tagged { stag, to },
        }
    }

    /// An untagged header on the opcode's own queue, MO 0.
    pub fn untagged(opcode: Opcode, msn: u32, last: bool) -> Header {
        Header {
            opcode,
            last,
            kind: HeaderKind::Untagged {
                inv_stag: 0,
                qn: opcode.queue().unwrap_or(0),
                msn,
                mo: 0,
            },
        }
    }

    /// Encoded length: 14 (tagged) or 18 (untagged).
    pub fn len(&self) -> usize {
        match self.kind {
            HeaderKind::Tagged { .. } => TAGGED_HDR_LEN,
            HeaderKind::Untagged { .. } => UNTAGGED_HDR_LEN,
        }
    }

    /// Never: a header has at least its two control bytes.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// This header advanced by `n` payload bytes: TO or MO plus `n` (wrapping, as on the wire).
    pub fn advanced(&self, n: usize) -> Header {
        let mut h = *self;
        match &mut h.kind {
            HeaderKind::Tagged { to, .. } => *to = to.wrapping_add(n as u64),
            HeaderKind::Untagged { mo, .. } => *mo = mo.wrapping_add(n as u32),
        }
        h
    }

    /// Encodes into the front of `buf` and returns the length written (14 or 18).
    ///
    /// The buffer model comes from `kind`; a caller that pairs an opcode with the wrong model
    /// gets exactly that on the wire (the peer will reject it), which lets tests build bad frames.
    ///
    /// # Panics
    /// If `buf` is shorter than [`Header::len`].
    pub fn encode_into(&self, buf: &mut [u8]) -> usize {
        let last = if self.last { DDP_LAST } else { 0 };
        let op = self.opcode as u8;
        match self.kind {
            HeaderKind::Tagged { stag, to } => {
                buf[0] = DDP_TAGGED | last | DDP_VERSION;
                buf[1] = RDMAP_VERSION | op;
                buf[2..6].copy_from_slice(&stag.to_be_bytes());
                buf[6..14].copy_from_slice(&to.to_be_bytes());
                TAGGED_HDR_LEN
            }
            HeaderKind::Untagged {
                inv_stag,
                qn,
                msn,
                mo,
            } => {
                buf[0] = last | DDP_VERSION;
                buf[1] = RDMAP_VERSION | op;
                buf[2..6].copy_from_slice(&inv_stag.to_be_bytes());
                buf[6..10].copy_from_slice(&qn.to_be_bytes());
                buf[10..14].copy_from_slice(&msn.to_be_bytes());
                buf[14..18].copy_from_slice(&mo.to_be_bytes());
                UNTAGGED_HDR_LEN
            }
        }
    }

    /// Encodes into a small array.
    pub fn encode(&self) -> HeaderBytes {
        let mut bytes = [0u8; UNTAGGED_HDR_LEN];
        let len = self.encode_into(&mut bytes) as u8;
        HeaderBytes { bytes, len }
    }

    /// The header length announced by a ULPDU's first byte (the T bit), if present.
    pub fn peek_len(ulpdu: &[u8]) -> Option<usize> {
        ulpdu.first().map(|c| {
            if c & DDP_TAGGED != 0 {
                TAGGED_HDR_LEN
            } else {
                UNTAGGED_HDR_LEN
            }
        })
    }

    /// Decodes and validates the header at the front of a ULPDU; returns it and its length.
    ///
    /// Checked, in this order (the first failure wins, as its Terminate cause blames the lowest
    /// layer): DDP version, RDMAP version, opcode known, buffer model matching the opcode, queue
    /// number matching the opcode, control messages in one segment at MO 0. Reserved bits are
    /// ignored, as RFC 5040/5041 ask of receivers.
    ///
    /// # Errors
    /// [`WireError::Truncated`], [`WireError::BadDdpVersion`], [`WireError::BadRdmapVersion`],
    /// [`WireError::UnknownOpcode`], [`WireError::UnexpectedOpcode`],
    /// [`WireError::BadQueueNumber`], [`WireError::BadMessageOffset`].
    pub fn decode(ulpdu: &[u8]) -> Result<(Header, usize)> {
        let mut r = super::cursor::Reader::new(ulpdu, "DDP header");
        let ddp = r.u8()?;
        let rdmap = r.u8()?;
        let tagged = ddp & DDP_TAGGED != 0;
        let last = ddp & DDP_LAST != 0;
        if ddp & 0x03 != DDP_VERSION {
            return Err(WireError::BadDdpVersion {
                version: ddp & 0x03,
                tagged,
            });
        }
        if rdmap & 0xC0 != RDMAP_VERSION {
            return Err(WireError::BadRdmapVersion {
                version: rdmap >> 6,
            });
        }
        let opcode = Opcode::from_u8(rdmap & 0x0F).ok_or(WireError::UnknownOpcode {
            opcode: rdmap & 0x0F,
        })?;
        if opcode.is_tagged() != tagged {
            return Err(WireError::UnexpectedOpcode {
                opcode,
                reason: if tagged {
                    "tagged segment"
                } else {
                    "untagged segment"
                },
            });
        }
        let first = r.u32()?;
        let kind = if tagged {
            HeaderKind::Tagged {
                stag: first,
                to: r.u64()?,
            }
        } else {
            let (qn, msn, mo) = (r.u32()?, r.u32()?, r.u32()?);
            HeaderKind::Untagged {
                inv_stag: first,
                qn,
                msn,
                mo,
            }
        };
        if let (HeaderKind::Untagged { qn, mo, .. }, Some(expected)) = (kind, opcode.queue()) {
            if qn != expected {
                return Err(WireError::BadQueueNumber {
                    opcode,
                    qn,
                    expected,
                });
            }
            if opcode.is_single_segment() && (mo != 0 || !last) {
                return Err(WireError::BadMessageOffset { opcode, mo, last });
            }
        }
        Ok((Header { opcode, last, kind }, r.position()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_header_golden() {
        let h = Header::tagged(Opcode::Write, 0x1122_3344, 0x0102_0304_0506_0708, true);
        let b = h.encode();
        assert_eq!(
            b.as_slice(),
            [0xC1, 0x40, 0x11, 0x22, 0x33, 0x44, 1, 2, 3, 4, 5, 6, 7, 8]
        );
        assert_eq!(Header::decode(b.as_slice()).unwrap(), (h, 14));
        // Not last: L clear.
        let h = Header::tagged(Opcode::Write, 1, 0, false);
        assert_eq!(h.encode().as_slice()[..2], [0x81, 0x40]);
    }

    #[test]
    fn read_response_header_golden() {
        let h = Header::tagged(Opcode::ReadResponse, 0xAABB_CCDD, 0x10, true);
        assert_eq!(
            h.encode().as_slice(),
            [0xC1, 0x42, 0xAA, 0xBB, 0xCC, 0xDD, 0, 0, 0, 0, 0, 0, 0, 0x10]
        );
        assert_eq!(Header::decode(h.encode().as_slice()).unwrap().0, h);
    }

    #[test]
    fn untagged_headers_golden() {
        let cases: &[(Opcode, u8, u32)] = &[
            (Opcode::ReadRequest, 0x41, 1),
            (Opcode::Send, 0x43, 0),
            (Opcode::SendInvalidate, 0x44, 0),
            (Opcode::SendSe, 0x45, 0),
            (Opcode::SendSeInvalidate, 0x46, 0),
            (Opcode::Terminate, 0x47, 2),
            (Opcode::ImmediateData, 0x48, 0),
            (Opcode::ImmediateDataSe, 0x49, 0),
            (Opcode::AtomicRequest, 0x4A, 1),
            (Opcode::AtomicResponse, 0x4B, 3),
            (Opcode::FlushRequest, 0x4C, 1),
            (Opcode::AtomicWriteRequest, 0x4D, 1),
            (Opcode::PrivateResponse, 0x4E, 3),
        ];
        for &(op, ctrl, qn) in cases {
            let mut h = Header::untagged(op, 0x0102_0304, true);
            if op == Opcode::SendInvalidate {
                if let HeaderKind::Untagged { inv_stag, .. } = &mut h.kind {
                    *inv_stag = 0xDEAD_BEEF;
                }
            }
            let inv: [u8; 4] = if op == Opcode::SendInvalidate {
                [0xDE, 0xAD, 0xBE, 0xEF]
            } else {
                [0; 4]
            };
            let mut want = vec![0x41, ctrl];
            want.extend_from_slice(&inv);
            want.extend_from_slice(&qn.to_be_bytes());
            want.extend_from_slice(&[1, 2, 3, 4, 0, 0, 0, 0]);
            assert_eq!(h.encode().as_slice(), &want[..], "{op:?}");
            assert_eq!(Header::decode(&want).unwrap(), (h, 18), "{op:?}");
        }
    }

    #[test]
    fn segmented_send_header_golden() {
        let h = Header::untagged(Opcode::Send, 7, false).advanced(1436);
        assert_eq!(
            h.encode().as_slice(),
            [0x01, 0x43, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 7, 0, 0, 0x05, 0x9C]
        );
        let t = Header::tagged(Opcode::Write, 9, u64::MAX, false).advanced(2);
        assert_eq!(t.kind, HeaderKind::Tagged { stag: 9, to: 1 });
    }

    #[test]
    fn malformed_headers_rejected_with_the_right_cause() {
        let good = Header::untagged(Opcode::Send, 1, true).encode();
        let g = good.as_slice();
        let cases: Vec<(Vec<u8>, TermCause)> = vec![
            (g[..17].to_vec(), TermCause::RDMAP_OPERATION_UNSPECIFIED),
            (vec![], TermCause::RDMAP_OPERATION_UNSPECIFIED),
            (
                [&[0x42u8][..], &g[1..]].concat(),
                TermCause::DDP_UNTAGGED_VERSION,
            ),
            (
                [&[0xC0u8][..], &g[1..]].concat(),
                TermCause::DDP_TAGGED_VERSION,
            ),
            (
                [&[0x41u8, 0x83][..], &g[2..]].concat(),
                TermCause::RDMAP_VERSION,
            ),
            (
                [&[0x41u8, 0x4F][..], &g[2..]].concat(),
                TermCause::RDMAP_UNEXPECTED_OPCODE,
            ),
            // A tagged Send and an untagged Write.
            (
                [&[0xC1u8][..], &g[1..]].concat(),
                TermCause::RDMAP_UNEXPECTED_OPCODE,
            ),
            (
                [&[0x41u8, 0x40][..], &g[2..]].concat(),
                TermCause::RDMAP_UNEXPECTED_OPCODE,
            ),
        ];
        for (bytes, cause) in cases {
            let err = Header::decode(&bytes).unwrap_err();
            assert_eq!(err.terminate_cause(), cause, "{bytes:02x?}: {err}");
        }
        // A Send on QN 1.
        let mut h = Header::untagged(Opcode::Send, 1, true);
        h.kind = HeaderKind::Untagged {
            inv_stag: 0,
            qn: 1,
            msn: 1,
            mo: 0,
        };
        let err = Header::decode(h.encode().as_slice()).unwrap_err();
        assert!(matches!(
            err,
            WireError::BadQueueNumber {
                qn: 1,
                expected: 0,
                ..
            }
        ));
        assert_eq!(err.terminate_cause(), TermCause::DDP_UNTAGGED_INVALID_QN);
        // A Read Request in two segments.
        let h = Header::untagged(Opcode::ReadRequest, 1, false);
        let err = Header::decode(h.encode().as_slice()).unwrap_err();
        assert_eq!(err.terminate_cause(), TermCause::DDP_UNTAGGED_INVALID_MO);
        let h = Header::untagged(Opcode::AtomicRequest, 1, true).advanced(4);
        let err = Header::decode(h.encode().as_slice()).unwrap_err();
        assert!(matches!(err, WireError::BadMessageOffset { mo: 4, .. }));
    }

    use super::super::TermCause;
}
