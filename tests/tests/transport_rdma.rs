//! The `rdma` transport end to end.
//!
//! On every machine: without an RDMA device, `rdma://` fails with "no RDMA device found; use
//! tcp://" in the fabric (`Context::for_url`) and through the real binaries: `rpma-target`
//! refuses to start on an `rdma://` listener, `check-config` reports it as a problem, and
//! `rpma-initiator --target rdma://...` refuses to connect.
//!
//! Wherever a device exists: the scenarios below (connect, durable write and read back through
//! the library and the CLI, GPSPM, atomics, a second session's rkey refused, a target restart)
//! run over `tcp` always and over `rdma` in their `rdma::` twins ([`rpma_tests::rdma_runs!`],
//! like the rest of the end-to-end suite), `#[ignore = "requires an RDMA device"]`, which need
//! `RPMA_TEST_RDMA_DEVICE` (the device, e.g. `rxe0`) and `RPMA_TEST_RDMA_ADDR` (an address of
//! that device's netdev to listen on). Unlike the rest of the suite, the target here declares no
//! `direct_write_to_pmem`: what it offers by default is part of what is tested. docs/rdma.md
//! sets up Soft-RoCE for them and says how to run them.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use rpma_common::fabric::{RemoteAddr, WcStatus};
use rpma_common::proto::DurabilityMethods;
use rpma_initiator::{connect, Connection, Durability, PersistMethod};
use rpma_tests::sessions::write_then_read;
use rpma_tests::{
    check_config, cli_read_with, cli_write_with, conn_args, free_port, host, initiator, noise, nqn,
    opts, scratch, text, Config, Daemon, Namespace, Shm, Subsystem, Target, Transport,
};

const SUB: &str = "nqn.2026-11.io.rpma:rdma-e2e";
const HOST: &str = "nqn.2026-11.io.rpma:rdma-host";
const NO_DEVICE: &str = "no RDMA device found; use tcp://";

/// A target serving SUB to HOST with one dax (forced) namespace on /dev/shm (durable as far as
/// the target's persistence goes, and pinnable for an RDMA NIC), killed on drop.
struct Setup {
    target: Target,
    shm: Shm,
    dir: tempfile::TempDir,
}

const NS_SIZE: usize = 4 << 20;

fn start(tag: &str) -> Setup {
    let dir = scratch();
    let shm = Shm::new(tag);
    let config = Config::new().subsystem(
        Subsystem::new(SUB)
            .host(HOST)
            .namespace(Namespace::new(1, shm.path(), "4MiB").force_dax()),
    );
    // No direct_write_to_pmem declaration: what the target offers by default on each transport.
    let listen = Transport::current().listen();
    let target = Target::start_on(dir.path(), &listen, &config.to_string(), &[]);
    assert!(
        target.ready().contains("1 of 1 listener(s) bound"),
        "{}",
        target.ready()
    );
    Setup { target, shm, dir }
}

fn queue(s: &Setup) -> rpma_initiator::Queue {
    Connection::new(&s.target.url(), nqn(SUB), host(HOST))
        .with_connect_options(opts())
        .open_queue(0)
        .expect("open a queue")
}

fn file(s: &Setup) -> Vec<u8> {
    let f = std::fs::read(s.shm.path()).expect("the namespace file");
    assert_eq!(f.len(), NS_SIZE);
    f
}

// ---- the scenarios: over tcp always, over rdma where a device is named ----

#[test]
fn write_durable_read_back() {
    let s = start("wdr");
    let mut q = queue(&s);
    let mut ns = q.namespace(1).unwrap();
    let data = noise(13, 256 << 10);
    let d = ns.write_durable(8192, &data).unwrap();
    assert!(matches!(d, Durability::Durable(_)), "{d:?}");
    let mut back = vec![0u8; data.len()];
    ns.read_at(8192, &mut back).unwrap();
    assert_eq!(back, data, "read back");
    assert_eq!(
        &file(&s)[8192..8192 + data.len()],
        &data[..],
        "in the namespace"
    );
    drop(q);
    // The CLI over the same transport: a durable write, then a read in another process.
    let conn = conn_args(&s.target.url(), SUB, HOST, Some(1));
    let line = b"the CLI, over the same transport";
    cli_write_with(&conn, s.dir.path(), 1 << 20, line);
    assert_eq!(
        cli_read_with(&conn, s.dir.path(), 1 << 20, line.len() as u64),
        line
    );
}

#[test]
fn gpspm() {
    let s = start("gpspm");
    let mut q = queue(&s);
    let mut ns = q.namespace(1).unwrap();
    let offered = ns.descriptor().durability;
    assert!(offered.contains(DurabilityMethods::GPSPM), "{offered:?}");
    match Transport::current() {
        // The placement engine makes APM valid on tcp.
        Transport::Tcp => assert!(offered.contains(DurabilityMethods::APM), "{offered:?}"),
        // On rdma APM needs the operator's direct_write_to_pmem (not declared here), and
        // rdma-core 44 has no Flush.
        Transport::Rdma { .. } => {
            assert!(!offered.contains(DurabilityMethods::APM), "{offered:?}");
            assert!(!offered.contains(DurabilityMethods::FLUSH), "{offered:?}");
        }
    }
    ns.set_method(Some(PersistMethod::Gpspm)).unwrap();
    let data = noise(21, 64 << 10);
    assert_eq!(
        ns.write_durable(0, &data).unwrap(),
        Durability::Durable(PersistMethod::Gpspm)
    );
    assert_eq!(&file(&s)[..data.len()], &data[..]);
}

#[test]
fn atomics() {
    let s = start("atomics");
    let mut q = queue(&s);
    let mut ns = q.namespace(1).unwrap();
    assert_eq!(ns.compare_and_swap(64, 0, 7).unwrap(), 0);
    assert_eq!(
        ns.compare_and_swap(64, 1, 99).unwrap(),
        7,
        "no swap on a mismatch"
    );
    assert_eq!(ns.fetch_add(64, 35).unwrap(), 7);
    let mut v = [0u8; 8];
    ns.read_at(64, &mut v).unwrap();
    assert_eq!(u64::from_ne_bytes(v), 42);
    assert_eq!(&file(&s)[64..72], &42u64.to_ne_bytes());
}

#[test]
fn second_session_rkey_refused() {
    let s = start("rkeys");
    let a = connect(&s.target.url(), &nqn(SUB), &host(HOST), &opts()).unwrap();
    let mut b = connect(&s.target.url(), &nqn(SUB), &host(HOST), &opts()).unwrap();
    let na = a.namespace(1).unwrap().clone();
    assert_ne!(
        na.rkey,
        b.namespace(1).unwrap().rkey,
        "an rkey per connection"
    );
    let stolen = RemoteAddr {
        addr: na.remote_addr + 4096,
        rkey: na.rkey,
    };
    // tcp: the Write is handed to TCP, the Read behind it fails; rdma: the Write itself fails
    // and the Read is flushed. Either way: RemoteAccess, and nothing placed.
    let st = write_then_read(&mut b, stolen, b"stolen rkey");
    assert!(st.contains(&WcStatus::RemoteAccess), "{st:?}");
    assert!(file(&s)[4096..4096 + 11].iter().all(|&b| b == 0));
    drop(a);
}

#[test]
fn target_restart() {
    let mut s = start("restart");
    let data = noise(34, 128 << 10);
    {
        let mut q = queue(&s);
        let d = q.namespace(1).unwrap().write_durable(4096, &data).unwrap();
        assert!(matches!(d, Durability::Durable(_)), "{d:?}");
    }
    s.target.restart();
    let mut q = queue(&s);
    let mut back = vec![0u8; data.len()];
    q.namespace(1).unwrap().read_at(4096, &mut back).unwrap();
    assert_eq!(back, data, "the durable bytes are there after the restart");
}

rpma_tests::rdma_runs!(
    write_durable_read_back,
    gpspm,
    atomics,
    second_session_rkey_refused,
    target_restart,
);

// ---- in the VM lab: what the device can register ----

/// A directory on a page-cache file system for namespaces that must be page cache whatever
/// the run's scratch is (`RPMA_TEST_SCRATCH` in the VM lab, else the build directory).
fn page_cache_dir() -> tempfile::TempDir {
    let root = std::env::var_os(rpma_tests::SCRATCH_VAR)
        .map(std::path::PathBuf::from)
        .unwrap_or_else(rpma_tests::bin_dir);
    tempfile::tempdir_in(root).unwrap()
}

/// A target on the environment's RDMA device (no `direct_write_to_pmem`) serving SUB with
/// `namespaces`, and the output of `check-config` on its configuration.
fn start_rdma(dir: &Path, namespaces: Vec<Namespace>) -> (Target, String, bool) {
    let t = Transport::rdma();
    let config = Config::new().subsystem(Subsystem::new(SUB).host(HOST).namespaces(namespaces));
    let target = Target::start_on(dir, &t.listen(), &config.to_string(), &[]);
    let o = check_config(&dir.join("target.toml"));
    (target, text(&o), o.status.success())
}

/// On a device without on-demand paging (the VM lab's stock kernel: Soft-RoCE of Linux 6.1),
/// a page-cache namespace cannot be registered. It is refused alone: the subsystem's other
/// namespace is served, `identify` and `list` show the refused one with the reason, the
/// library and the CLI refuse I/O to it with that reason, the target logs it once however
/// many hosts connect, and `check-config` fails saying which namespace and why.
#[test]
#[ignore = "requires an RDMA device without ODP (the VM lab's stock kernel; make vm-test)"]
fn no_odp_a_namespace_the_device_cannot_register_is_refused_alone() {
    let d = scratch();
    let shm = Shm::new("no-odp");
    let pc = page_cache_dir();
    let pc_ns = pc.path().join("page-cache.ns");
    let (t, checked, ok) = start_rdma(
        d.path(),
        vec![
            Namespace::new(1, pc_ns.to_str().unwrap(), "4MiB"),
            Namespace::new(2, shm.path(), "4MiB").force_dax(),
        ],
    );
    assert!(
        !ok,
        "check-config passes an unregistrable namespace: {checked}"
    );
    assert!(
        checked.lines().any(|l| l.contains("problem:")
            && l.contains("cannot register nsid 1")
            && l.contains("on-demand paging")),
        "{checked}"
    );
    assert!(
        checked.lines().any(|l| l.contains("registered pinned")),
        "nsid 2 is pinned: {checked}"
    );

    let conn = conn_args(&t.url(), SUB, HOST, None);
    let mut args: Vec<&str> = conn.iter().map(String::as_str).collect();
    args.push("identify");
    let o = initiator(&args);
    assert!(o.status.success(), "{}", text(&o));
    let out = text(&o);
    assert!(
        out.lines().any(|l| l.contains("nsid 1:")
            && l.contains("UNAVAILABLE")
            && l.contains("on-demand paging")),
        "{out}"
    );
    assert!(
        out.lines()
            .any(|l| l.contains("nsid 2:") && l.contains("GPSPM")),
        "{out}"
    );
    args.pop();
    args.push("list");
    let o = initiator(&args);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("UNAVAILABLE"), "{}", text(&o));

    // The library: nsid 1 is refused with the reason, nsid 2 takes a durable write.
    let mut q = Connection::new(&t.url(), nqn(SUB), host(HOST))
        .with_connect_options(opts())
        .open_queue(0)
        .unwrap();
    let e = q.namespace(1).map(|_| ()).unwrap_err();
    assert!(
        matches!(
            e,
            rpma_initiator::Error::NamespaceUnavailable { nsid: 1, .. }
        ),
        "{e:?}"
    );
    let mut ns = q.namespace(2).unwrap();
    let data = noise(5, 64 << 10);
    assert_eq!(
        ns.write_durable(4096, &data).unwrap(),
        Durability::Durable(PersistMethod::Gpspm)
    );
    drop(q);
    assert_eq!(
        &std::fs::read(shm.path()).unwrap()[4096..4096 + data.len()],
        &data[..]
    );

    // The CLI: a write to nsid 1 fails with exit 4 and the reason.
    let f = d.path().join("data");
    std::fs::write(&f, b"refused").unwrap();
    let conn = conn_args(&t.url(), SUB, HOST, Some(1));
    let mut args: Vec<&str> = conn.iter().map(String::as_str).collect();
    args.extend([
        "write",
        "--offset",
        "0",
        "--durable",
        "--in",
        f.to_str().unwrap(),
    ]);
    let o = initiator(&args);
    assert_eq!(o.status.code(), Some(4), "{}", text(&o));
    assert!(text(&o).contains("unavailable"), "{}", text(&o));

    // Logged once, at error, for every connection above.
    let lines: Vec<_> = t
        .log()
        .lines()
        .filter(|l| l.contains("cannot be registered on this transport"))
        .map(str::to_owned)
        .collect();
    assert_eq!(lines.len(), 1, "{lines:#?}");
    assert!(lines[0].contains("ERROR"), "{}", lines[0]);
}

/// Locked memory that other sessions hold is a refusal the host may retry, not a namespace
/// listed unavailable: a target without CAP_IPC_LOCK whose RLIMIT_MEMLOCK has room for one
/// session (its /dev/shm namespace pinned, its message slots) refuses a second host's Connect
/// as full, logs no namespace as unregistrable, and admits a host again once the first
/// session is gone. (The second session was admitted with the namespace listed unavailable,
/// "RLIMIT_MEMLOCK is too low", and the namespace logged at ERROR as one this transport cannot
/// register.)
#[test]
#[ignore = "requires an RDMA device (RPMA_TEST_RDMA_DEVICE, RPMA_TEST_RDMA_ADDR)"]
fn locked_memory_held_by_other_sessions_is_a_retryable_refusal() {
    use rpma_common::proto::RefusalReason;
    use rpma_tests::target::{CAP_IPC_LOCK, WITHOUT_IPC_LOCK};

    let d = scratch();
    let shm = Shm::new("memlock");
    let config = Config::new().subsystem(
        Subsystem::new(SUB)
            .host(HOST)
            .namespace(Namespace::new(1, shm.path(), "4MiB").force_dax()),
    );
    let listen = Transport::rdma().listen();
    let t = Target::start_on(d.path(), &listen, &config.to_string(), &[WITHOUT_IPC_LOCK]);
    let field = |name: &str| -> String {
        let st = std::fs::read_to_string(format!("/proc/{}/status", t.pid())).unwrap();
        let line = st.lines().find(|l| l.starts_with(name)).unwrap().to_owned();
        line[name.len()..].trim().to_owned()
    };
    let eff = u64::from_str_radix(&field("CapEff:"), 16).unwrap();
    assert_eq!(eff & (1 << CAP_IPC_LOCK), 0, "the target kept CAP_IPC_LOCK");
    // Room for what is pinned now and one session: its namespace (4 MiB), its message slots
    // (1.16 MiB at the default depth) and a handshake's; not for a second namespace.
    let pinned_kib: u64 = field("VmPin:")
        .trim_end_matches("kB")
        .trim()
        .parse()
        .unwrap();
    let limit = (pinned_kib + 4096 + 2048) << 10;
    let lim = libc::rlimit {
        rlim_cur: limit,
        rlim_max: limit,
    };
    // SAFETY: prlimit reads the struct it is given; the pid is the target's, a child.
    let r = unsafe {
        libc::prlimit(
            t.pid() as libc::pid_t,
            libc::RLIMIT_MEMLOCK,
            &lim,
            std::ptr::null_mut(),
        )
    };
    assert_eq!(r, 0, "prlimit: {}", std::io::Error::last_os_error());

    let first = connect(&t.url(), &nqn(SUB), &host(HOST), &opts()).expect("the first session");
    let e = connect(&t.url(), &nqn(SUB), &host(HOST), &opts()).map(|_| ());
    assert!(
        matches!(
            e,
            Err(rpma_initiator::Error::Refused {
                reason: RefusalReason::TooManyConnections,
                ..
            })
        ),
        "{e:?}"
    );
    drop(first);
    // The first session's registrations go with it: a host gets in again.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let mut again = loop {
        match connect(&t.url(), &nqn(SUB), &host(HOST), &opts()) {
            Ok(s) => break s,
            Err(rpma_initiator::Error::Refused {
                reason: RefusalReason::TooManyConnections,
                ..
            }) if std::time::Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(50))
            }
            Err(e) => panic!("after the first session left: {e:?}"),
        }
    };
    assert_eq!(
        again.flush(1, 0, 4096, Duration::from_secs(20)).unwrap(),
        rpma_common::proto::FlushStatus::Durable
    );
    let log = t.log();
    assert!(
        !log.contains("cannot be registered on this transport"),
        "{log}"
    );
    assert!(
        log.contains("RLIMIT_MEMLOCK, held by other registrations"),
        "{log}"
    );
}

/// On Soft-RoCE with on-demand paging (the VM lab's odp kernel), `check-config` says how each
/// kind of namespace is registered: /dev/shm and devdax pinned; page cache and fsdax refused,
/// because rxe's ODP misplaces data (docs/rdma.md), unless `RPMA_TRUST_RXE_ODP=trust` says to
/// use it anyway (then on-demand paging).
#[test]
#[ignore = "requires the VM lab: Soft-RoCE with ODP, fsdax and devdax (make vm-test)"]
fn check_config_says_how_the_device_registers_each_namespace() {
    let d = scratch();
    let shm = Shm::new("reg");
    let dax_dir = std::env::var("RPMA_TEST_DAX_DIR").expect("RPMA_TEST_DAX_DIR (the VM lab)");
    let on_dax = tempfile::tempdir_in(dax_dir).unwrap();
    let dax_ns = on_dax.path().join("ns");
    let devdax = std::env::var("RPMA_TEST_DEVDAX").expect("RPMA_TEST_DEVDAX (the VM lab)");
    let pc = page_cache_dir();
    let pc_ns = pc.path().join("page-cache.ns");
    let (_t, checked, ok) = start_rdma(
        d.path(),
        vec![
            Namespace::new(1, pc_ns.to_str().unwrap(), "4MiB"),
            Namespace::new(2, shm.path(), "4MiB"),
            Namespace::new(3, dax_ns.to_str().unwrap(), "4MiB"),
            Namespace::existing(4, &devdax).read_only(),
        ],
    );
    // The line after a namespace's own says how each rdma device registers it.
    let after = |nsid: u32| {
        let mut lines = checked.lines();
        lines.find(|l| l.trim_start().starts_with(&format!("nsid {nsid}:")));
        lines.next().unwrap_or_default().to_owned()
    };
    assert!(after(2).contains("registered pinned"), "{checked}");
    assert!(after(4).contains("registered pinned"), "{checked}");
    if std::env::var("RPMA_TRUST_RXE_ODP").as_deref() == Ok("trust") {
        assert!(ok, "{checked}");
        assert!(
            after(1).contains("registered on-demand paging"),
            "{checked}"
        );
        assert!(
            after(3).contains("registered on-demand paging"),
            "{checked}"
        );
    } else {
        assert!(!ok, "{checked}");
        for nsid in [1, 3] {
            let l = after(nsid);
            assert!(
                l.contains("problem:")
                    && l.contains(&format!("cannot register nsid {nsid}"))
                    && l.contains("wrong offset"),
                "nsid {nsid}: {checked}"
            );
        }
        assert!(checked.contains("FAILED: 2 problem(s)"), "{checked}");
    }
}

/// The listener line the suite's `rdma::` twins write is one the daemon's own loader takes: an
/// rdma listener with the `direct_write_to_pmem` declaration, on the given address and port.
#[test]
fn the_suites_rdma_listener_line_is_a_valid_config() {
    for addr in ["192.0.2.10", "fd00::10"] {
        let t = Transport::Rdma {
            device: "rxe0".into(),
            addr: addr.into(),
        };
        let body = Config::new().subsystem(
            Subsystem::new(SUB)
                .host(HOST)
                .namespace(Namespace::new(1, "ns1", "1MiB")),
        );
        let text = format!("{}\n{body}", t.listen_line(7421));
        let c = rpma_target::config::Config::from_toml(&text, Path::new("/nonexistent"))
            .unwrap_or_else(|e| panic!("{text}: {e}"));
        assert_eq!(c.listeners.len(), 1, "{text}");
        let l = &c.listeners[0];
        assert!(l.direct_write_to_pmem, "{text}");
        assert_eq!(l.url.to_string(), t.url(7421), "{text}");
    }
    // And the tcp one, without the declaration (which tcp listeners refuse).
    let text = Transport::Tcp.listen_line(7421);
    let c = rpma_target::config::Config::from_toml(&text, Path::new("/nonexistent")).unwrap();
    assert!(!c.listeners[0].direct_write_to_pmem);
}

// ---- without a device: the clear error ----

/// Whether this machine has an RDMA device (then the no-device tests have nothing to show).
fn has_device() -> bool {
    std::path::Path::new("/sys/class/infiniband")
        .read_dir()
        .is_ok_and(|mut d| d.next().is_some())
}

/// What the binaries say about `rdma://` where there is no device: the clear error, or, in a
/// build without the `rdma` feature, that the build has no such transport.
fn expected(what: &str) -> &'static str {
    match (cfg!(feature = "rdma"), what) {
        (true, _) => NO_DEVICE,
        (false, "target") => "the rdma transport is not served by this build; use tcp://",
        (false, _) => "transport \"rdma\" is not available in this build",
    }
}

#[cfg(feature = "rdma")]
#[test]
fn the_fabric_says_there_is_no_device() {
    use rpma_common::fabric::{rdma_devices, Context, Error, Listener, Url};
    if has_device() {
        eprintln!("skipped: this machine has an RDMA device");
        return;
    }
    assert_eq!(rdma_devices().unwrap(), vec![], "an empty list, no error");
    for u in [
        "rdma://127.0.0.1:7420",
        "rdma://0.0.0.0:7420",
        "rdma://[::1]:7420",
    ] {
        let e = Context::for_url(&Url::parse(u).unwrap()).expect_err(u);
        assert!(matches!(e, Error::NoDevice), "{u}: {e:?}");
        assert_eq!(e.to_string(), NO_DEVICE);
    }
    let e = Context::rdma_device("rxe0").expect_err("no device of any name");
    assert!(matches!(e, Error::NoDevice), "{e:?}");
    // A tcp device does not listen on, or connect to, rdma:// URLs.
    let soft = Context::soft();
    let url = Url::parse("rdma://127.0.0.1:7420").unwrap();
    let e = Listener::bind(&soft, &url).expect_err("soft device, rdma URL");
    assert!(matches!(e, Error::BadUrl { .. }), "{e:?}");
    let pd = soft.alloc_pd().unwrap();
    let cq = soft.create_cq(4).unwrap();
    let qp = pd.create_qp(&cq, &cq, Default::default()).unwrap();
    let e = qp
        .connect(&url, &Default::default(), b"")
        .expect_err("soft queue pair, rdma URL");
    assert!(matches!(e, Error::BadUrl { .. }), "{e:?}");
}

fn rdma_listener_config(dir: &Path, port: u16) -> std::path::PathBuf {
    let cfg = dir.join("target.toml");
    let body = Config::new().subsystem(
        Subsystem::new(SUB)
            .host(HOST)
            .namespace(Namespace::new(1, "ns1", "1MiB")),
    );
    std::fs::write(
        &cfg,
        format!("listen = [\"rdma://127.0.0.1:{port}\"]\ncontrol_socket = \"ctl.sock\"\n{body}"),
    )
    .unwrap();
    cfg
}

#[test]
fn the_target_refuses_an_rdma_listener_without_a_device() {
    if has_device() {
        eprintln!("skipped: this machine has an RDMA device");
        return;
    }
    let d = scratch();
    let cfg = rdma_listener_config(d.path(), free_port());
    let log = d.path().join("stderr");
    let err = std::fs::File::create(&log).unwrap();
    let mut t = Daemon::start(&cfg, d.path(), &[], Stdio::from(err));
    let st = t.wait_exit(Duration::from_secs(30));
    assert!(!st.success(), "{st}");
    let said = std::fs::read_to_string(&log).unwrap();
    assert!(said.contains(expected("target")), "{said}");
    assert!(
        said.contains("rdma://127.0.0.1:"),
        "names the listener: {said}"
    );
    // check-config says so too, as a problem.
    let o = check_config(&cfg);
    assert!(!o.status.success(), "{}", text(&o));
    let out = text(&o);
    let want = if cfg!(feature = "rdma") {
        NO_DEVICE
    } else {
        "this build has no rdma transport"
    };
    assert!(
        out.lines()
            .any(|l| l.starts_with("problem: listener rdma://") && l.contains(want)),
        "{out}"
    );
}

#[test]
fn the_initiator_refuses_an_rdma_target_without_a_device() {
    if has_device() {
        eprintln!("skipped: this machine has an RDMA device");
        return;
    }
    let url = format!("rdma://127.0.0.1:{}", free_port());
    for cmd in [
        &["identify"][..],
        &["read", "--offset", "0", "--length", "16"][..],
    ] {
        let mut args: Vec<String> = conn_args(&url, SUB, HOST, Some(1));
        args.extend(cmd.iter().map(|s| s.to_string()));
        let a: Vec<&str> = args.iter().map(String::as_str).collect();
        let o = initiator(&a);
        assert!(!o.status.success(), "{a:?}: {}", text(&o));
        let said = text(&o);
        assert!(said.contains(expected("initiator")), "{a:?}: {said}");
        assert!(said.contains(&url), "names the target: {said}");
    }
}
