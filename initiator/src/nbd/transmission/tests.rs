use super::*;
use crate::nbd::proto::{
    Request, CMD_DISC, CMD_FLAG_FUA, CMD_FLAG_NO_HOLE, CMD_FLUSH, CMD_READ, CMD_WRITE,
    CMD_WRITE_ZEROES, EINVAL, ENOSPC, EPERM, REQUEST_LEN,
};
use crate::nbd::proto::{WireError, REQUEST_MAGIC};
use crate::nbd::MAX_PAYLOAD;

fn req(kind: u16, flags: u16, offset: u64, len: u32) -> Request {
    Request {
        flags,
        kind,
        handle: 1,
        offset,
        len,
    }
}

fn bytes(r: &Request, magic: u32) -> Vec<u8> {
    let mut b = magic.to_be_bytes().to_vec();
    b.extend_from_slice(&r.flags.to_be_bytes());
    b.extend_from_slice(&r.kind.to_be_bytes());
    b.extend_from_slice(&r.handle.to_be_bytes());
    b.extend_from_slice(&r.offset.to_be_bytes());
    b.extend_from_slice(&r.len.to_be_bytes());
    if r.kind == CMD_WRITE && r.len <= MAX_PAYLOAD {
        b.extend(std::iter::repeat_n(0xab, r.len as usize));
    }
    b
}

const RW: Limits = Limits {
    size: 1 << 20,
    read_only: false,
    align: 1,
};

#[test]
fn requests_are_checked_before_anything_is_issued() {
    let strict = Limits { align: 512, ..RW };
    let ro = Limits {
        read_only: true,
        ..RW
    };
    assert_eq!(classify(&req(CMD_READ, 0, 0, 4096), RW), Action::Read);
    assert_eq!(classify(&req(CMD_READ, 0, 1, 3), RW), Action::Read);
    assert_eq!(
        classify(&req(CMD_READ, 0, 1, 3), strict),
        Action::Fail(EINVAL)
    );
    assert_eq!(
        classify(&req(CMD_READ, 0, 1 << 20, 1), RW),
        Action::Fail(EINVAL)
    );
    assert_eq!(
        classify(&req(CMD_READ, 0, u64::MAX, 2), RW),
        Action::Fail(EINVAL)
    );
    assert_eq!(classify(&req(CMD_READ, 0, 0, 0), RW), Action::Fail(EINVAL));
    assert_eq!(
        classify(&req(CMD_WRITE, 0, (1 << 20) - 512, 1024), RW),
        Action::Fail(ENOSPC)
    );
    assert_eq!(
        classify(&req(CMD_WRITE, 0, 0, 512), ro),
        Action::Fail(EPERM)
    );
    assert_eq!(
        classify(&req(CMD_WRITE, CMD_FLAG_FUA, 512, 512), strict),
        Action::Write { fua: true }
    );
    assert_eq!(
        classify(&req(CMD_WRITE_ZEROES, CMD_FLAG_NO_HOLE, 0, 1 << 20), RW),
        Action::Zeroes { fua: false }
    );
    assert_eq!(
        classify(&req(CMD_WRITE, CMD_FLAG_NO_HOLE, 0, 1), RW),
        Action::Fail(EINVAL)
    );
    assert_eq!(
        classify(&req(CMD_READ, 1 << 4, 0, 1), RW),
        Action::Fail(EINVAL)
    );
    assert_eq!(
        classify(&req(4, 0, 0, 512), RW),
        Action::Fail(EINVAL),
        "TRIM"
    );
    assert_eq!(classify(&req(CMD_FLUSH, 0, 0, 0), ro), Action::Flush);
    assert_eq!(classify(&req(CMD_DISC, 0, 0, 0), RW), Action::Disc);
}

#[test]
fn split_takes_complete_requests_only() {
    let w = req(CMD_WRITE, 0, 0, 100);
    let r = req(CMD_READ, 0, 0, 4096);
    let mut b = bytes(&w, REQUEST_MAGIC);
    b.extend(bytes(&r, REQUEST_MAGIC));
    let s = split(&b, 32);
    assert_eq!(s.items.len(), 2);
    assert_eq!(s.items[0].payload, 28..128);
    assert_eq!(s.consumed, b.len());
    assert!(s.fatal.is_none());
    // Every truncation: the complete requests, and what the next one needs.
    for n in 0..b.len() {
        let s = split(&b[..n], 32);
        assert!(s.fatal.is_none());
        let want = if n < 128 {
            s.items.is_empty()
        } else {
            s.items.len() == 1
        };
        assert!(want, "{n}");
        assert!(s.want >= REQUEST_LEN, "{n}");
    }
    assert_eq!(split(&b, 1).items.len(), 1);
    // A bad magic after a good request: the good one, then the end.
    let mut bad = bytes(&r, REQUEST_MAGIC);
    bad.extend(bytes(&r, 0xdead_beef));
    let s = split(&bad, 32);
    assert_eq!(s.items.len(), 1);
    assert!(matches!(
        s.fatal,
        Some(ConnError::Wire(WireError::BadMagic { .. }))
    ));
    // An oversized WRITE is answered (EINVAL), then the connection ends.
    let big = req(CMD_WRITE, 0, 0, MAX_PAYLOAD + 1);
    let s = split(&bytes(&big, REQUEST_MAGIC), 32);
    assert_eq!(s.items.len(), 1);
    assert_eq!(classify(&s.items[0].req, RW), Action::Fail(EINVAL));
    assert!(matches!(s.fatal, Some(ConnError::Protocol(_))));
}

#[test]
fn a_disc_disconnects_whatever_its_flags_offset_and_length() {
    // NBD's spec: "There is no reply to an NBD_CMD_DISC", and the client sends nothing after
    // it (qemu-nbd disconnects "whether or not flags, from, or len are bogus").
    for flags in [CMD_FLAG_FUA, CMD_FLAG_NO_HOLE, 1 << 5, 0xffff] {
        assert_eq!(
            classify(&req(CMD_DISC, flags, 0, 0), RW),
            Action::Disc,
            "{flags:#x}"
        );
    }
    assert_eq!(classify(&req(CMD_DISC, 0, 4096, 512), RW), Action::Disc);
    let ro = Limits {
        read_only: true,
        ..RW
    };
    assert_eq!(
        classify(&req(CMD_DISC, 1 << 7, u64::MAX, 1), ro),
        Action::Disc
    );
}

#[test]
fn write_zeroes_count_toward_a_batchs_bytes() {
    // Three of 48 MiB: the second takes the batch past 64 MiB, the third waits for the next.
    let z = req(CMD_WRITE_ZEROES, 0, 0, 48 << 20);
    let b: Vec<u8> = (0..3).flat_map(|_| bytes(&z, REQUEST_MAGIC)).collect();
    let s = split(&b, 32);
    assert_eq!(s.items.len(), 2);
    assert_eq!(s.consumed, 2 * REQUEST_LEN);
    // Nor do zeroes and READs together go past it.
    let r = req(CMD_READ, 0, 0, 32 << 20);
    let mut b = bytes(&z, REQUEST_MAGIC);
    b.extend(bytes(&r, REQUEST_MAGIC));
    b.extend(bytes(&r, REQUEST_MAGIC));
    assert_eq!(split(&b, 32).items.len(), 2);
}

#[test]
fn the_walk_finds_the_request_the_buffer_ends_in() {
    use super::parse::incomplete;
    let small = req(CMD_WRITE, 0, 0, 100);
    let r = req(CMD_READ, 0, 0, 4096);
    let large = req(CMD_WRITE, 0, 4096, 1 << 20);
    let mut b = bytes(&small, REQUEST_MAGIC);
    b.extend(bytes(&r, REQUEST_MAGIC));
    let at = b.len();
    b.extend(bytes(&large, REQUEST_MAGIC));
    // Every length of the buffer, walked afresh and as one walk that goes on as it grows.
    let mut scan = 0;
    for n in 0..=b.len() {
        let want = if (REQUEST_LEN..128).contains(&n) {
            Some(small)
        } else {
            (n >= at + REQUEST_LEN && n < b.len()).then_some(large)
        };
        assert_eq!(incomplete(&b[..n], &mut 0), want, "{n} afresh");
        assert_eq!(incomplete(&b[..n], &mut scan), want, "{n} going on");
    }
    assert_eq!(
        scan,
        b.len(),
        "the walk ends past the last complete request"
    );
    // A bad magic ends the walk, for good.
    let mut bad = bytes(&r, REQUEST_MAGIC);
    bad.extend(bytes(&r, 0xdead_beef));
    bad.extend(bytes(&large, REQUEST_MAGIC));
    let mut scan = 0;
    assert_eq!(incomplete(&bad[..bad.len() - 1], &mut scan), None);
    assert_eq!(incomplete(&bad[..bad.len() - 1], &mut scan), None);
    // An oversized WRITE's header: the request, whose checks are the caller's.
    let big = req(CMD_WRITE, 0, 0, MAX_PAYLOAD + 1);
    assert_eq!(incomplete(&bytes(&big, REQUEST_MAGIC), &mut 0), Some(big));
}

#[test]
fn library_errors_map_to_nbd_errors() {
    let oor = Error::OutOfRange {
        nsid: 1,
        offset: 0,
        len: 1,
        size: 0,
    };
    assert_eq!(errno(&oor, true), ENOSPC);
    assert_eq!(errno(&oor, false), EINVAL);
    assert_eq!(errno(&Error::ReadOnly { nsid: 1 }, true), EPERM);
    assert_eq!(errno(&Error::Broken, false), EIO);
}
