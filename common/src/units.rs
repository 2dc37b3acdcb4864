//! Human-readable sizes: `4096`, `4k`, `64MiB`, `1G`, `1GiB`.

/// Why a size string was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The string is empty (or only blanks).
    #[error("empty size")]
    Empty,
    /// The string does not start with a decimal number.
    #[error("size `{input}` does not start with a number")]
    NoNumber {
        /// The string given.
        input: String,
    },
    /// The suffix is not one of the known units.
    #[error("size `{input}`: unknown unit `{unit}` (use none, k/KiB, M/MiB, G/GiB, T/TiB)")]
    BadUnit {
        /// The string given.
        input: String,
        /// The unit part.
        unit: String,
    },
    /// The size does not fit in 64 bits.
    #[error("size `{input}` is too large")]
    Overflow {
        /// The string given.
        input: String,
    },
}

/// The units module's result type.
pub type Result<T> = std::result::Result<T, Error>;

/// Parses a size in bytes: a decimal number, optionally followed (with or without one space) by a
/// binary unit: `k`/`K`/`KiB`/`KB`, `M`/`MiB`/`MB`, `G`/`GiB`/`GB`, `T`/`TiB`/`TB`, or `B`.
/// Units are case-insensitive and all powers of 1024, as in qemu-img and fio.
///
/// Errors: [`Error::Empty`], [`Error::NoNumber`], [`Error::BadUnit`], [`Error::Overflow`].
pub fn parse_size(input: &str) -> Result<u64> {
    let s = input.trim();
    if s.is_empty() {
        return Err(Error::Empty);
    }
    let digits = s.bytes().take_while(u8::is_ascii_digit).count();
    if digits == 0 {
        return Err(Error::NoNumber {
            input: input.to_owned(),
        });
    }
    let overflow = || Error::Overflow {
        input: input.to_owned(),
    };
    let number: u64 = s[..digits].parse().map_err(|_| overflow())?;
    let unit = s[digits..].strip_prefix(' ').unwrap_or(&s[digits..]);
    let shift = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => {
            return Err(Error::BadUnit {
                input: input.to_owned(),
                unit: unit.to_owned(),
            })
        }
    };
    number.checked_mul(1u64 << shift).ok_or_else(overflow)
}

/// Formats a byte count with the largest binary unit that divides it exactly: `64 MiB`, `4 KiB`,
/// `4097 B`.
pub fn format_size(bytes: u64) -> String {
    for (shift, unit) in [(40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")] {
        if bytes != 0 && bytes.is_multiple_of(1u64 << shift) {
            return format!("{} {unit}", bytes >> shift);
        }
    }
    format!("{bytes} B")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_documented_forms() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("4k"), Ok(4096));
        assert_eq!(parse_size("4K"), Ok(4096));
        assert_eq!(parse_size("64MiB"), Ok(64 << 20));
        assert_eq!(parse_size("64M"), Ok(64 << 20));
        assert_eq!(parse_size("1G"), Ok(1 << 30));
        assert_eq!(parse_size("1GiB"), Ok(1 << 30));
        assert_eq!(parse_size("1gb"), Ok(1 << 30));
        assert_eq!(parse_size("2T"), Ok(2 << 40));
        assert_eq!(parse_size(" 512 B "), Ok(512));
        assert_eq!(parse_size("8 KiB"), Ok(8192));
        assert_eq!(parse_size("0"), Ok(0));
    }

    #[test]
    fn refuses_bad_input() {
        assert_eq!(parse_size(""), Err(Error::Empty));
        assert_eq!(parse_size("   "), Err(Error::Empty));
        assert!(matches!(parse_size("MiB"), Err(Error::NoNumber { .. })));
        assert!(matches!(parse_size("-4k"), Err(Error::NoNumber { .. })));
        assert!(matches!(parse_size("1.5G"), Err(Error::BadUnit { .. })));
        assert!(matches!(parse_size("4q"), Err(Error::BadUnit { .. })));
        assert!(matches!(parse_size("4  k"), Err(Error::BadUnit { .. })));
        assert!(matches!(parse_size("4kk"), Err(Error::BadUnit { .. })));
        assert!(matches!(
            parse_size("99999999999999999999"),
            Err(Error::Overflow { .. })
        ));
        assert!(matches!(
            parse_size("16777216T"),
            Err(Error::Overflow { .. })
        ));
        let msg = parse_size("4q").unwrap_err().to_string();
        assert!(msg.contains("`q`"), "{msg}");
    }

    #[test]
    fn formats_with_the_largest_exact_unit() {
        assert_eq!(format_size(64 << 20), "64 MiB");
        assert_eq!(format_size(4096), "4 KiB");
        assert_eq!(format_size(1 << 30), "1 GiB");
        assert_eq!(format_size(4097), "4097 B");
        assert_eq!(format_size(0), "0 B");
    }
}
