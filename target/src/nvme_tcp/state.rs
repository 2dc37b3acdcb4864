//! What a queue ([`Queue`](super::queue::Queue)) holds besides its buffers: where it is
//! ([`Phase`]; an admin, I/O or discovery queue's own state; an admitted I/O controller's
//! [`Registration`] among the sessions), the commands it took in and has not answered yet (a
//! [`Transfer`] waiting for its data, a [`Wait`] for its flushes), and the [`Input`] a command
//! runs with. queue.rs and its handlers (`fabrics`, `admin`, `io`, `transfer`, `reply`) build on
//! this file, and it names none of them.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use super::command::{Sqe, Status};
use super::controller::{Controller, NsCounts, NsMap};
use super::Ctx;
use crate::namespace::OpenNamespace;
use crate::serve::session_info::SessionInfo;

/// The admin queue of an I/O controller: it owns the controller.
pub(crate) struct AdminQueue {
    pub(crate) ctrl: Arc<Controller>,
    pub(crate) reg: Registration,
    /// Asynchronous Event Requests held.
    pub(crate) aers: Vec<u16>,
}

/// An I/O queue.
pub(crate) struct IoQueue {
    pub(crate) ctrl: Arc<Controller>,
    pub(crate) qid: u16,
    pub(crate) ns_generation: u64,
    pub(crate) ns: Arc<NsMap>,
}

/// The admin queue of a discovery controller.
pub(crate) struct DiscoveryQueue {
    pub(crate) ctrl: Arc<Controller>,
    pub(crate) info: Arc<SessionInfo>,
    /// Its entry in `status`, removed with it.
    pub(crate) listed: u64,
    pub(crate) ctx: Arc<Ctx>,
    pub(crate) aers: Vec<u16>,
    /// When the session's time limit (`discovery_timeout_ms`) ends it.
    pub(crate) deadline: Instant,
}

impl Drop for DiscoveryQueue {
    fn drop(&mut self) {
        self.ctx.serve.unregister_discovery(self.listed);
    }
}

/// Where a queue is.
pub(crate) enum Phase {
    AwaitIcReq,
    AwaitConnect,
    Admin(Box<AdminQueue>),
    Io(Box<IoQueue>),
    Discovery(Box<DiscoveryQueue>),
}

/// An admitted I/O controller's place among the sessions: its controller id, its entry in
/// `status`, its namespaces' session counts. Dropping it gives them back and kills the
/// controller (its I/O queues close).
pub(crate) struct Registration {
    /// The listener's shared state, which lists the controller.
    pub(super) ctx: Arc<Ctx>,
    pub(crate) ctrl: Arc<Controller>,
    pub(crate) info: Arc<SessionInfo>,
    /// The namespaces whose session counts it holds.
    pub(super) held: Vec<Arc<OpenNamespace>>,
}

impl Registration {
    /// The namespaces it holds now (a reload changed them).
    pub(crate) fn hold(&mut self, namespaces: Vec<Arc<OpenNamespace>>) {
        for ns in &namespaces {
            ns.counters.sessions.fetch_add(1, Ordering::Relaxed);
        }
        for ns in std::mem::replace(&mut self.held, namespaces) {
            ns.counters.sessions.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.ctrl.kill();
        self.hold(Vec::new());
        self.ctx.forget_controller(self.ctrl.cntlid);
        self.ctx.serve.unregister_session(self.ctrl.cntlid);
        self.ctx.wake_all();
    }
}

/// Where the data an R2T fetches goes.
pub(crate) enum Sink {
    /// Straight into a namespace at this byte offset (a Write).
    Namespace {
        ns: Arc<OpenNamespace>,
        counts: Arc<NsCounts>,
        offset: u64,
        fua: bool,
    },
    /// Into a buffer, then the command runs as if the data had come in its capsule.
    Buffer(Vec<u8>),
}

/// A command waiting for its data.
pub(crate) struct Transfer {
    pub(super) sqe: Sqe,
    pub(super) ttag: u16,
    pub(super) len: u32,
    pub(super) received: u32,
    /// A data digest failed: the command completes with a transient transport error.
    pub(super) corrupt: bool,
    /// The namespace refused a chunk ([`write_status`](super::io::write_status)): the command
    /// completes with that status, nothing more of it is placed.
    pub(super) refused: Option<super::command::Status>,
    pub(super) sink: Sink,
}

/// What happens when every flush of a group is done.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Then {
    /// Complete the command.
    Complete(u16),
    /// Complete the write-type command `cid` (a FUA Write, any write with the write cache off,
    /// Write Zeroes, a deallocation) into namespace `nsid`, with a Write Fault if a reload
    /// put another file in place of the one its bytes went into meanwhile (they are in a file
    /// the host no longer reads, and the Flush that said so for the replacement may have come
    /// and gone).
    Write { cid: u16, nsid: u32 },
    /// The shutdown notification's flushes: shutdown processing is complete.
    ShutdownDone,
}

impl Then {
    /// The command it completes, if any.
    pub(crate) fn cid(self) -> Option<u16> {
        match self {
            Then::Complete(cid) | Then::Write { cid, .. } => Some(cid),
            Then::ShutdownDone => None,
        }
    }
}

/// Flushes a command (or a shutdown) waits for.
pub(crate) struct Wait {
    pub(super) then: Then,
    pub(super) remaining: usize,
    pub(super) status: Status,
    pub(super) counted: Vec<Arc<NsCounts>>,
    /// Namespaces whose failure to note (log once) if a flush of theirs failed.
    pub(super) namespaces: Vec<Arc<OpenNamespace>>,
}

/// The input a command runs with.
pub(crate) enum Input<'a> {
    /// Data from the host (in the capsule, or fetched).
    Data(&'a [u8]),
    /// Room the host has for data from the controller.
    Room(u32),
}

impl Input<'_> {
    pub(crate) fn data(&self) -> &[u8] {
        match self {
            Input::Data(d) => d,
            Input::Room(_) => &[],
        }
    }

    pub(crate) fn room(&self) -> u32 {
        match self {
            Input::Room(n) => *n,
            Input::Data(_) => 0,
        }
    }
}
