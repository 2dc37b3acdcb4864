//! Splitting and judging transmission requests under arbitrary client bytes (fuzz target
//! `nbd_requests`).

use super::parse::{batch_bytes, classify, split, Action, Limits, BATCH_BYTES};
use crate::nbd::proto::{
    Request, CMD_DISC, CMD_FLAG_FUA, CMD_FLUSH, CMD_READ, CMD_WRITE, CMD_WRITE_ZEROES, EPERM,
    REQUEST_LEN, REQUEST_MAGIC,
};
use crate::nbd::MAX_PAYLOAD;

/// The export sizes a settings byte chooses from.
const SIZES: [u64; 4] = [1 << 20, 4096, 0, u64::MAX];

/// `data[0]`: bit 0 read-only, bit 1 strict (the client was told the 512-byte block size),
/// bits 2-3 the export's size; `data[1]`: the most requests one batch takes (0 counts as 1).
/// Splits the rest as the server splits its input buffer and judges every request as it
/// would, checking that:
/// - the requests are contiguous from the start, each header parses to the request found, a
///   payload follows only a WRITE and has its length, and nothing past the input is used;
/// - what is left is shorter than what the next request needs, unless the batch was full or
///   the input cannot be parsed further;
/// - a READ, WRITE or WRITE_ZEROES is executed only inside the export, aligned, within the
///   payload limit and not empty, a write never on a read-only export, anything else is
///   refused with an error (never executed).
pub fn requests(data: &[u8]) {
    let Some((&[settings, max], buf)) = data.split_first_chunk::<2>() else {
        return;
    };
    let l = Limits {
        size: SIZES[usize::from((settings >> 2) & 3)],
        read_only: settings & 1 != 0,
        align: if settings & 2 != 0 { 512 } else { 1 },
    };
    let max = usize::from(max).max(1);
    let s = split(buf, max);
    assert!(s.items.len() <= max);
    let mut at = 0;
    let mut bytes = 0u64;
    for (i, it) in s.items.iter().enumerate() {
        assert_eq!(
            it.payload.start,
            at + REQUEST_LEN,
            "a gap before request {i}"
        );
        let parsed = Request::parse(&buf[at..it.payload.start]).expect("a parsed header");
        assert_eq!(parsed, it.req);
        let oversize = it.req.kind == CMD_WRITE && it.req.len > MAX_PAYLOAD;
        if oversize {
            assert!(it.payload.is_empty() && i + 1 == s.items.len() && s.fatal.is_some());
        } else if it.req.kind == CMD_WRITE {
            assert_eq!(it.payload.len(), it.req.len as usize);
        } else {
            assert!(it.payload.is_empty(), "a payload after a non-WRITE");
        }
        assert!(it.payload.end <= buf.len());
        at = it.payload.end;
        bytes += batch_bytes(&it.req);
        check_action(&it.req, classify(&it.req, l), l);
    }
    assert_eq!(s.consumed, at);
    let left = buf.len() - s.consumed;
    let full = s.items.len() == max || bytes >= BATCH_BYTES;
    if s.fatal.is_none() && !full {
        assert!(
            s.want > left,
            "{left} bytes left unparsed, {} wanted",
            s.want
        );
    }
    if s.fatal.is_some() && s.items.last().is_none_or(|it| it.req.len <= MAX_PAYLOAD) {
        // A bad magic right after the last request.
        let magic = buf[s.consumed..]
            .first_chunk::<4>()
            .map(|m| u32::from_be_bytes(*m));
        assert_ne!(magic, Some(REQUEST_MAGIC));
    }
}

fn check_action(r: &Request, a: Action, l: Limits) {
    let len = u64::from(r.len);
    let inside = r.offset.checked_add(len).is_some_and(|e| e <= l.size);
    let aligned = r.offset.is_multiple_of(l.align) && len.is_multiple_of(l.align);
    let sound = inside && aligned && len > 0;
    match a {
        Action::Read => {
            assert_eq!(r.kind, CMD_READ);
            assert!(sound && r.len <= MAX_PAYLOAD, "{r:?} read");
        }
        Action::Write { fua } => {
            assert_eq!(r.kind, CMD_WRITE);
            assert!(
                sound && r.len <= MAX_PAYLOAD && !l.read_only,
                "{r:?} written"
            );
            assert_eq!(fua, r.flags & CMD_FLAG_FUA != 0);
        }
        Action::Zeroes { fua } => {
            assert_eq!(r.kind, CMD_WRITE_ZEROES);
            assert!(sound && !l.read_only, "{r:?} zeroed");
            assert_eq!(fua, r.flags & CMD_FLAG_FUA != 0);
        }
        Action::Flush => assert_eq!(r.kind, CMD_FLUSH),
        Action::Disc => assert_eq!(r.kind, CMD_DISC),
        Action::Fail(e) => assert!(e != EPERM || l.read_only, "EPERM on a writable export"),
    }
}

/// Seeds: real request streams.
pub(crate) fn seeds() -> Vec<Vec<u8>> {
    let req = |kind: u16, flags: u16, offset: u64, len: u32| {
        let mut b = REQUEST_MAGIC.to_be_bytes().to_vec();
        b.extend_from_slice(&flags.to_be_bytes());
        b.extend_from_slice(&kind.to_be_bytes());
        b.extend_from_slice(&0x1234_5678u64.to_be_bytes());
        b.extend_from_slice(&offset.to_be_bytes());
        b.extend_from_slice(&len.to_be_bytes());
        if kind == CMD_WRITE && len <= 4096 {
            b.extend(std::iter::repeat_n(0xAB, len as usize));
        }
        b
    };
    let stream = |settings: u8, max: u8, reqs: &[Vec<u8>]| {
        let mut v = vec![settings, max];
        for r in reqs {
            v.extend_from_slice(r);
        }
        v
    };
    let mixed = [
        req(CMD_WRITE, CMD_FLAG_FUA, 0, 512),
        req(CMD_READ, 0, 0, 512),
        req(CMD_WRITE_ZEROES, 0, 4096, 8192),
        req(CMD_FLUSH, 0, 0, 0),
        req(CMD_READ, 0, 1 << 20, 1),
        req(9, 0, 0, 0),
        req(CMD_DISC, 0, 0, 0),
    ];
    vec![
        stream(0, 32, &mixed),
        stream(2, 32, &mixed),
        stream(1, 2, &mixed),
        stream(
            0,
            8,
            &[req(CMD_WRITE, 0, 0, 4096), req(CMD_WRITE, 0, 0, 40_000_000)],
        ),
        stream(0, 8, &[req(CMD_READ, 0, 0, 512), b"garbage!".to_vec()]),
        stream(4, 8, &[req(CMD_WRITE, 0, 4000, 200)]),
    ]
}
