//! `QueuePair::responder_counters`: what the soft placement engine served, per rkey, read
//! through the public API while the queue pairs run.

mod fabric_util;

use std::sync::Arc;

use fabric_util::{post_write, rw, Pair};
use rpma_common::fabric::*;

/// A page-cache mapping (a file on the disk the sources are on; /tmp may be a tmpfs).
fn page_cache(dir: &std::path::Path) -> Arc<rpma_common::pmem::Mapping> {
    let m = rpma_common::pmem::OpenOptions::new(dir.join("ns"))
        .size(1 << 20)
        .create(true)
        .open()
        .unwrap();
    assert_eq!(m.domain(), rpma_common::pmem::Domain::PageCache);
    Arc::new(m)
}

/// A dax (forced) mapping, where a Read after Writes is an APM Read (on page-cache it only
/// orders them: docs/fabric.md, "Ordering and durability").
fn dax(dir: &std::path::Path) -> Arc<rpma_common::pmem::Mapping> {
    let m = rpma_common::pmem::OpenOptions::new(dir.join("dax"))
        .size(1 << 20)
        .create(true)
        .force_dax(true)
        .open()
        .unwrap();
    assert_eq!(m.domain(), rpma_common::pmem::Domain::DaxForced);
    Arc::new(m)
}

#[test]
fn the_responder_counts_writes_reads_atomics_and_flushes_per_rkey() {
    for crc in [true, false] {
        let dir = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        let p = Pair::new(crc);
        let pc = page_cache(dir.path());
        let pmr =
            p.pd.register(
                Arc::clone(&pc),
                rw() | Access::REMOTE_ATOMIC | Access::FLUSH_PERSISTENT | Access::FLUSH_VISIBILITY,
            )
            .unwrap();
        let (_plain, plain) = p.target_buf(1 << 20, rw());
        let (imem, imr) = p.init_buf(1 << 20, Access::LOCAL_WRITE);
        imem.write_at(0, &vec![0x5A; 300_000]).unwrap();
        let quiet = SendFlags::empty();
        // A Write to the page-cache region, one of 300,000 bytes (several FPDUs: one
        // message) to the plain one, then an 8-byte Read: on page-cache it only orders the
        // Writes (no msync), so it is no APM Read.
        post_write(&p.qp, 1, Sge::new(&imr, 0, 4096), pmr.remote(0), quiet);
        post_write(&p.qp, 2, Sge::new(&imr, 0, 300_000), plain.remote(0), quiet);
        p.qp.post_send(SendWr::new(
            3,
            SendOp::Read {
                local: Sge::new(&imr, 400_000, 8),
                remote: pmr.remote(0),
            },
        ))
        .unwrap();
        p.expect_init(3, WcStatus::Success);
        // Nothing left to make durable: this Read is no APM Read.
        p.qp.post_send(SendWr::new(
            4,
            SendOp::Read {
                local: Sge::new(&imr, 400_000, 64),
                remote: plain.remote(64),
            },
        ))
        .unwrap();
        p.expect_init(4, WcStatus::Success);
        p.qp.post_send(SendWr::new(
            5,
            SendOp::FetchAdd {
                local: Sge::new(&imr, 400_008, 8),
                remote: pmr.remote(4096),
                add: 1,
            },
        ))
        .unwrap();
        p.expect_init(5, WcStatus::Success);
        post_write(&p.qp, 6, Sge::new(&imr, 0, 512), pmr.remote(8192), quiet);
        p.qp.post_send(SendWr::new(
            7,
            SendOp::Flush {
                target: FlushTarget::Range {
                    remote: pmr.remote(8192),
                    len: 512,
                },
                kind: FlushType::Persistent,
            },
        ))
        .unwrap();
        p.expect_init(7, WcStatus::Success);

        let s = p.tqp.responder_counters().expect("tcp counts").snapshot();
        let got = s.region(pmr.rkey()).copied().expect("the page-cache rkey");
        let want = RegionServed {
            rkey: pmr.rkey(),
            writes: 2,
            write_bytes: 4096 + 512,
            reads: 1,
            read_bytes: 8,
            atomics: 1,
            apm: 0,
            apm_failed: 0,
            flushes: 1,
            flushes_failed: 0,
        };
        assert_eq!(got, want, "crc {crc}");
        let got = s.region(plain.rkey()).copied().expect("the plain rkey");
        assert_eq!(
            (
                got.writes,
                got.write_bytes,
                got.reads,
                got.read_bytes,
                got.apm
            ),
            (1, 300_000, 1, 64, 0),
            "crc {crc}"
        );
        assert_eq!(s.regions.len(), 2);
        // The Flush's named range, and nothing before the Read.
        assert_eq!(s.persist_msync.count(), 1, "{:?}", s.persist_msync);
        assert_eq!(s.persist_writeback.count(), 0);
        // On dax the same Write and Read is an APM Read: a write-back before it.
        let dm = dax(dir.path());
        let dmr = p.pd.register(Arc::clone(&dm), rw()).unwrap();
        post_write(&p.qp, 8, Sge::new(&imr, 0, 512), dmr.remote(0), quiet);
        p.qp.post_send(SendWr::new(
            9,
            SendOp::Read {
                local: Sge::new(&imr, 400_000, 8),
                remote: dmr.remote(0),
            },
        ))
        .unwrap();
        p.expect_init(9, WcStatus::Success);
        let s = p.tqp.responder_counters().expect("tcp counts").snapshot();
        let got = s.region(dmr.rkey()).copied().expect("the dax rkey");
        assert_eq!(
            (got.writes, got.reads, got.apm, got.apm_failed),
            (1, 1, 1, 0),
            "crc {crc}"
        );
        assert_eq!(s.persist_writeback.count(), 1, "{:?}", s.persist_writeback);
        assert_eq!(s.persist_msync.count(), 1, "{:?}", s.persist_msync);
        assert_eq!(s.terminates, [0; 5]);
        // The requester side served nothing.
        let i = p.qp.responder_counters().unwrap().snapshot();
        assert!(i.regions.is_empty(), "{i:?}");
    }
}

#[test]
fn a_refused_access_is_a_terminate_counted_by_cause_and_nothing_else() {
    let p = Pair::new(true);
    let (_tmem, tmr) = p.target_buf(4096, rw());
    let (_imem, imr) = p.init_buf(64, Access::LOCAL_WRITE);
    let counters = p.tqp.responder_counters().unwrap();
    let bad = RemoteAddr {
        addr: tmr.addr(),
        rkey: tmr.rkey() ^ 0x100,
    };
    post_write(&p.qp, 1, Sge::new(&imr, 0, 8), bad, SendFlags::empty());
    p.qp.post_send(SendWr::new(
        2,
        SendOp::Read {
            local: Sge::new(&imr, 8, 8),
            remote: tmr.remote(0),
        },
    ))
    .unwrap();
    p.expect_init(2, WcStatus::RemoteAccess);
    p.assert_both_error();
    let s = counters.snapshot();
    assert_eq!(s.terminates_for(TerminateCause::Access), 1, "{s:?}");
    assert_eq!(s.terminates.iter().sum::<u64>(), 1);
    assert!(
        s.regions.is_empty(),
        "a refused Write is not counted: {s:?}"
    );
    // The handle outlives the queue pair.
    drop(p);
    assert_eq!(counters.terminates()[0], 1);
}

#[test]
fn failed_persists_are_counted_as_failed_durability_and_persist_terminates() {
    use rpma_common::pmem::{Persist, SyncFailure};
    for apm in [false, true] {
        let dir = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        let p = Pair::new(true);
        // APM on dax (forced), where a Read after Writes persists them; a 512-byte Write is
        // copied plainly and recorded dirty (a streamed one would need only a fence). FLUSH on
        // page-cache.
        let (pc, len) = if apm {
            (dax(dir.path()), 512)
        } else {
            (page_cache(dir.path()), 4096)
        };
        let pmr =
            p.pd.register(Arc::clone(&pc), rw() | Access::FLUSH_PERSISTENT)
                .unwrap();
        let (imem, imr) = p.init_buf(4096, Access::LOCAL_WRITE);
        imem.write_at(0, &[7u8; 4096]).unwrap();
        post_write(
            &p.qp,
            1,
            Sge::new(&imr, 0, len),
            pmr.remote(0),
            SendFlags::empty(),
        );
        // The namespace's store fails (as a write-back error would): no persist succeeds.
        pc.record_failure(SyncFailure::new(
            "msync",
            &std::io::Error::from_raw_os_error(5),
        ));
        let op = if apm {
            SendOp::Read {
                local: Sge::new(&imr, 0, 8),
                remote: pmr.remote(0),
            }
        } else {
            SendOp::Flush {
                target: FlushTarget::Range {
                    remote: pmr.remote(0),
                    len: 4096,
                },
                kind: FlushType::Persistent,
            }
        };
        p.qp.post_send(SendWr::new(2, op)).unwrap();
        let c = p.next_init();
        assert_eq!(c.wr_id, 2);
        assert_ne!(c.status, WcStatus::Success, "apm {apm}");
        let s = p.tqp.responder_counters().unwrap().snapshot();
        let r = s.region(pmr.rkey()).copied().unwrap();
        assert_eq!((r.writes, r.write_bytes), (1, len as u64));
        if apm {
            assert_eq!((r.apm, r.apm_failed, r.reads), (0, 1, 0), "{r:?}");
        } else {
            assert_eq!((r.flushes, r.flushes_failed), (0, 1), "{r:?}");
        }
        assert_eq!(s.terminates_for(TerminateCause::Persist), 1, "{s:?}");
    }
}

#[test]
fn messages_received_counts_every_message_the_peer_sent_one_sided_ones_too() {
    let p = Pair::new(true);
    let (_tmem, tmr) = p.target_buf(1 << 16, rw());
    let (imem, imr) = p.init_buf(1 << 16, Access::LOCAL_WRITE);
    imem.write_at(0, &[0x42; 512]).unwrap();
    let before = p.tqp.messages_received().expect("tcp counts");
    let init_before = p.qp.messages_received().expect("tcp counts");
    // A one-sided Write of 512 bytes (one FPDU) and a Read behind it (a Read Request): the
    // Read's completion means the target took both.
    post_write(
        &p.qp,
        1,
        Sge::new(&imr, 0, 512),
        tmr.remote(0),
        SendFlags::empty(),
    );
    p.qp.post_send(SendWr::new(
        2,
        SendOp::Read {
            local: Sge::new(&imr, 4096, 8),
            remote: tmr.remote(0),
        },
    ))
    .unwrap();
    p.expect_init(2, WcStatus::Success);
    let after = p.tqp.messages_received().unwrap();
    assert_eq!(after.wrapping_sub(before), 2, "{before} -> {after}");
    // The initiator took the Read Response.
    let init_after = p.qp.messages_received().unwrap();
    assert_eq!(init_after.wrapping_sub(init_before), 1);
    // Nothing sent, nothing counted.
    assert_eq!(p.tqp.messages_received().unwrap(), after);
}
