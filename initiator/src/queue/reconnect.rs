//! Reconnect: the state machine that takes a queue from a lost connection to a new one (with
//! the policy's backoff, the held writes re-issued) or to giving up, and the budget of one call
//! that a loss interrupted ([`Call`]: the call is re-run, or its loss reported).
//!
//! A connection given up while it is still up (a time-out, a lost keep-alive: the link went
//! silent, it did not break) is retired first: what it still carries must not land after the
//! held writes are re-issued elsewhere, or a stalled link that wakes up would overwrite them,
//! and the writes acknowledged after them, with its late copies ([`retire`]).
//!
//! [`Reconnect`] owns where to connect again and whether the queue gave up; it works on the
//! [`Engine`] (whose session it replaces and whose held writes it re-issues) and the
//! [`Persister`] (whose methods it chooses again for the new connection's namespaces).

use std::sync::Arc;
use std::time::{Duration, Instant};

use rpma_common::fabric::{Access, AlignedBuf, Completion, QpState, RemoteAddr, SendOp, Sge};
use rpma_common::proto::{Disconnect, Message, NamespaceDescriptor};

use super::connection::Connection;
use super::engine::{Engine, Lost};
use super::persist::Persister;
use crate::checks::check_healthy;
use crate::error::{Error, LossReason, Result};
use crate::pool::WriteRec;
use crate::session::Session;
use crate::writebuf::Hold;

/// How long past a retired connection's keep-alive period (at least) the queue waits for the
/// target to have expired it: the target checks lapses in its poll loop's turns.
const EXPIRY_GRACE: Duration = Duration::from_millis(500);

/// What [`Queue::run`](super::Queue::run) does with a call that a connection loss interrupted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OnLoss {
    /// Reconnect and run the call again (reads, writes, persists: re-running them is safe).
    Rerun,
    /// Reconnect, then fail the call with the loss (an atomic: it may have executed).
    ReconnectAndFail,
}

/// The reconnect budget of one call: a target that admits and then drops every connection
/// must not keep a call forever, so the policy's time budget starts at the first loss this
/// call sees and covers its reruns.
#[derive(Debug)]
pub(super) struct Call {
    budget: Duration,
    max_attempts: u32,
    deadline: Option<Instant>,
    reruns: u32,
}

impl Call {
    /// The deadline of this call's reconnects: set at its first loss.
    pub(super) fn deadline(&mut self) -> Instant {
        let budget = self.budget;
        *self
            .deadline
            .get_or_insert_with(|| crate::deadline::after(budget))
    }

    /// After a loss and a successful reconnect: whether to run the call again (else it fails
    /// with the loss). Never for `ReconnectAndFail`, nor past the policy's attempts or time.
    pub(super) fn rerun(&mut self, on_loss: OnLoss) -> bool {
        self.reruns += 1;
        let past = self.deadline.is_some_and(|d| Instant::now() >= d);
        !(on_loss == OnLoss::ReconnectAndFail || self.reruns > self.max_attempts || past)
    }
}

/// Of two failed attempts' errors, the one a failed reconnect reports: the later one, unless
/// only the earlier is the target's own refusal (a later attempt that got no answer, cut
/// short by the budget or finding the link gone, says nothing of why the target turned the
/// host away).
fn telling(earlier: Option<Error>, later: Error) -> Error {
    match earlier {
        Some(e) if e.is_refusal() && !later.is_refusal() => e,
        _ => later,
    }
}

/// Whether a call's error is a connection loss that a reconnect may cure.
pub(super) fn retryable(e: &Error) -> bool {
    e.is_connection_loss()
}

/// A queue's way back to its target: where and who ([`Connection`]), its queue id, how often
/// it reconnected, and whether it gave up (then every call fails with [`Error::Broken`]).
#[derive(Debug)]
pub(super) struct Reconnect {
    conn: Connection,
    queue_id: u16,
    reconnects: u32,
    broken: bool,
}

impl Reconnect {
    pub(super) fn new(conn: Connection, queue_id: u16) -> Reconnect {
        Reconnect {
            conn,
            queue_id,
            reconnects: 0,
            broken: false,
        }
    }

    /// Where and who.
    pub(super) fn connection(&self) -> &Connection {
        &self.conn
    }

    /// The queue id this queue asked for.
    pub(super) fn queue_id(&self) -> u16 {
        self.queue_id
    }

    /// How many times the queue reconnected.
    pub(super) fn reconnects(&self) -> u32 {
        self.reconnects
    }

    /// Whether the queue gave up.
    pub(super) fn is_broken(&self) -> bool {
        self.broken
    }

    /// The budget of a new call.
    ///
    /// # Errors
    /// [`Error::Broken`] once the queue gave up.
    pub(super) fn call(&self) -> Result<Call> {
        if self.broken {
            return Err(Error::Broken);
        }
        Ok(Call {
            budget: self.conn.queue.reconnect.timeout,
            max_attempts: self.conn.queue.reconnect.max_attempts,
            deadline: None,
            reruns: 0,
        })
    }

    /// Reconnects `e` with the policy's backoff; no attempt starts after `deadline`. The old
    /// connection is retired first when writes are held for a re-issue or `fence` says a
    /// request of the interrupted call may still be on it. `lost` says what lost it (for the
    /// error, when reconnecting fails).
    ///
    /// # Errors
    /// [`Error::ReconnectFailed`] when the budget or the attempts run out (or the old
    /// connection could not be retired in time), [`Error::NamespaceChanged`] when a namespace
    /// the queue uses changed ([`try_reconnect`](Self::try_reconnect)) and
    /// [`Error::NamespaceFailed`] when one it holds writes for failed; in every case the queue
    /// gives up.
    pub(super) fn reconnect(
        &mut self,
        e: &mut Engine,
        p: &mut Persister,
        deadline: Instant,
        fence: bool,
        lost: String,
    ) -> Result<()> {
        let started = Instant::now();
        let Lost { old, held, voided } = e.lose_connection();
        let retiring = fence || !held.is_empty();
        let at_stake = held.len();
        self.let_go(
            e,
            old.filter(|_| retiring),
            voided,
            deadline,
            &lost,
            at_stake,
        )?;
        let policy = self.conn.queue.reconnect.clone();
        let mut last = None;
        let mut attempts = 0;
        for attempt in 1..=policy.max_attempts {
            let wait = policy.backoff(attempt);
            if crate::deadline::after(wait) > deadline {
                break;
            }
            std::thread::sleep(wait);
            attempts = attempt;
            // Each attempt gets the connect deadline, cut to what is left of the budget.
            let left = deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(100));
            match self.try_reconnect(e, p, &held, self.conn.options.timeout.min(left)) {
                Ok(()) => {
                    self.reconnects += 1;
                    log::info!(
                        "queue {} reconnected to {} (attempt {attempt}), {} write(s) re-issued",
                        self.queue_id,
                        self.conn.url,
                        held.len()
                    );
                    return Ok(());
                }
                Err(err @ (Error::NamespaceChanged { .. } | Error::NamespaceFailed { .. })) => {
                    self.give_up(e);
                    return Err(err);
                }
                Err(err) => {
                    log::debug!("reconnect attempt {attempt} failed: {err}");
                    // The attempt's session may carry some of the re-issued Writes (a batch
                    // posted before it broke or went silent): they are held again for the next
                    // attempt, not left in flight on a connection that is gone, and a session
                    // still up is retired as the lost one was, so that none of them lands
                    // after the next attempt's copies.
                    let Lost { old, voided, .. } = e.lose_connection();
                    self.let_go(e, old, voided, deadline, &lost, at_stake)?;
                    last = Some(telling(last, err));
                }
            }
        }
        self.give_up(e);
        Err(Error::ReconnectFailed {
            lost,
            attempts,
            elapsed: started.elapsed(),
            held: at_stake,
            last: Box::new(last.unwrap_or(Error::ConnectionLost {
                reason: LossReason::NoReconnectAttempt,
            })),
        })
    }

    /// Retires `old` (when given: a connection that may still carry requests) and then lets
    /// the dropped Reads' buffers go and forgets what the connection owed: nothing places into
    /// those buffers once it is closed. The queue gives up if it cannot be retired in time.
    fn let_go(
        &mut self,
        e: &mut Engine,
        old: Option<Session>,
        voided: Vec<Hold>,
        deadline: Instant,
        lost: &str,
        held: usize,
    ) -> Result<()> {
        if let Some(s) = old {
            let expires = expiry_of(&s);
            if let Err(err) = retire(e, s, deadline, lost, held) {
                // Still up, it may deliver its Writes until the target expires it: over newer
                // writes of the connection's other queues, and of one opened in this one's
                // place (the NBD export opens one at once). The connection's Writes wait.
                self.conn.replay.fence_until(expires);
                log::warn!(
                    "queue {} gave up a connection to {} that may still deliver writes: the \
                     connection's writes wait {} ms, until the target has expired it",
                    self.queue_id,
                    self.conn.url,
                    expires
                        .saturating_duration_since(Instant::now())
                        .as_millis()
                );
                drop(voided);
                self.give_up(e);
                return Err(err);
            }
        }
        drop(voided);
        e.forget_owed();
        Ok(())
    }

    fn give_up(&mut self, e: &mut Engine) {
        self.broken = true;
        e.give_up();
    }

    /// One attempt: a new session on which every namespace the queue uses (a handle was taken
    /// on it, or it holds writes for it) is still there and maps the same file, with the same
    /// size and mode, and is healthy where writes are held; installed in `e` with every
    /// namespace's new descriptor (a namespace it no longer lists keeps its index, gone) and
    /// the methods chosen again in `p`, and the held writes re-issued on it. A namespace the
    /// queue does not use may change or go: nothing the queue holds or checked refers to it
    /// (a reload that changes one closes every session it was granted to).
    ///
    /// # Errors
    /// What connecting returns; [`Error::NamespaceChanged`], [`Error::NamespaceFailed`]
    /// before anything of the queue changed.
    fn try_reconnect(
        &self,
        e: &mut Engine,
        p: &mut Persister,
        held: &[(usize, WriteRec)],
        timeout: Duration,
    ) -> Result<()> {
        let s = self.conn.connect_session_within(self.queue_id, timeout)?;
        let peer_flush = s.qp().info().peer_flush;
        for idx in 0..e.descriptors().len() {
            let holds = held.iter().any(|(_, w)| w.ns == idx);
            if !(e.uses(idx) || holds) {
                continue;
            }
            let old = e.descriptor(idx);
            let new = s.namespace(old.nsid);
            if let Some(what) = change(old, new) {
                return Err(Error::NamespaceChanged {
                    nsid: old.nsid,
                    what,
                });
            }
            // Held writes on a namespace that failed meanwhile can never be made durable:
            // re-issuing them would only be refused.
            if let (true, Some(d)) = (holds, new) {
                check_healthy(d)?;
            }
        }
        for idx in 0..e.descriptors().len() {
            let old = e.descriptor(idx);
            let nsid = old.nsid;
            let new = s.namespace(nsid);
            if e.listed(idx) && !e.uses(idx) {
                if let Some(what) = change(old, new) {
                    log::info!(
                        "queue {}: namespace {nsid} changed across the reconnect ({what}); the \
                         queue does not use it and goes on",
                        self.queue_id
                    );
                }
            }
            match new {
                Some(d) => {
                    e.set_descriptor(idx, d.clone());
                    p.refresh(idx, d, peer_flush);
                }
                None => e.set_gone(idx),
            }
        }
        e.install(s)?;
        e.reissue(held)
    }
}

/// How namespace `new` (None: the target no longer lists it) differs from `old` in what the
/// queue's held writes and checks rely on, if it does. Another file at the namespace's path (a
/// restored one moved into place): the held writes belong to the old file, and a durability
/// answer from this one cannot vouch for what that one was given.
fn change(old: &NamespaceDescriptor, new: Option<&NamespaceDescriptor>) -> Option<String> {
    let Some(d) = new else {
        return Some("it is gone".into());
    };
    if d.identity != old.identity {
        return Some(format!(
            "the target maps another file as the namespace now (identity {:016x} -> {:016x})",
            old.identity, d.identity
        ));
    }
    if d.size != old.size || d.read_only != old.read_only {
        return Some(format!(
            "size {} -> {}, read-only {} -> {}",
            old.size, d.size, old.read_only, d.read_only
        ));
    }
    None
}

/// When the target has expired `s` if it stays silent from now: its keep-alive period (plus a
/// grace) after the last message sent on it.
fn expiry_of(s: &Session) -> Instant {
    s.last_sent + s.keep_alive + EXPIRY_GRACE.max(s.keep_alive / 4)
}

/// Retires `old` so that nothing it carries lands after this returns. A connection that
/// broke (queue pair in Error) or that the target closed (its Disconnect: the target revoked
/// the session's rkeys before sending it) carries nothing more. One that is still up may
/// deliver late what it holds, so a Read is posted on it (the target answers it only after
/// every earlier request of that queue pair was executed) and a Disconnect, and the queue
/// waits for the first of: the Read's answer, the connection's end, and the old session's
/// keep-alive period (plus a grace) after the last message sent on it, by when the target has
/// expired the silent session and revoked its rkeys (no keep-alive goes out meanwhile).
///
/// # Errors
/// [`Error::ReconnectFailed`] if `deadline` (the reconnect budget) passes first: the held
/// writes cannot be re-issued safely (`lost`: what lost the connection, for that error).
fn retire(
    e: &mut Engine,
    mut old: Session,
    deadline: Instant,
    lost: &str,
    held: usize,
) -> Result<()> {
    if old.closed.is_some() || old.qp().state() == QpState::Error {
        return Ok(());
    }
    let started = Instant::now();
    let expired_by = expiry_of(&old);
    // The fence's sink lives in the old protection domain, apart from the queue's buffers.
    let sink = AlignedBuf::new(64).ok();
    let sink_mr = sink
        .as_ref()
        .and_then(|b| old.pd().register(Arc::clone(b), Access::LOCAL_WRITE).ok());
    // Any namespace the connection serves (not one the target no longer lists: no rkey).
    let reachable = e.descriptors().iter().find(|d| d.unavailable.is_none());
    let fence = match (&sink_mr, reachable) {
        (Some(mr), Some(d)) => {
            let remote = RemoteAddr {
                addr: d.remote_addr,
                rkey: d.rkey,
            };
            let wr = e.waited_wr(SendOp::Read {
                local: Sge::new(mr, 0, 8),
                remote,
            });
            let id = wr.wr_id;
            old.qp().post_send(wr).ok().map(|()| id)
        }
        _ => None,
    };
    let bye = Message::Disconnect(Disconnect {
        reason: "the host gave this connection up: no answer in time".into(),
    });
    let _ = old.send_message(&bye);
    // The goodbye is said: dropping the session must not say it again (and wait).
    old.admitted = false;
    let mut wcs = [Completion::EMPTY; 16];
    let outcome = loop {
        if old.qp().state() == QpState::Error {
            break Ok(());
        }
        let now = Instant::now();
        if now >= expired_by {
            break Ok(());
        }
        if now >= deadline {
            break Err(Error::ReconnectFailed {
                lost: lost.to_owned(),
                attempts: 0,
                elapsed: started.elapsed(),
                held,
                last: Box::new(Error::Timeout {
                    what: "the end of the connection given up",
                    after: started.elapsed(),
                }),
            });
        }
        let wait = expired_by.min(deadline) - now;
        match old
            .cq()
            .wait(&mut wcs, Some(wait.min(Duration::from_millis(100))))
        {
            Ok(n) if wcs[..n].iter().any(|c| Some(c.wr_id) == fence) => break Ok(()),
            Ok(_) => {}
            // A lost device delivers nothing more.
            Err(rpma_common::fabric::Error::DeviceLost { .. }) => break Ok(()),
            Err(source) => {
                break Err(Error::Fabric {
                    op: "waiting for completions",
                    source,
                })
            }
        }
    };
    // The queue pair goes before the memory its unanswered Read may still be bound for.
    drop(old);
    drop(sink_mr);
    outcome
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn refused() -> Error {
        Error::HostNotAllowed {
            message: "not allowed".into(),
        }
    }

    fn timed_out() -> Error {
        Error::Timeout {
            what: "a connect answer",
            after: Duration::from_millis(100),
        }
    }

    #[test]
    fn a_failed_reconnect_reports_the_targets_refusal_over_a_later_attempt_without_answer() {
        // The last attempt got no answer (the budget cut it short): the refusal stands.
        assert!(matches!(
            telling(Some(refused()), timed_out()),
            Error::HostNotAllowed { .. }
        ));
        // Otherwise the later error: a newer refusal, or no refusal at all.
        assert!(matches!(
            telling(Some(timed_out()), refused()),
            Error::HostNotAllowed { .. }
        ));
        assert!(matches!(
            telling(Some(refused()), Error::KeyRequired),
            Error::KeyRequired
        ));
        assert!(matches!(
            telling(Some(timed_out()), Error::Broken),
            Error::Broken
        ));
        assert!(matches!(telling(None, timed_out()), Error::Timeout { .. }));
    }

    #[test]
    fn a_namespace_changed_is_another_file_size_or_mode_or_gone_not_a_new_address() {
        use rpma_common::proto::{DurabilityMethods, PersistenceDomain};
        let old = NamespaceDescriptor {
            nsid: 3,
            size: 1 << 20,
            block_size: 4096,
            remote_addr: 0x1000,
            rkey: 7,
            domain: PersistenceDomain::PageCache,
            durability: DurabilityMethods::NONE,
            atomic_write_unit: 8,
            read_only: true,
            failure: None,
            simulation: None,
            unavailable: None,
            identity: 42,
        };
        let with = |f: fn(&mut NamespaceDescriptor)| {
            let mut d = old.clone();
            f(&mut d);
            change(&old, Some(&d))
        };
        // A new connection's address and rkey, block size or methods: the same namespace.
        assert_eq!(
            with(|d| {
                d.remote_addr = 0x2000;
                d.rkey = 9;
                d.block_size = 512;
            }),
            None
        );
        assert!(change(&old, None).is_some_and(|w| w == "it is gone"));
        assert!(with(|d| d.identity = 43).is_some_and(|w| w.contains("another file")));
        assert!(with(|d| d.size = 2 << 20).is_some_and(|w| w.contains("size 1048576 -> 2097152")));
        assert!(
            with(|d| d.read_only = false).is_some_and(|w| w.contains("read-only true -> false"))
        );
    }
}
