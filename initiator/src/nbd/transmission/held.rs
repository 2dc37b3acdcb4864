//! What a connection holds back ([`park`](super::park)): the requests, and their payloads;
//! and the WRITE whose payload it is receiving in place ([`direct`](super::direct)).

use super::super::proto::Request;
use super::inbuf::InBuf;
use super::parse::Action;
use crate::writebuf::{Data as WriteData, WriteBuf};

/// Other queues whose writes of a request's bytes may not be placed: their
/// [`order_id`](crate::Queue::order_id)s, and whether this connection's queue has such writes
/// too.
pub(super) struct Others {
    pub(super) writers: Vec<u64>,
    pub(super) mine: bool,
}

/// A WRITE's payload: where it lies in the receive buffer, a copy (held back), or a payload
/// buffer it was received into ([`Client::fill`](super::Client)).
pub(super) enum Data {
    Buf(std::ops::Range<usize>),
    Own(Vec<u8>),
    /// `len` bytes at the start of payload buffer `idx`.
    Direct {
        idx: usize,
        len: usize,
    },
}

impl Data {
    /// Bytes copied.
    pub(super) fn len(&self) -> usize {
        match self {
            Data::Buf(_) | Data::Direct { .. } => 0,
            Data::Own(v) => v.len(),
        }
    }

    /// The bytes, as the queue takes them: copied from `buf` or a copy, or written from their
    /// payload buffer in place.
    pub(super) fn payload<'b>(&'b self, buf: &'b InBuf, bufs: &'b [WriteBuf]) -> WriteData<'b> {
        match self {
            Data::Buf(r) => WriteData::Bytes(&buf.bytes()[r.clone()]),
            Data::Own(v) => WriteData::Bytes(v),
            Data::Direct { idx, len } => WriteData::Buf {
                buf: &bufs[*idx],
                at: 0,
                len: *len,
            },
        }
    }
}

/// A WRITE whose payload is being received into payload buffer `idx` of its connection
/// ([`direct`](super::direct)): `got` bytes of it so far.
#[derive(Debug)]
pub(super) struct Fill {
    pub(super) req: Request,
    pub(super) idx: usize,
    pub(super) got: usize,
}

impl Fill {
    pub(super) fn len(&self) -> usize {
        self.req.len as usize
    }
}

/// A request held back.
pub(super) struct Parked {
    pub(super) req: Request,
    pub(super) a: Action,
    pub(super) data: Data,
    /// Looks at it so far.
    pub(super) tries: u32,
}

/// Whether two requests' bytes overlap.
pub(super) fn overlap(a: &Request, b: &Request) -> bool {
    let (a_end, b_end) = (
        a.offset.saturating_add(u64::from(a.len)),
        b.offset.saturating_add(u64::from(b.len)),
    );
    a.offset < b_end && b.offset < a_end
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(offset: u64, len: u32) -> Request {
        Request {
            flags: 0,
            kind: 0,
            handle: 0,
            offset,
            len,
        }
    }

    #[test]
    fn requests_overlap_when_they_share_a_byte() {
        assert!(overlap(&req(0, 4096), &req(4095, 1)));
        assert!(overlap(&req(4095, 1), &req(0, 4096)));
        assert!(overlap(&req(100, 10), &req(0, 4096)), "inside");
        assert!(!overlap(&req(0, 4096), &req(4096, 4096)), "next to it");
        assert!(!overlap(&req(4096, 4096), &req(0, 4096)));
        assert!(!overlap(&req(0, 0), &req(0, 4096)), "no bytes");
        assert!(
            overlap(&req(u64::MAX - 1, 4096), &req(u64::MAX - 1, 1)),
            "at the end"
        );
    }
}
