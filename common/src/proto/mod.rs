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
    PersistenceDomain, Refusal, RefusalReason,
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

/// The longest a namespace's failure or unavailability text is sent at first, then shorter
/// ones in turn while the ConnectResponse would not fit ([`ConnectResponse::fit`]).
const TEXT_BUDGETS: [usize; 3] = [256, 32, 0];

impl ConnectResponse {
    /// Shortens its namespaces' failure and unavailability texts (each to 256 bytes, then 32,
    /// then none) until the message fits in [`MAX_MESSAGE_SIZE`]: a failure's text names its
    /// path and errno, and a few long ones would otherwise make the subsystem's
    /// ConnectResponse too large for any host to be admitted, its healthy namespaces too.
    /// Whether a namespace failed or is unavailable is kept (the text is cut, never taken
    /// away). The target's configuration check warns of a subsystem whose response may not
    /// fit even with every text empty.
    pub fn fit(&mut self) {
        for budget in TEXT_BUDGETS {
            if self.encoded_len() <= MAX_MESSAGE_SIZE {
                return;
            }
            for d in &mut self.namespaces {
                for text in [&mut d.failure, &mut d.unavailable].into_iter().flatten() {
                    shorten(text, budget);
                }
            }
        }
    }

    /// Its encoded length, header included.
    pub fn encoded_len(&self) -> usize {
        serde_body(MessageType::ConnectResponse, self).map_or(usize::MAX, |b| b.len())
    }
}

/// Room for a page's items: a message less its header and the varints around the items (their
/// count, and the largest the fields after them take: a u32 and a u64).
const PAGE_ROOM: usize = MAX_MESSAGE_SIZE - HEADER_LEN - 5 - 5 - 10;

/// How many of `items`, from the first, fit in one page (at most [`PAGE_ROOM`] bytes encoded).
fn fitting<T: serde::Serialize>(items: &[T]) -> usize {
    let mut used = 0;
    items
        .iter()
        .take_while(|item| {
            used += postcard::to_allocvec(item).map_or(usize::MAX / 2, |b| b.len());
            used <= PAGE_ROOM
        })
        .count()
}

impl DiscoveryResponse {
    /// The page of `listing` that starts at entry `start`: as many entries from there as one
    /// message holds, with the listing's `total` and `generation`; an empty page past its end.
    /// None when the entry at `start` alone does not fit in a message (it would list more
    /// listen URLs than one holds), so that no page could make progress.
    pub fn page(listing: &[DiscoveryEntry], start: u32, generation: u64) -> Option<Self> {
        let rest = listing.get(start as usize..).unwrap_or(&[]);
        let n = fitting(rest);
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
