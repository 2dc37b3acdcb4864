//! The real `dax` domain end to end, on the VM lab's emulated persistent memory
//! (tests/vm/guest-lab.sh): an ext4 mounted `-o dax` (`RPMA_TEST_DAX_DIR`) and a devdax device
//! (`RPMA_TEST_DEVDAX`). Ignored on the host, which has neither; `make test` runs them in the
//! guest, over `tcp` and (the devdax one's `rdma::` twin) over Soft-RoCE.
//!
//! - A namespace on the DAX filesystem is probed `dax` with no `force_dax`, and a durable
//!   write on it is made durable by cache write-back (clwb) in the target: strace of the target
//!   sees no msync, fsync, fdatasync, sync_file_range or io_uring submission (the flusher's
//!   fdatasync path) while the host writes durably with every method offered. The same count
//!   on a page-cache namespace of the same target is not zero, so the count can fail.
//! - A namespace on the devdax device is served (probed `dax`, pinned on rdma), and its
//!   durable bytes are there after a SIGKILL of the target.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use rpma_common::proto::PersistenceDomain;
use rpma_initiator::{Connection, Durability, PersistMethod};
use rpma_tests::{host, noise, nqn, opts, scratch, Config, Namespace, Subsystem, Target};

const SUB: &str = "nqn.2026-11.io.rpma:real-dax";
const HOST: &str = "nqn.2026-11.io.rpma:real-dax-host";

/// The path an environment variable of the VM lab names; a missing one fails the test with
/// what to set, rather than passing without having tested anything.
fn lab_path(var: &str) -> PathBuf {
    match std::env::var_os(var) {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => panic!("set {var} (the VM lab does: make vm-test; docs/testing.md)"),
    }
}

/// strace attached to a running process, recording the calls that write a file range back.
struct SyncCalls {
    strace: Child,
    out: PathBuf,
}

/// What a persist can call besides cache write-back: the page-cache paths (msync for APM and
/// FLUSH in the placement engine, fdatasync through io_uring or a thread for GPSPM).
const SYNC_CALLS: &str = "msync,fsync,fdatasync,sync_file_range,io_uring_enter";

impl SyncCalls {
    /// Attaches to every thread of `pid` and returns once strace says it is attached.
    fn attach(pid: u32, out: PathBuf) -> SyncCalls {
        let mut strace = Command::new("strace")
            .args(["-f", "-e", &format!("trace={SYNC_CALLS}"), "-o"])
            .arg(&out)
            .args(["-p", &pid.to_string()])
            .stderr(Stdio::piped())
            .spawn()
            .expect("strace runs (scripts/vm-setup.sh installs it)");
        let mut err = BufReader::new(strace.stderr.take().unwrap());
        let mut line = String::new();
        loop {
            line.clear();
            let n = err.read_line(&mut line).unwrap();
            assert!(n > 0, "strace ended before attaching to {pid}");
            if line.contains("attached") {
                break;
            }
        }
        // Keep draining strace's stderr so that it never blocks on it.
        std::thread::spawn(move || std::io::copy(&mut err, &mut std::io::sink()));
        SyncCalls { strace, out }
    }

    /// Detaches (SIGINT) and returns the calls strace saw, one line each.
    fn stop(mut self) -> Vec<String> {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.strace.id() as i32),
            nix::sys::signal::Signal::SIGINT,
        )
        .unwrap();
        self.strace.wait().unwrap();
        std::fs::read_to_string(&self.out)
            .unwrap()
            .lines()
            .filter(|l| SYNC_CALLS.split(',').any(|c| l.contains(&format!("{c}("))))
            .map(str::to_owned)
            .collect()
    }
}

/// A queue of `t` for HOST on SUB.
fn queue(t: &Target) -> rpma_initiator::Queue {
    Connection::new(&t.url(), nqn(SUB), host(HOST))
        .with_connect_options(opts())
        .open_queue(0)
        .unwrap()
}

/// A target serving nsid 1 on a file of the VM lab's DAX filesystem, in a directory named
/// `prefix`..., and nsid 2 on page cache, 8 MiB each: its scratch directory, the directory on
/// DAX, the file there, the target.
fn dax_and_page_cache(prefix: &str) -> (tempfile::TempDir, tempfile::TempDir, PathBuf, Target) {
    let dax_dir = lab_path("RPMA_TEST_DAX_DIR");
    let d = scratch();
    let on_dax = tempfile::Builder::new()
        .prefix(prefix)
        .tempdir_in(&dax_dir)
        .unwrap();
    let dax_ns = on_dax.path().join("ns.pmem");
    let config = Config::new().subsystem(
        Subsystem::new(SUB)
            .host(HOST)
            .namespace(Namespace::new(1, dax_ns.to_str().unwrap(), "8MiB"))
            .namespace(Namespace::new(2, "page-cache.ns", "8MiB")),
    );
    let t = Target::start(d.path(), &config.to_string());
    (d, on_dax, dax_ns, t)
}

/// Durable writes on namespace `nsid` with every method the target offers on it, with the
/// target's sync calls recorded meanwhile; returns them.
fn durable_writes_traced(t: &Target, nsid: u32, trace: PathBuf) -> Vec<String> {
    let mut q = queue(t);
    let mut ns = q.namespace(nsid).unwrap();
    let offered = ns.descriptor().durability;
    let methods: Vec<PersistMethod> = [
        (
            rpma_common::proto::DurabilityMethods::APM,
            PersistMethod::Apm,
        ),
        (
            rpma_common::proto::DurabilityMethods::GPSPM,
            PersistMethod::Gpspm,
        ),
        (
            rpma_common::proto::DurabilityMethods::FLUSH,
            PersistMethod::Flush,
        ),
    ]
    .into_iter()
    .filter(|(m, _)| offered.contains(*m))
    .map(|(_, p)| p)
    .collect();
    assert!(!methods.is_empty(), "nsid {nsid}: nothing durable offered");
    let calls = SyncCalls::attach(t.pid(), trace);
    for (i, m) in methods.iter().enumerate() {
        ns.set_method(Some(*m)).unwrap();
        let data = noise(i as u64 + 1, 64 << 10);
        let at = (i as u64) << 20;
        assert_eq!(
            ns.write_durable(at, &data).unwrap(),
            Durability::Durable(*m),
            "nsid {nsid}"
        );
        let mut back = vec![0u8; data.len()];
        ns.read_at(at, &mut back).unwrap();
        assert!(back == data, "nsid {nsid}: read back with {m}");
    }
    calls.stop()
}

#[test]
#[ignore = "requires the VM lab: a DAX filesystem (RPMA_TEST_DAX_DIR; make vm-test)"]
fn a_durable_write_on_real_dax_is_cache_write_back_with_no_sync_call() {
    let (d, _on_dax, _, t) = dax_and_page_cache("rpma-real-dax-");
    let id = rpma_initiator::identify(&t.url(), &nqn(SUB), &host(HOST), &opts()).unwrap();
    let domain = |n: u32| id.namespaces.iter().find(|d| d.nsid == n).unwrap().domain;
    assert_eq!(domain(1), PersistenceDomain::Dax, "probed dax, not forced");
    assert_eq!(domain(2), PersistenceDomain::PageCache);

    let dax_calls = durable_writes_traced(&t, 1, d.path().join("dax.strace"));
    assert!(
        dax_calls.is_empty(),
        "a durable write on dax made sync calls: {dax_calls:?}"
    );
    // The control: the same on page cache does call the kernel, and strace sees it.
    let pc_calls = durable_writes_traced(&t, 2, d.path().join("page-cache.strace"));
    assert!(
        !pc_calls.is_empty(),
        "no sync call seen for durable writes on page cache: the trace sees nothing"
    );
}

#[test]
#[ignore = "requires the VM lab: a devdax device (RPMA_TEST_DEVDAX; make vm-test)"]
fn a_devdax_namespace_is_served_and_keeps_durable_bytes_across_sigkill() {
    let dev = lab_path("RPMA_TEST_DEVDAX");
    let d = scratch();
    let config = Config::new().subsystem(
        Subsystem::new(SUB)
            .host(HOST)
            .namespace(Namespace::existing(1, dev.to_str().unwrap())),
    );
    let mut t = Target::start(d.path(), &config.to_string());
    let data = noise(77, 256 << 10);
    // Far from the start: the pmem_dax test writes the device's first 4 KiB.
    let at = 8 << 20;
    {
        let mut q = queue(&t);
        let mut ns = q.namespace(1).unwrap();
        assert_eq!(ns.descriptor().domain, PersistenceDomain::Dax);
        let r = ns.write_durable(at, &data).unwrap();
        assert!(matches!(r, Durability::Durable(_)), "{r:?}");
    }
    t.kill9();
    t.restart();
    let mut q = queue(&t);
    let mut back = vec![0u8; data.len()];
    q.namespace(1).unwrap().read_at(at, &mut back).unwrap();
    assert!(back == data, "the durable bytes on devdax after SIGKILL");
}

// The fsdax test has no rdma:: twin: fsdax pages need on-demand paging for a NIC, and the VM
// lab's Soft-RoCE has none usable (docs/rdma.md, "Soft-RoCE and ODP"; transport_rdma.rs tests
// the refusal). devdax is pinned, and is served over rdma too.
rpma_tests::rdma_runs!(a_devdax_namespace_is_served_and_keeps_durable_bytes_across_sigkill);

/// A namespace file on the DAX filesystem cut short by another process: the target's read of a
/// page past the new end is a SIGBUS on a MAP_SYNC mapping of real (emulated) pmem, which the
/// pmem layer takes (docs/persistence.md, "A page the kernel cannot give back"): the host's
/// Read fails, the namespace fails, the daemon and its other namespace go on.
#[test]
#[ignore = "requires the VM lab: a DAX filesystem (RPMA_TEST_DAX_DIR; make vm-test)"]
fn a_real_dax_file_cut_short_fails_its_namespace_not_the_daemon() {
    let (_d, _on_dax, dax_ns, t) = dax_and_page_cache("rpma-real-dax-cut-");
    let data = noise(5, 1 << 20);
    {
        let mut q = queue(&t);
        let mut ns = q.namespace(1).unwrap();
        assert_eq!(ns.descriptor().domain, PersistenceDomain::Dax);
        let r = ns.write_durable(6 << 20, &data).unwrap();
        assert!(matches!(r, Durability::Durable(_)), "{r:?}");
    }
    std::fs::OpenOptions::new()
        .write(true)
        .open(&dax_ns)
        .unwrap()
        .set_len(4 << 20)
        .unwrap();
    let mut q = queue(&t);
    let mut back = vec![0u8; data.len()];
    let r = q
        .namespace(1)
        .and_then(|mut ns| ns.read_at(6 << 20, &mut back));
    assert!(r.is_err(), "the Read past the end succeeded: {r:?}");
    // The daemon lives (status answers) and says why; nsid 2 serves.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let v = t.namespace_status(1);
        if v["failed"]
            .as_str()
            .is_some_and(|s| s.contains("load/store"))
        {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "nsid 1 not failed: {v}"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let mut q = queue(&t);
    let mut ns = q.namespace(2).unwrap();
    let r = ns.write_durable(0, &data).unwrap();
    assert!(matches!(r, Durability::Durable(_)), "{r:?}");
}
