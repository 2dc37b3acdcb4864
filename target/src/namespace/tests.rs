use super::*;
use crate::config::Transport;
use rpma_common::proto::{DurabilityMethods, PersistenceDomain};

#[test]
fn methods_per_domain_and_transport() {
    let all = DurabilityMethods::APM | DurabilityMethods::GPSPM | DurabilityMethods::FLUSH;
    for d in [Domain::Dax, Domain::DaxForced] {
        assert_eq!(durability_methods(d, Transport::Tcp, false), all);
    }
    assert_eq!(
        durability_methods(Domain::PageCache, Transport::Tcp, true),
        DurabilityMethods::GPSPM | DurabilityMethods::FLUSH
    );
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

/// Under the power-loss simulation rdma offers no APM, whatever the operator declares: the
/// simulated media learns of a byte only when the target's CPU persists it.
#[test]
fn a_simulated_namespace_takes_no_direct_write_declaration() {
    let d = tempfile::tempdir_in("/dev/shm").unwrap();
    let nqn = Nqn::new("nqn.2026-11.io.rpma:t").unwrap();
    let ns = |name: &str, sim: bool| config::Namespace {
        nsid: 1,
        path: d.path().join(name),
        size: Some(1 << 20),
        block_size: 4096,
        read_only: false,
        force_dax: true,
        grow: false,
        prefault: false,
        power_loss_simulation: sim.then_some(rpma_common::pmem::Simulation {
            seed: 1,
            eviction_percent: 0,
            eviction_interval_ms: 0,
            broken_persist: false,
        }),
    };
    let real = OpenNamespace::open(&nqn, &ns("real", false)).unwrap();
    let simulated = OpenNamespace::open(&nqn, &ns("sim", true)).unwrap();
    assert!(real
        .methods(Transport::Rdma, true)
        .contains(DurabilityMethods::APM));
    let m = simulated.methods(Transport::Rdma, true);
    assert!(!m.contains(DurabilityMethods::APM), "{m:?}");
    assert!(m.contains(DurabilityMethods::GPSPM));
    // check-config plans with the same rule.
    assert!(
        !offered_methods(simulated.domain(), Transport::Rdma, true, true)
            .contains(DurabilityMethods::APM)
    );
    // On tcp the placement engine persists what APM covers: offered as before.
    assert!(simulated
        .methods(Transport::Tcp, false)
        .contains(DurabilityMethods::APM));
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

#[test]
fn the_identity_follows_the_file_not_its_opening() {
    let d = tempfile::tempdir().unwrap();
    let ns = |nsid: u32| config::Namespace {
        nsid,
        path: d.path().join("n"),
        size: Some(64 << 10),
        block_size: 4096,
        read_only: false,
        force_dax: false,
        grow: false,
        prefault: false,
        power_loss_simulation: None,
    };
    let nqn = Nqn::new("nqn.2026-11.io.rpma:t").unwrap();
    let other = Nqn::new("nqn.2026-11.io.rpma:u").unwrap();
    let first = OpenNamespace::open(&nqn, &ns(1)).unwrap().identity();
    // Reopened (a reload, a restart): the same file, the same identity.
    assert_eq!(OpenNamespace::open(&nqn, &ns(1)).unwrap().identity(), first);
    // The same file as another namespace is not the same namespace.
    assert_ne!(OpenNamespace::open(&nqn, &ns(2)).unwrap().identity(), first);
    assert_ne!(
        OpenNamespace::open(&other, &ns(1)).unwrap().identity(),
        first
    );
    // A restored file moved over the path: another identity.
    std::fs::write(d.path().join("restored"), vec![0u8; 64 << 10]).unwrap();
    std::fs::rename(d.path().join("restored"), d.path().join("n")).unwrap();
    assert_ne!(OpenNamespace::open(&nqn, &ns(1)).unwrap().identity(), first);
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

/// A reload retires the openings it takes out of service (the namespace removed, or mapping
/// another file), and only those: a namespace reopened on the same file (grown) or left alone
/// is not (a transfer into it lands where its readers look).
#[test]
fn apply_retires_what_leaves_service_and_only_that() {
    let d = tempfile::tempdir().unwrap();
    let old = cfg(
        d.path(),
        "[[subsystem.namespace]]\nnsid = 3\npath = \"n3\"\nsize = \"64KiB\"\n",
    );
    let mut table = NamespaceTable::open_all(&old).unwrap();
    let nqn = Nqn::new("nqn.2026-11.io.rpma:t").unwrap();
    let [ns1, ns2, ns3] = [1, 2, 3].map(|n| table.get(&nqn, n).unwrap().clone());
    // nsid 1 removed, 2 grown on its file, 3 moved to another file.
    let mut new = cfg(
        d.path(),
        "[[subsystem.namespace]]\nnsid = 3\npath = \"n3b\"\nsize = \"64KiB\"\n",
    );
    new.subsystems[0].namespaces.remove(0);
    new.subsystems[0].namespaces[0].size = Some(128 << 10);
    new.subsystems[0].namespaces[0].grow = true;
    let diff = crate::reload::diff(&old, &new);
    table.apply(&diff, &new).unwrap();
    assert!(ns1.is_retired(), "removed");
    assert!(!ns2.is_retired(), "the same file, reopened");
    assert!(ns3.is_retired(), "another file in its place");
    assert!(
        [2, 3]
            .iter()
            .all(|&n| !table.get(&nqn, n).unwrap().is_retired()),
        "the new openings serve"
    );
    // A reload with the configuration unchanged: nsid 2's path names another file now (moved
    // over it), nsid 3 failed (reopened on its own file, failed still).
    let [ns2, ns3] = [2, 3].map(|n| table.get(&nqn, n).unwrap().clone());
    std::fs::write(d.path().join("moved"), vec![0u8; 128 << 10]).unwrap();
    std::fs::rename(d.path().join("moved"), d.path().join("n2")).unwrap();
    let f = SyncFailure::new("msync", &std::io::Error::from_raw_os_error(libc::EIO));
    ns3.mapping.record_failure(f);
    let mut diff = crate::reload::diff(&new, &new);
    assert_eq!(table.reopen_failed(&mut diff).len(), 1);
    assert_eq!(table.reopen_replaced(&mut diff).len(), 1);
    table.apply(&diff, &new).unwrap();
    assert!(ns2.is_retired(), "another file at its path");
    assert!(!ns3.is_retired(), "reopened failed on the same file");
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
fn a_reload_cannot_turn_the_power_loss_simulation_on_or_off() {
    let d = tempfile::tempdir().unwrap();
    let nqn = Nqn::new("nqn.2026-11.io.rpma:t").unwrap();
    let real = cfg(d.path(), "");
    let mut simulated = real.clone();
    simulated.subsystems[0].namespaces[0].power_loss_simulation =
        Some(rpma_common::pmem::Simulation {
            seed: 1,
            eviction_percent: 0,
            eviction_interval_ms: 0,
            broken_persist: false,
        });
    for (from, to) in [(&real, &simulated), (&simulated, &real)] {
        let mut table = NamespaceTable::open_all(from).unwrap();
        let before = Arc::clone(table.get(&nqn, 1).unwrap());
        let diff = crate::reload::diff(from, to);
        assert_eq!(diff.namespaces_changed, [(nqn.clone(), 1)]);
        let e = table.apply(&diff, to).unwrap_err();
        assert!(
            matches!(&e, NamespaceError::SimulationChanged { nsid: 1, .. }),
            "{e:?}"
        );
        assert!(e.to_string().contains("restart the target"), "{e}");
        assert!(
            Arc::ptr_eq(table.get(&nqn, 1).unwrap(), &before),
            "unchanged"
        );
        // Another file under the same nsid is a new namespace: the simulation may differ.
        let mut moved = to.clone();
        moved.subsystems[0].namespaces[0].path = d.path().join("other");
        let diff = crate::reload::diff(from, &moved);
        table.apply(&diff, &moved).unwrap();
        drop(table);
        std::fs::remove_file(d.path().join("other")).unwrap();
        // The same file under another nsid (nsid 1 removed, nsid 3 added on its file): the
        // old opening lives on in its sessions, so refused too.
        let mut table = NamespaceTable::open_all(from).unwrap();
        let mut renumbered = to.clone();
        renumbered.subsystems[0].namespaces[0].nsid = 3;
        let diff = crate::reload::diff(from, &renumbered);
        assert_eq!(diff.namespaces_added, [(nqn.clone(), 3)]);
        let e = table.apply(&diff, &renumbered).unwrap_err();
        assert!(
            matches!(&e, NamespaceError::SimulationChanged { nsid: 3, .. }),
            "{e:?}"
        );
    }
}

/// A namespace path that names a FIFO is refused, at once: looking for a failure mark on it
/// (for a file that may open short) must not open it blocking (a start, or a reload under the
/// daemon's lock, waited for a writer for ever).
#[test]
fn a_fifo_for_a_path_is_refused_without_waiting_for_a_writer() {
    let d = tempfile::tempdir().unwrap();
    nix::unistd::mkfifo(
        &d.path().join("n1"),
        nix::sys::stat::Mode::from_bits_truncate(0o600),
    )
    .unwrap();
    let c = cfg(d.path(), "");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(
            NamespaceTable::open_all(&c)
                .map(|_| ())
                .map_err(|e| e.to_string()),
        );
    });
    let r = rx
        .recv_timeout(std::time::Duration::from_secs(30))
        .expect("open_all returned");
    let e = r.unwrap_err();
    assert!(e.contains("namespace 1"), "{e}");
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
    let nqn = Nqn::new("nqn.2026-11.io.rpma:t").unwrap();
    assert!(
        [1, 2]
            .iter()
            .all(|&n| !table.get(&nqn, n).unwrap().is_retired()),
        "nothing retired when an open failed"
    );
}

#[test]
fn a_failure_is_remembered_across_openings_until_cleared() {
    let d = tempfile::tempdir().unwrap();
    let cfg = cfg(d.path(), "");
    let nqn = Nqn::new("nqn.2026-11.io.rpma:t").unwrap();
    let ledger = Arc::new(FailureLedger::open(&d.path().join("state")).unwrap());
    let table = NamespaceTable::open_all_remembering(&cfg, Some(Arc::clone(&ledger))).unwrap();
    let ns1 = table.get(&nqn, 1).unwrap();
    assert!(ns1.failure().is_none() && ns1.remembered().is_none());
    // The mapping's first failure reaches the state file at once.
    let f = SyncFailure::new("msync", &std::io::Error::from_raw_os_error(libc::EIO));
    ns1.mapping.record_failure(f);
    let r = ledger.get(&ns1.config.path).expect("recorded");
    assert_eq!((r.nsid, r.sync_failure()), (1, f));
    drop(table);
    drop(ledger);

    // A restart: opened failed, nothing durable; the other namespace is healthy.
    let ledger = Arc::new(FailureLedger::open(&d.path().join("state")).unwrap());
    let mut table = NamespaceTable::open_all_remembering(&cfg, Some(Arc::clone(&ledger))).unwrap();
    let ns1 = Arc::clone(table.get(&nqn, 1).unwrap());
    assert_eq!(ns1.failure(), Some(f));
    assert!(ns1.mapping.persist(0, 4096).is_err());
    assert!(table.get(&nqn, 2).unwrap().failure().is_none());

    // A reload that reopens it keeps it failed.
    let mut diff = crate::reload::diff(&cfg, &cfg);
    assert_eq!(table.reopen_failed(&mut diff).len(), 1);
    table.apply(&diff, &cfg).unwrap();
    assert!(!Arc::ptr_eq(table.get(&nqn, 1).unwrap(), &ns1), "reopened");
    assert_eq!(table.get(&nqn, 1).unwrap().failure(), Some(f));

    // Clearing: healthy, forgotten, and it says what may be lost; only once.
    let key = (nqn.clone(), 1);
    let c = table.clear_failure(&key, &cfg).unwrap();
    assert_eq!(c.failure, f);
    assert!(c.what_may_be_lost(&key).contains("may be lost"));
    let ns1 = Arc::clone(table.get(&nqn, 1).unwrap());
    assert!(ns1.failure().is_none());
    assert!(ns1.mapping.persist(0, 4096).is_ok());
    assert!(ledger.all().is_empty());
    assert!(matches!(
        table.clear_failure(&key, &cfg),
        Err(NamespaceError::NotFailed { nsid: 1, .. })
    ));
    assert!(matches!(
        table.clear_failure(&(nqn.clone(), 9), &cfg),
        Err(NamespaceError::NotFound { nsid: 9, .. })
    ));
    // And a failure after clearing is remembered again.
    ns1.mapping.record_failure(f);
    assert!(ledger.get(&ns1.config.path).is_some());
}

/// The file's own mark remembers a failure the state file in use does not list (a daemon
/// started with another `state_file`, or one removed by hand): the namespace opens failed and
/// that state file learns it; clearing removes the mark. (A new state file forgot it: the
/// namespace opened healthy and its persists succeeded over pages the media did not hold.)
#[test]
fn a_failure_marks_the_file_for_a_state_file_that_never_saw_it() {
    use std::os::fd::AsFd;
    let d = tempfile::tempdir().unwrap();
    let cfg = cfg(d.path(), "");
    let nqn = Nqn::new("nqn.2026-11.io.rpma:t").unwrap();
    let first = Arc::new(FailureLedger::open(&d.path().join("state-a")).unwrap());
    let table = NamespaceTable::open_all_remembering(&cfg, Some(first)).unwrap();
    let f = SyncFailure::new(
        "fdatasync",
        &std::io::Error::from_raw_os_error(libc::ENOSPC),
    );
    table.get(&nqn, 1).unwrap().mapping.record_failure(f);
    drop(table);
    let file = std::fs::File::open(d.path().join("n1")).unwrap();
    let marked = mark::get(file.as_fd()).unwrap();
    if marked.is_none() && !mark::set(file.as_fd(), &f).unwrap() {
        eprintln!("skipped: this filesystem has no user attributes");
        return;
    }
    assert_eq!(marked, Some(f), "the failure marked the file");

    // Started with another state file: failed all the same, and that file learns it.
    let other = Arc::new(FailureLedger::open(&d.path().join("state-b")).unwrap());
    let mut table = NamespaceTable::open_all_remembering(&cfg, Some(Arc::clone(&other))).unwrap();
    let ns1 = table.get(&nqn, 1).unwrap();
    assert_eq!(ns1.failure(), Some(f));
    assert!(ns1.mapping.persist(0, 4096).is_err());
    assert_eq!(
        other.get(&ns1.config.path).map(|e| e.sync_failure()),
        Some(f)
    );
    assert!(table.get(&nqn, 2).unwrap().failure().is_none());

    // Cleared: the mark goes, and a third state file finds the file healthy.
    table.clear_failure(&(nqn.clone(), 1), &cfg).unwrap();
    assert_eq!(mark::get(file.as_fd()).unwrap(), None);
    drop(table);
    let third = Arc::new(FailureLedger::open(&d.path().join("state-c")).unwrap());
    let table = NamespaceTable::open_all_remembering(&cfg, Some(third)).unwrap();
    assert!(table.get(&nqn, 1).unwrap().failure().is_none());
}

/// A file moved over the namespace's path while the old file is still mapped, and the old
/// file's sync then fails: the state file records the file that failed (its device and
/// inode), not the one the path names by then. (It recorded the newcomer's: the failed file,
/// configured elsewhere later, matched neither its path nor its inode and opened healthy.)
#[test]
fn the_state_file_records_the_file_that_failed_not_what_its_path_names_now() {
    use std::os::unix::fs::MetadataExt;
    let d = tempfile::tempdir().unwrap();
    let cfg = cfg(d.path(), "");
    let nqn = Nqn::new("nqn.2026-11.io.rpma:t").unwrap();
    let ledger = Arc::new(FailureLedger::open(&d.path().join("state")).unwrap());
    let table = NamespaceTable::open_all_remembering(&cfg, Some(Arc::clone(&ledger))).unwrap();
    let ns1 = table.get(&nqn, 1).unwrap();
    let failed_file = ns1.file_id().unwrap();
    std::fs::write(d.path().join("restored"), vec![0u8; 64 << 10]).unwrap();
    std::fs::rename(d.path().join("restored"), d.path().join("n1")).unwrap();
    let newcomer = std::fs::metadata(d.path().join("n1")).unwrap();
    assert_ne!((newcomer.dev(), newcomer.ino()), failed_file);
    let f = SyncFailure::new("fdatasync", &std::io::Error::from_raw_os_error(libc::EIO));
    ns1.mapping.record_failure(f);
    let entry = ledger.get(&ns1.config.path).expect("recorded");
    assert_eq!(entry.file, Some(failed_file));
}

#[test]
fn a_failure_the_state_file_missed_is_carried_by_a_reload() {
    let d = tempfile::tempdir().unwrap();
    let cfg = cfg(d.path(), "");
    let nqn = Nqn::new("nqn.2026-11.io.rpma:t").unwrap();
    // Without a ledger (the state file could not take it): the reload still keeps it.
    let mut table = NamespaceTable::open_all(&cfg).unwrap();
    let f = SyncFailure::new(
        "fdatasync",
        &std::io::Error::from_raw_os_error(libc::ENOSPC),
    );
    table.get(&nqn, 2).unwrap().mapping.record_failure(f);
    let mut diff = crate::reload::diff(&cfg, &cfg);
    table.reopen_failed(&mut diff);
    table.apply(&diff, &cfg).unwrap();
    assert_eq!(table.get(&nqn, 2).unwrap().failure(), Some(f));
    // A new path is another file: nothing to carry.
    let mut moved = cfg.clone();
    moved.subsystems[0].namespaces[1].path = d.path().join("n2b");
    let diff = crate::reload::diff(&cfg, &moved);
    table.apply(&diff, &moved).unwrap();
    assert!(table.get(&nqn, 2).unwrap().failure().is_none());
}

/// A reload reopened the namespace while a session still held the old opening, whose sync then
/// failed (the kernel reports a write-back error to the descriptions that were open, once): the
/// new opening fails with it at once, not at the next restart.
#[test]
fn a_failure_of_an_opening_a_reload_replaced_reaches_the_new_one() {
    let d = tempfile::tempdir().unwrap();
    let cfg = cfg(d.path(), "");
    let nqn = Nqn::new("nqn.2026-11.io.rpma:t").unwrap();
    let ledger = Arc::new(FailureLedger::open(&d.path().join("state")).unwrap());
    let mut table = NamespaceTable::open_all_remembering(&cfg, Some(Arc::clone(&ledger))).unwrap();
    let held = Arc::clone(table.get(&nqn, 1).unwrap());
    let mut diff = crate::reload::diff(&cfg, &cfg);
    diff.namespaces_changed.push((nqn.clone(), 1));
    table.apply(&diff, &cfg).unwrap();
    let fresh = Arc::clone(table.get(&nqn, 1).unwrap());
    assert!(!Arc::ptr_eq(&held, &fresh), "reopened");
    assert!(fresh.failure().is_none());
    let f = SyncFailure::new("fdatasync", &std::io::Error::from_raw_os_error(libc::EIO));
    held.mapping.record_failure(f);
    assert_eq!(fresh.failure(), Some(f), "the live opening fails with it");
    assert!(fresh.mapping.persist(0, 4096).is_err());
    assert!(ledger.get(&fresh.config.path).is_some());
    assert!(
        table.get(&nqn, 2).unwrap().failure().is_none(),
        "another file"
    );
    // Cleared, the file is healthy in the new opening, while the failed one is still held.
    table.clear_failure(&(nqn.clone(), 1), &cfg).unwrap();
    let cleared = table.get(&nqn, 1).unwrap();
    assert!(cleared.failure().is_none());
    assert!(cleared.mapping.persist(0, 4096).is_ok());
    drop(held);
}

/// Two tables on one file, as two daemons would have: the second is refused.
#[test]
fn a_file_another_process_serves_is_not_opened() {
    let d = tempfile::tempdir().unwrap();
    let cfg = cfg(d.path(), "");
    // Creates the files, and lets them go.
    drop(NamespaceTable::open_all(&cfg).unwrap());
    // Another open file description holding the lock, as another daemon's registry would.
    let f = std::fs::File::open(&cfg.subsystems[0].namespaces[0].path).unwrap();
    let fd = std::os::fd::AsRawFd::as_raw_fd(&f);
    // SAFETY: flock only reads the descriptor, kept open by `f`.
    let locked = unsafe { libc::flock(fd, libc::LOCK_EX | libc::LOCK_NB) };
    assert_eq!(locked, 0);
    let err = NamespaceTable::open_all(&cfg).unwrap_err();
    assert!(
        matches!(
            err,
            NamespaceError::Claim {
                nsid: 1,
                source: ClaimError::InUse,
                ..
            }
        ),
        "{err:?}"
    );
    drop(f);
    assert!(NamespaceTable::open_all(&cfg).is_ok());
}

/// A page-cache namespace is opened once more for each of the daemon's flush services (one per
/// poll loop of each kind of listener), whatever a reload says: no two loops sync it through
/// one open file, where one loop's sync could take a write-back error's report and another's 0
/// be answered durable first. (Four files were opened and a fifth loop shared the first's.)
#[test]
fn a_page_cache_namespace_has_an_open_file_per_flush_service() {
    let d = tempfile::tempdir().unwrap();
    let body = "[[subsystem]]\nnqn = \"nqn.2026-11.io.rpma:t\"\nallow_any_host = true\n\
                [[subsystem.namespace]]\nnsid = 1\npath = \"n1\"\nsize = \"64KiB\"\n";
    let top = |loops: u32| {
        format!(
            "listen = [\"tcp://127.0.0.1:7420\", \"nvme-tcp://127.0.0.1:4420\"]\n\
             poll_loops = {loops}\n"
        )
    };
    let old = config::Config::from_toml(&format!("{}{body}", top(3)), d.path()).unwrap();
    assert_eq!(old.flush_services(), 6);
    let mut table = NamespaceTable::open_all(&old).unwrap();
    let nqn = Nqn::new("nqn.2026-11.io.rpma:t").unwrap();
    let ns1 = table.get(&nqn, 1).unwrap().clone();
    assert_eq!(ns1.domain(), Domain::PageCache, "{:?}", d.path());
    assert_eq!(ns1.flush_target.open_files(), 6);

    // A reload's new namespace: the start's six (poll_loops needs a restart).
    let new = config::Config::from_toml(
        &format!(
            "{}{body}[[subsystem.namespace]]\nnsid = 2\npath = \"n2\"\nsize = \"64KiB\"\n",
            top(7)
        ),
        d.path(),
    )
    .unwrap();
    let diff = crate::reload::diff(&old, &new);
    table.apply(&diff, &new).unwrap();
    let ns2 = table.get(&nqn, 2).unwrap();
    assert_eq!(ns2.flush_target.open_files(), 6);

    // Without an nvme-tcp listener: the native loops alone.
    let native = config::Config::from_toml(
        &format!("listen = [\"tcp://127.0.0.1:7420\"]\npoll_loops = 5\n{body}"),
        d.path(),
    )
    .unwrap();
    assert_eq!(native.flush_services(), 5);
    drop((table, ns1));
    let table = NamespaceTable::open_all(&native).unwrap();
    assert_eq!(table.get(&nqn, 1).unwrap().flush_target.open_files(), 5);
    drop(table);

    // An nvme-tcp listener alone: its loops' (the native loops start, and never sync).
    let nvme = config::Config::from_toml(
        &format!("listen = [\"nvme-tcp://127.0.0.1:4420\"]\npoll_loops = 2\n{body}"),
        d.path(),
    )
    .unwrap();
    assert_eq!(nvme.flush_services(), 2);
    let table = NamespaceTable::open_all(&nvme).unwrap();
    assert_eq!(table.get(&nqn, 1).unwrap().flush_target.open_files(), 2);
}

/// A clear-failure that fails (here the configuration it reopens with asks a larger file,
/// without `grow`) leaves the file's failed openings counting: a reload that maps the file
/// under another key starts that namespace failed. (They were forgotten before anything of
/// the clear could fail: without a state file or a mark, nsid 2 on the same file opened
/// healthy, and its persists succeeded over pages the media did not hold.)
#[test]
fn a_failed_clear_leaves_the_file_failed_for_its_next_opening() {
    let d = tempfile::tempdir().unwrap();
    let cfg = cfg(d.path(), "");
    let nqn = Nqn::new("nqn.2026-11.io.rpma:t").unwrap();
    let mut table = NamespaceTable::open_all(&cfg).unwrap();
    let f = SyncFailure::new("fdatasync", &std::io::Error::from_raw_os_error(libc::EIO));
    table.get(&nqn, 1).unwrap().mapping.record_failure(f);
    let mut bigger = cfg.clone();
    bigger.subsystems[0].namespaces[0].size = Some(128 << 10);
    let e = table.clear_failure(&(nqn.clone(), 1), &bigger).unwrap_err();
    assert!(
        matches!(e, NamespaceError::WouldGrow { nsid: 1, .. }),
        "{e:?}"
    );
    assert_eq!(table.get(&nqn, 1).unwrap().failure(), Some(f));
    // nsid 1 removed, and nsid 2 moved onto its file.
    let mut moved = cfg.clone();
    moved.subsystems[0].namespaces.remove(0);
    moved.subsystems[0].namespaces[0].path = cfg.subsystems[0].namespaces[0].path.clone();
    let diff = crate::reload::diff(&cfg, &moved);
    table.apply(&diff, &moved).unwrap();
    let ns2 = table.get(&nqn, 2).unwrap();
    assert_eq!(ns2.failure(), Some(f), "the same file, failed");
    assert!(ns2.mapping.persist(0, 4096).is_err());
}

/// A failure the state file could not take is written by the next reload (which reopens the
/// failed namespace), not only by the next failure. (It waited for another failure, and a
/// restart before one forgot it.)
#[test]
fn a_reload_writes_a_failure_the_state_file_could_not_take() {
    let d = tempfile::tempdir().unwrap();
    let cfg = cfg(d.path(), "");
    let nqn = Nqn::new("nqn.2026-11.io.rpma:t").unwrap();
    let state = d.path().join("state");
    let ledger = Arc::new(FailureLedger::open(&state).unwrap());
    let mut table = NamespaceTable::open_all_remembering(&cfg, Some(Arc::clone(&ledger))).unwrap();
    ledger.fail_next_write();
    let f = SyncFailure::new("fdatasync", &std::io::Error::from_raw_os_error(libc::EIO));
    table.get(&nqn, 1).unwrap().mapping.record_failure(f);
    assert_eq!(crate::failures::peek(&state).unwrap(), Some(vec![]));
    let mut diff = crate::reload::diff(&cfg, &cfg);
    table.reopen_failed(&mut diff);
    table.apply(&diff, &cfg).unwrap();
    let listed = crate::failures::peek(&state).unwrap().unwrap();
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0].sync_failure(), f);
}

/// A clear-failure whose state file could not be written leaves the file's mark as it was
/// (removed before the state file is written, it is put back): the namespace stays failed in
/// memory, in the state file and on its file. (The mark was gone, so a daemon started with
/// another state file found the file healthy.)
#[test]
fn a_clear_the_state_file_refused_leaves_the_mark() {
    use std::os::fd::AsFd;
    let d = tempfile::tempdir().unwrap();
    let cfg = cfg(d.path(), "");
    let nqn = Nqn::new("nqn.2026-11.io.rpma:t").unwrap();
    let ledger = Arc::new(FailureLedger::open(&d.path().join("state")).unwrap());
    let mut table = NamespaceTable::open_all_remembering(&cfg, Some(Arc::clone(&ledger))).unwrap();
    let f = SyncFailure::new("fdatasync", &std::io::Error::from_raw_os_error(libc::EIO));
    table.get(&nqn, 1).unwrap().mapping.record_failure(f);
    let file = std::fs::File::open(d.path().join("n1")).unwrap();
    if mark::get(file.as_fd()).unwrap().is_none() {
        eprintln!("skipped: this filesystem has no user attributes");
        return;
    }
    ledger.fail_next_write();
    let e = table.clear_failure(&(nqn.clone(), 1), &cfg).unwrap_err();
    assert!(matches!(e, NamespaceError::Ledger { nsid: 1, .. }), "{e:?}");
    assert_eq!(mark::get(file.as_fd()).unwrap(), Some(f), "the mark");
    assert_eq!(table.get(&nqn, 1).unwrap().failure(), Some(f));
    assert!(ledger.get(&d.path().join("n1")).is_some());
}

/// check-config and the daemon agree on a short file whose failure is known: opened failed
/// (check-config passes), except under the power-loss simulation, which the daemon refuses
/// (check-config said it would open failed, and the unit's ExecStartPre let through a start
/// that then failed).
#[test]
fn check_config_and_the_daemon_agree_on_a_known_failed_short_file() {
    for sim in ["", "power_loss_simulation = { eviction_percent = 0 }\n"] {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("n1"), vec![0u8; 8192]).unwrap();
        let f = std::fs::File::open(d.path().join("n1")).unwrap();
        super::mark::set(
            std::os::fd::AsFd::as_fd(&f),
            &SyncFailure {
                op: "load/store",
                errno: libc::EIO,
            },
        )
        .unwrap();
        let text = format!(
            "state_file = \"state\"\n[[subsystem]]\nnqn = \"nqn.2026-11.io.rpma:t\"\n\
             allow_any_host = true\n[[subsystem.namespace]]\nnsid = 1\npath = \"n1\"\n\
             size = \"64KiB\"\n{sim}"
        );
        let path = d.path().join("c.toml");
        std::fs::write(&path, &text).unwrap();
        let mut out = Vec::new();
        let checked = crate::check::check_config(&path, &mut out).unwrap();
        let cfg = config::Config::from_toml(&text, d.path()).unwrap();
        let opened = NamespaceTable::open_all(&cfg).map(|_| ());
        assert_eq!(
            checked,
            opened.is_ok(),
            "{sim:?}: check-config {checked}, the daemon {opened:?}: {}",
            String::from_utf8_lossy(&out)
        );
    }
}
