//! Reconnect: running a call so that a lost connection is reconnected with the policy's
//! backoff, the held writes re-issued and the call re-run (or its loss reported).

use std::time::{Duration, Instant};

use rpma_common::fabric::{QpState, SendWr};

use super::persist::choice_of;
use super::Queue;
use crate::checks::check_healthy;
use crate::error::{Error, Result};
use crate::pool::WriteRec;

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
                self.reconnect(d)?;
            }
            match op(self) {
                Err(e) if retryable(&e) => {
                    let d = *deadline.get_or_insert_with(|| Instant::now() + budget);
                    self.reconnect(d)?;
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

    /// Reconnects with the policy's backoff; no attempt starts after `deadline`.
    fn reconnect(&mut self, deadline: Instant) -> Result<()> {
        let started = Instant::now();
        if let Some(s) = self.session.take() {
            drop(s);
        }
        let held = self.pool.on_connection_lost();
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
            last: Box::new(last.unwrap_or_else(|| Error::ConnectionLost {
                detail: "the reconnect policy allowed no attempt".into(),
            })),
        })
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
