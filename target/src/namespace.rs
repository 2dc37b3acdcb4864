//! Open namespaces: each configured namespace mapped through the pmem layer, with its flush
//! target and counters, in a table keyed by (subsystem NQN, nsid).
//!
//! Namespaces are shared as `Arc<OpenNamespace>`: a reload that replaces or removes one drops
//! the table's reference, and sessions still holding it keep the mapping alive until they close.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use rpma_common::pmem::{self, Domain, Mapping, OpenOptions, Persist, Resize, SyncFailure};
use rpma_common::proto::nqn::Nqn;
use rpma_common::proto::{DurabilityMethods, PersistenceDomain};

pub use crate::config::NsKey;
use crate::config::{self, Transport};
use crate::flusher::{FlushTarget, FlusherError};
use crate::reload::ConfigDiff;

/// Errors opening namespaces.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NamespaceError {
    /// The pmem layer could not open or map the backing store.
    #[error("subsystem {subsystem} namespace {nsid} ({path}): cannot open")]
    Open {
        /// Subsystem.
        subsystem: Nqn,
        /// Namespace id.
        nsid: u32,
        /// Backing store.
        path: PathBuf,
        /// What the pmem layer reported.
        #[source]
        source: pmem::Error,
    },
    /// An existing file is smaller than the configured size, and the namespace does not say
    /// `grow = true`.
    #[error(
        "subsystem {subsystem} namespace {nsid} ({path}): the file is smaller than the configured \
         size; set `grow = true` on the namespace to grow it"
    )]
    WouldGrow {
        /// Subsystem.
        subsystem: Nqn,
        /// Namespace id.
        nsid: u32,
        /// Backing store.
        path: PathBuf,
        /// What the pmem layer reported (the sizes).
        #[source]
        source: pmem::Error,
    },
    /// The flush target could not be prepared.
    #[error("subsystem {subsystem} namespace {nsid}: cannot prepare flushing")]
    Flush {
        /// Subsystem.
        subsystem: Nqn,
        /// Namespace id.
        nsid: u32,
        /// What went wrong.
        #[source]
        source: FlusherError,
    },
}

/// Result of namespace operations.
pub type Result<T> = std::result::Result<T, NamespaceError>;

/// The wire's name for a pmem domain.
pub fn wire_domain(d: Domain) -> PersistenceDomain {
    match d {
        Domain::Dax => PersistenceDomain::Dax,
        Domain::DaxForced => PersistenceDomain::DaxForced,
        Domain::PageCache => PersistenceDomain::PageCache,
        _ => PersistenceDomain::Volatile,
    }
}

/// The durability methods a namespace in `domain` offers on `transport` (DESIGN.md, Persistence).
///
/// - volatile: none (acknowledgements mean "visible only").
/// - tcp: APM, GPSPM and FLUSH on dax, dax (forced) and page-cache: the placement engine makes
///   every earlier Write durable before it answers a Read, Atomic or Flush on that QP.
/// - rdma: GPSPM always; APM only on dax with the operator's `direct_write_to_pmem` declaration
///   (DDIO off or eADR), never on page-cache where the NIC's writes land in DRAM; FLUSH is left
///   to the transport, which knows whether the provider implements it.
/// - nvme-tcp: FLUSH, meaning NVMe's Flush command and Write with FUA (docs/nvme-tcp.md): there
///   is no other way to ask an NVMe controller for durability.
pub fn durability_methods(
    domain: Domain,
    transport: Transport,
    direct_write_to_pmem: bool,
) -> DurabilityMethods {
    if !domain.is_durable() {
        return DurabilityMethods::NONE;
    }
    match transport {
        Transport::Tcp => {
            DurabilityMethods::APM | DurabilityMethods::GPSPM | DurabilityMethods::FLUSH
        }
        Transport::Rdma if domain.is_dax() && direct_write_to_pmem => {
            DurabilityMethods::APM | DurabilityMethods::GPSPM
        }
        Transport::Rdma => DurabilityMethods::GPSPM,
        Transport::NvmeTcp => DurabilityMethods::FLUSH,
    }
}

/// Per-namespace counters, updated by the sessions and the flush service.
#[derive(Debug, Default)]
pub struct Counters {
    /// Flush requests answered.
    pub flushes: AtomicU64,
    /// Flush requests answered with an error status.
    pub flush_errors: AtomicU64,
    /// Bytes made durable on request.
    pub flushed_bytes: AtomicU64,
    /// Sessions currently holding the namespace.
    pub sessions: AtomicU64,
}

impl Counters {
    /// A plain copy for status output.
    pub fn snapshot(&self) -> CountersSnapshot {
        CountersSnapshot {
            flushes: self.flushes.load(Ordering::Relaxed),
            flush_errors: self.flush_errors.load(Ordering::Relaxed),
            flushed_bytes: self.flushed_bytes.load(Ordering::Relaxed),
            sessions: self.sessions.load(Ordering::Relaxed),
        }
    }
}

/// A copy of [`Counters`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CountersSnapshot {
    /// See [`Counters::flushes`].
    pub flushes: u64,
    /// See [`Counters::flush_errors`].
    pub flush_errors: u64,
    /// See [`Counters::flushed_bytes`].
    pub flushed_bytes: u64,
    /// See [`Counters::sessions`].
    pub sessions: u64,
}

/// A mapped namespace.
#[derive(Debug)]
pub struct OpenNamespace {
    /// Its subsystem.
    pub subsystem: Nqn,
    /// Its configuration.
    pub config: config::Namespace,
    /// The mapping.
    pub mapping: Arc<Mapping>,
    /// What the flush service uses for it.
    pub flush_target: FlushTarget,
    /// Counters.
    pub counters: Counters,
    /// Whether its failure was logged (once per opening).
    failure_logged: AtomicBool,
}

impl OpenNamespace {
    /// Opens (creating and allocating a missing file when a size is configured) and maps a
    /// namespace. An existing file of another size is refused, never silently resized, except
    /// that a smaller one is grown when the namespace says `grow = true` (the same rule at
    /// start-up and on reload).
    ///
    /// # Errors
    /// [`NamespaceError::WouldGrow`], [`NamespaceError::Open`], [`NamespaceError::Flush`].
    pub fn open(subsystem: &Nqn, ns: &config::Namespace) -> Result<Self> {
        let opts = Self::options(ns);
        let mapping = Arc::new(opts.open().map_err(|source| {
            let (subsystem, nsid, path) = (subsystem.clone(), ns.nsid, ns.path.clone());
            match source {
                pmem::Error::WouldGrow { .. } => NamespaceError::WouldGrow {
                    subsystem,
                    nsid,
                    path,
                    source,
                },
                source => NamespaceError::Open {
                    subsystem,
                    nsid,
                    path,
                    source,
                },
            }
        })?);
        if ns.prefault && matches!(mapping.domain(), Domain::Dax | Domain::DaxForced) {
            // The first Write to each page would otherwise pay a page fault in the poll loop
            // (about half the speed of a first pass over a fresh namespace).
            let t = std::time::Instant::now();
            match mapping.prefault() {
                Ok(()) => log::info!(
                    "subsystem {subsystem} nsid {}: {} bytes mapped in ahead of use in {} ms",
                    ns.nsid,
                    mapping.len(),
                    t.elapsed().as_millis()
                ),
                Err(e) => log::warn!(
                    "subsystem {subsystem} nsid {}: not mapped in ahead of use (first writes \
                     to each page fault): {}",
                    ns.nsid,
                    rpma_common::error_chain(&e)
                ),
            }
        }
        if mapping.simulation().is_some() {
            log::warn!(
                "subsystem {subsystem} nsid {} ({}): domain {}: only what was persisted survives                  a SIGKILL of this daemon; NOT for production",
                ns.nsid,
                ns.path.display(),
                mapping.domain_label()
            );
        }
        let flush_target =
            FlushTarget::for_mapping(&mapping).map_err(|source| NamespaceError::Flush {
                subsystem: subsystem.clone(),
                nsid: ns.nsid,
                source,
            })?;
        Ok(OpenNamespace {
            subsystem: subsystem.clone(),
            config: ns.clone(),
            mapping,
            flush_target,
            counters: Counters::default(),
            failure_logged: AtomicBool::new(false),
        })
    }

    /// The pmem options a namespace is opened with: created when it has a size, grown only with
    /// `grow = true`. `check-config` plans with the same options, so it reports what opening does.
    pub fn options(ns: &config::Namespace) -> OpenOptions {
        let opts = OpenOptions::new(&ns.path)
            .resize(if ns.grow {
                Resize::Grow
            } else {
                Resize::Refuse
            })
            .block_size(u64::from(ns.block_size))
            .force_dax(ns.force_dax)
            .power_loss_simulation(ns.power_loss_simulation)
            .create(ns.size.is_some());
        match ns.size {
            Some(size) => opts.size(size),
            None => opts,
        }
    }

    /// The probed (or forced) domain.
    pub fn domain(&self) -> Domain {
        self.mapping.domain()
    }

    /// The domain as every interface shows it, with the power-loss simulation's label when
    /// it is on ("page-cache, power-loss simulation (test only)").
    pub fn domain_label(&self) -> String {
        self.mapping.domain_label()
    }

    /// Size in bytes.
    pub fn size(&self) -> u64 {
        self.mapping.len() as u64
    }

    /// The first failed write-back of the namespace (from any path: a GPSPM fdatasync, the
    /// placement engine's msync for APM and FLUSH), if it has failed. A failed namespace answers
    /// no durability request until it is reopened (reload or restart).
    pub fn failure(&self) -> Option<SyncFailure> {
        self.mapping.failure()
    }

    /// Logs the namespace's failure at error level the first time it is seen; call it wherever
    /// a durability request on it failed. Returns whether it has failed.
    pub fn note_failure(&self) -> bool {
        let Some(f) = self.failure() else {
            return false;
        };
        if !self.failure_logged.swap(true, Ordering::Relaxed) {
            log::error!(
                "subsystem {} namespace {} ({}) has FAILED: {f} (errno {}); every durability \
                 request on it is refused until an operator reopens it (reload or restart)",
                self.subsystem,
                self.config.nsid,
                self.config.path.display(),
                f.errno
            );
        }
        true
    }
}

/// Every open namespace.
#[derive(Debug, Default)]
pub struct NamespaceTable {
    map: BTreeMap<NsKey, Arc<OpenNamespace>>,
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
        let mut map = BTreeMap::new();
        for s in &cfg.subsystems {
            for ns in &s.namespaces {
                map.insert(
                    (s.nqn.clone(), ns.nsid),
                    Arc::new(OpenNamespace::open(&s.nqn, ns)?),
                );
            }
        }
        Ok(NamespaceTable { map })
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
    /// (which clears the failure: the operator's explicit act) and closes its sessions. Returns
    /// them with their failures, for the log.
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

    /// Applies a reload: opens the added and changed namespaces of `new` first, as
    /// [`OpenNamespace::open`] does at start-up (a file is grown only with `grow = true`; if
    /// any open fails the table is left exactly as it was), then swaps them in and drops the
    /// removed ones. Namespaces the diff does not name are
    /// not touched: their `Arc` stays the same.
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
                opened.push((key.clone(), Arc::new(OpenNamespace::open(&key.0, ns)?)));
            }
        }
        let mut report = ApplyReport::default();
        for key in diff
            .namespaces_removed
            .iter()
            .chain(&diff.namespaces_changed)
        {
            if self.map.remove(key).is_some() {
                report.closed.push(key.clone());
            }
        }
        for (key, ns) in opened {
            report.opened.push(key.clone());
            self.map.insert(key, ns);
        }
        Ok(report)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn methods_per_domain_and_transport() {
        let all = DurabilityMethods::APM | DurabilityMethods::GPSPM | DurabilityMethods::FLUSH;
        for d in [Domain::Dax, Domain::DaxForced, Domain::PageCache] {
            assert_eq!(durability_methods(d, Transport::Tcp, false), all);
        }
        assert_eq!(
            durability_methods(Domain::Volatile, Transport::Tcp, true),
            DurabilityMethods::NONE
        );
        assert_eq!(
            durability_methods(Domain::Volatile, Transport::Rdma, true),
            DurabilityMethods::NONE
        );
        assert_eq!(
            durability_methods(Domain::Dax, Transport::Rdma, false),
            DurabilityMethods::GPSPM
        );
        assert_eq!(
            durability_methods(Domain::Dax, Transport::Rdma, true),
            DurabilityMethods::APM | DurabilityMethods::GPSPM
        );
        assert_eq!(
            durability_methods(Domain::PageCache, Transport::Rdma, true),
            DurabilityMethods::GPSPM
        );
        for d in [Domain::Dax, Domain::PageCache] {
            assert_eq!(
                durability_methods(d, Transport::NvmeTcp, false),
                DurabilityMethods::FLUSH
            );
        }
        assert_eq!(
            durability_methods(Domain::Volatile, Transport::NvmeTcp, false),
            DurabilityMethods::NONE
        );
    }

    #[test]
    fn wire_domains() {
        assert_eq!(wire_domain(Domain::DaxForced), PersistenceDomain::DaxForced);
        assert_eq!(wire_domain(Domain::Volatile), PersistenceDomain::Volatile);
        assert_eq!(
            wire_domain(Domain::PageCache).to_string(),
            Domain::PageCache.to_string()
        );
    }

    /// Minor faults of this thread while writing a byte into every page of `ns`.
    fn first_touch_faults(ns: &OpenNamespace) -> i64 {
        let faults = || {
            // SAFETY: getrusage fills one plain struct that outlives the call.
            unsafe {
                let mut ru: libc::rusage = std::mem::zeroed();
                assert_eq!(libc::getrusage(libc::RUSAGE_THREAD, &mut ru), 0);
                ru.ru_minflt
            }
        };
        let before = faults();
        for off in (0..ns.mapping.len()).step_by(4096) {
            ns.mapping.write_at(off, &[1]).unwrap();
        }
        faults() - before
    }

    #[test]
    fn a_dax_namespace_is_mapped_in_ahead_unless_the_config_says_not_to() {
        let d = tempfile::tempdir_in("/dev/shm").unwrap();
        let nqn = Nqn::new("nqn.2026-11.io.rpma:t").unwrap();
        let ns = |name: &str, prefault: bool| config::Namespace {
            nsid: 1,
            path: d.path().join(name),
            size: Some(2 << 20),
            block_size: 4096,
            read_only: false,
            force_dax: true,
            grow: false,
            prefault,
            power_loss_simulation: None,
        };
        let ahead = OpenNamespace::open(&nqn, &ns("ahead", true)).unwrap();
        let lazy = OpenNamespace::open(&nqn, &ns("lazy", false)).unwrap();
        let pages = (2 << 20) / 4096;
        assert!(first_touch_faults(&lazy) >= pages / 2, "the control");
        assert!(first_touch_faults(&ahead) < pages / 16);
    }

    #[test]
    fn open_errors_name_the_namespace() {
        let d = tempfile::tempdir().unwrap();
        let ns = config::Namespace {
            nsid: 3,
            path: d.path().join("missing"),
            size: None,
            block_size: 4096,
            read_only: false,
            force_dax: false,
            grow: false,
            prefault: true,
            power_loss_simulation: None,
        };
        let nqn = Nqn::new("nqn.2026-11.io.rpma:t").unwrap();
        let e = OpenNamespace::open(&nqn, &ns).unwrap_err();
        assert!(matches!(e, NamespaceError::Open { nsid: 3, .. }));
        assert!(e.to_string().contains("namespace 3"), "{e}");
    }

    fn cfg(dir: &std::path::Path, extra: &str) -> config::Config {
        let text = format!(
            "[[subsystem]]\nnqn = \"nqn.2026-11.io.rpma:t\"\nallow_any_host = true\n\
             [[subsystem.namespace]]\nnsid = 1\npath = \"n1\"\nsize = \"64KiB\"\n\
             [[subsystem.namespace]]\nnsid = 2\npath = \"n2\"\nsize = \"64KiB\"\n{extra}"
        );
        config::Config::from_toml(&text, dir).unwrap()
    }

    #[test]
    fn apply_touches_only_what_the_diff_names() {
        let d = tempfile::tempdir().unwrap();
        let old = cfg(d.path(), "");
        let mut table = NamespaceTable::open_all(&old).unwrap();
        assert_eq!(table.len(), 2);
        let nqn = Nqn::new("nqn.2026-11.io.rpma:t").unwrap();
        let ns1 = table.get(&nqn, 1).unwrap().clone();
        let ns2 = table.get(&nqn, 2).unwrap().clone();

        let mut new = cfg(
            d.path(),
            "[[subsystem.namespace]]\nnsid = 3\npath = \"n3\"\nsize = \"64KiB\"\n",
        );
        new.subsystems[0].namespaces[1].size = Some(128 << 10);
        new.subsystems[0].namespaces[1].grow = true;
        let diff = crate::reload::diff(&old, &new);
        let report = table.apply(&diff, &new).unwrap();
        assert_eq!(report.opened, [(nqn.clone(), 3), (nqn.clone(), 2)]);
        assert_eq!(report.closed, [(nqn.clone(), 2)]);
        assert!(
            Arc::ptr_eq(table.get(&nqn, 1).unwrap(), &ns1),
            "untouched namespace reopened"
        );
        assert!(!Arc::ptr_eq(table.get(&nqn, 2).unwrap(), &ns2));
        assert_eq!(table.get(&nqn, 2).unwrap().size(), 128 << 10, "grown");
        assert_eq!(table.get(&nqn, 3).unwrap().size(), 64 << 10);
        assert_eq!(table.of_subsystem(&nqn).count(), 3);
    }

    #[test]
    fn growing_needs_grow_at_start_and_on_reload_alike() {
        let d = tempfile::tempdir().unwrap();
        let old = cfg(d.path(), "");
        let mut table = NamespaceTable::open_all(&old).unwrap();
        let nqn = Nqn::new("nqn.2026-11.io.rpma:t").unwrap();
        let mut bigger = old.clone();
        bigger.subsystems[0].namespaces[0].size = Some(128 << 10);

        // Without `grow`: the reload is refused, and so is a start with that configuration.
        let diff = crate::reload::diff(&old, &bigger);
        let e = table.apply(&diff, &bigger).unwrap_err();
        assert!(
            matches!(&e, NamespaceError::WouldGrow { nsid: 1, .. }),
            "{e:?}"
        );
        assert!(e.to_string().contains("grow = true"), "{e}");
        assert_eq!(table.get(&nqn, 1).unwrap().size(), 64 << 10, "unchanged");
        drop(table);
        assert!(NamespaceTable::open_all(&bigger).is_err());

        // With it: a start grows the file, and so does a reload.
        bigger.subsystems[0].namespaces[0].grow = true;
        let table = NamespaceTable::open_all(&bigger).unwrap();
        assert_eq!(table.get(&nqn, 1).unwrap().size(), 128 << 10);
        drop(table);
        let mut table = NamespaceTable::open_all(&bigger).unwrap();
        let mut biggest = bigger.clone();
        biggest.subsystems[0].namespaces[0].size = Some(256 << 10);
        let diff = crate::reload::diff(&bigger, &biggest);
        table.apply(&diff, &biggest).unwrap();
        assert_eq!(table.get(&nqn, 1).unwrap().size(), 256 << 10);
        // Never shrunk.
        let diff = crate::reload::diff(&biggest, &bigger);
        assert!(table.apply(&diff, &bigger).is_err());
    }

    #[test]
    fn failed_apply_leaves_the_table_as_it_was() {
        let d = tempfile::tempdir().unwrap();
        let old = cfg(d.path(), "");
        let mut table = NamespaceTable::open_all(&old).unwrap();
        // nsid 3 on a path that cannot be created (a directory).
        std::fs::create_dir(d.path().join("dir")).unwrap();
        let new = cfg(
            d.path(),
            "[[subsystem.namespace]]\nnsid = 3\npath = \"dir\"\nsize = \"64KiB\"\n",
        );
        let mut new2 = new.clone();
        new2.subsystems[0].namespaces.remove(0);
        let diff = crate::reload::diff(&old, &new2);
        assert!(!diff.namespaces_removed.is_empty());
        assert!(table.apply(&diff, &new2).is_err());
        assert_eq!(table.len(), 2, "nothing removed when an open failed");
    }
}
