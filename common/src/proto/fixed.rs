//! The hot-path messages: fixed little-endian layouts, encoded into arrays (no allocation) and
//! decoded with a bounds-checked cursor. Byte offsets are in `docs/control-plane.md`.

use super::header::{header, peek_type, Error, MessageType, Reader, Result, HEADER_LEN};

/// Checks the header for type `want` and returns a reader positioned after it.
fn open(buf: &[u8], want: MessageType) -> Result<Reader<'_>> {
    let ty = peek_type(buf)?;
    if ty != want {
        return Err(Error::InvalidField {
            ty: want,
            field: "type",
            value: ty as u64,
        });
    }
    let mut r = Reader::new(buf);
    r.pos = HEADER_LEN;
    Ok(r)
}

/// A small fixed-size writer: only ever used with arrays sized for the message.
struct Writer<const N: usize> {
    buf: [u8; N],
    pos: usize,
}

impl<const N: usize> Writer<N> {
    fn new(ty: MessageType) -> Self {
        let mut buf = [0u8; N];
        buf[..HEADER_LEN].copy_from_slice(&header(ty));
        Writer {
            buf,
            pos: HEADER_LEN,
        }
    }

    fn put(&mut self, bytes: &[u8]) -> &mut Self {
        self.buf[self.pos..self.pos + bytes.len()].copy_from_slice(bytes);
        self.pos += bytes.len();
        self
    }

    fn finish(&self) -> [u8; N] {
        debug_assert_eq!(self.pos, N, "layout and size disagree");
        self.buf
    }
}

/// GPSPM: make `length` bytes at `offset` of namespace `nsid` durable; answered by a
/// [`FlushResponse`] carrying the same `token`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FlushRequest {
    /// Namespace.
    pub nsid: u32,
    /// Byte offset within the namespace.
    pub offset: u64,
    /// Byte count.
    pub length: u64,
    /// Opaque to the target; echoed in the response.
    pub token: u64,
}

impl FlushRequest {
    /// Encoded size: header 4, nsid 4, offset 8, length 8, token 8.
    pub const LEN: usize = 32;

    /// Encodes the request.
    pub fn encode(&self) -> [u8; Self::LEN] {
        Writer::<{ Self::LEN }>::new(MessageType::FlushRequest)
            .put(&self.nsid.to_le_bytes())
            .put(&self.offset.to_le_bytes())
            .put(&self.length.to_le_bytes())
            .put(&self.token.to_le_bytes())
            .finish()
    }

    /// Decodes a request.
    ///
    /// # Errors
    /// Header errors (see [`super::peek_type`]), [`Error::InvalidField`] for another message type,
    /// [`Error::Truncated`], [`Error::TrailingBytes`]. Range checks against the namespace are the
    /// target's job, not the codec's.
    pub fn decode(buf: &[u8]) -> Result<Self> {
        let mut r = open(buf, MessageType::FlushRequest)?;
        let m = FlushRequest {
            nsid: r.u32("nsid")?,
            offset: r.u64("offset")?,
            length: r.u64("length")?,
            token: r.u64("token")?,
        };
        r.finish(MessageType::FlushRequest)?;
        Ok(m)
    }
}

/// The outcome of a [`FlushRequest`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FlushStatus {
    /// The range is durable.
    Durable = 0,
    /// The namespace is volatile: the range is visible, and nothing more can be promised.
    VisibleOnly = 1,
    /// No such namespace on this connection.
    InvalidNamespace = 2,
    /// The range is not inside the namespace.
    OutOfRange = 3,
    /// Writing back failed (an I/O error from the backing store): the range is NOT durable.
    IoError = 4,
    /// The target is shutting down or overloaded and did not flush: the range is NOT durable.
    Unavailable = 5,
    /// The namespace has failed (an earlier write-back of it failed): nothing on it can be made
    /// durable until an operator clears it (`rpma-target clear-failure`). Since protocol version 3.
    NamespaceFailed = 6,
}

impl FlushStatus {
    /// The status with this code, if it is one.
    pub fn from_code(code: u32) -> Option<Self> {
        Some(match code {
            0 => Self::Durable,
            1 => Self::VisibleOnly,
            2 => Self::InvalidNamespace,
            3 => Self::OutOfRange,
            4 => Self::IoError,
            5 => Self::Unavailable,
            6 => Self::NamespaceFailed,
            _ => return None,
        })
    }
}

/// The answer to a [`FlushRequest`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FlushResponse {
    /// The request's token.
    pub token: u64,
    /// What happened.
    pub status: FlushStatus,
}

impl FlushResponse {
    /// Encoded size: header 4, status 4, token 8.
    pub const LEN: usize = 16;

    /// Encodes the response.
    pub fn encode(&self) -> [u8; Self::LEN] {
        Writer::<{ Self::LEN }>::new(MessageType::FlushResponse)
            .put(&(self.status as u32).to_le_bytes())
            .put(&self.token.to_le_bytes())
            .finish()
    }

    /// Decodes a response.
    ///
    /// # Errors
    /// As [`FlushRequest::decode`], and [`Error::InvalidField`] for an unknown status code.
    pub fn decode(buf: &[u8]) -> Result<Self> {
        let ty = MessageType::FlushResponse;
        let mut r = open(buf, ty)?;
        let code = r.u32("status")?;
        let token = r.u64("token")?;
        r.finish(ty)?;
        let status = FlushStatus::from_code(code).ok_or(Error::InvalidField {
            ty,
            field: "status",
            value: code.into(),
        })?;
        Ok(FlushResponse { token, status })
    }
}

/// Keep-alive, sent by either side; the peer answers with the same sequence number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KeepAlive {
    /// Sequence number chosen by the side that started the exchange.
    pub seq: u64,
}

impl KeepAlive {
    /// Encoded size: header 4, seq 8.
    pub const LEN: usize = 12;

    /// Encodes the keep-alive.
    pub fn encode(&self) -> [u8; Self::LEN] {
        Writer::<{ Self::LEN }>::new(MessageType::KeepAlive)
            .put(&self.seq.to_le_bytes())
            .finish()
    }

    /// Decodes a keep-alive.
    ///
    /// # Errors
    /// As [`FlushRequest::decode`].
    pub fn decode(buf: &[u8]) -> Result<Self> {
        let mut r = open(buf, MessageType::KeepAlive)?;
        let seq = r.u64("seq")?;
        r.finish(MessageType::KeepAlive)?;
        Ok(KeepAlive { seq })
    }
}
