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
mod header;
mod messages;
pub mod msgbuf;
pub mod nqn;

pub use fixed::{FlushRequest, FlushResponse, FlushStatus, KeepAlive};
use header::header;
pub use header::{
    peek_type, Error, MessageType, Result, HEADER_LEN, MAX_MESSAGE_SIZE, PROTO_VERSION,
};
pub use messages::{
    AuthChallenge, AuthConfirm, AuthResponse, Connect, ConnectResponse, Disconnect, DiscoveryEntry,
    DiscoveryRequest, DiscoveryResponse, DurabilityMethods, HostId, NamespaceDescriptor,
    NamespacesRequest, NamespacesResponse, PersistenceDomain, Refusal, RefusalReason,
};
pub use nqn::Nqn;

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
    /// See [`NamespacesRequest`].
    NamespacesRequest(NamespacesRequest),
    /// See [`NamespacesResponse`].
    NamespacesResponse(NamespacesResponse),
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
            Message::NamespacesRequest(_) => MessageType::NamespacesRequest,
            Message::NamespacesResponse(_) => MessageType::NamespacesResponse,
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
            Message::NamespacesRequest(m) => serde_body(ty, m)?,
            Message::NamespacesResponse(m) => serde_body(ty, m)?,
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
            MessageType::NamespacesRequest => Message::NamespacesRequest(serde_decode(ty, body)?),
            MessageType::NamespacesResponse => Message::NamespacesResponse(serde_decode(ty, body)?),
        })
    }
}

/// The most entries a listing sent in pages (a discovery listing, a session's namespaces) may
/// have: a host reads no more (a target that says it has 4 billion would otherwise keep it
/// reading for ever), and the target's configuration check warns of a configuration that
/// makes a longer one.
pub const MAX_LISTING: u32 = 1 << 16;

/// The most memory a host gives one listing's entries once decoded ([`ListingEntry::cost`]):
/// the number of entries alone does not bound it (an entry of thousands of empty URLs takes
/// 24 bytes of memory for each byte on the wire). Enough for [`MAX_LISTING`] namespace
/// descriptors with their texts cut (under a kilobyte each) and for a discovery listing of
/// as many entries with a few listen URLs each (the target's configuration check warns of a
/// wider one).
pub const MAX_LISTING_BYTES: usize = 64 << 20;

/// An entry of a listing sent in pages, with the memory it takes once decoded.
pub trait ListingEntry {
    /// Bytes of memory it takes, its strings included (an upper bound, near enough).
    fn cost(&self) -> usize;
}

impl ListingEntry for DiscoveryEntry {
    fn cost(&self) -> usize {
        let strings: usize = self.listen.iter().map(|u| u.len() + 24).sum();
        std::mem::size_of::<Self>() + self.subsystem_nqn.as_str().len() + strings
    }
}

impl ListingEntry for NamespaceDescriptor {
    fn cost(&self) -> usize {
        let texts = [&self.failure, &self.simulation, &self.unavailable];
        std::mem::size_of::<Self>()
            + texts
                .iter()
                .flat_map(|t| t.as_deref())
                .map(str::len)
                .sum::<usize>()
    }
}

/// The longest a namespace's failure or unavailability text is sent when a session's
/// descriptors do not all fit in its ConnectResponse (longer ones are cut, ending in "..."): a
/// failure's text names its path and errno, and a page holds at least one descriptor whatever
/// its texts.
const TEXT_MAX: usize = 256;

/// How many of `items`, from the first, fit in `room` bytes encoded.
fn fitting<T: serde::Serialize>(items: &[T], room: usize) -> usize {
    let mut used = 0;
    items
        .iter()
        .take_while(|item| {
            used += postcard::to_allocvec(item).map_or(usize::MAX / 2, |b| b.len());
            used <= room
        })
        .count()
}

/// The most bytes postcard's varint of a u16 takes.
const VARINT_U16: usize = 3;
/// Of a u32 (and of a length).
const VARINT_U32: usize = 5;
/// Of a u64.
const VARINT_U64: usize = 10;

impl ConnectResponse {
    /// Makes the response fit in one message: sets `namespace_count` to how many namespaces
    /// there are and, when they do not all fit, cuts their failure and unavailability texts to
    /// 256 bytes and keeps in `namespaces` as many of them as one message holds beside the
    /// other fields. Returns the whole listing when some did not fit (the host asks for them
    /// with [`NamespacesRequest`]s, answered from it by [`NamespacesResponse::page`]), None
    /// when all did. Whether a namespace failed or is unavailable is kept (a text is cut,
    /// never taken away).
    pub fn paged(&mut self) -> Option<Vec<NamespaceDescriptor>> {
        self.namespace_count = u32::try_from(self.namespaces.len()).unwrap_or(u32::MAX);
        let room = MAX_MESSAGE_SIZE - HEADER_LEN - VARINT_U16 - 3 * VARINT_U32 - VARINT_U32;
        // Whole texts when everything fits in one message.
        if fitting(&self.namespaces, room) == self.namespaces.len() {
            return None;
        }
        for d in &mut self.namespaces {
            for text in [&mut d.failure, &mut d.unavailable].into_iter().flatten() {
                shorten(text, TEXT_MAX);
            }
        }
        let n = fitting(&self.namespaces, room);
        if n == self.namespaces.len() {
            return None;
        }
        let all = self.namespaces.clone();
        self.namespaces.truncate(n);
        Some(all)
    }
}

impl NamespacesResponse {
    /// The page of `listing` (a session's namespaces, texts cut by [`ConnectResponse::paged`])
    /// that starts at index `start`: as many from there as one message holds (at least one:
    /// a descriptor with its texts cut is well under a message), with the listing's `total`;
    /// an empty page past its end.
    pub fn page(listing: &[NamespaceDescriptor], start: u32) -> Self {
        let rest = listing.get(start as usize..).unwrap_or(&[]);
        let n = fitting(rest, MAX_MESSAGE_SIZE - HEADER_LEN - 2 * VARINT_U32);
        NamespacesResponse {
            namespaces: rest[..n].to_vec(),
            total: u32::try_from(listing.len()).unwrap_or(u32::MAX),
        }
    }
}

impl DiscoveryResponse {
    /// The page of `listing` that starts at entry `start`: as many entries from there as one
    /// message holds, with the listing's `total` and `generation`; an empty page past its end.
    /// None when the entry at `start` alone does not fit in a message (it would list more
    /// listen URLs than one holds), so that no page could make progress.
    pub fn page(listing: &[DiscoveryEntry], start: u32, generation: u64) -> Option<Self> {
        let rest = listing.get(start as usize..).unwrap_or(&[]);
        let n = fitting(
            rest,
            MAX_MESSAGE_SIZE - HEADER_LEN - 2 * VARINT_U32 - VARINT_U64,
        );
        if n == 0 && !rest.is_empty() {
            return None;
        }
        Some(DiscoveryResponse {
            entries: rest[..n].to_vec(),
            total: u32::try_from(listing.len()).unwrap_or(u32::MAX),
            generation,
        })
    }

    /// The generation of `listing` ([`DiscoveryResponse::generation`]): a hash of its
    /// entries, so that any change to them changes it (but for a collision, 2^-64).
    pub fn generation_of(listing: &[DiscoveryEntry]) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut h = std::hash::DefaultHasher::new();
        listing.hash(&mut h);
        h.finish()
    }
}

/// Cuts `text` to at most `max` bytes at a character boundary, ending it with "..." when cut.
fn shorten(text: &mut String, max: usize) {
    if text.len() <= max {
        return;
    }
    let mut end = max.saturating_sub(3);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text.truncate(end);
    if max >= 3 {
        text.push_str("...");
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
