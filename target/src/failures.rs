//! Failed namespaces, remembered across reloads, restarts and SIGKILL: the state file
//! (`state_file`, beside the configuration by default).
//!
//! Linux reports a write-back error once and marks the pages it could not write clean, so a
//! target that forgot a failure on restart would serve those pages and call them durable
//! (docs/persistence.md, "A failed write-back is not forgotten"). The [`FailureLedger`] keeps
//! every failed namespace's backing file with the failure and its time until an operator
//! clears it explicitly (`rpma-target clear-failure`, through the control socket).
//!
//! # The file
//!
//! It is allocated once, at start-up, at its full size: two slots of [`SLOT`] bytes. Each
//! update writes the whole list into the slot not holding the newest copy and `fdatasync`s it,
//! so recording a failure allocates no block of the filesystem (a full filesystem, the usual
//! reason for a failed write-back, can still take it) and a crash in the middle of an update
//! leaves the other slot intact. A slot is a text line
//! `rpma-target state v1 seq=N len=L crc32c=XXXXXXXX`, then `L` bytes of JSON, then zeros
//! (a path is a JSON string, or the array of its bytes where it is not UTF-8);
//! the valid slot with the highest `seq` wins. A file whose slots are both damaged is refused
//! (the daemon does not start): nobody could tell which namespaces had failed. So is one that
//! holds no copy at all but the two slots of zeros an earlier version left until a namespace
//! first failed (empty, or cut short): the daemon writes a first copy (seq 1, nothing failed)
//! into the file it creates, and into such an earlier one.
//!
//! The list in memory is what the daemon goes by: a failure is listed there before it is
//! written, and a write that fails uses up its `seq` and leaves the list to the next write
//! (the next failure, or a reload, which records every failed namespace again).
//!
//! It is created mode 0600, and one that group or others may write is refused (the daemon does
//! not start; `chmod 600` it), as key files with such bits are: whoever can write it can make
//! the next start forget a failure (a copy with a higher `seq` and an empty list).

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{FileExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use rpma_common::pmem::SyncFailure;
use serde::{Deserialize, Serialize};

/// Bytes per slot (the file is two of them).
pub const SLOT: usize = 64 * 1024;

const MAGIC: &str = "rpma-target state v1";

/// Errors of the state file.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LedgerError {
    /// The file could not be created, allocated, read or written.
    #[error(
        "state file {}: cannot {op} (it remembers failed namespaces across restarts; set \
         `state_file` to a path the daemon can write, on another filesystem than the \
         namespaces if you can)",
        path.display()
    )]
    Io {
        /// The file.
        path: PathBuf,
        /// What was being done.
        op: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// Neither slot holds a valid copy, or the file holds none at all (empty, cut short).
    #[error(
        "state file {}: damaged ({why}); it says which namespaces failed, so the daemon will \
         not guess: restore it, or remove it once you have checked every namespace's data",
        path.display()
    )]
    Damaged {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        why: String,
    },
    /// Another process (another rpma-target) holds the state file's lock.
    #[error(
        "state file {} is in use by a running daemon (another rpma-target holds its lock): \
         give each daemon a state_file of its own",
        path.display()
    )]
    InUse {
        /// The file.
        path: PathBuf,
    },
    /// Others may write the file, or another user owns it.
    #[error(
        "state file {} has mode {mode:04o} and owner uid {owner}: others may write it, or \
         another user owns it, and a rewritten file would make the daemon forget failed \
         namespaces (chown it to the daemon's user and chmod 600)",
        path.display()
    )]
    Permissions {
        /// The file.
        path: PathBuf,
        /// Its mode bits.
        mode: u32,
        /// Its owner.
        owner: u32,
    },
    /// The list does not fit in a slot.
    #[error("state file {}: {len} bytes of failures do not fit in {SLOT}", path.display())]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// The list's size.
        len: usize,
    },
}

/// Result of the ledger.
pub type Result<T> = std::result::Result<T, LedgerError>;

/// A failed namespace, as remembered.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Failed {
    /// The backing file (as configured when it failed, canonicalized).
    #[serde(with = "path_text")]
    pub path: PathBuf,
    /// Its subsystem then.
    pub subsystem: String,
    /// Its namespace id then.
    pub nsid: u32,
    /// The call that failed: "fdatasync", "msync", ...
    pub op: String,
    /// Its errno.
    pub errno: i32,
    /// The failure as logged ("fdatasync failed: No space left on device (os error 28)").
    pub failure: String,
    /// When it failed, in ms since the Unix epoch.
    pub since_unix_ms: u64,
    /// The file's device and inode then (None in state files written before they were kept):
    /// the same file under another path (moved, linked, and the configuration edited) is the
    /// same failed namespace.
    #[serde(default)]
    pub file: Option<(u64, u64)>,
}

/// A path in the state file: a JSON string when it is UTF-8 (as in every state file written
/// before), else its bytes as an array of numbers. Serde refuses a path that is not UTF-8 (the
/// ledger panicked on one), and a JSON string cannot hold bytes that are not.
mod path_text {
    use std::ffi::OsString;
    use std::os::unix::ffi::{OsStrExt, OsStringExt};
    use std::path::{Path, PathBuf};

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(path: &Path, s: S) -> Result<S::Ok, S::Error> {
        match path.to_str() {
            Some(text) => s.serialize_str(text),
            None => s.collect_seq(path.as_os_str().as_bytes()),
        }
    }

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Repr {
        Text(String),
        Bytes(Vec<u8>),
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<PathBuf, D::Error> {
        Ok(match Repr::deserialize(d)? {
            Repr::Text(text) => PathBuf::from(text),
            Repr::Bytes(bytes) => PathBuf::from(OsString::from_vec(bytes)),
        })
    }
}

impl Failed {
    /// Whether this is the failure of the file at `path` (canonical `key`, file `id`): the
    /// same path, or the same file under another path.
    pub fn is_of(&self, key: &Path, id: Option<(u64, u64)>) -> bool {
        self.path == key || (self.file.is_some() && self.file == id)
    }
}

impl Failed {
    /// The failure, as the pmem layer reports it.
    pub fn sync_failure(&self) -> SyncFailure {
        // The layer names its calls with static strings; a name this build does not know
        // still reads as a failed write-back.
        let op = match self.op.as_str() {
            "msync" => "msync",
            "fdatasync" => "fdatasync",
            "pwrite" => "pwrite",
            "load/store" => "load/store",
            _ => "write-back",
        };
        SyncFailure {
            op,
            errno: self.errno,
        }
    }

    /// When it failed, for people (UTC).
    pub fn since(&self) -> String {
        utc(self.since_unix_ms / 1000)
    }
}

/// `YYYY-MM-DD HH:MM:SS UTC` of Unix time `secs`.
pub fn utc(secs: u64) -> String {
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil from days (Howard Hinnant's algorithm), for days since 1970-01-01.
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02} UTC",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct Contents {
    failed: Vec<Failed>,
}

#[derive(Debug)]
struct Inner {
    /// Locked (flock) as long as the ledger is open: two daemons writing one state file would
    /// each write its own list over the other's, and forget the other's failures.
    file: nix::fcntl::Flock<File>,
    seq: u64,
    /// The slot holding the newest copy.
    slot: usize,
    /// Every failure remembered, whether or not its write succeeded: what the daemon goes by,
    /// and what every write takes whole.
    failed: Vec<Failed>,
    /// A write failed since the last that succeeded: the file may lack some of `failed`.
    dirty: bool,
    /// Tests: how the next write of a slot fails.
    #[cfg(test)]
    fail_next: Option<FailAt>,
}

/// Tests: where a write of a slot fails.
#[cfg(test)]
#[derive(Debug, Clone, Copy)]
enum FailAt {
    /// Before anything is written (ENOSPC, say).
    Write,
    /// In the sync: the copy is in the page cache, and a restart would read it.
    Sync,
}

/// The failed namespaces and the file that remembers them. Shared by the namespaces (each
/// mapping's failure hook records into it) and the daemon.
#[derive(Debug)]
pub struct FailureLedger {
    path: PathBuf,
    inner: Mutex<Inner>,
}

/// The canonical form of a backing path, the ledger's key (the path itself if it cannot be
/// resolved).
pub fn key_of(path: &Path) -> PathBuf {
    path.canonicalize().unwrap_or_else(|_| path.to_owned())
}

/// The device and inode of the file at `path` (followed as opening it would), if it names one.
pub fn file_id_of(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// One slot's contents: None if it is all zeros (never written).
fn parse_slot(buf: &[u8]) -> std::result::Result<Option<(u64, Contents)>, String> {
    if buf.iter().all(|&b| b == 0) {
        return Ok(None);
    }
    let nl = buf
        .iter()
        .position(|&b| b == b'\n')
        .ok_or("no header line")?;
    let head = std::str::from_utf8(&buf[..nl]).map_err(|_| "header is not text")?;
    let rest = head
        .strip_prefix(MAGIC)
        .ok_or_else(|| format!("header {head:?}"))?;
    let mut seq = None;
    let mut len = None;
    let mut crc = None;
    for kv in rest.split_whitespace() {
        match kv.split_once('=') {
            Some(("seq", v)) => seq = v.parse::<u64>().ok(),
            Some(("len", v)) => len = v.parse::<usize>().ok(),
            Some(("crc32c", v)) => crc = u32::from_str_radix(v, 16).ok(),
            _ => return Err(format!("header {head:?}")),
        }
    }
    let (Some(seq), Some(len), Some(crc)) = (seq, len, crc) else {
        return Err(format!("header {head:?}"));
    };
    let body = buf
        .get(nl + 1..nl + 1 + len)
        .ok_or("length past the slot")?;
    if crc_fast::crc32_iscsi(body) != crc {
        return Err("checksum mismatch".into());
    }
    let c: Contents = serde_json::from_slice(body).map_err(|e| e.to_string())?;
    Ok(Some((seq, c)))
}

/// The newest valid copy in a state file's bytes: (seq, slot, contents), None if it holds
/// none yet.
fn newest(path: &Path, buf: &[u8]) -> Result<Option<(u64, usize, Contents)>> {
    let mut best: Option<(u64, usize, Contents)> = None;
    let mut damaged = Vec::new();
    for slot in 0..2 {
        let part = buf.get(slot * SLOT..).unwrap_or(&[]);
        let part = &part[..part.len().min(SLOT)];
        match parse_slot(part) {
            Ok(Some((seq, c))) if best.as_ref().is_none_or(|b| seq > b.0) => {
                best = Some((seq, slot, c))
            }
            Ok(_) => {}
            Err(why) => damaged.push(format!("slot {slot}: {why}")),
        }
    }
    if best.is_none() && !damaged.is_empty() {
        return Err(LedgerError::Damaged {
            path: path.to_owned(),
            why: damaged.join("; "),
        });
    }
    // No copy, and not the two slots of zeros an earlier version allocated and left until a
    // namespace first failed: emptied or cut short (the daemon writes a first copy into the
    // file it creates), so nobody can say that nothing failed.
    if best.is_none() && buf.len() != 2 * SLOT {
        let what = match buf.len() {
            0 => "empty".to_owned(),
            n => format!("{n} bytes of zeros, not {}", 2 * SLOT),
        };
        return Err(LedgerError::Damaged {
            path: path.to_owned(),
            why: format!("{what}: it holds no copy, and one the daemon made always does"),
        });
    }
    Ok(best)
}

/// Refuses a state file that others may write or that another user owns. Returns whether
/// its group may write it: the daemon's own file, as the unit's `UMask=0007` made it before
/// the daemon created it 0600, which opening tightens (with a warning) rather than refusing
/// to start after an upgrade.
fn check_mode(path: &Path, meta: &std::fs::Metadata) -> Result<bool> {
    use std::os::unix::fs::MetadataExt;
    let mode = meta.permissions().mode() & 0o7777;
    if mode & 0o002 != 0 || meta.uid() != nix::unistd::geteuid().as_raw() {
        return Err(LedgerError::Permissions {
            path: path.to_owned(),
            mode,
            owner: meta.uid(),
        });
    }
    Ok(mode & 0o020 != 0)
}

/// What the state file at `path` remembers, read without creating or changing anything
/// (`check-config`): None if there is no file yet.
///
/// # Errors
/// [`LedgerError::Io`] (unreadable), [`LedgerError::Permissions`], [`LedgerError::Damaged`].
pub fn peek(path: &Path) -> Result<Option<Vec<Failed>>> {
    match std::fs::read(path) {
        Ok(buf) => {
            let meta = std::fs::metadata(path).map_err(|source| LedgerError::Io {
                path: path.to_owned(),
                op: "read",
                source,
            })?;
            check_mode(path, &meta)?;
            Ok(Some(
                newest(path, &buf)?.map(|b| b.2.failed).unwrap_or_default(),
            ))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(LedgerError::Io {
            path: path.to_owned(),
            op: "read",
            source,
        }),
    }
}

impl FailureLedger {
    /// Opens the state file at `path`, creating it (allocating both slots, with a first copy:
    /// nothing failed) if missing, and reads what it remembers, holding its lock until dropped. Fails if the file cannot be
    /// written: a daemon that could not remember a failure must not start. Created mode 0600;
    /// one that group or others may write is refused.
    ///
    /// # Errors
    /// [`LedgerError::Io`], [`LedgerError::Permissions`], [`LedgerError::Damaged`],
    /// [`LedgerError::InUse`].
    pub fn open(path: &Path) -> Result<FailureLedger> {
        let io = |op| {
            move |source| LedgerError::Io {
                path: path.to_owned(),
                op,
                source,
            }
        };
        let options = || {
            let mut o = std::fs::OpenOptions::new();
            o.read(true).write(true).mode(0o600);
            o
        };
        // Created here, or found: a file found that holds no copy was emptied or cut short
        // (one created here gets its first copy below), unless an earlier version left it.
        let (file, created) = match options().create_new(true).open(path) {
            Ok(f) => (f, true),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                (options().open(path).map_err(io("open for writing"))?, false)
            }
            Err(e) => return Err(io("open for writing")(e)),
        };
        let meta = file.metadata().map_err(io("read"))?;
        if check_mode(path, &meta)? {
            let mode = meta.permissions().mode() & 0o7777;
            file.set_permissions(std::fs::Permissions::from_mode(mode & !0o020))
                .map_err(io("chmod g-w"))?;
            log::warn!(
                "state file {}: had mode {mode:04o}, which the daemon's group could write (as \
                 the unit's UMask made it before this version): made {:04o}; if members of \
                 that group you do not trust could have rewritten it, check the failed \
                 namespaces it lists (`rpma-target check-config`) against your records",
                path.display(),
                mode & !0o020
            );
        }
        use nix::fcntl::{Flock, FlockArg};
        let mut file = match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(f) => f,
            Err((_, nix::errno::Errno::EWOULDBLOCK)) => {
                return Err(LedgerError::InUse {
                    path: path.to_owned(),
                })
            }
            Err((_, e)) => return Err(io("lock")(std::io::Error::from(e))),
        };
        let mut buf = Vec::new();
        file.read_to_end(&mut buf).map_err(io("read"))?;
        let best = match created {
            true => None,
            false => newest(path, &buf)?,
        };
        // Allocated up front: an update then needs no new block.
        if buf.len() < 2 * SLOT {
            file.seek(SeekFrom::Start(buf.len() as u64))
                .and_then(|_| file.write_all(&vec![0u8; 2 * SLOT - buf.len()]))
                .map_err(io("allocate"))?;
        }
        file.sync_all().map_err(io("sync"))?;
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            // The new file's name is durable too.
            if let Ok(d) = File::open(dir) {
                let _ = d.sync_all();
            }
        }
        let first = best.is_none();
        let (seq, slot, c) = best.unwrap_or((0, 1, Contents::default()));
        let ledger = FailureLedger {
            path: path.to_owned(),
            inner: Mutex::new(Inner {
                file,
                seq,
                slot,
                failed: c.failed,
                dirty: false,
                #[cfg(test)]
                fail_next: None,
            }),
        };
        if first {
            if !created {
                log::warn!(
                    "state file {}: holds no copy yet (all zeros, as versions before this one \
                     left it until a namespace first failed): taken as no namespace having \
                     failed",
                    path.display()
                );
            }
            // From now on it always holds one: a file that holds none was emptied or cut short.
            ledger.write_listed(&mut ledger.lock())?;
        }
        Ok(ledger)
    }

    /// The state file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// What is remembered about the file at `path` (by its path, or as the same file under
    /// another path), if it failed.
    pub fn get(&self, path: &Path) -> Option<Failed> {
        let (key, id) = (key_of(path), file_id_of(path));
        self.lock()
            .failed
            .iter()
            .find(|f| f.is_of(&key, id))
            .cloned()
    }

    /// Every failed namespace remembered.
    pub fn all(&self) -> Vec<Failed> {
        self.lock().failed.clone()
    }

    /// Remembers that the namespace backed by `path` failed with `failure` (kept as it is if
    /// the file is remembered already: the first failure and its time stand). Written to the
    /// file before this returns (the whole list, with any failure an earlier write could not
    /// write).
    ///
    /// # Errors
    /// [`LedgerError::Io`], [`LedgerError::TooLarge`]: the failure is then not remembered
    /// across a restart yet; it is listed here all the same ([`get`](Self::get)), and the next
    /// write of the file takes it (another record, even of a failure already listed, as a
    /// reload reopening the failed namespace makes).
    pub fn record(
        &self,
        subsystem: &str,
        nsid: u32,
        path: &Path,
        failure: &SyncFailure,
    ) -> Result<Failed> {
        self.record_file(subsystem, nsid, path, file_id_of(path), failure)
    }

    /// [`record`](Self::record) for the file `id` (device and inode) that failed, whatever
    /// `path` names by now (a file moved over it before a reload).
    ///
    /// # Errors
    /// As [`record`](Self::record).
    pub fn record_file(
        &self,
        subsystem: &str,
        nsid: u32,
        path: &Path,
        id: Option<(u64, u64)>,
        failure: &SyncFailure,
    ) -> Result<Failed> {
        let key = key_of(path);
        let mut g = self.lock();
        if let Some(f) = g.failed.iter().find(|f| f.is_of(&key, id)).cloned() {
            if g.dirty {
                self.write_listed(&mut g)?;
            }
            return Ok(f);
        }
        let entry = Failed {
            path: key,
            subsystem: subsystem.to_owned(),
            nsid,
            op: failure.op.to_owned(),
            errno: failure.errno,
            failure: failure.to_string(),
            since_unix_ms: now_ms(),
            file: id,
        };
        // Listed before it is written: a write that fails leaves it to the next write, which
        // takes the whole list (written after, it was gone once a later failure's write
        // succeeded).
        g.failed.push(entry.clone());
        self.write_listed(&mut g)?;
        Ok(entry)
    }

    /// Forgets the failure of the file at `path` (the operator's explicit act). Returns what
    /// was remembered, None if nothing was.
    ///
    /// # Errors
    /// [`LedgerError::Io`]: nothing is forgotten then.
    pub fn clear(&self, path: &Path) -> Result<Option<Failed>> {
        let (key, id) = (key_of(path), file_id_of(path));
        let mut g = self.lock();
        let Some(at) = g.failed.iter().position(|f| f.is_of(&key, id)) else {
            return Ok(None);
        };
        let mut next = g.failed.clone();
        let gone = next.remove(at);
        if let Err(e) = self.write(&mut g, &next) {
            // The copy that failed (the newest, without the failure) may be in the page cache,
            // which a restart reads: the list as it stands goes over it, with a higher seq.
            let _ = self.write_listed(&mut g);
            return Err(e);
        }
        g.failed = next;
        Ok(Some(gone))
    }

    /// Tests: the next write of the file fails before anything is written.
    #[cfg(test)]
    pub(crate) fn fail_next_write(&self) {
        self.lock().fail_next = Some(FailAt::Write);
    }

    /// Writes the list as it stands ([`write`](Self::write)).
    fn write_listed(&self, g: &mut Inner) -> Result<()> {
        let failed = std::mem::take(&mut g.failed);
        let written = self.write(g, &failed);
        g.failed = failed;
        written
    }

    /// Writes `failed` into the slot not holding the newest copy, then makes it the newest.
    /// A write that fails uses up its seq (its copy may be in the page cache, or reach the
    /// media, and must never outrank a later one) and leaves the ledger dirty: the next
    /// record writes the list again even if it adds nothing.
    fn write(&self, g: &mut Inner, failed: &[Failed]) -> Result<()> {
        #[derive(Serialize)]
        struct Borrowed<'a> {
            failed: &'a [Failed],
        }
        g.dirty = true;
        let body = serde_json::to_vec(&Borrowed { failed }).map_err(|e| LedgerError::Io {
            path: self.path.clone(),
            op: "serialize",
            source: std::io::Error::other(e),
        })?;
        let seq = g.seq + 1;
        let head = format!(
            "{MAGIC} seq={seq} len={} crc32c={:08x}\n",
            body.len(),
            crc_fast::crc32_iscsi(&body)
        );
        let mut slot = Vec::with_capacity(SLOT);
        slot.extend_from_slice(head.as_bytes());
        slot.extend_from_slice(&body);
        if slot.len() > SLOT {
            return Err(LedgerError::TooLarge {
                path: self.path.clone(),
                len: slot.len(),
            });
        }
        slot.resize(SLOT, 0);
        // Never the slot of the newest copy that is known durable: a failed write leaves that
        // one for a restart, and the next write goes over the failed one's.
        let to = 1 - g.slot;
        let io = |op| {
            move |source| LedgerError::Io {
                path: self.path.clone(),
                op,
                source,
            }
        };
        g.seq = seq;
        #[cfg(test)]
        let fail = g.fail_next.take();
        #[cfg(test)]
        if matches!(fail, Some(FailAt::Write)) {
            return Err(io("write")(std::io::Error::from_raw_os_error(libc::EIO)));
        }
        g.file
            .write_all_at(&slot, (to * SLOT) as u64)
            .map_err(io("write"))?;
        #[cfg(test)]
        if matches!(fail, Some(FailAt::Sync)) {
            return Err(io("sync")(std::io::Error::from_raw_os_error(libc::EIO)));
        }
        g.file.sync_data().map_err(io("sync"))?;
        g.slot = to;
        g.dirty = false;
        Ok(())
    }
}

pub mod capacity;
#[cfg(test)]
mod tests;
