use super::*;

const A: u64 = 0;
const B: u64 = 1;

/// A seeded generator of numbers below its argument.
fn xorshift(mut x: u64) -> impl FnMut(u64) -> u64 {
    move |n| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % n
    }
}

fn w(queue: u64, seq: u64) -> Writer {
    Writer { queue, seq }
}

#[test]
fn a_newer_write_of_another_queue_takes_the_bytes_it_covers() {
    let o = ReplayOrder::default();
    o.register(1, 0, 8192, w(A, 1));
    o.register(1, 4096, 8192, w(B, 1));
    assert_eq!(o.owned(1, 0, 8192, w(A, 1)), [(0, 4096)]);
    assert_eq!(o.owned(1, 4096, 8192, w(B, 1)), [(4096, 8192)]);
    // Once B's write is durable and released, A still does not get the bytes back.
    o.release(1, 4096, 8192, w(B, 1));
    assert_eq!(o.owned(1, 0, 8192, w(A, 1)), [(0, 4096)]);
    o.release(1, 0, 8192, w(A, 1));
    assert_eq!(o.len(), 0);
}

#[test]
fn a_write_inside_an_older_one_splits_it() {
    let o = ReplayOrder::default();
    o.register(1, 0, 12288, w(A, 1));
    o.register(1, 4096, 8192, w(B, 7));
    assert_eq!(o.owned(1, 0, 12288, w(A, 1)), [(0, 4096), (8192, 12288)]);
    assert_eq!(o.len(), 3);
    // A newer write of A over all of it leaves nothing to the older ones.
    o.register(1, 0, 12288, w(A, 2));
    assert!(o.owned(1, 0, 12288, w(A, 1)).is_empty());
    assert!(o.owned(1, 4096, 8192, w(B, 7)).is_empty());
    assert_eq!(o.owned(1, 0, 12288, w(A, 2)), [(0, 12288)]);
    assert_eq!(o.len(), 1);
}

#[test]
fn namespaces_and_untouched_neighbours_are_apart() {
    let o = ReplayOrder::default();
    o.register(1, 0, 4096, w(A, 1));
    o.register(2, 0, 4096, w(B, 1));
    o.register(1, 4096, 8192, w(B, 2));
    assert_eq!(o.owned(1, 0, 4096, w(A, 1)), [(0, 4096)]);
    assert_eq!(o.owned(2, 0, 4096, w(B, 1)), [(0, 4096)]);
    // Releasing a write that owns nothing any more leaves the others alone.
    o.register(1, 0, 4096, w(B, 3));
    o.release(1, 0, 4096, w(A, 1));
    assert_eq!(o.owned(1, 0, 4096, w(B, 3)), [(0, 4096)]);
    assert_eq!(o.len(), 3);
}

#[test]
fn empty_writes_and_unknown_namespaces_change_nothing() {
    let o = Arc::new(ReplayOrder::default());
    o.register(1, 4096, 4096, w(A, 1));
    assert_eq!(o.len(), 0);
    let mut m = Member::new(Arc::clone(&o), vec![1]);
    m.register(5, 0, 4096, 1);
    assert_eq!(o.len(), 0);
    // A namespace the member does not know is replayed whole (nothing to compare with).
    assert_eq!(m.owned(5, 0, 4096, 1), [(0, 4096)]);
}

/// Random registers and releases against a model that keeps the owner of every byte.
#[test]
fn the_map_agrees_with_a_byte_by_byte_model() {
    let o = ReplayOrder::default();
    let mut model: Vec<Option<Writer>> = vec![None; 64];
    let mut live: Vec<(u64, u64, Writer)> = Vec::new();
    let mut next = xorshift(0x2545_f491_4f6c_dd1d);
    for seq in 1..1500 {
        if live.is_empty() || next(3) > 0 {
            let start = next(60);
            let end = start + 1 + next(64 - start);
            let owner = w(next(3), seq);
            o.register(1, start, end, owner);
            model[start as usize..end as usize].fill(Some(owner));
            live.push((start, end, owner));
        } else {
            let (start, end, owner) = live.swap_remove(next(live.len() as u64) as usize);
            o.release(1, start, end, owner);
            for b in &mut model[start as usize..end as usize] {
                if *b == Some(owner) {
                    *b = None;
                }
            }
        }
        for &(start, end, owner) in &live {
            let want: Vec<u64> = (start..end)
                .filter(|&b| model[b as usize] == Some(owner))
                .collect();
            let got: Vec<u64> = o
                .owned(1, start, end, owner)
                .into_iter()
                .flat_map(|(s, e)| s..e)
                .collect();
            assert_eq!(got, want, "{owner:?} at step {seq}");
        }
    }
}

#[test]
fn a_lone_queue_stays_out_and_enters_under_what_came_after() {
    let o = Arc::new(ReplayOrder::default());
    let mut a = Member::new(Arc::clone(&o), vec![1]);
    // A holds two writes, the newer inside the older.
    let held = || vec![(0, 0, 20480, 1), (0, 4096, 4096, 2)];
    assert!(!a.keep_order(held), "alone: out of the map");
    let mut b = Member::new(Arc::clone(&o), vec![1]);
    assert!(b.entered(), "a second queue enters as it joins");
    // B writes twice over A's older write; one of them is done with before A enters: it
    // stays as a tombstone.
    b.register(0, 8192, 4096, 1);
    b.register(0, 16384, 2048, 2);
    b.release(0, 16384, 2048, 2);
    assert_eq!(o.len(), 2);
    assert!(a.keep_order(held));
    assert_eq!(a.owned(0, 4096, 4096, 2), [(4096, 8192)]);
    assert_eq!(
        a.owned(0, 0, 20480, 1),
        [(0, 4096), (12288, 16384), (18432, 20480)]
    );
    // No queue is out any more: the tombstone went.
    assert_eq!(o.len(), 5);
    b.release(0, 8192, 4096, 1);
    assert_eq!(o.len(), 4, "released for good, no tombstone");
    // Once in, always in, even alone again.
    drop(b);
    assert!(a.keep_order(|| unreachable!("entered once")));
}

#[test]
fn tombstones_go_when_the_last_queue_kept_out_goes() {
    let o = Arc::new(ReplayOrder::default());
    let a = Member::new(Arc::clone(&o), vec![1]);
    let mut b = Member::new(Arc::clone(&o), vec![1]);
    b.register(0, 0, 4096, 1);
    b.release(0, 0, 4096, 1);
    assert_eq!(o.len(), 1, "a tombstone while A is out");
    drop(a);
    assert_eq!(o.len(), 0);
    // With no one out, a release leaves nothing.
    b.register(0, 0, 4096, 2);
    b.release(0, 0, 4096, 2);
    assert_eq!(o.len(), 0);
}

#[test]
fn writes_are_unplaced_until_their_queue_placed_them() {
    let o = Arc::new(ReplayOrder::default());
    let mut a = Member::new(Arc::clone(&o), vec![1]);
    let mut b = Member::new(Arc::clone(&o), vec![1]);
    assert!(a.keep_order(Vec::new));
    assert!(!a.unplaced(), "nothing written: no probe to send");
    a.register(0, 0, 8192, 1);
    assert!(a.unplaced());
    assert_eq!(b.unplaced_writers(0, 4096, 4096), [a.id()], "inside");
    assert_eq!(b.unplaced_writers(0, 8000, 1000), [a.id()], "reaching in");
    assert_eq!(a.unplaced_writers(0, 0, 8192), [a.id()], "for any queue");
    assert!(b.unplaced_writers(0, 8192, 4096).is_empty(), "next to it");
    assert!(
        b.unplaced_writers(1, 0, 8192).is_empty(),
        "an unknown index"
    );
    // Placed through seq 1: gone; a newer write of A is not.
    a.placed_through(1);
    assert!(b.unplaced_writers(0, 0, 8192).is_empty());
    a.register(0, 4096, 4096, 2);
    assert_eq!(b.unplaced_writers(0, 0, 8192), [a.id()]);
    a.placed_through(2);
    a.placed_through(1);
    assert!(b.unplaced_writers(0, 0, 8192).is_empty(), "never goes back");
    assert!(!a.unplaced());
    // A reconnected: nothing of it is known placed.
    a.unplace(2);
    assert_eq!(b.unplaced_writers(0, 0, 4096), [a.id()]);
    // Both: each named once, sorted.
    b.register(0, 2048, 4096, 1);
    let mut both = vec![a.id(), b.id()];
    both.sort_unstable();
    assert_eq!(a.unplaced_writers(0, 0, 8192), both);
    // B's newer write over all of it takes the bytes: they are B's alone now.
    b.register(0, 0, 8192, 2);
    assert_eq!(a.unplaced_writers(0, 0, 8192), [b.id()]);
    // Released (durable) writes leave nothing unplaced, and nothing as tombstones here.
    b.release(0, 0, 8192, 2);
    b.release(0, 2048, 4096, 1);
    assert!(a.unplaced_writers(0, 0, 8192).is_empty());
    // A queue that goes takes its mark with it.
    b.placed_through(5);
    let id = b.id();
    drop(b);
    assert!(!o.lock().placed.contains_key(&id));
}

#[test]
fn an_ask_to_learn_placement_is_taken_once_by_the_queue_asked() {
    let o = Arc::new(ReplayOrder::default());
    let a = Member::new(Arc::clone(&o), vec![1]);
    let b = Member::new(Arc::clone(&o), vec![1]);
    let c = Member::new(Arc::clone(&o), vec![1]);
    assert!(!a.take_want() && !b.take_want(), "no one asked");
    // Asked twice before it looks: one probe answers both.
    b.want_placed(&[a.id(), c.id()]);
    b.want_placed(&[a.id()]);
    assert_eq!(o.wanting.load(Ordering::SeqCst), 2);
    assert!(!b.take_want(), "only the queues named");
    assert!(a.take_want());
    assert!(!a.take_want(), "taken");
    // A queue that goes takes its ask with it: no one looks under the lock for it.
    drop(c);
    assert_eq!(o.wanting.load(Ordering::SeqCst), 0);
    assert!(o.lock().wanted.is_empty());
    // Nor is a queue that went asked (the caller looked before it went).
    let gone = {
        let d = Member::new(Arc::clone(&o), vec![1]);
        d.id()
    };
    b.want_placed(&[gone]);
    assert_eq!(o.wanting.load(Ordering::SeqCst), 0);
}

#[test]
fn a_queue_kept_out_of_the_map_is_named_for_any_bytes_until_it_enters() {
    let o = Arc::new(ReplayOrder::default());
    let mut a = Member::new(Arc::clone(&o), vec![1]);
    assert!(!a.keep_order(Vec::new), "alone");
    let b = Member::new(Arc::clone(&o), vec![1]);
    // A may hold a write of anything: it kept its writes out.
    assert_eq!(b.unplaced_writers(0, 1 << 30, 1), [a.id()]);
    // It enters with what it holds: now only those bytes name it.
    assert!(a.keep_order(|| vec![(0, 0, 4096, 1)]));
    assert!(b.unplaced_writers(0, 1 << 30, 1).is_empty());
    assert_eq!(b.unplaced_writers(0, 0, 1), [a.id()]);
    // A tombstone (left while a queue is out) names no one.
    let o = Arc::new(ReplayOrder::default());
    let x = Member::new(Arc::clone(&o), vec![1]);
    let mut y = Member::new(Arc::clone(&o), vec![1]);
    y.register(0, 0, 4096, 1);
    y.release(0, 0, 4096, 1);
    assert_eq!(o.len(), 1, "a tombstone");
    assert_eq!(
        y.unplaced_writers(0, 0, 4096),
        [x.id()],
        "only the queue kept out"
    );
}

/// Random writes, releases, placements and reconnects of three queues (one kept out at
/// first): the filter in front of the lock never hides a write the map calls unplaced.
#[test]
fn the_filter_never_hides_an_unplaced_write() {
    let o = Arc::new(ReplayOrder::default());
    let mut qs: Vec<Member> = (0..3)
        .map(|_| Member::new(Arc::clone(&o), vec![1]))
        .collect();
    let mut next = xorshift(0x9e37_79b9_7f4a_7c15);
    let mut live: Vec<(usize, u64, usize, u64)> = Vec::new();
    let mut seqs = [0u64; 3];
    let mut hidden_checked = 0;
    for step in 0..3000 {
        let q = next(3) as usize;
        match next(10) {
            0..=4 => {
                seqs[q] += 1;
                let off = next(64) << 14;
                let len = (1 + next(8) as usize) << 12;
                if qs[q].keep_order(|| {
                    live.iter()
                        .filter(|l| l.0 == q)
                        .map(|l| (0, l.1, l.2, l.3))
                        .collect()
                }) {
                    qs[q].register(0, off, len, seqs[q]);
                }
                live.push((q, off, len, seqs[q]));
            }
            5 | 6 if !live.is_empty() => {
                let (q, off, len, seq) = live.swap_remove(next(live.len() as u64) as usize);
                if qs[q].entered() {
                    qs[q].release(0, off, len, seq);
                }
            }
            7 | 8 => qs[q].placed_through(next(seqs[q] + 1)),
            _ => qs[q].unplace(seqs[q]),
        }
        for _ in 0..4 {
            let (s, e) = (next(1 << 20), next(1 << 20) + (1 << 12));
            let exact = o.unplaced_exact(1, s, s + e);
            assert_eq!(o.unplaced(1, s, s + e), exact, "step {step}");
            hidden_checked += usize::from(!exact.is_empty());
        }
    }
    assert!(
        hidden_checked > 100,
        "the walk found unplaced writes to hide"
    );
}

#[test]
fn members_of_one_order_get_their_own_numbers() {
    let o = Arc::new(ReplayOrder::default());
    let (mut a, mut b) = (
        Member::new(Arc::clone(&o), vec![1]),
        Member::new(Arc::clone(&o), vec![1]),
    );
    a.register(0, 0, 4096, 1);
    b.register(0, 0, 4096, 1);
    assert!(a.owned(0, 0, 4096, 1).is_empty(), "same seq, other queue");
    assert_eq!(b.owned(0, 0, 4096, 1), [(0, 4096)]);
}
