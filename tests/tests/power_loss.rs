//! The power-loss simulation end to end (docs/reliability.md): a SIGKILL of a target whose
//! namespaces run under it loses exactly what was not persisted, on page-cache and on forced
//! dax, through every durability method; without the simulation the same SIGKILL loses
//! nothing (why the simulation exists); a broken persist loses acknowledged writes; the domain
//! is labelled wherever it is shown; and what the simulation cannot do is refused.

use std::process::Stdio;
use std::time::{Duration, Instant};

use rpma_common::pmem::SIMULATION_LABEL;
use rpma_common::proto::nqn::Nqn;
use rpma_common::proto::PersistenceDomain;
use rpma_initiator::{ConnectOptions, Connection, Durability, HostIdentity, PersistMethod};
use rpma_tests::{
    check_config, conn_args, initiator, noise, scratch, text, Config, Daemon, Namespace, Shm,
    Subsystem, Target, Transport,
};

const SUB: &str = "nqn.2026-11.io.rpma:power-loss";
const HOST: &str = "nqn.2026-11.io.rpma:power-loss-host";
/// The methods the target offers on the simulated namespaces (no `direct_write_to_pmem`
/// over rdma: the simulation loses the caches at a power loss, as an ADR platform does).
fn methods(nsid: u32) -> Vec<PersistMethod> {
    let t = Transport::current();
    let domain = match nsid {
        2 => PersistenceDomain::DaxForced,
        _ => t.file_domain(),
    };
    t.methods_undeclared(domain)
}

/// nsid 1: page-cache file, nsid 2: /dev/shm forced dax, both simulated with `settings`;
/// nsid 3: a page-cache file without the simulation.
fn start(tag: &str, settings: &str) -> (tempfile::TempDir, Shm, Target) {
    let d = scratch();
    let shm = Shm::new(tag);
    let config = Config::new().subsystem(
        Subsystem::new(SUB).any_host().namespaces([
            Namespace::new(1, "pc", "1MiB").power_loss_simulation(settings),
            Namespace::new(2, shm.path(), "1MiB")
                .force_dax()
                .power_loss_simulation(settings),
            Namespace::new(3, "plain", "1MiB"),
        ]),
    );
    let listen = Transport::current().listen();
    let t = Target::start_on(d.path(), &listen, &config.to_string(), &[]);
    (d, shm, t)
}

fn queue(t: &Target) -> rpma_initiator::Queue {
    Connection::new(
        &t.url(),
        Nqn::new(SUB).unwrap(),
        HostIdentity::new(Nqn::new(HOST).unwrap()),
    )
    .with_connect_options(ConnectOptions {
        timeout: Duration::from_secs(10),
        ..ConnectOptions::default()
    })
    .open_queue(0)
    .unwrap()
}

fn read(q: &mut rpma_initiator::Queue, nsid: u32, offset: u64, len: usize) -> Vec<u8> {
    let mut b = vec![0; len];
    q.namespace(nsid).unwrap().read_at(offset, &mut b).unwrap();
    b
}

/// Writes (not durable) `data` at `offset` on queue `w` and waits until queue `r` reads it
/// back: placed in the target's memory. A Read on `w` itself would make it durable (APM).
fn place(
    w: &mut rpma_initiator::Queue,
    r: &mut rpma_initiator::Queue,
    nsid: u32,
    offset: u64,
    data: &[u8],
) {
    w.namespace(nsid).unwrap().write_at(offset, data).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while read(r, nsid, offset, data.len()) != data {
        assert!(Instant::now() < deadline, "nsid {nsid}: never placed");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Per method, 4 KiB acknowledged durable at block `2 * i` of `nsid` on one queue, then 4 KiB
/// only placed at block `2 * i + 1` by another (a durable call on the first would persist
/// them: APM covers every earlier Write of its queue pair). Returns the durable writes' data
/// and the queues, to be dropped only after the kill (nothing may end their sessions first).
fn durable_and_placed(
    t: &Target,
    nsid: u32,
    seed: u64,
) -> (Vec<Vec<u8>>, Vec<rpma_initiator::Queue>) {
    let (mut d, mut w, mut r) = (queue(t), queue(t), queue(t));
    let mut acked = Vec::new();
    for (i, m) in methods(nsid).into_iter().enumerate() {
        let data = noise(seed + i as u64, 4096);
        let mut ns = d.namespace(nsid).unwrap();
        ns.set_method(Some(m)).unwrap();
        let at = 8192 * i as u64;
        assert_eq!(ns.write_durable(at, &data).unwrap(), Durability::Durable(m));
        acked.push(data);
    }
    for i in 0..methods(nsid).len() as u64 {
        place(
            &mut w,
            &mut r,
            nsid,
            8192 * i + 4096,
            &noise(seed + 100, 4096),
        );
    }
    (acked, vec![d, w, r])
}

#[test]
fn a_sigkill_loses_exactly_what_was_not_persisted() {
    let (_d, _shm, mut t) = start("exact", "eviction_percent = 0");
    let (mut acked, mut queues) = (Vec::new(), Vec::new());
    for nsid in [1, 2, 3] {
        let (a, q) = durable_and_placed(&t, nsid, u64::from(nsid) * 1000);
        acked.push(a);
        queues.extend(q);
    }
    t.kill9(); // the power loss
    drop(queues);
    t.restart(); // the same config again
    let mut q = queue(&t);
    for nsid in [1, 2, 3] {
        for (i, m) in methods(nsid).into_iter().enumerate() {
            let at = 8192 * i as u64;
            assert!(
                read(&mut q, nsid, at, 4096) == acked[nsid as usize - 1][i],
                "nsid {nsid}: the write acknowledged durable with {m} was lost"
            );
            let placed = read(&mut q, nsid, at + 4096, 4096);
            if nsid == 3 {
                // Without the simulation a SIGKILL drops nothing: the page cache keeps what
                // no persist covered, so a crash test there cannot tell a persist that works.
                assert!(
                    placed == noise(nsid as u64 * 1000 + 100, 4096),
                    "nsid 3: lost"
                );
            } else {
                assert!(
                    placed == [0; 4096],
                    "nsid {nsid}: never persisted, yet kept"
                );
            }
        }
    }
}

/// GPSPM from a target's only connection, one request at a time, on nsid 1: on page cache its
/// poll loop syncs each range itself (`Flusher::submit_inline`: the mapping's msync) instead
/// of handing it to the kernel's workers (over rdma the suite's files are pinned, forced dax).
/// What it acknowledged survives the power loss; with a broken persist it does not (so this
/// test sees a sync that does nothing).
#[test]
fn a_lone_connections_gpspm_writes_survive_the_power_loss() {
    assert!(methods(1).contains(&PersistMethod::Gpspm));
    for broken in [false, true] {
        let settings = format!("eviction_percent = 0, broken_persist = {broken}");
        let (_d, _shm, mut t) = start(&format!("lone-{broken}"), &settings);
        let mut q = queue(&t);
        let blocks: Vec<Vec<u8>> = (0..8).map(|i| noise(4200 + i, 4096)).collect();
        {
            let mut ns = q.namespace(1).unwrap();
            ns.set_method(Some(PersistMethod::Gpspm)).unwrap();
            for (i, b) in blocks.iter().enumerate() {
                assert_eq!(
                    ns.write_durable(8192 * i as u64, b).unwrap(),
                    Durability::Durable(PersistMethod::Gpspm)
                );
            }
        }
        t.kill9();
        drop(q);
        t.restart();
        let mut q = queue(&t);
        for (i, b) in blocks.iter().enumerate() {
            let got = read(&mut q, 1, 8192 * i as u64, 4096);
            if broken {
                assert!(got == [0; 4096], "block {i}: kept with a broken persist");
            } else {
                assert!(got == *b, "block {i}: acknowledged durable, and lost");
            }
        }
    }
}

/// Writes `blocks` durably through GPSPM on nsid 1 at 8 KiB strides from `q`, calling
/// `before` ahead of each.
fn gpspm_blocks(q: &mut rpma_initiator::Queue, blocks: &[Vec<u8>], mut before: impl FnMut()) {
    let mut ns = q.namespace(1).unwrap();
    ns.set_method(Some(PersistMethod::Gpspm)).unwrap();
    for (i, b) in blocks.iter().enumerate() {
        before();
        assert_eq!(
            ns.write_durable(8192 * i as u64, b).unwrap(),
            Durability::Durable(PersistMethod::Gpspm)
        );
    }
}

/// Reads the blocks back after a SIGKILL and restart: every one survived, or (a broken
/// persist) none did.
fn blocks_after_the_power_loss(t: &mut Target, blocks: &[Vec<u8>], broken: bool) {
    t.kill9();
    t.restart();
    let mut q = queue(t);
    for (i, b) in blocks.iter().enumerate() {
        let got = read(&mut q, 1, 8192 * i as u64, b.len());
        if broken {
            assert!(
                got.iter().all(|x| *x == 0),
                "block {i}: kept with a broken persist"
            );
        } else {
            assert!(got == *b, "block {i}: acknowledged durable, and lost");
        }
    }
}

/// GPSPM beside a second connection that sends nothing (tcp: page-cache GPSPM): with the other
/// connection quiet for a while before each request, the poll loop syncs the range itself
/// (its own msync) as for a lone connection, and what it acknowledged survives the power loss
/// (a broken persist loses it: the test sees a sync that does nothing).
#[test]
fn gpspm_writes_beside_a_quiet_connection_are_synced_by_the_loop_and_survive_the_power_loss() {
    for broken in [false, true] {
        let settings = format!("eviction_percent = 0, broken_persist = {broken}");
        let (_d, _shm, mut t) = start(&format!("quiet-{broken}"), &settings);
        let (mut q, idle) = (queue(&t), queue(&t));
        let blocks: Vec<Vec<u8>> = (0..6).map(|i| noise(4300 + i, 4096)).collect();
        // Quiet: nothing from the other connection for longer than the loop asks (1 ms).
        gpspm_blocks(&mut q, &blocks, || {
            std::thread::sleep(Duration::from_millis(5))
        });
        let (fdatasyncs, msyncs) = t.gpspm_syncs();
        assert_eq!(fdatasyncs + msyncs, blocks.len() as u64);
        // The first request may see the other connection's set-up as recent traffic.
        assert!(
            msyncs >= 1,
            "no GPSPM request was synced by the loop: {msyncs}"
        );
        drop(idle);
        blocks_after_the_power_loss(&mut t, &blocks, broken);
    }
}

/// GPSPM beside a connection that has just been served a one-sided Read: the poll loop leaves
/// every sync to the kernel's workers (no host whose traffic flows waits for another's sync),
/// as it does for a range over 256 KiB whoever is quiet; the writes survive the power loss.
#[test]
fn a_busy_neighbour_keeps_gpspm_on_the_kernels_workers_and_the_writes_survive_the_power_loss() {
    let (_d, _shm, mut t) = start("busy", "eviction_percent = 0");
    let (mut q, mut busy) = (queue(&t), queue(&t));
    let blocks: Vec<Vec<u8>> = (0..6).map(|i| noise(4400 + i, 4096)).collect();
    // Each durable write right after the other connection's Read was answered.
    gpspm_blocks(&mut q, &blocks, || {
        read(&mut busy, 3, 0, 8);
    });
    assert_eq!(t.gpspm_syncs(), (blocks.len() as u64, 0));
    // A range over 256 KiB with the other connection quiet: still the workers'.
    std::thread::sleep(Duration::from_millis(5));
    let big = noise(4499, 512 << 10);
    {
        let mut ns = q.namespace(1).unwrap();
        assert_eq!(
            ns.write_durable(512 << 10, &big).unwrap(),
            Durability::Durable(PersistMethod::Gpspm)
        );
    }
    assert_eq!(t.gpspm_syncs(), (blocks.len() as u64 + 1, 0));
    drop((q, busy));
    blocks_after_the_power_loss(&mut t, &blocks, false);
    let mut q = queue(&t);
    assert!(
        read(&mut q, 1, 512 << 10, big.len()) == big,
        "the 512 KiB write was lost"
    );
}

#[test]
fn a_clean_stop_is_not_a_power_loss() {
    // SIGTERM: the daemon closes its namespaces, and the simulation writes its working copy
    // back, as the kernel would write the page cache back.
    let (_d, _shm, mut t) = start("clean", "eviction_percent = 0");
    let (mut w, mut r) = (queue(&t), queue(&t));
    for nsid in [1, 2] {
        place(&mut w, &mut r, nsid, 40960, &noise(u64::from(nsid), 4096));
    }
    drop((w, r));
    t.signal(nix::sys::signal::Signal::SIGTERM);
    assert!(t.wait_exit(Duration::from_secs(30)).success());
    t.restart();
    let mut q = queue(&t);
    for nsid in [1, 2] {
        assert!(
            read(&mut q, nsid, 40960, 4096) == noise(u64::from(nsid), 4096),
            "nsid {nsid}: written back at the clean stop, yet gone"
        );
    }
}

#[test]
fn with_a_broken_persist_the_acknowledged_writes_are_lost() {
    let (_d, _shm, mut t) = start("broken", "eviction_percent = 0, broken_persist = true");
    let (mut acked, mut queues) = (Vec::new(), Vec::new());
    for nsid in [1, 2] {
        let (a, q) = durable_and_placed(&t, nsid, u64::from(nsid) * 7000);
        acked.push(a);
        queues.extend(q);
    }
    assert!(
        t.log().contains("persist BROKEN"),
        "the log says so: {}",
        t.log()
    );
    t.kill9();
    drop(queues);
    t.restart();
    let mut q = queue(&t);
    for nsid in [1, 2] {
        for (i, m) in methods(nsid).into_iter().enumerate() {
            let at = 8192 * i as u64;
            assert!(
                read(&mut q, nsid, at, 4096) == [0; 4096],
                "nsid {nsid}, {m}: acknowledged durable, and lost: what a crash test must see"
            );
        }
    }
}

#[test]
fn the_simulated_domain_is_labelled_wherever_it_is_shown() {
    let (_d, _shm, t) = start("label", "");
    let st = t.status();
    let domains: Vec<&str> = st["subsystems"][0]["namespaces"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["domain"].as_str().unwrap())
        .collect();
    let files = Transport::current().file_domain().to_string();
    assert_eq!(
        domains,
        [
            format!("{files}, {SIMULATION_LABEL}").as_str(),
            &format!("dax (forced), {SIMULATION_LABEL}"),
            &files
        ],
        "{st}"
    );
    // The human status too.
    let human = rpma_tests::status(&["--socket", t.dir().join("ctl.sock").to_str().unwrap()]);
    assert!(text(&human).contains(SIMULATION_LABEL), "{}", text(&human));
    let warned = t.log_lines(&[SIMULATION_LABEL, "NOT for production"], Duration::ZERO);
    assert_eq!(warned.len(), 2, "{}", t.log());
    // check-config.
    let out = check_config(&t.dir().join("target.toml"));
    let out = text(&out);
    let simulated = out.lines().filter(|l| l.contains(SIMULATION_LABEL)).count();
    assert_eq!(simulated, 2, "{out}");
    // The initiator: identify and list, in words and JSON.
    let conn = conn_args(&t.url(), SUB, HOST, None);
    let conn: Vec<&str> = conn.iter().map(String::as_str).collect();
    for cmd in ["identify", "list"] {
        let o = initiator(&[&conn[..], &[cmd]].concat());
        assert!(o.status.success(), "{}", text(&o));
        let words = String::from_utf8_lossy(&o.stdout).into_owned();
        let labelled = words
            .lines()
            .filter(|l| l.contains(SIMULATION_LABEL))
            .count();
        assert_eq!(labelled, 2, "{cmd}: {words}");
        let o = initiator(&[&conn[..], &["--json", cmd]].concat());
        assert!(o.status.success(), "{}", text(&o));
        let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        let s = j.to_string();
        assert_eq!(
            s.matches(SIMULATION_LABEL).count(),
            4,
            "{cmd}: domain and simulation: {s}"
        );
    }
    // A durable write's outcome names it.
    let dir = t.dir().join("in");
    std::fs::write(&dir, [7u8; 4096]).unwrap();
    let conn1 = conn_args(&t.url(), SUB, HOST, Some(1));
    let conn1: Vec<&str> = conn1.iter().map(String::as_str).collect();
    let o = initiator(
        &[
            &conn1[..],
            &[
                "write",
                "--offset",
                "0",
                "--durable",
                "--in",
                dir.to_str().unwrap(),
            ],
        ]
        .concat(),
    );
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains(&format!("{files}, {SIMULATION_LABEL})")),
        "{}",
        text(&o)
    );
}

#[test]
fn what_the_simulation_cannot_simulate_is_refused() {
    let d = scratch();
    let shm = Shm::new("refused");
    // /dev/shm without force_dax is volatile: nothing survives a power loss to simulate.
    let config = Config::new().subsystem(
        Subsystem::new(SUB)
            .any_host()
            .namespace(Namespace::new(1, shm.path(), "1MiB").power_loss_simulation("")),
    );
    let cfg = d.path().join("target.toml");
    std::fs::write(
        &cfg,
        format!(
            "listen = [\"tcp://127.0.0.1:{}\"]\ncontrol_socket = \"ctl.sock\"\n{config}",
            rpma_tests::free_port()
        ),
    )
    .unwrap();
    let out = check_config(&cfg);
    assert!(!out.status.success());
    assert!(
        text(&out).contains("no power-loss simulation here: the domain is volatile"),
        "{}",
        text(&out)
    );
    let log = d.path().join("stderr");
    let mut daemon = Daemon::start(
        &cfg,
        d.path(),
        &[],
        Stdio::from(std::fs::File::create(&log).unwrap()),
    );
    let st = daemon.wait_exit(Duration::from_secs(30));
    assert!(!st.success());
    let err = std::fs::read_to_string(&log).unwrap();
    assert!(err.contains("the domain is volatile"), "{err}");
    assert!(
        !std::path::Path::new(shm.path()).exists(),
        "no file left behind"
    );
    // A bad setting names its key.
    std::fs::write(
        &cfg,
        format!(
            "{}",
            Config::new().subsystem(Subsystem::new(SUB).any_host().namespace(
                Namespace::new(1, "ns", "1MiB").power_loss_simulation("eviction_percent = 200")
            ))
        ),
    )
    .unwrap();
    let out = check_config(&cfg);
    assert!(
        text(&out).contains(
            "subsystem[0].namespace[0].power_loss_simulation.eviction_percent: 200 is not a \
             percentage (0..=100)"
        ),
        "{}",
        text(&out)
    );
}

rpma_tests::rdma_runs!(
    a_sigkill_loses_exactly_what_was_not_persisted,
    a_clean_stop_is_not_a_power_loss,
    a_lone_connections_gpspm_writes_survive_the_power_loss,
    with_a_broken_persist_the_acknowledged_writes_are_lost,
    the_simulated_domain_is_labelled_wherever_it_is_shown,
);
