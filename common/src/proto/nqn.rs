//! NVMe Qualified Names: `nqn.YYYY-MM.reverse-domain:name`, the UUID form
//! `nqn.2014-08.org.nvmexpress:uuid:<uuid>`, and the default host NQN.

use std::fmt;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

/// The longest NQN, in bytes (NVMe Base Specification).
pub const MAX_NQN_LEN: usize = 223;

/// The well-known discovery subsystem NQN.
pub const DISCOVERY_NQN: &str = "nqn.2014-08.org.nvmexpress.discovery";

/// Prefix of the UUID form.
pub const UUID_PREFIX: &str = "nqn.2014-08.org.nvmexpress:uuid:";

/// Where nvme-cli keeps the host NQN.
pub const HOSTNQN_PATH: &str = "/etc/nvme/hostnqn";

/// The machine id that a stable host NQN is derived from when there is no [`HOSTNQN_PATH`].
pub const MACHINE_ID_PATH: &str = "/etc/machine-id";

/// Why a string is not an NQN, or why no default host NQN could be found.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NqnError {
    /// Longer than [`MAX_NQN_LEN`].
    #[error("NQN is {len} bytes, more than the maximum of {MAX_NQN_LEN}")]
    TooLong {
        /// Its length.
        len: usize,
    },
    /// Does not start with `nqn.`.
    #[error("NQN {0:?} does not start with \"nqn.\"")]
    MissingPrefix(String),
    /// The `YYYY-MM` part is malformed.
    #[error("NQN {0:?}: expected a date YYYY-MM after \"nqn.\"")]
    BadDate(String),
    /// The reverse domain is missing or has an empty or invalid label.
    #[error("NQN {0:?}: the reverse domain after the date is missing or invalid")]
    BadDomain(String),
    /// No `:name` after the domain, or an empty name.
    #[error("NQN {0:?}: expected \":name\" after the reverse domain")]
    MissingName(String),
    /// Whitespace or a control character.
    #[error("NQN {0:?} contains whitespace or a control character")]
    BadChar(String),
    /// The UUID form with a malformed UUID.
    #[error("NQN {0:?}: malformed UUID after \"{UUID_PREFIX}\"")]
    BadUuid(String),
    /// A host NQN or machine id file could not be read.
    #[error("cannot read {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The machine id file does not hold 32 hex digits.
    #[error("{path} does not hold a machine id (32 hex digits)")]
    BadMachineId {
        /// The file.
        path: PathBuf,
    },
    /// The host NQN file holds an invalid NQN.
    #[error("{path} holds an invalid host NQN")]
    BadHostNqnFile {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        #[source]
        source: Box<NqnError>,
    },
}

/// Result of NQN operations.
pub type Result<T> = std::result::Result<T, NqnError>;

/// A validated NVMe Qualified Name.
#[derive(
    Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[serde(try_from = "String", into = "String")]
pub struct Nqn(String);

impl Nqn {
    /// Validates `s` as an NQN.
    ///
    /// # Errors
    /// One [`NqnError`] variant per rule: [`NqnError::TooLong`], [`NqnError::MissingPrefix`],
    /// [`NqnError::BadDate`], [`NqnError::BadDomain`], [`NqnError::MissingName`],
    /// [`NqnError::BadChar`], [`NqnError::BadUuid`].
    pub fn new(s: impl Into<String>) -> Result<Self> {
        let s = s.into();
        validate(&s)?;
        Ok(Nqn(s))
    }

    /// The UUID-form NQN of a UUID.
    pub fn from_uuid(uuid: &[u8; 16]) -> Self {
        Nqn(format!("{UUID_PREFIX}{}", format_uuid(uuid)))
    }

    /// The NQN as a string.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether this is the well-known discovery NQN.
    pub fn is_discovery(&self) -> bool {
        self.0 == DISCOVERY_NQN
    }
}

impl fmt::Display for Nqn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::str::FromStr for Nqn {
    type Err = NqnError;
    fn from_str(s: &str) -> Result<Self> {
        Nqn::new(s)
    }
}

impl TryFrom<String> for Nqn {
    type Error = NqnError;
    fn try_from(s: String) -> Result<Self> {
        Nqn::new(s)
    }
}

impl From<Nqn> for String {
    fn from(n: Nqn) -> String {
        n.0
    }
}

/// Formats 16 bytes as a lower-case hyphenated UUID.
pub fn format_uuid(u: &[u8; 16]) -> String {
    let h: String = u.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

/// Parses a hyphenated UUID (either case).
pub fn parse_uuid(s: &str) -> Option<[u8; 16]> {
    let b = s.as_bytes();
    if b.len() != 36 || [8, 13, 18, 23].iter().any(|&i| b[i] != b'-') {
        return None;
    }
    let hex: Vec<u8> = b.iter().copied().filter(|&c| c != b'-').collect();
    if hex.len() != 32 {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, pair) in hex.chunks(2).enumerate() {
        let s = std::str::from_utf8(pair).ok()?;
        out[i] = u8::from_str_radix(s, 16).ok()?;
    }
    Some(out)
}

fn validate(s: &str) -> Result<()> {
    if s.len() > MAX_NQN_LEN {
        return Err(NqnError::TooLong { len: s.len() });
    }
    if s.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(NqnError::BadChar(s.to_owned()));
    }
    let Some(rest) = s.strip_prefix("nqn.") else {
        return Err(NqnError::MissingPrefix(s.to_owned()));
    };
    if let Some(uuid) = s.strip_prefix(UUID_PREFIX) {
        return match parse_uuid(uuid) {
            Some(_) => Ok(()),
            None => Err(NqnError::BadUuid(s.to_owned())),
        };
    }
    if s == DISCOVERY_NQN {
        return Ok(());
    }
    let date = rest.as_bytes();
    let date_ok = date.len() >= 8
        && date[..4].iter().all(u8::is_ascii_digit)
        && date[4] == b'-'
        && date[5..7].iter().all(u8::is_ascii_digit)
        && matches!(
            (date[5], date[6]),
            (b'0', b'1'..=b'9') | (b'1', b'0'..=b'2')
        )
        && date[7] == b'.';
    if !date_ok {
        return Err(NqnError::BadDate(s.to_owned()));
    }
    let after_date = &rest[8..];
    let (domain, name) = match after_date.split_once(':') {
        Some((d, n)) => (d, n),
        None => (after_date, ""),
    };
    let label_ok = |l: &str| {
        !l.is_empty()
            && !l.starts_with('-')
            && !l.ends_with('-')
            && l.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'-')
    };
    if domain.is_empty() || !domain.split('.').all(label_ok) {
        return Err(NqnError::BadDomain(s.to_owned()));
    }
    if name.is_empty() {
        return Err(NqnError::MissingName(s.to_owned()));
    }
    Ok(())
}

/// The default host NQN: the one in [`HOSTNQN_PATH`] if that file exists, else one derived
/// stably from [`MACHINE_ID_PATH`].
///
/// # Errors
/// As [`default_host_nqn_from`].
pub fn default_host_nqn() -> Result<Nqn> {
    default_host_nqn_from(Path::new(HOSTNQN_PATH), Path::new(MACHINE_ID_PATH))
}

/// [`default_host_nqn`] with explicit file paths.
///
/// The derived form is `nqn.2014-08.org.nvmexpress:uuid:<uuid>` where the UUID is an
/// application-specific hash of the machine id (as systemd's `sd_id128_get_machine_app_specific`
/// recommends, so that the machine id itself is not disclosed): the first 16 bytes of
/// SHA-256("rpma host nqn v1" || machine id), with the version-4/variant-1 bits set.
///
/// # Errors
/// [`NqnError::BadHostNqnFile`] if the host NQN file exists but is invalid; [`NqnError::Read`] if
/// a file exists but cannot be read, or neither exists; [`NqnError::BadMachineId`].
pub fn default_host_nqn_from(hostnqn: &Path, machine_id: &Path) -> Result<Nqn> {
    match std::fs::read_to_string(hostnqn) {
        Ok(s) => {
            return Nqn::new(s.trim()).map_err(|e| NqnError::BadHostNqnFile {
                path: hostnqn.to_owned(),
                source: Box::new(e),
            })
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(source) => {
            return Err(NqnError::Read {
                path: hostnqn.to_owned(),
                source,
            })
        }
    }
    let id = std::fs::read_to_string(machine_id).map_err(|source| NqnError::Read {
        path: machine_id.to_owned(),
        source,
    })?;
    let id = id.trim();
    if id.len() != 32 || !id.bytes().all(|c| c.is_ascii_hexdigit()) {
        return Err(NqnError::BadMachineId {
            path: machine_id.to_owned(),
        });
    }
    let digest = Sha256::new()
        .chain_update(b"rpma host nqn v1")
        .chain_update(id.to_ascii_lowercase().as_bytes())
        .finalize();
    let mut uuid = [0u8; 16];
    uuid.copy_from_slice(&digest[..16]);
    uuid[6] = (uuid[6] & 0x0f) | 0x40;
    uuid[8] = (uuid[8] & 0x3f) | 0x80;
    Ok(Nqn::from_uuid(&uuid))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_good_names() {
        for s in [
            "nqn.2026-11.io.rpma:demo",
            "nqn.2014-08.org.nvmexpress:uuid:0f8fad5b-d9cb-469f-a165-70867728950e",
            "nqn.2014-08.org.nvmexpress:uuid:0F8FAD5B-D9CB-469F-A165-70867728950E",
            DISCOVERY_NQN,
            "nqn.1999-12.com.example-corp:disk:a/b",
        ] {
            assert_eq!(Nqn::new(s).unwrap().as_str(), s);
        }
        let long = format!("nqn.2026-11.io.rpma:{}", "x".repeat(MAX_NQN_LEN - 20));
        assert_eq!(long.len(), MAX_NQN_LEN);
        Nqn::new(long).unwrap();
    }

    #[test]
    fn rejects_each_rule() {
        let long = format!("nqn.2026-11.io.rpma:{}", "x".repeat(MAX_NQN_LEN - 19));
        assert!(matches!(
            Nqn::new(long),
            Err(NqnError::TooLong { len: 224 })
        ));
        assert!(matches!(
            Nqn::new("iqn.2026-11.io.rpma:x"),
            Err(NqnError::MissingPrefix(_))
        ));
        assert!(matches!(Nqn::new(""), Err(NqnError::MissingPrefix(_))));
        for bad in [
            "nqn.26-11.io.rpma:x",
            "nqn.2026-13.io.rpma:x",
            "nqn.2026-00.io:x",
            "nqn.2026-1",
        ] {
            assert!(matches!(Nqn::new(bad), Err(NqnError::BadDate(_))), "{bad}");
        }
        for bad in [
            "nqn.2026-11.:x",
            "nqn.2026-11.io..rpma:x",
            "nqn.2026-11.io_x:y",
            "nqn.2026-11.-a:x",
        ] {
            assert!(
                matches!(Nqn::new(bad), Err(NqnError::BadDomain(_))),
                "{bad}"
            );
        }
        for bad in ["nqn.2026-11.io.rpma", "nqn.2026-11.io.rpma:"] {
            assert!(
                matches!(Nqn::new(bad), Err(NqnError::MissingName(_))),
                "{bad}"
            );
        }
        assert!(matches!(
            Nqn::new("nqn.2026-11.io.rpma:a b"),
            Err(NqnError::BadChar(_))
        ));
        assert!(matches!(
            Nqn::new("nqn.2026-11.io.rpma:a\n"),
            Err(NqnError::BadChar(_))
        ));
        for bad in [
            "nqn.2014-08.org.nvmexpress:uuid:",
            "nqn.2014-08.org.nvmexpress:uuid:0f8fad5b-d9cb-469f-a165-70867728950",
            "nqn.2014-08.org.nvmexpress:uuid:0f8fad5bXd9cb-469f-a165-70867728950e",
            "nqn.2014-08.org.nvmexpress:uuid:zf8fad5b-d9cb-469f-a165-70867728950e",
        ] {
            assert!(matches!(Nqn::new(bad), Err(NqnError::BadUuid(_))), "{bad}");
        }
    }

    #[test]
    fn uuid_round_trip() {
        let u = [0xabu8; 16];
        let s = format_uuid(&u);
        assert_eq!(s, "abababab-abab-abab-abab-abababababab");
        assert_eq!(parse_uuid(&s), Some(u));
        assert_eq!(parse_uuid("abababababababababababababababababab"), None);
    }

    #[test]
    fn default_host_nqn_prefers_the_file() {
        let d = tempfile::tempdir().unwrap();
        let h = d.path().join("hostnqn");
        let m = d.path().join("machine-id");
        std::fs::write(&h, "nqn.2026-11.io.rpma:host1\n").unwrap();
        std::fs::write(&m, "0123456789abcdef0123456789abcdef\n").unwrap();
        assert_eq!(
            default_host_nqn_from(&h, &m).unwrap().as_str(),
            "nqn.2026-11.io.rpma:host1"
        );
        std::fs::write(&h, "garbage\n").unwrap();
        assert!(matches!(
            default_host_nqn_from(&h, &m),
            Err(NqnError::BadHostNqnFile { .. })
        ));
    }

    #[test]
    fn default_host_nqn_from_machine_id_is_stable_and_uuid_form() {
        let d = tempfile::tempdir().unwrap();
        let h = d.path().join("absent");
        let m = d.path().join("machine-id");
        std::fs::write(&m, "0123456789abcdef0123456789abcdef\n").unwrap();
        let a = default_host_nqn_from(&h, &m).unwrap();
        let b = default_host_nqn_from(&h, &m).unwrap();
        assert_eq!(a, b);
        assert!(a.as_str().starts_with(UUID_PREFIX));
        // The machine id itself is not disclosed.
        assert!(!a.as_str().replace('-', "").contains("0123456789abcdef"));
        std::fs::write(&m, "fedcba9876543210fedcba9876543210").unwrap();
        assert_ne!(default_host_nqn_from(&h, &m).unwrap(), a);
    }

    #[test]
    fn default_host_nqn_errors() {
        let d = tempfile::tempdir().unwrap();
        let h = d.path().join("absent");
        let m = d.path().join("machine-id");
        assert!(matches!(
            default_host_nqn_from(&h, &m),
            Err(NqnError::Read { .. })
        ));
        std::fs::write(&m, "not-a-machine-id").unwrap();
        assert!(matches!(
            default_host_nqn_from(&h, &m),
            Err(NqnError::BadMachineId { .. })
        ));
    }

    #[test]
    fn serde_validates() {
        let good = postcard::to_allocvec(&"nqn.2026-11.io.rpma:x".to_string()).unwrap();
        let n: Nqn = postcard::from_bytes(&good).unwrap();
        assert_eq!(n.as_str(), "nqn.2026-11.io.rpma:x");
        let bad = postcard::to_allocvec(&"nqn.bad".to_string()).unwrap();
        assert!(postcard::from_bytes::<Nqn>(&bad).is_err());
    }
}
