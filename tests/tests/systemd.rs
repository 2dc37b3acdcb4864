//! The shipped unit and example configuration.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use rpma_tests::{repo_file, target_bin};

/// The example configuration, `text`, with its directories moved to `dir` and its namespaces
/// shrunk to 16 MiB, written to `dir/rpma-target.toml` (returned).
fn example_in(dir: &Path, text: &str) -> PathBuf {
    let d = dir.to_str().unwrap();
    let text = text
        .replace("/var/lib/rpma", d)
        .replace("/etc/rpma", d)
        .replace("/run/rpma-target", d)
        .replace("size = \"1GiB\"", "size = \"16MiB\"");
    let cfg = dir.join("rpma-target.toml");
    std::fs::write(&cfg, &text).unwrap();
    cfg
}

use rpma_tests::check_config;

#[test]
fn unit_passes_systemd_analyze_verify() {
    let Ok(probe) = Command::new("systemd-analyze").arg("--version").output() else {
        eprintln!(
            "SKIPPED: systemd-analyze is not installed (scripts/install-deps.sh installs systemd)"
        );
        return;
    };
    assert!(probe.status.success());
    let unit = std::fs::read_to_string(repo_file("systemd/rpma-target.service")).unwrap();
    for key in [
        "Type=notify",
        "WatchdogSec=",
        "Restart=on-failure",
        "LimitMEMLOCK=infinity",
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        "ReadWritePaths=",
        "ProtectHome=yes",
        "PrivateTmp=yes",
        "CapabilityBoundingSet=CAP_IPC_LOCK",
        "AmbientCapabilities=CAP_IPC_LOCK",
        // The page-cache namespace files' descriptors kept across restarts (fdstore.rs).
        "FileDescriptorStoreMax=",
        // `systemctl reload` waits for the reload's outcome (a bare SIGHUP would not).
        "ExecReload=/usr/bin/rpma-target reload --socket /run/rpma-target/control.sock",
        "TimeoutStartSec=300s",
    ] {
        assert!(unit.contains(key), "unit lacks {key}");
    }
    // verify checks that ExecStart's binary exists: point it at the one just built.
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("rpma-target.service");
    std::fs::write(
        &p,
        unit.replace("/usr/bin/rpma-target", target_bin().to_str().unwrap()),
    )
    .unwrap();
    let out = Command::new("systemd-analyze")
        .arg("verify")
        .arg(&p)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "systemd-analyze verify failed:\n{stderr}"
    );
    assert!(
        !stderr.contains("rpma-target.service:"),
        "warnings about the unit:\n{stderr}"
    );
}

#[test]
fn example_config_passes_check_config_after_adjusting_paths() {
    let d = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(repo_file("systemd/rpma-target.toml")).unwrap();
    // As shipped, the example needs no file that the install steps do not create.
    let cfg = example_in(d.path(), &text);

    let parsed = rpma_target::config::Config::load(&cfg).unwrap();
    assert_eq!(parsed.subsystems[0].namespaces.len(), 2);
    assert_eq!(
        parsed.listeners[0].url.port,
        rpma_target::config::DEFAULT_PORT
    );

    let out = check_config(&cfg);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(
        stdout.contains("OK: 2 namespace(s) in 1 subsystem(s)"),
        "{stdout}"
    );
}

#[test]
fn sysusers_and_tmpfiles_snippets_name_the_user_and_dirs() {
    let sysusers = std::fs::read_to_string(repo_file("systemd/rpma-target.sysusers.conf")).unwrap();
    assert!(sysusers.lines().any(|l| l.starts_with("u rpma-target ")));
    let tmpfiles = std::fs::read_to_string(repo_file("systemd/rpma-target.tmpfiles.conf")).unwrap();
    for dir in ["/var/lib/rpma", "/etc/rpma", "/run/rpma-target"] {
        assert!(
            tmpfiles
                .lines()
                .any(|l| l.starts_with("d ") && l.contains(dir)),
            "{dir}"
        );
    }
    let example = std::fs::read_to_string(repo_file("systemd/rpma-target.toml")).unwrap();
    let unit = std::fs::read_to_string(repo_file("systemd/rpma-target.service")).unwrap();
    // The unit's writable path covers the example's namespaces.
    assert!(
        example.contains("path = \"/var/lib/rpma/")
            && unit.contains("ReadWritePaths=/var/lib/rpma")
    );
}

/// The key recipe in the example (and docs/operations.md), run as written: the key it makes is
/// one check-config accepts once the host entry names it.
#[test]
fn example_key_recipe_makes_a_key_check_config_accepts() {
    if Command::new("openssl").arg("version").output().is_err() {
        eprintln!("SKIPPED: no openssl on this machine (the recipe uses it)");
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().to_str().unwrap();
    let text = std::fs::read_to_string(repo_file("systemd/rpma-target.toml")).unwrap();
    let recipe = text
        .lines()
        .find(|l| l.contains("openssl rand"))
        .expect("the example has a key recipe")
        .trim_start_matches(['#', ' '])
        .replace("/etc/rpma", dir);
    let made = Command::new("sh").arg("-c").arg(&recipe).output().unwrap();
    assert!(made.status.success(), "{recipe}: {made:?}");
    let key = d.path().join("host1.psk");
    let mode = std::fs::metadata(&key).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "{recipe}");
    // The commented host entry with its key, in place of the one without.
    let keyed = text
        .lines()
        .find(|l| l.contains("psk_file"))
        .unwrap()
        .trim_start_matches(['#', ' '])
        .to_owned();
    let plain = text
        .lines()
        .find(|l| l.trim_start().starts_with("{ nqn = \"nqn.2014-08"))
        .unwrap()
        .to_owned();
    let out = check_config(&example_in(d.path(), &text.replace(&plain, &keyed)));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(stdout.contains("2 host(s), 1 with a key"), "{stdout}");
}
