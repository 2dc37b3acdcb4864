//! Writes from a caller's registered buffer ([`WriteBuf`]) against a real `rpma-target`: they
//! land without a bounce copy (the queue's `bytes_copied` says so), the queue holds the buffer
//! until a durability acknowledgement covers them (the caller cannot refill it before), every
//! call refuses the ranges it promises to refuse, and a write from a buffer that a cut link
//! swallowed is re-issued from the same buffer after the reconnect. Reads into such a buffer
//! land in it without a copy out (the queue's `read_bytes_copied`).

use std::time::Duration;

use rpma_common::proto::nqn::Nqn;
use rpma_common::proto::PersistenceDomain;
use rpma_initiator::{
    Completed, ConnectOptions, Connection, Error, HostIdentity, QueueOptions, ReconnectPolicy,
    WriteBuf,
};
use rpma_tests::{four_namespace_target, noise, Relay, Subsystem, Transport};

const SUB: &str = "nqn.2026-11.io.rpma:wbuf";
const HOST: &str = "nqn.2026-11.io.rpma:wbuf-host";

fn conn(url: &str, reconnect: ReconnectPolicy) -> Connection {
    Connection::new(
        url,
        Nqn::new(SUB).unwrap(),
        HostIdentity::new(Nqn::new(HOST).unwrap()),
    )
    .with_connect_options(ConnectOptions {
        timeout: Duration::from_secs(5),
        ..ConnectOptions::default()
    })
    .with_queue_options(QueueOptions {
        depth: 8,
        chunk: 16384,
        reconnect,
        ..QueueOptions::default()
    })
}

/// A buffer holding `bytes`.
fn buf_of(bytes: &[u8]) -> WriteBuf {
    let mut b = WriteBuf::new(bytes.len()).unwrap();
    b.bytes_mut().unwrap().copy_from_slice(bytes);
    b
}

fn read_back(ns: &mut rpma_initiator::Namespace<'_>, offset: u64, len: usize) -> Vec<u8> {
    let mut back = vec![0u8; len];
    ns.read_at(offset, &mut back).unwrap();
    back
}

#[test]
fn writes_from_a_buffer_land_without_a_copy_and_hold_it_until_durable() {
    let (_d, _shm, t) = four_namespace_target("wbuf", Subsystem::new(SUB).any_host(), 512);
    let mut q = conn(&t.url(), ReconnectPolicy::default())
        .open_queue(0)
        .unwrap();
    // Writes and reads: the fence between them is the one a plain write has.
    for nsid in [1u32, 3, 4] {
        let mut ns = q.namespace(nsid).unwrap();
        // The outcome a plain durable write has here (a volatile namespace's is VisibleOnly).
        let outcome = ns.write_durable(0, b"x").unwrap();
        let copied = ns.queue_stats().bytes_copied;
        // Durable, larger than a chunk (four pieces from the one buffer), at an offset in it.
        let big = noise(u64::from(nsid), 70_000);
        let b = buf_of(&big);
        assert_eq!(
            ns.write_durable_from(8192, &b, 1000..61_000).unwrap(),
            outcome
        );
        assert_eq!(b.holds(), 0, "nsid {nsid}: durable, so let go");
        assert!(read_back(&mut ns, 8192, 60_000) == big[1000..61_000]);

        // Not durable yet: held (each piece) until a persist covers it.
        let mut b = buf_of(&noise(10 + u64::from(nsid), 40_000));
        ns.write_from(200_000, &b, 0..40_000).unwrap();
        assert_eq!(b.holds(), 3, "nsid {nsid}: one hold per chunk-sized piece");
        assert!(b.bytes_mut().is_none());
        assert!(matches!(b.fill(0, b"x"), Err(Error::InvalidArgument(_))));
        assert_eq!(
            ns.persist_own_writes().unwrap().is_durable(),
            outcome.is_durable()
        );
        assert_eq!(b.holds(), 0);
        let want = b.bytes_mut().unwrap().to_vec();
        assert!(read_back(&mut ns, 200_000, 40_000) == want);

        // Batches from buffers, durable and not; one buffer in several items.
        let (x, y) = (buf_of(&noise(20, 4096)), buf_of(&noise(21, 8192)));
        let items = [
            (300_000, &x, 0..4096),
            (310_000, &y, 4096..8192),
            (320_000, &y, 0..100),
        ];
        assert_eq!(ns.write_batch_durable_from(&items).unwrap(), outcome);
        assert_eq!((x.holds(), y.holds()), (0, 0));
        ns.write_batch_from(&[(330_000, &x, 10..20)]).unwrap();
        assert_eq!(x.holds(), 1);
        ns.persist_own_writes().unwrap();
        let (xb, yb) = (noise(20, 4096), noise(21, 8192));
        assert!(read_back(&mut ns, 300_000, 4096) == xb);
        assert!(read_back(&mut ns, 310_000, 4096) == yb[4096..]);
        assert!(read_back(&mut ns, 320_000, 100) == yb[..100]);
        assert!(read_back(&mut ns, 330_000, 10) == xb[10..20]);

        // Started from a buffer: completes as a started write, held until a persist.
        let s = buf_of(&noise(30, 16384));
        let t1 = ns.start_write_from(400_000, &s, 0..16384).unwrap();
        let t2 = ns.start_write_from(420_000, &s, 5..9).unwrap();
        let mut seen = Vec::new();
        while seen.len() < 2 {
            let mut done = Vec::new();
            ns.wait_started(&mut done).unwrap();
            seen.extend(done);
        }
        assert!(seen.contains(&Completed::Write(t1)) && seen.contains(&Completed::Write(t2)));
        assert_eq!(s.holds(), 2);
        ns.persist_own_writes().unwrap();
        assert_eq!(s.holds(), 0);
        assert!(read_back(&mut ns, 400_000, 16384) == noise(30, 16384));
        assert!(read_back(&mut ns, 420_000, 4) == noise(30, 16384)[5..9]);

        assert_eq!(
            ns.queue_stats().bytes_copied,
            copied,
            "nsid {nsid}: no write from a buffer was copied"
        );
        // A plain write is.
        ns.write_durable(500_000, &[7u8; 1000]).unwrap();
        assert_eq!(ns.queue_stats().bytes_copied, copied + 1000);
    }

    // Every method makes a write from a buffer durable.
    let mut ns = q.namespace(4).unwrap();
    let offered = Transport::current().methods(PersistenceDomain::DaxForced);
    assert!(offered.len() >= 2, "{offered:?}");
    for (i, &m) in offered.iter().enumerate() {
        ns.set_method(Some(m)).unwrap();
        let b = buf_of(&noise(40 + i as u64, 20_000));
        let at = 600_000 + i as u64 * 32768;
        assert_eq!(
            ns.write_durable_from(at, &b, 0..20_000).unwrap(),
            rpma_initiator::Durability::Durable(m)
        );
        assert_eq!(b.holds(), 0, "{m}");
        assert!(read_back(&mut ns, at, 20_000) == noise(40 + i as u64, 20_000));
    }
    ns.set_method(None).unwrap();

    // The errors each call promises, and nothing held after any of them.
    let b = buf_of(&[1u8; 4096]);
    let bad = |r: rpma_initiator::Result<_>| matches!(r, Err(Error::InvalidArgument(_)));
    assert!(bad(ns.write_from(0, &b, 0..0).map(|_| ())));
    assert!(bad(ns.write_from(0, &b, 4000..4097).map(|_| ())));
    #[allow(clippy::reversed_empty_ranges)]
    let backwards = 10..5;
    assert!(bad(ns.write_durable_from(0, &b, backwards).map(|_| ())));
    assert!(bad(ns
        .write_batch_durable_from(&[(0, &b, 0..10), (8192, &b, 0..5000)])
        .map(|_| ())));
    let big = WriteBuf::new(20_000).unwrap();
    assert!(
        bad(ns.start_write_from(0, &big, 0..20_000).map(|_| ())),
        "a started write moves at most a chunk"
    );
    let size = ns.descriptor().size;
    assert!(matches!(
        ns.write_from(size - 100, &b, 0..4096),
        Err(Error::OutOfRange { .. })
    ));
    assert_eq!((b.holds(), big.holds()), (0, 0));
    assert!(matches!(
        q.namespace(2).unwrap().write_from(0, &b, 0..512),
        Err(Error::ReadOnly { .. })
    ));
    assert_eq!(b.holds(), 0);
}

/// Writes from a buffer that went into a link throwing them away are re-issued from the buffer
/// after the reconnect (the queue held it, not a copy), and the buffer is let go once they are
/// durable; a buffer the caller dropped meanwhile stays alive for the replay; a Read into a
/// buffer is void after the loss and lets its buffer go.
#[test]
fn writes_from_a_buffer_swallowed_by_a_cut_link_are_reissued_from_it() {
    let (_d, _shm, t) = four_namespace_target("wbufcut", Subsystem::new(SUB).any_host(), 512);
    let relay = std::sync::Arc::new(Relay::start(&format!("127.0.0.1:{}", t.port())));
    let reconnect = ReconnectPolicy {
        max_attempts: 20,
        timeout: Duration::from_secs(30),
        initial_backoff: Duration::from_millis(20),
        max_backoff: Duration::from_millis(200),
    };
    let mut q = conn(&relay.url(), reconnect).open_queue(0).unwrap();
    let mut ns = q.namespace(4).unwrap();
    let kept = buf_of(&noise(50, 65536));
    let dropped = buf_of(&noise(51, 16384));
    relay.swallow();
    let mut tickets: Vec<_> = (0..4)
        .map(|i| {
            let r = i * 16384..(i + 1) * 16384;
            ns.start_write_from(i as u64 * 16384, &kept, r).unwrap()
        })
        .collect();
    tickets.push(ns.start_write_from(65536, &dropped, 0..16384).unwrap());
    drop(dropped);
    let read = ns.start_read(0, 4096).unwrap();
    let mut into = WriteBuf::new(4096).unwrap();
    let read_into = ns.start_read_into(0, &mut into, 0..4096).unwrap();
    assert_eq!(into.holds(), 1);
    let (err, seen) =
        rpma_tests::relay::wait_started_through_a_cut(&relay, Duration::from_millis(300), &mut ns);
    assert!(err.is_connection_loss(), "{err}");
    for t in &tickets {
        assert!(seen.contains(&Completed::Write(*t)), "{t:?}: {seen:?}");
    }
    assert!(!seen.contains(&Completed::Read(read)));
    // A Read into a buffer is void as well, and lets the buffer go once the old connection is
    // closed: the caller may fill it again.
    assert!(!seen.contains(&Completed::Read(read_into)));
    assert_eq!(into.holds(), 0, "the voided Read's hold is let go");
    assert!(matches!(
        ns.finish_read(read_into),
        Err(Error::InvalidArgument(_))
    ));
    into.fill(0, b"mine").unwrap();
    assert_eq!(kept.holds(), 4, "held through the reconnect");
    assert!(ns.persist_own_writes().unwrap().is_durable());
    assert_eq!(kept.holds(), 0);
    assert!(
        read_back(&mut ns, 0, 65536) == noise(50, 65536),
        "re-issued from the buffer"
    );
    assert!(
        read_back(&mut ns, 65536, 16384) == noise(51, 16384),
        "a dropped buffer's write re-issued too"
    );
    assert!(q.reconnects() >= 1);
}

/// Waits until each of `tickets` completed as a Read.
fn wait_reads(ns: &mut rpma_initiator::Namespace<'_>, tickets: &[rpma_initiator::Ticket]) {
    let mut seen = Vec::new();
    while !tickets.iter().all(|t| seen.contains(&Completed::Read(*t))) {
        let mut done = Vec::new();
        ns.wait_started(&mut done).unwrap();
        seen.extend(done);
    }
}

/// Reads into a caller's buffer (`start_read_into`): the bytes land in it and nothing copies
/// them out (a plain read's do get copied), several Reads go into one buffer at once, the
/// queue holds it until `finish_read` (or `take_read`, which copies them out too); a buffer a
/// write from it is held for takes no Read, a buffer with a Read into it gives no write; and
/// the errors each call promises, nothing held after any of them.
#[test]
fn reads_into_a_buffer_land_without_a_copy() {
    let (_d, _shm, t) = four_namespace_target("rbuf", Subsystem::new(SUB).any_host(), 512);
    let mut q = conn(&t.url(), ReconnectPolicy::default())
        .open_queue(0)
        .unwrap();
    let bad = |r: rpma_initiator::Result<()>| matches!(r, Err(Error::InvalidArgument(_)));
    for nsid in [1u32, 4] {
        let mut ns = q.namespace(nsid).unwrap();
        let data = noise(60 + u64::from(nsid), 3 * 16384);
        ns.write_durable(0, &data).unwrap();
        let copied = ns.queue_stats().read_bytes_copied;

        // Three chunk-sized Reads into one buffer at once.
        let mut b = WriteBuf::new(3 * 16384).unwrap();
        let tickets: Vec<_> = (0..3)
            .map(|i| {
                ns.start_read_into(i as u64 * 16384, &mut b, i * 16384..(i + 1) * 16384)
                    .unwrap()
            })
            .collect();
        assert_eq!(b.holds(), 3);
        assert!(
            b.bytes_mut().is_none(),
            "nsid {nsid}: held while Reads may write it"
        );
        assert!(
            bad(ns.write_from(0, &b, 0..10)),
            "nsid {nsid}: no write from a buffer a Read goes into"
        );
        wait_reads(&mut ns, &tickets);
        for &t in &tickets {
            ns.finish_read(t).unwrap();
        }
        assert!(
            bad(ns.finish_read(tickets[0])),
            "nsid {nsid}: freed already"
        );
        assert_eq!(b.holds(), 0);
        assert!(
            b.bytes_mut().unwrap() == &data[..],
            "nsid {nsid}: the bytes landed"
        );
        assert_eq!(
            ns.queue_stats().read_bytes_copied,
            copied,
            "nsid {nsid}: nothing copied out"
        );

        // take_read of a Read into a buffer copies them out as well; a plain read copies.
        let t = ns.start_read_into(100, &mut b, 5000..5050).unwrap();
        wait_reads(&mut ns, &[t]);
        let mut out = [0u8; 50];
        ns.take_read(t, &mut out).unwrap();
        assert!(out[..] == data[100..150]);
        assert!(b.bytes_mut().unwrap()[5000..5050] == data[100..150]);
        assert!(read_back(&mut ns, 0, 1000) == data[..1000]);
        assert_eq!(ns.queue_stats().read_bytes_copied, copied + 1050);

        // Not into a buffer a write from it is held for: its bytes may be re-issued.
        let mut w = buf_of(&noise(70, 4096));
        ns.write_from(200_000, &w, 0..4096).unwrap();
        assert!(bad(ns.start_read_into(0, &mut w, 0..4096).map(|_| ())));
        assert_eq!(w.holds(), 1);
        ns.persist_own_writes().unwrap();
        let t = ns.start_read_into(0, &mut w, 0..4096).unwrap();
        wait_reads(&mut ns, &[t]);
        ns.finish_read(t).unwrap();
        assert!(w.bytes_mut().unwrap() == &data[..4096]);
        assert!(read_back(&mut ns, 200_000, 4096) == noise(70, 4096));
    }

    // The errors.
    let mut ns = q.namespace(4).unwrap();
    let mut b = WriteBuf::new(16384).unwrap();
    let start = |ns: &mut rpma_initiator::Namespace<'_>, off, b: &mut WriteBuf, r| {
        ns.start_read_into(off, b, r).map(|_| ())
    };
    assert!(bad(start(&mut ns, 0, &mut b, 0..0)), "empty");
    assert!(
        bad(start(&mut ns, 0, &mut b, 16000..16385)),
        "outside the buffer"
    );
    #[allow(clippy::reversed_empty_ranges)]
    let backwards = 10..5;
    assert!(bad(start(&mut ns, 0, &mut b, backwards)));
    let mut big = WriteBuf::new(20_000).unwrap();
    assert!(
        bad(start(&mut ns, 0, &mut big, 0..20_000)),
        "a started read moves at most a chunk"
    );
    let size = ns.descriptor().size;
    assert!(matches!(
        start(&mut ns, size - 100, &mut b, 0..4096),
        Err(Error::OutOfRange { .. })
    ));
    let w = ns.start_write(0, b"abc").unwrap();
    let mut done = Vec::new();
    while !done.contains(&Completed::Write(w)) {
        ns.wait_started(&mut done).unwrap();
    }
    assert!(bad(ns.finish_read(w)), "a write's ticket");
    let r = ns.start_read(0, 3).unwrap();
    wait_reads(&mut ns, &[r]);
    assert!(
        bad(ns.finish_read(r)),
        "a read into a slot: its bytes are to be taken"
    );
    let mut out = [0u8; 3];
    ns.take_read(r, &mut out).unwrap();
    assert_eq!(&out, b"abc", "still there to take after the refusal");
    assert_eq!((b.holds(), big.holds()), (0, 0));
}

rpma_tests::rdma_runs!(
    writes_from_a_buffer_land_without_a_copy_and_hold_it_until_durable,
    reads_into_a_buffer_land_without_a_copy,
);
