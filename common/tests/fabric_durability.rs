//! The RC durability contract on page-cache memory: a Write followed by an 8-byte Read is
//! durable once the Read completes, even if the target process is SIGKILLed right after.
//!
//! The target runs as a child process: this test binary re-executed with
//! `RPMA_FABRIC_CHILD_TARGET=<file>`, running `child_target` only.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use rpma_common::fabric::*;
use rpma_common::pmem::{Domain, OpenOptions};

const ENV: &str = "RPMA_FABRIC_CHILD_TARGET";
const SIZE: usize = 1 << 20;

/// The target side; a no-op unless started by `write_read_survives_sigkill`.
#[test]
fn child_target() {
    let Ok(path) = std::env::var(ENV) else { return };
    let m = OpenOptions::new(&path)
        .size(SIZE as u64)
        .create(true)
        .open()
        .unwrap();
    let domain = m.domain();
    let ctx = Context::soft();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(16).unwrap();
    let mr = pd
        .register(
            Arc::new(m),
            Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
        )
        .unwrap();
    let listener = Listener::bind(&ctx, &"tcp://127.0.0.1:0".parse().unwrap()).unwrap();
    println!(
        "READY {} {} {} {}",
        listener.url().unwrap().port,
        mr.addr(),
        mr.rkey(),
        domain.as_str()
    );
    let req = listener.accept(&ConnParams::default()).unwrap();
    let qp = pd.create_qp(&cq, &cq, QpCaps::default()).unwrap();
    let _qp = req.accept(qp, &ConnParams::default(), b"").unwrap();
    let mut wc = [Completion::EMPTY; 4];
    // Serve until killed (bounded, in case the parent dies first).
    for _ in 0..600 {
        let _ = cq.wait(&mut wc, Some(Duration::from_millis(100)));
    }
}

#[test]
fn write_read_survives_sigkill() {
    if std::env::var(ENV).is_ok() {
        return;
    }
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = dir.path().join("ns0");
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_target", "--nocapture", "--test-threads=1"])
        .env(ENV, &path)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    let (port, addr, rkey, domain) = loop {
        line.clear();
        assert!(
            out.read_line(&mut line).unwrap() > 0,
            "child ended before READY"
        );
        // libtest may print "test child_target ... " before it on the same line.
        if let Some((_, rest)) = line.split_once("READY ") {
            let f: Vec<&str> = rest.split_whitespace().collect();
            break (
                f[0].parse::<u16>().unwrap(),
                f[1].parse::<u64>().unwrap(),
                f[2].parse::<u32>().unwrap(),
                f[3].to_owned(),
            );
        }
    };
    if domain != Domain::PageCache.as_str() && domain != "dax" {
        eprintln!(
            "skipped: {} is on a {domain} filesystem, not page-cache",
            path.display()
        );
        let _ = child.kill();
        let _ = child.wait();
        return;
    }
    let ctx = Context::soft();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(16).unwrap();
    let url: Url = format!("tcp://127.0.0.1:{port}").parse().unwrap();
    let qp = pd
        .create_qp(&cq, &cq, QpCaps::default())
        .unwrap()
        .connect(&url, &ConnParams::default(), b"")
        .unwrap();
    let buf = AlignedBuf::new(8192).unwrap();
    let pattern: Vec<u8> = (0..4096).map(|i| (i * 13 + 1) as u8).collect();
    buf.write_at(0, &pattern).unwrap();
    let mr = pd.register(Arc::clone(&buf), Access::LOCAL_WRITE).unwrap();
    let remote = RemoteAddr {
        addr: addr + 65536,
        rkey,
    };
    qp.post_send(
        SendWr::new(
            1,
            SendOp::Write {
                local: Sge::new(&mr, 0, 4096),
                remote,
            },
        )
        .with_flags(SendFlags::empty()),
    )
    .unwrap();
    qp.post_send(SendWr::new(
        2,
        SendOp::Read {
            local: Sge::new(&mr, 4096, 8),
            remote,
        },
    ))
    .unwrap();
    let mut wc = [Completion::EMPTY; 4];
    let n = cq.wait(&mut wc, Some(Duration::from_secs(10))).unwrap();
    assert_eq!(n, 1);
    assert_eq!((wc[0].wr_id, wc[0].status), (2, WcStatus::Success));
    // Durable now: kill the target without letting it do anything more.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let _ = child.wait();
    let file = std::fs::read(&path).unwrap();
    assert_eq!(file.len(), SIZE);
    assert!(
        file[65536..65536 + 4096] == pattern[..],
        "the written bytes are in the file"
    );
    assert!(file[..65536].iter().all(|&b| b == 0));
}
