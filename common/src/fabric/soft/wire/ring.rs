//! The receiver's byte ring: `cap` bytes mapped twice, back to back, so that any `cap` bytes
//! starting anywhere in the first copy are one contiguous slice. The receiver can then read
//! from the socket into the free space behind its data and hand out whole FPDUs as slices
//! without ever moving bytes to the front of a buffer (the compaction a linear buffer needs
//! whenever an FPDU straddles its end).
//!
//! The two views are two mappings of one memfd. Where that is refused (no memfd, a sandbox),
//! the ring falls back to a plain allocation of `2 * cap` bytes and copies the bytes still
//! buffered down by `cap` when the data wraps: the same indices, correct, just slower.

use std::io;
use std::ops::Range;

/// A mirrored byte ring of `cap()` bytes, seen as a slice of `2 * cap()` bytes.
pub(crate) struct Ring {
    ptr: *mut u8,
    cap: usize,
    /// Whether the second half is a mapping of the first (else a separate allocation).
    mirrored: bool,
}

// SAFETY: the ring owns its mappings (or allocation) exclusively; nothing else refers to them.
unsafe impl Send for Ring {}

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as usize
    } else {
        4096
    }
}

impl Ring {
    /// A ring of at least `min` bytes (rounded up to whole pages).
    pub(crate) fn new(min: usize) -> Ring {
        let page = page_size();
        let cap = min.max(1).div_ceil(page) * page;
        match Self::mirrored(cap) {
            Ok(ptr) => Ring {
                ptr,
                cap,
                mirrored: true,
            },
            Err(_) => {
                let v = vec![0u8; 2 * cap].into_boxed_slice();
                Ring {
                    ptr: Box::into_raw(v).cast::<u8>(),
                    cap,
                    mirrored: false,
                }
            }
        }
    }

    fn mirrored(cap: usize) -> io::Result<*mut u8> {
        // SAFETY: a plain system call on a NUL-terminated name.
        let fd = unsafe { libc::memfd_create(c"rpma-rx-ring".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        let result = (|| {
            // SAFETY: `fd` is the memfd just created and owned here.
            if unsafe { libc::ftruncate(fd, cap as libc::off_t) } != 0 {
                return Err(io::Error::last_os_error());
            }
            // Reserve 2 * cap of address space, then map the file over each half.
            // SAFETY: a fresh anonymous mapping at an address the kernel chooses.
            let base = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    2 * cap,
                    libc::PROT_NONE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            if base == libc::MAP_FAILED {
                return Err(io::Error::last_os_error());
            }
            for half in 0..2 {
                // SAFETY: MAP_FIXED replaces pages of the reservation made above, which this
                // function owns; nothing else lives there.
                let p = unsafe {
                    libc::mmap(
                        base.cast::<u8>().add(half * cap).cast(),
                        cap,
                        libc::PROT_READ | libc::PROT_WRITE,
                        libc::MAP_SHARED | libc::MAP_FIXED,
                        fd,
                        0,
                    )
                };
                if p == libc::MAP_FAILED {
                    let e = io::Error::last_os_error();
                    // SAFETY: unmapping the reservation this function made.
                    unsafe { libc::munmap(base, 2 * cap) };
                    return Err(e);
                }
            }
            Ok(base.cast::<u8>())
        })();
        // SAFETY: the mappings keep the memory; the descriptor is ours to close.
        unsafe { libc::close(fd) };
        result
    }

    /// Bytes in the ring.
    pub(crate) fn cap(&self) -> usize {
        self.cap
    }

    /// Panics unless `range` is a window of at most `cap` bytes inside the double view: such a
    /// window covers each byte of the memfd at most once, so a reference over it aliases
    /// nothing (the whole double view would cover every byte twice).
    fn window(&self, range: &Range<usize>) -> *mut u8 {
        assert!(
            range.start <= range.end && range.end <= 2 * self.cap && range.len() <= self.cap,
            "ring window {range:?} of a {}-byte ring",
            self.cap
        );
        // SAFETY: inside the 2 * cap bytes at `ptr` (checked).
        unsafe { self.ptr.add(range.start) }
    }

    /// The bytes at `range` (at most `cap` of them, anywhere in the double view).
    pub(crate) fn bytes(&self, range: Range<usize>) -> &[u8] {
        let p = self.window(&range);
        // SAFETY: valid for the ring's lifetime; a window of at most cap bytes covers no byte
        // twice, and the borrow of self keeps `bytes_mut` from being used meanwhile.
        unsafe { std::slice::from_raw_parts(p, range.len()) }
    }

    /// The bytes at `range`, writable (the receiver reads from the socket into them).
    pub(crate) fn bytes_mut(&mut self, range: Range<usize>) -> &mut [u8] {
        let p = self.window(&range);
        // SAFETY: as in `bytes`, and `&mut self` makes this the only reference into the ring.
        unsafe { std::slice::from_raw_parts_mut(p, range.len()) }
    }

    /// Moves the buffered bytes `[start, end)` (with `start >= cap`, `end - start <= cap`) down
    /// by `cap`: returns the new `(start, end)`. Mirrored, the bytes are already there.
    pub(crate) fn wrap(&mut self, start: usize, end: usize) -> (usize, usize) {
        debug_assert!(start >= self.cap && end >= start && end - start <= self.cap);
        if self.mirrored {
            // The bytes written through the upper view are about to be read through the lower
            // one: a compiler barrier, so that no load through the lower view is served from
            // before the stores through the upper one (the CPU sees one physical page).
            // SAFETY: an empty asm statement; it may "touch memory", which is the point.
            unsafe { std::arch::asm!("", options(nostack, preserves_flags)) };
        } else {
            // SAFETY: the fallback is one plain allocation of 2 * cap bytes (no mirror), and
            // both ranges lie inside it; `ptr::copy` allows the overlap.
            unsafe {
                std::ptr::copy(
                    self.ptr.add(start),
                    self.ptr.add(start - self.cap),
                    end - start,
                )
            };
        }
        (start - self.cap, end - self.cap)
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        if self.mirrored {
            // SAFETY: the 2 * cap bytes at ptr are the two mappings made in `mirrored`.
            unsafe { libc::munmap(self.ptr.cast(), 2 * self.cap) };
        } else {
            let slice = std::ptr::slice_from_raw_parts_mut(self.ptr, 2 * self.cap);
            // SAFETY: `ptr` came from `Box::into_raw` of a boxed slice of 2 * cap bytes.
            drop(unsafe { Box::from_raw(slice) });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_upper_half_mirrors_the_lower_one() {
        let mut r = Ring::new(5000);
        assert_eq!(r.cap() % page_size(), 0);
        assert!(r.cap() >= 5000);
        assert!(r.mirrored, "memfd mirror expected on Linux");
        let cap = r.cap();
        r.bytes_mut(cap + 10..cap + 13).copy_from_slice(b"abc");
        let (s, e) = r.wrap(cap + 10, cap + 13);
        assert_eq!((s, e), (10, 13));
        assert_eq!(r.bytes(s..e), b"abc");
        r.bytes_mut(cap - 2..cap + 2).copy_from_slice(b"wxyz");
        assert_eq!(r.bytes(cap - 2..cap), b"wx");
        assert_eq!(r.bytes(0..2), b"yz");
    }

    #[test]
    fn the_fallback_copies_on_wrap() {
        let cap = page_size();
        let v = vec![0u8; 2 * cap].into_boxed_slice();
        let mut r = Ring {
            ptr: Box::into_raw(v).cast::<u8>(),
            cap,
            mirrored: false,
        };
        r.bytes_mut(cap + 100..cap + 104).copy_from_slice(b"data");
        let (s, e) = r.wrap(cap + 100, cap + 104);
        assert_eq!(r.bytes(s..e), b"data");
    }

    #[test]
    fn windows_never_cover_a_byte_twice() {
        let r = Ring::new(4096);
        let cap = r.cap();
        assert_eq!(
            r.bytes(cap / 2..cap / 2 + cap).len(),
            cap,
            "one whole turn is fine"
        );
        assert_eq!(r.bytes(2 * cap..2 * cap).len(), 0);
        for bad in [0..cap + 1, cap - 1..2 * cap, cap..2 * cap + 1] {
            let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                r.bytes(bad.clone()).len()
            }));
            assert!(caught.is_err(), "{bad:?} must be refused");
        }
    }
}
