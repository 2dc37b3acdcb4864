//! The metrics listener: HTTP/1.x on a TCP address of its own, answering only `GET /metrics`.
//!
//! Bounded like every other listener, so that a slow or hostile scraper can neither hold the
//! daemon, grow its memory, nor keep a real scraper out (issue 22, F3):
//! - at most [`MAX_SCRAPERS`] connections are served at once, each on a thread of its own, and
//!   at most [`MAX_PER_SOURCE`] of them from one source address;
//! - a newcomer takes the place of an unfinished one the way the target's admission pools do:
//!   if its address holds its cap, one of that address's connections is closed for it; if all
//!   places are taken, one of any address. First the oldest that is done (lingering to close)
//!   or whose answer's write has made no progress for [`WRITE_STALL`] (a client that asked and
//!   does not read); failing those, the oldest still sending its request after
//!   [`WRITE_STALL`], then the oldest being written to, then the oldest still sending its
//!   request that connected within [`WRITE_STALL`] (a real scrape whose request is on its way).
//!   Only when every place it could take is rendering an answer, or holds a whole request its
//!   thread has yet to read, is it turned away (503), and answers are bounded by
//!   [`WRITE_DEADLINE`]. So trickling or non-reading connections, from
//!   any address or the scraper's own, cannot keep a real scrape out: its request arrives in
//!   one packet, its answer leaves at once (into the socket's buffers), and it is the newest;
//! - the whole request has one deadline: its head must arrive within [`REQUEST_DEADLINE`] of
//!   the accept (a slowloris is cut off there with a 408, however it trickles), and may be at
//!   most [`MAX_REQUEST`] bytes (431 past it); nothing after the head is read;
//! - the answer must leave within [`WRITE_DEADLINE`]; then the connection is closed
//!   (`Connection: close`: one request per connection).
//!
//! Anything but `GET` is answered 405 (with `Allow: GET`), any path but `/metrics` (a query
//! string is ignored) 404, a request line that is not HTTP/1.x 400. The page itself comes from
//! the handler given to [`MetricsServer::bind`], called once per scrape.

use std::collections::BTreeMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Connections served at once.
pub const MAX_SCRAPERS: usize = 8;
/// Connections served at once from one source address.
pub const MAX_PER_SOURCE: usize = 4;
/// Threads (served connections and those closing after an eviction) at most: past it a
/// newcomer is turned away rather than given a thread.
const MAX_THREADS: usize = 2 * MAX_SCRAPERS;
/// Largest request head (request line and headers).
pub const MAX_REQUEST: usize = 8192;
/// How long a client has to send its whole request head.
pub const REQUEST_DEADLINE: Duration = Duration::from_secs(5);
/// How long the answer may take to leave.
pub const WRITE_DEADLINE: Duration = Duration::from_secs(5);
/// How long an answer's write may make no progress before its place is the first a newcomer
/// takes.
pub const WRITE_STALL: Duration = Duration::from_millis(200);

/// Errors of the metrics listener.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ListenerError {
    /// The address could not be bound.
    #[error("cannot listen for metrics on {addr}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The accept thread could not start.
    #[error("cannot start the metrics thread")]
    Thread(#[source] std::io::Error),
}

/// Renders the page for one scrape.
pub type PageFn = Arc<dyn Fn() -> String + Send + Sync>;

/// A bound metrics listener: its accept thread runs until this is dropped.
pub struct MetricsServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    /// The listening socket, to wake the blocking accept with (a shutdown makes it fail).
    waker: TcpListener,
    slots: Arc<Slots>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for MetricsServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetricsServer")
            .field("addr", &self.addr)
            .finish()
    }
}

impl MetricsServer {
    /// Listens on `addr` and serves `page` at /metrics. When this returns, connections are
    /// accepted.
    ///
    /// # Errors
    /// [`ListenerError::Bind`], [`ListenerError::Thread`].
    pub fn bind(addr: SocketAddr, page: PageFn) -> Result<MetricsServer, ListenerError> {
        let bind_err = |source| ListenerError::Bind { addr, source };
        let listener = TcpListener::bind(addr).map_err(bind_err)?;
        let local = listener.local_addr().map_err(bind_err)?;
        let waker = listener.try_clone().map_err(bind_err)?;
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = Arc::clone(&stop);
        let slots = Arc::new(Slots::default());
        let slots2 = Arc::clone(&slots);
        let thread = std::thread::Builder::new()
            .name("rpma-metrics".into())
            .spawn(move || accept_loop(listener, stop2, slots2, page))
            .map_err(ListenerError::Thread)?;
        Ok(MetricsServer {
            addr: local,
            stop,
            waker,
            slots,
            thread: Some(thread),
        })
    }

    /// The address it is bound to.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Connections being served now (a test waits for 0 before it counts on a free place).
    pub fn serving(&self) -> usize {
        self.slots.lock().held.len()
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Wake the blocking accept: shut down, the listening socket fails it. (A connection of
        // our own did, and never came where a firewall dropped it or the address was gone:
        // the join waited for ever, and so did the daemon's stop, or a reload moving the
        // listener.)
        let _ =
            nix::sys::socket::shutdown(self.waker.as_raw_fd(), nix::sys::socket::Shutdown::Both);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Where a served connection is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Its request head is being read: a newcomer may take its place.
    Reading,
    /// The answer is being rendered: not evictable.
    Answering,
    /// The answer is being written (bounded by [`WRITE_DEADLINE`]): evictable, with those
    /// reading; first of all once its write has made no progress for [`WRITE_STALL`]
    /// (`stalled`), so that clients that ask and never read cannot keep the places.
    Writing { stalled: bool },
    /// The answer is out; the connection lingers to close cleanly: evictable.
    Closing,
}

/// One served connection.
#[derive(Debug)]
struct Held {
    source: IpAddr,
    phase: Phase,
    /// When it was accepted: one still sending its request after [`WRITE_STALL`] is slow or
    /// silent; before, it is a real scrape as likely as not (its request is on the way).
    since: Instant,
    /// To close it from the accept thread (its own thread then sees its socket end).
    sock: Option<TcpStream>,
}

#[derive(Debug, Default)]
struct Places {
    /// By serial: the first is the oldest.
    held: BTreeMap<u64, Held>,
    next: u64,
    /// Evicted since start.
    evicted: u64,
}

/// The places of the connections being served, and the threads serving them.
#[derive(Debug, Default)]
struct Slots {
    places: Mutex<Places>,
    threads: AtomicUsize,
}

impl Slots {
    fn lock(&self) -> std::sync::MutexGuard<'_, Places> {
        self.places.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A place for a connection from `source` (`sock` a handle to close it by), evicting an
    /// unfinished one if it must: its serial, or None (turn it away).
    fn take(&self, source: IpAddr, sock: Option<TcpStream>) -> Option<u64> {
        let source = source.to_canonical();
        if self.threads.load(Ordering::Acquire) >= MAX_THREADS {
            return None;
        }
        let mut p = self.lock();
        // First the oldest done (closing) or not read (its answer's write stalled); failing
        // those, the oldest still sending its request for WRITE_STALL or more (slow or
        // silent); then the oldest being written to (a real scrape over a slow link); then the
        // oldest that connected within WRITE_STALL and is still sending (a real scrape whose
        // request is on its way: evicted before those being written, it lost its place to a
        // non-reader's reconnect on a busy machine); never one whose answer is being rendered,
        // or whose whole request waits to be read (its thread has not run yet: a real scrape
        // on a busy machine). A newcomer is the newest: it goes last.
        let now = Instant::now();
        let idle = |h: &Held| match h.phase {
            Phase::Closing | Phase::Writing { stalled: true } => true,
            Phase::Reading | Phase::Answering | Phase::Writing { stalled: false } => false,
        };
        let sending = |h: &Held| match h.phase {
            Phase::Reading => !h.sock.as_ref().is_some_and(head_waits),
            Phase::Writing { .. } | Phase::Answering | Phase::Closing => false,
        };
        let slow = |h: &Held| sending(h) && now.duration_since(h.since) >= WRITE_STALL;
        let written = |h: &Held| matches!(h.phase, Phase::Writing { .. });
        let oldest = |p: &Places, of: &dyn Fn(&Held) -> bool| {
            let find = |f: &dyn Fn(&Held) -> bool| {
                p.held.iter().find(|(_, h)| of(h) && f(h)).map(|(&k, _)| k)
            };
            find(&idle)
                .or_else(|| find(&slow))
                .or_else(|| find(&written))
                .or_else(|| find(&sending))
        };
        let mine = p.held.values().filter(|h| h.source == source).count();
        let mut victim = None;
        if mine >= MAX_PER_SOURCE {
            victim = Some(oldest(&p, &|h| h.source == source)?);
        } else if p.held.len() >= MAX_SCRAPERS {
            victim = Some(oldest(&p, &|_| true)?);
        }
        if let Some(v) = victim {
            if let Some(h) = p.held.remove(&v) {
                p.evicted += 1;
                if let Some(s) = h.sock {
                    // Its thread's read or write fails now; it gives up and ends.
                    let _ = s.shutdown(Shutdown::Both);
                }
            }
        }
        let serial = p.next;
        p.next += 1;
        p.held.insert(
            serial,
            Held {
                source,
                phase: Phase::Reading,
                sock,
                since: now,
            },
        );
        Some(serial)
    }

    /// Moves `serial` on to `phase`; false if it was evicted meanwhile.
    fn set(&self, serial: u64, phase: Phase) -> bool {
        match self.lock().held.get_mut(&serial) {
            Some(h) => {
                h.phase = phase;
                true
            }
            None => false,
        }
    }

    fn release(&self, serial: u64) {
        self.lock().held.remove(&serial);
    }
}

/// A served connection's place and thread, given back when its thread ends.
struct Slot {
    slots: Arc<Slots>,
    serial: u64,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.slots.release(self.serial);
        self.slots.threads.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The listener's own warnings (accept failing, no thread), which clients can cause by
/// exhausting descriptors or threads: one a minute, with how many were held back.
#[derive(Debug, Default)]
struct Warnings {
    last: Option<Instant>,
    held_back: u64,
}

impl Warnings {
    const EVERY: Duration = Duration::from_secs(60);

    fn warn(&mut self, what: std::fmt::Arguments<'_>) {
        let now = Instant::now();
        if self
            .last
            .is_some_and(|t| now.duration_since(t) < Self::EVERY)
        {
            self.held_back += 1;
            log::debug!("metrics listener: {what}");
            return;
        }
        let more = match std::mem::take(&mut self.held_back) {
            0 => String::new(),
            n => format!(" ({n} more such warning(s) in the last minute)"),
        };
        log::warn!("metrics listener: {what}{more}");
        self.last = Some(now);
    }
}

fn accept_loop(listener: TcpListener, stop: Arc<AtomicBool>, slots: Arc<Slots>, page: PageFn) {
    let mut warnings = Warnings::default();
    for conn in listener.incoming() {
        if stop.load(Ordering::Acquire) {
            break;
        }
        let conn = match conn {
            Ok(c) => c,
            Err(e) => {
                // EMFILE and the like: say so, and do not spin on it.
                warnings.warn(format_args!("accept failed: {e}"));
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        let accepted = Instant::now();
        let source = conn
            .peer_addr()
            .map_or(IpAddr::from(std::net::Ipv4Addr::UNSPECIFIED), |a| a.ip());
        let Some(serial) = slots.take(source, conn.try_clone().ok()) else {
            busy(conn);
            continue;
        };
        slots.threads.fetch_add(1, Ordering::AcqRel);
        let slot = Slot {
            slots: Arc::clone(&slots),
            serial,
        };
        let page = Arc::clone(&page);
        let spawned = std::thread::Builder::new()
            .name("rpma-scrape".into())
            .spawn(move || serve(conn, &page, &slot, accepted));
        if let Err(e) = spawned {
            // The closure (and its slot) was dropped with the error.
            warnings.warn(format_args!("cannot start a thread: {e}"));
        }
    }
}

/// Over the limit: a 503 if the socket takes it at once, then close.
fn busy(conn: TcpStream) {
    let _ = conn.set_nonblocking(true);
    let _ = (&conn).write(&response(
        "503 Service Unavailable",
        &[("Retry-After", "1")],
        b"too many scrapers at once\n",
    ));
    let _ = conn.shutdown(Shutdown::Both);
}

fn response(status: &str, headers: &[(&str, &str)], body: &[u8]) -> Vec<u8> {
    let mut head = format!(
        "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n",
        body.len()
    );
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    if !headers.iter().any(|(k, _)| *k == "Content-Type") {
        head.push_str("Content-Type: text/plain; charset=utf-8\r\n");
    }
    head.push_str("\r\n");
    let mut out = head.into_bytes();
    out.extend_from_slice(body);
    out
}

/// What a request head asks for.
#[derive(Debug, PartialEq, Eq)]
enum Request {
    Metrics,
    NotFound,
    MethodNotAllowed,
    Bad,
}

/// Parses a complete request head (without the final blank line).
fn parse(head: &[u8]) -> Request {
    let Ok(text) = std::str::from_utf8(head) else {
        return Request::Bad;
    };
    let line = text.split("\r\n").next().unwrap_or("");
    let mut parts = line.split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Request::Bad;
    };
    if !matches!(version, "HTTP/1.0" | "HTTP/1.1") || method.is_empty() || target.is_empty() {
        return Request::Bad;
    }
    if !method.bytes().all(|b| b.is_ascii_uppercase()) {
        return Request::Bad;
    }
    if method != "GET" {
        return Request::MethodNotAllowed;
    }
    let path = target.split('?').next().unwrap_or("");
    if path == "/metrics" {
        Request::Metrics
    } else {
        Request::NotFound
    }
}

/// Where the head ends (the index after "\r\n\r\n"), if it has.
fn head_end(buf: &[u8]) -> Option<usize> {
    buf.windows(4).position(|w| w == b"\r\n\r\n").map(|i| i + 4)
}

/// Whether the end of a request head waits, unread, in `sock` (looked at without taking it off
/// the socket, and without blocking: the socket's own mode is its serving thread's).
fn head_waits(sock: &TcpStream) -> bool {
    use nix::sys::socket::{recv, MsgFlags};
    use std::os::fd::AsRawFd;
    let mut buf = [0u8; MAX_REQUEST];
    recv(
        sock.as_raw_fd(),
        &mut buf,
        MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT,
    )
    .is_ok_and(|n| head_end(&buf[..n]).is_some())
}

/// Why no request head was read.
#[derive(Debug, PartialEq, Eq)]
enum NoHead {
    /// The peer closed or the connection failed: nothing to answer.
    Gone,
    /// Answer with this status.
    Refuse(&'static str),
}

/// Reads a request head by `deadline`.
fn read_head(
    conn: &mut impl Read,
    deadline: Instant,
    set_timeout: impl Fn(Duration),
) -> Result<Vec<u8>, NoHead> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(NoHead::Refuse("408 Request Timeout"));
        }
        set_timeout(left);
        match conn.read(&mut chunk) {
            Ok(0) => return Err(NoHead::Gone),
            Ok(n) => {
                // Search from just before the new bytes: the terminator may straddle reads.
                let from = buf.len().saturating_sub(3);
                buf.extend_from_slice(&chunk[..n]);
                if let Some(end) = head_end(&buf[from..]) {
                    buf.truncate(from + end - 4);
                    return Ok(buf);
                }
                if buf.len() > MAX_REQUEST {
                    return Err(NoHead::Refuse("431 Request Header Fields Too Large"));
                }
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return Err(NoHead::Refuse("408 Request Timeout"))
            }
            Err(_) => return Err(NoHead::Gone),
        }
    }
}

/// Writes all of `buf` within `deadline`, or fails: a socket's write timeout bounds each send
/// only, so a client that reads a little now and then would hold a scrape slot for as long as
/// it likes. Tells `stalled` when the write has made no progress for [`WRITE_STALL`] (true)
/// and when it moves again (false); gives up if that returns false (the place was taken).
fn write_within(
    conn: &mut TcpStream,
    buf: &[u8],
    deadline: Duration,
    mut stalled: impl FnMut(bool) -> bool,
) -> std::io::Result<()> {
    let until = Instant::now() + deadline;
    let mut at = 0;
    let mut stuck = false;
    while at < buf.len() {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(ErrorKind::TimedOut.into());
        }
        conn.set_write_timeout(Some(left.min(WRITE_STALL)))?;
        match conn.write(&buf[at..]) {
            Ok(0) => return Err(ErrorKind::WriteZero.into()),
            Ok(n) => {
                at += n;
                if std::mem::take(&mut stuck) && !stalled(false) {
                    return Err(ErrorKind::ConnectionAborted.into());
                }
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                if !std::mem::replace(&mut stuck, true) && !stalled(true) {
                    return Err(ErrorKind::ConnectionAborted.into());
                }
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn serve(mut conn: TcpStream, page: &PageFn, slot: &Slot, accepted: Instant) {
    let sock = conn.try_clone();
    let set_timeout = |t| {
        if let Ok(s) = &sock {
            let _ = s.set_read_timeout(Some(t));
        }
    };
    let head = read_head(&mut conn, accepted + REQUEST_DEADLINE, set_timeout);
    // Evicted while it read (its socket was shut): nothing to answer.
    if !slot.slots.set(slot.serial, Phase::Answering) {
        return;
    }
    let answer = match head {
        Err(NoHead::Gone) => return,
        Err(NoHead::Refuse(status)) => response(status, &[], format!("{status}\n").as_bytes()),
        Ok(head) => match parse(&head) {
            Request::Metrics => response(
                "200 OK",
                &[("Content-Type", super::exposition::CONTENT_TYPE)],
                page().as_bytes(),
            ),
            Request::NotFound => response("404 Not Found", &[], b"only /metrics is served\n"),
            Request::MethodNotAllowed => response(
                "405 Method Not Allowed",
                &[("Allow", "GET")],
                b"only GET is served\n",
            ),
            Request::Bad => response("400 Bad Request", &[], b"not an HTTP/1.x request\n"),
        },
    };
    let writing = |stalled| slot.slots.set(slot.serial, Phase::Writing { stalled });
    // From here, a newcomer may take this place, first if the client does not read.
    if !writing(false) {
        return;
    }
    let written = write_within(&mut conn, &answer, WRITE_DEADLINE, writing);
    // Done: from now on this place is among the first a newcomer takes.
    if written.is_err() || !slot.slots.set(slot.serial, Phase::Closing) {
        return;
    }
    // Unread request bytes (a body) would turn our close into a reset that can destroy the
    // answer before the client reads it: half-close, then drop what is left, briefly.
    let _ = conn.shutdown(Shutdown::Write);
    let _ = conn.set_read_timeout(Some(Duration::from_millis(200)));
    let mut sink = [0u8; 1024];
    let until = Instant::now() + Duration::from_millis(500);
    while Instant::now() < until {
        match conn.read(&mut sink) {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
    }
}

#[cfg(test)]
mod tests;
