//! The NBD wire format (fixed newstyle handshake, simple replies), as the NBD protocol
//! document (NetworkBlockDevice/nbd doc/proto.md) defines it: constants, a cursor that fails
//! on short input, and encoders. Everything here is big-endian ("network byte order"). No
//! panics on anything that came from the network: every read goes through [`Cursor`].

use std::fmt;

/// `NBDMAGIC`: the first 8 bytes the server sends.
pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
/// `IHAVEOPT`: the server's second magic, and the magic of every option request.
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
/// Magic of an option reply.
pub const OPT_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// Magic of a transmission request.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// Magic of a simple reply.
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;

/// Handshake flags (server): fixed newstyle, and the 124 zero bytes may be left out.
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
/// See [`FLAG_FIXED_NEWSTYLE`].
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
/// Client flags: the client speaks fixed newstyle.
pub const FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
/// Client flags: leave out the 124 zero bytes after `NBD_OPT_EXPORT_NAME`.
pub const FLAG_C_NO_ZEROES: u32 = 1 << 1;

/// Options.
pub const OPT_EXPORT_NAME: u32 = 1;
/// See [`OPT_EXPORT_NAME`].
pub const OPT_ABORT: u32 = 2;
/// See [`OPT_EXPORT_NAME`].
pub const OPT_LIST: u32 = 3;
/// See [`OPT_EXPORT_NAME`].
pub const OPT_INFO: u32 = 6;
/// See [`OPT_EXPORT_NAME`].
pub const OPT_GO: u32 = 7;

/// Option reply types.
pub const REP_ACK: u32 = 1;
/// See [`REP_ACK`].
pub const REP_SERVER: u32 = 2;
/// See [`REP_ACK`].
pub const REP_INFO: u32 = 3;
/// Option error replies (bit 31 set).
pub const REP_ERR_UNSUP: u32 = 0x8000_0001;
/// See [`REP_ERR_UNSUP`].
pub const REP_ERR_INVALID: u32 = 0x8000_0003;
/// See [`REP_ERR_UNSUP`].
pub const REP_ERR_UNKNOWN: u32 = 0x8000_0006;
/// See [`REP_ERR_UNSUP`].
pub const REP_ERR_SHUTDOWN: u32 = 0x8000_0007;

/// Information types of `NBD_OPT_INFO` / `NBD_OPT_GO`.
pub const INFO_EXPORT: u16 = 0;
/// See [`INFO_EXPORT`].
pub const INFO_NAME: u16 = 1;
/// See [`INFO_EXPORT`].
pub const INFO_DESCRIPTION: u16 = 2;
/// See [`INFO_EXPORT`].
pub const INFO_BLOCK_SIZE: u16 = 3;

/// Transmission flags.
pub const TF_HAS_FLAGS: u16 = 1 << 0;
/// See [`TF_HAS_FLAGS`].
pub const TF_READ_ONLY: u16 = 1 << 1;
/// See [`TF_HAS_FLAGS`].
pub const TF_SEND_FLUSH: u16 = 1 << 2;
/// See [`TF_HAS_FLAGS`].
pub const TF_SEND_FUA: u16 = 1 << 3;
/// See [`TF_HAS_FLAGS`].
pub const TF_SEND_WRITE_ZEROES: u16 = 1 << 6;
/// See [`TF_HAS_FLAGS`].
pub const TF_CAN_MULTI_CONN: u16 = 1 << 8;

/// Commands.
pub const CMD_READ: u16 = 0;
/// See [`CMD_READ`].
pub const CMD_WRITE: u16 = 1;
/// See [`CMD_READ`].
pub const CMD_DISC: u16 = 2;
/// See [`CMD_READ`].
pub const CMD_FLUSH: u16 = 3;
/// See [`CMD_READ`].
pub const CMD_WRITE_ZEROES: u16 = 6;

/// Command flags.
pub const CMD_FLAG_FUA: u16 = 1 << 0;
/// See [`CMD_FLAG_FUA`].
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;

/// Error values of a reply (the Linux errno numbers the protocol fixes).
pub const EPERM: u32 = 1;
/// See [`EPERM`].
pub const EIO: u32 = 5;
/// See [`EPERM`].
pub const EINVAL: u32 = 22;
/// See [`EPERM`].
pub const ENOSPC: u32 = 28;
/// See [`EPERM`].
pub const ESHUTDOWN: u32 = 108;

/// Bytes of a request header.
pub const REQUEST_LEN: usize = 28;
/// Bytes of an option request header.
pub const OPTION_LEN: usize = 16;

/// Input that ended early or did not follow the protocol.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// Fewer bytes than the field needs.
    #[error("short message: {what} needs {need} more byte(s)")]
    Short {
        /// The field.
        what: &'static str,
        /// Bytes missing.
        need: usize,
    },
    /// A magic number that is not the protocol's.
    #[error("bad magic {got:#x} where {what} was expected")]
    BadMagic {
        /// Which magic.
        what: &'static str,
        /// What came.
        got: u64,
    },
    /// A string that is not UTF-8.
    #[error("{what} is not UTF-8")]
    NotUtf8 {
        /// Which string.
        what: &'static str,
    },
    /// Bytes left over after the fields of an option.
    #[error("{extra} unexpected byte(s) after {what}")]
    Trailing {
        /// The option.
        what: &'static str,
        /// How many.
        extra: usize,
    },
}

/// Reads big-endian fields off a byte slice; every read fails on short input.
#[derive(Debug)]
pub struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    /// A cursor at the start of `buf`.
    pub fn new(buf: &'a [u8]) -> Cursor<'a> {
        Cursor { buf, pos: 0 }
    }

    /// Bytes not read yet.
    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    /// The next `n` bytes.
    ///
    /// # Errors
    /// [`WireError::Short`].
    pub fn bytes(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], WireError> {
        if self.remaining() < n {
            return Err(WireError::Short {
                what,
                need: n - self.remaining(),
            });
        }
        let b = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(b)
    }

    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], WireError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.bytes(N, what)?);
        Ok(a)
    }

    /// A u16.
    ///
    /// # Errors
    /// [`WireError::Short`].
    pub fn u16(&mut self, what: &'static str) -> Result<u16, WireError> {
        self.array(what).map(u16::from_be_bytes)
    }

    /// A u32.
    ///
    /// # Errors
    /// [`WireError::Short`].
    pub fn u32(&mut self, what: &'static str) -> Result<u32, WireError> {
        self.array(what).map(u32::from_be_bytes)
    }

    /// A u64.
    ///
    /// # Errors
    /// [`WireError::Short`].
    pub fn u64(&mut self, what: &'static str) -> Result<u64, WireError> {
        self.array(what).map(u64::from_be_bytes)
    }

    /// A string of `n` bytes.
    ///
    /// # Errors
    /// [`WireError::Short`], [`WireError::NotUtf8`].
    pub fn string(&mut self, n: usize, what: &'static str) -> Result<&'a str, WireError> {
        std::str::from_utf8(self.bytes(n, what)?).map_err(|_| WireError::NotUtf8 { what })
    }

    /// Nothing may be left.
    ///
    /// # Errors
    /// [`WireError::Trailing`].
    pub fn finish(&self, what: &'static str) -> Result<(), WireError> {
        match self.remaining() {
            0 => Ok(()),
            extra => Err(WireError::Trailing { what, extra }),
        }
    }
}

/// The header of an option request (its data follows).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionHeader {
    /// The option.
    pub option: u32,
    /// Bytes of data that follow.
    pub len: u32,
}

impl OptionHeader {
    /// Parses the 16 bytes of an option header.
    ///
    /// # Errors
    /// [`WireError::Short`], [`WireError::BadMagic`].
    pub fn parse(b: &[u8]) -> Result<OptionHeader, WireError> {
        let mut c = Cursor::new(b);
        let magic = c.u64("option magic")?;
        if magic != IHAVEOPT {
            return Err(WireError::BadMagic {
                what: "IHAVEOPT",
                got: magic,
            });
        }
        Ok(OptionHeader {
            option: c.u32("option")?,
            len: c.u32("option length")?,
        })
    }
}

/// The data of `NBD_OPT_INFO` and `NBD_OPT_GO`: an export name and the information asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InfoRequest {
    /// The export name.
    pub name: String,
    /// The information types requested.
    pub requests: Vec<u16>,
}

impl InfoRequest {
    /// Parses the option data.
    ///
    /// # Errors
    /// [`WireError`] when the lengths do not add up or the name is not UTF-8.
    pub fn parse(b: &[u8]) -> Result<InfoRequest, WireError> {
        let mut c = Cursor::new(b);
        let n = c.u32("export name length")? as usize;
        let name = c.string(n, "export name")?.to_owned();
        let count = c.u16("information request count")?;
        let requests = (0..count)
            .map(|_| c.u16("information request"))
            .collect::<Result<Vec<_>, _>>()?;
        c.finish("NBD_OPT_INFO/GO")?;
        Ok(InfoRequest { name, requests })
    }
}

/// A transmission request header (a WRITE's payload follows it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    /// Command flags.
    pub flags: u16,
    /// The command.
    pub kind: u16,
    /// The client's handle, echoed in the reply.
    pub handle: u64,
    /// Byte offset in the export.
    pub offset: u64,
    /// Bytes.
    pub len: u32,
}

impl Request {
    /// Parses the 28 bytes of a request header.
    ///
    /// # Errors
    /// [`WireError::Short`], [`WireError::BadMagic`].
    pub fn parse(b: &[u8]) -> Result<Request, WireError> {
        let mut c = Cursor::new(b);
        let magic = c.u32("request magic")?;
        if magic != REQUEST_MAGIC {
            return Err(WireError::BadMagic {
                what: "NBD_REQUEST_MAGIC",
                got: u64::from(magic),
            });
        }
        Ok(Request {
            flags: c.u16("command flags")?,
            kind: c.u16("command")?,
            handle: c.u64("handle")?,
            offset: c.u64("offset")?,
            len: c.u32("length")?,
        })
    }

    /// Whether a payload of `len` bytes follows the header.
    pub fn has_payload(&self) -> bool {
        self.kind == CMD_WRITE
    }
}

/// The name of an option, for logs.
pub fn option_name(option: u32) -> &'static str {
    match option {
        OPT_EXPORT_NAME => "NBD_OPT_EXPORT_NAME",
        OPT_ABORT => "NBD_OPT_ABORT",
        OPT_LIST => "NBD_OPT_LIST",
        5 => "NBD_OPT_STARTTLS",
        OPT_INFO => "NBD_OPT_INFO",
        OPT_GO => "NBD_OPT_GO",
        8 => "NBD_OPT_STRUCTURED_REPLY",
        9 => "NBD_OPT_LIST_META_CONTEXT",
        10 => "NBD_OPT_SET_META_CONTEXT",
        11 => "NBD_OPT_EXTENDED_HEADERS",
        _ => "an unknown option",
    }
}

/// The server's greeting: `NBDMAGIC`, `IHAVEOPT`, handshake flags.
pub fn greeting() -> [u8; 18] {
    let mut b = [0u8; 18];
    b[..8].copy_from_slice(&NBDMAGIC.to_be_bytes());
    b[8..16].copy_from_slice(&IHAVEOPT.to_be_bytes());
    b[16..].copy_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
    b
}

/// An option reply with `data`, appended to `out`.
pub fn option_reply(out: &mut Vec<u8>, option: u32, reply: u32, data: &[u8]) {
    out.extend_from_slice(&OPT_REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&option.to_be_bytes());
    out.extend_from_slice(&reply.to_be_bytes());
    // Callers build data from a name (at most a few KiB) and fixed fields.
    out.extend_from_slice(&u32::try_from(data.len()).unwrap_or(u32::MAX).to_be_bytes());
    out.extend_from_slice(data);
}

/// Export size and transmission flags: `NBD_INFO_EXPORT` without its type, and the reply to
/// `NBD_OPT_EXPORT_NAME` without the zeroes.
pub fn export_fields(size: u64, flags: u16) -> [u8; 10] {
    let mut b = [0u8; 10];
    b[..8].copy_from_slice(&size.to_be_bytes());
    b[8..].copy_from_slice(&flags.to_be_bytes());
    b
}

/// Block size constraints of an export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockSizes {
    /// Requests are multiples of this, at offsets that are (a power of 2, 1..=64 KiB).
    pub min: u32,
    /// Requests of (multiples of) this size are efficient (a power of 2, at least `min`).
    pub preferred: u32,
    /// The largest payload (a multiple of `min`).
    pub max: u32,
}

impl BlockSizes {
    /// The sizes for a namespace of `block_size` bytes per block, with payloads of at most
    /// `max_payload` bytes.
    pub fn for_block(block_size: u32, max_payload: u32) -> BlockSizes {
        let min = if block_size.is_power_of_two() && block_size <= 65536 {
            block_size
        } else {
            1
        };
        BlockSizes {
            min,
            preferred: min.max(4096),
            max: max_payload - max_payload % min,
        }
    }

    /// The `NBD_INFO_BLOCK_SIZE` information (type included).
    pub fn info(&self) -> [u8; 14] {
        let mut b = [0u8; 14];
        b[..2].copy_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
        b[2..6].copy_from_slice(&self.min.to_be_bytes());
        b[6..10].copy_from_slice(&self.preferred.to_be_bytes());
        b[10..].copy_from_slice(&self.max.to_be_bytes());
        b
    }
}

/// Bytes of a simple reply header.
pub const SIMPLE_REPLY_LEN: usize = 16;

/// A simple reply header (a successful READ's data follows it).
pub fn simple_reply_header(error: u32, handle: u64) -> [u8; SIMPLE_REPLY_LEN] {
    let mut b = [0u8; SIMPLE_REPLY_LEN];
    b[..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    b[4..8].copy_from_slice(&error.to_be_bytes());
    b[8..].copy_from_slice(&handle.to_be_bytes());
    b
}

/// A simple reply header, appended to `out`.
pub fn simple_reply(out: &mut Vec<u8>, error: u32, handle: u64) {
    out.extend_from_slice(&simple_reply_header(error, handle));
}

/// An errno of a reply, by name, for logs.
#[derive(Debug, Clone, Copy)]
pub struct Errno(pub u32);

impl fmt::Display for Errno {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = match self.0 {
            0 => "OK",
            EPERM => "EPERM",
            EIO => "EIO",
            EINVAL => "EINVAL",
            ENOSPC => "ENOSPC",
            ESHUTDOWN => "ESHUTDOWN",
            _ => "errno",
        };
        write!(f, "{n} ({})", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request_bytes(
        magic: u32,
        flags: u16,
        kind: u16,
        handle: u64,
        off: u64,
        len: u32,
    ) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(&magic.to_be_bytes());
        b.extend_from_slice(&flags.to_be_bytes());
        b.extend_from_slice(&kind.to_be_bytes());
        b.extend_from_slice(&handle.to_be_bytes());
        b.extend_from_slice(&off.to_be_bytes());
        b.extend_from_slice(&len.to_be_bytes());
        b
    }

    #[test]
    fn requests_parse_and_reject_short_or_bad_input() {
        let b = request_bytes(REQUEST_MAGIC, CMD_FLAG_FUA, CMD_WRITE, 7, 4096, 512);
        assert_eq!(b.len(), REQUEST_LEN);
        let r = Request::parse(&b).unwrap();
        assert_eq!(
            r,
            Request {
                flags: CMD_FLAG_FUA,
                kind: CMD_WRITE,
                handle: 7,
                offset: 4096,
                len: 512
            }
        );
        assert!(r.has_payload());
        for n in 0..REQUEST_LEN {
            assert!(
                matches!(Request::parse(&b[..n]), Err(WireError::Short { .. })),
                "{n}"
            );
        }
        let bad = request_bytes(0x1234_5678, 0, CMD_READ, 1, 0, 1);
        assert!(matches!(
            Request::parse(&bad),
            Err(WireError::BadMagic {
                got: 0x1234_5678,
                ..
            })
        ));
    }

    #[test]
    fn options_and_info_requests() {
        let mut b = IHAVEOPT.to_be_bytes().to_vec();
        b.extend_from_slice(&OPT_GO.to_be_bytes());
        b.extend_from_slice(&9u32.to_be_bytes());
        assert_eq!(
            OptionHeader::parse(&b).unwrap(),
            OptionHeader {
                option: OPT_GO,
                len: 9
            }
        );
        assert!(OptionHeader::parse(&b[..15]).is_err());
        b[0] = 0;
        assert!(matches!(
            OptionHeader::parse(&b),
            Err(WireError::BadMagic { .. })
        ));

        let mut d = 3u32.to_be_bytes().to_vec();
        d.extend_from_slice(b"abc");
        d.extend_from_slice(&2u16.to_be_bytes());
        d.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
        d.extend_from_slice(&INFO_NAME.to_be_bytes());
        let r = InfoRequest::parse(&d).unwrap();
        assert_eq!(r.name, "abc");
        assert_eq!(r.requests, vec![INFO_BLOCK_SIZE, INFO_NAME]);
        // Every truncation, an overlong name length and trailing bytes are errors.
        for n in 0..d.len() {
            assert!(InfoRequest::parse(&d[..n]).is_err(), "{n}");
        }
        let mut long = d.clone();
        long.push(0);
        assert!(matches!(
            InfoRequest::parse(&long),
            Err(WireError::Trailing { extra: 1, .. })
        ));
        let mut huge = d.clone();
        huge[..4].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(InfoRequest::parse(&huge).is_err());
        let mut latin = d;
        latin[4] = 0xff;
        assert!(matches!(
            InfoRequest::parse(&latin),
            Err(WireError::NotUtf8 { .. })
        ));
    }

    #[test]
    fn replies_and_block_sizes() {
        let g = greeting();
        assert_eq!(&g[..8], b"NBDMAGIC");
        assert_eq!(&g[8..16], b"IHAVEOPT");
        assert_eq!(&g[16..], &[0, 3]);
        let mut out = Vec::new();
        option_reply(&mut out, OPT_LIST, REP_ACK, &[]);
        assert_eq!(out.len(), 20);
        assert_eq!(&out[..8], &OPT_REPLY_MAGIC.to_be_bytes());
        assert_eq!(&out[12..16], &REP_ACK.to_be_bytes());
        out.clear();
        simple_reply(&mut out, EIO, 0x0102);
        assert_eq!(
            out,
            [0x67, 0x44, 0x66, 0x98, 0, 0, 0, 5, 0, 0, 0, 0, 0, 0, 1, 2]
        );

        let s = BlockSizes::for_block(512, 32 << 20);
        assert_eq!((s.min, s.preferred, s.max), (512, 4096, 32 << 20));
        let s = BlockSizes::for_block(4096, 32 << 20);
        assert_eq!((s.min, s.preferred), (4096, 4096));
        let i = s.info();
        assert_eq!(&i[..2], &[0, 3]);
        assert_eq!(&i[2..6], &4096u32.to_be_bytes());
        assert_eq!(&i[10..], &(32u32 << 20).to_be_bytes());
        // A block size the protocol cannot express: no constraint at all.
        assert_eq!(BlockSizes::for_block(3000, 32 << 20).min, 1);
        assert_eq!(export_fields(1 << 20, TF_HAS_FLAGS)[8..], [0, 1]);
        assert_eq!(Errno(ENOSPC).to_string(), "ENOSPC (28)");
    }
}
