//! rpma-initiator: connect to an rpma target, map remote namespaces and write them durably.
//!
//! The data path: a [`Connection`] names a target, a subsystem and this host; it opens
//! [`Queue`]s (one per thread), and a queue hands out [`Namespace`] handles with `read_at`,
//! `write_at` (sent, not acknowledged by the target, not yet durable), `persist`,
//! `write_durable`, batches, block calls and atomics. Durable calls use the best method the
//! target offers for the namespace (on `dax`: FLUSH, then APM, then GPSPM; on `page-cache`
//! GPSPM first, which keeps the msync off the target's poll loop; see [`durability`]) or a
//! forced one, and return a [`Durability`] outcome: `Durable(method)`, or `VisibleOnly` on a
//! volatile namespace. A lost connection is reconnected with backoff for up to a minute by
//! default and every write not yet acknowledged as durable is re-issued (the bytes of it that
//! no newer write of a queue of the same [`Connection`] wrote since); a first connection
//! that fails while the target is not up yet (or has no room) is retried the same way
//! ([`ReconnectPolicy`]).
//! Large writes can skip the copy into the queue's bounce buffers: fill a [`WriteBuf`] and
//! use the `*_from` calls ([`writebuf`]).
//! docs/initiator.md has the design and the CLI reference.
//!
//! The control side: [`connect`] opens a [`Session`] (transport, Connect, mutual
//! authentication when the host has a key, namespace descriptors); [`discover`] lists a
//! target's subsystems; [`identify`] reads a subsystem's namespaces.
//!
//! # Quick start
//!
//! ```no_run
//! use rpma_initiator::{Connection, Durability, HostIdentity};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let host = HostIdentity::default_host()?;
//! let conn = Connection::new("tcp://127.0.0.1:7420", "nqn.2026-11.io.rpma:demo".parse()?, host);
//! let mut queue = conn.open_queue(0)?;
//! for d in queue.namespaces() {
//!     println!("nsid {}: {} bytes, {}", d.nsid, d.size, d.domain);
//! }
//! let mut ns = queue.namespace(1)?;
//! match ns.write_durable(4096, b"hello, persistent world")? {
//!     Durability::Durable(method) => println!("durable ({method})"),
//!     Durability::VisibleOnly => eprintln!("warning: volatile namespace, visible only"),
//! }
//! let mut back = [0u8; 23];
//! ns.read_at(4096, &mut back)?;
//! let old = ns.fetch_add(0, 1)?; // an 8-byte aligned counter
//! # let _ = old;
//! queue.close()?;
//! # Ok(()) }
//! ```
//!
//! # Threads, progress, cleanup
//!
//! No hidden threads: progress happens inside the calls of the thread that owns a [`Queue`]
//! (or a [`Session`]), which poll its completion queue with a deadline. A queue is `Send`:
//! open one per thread from a cloned [`Connection`]. Keep-alives are sent by
//! [`Queue::tick`] (and every data call) or [`Session::tick`], which the caller runs at least every
//! half keep-alive period. Every wait has a deadline ([`ConnectOptions::timeout`]): a dead target
//! is an error, never a hang. Dropping a [`Session`] (or a [`Queue`]) sends the target a Disconnect
//! (waiting at most [`DROP_GOODBYE`] for it to go out) and closes the connection; the target then
//! revokes its rkeys.
//!
//! Features: `rdma` builds the rdma transport in rpma-common: `rdma://` target URLs then
//! connect over an RDMA NIC or Soft-RoCE (docs/rdma.md).

#![warn(missing_docs)]

mod checks;
mod connect;
mod deadline;
pub mod durability;
mod error;
mod idmap;
mod method;
pub mod namespace;
pub mod nbd;
mod pool;
mod queue;
mod replay;
mod session;
pub mod writebuf;

pub use connect::{
    connect, discover, host_id_of, identify, ConnectOptions, HostIdentity, Identity, RECV_DEPTH,
};
pub use durability::{Choice, Durability, PersistMethod};
pub use error::{Error, LossReason, Result};
pub use namespace::Namespace;
pub use queue::{Completed, Connection, Queue, QueueOptions, QueueStats, ReconnectPolicy, Ticket};
pub use rpma_common::proto::msgbuf::CONTROL_BIT;
pub use rpma_common::proto::MAX_LISTING;
pub use session::{Session, DROP_GOODBYE};
pub use writebuf::WriteBuf;
