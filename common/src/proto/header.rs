//! The common header every control-plane message starts with (version, type, flags), the
//! wire format's errors, and the bounds-checked cursor that reads untrusted bytes: what the
//! fixed layouts (fixed.rs) and the postcard messages (mod.rs) both build on.

/// The protocol version this build speaks (and the only one it accepts).
///
/// History: 1, the first; 2, [`ConnectResponse`] gained `queue_depth` (postcard bodies are not
/// self-describing, so a new field is a new version); 3, [`NamespaceDescriptor`] gained
/// `failure` and [`FlushStatus`] `NamespaceFailed`; 4, [`NamespaceDescriptor`] gained
/// `simulation` (the power-loss simulation's label); 5, [`NamespaceDescriptor`] gained
/// `unavailable` (a namespace the target cannot register for this connection); 6,
/// [`NamespaceDescriptor`] gained `identity` (which file the target maps); 7, the discovery
/// listing and a session's namespaces come in pages ([`DiscoveryRequest`] `start`,
/// [`DiscoveryResponse`] `total` and `generation`; [`ConnectResponse`] `namespace_count`, the
/// NamespacesRequest and NamespacesResponse). A peer of another
/// version gets [`Error::UnsupportedVersion`] naming both; a target answers such a Connect with
/// a Refusal `VersionUnsupported`.
///
/// [`ConnectResponse`]: super::ConnectResponse
/// [`NamespaceDescriptor`]: super::NamespaceDescriptor
/// [`DiscoveryRequest`]: super::DiscoveryRequest
/// [`DiscoveryResponse`]: super::DiscoveryResponse
/// [`FlushStatus`]: super::FlushStatus
pub const PROTO_VERSION: u8 = 7;

/// The largest control-plane message, header included. Receive buffers of this size always suffice.
pub const MAX_MESSAGE_SIZE: usize = 8192;

/// Size of the common header.
pub const HEADER_LEN: usize = 4;

/// Errors from encoding or decoding a control-plane message.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The input ended before the field being read.
    #[error("message truncated: need {needed} bytes at offset {offset} for {field}, have {len}")]
    Truncated {
        /// Field being read.
        field: &'static str,
        /// Offset of that field.
        offset: usize,
        /// Bytes the field needs.
        needed: usize,
        /// Length of the input.
        len: usize,
    },
    /// A message of a version this build does not speak.
    #[error("unsupported control-plane version {got} (this build speaks version {supported})")]
    UnsupportedVersion {
        /// Version in the header.
        got: u8,
        /// The version this build speaks.
        supported: u8,
    },
    /// A message type this build does not know.
    #[error("unknown control-plane message type {0:#04x}")]
    UnknownType(u8),
    /// Header flags that are not defined.
    #[error("undefined header flags {0:#06x} in a {1:?} message")]
    UnknownFlags(u16, MessageType),
    /// The message (or input) is longer than [`MAX_MESSAGE_SIZE`].
    #[error("message of {len} bytes exceeds the maximum of {max}")]
    TooLarge {
        /// Length of the message.
        len: usize,
        /// [`MAX_MESSAGE_SIZE`].
        max: usize,
    },
    /// A fixed-layout message with bytes after its last field.
    #[error("{ty:?} message has {extra} trailing bytes")]
    TrailingBytes {
        /// Type of the message.
        ty: MessageType,
        /// Count of bytes after the message.
        extra: usize,
    },
    /// A field holds a value outside its range.
    #[error("{ty:?} message: field {field} has invalid value {value}")]
    InvalidField {
        /// Type of the message.
        ty: MessageType,
        /// The field.
        field: &'static str,
        /// Its value.
        value: u64,
    },
    /// The postcard body of a message could not be decoded (this includes an invalid NQN inside
    /// it).
    #[error("malformed {ty:?} body")]
    Body {
        /// Type of the message.
        ty: MessageType,
        /// What postcard reported.
        #[source]
        source: postcard::Error,
    },
    /// A message could not be encoded.
    #[error("cannot encode a {ty:?} message")]
    Encode {
        /// Type of the message.
        ty: MessageType,
        /// What postcard reported.
        #[source]
        source: postcard::Error,
    },
}

/// Result of the wire format's operations.
pub type Result<T> = std::result::Result<T, Error>;

macro_rules! message_types {
    ($($(#[$doc:meta])* $name:ident = $code:expr,)*) => {
        /// The type byte of a message's header.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[non_exhaustive]
        pub enum MessageType {
            $($(#[$doc])* $name = $code,)*
        }

        impl MessageType {
            /// The type with this code, if it is one.
            pub fn from_code(code: u8) -> Option<Self> {
                match code {
                    $($code => Some(Self::$name),)*
                    _ => None,
                }
            }
        }
    };
}

message_types! {
    /// Host -> target: open a queue on a subsystem.
    Connect = 0x01,
    /// Target -> host: the target's nonce.
    AuthChallenge = 0x02,
    /// Host -> target: the host's nonce and proof.
    AuthResponse = 0x03,
    /// Target -> host: the target's proof.
    AuthConfirm = 0x04,
    /// Target -> host: the queue is open; the namespace descriptors.
    ConnectResponse = 0x05,
    /// Target -> host: the connection is refused, with a reason.
    Refusal = 0x06,
    /// Host -> target: list the subsystems.
    DiscoveryRequest = 0x07,
    /// Target -> host: the subsystems and their listen URLs.
    DiscoveryResponse = 0x08,
    /// Either way: the sender is closing the connection.
    Disconnect = 0x09,
    /// Host -> target: the session's namespaces from one on (those its ConnectResponse had no
    /// room for).
    NamespacesRequest = 0x0A,
    /// Target -> host: a page of the session's namespaces.
    NamespacesResponse = 0x0B,
    /// Host -> target (hot path): make a range durable (GPSPM).
    FlushRequest = 0x10,
    /// Target -> host (hot path): the flush is done.
    FlushResponse = 0x11,
    /// Either way (hot path): keep-alive.
    KeepAlive = 0x12,
}

/// Reads and checks the common header; returns the message type.
///
/// # Errors
/// [`Error::Truncated`], [`Error::TooLarge`], [`Error::UnsupportedVersion`],
/// [`Error::UnknownType`], [`Error::UnknownFlags`].
pub fn peek_type(buf: &[u8]) -> Result<MessageType> {
    if buf.len() > MAX_MESSAGE_SIZE {
        return Err(Error::TooLarge {
            len: buf.len(),
            max: MAX_MESSAGE_SIZE,
        });
    }
    let mut r = Reader::new(buf);
    let version = r.u8("version")?;
    let ty = r.u8("type")?;
    let flags = r.u16("flags")?;
    if version != PROTO_VERSION {
        return Err(Error::UnsupportedVersion {
            got: version,
            supported: PROTO_VERSION,
        });
    }
    let ty = MessageType::from_code(ty).ok_or(Error::UnknownType(ty))?;
    if flags != 0 {
        return Err(Error::UnknownFlags(flags, ty));
    }
    Ok(ty)
}

pub(super) fn header(ty: MessageType) -> [u8; HEADER_LEN] {
    [PROTO_VERSION, ty as u8, 0, 0]
}

/// A bounds-checked little-endian reader over untrusted bytes.
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    pub(super) pos: usize,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }

    fn take<const N: usize>(&mut self, field: &'static str) -> Result<[u8; N]> {
        let end = self.pos.checked_add(N).filter(|&e| e <= self.buf.len());
        let Some(end) = end else {
            return Err(Error::Truncated {
                field,
                offset: self.pos,
                needed: N,
                len: self.buf.len(),
            });
        };
        let mut out = [0u8; N];
        out.copy_from_slice(&self.buf[self.pos..end]);
        self.pos = end;
        Ok(out)
    }

    pub(crate) fn u8(&mut self, field: &'static str) -> Result<u8> {
        Ok(self.take::<1>(field)?[0])
    }

    pub(crate) fn u16(&mut self, field: &'static str) -> Result<u16> {
        Ok(u16::from_le_bytes(self.take(field)?))
    }

    pub(crate) fn u32(&mut self, field: &'static str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(field)?))
    }

    pub(crate) fn u64(&mut self, field: &'static str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(field)?))
    }

    pub(super) fn finish(self, ty: MessageType) -> Result<()> {
        let extra = self.buf.len() - self.pos;
        if extra != 0 {
            return Err(Error::TrailingBytes { ty, extra });
        }
        Ok(())
    }
}
