//! Write-back error reports that a restart would lose, kept in the service manager's file
//! descriptor store.
//!
//! Linux reports a failed write-back of a file once to each open file description that was
//! open when it failed, at its next sync, and marks the pages clean. A daemon killed while
//! its sync of a page-cache namespace ran (SIGKILL at the end of a stop timeout, the watchdog,
//! the OOM killer, all likelier while a failing disk makes syncs slow) leaves the kernel to
//! finish that sync: it takes the report, and the process is gone before it records the
//! failure. The next start opens the file anew, and no description opened then ever hears of
//! it: the namespace was served healthy, and a host's retried Flush (an NVMe/TCP host retries
//! what a lost controller left unanswered) was answered durable over pages the disk never got.
//!
//! So the daemon hands the service manager one read-only description of each page-cache
//! namespace file it serves (`FDSTORE=1`, named `rpma-ns-DEV-INO`), opened when it first
//! served the file. systemd keeps it across restarts of the service (`FileDescriptorStoreMax=`
//! in the unit) and passes it back (`$LISTEN_FDS`). At start-up, before it serves anything,
//! the daemon syncs each such description: an error it reports is one no sync of this run can
//! hear, and the namespace fails with it (recorded as any write-back failure). A description
//! of a file no longer served is taken out of the store. An error reported for a file this
//! start does not serve (its namespace taken out of the configuration meanwhile) marks the file
//! failed and is remembered by its device and inode, so that a reload or a restart that serves
//! it again opens it failed (it was dropped, and the file served healthy once added back).
//!
//! Outside systemd (no `$NOTIFY_SOCKET`) nothing is stored, and such a loss is not caught.
//! An operator's `clear-failure` syncs the file's description, so that the failure it cleared
//! is not heard again at the next start.

use std::collections::BTreeMap;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};

use rpma_common::pmem::{Domain, Persist, SyncFailure};

use crate::failures::FailureLedger;
use crate::namespace::NamespaceTable;
use crate::notify::Notifier;

/// The names of the descriptors this daemon stores.
const PREFIX: &str = "rpma-ns-";

/// A file by device and inode.
type FileId = (u64, u64);

/// The descriptors kept for the page-cache namespace files served (see the module docs).
#[derive(Debug, Default)]
pub struct FdStore {
    held: BTreeMap<FileId, OwnedFd>,
}

fn name_of(id: FileId) -> String {
    format!("{PREFIX}{}-{}", id.0, id.1)
}

/// The files of the page-cache namespaces `table` serves, each with a descriptor of it.
fn served(table: &NamespaceTable) -> BTreeMap<FileId, std::os::fd::RawFd> {
    table
        .iter()
        .filter(|(_, ns)| ns.domain() == Domain::PageCache)
        .filter_map(|(_, ns)| Some((ns.file_id()?, ns.mapping.backing_fd()?.as_raw_fd())))
        .collect()
}

impl FdStore {
    /// The descriptors a previous run stored (`$LISTEN_FDS`, those named `rpma-ns-...`);
    /// others passed are closed.
    pub fn from_env() -> FdStore {
        let mut held = BTreeMap::new();
        for (name, fd) in crate::notify::listen_fds() {
            if !name.starts_with(PREFIX) {
                log::warn!("a descriptor named {name:?} passed by the service manager: closed");
                continue;
            }
            if let Some(id) = crate::namespace::file_id_of(fd.as_fd()) {
                held.insert(id, fd);
            }
        }
        FdStore { held }
    }

    /// How many descriptors it holds.
    pub fn len(&self) -> usize {
        self.held.len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    /// Before serving (start-up): syncs each stored description, and fails the namespaces of a
    /// file whose sync reports an error (one that no sync of this run can hear: see the module
    /// docs); a file `table` does not serve is marked failed and remembered in `ledger`
    /// instead. Then [`keep`](Self::keep). Returns how many namespaces it failed.
    pub fn check(
        &mut self,
        table: &NamespaceTable,
        ledger: &FailureLedger,
        notifier: &Notifier,
    ) -> usize {
        let mut failed = 0;
        for (id, fd) in &self.held {
            let Err(e) = nix::unistd::fdatasync(fd.as_raw_fd()) else {
                continue;
            };
            let e = std::io::Error::from(e);
            let f = SyncFailure::new("fdatasync", &e);
            if !table.iter().any(|(_, ns)| ns.file_id() == Some(*id)) {
                unserved_failure(fd, *id, f, ledger);
                continue;
            }
            for (key, ns) in table.iter().filter(|(_, ns)| ns.file_id() == Some(*id)) {
                if ns.mapping.record_failure(f) {
                    failed += 1;
                    // The pages whose write-back failed are clean in the page cache: dropped,
                    // so that hosts read what the media holds, as a failed reopening does.
                    if let Err(e) = ns.mapping.drop_page_cache() {
                        log::warn!(
                            "subsystem {} namespace {}: {}",
                            key.0,
                            key.1,
                            rpma_common::error_chain(&e)
                        );
                    }
                    log::error!(
                        "subsystem {} namespace {} ({}) has FAILED: a write-back of it failed \
                         ({f}) and this daemon's previous run ended before it recorded it (its \
                         sync took the kernel's one report); every durability request on it is \
                         refused until an operator clears it with `rpma-target clear-failure \
                         {} {}` (writes not acknowledged as durable before may be lost)",
                        key.0,
                        key.1,
                        ns.config.path.display(),
                        key.0,
                        key.1
                    );
                }
            }
        }
        self.keep(table, notifier);
        failed
    }

    /// Stores a description of each page-cache namespace file `table` serves that has none
    /// yet, and takes those of files it no longer serves out of the store (at start-up and
    /// after a reload).
    pub fn keep(&mut self, table: &NamespaceTable, notifier: &Notifier) {
        if !notifier.is_enabled() {
            return;
        }
        let served = served(table);
        let gone: Vec<FileId> = self
            .held
            .keys()
            .filter(|id| !served.contains_key(id))
            .copied()
            .collect();
        for id in gone {
            self.held.remove(&id);
            if let Err(e) = notifier.remove_fds(&name_of(id)) {
                log::warn!("{}", rpma_common::error_chain(&e));
            }
        }
        for (id, raw) in served {
            if self.held.contains_key(&id) {
                continue;
            }
            // A description of its own (not a duplicate of the mapping's, which this run's
            // syncs share): it hears every write-back failure from now on.
            let path = format!("/proc/self/fd/{raw}");
            let fd = match std::fs::File::open(&path) {
                Ok(f) => OwnedFd::from(f),
                Err(e) => {
                    log::warn!("the file of descriptor {raw} cannot be opened again: {e}");
                    continue;
                }
            };
            match notifier.store_fd(&name_of(id), fd.as_fd()) {
                Ok(()) => {
                    self.held.insert(id, fd);
                }
                Err(e) => log::warn!(
                    "a namespace file's descriptor was not stored with the service manager \
                     (a write-back failure a crash leaves unrecorded would not be heard at the \
                     next start): {}",
                    rpma_common::error_chain(&e)
                ),
            }
        }
    }

    /// An operator cleared the failure of the namespaces of `id`: its stored description
    /// takes the report of that failure now, so that the next start does not hear it again.
    pub fn cleared(&self, id: FileId) {
        if let Some(fd) = self.held.get(&id) {
            let _ = nix::unistd::fdatasync(fd.as_raw_fd());
        }
    }
}

/// A stored description's sync reported an error for a file no namespace of this start serves
/// (taken out of the configuration after the run that wrote it): the file is marked failed
/// ([`crate::namespace::mark`]) and remembered by its device and inode, so that a reload or a
/// restart that serves it again opens it failed, as any failed file.
fn unserved_failure(fd: &OwnedFd, id: FileId, f: SyncFailure, ledger: &FailureLedger) {
    let path = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))
        .unwrap_or_else(|_| format!("(device {} inode {})", id.0, id.1).into());
    if nix::sys::stat::fstat(fd.as_raw_fd()).is_ok_and(|st| st.st_nlink == 0) {
        // Deleted: nothing can serve it again, and a record by its inode would fail the next
        // file given that inode number.
        log::warn!(
            "{}, deleted and not in this configuration, failed a write-back ({f}) that the \
             daemon's previous run ended before it recorded: nothing serves it any more",
            path.display()
        );
        return;
    }
    let marked = match crate::namespace::mark::set(fd.as_fd(), &f) {
        Ok(true) => "marked failed on the file itself".to_owned(),
        Ok(false) => "not marked (the file takes no mark)".to_owned(),
        Err(e) => format!("not marked ({e})"),
    };
    let remembered = match ledger.record_file("", 0, &path, Some(id), &f) {
        Ok(_) => "remembered in the state file".to_owned(),
        Err(e) => format!("not remembered ({})", rpma_common::error_chain(&e)),
    };
    log::error!(
        "{} (device {} inode {}), which this configuration does not serve, FAILED a write-back \
         ({f}) that the daemon's previous run ended before it recorded: {marked}, {remembered}; \
         a namespace on it opens failed until an operator clears it (writes not acknowledged as \
         durable before may be lost)",
        path.display(),
        id.0,
        id.1
    );
}
