//! A small NVMe/TCP host for the tests: it speaks the PDUs of the NVMe over TCP transport
//! specification over a blocking TCP connection, written from the spec's field offsets on its
//! own (not the target's codec), so that a mistake shared by both ends does not pass unseen.
//! The kernel's host in the VM lab (tests/tests/nvme_tcp_vm.rs) is the other check.
//!
//! [`Host`] is one connection (one queue): [`Host::connect_tcp`] + [`Host::icreq`], then
//! [`Host::command`] runs any command, moving its data in the capsule, by R2T/H2CData or from
//! C2HData; [`Controller`] sets up an admin queue and I/O queues the way the Linux host does
//! (Connect, CC enable, Identify, Set Features Number of Queues). Raw PDUs go out with
//! [`Host::send_raw`] and come back with [`Host::recv`], for the malformed-input tests.
//! Every read has a deadline (`read_timeout`), so a target that does not answer fails a test
//! instead of hanging it.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// The discovery subsystem's NQN.
pub const DISCOVERY_NQN: &str = "nqn.2014-08.org.nvmexpress.discovery";
/// How long a reply may take before the test fails.
pub const REPLY_WITHIN: Duration = Duration::from_secs(20);

/// CRC32C (Castagnoli, init and final xor all ones), bitwise: independent of the target's.
pub fn crc32c(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0x82f6_3b78
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

/// PDU types.
pub mod pdu {
    /// ICReq.
    pub const IC_REQ: u8 = 0x00;
    /// ICResp.
    pub const IC_RESP: u8 = 0x01;
    /// H2CTermReq.
    pub const H2C_TERM: u8 = 0x02;
    /// C2HTermReq.
    pub const C2H_TERM: u8 = 0x03;
    /// CapsuleCmd.
    pub const CMD: u8 = 0x04;
    /// CapsuleResp.
    pub const RESP: u8 = 0x05;
    /// H2CData.
    pub const H2C_DATA: u8 = 0x06;
    /// C2HData.
    pub const C2H_DATA: u8 = 0x07;
    /// R2T.
    pub const R2T: u8 = 0x09;
}

/// A PDU as received.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rx {
    /// Type.
    pub kind: u8,
    /// Flags.
    pub flags: u8,
    /// The header (HLEN bytes, without its digest).
    pub header: Vec<u8>,
    /// The data.
    pub data: Vec<u8>,
}

impl Rx {
    /// A little-endian u16 of the header.
    pub fn u16(&self, at: usize) -> u16 {
        u16::from_le_bytes([self.header[at], self.header[at + 1]])
    }

    /// A little-endian u32 of the header.
    pub fn u32(&self, at: usize) -> u32 {
        u32::from_le_bytes(self.header[at..at + 4].try_into().unwrap())
    }
}

/// A C2HTermReq's contents.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Term {
    /// Fatal error status.
    pub fes: u16,
    /// Fatal error information.
    pub fei: u32,
    /// The offending PDU header it carries.
    pub data: Vec<u8>,
}

/// What went wrong talking to the target.
#[derive(Debug)]
pub enum Error {
    /// It sent a C2HTermReq.
    Terminated(Term),
    /// The connection closed (or failed) without one.
    Closed(String),
    /// It sent something that is not NVMe/TCP as this host expects.
    Protocol(String),
}

/// A completion.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    /// Dword 0.
    pub dw0: u32,
    /// Dword 1.
    pub dw1: u32,
    /// The status field without the phase bit: (DNR << 14) | (SCT << 8) | SC.
    pub status: u16,
    /// Data the command returned.
    pub data: Vec<u8>,
    /// The data came with the SUCCESS flag (no CapsuleResp).
    pub by_success_flag: bool,
}

impl Completion {
    /// SCT << 8 | SC (without DNR).
    pub fn code(&self) -> u16 {
        self.status & 0x7ff
    }

    /// Do Not Retry.
    pub fn dnr(&self) -> bool {
        self.status & 0x4000 != 0
    }

    /// Success.
    pub fn ok(&self) -> bool {
        self.code() == 0
    }
}

/// Status codes (SCT << 8 | SC) the tests look for.
pub mod sc {
    /// Invalid Command Opcode.
    pub const INVALID_OPCODE: u16 = 0x001;
    /// Invalid Field in Command.
    pub const INVALID_FIELD: u16 = 0x002;
    /// Invalid Namespace or Format.
    pub const INVALID_NS: u16 = 0x00b;
    /// Command Sequence Error.
    pub const SEQUENCE: u16 = 0x00c;
    /// Data SGL Length Invalid.
    pub const SGL_LENGTH: u16 = 0x00f;
    /// Namespace is Write Protected.
    pub const WRITE_PROTECTED: u16 = 0x020;
    /// Transient Transport Error.
    pub const TRANSIENT: u16 = 0x022;
    /// LBA Out of Range.
    pub const LBA_RANGE: u16 = 0x080;
    /// Connect Invalid Parameters.
    pub const CONNECT_INVALID_PARAM: u16 = 0x182;
    /// Connect Controller Busy.
    pub const CONNECT_BUSY: u16 = 0x181;
    /// Connect Invalid Host.
    pub const CONNECT_INVALID_HOST: u16 = 0x184;
    /// Authentication Required.
    pub const AUTH_REQUIRED: u16 = 0x191;
    /// Write Fault.
    pub const WRITE_FAULT: u16 = 0x280;
    /// Unrecovered Read Error.
    pub const UNRECOVERED_READ: u16 = 0x281;
}

/// A 64-byte submission queue entry under construction.
#[derive(Debug, Clone, Copy)]
pub struct Sqe(pub [u8; 64]);

impl Sqe {
    /// Opcode `opcode` for namespace `nsid`, SGLs (PSDT 01b).
    pub fn new(opcode: u8, nsid: u32) -> Sqe {
        let mut s = [0u8; 64];
        s[0] = opcode;
        s[1] = 0x40;
        s[4..8].copy_from_slice(&nsid.to_le_bytes());
        Sqe(s)
    }

    /// A Fabrics command of type `fctype`.
    pub fn fabrics(fctype: u8) -> Sqe {
        let mut s = Sqe::new(0x7f, 0);
        s.0[4] = fctype;
        s
    }

    /// Command dword `n` (10..=15).
    pub fn cdw(mut self, n: usize, v: u32) -> Sqe {
        let at = 40 + 4 * (n - 10);
        self.0[at..at + 4].copy_from_slice(&v.to_le_bytes());
        self
    }

    /// A byte.
    pub fn byte(mut self, at: usize, v: u8) -> Sqe {
        self.0[at] = v;
        self
    }

    /// A little-endian u16.
    pub fn u16(mut self, at: usize, v: u16) -> Sqe {
        self.0[at..at + 2].copy_from_slice(&v.to_le_bytes());
        self
    }

    /// A little-endian u32.
    pub fn u32(mut self, at: usize, v: u32) -> Sqe {
        self.0[at..at + 4].copy_from_slice(&v.to_le_bytes());
        self
    }

    fn sgl(&mut self, addr: u64, len: u32, kind: u8) {
        self.0[24..32].copy_from_slice(&addr.to_le_bytes());
        self.0[32..36].copy_from_slice(&len.to_le_bytes());
        self.0[36..39].fill(0);
        self.0[39] = kind;
    }
}

/// One connection to the target (one queue).
#[derive(Debug)]
pub struct Host {
    stream: TcpStream,
    /// Header digests negotiated.
    pub hdgst: bool,
    /// Data digests negotiated.
    pub ddgst: bool,
    /// MAXH2CDATA from the ICResp.
    pub maxh2cdata: u32,
    /// In-capsule data this host sends at most (the target's 8 KiB).
    pub in_capsule: usize,
    next_cid: u16,
}

/// SGL descriptor types.
const SGL_IN_CAPSULE: u8 = 0x01;
const SGL_TRANSPORT: u8 = 0x5a;

impl Host {
    /// A TCP connection to `addr` with the reply deadline.
    pub fn connect_tcp(addr: &str) -> TcpStream {
        let s = TcpStream::connect(addr).unwrap_or_else(|e| panic!("connect to {addr}: {e}"));
        s.set_read_timeout(Some(REPLY_WITHIN)).unwrap();
        s.set_nodelay(true).unwrap();
        s
    }

    /// Wraps a connected stream that has not sent its ICReq yet.
    pub fn raw(stream: TcpStream) -> Host {
        Host {
            stream,
            hdgst: false,
            ddgst: false,
            maxh2cdata: 4096,
            in_capsule: 8192,
            next_cid: 1,
        }
    }

    /// Sends an ICReq asking for the digests and reads the ICResp, which must grant exactly
    /// them and offer a MAXH2CDATA the spec allows.
    pub fn icreq(stream: TcpStream, hdgst: bool, ddgst: bool) -> Result<Host, Error> {
        let mut h = Host::raw(stream);
        let digest = u8::from(hdgst) | (u8::from(ddgst) << 1);
        h.send_raw(&icreq_pdu(0, 0, digest));
        let r = h.recv_plain()?;
        if r.kind != pdu::IC_RESP || r.header.len() != 128 || !r.data.is_empty() {
            return Err(Error::Protocol(format!("not an ICResp: {r:?}")));
        }
        if r.u16(8) != 0 || r.header[10] != 0 || r.header[11] != digest {
            return Err(Error::Protocol(format!(
                "ICResp pfv {} cpda {} digest {} (asked {digest})",
                r.u16(8),
                r.header[10],
                r.header[11]
            )));
        }
        h.maxh2cdata = r.u32(12);
        if h.maxh2cdata < 4096 || !h.maxh2cdata.is_multiple_of(4) {
            return Err(Error::Protocol(format!("MAXH2CDATA {}", h.maxh2cdata)));
        }
        h.hdgst = hdgst;
        h.ddgst = ddgst;
        Ok(h)
    }

    /// The stream (to set options, shut down, or read raw).
    pub fn stream(&self) -> &TcpStream {
        &self.stream
    }

    /// Writes bytes as they are.
    pub fn send_raw(&mut self, bytes: &[u8]) {
        // The target may close first (a test of a refusal): the read that follows says so.
        let _ = self.stream.write_all(bytes);
    }

    fn read_exact(&mut self, buf: &mut [u8]) -> Result<(), Error> {
        self.stream
            .read_exact(buf)
            .map_err(|e| Error::Closed(e.to_string()))
    }

    /// Reads one PDU of the ICReq phase (no digests).
    fn recv_plain(&mut self) -> Result<Rx, Error> {
        let (hd, dd) = (self.hdgst, self.ddgst);
        self.hdgst = false;
        self.ddgst = false;
        let r = self.recv();
        self.hdgst = hd;
        self.ddgst = dd;
        r
    }

    /// Reads one PDU, checking its digests; a C2HTermReq is returned as
    /// [`Error::Terminated`].
    pub fn recv(&mut self) -> Result<Rx, Error> {
        let mut ch = [0u8; 8];
        self.read_exact(&mut ch)?;
        let (kind, flags, hlen, pdo) = (ch[0], ch[1], ch[2] as usize, ch[3] as usize);
        let plen = u32::from_le_bytes(ch[4..8].try_into().unwrap()) as usize;
        if hlen < 8 || plen < hlen || plen > (1 << 24) {
            return Err(Error::Protocol(format!("header {ch:?}")));
        }
        let mut rest = vec![0u8; plen - 8];
        self.read_exact(&mut rest)?;
        let mut whole = ch.to_vec();
        whole.extend_from_slice(&rest);
        let header = whole[..hlen].to_vec();
        if kind == pdu::C2H_TERM {
            return Err(Error::Terminated(Term {
                fes: u16::from_le_bytes([whole[8], whole[9]]),
                fei: u32::from_le_bytes(whole[10..14].try_into().unwrap()),
                data: whole[hlen.min(plen)..].to_vec(),
            }));
        }
        let carries_digests = !matches!(kind, pdu::IC_RESP | pdu::C2H_TERM);
        let hd = if self.hdgst && carries_digests { 4 } else { 0 };
        if hd > 0 {
            if flags & 1 == 0 {
                return Err(Error::Protocol("HDGSTF missing".into()));
            }
            let got = u32::from_le_bytes(whole[hlen..hlen + 4].try_into().unwrap());
            if got != crc32c(&header) {
                return Err(Error::Protocol("header digest".into()));
            }
        }
        let data = if plen > hlen + hd {
            let dd = if self.ddgst { 4 } else { 0 };
            if pdo < hlen + hd || pdo > plen - dd {
                return Err(Error::Protocol(format!("PDO {pdo}")));
            }
            let d = whole[pdo..plen - dd].to_vec();
            if dd > 0 {
                if flags & 2 == 0 {
                    return Err(Error::Protocol("DDGSTF missing".into()));
                }
                let got = u32::from_le_bytes(whole[plen - 4..].try_into().unwrap());
                if got != crc32c(&d) {
                    return Err(Error::Protocol("data digest".into()));
                }
            }
            d
        } else {
            Vec::new()
        };
        Ok(Rx {
            kind,
            flags,
            header,
            data,
        })
    }

    /// A PDU framed as this host frames them: `rest` after the common header, the header
    /// digest, `data` and its digest, as negotiated.
    pub fn frame(&self, kind: u8, mut flags: u8, rest: &[u8], data: &[u8]) -> Vec<u8> {
        let hlen = 8 + rest.len();
        let hd = if self.hdgst { 4 } else { 0 };
        let dd = if self.ddgst && !data.is_empty() { 4 } else { 0 };
        if self.hdgst {
            flags |= 1;
        }
        if dd > 0 {
            flags |= 2;
        }
        let pdo = if data.is_empty() { 0 } else { hlen + hd };
        let plen = hlen + hd + data.len() + dd;
        let mut b = vec![kind, flags, hlen as u8, pdo as u8];
        b.extend_from_slice(&(plen as u32).to_le_bytes());
        b.extend_from_slice(rest);
        if hd > 0 {
            let d = crc32c(&b);
            b.extend_from_slice(&d.to_le_bytes());
        }
        b.extend_from_slice(data);
        if dd > 0 {
            b.extend_from_slice(&crc32c(data).to_le_bytes());
        }
        b
    }

    /// A fresh command identifier.
    pub fn cid(&mut self) -> u16 {
        self.next_cid = self.next_cid.wrapping_add(1).max(1);
        self.next_cid
    }

    /// Sends a command (its data in the capsule when it fits, else by R2T) and returns its
    /// completion; `room` is the data the command returns, if any.
    pub fn command(&mut self, sqe: Sqe, out: &[u8], room: u32) -> Result<Completion, Error> {
        let cid = self.cid();
        self.command_cid(sqe, cid, out, room)
    }

    /// [`command`](Self::command) with the given command identifier.
    pub fn command_cid(
        &mut self,
        mut sqe: Sqe,
        cid: u16,
        out: &[u8],
        room: u32,
    ) -> Result<Completion, Error> {
        sqe.0[2..4].copy_from_slice(&cid.to_le_bytes());
        let inline = !out.is_empty() && out.len() <= self.in_capsule;
        if inline {
            sqe.sgl(0, out.len() as u32, SGL_IN_CAPSULE);
        } else {
            let len = if out.is_empty() {
                room
            } else {
                out.len() as u32
            };
            sqe.sgl(0, len, SGL_TRANSPORT);
        }
        let pdu = self.frame(pdu::CMD, 0, &sqe.0, if inline { out } else { &[] });
        self.send_raw(&pdu);
        self.complete(cid, if inline { &[] } else { out })
    }

    /// Serves R2Ts for `cid` from `out` and collects its data until its completion.
    pub fn complete(&mut self, cid: u16, out: &[u8]) -> Result<Completion, Error> {
        let mut data = Vec::new();
        loop {
            let r = self.recv()?;
            match r.kind {
                pdu::RESP => {
                    let c = &r.header[8..24];
                    let got = u16::from_le_bytes([c[12], c[13]]);
                    if got != cid {
                        return Err(Error::Protocol(format!("completion of {got}, not {cid}")));
                    }
                    return Ok(Completion {
                        dw0: u32::from_le_bytes(c[0..4].try_into().unwrap()),
                        dw1: u32::from_le_bytes(c[4..8].try_into().unwrap()),
                        status: u16::from_le_bytes([c[14], c[15]]) >> 1,
                        data,
                        by_success_flag: false,
                    });
                }
                pdu::C2H_DATA => {
                    if r.u16(8) != cid || r.u32(12) as usize != data.len() {
                        return Err(Error::Protocol(format!("C2HData {:?}", &r.header)));
                    }
                    data.extend_from_slice(&r.data);
                    if r.flags & 0x08 != 0 {
                        return Ok(Completion {
                            dw0: 0,
                            dw1: 0,
                            status: 0,
                            data,
                            by_success_flag: true,
                        });
                    }
                }
                pdu::R2T => {
                    let (ttag, off, len) = (r.u16(10), r.u32(12) as usize, r.u32(16) as usize);
                    if r.u16(8) != cid || off + len > out.len() {
                        return Err(Error::Protocol(format!("R2T {:?}", &r.header)));
                    }
                    let mut at = off;
                    while at < off + len {
                        let n = (off + len - at).min(self.maxh2cdata as usize);
                        let last = at + n == off + len;
                        let h = h2c_header(cid, ttag, at as u32, n as u32);
                        let p = self.frame(
                            pdu::H2C_DATA,
                            if last { 4 } else { 0 },
                            &h,
                            &out[at..at + n],
                        );
                        self.send_raw(&p);
                        at += n;
                    }
                }
                other => return Err(Error::Protocol(format!("unexpected PDU type {other}"))),
            }
        }
    }
}

/// The 16 bytes of an H2CData header after its common header.
pub fn h2c_header(cccid: u16, ttag: u16, datao: u32, datal: u32) -> Vec<u8> {
    let mut h = Vec::new();
    h.extend_from_slice(&cccid.to_le_bytes());
    h.extend_from_slice(&ttag.to_le_bytes());
    h.extend_from_slice(&datao.to_le_bytes());
    h.extend_from_slice(&datal.to_le_bytes());
    h.extend_from_slice(&[0; 4]);
    h
}

/// An ICReq.
pub fn icreq_pdu(pfv: u16, hpda: u8, digest: u8) -> Vec<u8> {
    let mut b = vec![pdu::IC_REQ, 0, 128, 0, 128, 0, 0, 0];
    b.extend_from_slice(&pfv.to_le_bytes());
    b.push(hpda);
    b.push(digest);
    b.resize(128, 0);
    b
}

/// The 1024 bytes of Connect data.
pub fn connect_data(host_id: [u8; 16], cntlid: u16, subnqn: &str, hostnqn: &str) -> Vec<u8> {
    let mut d = vec![0u8; 1024];
    d[..16].copy_from_slice(&host_id);
    d[16..18].copy_from_slice(&cntlid.to_le_bytes());
    d[256..256 + subnqn.len()].copy_from_slice(subnqn.as_bytes());
    d[512..512 + hostnqn.len()].copy_from_slice(hostnqn.as_bytes());
    d
}

/// A Connect command: queue `qid` of `sqsize + 1` entries, keep-alive `kato_ms`.
pub fn connect_sqe(qid: u16, sqsize: u16, kato_ms: u32) -> Sqe {
    Sqe::fabrics(0x01)
        .u16(42, qid)
        .u16(44, sqsize)
        .u32(48, kato_ms)
}

/// CC with EN set and the queue entry sizes the Linux host writes.
pub const CC_ENABLE: u32 = 1 | (6 << 16) | (4 << 20);

/// An admin queue set up as the Linux host does, and I/O queues on connections of their own.
#[derive(Debug)]
pub struct Controller {
    /// The admin queue.
    pub admin: Host,
    /// Controller id.
    pub cntlid: u16,
    /// The host NQN.
    pub host: String,
    /// The subsystem NQN.
    pub subsystem: String,
    /// The host identifier.
    pub host_id: [u8; 16],
    /// Where the target listens.
    pub addr: String,
    /// Digests asked for on every queue.
    pub digests: (bool, bool),
}

impl Controller {
    /// Connects the admin queue (keep-alive 5 s) and enables the controller.
    pub fn connect(
        addr: &str,
        subsystem: &str,
        host: &str,
        digests: (bool, bool),
    ) -> Result<Controller, Completion> {
        Controller::connect_kato(addr, subsystem, host, digests, 5000)
    }

    /// [`connect`](Self::connect) with a keep-alive of `kato_ms` (a test that sends none and
    /// must not see its controller expire on a loaded machine asks for a long one).
    pub fn connect_kato(
        addr: &str,
        subsystem: &str,
        host: &str,
        digests: (bool, bool),
        kato_ms: u32,
    ) -> Result<Controller, Completion> {
        let mut admin =
            Host::icreq(Host::connect_tcp(addr), digests.0, digests.1).expect("ICReq/ICResp");
        let host_id = [0x5a; 16];
        let c = admin
            .command(
                connect_sqe(0, 31, kato_ms),
                &connect_data(host_id, 0xffff, subsystem, host),
                0,
            )
            .expect("Connect answered");
        if !c.ok() {
            return Err(c);
        }
        let mut ctrl = Controller {
            admin,
            cntlid: c.dw0 as u16,
            host: host.into(),
            subsystem: subsystem.into(),
            host_id,
            addr: addr.into(),
            digests,
        };
        let r = ctrl.property_set(0x14, CC_ENABLE);
        assert!(r.ok(), "CC enable: {r:?}");
        let csts = ctrl.property_get(0x1c, false);
        assert_eq!(csts.dw0 & 1, 1, "CSTS.RDY after CC.EN");
        Ok(ctrl)
    }

    /// Property Get (`eight`: an 8-byte property).
    pub fn property_get(&mut self, offset: u32, eight: bool) -> Completion {
        let sqe = Sqe::fabrics(0x04).byte(40, u8::from(eight)).u32(44, offset);
        self.admin.command(sqe, &[], 0).expect("Property Get")
    }

    /// Property Set of a 4-byte property.
    pub fn property_set(&mut self, offset: u32, value: u32) -> Completion {
        let sqe = Sqe::fabrics(0x00).u32(44, offset).u32(48, value);
        self.admin.command(sqe, &[], 0).expect("Property Set")
    }

    /// Identify with `cns` for `nsid` (4096 bytes).
    pub fn identify(&mut self, cns: u8, nsid: u32) -> Completion {
        let sqe = Sqe::new(0x06, nsid).cdw(10, u32::from(cns));
        self.admin.command(sqe, &[], 4096).expect("Identify")
    }

    /// Set Features `fid` to `value`.
    pub fn set_features(&mut self, fid: u8, value: u32) -> Completion {
        let sqe = Sqe::new(0x09, 0).cdw(10, u32::from(fid)).cdw(11, value);
        self.admin.command(sqe, &[], 0).expect("Set Features")
    }

    /// Get Log Page `lid`, `len` bytes from `offset`.
    pub fn get_log(&mut self, lid: u8, len: u32, offset: u64) -> Completion {
        let numd = len / 4 - 1;
        let sqe = Sqe::new(0x02, 0xffff_ffff)
            .cdw(10, u32::from(lid) | ((numd & 0xffff) << 16))
            .cdw(11, numd >> 16)
            .cdw(12, offset as u32)
            .cdw(13, (offset >> 32) as u32);
        self.admin.command(sqe, &[], len).expect("Get Log Page")
    }

    /// Waits until the controller heard of a reload (or a cleared failure) that changed
    /// `nsid`: its Changed Namespace List names it (read with RAE 0, which empties it for the
    /// next change). A reload reaches each controller in its own loop's turn.
    pub fn wait_changed(&mut self, nsid: u32) {
        let deadline = std::time::Instant::now() + REPLY_WITHIN;
        loop {
            let c = self.get_log(0x04, 4096, 0);
            assert!(c.ok(), "Changed Namespace List: {c:?}");
            if c.data.chunks_exact(4).any(|id| id == nsid.to_le_bytes()) {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "controller {} never heard that namespace {nsid} changed",
                self.cntlid
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Connects I/O queue `qid` on a connection of its own.
    pub fn io_queue(&self, qid: u16) -> Result<Host, Completion> {
        let mut q = Host::icreq(
            Host::connect_tcp(&self.addr),
            self.digests.0,
            self.digests.1,
        )
        .expect("ICReq/ICResp");
        let c = q
            .command(
                connect_sqe(qid, 127, 0),
                &connect_data(self.host_id, self.cntlid, &self.subsystem, &self.host),
                0,
            )
            .expect("I/O queue Connect answered");
        if c.ok() {
            Ok(q)
        } else {
            Err(c)
        }
    }
}

/// I/O commands on a connected I/O queue.
impl Host {
    /// Write `data` at block `slba` of `nsid` (`bs`-byte blocks), FUA if asked.
    pub fn write(
        &mut self,
        nsid: u32,
        slba: u64,
        bs: u32,
        data: &[u8],
        fua: bool,
    ) -> Result<Completion, Error> {
        let nlb = (data.len() as u32 / bs) - 1;
        let sqe = Sqe::new(0x01, nsid)
            .cdw(10, slba as u32)
            .cdw(11, (slba >> 32) as u32)
            .cdw(12, nlb | if fua { 1 << 30 } else { 0 });
        self.command(sqe, data, 0)
    }

    /// Read `blocks` blocks at `slba` of `nsid`.
    pub fn read(
        &mut self,
        nsid: u32,
        slba: u64,
        bs: u32,
        blocks: u32,
    ) -> Result<Completion, Error> {
        let sqe = Sqe::new(0x02, nsid)
            .cdw(10, slba as u32)
            .cdw(11, (slba >> 32) as u32)
            .cdw(12, blocks - 1);
        self.command(sqe, &[], blocks * bs)
    }

    /// Flush `nsid`.
    pub fn flush(&mut self, nsid: u32) -> Result<Completion, Error> {
        self.command(Sqe::new(0x00, nsid), &[], 0)
    }
}
