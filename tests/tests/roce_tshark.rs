//! tshark decodes the RoCEv2 packets of rpma's durable writes, in the VM lab.
//!
//! Soft-RoCE sends nothing on the wire between two ends on one device (rxe loops it back
//! inside the kernel), so this test makes a wire of its own: two network namespaces joined by
//! a veth pair, an rxe device on each end, the target in one and the initiator in the other,
//! and tshark capturing on the target's end. One 4 KiB durable write with APM must show RDMA
//! WRITE packets and the APM's RDMA READ request and response; one with GPSPM the WRITE and the
//! SENDs of the flush request and its answer; and no packet of the connection is malformed.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rpma_tests::{built, free_port, run_with_deadline, scratch, text, Shm};

const SUB: &str = "nqn.2026-12.io.rpma:roce";
const WAIT: Duration = Duration::from_secs(300);

/// Runs `ip ARGS`; panics with its output unless it succeeds.
fn ip(args: &[&str]) {
    let o = run_with_deadline(Command::new("ip").args(args), WAIT);
    assert!(o.status.success(), "ip {args:?}: {}", text(&o));
}

/// Two network namespaces joined by a veth pair with an rxe device on each end; removed on
/// drop.
struct Wire;

const TARGET_NS: &str = "rpma-roce-t";
const HOST_NS: &str = "rpma-roce-i";
const TARGET_ADDR: &str = "10.99.7.1";
const HOST_ADDR: &str = "10.99.7.2";

impl Wire {
    fn new() -> Wire {
        assert!(
            Path::new("/sys/module/rdma_rxe").exists(),
            "no rdma_rxe: this test runs in the VM lab (make vm-test; docs/testing.md)"
        );
        let w = Wire;
        ip(&["netns", "add", TARGET_NS]);
        ip(&["netns", "add", HOST_NS]);
        ip(&[
            "link", "add", "rpma-vt", "type", "veth", "peer", "name", "rpma-vi",
        ]);
        ip(&["link", "set", "rpma-vt", "netns", TARGET_NS]);
        ip(&["link", "set", "rpma-vi", "netns", HOST_NS]);
        for (ns, dev, addr, rxe) in [
            (TARGET_NS, "rpma-vt", TARGET_ADDR, "rxet"),
            (HOST_NS, "rpma-vi", HOST_ADDR, "rxei"),
        ] {
            let cidr = format!("{addr}/24");
            ip(&["-n", ns, "addr", "add", &cidr, "dev", dev]);
            ip(&["-n", ns, "link", "set", dev, "up"]);
            ip(&["-n", ns, "link", "set", "lo", "up"]);
            let o = run_with_deadline(
                Command::new("ip").args([
                    "netns", "exec", ns, "rdma", "link", "add", rxe, "type", "rxe", "netdev", dev,
                ]),
                WAIT,
            );
            assert!(o.status.success(), "rdma link add {rxe}: {}", text(&o));
        }
        w
    }

    /// `program args` in namespace `ns`.
    fn command(ns: &str, program: &Path) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", ns]).arg(program);
        c
    }
}

impl Drop for Wire {
    fn drop(&mut self) {
        for rxe in ["rxet", "rxei"] {
            let _ = Command::new("rdma").args(["link", "delete", rxe]).status();
        }
        for ns in [TARGET_NS, HOST_NS] {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
    }
}

/// A process killed on drop.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// tshark on the target's end of the wire, writing `pcap`; returns once it captures.
fn capture(pcap: &Path) -> Running {
    let mut c = Command::new("ip")
        .args(["netns", "exec", TARGET_NS, "tshark", "-i", "rpma-vt", "-w"])
        .arg(pcap)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("tshark runs (scripts/install-deps.sh installs it)");
    let mut lines = BufReader::new(c.stderr.take().unwrap()).lines();
    let deadline = Instant::now() + WAIT;
    loop {
        match lines.next() {
            // dumpcap's own line comes once the capture really runs (tshark's "Capturing on"
            // comes before it).
            Some(Ok(l)) if l.contains("Capture started") => break,
            Some(Ok(_)) => {}
            other => panic!("tshark did not start capturing: {other:?}"),
        }
        assert!(Instant::now() < deadline, "tshark did not start capturing");
    }
    std::thread::spawn(move || for _ in lines {});
    Running(c)
}

/// `rpma-initiator` in the host's namespace against the target; its output, panicking unless
/// it succeeds.
fn initiator(url: &str, args: &[&str]) -> String {
    let o = run_with_deadline(
        Wire::command(HOST_NS, &built("rpma-initiator"))
            .args(["--target", url, "--nqn", SUB, "--nsid", "1"])
            .args(args)
            .env_remove("RUST_LOG")
            .stdin(Stdio::null()),
        WAIT,
    );
    assert!(o.status.success(), "rpma-initiator {args:?}: {}", text(&o));
    text(&o)
}

/// The BTH opcodes of the RC packets in `pcap` (the connection's data path, not the rdma_cm
/// MADs on QP1), and how many of them tshark found malformed.
fn rc_packets(pcap: &Path) -> (Vec<u32>, usize) {
    let fields = |filter: &str, field: &str| -> Vec<String> {
        let o = Command::new("tshark")
            .arg("-r")
            .arg(pcap)
            .args(["-Y", filter, "-T", "fields", "-e", field])
            .output()
            .expect("tshark -r");
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout)
            .lines()
            .map(str::to_owned)
            .collect()
    };
    // RC opcodes are 0x00-0x1f.
    let rc = "infiniband.bth.opcode < 32";
    let opcodes = fields(rc, "infiniband.bth.opcode")
        .iter()
        .filter_map(|o| o.trim().parse().ok())
        .collect();
    let malformed = fields(&format!("{rc} && _ws.malformed"), "frame.number").len();
    (opcodes, malformed)
}

#[test]
#[ignore = "requires the VM lab: Soft-RoCE (rdma_rxe), network namespaces (make vm-test)"]
fn tshark_decodes_the_rocev2_packets_of_durable_writes() {
    let d = scratch();
    let shm = Shm::new("roce");
    let wire = Wire::new();
    let pcap = d.path().join("roce.pcap");
    let cap = capture(&pcap);

    // The target in its namespace, declaring direct_write_to_pmem so that APM is offered.
    let port = free_port();
    let url = format!("rdma://{TARGET_ADDR}:{port}");
    let cfg = d.path().join("target.toml");
    std::fs::write(
        &cfg,
        format!(
            "listen = [{{ url = \"{url}\", direct_write_to_pmem = true }}]\n\
             control_socket = \"{}\"\n\
             [[subsystem]]\nnqn = \"{SUB}\"\nallow_any_host = true\n\
             [[subsystem.namespace]]\nnsid = 1\npath = \"{}\"\nsize = \"4MiB\"\n\
             force_dax = true\n",
            d.path().join("ctl.sock").display(),
            shm.path()
        ),
    )
    .unwrap();
    let log = std::fs::File::create(d.path().join("target.log")).unwrap();
    let _target = Running(
        Wire::command(TARGET_NS, &built("rpma-target"))
            .arg("--config")
            .arg(&cfg)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap(),
    );
    // Ready when a host gets in.
    let deadline = Instant::now() + WAIT;
    loop {
        let o = Wire::command(HOST_NS, &built("rpma-initiator"))
            .args(["--target", &url, "--nqn", SUB, "identify"])
            .output()
            .unwrap();
        if o.status.success() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the target never admitted a host: {}\n{}",
            text(&o),
            std::fs::read_to_string(d.path().join("target.log")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(200));
    }

    let data = d.path().join("4k");
    std::fs::write(&data, rpma_tests::noise(7, 4096)).unwrap();
    let data = data.to_str().unwrap();
    for (method, offset) in [("apm", "0"), ("gpspm", "1MiB")] {
        let out = initiator(
            &url,
            &[
                "--persist",
                method,
                "write",
                "--offset",
                offset,
                "--durable",
                "--in",
                data,
            ],
        );
        assert!(
            out.contains(&format!("durable ({}", method.to_uppercase())),
            "{out}"
        );
    }

    // Let the last packets reach the capture, then stop it (SIGINT flushes the file).
    std::thread::sleep(Duration::from_millis(500));
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(cap.0.id() as i32),
        nix::sys::signal::Signal::SIGINT,
    )
    .unwrap();
    let mut cap = cap;
    cap.0.wait().unwrap();
    drop(wire);

    let (opcodes, malformed) = rc_packets(&pcap);
    let has = |codes: &[u32]| opcodes.iter().any(|o| codes.contains(o));
    // IBTA RC opcodes: RDMA WRITE first/middle/last/only 6-8, 10; READ request 12, response
    // first/middle/last/only 13-16; SEND first/middle/last/only 0-2, 4; ACK 17.
    assert!(has(&[6, 7, 8, 10]), "no RDMA WRITE: {opcodes:?}");
    assert!(has(&[12]), "no RDMA READ request (APM): {opcodes:?}");
    assert!(has(&[13, 14, 15, 16]), "no RDMA READ response: {opcodes:?}");
    assert!(
        has(&[0, 1, 2, 4]),
        "no SEND (GPSPM's request and answer): {opcodes:?}"
    );
    assert!(has(&[17]), "no ACK: {opcodes:?}");
    assert_eq!(malformed, 0, "malformed RoCEv2 packets: {opcodes:?}");
}
