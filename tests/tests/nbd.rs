//! `rpma-initiator nbd` against a real `rpma-target`, driven by the NBD clients people use
//! (qemu-io, qemu-img, nbdinfo, nbdcopy, fio's nbd engine) and by a raw client that misbehaves
//! on purpose; durability of FUA and FLUSH across a SIGKILL of the target; queue depth;
//! SIGTERM; the systemd template unit.
//!
//! A test whose client is not installed says SKIPPED (scripts/install-deps.sh installs them).

use std::io::{Read, Write};
use std::os::unix::net::{UnixDatagram, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use rpma_tests::{
    built, conn_args, four_namespace_target, initiator, noise as pattern, repo_file,
    run_with_deadline, text, Shm, Subsystem, Target,
};

const SUB: &str = "nqn.2026-11.io.rpma:nbd";
const HOST: &str = "nqn.2026-11.io.rpma:nbd-host";
/// nsid 1 of [`four_namespaces`]: page-cache, 8 MiB of 4096-byte blocks.
const NS1: u64 = 8 << 20;
const WAIT: Duration = Duration::from_secs(30);

/// A target in a scratch dir of its own serving SUB to any host: [`four_namespaces`] (nsid 1
/// page-cache 8 MiB, 2 read-only 1 MiB of 512-byte blocks, 3 volatile, 4 forced dax 2 MiB).
fn start(tag: &str) -> (tempfile::TempDir, Shm, Target) {
    four_namespace_target(tag, Subsystem::new(SUB).any_host(), 512)
}

/// Whether `tool` runs; else says why the test is skipped.
fn have(tool: &str) -> bool {
    let ok = Command::new(tool)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok();
    if !ok {
        eprintln!("SKIPPED: {tool} is not installed (scripts/install-deps.sh installs it)");
    }
    ok
}

/// A running `rpma-initiator nbd` on a Unix socket in the target's directory; SIGKILLed on drop.
struct Export {
    child: Option<Child>,
    sock: PathBuf,
    log: PathBuf,
    /// HOST:PORT when it listens on TCP (`--listen` in its arguments).
    tcp: Option<String>,
}

impl Export {
    /// Starts an export of `nsid` (extra `args` after `nbd`) and waits for its READY=1.
    fn start(t: &Target, nsid: u32, tag: &str, args: &[&str]) -> Export {
        let dir = t.dir();
        let sock = dir.join(format!("{tag}.sock"));
        let log = dir.join(format!("{tag}.log"));
        let notify_path = dir.join(format!("{tag}.notify"));
        let _ = std::fs::remove_file(&notify_path);
        let notify = UnixDatagram::bind(&notify_path).unwrap();
        let conn = conn_args(&t.url(), SUB, HOST, Some(nsid));
        let mut a: Vec<&str> = conn.iter().map(String::as_str).collect();
        a.push("nbd");
        let s = sock.to_str().unwrap().to_owned();
        let tcp = args
            .iter()
            .position(|a| *a == "--listen")
            .map(|i| args[i + 1].to_owned());
        if tcp.is_none() {
            a.extend(["--socket", &s]);
        }
        a.extend_from_slice(args);
        let child = Command::new(built("rpma-initiator"))
            .args(&a)
            .env("NOTIFY_SOCKET", &notify_path)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let mut e = Export {
            child: Some(child),
            sock,
            log,
            tcp,
        };
        let deadline = Instant::now() + WAIT;
        let mut buf = [0u8; 512];
        loop {
            assert!(
                Instant::now() < deadline,
                "no READY=1 within {WAIT:?}: {}",
                e.log()
            );
            if let Ok(Some(st)) = e.child.as_mut().unwrap().try_wait() {
                panic!("rpma-initiator nbd exited ({st}) before READY: {}", e.log());
            }
            notify
                .set_read_timeout(Some(Duration::from_millis(200)))
                .unwrap();
            if let Ok(n) = notify.recv(&mut buf) {
                if buf[..n].starts_with(b"READY=1") {
                    // READY=1 means the socket accepts.
                    match &e.tcp {
                        Some(a) => assert!(std::net::TcpStream::connect(a).is_ok()),
                        None => assert!(UnixStream::connect(&e.sock).is_ok(), "{}", e.log()),
                    }
                    return e;
                }
            }
        }
    }

    /// `nbd+unix:///rpma?socket=PATH`, or `nbd://HOST:PORT/rpma`.
    fn uri(&self) -> String {
        match &self.tcp {
            Some(a) => format!("nbd://{a}/rpma"),
            None => format!("nbd+unix:///rpma?socket={}", self.sock.display()),
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn pid(&self) -> i32 {
        self.child.as_ref().unwrap().id() as i32
    }

    fn running(&mut self) -> bool {
        matches!(self.child.as_mut().unwrap().try_wait(), Ok(None))
    }

    /// SIGTERM, then its exit status (within the deadline).
    fn term(&mut self) -> ExitStatus {
        // SAFETY: kill has no memory-safety preconditions; the pid is our live child's.
        assert_eq!(unsafe { libc::kill(self.pid(), libc::SIGTERM) }, 0);
        self.wait()
    }

    fn wait(&mut self) -> ExitStatus {
        let deadline = Instant::now() + WAIT;
        loop {
            if let Some(st) = self.child.as_mut().unwrap().try_wait().unwrap() {
                return st;
            }
            assert!(Instant::now() < deadline, "did not exit: {}", self.log());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits until the log has a line containing `what`; returns that line.
    fn log_line(&self, what: &str) -> String {
        let deadline = Instant::now() + WAIT;
        loop {
            if let Some(l) = self.log().lines().find(|l| l.contains(what)) {
                return l.to_owned();
            }
            assert!(
                Instant::now() < deadline,
                "no {what:?} in the log: {}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Export {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Runs a client tool within the deadline; panics with its output unless it succeeds.
fn tool(cmd: &mut Command) -> String {
    let o = run_with_deadline(cmd, WAIT);
    assert!(o.status.success(), "{cmd:?}: {}", text(&o));
    text(&o)
}

/// `rpma-initiator` with the target, subsystem, host and `--nsid nsid`, then `args`.
fn cli(t: &Target, nsid: u32, args: &[&str]) -> std::process::Output {
    let conn = conn_args(&t.url(), SUB, HOST, Some(nsid));
    let mut a: Vec<&str> = conn.iter().map(String::as_str).collect();
    a.extend_from_slice(args);
    let o = initiator(&a);
    assert!(o.status.success(), "{a:?}: {}", text(&o));
    o
}

/// The namespace's bytes `[offset, offset + len)`, read by `rpma-initiator read`.
fn cli_read(t: &Target, nsid: u32, offset: u64, len: u64) -> Vec<u8> {
    let out = t.dir().join(format!("read-{nsid}-{offset}-{len}"));
    let (o, l) = (offset.to_string(), len.to_string());
    cli(
        t,
        nsid,
        &[
            "read",
            "--offset",
            &o,
            "--length",
            &l,
            "--out",
            out.to_str().unwrap(),
        ],
    );
    let b = std::fs::read(&out).unwrap();
    let _ = std::fs::remove_file(&out);
    b
}

/// Writes `data` at `offset` with `rpma-initiator write --durable`.
fn cli_write(t: &Target, nsid: u32, offset: u64, data: &[u8]) {
    let f = t.dir().join(format!("write-{nsid}-{offset}"));
    std::fs::write(&f, data).unwrap();
    let o = offset.to_string();
    cli(
        t,
        nsid,
        &[
            "write",
            "--offset",
            &o,
            "--in",
            f.to_str().unwrap(),
            "--durable",
        ],
    );
    let _ = std::fs::remove_file(&f);
}

// ---- a raw client ----

const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
const REQUEST_MAGIC: u32 = 0x2560_9513;
const OPT_GO: u32 = 7;
const CMD_READ: u16 = 0;
const CMD_WRITE: u16 = 1;
const CMD_DISC: u16 = 2;
const CMD_FLUSH: u16 = 3;
const FUA: u16 = 1;
const EIO: u32 = 5;
const EINVAL: u32 = 22;
const ENOSPC: u32 = 28;

/// A hand-driven NBD client.
struct Raw(UnixStream);

impl Raw {
    /// Connected, greeting read and checked, client flags (fixed newstyle, no zeroes) sent.
    fn hello(sock: &Path) -> Raw {
        let s = UnixStream::connect(sock).unwrap();
        s.set_read_timeout(Some(WAIT)).unwrap();
        let mut r = Raw(s);
        let g = r.take(18);
        assert_eq!(&g[..16], b"NBDMAGICIHAVEOPT");
        r.send(&3u32.to_be_bytes());
        r
    }

    fn send(&mut self, b: &[u8]) {
        self.0.write_all(b).unwrap();
    }

    fn take(&mut self, n: usize) -> Vec<u8> {
        let mut b = vec![0u8; n];
        self.0.read_exact(&mut b).unwrap();
        b
    }

    fn option(&mut self, opt: u32, data: &[u8]) {
        let mut b = IHAVEOPT.to_be_bytes().to_vec();
        b.extend_from_slice(&opt.to_be_bytes());
        b.extend_from_slice(&(data.len() as u32).to_be_bytes());
        b.extend_from_slice(data);
        self.send(&b);
    }

    /// (option, reply type, data) of the next option reply.
    fn option_reply(&mut self) -> (u32, u32, Vec<u8>) {
        let h = self.take(20);
        assert_eq!(h[..8], 0x0003_e889_0455_65a9u64.to_be_bytes());
        let n = u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize;
        (
            u32::from_be_bytes(h[8..12].try_into().unwrap()),
            u32::from_be_bytes(h[12..16].try_into().unwrap()),
            self.take(n),
        )
    }

    /// NBD_OPT_GO for the default export (asking for the block sizes: alignment is enforced).
    fn go(&mut self) {
        let mut d = 0u32.to_be_bytes().to_vec();
        d.extend_from_slice(&1u16.to_be_bytes());
        d.extend_from_slice(&3u16.to_be_bytes());
        self.option(OPT_GO, &d);
        loop {
            let (_, ty, _) = self.option_reply();
            if ty == 1 {
                return;
            }
            assert_eq!(ty, 3, "NBD_REP_INFO or NBD_REP_ACK");
        }
    }

    /// A client in the transmission phase.
    fn connect(sock: &Path) -> Raw {
        let mut r = Raw::hello(sock);
        r.go();
        r
    }

    fn request(&mut self, kind: u16, flags: u16, handle: u64, offset: u64, len: u32) -> Vec<u8> {
        let mut b = REQUEST_MAGIC.to_be_bytes().to_vec();
        b.extend_from_slice(&flags.to_be_bytes());
        b.extend_from_slice(&kind.to_be_bytes());
        b.extend_from_slice(&handle.to_be_bytes());
        b.extend_from_slice(&offset.to_be_bytes());
        b.extend_from_slice(&len.to_be_bytes());
        b
    }

    /// (error, handle) of the next simple reply.
    fn reply(&mut self) -> (u32, u64) {
        let h = self.take(16);
        assert_eq!(h[..4], 0x6744_6698u32.to_be_bytes());
        (
            u32::from_be_bytes(h[4..8].try_into().unwrap()),
            u64::from_be_bytes(h[8..16].try_into().unwrap()),
        )
    }

    fn read(&mut self, offset: u64, len: u32) -> Result<Vec<u8>, u32> {
        let r = self.request(CMD_READ, 0, 9, offset, len);
        self.send(&r);
        match self.reply() {
            (0, 9) => Ok(self.take(len as usize)),
            (e, 9) => Err(e),
            (_, h) => panic!("reply to handle {h}"),
        }
    }

    fn write(&mut self, flags: u16, offset: u64, data: &[u8]) -> u32 {
        let mut r = self.request(CMD_WRITE, flags, 10, offset, data.len() as u32);
        r.extend_from_slice(data);
        self.send(&r);
        let (e, h) = self.reply();
        assert_eq!(h, 10);
        e
    }

    fn flush(&mut self) -> u32 {
        let r = self.request(CMD_FLUSH, 0, 11, 0, 0);
        self.send(&r);
        let (e, h) = self.reply();
        assert_eq!(h, 11);
        e
    }

    /// The server closed the connection (end of file or reset) within the deadline.
    fn closed(&mut self) -> bool {
        let mut b = [0u8; 64];
        loop {
            match self.0.read(&mut b) {
                Ok(0) => return true,
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
                Err(_) => return false,
            }
        }
    }
}

// ---- third-party clients ----

#[test]
fn qemu_io_across_block_boundaries_and_the_cli_see_the_same_bytes() {
    if !have("qemu-io") {
        return;
    }
    let (_d, _shm, t) = start("qemuio");
    let e = Export::start(&t, 1, "qemuio", &[]);
    let uri = e.uri();
    // 10000 bytes from 1000: partial first and last 4096-byte blocks (qemu reads, modifies,
    // writes them back), FUA on one write, then a flush.
    let out = tool(Command::new("qemu-io").args([
        "-f",
        "raw",
        &uri,
        "-c",
        "write -P 0x5a 1000 10000",
        "-c",
        "write -f -P 0x5b 20000 100",
        "-c",
        "write -P 0x5c 30000 9000",
        "-c",
        "write -z 32768 4096",
        "-c",
        "flush",
        "-c",
        "read -P 0x5a 1000 10000",
        "-c",
        "read -P 0x5c 30000 2768",
        "-c",
        "read -P 0 32768 4096",
        "-c",
        "read -P 0x5c 36864 2136",
        "-c",
        "read -P 0x5b 20000 100",
        "-c",
        "read -P 0 0 1000",
        "-c",
        "read -P 0 11000 9000",
    ]));
    assert!(!out.contains("verification failed"), "{out}");
    // The same bytes through the library's own CLI.
    let b = cli_read(&t, 1, 0, 49152);
    assert!(b[..1000].iter().all(|&x| x == 0));
    assert!(b[1000..11000].iter().all(|&x| x == 0x5a));
    assert!(b[11000..20000].iter().all(|&x| x == 0));
    assert!(b[20000..20100].iter().all(|&x| x == 0x5b));
    assert!(b[20100..30000].iter().all(|&x| x == 0));
    let z = &b[30000..];
    assert!(z[..2768].iter().all(|&x| x == 0x5c) && z[6864..9000].iter().all(|&x| x == 0x5c));
    assert!(z[2768..6864].iter().all(|&x| x == 0), "WRITE_ZEROES");
    assert!(z[9000..].iter().all(|&x| x == 0));
    // And the reverse: the CLI writes, qemu-io reads.
    cli(
        &t,
        1,
        &[
            "write",
            "--offset",
            "40000",
            "--pattern",
            "0x77",
            "--length",
            "5000",
        ],
    );
    let out = tool(Command::new("qemu-io").args([
        "-f",
        "raw",
        &uri,
        "-c",
        "read -P 0x77 40000 5000",
        "-c",
        "read -P 0 45000 3000",
    ]));
    assert!(!out.contains("verification failed"), "{out}");
    // A mismatch is seen: the check above can fail.
    let o = run_with_deadline(
        Command::new("qemu-io").args(["-f", "raw", &uri, "-c", "read -P 0x77 39999 2"]),
        WAIT,
    );
    assert!(text(&o).contains("verification failed"), "{}", text(&o));
}

#[test]
fn qemu_img_convert_compare_and_nbdcopy_round_trip() {
    if !have("qemu-img") || !have("nbdcopy") {
        return;
    }
    let (d, _shm, t) = start("convert");
    let e = Export::start(&t, 1, "convert", &[]);
    let uri = e.uri();
    let src = d.path().join("src.img");
    let img = pattern(1, NS1 as usize);
    std::fs::write(&src, &img).unwrap();
    let s = src.to_str().unwrap();
    tool(Command::new("qemu-img").args(["convert", "-n", "-f", "raw", "-O", "raw", s, &uri]));
    tool(Command::new("qemu-img").args(["compare", "-f", "raw", "-F", "raw", s, &uri]));
    assert!(
        cli_read(&t, 1, 0, NS1) == img,
        "bytes written over NBD differ in `read`"
    );

    // The CLI writes, nbdcopy reads (export -> file), a changed file goes back (file ->
    // export), and the CLI reads it.
    let two = pattern(2, 3 << 20);
    cli_write(&t, 1, 1 << 20, &two);
    let copy = d.path().join("copy.img");
    let c = copy.to_str().unwrap();
    tool(Command::new("nbdcopy").args([&uri, c]));
    let mut back = std::fs::read(&copy).unwrap();
    assert!(back[..1 << 20] == img[..1 << 20]);
    assert!(
        back[1 << 20..4 << 20] == two[..],
        "bytes the CLI wrote differ over NBD"
    );
    assert!(back[4 << 20..] == img[4 << 20..]);
    for (i, b) in back.iter_mut().enumerate().step_by(4093) {
        *b = b.wrapping_add(i as u8 | 1);
    }
    std::fs::write(&copy, &back).unwrap();
    tool(Command::new("nbdcopy").args([c, &uri]));
    assert!(cli_read(&t, 1, 0, NS1) == back, "nbdcopy file -> export");
    // qemu-img compare sees a difference too (the comparison can fail).
    let o = run_with_deadline(
        Command::new("qemu-img").args(["compare", "-f", "raw", "-F", "raw", s, &uri]),
        WAIT,
    );
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
}

#[test]
fn nbdinfo_reports_size_block_sizes_and_honest_flags() {
    if !have("nbdinfo") {
        return;
    }
    let (_d, _shm, t) = start("info");
    // nsid 1 over TCP, nsid 2 (read-only) over a Unix socket.
    let addr = format!("127.0.0.1:{}", rpma_tests::free_port());
    for (nsid, size, block, ro) in [(1, NS1, 4096, false), (2, 1u64 << 20, 512, true)] {
        let args: &[&str] = if nsid == 1 { &["--listen", &addr] } else { &[] };
        let e = Export::start(&t, nsid, &format!("info{nsid}"), args);
        let out = run_with_deadline(Command::new("nbdinfo").args(["--json", &e.uri()]), WAIT);
        assert!(out.status.success(), "{}", text(&out));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let x = &v["exports"][0];
        assert_eq!(x["export-name"], "rpma");
        assert_eq!(x["export-size"], size, "{x}");
        assert_eq!(x["block_size_minimum"], block, "{x}");
        assert_eq!(x["block_size_preferred"], 4096, "{x}");
        assert_eq!(x["block_size_maximum"], 32 << 20, "{x}");
        assert_eq!(x["is_read_only"], ro, "{x}");
        assert_eq!(x["can_flush"], !ro, "{x}");
        assert_eq!(x["can_fua"], !ro, "{x}");
        assert_eq!(x["can_zero"], !ro, "{x}");
        assert_eq!(x["can_multi_conn"], true, "{x}");
        assert_eq!(x["can_trim"], false, "{x}");
        assert_eq!(v["structured"], false, "{v}");
    }
}

#[test]
fn fio_nbd_randwrite_with_crc32c_verify_at_depth_8() {
    if !have("fio") {
        return;
    }
    let (d, _shm, t) = start("fio");
    let e = Export::start(&t, 1, "fio", &[]);
    let o = run_with_deadline(
        Command::new("fio").current_dir(d.path()).args([
            "--name=verify",
            "--ioengine=nbd",
            &format!("--uri={}", e.uri()),
            "--rw=randwrite",
            "--bs=4k",
            "--iodepth=8",
            "--size=4M",
            "--verify=crc32c",
            "--do_verify=1",
            "--output-format=json",
        ]),
        Duration::from_secs(50),
    );
    assert!(o.status.success(), "{}", text(&o));
    let s = String::from_utf8_lossy(&o.stdout);
    // fio may print notes before the JSON.
    let v: serde_json::Value = serde_json::from_str(&s[s.find('{').unwrap()..]).unwrap();
    let job = &v["jobs"][0];
    assert_eq!(job["error"], 0, "{job}");
    assert_eq!(job["write"]["io_bytes"], 4 << 20, "{job}");
    assert_eq!(
        job["read"]["io_bytes"],
        4 << 20,
        "verify read everything back: {job}"
    );
    e.log_line("largest batch");
    let most = e
        .log()
        .lines()
        .filter_map(|l| l.split("largest batch ").nth(1))
        .filter_map(|l| l.split(';').next()?.parse::<usize>().ok())
        .max();
    assert!(most > Some(1), "depth 8 issued one at a time: {}", e.log());
}

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
    let unsynced = |off: u64| rpma_tests::unsynced_pages(&file, off, 64 << 10);
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

#[test]
fn a_flush_after_the_queue_gave_up_answers_eio_once_per_connection() {
    let (_d, _shm, mut t) = start("lost");
    let e = Export::start(&t, 1, "lost", &["--reconnect-timeout", "1"]);
    let mut c = Raw::connect(&e.sock);
    assert_eq!(c.write(0, 0, &[7; 4096]), 0);
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

// ---- bad clients, depth, SIGTERM ----

#[test]
fn bad_clients_lose_their_own_connection_and_change_nothing_else() {
    let (_d, _shm, t) = start("bad");
    let mut e = Export::start(&t, 1, "bad", &[]);
    let base = pattern(6, NS1 as usize);
    cli_write(&t, 1, 0, &base);
    let mut expect = base.clone();
    // A good client, connected throughout, reads after every bad one.
    let mut good = Raw::connect(&e.sock);
    let check = |good: &mut Raw, what: &str| {
        assert_eq!(
            good.read(8192, 4096).unwrap(),
            base[8192..12288],
            "after {what}"
        );
    };

    // A short header, then gone.
    let mut r = Raw::hello(&e.sock);
    r.send(&IHAVEOPT.to_be_bytes()[..5]);
    drop(r);
    check(&mut good, "a short option header");
    // A bad option magic: closed.
    let mut r = Raw::hello(&e.sock);
    r.send(&[0xee; 16]);
    assert!(r.closed(), "bad option magic");
    check(&mut good, "a bad option magic");
    // An unknown option: NBD_REP_ERR_UNSUP, and the handshake goes on.
    let mut r = Raw::hello(&e.sock);
    r.option(0x4242, b"whatever");
    let (opt, ty, _) = r.option_reply();
    assert_eq!((opt, ty), (0x4242, 0x8000_0001));
    r.go();
    assert_eq!(r.read(0, 4096).unwrap(), base[..4096]);
    // Requests past the end: EINVAL (read), ENOSPC (write); the connection stays.
    assert_eq!(r.read(NS1 - 4096, 8192), Err(EINVAL));
    assert_eq!(r.write(0, NS1 - 4096, &[0xcc; 8192]), ENOSPC);
    assert_eq!(r.read(u64::MAX - 4095, 4096), Err(EINVAL));
    // Misaligned to the block size it was told: EINVAL.
    assert_eq!(r.read(1, 4096), Err(EINVAL));
    assert_eq!(r.write(0, 4096, &[0xcc; 100]), EINVAL);
    // An oversized READ: EINVAL, the connection stays.
    assert_eq!(r.read(0, 64 << 20), Err(EINVAL));
    // A good write still works on it.
    assert_eq!(r.write(0, 4096, &[0x11; 4096]), 0);
    expect[4096..8192].fill(0x11);
    // An oversized WRITE: EINVAL, then closed (its payload cannot be skipped).
    let h = r.request(CMD_WRITE, 0, 77, 0, 64 << 20);
    r.send(&h);
    r.send(&[0xcc; 4096]);
    assert_eq!(r.reply(), (EINVAL, 77));
    assert!(r.closed(), "oversized write");
    check(&mut good, "an oversized write");
    // A bad request magic: closed.
    let mut r = Raw::connect(&e.sock);
    r.send(&[0xdd; 28]);
    assert!(r.closed(), "bad request magic");
    // A client that goes away in the middle of a WRITE: nothing of it is written.
    let mut r = Raw::connect(&e.sock);
    let mut w = r.request(CMD_WRITE, FUA, 5, 65536, 8192);
    w.extend_from_slice(&[0xcc; 4096]);
    r.send(&w);
    drop(r);
    // Unknown client flags: closed.
    let s = UnixStream::connect(&e.sock).unwrap();
    s.set_read_timeout(Some(WAIT)).unwrap();
    let mut r = Raw(s);
    r.take(18);
    r.send(&0x80u32.to_be_bytes());
    assert!(r.closed(), "unknown client flags");
    check(&mut good, "a client gone mid-request");
    e.log_line("went away in the middle of a request");

    assert!(e.running(), "the server died: {}", e.log());
    assert_eq!(good.flush(), 0);
    let now = cli_read(&t, 1, 0, NS1);
    if let Some(i) = (0..now.len()).find(|&i| now[i] != expect[i]) {
        panic!("byte {i} changed: {:#x} where {:#x}", now[i], expect[i]);
    }
    assert_eq!(e.term().code(), Some(0), "{}", e.log());
}

#[test]
fn a_client_at_depth_32_has_32_requests_in_flight() {
    let (_d, _shm, t) = start("depth");
    let e = Export::start(&t, 1, "depth", &[]);
    let data = pattern(7, 32 * 4096);
    cli_write(&t, 1, 0, &data);
    let mut c = Raw::connect(&e.sock);
    // 32 READs in one go, as a client at depth 32 sends them.
    let mut b = Vec::new();
    for i in 0..32u64 {
        b.extend(c.request(CMD_READ, 0, 100 + i, (31 - i) * 4096, 4096));
    }
    c.send(&b);
    for i in 0..32u64 {
        let (err, h) = c.reply();
        assert_eq!((err, h), (0, 100 + i), "replies come in order here");
        let off = ((31 - i) * 4096) as usize;
        assert!(c.take(4096) == data[off..off + 4096]);
    }
    let disc = c.request(CMD_DISC, 0, 1, 0, 0);
    c.send(&disc);
    assert!(c.closed());
    let line = e.log_line("largest batch");
    assert!(
        line.contains("largest batch 32;") && line.contains("queue max in flight 32"),
        "{line}"
    );
}

#[test]
fn pipelined_overlapping_requests_keep_their_order() {
    let (_d, _shm, t) = start("order");
    let e = Export::start(&t, 1, "order", &[]);
    let mut c = Raw::connect(&e.sock);
    let (a, b, x) = (pattern(10, 8192), pattern(11, 8192), pattern(12, 4096));
    // One burst: W(a) R W(b, overlapping) W(x, overlapping) R.
    let mut burst = c.request(CMD_WRITE, 0, 1, 0, 8192);
    burst.extend_from_slice(&a);
    burst.extend(c.request(CMD_READ, 0, 2, 0, 12288));
    burst.extend(c.request(CMD_WRITE, 0, 3, 4096, 8192));
    burst.extend_from_slice(&b);
    burst.extend(c.request(CMD_WRITE, FUA, 4, 8192, 4096));
    burst.extend_from_slice(&x);
    burst.extend(c.request(CMD_READ, 0, 5, 0, 12288));
    c.send(&burst);
    assert_eq!(c.reply(), (0, 1));
    assert_eq!(c.reply(), (0, 2));
    let first = c.take(12288);
    assert!(first[..8192] == a[..] && first[8192..].iter().all(|&v| v == 0));
    assert_eq!(c.reply(), (0, 3));
    assert_eq!(c.reply(), (0, 4));
    assert_eq!(c.reply(), (0, 5));
    let second = c.take(12288);
    assert!(second[..4096] == a[..4096], "write-after-write");
    assert!(second[4096..8192] == b[..4096], "write-after-write");
    assert!(second[8192..] == x[..], "the later overlapping write wins");
}

#[test]
fn sigterm_answers_what_was_sent_flushes_and_exits_0() {
    let (_d, _shm, t) = start("term");
    let file = t.dir().join("ns1");
    let mut e = Export::start(&t, 1, "term", &[]);
    let mut c = Raw::connect(&e.sock);
    let data = pattern(8, 8 * 8192);
    let mut b = Vec::new();
    for i in 0..8u64 {
        b.extend(c.request(CMD_WRITE, 0, 200 + i, i * 8192, 8192));
        b.extend_from_slice(&data[i as usize * 8192..(i as usize + 1) * 8192]);
    }
    c.send(&b);
    // SAFETY: kill has no memory-safety preconditions; the pid is our live child's.
    assert_eq!(unsafe { libc::kill(e.pid(), libc::SIGTERM) }, 0);
    for i in 0..8u64 {
        assert_eq!(c.reply(), (0, 200 + i));
    }
    assert!(c.closed());
    assert_eq!(e.wait().code(), Some(0), "{}", e.log());
    assert!(e.log().contains("writes durable"), "{}", e.log());
    assert_eq!(
        rpma_tests::unsynced_pages(&file, 0, 8 * 8192).unwrap_or(0),
        0,
        "the final flush left pages unsynced"
    );
    assert!(!e.sock.exists(), "the socket file is removed");
    assert_eq!(cli_read(&t, 1, 0, 8 * 8192), data);
}

// ---- systemd ----

#[test]
fn the_template_unit_passes_verify_and_its_command_line_gets_ready() {
    let unit = std::fs::read_to_string(repo_file("systemd/rpma-nbd@.service")).unwrap();
    for key in [
        "Type=notify",
        "NotifyAccess=main",
        "EnvironmentFile=/etc/rpma/nbd-%i.env",
        "KillSignal=SIGTERM",
        "RuntimeDirectory=rpma-nbd/%i",
        "NoNewPrivileges=yes",
    ] {
        assert!(unit.contains(key), "unit lacks {key}");
    }
    let bin = built("rpma-initiator");
    let bin = bin.to_str().unwrap();
    if Command::new("systemd-analyze")
        .arg("--version")
        .output()
        .is_ok()
    {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("rpma-nbd@disk1.service");
        std::fs::write(&p, unit.replace("/usr/bin/rpma-initiator", bin)).unwrap();
        let out = Command::new("systemd-analyze")
            .arg("verify")
            .arg(&p)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "systemd-analyze verify: {stderr}");
        assert!(
            !stderr.contains("rpma-nbd@"),
            "warnings about the unit:\n{stderr}"
        );
    } else {
        eprintln!("SKIPPED (verify): systemd-analyze is not installed");
    }

    // ExecStart as systemd would run it for instance "disk1" with an environment file's
    // variables: it must come up and say READY=1 only once the socket accepts.
    let exec = unit
        .lines()
        .find_map(|l| l.strip_prefix("ExecStart=/bin/sh -c '"))
        .and_then(|l| l.strip_suffix('\''))
        .expect("ExecStart=/bin/sh -c '...'")
        .replace("$$", "$")
        .replace("%i", "disk1")
        .replace("/usr/bin/rpma-initiator", bin);
    let (_d, _shm, t) = start("unit");
    let sock = t.dir().join("disk1.sock");
    let notify_path = t.dir().join("unit.notify");
    let notify = UnixDatagram::bind(&notify_path).unwrap();
    notify.set_read_timeout(Some(WAIT)).unwrap();
    let mut child = Command::new("/bin/sh")
        .args(["-c", &exec])
        .env_clear()
        .env("TARGET", t.url())
        .env("NQN", SUB)
        .env("HOSTNQN", HOST)
        .env("SOCKET", &sock)
        .env("EXTRA_ARGS", "--queue-depth 8")
        .env("NOTIFY_SOCKET", &notify_path)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut buf = [0u8; 512];
    let n = notify
        .recv(&mut buf)
        .expect("READY=1 from the unit's command line");
    assert!(buf[..n].starts_with(b"READY=1"));
    let mut c = Raw::hello(&sock);
    // The default export is the instance name: NBD_OPT_LIST names it.
    c.option(3, &[]);
    let (_, ty, data) = c.option_reply();
    assert_eq!(ty, 2);
    assert_eq!(&data[4..9], b"disk1");
    // SIGTERM reaches rpma-initiator itself (sh exec'd it): a clean exit 0.
    // SAFETY: kill has no memory-safety preconditions; the pid is our live child's.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
    let deadline = Instant::now() + WAIT;
    let st = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        assert!(Instant::now() < deadline, "did not stop");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(st.code(), Some(0));
}
