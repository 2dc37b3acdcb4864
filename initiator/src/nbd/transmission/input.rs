//! A client's bytes taken in from its socket: what it already sent ([`Client::read_ahead`]),
//! waiting for more under the idle time-out ([`Client::read_more`]), and a request header alone
//! after a payload received in place ([`direct`](super::direct)).

use std::io::{ErrorKind, Read};
use std::time::Instant;

use super::super::proto::REQUEST_LEN;
use super::super::ConnError;
use super::inbuf::{GROW_STEP, READ_CHUNK};
use super::{Client, KEEP_IDLE, READ_AHEAD};

impl Client<'_> {
    /// Takes in whatever the socket already has (without waiting), up to a large WRITE's
    /// payload that goes straight to a buffer of its own ([`Client::stops_for_fill`]). A read
    /// that did not fill its room emptied the socket: no further read is tried for the
    /// `EAGAIN` that would follow (bytes that came since wake the next wait for input).
    pub(super) fn read_ahead(&mut self) -> Result<(), ConnError> {
        let mut scan = 0;
        while self.buf.bytes().len() < READ_AHEAD && !self.stops_for_fill(&mut scan) {
            let header = self.header_alone();
            let room = self.buf.room(READ_CHUNK);
            let room = if header {
                &mut room[..REQUEST_LEN]
            } else {
                room
            };
            let asked = room.len();
            match self.stream.read_available(room)? {
                Some(0) => {
                    self.eof = true;
                    return Ok(());
                }
                Some(n) => {
                    self.buf.filled(n);
                    if header {
                        self.header_next = false;
                        return Ok(());
                    }
                    if n < asked {
                        return Ok(());
                    }
                }
                None => return Ok(()),
            }
        }
        Ok(())
    }

    /// Whether the next read takes a request header alone: after a payload received in
    /// place, with nothing else buffered (the next request's payload, if large too, goes
    /// straight to its buffer: [`direct`]).
    fn header_alone(&self) -> bool {
        self.header_next && self.buf.bytes().is_empty()
    }

    /// Waits for more bytes: the next request needs `want` bytes in all. The client is idle
    /// meanwhile: past the idle time-out (counted from its last answered request, or its
    /// handshake) without a complete request, it is closed.
    pub(super) fn read_more(&mut self, want: usize) -> Result<(), ConnError> {
        // The buffer grows as the bytes come, GROW_STEP at most ahead of them: a header alone
        // (28 bytes) committed the whole payload it announced (32 MiB, zeroed) until the idle
        // time-out.
        let need = want
            .saturating_sub(self.buf.bytes().len())
            .clamp(READ_CHUNK, GROW_STEP);
        let idle = self.shared.opts.limits.idle_timeout;
        loop {
            let left = match idle {
                Some(d) => {
                    let left = (self.slot.since() + d).saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(ConnError::Idle(d));
                    }
                    Some(left)
                }
                None => None,
            };
            // A large buffer kept from a burst of large WRITEs, the payload buffers and the
            // buffers of large READs' replies go back once the client has been quiet for
            // KEEP_IDLE: an idle client holds no more than a fresh one.
            let keeping = self.buf.bytes().is_empty()
                && (self.buf.large()
                    || (self.fill.is_none() && !self.bufs.is_empty())
                    || self.pipe.keeps_bufs());
            let timeout = match (keeping, left) {
                (true, l) => Some(l.map_or(KEEP_IDLE, |l| l.min(KEEP_IDLE))),
                (false, l) => l,
            };
            if timeout.is_some() {
                self.stream.set_read_timeout(timeout)?;
            }
            let header = self.header_alone();
            let r = if self.fill.is_some() {
                self.fill_read()
            } else {
                let room = self.buf.room(need);
                let room = if header {
                    &mut room[..REQUEST_LEN]
                } else {
                    room
                };
                self.stream.read(room)
            };
            if keeping && idle.is_none() {
                // Back to no time-out, as the socket was.
                self.stream.set_read_timeout(None)?;
            }
            match r {
                Ok(0) => {
                    self.eof = true;
                    return Ok(());
                }
                Ok(n) => {
                    if self.fill.is_some() {
                        self.fill_got(n);
                    } else {
                        self.buf.filled(n);
                        self.header_next &= !header;
                    }
                    return Ok(());
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                    if keeping {
                        self.buf.release();
                        self.release_payload_bufs();
                        self.pipe.release_bufs();
                    } else if idle.is_none() {
                        return Err(e.into());
                    }
                }
                Err(e) => return Err(e.into()),
            }
        }
    }
}
