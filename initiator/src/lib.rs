//! rpma-initiator: connect to an rpma target, map remote namespaces and write them durably.
//!
//! This is the control side: [`connect`] opens a [`Session`] with a subsystem (transport,
//! Connect, mutual authentication when the host has a key, namespace descriptors);
//! [`discover`] lists a target's subsystems; [`identify`] reads a subsystem's namespaces. The
//! session keeps the queue pair, protection domain and completion queue reachable for the data
//! path (Writes, Reads, Flushes; GPSPM through [`Session::flush`]).
//!
//! # Quick start
//!
//! ```no_run
//! use rpma_initiator::{connect, ConnectOptions, HostIdentity};
//! use rpma_common::proto::nqn::Nqn;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let host = HostIdentity::default_host()?;
//! let subsystem: Nqn = "nqn.2026-11.io.rpma:demo".parse()?;
//! let mut s = connect("tcp://127.0.0.1:7420", &subsystem, &host, &ConnectOptions::default())?;
//! for ns in s.namespaces() {
//!     println!("nsid {} {} bytes, {}", ns.nsid, ns.size, ns.domain);
//! }
//! s.tick()?; // from the caller's polling loop: sends a keep-alive when one is due
//! s.disconnect(std::time::Duration::from_secs(1))?;
//! # Ok(()) }
//! ```
//!
//! # Threads, progress, cleanup
//!
//! No hidden threads: progress happens when the caller polls the session's completion queue
//! (or calls a blocking helper, which polls it with a deadline). Keep-alives are sent by
//! [`Session::tick`], which the caller runs at least every half keep-alive period. Every wait
//! has a deadline ([`ConnectOptions::timeout`]): a dead target is an error, never a hang.
//! Dropping a [`Session`] closes its connection; the target then revokes its rkeys.
//!
//! Features: `rdma` builds the rdma transport in rpma-common (a later issue).

mod connect;
pub mod durability;
mod error;
mod msgbuf;
pub mod namespace;
mod pool;
mod queue;
mod session;

pub use connect::{
    connect, discover, host_id_of, identify, ConnectOptions, HostIdentity, Identity, RECV_DEPTH,
};
pub use durability::{Choice, Durability, PersistMethod};
pub use error::{Error, Result};
pub use msgbuf::CONTROL_BIT;
pub use namespace::Namespace;
pub use queue::{Connection, Queue, QueueOptions, ReconnectPolicy};
pub use session::Session;
