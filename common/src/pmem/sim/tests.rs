use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::*;
use crate::pmem::{Domain, Durability, Error, Mapping, OpenOptions, Persist};

const LEN: u64 = 1 << 20;

/// Eviction off: only persists reach the media.
fn strict() -> Simulation {
    Simulation {
        eviction_percent: 0,
        ..Simulation::default()
    }
}

/// A page-cache file (under the crate, on disk) and a forced-dax one (in /dev/shm).
fn stores() -> (tempfile::TempDir, tempfile::TempDir, [(PathBuf, bool); 2]) {
    let disk = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
    let shm = tempfile::tempdir_in("/dev/shm").unwrap();
    let files = [
        (disk.path().join("ns"), false),
        (shm.path().join("ns"), true),
    ];
    (disk, shm, files)
}

fn open(path: &Path, force_dax: bool, sim: Simulation) -> Mapping {
    open_len(path, force_dax, sim, LEN)
}

fn open_len(path: &Path, force_dax: bool, sim: Simulation, len: u64) -> Mapping {
    OpenOptions::new(path)
        .size(len)
        .create(true)
        .force_dax(force_dax)
        .power_loss_simulation(Some(sim))
        .open()
        .unwrap()
}

fn media(path: &Path, offset: usize, len: usize) -> Vec<u8> {
    std::fs::read(path).unwrap()[offset..offset + len].to_vec()
}

fn read(m: &Mapping, offset: usize, len: usize) -> Vec<u8> {
    let mut b = vec![0; len];
    m.read_at(offset, &mut b).unwrap();
    b
}

#[test]
fn a_persisted_range_survives_a_power_loss_and_an_unpersisted_one_does_not() {
    let (_d, _s, files) = stores();
    for (path, dax) in &files {
        let m = open(path, *dax, strict());
        assert_eq!(
            m.domain(),
            if *dax {
                Domain::DaxForced
            } else {
                Domain::PageCache
            }
        );
        assert!(m.domain_label().ends_with(SIMULATION_LABEL), "{m:?}");
        m.write_at(100, b"durable").unwrap();
        m.write_at(200_000, b"lost").unwrap();
        assert_eq!(m.persist(100, 7).unwrap(), Durability::Durable);
        // Both are visible before the power loss, only one is on the media.
        assert_eq!(read(&m, 200_000, 4), b"lost");
        assert_eq!(media(path, 100, 7), b"durable");
        assert_eq!(media(path, 200_000, 4), [0; 4]);
        let stats = m.simulation_stats().unwrap();
        assert_eq!((stats.events, stats.evicted_units), (1, 0));
        assert_eq!(stats.persisted_units, 1, "one unit covers the 7 bytes");
        m.simulate_power_loss();
        let m = open(path, *dax, strict());
        assert_eq!(read(&m, 100, 7), b"durable");
        assert_eq!(read(&m, 200_000, 4), [0; 4], "never persisted: gone");
        m.simulate_power_loss();
    }
}

#[test]
fn without_the_simulation_a_process_crash_keeps_what_was_never_persisted() {
    // Why the simulation exists: a plain shared mapping's stores are in the page cache at
    // once, so reopening (as after a SIGKILL) finds them although nothing persisted them.
    let d = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
    let path = d.path().join("ns");
    let m = OpenOptions::new(&path)
        .size(LEN)
        .create(true)
        .open()
        .unwrap();
    m.write_at(4096, b"never persisted").unwrap();
    drop(m);
    assert_eq!(media(&path, 4096, 15), b"never persisted");
}

#[test]
fn a_clean_close_writes_everything_back_as_the_kernel_would() {
    let (_d, _s, files) = stores();
    for (path, dax) in &files {
        let m = open(path, *dax, strict());
        m.write_at(300_000, b"cached").unwrap();
        drop(m);
        assert_eq!(media(path, 300_000, 6), b"cached");
        let m = open(path, *dax, strict());
        assert_eq!(read(&m, 300_000, 6), b"cached");
        m.simulate_power_loss();
    }
}

#[test]
fn a_flush_reaches_the_media_at_the_drain_and_not_before() {
    let (_d, _s, files) = stores();
    for (path, dax) in &files {
        let m = open(path, *dax, strict());
        m.write_at(8192, b"flushed").unwrap();
        m.flush(8192, 7).unwrap();
        assert_eq!(media(path, 8192, 7), [0; 7], "flushed, not drained");
        assert_eq!(m.drain().unwrap(), Durability::Durable);
        assert_eq!(media(path, 8192, 7), b"flushed");
        // A flush without its drain is lost with the power.
        m.write_at(16384, b"undrained").unwrap();
        m.flush(16384, 9).unwrap();
        m.simulate_power_loss();
        let m = open(path, *dax, strict());
        assert_eq!(read(&m, 8192, 7), b"flushed");
        assert_eq!(read(&m, 16384, 9), [0; 9]);
        m.simulate_power_loss();
    }
}

#[test]
fn the_unit_is_a_cache_line_on_dax_and_a_page_on_page_cache() {
    let (_d, _s, files) = stores();
    for (path, dax) in &files {
        let m = open(path, *dax, strict());
        // Two bytes 128 apart: the same page, different cache lines.
        m.write_at(0, b"a").unwrap();
        m.write_at(128, b"b").unwrap();
        m.persist(0, 1).unwrap();
        let neighbour = media(path, 128, 1);
        if *dax {
            assert_eq!(neighbour, [0], "another cache line: not written");
        } else {
            assert_eq!(neighbour, b"b", "msync writes the whole page");
        }
        m.simulate_power_loss();
    }
}

#[test]
fn a_later_store_to_a_persisted_range_is_not_durable_until_persisted_again() {
    // The order a fence gives: what the persist covered is on the media; a store made after it
    // is not, however close, until a persist covers it.
    let (_d, _s, files) = stores();
    for (path, dax) in &files {
        let m = open(path, *dax, strict());
        m.write_at(512, b"first").unwrap();
        m.persist(512, 5).unwrap();
        m.write_at(512, b"again").unwrap();
        m.simulate_power_loss();
        let m = open(path, *dax, strict());
        assert_eq!(read(&m, 512, 5), b"first");
        m.write_at(512, b"third").unwrap();
        m.persist(512, 5).unwrap();
        m.simulate_power_loss();
        let m = open(path, *dax, strict());
        assert_eq!(read(&m, 512, 5), b"third");
        m.simulate_power_loss();
    }
}

/// The generation stamped in every 8 bytes of a unit, or None if the unit is torn.
fn generation(b: &[u8]) -> Option<u64> {
    let first = u64::from_le_bytes(b[..8].try_into().unwrap());
    b.chunks(8)
        .all(|c| u64::from_le_bytes(c.try_into().unwrap()) == first)
        .then_some(first)
}

#[test]
fn eviction_never_takes_the_media_back_behind_a_completed_persist() {
    let (_d, _s, files) = stores();
    for (path, dax) in &files {
        let all = Simulation {
            eviction_percent: 100,
            seed: 7,
            ..Simulation::default()
        };
        // 128 KiB: every 64 KiB eviction window has an even chance to cover the 16 units.
        let len = 128 << 10;
        let m = Arc::new(open_len(path, *dax, all, len as u64));
        let unit = if *dax { cache_line() } else { 4096 };
        // One thread stores and persists generations into 16 units; another makes eviction
        // happen all the time (persists of a range of its own); the media is checked against
        // what was persisted after every persist.
        let stop = Arc::new(AtomicBool::new(false));
        let evictor = {
            let (m, stop) = (m.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    m.persist(len - 64, 64).unwrap();
                }
            })
        };
        let (mut persisted, mut written) = ([0u64; 16], [0u64; 16]);
        for g in 1..=300u64 {
            let i = (g as usize * 7) % 16;
            let stamp: Vec<u8> = g.to_le_bytes().repeat(unit / 8);
            m.write_at(i * unit, &stamp).unwrap();
            written[i] = g;
            if g % 3 != 0 {
                m.persist(i * unit, unit).unwrap();
                persisted[i] = g;
            }
            let on_media = media(path, 0, 16 * unit);
            for j in 0..16 {
                let (p, w) = (persisted[j], written[j]);
                match generation(&on_media[j * unit..(j + 1) * unit]) {
                    Some(s) => assert!(
                        s >= p && s <= w,
                        "unit {j}: media has {s}, persisted {p}, written {w}"
                    ),
                    // Evicted while its store was being made: only ahead of its persist.
                    None => assert!(w > p, "unit {j}: torn, persisted {p} is its last store"),
                }
            }
        }
        stop.store(true, Ordering::Relaxed);
        evictor.join().unwrap();
        let stats = m.simulation_stats().unwrap();
        assert!(stats.evicted_units > 0, "{stats:?}");
        Arc::into_inner(m).unwrap().simulate_power_loss();
    }
}

fn cache_line() -> usize {
    crate::pmem::cache_line_size()
}

#[test]
fn eviction_writes_unpersisted_units_and_is_reproducible_from_its_seed() {
    let run = |seed: u64| {
        let d = tempfile::tempdir_in("/dev/shm").unwrap();
        let path = d.path().join("ns");
        let sim = Simulation {
            seed,
            eviction_percent: 50,
            ..Simulation::default()
        };
        let m = open(&path, true, sim);
        // Dirty every line, then let 8 persists of one line evict at random (8 windows of
        // 64 KiB, half of their lines each).
        m.write_at(0, &vec![0xAB; LEN as usize]).unwrap();
        for _ in 0..8 {
            m.persist(0, 1).unwrap();
        }
        let stats = m.simulation_stats().unwrap();
        m.simulate_power_loss();
        (std::fs::read(&path).unwrap(), stats)
    };
    let (a, sa) = run(1);
    let (b, sb) = run(1);
    let (c, _) = run(2);
    assert!(sa.evicted_units > 0);
    assert_eq!(sa, sb);
    assert!(a == b, "same seed, same calls: the same media");
    assert!(a != c, "another seed evicts other lines");
    let written = a.iter().filter(|&&x| x == 0xAB).count();
    assert!(
        written > 64 && written < LEN as usize / 2,
        "{written} bytes on the media: some evicted, most not"
    );
}

#[test]
fn the_eviction_timer_writes_unpersisted_units_without_any_persist() {
    let d = tempfile::tempdir_in("/dev/shm").unwrap();
    let path = d.path().join("ns");
    let sim = Simulation {
        eviction_interval_ms: 1,
        eviction_percent: 100,
        ..Simulation::default()
    };
    let m = open(&path, true, sim);
    m.write_at(0, &vec![0xCD; LEN as usize]).unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !std::fs::read(&path).unwrap().contains(&0xCD) {
        assert!(std::time::Instant::now() < deadline, "no eviction in 10 s");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert!(m.simulation_stats().unwrap().evicted_units > 0);
    m.simulate_power_loss();
    // The timer stops with the power: the media changes no more.
    let after = std::fs::read(&path).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(20));
    assert!(std::fs::read(&path).unwrap() == after);
}

#[test]
fn a_broken_persist_answers_durable_and_writes_nothing() {
    let (_d, _s, files) = stores();
    for (path, dax) in &files {
        let broken = Simulation {
            broken_persist: true,
            ..strict()
        };
        let m = open(path, *dax, broken);
        assert!(m.domain_label().ends_with("persist BROKEN"));
        m.write_at(0, b"acknowledged").unwrap();
        assert_eq!(m.persist(0, 12).unwrap(), Durability::Durable);
        m.flush(0, 12).unwrap();
        assert_eq!(m.drain().unwrap(), Durability::Durable);
        m.before_sync(0, 12).unwrap();
        m.after_sync(0, 12).unwrap();
        m.simulate_power_loss();
        assert_eq!(media(path, 0, 12), [0; 12]);
    }
}

/// The flush service's sync: the range reaches the media once the sync returned
/// (`after_sync`), not before it (`before_sync` checks only).
#[test]
fn the_flush_service_sync_copies_the_range_to_the_media() {
    let (_d, _s, files) = stores();
    for (path, dax) in &files {
        let m = open(path, *dax, strict());
        m.write_at(40_000, b"gpspm").unwrap();
        m.before_sync(40_000, 5).unwrap();
        assert_eq!(media(path, 40_000, 5), [0; 5]);
        m.after_sync(40_000, 5).unwrap();
        assert_eq!(media(path, 40_000, 5), b"gpspm");
        assert!(
            !m.durable_by_writeback(),
            "the placement must record its ranges"
        );
        assert!(matches!(
            m.before_sync(LEN as usize, 1),
            Err(Error::OutOfRange { .. })
        ));
        assert!(matches!(
            m.after_sync(LEN as usize, 1),
            Err(Error::OutOfRange { .. })
        ));
        m.simulate_power_loss();
    }
    let plain = Mapping::anonymous(4096).unwrap();
    plain.before_sync(0, 4096).unwrap();
    plain.after_sync(0, 4096).unwrap();
}

#[test]
fn openings_of_one_file_share_one_cache() {
    let d = tempfile::tempdir_in("/dev/shm").unwrap();
    let path = d.path().join("ns");
    let a = open(&path, true, strict());
    let b = open(&path, true, strict());
    a.write_at(10, b"shared").unwrap();
    assert_eq!(read(&b, 10, 6), b"shared");
    let other = Simulation {
        seed: 99,
        ..strict()
    };
    let e = OpenOptions::new(&path)
        .force_dax(true)
        .power_loss_simulation(Some(other))
        .open()
        .unwrap_err();
    assert!(
        matches!(e, Error::SimulationUnsupported { .. }) && e.to_string().contains("settings"),
        "{e}"
    );
    // Nor another size (grown on purpose: the simulation's cache has the old one).
    let e = OpenOptions::new(&path)
        .size(2 * LEN)
        .resize(crate::pmem::Resize::Grow)
        .force_dax(true)
        .power_loss_simulation(Some(strict()))
        .open()
        .unwrap_err();
    assert!(
        matches!(e, Error::SimulationUnsupported { .. }) && e.to_string().contains("size"),
        "{e}"
    );
    assert_eq!(
        std::fs::metadata(&path).unwrap().len(),
        LEN,
        "refused before growing"
    );
    drop(a);
    assert_eq!(media(&path, 10, 6), [0; 6], "b still holds the cache");
    drop(b);
    assert_eq!(media(&path, 10, 6), b"shared");
}

#[test]
fn the_simulation_is_refused_where_there_is_nothing_to_simulate() {
    let d = tempfile::tempdir_in("/dev/shm").unwrap();
    let path = d.path().join("volatile");
    let opts = OpenOptions::new(&path)
        .size(LEN)
        .create(true)
        .power_loss_simulation(Some(Simulation::default()));
    for e in [opts.open().unwrap_err(), opts.plan().unwrap_err()] {
        assert!(matches!(e, Error::SimulationUnsupported { .. }), "{e:?}");
        assert!(e.to_string().contains("volatile"), "{e}");
    }
    assert!(!path.exists(), "the refused open left no file behind");
    // A devdax device cannot be the media (no pwrite); what open and plan check for it.
    let e = opts.check_simulation(true, Domain::Dax).unwrap_err();
    assert!(e.to_string().contains("devdax"), "{e}");
    assert!(OpenOptions::new(&path)
        .check_simulation(true, Domain::Dax)
        .is_ok());
    // The plan of a simulated page-cache file goes through.
    let disk = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
    let plan = OpenOptions::new(disk.path().join("ns"))
        .size(LEN)
        .create(true)
        .power_loss_simulation(Some(Simulation::default()))
        .plan()
        .unwrap();
    assert_eq!(plan.domain, Domain::PageCache);
}

#[test]
fn labels_name_the_simulation_and_a_broken_persist() {
    assert_eq!(Simulation::default().label(), SIMULATION_LABEL);
    let broken = Simulation {
        broken_persist: true,
        ..Simulation::default()
    };
    assert_eq!(
        broken.label(),
        "power-loss simulation (test only), persist BROKEN"
    );
    let plain = Mapping::anonymous(4096).unwrap();
    assert_eq!(plain.domain_label(), "volatile");
    assert!(plain.simulation().is_none() && plain.simulation_stats().is_none());
}

#[test]
fn after_a_power_loss_the_other_openings_reach_the_media_no_more() {
    let (_d, _s, files) = stores();
    for (path, dax) in &files {
        let a = open(path, *dax, strict());
        let b = open(path, *dax, strict());
        a.simulate_power_loss();
        b.write_at(100, b"after").unwrap();
        assert!(
            b.persist(100, 5).is_err(),
            "a dead cache answers no persist"
        );
        assert_eq!(media(path, 100, 5), [0; 5]);
        // Nor does its close write the dead cache back.
        drop(b);
        assert_eq!(media(path, 100, 5), [0; 5]);
    }
}
