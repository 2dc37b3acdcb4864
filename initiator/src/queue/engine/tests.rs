//! The engine on a queue pair of the soft transport whose peer serves Reads of its memory: no
//! target and no handshake, so that what the engine's own bookkeeping leaves behind shows.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rpma_common::fabric::{
    Access, AlignedBuf, Completion, ConnParams, Context, Listener, QpCaps, QueuePair,
};
use rpma_common::proto::msgbuf::MsgBufs;
use rpma_common::proto::{DurabilityMethods, NamespaceDescriptor, PersistenceDomain};

use super::{Engine, MakeRoom};
use crate::error::{Error, Result};
use crate::pool::{Kind, Pool};
use crate::session::Session;

/// The peer's bytes: byte `i` is `byte(i)`.
fn byte(i: usize) -> u8 {
    (i % 251) as u8
}

/// No write is ever held here, so nothing asks for room.
struct NoRoom;

impl MakeRoom for NoRoom {
    fn make_room(&self, _: &mut Engine) -> Result<()> {
        Err(Error::InvalidArgument(
            "no held write to make room with".into(),
        ))
    }
}

/// The peer: serves Reads of its memory (the soft transport answers them as the peer's
/// completion queue is polled) until dropped.
struct Peer {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Drop for Peer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// An engine of `depth` slots of `chunk` bytes on one namespace of `len` bytes (the peer's),
/// whose queue pair posts messages of at most `max_message` bytes.
fn engine(depth: usize, chunk: usize, len: usize, max_message: usize) -> (Engine, Peer) {
    let ctx = Context::soft();
    let listener = Listener::bind(&ctx, &"tcp://127.0.0.1:0".parse().unwrap()).unwrap();
    let url = listener.url().unwrap();
    let ppd = ctx.alloc_pd().unwrap();
    let mem = AlignedBuf::new(len).unwrap();
    let bytes: Vec<u8> = (0..len).map(byte).collect();
    mem.write_at(0, &bytes).unwrap();
    let mr = ppd
        .register(
            Arc::clone(&mem),
            Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE,
        )
        .unwrap();
    let (remote_addr, rkey) = (mr.addr(), mr.rkey());
    let stop = Arc::new(AtomicBool::new(false));
    let (pctx, pstop) = (ctx.clone(), Arc::clone(&stop));
    let thread = std::thread::spawn(move || {
        let req = listener.accept(&ConnParams::default()).unwrap();
        let cq = pctx.create_cq(64).unwrap();
        let qp = ppd.create_qp(&cq, &cq, QpCaps::default()).unwrap();
        let _qp: QueuePair = req.accept(qp, &ConnParams::default(), &[]).unwrap();
        let mut wcs = [Completion::EMPTY; 16];
        while !pstop.load(Ordering::Relaxed) {
            let _ = cq.wait(&mut wcs, Some(Duration::from_millis(10)));
        }
        // Served until here.
        drop(mr);
    });
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(64).unwrap();
    let params = ConnParams {
        max_message,
        ..ConnParams::default()
    };
    let qp = pd
        .create_qp(&cq, &cq, QpCaps::default())
        .unwrap()
        .connect(&url, &params, &[])
        .unwrap();
    let bufs = MsgBufs::new(&pd, 1, 1).unwrap();
    let now = Instant::now();
    let desc = NamespaceDescriptor {
        nsid: 1,
        size: len as u64,
        block_size: 512,
        remote_addr,
        rkey,
        domain: PersistenceDomain::Volatile,
        durability: DurabilityMethods::NONE,
        atomic_write_unit: 8,
        read_only: true,
        failure: None,
        simulation: None,
        unavailable: None,
        identity: 1,
    };
    let session = Session {
        ctx,
        pd: pd.clone(),
        cq,
        qp,
        bufs,
        url: url.to_string(),
        controller_id: 1,
        // No keep-alive is due, nor missed, within a test.
        keep_alive: Duration::from_secs(3600),
        queue_depth: depth as u32,
        namespaces: vec![desc],
        inbox: VecDeque::new(),
        other: VecDeque::new(),
        last_sent: now,
        last_heard: now,
        seq: 0,
        echoed: 0,
        next_token: 0,
        closed: None,
        admitted: false,
        violated: None,
        rx: Vec::new(),
    };
    let pool = Pool::new(&pd, depth, depth, chunk).unwrap();
    let e = Engine::new(session, pool, Duration::from_secs(5));
    let peer = Peer {
        stop,
        thread: Some(thread),
    };
    (e, peer)
}

/// A batch read one of whose Reads the fabric refuses to post (longer than the queue pair's
/// largest message) fails, and gives back everything it took: the refused Read's slot, and
/// the slots of the Reads posted before it, which the call waits for and copies out; a started
/// Read refused with it in one post is let go too. After `depth` such refusals the queue still
/// reads its whole depth at once, every piece its own bytes. (The refused Read's slot stayed in
/// flight until the next time-out or reconnect: the next read waited for it, timed out and
/// reconnected, and `depth` refusals left no slot at all; the Reads posted before it completed
/// after the call, and the next batch copied their bytes into its own buffers.)
#[test]
fn a_refused_read_gives_back_its_slot_and_its_batchs() {
    const DEPTH: usize = 4;
    const CHUNK: usize = 8192;
    let (mut e, _peer) = engine(DEPTH, CHUNK, 2 * DEPTH * CHUNK, CHUNK / 2);
    let refused = |r: &Result<()>| matches!(r, Err(Error::Fabric { .. }));
    for round in 0..DEPTH {
        // The first piece fits the largest message; the second, a whole chunk, does not.
        let (mut a, mut b) = (vec![0u8; CHUNK / 2], vec![0u8; CHUNK]);
        let r = e.read_into(
            &NoRoom,
            0,
            &mut [(0, &mut a[..]), (CHUNK as u64, &mut b[..])],
        );
        assert!(refused(&r), "round {round}: {r:?}");
        assert_eq!(
            e.pool.in_flight(),
            0,
            "round {round}: a slot left in flight"
        );
        assert_eq!(e.pool.number(Kind::Reading), 0, "round {round}");
        assert!(
            e.reads_done.is_empty(),
            "round {round}: a Read left for the next batch"
        );
        let want: Vec<u8> = (0..CHUNK / 2).map(byte).collect();
        assert!(a == want, "round {round}: the posted Read's bytes");
    }
    // A started Read waits for the next post: the refused Read's, which takes both.
    e.start_read(&NoRoom, 0, 0, CHUNK / 2).unwrap();
    let mut b = vec![0u8; CHUNK];
    let r = e.read_into(&NoRoom, 0, &mut [(CHUNK as u64, &mut b[..])]);
    assert!(refused(&r), "{r:?}");
    assert_eq!(e.pool.in_flight(), 0, "a slot left in flight");
    assert_eq!(e.pool.number(Kind::StartedOutstanding), 0);
    // The whole depth at once.
    let mut bufs = vec![vec![0u8; CHUNK / 2]; DEPTH];
    let at = |i: usize| i * CHUNK + 100 * i;
    let mut items: Vec<(u64, &mut [u8])> = bufs
        .iter_mut()
        .enumerate()
        .map(|(i, b)| (at(i) as u64, &mut b[..]))
        .collect();
    e.read_into(&NoRoom, 0, &mut items).unwrap();
    for (i, b) in bufs.iter().enumerate() {
        let want: Vec<u8> = (at(i)..at(i) + CHUNK / 2).map(byte).collect();
        assert!(*b == want, "item {i}: another Read's bytes");
    }
    assert_eq!(e.pool.in_flight(), 0);
}

/// A held write that a new write of the same bytes supersedes stays held until the new one is
/// posted: a post refused for another reason than a lost connection (here a Read too long for
/// the queue pair, posted with the new write) frees the new write, and the older one's bytes
/// stay held for the queue's persist. (The older one was freed first: the bytes were held by
/// neither, and a persist, the queue's own or an heir's, said durable without them.)
#[test]
fn a_superseded_write_stays_held_when_the_new_ones_post_is_refused() {
    const CHUNK: usize = 8192;
    let (mut e, _peer) = engine(4, CHUNK, 8 * CHUNK, CHUNK / 2);
    e.start_write(
        &NoRoom,
        0,
        0,
        crate::writebuf::Data::Bytes(&[7; 4096]),
        false,
    )
    .unwrap();
    let mut done = Vec::new();
    while done.is_empty() {
        e.wait_started(&mut done).unwrap();
    }
    assert_eq!(e.held_ranges(0).as_slice(), &[(0, 4096)]);
    e.start_write(
        &NoRoom,
        0,
        0,
        crate::writebuf::Data::Bytes(&[8; 4096]),
        false,
    )
    .unwrap();
    let mut b = vec![0u8; CHUNK];
    let r = e.read_into(&NoRoom, 0, &mut [(CHUNK as u64, &mut b[..])]);
    assert!(matches!(r, Err(Error::Fabric { .. })), "{r:?}");
    assert_eq!(
        e.held_ranges(0).as_slice(),
        &[(0, 4096)],
        "the first write's bytes are held by no write"
    );
}
