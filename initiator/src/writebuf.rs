//! Write buffers: memory of the caller's that Writes go out from without the bounce copy.
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

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use rpma_common::fabric::{AlignedBuf, RegisteredMemory};

use crate::error::{Error, Result};

/// Registered memory of the caller's to write from without a copy (the module's doc).
pub struct WriteBuf {
    id: u64,
    mem: Arc<AlignedBuf>,
    /// Holds on it: the writes from it a queue keeps for a replay. Its weak count tells a
    /// queue's registration cache that the buffer is gone.
    holds: Arc<AtomicUsize>,
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
            holds: Arc::new(AtomicUsize::new(0)),
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

    /// How many requests on it a queue holds: Writes from it (posted, or completed and not yet
    /// durable) and Reads into it (crate-internal; until their slot is freed).
    pub fn holds(&self) -> usize {
        self.holds.load(Ordering::Acquire)
    }

    /// Its bytes, to fill; `None` while a queue holds a write from it (see [`holds`]): make
    /// those durable first ([`Namespace::persist_own_writes`], or a durability call that
    /// covers them), then fill it again.
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
        // takes `&self` or, for a Read into it, `&mut self`).
        Some(unsafe { std::slice::from_raw_parts_mut(self.mem.as_mut_ptr(), self.mem.len()) })
    }

    /// Its bytes, to read; `None` while a queue holds a request on it (a Write from it not yet
    /// durable, or a Read into it not yet finished).
    pub(crate) fn bytes(&self) -> Option<&[u8]> {
        if self.holds() != 0 {
            return None;
        }
        // SAFETY: the mapping is valid for `len` bytes while `self.mem` lives. No queue holds a
        // request on it, so no Read writes it; a Read into it is started only through
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
    /// [`Error::InvalidArgument`] if the range is outside the buffer, or while a write from it
    /// is held (see [`bytes_mut`](Self::bytes_mut)).
    pub fn fill(&mut self, at: usize, data: &[u8]) -> Result<()> {
        self.check(at, data.len())?;
        let bytes = self.bytes_mut().ok_or_else(|| {
            Error::InvalidArgument(
                "a write from this buffer is not durable yet: persist it before filling it again"
                    .into(),
            )
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

    /// A hold on the buffer, given back when dropped.
    pub(crate) fn hold(&self) -> Hold {
        self.holds.fetch_add(1, Ordering::AcqRel);
        Hold(Arc::clone(&self.holds))
    }

    /// What tells a registration cache whether the buffer (or a hold on it) is still alive.
    pub(crate) fn alive(&self) -> std::sync::Weak<AtomicUsize> {
        Arc::downgrade(&self.holds)
    }
}

/// A queue's hold on a [`WriteBuf`] (the module's doc).
#[derive(Debug)]
pub(crate) struct Hold(Arc<AtomicUsize>);

impl Hold {
    /// What tells a registration cache whether the buffer is still alive (as
    /// [`WriteBuf::alive`]).
    pub(crate) fn alive(&self) -> std::sync::Weak<AtomicUsize> {
        Arc::downgrade(&self.0)
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
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
    fn a_buffer_is_filled_only_while_no_write_from_it_is_held() {
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
        let h = b.hold();
        let h2 = b.hold();
        assert_eq!(b.holds(), 2);
        assert!(b.bytes_mut().is_none());
        assert!(
            matches!(b.fill(0, b"x"), Err(Error::InvalidArgument(m)) if m.contains("not durable"))
        );
        drop(h);
        assert!(b.bytes_mut().is_none());
        drop(h2);
        b.fill(0, b"x").unwrap();
        // A hold outlives the buffer; the cache's weak handle dies with the last of them.
        let alive = b.alive();
        let h = b.hold();
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
