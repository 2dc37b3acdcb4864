//! Durability mechanics: the method each namespace uses, and the requests that make a range
//! durable (an APM or visibility Read, a FLUSH, a GPSPM FlushRequest) and free the held writes
//! they cover.

use std::time::Instant;

use rpma_common::fabric::{SendOp, SendWr};
use rpma_common::proto::{
    DurabilityMethods, FlushStatus, Message, NamespaceDescriptor, PersistenceDomain,
};

use super::{NsState, Queue};
use crate::checks::check_healthy;
use crate::durability::{choose_method, Choice, MethodNotValid, PersistMethod};
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
        n.choice.clone().map_err(Error::from)
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
        if choice != Choice::Method(PersistMethod::Gpspm) {
            return self.write_and_persist(ns, &[], &[(offset, offset + len)], choice);
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
    ///
    /// What it persists is the held writes' own ranges, never the span between them: a FLUSH
    /// (or a GPSPM request on dax) of the span of random writes would write back every cache
    /// line in between, milliseconds for writes scattered over 64 MiB.
    pub(super) fn persist_held(&mut self) -> Result<()> {
        for idx in 0..self.ns.len() {
            let ranges = self.pool.held_ranges(idx);
            if ranges.is_empty() {
                continue;
            }
            let choice = self.held_choice(idx).unwrap_or(Choice::VisibleOnly);
            self.persist_ranges(idx, &ranges, choice)?;
        }
        Ok(())
    }

    /// Makes durable every write this queue posted to namespace `idx` that is not durable yet
    /// (the ones it holds for a replay), with [`held_choice`](Self::held_choice).
    pub(crate) fn persist_own(&mut self, idx: usize) -> Result<crate::Durability> {
        let choice = self.held_choice(idx)?;
        let ranges = self.pool.held_ranges(idx);
        self.persist_ranges(idx, &ranges, choice)
    }

    /// The method for this queue's own held writes of namespace `idx`: the namespace's, except
    /// that where the target offers APM on a dax namespace and no method was forced, APM: one
    /// Read makes them all durable, and the target writes back only the lines they placed (its
    /// dirty list), where a FLUSH per scattered range costs a request each.
    pub(crate) fn held_choice(&self, idx: usize) -> Result<Choice> {
        let c = self.choice(idx)?;
        let apm = Choice::Method(PersistMethod::Apm);
        if c != apm
            && c != Choice::VisibleOnly
            && self.ns[idx].forced.is_none()
            && self.apm_for_held(idx)
        {
            return Ok(apm);
        }
        Ok(c)
    }

    /// Whether APM may stand in for the chosen method to free held writes of namespace `idx`:
    /// the target offers it, and the namespace is dax (on page-cache APM would make the
    /// target msync in its poll loop, which the default choice of GPSPM avoids).
    fn apm_for_held(&self, idx: usize) -> bool {
        let d = &self.ns[idx].desc;
        matches!(
            d.domain,
            PersistenceDomain::Dax | PersistenceDomain::DaxForced
        ) && d.durability.contains(DurabilityMethods::APM)
    }

    /// The send-queue requests that make the sorted, disjoint `ranges` of namespace `ns`
    /// durable (or visible) after the Writes posted before them, with their wr_ids: one Read
    /// for APM and visibility (it covers every earlier Write of this queue pair), one Flush per
    /// range for FLUSH (never their span: a Flush of the span between scattered writes would
    /// write back every cache line in between); none for GPSPM, a control message
    /// ([`gpspm_ranges`](Self::gpspm_ranges) after the Writes completed).
    pub(crate) fn persist_requests(
        &mut self,
        ns: usize,
        ranges: &[(u64, u64)],
        choice: Choice,
    ) -> Vec<(&'static str, SendWr)> {
        let one = matches!(
            choice,
            Choice::VisibleOnly | Choice::Method(PersistMethod::Apm)
        );
        let mut out = Vec::new();
        for &(lo, hi) in ranges {
            if let Some((what, op)) = self.persist_request(ns, lo, hi - lo, choice) {
                out.push((what, self.waited_wr(op)));
            }
            if one {
                break;
            }
        }
        out
    }

    /// Waits for the requests of [`persist_requests`](Self::persist_requests) (posted), then
    /// frees the held writes in `ranges` and says what they achieved.
    pub(crate) fn await_persisted(
        &mut self,
        ns: usize,
        ranges: &[(u64, u64)],
        choice: Choice,
        requests: &[(&'static str, u64)],
    ) -> Result<crate::Durability> {
        for &(what, id) in requests {
            self.wait_for_request(ns, what, id)?;
        }
        let mut out = match choice {
            Choice::Method(m) => crate::Durability::Durable(m),
            Choice::VisibleOnly => crate::Durability::VisibleOnly,
        };
        for &(lo, hi) in ranges {
            out = self.persisted(ns, lo, hi - lo, choice);
        }
        Ok(out)
    }

    /// Makes the sorted, disjoint `ranges` of namespace `ns` durable with `choice`, after every
    /// Write posted before, and frees the held writes they cover: the requests of
    /// [`persist_requests`](Self::persist_requests) behind one doorbell, or GPSPM's.
    pub(crate) fn persist_ranges(
        &mut self,
        ns: usize,
        ranges: &[(u64, u64)],
        choice: Choice,
    ) -> Result<crate::Durability> {
        self.drain()?;
        self.write_and_persist(ns, &[], ranges, choice)
    }

    /// Posts the Writes of `items` to namespace `ns` and makes the sorted, disjoint `ranges`
    /// durable with `choice` after them: the requests of
    /// [`persist_requests`](Self::persist_requests) behind the last Writes with one doorbell,
    /// or, for GPSPM, the FlushRequest(s) once the Writes completed.
    pub(crate) fn write_and_persist(
        &mut self,
        ns: usize,
        items: &[(u64, &[u8])],
        ranges: &[(u64, u64)],
        choice: Choice,
    ) -> Result<crate::Durability> {
        if choice == Choice::Method(PersistMethod::Gpspm) {
            self.post_writes(ns, items, Vec::new())?;
            self.drain()?;
            return self.gpspm_ranges(ns, ranges);
        }
        let reqs = self.persist_requests(ns, ranges, choice);
        let ids: Vec<(&'static str, u64)> = reqs.iter().map(|(w, r)| (*w, r.wr_id)).collect();
        self.post_writes(ns, items, reqs.into_iter().map(|(_, r)| r).collect())?;
        self.await_persisted(ns, ranges, choice, &ids)
    }

    /// GPSPM for the sorted, disjoint `ranges` after every Write posted before completed: their
    /// span on page-cache (a ranged fdatasync writes back only the dirty pages in it, where one
    /// per range would each pay the filesystem's sync), a request per range elsewhere (the
    /// target's write-back of a dax span would cover every line in between).
    pub(crate) fn gpspm_ranges(
        &mut self,
        ns: usize,
        ranges: &[(u64, u64)],
    ) -> Result<crate::Durability> {
        let choice = Choice::Method(PersistMethod::Gpspm);
        let (Some(first), Some(last)) = (ranges.first(), ranges.last()) else {
            return Ok(crate::Durability::Durable(PersistMethod::Gpspm));
        };
        if self.ns[ns].desc.domain == PersistenceDomain::PageCache {
            return self.persist_range(ns, first.0, last.1 - first.0, choice);
        }
        let mut out = crate::Durability::Durable(PersistMethod::Gpspm);
        for &(lo, hi) in ranges {
            out = self.persist_range(ns, lo, hi - lo, choice)?;
        }
        Ok(out)
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

/// The method for durable calls on `d`, or the refusal of a forced one, kept typed.
pub(super) fn choice_of(
    d: &NamespaceDescriptor,
    peer_flush: bool,
    forced: Option<PersistMethod>,
) -> std::result::Result<Choice, MethodNotValid> {
    choose_method(d, peer_flush, forced)
}
