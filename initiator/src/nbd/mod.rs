//! A namespace as an NBD export: `rpma-initiator nbd` serves it to any NBD client (qemu,
//! nbdinfo/nbdcopy, fio's nbd engine, the kernel's nbd-client) on a Unix socket or TCP.
//!
//! - [`proto`]: the wire format (fixed newstyle handshake, simple replies).
//! - `handshake`: option haggling (`NBD_OPT_GO`/`INFO` with the export size and block
//!   sizes, `LIST`, `ABORT`, `EXPORT_NAME`; anything else gets `NBD_REP_ERR_UNSUP`).
//! - `transmission`: one client's requests, started on its queue as they come (`pipeline`:
//!   each answered as soon as it completed).
//! - [`Server`]: the listener, one thread per client, keep-alives, shutdown.
//! - `slots`: the limits on clients ([`ClientLimits`]): per source and in all, with eviction
//!   of unfinished and idle clients for newcomers; `ratelog`: rate-limited client log lines.
//!
//! # A queue per client connection
//!
//! Each client connection issues its requests through a library [`Queue`](crate::Queue) of
//! its own (one queue pair; `shared::Cell`), taken at its first request (a connection that
//! sends nothing holds none) and given back (with the writes it holds) when it leaves, so
//! that a client with several connections (`NBD_FLAG_CAN_MULTI_CONN`, which is set) has as
//! many queue pairs to the target, served by as many of its poll loops. Past
//! [`ClientLimits::max_queues`], or where the target refuses another connection, a client
//! shares an existing queue. Queues no client has are closed beyond two kept for the next clients (each
//! is a session on the target), once no write of theirs waits for a FLUSH. A FLUSH on any connection makes durable every write any connection had
//! acknowledged: it persists each queue's own held writes (`persist_own_writes`: the writes
//! that queue acknowledged and did not make durable yet, rather than the whole namespace or
//! the span between them, whose write-back can take milliseconds on dax), one queue after the
//! other, each after every Write it carried.
//!
//! # Threads
//!
//! [`Server::serve`] runs in the caller's thread: it accepts, ticks the idle queues'
//! keep-alives and returns when a stop descriptor (a signalfd, say) becomes readable. Each
//! client has a thread of its own; [`Server::shutdown`] ends them (each finishes the requests
//! it has read), then makes every write durable and disconnects.

// Test-only: the fuzz targets' entry points (fuzz/, tests/tests/fuzz_corpus.rs).
#[cfg(feature = "fuzzing")]
pub mod fuzz;
mod handshake;
mod pipeline;
pub mod proto;
mod ratelog;
mod server;
mod shared;
mod slots;
mod stream;
mod transmission;

pub use server::Server;
pub use shared::{ClientLimits, ExportOptions};
pub use stream::Listener;

/// The largest READ or WRITE payload (`NBD_INFO_BLOCK_SIZE` maximum); the protocol's
/// recommended limit for clients that were told nothing.
pub const MAX_PAYLOAD: u32 = 32 << 20;

/// What starting or running an export failed with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NbdError {
    /// The listening socket could not be set up.
    #[error("cannot listen on {addr}")]
    Listen {
        /// The address.
        addr: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A server already answers on that Unix socket.
    #[error("{addr} is in use: another server answers on it")]
    InUse {
        /// The socket path.
        addr: String,
    },
    /// The library refused: connecting, the namespace, its durability method.
    #[error(transparent)]
    Library(#[from] crate::Error),
    /// A thread of the server could not be started.
    #[error("cannot start a thread")]
    Thread(#[source] std::io::Error),
    /// Waiting for connections or the stop descriptor failed.
    #[error("waiting for NBD connections")]
    Poll(#[source] std::io::Error),
    /// The flush at shutdown could not make the writes durable.
    #[error("the final flush of namespace {nsid} failed")]
    FinalFlush {
        /// Namespace.
        nsid: u32,
        /// What the library reported.
        #[source]
        source: crate::Error,
    },
    /// A queue to the target was given up during the run (its reconnect budget spent, or the
    /// namespace changed), the target mapped another file as the namespace, or a queue's
    /// persist found bytes it let go at a reconnect lost with the newer write that took them
    /// ([`crate::Error::RewritesLost`]): writes acknowledged before that and not made durable
    /// yet may be lost, and the final flush, which made the others durable, cannot vouch for
    /// them.
    #[error(
        "{losses} queue(s) to the target of namespace {nsid} gave up during this run, found \
         another file in its place, or found the writes they let go at a reconnect lost with the \
         newer writes that took them: writes acknowledged before that and not yet durable may be \
         lost (each connection open then had its next FLUSH answered EIO)"
    )]
    WritesLost {
        /// Namespace.
        nsid: u32,
        /// How many losses: queues that gave up or found another file, persists that found
        /// rewritten bytes lost.
        losses: u64,
    },
}

/// Result of the NBD server's calls.
pub type Result<T> = std::result::Result<T, NbdError>;

/// Why one client's connection ended badly (logged once, by its thread; the server goes on).
#[derive(Debug, thiserror::Error)]
pub(crate) enum ConnError {
    /// The socket failed (reset, timeout).
    #[error("socket error")]
    Io(#[from] std::io::Error),
    /// The client sent something the protocol does not allow.
    #[error("protocol violation")]
    Wire(#[from] proto::WireError),
    /// The client sent something this server cannot follow.
    #[error("{0}")]
    Protocol(String),
    /// The client sent no request for this long (`--idle-timeout`).
    #[error("no request for {0:?}")]
    Idle(std::time::Duration),
    /// The client's slot was taken for a newcomer.
    #[error("evicted for a newcomer")]
    Evicted,
}
