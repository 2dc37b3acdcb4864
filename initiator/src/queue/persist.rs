//! Durability mechanics: the method each namespace uses, and the requests that make a range
//! durable (an APM or visibility Read, a FLUSH, a GPSPM FlushRequest) and free the held writes
//! they cover.

use std::time::Instant;

use rpma_common::fabric::SendOp;
use rpma_common::proto::{FlushStatus, Message, NamespaceDescriptor};

use super::{NsState, Queue};
use crate::checks::check_healthy;
use crate::durability::{choose, Choice, PersistMethod};
use crate::error::{Error, Result};

impl Queue {
    pub(super) fn describe_all(&self) -> Result<Vec<NsState>> {
        let s = self.session()?;
        let peer_flush = s.qp().info().peer_flush;
        let forced = self.conn.queue.persist;
        Ok(s.namespaces()
            .iter()
            .map(|d| NsState {
                desc: d.clone(),
                choice: choice_of(d, peer_flush, forced),
                forced,
            })
            .collect())
    }

    pub(crate) fn set_forced(&mut self, idx: usize, m: Option<PersistMethod>) {
        let peer_flush = self.peer_has(|i| i.peer_flush);
        let n = &mut self.ns[idx];
        n.forced = m;
        n.choice = choice_of(&n.desc, peer_flush, m);
    }

    pub(crate) fn choice(&self, idx: usize) -> Result<Choice> {
        let n = &self.ns[idx];
        check_healthy(&n.desc)?;
        n.choice.clone().map_err(|(method, offered)| {
            // Rebuild the error with its context (Error is not Clone).
            Error::MethodNotValid {
                nsid: n.desc.nsid,
                method,
                domain: n.desc.domain,
                offered,
            }
        })
    }

    /// The method for making a named range of namespace `idx` durable whoever wrote it
    /// ([`choose_for_range`](crate::durability::choose_for_range): never APM).
    pub(crate) fn range_choice(&self, idx: usize) -> Result<Choice> {
        let n = &self.ns[idx];
        check_healthy(&n.desc)?;
        let peer_flush = self.peer_has(|i| i.peer_flush);
        crate::durability::choose_for_range(&n.desc, peer_flush, n.forced)
    }

    /// The send-queue request that makes the Writes posted before it durable (APM Read,
    /// FLUSH) or visible (a visibility Read) for `[offset, offset + len)` of namespace `ns`;
    /// None for GPSPM, which is a control message.
    pub(crate) fn persist_request(
        &self,
        ns: usize,
        offset: u64,
        len: u64,
        choice: Choice,
    ) -> Option<(&'static str, SendOp)> {
        use rpma_common::fabric::{FlushTarget, FlushType, RemoteAddr};
        let d = &self.ns[ns].desc;
        let at = offset.min(d.size.saturating_sub(8));
        let read = SendOp::Read {
            local: self.sink(),
            remote: RemoteAddr {
                addr: d.remote_addr + at,
                rkey: d.rkey,
            },
        };
        match choice {
            // A Read answers after every earlier Write was placed: they are visible.
            Choice::VisibleOnly => Some(("visibility read", read)),
            Choice::Method(PersistMethod::Apm) => Some(("APM read", read)),
            Choice::Method(PersistMethod::Flush) => {
                let target = if offset == 0 && len == d.size {
                    FlushTarget::Region { rkey: d.rkey }
                } else {
                    FlushTarget::Range {
                        remote: RemoteAddr {
                            addr: d.remote_addr + offset,
                            rkey: d.rkey,
                        },
                        len,
                    }
                };
                Some((
                    "flush",
                    SendOp::Flush {
                        target,
                        kind: FlushType::Persistent,
                    },
                ))
            }
            Choice::Method(PersistMethod::Gpspm) => None,
        }
    }

    /// After the request of [`persist_request`](Self::persist_request) completed: frees the
    /// held writes it covers and says what it achieved.
    pub(crate) fn persisted(
        &mut self,
        ns: usize,
        offset: u64,
        len: u64,
        choice: Choice,
    ) -> crate::Durability {
        use crate::Durability;
        match choice {
            Choice::Method(PersistMethod::Apm) => {
                // Everything placed on this queue pair before the Read is durable.
                self.pool.release_held(ns, 0, 0, true);
                Durability::Durable(PersistMethod::Apm)
            }
            Choice::Method(m) => {
                self.pool.release_held(ns, offset, offset + len, false);
                Durability::Durable(m)
            }
            Choice::VisibleOnly => {
                self.pool.release_held(ns, offset, offset + len, false);
                Durability::VisibleOnly
            }
        }
    }

    /// Makes `[offset, offset + len)` of namespace `ns` durable with `choice`, after every
    /// Write posted before; frees the held writes the acknowledgement covers. With APM that is
    /// only this queue's own Writes: callers that name a range for its own sake choose with
    /// [`range_choice`](Self::range_choice).
    pub(crate) fn persist_range(
        &mut self,
        ns: usize,
        offset: u64,
        len: u64,
        choice: Choice,
    ) -> Result<crate::Durability> {
        self.drain()?;
        if let Some((what, op)) = self.persist_request(ns, offset, len, choice) {
            self.post_and_wait(ns, what, op)?;
            return Ok(self.persisted(ns, offset, len, choice));
        }
        let d = self.ns[ns].desc.clone();
        let whole = offset == 0 && len == d.size;
        let status = self.gpspm(
            ns,
            if whole { 0 } else { offset },
            if whole { 0 } else { len },
        )?;
        match status {
            FlushStatus::Durable => Ok(self.persisted(ns, offset, len, choice)),
            FlushStatus::VisibleOnly => Ok(self.persisted(ns, offset, len, Choice::VisibleOnly)),
            // The target is leaving: retry on the next connection.
            FlushStatus::Unavailable => Err(Error::Disconnected {
                reason: "the target answered a flush with Unavailable".into(),
            }),
            FlushStatus::NamespaceFailed => Err(Error::NamespaceFailed {
                nsid: d.nsid,
                reason: "the target answered a flush with NamespaceFailed".into(),
            }),
            status => Err(Error::NotDurable {
                nsid: d.nsid,
                status,
            }),
        }
    }

    /// Makes every held write durable (or visible, on volatile namespaces) to free their
    /// slots. A namespace whose forced method is not valid gets a visibility Read instead: this
    /// claims nothing to the caller, it only frees the slots.
    pub(super) fn persist_held(&mut self) -> Result<()> {
        for idx in 0..self.ns.len() {
            // Only the span the held writes cover: the whole namespace would cost a persist of
            // all of it (a cache write-back of every line on dax).
            if let Some((start, end)) = self.pool.held_span(idx) {
                // The held writes are this queue's own: APM covers them.
                let choice = self.choice(idx).unwrap_or(Choice::VisibleOnly);
                self.persist_range(idx, start, end - start, choice)?;
            }
        }
        Ok(())
    }

    /// GPSPM: a FlushRequest for the range, and its answer.
    fn gpspm(&mut self, ns: usize, offset: u64, len: u64) -> Result<FlushStatus> {
        self.next_token += 1;
        let token = self.next_token;
        let req = rpma_common::proto::FlushRequest {
            nsid: self.ns[ns].desc.nsid,
            offset,
            length: len,
            token,
        };
        self.doorbells += 1;
        self.session
            .as_mut()
            .ok_or(Error::Broken)?
            .send_message(&Message::FlushRequest(req))?;
        let deadline = Instant::now() + self.conn.options.timeout;
        loop {
            if let Some(i) = self.flush_answers.iter().position(|a| a.0 == token) {
                return Ok(self.flush_answers.swap_remove(i).1);
            }
            self.poll_or_time_out(deadline, "flush response")?;
        }
    }
}

pub(super) fn choice_of(
    d: &NamespaceDescriptor,
    peer_flush: bool,
    forced: Option<PersistMethod>,
) -> std::result::Result<Choice, (PersistMethod, String)> {
    choose(d, peer_flush, forced).map_err(|e| match e {
        Error::MethodNotValid {
            method, offered, ..
        } => (method, offered),
        other => (PersistMethod::Gpspm, other.to_string()),
    })
}
