//! The durability half of the RC contract, observed directly: the target's memory records
//! every persist, flush and drain, with a sequence number from a counter the test also reads
//! when it polls the requester's completion. On memory made durable by a cache write-back
//! (dax), every byte written must have been persisted before the completion of the Read, Flush
//! or atomic that followed the Writes is seen. On page-cache memory a Read or atomic response
//! persists nothing (it orders the Writes: no msync in the poll loop), and a Flush persists the
//! range it names.

mod fabric_util;

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use fabric_util::*;
use rpma_common::fabric::*;
use rpma_common::pmem::{self, Domain, Durability, Persist, SyncFailure};

/// One call made on the recording memory's `Persist`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Call {
    Persist { seq: u64, offset: usize, len: usize },
    Flush { seq: u64, offset: usize, len: usize },
    Drain { seq: u64 },
}

/// Registered memory in `domain` that records how it is made durable: by a persist of every
/// placed range (as under the power-loss simulation), or, with `writeback`, by the copy that
/// places the bytes and the fence (`drain`) a response owes after it, as on real dax; with
/// `fail` set, every persist and drain fails as a sync that returned EIO would.
struct Recording {
    domain: Domain,
    writeback: bool,
    buf: Arc<AlignedBuf>,
    seq: Arc<AtomicU64>,
    calls: Mutex<Vec<Call>>,
    fail: AtomicBool,
    /// Every persist fails once this many calls were recorded.
    fail_at: AtomicUsize,
    failure: Mutex<Option<SyncFailure>>,
}

// SAFETY: all of it is the AlignedBuf's memory, which satisfies the contract itself; this
// type adds no references into it.
unsafe impl RegisteredMemory for Recording {
    fn as_mut_ptr(&self) -> *mut u8 {
        self.buf.as_mut_ptr()
    }
    fn len(&self) -> usize {
        self.buf.len()
    }
    fn persist(&self) -> Option<&dyn Persist> {
        Some(self)
    }
}

impl Persist for Recording {
    fn domain(&self) -> Domain {
        self.domain
    }
    fn durable_by_writeback(&self) -> bool {
        self.writeback
    }
    fn persist(&self, offset: usize, len: usize) -> pmem::Result<Durability> {
        if self.fail.load(Ordering::SeqCst)
            || self.calls.lock().unwrap().len() >= self.fail_at.load(Ordering::SeqCst)
        {
            let e = std::io::Error::from_raw_os_error(libc::EIO);
            self.record_failure(SyncFailure::new("msync", &e));
            return Err(pmem::Error::Sync {
                path: "recording".into(),
                op: "msync",
                offset,
                len,
                source: e,
            });
        }
        let seq = self.seq.fetch_add(1, Ordering::SeqCst);
        self.calls
            .lock()
            .unwrap()
            .push(Call::Persist { seq, offset, len });
        Ok(Durability::Durable)
    }
    fn flush(&self, offset: usize, len: usize) -> pmem::Result<()> {
        let seq = self.seq.fetch_add(1, Ordering::SeqCst);
        self.calls
            .lock()
            .unwrap()
            .push(Call::Flush { seq, offset, len });
        Ok(())
    }
    fn drain(&self) -> pmem::Result<Durability> {
        if self.fail.load(Ordering::SeqCst) {
            let e = std::io::Error::from_raw_os_error(libc::EIO);
            self.record_failure(SyncFailure::new("drain", &e));
            return Err(pmem::Error::Failed {
                path: "recording".into(),
                failure: SyncFailure::new("drain", &e),
            });
        }
        let seq = self.seq.fetch_add(1, Ordering::SeqCst);
        self.calls.lock().unwrap().push(Call::Drain { seq });
        Ok(Durability::Durable)
    }
    fn failure(&self) -> Option<SyncFailure> {
        *self.failure.lock().unwrap()
    }
    fn record_failure(&self, failure: SyncFailure) -> bool {
        let mut f = self.failure.lock().unwrap();
        let first = f.is_none();
        f.get_or_insert(failure);
        first
    }
}

const SIZE: usize = 1 << 16;

struct Rig {
    p: Pair,
    mem: Arc<Recording>,
    mr: Arc<MemoryRegion>,
    seq: Arc<AtomicU64>,
    imem: Arc<AlignedBuf>,
    imr: Arc<MemoryRegion>,
}

/// Dax memory (forced): the contract persists every placed byte before a response.
fn rig() -> Rig {
    rig_in(Domain::DaxForced)
}

fn rig_in(domain: Domain) -> Rig {
    rig_with(domain, false)
}

fn rig_with(domain: Domain, writeback: bool) -> Rig {
    rig_sized(domain, writeback, SIZE)
}

fn rig_sized(domain: Domain, writeback: bool, size: usize) -> Rig {
    let p = Pair::new(true);
    let seq = Arc::new(AtomicU64::new(1));
    let mem = Arc::new(Recording {
        domain,
        writeback,
        buf: AlignedBuf::new(size).unwrap(),
        seq: Arc::clone(&seq),
        calls: Mutex::new(Vec::new()),
        fail: AtomicBool::new(false),
        fail_at: AtomicUsize::new(usize::MAX),
        failure: Mutex::new(None),
    });
    let access = Access::LOCAL_WRITE
        | Access::REMOTE_WRITE
        | Access::REMOTE_READ
        | Access::REMOTE_ATOMIC
        | Access::FLUSH_PERSISTENT
        | Access::FLUSH_VISIBILITY;
    let mr = p.pd.register(Arc::clone(&mem), access).unwrap();
    let (imem, imr) = p.init_buf(SIZE, Access::LOCAL_WRITE);
    imem.write_at(0, &vec![0xC3; SIZE]).unwrap();
    Rig {
        p,
        mem,
        mr,
        seq,
        imem,
        imr,
    }
}

impl Rig {
    fn write(&self, wr_id: u64, offset: usize, len: usize) {
        self.p
            .qp
            .post_send(SendWr::new(
                wr_id,
                SendOp::Write {
                    local: Sge::new(&self.imr, 0, len),
                    remote: self.mr.remote(offset as u64),
                },
            ))
            .unwrap();
    }

    /// Waits for the completion of `wr_id` (earlier ones must succeed); returns the sequence
    /// number taken right when it was polled.
    fn complete(&self, wr_id: u64) -> u64 {
        loop {
            let c = self.p.next_init();
            let seen = self.seq.fetch_add(1, Ordering::SeqCst);
            assert_eq!(c.status, WcStatus::Success, "{c:?}");
            if c.wr_id == wr_id {
                return seen;
            }
        }
    }

    /// The bytes of `[offset, offset + len)` not covered by a persist numbered below `before`.
    fn unpersisted(&self, offset: usize, len: usize, before: u64) -> Vec<usize> {
        let calls = self.mem.calls.lock().unwrap().clone();
        let mut covered = vec![false; self.mem.buf.len()];
        for c in calls {
            if let Call::Persist { seq, offset, len } = c {
                if seq < before {
                    covered[offset..offset + len].fill(true);
                }
            }
        }
        (offset..offset + len).filter(|&i| !covered[i]).collect()
    }

    fn calls(&self) -> Vec<Call> {
        self.mem.calls.lock().unwrap().clone()
    }
}

fn assert_persisted(r: &Rig, ranges: &[(usize, usize)], before: u64) {
    for &(off, len) in ranges {
        let missing = r.unpersisted(off, len, before);
        assert!(
            missing.is_empty(),
            "{} bytes of [{off}, +{len}) not persisted before the completion (first {:?}); calls {:?}",
            missing.len(),
            missing.first(),
            r.calls()
        );
    }
}

#[test]
fn writes_then_an_8_byte_read_persist_every_written_byte_before_the_read_completes() {
    let r = rig();
    // Several FPDUs, a second range, and one that does not start on a cache line.
    r.write(1, 0, 40_000);
    r.write(2, 50_001, 777);
    r.p.qp
        .post_send(SendWr::new(
            3,
            SendOp::Read {
                local: Sge::new(&r.imr, 0, 8),
                remote: r.mr.remote(0),
            },
        ))
        .unwrap();
    let seen = r.complete(3);
    assert_persisted(&r, &[(0, 40_000), (50_001, 777)], seen);
    assert_eq!(r.imem.read_u64(0).unwrap(), 0xC3C3_C3C3_C3C3_C3C3);
}

#[test]
fn a_write_then_a_flush_persists_the_write_before_the_flush_completes() {
    for (kind, target) in [
        (FlushType::Persistent, None),
        (FlushType::Visibility, None),
        (FlushType::Persistent, Some(())),
    ] {
        let r = rig();
        r.write(1, 4096, 10_000);
        let target = match target {
            None => FlushTarget::Range {
                remote: r.mr.remote(4096),
                len: 8,
            },
            Some(()) => FlushTarget::Region { rkey: r.mr.rkey() },
        };
        r.p.qp
            .post_send(SendWr::new(2, SendOp::Flush { target, kind }))
            .unwrap();
        let seen = r.complete(2);
        assert_persisted(&r, &[(4096, 10_000)], seen);
    }
}

#[test]
fn a_write_then_an_atomic_persists_both_before_the_atomic_completes() {
    let r = rig();
    r.write(1, 100, 3000);
    r.p.qp
        .post_send(SendWr::new(
            2,
            SendOp::FetchAdd {
                local: Sge::new(&r.imr, 0, 8),
                remote: r.mr.remote(8192),
                add: 5,
            },
        ))
        .unwrap();
    let seen = r.complete(2);
    assert_persisted(&r, &[(100, 3000), (8192, 8)], seen);
    r.write(3, 200, 64);
    r.p.qp
        .post_send(SendWr::new(
            4,
            SendOp::AtomicWrite {
                remote: r.mr.remote(16384),
                value: 9,
            },
        ))
        .unwrap();
    let seen = r.complete(4);
    assert_persisted(&r, &[(200, 64), (16384, 8)], seen);
}

#[test]
fn on_page_cache_a_read_or_atomic_only_orders_the_writes_and_a_flush_persists_its_range() {
    let r = rig_in(Domain::PageCache);
    r.write(1, 0, 40_000);
    r.p.qp
        .post_send(SendWr::new(
            2,
            SendOp::Read {
                local: Sge::new(&r.imr, 0, 8),
                remote: r.mr.remote(0),
            },
        ))
        .unwrap();
    r.complete(2);
    // Placed (the Read sees it), not persisted.
    assert_eq!(r.imem.read_u64(0).unwrap(), 0xC3C3_C3C3_C3C3_C3C3);
    r.p.qp
        .post_send(SendWr::new(
            3,
            SendOp::FetchAdd {
                local: Sge::new(&r.imr, 0, 8),
                remote: r.mr.remote(8192),
                add: 5,
            },
        ))
        .unwrap();
    r.complete(3);
    assert_eq!(
        r.calls(),
        vec![],
        "no persist before a Read or atomic response"
    );
    // A Flush persists the range it names, and only that.
    r.p.qp
        .post_send(SendWr::new(
            4,
            SendOp::Flush {
                target: FlushTarget::Range {
                    remote: r.mr.remote(4096),
                    len: 100,
                },
                kind: FlushType::Persistent,
            },
        ))
        .unwrap();
    let seen = r.complete(4);
    assert_persisted(&r, &[(4096, 100)], seen);
    assert_eq!(r.unpersisted(0, 4096, seen).len(), 4096, "{:?}", r.calls());
}

#[test]
fn a_read_without_earlier_writes_persists_nothing() {
    let r = rig();
    for i in 0..3 {
        r.p.qp
            .post_send(SendWr::new(
                i,
                SendOp::Read {
                    local: Sge::new(&r.imr, 0, 4096),
                    remote: r.mr.remote(0),
                },
            ))
            .unwrap();
        r.complete(i);
    }
    assert_eq!(r.calls(), vec![], "nothing was written: nothing to persist");
}

#[test]
fn a_failed_persist_fails_the_response_and_the_queue_pairs_error_keeps_the_errno() {
    // APM (Write + Read) and FLUSH (Write + Flush): neither answer may leave when the persist
    // before it failed, and the target's queue pair says why, errno included.
    for flush in [false, true] {
        let r = rig();
        r.mem.fail.store(true, Ordering::SeqCst);
        r.write(1, 0, 4096);
        let op = if flush {
            SendOp::Flush {
                target: FlushTarget::Range {
                    remote: r.mr.remote(0),
                    len: 4096,
                },
                kind: FlushType::Persistent,
            }
        } else {
            SendOp::Read {
                local: Sge::new(&r.imr, 0, 8),
                remote: r.mr.remote(0),
            }
        };
        r.p.qp.post_send(SendWr::new(2, op)).unwrap();
        let (_, c) = r.p.until_init(2);
        assert_ne!(c.status, WcStatus::Success, "flush {flush}: {c:?}");
        r.p.assert_both_error();
        let failure = r.p.tqp.error();
        assert!(
            matches!(failure, Some(QpFailure::PersistFailed { .. })),
            "flush {flush}: {failure:?}"
        );
        let why = failure
            .map(|e| rpma_common::error_chain(&e))
            .unwrap_or_default();
        assert!(
            why.contains("durable failed") && why.contains("Input/output error"),
            "flush {flush}: {why}"
        );
        assert_eq!(
            r.mem.failure().map(|f| f.errno),
            Some(libc::EIO),
            "the store remembers"
        );
        assert!(r.calls().iter().all(|c| !matches!(c, Call::Persist { .. })));
    }
}

/// A Persistent Flush of an empty range writes nothing back, but it is still a durability
/// answer: on a store that has failed it must not succeed (it did, as no persist was called).
#[test]
fn a_persistent_flush_of_nothing_on_a_failed_store_fails() {
    let r = rig();
    r.mem.fail.store(true, Ordering::SeqCst);
    let eio = std::io::Error::from_raw_os_error(libc::EIO);
    r.mem.record_failure(SyncFailure::new("fdatasync", &eio));
    r.p.qp
        .post_send(SendWr::new(
            1,
            SendOp::Flush {
                target: FlushTarget::Range {
                    remote: r.mr.remote(4096),
                    len: 0,
                },
                kind: FlushType::Persistent,
            },
        ))
        .unwrap();
    let (_, c) = r.p.until_init(1);
    assert_ne!(c.status, WcStatus::Success, "{c:?}");
    r.p.assert_both_error();
    let failure = r.p.tqp.error();
    assert!(
        matches!(failure, Some(QpFailure::PersistFailed { .. })),
        "{failure:?}"
    );
}

/// On dax, a Persistent Flush of a whole large region is written back a step of at most 1 MiB
/// per receive pass (each pass lets the loop's other queue pairs in), all of it before its
/// answer, and nothing after it (a Read) is taken before its last step. (In one go, a region
/// of a GiB held the loop for a tenth of a second.) A step that fails fails the Flush.
#[test]
fn a_large_flush_is_made_durable_in_steps_all_before_its_answer() {
    const BIG: usize = 5 << 20;
    for fail in [false, true] {
        let r = rig_sized(Domain::DaxForced, false, BIG + 4096);
        if fail {
            // The Write's persist and the Flush's first two steps succeed, the third fails.
            r.mem.fail_at.store(3, Ordering::SeqCst);
        }
        r.write(1, BIG, 4096);
        r.p.qp
            .post_send(SendWr::new(
                2,
                SendOp::Flush {
                    target: FlushTarget::Region { rkey: r.mr.rkey() },
                    kind: FlushType::Persistent,
                },
            ))
            .unwrap();
        r.p.qp
            .post_send(SendWr::new(
                3,
                SendOp::Read {
                    local: Sge::new(&r.imr, 0, 8),
                    remote: r.mr.remote(0),
                },
            ))
            .unwrap();
        if fail {
            let (_, c) = r.p.until_init(2);
            assert_ne!(c.status, WcStatus::Success, "{c:?}");
            r.p.assert_both_error();
            assert_eq!(r.calls().len(), 3, "{:?}", r.calls());
            continue;
        }
        // Driven pass by pass: while the steps go on, nothing after the Flush (the Read
        // Request) is taken from the peer.
        let persists = || {
            r.calls()
                .iter()
                .filter(|c| matches!(c, Call::Persist { .. }))
                .count()
        };
        let taken = || r.p.tqp.messages_received().unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while persists() < 2 {
            assert!(std::time::Instant::now() < deadline, "{:?}", r.calls());
            r.p.pump();
        }
        let at_first_step = taken();
        // The sixth step answers the Flush, and its pass goes on to the Read.
        while persists() < 6 {
            assert!(std::time::Instant::now() < deadline, "{:?}", r.calls());
            r.p.pump();
            assert_eq!(
                taken(),
                at_first_step,
                "an FPDU taken amid the Flush's steps"
            );
        }
        let seen = r.complete(2);
        assert_persisted(&r, &[(0, BIG + 4096)], seen);
        let steps: Vec<usize> = r
            .calls()
            .iter()
            .filter_map(|c| match c {
                Call::Persist { len, .. } => Some(*len),
                _ => None,
            })
            .collect();
        assert!(steps.len() >= 6, "{steps:?}");
        assert!(steps.iter().all(|&l| l <= 1 << 20), "{steps:?}");
        r.complete(3);
        assert_eq!(
            taken(),
            at_first_step + 1,
            "the Read was taken with the Flush"
        );
    }
}

/// Real dax: large Writes are placed with stores that write the cache lines back as they go,
/// which makes them durable once a store fence ran; the Read (APM), Flush or atomic after them
/// owes that fence, and is answered only after it (`drain`), and not at all when it fails (a
/// namespace failed meanwhile). The other tests' memory records a persist of every placed range
/// instead, as the power-loss simulation does: without this one, a placement that left the
/// fence out, or a response that did not wait for it, passed every end-to-end test.
#[test]
fn on_dax_a_response_after_writes_placed_by_writeback_waits_for_the_fence() {
    for op in ["read", "flush", "atomic"] {
        let r = rig_with(Domain::DaxForced, true);
        r.write(1, 0, 40_000);
        let before = r.seq.load(Ordering::SeqCst);
        r.p.qp
            .post_send(SendWr::new(2, response_op(&r, op)))
            .unwrap();
        let seen = r.complete(2);
        let fenced = r
            .calls()
            .iter()
            .any(|c| matches!(c, Call::Drain { seq } if (before..seen).contains(seq)));
        assert!(
            fenced,
            "{op}: no fence before the answer; calls {:?}",
            r.calls()
        );
    }
    for op in ["read", "flush", "atomic"] {
        let r = rig_with(Domain::DaxForced, true);
        r.mem.fail.store(true, Ordering::SeqCst);
        r.write(1, 0, 40_000);
        r.p.qp
            .post_send(SendWr::new(2, response_op(&r, op)))
            .unwrap();
        let (_, c) = r.p.until_init(2);
        assert_ne!(
            c.status,
            WcStatus::Success,
            "{op}: answered over a failed fence: {c:?}"
        );
    }
}

/// The request that owes the Writes before it their durability: an 8-byte Read, a Flush of
/// their range, or a fetch-and-add.
fn response_op(r: &Rig, op: &str) -> SendOp {
    match op {
        "read" => SendOp::Read {
            local: Sge::new(&r.imr, 0, 8),
            remote: r.mr.remote(0),
        },
        "flush" => SendOp::Flush {
            target: FlushTarget::Range {
                remote: r.mr.remote(0),
                len: 40_000,
            },
            kind: FlushType::Persistent,
        },
        _ => SendOp::FetchAdd {
            local: Sge::new(&r.imr, 0, 8),
            remote: r.mr.remote(60_000),
            add: 1,
        },
    }
}
