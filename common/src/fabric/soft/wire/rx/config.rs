//! The receive side's settings: CRC, the longest ULPDU accepted, the optional opcodes
//! negotiated, and how far the receiver reads ahead with CRC off.

use super::super::caps::CapFlags;
use super::super::codes::Opcode;
use super::super::error::{Result, WireError};
use super::super::mpa::Negotiated;
use super::super::tx::MIN_MAX_ULPDU;
use super::super::MAX_ULPDU_LIMIT;

/// With CRC off, how far past the bytes it needs the receiver reads ahead. Small enough that a
/// large direct payload mostly lands straight in place, large enough that a 4 KiB Write and the
/// Read Request behind it come in one read.
pub const READ_AHEAD: usize = 8192;

/// Settings of the receive side.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RxConfig {
    pub(super) crc: bool,
    pub(super) max_ulpdu: usize,
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

    /// Whether `opcode` may be received: the optional ones only where negotiated.
    pub(super) fn check_allowed(&self, opcode: Opcode) -> Result<()> {
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
