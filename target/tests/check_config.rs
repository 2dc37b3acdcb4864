//! `rpma-target check-config` as a real process: a good configuration and each kind of bad one.

mod support;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;

use support::{write_psk, BIN};

const GOOD: &str = r#"
listen = ["tcp://127.0.0.1:7420"]
control_socket = "ctl.sock"
[[subsystem]]
nqn = "nqn.2026-11.io.rpma:demo"
hosts = [{ nqn = "nqn.2026-11.io.rpma:host1", psk_file = "host1.psk" }]
[[subsystem.namespace]]
nsid = 1
path = "ns1"
size = "2MiB"
[[subsystem.namespace]]
nsid = 2
path = "ns2"
size = "1MiB"
force_dax = true
"#;

fn run(dir: &Path, text: &str) -> (bool, String) {
    let psk = dir.join("host1.psk");
    if !psk.exists() {
        write_psk(&psk, "77");
    }
    let cfg = dir.join("c.toml");
    std::fs::write(&cfg, text).unwrap();
    let out = Command::new(BIN)
        .arg("check-config")
        .arg(&cfg)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[test]
fn good_config_reports_domains_and_methods() {
    let d = tempfile::tempdir().unwrap();
    let (ok, out) = run(d.path(), GOOD);
    assert!(ok, "{out}");
    assert!(
        out.contains("nsid 1:") && out.contains("(will be created)"),
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
        !d.path().join("ns1").exists(),
        "check-config must not create namespaces"
    );
    assert_eq!(
        std::fs::read_dir(d.path()).unwrap().count(),
        2,
        "scratch probe file left behind"
    );

    // Existing files are opened for real.
    std::fs::write(d.path().join("ns1"), vec![0u8; 2 << 20]).unwrap();
    let (ok, out) = run(d.path(), GOOD);
    assert!(ok, "{out}");
    assert!(
        out.contains("nsid 1: ") && !out.contains("nsid 1: ns1 (will be created)"),
        "{out}"
    );
}

#[test]
fn volatile_namespace_offers_nothing_durable() {
    let shm = Path::new("/dev/shm");
    if !shm.is_dir() {
        eprintln!("SKIPPED: no /dev/shm tmpfs on this machine");
        return;
    }
    let d = tempfile::tempdir_in(shm).unwrap();
    let (ok, out) = run(d.path(), GOOD);
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
        assert!(GOOD.contains(from), "{from}");
        let (ok, out) = run(d.path(), &GOOD.replacen(from, to, 1));
        assert!(!ok, "{to}: should fail\n{out}");
        assert!(out.contains(needle), "{to}: expected {needle:?} in\n{out}");
        assert!(out.contains("FAILED"), "{out}");
    }
}

#[test]
fn psk_with_open_permissions_fails() {
    let d = tempfile::tempdir().unwrap();
    let psk = d.path().join("host1.psk");
    std::fs::write(&psk, "77".repeat(32)).unwrap();
    std::fs::set_permissions(&psk, std::fs::Permissions::from_mode(0o644)).unwrap();
    let (ok, out) = run(d.path(), GOOD);
    assert!(!ok && out.contains("mode 0644"), "{out}");
    std::fs::set_permissions(&psk, std::fs::Permissions::from_mode(0o600)).unwrap();
    std::fs::write(&psk, "77".repeat(8)).unwrap();
    let (ok, out) = run(d.path(), GOOD);
    assert!(!ok && out.contains("is 8 bytes"), "{out}");
}

#[test]
fn namespace_problems_found_by_probing() {
    // A directory where a namespace file should be, and an existing file of another size.
    let d = tempfile::tempdir().unwrap();
    std::fs::create_dir(d.path().join("ns1")).unwrap();
    std::fs::write(d.path().join("ns2"), vec![0u8; 4096]).unwrap();
    let (ok, out) = run(d.path(), GOOD);
    assert!(!ok, "{out}");
    assert!(
        out.contains("nsid 1: ") && out.contains("is a directory"),
        "{out}"
    );
    assert!(out.contains("nsid 2: ") && out.contains("problem"), "{out}");
    assert!(out.contains("FAILED: 2 problem(s)"), "{out}");
}

#[test]
fn missing_file_fails() {
    let out = Command::new(BIN)
        .args(["check-config", "/nonexistent/c.toml"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("cannot read /nonexistent/c.toml"));
}

#[test]
fn a_smaller_file_is_refused_unless_grow_and_check_config_never_grows_it() {
    let d = tempfile::tempdir().unwrap();
    std::fs::write(d.path().join("ns1"), vec![0u8; 1 << 20]).unwrap();
    let (ok, out) = run(d.path(), GOOD);
    assert!(
        !ok && out.contains("nsid 1: ") && out.contains("problem"),
        "{out}"
    );
    let grow = GOOD.replacen(r#"size = "2MiB""#, "size = \"2MiB\"\ngrow = true", 1);
    let (ok, out) = run(d.path(), &grow);
    assert!(ok, "{out}");
    assert!(
        out.contains("nsid 1: ") && out.contains("(will be grown), 2 MiB"),
        "{out}"
    );
    assert_eq!(
        std::fs::metadata(d.path().join("ns1")).unwrap().len(),
        1 << 20,
        "check-config must not grow a namespace"
    );
}
