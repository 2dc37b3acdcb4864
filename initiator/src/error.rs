//! The initiator library's error type.

use std::time::Duration;

use rpma_common::fabric::{self, QpFailure, WcStatus};
use rpma_common::proto::auth::AuthError;
use rpma_common::proto::nqn::NqnError;
use rpma_common::proto::{self, MessageType, RefusalReason};

/// What a call into the initiator library failed with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The target URL did not parse.
    #[error("bad target URL {url:?}")]
    Url {
        /// The text given.
        url: String,
        /// What the fabric reported.
        #[source]
        source: fabric::Error,
    },
    /// The transport connection could not be made (refused, unreachable, MPA failure, timeout).
    #[error("cannot connect to {url}")]
    Connect {
        /// The target URL.
        url: String,
        /// What the fabric reported.
        #[source]
        source: fabric::Error,
    },
    /// A fabric call failed (creating a queue, registering a buffer, posting).
    #[error("{op} failed")]
    Fabric {
        /// What was being done.
        op: &'static str,
        /// What the fabric reported.
        #[source]
        source: fabric::Error,
    },
    /// The target did not answer in time.
    #[error("no {what} from the target within {after:?}")]
    Timeout {
        /// What was awaited.
        what: &'static str,
        /// How long was waited.
        after: Duration,
    },
    /// Refusal: the target has no subsystem of that NQN.
    #[error("the target has no such subsystem: {message}")]
    UnknownSubsystem {
        /// The target's explanation.
        message: String,
    },
    /// Refusal: this host is not allowed on the subsystem.
    #[error("this host is not allowed: {message}")]
    HostNotAllowed {
        /// The target's explanation.
        message: String,
    },
    /// Refusal: the target did not accept this host's proof of the pre-shared key.
    #[error("authentication failed: {message}")]
    AuthFailed {
        /// The target's explanation.
        message: String,
    },
    /// Refusal: the target does not speak this host's protocol version.
    #[error("protocol version unsupported by the target: {message}")]
    VersionUnsupported {
        /// The target's explanation.
        message: String,
    },
    /// Any other refusal (too many connections, shutting down, protocol error, ...).
    #[error("the target refused the connection ({reason:?}): {message}")]
    Refused {
        /// The reason code.
        reason: RefusalReason,
        /// The target's explanation.
        message: String,
    },
    /// The target's proof of the key did not verify, or the target skipped authentication
    /// although this host holds a key: the target is not who it claims to be.
    #[error("the target failed to prove the pre-shared key")]
    TargetNotAuthenticated {
        /// Why, when the proof itself was checked.
        #[source]
        source: Option<AuthError>,
    },
    /// The target asks for authentication and this host has no key for it.
    #[error("the target requires authentication: give this host's pre-shared key")]
    KeyRequired,
    /// Computing this host's proof failed (the random source).
    #[error("cannot authenticate")]
    Auth(#[source] AuthError),
    /// The host NQN could not be determined or is invalid.
    #[error("host NQN")]
    HostNqn(#[source] NqnError),
    /// A message from the target could not be decoded (including an unknown version).
    #[error("malformed message from the target")]
    Decode(#[source] proto::Error),
    /// A message could not be encoded.
    #[error("cannot encode a control message")]
    Encode(#[source] proto::Error),
    /// The target sent a message that makes no sense at this point.
    #[error("protocol error: expected {expected}, got {got:?}")]
    Unexpected {
        /// What was expected.
        expected: &'static str,
        /// What came.
        got: MessageType,
    },
    /// The target's listing, sent a page at a time, did not add up: a page that brought
    /// nothing before the end, one that went past it, a listing that changed at every read, or
    /// more entries, or more memory, than a host gives one ([`crate::MAX_LISTING`],
    /// [`rpma_common::proto::MAX_LISTING_BYTES`]).
    #[error("the target's {what} listing cannot be read: {why}")]
    Listing {
        /// Which listing ("discovery").
        what: &'static str,
        /// What did not add up.
        why: String,
    },
    /// The target closed the session with a Disconnect.
    #[error("the target closed the session: {reason}")]
    Disconnected {
        /// The target's reason.
        reason: String,
    },
    /// The connection broke (the queue pair went to Error). The text carries the reason with
    /// the errors under it.
    #[error("the connection to the target is lost: {}", rpma_common::error_chain(.reason))]
    ConnectionLost {
        /// Why: the fabric's reason when the queue pair recorded one
        /// ([`LossReason::QueuePair`]), to branch on.
        reason: LossReason,
    },
    /// A control message's work request completed with an error.
    #[error("a control {what} completed with {status:?}")]
    Completion {
        /// "send" or "receive".
        what: &'static str,
        /// Its status.
        status: WcStatus,
    },
    /// The target did not echo keep-alives for this long: it is presumed gone.
    #[error("the target answered no keep-alive for {silent:?}")]
    KeepAliveLost {
        /// Time since the target was last heard from.
        silent: Duration,
    },
    /// The subsystem has no namespace of that nsid (for this host).
    #[error("no namespace {nsid} on this connection")]
    NoSuchNamespace {
        /// The nsid asked for.
        nsid: u32,
    },
    /// An access outside the namespace, checked before anything was posted.
    #[error("{len} bytes at offset {offset} are outside namespace {nsid} ({size} bytes)")]
    OutOfRange {
        /// Namespace.
        nsid: u32,
        /// Start of the access.
        offset: u64,
        /// Its length.
        len: u64,
        /// The namespace's size.
        size: u64,
    },
    /// An offset or length that must be aligned is not (atomics: 8 bytes; block calls: the
    /// block size).
    #[error("{what} {value} is not a multiple of {align} on namespace {nsid}")]
    Misaligned {
        /// Namespace.
        nsid: u32,
        /// "offset" or "length".
        what: &'static str,
        /// The value given.
        value: u64,
        /// The alignment required.
        align: u64,
    },
    /// A write, atomic or persist to a read-only namespace.
    #[error("namespace {nsid} is read-only")]
    ReadOnly {
        /// Namespace.
        nsid: u32,
    },
    /// The requested durability method is not one the target offers for this namespace: it
    /// cannot make that namespace durable. Never silently replaced by another method.
    #[error(
        "{method} cannot make namespace {nsid} ({domain}) durable: the target offers {offered}"
    )]
    MethodNotValid {
        /// Namespace.
        nsid: u32,
        /// The method asked for.
        method: crate::method::PersistMethod,
        /// The namespace's persistence domain.
        domain: rpma_common::proto::PersistenceDomain,
        /// What the target offers ("APM GPSPM", or "nothing (visible only)").
        offered: String,
    },
    /// APM was asked to make a range durable that this queue may not have written: an APM Read
    /// makes durable only the Writes of its own queue pair, so it cannot vouch for a range as
    /// a whole ([`Namespace::persist`](crate::Namespace::persist) names a range, whoever wrote
    /// it). Use GPSPM or FLUSH, which make the range itself durable.
    #[error(
        "APM cannot make a range of namespace {nsid} durable: it covers only the writes of its \
         own connection (use --persist gpspm or flush, which make the range durable whoever \
         wrote it; the target offers {offered})"
    )]
    ApmNotForRanges {
        /// Namespace.
        nsid: u32,
        /// What the target offers.
        offered: String,
    },
    /// The namespace has failed on the target: a write-back of it failed, so the target makes
    /// nothing on it durable, and this library writes nothing to it, until the target's operator
    /// clears the failure (`rpma-target clear-failure`; reloads and restarts keep it). Reads
    /// still work and return what the target's media holds, unless the failure is a page the
    /// target could not read back (`load/store`: a media error, its file truncated): then
    /// nothing of it is served until the target reopens it.
    #[error(
        "namespace {nsid} has FAILED on the target ({reason}): nothing on it can be made durable \
         and writes are refused until the target's operator clears it (rpma-target \
         clear-failure); reads still work, unless the target could not read a page of it back \
         (load/store)"
    )]
    NamespaceFailed {
        /// Namespace.
        nsid: u32,
        /// What the target said: the failed call and its errno, or its flush status.
        reason: String,
    },
    /// The target lists the namespace but cannot serve it on this connection's transport
    /// (it cannot register its memory: e.g. page-cache pages on an RDMA device without
    /// on-demand paging). Nothing can be read or written on it; the subsystem's other
    /// namespaces are served.
    #[error("namespace {nsid} is unavailable on this connection: {reason}")]
    NamespaceUnavailable {
        /// Namespace.
        nsid: u32,
        /// What the target said.
        reason: String,
    },
    /// The peer does not support an operation (atomics, Atomic Write, Flush).
    #[error("the target does not support {op}")]
    Unsupported {
        /// The operation.
        op: &'static str,
    },
    /// A data-path request completed with an error status that is not a lost connection
    /// (a revoked rkey: RemoteAccess; a refused request).
    #[error("{op} on namespace {nsid} completed with {status:?}")]
    Remote {
        /// Namespace.
        nsid: u32,
        /// What it was.
        op: &'static str,
        /// Its status.
        status: WcStatus,
    },
    /// The target answered a GPSPM FlushRequest with a status that means "not durable".
    #[error("the target could not make namespace {nsid} durable: {status:?}")]
    NotDurable {
        /// Namespace.
        nsid: u32,
        /// The target's status.
        status: proto::FlushStatus,
    },
    /// [`Namespace::persist_own_writes`](crate::Namespace::persist_own_writes) cannot say
    /// durable yet: a reconnect of this queue let go writes of it whose bytes newer writes of
    /// other queues of the connection had taken, and those are not known placed on the target
    /// since (a target that restarted keeps nothing unpersisted). The queues named were asked
    /// to learn their placement (each sends a probe the next time its owner polls it): call
    /// again once they did, or have them `place_writes` or persist their own writes first.
    #[error(
        "writes of this queue to namespace {nsid} were rewritten by newer writes of queues \
         {queues:?} of the connection that are not known placed since this queue reconnected: \
         not durable yet (those queues were asked to learn their placement; call again once \
         they polled)"
    )]
    RewritesNotPlaced {
        /// Namespace.
        nsid: u32,
        /// The queues ([`Queue::order_id`](crate::Queue::order_id)) whose writes wait.
        queues: Vec<u64>,
    },
    /// [`Namespace::persist_own_writes`](crate::Namespace::persist_own_writes): a reconnect of
    /// this queue let go writes of it whose bytes newer writes of other queues of the
    /// connection had taken, and those newer writes were let go unpersisted (their queue gave
    /// up or was dropped, or freed them after a visibility Read only): the bytes may hold
    /// neither. Reported once; the queue's other writes are still covered by later calls.
    #[error(
        "writes of this queue to namespace {nsid} were rewritten by newer writes of another \
         queue of the connection that were let go unpersisted: {ranges:x?} may hold neither"
    )]
    RewritesLost {
        /// Namespace.
        nsid: u32,
        /// The byte ranges `[start, end)`, sorted.
        ranges: Vec<(u64, u64)>,
    },
    /// The connection was lost and could not be re-established within the reconnect policy:
    /// writes not yet acknowledged as durable (`held` of them) may not be on the target.
    #[error(
        "{lost}; then {attempts} reconnect attempt(s) over {elapsed:.1?} failed{}",
        held_note(*held)
    )]
    ReconnectFailed {
        /// What lost it: the error of the call that met the loss, with its causes (a time-out,
        /// a keep-alive that went unanswered), or the queue pair's failure when the loss was
        /// found between calls.
        lost: String,
        /// Attempts made.
        attempts: u32,
        /// Time spent reconnecting.
        elapsed: Duration,
        /// Writes (requests) the queue held for a replay (not acknowledged as durable) when it
        /// gave up: these may be lost. 0: no write was held (a queue that only read, or whose
        /// writes were all durable); atomics are never held, so one not made durable since
        /// may be lost all the same, as after any loss of the target.
        held: usize,
        /// The last attempt's error; or the target's refusal of an earlier attempt when no
        /// later one got an answer from the target ([`Error::is_refusal`]): that refusal is
        /// what there is to act on, not a last attempt cut short by the budget.
        #[source]
        last: Box<Error>,
    },
    /// After a reconnect a namespace the queue uses (a handle was taken on it, or it holds
    /// writes for it) is gone, maps another file (a restored file moved over its path) or has
    /// another size or mode: the queue gives up, and the writes it held are not re-issued.
    #[error("namespace {nsid} changed across a reconnect: {what}")]
    NamespaceChanged {
        /// Namespace.
        nsid: u32,
        /// What changed.
        what: String,
    },
    /// The queue failed earlier (its reconnect limit was reached) and takes no more work.
    #[error("the queue is broken by an earlier failure; open a new one")]
    Broken,
    /// A bad argument (an empty batch, a zero-length transfer where one is needed, a queue
    /// option out of range).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

impl Error {
    /// Whether this is the target's own answer refusing the connection: an unknown
    /// subsystem, a host not allowed, a failed or missing authentication, a version or
    /// another refusal.
    pub fn is_refusal(&self) -> bool {
        matches!(
            self,
            Error::UnknownSubsystem { .. }
                | Error::HostNotAllowed { .. }
                | Error::AuthFailed { .. }
                | Error::KeyRequired
                | Error::TargetNotAuthenticated { .. }
                | Error::VersionUnsupported { .. }
                | Error::Refused { .. }
        )
    }

    /// Whether this error means the connection is gone (a reconnect may help).
    pub fn is_connection_loss(&self) -> bool {
        matches!(
            self,
            Error::ConnectionLost { .. }
                | Error::KeepAliveLost { .. }
                | Error::Disconnected { .. }
                | Error::Timeout { .. }
        )
    }

    /// The error for a refusal.
    pub fn from_refusal(reason: RefusalReason, message: String) -> Error {
        match reason {
            RefusalReason::UnknownSubsystem => Error::UnknownSubsystem { message },
            RefusalReason::HostNotAllowed => Error::HostNotAllowed { message },
            RefusalReason::AuthFailed => Error::AuthFailed { message },
            RefusalReason::VersionUnsupported => Error::VersionUnsupported { message },
            reason => Error::Refused { reason, message },
        }
    }
}

/// Why a connection was found lost ([`Error::ConnectionLost`]).
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum LossReason {
    /// The queue pair went to Error for this reason (a peer that closed, a Terminate, a broken
    /// link, a failed device).
    #[error(transparent)]
    QueuePair(#[from] QpFailure),
    /// A request completed flushed (or out of retries) and the queue pair recorded no reason.
    #[error("{op} completed with {status:?}")]
    Completion {
        /// What the request was.
        op: &'static str,
        /// Its status.
        status: WcStatus,
    },
    /// The queue pair is in Error and recorded no reason.
    #[error("queue pair in Error")]
    Unexplained,
    /// The reconnect policy allowed no attempt (its time-out is zero).
    #[error("the reconnect policy allowed no attempt")]
    NoReconnectAttempt,
    /// The target sent a control message this host cannot decode: the connection cannot be
    /// trusted on (what the decoder said).
    #[error("the target broke the protocol: {0}")]
    Protocol(String),
    /// This host's RDMA device failed or was removed (its name): nothing made on it works
    /// again; a reconnect opens the device anew once it is back.
    #[error("the RDMA device {0} failed or was removed")]
    DeviceLost(String),
}

/// What a failed reconnect says of the writes it could not re-issue.
fn held_note(held: usize) -> String {
    match held {
        0 => String::new(),
        n => format!("; {n} write(s) not acknowledged as durable may be lost"),
    }
}

/// The error of a wait on a completion queue: a lost device is a lost connection (the device
/// carries nothing more, so the queue reconnects, on the device when it is back), anything else
/// the fabric's error.
pub(crate) fn wait_error(source: fabric::Error) -> Error {
    match source {
        fabric::Error::DeviceLost { device } => Error::ConnectionLost {
            reason: LossReason::DeviceLost(device),
        },
        source => Error::Fabric {
            op: "waiting for completions",
            source,
        },
    }
}

impl LossReason {
    /// The reason a queue pair in Error gives: its own, else [`LossReason::Unexplained`].
    pub(crate) fn of(qp: &fabric::QueuePair) -> LossReason {
        qp.error()
            .map_or(LossReason::Unexplained, LossReason::QueuePair)
    }
}

/// The initiator library's result type.
pub type Result<T> = std::result::Result<T, Error>;

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    #[test]
    fn a_failed_reconnect_speaks_of_lost_writes_only_when_it_held_some() {
        let failed = |held| Error::ReconnectFailed {
            lost: "no answer from the target".into(),
            attempts: 2,
            elapsed: Duration::from_secs(1),
            held,
            last: Box::new(Error::Broken),
        };
        let reads = failed(0).to_string();
        assert!(!reads.contains("write"), "{reads}");
        assert!(reads.contains("2 reconnect attempt(s)"), "{reads}");
        let writes = failed(3).to_string();
        assert!(
            writes.ends_with("; 3 write(s) not acknowledged as durable may be lost"),
            "{writes}"
        );
    }

    #[test]
    fn a_wait_on_a_lost_device_is_a_lost_connection() {
        let e = wait_error(fabric::Error::DeviceLost {
            device: "rxe0".into(),
        });
        assert!(e.is_connection_loss(), "{e:?}");
        assert!(e.to_string().contains("rxe0 failed or was removed"), "{e}");
        let e = wait_error(fabric::Error::NoDevice);
        assert!(!e.is_connection_loss(), "{e:?}");
        assert!(matches!(e, Error::Fabric { .. }), "{e:?}");
    }

    #[test]
    fn a_lost_connection_keeps_the_fabrics_reason_typed_and_in_its_text() {
        let reset = std::io::Error::from_raw_os_error(libc::ECONNRESET);
        let e = Error::ConnectionLost {
            reason: QpFailure::Link {
                op: "receiving",
                source: Arc::new(reset),
            }
            .into(),
        };
        assert!(e.is_connection_loss());
        // A caller branches on the reason, down to the errno.
        let Error::ConnectionLost {
            reason: LossReason::QueuePair(QpFailure::Link { op, source }),
        } = &e
        else {
            panic!("{e:?}");
        };
        assert_eq!(
            (*op, source.raw_os_error()),
            ("receiving", Some(libc::ECONNRESET))
        );
        // The text keeps what the string said: the cause and the OS error under it.
        let text = e.to_string();
        assert!(
            text.starts_with(
                "the connection to the target is lost: connection lost while receiving: "
            ),
            "{text}"
        );
        assert!(text.contains("reset by peer"), "{text}");
        let e = Error::ConnectionLost {
            reason: LossReason::Completion {
                op: "read",
                status: WcStatus::WrFlush,
            },
        };
        assert_eq!(
            e.to_string(),
            "the connection to the target is lost: read completed with WrFlush"
        );
    }
}
