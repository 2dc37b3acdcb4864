use super::*;

fn enospc() -> SyncFailure {
    SyncFailure::new("fdatasync", &std::io::Error::from_raw_os_error(28))
}

/// Whoever could write the state file could make the next start forget a failure: it is
/// created for the daemon's user only (before, with the umask's mode: 0660 under the
/// unit's UMask=0007, the group's to rewrite), and one the group may write is refused.
#[test]
fn the_state_file_is_the_daemons_alone() {
    use std::os::unix::fs::PermissionsExt;
    let d = tempfile::tempdir().unwrap();
    let state = d.path().join("state");
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o7777;
    drop(FailureLedger::open(&state).unwrap());
    assert_eq!(mode(&state), 0o600);
    // Others may write it: refused.
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o662)).unwrap();
    let want = format!(
        "state file {} has mode 0662 and owner uid {}: others may write it, or another user \
         owns it, and a rewritten file would make the daemon forget failed namespaces \
         (chown it to the daemon's user and chmod 600)",
        state.display(),
        nix::unistd::geteuid().as_raw()
    );
    let Err(e) = FailureLedger::open(&state) else {
        panic!("a file others may write is refused");
    };
    assert_eq!(e.to_string(), want);
    assert_eq!(peek(&state).unwrap_err().to_string(), want);
    // The daemon's own, its group may write (the unit's umask before): made 0640.
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o660)).unwrap();
    assert!(FailureLedger::open(&state).is_ok());
    assert_eq!(mode(&state), 0o640);
    // Readable by the group is fine.
    assert!(FailureLedger::open(&state).is_ok());
    assert_eq!(peek(&state).unwrap(), Some(vec![]));
}

#[test]
fn a_recorded_failure_survives_reopening_until_cleared() {
    let d = tempfile::tempdir().unwrap();
    let state = d.path().join("state");
    let ns = d.path().join("ns1");
    std::fs::write(&ns, b"x").unwrap();
    let l = FailureLedger::open(&state).unwrap();
    assert_eq!(std::fs::metadata(&state).unwrap().len(), 2 * SLOT as u64);
    assert!(l.get(&ns).is_none());
    let f = l
        .record("nqn.2026-11.io.rpma:t", 1, &ns, &enospc())
        .unwrap();
    assert_eq!(f.sync_failure(), enospc());
    // The first failure stands.
    let eio = SyncFailure::new("msync", &std::io::Error::from_raw_os_error(5));
    assert_eq!(l.record("nqn.2026-11.io.rpma:t", 1, &ns, &eio).unwrap(), f);
    drop(l);

    // Another opening (a restart) sees it, by any spelling of the path.
    let l = FailureLedger::open(&state).unwrap();
    let odd = d.path().join(".").join("ns1");
    assert_eq!(l.get(&odd), Some(f.clone()));
    assert_eq!(l.all().len(), 1);
    assert_eq!(l.clear(&ns).unwrap(), Some(f));
    assert_eq!(l.clear(&ns).unwrap(), None);
    drop(l);
    assert!(FailureLedger::open(&state).unwrap().all().is_empty());

    // A page that could not be read or written reads back as such.
    let l = FailureLedger::open(&state).unwrap();
    let u = SyncFailure::unreadable();
    l.record("nqn.2026-11.io.rpma:t", 1, &ns, &u).unwrap();
    drop(l);
    let l = FailureLedger::open(&state).unwrap();
    assert_eq!(l.get(&ns).map(|f| f.sync_failure()), Some(u));
}

/// A second opening while the first holds the file (a second daemon on the same state
/// file) is refused: each would write its own list over the other's. (Both opened it, and
/// one's failure was gone at the next start.)
#[test]
fn a_state_file_in_use_is_refused_until_let_go() {
    let d = tempfile::tempdir().unwrap();
    let state = d.path().join("state");
    let first = FailureLedger::open(&state).unwrap();
    let e = FailureLedger::open(&state).unwrap_err();
    assert!(matches!(e, LedgerError::InUse { .. }), "{e}");
    assert!(e.to_string().contains("in use by a running daemon"), "{e}");
    drop(first);
    FailureLedger::open(&state).unwrap();
}

/// The same file under another path (moved, and the configuration edited) is the same
/// failed namespace, to get and to clear; an entry of a state file written before the
/// file's identity was kept still reads, known by its path alone.
#[test]
fn a_failure_follows_its_file_to_another_path() {
    let d = tempfile::tempdir().unwrap();
    let (ns, moved) = (d.path().join("ns1"), d.path().join("moved"));
    std::fs::write(&ns, b"x").unwrap();
    let l = FailureLedger::open(&d.path().join("state")).unwrap();
    let f = l
        .record("nqn.2026-11.io.rpma:t", 1, &ns, &enospc())
        .unwrap();
    assert!(f.file.is_some());
    std::fs::rename(&ns, &moved).unwrap();
    assert_eq!(l.get(&moved), Some(f.clone()));
    // Another file at the old path is still taken for the failed one (as before).
    std::fs::write(&ns, b"y").unwrap();
    assert_eq!(l.get(&ns), Some(f.clone()));
    assert_eq!(l.clear(&moved).unwrap(), Some(f));
    assert!(l.get(&moved).is_none() && l.get(&ns).is_none());
    let old = r#"{"path":"/x","subsystem":"s","nsid":1,"op":"msync","errno":5,
        "failure":"msync failed","since_unix_ms":1}"#;
    let f: Failed = serde_json::from_str(old).unwrap();
    assert_eq!(f.file, None);
    assert!(f.is_of(Path::new("/x"), None) && !f.is_of(Path::new("/y"), Some((1, 2))));
}

/// A failure whose write failed is still listed once a later one's write succeeds: that
/// write takes the whole list as the daemon holds it. (It wrote the list the file held, and
/// the first failure was gone at the next start.)
#[test]
fn a_failure_whose_write_failed_is_written_with_the_next() {
    let d = tempfile::tempdir().unwrap();
    let state = d.path().join("state");
    let (a, b) = (d.path().join("a"), d.path().join("b"));
    let l = FailureLedger::open(&state).unwrap();
    l.lock().fail_next = Some(FailAt::Write);
    let e = l
        .record("nqn.2026-11.io.rpma:t", 1, &a, &enospc())
        .unwrap_err();
    assert!(matches!(e, LedgerError::Io { op: "write", .. }), "{e}");
    assert!(l.get(&a).is_some(), "held in memory");
    l.record("nqn.2026-11.io.rpma:t", 2, &b, &enospc()).unwrap();
    drop(l);
    let l = FailureLedger::open(&state).unwrap();
    assert!(l.get(&a).is_some() && l.get(&b).is_some(), "{:?}", l.all());
}

/// A clear whose sync failed left its copy (without the failure, and the newest) in the
/// page cache: the list as it stands is written over it, so a restart still lists the
/// failure; and every write after a failed one carries a higher seq than the copy that
/// failed. (A restart read the failed clear's copy and forgot the failure.)
#[test]
fn a_clear_whose_sync_failed_leaves_the_failure_listed() {
    let d = tempfile::tempdir().unwrap();
    let state = d.path().join("state");
    let a = d.path().join("a");
    let l = FailureLedger::open(&state).unwrap();
    l.record("nqn.2026-11.io.rpma:t", 1, &a, &enospc()).unwrap();
    let seq = l.lock().seq;
    l.lock().fail_next = Some(FailAt::Sync);
    let e = l.clear(&a).unwrap_err();
    assert!(matches!(e, LedgerError::Io { op: "sync", .. }), "{e}");
    assert!(l.get(&a).is_some(), "nothing is forgotten");
    assert!(
        l.lock().seq > seq + 1,
        "the failed copy's seq is not used again"
    );
    drop(l);
    // A restart (no reboot: the page cache is what it reads).
    let l = FailureLedger::open(&state).unwrap();
    assert!(l.get(&a).is_some(), "{:?}", l.all());
}

/// A namespace path that is not UTF-8 is recorded and read back as it is, and a state file
/// written before such paths were kept (every path a JSON string) still reads. (Recording
/// one panicked: serde refuses a path that is not UTF-8, in a poll loop's failure hook, and
/// at start-up the daemon could not start.)
#[test]
fn a_path_that_is_not_utf8_is_remembered() {
    use std::os::unix::ffi::OsStrExt;
    let d = tempfile::tempdir().unwrap();
    let state = d.path().join("state");
    let ns = d.path().join(std::ffi::OsStr::from_bytes(b"ns-\xff\xfe"));
    std::fs::write(&ns, b"x").unwrap();
    let l = FailureLedger::open(&state).unwrap();
    let f = l
        .record("nqn.2026-11.io.rpma:t", 1, &ns, &enospc())
        .unwrap();
    assert_eq!(f.path, key_of(&ns));
    drop(l);
    let l = FailureLedger::open(&state).unwrap();
    assert_eq!(l.get(&ns), Some(f.clone()));
    assert_eq!(peek(&state).unwrap(), Some(vec![f]));
    let old = r#"{"failed":[{"path":"/x/\u00e9","subsystem":"s","nsid":1,"op":"msync",
        "errno":5,"failure":"msync failed","since_unix_ms":1,"file":[1,2]}]}"#;
    let c: Contents = serde_json::from_str(old).unwrap();
    assert_eq!(c.failed[0].path, Path::new("/x/\u{e9}"));
    // Written back the same way: a string.
    let value = |text: &str| serde_json::from_str::<serde_json::Value>(text).unwrap();
    assert_eq!(value(&serde_json::to_string(&c).unwrap()), value(old));
}

/// A state file the daemon creates holds a copy (seq 1, nothing failed) from the start, so
/// that one emptied or cut short since is not taken for one that never had any.
#[test]
fn a_new_state_file_holds_a_copy_from_the_start() {
    let d = tempfile::tempdir().unwrap();
    let state = d.path().join("state");
    drop(FailureLedger::open(&state).unwrap());
    let buf = std::fs::read(&state).unwrap();
    assert_eq!(buf.len(), 2 * SLOT);
    let head = format!("{MAGIC} seq=1 ");
    assert!(buf.starts_with(head.as_bytes()), "{:?}", &buf[..40]);
    assert_eq!(newest(&state, &buf).unwrap().map(|b| b.0), Some(1));
    assert_eq!(peek(&state).unwrap(), Some(vec![]));
}

/// A state file that is empty, or zeros shorter than the two slots, holds no copy, and the
/// daemon's own always does: refused, naming the file, as one whose slots are both damaged
/// is. (Taken as "nothing failed".) One of the two slots' full size, all zeros, is what an
/// earlier version left until a namespace first failed: it reads as nothing failed, and
/// gets its first copy.
#[test]
fn an_empty_or_short_state_file_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let state = d.path().join("state");
    for (bytes, why) in [(0, "empty"), (4096, "4096 bytes of zeros")] {
        std::fs::write(&state, vec![0u8; bytes]).unwrap();
        let e = FailureLedger::open(&state).unwrap_err();
        assert!(matches!(e, LedgerError::Damaged { .. }), "{e}");
        let text = e.to_string();
        assert!(text.contains(&*state.to_string_lossy()), "{text}");
        assert!(text.contains(why), "{text}");
        assert_eq!(peek(&state).unwrap_err().to_string(), text);
        assert_eq!(std::fs::metadata(&state).unwrap().len(), bytes as u64);
    }
    // An earlier version's file.
    std::fs::write(&state, vec![0u8; 2 * SLOT]).unwrap();
    assert_eq!(peek(&state).unwrap(), Some(vec![]));
    assert!(FailureLedger::open(&state).unwrap().all().is_empty());
    let buf = std::fs::read(&state).unwrap();
    assert_eq!(newest(&state, &buf).unwrap().map(|b| b.0), Some(1));
}

#[test]
fn a_torn_update_leaves_the_previous_copy() {
    let d = tempfile::tempdir().unwrap();
    let state = d.path().join("state");
    let l = FailureLedger::open(&state).unwrap();
    let a = d.path().join("a");
    let b = d.path().join("b");
    l.record("nqn.2026-11.io.rpma:t", 1, &a, &enospc()).unwrap();
    l.record("nqn.2026-11.io.rpma:t", 2, &b, &enospc()).unwrap();
    let newest = l.lock().slot;
    drop(l);
    // The newest copy is torn (a crash while it was written): the older one is used.
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&state)
        .unwrap();
    f.write_all_at(b"garbage", (newest * SLOT + 40) as u64)
        .unwrap();
    let l = FailureLedger::open(&state).unwrap();
    assert_eq!(l.all().len(), 1, "the copy before the torn one");
    drop(l);
    // Both damaged: refused, not taken as "nothing failed".
    f.write_all_at(b"garbage", (((1 - newest) * SLOT) + 40) as u64)
        .unwrap();
    let e = FailureLedger::open(&state).unwrap_err();
    assert!(matches!(e, LedgerError::Damaged { .. }), "{e}");
}

#[test]
fn an_unwritable_place_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let e = FailureLedger::open(&d.path().join("missing-dir/state")).unwrap_err();
    assert!(e.to_string().contains("state_file"), "{e}");
}

#[test]
fn utc_dates() {
    assert_eq!(utc(0), "1970-01-01 00:00:00 UTC");
    assert_eq!(utc(1_764_588_000), "2025-12-01 11:20:00 UTC");
    assert_eq!(utc(951_782_400), "2000-02-29 00:00:00 UTC");
}

/// [`capacity::listable`] is what a copy holds: that many failures (of the longest text) are written, one
/// more of the same shape is refused once the list passes a slot, and a clear is refused then.
#[test]
fn listable_is_what_one_copy_of_the_state_file_holds() {
    let d = tempfile::tempdir().unwrap();
    let l = FailureLedger::open(&d.path().join("state")).unwrap();
    let sub = "nqn.2026-11.io.rpma:a-subsystem-of-the-fleet";
    let paths: Vec<PathBuf> = (0..400)
        .map(|i| d.path().join(format!("namespace-{i:04}.pmem")))
        .collect();
    for p in &paths {
        std::fs::write(p, b"x").unwrap();
    }
    let n = capacity::listable(
        paths
            .iter()
            .enumerate()
            .map(|(i, p)| (sub, i as u32 + 1, p.as_path())),
    );
    assert!(n > 100 && n < 400, "{n}");
    let f = SyncFailure::new(
        "fdatasync",
        &std::io::Error::from_raw_os_error(libc::ESHUTDOWN),
    );
    for (i, p) in paths.iter().take(n).enumerate() {
        l.record(sub, i as u32 + 1, p, &f)
            .unwrap_or_else(|e| panic!("failure {} of {n}: {e}", i + 1));
    }
    let refused = paths
        .iter()
        .enumerate()
        .skip(n)
        .find_map(|(i, p)| l.record(sub, i as u32 + 1, p, &f).err());
    assert!(
        matches!(refused, Some(LedgerError::TooLarge { .. })),
        "{refused:?}"
    );
}
