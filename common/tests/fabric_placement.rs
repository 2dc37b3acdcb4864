//! Placement on the responder: the memory a Write FPDU is placed into stays alive for the whole
//! FPDU (which a deregistration lets finish), nothing more of it lands once its region is
//! revoked, and what an out-of-bounds
//! multi-FPDU Write may and may not change.

mod fabric_util;

use std::io::Write;
use std::net::TcpStream;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use fabric_util::*;
use rpma_common::fabric::soft::wire::{mpa, CapFlags, Header, Opcode};
use rpma_common::fabric::*;

/// A target queue pair (CRC off) accepting a raw peer: (target QP, its CQ, its PD, the peer).
fn raw_pair() -> (
    QueuePair,
    CompletionQueue,
    ProtectionDomain,
    TcpStream,
    mpa::Negotiated,
) {
    let ctx = Context::soft();
    let listener = Listener::bind(&ctx, &"tcp://127.0.0.1:0".parse().unwrap()).unwrap();
    let url = listener.url().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(16).unwrap();
    let (pd2, cq2) = (pd.clone(), cq.clone());
    let h = std::thread::spawn(move || {
        let params = params(false);
        let req = listener.accept(&params).unwrap();
        let qp = pd2.create_qp(&cq2, &cq2, QpCaps::default()).unwrap();
        req.accept(qp, &params, b"").unwrap()
    });
    let (s, n) = raw_peer(&url, CapFlags::ALL, 4);
    let qp = h.join().unwrap();
    (qp, cq, pd, s, n)
}

/// Polls `cq` (which drives the target) for `d`.
fn drive(cq: &CompletionQueue, d: Duration) {
    let end = Instant::now() + d;
    let mut wc = [Completion::EMPTY; 4];
    while Instant::now() < end {
        cq.poll(&mut wc).unwrap();
    }
}

/// The receiver holds only a raw pointer into the region while a payload streams into place:
/// the region stays alive after its MR is dropped until the FPDU is in. A deregistration
/// refuses new access only: the Write accepted before it lands whole (a daemon deregisters a
/// departing host's regions before its Disconnect; that host's last Write must not fail with a
/// remote access error).
#[test]
fn dropping_the_mr_mid_fpdu_keeps_its_memory_alive_until_the_fpdu_is_in() {
    let (qp, cq, pd, mut s, n) = raw_pair();
    assert!(!n.crc, "CRC off: the payload is read straight into place");
    let buf = AlignedBuf::new(1 << 16).unwrap();
    let mr = pd.register(Arc::clone(&buf), rw()).unwrap();
    let payload = vec![0x5Au8; 30000]; // long enough to be read straight into place
    let frame = fpdu(
        Header::tagged(Opcode::Write, mr.rkey(), mr.addr() + 100, true),
        &payload,
    );
    // The MPA length, the DDP/RDMAP header and 3000 payload bytes.
    let split = 2 + 14 + 3000;
    s.write_all(&frame[..split]).unwrap();
    // Until placing began (a fixed spell of polling was a guess at when the bytes arrive).
    let deadline = Instant::now() + Duration::from_secs(10);
    while buf.read_u64(100).unwrap() != 0x5A5A_5A5A_5A5A_5A5A {
        assert!(Instant::now() < deadline, "placing never began");
        drive(&cq, Duration::from_millis(1));
    }
    let weak: Weak<AlignedBuf> = Arc::downgrade(&buf);
    drop(mr);
    drop(buf);
    assert!(
        weak.upgrade().is_some(),
        "the FPDU in placement keeps the memory alive after its MR is dropped"
    );
    drive(&cq, Duration::from_millis(50));
    assert!(weak.upgrade().is_some(), "still: the FPDU is not complete");
    s.write_all(&frame[split..]).unwrap();
    let end = Instant::now() + Duration::from_secs(10);
    while weak.upgrade().is_some() && Instant::now() < end {
        drive(&cq, Duration::from_millis(10));
    }
    assert!(
        weak.upgrade().is_none(),
        "released once the FPDU is reported"
    );
    assert_eq!(
        qp.state(),
        QpState::Rts,
        "the Write was valid when it began"
    );
}

/// A Write whose region is revoked between its header and the rest of its payload (CRC
/// off, where the header is judged as soon as it is in): nothing more of it lands, whether the
/// payload is read straight into place or gathered first; the peer gets a DDP Invalid STag
/// Terminate, as a Write with that rkey would from then on. (A reload removing a namespace
/// while a host's Write to it was arriving let its rest into the file.)
#[test]
fn a_write_whose_region_is_revoked_mid_fpdu_places_nothing_more() {
    // (payload, bytes of it sent before the revocation): read into place, gathered.
    for (len, first) in [(30_000, 3000), (4000, 1000)] {
        let (qp, cq, pd, mut s, _) = raw_pair();
        let buf = AlignedBuf::new(1 << 16).unwrap();
        let mr = pd.register(Arc::clone(&buf), rw()).unwrap();
        let frame = fpdu(
            Header::tagged(Opcode::Write, mr.rkey(), mr.addr() + 100, true),
            &vec![0x5Au8; len],
        );
        let split = 2 + 14 + first;
        s.write_all(&frame[..split]).unwrap();
        // Until the header was judged and the first bytes taken.
        drive(&cq, Duration::from_millis(100));
        let placed = |buf: &AlignedBuf| buf.to_vec().iter().filter(|&&b| b == 0x5A).count();
        let before = placed(&buf);
        assert!(before <= first);
        mr.revoke();
        drop(mr);
        s.write_all(&frame[split..]).unwrap();
        let got = read_while(&mut s, || {
            drive(&cq, Duration::from_millis(1));
            qp.state() == QpState::Error
        });
        assert_eq!(
            placed(&buf),
            before,
            "payload {len}: bytes landed after the revocation"
        );
        let t = terminate_in(&got).expect("a Terminate");
        assert_eq!(
            t.cause,
            rpma_common::fabric::soft::wire::TermCause::DDP_TAGGED_INVALID_STAG,
            "payload {len}"
        );
    }
}

#[test]
fn a_multi_fpdu_write_running_out_of_bounds_lands_only_its_full_in_bounds_segments() {
    // 128-byte ULPDUs: 14 bytes of tagged DDP/RDMAP header, 114 of payload per FPDU.
    const SEG: usize = 128 - 14;
    let ip = ConnParams {
        tcp: TcpParams {
            max_ulpdu: 128,
            ..TcpParams::default()
        },
        ..params(true)
    };
    let p = Pair::with(ip, params(true), |_| {});
    let (tmem, tmr) = p.target_buf(4096, rw());
    let inside = 300; // bytes of the Write that fall inside the region
    let start = 4096 - inside;
    let len = 500;
    let (imem, imr) = p.init_buf(len + 8, Access::LOCAL_WRITE);
    imem.write_at(0, &vec![0xAB; len]).unwrap();
    p.qp.post_send(SendWr::new(
        1,
        SendOp::Write {
            local: Sge::new(&imr, 0, len),
            remote: tmr.remote(start as u64),
        },
    ))
    .unwrap();
    p.qp.post_send(SendWr::new(
        2,
        SendOp::Read {
            local: Sge::new(&imr, len, 8),
            remote: tmr.remote(0),
        },
    ))
    .unwrap();
    assert_eq!(p.until_init(2).1.status, WcStatus::RemoteAccess);
    p.assert_both_error();
    let mem = tmem.to_vec();
    // DDP tagged segments carry no message length: each FPDU is checked on its own. The full
    // segments before the offending one were in bounds and landed; the offending segment (the
    // one that would cross the end) placed nothing, and nothing after it was placed.
    let landed = (inside / SEG) * SEG;
    assert_eq!(landed, 228);
    assert!(
        mem[..start].iter().all(|&b| b == 0),
        "nothing before the Write"
    );
    assert!(
        mem[start..start + landed].iter().all(|&b| b == 0xAB),
        "the in-bounds full segments landed"
    );
    assert!(
        mem[start + landed..].iter().all(|&b| b == 0),
        "the offending segment placed nothing"
    );
}

/// Minor page faults of the calling thread so far.
fn thread_minor_faults() -> i64 {
    // SAFETY: getrusage writes one plain struct, zero-initialisable, that outlives the call.
    unsafe {
        let mut ru: libc::rusage = std::mem::zeroed();
        assert_eq!(libc::getrusage(libc::RUSAGE_THREAD, &mut ru), 0);
        ru.ru_minflt
    }
}

/// On a page-cache namespace the engine places a Write with pwrite into the file, not with
/// stores into the mapping: a page the last msync cleaned takes no write fault (the target's
/// cost per durable write on a disk, docs/benchmarks.md), and the bytes are in the file's page
/// cache, which the mapping shows. With stores, every page written faults once after the
/// msync (this test fails on that code).
#[test]
fn a_write_into_a_page_cache_namespace_takes_no_write_fault() {
    use rpma_common::pmem::{Domain, OpenOptions, Persist};
    use std::os::unix::fs::FileExt;
    const PAGES: usize = 64;
    // What round `round` writes into `page`: different in every round and page.
    let value = |round: u8, page: usize| 0x10 + 0x40 * round + (page % 16) as u8;
    for crc in [true, false] {
        let dir = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        let path = dir.path().join("ns");
        let m = Arc::new(
            OpenOptions::new(&path)
                .size((PAGES * 4096) as u64)
                .create(true)
                .open()
                .unwrap(),
        );
        assert_eq!(m.domain(), Domain::PageCache);
        let p = Pair::new(crc);
        let mr = p.pd.register(Arc::clone(&m), rw()).unwrap();
        let (src, smr) = p.init_buf(4096, Access::LOCAL_WRITE);
        let write = |wr_id: u64, page: usize, byte: u8| {
            src.write_at(0, &[byte; 4096]).unwrap();
            p.qp.post_send(SendWr::new(
                wr_id,
                SendOp::Write {
                    local: Sge::new(&smr, 0, 4096),
                    remote: mr.remote((page * 4096) as u64),
                },
            ))
            .unwrap();
            // An 8-byte Read behind it: answered once the Write is placed.
            p.qp.post_send(SendWr::new(
                wr_id + 1,
                SendOp::Read {
                    local: Sge::new(&smr, 0, 8),
                    remote: mr.remote(0),
                },
            ))
            .unwrap();
            let (_, c) = p.until_init(wr_id + 1);
            assert_eq!(c.status, WcStatus::Success, "{c:?}");
        };
        // Every page once (and the engine's own buffers warm).
        for page in 0..PAGES {
            write(10 + 2 * page as u64, page, 1);
        }
        // Rounds of: the file synced (its pages clean, mapped read-only until the next write to
        // each), then every page written again, counting the test thread's minor faults (it
        // polls both completion queues: it runs the target's placement). A store into each
        // page would fault once per page in every round. Faults only add to what placement
        // takes, so the fewest of three rounds is what it took: under ThreadSanitizer the
        // runtime's periodic reset of its shadow memory lands in some round and refaults
        // everything the thread touches (measured: 654 faults in one round of sixty, 0 in the
        // others).
        let mut faults = Vec::new();
        for round in 0..3u8 {
            Persist::persist(&*m, 0, PAGES * 4096).unwrap();
            let mut b = [0u8; 1];
            for page in 0..PAGES {
                m.read_at(page * 4096, &mut b).unwrap();
            }
            let before = thread_minor_faults();
            for page in 0..PAGES {
                let wr_id = 1000 * (u64::from(round) + 1) + 2 * page as u64;
                write(wr_id, page, value(round, page));
            }
            faults.push(thread_minor_faults() - before);
        }
        assert!(
            faults.iter().min().is_some_and(|&f| f < PAGES as i64 / 4),
            "crc {crc}: {faults:?} page faults placing {PAGES} pages in each round"
        );
        let file = std::fs::File::open(&path).unwrap();
        for page in 0..PAGES {
            let want = value(2, page);
            let mut got = [0u8; 4096];
            file.read_exact_at(&mut got, (page * 4096) as u64).unwrap();
            assert!(
                got.iter().all(|&x| x == want),
                "crc {crc}: page {page} in the file"
            );
            let mut b = [0u8; 1];
            m.read_at(page * 4096 + 4095, &mut b).unwrap();
            assert_eq!(b[0], want, "crc {crc}: page {page} in the mapping");
        }
    }
}

use rpma_common::pmem::unsynced_pages;

/// The pwrite placement leaves the bytes in the file's page cache, dirty, where a Flush
/// Persistent of their range finds them: after it the range's pages are written back, and the
/// pages of the same Writes outside the range are still dirty (so the check can see a flush
/// that syncs nothing, and one that only orders: the Read after the Writes synced nothing).
#[test]
fn a_pwrite_placed_write_is_synced_by_a_flush_of_its_range() {
    use rpma_common::pmem::{Domain, OpenOptions};
    const PAGES: u64 = 32;
    const HALF: u64 = PAGES / 2 * 4096;
    for crc in [true, false] {
        let dir = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        let path = dir.path().join("ns");
        let m = Arc::new(
            OpenOptions::new(&path)
                .size(PAGES * 4096)
                .create(true)
                .open()
                .unwrap(),
        );
        assert_eq!(m.domain(), Domain::PageCache);
        let Some(_) = unsynced_pages(&path, 0, PAGES * 4096) else {
            eprintln!("SKIPPED: this kernel has no cachestat(2) to see unsynced pages");
            return;
        };
        let p = Pair::new(crc);
        let mr =
            p.pd.register(Arc::clone(&m), rw() | Access::FLUSH_PERSISTENT)
                .unwrap();
        let (src, smr) = p.init_buf((PAGES * 4096) as usize, Access::LOCAL_WRITE);
        // The kernel's background write-back may clean pages before we look: write again
        // until both halves are seen dirty.
        let mut seen_dirty = false;
        for round in 0..5u64 {
            src.write_at(0, &vec![0x30 + round as u8; (PAGES * 4096) as usize])
                .unwrap();
            p.qp.post_send(SendWr::new(
                10 * round + 1,
                SendOp::Write {
                    local: Sge::new(&smr, 0, (PAGES * 4096) as usize),
                    remote: mr.remote(0),
                },
            ))
            .unwrap();
            // A Read behind the Writes: on page-cache it orders them and syncs nothing.
            p.qp.post_send(SendWr::new(
                10 * round + 2,
                SendOp::Read {
                    local: Sge::new(&smr, 0, 8),
                    remote: mr.remote(0),
                },
            ))
            .unwrap();
            let (_, c) = p.until_init(10 * round + 2);
            assert_eq!(c.status, WcStatus::Success, "{c:?}");
            let lo = unsynced_pages(&path, 0, HALF).unwrap();
            let hi = unsynced_pages(&path, HALF, HALF).unwrap();
            if lo > 0 && hi > 0 {
                seen_dirty = true;
                break;
            }
        }
        assert!(
            seen_dirty,
            "crc {crc}: five rounds written back before a look"
        );
        p.qp.post_send(SendWr::new(
            100,
            SendOp::Flush {
                target: FlushTarget::Range {
                    remote: mr.remote(0),
                    len: HALF,
                },
                kind: FlushType::Persistent,
            },
        ))
        .unwrap();
        let (_, c) = p.until_init(100);
        assert_eq!(c.status, WcStatus::Success, "{c:?}");
        assert_eq!(
            unsynced_pages(&path, 0, HALF),
            Some(0),
            "crc {crc}: the flushed range is written back"
        );
        assert!(
            unsynced_pages(&path, HALF, HALF).unwrap() > 0,
            "crc {crc}: outside the range nothing was synced"
        );
    }
}

/// Bytes the calling thread has written with write-like system calls so far (`wchar` of
/// /proc/thread-self/io: `pwrite` and the sockets' `writev` count; stores into a mapping do
/// not). None without the kernel's task I/O accounting.
fn thread_wchar() -> Option<u64> {
    let io = std::fs::read_to_string("/proc/thread-self/io").ok()?;
    io.lines()
        .find_map(|l| l.strip_prefix("wchar: "))
        .and_then(|v| v.trim().parse().ok())
}

/// The first Write into a page-cache page after its write-back is placed with `pwrite`, the
/// later ones with stores (no system call: the page is dirty and writable in the mapping), and
/// a Flush Persistent of the range still writes the stored pages back, after which the next
/// Write is a `pwrite` again. Seen in the bytes the placing thread wrote with system calls: a
/// round placed with `pwrite` writes the payload once more than a round placed with stores.
#[test]
fn a_page_written_twice_since_its_write_back_is_stored_into_and_a_flush_syncs_it() {
    use rpma_common::pmem::{Domain, OpenOptions};
    const LEN: usize = 32 * 4096;
    for crc in [true, false] {
        let dir = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        let path = dir.path().join("ns");
        let m = Arc::new(
            OpenOptions::new(&path)
                .size(LEN as u64)
                .create(true)
                .open()
                .unwrap(),
        );
        assert_eq!(m.domain(), Domain::PageCache);
        let Some(_) = thread_wchar() else {
            eprintln!("SKIPPED: no /proc/thread-self/io (task I/O accounting) to see pwrites");
            return;
        };
        let p = Pair::new(crc);
        let mr =
            p.pd.register(Arc::clone(&m), rw() | Access::FLUSH_PERSISTENT)
                .unwrap();
        let (src, smr) = p.init_buf(LEN, Access::LOCAL_WRITE);
        // One Write of the whole range and a Read behind it (answered once it is placed);
        // returns the bytes this thread wrote with system calls meanwhile, and its page faults.
        // The test thread polls both completion queues: it runs the target's placement.
        let round = |n: u64| {
            src.write_at(0, &vec![0x40 + n as u8; LEN]).unwrap();
            let before = thread_wchar().unwrap();
            let faults = thread_minor_faults();
            p.qp.post_send(SendWr::new(
                10 * n + 1,
                SendOp::Write {
                    local: Sge::new(&smr, 0, LEN),
                    remote: mr.remote(0),
                },
            ))
            .unwrap();
            p.qp.post_send(SendWr::new(
                10 * n + 2,
                SendOp::Read {
                    local: Sge::new(&smr, 0, 8),
                    remote: mr.remote(0),
                },
            ))
            .unwrap();
            let (_, c) = p.until_init(10 * n + 2);
            assert_eq!(c.status, WcStatus::Success, "{c:?}");
            (
                thread_wchar().unwrap() - before,
                thread_minor_faults() - faults,
            )
        };
        let (first, _) = round(1);
        let (second, _) = round(2);
        let (third, _) = round(3);
        let pwritten = |d: u64| d >= third + LEN as u64 * 9 / 10;
        assert!(
            pwritten(first),
            "crc {crc}: the first Write is pwritten: {first} bytes against {third} for the third"
        );
        assert!(
            !pwritten(second),
            "crc {crc}: the second Write is stored: {second} bytes, the third {third}"
        );
        if let Some(n) = unsynced_pages(&path, 0, LEN as u64) {
            assert!(n > 0, "crc {crc}: the stored pages are dirty");
        }
        p.qp.post_send(SendWr::new(
            100,
            SendOp::Flush {
                target: FlushTarget::Range {
                    remote: mr.remote(0),
                    len: LEN as u64,
                },
                kind: FlushType::Persistent,
            },
        ))
        .unwrap();
        let (_, c) = p.until_init(100);
        assert_eq!(c.status, WcStatus::Success, "{c:?}");
        if let Some(n) = unsynced_pages(&path, 0, LEN as u64) {
            assert_eq!(n, 0, "crc {crc}: the Flush wrote the stored pages back");
        }
        let (after_flush, faults) = round(4);
        assert!(
            pwritten(after_flush),
            "crc {crc}: after the write-back a pwrite again: {after_flush} bytes, {third} stored"
        );
        // The Write is cut into segments (FPDUs) inside pages: the segment after a cut places
        // the rest of a page the one before it wrote with pwrite, and is a pwrite too (a store
        // there would fault, once per cut). Not under ThreadSanitizer, whose shadow memory
        // faults too.
        assert!(
            faults == 0 || cfg!(rpma_tsan),
            "crc {crc}: {faults} page faults placing a Write with pwrite"
        );
        let mut got = vec![0u8; LEN];
        std::os::unix::fs::FileExt::read_exact_at(
            &std::fs::File::open(&path).unwrap(),
            &mut got,
            0,
        )
        .unwrap();
        assert!(
            got.iter().all(|&b| b == 0x44),
            "crc {crc}: the file holds round 4"
        );
    }
}

/// Page-cache memory whose placement file is open read-only: every pwrite into it fails.
struct ReadOnlyFile {
    map: Arc<rpma_common::pmem::Mapping>,
    file: std::fs::File,
}

// SAFETY: all of it is the Mapping's memory, which satisfies the contract itself; this type
// adds no references into it.
unsafe impl RegisteredMemory for ReadOnlyFile {
    fn as_mut_ptr(&self) -> *mut u8 {
        RegisteredMemory::as_mut_ptr(&*self.map)
    }
    fn len(&self) -> usize {
        RegisteredMemory::len(&*self.map)
    }
    fn persist(&self) -> Option<&dyn rpma_common::pmem::Persist> {
        RegisteredMemory::persist(&*self.map)
    }
    fn placement_file(&self, _: usize, _: usize) -> Option<std::os::fd::BorrowedFd<'_>> {
        use std::os::fd::AsFd;
        Some(self.file.as_fd())
    }
}

/// A pwrite placement that fails is not a placed Write: the connection is terminated (as a
/// failed store would have), the Read behind it is never answered with success, and nothing
/// reaches the file.
#[test]
fn a_failed_pwrite_placement_terminates_the_connection() {
    use rpma_common::pmem::OpenOptions;
    for crc in [true, false] {
        let dir = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        let path = dir.path().join("ns");
        let map = Arc::new(
            OpenOptions::new(&path)
                .size(16 * 4096)
                .create(true)
                .open()
                .unwrap(),
        );
        let mem = Arc::new(ReadOnlyFile {
            map,
            file: std::fs::File::open(&path).unwrap(),
        });
        let p = Pair::new(crc);
        let mr = p.pd.register(mem, rw()).unwrap();
        let (src, smr) = p.init_buf(8192, Access::LOCAL_WRITE);
        src.write_at(0, &[0x77; 8192]).unwrap();
        p.qp.post_send(SendWr::new(
            1,
            SendOp::Write {
                local: Sge::new(&smr, 0, 8192),
                remote: mr.remote(4096),
            },
        ))
        .unwrap();
        p.qp.post_send(SendWr::new(
            2,
            SendOp::Read {
                local: Sge::new(&smr, 0, 8),
                remote: mr.remote(4096),
            },
        ))
        .unwrap();
        p.assert_both_error();
        let (init, _) = p.settle(Duration::from_millis(100));
        assert!(
            init.iter()
                .all(|c| c.wr_id != 2 || c.status != WcStatus::Success),
            "crc {crc}: the Read after a failed placement succeeded: {init:?}"
        );
        let mut got = vec![0u8; 8192];
        std::os::unix::fs::FileExt::read_exact_at(
            &std::fs::File::open(&path).unwrap(),
            &mut got,
            4096,
        )
        .unwrap();
        assert!(got.iter().all(|&b| b == 0), "crc {crc}: bytes in the file");
    }
}
