//! Two sessions placing into one range from two poll loops, a Read Response sent from that
//! range meanwhile, and the memory's owner copying it out: the concurrency test of the
//! placement paths. `make tsan` runs it under ThreadSanitizer (docs/reliability.md, "Race
//! detection"); it uses only fabric calls that older trees have too, so that
//! `scripts/tsan.sh --at REV` can run this same file against an older receive path.

mod fabric_util;

use std::sync::Arc;

use fabric_util::*;
use rpma_common::fabric::*;

/// Two sessions place into the same target bytes from two poll loops (one with CRC off, whose
/// large payloads are read from the socket straight into place, one with CRC on, staged and
/// copied), one of them also Reads the range back (its Read Response is sent straight from the
/// memory being placed into), while the memory's owner copies it out. Racing bytes may come out
/// as any mix of the two patterns, never anything else, and every session stays up: the
/// contract of `VolatileSlice` (no Rust reference covers registered memory anywhere on these
/// paths, so none of this is undefined behaviour).
#[test]
fn two_sessions_racing_on_one_range_leave_only_their_bytes() {
    const LEN: usize = 256 * 1024;
    const ROUNDS: usize = 50;
    let mem = AlignedBuf::new(LEN).unwrap();
    let done = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    // The reader has CRC off: with CRC on, a Read Response whose source changes between its
    // CRC and its send fails the requester's CRC check (docs/fabric.md), which is not what
    // this test is about. The CRC-on session reads 8 bytes of memory nobody races on.
    let session = |crc: bool, pattern: u8, read_back: bool| {
        let (mem, done) = (Arc::clone(&mem), Arc::clone(&done));
        std::thread::spawn(move || {
            let p = Pair::new(crc);
            let tmr = p.pd.register(Arc::clone(&mem), rw()).unwrap();
            let (_quiet, quiet_mr) = p.target_buf(64, rw());
            let (imem, imr) = p.init_buf(2 * LEN, Access::LOCAL_WRITE);
            imem.write_at(0, &vec![pattern; LEN]).unwrap();
            for _ in 0..ROUNDS {
                let flags = SendFlags::SIGNALED;
                post_write(&p.qp, 1, Sge::new(&imr, 0, LEN), tmr.remote(0), flags);
                if read_back {
                    post_read(&p.qp, 2, Sge::new(&imr, LEN, LEN), tmr.remote(0));
                } else {
                    post_read(&p.qp, 2, Sge::new(&imr, LEN, 8), quiet_mr.remote(0));
                }
                let (before, c) = p.until_init(2);
                assert!(before.iter().all(|c| c.status == WcStatus::Success));
                assert_eq!(c.status, WcStatus::Success, "crc {crc}");
                if read_back {
                    let mut back = vec![0u8; LEN];
                    imem.read_at(LEN, &mut back).unwrap();
                    assert!(back.iter().all(|&b| b == 0xA1 || b == 0xB2));
                }
            }
            done.fetch_add(1, std::sync::atomic::Ordering::Release);
        })
    };
    let a = session(false, 0xA1, true);
    let b = session(true, 0xB2, false);
    let mut seen = vec![0u8; LEN];
    // The owner copies the range out as often as it can, and checks one copy in 64: under
    // `make tsan` the more copies race with the placements, the likelier an access that does
    // not go through VolatileSlice is seen racing (docs/reliability.md, "Race detection").
    let mut copies = 0u64;
    while done.load(std::sync::atomic::Ordering::Acquire) < 2 && !a.is_finished() {
        mem.read_at(0, &mut seen).unwrap();
        if copies.is_multiple_of(64) {
            assert!(seen.iter().all(|&b| matches!(b, 0 | 0xA1 | 0xB2)));
        }
        copies += 1;
    }
    a.join().unwrap();
    b.join().unwrap();
    mem.read_at(0, &mut seen).unwrap();
    assert!(seen.iter().all(|&b| b == 0xA1 || b == 0xB2));
}
