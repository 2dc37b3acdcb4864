use super::*;

fn get(addr: SocketAddr, request: &[u8]) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(request).unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out
}

fn far() -> Instant {
    Instant::now() + Duration::from_secs(60)
}

fn server() -> MetricsServer {
    let page: PageFn = Arc::new(|| "# HELP x_total y\n# TYPE x_total counter\nx_total 1\n".into());
    MetricsServer::bind("127.0.0.1:0".parse().unwrap(), page).unwrap()
}

#[test]
fn request_lines_are_sorted_into_metrics_404_405_and_400() {
    assert_eq!(parse(b"GET /metrics HTTP/1.1\r\nHost: x"), Request::Metrics);
    assert_eq!(parse(b"GET /metrics?name[]=up HTTP/1.0"), Request::Metrics);
    assert_eq!(parse(b"GET / HTTP/1.1"), Request::NotFound);
    assert_eq!(parse(b"GET /metrics/x HTTP/1.1"), Request::NotFound);
    assert_eq!(parse(b"POST /metrics HTTP/1.1"), Request::MethodNotAllowed);
    assert_eq!(parse(b"HEAD /metrics HTTP/1.1"), Request::MethodNotAllowed);
    assert_eq!(parse(b"get /metrics HTTP/1.1"), Request::Bad);
    assert_eq!(parse(b"GET /metrics HTTP/2"), Request::Bad);
    assert_eq!(parse(b"GET /metrics"), Request::Bad);
    assert_eq!(parse(b"GET  /metrics HTTP/1.1"), Request::Bad);
    assert_eq!(parse(b"GET /metrics HTTP/1.1 extra"), Request::Bad);
    assert_eq!(parse(b"\xff\xfe garbage"), Request::Bad);
    assert_eq!(parse(b""), Request::Bad);
}

/// Hands out its bytes a few at a time.
struct Trickle(Vec<u8>, usize);
impl Read for Trickle {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.1.min(buf.len()).min(self.0.len());
        buf[..n].copy_from_slice(&self.0[..n]);
        self.0.drain(..n);
        Ok(n)
    }
}

#[test]
fn heads_are_read_across_reads_and_bounded() {
    let req = b"GET /metrics HTTP/1.1\r\nHost: a\r\n\r\nbody".to_vec();
    for step in [1, 2, 3, 5, 1024] {
        let got = read_head(&mut Trickle(req.clone(), step), far(), |_| {}).unwrap();
        assert_eq!(got, b"GET /metrics HTTP/1.1\r\nHost: a", "step {step}");
    }
    let huge = [
        b"GET /metrics HTTP/1.1\r\nX: ".as_slice(),
        &[b'a'; MAX_REQUEST],
    ]
    .concat();
    assert_eq!(
        read_head(&mut Trickle(huge, 1000), far(), |_| {}),
        Err(NoHead::Refuse("431 Request Header Fields Too Large"))
    );
    assert_eq!(
        read_head(&mut Trickle(b"GET / HTT".to_vec(), 4), far(), |_| {}),
        Err(NoHead::Gone),
        "closed before the head ended"
    );
}

#[test]
fn serves_get_metrics_and_refuses_the_rest() {
    let s = server();
    let addr = s.local_addr();
    assert_ne!(addr.port(), 0);
    let ok = get(addr, b"GET /metrics HTTP/1.1\r\nHost: t\r\n\r\n");
    assert!(ok.starts_with("HTTP/1.1 200 OK\r\n"), "{ok}");
    assert!(
        ok.contains("Content-Type: text/plain; version=0.0.4"),
        "{ok}"
    );
    assert!(ok.contains("Connection: close"), "{ok}");
    assert!(ok.ends_with("\r\n\r\n# HELP x_total y\n# TYPE x_total counter\nx_total 1\n"));
    let post = get(
        addr,
        b"POST /metrics HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello",
    );
    assert!(post.starts_with("HTTP/1.1 405 "), "{post}");
    assert!(post.contains("Allow: GET"), "{post}");
    assert!(get(addr, b"GET /other HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 404 "));
    assert!(get(addr, b"\x16\x03\x01 not http\r\n\r\n").starts_with("HTTP/1.1 400 "));
}

/// Waits until the server serves `n` connections.
fn serving(s: &MetricsServer, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while s.serving() != n {
        assert!(Instant::now() < deadline, "serving {} not {n}", s.serving());
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn silent_clients_make_room_for_a_scrape_oldest_first() {
    let s = server();
    let addr = s.local_addr();
    // Connections that send nothing hold every place this address may have...
    let mut silent: Vec<TcpStream> = (0..MAX_PER_SOURCE)
        .map(|_| TcpStream::connect(addr).unwrap())
        .collect();
    serving(&s, MAX_PER_SOURCE);
    // ...and a scrape from the same address still gets in, in the oldest one's place.
    let ok = get(addr, b"GET /metrics HTTP/1.1\r\n\r\n");
    assert!(ok.starts_with("HTTP/1.1 200 "), "{ok}");
    let mut b = [0u8; 16];
    silent[0]
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    assert!(
        matches!(silent[0].read(&mut b), Ok(0) | Err(_)),
        "the oldest was closed"
    );
    silent[1]
        .set_read_timeout(Some(Duration::from_millis(50)))
        .unwrap();
    assert!(
        matches!(silent[1].read(&mut b), Err(e) if e.kind() == ErrorKind::WouldBlock),
        "the next one is still served"
    );
    assert_eq!(s.slots.lock().evicted, 1);
    drop(silent);
    serving(&s, 0);
}

#[test]
fn places_taken_by_answers_are_not_evicted() {
    let slots = Slots::default();
    let a: IpAddr = "192.0.2.1".parse().unwrap();
    let b: IpAddr = "192.0.2.2".parse().unwrap();
    let mine: Vec<u64> = (0..MAX_PER_SOURCE)
        .map(|_| slots.take(a, None).unwrap())
        .collect();
    for &m in &mine {
        assert!(slots.set(m, Phase::Answering));
    }
    // Every place of a's is answering: a's newcomer is turned away...
    assert_eq!(slots.take(a, None), None);
    // ...until one is done.
    assert!(slots.set(mine[2], Phase::Closing));
    let n = slots.take(a, None).unwrap();
    assert!(!slots.set(mine[2], Phase::Answering), "evicted");
    assert!(slots.set(n, Phase::Answering));
    // Another address fills the rest; then the pool's oldest evictable goes: b's first.
    let bs: Vec<u64> = (0..MAX_SCRAPERS - MAX_PER_SOURCE)
        .map(|_| slots.take(b, None).unwrap())
        .collect();
    let c: IpAddr = "192.0.2.3".parse().unwrap();
    slots.take(c, None).unwrap();
    assert!(!slots.set(bs[0], Phase::Reading), "b's oldest made room");
    assert!(slots.set(bs[1], Phase::Reading));
    assert_eq!(slots.lock().evicted, 2);
}

/// An answer being written gives its place up to a newcomer, first of all once its write has
/// stalled (a client that asks and never reads held its place until WRITE_DEADLINE: with its
/// address's places so held, the scraper got 503); a moving one goes after those still
/// sending their request (a real scrape over a slow link is the last to go).
#[test]
fn places_of_answers_being_written_are_taken_stalled_first() {
    let slots = Slots::default();
    let a: IpAddr = "192.0.2.1".parse().unwrap();
    let writing = |stalled| Phase::Writing { stalled };
    let mine: Vec<u64> = (0..MAX_PER_SOURCE)
        .map(|_| slots.take(a, None).unwrap())
        .collect();
    assert!(slots.set(mine[0], writing(false)));
    assert!(slots.set(mine[2], writing(true)));
    assert!(slots.set(mine[3], writing(false)));
    let n = slots.take(a, None).unwrap();
    assert!(
        !slots.set(mine[2], Phase::Answering),
        "the stalled one went first"
    );
    assert!(slots.set(n, Phase::Answering));
    // mine[1] has been sending its request for longer than a real scrape's takes.
    slots.lock().held.get_mut(&mine[1]).unwrap().since -= WRITE_STALL;
    let m = slots.take(a, None).unwrap();
    assert!(
        !slots.set(mine[1], Phase::Answering),
        "then the oldest still sending its request for WRITE_STALL"
    );
    assert!(slots.set(m, Phase::Answering));
    // A newcomer that is still sending (its request on its way) keeps its place over one
    // being written to.
    let fresh = slots.take(a, None).unwrap();
    keep_fresh(&slots, fresh);
    assert!(
        !slots.set(mine[0], Phase::Answering),
        "then the oldest being written to"
    );
    slots.take(a, None).unwrap();
    assert!(!slots.set(mine[3], Phase::Answering), "and the next one");
    assert!(slots.set(fresh, Phase::Reading), "the fresh sender stays");
    assert!(slots.set(n, Phase::Answering) && slots.set(m, Phase::Answering));
}

/// Makes `serial` count as connected within WRITE_STALL however long the test takes (a
/// loaded machine may run it for longer than that).
fn keep_fresh(slots: &Slots, serial: u64) {
    slots.lock().held.get_mut(&serial).unwrap().since = Instant::now() + Duration::from_secs(3600);
}

/// A scrape that has connected and whose request is on its way keeps its place over answers
/// being written to non-readers whose writes have not stalled yet: on a busy machine such a
/// scrape was closed for a non-reader's reconnect (the scrape got no answer at all).
#[test]
fn a_scrape_whose_request_is_on_its_way_outlasts_answers_being_written() {
    let slots = Slots::default();
    let a: IpAddr = "192.0.2.1".parse().unwrap();
    let writers: Vec<u64> = (0..MAX_PER_SOURCE - 1)
        .map(|_| slots.take(a, None).unwrap())
        .collect();
    for &w in &writers {
        assert!(slots.set(w, Phase::Writing { stalled: false }));
    }
    let scrape = slots.take(a, None).unwrap();
    keep_fresh(&slots, scrape);
    for i in 0..3 {
        let newcomer = slots.take(a, None).unwrap();
        assert!(
            slots.set(scrape, Phase::Reading),
            "round {i}: the scrape stays"
        );
        assert!(slots.set(newcomer, Phase::Writing { stalled: false }));
    }
}

/// A connection whose whole request waits to be read (its thread has not run yet) keeps its
/// place: a real scrape on a busy machine is not closed for a newcomer; a trickle is.
#[test]
fn a_request_that_arrived_whole_keeps_its_place() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let slots = Slots::default();
    let a: IpAddr = "192.0.2.1".parse().unwrap();
    let mut clients = Vec::new();
    let mut mine = Vec::new();
    for i in 0..MAX_PER_SOURCE {
        let mut c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (conn, _) = l.accept().unwrap();
        let sent: &[u8] = match i {
            0 | 2 => b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n",
            _ => b"GET /metrics HTTP/1.1\r\nHo",
        };
        c.write_all(sent).unwrap();
        clients.push(c);
        mine.push(slots.take(a, Some(conn)).unwrap());
    }
    // The bytes are there before they are looked at.
    let until = Instant::now() + Duration::from_secs(30);
    while !slots
        .lock()
        .held
        .values()
        .filter_map(|h| h.sock.as_ref())
        .filter(|s| head_waits(s))
        .count()
        .eq(&2)
    {
        assert!(Instant::now() < until, "the requests arrived");
        std::thread::sleep(Duration::from_millis(10));
    }
    slots.take(a, None).unwrap();
    assert!(slots.set(mine[0], Phase::Reading), "whole: kept");
    assert!(
        !slots.set(mine[1], Phase::Reading),
        "the oldest trickle went"
    );
    slots.take(a, None).unwrap();
    assert!(!slots.set(mine[3], Phase::Reading), "then the next");
}

/// The write says when it stalls and when it moves again, and gives up when told to.
#[test]
fn a_write_that_makes_no_progress_says_so() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (mut conn, _) = l.accept().unwrap();
    let mut said = Vec::new();
    // Nobody reads: it stalls, is told its place is gone, and gives up.
    let r = write_within(&mut conn, &vec![7u8; 64 << 20], WRITE_DEADLINE, |s| {
        said.push(s);
        false
    });
    assert_eq!(r.map_err(|e| e.kind()), Err(ErrorKind::ConnectionAborted));
    assert_eq!(said, [true]);
    drop(c);
}

#[test]
fn dropping_the_server_closes_the_port() {
    let s = server();
    let addr = s.local_addr();
    drop(s);
    assert!(
        TcpStream::connect(addr).is_err(),
        "nothing listens after drop"
    );
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let page: PageFn = Arc::new(String::new);
    let err = MetricsServer::bind(taken.local_addr().unwrap(), page).unwrap_err();
    assert!(matches!(err, ListenerError::Bind { .. }), "{err}");
}

/// A client that reads a little now and then cannot stretch an answer past the deadline (a
/// socket write timeout alone bounds each send, not the answer).
#[test]
fn a_slow_reader_does_not_stretch_an_answer_past_the_deadline() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let stop2 = Arc::clone(&stop);
    let reader = std::thread::spawn(move || {
        let mut c = TcpStream::connect(addr).unwrap();
        let mut b = [0u8; 4096];
        // 4 KiB every 20 ms: progress, but far slower than the answer needs.
        while let Ok(n) = c.read(&mut b) {
            if n == 0 || stop2.load(Ordering::Relaxed) {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    });
    let (mut conn, _) = l.accept().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let t = Instant::now();
        let r = write_within(
            &mut conn,
            &vec![7u8; 256 << 20],
            Duration::from_millis(500),
            |_| true,
        );
        let _ = tx.send((r.map_err(|e| e.kind()), t.elapsed()));
    });
    let (r, took) = rx
        .recv_timeout(Duration::from_secs(10))
        .expect("the write gave up within its deadline");
    assert_eq!(r, Err(ErrorKind::TimedOut));
    assert!(took < Duration::from_secs(3), "{took:?}");
    stop.store(true, Ordering::Relaxed);
    reader.join().unwrap();
}

/// Dropping the listener returns though no connection can reach it (here: its network's
/// loopback taken down; a firewall that drops the daemon's own connections, an address
/// removed, do the same). Before, it woke its accept thread with a connection of its own and
/// waited for that thread for ever: the daemon's stop hung, and so did a reload that moved
/// `metrics_listen`. In a network namespace of its own (root only: said and passed otherwise).
#[test]
fn dropping_the_listener_returns_when_no_connection_can_reach_it() {
    let r = std::thread::spawn(|| {
        // SAFETY: unshare(2) takes no pointers; CLONE_NEWNET moves only this thread (and what
        // it starts from now on) into a network namespace of its own.
        if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
            eprintln!(
                "not run: unshare(CLONE_NEWNET): {}",
                std::io::Error::last_os_error()
            );
            return;
        }
        let ip = |args: &[&str]| {
            let s = std::process::Command::new("ip").args(args).status();
            assert!(s.as_ref().is_ok_and(|s| s.success()), "ip {args:?}: {s:?}");
        };
        ip(&["link", "set", "lo", "up"]);
        let s = server();
        assert!(get(s.local_addr(), b"GET /metrics HTTP/1.0\r\n\r\n").contains("x_total 1"));
        ip(&["link", "set", "lo", "down"]);
        assert!(TcpStream::connect_timeout(&s.local_addr(), Duration::from_secs(2)).is_err());
        let (done, dropped) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            drop(s);
            let _ = done.send(());
        });
        assert!(
            dropped.recv_timeout(Duration::from_secs(30)).is_ok(),
            "the drop waited for its accept thread"
        );
    })
    .join();
    assert!(r.is_ok());
}
