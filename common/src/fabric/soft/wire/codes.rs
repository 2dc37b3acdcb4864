//! The codes the three layers put in their frames: RDMAP opcodes with the DDP queues they
//! travel on (RFC 5040, RFC 5041, RFC 7306 and this project's private opcodes), the MPA frame
//! kinds (RFC 5044), the Terminate causes (RFC 5040 §7.2, RFC 5041 §7, RFC 5044 §8,
//! RFC 6581 §6). Plain values at the bottom of the wire layer: its errors name them, and
//! nothing here parses or fails.

/// Untagged queue 0: Send, Send with Invalidate/Solicited Event, Immediate Data.
pub const QN_SEND: u32 = 0;
/// Untagged queue 1: Read Requests, RFC 7306 Atomic Requests and the private Flush and Atomic
/// Write Requests: everything that counts against IRD/ORD.
pub const QN_READ_REQUEST: u32 = 1;
/// Untagged queue 2: Terminate.
pub const QN_TERMINATE: u32 = 2;
/// Untagged queue 3: RFC 7306 Atomic Responses and the private responses.
pub const QN_RESPONSE: u32 = 3;

/// RDMAP opcodes: RFC 5040, RFC 7306, and the private ones in 0xC-0xE (docs/protocol.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Opcode {
    /// RDMA Write (tagged).
    Write = 0x0,
    /// RDMA Read Request (untagged, QN 1).
    ReadRequest = 0x1,
    /// RDMA Read Response (tagged, to the sink STag/TO of the request).
    ReadResponse = 0x2,
    /// Send (QN 0).
    Send = 0x3,
    /// Send with Invalidate (QN 0, STag to invalidate in the header).
    SendInvalidate = 0x4,
    /// Send with Solicited Event.
    SendSe = 0x5,
    /// Send with Solicited Event and Invalidate.
    SendSeInvalidate = 0x6,
    /// Terminate (QN 2).
    Terminate = 0x7,
    /// RFC 7306 Immediate Data: 8 bytes, QN 0.
    ImmediateData = 0x8,
    /// RFC 7306 Immediate Data with Solicited Event.
    ImmediateDataSe = 0x9,
    /// RFC 7306 Atomic Request (QN 1).
    AtomicRequest = 0xA,
    /// RFC 7306 Atomic Response (QN 3).
    AtomicResponse = 0xB,
    /// Private: Flush Request (QN 1), IBTA FLUSH semantics.
    FlushRequest = 0xC,
    /// Private: Atomic Write Request (QN 1), IBTA ATOMIC WRITE semantics.
    AtomicWriteRequest = 0xD,
    /// Private: the response to a Flush or Atomic Write Request (QN 3).
    PrivateResponse = 0xE,
}

impl Opcode {
    /// The opcode for a raw 4-bit value; None for 0xF (and anything above 4 bits), which the
    /// decoders answer with `WireError::UnknownOpcode`.
    pub const fn from_u8(v: u8) -> Option<Opcode> {
        use Opcode::*;
        Some(match v {
            0x0 => Write,
            0x1 => ReadRequest,
            0x2 => ReadResponse,
            0x3 => Send,
            0x4 => SendInvalidate,
            0x5 => SendSe,
            0x6 => SendSeInvalidate,
            0x7 => Terminate,
            0x8 => ImmediateData,
            0x9 => ImmediateDataSe,
            0xA => AtomicRequest,
            0xB => AtomicResponse,
            0xC => FlushRequest,
            0xD => AtomicWriteRequest,
            0xE => PrivateResponse,
            _ => return None,
        })
    }

    /// Whether the opcode uses the tagged buffer model.
    pub const fn is_tagged(self) -> bool {
        matches!(self, Opcode::Write | Opcode::ReadResponse)
    }

    /// The untagged queue the opcode travels on (None for tagged opcodes).
    pub const fn queue(self) -> Option<u32> {
        use Opcode::*;
        match self {
            Write | ReadResponse => None,
            Send | SendInvalidate | SendSe | SendSeInvalidate | ImmediateData | ImmediateDataSe => {
                Some(QN_SEND)
            }
            ReadRequest | AtomicRequest | FlushRequest | AtomicWriteRequest => {
                Some(QN_READ_REQUEST)
            }
            Terminate => Some(QN_TERMINATE),
            AtomicResponse | PrivateResponse => Some(QN_RESPONSE),
        }
    }

    /// Whether this is one of the private opcodes (0xC-0xE).
    pub const fn is_private(self) -> bool {
        matches!(
            self,
            Opcode::FlushRequest | Opcode::AtomicWriteRequest | Opcode::PrivateResponse
        )
    }

    /// Whether the opcode carries user data (placed through the receiver's `Placer`); the
    /// others carry a fixed or small control body.
    pub const fn carries_data(self) -> bool {
        use Opcode::*;
        matches!(
            self,
            Write | ReadResponse | Send | SendInvalidate | SendSe | SendSeInvalidate
        )
    }

    /// Whether the message must be a single segment at offset 0 (a control message).
    pub const fn is_single_segment(self) -> bool {
        !self.carries_data()
    }
}

/// Request (active side) or Reply (passive side).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MpaKind {
    /// `MPA ID Req Frame`.
    Request,
    /// `MPA ID Rep Frame`.
    Reply,
}

/// The layer a Terminate blames.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Layer {
    /// RDMAP (RFC 5040).
    Rdmap = 0,
    /// DDP (RFC 5041).
    Ddp = 1,
    /// The lower layer protocol: MPA (RFC 5044).
    Mpa = 2,
}

impl Layer {
    /// The layer for a raw 4-bit value; None above 2.
    pub(crate) const fn from_u8(v: u8) -> Option<Layer> {
        match v {
            0 => Some(Layer::Rdmap),
            1 => Some(Layer::Ddp),
            2 => Some(Layer::Mpa),
            _ => None,
        }
    }
}

/// A Terminate cause: layer, error type, error code.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TermCause {
    /// The layer.
    pub layer: Layer,
    /// The error type (4 bits).
    pub etype: u8,
    /// The error code.
    pub ecode: u8,
}

const fn cause(layer: Layer, etype: u8, ecode: u8) -> TermCause {
    TermCause {
        layer,
        etype,
        ecode,
    }
}

#[allow(missing_docs)] // The names are the RFCs' own; docs/protocol.md tabulates them.
impl TermCause {
    // RDMAP, RFC 5040 §7.2.
    pub const RDMAP_LOCAL_CATASTROPHIC: Self = cause(Layer::Rdmap, 0, 0);
    pub const RDMAP_INVALID_STAG: Self = cause(Layer::Rdmap, 1, 0x00);
    pub const RDMAP_BASE_BOUNDS: Self = cause(Layer::Rdmap, 1, 0x01);
    pub const RDMAP_ACCESS_RIGHTS: Self = cause(Layer::Rdmap, 1, 0x02);
    pub const RDMAP_STAG_NOT_ASSOCIATED: Self = cause(Layer::Rdmap, 1, 0x03);
    pub const RDMAP_TO_WRAP: Self = cause(Layer::Rdmap, 1, 0x04);
    pub const RDMAP_PROTECTION_CANNOT_INVALIDATE: Self = cause(Layer::Rdmap, 1, 0x09);
    pub const RDMAP_PROTECTION_UNSPECIFIED: Self = cause(Layer::Rdmap, 1, 0xFF);
    pub const RDMAP_VERSION: Self = cause(Layer::Rdmap, 2, 0x05);
    pub const RDMAP_UNEXPECTED_OPCODE: Self = cause(Layer::Rdmap, 2, 0x06);
    pub const RDMAP_CATASTROPHIC_STREAM: Self = cause(Layer::Rdmap, 2, 0x07);
    pub const RDMAP_CATASTROPHIC_GLOBAL: Self = cause(Layer::Rdmap, 2, 0x08);
    pub const RDMAP_CANNOT_INVALIDATE: Self = cause(Layer::Rdmap, 2, 0x09);
    pub const RDMAP_OPERATION_UNSPECIFIED: Self = cause(Layer::Rdmap, 2, 0xFF);
    // DDP, RFC 5041 §7.
    pub const DDP_LOCAL_CATASTROPHIC: Self = cause(Layer::Ddp, 0, 0);
    pub const DDP_TAGGED_INVALID_STAG: Self = cause(Layer::Ddp, 1, 0x00);
    pub const DDP_TAGGED_BASE_BOUNDS: Self = cause(Layer::Ddp, 1, 0x01);
    pub const DDP_TAGGED_STAG_NOT_ASSOCIATED: Self = cause(Layer::Ddp, 1, 0x02);
    pub const DDP_TAGGED_TO_WRAP: Self = cause(Layer::Ddp, 1, 0x03);
    pub const DDP_TAGGED_VERSION: Self = cause(Layer::Ddp, 1, 0x04);
    pub const DDP_UNTAGGED_INVALID_QN: Self = cause(Layer::Ddp, 2, 0x01);
    pub const DDP_UNTAGGED_NO_BUFFER: Self = cause(Layer::Ddp, 2, 0x02);
    pub const DDP_UNTAGGED_MSN_RANGE: Self = cause(Layer::Ddp, 2, 0x03);
    pub const DDP_UNTAGGED_INVALID_MO: Self = cause(Layer::Ddp, 2, 0x04);
    pub const DDP_UNTAGGED_TOO_LONG: Self = cause(Layer::Ddp, 2, 0x05);
    pub const DDP_UNTAGGED_VERSION: Self = cause(Layer::Ddp, 2, 0x06);
    // MPA (LLP), RFC 5044 §8 and RFC 6581 §6; error type 0 = MPA error.
    pub const MPA_TCP_LOST: Self = cause(Layer::Mpa, 0, 0x01);
    pub const MPA_CRC: Self = cause(Layer::Mpa, 0, 0x02);
    pub const MPA_LENGTH_MISMATCH: Self = cause(Layer::Mpa, 0, 0x03);
    pub const MPA_INVALID_REQ_REP: Self = cause(Layer::Mpa, 0, 0x04);
    pub const MPA_LOCAL_CATASTROPHIC: Self = cause(Layer::Mpa, 0, 0x05);
    pub const MPA_INSUFFICIENT_IRD: Self = cause(Layer::Mpa, 0, 0x06);
    pub const MPA_NO_MATCHING_RTR: Self = cause(Layer::Mpa, 0, 0x07);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opcode_table() {
        for v in 0u8..=0xE {
            let op = Opcode::from_u8(v).unwrap();
            assert_eq!(op as u8, v);
            assert_eq!(op.queue().is_none(), op.is_tagged());
        }
        assert_eq!(Opcode::from_u8(0xF), None);
        assert!(Opcode::FlushRequest.is_private());
        assert!(!Opcode::AtomicRequest.is_private());
    }
}
