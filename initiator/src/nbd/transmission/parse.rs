//! A client's bytes as requests: where each complete request and its payload lie in the
//! buffer ([`split`]), and what to do with each ([`classify`]).

use std::ops::Range;

use super::super::proto::{
    Request, CMD_DISC, CMD_FLAG_FUA, CMD_FLAG_NO_HOLE, CMD_FLUSH, CMD_READ, CMD_WRITE,
    CMD_WRITE_ZEROES, EINVAL, ENOSPC, EPERM, REQUEST_LEN,
};
use super::super::{ConnError, MAX_PAYLOAD};

/// Bytes read, written or zeroed by one batch, at most (one request may exceed it): the
/// requests of a batch run without a pause for the other threads that want the client's queue
/// (a FLUSH of another connection).
pub(super) const BATCH_BYTES: u64 = 64 << 20;

/// What to do with a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Action {
    Read,
    Write {
        fua: bool,
    },
    Zeroes {
        fua: bool,
    },
    Flush,
    Disc,
    /// Answer with this error.
    Fail(u32),
}

/// The export's facts a request is checked against.
#[derive(Debug, Clone, Copy)]
pub(super) struct Limits {
    pub(super) size: u64,
    pub(super) read_only: bool,
    /// 1, or the minimum block size when the client was told it.
    pub(super) align: u64,
}

pub(super) fn classify(r: &Request, l: Limits) -> Action {
    // "There is no reply to an NBD_CMD_DISC", and the client sends nothing after it: whatever
    // its flags, offset and length (which must be 0), it ends the connection (as qemu-nbd's).
    // An EINVAL answer left the connection, its slot and thread, to the idle time-out.
    if r.kind == CMD_DISC {
        return Action::Disc;
    }
    if r.flags & !(CMD_FLAG_FUA | CMD_FLAG_NO_HOLE) != 0
        || (r.flags & CMD_FLAG_NO_HOLE != 0 && r.kind != CMD_WRITE_ZEROES)
    {
        return Action::Fail(EINVAL);
    }
    let len = u64::from(r.len);
    let inside = r.offset.checked_add(len).is_some_and(|end| end <= l.size);
    let aligned = r.offset.is_multiple_of(l.align) && len.is_multiple_of(l.align);
    let fua = r.flags & CMD_FLAG_FUA != 0;
    let write = |a: Action, limit: u64| {
        if l.read_only {
            Action::Fail(EPERM)
        } else if len == 0 || len > limit || !aligned {
            Action::Fail(EINVAL)
        } else if !inside {
            Action::Fail(ENOSPC)
        } else {
            a
        }
    };
    match r.kind {
        CMD_READ if len == 0 || len > u64::from(MAX_PAYLOAD) || !inside || !aligned => {
            Action::Fail(EINVAL)
        }
        CMD_READ => Action::Read,
        CMD_WRITE => write(Action::Write { fua }, u64::from(MAX_PAYLOAD)),
        CMD_WRITE_ZEROES => write(Action::Zeroes { fua }, u64::MAX),
        CMD_FLUSH => Action::Flush,
        // TRIM is not advertised (remote memory has nothing to deallocate), nor CACHE or
        // BLOCK_STATUS (no structured replies).
        _ => Action::Fail(EINVAL),
    }
}

/// A request and where its payload lies: in the buffer, or (`from`) in a payload buffer it
/// was received into ([`direct`](super::direct)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Item {
    pub(super) req: Request,
    pub(super) payload: Range<usize>,
    pub(super) from: Option<usize>,
}

/// The complete requests at the front of a buffer.
#[derive(Debug, Default)]
pub(super) struct Split {
    pub(super) items: Vec<Item>,
    /// Bytes they take.
    pub(super) consumed: usize,
    /// Bytes (from `consumed`) the next request needs to be complete.
    pub(super) want: usize,
    /// Input after which nothing can be parsed: the connection ends once the items before
    /// it are answered.
    pub(super) fatal: Option<ConnError>,
}

/// Bytes `req` reads, writes or zeroes, toward its batch's [`BATCH_BYTES`]. (WRITE_ZEROES
/// counted nothing: a batch of 64 of up to 4 GiB each held the queue for minutes.)
pub(super) fn batch_bytes(req: &Request) -> u64 {
    match req.kind {
        CMD_READ | CMD_WRITE | CMD_WRITE_ZEROES => u64::from(req.len),
        _ => 0,
    }
}

/// Bytes of payload that follow the request's header on the wire (a WRITE's; none otherwise).
fn payload_len(req: &Request) -> usize {
    if req.has_payload() {
        req.len as usize
    } else {
        0
    }
}

pub(super) fn split(buf: &[u8], max_items: usize) -> Split {
    let mut s = Split::default();
    let mut bytes = 0u64;
    while s.items.len() < max_items && bytes < BATCH_BYTES {
        let rest = &buf[s.consumed..];
        if rest.len() < REQUEST_LEN {
            s.want = REQUEST_LEN;
            break;
        }
        let req = match Request::parse(&rest[..REQUEST_LEN]) {
            Ok(r) => r,
            Err(e) => {
                s.fatal = Some(e.into());
                break;
            }
        };
        let at = s.consumed + REQUEST_LEN;
        if req.has_payload() && req.len > MAX_PAYLOAD {
            // Its payload cannot be skipped cheaply: answer EINVAL, then close.
            s.items.push(Item {
                req,
                payload: at..at,
                from: None,
            });
            s.consumed = at;
            s.fatal = Some(ConnError::Protocol(format!(
                "a WRITE of {} bytes (at most {MAX_PAYLOAD})",
                req.len
            )));
            break;
        }
        let plen = payload_len(&req);
        if rest.len() < REQUEST_LEN + plen {
            s.want = REQUEST_LEN + plen;
            break;
        }
        bytes += batch_bytes(&req);
        s.items.push(Item {
            req,
            payload: at..at + plen,
            from: None,
        });
        s.consumed = at + plen;
    }
    s
}

/// The request whose header is in `buf` but not all of its payload, if the buffer ends in one:
/// the walk over its request headers goes on from `scan` (where an earlier walk of the same
/// buffer, since grown, left off; 0 at first) and leaves it at that request's header. None when
/// the buffer ends between requests or in a header, and from a header that does not parse on
/// (`split` ends the connection there).
pub(super) fn incomplete(buf: &[u8], scan: &mut usize) -> Option<Request> {
    while let Some(rest) = buf.get(*scan..) {
        if rest.len() < REQUEST_LEN {
            return None;
        }
        let Ok(req) = Request::parse(&rest[..REQUEST_LEN]) else {
            *scan = usize::MAX;
            return None;
        };
        let plen = payload_len(&req);
        if rest.len() < REQUEST_LEN + plen {
            return Some(req);
        }
        *scan += REQUEST_LEN + plen;
    }
    None
}
