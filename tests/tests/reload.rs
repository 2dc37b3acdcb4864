//! SIGHUP reloads with sessions up: only what the diff names is touched (namespaces added,
//! removed, changed; hosts removed), a refused reload changes nothing.
//! The real `rpma-target` process and the rpma-initiator library in-process (the fixture of
//! [`rpma_tests::sessions`]); every wait has a deadline.

mod hostile;

use std::time::Duration;

use nix::sys::signal::Signal;
use rpma_common::fabric::{RemoteAddr, WcStatus};
use rpma_common::proto::auth::Psk;
use rpma_common::proto::FlushStatus;
use rpma_initiator::{connect, identify, Error, Session};
use rpma_tests::sessions::*;
use rpma_tests::{host, nqn, opts, scratch};

#[test]
fn sighup_adds_a_namespace_while_a_session_stays_up() {
    let d = scratch();
    // A keep-alive short enough to lapse if the session were dropped by the reload, long
    // enough for the steps below that do not tick it (an identify over rdma in an emulated
    // guest takes seconds).
    let t = start(d.path(), "keep_alive_ms = 10000");
    let mut s = session(&t);
    let n1 = s.namespace(1).unwrap().clone();
    let remote = RemoteAddr {
        addr: n1.remote_addr + 8192,
        rkey: n1.rkey,
    };
    let extra = "[[subsystem.namespace]]\nnsid = 4\npath = \"ns4\"\nsize = \"1MiB\"\n";
    t.rewrite(&demo_config("keep_alive_ms = 10000", extra));
    t.signal(Signal::SIGHUP);
    // The session keeps its keep-alive going while the target reloads (slow on a loaded
    // machine or in an emulated guest): the host sends keep-alives when it ticks.
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        s.tick().unwrap();
        if t.next(Duration::from_millis(100))
            .is_some_and(|m| m.starts_with("READY=1"))
        {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no READY=1 after the reload"
        );
    }
    // The session was not touched: same rkeys, still working, still alive.
    for _ in 0..5 {
        s.tick().unwrap();
        let _ = s.wait_message(Duration::from_millis(100), "nothing");
    }
    assert_eq!(
        write_then_read(&mut s, remote, b"after reload"),
        [WcStatus::Success, WcStatus::Success]
    );
    assert_eq!(s.flush(1, 8192, 12, WAIT).unwrap(), FlushStatus::Durable);
    assert_eq!(s.namespaces().len(), 2);
    // A new identify sees the new namespace.
    let id = identify(&t.url(), &nqn(SUB), &host(PLAIN), &opts()).unwrap();
    let ns: Vec<u32> = id.namespaces.iter().map(|n| n.nsid).collect();
    assert_eq!(ns, [1, 3, 4]);
    // identify's Disconnect may still be on its way: the count settles at 1 (ours) shortly.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let mut v = t.status();
    while v["sessions"].as_array().unwrap().len() != 1 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
        v = t.status();
    }
    assert_eq!(v["sessions"].as_array().unwrap().len(), 1, "{v}");
}

#[test]
fn sighup_removing_a_namespace_revokes_it_only() {
    let d = scratch();
    let top = "keep_alive_ms = 10000";
    let t = start(d.path(), top);
    // A session on OPEN (its nsid 1 only) and one on SUB (nsid 1 and the read-only nsid 3).
    let mut other = connect(&t.url(), &nqn(OPEN), &host(OPEN_HOST), &opts()).unwrap();
    let mut s = session(&t);
    let at = |s: &Session, nsid: u32, off: u64| {
        let n = s.namespace(nsid).unwrap();
        RemoteAddr {
            addr: n.remote_addr + off,
            rkey: n.rkey,
        }
    };
    let (o1, n1, n3) = (at(&other, 1, 0), at(&s, 1, 4096), at(&s, 3, 0));
    assert_eq!(read8(&mut s, n3), WcStatus::Success);

    // Remove SUB's nsid 3 and reload.
    let without_3 = rpma_tests::without_namespace(&demo_config(top, ""), 3);
    assert!(!without_3.contains("nsid = 3"), "{without_3}");
    t.rewrite(&without_3);
    t.signal(Signal::SIGHUP);
    t.expect("RELOADING=1", WAIT);
    t.expect("READY=1", WAIT);

    // The session that never used nsid 3 is untouched: Writes, Reads and flushes.
    assert_eq!(
        write_then_read(&mut other, o1, b"other session"),
        [WcStatus::Success, WcStatus::Success]
    );
    assert_eq!(other.flush(1, 0, 13, WAIT).unwrap(), FlushStatus::Durable);
    // The session that had it keeps nsid 1...
    assert_eq!(
        write_then_read(&mut s, n1, b"still mine"),
        [WcStatus::Success, WcStatus::Success]
    );
    assert_eq!(s.flush(1, 4096, 10, WAIT).unwrap(), FlushStatus::Durable);
    // ...and lost nsid 3: no flush, and its rkey is revoked.
    assert_eq!(
        s.flush(3, 0, 8, WAIT).unwrap(),
        FlushStatus::InvalidNamespace
    );
    // Over rdma the target's queue pair goes to Error on the access violation and the target
    // disconnects; the DREQ can reach this side before the NAK does, and then the Read is
    // flushed instead (docs/rdma.md). Either way it returned nothing.
    let st = read8(&mut s, n3);
    let refused: &[WcStatus] = match rpma_tests::Transport::current() {
        rpma_tests::Transport::Tcp => &[WcStatus::RemoteAccess],
        rpma_tests::Transport::Rdma { .. } => &[WcStatus::RemoteAccess, WcStatus::WrFlush],
    };
    assert!(refused.contains(&st), "{st:?}");
    // New connections no longer see it; the other session is still listed and alive.
    let id = identify(&t.url(), &nqn(SUB), &host(PLAIN), &opts()).unwrap();
    let ns: Vec<u32> = id.namespaces.iter().map(|n| n.nsid).collect();
    assert_eq!(ns, [1]);
    assert_eq!(other.flush(1, 0, 0, WAIT).unwrap(), FlushStatus::Durable);
    let v = t.status();
    assert!(v["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .any(|x| x["host_nqn"] == OPEN_HOST));
}

/// A target on the demo configuration plus nsid 2 (`len` bytes of 0xAA in `ns2`; `extra`,
/// returned, is its lines) and a raw peer admitted as PLAIN that asked for as many Reads of all
/// of nsid 2 as its ORD allows and reads nothing yet: the target answers until the socket
/// takes no more.
fn reads_not_taken(len: usize) -> (tempfile::TempDir, rpma_tests::Target, hostile::Peer, String) {
    use rpma_common::fabric::soft::wire::rdmap::ReadRequest;
    use rpma_common::fabric::soft::wire::Opcode;
    let d = scratch();
    std::fs::write(d.path().join("ns2"), vec![0xAA; len]).unwrap();
    let extra = format!(
        "[[subsystem.namespace]]\nnsid = 2\npath = \"ns2\"\nsize = \"{}MiB\"\n",
        len >> 20
    );
    let t = start_with_extra(d.path(), "", &extra, &[]);
    let mut p = hostile::Peer::open(t.port(), std::net::Ipv4Addr::new(127, 0, 0, 2));
    let n2 = hostile::ns(&p.admit(), 2).clone();
    let mut reads = Vec::new();
    for _ in 0..p.n.ord {
        let rr = ReadRequest {
            sink_stag: 0x4242,
            sink_to: 0,
            size: len as u32,
            src_stag: n2.rkey,
            src_to: n2.remote_addr,
        };
        reads.extend(p.request_fpdu(Opcode::ReadRequest, &rr.encode()));
    }
    p.raw(&reads);
    // Not a margin: the tests' checks hold whatever the target sent by then.
    std::thread::sleep(Duration::from_secs(1));
    (d, t, p, extra)
}

/// A host that asked for Reads of a namespace and stopped reading its socket, when a reload
/// removes that namespace and its file is written afterwards (given to someone else): the rest
/// of its Reads never leaves. It gets an RDMAP Invalid STag Terminate, or its stream ends in
/// the middle of the FPDU the target was sending, and not one byte written after the reload.
/// (The answers were read from the mapping when the socket took them: the host got the file's
/// new contents.)
#[test]
fn a_read_a_host_stopped_taking_ends_when_a_reload_removes_its_namespace() {
    use rpma_common::fabric::soft::wire::{fpdu_len, Header, Opcode, TermCause, Terminate};
    use std::io::Read;
    use std::os::unix::fs::FileExt;
    if rpma_tests::Transport::current() != rpma_tests::Transport::Tcp {
        eprintln!("skipped: a raw iWARP peer needs the tcp transport");
        return;
    }
    const LEN: usize = 64 << 20;
    let (d, t, mut p, extra) = reads_not_taken(LEN);
    let ns2 = d.path().join("ns2");
    t.rewrite(&rpma_tests::without_namespace(&demo_config("", &extra), 2));
    t.signal(Signal::SIGHUP);
    t.expect("RELOADING=1", WAIT);
    t.expect("READY=1", WAIT);
    // The poll loop hears of the reload after READY=1.
    let revoked = t.log_lines(&["namespace 2 removed by reload"], WAIT);
    assert!(!revoked.is_empty(), "{}", t.log());
    let f = std::fs::OpenOptions::new().write(true).open(&ns2).unwrap();
    f.write_all_at(&vec![0xBB; LEN], 0).unwrap();
    // The host reads again: FPDU by FPDU, until a Terminate or the end of the stream (which
    // the target cuts in the middle of an FPDU that was partly sent when it was revoked).
    let deadline = std::time::Instant::now() + WAIT;
    let (mut buf, mut answered, mut term) = (Vec::new(), 0usize, None::<Terminate>);
    let mut ended = false;
    let mut b = vec![0u8; 1 << 20];
    p.s.set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    while term.is_none() && std::time::Instant::now() < deadline {
        match p.s.read(&mut b) {
            Ok(0) => ended = true,
            Ok(n) => buf.extend_from_slice(&b[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => ended = true,
            Err(_) => continue,
        }
        if ended {
            break;
        }
        let mut at = 0;
        while buf.len() - at >= 2 {
            let len = usize::from(u16::from_be_bytes([buf[at], buf[at + 1]]));
            if buf.len() - at < fpdu_len(len) {
                break;
            }
            let ulpdu = &buf[at + 2..at + 2 + len];
            let (h, hl) = Header::decode(ulpdu).unwrap();
            match h.opcode {
                Opcode::ReadResponse => {
                    assert!(
                        !ulpdu[hl..].contains(&0xBB),
                        "bytes written after the reload were sent, {answered} bytes in"
                    );
                    answered += len - hl;
                }
                Opcode::Terminate => term = Some(Terminate::decode(&ulpdu[hl..]).unwrap()),
                _ => {}
            }
            at += fpdu_len(len);
        }
        buf.drain(..at);
    }
    match term {
        Some(term) => {
            assert_eq!(term.cause, TermCause::RDMAP_INVALID_STAG);
            assert!(p.closed(), "the connection stayed open");
        }
        None => {
            assert!(
                ended,
                "neither a Terminate nor the end, {answered} bytes answered"
            );
            assert!(
                !buf.is_empty(),
                "the stream ended between FPDUs, without a Terminate"
            );
            assert!(
                !buf.contains(&0xBB),
                "bytes written after the reload were sent"
            );
        }
    }
    assert!(answered < LEN * usize::from(p.n.ord));
}

/// A reload that closes a session (its host was removed) while Reads the host asked for wait
/// for it to read its socket: the target deregisters the session's regions before its
/// Disconnect, and that must not fail those Reads. The host gets their answers and then the
/// Disconnect, never a Terminate (a RemoteAccess, which the initiator does not retry: EIO for
/// an NBD client across a graceful goodbye).
#[test]
fn a_goodbye_answers_the_reads_a_host_had_not_taken_before_its_disconnect() {
    if rpma_tests::Transport::current() != rpma_tests::Transport::Tcp {
        eprintln!("skipped: a raw iWARP peer needs the tcp transport");
        return;
    }
    const LEN: usize = 2 << 20;
    let (_d, t, mut p, extra) = reads_not_taken(LEN);
    let without_plain = demo_config("", &extra).replace(&format!("{{ nqn = \"{PLAIN}\" }}, "), "");
    assert!(!without_plain.contains(PLAIN), "{without_plain}");
    t.rewrite(&without_plain);
    t.signal(Signal::SIGHUP);
    t.expect("RELOADING=1", WAIT);
    t.expect("READY=1", WAIT);
    let closing = t.log_lines(&["its subsystem or host entry changed: closing"], WAIT);
    assert!(!closing.is_empty(), "{}", t.log());
    answers_then_disconnect(&mut p, "configuration");
}

/// What a host that stopped reading gets once it reads again after its session was closed:
/// Read Responses, then the Disconnect (its reason naming `why`), never a Terminate.
fn answers_then_disconnect(p: &mut hostile::Peer, why: &str) {
    use hostile::FromTarget;
    use rpma_common::fabric::soft::wire::Opcode;
    use rpma_common::proto::Message;
    let mut answers = 0;
    loop {
        match p.next(WAIT) {
            Some(FromTarget::Other(Opcode::ReadResponse)) => answers += 1,
            Some(FromTarget::Message(Ok(Message::Disconnect(d)))) => {
                assert!(d.reason.contains(why), "{d:?}");
                break;
            }
            Some(FromTarget::Message(_)) | Some(FromTarget::Other(_)) => {}
            other => panic!("no Disconnect after {answers} Read Response FPDUs: {other:?}"),
        }
    }
    assert!(answers > 0);
}

/// A reload that changes a namespace in place (its size grown, the same file) closes the
/// sessions that hold it, but the Reads their hosts asked for before are still answered, then
/// the Disconnect: only a namespace removed, or another file in its place, has its queued
/// answers stopped. (Every changed namespace was revoked: the hosts' Reads failed with
/// RemoteAccess, which the initiator does not retry, a helper's review.)
#[test]
fn a_namespace_changed_in_place_still_answers_the_reads_before_the_disconnect() {
    if rpma_tests::Transport::current() != rpma_tests::Transport::Tcp {
        eprintln!("skipped: a raw iWARP peer needs the tcp transport");
        return;
    }
    const LEN: usize = 2 << 20;
    let (_d, t, mut p, extra) = reads_not_taken(LEN);
    let grown = extra.replace("size = \"2MiB\"", "size = \"4MiB\"\ngrow = true");
    assert_ne!(grown, extra);
    t.rewrite(&demo_config("", &grown));
    t.signal(Signal::SIGHUP);
    t.expect("RELOADING=1", WAIT);
    t.expect("READY=1", WAIT);
    let closing = t.log_lines(&["namespace 2 changed by reload: closing"], WAIT);
    assert!(!closing.is_empty(), "{}", t.log());
    answers_then_disconnect(&mut p, "changed by reload");
}

/// Removing a host from a subsystem closes that host's session with a reason and refuses it
/// from then on; a session of another subsystem is not disturbed.
#[test]
fn sighup_removing_a_host_closes_its_session_only() {
    let d = scratch();
    let top = "keep_alive_ms = 10000";
    let t = start(d.path(), top);
    let mut other = connect(&t.url(), &nqn(OPEN), &host(OPEN_HOST), &opts()).unwrap();
    let mut s = session(&t);
    assert_eq!(s.flush(1, 0, 8, WAIT).unwrap(), FlushStatus::Durable);

    let without_plain = demo_config(top, "").replace(&format!("{{ nqn = \"{PLAIN}\" }}, "), "");
    assert!(!without_plain.contains(PLAIN), "{without_plain}");
    t.rewrite(&without_plain);
    t.signal(Signal::SIGHUP);
    t.expect("RELOADING=1", WAIT);
    t.expect("READY=1", WAIT);

    // The removed host's session is closed, with the reason.
    let end = s.wait_message(WAIT, "the goodbye");
    assert!(
        matches!(end, Err(Error::Disconnected { ref reason }) if reason.contains("configuration")),
        "{end:?}"
    );
    // It is refused from now on.
    let again = connect(&t.url(), &nqn(SUB), &host(PLAIN), &opts());
    assert!(
        matches!(again, Err(Error::HostNotAllowed { .. })),
        "{again:?}"
    );
    // The other subsystem's session never noticed.
    let o1 = {
        let n = other.namespace(1).unwrap();
        RemoteAddr {
            addr: n.remote_addr,
            rkey: n.rkey,
        }
    };
    assert_eq!(
        write_then_read(&mut other, o1, b"undisturbed"),
        [WcStatus::Success, WcStatus::Success]
    );
    assert_eq!(other.flush(1, 0, 11, WAIT).unwrap(), FlushStatus::Durable);
}

/// A host that `allow_any_host` admitted without a key, listed with a key by a reload: it must
/// now authenticate, so the session it holds without having done so is closed, and it gets in
/// again only with the key. (The added entry was not looked at: the session kept its rights.)
#[test]
fn a_reload_listing_a_host_with_a_key_closes_the_session_it_holds_without_one() {
    let d = scratch();
    let top = "keep_alive_ms = 10000";
    let t = start(d.path(), top);
    let mut s = connect(&t.url(), &nqn(OPEN), &host(OPEN_HOST), &opts()).unwrap();
    assert_eq!(s.flush(1, 0, 8, WAIT).unwrap(), FlushStatus::Durable);
    let keyed = demo_config(top, "").replacen(
        "allow_any_host = true\n",
        &format!(
            "allow_any_host = true\nhosts = [{{ nqn = \"{OPEN_HOST}\", psk_file = \"keyed.psk\" }}]\n"
        ),
        1,
    );
    assert!(
        keyed.contains(&format!("\"{OPEN_HOST}\", psk_file")),
        "{keyed}"
    );
    t.rewrite(&keyed);
    t.signal(Signal::SIGHUP);
    t.expect("RELOADING=1", WAIT);
    t.expect("READY=1", WAIT);
    let end = s.wait_message(WAIT, "the goodbye");
    assert!(
        matches!(end, Err(Error::Disconnected { ref reason }) if reason.contains("configuration")),
        "{end:?}"
    );
    let again = connect(&t.url(), &nqn(OPEN), &host(OPEN_HOST), &opts());
    assert!(matches!(again, Err(Error::KeyRequired)), "{again:?}");
    let with_key = host(OPEN_HOST).with_psk(Psk::from_hex(&KEY.repeat(32)).unwrap());
    let mut s = connect(&t.url(), &nqn(OPEN), &with_key, &opts()).unwrap();
    assert_eq!(s.flush(1, 0, 8, WAIT).unwrap(), FlushStatus::Durable);
}

#[test]
fn a_reload_that_changes_a_namespace_disconnects_its_sessions_with_the_reason() {
    let d = scratch();
    let top = "keep_alive_ms = 10000";
    let t = start(d.path(), top);
    let mut other = connect(&t.url(), &nqn(OPEN), &host(OPEN_HOST), &opts()).unwrap();
    let mut s = session(&t);
    assert_eq!(s.namespace(1).unwrap().size, 2 << 20);
    // Grow SUB's nsid 1 (which needs `grow = true`).
    let grown = demo_config(top, "").replacen(
        "path = \"ns1\"\nsize = \"2MiB\"",
        "path = \"ns1\"\nsize = \"4MiB\"\ngrow = true",
        1,
    );
    assert!(grown.contains("4MiB"));
    t.rewrite(&grown);
    t.signal(Signal::SIGHUP);
    t.expect("RELOADING=1", WAIT);
    t.expect("READY=1", WAIT);
    match s.wait_message(WAIT, "a Disconnect") {
        Err(Error::Disconnected { reason }) => {
            assert_eq!(reason, "namespace 1 changed by reload")
        }
        other => panic!("expected a Disconnect, got {other:?}"),
    }
    // The host reconnects and sees the new size; the other subsystem's session is untouched.
    let s = session(&t);
    assert_eq!(s.namespace(1).unwrap().size, 4 << 20);
    assert_eq!(other.flush(1, 0, 8, WAIT).unwrap(), FlushStatus::Durable);
    let v = t.status();
    assert!(
        v["last_reload"]
            .as_str()
            .unwrap()
            .contains("1 namespaces changed"),
        "{v}"
    );
}

#[test]
fn a_reload_that_would_grow_without_grow_changes_nothing() {
    let d = scratch();
    let top = "keep_alive_ms = 10000";
    let t = start(d.path(), top);
    let mut s = session(&t);
    let bigger = demo_config(top, "").replacen(
        "path = \"ns1\"\nsize = \"2MiB\"",
        "path = \"ns1\"\nsize = \"4MiB\"",
        1,
    );
    t.rewrite(&bigger);
    t.signal(Signal::SIGHUP);
    t.expect("RELOADING=1", WAIT);
    t.expect("READY=1", WAIT);
    let v = t.status();
    let last = v["last_reload"].as_str().unwrap();
    assert!(last.starts_with("failed") && last.contains("grow"), "{v}");
    assert_eq!(
        std::fs::metadata(d.path().join("ns1")).unwrap().len(),
        2 << 20
    );
    assert_eq!(s.flush(1, 0, 8, WAIT).unwrap(), FlushStatus::Durable);
}

rpma_tests::rdma_runs!(
    sighup_adds_a_namespace_while_a_session_stays_up,
    sighup_removing_a_namespace_revokes_it_only,
    sighup_removing_a_host_closes_its_session_only,
    a_reload_that_changes_a_namespace_disconnects_its_sessions_with_the_reason,
    a_reload_that_would_grow_without_grow_changes_nothing,
);

/// After a reload that followed the file at ns1's path being replaced by one filled with 0xaa:
/// the new file is served, and a durable write after the reload is there after a restart.
fn serves_the_new_file_across_a_restart(t: &mut rpma_tests::Target, what: &str) {
    use rpma_initiator::{Connection, HostIdentity};
    let conn = |t: &rpma_tests::Target| {
        Connection::new(&t.url(), nqn(SUB), HostIdentity::new(nqn(PLAIN)))
            .open_queue(0)
            .unwrap()
    };
    t.reload();
    let mut q = conn(t);
    let mut ns = q.namespace(1).unwrap();
    let mut got = vec![0u8; 4096];
    ns.read_at(8192, &mut got).unwrap();
    assert!(got == [0xaa; 4096], "{what} is served");
    assert!(ns.write_durable(0, &[0x5b; 4096]).unwrap().is_durable());
    q.close().unwrap();
    t.restart();
    let mut q = conn(t);
    let mut ns = q.namespace(1).unwrap();
    ns.read_at(0, &mut got).unwrap();
    assert!(
        got == [0x5b; 4096],
        "a durable write after the reload is there after a restart"
    );
}

/// A reload after a file was moved over a namespace's path (a restore, a provisioning tool):
/// the target maps the file the path names, and what hosts write durably after the reload is
/// in that file at the next start. (It kept serving the old file, unlinked: the writes and
/// their "durable" answers went there and were gone after a restart.)
#[test]
fn a_reload_after_the_file_was_replaced_serves_the_new_file() {
    let d = scratch();
    let mut t = start(d.path(), "");
    let restored = d.path().join("ns1.restored");
    std::fs::write(&restored, vec![0xaa; 2 << 20]).unwrap();
    std::fs::rename(&restored, d.path().join("ns1")).unwrap();
    serves_the_new_file_across_a_restart(&mut t, "the restored file");
}

/// The same through a symlink: the namespace's path is a link, retargeted to another file
/// (`current -> v2`), and a reload maps the file it names now. (The target compared the file
/// it had opened with the path it had resolved the link to then, which still named the old
/// file: it went on serving that one, and a restart served the other.)
#[test]
fn a_reload_after_the_namespace_symlink_was_retargeted_serves_the_new_file() {
    let d = scratch();
    std::fs::write(d.path().join("v1.img"), vec![0x11; 2 << 20]).unwrap();
    std::os::unix::fs::symlink("v1.img", d.path().join("ns1")).unwrap();
    let mut t = start(d.path(), "");
    std::fs::write(d.path().join("v2.img"), vec![0xaa; 2 << 20]).unwrap();
    std::os::unix::fs::symlink("v2.img", d.path().join("ns1.new")).unwrap();
    std::fs::rename(d.path().join("ns1.new"), d.path().join("ns1")).unwrap();
    serves_the_new_file_across_a_restart(&mut t, "the file the link names now");
}

/// A queue of PLAIN on SUB (the library's, which reconnects and re-issues what it holds), with
/// 4 KiB of 0x11 made durable at 0 and 4 KiB of 0x22 written at 4096 of nsid 1: acknowledged,
/// held by the queue, not durable yet.
fn queue_holding_a_write(t: &rpma_tests::Target) -> rpma_initiator::Queue {
    queue_holding_a_write_on(t, 1)
}

/// [`queue_holding_a_write`] on namespace `nsid`.
fn queue_holding_a_write_on(t: &rpma_tests::Target, nsid: u32) -> rpma_initiator::Queue {
    use rpma_initiator::{Connection, HostIdentity};
    let mut q = Connection::new(&t.url(), nqn(SUB), HostIdentity::new(nqn(PLAIN)))
        .open_queue(0)
        .unwrap();
    let mut ns = q.namespace(nsid).unwrap();
    assert!(ns.write_durable(0, &[0x11; 4096]).unwrap().is_durable());
    ns.write_at(4096, &[0x22; 4096]).unwrap();
    q
}

/// Reloads `t` and waits until its poll loop closed the sessions of the changed namespace (it
/// hears of the reload after READY=1): a request sent before then is served by the old
/// opening, as any before the reload.
fn reload_closing_sessions(t: &mut rpma_tests::Target) {
    t.reload();
    let closed = t.log_lines(&["changed by reload: closing"], Duration::from_secs(30));
    assert!(!closed.is_empty(), "no session closed: {}", t.log());
}

/// A queue holding a write (acknowledged, not durable) when a reload maps a restored file at
/// its namespace's path gives up with `NamespaceChanged`: the held write is not re-issued into
/// the restored file, and no persist answers durable (the durable 0x11 is not in that file).
/// (The queue compared size and mode only: it re-issued the write into the restored file and
/// the persist answered durable, vouching for bytes the namespace no longer held.)
#[test]
fn a_queue_holding_writes_gives_up_when_a_reload_replaced_its_file() {
    let d = scratch();
    let mut t = start(d.path(), "");
    let mut q = queue_holding_a_write(&t);
    let restored = d.path().join("ns1.restored");
    std::fs::write(&restored, vec![0u8; 2 << 20]).unwrap();
    std::fs::rename(&restored, d.path().join("ns1")).unwrap();
    reload_closing_sessions(&mut t);
    match q.namespace(1).unwrap().persist(0, 8192) {
        Err(Error::NamespaceChanged { nsid: 1, what }) => {
            assert!(what.contains("another file"), "{what}")
        }
        other => panic!("expected NamespaceChanged, got {other:?}"),
    }
    assert!(matches!(
        q.namespace(1).unwrap().persist(0, 8192),
        Err(Error::Broken)
    ));
    let now = std::fs::read(d.path().join("ns1")).unwrap();
    assert!(
        now[..8192].iter().all(|&b| b == 0),
        "the held write was re-issued into the restored file"
    );
}

/// A reload that reopens the same file (a changed block size) keeps the namespace's identity:
/// the queue reconnects, re-issues the write it held and makes it durable.
#[test]
fn a_queue_holding_writes_reissues_them_across_a_reload_of_the_same_file() {
    let d = scratch();
    let mut t = start(d.path(), "");
    let mut q = queue_holding_a_write(&t);
    let changed = demo_config("", "").replacen(
        "path = \"ns1\"\nsize = \"2MiB\"",
        "path = \"ns1\"\nsize = \"2MiB\"\nblock_size = 512",
        1,
    );
    assert!(changed.contains("block_size = 512"));
    t.rewrite(&changed);
    reload_closing_sessions(&mut t);
    let out = q.namespace(1).unwrap().persist(0, 8192).unwrap();
    assert!(out.is_durable(), "{out:?}");
    assert_eq!(q.reconnects(), 1);
    let now = std::fs::read(d.path().join("ns1")).unwrap();
    assert!(now[..4096] == [0x11; 4096] && now[4096..8192] == [0x22; 4096]);
}

/// [`queue_holding_a_write_on`] `nsid` of `t`, whose file is `file`, then a reload to
/// `config` that closes the queue's session (it was granted every namespace of SUB) without
/// touching that file: the bytes of the held write are taken out of the file once the session
/// is closed (nothing more of it lands), so that only a re-issue puts them back. Returns the
/// queue after a persist of `nsid` that the reconnect had to go through.
fn queue_after_a_reload_of_another_namespace(
    t: &mut rpma_tests::Target,
    file: &std::path::Path,
    nsid: u32,
    config: &str,
) -> rpma_initiator::Queue {
    let mut q = queue_holding_a_write_on(t, nsid);
    t.rewrite(config);
    reload_closing_sessions(t);
    let f = std::fs::OpenOptions::new().write(true).open(file).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, &[0u8; 4096], 4096).unwrap();
    drop(f);
    let out = q.namespace(nsid).unwrap().persist(0, 8192);
    assert!(
        out.as_ref().is_ok_and(|o| o.is_durable()),
        "the queue gave up for a namespace it never opened: {out:?}"
    );
    assert_eq!(q.reconnects(), 1);
    assert!(!q.is_broken());
    let now = std::fs::read(file).unwrap();
    assert!(
        now[..4096] == [0x11; 4096] && now[4096..8192] == [0x22; 4096],
        "the held write was not re-issued"
    );
    q
}

/// A reload that changes a namespace the queue never opened (nsid 3 made writable) closes the
/// queue's session, and the queue goes on: it re-issues the write it held on nsid 1 and makes
/// it durable, and a later handle on nsid 3 sees its new descriptor. (Any namespace that
/// changed gave the queue up with `NamespaceChanged`: the write held on nsid 1, which had not
/// changed, was dropped and every later call failed with `Broken`.)
#[test]
fn a_queue_holding_writes_reissues_them_when_a_reload_changed_a_namespace_it_does_not_use() {
    let writable = demo_config("", "").replacen("read_only = true\n", "", 1);
    assert!(!writable.contains("read_only"), "{writable}");
    let d = scratch();
    let mut t = start(d.path(), "");
    let mut q =
        queue_after_a_reload_of_another_namespace(&mut t, &d.path().join("ns1"), 1, &writable);
    assert!(!q.namespace(3).unwrap().descriptor().read_only);
    let mut ns3 = q.namespace(3).unwrap();
    ns3.write_at(0, &[0x33; 8]).unwrap();
    assert!(ns3.persist(0, 8).unwrap().is_durable());
}

/// The same when the reload grows the namespace the queue never opened: the queue goes on,
/// and sees the new size.
#[test]
fn a_queue_holding_writes_reissues_them_when_a_reload_grew_a_namespace_it_does_not_use() {
    let grown = demo_config("", "").replacen(
        "path = \"ns3\"\nsize = \"1MiB\"",
        "path = \"ns3\"\nsize = \"2MiB\"\ngrow = true",
        1,
    );
    assert!(grown.contains("grow = true"), "{grown}");
    let d = scratch();
    let mut t = start(d.path(), "");
    let mut q = queue_after_a_reload_of_another_namespace(&mut t, &d.path().join("ns1"), 1, &grown);
    assert_eq!(q.namespace(3).unwrap().descriptor().size, 2 << 20);
}

/// The same when the reload removes the namespace the queue never opened (and reopens nsid 1's
/// file with another block size, which closes the session): the queue goes on, and no longer
/// lists nsid 3. The indexes the queue addresses its namespaces by stay: nsid 1's held write
/// is re-issued to nsid 1.
#[test]
fn a_queue_holding_writes_reissues_them_when_a_reload_removed_a_namespace_it_does_not_use() {
    let config = rpma_tests::without_namespace(&demo_config("", ""), 3).replacen(
        "path = \"ns1\"\nsize = \"2MiB\"",
        "path = \"ns1\"\nsize = \"2MiB\"\nblock_size = 512",
        1,
    );
    assert!(!config.contains("nsid = 3") && config.contains("block_size = 512"));
    let d = scratch();
    let mut t = start(d.path(), "");
    let mut q =
        queue_after_a_reload_of_another_namespace(&mut t, &d.path().join("ns1"), 1, &config);
    assert!(
        matches!(q.namespace(3), Err(Error::NoSuchNamespace { nsid: 3 })),
        "{:?}",
        q.namespace(3).map(|ns| ns.descriptor().clone())
    );
    let listed: Vec<u32> = q.namespaces().iter().map(|d| d.nsid).collect();
    assert_eq!(listed, [1]);
}

/// The same with the removed namespace before the one holding the write in the target's list
/// (nsid 1 removed; the write held on nsid 5, after nsid 3): the queue addresses its
/// namespaces by their places in the first connection's list, and the write goes to nsid 5,
/// not to what comes at its place in the new list, and nothing to nsid 1's file.
#[test]
fn a_write_held_on_a_later_namespace_is_reissued_to_it_when_a_reload_removed_an_earlier_one() {
    let ns5 = "[[subsystem.namespace]]\nnsid = 5\npath = \"ns5\"\nsize = \"1MiB\"\n";
    let d = scratch();
    let mut t = start_with_extra(d.path(), "", ns5, &[]);
    // SUB's nsid 1 (OPEN has an nsid 1 too).
    let config = demo_config("", ns5)
        .replacen(
            "[[subsystem.namespace]]\nnsid = 1\npath = \"ns1\"\nsize = \"2MiB\"\n",
            "",
            1,
        )
        .replacen(
            "path = \"ns5\"\nsize = \"1MiB\"",
            "path = \"ns5\"\nsize = \"1MiB\"\nblock_size = 512",
            1,
        );
    assert!(config.contains("block_size = 512") && !config.contains("path = \"ns1\""));
    let mut q =
        queue_after_a_reload_of_another_namespace(&mut t, &d.path().join("ns5"), 5, &config);
    assert!(matches!(
        q.namespace(1),
        Err(Error::NoSuchNamespace { nsid: 1 })
    ));
    let listed: Vec<u32> = q.namespaces().iter().map(|d| d.nsid).collect();
    assert_eq!(listed, [3, 5]);
    let ns1 = std::fs::read(d.path().join("ns1")).unwrap();
    assert!(ns1.iter().all(|&b| b == 0), "a write went to nsid 1's file");
}

/// A namespace the queue opened is one it uses, whether or not it holds writes there: a
/// reload that changes it gives the queue up with `NamespaceChanged` naming it, as for the
/// namespace holding its writes (what the queue checked and chose there was for the old one).
#[test]
fn a_queue_gives_up_when_a_reload_changed_a_namespace_it_opened() {
    let d = scratch();
    let mut t = start(d.path(), "");
    let mut q = queue_holding_a_write(&t);
    let mut b = [0u8; 8];
    q.namespace(3).unwrap().read_at(0, &mut b).unwrap();
    t.rewrite(&demo_config("", "").replacen("read_only = true\n", "", 1));
    reload_closing_sessions(&mut t);
    match q.namespace(1).unwrap().persist(0, 8192) {
        Err(Error::NamespaceChanged { nsid: 3, what }) => {
            assert!(what.contains("read-only true -> false"), "{what}")
        }
        other => panic!("expected NamespaceChanged for nsid 3, got {other:?}"),
    }
    assert!(q.is_broken());
}

/// A setting that needs a restart is said to be ignored by every reload until the restart, not
/// only the first: `state_file` was taken from the new configuration by the first reload, so
/// the second saw no change and no longer said so (the daemon still wrote the old file).
#[test]
fn a_state_file_change_is_ignored_until_restart_by_every_reload() {
    let d = scratch();
    let mut t = start(d.path(), "");
    t.rewrite(&demo_config("state_file = \"moved.state\"", ""));
    for i in 0..2 {
        t.reload();
        let last = t.status()["last_reload"].clone();
        assert!(
            last.as_str()
                .is_some_and(|l| l.contains("ignored until restart: state_file")),
            "reload {i}: {last}"
        );
    }
    assert!(!d.path().join("moved.state").exists());
}

/// `crc`, which a reload applies to new connections, is what `status` shows for the listener
/// after the reload (it kept the value of the start).
#[test]
fn a_reloaded_crc_setting_is_what_status_shows() {
    let d = scratch();
    let mut t = start(d.path(), "");
    assert_eq!(t.status()["listeners"][0]["crc"], true);
    t.rewrite(&demo_config("crc = false", ""));
    t.reload();
    assert_eq!(
        t.status()["listeners"][0]["crc"],
        false,
        "{}",
        t.status()["listeners"]
    );
}

/// A host whose session ended (a reload removed its host entry) while Reads it had asked for
/// waited for it to read its socket: the connection lingers to let the Disconnect out, and a
/// second reload that removes the namespace, whose file then serves someone else, closes it
/// at once: not one byte written after that reload reaches the old host. (The lingering
/// connection had no grant left to revoke and went on sending from the file for its 2 s: the
/// new contents, a helper's review.)
#[test]
fn a_lingering_connection_sends_nothing_of_a_namespace_a_reload_removed() {
    use std::io::Read;
    use std::os::unix::fs::FileExt;
    if rpma_tests::Transport::current() != rpma_tests::Transport::Tcp {
        eprintln!("skipped: a raw iWARP peer needs the tcp transport");
        return;
    }
    const LEN: usize = 64 << 20;
    let (d, t, mut p, extra) = reads_not_taken(LEN);
    let reload = |config: &str| {
        t.rewrite(config);
        t.signal(Signal::SIGHUP);
        t.expect("RELOADING=1", WAIT);
        t.expect("READY=1", WAIT);
    };
    let without_plain = demo_config("", &extra).replace(&format!("{{ nqn = \"{PLAIN}\" }}, "), "");
    assert!(!without_plain.contains(PLAIN), "{without_plain}");
    reload(&without_plain);
    reload(&rpma_tests::without_namespace(&without_plain, 2));
    // The second reload reached the loop (it hears of one after its READY=1).
    let cut = t.log_lines(&["closed now, not at the end of its linger"], WAIT);
    assert!(!cut.is_empty(), "{}", t.log());
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(d.path().join("ns2"))
        .unwrap();
    f.write_all_at(&vec![0xBB; LEN], 0).unwrap();
    drop(f);
    let (mut got, mut b) = (0usize, vec![0u8; 1 << 20]);
    let mut run = 0usize;
    p.s.set_read_timeout(Some(WAIT)).unwrap();
    loop {
        match p.s.read(&mut b) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                for &x in &b[..n] {
                    run = if x == 0xBB { run + 1 } else { 0 };
                    assert!(
                        run < 64,
                        "bytes written after the reload were sent, {got} bytes in"
                    );
                }
                got += n;
            }
        }
    }
    eprintln!("the lingering connection closed after {got} bytes");
}

/// A target on [`demo_config`]`(HELD_UP_TOP, "")` whose two poll loops the test hook holds up
/// 300 ms at each reload, a reload waiting for them as long as need be (no margin to miss,
/// whatever the load).
const HELD_UP_TOP: &str = "poll_loops = 2";

fn with_held_up_loops(d: &std::path::Path) -> rpma_tests::Target {
    start_with_env(
        d,
        HELD_UP_TOP,
        &[
            ("RPMA_TARGET_TEST_STALL_ON_RELOAD_MS", "300"),
            ("RPMA_TARGET_TEST_RELOAD_APPLY_WAIT_MS", "600000"),
        ],
    )
}

/// How many loops said their hold was over among `t`'s notifications before its next READY=1
/// (and those notifications).
fn holds_over_before_ready(t: &rpma_tests::Target) -> (usize, Vec<String>) {
    let mut seen: Vec<String> = Vec::new();
    while !seen.iter().any(|m| m.starts_with("READY=1")) {
        seen.push(t.next(WAIT).unwrap_or_else(|| panic!("no READY: {seen:?}")));
    }
    let overs = seen
        .iter()
        .filter(|m| *m == "STATUS=test hook: stall over")
        .count();
    (overs, seen)
}

/// A reload that removes a namespace says READY only once every poll loop has applied it (a
/// loop's sessions reach the old file until then: on rdma its NIC does, until the loop
/// deregisters their regions). A loop held up by the test hook delays READY until it goes on.
/// (Before, READY came at once, while the loops still stalled.)
#[test]
fn a_reload_that_removes_a_namespace_is_ready_only_once_every_loop_applied_it() {
    let d = scratch();
    let t = with_held_up_loops(d.path());
    // SUB's nsid 3 removed: READY comes after both loops applied it.
    let without_3 = rpma_tests::without_namespace(&demo_config(HELD_UP_TOP, ""), 3);
    t.rewrite(&without_3);
    t.signal(Signal::SIGHUP);
    let (overs, seen) = holds_over_before_ready(&t);
    assert_eq!(
        overs, 2,
        "READY before every loop applied the reload: {seen:?}"
    );
}

/// `rpma-target reload` (the unit's ExecReload) asks for the reload and answers once it is
/// done, with its outcome: exit 0 and what changed, the loops having applied a removal (one
/// held up by the test hook included) and `status` counting it; exit 1 and why for a
/// configuration the daemon refuses, which changes nothing. (Before, ExecReload was `kill
/// -HUP`: `systemctl reload` returned at once, and succeeded whatever the reload did.)
#[test]
fn rpma_target_reload_waits_for_the_reload_and_reports_its_outcome() {
    let d = scratch();
    let t = with_held_up_loops(d.path());
    let sock = d.path().join("ctl.sock");
    let reload = || {
        let o = std::process::Command::new(rpma_tests::target_bin())
            .args(["reload", "--socket", sock.to_str().unwrap()])
            .output()
            .unwrap();
        (o.status.code(), rpma_tests::text(&o))
    };
    assert_eq!(t.status()["reloads"], 0);
    let without_3 = rpma_tests::without_namespace(&demo_config(HELD_UP_TOP, ""), 3);
    t.rewrite(&without_3);
    let (code, said) = reload();
    assert_eq!(code, Some(0), "{said}");
    assert!(
        said.contains("reloaded: ") && said.contains("namespaces removed"),
        "{said}"
    );
    // Done when it answered: counted, and both loops applied it (each said its stall was over
    // before the reload said READY).
    assert_eq!(t.status()["reloads"], 1);
    let (overs, seen) = holds_over_before_ready(&t);
    assert_eq!(overs, 2, "{seen:?}");
    // A configuration the daemon refuses: exit 1 with why; nothing changes.
    t.rewrite("this is not toml [");
    let (code, said) = reload();
    assert_eq!(code, Some(1), "{said}");
    assert!(said.contains("the reload failed"), "{said}");
    let st = t.status();
    assert_eq!(st["reloads"], 1, "{st}");
    assert!(
        st["last_reload"]
            .as_str()
            .is_some_and(|s| s.starts_with("failed")),
        "{st}"
    );
    // No daemon at the socket: exit 1, saying so.
    let o = std::process::Command::new(rpma_tests::target_bin())
        .args(["reload", "--socket"])
        .arg(d.path().join("no.sock"))
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", rpma_tests::text(&o));
    assert!(
        rpma_tests::text(&o).contains("no.sock"),
        "{}",
        rpma_tests::text(&o)
    );
}

/// A reload whose removal a poll loop has not applied when the daemon stops waiting for it (a
/// loop held up longer than the wait: a long sync of its own) is not reported done:
/// `rpma-target reload` exits 1 saying how many loops have not applied it and not to reuse the
/// files yet, and `status` says so too until they have. (It exited 0, "reloaded", while that
/// loop's sessions still reached the removed file: a file reused at once would have taken
/// their writes.)
#[test]
fn a_reload_a_loop_has_not_applied_when_the_wait_ends_is_not_reported_done() {
    let d = scratch();
    let t = start_with_env(
        d.path(),
        HELD_UP_TOP,
        &[
            ("RPMA_TARGET_TEST_STALL_ON_RELOAD_MS", "8000"),
            ("RPMA_TARGET_TEST_RELOAD_APPLY_WAIT_MS", "200"),
        ],
    );
    let without_3 = rpma_tests::without_namespace(&demo_config(HELD_UP_TOP, ""), 3);
    t.rewrite(&without_3);
    let reload = || {
        let o = std::process::Command::new(rpma_tests::target_bin())
            .args(["reload", "--socket"])
            .arg(d.path().join("ctl.sock"))
            .output()
            .unwrap();
        (o.status.code(), rpma_tests::text(&o))
    };
    let (code, said) = reload();
    assert_eq!(code, Some(1), "{said}");
    assert!(
        said.contains("namespaces removed")
            && said.contains("poll loop(s) have not applied it yet")
            && said.contains("do not reuse those files yet"),
        "{said}"
    );
    let st = t.status();
    assert!(
        st["last_reload"]
            .as_str()
            .is_some_and(|s| s.contains("have not applied it yet")),
        "{st}"
    );
    // A reload that changes nothing (an operator trying again) waits for nothing, and does not
    // hide the one that lags. (It answered 0, the warning gone.)
    let (code, said) = reload();
    assert_eq!(code, Some(1), "{said}");
    assert!(said.contains("have not applied it yet"), "{said}");
    // Once the loop applied it (its hold is over), `status` says the reload as it is.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let st = t.status();
        let said = st["last_reload"].as_str().unwrap_or_default().to_owned();
        if !said.is_empty() && !said.contains("have not applied") {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{st}");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// `reload` and `clear-failure` change the daemon's state: a member of the control socket's
/// group who is neither root nor the daemon's user may read `status` but is refused them,
/// with who may (SO_PEERCRED), and nothing is reloaded.
#[test]
fn reload_and_clear_failure_are_refused_to_the_sockets_other_users() {
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    const NOBODY: u32 = 65534;
    let d = scratch();
    let t = start(d.path(), "");
    let sock = d.path().join("ctl.sock");
    // The group's way to the socket: through the directory, and the socket's group.
    std::fs::set_permissions(d.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
    std::os::unix::fs::chown(&sock, None, Some(NOBODY)).unwrap();
    let as_nobody = |args: &[&str]| {
        let o = std::process::Command::new(rpma_tests::target_bin())
            .args(args)
            .arg("--socket")
            .arg(&sock)
            .uid(NOBODY)
            .gid(NOBODY)
            .output()
            .unwrap();
        (o.status.code(), rpma_tests::text(&o))
    };
    let (code, said) = as_nobody(&["status", "--json"]);
    assert_eq!(code, Some(0), "the group reads status: {said}");
    for args in [&["reload"][..], &["clear-failure", SUB, "1"][..]] {
        let (code, said) = as_nobody(args);
        assert_eq!(code, Some(1), "{args:?}: {said}");
        assert!(
            said.contains("changes the daemon's state: only root or the daemon's user"),
            "{args:?}: {said}"
        );
    }
    assert_eq!(t.status()["reloads"], 0, "nothing was reloaded");
}

/// A reload that gives a subsystem more namespaces than one message lists (800 more) is
/// taken, and a host reaches every one of them: its ConnectResponse lists the first and it
/// reads the rest a page at a time, each with this connection's rkey, so a durable write to
/// the last one works and is read back; the target keeps the descriptors for the session only
/// until the host has read them. (Before protocol version 7 such a reload was refused,
/// "split them between subsystems", and before that check every host of the subsystem was
/// refused "message of N bytes exceeds the maximum".)
#[test]
fn a_reload_to_more_namespaces_than_one_message_lists_serves_them_all() {
    use rpma_initiator::{Connection, HostIdentity};
    let d = scratch();
    let mut t = start(d.path(), "");
    let extra: String = (10..810)
        .map(|i| {
            format!("[[subsystem.namespace]]\nnsid = {i}\npath = \"many{i}\"\nsize = \"4KiB\"\n")
        })
        .collect();
    t.rewrite(&demo_config("", &extra));
    t.reload();
    let mut s = session(&t);
    let nsids: Vec<u32> = s.namespaces().iter().map(|d| d.nsid).collect();
    let mut want = vec![1, 3];
    want.extend(10..810);
    assert_eq!(nsids, want);
    // Read whole, the session's listing is gone from the target: asking again is an error.
    s.send_message(&rpma_common::proto::Message::NamespacesRequest(
        rpma_common::proto::NamespacesRequest { start: 0 },
    ))
    .unwrap();
    match s.wait_message(WAIT, "Disconnect") {
        Err(Error::Disconnected { reason }) => {
            assert!(reason.contains("no listing left to page"), "{reason}")
        }
        other => panic!("{:?}", other.map(|m| m.message_type())),
    }
    drop(s);
    let mut q = Connection::new(&t.url(), nqn(SUB), HostIdentity::new(nqn(PLAIN)))
        .open_queue(0)
        .unwrap();
    for nsid in [809, 400, 1] {
        let mut ns = q.namespace(nsid).unwrap();
        let data = [nsid as u8; 4096];
        assert!(ns.write_durable(0, &data).unwrap().is_durable());
        let mut got = vec![0u8; 4096];
        ns.read_at(0, &mut got).unwrap();
        assert!(got == data, "namespace {nsid}");
    }
    q.close().unwrap();
    assert_eq!(
        std::fs::read(d.path().join("many809")).unwrap()[..4096],
        [809u16 as u8; 4096]
    );
}
