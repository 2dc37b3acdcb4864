//! The heirs' bookkeeping, against [`Member`]s of one [`ReplayOrder`].

use std::sync::Arc;

use super::*;

/// An order with two queues in it: A and B.
fn two() -> (Arc<ReplayOrder>, Member, Member) {
    let o = Arc::new(ReplayOrder::default());
    let mut a = Member::new(Arc::clone(&o), vec![1]);
    let b = Member::new(Arc::clone(&o), vec![1]);
    assert!(a.keep_order(Vec::new));
    (o, a, b)
}

/// [`two`], A's write of `len` bytes at 0 rewritten whole by B's, and A re-issued after a
/// reconnect: A is B's heir for them.
fn heir_of_b(len: usize) -> (Arc<ReplayOrder>, Member, Member) {
    let (o, mut a, mut b) = two();
    a.register(0, 0, len, 1);
    b.register(0, 0, len, 1);
    reissue(&mut a, 0, len);
    (o, a, b)
}

/// A re-issues its write (ns 0, `offset`, `len`, seq 1) after a reconnect.
fn reissue(a: &mut Member, offset: u64, len: usize) {
    a.reissuing();
    a.hand_over(0, offset, len, 1);
    a.reissued();
}

#[test]
fn bytes_let_go_to_a_held_write_are_owed_once_it_is_placed_since_the_reconnect() {
    let (o, mut a, mut b) = two();
    a.register(0, 0, 8192, 1);
    b.register(0, 4096, 4096, 1);
    let before = o.now();
    reissue(&mut a, 0, 8192);
    assert_eq!(a.handed(0), Handed::Unplaced(vec![b.id()]));
    // Told by a request sent before A reconnected: a target restarted since kept nothing.
    b.placed_fresh(1, before);
    assert_eq!(a.handed(0), Handed::Unplaced(vec![b.id()]));
    b.placed_fresh(1, o.now());
    assert_eq!(a.handed(0), Handed::Persist(vec![(4096, 8192)]));
    // A newer write of B there does not put it off again: the bytes of the placed one are
    // vouched for (any write newer than A's will do); one of A's own is A's anyway.
    b.register(0, 6144, 2048, 2);
    assert_eq!(a.handed(0), Handed::Persist(vec![(4096, 8192)]));
    a.register(0, 6144, 2048, 2);
    assert_eq!(a.handed(0), Handed::Persist(vec![(4096, 6144)]));
    // B reconnected: what it re-issues is on its way again.
    b.unplace(2);
    assert_eq!(a.handed(0), Handed::Unplaced(vec![b.id()]));
    b.placed_fresh(2, o.now());
    // A's own bytes are A's persist's anyway.
    assert_eq!(a.handed(0), Handed::Persist(vec![(4096, 6144)]));
    // Made durable: nothing owed, and nothing kept.
    a.settle_handed(0);
    assert_eq!(a.handed(0), Handed::Persist(Vec::new()));
    assert_eq!(o.heirs.load(Ordering::SeqCst), 0);
    assert!(o.lock().heirs.is_empty());
}

#[test]
fn a_client_rewriting_the_bytes_after_each_placement_does_not_keep_the_heir_waiting() {
    // The NBD export's FLUSH has the queues named place their writes and asks again, for
    // a few rounds: B's client rewrote the bytes after each placement, so every round
    // named B again, and the FLUSH answered EIO.
    let (o, mut a, mut b) = heir_of_b(4096);
    assert_eq!(a.handed(0), Handed::Unplaced(vec![b.id()]));
    for seq in 1..=8 {
        b.placed_fresh(seq, o.now());
        // As a rewrite is posted: the new write registered, then the one it supersedes
        // released.
        b.register(0, 0, 4096, seq + 1);
        b.release(0, 0, 4096, seq);
        assert_eq!(a.handed(0), Handed::Persist(vec![(0, 4096)]), "round {seq}");
    }
    // A reconnects again: what was placed before vouches for nothing now.
    a.reissuing();
    assert_eq!(a.handed(0), Handed::Unplaced(vec![b.id()]));
    b.placed_fresh(9, o.now());
    assert_eq!(a.handed(0), Handed::Persist(vec![(0, 4096)]));
    a.settle_handed(0);
    assert_eq!(a.handed(0), Handed::Persist(Vec::new()));
    assert_eq!(o.heirs.load(Ordering::SeqCst), 0);
}

#[test]
fn bytes_the_heirs_own_write_held_need_nothing_when_a_third_queue_takes_them() {
    let (o, mut a, mut b) = two();
    let mut c = Member::new(Arc::clone(&o), vec![1]);
    a.register(0, 0, 4096, 1);
    b.register(0, 0, 4096, 1);
    reissue(&mut a, 0, 4096);
    // A writes the bytes again (held: its own persist covers the write's whole range),
    // then C takes them: A owes nothing for them.
    a.register(0, 0, 4096, 2);
    c.register(0, 0, 4096, 1);
    assert_eq!(a.handed(0), Handed::Persist(Vec::new()));
    // A reconnects again and lets its second write go to C's: owed until C's is placed.
    a.reissuing();
    a.hand_over(0, 0, 4096, 2);
    a.reissued();
    assert_eq!(a.handed(0), Handed::Unplaced(vec![c.id()]));
    c.placed_fresh(1, o.now());
    assert_eq!(a.handed(0), Handed::Persist(vec![(0, 4096)]));
}

#[test]
fn what_a_write_takes_from_an_heir_is_found_among_many_spans_and_namespaces() {
    let o = Arc::new(ReplayOrder::default());
    let mut a = Member::new(Arc::clone(&o), vec![1, 2]);
    let mut b = Member::new(Arc::clone(&o), vec![1, 2]);
    assert!(a.keep_order(Vec::new));
    // A's writes, every other 4 KiB of 1 MiB of both namespaces, each rewritten by B.
    let mut seq = 0;
    for ns in 0..2 {
        for i in (0..256u64).step_by(2) {
            seq += 1;
            a.register(ns, i * 4096, 4096, seq);
            b.register(ns, i * 4096, 4096, seq);
        }
    }
    a.reissuing();
    let mut seq = 0;
    for ns in 0..2 {
        for i in (0..256u64).step_by(2) {
            seq += 1;
            a.hand_over(ns, i * 4096, 4096, seq);
        }
    }
    a.reissued();
    b.placed_fresh(seq, o.now());
    // B writes namespace 2's blocks again, and a run across namespace 1's gaps.
    for i in (0..256u64).step_by(2) {
        seq += 1;
        b.register(1, i * 4096, 4096, seq);
    }
    seq += 1;
    b.register(0, 8192, 3 * 4096, seq);
    let every_other = |from: u64| -> Vec<(u64, u64)> {
        (from..256)
            .step_by(2)
            .map(|i| (i * 4096, i * 4096 + 4096))
            .collect()
    };
    assert_eq!(a.handed(0), Handed::Persist(every_other(0)));
    assert_eq!(a.handed(1), Handed::Persist(every_other(0)));
    // Namespace 2's bytes are vouched for; namespace 1's run (8 KiB-20 KiB) too, and its
    // gap (12-16 KiB) was never owed.
    let inner = o.lock();
    let h = &inner.heirs[&a.id()];
    assert_eq!(h.vouched.iter().filter(|v| v.0 == 2).count(), 128);
    assert_eq!(
        merged(&h.vouched_spans(), 1),
        [(8192, 12288), (16384, 20480)]
    );
}

#[test]
fn vouched_bytes_are_owed_again_when_the_vouching_queue_reconnects() {
    let (o, a, mut b) = heir_of_b(4096);
    b.placed_fresh(1, o.now());
    b.register(0, 0, 4096, 2);
    assert_eq!(a.handed(0), Handed::Persist(vec![(0, 4096)]));
    b.unplace(2);
    assert_eq!(a.handed(0), Handed::Unplaced(vec![b.id()]));
}

#[test]
fn vouched_bytes_whose_newer_write_is_let_go_unpersisted_are_lost() {
    let (o, mut a, mut b) = heir_of_b(4096);
    b.placed_fresh(1, o.now());
    b.register(0, 0, 4096, 2);
    b.lose(0, 0, 4096, 2);
    b.release(0, 0, 4096, 2);
    assert_eq!(a.handed(0), Handed::Lost(vec![(0, 4096)]));
    a.lost_reported(0);
    assert_eq!(a.handed(0), Handed::Persist(Vec::new()));
}

/// Bytes whose newer write was made durable and released need nothing when a client
/// writes them again, each time: a writer that makes its block durable before rewriting
/// it (FUA, a flush between rewrites: a journal) does not keep the heir waiting for the
/// placement of each new write.
#[test]
fn bytes_whose_newer_write_was_made_durable_need_nothing_when_written_again() {
    let (o, mut a, mut b) = heir_of_b(8192);
    b.placed_fresh(1, o.now());
    b.release(0, 0, 8192, 1);
    for seq in 2..=9 {
        b.register(0, 0, 4096, seq);
        assert_eq!(a.handed(0), Handed::Persist(Vec::new()), "write {seq}");
        b.release(0, 0, 4096, seq);
    }
    a.settle_handed(0);
    assert_eq!(o.heirs.load(Ordering::SeqCst), 0);
}

/// Vouched bytes whose writes were made durable and released since need nothing more:
/// a method that cannot name a range (APM) is not asked for them. (They were named for
/// ever: a forced APM failed every persist until a reconnect.)
#[test]
fn vouched_bytes_no_write_holds_any_more_need_nothing() {
    let (o, mut a, mut b) = two();
    let mut c = Member::new(Arc::clone(&o), vec![1]);
    a.register(0, 0, 4096, 1);
    b.register(0, 0, 4096, 1);
    reissue(&mut a, 0, 4096);
    b.placed_fresh(1, o.now());
    c.register(0, 0, 4096, 1);
    assert_eq!(a.handed(0), Handed::Persist(vec![(0, 4096)]));
    b.release(0, 0, 4096, 1);
    c.release(0, 0, 4096, 1);
    assert_eq!(a.handed(0), Handed::Persist(Vec::new()));
}

#[test]
fn bytes_whose_newer_write_is_let_go_unpersisted_are_reported_lost_once() {
    let (_o, mut a, mut b) = two();
    a.register(0, 0, 12288, 1);
    b.register(0, 0, 4096, 1);
    b.register(0, 8192, 4096, 2);
    reissue(&mut a, 0, 12288);
    // B goes with both writes: one was made durable before, the other is lost.
    b.release(0, 8192, 4096, 2);
    b.lose(0, 0, 4096, 1);
    b.release(0, 0, 4096, 1);
    assert_eq!(a.handed(0), Handed::Lost(vec![(0, 4096)]));
    a.lost_reported(0);
    assert_eq!(a.handed(0), Handed::Persist(Vec::new()));
}

#[test]
fn bytes_let_go_between_a_loss_and_its_release_are_lost() {
    let (_o, mut a, mut b) = two();
    a.register(0, 0, 4096, 1);
    b.register(0, 0, 4096, 1);
    // B's queue lets its write go unpersisted, and releases it only after a visibility
    // Read (or in a loop of its own): A's re-issue lets its write go in between.
    b.lose(0, 0, 4096, 1);
    reissue(&mut a, 0, 4096);
    b.release(0, 0, 4096, 1);
    assert_eq!(a.handed(0), Handed::Lost(vec![(0, 4096)]));
    a.lost_reported(0);
    assert_eq!(a.handed(0), Handed::Persist(Vec::new()));
}

#[test]
fn bytes_a_write_let_go_unpersisted_had_taken_before_the_reconnect_are_lost() {
    let (o, mut a, mut b) = two();
    a.register(0, 0, 4096, 1);
    b.register(0, 0, 4096, 1);
    b.lose(0, 0, 4096, 1);
    b.release(0, 0, 4096, 1);
    reissue(&mut a, 0, 4096);
    assert_eq!(a.handed(0), Handed::Lost(vec![(0, 4096)]));
    a.lost_reported(0);
    // Made durable before: nothing owed. And a loss before A last held nothing is of
    // older bytes than any A holds now.
    a.release(0, 0, 4096, 1);
    a.emptied();
    a.register(0, 0, 4096, 1);
    b.register(0, 0, 4096, 2);
    b.release(0, 0, 4096, 2);
    reissue(&mut a, 0, 4096);
    assert_eq!(a.handed(0), Handed::Persist(Vec::new()));
    assert_eq!(o.heirs.load(Ordering::SeqCst), 0);
}

#[test]
fn bytes_a_newer_write_of_the_same_queue_took_are_not_handed_over() {
    let (o, mut a, _b) = two();
    a.register(0, 0, 8192, 1);
    a.register(0, 4096, 4096, 2);
    reissue(&mut a, 0, 8192);
    assert_eq!(o.heirs.load(Ordering::SeqCst), 0);
    assert_eq!(a.handed(0), Handed::Persist(Vec::new()));
}

#[test]
fn a_queue_that_goes_takes_what_it_owed_and_its_placement_with_it() {
    let (o, a, mut b) = heir_of_b(4096);
    b.placed_fresh(1, o.now());
    assert_eq!(o.lock().fresh.len(), 1);
    drop(a);
    drop(b);
    assert_eq!(o.heirs.load(Ordering::SeqCst), 0);
    assert!(o.lock().heirs.is_empty() && o.lock().fresh.is_empty());
}

#[test]
fn ranges_without_a_cut_keep_what_is_outside_it() {
    assert_eq!(without(&[(0, 100)], &[]), [(0, 100)]);
    assert_eq!(without(&[(0, 100)], &[(0, 100)]), []);
    assert_eq!(
        without(&[(0, 100), (200, 300)], &[(50, 60), (90, 250)]),
        [(0, 50), (60, 90), (250, 300)]
    );
    assert_eq!(merged(&vec![(1, 5, 9), (2, 0, 4), (1, 0, 5)], 1), [(0, 9)]);
}
