//! The control socket's served connections: a place and a thread each, at most
//! [`MAX_CLIENTS`], a newcomer taking the place of the oldest still sending its request; one
//! deadline for the whole request line and one for the answer; who sent it ([`Peer`]).

use std::collections::BTreeMap;
use std::io::{ErrorKind, Read, Write};
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

const MAX_REQUEST: usize = 4096;
/// Connections served at once.
pub const MAX_CLIENTS: usize = 8;
/// How long a client has to send its whole request line.
pub const REQUEST_DEADLINE: Duration = Duration::from_secs(5);
/// How long the answer may take to leave.
pub const WRITE_DEADLINE: Duration = Duration::from_secs(5);

/// Answers one request line from a [`Peer`].
pub type Handler = Arc<dyn Fn(&str, Peer) -> std::result::Result<String, String> + Send + Sync>;

/// Who sent a request: the credentials the kernel took at its connect (SO_PEERCRED), which the
/// client cannot choose.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Peer {
    /// Its user id; None if the kernel could not say.
    pub uid: Option<u32>,
}

impl Peer {
    /// The credentials of the process at the other end of `conn`.
    pub fn of(conn: &UnixStream) -> Peer {
        use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};
        Peer {
            uid: getsockopt(conn, PeerCredentials).ok().map(|c| c.uid()),
        }
    }

    /// Whether this peer may make `request`, one that changes the daemon's state: only root and
    /// the daemon's own user (`daemon_uid`, its effective uid) may. The socket's group, given to
    /// operators and monitoring so that they can read `status`, may not: clearing a failure
    /// before anyone checked the media would make lost writes look durable.
    ///
    /// # Errors
    /// The refusal to answer with, naming who may.
    pub fn may_change_state(
        &self,
        request: &str,
        daemon_uid: u32,
    ) -> std::result::Result<(), String> {
        match self.uid {
            Some(uid) if uid == 0 || uid == daemon_uid => Ok(()),
            who => Err(format!(
                "{request} changes the daemon's state: only root or the daemon's user (uid \
                 {daemon_uid}) may ask for it, not {}; members of the socket's group may read \
                 status only",
                who.map_or_else(
                    || "a peer of unknown uid".to_owned(),
                    |u| format!("uid {u}")
                )
            )),
        }
    }
}

/// Threads (served connections and those ending after an eviction) at most.
const MAX_THREADS: usize = 2 * MAX_CLIENTS;

/// One served connection.
#[derive(Debug)]
struct Held {
    /// Still sending its request: a newcomer may take its place.
    reading: bool,
    /// To shut it from another thread.
    sock: UnixStream,
}

#[derive(Debug, Default)]
struct Places {
    /// By serial: the first is the oldest.
    held: BTreeMap<u64, Held>,
    next: u64,
    /// Client threads running (evicted ones included, until they end).
    threads: usize,
}

/// The connections being served, and their threads.
#[derive(Debug, Default)]
pub(super) struct Clients {
    places: Mutex<Places>,
    /// Notified when a client thread ends.
    done: Condvar,
}

impl Clients {
    /// Shuts every connection served and waits for their threads: a client still sending its
    /// request or slow to read the answer must not hold the daemon's exit (its thread sees the
    /// shutdown at once); only requests being answered (the daemon's own work) are waited for.
    pub(super) fn shut_all(&self) {
        let mut p = self.lock();
        for h in p.held.values() {
            let _ = h.sock.shutdown(Shutdown::Both);
        }
        while p.threads > 0 {
            p = self.done.wait(p).unwrap_or_else(|e| e.into_inner());
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Places> {
        self.places.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A client thread's place, given back when it ends.
struct Slot {
    clients: Arc<Clients>,
    serial: u64,
}

impl Slot {
    /// Its request is read: no newcomer takes its place now. False if it was evicted.
    fn answering(&self) -> bool {
        match self.clients.lock().held.get_mut(&self.serial) {
            Some(h) => {
                h.reading = false;
                true
            }
            None => false,
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut p = self.clients.lock();
        p.held.remove(&self.serial);
        p.threads -= 1;
        self.clients.done.notify_all();
    }
}

/// Gives `conn` a place and a thread, taking the place of the oldest connection still sending
/// its request if all are taken, or turns it away.
pub(super) fn admit(clients: &Arc<Clients>, conn: UnixStream, handler: &Handler) {
    let Ok(sock) = conn.try_clone() else {
        return busy(conn);
    };
    let serial = {
        let mut p = clients.lock();
        if p.threads >= MAX_THREADS {
            drop(p);
            return busy(conn);
        }
        if p.held.len() >= MAX_CLIENTS {
            let Some(victim) = p.held.iter().find(|(_, h)| h.reading).map(|(&k, _)| k) else {
                drop(p);
                return busy(conn);
            };
            if let Some(h) = p.held.remove(&victim) {
                // Its thread's read fails now; it gives up and ends.
                let _ = h.sock.shutdown(Shutdown::Both);
            }
        }
        let serial = p.next;
        p.next += 1;
        p.held.insert(
            serial,
            Held {
                reading: true,
                sock,
            },
        );
        p.threads += 1;
        serial
    };
    let slot = Slot {
        clients: clients.clone(),
        serial,
    };
    let handler = handler.clone();
    let spawned = std::thread::Builder::new()
        .name("rpma-control-client".into())
        .spawn(move || serve_one(conn, &handler, &slot));
    if let Err(e) = spawned {
        // The closure (and its slot) was dropped with the error.
        log::warn!("control socket: cannot start a thread: {e}");
    }
}

/// Every place is being answered: say so if the socket takes it at once, then close.
fn busy(conn: UnixStream) {
    let _ = conn.set_nonblocking(true);
    let answer = serde_json::json!({
        "error": format!("busy: {MAX_CLIENTS} requests are being answered; try again")
    });
    let _ = (&conn).write_all(format!("{answer}\n").as_bytes());
}

/// Reads one request line by `deadline`: None if the client left without sending one, an
/// error to answer if it is late, too long or not text.
fn read_request(
    conn: &UnixStream,
    deadline: Instant,
) -> Option<std::result::Result<String, String>> {
    let mut buf = Vec::with_capacity(128);
    let mut chunk = [0u8; 512];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Some(Err(format!(
                "bad request: no whole request line within {} s",
                REQUEST_DEADLINE.as_secs()
            )));
        }
        if conn.set_read_timeout(Some(left)).is_err() {
            return None;
        }
        match (&*conn).read(&mut chunk) {
            Ok(0) if buf.is_empty() => return None,
            Ok(0) => break,
            Ok(n) => {
                buf.extend_from_slice(&chunk[..n]);
                if let Some(end) = buf.iter().position(|&b| b == b'\n') {
                    buf.truncate(end);
                    break;
                }
                if buf.len() > MAX_REQUEST {
                    return Some(Err(format!("bad request: longer than {MAX_REQUEST} bytes")));
                }
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            // The deadline passed; the next turn says so.
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(_) => return None,
        }
    }
    Some(String::from_utf8(buf).map_err(|_| "bad request: not UTF-8".to_owned()))
}

/// Writes all of `buf` within `deadline`, or fails: a socket's write timeout bounds each send
/// only, so a client reading a byte now and then would hold its thread as long as it likes.
fn write_within(conn: &UnixStream, buf: &[u8], deadline: Duration) -> std::io::Result<()> {
    let until = Instant::now() + deadline;
    let mut at = 0;
    while at < buf.len() {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(ErrorKind::TimedOut.into());
        }
        conn.set_write_timeout(Some(left))?;
        match (&*conn).write(&buf[at..]) {
            Ok(0) => return Err(ErrorKind::WriteZero.into()),
            Ok(n) => at += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn serve_one(conn: UnixStream, handler: &Handler, slot: &Slot) {
    let peer = Peer::of(&conn);
    let Some(read) = read_request(&conn, Instant::now() + REQUEST_DEADLINE) else {
        return;
    };
    // Evicted while it read (its socket was shut): nothing to answer.
    if !slot.answering() {
        return;
    }
    let answer = match read {
        Ok(line) => match handler(line.trim(), peer) {
            Ok(a) => a,
            Err(e) => serde_json::json!({ "error": e }).to_string(),
        },
        Err(e) => serde_json::json!({ "error": e }).to_string(),
    };
    let _ = write_within(&conn, format!("{answer}\n").as_bytes(), WRITE_DEADLINE);
}
