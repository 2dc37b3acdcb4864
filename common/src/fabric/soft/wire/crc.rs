//! CRC32c (Castagnoli) as MPA uses it: reflected, init and xorout 0xFFFFFFFF. The `crc-fast`
//! crate picks, at run time, carry-less multiply folding (AVX-512 VPCLMULQDQ, else PCLMULQDQ;
//! ARM PMULL) and falls back to tables. On this project's machines it runs at 70-95 GB/s on
//! 4-64 KiB, against 22-27 GB/s for the SSE4.2 `crc32` instruction in three interleaved streams
//! (the `crc32c` crate, used before) and 8-12 GB/s for one `_mm_crc32_u64` stream: MPA checks
//! every byte at both ends, so this is per-byte CPU on the data path (docs/benchmarks.md).
//!
//! MPA puts the value on the wire least-significant byte first: `crc32c(..).to_le_bytes()`.

use crate::volatile::VolatileSlice;

/// CRC32c of `data`.
pub fn crc32c(data: &[u8]) -> u32 {
    crc_fast::crc32_iscsi(data)
}

/// Continues `crc` (the CRC32c of the bytes so far) over `data`:
/// `crc32c_append(crc32c(a), b) == crc32c(a ++ b)`.
pub fn crc32c_append(crc: u32, data: &[u8]) -> u32 {
    // The digest's state is the register before the final xor: resume from `!crc`.
    let mut d =
        crc_fast::Digest::new_with_init_state(crc_fast::CrcAlgorithm::Crc32Iscsi, u64::from(!crc));
    d.update(data);
    d.finalize() as u32
}

/// Bytes of registered memory copied out per step of [`crc32c_append_volatile`]: small enough
/// to stay in L1, large enough that the per-call cost of the CRC is lost in the bytes.
const VOLATILE_CHUNK: usize = 8192;

/// [`crc32c_append`] over bytes others may be writing (registered memory): they are copied out
/// a chunk at a time into a buffer of our own and the CRC runs over that, so that no Rust
/// reference ever covers them. A byte written meanwhile makes this the CRC of some mix of old
/// and new bytes, which may then not match what a later read of the memory sends: the peer's
/// CRC check fails and the connection is terminated, as when an RNIC's data changes under it.
pub fn crc32c_append_volatile(crc: u32, data: VolatileSlice<'_>) -> u32 {
    prefetch_range(data.as_ptr(), data.len());
    let mut d =
        crc_fast::Digest::new_with_init_state(crc_fast::CrcAlgorithm::Crc32Iscsi, u64::from(!crc));
    let mut chunk = std::mem::MaybeUninit::<[u8; VOLATILE_CHUNK]>::uninit();
    let buf = chunk.as_mut_ptr().cast::<u8>();
    let mut off = 0;
    while off < data.len() {
        let n = (data.len() - off).min(VOLATILE_CHUNK);
        // SAFETY: `data` is valid for reads of its length (its contract) and off + n <= len;
        // `buf` is our own VOLATILE_CHUNK >= n bytes, which no slice of registered memory can
        // overlap.
        unsafe { crate::volatile::copy(buf, data.as_ptr().add(off), n) };
        // SAFETY: the copy just initialised these n bytes of our own buffer.
        d.update(unsafe { std::slice::from_raw_parts(buf, n) });
        off += n;
    }
    d.finalize() as u32
}

/// The page size [`prefetch_pages`] assumes (the smallest x86-64 and common ARM page).
const PAGE: usize = 4096;

/// Offsets into a slice at `addr` of `len` bytes of one byte in each `PAGE`-sized page it
/// touches: its start, then every page boundary inside it.
fn page_offsets(addr: usize, len: usize) -> impl Iterator<Item = usize> {
    let first_boundary = (addr | (PAGE - 1)).wrapping_add(1).wrapping_sub(addr);
    std::iter::once(0)
        .chain((first_boundary..).step_by(PAGE))
        .take_while(move |&o| o < len)
}

/// Asks the CPU to start loading the first touched cache line of every page of `data`, so that
/// the address translations and the first misses of every page overlap instead of coming one
/// page at a time as a linear pass reaches them (the hardware prefetchers stop at page
/// boundaries). Call it right before a pass over memory that is likely not cached: the sender's
/// CRC32c over registered memory went from about 23 to 27 GB/s on this project's machines
/// (16 MiB of source, 32 KiB FPDUs); on cached data it costs one instruction per page
/// (docs/benchmarks.md). A hint only: it never faults and changes no state a program can see.
#[inline]
pub fn prefetch_pages(data: &[u8]) {
    prefetch_range(data.as_ptr(), data.len());
}

/// [`prefetch_pages`] for `len` bytes at `ptr`, which need not be covered by a reference.
#[inline]
fn prefetch_range(ptr: *const u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    for o in page_offsets(ptr as usize, len) {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        // SAFETY: SSE is baseline on x86-64; a prefetch only hints the cache, reads nothing a
        // program can see and cannot fault on any address (`o < len` keeps it in the range).
        unsafe { _mm_prefetch::<_MM_HINT_T0>(ptr.wrapping_add(o).cast()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (ptr, len);
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn check_value() {
        // The CRC-32C check value (IWARP.md, RFC 3720 B.4).
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(b""), 0);
        assert_eq!(crc32c_append(0, b"123456789"), 0xE306_9283);
    }

    #[test]
    fn the_volatile_crc_equals_the_slice_crc_across_chunks() {
        let mut data: Vec<u8> = (0..3 * VOLATILE_CHUNK as u32 + 77)
            .map(|i| (i.wrapping_mul(2654435761) >> 11) as u8)
            .collect();
        let want: Vec<u32> = [0, 1, VOLATILE_CHUNK, VOLATILE_CHUNK + 1, data.len()]
            .iter()
            .map(|&n| crc32c_append(crc32c(b"head"), &data[..n]))
            .collect();
        let s = VolatileSlice::from(&mut data[..]);
        for (i, &n) in [0, 1, VOLATILE_CHUNK, VOLATILE_CHUNK + 1, s.len()]
            .iter()
            .enumerate()
        {
            let v = crc32c_append_volatile(crc32c(b"head"), s.subslice(0, n).unwrap());
            assert_eq!(v, want[i], "{n} bytes");
        }
    }

    #[test]
    fn rfc3720_vectors() {
        // RFC 3720 B.4: 32 bytes of zeros, of 0xFF, and an ascending sequence.
        assert_eq!(crc32c(&[0u8; 32]), 0x8A91_36AA);
        assert_eq!(crc32c(&[0xFFu8; 32]), 0x62A8_AB43);
        let inc: Vec<u8> = (0u8..32).collect();
        assert_eq!(crc32c(&inc), 0x46DD_794E);
    }

    #[test]
    fn matches_a_bitwise_reference_at_every_length_and_alignment() {
        // The SIMD paths switch on length (16, 64, 256 bytes...) and alignment.
        fn reference(data: &[u8]) -> u32 {
            let mut c = !0u32;
            for &b in data {
                c ^= u32::from(b);
                for _ in 0..8 {
                    c = if c & 1 == 1 {
                        (c >> 1) ^ 0x82F6_3B78
                    } else {
                        c >> 1
                    };
                }
            }
            !c
        }
        let data: Vec<u8> = (0..5000u32)
            .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
            .collect();
        for start in 0..9 {
            for len in (0..700).chain([1023, 1024, 1025, 4096, 4990]) {
                let d = &data[start..start + len];
                assert_eq!(crc32c(d), reference(d), "start {start} len {len}");
            }
        }
    }

    #[test]
    fn page_offsets_name_each_touched_page_once() {
        let offs = |addr, len| page_offsets(addr, len).collect::<Vec<_>>();
        assert_eq!(offs(0x1000, 0), Vec::<usize>::new());
        assert_eq!(offs(0x1000, 1), vec![0]);
        assert_eq!(offs(0x1000, 4096), vec![0]);
        assert_eq!(offs(0x1000, 4097), vec![0, 4096]);
        // Unaligned start: the start, then each boundary inside the slice.
        assert_eq!(offs(0x1ff0, 16), vec![0]);
        assert_eq!(offs(0x1ff0, 17), vec![0, 16]);
        assert_eq!(
            offs(0x1ff0, 32 * 1024),
            (0..9)
                .map(|i| if i == 0 { 0 } else { 16 + (i - 1) * 4096 })
                .collect::<Vec<_>>()
        );
        // At the top of the address space nothing overflows.
        assert_eq!(offs(usize::MAX - 10, 5), vec![0]);
    }

    #[test]
    fn prefetch_pages_leaves_data_and_crc_alone() {
        let data: Vec<u8> = (0..40_000u32).map(|i| (i * 31) as u8).collect();
        let before = crc32c(&data);
        for start in [0, 1, 4095, 4097] {
            prefetch_pages(&data[start..]);
        }
        prefetch_pages(&[]);
        assert_eq!(crc32c(&data), before);
    }

    proptest! {
        #[test]
        fn page_offsets_cover_every_page_exactly_once(addr in 0usize..1 << 40, len in 0usize..100_000) {
            let offs: Vec<usize> = page_offsets(addr, len).collect();
            let pages: Vec<usize> = offs.iter().map(|o| (addr + o) / PAGE).collect();
            let want: Vec<usize> = if len == 0 {
                vec![]
            } else {
                (addr / PAGE..=(addr + len - 1) / PAGE).collect()
            };
            prop_assert_eq!(pages, want);
            prop_assert!(offs.iter().all(|&o| o < len));
        }

        #[test]
        fn append_equals_whole(a in proptest::collection::vec(any::<u8>(), 0..300),
                               b in proptest::collection::vec(any::<u8>(), 0..300)) {
            let mut all = a.clone();
            all.extend_from_slice(&b);
            prop_assert_eq!(crc32c_append(crc32c(&a), &b), crc32c(&all));
        }
    }
}
