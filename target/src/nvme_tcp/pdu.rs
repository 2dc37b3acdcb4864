//! NVMe/TCP PDUs (NVMe over TCP Transport Specification 1.0, section 3.6): the common header,
//! each PDU type's header, header and data digests, and the framing of a byte stream into
//! PDUs as a controller receives them.
//!
//! # Layout
//!
//! Every PDU starts with an 8-byte common header: type, flags, HLEN (header length), PDO (data
//! offset), PLEN (whole PDU length, little-endian). The type's header (HLEN bytes in all) is
//! followed by the header digest (CRC32C of the header, when negotiated), padding up to PDO,
//! the data, and the data digest (CRC32C of the data, when negotiated and there is data).
//! Digests are CRC32C (the iSCSI polynomial: init and final xor all ones) stored
//! least-significant byte first. ICReq, ICResp and the TermReqs never carry digests.
//!
//! # Framing
//!
//! [`frame`] is a cursor over what has been received so far: it returns a whole PDU (borrowing
//! its header and data), says how many bytes the PDU at the front needs in all, or returns the
//! [`Fatal`] error to answer with a C2HTermReq. It decides from the 8-byte common header alone
//! whether the PDU is one this controller accepts now and how long it may be ([`Limits`]), so a
//! peer can never make the receiver buffer more than [`Limits::max_plen`] bytes. It never
//! panics and never reads past its input; a data digest error is not fatal (the command fails
//! with a transient transport error), a header digest error is.

use std::fmt;

/// Length of the common header.
pub const CH_LEN: usize = 8;
/// Length of a header or data digest.
pub const DIGEST_LEN: usize = 4;
/// HLEN (and PLEN) of ICReq and ICResp.
pub const IC_LEN: usize = 128;
/// HLEN of a CapsuleCmd: the common header and a 64-byte submission queue entry.
pub const CMD_HLEN: usize = 72;
/// HLEN of CapsuleResp, H2CData, C2HData, R2T and the TermReqs.
pub const HLEN_24: usize = 24;
/// Most bytes of the offending PDU a C2HTermReq carries (PLEN at most 152).
pub const TERM_DATA_MAX: usize = 128;
/// The smallest MAXH2CDATA a controller may offer.
pub const MIN_MAXH2CDATA: u32 = 4096;

/// PDU types.
pub mod kind {
    /// Initialize Connection Request (host to controller).
    pub const IC_REQ: u8 = 0x00;
    /// Initialize Connection Response.
    pub const IC_RESP: u8 = 0x01;
    /// Host to Controller Terminate Connection Request.
    pub const H2C_TERM_REQ: u8 = 0x02;
    /// Controller to Host Terminate Connection Request.
    pub const C2H_TERM_REQ: u8 = 0x03;
    /// Command Capsule.
    pub const CAPSULE_CMD: u8 = 0x04;
    /// Response Capsule.
    pub const CAPSULE_RESP: u8 = 0x05;
    /// Host to Controller Data.
    pub const H2C_DATA: u8 = 0x06;
    /// Controller to Host Data.
    pub const C2H_DATA: u8 = 0x07;
    /// Ready to Transfer.
    pub const R2T: u8 = 0x09;
}

/// Common header flags.
pub mod flag {
    /// A header digest follows the header.
    pub const HDGSTF: u8 = 1 << 0;
    /// A data digest follows the data.
    pub const DDGSTF: u8 = 1 << 1;
    /// H2CData/C2HData: the last PDU of the transfer.
    pub const LAST_PDU: u8 = 1 << 2;
    /// C2HData: the command completed successfully; no response capsule follows.
    pub const SUCCESS: u8 = 1 << 3;
}

/// ICReq/ICResp digest bits.
pub mod dgst {
    /// Header digests.
    pub const HDGST: u8 = 1 << 0;
    /// Data digests.
    pub const DDGST: u8 = 1 << 1;
}

/// Fatal Error Status of a TermReq.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u16)]
pub enum Fes {
    /// A header field is invalid; FEI is its byte offset in the PDU.
    InvalidHeaderField = 0x01,
    /// A PDU that is not allowed now.
    PduSequenceError = 0x02,
    /// The header digest does not match.
    HeaderDigestError = 0x03,
    /// Data outside the range the controller asked for (an H2CData's offset or length).
    DataOutOfRange = 0x04,
    /// More data in one PDU than allowed (MAXH2CDATA, or the in-capsule limit).
    DataLimitExceeded = 0x05,
    /// A parameter the controller does not support; FEI is its byte offset.
    UnsupportedParameter = 0x06,
}

impl Fes {
    /// Whether FEI carries a byte offset (only for these two, as the spec says).
    fn has_offset(self) -> bool {
        matches!(self, Fes::InvalidHeaderField | Fes::UnsupportedParameter)
    }
}

/// A fatal transport error: the connection is answered with a C2HTermReq and closed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fatal {
    /// The status.
    pub fes: Fes,
    /// The byte offset of the field in error, where `fes` has one.
    pub fei: u32,
    /// For the log.
    pub why: String,
}

impl Fatal {
    pub(crate) fn new(fes: Fes, fei: u32, why: impl Into<String>) -> Fatal {
        Fatal {
            fes,
            fei: if fes.has_offset() { fei } else { 0 },
            why: why.into(),
        }
    }
}

impl fmt::Display for Fatal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.fes)?;
        if self.fes.has_offset() {
            write!(f, " (byte {})", self.fei)?;
        }
        write!(f, ": {}", self.why)
    }
}

/// CRC32C as NVMe/TCP digests use it.
pub fn crc32c(data: &[u8]) -> u32 {
    crc_fast::crc32_iscsi(data)
}

/// The common header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CommonHeader {
    /// PDU type ([`kind`]).
    pub pdu_type: u8,
    /// Flags ([`flag`]).
    pub flags: u8,
    /// Header length.
    pub hlen: u8,
    /// PDU data offset.
    pub pdo: u8,
    /// PDU length.
    pub plen: u32,
}

impl CommonHeader {
    /// Reads the first 8 bytes of `b` (None if shorter).
    pub fn parse(b: &[u8]) -> Option<CommonHeader> {
        let ch = b.get(..CH_LEN)?;
        Some(CommonHeader {
            pdu_type: ch[0],
            flags: ch[1],
            hlen: ch[2],
            pdo: ch[3],
            plen: u32::from_le_bytes([ch[4], ch[5], ch[6], ch[7]]),
        })
    }

    fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&[self.pdu_type, self.flags, self.hlen, self.pdo]);
        out.extend_from_slice(&self.plen.to_le_bytes());
    }
}

/// What a receiver accepts now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// The ICReq has not come yet: only it is accepted (at most 128 bytes).
    pub await_icreq: bool,
    /// Header digests negotiated.
    pub hdgst: bool,
    /// Data digests negotiated.
    pub ddgst: bool,
    /// Most in-capsule data in a CapsuleCmd.
    pub max_capsule_data: u32,
    /// MAXH2CDATA: most data in an H2CData PDU.
    pub maxh2cdata: u32,
}

impl Limits {
    /// Before the ICReq.
    pub const ICREQ: Limits = Limits {
        await_icreq: true,
        hdgst: false,
        ddgst: false,
        max_capsule_data: 0,
        maxh2cdata: 0,
    };

    /// The longest PDU accepted now: what a receive buffer must hold.
    pub fn max_plen(&self) -> usize {
        if self.await_icreq {
            return IC_LEN;
        }
        let (hd, dd) = (self.hd(), self.dd());
        let cmd = CMD_HLEN + hd + self.max_capsule_data as usize + dd;
        let data = HLEN_24 + hd + self.maxh2cdata as usize + dd;
        cmd.max(data).max(HLEN_24 + TERM_DATA_MAX)
    }

    fn hd(&self) -> usize {
        if self.hdgst {
            DIGEST_LEN
        } else {
            0
        }
    }

    fn dd(&self) -> usize {
        if self.ddgst {
            DIGEST_LEN
        } else {
            0
        }
    }
}

/// An ICReq.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IcReq {
    /// PDU format version (0).
    pub pfv: u16,
    /// Host PDU data alignment, 0's based dwords.
    pub hpda: u8,
    /// Digests the host asks for ([`dgst`]).
    pub digest: u8,
    /// Most outstanding R2Ts per command, 0's based.
    pub maxr2t: u32,
}

/// The fields of an H2CData PDU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct H2cData {
    /// The command it belongs to.
    pub cccid: u16,
    /// The transfer tag of the R2T it answers.
    pub ttag: u16,
    /// Offset of its data in the command's data.
    pub datao: u32,
    /// Length of its data.
    pub datal: u32,
    /// LAST_PDU flag.
    pub last: bool,
}

/// Byte offsets of H2CData fields (for FEI).
pub mod h2c_off {
    /// CCCID.
    pub const CCCID: u32 = 8;
    /// TTAG.
    pub const TTAG: u32 = 10;
    /// DATAO.
    pub const DATAO: u32 = 12;
    /// DATAL.
    pub const DATAL: u32 = 16;
}

/// One received PDU.
#[derive(Debug, PartialEq, Eq)]
pub enum Pdu<'a> {
    /// An ICReq.
    IcReq(IcReq),
    /// The host terminates the connection.
    H2cTermReq {
        /// Its status.
        fes: u16,
        /// Its information.
        fei: u32,
    },
    /// A command, with its in-capsule data (maybe empty).
    CapsuleCmd {
        /// The submission queue entry.
        sqe: &'a [u8; 64],
        /// In-capsule data.
        data: &'a [u8],
        /// False if the data digest did not match: fail the command, do not use the data.
        data_ok: bool,
    },
    /// Data for an R2T.
    H2cData {
        /// Its header.
        hdr: H2cData,
        /// The data.
        data: &'a [u8],
        /// False if the data digest did not match.
        data_ok: bool,
    },
}

/// What [`frame`] found at the front of the input.
#[derive(Debug, PartialEq, Eq)]
pub enum Framed<'a> {
    /// Not a whole PDU yet: the PDU at the front needs this many bytes in all (at most
    /// [`Limits::max_plen`]; 8 while its common header is incomplete).
    NeedMore(usize),
    /// A PDU, and how many bytes of the input it took.
    Pdu(Pdu<'a>, usize),
    /// The stream is broken: answer with a C2HTermReq and close.
    Fatal(Fatal),
}

fn invalid(fei: u32, why: impl Into<String>) -> Framed<'static> {
    Framed::Fatal(Fatal::new(Fes::InvalidHeaderField, fei, why))
}

fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn le16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

/// Frames the PDU at the front of `input` (see the module docs).
pub fn frame<'a>(input: &'a [u8], limits: &Limits) -> Framed<'a> {
    let Some(ch) = CommonHeader::parse(input) else {
        return Framed::NeedMore(CH_LEN);
    };
    if limits.await_icreq && ch.pdu_type != kind::IC_REQ {
        return Framed::Fatal(Fatal::new(
            Fes::PduSequenceError,
            0,
            format!("PDU type {:#04x} before the ICReq", ch.pdu_type),
        ));
    }
    let plen = ch.plen as usize;
    // ICReq and the TermReqs: fixed headers, no digests, no PDO.
    match ch.pdu_type {
        kind::IC_REQ if !limits.await_icreq => {
            return Framed::Fatal(Fatal::new(Fes::PduSequenceError, 0, "a second ICReq"));
        }
        kind::IC_REQ | kind::H2C_TERM_REQ => {
            let (hlen, max) = match ch.pdu_type {
                kind::IC_REQ => (IC_LEN, IC_LEN),
                _ => (HLEN_24, HLEN_24 + TERM_DATA_MAX),
            };
            if usize::from(ch.hlen) != hlen {
                return invalid(2, format!("HLEN {} (expected {hlen})", ch.hlen));
            }
            if plen < hlen || plen > max {
                return invalid(4, format!("PLEN {plen} (expected {hlen}..={max})"));
            }
            if input.len() < plen {
                return Framed::NeedMore(plen);
            }
            let pdu = &input[..plen];
            let out = if ch.pdu_type == kind::IC_REQ {
                Pdu::IcReq(IcReq {
                    pfv: le16(pdu, 8),
                    hpda: pdu[10],
                    digest: pdu[11],
                    maxr2t: le32(pdu, 12),
                })
            } else {
                Pdu::H2cTermReq {
                    fes: le16(pdu, 8),
                    fei: le32(pdu, 10),
                }
            };
            return Framed::Pdu(out, plen);
        }
        _ => {}
    }
    let (hlen, max_data) = match ch.pdu_type {
        kind::CAPSULE_CMD => (CMD_HLEN, limits.max_capsule_data as usize),
        kind::H2C_DATA => (HLEN_24, limits.maxh2cdata as usize),
        other => {
            return invalid(
                0,
                format!("PDU type {other:#04x} is not one a host sends to a controller"),
            )
        }
    };
    if usize::from(ch.hlen) != hlen {
        return invalid(
            2,
            format!(
                "HLEN {} for PDU type {:#04x} (expected {hlen})",
                ch.hlen, ch.pdu_type
            ),
        );
    }
    let (hd, dd) = (limits.hd(), limits.dd());
    // The digest flags must say what was negotiated.
    if (ch.flags & flag::HDGSTF != 0) != limits.hdgst {
        return invalid(1, "HDGSTF does not match the negotiated header digest");
    }
    if ch.flags & flag::DDGSTF != 0 && !limits.ddgst {
        return invalid(1, "DDGSTF set without a negotiated data digest");
    }
    let header_end = hlen + hd;
    if plen < header_end {
        return invalid(4, format!("PLEN {plen} is shorter than the header"));
    }
    let data_len = if plen > header_end {
        // Data always starts right after the header (and its digest): CPDA is 0, so no padding.
        if usize::from(ch.pdo) != header_end {
            return invalid(
                3,
                format!("PDO {} (the data must start at {header_end})", ch.pdo),
            );
        }
        if limits.ddgst && ch.flags & flag::DDGSTF == 0 {
            return invalid(1, "data without DDGSTF where a data digest was negotiated");
        }
        match plen.checked_sub(header_end + dd) {
            Some(n) if n > 0 => n,
            _ => return invalid(4, format!("PLEN {plen} leaves no room for the data digest")),
        }
    } else {
        if ch.pdo != 0 {
            return invalid(3, format!("PDO {} in a PDU without data", ch.pdo));
        }
        0
    };
    if data_len > max_data {
        let what = if ch.pdu_type == kind::H2C_DATA {
            "MAXH2CDATA"
        } else {
            "the in-capsule data limit"
        };
        return Framed::Fatal(Fatal::new(
            Fes::DataLimitExceeded,
            0,
            format!("{data_len} bytes of data, more than {what} ({max_data})"),
        ));
    }
    if input.len() < plen {
        return Framed::NeedMore(plen);
    }
    let pdu = &input[..plen];
    if hd > 0 {
        let want = crc32c(&pdu[..hlen]);
        let got = le32(pdu, hlen);
        if want != got {
            return Framed::Fatal(Fatal::new(
                Fes::HeaderDigestError,
                0,
                format!("header digest {got:#010x}, expected {want:#010x}"),
            ));
        }
    }
    let data = &pdu[header_end..header_end + data_len];
    let data_ok = dd == 0 || data_len == 0 || crc32c(data) == le32(pdu, header_end + data_len);
    let out = match ch.pdu_type {
        kind::CAPSULE_CMD => {
            let Ok(sqe) = <&[u8; 64]>::try_from(&pdu[CH_LEN..CMD_HLEN]) else {
                return invalid(2, "short command");
            };
            Pdu::CapsuleCmd { sqe, data, data_ok }
        }
        _ => {
            let hdr = H2cData {
                cccid: le16(pdu, 8),
                ttag: le16(pdu, 10),
                datao: le32(pdu, 12),
                datal: le32(pdu, 16),
                last: ch.flags & flag::LAST_PDU != 0,
            };
            if hdr.datal as usize != data_len {
                return invalid(
                    h2c_off::DATAL,
                    format!("DATAL {} but the PDU carries {data_len} bytes", hdr.datal),
                );
            }
            Pdu::H2cData { hdr, data, data_ok }
        }
    };
    Framed::Pdu(out, plen)
}

/// Appends the header digest of `out[start..]` (the header just written) when `on`.
fn header_digest(out: &mut Vec<u8>, start: usize, on: bool) {
    if on {
        let d = crc32c(&out[start..]);
        out.extend_from_slice(&d.to_le_bytes());
    }
}

/// An ICResp (never with digests).
pub fn ic_resp(out: &mut Vec<u8>, cpda: u8, digest: u8, maxh2cdata: u32) {
    CommonHeader {
        pdu_type: kind::IC_RESP,
        flags: 0,
        hlen: IC_LEN as u8,
        pdo: 0,
        plen: IC_LEN as u32,
    }
    .write(out);
    out.extend_from_slice(&0u16.to_le_bytes());
    out.push(cpda);
    out.push(digest);
    out.extend_from_slice(&maxh2cdata.to_le_bytes());
    out.resize(out.len() + IC_LEN - 16, 0);
}

/// A CapsuleResp carrying the 16-byte completion queue entry `cqe`.
pub fn capsule_resp(out: &mut Vec<u8>, hdgst: bool, cqe: &[u8; 16]) {
    let start = out.len();
    CommonHeader {
        pdu_type: kind::CAPSULE_RESP,
        flags: if hdgst { flag::HDGSTF } else { 0 },
        hlen: HLEN_24 as u8,
        pdo: 0,
        plen: (HLEN_24 + if hdgst { DIGEST_LEN } else { 0 }) as u32,
    }
    .write(out);
    out.extend_from_slice(cqe);
    header_digest(out, start, hdgst);
}

/// An R2T asking for `len` bytes at `offset` of command `cccid`'s data under tag `ttag`.
pub fn r2t(out: &mut Vec<u8>, hdgst: bool, cccid: u16, ttag: u16, offset: u32, len: u32) {
    let start = out.len();
    CommonHeader {
        pdu_type: kind::R2T,
        flags: if hdgst { flag::HDGSTF } else { 0 },
        hlen: HLEN_24 as u8,
        pdo: 0,
        plen: (HLEN_24 + if hdgst { DIGEST_LEN } else { 0 }) as u32,
    }
    .write(out);
    out.extend_from_slice(&cccid.to_le_bytes());
    out.extend_from_slice(&ttag.to_le_bytes());
    out.extend_from_slice(&offset.to_le_bytes());
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(&[0; 4]);
    header_digest(out, start, hdgst);
}

/// How a C2HData PDU is framed on this connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct C2hFraming {
    /// Header digests.
    pub hdgst: bool,
    /// Data digests.
    pub ddgst: bool,
    /// The host's PDU data alignment (0's based dwords): the data starts at a multiple of
    /// (hpda + 1) * 4.
    pub hpda: u8,
}

/// What a C2HData PDU carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct C2hData {
    /// The command.
    pub cccid: u16,
    /// Offset of the data in the command's data.
    pub offset: u32,
    /// Length of the data.
    pub len: u32,
    /// The last PDU of the command's data.
    pub last: bool,
    /// The command completed successfully: no CapsuleResp follows (only with SQ flow control
    /// disabled).
    pub success: bool,
}

/// A C2HData PDU, its data written by `fill` into the slice it is given (exactly `d.len`
/// bytes, zeroed first). Returns what `fill` returned; on an error nothing is appended.
pub fn c2h_data<E>(
    out: &mut Vec<u8>,
    f: C2hFraming,
    d: C2hData,
    fill: impl FnOnce(&mut [u8]) -> Result<(), E>,
) -> Result<(), E> {
    let C2hData {
        cccid,
        offset,
        len,
        last,
        success,
    } = d;
    let start = out.len();
    let hd = if f.hdgst { DIGEST_LEN } else { 0 };
    let dd = if f.ddgst { DIGEST_LEN } else { 0 };
    let align = (usize::from(f.hpda) + 1) * 4;
    let pdo = (HLEN_24 + hd).div_ceil(align) * align;
    let mut flags = 0;
    if f.hdgst {
        flags |= flag::HDGSTF;
    }
    if f.ddgst {
        flags |= flag::DDGSTF;
    }
    if last {
        flags |= flag::LAST_PDU;
    }
    if success {
        flags |= flag::SUCCESS;
    }
    CommonHeader {
        pdu_type: kind::C2H_DATA,
        flags,
        hlen: HLEN_24 as u8,
        // At most (24 + 4) rounded up to 128: fits.
        pdo: pdo as u8,
        plen: (pdo + len as usize + dd) as u32,
    }
    .write(out);
    out.extend_from_slice(&cccid.to_le_bytes());
    out.extend_from_slice(&[0; 2]);
    out.extend_from_slice(&offset.to_le_bytes());
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(&[0; 4]);
    header_digest(out, start, f.hdgst);
    out.resize(start + pdo, 0);
    let data_at = out.len();
    out.resize(data_at + len as usize, 0);
    if let Err(e) = fill(&mut out[data_at..]) {
        out.truncate(start);
        return Err(e);
    }
    if f.ddgst {
        let d = crc32c(&out[data_at..]);
        out.extend_from_slice(&d.to_le_bytes());
    }
    Ok(())
}

/// A C2HTermReq for `fatal`, carrying up to 128 bytes of the offending PDU's header
/// (`offending`). Never with digests.
pub fn c2h_term_req(out: &mut Vec<u8>, fatal: &Fatal, offending: &[u8]) {
    let data = &offending[..offending.len().min(TERM_DATA_MAX)];
    CommonHeader {
        pdu_type: kind::C2H_TERM_REQ,
        flags: 0,
        hlen: HLEN_24 as u8,
        pdo: 0,
        plen: (HLEN_24 + data.len()) as u32,
    }
    .write(out);
    out.extend_from_slice(&(fatal.fes as u16).to_le_bytes());
    out.extend_from_slice(&fatal.fei.to_le_bytes());
    out.extend_from_slice(&[0; 10]);
    out.extend_from_slice(data);
}

#[cfg(test)]
mod tests;
