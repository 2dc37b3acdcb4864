//! The bytes a client sent that are not executed yet, and the memory they take.

/// Bytes asked of each socket read.
pub(super) const READ_CHUNK: usize = 256 << 10;
/// Bytes the buffer grows by at most ahead of the bytes received, while a request is
/// incomplete (`Client::read_more`): what the client sent, not what it announced, is what it
/// costs.
pub(super) const GROW_STEP: usize = 1 << 20;

/// Bytes received and not yet consumed: `data[start..end]`.
#[derive(Debug, Default)]
pub(super) struct InBuf {
    data: Vec<u8>,
    start: usize,
    end: usize,
}

impl InBuf {
    pub(super) fn bytes(&self) -> &[u8] {
        &self.data[self.start..self.end]
    }

    /// `n` bytes were executed. Once the buffer is empty, a large one is given back when
    /// the round just executed was small (a burst of large writes is over); a round of large
    /// writes keeps it for the next (`Client::read_more` gives it back once the client is
    /// quiet for `KEEP_IDLE`): growing it anew for every 1 MiB WRITE cost a realloc's copy and
    /// a zeroing each time, 6% of the export's samples on 1 MiB writes at depth 1 (perf,
    /// docs/benchmarks.md "The export's 1 MiB writes"). The most it holds is the same either
    /// way: what the client may send ahead of execution.
    pub(super) fn consume(&mut self, n: usize) {
        self.start += n;
        if self.start >= self.end {
            self.start = 0;
            self.end = 0;
            if self.large() && n <= 4 * READ_CHUNK {
                self.release();
            }
        }
    }

    /// Whether it holds more memory than a burst of small requests needs.
    pub(super) fn large(&self) -> bool {
        self.data.len() > 4 * READ_CHUNK
    }

    /// Gives the memory back (only while empty: the bytes would be lost).
    pub(super) fn release(&mut self) {
        if self.start == self.end {
            *self = InBuf::default();
        }
    }

    /// Free space for at least `n` more bytes.
    pub(super) fn room(&mut self, n: usize) -> &mut [u8] {
        if self.data.len() - self.end < n {
            self.data.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
            if self.data.len() - self.end < n {
                self.data.resize(self.end + n, 0);
            }
        }
        &mut self.data[self.end..]
    }

    pub(super) fn filled(&mut self, n: usize) {
        self.end += n;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inbuf_compacts_and_grows() {
        let mut b = InBuf::default();
        b.room(4)[..4].copy_from_slice(b"abcd");
        b.filled(4);
        b.consume(1);
        assert_eq!(b.bytes(), b"bcd");
        let r = b.room(10);
        assert!(r.len() >= 10);
        r[..2].copy_from_slice(b"ef");
        b.filled(2);
        assert_eq!(b.bytes(), b"bcdef");
        b.consume(5);
        assert!(b.bytes().is_empty());
    }

    #[test]
    fn inbuf_keeps_its_memory_through_a_burst_of_large_requests_and_gives_it_back_after() {
        let mut b = InBuf::default();
        let big = 2 << 20;
        let fill = |b: &mut InBuf, n: usize| {
            b.room(n);
            b.filled(n);
        };
        fill(&mut b, big);
        let grown = b.data.len();
        assert!(grown >= big);
        b.consume(big);
        assert!(b.bytes().is_empty());
        // The next large request finds the memory there (no growing, no zeroing).
        assert_eq!(
            b.data.len(),
            grown,
            "a round of large requests keeps the buffer"
        );
        fill(&mut b, big);
        assert_eq!(b.data.len(), grown);
        // A small round while bytes wait: nothing is given back.
        b.consume(512);
        assert_eq!(b.data.len(), grown);
        b.consume(big - 512);
        assert_eq!(b.data.len(), grown);
        // Released while bytes wait (read_more while a request is incomplete): nothing happens.
        fill(&mut b, 100);
        b.release();
        assert_eq!(b.bytes().len(), 100);
        assert!(b.large());
        b.consume(100);
        assert!(!b.large());
        // Released once empty (a client quiet after a burst): the memory goes back.
        fill(&mut b, big);
        b.consume(big);
        assert!(b.large());
        b.release();
        assert_eq!(b.data.len(), 0);
        // A small round after a burst: the memory goes back.
        fill(&mut b, big);
        b.consume(big);
        fill(&mut b, 4096);
        b.consume(4096);
        assert_eq!(
            b.data.len(),
            0,
            "a small round after a burst gives the buffer back"
        );
    }
}
