//! Views of memory that others write while we look at it: registered memory (a peer's Write is
//! placed into it by whichever poll loop serves that peer, two sessions may place into the same
//! bytes at once), a shared mapping of a namespace (other processes), a buffer the kernel fills.
//!
//! A Rust reference promises that nobody else changes the bytes behind it while it lives
//! (`&[u8]`) or that nobody else touches them at all (`&mut [u8]`). Neither holds for such
//! memory, so forming one over it is undefined behaviour even if the code looks only once. A
//! [`VolatileSlice`] is a raw pointer and a length, after rust-vmm/vm-memory's type of the same
//! name: the bytes are only ever reached through raw-pointer copies and through iovecs handed
//! to the kernel ([`VolatileSlice::iovec`], [`ReadVolatile`]), never through a reference.
//!
//! What a racing copy gives: each byte read or written while another party writes the same
//! byte is the old or the new value, and a copy may come out torn (a mix of old and new
//! bytes); nothing else goes wrong. Copies of up to 8 bytes use volatile loads and stores of
//! the widest unit both ends are aligned to, so an aligned 8-byte value moves in one access.
//! Longer copies use `ptr::copy_nonoverlapping` (a `memcpy`) on the raw pointers, as vm-memory
//! does for anything longer than a `usize`: no reference is formed, the compiler cannot assume
//! the bytes are unchanged or unobserved, and a byte-wise volatile loop would cost an order of
//! magnitude in bandwidth on the placement path.
//!
//! How far that goes: Rust's memory model has no formal rule yet for plain accesses that race
//! with writers it cannot see (the kernel, another process, a thread writing through raw
//! pointers); "torn, nothing worse" is what the hardware and the compiler give for raw copies
//! that no reference covers, and the position vm-memory (and the VMMs built on it) takes for
//! guest memory. What this type removes is the part Rust does define as undefined behaviour:
//! references whose aliasing promises are broken.
//!
//! # Under ThreadSanitizer (`make tsan`, `--cfg rpma_tsan`)
//!
//! ThreadSanitizer cannot see references; it sees accesses, and two racing plain accesses are a
//! data race to it, whether they come through a slice or through this type's `memcpy`. So in
//! the `rpma_tsan` build this type's copies are relaxed atomic accesses (8 bytes at a time where
//! both ends are aligned, else byte by byte), and its `readv` goes through a buffer of its own:
//! what a NIC's DMA is to the CPU's memory model, racing and torn at some granularity, never
//! undefined. Every other access to registered or shared memory stays a plain access, and
//! ThreadSanitizer reports it when it races with one of these: the check that everything
//! reaches that memory through this type (docs/reliability.md, "Race detection").

use std::io;
use std::marker::PhantomData;
use std::net::TcpStream;

/// The errors of [`VolatileSlice`]'s checked accessors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// `offset..offset + len` is not inside the slice.
    #[error("range {offset}+{len} is outside a slice of {slice_len} bytes")]
    OutOfRange {
        /// Start of the range asked for.
        offset: usize,
        /// Its length.
        len: usize,
        /// Length of the slice.
        slice_len: usize,
    },
}

/// `Result` with this module's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

/// `len` bytes at `ptr` that other threads, processes or the kernel may read and write at any
/// time: a view with no Rust reference over the bytes. Copy it freely; it borrows the memory's
/// owner for `'a`.
#[derive(Clone, Copy)]
pub struct VolatileSlice<'a> {
    ptr: *mut u8,
    len: usize,
    // Like `&'a [Cell<u8>]`: tied to the owner's lifetime, neither Send nor Sync (a holder that
    // moves one to another thread states why that is sound, as `DirectTarget` does).
    _mem: PhantomData<&'a [std::cell::Cell<u8>]>,
}

impl std::fmt::Debug for VolatileSlice<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VolatileSlice")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .finish()
    }
}

impl<'a> From<&'a mut [u8]> for VolatileSlice<'a> {
    /// A view of memory borrowed exclusively (a buffer of our own handed to `readv`).
    fn from(s: &'a mut [u8]) -> VolatileSlice<'a> {
        // SAFETY: the exclusive borrow keeps the bytes valid and unreferenced elsewhere for 'a.
        unsafe { VolatileSlice::new(s.as_mut_ptr(), s.len()) }
    }
}

impl<'a> VolatileSlice<'a> {
    /// A view of `len` bytes at `ptr`.
    ///
    /// # Safety
    /// For all of `'a`: `ptr..ptr + len` stays valid for reads and writes (mapped or allocated,
    /// not freed, not wrapping the address space), and no Rust reference to any of its bytes is
    /// used. Other parties may read and write the bytes concurrently through raw pointers, DMA
    /// or system calls: that is what this type is for.
    pub unsafe fn new(ptr: *mut u8, len: usize) -> VolatileSlice<'a> {
        VolatileSlice {
            ptr,
            len,
            _mem: PhantomData,
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The first byte, for system calls and cache instructions (never to form a reference).
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    fn check(&self, offset: usize, len: usize) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(Error::OutOfRange {
                offset,
                len,
                slice_len: self.len,
            }),
        }
    }

    /// The `len` bytes at `offset`.
    ///
    /// # Errors
    /// [`Error::OutOfRange`] if they are not all inside this slice.
    pub fn subslice(&self, offset: usize, len: usize) -> Result<VolatileSlice<'a>> {
        self.check(offset, len)?;
        // SAFETY: inside this slice (checked), so covered by its own contract for 'a.
        Ok(unsafe { VolatileSlice::new(self.ptr.add(offset), len) })
    }

    /// Copies `buf.len()` bytes at `offset` into `buf`. Bytes written concurrently by others
    /// may come out torn (see the module docs).
    ///
    /// # Errors
    /// [`Error::OutOfRange`] if the range is not inside this slice.
    pub fn read_at(&self, offset: usize, buf: &mut [u8]) -> Result<()> {
        self.check(offset, buf.len())?;
        // SAFETY: the source is inside this slice (checked), valid for reads by its contract;
        // `buf` is exclusively ours, so it cannot overlap memory no reference may cover.
        unsafe { copy(buf.as_mut_ptr(), self.ptr.add(offset), buf.len()) };
        Ok(())
    }

    /// Copies `data` into this slice at `offset`. Others reading the bytes meanwhile may see
    /// a torn mix of old and new.
    ///
    /// # Errors
    /// [`Error::OutOfRange`] if the range is not inside this slice.
    pub fn write_at(&self, offset: usize, data: &[u8]) -> Result<()> {
        self.check(offset, data.len())?;
        // SAFETY: the destination is inside this slice (checked), valid for writes by its
        // contract; `data` is a live reference, so it is not memory this slice covers (no
        // reference may cover that).
        unsafe { copy(self.ptr.add(offset), data.as_ptr(), data.len()) };
        Ok(())
    }

    /// The slice as an iovec, for `readv`/`writev`: the kernel reads or writes the bytes, no
    /// Rust reference is formed.
    pub fn iovec(&self) -> libc::iovec {
        libc::iovec {
            iov_base: self.ptr.cast(),
            iov_len: self.len,
        }
    }
}

/// Copies `len` bytes from `src` to `dst` (see the module docs for why `memcpy` above 8 bytes,
/// and for the atomic copies of the `rpma_tsan` build).
///
/// # Safety
/// `src` is valid for reads and `dst` for writes of `len` bytes; the ranges do not overlap.
pub(crate) unsafe fn copy(dst: *mut u8, src: *const u8, len: usize) {
    #[cfg(rpma_tsan)]
    {
        // SAFETY: the caller's contract.
        unsafe { atomic_copy(dst, src, len) };
    }
    #[cfg(not(rpma_tsan))]
    // SAFETY: the caller's contract.
    unsafe {
        plain_copy(dst, src, len)
    };
}

/// [`copy`] as relaxed atomic loads and stores, for ThreadSanitizer (module docs).
///
/// # Safety
/// As [`copy`].
#[cfg(rpma_tsan)]
unsafe fn atomic_copy(dst: *mut u8, src: *const u8, len: usize) {
    use std::sync::atomic::{AtomicU64, AtomicU8, Ordering::Relaxed};
    let mut i = 0;
    if (dst as usize) % 8 == (src as usize) % 8 {
        while i < len && !(dst as usize + i).is_multiple_of(8) {
            // SAFETY: in range (i < len, the caller's contract); any address is aligned for u8.
            unsafe {
                let v = AtomicU8::from_ptr(src.add(i).cast_mut()).load(Relaxed);
                AtomicU8::from_ptr(dst.add(i)).store(v, Relaxed);
            }
            i += 1;
        }
        while i + 8 <= len {
            // SAFETY: in range, and both addresses are multiples of 8 here (equal alignment,
            // the head above brought dst to it).
            unsafe {
                let v = AtomicU64::from_ptr(src.add(i).cast::<u64>().cast_mut()).load(Relaxed);
                AtomicU64::from_ptr(dst.add(i).cast::<u64>()).store(v, Relaxed);
            }
            i += 8;
        }
    }
    while i < len {
        // SAFETY: as for the head.
        unsafe {
            let v = AtomicU8::from_ptr(src.add(i).cast_mut()).load(Relaxed);
            AtomicU8::from_ptr(dst.add(i)).store(v, Relaxed);
        }
        i += 1;
    }
}

/// [`copy`] in a normal build.
///
/// # Safety
/// As [`copy`].
#[cfg_attr(rpma_tsan, allow(dead_code))]
unsafe fn plain_copy(dst: *mut u8, src: *const u8, len: usize) {
    if len > 8 {
        // SAFETY: the caller's contract; any alignment is valid for u8.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
        return;
    }
    let (mut d, mut s, mut left) = (dst, src, len);
    let align = (d as usize | s as usize).trailing_zeros();
    macro_rules! units {
        ($t:ty) => {
            let size = std::mem::size_of::<$t>();
            if align >= size.trailing_zeros() {
                while left >= size {
                    // SAFETY: in range (caller; `left` bytes remain at both ends) and aligned
                    // for $t (both addresses are multiples of `size`, checked above, and each
                    // step moves by `size`); every bit pattern is a valid integer.
                    unsafe {
                        std::ptr::write_volatile(
                            d.cast::<$t>(),
                            std::ptr::read_volatile(s.cast::<$t>()),
                        );
                        d = d.add(size);
                        s = s.add(size);
                    }
                    left -= size;
                }
            }
        };
    }
    units!(u64);
    units!(u32);
    units!(u16);
    units!(u8);
}

/// A byte stream that reads into [`VolatileSlice`]s: how the receiver reads a payload straight
/// into registered memory without a `&mut [u8]` over it (vm-memory has a trait of this name).
pub trait ReadVolatile {
    /// Reads into `bufs` in order, like `readv(2)`: returns the bytes read (0 at end of
    /// stream). May read less than asked, or use only the first few buffers.
    ///
    /// # Errors
    /// Those of the stream (`WouldBlock` on a non-blocking one with nothing to read).
    fn read_volatile(&mut self, bufs: &[VolatileSlice<'_>]) -> io::Result<usize>;
}

/// At most this many buffers go to one `readv`: the receiver passes two.
const MAX_IOV: usize = 8;

impl ReadVolatile for TcpStream {
    #[cfg(rpma_tsan)]
    fn read_volatile(&mut self, bufs: &[VolatileSlice<'_>]) -> io::Result<usize> {
        // The kernel's writes are plain accesses to ThreadSanitizer: read into a buffer of our
        // own, then copy into place atomically (module docs).
        use std::io::Read;
        let want: usize = bufs.iter().take(MAX_IOV).map(VolatileSlice::len).sum();
        let mut own = vec![0u8; want];
        let n = self.read(&mut own)?;
        let mut at = 0;
        for b in bufs {
            let k = (n - at).min(b.len());
            b.write_at(0, &own[at..at + k])
                .map_err(|e| io::Error::other(e.to_string()))?;
            at += k;
            if at == n {
                break;
            }
        }
        Ok(n)
    }

    #[cfg(not(rpma_tsan))]
    fn read_volatile(&mut self, bufs: &[VolatileSlice<'_>]) -> io::Result<usize> {
        use std::os::fd::AsRawFd;
        let mut iov = [libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        }; MAX_IOV];
        let n = bufs.len().min(MAX_IOV);
        for (v, b) in iov.iter_mut().zip(bufs) {
            *v = b.iovec();
        }
        // SAFETY: every iovec describes a VolatileSlice, valid for writes for the duration of
        // this call by its contract; the kernel writes through them, nothing forms a reference.
        let r = unsafe { libc::readv(self.as_raw_fd(), iov.as_ptr(), n as libc::c_int) };
        if r < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(r as usize)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn subslices_and_copies_stay_inside_the_slice() {
        let mut mem = [0u8; 100];
        let s = VolatileSlice::from(&mut mem[..]);
        assert_eq!(s.len(), 100);
        assert!(s.subslice(0, 100).is_ok());
        assert!(s.subslice(100, 0).unwrap().is_empty());
        let err = Error::OutOfRange {
            offset: 99,
            len: 2,
            slice_len: 100,
        };
        assert_eq!(s.subslice(99, 2).unwrap_err(), err);
        assert!(s.subslice(101, 0).is_err());
        assert!(s.subslice(usize::MAX, 2).is_err(), "offset + len overflows");
        assert!(s.subslice(2, usize::MAX).is_err());
        let sub = s.subslice(10, 20).unwrap();
        assert!(
            sub.write_at(15, &[1; 6]).is_err(),
            "past the subslice's end"
        );
        assert!(sub.read_at(0, &mut [0; 21]).is_err());
        sub.write_at(15, &[7; 5]).unwrap();
        let mut b = [0u8; 7];
        s.read_at(24, &mut b).unwrap();
        assert_eq!(
            b,
            [0, 7, 7, 7, 7, 7, 0],
            "written at 10 + 15, nothing past 30"
        );
        assert_eq!(
            sub.write_at(21, &[]).unwrap_err(),
            Error::OutOfRange {
                offset: 21,
                len: 0,
                slice_len: 20
            }
        );
        assert_eq!(sub.iovec().iov_len, 20);
        assert_eq!(sub.iovec().iov_base as usize, mem.as_ptr() as usize + 10);
    }

    #[test]
    fn copies_of_every_length_and_alignment_move_exactly_their_bytes() {
        // Covers the volatile path (up to 8 bytes, every alignment) and memcpy above it.
        let src: Vec<u8> = (0..64u8).map(|i| i.wrapping_mul(37) | 1).collect();
        for off in 0..9 {
            for len in 0..=24 {
                let mut mem = [0u8; 48];
                let s = VolatileSlice::from(&mut mem[..]);
                s.write_at(off, &src[off..off + len]).unwrap();
                let mut back = vec![0u8; len];
                s.read_at(off, &mut back).unwrap();
                assert_eq!(back, &src[off..off + len], "off {off} len {len}");
                assert!(mem[..off].iter().all(|&b| b == 0));
                assert!(mem[off + len..].iter().all(|&b| b == 0));
            }
        }
    }

    #[test]
    fn an_aligned_u64_is_copied_in_one_access() {
        // A writer flips an aligned word between two values with single 8-byte stores; a reader
        // copying it through read_at never sees a mix (a byte-wise copy would).
        use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
        use std::sync::Arc;
        let cell = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (c, st) = (Arc::clone(&cell), Arc::clone(&stop));
        let writer = std::thread::spawn(move || {
            let mut i = 0u64;
            while !st.load(Ordering::Relaxed) {
                c.store(
                    if i.is_multiple_of(2) { 0 } else { u64::MAX },
                    Ordering::Relaxed,
                );
                i += 1;
            }
        });
        // SAFETY: the 8 bytes of the atomic live as long as `cell`; only atomics and this
        // slice's copies touch them.
        let s = unsafe { VolatileSlice::new(cell.as_ptr().cast::<u8>(), 8) };
        for _ in 0..100_000 {
            let mut b = [0u8; 8];
            s.read_at(0, &mut b).unwrap();
            let v = u64::from_ne_bytes(b);
            assert!(v == 0 || v == u64::MAX, "torn read {v:#x}");
        }
        stop.store(true, Ordering::Relaxed);
        writer.join().unwrap();
    }

    #[test]
    fn a_socket_reads_into_several_slices_in_order() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut b, _) = l.accept().unwrap();
        a.write_all(b"abcdefghij").unwrap();
        drop(a);
        let (mut x, mut y) = ([0u8; 4], [0u8; 16]);
        let mut got = 0;
        while got < 10 {
            let n = if got < 4 {
                let bufs = [
                    VolatileSlice::from(&mut x[got..]),
                    VolatileSlice::from(&mut y[..]),
                ];
                b.read_volatile(&bufs)
            } else {
                b.read_volatile(&[VolatileSlice::from(&mut y[got - 4..])])
            }
            .unwrap();
            assert!(n > 0);
            got += n;
        }
        assert_eq!(&x, b"abcd");
        assert_eq!(&y[..6], b"efghij");
        let mut rest = [0u8; 4];
        assert_eq!(
            b.read_volatile(&[VolatileSlice::from(&mut rest[..])])
                .unwrap(),
            0
        );
    }
}
