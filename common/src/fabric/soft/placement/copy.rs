//! Copying received payloads into registered memory: the only functions that write received
//! bytes gathered by the receiver into it ([`place_copy`], [`place_copy_writeback`], and
//! [`place_pwrite`] into the file of a page-cache mapping). No parsing here, and no wire type:
//! the transport's placer (soft/placer.rs) calls these with the payload bytes the wire layer's
//! receiver checked and handed it.

use std::io;
use std::os::fd::RawFd;

use crate::volatile::{self, VolatileSlice};

/// Copies a checked payload to the start of its placement: with [`place_copy_writeback`], the
/// only code that writes received bytes into registered memory on the staged path. A `memcpy`
/// on raw pointers (see [`crate::volatile`]): as fast as a slice copy, with no reference over
/// memory others may be writing.
///
/// # Errors
/// [`volatile::Error::OutOfRange`] if `dst` is shorter than `src` (nothing is copied).
pub fn place_copy(dst: VolatileSlice<'_>, src: &[u8]) -> volatile::Result<()> {
    dst.write_at(0, src)
}

/// Writes a checked payload into the file of a page-cache placement (the receiver's
/// `DirectTarget::into_file`) at `offset`: the placement that takes no write fault. Short
/// writes are continued; `EINTR` is retried.
///
/// # Errors
/// The `pwrite` error (`EIO`, `ENOSPC` on a filesystem that could not keep the allocation
/// made at open...): nothing is promised about the bytes then, and the caller fails the
/// connection, as a failed store would have.
pub fn place_pwrite(fd: RawFd, offset: u64, src: &[u8]) -> io::Result<()> {
    let mut done = 0;
    while done < src.len() {
        let rest = &src[done..];
        // SAFETY: `rest` is a live slice of `rest.len()` readable bytes; pwrite only reads it,
        // and `fd` is an open descriptor (DirectTarget::into_file's contract).
        let n = unsafe {
            libc::pwrite(
                fd,
                rest.as_ptr().cast(),
                rest.len(),
                (offset + done as u64) as libc::off_t,
            )
        };
        match n {
            n if n > 0 => done += n as usize,
            0 => return Err(io::Error::from(io::ErrorKind::WriteZero)),
            _ => {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
    Ok(())
}

/// Payloads shorter than this are copied plainly (and written back later, with the other dirty
/// ranges): with 1440-byte FPDUs every one shares its first and last cache line with its
/// neighbours, and streaming them in cost more than it saved (docs/benchmarks.md).
pub const WRITEBACK_COPY_MIN: usize = 2048;

/// How [`place_copy_writeback`] splits `len` bytes at `dst`: (head, body, tail), where the
/// body is whole 64-byte lines from a line boundary, streamed with non-temporal stores, and the
/// head and tail (each under a line) are copied plainly and written back from the cache. The
/// three cover `len` exactly, so every byte is either streamed or written back.
// Whole lines only: a partly streamed line leaves the write-combining buffer as a partial
// write, which is slow.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
fn writeback_split(dst: *const u8, len: usize) -> (usize, usize, usize) {
    let head = dst.align_offset(64).min(len);
    let body = (len - head) & !63;
    (head, body, len - head - body)
}

/// [`place_copy`] with non-temporal stores where the CPU has them (x86-64: `movntdq` for the
/// whole cache lines in the middle, a plain copy and a cache write-back of the partial lines at
/// either end): returns true when every byte is on its way out of the cache, so that an `sfence`
/// makes the range durable, as after `clwb` + `sfence`. Returns false, having done a plain copy,
/// where there is no cache write-back instruction or `src` is shorter than
/// [`WRITEBACK_COPY_MIN`]. Streaming stores go through raw pointers too: racing bytes may come
/// out torn, as with [`place_copy`].
///
/// # Errors
/// As [`place_copy`].
pub fn place_copy_writeback(dst: VolatileSlice<'_>, src: &[u8]) -> volatile::Result<bool> {
    let dst = dst.subslice(0, src.len())?;
    // Under ThreadSanitizer the streaming stores would be plain accesses: the plain copy
    // (atomic there, rpma_common::volatile) and a write-back by the caller instead.
    #[cfg(target_arch = "x86_64")]
    if !cfg!(rpma_tsan)
        && src.len() >= WRITEBACK_COPY_MIN
        && crate::pmem::flush_instruction() != crate::pmem::FlushInstruction::None
    {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
        let (head, body, tail) = writeback_split(dst.as_ptr(), src.len());
        let (d0, s0) = (dst.as_ptr(), src.as_ptr());
        // SAFETY: `dst` is valid for writes of src.len() bytes (a VolatileSlice of that length,
        // checked above) and, being memory no reference may cover, does not overlap `src`;
        // head + body + tail == len, so every access stays inside both; the write-back only
        // needs the lines mapped, which a valid slice is.
        unsafe {
            crate::volatile::copy(d0, s0, head);
            let mut i = head;
            while i < head + body {
                // One line per round: four aligned 16-byte streaming stores (SSE2 is baseline
                // on x86-64), unaligned loads from our buffer.
                let s = s0.add(i).cast::<__m128i>();
                let d = d0.add(i).cast::<__m128i>();
                let (x0, x1) = (_mm_loadu_si128(s), _mm_loadu_si128(s.add(1)));
                let (x2, x3) = (_mm_loadu_si128(s.add(2)), _mm_loadu_si128(s.add(3)));
                _mm_stream_si128(d, x0);
                _mm_stream_si128(d.add(1), x1);
                _mm_stream_si128(d.add(2), x2);
                _mm_stream_si128(d.add(3), x3);
                i += 64;
            }
            crate::volatile::copy(d0.add(head + body), s0.add(head + body), tail);
            // The partial lines went through the cache: write them back (no fence here; the
            // caller's sfence orders them with the streaming stores).
            crate::pmem::writeback_range(d0, head);
            crate::pmem::writeback_range(d0.add(head + body), tail);
        }
        return Ok(true);
    }
    place_copy(dst, src)?;
    Ok(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writeback_copy_equals_a_plain_copy_at_every_alignment() {
        let src: Vec<u8> = (0..3100u32).map(|i| (i * 13 + 5) as u8).collect();
        for dst_off in (0..20).chain([63, 64, 65]) {
            for src_off in [0usize, 1, 7, 16] {
                for len in (0..200).chain([255, 640, 2047, 2048, 2049, 2111, 3000]) {
                    let mut mem = vec![0xEEu8; 3100 + 64];
                    let s = &src[src_off..src_off + len.min(src.len() - src_off)];
                    let dst = VolatileSlice::from(&mut mem[dst_off..]);
                    let wb = place_copy_writeback(dst, s).unwrap();
                    crate::pmem::sfence();
                    assert_eq!(
                        wb,
                        s.len() >= WRITEBACK_COPY_MIN
                            && crate::pmem::flush_instruction()
                                != crate::pmem::FlushInstruction::None
                    );
                    assert_eq!(
                        &mem[dst_off..dst_off + s.len()],
                        s,
                        "{dst_off} {src_off} {len}"
                    );
                    assert!(mem[..dst_off].iter().all(|&b| b == 0xEE));
                    assert!(mem[dst_off + s.len()..].iter().all(|&b| b == 0xEE));
                }
            }
        }
    }

    #[test]
    fn placing_copies_refuse_a_destination_shorter_than_the_payload() {
        let src = vec![9u8; 4096];
        for n in [5, 4096] {
            let mut mem = vec![0u8; n - 1];
            let err = volatile::Error::OutOfRange {
                offset: 0,
                len: n,
                slice_len: n - 1,
            };
            let dst = VolatileSlice::from(&mut mem[..]);
            assert_eq!(place_copy(dst, &src[..n]), Err(err));
            assert_eq!(place_copy_writeback(dst, &src[..n]), Err(err));
            assert!(mem.iter().all(|&b| b == 0), "nothing copied");
        }
    }

    #[test]
    fn writeback_split_covers_every_byte_with_whole_lines_streamed() {
        let buf = vec![0u8; 4096 + 128];
        let base = buf.as_ptr().wrapping_add(buf.as_ptr().align_offset(64));
        for mis in 0..64 {
            for len in [0, 1, 63, 64, 65, 127, 128, 2047, 2048, 2049, 3000, 4096] {
                let dst = base.wrapping_add(mis);
                let (head, body, tail) = writeback_split(dst, len);
                assert_eq!(head + body + tail, len, "mis {mis} len {len}");
                assert!(head < 64 && tail < 64, "partial lines only at the ends");
                assert_eq!(body % 64, 0);
                if body > 0 {
                    assert_eq!((dst as usize + head) % 64, 0, "the body starts on a line");
                    assert!(head == 0 || !(dst as usize).is_multiple_of(64));
                }
                if len >= 64 + mis.min(1) * 64 {
                    assert!(body > 0, "a range holding a whole line streams it");
                }
            }
        }
    }
}
