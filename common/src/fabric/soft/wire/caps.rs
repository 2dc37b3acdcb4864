//! The transport capabilities carried in MPA private data, after the RFC 6581 IRD/ORD prefix.
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 4 | magic `rPMA` (0x72 0x50 0x4D 0x41) |
//! | 4 | 1 | version, 1 |
//! | 5 | 1 | length of this block in bytes (12 for version 1); application bytes follow it |
//! | 6 | 2 | flags: FLUSH 0x0001, ATOMIC_WRITE 0x0002, RFC7306_ATOMICS 0x0004; others reserved |
//! | 8 | 2 | the largest ULPDU this side accepts (0: not stated, assume 1454) |
//! | 10 | 2 | reserved, zero |
//! | 12 | n | opaque application bytes (the control plane's) |
//!
//! A later version may grow the block; readers take the fields they know and skip to the
//! stated length. Private data without the magic (Linux siw, other iWARP peers) means "no
//! capabilities": such a peer gets no private opcodes, and all of its private data is
//! application bytes.

use super::cursor::{Reader, Writer};
use super::error::{Result, WireError};

/// The block's magic.
pub const MAGIC: [u8; 4] = *b"rPMA";
/// The version this code writes.
pub const VERSION: u8 = 1;
/// Length of a version-1 block.
pub const BLOCK_LEN: usize = 12;

/// Capability flags.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct CapFlags(pub u16);

impl CapFlags {
    /// Understands the private Flush Request (0xC) and its response (0xE).
    pub const FLUSH: CapFlags = CapFlags(0x0001);
    /// Understands the private Atomic Write Request (0xD) and its response (0xE).
    pub const ATOMIC_WRITE: CapFlags = CapFlags(0x0002);
    /// Understands RFC 7306 Atomic Request/Response and Immediate Data (0x8-0xB).
    pub const RFC7306_ATOMICS: CapFlags = CapFlags(0x0004);
    /// Everything this implementation supports.
    pub const ALL: CapFlags = CapFlags(0x0007);
    /// Nothing.
    pub const NONE: CapFlags = CapFlags(0);

    /// Whether every flag of `other` is set.
    pub const fn contains(self, other: CapFlags) -> bool {
        self.0 & other.0 == other.0
    }

    /// The flags set in both.
    pub const fn intersection(self, other: CapFlags) -> CapFlags {
        CapFlags(self.0 & other.0)
    }
}

impl std::ops::BitOr for CapFlags {
    type Output = CapFlags;
    fn bitor(self, rhs: CapFlags) -> CapFlags {
        CapFlags(self.0 | rhs.0)
    }
}

/// One side's capabilities plus its application bytes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Caps {
    /// Whether the block was present (false for a foreign peer).
    pub present: bool,
    /// Version of the block received (ours when sending).
    pub version: u8,
    /// Flags. Unknown bits received are kept, and ignored by [`CapFlags::contains`] users.
    pub flags: CapFlags,
    /// The largest ULPDU this side accepts, if stated.
    pub max_ulpdu: Option<u16>,
    /// Application bytes after the block.
    pub app: Vec<u8>,
}

impl Caps {
    /// Our capabilities: a version-1 block with `flags`, `max_ulpdu`, and application bytes.
    pub fn new(flags: CapFlags, max_ulpdu: Option<u16>, app: Vec<u8>) -> Caps {
        Caps {
            present: true,
            version: VERSION,
            flags,
            max_ulpdu,
            app,
        }
    }

    /// A foreign peer's private data: no block, everything is application bytes.
    pub fn foreign(app: Vec<u8>) -> Caps {
        Caps {
            present: false,
            version: 0,
            flags: CapFlags::NONE,
            max_ulpdu: None,
            app,
        }
    }

    /// Encoded length.
    pub fn len(&self) -> usize {
        if self.present {
            BLOCK_LEN + self.app.len()
        } else {
            self.app.len()
        }
    }

    /// Whether nothing would be encoded.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Appends the encoding to `out` (a version-1 block, or only the app bytes when absent).
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        if self.present {
            let mut b = [0u8; BLOCK_LEN];
            Writer::new(&mut b)
                .put(&MAGIC)
                .u8(VERSION)
                .u8(BLOCK_LEN as u8)
                .u16(self.flags.0)
                .u16(self.max_ulpdu.unwrap_or(0))
                .u16(0);
            out.extend_from_slice(&b);
        }
        out.extend_from_slice(&self.app);
    }

    /// Decodes the application part of MPA private data (after the IRD/ORD prefix).
    ///
    /// # Errors
    /// [`WireError::BadCaps`] if the magic is there but the block is malformed: version 0, a
    /// stated length below 12, or a length beyond the private data; or if it states a maximum
    /// ULPDU below [`MIN_MAX_ULPDU`](super::tx::MIN_MAX_ULPDU) (too small for every control
    /// message).
    pub fn decode(pd: &[u8]) -> Result<Caps> {
        if pd.len() < MAGIC.len() || pd[..4] != MAGIC {
            return Ok(Caps::foreign(pd.to_vec()));
        }
        let bad = |reason| WireError::BadCaps { reason };
        let mut r = Reader::new(pd, "capability block");
        r.skip(4).map_err(|_| bad("truncated"))?;
        let version = r.u8().map_err(|_| bad("truncated"))?;
        let len = r.u8().map_err(|_| bad("truncated"))? as usize;
        if version == 0 {
            return Err(bad("version 0"));
        }
        if len < BLOCK_LEN {
            return Err(bad("block shorter than version 1"));
        }
        if len > pd.len() {
            return Err(bad("block longer than the private data"));
        }
        let flags = CapFlags(r.u16().map_err(|_| bad("truncated"))?);
        let max = r.u16().map_err(|_| bad("truncated"))?;
        if max != 0 && (max as usize) < super::tx::MIN_MAX_ULPDU {
            return Err(bad("max ULPDU below 128"));
        }
        Ok(Caps {
            present: true,
            version,
            flags,
            max_ulpdu: (max != 0).then_some(max),
            app: pd[len..].to_vec(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caps_golden() {
        let c = Caps::new(CapFlags::ALL, Some(1454), b"hi".to_vec());
        let mut out = Vec::new();
        c.encode_into(&mut out);
        assert_eq!(
            out,
            [0x72, 0x50, 0x4D, 0x41, 1, 12, 0x00, 0x07, 0x05, 0xAE, 0, 0, b'h', b'i']
        );
        assert_eq!(c.len(), out.len());
        assert_eq!(Caps::decode(&out).unwrap(), c);
    }

    #[test]
    fn foreign_private_data_has_no_caps() {
        let c = Caps::decode(b"siw private").unwrap();
        assert!(!c.present);
        assert_eq!(c.flags, CapFlags::NONE);
        assert_eq!(c.app, b"siw private");
        assert_eq!(Caps::decode(b"").unwrap(), Caps::foreign(vec![]));
        assert_eq!(Caps::decode(b"rPM").unwrap().app, b"rPM");
        let mut out = Vec::new();
        Caps::foreign(b"x".to_vec()).encode_into(&mut out);
        assert_eq!(out, b"x");
    }

    #[test]
    fn later_versions_are_read_by_skipping_to_their_length() {
        let mut b = vec![
            0x72, 0x50, 0x4D, 0x41, 2, 16, 0x80, 0x01, 0, 0, 0, 0, 9, 9, 9, 9,
        ];
        b.extend_from_slice(b"app");
        let c = Caps::decode(&b).unwrap();
        assert_eq!(c.version, 2);
        assert!(c.flags.contains(CapFlags::FLUSH));
        assert!(!c.flags.contains(CapFlags::ATOMIC_WRITE));
        assert_eq!(c.max_ulpdu, None);
        assert_eq!(c.app, b"app");
    }

    #[test]
    fn malformed_blocks_are_errors() {
        for (b, reason) in [
            (&[0x72u8, 0x50, 0x4D, 0x41][..], "truncated"),
            (&[0x72, 0x50, 0x4D, 0x41, 1][..], "truncated"),
            (
                &[0x72, 0x50, 0x4D, 0x41, 0, 12, 0, 0, 0, 0, 0, 0][..],
                "version 0",
            ),
            (
                &[0x72, 0x50, 0x4D, 0x41, 1, 8, 0, 0, 0, 0, 0, 0][..],
                "block shorter than version 1",
            ),
            (
                &[0x72, 0x50, 0x4D, 0x41, 1, 13, 0, 0, 0, 0, 0, 0][..],
                "block longer than the private data",
            ),
            (
                &[0x72, 0x50, 0x4D, 0x41, 1, 12, 0, 0, 0, 127, 0, 0][..],
                "max ULPDU below 128",
            ),
        ] {
            match Caps::decode(b) {
                Err(WireError::BadCaps { reason: r }) => assert_eq!(r, reason),
                other => panic!("{b:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn flag_algebra() {
        let f = CapFlags::FLUSH | CapFlags::RFC7306_ATOMICS;
        assert!(f.contains(CapFlags::FLUSH));
        assert!(!f.contains(CapFlags::ALL));
        assert_eq!(
            f.intersection(CapFlags::ATOMIC_WRITE | CapFlags::FLUSH),
            CapFlags::FLUSH
        );
    }
}
