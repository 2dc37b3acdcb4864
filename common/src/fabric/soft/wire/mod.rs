//! iWARP wire formats for the `tcp` transport: MPA (RFC 5044, RFC 6581), DDP (RFC 5041),
//! RDMAP (RFC 5040, RFC 7306) and this project's private opcodes. Pure code: encoding, decoding,
//! segmentation and a receive state machine fed through `std::io::Read` and
//! [`ReadVolatile`](crate::volatile::ReadVolatile); no sockets inside.
//!
//! Quick start (the engine's view):
//!
//! 1. [`mpa::connect_handshake`] / [`mpa::accept_handshake`] on a freshly connected stream give
//!    a [`mpa::Negotiated`]: CRC on or off, IRD/ORD, the peer's [`caps::Caps`]
//!    ([`mpa::connect_exchange`] also hands back a rejecting peer's private data).
//! 2. To send, build a [`ddp::Header`] template and cut the message into FPDUs with
//!    [`tx::Segmenter`] (iovec-friendly: header bytes, payload slices, trailer), or encode a small
//!    control message in one go with [`tx::encode_fpdu`]. A transmit queue that owns its payloads
//!    its own way (the engine's) uses the segmenter's owned parts, [`tx::Cuts`] and
//!    [`tx::Framing`].
//! 3. To receive, feed a non-blocking socket to [`rx::FpduReceiver::poll`] with a
//!    [`rx::Placer`] that says where each data payload goes and writes the checked payloads
//!    the receiver gathered ([`rx::Placer::write`]). Registered memory, on both sides,
//!    is reached only through a [`VolatileSlice`](crate::volatile::VolatileSlice)
//!    ([`tx::Framing::for_volatile`], [`rx::DirectTarget`]). The copies into place, and what
//!    the responder does with placed bytes, are the transport's placement module's, not this
//!    layer's: this layer names none of it.
//!
//! Every decoding error is a [`WireError`], and every `WireError` names the Terminate cause the
//! RFCs prescribe for it ([`WireError::terminate_cause`]), so the engine can answer a bad frame
//! with the right Terminate. Nothing here panics on input from the network; the few functions that panic
//! on a caller's mistake (an output buffer too small) say so.
//!
//! Threads: every type is plain data or a state machine owned by one connection; nothing is shared.

pub mod body;
pub mod caps;
pub mod codes;
pub mod crc;
pub mod cursor;
pub mod ddp;
mod error;
pub mod mpa;
pub mod rdmap;
mod ring;
pub mod rx;
pub mod terminate;
pub mod tx;

pub use body::Body;
pub use caps::{CapFlags, Caps};
pub use codes::{Layer, MpaKind, Opcode, TermCause};
pub use crc::{crc32c, crc32c_append};
pub use ddp::{Header, HeaderKind};
pub use error::{Result, WireError};
pub use mpa::{IrdOrd, MpaConfig, MpaFrame, Negotiated};
pub use terminate::Terminate;

/// Bytes of MPA framing around a ULPDU: the 2-byte length in front and the 4-byte CRC behind
/// (padding comes on top, 0-3 bytes).
pub const MPA_OVERHEAD: usize = 2 + 4;

/// Maximum ULPDU length when an FPDU must fit one TCP segment of the classic Ethernet MSS (1460):
/// 2 (length) + 1454 (ULPDU) + 0 (pad) + 4 (CRC) = 1460.
pub const DEFAULT_MAX_ULPDU: usize = 1454;

/// The largest ULPDU the 16-bit MPA length field can describe.
pub const MAX_ULPDU_LIMIT: usize = u16::MAX as usize;

/// Padding that brings `2 + ulpdu_len` to a multiple of 4.
pub const fn pad_len(ulpdu_len: usize) -> usize {
    (4 - ((2 + ulpdu_len) & 3)) & 3
}

/// Total bytes on the wire of an FPDU carrying a ULPDU of `ulpdu_len` bytes.
pub const fn fpdu_len(ulpdu_len: usize) -> usize {
    2 + ulpdu_len + pad_len(ulpdu_len) + 4
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn padding_rounds_length_plus_ulpdu_to_four() {
        assert_eq!(pad_len(2), 0);
        assert_eq!(pad_len(3), 3);
        assert_eq!(pad_len(14), 0);
        assert_eq!(pad_len(18), 0);
        assert_eq!(pad_len(19), 3);
        assert_eq!(pad_len(20), 2);
        assert_eq!(pad_len(21), 1);
        assert_eq!(fpdu_len(DEFAULT_MAX_ULPDU), 1460);
        for n in 0..64 {
            assert_eq!(fpdu_len(n) % 4, 0, "ulpdu {n}");
        }
    }
}
