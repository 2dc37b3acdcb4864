//! CRC32c (Castagnoli) as MPA uses it: reflected, init and xorout 0xFFFFFFFF. The `crc-fast`
//! crate picks, at run time, carry-less multiply folding (AVX-512 VPCLMULQDQ, else PCLMULQDQ;
//! ARM PMULL) and falls back to tables. On this project's machines it runs at 70-95 GB/s on
//! 4-64 KiB, against 22-27 GB/s for the SSE4.2 `crc32` instruction in three interleaved streams
//! (the `crc32c` crate, used before) and 8-12 GB/s for one `_mm_crc32_u64` stream: MPA checks
//! every byte at both ends, so this is per-byte CPU on the data path (docs/benchmarks.md).
//!
//! MPA puts the value on the wire least-significant byte first: `crc32c(..).to_le_bytes()`.

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

    proptest! {
        #[test]
        fn append_equals_whole(a in proptest::collection::vec(any::<u8>(), 0..300),
                               b in proptest::collection::vec(any::<u8>(), 0..300)) {
            let mut all = a.clone();
            all.extend_from_slice(&b);
            prop_assert_eq!(crc32c_append(crc32c(&a), &b), crc32c(&all));
        }
    }
}
