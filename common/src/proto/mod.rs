//! The control-plane wire format: the messages that travel as Send/Recv payloads on a queue pair
//! once the transport has connected.
//!
//! # Quick start
//!
//! ```
//! use rpma_common::proto::{FlushRequest, Message};
//!
//! let req = FlushRequest { nsid: 1, offset: 4096, length: 8192, token: 7 };
//! let bytes = req.encode(); // 32 bytes, fixed little-endian layout, no allocation
//! match Message::decode(&bytes).unwrap() {
//!     Message::FlushRequest(r) => assert_eq!(r, req),
//!     other => panic!("unexpected {other:?}"),
//! }
//! ```
//!
//! # Layout
//!
//! Every message starts with the same 4-byte header: `version: u8`, `type: u8`, `flags: u16`
//! (little endian, no flags are defined yet and a non-zero value is refused). A message of an
//! unknown version or type is an error ([`Error::UnsupportedVersion`], [`Error::UnknownType`]),
//! never a guess.
//!
//! The hot-path messages ([`FlushRequest`], [`FlushResponse`], [`KeepAlive`]) have fixed
//! little-endian layouts written by hand (see `docs/control-plane.md`); the others carry a
//! [postcard](https://docs.rs/postcard) body. No message is longer than [`MAX_MESSAGE_SIZE`].
//! Decoding never panics and never reads past the input, whatever the input is.
//!
//! Submodules: [`nqn`] (NVMe qualified names, the default host NQN), [`auth`] (the mutual
//! HMAC-SHA256 challenge-response as a sans-I/O state machine pair), [`msgbuf`] (the registered
//! receive and send slots both ends carry these messages in).

pub mod auth;
mod fixed;
mod messages;
pub mod msgbuf;
pub mod nqn;

pub use fixed::{FlushRequest, FlushResponse, FlushStatus, KeepAlive};
pub use messages::{
    AuthChallenge, AuthConfirm, AuthResponse, Connect, ConnectResponse, Disconnect, DiscoveryEntry,
    DiscoveryRequest, DiscoveryResponse, DurabilityMethods, HostId, NamespaceDescriptor,
    PersistenceDomain, Refusal, RefusalReason,
};
pub use nqn::Nqn;

/// The protocol version this build speaks (and the only one it accepts).
///
/// History: 1, the first; 2, [`ConnectResponse`] gained `queue_depth` (postcard bodies are not
/// self-describing, so a new field is a new version); 3, [`NamespaceDescriptor`] gained
/// `failure` and [`FlushStatus`] `NamespaceFailed`; 4, [`NamespaceDescriptor`] gained
/// `simulation` (the power-loss simulation's label); 5, [`NamespaceDescriptor`] gained
/// `unavailable` (a namespace the target cannot register for this connection). A peer of another version gets
/// [`Error::UnsupportedVersion`] naming both; a target answers such a Connect with a Refusal
/// `VersionUnsupported`.
pub const PROTO_VERSION: u8 = 5;

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
    let mut r = fixed::Reader::new(buf);
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

fn header(ty: MessageType) -> [u8; HEADER_LEN] {
    [PROTO_VERSION, ty as u8, 0, 0]
}

/// Any control-plane message.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Message {
    /// See [`Connect`].
    Connect(Connect),
    /// See [`AuthChallenge`].
    AuthChallenge(AuthChallenge),
    /// See [`AuthResponse`].
    AuthResponse(AuthResponse),
    /// See [`AuthConfirm`].
    AuthConfirm(AuthConfirm),
    /// See [`ConnectResponse`].
    ConnectResponse(ConnectResponse),
    /// See [`Refusal`].
    Refusal(Refusal),
    /// See [`DiscoveryRequest`].
    DiscoveryRequest(DiscoveryRequest),
    /// See [`DiscoveryResponse`].
    DiscoveryResponse(DiscoveryResponse),
    /// See [`Disconnect`].
    Disconnect(Disconnect),
    /// See [`FlushRequest`].
    FlushRequest(FlushRequest),
    /// See [`FlushResponse`].
    FlushResponse(FlushResponse),
    /// See [`KeepAlive`].
    KeepAlive(KeepAlive),
}

impl Message {
    /// The message's type.
    pub fn message_type(&self) -> MessageType {
        match self {
            Message::Connect(_) => MessageType::Connect,
            Message::AuthChallenge(_) => MessageType::AuthChallenge,
            Message::AuthResponse(_) => MessageType::AuthResponse,
            Message::AuthConfirm(_) => MessageType::AuthConfirm,
            Message::ConnectResponse(_) => MessageType::ConnectResponse,
            Message::Refusal(_) => MessageType::Refusal,
            Message::DiscoveryRequest(_) => MessageType::DiscoveryRequest,
            Message::DiscoveryResponse(_) => MessageType::DiscoveryResponse,
            Message::Disconnect(_) => MessageType::Disconnect,
            Message::FlushRequest(_) => MessageType::FlushRequest,
            Message::FlushResponse(_) => MessageType::FlushResponse,
            Message::KeepAlive(_) => MessageType::KeepAlive,
        }
    }

    /// Encodes the message, header included.
    ///
    /// # Errors
    /// [`Error::Encode`] if serialization fails, [`Error::TooLarge`] if the result would exceed
    /// [`MAX_MESSAGE_SIZE`] (e.g. a discovery response listing too many subsystems).
    pub fn encode(&self) -> Result<Vec<u8>> {
        let ty = self.message_type();
        let out = match self {
            Message::FlushRequest(m) => m.encode().to_vec(),
            Message::FlushResponse(m) => m.encode().to_vec(),
            Message::KeepAlive(m) => m.encode().to_vec(),
            Message::Connect(m) => serde_body(ty, m)?,
            Message::AuthChallenge(m) => serde_body(ty, m)?,
            Message::AuthResponse(m) => serde_body(ty, m)?,
            Message::AuthConfirm(m) => serde_body(ty, m)?,
            Message::ConnectResponse(m) => serde_body(ty, m)?,
            Message::Refusal(m) => serde_body(ty, m)?,
            Message::DiscoveryRequest(m) => serde_body(ty, m)?,
            Message::DiscoveryResponse(m) => serde_body(ty, m)?,
            Message::Disconnect(m) => serde_body(ty, m)?,
        };
        if out.len() > MAX_MESSAGE_SIZE {
            return Err(Error::TooLarge {
                len: out.len(),
                max: MAX_MESSAGE_SIZE,
            });
        }
        Ok(out)
    }

    /// Decodes one message (the whole of `buf`).
    ///
    /// # Errors
    /// Those of [`peek_type`], [`Error::Truncated`] / [`Error::TrailingBytes`] /
    /// [`Error::InvalidField`] for fixed layouts, [`Error::Body`] for a malformed postcard body
    /// (including trailing bytes and invalid NQNs).
    pub fn decode(buf: &[u8]) -> Result<Message> {
        let ty = peek_type(buf)?;
        let body = &buf[HEADER_LEN..];
        Ok(match ty {
            MessageType::FlushRequest => Message::FlushRequest(FlushRequest::decode(buf)?),
            MessageType::FlushResponse => Message::FlushResponse(FlushResponse::decode(buf)?),
            MessageType::KeepAlive => Message::KeepAlive(KeepAlive::decode(buf)?),
            MessageType::Connect => Message::Connect(serde_decode(ty, body)?),
            MessageType::AuthChallenge => Message::AuthChallenge(serde_decode(ty, body)?),
            MessageType::AuthResponse => Message::AuthResponse(serde_decode(ty, body)?),
            MessageType::AuthConfirm => Message::AuthConfirm(serde_decode(ty, body)?),
            MessageType::ConnectResponse => Message::ConnectResponse(serde_decode(ty, body)?),
            MessageType::Refusal => Message::Refusal(serde_decode(ty, body)?),
            MessageType::DiscoveryRequest => Message::DiscoveryRequest(serde_decode(ty, body)?),
            MessageType::DiscoveryResponse => Message::DiscoveryResponse(serde_decode(ty, body)?),
            MessageType::Disconnect => Message::Disconnect(serde_decode(ty, body)?),
        })
    }
}

fn serde_body<T: serde::Serialize>(ty: MessageType, m: &T) -> Result<Vec<u8>> {
    let mut out = header(ty).to_vec();
    let body = postcard::to_allocvec(m).map_err(|source| Error::Encode { ty, source })?;
    out.extend_from_slice(&body);
    Ok(out)
}

fn serde_decode<'a, T: serde::Deserialize<'a>>(ty: MessageType, body: &'a [u8]) -> Result<T> {
    let (v, rest) = postcard::take_from_bytes(body).map_err(|source| Error::Body { ty, source })?;
    if !rest.is_empty() {
        return Err(Error::TrailingBytes {
            ty,
            extra: rest.len(),
        });
    }
    Ok(v)
}

#[cfg(test)]
mod tests;
