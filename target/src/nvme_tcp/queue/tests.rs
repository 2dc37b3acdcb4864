//! The queue's state machine driven by hand: bytes in, bytes out, flushes completed (or not) by
//! the test, no socket and no thread.

use std::sync::mpsc;

use rpma_common::proto::FlushStatus;

use super::*;
use crate::config::Config;
use crate::namespace::NamespaceTable;
use crate::nvme_tcp::pdu::{crc32c, kind};
use crate::serve::budget::Pool;
use crate::serve::{LoopCmd, Shared};

const SUB: &str = "nqn.2026-11.io.rpma:t";
const HOST: &str = "nqn.2026-11.io.rpma:h";

struct H {
    _dir: tempfile::TempDir,
    ctx: Arc<Ctx>,
    evict: LoopTx,
    _evicted: mpsc::Receiver<LoopCmd>,
    stats: LoopStats,
    effects: Vec<(u64, Effect)>,
    token: u64,
    peer: SocketAddr,
}

impl H {
    /// A target with one 1 MiB page-cache namespace (block 512) on a subsystem that lists `HOST`.
    fn new(extra: &str) -> H {
        // A disk: the namespace is page-cache.
        let dir = tempfile::tempdir().unwrap();
        let text = format!(
            "listen = [\"nvme-tcp://127.0.0.1:4420\"]\n{extra}\n[[subsystem]]\nnqn = \"{SUB}\"\n\
             hosts = [{{ nqn = \"{HOST}\" }}]\n[[subsystem.namespace]]\nnsid = 1\npath = \"n1\"\n\
             size = \"1MiB\"\nblock_size = 512\n"
        );
        let cfg = Config::from_toml(&text, dir.path()).unwrap();
        let table = NamespaceTable::open_all(&cfg).unwrap();
        let shared = Shared::for_tests(&cfg, &table);
        let (tx, rx) = mpsc::channel();
        let wake = Arc::new(crate::eventfd::EventFd::new().unwrap());
        H {
            _dir: dir,
            ctx: Arc::new(Ctx::new(shared)),
            evict: LoopTx::new(tx, wake),
            _evicted: rx,
            stats: LoopStats::default(),
            effects: Vec::new(),
            token: 0,
            peer: "192.0.2.1:40000".parse().unwrap(),
        }
    }

    fn queue(&mut self) -> Queue {
        let limits = self.ctx.serve.limits(Pool::Unadmitted);
        let ticket = self.ctx.serve.budgets.take(
            Pool::Unadmitted,
            self.peer.ip(),
            limits,
            self.evict.clone(),
        );
        let local = "127.0.0.1:4420".parse().unwrap();
        Queue::new(
            self.peer,
            local,
            ticket,
            Instant::now(),
            Duration::from_secs(5),
        )
    }

    fn env(&mut self) -> Env<'_> {
        Env {
            ctx: &self.ctx,
            now: Instant::now(),
            conn: 1,
            effects: &mut self.effects,
            next_token: &mut self.token,
            owner: &self.evict,
            stats: &self.stats,
        }
    }

    /// Feeds `bytes` (in as many reads as the queue's buffer needs) and returns what it sends.
    fn send(&mut self, q: &mut Queue, mut bytes: &[u8]) -> Vec<u8> {
        while !bytes.is_empty() {
            let space = q.recv_space();
            if space.is_empty() {
                break;
            }
            let n = space.len().min(bytes.len());
            space[..n].copy_from_slice(&bytes[..n]);
            bytes = &bytes[n..];
            let mut env = self.env();
            q.received(n, &mut env);
        }
        let out = q.pending_tx().to_vec();
        q.sent(out.len());
        out
    }

    /// The flushes asked for since the last call.
    fn flushes(&mut self) -> Vec<u64> {
        std::mem::take(&mut self.effects)
            .into_iter()
            .filter_map(|(_, e)| match e {
                Effect::Flush { token, .. } => Some(token),
                Effect::WakeAll => None,
            })
            .collect()
    }

    fn flush_done(&mut self, q: &mut Queue, token: u64, st: FlushStatus) -> Vec<u8> {
        let mut env = self.env();
        q.flush_done(token, st, &mut env);
        let out = q.pending_tx().to_vec();
        q.sent(out.len());
        out
    }
}

fn icreq(digest: u8) -> Vec<u8> {
    let mut b = vec![kind::IC_REQ, 0, 128, 0, 128, 0, 0, 0, 0, 0, 0, digest];
    b.resize(128, 0);
    b
}

/// A CapsuleCmd (no digests) of `sqe` with in-capsule `data`.
fn capsule(sqe: &[u8; 64], data: &[u8]) -> Vec<u8> {
    let plen = 72 + data.len();
    let pdo = if data.is_empty() { 0 } else { 72 };
    let mut b = vec![kind::CAPSULE_CMD, 0, 72, pdo];
    b.extend_from_slice(&(plen as u32).to_le_bytes());
    b.extend_from_slice(sqe);
    b.extend_from_slice(data);
    b
}

fn sqe(opcode: u8, cid: u16, nsid: u32) -> [u8; 64] {
    let mut s = [0u8; 64];
    s[0] = opcode;
    s[1] = 0x40; // SGLs
    s[2..4].copy_from_slice(&cid.to_le_bytes());
    s[4..8].copy_from_slice(&nsid.to_le_bytes());
    s[39] = command::sgl::TRANSPORT;
    s
}

fn set_sgl(s: &mut [u8; 64], kind: u8, len: u32) {
    s[32..36].copy_from_slice(&len.to_le_bytes());
    s[39] = kind;
}

fn cdw(s: &mut [u8; 64], n: usize, v: u32) {
    s[40 + 4 * (n - 10)..44 + 4 * (n - 10)].copy_from_slice(&v.to_le_bytes());
}

fn connect_cmd(cid: u16, qid: u16, cntlid: u16, sub: &str, host: &str) -> Vec<u8> {
    let mut s = sqe(command::FABRICS, cid, 0);
    s[4] = command::fctype::CONNECT;
    set_sgl(&mut s, command::sgl::IN_CAPSULE, 1024);
    s[42..44].copy_from_slice(&qid.to_le_bytes());
    s[44..46].copy_from_slice(&31u16.to_le_bytes());
    s[48..52].copy_from_slice(&5000u32.to_le_bytes());
    let mut d = vec![0u8; 1024];
    d[..16].copy_from_slice(&[0xab; 16]);
    d[16..18].copy_from_slice(&cntlid.to_le_bytes());
    d[256..256 + sub.len()].copy_from_slice(sub.as_bytes());
    d[512..512 + host.len()].copy_from_slice(host.as_bytes());
    capsule(&s, &d)
}

/// The completions (cid, dw0, status field) in `out`, skipping other PDUs.
fn completions(out: &[u8]) -> Vec<(u16, u32, u16)> {
    let mut v = Vec::new();
    let mut at = 0;
    while at + 8 <= out.len() {
        let plen = u32::from_le_bytes(out[at + 4..at + 8].try_into().unwrap()) as usize;
        if out[at] == kind::CAPSULE_RESP {
            let c = &out[at + 8..at + 24];
            v.push((
                u16::from_le_bytes([c[12], c[13]]),
                u32::from_le_bytes(c[0..4].try_into().unwrap()),
                u16::from_le_bytes([c[14], c[15]]),
            ));
        }
        at += plen.max(8);
    }
    v
}

fn types(out: &[u8]) -> Vec<u8> {
    let mut v = Vec::new();
    let mut at = 0;
    while at + 8 <= out.len() {
        v.push(out[at]);
        at += (u32::from_le_bytes(out[at + 4..at + 8].try_into().unwrap()) as usize).max(8);
    }
    v
}

fn status(s: Status) -> u16 {
    s.field()
}

/// An admin queue connected and enabled, and an I/O queue of its controller.
fn connected(h: &mut H) -> (Queue, Queue, u16) {
    let mut a = h.queue();
    let out = h.send(&mut a, &icreq(0));
    assert_eq!(out.len(), 128, "ICResp");
    let out = h.send(&mut a, &connect_cmd(1, 0, 0xffff, SUB, HOST));
    let c = completions(&out);
    assert_eq!(c[0].2, 0, "admitted");
    let cntlid = c[0].1 as u16;
    let mut set = sqe(command::FABRICS, 2, 0);
    set[4] = command::fctype::PROPERTY_SET;
    set[44..48].copy_from_slice(&0x14u32.to_le_bytes());
    set[48..52].copy_from_slice(&(1u32 | (6 << 16) | (4 << 20)).to_le_bytes());
    assert_eq!(completions(&h.send(&mut a, &capsule(&set, &[])))[0].2, 0);
    let mut io = h.queue();
    h.send(&mut io, &icreq(0));
    let c = completions(&h.send(&mut io, &connect_cmd(1, 1, cntlid, SUB, HOST)));
    assert_eq!(c[0].2, 0, "I/O queue connected");
    (a, io, cntlid)
}

fn write_cmd(cid: u16, slba: u64, blocks: u32, data: &[u8], fua: bool) -> Vec<u8> {
    let mut s = sqe(command::io::WRITE, cid, 1);
    set_sgl(&mut s, command::sgl::IN_CAPSULE, data.len() as u32);
    cdw(&mut s, 10, slba as u32);
    cdw(&mut s, 12, (blocks - 1) | if fua { 1 << 30 } else { 0 });
    capsule(&s, data)
}

#[test]
fn a_command_before_the_connect_is_a_sequence_error_and_closes() {
    let mut h = H::new("");
    let mut q = h.queue();
    h.send(&mut q, &icreq(0));
    let out = h.send(&mut q, &capsule(&sqe(0x06, 5, 0), &[]));
    assert_eq!(completions(&out), [(5, 0, status(Status::SEQUENCE_ERROR))]);
    assert!(!q.wants_read(), "closing");
    // What comes after is not even read.
    assert!(q.recv_space().is_empty());
    let mut m = crate::metrics::MetricsStatus::default();
    h.ctx.serve.events.fill(&mut m);
    assert_eq!(m.refusals["protocol_error"], 1, "a refusal");
    assert_eq!(
        m.handshakes_failed["abandoned"], 0,
        "not an abandoned handshake"
    );
}

#[test]
fn connect_refusals_say_which_field() {
    let mut h = H::new("");
    let refused = |h: &mut H, cmd: Vec<u8>| {
        let mut q = h.queue();
        h.send(&mut q, &icreq(0));
        let c = completions(&h.send(&mut q, &cmd));
        assert!(!q.wants_read(), "closed after a refused Connect");
        c[0]
    };
    let c = refused(
        &mut h,
        connect_cmd(1, 0, 0xffff, "nqn.2026-11.io.rpma:nope", HOST),
    );
    assert_eq!(
        (c.1, c.2),
        ((1 << 16) | 256, status(Status::CONNECT_INVALID_PARAM))
    );
    let c = refused(
        &mut h,
        connect_cmd(1, 0, 0xffff, SUB, "nqn.2026-11.io.rpma:other"),
    );
    assert_eq!(
        (c.1, c.2),
        ((1 << 16) | 512, status(Status::CONNECT_INVALID_HOST))
    );
    let c = refused(&mut h, connect_cmd(1, 3, 77, SUB, HOST));
    assert_eq!(
        (c.1, c.2),
        ((1 << 16) | 16, status(Status::CONNECT_INVALID_PARAM)),
        "an I/O queue of a controller that does not exist"
    );
    let mut bad = connect_cmd(1, 0, 0xffff, SUB, HOST);
    bad[8 + 40] = 1; // RECFMT
    assert_eq!(refused(&mut h, bad).2, status(Status::CONNECT_FORMAT));
    let mut bad = connect_cmd(1, 0, 0xffff, SUB, HOST);
    bad[8 + 44] = 0; // SQSIZE 0
    bad[8 + 45] = 0;
    let c = refused(&mut h, bad);
    assert_eq!((c.1, c.2), (44, status(Status::CONNECT_INVALID_PARAM)));
    let m = {
        let mut m = crate::metrics::MetricsStatus::default();
        h.ctx.serve.events.fill(&mut m);
        m
    };
    assert_eq!(m.refusals["unknown_subsystem"], 1);
    assert_eq!(m.refusals["host_not_allowed"], 1);
}

#[test]
fn a_keyed_host_is_refused_authentication_required() {
    let mut h = H::new("");
    let dir = tempfile::tempdir().unwrap();
    let k = dir.path().join("k.psk");
    std::fs::write(&k, "11".repeat(32)).unwrap();
    std::fs::set_permissions(&k, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let text = format!(
        "[[subsystem]]\nnqn = \"{SUB}\"\nhosts = [{{ nqn = \"{HOST}\", psk_file = \"{}\" }}]\n",
        k.display()
    );
    let cfg = Config::from_toml(&text, dir.path()).unwrap();
    let table = NamespaceTable::open_all(&cfg).unwrap();
    h.ctx = Arc::new(Ctx::new(Shared::for_tests(&cfg, &table)));
    let mut q = h.queue();
    h.send(&mut q, &icreq(0));
    let c = completions(&h.send(&mut q, &connect_cmd(1, 0, 0xffff, SUB, HOST)));
    assert_eq!(c[0].2, status(Status::AUTH_REQUIRED));
    let c = {
        let mut q = h.queue();
        h.send(&mut q, &icreq(0));
        completions(&h.send(
            &mut q,
            &connect_cmd(1, 0, 0xffff, "nqn.2014-08.org.nvmexpress.discovery", HOST),
        ))
    };
    assert_eq!(c[0].2, status(Status::AUTH_REQUIRED), "discovery too");
}

#[test]
fn a_write_in_the_capsule_and_one_by_r2t_land_and_read_back() {
    let mut h = H::new("");
    let (_a, mut io, _) = connected(&mut h);
    let data: Vec<u8> = (0..1024u32).map(|i| i as u8).collect();
    let out = h.send(&mut io, &write_cmd(7, 2, 2, &data, false));
    assert_eq!(completions(&out), [(7, 0, 0)]);
    // 8 blocks by R2T, sent in two H2CData PDUs.
    let mut s = sqe(command::io::WRITE, 8, 1);
    set_sgl(&mut s, command::sgl::TRANSPORT, 4096);
    cdw(&mut s, 10, 8);
    cdw(&mut s, 12, 7);
    let out = h.send(&mut io, &capsule(&s, &[]));
    assert_eq!(types(&out), [kind::R2T]);
    let ttag = u16::from_le_bytes([out[10], out[11]]);
    assert_eq!(u32::from_le_bytes(out[16..20].try_into().unwrap()), 4096);
    let big: Vec<u8> = (0..4096u32).map(|i| (i * 7) as u8).collect();
    let h2c = |off: u32, chunk: &[u8], last: bool| {
        let mut b = vec![kind::H2C_DATA, if last { 4 } else { 0 }, 24, 24];
        b.extend_from_slice(&(24 + chunk.len() as u32).to_le_bytes());
        b.extend_from_slice(&8u16.to_le_bytes());
        b.extend_from_slice(&ttag.to_le_bytes());
        b.extend_from_slice(&off.to_le_bytes());
        b.extend_from_slice(&(chunk.len() as u32).to_le_bytes());
        b.extend_from_slice(&[0; 4]);
        b.extend_from_slice(chunk);
        b
    };
    assert!(h.send(&mut io, &h2c(0, &big[..1000], false)).is_empty());
    let out = h.send(&mut io, &h2c(1000, &big[1000..], true));
    assert_eq!(completions(&out), [(8, 0, 0)]);
    // Read blocks 2..16 back.
    let mut r = sqe(command::io::READ, 9, 1);
    set_sgl(&mut r, command::sgl::TRANSPORT, 14 * 512);
    cdw(&mut r, 10, 2);
    cdw(&mut r, 12, 13);
    let out = h.send(&mut io, &capsule(&r, &[]));
    assert_eq!(types(&out), [kind::C2H_DATA, kind::CAPSULE_RESP]);
    let got = &out[24..24 + 14 * 512];
    assert_eq!(&got[..1024], &data[..]);
    assert_eq!(&got[1024..3072], &[0u8; 2048][..], "blocks 4..8 untouched");
    assert_eq!(&got[3072..], &big[..]);
}

#[test]
fn h2c_data_is_checked_against_its_r2t_before_its_data_is_read() {
    let mut h = H::new("");
    for (what, cccid, tweak, fes, fei) in [
        (
            "no R2T for that command",
            99u16,
            0u8,
            Fes::InvalidHeaderField,
            8u32,
        ),
        ("the wrong transfer tag", 8, 1, Fes::InvalidHeaderField, 10),
        ("the wrong offset", 8, 2, Fes::DataOutOfRange, 0),
        ("past the R2T", 8, 3, Fes::DataOutOfRange, 0),
    ] {
        let (_a, mut io, _) = connected(&mut h);
        let mut s = sqe(command::io::WRITE, 8, 1);
        set_sgl(&mut s, command::sgl::TRANSPORT, 65536);
        cdw(&mut s, 12, 127);
        let out = h.send(&mut io, &capsule(&s, &[]));
        let ttag = u16::from_le_bytes([out[10], out[11]]);
        let (ttag, off, len) = match tweak {
            1 => (ttag.wrapping_add(1), 0u32, 4096u32),
            2 => (ttag, 512, 4096),
            3 => (ttag, 0, 65536 + 512),
            _ => (ttag, 0, 4096),
        };
        // Only the header: the error must come before any data is held.
        let mut b = vec![kind::H2C_DATA, 0, 24, 24];
        b.extend_from_slice(&(24 + len).to_le_bytes());
        b.extend_from_slice(&cccid.to_le_bytes());
        b.extend_from_slice(&ttag.to_le_bytes());
        b.extend_from_slice(&off.to_le_bytes());
        b.extend_from_slice(&len.to_le_bytes());
        b.extend_from_slice(&[0; 4]);
        let out = h.send(&mut io, &b);
        assert_eq!(types(&out), [kind::C2H_TERM_REQ], "{what}");
        assert_eq!(u16::from_le_bytes([out[8], out[9]]), fes as u16, "{what}");
        assert_eq!(
            u32::from_le_bytes(out[10..14].try_into().unwrap()),
            fei,
            "{what}"
        );
        assert_eq!(&out[24..48], &b[..24], "{what}: the offending header");
        assert!(!io.wants_read(), "{what}");
    }
}

#[test]
fn before_its_connect_a_queue_holds_at_most_one_admin_capsule() {
    let mut h = H::new("");
    let mut q = h.queue();
    h.send(&mut q, &icreq(0));
    // A capsule announcing 8 KiB of data, sent a byte short: the buffer holds it, no more.
    let mut s = sqe(command::FABRICS, 1, 0);
    s[4] = command::fctype::CONNECT;
    set_sgl(&mut s, command::sgl::IN_CAPSULE, 8192);
    let c = capsule(&s, &vec![0u8; 8192]);
    h.send(&mut q, &c[..c.len() - 1]);
    assert!(q.rx.len() <= 72 + 8192 + 8, "{}", q.rx.len());
    // One more byte than an admin capsule may be: refused from its header.
    let mut q = h.queue();
    h.send(&mut q, &icreq(0));
    let mut big = c.clone();
    big[4..8].copy_from_slice(&(72u32 + 8193).to_le_bytes());
    let out = h.send(&mut q, &big[..8]);
    assert_eq!(types(&out), [kind::C2H_TERM_REQ]);
    assert_eq!(
        u16::from_le_bytes([out[8], out[9]]),
        Fes::DataLimitExceeded as u16
    );
}

#[test]
fn a_fua_write_on_page_cache_completes_only_once_its_flush_did() {
    let mut h = H::new("");
    let (_a, mut io, _) = connected(&mut h);
    let out = h.send(&mut io, &write_cmd(3, 0, 1, &[5; 512], true));
    assert!(completions(&out).is_empty(), "held until durable");
    let t = h.flushes();
    assert_eq!(t.len(), 1);
    let out = h.flush_done(&mut io, t[0], FlushStatus::Durable);
    assert_eq!(completions(&out), [(3, 0, 0)]);
    // A Flush likewise; a failed flush is a Write Fault (DNR).
    let out = h.send(&mut io, &capsule(&sqe(command::io::FLUSH, 4, 1), &[]));
    assert!(completions(&out).is_empty());
    let t = h.flushes();
    let out = h.flush_done(&mut io, t[0], FlushStatus::IoError);
    assert_eq!(completions(&out), [(4, 0, status(Status::WRITE_FAULT))]);
}

#[test]
fn a_data_digest_error_fails_the_command_not_the_connection() {
    let mut h = H::new("");
    let mut a = h.queue();
    h.send(&mut a, &icreq(2));
    let mut c = connect_cmd(1, 0, 0xffff, SUB, HOST);
    // With a data digest: flag, digest after the data.
    c[1] |= pdu::flag::DDGSTF;
    let plen = c.len() as u32 + 4;
    c[4..8].copy_from_slice(&plen.to_le_bytes());
    let d = crc32c(&c[72..]);
    c.extend_from_slice(&d.to_le_bytes());
    assert_eq!(completions(&h.send(&mut a, &c))[0].2, 0);
    let mut c2 = connect_cmd(1, 0, 0xffff, SUB, HOST);
    c2[1] |= pdu::flag::DDGSTF;
    c2[4..8].copy_from_slice(&plen.to_le_bytes());
    c2.extend_from_slice(&(d ^ 1).to_le_bytes());
    let out = h.send(&mut a, &c2);
    assert_eq!(
        completions(&out),
        [(1, 0, status(Status::TRANSIENT_TRANSPORT))]
    );
    assert!(a.wants_read(), "the admitted connection goes on");
    // Before its Connect, a Connect that is not accepted (here: its data failed) is the one
    // command the peer had: answered, then closed.
    let mut b = h.queue();
    h.send(&mut b, &icreq(2));
    let out = h.send(&mut b, &c2);
    assert_eq!(
        completions(&out),
        [(1, 0, status(Status::TRANSIENT_TRANSPORT))]
    );
    assert!(!b.wants_read(), "an unadmitted connection closes");
}

#[test]
fn a_host_that_does_not_read_stops_being_read() {
    let mut h = H::new("");
    let (_a, mut io, _) = connected(&mut h);
    let mut r = sqe(command::io::READ, 1, 1);
    set_sgl(&mut r, command::sgl::TRANSPORT, 64 * 1024);
    cdw(&mut r, 12, 127);
    let one = capsule(&r, &[]);
    // Feed reads without taking out what the queue sends.
    let mut fed = 0;
    while !io.recv_space().is_empty() && fed < 100 {
        let mut c = one.clone();
        c[10..12].copy_from_slice(&(fed as u16).to_le_bytes());
        let space = io.recv_space();
        space[..c.len()].copy_from_slice(&c);
        let mut env = h.env();
        io.received(c.len(), &mut env);
        fed += 1;
    }
    assert!(fed < 10, "stopped after {fed} reads");
    assert!(io.pending_tx().len() < TX_HIGH + 70 * 1024);
    // Once drained it takes more again.
    let n = io.pending_tx().len();
    io.sent(n);
    assert!(io.wants_read());
}

/// A Write whose data comes by R2T on an I/O queue whose controller is no longer enabled is a
/// Sequence Error, as a Write in the capsule is (it got an R2T and completed); data of one
/// under way when the controller goes never lands, and the Write fails.
#[test]
fn a_write_by_r2t_of_a_controller_not_enabled_fails_and_lands_nothing() {
    let mut h = H::new("");
    let (mut a, mut io, _) = connected(&mut h);
    let r2t_write = |cid: u16, slba: u32| {
        let mut s = sqe(command::io::WRITE, cid, 1);
        set_sgl(&mut s, command::sgl::TRANSPORT, 4096);
        cdw(&mut s, 10, slba);
        cdw(&mut s, 12, 7);
        capsule(&s, &[])
    };
    // One under way: its R2T came, its data has not.
    let out = h.send(&mut io, &r2t_write(8, 8));
    assert_eq!(types(&out), [kind::R2T]);
    let ttag = u16::from_le_bytes([out[10], out[11]]);
    // The host disables the controller (CC.EN = 0).
    let mut set = sqe(command::FABRICS, 3, 0);
    set[4] = command::fctype::PROPERTY_SET;
    set[44..48].copy_from_slice(&0x14u32.to_le_bytes());
    set[48..52].copy_from_slice(&0u32.to_le_bytes());
    assert_eq!(completions(&h.send(&mut a, &capsule(&set, &[])))[0].2, 0);
    // A new Write by R2T: refused at once.
    let out = h.send(&mut io, &r2t_write(9, 24));
    assert_eq!(completions(&out), [(9, 0, status(Status::SEQUENCE_ERROR))]);
    // The data of the one under way: refused, nothing placed.
    let mut b = vec![kind::H2C_DATA, 4, 24, 24];
    b.extend_from_slice(&(24 + 4096u32).to_le_bytes());
    b.extend_from_slice(&8u16.to_le_bytes());
    b.extend_from_slice(&ttag.to_le_bytes());
    b.extend_from_slice(&0u32.to_le_bytes());
    b.extend_from_slice(&4096u32.to_le_bytes());
    b.extend_from_slice(&[0; 4]);
    b.extend_from_slice(&[0x77; 4096]);
    let out = h.send(&mut io, &b);
    assert_eq!(completions(&out), [(8, 0, status(Status::SEQUENCE_ERROR))]);
    let file = std::fs::read(h._dir.path().join("n1")).unwrap();
    assert!(
        file[8 * 512..8 * 512 + 4096].iter().all(|&b| b == 0),
        "nothing landed"
    );
}

/// A burst of deallocations, each within the limits, is zeroed at most `ZERO_BUDGET` bytes per
/// turn of the loop: what is left waits in the receive buffer, the queue reads nothing more,
/// and the next turn takes it (before: the whole burst in one go, holding up every queue of the
/// loop for as long as it took).
#[test]
fn zeroing_is_bounded_per_turn_of_the_loop() {
    let mut h = H::new("");
    let (_a, mut io, _) = connected(&mut h);
    // 12 deallocations of the whole 1 MiB namespace (2048 blocks of 512, DMRSL).
    let mut burst = Vec::new();
    for cid in 10..22u16 {
        let mut s = sqe(command::io::DSM, cid, 1);
        set_sgl(&mut s, command::sgl::IN_CAPSULE, 16);
        cdw(&mut s, 11, 1 << 2);
        let mut r = [0u8; 16];
        r[4..8].copy_from_slice(&2048u32.to_le_bytes());
        burst.extend_from_slice(&capsule(&s, &r));
    }
    let per_turn = (ZERO_BUDGET / (1 << 20)) as usize;
    let first = completions(&h.send(&mut io, &burst));
    assert_eq!(first.len(), per_turn, "{first:?}");
    assert!(first.iter().all(|c| c.2 == 0));
    assert!(io.spent() && !io.wants_read(), "the rest waits");
    let mut env = h.env();
    io.new_turn(&mut env);
    let out = io.pending_tx().to_vec();
    io.sent(out.len());
    let next = completions(&out);
    assert_eq!(next.len(), 12 - per_turn, "{next:?}");
    assert!(io.wants_read() && !io.spent());
}

/// An opening a reload retired (its namespace removed, or another file in its place) before
/// this controller's map heard of it (the admin queue's loop applies the reload in its own
/// turn, and may be later than this queue's) takes no more writes: an in-capsule Write, a
/// Write Zeroes and a deallocation answer Write Fault and leave the file as it was: it is the
/// operator's again once the reload is reported done. (They landed, then answered Write
/// Fault: a reused file took the bytes, or the zeros.)
#[test]
fn a_retired_opening_takes_no_write_of_any_kind() {
    let mut h = H::new("");
    let (_a, mut io, _) = connected(&mut h);
    let out = h.send(&mut io, &write_cmd(3, 0, 1, &[5; 512], false));
    assert_eq!(completions(&out), [(3, 0, 0)]);
    let Phase::Io(q) = &io.phase else {
        panic!("not an I/O queue")
    };
    let ns = Arc::clone(&q.ctrl.namespaces().1.get(&1).unwrap().ns);
    ns.retire();
    let fault = status(Status::WRITE_FAULT);
    let out = h.send(&mut io, &write_cmd(4, 1, 1, &[6; 512], false));
    assert_eq!(completions(&out), [(4, 0, fault)], "Write");
    let mut wz = sqe(command::io::WRITE_ZEROES, 5, 1);
    cdw(&mut wz, 12, 0);
    let out = h.send(&mut io, &capsule(&wz, &[]));
    assert_eq!(completions(&out), [(5, 0, fault)], "Write Zeroes");
    let mut dsm = sqe(command::io::DSM, 6, 1);
    set_sgl(&mut dsm, command::sgl::IN_CAPSULE, 16);
    cdw(&mut dsm, 11, 1 << 2);
    let mut r = [0u8; 16];
    r[4..8].copy_from_slice(&2u32.to_le_bytes());
    let out = h.send(&mut io, &capsule(&dsm, &r));
    assert_eq!(completions(&out), [(6, 0, fault)], "deallocation");
    let mut file = vec![0u8; 1024];
    ns.mapping.read_at(0, &mut file).unwrap();
    assert_eq!(
        &file[..512],
        &[5; 512][..],
        "block 0 neither zeroed nor deallocated"
    );
    assert_eq!(&file[512..], &[0; 512][..], "block 1 not written");
}

/// What a reload that puts another file at nsid 1 does to `io`'s controller: the new opening
/// is its nsid 1 from now on (kept open by the table returned, in a directory of its own).
fn another_file_at_nsid_1(io: &Queue) -> (tempfile::TempDir, NamespaceTable) {
    let d = tempfile::tempdir().unwrap();
    let text = format!(
        "listen = [\"nvme-tcp://127.0.0.1:4420\"]\n[[subsystem]]\nnqn = \"{SUB}\"\n\
         hosts = [{{ nqn = \"{HOST}\" }}]\n[[subsystem.namespace]]\nnsid = 1\npath = \"other\"\n\
         size = \"1MiB\"\nblock_size = 512\n"
    );
    let cfg = Config::from_toml(&text, d.path()).unwrap();
    let table = NamespaceTable::open_all(&cfg).unwrap();
    let sub = rpma_common::proto::nqn::Nqn::new(SUB).unwrap();
    let Phase::Io(q) = &io.phase else {
        panic!("not an I/O queue")
    };
    q.ctrl
        .set_namespaces(vec![Arc::clone(table.get(&sub, 1).unwrap())], &[1]);
    (d, table)
}

/// A FUA Write on page-cache whose sync was in flight when a reload put another file in place
/// of its namespace's: the Flush that the replacement fails once (on any queue of the
/// controller) came before the Write completed, so it does not cover it; the Write itself
/// completes with a Write Fault, not success (its bytes are in a file the host no longer
/// reads). (The Write completed with success, and the next Flush too: its bytes were lost
/// with no error ever said.)
#[test]
fn a_write_whose_file_a_reload_replaced_before_it_completed_is_a_write_fault() {
    let mut h = H::new("");
    let (_a, mut io, _) = connected(&mut h);
    let out = h.send(&mut io, &write_cmd(3, 0, 1, &[5; 512], true));
    assert!(completions(&out).is_empty(), "held until durable");
    let t = h.flushes();
    assert_eq!(t.len(), 1);
    // The reload: another file at nsid 1.
    let _other = another_file_at_nsid_1(&io);
    // The Flush the replacement fails, before the Write completed.
    let out = h.send(&mut io, &capsule(&sqe(command::io::FLUSH, 4, 1), &[]));
    assert_eq!(completions(&out), [(4, 0, status(Status::WRITE_FAULT))]);
    let out = h.flush_done(&mut io, t[0], FlushStatus::Durable);
    assert_eq!(
        completions(&out),
        [(3, 0, status(Status::WRITE_FAULT))],
        "the Write's bytes are in the old file"
    );
    // Written from now on: the new file, and answered.
    let out = h.send(&mut io, &write_cmd(5, 0, 1, &[6; 512], false));
    assert_eq!(completions(&out), [(5, 0, 0)]);
}

/// Turning the write cache off (Set Features 06h, WCE 0) after a reload put another file in
/// place of a page-cache namespace: what the cache held went to the old file, and with the
/// cache off the host sends no Flush that could say so later: the Set Features answers Write
/// Fault (after the new file is synced), as a Flush would. (It answered success.)
#[test]
fn turning_the_write_cache_off_over_a_replaced_file_is_a_write_fault() {
    let mut h = H::new("");
    let (mut a, mut io, _) = connected(&mut h);
    let out = h.send(&mut io, &write_cmd(3, 0, 1, &[5; 512], false));
    assert_eq!(completions(&out), [(3, 0, 0)], "cached");
    let _other = another_file_at_nsid_1(&io);
    let mut set = sqe(command::admin::SET_FEATURES, 7, 0);
    cdw(&mut set, 10, 0x06);
    cdw(&mut set, 11, 0);
    let out = h.send(&mut a, &capsule(&set, &[]));
    assert!(completions(&out).is_empty(), "the new file is synced first");
    let t = h.flushes();
    assert_eq!(t.len(), 1);
    let out = h.flush_done(&mut a, t[0], FlushStatus::Durable);
    assert_eq!(completions(&out), [(7, 0, status(Status::WRITE_FAULT))]);
}
