//! NVMe commands as they arrive (the 64-byte submission queue entry), their completions (the
//! 16-byte completion queue entry) and status codes: NVM Express Base Specification 2.0 and
//! NVMe over Fabrics 1.1, the fields this controller reads. Pure data: parsing takes a fixed
//! array, so it cannot fail or read out of bounds.

use std::fmt;

/// Admin command opcodes.
pub mod admin {
    /// Get Log Page.
    pub const GET_LOG_PAGE: u8 = 0x02;
    /// Identify.
    pub const IDENTIFY: u8 = 0x06;
    /// Abort.
    pub const ABORT: u8 = 0x08;
    /// Set Features.
    pub const SET_FEATURES: u8 = 0x09;
    /// Get Features.
    pub const GET_FEATURES: u8 = 0x0a;
    /// Asynchronous Event Request.
    pub const ASYNC_EVENT: u8 = 0x0c;
    /// Keep Alive.
    pub const KEEP_ALIVE: u8 = 0x18;
}

/// NVM command set (I/O) opcodes.
pub mod io {
    /// Flush.
    pub const FLUSH: u8 = 0x00;
    /// Write.
    pub const WRITE: u8 = 0x01;
    /// Read.
    pub const READ: u8 = 0x02;
    /// Write Zeroes.
    pub const WRITE_ZEROES: u8 = 0x08;
    /// Dataset Management.
    pub const DSM: u8 = 0x09;
}

/// The Fabrics command opcode (both queues).
pub const FABRICS: u8 = 0x7f;

/// Fabrics command types (FCTYPE, byte 4).
pub mod fctype {
    /// Property Set.
    pub const PROPERTY_SET: u8 = 0x00;
    /// Connect.
    pub const CONNECT: u8 = 0x01;
    /// Property Get.
    pub const PROPERTY_GET: u8 = 0x04;
    /// Authentication Send.
    pub const AUTH_SEND: u8 = 0x05;
    /// Authentication Receive.
    pub const AUTH_RECV: u8 = 0x06;
    /// Disconnect.
    pub const DISCONNECT: u8 = 0x08;
}

/// The namespace id that means every namespace.
pub const NSID_ALL: u32 = 0xffff_ffff;

/// SGL descriptor types (type << 4 | subtype) this transport uses.
pub mod sgl {
    /// Data Block, Offset subtype: in-capsule data at an offset (ICDOFF is 0 here).
    pub const IN_CAPSULE: u8 = 0x01;
    /// Transport Data Block, transport-specific subtype A: data moved by R2T/H2CData (writes)
    /// or C2HData (reads); the Linux host also uses it, with length 0, for "no data".
    pub const TRANSPORT: u8 = 0x5a;
}

/// The data pointer of a command: one SGL descriptor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sgl {
    /// Address (the in-capsule offset for [`sgl::IN_CAPSULE`]).
    pub addr: u64,
    /// Length in bytes.
    pub len: u32,
    /// Descriptor type and subtype (byte 15).
    pub kind: u8,
}

/// A submission queue entry.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Sqe {
    raw: [u8; 64],
}

impl fmt::Debug for Sqe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Sqe(opcode {:#04x}, cid {}, nsid {})",
            self.opcode(),
            self.cid(),
            self.nsid()
        )
    }
}

impl Sqe {
    /// The entry as received.
    pub fn new(raw: [u8; 64]) -> Sqe {
        Sqe { raw }
    }

    /// Its bytes.
    pub fn bytes(&self) -> &[u8; 64] {
        &self.raw
    }

    /// A byte.
    pub fn u8_at(&self, at: usize) -> u8 {
        self.raw[at % 64]
    }

    /// A little-endian u16 at byte `at` (< 63).
    pub fn u16_at(&self, at: usize) -> u16 {
        let at = at.min(62);
        u16::from_le_bytes([self.raw[at], self.raw[at + 1]])
    }

    /// A little-endian u32 at byte `at` (< 61).
    pub fn u32_at(&self, at: usize) -> u32 {
        let at = at.min(60);
        u32::from_le_bytes([
            self.raw[at],
            self.raw[at + 1],
            self.raw[at + 2],
            self.raw[at + 3],
        ])
    }

    /// A little-endian u64 at byte `at` (< 57).
    pub fn u64_at(&self, at: usize) -> u64 {
        let at = at.min(56);
        u64::from(self.u32_at(at)) | u64::from(self.u32_at(at + 4)) << 32
    }

    /// Opcode.
    pub fn opcode(&self) -> u8 {
        self.raw[0]
    }

    /// Flags: FUSE (bits 1:0) and PSDT (bits 7:6).
    pub fn flags(&self) -> u8 {
        self.raw[1]
    }

    /// Command identifier.
    pub fn cid(&self) -> u16 {
        self.u16_at(2)
    }

    /// Namespace identifier (the FCTYPE byte is its first byte in a Fabrics command).
    pub fn nsid(&self) -> u32 {
        self.u32_at(4)
    }

    /// FCTYPE of a Fabrics command.
    pub fn fctype(&self) -> u8 {
        self.raw[4]
    }

    /// The data pointer.
    pub fn sgl(&self) -> Sgl {
        Sgl {
            addr: self.u64_at(24),
            len: self.u32_at(32),
            kind: self.raw[39],
        }
    }

    /// Command dword `n` (10..=15).
    pub fn cdw(&self, n: usize) -> u32 {
        self.u32_at(40 + 4 * (n.clamp(10, 15) - 10))
    }
}

/// A status: the Status Code Type and Status Code, and Do Not Retry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Status {
    /// SCT (0 generic, 1 command specific, 2 media and data integrity).
    pub sct: u8,
    /// SC.
    pub sc: u8,
    /// DNR: retrying the same command will fail the same way.
    pub dnr: bool,
}

impl Status {
    const fn new(sct: u8, sc: u8, dnr: bool) -> Status {
        Status { sct, sc, dnr }
    }

    /// Success.
    pub const SUCCESS: Status = Status::new(0, 0x00, false);
    /// Invalid Command Opcode.
    pub const INVALID_OPCODE: Status = Status::new(0, 0x01, true);
    /// Invalid Field in Command.
    pub const INVALID_FIELD: Status = Status::new(0, 0x02, true);
    /// Command ID Conflict.
    pub const CID_CONFLICT: Status = Status::new(0, 0x03, true);
    /// Internal Error.
    pub const INTERNAL: Status = Status::new(0, 0x06, false);
    /// Command Abort Requested.
    pub const ABORT_REQUESTED: Status = Status::new(0, 0x07, false);
    /// Invalid Namespace or Format.
    pub const INVALID_NS: Status = Status::new(0, 0x0b, true);
    /// Command Sequence Error.
    pub const SEQUENCE_ERROR: Status = Status::new(0, 0x0c, true);
    /// Data SGL Length Invalid.
    pub const SGL_LENGTH_INVALID: Status = Status::new(0, 0x0f, true);
    /// SGL Descriptor Type Invalid.
    pub const SGL_TYPE_INVALID: Status = Status::new(0, 0x11, true);
    /// SGL Offset Invalid.
    pub const SGL_OFFSET_INVALID: Status = Status::new(0, 0x16, true);
    /// Namespace is Write Protected.
    pub const WRITE_PROTECTED: Status = Status::new(0, 0x20, true);
    /// Transient Transport Error (a data digest did not match: retry).
    pub const TRANSIENT_TRANSPORT: Status = Status::new(0, 0x22, false);
    /// LBA Out of Range.
    pub const LBA_OUT_OF_RANGE: Status = Status::new(0, 0x80, true);
    /// Invalid Log Page.
    pub const INVALID_LOG_PAGE: Status = Status::new(1, 0x09, true);
    /// Feature Identifier Not Saveable.
    pub const FEATURE_NOT_SAVEABLE: Status = Status::new(1, 0x0d, true);
    /// Connect Incompatible Format.
    pub const CONNECT_FORMAT: Status = Status::new(1, 0x80, true);
    /// Connect Controller Busy.
    pub const CONNECT_BUSY: Status = Status::new(1, 0x81, true);
    /// Connect Invalid Parameters (with IATTR/IPO in dword 0).
    pub const CONNECT_INVALID_PARAM: Status = Status::new(1, 0x82, true);
    /// Connect Invalid Host.
    pub const CONNECT_INVALID_HOST: Status = Status::new(1, 0x84, true);
    /// Authentication Required.
    pub const AUTH_REQUIRED: Status = Status::new(1, 0x91, true);
    /// Write Fault: the namespace failed (its write-back failed) and nothing written to it
    /// can be made durable until an operator reopens it.
    pub const WRITE_FAULT: Status = Status::new(2, 0x80, true);
    /// Media and Data Integrity Errors: Unrecovered Read Error (a page of the namespace the
    /// kernel could not give back: a media error, or its file truncated).
    pub const UNRECOVERED_READ_ERROR: Status = Status::new(2, 0x81, true);

    /// The 16-bit status field of a completion (phase tag 0).
    pub fn field(self) -> u16 {
        (u16::from(self.dnr) << 15) | (u16::from(self.sct & 0x7) << 9) | (u16::from(self.sc) << 1)
    }

    /// Whether it is a success.
    pub fn is_success(self) -> bool {
        self.sct == 0 && self.sc == 0
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "SCT {} SC {:#04x}{}",
            self.sct,
            self.sc,
            if self.dnr { " DNR" } else { "" }
        )
    }
}

/// A completion queue entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cqe {
    /// Command specific dword 0.
    pub dw0: u32,
    /// Command specific dword 1.
    pub dw1: u32,
    /// SQ head pointer.
    pub sqhd: u16,
    /// The command identifier.
    pub cid: u16,
    /// The status.
    pub status: Status,
}

impl Cqe {
    /// A completion of `cid` with `status` and no result.
    pub fn new(cid: u16, status: Status) -> Cqe {
        Cqe {
            dw0: 0,
            dw1: 0,
            sqhd: 0,
            cid,
            status,
        }
    }

    /// Its 16 bytes (SQID is 0 on fabrics).
    pub fn bytes(&self) -> [u8; 16] {
        let mut b = [0u8; 16];
        b[0..4].copy_from_slice(&self.dw0.to_le_bytes());
        b[4..8].copy_from_slice(&self.dw1.to_le_bytes());
        b[8..10].copy_from_slice(&self.sqhd.to_le_bytes());
        b[12..14].copy_from_slice(&self.cid.to_le_bytes());
        b[14..16].copy_from_slice(&self.status.field().to_le_bytes());
        b
    }
}

/// What a command's data transfer is, from its SGL and direction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataIn {
    /// No data.
    None,
    /// `len` bytes in the capsule.
    InCapsule(u32),
    /// `len` bytes to fetch with R2T.
    Fetch(u32),
}

/// Checks a command's SGL against the in-capsule data that came with it and the direction of
/// its transfer: for a command that takes data from the host (`to_controller`), where that data
/// is; for one that returns data, the length the host has room for (in `DataIn::Fetch`).
///
/// # Errors
/// The status to fail the command with: PRPs instead of SGLs (Invalid Field), an SGL type this
/// transport does not use, an in-capsule offset other than 0, or an in-capsule length that
/// does not match the data.
pub fn data_of(sqe: &Sqe, in_capsule: usize, to_controller: bool) -> Result<DataIn, Status> {
    let psdt = sqe.flags() >> 6;
    if psdt == 0 {
        // PRPs: meaningless over a fabric.
        return Err(Status::INVALID_FIELD);
    }
    let s = sqe.sgl();
    match s.kind {
        sgl::IN_CAPSULE => {
            if s.addr != 0 {
                return Err(Status::SGL_OFFSET_INVALID);
            }
            if s.len as usize != in_capsule || !to_controller {
                return Err(Status::SGL_LENGTH_INVALID);
            }
            Ok(if s.len == 0 {
                DataIn::None
            } else {
                DataIn::InCapsule(s.len)
            })
        }
        sgl::TRANSPORT => {
            if in_capsule != 0 {
                return Err(Status::SGL_LENGTH_INVALID);
            }
            Ok(if s.len == 0 {
                DataIn::None
            } else {
                DataIn::Fetch(s.len)
            })
        }
        0x00 if s.len == 0 && in_capsule == 0 => Ok(DataIn::None),
        _ => Err(Status::SGL_TYPE_INVALID),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_fields_are_laid_out_as_the_spec_says() {
        assert_eq!(Status::SUCCESS.field(), 0);
        // SC 0x02, SCT 0, DNR: bits 8:1 and 15.
        assert_eq!(Status::INVALID_FIELD.field(), 0x8004);
        // Connect Invalid Parameters: SCT 1, SC 0x82 -> 0x182 << 1.
        assert_eq!(Status::CONNECT_INVALID_PARAM.field(), 0x8000 | (0x182 << 1));
        assert_eq!(Status::WRITE_FAULT.field(), 0x8000 | (0x280 << 1));
        assert_eq!(Status::TRANSIENT_TRANSPORT.field(), 0x22 << 1);
        assert_eq!(Status::TRANSIENT_TRANSPORT.field() & 0x8000, 0, "retryable");
    }

    #[test]
    fn a_cqe_has_its_fields_where_the_host_reads_them() {
        let c = Cqe {
            dw0: 0x0102_0304,
            dw1: 0x0506_0708,
            sqhd: 9,
            cid: 0xabcd,
            status: Status::INVALID_NS,
        };
        let b = c.bytes();
        assert_eq!(&b[0..4], &[4, 3, 2, 1]);
        assert_eq!(&b[4..8], &[8, 7, 6, 5]);
        assert_eq!(&b[8..10], &[9, 0]);
        assert_eq!(&b[10..12], &[0, 0], "SQID");
        assert_eq!(&b[12..14], &[0xcd, 0xab]);
        assert_eq!(
            u16::from_le_bytes([b[14], b[15]]),
            Status::INVALID_NS.field()
        );
    }

    fn sqe(flags: u8, kind: u8, addr: u64, len: u32) -> Sqe {
        let mut raw = [0u8; 64];
        raw[0] = io::WRITE;
        raw[1] = flags;
        raw[2..4].copy_from_slice(&7u16.to_le_bytes());
        raw[4..8].copy_from_slice(&1u32.to_le_bytes());
        raw[24..32].copy_from_slice(&addr.to_le_bytes());
        raw[32..36].copy_from_slice(&len.to_le_bytes());
        raw[39] = kind;
        raw[40..44].copy_from_slice(&0x11u32.to_le_bytes());
        raw[60..64].copy_from_slice(&0x66u32.to_le_bytes());
        Sqe::new(raw)
    }

    #[test]
    fn fields_and_dwords() {
        let s = sqe(0x40, sgl::TRANSPORT, 0, 4096);
        assert_eq!((s.opcode(), s.cid(), s.nsid()), (io::WRITE, 7, 1));
        assert_eq!(s.cdw(10), 0x11);
        assert_eq!(s.cdw(15), 0x66);
        // Out-of-range dword numbers are clamped, never a panic.
        assert_eq!(s.cdw(99), 0x66);
        assert_eq!(s.u64_at(200), s.u64_at(56));
    }

    #[test]
    fn data_pointers() {
        let w = |f, k, a, l, inc| data_of(&sqe(f, k, a, l), inc, true);
        assert_eq!(
            w(0x40, sgl::IN_CAPSULE, 0, 512, 512),
            Ok(DataIn::InCapsule(512))
        );
        assert_eq!(
            w(0x40, sgl::TRANSPORT, 0, 65536, 0),
            Ok(DataIn::Fetch(65536))
        );
        assert_eq!(w(0x40, sgl::TRANSPORT, 0, 0, 0), Ok(DataIn::None));
        assert_eq!(
            w(0, sgl::TRANSPORT, 0, 512, 0),
            Err(Status::INVALID_FIELD),
            "PRPs"
        );
        assert_eq!(
            w(0x40, sgl::IN_CAPSULE, 8, 512, 512),
            Err(Status::SGL_OFFSET_INVALID)
        );
        assert_eq!(
            w(0x40, sgl::IN_CAPSULE, 0, 1024, 512),
            Err(Status::SGL_LENGTH_INVALID),
            "the SGL says more than came"
        );
        assert_eq!(
            w(0x40, sgl::TRANSPORT, 0, 512, 512),
            Err(Status::SGL_LENGTH_INVALID),
            "data came in the capsule for an R2T descriptor"
        );
        assert_eq!(
            w(0x40, 0x20, 0, 512, 0),
            Err(Status::SGL_TYPE_INVALID),
            "a segment descriptor"
        );
        assert_eq!(
            data_of(&sqe(0x40, sgl::IN_CAPSULE, 0, 512), 512, false),
            Err(Status::SGL_LENGTH_INVALID),
            "in-capsule data for a command that returns data"
        );
    }
}
