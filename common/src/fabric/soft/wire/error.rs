//! The wire layer's error: every way a frame, a handshake or the stream can be wrong, each
//! with the Terminate cause the RFCs prescribe for it.

use std::io;

use super::codes::{MpaKind, Opcode, TermCause};

/// Errors of the wire layer. Each maps to a Terminate cause: [`WireError::terminate_cause`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// A field or frame ended before its layout did.
    #[error("{what} is truncated: {need} bytes needed, {have} present")]
    Truncated {
        /// What was being parsed.
        what: &'static str,
        /// Bytes the layout needs.
        need: usize,
        /// Bytes present.
        have: usize,
    },
    /// The MPA length is smaller than the DDP/RDMAP header (and fixed body) of its opcode.
    #[error("ULPDU of {ulpdu_len} bytes is shorter than the {need} bytes of a {opcode:?} header")]
    UlpduTooShort {
        /// The opcode named by the header, if the ULPDU reaches that far.
        opcode: Option<Opcode>,
        /// The MPA ULPDU length.
        ulpdu_len: usize,
        /// The least length this opcode needs.
        need: usize,
    },
    /// The MPA length exceeds what this receiver accepts.
    #[error("ULPDU of {ulpdu_len} bytes exceeds the maximum of {max}")]
    UlpduTooLong {
        /// The MPA ULPDU length.
        ulpdu_len: usize,
        /// The configured maximum.
        max: usize,
    },
    /// A fixed-size body came with the wrong payload length.
    #[error("{opcode:?} body is {len} bytes, expected {expected}")]
    BadBodyLength {
        /// The opcode.
        opcode: Opcode,
        /// The payload length received.
        len: usize,
        /// The body length the layout fixes.
        expected: usize,
    },
    /// The FPDU's CRC32c does not match its contents.
    #[error("bad MPA CRC: computed {computed:#010x}, received {received:#010x}")]
    BadCrc {
        /// CRC computed over the received bytes.
        computed: u32,
        /// CRC carried by the FPDU.
        received: u32,
    },
    /// The DDP version (DV) is not 1.
    #[error("bad DDP version {version} (tagged: {tagged})")]
    BadDdpVersion {
        /// The version received.
        version: u8,
        /// Whether the T bit was set (selects the Terminate error type).
        tagged: bool,
    },
    /// The RDMAP version (RV) is not 1.
    #[error("bad RDMAP version {version}")]
    BadRdmapVersion {
        /// The version received.
        version: u8,
    },
    /// An opcode this implementation does not know.
    #[error("unknown RDMAP opcode {opcode:#x}")]
    UnknownOpcode {
        /// The raw 4-bit opcode.
        opcode: u8,
    },
    /// A known opcode where it may not appear: wrong buffer model, or a private opcode that
    /// was not negotiated.
    #[error("unexpected {opcode:?}: {reason}")]
    UnexpectedOpcode {
        /// The opcode.
        opcode: Opcode,
        /// Why it is not acceptable here.
        reason: &'static str,
    },
    /// An untagged message on the wrong DDP queue.
    #[error("{opcode:?} on queue number {qn}, expected {expected}")]
    BadQueueNumber {
        /// The opcode.
        opcode: Opcode,
        /// The queue number received.
        qn: u32,
        /// The queue number the opcode uses.
        expected: u32,
    },
    /// A single-segment message with a non-zero message offset or without the L bit.
    #[error("{opcode:?} must be one segment at offset 0: MO {mo}, last {last}")]
    BadMessageOffset {
        /// The opcode.
        opcode: Opcode,
        /// The message offset received.
        mo: u32,
        /// The L bit received.
        last: bool,
    },
    /// A field holds a value its layout does not allow.
    #[error("bad {what}: {value:#x}")]
    BadField {
        /// The field.
        what: &'static str,
        /// The value received.
        value: u64,
    },
    /// The receiver's [`Placer`](super::rx::Placer) refused a data segment (bad STag, bounds,
    /// rights, no posted receive...): nothing was placed; answer with `cause`.
    #[error("placement of {opcode:?} refused: {cause:?}")]
    Refused {
        /// The opcode of the refused segment.
        opcode: Opcode,
        /// The Terminate cause the placer gave.
        cause: TermCause,
    },
    /// A direct placement shorter than the payload it was given for (a placer bug).
    #[error("direct placement of {given} bytes for a payload of {need}")]
    PlacementTooShort {
        /// The payload length.
        need: usize,
        /// The placement's length.
        given: usize,
    },
    /// Writing a payload into the file of a page-cache placement failed (nothing is promised
    /// about its bytes).
    #[error("placing {len} bytes into the namespace file failed")]
    PlacementFailed {
        /// The payload length.
        len: usize,
        /// The `pwrite` error.
        #[source]
        source: io::Error,
    },
    /// An MPA frame without the Request or Reply key (expected here).
    #[error("bad MPA key (expected: {expected:?})")]
    BadMpaKey {
        /// The kind of frame that was expected, if the context says.
        expected: Option<MpaKind>,
    },
    /// An MPA revision this implementation does not speak.
    #[error("unsupported MPA revision {revision}")]
    BadMpaRevision {
        /// The revision received.
        revision: u8,
    },
    /// The peer asked for MPA markers, which this implementation refuses (as Linux siw does).
    #[error("the peer requested MPA markers, which are not supported")]
    MarkersRequested,
    /// MPA private data longer than allowed.
    #[error("MPA private data of {len} bytes exceeds {max}")]
    PrivateDataTooLong {
        /// Length given.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// A revision-2 MPA frame without the RFC 6581 IRD/ORD prefix, which this implementation
    /// requires.
    #[error("MPA frame lacks the RFC 6581 IRD/ORD prefix")]
    MissingIrdOrd,
    /// The peer's private data carries our magic but a malformed capability block.
    #[error("malformed capability block: {reason}")]
    BadCaps {
        /// What is wrong.
        reason: &'static str,
    },
    /// The peer's MPA Reply rejected the connection (R=1).
    #[error("the peer rejected the MPA connection")]
    Rejected,
    /// Peer-to-peer mode was requested without a ready-to-receive message type we share.
    #[error("no matching RTR message type for peer-to-peer mode")]
    NoMatchingRtr,
    /// A local configuration value out of range.
    #[error("invalid configuration: {what}")]
    InvalidConfig {
        /// What is wrong.
        what: &'static str,
    },
    /// The stream ended.
    #[error("connection closed during {during}")]
    Closed {
        /// What was in progress.
        during: &'static str,
    },
    /// An I/O error on the stream.
    #[error("I/O error during {during}")]
    Io {
        /// What was in progress.
        during: &'static str,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
}

/// Result alias of the wire layer.
pub type Result<T> = std::result::Result<T, WireError>;

impl WireError {
    /// The Terminate layer/type/code that RFC 5040 §7.2, RFC 5041 §7 and RFC 5044 §8 (with the
    /// RFC 6581 additions) prescribe for this error. docs/protocol.md lists the mapping.
    pub fn terminate_cause(&self) -> TermCause {
        use WireError::*;
        match self {
            Truncated { .. } | BadBodyLength { .. } | BadField { .. } => {
                TermCause::RDMAP_OPERATION_UNSPECIFIED
            }
            UlpduTooShort { .. } | UlpduTooLong { .. } => TermCause::MPA_LENGTH_MISMATCH,
            BadCrc { .. } => TermCause::MPA_CRC,
            BadDdpVersion { tagged: true, .. } => TermCause::DDP_TAGGED_VERSION,
            BadDdpVersion { tagged: false, .. } => TermCause::DDP_UNTAGGED_VERSION,
            BadRdmapVersion { .. } => TermCause::RDMAP_VERSION,
            UnknownOpcode { .. } | UnexpectedOpcode { .. } => TermCause::RDMAP_UNEXPECTED_OPCODE,
            BadQueueNumber { .. } => TermCause::DDP_UNTAGGED_INVALID_QN,
            BadMessageOffset { .. } => TermCause::DDP_UNTAGGED_INVALID_MO,
            BadMpaKey { .. }
            | BadMpaRevision { .. }
            | MarkersRequested
            | PrivateDataTooLong { .. }
            | MissingIrdOrd
            | BadCaps { .. }
            | Rejected => TermCause::MPA_INVALID_REQ_REP,
            NoMatchingRtr => TermCause::MPA_NO_MATCHING_RTR,
            Refused { cause, .. } => *cause,
            PlacementTooShort { .. } | PlacementFailed { .. } => {
                TermCause::RDMAP_LOCAL_CATASTROPHIC
            }
            InvalidConfig { .. } => TermCause::MPA_LOCAL_CATASTROPHIC,
            Closed { .. } | Io { .. } => TermCause::MPA_TCP_LOST,
        }
    }

    pub(crate) fn io(during: &'static str, source: io::Error) -> Self {
        if source.kind() == io::ErrorKind::UnexpectedEof {
            WireError::Closed { during }
        } else {
            WireError::Io { during, source }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_error_has_the_prescribed_cause() {
        let cases: Vec<(WireError, (u8, u8, u8))> = vec![
            (
                WireError::BadCrc {
                    computed: 1,
                    received: 2,
                },
                (2, 0, 2),
            ),
            (
                WireError::BadDdpVersion {
                    version: 0,
                    tagged: true,
                },
                (1, 1, 4),
            ),
            (
                WireError::BadDdpVersion {
                    version: 2,
                    tagged: false,
                },
                (1, 2, 6),
            ),
            (WireError::BadRdmapVersion { version: 0 }, (0, 2, 5)),
            (WireError::UnknownOpcode { opcode: 0xF }, (0, 2, 6)),
            (
                WireError::BadQueueNumber {
                    opcode: Opcode::Send,
                    qn: 7,
                    expected: 0,
                },
                (1, 2, 1),
            ),
            (
                WireError::BadMessageOffset {
                    opcode: Opcode::ReadRequest,
                    mo: 4,
                    last: true,
                },
                (1, 2, 4),
            ),
            (
                WireError::UlpduTooLong {
                    ulpdu_len: 9000,
                    max: 1454,
                },
                (2, 0, 3),
            ),
            (WireError::MarkersRequested, (2, 0, 4)),
            (
                WireError::BadMpaKey {
                    expected: Some(MpaKind::Request),
                },
                (2, 0, 4),
            ),
            (WireError::NoMatchingRtr, (2, 0, 7)),
            (
                WireError::Refused {
                    opcode: Opcode::Write,
                    cause: TermCause::DDP_TAGGED_BASE_BOUNDS,
                },
                (1, 1, 1),
            ),
            (
                WireError::PlacementTooShort { need: 2, given: 1 },
                (0, 0, 0),
            ),
            (
                WireError::UlpduTooShort {
                    opcode: None,
                    ulpdu_len: 1,
                    need: 18,
                },
                (2, 0, 3),
            ),
            (WireError::Closed { during: "test" }, (2, 0, 1)),
        ];
        for (err, (layer, etype, ecode)) in cases {
            let c = err.terminate_cause();
            assert_eq!(
                (c.layer as u8, c.etype, c.ecode),
                (layer, etype, ecode),
                "{err}"
            );
        }
    }

    #[test]
    fn unexpected_eof_is_closed() {
        let e = WireError::io("x", io::Error::from(io::ErrorKind::UnexpectedEof));
        assert!(matches!(e, WireError::Closed { during: "x" }));
        let e = WireError::io("x", io::Error::from(io::ErrorKind::ConnectionReset));
        assert!(matches!(e, WireError::Io { .. }));
    }
}
