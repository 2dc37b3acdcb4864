//! `rpma-initiator nbd` against a real `rpma-target`: durability of FUA and FLUSH across a
//! SIGKILL of the target, and what FLUSH answers when it cannot be honest (EIO).

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use rpma_tests::nbd::*;
use rpma_tests::noise as pattern;

// ---- durability ----

/// Waits until the namespace file holds `data` at `offset` (placed by the target).
fn wait_placed(file: &Path, offset: u64, data: &[u8]) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::open(file).unwrap();
    let mut b = vec![0u8; data.len()];
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        f.read_exact_at(&mut b, offset).unwrap();
        if b == data {
            return;
        }
        assert!(Instant::now() < deadline, "never placed at {offset}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn fua_and_flush_answers_mean_durable_across_a_target_sigkill() {
    let (_d, _shm, mut t) = start("durable");
    let file = t.dir().join("ns1");
    // What the page cache holds unsynced, where the namespace is page cache (not where the
    // run pins its files: rdma on a device that cannot register page cache).
    let page_cache = rpma_tests::Transport::current().file_domain()
        == rpma_common::proto::PersistenceDomain::PageCache;
    let unsynced = |off: u64| {
        page_cache
            .then(|| rpma_tests::unsynced_pages(&file, off, 64 << 10))
            .flatten()
    };
    let mut e = Export::start(&t, 1, "durable", &[]);
    let mut c = Raw::connect(&e.sock);
    let (a, b, f) = (
        pattern(3, 64 << 10),
        pattern(4, 64 << 10),
        pattern(5, 64 << 10),
    );
    assert_eq!(c.write(0, 0, &a), 0);
    if unsynced(0).is_some() {
        // Only sent: once placed it sits dirty in the page cache (so the checks below can
        // fail). Placement follows the answer shortly: wait for it.
        let deadline = Instant::now() + Duration::from_secs(5);
        while unsynced(0) == Some(0) {
            assert!(
                Instant::now() < deadline,
                "a plain write never showed up dirty"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    } else {
        eprintln!("note: no cachestat(2) on this kernel: durability checked by SIGKILL only");
    }
    assert_eq!(c.write(FUA, 64 << 10, &b), 0);
    // Read straight from the file (not through a queue, whose Read would sync): once the bytes
    // are there, nothing of them may be unsynced.
    wait_placed(&file, 64 << 10, &b);
    assert_eq!(
        unsynced(64 << 10).unwrap_or(0),
        0,
        "FUA answered with pages unsynced"
    );
    assert_eq!(c.write(0, 128 << 10, &f), 0);
    assert_eq!(c.flush(), 0);
    for off in [0, 128 << 10] {
        assert_eq!(
            unsynced(off).unwrap_or(0),
            0,
            "FLUSH answered with pages unsynced"
        );
    }
    // CAN_MULTI_CONN: another connection's acknowledged write is covered by this one's FLUSH,
    // and seen by its reads.
    let g = pattern(9, 64 << 10);
    let mut c2 = Raw::connect(&e.sock);
    assert_eq!(c2.write(0, 192 << 10, &g), 0);
    assert_eq!(c.flush(), 0);
    wait_placed(&file, 192 << 10, &g);
    assert_eq!(
        unsynced(192 << 10).unwrap_or(0),
        0,
        "a FLUSH missed another connection's write"
    );
    assert_eq!(c.read(192 << 10, 64 << 10).unwrap(), g);

    t.kill9();
    t.restart();
    // The export reconnects on its own and serves the same bytes.
    assert_eq!(c.read(0, 64 << 10).unwrap(), a);
    assert_eq!(c.read(64 << 10, 64 << 10).unwrap(), b);
    assert_eq!(c.read(128 << 10, 64 << 10).unwrap(), f);
    assert_eq!(cli_read(&t, 1, 64 << 10, 64 << 10), b);
    assert!(e.running());

    // qemu-io's FUA write on the forced-dax namespace, across another SIGKILL.
    if have("qemu-io") {
        let e4 = Export::start(&t, 4, "durable4", &[]);
        let uri = e4.uri();
        tool(Command::new("qemu-io").args(["-f", "raw", &uri, "-c", "write -f -P 0x6d 4096 8192"]));
        t.kill9();
        t.restart();
        assert!(cli_read(&t, 4, 4096, 8192).iter().all(|&x| x == 0x6d));
        let out =
            tool(Command::new("qemu-io").args(["-f", "raw", &uri, "-c", "read -P 0x6d 4096 8192"]));
        assert!(!out.contains("verification failed"), "{out}");
    }
    assert_eq!(e.term().code(), Some(0), "{}", e.log());
}

/// What a test keeps alive: its directory, shm file, target, export and client.
type Rig = (
    tempfile::TempDir,
    rpma_tests::Shm,
    rpma_tests::Target,
    Export,
    Raw,
);

/// A target, an export whose queue gives up after 1 s of reconnecting, and a client that
/// wrote 4 KiB of 7s at offset 0 (answered, not yet durable).
fn written_through_a_short_budget(tag: &str) -> Rig {
    let (d, shm, t) = start(tag);
    let e = Export::start(&t, 1, tag, &["--reconnect-timeout", "1"]);
    let mut c = Raw::connect(&e.sock);
    assert_eq!(c.write(0, 0, &[7; 4096]), 0);
    (d, shm, t, e, c)
}

#[test]
fn a_flush_after_the_queue_gave_up_answers_eio_once_per_connection() {
    let (_d, _shm, mut t, mut e, mut c) = written_through_a_short_budget("lost");
    t.kill9();
    // The keep-alive finds the target gone and gives up after 1 s of reconnecting.
    e.log_line("the queue to the target failed");
    t.restart();
    // The write was answered but never made durable, and its queue is gone: this FLUSH
    // cannot vouch for it.
    assert_eq!(c.flush(), EIO);
    assert_eq!(c.flush(), 0, "reported once");
    assert_eq!(c.write(FUA, 4096, &[8; 4096]), 0, "a new queue serves");
    // A connection opened after the loss had no write on the old queue.
    let mut c2 = Raw::connect(&e.sock);
    assert_eq!(c2.flush(), 0);
    // Stopped, the export cannot vouch for the lost queue's writes either: its final flush
    // made the others durable, and it exits 1 saying so (it exited 0).
    drop((c, c2));
    assert_eq!(e.term().code(), Some(1), "{}", e.log());
    assert!(e.log().contains("gave up during this run"), "{}", e.log());
}

/// A loss that no FLUSH reported, its connection closed first (as a kernel client reconnecting
/// with `nbd-client -persist` does), is reported by the first FLUSH of the next connection:
/// `CAN_MULTI_CONN` has a FLUSH cover the writes answered on every connection. Once reported,
/// later connections' FLUSHes answer 0. (The next connection's FLUSH answered 0: the write
/// answered before the loss, and never made durable, looked durable.)
#[test]
fn a_loss_no_flush_reported_is_reported_to_the_next_connection() {
    let (_d, _shm, mut t, mut e, c) = written_through_a_short_budget("unreported");
    drop(c);
    t.kill9();
    e.log_line("the queue to the target failed");
    t.restart();
    let mut c2 = Raw::connect(&e.sock);
    assert_eq!(c2.flush(), EIO, "the lost write looked durable");
    assert_eq!(c2.flush(), 0, "reported once");
    let mut c3 = Raw::connect(&e.sock);
    assert_eq!(c3.flush(), 0, "reported already, to c2");
    drop((c2, c3));
    assert_eq!(e.term().code(), Some(1), "{}", e.log());
}

/// A loss its client was told of (a WRITE after it answered EIO, as md sees when a leg's
/// target goes: it fails the leg) is not reported again to the next connection: md re-adds the
/// leg over a new connection and resyncs it, and its superblock write's FLUSH must succeed.
/// (Answered EIO, the re-added leg failed again: kernel_clients
/// `md_raid1_across_two_targets_survives_one_and_resyncs` in the VM lab.)
#[test]
fn a_loss_its_client_was_told_of_is_not_reported_to_the_next_connection() {
    let (_d, _shm, mut t, mut e, mut c) = written_through_a_short_budget("told");
    t.kill9();
    assert_eq!(c.write(0, 4096, &[8; 4096]), EIO, "the target is gone");
    drop(c);
    t.restart();
    let mut c2 = Raw::connect(&e.sock);
    assert_eq!(c2.flush(), 0, "told already, by the WRITE's EIO");
    drop(c2);
    assert_eq!(e.term().code(), Some(1), "{}", e.log());
}

/// A connection already in transmission at the loss, idle until then, hears of it at its first
/// FLUSH, even though another connection was told meanwhile (a READ of it answered EIO): one
/// client on several connections (`nbd-client -connections N`) has a FLUSH on any of them cover
/// the writes answered on all of them. (It answered 0: a connection took its starting point at
/// its first request, and any failed request, a READ's too, counted as the loss told.)
#[test]
fn a_flush_on_a_connection_open_before_the_loss_does_not_vouch_for_a_lost_write() {
    let (_d, _shm, mut t, mut e, c1) = written_through_a_short_budget("open-before");
    let mut c2 = Raw::connect(&e.sock);
    let mut c3 = Raw::connect(&e.sock);
    t.kill9();
    e.log_line("the queue to the target failed");
    assert_eq!(c3.read(8192, 4096).err(), Some(EIO), "the target is gone");
    t.restart();
    assert_eq!(c2.flush(), EIO, "c1's write was never made durable");
    assert_eq!(c2.flush(), 0, "reported once");
    drop((c1, c2, c3));
    assert_eq!(e.term().code(), Some(1), "{}", e.log());
}

/// A READ answered EIO tells its client nothing of the writes answered before it: a later
/// connection's first FLUSH still reports the loss. (It answered 0: any failed request counted
/// as the loss told.)
#[test]
fn a_failed_read_does_not_count_as_a_loss_told() {
    let (_d, _shm, mut t, mut e, c) = written_through_a_short_budget("read-told");
    drop(c);
    t.kill9();
    e.log_line("the queue to the target failed");
    let mut probe = Raw::connect(&e.sock);
    assert_eq!(
        probe.read(8192, 4096).err(),
        Some(EIO),
        "the target is gone"
    );
    drop(probe);
    t.restart();
    let mut c2 = Raw::connect(&e.sock);
    assert_eq!(c2.flush(), EIO, "the lost write looked durable");
    drop(c2);
    assert_eq!(e.term().code(), Some(1), "{}", e.log());
}

/// Several connections that entered transmission after a loss no client was told of (a client
/// reconnecting with `nbd-client -persist -connections N`) hear of it once, at the first FLUSH
/// of any of them: they had no write on the lost queue. (Each one's first FLUSH answered EIO,
/// once a connection's starting point was taken as it entered transmission: md above such a
/// device saw a failed flush per connection.)
#[test]
fn connections_entering_after_an_untold_loss_hear_of_it_once() {
    let (_d, _shm, mut t, mut e, c) = written_through_a_short_budget("untold-once");
    drop(c);
    t.kill9();
    e.log_line("the queue to the target failed");
    t.restart();
    let mut cs: Vec<Raw> = (0..3).map(|_| Raw::connect(&e.sock)).collect();
    assert_eq!(cs[0].flush(), EIO, "the lost write looked durable");
    assert_eq!(cs[1].flush(), 0, "reported already, to the first");
    assert_eq!(cs[2].flush(), 0, "reported already, to the first");
    drop(cs);
    assert_eq!(e.term().code(), Some(1), "{}", e.log());
}

/// A queue that gives up holding nothing that was not durable (every write answered was made
/// durable by a FLUSH: an idle export while its target restarts for longer than the reconnect
/// budget) loses nothing: the next FLUSH answers 0 and the export exits 0. (It counted a loss:
/// every connection's next FLUSH answered EIO, which ext4's journal or md above it takes for a
/// failed disk.)
#[test]
fn a_clean_queue_that_gives_up_loses_nothing() {
    let (_d, _shm, mut t, mut e, mut c) = written_through_a_short_budget("clean-gave-up");
    assert_eq!(c.flush(), 0, "made durable");
    t.kill9();
    e.log_line("it held no write that was not durable yet");
    t.restart();
    assert_eq!(c.flush(), 0, "nothing was lost");
    assert_eq!(c.read(0, 4096), Ok(vec![7; 4096]));
    let mut c2 = Raw::connect(&e.sock);
    assert_eq!(c2.flush(), 0);
    drop((c, c2));
    assert_eq!(e.term().code(), Some(0), "{}", e.log());
}

/// Moves a zero-filled file of ns1's size over ns1 (an operator restoring a file).
fn replace_ns1(t: &rpma_tests::Target) {
    let restored = t.dir().join("ns1.restored");
    std::fs::write(&restored, vec![0u8; NS1 as usize]).unwrap();
    std::fs::rename(&restored, t.dir().join("ns1")).unwrap();
}

/// [`replace_ns1`], then a reload, waiting until the target's poll loop closed the sessions of
/// the old file (it hears of the reload just after READY=1) and the export's idle queue heard
/// of it (its keep-alive tick finds the connection closed and reconnects, or gives up): a
/// FLUSH before then finds nothing to learn it from when no write is held.
fn reload_replacing_ns1(t: &mut rpma_tests::Target, e: &Export) {
    replace_ns1(t);
    t.reload();
    let closed = t.log_lines(&["changed by reload: closing"], WAIT);
    assert!(!closed.is_empty(), "no session closed: {}", t.log());
    let deadline = Instant::now() + WAIT;
    let heard = |l: &str| {
        [
            "reconnected to",
            "queue to the target failed",
            "keep-alive with the target failed",
        ]
        .iter()
        .any(|w| l.contains(w))
    };
    while !e.log().lines().any(heard) {
        assert!(
            Instant::now() < deadline,
            "the export never heard: {}",
            e.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A reload that maps a restored file at the namespace's path, while the export's queue holds
/// a write answered and not yet durable: the next FLUSH answers EIO (the earlier FLUSH's write
/// is not in the namespace any more, and the held one is not re-issued into the new file),
/// once; the export then serves the new file. (The queue re-issued the held write into the
/// restored file and the FLUSH answered 0, vouching for a write the namespace did not hold.)
#[test]
fn a_flush_after_a_reload_replaced_the_namespace_file_answers_eio_once() {
    let (_d, _shm, mut t) = start("replaced");
    let mut e = Export::start(&t, 1, "replaced", &[]);
    let mut c = Raw::connect(&e.sock);
    assert_eq!(c.write(0, 0, &[0x11; 4096]), 0);
    assert_eq!(c.flush(), 0);
    assert_eq!(c.write(0, 4096, &[0x22; 4096]), 0);
    reload_replacing_ns1(&mut t, &e);
    assert_eq!(c.flush(), EIO, "{}", e.log());
    assert_eq!(c.flush(), 0, "reported once: {}", e.log());
    assert!(c.read(0, 8192).unwrap() == [0; 8192], "{}", e.log());
    assert_eq!(c.write(FUA, 0, &[0x33; 4096]), 0);
    assert_eq!(cli_read(&t, 1, 0, 4096), [0x33; 4096]);
    drop(c);
    assert_eq!(e.term().code(), Some(1), "{}", e.log());
}

/// A reload that makes the exported namespace read-only (the clients were told it is
/// writable): the queue gives up (counted as a loss: the next FLUSH answers EIO, once), and
/// queues opened to it are refused, each request failing, rather than served with another
/// mode than the export advertised. (The queue's give-up was not counted: that FLUSH answered
/// 0.)
#[test]
fn a_namespace_a_reload_made_read_only_is_refused_by_the_export() {
    let (_d, shm, mut t) = start("made-ro");
    let e = Export::start(&t, 1, "made-ro", &[]);
    let mut c = Raw::connect(&e.sock);
    assert_eq!(c.write(0, 0, &[0x11; 4096]), 0);
    assert_eq!(c.flush(), 0);
    let [n1, n2, n3, n4] = rpma_tests::four_namespaces(&shm, 512);
    let sub = rpma_tests::Subsystem::new(SUB)
        .any_host()
        .namespaces([n1.read_only(), n2, n3, n4]);
    t.rewrite(&rpma_tests::Config::new().subsystem(sub).to_string());
    t.reload();
    let closed = t.log_lines(&["changed by reload: closing"], WAIT);
    assert!(!closed.is_empty(), "no session closed: {}", t.log());
    e.log_line("the queue to the target failed");
    assert_eq!(c.flush(), EIO, "{}", e.log());
    assert_eq!(c.read(0, 4096), Err(EIO), "{}", e.log());
    assert_eq!(c.read(0, 4096), Err(EIO), "{}", e.log());
    assert_eq!(c.flush(), 0, "reported once: {}", e.log());
}

/// An export whose queue gave up (1 s of reconnecting) while the target was down, holding
/// nothing that was not durable (connection `c`'s write was flushed: its FLUSH after the give-up
/// answers 0), and the target back with a restored file at ns1's path (a zero-filled one).
fn restored_after_the_queue_gave_up(tag: &str) -> Rig {
    let (d, shm, mut t) = start(tag);
    let e = Export::start(&t, 1, tag, &["--reconnect-timeout", "1"]);
    let mut c = Raw::connect(&e.sock);
    assert_eq!(c.write(0, 0, &[0x11; 4096]), 0);
    assert_eq!(c.flush(), 0);
    t.kill9();
    e.log_line("the queue to the target failed");
    assert_eq!(
        c.flush(),
        0,
        "the queue gave up holding nothing not durable"
    );
    replace_ns1(&t);
    t.restart();
    (d, shm, t, e, c)
}

/// The queue that replaces the one that gave up finds another file: a loss of its own,
/// reported by the next FLUSH (after the one that reported the queue); the export serves the
/// new file. (The replacement was served as if nothing had happened: that FLUSH answered 0.)
#[test]
fn a_replacement_queue_to_a_restored_file_is_reported_as_a_loss() {
    let (_d, _shm, _t, e, mut c) = restored_after_the_queue_gave_up("restored");
    assert!(c.read(0, 4096).unwrap() == [0; 4096], "{}", e.log());
    assert_eq!(c.flush(), EIO, "another file: {}", e.log());
    assert_eq!(c.flush(), 0, "reported once");
}

/// A client that connects then gets a queue of its own (the first connection holds the
/// export's cell), to the new file: a loss, so the first connection's FLUSH answers EIO (its
/// durable write is not in the namespace any more). (The new client's queue was served as if
/// nothing had happened, and that FLUSH answered 0.)
#[test]
fn a_new_clients_queue_to_a_restored_file_is_reported_as_a_loss() {
    let (_d, _shm, _t, e, mut a) = restored_after_the_queue_gave_up("restored-new");
    let mut b = Raw::connect(&e.sock);
    assert!(b.read(0, 4096).unwrap() == [0; 4096], "{}", e.log());
    assert_eq!(a.flush(), EIO, "another file: {}", e.log());
}

/// Two FLUSHes at once on two connections: the second, which covers the first connection's
/// write too (`CAN_MULTI_CONN`), is answered only after the first made that write durable,
/// whose persist waits here in the first connection's stalled link. (The first FLUSH marked
/// its queue clean before its persist: the second skipped that queue and answered success
/// while the write was still on its way.)
#[test]
fn a_flush_waits_for_another_connections_flush_of_the_same_writes() {
    let (_d, _shm, t) = start("flushes");
    let relay = rpma_tests::Relay::start(&format!("127.0.0.1:{}", t.port()));
    let e = Export::start_via(&t, &relay.url(), 1, "flushes", &[]);
    let mut a = Raw::connect(&e.sock);
    assert_eq!(a.write(0, 0, &[5; 4096]), 0);
    // B's queue is its own (the relay's second link), and has written nothing.
    let mut b = Raw::connect(&e.sock);
    assert!(b.read(1 << 20, 4096).is_ok());
    assert_eq!(relay.live(), 2, "{}", e.log());
    assert!(relay.inject_one(rpma_tests::Fault::Stall(Duration::MAX), 0));
    let before = relay.waiting_from_client(0);
    let f = a.request(CMD_FLUSH, 0, 31, 0, 0);
    a.send(&f);
    // A's FLUSH is under way: its persist waits in A's link.
    let deadline = Instant::now() + WAIT;
    while relay.waiting_from_client(0) <= before {
        assert!(
            Instant::now() < deadline,
            "A's FLUSH sent nothing: {}",
            e.log()
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let f = b.request(CMD_FLUSH, 0, 32, 0, 0);
    b.send(&f);
    // While the link holds A's persist, B's FLUSH cannot be answered. (A slower machine only
    // gives a wrong answer more time to come.)
    let until = Instant::now() + Duration::from_secs(2);
    while Instant::now() < until {
        assert!(
            !readable(&b.0),
            "B's FLUSH answered {:?} while A's write was held in its link",
            b.reply()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    relay.resume();
    assert_eq!(a.reply(), (0, 31));
    assert_eq!(b.reply(), (0, 32));
}

/// Two connections, two queues to the target: a block written on the first and then
/// rewritten on the second. The first queue's link is reset; it reconnects and re-issues the
/// writes it holds for a replay (not durable yet: no FLUSH). Its older copy of the block must
/// not land over the newer one the second queue wrote: both connections read the newer one.
#[test]
fn a_reconnecting_queue_does_not_replay_a_block_another_connection_rewrote() {
    let (_d, _shm, t) = start("replay");
    let relay = rpma_tests::Relay::start(&format!("127.0.0.1:{}", t.port()));
    let e = Export::start_via(&t, &relay.url(), 1, "replay", &[]);
    let (old, new) = (pattern(1, 8192), pattern(2, 4096));
    let mut a = Raw::connect(&e.sock);
    assert_eq!(a.write(0, 0, &old), 0);
    let mut b = Raw::connect(&e.sock);
    // FUA: placed (and durable) before the reset, whatever the links' timing.
    assert_eq!(b.write(FUA, 4096, &new), 0);
    // A holds the export's first queue (link 0), B one it opened for itself (link 1).
    assert_eq!(relay.live(), 2, "{}", e.log());
    assert!(relay.inject_one(rpma_tests::Fault::Reset, 0));
    // A's next request finds its link gone: its queue reconnects and replays.
    let mut want = old.clone();
    want[4096..].copy_from_slice(&new);
    assert!(a.read(0, 8192).unwrap() == want, "A's read: {}", e.log());
    assert!(b.read(4096, 4096).unwrap() == new, "B's read: {}", e.log());
    assert!(e.log().contains("reconnected"), "{}", e.log());
    // And a FLUSH makes that state durable (the file is the target's namespace).
    assert_eq!(a.flush(), 0);
    assert!(b.read(0, 8192).unwrap() == want);
}

/// The same, but B's rewrite is a plain WRITE (held, not durable) when A's link is reset: A's
/// queue lets that block go, and its persist owes it (the block's bytes are B's, placed by B's
/// queue before A reconnected, which a restarted target would not have kept). A FLUSH on A
/// persists A's queue first: it has B's queue place its writes, makes the block durable, and
/// answers 0 with no page of the two blocks unsynced (the library's "not placed since the
/// reconnect" is handled there, not answered EIO).
#[test]
fn a_flush_after_a_reconnect_covers_a_block_another_connection_rewrote_unflushed() {
    a_flush_after_a_reconnect_covers_a_rewritten_block("replayflush", 1, &[]);
}

/// The same with APM forced on the dax namespace: A's queue cannot make B's block durable
/// itself (APM names no range), so its FLUSH persists B's queue first, which releases B's
/// write, and then A owes nothing for it. (A's cell came first and its error ended the
/// FLUSH: every FLUSH of A answered EIO while B's client was idle.)
#[test]
fn a_flush_with_apm_forced_after_a_reconnect_covers_a_block_another_connection_rewrote() {
    a_flush_after_a_reconnect_covers_a_rewritten_block("replayflush-apm", 4, &["--persist", "apm"]);
}

/// Connection A writes two blocks of namespace `nsid`, B rewrites the second (a plain WRITE),
/// A's link is reset (its queue reconnects and lets the second block go to B's write), and a
/// FLUSH on A answers 0 with no page of the blocks unsynced.
fn a_flush_after_a_reconnect_covers_a_rewritten_block(tag: &str, nsid: u32, args: &[&str]) {
    let (_d, _shm, t) = start(tag);
    let file = t.dir().join(format!("ns{nsid}"));
    let relay = rpma_tests::Relay::start(&format!("127.0.0.1:{}", t.port()));
    let e = Export::start_via(&t, &relay.url(), nsid, tag, args);
    let (old, new) = (pattern(1, 8192), pattern(2, 4096));
    let mut want = old.clone();
    want[4096..].copy_from_slice(&new);
    let mut a = Raw::connect(&e.sock);
    assert_eq!(a.write(0, 0, &old), 0);
    wait_placed(&file, 0, &old);
    let mut b = Raw::connect(&e.sock);
    assert_eq!(b.write(0, 4096, &new), 0);
    wait_placed(&file, 0, &want);
    assert_eq!(relay.live(), 2, "{}", e.log());
    assert!(relay.inject_one(rpma_tests::Fault::Reset, 0));
    assert!(a.read(0, 8192).unwrap() == want, "A's read: {}", e.log());
    assert!(e.log().contains("reconnected"), "{}", e.log());
    assert_eq!(a.flush(), 0, "{}", e.log());
    // Namespace 1 only: the forced-dax one's writes are durable on placement.
    let page_cache = nsid == 1
        && rpma_tests::Transport::current().file_domain()
            == rpma_common::proto::PersistenceDomain::PageCache;
    if let Some(n) = page_cache
        .then(|| rpma_tests::unsynced_pages(&file, 0, 8192))
        .flatten()
    {
        assert_eq!(n, 0, "FLUSH answered with pages unsynced");
    }
    assert!(b.read(0, 8192).unwrap() == want);
}

/// Whether `s` has bytes to read now.
fn readable(s: &std::os::unix::net::UnixStream) -> bool {
    use nix::poll::{poll, PollFd, PollFlags};
    use std::os::fd::AsFd;
    let mut fds = [PollFd::new(s.as_fd(), PollFlags::POLLIN)];
    poll(&mut fds, 0u8).unwrap() > 0
}

/// A WRITE answered on one connection, then a WRITE (with `flags`) of the same block on
/// another, while the first is still on its way to the target (its link holds it: the export
/// answers a WRITE once TCP took it). The second must land after the first.
fn a_second_write_lands_after_a_held_one(name: &str, flags: u16, len: usize) {
    let (_d, _shm, t) = start(name);
    let relay = rpma_tests::Relay::start(&format!("127.0.0.1:{}", t.port()));
    let e = Export::start_via(&t, &relay.url(), 1, name, &[]);
    let mut a = Raw::connect(&e.sock);
    // A has the export's first queue, on the relay's only link so far: it stops forwarding.
    assert_eq!(relay.stall_links(), 1, "{}", e.log());
    assert_eq!(a.write(0, 0, &[1; 4096]), 0);
    let held = relay.waiting_from_client(0);
    assert!(held >= 4096, "A's WRITE waits in its link ({held} bytes)");
    let mut b = Raw::connect(&e.sock);
    let mut w = b.request(CMD_WRITE, flags, 20, 0, len as u32);
    w.extend(std::iter::repeat_n(2u8, len));
    b.send(&w);
    // B's WRITE must go after A's: through A's queue (into A's link, behind A's WRITE), or
    // once A's queue placed its writes (a Read that waits behind A's WRITE). Either way A's
    // link gets more to carry; B answered with nothing more there is the order lost.
    let deadline = Instant::now() + Duration::from_secs(30);
    while relay.waiting_from_client(0) <= held && !readable(&b.0) {
        assert!(Instant::now() < deadline, "neither came: {}", e.log());
        std::thread::sleep(Duration::from_millis(1));
    }
    let behind_a = relay.waiting_from_client(0) > held;
    relay.resume();
    assert_eq!(b.reply(), (0, 20));
    // A READ on A's own link comes after A's WRITE there: it sees what landed last.
    assert!(
        a.read(0, 4096).unwrap() == [2; 4096],
        "A's older WRITE landed over B's (B's went behind A's: {behind_a})"
    );
    assert!(behind_a);
    assert!(b.read(0, 4096).unwrap() == [2; 4096]);
}

/// A plain WRITE goes through the first connection's queue, behind the first WRITE. Without
/// that it went out on its own queue and the first's older bytes landed over it when its link
/// carried them (`CAN_MULTI_CONN`: the connections share one view).
#[test]
fn a_write_answered_on_one_connection_lands_before_a_later_one_on_another() {
    a_second_write_lands_after_a_held_one("order", 0, 4096);
}

/// A WRITE too large to be held back (its payload would be copied) goes through the first
/// connection's queue, behind the first WRITE, in the first connection's order.
#[test]
fn a_large_write_answered_after_another_connections_write_goes_through_its_queue() {
    a_second_write_lands_after_a_held_one("order-large", 0, 2 << 20);
}

/// A connection whose queue gave up (its reconnect budget spent while its target link kept
/// failing) gets a new queue for its next request, and that request still comes after the
/// WRITE another connection answered on the same bytes, held here in that connection's stalled
/// link. (Without a queue it asked no one, went out on the new queue at once, and the held
/// WRITE, answered earlier, landed over it.)
#[test]
fn a_connection_whose_queue_gave_up_still_waits_for_another_connections_write() {
    let (_d, _shm, t) = start("gave-up-order");
    let relay = rpma_tests::Relay::start(&format!("127.0.0.1:{}", t.port()));
    let e = Export::start_via(
        &t,
        &relay.url(),
        1,
        "gave-up-order",
        &["--reconnect-timeout", "1"],
    );
    let mut a = Raw::connect(&e.sock);
    assert_eq!(a.write(0, 8192, &[1; 4096]), 0);
    let mut b = Raw::connect(&e.sock);
    assert!(b.read(1 << 20, 4096).is_ok());
    assert_eq!(relay.live(), 2, "{}", e.log());
    // A's link is reset, and every connection its queue tries next, until it gives up.
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                relay.arm_next(rpma_tests::Fault::Reset);
                std::thread::sleep(Duration::from_millis(1));
            }
            relay.disarm();
        });
        assert!(relay.inject_one(rpma_tests::Fault::Reset, 0));
        e.log_line("the queue to the target failed");
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
    });
    // B's link, the only one left once the last attempt's link ended, holds what B sends
    // next: a WRITE of block 0, answered.
    let deadline = Instant::now() + WAIT;
    while relay.live() != 1 {
        assert!(Instant::now() < deadline, "links left: {}", relay.live());
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(relay.inject_one(rpma_tests::Fault::Stall(Duration::MAX), 0));
    assert_eq!(b.write(0, 0, &[2; 4096]), 0);
    assert!(relay.waiting_from_client(0) >= 4096);
    // A FUA WRITE of the same block on A: it must wait until B's is placed.
    let mut w = a.request(CMD_WRITE, FUA, 41, 0, 4096);
    w.extend_from_slice(&[3; 4096]);
    a.send(&w);
    let until = Instant::now() + Duration::from_secs(2);
    while Instant::now() < until {
        assert!(
            !readable(&a.0),
            "A's FUA WRITE answered {:?} while B's earlier WRITE was held in its link",
            a.reply()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    relay.resume();
    assert_eq!(a.reply(), (0, 41), "{}", e.log());
    assert!(
        b.read(0, 4096).unwrap() == [3; 4096],
        "B's older WRITE landed over A's"
    );
}

/// A FUA WRITE goes out on its own queue once the first connection's queue placed its writes
/// (a Read answered behind the first WRITE): the answer waits for the held link.
#[test]
fn a_fua_write_waits_until_another_connections_answered_write_is_placed() {
    a_second_write_lands_after_a_held_one("order-fua", FUA, 4096);
}

/// Large WRITEs received straight into payload buffers are held there until durable: sent
/// while the link to the target throws away what it carries (answered: TCP took them; nothing
/// reached the target), they are re-issued from their buffers once the link is reset and the
/// export's queue reconnects, and READs and a FLUSH after that find every byte.
#[test]
fn large_writes_received_in_place_are_reissued_from_their_buffers_after_a_lost_link() {
    const MIB: usize = 1 << 20;
    let (_d, _shm, t) = start("inplace-lost");
    let relay = rpma_tests::Relay::start(&format!("127.0.0.1:{}", t.port()));
    let e = Export::start_via(&t, &relay.url(), 1, "inplace-lost", &[]);
    let mut c = Raw::connect(&e.sock);
    assert_eq!(c.write(FUA, 0, &[1; 4096]), 0, "the queue is up");
    relay.swallow();
    let data: Vec<Vec<u8>> = (0..4).map(|i| pattern(60 + i, MIB)).collect();
    for (i, d) in data.iter().enumerate() {
        let mut w = c.request(CMD_WRITE, 0, 10, (i * MIB) as u64, MIB as u32);
        w.extend_from_slice(d);
        // Its header and first bytes read before the rest comes: received in place.
        c.send_read(&w[..28 + 4096]);
        c.send(&w[28 + 4096..]);
        assert_eq!(c.reply(), (0, 10));
    }
    assert!(
        cli_read(&t, 1, 0, 4 * MIB as u64)[4096..]
            .iter()
            .all(|&b| b == 0),
        "a swallowed WRITE reached the target"
    );
    relay.reset();
    for (i, d) in data.iter().enumerate() {
        assert!(
            c.read((i * MIB) as u64, MIB as u32).unwrap() == *d,
            "WRITE {i} after the reconnect: {}",
            e.log()
        );
    }
    assert_eq!(c.flush(), 0);
    for (i, d) in data.iter().enumerate() {
        assert!(
            cli_read(&t, 1, (i * MIB) as u64, MIB as u64) == *d,
            "WRITE {i}"
        );
    }
    let disc = c.request(CMD_DISC, 0, 1, 0, 0);
    c.send(&disc);
    assert!(c.closed());
    let line = e.log_line(" closed after ");
    assert!(
        line.contains("; 4 WRITE payload(s) received in place"),
        "{line}"
    );
}

/// A large READ is read straight into its reply's buffer; when a lost link voids its pieces
/// (their Read Requests wait in a stalled relay when the link is reset), the export's queue
/// reconnects and reads them again into the same buffer: the answer carries the bytes.
#[test]
fn a_large_read_voided_by_a_lost_link_is_read_again_into_its_buffer() {
    const MIB: usize = 1 << 20;
    let (_d, _shm, t) = start("inplace-read");
    let relay = rpma_tests::Relay::start(&format!("127.0.0.1:{}", t.port()));
    let e = Export::start_via(&t, &relay.url(), 1, "inplace-read", &[]);
    let mut c = Raw::connect(&e.sock);
    let data = pattern(70, 2 * MIB);
    assert_eq!(c.write(FUA, 0, &data), 0);
    assert_eq!(relay.stall_links(), 1, "{}", e.log());
    let read = c.request(CMD_READ, 0, 7, 0, 2 * MIB as u32);
    c.send(&read);
    let deadline = Instant::now() + Duration::from_secs(30);
    while relay.waiting_from_client(0) == 0 {
        assert!(Instant::now() < deadline, "the READ never reached the link");
        std::thread::sleep(Duration::from_millis(1));
    }
    relay.reset();
    assert_eq!(c.reply(), (0, 7));
    assert!(
        c.take(2 * MIB) == data,
        "the READ's bytes after the reconnect"
    );
    // The same buffer serves the next large READ.
    assert!(c.read(MIB as u64, MIB as u32).unwrap() == data[MIB..]);
}

#[test]
fn every_request_is_answered_while_the_target_stays_gone() {
    let (_d, _shm, mut t) = start("gone");
    let e = Export::start(&t, 1, "gone", &["--reconnect-timeout", "1"]);
    let mut c = Raw::connect(&e.sock);
    assert_eq!(c.write(0, 0, &[7; 4096]), 0);
    t.kill9();
    e.log_line("the queue to the target failed");
    // No queue now, and none can be opened: each request is answered EIO, none is left
    // waiting (the kernel's nbd would wait for it forever, and md above it would never fail
    // the leg).
    assert_eq!(c.write(0, 4096, &[8; 4096]), EIO);
    assert_eq!(c.read(0, 4096), Err(EIO));
    // Several at once, as the kernel sends them.
    let mut burst = Vec::new();
    for h in 0..3u64 {
        burst.extend(c.request(CMD_WRITE, 0, 100 + h, h * 4096, 4096));
        burst.extend_from_slice(&[9; 4096]);
    }
    c.send(&burst);
    let mut handles: Vec<u64> = (0..3)
        .map(|_| {
            let (err, h) = c.reply();
            assert_eq!(err, EIO, "handle {h}");
            h
        })
        .collect();
    handles.sort_unstable();
    assert_eq!(handles, [100, 101, 102]);
    t.restart();
    // The write acknowledged before the loss cannot be vouched for; then a new queue serves.
    assert_eq!(c.flush(), EIO);
    assert_eq!(c.write(FUA, 4096, &[8; 4096]), 0);
    assert_eq!(c.read(4096, 4096).unwrap(), vec![8; 4096]);
}

#[test]
fn volatile_flush_and_fua_fail_with_eio_unless_visible_ok() {
    let (_d, _shm, t) = start("volatile");
    let e = Export::start(&t, 3, "vol", &[]);
    let mut c = Raw::connect(&e.sock);
    assert_eq!(
        c.write(0, 0, &[1; 4096]),
        0,
        "a plain write is only sent anyway"
    );
    assert_eq!(c.write(FUA, 4096, &[2; 4096]), EIO);
    assert_eq!(c.flush(), EIO);
    assert_eq!(
        c.read(4096, 4096).unwrap(),
        vec![2; 4096],
        "visible all the same"
    );
    let ok = Export::start(&t, 3, "vol-ok", &["--visible-ok"]);
    let mut c = Raw::connect(&ok.sock);
    assert_eq!(c.write(FUA, 4096, &[3; 4096]), 0);
    assert_eq!(c.flush(), 0);
}

/// A READ or WRITE of a block another connection wrote (answered, but still on its way: its
/// link holds it) while that connection is busy (its READ waits in the same link): the request
/// is held back until that write is placed, and the requests after it on its own connection
/// are answered meanwhile. Waiting for the other connection in line stalled them all.
fn a_request_held_back_lets_the_next_go(name: &str, kind: u16) {
    let (_d, _shm, t) = start(name);
    let relay = rpma_tests::Relay::start(&format!("127.0.0.1:{}", t.port()));
    let e = Export::start_via(&t, &relay.url(), 1, name, &[]);
    let mut a = Raw::connect(&e.sock);
    // A takes its queue before B connects (a connection takes one after its handshake: B's
    // could take the export's first one, on link 0, first): A's is link 0, B's link 1.
    assert!(a.read(16384, 4096).is_ok());
    // B's queue comes before A's WRITE: A's queue writes into the export's shared map of
    // writes (a queue alone keeps out, and is waited for whatever the bytes).
    let mut b = Raw::connect(&e.sock);
    assert!(b.read(8192, 4096).is_ok());
    assert_eq!(relay.live(), 2, "{}", e.log());
    assert!(relay.inject_one(rpma_tests::Fault::Stall(Duration::MAX), 0));
    assert_eq!(a.write(0, 0, &[1; 4096]), 0);
    let held = relay.waiting_from_client(0);
    // A busy: its READ waits in its link, its connection waits for it.
    let r = a.request(CMD_READ, 0, 30, 1 << 20, 4096);
    a.send(&r);
    let deadline = Instant::now() + Duration::from_secs(30);
    while relay.waiting_from_client(0) <= held {
        assert!(
            Instant::now() < deadline,
            "A's READ never went: {}",
            e.log()
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let mut both = b.request(kind, 0, 20, 0, 4096);
    if kind == CMD_WRITE {
        both.extend_from_slice(&[2; 4096]);
    }
    both.extend(b.request(CMD_WRITE, 0, 21, 8192, 4096));
    both.extend_from_slice(&[3; 4096]);
    b.send(&both);
    assert_eq!(
        b.reply(),
        (0, 21),
        "B's second request was answered first, while its first waits for A's WRITE: {}",
        e.log()
    );
    relay.resume();
    assert_eq!(b.reply(), (0, 20));
    if kind == CMD_READ {
        assert!(
            b.take(4096) == [1; 4096],
            "B's READ missed A's answered WRITE"
        );
    }
    assert_eq!(a.reply(), (0, 30));
    assert!(a.take(4096) == [0; 4096]);
    let want = if kind == CMD_READ { 1 } else { 2 };
    assert!(
        a.read(0, 4096).unwrap() == [want; 4096],
        "A's older WRITE landed over B's"
    );
    assert!(b.read(8192, 4096).unwrap() == [3; 4096]);
}

#[test]
fn a_write_held_back_for_another_connections_write_lets_the_next_request_go() {
    a_request_held_back_lets_the_next_go("held-write", CMD_WRITE);
}

#[test]
fn a_read_held_back_for_another_connections_write_lets_the_next_request_go() {
    a_request_held_back_lets_the_next_go("held-read", CMD_READ);
}

rpma_tests::rdma_runs!(
    fua_and_flush_answers_mean_durable_across_a_target_sigkill,
    a_flush_after_the_queue_gave_up_answers_eio_once_per_connection,
    a_loss_no_flush_reported_is_reported_to_the_next_connection,
    a_loss_its_client_was_told_of_is_not_reported_to_the_next_connection,
    every_request_is_answered_while_the_target_stays_gone,
    volatile_flush_and_fua_fail_with_eio_unless_visible_ok,
);

/// A client that sends a FLUSH after each WRITE (fio's `fsync=1`, a journal) has each WRITE
/// made durable before it is answered, so that its FLUSH finds nothing left to do: right
/// after the answer, before any FLUSH, the bytes are in the file and no page under them is
/// unsynced (cachestat). A plain WRITE is answered once the transport took it: placed later,
/// and dirty until a FLUSH. Only small WRITEs (8 KiB at most); a client that sends two WRITEs
/// in a row is no longer taken for one that flushes after each: its closing log line counts
/// the WRITEs made durable early.
#[test]
fn a_write_of_a_client_that_flushes_after_each_is_durable_when_answered() {
    let (_d, _shm, t) = start("early");
    let file = t.dir().join("ns1");
    let page_cache = rpma_tests::Transport::current().file_domain()
        == rpma_common::proto::PersistenceDomain::PageCache;
    let unsynced = |off: u64| {
        page_cache
            .then(|| rpma_tests::unsynced_pages(&file, off, 64 << 10))
            .flatten()
    };
    if unsynced(0).is_none() {
        eprintln!("skipped: the namespace is not page cache here, or no cachestat(2)");
        return;
    }
    let in_file = |off: u64, len: usize| {
        use std::os::unix::fs::FileExt;
        let mut b = vec![0u8; len];
        std::fs::File::open(&file)
            .unwrap()
            .read_exact_at(&mut b, off)
            .unwrap();
        b
    };
    let mut e = Export::start(&t, 1, "early", &[]);
    let mut c = Raw::connect(&e.sock);
    // The pattern: a WRITE, then a FLUSH.
    assert_eq!(c.write(0, 0, &pattern(1, 64 << 10)), 0);
    assert_eq!(c.flush(), 0);
    for (i, off) in [64u64 << 10, 128 << 10].into_iter().enumerate() {
        let data = pattern(2 + i as u64, 4096);
        assert_eq!(c.write(0, off, &data), 0);
        assert!(
            in_file(off, data.len()) == data,
            "the WRITE was answered before its bytes were placed"
        );
        assert_eq!(
            unsynced(off),
            Some(0),
            "the WRITE was answered with its pages unsynced"
        );
        assert_eq!(c.flush(), 0);
    }
    // A larger WRITE goes the usual way (its transfer overlaps the client's turn-around).
    assert_eq!(c.write(0, 256 << 10, &pattern(7, 64 << 10)), 0);
    assert_eq!(c.flush(), 0);
    // Two WRITEs in a row (sent together, so decided as they are read): the first is taken
    // for one more of the pattern, the second ends it.
    let mut two = Vec::new();
    for (h, off) in [(21u64, 192u64 << 10), (22, 196 << 10)] {
        two.extend(c.request(CMD_WRITE, 0, h, off, 4096));
        two.extend(pattern(h, 4096));
    }
    c.send(&two);
    let mut handles = [c.reply(), c.reply()];
    handles.sort();
    assert_eq!(handles, [(0, 21), (0, 22)]);
    assert_eq!(c.flush(), 0);
    for (h, off) in [(21u64, 192u64 << 10), (22, 196 << 10)] {
        assert!(in_file(off, 4096) == pattern(h, 4096));
    }
    drop(c);
    let line = e.log_line(") closed after");
    assert!(
        line.contains("; 3 WRITE(s) made durable before their FLUSH came"),
        "{line}"
    );
    assert_eq!(e.term().code(), Some(0), "{}", e.log());
}

/// The export keeps the blocks it wrote for a replay in its queue's slots and makes them
/// durable when those are full (or at a FLUSH), not before: `--replay-bytes` is that memory.
/// With none beyond the requests in flight (`0`, four slots at `--queue-depth 4`), a burst of
/// sixteen plain WRITEs found its first blocks synced to make room; with 16 MiB (64 slots),
/// every block of the burst is still in the page cache unsynced once placed.
#[test]
fn held_writes_are_made_durable_when_the_replay_memory_is_full_not_before() {
    let (_d, _shm, t) = start("replay");
    let file = t.dir().join("ns1");
    if rpma_tests::Transport::current().file_domain()
        != rpma_common::proto::PersistenceDomain::PageCache
        || rpma_tests::unsynced_pages(&file, 0, 4096).is_none()
    {
        eprintln!("SKIPPED: needs nsid 1 on page cache and cachestat(2) to see unsynced pages");
        return;
    }
    // Sixteen 4 KiB WRITEs at `base`, each answered before the next; then, once all are
    // placed, which of them still have unsynced pages.
    let burst = |replay: &str, base: u64| -> Vec<bool> {
        let args = ["--queue-depth", "4", "--replay-bytes", replay];
        let e = Export::start(&t, 1, &format!("replay-{replay}"), &args);
        let mut c = Raw::connect(&e.sock);
        let blocks: Vec<(u64, Vec<u8>)> = (0..16u64)
            .map(|i| (base + i * 4096, pattern(100 + i, 4096)))
            .collect();
        for (off, b) in &blocks {
            assert_eq!(c.write(0, *off, b), 0);
        }
        for (off, b) in &blocks {
            wait_placed(&file, *off, b);
        }
        blocks
            .iter()
            .map(|(off, _)| rpma_tests::unsynced_pages(&file, *off, 4096).unwrap() > 0)
            .collect()
    };
    let roomy = burst("16MiB", 0);
    assert!(
        roomy.iter().all(|&d| d),
        "with room for the burst, a block was synced before any FLUSH: {roomy:?}"
    );
    let tight = burst("0", 1 << 20);
    assert!(
        !tight[0] && tight.iter().filter(|&&d| !d).count() >= 8,
        "with four slots, the burst's first blocks were not made durable to make room: {tight:?}"
    );
}
