//! Registering an admitted host's namespaces off its poll loop.
//!
//! A registration is an `ibv_reg_mr` per namespace on `rdma://`: on devdax and tmpfs it pins
//! every page of the namespace, which takes long for a big one (and as long again at each
//! connect: each connection has a protection domain of its own, docs/architecture.md). Run by
//! the poll loop, it held every other session of the loop for that long: their requests, their
//! keep-alives. So each poll loop has a registrar whose registering thread registers a
//! session's namespaces while the loop serves the others; the connection waits in
//! [`Phase::Registering`](super::conn::Phase) and the loop finishes its admission when the
//! registrations come back ([`Conn::registered`](super::conn::Conn)). Registrations the loop
//! cannot use (the connection went away, a reload changed the namespaces meanwhile, the target
//! filled up) are sent back here to be dropped, so that their deregistration does not hold the
//! loop either; so are a session's when it ends ([`Registrar::release`]): its goodbye
//! (the Disconnect that says why) goes out once they are dropped, so that a Write the host sends
//! after it is refused as before.
//!
//! Registering and dropping have a thread each (`rpma-reg-N`, `rpma-dereg-N`, each started at
//! its first use), so that a long deregistration (the hosts of a reconnect storm closing their
//! old sessions) does not hold the registrations of the hosts coming back, nor the other way
//! round. A session's regions may then still be pinned while a newcomer's are pinned: the
//! memory-lock check at start (target/src/memlock.rs) counts `max_connections` sessions, and a
//! registration refused for want of locked memory is said to the host, which connects again.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};

use rpma_common::fabric::{self, ProtectionDomain};
use rpma_common::proto::NamespaceDescriptor;

use super::session::{grant, Grant};
use super::LoopTx;
use crate::config::Transport;
use crate::namespace::OpenNamespace;

/// What a connection asks to have registered: its subsystem's namespaces, in nsid order.
pub(crate) struct Request {
    pub(crate) pd: ProtectionDomain,
    pub(crate) namespaces: Vec<Arc<OpenNamespace>>,
    /// The transport the connection came in on and its listener's `direct_write_to_pmem`.
    pub(crate) served_by: (Transport, bool),
    /// Whether the peer can send RDMA Flush.
    pub(crate) peer_flush: bool,
    /// Set when the connection no longer waits for it: what is not registered yet is not.
    pub(crate) cancel: Arc<AtomicBool>,
    /// The connection's registrations this one replaces (a reload changed its namespaces while
    /// they were made): dropped first, in the registering thread, so that one connection never
    /// has the same pages pinned twice (against RLIMIT_MEMLOCK).
    pub(crate) replaced: Vec<Grant>,
}

/// One namespace of a [`Registration`].
pub(crate) enum Outcome {
    /// A page of it could not be read back (docs/persistence.md): listed unavailable, not
    /// registered.
    Unreadable(usize),
    /// Registered, or why not.
    Registered(fabric::Result<(Grant, NamespaceDescriptor)>),
    /// Not registered: the connection called it off.
    Cancelled,
}

/// The registrations of one connection's namespaces, back to its loop.
pub(crate) struct Registration {
    /// The connection (its queue pair number and its serial in the loop).
    pub(crate) qp_num: u32,
    pub(crate) serial: u64,
    /// The namespaces asked for, in order, each with its outcome.
    pub(crate) outcomes: Vec<(Arc<OpenNamespace>, Outcome)>,
}

enum Work {
    Register(Request, u32, u64),
    /// Registrations to drop (deregister) here.
    Drop(Vec<Grant>),
    /// A session's registrations to drop, then to tell its connection (`qp_num`, `serial`).
    Release(Vec<Grant>, u32, u64),
}

/// A connection whose session's registrations were dropped ([`Registrar::release`]): its
/// queue pair number and its serial in the loop.
pub(crate) struct Released {
    pub(crate) qp_num: u32,
    pub(crate) serial: u64,
}

/// Which of a registrar's threads a [`Work`] goes to.
#[derive(Clone, Copy)]
enum Kind {
    /// Registrations.
    Register,
    /// Drops and releases (deregistrations).
    Deregister,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Register => "reg",
            Kind::Deregister => "dereg",
        }
    }
}

/// One of a registrar's threads, started at its first use.
#[derive(Default)]
struct Worker {
    /// To the thread, once it is started.
    tx: Option<mpsc::Sender<Work>>,
    /// The thread could not be started (said once; the loop does its work from then on).
    failed: bool,
}

/// A poll loop's registrar: its threads register what its connections ask for, and drop what
/// they no longer need, and hand the results to the loop ([`Registrar::take`],
/// [`Registrar::take_released`]), waking it.
pub(crate) struct Registrar {
    index: usize,
    registering: Worker,
    deregistering: Worker,
    done_tx: mpsc::Sender<Registration>,
    done: mpsc::Receiver<Registration>,
    released_tx: mpsc::Sender<Released>,
    released: mpsc::Receiver<Released>,
    wake: LoopTx,
}

impl Registrar {
    /// The registrar of poll loop `index`, which `wake` wakes (no thread until it is needed).
    pub(crate) fn new(index: usize, wake: LoopTx) -> Registrar {
        let (done_tx, done) = mpsc::channel();
        let (released_tx, released) = mpsc::channel();
        Registrar {
            index,
            registering: Worker::default(),
            deregistering: Worker::default(),
            done_tx,
            done,
            released_tx,
            released,
            wake,
        }
    }

    /// Registers `req` for connection (`qp_num`, `serial`) in the registering thread; the
    /// result comes back through [`take`](Self::take). If the thread cannot be started, it
    /// is done here, in the loop (as before there was a registrar).
    pub(crate) fn register(&mut self, req: Request, qp_num: u32, serial: u64) {
        match self.thread(Kind::Register) {
            Some(tx) => {
                if let Err(mpsc::SendError(Work::Register(req, ..))) =
                    tx.send(Work::Register(req, qp_num, serial))
                {
                    self.registering.tx = None;
                    let r = register(req, qp_num, serial);
                    let _ = self.done_tx.send(r);
                    self.wake.wake();
                }
            }
            None => {
                let r = register(req, qp_num, serial);
                let _ = self.done_tx.send(r);
                // (Possibly called while the loop takes results in: it turns again.)
                self.wake.wake();
            }
        }
    }

    /// The registrations among `outcomes` (to drop).
    pub(crate) fn granted(outcomes: Vec<(Arc<OpenNamespace>, Outcome)>) -> Vec<Grant> {
        outcomes
            .into_iter()
            .filter_map(|(_, o)| match o {
                Outcome::Registered(Ok((g, _))) => Some(g),
                _ => None,
            })
            .collect()
    }

    /// Registrations that are done, for the loop to hand to their connections.
    pub(crate) fn take(&self) -> mpsc::TryIter<'_, Registration> {
        self.done.try_iter()
    }

    /// Drops `grants` (deregistering their regions) in the deregistering thread.
    pub(crate) fn discard(&mut self, grants: Vec<Grant>) {
        if grants.is_empty() {
            return;
        }
        if let Some(tx) = self.thread(Kind::Deregister) {
            // (If the thread is gone they are dropped here, with the error.)
            let _ = tx.send(Work::Drop(grants));
        }
    }

    /// Drops a session's registrations `grants` in the deregistering thread (a pinned
    /// namespace's deregistration takes as long as its registration), then says so through
    /// [`take_released`](Self::take_released) and wakes the loop. Done here if the thread
    /// cannot be started.
    pub(crate) fn release(&mut self, grants: Vec<Grant>, qp_num: u32, serial: u64) {
        match self.thread(Kind::Deregister) {
            Some(tx) => {
                if let Err(mpsc::SendError(Work::Release(grants, ..))) =
                    tx.send(Work::Release(grants, qp_num, serial))
                {
                    self.deregistering.tx = None;
                    self.release_here(grants, qp_num, serial);
                }
            }
            None => self.release_here(grants, qp_num, serial),
        }
    }

    fn release_here(&self, grants: Vec<Grant>, qp_num: u32, serial: u64) {
        drop(grants);
        let _ = self.released_tx.send(Released { qp_num, serial });
        // (Possibly called while the loop takes results in: it turns again.)
        self.wake.wake();
    }

    /// Sessions whose registrations [`release`](Self::release) dropped.
    pub(crate) fn take_released(&self) -> mpsc::TryIter<'_, Released> {
        self.released.try_iter()
    }

    /// The way in to the thread of `kind`, started at its first use; None if it cannot be
    /// started.
    fn thread(&mut self, kind: Kind) -> Option<mpsc::Sender<Work>> {
        let worker = match kind {
            Kind::Register => &mut self.registering,
            Kind::Deregister => &mut self.deregistering,
        };
        if let Some(tx) = &worker.tx {
            return Some(tx.clone());
        }
        if worker.failed {
            return None;
        }
        let (tx, rx) = mpsc::channel::<Work>();
        let done = self.done_tx.clone();
        let released = self.released_tx.clone();
        let wake = self.wake.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("rpma-{}-{}", kind.name(), self.index))
            .spawn(move || {
                for w in rx {
                    match w {
                        Work::Register(req, qp_num, serial) => {
                            // (A loop that is gone takes nothing: dropped here.)
                            if done.send(register(req, qp_num, serial)).is_ok() {
                                wake.wake();
                            }
                        }
                        Work::Drop(grants) => drop(grants),
                        Work::Release(grants, qp_num, serial) => {
                            drop(grants);
                            if released.send(Released { qp_num, serial }).is_ok() {
                                wake.wake();
                            }
                        }
                    }
                }
            });
        match spawned {
            Ok(_) => {
                worker.tx = Some(tx.clone());
                Some(tx)
            }
            Err(e) => {
                worker.failed = true;
                log::error!(
                    "poll loop {}: cannot start its {}istration thread ({e}): doing that work \
                     in the loop",
                    self.index,
                    kind.name()
                );
                None
            }
        }
    }
}

/// Registers every namespace of `req` that can be read, until the connection calls it off,
/// having dropped what it replaces.
fn register(req: Request, qp_num: u32, serial: u64) -> Registration {
    drop(req.replaced);
    let outcomes = req
        .namespaces
        .into_iter()
        .map(|ns| {
            let outcome = if req.cancel.load(Ordering::Relaxed) {
                Outcome::Cancelled
            } else {
                match ns.mapping.unreadable_at() {
                    Some(at) => Outcome::Unreadable(at),
                    None => Outcome::Registered(grant(&req.pd, &ns, req.served_by, req.peer_flush)),
                }
            };
            (ns, outcome)
        })
        .collect();
    Registration {
        qp_num,
        serial,
        outcomes,
    }
}
