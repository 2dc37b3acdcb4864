use super::*;

fn ctrl(kind: CtrlKind) -> Controller {
    Controller::new(
        1,
        kind,
        Nqn::new("nqn.2026-11.io.rpma:s").unwrap(),
        Nqn::new("nqn.2026-11.io.rpma:h").unwrap(),
        [0; 16],
        Vec::new(),
        Duration::from_secs(5),
        128,
        Instant::now(),
    )
}

const GOOD_CC: u32 = 1 | (6 << 16) | (4 << 20);

#[test]
fn enable_disable_and_shutdown() {
    let c = ctrl(CtrlKind::Io);
    assert_eq!(c.cap() & 0xffff, 127, "MQES is 0's based");
    assert_ne!(c.cap() & (1 << 37), 0, "NVM command set");
    assert!(!c.ready());
    assert_eq!(c.set_cc(GOOD_CC), CcChange::Enabled);
    assert!(c.ready());
    assert_eq!(c.set_cc(GOOD_CC | (1 << 14)), CcChange::Shutdown);
    assert_eq!(c.csts() & csts::SHST_MASK, csts::SHST_OCCURRING);
    assert!(c.was_shut_down());
    c.shutdown_done(true);
    assert_eq!(c.csts() & csts::SHST_MASK, csts::SHST_COMPLETE);
    assert_eq!(c.set_cc(0), CcChange::Disabled);
    assert!(!c.ready());
    // Queue entry sizes other than 64/16 bytes are a fatal status, never ready.
    assert_eq!(c.set_cc(1 | (7 << 16) | (4 << 20)), CcChange::None);
    assert_eq!(c.csts(), csts::CFS);
}

#[test]
fn queues_are_granted_and_attached_once() {
    let c = ctrl(CtrlKind::Io);
    assert_eq!(c.set_io_queues(64), MAX_IO_QUEUES);
    assert_eq!(c.set_io_queues(2), 2);
    assert!(!c.attach_io_queue(0));
    assert!(c.attach_io_queue(1));
    assert!(!c.attach_io_queue(1), "twice");
    assert!(c.attach_io_queue(2));
    assert!(!c.attach_io_queue(3), "not granted");
    c.detach_io_queue(1);
    assert!(c.attach_io_queue(1));
}

#[test]
fn events_wait_for_their_enable_and_are_masked_until_read() {
    let c = ctrl(CtrlKind::Io);
    c.set_namespaces(Vec::new(), &[3]);
    assert_eq!(c.take_event(), None, "not enabled");
    assert_eq!(c.changed_namespaces(false), [3], "still listed");
    c.set_aec(aen::AEC_NS_ATTR);
    let g = c.ns_generation();
    c.set_namespaces(Vec::new(), &[5]);
    assert_eq!(c.ns_generation(), g + 1);
    assert_eq!(c.take_event(), Some(aen::NS_CHANGED));
    c.set_namespaces(Vec::new(), &[6]);
    assert_eq!(c.take_event(), None, "masked until the log is read");
    assert_eq!(c.changed_namespaces(true), [3, 5, 6]);
    assert!(c.changed_namespaces(false).is_empty());
    c.set_namespaces(Vec::new(), &[7]);
    assert_eq!(
        c.take_event(),
        Some(aen::NS_CHANGED),
        "unmasked by the read"
    );
}

/// A namespace that fails under a controller stays failed to it after the clear, through a
/// reload that reopened it failed in between; a controller connected while it was failed
/// gets the cleared one.
#[test]
fn a_namespace_that_failed_under_a_controller_stays_lost_to_it() {
    use crate::namespace::NamespaceTable;
    use rpma_common::pmem::{Persist, SyncFailure};
    let d = tempfile::tempdir().unwrap();
    let text = "listen = [\"nvme-tcp://127.0.0.1:4420\"]\n[[subsystem]]\n\
                nqn = \"nqn.2026-11.io.rpma:s\"\nallow_any_host = true\n\
                [[subsystem.namespace]]\nnsid = 1\npath = \"n1\"\nsize = \"1MiB\"\n";
    let cfg = crate::config::Config::from_toml(text, d.path()).unwrap();
    let mut table = NamespaceTable::open_all(&cfg).unwrap();
    let sub = Nqn::new("nqn.2026-11.io.rpma:s").unwrap();
    let ns = |t: &NamespaceTable| vec![Arc::clone(t.get(&sub, 1).unwrap())];
    let new = |nss| {
        let host = Nqn::new("nqn.2026-11.io.rpma:h").unwrap();
        let t = Instant::now();
        let s = sub.clone();
        Controller::new(1, CtrlKind::Io, s, host, [0; 16], nss, Duration::ZERO, 8, t)
    };
    let entry = |c: &Controller| c.namespaces().1[&1].clone();
    let attached = new(ns(&table));
    assert!(!entry(&attached).failed());
    let f = SyncFailure::new("fdatasync", &std::io::Error::from_raw_os_error(libc::EIO));
    table.get(&sub, 1).unwrap().mapping.record_failure(f);
    let late = new(ns(&table));
    assert!(entry(&attached).failed() && entry(&late).failed());
    // A reload reopens it, still failed.
    let mut diff = crate::reload::diff(&cfg, &cfg);
    assert_eq!(table.reopen_failed(&mut diff).len(), 1);
    table.apply(&diff, &cfg).unwrap();
    assert_eq!(
        attached.set_namespaces(ns(&table), &[1]),
        [1],
        "lost from now on"
    );
    assert!(late.set_namespaces(ns(&table), &[1]).is_empty());
    // The clear: a new, healthy opening.
    table.clear_failure(&(sub.clone(), 1), &cfg).unwrap();
    assert!(
        attached.set_namespaces(ns(&table), &[1]).is_empty(),
        "said once"
    );
    assert!(late.set_namespaces(ns(&table), &[1]).is_empty());
    let (a, l) = (entry(&attached), entry(&late));
    assert!(a.ns.failure().is_none() && a.lost && a.failed());
    assert!(attached.any_failed());
    assert!(!l.failed() && !late.any_failed());
    assert!(
        !entry(&new(ns(&table))).failed(),
        "connected after the clear"
    );
    // Removed by a reload: still failed to it (its writes there may be lost); added
    // back: still lost.
    attached.set_namespaces(Vec::new(), &[1]);
    assert!(
        attached.any_failed(),
        "removed, its lost writes still count"
    );
    attached.set_namespaces(ns(&table), &[1]);
    assert!(entry(&attached).lost);
}

#[test]
fn keep_alive_and_write_cache() {
    let c = ctrl(CtrlKind::Io);
    let t0 = Instant::now();
    c.keep_alive(t0);
    assert_eq!(c.keep_alive_deadline(), Some(t0 + Duration::from_secs(5)));
    c.set_kato(Duration::ZERO, t0);
    assert_eq!(c.keep_alive_deadline(), None);
    assert!(!c.vwc, "no namespace needs one");
    assert!(!c.set_wce(true));
    assert!(!c.wce());
}
