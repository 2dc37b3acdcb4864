//! rpma-target: the daemon that serves persistent-memory namespaces to initiators.
//!
//! The binary `rpma-target` is a thin front over this library:
//! `rpma-target --config FILE` runs [`daemon::run`], `check-config` is [`check::check_config`],
//! `status` is [`control::query_status`] + [`control::render`].
//!
//! # Quick start
//!
//! ```no_run
//! use rpma_target::{config::Config, namespace::NamespaceTable, reload};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let cfg = Config::load("/etc/rpma/rpma-target.toml".as_ref())?;
//! let mut table = NamespaceTable::open_all(&cfg)?;
//! let new = Config::load("/etc/rpma/rpma-target.toml".as_ref())?;
//! let diff = reload::diff(&cfg, &new);
//! table.apply(&diff, &new)?; // touches only what the diff names
//! # Ok(()) }
//! ```
//!
//! # Modules
//!
//! - [`config`]: the TOML configuration, validated with errors that name the key.
//! - [`namespace`]: namespaces mapped through the pmem layer; durability methods per domain.
//! - [`subsystem`], [`handshake`]: admission, discovery and the connection handshake (pure /
//!   sans-I/O, for the sessions on the fabric).
//! - [`failures`]: the state file that remembers failed namespaces across restarts.
//! - [`flusher`]: the GPSPM flush service (io_uring; inline only for a loop with nothing else
//!   to do).
//! - [`reload`]: the SIGHUP configuration diff.
//! - [`control`]: the control socket and `status`.
//! - [`metrics`]: what is counted and how: the data-path counters' aggregation, latency
//!   histograms, the Prometheus exposition and its HTTP listener (`metrics_listen`).
//! - [`notify`]: sd_notify without libsystemd.
//! - [`daemon`]: start-up, signals, readiness; [`daemon::Serve`] is the seam for listeners and
//!   sessions.
//! - [`serve`]: the fabric-backed [`serve::FabricServe`]: accept threads, poll loops, sessions,
//!   per-connection rkeys, the GPSPM flush service on the wire.
//! - [`nvme_tcp`]: the `nvme-tcp://` listener: NVMe over TCP for the stock Linux host, on the
//!   same subsystems, namespaces, budgets and metrics.
//!
//! Threads: the daemon's main thread handles signals and reloads, one thread serves the control
//! socket (and, with `metrics_listen`, one accepts scrapes, each served on a short-lived thread
//! of its own, at most eight at once), one thread per listener accepts, and `poll_loops` threads each own their connections
//! and a [`flusher::Flusher`]. Cleanup: the control socket is removed
//! at exit; namespace mappings are dropped with the last session that holds them.
//!
//! Features: `rdma` builds the rdma transport in rpma-common (listeners on `rdma://` need it;
//! [`memlock`] checks at start that RLIMIT_MEMLOCK lets their sessions register namespaces).

pub mod check;
pub mod config;
pub mod control;
pub mod daemon;
mod eventfd;
pub mod failures;
pub mod fdstore;
pub mod flusher;
pub mod handshake;
pub mod memlock;
pub mod metrics;
pub mod namespace;
pub mod nvme_tcp;
/// sd_notify(3) (the common crate's, which the initiator's NBD export uses too).
pub use rpma_common::notify;
pub mod probe;
pub mod reload;
mod seam;
pub mod serve;
pub mod subsystem;
