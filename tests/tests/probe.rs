//! `rpma-target probe` as a user runs it: the domain it prints for a file under the repo's
//! scratch/ (page-cache), under /dev/shm (volatile) and with --force-dax, and its errors.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use rpma_tests::target_bin;

fn rpma_target(args: &[&str]) -> Output {
    Command::new(target_bin())
        .args(args)
        .env("RUST_LOG", "off")
        .output()
        .unwrap()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn scratch() -> tempfile::TempDir {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scratch");
    std::fs::create_dir_all(&dir).unwrap();
    tempfile::Builder::new()
        .prefix("probe-")
        .tempdir_in(dir)
        .unwrap()
}

fn shm() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("rpma-probe-")
        .tempdir_in("/dev/shm")
        .unwrap()
}

fn p(path: &Path) -> &str {
    path.to_str().unwrap()
}

#[test]
fn file_under_scratch_is_page_cache() {
    let dir = scratch();
    let path = dir.path().join("ns.pmem");
    let out = rpma_target(&["probe", p(&path), "--size", "64MiB"]);
    let text = stdout(&out);
    assert!(out.status.success(), "{text}{}", stderr(&out));
    assert!(
        text.contains(&format!("path:        {}\n", path.display())),
        "{text}"
    );
    assert!(
        text.contains("size:        67108864 bytes (64 MiB)\n"),
        "{text}"
    );
    assert!(text.contains("domain:      page-cache\n"), "{text}");
    assert!(text.contains("msync"), "{text}");
    assert!(text.contains("acks mean:   durable\n"), "{text}");
    assert_eq!(std::fs::metadata(&path).unwrap().len(), 64 << 20);
}

#[test]
fn file_under_dev_shm_is_volatile_and_visible_only() {
    let dir = shm();
    let path = dir.path().join("ns.pmem");
    let out = rpma_target(&["probe", p(&path), "--size", "4k", "--block-size", "512"]);
    let text = stdout(&out);
    assert!(out.status.success(), "{text}{}", stderr(&out));
    assert!(text.contains("domain:      volatile\n"), "{text}");
    assert!(text.contains("acks mean:   visible only\n"), "{text}");
    assert!(text.contains("block size:  512\n"), "{text}");
}

#[test]
fn force_dax_prints_dax_forced() {
    let dir = shm();
    let path = dir.path().join("ns.pmem");
    let out = rpma_target(&["probe", p(&path), "--size", "1M", "--force-dax"]);
    let text = stdout(&out);
    assert!(out.status.success(), "{text}{}", stderr(&out));
    assert!(text.contains("domain:      dax (forced)\n"), "{text}");
    assert!(text.contains("probed:      volatile"), "{text}");
    assert!(!text.contains("domain:      dax\n"), "{text}");
    // The existing file again, without --size, as `make demo` does.
    let out = rpma_target(&["probe", p(&path), "--force-dax", "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(v["domain"], "dax (forced)");
    assert_eq!(v["probed_domain"], "volatile");
    assert_eq!(v["size"], 1 << 20);
    assert_eq!(v["path"], p(&path));
}

#[test]
fn json_for_page_cache() {
    let dir = scratch();
    let path: PathBuf = dir.path().join("ns.pmem");
    let out = rpma_target(&["probe", p(&path), "--size", "8k", "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(v["domain"], "page-cache");
    assert_eq!(v["durable"], true);
    assert_eq!(v["acknowledgement"], "durable");
    assert_eq!(v["block_size"], 4096);
}

#[test]
fn grow_needs_the_flag() {
    let dir = scratch();
    let path = dir.path().join("ns.pmem");
    assert!(rpma_target(&["probe", p(&path), "--size", "8k"])
        .status
        .success());
    let out = rpma_target(&["probe", p(&path), "--size", "16k"]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("refusing to grow") && stderr(&out).contains("add --grow"),
        "{}",
        stderr(&out)
    );
    let out = rpma_target(&["probe", p(&path), "--size", "4k"]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("never shrinks"), "{}", stderr(&out));
    let out = rpma_target(&["probe", p(&path), "--size", "16k", "--grow"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("(16 KiB)"), "{}", stdout(&out));
}

#[test]
fn bad_input_fails_with_a_clear_message() {
    let dir = scratch();
    let ns = dir.path().join("ns.pmem");
    let cases: [(&[&str], &str); 6] = [
        (&["probe", p(&ns), "--size", "lots"], "--size lots"),
        (&["probe", p(&ns), "--size", "0"], "size is 0"),
        (
            &["probe", p(&ns), "--size", "5000"],
            "not a multiple of the block size",
        ),
        (&["probe", p(&ns)], "a size is needed"),
        (&["probe", p(dir.path()), "--size", "4k"], "is a directory"),
        (&["probe", "/dev/null"], "not a devdax device"),
    ];
    for (args, want) in cases {
        let out = rpma_target(args);
        assert!(!out.status.success(), "{args:?} succeeded");
        let err = stderr(&out);
        assert!(err.contains(want), "{args:?}: {err}");
        assert!(stdout(&out).is_empty(), "{args:?} printed a report");
    }
    assert!(!ns.exists());
}

/// `rpma-target probe` of a file on an overlay mounted (in a mount namespace of its own) with
/// its upper directory on `upper_on` and its lower one under `dir`: what it printed.
fn probe_on_an_overlay(dir: &Path, upper_on: &str) -> String {
    probe_on_an_overlay_with(dir, upper_on, "")
}

/// [`probe_on_an_overlay`] with more mount options (`,volatile`).
fn probe_on_an_overlay_with(dir: &Path, upper_on: &str, more: &str) -> String {
    let script = format!(
        "set -e; d={d}; mkdir -p $d/lower $d/merged $d/upperfs; {mount_upper} \
         mkdir -p $d/upperfs/up $d/upperfs/work; \
         mount -t overlay overlay -o lowerdir=$d/lower,upperdir=$d/upperfs/up,workdir=$d/upperfs/work{more} $d/merged; \
         {bin} probe --size 1MiB $d/merged/ns.pmem",
        d = dir.display(),
        mount_upper = match upper_on {
            "tmpfs" => "mount -t tmpfs tmpfs $d/upperfs;",
            _ => "",
        },
        bin = target_bin().display(),
    );
    let out = Command::new("unshare")
        .args(["-m", "--", "sh", "-c", &script])
        .env("RUST_LOG", "off")
        .output()
        .unwrap();
    let text = stdout(&out);
    assert!(out.status.success(), "{text}{}", stderr(&out));
    text
}

/// An overlay's syncs are its upper layer's: over tmpfs they keep nothing, so a file there is
/// volatile (visible only), not page-cache (it was: every acknowledgement said durable for
/// bytes held in RAM, as on a live system's root). Over a disk's filesystem it is page-cache.
#[test]
fn a_file_on_an_overlay_over_tmpfs_is_volatile() {
    let dir = scratch();
    let text = probe_on_an_overlay(dir.path(), "tmpfs");
    assert!(text.contains("domain:      volatile\n"), "{text}");
    assert!(text.contains("acks mean:   visible only\n"), "{text}");
    let dir = scratch();
    let text = probe_on_an_overlay(dir.path(), "disk");
    assert!(text.contains("domain:      page-cache\n"), "{text}");
    assert!(text.contains("acks mean:   durable\n"), "{text}");
    // Mounted `volatile`, an overlay skips every sync whatever lies under it.
    let dir = scratch();
    let text = probe_on_an_overlay_with(dir.path(), "disk", ",volatile");
    assert!(text.contains("domain:      volatile\n"), "{text}");
}

/// `probe --grow` of a file a running rpma-target serves is refused, the file untouched: the
/// daemon's hosts were told its size, and its next start would refuse the file. (It grew the
/// file: the daemon's `check-config` then said it would refuse it.) Without --grow the probe
/// only reports.
#[test]
fn grow_of_a_file_a_running_target_serves_is_refused() {
    let dir = scratch();
    let path = dir.path().join("ns1");
    let t = rpma_tests::Target::start(
        dir.path(),
        &format!(
            "[[subsystem]]\nnqn = \"nqn.2026-12.io.rpma:probe\"\nallow_any_host = true\n\
             [[subsystem.namespace]]\nnsid = 1\npath = \"{}\"\nsize = \"4MiB\"\n",
            path.display()
        ),
    );
    let out = rpma_target(&["probe", p(&path), "--size", "16MiB", "--grow"]);
    assert!(!out.status.success(), "{}", stdout(&out));
    assert!(
        stderr(&out).contains("in use by another process"),
        "{}",
        stderr(&out)
    );
    assert_eq!(std::fs::metadata(&path).unwrap().len(), 4 << 20, "grown");
    let out = rpma_target(&["probe", p(&path)]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("size:        4194304 bytes"),
        "{}",
        stdout(&out)
    );
    drop(t);
    // The daemon gone, the file may grow.
    let out = rpma_target(&["probe", p(&path), "--size", "16MiB", "--grow"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(std::fs::metadata(&path).unwrap().len(), 16 << 20);
}
