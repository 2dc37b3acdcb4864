//! The NVMe/TCP listener: `nvme-tcp://ADDR:PORT` serves the configured subsystems and
//! namespaces to the stock Linux host (`nvme discover`, `nvme connect -t tcp`, /dev/nvmeXnY),
//! beside the `tcp://` and `rdma://` listeners and under the same admission budgets, logs and
//! metrics. docs/nvme-tcp.md is the operator's guide.
//!
//! # Shape
//!
//! ```text
//!  accept thread (one per nvme-tcp listener)       nvme loop 0 .. poll_loops-1 (threads)
//!  TCP accept, a place in the unadmitted pool ---> epoll over its sockets; each connection a
//!  (per-source cap), least-loaded loop             Queue (queue.rs): PDUs in, PDUs out;
//!                                                  flushes through its own Flusher (io_uring)
//! ```
//!
//! - [`pdu`]: the wire (PDUs, digests, framing); [`command`]: submission and completion entries,
//!   status codes; [`identify`] and [`discovery`]: the data structures a host reads.
//! - `queue`: one connection as a sans-I/O state machine, over `state` (what it holds: its
//!   phase, the commands waiting for data or flushes): `transfer` (R2T and H2CData) and
//!   `reply` (completions, data, waiting for flushes) are its halves; `fabrics` (Connect,
//!   properties, Disconnect), `admin` (admin commands, reloads) and `io` (I/O commands,
//!   durability) its command handlers; [`controller`]: what the queues of one controller share.
//! - `server`: the accept threads, and `poll_loop`: the loops that move bytes between sockets
//!   and queues.
//!
//! # Admission and memory
//!
//! A new connection takes a place in the unadmitted pool at its TCP accept (bounded in total
//! and per source address, its oldest evicted when full; `handshake_timeout_ms` to finish its
//! ICReq and Connect) and holds at most one admin command capsule until its Connect. An
//! admitted I/O controller counts against `max_connections` and gets its controller id from the
//! same space as the native sessions; it may open up to [`controller::MAX_IO_QUEUES`] I/O queues,
//! each bounded in what it buffers (queue.rs). A discovery controller moves to the discovery
//! pool, with its time limit. Refusals, protocol errors and TermReqs are logged rate-limited
//! per peer address ([`crate::serve`]'s peer log) and counted like the native ones.
//!
//! # Threads
//!
//! `poll_loops` loops of their own (named `rpma-nvme-N`) and one accept thread per listener
//! (`rpma-nvme-accept-PORT`), each with a heartbeat for the watchdog. A controller's queues may
//! be served by different loops: what they share is in an `Arc<Controller>` behind locks that
//! are taken per command, never across a wait.

pub mod command;
pub mod controller;
pub mod discovery;
pub mod identify;
pub mod pdu;

mod admin;
mod fabrics;
mod io;
mod poll_loop;
pub(crate) mod queue;
mod reply;
mod server;
mod state;
mod transfer;

pub(crate) use server::Server;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use controller::Controller;

use crate::eventfd::EventFd;
use crate::serve::shared::Shared;

/// What every NVMe/TCP thread shares.
pub(crate) struct Ctx {
    /// The serving machinery's shared state: configuration, namespaces, budgets, sessions, peer
    /// log, events.
    pub(crate) serve: Arc<Shared>,
    controllers: Mutex<HashMap<u16, Arc<Controller>>>,
    next_discovery: AtomicU32,
    generation: AtomicU64,
    wakers: Mutex<Vec<Arc<EventFd>>>,
}

impl std::fmt::Debug for Ctx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("nvme_tcp::Ctx").finish()
    }
}

impl Ctx {
    pub(crate) fn new(serve: Arc<Shared>) -> Ctx {
        Ctx {
            serve,
            controllers: Mutex::new(HashMap::new()),
            next_discovery: AtomicU32::new(0),
            generation: AtomicU64::new(1),
            wakers: Mutex::new(Vec::new()),
        }
    }

    /// Entries of the largest queue a host may create (MQES + 1, MAXCMD): the configuration's
    /// `max_queue_depth`.
    pub(crate) fn queue_entries(&self) -> u16 {
        self.serve.config().max_queue_depth.clamp(2, 65_535) as u16
    }

    /// The live I/O controller `cntlid`.
    pub(crate) fn controller(&self, cntlid: u16) -> Option<Arc<Controller>> {
        self.controllers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&cntlid)
            .cloned()
    }

    pub(crate) fn add_controller(&self, c: Arc<Controller>) {
        self.controllers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(c.cntlid, c);
    }

    pub(crate) fn forget_controller(&self, cntlid: u16) {
        self.controllers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&cntlid);
    }

    /// An id for a discovery controller (they have no I/O queues, so ids only need to differ
    /// from one connection to the next).
    pub(crate) fn next_discovery_id(&self) -> u16 {
        (self.next_discovery.fetch_add(1, Ordering::Relaxed) % 0xffef + 1) as u16
    }

    /// The discovery log's generation counter (bumped by every reload).
    pub(crate) fn discovery_generation(&self) -> u64 {
        self.generation.load(Ordering::Relaxed)
    }

    pub(crate) fn bump_generation(&self) {
        self.generation.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn add_waker(&self, w: Arc<EventFd>) {
        self.wakers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(w);
    }

    /// Wakes every loop (a controller died: its I/O queues, wherever they are, close).
    pub(crate) fn wake_all(&self) {
        for w in self.wakers.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            w.signal();
        }
    }
}
