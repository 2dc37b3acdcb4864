//! A TCP relay between the tests' initiators and a target that injects link faults on demand:
//! cut (FIN both ways), reset (RST both ways: `SO_LINGER` 0), stall (nothing forwarded either
//! way until resumed or for a while), swallow (what the client sends is thrown away) and a reset
//! after a number of further bytes (a fault at a chosen point of the stream, mid-FPDU).
//!
//! Each link is one thread that owns both sockets (non-blocking, `poll(2)`, 5 ms turns) and
//! looks at its controls every turn; the calls that change what a link does ([`Relay::cut`],
//! [`Relay::stall_links`], [`Relay::swallow`], ...) return only once every live link has seen
//! the change, so that a test's next write already meets the fault.

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::poll::{poll, PollFd, PollFlags};
use nix::sys::socket::{setsockopt, sockopt};

/// A fault for one link (or every live link).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Both sides see a close (FIN).
    Cut,
    /// Both sides see a reset (RST): bytes not yet read are gone.
    Reset,
    /// Nothing is forwarded either way for this long, then the link carries on (what was sent
    /// meanwhile is delivered late). `Duration::MAX`: until [`Relay::resume`].
    Stall(Duration),
    /// This many more bytes from the client reach the server, then both sides are reset.
    ResetAfter(u64),
    /// The client sees a reset; the server's side stays open and hears nothing more (what it
    /// sends is read and dropped) until the server closes it: a peer that vanished, as behind
    /// a NAT that dropped the flow. Only the server's own time-outs end its side.
    Orphan,
}

const RUN: u8 = 0;
const CUT: u8 = 1;
const RESET: u8 = 2;
const ORPHAN: u8 = 3;

/// One link's controls, shared by its thread and the relay.
#[derive(Debug)]
struct LinkCtl {
    kill: AtomicU8,
    /// Stalled until then (None: flowing).
    stall_until: Mutex<Option<Instant>>,
    /// Client bytes still to forward before a reset (`u64::MAX`: no limit).
    budget: AtomicU64,
    /// Turns of the link's loop so far (a change is seen once this moves on twice).
    turns: AtomicU64,
    done: AtomicBool,
    /// The client side's socket (-1 until the link runs).
    down_fd: AtomicI32,
}

impl LinkCtl {
    fn new() -> LinkCtl {
        LinkCtl {
            kill: AtomicU8::new(RUN),
            stall_until: Mutex::new(None),
            budget: AtomicU64::new(u64::MAX),
            turns: AtomicU64::new(0),
            done: AtomicBool::new(false),
            down_fd: AtomicI32::new(-1),
        }
    }

    fn stalled(&self) -> bool {
        let mut s = self.stall_until.lock().unwrap();
        match *s {
            Some(t) if Instant::now() < t => true,
            Some(_) => {
                *s = None;
                false
            }
            None => false,
        }
    }

    fn apply(&self, f: Fault) {
        match f {
            Fault::Cut => self.kill.store(CUT, Ordering::SeqCst),
            Fault::Reset => self.kill.store(RESET, Ordering::SeqCst),
            Fault::Orphan => self.kill.store(ORPHAN, Ordering::SeqCst),
            Fault::Stall(d) => {
                *self.stall_until.lock().unwrap() = Some(
                    Instant::now()
                        .checked_add(d)
                        .unwrap_or_else(|| Instant::now() + Duration::from_secs(86_400)),
                )
            }
            Fault::ResetAfter(n) => self.budget.store(n, Ordering::SeqCst),
        }
    }
}

/// How many faults of each kind were injected (for the tests' figures).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FaultCounts {
    /// Cuts (FIN), one per link cut.
    pub cuts: u64,
    /// Resets (RST), immediate or after a byte count, one per link.
    pub resets: u64,
    /// Stalls, one per link stalled.
    pub stalls: u64,
    /// Links orphaned (the client reset, the server left hanging).
    pub orphans: u64,
    /// Times the client's bytes were swallowed.
    pub swallows: u64,
}

impl FaultCounts {
    /// All of them.
    pub fn total(&self) -> u64 {
        self.cuts + self.resets + self.stalls + self.swallows + self.orphans
    }
}

#[derive(Debug, Default)]
struct Shared {
    stop: AtomicBool,
    swallow: AtomicBool,
    links: Mutex<Vec<Arc<LinkCtl>>>,
    accepted: AtomicU64,
    armed: Mutex<Option<Fault>>,
    counts: Mutex<FaultCounts>,
}

impl Shared {
    fn count(&self, f: Fault, n: u64) {
        let mut c = self.counts.lock().unwrap();
        match f {
            Fault::Cut => c.cuts += n,
            Fault::Reset | Fault::ResetAfter(_) => c.resets += n,
            Fault::Stall(_) => c.stalls += n,
            Fault::Orphan => c.orphans += n,
        }
    }

    /// The links still running (finished ones are forgotten).
    fn live(&self) -> Vec<Arc<LinkCtl>> {
        let mut v = self.links.lock().unwrap();
        v.retain(|l| !l.done.load(Ordering::SeqCst));
        v.clone()
    }
}

/// A TCP relay on 127.0.0.1: every connection to it is forwarded to `upstream`, through a link
/// that faults when told to. New connections are relayed as usual whatever happened to the old
/// ones. Stops (cutting every link) on drop.
#[derive(Debug)]
pub struct Relay {
    port: u16,
    shared: Arc<Shared>,
}

impl Relay {
    /// Starts relaying to `upstream` (host:port).
    pub fn start(upstream: &str) -> Relay {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind relay");
        l.set_nonblocking(true).expect("nonblocking");
        let port = l.local_addr().unwrap().port();
        let shared = Arc::new(Shared::default());
        let upstream = upstream.to_owned();
        let sh = Arc::clone(&shared);
        std::thread::spawn(move || {
            while !sh.stop.load(Ordering::Relaxed) {
                match l.accept() {
                    Ok((down, _)) => {
                        let Ok(up) = TcpStream::connect(&upstream) else {
                            continue;
                        };
                        sh.accepted.fetch_add(1, Ordering::Relaxed);
                        let ctl = Arc::new(LinkCtl::new());
                        if let Some(f) = sh.armed.lock().unwrap().take() {
                            ctl.apply(f);
                            sh.count(f, 1);
                        }
                        sh.links.lock().unwrap().push(Arc::clone(&ctl));
                        let sh = Arc::clone(&sh);
                        std::thread::spawn(move || {
                            run_link(down, up, &ctl, &sh);
                            ctl.done.store(true, Ordering::SeqCst);
                        });
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(2)),
                }
            }
        });
        Relay { port, shared }
    }

    /// `tcp://127.0.0.1:PORT` of the relay.
    pub fn url(&self) -> String {
        format!("tcp://127.0.0.1:{}", self.port)
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> u64 {
        self.shared.accepted.load(Ordering::Relaxed)
    }

    /// Links running now.
    pub fn live(&self) -> usize {
        self.shared.live().len()
    }

    /// The faults injected so far.
    pub fn counts(&self) -> FaultCounts {
        *self.shared.counts.lock().unwrap()
    }

    /// Applies `f` to every live link; returns how many.
    pub fn inject_all(&self, f: Fault) -> usize {
        let links = self.shared.live();
        self.shared.count(f, links.len() as u64);
        for l in &links {
            l.apply(f);
        }
        settle(&links);
        links.len()
    }

    /// Applies `f` to one live link, the `n`th (modulo how many there are); false if none is.
    pub fn inject_one(&self, f: Fault, n: usize) -> bool {
        let links = self.shared.live();
        if links.is_empty() {
            return false;
        }
        let l = &links[n % links.len()];
        self.shared.count(f, 1);
        l.apply(f);
        settle(std::slice::from_ref(l));
        true
    }

    /// The next connection accepted gets `f` from its first byte (a fault during the
    /// handshake: `ResetAfter(n)` resets it after n bytes of MPA and Connect).
    pub fn arm_next(&self, f: Fault) {
        *self.shared.armed.lock().unwrap() = Some(f);
    }

    /// Takes back a fault [`arm_next`](Self::arm_next) set that no connection took yet.
    pub fn disarm(&self) {
        *self.shared.armed.lock().unwrap() = None;
    }

    /// Drops every live link with a FIN both ways (and ends [`swallow`](Self::swallow)).
    pub fn cut(&self) {
        self.inject_all(Fault::Cut);
        self.shared.swallow.store(false, Ordering::SeqCst);
    }

    /// Drops every live link with a RST both ways (and ends [`swallow`](Self::swallow)).
    pub fn reset(&self) {
        self.inject_all(Fault::Reset);
        self.shared.swallow.store(false, Ordering::SeqCst);
    }

    /// The live links stop forwarding, either way, until [`resume`](Self::resume): what is sent
    /// meanwhile waits in the relay and the kernels' buffers, as on a link that went silent.
    /// New links are not stalled.
    pub fn stall_links(&self) -> usize {
        self.inject_all(Fault::Stall(Duration::MAX))
    }

    /// Every stalled link carries on: what waited is delivered now, late.
    pub fn resume(&self) {
        let links = self.shared.live();
        for l in &links {
            *l.stall_until.lock().unwrap() = None;
        }
        settle(&links);
    }

    /// Bytes the client sent on live link `n` (as [`inject_one`](Self::inject_one) counts)
    /// that wait unread in the relay: on a stalled link, everything it sent since the stall.
    pub fn waiting_from_client(&self, n: usize) -> usize {
        let links = self.shared.live();
        let Some(l) = links.get(n % links.len().max(1)) else {
            return 0;
        };
        let fd = l.down_fd.load(Ordering::SeqCst);
        if fd < 0 {
            return 0;
        }
        let mut queued: libc::c_int = 0;
        // SAFETY: FIONREAD writes one int; the link is live, so its socket is open.
        match unsafe { libc::ioctl(fd, libc::FIONREAD, &mut queued) } {
            0 => queued.max(0) as usize,
            _ => 0,
        }
    }

    /// From now until the next [`cut`](Self::cut) or [`reset`](Self::reset), bytes from the
    /// client are read and thrown away instead of forwarded: what the client sent meanwhile
    /// never reaches the server (a link that dies with data in flight).
    pub fn swallow(&self) {
        self.shared.swallow.store(true, Ordering::SeqCst);
        let links = self.shared.live();
        self.shared.counts.lock().unwrap().swallows += 1;
        settle(&links);
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        for l in self.shared.live() {
            l.apply(Fault::Cut);
        }
    }
}

/// Returns once each of `links` has run two more turns (or ended): a control changed before
/// this call is then in force on all of them.
fn settle(links: &[Arc<LinkCtl>]) {
    let start: Vec<u64> = links
        .iter()
        .map(|l| l.turns.load(Ordering::SeqCst))
        .collect();
    let deadline = Instant::now() + Duration::from_secs(5);
    for (l, t) in links.iter().zip(start) {
        while !l.done.load(Ordering::SeqCst)
            && l.turns.load(Ordering::SeqCst) < t + 2
            && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// Ends a link with a RST: `SO_LINGER` 0, then the close (when `s` is dropped) aborts.
fn abort(s: &TcpStream) {
    let _ = setsockopt(
        s,
        sockopt::Linger,
        &libc::linger {
            l_onoff: 1,
            l_linger: 0,
        },
    );
}

/// Forwards between `down` (the client) and `up` (the server) until either side closes or a
/// fault ends the link.
fn run_link(down: TcpStream, up: TcpStream, ctl: &LinkCtl, sh: &Shared) {
    ctl.down_fd.store(down.as_raw_fd(), Ordering::SeqCst);
    let _ = down.set_nodelay(true);
    let _ = up.set_nodelay(true);
    if down.set_nonblocking(true).is_err() || up.set_nonblocking(true).is_err() {
        return;
    }
    // Bytes read from one side, not yet written to the other.
    let mut to_up: Vec<u8> = Vec::new();
    let mut to_down: Vec<u8> = Vec::new();
    let mut buf = vec![0u8; 64 << 10];
    loop {
        ctl.turns.fetch_add(1, Ordering::SeqCst);
        if sh.stop.load(Ordering::Relaxed) {
            ctl.kill.store(CUT, Ordering::SeqCst);
        }
        match ctl.kill.load(Ordering::SeqCst) {
            CUT => {
                let _ = down.shutdown(Shutdown::Both);
                let _ = up.shutdown(Shutdown::Both);
                return;
            }
            RESET => {
                abort(&down);
                abort(&up);
                return;
            }
            ORPHAN => {
                abort(&down);
                drop(down);
                return hang_on(up, ctl, sh);
            }
            _ => {}
        }
        if ctl.stalled() {
            std::thread::sleep(Duration::from_millis(2));
            continue;
        }
        let flags = |pending_in: &[u8], pending_out: &[u8]| {
            let mut f = PollFlags::empty();
            if pending_in.is_empty() {
                f |= PollFlags::POLLIN;
            }
            if !pending_out.is_empty() {
                f |= PollFlags::POLLOUT;
            }
            f
        };
        let mut fds = [
            PollFd::new(down.as_fd(), flags(&to_up, &to_down)),
            PollFd::new(up.as_fd(), flags(&to_down, &to_up)),
        ];
        if poll(&mut fds, 5u8).is_err() {
            continue;
        }
        // A control that changed while polling wins over the bytes that woke the poll.
        if ctl.kill.load(Ordering::SeqCst) != RUN || ctl.stalled() {
            continue;
        }
        if to_up.is_empty() {
            match (&down).read(&mut buf) {
                Ok(0) => return close_both(&down, &up),
                Ok(_) if sh.swallow.load(Ordering::SeqCst) => {}
                Ok(n) => {
                    let budget = ctl.budget.load(Ordering::SeqCst);
                    let take = (n as u64).min(budget) as usize;
                    to_up.extend_from_slice(&buf[..take]);
                    if budget != u64::MAX {
                        ctl.budget.store(budget - take as u64, Ordering::SeqCst);
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                Err(_) => return close_both(&down, &up),
            }
        }
        if to_down.is_empty() {
            match (&up).read(&mut buf) {
                Ok(0) => return close_both(&up, &down),
                Ok(n) => to_down.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                Err(_) => return close_both(&up, &down),
            }
        }
        if !flush(&up, &mut to_up) || !flush(&down, &mut to_down) {
            return close_both(&down, &up);
        }
        // The byte budget is spent and its last bytes are out: reset here.
        if ctl.budget.load(Ordering::SeqCst) == 0 && to_up.is_empty() {
            ctl.kill.store(RESET, Ordering::SeqCst);
        }
    }
}

/// The server's side of an orphaned link: read and dropped until the server closes it (or the
/// link is cut or reset, or the relay stops).
fn hang_on(up: TcpStream, ctl: &LinkCtl, sh: &Shared) {
    let mut buf = vec![0u8; 64 << 10];
    loop {
        ctl.turns.fetch_add(1, Ordering::SeqCst);
        if sh.stop.load(Ordering::Relaxed) || ctl.kill.load(Ordering::SeqCst) == CUT {
            let _ = up.shutdown(Shutdown::Both);
            return;
        }
        if ctl.kill.load(Ordering::SeqCst) == RESET {
            return abort(&up);
        }
        let mut fds = [PollFd::new(up.as_fd(), PollFlags::POLLIN)];
        if poll(&mut fds, 5u8).is_err() {
            continue;
        }
        match (&up).read(&mut buf) {
            Ok(0) => return,
            Ok(_) => {}
            Err(e) if e.kind() == ErrorKind::WouldBlock => {}
            Err(_) => return,
        }
    }
}

/// Writes what it can of `pending` to `to`; false if `to` is gone.
fn flush(mut to: &TcpStream, pending: &mut Vec<u8>) -> bool {
    while !pending.is_empty() {
        match to.write(pending) {
            Ok(0) => return false,
            Ok(n) => {
                pending.drain(..n);
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => return true,
            Err(_) => return false,
        }
    }
    true
}

/// One side closed (or failed): the other is closed too. (Each side is read only when what it
/// sent before has been passed on, so nothing is pending here.)
fn close_both(from: &TcpStream, to: &TcpStream) {
    let _ = to.shutdown(Shutdown::Both);
    let _ = from.shutdown(Shutdown::Both);
}

/// Cuts `relay`'s links after `after` from another thread and waits on the started requests of
/// `ns` through the loss: the completions reported before the wait that sees the cut, then
/// those reported after it (the queue reconnected), until a wait reports none. Returns the
/// loss (the error that wait returned) and every completion reported.
pub fn wait_started_through_a_cut(
    relay: &Arc<Relay>,
    after: Duration,
    ns: &mut rpma_initiator::Namespace<'_>,
) -> (rpma_initiator::Error, Vec<rpma_initiator::Completed>) {
    let cutter = {
        let r = Arc::clone(relay);
        std::thread::spawn(move || {
            std::thread::sleep(after);
            r.cut();
        })
    };
    let (mut seen, mut done) = (Vec::new(), Vec::new());
    let err = loop {
        done.clear();
        match ns.wait_started(&mut done) {
            Ok(()) => seen.extend(done.iter().copied()),
            Err(e) => break e,
        }
    };
    cutter.join().unwrap();
    loop {
        done.clear();
        ns.wait_started(&mut done).unwrap();
        if done.is_empty() {
            break;
        }
        seen.extend(done.iter().copied());
    }
    (err, seen)
}
