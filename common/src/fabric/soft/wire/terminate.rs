//! The Terminate message body (RFC 5040 §4.8); its causes (RFC 5040 §7.2, RFC 5041 §7,
//! RFC 5044 §8, RFC 6581 §6) are in `codes.rs`.
//!
//! Body layout, after the untagged DDP/RDMAP header (QN 2, MSN 1, MO 0):
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 1 | layer (high nibble) \| error type (low nibble) |
//! | 1 | 1 | error code |
//! | 2 | 2 | header control M 0x8000, D 0x4000, R 0x2000; rest reserved, zero |
//! | 4 | 2 | DDP segment length of the offending segment (if D) |
//! | 6 | 14 or 18 | the offending DDP header, tagged or untagged by its T bit (if D) |
//! | .. | 28 | the offending RDMA Read Request header (if R) |

pub use super::codes::{Layer, TermCause};
use super::cursor::{Reader, Writer};
use super::error::{Result, WireError};
use super::rdmap::ReadRequest;

/// Header control flag M: the DDP segment length field is valid.
pub const HDRCT_M: u16 = 0x8000;
/// Header control flag D: the offending DDP header is included.
pub const HDRCT_D: u16 = 0x4000;
/// Header control flag R: the offending RDMA Read Request header is included.
pub const HDRCT_R: u16 = 0x2000;

/// The offending DDP segment quoted by a Terminate (flag D).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TerminatedDdp {
    /// The MPA ULPDU length of the offending segment.
    pub seg_len: u16,
    /// Its DDP/RDMAP header as received: 14 bytes when tagged, 18 when untagged.
    pub header: Vec<u8>,
}

/// The body of a Terminate message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Terminate {
    /// Layer, error type and code.
    pub cause: TermCause,
    /// Flag M: `ddp.seg_len` is valid.
    pub seg_len_valid: bool,
    /// Flag D: the offending DDP segment header.
    pub ddp: Option<TerminatedDdp>,
    /// Flag R: the offending RDMA Read Request.
    pub rreq: Option<ReadRequest>,
}

impl Terminate {
    /// A Terminate carrying only its cause.
    pub fn new(cause: TermCause) -> Self {
        Terminate {
            cause,
            seg_len_valid: false,
            ddp: None,
            rreq: None,
        }
    }

    /// Quotes the offending segment: `ulpdu` is the ULPDU as received (its DDP header is
    /// copied: 14 bytes if the T bit is set, else 18; fewer if the ULPDU is shorter).
    pub fn with_ddp(mut self, seg_len: u16, ulpdu: &[u8]) -> Self {
        let want = if ulpdu.first().is_some_and(|c| c & 0x80 != 0) {
            14
        } else {
            18
        };
        let mut header = ulpdu[..want.min(ulpdu.len())].to_vec();
        header.resize(want, 0);
        self.seg_len_valid = true;
        self.ddp = Some(TerminatedDdp { seg_len, header });
        self
    }

    /// Body length in bytes.
    pub fn len(&self) -> usize {
        4 + self.ddp.as_ref().map_or(0, |d| 2 + d.header.len())
            + self.rreq.map_or(0, |_| ReadRequest::LEN)
    }

    /// Never: a Terminate body has at least its 4-byte control word.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Encodes the body.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![0u8; self.len()];
        let mut w = Writer::new(&mut out);
        let c = self.cause;
        let mut hdrct = 0u16;
        if self.seg_len_valid {
            hdrct |= HDRCT_M;
        }
        if self.ddp.is_some() {
            hdrct |= HDRCT_D;
        }
        if self.rreq.is_some() {
            hdrct |= HDRCT_R;
        }
        w.u8(((c.layer as u8) << 4) | (c.etype & 0x0F))
            .u8(c.ecode)
            .u16(hdrct);
        if let Some(d) = &self.ddp {
            w.u16(d.seg_len).put(&d.header);
        }
        if let Some(r) = &self.rreq {
            w.put(&r.encode());
        }
        out
    }

    /// Decodes a body; bytes after the quoted headers are ignored.
    ///
    /// # Errors
    /// [`WireError::Truncated`] if the body is shorter than its flags say,
    /// [`WireError::BadField`] for a layer above 2.
    pub fn decode(buf: &[u8]) -> Result<Terminate> {
        let mut r = Reader::new(buf, "Terminate");
        let b0 = r.u8()?;
        let ecode = r.u8()?;
        let hdrct = r.u16()?;
        let cause = TermCause {
            layer: Layer::from_u8(b0 >> 4).ok_or(WireError::BadField {
                what: "Terminate layer",
                value: (b0 >> 4).into(),
            })?,
            etype: b0 & 0x0F,
            ecode,
        };
        let ddp = if hdrct & HDRCT_D != 0 {
            let seg_len = r.u16()?;
            let t = r.rest().first().copied().unwrap_or(0) & 0x80 != 0;
            let header = r.bytes(if t { 14 } else { 18 })?.to_vec();
            Some(TerminatedDdp { seg_len, header })
        } else {
            None
        };
        let rreq = if hdrct & HDRCT_R != 0 {
            Some(ReadRequest::decode(r.bytes(ReadRequest::LEN)?)?)
        } else {
            None
        };
        Ok(Terminate {
            cause,
            seg_len_valid: hdrct & HDRCT_M != 0,
            ddp,
            rreq,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bare_terminate_golden() {
        let t = Terminate::new(TermCause::DDP_TAGGED_BASE_BOUNDS);
        let b = t.encode();
        assert_eq!(b, [0x11, 0x01, 0x00, 0x00]);
        assert_eq!(Terminate::decode(&b).unwrap(), t);
        let t = Terminate::new(TermCause::MPA_CRC);
        assert_eq!(t.encode(), [0x20, 0x02, 0x00, 0x00]);
        let t = Terminate::new(TermCause::RDMAP_OPERATION_UNSPECIFIED);
        assert_eq!(t.encode(), [0x02, 0xFF, 0x00, 0x00]);
    }

    #[test]
    fn terminate_quoting_a_tagged_write_golden() {
        // Offending Write: DDP ctrl 0xC1, RDMAP ctrl 0x40, STag 0x11223344, TO 0x1000.
        let ulpdu = [
            0xC1, 0x40, 0x11, 0x22, 0x33, 0x44, 0, 0, 0, 0, 0, 0, 0x10, 0x00, 0xAA, 0xBB,
        ];
        let t = Terminate::new(TermCause::DDP_TAGGED_INVALID_STAG).with_ddp(16, &ulpdu);
        let b = t.encode();
        let want = [
            0x11, 0x00, 0xC0, 0x00, // layer DDP, tagged buffer error, invalid STag; M|D
            0x00, 0x10, // segment length 16
            0xC1, 0x40, 0x11, 0x22, 0x33, 0x44, 0, 0, 0, 0, 0, 0, 0x10, 0x00,
        ];
        assert_eq!(b, want);
        assert_eq!(t.len(), want.len());
        assert_eq!(Terminate::decode(&b).unwrap(), t);
    }

    #[test]
    fn terminate_quoting_a_read_request_golden() {
        let rreq = ReadRequest {
            sink_stag: 1,
            sink_to: 2,
            size: 3,
            src_stag: 4,
            src_to: 5,
        };
        let ulpdu = [0x41, 0x41, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 0];
        let mut t = Terminate::new(TermCause::RDMAP_INVALID_STAG).with_ddp(46, &ulpdu);
        t.rreq = Some(rreq);
        let b = t.encode();
        assert_eq!(&b[..4], &[0x01, 0x00, 0xE0, 0x00]);
        assert_eq!(&b[4..6], &[0x00, 46]);
        assert_eq!(&b[6..24], &ulpdu);
        assert_eq!(&b[24..], &rreq.encode());
        assert_eq!(b.len(), 4 + 2 + 18 + 28);
        assert_eq!(Terminate::decode(&b).unwrap(), t);
    }

    #[test]
    fn bad_terminates_are_errors() {
        assert!(matches!(
            Terminate::decode(&[0x01, 0x00]),
            Err(WireError::Truncated { .. })
        ));
        assert!(matches!(
            Terminate::decode(&[0x31, 0x00, 0, 0]),
            Err(WireError::BadField {
                what: "Terminate layer",
                value: 3
            })
        ));
        // D set but no header follows.
        assert!(matches!(
            Terminate::decode(&[0x11, 0x00, 0x40, 0, 0, 16, 0xC1]),
            Err(WireError::Truncated { .. })
        ));
        // R set but no read request follows.
        assert!(matches!(
            Terminate::decode(&[0x01, 0x00, 0x20, 0, 1, 2]),
            Err(WireError::Truncated { .. })
        ));
    }
}
