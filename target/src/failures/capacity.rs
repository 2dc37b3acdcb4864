//! How many failed namespaces one copy of the state file lists ([`super::SLOT`] bytes): past
//! that a failure is remembered by its file's mark only, and `clear-failure` is refused until
//! fewer are failed. check-config and the daemon warn of a configuration of more namespaces.

use std::path::Path;

use rpma_common::pmem::SyncFailure;

use super::{key_of, Failed, MAGIC, SLOT};

/// How many of the namespaces `files` (subsystem, nsid, backing path) one copy of the state
/// file can list failed at once, each with the longest failure a sync reports: all of them, or
/// the first so many. Past that a failure is remembered by the file's mark only (and on a
/// filesystem that takes none, not across a restart), and `clear-failure` is refused until
/// fewer are failed ([`super::LedgerError::TooLarge`]).
pub fn listable<'a>(files: impl IntoIterator<Item = (&'a str, u32, &'a Path)>) -> usize {
    // The longest failure text a sync gives (errno names differ in length).
    let f = SyncFailure::new(
        "fdatasync",
        &std::io::Error::from_raw_os_error(libc::ESHUTDOWN),
    );
    // The slot's head line at its longest, the body's braces and the separators.
    let mut used = format!("{MAGIC} seq={} len={} crc32c=00000000\n", u64::MAX, SLOT).len()
        + r#"{"failed":[]}"#.len();
    let mut n = 0;
    for (subsystem, nsid, path) in files {
        let entry = Failed {
            path: key_of(path),
            subsystem: subsystem.to_owned(),
            nsid,
            op: f.op.to_owned(),
            errno: f.errno,
            failure: f.to_string(),
            since_unix_ms: u64::MAX,
            file: Some((u64::MAX, u64::MAX)),
        };
        used += serde_json::to_vec(&entry).map_or(usize::MAX / 2, |v| v.len()) + 1;
        if used > SLOT {
            break;
        }
        n += 1;
    }
    n
}

/// The warning for a configuration of `all` namespaces, of which one copy of the state file can
/// list only `listable` failed at once (check-config, and the daemon's log at start and
/// reload); None when it lists them all.
pub fn capacity_warning(cfg: &crate::config::Config) -> Option<String> {
    let files: Vec<(&str, u32, &Path)> = cfg
        .subsystems
        .iter()
        .flat_map(|s| {
            s.namespaces
                .iter()
                .map(move |ns| (s.nqn.as_str(), ns.nsid, ns.path.as_path()))
        })
        .collect();
    let fit = listable(files.iter().copied());
    (fit < files.len()).then(|| {
        format!(
            "the state file lists at most about {fit} failed namespaces at once, and this \
             configuration has {}: past that, a failure is remembered by its file's mark only \
             (on a filesystem that takes no mark, not across a restart), and clear-failure is \
             refused until fewer are failed",
            files.len()
        )
    })
}
