use super::*;
use crate::writebuf::{Data, WriteBuf};
use rpma_common::fabric::Context;

fn rec(ns: usize, offset: u64, len: usize, seq: u64) -> WriteRec {
    WriteRec {
        ns,
        offset,
        len,
        seq,
        notify: false,
    }
}

/// Two queues' pools in one replay order: a slot's write registers as it is set, moving on
/// (posted, completed, re-issued) keeps it registered, freeing or dropping the pool
/// releases it, and a newer write of the other pool takes the bytes it covers for good.
#[test]
fn pools_of_one_connection_share_the_replay_order() {
    let pd = Context::soft().alloc_pd().unwrap();
    let order = Arc::new(crate::replay::ReplayOrder::default());
    let (mut a, mut b) = (
        Pool::new(&pd, 2, 2, 16384).unwrap(),
        Pool::new(&pd, 2, 2, 16384).unwrap(),
    );
    a.join(Member::new(Arc::clone(&order), vec![1, 2]));
    b.join(Member::new(Arc::clone(&order), vec![2, 1]));
    let sa = a.take_free().unwrap();
    let seq = a.next_seq();
    let w = WriteRec {
        notify: true,
        ..rec(0, 0, 12288, seq)
    };
    a.set(sa, Slot::Writing(w));
    a.set(sa, Slot::Held(WriteRec { notify: false, ..w }));
    assert!(a.carries(sa, &w));
    assert_eq!(a.replay_pieces(&w), [(0, 12288)]);
    // B's index 1 is nsid 1 too: its write in the middle splits A's.
    let sb = b.take_free().unwrap();
    let seq = b.next_seq();
    let v = rec(1, 4096, 4096, seq);
    b.set(sb, Slot::Writing(v));
    assert_eq!(a.replay_pieces(&w), [(0, 4096), (8192, 12288)]);
    // B's write done with (durable): the bytes stay B's.
    b.set(sb, Slot::Free);
    assert_eq!(a.replay_pieces(&w), [(0, 4096), (8192, 12288)]);
    // A's re-issue moves the same write on: nothing changes.
    a.set(sa, Slot::Writing(w));
    assert_eq!(a.replay_pieces(&w), [(0, 4096), (8192, 12288)]);
    assert_eq!(order.len(), 2);
    // Another namespace of B's is apart.
    let (sb, seq) = (b.take_free().unwrap(), b.next_seq());
    b.set(sb, Slot::Held(rec(0, 0, 4096, seq)));
    assert_eq!(a.replay_pieces(&w), [(0, 4096), (8192, 12288)]);
    drop(b);
    assert_eq!(order.len(), 2, "B's write on nsid 2 released");
    a.clear();
    assert!(!a.carries(sa, &w));
    assert_eq!(order.len(), 0);
}

/// A queue alone on its connection keeps its write out of the map; a second queue's newer
/// write over part of it, done with and released before the first one enters (a
/// tombstone meanwhile), still keeps that part from the first one's replay.
#[test]
fn a_write_made_before_a_second_queue_joined_is_still_ordered() {
    let pd = Context::soft().alloc_pd().unwrap();
    let order = Arc::new(crate::replay::ReplayOrder::default());
    let mut a = Pool::new(&pd, 2, 2, 16384).unwrap();
    a.join(Member::new(Arc::clone(&order), vec![1]));
    let (sa, seq) = (a.take_free().unwrap(), a.next_seq());
    let w = rec(0, 0, 8192, seq);
    a.set(sa, Slot::Held(w));
    let mut b = Pool::new(&pd, 2, 2, 16384).unwrap();
    b.join(Member::new(Arc::clone(&order), vec![1]));
    let (sb, seq) = (b.take_free().unwrap(), b.next_seq());
    b.set(sb, Slot::Writing(rec(0, 0, 4096, seq)));
    b.set(sb, Slot::Free);
    assert_eq!(a.replay_pieces(&w), [(4096, 8192)]);
}

/// A durable acknowledgement of a newer write inside an older, larger held write must not
/// free the newer one alone: the replay would re-issue only the older write and put its
/// stale bytes back over the acknowledged ones.
#[test]
fn an_acknowledged_write_under_an_older_held_one_stays_for_the_replay() {
    let pd = Context::soft().alloc_pd().unwrap();
    let mut p = Pool::new(&pd, 4, 4, 1 << 17).unwrap();
    let (old, new, other) = (
        p.take_free().unwrap(),
        p.take_free().unwrap(),
        p.take_free().unwrap(),
    );
    p.set(old, Slot::Held(rec(0, 0, 1 << 17, 1)));
    p.set(new, Slot::Held(rec(0, 4096, 4096, 2)));
    // Newer than `new` and overlapping it, but outside the older write's shadow: free.
    p.set(other, Slot::Held(rec(0, 1 << 20, 4096, 3)));
    assert_eq!(p.release_held(0, 4096, 8192, false), 0);
    assert_eq!(p.release_held(0, 1 << 20, (1 << 20) + 4096, false), 1);
    let (held, _) = p.on_connection_lost();
    assert_eq!(
        held.iter()
            .map(|(_, w)| (w.offset, w.seq))
            .collect::<Vec<_>>(),
        [(0, 1), (4096, 2)],
        "the replay re-applies the acknowledged write after the older one"
    );
    // An in-flight older write shadows as well.
    p.set(old, Slot::Writing(rec(0, 0, 1 << 17, 1)));
    assert_eq!(p.release_held(0, 4096, 8192, false), 0);
    // A persist of the whole held span frees both; APM frees every held write.
    p.set(old, Slot::Held(rec(0, 0, 1 << 17, 1)));
    assert_eq!(p.release_held(0, 0, 1 << 17, false), 2);
    p.set(old, Slot::Held(rec(0, 0, 1 << 17, 4)));
    p.set(new, Slot::Held(rec(0, 4096, 4096, 5)));
    assert_eq!(p.release_held(0, 0, 0, true), 2);
}

#[test]
fn a_newer_write_of_the_same_block_frees_the_held_older_one() {
    let pd = Context::soft().alloc_pd().unwrap();
    let mut p = Pool::new(&pd, 2, 6, 4096).unwrap();
    let s: Vec<usize> = (0..5).map(|_| p.take_free().unwrap()).collect();
    p.set(s[0], Slot::Held(rec(0, 0, 4096, 1)));
    p.set(s[1], Slot::Held(rec(0, 8192, 4096, 2)));
    p.set(s[2], Slot::Held(rec(1, 0, 4096, 3)));
    let mut pending = rec(0, 8192, 4096, 4);
    pending.notify = true;
    p.set(s[3], Slot::Held(pending));
    assert_eq!(p.number(Kind::Held), 4);
    // Same namespace and offset, at least as long: the older copy goes.
    assert!(p.supersede(&rec(0, 0, 4096, 5)));
    assert_eq!(p.get(s[0]), Some(Slot::Free));
    // Another namespace, a shorter write, or a write whose completion the caller still
    // waits for (s[3], the latest at 8192): kept.
    assert!(!p.supersede(&rec(1, 4096, 4096, 6)));
    assert!(
        !p.supersede(&rec(0, 8192, 4096, 7)),
        "a pending report stays"
    );
    p.set(s[4], Slot::Writing(rec(0, 16384, 8192, 8)));
    assert!(!p.supersede(&rec(0, 16384, 8192, 9)), "still in flight");
    assert_eq!(p.number(Kind::Held), 3);
    // The replay has every write that is still needed, in post order.
    let (held, _) = p.on_connection_lost();
    assert_eq!(
        held.iter().map(|(_, w)| w.seq).collect::<Vec<_>>(),
        vec![2, 3, 4, 8]
    );
}

#[test]
fn at_most_depth_slots_are_in_flight_the_rest_hold_writes() {
    let pd = Context::soft().alloc_pd().unwrap();
    let mut p = Pool::new(&pd, 2, 8, 4096).unwrap();
    let a = p.take_free().unwrap();
    p.set(a, Slot::Writing(rec(0, 0, 4096, 1)));
    let b = p.take_free().unwrap();
    p.set(
        b,
        Slot::Reading {
            ns: 0,
            item: 0,
            at: 0,
            len: 8,
        },
    );
    assert_eq!(p.take_free(), None, "two in flight");
    p.set(a, Slot::Held(rec(0, 0, 4096, 1)));
    let c = p.take_free().unwrap();
    p.set(
        c,
        Slot::Started {
            ns: 0,
            ticket: 7,
            len: 8,
        },
    );
    assert_eq!(p.number(Kind::StartedOutstanding), 1);
    assert_eq!(p.number(Kind::Reading), 1);
    p.set(c, Slot::StartedDone { ticket: 7, len: 8 });
    assert_eq!(p.done_read(7), Some((c, 8)));
    assert_eq!(p.number(Kind::StartedOutstanding), 0);
    p.set(c, Slot::Free);
    assert_eq!(p.done_read(7), None);
}

#[test]
fn slots_cycle_and_held_writes_are_released_by_range() {
    let pd = Context::soft().alloc_pd().unwrap();
    let mut p = Pool::new(&pd, 4, 4, 4096).unwrap();
    let a = p.take_free().unwrap();
    let b = p.take_free().unwrap();
    let c = p.take_free().unwrap();
    p.set(a, Slot::Held(rec(0, 0, 4096, 1)));
    p.set(b, Slot::Held(rec(0, 8192, 4096, 2)));
    p.set(c, Slot::Held(rec(1, 0, 4096, 3)));
    assert_eq!(p.count(|s| matches!(s, Slot::Held(_))), 3);
    assert_eq!(p.in_flight(), 0, "held writes are not in flight");
    // The ranges a persist of the held writes covers, per namespace: apart, not their span.
    assert_eq!(p.held_ranges(0).to_vec(), vec![(0, 4096), (8192, 12288)]);
    assert_eq!(p.held_ranges(1).to_vec(), vec![(0, 4096)]);
    assert!(p.held_ranges(2).is_empty());
    // Only namespace 0's write inside [0, 4096).
    assert_eq!(p.release_held(0, 0, 4096, false), 1);
    assert_eq!(p.get(a), Some(Slot::Free));
    // A range that covers part of a write does not release it.
    assert_eq!(p.release_held(0, 8192, 8200, false), 0);
    assert_eq!(p.release_held(0, 0, 0, true), 1);
    assert_eq!(p.count(|s| *s == Slot::Free), 3);
    p.load(c, Data::Bytes(b"abc"), false).unwrap();
    let mut out = [0u8; 3];
    p.copy_out(c, &mut out).unwrap();
    assert_eq!(&out, b"abc");
    assert!(
        p.load(c, Data::Bytes(&[0u8; 4097]), false).is_ok(),
        "spills into the next slot's memory"
    );
    assert!(
        p.load(3, Data::Bytes(&[0u8; 4097]), false).is_err(),
        "but never past the pool"
    );
}

#[test]
fn ranges_merge_when_they_overlap_or_touch_and_stay_apart_otherwise() {
    assert_eq!(
        merge_ranges(Ranges::from_vec(vec![
            (8192, 12288),
            (0, 4096),
            (4096, 4608),
            (100, 200),
            (9000, 9000)
        ]))
        .to_vec(),
        vec![(0, 4608), (8192, 12288)]
    );
    assert!(merge_ranges(Ranges::from_vec(vec![(5, 5)])).is_empty());
    assert_eq!(
        merge_ranges(Ranges::from_vec(vec![
            (0, 10),
            (2, 3),
            (10, 12),
            (20, 30),
            (25, 40)
        ]))
        .to_vec(),
        vec![(0, 12), (20, 40)],
        "one inside another, touching, overlapping"
    );
}

#[test]
fn connection_loss_voids_started_reads_in_flight_and_keeps_completed_ones() {
    let pd = Context::soft().alloc_pd().unwrap();
    let mut p = Pool::new(&pd, 3, 3, 512).unwrap();
    let s: Vec<usize> = (0..3).map(|_| p.take_free().unwrap()).collect();
    p.set(
        s[0],
        Slot::Started {
            ns: 0,
            ticket: 1,
            len: 8,
        },
    );
    p.set(s[1], Slot::StartedDone { ticket: 2, len: 8 });
    let mut w = rec(0, 0, 512, 3);
    w.notify = true;
    p.set(s[2], Slot::Writing(w));
    assert_eq!(p.in_flight(), 2);
    let (held, _) = p.on_connection_lost();
    assert_eq!(p.get(s[0]), Some(Slot::Free), "in flight: void");
    assert_eq!(p.get(s[1]), Some(Slot::StartedDone { ticket: 2, len: 8 }));
    // The started Write is held for the replay and still to be reported.
    assert_eq!(held, vec![(s[2], w)]);
    assert_eq!(p.in_flight(), 0);
}

#[test]
fn connection_loss_holds_unfinished_writes_in_post_order_and_drops_reads() {
    let pd = Context::soft().alloc_pd().unwrap();
    let mut p = Pool::new(&pd, 4, 4, 512).unwrap();
    let s: Vec<usize> = (0..4).map(|_| p.take_free().unwrap()).collect();
    p.set(s[0], Slot::Writing(rec(0, 512, 512, 9)));
    p.set(s[1], Slot::Held(rec(0, 0, 512, 4)));
    p.set(
        s[2],
        Slot::Reading {
            ns: 0,
            item: 0,
            at: 0,
            len: 8,
        },
    );
    assert_eq!(p.in_flight(), 2);
    let (held, _) = p.on_connection_lost();
    assert_eq!(p.in_flight(), 0);
    assert_eq!(
        held.iter().map(|(_, w)| w.seq).collect::<Vec<_>>(),
        vec![4, 9]
    );
    assert_eq!(p.get(s[2]), Some(Slot::Free));
    assert_eq!(p.take_free(), Some(s[2]));
    let pd2 = Context::soft().alloc_pd().unwrap();
    p.rebind(&pd2).unwrap();
    assert_eq!(p.write_sge(1, 0, 8).offset, 512);
    p.clear();
    assert_eq!(p.count(|s| *s == Slot::Free), 4);
}

/// The writes a persist walks are the ones the slots carry, however many came and went: a long
/// run of writes (posted, held, superseded, released by persists, a slot reused) in a pool of
/// many slots gives the same held ranges and frees the same writes as a scan of every slot,
/// and the index stays a small multiple of the writes carried.
#[test]
fn the_index_a_persist_walks_matches_the_slots_and_stays_small() {
    let pd = Context::soft().alloc_pd().unwrap();
    let mut p = Pool::new(&pd, 4, 512, 4096).unwrap();
    let scan = |p: &Pool, ns: usize| {
        let all = p
            .slots
            .iter()
            .filter_map(|s| s.write())
            .filter(|w| w.ns == ns)
            .map(|w| (w.offset, w.offset + w.len as u64))
            .collect();
        merge_ranges(all)
    };
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut posted: Vec<usize> = Vec::new();
    for round in 0..20_000u32 {
        let r = next();
        let (ns, block) = ((r % 2) as usize, (r >> 8) % 64);
        let w = rec(ns, block * 4096, 4096, p.next_seq());
        p.supersede(&w);
        if let Some(s) = p.take_free() {
            p.set(s, Slot::Writing(w));
            posted.push(s);
        }
        if posted.len() == 4 || round % 7 == 0 {
            for s in posted.drain(..) {
                let w = p.get(s).unwrap().write().unwrap();
                p.set(s, Slot::Held(w));
            }
        }
        if round % 97 == 0 {
            let (lo, hi) = (block * 4096, block * 4096 + 16 * 4096);
            let before = p.number(Kind::Held);
            let freed = p.release_held(ns, lo, hi, round % 3 == 0);
            assert_eq!(p.number(Kind::Held), before - freed);
        }
        for ns in 0..2 {
            assert_eq!(p.held_ranges(ns), scan(&p, ns), "round {round}");
        }
        let carried = p.count(|s| s.write().is_some());
        assert!(
            p.order.len() <= 2 * carried + 65,
            "round {round}: {} entries for {carried} writes",
            p.order.len()
        );
    }
    assert!(p.number(Kind::Held) > 0);
    let held = p.count(|s| matches!(s, Slot::Held(_)));
    assert_eq!(
        p.release_held(0, 0, 0, true) + p.release_held(1, 0, 0, true),
        held
    );
    assert_eq!(p.count(|s| matches!(s, Slot::Held(_))), 0);
}

/// A slot that writes from a caller's buffer points its Write at the buffer (registered once
/// per domain, again after a rebind), holds the buffer until the slot is free (or handed back
/// unused), and copies nothing; a slot loaded with bytes again writes from its own memory.
#[test]
fn a_slot_writes_from_a_callers_buffer_and_holds_it_until_free() {
    let ctx = Context::soft();
    let pd = ctx.alloc_pd().unwrap();
    let mut p = Pool::new(&pd, 4, 4, 4096).unwrap();
    let b = WriteBuf::new(8192).unwrap();
    let s = p.take_free().unwrap();
    p.load(
        s,
        Data::Buf {
            buf: &b,
            at: 4096,
            len: 100,
        },
        false,
    )
    .unwrap();
    assert_eq!((b.holds(), p.bytes_copied()), (1, 0));
    let w = rec(0, 0, 100, p.next_seq());
    p.set(s, Slot::Writing(w));
    let sge = p.write_sge(s, 10, 50);
    assert_eq!(
        (sge.offset, sge.len),
        (4106, 50),
        "in the buffer, not the slot"
    );
    let lkey = p.ext_mr(s).unwrap().lkey();
    assert_eq!(
        p.ext_mr(s).unwrap().addr(),
        b.mem().as_volatile().as_ptr() as u64
    );
    // The same write moving on keeps the buffer; a second slot shares the registration.
    p.set(s, Slot::Held(w));
    let t = p.take_free().unwrap();
    p.load(
        t,
        Data::Buf {
            buf: &b,
            at: 0,
            len: 10,
        },
        false,
    )
    .unwrap();
    let seq = p.next_seq();
    p.set(t, Slot::Writing(rec(0, 4096, 10, seq)));
    assert_eq!(p.ext_mr(t).unwrap().lkey(), lkey);
    assert_eq!(b.holds(), 2);
    // A new domain: the held writes' buffer is registered in it.
    let pd2 = ctx.alloc_pd().unwrap();
    p.rebind(&pd2).unwrap();
    let again = p.ext_mr(s).unwrap();
    assert_ne!(again.lkey(), lkey);
    assert_eq!(p.ext_mr(t).unwrap().lkey(), again.lkey());
    assert_eq!(p.write_sge(s, 0, 100).offset, 4096);
    // A new write from the buffer after the rebind finds that registration, not a new one.
    let v = p.take_free().unwrap();
    p.load(v, buf_data(&b, 0, 10), false).unwrap();
    assert_eq!(p.ext_mr(v).unwrap().lkey(), again.lkey());
    p.untake(v);
    p.set(s, Slot::Free);
    p.set(t, Slot::Free);
    assert_eq!(b.holds(), 0);
    // Handed back unused, and loaded with bytes: the slot's own memory again.
    let u = p.take_free().unwrap();
    p.load(u, buf_data(&b, 0, 10), false).unwrap();
    assert_eq!(b.holds(), 1);
    p.untake(u);
    assert_eq!(b.holds(), 0);
    let u = p.take_free().unwrap();
    p.load(u, buf_data(&b, 0, 10), false).unwrap();
    p.load(u, Data::Bytes(b"abc"), false).unwrap();
    assert_eq!((b.holds(), p.bytes_copied()), (0, 3));
    assert!(p.ext_mr(u).is_none());
    assert_eq!(p.write_sge(u, 0, 3).offset, u * 4096);
}

/// `len` bytes from `at` of `buf`, as a write from it.
fn buf_data(buf: &WriteBuf, at: usize, len: usize) -> Data<'_> {
    Data::Buf { buf, at, len }
}

/// A Read into a caller's buffer that a lost connection voids frees its slot, but its hold on
/// the buffer is handed back with the held writes, not let go: the old connection may still
/// place the Read's bytes until it is closed. A completed one keeps its slot and hold.
#[test]
fn a_voided_read_into_a_buffer_keeps_its_hold_until_it_is_let_go() {
    let ctx = Context::soft();
    let pd = ctx.alloc_pd().unwrap();
    let mut p = Pool::new(&pd, 4, 4, 4096).unwrap();
    let b = WriteBuf::new(8192).unwrap();
    let (s, t) = (p.take_free().unwrap(), p.take_free().unwrap());
    for (slot, at) in [(s, 0), (t, 4096)] {
        p.load(slot, buf_data(&b, at, 100), true).unwrap();
        let ticket = p.next_seq();
        p.set(
            slot,
            Slot::Started {
                ns: 0,
                ticket,
                len: 100,
            },
        );
    }
    assert_eq!((b.reads_held(), b.writes_held()), (2, 0));
    p.set(
        t,
        Slot::StartedDone {
            ticket: 99,
            len: 100,
        },
    );
    let (held, voided) = p.on_connection_lost();
    assert!(held.is_empty());
    assert_eq!(voided.len(), 1, "the Read in flight");
    assert_eq!(p.get(s), Some(Slot::Free));
    assert!(p.ext_mr(s).is_none());
    assert_eq!(
        b.reads_held(),
        2,
        "the voided one's hold handed back, the done one's kept"
    );
    drop(voided);
    assert_eq!(b.reads_held(), 1);
    p.set(t, Slot::Free);
    assert_eq!(b.holds(), 0);
}

/// A new write whose post is refused (another reason than a lost connection) after it was
/// registered over a held write of the same bytes it supersedes: the held write stays held
/// (this queue's persist covers it), and a queue that let those bytes go is told of a loss,
/// never of a durable release; the held write, owning no bytes in the replay order any more,
/// counts them lost at its own re-issue. (The other queue's heir found a gap and said
/// durable over the held write.)
#[test]
fn a_refused_rewrite_is_told_as_a_loss_never_as_durable() {
    let pd = Context::soft().alloc_pd().unwrap();
    let order = Arc::new(crate::replay::ReplayOrder::default());
    let (mut a, mut b) = (
        Pool::new(&pd, 4, 4, 16384).unwrap(),
        Pool::new(&pd, 4, 4, 16384).unwrap(),
    );
    a.join(Member::new(Arc::clone(&order), vec![1]));
    b.join(Member::new(Arc::clone(&order), vec![1]));
    assert!(a.keep_order() && b.keep_order());
    // B's write, then A's newer one of the same bytes, both held; B re-issues after a
    // reconnect and lets its write go to A's.
    let (sb, seq) = (b.take_free().unwrap(), b.next_seq());
    let wb = rec(0, 0, 4096, seq);
    b.set(sb, Slot::Held(wb));
    let (sa, seq) = (a.take_free().unwrap(), a.next_seq());
    let old = rec(0, 0, 4096, seq);
    a.set(sa, Slot::Held(old));
    b.replay.as_mut().unwrap().reissuing();
    b.replay.as_mut().unwrap().hand_over(0, 0, 4096, wb.seq);
    b.replay.as_mut().unwrap().reissued();
    b.set(sb, Slot::Free);
    // A's client rewrites the block; the post is refused.
    let (s2, seq) = (a.take_free().unwrap(), a.next_seq());
    let new = rec(0, 0, 4096, seq);
    let p = a.superseded(&new).expect("the held write is superseded");
    a.set(s2, Slot::Writing(new));
    a.supersede_when_posted(s2, &new, p);
    a.unpost_write(s2);
    a.settle_superseded(&[]);
    assert_eq!(a.held_ranges(0).as_slice(), &[(0, 4096)]);
    assert_eq!(
        b.replay.as_mut().unwrap().handed(0),
        crate::replay::Handed::Lost(vec![(0, 4096)]),
        "B's persist would say durable over A's unpersisted write"
    );
    // A's re-issue: its held write owns nothing; the bytes are counted lost (A owes them).
    let m = a.replay.as_mut().unwrap();
    m.reissuing();
    m.hand_over(0, 0, 4096, old.seq);
    m.reissued();
    assert_eq!(m.handed(0), crate::replay::Handed::Lost(vec![(0, 4096)]));
}
