//! CRC32c (Castagnoli) as MPA uses it: reflected, init and xorout 0xFFFFFFFF. The `crc32c`
//! crate picks SSE4.2 / ARMv8 CRC instructions at run time and falls back to tables.
//!
//! MPA puts the value on the wire least-significant byte first: `crc32c(..).to_le_bytes()`.

/// CRC32c of `data`.
pub fn crc32c(data: &[u8]) -> u32 {
    ::crc32c::crc32c(data)
}

/// Continues `crc` (the CRC32c of the bytes so far) over `data`:
/// `crc32c_append(crc32c(a), b) == crc32c(a ++ b)`.
pub fn crc32c_append(crc: u32, data: &[u8]) -> u32 {
    ::crc32c::crc32c_append(crc, data)
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
