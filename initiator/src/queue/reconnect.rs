//! Reconnect: running a call so that a lost connection is reconnected with the policy's
//! backoff, the held writes re-issued and the call re-run (or its loss reported).
//!
//! A connection given up while it is still up (a time-out, a lost keep-alive: the link went
//! silent, it did not break) is retired first: what it still carries must not land after the
//! held writes are re-issued elsewhere, or a stalled link that wakes up would overwrite them,
//! and the writes acknowledged after them, with its late copies ([`Queue::retire`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use rpma_common::fabric::{
    Access, AlignedBuf, Completion, QpState, RemoteAddr, SendOp, SendWr, Sge,
};
use rpma_common::proto::{Disconnect, Message};

use super::persist::choice_of;
use super::Queue;
use crate::checks::check_healthy;
use crate::error::{Error, LossReason, Result};
use crate::pool::WriteRec;
use crate::session::Session;

/// How long past a retired connection's keep-alive period (at least) the queue waits for the
/// target to have expired it: the target checks lapses in its poll loop's turns.
const EXPIRY_GRACE: Duration = Duration::from_millis(500);

/// What [`Queue::run`] does with a call that a connection loss interrupted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OnLoss {
    /// Reconnect and run the call again (reads, writes, persists: re-running them is safe).
    Rerun,
    /// Reconnect, then fail the call with the loss (an atomic: it may have executed).
    ReconnectAndFail,
}

impl Queue {
    /// Runs `op`, reconnecting after a connection loss and then re-running it or failing with
    /// the loss, as `on_loss` says.
    pub(crate) fn run<T>(
        &mut self,
        on_loss: OnLoss,
        mut op: impl FnMut(&mut Self) -> Result<T>,
    ) -> Result<T> {
        if self.broken {
            return Err(Error::Broken);
        }
        // A target that admits and then drops every connection must not keep a call forever:
        // the policy's time budget starts at the first loss this call sees and covers reruns.
        let mut reruns = 0;
        let mut deadline = None;
        let budget = self.conn.queue.reconnect.timeout;
        loop {
            if self.needs_reconnect() {
                let d = *deadline.get_or_insert_with(|| Instant::now() + budget);
                self.reconnect(d, true)?;
            }
            match op(self) {
                Err(e) if retryable(&e) => {
                    let d = *deadline.get_or_insert_with(|| Instant::now() + budget);
                    // An interrupted atomic must have executed, or never execute, by the time
                    // the call reports the loss: retire the connection it may still be on.
                    self.reconnect(d, on_loss == OnLoss::ReconnectAndFail)?;
                    reruns += 1;
                    if on_loss == OnLoss::ReconnectAndFail
                        || reruns > self.conn.queue.reconnect.max_attempts
                        || Instant::now() >= d
                    {
                        return Err(e);
                    }
                }
                r => return r,
            }
        }
    }

    fn needs_reconnect(&self) -> bool {
        match &self.session {
            Some(s) => s.qp().state() == QpState::Error,
            None => true,
        }
    }

    /// Reconnects with the policy's backoff; no attempt starts after `deadline`. The old
    /// connection is retired first when writes are held for a re-issue or `fence` says a
    /// request of the interrupted call may still be on it.
    fn reconnect(&mut self, deadline: Instant, fence: bool) -> Result<()> {
        let started = Instant::now();
        let held = self.pool.on_connection_lost();
        if let Some(s) = self.session.take() {
            if fence || !held.is_empty() {
                if let Err(e) = self.retire(s, deadline) {
                    self.give_up();
                    return Err(e);
                }
            }
        }
        self.flush_answers.clear();
        self.reads_done.clear();
        self.waited_done.clear();
        // Started Writes are held (re-issued below) and started Reads in flight dropped (their
        // tickets void); the completions already collected stay, completed Reads with their
        // bytes.
        self.deferred.clear();
        let policy = self.conn.queue.reconnect.clone();
        let mut last = None;
        let mut attempts = 0;
        for attempt in 1..=policy.max_attempts {
            let wait = policy.backoff(attempt);
            if Instant::now() + wait > deadline {
                break;
            }
            std::thread::sleep(wait);
            attempts = attempt;
            // Each attempt gets the connect deadline, cut to what is left of the budget.
            let left = deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(100));
            match self.try_reconnect(&held, self.conn.options.timeout.min(left)) {
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
                Err(e @ (Error::NamespaceChanged { .. } | Error::NamespaceFailed { .. })) => {
                    self.give_up();
                    return Err(e);
                }
                Err(e) => {
                    log::debug!("reconnect attempt {attempt} failed: {e}");
                    self.session = None;
                    last = Some(e);
                }
            }
        }
        self.give_up();
        Err(Error::ReconnectFailed {
            attempts,
            elapsed: started.elapsed(),
            last: Box::new(last.unwrap_or(Error::ConnectionLost {
                reason: LossReason::NoReconnectAttempt,
            })),
        })
    }

    /// Retires `old` so that nothing it carries lands after this returns. A connection that
    /// broke (queue pair in Error) or that the target closed (its Disconnect: the target
    /// revoked the session's rkeys before sending it) carries nothing more. One that is still
    /// up may deliver late what it holds, so a Read is posted on it (the target answers it
    /// only after every earlier request of that queue pair was executed) and a Disconnect, and
    /// the queue waits for the first of: the Read's answer, the connection's end, and the old
    /// session's keep-alive period (plus a grace) after the last message sent on it, by when
    /// the target has expired the silent session and revoked its rkeys (no keep-alive goes out
    /// meanwhile).
    ///
    /// # Errors
    /// [`Error::ReconnectFailed`] if `deadline` (the reconnect budget) passes first: the held
    /// writes cannot be re-issued safely.
    fn retire(&mut self, mut old: Session, deadline: Instant) -> Result<()> {
        if old.closed.is_some() || old.qp().state() == QpState::Error {
            return Ok(());
        }
        let started = Instant::now();
        let expired_by = old.last_sent + old.keep_alive + EXPIRY_GRACE.max(old.keep_alive / 4);
        // The fence's sink lives in the old protection domain, apart from the queue's buffers.
        let sink = AlignedBuf::new(64).ok();
        let sink_mr = sink
            .as_ref()
            .and_then(|b| old.pd().register(Arc::clone(b), Access::LOCAL_WRITE).ok());
        let fence = match (&sink_mr, self.ns.first()) {
            (Some(mr), Some(n)) => {
                let remote = RemoteAddr {
                    addr: n.desc.remote_addr,
                    rkey: n.desc.rkey,
                };
                let wr = self.waited_wr(SendOp::Read {
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
                    attempts: 0,
                    elapsed: started.elapsed(),
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

    fn give_up(&mut self) {
        self.broken = true;
        self.session = None;
        self.pool.clear();
    }

    fn try_reconnect(&mut self, held: &[(usize, WriteRec)], timeout: Duration) -> Result<()> {
        let s = self.conn.connect_session_within(self.queue_id, timeout)?;
        let peer_flush = s.qp().info().peer_flush;
        for (idx, n) in self.ns.iter_mut().enumerate() {
            let nsid = n.desc.nsid;
            let Some(d) = s.namespace(nsid) else {
                return Err(Error::NamespaceChanged {
                    nsid,
                    what: "it is gone".into(),
                });
            };
            if d.size != n.desc.size || d.read_only != n.desc.read_only {
                return Err(Error::NamespaceChanged {
                    nsid,
                    what: format!(
                        "size {} -> {}, read-only {} -> {}",
                        n.desc.size, d.size, n.desc.read_only, d.read_only
                    ),
                });
            }
            // Held writes on a namespace that failed meanwhile can never be made durable:
            // re-issuing them would only be refused.
            if held.iter().any(|(_, w)| w.ns == idx) {
                check_healthy(d)?;
            }
            n.desc = d.clone();
            n.choice = choice_of(d, peer_flush, n.forced);
        }
        self.pool.rebind(s.pd()).map_err(|source| Error::Fabric {
            op: "registering the bounce buffers",
            source,
        })?;
        self.session = Some(s);
        let wrs: Vec<SendWr> = held
            .iter()
            .map(|&(slot, w)| self.write_wr(slot, w))
            .collect();
        self.post_list(wrs)
    }
}

fn retryable(e: &Error) -> bool {
    e.is_connection_loss()
}
