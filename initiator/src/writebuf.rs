//! Write buffers: memory of the caller's that Writes go out from, and Reads come into, without
//! the bounce copy.
//!
//! A plain write ([`Namespace::write_at`](crate::Namespace::write_at) and the rest) copies the
//! caller's bytes into a bounce slot of the queue, registered once, and keeps that copy until a
//! durability acknowledgement covers it: a reconnect re-issues it. A [`WriteBuf`] is registered
//! memory the caller fills itself; the `*_from` calls
//! ([`Namespace::write_from`](crate::Namespace::write_from),
//! [`write_durable_from`](crate::Namespace::write_durable_from),
//! [`start_write_from`](crate::Namespace::start_write_from)) post their Writes straight from it,
//! and the queue keeps a hold on the buffer instead of a copy: until every write from it is
//! acknowledged as durable, [`WriteBuf::bytes_mut`] refuses to hand its bytes out, so the bytes a
//! reconnect re-issues are the bytes the caller wrote. Dropping a held buffer is fine: the queue
//! keeps the memory until it is done with it.
//!
//! Each queue registers a buffer in its protection domain the first time it writes from it (and
//! again after a reconnect), and keeps the registration while the buffer lives: reuse one buffer
//! rather than making one per write.
//!
//! [`Namespace::start_read_into`](crate::Namespace::start_read_into) places a Read's bytes in
//! a buffer instead of a bounce slot; the queue holds the buffer until the Read is freed. A
//! buffer does one thing at a time: no Read into it while a write from it is held, no write
//! from it while a Read into it is.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use rpma_common::fabric::{AlignedBuf, RegisteredMemory};

use crate::error::{Error, Result};

/// Registered memory of the caller's to write from without a copy (the module's doc).
pub struct WriteBuf {
    id: u64,
    mem: Arc<AlignedBuf>,
    /// Holds on it: the writes from it a queue keeps for a replay, the Reads into it in
    /// flight. Its weak count tells a queue's registration cache that the buffer is gone.
    holds: Arc<Holds>,
}

/// The holds queues have on one buffer, by kind.
#[derive(Debug, Default)]
pub(crate) struct Holds {
    /// Writes from it: posted, or completed and not durable yet.
    writes: AtomicUsize,
    /// Reads into it whose slot is not freed yet.
    reads: AtomicUsize,
}

impl Holds {
    fn of(&self, read: bool) -> &AtomicUsize {
        if read {
            &self.reads
        } else {
            &self.writes
        }
    }
}

impl std::fmt::Debug for WriteBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WriteBuf")
            .field("len", &self.len())
            .field("holds", &self.holds())
            .finish()
    }
}

impl WriteBuf {
    /// A zeroed buffer of `len` bytes, page-aligned.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a zero length; [`Error::Fabric`] when the memory cannot be
    /// had.
    pub fn new(len: usize) -> Result<WriteBuf> {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        if len == 0 {
            return Err(Error::InvalidArgument("a write buffer of 0 bytes".into()));
        }
        let mem = AlignedBuf::new(len).map_err(|source| Error::Fabric {
            op: "allocating a write buffer",
            source,
        })?;
        Ok(WriteBuf {
            id: NEXT.fetch_add(1, Ordering::Relaxed),
            mem,
            holds: Arc::default(),
        })
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.mem.len()
    }

    /// Never: a write buffer has at least one byte.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// How many requests on it queues hold: Writes from it (posted, or completed and not yet
    /// durable) and Reads into it (until [`Namespace::finish_read`] or
    /// [`Namespace::take_read`] freed them).
    ///
    /// [`Namespace::finish_read`]: crate::Namespace::finish_read
    /// [`Namespace::take_read`]: crate::Namespace::take_read
    pub fn holds(&self) -> usize {
        self.writes_held() + self.reads_held()
    }

    /// Writes from it a queue holds (posted, or completed and not yet durable).
    pub(crate) fn writes_held(&self) -> usize {
        self.holds.writes.load(Ordering::Acquire)
    }

    /// Reads into it a queue holds (not freed yet).
    pub(crate) fn reads_held(&self) -> usize {
        self.holds.reads.load(Ordering::Acquire)
    }

    /// Its bytes, to fill or to look at; `None` while a queue holds a request on it (see
    /// [`holds`]): make the writes from it durable first ([`Namespace::persist_own_writes`],
    /// or a durability call that covers them), free the Reads into it, then look again.
    ///
    /// [`holds`]: Self::holds
    /// [`Namespace::persist_own_writes`]: crate::Namespace::persist_own_writes
    pub fn bytes_mut(&mut self) -> Option<&mut [u8]> {
        if self.holds() != 0 {
            return None;
        }
        // SAFETY: the mapping is valid for `len` bytes while `self.mem` lives, which the borrow
        // of self outlasts. No request on it is held, so no posted request reads or writes it
        // (a queue takes a hold before it posts a Write from the buffer or a Read into it, and
        // gives it back only once its slot is freed: after the request completed, or with its
        // connection gone) and no new one can be posted while `&mut self` is borrowed (posting
        // takes `&self` or, for a Read into it, `&mut self`). Each counter is read once and
        // only goes up while a `&self` or `&mut self` is posting, which this borrow excludes.
        Some(unsafe { std::slice::from_raw_parts_mut(self.mem.as_mut_ptr(), self.mem.len()) })
    }

    /// Its bytes, to read; `None` while a queue holds a request on it (a Write from it not yet
    /// durable, or a Read into it not yet finished).
    pub(crate) fn bytes(&self) -> Option<&[u8]> {
        if self.reads_held() != 0 {
            return None;
        }
        // SAFETY: the mapping is valid for `len` bytes while `self.mem` lives. No queue holds a
        // Read into it, so no Read writes it; a Read into it is started only through
        // `&mut self` (`Namespace::start_read_into`), which this borrow excludes; Writes from it
        // only read it.
        Some(unsafe { std::slice::from_raw_parts(self.mem.as_mut_ptr(), self.mem.len()) })
    }

    /// Copies `out.len()` bytes from `at` out, also while a queue holds it (the bytes a Read
    /// placed before its connection was lost, its slot not freed yet).
    pub(crate) fn copy_out(&self, at: usize, out: &mut [u8]) -> Result<()> {
        self.check(at, out.len())?;
        self.mem.read_at(at, out).map_err(|source| Error::Fabric {
            op: "copying from a write buffer",
            source,
        })
    }

    /// Copies `data` into it at `at`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if the range is outside the buffer, or while a request on it
    /// is held (see [`bytes_mut`](Self::bytes_mut)).
    pub fn fill(&mut self, at: usize, data: &[u8]) -> Result<()> {
        self.check(at, data.len())?;
        let reading = self.reads_held() != 0;
        let bytes = self.bytes_mut().ok_or_else(|| {
            Error::InvalidArgument(if reading {
                "a Read into this buffer is not finished: finish it before filling the buffer"
                    .into()
            } else {
                "a write from this buffer is not durable yet: persist it before filling it again"
                    .into()
            })
        })?;
        bytes[at..at + data.len()].copy_from_slice(data);
        Ok(())
    }

    /// Checks that `[at, at + len)` is a non-empty range of the buffer.
    pub(crate) fn check(&self, at: usize, len: usize) -> Result<()> {
        if len == 0 || at.checked_add(len).is_none_or(|end| end > self.len()) {
            return Err(Error::InvalidArgument(format!(
                "bytes {at}..+{len} of a {}-byte write buffer",
                self.len()
            )));
        }
        Ok(())
    }

    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    pub(crate) fn mem(&self) -> &Arc<AlignedBuf> {
        &self.mem
    }

    /// A hold on the buffer for a Read into it (`read`) or a Write from it, given back when
    /// dropped.
    pub(crate) fn hold(&self, read: bool) -> Hold {
        self.holds.of(read).fetch_add(1, Ordering::AcqRel);
        Hold {
            holds: Arc::clone(&self.holds),
            read,
        }
    }

    /// What tells a registration cache whether the buffer (or a hold on it) is still alive.
    pub(crate) fn alive(&self) -> std::sync::Weak<Holds> {
        Arc::downgrade(&self.holds)
    }
}

/// A queue's hold on a [`WriteBuf`] (the module's doc).
#[derive(Debug)]
pub(crate) struct Hold {
    holds: Arc<Holds>,
    /// For a Read into the buffer; else for a Write from it.
    read: bool,
}

impl Hold {
    /// What tells a registration cache whether the buffer is still alive (as
    /// [`WriteBuf::alive`]).
    pub(crate) fn alive(&self) -> std::sync::Weak<Holds> {
        Arc::downgrade(&self.holds)
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        self.holds.of(self.read).fetch_sub(1, Ordering::AcqRel);
    }
}

/// The bytes of a write: the caller's slice, copied into a bounce slot, or a range of a
/// [`WriteBuf`], written from in place.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Data<'a> {
    /// Copied.
    Bytes(&'a [u8]),
    /// `len` bytes from `at` of the buffer.
    Buf {
        /// The buffer.
        buf: &'a WriteBuf,
        /// Where in it.
        at: usize,
        /// Bytes.
        len: usize,
    },
}

impl Data<'_> {
    /// Bytes.
    pub(crate) fn len(&self) -> usize {
        match self {
            Data::Bytes(b) => b.len(),
            Data::Buf { len, .. } => *len,
        }
    }

    /// What loading it into a slot does, named in an error.
    pub(crate) fn load_op(&self) -> &'static str {
        match self {
            Data::Bytes(_) => "filling a bounce buffer",
            Data::Buf { .. } => "registering a write buffer",
        }
    }

    /// Its `n` bytes from `at` (within it).
    pub(crate) fn slice(self, at: usize, n: usize) -> Self {
        match self {
            Data::Bytes(b) => Data::Bytes(&b[at..at + n]),
            Data::Buf { buf, at: a, .. } => Data::Buf {
                buf,
                at: a + at,
                len: n,
            },
        }
    }

    /// The pieces of at most `chunk` bytes it is posted as, in order.
    pub(crate) fn pieces(self, chunk: usize) -> impl Iterator<Item = Self> {
        let len = self.len();
        (0..len.div_ceil(chunk)).map(move |i| {
            let at = i * chunk;
            self.slice(at, chunk.min(len - at))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_buffer_is_filled_only_while_no_request_on_it_is_held() {
        assert!(matches!(WriteBuf::new(0), Err(Error::InvalidArgument(_))));
        let mut b = WriteBuf::new(8192).unwrap();
        assert_eq!(b.len(), 8192);
        b.fill(4096, b"abc").unwrap();
        assert_eq!(&b.bytes_mut().unwrap()[4096..4099], b"abc");
        assert!(matches!(
            b.fill(8190, b"abc"),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            b.fill(usize::MAX, b"a"),
            Err(Error::InvalidArgument(_))
        ));
        let h = b.hold(false);
        let h2 = b.hold(true);
        assert_eq!((b.holds(), b.writes_held(), b.reads_held()), (2, 1, 1));
        assert!(b.bytes_mut().is_none());
        assert!(b.bytes().is_none(), "a Read may be writing it");
        assert!(
            matches!(b.fill(0, b"x"), Err(Error::InvalidArgument(m)) if m.contains("not finished"))
        );
        drop(h2);
        assert!(b.bytes_mut().is_none());
        assert!(b.bytes().is_some(), "a write from it only reads it");
        assert!(
            matches!(b.fill(0, b"x"), Err(Error::InvalidArgument(m)) if m.contains("not durable"))
        );
        drop(h);
        b.fill(0, b"x").unwrap();
        // A hold outlives the buffer; the cache's weak handle dies with the last of them.
        let alive = b.alive();
        let h = b.hold(true);
        drop(b);
        assert!(alive.upgrade().is_some());
        drop(h);
        assert!(alive.upgrade().is_none());
    }

    #[test]
    fn data_splits_into_chunks_in_order() {
        let b = WriteBuf::new(10_000).unwrap();
        let d = Data::Buf {
            buf: &b,
            at: 100,
            len: 9000,
        };
        let p: Vec<(usize, usize)> = d
            .pieces(4096)
            .map(|p| match p {
                Data::Buf { at, len, .. } => (at, len),
                Data::Bytes(_) => unreachable!(),
            })
            .collect();
        assert_eq!(p, [(100, 4096), (4196, 4096), (8292, 808)]);
        let v = vec![7u8; 5000];
        let lens: Vec<usize> = Data::Bytes(&v).pieces(4096).map(|p| p.len()).collect();
        assert_eq!(lens, [4096, 904]);
    }
}
