//! An RDMA device that goes away under a running target and comes back (a NIC reset, a driver
//! reload, `rdma link delete`), in the VM lab: Soft-RoCE deleted and added again.
//!
//! The target says once that the device is lost (it used to log a failed wait 45 times a
//! second for as long as it ran), its sessions end, and once the device is back it listens
//! again on its own (it used to stay deaf until restarted); a host's queue reconnects over the
//! device that is back and finds its durable bytes.
//!
//! The test deletes the lab's RDMA device, so it runs alone: tests/vm/suite.sh runs this binary
//! after every other one, by itself, and the device is added back even when the test fails.

use std::process::Command;
use std::time::Duration;

use rpma_initiator::{Connection, Durability};
use rpma_tests::{host, noise, nqn, opts, scratch, Config, Namespace, Shm, Subsystem, Target};
use rpma_tests::{transport, Transport};

const SUB: &str = "nqn.2026-11.io.rpma:device-loss";
const HOST: &str = "nqn.2026-11.io.rpma:device-loss-host";

fn rdma(args: &[&str]) -> (bool, String) {
    let o = Command::new("rdma").args(args).output().expect("run rdma");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    (o.status.success(), text)
}

/// The Soft-RoCE device `device` (on `netdev`), deleted for as long as this lives: added back
/// when dropped if it is still missing (a failed test leaves the lab as it found it).
struct Deleted {
    device: String,
    netdev: String,
    back: bool,
}

impl Deleted {
    fn delete(device: &str) -> Deleted {
        let (ok, shown) = rdma(&["link", "show", &format!("{device}/1")]);
        assert!(ok, "rdma link show {device}/1: {shown}");
        let netdev = shown
            .split_whitespace()
            .skip_while(|w| *w != "netdev")
            .nth(1)
            .unwrap_or_else(|| panic!("no netdev in {shown:?}"))
            .to_owned();
        let (ok, said) = rdma(&["link", "delete", device]);
        assert!(ok, "rdma link delete {device}: {said}");
        Deleted {
            device: device.to_owned(),
            netdev,
            back: false,
        }
    }

    /// `rdma link add DEVICE type rxe netdev NETDEV`.
    fn add(&self) -> (bool, String) {
        rdma(&[
            "link",
            "add",
            &self.device,
            "type",
            "rxe",
            "netdev",
            &self.netdev,
        ])
    }

    fn add_back(&mut self) {
        let (ok, said) = self.add();
        assert!(ok, "rdma link add {}: {said}", self.device);
        self.back = true;
    }
}

impl Drop for Deleted {
    fn drop(&mut self) {
        if !self.back {
            let _ = self.add();
        }
    }
}

#[test]
#[ignore = "requires the VM lab: Soft-RoCE that it deletes and adds again (make vm-test)"]
fn a_target_listens_again_once_its_lost_rdma_device_is_back() {
    let t = Transport::rdma();
    let Transport::Rdma { device, .. } = t.clone() else {
        unreachable!()
    };
    transport::on(t.clone(), || {
        let dir = scratch();
        let shm = Shm::new("device-loss");
        let config = Config::new().subsystem(
            Subsystem::new(SUB)
                .host(HOST)
                .namespace(Namespace::new(1, shm.path(), "4MiB").force_dax()),
        );
        let target = Target::start_on(dir.path(), &t.listen(), &config.to_string(), &[]);
        let mut q = Connection::new(&target.url(), nqn(SUB), host(HOST))
            .with_connect_options(opts())
            .open_queue(0)
            .expect("open a queue");
        let before = noise(41, 64 << 10);
        {
            let mut ns = q.namespace(1).unwrap();
            let d = ns.write_durable(0, &before).unwrap();
            assert!(matches!(d, Durability::Durable(_)), "{d:?}");
        }

        let mut gone = Deleted::delete(&device);
        let lost = target.log_lines(
            &["failed or was removed", "not accepting connections"],
            Duration::from_secs(120),
        );
        assert_eq!(lost.len(), 1, "the listener says so once: {}", target.log());
        // A try to listen again has come and gone (said once, at the first try) ...
        let tried = target.log_lines(&["cannot listen yet"], Duration::from_secs(60));
        assert!(!tried.is_empty(), "{}", target.log());
        // ... and the loop said that its device is lost (counted again at the end: once).
        let loops = target.log_lines(
            &["loop 0:", "failed or was removed"],
            Duration::from_secs(60),
        );
        assert!(!loops.is_empty(), "{}", target.log());
        // `status` (and the metrics' rpma_target_listener_up) says the listener is down, and why.
        let l = &target.status()["listeners"][0];
        assert_eq!(l["bound"], false, "{l}");
        assert!(
            l["note"]
                .as_str()
                .is_some_and(|n| n.contains("failed or was removed")),
            "{l}"
        );

        gone.add_back();
        // The port turns active when the kernel has seen the netdev's carrier (seconds under
        // TCG): waited for, as the lab's set-up does, before a host counts on it.
        let deadline = std::time::Instant::now() + Duration::from_secs(300);
        while !Command::new("ibv_devinfo")
            .args(["-d", &device])
            .output()
            .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("PORT_ACTIVE"))
        {
            assert!(
                std::time::Instant::now() < deadline,
                "{device} never became active"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        let again = target.log_lines(
            &["listening again: the RDMA device"],
            Duration::from_secs(120),
        );
        assert_eq!(again.len(), 1, "{}", target.log());
        assert!(again[0].contains(&device), "{again:?}");
        let l = &target.status()["listeners"][0];
        assert_eq!(l["bound"], true, "{l}");
        assert!(l["note"].is_null(), "{l}");

        // The host's queue was on the lost device too: it reconnects over the one that is
        // back, and finds what it made durable.
        let after = noise(42, 64 << 10);
        {
            let mut ns = q.namespace(1).unwrap();
            let mut back = vec![0u8; before.len()];
            ns.read_at(0, &mut back)
                .expect("read after the device came back");
            assert!(back == before, "the durable bytes are there");
            let d = ns.write_durable(1 << 20, &after).unwrap();
            assert!(matches!(d, Durability::Durable(_)), "{d:?}");
        }
        assert!(q.reconnects() >= 1, "the queue reconnected");
        drop(q);
        // And a new host connection is served, with both writes in place.
        let mut q = Connection::new(&target.url(), nqn(SUB), host(HOST))
            .with_connect_options(opts())
            .open_queue(0)
            .expect("a new queue once the device is back");
        let mut ns = q.namespace(1).unwrap();
        let mut back = vec![0u8; after.len()];
        ns.read_at(1 << 20, &mut back).unwrap();
        assert!(back == after, "the write after the device came back");
        let f = std::fs::read(shm.path()).unwrap();
        assert!(f[..before.len()] == before[..], "in the namespace file");
        // Each said once in all (a loss told again and again filled the journal before), and
        // no wait failed.
        let log = target.log();
        // (At info level: the later tries to listen are said at debug level.)
        for said in [
            "not accepting connections",
            "cannot listen yet",
            "listening again: the RDMA device",
            "loop 0: serving on the RDMA device",
        ] {
            let n = log
                .lines()
                .filter(|l| !l.contains(" DEBUG ") && l.contains(said))
                .count();
            assert_eq!(n, 1, "{said}: {log}");
        }
        let loops = log
            .lines()
            .filter(|l| l.contains("loop 0:") && l.contains("failed or was removed"))
            .count();
        assert_eq!(loops, 1, "{log}");
        assert!(!log.contains("waiting for completions failed"), "{log}");
    });
}
