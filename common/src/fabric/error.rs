//! The fabric's error type: what a verb (a call into this module) can fail with.
//!
//! Errors that happen on the wire after a work request was posted are not [`Error`]s: they come
//! back as [`Completion`](super::Completion)s with a non-success [`WcStatus`](super::WcStatus), as
//! in libibverbs.

use std::io;

use super::types::{Access, QpState};

/// What a fabric call failed with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A `tcp://host:port` (or `rdma://`) URL did not parse.
    #[error("bad fabric url {url:?}: {reason}")]
    BadUrl {
        /// The text given.
        url: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The URL names a transport this build does not have.
    #[error("transport {scheme:?} is not available in this build")]
    TransportUnavailable {
        /// The URL scheme.
        scheme: String,
    },
    /// `rdma://`: the machine has no RDMA device (no NIC, no Soft-RoCE link, or no kernel
    /// RDMA support).
    #[error("no RDMA device found; use tcp://")]
    NoDevice,
    /// `rdma://`: no RDMA device has this name, or none serves this address.
    #[error("no RDMA device {wanted}: {reason}")]
    NoSuchDevice {
        /// The device name or address asked for.
        wanted: String,
        /// Why none fits (the devices there are, the address's route).
        reason: String,
    },
    /// A verbs or rdma_cm call failed. (The OS error is the source, not repeated in the text.)
    #[error("{op}")]
    Verbs {
        /// The call ("ibv_create_cq", "rdma_resolve_route", ...).
        op: &'static str,
        /// The error it reported.
        #[source]
        source: io::Error,
    },
    /// Resolving or binding or connecting a socket failed. (The OS error is the source, not
    /// repeated in the text.)
    #[error("{op} {addr}")]
    Socket {
        /// What was being done ("connect", "bind", "accept", ...).
        op: &'static str,
        /// The address involved.
        addr: String,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The MPA handshake failed or was rejected.
    #[error("connection set-up with {peer} failed: {reason}")]
    Handshake {
        /// The peer address.
        peer: String,
        /// Why.
        reason: String,
        /// The underlying wire error, if any.
        #[source]
        source: Option<Box<dyn std::error::Error + Send + Sync>>,
    },
    /// The peer rejected the connection (MPA Reply with the reject flag).
    #[error("connection rejected by {peer}")]
    Rejected {
        /// The peer address.
        peer: String,
        /// The private data the peer sent with its rejection.
        private_data: Vec<u8>,
    },
    /// Access flags that make no sense together (e.g. remote write without local write).
    #[error("invalid access flags {access:?}: {reason}")]
    InvalidAccess {
        /// The flags given.
        access: Access,
        /// Why they are refused.
        reason: &'static str,
    },
    /// A memory registration was refused (null or empty or unsupported range).
    #[error("cannot register {len} bytes at {addr:#x}: {reason}")]
    Register {
        /// Start address.
        addr: usize,
        /// Length in bytes.
        len: usize,
        /// Why.
        reason: &'static str,
    },
    /// An object from another protection domain or context was mixed in.
    #[error("{what} belongs to another protection domain")]
    WrongDomain {
        /// The offending object.
        what: &'static str,
    },
    /// A scatter/gather element reaches outside its memory region.
    #[error("local range {offset}+{len} is outside the memory region of {region_len} bytes")]
    LocalBounds {
        /// Offset into the region.
        offset: usize,
        /// Length.
        len: usize,
        /// The region's length.
        region_len: usize,
    },
    /// A local memory region lacks a right the work request needs.
    #[error("the local memory region lacks {needed:?} (has {has:?})")]
    LocalAccess {
        /// The right needed.
        needed: Access,
        /// The rights it has.
        has: Access,
    },
    /// A work request is malformed (wrong length, misaligned atomic, too large...).
    #[error("invalid work request: {reason}")]
    InvalidWorkRequest {
        /// Why.
        reason: &'static str,
    },
    /// The operation needs a capability the peer did not advertise (Flush, Atomic Write, atomics).
    #[error("the peer does not support {op}")]
    PeerUnsupported {
        /// The operation.
        op: &'static str,
    },
    /// The queue pair is not in a state that allows this verb (posting needs RTS).
    #[error("queue pair {qp_num} is in state {state:?}; {op} needs {needed:?}")]
    InvalidState {
        /// The queue pair number.
        qp_num: u32,
        /// Its current state.
        state: QpState,
        /// What was attempted.
        op: &'static str,
        /// The state it needs.
        needed: QpState,
    },
    /// The send or receive queue is full.
    #[error("queue pair {qp_num}: {queue} queue full ({depth} outstanding)")]
    QueueFull {
        /// The queue pair number.
        qp_num: u32,
        /// "send" or "receive".
        queue: &'static str,
        /// Its depth.
        depth: usize,
    },
    /// A memory window operation was refused.
    #[error("memory window: {reason}")]
    MemoryWindow {
        /// Why.
        reason: &'static str,
    },
    /// Too many objects: the STag space or a table is exhausted.
    #[error("out of {what}")]
    Exhausted {
        /// What ran out.
        what: &'static str,
    },
    /// An I/O error while waiting for events (epoll).
    #[error("waiting for completions: {source}")]
    Wait {
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// A file descriptor could not be added to (or removed from) a completion queue's wait set:
    /// not pollable, already watched, or not watched.
    #[error("cannot {op} fd {fd} on a completion queue: {source}")]
    Watch {
        /// "watch" or "unwatch".
        op: &'static str,
        /// The file descriptor.
        fd: std::os::fd::RawFd,
        /// The OS error.
        #[source]
        source: io::Error,
    },
}

/// The fabric's result type.
pub type Result<T> = std::result::Result<T, Error>;
