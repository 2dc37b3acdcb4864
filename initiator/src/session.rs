//! [`Session`]: a connected, admitted queue pair to a target's subsystem, with its namespace
//! descriptors and the fabric objects the data path runs on.
//!
//! # Progress and keep-alive
//!
//! There is no hidden thread. The session's control messages (keep-alive echoes, flush
//! responses, a Disconnect) arrive as receive completions on the session's completion queue,
//! which the caller polls anyway for its own work requests. Completions whose wr_id has
//! [`CONTROL_BIT`] set belong to the session: hand them to [`Session::handle`]. The blocking
//! helpers ([`Session::wait_message`], [`Session::flush`]) poll the queue themselves and keep
//! any other completion for [`Session::take_completions`].
//!
//! Keep-alive: the target closes a session that sends nothing for its keep-alive period
//! ([`Session::keep_alive`]). Call [`Session::tick`] from the polling loop at least every half
//! period (or whenever [`Session::keep_alive_due`] says so): it sends a KeepAlive when one is due
//! and reports a target that stopped answering.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use rpma_common::fabric::{
    Completion, CompletionQueue, Context, ProtectionDomain, QpState, QueuePair, WcStatus,
};
use rpma_common::proto::{
    Disconnect, FlushRequest, FlushStatus, KeepAlive, Message, NamespaceDescriptor,
};

use crate::error::{Error, LossReason, Result};
use rpma_common::proto::msgbuf::{MsgBufs, CONTROL_BIT, SEND_BIT};

/// A session with a subsystem (or with the discovery subsystem).
pub struct Session {
    pub(crate) ctx: Context,
    pub(crate) pd: ProtectionDomain,
    pub(crate) cq: CompletionQueue,
    pub(crate) qp: QueuePair,
    pub(crate) bufs: MsgBufs,
    pub(crate) url: String,
    pub(crate) controller_id: u16,
    pub(crate) keep_alive: Duration,
    pub(crate) queue_depth: u32,
    pub(crate) namespaces: Vec<NamespaceDescriptor>,
    pub(crate) inbox: VecDeque<Message>,
    pub(crate) other: VecDeque<Completion>,
    pub(crate) last_sent: Instant,
    pub(crate) last_heard: Instant,
    pub(crate) seq: u64,
    /// The newest KeepAlive the target echoed (its `seq`): every request posted before that
    /// KeepAlive was executed (placed) by then.
    pub(crate) echoed: u64,
    pub(crate) next_token: u64,
    pub(crate) closed: Option<String>,
    /// Admitted by a ConnectResponse and not said goodbye to: dropping it sends a Disconnect.
    pub(crate) admitted: bool,
    /// The target broke the protocol on the data path (a control message this host cannot
    /// decode): the connection is given up, and retired first (the target did not close it).
    pub(crate) violated: Option<String>,
    /// The last received message's bytes, kept for the next (a GPSPM answer per durable write
    /// allocates nothing).
    pub(crate) rx: Vec<u8>,
}

/// Text the target wrote (a refusal's message, a Disconnect's reason, a namespace's failure or
/// why it is unavailable), as this host shows it: every character that would break a line, move
/// the cursor or hide text escaped (`\n`, `\u{1b}`), so that it cannot forge a line of the
/// caller's log or drive its terminal.
pub(crate) fn target_text(s: &str) -> String {
    rpma_common::logline::escape(s)
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("url", &self.url)
            .field("controller_id", &self.controller_id)
            .field("keep_alive", &self.keep_alive)
            .field("namespaces", &self.namespaces.len())
            .field("qp", &self.qp)
            .finish()
    }
}

impl Session {
    /// The target URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The controller id the target assigned (0 on a discovery connection).
    pub fn controller_id(&self) -> u16 {
        self.controller_id
    }

    /// The keep-alive period the target enforces.
    pub fn keep_alive(&self) -> Duration {
        self.keep_alive
    }

    /// The queue depth the target granted: the most FlushRequests this host may have
    /// outstanding at once on this connection (0 on a discovery connection).
    pub fn queue_depth(&self) -> u32 {
        self.queue_depth
    }

    /// The namespaces this host may reach, by ascending nsid.
    pub fn namespaces(&self) -> &[NamespaceDescriptor] {
        &self.namespaces
    }

    /// One namespace.
    pub fn namespace(&self, nsid: u32) -> Option<&NamespaceDescriptor> {
        self.namespaces.iter().find(|n| n.nsid == nsid)
    }

    /// The queue pair: post the data path's Writes, Reads and Flushes here, with wr_ids that do
    /// not have [`CONTROL_BIT`] set.
    pub fn qp(&self) -> &QueuePair {
        &self.qp
    }

    /// The protection domain: register the data path's local buffers here.
    pub fn pd(&self) -> &ProtectionDomain {
        &self.pd
    }

    /// The completion queue of the queue pair (send and receive).
    pub fn cq(&self) -> &CompletionQueue {
        &self.cq
    }

    /// The device.
    pub fn context(&self) -> &Context {
        &self.ctx
    }

    /// Whether a KeepAlive should be sent now (half the period passed since the last message).
    pub fn keep_alive_due(&self) -> bool {
        self.last_sent.elapsed() >= self.keep_alive / 2
    }

    /// Sends a KeepAlive if one is due. Never blocks.
    ///
    /// # Errors
    /// [`Error::Disconnected`] / [`Error::ConnectionLost`] if the session is over,
    /// [`Error::KeepAliveLost`] if the target was silent for twice its keep-alive period,
    /// [`Error::Fabric`] if the send cannot be posted.
    pub fn tick(&mut self) -> Result<()> {
        self.check_open()?;
        let silent = self.last_heard.elapsed();
        if silent > self.keep_alive * 2 {
            return Err(Error::KeepAliveLost { silent });
        }
        if self.keep_alive_due() {
            self.seq += 1;
            let ka = KeepAlive { seq: self.seq };
            self.send_bytes(&ka.encode())?;
        }
        Ok(())
    }

    /// Sends a KeepAlive now, due or not, and returns its `seq`: once the target echoed it
    /// ([`echoed`](Self::echoed)), every request posted on the queue pair before it was
    /// executed (a Send is delivered only after the Writes before it were placed). Its echo
    /// is a receive: unlike a Read, it holds no later Write's completion back.
    ///
    /// # Errors
    /// As [`tick`](Self::tick).
    pub(crate) fn probe(&mut self) -> Result<u64> {
        self.check_open()?;
        self.seq += 1;
        let ka = KeepAlive { seq: self.seq };
        self.send_bytes(&ka.encode())?;
        Ok(self.seq)
    }

    /// The newest KeepAlive `seq` the target echoed.
    pub(crate) fn echoed(&self) -> u64 {
        self.echoed
    }

    fn check_open(&self) -> Result<()> {
        if let Some(reason) = &self.closed {
            return Err(Error::Disconnected {
                reason: reason.clone(),
            });
        }
        if self.qp.state() == QpState::Error {
            return Err(Error::ConnectionLost {
                reason: LossReason::of(&self.qp),
            });
        }
        Ok(())
    }

    pub(crate) fn send_bytes(&mut self, bytes: &[u8]) -> Result<()> {
        self.bufs
            .send(&self.qp, bytes)
            .map_err(|source| Error::Fabric {
                op: "sending a control message",
                source,
            })?;
        self.last_sent = Instant::now();
        Ok(())
    }

    /// Sends a control message (e.g. a [`FlushRequest`] of the data path). Never blocks: it goes
    /// out now or as soon as a send slot is free.
    ///
    /// # Errors
    /// [`Error::Encode`], [`Error::Fabric`], and those of a closed session.
    pub fn send_message(&mut self, m: &Message) -> Result<()> {
        self.check_open()?;
        let bytes = m.encode().map_err(Error::Encode)?;
        // A caller's own tokens and sequence numbers count as sent: their answers and echoes
        // are the protocol's (`handle`), and the session's own go on above them.
        match m {
            Message::FlushRequest(r) => self.next_token = self.next_token.max(r.token),
            Message::KeepAlive(k) => self.seq = self.seq.max(k.seq),
            _ => {}
        }
        self.send_bytes(&bytes)
    }

    /// Handles a completion whose wr_id has [`CONTROL_BIT`] set. Returns a received message the
    /// caller should act on (a FlushResponse, a DiscoveryResponse...); keep-alive echoes are
    /// consumed here.
    ///
    /// # Errors
    /// [`Error::Disconnected`] when the target closed the session (its reason), [`Error::Decode`]
    /// for a malformed message, [`Error::Completion`] for a failed control request,
    /// [`Error::ConnectionLost`].
    pub fn handle(&mut self, c: &Completion) -> Result<Option<Message>> {
        if c.wr_id & SEND_BIT != 0 {
            let _ = self.bufs.on_send_done(&self.qp, c.wr_id);
            if c.status != WcStatus::Success {
                return Err(self.lost_or(Error::Completion {
                    what: "send",
                    status: c.status,
                }));
            }
            return Ok(None);
        }
        if c.status != WcStatus::Success {
            return Err(self.lost_or(Error::Completion {
                what: "receive",
                status: c.status,
            }));
        }
        let mut buf = std::mem::take(&mut self.rx);
        let slot = self.bufs.take(c, &mut buf);
        let decoded = slot.map(|_| Message::decode(&buf));
        self.rx = buf;
        let (Some(slot), Some(decoded)) = (slot, decoded) else {
            return Ok(None);
        };
        let _ = self.qp.post_recv(self.bufs.recv_wr(slot));
        self.last_heard = Instant::now();
        match decoded.map_err(Error::Decode)? {
            // Only echoes of this host's own: an echo of one it never sent would mark requests
            // as executed that were not (`echoed`), an answer to a FlushRequest it never sent
            // would be taken for the next one's.
            Message::KeepAlive(k) if k.seq > self.seq => Err(self.broke(format!(
                "an echo of KeepAlive {} (this host sent {} so far)",
                k.seq, self.seq
            ))),
            Message::FlushResponse(r) if r.token > self.next_token => Err(self.broke(format!(
                "an answer to FlushRequest {} (this host sent {} so far)",
                r.token, self.next_token
            ))),
            Message::KeepAlive(k) => {
                self.echoed = self.echoed.max(k.seq);
                Ok(None)
            }
            Message::Disconnect(Disconnect { reason }) => {
                let reason = target_text(&reason);
                self.closed = Some(reason.clone());
                Err(Error::Disconnected { reason })
            }
            m => Ok(Some(m)),
        }
    }

    /// The target broke the protocol (`what`): the connection is not trusted on; a data path's
    /// queue gives it up and reconnects.
    fn broke(&mut self, what: String) -> Error {
        self.violated = Some(what.clone());
        Error::ConnectionLost {
            reason: LossReason::Protocol(what),
        }
    }

    /// A closed session's Disconnect reason beats the flush error it caused.
    fn lost_or(&self, e: Error) -> Error {
        if let Some(reason) = &self.closed {
            return Error::Disconnected {
                reason: reason.clone(),
            };
        }
        if self.qp.state() == QpState::Error {
            return Error::ConnectionLost {
                reason: LossReason::of(&self.qp),
            };
        }
        e
    }

    /// Completions of the caller's own work requests that the blocking helpers reaped.
    pub fn take_completions(&mut self) -> Vec<Completion> {
        self.other.drain(..).collect()
    }

    /// Waits up to `timeout` for the next control message, polling the completion queue (and
    /// keeping other completions for [`take_completions`](Self::take_completions)).
    ///
    /// # Errors
    /// [`Error::Timeout`], and those of [`handle`](Self::handle).
    pub fn wait_message(&mut self, timeout: Duration, what: &'static str) -> Result<Message> {
        let deadline = crate::deadline::after(timeout);
        let mut wcs = [Completion::EMPTY; 16];
        loop {
            if let Some(m) = self.inbox.pop_front() {
                return Ok(m);
            }
            // Messages the target sent before it closed may still sit in the CQ behind the
            // close: a closed session drains them (without blocking) before reporting the close.
            let open = self.check_open();
            let now = Instant::now();
            let n = if open.is_err() {
                self.cq.poll(&mut wcs)
            } else if now >= deadline {
                return Err(Error::Timeout {
                    what,
                    after: timeout,
                });
            } else {
                self.cq.wait(&mut wcs, Some(deadline - now))
            }
            .map_err(crate::error::wait_error)?;
            if n == 0 {
                open?;
                continue;
            }
            // Handle the whole batch: a Disconnect or a failed completion must not drop the
            // messages that arrived with it. The close itself is kept in the session's state
            // (`check_open` reports it once the inbox is empty).
            let mut deferred = None;
            for c in &wcs[..n] {
                if c.wr_id & CONTROL_BIT == 0 {
                    self.other.push_back(*c);
                    continue;
                }
                match self.handle(c) {
                    Ok(Some(m)) => self.inbox.push_back(m),
                    Ok(None) => {}
                    Err(
                        e @ (Error::Decode(_)
                        | Error::ConnectionLost {
                            reason: LossReason::Protocol(_),
                        }),
                    ) => return Err(e),
                    Err(e) => {
                        deferred.get_or_insert(e);
                    }
                }
            }
            if self.inbox.is_empty() {
                if let Some(e) = deferred {
                    return Err(e);
                }
            }
        }
    }

    /// Sends a GPSPM FlushRequest for `length` bytes at `offset` of `nsid` (length 0: the whole
    /// namespace) and returns its token, which its FlushResponse carries: the caller waits for
    /// it, in [`flush`](Self::flush) or on the data path's completion queue.
    ///
    /// # Errors
    /// Those of [`send_message`](Self::send_message).
    pub(crate) fn send_flush_request(
        &mut self,
        nsid: u32,
        offset: u64,
        length: u64,
    ) -> Result<u64> {
        self.next_token += 1;
        let token = self.next_token;
        let req = FlushRequest {
            nsid,
            offset,
            length,
            token,
        };
        self.check_open()?;
        self.send_bytes(&req.encode())?;
        Ok(token)
    }

    /// GPSPM: asks the target to make `length` bytes at `offset` of `nsid` durable (length 0:
    /// the whole namespace) and waits for its answer. The Writes to make durable must have been
    /// posted on [`qp`](Self::qp) before.
    ///
    /// # Errors
    /// [`Error::Timeout`], [`Error::Unexpected`] for another message, and those of
    /// [`send_message`](Self::send_message) and [`handle`](Self::handle). A status other than
    /// `Durable` is not an error here: the caller decides what `VisibleOnly` means to it.
    pub fn flush(
        &mut self,
        nsid: u32,
        offset: u64,
        length: u64,
        timeout: Duration,
    ) -> Result<FlushStatus> {
        let token = self.send_flush_request(nsid, offset, length)?;
        // One deadline for the whole wait, however many other messages come meanwhile.
        let deadline = crate::deadline::after(timeout);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let m = self
                .wait_message(left, "flush response")
                .map_err(|e| match e {
                    Error::Timeout { what, .. } => Error::Timeout {
                        what,
                        after: timeout,
                    },
                    e => e,
                })?;
            match m {
                Message::FlushResponse(r) if r.token == token => return Ok(r.status),
                // An answer to an earlier request (one that timed out): dropped. (One to a
                // later request, never sent, broke the protocol: `handle`.)
                Message::FlushResponse(_) => continue,
                other => {
                    return Err(Error::Unexpected {
                        expected: "FlushResponse",
                        got: other.message_type(),
                    })
                }
            }
        }
    }

    /// Sends a Disconnect and closes the connection once it is out (at most `timeout`).
    /// Dropping a session does the same with a short wait ([`DROP_GOODBYE`]).
    ///
    /// # Errors
    /// None that matter to a caller closing anyway: the connection is closed in every case; an
    /// error says the target may not have read the goodbye.
    pub fn disconnect(mut self, timeout: Duration) -> Result<()> {
        self.goodbye(timeout)
    }

    /// The Disconnect, if the session is still open. Clears `admitted`, so that the Drop that
    /// follows does not say it twice.
    fn goodbye(&mut self, timeout: Duration) -> Result<()> {
        self.admitted = false;
        if self.closed.is_some() || self.qp.state() == QpState::Error {
            return Ok(());
        }
        let bye = Message::Disconnect(Disconnect {
            reason: "host disconnecting".into(),
        });
        self.send_message(&bye)?;
        let deadline = crate::deadline::after(timeout);
        let mut wcs = [Completion::EMPTY; 16];
        while self.bufs.unsent() > 0 && Instant::now() < deadline {
            let n = self
                .cq
                .wait(&mut wcs, Some(Duration::from_millis(10)))
                .map_err(|source| Error::Fabric {
                    op: "waiting for completions",
                    source,
                })?;
            for c in &wcs[..n] {
                if c.wr_id & CONTROL_BIT != 0 && c.wr_id & SEND_BIT != 0 {
                    let _ = self.bufs.on_send_done(&self.qp, c.wr_id);
                }
            }
        }
        Ok(())
    }
}

/// How long dropping an open session waits for its Disconnect to go out.
pub const DROP_GOODBYE: Duration = Duration::from_millis(250);

impl Drop for Session {
    /// Says goodbye (a Disconnect) unless that was done or the connection is gone, so that
    /// every exit path (an error, a panic, an early return) closes the session cleanly.
    fn drop(&mut self) {
        // A session that was never admitted (an error inside `connect`) owes nothing.
        if self.admitted {
            let _ = self.goodbye(DROP_GOODBYE);
        }
    }
}
