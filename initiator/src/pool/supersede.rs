//! A new write of the same bytes as a held write: the held one is no longer needed for a
//! replay once the new one is posted, and only then is its slot freed (never before: the
//! bytes would be held by neither write for a moment, or for good if the post is refused).

use smallvec::SmallVec;

use super::{Pool, Slot, WriteRec};

impl Pool {
    /// A new write `w` (not a re-issue) is about to be posted: an older held write of the same
    /// namespace that it covers whole, starting at the same offset, is no longer needed for a
    /// replay (the replay re-issues `w`, in post order, over the same bytes), so its slot is
    /// freed. This is what lets a pool of held writes absorb a working set it can hold without
    /// a persist: rewriting a block frees its older copy. A held write whose completion the
    /// caller still waits to hear of (a started Write to be re-issued) stays. Returns whether
    /// one was freed.
    /// (For the tests: the engine frees that slot only once the new write is posted:
    /// [`superseded`](Self::superseded), [`supersede_when_posted`](Self::supersede_when_posted).)
    #[cfg(test)]
    pub(crate) fn supersede(&mut self, w: &WriteRec) -> bool {
        match self.superseded(w) {
            Some(p) => {
                self.set(p, Slot::Free);
                true
            }
            None => false,
        }
    }

    /// The slot of the held write that `w` supersedes ([`supersede`](Self::supersede)), left
    /// as it is: for a caller that frees it once `w` is registered and posted, so that the
    /// bytes are never held by neither (an heir would take that for a release, and a post
    /// refused would leave them to nobody).
    pub(crate) fn superseded(&self, w: &WriteRec) -> Option<usize> {
        let &p = self.latest.get(&(w.ns, w.offset))?;
        match self.slots[p] {
            Slot::Held(o) if !o.notify && o.len <= w.len && o.seq < w.seq => Some(p),
            _ => None,
        }
    }

    /// The write `w` in `slot` supersedes the held write in `old` ([`superseded`]): `old` is
    /// freed once `w` is posted ([`settle_superseded`](Self::settle_superseded)).
    pub(crate) fn supersede_when_posted(&mut self, slot: usize, w: &WriteRec, old: usize) {
        if let Some(o) = self.slots[old].write() {
            self.superseding.push((slot, w.seq, old, o.seq));
        }
    }

    /// The writes in `posted` were posted: the held writes they supersede are freed (and
    /// those of new writes that completed, so were posted). Those of new writes no slot
    /// carries any more (a refused post freed them: [`unpost_write`](Self::unpost_write)) stay
    /// held: this queue's persist covers them.
    pub(crate) fn settle_superseded(&mut self, posted: &[usize]) {
        if self.superseding.is_empty() {
            return;
        }
        let mut free = SmallVec::<[usize; 4]>::new();
        let slots = &self.slots;
        self.superseding.retain(|&(new, new_seq, old, old_seq)| {
            let went = match slots[new] {
                // Completed: it was posted.
                Slot::Held(w) => w.seq == new_seq,
                // Not posted yet: kept for a later post.
                Slot::Writing(w) if w.seq == new_seq && !posted.contains(&new) => return true,
                Slot::Writing(w) => w.seq == new_seq,
                // The new write is gone without being posted: the held one stays.
                _ => false,
            };
            if went && matches!(slots[old], Slot::Held(o) if o.seq == old_seq) {
                free.push(old);
            }
            false
        });
        for old in free {
            self.set(old, Slot::Free);
        }
    }

    /// Frees the slot of a write whose post was refused (another reason than a lost
    /// connection): never posted, never acknowledged. In the replay order it had taken its
    /// bytes from the writes that held them (of any queue), which cannot be told now (a gap
    /// is no proof a write gave them up: a newer write of another queue may have taken them
    /// before and been released since): it is let go as lost first ([`Member::lose`]), so that
    /// a queue that let those bytes go hears of a loss rather than a durable release, and a
    /// write that no longer owns its bytes counts them lost at its queue's next re-issue. A
    /// loss reported that a durable write would not have needed, on this rare path; never a
    /// durable over a lost write.
    pub(crate) fn unpost_write(&mut self, slot: usize) {
        if let Slot::Writing(w) = self.slots[slot] {
            if let Some(m) = &mut self.replay {
                m.lose(w.ns, w.offset, w.len, w.seq);
            }
        }
        self.set(slot, Slot::Free);
    }
}
