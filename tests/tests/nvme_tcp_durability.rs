//! What an NVMe/TCP host is told is durable survives a SIGKILL of the target; what it was not
//! told is durable may not (the control that shows the check can fail). Under the power-loss
//! simulation (docs/reliability.md) only what was persisted reaches the namespace's file, so a
//! SIGKILL of the daemon loses everything else, as a power loss would.
//!
//! - page-cache: a Write is durable once a Flush of its namespace (or the Write itself, with
//!   FUA) completed;
//! - dax: every Write is durable at its completion (no volatile write cache is reported);
//! - a namespace whose write-back failed answers Flush, FUA and Write with Write Fault, and
//!   keeps doing so after the operator's clear to the controllers it failed under (needs root,
//!   loop devices and mkfs.ext4 for a real failing filesystem; says why it skips).

use rpma_tests::fragile_fs::FragileFs;
use rpma_tests::nvme::{sc, Controller, Host, Sqe};
use rpma_tests::{Config, Namespace, Subsystem, Target};

const SUB: &str = "nqn.2026-11.io.rpma:nvme-durable";
const HOST: &str = "nqn.2026-11.io.rpma:nvme-durable-host";

fn start(ns: Namespace) -> (tempfile::TempDir, Target) {
    let dir = rpma_tests::scratch();
    let cfg = Config::new()
        .subsystem(Subsystem::new(SUB).host(HOST).namespace(ns))
        .to_string();
    let t = Target::start_on(dir.path(), "nvme-tcp://127.0.0.1", &cfg, &[]);
    (dir, t)
}

fn queue(t: &Target) -> (Controller, Host) {
    let addr = format!("127.0.0.1:{}", t.port());
    let c = Controller::connect(&addr, SUB, HOST, (true, true)).expect("admitted");
    let q = c.io_queue(1).expect("I/O queue");
    (c, q)
}

#[test]
fn on_page_cache_what_flush_or_fua_acknowledged_survives_a_sigkill_and_nothing_else_is_promised() {
    // No eviction: a range reaches the file only when something makes it durable.
    let (_d, mut t) =
        start(Namespace::new(1, "ns1", "4MiB").power_loss_simulation("eviction_percent = 0"));
    let (a, b, f) = (
        rpma_tests::noise(1, 8192),
        rpma_tests::noise(2, 8192),
        rpma_tests::noise(3, 8192),
    );
    {
        let (c, mut q) = queue(&t);
        let id = c.identify_vwc();
        assert!(id, "page-cache: a volatile write cache is reported");
        assert!(q.write(1, 0, 4096, &a, false).unwrap().ok());
        assert!(q.flush(1).unwrap().ok(), "acknowledged: A is durable");
        assert!(
            q.write(1, 16, 4096, &f, true).unwrap().ok(),
            "FUA: F is durable"
        );
        assert!(
            q.write(1, 32, 4096, &b, false).unwrap().ok(),
            "B: not flushed"
        );
        // Everything reads back before the kill.
        assert_eq!(q.read(1, 32, 4096, 2).unwrap().data, b);
        let _ = c;
    }
    t.restart();
    let (_c, mut q) = queue(&t);
    assert_eq!(q.read(1, 0, 4096, 2).unwrap().data, a, "flushed: there");
    assert_eq!(q.read(1, 16, 4096, 2).unwrap().data, f, "FUA: there");
    assert_eq!(
        q.read(1, 32, 4096, 2).unwrap().data,
        vec![0; 8192],
        "never made durable: lost, as a power loss loses it (the control)"
    );
}

/// With the volatile write cache turned off (Set Features 06h), a deallocate (Dataset
/// Management, AD) is durable at its completion as a write is: the blocks read as zeros after a
/// power loss. (The zeros were left in the page cache, and the old data came back.)
#[test]
fn with_the_write_cache_off_a_deallocate_is_durable_at_its_completion() {
    let (_d, mut t) =
        start(Namespace::new(1, "ns1", "4MiB").power_loss_simulation("eviction_percent = 0"));
    let a = rpma_tests::noise(5, 8192);
    {
        let (mut c, mut q) = queue(&t);
        assert!(q.write(1, 0, 4096, &a, false).unwrap().ok());
        assert!(q.flush(1).unwrap().ok(), "A is durable");
        assert!(c.set_features(0x06, 0).ok(), "the write cache off");
        // One range: 2 blocks at block 0.
        let mut range = vec![0u8; 16];
        range[4..8].copy_from_slice(&2u32.to_le_bytes());
        let dsm = Sqe::new(0x09, 1).cdw(10, 0).cdw(11, 1 << 2);
        assert!(q.command(dsm, &range, 0).unwrap().ok());
        assert!(q.read(1, 0, 4096, 2).unwrap().data == [0; 8192]);
    }
    t.restart();
    let (_c, mut q) = queue(&t);
    let back = q.read(1, 0, 4096, 2).unwrap().data;
    assert!(
        back == [0; 8192],
        "the deallocate was answered with the cache off, yet {} bytes came back",
        back.iter().filter(|&&b| b != 0).count()
    );
}

/// Turning the volatile write cache off (Set Features 06h, WCE 0) makes what it holds durable
/// before the Set Features completes: from then on the host takes every completed write as
/// durable, the ones completed before too. (They stayed in the page cache, and a power loss
/// lost writes the host had every reason to think durable.)
#[test]
fn turning_the_write_cache_off_makes_what_it_holds_durable() {
    let (_d, mut t) =
        start(Namespace::new(1, "ns1", "4MiB").power_loss_simulation("eviction_percent = 0"));
    let a = rpma_tests::noise(6, 8192);
    {
        let (mut c, mut q) = queue(&t);
        assert!(q.write(1, 8, 4096, &a, false).unwrap().ok(), "cached");
        assert!(c.set_features(0x06, 0).ok(), "the write cache off");
    }
    t.restart();
    let (_c, mut q) = queue(&t);
    let back = q.read(1, 8, 4096, 2).unwrap().data;
    assert!(
        back == a,
        "completed before the cache was turned off, yet {} of its bytes were lost",
        back.iter().zip(&a).filter(|(x, y)| x != y).count()
    );
}

#[test]
fn on_dax_every_write_is_durable_at_its_completion() {
    let (_d, mut t) = start(
        Namespace::new(1, "ns1", "2MiB")
            .force_dax()
            .power_loss_simulation("eviction_percent = 0"),
    );
    let a = rpma_tests::noise(9, 16384);
    {
        let (c, mut q) = queue(&t);
        assert!(!c.identify_vwc(), "dax: no volatile write cache");
        assert!(q.write(1, 4, 4096, &a, false).unwrap().ok());
    }
    t.restart();
    let (_c, mut q) = queue(&t);
    assert_eq!(q.read(1, 4, 4096, 4).unwrap().data, a);
}

#[test]
fn a_persist_that_does_nothing_is_caught() {
    // The same sequence with persists broken (they copy nothing and still answer durable):
    // the acknowledged data is gone after the kill, so the check above can fail.
    let (_d, mut t) = start(
        Namespace::new(1, "ns1", "4MiB")
            .power_loss_simulation("eviction_percent = 0, broken_persist = true"),
    );
    let a = rpma_tests::noise(4, 8192);
    {
        let (_c, mut q) = queue(&t);
        assert!(q.write(1, 0, 4096, &a, false).unwrap().ok());
        assert!(q.flush(1).unwrap().ok());
    }
    t.restart();
    let (_c, mut q) = queue(&t);
    assert_ne!(q.read(1, 0, 4096, 2).unwrap().data, a);
}

trait Vwc {
    fn identify_vwc(&self) -> bool;
}

impl Vwc for Controller {
    /// Identify Controller's VWC bit (on a fresh admin queue of the same controller's host).
    fn identify_vwc(&self) -> bool {
        let mut c = Controller::connect(&self.addr, &self.subsystem, &self.host, (false, false))
            .expect("admitted");
        let id = c.identify(1, 0);
        assert!(id.ok());
        id.data[525] & 1 == 1
    }
}

/// A target serving one 8 MiB page-cache namespace on a filesystem whose write-back fails on
/// demand (fields drop in order: the target before the filesystem under it).
struct Fragile {
    t: Target,
    fs: FragileFs,
}

impl Fragile {
    /// Under `dir`, or None (the test skips, and says why) where the filesystem cannot be built.
    fn start(dir: &std::path::Path) -> Option<Fragile> {
        let fs = FragileFs::or_skip(dir)?;
        let t_dir = dir.join("target");
        std::fs::create_dir(&t_dir).unwrap();
        let cfg = Config::new()
            .subsystem(Subsystem::new(SUB).host(HOST).namespace(Namespace::new(
                1,
                &format!("{}/ns1", fs.mnt.display()),
                "8MiB",
            )))
            .to_string();
        let t = Target::start_on(&t_dir, "nvme-tcp://127.0.0.1", &cfg, &[]);
        Some(Fragile { t, fs })
    }
}

/// `rpma-target clear-failure SUB 1`, which must succeed.
fn clear_failure(t: &Target) {
    let (c, all) = t.clear_failure(SUB, 1);
    assert_eq!(c, Some(0), "{all}");
}

#[test]
fn a_failed_namespace_answers_flush_fua_and_writes_with_write_fault() {
    let d = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let Some(Fragile { t, fs }) = Fragile::start(d.path()) else {
        return;
    };
    let (mut c, mut q) = queue(&t);
    assert_eq!(
        c.get_log(0x02, 512, 0).data[0],
        0,
        "healthy: no critical warning"
    );
    fs.fill();
    // 1 MiB of dirty pages, in writes of MDTS (128 KiB).
    for i in 0..8u64 {
        let w = q.write(1, i * 32, 4096, &vec![0x5a; 128 << 10], false);
        assert!(w.unwrap().ok());
    }
    let f = q.flush(1).unwrap();
    assert_eq!(f.code(), sc::WRITE_FAULT, "the failed write-back: {f:?}");
    assert!(f.dnr(), "nothing will succeed until an operator acts");
    // Linux would now report success for the same pages: the namespace must not.
    let f = q.flush(1).unwrap();
    assert_eq!(f.code(), sc::WRITE_FAULT);
    let w = q.write(1, 0, 4096, &[1; 4096], true).unwrap();
    assert_eq!(w.code(), sc::WRITE_FAULT, "FUA");
    let w = q.write(1, 8, 4096, &[1; 4096], false).unwrap();
    assert_eq!(w.code(), sc::WRITE_FAULT, "writes are refused too");
    assert!(q.read(1, 0, 4096, 1).unwrap().ok(), "reads still work");
    let smart = c.get_log(0x02, 512, 0);
    assert_eq!(
        smart.data[0] & (1 << 2),
        1 << 2,
        "SMART: reliability degraded"
    );
    let st = t.status();
    assert!(
        st["subsystems"][0]["namespaces"][0]["failed"].is_string(),
        "{}",
        st["subsystems"][0]
    );
    assert!(t
        .log()
        .lines()
        .any(|l| l.contains("has FAILED") && l.contains("No space left")));
    // A host that shuts a controller down now is told its data is not safe: shutdown
    // processing completes with Controller Fatal Status (it completed as if all were durable).
    {
        let (mut c2, _q2) = queue(&t);
        let cc = c2.property_get(0x14, false);
        assert!(cc.ok());
        assert!(
            c2.property_set(0x14, cc.dw0 | (1 << 14)).ok(),
            "CC.SHN: normal shutdown"
        );
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        let csts = loop {
            let v = c2.property_get(0x1c, false).dw0;
            if v & (3 << 2) == 2 << 2 {
                break v;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "shutdown never completed: {v:#x}"
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        };
        assert_eq!(csts & (1 << 1), 1 << 1, "CSTS {csts:#x}: CFS");
    }
    // The operator frees the space and clears the failure. This controller's 1 MiB was lost
    // in the failed write-back, so once it has heard of the clear it still answers Write Fault
    // (no Flush of it may vouch for those writes: the test below); a controller connected
    // after the clear is served as usual.
    fs.free();
    clear_failure(&t);
    c.wait_changed(1);
    let w = q.write(1, 0, 4096, &[2; 4096], true).unwrap();
    assert_eq!(w.code(), sc::WRITE_FAULT, "FUA after the clear: {w:?}");
    assert_eq!(q.flush(1).unwrap().code(), sc::WRITE_FAULT);
    let (_c3, mut q3) = queue(&t);
    let w = q3.write(1, 0, 4096, &[2; 4096], true).unwrap();
    assert!(w.ok(), "a FUA write after the failure was cleared: {w:?}");
    assert!(q3.flush(1).unwrap().ok());
}

/// A controller attached to a page-cache namespace when its write-back failed may have
/// completed writes that only the page cache held, and that are gone; an NVMe host keeps no
/// copy to write again. So after an operator cleared the failure, such a controller still
/// answers Write Fault to every Flush and FUA write of the namespace (and to writes, as the
/// failed namespace did) until its host reconnects: no Flush may vouch for the lost writes.
/// Controllers connected while it was failed, or after the clear, are served as usual.
/// (Before: controller A, whose 1 MiB controller B's Flush had failed to write back, was
/// answered success by its first Flush after the clear, over data the media did not hold.)
#[test]
fn after_a_cleared_failure_no_flush_vouches_for_writes_lost_in_it() {
    let d = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let Some(Fragile { t, fs }) = Fragile::start(d.path()) else {
        return;
    };
    let (mut ca, mut qa) = queue(&t);
    let (mut cb, mut qb) = queue(&t);
    fs.fill();
    // A: 1 MiB without FUA, completed (in the page cache), never flushed by A.
    let lost = vec![0x5a; 128 << 10];
    for i in 0..8u64 {
        assert!(qa.write(1, i * 32, 4096, &lost, false).unwrap().ok());
    }
    let f = qb.flush(1).unwrap();
    assert_eq!(
        f.code(),
        sc::WRITE_FAULT,
        "B's Flush met the failure: {f:?}"
    );
    // Connected while the namespace is failed: nothing it writes completes, nothing is lost.
    let (mut cc, mut qc) = queue(&t);
    let w = qc.write(1, 512, 4096, &[3; 4096], false).unwrap();
    assert_eq!(w.code(), sc::WRITE_FAULT);
    fs.free();
    clear_failure(&t);
    for c in [&mut ca, &mut cb, &mut cc] {
        c.wait_changed(1);
    }
    let f = qa.flush(1).unwrap();
    assert_eq!(
        f.code(),
        sc::WRITE_FAULT,
        "A's first Flush after the clear would vouch for its lost writes: {f:?}"
    );
    assert!(f.dnr());
    assert_eq!(qa.flush(1).unwrap().code(), sc::WRITE_FAULT, "said again");
    assert_eq!(qa.flush(0xffff_ffff).unwrap().code(), sc::WRITE_FAULT);
    let w = qa.write(1, 0, 4096, &[1; 4096], true).unwrap();
    assert_eq!(w.code(), sc::WRITE_FAULT, "FUA");
    assert_eq!(
        qb.flush(1).unwrap().code(),
        sc::WRITE_FAULT,
        "B was attached when it failed too"
    );
    assert_eq!(
        ca.get_log(0x02, 512, 0).data[0] & (1 << 2),
        1 << 2,
        "A's SMART: reliability degraded"
    );
    // The faults are honest: the media (read by a new controller: the clear dropped the page
    // cache) does not hold A's writes.
    let (mut cn, mut qn) = queue(&t);
    let back = qn.read(1, 0, 4096, 32).unwrap();
    assert!(back.ok());
    assert_ne!(
        back.data, lost,
        "A's first 128 KiB reached the media after all"
    );
    assert_eq!(
        cn.get_log(0x02, 512, 0).data[0],
        0,
        "a new controller: healthy"
    );
    let w = qn.write(1, 0, 4096, &[2; 4096], true).unwrap();
    assert!(w.ok(), "a controller connected after the clear: {w:?}");
    assert!(qn.flush(1).unwrap().ok());
    let w = qc.write(1, 512, 4096, &[3; 4096], false).unwrap();
    assert!(w.ok(), "a controller connected while it was failed: {w:?}");
    assert!(qc.flush(1).unwrap().ok());
}
