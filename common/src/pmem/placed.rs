//! Which pages of a page-cache mapping were placed into since their last write-back started:
//! how [`Mapping::placement_file`](super::Mapping::placement_file) chooses between a `pwrite`
//! and a store for the next placement.
//!
//! A store into a page that a write-back cleaned takes a write fault (the kernel write-protects
//! a shared file page while cleaning it; then ext4's `page_mkwrite`), a `pwrite` none; but a
//! `pwrite` costs a system call and the filesystem's write_begin/write_end for every page
//! (every 4 KiB folio) it touches, each time, while a store into a page that is already dirty
//! and writable in the mapping costs a copy. So a page's placements after its write-back are
//! `pwrite`s until all of it has been placed, and stores after that: the first store takes the
//! page's one fault (a `pwrite` does not map it writable here), the rest none, until the next
//! write-back of the page (a persist, a flush or [`Persist::before_sync`](super::Persist)
//! forgets it).
//!
//! "All of it": one placement covering the whole page, or two covering parts of it. Two parts
//! because a Write's segments are cut where the sender cut them, not at pages: the two
//! segments around a cut each place part of one page, and if the first marked the page
//! placed, the second would be a store into a page only just written with `pwrite`, a fault
//! in every Write (a durable 64 KiB write took one each). The two parts need not cover the
//! page: two small writes into one page before its flush make the third a store.
//!
//! Only a cost is at stake: a store and a `pwrite` leave the same bytes in the same page-cache
//! page, dirty, and every sync writes both. A write-back this set does not see (the kernel's
//! own, every 30 s by default) only makes the next store fault once.
//!
//! Two bits per page, atomics so that several poll loops may place into one namespace and a
//! flush service clear from another thread: 64 MiB for a 1 TiB namespace.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Two bits per page of a mapping: placed into (all of it) since its last write-back started,
/// and partly placed into once.
#[derive(Debug)]
pub(super) struct PlacedPages {
    /// A bit per page: placed, the next placement is a store.
    placed: Box<[AtomicU64]>,
    /// A bit per page: part of it placed once since its write-back.
    part: Box<[AtomicU64]>,
    /// log2 of the page size.
    shift: u32,
    /// The mapping's length.
    len: usize,
}

fn zeroed(n: usize) -> Box<[AtomicU64]> {
    std::iter::repeat_with(|| AtomicU64::new(0))
        .take(n)
        .collect()
}

impl PlacedPages {
    /// Nothing placed yet, for a mapping of `len` bytes in pages of `page` bytes (a power of
    /// two).
    pub(super) fn new(len: usize, page: usize) -> PlacedPages {
        debug_assert!(page.is_power_of_two());
        let words = len.div_ceil(page).div_ceil(64);
        PlacedPages {
            placed: zeroed(words),
            part: zeroed(words),
            shift: page.trailing_zeros(),
            len,
        }
    }

    /// The pages `[offset, offset + len)` touches (first, last), None for `len` 0 or a range
    /// not inside the mapping.
    fn pages(&self, offset: usize, len: usize) -> Option<(usize, usize)> {
        match offset.checked_add(len) {
            Some(end) if len > 0 && end <= self.len => {
                Some((offset >> self.shift, (end - 1) >> self.shift))
            }
            _ => None,
        }
    }

    /// The pages `first..=last` (`first <= last`, as [`Self::pages`] gives them) as (word,
    /// mask) pairs.
    fn masks(first: usize, last: usize) -> impl Iterator<Item = (usize, u64)> {
        (first / 64..=last / 64).map(move |w| {
            let lo = if w == first / 64 { first % 64 } else { 0 };
            let hi = if w == last / 64 { last % 64 } else { 63 };
            (w, (u64::MAX >> (63 - hi)) & (u64::MAX << lo))
        })
    }

    /// Whether every page of `[offset, offset + len)` was placed into (all of it) since its
    /// last write-back started: the caller stores then. If not, records the placement the
    /// caller now makes with a `pwrite` (the pages it covers whole are placed; a page it covers
    /// in part is placed if part of it was before, else partly placed) and returns false.
    /// False for `len` 0 and for a range outside the mapping (nothing recorded).
    pub(super) fn placed_or_mark(&self, offset: usize, len: usize) -> bool {
        let Some((first, last)) = self.pages(offset, len) else {
            return false;
        };
        if Self::masks(first, last).all(|(w, m)| self.placed[w].load(Relaxed) & m == m) {
            return true;
        }
        let page = 1usize << self.shift;
        let end = offset + len;
        // The pages at either end are covered in part unless the range starts (ends) on their
        // boundary or the mapping's end.
        let end_part = !end.is_multiple_of(page) && end < self.len;
        let head_part = !offset.is_multiple_of(page) || (first == last && end_part);
        let tail_part = last != first && end_part;
        let whole_first = first + usize::from(head_part);
        let whole_last = if tail_part { last - 1 } else { last };
        if whole_first <= whole_last {
            for (w, m) in Self::masks(whole_first, whole_last) {
                self.placed[w].fetch_or(m, Relaxed);
            }
        }
        for (p, part) in [(first, head_part), (last, tail_part)] {
            if part {
                let (w, m) = (p / 64, 1u64 << (p % 64));
                if self.part[w].fetch_or(m, Relaxed) & m != 0 {
                    self.placed[w].fetch_or(m, Relaxed);
                }
            }
        }
        false
    }

    /// Forgets the pages `[offset, offset + len)` touches: their write-back is about to start.
    /// A range reaching past the mapping forgets up to its end.
    pub(super) fn forget(&self, offset: usize, len: usize) {
        let end = offset.saturating_add(len).min(self.len);
        let Some((first, last)) = end.checked_sub(offset).and_then(|n| self.pages(offset, n))
        else {
            return;
        };
        for (w, m) in Self::masks(first, last) {
            self.placed[w].fetch_and(!m, Relaxed);
            self.part[w].fetch_and(!m, Relaxed);
        }
    }

    /// Forgets every page.
    pub(super) fn forget_all(&self) {
        for w in self.placed.iter().chain(self.part.iter()) {
            w.store(0, Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: usize = 4096;

    #[test]
    fn a_whole_page_placed_once_is_stored_into_until_a_write_back_forgets_it() {
        let s = PlacedPages::new(200 * P, P);
        assert!(!s.placed_or_mark(0, P), "first placement: a pwrite");
        assert!(s.placed_or_mark(0, P), "second: a store");
        assert!(s.placed_or_mark(10, 100), "any part of the page");
        assert!(
            !s.placed_or_mark(0, 2 * P),
            "reaches into page 1: not all placed"
        );
        assert!(s.placed_or_mark(P + 5, 7), "page 1 is now placed too");
        s.forget(P + 5, 1);
        assert!(!s.placed_or_mark(P, 1), "page 1 was written back");
        assert!(s.placed_or_mark(0, P), "page 0 was not");
        s.forget_all();
        assert!(!s.placed_or_mark(0, P));
    }

    #[test]
    fn a_page_placed_in_two_parts_is_placed() {
        let s = PlacedPages::new(200 * P, P);
        // The two segments around a cut inside page 15: neither is a store.
        assert!(!s.placed_or_mark(0, 15 * P + 300));
        assert!(
            !s.placed_or_mark(15 * P + 300, P - 300),
            "the rest of page 15"
        );
        assert!(
            s.placed_or_mark(0, 16 * P),
            "then all sixteen pages are placed"
        );
        // Two small writes into one page; the third is a store.
        assert!(!s.placed_or_mark(40 * P + 512, 512));
        assert!(!s.placed_or_mark(40 * P + 2048, 512));
        assert!(s.placed_or_mark(40 * P, 512));
        // A range with a part at both ends: its whole pages are placed, the ends are not.
        assert!(!s.placed_or_mark(50 * P + 1, 3 * P));
        assert!(s.placed_or_mark(51 * P, 2 * P), "pages 51 and 52");
        assert!(!s.placed_or_mark(50 * P, 1), "page 50 was placed in part");
        assert!(
            !s.placed_or_mark(53 * P + 7, 1),
            "page 53 in part, the second part now"
        );
        assert!(s.placed_or_mark(53 * P, 1), "page 53 twice in part: placed");
        // A write-back forgets the parts too.
        assert!(!s.placed_or_mark(60 * P + 9, 9));
        s.forget(60 * P, P);
        assert!(
            !s.placed_or_mark(60 * P + 9, 9),
            "a part again, not a second part"
        );
        assert!(!s.placed_or_mark(60 * P, 1), "the second part");
        assert!(s.placed_or_mark(60 * P, 1));
    }

    #[test]
    fn ranges_across_words_are_marked_and_forgotten_page_by_page() {
        let s = PlacedPages::new(200 * P, P);
        // Pages 60..=130: across three words.
        assert!(!s.placed_or_mark(60 * P, 71 * P));
        for page in 60..=130 {
            assert!(s.placed_or_mark(page * P, P), "page {page}");
        }
        for page in [0, 59, 131, 199] {
            assert!(!s.placed_or_mark(page * P, P), "page {page} was not placed");
        }
        // Forget pages 64..=127 (one whole word) only.
        s.forget(64 * P, 64 * P);
        assert!(s.placed_or_mark(60 * P, 4 * P));
        assert!(s.placed_or_mark(128 * P, 3 * P));
        for page in 64..128 {
            assert!(!s.placed_or_mark(page * P, P), "page {page} was forgotten");
        }
    }

    #[test]
    fn empty_and_outside_ranges_mark_nothing_and_the_mappings_end_is_a_whole_page() {
        let s = PlacedPages::new(3 * P + 100, P);
        assert!(!s.placed_or_mark(5, 0), "len 0");
        assert!(!s.placed_or_mark(5, 0), "still: nothing was marked");
        assert!(
            !s.placed_or_mark(3 * P, 100),
            "the short last page, all of it"
        );
        assert!(s.placed_or_mark(3 * P + 99, 1));
        assert!(!s.placed_or_mark(3 * P + 99, 2), "past the mapping");
        assert!(!s.placed_or_mark(4 * P, 1));
        assert!(!s.placed_or_mark(usize::MAX, 2), "wraps");
        // A forget reaching past the end stops there.
        s.forget(3 * P, usize::MAX);
        assert!(!s.placed_or_mark(3 * P, 100));
        s.forget(usize::MAX, 5);
        s.forget(4 * P, 5);
    }
}
