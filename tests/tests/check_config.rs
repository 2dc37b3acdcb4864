//! `rpma-target check-config` as a real process: a good configuration and each kind of bad one.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::Stdio;

use rpma_tests::{free_port, write_psk, Config, Daemon, Namespace, Subsystem};

/// The fixture: listening on `port`, subsystem demo whose host1 has a key, `namespaces`.
fn config(port: u16, namespaces: impl IntoIterator<Item = Namespace>) -> String {
    Config::new()
        .set(&format!("listen = [\"tcp://127.0.0.1:{port}\"]"))
        .set("control_socket = \"ctl.sock\"")
        .subsystem(
            Subsystem::new("nqn.2026-11.io.rpma:demo")
                .keyed_host("nqn.2026-11.io.rpma:host1", "host1.psk")
                .namespaces(namespaces),
        )
        .to_string()
}

/// A good configuration: nsid 1 page-cache 2 MiB, nsid 2 forced dax 1 MiB.
fn good() -> String {
    config(
        7420,
        [
            Namespace::new(1, "ns1", "2MiB"),
            Namespace::new(2, "ns2", "1MiB").force_dax(),
        ],
    )
}

fn run(dir: &Path, text: &str) -> (bool, String) {
    let psk = dir.join("host1.psk");
    if !psk.exists() {
        write_psk(&psk, "77");
    }
    let cfg = dir.join("c.toml");
    std::fs::write(&cfg, text).unwrap();
    let out = rpma_tests::check_config(&cfg);
    (out.status.success(), rpma_tests::text(&out))
}

#[test]
fn good_config_reports_domains_and_methods() {
    let d = tempfile::tempdir().unwrap();
    let (ok, out) = run(d.path(), &good());
    assert!(ok, "{out}");
    assert!(
        out.contains("nsid 1:") && out.contains("ns1: would create 2 MiB, block 4096"),
        "{out}"
    );
    assert!(
        out.contains("nsid 2:") && out.contains("domain dax (forced); tcp: APM GPSPM FLUSH"),
        "{out}"
    );
    assert!(
        out.contains("OK: 2 namespace(s) in 1 subsystem(s)"),
        "{out}"
    );
    assert!(
        out.contains("admission: unadmitted 64 (8 per source, 5000 ms to Connect), discovery 16"),
        "{out}"
    );
    assert!(
        !d.path().join("ns1").exists(),
        "check-config must not create namespaces"
    );
    assert_eq!(
        std::fs::read_dir(d.path()).unwrap().count(),
        2,
        "scratch probe file left behind"
    );

    // An existing file is only looked at, too.
    std::fs::write(d.path().join("ns1"), vec![0u8; 2 << 20]).unwrap();
    let (ok, out) = run(d.path(), &good());
    assert!(ok, "{out}");
    assert!(out.contains("ns1: exists, 2 MiB, block 4096"), "{out}");
}

#[test]
fn volatile_namespace_offers_nothing_durable() {
    let shm = Path::new("/dev/shm");
    if !shm.is_dir() {
        eprintln!("SKIPPED: no /dev/shm tmpfs on this machine");
        return;
    }
    let d = tempfile::tempdir_in(shm).unwrap();
    let (ok, out) = run(d.path(), &good());
    assert!(ok, "{out}");
    assert!(
        out.contains("domain volatile; tcp: none durable (visible only)"),
        "{out}"
    );
}

#[test]
fn each_bad_config_fails_with_its_key() {
    let cases: &[(&str, &str, &str)] = &[
        (
            r#"size = "2MiB""#,
            r#"size = "12X""#,
            r#"subsystem[0].namespace[0].size: "12X" is not a size"#,
        ),
        (
            "nsid = 2",
            "nsid = 0",
            "subsystem[0].namespace[1].nsid: 0 is not a namespace id",
        ),
        ("nsid = 2", "nsid = 1", "nsid 1 is used twice"),
        (
            "force_dax = true",
            "force_dax = true\nblock_size = 1000",
            "block_size: 1000 is not a block size",
        ),
        (
            r#"size = "1MiB""#,
            "size = 1000",
            "is not a multiple of the block size",
        ),
        (
            r#"path = "ns2""#,
            r#"path = "ns1""#,
            "backs another namespace",
        ),
        (
            "control_socket",
            "control_sockett",
            "unknown field `control_sockett`",
        ),
        (
            "tcp://127.0.0.1:7420",
            "tcp://127.0.0.1:70000",
            "listen[0]:",
        ),
        (
            "nqn.2026-11.io.rpma:demo",
            "nqn.2026-11.io.rpma",
            "subsystem[0].nqn:",
        ),
        (
            "host1.psk",
            "missing.psk",
            "subsystem[0].hosts[0].psk_file: cannot read key file",
        ),
    ];
    for (from, to, needle) in cases {
        let d = tempfile::tempdir().unwrap();
        let good = good();
        assert!(good.contains(from), "{from}");
        let (ok, out) = run(d.path(), &good.replacen(from, to, 1));
        assert!(!ok, "{to}: should fail\n{out}");
        assert!(out.contains(needle), "{to}: expected {needle:?} in\n{out}");
        assert!(out.contains("FAILED"), "{out}");
    }
}

/// Listeners of both transports: check-config says so, as the daemon refuses to start on them
/// (the unit runs check-config first, as its guard: it passed them).
#[test]
fn listeners_of_both_transports_fail() {
    let d = tempfile::tempdir().unwrap();
    let mixed = good().replace(
        "listen = [\"tcp://127.0.0.1:7420\"]",
        "listen = [\"tcp://127.0.0.1:7420\", \"rdma://127.0.0.1:7421\"]",
    );
    assert_ne!(mixed, good());
    let (ok, out) = run(d.path(), &mixed);
    assert!(!ok, "{out}");
    assert!(
        out.lines()
            .any(|l| l.starts_with("problem:")
                && l.contains("one configuration serves one transport")),
        "{out}"
    );
}

#[test]
fn psk_with_open_permissions_fails() {
    let d = tempfile::tempdir().unwrap();
    let psk = d.path().join("host1.psk");
    std::fs::write(&psk, "77".repeat(32)).unwrap();
    std::fs::set_permissions(&psk, std::fs::Permissions::from_mode(0o644)).unwrap();
    let (ok, out) = run(d.path(), &good());
    assert!(!ok && out.contains("mode 0644"), "{out}");
    std::fs::set_permissions(&psk, std::fs::Permissions::from_mode(0o600)).unwrap();
    std::fs::write(&psk, "77".repeat(8)).unwrap();
    let (ok, out) = run(d.path(), &good());
    assert!(!ok && out.contains("is 8 bytes"), "{out}");
}

#[test]
fn namespace_problems_found_by_probing() {
    // A directory where a namespace file should be, and an existing file of another size.
    let d = tempfile::tempdir().unwrap();
    std::fs::create_dir(d.path().join("ns1")).unwrap();
    std::fs::write(d.path().join("ns2"), vec![0u8; 4096]).unwrap();
    let (ok, out) = run(d.path(), &good());
    assert!(!ok, "{out}");
    assert!(
        out.contains("nsid 1: ") && out.contains("is a directory"),
        "{out}"
    );
    assert!(out.contains("nsid 2: ") && out.contains("problem"), "{out}");
    assert!(out.contains("FAILED: 2 problem(s)"), "{out}");
}

#[test]
fn an_empty_config_passes_with_a_warning_that_it_serves_nothing() {
    let d = tempfile::tempdir().unwrap();
    let (ok, out) = run(d.path(), "");
    assert!(ok, "{out}");
    assert!(
        out.lines()
            .any(|l| l.starts_with("warning: no subsystem: the daemon would serve no namespace")),
        "{out}"
    );
    assert!(
        out.contains("OK: 0 namespace(s) in 0 subsystem(s)"),
        "{out}"
    );
    // A configuration with a subsystem has no such warning.
    let (ok, out) = run(d.path(), &good());
    assert!(ok, "{out}");
    assert!(!out.contains("no subsystem"), "{out}");
}

#[test]
fn missing_file_fails() {
    let out = rpma_tests::check_config(Path::new("/nonexistent/c.toml"));
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("cannot read /nonexistent/c.toml"));
}

#[test]
fn a_smaller_file_is_refused_unless_grow_and_check_config_never_grows_it() {
    let d = tempfile::tempdir().unwrap();
    std::fs::write(d.path().join("ns1"), vec![0u8; 1 << 20]).unwrap();
    let (ok, out) = run(d.path(), &good());
    assert!(
        !ok && out.contains("nsid 1: ") && out.contains("problem"),
        "{out}"
    );
    let grow = good().replacen(r#"size = "2MiB""#, "size = \"2MiB\"\ngrow = true", 1);
    let (ok, out) = run(d.path(), &grow);
    assert!(ok, "{out}");
    assert!(
        out.contains("ns1: would grow from 1 MiB to 2 MiB (grow = true), block 4096"),
        "{out}"
    );
    assert_eq!(
        std::fs::metadata(d.path().join("ns1")).unwrap().len(),
        1 << 20,
        "check-config must not grow a namespace"
    );
}

/// Size, modification time and allocated blocks: what check-config must leave as they were.
fn footprint(p: &Path) -> (u64, i64, i64, u64) {
    let m = std::fs::metadata(p).unwrap();
    (m.len(), m.mtime(), m.mtime_nsec(), m.blocks())
}

/// [`config`] on `port` with `namespaces` (TOML tables).
fn with_namespaces(port: u16, namespaces: &str) -> String {
    config(port, []) + namespaces
}

#[test]
fn check_config_creates_grows_and_allocates_nothing_and_says_what_the_daemon_would_do() {
    let d = tempfile::tempdir().unwrap();
    let p = |name: &str| d.path().join(name);
    // An empty file, a sparse smaller one with grow = true, a sparse one of the right size; ns2
    // does not exist.
    std::fs::write(p("ns1"), b"").unwrap();
    std::fs::File::create(p("ns3"))
        .unwrap()
        .set_len(1 << 20)
        .unwrap();
    std::fs::File::create(p("ns4"))
        .unwrap()
        .set_len(1 << 20)
        .unwrap();
    let port = free_port();
    let cfg = with_namespaces(
        port,
        r#"
[[subsystem.namespace]]
nsid = 1
path = "ns1"
size = "2MiB"
[[subsystem.namespace]]
nsid = 2
path = "ns2"
size = "1MiB"
[[subsystem.namespace]]
nsid = 3
path = "ns3"
size = "2MiB"
grow = true
[[subsystem.namespace]]
nsid = 4
path = "ns4"
size = "1MiB"
"#,
    );
    let before: Vec<_> = ["ns1", "ns3", "ns4"].map(|n| footprint(&p(n))).into();
    let (ok, out) = run(d.path(), &cfg);
    let after: Vec<_> = ["ns1", "ns3", "ns4"].map(|n| footprint(&p(n))).into();
    assert_eq!(
        before, after,
        "check-config changed a namespace file (size, mtime, blocks)\n{out}"
    );
    assert!(
        !p("ns2").exists(),
        "check-config created a namespace\n{out}"
    );
    assert_eq!(
        std::fs::read_dir(d.path()).unwrap().count(),
        5,
        "check-config left a file behind\n{out}"
    );
    assert!(ok, "{out}");
    for line in [
        "nsid 1: {ns1}: would grow from 0 B to 2 MiB (the file is empty), block 4096, read-write: \
         domain ",
        "nsid 2: {ns2}: would create 1 MiB, block 4096, read-write: domain ",
        "nsid 3: {ns3}: would grow from 1 MiB to 2 MiB (grow = true), block 4096",
        "nsid 4: {ns4}: exists, 1 MiB, block 4096",
    ] {
        let line = ["ns1", "ns2", "ns3", "ns4"]
            .iter()
            .fold(line.to_owned(), |l, n| {
                l.replace(&format!("{{{n}}}"), &p(n).display().to_string())
            });
        assert!(out.contains(&line), "no {line:?} in\n{out}");
    }
    assert!(out.contains("OK: 4 namespace(s)"), "{out}");

    // The daemon does what check-config said.
    std::fs::write(d.path().join("c.toml"), &cfg).unwrap();
    let daemon = Daemon::start(&p("c.toml"), d.path(), &[], Stdio::inherit());
    daemon.expect("READY=1");
    for (name, size) in [
        ("ns1", 2 << 20),
        ("ns2", 1 << 20),
        ("ns3", 2 << 20),
        ("ns4", 1 << 20),
    ] {
        let m = std::fs::metadata(p(name)).unwrap();
        assert_eq!(m.len(), size, "{name}");
        assert!(m.blocks() * 512 >= size, "{name} is not allocated");
    }
}

#[test]
fn check_config_refusals_change_nothing() {
    let d = tempfile::tempdir().unwrap();
    let p = |name: &str| d.path().join(name);
    // Larger than configured (never shrunk), smaller without grow, and a missing directory.
    std::fs::File::create(p("ns1"))
        .unwrap()
        .set_len(3 << 20)
        .unwrap();
    std::fs::File::create(p("ns2"))
        .unwrap()
        .set_len(1 << 20)
        .unwrap();
    let cfg = with_namespaces(
        free_port(),
        r#"
[[subsystem.namespace]]
nsid = 1
path = "ns1"
size = "2MiB"
grow = true
[[subsystem.namespace]]
nsid = 2
path = "ns2"
size = "2MiB"
[[subsystem.namespace]]
nsid = 3
path = "nodir/ns3"
size = "1MiB"
"#,
    );
    let before = [footprint(&p("ns1")), footprint(&p("ns2"))];
    let (ok, out) = run(d.path(), &cfg);
    assert_eq!(
        before,
        [footprint(&p("ns1")), footprint(&p("ns2"))],
        "{out}"
    );
    assert!(!p("nodir").exists(), "{out}");
    assert!(!ok, "{out}");
    assert!(
        out.contains(&format!(
            "nsid 1: {}: problem: would refuse: ",
            p("ns1").display()
        )) && out.contains("larger than the 2097152 asked for"),
        "{out}"
    );
    assert!(
        out.contains(&format!(
            "nsid 2: {}: problem: would refuse: ",
            p("ns2").display()
        )) && out.contains("set `grow = true` on the namespace to grow it"),
        "{out}"
    );
    assert!(
        out.contains(&format!(
            "nsid 3: {}: problem: would refuse: ",
            p("nodir/ns3").display()
        )) && out.contains("no such file or directory"),
        "{out}"
    );
    assert!(out.contains("FAILED: 3 problem(s)"), "{out}");
}

/// Run from the configuration's own directory with its bare file name (`rpma-target
/// check-config c.toml`), as the daemon accepts it: the state file's directory is the current
/// one. (It said the state file was not writable, ENOENT from `access("")`, and FAILED.)
#[test]
fn a_bare_file_name_checks_as_the_daemon_starts() {
    let d = tempfile::tempdir().unwrap();
    run(d.path(), &good());
    let out = rpma_tests::run_with_deadline(
        std::process::Command::new(rpma_tests::target_bin())
            .current_dir(d.path())
            .args(["check-config", "c.toml"]),
        std::time::Duration::from_secs(30),
    );
    let text = rpma_tests::text(&out);
    assert!(out.status.success(), "{text}");
    assert!(!text.contains("problem"), "{text}");
}

/// A subsystem of more namespaces than one message lists to a host is taken without a
/// warning: a host reads them a page at a time. (Before protocol version 7: 800 were refused,
/// "split them between subsystems", and 300 warned of.)
#[test]
fn a_subsystem_of_more_namespaces_than_one_message_lists_is_taken() {
    let d = tempfile::tempdir().unwrap();
    let many = |n: u32| {
        config(
            7420,
            (1..=n).map(|i| Namespace::new(i, &format!("ns{i}"), "4KiB")),
        )
    };
    for n in [800, 300] {
        let (ok, out) = run(d.path(), &many(n));
        // (The state file's warning: `check_config_warns_when_the_state_file_cannot_list_every_failure`.)
        let listing = out
            .lines()
            .filter(|l| l.starts_with("warning") && !l.contains("the state file lists"))
            .count();
        assert!(ok && listing == 0, "{out}");
        assert!(out.contains(&format!("OK: {n} namespace(s)")), "{out}");
    }
}

/// One copy of the state file lists some 250 failed namespaces at once (64 KiB): check-config
/// warns of a configuration with more, saying what happens past that, and of none with fewer.
/// (Nothing said it: with every namespace of a thin pool failed by ENOSPC, the failures past
/// the 245th were remembered by their files' marks only, and every clear-failure was refused.)
#[test]
fn check_config_warns_when_the_state_file_cannot_list_every_failure() {
    let d = tempfile::tempdir().unwrap();
    let many = |n: u32| {
        config(
            7420,
            (1..=n).map(|i| Namespace::new(i, &format!("ns{i}"), "4KiB")),
        )
    };
    let (ok, out) = run(d.path(), &many(800));
    assert!(ok, "{out}");
    let w: Vec<&str> = out
        .lines()
        .filter(|l| l.starts_with("warning: the state file lists at most about"))
        .collect();
    assert_eq!(w.len(), 1, "{out}");
    assert!(
        w[0].contains("this configuration has 800") && w[0].contains("clear-failure is refused"),
        "{out}"
    );
    let (ok, out) = run(d.path(), &many(100));
    assert!(ok && !out.contains("the state file lists"), "{out}");
}

/// Discovery lists a host's subsystems a page at a time, so only one subsystem whose entry
/// alone is longer than a message (its every listen URL: here 500 listeners) makes a listing
/// that cannot be sent whole: check-config warns of that, naming the subsystem, and of nothing
/// for many subsystems.
#[test]
fn check_config_warns_of_a_discovery_entry_longer_than_a_message() {
    let d = tempfile::tempdir().unwrap();
    let listeners = |n: u16| {
        let urls: Vec<String> = (0..n)
            .map(|i| format!("\"tcp://0.0.0.0:{}\"", 20000 + i))
            .collect();
        good().replace(
            "listen = [\"tcp://127.0.0.1:7420\"]",
            &format!("listen = [{}]", urls.join(", ")),
        )
    };
    let (ok, out) = run(d.path(), &listeners(500));
    assert!(ok, "{out}");
    assert!(
        out.contains(
            "warning: discovery: subsystem nqn.2026-11.io.rpma:demo's entry, with every listen URL"
        ),
        "{out}"
    );
    let (ok, out) = run(d.path(), &listeners(2));
    assert!(ok && !out.contains("warning"), "{out}");
    // 200 subsystems: paged, no warning.
    let mut many = Config::new()
        .set("listen = [\"tcp://127.0.0.1:7420\"]")
        .set("control_socket = \"ctl.sock\"");
    for i in 0..200 {
        many = many.subsystem(
            Subsystem::new(&format!("nqn.2026-11.io.rpma:s{i}"))
                .any_host()
                .namespace(Namespace::new(1, &format!("s{i}"), "4KiB")),
        );
    }
    let (ok, out) = run(d.path(), &many.to_string());
    assert!(ok && !out.contains("warning"), "{out}");
}
