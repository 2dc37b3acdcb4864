//! Which pages of a page-cache mapping were placed into since their last write-back started:
//! how [`Mapping::placement_file`](super::Mapping::placement_file) chooses between a `pwrite`
//! and a store for the next placement.
//!
//! A store into a page that a write-back cleaned takes a write fault (the kernel write-protects
//! a shared file page while cleaning it; ext4's `page_mkwrite` starts a journal handle), a
//! `pwrite` none; but a `pwrite` costs a system call and the filesystem's write_begin/write_end
//! for every page (every 4 KiB folio) it touches, each time, while a store into a page that is
//! already dirty and writable in the mapping costs a copy. So the first placement into a page
//! after its write-back is a `pwrite`, and the later ones are stores: the second one takes the
//! page's one fault (the `pwrite` did not map it writable here), the rest none, until the next
//! write-back of the page (a persist, a flush or [`Persist::before_sync`](super::Persist)
//! forgets its mark).
//!
//! Only a cost is at stake: a store and a `pwrite` leave the same bytes in the same page-cache
//! page, dirty, and every sync writes both. A write-back this set does not see (the kernel's
//! own, every 30 s by default) only makes the next store fault once.
//!
//! One bit per page, atomics so that several poll loops may place into one namespace and a
//! flush service clear from another thread: 32 MiB for a 1 TiB namespace.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// One bit per page of a mapping: placed into since its last write-back started.
#[derive(Debug)]
pub(super) struct PlacedPages {
    words: Box<[AtomicU64]>,
    /// log2 of the page size.
    shift: u32,
    /// Pages in the mapping (the last may be partial).
    pages: usize,
}

impl PlacedPages {
    /// Nothing placed yet, for a mapping of `len` bytes in pages of `page` bytes (a power of
    /// two).
    pub(super) fn new(len: usize, page: usize) -> PlacedPages {
        debug_assert!(page.is_power_of_two());
        let pages = len.div_ceil(page);
        PlacedPages {
            words: std::iter::repeat_with(|| AtomicU64::new(0))
                .take(pages.div_ceil(64))
                .collect(),
            shift: page.trailing_zeros(),
            pages,
        }
    }

    /// The pages `[offset, offset + len)` touches, as (word, mask) pairs; empty for `len` 0 or
    /// a range not inside the mapping.
    fn masks(&self, offset: usize, len: usize) -> impl Iterator<Item = (usize, u64)> {
        let (first, last) = match offset.checked_add(len) {
            Some(end) if len > 0 && (end - 1) >> self.shift < self.pages => {
                (offset >> self.shift, (end - 1) >> self.shift)
            }
            _ => (1, 0),
        };
        (first / 64..=last / 64)
            .filter(move |_| first <= last)
            .map(move |w| {
                let lo = if w == first / 64 { first % 64 } else { 0 };
                let hi = if w == last / 64 { last % 64 } else { 63 };
                (w, (u64::MAX >> (63 - hi)) & (u64::MAX << lo))
            })
    }

    /// Whether every page of `[offset, offset + len)` was placed into since its last
    /// write-back started; if not, marks them all (the caller places the range now) and
    /// returns false. False for `len` 0 and for a range outside the mapping (nothing marked).
    pub(super) fn placed_or_mark(&self, offset: usize, len: usize) -> bool {
        let mut any = false;
        let all = self.masks(offset, len).all(|(w, m)| {
            any = true;
            self.words[w].load(Relaxed) & m == m
        });
        if all && any {
            return true;
        }
        for (w, m) in self.masks(offset, len) {
            self.words[w].fetch_or(m, Relaxed);
        }
        false
    }

    /// Forgets the marks of the pages `[offset, offset + len)` touches: their write-back is
    /// about to start. A range reaching past the mapping forgets up to its end.
    pub(super) fn forget(&self, offset: usize, len: usize) {
        let page = 1usize << self.shift;
        let end = offset.saturating_add(len).min(self.pages * page);
        if offset < end {
            for (w, m) in self.masks(offset, end - offset) {
                self.words[w].fetch_and(!m, Relaxed);
            }
        }
    }

    /// Forgets every mark.
    pub(super) fn forget_all(&self) {
        for w in self.words.iter() {
            w.store(0, Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: usize = 4096;

    #[test]
    fn the_second_placement_of_a_page_is_known_and_a_write_back_forgets_it() {
        let s = PlacedPages::new(200 * P, P);
        assert!(!s.placed_or_mark(10, 100), "first placement: a pwrite");
        assert!(s.placed_or_mark(10, 100), "second: a store");
        assert!(s.placed_or_mark(0, P), "the same page, another part of it");
        assert!(
            !s.placed_or_mark(P - 1, 2),
            "reaches into page 1: not all placed"
        );
        assert!(s.placed_or_mark(0, 2 * P), "page 1 is now marked too");
        s.forget(P + 5, 1);
        assert!(!s.placed_or_mark(0, 2 * P), "page 1 was written back");
        assert!(s.placed_or_mark(0, 2 * P));
        s.forget_all();
        assert!(!s.placed_or_mark(0, 1));
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
            assert!(!s.placed_or_mark(page * P, 1), "page {page} was not placed");
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
    fn empty_and_outside_ranges_mark_nothing() {
        let s = PlacedPages::new(3 * P + 100, P);
        assert!(!s.placed_or_mark(5, 0), "len 0");
        assert!(!s.placed_or_mark(5, 0), "still: nothing was marked");
        assert!(!s.placed_or_mark(3 * P, 100), "the partial last page");
        assert!(s.placed_or_mark(3 * P + 99, 1));
        assert!(!s.placed_or_mark(4 * P, 1), "past the mapping");
        assert!(!s.placed_or_mark(4 * P, 1));
        assert!(!s.placed_or_mark(usize::MAX, 2), "wraps");
        // A forget reaching past the end stops there.
        s.forget(3 * P, usize::MAX);
        assert!(!s.placed_or_mark(3 * P, 1));
        s.forget(usize::MAX, 5);
    }
}
