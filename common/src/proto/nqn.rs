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
    /// Whitespace, a control character, or a character that hides or reorders text (a
    /// bidirectional override, a zero-width or other format character:
    /// [`logline::hidden`](crate::logline::hidden)): an NQN is shown in logs and listings.
    #[error("NQN {0:?} contains whitespace, a control character or an invisible one")]
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
    /// Neither a host NQN file nor a machine id exists, and a generated host NQN could be
    /// stored nowhere (so it would not be stable).
    #[error("no host NQN: no {hostnqn} and no {machine_id}, and a generated one cannot be stored (tried {tried})")]
    NoStableHostNqn {
        /// The host NQN file looked for.
        hostnqn: PathBuf,
        /// The machine id file looked for.
        machine_id: PathBuf,
        /// Where storing was tried, comma-separated.
        tried: String,
        /// Why the last place failed.
        #[source]
        source: std::io::Error,
    },
    /// No random bytes for a generated host NQN.
    #[error("cannot generate a host NQN: no random bytes")]
    Random(#[source] getrandom::Error),
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
    if s.chars()
        .any(|c| c.is_whitespace() || crate::logline::hidden(c))
    {
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

/// Where the default host NQN comes from, in this order: a host NQN file, a machine id to
/// derive one from, else a generated one stored once (in the first of `store` that takes it)
/// and read back from there afterwards.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostNqnSources {
    /// nvme-cli's host NQN file ([`HOSTNQN_PATH`]).
    pub hostnqn: PathBuf,
    /// The machine id ([`MACHINE_ID_PATH`]).
    pub machine_id: PathBuf,
    /// Where a generated host NQN is stored (and looked for), in order of preference.
    pub store: Vec<PathBuf>,
}

impl HostNqnSources {
    /// The system's: [`HOSTNQN_PATH`], [`MACHINE_ID_PATH`]; a generated NQN is stored in
    /// [`HOSTNQN_PATH`] if that can be written (as nvme-cli would), else in
    /// `$XDG_STATE_HOME/rpma/hostnqn` (by default `~/.local/state/rpma/hostnqn`).
    pub fn system() -> HostNqnSources {
        let state = std::env::var_os("XDG_STATE_HOME")
            .map(PathBuf::from)
            .filter(|p| p.is_absolute())
            .or_else(|| {
                std::env::var_os("HOME")
                    .map(PathBuf::from)
                    .filter(|p| p.is_absolute())
                    .map(|h| h.join(".local/state"))
            });
        let mut store = vec![PathBuf::from(HOSTNQN_PATH)];
        store.extend(state.map(|s| s.join("rpma/hostnqn")));
        HostNqnSources {
            hostnqn: PathBuf::from(HOSTNQN_PATH),
            machine_id: PathBuf::from(MACHINE_ID_PATH),
            store,
        }
    }
}

/// The default host NQN, from [`HostNqnSources::system`]: the one in [`HOSTNQN_PATH`] if that
/// file exists, else one derived stably from [`MACHINE_ID_PATH`], else (minimal containers
/// have neither) a random UUID NQN generated once and stored so that it stays the same.
///
/// # Errors
/// As [`default_host_nqn_in`].
pub fn default_host_nqn() -> Result<Nqn> {
    default_host_nqn_in(&HostNqnSources::system())
}

/// [`default_host_nqn`] from explicit sources.
///
/// # Errors
/// Those of [`default_host_nqn_from`] except a missing machine id; [`NqnError::BadHostNqnFile`]
/// for an invalid stored NQN; [`NqnError::NoStableHostNqn`] when none of `store` can be
/// written; [`NqnError::Random`].
pub fn default_host_nqn_in(src: &HostNqnSources) -> Result<Nqn> {
    match default_host_nqn_from(&src.hostnqn, &src.machine_id) {
        Err(NqnError::Read { path, source })
            if path == src.machine_id && source.kind() == std::io::ErrorKind::NotFound => {}
        other => return other,
    }
    // Stored earlier?
    for p in &src.store {
        if let Some(n) = read_nqn_file(p)? {
            return Ok(n);
        }
    }
    let mut uuid = [0u8; 16];
    getrandom::fill(&mut uuid).map_err(NqnError::Random)?;
    uuid[6] = (uuid[6] & 0x0f) | 0x40;
    uuid[8] = (uuid[8] & 0x3f) | 0x80;
    let fresh = Nqn::from_uuid(&uuid);
    let mut last = std::io::Error::new(std::io::ErrorKind::NotFound, "no place to store it");
    for p in &src.store {
        match store_once(p, &fresh) {
            // Another process may have stored its own first: that one wins, for everyone.
            Ok(()) | Err(StoreError::Exists) => match read_nqn_file(p)? {
                Some(n) => return Ok(n),
                None => continue,
            },
            Err(StoreError::Io(e)) => last = e,
        }
    }
    Err(NqnError::NoStableHostNqn {
        hostnqn: src.hostnqn.clone(),
        machine_id: src.machine_id.clone(),
        tried: src
            .store
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", "),
        source: last,
    })
}

/// The NQN in `path`, None if it does not exist.
fn read_nqn_file(path: &Path) -> Result<Option<Nqn>> {
    match std::fs::read_to_string(path) {
        Ok(s) => Nqn::new(s.trim())
            .map(Some)
            .map_err(|e| NqnError::BadHostNqnFile {
                path: path.to_owned(),
                source: Box::new(e),
            }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(NqnError::Read {
            path: path.to_owned(),
            source,
        }),
    }
}

enum StoreError {
    Exists,
    Io(std::io::Error),
}

/// Writes `nqn` to `path` unless it exists, atomically: a temporary file beside it, then a
/// hard link (which, unlike rename, never replaces an existing file).
fn store_once(path: &Path, nqn: &Nqn) -> std::result::Result<(), StoreError> {
    use std::io::Write;
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(StoreError::Io)?;
    let tmp = dir.join(format!(".hostnqn.{}.tmp", std::process::id()));
    let written = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(format!("{nqn}\n").as_bytes())?;
        f.sync_all()
    })();
    let linked = written.and_then(|()| std::fs::hard_link(&tmp, path));
    let _ = std::fs::remove_file(&tmp);
    match linked {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Err(StoreError::Exists),
        Err(e) => Err(StoreError::Io(e)),
    }
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
        for bad in [
            "nqn.2026-11.io.rpma:a\n",
            "nqn.2026-11.io.rpma:a\u{202e}b",
            "nqn.2026-11.io.rpma:a\u{200b}b",
            "nqn.2026-11.io.rpma:\u{2066}a",
        ] {
            assert!(matches!(Nqn::new(bad), Err(NqnError::BadChar(_))), "{bad}");
        }
        assert!(Nqn::new("nqn.2026-11.io.rpma:ünïcode").is_ok());
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

    fn sources(d: &Path) -> HostNqnSources {
        HostNqnSources {
            hostnqn: d.join("etc/nvme/hostnqn"),
            machine_id: d.join("etc/machine-id"),
            store: vec![d.join("etc/nvme/hostnqn"), d.join("state/rpma/hostnqn")],
        }
    }

    #[test]
    fn without_hostnqn_or_machine_id_one_is_generated_once_and_kept() {
        let d = tempfile::tempdir().unwrap();
        let src = sources(d.path());
        let a = default_host_nqn_in(&src).unwrap();
        assert!(a.as_str().starts_with(UUID_PREFIX), "{a}");
        // Stored in the first place that takes it, and the same on every later call.
        let stored = std::fs::read_to_string(&src.hostnqn).unwrap();
        assert_eq!(stored.trim(), a.as_str());
        assert_eq!(default_host_nqn_in(&src).unwrap(), a);
        assert!(
            std::fs::read_dir(d.path().join("etc/nvme"))
                .unwrap()
                .count()
                == 1,
            "temporary file left behind"
        );
    }

    #[test]
    fn a_generated_nqn_falls_back_to_the_state_dir_and_is_found_there() {
        let d = tempfile::tempdir().unwrap();
        let mut src = sources(d.path());
        // A host NQN file that cannot be created (as /etc/nvme/hostnqn for a user, or in a
        // read-only /etc): under /proc nothing can be created, even by root.
        let unwritable = PathBuf::from("/proc/rpma-test-no-such-dir/hostnqn");
        src.hostnqn = unwritable.clone();
        src.store[0] = unwritable;
        let a = default_host_nqn_in(&src).unwrap();
        let stored = std::fs::read_to_string(d.path().join("state/rpma/hostnqn")).unwrap();
        assert_eq!(stored.trim(), a.as_str());
        assert_eq!(default_host_nqn_in(&src).unwrap(), a, "stable");
        // A machine id, once there, takes precedence (as before).
        std::fs::create_dir_all(d.path().join("etc")).unwrap();
        std::fs::write(&src.machine_id, "0123456789abcdef0123456789abcdef\n").unwrap();
        let m = default_host_nqn_in(&src).unwrap();
        assert_ne!(m, a);
        assert_eq!(
            m,
            default_host_nqn_from(&src.hostnqn, &src.machine_id).unwrap()
        );
        // Nowhere to store: a clear error naming the places tried.
        std::fs::remove_file(&src.machine_id).unwrap();
        src.store.truncate(1);
        match default_host_nqn_in(&src) {
            Err(NqnError::NoStableHostNqn { tried, .. }) => {
                assert!(
                    tried.contains("/proc/rpma-test-no-such-dir/hostnqn"),
                    "{tried}"
                )
            }
            other => panic!("expected NoStableHostNqn, got {other:?}"),
        }
    }

    #[test]
    fn a_bad_stored_nqn_is_an_error_not_replaced() {
        let d = tempfile::tempdir().unwrap();
        let src = sources(d.path());
        std::fs::create_dir_all(d.path().join("state/rpma")).unwrap();
        std::fs::write(d.path().join("state/rpma/hostnqn"), "garbage\n").unwrap();
        // The first store place is free, but the existing (bad) one is found first.
        assert!(matches!(
            default_host_nqn_in(&src),
            Err(NqnError::BadHostNqnFile { .. })
        ));
    }

    #[test]
    fn system_sources_use_xdg_state_home_or_home() {
        let s = HostNqnSources::system();
        assert_eq!(s.hostnqn, Path::new(HOSTNQN_PATH));
        assert_eq!(s.store[0], Path::new(HOSTNQN_PATH));
        assert!(s.store.iter().skip(1).all(|p| p.ends_with("rpma/hostnqn")));
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
