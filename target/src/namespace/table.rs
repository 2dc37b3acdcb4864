//! The table of open namespaces, keyed by (subsystem NQN, nsid): opened all or nothing, changed
//! by a reload's diff only where it says, and the operator's clearing of a failure.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use rpma_common::pmem::SyncFailure;
use rpma_common::proto::nqn::Nqn;

use super::{NamespaceError, OpenNamespace, Result};
use crate::config::{self, NsKey};
use crate::failures::{self, Failed, FailureLedger};
use crate::reload::ConfigDiff;

/// Every open namespace.
#[derive(Debug, Default)]
pub struct NamespaceTable {
    map: BTreeMap<NsKey, Arc<OpenNamespace>>,
    /// Where failures are remembered (None: in memory only).
    ledger: Option<Arc<FailureLedger>>,
    /// The daemon's flush services ([`config::Config::flush_services`] at the start, which a
    /// reload does not change): a page-cache namespace opens its file once for each.
    services: usize,
}

/// What [`NamespaceTable::clear_failure`] cleared.
#[derive(Debug, Clone)]
pub struct Cleared {
    /// The namespace's backing file.
    pub path: PathBuf,
    /// The failure that was cleared.
    pub failure: SyncFailure,
    /// What the state file remembered (None if it had not been recorded there).
    pub remembered: Option<Failed>,
}

impl Cleared {
    /// What may have been lost, in words (for the log and the operator).
    pub fn what_may_be_lost(&self, key: &NsKey) -> String {
        let since = self
            .remembered
            .as_ref()
            .map_or_else(String::new, |r| format!(" at {}", r.since()));
        format!(
            "subsystem {} namespace {} ({}) failed{since} ({}): any write to it that was not \
             acknowledged as durable before then may be lost (the media holds whatever the \
             failed write-back left), and no write since was acknowledged as durable; hosts \
             now read what the media holds, and durability requests succeed again (not on the \
             NVMe/TCP controllers connected when it failed: writes they completed may be lost \
             and their hosts keep no copy, so they answer Write Fault until their host \
             reconnects)",
            key.0,
            key.1,
            self.path.display(),
            self.failure
        )
    }
}

/// What [`NamespaceTable::apply`] did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ApplyReport {
    /// Namespaces opened (added, or reopened because they changed).
    pub opened: Vec<NsKey>,
    /// Namespaces dropped from the table (removed, or replaced because they changed).
    pub closed: Vec<NsKey>,
}

impl NamespaceTable {
    /// Opens every namespace of `cfg`; all or nothing.
    ///
    /// # Errors
    /// The first namespace that fails, as [`OpenNamespace::open`].
    pub fn open_all(cfg: &config::Config) -> Result<Self> {
        Self::open_all_remembering(cfg, None)
    }

    /// [`NamespaceTable::open_all`], remembering failures in `ledger`: a namespace it
    /// remembers as failed opens failed ([`OpenNamespace::open_remembering`]).
    ///
    /// # Errors
    /// As [`NamespaceTable::open_all`].
    pub fn open_all_remembering(
        cfg: &config::Config,
        ledger: Option<Arc<FailureLedger>>,
    ) -> Result<Self> {
        let services = cfg.flush_services();
        let mut map = BTreeMap::new();
        for s in &cfg.subsystems {
            for ns in &s.namespaces {
                let opened =
                    OpenNamespace::open_remembering(&s.nqn, ns, ledger.as_ref(), None, services)?;
                map.insert((s.nqn.clone(), ns.nsid), Arc::new(opened));
            }
        }
        Ok(NamespaceTable {
            map,
            ledger,
            services,
        })
    }

    /// The state file's ledger, if failures are remembered.
    pub fn ledger(&self) -> Option<&Arc<FailureLedger>> {
        self.ledger.as_ref()
    }

    /// One namespace.
    pub fn get(&self, subsystem: &Nqn, nsid: u32) -> Option<&Arc<OpenNamespace>> {
        self.map.get(&(subsystem.clone(), nsid))
    }

    /// The namespaces of a subsystem, by nsid.
    pub fn of_subsystem<'a>(
        &'a self,
        subsystem: &'a Nqn,
    ) -> impl Iterator<Item = &'a Arc<OpenNamespace>> + 'a {
        self.map
            .iter()
            .filter(move |((s, _), _)| s == subsystem)
            .map(|(_, ns)| ns)
    }

    /// Every namespace.
    pub fn iter(&self) -> impl Iterator<Item = (&NsKey, &Arc<OpenNamespace>)> {
        self.map.iter()
    }

    /// Fails and logs each namespace a page of which could not be read or written, or whose
    /// file is shorter than it now ([`OpenNamespace::note_unreadable`]); returns those found
    /// so for the first time, whose sessions are to be closed. An `fstat` per namespace.
    pub fn note_unreadable(&self) -> Vec<NsKey> {
        self.map
            .iter()
            .filter(|(_, ns)| {
                // A file cut short shows no fault until a page of it is touched.
                ns.mapping.check_size();
                ns.newly_unreadable()
            })
            .map(|(k, _)| k.clone())
            .collect()
    }

    /// How many namespaces are open.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Adds every failed namespace that the new configuration keeps unchanged to `diff`'s
    /// [`namespaces_changed`](ConfigDiff::namespaces_changed), so that the reload reopens it
    /// (dropping its page cache: hosts then read what the media holds) and closes its sessions.
    /// It stays failed ([`NamespaceTable::apply`]). Returns them with their failures, for the
    /// log.
    pub fn reopen_failed(&self, diff: &mut ConfigDiff) -> Vec<(NsKey, SyncFailure)> {
        let mut reopened = Vec::new();
        for (key, ns) in self.iter() {
            let Some(f) = ns.failure() else { continue };
            if diff.namespaces_removed.contains(key) || diff.namespaces_changed.contains(key) {
                continue;
            }
            diff.namespaces_changed.push(key.clone());
            reopened.push((key.clone(), f));
        }
        reopened
    }

    /// Adds every namespace that the new configuration keeps unchanged but whose path now
    /// names another file (a restore or a provisioning tool moved one there) to `diff`'s
    /// [`namespaces_changed`](ConfigDiff::namespaces_changed), so that the reload maps the
    /// file the path names and closes the sessions of the old one: kept, every write and
    /// "durable" answer after the reload went to the old file, which the path no longer names,
    /// and was gone at the next start. Returns them, for the log. A path that names no file now
    /// is left alone (reopening it would create an empty file in place of the data hosts see).
    pub fn reopen_replaced(&self, diff: &mut ConfigDiff) -> Vec<NsKey> {
        let mut reopened = Vec::new();
        for (key, ns) in self.iter() {
            if diff.namespaces_removed.contains(key) || diff.namespaces_changed.contains(key) {
                continue;
            }
            // The configured path, followed as opening it would (not the canonical path it
            // resolved to then: a symlink retargeted since names another file now).
            let now = std::fs::metadata(&ns.config.path);
            let (Some(fd), Ok(now)) = (ns.mapping.backing_fd(), now) else {
                continue;
            };
            let Ok(open) = nix::sys::stat::fstat(std::os::fd::AsRawFd::as_raw_fd(&fd)) else {
                continue;
            };
            use std::os::unix::fs::MetadataExt;
            if (open.st_dev, open.st_ino) != (now.dev(), now.ino()) {
                diff.namespaces_changed.push(key.clone());
                reopened.push(key.clone());
            }
        }
        reopened
    }

    /// Applies a reload: opens the added and changed namespaces of `new` first, as
    /// [`OpenNamespace::open`] does at start-up (a file is grown only with `grow = true`; if
    /// any open fails the table is left exactly as it was), then swaps them in and drops the
    /// removed ones. Namespaces the diff does not name are
    /// not touched: their `Arc` stays the same. A failed namespace reopened on the same file
    /// stays failed (the old mapping's pages are taken out of its page tables first, so that
    /// the page cache can be dropped).
    ///
    /// # Errors
    /// As [`OpenNamespace::open`].
    pub fn apply(&mut self, diff: &ConfigDiff, new: &config::Config) -> Result<ApplyReport> {
        let mut opened = Vec::new();
        for key in diff.namespaces_added.iter().chain(&diff.namespaces_changed) {
            let ns = new
                .subsystems
                .iter()
                .find(|s| s.nqn == key.0)
                .and_then(|s| s.namespaces.iter().find(|n| n.nsid == key.1));
            if let Some(ns) = ns {
                // The same file, under its path or another (moved, and the path edited).
                let same_file = |o: &OpenNamespace| {
                    o.key == failures::key_of(&ns.path)
                        || o.file_id()
                            .is_some_and(|id| failures::file_id_of(&ns.path) == Some(id))
                };
                let old = self.map.get(key).filter(|o| same_file(o));
                // Any opening of the file, under any nsid (one this reload removes included:
                // its sessions hold it until they are closed).
                if self.map.values().any(|o| {
                    same_file(o)
                        && o.config.power_loss_simulation.is_some()
                            != ns.power_loss_simulation.is_some()
                }) {
                    return Err(NamespaceError::SimulationChanged {
                        subsystem: key.0.clone(),
                        nsid: key.1,
                        path: ns.path.clone(),
                    });
                }
                let carried = old.and_then(|o| o.failure());
                if let (Some(o), Some(_)) = (old, carried) {
                    if let Err(e) = o.mapping.drop_page_cache() {
                        log::warn!(
                            "subsystem {} namespace {}: {}",
                            key.0,
                            key.1,
                            rpma_common::error_chain(&e)
                        );
                    }
                }
                let opened_ns = OpenNamespace::open_remembering(
                    &key.0,
                    ns,
                    self.ledger.as_ref(),
                    carried,
                    self.services,
                )?;
                opened.push((key.clone(), Arc::new(opened_ns)));
            }
        }
        let mut report = ApplyReport::default();
        for key in diff
            .namespaces_removed
            .iter()
            .chain(&diff.namespaces_changed)
        {
            if let Some(old) = self.map.remove(key) {
                // Out of service unless the namespace maps the same file again (a transfer
                // into the old opening still lands where the namespace's readers look).
                let same_file = old.file_id().is_some()
                    && opened
                        .iter()
                        .any(|(k, n)| k == key && n.file_id() == old.file_id());
                if !same_file {
                    old.retire();
                }
                report.closed.push(key.clone());
            }
        }
        for (key, ns) in opened {
            report.opened.push(key.clone());
            self.map.insert(key, ns);
        }
        Ok(report)
    }

    /// Clears the failure of namespace `key` (the operator's explicit act): reopens its file
    /// healthy, with its page cache dropped (hosts read what the media holds), forgets the
    /// failure in the state file, and swaps the new opening in. The caller closes the sessions
    /// that hold the old one (they reconnect and see a healthy descriptor). If anything fails
    /// the table, the state file and the file's failure mark are left as they were (the mark,
    /// removed before the state file is written, is put back if that fails; a mark that cannot
    /// be put back is logged).
    ///
    /// # Errors
    /// [`NamespaceError::NotFound`], [`NamespaceError::NotFailed`], those of
    /// [`OpenNamespace::open`], [`NamespaceError::Mark`], [`NamespaceError::Ledger`],
    /// [`NamespaceError::FailedAgain`].
    pub fn clear_failure(&mut self, key: &NsKey, cfg: &config::Config) -> Result<Cleared> {
        let not_found = || NamespaceError::NotFound {
            subsystem: key.0.clone(),
            nsid: key.1,
        };
        let old = self.map.get(key).ok_or_else(not_found)?;
        let failure = old.failure().ok_or_else(|| NamespaceError::NotFailed {
            subsystem: key.0.clone(),
            nsid: key.1,
        })?;
        let ns = cfg
            .subsystems
            .iter()
            .find(|s| s.nqn == key.0)
            .and_then(|s| s.namespaces.iter().find(|n| n.nsid == key.1))
            .ok_or_else(not_found)?;
        let remembered = old.remembered();
        // Opened without reading the ledger (it still remembers the failure, and must until
        // the new opening exists: read, the new opening would start failed) but recording into
        // it from before any sync of the new opening, so that a failure of that sync is
        // written there too; without that, old sessions still writing could make the new
        // opening fail before it listened, and the clear left it failed in memory but healthy
        // in the state file, which a restart then believed (a helper's review). For the same
        // reason the file's failed openings do not make this one start failed (`clearing`);
        // one that fails from now on makes it fail too (FailedAgain below). They still count
        // for any other opening of the file until the clear has succeeded (forgotten before,
        // a clear that then failed left a reload free to map the file healthy under another
        // key, where no state file or mark remembered it).
        let fresh = OpenNamespace::open_with(
            &key.0,
            ns,
            None,
            self.ledger.as_ref(),
            None,
            self.services,
            true,
        )?;
        // The old opening's page cache is dropped only now that the new one is open: the
        // kernel reports a write-back error to the descriptions open when it happens, so a
        // failure of this write-back (of whatever was written since the failure, the cause
        // still there) reaches the new opening's own sync below, which fails it (FailedAgain).
        // Opened after it, the new one never heard of it and the clear succeeded. What the old
        // opening's sync reports itself may be the failure being cleared, reported to it late.
        for (which, m) in [("old", &old.mapping), ("new", &fresh.mapping)] {
            if let Err(e) = m.drop_page_cache() {
                log::warn!(
                    "subsystem {} namespace {}: the {which} opening: {}",
                    key.0,
                    key.1,
                    rpma_common::error_chain(&e)
                );
            }
        }
        // Failed again already (the usual way: that write-back): refused before the mark or
        // the state file is touched, so both keep the failure as it was first met.
        if let Some(again) = fresh.failure() {
            return Err(NamespaceError::FailedAgain {
                subsystem: key.0.clone(),
                nsid: key.1,
                failure: again,
            });
        }
        // The file's own mark goes first: one that stays would make the next start fail it
        // again (safe, but not what the operator asked).
        if let Some(fd) = fresh.mapping.backing_fd() {
            super::mark::remove(fd).map_err(|source| NamespaceError::Mark {
                subsystem: key.0.clone(),
                nsid: key.1,
                path: ns.path.clone(),
                source,
            })?;
        }
        if let Some(l) = &self.ledger {
            if let Err(source) = l.clear(&old.key) {
                // Nothing changes: the mark goes back (gone, a daemon started with another
                // state file would find the file healthy).
                if let Some(fd) = fresh.mapping.backing_fd() {
                    super::mark::mark_file(fd, key.0.as_str(), key.1, &failure);
                }
                return Err(NamespaceError::Ledger {
                    subsystem: key.0.clone(),
                    nsid: key.1,
                    source,
                });
            }
        }
        // Failed again since the check above (its hook wrote that to the state file, perhaps
        // before the clear above took it out): the clear is void, the file and the state file
        // say so again, and the old opening stays.
        if let Some(again) = fresh.failure() {
            if let Some(fd) = fresh.mapping.backing_fd() {
                super::mark::mark_file(fd, key.0.as_str(), key.1, &again);
            }
            if let Some(l) = &self.ledger {
                let id = fresh.file_id().or_else(|| failures::file_id_of(&fresh.key));
                if let Err(e) = l.record_file(key.0.as_str(), key.1, &fresh.key, id, &again) {
                    // In memory it stays failed; the state file says otherwise.
                    log::error!(
                        "subsystem {} namespace {} failed again during clear-failure, and \
                         the state file could not record it ({}): a restart would forget it",
                        key.0,
                        key.1,
                        rpma_common::error_chain(&e)
                    );
                }
            }
            return Err(NamespaceError::FailedAgain {
                subsystem: key.0.clone(),
                nsid: key.1,
                failure: again,
            });
        }
        // Cleared: the failed openings no longer make a new opening of the file start failed,
        // and the hook of one still spreading the failure reaches none made since.
        if let Some(c) = &old.claim {
            c.forget_failed(&fresh.mapping);
        }
        let path = old.config.path.clone();
        self.map.insert(key.clone(), Arc::new(fresh));
        Ok(Cleared {
            path,
            failure,
            remembered,
        })
    }
}
