//! Malformed and hostile input against the `nvme-tcp://` listener, as the hostile suite does for
//! the native wire: each malformed PDU gets its exact termination (the C2HTermReq's fatal error
//! status and information, or the command's status where the spec makes it a command error),
//! nothing is written, the connection is closed, and the daemon keeps serving. Before its Connect
//! a peer costs a bounded place, buffer, time and log.

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use rpma_tests::nvme::{
    connect_data, connect_sqe, h2c_header, icreq_pdu, pdu, sc, Controller, Error, Host, Sqe, Term,
};
use rpma_tests::{
    counted_in_summaries, summary_lines, tcp_from, Config, Namespace, Subsystem, Target,
};

const SUB: &str = "nqn.2026-11.io.rpma:hostile-nvme";
const HOST: &str = "nqn.2026-11.io.rpma:hostile-nvme-host";

/// Fatal error statuses.
const INVALID_HEADER_FIELD: u16 = 1;
const PDU_SEQUENCE: u16 = 2;
const HEADER_DIGEST: u16 = 3;
const DATA_OUT_OF_RANGE: u16 = 4;
const DATA_LIMIT_EXCEEDED: u16 = 5;
const UNSUPPORTED_PARAMETER: u16 = 6;

fn start(extra: &str) -> (tempfile::TempDir, Target, String) {
    let dir = rpma_tests::scratch();
    let cfg = Config::new()
        .set(extra)
        .subsystem(
            Subsystem::new(SUB)
                .host(HOST)
                .namespace(Namespace::new(1, "ns1", "4MiB").block_size(512)),
        )
        .to_string();
    let t = Target::start_on(dir.path(), "nvme-tcp://127.0.0.1", &cfg, &[]);
    let addr = format!("127.0.0.1:{}", t.port());
    (dir, t, addr)
}

/// The C2HTermReq the target answers `h` with, and that it closes the connection after it.
fn terminated(h: &mut Host) -> Term {
    let t = loop {
        match h.recv() {
            Err(Error::Terminated(t)) => break t,
            Ok(r) => assert!(
                r.kind == pdu::RESP || r.kind == pdu::R2T,
                "unexpected {r:?}"
            ),
            Err(e) => panic!("no C2HTermReq: {e:?}"),
        }
    };
    assert!(
        matches!(h.recv(), Err(Error::Closed(_))),
        "closed after the C2HTermReq"
    );
    t
}

/// An I/O queue of a fresh controller, with the digests asked for.
fn io(addr: &str, digests: (bool, bool)) -> (Controller, Host) {
    let c = Controller::connect(addr, SUB, HOST, digests).expect("admitted");
    let q = c.io_queue(1).expect("I/O queue");
    (c, q)
}

fn read_back(addr: &str, slba: u64) -> Vec<u8> {
    let (_c, mut q) = io(addr, (false, false));
    q.read(1, slba, 512, 8).unwrap().data
}

/// A Write command asking for `len` bytes by R2T (no data in its capsule).
fn write_by_r2t(h: &Host, cid: u16, slba: u64, len: u32) -> Vec<u8> {
    let mut s = Sqe::new(0x01, 1)
        .cdw(10, slba as u32)
        .cdw(12, len / 512 - 1)
        .u16(2, cid);
    s.0[32..36].copy_from_slice(&len.to_le_bytes());
    s.0[39] = 0x5a;
    h.frame(pdu::CMD, 0, &s.0, &[])
}

#[test]
fn a_bad_header_digest_is_terminated_and_nothing_is_written() {
    let (_d, t, addr) = start("");
    let (_c, mut q) = io(&addr, (true, true));
    let mut s = Sqe::new(0x01, 1).cdw(10, 0).cdw(12, 7).u16(2, 9);
    s.0[32..36].copy_from_slice(&4096u32.to_le_bytes());
    s.0[39] = 0x01;
    let mut p = q.frame(pdu::CMD, 0, &s.0, &[0xee; 4096]);
    p[20] ^= 0x01; // a byte of the command under the header digest
    q.send_raw(&p);
    let term = terminated(&mut q);
    assert_eq!(term.fes, HEADER_DIGEST);
    assert_eq!(&term.data[..8], &p[..8], "it carries the offending header");
    assert_eq!(read_back(&addr, 0), vec![0; 4096], "nothing written");
    let m = &t.status()["metrics"];
    assert_eq!(m["terminates"]["crc"], 1, "{m}");
}

#[test]
fn a_bad_data_digest_fails_the_command_and_nothing_lands() {
    let (_d, _t, addr) = start("");
    let (_c, mut q) = io(&addr, (false, true));
    // In the capsule.
    let mut s = Sqe::new(0x01, 1).cdw(10, 0).cdw(12, 7).u16(2, 3);
    s.0[32..36].copy_from_slice(&4096u32.to_le_bytes());
    s.0[39] = 0x01;
    let mut p = q.frame(pdu::CMD, 0, &s.0, &[0xaa; 4096]);
    let last = p.len() - 1;
    p[last] ^= 0xff;
    q.send_raw(&p);
    let c = q.complete(3, &[]).expect("a completion, not a termination");
    assert_eq!(c.code(), sc::TRANSIENT);
    assert!(!c.dnr(), "a transient transport error may be retried");
    // By R2T, the second of two H2CData PDUs corrupt: the command fails, the first half that
    // did pass its digest may have landed, the corrupt half did not.
    let p = write_by_r2t(&q, 4, 16, 8192);
    q.send_raw(&p);
    let r = q.recv().unwrap();
    assert_eq!(r.kind, pdu::R2T);
    let ttag = r.u16(10);
    let a = q.frame(
        pdu::H2C_DATA,
        0,
        &h2c_header(4, ttag, 0, 4096),
        &[0x11; 4096],
    );
    q.send_raw(&a);
    let mut b = q.frame(
        pdu::H2C_DATA,
        4,
        &h2c_header(4, ttag, 4096, 4096),
        &[0x22; 4096],
    );
    let last = b.len() - 1;
    b[last] ^= 1;
    q.send_raw(&b);
    let c = q.complete(4, &[]).unwrap();
    assert_eq!(c.code(), sc::TRANSIENT);
    // The connection goes on.
    let ok = q.read(1, 0, 512, 8).unwrap();
    assert!(ok.ok());
    assert_eq!(
        ok.data,
        vec![0; 4096],
        "the corrupt capsule's data never landed"
    );
    let back = q.read(1, 24, 512, 8).unwrap().data;
    assert_eq!(back, vec![0; 4096], "the corrupt H2CData never landed");
}

#[test]
fn h2c_data_past_maxh2cdata_or_its_r2t_or_for_no_r2t_is_terminated() {
    let (_d, _t, addr) = start("");
    // MAXH2CDATA is the largest transfer: no R2T asks for more than one PDU carries (a PDU
    // over it is past its R2T), and a 128 KiB Write's data in one H2CData PDU, as Linux hosts
    // before 5.16 send it whatever the MAXH2CDATA, is taken (it was terminated, Data Transfer
    // Limit Exceeded, at the 64 KiB offered before: such a host reconnected for ever).
    let (_c, mut q) = io(&addr, (false, false));
    assert_eq!(q.maxh2cdata, 131072);
    let p = write_by_r2t(&q, 7, 0, 131072);
    q.send_raw(&p);
    let ttag = q.recv().unwrap().u16(10);
    let p = q.frame(
        pdu::H2C_DATA,
        4,
        &h2c_header(7, ttag, 0, 131072),
        &vec![9; 131072],
    );
    q.send_raw(&p);
    let done = q.recv().unwrap();
    assert_eq!(done.kind, pdu::RESP);
    assert_eq!(read_back(&addr, 0), vec![9; 4096], "written");
    let p = write_by_r2t(&q, 8, 0, 131072);
    q.send_raw(&p);
    let ttag = q.recv().unwrap().u16(10);
    let n = q.maxh2cdata + 4;
    let p = q.frame(
        pdu::H2C_DATA,
        0,
        &h2c_header(8, ttag, 0, n),
        &vec![1; n as usize],
    );
    q.send_raw(&p);
    assert_eq!(terminated(&mut q).fes, DATA_OUT_OF_RANGE);
    assert_eq!(read_back(&addr, 0), vec![9; 4096], "nothing more written");
    // Past the R2T's range.
    let (_c, mut q) = io(&addr, (false, false));
    let p = write_by_r2t(&q, 7, 0, 4096);
    q.send_raw(&p);
    let ttag = q.recv().unwrap().u16(10);
    let p = q.frame(pdu::H2C_DATA, 4, &h2c_header(7, ttag, 0, 8192), &[1; 8192]);
    q.send_raw(&p);
    assert_eq!(terminated(&mut q).fes, DATA_OUT_OF_RANGE);
    // At an offset the R2T did not ask for.
    let (_c, mut q) = io(&addr, (false, false));
    let p = write_by_r2t(&q, 7, 0, 8192);
    q.send_raw(&p);
    let ttag = q.recv().unwrap().u16(10);
    let p = q.frame(
        pdu::H2C_DATA,
        0,
        &h2c_header(7, ttag, 4096, 4096),
        &[1; 4096],
    );
    q.send_raw(&p);
    assert_eq!(terminated(&mut q).fes, DATA_OUT_OF_RANGE);
    // Under a transfer tag it never gave.
    let (_c, mut q) = io(&addr, (false, false));
    let p = write_by_r2t(&q, 7, 0, 4096);
    q.send_raw(&p);
    let ttag = q.recv().unwrap().u16(10);
    let p = q.frame(
        pdu::H2C_DATA,
        4,
        &h2c_header(7, ttag.wrapping_add(5), 0, 4096),
        &[1; 4096],
    );
    q.send_raw(&p);
    let t = terminated(&mut q);
    assert_eq!((t.fes, t.fei), (INVALID_HEADER_FIELD, 10), "TTAG");
    // Data for a command that asked for none.
    let (_c, mut q) = io(&addr, (false, false));
    let p = q.frame(pdu::H2C_DATA, 4, &h2c_header(42, 1, 0, 512), &[1; 512]);
    q.send_raw(&p);
    let t = terminated(&mut q);
    assert_eq!((t.fes, t.fei), (INVALID_HEADER_FIELD, 8), "CCCID");
    assert_eq!(read_back(&addr, 0), vec![9; 4096], "nothing more written");
}

#[test]
fn pdus_only_a_controller_sends_are_terminated_by_type() {
    let (_d, _t, addr) = start("");
    for kind in [
        pdu::R2T,
        pdu::C2H_DATA,
        pdu::RESP,
        pdu::IC_RESP,
        pdu::C2H_TERM,
        0x0b,
    ] {
        let (_c, mut q) = io(&addr, (false, false));
        // An R2T nobody asked for (and the other controller-to-host types).
        let p = q.frame(kind, 0, &h2c_header(1, 1, 0, 512), &[]);
        q.send_raw(&p);
        let t = terminated(&mut q);
        assert_eq!((t.fes, t.fei), (INVALID_HEADER_FIELD, 0), "type {kind:#x}");
    }
}

#[test]
fn the_connection_setup_is_checked_before_anything_else() {
    let (_d, _t, addr) = start("");
    // A command before the ICReq.
    let mut h = Host::raw(Host::connect_tcp(&addr));
    let p = h.frame(pdu::CMD, 0, &Sqe::new(0x06, 0).0, &[]);
    h.send_raw(&p);
    assert_eq!(terminated(&mut h).fes, PDU_SEQUENCE);
    // An ICReq of a version it does not speak, and an alignment beyond the spec's.
    let mut h = Host::raw(Host::connect_tcp(&addr));
    h.send_raw(&icreq_pdu(1, 0, 0));
    let t = terminated(&mut h);
    assert_eq!((t.fes, t.fei), (UNSUPPORTED_PARAMETER, 8), "PFV");
    let mut h = Host::raw(Host::connect_tcp(&addr));
    h.send_raw(&icreq_pdu(0, 32, 0));
    let t = terminated(&mut h);
    assert_eq!((t.fes, t.fei), (UNSUPPORTED_PARAMETER, 10), "HPDA");
    // A second ICReq.
    let mut h = Host::icreq(Host::connect_tcp(&addr), false, false).unwrap();
    h.send_raw(&icreq_pdu(0, 0, 0));
    assert_eq!(terminated(&mut h).fes, PDU_SEQUENCE);
    // A command other than Connect first: a sequence error, then closed.
    let mut h = Host::icreq(Host::connect_tcp(&addr), false, false).unwrap();
    let c = h.command(Sqe::new(0x06, 0).cdw(10, 1), &[], 4096).unwrap();
    assert_eq!(c.code(), sc::SEQUENCE);
    assert!(matches!(h.recv(), Err(Error::Closed(_))));
    // A Connect to a subsystem that is not there: Connect Invalid Parameters, the subsystem
    // NQN's offset in the Connect data, then closed.
    let mut h = Host::icreq(Host::connect_tcp(&addr), true, true).unwrap();
    let d = connect_data([1; 16], 0xffff, "nqn.2026-11.io.rpma:unknown", HOST);
    let c = h.command(connect_sqe(0, 31, 0), &d, 0).unwrap();
    assert_eq!(
        (c.code(), c.dw0, c.dnr()),
        (sc::CONNECT_INVALID_PARAM, (1 << 16) | 256, true)
    );
    assert!(matches!(h.recv(), Err(Error::Closed(_))));
    // A capsule longer than the in-capsule limit: refused from its header.
    let mut h = Host::icreq(Host::connect_tcp(&addr), false, false).unwrap();
    let mut p = h.frame(pdu::CMD, 0, &connect_sqe(0, 31, 0).0, &[0; 16]);
    p[4..8].copy_from_slice(&(72u32 + 65536).to_le_bytes());
    h.send_raw(&p[..24]);
    assert_eq!(terminated(&mut h).fes, DATA_LIMIT_EXCEEDED);
    // The daemon keeps serving.
    let (_c, mut q) = io(&addr, (true, true));
    assert!(q.write(1, 0, 512, &[5; 512], false).unwrap().ok());
}

/// Before its Connect a peer gets one command answered: a Connect that is not accepted for any
/// reason (here a PRP data pointer, PSDT 0) is answered and the connection closed, so that a
/// peer that never reads cannot have answer after answer piled up for it (before: every such
/// Connect was answered, the connection left open).
#[test]
fn a_connect_that_is_not_accepted_closes_the_connection_after_its_answer() {
    let (_d, _t, addr) = start("");
    let mut h = Host::icreq(Host::connect_tcp(&addr), false, false).unwrap();
    let d = connect_data([1; 16], 0xffff, SUB, HOST);
    let mut two = Vec::new();
    for cid in [1u16, 2] {
        let mut s = connect_sqe(0, 31, 0).byte(1, 0).u16(2, cid);
        s.0[32..36].copy_from_slice(&(d.len() as u32).to_le_bytes());
        s.0[39] = 0x01;
        two.extend_from_slice(&h.frame(pdu::CMD, 0, &s.0, &d));
    }
    h.send_raw(&two);
    let r = h.recv().expect("the first Connect is answered");
    assert_eq!(r.kind, pdu::RESP, "{r:?}");
    let status = r.u16(22) >> 1;
    assert_eq!(status & 0x7ff, sc::INVALID_FIELD, "{r:?}");
    match h.recv() {
        Err(Error::Closed(_)) => {}
        other => panic!("closed after the first answer, got {other:?}"),
    }
    // The daemon keeps serving.
    let (_c, mut q) = io(&addr, (false, false));
    assert!(q.write(1, 0, 512, &[5; 512], false).unwrap().ok());
}

/// A Connect the target answers with an error is a refusal, whatever the error: a refused host
/// or subsystem by its reason, a malformed Connect (a PRP data pointer, data that failed its
/// digest) or a command other than the Connect before it as `protocol_error`, as on the native
/// listeners. Only a peer that goes away (or times out) before its Connect is answered is an
/// abandoned handshake (before: the malformed ones and the command before the Connect were
/// counted as abandoned, not as refusals).
#[test]
fn a_connect_answered_with_an_error_is_a_refusal_not_an_abandoned_handshake() {
    let (_d, t, addr) = start("");
    let counts = || {
        let m = t.status()["metrics"].clone();
        (m["refusals"].clone(), m["handshakes_failed"].clone())
    };
    // The target counts before it answers: each count is in once its answer came back.
    let answered_and_closed = |h: &mut Host, cid: u16, code: u16| {
        let c = h.complete(cid, &[]).expect("answered");
        assert_eq!(c.code(), code, "{c:?}");
        assert!(matches!(h.recv(), Err(Error::Closed(_))), "then closed");
    };
    // Refused by admission: a subsystem that is not there.
    let d = connect_data([1; 16], 0xffff, "nqn.2026-11.io.rpma:unknown", HOST);
    let mut h = Host::icreq(Host::connect_tcp(&addr), false, false).unwrap();
    let s = in_capsule(connect_sqe(0, 31, 0), 1, d.len());
    let p = h.frame(pdu::CMD, 0, &s.0, &d);
    h.send_raw(&p);
    answered_and_closed(&mut h, 1, sc::CONNECT_INVALID_PARAM);
    // A PRP data pointer (PSDT 0).
    let d = connect_data([1; 16], 0xffff, SUB, HOST);
    let mut h = Host::icreq(Host::connect_tcp(&addr), false, false).unwrap();
    let s = in_capsule(connect_sqe(0, 31, 0).byte(1, 0), 2, d.len());
    let p = h.frame(pdu::CMD, 0, &s.0, &d);
    h.send_raw(&p);
    answered_and_closed(&mut h, 2, sc::INVALID_FIELD);
    // Connect data that fails its digest.
    let mut h = Host::icreq(Host::connect_tcp(&addr), false, true).unwrap();
    let s = in_capsule(connect_sqe(0, 31, 0), 3, d.len());
    let mut p = h.frame(pdu::CMD, 0, &s.0, &d);
    let last = p.len() - 1;
    p[last] ^= 0xff;
    h.send_raw(&p);
    answered_and_closed(&mut h, 3, sc::TRANSIENT);
    // An Identify before the Connect.
    let mut h = Host::icreq(Host::connect_tcp(&addr), false, false).unwrap();
    let p = h.frame(pdu::CMD, 0, &Sqe::new(0x06, 0).cdw(10, 1).u16(2, 4).0, &[]);
    h.send_raw(&p);
    answered_and_closed(&mut h, 4, sc::SEQUENCE);
    let (refusals, handshakes) = counts();
    assert_eq!(refusals["unknown_subsystem"], 1, "{refusals}");
    assert_eq!(refusals["protocol_error"], 3, "{refusals}");
    assert_eq!(handshakes["abandoned"], 0, "{handshakes}");
    // A peer that goes away after its ICReq did abandon its handshake.
    drop(Host::icreq(Host::connect_tcp(&addr), false, false).unwrap());
    let deadline = Instant::now() + Duration::from_secs(10);
    while counts().1["abandoned"] == 0 {
        assert!(Instant::now() < deadline, "never counted: {}", counts().1);
        std::thread::sleep(Duration::from_millis(20));
    }
    let (refusals, handshakes) = counts();
    assert_eq!(handshakes["abandoned"], 1, "{handshakes}");
    assert_eq!(handshakes["timeout"], 0, "{handshakes}");
    assert_eq!(refusals["protocol_error"], 3, "{refusals}");
}

/// `sqe` with command id `cid` and `len` bytes of data in its capsule.
fn in_capsule(sqe: Sqe, cid: u16, len: usize) -> Sqe {
    let mut s = sqe.u16(2, cid);
    s.0[32..36].copy_from_slice(&(len as u32).to_le_bytes());
    s.0[39] = 0x01;
    s
}

#[test]
fn before_its_connect_a_peer_costs_a_bounded_place_buffer_time_and_log() {
    let (_d, t, addr) =
        start("max_unadmitted = 16\nmax_unadmitted_per_source = 2\nhandshake_timeout_ms = 3000");
    let port = t.port();
    // A source past its cap makes room by closing its own oldest (issue 22: a host's own
    // address cannot be locked out by its neighbours): the newcomer is served.
    let src = Ipv4Addr::new(127, 0, 0, 9);
    let a = tcp_from(port, src, Duration::from_secs(20));
    let b = tcp_from(port, src, Duration::from_secs(20));
    let mut c = Host::raw(tcp_from(port, src, Duration::from_secs(20)));
    c.send_raw(&icreq_pdu(0, 0, 0));
    c.recv()
        .expect("the newcomer past the per-source cap gets its ICResp");
    let mut a = Host::raw(a);
    assert!(
        matches!(a.recv(), Err(Error::Closed(_))),
        "the source's oldest is evicted"
    );
    // The others, which never Connect, are closed at the handshake deadline.
    for mut h in [Host::raw(b), c] {
        assert!(matches!(h.recv(), Err(Error::Closed(_))));
    }
    // Many half-open connections, each with a nearly whole 8 KiB capsule: the daemon's memory
    // grows by a bounded buffer each, not by what a connected queue may buffer.
    let rss = || -> u64 {
        let s = std::fs::read_to_string(format!("/proc/{}/status", t.pid())).unwrap();
        let line = s
            .lines()
            .find(|l| l.starts_with("VmRSS:"))
            .unwrap()
            .to_owned();
        line.split_whitespace()
            .nth(1)
            .unwrap()
            .parse::<u64>()
            .unwrap()
            * 1024
    };
    let before = rss();
    let first = Instant::now();
    let mut held = Vec::new();
    for i in 0..16u8 {
        let mut h = Host::raw(tcp_from(
            port,
            Ipv4Addr::new(127, 0, 1, i),
            Duration::from_secs(20),
        ));
        h.send_raw(&icreq_pdu(0, 0, 0));
        h.recv().expect("ICResp");
        let p = h.frame(pdu::CMD, 0, &connect_sqe(0, 31, 0).0, &vec![0; 8192]);
        h.send_raw(&p[..p.len() - 1]);
        held.push(h);
    }
    let st = t.status();
    // All 16 are held, when the status came back before the first one's handshake deadline
    // (on a loaded machine the first may already be closed; never more than 16).
    let held_now = st["admission"]["unadmitted"]["held"].as_u64().unwrap();
    if first.elapsed() < Duration::from_secs(3) {
        assert_eq!(held_now, 16, "{}", st["admission"]);
    }
    assert!(held_now <= 16, "{}", st["admission"]);
    let grown = rss().saturating_sub(before);
    assert!(
        grown < 16 * 48 * 1024,
        "16 half-open connections grew the daemon by {grown} bytes"
    );
    // A 17th evicts the oldest (the pool is full), which is closed.
    let mut newest = Host::raw(tcp_from(
        port,
        Ipv4Addr::new(127, 0, 2, 1),
        Duration::from_secs(20),
    ));
    newest.send_raw(&icreq_pdu(0, 0, 0));
    newest.recv().expect("ICResp");
    assert!(
        matches!(held[0].recv(), Err(Error::Closed(_))),
        "the oldest was evicted"
    );
    // The allowed host still gets in, with the pool full of strangers.
    let (_c, mut q) = io(&addr, (false, false));
    assert!(q.read(1, 0, 512, 1).unwrap().ok());
    // 20 broken peers from one address: one WARN line for them in the period.
    let src = Ipv4Addr::new(127, 0, 3, 1);
    for _ in 0..20 {
        let mut h = Host::raw(tcp_from(port, src, Duration::from_secs(20)));
        h.send_raw(&[0xff; 8]);
        let _ = h.recv();
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while t.status()["metrics"]["terminates"]["invalid_request"].as_u64() < Some(20) {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(20));
    }
    let warned = t
        .log()
        .lines()
        .filter(|l| l.contains("WARN") && l.contains("127.0.3.1"))
        .count();
    assert_eq!(warned, 1, "rate-limited per address");
    let m = &t.status()["metrics"];
    assert!(m["handshakes_failed"]["timeout"].as_u64() >= Some(2), "{m}");
    // The source past its cap and the 17th each evicted one.
    let evicted = t.status()["admission"]["unadmitted"]["evicted"].as_u64();
    assert!(evicted >= Some(2), "{}", t.status()["admission"]);
}

/// One address cycling controllers as fast as it can: their lines (admitted, ended) are the
/// target's session lines, within the per-address budget each period, the rest counted by
/// summary lines at INFO, as on the native wire (before: two INFO lines per controller, as
/// many as the peer made).
#[test]
fn cycling_controllers_writes_a_bounded_log() {
    let period = Duration::from_secs(2);
    let (_d, t, addr) = start(&format!("refusal_log_period_ms = {}", period.as_millis()));
    let log0 = t.log().len();
    let n: u64 = 300;
    let started = Instant::now();
    for _ in 0..n {
        let c = Controller::connect(&addr, SUB, HOST, (false, false)).expect("admitted");
        drop(c);
    }
    let is_session_line = |l: &&str| {
        l.contains("nvme-tcp controller") && (l.contains(" admitted: ") || l.contains(" ended: "))
    };
    // Every controller's two lines are logged or counted (a summary comes a period after the
    // first line it counts).
    let deadline = Instant::now() + Duration::from_secs(60) + period;
    let log = loop {
        let log = t.log();
        let new = &log[log0..];
        let logged = new.lines().filter(is_session_line).count() as u64;
        if logged + counted_in_summaries(new) == 2 * n {
            break log;
        }
        assert!(
            Instant::now() < deadline,
            "logged {logged} + counted {} of {}",
            counted_in_summaries(new),
            2 * n
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let new = &log[log0..];
    let periods = (started.elapsed().as_millis() / period.as_millis()) as usize + 1;
    let logged = new.lines().filter(is_session_line).count();
    assert!(
        logged <= periods * 20 && logged >= 2,
        "{logged} controller lines in {periods} period(s)"
    );
    let summaries: Vec<&str> = summary_lines(new).collect();
    assert!(
        !summaries.is_empty() && summaries.iter().all(|l| l.contains(" INFO ")),
        "{summaries:?}"
    );
}

/// CPU clock ticks (utime + stime) of the target's NVMe/TCP poll loops (threads `rpma-nvme-N`;
/// the accept threads' names, `rpma-nvme-accept-PORT`, are cut to `rpma-nvme-accep`).
fn poll_loop_ticks(pid: u32) -> u64 {
    let mut total = 0;
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let path = task.unwrap().path();
        let comm = std::fs::read_to_string(path.join("comm")).unwrap_or_default();
        if !comm.starts_with("rpma-nvme-") || comm.starts_with("rpma-nvme-acc") {
            continue;
        }
        let Ok(stat) = std::fs::read_to_string(path.join("stat")) else {
            continue; // a thread that just ended
        };
        // Fields after the name (in parentheses): utime is field 14, stime 15.
        let rest = &stat[stat.rfind(')').unwrap() + 2..];
        let f: Vec<&str> = rest.split_whitespace().collect();
        total += f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap();
    }
    total
}

/// Bytes waiting to be read on `h`'s socket.
fn unread(h: &Host) -> usize {
    use std::os::fd::AsRawFd;
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD writes one int into `n`, which outlives the call.
    let r = unsafe { libc::ioctl(h.stream().as_raw_fd(), libc::FIONREAD, &mut n) };
    assert_eq!(r, 0, "FIONREAD: {}", std::io::Error::last_os_error());
    n as usize
}

/// Sends `commands` (framed by `h`) at once and reads none of their answers: returns once the
/// target has stopped sending them (its answers fill the sockets and its own backlog, and it
/// stops reading commands past 256 KiB waiting).
fn send_and_read_nothing(h: &mut Host, commands: &[Sqe]) {
    let mut burst = Vec::new();
    for s in commands {
        burst.extend_from_slice(&h.frame(pdu::CMD, 0, &s.0, &[]));
    }
    h.send_raw(&burst);
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut last = unread(h);
    loop {
        std::thread::sleep(Duration::from_millis(300));
        let now = unread(h);
        if now == last {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the target never stopped answering"
        );
        last = now;
    }
}

/// The target's NVMe/TCP poll loops' CPU ticks over two seconds in which nothing is asked of
/// them: a sleeping loop shows 0 (1 for a tick charged to it); a spinning one, on any machine
/// that ran it at all, a good part of 200.
fn idle_ticks(t: &Target) -> u64 {
    std::thread::sleep(Duration::from_millis(200));
    let before = poll_loop_ticks(t.pid());
    std::thread::sleep(Duration::from_secs(2));
    poll_loop_ticks(t.pid()) - before
}

/// A discovery controller (which any host may open) of a host NQN no subsystem lists, its
/// admin queue of `sqsize` + 1 entries, host identifier all `hostid`.
fn discovery_controller(addr: &str, sqsize: u16, hostid: u8) -> Host {
    let mut h = Host::icreq(Host::connect_tcp(addr), false, false).unwrap();
    let c = h
        .command(
            connect_sqe(0, sqsize, 0),
            &connect_data(
                [hostid; 16],
                0xffff,
                rpma_tests::nvme::DISCOVERY_NQN,
                "nqn.2026-11.io.rpma:stranger",
            ),
            0,
        )
        .unwrap();
    assert!(c.ok(), "a discovery controller for anyone: {c:?}");
    h
}

/// A host that stops reading its answers (the queue stops reading past 256 KiB waiting) and
/// then half-closes its side costs its poll loop nothing: the half-close is watched only with
/// the reads. Before, it stayed in the epoll interest, and being level-triggered it woke every
/// wait at once: the loop spun at a whole CPU until the controller's keep-alive ran out, an hour
/// at most, and for any peer through a discovery controller (no host list) until the discovery
/// time limit.
#[test]
fn a_peer_that_half_closes_without_reading_its_answers_does_not_spin_its_loop() {
    let (_d, t, addr) = start("");
    // Through a discovery controller, which any host may open: its 128 KiB log page a thousand
    // times.
    let mut h = discovery_controller(&addr, 31, 2);
    let enable = Sqe::fabrics(0x00)
        .u32(44, 0x14)
        .u32(48, rpma_tests::nvme::CC_ENABLE);
    assert!(h.command(enable, &[], 0).unwrap().ok());
    let numd = 128 * 1024 / 4 - 1;
    let logs: Vec<Sqe> = (1..=1000u16)
        .map(|cid| {
            let mut s = Sqe::new(0x02, 0)
                .cdw(10, 0x70 | ((numd & 0xffff) << 16))
                .u16(2, cid);
            s.0[32..36].copy_from_slice(&(128u32 * 1024).to_le_bytes());
            s.0[39] = 0x5a;
            s
        })
        .collect();
    send_and_read_nothing(&mut h, &logs);
    h.stream().shutdown(std::net::Shutdown::Write).unwrap();
    let spun = idle_ticks(&t);
    eprintln!("a discovery peer half-closed: the poll loops used {spun} tick(s) in 2 s");
    assert!(spun <= 5, "the poll loops used {spun} ticks in 2 s");

    // The same through an admitted controller's I/O queue: 600 Reads of 128 KiB.
    let c = Controller::connect_kato(&addr, SUB, HOST, (false, false), 600_000).expect("admitted");
    let mut q = c.io_queue(1).expect("I/O queue");
    let reads: Vec<Sqe> = (1..=600u16)
        .map(|cid| {
            let mut s = Sqe::new(0x02, 1).cdw(10, 0).cdw(12, 255).u16(2, cid);
            s.0[32..36].copy_from_slice(&(128u32 * 1024).to_le_bytes());
            s.0[39] = 0x5a;
            s
        })
        .collect();
    send_and_read_nothing(&mut q, &reads);
    q.stream().shutdown(std::net::Shutdown::Write).unwrap();
    let spun = idle_ticks(&t);
    eprintln!("an I/O queue half-closed: the poll loops used {spun} tick(s) in 2 s");
    assert!(spun <= 5, "the poll loops used {spun} ticks in 2 s");
    // The daemon serves on.
    assert_eq!(read_back(&addr, 0).len(), 4096);
}

/// A host that stops reading its answers, reads a few, and stops again costs its poll loop
/// nothing once the target stopped answering. Before, the few it read let the target's backlog
/// fall back under its high mark while its receive buffer stayed full of commands, which it
/// handled only once the socket took every byte: its readable socket woke every wait and nothing
/// was read, the loop spinning at a whole CPU until the host read again.
#[test]
fn a_host_that_stops_reading_its_answers_does_not_spin_its_loop() {
    let (_d, t, addr) = start("");
    let c = Controller::connect_kato(&addr, SUB, HOST, (false, false), 600_000).expect("admitted");
    let mut q = c.io_queue(1).expect("I/O queue");
    // 128 KiB Reads, far more than the socket buffers and the backlog hold.
    let reads: Vec<Sqe> = (0..600u16)
        .map(|i| {
            let mut s = Sqe::new(0x02, 1)
                .cdw(10, 0)
                .cdw(12, 255)
                .u16(2, i % 100 + 1);
            s.0[32..36].copy_from_slice(&(128u32 * 1024).to_le_bytes());
            s.0[39] = 0x5a;
            s
        })
        .collect();
    send_and_read_nothing(&mut q, &reads);
    // Two answers (their data and completions) read: the target sends some more, then the
    // socket is full again.
    let mut answered = 0;
    for _ in 0..4 {
        if q.recv().expect("an answer").kind == pdu::RESP {
            answered += 1;
        }
    }
    let spun = idle_ticks(&t);
    eprintln!("a host reading little: the poll loops used {spun} tick(s) in 2 s");
    assert!(spun <= 5, "the poll loops used {spun} ticks in 2 s");
    // The daemon serves on, and so does the queue once its host reads again.
    assert_eq!(read_back(&addr, 0).len(), 4096);
    while answered < reads.len() {
        if q.recv().expect("the rest of the answers").kind == pdu::RESP {
            answered += 1;
        }
    }
}

/// A RESP's command identifier and status code (SCT << 8 | SC).
fn resp_of(r: &rpma_tests::nvme::Rx) -> (u16, u16) {
    assert_eq!(r.kind, pdu::RESP, "{r:?}");
    (r.u16(8 + 12), (r.u16(8 + 14) >> 1) & 0x7ff)
}

/// Only a Connect and a Dataset Management have their data fetched by R2T (and buffered), and a
/// queue buffers at most four commands' data at a time; any other command runs at once without
/// its data (none reads it). Before, every command whose opcode says "data to the controller"
/// was given an R2T and an 8 KiB buffer, as many as the queue had entries, on any queue: through
/// a discovery controller, which any host may open, 4 connections of 4,096 entries took the
/// target from 13 to 149 MiB.
#[test]
fn only_commands_that_read_data_have_it_fetched_and_few_at_a_time() {
    let (_d, _t, addr) = start("");
    // A discovery controller: 64 Set Features asking for 8 KiB each by R2T.
    let mut h = discovery_controller(&addr, 127, 3);
    let mut burst = Vec::new();
    for cid in 1..=64u16 {
        let mut s = Sqe::new(0x09, 0).cdw(10, 0x81).u16(2, cid);
        s.0[32..36].copy_from_slice(&8192u32.to_le_bytes());
        s.0[39] = 0x5a;
        burst.extend_from_slice(&h.frame(pdu::CMD, 0, &s.0, &[]));
    }
    h.send_raw(&burst);
    let mut answered = std::collections::BTreeSet::new();
    for _ in 0..64 {
        let r = h.recv().expect("an answer");
        let (cid, status) = resp_of(&r);
        assert_ne!(status, 0, "Set Features with data is not supported");
        answered.insert(cid);
    }
    assert_eq!(
        answered.len(),
        64,
        "each answered at once, none given an R2T"
    );

    // Dataset Management by R2T on an I/O queue: four at a time; more are answered with a
    // retryable status; one longer than 256 ranges is refused.
    let (_c, mut q) = io(&addr, (false, false));
    let dsm = |cid: u16, len: u32| {
        // One range (NR 0), deallocate (AD).
        let mut s = Sqe::new(0x09, 1).cdw(10, 0).cdw(11, 1 << 2).u16(2, cid);
        s.0[32..36].copy_from_slice(&len.to_le_bytes());
        s.0[39] = 0x5a;
        s
    };
    let mut burst = Vec::new();
    for cid in 1..=6u16 {
        burst.extend_from_slice(&q.frame(pdu::CMD, 0, &dsm(cid, 16).0, &[]));
    }
    q.send_raw(&burst);
    let mut r2ts = Vec::new();
    let mut retry = Vec::new();
    for _ in 0..6 {
        let r = q.recv().expect("an R2T or an answer");
        if r.kind == pdu::R2T {
            r2ts.push((r.u16(8), r.u16(10)));
        } else {
            let (cid, status) = resp_of(&r);
            assert_eq!(status, sc::TRANSIENT, "command {cid}");
            retry.push(cid);
        }
    }
    assert_eq!(r2ts.len(), 4, "{r2ts:?} {retry:?}");
    assert_eq!(retry, vec![5, 6]);
    // Their data (one range: 8 blocks at LBA 0): each ends well.
    for (cid, ttag) in r2ts {
        let mut range = [0u8; 16];
        range[4..8].copy_from_slice(&8u32.to_le_bytes());
        let p = q.frame(pdu::H2C_DATA, 4, &h2c_header(cid, ttag, 0, 16), &range);
        q.send_raw(&p);
        let (got, status) = resp_of(&q.recv().expect("its answer"));
        assert_eq!((got, status), (cid, 0));
    }
    let p = q.frame(pdu::CMD, 0, &dsm(7, 8192).0, &[]);
    q.send_raw(&p);
    assert_eq!(resp_of(&q.recv().unwrap()), (7, sc::SGL_LENGTH));
}
