//! RDMAP message bodies: RFC 5040 Read Request, RFC 7306 Atomic Request/Response, and the
//! private Flush Request, Atomic Write Request and their response. Each body follows the
//! untagged header (offset 20 of the FPDU) and has a fixed length; docs/protocol.md shows every
//! byte.

use super::codes::Opcode;
use super::cursor::{Reader, Writer};
use super::error::{Result, WireError};

/// RDMA Read Request (RFC 5040 §4.4), QN 1.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ReadRequest {
    /// STag of the requester's sink buffer (the Read Response's STag).
    pub sink_stag: u32,
    /// Tagged offset in the sink buffer.
    pub sink_to: u64,
    /// Bytes to read.
    pub size: u32,
    /// STag of the responder's source buffer.
    pub src_stag: u32,
    /// Tagged offset in the source buffer.
    pub src_to: u64,
}

impl ReadRequest {
    /// Body length.
    pub const LEN: usize = 28;

    /// Encodes the body.
    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        Writer::new(&mut b)
            .u32(self.sink_stag)
            .u64(self.sink_to)
            .u32(self.size)
            .u32(self.src_stag)
            .u64(self.src_to);
        b
    }

    /// Decodes the body (extra bytes are an error: the length is fixed).
    ///
    /// # Errors
    /// [`WireError::Truncated`] or [`WireError::BadBodyLength`].
    pub fn decode(b: &[u8]) -> Result<Self> {
        let mut r = fixed(b, Opcode::ReadRequest, Self::LEN, "Read Request")?;
        Ok(ReadRequest {
            sink_stag: r.u32()?,
            sink_to: r.u64()?,
            size: r.u32()?,
            src_stag: r.u32()?,
            src_to: r.u64()?,
        })
    }
}

pub(super) fn fixed<'a>(
    b: &'a [u8],
    opcode: Opcode,
    len: usize,
    what: &'static str,
) -> Result<Reader<'a>> {
    if b.len() > len {
        return Err(WireError::BadBodyLength {
            opcode,
            len: b.len(),
            expected: len,
        });
    }
    Ok(Reader::new(b, what))
}

/// RFC 7306 atomic operation codes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum AtomicOp {
    /// Fetch and add.
    FetchAdd = 0,
    /// Compare and swap.
    CompareSwap = 2,
}

/// RFC 7306 Atomic Request, QN 1 (counts against IRD/ORD like a Read).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AtomicRequest {
    /// The operation.
    pub op: AtomicOp,
    /// Request identifier, echoed by the response.
    pub req_id: u32,
    /// STag of the target.
    pub stag: u32,
    /// Tagged offset of the 8-byte target (8-byte aligned).
    pub to: u64,
    /// FetchAdd: the addend. CompareSwap: the swap value.
    pub add_swap: u64,
    /// FetchAdd: bits where carries stop (0 = plain 64-bit add). CompareSwap: the bits swapped.
    pub add_swap_mask: u64,
    /// CompareSwap: the compare value (0 for FetchAdd).
    pub compare: u64,
    /// CompareSwap: the bits compared (0 for FetchAdd).
    pub compare_mask: u64,
}

impl AtomicRequest {
    /// Body length.
    pub const LEN: usize = 52;

    /// A plain 64-bit fetch-and-add.
    pub fn fetch_add(req_id: u32, stag: u32, to: u64, add: u64) -> Self {
        AtomicRequest {
            op: AtomicOp::FetchAdd,
            req_id,
            stag,
            to,
            add_swap: add,
            add_swap_mask: 0,
            compare: 0,
            compare_mask: 0,
        }
    }

    /// A plain 64-bit compare-and-swap.
    pub fn compare_swap(req_id: u32, stag: u32, to: u64, compare: u64, swap: u64) -> Self {
        AtomicRequest {
            op: AtomicOp::CompareSwap,
            req_id,
            stag,
            to,
            add_swap: swap,
            add_swap_mask: u64::MAX,
            compare,
            compare_mask: u64::MAX,
        }
    }

    /// Encodes the body.
    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        Writer::new(&mut b)
            .u32(self.op as u32)
            .u32(self.req_id)
            .u32(self.stag)
            .u64(self.to)
            .u64(self.add_swap)
            .u64(self.add_swap_mask)
            .u64(self.compare)
            .u64(self.compare_mask);
        b
    }

    /// Decodes the body. The 28 reserved bits before the atomic opcode are ignored.
    ///
    /// # Errors
    /// [`WireError::Truncated`], [`WireError::BadBodyLength`], or [`WireError::BadField`] for an
    /// atomic opcode other than 0 and 2.
    pub fn decode(b: &[u8]) -> Result<Self> {
        let mut r = fixed(b, Opcode::AtomicRequest, Self::LEN, "Atomic Request")?;
        let op = match r.u32()? & 0x0F {
            0 => AtomicOp::FetchAdd,
            2 => AtomicOp::CompareSwap,
            v => {
                return Err(WireError::BadField {
                    what: "atomic opcode",
                    value: v.into(),
                })
            }
        };
        Ok(AtomicRequest {
            op,
            req_id: r.u32()?,
            stag: r.u32()?,
            to: r.u64()?,
            add_swap: r.u64()?,
            add_swap_mask: r.u64()?,
            compare: r.u64()?,
            compare_mask: r.u64()?,
        })
    }
}

/// RFC 7306 Atomic Response, QN 3.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AtomicResponse {
    /// The request identifier being answered.
    pub req_id: u32,
    /// The target's value before the operation.
    pub original: u64,
}

impl AtomicResponse {
    /// Body length.
    pub const LEN: usize = 12;

    /// Encodes the body.
    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        Writer::new(&mut b).u32(self.req_id).u64(self.original);
        b
    }

    /// Decodes the body.
    ///
    /// # Errors
    /// [`WireError::Truncated`] or [`WireError::BadBodyLength`].
    pub fn decode(b: &[u8]) -> Result<Self> {
        let mut r = fixed(b, Opcode::AtomicResponse, Self::LEN, "Atomic Response")?;
        Ok(AtomicResponse {
            req_id: r.u32()?,
            original: r.u64()?,
        })
    }
}

/// Where a Flush makes data land (IBTA placement type).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum FlushPlacement {
    /// Global visibility: placed data visible to every reader of the memory.
    Visibility = 0x01,
    /// Persistence: placed data durable in the memory's persistence domain (implies visibility).
    Persistent = 0x02,
}

/// What a Flush covers (IBTA selectivity).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FlushSelectivity {
    /// A byte range of one region.
    Range {
        /// STag of the region.
        stag: u32,
        /// Tagged offset of the first byte.
        to: u64,
        /// Bytes.
        len: u64,
    },
    /// The whole region.
    Region {
        /// STag of the region.
        stag: u32,
    },
}

/// Private Flush Request (opcode 0xC, QN 1; counts against IRD/ORD).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FlushRequest {
    /// Request identifier, echoed by the response.
    pub req_id: u32,
    /// Visibility or persistence.
    pub placement: FlushPlacement,
    /// Range or whole region.
    pub selectivity: FlushSelectivity,
}

impl FlushRequest {
    /// Body length.
    pub const LEN: usize = 28;

    /// Encodes the body.
    pub fn encode(&self) -> [u8; Self::LEN] {
        let (sel, stag, to, len) = match self.selectivity {
            FlushSelectivity::Range { stag, to, len } => (0u8, stag, to, len),
            FlushSelectivity::Region { stag } => (1u8, stag, 0, 0),
        };
        let mut b = [0u8; Self::LEN];
        Writer::new(&mut b)
            .u32(self.req_id)
            .u8(self.placement as u8)
            .u8(sel)
            .u16(0)
            .u32(stag)
            .u64(to)
            .u64(len);
        b
    }

    /// Decodes the body. Reserved bytes, and TO/length of a whole-region flush, are ignored.
    ///
    /// # Errors
    /// [`WireError::Truncated`], [`WireError::BadBodyLength`], or [`WireError::BadField`] for a
    /// placement type other than 1 or 2 or a selectivity other than 0 or 1.
    pub fn decode(b: &[u8]) -> Result<Self> {
        let mut r = fixed(b, Opcode::FlushRequest, Self::LEN, "Flush Request")?;
        let req_id = r.u32()?;
        let placement = match r.u8()? {
            0x01 => FlushPlacement::Visibility,
            0x02 => FlushPlacement::Persistent,
            v => {
                return Err(WireError::BadField {
                    what: "flush placement type",
                    value: v.into(),
                })
            }
        };
        let sel = r.u8()?;
        r.skip(2)?;
        let (stag, to, len) = (r.u32()?, r.u64()?, r.u64()?);
        let selectivity = match sel {
            0 => FlushSelectivity::Range { stag, to, len },
            1 => FlushSelectivity::Region { stag },
            v => {
                return Err(WireError::BadField {
                    what: "flush selectivity",
                    value: v.into(),
                })
            }
        };
        Ok(FlushRequest {
            req_id,
            placement,
            selectivity,
        })
    }
}

/// Private Atomic Write Request (opcode 0xD, QN 1; counts against IRD/ORD).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AtomicWriteRequest {
    /// Request identifier, echoed by the response.
    pub req_id: u32,
    /// STag of the target.
    pub stag: u32,
    /// Tagged offset of the 8-byte target (8-byte aligned).
    pub to: u64,
    /// The 8 bytes to place, in memory order (as `ibv_wr_atomic_write` takes them).
    pub data: [u8; 8],
}

impl AtomicWriteRequest {
    /// Body length.
    pub const LEN: usize = 24;

    /// Encodes the body.
    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        Writer::new(&mut b)
            .u32(self.req_id)
            .u32(self.stag)
            .u64(self.to)
            .put(&self.data);
        b
    }

    /// Decodes the body.
    ///
    /// # Errors
    /// [`WireError::Truncated`] or [`WireError::BadBodyLength`].
    pub fn decode(b: &[u8]) -> Result<Self> {
        let mut r = fixed(
            b,
            Opcode::AtomicWriteRequest,
            Self::LEN,
            "Atomic Write Request",
        )?;
        Ok(AtomicWriteRequest {
            req_id: r.u32()?,
            stag: r.u32()?,
            to: r.u64()?,
            data: r.array()?,
        })
    }
}

/// Private response to a Flush or Atomic Write Request (opcode 0xE, QN 3). It is sent once the
/// request has been carried out; a failed request is answered by a Terminate instead.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PrivateResponse {
    /// The request identifier being answered.
    pub req_id: u32,
    /// The opcode of the request: [`Opcode::FlushRequest`] or [`Opcode::AtomicWriteRequest`].
    pub request: Opcode,
}

impl PrivateResponse {
    /// Body length.
    pub const LEN: usize = 8;

    /// Encodes the body.
    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        Writer::new(&mut b)
            .u32(self.req_id)
            .u8(self.request as u8)
            .put(&[0, 0, 0]);
        b
    }

    /// Decodes the body.
    ///
    /// # Errors
    /// [`WireError::Truncated`], [`WireError::BadBodyLength`], or [`WireError::BadField`] if the
    /// answered opcode is not 0xC or 0xD.
    pub fn decode(b: &[u8]) -> Result<Self> {
        let mut r = fixed(b, Opcode::PrivateResponse, Self::LEN, "private response")?;
        let req_id = r.u32()?;
        let request = match r.u8()? {
            0x0C => Opcode::FlushRequest,
            0x0D => Opcode::AtomicWriteRequest,
            v => {
                return Err(WireError::BadField {
                    what: "answered opcode",
                    value: v.into(),
                })
            }
        };
        r.skip(3)?;
        Ok(PrivateResponse { req_id, request })
    }
}

/// The fixed body length of a control message (None for data and for Terminate, whose body
/// is variable).
pub const fn body_len(opcode: Opcode) -> Option<usize> {
    match opcode {
        Opcode::ReadRequest => Some(ReadRequest::LEN),
        Opcode::ImmediateData | Opcode::ImmediateDataSe => Some(8),
        Opcode::AtomicRequest => Some(AtomicRequest::LEN),
        Opcode::AtomicResponse => Some(AtomicResponse::LEN),
        Opcode::FlushRequest => Some(FlushRequest::LEN),
        Opcode::AtomicWriteRequest => Some(AtomicWriteRequest::LEN),
        Opcode::PrivateResponse => Some(PrivateResponse::LEN),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read_request_golden() {
        let rr = ReadRequest {
            sink_stag: 0x0A0B_0C0D,
            sink_to: 0x1000,
            size: 4096,
            src_stag: 0x1122_3344,
            src_to: 0x0000_7F00_0000_0008,
        };
        let want = [
            0x0A, 0x0B, 0x0C, 0x0D, // sink STag
            0, 0, 0, 0, 0, 0, 0x10, 0x00, // sink TO
            0, 0, 0x10, 0x00, // size
            0x11, 0x22, 0x33, 0x44, // source STag
            0, 0, 0x7F, 0, 0, 0, 0, 0x08, // source TO
        ];
        assert_eq!(rr.encode(), want);
        assert_eq!(ReadRequest::decode(&want).unwrap(), rr);
    }

    #[test]
    fn atomic_request_golden() {
        let a = AtomicRequest::compare_swap(7, 0x55, 0x40, 0x1111, 0x2222);
        let mut want = vec![
            0, 0, 0, 2, 0, 0, 0, 7, 0, 0, 0, 0x55, 0, 0, 0, 0, 0, 0, 0, 0x40,
        ];
        want.extend_from_slice(&0x2222u64.to_be_bytes());
        want.extend_from_slice(&[0xFF; 8]);
        want.extend_from_slice(&0x1111u64.to_be_bytes());
        want.extend_from_slice(&[0xFF; 8]);
        assert_eq!(a.encode().as_slice(), &want[..]);
        assert_eq!(AtomicRequest::decode(&want).unwrap(), a);

        let f = AtomicRequest::fetch_add(1, 2, 8, 5);
        let b = f.encode();
        assert_eq!(&b[..4], &[0, 0, 0, 0]);
        assert_eq!(&b[20..28], &5u64.to_be_bytes());
        assert_eq!(&b[28..], &[0u8; 24]);
        assert_eq!(AtomicRequest::decode(&b).unwrap(), f);
        // Reserved bits are ignored; an unknown atomic opcode is not.
        let mut r = b;
        r[0] = 0xFF;
        assert_eq!(AtomicRequest::decode(&r).unwrap(), f);
        r[3] = 1;
        assert!(matches!(
            AtomicRequest::decode(&r),
            Err(WireError::BadField {
                what: "atomic opcode",
                value: 1
            })
        ));
    }

    #[test]
    fn atomic_response_golden() {
        let a = AtomicResponse {
            req_id: 0x0102_0304,
            original: 0x1122_3344_5566_7788,
        };
        let want = [1, 2, 3, 4, 0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88];
        assert_eq!(a.encode(), want);
        assert_eq!(AtomicResponse::decode(&want).unwrap(), a);
    }

    #[test]
    fn flush_request_golden() {
        let f = FlushRequest {
            req_id: 9,
            placement: FlushPlacement::Persistent,
            selectivity: FlushSelectivity::Range {
                stag: 0xABCD,
                to: 0x2000,
                len: 0x1_0000_0000,
            },
        };
        let want = [
            0, 0, 0, 9, // request id
            0x02, 0x00, 0, 0, // persistence, range, reserved
            0, 0, 0xAB, 0xCD, // STag
            0, 0, 0, 0, 0, 0, 0x20, 0x00, // TO
            0, 0, 0, 0x01, 0, 0, 0, 0, // length
        ];
        assert_eq!(f.encode(), want);
        assert_eq!(FlushRequest::decode(&want).unwrap(), f);

        let g = FlushRequest {
            req_id: 1,
            placement: FlushPlacement::Visibility,
            selectivity: FlushSelectivity::Region { stag: 3 },
        };
        let b = g.encode();
        assert_eq!(&b[..12], &[0, 0, 0, 1, 0x01, 0x01, 0, 0, 0, 0, 0, 3]);
        assert_eq!(&b[12..], &[0u8; 16]);
        assert_eq!(FlushRequest::decode(&b).unwrap(), g);

        let mut bad = b;
        bad[4] = 3;
        assert!(matches!(
            FlushRequest::decode(&bad),
            Err(WireError::BadField { value: 3, .. })
        ));
        let mut bad = b;
        bad[5] = 2;
        assert!(matches!(
            FlushRequest::decode(&bad),
            Err(WireError::BadField {
                what: "flush selectivity",
                value: 2
            })
        ));
    }

    #[test]
    fn atomic_write_and_private_response_golden() {
        let a = AtomicWriteRequest {
            req_id: 2,
            stag: 0x10,
            to: 0x18,
            data: *b"ABCDEFGH",
        };
        let want = [
            0, 0, 0, 2, 0, 0, 0, 0x10, 0, 0, 0, 0, 0, 0, 0, 0x18, b'A', b'B', b'C', b'D', b'E',
            b'F', b'G', b'H',
        ];
        assert_eq!(a.encode(), want);
        assert_eq!(AtomicWriteRequest::decode(&want).unwrap(), a);

        let p = PrivateResponse {
            req_id: 2,
            request: Opcode::AtomicWriteRequest,
        };
        assert_eq!(p.encode(), [0, 0, 0, 2, 0x0D, 0, 0, 0]);
        assert_eq!(PrivateResponse::decode(&p.encode()).unwrap(), p);
        let p = PrivateResponse {
            req_id: 3,
            request: Opcode::FlushRequest,
        };
        assert_eq!(p.encode(), [0, 0, 0, 3, 0x0C, 0, 0, 0]);
        assert!(matches!(
            PrivateResponse::decode(&[0, 0, 0, 3, 0x01, 0, 0, 0]),
            Err(WireError::BadField {
                what: "answered opcode",
                value: 1
            })
        ));
    }

    #[test]
    fn wrong_body_lengths_are_errors() {
        let rr = [0u8; 29];
        assert!(matches!(
            ReadRequest::decode(&rr),
            Err(WireError::BadBodyLength {
                len: 29,
                expected: 28,
                ..
            })
        ));
        assert!(matches!(
            ReadRequest::decode(&rr[..27]),
            Err(WireError::Truncated { .. })
        ));
        assert!(AtomicRequest::decode(&[0u8; 51]).is_err());
        assert!(AtomicResponse::decode(&[0u8; 13]).is_err());
        assert!(FlushRequest::decode(&[0u8; 20]).is_err());
        assert!(AtomicWriteRequest::decode(&[0u8; 23]).is_err());
        assert!(PrivateResponse::decode(&[0u8; 4]).is_err());
    }
}
