//! The `nvme-tcp://` listener of a real `rpma-target`, driven by the tests' own NVMe/TCP host
//! (tests/src/nvme.rs) over loopback: ICReq negotiation, Connect allowed and refused, Identify,
//! the discovery log, reads and writes and their durability commands, queue rules, reloads
//! and asynchronous events, keep-alive, shutdown.

use std::time::{Duration, Instant};

use rpma_tests::nvme::{sc, Completion, Controller, Host, Sqe, DISCOVERY_NQN};
use rpma_tests::{Config, Namespace, Shm, Subsystem, Target};

const SUB: &str = "nqn.2026-11.io.rpma:nvme";
const DAX: &str = "nqn.2026-11.io.rpma:nvme-dax";
const HOST: &str = "nqn.2026-11.io.rpma:nvme-host";
const OTHER: &str = "nqn.2026-11.io.rpma:nvme-stranger";

/// nsid 1 page-cache 8 MiB (512-byte blocks), 2 read-only 1 MiB, 3 volatile 1 MiB; and an
/// all-dax (forced) subsystem.
fn config(shm: &Shm) -> Config {
    config_of(shm, Some(Namespace::new(1, "ns1", "8MiB").block_size(512)))
}

/// [`config`], with `ns1` as SUB's nsid 1 (None: SUB has no nsid 1).
fn config_of(shm: &Shm, ns1: Option<Namespace>) -> Config {
    let rest = [
        Namespace::new(2, "ns2", "1MiB").read_only(),
        Namespace::new(3, shm.path(), "1MiB"),
    ];
    Config::new()
        .subsystem(
            Subsystem::new(SUB)
                .host(HOST)
                .namespaces(ns1.into_iter().chain(rest)),
        )
        .subsystem(
            Subsystem::new(DAX)
                .host(HOST)
                .namespace(Namespace::new(1, "dax1", "2MiB").force_dax()),
        )
}

fn start(tag: &str) -> (tempfile::TempDir, Shm, Target, String) {
    let dir = rpma_tests::scratch();
    let shm = Shm::new(tag);
    let t = Target::start_on(
        dir.path(),
        "nvme-tcp://127.0.0.1",
        &config(&shm).to_string(),
        &[],
    );
    let addr = format!("127.0.0.1:{}", t.port());
    (dir, shm, t, addr)
}

fn noise(seed: u64, len: usize) -> Vec<u8> {
    rpma_tests::noise(seed, len)
}

fn ok(c: Completion) -> Completion {
    assert!(c.ok(), "{c:?}");
    c
}

#[test]
fn every_digest_combination_negotiates_and_carries_io() {
    let (_d, _s, _t, addr) = start("nvme-digests");
    for digests in [(false, false), (true, false), (false, true), (true, true)] {
        let mut c = Controller::connect(&addr, SUB, HOST, digests).expect("admitted");
        let n = ok(c.set_features(0x07, 1 | (1 << 16)));
        assert_eq!(n.dw0, 1 | (1 << 16), "two I/O queues granted");
        let mut q = c.io_queue(1).expect("I/O queue");
        // In the capsule, by R2T (one PDU), by R2T over several H2CData PDUs (128 KiB, MDTS).
        for (slba, len) in [(0u64, 4096usize), (64, 32768), (1024, 131072)] {
            let data = noise(slba + u64::from(digests.0) * 2 + u64::from(digests.1), len);
            ok(q.write(1, slba, 512, &data, false).unwrap());
            let r = ok(q.read(1, slba, 512, (len / 512) as u32).unwrap());
            assert_eq!(r.data, data, "{digests:?} {len}");
        }
        // Above MDTS: refused, not served.
        let big = q.read(1, 0, 512, 257).unwrap();
        assert_eq!(big.code(), sc::INVALID_FIELD);
    }
}

#[test]
fn connect_admits_the_listed_host_and_refuses_the_others_with_their_status() {
    let dir = rpma_tests::scratch();
    let psk = dir.path().join("k.psk");
    rpma_tests::write_psk(&psk, "21");
    let cfg = Config::new()
        .subsystem(
            Subsystem::new(SUB)
                .host(HOST)
                .keyed_host("nqn.2026-11.io.rpma:keyed", psk.to_str().unwrap())
                .namespace(Namespace::new(1, "ns1", "1MiB")),
        )
        .to_string();
    let t = Target::start_on(dir.path(), "nvme-tcp://127.0.0.1", &cfg, &[]);
    let addr = format!("127.0.0.1:{}", t.port());
    let c = Controller::connect(&addr, SUB, HOST, (false, false)).expect("admitted");
    assert_ne!(c.cntlid, 0);
    let refused = |sub: &str, host: &str| {
        let e = Controller::connect(&addr, sub, host, (false, false)).expect_err("refused");
        assert!(e.dnr(), "{e:?}");
        e
    };
    let e = refused(SUB, "nqn.2026-11.io.rpma:keyed");
    assert_eq!(e.code(), sc::AUTH_REQUIRED, "no DH-HMAC-CHAP: refused");
    let e = refused(SUB, OTHER);
    assert_eq!(
        (e.code(), e.dw0),
        (sc::CONNECT_INVALID_HOST, (1 << 16) | 512)
    );
    let e = refused("nqn.2026-11.io.rpma:nowhere", HOST);
    assert_eq!(
        (e.code(), e.dw0),
        (sc::CONNECT_INVALID_PARAM, (1 << 16) | 256)
    );
    // A refused connection is closed after its completion.
    let mut h = Host::icreq(Host::connect_tcp(&addr), false, false).unwrap();
    let data = rpma_tests::nvme::connect_data([1; 16], 0xffff, SUB, OTHER);
    let r = h
        .command(rpma_tests::nvme::connect_sqe(0, 31, 0), &data, 0)
        .unwrap();
    assert_eq!(r.code(), sc::CONNECT_INVALID_HOST);
    assert!(matches!(h.recv(), Err(rpma_tests::nvme::Error::Closed(_))));
    let lines = t.log_lines(&["nvme-tcp Connect refused"], Duration::from_secs(10));
    assert!(
        lines[0].contains("keyed") && lines[0].contains("DH-HMAC-CHAP"),
        "the refusal says why: {lines:?}"
    );
    // Refusals from one address are logged once per period: the others are counted.
    assert_eq!(lines.len(), 1, "{lines:?}");
    let m = &t.status()["metrics"];
    assert_eq!(m["refusals"]["host_not_allowed"], 2);
    assert_eq!(m["refusals"]["unknown_subsystem"], 1);
    assert_eq!(m["refusals"]["auth_failed"], 1);
    assert_eq!(m["sessions_admitted"], 1);
}

#[test]
fn identify_reports_the_controller_and_its_namespaces() {
    let (_d, _s, mut t, addr) = start("nvme-identify");
    let mut c = Controller::connect(&addr, SUB, HOST, (false, false)).unwrap();
    let id = ok(c.identify(1, 0)).data;
    assert_eq!(id.len(), 4096);
    assert_eq!(u16::from_le_bytes([id[78], id[79]]), c.cntlid, "CNTLID");
    assert_eq!(
        id[525] & 1,
        1,
        "VWC: page-cache and volatile namespaces have a write cache"
    );
    assert_eq!(&id[768..768 + SUB.len()], SUB.as_bytes());
    assert_eq!(id[111], 1, "an I/O controller");
    let serial = id[4..24].to_vec();
    let ns1 = ok(c.identify(0, 1)).data;
    let blocks = u64::from_le_bytes(ns1[0..8].try_into().unwrap());
    assert_eq!(blocks, (8 << 20) / 512);
    assert_eq!(
        (u32::from_le_bytes(ns1[128..132].try_into().unwrap()) >> 16) & 0xff,
        9
    );
    let ns2 = ok(c.identify(0, 2)).data;
    assert_eq!(
        u64::from_le_bytes(ns2[0..8].try_into().unwrap()),
        (1 << 20) / 4096
    );
    assert_eq!(ns2[99], 1, "read-only: write protected");
    let list = ok(c.identify(2, 0)).data;
    let ids: Vec<u32> = list
        .chunks(4)
        .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
        .take_while(|&n| n != 0)
        .collect();
    assert_eq!(ids, [1, 2, 3]);
    let desc = ok(c.identify(3, 1)).data;
    assert_eq!((desc[0], desc[1]), (2, 16), "NGUID");
    let nguid = desc[4..20].to_vec();
    assert_eq!(
        &ns1[104..120],
        &nguid[..],
        "the same NGUID in Identify Namespace"
    );
    assert_eq!(
        c.identify(0, 9).data,
        vec![0; 4096],
        "an inactive id reads zeroed"
    );
    assert_eq!(c.identify(3, 9).code(), sc::INVALID_NS);
    assert_eq!(c.identify(0x1f, 0).code(), sc::INVALID_FIELD);
    // The all-dax subsystem: no volatile write cache (every write is durable at completion).
    let mut d = Controller::connect(&addr, DAX, HOST, (false, false)).unwrap();
    assert_eq!(ok(d.identify(1, 0)).data[525] & 1, 0, "VWC 0 on dax");
    drop((c, d));
    // Stable across a restart: the host must recognise its namespaces when it reconnects.
    t.restart();
    let addr = format!("127.0.0.1:{}", t.port());
    let mut c = Controller::connect(&addr, SUB, HOST, (true, true)).unwrap();
    assert_eq!(&ok(c.identify(3, 1)).data[4..20], &nguid[..]);
    assert_eq!(&ok(c.identify(1, 0)).data[4..24], &serial[..]);
}

/// What a host knows a namespace by: the NGUID of Identify Namespace and the Namespace
/// Identification Descriptor list (NGUID, UUID, command set), read on a new controller.
fn namespace_ids(addr: &str) -> (Vec<u8>, Vec<u8>) {
    let mut c = Controller::connect(addr, SUB, HOST, (false, false)).unwrap();
    let nguid = ok(c.identify(0, 1)).data[104..120].to_vec();
    let desc = ok(c.identify(3, 1)).data;
    assert_eq!(
        (desc[0], desc[1], &desc[4..20]),
        (2, 16, &nguid[..]),
        "NGUID"
    );
    assert_eq!((desc[20], desc[21]), (3, 16), "UUID");
    (nguid, desc)
}

/// A namespace's NGUID and UUID follow its file, not its path: a restart on the same file
/// keeps them (a reconnecting host keeps its block device), another file moved into place at
/// the path (a restored copy: another inode) gets others, across a restart or a reload, so
/// the host takes it for another namespace and none of its Flushes of the new file vouches
/// for writes that went to the old one. (Before: hashed from the path, they stayed the same.)
#[test]
fn another_file_at_the_namespace_path_is_another_namespace_to_the_host() {
    use std::os::unix::fs::MetadataExt;
    let (d, _s, mut t, addr) = start("nvme-ids");
    let ns1 = d.path().join("ns1");
    let first = namespace_ids(&addr);
    t.restart();
    assert_eq!(namespace_ids(&addr), first, "a restart on the same file");
    // Stopped, a copy of the file moved over it, started again.
    t.kill9();
    let ino = std::fs::metadata(&ns1).unwrap().ino();
    std::fs::copy(&ns1, d.path().join("ns1.copy")).unwrap();
    std::fs::rename(d.path().join("ns1.copy"), &ns1).unwrap();
    assert_ne!(std::fs::metadata(&ns1).unwrap().ino(), ino, "another inode");
    t.restart();
    let second = namespace_ids(&addr);
    assert_ne!(second.0, first.0, "another file, another NGUID");
    assert_ne!(second.1[24..40], first.1[24..40], "and another UUID");
    // The same while running: a reload that finds another file there.
    std::fs::copy(&ns1, d.path().join("ns1.copy")).unwrap();
    std::fs::rename(d.path().join("ns1.copy"), &ns1).unwrap();
    t.reload();
    let third = namespace_ids(&addr);
    assert_ne!(third.0, second.0, "a reload that mapped another file");
    assert_ne!(third.0, first.0);
}

#[test]
fn reads_writes_and_every_durability_command() {
    let (_d, _s, t, addr) = start("nvme-io");
    let mut c = Controller::connect(&addr, SUB, HOST, (false, false)).unwrap();
    ok(c.set_features(0x07, 0));
    let mut q = c.io_queue(1).unwrap();
    let a = noise(1, 8192);
    ok(q.write(1, 16, 512, &a, false).unwrap());
    ok(q.flush(1).unwrap());
    ok(q.write(1, 32, 512, &a, true).unwrap());
    assert_eq!(ok(q.read(1, 32, 512, 16).unwrap()).data, a);
    // Write Zeroes over blocks 16..24 (FUA), then Dataset Management deallocate of 32..40.
    let wz = Sqe::new(0x08, 1).cdw(10, 16).cdw(12, 7 | (1 << 30));
    ok(q.command(wz, &[], 0).unwrap());
    let mut range = vec![0u8; 16];
    range[4..8].copy_from_slice(&8u32.to_le_bytes());
    range[8..16].copy_from_slice(&32u64.to_le_bytes());
    let dsm = Sqe::new(0x09, 1).cdw(10, 0).cdw(11, 1 << 2);
    ok(q.command(dsm, &range, 0).unwrap());
    let back = ok(q.read(1, 16, 512, 32).unwrap()).data;
    assert_eq!(&back[..4096], &[0u8; 4096][..], "zeroed");
    assert_eq!(&back[4096..8192], &a[4096..], "not zeroed");
    assert_eq!(
        &back[8192..12288],
        &[0u8; 4096][..],
        "deallocated reads zeros"
    );
    assert_eq!(&back[12288..], &a[4096..]);
    // Refusals: out of range, read-only, no such namespace, an opcode it does not have.
    assert_eq!(
        q.read(1, (8 << 20) / 512 - 1, 512, 2).unwrap().code(),
        sc::LBA_RANGE
    );
    let w = q.write(2, 0, 4096, &[1; 4096], false).unwrap();
    assert_eq!(w.code(), sc::WRITE_PROTECTED);
    assert_eq!(q.read(7, 0, 512, 1).unwrap().code(), sc::INVALID_NS);
    assert_eq!(
        q.command(Sqe::new(0x05, 1), &[], 0).unwrap().code(),
        sc::INVALID_OPCODE
    );
    // The volatile namespace: Flush and FUA succeed (visible only, as documented).
    ok(q.write(3, 0, 4096, &a[..4096], true).unwrap());
    ok(q.flush(3).unwrap());
    // Every namespace at once.
    ok(q.flush(0xffff_ffff).unwrap());
    // status counts what the session did, per namespace.
    let st = t.status();
    let s = st["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["kind"] == "nvme-tcp")
        .expect("the controller is listed")
        .clone();
    assert_eq!(s["host_nqn"], HOST);
    let ns1 = s["namespaces"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["nsid"] == 1)
        .unwrap()["data"]
        .clone();
    assert_eq!(ns1["writes"], 3, "two writes and the Write Zeroes");
    assert_eq!(
        ns1["durability"]["flush"]["ok"], 4,
        "Flush, FUA write, FUA Write Zeroes, the Flush of every namespace"
    );
    assert!(ns1["reads"].as_u64().unwrap() >= 2);
}

#[test]
fn io_queues_only_for_their_own_controller_and_granted_ids() {
    let (_d, _s, _t, addr) = start("nvme-queues");
    let mut c = Controller::connect(&addr, SUB, HOST, (false, false)).unwrap();
    ok(c.set_features(0x07, 1 | (1 << 16)));
    let _q1 = c.io_queue(1).unwrap();
    let e = c.io_queue(1).expect_err("twice");
    assert_eq!((e.code(), e.dw0), (sc::CONNECT_INVALID_PARAM, 42));
    let e = c.io_queue(3).expect_err("not granted");
    assert_eq!((e.code(), e.dw0), (sc::CONNECT_INVALID_PARAM, 42));
    let mut other = Controller::connect(&addr, SUB, HOST, (false, false)).unwrap();
    other.host_id = [9; 16];
    other.cntlid = c.cntlid;
    let e = other.io_queue(2).expect_err("another host id");
    assert_eq!(
        (e.code(), e.dw0),
        (sc::CONNECT_INVALID_PARAM, (1 << 16) | 16)
    );
    // An I/O command on the admin queue, an admin command on an I/O queue.
    let mut q2 = c.io_queue(2).unwrap();
    assert_eq!(
        q2.command(Sqe::new(0x06, 0).cdw(10, 1), &[], 4096)
            .unwrap()
            .code(),
        sc::INVALID_OPCODE
    );
    assert_eq!(
        c.admin
            .command(Sqe::new(0x02, 1).cdw(12, 0), &[], 512)
            .unwrap()
            .code(),
        sc::SGL_LENGTH,
        "Get Log Page with a length that is not the SGL's"
    );
}

#[test]
fn discovery_lists_what_the_host_may_reach() {
    let (_d, _s, _t, addr) = start("nvme-discovery");
    let mut d = Controller::connect(&addr, DISCOVERY_NQN, OTHER, (false, false)).unwrap();
    let head = ok(d.get_log(0x70, 1024, 0)).data;
    assert_eq!(
        u64::from_le_bytes(head[8..16].try_into().unwrap()),
        1,
        "a stranger sees only discovery"
    );
    let mut d = Controller::connect(&addr, DISCOVERY_NQN, HOST, (false, false)).unwrap();
    let head = ok(d.get_log(0x70, 1024, 0)).data;
    let n = u64::from_le_bytes(head[8..16].try_into().unwrap()) as u32;
    assert_eq!(n, 3, "discovery, and both subsystems that list the host");
    let all = ok(d.get_log(0x70, 1024 * (n + 1), 0)).data;
    let subs: Vec<String> = (1..=n as usize)
        .map(|i| {
            let r = &all[i * 1024..(i + 1) * 1024];
            assert_eq!(r[0], 3, "TCP");
            let port = String::from_utf8_lossy(&r[32..64])
                .trim_end_matches('\0')
                .to_owned();
            assert_eq!(port, addr.rsplit(':').next().unwrap());
            String::from_utf8_lossy(&r[256..512])
                .trim_end_matches('\0')
                .to_owned()
        })
        .collect();
    assert_eq!(subs, [DISCOVERY_NQN, SUB, DAX]);
    // An offset inside the page, and one past it.
    assert_eq!(ok(d.get_log(0x70, 1024, 1024)).data, all[1024..2048]);
    assert_eq!(d.get_log(0x70, 1024, 1 << 20).code(), sc::INVALID_FIELD);
    // Past the page's end, zeros, up to 128 KiB; a longer read is refused (16 MiB was answered,
    // a buffer that size held per discovery connection until the host read it).
    let big = ok(d.get_log(0x70, 128 << 10, 0)).data;
    assert_eq!(big[..all.len()], all[..]);
    assert!(big[all.len()..].iter().all(|&b| b == 0));
    assert_eq!(d.get_log(0x70, 16 << 20, 0).code(), sc::INVALID_FIELD);
    assert_eq!(
        d.get_log(0x70, (128 << 10) + 4, 0).code(),
        sc::INVALID_FIELD
    );
    // A discovery controller answers nothing an I/O controller does.
    assert_eq!(d.identify(0, 1).code(), sc::INVALID_FIELD);
    assert_eq!(d.get_log(0x02, 512, 0).code(), 0x109, "Invalid Log Page");
}

#[test]
fn a_reload_that_adds_a_namespace_completes_the_held_event_request() {
    let (_d, shm, t, addr) = start("nvme-aen");
    let mut c = Controller::connect(&addr, SUB, HOST, (false, false)).unwrap();
    ok(c.set_features(0x0b, 1 << 8));
    // An Asynchronous Event Request is held: no completion comes until something happens.
    let aer = Sqe::new(0x0c, 0).u16(2, 4000);
    let mut pdu = aer;
    pdu.0[39] = 0x5a;
    let p = c.admin.frame(rpma_tests::nvme::pdu::CMD, 0, &pdu.0, &[]);
    c.admin.send_raw(&p);
    // A Keep Alive answered meanwhile shows the AER did not complete.
    let ka = ok(c.admin.command(Sqe::new(0x18, 0), &[], 0).unwrap());
    assert_eq!(ka.dw0, 0);
    let cfg = config(&shm).subsystem(
        Subsystem::new("nqn.2026-11.io.rpma:unrelated")
            .host(HOST)
            .namespace(Namespace::new(1, "u1", "1MiB")),
    );
    let text = cfg
        .to_string()
        .replace(
            "[[subsystem.namespace]]\nnsid = 3",
            "[[subsystem.namespace]]\nnsid = 4\npath = \"ns4\"\nsize = \"1MiB\"\n[[subsystem.namespace]]\nnsid = 3",
        );
    t.rewrite(&text);
    let mut t = t;
    t.reload();
    let done = c
        .admin
        .complete(4000, &[])
        .expect("the event request completes");
    assert_eq!(
        done.dw0, 0x0004_0002,
        "namespace attribute changed, log page 04h"
    );
    let changed = ok(c.get_log(0x04, 4096, 0)).data;
    assert_eq!(u32::from_le_bytes(changed[0..4].try_into().unwrap()), 4);
    assert_eq!(u32::from_le_bytes(changed[4..8].try_into().unwrap()), 0);
    let list = ok(c.identify(2, 0)).data;
    assert_eq!(u32::from_le_bytes(list[12..16].try_into().unwrap()), 4);
    let mut q = c.io_queue(1).unwrap();
    ok(q.write(4, 0, 4096, &[7; 4096], false).unwrap());
}

#[test]
fn a_lapsed_keep_alive_ends_the_controller_and_its_io_queues() {
    let (_d, _s, t, addr) = start("nvme-kato");
    let mut admin = Host::icreq(Host::connect_tcp(&addr), false, false).unwrap();
    let data = rpma_tests::nvme::connect_data([3; 16], 0xffff, SUB, HOST);
    let c = ok(admin
        .command(rpma_tests::nvme::connect_sqe(0, 31, 1500), &data, 0)
        .unwrap());
    let cntlid = c.dw0 as u16;
    let mut q = Host::icreq(Host::connect_tcp(&addr), false, false).unwrap();
    let data = rpma_tests::nvme::connect_data([3; 16], cntlid, SUB, HOST);
    ok(q.command(rpma_tests::nvme::connect_sqe(1, 31, 0), &data, 0)
        .unwrap());
    // No Keep Alive: both connections are closed by the target (1.5 s: the I/O queue's
    // Connect has that long to come before the controller is gone; 300 ms was short on a
    // loaded machine).
    assert!(matches!(
        admin.recv(),
        Err(rpma_tests::nvme::Error::Closed(_))
    ));
    assert!(matches!(q.recv(), Err(rpma_tests::nvme::Error::Closed(_))));
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let m = t.status()["metrics"].clone();
        if m["sessions_ended"]["keep_alive"] == 1 {
            break;
        }
        assert!(Instant::now() < deadline, "{m}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_shutdown_notification_completes_once_everything_is_durable() {
    let (_d, _s, _t, addr) = start("nvme-shutdown");
    let mut c = Controller::connect(&addr, SUB, HOST, (false, false)).unwrap();
    let mut q = c.io_queue(1).unwrap();
    ok(q.write(1, 0, 512, &noise(3, 65536), false).unwrap());
    ok(c.property_set(0x14, rpma_tests::nvme::CC_ENABLE | (1 << 14)));
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let csts = c.property_get(0x1c, false).dw0;
        if (csts >> 2) & 3 == 2 {
            break;
        }
        assert!(Instant::now() < deadline, "CSTS {csts:#x}");
        std::thread::sleep(Duration::from_millis(20));
    }
    let cap = ok(c.property_get(0x00, true));
    assert_eq!(cap.dw0 & 0xffff, 127, "MQES");
    assert_ne!(cap.dw1 & (1 << 5), 0, "CSS: the NVM command set (bit 37)");
    assert_eq!(ok(c.property_get(0x08, false)).dw0, 0x0001_0400, "VS 1.4");
    assert_eq!(
        c.property_get(0x00, false).code(),
        sc::INVALID_FIELD,
        "CAP is 8 bytes"
    );
}

#[test]
fn wrong_admin_and_io_commands_get_their_status_and_the_queue_goes_on() {
    let (_d, _s, _t, addr) = start("nvme-wrong");
    let mut c = Controller::connect(&addr, SUB, HOST, (false, false)).unwrap();
    let code = |c: &mut Controller, sqe: Sqe, room: u32| c.admin.command(sqe, &[], room).unwrap();
    // Features: an unknown one, a saveable set, a selection that does not exist, and what is.
    assert_eq!(
        code(&mut c, Sqe::new(0x0a, 0).cdw(10, 0x7e), 0).code(),
        sc::INVALID_FIELD
    );
    assert_eq!(
        code(&mut c, Sqe::new(0x09, 0).cdw(10, 0x0f | (1 << 31)), 0).code(),
        0x10d,
        "Feature Identifier Not Saveable"
    );
    assert_eq!(
        code(&mut c, Sqe::new(0x0a, 0).cdw(10, 0x0f | (5 << 8)), 0).code(),
        sc::INVALID_FIELD
    );
    assert_eq!(
        ok(code(&mut c, Sqe::new(0x0a, 0).cdw(10, 0x0f), 0)).dw0,
        5000,
        "KATO"
    );
    assert_eq!(
        ok(code(&mut c, Sqe::new(0x0a, 0).cdw(10, 0x06), 0)).dw0,
        1,
        "write cache on"
    );
    ok(c.set_features(0x06, 0));
    assert_eq!(
        ok(code(&mut c, Sqe::new(0x0a, 0).cdw(10, 0x06), 0)).dw0,
        0,
        "and off"
    );
    assert_eq!(
        c.set_features(0x07, 0xffff).code(),
        sc::INVALID_FIELD,
        "queues: 65536"
    );
    // Properties: a register that is not there, CC as 8 bytes, a write to CSTS.
    assert_eq!(c.property_get(0x40, false).code(), sc::INVALID_FIELD);
    assert_eq!(c.property_get(0x14, true).code(), sc::INVALID_FIELD);
    assert_eq!(c.property_set(0x1c, 1).code(), sc::INVALID_FIELD);
    // Get Log Page: an offset that is not a whole dword, one it does not have.
    assert_eq!(c.get_log(0x02, 512, 2).code(), sc::INVALID_FIELD);
    assert_eq!(c.get_log(0x7f, 512, 0).code(), 0x109, "Invalid Log Page");
    let smart = ok(c.get_log(0x02, 512, 0));
    assert_eq!(smart.data.len(), 512);
    // Abort aborts nothing and says so; unknown and PCIe-only opcodes are refused.
    assert_eq!(ok(code(&mut c, Sqe::new(0x08, 0), 0)).dw0 & 1, 1);
    assert_eq!(
        code(&mut c, Sqe::new(0x01, 0), 0).code(),
        sc::INVALID_OPCODE,
        "Create I/O SQ"
    );
    assert_eq!(
        code(&mut c, Sqe::new(0xc5, 0), 0).code(),
        sc::INVALID_OPCODE
    );
    // PRPs instead of SGLs.
    let mut prp = Sqe::new(0x06, 0).cdw(10, 1);
    prp.0[1] = 0;
    assert_eq!(code(&mut c, prp, 4096).code(), sc::INVALID_FIELD);
    // Five held event requests are one too many.
    for cid in 100..104u16 {
        let mut s = Sqe::new(0x0c, 0).u16(2, cid);
        s.0[39] = 0x5a;
        let p = c.admin.frame(rpma_tests::nvme::pdu::CMD, 0, &s.0, &[]);
        c.admin.send_raw(&p);
    }
    assert_eq!(
        code(&mut c, Sqe::new(0x0c, 0), 0).code(),
        0x105,
        "Asynchronous Event Request Limit Exceeded"
    );
    // I/O: protection information asked for, a length that is not the SGL's, Write Zeroes and
    // deallocation past the end, a Dataset Management with fewer ranges than it says.
    let mut q = c.io_queue(1).unwrap();
    let pi = Sqe::new(0x02, 1).cdw(12, 7 | (1 << 26));
    assert_eq!(q.command(pi, &[], 4096).unwrap().code(), sc::INVALID_FIELD);
    let short = Sqe::new(0x02, 1).cdw(12, 7);
    assert_eq!(q.command(short, &[], 512).unwrap().code(), sc::SGL_LENGTH);
    let blocks = (8u32 << 20) / 512;
    let wz = Sqe::new(0x08, 1).cdw(10, blocks - 1).cdw(12, 1);
    assert_eq!(q.command(wz, &[], 0).unwrap().code(), sc::LBA_RANGE);
    let mut range = vec![0u8; 16];
    range[4..8].copy_from_slice(&2u32.to_le_bytes());
    range[8..16].copy_from_slice(&u64::from(blocks - 1).to_le_bytes());
    let dsm = Sqe::new(0x09, 1).cdw(11, 1 << 2);
    assert_eq!(q.command(dsm, &range, 0).unwrap().code(), sc::LBA_RANGE);
    let dsm = Sqe::new(0x09, 1).cdw(10, 3).cdw(11, 1 << 2);
    assert_eq!(
        q.command(dsm, &range, 0).unwrap().code(),
        sc::SGL_LENGTH,
        "4 ranges said, 1 sent"
    );
    // A write to the end of the namespace and one block past it.
    assert!(q
        .write(1, u64::from(blocks - 1), 512, &[1; 512], false)
        .unwrap()
        .ok());
    assert_eq!(
        q.write(1, u64::from(blocks - 1), 512, &[1; 1024], false)
            .unwrap()
            .code(),
        sc::LBA_RANGE
    );
    // After all that, the queues still serve.
    assert!(q.read(1, 0, 512, 1).unwrap().ok());
    assert!(c.identify(1, 0).ok());
}

#[test]
fn with_sq_flow_control_disabled_data_carries_the_success_flag() {
    let (_d, _s, _t, addr) = start("nvme-sqflow");
    let c = Controller::connect(&addr, SUB, HOST, (true, true)).unwrap();
    let mut q = Host::icreq(Host::connect_tcp(&addr), true, true).unwrap();
    let data = rpma_tests::nvme::connect_data(c.host_id, c.cntlid, SUB, HOST);
    // CATTR bit 2: the host disables SQ flow control (nvme connect-all does, when the discovery
    // log offers it).
    let connect = rpma_tests::nvme::connect_sqe(1, 127, 0).byte(46, 1 << 2);
    ok(q.command(connect, &data, 0).unwrap());
    let a = noise(5, 8192);
    ok(q.write(1, 0, 512, &a, false).unwrap());
    let r = ok(q.read(1, 0, 512, 16).unwrap());
    assert!(r.by_success_flag, "no CapsuleResp after the data");
    assert_eq!(r.data, a);
    // A command without data still completes with a CapsuleResp; an error too.
    ok(q.flush(1).unwrap());
    let e = q.read(1, (8 << 20) / 512, 512, 1).unwrap();
    assert_eq!(e.code(), sc::LBA_RANGE);
    assert!(!e.by_success_flag);
}

#[test]
fn check_config_shows_the_listener_its_methods_and_the_keyed_hosts_it_refuses() {
    let dir = rpma_tests::scratch();
    let psk = dir.path().join("k.psk");
    rpma_tests::write_psk(&psk, "31");
    let text = format!(
        "listen = [\"tcp://127.0.0.1:7420\", \"nvme-tcp://127.0.0.1\"]\n{}",
        Config::new().subsystem(
            Subsystem::new(SUB)
                .host(HOST)
                .keyed_host("nqn.2026-11.io.rpma:keyed", psk.to_str().unwrap())
                .namespace(Namespace::new(1, "ns1", "1MiB"))
        )
    );
    let cfg = dir.path().join("target.toml");
    std::fs::write(&cfg, text).unwrap();
    let o = rpma_tests::check_config(&cfg);
    let out = rpma_tests::text(&o);
    assert!(o.status.success(), "{out}");
    assert!(
        out.contains("listener nvme-tcp://127.0.0.1:4420 (NVMe/TCP: digests as each host asks)"),
        "{out}"
    );
    // What tcp offers depends on the scratch directory's domain (no APM on page-cache).
    let files = rpma_tests::Transport::current().file_domain();
    let tcp = rpma_tests::Transport::Tcp.offered(files).names().join(" ");
    assert!(
        out.contains(&format!("tcp: {tcp}; nvme-tcp: FLUSH")),
        "{out}"
    );
    assert!(
        out.contains("its 1 host(s) with a key are refused on nvme-tcp:// listeners"),
        "{out}"
    );
}

#[test]
fn a_reload_that_needs_a_write_cache_closes_a_controller_that_reported_none() {
    let (_d, shm, mut t, addr) = start("nvme-vwc-reload");
    let mut c = Controller::connect(&addr, DAX, HOST, (false, false)).unwrap();
    assert_eq!(ok(c.identify(1, 0)).data[525] & 1, 0, "VWC 0");
    // Without a write cache there is none to turn off.
    assert_eq!(c.set_features(0x06, 0).code(), sc::INVALID_FIELD);
    // A Disconnect on an I/O queue: completed, then the queue is closed.
    let mut q = c.io_queue(1).unwrap();
    ok(q.command(Sqe::fabrics(0x08), &[], 0).unwrap());
    assert!(matches!(q.recv(), Err(rpma_tests::nvme::Error::Closed(_))));
    // A page-cache namespace joins the dax subsystem: the controller told the host writes are
    // durable at completion, which the new namespace cannot keep: it is closed, the host
    // reconnects and reads VWC 1.
    let text = config(&shm).to_string().replace(
        "path = \"dax1\"\nsize = \"2MiB\"\nforce_dax = true\n",
        "path = \"dax1\"\nsize = \"2MiB\"\nforce_dax = true\n[[subsystem.namespace]]\nnsid = 2\npath = \"pc2\"\nsize = \"1MiB\"\n",
    );
    assert!(text.contains("pc2"), "{text}");
    t.rewrite(&text);
    t.reload();
    assert!(matches!(
        c.admin.recv(),
        Err(rpma_tests::nvme::Error::Closed(_))
    ));
    let mut c = Controller::connect(&addr, DAX, HOST, (false, false)).unwrap();
    assert_eq!(ok(c.identify(1, 0)).data[525] & 1, 1, "VWC 1 now");
    assert_eq!(t.status()["metrics"]["sessions_ended"]["reload"], 1);
}

#[test]
fn a_keep_alive_timeout_of_zero_is_the_targets_keep_alive() {
    let (_d, _s, _t, addr) = start("nvme-kato0");
    let mut admin = Host::icreq(Host::connect_tcp(&addr), false, false).unwrap();
    let data = rpma_tests::nvme::connect_data([4; 16], 0xffff, SUB, HOST);
    ok(admin
        .command(rpma_tests::nvme::connect_sqe(0, 31, 0), &data, 0)
        .unwrap());
    ok(admin
        .command(
            Sqe::fabrics(0x00)
                .u32(44, 0x14)
                .u32(48, rpma_tests::nvme::CC_ENABLE),
            &[],
            0,
        )
        .unwrap());
    let get = |h: &mut Host| ok(h.command(Sqe::new(0x0a, 0).cdw(10, 0x0f), &[], 0).unwrap()).dw0;
    assert_eq!(get(&mut admin), 5000, "keep_alive_ms, the default");
    ok(admin
        .command(Sqe::new(0x09, 0).cdw(10, 0x0f).cdw(11, 0), &[], 0)
        .unwrap());
    assert_eq!(get(&mut admin), 5000, "Set Features to 0 likewise");
    ok(admin
        .command(Sqe::new(0x09, 0).cdw(10, 0x0f).cdw(11, 7_200_000), &[], 0)
        .unwrap());
    assert_eq!(get(&mut admin), 3_600_000, "at most an hour");
}

/// A reload that puts another file in place of a page-cache namespace's (an operator's restore
/// of an older copy) leaves the controller up with the new file, but its next Flush of that
/// namespace answers Write Fault, once: the writes it answered before went to the old file's
/// page cache, which no sync of the new file covers. A reload that leaves the file alone
/// changes nothing. (The Flush succeeded on the new file: a write the namespace no longer had
/// looked durable.)
#[test]
fn a_flush_after_a_reload_replaced_the_namespace_file_is_a_write_fault() {
    let (d, _s, mut t, addr) = start("nvme-replaced");
    let mut c = Controller::connect(&addr, SUB, HOST, (false, false)).unwrap();
    ok(c.set_features(0x07, 0));
    let mut q = c.io_queue(1).unwrap();
    let ns1 = d.path().join("ns1");
    let before = ok(q.read(1, 16, 512, 8).unwrap()).data;
    std::fs::copy(&ns1, d.path().join("ns1.old")).unwrap();
    let a = noise(2, 4096);
    ok(q.write(1, 16, 512, &a, false).unwrap());
    // Nothing changed: the Flush is the usual one.
    t.reload();
    ok(q.flush(1).unwrap());
    // Another write, then the older copy renamed over the file, and a reload.
    let b = noise(3, 4096);
    ok(q.write(1, 16, 512, &b, false).unwrap());
    std::fs::rename(d.path().join("ns1.old"), &ns1).unwrap();
    t.reload();
    // The controller hears of the reload in its own loop's turn: its changed namespace list
    // names nsid 1 once it has.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let changed = ok(c.get_log(0x04, 4096, 0)).data;
        if u32::from_le_bytes(changed[0..4].try_into().unwrap()) == 1 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the controller never heard of the reload"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let f = q.flush(1).unwrap();
    assert_eq!(f.code(), sc::WRITE_FAULT, "{f:?}");
    // The fault was honest: the namespace is the older copy now, without either write.
    assert_eq!(ok(q.read(1, 16, 512, 8).unwrap()).data, before);
    // Said once: the writes after it are the new file's.
    ok(q.write(1, 16, 512, &b, false).unwrap());
    ok(q.flush(1).unwrap());
    ok(q.flush(0xffff_ffff).unwrap());
}

/// Waits until controller `c` heard of a reload that changed nsid 1 (its changed namespace
/// list names it; read with RAE 0, which empties it for the next reload).
fn wait_changed(c: &mut Controller) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let changed = ok(c.get_log(0x04, 4096, 0)).data;
        if u32::from_le_bytes(changed[0..4].try_into().unwrap()) == 1 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the controller never heard of the reload"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Sends a Write of `len` bytes (more than the capsule holds: by R2T) to nsid 1 at block 64
/// (512-byte blocks) and takes its R2T: the command id and the transfer tag; the data is held
/// back ([`send_h2c_data`]).
fn r2t_write_at_block_64(q: &mut rpma_tests::nvme::Host, len: usize) -> (u16, u16) {
    use rpma_tests::nvme::pdu;
    let cid = q.cid();
    let blocks = (len / 512) as u32;
    let mut s = Sqe::new(0x01, 1)
        .cdw(10, 64)
        .cdw(12, blocks - 1)
        .u16(2, cid);
    s.0[32..36].copy_from_slice(&(len as u32).to_le_bytes());
    s.0[39] = 0x5a;
    let p = q.frame(pdu::CMD, 0, &s.0, &[]);
    q.send_raw(&p);
    let r2t = q.recv().unwrap();
    assert_eq!((r2t.kind, r2t.u16(8)), (pdu::R2T, cid), "{r2t:?}");
    (cid, r2t.u16(10))
}

/// Sends `data` for the R2T (`cid`, `ttag`) in H2CData PDUs of at most the host's MAXH2CDATA.
fn send_h2c_data(q: &mut rpma_tests::nvme::Host, cid: u16, ttag: u16, data: &[u8]) {
    use rpma_tests::nvme::{h2c_header, pdu};
    let mut at = 0;
    while at < data.len() {
        let n = (data.len() - at).min(q.maxh2cdata as usize);
        let last = at + n == data.len();
        let h = h2c_header(cid, ttag, at as u32, n as u32);
        let p = q.frame(
            pdu::H2C_DATA,
            if last { 4 } else { 0 },
            &h,
            &data[at..at + n],
        );
        q.send_raw(&p);
        at += n;
    }
}

/// A Write whose data comes by R2T, started before a reload that put another file in place of
/// its namespace's and finished after it, is a Write Fault: its data landed in the old file,
/// which the host no longer reads (before: answered success after the Flush that faulted for
/// the replacement, so the next Flush vouched for a write the namespace did not have). And a
/// shutdown after a replacement no Flush reported sets Controller Fatal Status (before: a
/// clean shutdown).
#[test]
fn a_write_by_r2t_across_a_reload_that_replaced_its_file_is_a_write_fault() {
    let (d, _s, mut t, addr) = start("nvme-replaced-r2t");
    let mut c = Controller::connect(&addr, SUB, HOST, (false, false)).unwrap();
    ok(c.set_features(0x07, 0));
    let mut q = c.io_queue(1).unwrap();
    let ns1 = d.path().join("ns1");
    std::fs::copy(&ns1, d.path().join("ns1.old")).unwrap();
    // A 16 KiB Write (more than the capsule holds): its R2T comes, its data is held back.
    let data = noise(5, 16384);
    let (cid, ttag) = r2t_write_at_block_64(&mut q, data.len());
    // The older copy renamed over the file, a reload, heard by the controller; its Flush
    // faults for the replacement.
    std::fs::rename(d.path().join("ns1.old"), &ns1).unwrap();
    t.reload();
    wait_changed(&mut c);
    assert_eq!(q.flush(1).unwrap().code(), sc::WRITE_FAULT);
    // Now the data: it went to the old file, so the Write is not answered success.
    send_h2c_data(&mut q, cid, ttag, &data);
    let w = q.complete(cid, &[]).unwrap();
    assert_eq!(w.code(), sc::WRITE_FAULT, "{w:?}");
    assert_ne!(ok(q.read(1, 64, 512, 32).unwrap()).data, data);
    // Writes to the new file go on as usual.
    ok(q.write(1, 64, 512, &data, false).unwrap());
    ok(q.flush(1).unwrap());
    // Another replacement that no Flush reported: the shutdown says the data is not safe.
    std::fs::copy(&ns1, d.path().join("ns1.old")).unwrap();
    std::fs::rename(d.path().join("ns1.old"), &ns1).unwrap();
    t.reload();
    wait_changed(&mut c);
    ok(c.property_set(0x14, rpma_tests::nvme::CC_ENABLE | (1 << 14)));
    let deadline = Instant::now() + Duration::from_secs(30);
    let csts = loop {
        let csts = c.property_get(0x1c, false).dw0;
        if (csts >> 2) & 3 == 2 {
            break csts;
        }
        assert!(Instant::now() < deadline, "CSTS {csts:#x}");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_ne!(csts & 2, 0, "CFS with the completed shutdown: {csts:#x}");
}

/// A Write whose data comes by R2T, started before a reload that removed its namespace, puts
/// none of the data that comes after the reload is done into the removed namespace's file: the
/// operator may reuse or delete the file once `rpma-target reload` (or READY) said the reload
/// took effect. (Before: the data went on landing in the old file, PDU by PDU, after the
/// reload was reported done; only the completion said Write Fault.)
#[test]
fn a_write_by_r2t_across_a_reload_that_removed_its_namespace_puts_nothing_in_the_file() {
    let (d, shm, mut t, addr) = start("nvme-removed-r2t");
    let mut c = Controller::connect(&addr, SUB, HOST, (false, false)).unwrap();
    ok(c.set_features(0x07, 0));
    let mut q = c.io_queue(1).unwrap();
    let ns1 = d.path().join("ns1");
    // A 16 KiB Write at block 64 (more than the capsule holds): its R2T comes, its data is
    // held back.
    let data = noise(7, 16384);
    let (cid, ttag) = r2t_write_at_block_64(&mut q, data.len());
    // Namespace 1 removed from the configuration; the reload is done (READY) before the data.
    t.rewrite(&config_of(&shm, None).to_string());
    t.reload();
    send_h2c_data(&mut q, cid, ttag, &data);
    let w = q.complete(cid, &[]).unwrap();
    assert_eq!(w.code(), sc::WRITE_FAULT, "{w:?}");
    // The file the operator took back holds none of it (the daemon's page cache is the
    // file's: a read sees what its mapping got).
    let file = std::fs::read(&ns1).unwrap();
    let block = &file[64 * 512..64 * 512 + data.len()];
    let landed = block
        .chunks(512)
        .zip(data.chunks(512))
        .filter(|(f, d)| f == d)
        .count();
    assert_eq!(
        landed, 0,
        "blocks of the Write in the removed namespace's file"
    );
    // The connection goes on: the namespaces left are served.
    assert_eq!(q.read(1, 0, 512, 1).unwrap().code(), sc::INVALID_NS);
    ok(q.read(2, 0, 4096, 1).unwrap());
}

/// The zeroing commands have limits, reported in the NVM command set's Identify Controller so
/// that a host splits its requests (the Linux host takes DMRSL as its discard size and WZSL as
/// its Write Zeroes size), and larger ones are refused: a Write Zeroes of at most 1 MiB, a
/// deallocation of at most 2048 blocks in all. (Before: nothing reported, and a Dataset
/// Management of 256 ranges each the whole namespace was zeroed in one go, holding up every
/// host of the poll loop.)
#[test]
fn write_zeroes_and_deallocation_are_bounded_and_say_so() {
    let (_d, _s, _t, addr) = start("nvme-zero-limits");
    let mut c = Controller::connect(&addr, SUB, HOST, (false, false)).unwrap();
    ok(c.set_features(0x07, 0));
    let id = ok(c.identify(0x06, 0)).data;
    assert_eq!(id[1], 8, "WZSL: 2^8 pages of 4 KiB");
    assert_eq!(id[3], 0, "DMRL: no limit but the command's 256 ranges");
    assert_eq!(
        u32::from_le_bytes(id[4..8].try_into().unwrap()),
        2048,
        "DMRSL"
    );
    assert_eq!(
        u64::from_le_bytes(id[8..16].try_into().unwrap()),
        2048,
        "DMSL"
    );
    let mut q = c.io_queue(1).unwrap();
    let a = noise(9, 4096);
    ok(q.write(1, 0, 512, &a, false).unwrap());
    // Write Zeroes: 1 MiB (2048 blocks of 512) is taken, one block more is refused.
    let wz = |blocks: u32| Sqe::new(0x08, 1).cdw(10, 2048).cdw(12, blocks - 1);
    ok(q.command(wz(2048), &[], 0).unwrap());
    assert_eq!(
        q.command(wz(2049), &[], 0).unwrap().code(),
        sc::INVALID_FIELD
    );
    // Deallocation: a range past DMRSL, or ranges past DMSL in all, are refused, and nothing
    // of them is zeroed.
    let ranges = |list: &[(u32, u64)]| -> (Sqe, Vec<u8>) {
        let mut d = Vec::new();
        for &(blocks, slba) in list {
            let mut r = vec![0u8; 16];
            r[4..8].copy_from_slice(&blocks.to_le_bytes());
            r[8..16].copy_from_slice(&slba.to_le_bytes());
            d.extend_from_slice(&r);
        }
        let n = list.len() as u32 - 1;
        (Sqe::new(0x09, 1).cdw(10, n).cdw(11, 1 << 2), d)
    };
    let (s, d) = ranges(&[(2049, 0)]);
    assert_eq!(q.command(s, &d, 0).unwrap().code(), sc::INVALID_FIELD);
    let (s, d) = ranges(&[(2048, 4096), (8, 0)]);
    assert_eq!(q.command(s, &d, 0).unwrap().code(), sc::INVALID_FIELD);
    let full = vec![(16384u32, 0u64); 256];
    let (s, d) = ranges(&full);
    assert_eq!(q.command(s, &d, 0).unwrap().code(), sc::INVALID_FIELD);
    assert_eq!(ok(q.read(1, 0, 512, 8).unwrap()).data, a, "nothing zeroed");
    // Within the limits: zeroed.
    let (s, d) = ranges(&[(2040, 4096), (8, 0)]);
    ok(q.command(s, &d, 0).unwrap());
    assert_eq!(ok(q.read(1, 0, 512, 8).unwrap()).data, vec![0; 4096]);
    // A burst of 24 permitted deallocations of 1 MiB sent at once: more than a turn's zeroing
    // budget (8 MiB), so the loop takes them over several turns; every one is answered.
    let (s, d) = ranges(&[(2048, 0)]);
    let mut burst = Vec::new();
    let cids: Vec<u16> = (0..24).map(|_| q.cid()).collect();
    for &cid in &cids {
        let mut s = s.u16(2, cid);
        s.0[32..36].copy_from_slice(&16u32.to_le_bytes());
        s.0[39] = 0x01;
        burst.extend_from_slice(&q.frame(rpma_tests::nvme::pdu::CMD, 0, &s.0, &d));
    }
    q.stream()
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    q.send_raw(&burst);
    for &cid in &cids {
        ok(q.complete(cid, &[]).unwrap());
    }
}

/// An `nvme-tcp://` controller proves no key (no in-band authentication): in a full target
/// (`max_connections`), a host that proved its key on the `tcp://` listener takes its place;
/// the controller's connection is closed.
#[test]
fn a_keyed_host_takes_the_place_of_an_nvme_controller_in_a_full_target() {
    const KEYED_SUB: &str = "nqn.2026-11.io.rpma:nvme-keyed";
    const KEYED: &str = "nqn.2026-11.io.rpma:nvme-keyed-host";
    let dir = rpma_tests::scratch();
    rpma_tests::write_psk(&dir.path().join("keyed.psk"), "5a");
    let config = Config::new()
        .set("max_connections = 1")
        .subsystem(
            Subsystem::new(SUB)
                .host(HOST)
                .namespace(Namespace::new(1, "ns1", "1MiB")),
        )
        .subsystem(
            Subsystem::new(KEYED_SUB)
                .keyed_host(KEYED, "keyed.psk")
                .namespace(Namespace::new(1, "k1", "1MiB")),
        );
    // Two listeners: the tcp:// one on a port of its own, then the nvme-tcp:// one.
    let tcp = format!("tcp://127.0.0.1:{}", rpma_tests::free_port());
    let t = Target::start_on(
        dir.path(),
        &format!("{tcp}\", \"nvme-tcp://127.0.0.1"),
        &config.to_string(),
        &[],
    );
    let addr = format!("127.0.0.1:{}", t.port());
    let mut ctrl = Controller::connect(&addr, SUB, HOST, (false, false)).expect("admitted");
    let keyed = rpma_tests::host(KEYED)
        .with_psk(rpma_common::proto::auth::Psk::from_hex(&"5a".repeat(32)).unwrap());
    let _s = rpma_initiator::connect(
        &tcp,
        &rpma_tests::nqn(KEYED_SUB),
        &keyed,
        &rpma_tests::opts(),
    )
    .expect("the keyed host gets in");
    assert!(matches!(
        ctrl.admin.recv(),
        Err(rpma_tests::nvme::Error::Closed(_))
    ));
    let st = t.status();
    assert_eq!(st["admission"]["sessions"]["evicted"], 1);
    assert_eq!(st["metrics"]["sessions_ended"]["evicted"], 1, "{st}");
}

/// On an `allow_any_host` subsystem, a controller of a host the subsystem does not list gives
/// its place in a full target (`max_connections`) to a listed host's, which is admitted; the
/// unlisted one's connection is closed. Full of a listed host's controller, the target refuses
/// an unlisted newcomer and a listed one alike (busy). (Before, the listed host was refused
/// busy: only a host that proved its key on a `tcp://` listener took a place.)
#[test]
fn a_listed_host_takes_the_place_of_an_unlisted_controller_in_a_full_target() {
    let dir = rpma_tests::scratch();
    let config = Config::new().set("max_connections = 1").subsystem(
        Subsystem::new(SUB)
            .any_host()
            .host(HOST)
            .namespace(Namespace::new(1, "ns1", "1MiB")),
    );
    let t = Target::start_on(dir.path(), "nvme-tcp://127.0.0.1", &config.to_string(), &[]);
    let addr = format!("127.0.0.1:{}", t.port());
    let busy = |host: &str| {
        let e = Controller::connect(&addr, SUB, host, (false, false)).expect_err("full");
        assert_eq!(e.code(), sc::CONNECT_BUSY, "{host}: {e:?}");
    };
    let mut unlisted =
        Controller::connect(&addr, SUB, OTHER, (false, false)).expect("an unlisted host admitted");
    busy("nqn.2026-11.io.rpma:nvme-stranger-2");
    let mut listed =
        Controller::connect(&addr, SUB, HOST, (false, false)).expect("the listed host gets in");
    assert!(matches!(
        unlisted.admin.recv(),
        Err(rpma_tests::nvme::Error::Closed(_))
    ));
    ok(listed.identify(1, 0));
    busy(OTHER);
    busy(HOST);
    let st = t.status();
    assert_eq!(st["admission"]["unlisted"]["evicted"], 1, "{st}");
    assert_eq!(st["admission"]["sessions"]["evicted"], 1, "{st}");
    assert_eq!(st["metrics"]["sessions_ended"]["evicted"], 1, "{st}");
}

/// A controller let in by `allow_any_host` whose host a reload then lists (without a key) is a
/// listed host's from then on: in a full target a listed newcomer is refused busy rather than
/// given its place. (Before, it stayed in the lowest class and was closed for the newcomer.)
#[test]
fn a_controller_whose_host_a_reload_lists_is_no_longer_unlisted() {
    let dir = rpma_tests::scratch();
    let config = |listed: &[&str]| {
        let mut s = Subsystem::new(SUB)
            .any_host()
            .host(HOST)
            .namespace(Namespace::new(1, "ns1", "1MiB"));
        for h in listed {
            s = s.host(h);
        }
        Config::new()
            .set("max_connections = 1")
            .subsystem(s)
            .to_string()
    };
    let mut t = Target::start_on(dir.path(), "nvme-tcp://127.0.0.1", &config(&[]), &[]);
    let addr = format!("127.0.0.1:{}", t.port());
    // A keep-alive the test need not send meanwhile (it is not what is tested).
    let mut late = Controller::connect_kato(&addr, SUB, OTHER, (false, false), 120_000)
        .expect("an unlisted host admitted");
    let unlisted_held = |t: &Target| t.status()["admission"]["unlisted"]["held"].as_u64();
    assert_eq!(unlisted_held(&t), Some(1));
    t.rewrite(&config(&[OTHER]));
    t.reload();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while unlisted_held(&t) != Some(0) {
        assert!(
            std::time::Instant::now() < deadline,
            "the controller stayed unlisted: {}",
            t.status()["admission"]
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let e = Controller::connect(&addr, SUB, HOST, (false, false)).expect_err("full");
    assert_eq!(e.code(), sc::CONNECT_BUSY, "{e:?}");
    ok(late.identify(1, 0));
    assert_eq!(t.status()["admission"]["sessions"]["evicted"], 0);
}
