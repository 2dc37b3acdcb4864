//! The initiator library against a target that breaks the protocol: a small target of this
//! file's own on the soft fabric admits the host to one namespace (its memory served by the
//! fabric, as a real target's; GPSPM offered), echoes KeepAlives, answers FlushRequests
//! Durable, and, when told, sends a control message no target may send: one the host cannot
//! decode, an answer to a FlushRequest or an echo of a KeepAlive the host never sent, or stray
//! answers while it leaves the host's request unanswered.

use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rpma_common::fabric::{
    Access, AlignedBuf, Completion, ConnParams, Context, Listener, MemoryRegion, QpCaps, QueuePair,
};
use rpma_common::proto::msgbuf::{MsgBufs, CONTROL_BIT, SEND_BIT};
use rpma_common::proto::nqn::Nqn;
use rpma_common::proto::{
    ConnectResponse, DurabilityMethods, FlushResponse, FlushStatus, KeepAlive, Message,
    NamespaceDescriptor, NamespacesResponse, PersistenceDomain, PROTO_VERSION,
};
use rpma_initiator::{
    connect, ConnectOptions, Connection, Durability, Error, HostIdentity, QueueOptions,
    ReconnectPolicy,
};
use rpma_tests::noise as pattern;

const SUB: &str = "nqn.2026-11.io.rpma:hostile-target";
const HOST: &str = "nqn.2026-11.io.rpma:hostile-target-host";
const SIZE: usize = 1 << 20;

/// What the first admitted connection does besides serving (the later ones only serve), and
/// what it sends when told ([`FakeTarget::garbage`]).
/// Sends a message of a type no target sends.
const HONEST: u8 = 0;
/// Sends an answer (Durable) to FlushRequest 1, before the host sent it; leaves the host's
/// FlushRequests unanswered.
const FORGED_ANSWER: u8 = 1;
/// Sends an echo of KeepAlive u64::MAX, never sent.
const FORGED_ECHO: u8 = 2;
/// Describes its namespace at an address whose end is past the address space.
const BAD_ADDRESS: u8 = 4;
/// Writes text meant to forge a line and drive a terminal ([`HOSTILE_TEXT`]) where a target
/// writes text: the namespace's reason to be unavailable, and a Disconnect's reason as the
/// answer to the first FlushRequest.
const BAD_TEXT: u8 = 5;
/// Refuses the Connect with [`HOSTILE_TEXT`] as the message.
const BAD_REFUSAL: u8 = 6;

/// Says it has 3 namespaces, lists 1 in its ConnectResponse, and answers every
/// NamespacesRequest with a page that brings none.
const EMPTY_PAGES: u8 = 7;
/// Says it has u32::MAX namespaces (and lists 1).
const COUNTLESS: u8 = 8;
/// Says it has 2 namespaces, lists 1, and answers the NamespacesRequest honestly with the
/// second (nsid 2, the same memory).
const PAGED: u8 = 9;

/// A line break, a forged log line, a terminal escape (red), a right-to-left override.
const HOSTILE_TEXT: &str = "bye\n[2026-12-06T00:00:00Z ERROR rpma] forged\u{1b}[31m red\u{202e}";
/// The host's FlushRequests unanswered; every 20 ms an answer to FlushRequest 0 (none has that
/// token: an old request's, as far as the host can tell).
const STRAY_ANSWERS: u8 = 3;

/// The fake target: every connection on a thread of its own, the namespace shared.
struct FakeTarget {
    url: String,
    /// What the first admitted connection does ([`HONEST`] ...), set before the host connects.
    first: Arc<AtomicU8>,
    /// Set: a connection sends the garbage (once; what [`FakeTarget::first`] says), then sets
    /// `sent`.
    garbage: Arc<AtomicBool>,
    /// The garbage is in the host's socket: a soft queue pair writes at its post.
    sent: Arc<AtomicBool>,
    admitted: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl FakeTarget {
    fn start() -> FakeTarget {
        let ctx = Context::soft();
        let listener = Listener::bind(&ctx, &"tcp://127.0.0.1:0".parse().unwrap()).unwrap();
        let url = format!("tcp://127.0.0.1:{}", listener.url().unwrap().port);
        let mem = AlignedBuf::new(SIZE).unwrap();
        mem.write_at(0, &pattern(77, SIZE)).unwrap();
        let first = Arc::new(AtomicU8::new(HONEST));
        let (garbage, sent, admitted, stop) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicUsize::new(0)),
            Arc::new(AtomicBool::new(false)),
        );
        let flags = Flags {
            first: first.clone(),
            garbage: garbage.clone(),
            sent: sent.clone(),
            admitted: admitted.clone(),
            stop: stop.clone(),
        };
        let st = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut conns = Vec::new();
            while !st.load(Ordering::SeqCst) {
                let Ok(req) = listener.accept(&ConnParams::default()) else {
                    continue;
                };
                let (ctx, mem, f) = (ctx.clone(), Arc::clone(&mem), flags.clone());
                conns.push(std::thread::spawn(move || {
                    let pd = ctx.alloc_pd().unwrap();
                    let cq = ctx.create_cq(64).unwrap();
                    let mr = pd
                        .register(
                            mem,
                            Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
                        )
                        .unwrap();
                    let prepared = pd.create_qp(&cq, &cq, QpCaps::default()).unwrap();
                    let mut bufs = MsgBufs::new(&pd, 16, 8).unwrap();
                    for slot in 0..bufs.recv_slots() {
                        prepared.post_recv(bufs.recv_wr(slot)).unwrap();
                    }
                    let Ok(qp) = req.accept(prepared, &ConnParams::default(), &[]) else {
                        return;
                    };
                    serve(&qp, &cq, &mut bufs, &mr, &f);
                }));
            }
            for c in conns {
                let _ = c.join();
            }
        });
        FakeTarget {
            url,
            first,
            garbage,
            sent,
            admitted,
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for FakeTarget {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // The accept loop waits for a connection: give it one to notice the stop.
        let _ = std::net::TcpStream::connect(self.url.trim_start_matches("tcp://"));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// What the connections share with the test.
#[derive(Clone)]
struct Flags {
    first: Arc<AtomicU8>,
    garbage: Arc<AtomicBool>,
    sent: Arc<AtomicBool>,
    admitted: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
}

/// One connection: the Connect answered with the namespace, KeepAlives echoed, the garbage sent
/// when asked, until the host's Disconnect, the connection's end or the stop.
fn serve(
    qp: &QueuePair,
    cq: &rpma_common::fabric::CompletionQueue,
    bufs: &mut MsgBufs,
    mr: &MemoryRegion,
    f: &Flags,
) {
    let mut wcs = [Completion::EMPTY; 16];
    let mut buf = Vec::new();
    let mut open = false;
    let mut mode = HONEST;
    let mut last_stray = Instant::now();
    while !f.stop.load(Ordering::SeqCst) {
        if mode == STRAY_ANSWERS && last_stray.elapsed() >= Duration::from_millis(20) {
            last_stray = Instant::now();
            let stray = FlushResponse {
                token: 0,
                status: FlushStatus::Durable,
            };
            let _ = bufs.send(qp, &stray.encode());
        }
        if open && f.garbage.swap(false, Ordering::SeqCst) {
            let garbage = match mode {
                FORGED_ANSWER => Message::FlushResponse(FlushResponse {
                    token: 1,
                    status: FlushStatus::Durable,
                })
                .encode()
                .unwrap(),
                FORGED_ECHO => Message::KeepAlive(KeepAlive { seq: u64::MAX })
                    .encode()
                    .unwrap(),
                // A well-formed header of a message type no target sends (nor any version
                // knows).
                _ => vec![PROTO_VERSION, 0xEE, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8],
            };
            bufs.send(qp, &garbage).unwrap();
            f.sent.store(true, Ordering::SeqCst);
        }
        let Ok(n) = cq.wait(&mut wcs, Some(Duration::from_millis(20))) else {
            return;
        };
        for c in &wcs[..n] {
            if c.wr_id & CONTROL_BIT == 0 {
                continue;
            }
            if c.wr_id & SEND_BIT != 0 {
                let _ = bufs.on_send_done(qp, c.wr_id);
                continue;
            }
            let Some(slot) = bufs.take(c, &mut buf) else {
                return;
            };
            let _ = qp.post_recv(bufs.recv_wr(slot));
            let answer = match Message::decode(&buf) {
                Ok(Message::Connect(_)) if f.first.load(Ordering::SeqCst) == BAD_REFUSAL => {
                    Message::Refusal(rpma_common::proto::Refusal {
                        reason: rpma_common::proto::RefusalReason::HostNotAllowed,
                        message: HOSTILE_TEXT.into(),
                    })
                }
                Ok(Message::Connect(_)) => {
                    open = true;
                    if f.admitted.fetch_add(1, Ordering::SeqCst) == 0 {
                        mode = f.first.load(Ordering::SeqCst);
                    }
                    Message::ConnectResponse(ConnectResponse {
                        controller_id: 1,
                        keep_alive_ms: 60_000,
                        namespaces: vec![match mode {
                            BAD_ADDRESS => NamespaceDescriptor {
                                remote_addr: u64::MAX - 4095,
                                ..descriptor(mr)
                            },
                            BAD_TEXT => NamespaceDescriptor {
                                nsid: 2,
                                unavailable: Some(HOSTILE_TEXT.into()),
                                ..descriptor(mr)
                            },
                            _ => descriptor(mr),
                        }],
                        queue_depth: 8,
                        namespace_count: match mode {
                            EMPTY_PAGES => 3,
                            COUNTLESS => u32::MAX,
                            PAGED => 2,
                            _ => 1,
                        },
                    })
                }
                Ok(Message::NamespacesRequest(r)) => Message::NamespacesResponse(match mode {
                    PAGED if r.start == 1 => NamespacesResponse {
                        namespaces: vec![NamespaceDescriptor {
                            nsid: 2,
                            ..descriptor(mr)
                        }],
                        total: 2,
                    },
                    _ => NamespacesResponse {
                        namespaces: Vec::new(),
                        total: if mode == COUNTLESS { u32::MAX } else { 3 },
                    },
                }),
                Ok(Message::KeepAlive(k)) => Message::KeepAlive(k),
                Ok(Message::FlushRequest(r)) if mode == HONEST || mode == FORGED_ECHO => {
                    Message::FlushResponse(FlushResponse {
                        token: r.token,
                        status: FlushStatus::Durable,
                    })
                }
                Ok(Message::FlushRequest(_)) if mode == BAD_TEXT => {
                    Message::Disconnect(rpma_common::proto::Disconnect {
                        reason: HOSTILE_TEXT.into(),
                    })
                }
                Ok(Message::FlushRequest(_)) => continue,
                _ => return,
            };
            let _ = bufs.send(qp, &answer.encode().unwrap());
        }
    }
}

fn descriptor(mr: &MemoryRegion) -> NamespaceDescriptor {
    NamespaceDescriptor {
        nsid: 1,
        size: SIZE as u64,
        block_size: 512,
        remote_addr: mr.addr(),
        rkey: mr.rkey(),
        // Served from memory: "durable" here is what the fake target says, which is the point.
        domain: PersistenceDomain::PageCache,
        durability: DurabilityMethods::GPSPM,
        atomic_write_unit: 0,
        read_only: false,
        failure: None,
        simulation: None,
        unavailable: None,
        // The same file across the reconnects the tests wait for.
        identity: 1,
    }
}

/// A queue on the fake target (nothing retried for long: the tests wait for one reconnect).
fn queue(t: &FakeTarget) -> rpma_initiator::Queue {
    Connection::new(
        &t.url,
        Nqn::new(SUB).unwrap(),
        HostIdentity::new(Nqn::new(HOST).unwrap()),
    )
    .with_connect_options(ConnectOptions {
        timeout: Duration::from_secs(5),
        ..ConnectOptions::default()
    })
    .with_queue_options(QueueOptions {
        depth: 8,
        chunk: 4096,
        reconnect: ReconnectPolicy::within(Duration::from_secs(20)),
        ..QueueOptions::default()
    })
    .open_queue(0)
    .unwrap()
}

/// Tells the first connection to send its garbage, and waits until it is in the host's socket.
fn send_garbage(t: &FakeTarget) {
    t.garbage.store(true, Ordering::SeqCst);
    let deadline = Instant::now() + Duration::from_secs(20);
    while !t.sent.load(Ordering::SeqCst) {
        assert!(Instant::now() < deadline, "the garbage was not sent");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A session with the fake target (its Connect answered, or refused).
fn session(t: &FakeTarget) -> rpma_initiator::Result<rpma_initiator::Session> {
    let opts = ConnectOptions {
        timeout: Duration::from_secs(5),
        ..ConnectOptions::default()
    };
    let host = HostIdentity::new(Nqn::new(HOST).unwrap());
    connect(&t.url, &Nqn::new(SUB).unwrap(), &host, &opts)
}

/// A control message this host cannot decode arrives while a batch of Reads is in flight: the
/// call gives the connection up as lost (and retires it: the target did not close it),
/// reconnects and reads again; the next calls read what they asked for. (The call failed with
/// the decode error and left its Reads behind, in flight or done: the next batch took their
/// bytes for its own, from the wrong offsets, or panicked on an index out of its range, and a
/// write that needed a slot spun for ever.)
#[test]
fn a_control_message_the_host_cannot_decode_loses_the_connection_and_nothing_else() {
    let t = FakeTarget::start();
    let mut q = queue(&t);
    let want = pattern(77, SIZE);
    // In the host's socket now, taken in by its next poll: the batch's.
    send_garbage(&t);
    let mut ns = q.namespace(1).unwrap();
    let mut bufs = vec![vec![0u8; 4096]; 6];
    let at = [0u64, 65536, 131072, 196608, 262144, 327680];
    {
        let mut items: Vec<(u64, &mut [u8])> = at
            .iter()
            .zip(bufs.iter_mut())
            .map(|(o, b)| (*o, b.as_mut_slice()))
            .collect();
        ns.read_batch(&mut items).unwrap();
    }
    for (o, b) in at.iter().zip(&bufs) {
        assert!(b[..] == want[*o as usize..*o as usize + 4096], "offset {o}");
    }
    assert_eq!(t.admitted.load(Ordering::SeqCst), 2, "reconnected once");
    // The next batches read their own offsets.
    for round in 0..20u64 {
        let mut one = vec![0u8; 512];
        let o = 4096 * (100 + round);
        ns.read_at(o, &mut one).unwrap();
        assert!(one[..] == want[o as usize..o as usize + 512], "offset {o}");
    }
    // And writes find slots.
    let data = pattern(5, 16 * 4096);
    ns.write_at(512 << 10, &data).unwrap();
    let mut back = vec![0u8; data.len()];
    ns.read_at(512 << 10, &mut back).unwrap();
    assert!(back == data);
}

/// An answer to a FlushRequest the host has not sent yet (the tokens are 1, 2, 3...) is a
/// broken protocol, not an answer kept for later: the durable write it would have acknowledged
/// is made durable on the next connection, by an answer to a request the target received.
/// (Before, the forged answer waited in the queue and acknowledged the first GPSPM write as
/// durable though the target had never seen its request.)
#[test]
fn an_answer_to_a_flush_request_never_sent_loses_the_connection_and_acknowledges_nothing() {
    let t = FakeTarget::start();
    t.first.store(FORGED_ANSWER, Ordering::SeqCst);
    let mut q = queue(&t);
    let mut ns = q.namespace(1).unwrap();
    send_garbage(&t);
    // Taken in by a Read (the answer arrives before the Read Response).
    let want = pattern(77, SIZE);
    let mut one = vec![0u8; 512];
    ns.read_at(0, &mut one).unwrap();
    assert!(one[..] == want[..512]);
    let data = pattern(9, 4096);
    let d = ns.write_durable(8192, &data).unwrap();
    assert!(matches!(d, Durability::Durable(_)), "{d:?}");
    assert_eq!(
        t.admitted.load(Ordering::SeqCst),
        2,
        "the write was acknowledged on the connection that forged an answer"
    );
    let mut back = vec![0u8; 4096];
    ns.read_at(8192, &mut back).unwrap();
    assert!(back == data);
}

/// An echo of a KeepAlive the host never sent (which would mark every Write posted so far as
/// placed, for the ordering across queues) loses the connection; the call reconnects and is
/// served.
#[test]
fn an_echo_of_a_keep_alive_never_sent_loses_the_connection() {
    let t = FakeTarget::start();
    t.first.store(FORGED_ECHO, Ordering::SeqCst);
    let mut q = queue(&t);
    let mut ns = q.namespace(1).unwrap();
    send_garbage(&t);
    let want = pattern(77, SIZE);
    let mut one = vec![0u8; 512];
    ns.read_at(4096, &mut one).unwrap();
    assert!(one[..] == want[4096..4096 + 512]);
    let data = pattern(3, 4096);
    ns.write_durable(SIZE as u64 / 2, &data).unwrap();
    assert_eq!(
        t.admitted.load(Ordering::SeqCst),
        2,
        "the forged echo was taken as an answer"
    );
}

/// `Session::flush` waits at most its time-out in all, however many answers to other requests
/// the target sends meanwhile. (Before, each one started the wait again: a target answering old
/// tokens every 20 ms kept the call waiting for ever.)
#[test]
fn stray_answers_do_not_extend_a_flush_beyond_its_time_out() {
    let t = FakeTarget::start();
    t.first.store(STRAY_ANSWERS, Ordering::SeqCst);
    let mut s = session(&t).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let waiter = std::thread::spawn(move || {
        let r = s.flush(1, 0, 4096, Duration::from_millis(300));
        let _ = tx.send(r);
        s
    });
    let r = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("Session::flush did not return within 20 s (its time-out: 300 ms)");
    assert!(matches!(r, Err(Error::Timeout { .. })), "{r:?}");
    drop(waiter.join().unwrap());
}

/// A namespace described past the end of the address space (an address and a size whose sum
/// overflows) is unavailable, said why: no request goes to a wrapped address. (A write to it
/// panicked "attempt to add with overflow" in a debug build.)
#[test]
fn a_namespace_described_past_the_end_of_the_address_space_is_unavailable() {
    let t = FakeTarget::start();
    t.first.store(BAD_ADDRESS, Ordering::SeqCst);
    let mut q = queue(&t);
    match q.namespace(1) {
        Err(Error::NamespaceUnavailable { nsid: 1, reason }) => {
            assert!(
                reason.contains("past the end of the address space"),
                "{reason}"
            )
        }
        Err(e) => panic!("another error: {e}"),
        Ok(mut ns) => {
            let r = ns.write_at(8192, &[1; 4096]);
            panic!("the namespace was served: {r:?}");
        }
    }
}

/// A ConnectResponse that lists fewer namespaces than it says the session has: the host asks
/// for the rest and is given them (a page with nsid 2); a target whose
/// pages bring none, or that says it has more than a host reads, fails the connect with a
/// Listing error that says why, instead of leaving the host asking for ever or serving a
/// listing that does not add up.
#[test]
fn a_namespace_listing_in_pages_is_read_whole_or_refused() {
    let t = FakeTarget::start();
    t.first.store(PAGED, Ordering::SeqCst);
    let s = session(&t).unwrap();
    let nsids: Vec<u32> = s.namespaces().iter().map(|d| d.nsid).collect();
    assert_eq!(nsids, [1, 2]);
    drop(s);

    for (mode, said) in [
        (EMPTY_PAGES, "the page from entry 1 of 3 brought none"),
        (
            COUNTLESS,
            "it has 4294967295 entries, more than the 65536 a host reads",
        ),
    ] {
        let t = FakeTarget::start();
        t.first.store(mode, Ordering::SeqCst);
        match session(&t) {
            Err(Error::Listing { what, why }) => {
                assert_eq!(what, "namespace");
                assert!(why.contains(said), "{why}");
            }
            // (A target left unanswered would end in Error::Timeout instead.)
            other => panic!("{other:?}"),
        }
    }
}

/// Text a target writes (a refusal's message, a Disconnect's reason, why a namespace is
/// unavailable) reaches the caller's errors escaped: no line break, no terminal escape, no
/// reordering character, so that it can neither forge a line of the caller's log nor drive its
/// terminal. (It was shown as the target wrote it.)
#[test]
fn text_a_target_writes_is_shown_escaped() {
    let clean = |what: &str, shown: String| {
        assert!(
            !shown.contains(['\n', '\u{1b}', '\u{202e}']),
            "{what}: {shown:?}"
        );
        assert!(shown.contains("forged"), "{what}: {shown:?}");
    };
    let t = FakeTarget::start();
    t.first.store(BAD_REFUSAL, Ordering::SeqCst);
    let e = session(&t).unwrap_err();
    assert!(matches!(e, Error::HostNotAllowed { .. }), "{e:?}");
    clean("the refusal", e.to_string());
    drop(t);

    let t = FakeTarget::start();
    t.first.store(BAD_TEXT, Ordering::SeqCst);
    let mut s = session(&t).unwrap();
    let why = s
        .namespaces()
        .iter()
        .find(|d| d.nsid == 2)
        .and_then(|d| d.unavailable.clone())
        .expect("namespace 2 is unavailable");
    clean("why namespace 2 is unavailable", why);
    let e = s.flush(2, 0, 4096, Duration::from_secs(5)).unwrap_err();
    assert!(matches!(e, Error::Disconnected { .. }), "{e:?}");
    clean("the Disconnect", e.to_string());
}
