//! The fabric's error type: what a verb (a call into this module) can fail with.
//!
//! Errors that happen on the wire after a work request was posted are not [`Error`]s: they come
//! back as [`Completion`](super::Completion)s with a non-success [`WcStatus`](super::WcStatus), as
//! in libibverbs. Why a queue pair went to Error is a [`QpFailure`].

use std::fmt;
use std::io;
use std::sync::Arc;

use super::types::{Access, QpState, WcStatus};

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
    /// `rdma://`: the device failed or was removed ([`Context::is_lost`]): nothing made on it
    /// works again. Reported once by the completion queue that saw it; a listener on it
    /// reports it from `accept_incoming`.
    ///
    /// [`Context::is_lost`]: super::Context::is_lost
    #[error("the RDMA device {device} failed or was removed")]
    DeviceLost {
        /// The device's name.
        device: String,
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
    /// The peer answered the MPA Request with something that is no MPA Reply: a service that
    /// is not an iWARP (rpma `tcp://`) listener, such as an NVMe/TCP port. Making the
    /// connection again cannot help.
    #[error(
        "{peer} does not speak MPA: not an rpma tcp:// listener (is it an nvme-tcp:// port, or \
         another service?)"
    )]
    NotMpa {
        /// The peer address.
        peer: String,
    },
    /// The peer closed the connection before sending a byte of its MPA Request: a TCP port
    /// probe or health check (`nc -z`, a load balancer's check), not a failed handshake.
    #[error("{peer} closed the connection before sending anything")]
    ClosedBeforeRequest {
        /// The peer address.
        peer: String,
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

/// Why a queue pair went to Error ([`QueuePair::error`](super::QueuePair::error)): the first
/// cause, kept as it was found, so that a caller can tell a peer that left from a protocol
/// error, a failed link or a failed device. The text names the cause; the OS or persist
/// error under it is the [`source`](std::error::Error::source) (print the chain, as
/// [`error_chain`](crate::error_chain) does, to keep the errno).
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum QpFailure {
    /// The peer closed the connection: the end of the stream (`tcp`), a disconnect request,
    /// which was answered (`rdma`).
    #[error("the peer closed the connection")]
    PeerClosed,
    /// Sending or receiving on the connection failed (`tcp`: a reset, a time-out).
    #[error("connection lost while {op}")]
    Link {
        /// "sending" or "receiving".
        op: &'static str,
        /// The OS error.
        #[source]
        source: Arc<io::Error>,
    },
    /// The peer sent a Terminate (`tcp`): the oldest outstanding request completed with
    /// `status`, every later one was flushed.
    #[error("received Terminate ({code})")]
    TerminateReceived {
        /// The Terminate's cause.
        code: TerminateCode,
        /// The status the oldest outstanding request completed with.
        status: WcStatus,
    },
    /// This side sent a Terminate (`tcp`): the peer broke the protocol or asked for an access
    /// it does not have.
    #[error("sent Terminate ({code})")]
    TerminateSent {
        /// The Terminate's cause.
        code: TerminateCode,
    },
    /// This side sent a Terminate (`tcp`) because making earlier Writes durable, before a
    /// response that vouches for them, failed: the memory's store failed.
    #[error("sent Terminate ({code}): making earlier Writes durable failed")]
    PersistFailed {
        /// The Terminate's cause.
        code: TerminateCode,
        /// What the persist failed with (the call and its errno).
        #[source]
        source: Arc<crate::pmem::Error>,
    },
    /// A work request completed with an error (`rdma`).
    #[error("a request completed with {status:?} (vendor error {vendor_err:#x})")]
    RequestFailed {
        /// Its status.
        status: WcStatus,
        /// The device's own error code.
        vendor_err: u32,
    },
    /// The device flushed the queue pair's requests before this side saw an error (`rdma`).
    #[error("flushed by the device")]
    Flushed,
    /// The device refused a request of a list after it had taken the first `posted` (`rdma`).
    #[error("the device refused a request of a list after taking the first {posted}")]
    PostRefused {
        /// How many requests of the list went to the device.
        posted: usize,
    },
    /// Moving the queue pair to RTS or completing the connection failed (`rdma`). The call
    /// that connected or accepted returned the typed [`Error`]; this keeps its text.
    #[error("{op} failed: {reason}")]
    Setup {
        /// "connect" or "accept".
        op: &'static str,
        /// The error the call returned, with its sources.
        reason: String,
    },
    /// The connection manager reported that the connection failed (`rdma`: rejected,
    /// unreachable, a connect error).
    #[error("the connection failed: {event} (status {status})")]
    ConnectionFailed {
        /// The rdma_cm event's name.
        event: String,
        /// Its status (a negative errno, or a reject reason).
        status: i32,
    },
    /// The device reported an error of the queue pair (`rdma`, an async event).
    #[error("the device reported {event}")]
    DeviceEvent {
        /// What it reported.
        event: DeviceEvent,
    },
    /// The RDMA device was removed (`rdma`).
    #[error("the RDMA device was removed")]
    DeviceRemoved,
    /// The RDMA device failed (IBV_EVENT_DEVICE_FATAL): every queue pair on it is in Error.
    #[error("the RDMA device failed (IBV_EVENT_DEVICE_FATAL)")]
    DeviceFatal,
    /// The owner moved the queue pair to Error ([`QueuePair::to_error`](super::QueuePair::to_error)).
    #[error("moved to Error locally")]
    Local,
    /// The queue pair's handle was dropped.
    #[error("queue pair dropped")]
    Dropped,
}

/// An error the device reports of one queue pair (an `ibv_async_event`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DeviceEvent {
    /// IBV_EVENT_QP_FATAL.
    QpFatal,
    /// IBV_EVENT_QP_REQ_ERR: an invalid request.
    InvalidRequest,
    /// IBV_EVENT_QP_ACCESS_ERR: a local access error.
    AccessError,
}

impl fmt::Display for DeviceEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DeviceEvent::QpFatal => "a fatal queue pair error",
            DeviceEvent::InvalidRequest => "an invalid request",
            DeviceEvent::AccessError => "a local access error",
        })
    }
}

/// A Terminate's cause as RFC 5040 §7.2 codes it: the layer that found the error, its type
/// and its code (docs/protocol.md tabulates them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TerminateCode {
    /// The layer.
    pub layer: TerminateLayer,
    /// The error type (4 bits).
    pub etype: u8,
    /// The error code.
    pub ecode: u8,
}

/// The layer of a [`TerminateCode`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TerminateLayer {
    /// RDMAP (RFC 5040).
    Rdmap,
    /// DDP (RFC 5041).
    Ddp,
    /// The lower layer protocol: MPA (RFC 5044).
    Mpa,
}

impl fmt::Display for TerminateCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let layer = match self.layer {
            TerminateLayer::Rdmap => "RDMAP",
            TerminateLayer::Ddp => "DDP",
            TerminateLayer::Mpa => "MPA",
        };
        write!(f, "{layer} etype: {}, ecode: {}", self.etype, self.ecode)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failure_names_its_cause_and_keeps_the_error_under_it() {
        let code = TerminateCode {
            layer: TerminateLayer::Rdmap,
            etype: 1,
            ecode: 9,
        };
        let f = QpFailure::TerminateReceived {
            code,
            status: WcStatus::RemoteAccess,
        };
        assert_eq!(
            f.to_string(),
            "received Terminate (RDMAP etype: 1, ecode: 9)"
        );
        let eio = io::Error::from_raw_os_error(libc::EIO);
        let f = QpFailure::Link {
            op: "receiving",
            source: Arc::new(eio),
        };
        let chain = crate::error_chain(&f);
        assert!(
            chain.starts_with("connection lost while receiving: "),
            "{chain}"
        );
        assert!(chain.contains("Input/output error"), "{chain}");
        let errno = std::error::Error::source(&f)
            .and_then(|s| s.downcast_ref::<Arc<io::Error>>())
            .and_then(|e| e.raw_os_error());
        assert_eq!(errno, Some(libc::EIO), "the errno is reachable by type");
        let f = QpFailure::DeviceEvent {
            event: DeviceEvent::AccessError,
        };
        assert_eq!(f.to_string(), "the device reported a local access error");
    }
}
