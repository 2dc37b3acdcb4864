//! What a lost connection does to the engine: the old session taken away (to retire or
//! drop), the unfinished Writes held, a new session installed, and the held writes re-issued
//! on it (only the pieces no newer write took: [`crate::replay`]). What the connection owed is
//! forgotten in mod.rs, beside everything else that touches `reads_done`. The
//! [`Reconnect`](crate::queue::reconnect) state machine drives these steps; the engine only
//! carries them out.

use rpma_common::fabric::{QpState, SendFlags, SendWr};
use rpma_common::proto::NamespaceDescriptor;

use super::Engine;
use crate::error::{Error, Result};
use crate::pool::{Slot, WriteRec};
use crate::queue::completion::{Completed, Ticket};
use crate::replay::Handed;
use crate::session::Session;
use crate::writebuf::Hold;

/// Re-issued Writes posted at once, at most (a send queue takes 256: [`QpCaps`]).
///
/// [`QpCaps`]: rpma_common::fabric::QpCaps
const REISSUE_BATCH: usize = 128;

/// What [`Engine::lose_connection`] hands the reconnect.
pub(in crate::queue) struct Lost {
    /// The old session, to retire or drop.
    pub(in crate::queue) old: Option<Session>,
    /// The held writes in post order, to re-issue.
    pub(in crate::queue) held: Vec<(usize, WriteRec)>,
    /// The holds of the dropped Reads into callers' buffers: let go once `old` is retired or
    /// dropped, not before (a caller's other thread could write from the buffer meanwhile).
    pub(in crate::queue) voided: Vec<Hold>,
}

impl Engine {
    /// Whether the connection is gone: no session, its queue pair in Error, or the target
    /// broke the protocol on it.
    pub(in crate::queue) fn needs_reconnect(&self) -> bool {
        match &self.session {
            Some(s) => s.qp().state() == QpState::Error || s.violated.is_some(),
            None => true,
        }
    }

    /// Why [`needs_reconnect`](Self::needs_reconnect) says so, for the error a failed reconnect
    /// reports: the queue pair's failure, with its causes.
    pub(in crate::queue) fn why_lost(&self) -> String {
        if let Some(what) = self.session.as_ref().and_then(|s| s.violated.clone()) {
            return format!("the target broke the protocol: {what}");
        }
        match self.session.as_ref().map(|s| s.qp().error()) {
            Some(Some(f)) => rpma_common::error_chain(&f),
            Some(None) => "the queue pair failed".into(),
            None => "an earlier call gave the connection up".into(),
        }
    }

    /// The connection is lost (or given up): unfinished Writes become held, Reads in flight
    /// are dropped ([`Pool::on_connection_lost`](crate::pool::Pool::on_connection_lost)).
    /// Returns the old session, to retire or drop, the held writes in post order, to re-issue
    /// on the next connection ([`reissue`](Self::reissue)), and the holds of the dropped Reads
    /// into callers' buffers, to let go once the old session is retired or dropped (until then
    /// it may still place their bytes).
    pub(in crate::queue) fn lose_connection(&mut self) -> Lost {
        let (held, voided) = self.pool.on_connection_lost();
        self.forget_placement();
        Lost {
            old: self.session.take(),
            held,
            voided,
        }
    }

    /// Namespace `idx` as the new connection addresses it.
    pub(in crate::queue) fn set_descriptor(&mut self, idx: usize, d: NamespaceDescriptor) {
        self.descs[idx] = d;
        self.gone[idx] = false;
    }

    /// The new connection does not list namespace `idx` (a reload removed it). It keeps its
    /// index (the others' do not shift), without an address or rkey: nothing is posted to it,
    /// and no handle is given out for it ([`index_of`](Self::index_of)).
    pub(in crate::queue) fn set_gone(&mut self, idx: usize) {
        let d = &mut self.descs[idx];
        d.remote_addr = 0;
        d.rkey = 0;
        d.unavailable = Some("the target no longer lists it".into());
        self.gone[idx] = true;
    }

    /// Makes `session` the engine's connection: registers the bounce buffers in its
    /// protection domain.
    ///
    /// # Errors
    /// [`Error::Fabric`] if the registration fails (the session is dropped).
    pub(in crate::queue) fn install(&mut self, session: Session) -> Result<()> {
        self.pool
            .rebind(session.pd())
            .map_err(|source| Error::Fabric {
                op: "registering the bounce buffers",
                source,
            })?;
        self.session = Some(session);
        Ok(())
    }

    /// Re-issues the held writes of [`lose_connection`](Self::lose_connection), in post
    /// order: of each, the pieces that no newer write of this queue or of another queue of the
    /// connection wrote since ([`crate::replay`]). A write split in pieces completes once, with
    /// its last piece (the others are unsignaled; one queue pair completes in order). One with
    /// no piece left is not re-issued: its slot is free again, and a started Write the caller
    /// waits to hear of completes now. The bytes newer writes of other queues took are this
    /// queue's to vouch for in its next persist of its own writes ([`Pool::hand_over`]).
    ///
    /// They go out [`REISSUE_BATCH`] Writes at a time, each batch once the one before it
    /// completed: a queue may hold far more writes than its send queue takes (the job runner's
    /// holds 64 MiB), and a post of all of them at once was refused. A refused post leaves the
    /// slots as they were, for the next attempt (never freed: those writes are not durable).
    ///
    /// [`Pool::hand_over`]: crate::pool::Pool::hand_over
    pub(in crate::queue) fn reissue(&mut self, held: &[(usize, WriteRec)]) -> Result<()> {
        self.pool.reissuing();
        let mut batch: Vec<(usize, WriteRec, Vec<SendWr>)> = Vec::new();
        let mut wrs = 0;
        for &(slot, w) in held {
            // An earlier attempt of this reconnect may have let it go already.
            if !self.pool.carries(slot, &w) {
                continue;
            }
            let pieces = self.pool.replay_pieces(&w);
            self.pool.hand_over(&w, &pieces);
            let Some((&(start, end), rest)) = pieces.split_last() else {
                if w.notify {
                    self.started_done.push(Completed::Write(Ticket(w.seq)));
                }
                self.pool.set(slot, Slot::Free);
                continue;
            };
            // A write in more pieces than a batch takes (another queue rewrote many small
            // places of it since): all but its last batch of pieces go out first, a batch at a
            // time (`post_pieces`); posted as one list they were refused.
            let mut rest = rest;
            if rest.len() >= REISSUE_BATCH {
                self.post_reissued(std::mem::take(&mut batch))?;
                wrs = 0;
                while rest.len() >= REISSUE_BATCH {
                    let (group, more) = rest.split_at(REISSUE_BATCH);
                    self.post_pieces(slot, w, group)?;
                    rest = more;
                }
            }
            let mut these = self.unsignaled_pieces(slot, w, rest);
            these.push(self.piece_wr(slot, w, start, end));
            if wrs + these.len() > REISSUE_BATCH && !batch.is_empty() {
                self.post_reissued(std::mem::take(&mut batch))?;
                wrs = 0;
            }
            wrs += these.len();
            batch.push((slot, w, these));
        }
        self.post_reissued(batch)?;
        self.pool.reissued();
        Ok(())
    }

    /// What the persist of this queue's own writes of namespace `ns` owes for the bytes its
    /// re-issues let go to newer writes of other queues ([`Handed`]).
    pub(in crate::queue) fn handed(&self, ns: usize) -> Handed {
        self.pool.handed(ns)
    }

    /// A persist of this queue's own writes of namespace `ns` covered what it owed.
    pub(in crate::queue) fn settle_handed(&mut self, ns: usize) {
        self.pool.settle_handed(ns);
    }

    /// The loss of bytes this queue let go on namespace `ns` was reported.
    pub(in crate::queue) fn lost_reported(&mut self, ns: usize) {
        self.pool.lost_reported(ns);
    }

    /// The writes of namespace `ns` this queue carries are let go unpersisted (their slots
    /// freed after a visibility Read only): call before they are released.
    pub(in crate::queue) fn lose_writes(&mut self, ns: usize) {
        self.pool.lose_writes(Some(ns));
    }

    /// Asks the queues `ids` of the connection to learn their placement soon.
    pub(in crate::queue) fn want_placed(&self, ids: &[u64]) {
        self.pool.want_placed(ids);
    }

    /// Posts `pieces` of the held write `w` in `slot` behind one doorbell once nothing is in
    /// flight, and waits until they completed: all unsignaled but the last, which completes
    /// under a waited id of its own (the slot's completion is its last piece's, posted later).
    fn post_pieces(&mut self, slot: usize, w: WriteRec, pieces: &[(u64, u64)]) -> Result<()> {
        let Some((&(s, e), rest)) = pieces.split_last() else {
            return Ok(());
        };
        let mut wrs = self.unsignaled_pieces(slot, w, rest);
        let last = self.piece_wr(slot, w, s, e);
        let last = self.waited_wr(last.op);
        let id = last.wr_id;
        wrs.push(last);
        self.post_when_drained(wrs)?;
        self.wait_for_request(w.ns, "re-issued write", id)
    }

    /// Writes of `pieces` of the held write `w` in `slot`, none signaled.
    fn unsignaled_pieces(&self, slot: usize, w: WriteRec, pieces: &[(u64, u64)]) -> Vec<SendWr> {
        pieces
            .iter()
            .map(|&(s, e)| self.piece_wr(slot, w, s, e).with_flags(SendFlags::empty()))
            .collect()
    }

    /// Posts `wrs` behind one doorbell once nothing is in flight.
    fn post_when_drained(&mut self, wrs: Vec<SendWr>) -> Result<()> {
        self.drain()?;
        self.wait_fence()?;
        self.doorbells += 1;
        let s = self.session()?;
        s.qp()
            .post_send_list(wrs)
            .map_err(|e| super::post::post_error(s, e))
    }

    /// Posts re-issued Writes, behind one doorbell, once nothing is in flight.
    fn post_reissued(&mut self, mut batch: Vec<(usize, WriteRec, Vec<SendWr>)>) -> Result<()> {
        if batch.is_empty() {
            return Ok(());
        }
        let mut wrs = Vec::with_capacity(batch.len());
        for (_, _, w) in &mut batch {
            wrs.append(w);
        }
        self.post_when_drained(wrs)?;
        for (slot, w, _) in batch {
            self.pool.set(slot, Slot::Writing(w));
            self.writes_posted += 1;
        }
        self.note_posted();
        Ok(())
    }

    /// The queue gave up: no connection, every held write dropped, nothing left to post.
    pub(in crate::queue) fn give_up(&mut self) {
        self.session = None;
        self.pool.clear();
        self.forget_owed();
    }
}
